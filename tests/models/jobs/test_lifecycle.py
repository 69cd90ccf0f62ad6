"""Every booking is freed (docs/jobs.md, "Who frees what"), without Faust: the placement state, the priority
and targets steps and horus's state act on the states that end a job; a placed job with no ``started`` within
``job_start_timeout_s`` is released as ``lost``; repeated and out-of-order states change nothing and are
counted; a second submission of a known id and targets in the wrong order are refused."""

from __future__ import annotations

import pytest

from phasewise.kit.records import HostSamples, JobEvent, JobRequests, JobSpec, JobTargets, encode
from phasewise.kit.settings import Settings
from phasewise.models.jobs.events import Refused
from phasewise.models.jobs.lifecycle import Lifecycle
from phasewise.models.jobs.placement.state import PlacementState
from phasewise.models.jobs.priorities import PriorityConfig
from phasewise.models.jobs.targets_step import TargetsStep
from phasewise.streams.config import placement_state_config, submissions, targets_step_config
from tests.models.jobs.test_priority_step import make as priority_step
from tests.models.jobs.test_priority_step import submitted as priority_submitted

GIB = 1 << 30


def _nodes(cpus: int = 1) -> HostSamples:
    return HostSamples(host="here", ts=1.0, interval_s=1.0, host_cpu_count=2 * cpus, host_cpu_cores=0.0,
                       host_mem_bytes=GIB, host_mem_total_bytes=32 * GIB)


def _state(**kw) -> PlacementState:
    """Two one-CPU slices of host ``here`` (docs/placement.md's local run), no prediction wait."""
    settings = Settings.from_env({"host": "here", "place_prediction_wait_s": 0.0, "place_local_nodes": "s0=0;s1=1",
                                  **kw}, env={})
    s = PlacementState(placement_state_config(settings), submissions(settings))
    s.samples(_nodes())
    return s


def _job(name: str, ts: float = 1.0, targets: JobTargets | None = None) -> JobEvent:
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=8, command=("true",), targets=targets,
                   requests=JobRequests(cpu_cores=1.0, mem_bytes=GIB))
    return JobEvent(job=name, ts=ts, kind="submitted", spec=spec)


def _ev(job: str, kind: str, ts: float, **kw) -> JobEvent:
    return JobEvent(job=job, ts=ts, kind=kind, **kw)


def _place(s: PlacementState, ts: float) -> list[str]:
    return [d.details.get("job", d.container) for d, _p in s.decide(now=1e9, ts=ts)]


def _three(s: PlacementState) -> None:
    for j in ("a", "b", "c"):
        s.job_event(_job(j), now=0.0)
    assert _place(s, 10.0) == ["a", "b"] and list(s.waiting) == ["c"]


@pytest.mark.parametrize("kind", ["finished", "failed", "rejected", "lost", "terminated"])
def test_each_state_that_ends_a_job_frees_its_booking_and_the_waiting_job_takes_it(kind):
    s = _state()
    _three(s)
    if kind != "rejected":  # (the actuator refused its decision: it never started)
        s.job_event(_ev("a", "started", 11.0, host="here", container="a"), now=0.0)
    s.job_event(_ev("a", kind, 20.0, reason="why" if kind in ("rejected", "lost") else None), now=0.0)
    assert "a" not in s.placed and "a" not in s.events
    assert _place(s, 21.0) == ["c"] and not s.waiting
    assert [k for k, _p, v in s.writes() if v is None] == ["job/a"]  # its table record is deleted
    assert s.lifecycle.take_counts() == {}


