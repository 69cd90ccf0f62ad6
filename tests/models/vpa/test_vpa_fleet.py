"""VpaFleet: many VPA recommenders as arrays, equal to VpaPolicy per container bit for bit."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from phasewise.models.vpa.fleet import VpaFleet
from phasewise.models.vpa.histogram import ExponentialBuckets
from phasewise.models.vpa.recommender import VpaPolicy, VpaRecommender, VpaStateError

CPU = ExponentialBuckets(0.01, 1.05, 1000.0)
MEM = ExponentialBuckets(1e7, 1.05, 1e12)
T0 = 1.7e9
NAN = math.nan


def assert_row_equals(fleet: VpaFleet, row: int, policy: VpaPolicy) -> None:
    """Every learned number of the row equals the policy's (exactly)."""
    got, want = fleet.recommender(row), policy.model
    for a, b in ((got._cpu, want._cpu), (got._mem, want._mem)):
        assert a._w == b._w, row
        assert a._total == b._total and a._ref == b._ref, row
    for name in ("_first_t", "_last_t", "_n", "_last_cpu_t", "_last_mem_t", "_window_end", "_mem_peak",
                 "_oom_peak", "_n_oom", "_n_throttled", "_n_mem"):
        assert getattr(got, name) == getattr(want, name), (row, name)
    assert fleet.last_limits(row) == policy._last


def assert_predictions_equal(fleet: VpaFleet, rows: list[int], policies: list[VpaPolicy]) -> None:
    rec = fleet.predict_many(np.array(rows))
    for i, (row, p) in enumerate(zip(rows, policies)):
        want = p.model.predict_one()
        for res in ("cpu", "mem"):
            for bound, v in want[res].items():
                g = float(rec.estimates[res][bound][i])
                if v is None:
                    assert math.isnan(g), (row, res, bound)
                else:
                    assert g == v, (row, res, bound, g, v)
        got, exp = fleet.explain(row, rec, i), p.model.explain()
        assert got == exp and list(got) == list(exp)  # same numbers, same key order


def random_value(rng: random.Random, buckets: ExponentialBuckets, lo: float, hi: float) -> float:
    """Mostly log-uniform; sometimes exactly a bucket start (edge ties) or tiny / zero."""
    u = rng.random()
    if u < 0.15:
        return buckets.start(rng.randrange(1, 120))
    if u < 0.2:
        return rng.choice((0.0, buckets.first * 0.5))
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def random_usage(rng: random.Random) -> dict:
    """A usage dict as VpaPolicy.observe takes it (keys absent = not reported)."""
    u: dict = {}
    u["cpu"] = None if rng.random() < 0.05 else random_value(rng, CPU, 0.01, 8.0)
    u["mem"] = None if rng.random() < 0.05 else random_value(rng, MEM, 1e7, 3e10)
    r = rng.random()
    if r < 0.6:
        u["cpu_limit"] = rng.choice((0.05, 0.5, 1.0, 2.0, 4.0, 0.0))
    if rng.random() < 0.6:
        u["mem_limit"] = rng.choice((2e8, 1e9, 4e9, 0.0))
    if rng.random() < 0.05:
        u["oom"] = rng.choice((1, 3))
    if rng.random() < 0.3:
        u["throttled_frac"] = rng.choice((0.0, 0.05, 0.5, 1.0))
        if rng.random() < 0.7:
            u["throttled_cores"] = rng.choice((0.0, 0.3, 2.5))
    return u


def usage_arrays(usages: list[dict]) -> dict[str, np.ndarray]:
    def col(name: str) -> np.ndarray:
        return np.array([NAN if u.get(name) is None else u[name] for u in usages], dtype=float)

    out = {n: col(n) for n in ("cpu", "mem", "cpu_limit", "mem_limit", "throttled_frac", "throttled_cores")}
    out["oom"] = np.array([u.get("oom", 0) for u in usages], dtype=float)
    return out


