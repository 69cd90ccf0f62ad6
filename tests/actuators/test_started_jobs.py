"""What a started job can do, and which containers an actuator touches (issue #21; docs/security.md).

On real cgroups (v1) and real processes, as root: a place decision starts
nothing while ``actuator_start_jobs`` is off; a started job runs as
``nobody`` with no supplementary group, ``no_new_privs``, no core dumps and an
environment built from scratch; links planted where the actuator writes its
log or makes the job's working directory are refused, never followed; and
``freeze``, ``thaw``, ``terminate``, ``weight`` and resume act only on the
containers the actuator started for the decision's job (or whose workload
says they are that job's).
"""

from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import NOT_STARTING, Actuator
from phasewise.actuators.backends import JOB_PATH, CgroupBackend, DryRunBackend, JobSetupError, job_runtime
from phasewise.actuators.backends.started_jobs import child_setup
from phasewise.actuators.commands import StartJob
from phasewise.actuators.consumer import make_backend
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.cgroups.workloads import Workloads
from phasewise.kit.records import Decision, JobEvent, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import DECISIONS, JOB_EVENTS
from phasewise.models.safety.workload import parse_policy_file
from tests.actuators.conftest import Recorder, job_backend, job_settings, remove_started_jobs
from tests.conftest import requires_root
from tests.job_keys import TRUSTED, write_public
from tests.job_keys import start as signed_start

V1 = Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists() and Path("/sys/fs/cgroup/freezer").is_dir()


def real_v1(test):
    """Runs on the host's real cgroup v1 hierarchies, as root."""
    return requires_root(pytest.mark.skipif(not V1, reason="no cgroup v1 cpuset and freezer hierarchies")(test))


NOBODY = pwd.getpwnam("nobody")
KEY = b"c" * 40


def place(container: str, argv: list[str], *, host: str = "h1", **details) -> bytes:
    """A place decision starting *argv* as job *container*, signed by the trusted test submitter."""
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host=host, container=container, action="place",
                           policy="test", details={"cpuset": None, "device": [],
                                                   **signed_start(container, tuple(argv), ts=time.time() - 1),
                                                   **details}))


def decision(container: str, action: str, *, host: str = "h1", **details) -> bytes:
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host=host, container=container, action=action,
                           policy="test", details=details))


def actuator(settings: Settings, backend, ledger: Ledger | None = None, **kw) -> tuple[Actuator, Recorder]:
    rec = Recorder()
    kw.setdefault("submitters", TRUSTED)
    return Actuator(settings, backend, ledger or Ledger(":memory:"), rec,
                    metrics=ActuatorMetrics(CollectorRegistry()), host_cores=2.0, **kw), rec


def refused(act: Actuator, reason: str) -> float:
    return act.metrics.registry.get_sample_value("phasewise_actuator_refused_total", {"reason": reason})


def proc_status(pid: int) -> dict[str, str]:
    return dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if kv)


@pytest.fixture
def layout():
    lay = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    yield lay
    for c in lay.containers():  # a frozen process dies only once thawed
        try:
            (lay.path(c, "freezer") / "freezer.state").write_text("THAWED")
        except OSError:
            pass


# --------------------------------------------------------------------------- off unless configured


def test_start_jobs_off_rejects_a_place_decision_and_starts_nothing(tmp_path):
    backend = DryRunBackend()
    act, _ = actuator(Settings().replace(host="h1", data_dir=str(tmp_path)), backend)
    a = act.handle(place("job-a", ["/bin/touch", str(tmp_path / "x")]), b"h1", 0, 0)
    assert a.status == "rejected" and a.message == NOT_STARTING
    assert backend.commands == [] and refused(act, "jobs_off") == 1
    # a backend without a job runtime starts nothing even when asked directly
    out = CgroupBackend(CgroupLayout(tmp_path, prefix="pw", version=2)).apply(StartJob("job-a", "0", ("/bin/true",)))
    assert out.status == "failed" and "starts no jobs (actuator_start_jobs is off)" in out.message
    assert not (tmp_path / "x").exists() and not (tmp_path / "pw").exists()


