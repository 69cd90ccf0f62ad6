"""The job states the actuator publishes (issue #23; docs/jobs.md, "Actuator").

Real processes in real cgroup v1 hierarchies, as root: a job that exits 0 is
``finished``, one that exits 3 or is killed by a signal or by the OOM killer in
its memory limit is ``failed`` with how, one a terminate decision ends is
``terminated``; a place decision the actuator refuses (no command, an unknown
command, start disabled, an untrusted submitter) is ``rejected`` with the
reason; freeze and thaw are states too. After a restart the actuator watches
its running jobs again (not as their parent), reports those that ended while
it was away, and publishes each state once. Every wait is on an event.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import AWAY, NOT_STARTING, Actuator
from phasewise.actuators.backends.job_watch import ExitStatus, ExitWatcher, proc_identity, signal_name
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.records import Decision, JobEvent, JobRequests, decode, encode
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import DECISIONS, JOB_EVENTS
from tests.actuators.conftest import Recorder, job_backend, job_python, job_settings, remove_started_jobs
from tests.conftest import requires_root
from tests.job_keys import STRANGER, TRUSTED
from tests.job_keys import start as signed_start

V1 = (Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists() and Path("/sys/fs/cgroup/freezer").is_dir()
      and Path("/sys/fs/cgroup/memory/memory.oom_control").exists())
KEY = b"k" * 40


def real_v1(test):
    return requires_root(pytest.mark.skipif(not V1, reason="no cgroup v1 cpuset, freezer and memory hierarchies")(test))


def place(job: str, argv, *, key=None, resume: bool = False, **kw) -> bytes:
    start = signed_start(job, tuple(argv), ts=time.time() - 1, **({"key": key} if key is not None else {}), **kw)
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="h1", container=job, action="place",
                           policy="test", details={"cpuset": None, "device": [], **start,
                                                   **({"resume": True} if resume else {})}))


def decision(job: str, action: str, **details) -> bytes:
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="h1", container=job, action=action,
                           policy="test", reason=f"test {action}", details=details))


def make(settings, backend, ledger: Ledger, rec: Recorder | None = None) -> tuple[Actuator, Recorder]:
    rec = rec or Recorder()
    return Actuator(settings, backend, ledger, rec, metrics=ActuatorMetrics(CollectorRegistry()), host_cores=2.0,
                    keyring=Keyring(KEY), submitters=TRUSTED), rec


def handle(act: Actuator, raw: bytes):
    """*raw* as the actuator's consumer hands it over, signed with the cluster key."""
    return act.handle(raw, b"h1", 0, 0, headers=Keyring(KEY).headers(DECISIONS.name, b"h1", raw))


def states(act: Actuator, kind: str) -> float:
    return act.metrics.registry.get_sample_value("phasewise_actuator_job_states_total", {"kind": kind})


def removed(act: Actuator, outcome: str) -> float:
    return act.metrics.registry.get_sample_value("phasewise_actuator_job_cgroups_removed_total", {"outcome": outcome})


@pytest.fixture
def layout():
    lay = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    yield lay
    for c in lay.containers():
        try:
            (lay.path(c, "freezer") / "freezer.state").write_text("THAWED")
        except OSError:
            pass


@pytest.fixture
def env(tmp_path, layout):
    s = job_settings(tmp_path)
    backends = []

    def new():
        b = job_backend(layout, s)
        backends.append(b)
        return b

    yield s, new
    for b in backends:
        remove_started_jobs(b, layout)


# --------------------------------------------------------------------------- pure parts


def test_signal_names_and_exit_statuses():
    assert signal_name(9) == "SIGKILL" and signal_name(signal.SIGRTMIN + 3) == "SIGRTMIN+3"
    assert ExitStatus.of_wait_status(3 << 8, "zombie") == ExitStatus(3, None, "zombie")
    assert ExitStatus.of_wait_status(9, "pidfd") == ExitStatus(None, 9, "pidfd")
    assert ExitStatus.of_returncode(-15, "waited").returncode == -15 and not ExitStatus().known
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV):
        assert decode(JobEvent, encode(JobEvent(job="j", ts=1.0, kind="failed", signal=signal_name(sig))))


