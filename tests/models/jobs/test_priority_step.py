"""The priority agent's step without Faust: job events -> place, freeze, thaw, terminate, weight decisions and
controls; poison -> refusals with reasons; its table state restores it."""

from __future__ import annotations

import json

import pytest

from phasewise.kit.job_signing import START_FIELDS, sign_event, spec_of, start_details
from phasewise.kit.records import (
    Decision,
    JobControl,
    JobEvent,
    JobRequests,
    JobSpec,
    SchemaError,
    encode,
    to_dict,
)
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import JOB_EVENTS
from phasewise.models.jobs.events import EventTimeRefused, Refused, SignatureRefused
from phasewise.models.jobs.priorities import Capacity, PriorityConfig
from phasewise.models.jobs.priority_step import PriorityStep, PriorityStepConfig
from phasewise.models.jobs.submissions import Submissions
from tests.job_keys import KEY, TRUSTED
from tests.test_poison import poison

GB = 1e9


def submitted(job: str, ts: float, *, cpu: float, priority: int = 0, expected_s: float | None = None,
              host: str | None = "n1", workload: str = "training", command: tuple[str, ...] = (),
              gpus: float = 0.0, container: str | None = None) -> bytes:
    """A submitted event signed by the tests' trusted submitter (tests.job_keys.KEY)."""
    spec = JobSpec(model="resnet50", dataset="cifar10", batch_size=32, expected_s=expected_s, command=command,
                   requests=JobRequests(cpu_cores=cpu, mem_bytes=1 * GB, gpus=gpus))
    return encode(sign_event(KEY, JobEvent(job=job, ts=ts, kind="submitted", host=host, priority=priority,
                                           workload=workload, spec=spec, container=container)))


def finished(job: str, ts: float) -> bytes:
    return encode(JobEvent(job=job, ts=ts, kind="finished"))


JOB_POISON = poison(to_dict(JobEvent(job="p", ts=1.0, kind="submitted")), "ts",
                    {"priority": "high", "workload": 3}, wrong_reason="must be", max_bytes=JobEvent.MAX_BYTES)


def valid_stream(prefix: str = "", host: str = "n1") -> list[bytes]:
    return [submitted(f"{prefix}low", 1, cpu=2, host=host),
            submitted(f"{prefix}hi", 2, cpu=1, priority=5, expected_s=30, host=host),
            submitted(f"{prefix}infer", 3, cpu=1, priority=9, workload="inference", host=host),
            finished(f"{prefix}hi", 50), finished(f"{prefix}infer", 60)]


#: low starts; hi (short) freezes it; infer fits beside hi; hi ends (low needs 2 cores, 1 is free: waits);
#: infer ends: low thawed
EXPECTED = [("place", "low"), ("freeze", "low"), ("place", "hi"), ("place", "infer"), ("thaw", "low")]


#: the same with CPU weights (the settings' default): each start and restart is followed by the job's weight
EXPECTED_WEIGHTED = [("place", "low"), ("weight", "low"), ("freeze", "low"), ("place", "hi"), ("weight", "hi"),
                     ("place", "infer"), ("weight", "infer"), ("thaw", "low")]


HOST = Capacity(2, 8 * GB, 1)


def make(policy: PriorityConfig, capacity: Capacity = HOST, *, launcher: str = "self",
         ring: Keyring | None = None, submitters=None, clock=None, now=None,
         start_timeout_s: float = 300.0) -> PriorityStep:
    """A step on host n1 (*ring*: the cluster key that signs ``started`` events; *submitters*: the trusted ones)."""
    verify = None if ring is None else (lambda key, value, headers: ring.verify(JOB_EVENTS.name, key, value, headers))
    return PriorityStep(PriorityStepConfig(policy, capacity, "n1", JOB_EVENTS.partitions, launcher, start_timeout_s),
                        Submissions(start_details, None if submitters is None else submitters.verify_event),
                        clock=clock, now=now, verify=verify)


def step(ratio: float | None = None) -> PriorityStep:
    return make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=ratio))


