"""No job event stops a role: a ~1 MB command against real ``worker --priorities`` and ``place``, with restarts.

The event (about 1,030,000 bytes) is under a real Kafka broker's default
record limit (``message.max.bytes`` 1,048,588), so any client may write it.
Before the job events had bounds, both roles copied the command into a
decision larger than their producer's limit and died on it, and again after
every restart (they read it again). Now the decoder refuses it (a job event
is at most ``JobEvent.MAX_BYTES``): it is a dead letter, and each role goes
on deciding for the next jobs, after a SIGKILL and after a restart under a
new id that reads the topic, the big event included, from its start.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    DeadLetter,
    Decision,
    GpuSample,
    HostSamples,
    JobEvent,
    JobRequests,
    JobSpec,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, SAMPLES
from tests.test_poison import Reader, records, wait

pytestmark = [pytest.mark.broker, pytest.mark.slow]

GIB = 1 << 30
#: the big event's command argument: the whole event stays under Kafka's default 1,048,588-byte record limit
BIG_ARG = 1_030_000


def submitted(job: str, *, host: str | None = None, command: tuple[str, ...] = ("python", "train.py")) -> bytes:
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32, command=command,
                   requests=JobRequests(cpu_cores=1.0, mem_bytes=GIB))
    return encode(JobEvent(job=job, ts=time.time(), kind="submitted", host=host, spec=spec))


def big(job: str, host: str | None = None) -> bytes:
    value = submitted(job, host=host, command=("python", "x" * BIG_ARG))
    assert JobEvent.MAX_BYTES < 1_000_000 < len(value) < 1_048_588
    return value


class Kit:
    def __init__(self, broker) -> None:
        self.settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
        ensure_topics(self.settings)
        # a writer allowed records up to Kafka's default broker limit
        self.p = make_producer(self.settings, **{"message.max.bytes": 1_048_588})
        self.decisions = Reader(self.settings, DECISIONS.name, DECISIONS.partitions)
        self.letters = Reader(self.settings, DEAD_LETTERS.name, DEAD_LETTERS.partitions)

    def send(self, topic: str, key: str, value: bytes) -> None:
        errors: list = []
        self.p.produce(topic, key=key.encode(), value=value, on_delivery=lambda e, m: e and errors.append(e))
        assert self.p.flush(30) == 0 and not errors, errors

    def placed(self, host: str) -> set[str]:
        return {d.container for d in records(Decision, self.decisions.drain()) if d.host == host
                and d.action == "place"}

    def letters_of(self, job: str) -> list[DeadLetter]:
        return [d for d in records(DeadLetter, self.letters.drain()) if d.key == job]

    def close(self) -> None:
        self.decisions.close()
        self.letters.close()


@pytest.fixture
def kit(broker):
    k = Kit(broker)
    yield k
    k.close()


def _ready(port: int, metric: str) -> bool:
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics").get(metric) == 1.0
    except OSError:
        return False


def _start(role: str, args: list[str], env: dict, log, metric: str) -> RoleProcess:
    port = free_port()
    r = RoleProcess(role, [*args, "--metrics-port", str(port)], env=env, log_path=log).start()
    wait(lambda: _ready(port, metric), 120, f"{role} ready", r)
    return r


def _the_big_event_is_a_dead_letter_and_the_role_goes_on(kit: Kit, start, host: str, tag: str) -> None:
    """start(label, worker_id) -> a ready role; three runs: the big event, a SIGKILL, a fresh id."""
    big_job = f"big-{tag}"
    first = start("first", f"pwtest-{tag}")
    try:
        kit.send(JOB_EVENTS.name, big_job, big(big_job, host))
        kit.send(JOB_EVENTS.name, f"a1-{tag}", submitted(f"a1-{tag}", host=host))
        wait(lambda: f"a1-{tag}" in kit.placed(host), 90, "a1 placed", first)
        wait(lambda: kit.letters_of(big_job), 30, "the big event's dead letter", first)
        (dl,) = kit.letters_of(big_job)[:1]
        assert dl.reason.startswith("JobEvent: message of 10") and "larger than the limit of 65536 bytes" in dl.reason
        assert dl.source_topic == JOB_EVENTS.name and dl.truncated and dl.payload_bytes > 1_000_000
        assert first.alive()
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # no clean stop: what was not committed is read again
        first.stop()
    second = start("second", f"pwtest-{tag}")
    try:
        kit.send(JOB_EVENTS.name, f"a2-{tag}", submitted(f"a2-{tag}", host=host))
        wait(lambda: f"a2-{tag}" in kit.placed(host), 90, "a2 placed after a SIGKILL", second)
        assert second.alive()
    finally:
        assert second.stop(timeout_s=60) == 0, second.log_tail(40)
    before = len(kit.letters_of(big_job))
    third = start("third", f"pwtest-{tag}-fresh")  # a new consumer group: reads the big event again
    try:
        kit.send(JOB_EVENTS.name, f"a3-{tag}", submitted(f"a3-{tag}", host=host))
        wait(lambda: f"a3-{tag}" in kit.placed(host), 90, "a3 placed by a worker that read the big event", third)
        wait(lambda: len(kit.letters_of(big_job)) > before, 30, "the big event dead-lettered again", third)
        assert third.alive()
    finally:
        assert third.stop(timeout_s=60) == 0, third.log_tail(40)


def test_a_1mb_command_is_a_dead_letter_and_worker_priorities_goes_on_after_restarts(kit, tmp_path):
    tag = uuid.uuid4().hex[:6]
    host = f"prio-{tag}"
    env = {"PHASEWISE_BOOTSTRAP": kit.settings.kafka.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_PRIORITY_HOST_CPU_CORES": "64", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "256G"}

    def start(label: str, worker_id: str) -> RoleProcess:
        args = ["--priorities", "--web-port", "0", "--worker-id", worker_id, "--data-dir", str(tmp_path / worker_id),
                "--host", host]
        return _start("worker", args, env, tmp_path / f"{label}.log", "phasewise_worker_ready")

    _the_big_event_is_a_dead_letter_and_the_role_goes_on(kit, start, host, tag)


def test_a_1mb_command_is_a_dead_letter_and_place_goes_on_after_restarts(kit, tmp_path):
    tag = uuid.uuid4().hex[:6]
    host = f"node-{tag}"
    env = {"PHASEWISE_BOOTSTRAP": kit.settings.kafka.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_PLACE_PREDICTION_WAIT_S": "0"}

    def start(label: str, worker_id: str) -> RoleProcess:
        # a node for every job; a live host samples every second, so a restarted worker hears of it again
        # (one that resumes after the first run's commit does not read the first sample again)
        kit.send(SAMPLES.name, host, encode(HostSamples(
            host=host, ts=time.time(), interval_s=1.0, host_cpu_count=1024, host_cpu_cores=1.0, host_mem_bytes=GIB,
            host_mem_total_bytes=4096 * GIB,
            gpus=(GpuSample(index=0, uuid="GPU-0", util=0.0, mem_used_bytes=0, mem_total_bytes=16 * GIB),))))
        args = ["--place-id", worker_id, "--data-dir", str(tmp_path / worker_id)]
        return _start("place", args, env, tmp_path / f"{label}.log", "phasewise_place_ready")

    _the_big_event_is_a_dead_letter_and_the_role_goes_on(kit, start, host, tag)