def test_the_job_user_is_never_root_by_default_and_a_non_root_actuator_starts_only_as_itself(tmp_path):
    s = job_settings(tmp_path)
    rt = job_runtime(s)
    assert (rt.user, rt.uid, rt.gid) == ("nobody", NOBODY.pw_uid, NOBODY.pw_gid)
    refusals = [
        (s.replace(job_user="root"), "job_user: root is root (uid 0); jobs never run as root unless job_allow_root"),
        (s.replace(job_user="0"), "job_user: root is root (uid 0)"),
        (s.replace(job_group="root"), "job_group: root is root's group (gid 0)"),
        (s.replace(job_user="no-such-user-pw"), "job_user: no user 'no-such-user-pw' on this host"),
        (s.replace(job_group="no-such-group-pw"), "job_group: no group 'no-such-group-pw' on this host"),
    ]
    for settings, why in refusals:
        with pytest.raises(JobSetupError) as e:
            job_runtime(settings, euid=0, egid=0)
        assert str(e.value).startswith(why), str(e.value)
    assert job_runtime(s.replace(job_user="root", job_allow_root=True), euid=0, egid=0).uid == 0
    # an actuator that is not root cannot switch users: only its own
    with pytest.raises(JobSetupError, match="job_user: this actuator runs as uid 1234, not root"):
        job_runtime(s, euid=1234, egid=1234)
    assert job_runtime(s, euid=NOBODY.pw_uid, egid=NOBODY.pw_gid).uid == NOBODY.pw_uid
    with pytest.raises(JobSetupError, match="job_group: this actuator runs as gid 1234"):
        job_runtime(s, euid=NOBODY.pw_uid, egid=1234)
    assert job_runtime(s, switches=False, euid=1234, egid=1234).uid == NOBODY.pw_uid  # a dry run only describes