def run(s: PriorityStep, records: list, offsets: bool = False) -> tuple[list[Decision], list[JobControl], list[str]]:
    ds, cs, bad = [], [], []
    for i, r in enumerate(records):
        try:
            d, c = s.handle(r, 0, i) if offsets else s.handle(r)
        except (SchemaError, Refused) as e:
            bad.append(str(e))
            continue
        ds += d
        cs += c
    return ds, cs, bad


def test_valid_events_give_the_policy_s_decisions_in_order():
    ds, cs, bad = run(step(), valid_stream())
    assert bad == [] and cs == []
    assert [(d.action, d.container) for d in ds] == EXPECTED
    assert all(d.policy == "priority" and d.host == "n1" for d in ds)


def test_checkpoint_and_stop_sends_a_checkpoint_exit_control():
    s = step()
    ds, cs, bad = run(s, [submitted("low", 1, cpu=2), submitted("hi", 2, cpu=2, priority=1)])
    assert [(d.action, d.container, d.details.get("mode")) for d in ds] == [
        ("place", "low", None), ("terminate", "low", "checkpoint"), ("place", "hi", None)]
    assert [(c.job, c.action, c.grace_s) for c in cs] == [("low", "checkpoint_exit", 20.0)]
    # the stop is a state on the job's events whoever launches (the targets agent reads it); starts are not
    assert [(h.kind, h.job, h.host, h.container) for h in s.take_hints()] == [("stopped", "low", "n1", "low")]
    ds, cs, bad = run(s, [finished("hi", 9)])
    assert [(d.action, d.container, d.details["resume"]) for d in ds] == [("place", "low", True)]
    assert s.take_hints() == []


@pytest.mark.parametrize("kind", ["finished", "failed"])
def test_a_job_that_ends_on_its_checkpoint_exit_control_before_the_terminate_is_resumed(kind):
    """The control and the terminate decision go out together: a job that saves its checkpoint and exits before
    the actuator handles the decision is reported finished (exit 0) or failed (killed by the signal), not
    terminated. It is the stop's exit all the same: the job waits and is resumed, and only an end after that
    (it was started again) takes it out of the policy."""
    s = step()
    run(s, [submitted("low", 1, cpu=2), submitted("hi", 2, cpu=2, priority=1)])
    ds, cs, bad = run(s, [encode(JobEvent(job="low", ts=2.5, kind=kind, exit_code=0 if kind == "finished" else 143))])
    assert (ds, cs, bad) == ([], [], [])
    assert s.policy.state("low") is not None  # still the policy's: it waits for capacity
    ds, _, _ = run(s, [finished("hi", 9)])
    assert [(d.action, d.container, d.details["resume"]) for d in ds] == [("place", "low", True)]
    run(s, [encode(JobEvent(job="low", ts=10, kind="started", host="n1", container="low"))])
    run(s, [finished("low", 20)])  # its own end this time
    assert s.policy.state("low") is None


def test_poison_between_valid_records_is_refused_with_reasons_and_nothing_valid_is_lost():
    records = []
    valid = valid_stream()
    kinds = list(JOB_POISON)
    for i, v in enumerate(valid):
        records.append(v)
        records.append(JOB_POISON[kinds[i % len(kinds)]][0])
    records += [JOB_POISON[k][0] for k in kinds]
    no_spec = encode(JobEvent(job="nospec", ts=4, kind="submitted"))
    records += [no_spec, submitted("low", 70, cpu=1)]  # a second submission of a known job
    ds, cs, bad = run(step(), records)
    ref_ds, _, _ = run(step(), valid)
    assert ds == ref_ds
    assert len(bad) == len(valid) + len(kinds) + 2
    for k in kinds:
        assert any(JOB_POISON[k][1] in b for b in bad), k
    assert "carries no spec" in bad[-2] and "already submitted" in bad[-1]