def test_out_of_order_and_repeated_states_change_nothing_beyond_the_first_and_are_counted():
    s = _state()
    _three(s)
    # finished before started: it ends the job (its booking frees); the started that follows changes nothing
    s.job_event(_ev("a", "finished", 20.0, exit_code=0, run_s=1.0), now=0.0)
    assert _place(s, 21.0) == ["c"]
    s.job_event(_ev("a", "started", 19.0, host="here", container="a"), now=0.0)
    # two finishes, and a failed after the finish: the first stands
    s.job_event(_ev("a", "finished", 22.0), now=0.0)
    s.job_event(_ev("a", "failed", 23.0, exit_code=1), now=0.0)
    # a state of a job it never held
    s.job_event(_ev("nobody", "finished", 24.0), now=0.0)
    s.job_event(_ev("nobody", "started", 24.0, host="here", container="nobody"), now=0.0)
    # the very record that ended it, read again (after a restart): not counted
    s.job_event(_ev("a", "finished", 20.0, exit_code=0, run_s=1.0), now=0.0)
    # a started of a waiting job it did not place; b started twice
    s.job_event(_job("d"), now=0.0)
    assert _place(s, 25.0) == [] and "d" in s.waiting
    s.job_event(_ev("d", "started", 26.0, host="here", container="d"), now=0.0)
    s.job_event(_ev("b", "started", 27.0, host="here", container="b"), now=0.0)
    s.job_event(_ev("b", "started", 28.0, host="here", container="b"), now=0.0)
    assert s.lifecycle.take_counts() == {"after_end": 1, "repeated": 3, "unknown_job": 2, "not_placed": 1}
    assert s.lifecycle.take_counts() == {}
    # nothing else moved: b and c hold the two slices, d waits
    assert set(s.placed) == {"b", "c"} and list(s.waiting) == ["d"] and s.placed["b"]["started"] == 27.0


def test_a_placed_job_with_no_started_within_the_timeout_is_lost_by_event_time():
    s = _state(job_start_timeout_s=30.0)
    _three(s)
    s.job_event(_ev("b", "started", 15.0, host="here", container="b"), now=0.0)  # b is alive: never lost
    assert s.expire(39.99) == [] and set(s.placed) == {"a", "b"}
    [(lost, sub)] = s.expire(40.0)
    assert (lost.job, lost.kind, lost.ts, lost.host, lost.container) == ("a", "lost", 40.0, "here", "a")
    assert lost.reason.startswith("no sign of life: no started event within job_start_timeout_s 30 s of its place "
                                  "decision at 10.000 on s0")
    assert sub == _job("a") and "a" not in s.placed and "a" not in s.events
    assert _place(s, 41.0) == ["c"]  # its slice went to the waiting job, whose own clock starts now
    assert s.start_by == {"c": 71.0} and s.expire(1000.0)[0][0].job == "c"
    # its own lost event read back changes nothing and is not counted; a late started is
    s.job_event(lost, now=0.0)
    s.job_event(_ev("a", "started", 42.0, host="here", container="a"), now=0.0)
    assert s.lifecycle.take_counts() == {"after_end": 1}
    assert s.expire(10_000.0) == []


def test_the_lost_deadline_survives_a_restart_and_zero_means_never():
    s = _state(job_start_timeout_s=30.0)
    _three(s)
    table = {k: v for k, _p, v in s.writes()}
    t = _state(job_start_timeout_s=30.0)
    t.restore(table.items())
    assert t.start_by == {"a": 40.0, "b": 40.0} and [ev.job for ev, _ in t.expire(40.0)] == ["a", "b"]
    never = _state(job_start_timeout_s=0.0)
    _three(never)
    assert never.start_by == {} and never.expire(1e12) == []


def test_after_admission_the_exit_of_the_priority_agent_s_own_stop_frees_nothing_more():
    s = _state(place_after_admission=True)
    s.job_event(_job("a"), now=0.0)
    s.job_event(_ev("a", "admitted", 5.0, host="here", container="a"), now=0.0)
    assert _place(s, 10.0) == ["a"]
    s.job_event(_ev("a", "started", 11.0, host="here", container="a"), now=0.0)
    s.job_event(_ev("a", "stopped", 12.0, host="here", container="a"), now=0.0)  # its checkpoint stop
    assert "a" not in s.placed and "a" in s.resumable
    s.job_event(_ev("a", "terminated", 13.0, signal="SIGTERM", run_s=2.0), now=0.0)  # the exit it asked for
    assert "a" in s.events and "a" not in s.resumable  # kept: it is resumed
    s.job_event(_ev("a", "admitted", 14.0, host="here", container="a", resume=True), now=0.0)
    assert _place(s, 15.0) == ["a"]
    s.job_event(_ev("a", "started", 16.0, host="here", container="a"), now=0.0)
    # another's terminate (a target reached) ends it for good
    s.job_event(_ev("a", "terminated", 30.0, signal="SIGKILL", run_s=14.0), now=0.0)
    assert not s.holds("a") and s.cluster.allocs == {}
    assert s.lifecycle.take_counts() == {}


