"""The targets agent in a real worker on a broker of its own: the share rule from the samples, and a restart.

- The worker follows two jobs of one host from their job events, reads their
  containers' use from the samples topic and applies the TRADL share rule: the
  limit decisions name the rule, the node's use against alpha x capacity and each
  job's share; poison job events around them are dead letters.
- A worker killed (SIGKILL) mid-job and started again goes on from the state
  table: the job reaches its objective without a new ``submitted`` event, and what
  the first worker decided is not decided again under another id.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid

import pytest

from phasewise.kit.records import (
    ContainerSample,
    Decision,
    HostSamples,
    JobControl,
    JobEvent,
    JobSpec,
    JobTargets,
    encode,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def submitted(job: str, ts: float) -> bytes:
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32,
                   targets=JobTargets(acceptable=1.0, objective=0.5))
    return encode(JobEvent(job=job, ts=ts, kind="submitted", spec=spec))


def started(job: str, host: str, ts: float) -> bytes:
    return encode(JobEvent(job=job, ts=ts, kind="started", host=host, container=job))


def progress(job: str, step: int, loss: float, ts: float) -> bytes:
    return encode(JobEvent(job=job, ts=ts, kind="progress", step=step, loss=loss))


def samples(host: str, ts: float, use: dict[str, float]) -> bytes:
    return encode(HostSamples(host=host, ts=ts, interval_s=1.0, host_cpu_count=2, containers=tuple(
        ContainerSample(container=c, cpu_cores=u, mem_bytes=2e8) for c, u in use.items())))


def start(settings, tmp_path, worker_id: str, port: int, log: str, **env):
    from phasewise.kit.procs import RoleProcess

    env = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_TARGETS_PATIENCE": "1", "PHASEWISE_TARGETS_EWMA_ALPHA": "1", **env}
    args = ["--targets", "--web-port", "0", "--worker-id", worker_id, "--data-dir", str(tmp_path / "data"),
            "--metrics-port", str(port)]
    return RoleProcess("worker", args, env=env, log_path=tmp_path / log).start()


def ready(port: int) -> bool:
    from phasewise.apps.bench.harness import scrape

    try:
        return scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0
    except OSError:
        return False


@pytest.fixture
def kit(broker, tmp_path):
    from phasewise.kit.broker import free_port
    from phasewise.kit.kafka.client import ensure_topics, make_producer
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import CONTROL, DEAD_LETTERS, DECISIONS
    from tests.test_poison import Reader

    settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(settings)
    readers = {t.name: Reader(settings, t.name, t.partitions) for t in (DECISIONS, CONTROL, DEAD_LETTERS)}
    yield settings, readers, make_producer(settings), free_port
    for r in readers.values():
        r.close()


def test_the_share_rule_from_the_samples_topic(kit, tmp_path):
    from phasewise.kit.topics import CONTROL, DEAD_LETTERS, DECISIONS, JOB_EVENTS, SAMPLES
    from tests.test_poison import dead_letters, poison, records, wait

    POISON = poison({"v": 1, "job": "p", "ts": 1.0, "kind": "progress", "step": 1, "loss": 0.5}, "ts",
                    {"step": "x"}, wrong_reason="must be", max_bytes=JobEvent.MAX_BYTES)

    settings, readers, p, free_port = kit
    tag = uuid.uuid4().hex[:6]
    host, a, b = f"node-{tag}", f"{tag}-a", f"{tag}-b"
    port = free_port()
    role = start(settings, tmp_path, f"share-{tag}", port, "worker.log", PHASEWISE_TARGETS_SHARE_ALPHA="0.5",
                 PHASEWISE_TARGETS_SHARE_INTERVAL_S="0")
    try:
        wait(lambda: ready(port), 90, "worker ready", role)
        now = time.time()
        for raw in (submitted(a, now), submitted(b, now), started(a, host, now), started(b, host, now)):
            p.produce(JOB_EVENTS.name, key=tag.encode(), value=raw)
        for raw in POISON.values():
            p.produce(JOB_EVENTS.name, key=tag.encode(), value=raw[0])
        p.flush(10)
        time.sleep(1.0)  # the job events first (another topic: no order across them)
        p.produce(SAMPLES.name, key=host.encode(), value=samples(host, time.time(), {a: 1.5, b: 0.3, "x": 0.2}))
        p.flush(10)

        def mine() -> list[Decision]:
            return [d for d in records(Decision, readers[DECISIONS.name].drain()) if d.host == host]

        wait(lambda: len(mine()) >= 2, 60, "the share rule's decisions", role)
        got = {d.container: d for d in mine()}
        assert (got[a].cpu_limit_cores, got[b].cpu_limit_cores) == (0.5, 0.667)
        assert got[a].policy == "targets" and got[a].action == "limit"
        assert got[a].reason == (f"TRADL share rule: node {host}'s 2 jobs use 1.8 cores > alpha 0.5 x 2 = 1; {a} "
                                 f"uses 1.5 > 1/n = 1: 1/(2n) = 0.5 cores (shares: {a} 1.5 -> 0.5, {b} 0.3 -> 0.667)")
        # the jobs' use drops below alpha x capacity: they compete freely again (released to the node's cores)
        p.produce(SAMPLES.name, key=host.encode(), value=samples(host, time.time(), {a: 0.4, b: 0.3}))
        p.flush(10)
        wait(lambda: len(mine()) >= 4, 60, "the release", role)
        released = mine()[2:]
        assert sorted((d.container, d.cpu_limit_cores) for d in released) == [(a, 2.0), (b, 2.0)]
        assert all(d.reason.startswith("released: ") for d in released)
        assert "0.7 cores" not in released[0].reason and "(the node's 2 cores)" in released[0].reason
        # a reaches its objective: checkpoint_exit
        p.produce(JOB_EVENTS.name, key=tag.encode(), value=progress(a, 1, 0.4, time.time()))
        p.flush(10)
        wait(lambda: any(c.job == a and c.action == "checkpoint_exit"
                         for c in records(JobControl, readers[CONTROL.name].drain())), 30, "the control", role)
        wait(lambda: len(dead_letters(readers[DEAD_LETTERS.name].drain(), JOB_EVENTS.name)) >= len(POISON), 30,
             "every dead letter", role)
        reasons = [dl.reason for dl in dead_letters(readers[DEAD_LETTERS.name].values, JOB_EVENTS.name).values()]
        for _, why in POISON.values():
            assert any(why in r for r in reasons), (why, reasons)
        assert role.alive()
    finally:
        role.stop()
    assert role.returncode() == 0, role.log_tail(40)


def test_a_worker_killed_mid_job_goes_on_from_its_state_table(kit, tmp_path):
    from phasewise.kit.topics import CONTROL, DEAD_LETTERS, DECISIONS, JOB_EVENTS
    from tests.test_poison import Reader, dead_letters, records, wait

    settings, readers, p, free_port = kit
    tag = uuid.uuid4().hex[:6]
    host, a, b = f"node-{tag}", f"{tag}-a", f"{tag}-b"
    worker_id = f"restart-{tag}"
    port = free_port()
    env = {"PHASEWISE_TARGETS_GRACE_S": "2"}
    first = start(settings, tmp_path, worker_id, port, "first.log", **env)

    def mine() -> list[Decision]:
        return [d for d in records(Decision, readers[DECISIONS.name].drain()) if d.host == host]

    try:
        wait(lambda: ready(port), 90, "first worker ready", first)
        now = time.time()
        for raw in (submitted(a, now), submitted(b, now), started(a, host, now), started(b, host, now),
                    progress(a, 1, 2.0, now + 1), progress(b, 1, 3.0, now + 1), progress(a, 2, 0.9, now + 2)):
            p.produce(JOB_EVENTS.name, key=tag.encode(), value=raw)
        p.flush(10)
        wait(lambda: len(mine()) >= 1, 60, "a held at acceptable", first)
        held = mine()[0]
        assert (held.container, held.cpu_limit_cores) == (a, 1.0)  # 0.25 x 8 cores / 2 jobs: b is short
        # a commit wrote both jobs' state to the table's changelog (its offsets follow; the events a commit
        # wrote but did not get to commit the offsets of are read again by the next worker, and skipped)
        changelog = Reader(settings, f"{worker_id}-targets-state-changelog", JOB_EVENTS.partitions)
        stored: set[str] = set()

        def both_stored() -> bool:
            stored.update(json.loads(m.key()) for m in changelog.c.consume(500, 0.2) if not m.error() and m.key())
            return stored >= {a, b}

        wait(both_stored, 60, "the state in the changelog", first)
        changelog.close()
        time.sleep(1.0)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # no clean shutdown, no last commit
        first.stop()
    port2 = free_port()
    second = start(settings, tmp_path, worker_id, port2, "second.log", **env)
    try:
        wait(lambda: ready(port2), 90, "second worker ready", second)
        t = time.time()
        for raw in (progress(a, 3, 0.4, t), progress(b, 2, 0.8, t)):  # no new submitted event
            p.produce(JOB_EVENTS.name, key=tag.encode(), value=raw)
        p.flush(10)
        wait(lambda: any(c.job == a and c.action == "checkpoint_exit"
                         for c in records(JobControl, readers[CONTROL.name].drain())), 60,
             "a's checkpoint_exit from the restored state", second)
        wait(lambda: any(d.action == "terminate" for d in mine()), 30, "a's hard stop after the grace", second)
        letters = dead_letters(readers[DEAD_LETTERS.name].drain(), JOB_EVENTS.name)
        assert not [dl.reason for dl in letters.values() if tag in dl.payload], "a restored job is no unknown job"
        ds = mine()
        assert len({d.id for d in ds if d.action == "limit" and d.container == a and d.cpu_limit_cores == 1.0}) == 1
        # from the table, not from the job events read again: their offsets were committed with it
        restored = re.search(r"targets: restored (\d+) followed job", (tmp_path / "second.log").read_text())
        assert restored and int(restored.group(1)) >= 2  # (the other test's jobs are on this broker too)
        stop = next(d for d in ds if d.action == "terminate")
        assert stop.container == a and stop.details["hard"] is True and "hard stop" in stop.reason
        assert second.alive()
    finally:
        second.stop()
    assert second.returncode() == 0, second.log_tail(40)