def test_events_of_other_kinds_change_nothing():
    s = step()
    run(s, [submitted("a", 1, cpu=1)])
    before = s.policy.to_state()
    ds, cs, bad = run(s, [encode(JobEvent(job="a", ts=2, kind="progress", step=3, loss=0.5)),
                          encode(JobEvent(job="a", ts=2, kind="started", host="n1", container="a"))])
    assert (ds, cs, bad) == ([], [], []) and s.policy.to_state() == before


def test_weights_on_start_restart_started_and_a_new_priority():
    s = step(ratio=2.0)
    ds, cs, bad = run(s, valid_stream())
    assert bad == [] and [(d.action, d.container) for d in ds] == EXPECTED_WEIGHTED
    assert [d.details["cpu_weight"] for d in ds if d.action == "weight"] == [100, 3200, 10000]  # (the cap)
    s = step(ratio=2.0)
    run(s, [submitted("a", 1, cpu=1, command=("python", "train.py")),
            encode(JobEvent(job="a", ts=2, kind="started", host="n1", container="a-ctr"))])
    ds, cs, bad = run(s, [encode(JobEvent(job="a", ts=3, kind="priority", priority=4))])
    assert [(d.action, d.container, d.details["cpu_weight"], d.details["job"]) for d in ds] == [
        ("weight", "a-ctr", 1600, "a")]
    assert "priority 0 -> 4" in ds[0].reason
    ds, cs, bad = run(s, [encode(JobEvent(job="b", ts=4, kind="priority", priority=4))])
    assert ds == [] and "priority of unknown job 'b'" in bad[0]
    # a bigger, more important job: a is checkpointed and stopped; the control names the job, the decision
    # its container
    ds, cs, bad = run(s, [submitted("big", 5, cpu=2, priority=9, command=("python", "big.py"))])
    assert [(d.action, d.container) for d in ds] == [("terminate", "a-ctr"), ("place", "big"), ("weight", "big")]
    assert [(c.job, c.action) for c in cs] == [("a", "checkpoint_exit")]
    ds, cs, bad = run(s, [finished("big", 6)])
    assert [(d.action, d.container) for d in ds] == [("place", "a-ctr"), ("weight", "a-ctr")]
    assert ds[0].details["resume"] is True and ds[0].details["spec"]["command"] == ["python", "train.py"]
    assert ds[0].details["cpuset"] is None and ds[0].details["device"] == []  # no GPU asked: none seen


def test_place_decisions_carry_what_the_actuator_starts():
    s = step()
    ds, _, _ = run(s, [submitted("g", 1, cpu=1, gpus=0.5, command=("python", "-m", "job"))])
    d = ds[0]
    assert (d.action, d.details["spec"]["command"], d.details["cpuset"], d.details["device"],
            d.details["resume"]) == ("place", ["python", "-m", "job"], None, None, False)  # GPUs: not named
    assert "command" not in d.details  # no command of the agent's own: the signed spec's only
    ds, _, _ = run(s, [submitted("n", 2, cpu=1)])
    assert ds[0].details["spec"]["command"] == []  # the actuator refuses it, saying who starts it


def test_place_decisions_carry_the_submission_as_signed_and_the_admitted_priority_beside_it():
    s = step()
    run(s, [submitted("hi", 1, cpu=2, priority=5, expected_s=30), submitted("low", 2, cpu=1, command=("run",))])
    ds, _, _ = run(s, [encode(JobEvent(job="low", ts=3, kind="priority", priority=7)), finished("hi", 4)])
    d = next(x for x in ds if x.action == "place")
    assert set(START_FIELDS) <= set(d.details) and d.details["job"] == "low" and d.details["job_ts"] == 2
    # the priority signed at submission is carried; the one it was admitted at beside it
    assert (d.details["priority"], d.details["admitted_priority"]) == (0, 7)
    x = d.details
    assert TRUSTED.verify(x["job"], x["job_ts"], x["workload"], x["priority"], spec_of(x["spec"]),
                          x["job_signature"]) is None
    # an unsigned submission is decided all the same; its decision carries no signature (no actuator starts it)
    t = step()
    unsigned = encode(JobEvent(job="u", ts=1, kind="submitted", host="n1", spec=JobSpec(
        model="resnet50", dataset="cifar10", batch_size=32, command=("evil",), requests=JobRequests(cpu_cores=1))))
    ds, _, _ = run(t, [unsigned])
    assert ds[0].details["job_signature"] is None