def test_the_actuator_refuses_to_start_with_a_root_job_user(tmp_path):
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    trusted = tmp_path / "submitters"
    trusted.mkdir(mode=0o755)
    write_public(trusted / "test.pub")
    env.update(PHASEWISE_ACTUATOR_START_JOBS="true", PHASEWISE_JOB_USER="root", PHASEWISE_DATA_DIR=str(tmp_path),
               PHASEWISE_BOOTSTRAP="127.0.0.1:9", PHASEWISE_JOB_TRUSTED_SUBMITTERS=str(trusted))
    r = subprocess.run([sys.executable, "-m", "phasewise.cli", "actuate", "--backend", "dry-run"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "phasewise actuate: error: job_user: root is root (uid 0); jobs never run as root unless job_allow_root=true"]


def test_a_jobs_environment_is_built_from_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("PHASEWISE_SIGNING_KEY_FILE", "/etc/phasewise/cluster.key")
    rt = job_runtime(job_settings(tmp_path, job_env="PATH=/opt/venv/bin:/usr/bin;OMP_NUM_THREADS=2"))
    env = rt.environment(StartJob("ctr", "0", ("/bin/true",), None, job="job-7"))
    assert env == {"PATH": "/opt/venv/bin:/usr/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "2",
                   "HOME": f"{tmp_path}/jobs/ctr", "TMPDIR": f"{tmp_path}/jobs/ctr/tmp", "PHASEWISE_JOB": "job-7",
                   "CUDA_VISIBLE_DEVICES": "1"}  # no GPUs decided: the actuator's own restriction holds
    assert rt.environment(StartJob("ctr", "0", ("/bin/true",), ()))["CUDA_VISIBLE_DEVICES"] == ""
    assert rt.environment(StartJob("ctr", "0", ("/bin/true",), (0, 2)))["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert rt.environment(StartJob("ctr", "0", ("/bin/true",)))["PHASEWISE_JOB"] == "ctr"


def test_the_dry_run_describes_how_it_would_start_the_job(tmp_path):
    s = job_settings(tmp_path, backend="dry-run", cgroup_root=str(tmp_path / "no-cgroups"),
                     job_env="OMP_NUM_THREADS=1")
    assert make_backend(s).jobs == job_runtime(s, switches=False)  # the actuator's dry run describes the jobs
    backend = DryRunBackend(exists=lambda c: False, jobs=job_runtime(s, switches=False))
    act, rec = actuator(s, backend)
    a = act.handle(place("job-d", ["/bin/true"], job="job-d"), b"h1", 0, 0)
    assert a.status == "applied", a.message
    assert f"as nobody:{backend.jobs.group} (uid {NOBODY.pw_uid}, gid {NOBODY.pw_gid})" in a.message
    assert "no supplementary groups, no_new_privs, no core dumps" in a.message
    assert f"working directory {tmp_path}/jobs/job-d, log {tmp_path}/job-logs/job-d.log" in a.message
    assert ("environment CUDA_VISIBLE_DEVICES, HOME, LANG, OMP_NUM_THREADS, PATH, PHASEWISE_JOB, TMPDIR "
            "(nothing else)") in a.message
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "job-logs").exists()  # nothing made
    assert [t for t, _, _ in rec.sent if t == JOB_EVENTS.name] == []  # no process: no started event


# --------------------------------------------------------------------------- unprivileged and clean


@real_v1
def test_a_started_job_runs_as_nobody_without_privileges_or_the_actuators_environment(tmp_path, layout, monkeypatch):
    monkeypatch.setenv("PHASEWISE_KAFKA_SASL_PASSWORD", "hunter2")
    monkeypatch.setenv("PW_TEST_FAKE_SECRET", "s3cret-value")
    s = job_settings(tmp_path, job_env="OMP_NUM_THREADS=1")
    backend = job_backend(layout, s)
    act, rec = actuator(s, backend, Ledger(tmp_path / "ledger.sqlite"), keyring=Keyring(KEY))
    groups = os.getgroups()
    os.setgroups([*groups, 4242])  # the actuator has a supplementary group: the job must not keep it
    try:
        raw = place("sleeper", ["/bin/sleep", "60"])
        a = act.handle(raw, b"h1", 0, 0, headers=Keyring(KEY).headers(DECISIONS.name, b"h1", raw))
        assert a.status == "applied" and "as nobody:" in a.message, a.message
        pid = backend.processes["sleeper"].pid
        st = proc_status(pid)
        assert st["Uid"].split() == [str(NOBODY.pw_uid)] * 4 and st["Gid"].split() == [str(NOBODY.pw_gid)] * 4
        assert st["Groups"].strip() == "" and st["NoNewPrivs"].strip() == "1"
        assert st["CapEff"].strip() == "0" * 16 and st["CapPrm"].strip() == "0" * 16
        core = next(ln for ln in Path(f"/proc/{pid}/limits").read_text().splitlines() if ln.startswith("Max core"))
        assert core.split()[4:6] == ["0", "0"], core  # soft and hard: the job cannot raise it
        env = proc_environ(pid)
        work = tmp_path / "jobs" / "sleeper"
        assert env == {"PATH": JOB_PATH, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "HOME": str(work),
                       "TMPDIR": f"{work}/tmp", "PHASEWISE_JOB": "sleeper", "CUDA_VISIBLE_DEVICES": ""}
        assert "s3cret-value" not in Path(f"/proc/{pid}/environ").read_text()
        assert "hunter2" not in Path(f"/proc/{pid}/environ").read_text()
        assert [k for k in env if k.startswith("PHASEWISE_")] == ["PHASEWISE_JOB"]
        # its own working directory, the root-owned log directory, its cgroups
        assert os.readlink(f"/proc/{pid}/cwd") == str(work)
        w = os.stat(work)
        assert (w.st_uid, w.st_gid, stat.S_IMODE(w.st_mode)) == (NOBODY.pw_uid, NOBODY.pw_gid, 0o700)
        logs = os.stat(tmp_path / "job-logs")
        assert (logs.st_uid, stat.S_IMODE(logs.st_mode)) == (0, 0o750)
        assert os.stat(tmp_path / "job-logs" / "sleeper.log").st_uid == 0
        cg = dict(ln.split(":", 2)[1:] for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
        assert cg["cpuset"] == cg["freezer"] == cg["memory"] == f"/{layout.prefix}/sleeper"
        # entered in the registry, and announced: a started event, signed with the cluster key
        row = act.ledger.started_job("sleeper")
        assert (row.job, row.pid, row.backend, row.ended) == ("sleeper", pid, "cgroup-v1", None)
        events = [(i, k, v) for i, (t, k, v) in enumerate(rec.sent) if t == JOB_EVENTS.name]
        assert len(events) == 1
        i, key, value = events[0]
        ev = decode(JobEvent, value)
        assert (ev.kind, ev.job, ev.host, ev.container, ev.pid) == ("started", "sleeper", "h1", "sleeper", pid)
        assert key == b"sleeper"
        assert Keyring(KEY).verify(JOB_EVENTS.name, key, value, rec.headers[i], now=time.time()) is None
        assert Keyring(b"z" * 40).verify(JOB_EVENTS.name, key, value, rec.headers[i], now=time.time()) is not None
        # its own container: the actuator stops it, and records the end and how it ended
        raw = decision("sleeper", "terminate", grace_s=5.0)
        t = act.handle(raw, b"h1", 0, 1, headers=Keyring(KEY).headers(DECISIONS.name, b"h1", raw))
        assert t.status == "applied", t.message
        end = rec.wait_job_event("sleeper", "terminated")
        assert (end.signal, end.exit_code, end.pid, end.oom) == ("SIGTERM", None, pid, False)
        with act.lock:  # its report done
            row = act.ledger.started_job("sleeper")
        assert row.ended is not None and row.exit_status == -signal.SIGTERM and row.published is not None
    finally:
        os.setgroups(groups)
        remove_started_jobs(backend, layout)


@real_v1
def test_the_jobs_limits_are_in_its_cgroup_before_it_runs_and_its_exit_is_recorded(tmp_path, layout):
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    act, rec = actuator(s, backend, Ledger(tmp_path / "ledger.sqlite"))
    # the job reads its own limits as its first instruction
    script = ("cg=$(grep :memory: /proc/self/cgroup | cut -d: -f3); "
              "cat /sys/fs/cgroup/memory$cg/memory.limit_in_bytes /sys/fs/cgroup/cpu$cg/cpu.cfs_quota_us > limits")
    try:
        with act.lock:  # entered in the registry before its end is reported (as handle() does)
            out = backend.apply(StartJob("limited", "", ("/bin/sh", "-c", script), cpu_cores=0.5,
                                         mem_bytes=256 * 2**20))
            assert out.status == "applied" and "limits cpu 0.5 cores, memory 268435456 bytes" in out.message, \
                out.message
            act.ledger.record_start("limited", job="limited", decision="d", backend=backend.name, pid=out.pid)
        end = rec.wait_job_event("limited", "finished")
        assert (end.exit_code, end.signal, end.oom) == (0, None, False)
        assert (tmp_path / "jobs" / "limited" / "limits").read_text().split() == [str(256 * 2**20), "50000"]
        with act.lock:
            row = act.ledger.started_job("limited")
        assert row.ended is not None and row.exit_status == 0
    finally:
        remove_started_jobs(backend, layout)


def _untouched(path: Path) -> tuple:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, st.st_mode, st.st_mtime_ns, path.read_text() if path.is_file() else None


@real_v1
def test_links_planted_at_the_log_or_the_working_directory_are_not_followed(tmp_path, layout):
    data = tmp_path / "data"
    s = job_settings(data)
    backend = job_backend(layout, s)
    act, rec6 = actuator(s, backend)
    target = tmp_path / "target"  # what a root write through the link would reach
    target.write_text("untouched\n")
    target_dir = tmp_path / "target-dir"
    target_dir.mkdir(mode=0o755)
    (target_dir / "keep").write_text("keep\n")
    before, before_dir = _untouched(target), _untouched(target_dir)
    try:
        # 1. a link at the job's log
        (data / "job-logs").mkdir(parents=True, mode=0o750)
        (data / "job-logs" / "j1.log").symlink_to(target)
        a = act.handle(place("j1", ["/bin/true"]), b"h1", 0, 0)
        assert a.status == "failed" and "j1.log is a symbolic link: not followed" in a.message, a.message
        assert rec6.wait_job_event("j1", "rejected").reason == a.message  # the job's state says why
        assert not layout.exists("j1") and "j1" not in backend.processes  # no cgroup left behind
        # 2. the log directory itself a link
        (data / "job-logs" / "j1.log").unlink()
        (data / "job-logs").rmdir()
        (data / "job-logs").symlink_to(target_dir)
        a = act.handle(place("j2", ["/bin/true"]), b"h1", 0, 1)
        assert a.status == "failed" and "job log directory" in a.message and "not followed" in a.message, a.message
        (data / "job-logs").unlink()
        # 3. a link at the job's working directory
        (data / "jobs").mkdir(mode=0o755)
        (data / "jobs" / "j3").symlink_to(target_dir)
        a = act.handle(place("j3", ["/bin/true"]), b"h1", 0, 2)
        assert a.status == "failed" and "working directory" in a.message and "not followed" in a.message, a.message
        # 4. a working directory that is not the job user's (a resume must not hand over root's files)
        (data / "jobs" / "j4").mkdir(mode=0o700)
        a = act.handle(place("j4", ["/bin/true"]), b"h1", 0, 3)
        assert a.status == "failed" and "belongs to uid 0, not to the job user nobody" in a.message, a.message
        # 5. a jobs directory someone else owns (a pre-created data directory)
        other = tmp_path / "other-data"
        (other / "jobs").mkdir(parents=True)
        os.chown(other / "jobs", NOBODY.pw_uid, NOBODY.pw_gid)
        b2 = job_backend(layout, job_settings(other))
        out = b2.apply(StartJob("j5", "", ("/bin/true",)))
        assert out.status == "failed" and "belongs to uid 65534" in out.message, out.message
        assert _untouched(target) == before and _untouched(target_dir) == before_dir
        assert sorted(p.name for p in target_dir.iterdir()) == ["keep"]
        assert [c for c in layout.containers()] == [] and backend.processes == {}
        # and where nothing is planted, the same actuator starts the job
        assert act.handle(place("j6", ["/bin/true"]), b"h1", 0, 4).status == "applied"
        assert rec6.wait_job_event("j6", "finished").exit_code == 0
    finally:
        remove_started_jobs(backend, layout)


def test_a_failure_in_the_child_says_which_step_failed():
    r, w = os.pipe()
    work = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        setup = child_setup(["/nonexistent-cgroup/cgroup.procs"], work, NOBODY.pw_uid, NOBODY.pw_gid, False, w)
        with pytest.raises(subprocess.SubprocessError):
            subprocess.Popen(["/bin/true"], preexec_fn=setup)  # noqa: PLW1509
        os.close(w)
        w = -1
        assert os.read(r, 4096).decode().startswith("joining its cgroups: [Errno 2] No such file or directory")
    finally:
        for fd in (r, w, work):
            if fd >= 0:
                os.close(fd)


# --------------------------------------------------------------------------- ownership


@real_v1
def test_the_actuator_acts_only_on_the_containers_it_started_for_that_job(tmp_path, layout):
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    rules = parse_policy_file({"workloads": [{"match": "annotated", "job": "annotated"}]})
    act, _rec = actuator(s, backend, Ledger(tmp_path / "ledger.sqlite"), workloads=Workloads(layout, rules=rules))
    strangers: list[subprocess.Popen] = []

    def stranger(name: str) -> subprocess.Popen:  # a container and process this actuator did not start
        layout.create(name)
        p = subprocess.Popen(["/bin/sleep", "60"])
        strangers.append(p)
        layout.attach(name, p.pid)
        return p

    def freezer(name: str) -> str:
        return (layout.path(name, "freezer") / "freezer.state").read_text().strip()

    try:
        other = stranger("other")
        shares = (layout.path("other", "cpu") / "cpu.shares").read_text()
        for i, (action, details) in enumerate([("freeze", {}), ("weight", {"cpu_weight": 10}), ("thaw", {}),
                                               ("terminate", {"grace_s": 0}),
                                               ("place", {"resume": True, "command": ["/bin/true"], "cpuset": None,
                                                          "device": []})]):
            a = act.handle(decision("other", action, **details), b"h1", 0, i)
            assert a.status == "rejected", (action, a.message)
            assert a.message == (f"container 'other' was not started by this actuator and its workload does not say "
                                 f"it belongs to job 'other' (phasewise.io/job): {action} refused"), a.message
        assert other.poll() is None and freezer("other") == "THAWED"  # alive, never frozen
        assert (layout.path("other", "cpu") / "cpu.shares").read_text() == shares
        assert layout.pids("other") == [other.pid]
        assert refused(act, "not_owner") == 5

        # its own job: started here, so frozen and thawed for that job's decisions, for no other job's
        assert act.handle(place("mine", ["/bin/sleep", "60"]), b"h1", 0, 10).status == "applied"
        mine = backend.processes["mine"]
        a = act.handle(decision("mine", "freeze", job="someone-else"), b"h1", 0, 11)
        assert a.status == "rejected" and "started by this actuator for job 'mine', not 'someone-else'" in a.message
        assert freezer("mine") == "THAWED"
        a = act.handle(decision("mine", "freeze"), b"h1", 0, 12)
        assert a.status == "applied" and freezer("mine") == "FROZEN", a.message
        assert act.handle(decision("mine", "thaw"), b"h1", 0, 13).status == "applied" and freezer("mine") == "THAWED"
        assert mine.poll() is None

        # a container whose workload says whose it is: acted on for that job, and that job only
        annotated = stranger("annotated")
        a = act.handle(decision("annotated", "freeze", job="x"), b"h1", 0, 20)
        assert a.status == "rejected" and "belongs to job 'annotated' (its workload's phasewise.io/job)" in a.message
        assert freezer("annotated") == "THAWED"
        assert act.handle(decision("annotated", "freeze"), b"h1", 0, 21).status == "applied"
        assert freezer("annotated") == "FROZEN"
        assert act.handle(decision("annotated", "thaw"), b"h1", 0, 22).status == "applied"
        assert annotated.poll() is None and other.poll() is None
        # limit decisions are unchanged: the workload's mode decides, not who started it
        a = act.handle(encode(Decision(id="lim", ts=time.time(), host="h1", container="other", action="limit",
                                       policy="test", cpu_limit_cores=0.5)), b"h1", 0, 30)
        assert a.status == "applied", a.message
    finally:
        for c in layout.containers():
            (layout.path(c, "freezer") / "freezer.state").write_text("THAWED")
        for p in strangers:
            p.kill()
            p.wait()
        remove_started_jobs(backend, layout)


# --------------------------------------------------------------------------- the role, on the broker


@pytest.mark.broker
@pytest.mark.slow
@real_v1
def test_phasewise_actuate_starts_a_job_as_nobody_announces_it_signed_and_leaves_a_strangers_container(
        settings, tmp_path):
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    from phasewise.kit.kafka.client import make_consumer, make_producer
    from phasewise.kit.kafka.partitions import PARTITIONER
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.records import Actuation, SchemaError
    from phasewise.kit.topics import ACTUATIONS

    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(os.urandom(48).hex().encode())
    os.chmod(key_file, 0o600)
    ring = Keyring(key_file.read_bytes().strip())
    host, prefix, job = settings.host, f"pwtest-{uuid.uuid4().hex[:8]}", f"job-{uuid.uuid4().hex[:6]}"
    layout = CgroupLayout("/sys/fs/cgroup", prefix=prefix, version=1)
    layout.create("other")  # a stranger's container and process in the managed prefix
    other = subprocess.Popen(["/bin/sleep", "120"])
    layout.attach("other", other.pid)
    trusted = tmp_path / "submitters"
    trusted.mkdir(mode=0o755)
    write_public(trusted / "test.pub")
    actuator = RoleProcess("actuate", ["--backend", "cgroup", "--start-jobs", "--cgroup-prefix", prefix], env={
        "PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_HOST": host, "PHASEWISE_CGROUP_ROOT":
        "/sys/fs/cgroup", "PHASEWISE_DATA_DIR": str(tmp_path / "a"), "PHASEWISE_SIGNING_KEY_FILE": str(key_file),
        "PHASEWISE_KAFKA_SASL_USERNAME": "not-for-jobs", "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(trusted)},
        log_path=tmp_path / "actuator.log").start()
    producer = make_producer(settings, partitioner=PARTITIONER)
    reader = make_consumer(settings, f"jail-{uuid.uuid4().hex[:6]}")
    reader.assign([TopicPartition(t.name, p, OFFSET_BEGINNING) for t in (JOB_EVENTS, ACTUATIONS)
                   for p in range(t.partitions)])

    def send(raw: bytes) -> str:
        producer.produce(DECISIONS.name, key=host.encode(), value=raw,
                         headers=ring.headers(DECISIONS.name, host.encode(), raw))
        assert producer.flush(10) == 0
        return decode(Decision, raw).id

    acts: dict[str, Actuation] = {}
    started: list = []

    def wait_for(pred, what: str) -> None:
        deadline = time.monotonic() + 90
        while not pred():
            assert actuator.alive() and time.monotonic() < deadline, f"{what}\n{actuator.log_tail()}"
            m = reader.poll(0.2)
            if m is None or m.error():
                continue
            try:
                if m.topic() == ACTUATIONS.name:
                    a = decode(Actuation, m.value())
                    acts[a.decision_id] = a
                else:
                    ev = decode(JobEvent, m.value())
                    if ev.job == job and ev.kind == "started":
                        started.append((m.key(), m.value(), m.headers(), ev))
            except SchemaError:
                continue  # other tests' records

    try:
        placed = send(place(job, ["/bin/sleep", "120"], host=host))
        wait_for(lambda: placed in acts and started, "the place's actuation and its started event")
        assert acts[placed].status == "applied", acts[placed].message
        key, value, headers, ev = started[0]
        assert key == job.encode() and (ev.host, ev.container) == (host, job)
        assert ring.verify(JOB_EVENTS.name, key, value, headers) is None  # signed with the cluster key
        st = proc_status(ev.pid)
        assert st["Uid"].split()[0] == str(NOBODY.pw_uid) and st["NoNewPrivs"].strip() == "1"
        assert layout.pids(job) == [ev.pid]
        env = proc_environ(ev.pid)
        assert [k for k in env if k.startswith("PHASEWISE_")] == ["PHASEWISE_JOB"]
        assert "not-for-jobs" not in env.values()
        frozen = send(decision("other", "freeze", host=host))
        killed = send(decision("other", "terminate", host=host, grace_s=0))
        mine = send(decision(job, "freeze", host=host))
        wait_for(lambda: {frozen, killed, mine} <= set(acts), "the freezes' and the terminate's actuations")
        assert acts[frozen].status == acts[killed].status == "rejected", (acts[frozen], acts[killed])
        assert "was not started by this actuator" in acts[frozen].message
        assert other.poll() is None
        assert (layout.path("other", "freezer") / "freezer.state").read_text().strip() == "THAWED"
        assert acts[mine].status == "applied", acts[mine].message
        assert (layout.path(job, "freezer") / "freezer.state").read_text().strip() == "FROZEN"
    finally:
        reader.close()
        actuator.stop()
        for c in layout.containers():  # the job outlives the actuator (its own session): stop it
            (layout.path(c, "freezer") / "freezer.state").write_text("THAWED")
            for pid in layout.pids(c):
                os.kill(pid, signal.SIGKILL)
        other.kill()
        other.wait()
        deadline = time.monotonic() + 60
        while any(layout.pids(c) for c in layout.containers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        cs = layout.controller_root("cpuset") / prefix
        for c in layout.containers():
            layout.remove(c)
        for d in sorted(cs.glob("*"), reverse=True) if cs.exists() else ():
            if d.is_dir():
                d.rmdir()
        if cs.exists():
            cs.rmdir()
        for ctl in layout.controllers():
            try:
                layout.base(ctl).rmdir()
            except OSError:
                pass
