"""The safety rules (phasewise.models.safety.guard): each rule alone, then together, then their state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from phasewise.kit.settings import Settings
from phasewise.models.safety.guard import MIB, RULES, GuardConfig, LimitGuard, bounded_text, oom_bump
from phasewise.streams.config import guard_config

NAN = np.nan


def config(**kw) -> GuardConfig:
    """The worker's rules under the default settings, with *kw* changed."""
    return dataclasses.replace(guard_config(Settings()), **kw)


def guard(**kw) -> tuple[LimitGuard, np.ndarray]:
    g = LimitGuard(config(**{"min_history_s": 60.0, "cooldown_s": 30.0, "max_decrease": 0.25, "peak_window_s": 120.0,
                             "mem_margin_bytes": 0.0, "throttle_window_s": 5.0, **kw}))
    return g, g.add_rows(1)


def see(g: LimitGuard, rows: np.ndarray, t: float, mem: float = 1e8, thr: float = 0.0, oom: int = 0,
        mem_limit: float = NAN) -> None:
    n = len(rows)
    g.observe(rows, t, mem=np.full(n, mem), throttled_frac=np.full(n, thr), oom=np.full(n, oom),
              mem_limit=np.full(n, mem_limit))


def bound(g, rows, t, cpu=NAN, mem=NAN, in_cpu=NAN, in_mem=NAN, lo=None, hi=None):
    return g.bound(rows, t, np.array([[cpu, mem]]), np.array([[in_cpu, in_mem]]),
                   lo=None if lo is None else np.array([lo], dtype=float),
                   hi=None if hi is None else np.array([hi], dtype=float))


def test_no_limit_is_lowered_before_the_minimum_history():
    g, r = guard()
    for t in range(0, 60, 5):
        see(g, r, float(t))
        out = bound(g, r, float(t), cpu=0.5, mem=5e8, in_cpu=1.0, in_mem=1e9)
        assert not out.emit.any()
        assert out.rules_of(0) == {"cpu": ["history"], "mem": ["history"]}
    see(g, r, 60.0)
    out = bound(g, r, 60.0, cpu=0.5, mem=5e8, in_cpu=1.0, in_mem=1e9)
    assert out.emit.all() and out.limits.tolist() == [[0.75, 7.5e8]]  # now only the step bounds it
    assert out.rules_of(0) == {"cpu": ["step"], "mem": ["step"]}


def test_an_unlimited_container_gets_no_limit_on_little_history_then_one_without_a_step_bound():
    g, r = guard(mem_margin_bytes=64 * MIB)
    for t in range(0, 65, 5):
        see(g, r, float(t), mem=3e8)
        out = bound(g, r, float(t), cpu=0.3, mem=4e8)  # unlimited: NaN in force
        if t < 60:
            assert not out.emit.any() and out.rules_of(0) == {"cpu": ["history"], "mem": ["history"]}
    assert out.emit.all()
    assert out.limits[0, 0] == 0.3
    assert out.limits[0, 1] == 4e8  # above the peak 3e8 + 64 MiB: not raised
    assert np.isinf(out.in_force).all()


def test_increases_are_never_held_back():
    g, r = guard()
    see(g, r, 0.0, thr=0.9, oom=1, mem_limit=1e9)  # young, throttled, just OOM-killed
    out = bound(g, r, 0.0, cpu=2.0, mem=5e9, in_cpu=1.0, in_mem=1e9)
    assert out.emit.all() and out.limits.tolist() == [[2.0, 5e9]]
    assert "cpu" not in out.rules_of(0)


def test_cpu_is_not_lowered_while_the_container_is_throttled_and_memory_still_is():
    g, r = guard(min_history_s=0.0, throttle_threshold=0.1)
    see(g, r, 10.0, thr=0.5)
    out = bound(g, r, 10.0, cpu=0.5, mem=9e8, in_cpu=1.0, in_mem=1e9)
    assert out.emit.tolist() == [[False, True]]
    assert out.rules_of(0) == {"cpu": ["throttled"]}
    see(g, r, 13.0, thr=0.05)  # below the threshold, but a throttled sample 3 s ago is in the window
    assert bound(g, r, 13.0, cpu=0.5, in_cpu=1.0).rules_of(0) == {"cpu": ["throttled"]}
    see(g, r, 16.0, thr=0.0)  # 6 s since the last throttled sample: the 5 s window has passed
    out = bound(g, r, 16.0, cpu=0.9, in_cpu=1.0)
    assert out.emit[0, 0] and out.limits[0, 0] == 0.9