def test_the_watcher_reports_each_child_once_with_its_status_and_reaps_it():
    got, done = [], __import__("threading").Event()

    def on_exit(key, pid, status, data, ended):
        got.append((key, pid, status, data))
        if len(got) == 3:
            done.set()

    w = ExitWatcher(on_exit)
    try:
        procs = {"ok": subprocess.Popen(["/bin/sh", "-c", "exit 0"]),
                 "three": subprocess.Popen(["/bin/sh", "-c", "exit 3"]),
                 "killed": subprocess.Popen(["/bin/sh", "-c", "kill -KILL $$"])}
        for k, p in procs.items():
            w.watch_child(k, p, data=k.upper())
        assert done.wait(60), got
        by = {k: (pid, st, data) for k, pid, st, data in got}
        assert by["ok"][1] == ExitStatus(0, None, "waited") and by["three"][1].exit_code == 3
        assert by["killed"][1] == ExitStatus(None, signal.SIGKILL, "waited") and by["killed"][2] == "KILLED"
        assert {k: by[k][0] for k in by} == {k: p.pid for k, p in procs.items()}
        # reaped through their Popen: no zombie left, and Popen agrees on the status
        assert [procs[k].returncode for k in ("ok", "three", "killed")] == [0, 3, -signal.SIGKILL]
        assert all(proc_identity(p.pid) is None for p in procs.values())
        assert len(w) == 0
    finally:
        w.close()


# --------------------------------------------------------------------------- how a started job ends


@real_v1
def test_exit_0_is_finished_3_is_failed_a_signal_and_the_oom_killer_are_failed_with_how(env):
    s, new = env
    backend = new()
    act, rec = make(s, backend, Ledger(":memory:"))
    py = job_python()
    jobs = {
        "ok": ["/bin/sh", "-c", "exit 0"],
        "three": ["/bin/sh", "-c", "exit 3"],
        "killed": ["/bin/sh", "-c", "kill -KILL $$"],
    }
    for job, argv in jobs.items():
        a = handle(act, place(job, argv))
        assert a.status == "applied", a.message
    # 64 MiB limit, 512 MiB written: the kernel's OOM killer ends it (no swap to escape to)
    a = handle(act, place("hog", [py, "-c", "x = b'x' * (512 << 20)"], requests=JobRequests(mem_bytes=64 * 2**20)))
    assert a.status == "applied" and "memory 67108864 bytes" in a.message, a.message

    ok = rec.wait_job_event("ok", "finished")
    assert (ok.exit_code, ok.signal, ok.oom, ok.reason, ok.host, ok.container) == (0, None, False, None, "h1", "ok")
    assert ok.run_s is not None and ok.run_s >= 0
    three = rec.wait_job_event("three", "failed")
    assert (three.exit_code, three.signal, three.oom, three.reason) == (3, None, False, "exited with status 3")
    killed = rec.wait_job_event("killed", "failed")
    assert (killed.exit_code, killed.signal, killed.oom, killed.reason) == (None, "SIGKILL", False,
                                                                             "killed by SIGKILL")
    hog = rec.wait_job_event("hog", "failed")
    assert hog.oom is True and hog.signal == "SIGKILL", hog
    assert hog.reason == ("OOM-killed: the kernel's OOM killer killed 1 process in its memory limit; "
                          "killed by SIGKILL")
    # each state once, signed with the cluster key, started before it ended
    with act.lock:
        for job in (*jobs, "hog"):
            kinds = [e.kind for e in rec.job_events(job)]
            assert kinds[0] == "started" and len(kinds) == 2, (job, kinds)
            row = act.ledger.started_job(job)
            assert row.ended is not None and row.published is not None and row.proc_start is not None
    for i, (t, k, v) in enumerate(rec.sent):
        if t == JOB_EVENTS.name:
            assert Keyring(KEY).verify(t, k, v, rec.headers[i], now=time.time()) is None
    assert (states(act, "started"), states(act, "finished"), states(act, "failed")) == (4, 1, 3)
    assert backend.processes == {} and backend.watching() == []
    # a finished or failed job is over: its cgroups went with its end (the cpuset slice too)
    with act.lock:
        assert backend.layout.containers() == []
        assert [d.name for d in (backend.layout.controller_root("cpuset") / backend.layout.prefix).iterdir()
                if d.is_dir()] == []
        assert removed(act, "removed") == 4 and removed(act, "left") == 0


