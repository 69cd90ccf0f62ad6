"""The priority agent on a real worker: every valid job event decided, every poison dead-lettered, a restart
resuming what its predecessor preempted (the step itself: tests/models/jobs/test_priority_step.py)."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

from phasewise.kit.records import Decision, JobControl, JobEvent
from tests.models.jobs.test_priority_step import EXPECTED_WEIGHTED, JOB_POISON, finished, submitted, valid_stream


@pytest.mark.broker
@pytest.mark.slow
def test_a_real_worker_with_priorities_decides_every_valid_event_and_dead_letters_every_poison(broker, tmp_path):
    from phasewise.kit.kafka.client import ensure_topics, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import CONTROL, DEAD_LETTERS, DECISIONS, JOB_EVENTS
    from tests.test_poison import Reader, Sent, dead_letters, records, wait

    settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(settings)
    tag = uuid.uuid4().hex[:6]
    host = f"prio-{tag}"
    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port

    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_PRIORITY_HOST_CPU_CORES": "2", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G"}
    args = ["--priorities", "--priority-freeze-max-wait-s", "60", "--priority-grace-s", "20", "--web-port", "0",
            "--worker-id", f"prio-{tag}", "--data-dir", str(tmp_path / "data"), "--metrics-port", str(port),
            "--host", host]
    role = RoleProcess("worker", args, env=env, log_path=tmp_path / "worker.log").start()
    try:
        wait(lambda: _ready(scrape, port), 90, "worker ready", role)
        decisions = Reader(settings, DECISIONS.name, DECISIONS.partitions)
        letters = Reader(settings, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
        controls = Reader(settings, CONTROL.name, CONTROL.partitions)
        sent = Sent(make_producer(settings), JOB_EVENTS.name)
        kinds = list(JOB_POISON)
        # one key for all: one partition, so the events keep their order
        for i, v in enumerate(valid_stream(f"{tag}-", host=host)):
            sent.send(tag.encode(), v, f"valid:{i}")
            sent.send(tag.encode(), JOB_POISON[kinds[i % len(kinds)]][0], f"poison:{kinds[i % len(kinds)]}")
        for k in kinds[len(valid_stream()):]:
            sent.send(tag.encode(), JOB_POISON[k][0], f"poison:{k}")
        # valid but stamped ~116 days ahead: refused by the event-time rule (admitted, it would end low)
        sent.send(tag.encode(), finished(f"{tag}-low", time.time() + 1e7), "future:low")
        # big (unknown duration) needs low's 2 cores: low is checkpointed and stopped
        sent.send(tag.encode(), submitted(f"{tag}-big", 101, cpu=2, priority=3, host=host), "valid:big")
        sent.p.flush(10)

        def mine() -> list[Decision]:
            return [d for d in records(Decision, decisions.drain()) if d.host == host]

        wait(lambda: len(mine()) >= len(EXPECTED_WEIGHTED) + 3, 60, "every priority decision", role)
        got = [(d.action, d.container.removeprefix(f"{tag}-")) for d in mine()]
        assert got == [*EXPECTED_WEIGHTED, ("terminate", "low"), ("place", "big"), ("weight", "big")]
        wait(lambda: any(c.job == f"{tag}-low" and c.action == "checkpoint_exit"
                         for c in records(JobControl, controls.drain())), 30, "the checkpoint_exit control", role)
        # the stop is a state on the job's events too (the targets agent reads it), with this agent launching
        events = Reader(settings, JOB_EVENTS.name, JOB_EVENTS.partitions)
        wait(lambda: any(e.job == f"{tag}-low" and e.kind == "stopped" and e.host == host
                         for e in records(JobEvent, events.drain())), 30, "the stopped event", role)
        events.close()
        poisoned = sent.where("poison:")
        wait(lambda: set(poisoned) <= set(dead_letters(letters.drain(), JOB_EVENTS.name)), 30,
             "every dead letter", role)
        dl = dead_letters(letters.values, JOB_EVENTS.name)
        for at, label in poisoned.items():
            assert JOB_POISON[label.split(":")[1]][1] in dl[at].reason, (label, dl[at].reason)
        (future_at,) = sent.where("future:")
        wait(lambda: future_at in dead_letters(letters.drain(), JOB_EVENTS.name), 30, "the future event's letter",
             role)
        assert "ahead of the worker clock" in dead_letters(letters.values, JOB_EVENTS.name)[future_at].reason
        assert role.alive()
        for r in (decisions, letters, controls):
            r.close()
    finally:
        role.stop()
    assert role.returncode() == 0, role.log_tail(40)


@pytest.mark.broker
@pytest.mark.slow
def test_a_restarted_worker_resumes_the_job_its_predecessor_preempted(broker, tmp_path):
    """Worker 1 stops ``low`` (checkpoint-and-exit) for ``hi`` and is killed (SIGKILL: no last commit);
    worker 2, from the state table alone, restarts ``low`` from its checkpoint when ``hi`` finishes."""
    import os
    import signal

    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port
    from phasewise.kit.kafka.client import ensure_topics, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import DECISIONS, JOB_EVENTS
    from tests.test_poison import Reader, records, wait

    settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(settings)
    tag = uuid.uuid4().hex[:6]
    host, low, hi = f"restart-{tag}", f"{tag}-low", f"{tag}-hi"
    worker_id = f"prio-restart-{tag}"
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_PRIORITY_HOST_CPU_CORES": "2", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G"}

    def start(log: str):
        port = free_port()
        args = ["--priorities", "--web-port", "0", "--worker-id", worker_id, "--data-dir", str(tmp_path / "data"),
                "--metrics-port", str(port), "--host", host]
        role = RoleProcess("worker", args, env=env, log_path=tmp_path / log).start()
        wait(lambda: _ready(scrape, port), 90, f"{log}: worker ready", role)
        return role

    decisions = Reader(settings, DECISIONS.name, DECISIONS.partitions)
    seen: list[Decision] = []

    def mine() -> list[Decision]:  # every decision for the host so far (drain returns all read)
        seen[:] = [d for d in records(Decision, decisions.drain()) if d.host == host]
        return seen

    p = make_producer(settings)
    first = start("first.log")
    try:
        p.produce(JOB_EVENTS.name, key=low.encode(), value=submitted(low, 1, cpu=2, host=host,
                                                                     command=("python", "train.py", "--resume")))
        p.flush(10)
        # low is admitted before hi is submitted: the two keys are on different partitions, which the
        # worker may read in either order (hi first would leave low queued, never stopped)
        wait(lambda: len(mine()) >= 2, 60, "low admitted", first)
        p.produce(JOB_EVENTS.name, key=hi.encode(), value=submitted(hi, 2, cpu=2, priority=3, host=host))
        p.flush(10)
        wait(lambda: len(mine()) >= 5, 60, "low stopped for hi", first)
        assert [(d.action, d.container) for d in seen] == [
            ("place", low), ("weight", low), ("terminate", low), ("place", hi), ("weight", hi)]
        changelog = Reader(settings, f"{worker_id}-priority-state-changelog", JOB_EVENTS.partitions)
        stored: dict[str, dict] = {}

        def both_stored() -> bool:
            for m in changelog.c.consume(500, 0.2):
                if not m.error() and m.key() and m.value():
                    stored[json.loads(m.key())] = json.loads(m.value())
            return {low, hi} <= set(stored) and stored[low]["s"]["state"] == "stopped"

        wait(both_stored, 60, "the state in the changelog", first)
        changelog.close()
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # no clean shutdown, no last commit
        first.stop()
    second = start("second.log")
    try:
        p.produce(JOB_EVENTS.name, key=hi.encode(), value=finished(hi, 3))
        p.flush(10)
        wait(lambda: any(d.action == "place" and d.container == low and d.details.get("resume") for d in mine()),
             60, "low restarted by the second worker", second)
        wait(lambda: len(seen) >= 7, 30, "low's weight", second)
        resumed = next(d for d in seen if d.action == "place" and d.details.get("resume"))
        assert resumed.details["spec"]["command"] == ["python", "train.py", "--resume"]
        assert f"preempted by {hi}" in resumed.reason
        assert [(d.action, d.container) for d in seen[5:]] == [("place", low), ("weight", low)]
        assert len({d.id for d in seen if d.action == "terminate"}) == 1  # nothing decided twice
        restored = re.search(r"priorities: restored (\d+) job", (tmp_path / "second.log").read_text())
        assert restored and int(restored.group(1)) >= 2  # (the other test's jobs may be on this broker too)
        assert second.alive()
    finally:
        second.stop()
        decisions.close()
    assert second.returncode() == 0, second.log_tail(40)


def _ready(scrape, port) -> bool:
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0
    except OSError:
        return False