def test_a_submitted_container_is_ignored_and_a_started_one_taken_only_when_signed_with_the_cluster_key():
    ring = Keyring(b"c" * 40)
    s = make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=2.0), ring=ring)
    # a job-events writer names a victim's container in its submission: not taken, the job's container is its id
    run(s, [submitted("a", 1, cpu=2, container="victim")])
    assert s.jobs["a"]["ctr"] == "a"
    forged = encode(JobEvent(job="a", ts=2, kind="started", host="n1", container="victim"))
    with pytest.raises(Refused, match="not signed by the cluster key .*unsigned"):
        s.handle(forged, key=b"a")
    other = Keyring(b"z" * 40).headers(JOB_EVENTS.name, b"a", forged)
    with pytest.raises(Refused, match="unknown key"):
        s.handle(forged, key=b"a", headers=other)
    assert s.jobs["a"]["ctr"] == "a"
    ds, _, _ = run(s, [submitted("big", 3, cpu=2, priority=9)])
    assert [(d.action, d.container) for d in ds if d.action == "terminate"] == [("terminate", "a")]
    # the actuator's started event, signed with the cluster key: its container is taken
    t = make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None), ring=ring)
    run(t, [submitted("a", 1, cpu=2)])
    real = encode(JobEvent(job="a", ts=2, kind="started", host="n1", container="a-ctr"))
    t.handle(real, key=b"a", headers=ring.headers(JOB_EVENTS.name, b"a", real))
    assert t.jobs["a"]["ctr"] == "a-ctr"
    # a started event of a job this agent does not follow is nobody's concern: no dead letter
    assert t.handle(forged.replace(b'"a"', b'"zz"'), key=b"zz") == ([], [])


def test_the_state_written_at_commits_restores_the_policy_and_skips_events_read_again():
    records = [submitted("low", 1, cpu=2, command=("run-low",)), submitted("hi", 2, cpu=2, priority=3),
               encode(JobEvent(job="low", ts=2.5, kind="started", host="n1", container="low-ctr"))]
    s = step(ratio=2.0)
    run(s, records, offsets=True)
    table = {k: v for k, _p, v in s.writes()}
    assert set(table) == {"low", "hi"} and s.writes() == []  # written once, until something changes
    assert json.loads(table["low"])["o"] == 2 and json.loads(table["low"])["s"]["state"] == "stopped"
    t = step(ratio=2.0)
    assert t.restore(table.items()) == 2 and t.policy.states() == s.policy.states()
    # a worker that died before committing these offsets reads them again: skipped, nothing decided twice
    ds, cs, bad = run(t, records, offsets=True)
    assert (ds, cs, bad) == ([], [], []) and t.replayed == 3
    ds, _ = t.handle(finished("hi", 9), 0, 3)
    assert [(d.action, d.container, d.details.get("resume")) for d in ds] == [
        ("place", "low-ctr", True), ("weight", "low-ctr", None)]
    assert ds[0].details["spec"]["command"] == ["run-low"]
    writes = {k: v for k, _p, v in t.writes()}
    assert writes["hi"] is None and json.loads(writes["low"])["s"]["state"] == "running"  # hi's key deleted
    ref = step(ratio=2.0)  # the same events in one worker decide the same
    run(ref, records, offsets=True)
    assert ref.handle(finished("hi", 9), 0, 3)[0] == ds
    assert step().restore([("x", b"{not json"), ("y", json.dumps({"s": {"v": 99}}).encode()), ("z", None)]) == 0