@real_v1
def test_a_job_that_leaves_a_process_behind_keeps_its_cgroups_and_the_setting_keeps_every_one(env):
    s, new = env
    backend = new()
    act, rec = make(s, backend, Ledger(":memory:"))
    # its shell exits 0 and leaves a sleeper in the cgroup: finished, and the container stays, saying why
    assert handle(act, place("daemon", ["/bin/sh", "-c", "sleep 600 & exit 0"])).status == "applied"
    assert rec.wait_job_event("daemon", "finished").exit_code == 0
    with act.lock:
        assert backend.exists("daemon") and backend._pids("daemon")
        assert (removed(act, "removed"), removed(act, "left")) == (0, 1)
    assert handle(act, decision("daemon", "terminate", grace_s=0)).status == "applied"
    # actuator_remove_ended_jobs off: a finished job's cgroups stay
    keep, rec_keep = make(s.replace(actuator_remove_ended_jobs=False), backend, Ledger(":memory:"))
    assert handle(keep, place("kept", ["/bin/true"])).status == "applied"
    rec_keep.wait_job_event("kept", "finished")
    with keep.lock:
        assert backend.exists("kept") and removed(keep, "removed") == 0


@real_v1
def test_a_started_event_says_where_and_a_terminate_decision_ends_it_as_terminated(env):
    s, new = env
    backend = new()
    act, rec = make(s, backend, Ledger(":memory:"))
    cpu = sorted(os.sched_getaffinity(0))[-1]
    raw = encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="h1", container="sleeper", action="place",
                          policy="test", details={"cpuset": str(cpu), "device": [0],
                                                  **signed_start("sleeper", ("/bin/sleep", "600"))}))
    assert handle(act, raw).status == "applied"
    st = rec.wait_job_event("sleeper", "started")
    assert (st.cgroup, st.cpuset, st.devices) == (f"{backend.layout.prefix}/sleeper", str(cpu), ("0",))
    # freeze and thaw are states of the job
    assert handle(act, decision("sleeper", "freeze")).status == "applied"
    assert handle(act, decision("sleeper", "thaw")).status == "applied"
    assert [(e.kind, e.reason) for e in rec.job_events("sleeper")[1:]] == [("frozen", "test freeze"),
                                                                          ("thawed", "test thaw")]
    a = handle(act, decision("sleeper", "terminate", grace_s=0))
    assert a.status == "applied", a.message
    end = rec.wait_job_event("sleeper", "terminated")
    assert end.signal == "SIGKILL" and end.reason.startswith("terminated by decision ") and not end.oom
    assert "killed by SIGKILL" in end.reason
    assert [e.kind for e in rec.job_events("sleeper")] == ["started", "frozen", "thawed", "terminated"]
    assert states(act, "terminated") == 1 and states(act, "failed") == 0
    with act.lock:  # ended for good (a target's hard stop, an operator's terminate): its cgroups go
        assert not backend.exists("sleeper") and removed(act, "removed") == 1
    # a checkpoint stop (the priority agent's preemption): its agent resumes the job in its container, which stays
    # (its first run sleeps; resumed, it sees its own file in its working directory and exits 0)
    argv = ["/bin/sh", "-c", "test -e resumed && exit 0; touch resumed; exec sleep 600"]
    assert handle(act, place("stopped", argv)).status == "applied"
    rec.wait_job_event("stopped", "started")
    first_run = Path(s.data_dir) / "jobs" / "stopped" / "resumed"
    deadline = time.monotonic() + 60
    while not first_run.exists():  # its first run got as far as its file
        assert time.monotonic() < deadline, "the job's first run wrote no file within 60 s"
        time.sleep(0.05)
    assert handle(act, decision("stopped", "terminate", grace_s=0, mode="checkpoint")).status == "applied"
    assert rec.wait_job_event("stopped", "terminated").signal == "SIGKILL"
    with act.lock:
        assert backend.exists("stopped") and removed(act, "removed") == 1
    resumed = place("stopped", argv, resume=True)
    assert handle(act, resumed).status == "applied"
    rec.wait_job_event("stopped", "finished")
    with act.lock:  # its run after the resume ended: they go now
        assert not backend.exists("stopped") and removed(act, "removed") == 2


