"""``phasewise actuate`` killed (SIGKILL) while its jobs run, and started again (issue #23, bad input).

The real role on the module's broker, the cgroup backend on the host's cgroup
v1 hierarchies, real jobs: the first actuator starts three, is killed, one job
ends with status 0 and one is killed while no actuator runs, and the second
actuator (not their parent) reports both, watches the third again and reports
its end. Once the second actuator stopped, each job has exactly two states on
the job-events topic: ``started`` and its end.
"""

from __future__ import annotations

import os
import pwd
import select
import signal
import time
import uuid
from pathlib import Path

import pytest

from phasewise.kit.kafka.client import make_consumer, make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import Decision, JobEvent, decode, encode
from phasewise.kit.topics import DECISIONS, JOB_EVENTS
from tests.conftest import requires_root
from tests.job_keys import start as signed_start
from tests.job_keys import write_public

pytestmark = [pytest.mark.broker, pytest.mark.slow]

V1 = Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists() and Path("/sys/fs/cgroup/memory").is_dir()


class Events:
    """The job-events topic, read from its start, kept by job."""

    def __init__(self, settings, jobs: set[str]) -> None:
        self.jobs = jobs
        self.by_job: dict[str, list[JobEvent]] = {j: [] for j in jobs}
        self.c = make_consumer(settings, f"pwtest-events-{uuid.uuid4().hex[:6]}")
        self.c.subscribe([JOB_EVENTS.name])

    def until(self, done, timeout_s: float = 90.0) -> None:
        """Read until ``done(by_job)`` holds (the test fails after *timeout_s*)."""
        deadline = time.monotonic() + timeout_s
        while not done(self.by_job):
            assert time.monotonic() < deadline, {j: [e.kind for e in v] for j, v in self.by_job.items()}
            m = self.c.poll(1.0)  # blocks until a record comes (or a second passes)
            if m is None or m.error() is not None:
                continue
            key = (m.key() or b"").decode()
            if key in self.jobs:
                self.by_job[key].append(decode(JobEvent, m.value()))

    def drain(self, timeout_s: float = 60.0) -> None:
        """Read up to the end of every partition as it is now."""
        from confluent_kafka import TopicPartition

        md = self.c.list_topics(JOB_EVENTS.name, timeout=10).topics[JOB_EVENTS.name]
        ends = {p: self.c.get_watermark_offsets(TopicPartition(JOB_EVENTS.name, p), timeout=10)[1]
                for p in md.partitions}

        def at_end(by) -> bool:
            pos = self.c.position([TopicPartition(JOB_EVENTS.name, p) for p in ends])
            return all(tp.offset >= ends[tp.partition] or ends[tp.partition] == 0 for tp in pos)

        self.until(at_end, timeout_s)

    def kinds(self, job: str) -> list[str]:
        return [e.kind for e in self.by_job[job]]

    def close(self) -> None:
        self.c.close()