def test_a_stop_hint_read_before_the_started_event_still_keeps_the_job_for_its_resume():
    s = _state(place_after_admission=True)
    s.job_event(_job("a"), now=0.0)
    s.job_event(_ev("a", "admitted", 5.0, host="here", container="a"), now=0.0)
    assert _place(s, 10.0) == ["a"]
    s.job_event(_ev("a", "stopped", 12.0, host="here", container="a"), now=0.0)
    s.job_event(_ev("a", "started", 11.5, host="here", container="a"), now=0.0)  # (not placed any more)
    s.job_event(_ev("a", "terminated", 13.0, signal="SIGTERM"), now=0.0)
    assert s.holds("a") and "a" in s.events
    assert s.lifecycle.take_counts() == {"not_placed": 1}


def test_a_rejected_of_a_job_whose_process_started_is_an_older_decision_refused_again():
    s = _state()
    _three(s)
    s.job_event(_ev("a", "started", 11.0, host="here", container="a"), now=0.0)
    s.job_event(_ev("a", "rejected", 12.0, reason="decision older than decision_max_age_s"), now=0.0)
    s.job_event(_ev("b", "rejected", 12.0, reason="no command"), now=0.0)  # b never started: it ends
    assert set(s.placed) == {"a"} and s.lifecycle.take_counts() == {"after_start": 1}
    p = _prio()
    p.handle(priority_submitted("a", 1, cpu=1))
    p.handle(encode(_ev("a", "started", 2.0, host="n1", container="a")))
    assert _decided(p.handle(encode(_ev("a", "rejected", 3.0, reason="stale")))) == []
    assert p.policy.states() == {"a": "running"} and p.lifecycle.take_counts() == {"after_start": 1}


def test_a_second_submission_of_a_known_id_is_refused_and_the_same_record_read_again_is_not():
    s = _state()
    _three(s)
    s.job_event(_job("a"), now=0.0)  # the same record again: nothing
    s.job_event(_job("c"), now=0.0)
    with pytest.raises(Refused, match="job id 'a' already submitted .*placed.*submit it under another id") as e:
        s.job_event(_job("a", ts=50.0), now=0.0)
    assert e.value.kind == "duplicate"
    with pytest.raises(Refused, match="job id 'c' already submitted .*waiting"):
        s.job_event(_job("c", ts=50.0), now=0.0)
    s.job_event(_ev("a", "finished", 60.0), now=0.0)
    s.job_event(_job("a"), now=0.0)  # its submission read again after it ended: not placed a second time
    assert "a" not in s.events
    with pytest.raises(Refused, match=r"job id 'a' already submitted \(it ended: finished at 60.000\)"):
        s.job_event(_job("a", ts=61.0), now=0.0)
    assert set(s.placed) == {"b"} and _place(s, 62.0) == ["c"]


def test_targets_in_the_wrong_order_for_their_direction_book_nothing():
    s = _state()
    with pytest.raises(Refused, match="targets: objective 0.9 is above acceptable 0.5, but direction min needs"):
        s.job_event(_job("t", targets=JobTargets(acceptable=0.5, objective=0.9)), now=0.0)
    with pytest.raises(Refused, match="objective 0.5 is below acceptable 0.9, but direction max needs"):
        s.job_event(_job("t", targets=JobTargets(direction="max", metric="acc", acceptable=0.9, objective=0.5)),
                    now=0.0)
    assert not s.events and _place(s, 1.0) == []


# ---------------------------------------------------------------------------------------------- priorities

def _prio(**kw):
    return priority_step(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None), **kw)


def _decided(out) -> list[tuple[str, str]]:
    decisions, _controls = out
    return [(d.action, d.container) for d in decisions]


@pytest.mark.parametrize("kind", ["finished", "failed", "rejected", "lost", "terminated"])
def test_the_priority_agent_frees_what_a_job_held_on_each_state_that_ends_it(kind):
    p = _prio()
    assert _decided(p.handle(priority_submitted("a", 1, cpu=2))) == [("place", "a")]
    assert _decided(p.handle(priority_submitted("b", 2, cpu=2))) == []  # waits for a's cores
    assert _decided(p.handle(encode(_ev("a", kind, 10.0)))) == [("place", "b")]
    assert p.policy.states() == {"b": "running"} and "a" not in p.jobs
    assert p.lifecycle.take_counts() == {}


