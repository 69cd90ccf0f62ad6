"""PhaseFleet: batched phase limits for many containers over one shared model."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.models.phases.detector import PhaseModel, learn
from phasewise.models.phases.fleet import PhaseFleet, phase_limits, pick_every_k

IDLE = np.array([0.02, 2e8])
BUSY = np.array([1.0, 9e8])


def trained_model() -> PhaseModel:
    """A ready model with two phases (idle, busy) and no usage statistics yet."""
    m = PhaseModel(features=("cpu", "mem"), n_hid=6, n_his=2, warmup=32, seed=0)
    rng = np.random.default_rng(0)
    idle = IDLE * rng.uniform(0.9, 1.1, (64, 2))
    busy = BUSY * rng.uniform(0.95, 1.05, (64, 2))
    W = np.concatenate([idle, busy])[np.arange(128)[:, None] + [0, 0, 0]]
    for _ in range(5):
        learn(m, W)
    assert m.ready
    return m


def phase_of(m: PhaseModel, frame: np.ndarray) -> int:
    return int(m.predict(np.repeat(frame[None, None, :], m.window_len, axis=1))[0])


def with_stats(m: PhaseModel, phase: int, cpu: np.ndarray, mem: np.ndarray) -> None:
    m.clusterer.update_stats(np.full(len(cpu), phase), np.c_[cpu, mem])


FB = np.array([[4.0, 8e9]])


def test_a_cold_model_hands_out_the_fallback_limits_with_floors():
    m = PhaseModel(features=("cpu", "mem"), n_his=2, warmup=1000)
    fleet = PhaseFleet(m, floors={"cpu": 0.5, "mem": 1e9}, frozen=True)
    out = fleet.step(0.0, ["c"], IDLE[None], fallback_limits=np.array([[0.1, 2e9]]))
    assert out.limits.tolist() == [[0.5, 2e9]]  # cpu raised to its floor
    assert not out.from_phase.any() and out.phase.tolist() == [-1]
    assert out.decide.all() and out.changes == []
    again = fleet.step(1.0, ["c"], IDLE[None], fallback_limits=np.array([[0.1, 2e9]]))
    assert not again.decide.any()  # unchanged limits are not handed out twice


def test_limits_come_from_the_pooled_phase_quantile_times_one_plus_margin():
    m = trained_model()
    p_idle = phase_of(m, IDLE)
    rng = np.random.default_rng(1)
    with_stats(m, p_idle, rng.uniform(0.01, 0.03, 200), rng.uniform(1.5e8, 2.5e8, 200))
    slot = m.clusterer.slot_of(p_idle)
    q95 = m.clusterer.stats.quantiles(slot, (0.95,))[0]
    fleet = PhaseFleet(m, floors={"cpu": 0.025}, margin=0.2, frozen=True)
    ids = ["a", "b"]
    for t in range(3):  # windows of n_his + 1 = 3 frames
        out = fleet.step(float(t), ids, np.stack([IDLE, IDLE]), fallback_limits=np.repeat(FB, 2, axis=0))
    assert out.phase.tolist() == [p_idle, p_idle] and out.from_phase.all()
    expected = np.maximum(q95 * 1.2, [0.025, 0.0])
    np.testing.assert_allclose(out.limits, np.stack([expected, expected]))
    e = out.explain(0)
    assert e["phase"] == p_idle and e["source"] == "phase" and e["stats"]["cpu"]["count"] == 200


def test_a_phase_change_is_emitted_once_and_a_new_phase_falls_back_until_it_has_samples():
    m = trained_model()
    p_idle, p_busy = phase_of(m, IDLE), phase_of(m, BUSY)
    assert p_idle != p_busy
    with_stats(m, p_idle, np.full(50, 0.02), np.full(50, 2e8))  # busy phase: no statistics yet
    fleet = PhaseFleet(m, frozen=True, min_phase_samples=10)
    changes, steps = [], []
    for t in range(12):
        frame = IDLE if t < 6 else BUSY
        out = fleet.step(float(t), ["job"], frame[None], fallback_limits=FB, host="h1")
        changes += out.changes
        steps.append(out)
    busy_changes = [c for c in changes if c["new_phase"] == p_busy]
    assert len(busy_changes) == 1
    c = busy_changes[0]
    assert c["old_phase"] == p_idle and c["container"] == "job" and c["host"] == "h1" and c["since"] == 2.0
    assert c["stats"] == m.clusterer.phase_stats(p_busy)  # memoised per phase, same numbers
    first = next(x for x in changes if x["new_phase"] == p_idle)
    assert first["stats"] == m.clusterer.phase_stats(p_idle) and first["stats"]["cpu"]["count"] == 50
    assert steps[5].from_phase.all()  # idle: phase statistics
    assert not steps[-1].from_phase.any() and steps[-1].limits.tolist() == FB.tolist()  # busy: fallback
    assert steps[-1].explain(0)["source"] == "fallback"


def test_within_a_phase_limits_move_only_beyond_the_change_threshold():
    m = trained_model()
    p = phase_of(m, IDLE)
    with_stats(m, p, np.full(100, 0.5), np.full(100, 2e8))
    fleet = PhaseFleet(m, frozen=True, change_threshold=0.05, margin=0.0)
    for t in range(3):
        first = fleet.step(float(t), ["c"], IDLE[None], fallback_limits=FB)
    base = first.limits[0, 0]
    with_stats(m, p, np.full(100, 0.51), np.full(100, 2e8))  # quantile moves ~1-2 %
    fleet.set_model(m)  # a newer snapshot: statistics re-read
    out = fleet.step(3.0, ["c"], IDLE[None], fallback_limits=FB)
    assert out.limits[0, 0] == base and not out.decide[0, 0]
    with_stats(m, p, np.full(800, 0.8), np.full(800, 2e8))  # now far beyond 5 %
    fleet.set_model(m)
    out = fleet.step(4.0, ["c"], IDLE[None], fallback_limits=FB)
    assert out.limits[0, 0] > base * 1.05 and out.decide[0, 0]


def test_the_pure_rule_matches_a_hand_computed_case():
    lim, _basis, src, lp = phase_limits(
        q=np.array([[1.0, 100.0], [np.nan, np.nan]]), counts=np.array([[10, 9], [0, 0]]),
        phase=np.array([2, -1]), slot_ok=np.array([True, False]),
        prev_basis=np.array([[0.98, np.nan], [np.nan, np.nan]]), prev_limit_phase=np.array([2, -1]),
        prev_from_phase=np.array([[True, False], [False, False]]),
        fallback=np.array([[3.0, 50.0], [np.nan, 7.0]]), floors=np.array([0.0, 60.0]),
        margin=0.5, min_phase_samples=10, change_threshold=0.05)
    np.testing.assert_allclose(lim, [[0.98 * 1.5, 60.0], [np.nan, 60.0]])  # hysteresis keeps 0.98; floors
    assert src.tolist() == [[True, False], [False, False]] and lp.tolist() == [2, -1]


def test_a_frozen_fleet_is_deterministic_and_leaves_the_model_untouched():
    m = trained_model()
    before = m.to_bytes()
    rng = np.random.default_rng(3)
    ids = [f"c{i}" for i in range(50)]
    frames = [np.where(rng.random((50, 1)) < 0.5, IDLE, BUSY) * rng.uniform(0.9, 1.1, (50, 2)) for _ in range(20)]
    outs = []
    for _ in range(2):
        fleet = PhaseFleet(PhaseModel.from_bytes(before), frozen=True, learn_every=3)
        outs.append([fleet.step(float(t), ids, X, fallback_limits=np.tile(FB, (50, 1))) for t, X in enumerate(frames)])
        assert fleet.model.to_bytes() == before and fleet.windows_learned == 0
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a.phase, b.phase)
        np.testing.assert_array_equal(a.limits, b.limits)
        np.testing.assert_array_equal(a.sample, b.sample)
        assert a.changes == b.changes


def test_an_unfrozen_fleet_learns_every_kth_ready_window():
    m = PhaseModel(features=("cpu", "mem"), n_his=2, warmup=10_000)
    fleet = PhaseFleet(m, learn_every=4)
    ids = [f"c{i}" for i in range(10)]
    for t in range(10):  # windows ready from t = 2: 8 steps x 10 containers
        fleet.step(float(t), ids, np.tile(IDLE, (10, 1)))
    assert fleet.windows_learned == 80 // 4 and m.crbm.n_seen == 20
    assert pick_every_k(np.ones(5, bool), 0, 2)[0].tolist() == [0, 2, 4]


def test_state_survives_a_round_trip_through_the_loader():
    m = trained_model()
    fleet = PhaseFleet(m, frozen=True, state_write_interval_s=100.0)
    for t in range(4):
        fleet.step(float(t), ["a"], IDLE[None], fallback_limits=FB)
    dirty = dict(fleet.pop_dirty())
    assert "a" in dirty and fleet.pop_dirty() == []  # handed out once
    store = {"a": fleet.state_of("a")}
    restored = PhaseFleet(PhaseModel.from_bytes(m.to_bytes()), frozen=True, loader=store.get)
    out = restored.step(4.0, ["a"], IDLE[None], fallback_limits=FB)
    ref = fleet.step(4.0, ["a"], IDLE[None], fallback_limits=FB)
    assert restored.loaded == 1 and out.changes == [] and out.phase.tolist() == ref.phase.tolist()
    np.testing.assert_array_equal(out.limits, ref.limits)
    bad = PhaseFleet(PhaseModel.from_bytes(m.to_bytes()), frozen=True, loader=lambda c: {"v": 99})
    bad.step(0.0, ["x"], IDLE[None])
    assert bad.load_errors == 1


def test_state_per_container_stays_under_4_kib():
    fleet = PhaseFleet(trained_model(), frozen=True)
    ids = [f"host-{i // 100}/container-{i:05d}" for i in range(2000)]
    for t in range(4):
        fleet.step(float(t), ids, np.tile(IDLE, (2000, 1)))
    assert len(fleet) == 2000
    assert fleet.state_bytes() <= 4096


def test_bad_shapes_are_refused_with_a_clear_error():
    fleet = PhaseFleet(trained_model(), frozen=True)
    with pytest.raises(ValueError, match="frames must have shape"):
        fleet.step(0.0, ["a"], np.zeros((1, 3)))
    with pytest.raises(ValueError, match="fallback_limits must have shape"):
        fleet.step(0.0, ["a"], IDLE[None], fallback_limits=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="snapshot has features"):
        fleet.set_model(PhaseModel(features=("cpu",), n_his=2))


# ---------------------------------------------------------------- relative statistics


def test_relative_limits_are_the_container_level_times_the_pooled_ratio_quantile():
    m = trained_model()
    p_idle = phase_of(m, IDLE)
    # hand-checked ratios: usage / level spread evenly over [0.5, 1.5] -> p95 = 1.45 (2 % buckets)
    ratios = np.linspace(0.5, 1.5, 1001)
    m.clusterer.update_rel_stats(np.full(1001, p_idle), np.c_[ratios, ratios])
    q95 = m.clusterer.rel_stats.quantiles(m.clusterer.slot_of(p_idle), (0.95,))[0]
    assert q95 == pytest.approx([1.45, 1.45], rel=0.01)
    fleet = PhaseFleet(m, margin=0.1, frozen=True, statistics="relative", level_half_life=1.0)
    small, big = IDLE, IDLE * np.array([1.0, 4.0])  # same phase (same cpu), 4x the memory
    for t in range(3):
        out = fleet.step(float(t), ["s", "b"], np.stack([small, big]), fallback_limits=np.repeat(FB, 2, axis=0))
    assert out.from_phase.all() and out.statistics == "relative"
    # constant usage: the level (a decaying max) is the usage itself
    np.testing.assert_allclose(out.limits, np.stack([small, big]) * q95 * 1.1, rtol=1e-9)
    # the absolute design gives both containers the same pooled limit; the relative one scales with each
    assert out.limits[1, 1] == pytest.approx(4 * out.limits[0, 1])


def test_a_ratio_cap_bounds_relative_limits_at_level_times_cap_and_leaves_smaller_quantiles_alone():
    m = trained_model()
    p_idle = phase_of(m, IDLE)
    # a start-up ramp's ratios: most frames near 1, a tail of jumps to 50x the level before them
    ratios = np.r_[np.full(900, 0.9), np.full(100, 50.0)]
    m.clusterer.update_rel_stats(np.full(1000, p_idle), np.c_[np.full(1000, 0.8), ratios])
    q95 = m.clusterer.rel_stats.quantiles(m.clusterer.slot_of(p_idle), (0.95,))[0]
    assert q95[0] == pytest.approx(0.8, rel=0.02) and q95[1] > 40
    outs = {}
    for cap in (None, 1.25):
        fleet = PhaseFleet(PhaseModel.from_bytes(m.to_bytes()), margin=0.1, frozen=True, statistics="relative",
                           level_half_life=1.0, ratio_cap=cap)
        for t in range(3):
            outs[cap] = fleet.step(float(t), ["c"], IDLE[None], fallback_limits=FB)
    assert outs[None].from_phase.all() and outs[1.25].from_phase.all()
    np.testing.assert_allclose(outs[None].limits[0], IDLE * q95 * 1.1, rtol=1e-9)  # mem: 40+ x the use
    np.testing.assert_allclose(outs[1.25].limits[0], IDLE * [q95[0], 1.25] * 1.1, rtol=1e-9)  # cpu untouched
    with pytest.raises(ValueError, match="ratio_cap"):
        PhaseFleet(m, ratio_cap=0.0)


def test_the_level_is_a_decaying_max_and_credited_usage_is_divided_by_the_level_before_the_step():
    m = PhaseModel(features=("cpu", "mem"), n_his=2, warmup=10_000)
    fleet = PhaseFleet(m, statistics="relative", level_half_life=2.0, frozen=True)
    a = fleet.step(0.0, ["c"], np.array([[4.0, 100.0]]))
    assert np.isnan(a.levels).all()  # nothing seen before the first frame
    b = fleet.step(1.0, ["c"], np.array([[1.0, 50.0]]))
    np.testing.assert_allclose(b.levels, [[4.0, 100.0]])
    c = fleet.step(2.0, ["c"], np.array([[np.nan, 200.0]]))
    # level after step 1: max(usage, level * 2**-0.5); a missing value keeps the decayed level
    np.testing.assert_allclose(c.levels, [[4.0 * 2**-0.5, 100.0 * 2**-0.5]])
    d = fleet.step(3.0, ["c"], np.array([[0.0, 0.0]]))
    np.testing.assert_allclose(d.levels, [[4.0 * 2**-1.0, 200.0]])
    # learning credits usage / level-before-step to the relative statistics of the phase in force
    m2 = trained_model()
    p = phase_of(m2, IDLE)
    W = np.repeat(IDLE[None, None, :], m2.window_len, axis=1)
    learn(m2, np.repeat(W, 2, axis=0), stats_phases=np.array([p, p]), usage=np.array([[1.0, 2.0], [3.0, 3.0]]),
          levels=np.array([[2.0, 4.0], [0.0, 3.0]]))
    s = m2.clusterer.slot_of(p)
    assert m2.clusterer.rel_stats.count(s).tolist() == [1, 2]  # level 0: not credited
    assert m2.clusterer.rel_stats.maximum(s).tolist() == [0.5, 1.0]
    assert m2.clusterer.stats.count(s).tolist() == [2, 2]  # absolute statistics as before


def test_relative_state_round_trips_and_old_states_load_with_a_level_from_the_window():
    m = trained_model()
    fleet = PhaseFleet(m, frozen=True, statistics="relative")
    for t in range(4):
        fleet.step(float(t), ["a"], (IDLE * (1 + t))[None], fallback_limits=FB)
    st = fleet.state_of("a")
    assert st["v"] == 2 and len(st["lv"]) == 2
    restored = PhaseFleet(PhaseModel.from_bytes(m.to_bytes()), frozen=True, statistics="relative",
                          loader={"a": st}.get)
    out = restored.step(4.0, ["a"], IDLE[None], fallback_limits=FB)
    ref = fleet.step(4.0, ["a"], IDLE[None], fallback_limits=FB)
    np.testing.assert_array_equal(out.levels, ref.levels)
    np.testing.assert_array_equal(out.limits, ref.limits)
    old = {k: v for k, v in st.items() if k != "lv"} | {"v": 1}
    legacy = PhaseFleet(PhaseModel.from_bytes(m.to_bytes()), frozen=True, statistics="relative",
                        loader={"a": old}.get)
    got = legacy.step(4.0, ["a"], IDLE[None], fallback_limits=FB)
    assert legacy.loaded == 1
    np.testing.assert_allclose(got.levels, [IDLE * 4], rtol=1e-6)  # the window's max (float32 frames)
    with pytest.raises(ValueError, match="statistics must be one of"):
        PhaseFleet(m, statistics="pooled")


def test_relative_statistics_survive_the_model_snapshot_and_old_snapshots_are_refused(monkeypatch):
    from phasewise.models.phases.checkpoint import CheckpointError

    m = trained_model()
    p = phase_of(m, IDLE)
    m.clusterer.update_rel_stats(np.full(50, p), np.c_[np.linspace(0.2, 2, 50), np.linspace(0.2, 2, 50)])
    m2 = PhaseModel.from_bytes(m.to_bytes())
    s = m.clusterer.slot_of(p)
    np.testing.assert_array_equal(m2.clusterer.rel_stats.quantiles(s, (0.5, 0.95)),
                                  m.clusterer.rel_stats.quantiles(s, (0.5, 0.95)))
    monkeypatch.setattr(PhaseModel, "VERSION", 1)
    old = m.to_bytes()
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="version 1; this build reads version 2"):
        PhaseModel.from_bytes(old)


def test_relative_state_still_fits_in_4_kib_per_container():
    fleet = PhaseFleet(trained_model(), frozen=True, statistics="relative")
    ids = [f"host-{i // 100}/container-{i:05d}" for i in range(2000)]
    for t in range(4):
        fleet.step(float(t), ids, np.tile(IDLE, (2000, 1)))
    assert fleet.state_bytes() <= 4096


def test_the_fulfilment_target_raises_a_missing_containers_phase_limits_in_steps_of_5_percent():
    m = trained_model()
    p = phase_of(m, IDLE)
    m.clusterer.update_rel_stats(np.full(100, p), np.ones((100, 2)))  # ratio quantile 1.0 (up to 1 bucket)
    fleet = PhaseFleet(m, margin=0.0, frozen=True, statistics="relative", target_fulfilment=0.9, adapt_rate=0.1,
                       level_half_life=1e9)
    lims = []
    for t in range(12):
        out = fleet.step(float(t), ["c"], IDLE[None] * (1.0 if t < 3 else 1.2 ** min(t - 2, 1)), fallback_limits=FB)
        lims.append(out.limits[0].copy())
    # t = 3: usage 20 % above the phase limit in force (a miss): the level follows the usage (x1.2) and
    # the multiplier goes up (0.1 x 0.9 in log units -> rounded to 1.05**2); without further misses it
    # decays by 0.1 x 0.1 per step, back to 1.05**1 and then 1
    ratios = np.array(lims[3:])[:, 0] / lims[2][0]
    k = np.log(ratios / 1.2) / np.log(1.05)
    np.testing.assert_allclose(k, np.round(k), atol=1e-6)  # whole powers of 1.05
    assert np.round(k).tolist() == [2, 2, 1, 1, 1, 1, 1, 0, 0]
    st = fleet.state_of("c")
    assert st["sc"][0] == pytest.approx(0.09 - 8 * 0.01)
    with pytest.raises(ValueError, match="target_fulfilment"):
        PhaseFleet(m, target_fulfilment=1.0)


def test_per_resource_quantiles_and_margins_override_the_common_ones():
    m = trained_model()
    p = phase_of(m, IDLE)
    ratios = np.linspace(0.5, 1.5, 1001)
    m.clusterer.update_rel_stats(np.full(1001, p), np.c_[ratios, ratios])
    fleet = PhaseFleet(m, quantile=0.95, margin=0.1, frozen=True, statistics="relative",
                       resource_quantiles={"mem": 0.5}, resource_margins={"mem": 0.0})
    for t in range(3):
        out = fleet.step(float(t), ["c"], IDLE[None], fallback_limits=FB)
    np.testing.assert_allclose(out.limits[0] / IDLE, [1.45 * 1.1, 1.0], rtol=0.01)
    with pytest.raises(ValueError, match="not features of the model"):
        PhaseFleet(m, resource_quantiles={"gpu": 0.9})
