"""The targets agent's step without Faust: bad progress events are refused with reasons, jobs unaffected; its
table state restores it."""

from __future__ import annotations

import json

import pytest

from phasewise.kit.records import Decision, JobControl, JobEvent, JobSpec, JobTargets, SchemaError, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import CONTROL, DECISIONS
from phasewise.models.jobs.events import Refused
from phasewise.models.jobs.targets_step import TargetsStep
from phasewise.streams.config import targets_step_config


class Agent:
    """What the agent does with the step's answers, for the tests: the records it would send, in order
    (``(topic, key, value)``), and its dead letters (``(event, reason, kind)``)."""

    def __init__(self, step: TargetsStep) -> None:
        self.step, self.fleet = step, step.fleet
        self.sent: list[tuple[str, bytes | None, bytes]] = []
        self.dead: list[tuple[object, str, str]] = []

    def handle(self, event, raw, partition=None, offset=None, *, key=None, headers=None) -> None:
        try:
            decisions, controls = self.step.handle(raw, partition, offset, key=key, headers=headers)
        except SchemaError as e:
            self.dead.append((event, str(e), "schema"))
            return
        except Refused as e:
            self.dead.append((event, str(e), e.kind))
            return
        self.emit(decisions, controls)

    def tick(self, now: float) -> None:
        self.emit(self.step.tick(now), [])

    def emit(self, decisions, controls) -> None:
        self.sent += [(DECISIONS.name, d.host.encode(), encode(d)) for d in decisions]
        self.sent += [(CONTROL.name, c.job.encode(), encode(c)) for c in controls]

    @property
    def replayed(self) -> int:
        return self.step.replayed

    def writes(self):
        return self.step.writes()

    def restore(self, items) -> int:
        return self.step.restore(items)


def step(clock=None, now=None, verify=None, **env) -> Agent:
    settings = Settings.from_env({"host": "h1", **env}, env={})
    return Agent(TargetsStep(targets_step_config(settings), clock=clock, now=now, verify=verify))


def make(**env):
    h = step(**env)
    return h, h.sent, h.dead


def submitted(job: str, acceptable=1.0, objective=0.5, ts=1.0, **kw) -> bytes:
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32,
                   targets=JobTargets(acceptable=acceptable, objective=objective, **kw))
    return encode(JobEvent(job=job, ts=ts, kind="submitted", spec=spec))


def progress(job: str, step: int, loss: float, ts: float | None = None) -> bytes:
    return encode(JobEvent(job=job, ts=ts if ts is not None else 10.0 + step, kind="progress", step=step, loss=loss))


def started(job: str, host: str = "node-7", ts: float = 2.0) -> bytes:
    return encode(JobEvent(job=job, ts=ts, kind="started", host=host, container=job))


def test_a_job_reaches_acceptable_then_objective_and_each_decision_names_its_target():
    h, sent, dead = make(targets_patience=1, targets_ewma_alpha=1.0, targets_node_cores=4.0)
    for job in ("job-a", "job-b"):
        h.handle("e0", submitted(job))
        h.handle("e1", started(job))
    for i, loss in enumerate([2.0, 0.9, 0.4], start=1):
        h.handle(f"p{i}", progress("job-a", i, loss))
    assert not dead
    (t1, k1, v1), (t2, k2, v2) = sent
    d = decode(Decision, v1)
    assert (t1, k1, d.action, d.host, d.container, d.cpu_limit_cores) == (
        DECISIONS.name, b"node-7", "limit", "node-7", "job-a", 0.5)  # 0.25 x 4 cores / 2 jobs
    assert d.reason == ("loss 0.9 (smoothed ewma alpha=1) <= acceptable 1 at step 2: held to 0.25 x 4 / 2 = 0.5 "
                        "cores while job-b is short of acceptable (TRADL acceptable rule)")
    c = decode(JobControl, v2)
    assert (t2, k2, c.action, c.grace_s) == (CONTROL.name, b"job-a", "checkpoint_exit", 30.0)
    assert "objective 0.5" in c.reason
    h.tick(13.0 + 29.0)
    assert len(sent) == 2  # grace not over
    h.tick(13.0 + 31.5)
    stop = decode(Decision, sent[2][2])
    assert stop.action == "terminate" and stop.details["hard"] is True and "hard stop" in stop.reason
    assert stop.ts == 43.0  # when it fell due: the same stop decided again is the same decision
    h.tick(100.0)
    assert len(sent) == 3


