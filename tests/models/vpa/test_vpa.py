"""The VPA recommender and policy, against numbers computed by hand from VPA's rules."""

from __future__ import annotations

import json
import math
import random

import pytest

from phasewise.models.policy import LimitPolicy
from phasewise.models.vpa.histogram import ExponentialBuckets
from phasewise.models.vpa.recommender import (
    ConfidenceMultiplier,
    MarginEstimator,
    MinResourceEstimator,
    VpaPolicy,
    VpaRecommender,
    VpaStateError,
)

CPU = ExponentialBuckets(0.01, 1.05, 1000.0)
MEM = ExponentialBuckets(1e7, 1.05, 1e12)
MIB = 2**20
T0 = 1.7e9


def cpu_end(v: float) -> float:
    """End of the CPU bucket holding *v*: what a percentile landing there returns."""
    return CPU.start(CPU.find_bucket(v) + 1)


def mem_end(v: float) -> float:
    return MEM.start(MEM.find_bucket(v) + 1)


def steady(r: VpaRecommender, n: int, step: float, **x) -> None:
    for i in range(n):
        r.learn_one({"t": T0 + step * i, **x})


def test_a_steady_one_core_gives_the_bucket_end_plus_15_percent():
    r = VpaRecommender()
    steady(r, 120, 60.0, cpu=1.0, mem=5e8, cpu_limit=2.0)  # two hours, one sample a minute
    rec = r.predict_one()
    assert cpu_end(1.0) == pytest.approx(1.016281, rel=1e-6)
    assert rec["cpu"]["target"] == pytest.approx(cpu_end(1.0) * 1.15)
    # confidence = min(7140 s / 1 day, 120 samples / 1440) = 0.082639
    c = min(7140 / 86400, 120 / 1440)
    assert r.confidence() == pytest.approx(c)
    assert rec["cpu"]["upper"] == pytest.approx(cpu_end(1.0) * 1.15 * (1 + 1 / c))
    assert rec["cpu"]["lower"] == pytest.approx(cpu_end(1.0) * 1.15 * (1 + 0.001 / c) ** -2)
    # one memory peak (first window): all three bounds read the same bucket
    assert rec["mem"]["target"] == pytest.approx(mem_end(5e8) * 1.15)


def test_time_scale_shrinks_the_day_behind_the_confidence():
    r = VpaRecommender(time_scale=0.001)  # a "day" is 86.4 s
    steady(r, 120, 60.0, cpu=1.0, cpu_limit=2.0)
    # lifespan 7140 / 86.4 = 82.6 days; samples 120 / 1.44 = 83.3
    assert r.confidence() == pytest.approx(7140 / 86.4)
    assert r.predict_one()["cpu"]["upper"] == pytest.approx(cpu_end(1.0) * 1.15 * (1 + 86.4 / 7140))


def test_with_no_history_the_upper_bound_is_infinite_and_the_lower_bound_the_floor():
    r = VpaRecommender()
    r.learn_one({"t": T0, "cpu": 1.0, "mem": 5e8})
    rec = r.predict_one()
    assert rec["cpu"]["upper"] == math.inf
    assert rec["cpu"]["lower"] == 0.025  # base * 0 -> floor
    assert rec["cpu"]["target"] == pytest.approx(cpu_end(1.0) * 1.15)


def test_recommendations_never_go_below_the_floors():
    r = VpaRecommender()
    steady(r, 10, 60.0, cpu=0.001, mem=1e6)
    rec = r.predict_one()
    assert rec["cpu"]["target"] == 0.025 and rec["mem"]["target"] == 250 * MIB
    r2 = VpaRecommender(min_cpu_cores=0.005, min_mem_bytes=1e6)
    steady(r2, 10, 60.0, cpu=0.001, mem=1e6)
    assert r2.predict_one()["cpu"]["target"] == pytest.approx(0.01 * 1.15)  # end of bucket 0


def test_no_samples_means_no_opinion():
    rec = VpaRecommender().predict_one()
    assert rec == {"cpu": {"target": None, "lower": None, "upper": None},
                   "mem": {"target": None, "lower": None, "upper": None}}


