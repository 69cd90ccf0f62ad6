"""TRADL targets: crossing with direction, smoothing, patience, grace, the share rule's table, real curves."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from phasewise.kit.settings import Settings
from phasewise.models.jobs.targets import (
    Targets,
    TargetsConfig,
    TargetTracker,
    check_progress,
    tradl_share,
)

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"


def config(**kw) -> TargetsConfig:
    """The targets agent's parameters under the default settings (``targets_*``), with *kw* changed."""
    t = Settings().targets
    return TargetsConfig(**{"alpha": t.ewma_alpha, "patience": t.patience, "grace_s": t.grace_s, **kw})


def kinds(tracker: TargetTracker, values, start_ts=0.0):
    out = []
    for i, v in enumerate(values):
        out += [(e.kind, i) for e in tracker.update(ts=start_ts + i, step=i, value=v)]
    return out


def test_min_direction_both_tiers_in_order_and_reasons_name_value_and_target():
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), config(smoothing="none", patience=1))
    assert kinds(t, [2.0, 1.5, 0.9, 0.7, 0.4]) == [("acceptable", 2), ("objective", 4)]
    assert t.state == "objective"


def test_max_direction_metric():
    t = TargetTracker(Targets(acceptable=0.7, objective=0.9, direction="max", metric="accuracy"),
                      config(smoothing="none", patience=1))
    events = []
    for i, v in enumerate([0.2, 0.5, 0.75, 0.95]):
        events += t.update(ts=i, step=i, value=v)
    assert [(e.kind, e.step) for e in events] == [("acceptable", 2), ("objective", 3)]
    assert events[1].reason == "accuracy 0.95 (smoothed unsmoothed) >= objective 0.9 at step 3"
    assert events[1].details()["target"] == 0.9 and events[1].details()["direction"] == "max"


def test_one_report_past_both_tiers_gives_both_events():
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), config(smoothing="none", patience=1))
    assert kinds(t, [2.0, 0.1]) == [("acceptable", 1), ("objective", 1)]


def test_patience_ignores_a_single_noisy_dip():
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), config(smoothing="none", patience=3))
    assert kinds(t, [2.0, 0.4, 2.0, 2.0, 0.9, 0.9, 0.9]) == [("acceptable", 6)]


def test_ewma_lags_and_never_passes_a_target_no_value_reached():
    cfg = config(smoothing="ewma", alpha=0.3, patience=1)
    t = TargetTracker(Targets(acceptable=1.0, objective=0.5), cfg)
    # the raw values reach 0.9 (acceptable) at step 1, the EWMA only later
    got = kinds(t, [2.0] + [0.9] * 12)
    assert got and got[0][0] == "acceptable" and got[0][1] > 1
    # values that never pass the objective never declare it, whatever the smoothing
    for smoothing in ("ewma", "median", "none"):
        t = TargetTracker(Targets(acceptable=1.0, objective=0.5), config(smoothing=smoothing, patience=1))
        assert all(k != "objective" for k, _ in kinds(t, [2.0, 0.6, 0.51, 0.5000001] * 10))


def test_median_ignores_an_outlier_the_ewma_would_follow():
    target = Targets(acceptable=1.0, objective=0.5)
    med = TargetTracker(target, config(smoothing="median", window=5, patience=1))
    assert kinds(med, [2.0, 2.0, 2.0, 0.01, 2.0]) == []
    ewma = TargetTracker(target, config(smoothing="ewma", alpha=0.9, patience=1))
    assert kinds(ewma, [2.0, 2.0, 2.0, 0.01, 2.0]) != []


def test_grace_then_hard_stop_once_unless_finished():
    cfg = config(smoothing="none", patience=1, grace_s=30)
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
    cfg = config(alpha=0.5, patience=2)
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
    from phasewise.apps.experiment.curves import replay

    result = replay(config())
    total = result["summary"]["total"]
    assert total["runs"] >= 140
    assert total["objective_before_reached"] == 0
    assert total["objective_declared"] >= 20  # Pollux's full-length curves are declared
    # unsmoothed with no patience, the noisy curves are stopped early more often than with the default
    raw = replay(config(smoothing="none", patience=1))["summary"]["total"]
    assert raw["false_early_stops"] > total["false_early_stops"]
    for row in result["runs"]:
        o = row["objective"]
        if o["declared"] is not None:
            assert o["reached"] is not None and o["declared"] >= o["reached"]


# ---------------------------------------------------------------------------- a node's division