def test_at_most_one_decrease_per_cooldown_and_increases_in_between():
    g, r = guard(min_history_s=0.0)
    see(g, r, 0.0)
    out = bound(g, r, 0.0, cpu=0.9, in_cpu=1.0)
    g.commit(r, 0.0, out)
    for t in (10.0, 29.0):
        see(g, r, t)
        held = bound(g, r, t, cpu=0.8, in_cpu=0.9)
        assert not held.emit.any() and held.rules_of(0) == {"cpu": ["cooldown"]}
        up = bound(g, r, t, cpu=1.5, in_cpu=0.9)
        assert up.emit[0, 0] and up.rules_of(0) == {}
    see(g, r, 30.0)
    assert bound(g, r, 30.0, cpu=0.8, in_cpu=0.9).emit[0, 0]


def test_a_decrease_is_bounded_to_a_fraction_of_the_limit_in_force():
    g, r = guard(min_history_s=0.0, max_decrease=0.4)
    see(g, r, 0.0)
    out = bound(g, r, 0.0, cpu=0.1, mem=1e8, in_cpu=2.0, in_mem=1e9)
    assert out.limits.tolist() == [[1.2, 6e8]]
    assert out.rules_of(0) == {"cpu": ["step"], "mem": ["step"]}


def test_memory_covers_the_peak_of_the_window_and_forgets_it_once_the_window_passed():
    g, r = guard(min_history_s=0.0, max_decrease=1.0, peak_window_s=120.0, mem_margin_bytes=10 * MIB)
    see(g, r, 0.0, mem=9e8)  # a checkpoint spike
    for t in range(5, 200, 5):
        see(g, r, float(t), mem=2e8)
        out = bound(g, r, float(t), mem=3e8, in_mem=1.5e9)
        if t < 110:  # 11 of the 12 ten-second buckets always cover the spike
            assert out.limits[0, 1] == 9e8 + 10 * MIB and out.rules_of(0) == {"mem": ["peak"]}, t
        if t >= 120:  # the window has passed
            assert out.limits[0, 1] == 3e8 and out.rules_of(0) == {}, t


def test_memory_in_force_under_the_peak_is_raised_without_a_proposal():
    g, r = guard(mem_margin_bytes=50 * MIB)
    see(g, r, 0.0, mem=1e9 - 10 * MIB, mem_limit=1e9)  # pressing on its limit
    out = bound(g, r, 0.0, in_cpu=1.0, in_mem=1e9)
    assert out.emit.tolist() == [[False, True]]
    assert out.limits[0, 1] == 1e9 + 40 * MIB and out.rules_of(0) == {"mem": ["peak"]}


def test_an_oom_kill_raises_memory_to_vpas_bump_at_once_and_holds_decreases_for_the_cooldown():
    g, r = guard(min_history_s=0.0, cooldown_s=30.0)
    see(g, r, 0.0, mem=1e8, mem_limit=5e8)
    g.commit(r, 0.0, bound(g, r, 0.0, mem=5e8))  # the guard let 5e8 out
    see(g, r, 10.0, mem=1e8, oom=1, mem_limit=5e8)
    assert g.pending(r).tolist() == [True]
    out = bound(g, r, 10.0, in_mem=5e8)  # nothing proposed: the bump is
    bumped = float(oom_bump(5e8))
    assert bumped == 5e8 + 100 * MIB
    assert out.emit.tolist() == [[False, True]] and out.limits[0, 1] == bumped
    assert out.rules_of(0) == {"mem": ["oom"]}
    g.commit(r, 10.0, out)
    assert g.pending(r).tolist() == [False]
    see(g, r, 20.0, mem=1e8)
    held = bound(g, r, 20.0, mem=2e8, in_mem=bumped)
    assert not held.emit.any() and held.rules_of(0) == {"mem": ["oom"]}
    see(g, r, 45.0, mem=1e8)  # the cooldown passed
    assert bound(g, r, 45.0, mem=bumped * 0.9, in_mem=bumped).emit[0, 1]