def test_every_cpu_sample_weighs_0_1_whatever_the_limit_in_force():
    r = VpaRecommender()
    r.learn_one({"t": T0, "cpu": 0.5, "cpu_limit": 4.0})
    r.learn_one({"t": T0, "cpu": 0.6})  # a duplicate time: discarded
    r.learn_one({"t": T0 + 1, "cpu": 2.0})  # unlimited
    r.learn_one({"t": T0 + 2, "cpu": 3.0, "cpu_limit": 0.05})
    hl = 86400.0
    ref = math.floor(T0 / hl + 0.5) * hl
    want = {CPU.find_bucket(v): 0.1 * 2.0 ** ((t - ref) / hl) for v, t in ((0.5, T0), (2.0, T0 + 1), (3.0, T0 + 2))}
    assert r._cpu.weights() == want
    # p90 threshold = 0.9 * the total lies past the first two of three equal weights: 3.0's bucket
    assert r.predict_one()["cpu"]["target"] == pytest.approx(cpu_end(3.0) * 1.15)


def test_the_policys_own_limits_do_not_feed_back_into_its_cpu_percentiles():
    def run(first_limit: float | None) -> list[float | None]:
        p = VpaPolicy(time_scale=0.001)
        out = []
        for i in range(300):
            out.append(p.limits(float(i)))
            usage = {"cpu": 0.2 if i % 10 else 3.0, "mem": 5e8}
            if i == 0 and first_limit is not None:
                usage["cpu_limit"] = first_limit
            p.observe(float(i), usage)
        return [o["cpu"] for o in out]

    assert run(None) == run(64.0)  # a 64-core limit once weighed 640 samples


def test_duplicate_and_out_of_order_cpu_samples_are_discarded():
    r = VpaRecommender()
    r.learn_one({"t": T0 + 10, "cpu": 1.0})
    r.learn_one({"t": T0 + 10, "cpu": 3.0})
    r.learn_one({"t": T0 + 5, "cpu": 3.0})
    assert r.samples == 1
    assert r.predict_one()["cpu"]["target"] == pytest.approx(cpu_end(1.0) * 1.15)


def test_a_larger_memory_sample_replaces_the_peak_of_its_window():
    r = VpaRecommender()
    r.learn_one({"t": T0, "mem": 1e9})
    r.learn_one({"t": T0 + 1000, "mem": 2e9})  # same 24 h window: replaces 1e9
    r.learn_one({"t": T0 + 2000, "mem": 1.5e9})  # smaller: ignored
    r.learn_one({"t": T0 - 50, "mem": 9e9})  # older than the last sample: discarded
    assert list(r._mem.weights()) == [MEM.find_bucket(2e9)]
    assert r._mem.total_weight == pytest.approx(r._mem.weights()[MEM.find_bucket(2e9)])
    assert r.predict_one()["mem"]["target"] == pytest.approx(mem_end(2e9) * 1.15)
    # the next window starts a new peak: two peaks of (nearly) equal weight
    r.learn_one({"t": T0 + 86400 + 5, "mem": 5e8})
    assert sorted(r._mem.weights()) == [MEM.find_bucket(5e8), MEM.find_bucket(2e9)]
    assert r._window_end == T0 + 2 * 86400
    # peaks sit at their windows' ends, one day apart: the newer one weighs twice as much
    w = r._mem.weights()
    assert w[MEM.find_bucket(5e8)] == pytest.approx(2 * w[MEM.find_bucket(2e9)])
    assert r._mem.percentile(0.5) == mem_end(5e8)  # 2/3 of the weight is in 5e8's bucket
    assert r.predict_one()["mem"]["target"] == pytest.approx(mem_end(2e9) * 1.15)  # p90 needs 2e9's