def test_remaining_work_is_the_cpu_so_far_scaled_by_the_way_left():
    from phasewise.models.jobs.targets import remaining_work

    assert remaining_work(3.0, first=4.0, smoothed=3.0, objective=1.0) == pytest.approx(6.0)  # 1/3 of the way
    assert remaining_work(3.0, first=0.2, smoothed=0.5, objective=0.8) == pytest.approx(3.0)  # max: half way
    assert remaining_work(3.0, first=4.0, smoothed=0.9, objective=1.0) == 0.0  # past it
    assert remaining_work(3.0, first=4.0, smoothed=4.2, objective=1.0) == math.inf  # went the wrong way
    assert remaining_work(3.0, first=4.0, smoothed=4.0, objective=1.0) is None  # not moved yet
    assert remaining_work(None, first=4.0, smoothed=3.0, objective=1.0) is None
    assert remaining_work(0.0, first=4.0, smoothed=3.0, objective=1.0) is None  # no CPU measured yet
    assert remaining_work(3.0, first=None, smoothed=3.0, objective=1.0) is None


def test_tradl_holds_jobs_past_acceptable_only_while_another_is_short_of_it():
    from phasewise.models.jobs.targets import NodeJob, node_limits

    jobs = {"a": NodeJob(True, crossed="loss 0.9 <= acceptable 1"), "b": NodeJob(True), "c": NodeJob(False),
            "d": NodeJob(False)}
    p = node_limits(jobs, 8.0, shrink=0.25, host="h1")
    assert p.limits == {"a": 0.5, "b": 0.5, "c": None, "d": None}
    assert p.reasons["a"].startswith("loss 0.9 <= acceptable 1: held to 0.25 x 8 / 4 = 0.5 cores while c, d are")
    assert p.reasons["b"].startswith("b is past acceptable: held to")
    assert p.reasons["c"] == "no rule holds c on node h1 now (4 job(s) short of their objective): no limit"
    assert node_limits({k: NodeJob(True) for k in jobs}, 8.0).limits == dict.fromkeys(jobs)
    assert node_limits({}, 8.0).limits == {}


def test_the_share_rule_caps_and_its_reason_names_the_rule_the_node_use_and_each_share():
    from phasewise.models.jobs.targets import NodeJob, node_limits

    jobs = {"a": NodeJob(False, use=1.5), "b": NodeJob(False, use=0.3)}
    p = node_limits(jobs, 2.0, alpha=0.5, host="h1")
    assert p.limits == {"a": 0.5, "b": 0.667}
    assert p.reasons["a"] == ("TRADL share rule: node h1's 2 jobs use 1.8 cores > alpha 0.5 x 2 = 1; a uses 1.5 > "
                              "1/n = 1: 1/(2n) = 0.5 cores (shares: a 1.5 -> 0.5, b 0.3 -> 0.667)")
    assert "b uses 0.3 <= 1/n = 1: 1/(n+1) = 0.667 cores" in p.reasons["b"]
    assert node_limits(jobs, 2.0, alpha=0.95).limits == {"a": None, "b": None}  # 1.8 <= 1.9: compete freely
    # a job with no use known yet: the rule waits for it
    assert node_limits({**jobs, "c": NodeJob(False)}, 2.0, alpha=0.5).limits == {"a": None, "b": None, "c": None}
    # with the acceptable rule: the lower limit wins, both reasons are given
    both = node_limits({"a": NodeJob(True, use=1.5), "b": NodeJob(False, use=0.3)}, 2.0, alpha=0.5, shrink=0.9)
    assert both.limits["a"] == 0.5 and "(TRADL acceptable rule); TRADL share rule" in both.reasons["a"]