def test_a_job_alone_on_its_node_or_nowhere_known_is_not_held():
    h, sent, _ = make(targets_patience=1, targets_ewma_alpha=1.0)
    h.handle("e0", submitted("job-a"))
    h.handle("p1", progress("job-a", 1, 0.9))
    h.handle("e1", submitted("job-b"))
    h.handle("e2", started("job-b"))
    h.handle("p2", progress("job-b", 1, 0.9))  # alone on node-7: nobody to give its CPU to
    assert sent == []


def test_finished_within_grace_means_no_hard_stop_and_the_others_are_released():
    h, sent, _ = make(targets_patience=1, targets_ewma_alpha=1.0, targets_node_cores=4.0)
    for job in ("job-a", "job-b", "job-c"):
        h.handle("e0", submitted(job))
        h.handle("e1", started(job))
    h.handle("p1", progress("job-a", 1, 0.1))  # a: both tiers at once; b and c short of acceptable
    h.handle("p2", progress("job-b", 1, 0.9))  # b past acceptable while c is short: held
    h.handle("f", encode(JobEvent(job="job-a", ts=12.0, kind="finished")))
    h.tick(10_000.0)
    h.handle("p3", progress("job-c", 2, 0.9))  # nobody short of acceptable: b released
    got = [(json.loads(v).get("container") or json.loads(v).get("job"), json.loads(v).get("action"),
            json.loads(v).get("cpu_limit_cores")) for _, _, v in sent]
    assert got == [("job-a", "checkpoint_exit", None), ("job-b", "limit", 0.5), ("job-b", "limit", 4.0)]
    assert json.loads(sent[2][2])["reason"].startswith("released: ")


def test_a_restored_handler_skips_the_events_its_state_holds_and_decides_as_if_never_stopped():
    h, sent, dead = make(targets_patience=2, targets_ewma_alpha=0.5, targets_node_cores=4.0)
    stream = [submitted("job-a"), submitted("job-b"), started("job-a"), started("job-b")]
    stream += [progress(j, s, v) for s, (va, vb) in enumerate([(2.0, 3.0), (1.2, 2.5), (0.9, 2.0), (0.8, 1.6),
                                                               (0.4, 0.9), (0.3, 0.8), (0.2, 0.4), (0.1, 0.3)], 1)
               for j, v in (("job-a", va), ("job-b", vb))]
    for off, raw in enumerate(stream):
        h.handle(off, raw, partition=3, offset=off)
    assert not dead and [json.loads(v).get("action") for _, _, v in sent] == ["limit", "checkpoint_exit"]
    for cut in range(1, len(stream)):
        h1, sent1, _ = make(targets_patience=2, targets_ewma_alpha=0.5, targets_node_cores=4.0)
        for off, raw in enumerate(stream[:cut]):
            h1.handle(off, raw, partition=3, offset=off)
        table = {k: v for k, _, v in h1.writes()}
        h2, sent2, dead2 = make(targets_patience=2, targets_ewma_alpha=0.5, targets_node_cores=4.0)
        h2.restore(table.items())
        back = max(0, cut - 5)  # the last offsets were not committed: read again from before the cut
        for off in range(back, len(stream)):
            h2.handle(off, stream[off], partition=3, offset=off)
        assert not dead2, (cut, dead2)
        assert sent1 + sent2 == sent, cut
        assert h2.replayed == sum(1 for o in range(back, cut) if json.loads(stream[o])["job"] in table), cut


BAD = [
    (None, "null"),
    (b"[" * 100_000 + b"]" * 100_000, "deep"),
    (bytes(range(256)) * 2400, "binary"),  # 600 kB
    (b'{"v": 1, "job": "job-a", "ts": "soon", "kind": "progress"}', "ts"),
    (b'{"v": 1, "job": "job-a", "ts": 12.0, "kind": "progress", "step": 4, "loss": NaN}', "loss"),
    (b'{"v": 1, "job": "job-a", "ts": 12.0, "kind": "progress", "step": "x", "loss": 1.0}', "step"),
]