def test_rows_are_independent_and_vectorised_bounds_equal_one_row_at_a_time():
    rng = np.random.default_rng(7)
    cfg = GuardConfig(min_history_s=30.0, cooldown_s=20.0, max_decrease=0.3, peak_window_s=60.0,
                      mem_margin_bytes=5 * MIB, throttle_threshold=0.1, throttle_window_s=3.0)
    many = LimitGuard(cfg)
    rows = many.add_rows(6)
    ones = [LimitGuard(cfg) for _ in range(6)]
    one_rows = [g.add_rows(1) for g in ones]
    in_force = np.tile([[2.0, 2e9]], (6, 1))
    for step in range(120):
        t = float(step)
        mem = rng.uniform(1e8, 1.5e9, 6)
        thr = rng.uniform(0, 0.3, 6)
        oom = (rng.uniform(size=6) < 0.02).astype(float)
        many.observe(rows, t, mem=mem, throttled_frac=thr, oom=oom, mem_limit=in_force[:, 1])
        prop = np.where(rng.uniform(size=(6, 2)) < 0.5, in_force * rng.uniform(0.3, 1.3, (6, 2)), NAN)
        out = many.bound(rows, t, prop, in_force)
        many.commit(rows, t, out)
        for k, (g, r) in enumerate(zip(ones, one_rows)):
            g.observe(r, t, mem=mem[k:k + 1], throttled_frac=thr[k:k + 1], oom=oom[k:k + 1],
                      mem_limit=in_force[k:k + 1, 1])
            o = g.bound(r, t, prop[k:k + 1], in_force[k:k + 1])
            g.commit(r, t, o)
            np.testing.assert_array_equal(o.limits[0], out.limits[k])
            np.testing.assert_array_equal(o.rules[0], out.rules[k])
        in_force = np.where(out.emit, out.limits, in_force)


def test_the_peak_is_the_max_over_the_buckets_of_the_window_for_any_sample_times():
    rng = np.random.default_rng(3)
    g = LimitGuard(config(peak_window_s=120.0))
    r = g.add_rows(1)
    w = 120.0 / LimitGuard.PEAK_BUCKETS
    seen: list[tuple[float, float]] = []
    t = 0.0
    for _ in range(400):
        t += float(rng.exponential(4.0))
        m = float(rng.uniform(0, 1e9))
        seen.append((t, m))
        see(g, r, t, mem=m)
        first_bucket = np.floor(t / w) - LimitGuard.PEAK_BUCKETS + 1
        want = max(v for s, v in seen if np.floor(s / w) >= first_bucket)
        assert g.peak(r)[0] == want


def test_guard_state_round_trips_and_a_foreign_state_is_refused():
    g, r = guard(min_history_s=0.0)
    see(g, r, 0.0, mem=7e8, thr=0.5, oom=1, mem_limit=6e8)
    g.commit(r, 0.0, bound(g, r, 0.0, cpu=0.5, in_cpu=1.0, in_mem=6e8))
    state = g.state_of(int(r[0]))
    h, r2 = guard(min_history_s=0.0)
    h.load(int(r2[0]), state)
    assert h.state_of(int(r2[0])) == state
    a = bound(g, r, 3.0, cpu=0.2, mem=1e8, in_cpu=0.75, in_mem=8e8)
    b = bound(h, r2, 3.0, cpu=0.2, mem=1e8, in_cpu=0.75, in_mem=8e8)
    np.testing.assert_array_equal(a.limits, b.limits)
    np.testing.assert_array_equal(a.rules, b.rules)
    for bad in ({"v": 99}, {**state, "l": [1.0]}, {**state, "f": "x"}, "nonsense"):
        with pytest.raises(ValueError):
            h.load(int(r2[0]), bad)
        assert h.state_of(int(r2[0]))["f"] is None  # reset
    other = LimitGuard(config(peak_window_s=600.0))  # other buckets: peaks restart, the rest stays
    o = other.add_rows(1)
    other.load(int(o[0]), state)
    assert np.isnan(other.peak(o)[0]) and other.state_of(int(o[0]))["ot"] == 0.0


def test_configuration_is_checked():
    for bad in ({"max_decrease": 0.0}, {"max_decrease": 1.5}, {"peak_window_s": 0.0}, {"min_history_s": -1.0},
                {"cooldown_s": float("nan")}, {"throttle_threshold": 2.0}, {"oom_bump_ratio": 0.5}):
        with pytest.raises(ValueError):
            config(**bad)


def test_the_reason_names_every_rule_that_bounded_a_decision():
    assert bounded_text({"bounded_by": {}}) == ""
    assert bounded_text({"bounded_by": {"cpu": ["throttled"]}}) == " [bounded: cpu by throttled]"
    assert set(RULES) == {"history", "throttled", "oom", "cooldown", "step", "workload_max", "workload_min", "peak"}


# --------------------------------------------------------------------------- the workload's own min/max