def test_an_oom_kill_bumps_memory_by_20_percent_or_100_mib():
    r = VpaRecommender()
    r.learn_one({"t": T0, "mem": 1e9, "oom": 1, "mem_limit": 1e9})
    # used = max(limit 1e9, peak 1e9); needed = max(1e9 + 100 MiB, 1.2e9) = 1.2e9
    assert list(r._mem.weights()) == [MEM.find_bucket(1.2e9)]
    assert r.predict_one()["mem"]["target"] == pytest.approx(mem_end(1.2e9) * 1.15)
    small = VpaRecommender()
    small.learn_one({"t": T0, "mem": 2e8, "oom": 1, "mem_limit": 2e8})
    # needed = max(2e8 + 104857600, 2.4e8) = 304857600
    assert list(small._mem.weights()) == [MEM.find_bucket(304857600)]
    assert small.explain()["oom_events"] == 1


def test_an_oom_more_than_an_interval_before_the_last_memory_sample_is_discarded():
    r = VpaRecommender()
    r.learn_one({"t": T0, "mem": 1e9})
    r.learn_one({"t": T0 + 3 * 86400, "mem": 1e9})  # window now ends at T0 + 4 days
    assert r.record_oom(T0 + 86400, 1e9) is False
    assert r.record_oom(T0 + 3 * 86400 + 10, 1e9) is True


def test_a_throttled_sample_is_recorded_above_the_limit():
    r = VpaRecommender()
    r.learn_one({"t": T0, "cpu": 0.5, "cpu_limit": 0.5, "throttled_frac": 0.9})
    # true demand unseen: recorded as 0.5 * (1 + 0.5) = 0.75
    assert r.predict_one()["cpu"]["target"] == pytest.approx(cpu_end(0.75) * 1.15)
    assert r.explain()["throttled_samples"] == 1
    # with the throttled time known, the sample is the demand: usage + held-back cores
    r2 = VpaRecommender()
    r2.learn_one({"t": T0, "cpu": 0.25, "cpu_limit": 0.25, "throttled_frac": 1.0, "throttled_cores": 0.75})
    assert r2.predict_one()["cpu"]["target"] == pytest.approx(cpu_end(1.0) * 1.15)
    calm = VpaRecommender()
    calm.learn_one({"t": T0, "cpu": 0.5, "cpu_limit": 0.5, "throttled_frac": 0.05})
    assert calm.predict_one()["cpu"]["target"] == pytest.approx(cpu_end(0.5) * 1.15)


def test_estimators_compose_by_wrapping():
    def const(s):
        return 2.0
    r = VpaRecommender()
    steady(r, 1440, 60.0, cpu=1.0)  # exactly one day of one sample a minute: confidence ~1
    c = r.confidence()
    assert c == pytest.approx(1439 / 1440)
    assert MarginEstimator(0.15, const)(r) == pytest.approx(2.3)
    assert ConfidenceMultiplier(1.0, 1.0, 86400.0, const)(r) == pytest.approx(2.0 * (1 + 1 / c))
    assert ConfidenceMultiplier(0.001, -2.0, 86400.0, const)(r) == pytest.approx(2.0 * (1 + 0.001 / c) ** -2)
    assert MinResourceEstimator(3.0, const)(r) == 3.0 and MinResourceEstimator(1.0, const)(r) == 2.0


def test_bad_samples_raise_clear_errors():
    r = VpaRecommender()
    with pytest.raises(ValueError, match="cpu"):
        r.learn_one({"t": T0, "cpu": math.nan})
    with pytest.raises(ValueError, match="mem"):
        r.learn_one({"t": T0, "mem": -1.0})
    with pytest.raises(ValueError, match="time"):
        r.learn_one({"t": math.inf, "cpu": 1.0})