def test_the_exit_of_its_own_checkpoint_stop_is_not_an_end_but_a_later_terminate_is():
    p = _prio()
    p.handle(priority_submitted("low", 1, cpu=2))
    p.handle(encode(_ev("low", "started", 2.0, host="n1", container="low")))
    # hi preempts low (unknown holding time: checkpoint-and-stop)
    assert _decided(p.handle(priority_submitted("hi", 3, cpu=2, priority=5))) == [("terminate", "low"),
                                                                                 ("place", "hi")]
    assert _decided(p.handle(encode(_ev("low", "terminated", 4.0, signal="SIGTERM")))) == []  # the exit it asked
    assert p.policy.states() == {"hi": "running", "low": "stopped"}
    # hi ends: low restarts; later a target's terminate ends low for good
    assert _decided(p.handle(encode(_ev("hi", "finished", 5.0, exit_code=0)))) == [("place", "low")]
    p.handle(encode(_ev("low", "started", 6.0, host="n1", container="low")))
    assert _decided(p.handle(encode(_ev("low", "terminated", 7.0, signal="SIGKILL")))) == []
    assert p.policy.states() == {} and p.jobs == {}


def test_the_priority_agent_counts_repeated_and_late_states_and_refuses_a_known_id():
    p = _prio()
    p.handle(priority_submitted("a", 1, cpu=1))
    p.handle(encode(_ev("a", "finished", 5.0)))
    p.handle(encode(_ev("a", "finished", 5.0)))  # the same record: not counted
    p.handle(encode(_ev("a", "failed", 6.0)))
    p.handle(encode(_ev("a", "started", 7.0, host="n1", container="a")))
    p.handle(encode(_ev("ghost", "lost", 8.0)))
    assert p.lifecycle.take_counts() == {"repeated": 1, "after_end": 1, "unknown_job": 1}
    p.handle(priority_submitted("b", 1, cpu=1))
    with pytest.raises(Refused, match="job id 'b' already submitted") as e:
        p.handle(priority_submitted("b", 2, cpu=1))
    assert e.value.kind == "duplicate"
    with pytest.raises(Refused, match=r"job id 'a' already submitted \(it ended: finished"):
        p.handle(priority_submitted("a", 9, cpu=1))
    assert p.handle(priority_submitted("a", 1, cpu=1)) == ([], [])  # its own submission read again


def test_a_job_the_priority_agent_started_itself_with_no_started_event_is_lost():
    p = _prio(start_timeout_s=30.0)
    p.handle(priority_submitted("a", 1, cpu=2))
    p.handle(priority_submitted("b", 2, cpu=2))
    assert p.expire(30.99) == ([], [], [])
    decisions, controls, lost = p.expire(31.0)
    assert [(e.job, e.kind, e.ts) for e in lost] == [("a", "lost", 31.0)] and controls == []
    assert "no started event within job_start_timeout_s 30 s of its start decision on n1" in lost[0].reason
    assert [(d.action, d.container) for d in decisions] == [("place", "b")]
    p.handle(encode(_ev("b", "started", 32.0, host="n1", container="b")))
    assert p.expire(1e9) == ([], [], [])  # b is alive
    p.handle(encode(lost[0]))  # its own lost event read back: nothing, not counted
    assert p.lifecycle.take_counts() == {} and p.policy.states() == {"b": "running"}
    # with the placement agent as launcher, the timeout is the placement agent's
    q = _prio(launcher="place", start_timeout_s=30.0)
    q.handle(priority_submitted("a", 1, cpu=2))
    assert q.expire(1e9) == ([], [], [])
    # an event stamped long ago and read late: its deadline runs from the worker's clock at the decision
    late = _prio(start_timeout_s=30.0, now=lambda: 5000.0)
    late.handle(priority_submitted("a", 1, cpu=2))
    assert late.expire(5029.0) == ([], [], []) and late.expire(5030.0)[2][0].job == "a"


# ---------------------------------------------------------------------------------------------- targets

