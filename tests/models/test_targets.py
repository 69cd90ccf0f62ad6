"""TRADL targets: crossing with direction, smoothing, patience, grace, the share rule's table, real curves."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from phasewise.models.targets import (
    Targets,
    TargetsConfig,
    TargetTracker,
    check_progress,
    tradl_share,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def kinds(tracker: TargetTracker, values, start_ts=0.0):
    out = []
    for i, v in enumerate(values):
        out += [(e.kind, i) for e in tracker.update(ts=start_ts + i, step=i, value=v)]
    return out


def test_min_direction_both_tiers_in_order_and_reasons_name_value_and_target():
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), TargetsConfig(smoothing="none", patience=1))
    assert kinds(t, [2.0, 1.5, 0.9, 0.7, 0.4]) == [("acceptable", 2), ("objective", 4)]
    assert t.state == "objective"


def test_max_direction_metric():
    t = TargetTracker(Targets(acceptable=0.7, objective=0.9, direction="max", metric="accuracy"),
                      TargetsConfig(smoothing="none", patience=1))
    events = []
    for i, v in enumerate([0.2, 0.5, 0.75, 0.95]):
        events += t.update(ts=i, step=i, value=v)
    assert [(e.kind, e.step) for e in events] == [("acceptable", 2), ("objective", 3)]
    assert events[1].reason == "accuracy 0.95 (smoothed unsmoothed) >= objective 0.9 at step 3"
    assert events[1].details()["target"] == 0.9 and events[1].details()["direction"] == "max"


def test_one_report_past_both_tiers_gives_both_events():
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), TargetsConfig(smoothing="none", patience=1))
    assert kinds(t, [2.0, 0.1]) == [("acceptable", 1), ("objective", 1)]


def test_patience_ignores_a_single_noisy_dip():
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), TargetsConfig(smoothing="none", patience=3))
    assert kinds(t, [2.0, 0.4, 2.0, 2.0, 0.9, 0.9, 0.9]) == [("acceptable", 6)]


def test_ewma_lags_and_never_passes_a_target_no_value_reached():
    cfg = TargetsConfig(smoothing="ewma", alpha=0.3, patience=1)
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), cfg)
    # the raw values reach 0.9 (acceptable) at step 1, the EWMA only later
    got = kinds(t, [2.0] + [0.9] * 12)
    assert got and got[0][0] == "acceptable" and got[0][1] > 1
    # values that never pass the objective never declare it, whatever the smoothing
    for smoothing in ("ewma", "median", "none"):
        t = TargetTracker(Targets(acceptable=1.0, objective=0.5), TargetsConfig(smoothing=smoothing, patience=1))
        assert all(k != "objective" for k, _ in kinds(t, [2.0, 0.6, 0.51, 0.5000001] * 10))


def test_median_ignores_an_outlier_the_ewma_would_follow():
    target = Targets(acceptable=1.0, objective=0.5)
    med = TargetTracker(target, TargetsConfig(smoothing="median", window=5, patience=1))
    assert kinds(med, [2.0, 2.0, 2.0, 0.01, 2.0]) == []
    ewma = TargetTracker(target, TargetsConfig(smoothing="ewma", alpha=0.9, patience=1))
    assert kinds(ewma, [2.0, 2.0, 2.0, 0.01, 2.0]) != []


def test_grace_then_hard_stop_once_unless_finished():
    cfg = TargetsConfig(smoothing="none", patience=1, grace_s=30)
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), cfg)
    t.update(ts=100.0, step=1, value=0.1)
    assert t.due(129.9) is None
    hard = t.due(130.0)
    assert hard is not None and hard.kind == "hard_stop" and "30 s" in hard.reason
    assert t.due(200.0) is None  # once
    t2 = TargetTracker(Targets(acceptable=1.0, objective=0.5), cfg)
    t2.update(ts=100.0, step=1, value=0.1)
    t2.finished()
    assert t2.due(1000.0) is None


def test_state_round_trip_continues_identically():
    cfg = TargetsConfig(alpha=0.5, patience=2)
    target = Targets(acceptable=1.0, objective=0.5)
    a = TargetTracker(target, cfg)
    kinds(a, [2.0, 1.2, 0.9])
    b = TargetTracker.from_state(target, cfg, a.to_state())
    assert kinds(a, [0.8, 0.3, 0.2, 0.1], 10) == kinds(b, [0.8, 0.3, 0.2, 0.1], 10)
    with pytest.raises(ValueError, match="version"):
        TargetTracker.from_state(target, cfg, {**a.to_state(), "version": 99})


@pytest.mark.parametrize("kw, match", [
    ({"acceptable": 0.5, "objective": 1.0}, "objective must be <= acceptable"),
    ({"acceptable": 0.9, "objective": 0.7, "direction": "max"}, "objective must be >= acceptable"),
    ({"acceptable": 1.0, "objective": 0.5, "direction": "down"}, "direction"),
    ({"acceptable": math.nan, "objective": 0.5}, "finite"),
])
def test_bad_targets_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        Targets(**kw)


@pytest.mark.parametrize("value, step, last, reason", [
    (math.nan, 1, 0, "not finite"),
    (math.inf, 1, 0, "not finite"),
    (1.0, 3, 7, "goes backwards"),
    (5e9, 1, 0, "absurd"),
    ("1.0", 1, 0, "not a number"),
    (True, 1, 0, "not a number"),
    (1.0, -1, None, "non-negative"),
    (1.0, 1.5, None, "non-negative integer"),
    (1.0, 7, 7, None),
    (0.0, 0, None, None),
])
def test_check_progress(value, step, last, reason):
    got = check_progress(value, step, last)
    assert (got is None) if reason is None else (reason in got)


# the TRADL share rule: capacity C, n jobs; above alpha*C a job using > C/n gets C/(2n), others C/(n+1)
SHARE_CASES = [
    # usage, capacity, alpha, expected
    ({"a": 0.4, "b": 0.4}, 2.0, 0.5, None),                                  # 0.8 <= 1.0: free
    ({"a": 0.5, "b": 0.5}, 2.0, 0.5, None),                                  # exactly alpha*C: free
    ({"a": 1.5, "b": 0.3}, 2.0, 0.5, {"a": 0.5, "b": 2 / 3}),                # hog gets C/2n, other C/(n+1)
    ({"a": 1.0, "b": 1.0}, 2.0, 0.9, {"a": 2 / 3, "b": 2 / 3}),              # exactly C/n is not "more"
    ({"a": 0.7, "b": 0.7, "c": 0.7}, 2.0, 0.9, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}),  # all > C/n
    ({"a": 1.9}, 2.0, 0.9, {"a": 1.0}),                                      # n=1: uses <= C/1, gets C/2
    ({"a": 1.0}, 2.0, 0.9, None),                                            # n=1 below alpha
    ({"a": 2.0, "b": 0.1, "c": 0.1, "d": 0.1}, 2.0, 0.9, {"a": 0.25, "b": 0.4, "c": 0.4, "d": 0.4}),
    ({}, 2.0, 0.9, None),
]


@pytest.mark.parametrize("usage, capacity, alpha, expected", SHARE_CASES)
def test_tradl_share_table(usage, capacity, alpha, expected):
    got = tradl_share(usage, capacity, alpha)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)
        assert sum(got.values()) <= capacity + 1e-9  # never hands out more than the node has


@pytest.mark.parametrize("capacity, alpha", [(0.0, 0.5), (math.nan, 0.5), (2.0, 0.0), (2.0, 1.5)])
def test_tradl_share_rejects_bad_parameters(capacity, alpha):
    with pytest.raises(ValueError):
        tradl_share({"a": 1.0}, capacity, alpha)


@pytest.mark.skipif(not (SHARED / "pollux-traces").is_dir(), reason="../shared/data not present")
def test_real_curves_no_objective_declared_before_the_curve_reached_it():
    from phasewise.experiment.curves import replay

    result = replay(TargetsConfig())
    total = result["summary"]["total"]
    assert total["runs"] >= 140
    assert total["objective_before_reached"] == 0
    assert total["objective_declared"] >= 20  # Pollux's full-length curves are declared
    # unsmoothed with no patience, the noisy curves are stopped early more often than with the default
    raw = replay(TargetsConfig(smoothing="none", patience=1))["summary"]["total"]
    assert raw["false_early_stops"] > total["false_early_stops"]
    for row in result["runs"]:
        o = row["objective"]
        if o["declared"] is not None:
            assert o["reached"] is not None and o["declared"] >= o["reached"]
