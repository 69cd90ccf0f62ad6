"""The DynamoML priority policy: preemption order, freeze or stop, resume order, state."""

from __future__ import annotations

import json

import pytest

from phasewise.kit.records import Decision, decode, encode
from phasewise.models.jobs.priorities import (
    Capacity,
    JobRequest,
    PriorityConfig,
    PriorityPolicy,
    to_decision,
)

GB = 1e9


def policy(cpu=4.0, mem=16 * GB, gpus=0.0, **cfg) -> PriorityPolicy:
    cfg = {"freeze_max_wait_s": 120.0, "grace_s": 30.0, "cpu_weight_ratio": None, **cfg}
    return PriorityPolicy(PriorityConfig(**cfg), {"n1": Capacity(cpu, mem, gpus), "n2": Capacity(cpu, mem, gpus)})


def kinds(actions):
    return [(a.kind, a.job) for a in actions]


def test_victims_are_the_least_important_and_only_as_many_as_needed():
    p = policy(cpu=4)
    p.submit(JobRequest("t0", "n1", cpu_cores=1, priority=0), now=0)
    p.submit(JobRequest("t1", "n1", cpu_cores=1, priority=1), now=1)
    p.submit(JobRequest("i2", "n1", cpu_cores=1, priority=2, workload="interactive"), now=2)
    p.submit(JobRequest("x", "n2", cpu_cores=4, priority=-5), now=2)  # another host: never a victim
    # 1 core free, needs 2: one victim (the lowest priority), not two
    acts = p.submit(JobRequest("h", "n1", cpu_cores=2, priority=9, expected_s=10), now=3)
    assert kinds(acts) == [("freeze", "t0"), ("start", "h")]
    assert p.states() == {"h": "running", "i2": "running", "t0": "frozen", "t1": "running", "x": "running"}


def test_the_greedy_set_is_pruned_to_an_irreducible_one():
    p = policy(cpu=4)
    p.submit(JobRequest("small", "n1", cpu_cores=0.5, priority=0), now=0)
    p.submit(JobRequest("big", "n1", cpu_cores=3.5, priority=1), now=1)
    # needs 3 cores: greedy takes small (0.5) then big (3.5); big alone covers it, so small is spared
    acts = p.submit(JobRequest("h", "n1", cpu_cores=3, priority=5, expected_s=1), now=2)
    assert kinds(acts) == [("freeze", "big"), ("start", "h")]


def test_ties_break_by_class_then_most_recent_start_then_id():
    p = policy(cpu=3)
    p.submit(JobRequest("inf", "n1", cpu_cores=1, workload="inference"), now=0)
    p.submit(JobRequest("old", "n1", cpu_cores=1), now=1)
    p.submit(JobRequest("new", "n1", cpu_cores=1), now=2)
    acts = p.submit(JobRequest("h", "n1", cpu_cores=1, priority=1, expected_s=1), now=3)
    assert kinds(acts) == [("freeze", "new"), ("start", "h")]  # training before inference, newest first
    acts = p.submit(JobRequest("h2", "n1", cpu_cores=1, priority=1, expected_s=1), now=4)
    assert kinds(acts) == [("freeze", "old"), ("start", "h2")]


def test_equal_or_higher_priority_jobs_are_never_preempted_and_the_newcomer_waits():
    p = policy(cpu=2)
    p.submit(JobRequest("a", "n1", cpu_cores=2, priority=3), now=0)
    assert p.submit(JobRequest("b", "n1", cpu_cores=1, priority=3), now=1) == []
    assert p.state("b") == "pending"
    assert kinds(p.finish("a", now=2)) == [("start", "b")]


def test_freeze_for_short_waits_stop_for_long_unknown_or_memory():
    for expected, mem, want in [(60, 0, "freeze"), (61, 0, "checkpoint_stop"), (None, 0, "checkpoint_stop"),
                                (1, 12 * GB, "checkpoint_stop")]:
        p = policy(cpu=2, mem=16 * GB, freeze_max_wait_s=60)
        p.submit(JobRequest("low", "n1", cpu_cores=2, mem_bytes=8 * GB), now=0)
        acts = p.submit(JobRequest("h", "n1", cpu_cores=1, mem_bytes=mem, priority=1, expected_s=expected), now=1)
        assert kinds(acts) == [(want, "low"), ("start", "h")], (expected, mem)
        if want == "checkpoint_stop":
            assert acts[0].details["grace_s"] == 30.0


def test_a_frozen_job_keeps_its_memory():
    p = policy(cpu=2, mem=10 * GB)
    p.submit(JobRequest("low", "n1", cpu_cores=2, mem_bytes=6 * GB), now=0)
    p.submit(JobRequest("h", "n1", cpu_cores=2, mem_bytes=1 * GB, priority=1, expected_s=1), now=1)
    assert p.state("low") == "frozen"
    assert p.used("n1") == Capacity(2, 7 * GB, 0)
    # 5 GB does not fit next to the frozen job's 6 GB: a second high job waits rather than overcommit
    assert p.submit(JobRequest("h2", "n1", cpu_cores=0, mem_bytes=5 * GB, priority=1), now=2) == []