def test_a_limit_above_the_workloads_max_is_lowered_to_it_and_named():
    g, r = guard(min_history_s=0.0)
    see(g, r, 10.0, mem=1e8)
    out = bound(g, r, 10.0, cpu=3.0, mem=6e9, in_cpu=1.0, in_mem=1e9, hi=(2.0, 4e9))  # increases past the max
    assert out.limits.tolist() == [[2.0, 4e9]]
    assert out.rules_of(0) == {"cpu": ["workload_max"], "mem": ["workload_max"]}
    assert out.explain(0)["bounded_by"] == {"cpu": ["workload_max"], "mem": ["workload_max"]}


def test_the_max_is_reached_in_one_decision_not_spread_by_the_step():
    g, r = guard(min_history_s=0.0, max_decrease=0.25)
    see(g, r, 10.0)
    out = bound(g, r, 10.0, cpu=7.0, in_cpu=8.0, hi=(4.0, NAN))  # the actuator would cut 7 to 4 anyway
    assert out.limits[0, 0] == 4.0 and out.rules_of(0) == {"cpu": ["workload_max"]}
    out = bound(g, r, 10.0, cpu=1.0, in_cpu=8.0, hi=(4.0, NAN))  # the step bounds to 6, the max to 4
    assert out.limits[0, 0] == 4.0 and out.rules_of(0) == {"cpu": ["step", "workload_max"]}


def test_a_limit_below_the_workloads_min_is_raised_to_it():
    g, r = guard(min_history_s=0.0, max_decrease=1.0)
    see(g, r, 10.0, mem=1e8)
    out = bound(g, r, 10.0, cpu=0.2, mem=2e8, in_cpu=1.0, in_mem=1e9, lo=(0.5, 5e8))
    assert out.limits.tolist() == [[0.5, 5e8]]
    assert out.rules_of(0) == {"cpu": ["workload_min"], "mem": ["workload_min"]}
    # a proposal that lands on the limit in force after the clamp is no decision
    out = bound(g, r, 10.0, cpu=0.2, in_cpu=0.5, lo=(0.5, NAN))
    assert not out.emit.any() and out.rules_of(0) == {"cpu": ["workload_min"]}


def test_a_held_back_decrease_is_not_turned_into_one_by_the_max():
    g, r = guard(min_history_s=60.0)
    see(g, r, 10.0)  # young: the history rule holds every decrease
    out = bound(g, r, 10.0, cpu=3.0, in_cpu=8.0, hi=(4.0, NAN))
    assert not out.emit.any() and out.rules_of(0) == {"cpu": ["history"]}


def test_no_bounds_change_nothing():
    g, r = guard(min_history_s=0.0)
    see(g, r, 10.0)
    a = bound(g, r, 10.0, cpu=0.9, mem=9e8, in_cpu=1.0, in_mem=1e9)
    b = bound(g, r, 10.0, cpu=0.9, mem=9e8, in_cpu=1.0, in_mem=1e9, lo=(NAN, NAN), hi=(NAN, NAN))
    np.testing.assert_array_equal(a.limits, b.limits)
    np.testing.assert_array_equal(a.rules, b.rules)


def test_memory_max_gives_way_to_the_peak_floor():
    g, r = guard(min_history_s=0.0, mem_margin_bytes=1e8)
    see(g, r, 10.0, mem=3e9)  # peak 3e9 + margin 1e8 > the max 2e9: a lower limit would OOM-kill it
    out = bound(g, r, 10.0, mem=3.5e9, in_mem=4e9, hi=(NAN, 2e9))
    assert out.limits[0, 1] == 3.1e9
    assert out.rules_of(0) == {"mem": ["workload_max", "peak"]}


def test_the_memory_max_caps_the_oom_bump_and_answers_the_kill():
    g, r = guard(min_history_s=0.0, mem_margin_bytes=0.0)
    see(g, r, 10.0, mem=1.9e9, oom=1, mem_limit=2e9)  # killed at 2e9: the bump is 2.4e9
    assert g.pending(r).tolist() == [True]
    out = bound(g, r, 10.0, in_mem=2e9, hi=(NAN, 2.2e9))  # nothing proposed: the rules raise it, to the max
    assert out.limits[0, 1] == 2.2e9 and out.rules_of(0) == {"mem": ["oom"]}
    g.commit(r, 10.0, out)
    assert g.pending(r).tolist() == [False]  # answered: no decision is forced at every later sample
    # at the max already: the kill is answered with no decision at all
    g2, r2 = guard(min_history_s=0.0, mem_margin_bytes=0.0)
    see(g2, r2, 10.0, mem=1.9e9, oom=1, mem_limit=2e9)
    out = bound(g2, r2, 10.0, in_mem=2e9, hi=(NAN, 2e9))
    assert not out.emit.any()
    g2.commit(r2, 10.0, out)
    assert g2.pending(r2).tolist() == [False]