@real_v1
def test_a_refused_place_decision_is_rejected_with_its_reason(env, tmp_path):
    s, new = env
    backend = new()
    act, rec = make(s, backend, Ledger(":memory:"))
    # a command that does not exist: nothing starts, and the job is rejected saying so
    a = handle(act, place("ghost", ["/no/such/command", "--flag"]))
    assert a.status == "failed", a.message
    ev = rec.wait_job_event("ghost", "rejected")
    assert ev.reason == a.message and "/no/such/command" in ev.reason and "No such file" in ev.reason
    # an untrusted submitter, no command at all
    a = handle(act, place("stranger", ["/bin/true"], key=STRANGER))
    assert a.status == "rejected" and rec.wait_job_event("stranger", "rejected").reason == a.message
    no_cmd = encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="h1", container="nocmd", action="place",
                             policy="test", details={"cpuset": None, "device": []}))
    a = handle(act, no_cmd)
    assert a.status == "rejected" and rec.wait_job_event("nocmd", "rejected").reason == a.message
    # an actuator that does not start jobs
    off, rec_off = make(s.replace(actuator_start_jobs=False), backend, Ledger(":memory:"))
    assert handle(off, place("off", ["/bin/true"])).status == "rejected"
    assert rec_off.wait_job_event("off", "rejected").reason == NOT_STARTING
    # a redelivered decision is a duplicate: no second state
    assert handle(act, no_cmd).status == "duplicate"
    assert [e.kind for e in rec.job_events("nocmd")] == ["rejected"]
    assert states(act, "rejected") == 3 and states(act, "started") == 0
    assert backend.processes == {} and list(backend.layout.containers()) == []


# --------------------------------------------------------------------------- restart


def _gate(data_dir: Path, job: str) -> tuple[list[str], Path]:
    """A job that exits with the status written into the fifo ``gate`` of its working directory (made
    here, the job user's, before it starts): it blocks in ``read``, no sleep loop on either side."""
    jobs = data_dir / "jobs"
    jobs.mkdir(mode=0o755, exist_ok=True)
    work = jobs / job
    work.mkdir(mode=0o700)
    fifo = work / "gate"
    os.mkfifo(fifo, 0o600)
    nobody = pwd.getpwnam("nobody")
    for p in (work, fifo):
        os.chown(p, nobody.pw_uid, nobody.pw_gid)
    return ["/bin/sh", "-c", "read code < gate; exit $code"], fifo