def test_nearest_gives_the_node_to_the_least_remaining_work_and_changes_hands_only_when_clearly_nearer():
    from phasewise.models.jobs.targets import NodeJob, node_limits

    p = node_limits({"a": NodeJob(remaining=4.0), "b": NodeJob(remaining=1.0), "c": NodeJob(remaining=9.0)}, 1.0,
                    policy="nearest", shrink=0.3, host="h1")
    assert p.favoured == "b" and p.limits == {"a": 0.1, "b": None, "c": 0.1}
    assert p.reasons["b"] == "nearest first: b is estimated 1 CPU-s from its objective, the least of node h1's 3 " \
                             "jobs: no limit"
    assert p.reasons["a"] == "nearest first: b is estimated 1 CPU-s from its objective, a 4: held to 0.3 x 1 / 3 = " \
                             "0.1 cores"
    # a is nearer now, but not by 10 %: b keeps the node; by more, a gets it
    close = {"a": NodeJob(remaining=0.95), "b": NodeJob(remaining=1.0)}
    assert node_limits(close, 1.0, policy="nearest", favoured="b").favoured == "b"
    assert node_limits({**close, "a": NodeJob(remaining=0.85)}, 1.0, policy="nearest", favoured="b").favoured == "a"
    # an estimate missing, or one job: nobody is held
    assert node_limits({"a": NodeJob(remaining=1.0), "b": NodeJob()}, 1.0, policy="nearest").limits == \
        {"a": None, "b": None}
    assert node_limits({"a": NodeJob(remaining=1.0)}, 1.0, policy="nearest").limits == {"a": None}
    assert node_limits({"a": NodeJob(remaining=math.inf), "b": NodeJob(remaining=math.inf)}, 1.0,
                       policy="nearest").limits == {"a": None, "b": None}
    with pytest.raises(ValueError, match="node policy"):
        node_limits({}, 1.0, policy="fastest")


def _fleet(**kw):
    from phasewise.models.jobs.targets import TargetsFleet

    return TargetsFleet(config(smoothing="none", patience=1, grace_s=30), capacity=lambda host: 8.0, **kw)


def _ev(job, ts, kind, **kw):
    from phasewise.kit.records import JobEvent, JobSpec, JobTargets

    if kind == "submitted":
        kw["spec"] = JobSpec(model="m", dataset="d", batch_size=8, targets=JobTargets(acceptable=1.0, objective=0.5))
    return JobEvent(job=job, ts=ts, kind=kind, **kw)


def _samples(ts, use, host="h1", cpus=2):
    from phasewise.kit.records import ContainerSample, HostSamples

    return HostSamples(host=host, ts=ts, interval_s=1.0, host_cpu_count=cpus,
                       containers=tuple(ContainerSample(container=c, cpu_cores=u, mem_bytes=1e8)
                                        for c, u in use.items()))


def test_the_fleet_applies_the_share_rule_from_the_samples_of_the_jobs_containers():
    f = _fleet(share_alpha=0.5, share_interval_s=10.0)
    for j in ("a", "b"):
        f.process(_ev(j, 1.0, "submitted"))
        f.process(_ev(j, 1.0, "started", host="h1", container=j))
    d = f.samples(_samples(100.0, {"a": 1.5, "b": 0.3, "other": 1.9}))  # 2 CPUs from the samples, not 8
    assert [(x.container, x.cpu_limit_cores, x.host) for x in d] == [("a", 0.5, "h1"), ("b", 0.667, "h1")]
    assert "TRADL share rule: node h1's 2 jobs use 1.8 cores > alpha 0.5 x 2 = 1" in d[0].reason
    assert d[0].details["capacity"] == 2.0
    assert f.samples(_samples(105.0, {"a": 0.5, "b": 0.3})) == []  # within the interval
    d = f.samples(_samples(111.0, {"a": 0.5, "b": 0.3}))  # 0.8 <= 1: compete freely: released to the node's cores
    assert [(x.container, x.cpu_limit_cores) for x in d] == [("a", 2.0), ("b", 2.0)]
    assert d[0].reason.startswith("released: ")
    assert f.samples(_samples(125.0, {"a": 0.5, "b": 0.3})) == []  # nothing changed
    assert f.jobs["a"].cpu_s == pytest.approx(1.5 + 0.5 + 0.5 + 0.5)
    assert f.samples(_samples(125.0, {"a": 9.0, "b": 0.3})) == [] and f.jobs["a"].use == 0.5  # a re-read: ignored


def test_nearest_in_the_fleet_waits_for_the_jobs_samples_and_favours_the_one_nearest_its_objective():
    f = _fleet(policy="nearest")
    for j in ("a", "b"):
        f.process(_ev(j, 1.0, "submitted"))
        f.process(_ev(j, 1.0, "started", host="h1", container=j))
    for step, (la, lb) in enumerate([(4.0, 4.0), (3.0, 3.8)], 1):  # no samples yet: no estimate, nobody held
        assert f.process(_ev("a", 2.0 + step, "progress", step=step, loss=la))[0] == []
        assert f.process(_ev("b", 2.0 + step, "progress", step=step, loss=lb))[0] == []
    f.samples(_samples(5.0, {"a": 1.0, "b": 1.0}))
    d, _, _ = f.process(_ev("a", 6.0, "progress", step=3, loss=2.5))  # a: 3/7 of the way to 0.5 in 1 CPU-s
    assert d == []  # b has no estimate at its last report yet
    d, _, _ = f.process(_ev("b", 6.0, "progress", step=3, loss=3.7))  # b: 3/35 of the way in 1 CPU-s
    assert [(x.container, x.cpu_limit_cores) for x in d] == [("b", 0.25)]  # 0.25 x 2 cores / 2 jobs
    assert d[0].reason == "nearest first: a is estimated 1.33 CPU-s from its objective, b 10.7: held to " \
                          "0.25 x 2 / 2 = 0.25 cores"
    assert d[0].details["remaining_cpu_s"] == pytest.approx(32 / 3)