def test_bad_records_and_bad_progress_are_dead_lettered_with_reasons_and_the_job_is_unaffected():
    h, sent, dead = make(targets_patience=2, targets_ewma_alpha=1.0)
    good = [submitted("job-a")] + [progress("job-a", s, v) for s, v in [(1, 2.0), (2, 1.5), (3, 0.9)]]
    prelude = [submitted("job-b"), started("job-a"), started("job-b")]  # job-b stays short of acceptable
    stream = [good[0], *prelude, good[1]]
    for raw, _ in BAD:
        stream.append(raw)
    stream += [
        progress("job-a", 1, 0.1),  # steps going backwards (last 1 -> 1 is fine, so use 0 below)
        encode(JobEvent(job="job-a", ts=13.0, kind="progress", step=0, loss=0.1)),  # backwards
        encode(JobEvent(job="job-a", ts=13.0, kind="progress", step=5, loss=5e12)),  # absurd
        progress("ghost", 3, 0.1),  # unknown job
        encode(JobEvent(job="job-a", ts=13.0, kind="progress", step=5)),  # no loss
        good[2], good[3], progress("job-a", 4, 0.8), progress("job-a", 5, 0.4), progress("job-a", 6, 0.3),
    ]
    for i, raw in enumerate(stream):
        h.handle(i, raw)
    reasons = [why for _, why, _kind in dead]
    assert len(dead) == len(BAD) + 4, reasons
    assert "goes backwards" in reasons[len(BAD)]
    assert "absurd" in reasons[len(BAD) + 1]
    assert "unknown job 'ghost'" in reasons[len(BAD) + 2]
    assert "carries no loss" in reasons[len(BAD) + 3]
    assert any("null" in r.lower() or "none" in r.lower() for r in reasons[:1])
    # the valid stream, around all of that, is followed exactly as alone
    h2, sent2, dead2 = make(targets_patience=2, targets_ewma_alpha=1.0)
    for i, raw in enumerate([good[0], *prelude, good[1], progress("job-a", 1, 0.1), good[2], good[3],
                             progress("job-a", 4, 0.8), progress("job-a", 5, 0.4), progress("job-a", 6, 0.3)]):
        h2.handle(i, raw)
    assert not dead2
    strip = [(t, k, json.loads(v)["reason"]) for t, k, v in sent]
    assert strip == [(t, k, json.loads(v)["reason"]) for t, k, v in sent2]
    assert [json.loads(v).get("action") for _, _, v in sent] == ["limit", "checkpoint_exit"]


def test_jobs_without_targets_are_not_followed_and_bad_targets_are_reported():
    h, sent, dead = make()
    h.handle(0, encode(JobEvent(job="job-b", ts=1.0, kind="submitted",
                                spec=JobSpec(model="m", dataset="d", batch_size=8))))
    h.handle(1, progress("job-b", 1, 0.5))  # submitted without targets: another agent's job, skipped
    h.handle(2, submitted("job-c", acceptable=0.5, objective=1.0))  # objective above acceptable for min
    h.handle(3, progress("job-x", 1, 0.5))  # never submitted: a dead letter
    assert [why for _, why, _kind in dead] == [
        "job 'job-c': targets: objective must be <= acceptable for direction min, got acceptable 0.5, objective 1",
        "unknown job 'job-x' (no submitted event with targets)"]
    assert not sent


def test_metric_targets_with_max_direction():
    h, sent, dead = make(targets_patience=1, targets_ewma_alpha=1.0)
    h.handle(0, submitted("job-m", acceptable=0.7, objective=0.9, metric="accuracy", direction="max"))
    h.handle(0, submitted("job-n"))
    h.handle(0, started("job-m"))
    h.handle(0, started("job-n"))
    for step, acc in [(1, 0.5), (2, 0.75), (3, 0.95)]:
        h.handle(step, encode(JobEvent(job="job-m", ts=float(step), kind="progress", step=step, loss=1.0,
                                       metric=acc, metric_name="accuracy")))
    assert not dead
    assert [json.loads(v).get("action") for _, _, v in sent] == ["limit", "checkpoint_exit"]
    assert "accuracy 0.95" in json.loads(sent[1][2])["reason"]


@pytest.mark.parametrize("env, why", [({"targets_patience": 0}, "targets_patience"),
                                      ({"targets_shrink": 1.5}, "targets_shrink")])