def test_with_the_placement_agent_as_launcher_starts_and_restarts_are_admitted_hints():
    """priority_launcher=place: the same admission, preemption and resume order; a start or restart is an
    ``admitted`` hint (host, priority, workload, resume) for the placement agent, a checkpoint-and-stop also a
    ``stopped`` one; freeze, thaw, terminate and priority-change weights are unchanged, a start's or restart's
    weight is the placement agent's to send (the job has no container before its place decision)."""
    def s() -> PriorityStep:
        return make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=2.0), launcher="place")

    hinted = s()
    ds, cs, bad = run(hinted, valid_stream())
    hints = hinted.take_hints()
    assert bad == [] and cs == [] and hinted.take_hints() == []
    assert [(d.action, d.container) for d in ds] == [x for x in EXPECTED_WEIGHTED if x[0] not in ("place", "weight")]
    assert [(h.kind, h.job, h.host, h.priority, h.workload, h.resume) for h in hints] == [
        ("admitted", "low", "n1", 0, "training", False), ("admitted", "hi", "n1", 5, "training", False),
        ("admitted", "infer", "n1", 9, "inference", False)]
    ref = step(ratio=2.0)  # the same policy decides the same, only the launcher differs
    assert [d for d in run(ref, valid_stream())[0] if d.action not in ("place", "weight")] == ds
    # a checkpoint-and-stop: terminate, the control and a stopped hint; the restart is an admitted resume
    t = s()
    run(t, [submitted("low", 1, cpu=2, command=("run-low",)),
            encode(JobEvent(job="low", ts=1.5, kind="started", host="n1", container="low-ctr"))])
    ds, cs, _ = run(t, [submitted("big", 2, cpu=2, priority=3)])
    assert [(d.action, d.container) for d in ds] == [("terminate", "low-ctr")]
    assert [(c.job, c.action) for c in cs] == [("low", "checkpoint_exit")]
    assert [(h.kind, h.job, h.container, h.ts) for h in t.take_hints()] == [
        ("admitted", "low", "low", 1), ("stopped", "low", "low-ctr", 2), ("admitted", "big", "big", 2)]
    ds, cs, _ = run(t, [finished("big", 1.8)])  # stamped before low's last hint: the hints stay strictly ordered
    assert ds == []
    (h,) = t.take_hints()
    assert (h.kind, h.job, h.container, h.resume, h.ts) == ("admitted", "low", "low-ctr", True, 2.001)
    ds, _, _ = run(t, [encode(JobEvent(job="low", ts=3, kind="priority", priority=1))])
    assert [(d.action, d.container) for d in ds] == [("weight", "low-ctr")]  # a new priority: the agent's own
    # its own hints, read back from the job events, change nothing and are no dead letters
    before = t.policy.to_state()
    assert run(t, [encode(h), encode(JobEvent(job="low", ts=1e12, kind="stopped"))]) == ([], [], [])
    assert t.policy.to_state() == before and t.take_hints() == []
    # the hint order survives a restart (its time is in the state)
    u = s()
    u.restore([(k, v) for k, _p, v in t.writes()])
    run(u, [submitted("top", 1.0, cpu=2, priority=9)])
    assert [(h.kind, h.job, h.ts) for h in u.take_hints()] == [("stopped", "low", 2.002), ("admitted", "top", 1.0)]
    with pytest.raises(ValueError, match="launcher"):
        make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None), Capacity(1, GB),
             launcher="kubernetes")


def test_the_records_are_json():  # the fixtures' own sanity: valid events parse as JSON objects
    assert all(isinstance(json.loads(v), dict) for v in valid_stream())


def test_job_events_stamped_far_ahead_or_behind_are_refused_and_change_nothing():
    from phasewise.models.safety.intake import EventClock
    from tests.models.safety.test_intake import config as intake

    s = make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None),
             clock=EventClock(intake(max_future_s=60, max_behind_s=600)), now=lambda: 1000.0)
    ds, _, bad = run(s, [submitted("low", 900, cpu=2), finished("low", 1000 + 1e7), finished("low", 100)])
    assert [(d.action, d.container) for d in ds] == [("place", "low")]
    assert "ahead of the worker clock" in bad[0] and "behind the job's newest event" in bad[1]
    with pytest.raises(EventTimeRefused):
        s.handle(submitted("x", float("1e300"), cpu=1))
    ds, _, bad = run(s, [submitted("hi", 950, cpu=2, priority=3)])  # low was not finished by either
    assert [(d.action, d.container) for d in ds] == [("terminate", "low"), ("place", "hi")] and not bad


