"""The targets agent's record handling: bad progress events are dead letters with reasons, jobs unaffected."""

from __future__ import annotations

import json

import pytest

from phasewise.kit.records import Decision, JobControl, JobEvent, JobSpec, JobTargets, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import CONTROL, DECISIONS
from phasewise.streams.agents.targets import TargetsHandler, fleet_from_settings


def make(**env):
    settings = Settings.from_env({"host": "h1", **env}, env={})
    sent: list[tuple[str, bytes | None, bytes]] = []
    dead: list[tuple[object, str]] = []
    h = TargetsHandler(fleet_from_settings(settings), lambda t, k, v: sent.append((t, k, v)),
                       lambda ev, why: dead.append((ev, why)))
    return h, sent, dead


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
    reasons = [why for _, why in dead]
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
    h.handle(1, progress("job-b", 1, 0.5))
    h.handle(2, submitted("job-c", acceptable=0.5, objective=1.0))  # objective above acceptable for min
    assert [why for _, why in dead] == ["unknown job 'job-b' (no submitted event with targets)",
                                        "job 'job-c': targets: objective must be <= acceptable for direction min, "
                                        "got acceptable 0.5, objective 1"]
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


@pytest.mark.broker
@pytest.mark.slow
def test_the_worker_with_targets_through_the_broker(settings, tmp_path):
    import os
    import subprocess
    import sys
    import time
    import uuid

    from phasewise.kit.kafka.client import make_consumer, make_producer
    from phasewise.kit.topics import DEAD_LETTERS, JOB_EVENTS

    env = {**os.environ, "PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_TARGETS_ENABLED": "true",
           "PHASEWISE_TARGETS_PATIENCE": "1", "PHASEWISE_TARGETS_EWMA_ALPHA": "1", "PHASEWISE_TARGETS_GRACE_S": "1"}
    job = f"job-{uuid.uuid4().hex[:6]}"
    w = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "worker", "--web-port", "0", "--worker-id",
                          f"t-{uuid.uuid4().hex[:6]}", "--data-dir", str(tmp_path)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p = make_producer(settings)
        k = job.encode()
        now = time.time()
        p.produce(JOB_EVENTS.name, key=k, value=submitted(job, ts=now))
        p.produce(JOB_EVENTS.name, key=k, value=submitted(f"{job}-b", ts=now))  # short of acceptable beside it
        p.produce(JOB_EVENTS.name, key=k, value=started(job, host=f"node-{job}", ts=now))
        p.produce(JOB_EVENTS.name, key=k, value=started(f"{job}-b", host=f"node-{job}", ts=now))
        for raw, _ in BAD[:3]:
            p.produce(JOB_EVENTS.name, key=k, value=raw)
        for i, loss in enumerate([2.0, 0.9, 0.4], 1):
            p.produce(JOB_EVENTS.name, key=k, value=progress(job, i, loss, ts=now + i))
        p.flush(10)
        c = make_consumer(settings, f"t-{uuid.uuid4().hex[:8]}")
        c.subscribe([DECISIONS.name, CONTROL.name, DEAD_LETTERS.name])
        got: list[tuple[str, dict]] = []
        deadline = time.monotonic() + 90
        try:
            while time.monotonic() < deadline and len(got) < 6:
                m = c.poll(0.5)
                if m is None or m.error() or m.value() is None:
                    continue
                try:  # the topics hold other tests' records too, some of them not JSON on purpose
                    v = json.loads(m.value())
                except (ValueError, RecursionError):
                    continue
                if isinstance(v, dict) and (m.key() == k or v.get("container") == job):
                    got.append((m.topic(), v))
        finally:
            c.close()
        assert w.poll() is None, "the worker must keep running"
    finally:
        w.terminate()
        w.wait(30)
    kinds = sorted((t, v.get("action")) for t, v in got)
    assert kinds == sorted([(DECISIONS.name, "limit"), (CONTROL.name, "checkpoint_exit"),
                            (DECISIONS.name, "terminate")] + [(DEAD_LETTERS.name, None)] * 3), kinds


