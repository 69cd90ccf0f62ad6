"""The job view's fold, with hand-built records: every state, states out of order or repeated, a waiting job
with its reason, prediction against what the samples show, progress against targets."""

from __future__ import annotations

import pytest

from phasewise.kit.records import (
    Actuation,
    ContainerSample,
    DeadLetter,
    Decision,
    HostSamples,
    Interval,
    JobEvent,
    JobSpec,
    JobTargets,
    UtilisationPrediction,
    encode,
)
from phasewise.models.jobs.view import STATES, JobsFold, ViewConfig, age

JOB_TOPICS = frozenset({"phasewise.job-events.v1", "phasewise.predictions.v1", "phasewise.control.v1"})


def fold(warmup_s: float = 0.0, wait_s: float = 10.0) -> JobsFold:
    return JobsFold(ViewConfig(warmup_s=warmup_s, prediction_wait_s=wait_s), job_topics=JOB_TOPICS)


def ev(job: str, kind: str, ts: float, **kw) -> JobEvent:
    if kind == "submitted":
        kw.setdefault("spec", JobSpec(model="resnet18", dataset="cifar10", batch_size=8))
    return JobEvent(job=job, ts=ts, kind=kind, **kw)


def place(job: str, ts: float, host: str = "h1", **details) -> Decision:
    return Decision(id=f"place-{job}-{ts:g}", ts=ts, host=host, container=job, action="place", policy="horus",
                    reason="fits", details={"job": job, "node": details.pop("node", host), **details})


def prediction(job: str, ts: float, cpu: float = 2.0, mem: float = 2**30, gpu: float = 0.0) -> UtilisationPrediction:
    return UtilisationPrediction(job=job, ts=ts, model_version=3, gpu_util=Interval(mean=gpu, lo=0, hi=gpu * 1.5),
                                 gpu_mem_bytes=Interval(mean=0, lo=0, hi=0),
                                 cpu_cores=Interval(mean=cpu, lo=cpu / 2, hi=cpu * 2),
                                 mem_bytes=Interval(mean=mem, lo=mem / 2, hi=mem * 2), coverage=0.9)


def view(f: JobsFold, job: str, now: float = 1000.0):
    v = f.view(job, now)
    assert v is not None
    return v


# -- each state -------------------------------------------------------------------------------------------


def test_a_job_walks_submitted_placed_running_frozen_running_finished():
    f = fold()
    f.job_event(ev("a", "submitted", 10.0, priority=5, workload="inference"))
    assert view(f, "a", 12.0).state == "waiting"
    f.prediction(prediction("a", 11.0))
    f.decision(place("a", 12.0, host="h1", node="s0", cpuset="0-3", gpus=[0]))
    v = view(f, "a", 13.0)
    assert (v.state, v.host, v.node, v.cpuset, v.gpus, v.since) == ("placed", "h1", "s0", "0-3", ("0",), 12.0)
    assert v.reason == "no started event from the actuator on h1 yet"
    f.job_event(ev("a", "started", 14.0, host="h1", container="a", pid=77, cpuset="0-3", devices=("0",)))
    v = view(f, "a", 15.0)
    assert (v.state, v.pid, v.container, v.workload, v.priority) == ("running", 77, "a", "inference", 5)
    f.job_event(ev("a", "frozen", 20.0, host="h1"))
    assert view(f, "a").state == "frozen"
    f.job_event(ev("a", "thawed", 30.0, host="h1"))
    assert view(f, "a").state == "running"
    f.job_event(ev("a", "finished", 40.0, host="h1", exit_code=0, run_s=26.0))
    v = view(f, "a", 100.0)
    assert (v.state, v.since, v.exit_code, v.run_s) == ("finished", 40.0, 0, 26.0)
    kinds = [(e.source, e.kind) for e in v.timeline]
    assert kinds == [("job-events", "submitted"), ("predictions", "prediction"), ("decisions", "place"),
                     ("job-events", "started"), ("job-events", "frozen"), ("job-events", "thawed"),
                     ("job-events", "finished")]
    assert v.decisions == ("place-a-12",)


