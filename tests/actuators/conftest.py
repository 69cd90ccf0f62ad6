"""Helpers for the actuator tests."""

from __future__ import annotations

import threading

import pytest

from phasewise.kit.records import Actuation, DeadLetter, JobEvent, decode
from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, JOB_EVENTS


class Recorder:
    """Collects what an Actuator produces, for tests of ``handle`` without a broker.

    Thread-safe: the actuator publishes a job's end from its backend's watcher thread;
    :meth:`wait_job_event` blocks until such a record arrives.
    """

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []
        self.headers: list = []  # each record's headers, in the order of ``sent``
        self._cond = threading.Condition()

    def produce(self, topic, value=None, key=None, **kw):
        with self._cond:
            self.sent.append((topic, key, value))
            self.headers.append(kw.get("headers"))
            self._cond.notify_all()

    def job_events(self, job: str | None = None) -> list[JobEvent]:
        with self._cond:
            evs = [decode(JobEvent, v) for t, _, v in self.sent if t == JOB_EVENTS.name]
        return [e for e in evs if job is None or e.job == job]

    def wait_job_event(self, job: str, kind: str, timeout: float = 60.0, count: int = 1) -> JobEvent:
        """The *count*-th *kind* event of *job*, waiting for it (at most *timeout* s: then the test fails)."""
        def found():
            seen = [e for e in self.job_events(job) if e.kind == kind]
            return seen[count - 1] if len(seen) >= count else None

        with self._cond:
            if not self._cond.wait_for(lambda: found() is not None, timeout):
                raise AssertionError(f"no {kind} event of job {job} within {timeout:g} s; got "
                                     f"{[(e.job, e.kind) for e in self.job_events()]}")
        return found()

    def wait_for(self, found, timeout: float = 60.0) -> None:
        """Until *found()* is true (at most *timeout* s: then the test fails)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(found()), timeout):
                raise AssertionError(f"not within {timeout:g} s; got {[(e.job, e.kind) for e in self.job_events()]}")

    def poll(self, timeout=0):
        return 0

    def actuations(self) -> list[Actuation]:
        return [decode(Actuation, v) for t, _, v in self.sent if t == ACTUATIONS.name]

    def dead_letters(self) -> list[DeadLetter]:
        return [decode(DeadLetter, v) for t, _, v in self.sent if t == DEAD_LETTERS.name]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def remove_started_jobs(backend, layout) -> None:
    """After a test that started real jobs through *backend*: kill them, remove their cgroups, the
    prefix's cpuset slices and the prefix itself (what a failed run would otherwise leave behind)."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()
    for p in list(backend.processes.values()):
        p.kill()
        p.wait()
    for c in layout.containers():
        layout.remove(c)
    cs = layout.controller_root("cpuset") / layout.prefix
    for d in sorted(cs.glob("*"), reverse=True):
        if d.is_dir():
            d.rmdir()
    if cs.exists():
        cs.rmdir()
    for c in layout.controllers():
        try:
            layout.base(c).rmdir()
        except OSError:
            pass


def own(actuator, *containers: str, job: str | None = None) -> None:
    """Enter *containers* in *actuator*'s registry as job containers it started (for *job*, else each its own
    name's): for tests of what an actuator does to its own jobs' containers, where the test made them."""
    for c in containers:
        actuator.ledger.record_start(c, job=job or c, decision=f"test-start-{c}", backend=actuator.backend.name,
                                     pid=None)


def job_settings(data_dir, **kw):
    """Settings of an actuator that starts jobs (``actuator_start_jobs`` on) as the default job user, under
    *data_dir*."""
    from phasewise.kit.settings import Settings

    return Settings().replace(**{"host": "h1", "data_dir": str(data_dir), "actuator_start_jobs": True, **kw})


def job_backend(layout, settings, **kw):
    """The cgroup backend an actuator of *settings* starts jobs with."""
    from phasewise.actuators.backends import CgroupBackend, job_runtime

    return CgroupBackend(layout, jobs=job_runtime(settings), **kw)


_PYTHON: list[str | None] = []


def job_python() -> str:
    """A Python interpreter the job user (``nobody``) may run (the test venv's may sit in root's home);
    the test is skipped where there is none."""
    import pwd
    import subprocess
    import sys

    if not _PYTHON:
        found = None
        nobody = pwd.getpwnam("nobody")
        for cand in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
            try:
                ok = subprocess.run([cand, "-c", "pass"], user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                                    cwd="/", env={}, capture_output=True, timeout=30).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            if ok:
                found = cand
                break
        _PYTHON.append(found)
    if _PYTHON[0] is None:
        pytest.skip("no Python interpreter the job user nobody may run")
    return _PYTHON[0]