def test_resume_in_priority_order_without_backfill():
    p = policy(cpu=3)
    p.submit(JobRequest("p0", "n1", cpu_cores=1, priority=0), now=0)
    p.submit(JobRequest("p1", "n1", cpu_cores=1, priority=1), now=1)
    p.submit(JobRequest("p2", "n1", cpu_cores=1, priority=2), now=2)
    acts = p.submit(JobRequest("h", "n1", cpu_cores=3, priority=9), now=3)  # unknown wait: stop all three
    assert kinds(acts) == [("checkpoint_stop", "p0"), ("checkpoint_stop", "p1"), ("checkpoint_stop", "p2"),
                           ("start", "h")]
    p.submit(JobRequest("late", "n1", cpu_cores=0.5, priority=0), now=4)
    assert p.state("late") == "pending"
    acts = p.finish("h", now=5)
    assert kinds(acts) == [("restart", "p2"), ("restart", "p1"), ("restart", "p0")]
    assert p.state("late") == "pending"  # no capacity left, and it never jumped ahead


def test_a_big_waiting_job_blocks_smaller_less_important_ones():
    p = policy(cpu=2)
    p.submit(JobRequest("a", "n1", cpu_cores=1.5, priority=5), now=0)
    p.submit(JobRequest("big", "n1", cpu_cores=1, priority=4), now=1)   # waits (0.5 free)
    assert p.submit(JobRequest("tiny", "n1", cpu_cores=0.5, priority=1), now=2) == []  # would fit; waits behind big
    assert kinds(p.finish("a", now=3)) == [("start", "big"), ("start", "tiny")]


def test_gpus_are_preempted_too():
    p = policy(cpu=8, gpus=1.0)
    p.submit(JobRequest("a", "n1", cpu_cores=1, gpus=0.5), now=0)
    p.submit(JobRequest("b", "n1", cpu_cores=1, gpus=0.5, priority=1), now=1)
    acts = p.submit(JobRequest("h", "n1", cpu_cores=1, gpus=0.5, priority=2, expected_s=5), now=2)
    assert kinds(acts) == [("freeze", "a"), ("start", "h")]


def test_state_round_trips_and_decisions_are_records():
    p = policy(cpu=2)
    p.submit(JobRequest("low", "n1", cpu_cores=2), now=0)
    acts = p.submit(JobRequest("h", "n1", cpu_cores=1, priority=1), now=1)
    q = PriorityPolicy.from_state(p.config, {"n1": Capacity(2, 16 * GB), "n2": Capacity(2, 16 * GB)},
                                  json.loads(json.dumps(p.to_state())))
    assert q.states() == p.states()
    assert kinds(q.finish("h", 2)) == kinds(p.finish("h", 2)) == [("restart", "low")]
    d = to_decision(acts[0], ts=1.0)
    assert (d.action, d.details["mode"], d.container) == ("terminate", "checkpoint", "low")
    assert decode(Decision, encode(d)) == d
    assert to_decision(acts[0], ts=1.0).id == d.id != to_decision(acts[0], ts=2.0).id


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="workload"):
        JobRequest("a", "n1", workload="batch")
    with pytest.raises(ValueError, match="cpu_cores"):
        JobRequest("a", "n1", cpu_cores=float("nan"))
    p = policy()
    with pytest.raises(KeyError, match="unknown host"):
        p.submit(JobRequest("a", "nX"), now=0)
    p.submit(JobRequest("a", "n1"), now=0)
    with pytest.raises(ValueError, match="already"):
        p.submit(JobRequest("a", "n1"), now=1)


# ------------------------------------------------------------------------------------- CPU weights


def test_cpu_weights_follow_the_order_of_importance():
    from phasewise.models.jobs.priorities import CLASS_RANK, WEIGHT_MAX, WEIGHT_MIN, cpu_weight

    jobs = [(p, w) for p in range(-12, 20) for w in CLASS_RANK]
    for ratio in (1.0, 1.3, 2.0, 10.0):
        ranked = sorted(jobs, key=lambda j: (j[0], CLASS_RANK[j[1]]))  # least important first
        ws = [cpu_weight(p, w, ratio) for p, w in ranked]
        assert ws == sorted(ws), ratio  # never less for a more important job
        assert all(WEIGHT_MIN <= x <= WEIGHT_MAX for x in ws)
    assert cpu_weight(0, "training") == 100  # a cgroup nobody weighted
    assert cpu_weight(0, "inference", 2.0) > cpu_weight(0, "interactive", 2.0) > cpu_weight(0, "training", 2.0)
    assert cpu_weight(1, "training", 2.0) > cpu_weight(0, "inference", 2.0)  # a level outranks any class
    assert {cpu_weight(p, "inference", 1.0) for p in range(-50, 50)} == {100}  # ratio 1: all equal
    assert cpu_weight(10**9, "inference", 10.0) == WEIGHT_MAX and cpu_weight(-10**9, "training", 10.0) == WEIGHT_MIN
    for bad in ({"priority": 1.5}, {"priority": True}, {"workload": "batch"}, {"ratio": 0.5},
                {"ratio": float("inf")}):
        args = {"priority": 0, "workload": "training", "ratio": 2.0, **bad}
        with pytest.raises(ValueError):
            cpu_weight(args["priority"], args["workload"], args["ratio"])