def test_bad_settings_are_one_line_errors(env, why):
    from phasewise.kit.settings import SettingsError

    with pytest.raises(SettingsError, match=why):
        Settings.from_env(env, env={})


def test_a_progress_event_stamped_far_ahead_is_a_dead_letter_and_pins_nothing():
    from phasewise.models.safety.intake import EventClock
    from tests.models.safety.test_intake import config as intake

    h = step(clock=EventClock(intake(max_future_s=60, max_behind_s=600)), now=lambda: 1100.0,
             targets_patience=1, targets_ewma_alpha=1.0)
    sent, dead = h.sent, h.dead
    h.handle("e0", submitted("job-a", ts=1000.0))
    h.handle("e1", started("job-a", ts=1001.0))
    h.handle("future", progress("job-a", 1, 0.4, ts=1100.0 + 1e7))  # would reach the objective at once
    h.handle("old", progress("job-a", 2, 0.4, ts=300.0))  # far behind the job's newest event
    assert [(ev, kind) for ev, _, kind in dead] == [("future", "event_time"), ("old", "event_time")]
    assert "ahead of the worker clock" in dead[0][1] and "behind the job's newest event" in dead[1][1]
    assert sent == []  # nothing decided from either
    h.handle("p1", progress("job-a", 1, 2.0, ts=1050.0))
    h.handle("p2", progress("job-a", 2, 0.4, ts=1051.0))  # the job is still followed: the objective is reached
    assert [decode(JobControl, v).action for t, _, v in sent if t == CONTROL.name] == ["checkpoint_exit"]


def test_kinds_it_does_not_act_on_are_skipped_never_dead_lettered():
    """The priority agent's hints (stamped by another job's event; a ``stopped`` one marks the job, below) and new
    priorities: neither a dead letter nor the job's newest time, however they are stamped."""
    from phasewise.models.safety.intake import EventClock
    from tests.models.safety.test_intake import config as intake

    h = step(clock=EventClock(intake(max_future_s=60, max_behind_s=600)), now=lambda: 1000.0,
             targets_patience=1, targets_ewma_alpha=1.0)
    sent, dead = h.sent, h.dead
    h.handle(0, submitted("job-a", ts=900.0))
    h.handle(1, started("job-a", ts=950.0))
    for i, ev in enumerate([JobEvent(job="job-a", ts=100.0, kind="admitted", host="node-7", resume=True),
                            JobEvent(job="job-a", ts=1e9, kind="stopped", host="node-7"),
                            JobEvent(job="job-a", ts=1040.0, kind="priority", priority=3)]):
        h.handle(2 + i, encode(ev))
    assert dead == [] and sent == []
    h.handle(5, progress("job-a", 1, 0.1, ts=400.0))  # 550 s behind started: within the bound (not 1040)
    assert dead == [] and [json.loads(v)["action"] for _, _, v in sent] == ["checkpoint_exit"]


def ended(job: str, kind: str, ts: float) -> bytes:
    return encode(JobEvent(job=job, ts=ts, kind=kind, exit_code=0 if kind == "finished" else 143))


@pytest.mark.parametrize("kind", ["finished", "failed"])
def test_a_job_that_exits_on_the_priority_agent_s_stop_before_its_terminate_is_followed_again_when_resumed(kind):
    """The priority agent's checkpoint stop puts ``stopped`` on the job's events before its control; a job that
    exits on the control before the actuator handles the terminate is reported finished or failed. That end
    is the stop's exit: the job leaves its node (the others are divided again), its targets are kept, and its
    resumed run is held to them; an end after it started again is its own. The mark survives a restart."""
    h, sent, dead = make(targets_patience=1, targets_ewma_alpha=1.0, targets_node_cores=4.0)
    for job in ("job-a", "job-b"):
        h.handle("e0", submitted(job))
        h.handle("e1", started(job))
    h.handle("p1", progress("job-a", 1, 0.9))  # a past acceptable while b is short: held to 0.5 cores
    assert [(decode(Decision, v).container, decode(Decision, v).cpu_limit_cores) for _, _, v in sent] == [
        ("job-a", 0.5)]
    h.handle("s", encode(JobEvent(job="job-a", ts=20.0, kind="stopped", host="node-7", container="job-a")))
    assert h.fleet.jobs["job-a"].stopping and sent[1:] == []
    restored = step(targets_patience=1, targets_ewma_alpha=1.0, targets_node_cores=4.0)
    restored.restore([(k, v) for k, _p, v in h.writes()])
    for agent in (h, restored):
        agent.handle("x", ended("job-a", kind, 21.0))
        assert "job-a" in agent.fleet.jobs and agent.fleet.jobs["job-a"].host is None and agent.dead == []
        agent.handle("r", started("job-a", ts=30.0))  # resumed from its checkpoint
        assert agent.fleet.jobs["job-a"].host == "node-7" and not agent.fleet.jobs["job-a"].stopping
        agent.handle("p2", progress("job-a", 2, 0.4, ts=31.0))  # objective: asked to checkpoint and exit
        assert [decode(JobControl, v).action for t, _, v in agent.sent if t == CONTROL.name] == ["checkpoint_exit"]
        agent.handle("f", ended("job-a", "finished", 40.0))  # its own end now
        assert "job-a" not in agent.fleet.jobs
    assert dead == []