def test_state_round_trips_and_stays_under_4_kib_after_10k_samples():
    rng = random.Random(3)
    r = VpaRecommender(time_scale=0.01)
    for i in range(10_000):
        r.learn_one({"t": T0 + 5.0 * i, "cpu": max(0.0, rng.gauss(2.0, 0.8)), "mem": rng.uniform(1e8, 8e9),
                     "cpu_limit": 4.0, "throttled_frac": rng.random() * 0.2, "oom": int(rng.random() < 0.01),
                     "mem_limit": 8e9})
    blob = json.dumps(r.to_state(), separators=(",", ":"))
    assert len(blob) < 4096
    back = VpaRecommender.from_state(json.loads(blob), time_scale=0.01)
    rec, rec2 = r.predict_one(), back.predict_one()
    for res in ("cpu", "mem"):
        for b in ("target", "lower", "upper"):
            assert rec2[res][b] == pytest.approx(rec[res][b], rel=1e-9)
    # learning continues identically after a restore
    for m in (r, back):
        m.learn_one({"t": T0 + 5.0 * 10_000, "cpu": 9.0, "mem": 9e9, "cpu_limit": 4.0})
    assert back.predict_one()["cpu"]["target"] == pytest.approx(r.predict_one()["cpu"]["target"])


def test_a_state_of_another_version_is_rejected():
    state = VpaRecommender().to_state()
    with pytest.raises(VpaStateError, match="version"):
        VpaRecommender.from_state({**state, "v": 99})
    with pytest.raises(VpaStateError, match="malformed"):
        VpaRecommender.from_state({"v": state["v"], "c": state["c"]})
    with pytest.raises(VpaStateError, match="malformed"):
        VpaRecommender.from_state({"v": 1, "c": state["c"]})


def test_a_version_1_state_loads_with_its_cpu_history_weighed_as_version_2_weighs_it():
    """v1 weighted CPU samples by the limit in force: its total is rescaled, its bucket proportions kept."""
    def fed(n: int, step: float) -> VpaRecommender:
        r = VpaRecommender(time_scale=0.001)
        for i in range(n):
            r.learn_one({"t": T0 + step * i, "cpu": 0.5 + (i % 5) * 0.3, "mem": 5e8})
        return r

    for n, step in ((1, 1.0), (400, 1.0), (400, 30.0)):  # 30 s steps: 139 half-lives, a reference shift
        r = fed(n, step)
        state = json.loads(json.dumps(r.to_state()))
        # the same samples under a constant 4-core limit, as version 1 stored them
        v1 = {**state, "v": 1, "c": {**state["c"], "t": state["c"]["t"] * 40.0}}
        back = VpaRecommender.from_state(v1, time_scale=0.001)
        v2 = VpaRecommender.from_state(state, time_scale=0.001)
        assert back._cpu.total_weight == pytest.approx(v2._cpu.total_weight, rel=1e-6)
        for res in ("cpu", "mem"):
            assert back.predict_one()[res] == pytest.approx(v2.predict_one()[res], rel=1e-12)
        assert back.to_state()["v"] == 2


def test_the_policy_meets_the_limit_policy_contract_and_sees_only_the_past():
    p = VpaPolicy(time_scale=0.001)
    assert isinstance(p, LimitPolicy) and p.name == "vpa"
    assert p.limits(0.0) == {"cpu": None, "mem": None}
    for t in range(100):
        p.limits(float(t))
        p.observe(float(t), {"cpu": 1.0, "mem": 5e8})
    before_spike = p.limits(100.0)
    assert before_spike["cpu"] == pytest.approx(cpu_end(1.0) * 1.15)
    p.observe(100.0, {"cpu": 50.0, "mem": 5e8})  # the spike arrives after limits(100) was given
    assert before_spike["cpu"] == pytest.approx(cpu_end(1.0) * 1.15)
    assert p.explain()["cpu_samples"] == 101 and p.explain()["bound"] == "target"


def test_the_policy_has_no_opinion_on_resources_vpa_does_not_manage():
    p = VpaPolicy()
    p.limits(0.0)
    p.observe(0.0, {"cpu": 1.0, "mem": 5e8, "gpu": 80.0})
    lim = p.limits(1.0)
    assert lim["gpu"] is None and lim["cpu"] is not None


def test_the_policy_hides_infinite_bounds():
    p = VpaPolicy(bound="upper")
    p.limits(0.0)
    p.observe(0.0, {"cpu": 1.0})
    assert p.limits(1.0)["cpu"] is None  # upper bound with no history is infinite: no opinion
    with pytest.raises(ValueError):
        VpaPolicy(bound="median")