def test_a_progress_event_stamped_far_ahead_is_a_dead_letter_and_pins_nothing():
    from phasewise.models.safety.intake import EventClock
    from phasewise.streams.config import intake_config

    settings = Settings.from_env({"host": "h1", "targets_patience": 1, "targets_ewma_alpha": 1.0}, env={})
    sent, dead = [], []
    clock = EventClock(intake_config(settings.replace(intake_max_future_s=60, intake_max_behind_s=600)))
    h = TargetsHandler(fleet_from_settings(settings), lambda t, k, v: sent.append((t, k, v)),
                       lambda ev, why, kind="schema": dead.append((ev, why, kind)),
                       clock=clock, now=lambda: 1100.0)
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
    """The priority agent's hints (stamped by another job's event) and new priorities: neither a dead letter
    nor the job's newest time, however they are stamped."""
    from phasewise.models.safety.intake import EventClock
    from phasewise.streams.config import intake_config

    settings = Settings.from_env({"host": "h1", "targets_patience": 1, "targets_ewma_alpha": 1.0}, env={})
    sent, dead = [], []
    clock = EventClock(intake_config(settings.replace(intake_max_future_s=60, intake_max_behind_s=600)))
    h = TargetsHandler(fleet_from_settings(settings), lambda t, k, v: sent.append((t, k, v)),
                       lambda ev, why, *kind: dead.append((ev, why)),
                       clock=clock, now=lambda: 1000.0)
    h.handle(0, submitted("job-a", ts=900.0))
    h.handle(1, started("job-a", ts=950.0))
    for i, ev in enumerate([JobEvent(job="job-a", ts=100.0, kind="admitted", host="node-7", resume=True),
                            JobEvent(job="job-a", ts=1e9, kind="stopped", host="node-7"),
                            JobEvent(job="job-a", ts=1040.0, kind="priority", priority=3)]):
        h.handle(2 + i, encode(ev))
    assert dead == [] and sent == []
    h.handle(5, progress("job-a", 1, 0.1, ts=400.0))  # 550 s behind started: within the bound (not 1040)
    assert dead == [] and [json.loads(v)["action"] for _, _, v in sent] == ["checkpoint_exit"]


def test_a_submitted_container_is_ignored_and_a_started_one_taken_only_when_signed_with_the_cluster_key():
    from phasewise.kit.signing import Keyring
    from phasewise.kit.topics import JOB_EVENTS

    ring = Keyring(b"c" * 40)
    settings = Settings.from_env({"host": "h1", "targets_patience": 1, "targets_ewma_alpha": 1.0}, env={})
    sent: list = []
    dead: list = []
    h = TargetsHandler(fleet_from_settings(settings), lambda *a: sent.append(a),
                       lambda ev, why, *kind: dead.append(why), verify=ring.verify)
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32, targets=JobTargets(acceptable=1.0,
                                                                                          objective=0.5))
    # a job-events writer names a victim's container in its submission: the job's container is its id
    h.handle("e0", encode(JobEvent(job="a", ts=1.0, kind="submitted", spec=spec, container="victim")))
    assert h.fleet.jobs["a"].container is None
    forged = encode(JobEvent(job="a", ts=2.0, kind="started", host="node-7", container="victim"))
    h.handle("e1", forged, key=b"a")
    assert dead == ["JobEvent started a: not signed by the cluster key (unsigned: no phasewise-hmac header, and "
                    "signing_key_file is set): its container is not taken"]
    assert h.fleet.jobs["a"].container is None and h.fleet.jobs["a"].host is None
    h.handle("e2", forged, key=b"a", headers=ring.headers(JOB_EVENTS.name, b"a", forged))  # the actuator's
    assert h.fleet.jobs["a"].container == "victim" and len(dead) == 1