def test_without_the_stop_an_end_is_the_job_s_end_and_an_unsigned_stopped_changes_nothing():
    from phasewise.kit.signing import Keyring
    from phasewise.kit.topics import JOB_EVENTS

    h, _, _ = make(targets_patience=1, targets_ewma_alpha=1.0)
    h.handle("e0", submitted("job-a"))
    h.handle("e1", started("job-a"))
    h.handle("f", ended("job-a", "finished", 21.0))
    assert "job-a" not in h.fleet.jobs
    h.handle("s", encode(JobEvent(job="job-a", ts=22.0, kind="stopped")))  # after its end: nothing, no letter
    assert "job-a" not in h.fleet.jobs and h.dead == []
    ring = Keyring(b"c" * 40)
    h = step(verify=lambda key, value, headers: ring.verify(JOB_EVENTS.name, key, value, headers),
             targets_patience=1, targets_ewma_alpha=1.0)
    h.handle("e0", submitted("job-a"))
    h.handle("e1", started("job-a"), key=b"job-a", headers=ring.headers(JOB_EVENTS.name, b"job-a", started("job-a")))
    forged = encode(JobEvent(job="job-a", ts=20.0, kind="stopped", host="node-7"))
    h.handle("s", forged, key=b"job-a")
    assert [why.split(":")[0] for _, why, _ in h.dead] == ["JobEvent stopped job-a"]
    assert not h.fleet.jobs["job-a"].stopping
    end = ended("job-a", "finished", 21.0)
    h.handle("f", end, key=b"job-a", headers=ring.headers(JOB_EVENTS.name, b"job-a", end))
    assert "job-a" not in h.fleet.jobs


def test_a_submitted_container_is_ignored_and_a_started_one_taken_only_when_signed_with_the_cluster_key():
    from phasewise.kit.signing import Keyring
    from phasewise.kit.topics import JOB_EVENTS

    ring = Keyring(b"c" * 40)
    h = step(verify=lambda key, value, headers: ring.verify(JOB_EVENTS.name, key, value, headers),
             targets_patience=1, targets_ewma_alpha=1.0)
    dead = h.dead
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32, targets=JobTargets(acceptable=1.0,
                                                                                          objective=0.5))
    # a job-events writer names a victim's container in its submission: the job's container is its id
    h.handle("e0", encode(JobEvent(job="a", ts=1.0, kind="submitted", spec=spec, container="victim")))
    assert h.fleet.jobs["a"].container is None
    forged = encode(JobEvent(job="a", ts=2.0, kind="started", host="node-7", container="victim"))
    h.handle("e1", forged, key=b"a")
    assert [(why, kind) for _, why, kind in dead] == [
        ("JobEvent started a: not signed by the cluster key (unsigned: no phasewise-hmac header, and "
         "signing_key_file is set): its container is not taken", "schema")]  # (the kind this agent counts it as)
    assert h.fleet.jobs["a"].container is None and h.fleet.jobs["a"].host is None
    h.handle("e2", forged, key=b"a", headers=ring.headers(JOB_EVENTS.name, b"a", forged))  # the actuator's
    assert h.fleet.jobs["a"].container == "victim" and len(dead) == 1