def next_time(rng: random.Random, t: float) -> float:
    r = rng.random()
    if r < 0.05:
        return t  # duplicate: the VPA discards its CPU sample
    if r < 0.1:
        return t - rng.uniform(0.1, 100.0)  # out of order
    if r < 0.12:
        return t + rng.uniform(9000.0, 20000.0)  # > 100 half-lives at time_scale 0.001: reference shift
    if r < 0.25:
        return t + rng.uniform(40.0, 200.0)  # across memory aggregation intervals (86.4 s)
    return t + rng.choice((1.0, 0.5, rng.uniform(0.01, 5.0)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fleet_reproduces_vpa_policy_exactly_on_random_irregular_sequences(seed):
    rng = random.Random(seed)
    params = {"time_scale": 0.001}
    n = 30
    fleet = VpaFleet(capacity=4, **params)  # grows while rows are added
    rows: list[int] = []
    policies: list[VpaPolicy] = []
    clocks: list[float] = []
    decided = 0
    for step in range(500):
        if len(rows) < n and rng.random() < 0.3:
            rows.append(int(fleet.add_rows(1)[0]))
            policies.append(VpaPolicy(**params))
            clocks.append(T0 + rng.uniform(0, 100.0))
        if not rows:
            continue
        pick = rng.sample(range(len(rows)), rng.randint(1, len(rows)))
        ts, usages = [], []
        for i in pick:
            clocks[i] = next_time(rng, clocks[i])
            ts.append(clocks[i])
            usages.append(random_usage(rng))
        for i, t, u in zip(pick, ts, usages):
            policies[i].observe(t, u)
        a = usage_arrays(usages)
        fleet.observe_many(np.array(ts), np.array([rows[i] for i in pick]), a["cpu"], a["mem"],
                           cpu_limit=a["cpu_limit"], mem_limit=a["mem_limit"], oom=a["oom"],
                           throttled_frac=a["throttled_frac"], throttled_cores=a["throttled_cores"])
        ask = [i for i in pick if rng.random() < 0.5]
        if ask:
            cpu, mem = fleet.limits_many(np.array([rows[i] for i in ask]))
            for j, i in enumerate(ask):
                want = policies[i].limits(clocks[i])
                got = {"cpu": None if math.isnan(cpu[j]) else float(cpu[j]),
                       "mem": None if math.isnan(mem[j]) else float(mem[j])}
                assert got == want, (step, i)
                decided += want["cpu"] is not None
        if step % 25 == 0:
            for i, row in enumerate(rows):
                assert_row_equals(fleet, row, policies[i])
                assert fleet.recommender_state(row) == policies[i].model.to_state()
            assert_predictions_equal(fleet, rows, policies)
        if step % 40 == 39:  # a restart: both sides reload the (lossy) stored state
            i = rng.randrange(len(rows))
            state = json.loads(json.dumps(policies[i].to_state()))
            policies[i] = VpaPolicy.from_state(state, **params)
            fleet.load_recommender_state(rows[i], state["m"], state["l"])
    for i, row in enumerate(rows):
        assert_row_equals(fleet, row, policies[i])
    assert_predictions_equal(fleet, rows, policies)
    # the sequences exercised what they are meant to
    models = [p.model for p in policies]
    assert decided > 100
    assert sum(m._n_oom for m in models) > 0 and sum(m._n_throttled for m in models) > 0
    assert max(m._n_mem for m in models) > 5


def test_reference_shifts_and_tied_power_of_two_weights_match():
    """Memory peaks one interval apart weigh exact powers of two, so percentile thresholds tie."""
    params = {"time_scale": 0.001}
    fleet = VpaFleet(**params)
    rows = fleet.add_rows(3)
    ref = [VpaPolicy(**params) for _ in range(3)]
    hl = 86.4
    t = T0
    for k in range(400):
        t += hl if k % 50 else 120 * hl  # every 50th step jumps past 100 half-lives
        mems = [MEM.start(40 + (k % 3)), MEM.start(40 + (k % 2)), MEM.start(60 - (k % 4))]
        for p, m in zip(ref, mems):
            p.observe(t, {"cpu": 1.0, "mem": m})
        fleet.observe_many(t, rows, np.ones(3), np.array(mems))
        cpu, mem = fleet.limits_many(rows)
        for j, p in enumerate(ref):
            want = p.limits(t)
            assert (float(cpu[j]), float(mem[j])) == (want["cpu"], want["mem"]), k
    for j, p in enumerate(ref):
        assert_row_equals(fleet, int(rows[j]), p)


def test_state_round_trips_through_the_recommender_format():
    params = {"time_scale": 0.001}
    p = VpaPolicy(**params)
    rng = random.Random(5)
    t = T0
    for _ in range(300):
        t = next_time(rng, t)
        p.observe(t, random_usage(rng))
    p.limits(t)
    state = json.loads(json.dumps(p.to_state()))
    fleet = VpaFleet(**params)
    row = int(fleet.add_rows(2)[1])
    fleet.load_recommender_state(row, state["m"], state["l"])
    loaded = VpaPolicy.from_state(state, **params)
    assert_row_equals(fleet, row, loaded)
    assert fleet.recommender_state(row) == loaded.model.to_state() == state["m"]
    # an exact copy back and forth
    again = VpaFleet(**params)
    r2 = int(again.add_rows(1)[0])
    again.load_recommender(r2, fleet.recommender(row))
    assert again.recommender(r2)._cpu._w == loaded.model._cpu._w


def test_a_malformed_state_is_refused_and_leaves_the_row_alone():
    fleet = VpaFleet()
    (row,) = fleet.add_rows(1).tolist()
    fleet.observe_many(T0, np.array([row]), np.array([1.0]), np.array([5e8]))
    before = fleet.recommender_state(row)
    with pytest.raises(VpaStateError):
        fleet.load_recommender_state(row, {"v": 99})
    with pytest.raises(VpaStateError):
        fleet.load_recommender_state(row, VpaRecommender().to_state(), last=[1.0])
    assert fleet.recommender_state(row) == before


def test_bad_samples_raise_before_anything_is_learned():
    fleet = VpaFleet()
    rows = fleet.add_rows(2)
    with pytest.raises(ValueError, match="cpu must be a finite number"):
        fleet.observe_many(T0, rows, np.array([1.0, -1.0]), np.array([1e8, 1e8]))
    with pytest.raises(ValueError, match="sample time must be finite"):
        fleet.observe_many(np.array([T0, math.inf]), rows, np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="distinct"):
        fleet.observe_many(T0, np.array([0, 0]), np.ones(2), np.ones(2))
    assert fleet.samples(0) == fleet.samples(1) == 0


def test_cleared_rows_are_reused_with_fresh_state():
    fleet = VpaFleet()
    rows = fleet.add_rows(2)
    fleet.observe_many(T0, rows, np.ones(2), np.full(2, 5e8))
    fleet.limits_many(rows)
    fleet.clear()
    assert len(fleet) == 0
    rows = fleet.add_rows(1)
    assert fleet.samples(int(rows[0])) == 0 and fleet.recommender_state(0) == VpaRecommender().to_state()
    assert fleet.last_limits(0) == {"cpu": None, "mem": None}


def test_a_row_takes_about_three_kibibytes():
    assert 2500 < VpaFleet().bytes_per_row() < 3500


def test_loaded_sub_epsilon_weights_count_as_the_reference_counts_them():
    """A checkpoint of light buckets loads below epsilon: in the percentile span they still add up."""
    params = {"time_scale": 0.001}
    ref_t = round(T0 / 86.4) * 86.4
    state = VpaRecommender(**params).to_state()
    # weights 10000 : 1 : 3 scaled to a total of 0.5: the light ones land below epsilon (1e-4)
    state["c"] = {"r": ref_t, "t": 0.5, "b": [20, 1, 5, 10000, 3, 3, 40, 1]}
    state["m"] = {"r": ref_t, "t": 0.002, "b": [30, 10000, 2, 1, 1, 2]}
    state.update({"f": T0 - 50, "l": T0, "n": 50, "lc": T0, "lm": T0, "we": T0 + 30.0, "mp": MEM.start(31),
                  "op": 0.0, "nm": 1})
    rng = random.Random(11)
    fleet = VpaFleet(**params)
    rows = fleet.add_rows(4)
    policies = []
    for row in rows.tolist():
        fleet.load_recommender_state(row, state)
        policies.append(VpaPolicy.from_state({"m": state}, **params))
    assert fleet._cpu.subeps[rows].all() and fleet._mem.subeps[rows].all()
    t = T0
    for step in range(300):
        t += rng.choice((1.0, 3.0, 50.0, 9000.0))
        usages = [random_usage(rng) for _ in policies]
        for p, u in zip(policies, usages):
            p.observe(t, u)
        a = usage_arrays(usages)
        fleet.observe_many(t, rows, a["cpu"], a["mem"], cpu_limit=a["cpu_limit"], mem_limit=a["mem_limit"],
                           oom=a["oom"], throttled_frac=a["throttled_frac"], throttled_cores=a["throttled_cores"])
        if step % 3 == 0:
            cpu, mem = fleet.limits_many(rows)
            for j, p in enumerate(policies):
                want = p.limits(t)
                assert (_none(cpu[j]), _none(mem[j])) == (want["cpu"], want["mem"]), step
        if step < 5 or step % 50 == 0:
            for j, p in enumerate(policies):
                assert_row_equals(fleet, int(rows[j]), p)
            assert_predictions_equal(fleet, rows.tolist(), policies)


def _none(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


def test_a_sub_epsilon_bucket_before_the_first_non_empty_one_does_not_count():
    """The reference walks from the first bucket >= epsilon: lighter buckets before it are skipped."""
    r = VpaRecommender()
    r._cpu._w = {20: 5e-5, 25: 0.5, 30: 0.5}  # p50 threshold 0.500025: reached at 30, not 25
    r._cpu._total = 1.00005
    r._cpu._ref = 0.0
    r._n, r._first_t, r._last_t = 10, 0.0, 600.0
    other = VpaRecommender()  # batched with a row whose buckets start lower (bucket 20 is in the window)
    other.learn_one({"t": 0.0, "cpu": CPU.start(10)})
    fleet = VpaFleet()
    rows = fleet.add_rows(2)
    fleet.load_recommender(0, r)
    fleet.load_recommender(1, other)
    got = fleet.predict_many(rows)
    assert got.percentiles["cpu"][0].tolist() == [r._cpu.percentile(q) for q in (0.5, 0.9, 0.95)]
    assert got.percentiles["cpu"][0, 0] == CPU.end(30)
    assert got.percentiles["cpu"][1].tolist() == [other._cpu.percentile(q) for q in (0.5, 0.9, 0.95)]


def test_a_fresh_oom_just_before_an_interval_boundary_is_recorded_as_the_reference_records_it():
    """kubernetes/autoscaler#8548: staleness is measured from the last memory sample, not the window end."""
    fleet = VpaFleet()
    rows = fleet.add_rows(3)
    ref = [VpaPolicy() for _ in range(3)]
    day = 86400.0
    # row 0: the upstream case (samples at T0 and T0 + 1 day, OOM 1 s before the second);
    # row 1: an OOM more than a day before its last memory sample (discarded);
    # row 2: no memory sample yet (always recorded)
    steps = [(T0, [1e8, 1e8, NAN], [0, 0, 0]),
             (T0 + day, [2e9, 2e9, NAN], [0, 0, 0]),
             (T0 + day - 1, [NAN, NAN, NAN], [1, 0, 1]),
             (T0 - 1, [NAN, NAN, NAN], [0, 1, 0])]
    for t, mem, oom in steps:
        fleet.observe_many(t, rows, np.full(3, NAN), np.array(mem), mem_limit=np.full(3, 1e9),
                           oom=np.array(oom, dtype=float))
        for j, p in enumerate(ref):
            u = {"mem_limit": 1e9, "oom": oom[j]}
            if not math.isnan(mem[j]):
                u["mem"] = mem[j]
            p.observe(t, u)
    for j, p in enumerate(ref):
        assert_row_equals(fleet, int(rows[j]), p)
    r0, r1, r2 = (fleet.recommender(int(r)) for r in rows)
    assert r0._n_oom == 1 and r0._oom_peak == 2e9 * 1.2 and r0._window_end == T0 + 2 * day
    assert r1._n_oom == 0 and r1._oom_peak == 0.0
    assert r2._n_oom == 1


def test_a_version_1_state_loads_into_the_fleet_as_into_the_recommender():
    params = {"time_scale": 0.001}
    p = VpaPolicy(**params)
    for i in range(500):
        p.observe(T0 + i, {"cpu": 0.5 + (i % 7) * 0.1, "mem": 5e8})
    state = json.loads(json.dumps(p.model.to_state()))
    v1 = {**state, "v": 1, "c": {**state["c"], "t": state["c"]["t"] * 40.0}}
    fleet = VpaFleet(**params)
    row = int(fleet.add_rows(1)[0])
    fleet.load_recommender_state(row, v1)
    want = VpaRecommender.from_state(v1, **params)
    assert fleet.recommender_state(row) == want.to_state()
    assert fleet.recommender_state(row)["v"] == 2


def test_two_rows_of_the_fleet_equal_a_vpa_policy_each_after_ten_minutes_of_samples():
    """The module's former example: the fleet's limit equals VpaPolicy's, number for number."""
    fleet = VpaFleet(time_scale=0.001)
    rows = fleet.add_rows(2)
    ref = VpaPolicy(time_scale=0.001)
    for t in range(600):
        fleet.observe_many(float(t), rows, cpu=np.array([0.5, 1.0]), mem=np.array([3e8, 6e8]))
        ref.observe(float(t), {"cpu": 0.5, "mem": 3e8})
    cpu, _ = fleet.limits_many(rows)
    assert float(cpu[0]) == ref.limits(600.0)["cpu"]
    assert round(float(cpu[1]), 3) == 1.169