@real_v1
def test_a_restarted_actuator_watches_its_running_jobs_again_and_reports_the_ones_that_ended(env, tmp_path):
    s, new = env
    ledger_file = tmp_path / "ledger.sqlite"
    first = new()
    act, rec = make(s, first, Ledger(ledger_file))
    argv_a, gate_a = _gate(tmp_path, "ja")  # ends with status 0 while the actuator is away, reaped by someone
    argv_b, gate_b = _gate(tmp_path, "jb")  # runs on: watched again, then exits 3
    argv_c, gate_c = _gate(tmp_path, "jc")  # ends while away, still a zombie: its exit status is recorded
    for job, argv in (("ja", argv_a), ("jb", argv_b), ("jc", argv_c), ("jd", ["/bin/sleep", "600"])):
        assert handle(act, place(job, argv)).status == "applied"
    procs = dict(first.processes)

    # the actuator goes away (its watcher stops; a crash would do the same): nobody watches the jobs
    first.close()
    act.ledger.close()
    gate_a.write_text("0\n")
    procs["ja"].wait(30)  # reaped by its parent (init, for an orphan): no exit status left to read
    gate_c.write_text("4\n")
    os.waitid(os.P_PID, procs["jc"].pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    os.kill(procs["jd"].pid, signal.SIGKILL)
    procs["jd"].wait(30)

    second = new()
    act2, rec2 = make(s, second, Ledger(ledger_file))
    assert act2.recover() == {"watched": 1, "ended": 3, "republished": 0}
    a = rec2.wait_job_event("ja", "failed")
    assert (a.reason, a.exit_code, a.signal, a.oom) == (AWAY, None, None, False)
    c = rec2.wait_job_event("jc", "failed")
    assert (c.exit_code, c.reason) == (4, "exited with status 4")  # the zombie said more
    d = rec2.wait_job_event("jd", "failed")
    assert d.reason == AWAY
    assert second.watching() == ["jb"]
    assert rec2.job_events("jb") == []
    with act2.lock:  # the ended ones' cgroups went with their ends, the running one's stays
        assert second.layout.containers() == ["jb"]
    # the job still running is watched again, not as its child: its end is seen when it comes
    gate_b.write_text("3\n")
    b = rec2.wait_job_event("jb", "failed")
    assert (b.exit_code, b.reason) == (3, "exited with status 3") and b.pid == procs["jb"].pid
    assert b.run_s is not None and b.run_s > 0
    with act2.lock:
        assert second.layout.containers() == [] and removed(act2, "removed") == 4
    m = act2.metrics.registry.get_sample_value
    assert (m("phasewise_actuator_jobs_recovered_total", {"outcome": "watched"}),
            m("phasewise_actuator_jobs_recovered_total", {"outcome": "ended"})) == (1, 3)

    # once more: every state was published, none again
    second.close()
    act2.ledger.close()
    act3, rec3 = make(s, new(), Ledger(ledger_file))
    assert act3.recover() == {"watched": 0, "ended": 0, "republished": 0}
    assert rec3.sent == []
    # an end decided but not published before a stop is published at the next start, once
    act3.ledger._db.execute("UPDATE jobs SET published = NULL WHERE container = 'jb'")
    assert act3.recover() == {"watched": 0, "ended": 0, "republished": 1}
    assert [(e.job, e.kind, e.exit_code) for e in rec3.job_events()] == [("jb", "failed", 3)]
    assert act3.recover()["republished"] == 0
    procs["jc"].wait(30)


@real_v1
def test_a_reused_pid_is_not_taken_for_the_job(env, tmp_path):
    s, new = env
    backend = new()
    act, rec = make(s, backend, Ledger(tmp_path / "ledger.sqlite"))
    other = subprocess.Popen(["/bin/sleep", "600"])  # alive, but not the job's process, nor in its cgroup
    try:
        backend.layout.create("reused")
        start = proc_identity(other.pid)[1]
        act.ledger.record_start("reused", job="reused", decision="d0", backend=backend.name, pid=other.pid,
                                proc_start=start + 1, oom_base=0, now=time.time() - 5)
        act.ledger.record_start("moved", job="moved", decision="d1", backend=backend.name, pid=other.pid,
                                proc_start=start, oom_base=0, now=time.time() - 5)
        assert act.recover() == {"watched": 0, "ended": 2, "republished": 0}
        for job in ("reused", "moved"):
            assert rec.wait_job_event(job, "failed").reason == AWAY
        assert other.poll() is None and backend.watching() == []  # never touched
    finally:
        other.kill()
        other.wait()