def test_the_fleet_state_goes_to_a_table_and_back_and_a_restored_fleet_decides_the_same():
    import json

    def events():
        yield "e", _ev("a", 1.0, "submitted")
        yield "e", _ev("b", 1.0, "submitted")
        yield "e", _ev("a", 2.0, "started", host="h1", container="a")
        yield "e", _ev("b", 2.0, "started", host="h1", container="b")
        yield "s", _samples(3.0, {"a": 1.0, "b": 1.0})
        yield "e", _ev("a", 4.0, "progress", step=1, loss=2.0)
        yield "e", _ev("b", 4.0, "progress", step=1, loss=3.0)
        yield "s", _samples(5.0, {"a": 1.0, "b": 1.0})
        yield "e", _ev("a", 6.0, "progress", step=2, loss=0.9)  # acceptable: held while b is short
        yield "s", _samples(7.0, {"a": 0.25, "b": 1.5})
        yield "e", _ev("b", 8.0, "progress", step=2, loss=1.5)
        yield "e", _ev("a", 9.0, "progress", step=3, loss=0.4)  # objective: checkpoint_exit
        yield "t", 39.0  # the hard stop falls due
        yield "e", _ev("b", 40.0, "progress", step=3, loss=0.4)

    def run(fleet, steps, store=None):
        out = []
        for kind, x in steps:
            if kind == "e":
                d, c, why = fleet.process(x)
                assert why is None
                out += [(v.action, v.container, v.cpu_limit_cores, v.reason) for v in d]
                out += [(v.action, v.job, v.id) for v in c]
            elif kind == "s":
                out += [(v.action, v.container, v.cpu_limit_cores, v.reason) for v in fleet.samples(x)]
            else:
                out += [(v.action, v.container, v.id) for v in fleet.due(x)]
            if store is not None:
                for job, state in fleet.pop_dirty():
                    store[job] = None if state is None else json.dumps(state)
        return out

    for policy in ("tradl", "nearest"):
        steps = list(events())
        whole = run(_fleet(policy=policy), steps)
        assert [x[:2] for x in whole if x[0] != "limit"] == [("checkpoint_exit", "a"), ("terminate", "a"),
                                                              ("checkpoint_exit", "b")]
        assert any(x[0] == "limit" for x in whole), whole
        for cut in range(1, len(steps)):
            table: dict = {}
            before = run(_fleet(policy=policy), steps[:cut], table)
            again = _fleet(policy=policy)
            for job, raw in table.items():
                if raw is not None:
                    again.load(job, json.loads(raw))
            after = run(again, steps[cut:])
            assert before + after == whole, (policy, cut)
    with pytest.raises(ValueError, match="version"):
        _fleet().load("a", {"v": 99})


def test_a_new_priority_is_not_progress_for_the_targets_fleet():
    f = _fleet()
    f.process(_ev("a", 1.0, "submitted"))
    before = f.jobs["a"].tracker.last_step
    assert f.process(_ev("a", 2.0, "priority", priority=7)) == ([], [], None)  # the priority agent's, not a loss
    assert f.jobs["a"].tracker.last_step == before


def test_a_stage_report_without_a_loss_is_not_progress_but_a_bare_report_is_refused():
    f = _fleet()
    f.process(_ev("a", 1.0, "submitted"))
    before = f.jobs["a"].tracker.last_step
    # `phasewise progress --stages`: an eval or checkpoint line carries its stage and no training loss
    assert f.process(_ev("a", 2.0, "progress", step=3, stage="eval")) == ([], [], None)
    assert f.jobs["a"].tracker.last_step == before
    assert f.process(_ev("a", 3.0, "progress", step=3))[2] == "job 'a': progress carries no loss"
