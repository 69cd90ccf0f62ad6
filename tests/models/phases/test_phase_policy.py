"""PhasePolicy: fallback while cold, floors, phase limits, agreement with the batched detector."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.models.phases.detector import PhaseModel, Windows, detect, learn
from phasewise.models.phases.limits import PhasePolicy, ReactiveFallback
from phasewise.models.policy import LimitPolicy


class Const:
    """A fixed reactive stand-in: any LimitPolicy can be the fallback."""

    name = "const"

    def __init__(self, cpu: float = 4.0, mem: float = 8e9) -> None:
        self.lim = {"cpu": cpu, "mem": mem}
        self.seen = 0

    def limits(self, t):
        return dict(self.lim)

    def observe(self, t, usage):
        self.seen += 1

    def explain(self):
        return {}


def on_off(t: int) -> dict:
    busy = (t // 25) % 2 == 1
    return {"cpu": 1.0 if busy else 0.02, "mem": 9e8 if busy else 2e8}


def drive(p: LimitPolicy, n: int, usage=on_off):
    out = []
    for t in range(n):
        out.append((p.limits(float(t)), p.explain()))
        p.observe(float(t), usage(t))
    return out


def test_it_meets_the_limit_policy_contract():
    assert isinstance(PhasePolicy(fallback=Const()), LimitPolicy)
    assert isinstance(ReactiveFallback(), LimitPolicy)


def test_falls_back_while_cold_and_feeds_the_fallback_every_sample():
    fb = Const()
    p = PhasePolicy(fallback=fb, pretrained=False, model_params={"warmup": 10_000})
    for lim, exp in drive(p, 60):
        assert lim == {"cpu": 4.0, "mem": 8e9}
        assert exp["source"] == "fallback" and exp["warm"] is False
    assert fb.seen == 60


def test_becomes_phase_driven_once_warm_and_explains_the_phase_and_statistics():
    p = PhasePolicy(fallback=Const(), pretrained=False, model_params={"warmup": 16})
    out = drive(p, 300)
    lim, exp = out[-1]
    assert exp["source"] == "phase" and isinstance(exp["phase"], int)
    assert set(exp["stats"]) == {"cpu", "mem"} and exp["stats"]["cpu"]["count"] >= 10
    # phase limits are far below the constant fallback for this workload
    assert lim["cpu"] < 2.0 and lim["mem"] < 2e9


def test_limits_are_never_below_the_floors():
    floors = {"cpu": 0.5, "mem": 5e8}
    rng = np.random.default_rng(0)
    p = PhasePolicy(fallback=Const(cpu=0.0, mem=0.0), floors=floors, pretrained=False,
                    model_params={"warmup": 16})
    out = drive(p, 300, usage=lambda t: {"cpu": float(rng.uniform(0, 0.1)), "mem": float(rng.uniform(1e6, 1e7))})
    assert any(e["source"] == "phase" for _, e in out)
    for lim, _ in out:
        assert lim["cpu"] >= 0.5 and lim["mem"] >= 5e8


def test_a_new_phase_uses_the_fallback_until_it_has_enough_samples():
    p = PhasePolicy(fallback=Const(), pretrained=False, min_phase_samples=10**6, model_params={"warmup": 16})
    for lim, _ in drive(p, 200):
        assert lim == {"cpu": 4.0, "mem": 8e9}


def test_phase_limits_cover_an_on_off_workload_with_less_allocation_than_a_window_max():
    from phasewise.models.scoring.baselines import WindowPolicy

    def score(p):
        alloc = used = ok = steps = 0.0
        for t in range(1500):
            lim = p.limits(float(t))
            u = on_off(t)
            p.observe(float(t), u)
            if t >= 300 and lim.get("cpu") is not None:
                alloc += lim["cpu"]
                used += u["cpu"]
                ok += u["cpu"] <= lim["cpu"]
                steps += 1
        return alloc / used, ok / steps

    phase = score(PhasePolicy(fallback=Const(), pretrained=False, model_params={"warmup": 64}))
    window = score(WindowPolicy(window=30, stat="max"))
    assert phase[1] >= 0.95
    assert phase[0] < window[0]


def test_a_frozen_policy_sees_the_same_phases_as_the_batched_detector():
    rng = np.random.default_rng(1)
    m = PhaseModel(features=("cpu", "mem"), warmup=32, seed=0)
    w = Windows(m.window_len, 2)
    for t in range(200):
        u = on_off(t)
        res = detect(m, w, ["train"], np.array([[u["cpu"], u["mem"]]]), float(t))
        learn(m, res.windows, stats_phases=res.prev_phase, usage=np.array([[u["cpu"], u["mem"]]]))
    assert m.ready
    n = 5
    offsets = rng.integers(0, 50, n)
    series = [[on_off(t + int(o)) for t in range(120)] for o in offsets]
    policies = [PhasePolicy(fallback=Const(), model=m, learn=False) for _ in range(n)]
    per_policy = [[] for _ in range(n)]
    batched = []
    bw = Windows(m.window_len, 2)
    ids = [f"c{i}" for i in range(n)]
    for t in range(120):
        for i, p in enumerate(policies):
            p.limits(float(t))
            p.observe(float(t), series[i][t])
            per_policy[i].append(p.explain()["phase"])
        X = np.array([[series[i][t]["cpu"], series[i][t]["mem"]] for i in range(n)])
        ph = detect(m, bw, ids, X, float(t)).phase
        batched.append([int(v) if v >= 0 else None for v in ph])
    assert [list(r) for r in zip(*per_policy)] == batched


# ---------------------------------------------------------------- the shipped pretrained model


def _ai4dl():
    from phasewise.apps.replay.traces import load_trace, sample_path

    return load_trace(sample_path(), "ai4dl")


@pytest.mark.parametrize("name", ["corpus", "ai4dl"])
def test_each_shipped_pretrained_model_loads_warm_with_both_kinds_of_phase_statistics(name):
    from phasewise.models.phases.limits import PRETRAINED, load_pretrained

    m = load_pretrained(PRETRAINED[name])
    assert m is not None and m.ready and m.features == ("cpu", "mem")
    counts = [m.clusterer.rel_stats.count(m.clusterer.slot_of(p)).sum() for p in m.clusterer.phase_ids]
    assert sum(counts) > 0  # relative statistics shipped, not only absolute ones


def test_the_default_start_is_the_corpus_model_and_an_unknown_one_is_refused():
    assert PhasePolicy().pretrained_model == "corpus"
    with pytest.raises(ValueError, match="pretrained_model must be one of"):
        PhasePolicy(pretrained_model="imagenet")


def test_on_the_ai4dl_sample_the_phase_policy_runs_warm_from_the_pretrained_model_and_stays_causal():
    from phasewise.apps.replay.driving import decision_sequence

    trace = _ai4dl()
    c = max(trace.containers, key=len)
    policy = PhasePolicy()
    seq, exps = decision_sequence(policy, c, explain=True)
    assert policy.warm_start.startswith("pretrained corpus_cpu_mem.pwck")  # (it never saw the AI4DL sample)
    assert exps[1]["warm"]  # warm from the first observation on (the model is built on it)
    assert any(e["source"] == "phase" for e in exps)  # phase statistics set limits from the start of the run
    # causal: change the usage from step k on; every limit up to and including step k is the same
    k = len(c) // 2
    from phasewise.apps.replay.traces import ContainerSeries

    changed = ContainerSeries(c.container, c.t, {r: np.where(np.arange(len(u)) >= k, u * 5.0, u)
                                                  for r, u in c.usage.items()})
    seq2 = decision_sequence(PhasePolicy(), changed)
    assert seq2[: k + 1] == seq[: k + 1] and seq2 != seq


def test_the_pretrained_shared_fleet_with_relative_statistics_is_causal_on_the_ai4dl_sample():
    from phasewise.apps.replay.driving import FleetOptions, _fleet_run
    from phasewise.apps.replay.traces import ContainerSeries, Trace
    from phasewise.models.phases.limits import load_pretrained

    trace = _ai4dl()
    seqs = _fleet_run(trace, FleetOptions(), load_pretrained())
    first = trace.containers[0]
    assert any(lim for _, lim in seqs[first.container][1:4])  # limits from the first steps on
    k = len(first) // 2
    changed = ContainerSeries(first.container, first.t, {r: np.where(np.arange(len(u)) >= k, u * 5.0, u)
                                                          for r, u in first.usage.items()})
    other = Trace(trace.format, trace.source, trace.units, [changed, *trace.containers[1:]])
    seqs2 = _fleet_run(other, FleetOptions(), load_pretrained())
    assert seqs2[first.container][: k + 1] == seqs[first.container][: k + 1]