@pytest.mark.parametrize("kind, fields, shown", [
    ("failed", {"exit_code": 1, "run_s": 3.0, "reason": "exited with status 1"}, "exited with status 1"),
    ("failed", {"signal": "SIGKILL", "oom": True, "reason": "OOM-killed in its memory limit"},
     "OOM-killed in its memory limit"),
    ("terminated", {"signal": "SIGTERM", "run_s": 9.0, "reason": "objective reached"}, "objective reached"),
    ("rejected", {"reason": "actuator_start_jobs is off"}, "actuator_start_jobs is off"),
    ("lost", {"reason": "no sign of life within 300 s of its placement"}, "no sign of life within 300 s"),
])
def test_each_end_and_its_reason(kind, fields, shown):
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.decision(place("j", 2.0))
    if kind in ("failed", "terminated"):
        f.job_event(ev("j", "started", 3.0, host="h1", container="j", pid=9))
    f.job_event(ev("j", kind, 12.0, host="h1", **fields))
    v = view(f, "j")
    assert v.state == kind and shown in (v.reason or "")
    assert v.signal == fields.get("signal") and v.oom == fields.get("oom", False)
    assert v.state in STATES


def test_a_job_the_priority_agent_stops_waits_to_resume_and_runs_again():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.decision(place("j", 2.0, host="h1"))
    f.job_event(ev("j", "started", 3.0, host="h1", container="j", pid=9))
    f.job_event(ev("j", "stopped", 10.0, host="h1"))
    f.job_event(ev("j", "terminated", 11.0, host="h1", signal="SIGTERM", run_s=8.0,
                   reason="terminated by decision prio-1 (checkpoint_exit)"))
    v = view(f, "j", 12.0)
    assert (v.state, v.since, v.signal) == ("waiting", 10.0, "SIGTERM")
    assert v.reason.startswith("stopped by the priority agent (checkpoint and exit), ended (terminated by decision")
    f.job_event(ev("j", "admitted", 20.0, host="h2", resume=True))
    v = view(f, "j", 21.0)
    assert v.state == "waiting" and "admitted on h2 (resume) by the priority agent" in v.reason
    f.decision(place("j", 22.0, host="h2"))
    f.job_event(ev("j", "started", 23.0, host="h2", container="j", pid=10))
    v = view(f, "j")
    assert (v.state, v.host, v.pid, v.reason, v.signal) == ("running", "h2", 10, None, None)


@pytest.mark.parametrize("hinted", [True, False], ids=["stopped-hint", "terminate-decision"])
@pytest.mark.parametrize("kind", ["finished", "failed"])
def test_a_job_that_ends_on_its_checkpoint_stops_control_first_waits_to_resume(kind, hinted):
    """The stop's exit reported finished or failed (the job honoured the control before the actuator handled the
    terminate): seen from the ``stopped`` hint (placement after admission) or from the checkpoint stop's terminate
    decision itself (the priority agent launches), the job waits to be resumed, and runs again when it is."""
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.decision(place("j", 2.0, host="h1"))
    f.job_event(ev("j", "started", 3.0, host="h1", container="j", pid=9))
    if hinted:
        f.job_event(ev("j", "stopped", 10.0, host="h1"))
    f.decision(Decision(id="stop-j", ts=10.0, host="h1", container="j", action="terminate", policy="priority",
                        reason="preempted", details={"mode": "checkpoint", "grace_s": 5}))
    f.job_event(ev("j", kind, 10.5, host="h1", exit_code=0 if kind == "finished" else 1, run_s=7.5))
    v = view(f, "j", 12.0)
    assert v.state == "waiting" and v.reason.startswith("stopped by the priority agent (checkpoint and exit)"), v
    f.decision(place("j", 22.0, host="h1", resume=True))
    f.job_event(ev("j", "started", 23.0, host="h1", container="j", pid=10))
    assert view(f, "j").state == "running"
    f.job_event(ev("j", kind, 40.0, host="h1", exit_code=0 if kind == "finished" else 1))  # its own end now
    assert view(f, "j").state == kind


def test_a_terminate_not_the_priority_agents_stop_ends_the_job():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.job_event(ev("j", "started", 3.0, host="h1", container="j", pid=9))
    f.job_event(ev("j", "stopped", 5.0, host="h1"))
    f.job_event(ev("j", "admitted", 6.0, host="h1", resume=True))
    f.job_event(ev("j", "started", 7.0, host="h1", container="j", pid=11))  # resumed: the stop is over
    f.job_event(ev("j", "terminated", 30.0, host="h1", exit_code=0, reason="objective reached"))
    v = view(f, "j")
    assert (v.state, v.reason, v.exit_code) == ("terminated", "objective reached", 0)


# -- out of order, repeated, unknown ----------------------------------------------------------------------


def test_states_arriving_out_of_order_are_ordered_by_event_time():
    f = fold()
    f.job_event(ev("j", "finished", 40.0, exit_code=0, run_s=30.0))  # read first, happened last
    f.job_event(ev("j", "started", 10.0, host="h1", container="j", pid=5))
    f.job_event(ev("j", "submitted", 1.0))
    v = view(f, "j")
    assert v.state == "finished" and v.submitted == 1.0
    assert [e.kind for e in v.timeline] == ["submitted", "started", "finished"]
    assert all(e.ignored is None for e in v.timeline)