def wait_ended(pid: int) -> None:
    """Block until process *pid* has exited (its pidfd turns readable; gone already is ended too)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 60)[0], f"process {pid} still runs"
    finally:
        os.close(fd)


def gate(data: Path, job: str) -> Path:
    """A fifo in the job's working directory (made before it starts, the job user's): the job waits in
    ``read`` for the exit status the test writes."""
    work = data / "jobs" / job
    work.mkdir(parents=True, mode=0o700)
    os.chmod(data / "jobs", 0o755)
    fifo = work / "gate"
    os.mkfifo(fifo, 0o600)
    nobody = pwd.getpwnam("nobody")
    for p in (work, fifo):
        os.chown(p, nobody.pw_uid, nobody.pw_gid)
    return fifo


@requires_root
@pytest.mark.skipif(not V1, reason="no cgroup v1 cpuset and memory hierarchies")
def test_an_actuator_killed_while_its_jobs_run_finds_them_again(settings, tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o711)
    trusted = tmp_path / "submitters"
    trusted.mkdir(mode=0o755)
    write_public(trusted / "test.pub")
    prefix = f"pwtest-{uuid.uuid4().hex[:8]}"
    env = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_HOST": settings.host,
           "PHASEWISE_DATA_DIR": str(data), "PHASEWISE_ACTUATOR_START_JOBS": "true",
           "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(trusted), "PHASEWISE_CGROUP_ROOT": "/sys/fs/cgroup",
           "PHASEWISE_CGROUP_PREFIX": prefix}
    tag = uuid.uuid4().hex[:6]
    runs, away, killed = f"runs-{tag}", f"away-{tag}", f"killed-{tag}"
    gates = {runs: gate(data, runs), away: gate(data, away)}
    argv = {runs: ("/bin/sh", "-c", "read code < gate; exit $code"),
            away: ("/bin/sh", "-c", "read code < gate; exit $code"), killed: ("/bin/sleep", "600")}
    events = Events(settings, set(argv))
    first = RoleProcess("actuate", ["--backend", "cgroup"], env=env, log_path=tmp_path / "first.log").start()
    second = None
    pids: dict[str, int] = {}
    try:
        p = make_producer(settings, partitioner=PARTITIONER)
        for job, cmd in argv.items():
            d = Decision(id=uuid.uuid4().hex, ts=time.time(), host=settings.host, container=job, action="place",
                         policy="test", details={"cpuset": None, "device": [],
                                                 **signed_start(job, cmd, ts=time.time() - 1)})
            p.produce(DECISIONS.name, key=settings.host.encode(), value=encode(d))
        assert p.flush(10) == 0
        events.until(lambda by: all(v and v[0].kind == "started" for v in by.values()))
        pids = {j: v[0].pid for j, v in events.by_job.items()}

        os.kill(first.pid, signal.SIGKILL)  # no clean stop: its watcher dies with it
        first.proc.wait(30)
        gates[away].write_text("0\n")  # blocks until the job reads it
        os.kill(pids[killed], signal.SIGKILL)
        for job in (away, killed):  # ended before the second actuator starts
            wait_ended(pids[job])
        assert events.kinds(away) == ["started"] and events.kinds(killed) == ["started"]

        second = RoleProcess("actuate", ["--backend", "cgroup"], env=env, log_path=tmp_path / "second.log").start()
        events.until(lambda by: len(by[away]) == 2 and len(by[killed]) == 2)
        a, k = events.by_job[away][1], events.by_job[killed][1]
        # the exit status of a job that ended while no actuator ran is known while it is an unreaped zombie
        # of init; once init reaped it, it is unknown and said so
        assert (a.kind, a.exit_code) in (("finished", 0), ("failed", None)), a
        assert (k.kind, k.signal) in (("failed", "SIGKILL"), ("failed", None)), k
        for e in (a, k):
            if e.kind == "failed" and e.signal is None:
                assert e.reason == "ended while the actuator was away (exit status unknown)"
        assert events.kinds(runs) == ["started"]
        # the job still running is watched again: its end comes as it happens
        gates[runs].write_text("3\n")
        events.until(lambda by: len(by[runs]) == 2)
        r = events.by_job[runs][1]
        assert (r.kind, r.pid) == ("failed", pids[runs]) and r.exit_code in (3, None), r
        assert second.stop(timeout_s=15) == 0, second.log_tail()
        log = (tmp_path / "second.log").read_text()
        assert "registry of started jobs: 1 running (watched again), 2 ended while no actuator watched" in log
        # everything the actuators published is on the topic now (both are gone): each state once
        events.drain()
        assert {j: events.kinds(j) for j in argv} == {runs: ["started", "failed"], away: ["started", a.kind],
                                                       killed: ["started", "failed"]}
    finally:
        events.close()
        for role in (first, second):
            if role is not None and role.alive():
                role.stop(timeout_s=10)
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _remove_cgroups(prefix)


def _remove_cgroups(prefix: str) -> None:
    root = Path("/sys/fs/cgroup")
    for ctl in root.iterdir():
        base = ctl / prefix
        if not base.is_dir():
            continue
        for d in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            base.rmdir()
        except OSError:
            pass