def test_step_peak_cooldown_and_the_workloads_max_in_one_container_s_life():
    """The module's former example: the step and the peak bound a cut, the cooldown holds the next, cpu-max caps."""
    g = LimitGuard(config(min_history_s=60, cooldown_s=30, max_decrease=0.5, peak_window_s=600,
                          mem_margin_bytes=0))
    rows = g.add_rows(1)
    for t in range(0, 70, 10):
        g.observe(rows, float(t), mem=np.array([2.5e9 if t == 20 else 1e9]), throttled_frac=np.zeros(1),
                  oom=np.zeros(1), mem_limit=np.array([4e9]))
    out = g.bound(rows, 60.0, proposed=np.array([[0.2, 1.0e9]]), in_force=np.array([[1.0, 4e9]]))
    assert out.limits.tolist() == [[0.5, 2500000000.0]]
    assert out.rules_of(0) == {"cpu": ["step"], "mem": ["step", "peak"]}
    g.commit(rows, 60.0, out)
    out = g.bound(rows, 70.0, proposed=np.array([[0.2, 1.0e9]]), in_force=np.array([[0.5, 2.5e9]]))
    assert out.emit.tolist() == [[False, False]]
    assert out.rules_of(0) == {"cpu": ["cooldown"], "mem": ["cooldown"]}
    out = g.bound(rows, 200.0, proposed=np.array([[3.0, NAN]]), in_force=np.array([[0.5, 2.5e9]]),
                  hi=np.array([[2.0, NAN]]))  # the workload's cpu-max is 2 cores
    assert out.limits[0, 0] == 2.0 and out.rules_of(0) == {"cpu": ["workload_max"]}


def test_a_cpu_cut_waits_for_a_sample_throttled_above_half_the_threshold():
    # one throttled CFS period of ~10 in a 1 s sample is the whole 0.1 threshold: another reading of the same
    # counters over another second can see 1 of 9 (0.11) where this sample saw 1 of 11 (0.09)
    g, r = guard(min_history_s=0.0, throttle_threshold=0.1)
    see(g, r, 10.0, thr=1 / 11)
    assert bound(g, r, 10.0, cpu=0.5, in_cpu=1.0).rules_of(0) == {"cpu": ["throttled"]}
    g, r = guard(min_history_s=0.0, throttle_threshold=0.1)
    see(g, r, 10.0, thr=0.04)  # under half the threshold: not throttled
    out = bound(g, r, 10.0, cpu=0.8, in_cpu=1.0)
    assert out.emit[0, 0] and out.limits[0, 0] == 0.8 and "cpu" not in out.rules_of(0)


def test_the_explanations_of_many_rows_are_each_rows_own():
    """``explain_rows`` (what a round's decisions read at once) gives what ``explain`` gives row by row; read
    through the phase step's subset of rows, a row the rules did not see is None."""
    from phasewise.models.phases.updater import _Rows

    g = LimitGuard(config(min_history_s=60.0, cooldown_s=30.0, max_decrease=0.25, peak_window_s=120.0,
                          mem_margin_bytes=0.0, throttle_window_s=5.0))
    rows = g.add_rows(3)
    for t in range(0, 100, 5):
        g.observe(rows, float(t), mem=np.array([1e8, 5e8, 2e8]), throttled_frac=np.array([0.0, 0.9, 0.0]),
                  oom=np.zeros(3), mem_limit=np.array([NAN, 1e9, 4e8]))
    out = g.bound(rows, 100.0, np.array([[0.5, 5e8], [0.2, 2e8], [NAN, 1e8]]),
                  np.array([[1.0, 1e9], [1.0, 1e9], [NAN, NAN]]))
    each = [out.explain(i) for i in range(3)]
    assert out.explain_rows(np.arange(3)) == each == out.explain_rows([0, 1, 2])
    assert each[1]["bounded_by"]["cpu"] == ["throttled"] and "bounded_by" in each[2]
    assert each[2]["in_force"] == {"cpu": None, "mem": None}
    sub = _Rows(out, np.array([1, 3, 4]), 5)  # step rows 1, 3 and 4 are the outcome's rows 0, 1 and 2
    assert sub.explain_rows(np.array([0, 1, 2, 3, 4])) == [None, each[0], None, each[1], each[2]]
    assert [sub.explain(i) for i in range(5)] == [None, each[0], None, each[1], each[2]]