def test_finished_before_started_and_two_finishes_change_nothing_more():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.job_event(ev("j", "finished", 5.0, exit_code=0))
    f.job_event(ev("j", "started", 6.0, host="h1", container="j", pid=5))  # after its end: ignored
    f.job_event(ev("j", "finished", 7.0, exit_code=0))
    f.job_event(ev("j", "failed", 8.0, exit_code=1, reason="late"))
    v = view(f, "j")
    assert (v.state, v.since, v.pid, v.reason) == ("finished", 5.0, None, None)
    assert [(e.kind, e.ignored) for e in v.timeline] == [
        ("submitted", None), ("finished", None), ("started", "after finished"), ("finished", "after finished"),
        ("failed", "after finished")]


def test_a_second_submission_and_a_thaw_without_a_freeze_are_ignored():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0, priority=1))
    f.job_event(ev("j", "submitted", 2.0, priority=9))
    f.job_event(ev("j", "thawed", 3.0))
    v = view(f, "j")
    assert v.priority == 1
    assert [e.ignored for e in v.timeline] == [None, "submitted again", "while waiting (not frozen)"]


def test_records_about_a_job_never_submitted_make_it_unknown():
    f = fold()
    f.job_event(ev("ghost", "progress", 5.0, step=3, loss=1.0))
    v = view(f, "ghost")
    assert v.state == "unknown" and "no submitted event" in v.reason


def test_a_refused_record_is_in_the_timeline_and_changes_nothing():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.job_event(ev("j", "finished", 2.0, exit_code=0), refused="refused: not signed with the cluster key")
    v = view(f, "j", 3.0)
    assert v.state == "waiting"
    assert v.timeline[-1].ignored == "refused: not signed with the cluster key"


# -- why a job waits --------------------------------------------------------------------------------------


def test_a_waiting_job_says_it_waits_for_its_prediction_then_for_room():
    f = fold(wait_s=10.0)
    f.job_event(ev("j", "submitted", 100.0))
    assert "waits for Horus's prediction" in view(f, "j", 105.0).reason
    v = view(f, "j", 200.0)
    assert "no place decision yet" in v.reason and "placement agent" in v.reason


def test_the_placement_agents_waiting_event_is_why_it_waits_until_it_is_placed():
    f = fold(wait_s=10.0)
    f.job_event(ev("j", "submitted", 100.0))
    f.job_event(ev("j", "waiting", 111.0, reason="no node has enough cpu"))
    v = view(f, "j", 200.0)
    assert v.state == "waiting" and "no node has enough cpu" in v.reason and v.reason.startswith("placement at ")
    f.job_event(ev("j", "waiting", 150.0, reason="no node has enough mem"))
    assert "enough mem" in view(f, "j", 200.0).reason
    f.decision(place("j", 160.0))
    f.job_event(ev("j", "waiting", 170.0, reason="late"))  # after its placement: in the timeline, ignored
    v = view(f, "j", 200.0)
    assert v.state == "placed" and v.timeline[-1].ignored == "while placed"


def test_a_dead_letter_about_a_waiting_job_is_its_reason():
    f = fold()
    sub = ev("j", "submitted", 100.0)
    f.job_event(sub)
    f.prediction(prediction("j", 101.0))
    why = ("no node takes job j now (no node has enough CPU) and 3 jobs wait for room already "
           "(place_max_waiting_jobs 3), each of higher priority or submitted earlier: refused, not kept")
    f.dead_letter(DeadLetter(ts=102.0, source_topic="phasewise.job-events.v1", reason=why,
                             payload=encode(sub).decode(), key="j"))
    v = view(f, "j", 103.0)
    assert v.state == "waiting" and v.reason.startswith("dead letter (phasewise.job-events.v1): no node takes job j")
    assert v.timeline[-1].kind == "dead letter"


def test_dead_letters_of_its_other_records_are_not_why_it_waits():
    """A second submission of its id and a refused progress event are in its timeline, not its reason."""
    f = fold(wait_s=0.0)
    f.job_event(ev("j", "submitted", 100.0))
    again = ev("j", "submitted", 150.0, priority=4)
    f.dead_letter(DeadLetter(ts=151.0, source_topic="phasewise.job-events.v1", key="j", payload=encode(again).decode(),
                             reason="job id 'j' already submitted"))
    f.dead_letter(DeadLetter(ts=152.0, source_topic="phasewise.job-events.v1", key="j",
                             payload=encode(ev("j", "progress", 152.0, step=1)).decode(),
                             reason="job 'j': progress carries no loss"))
    v = view(f, "j", 200.0)
    assert v.reason.startswith("no place decision yet")
    assert [e.kind for e in v.timeline] == ["submitted", "dead letter", "dead letter"]


