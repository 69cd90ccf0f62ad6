"""One conformance suite over every limit policy, the way river checks every estimator.

Each policy of :func:`policies` meets the :class:`~phasewise.models.policy.LimitPolicy`
contract the live worker and replay rely on:

- it is deterministic: two instances (same seed) fed the same stream answer the same;
- it never sees the future: its limits for a step do not depend on anything observed at or after
  that step, and asking for limits changes nothing it later answers;
- it leaves its input alone (the worker reuses its arrays and dicts);
- its state round-trips: a pickled copy taken mid-stream answers like the original from there
  on, and where a policy has a JSON state (``to_state`` / ``from_state``) that round-trips too;
- it tolerates missing resources and readings (absent keys), and answers for what it has seen;
- where a policy also exists fleet-vectorised (the VPA recommender, the safety rules), both
  answer the same, number for number (tests/models/vpa/test_vpa_fleet.py and test_guard.py hold the
  randomised equality tests; here each pair runs the same real stream once more).

The stream is real: the AI4DL IBM DLaaS sample's containers (CPU cores, working set bytes).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from phasewise.models.phases.limits import PhasePolicy, ReactiveFallback
from phasewise.models.policy import LimitPolicy
from phasewise.models.scoring.baselines import window_family
from phasewise.models.vpa.recommender import VpaPolicy

SAMPLE = Path(__file__).resolve().parents[2] / "src" / "phasewise" / "data" / "ai4dl_sample.csv"


def real_streams() -> list[list[tuple[float, dict[str, float]]]]:
    """Each AI4DL sample container as (t, usage) steps, in time order."""
    from phasewise.apps.replay.traces import load_trace

    trace = load_trace(str(SAMPLE), "ai4dl")
    out = []
    for c in trace.containers:
        steps = []
        for i, t in enumerate(c.t.tolist()):
            usage = {r: float(u[i]) for r, u in c.usage.items() if math.isfinite(u[i])}
            steps.append((float(t), usage))
        out.append(steps)
    return out


STREAMS = real_streams()
LONGEST = max(STREAMS, key=len)


def policies() -> dict[str, Callable[[], LimitPolicy]]:
    out: dict[str, Callable[[], LimitPolicy]] = {
        "vpa": lambda: VpaPolicy(time_scale=0.01),
        "vpa-lower": lambda: VpaPolicy(bound="lower", time_scale=0.01),
        "reactive-fallback": lambda: ReactiveFallback(),
        "phase": lambda: PhasePolicy(pretrained=False, model_params={"warmup": 8, "seed": 3}),
        "phase-pretrained": lambda: PhasePolicy(pretrained=True),
    }
    out.update(window_family())
    return out


POLICIES = policies()


def run(policy: LimitPolicy, steps) -> list[dict]:
    out = []
    for t, usage in steps:
        out.append(dict(policy.limits(t)))
        policy.observe(t, usage)
    return out


def same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), k
        for r in x:
            if x[r] is None or y[r] is None:
                assert x[r] is y[r], (k, r)
            else:
                assert x[r] == y[r], (k, r, x[r], y[r])


@pytest.mark.parametrize("name", POLICIES)
def test_the_policy_meets_the_contract(name):
    assert isinstance(POLICIES[name](), LimitPolicy)
    assert isinstance(POLICIES[name]().name, str)


@pytest.mark.parametrize("name", POLICIES)
def test_two_instances_fed_the_same_stream_answer_the_same(name):
    same(run(POLICIES[name](), LONGEST), run(POLICIES[name](), LONGEST))


@pytest.mark.parametrize("name", POLICIES)
def test_limits_never_depend_on_the_step_they_limit_or_later(name):
    """Two streams equal up to step k and different after it get the same limits up to k."""
    k = len(LONGEST) // 2
    rng = np.random.default_rng(1)
    other = LONGEST[:k] + [(t, {r: v * float(rng.uniform(0.1, 10.0)) for r, v in u.items()}) for t, u in LONGEST[k:]]
    a, b = run(POLICIES[name](), LONGEST), run(POLICIES[name](), other)
    same(a[:k + 1], b[:k + 1])  # step k's limits come before step k's usage


@pytest.mark.parametrize("name", POLICIES)
def test_asking_for_limits_changes_nothing_later(name):
    asked, quiet = POLICIES[name](), POLICIES[name]()
    for i, (t, usage) in enumerate(LONGEST):
        if i % 3 == 0:
            asked.limits(t)  # an extra question (a live worker asks when a decision is due)
        quiet_limits = quiet.limits(t)
        assert asked.limits(t) == quiet_limits, i
        asked.observe(t, usage)
        quiet.observe(t, usage)


@pytest.mark.parametrize("name", POLICIES)
def test_the_input_is_not_changed(name):
    p = POLICIES[name]()
    for t, usage in LONGEST:
        given = dict(usage)
        p.limits(t)
        p.observe(t, given)
        assert given == usage


@pytest.mark.parametrize("name", POLICIES)
def test_a_copy_taken_mid_stream_answers_like_the_original(name):
    k = len(LONGEST) // 2
    p = POLICIES[name]()
    run(p, LONGEST[:k])
    for clone in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        same(run(clone, LONGEST[k:]), run(copy.deepcopy(p), LONGEST[k:]))


@pytest.mark.parametrize("bound", ["target", "lower", "upper"])
def test_the_vpa_policys_json_state_round_trips_mid_stream(bound):
    import json

    k = len(LONGEST) // 2
    p = VpaPolicy(bound=bound, time_scale=0.01)
    run(p, LONGEST[:k])
    back = VpaPolicy.from_state(json.loads(json.dumps(p.to_state())), bound=bound, time_scale=0.01)
    same(run(back, LONGEST[k:]), run(p, LONGEST[k:]))


@pytest.mark.parametrize("name", POLICIES)
def test_missing_resources_and_readings_are_tolerated(name):
    p = POLICIES[name]()
    seen: set[str] = set()
    for i, (t, usage) in enumerate(LONGEST):
        u = dict(usage)
        if i % 5 == 1:
            u.pop("mem", None)  # a sample without memory
        if i % 7 == 2:
            u.pop("cpu", None)  # an unreadable CPU reading (the contract: a missing reading is an absent key)
        lim = p.limits(t)
        assert set(lim) <= seen | set(LONGEST[0][1]), (i, lim)
        for r, v in lim.items():
            assert v is None or (math.isfinite(v) and v >= 0), (i, r, v)
        p.observe(t, u)
        seen |= set(u)


def test_the_vpa_answers_alike_per_container_and_fleet_vectorised():
    from phasewise.models.vpa.fleet import VpaFleet

    fleet = VpaFleet(time_scale=0.01)
    rows = fleet.add_rows(len(STREAMS))
    singles = [VpaPolicy(time_scale=0.01) for _ in STREAMS]
    times = sorted({t for s in STREAMS for t, _ in s})
    at = [dict(s) for s in STREAMS]
    for t in times:
        here = [i for i, s in enumerate(at) if t in s]
        if not here:
            continue
        r = rows[here]
        cpu, mem = fleet.limits_many(r)
        for j, i in enumerate(here):
            want = singles[i].limits(t)
            for res, got in (("cpu", cpu[j]), ("mem", mem[j])):
                if want.get(res) is None:
                    assert math.isnan(got), (t, i, res)
                else:
                    assert got == pytest.approx(want[res], rel=1e-12), (t, i, res)
        u = [at[i][t] for i in here]
        fleet.observe_many(t, r, np.array([x.get("cpu", np.nan) for x in u]),
                           np.array([x.get("mem", np.nan) for x in u]))
        for i, x in zip(here, u):
            singles[i].observe(t, x)


def test_the_safety_rules_answer_alike_row_by_row_and_vectorised_on_the_real_stream():
    from phasewise.kit.settings import Settings
    from phasewise.models.safety.guard import LimitGuard
    from phasewise.streams.config import guard_config

    cfg = dataclasses.replace(guard_config(Settings()), min_history_s=600, cooldown_s=300, peak_window_s=3600,
                              throttle_window_s=5.0)
    many = LimitGuard(cfg)
    rows = many.add_rows(len(STREAMS))
    ones = [LimitGuard(cfg) for _ in STREAMS]
    one_rows = [g.add_rows(1) for g in ones]
    policies_ = [VpaPolicy(time_scale=0.01) for _ in STREAMS]
    in_force = np.full((len(STREAMS), 2), np.nan)
    for k in range(max(len(s) for s in STREAMS)):
        live = [i for i, s in enumerate(STREAMS) if k < len(s)]
        t = np.array([STREAMS[i][k][0] for i in live])
        u = [STREAMS[i][k][1] for i in live]
        prop = np.array([[policies_[i].limits(t[j]).get(r) or np.nan for r in ("cpu", "mem")]
                         for j, i in enumerate(live)], dtype=float)
        mem = np.array([x.get("mem", np.nan) for x in u])
        many.observe(rows[live], t, mem=mem, throttled_frac=np.zeros(len(live)), oom=np.zeros(len(live)),
                     mem_limit=in_force[live, 1])
        out = many.bound(rows[live], t, prop, in_force[live])
        many.commit(rows[live], t, out)
        for j, i in enumerate(live):
            g, r = ones[i], one_rows[i]
            g.observe(r, t[j], mem=mem[j:j + 1], throttled_frac=np.zeros(1), oom=np.zeros(1),
                      mem_limit=in_force[i:i + 1, 1])
            o = g.bound(r, t[j], prop[j:j + 1], in_force[i:i + 1])
            g.commit(r, t[j], o)
            np.testing.assert_array_equal(o.limits[0], out.limits[j])
            np.testing.assert_array_equal(o.rules[0], out.rules[j])
            policies_[i].observe(t[j], u[j])
        in_force[live] = np.where(out.emit, out.limits, in_force[live])