def test_a_job_gets_its_weight_when_it_starts_or_restarts_not_when_thawed():
    p = policy(cpu=2, cpu_weight_ratio=2.0)
    acts = p.submit(JobRequest("low", "n1", cpu_cores=2), now=0)
    assert kinds(acts) == [("start", "low"), ("weight", "low")]
    assert acts[1].details["cpu_weight"] == 100 and "priority 0 training" in acts[1].reason
    acts = p.submit(JobRequest("inf", "n1", cpu_cores=1, priority=3, workload="inference", expected_s=5), now=1)
    assert kinds(acts) == [("freeze", "low"), ("start", "inf"), ("weight", "inf")]
    assert acts[2].details["cpu_weight"] == round(100 * 2 ** (3 + 2 / 3))
    assert kinds(p.finish("inf", now=2)) == [("thaw", "low")]  # its cgroup kept its weight
    acts = p.submit(JobRequest("big", "n1", cpu_cores=2, priority=1), now=3)  # unknown wait: checkpoint-stop
    assert kinds(acts) == [("checkpoint_stop", "low"), ("start", "big"), ("weight", "big")]
    assert kinds(p.finish("big", now=4)) == [("restart", "low"), ("weight", "low")]
    assert kinds(policy(cpu=2).submit(JobRequest("x", "n1", cpu_cores=1), now=0)) == [("start", "x")]  # off


def test_a_new_priority_gives_a_new_weight_and_may_preempt_or_admit():
    p = policy(cpu=2, cpu_weight_ratio=2.0, freeze_max_wait_s=60)
    p.submit(JobRequest("a", "n1", cpu_cores=1), now=0)
    p.submit(JobRequest("b", "n1", cpu_cores=1, priority=2), now=1)
    assert kinds(p.submit(JobRequest("c", "n1", cpu_cores=1, priority=1, expected_s=10), now=2)) == [
        ("freeze", "a"), ("start", "c"), ("weight", "c")]
    acts = p.reprioritize("c", 5, now=3)  # running: new weight, nothing else moves
    assert kinds(acts) == [("weight", "c")] and acts[0].details["cpu_weight"] == 3200
    assert "priority 1 -> 5" in acts[0].reason
    assert p.reprioritize("c", 5, now=4) == []  # no change, no decision
    # the frozen a, now above b: b is preempted for it (a's expected time is unknown: checkpoint-stop)
    acts = p.reprioritize("a", 3, now=5)
    assert kinds(acts) == [("weight", "a"), ("checkpoint_stop", "b"), ("thaw", "a")]
    assert p.states() == {"a": "running", "b": "stopped", "c": "running"}
    with pytest.raises(KeyError, match="unknown job"):
        p.reprioritize("nobody", 1, now=6)
    with pytest.raises(ValueError, match="integer"):
        p.reprioritize("a", 1.5, now=6)
    assert p.states()["a"] == "running"


def test_a_job_s_state_alone_round_trips():
    p = policy(cpu=2)
    p.submit(JobRequest("low", "n1", cpu_cores=2, mem_bytes=GB), now=0)
    p.submit(JobRequest("h", "n1", cpu_cores=1, priority=1, expected_s=5), now=1)
    q = policy(cpu=2)
    for j in ("h", "low"):
        assert q.load_job(json.loads(json.dumps(p.job_state(j)))) == j
    by_job = lambda st: sorted(st["jobs"], key=lambda j: j["req"]["job"])  # noqa: E731
    assert by_job(q.to_state()) == by_job(p.to_state())
    assert kinds(q.finish("h", 2)) == kinds(p.finish("h", 2)) == [("thaw", "low")]
    assert p.job_state("nobody") is None
    for bad in ({**p.job_state("low"), "v": 99}, {**p.job_state("low"), "state": "zombie"},
                {**p.job_state("low"), "req": {**p.job_state("low")["req"], "host": "nX"}}):
        with pytest.raises((ValueError, KeyError)):
            policy().load_job(bad)


def test_weight_decisions_are_records_with_the_weight():
    p = policy(cpu=2, cpu_weight_ratio=2.0)
    acts = p.submit(JobRequest("j", "n1", cpu_cores=1, priority=2, workload="interactive"), now=0)
    d = to_decision(acts[1], ts=5.0, container="j-ctr")
    assert (d.action, d.container, d.details["cpu_weight"]) == ("weight", "j-ctr", 504)
    assert decode(Decision, encode(d)) == d
    other = to_decision(p.reprioritize("j", 3, now=1)[0], ts=5.0, container="j-ctr")
    assert other.id != d.id  # same time, another weight: another decision