def test_a_dead_letter_named_only_in_its_payload_is_found_and_unknown_jobs_are_not_made_up():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    d = place("j", 2.0)
    f.dead_letter(DeadLetter(ts=3.0, source_topic="phasewise.decisions.v1", reason="too large", key="h1",
                             payload=encode(d).decode()))
    f.dead_letter(DeadLetter(ts=3.0, source_topic="phasewise.job-events.v1", reason="bad", key="other",
                             payload="{not json"))
    assert [e.kind for e in view(f, "j", 4.0).timeline] == ["submitted", "dead letter"]
    assert f.jobs() == ["j"]


def test_waiting_jobs_are_ranked_as_placement_ranks_them():
    f = fold(wait_s=0.0)
    f.job_event(ev("low", "submitted", 1.0, priority=0))
    f.job_event(ev("high", "submitted", 2.0, priority=7))
    f.job_event(ev("early", "submitted", 0.5, priority=0))
    views = {v.job: v for v in f.views(10.0)}
    assert views["high"].reason.endswith("1st of 3 waiting jobs by priority, then submission")
    assert views["early"].reason.endswith("2nd of 3 waiting jobs by priority, then submission")
    assert views["low"].reason.endswith("3rd of 3 waiting jobs by priority, then submission")
    assert [v.job for v in f.views(10.0)] == ["early", "low", "high"]  # listed by submission


def test_a_job_stopped_by_the_priority_agent_waits_to_be_admitted_again():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.decision(place("j", 2.0))
    f.job_event(ev("j", "started", 3.0, host="h1", container="j", pid=4))
    f.job_event(ev("j", "stopped", 9.0, host="h1"))
    v = view(f, "j", 10.0)
    assert v.state == "waiting" and "stopped by the priority agent" in v.reason


# -- prediction vs observed, progress vs targets, decisions and actuations ------------------------------


def test_observed_is_the_mean_of_the_steady_samples_of_its_container():
    f = fold(warmup_s=5.0)
    f.job_event(ev("j", "submitted", 1.0))
    f.prediction(prediction("j", 2.0, cpu=2.0, mem=2**30))
    f.job_event(ev("j", "started", 10.0, host="h1", container="j", pid=3))
    for t, cpu in ((12.0, 9.0), (16.0, 1.0), (17.0, 3.0)):  # the first is within the warm-up
        f.samples(HostSamples(host="h1", ts=t, interval_s=1.0, containers=(
            ContainerSample(container="j", cpu_cores=cpu, mem_bytes=2**29),
            ContainerSample(container="other", cpu_cores=50.0, mem_bytes=1.0))))
    f.samples(HostSamples(host="h2", ts=18.0, interval_s=1.0,
                          containers=(ContainerSample(container="j", cpu_cores=40.0, mem_bytes=1.0),)))
    v = view(f, "j", 20.0)
    assert v.observed == {"source": "samples", "samples": 2, "first": 16.0, "last": 17.0, "cpu_cores": 2.0,
                          "mem_bytes": 2**29}
    assert v.prediction["cpu_cores"] == {"mean": 2.0, "lo": 1.0, "hi": 4.0}
    assert v.prediction["model_version"] == 3


def test_samples_after_the_run_ended_are_not_its_use_in_whatever_order_read():
    for order in ("ended first", "started first"):
        f = fold()
        f.job_event(ev("j", "submitted", 1.0))
        end = ev("j", "finished", 30.0, exit_code=0)
        if order == "ended first":
            f.job_event(end)
        f.job_event(ev("j", "started", 10.0, host="h1", container="j", pid=3))
        if order == "started first":
            f.job_event(end)
        for t, cpu in ((20.0, 2.0), (30.0, 4.0), (31.0, 0.0), (40.0, 0.0)):  # the cgroup stays after the end
            f.samples(HostSamples(host="h1", ts=t, interval_s=1.0,
                                  containers=(ContainerSample(container="j", cpu_cores=cpu, mem_bytes=1.0),)))
        v = view(f, "j", 50.0)
        assert (v.observed["samples"], v.observed["cpu_cores"], v.observed["last"]) == (2, 3.0, 30.0), order