def test_with_trusted_submitters_a_stranger_s_job_books_nothing_and_preempts_nobody():
    from tests.job_keys import STRANGER

    s = make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None), submitters=TRUSTED)
    ds, _, bad = run(s, [submitted("mine", 1, cpu=2)])
    assert bad == [] and [(d.action, d.container) for d in ds] == [("place", "mine")]
    spec = JobSpec(model="resnet50", dataset="cifar10", batch_size=32, expected_s=10,
                   requests=JobRequests(cpu_cores=2, mem_bytes=1 * GB))
    theirs = JobEvent(job="theirs", ts=2, kind="submitted", host="n1", priority=9, spec=spec)
    for ev, why in ((theirs, "not signed by a submitter"), (sign_event(STRANGER, theirs), "which is not trusted")):
        with pytest.raises(SignatureRefused, match=f"submitted job 'theirs' refused: .*{why}"):
            s.handle(encode(ev))
    assert s.policy.state("theirs") is None and s.policy.state("mine") == "running"  # not frozen, not stopped


def test_the_actuator_s_started_event_does_not_send_the_weight_a_second_time():
    s = step(ratio=2.0)
    ds, _, _ = run(s, [submitted("a", 1, cpu=1, priority=2, command=("python", "train.py"))])
    assert [(d.action, d.details.get("cpu_weight")) for d in ds] == [("place", None), ("weight", 400)]
    ds, _, bad = run(s, [encode(JobEvent(job="a", ts=2, kind="started", host="n1", container="a"))])
    assert (ds, bad) == ([], [])
    # a job its submitter started (no command): its weight comes with its started event, once
    ds, _, _ = run(s, [submitted("b", 3, cpu=1, priority=2)])
    assert [d.action for d in ds] == ["place", "weight"]
    t = step(ratio=2.0)
    run(t, [submitted("c", 1, cpu=1)])
    t.jobs["c"].pop("w", None)  # as restored from a state written before weights were remembered
    ds, _, _ = run(t, [encode(JobEvent(job="c", ts=2, kind="started", host="n1", container="c"))])
    assert [(d.action, d.details["cpu_weight"]) for d in ds] == [("weight", 100)]


def test_a_services_replicas_hold_their_requests_and_what_waits_is_admitted_when_they_go():
    s = make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None), Capacity(4, 8 * GB, 1))
    scaled = lambda n, ts, host="n1": encode(JobEvent(job="svc", ts=ts, kind="scaled", host=host,  # noqa: E731
                                                      container="svc", replicas=n, max_replicas=4,
                                                      workload="inference"))
    ds, _, bad = run(s, [submitted("svc", 1, cpu=1, priority=9, workload="inference"), scaled(3, 2),
                         submitted("train", 3, cpu=2)])
    assert bad == [] and [(d.action, d.container) for d in ds] == [("place", "svc")]
    assert s.policy.used("n1").cpu_cores == 3          # three replicas of one core; train (2) waits
    ds, _, _ = run(s, [scaled(3, 4), scaled(5, 4.5, host=None)])   # the same count; a Deployment's pods
    assert ds == [] and s.policy.used("n1").cpu_cores == 3
    ds, _, _ = run(s, [scaled(1, 5)])                    # back to one: train fits beside it now
    assert [(d.action, d.container) for d in ds] == [("place", "train")]
    # the count is part of the job's state: restored, it holds again
    run(s, [scaled(2, 6)])
    again = make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None), Capacity(4, 8 * GB, 1))
    again.restore([(k, v) for k, _p, v in s.writes()])
    assert again.policy.used("n1").cpu_cores == 4
    signed = make(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=None), ring=Keyring(b"c" * 40))
    run(signed, [submitted("svc", 1, cpu=1, workload="inference")])
    with pytest.raises(SignatureRefused, match="scaled svc"):
        signed.handle(scaled(2, 2))