def _targets() -> TargetsStep:
    settings = Settings.from_env({"host": "h1", "targets_patience": 1, "targets_ewma_alpha": 1.0,
                                  "targets_node_cores": 4.0}, env={})
    return TargetsStep(targets_step_config(settings))


def _tsub(job: str, ts: float = 1.0) -> bytes:
    return encode(_job(job, ts=ts, targets=JobTargets(acceptable=1.0, objective=0.5)))


@pytest.mark.parametrize("kind", ["finished", "failed", "rejected", "lost"])
def test_the_targets_agent_forgets_a_job_on_each_state_that_ends_it_and_releases_its_node(kind):
    t = _targets()
    for j in ("a", "b"):
        t.handle(_tsub(j))
        t.handle(encode(_ev(j, "started", 2.0, host="n7", container=j)))
    t.handle(encode(_ev("a", "progress", 3.0, step=1, loss=0.9)))  # a past acceptable: held
    assert t.fleet.jobs["a"].limit is not None
    decisions, _ = t.handle(encode(_ev("b", kind, 4.0)))
    assert set(t.fleet.jobs) == {"a"} and [d.container for d in decisions] == ["a"]  # alone: released
    assert decisions[0].details["released"] is True
    t.handle(encode(_ev("b", "finished", 5.0)))
    t.handle(encode(_ev("b", "started", 6.0, host="n7", container="b")))
    t.handle(encode(_ev("zzz", "finished", 6.0)))  # a job without targets: not its concern, not counted
    assert t.lifecycle.take_counts() == {"repeated": 1, "after_end": 1}


def test_a_preempted_job_leaves_its_node_until_it_starts_again_and_one_stopped_at_its_objective_is_forgotten():
    t = _targets()
    t.handle(_tsub("a"))
    t.handle(encode(_ev("a", "started", 2.0, host="n7", container="a")))
    t.handle(encode(_ev("a", "terminated", 3.0, signal="SIGTERM")))  # a preemption: kept, off its node
    assert t.fleet.jobs["a"].host is None
    t.handle(encode(_ev("a", "started", 4.0, host="n7", container="a")))
    assert t.fleet.jobs["a"].host == "n7"
    t.handle(encode(_ev("a", "progress", 5.0, step=1, loss=0.4)))  # past its objective: checkpoint_exit
    t.handle(encode(_ev("a", "progress", 6.0, step=2, loss=0.3)))
    assert t.fleet.jobs["a"].tracker.state in ("objective", "stopped")
    t.handle(encode(_ev("a", "terminated", 7.0, signal="SIGTERM")))
    assert "a" not in t.fleet.jobs


def test_the_targets_agent_refuses_a_second_submission_of_a_followed_id():
    t = _targets()
    t.handle(_tsub("a"))
    with pytest.raises(Refused, match="job id 'a' already submitted") as e:
        t.handle(_tsub("a", ts=2.0))
    assert e.value.kind == "duplicate"


# ---------------------------------------------------------------------------------------------- horus

def test_horus_forgets_a_job_that_fails_is_rejected_or_lost():
    from phasewise.models.horus.state import HorusState
    from phasewise.streams.config import horus_state_config

    h = HorusState(horus_state_config(Settings.from_env({"host": "h1"}, env={})))
    for i, kind in enumerate(("failed", "rejected", "lost")):
        job = f"j{i}"
        h.join.submitted(job, 1.0, {}, "resnet18", "cpu", {})
        assert h.route(h.started(_ev(job, "started", 2.0, host="n1", container=job))) == []
        assert job in h.join and job in h.book
        assert h.route(h.end(_ev(job, kind, 3.0, reason="why"))) == []  # too few samples, or it never ran
        assert job not in h.join and job not in h.book
    assert h.end(_ev("never", "lost", 3.0)) is None  # unknown: nothing routed, nothing written
    assert {k for k, _p, v in h.writes()} == {f"{side}/j{i}" for side in ("job", "run") for i in range(3)}


def test_lifecycle_memory_is_bounded():
    lc = Lifecycle("x", max_ended=3)
    for i in range(5):
        lc.end(f"j{i}", "finished", float(i))
    assert list(lc.ended) == ["j2", "j3", "j4"] and lc.unheld("j0", "finished", 9.0) == "unknown_job"