@pytest.mark.parametrize("losses, reached", [((2.0,), None), ((2.0, 0.9), "acceptable"), ((0.9, 0.4), "objective")])
def test_progress_against_targets(losses, reached):
    f = fold()
    f.job_event(ev("j", "submitted", 1.0, spec=JobSpec(model="m", dataset="d", batch_size=4,
                                                        targets=JobTargets(acceptable=1.0, objective=0.5))))
    for i, loss in enumerate(losses):
        f.job_event(ev("j", "progress", 10.0 + i, step=100 * (i + 1), loss=loss))
    v = view(f, "j")
    assert v.progress["value"] == losses[-1] and v.progress["step"] == 100 * len(losses)
    assert v.targets["reached"] == reached and v.targets["objective"] == 0.5


def test_an_older_progress_read_late_does_not_replace_the_latest():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.job_event(ev("j", "progress", 20.0, step=200, metric=0.8, metric_name="accuracy"))
    f.job_event(ev("j", "progress", 10.0, step=100, metric=0.5, metric_name="accuracy"))
    v = view(f, "j")
    assert (v.progress["metric"], v.progress["value"], v.progress["step"]) == ("accuracy", 0.8, 200)


def test_decisions_and_actuations_about_its_container_are_in_its_timeline():
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.job_event(ev("j", "started", 3.0, host="h1", container="j-c", pid=4))
    f.decision(Decision(id="frz-1", ts=5.0, host="h1", container="j-c", action="freeze", policy="priorities",
                        reason="inference SLO at risk"))
    f.decision(Decision(id="vpa-1", ts=5.0, host="h1", container="someone-else", action="limit", policy="vpa"))
    f.actuation(Actuation(decision_id="frz-1", ts=6.0, host="h1", container="j-c", status="applied",
                          backend="cgroup"))
    v = view(f, "j")
    assert [(e.source, e.kind) for e in v.timeline][-2:] == [("decisions", "freeze"), ("actuations", "applied")]
    assert v.decisions == ("frz-1",)
    assert v.state == "running"  # a freeze decision is not a state: the actuator's frozen event is


def test_what_a_record_may_hold_does_not_break_the_view():
    """Decision details are free-form; a dead letter's payload is whatever was refused."""
    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    f.decision(Decision(id="p", ts=2.0, host="h1", container="j", action="place", policy="x",
                        details={"job": "j", "cpuset": 7, "gpus": "0,1", "node": ["s0"]}))
    f.dead_letter(DeadLetter(ts=3.0, source_topic="phasewise.decisions.v1", key="h1", reason="deep",
                             payload="[" * 100_000))
    f.dead_letter(DeadLetter(ts=3.0, source_topic="phasewise.job-events.v1", key="j", reason="deep",
                             payload="[" * 100_000))
    v = view(f, "j", 5.0)
    assert (v.state, v.cpuset, v.gpus, v.node) == ("placed", None, (), None)
    assert [e.kind for e in v.timeline] == ["submitted", "place", "dead letter"]


def test_to_dict_is_json_ready():
    import json

    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    d = view(f, "j").to_dict()
    assert json.loads(json.dumps(d))["timeline"][0]["kind"] == "submitted"
    assert "timeline" not in view(f, "j").to_dict(timeline=False)


def test_ages():
    assert [age(x) for x in (0, 59, 60, 61, 3600, 3661, 86400, 90000)] == [
        "0s", "59s", "1m", "1m1s", "1h", "1h1m", "1d", "1d1h"]


LEARNED = "observed" in UtilisationPrediction.__dataclass_fields__


@pytest.mark.skipif(not LEARNED, reason="UtilisationPrediction has no observed/log_error here (Horus's live learning)")
def test_horus_learned_prediction_gives_observed_and_log_error_when_no_samples_were_read():
    import dataclasses

    f = fold()
    f.job_event(ev("j", "submitted", 1.0))
    first = prediction("j", 2.0, cpu=2.0)
    f.prediction(first)
    f.job_event(ev("j", "started", 3.0, host="h1", container="j", pid=5))
    f.job_event(ev("j", "finished", 90.0, exit_code=0))
    f.prediction(dataclasses.replace(first, ts=91.0, observed={"cpu_cores": 1.0}, log_error={"cpu_cores": 0.405}))
    v = view(f, "j")
    assert v.observed == {"source": "horus", "samples": None, "first": None, "last": 91.0, "cpu_cores": 1.0}
    assert v.prediction["log_error"] == {"cpu_cores": 0.405} and v.prediction["cpu_cores"]["mean"] == 2.0
    assert "learned, log error cpu_cores 0.405" in v.timeline[-1].text
