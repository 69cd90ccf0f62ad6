"""Backends carry out actuator commands: cgroup files (v1 and v2) or a dry run.

A backend does IO only; the safety rules ran before it is called
(:mod:`phasewise.actuators.safety`). Every backend implements the small
:class:`Backend` protocol: ``apply(command) -> Outcome``, ``memory_usage``
(working set, for the memory floor) and ``exists``.

cgroup v1 (one hierarchy per controller under the root)::

    cpu/<prefix>/<c>/cpu.cfs_period_us     100000
    cpu/<prefix>/<c>/cpu.cfs_quota_us      round(cores * period), at least 1000
    cpu/<prefix>/<c>/cpu.shares            round(weight * 1024 / 100), in [2, 262144]
    memory/<prefix>/<c>/memory.limit_in_bytes
    freezer/<prefix>/<c>/freezer.state     FROZEN | THAWED

cgroup v2 (one unified tree)::

    <prefix>/<c>/cpu.max                   "<quota> <period>"
    <prefix>/<c>/cpu.weight                weight (1..10000)
    <prefix>/<c>/memory.max
    <prefix>/<c>/cgroup.freeze             1 | 0

A CPU weight (:class:`SetCpuWeight`) is in ``cpu.weight`` units; on v1 it
becomes ``cpu.shares`` proportionally, as systemd converts them (weight 100,
the v2 default, is 1024 shares, the v1 default): CFS divides a contended
CPU among sibling groups in proportion to these numbers, so a proportional
conversion keeps every ratio the policy chose. (runc's conversion maps the two
ranges end to end, ``1 + (shares - 2) * 9999 / 262142``, which neither keeps
ratios nor maps the defaults onto each other.) A weight orders only the
siblings under the managed prefix; the prefix's own cgroup competes with the
rest of the host at its own weight.

A ``Terminate`` signals every process of the container's cgroup: SIGTERM to
each (unless the job is already checkpointing through its control channel),
up to the grace period for them to exit, then the hard stop of whatever is
left, race-free: v2 writes ``cgroup.kill`` (the kernel kills every process of
the cgroup, forks in flight included); v1 (and a v2 kernel without
``cgroup.kill``) freezes the cgroup so nothing in it can fork, SIGKILLs every
process listed in any of its hierarchies, and thaws it so they die. The
outcome says how many processes exited after SIGTERM and how many were
killed; processes still there after ``kill_wait_s`` (uninterruptible sleep)
are a permanent failure, so the container is not recorded as terminated. The
backend waits the grace out (the actuator handles the host's next decision
after it).

A ``StartJob`` (a placed job) is carried out only by a backend given a
:class:`JobRuntime` (``actuator_start_jobs``): it creates the job's managed
container in every controller, binds it to its CPUs (v1:
``cpuset/<prefix>/<c>/cpuset.cpus``, the prefix's own
``cpuset.cpus``/``cpuset.mems`` filled from its parent; v2:
``<prefix>/<c>/cpuset.cpus`` with ``+cpuset`` enabled on the way), writes the
job's CPU and memory limits when the command carries them, and starts the
command in it, unprivileged and clean (docs/security.md, "What a started job
can do"). The child, still root, joins the job's cgroups (so no instruction
of the job runs outside them), enters its working directory
``<data_dir>/jobs/<c>/`` (made 0700 for the job user; opened without
following links, a pre-existing one not the job user's refused), sets
``RLIMIT_CORE`` 0, drops every supplementary group, takes the job's gid and
uid and sets ``no_new_privs``; only then does it run the command, with an
environment built from scratch (:meth:`JobRuntime.environment`). Python's
``subprocess`` switches ``user=``/``group=``/``extra_groups=`` *before* it
calls ``preexec_fn``, which could then no longer write the root-owned
``cgroup.procs``: so all of it is done in the one ``preexec_fn``, in that
order. Output goes to ``<data_dir>/job-logs/<c>.log``, opened
``O_NOFOLLOW|O_CLOEXEC`` relative to the log directory, itself opened without
following links and refused unless it is the actuator's own and writable by
nobody else: a link planted at either place is never followed by a root
write. GPUs are passed as ``CUDA_VISIBLE_DEVICES``. A resumed job
(``resume``: stopped by checkpoint-and-exit, started again so that it resumes
from its checkpoint) reuses its container and working directory when they
are still there and the container is empty (its weight and, unless the
command names CPUs, its cpuset stay); a container that still holds a process
is refused, so a job never runs twice. The exits of the jobs it started are
collected (:meth:`CgroupBackend.exited`) for the actuator's registry.

Errors never escape ``apply``: they come back as a ``failed`` outcome marked
``temporary`` when a retry may help (EAGAIN, EINTR, ENOMEM, a busy freezer)
and permanent otherwise (missing container, permission, invalid value). A v1
memory limit the kernel refuses because usage cannot be reclaimed under it
(EBUSY) is permanent: the kernel already tried to reclaim, so it is reported
at once, not retried.
"""

from __future__ import annotations

import ctypes
import errno
import grp
import logging
import os
import pwd
import resource
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from phasewise.actuators.commands import Command, Freeze, Outcome, SetCpuWeight, SetLimits, StartJob, Terminate, Thaw
from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout, is_container_name
from phasewise.kit.settings import parse_job_env

__all__ = ["CFS_PERIOD_US", "JOB_PATH", "MIN_QUOTA_US", "Backend", "CgroupBackend", "DryRunBackend", "Exited",
           "JobRuntime", "JobSetupError", "job_runtime", "shares_of_weight", "weight_of_shares"]

log = logging.getLogger(__name__)

CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000
_TEMPORARY_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.ENOMEM, errno.EBUSY}


@runtime_checkable
class Backend(Protocol):
    #: shown as ``Actuation.backend``
    name: str

    def apply(self, command: Command) -> Outcome:
        """Carry out *command*; never raises for an OS error (see module doc)."""
        ...

    def memory_usage(self, container: str) -> float | None:
        """The container's memory working set in bytes, ``None`` if it cannot be read."""
        ...

    def exists(self, container: str) -> bool:
        """Whether the managed container exists now."""
        ...


# --------------------------------------------------------------------------- started jobs: who, where, what env

#: a started job's ``PATH`` unless ``job_env`` names one
JOB_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class JobSetupError(ValueError):
    """A ``job_*`` setting this host cannot honour; ``str(e)`` is one line naming the setting."""


@dataclass(frozen=True, slots=True)
class JobRuntime:
    """How started jobs run: as whom (resolved ids), where (under *data_dir*), with what added environment."""

    user: str
    uid: int
    group: str
    gid: int
    data_dir: str
    #: the operator's ``job_env``: NAME=VALUE pairs added to every job's environment
    env: tuple[tuple[str, str], ...] = ()

    @property
    def work_root(self) -> Path:
        """``<data_dir>/jobs``: the jobs' working directories (root-owned, 0755)."""
        return Path(self.data_dir) / "jobs"

    @property
    def log_dir(self) -> Path:
        """``<data_dir>/job-logs``: the jobs' output (root-owned, 0750)."""
        return Path(self.data_dir) / "job-logs"

    def workdir(self, container: str) -> Path:
        return self.work_root / container

    def log_path(self, container: str) -> Path:
        return self.log_dir / f"{container}.log"

    def who(self) -> str:
        return f"{self.user}:{self.group} (uid {self.uid}, gid {self.gid})"

    def environment(self, cmd: StartJob) -> dict[str, str]:
        """A job's whole environment, built from scratch: nothing of the actuator's own is passed on.

        ``PATH`` (:data:`JOB_PATH`) and ``LANG`` (``C.UTF-8``) unless ``job_env`` sets them, the rest
        of ``job_env``, then per job ``HOME`` (its working directory), ``TMPDIR`` (``$HOME/tmp``),
        ``PHASEWISE_JOB`` (its id) and ``CUDA_VISIBLE_DEVICES``: the decided GPUs, or where the
        decision names none (``gpus`` None) the actuator's own value, if it has one (the job sees
        what the actuator sees, as before).
        """
        home = str(self.workdir(cmd.container))
        env = {"PATH": JOB_PATH, "LANG": "C.UTF-8", **dict(self.env)}
        env.update(HOME=home, TMPDIR=f"{home}/tmp", PHASEWISE_JOB=cmd.job or cmd.container)
        if cmd.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cmd.gpus)
        elif "CUDA_VISIBLE_DEVICES" in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        return env


def job_runtime(settings: Any, *, switches: bool = True, euid: int | None = None,
                egid: int | None = None) -> JobRuntime:
    """The :class:`JobRuntime` of the settings (``job_user``, ``job_group``, ``job_allow_root``, ``job_env``).

    :class:`JobSetupError` (one line, naming the setting) for a user or group this host does not
    have, for root (uid or gid 0) unless ``job_allow_root``, and, when *switches* (the process
    really switches to them: the cgroup backend), for a user or group other than the actuator's
    own when the actuator is not root (it could not switch).
    """
    a = settings.actuator
    euid = os.geteuid() if euid is None else euid
    egid = os.getegid() if egid is None else egid
    user, uid, primary = _user(a.job_user)
    if a.job_group:
        group, gid = _group(a.job_group)
    elif primary is None:
        raise JobSetupError(f"job_user: uid {uid} has no entry in the user database, so no primary group: "
                            "set job_group")
    else:
        gid = primary
        try:
            group = grp.getgrgid(gid).gr_name
        except KeyError:
            group = str(gid)
    if not a.job_allow_root:
        if uid == 0:
            raise JobSetupError(f"job_user: {user} is root (uid 0); jobs never run as root unless "
                                "job_allow_root=true")
        if gid == 0:
            raise JobSetupError(f"job_group: {group} is root's group (gid 0); jobs never run with it unless "
                                "job_allow_root=true")
    if switches and euid != 0:
        if uid != euid:
            raise JobSetupError(f"job_user: this actuator runs as uid {euid}, not root: it can start jobs only as "
                                f"its own user (job_user={_name_of_uid(euid)}), not as {user} (uid {uid})")
        if gid != egid:
            raise JobSetupError(f"job_group: this actuator runs as gid {egid}, not root: it can start jobs only "
                                f"with its own group, not {group} (gid {gid})")
    return JobRuntime(user=user, uid=uid, group=group, gid=gid, data_dir=str(settings.data_dir),
                      env=parse_job_env(a.job_env))


def _user(text: str) -> tuple[str, int, int | None]:
    """(name, uid, primary gid or None) of a user name or numeric uid."""
    try:
        pw = pwd.getpwuid(int(text)) if text.isdigit() else pwd.getpwnam(text)
    except KeyError:
        if text.isdigit():
            return text, int(text), None
        raise JobSetupError(f"job_user: no user {text!r} on this host") from None
    return pw.pw_name, pw.pw_uid, pw.pw_gid


def _group(text: str) -> tuple[str, int]:
    try:
        gr = grp.getgrgid(int(text)) if text.isdigit() else grp.getgrnam(text)
    except KeyError:
        if text.isdigit():
            return text, int(text)
        raise JobSetupError(f"job_group: no group {text!r} on this host") from None
    return gr.gr_name, gr.gr_gid


def _name_of_uid(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class _Refused(Exception):
    """A job's working directory or log cannot be used safely (the message says why)."""


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, *, at: int | None, shown: Path, what: str) -> int:
    """Open directory *name* (relative to the directory fd *at*) without following a link in its place."""
    try:
        return os.open(name, _DIR, dir_fd=at)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _Refused(f"{what} {shown} is a symbolic link or not a directory: not followed") from None
        raise


def _own_dir(at: int, name: str, mode: int, *, owner: int, shown: Path, what: str) -> int:
    """The directory *name* in *at*, made (*mode*) when missing; refused unless *owner*'s and writable by it alone."""
    try:
        os.mkdir(name, mode, dir_fd=at)
    except FileExistsError:
        pass
    fd = _open_dir(name, at=at, shown=shown, what=what)
    st = os.fstat(fd)
    if st.st_uid != owner or st.st_mode & 0o022:
        os.close(fd)
        raise _Refused(f"{what} {shown} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; "
                       f"it must be uid {owner}'s and writable by it alone: refused")
    os.fchmod(fd, mode)
    return fd


def _job_files(rt: JobRuntime, container: str) -> tuple[int, int]:
    """(working directory fd, log fd) of a job about to start; :class:`_Refused` where unsafe (see the module doc).

    Every step is relative to a directory already opened without following links, so a link
    planted anywhere under ``data_dir`` (by whoever can write there) is refused, never followed.
    """
    me = os.geteuid()
    Path(rt.data_dir).mkdir(parents=True, exist_ok=True)
    top = _open_dir(rt.data_dir, at=None, shown=Path(rt.data_dir), what="data_dir")
    work = log = -1
    try:
        logs = _own_dir(top, "job-logs", 0o750, owner=me, shown=rt.log_dir, what="the job log directory")
        try:
            try:
                log = os.open(f"{container}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                              | os.O_CLOEXEC, 0o640, dir_fd=logs)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise _Refused(f"job log {rt.log_path(container)} is a symbolic link: not followed") from None
                raise
            st = os.fstat(log)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != me:
                raise _Refused(f"job log {rt.log_path(container)} is not a plain file of this actuator's "
                               f"(mode {st.st_mode:o}, {st.st_nlink} links, uid {st.st_uid}): refused")
        finally:
            os.close(logs)
        jobs = _own_dir(top, "jobs", 0o755, owner=me, shown=rt.work_root, what="the jobs' directory")
        try:
            try:
                os.mkdir(container, 0o700, dir_fd=jobs)
                made = True
            except FileExistsError:
                made = False
            work = _open_dir(container, at=jobs, shown=rt.workdir(container), what="working directory")
            st = os.fstat(work)
            if made:
                os.fchown(work, rt.uid, rt.gid)
                os.fchmod(work, 0o700)
            elif st.st_uid != rt.uid:
                raise _Refused(f"working directory {rt.workdir(container)} exists and belongs to uid {st.st_uid}, "
                               f"not to the job user {rt.user} (uid {rt.uid}): refused")
        finally:
            os.close(jobs)
    except BaseException:
        for fd in (work, log):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(top)
    return work, log


PR_SET_NO_NEW_PRIVS = 38
_prctl: Any = None


def _libc_prctl() -> Any:
    """libc's ``prctl``, looked up once in the actuator (never in a forked child)."""
    global _prctl
    if _prctl is None:
        f = ctypes.CDLL(None, use_errno=True).prctl
        f.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        f.restype = ctypes.c_int
        _prctl = f
    return _prctl


def _child_setup(procs: list[str], work_fd: int, uid: int, gid: int, switch: bool, err_fd: int) -> Callable[[], None]:
    """The ``preexec_fn`` of a started job, run in the child between fork and exec (see the module doc).

    Only system calls: no logging, no allocation-heavy work. A failure is written to *err_fd*
    (what step, why) before it is raised, so the actuator can say why the job did not start.
    """
    prctl = _libc_prctl()

    def setup() -> None:
        step = "joining its cgroups"
        try:
            pid = str(os.getpid()).encode()
            for path in procs:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)
            step = "entering its working directory"
            os.fchdir(work_fd)
            step = "setting RLIMIT_CORE to 0"
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if switch:
                step = f"dropping to uid {uid} gid {gid}"
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            step = "setting no_new_privs"
            if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
            step = "making its TMPDIR"
            try:
                os.mkdir("tmp", 0o700)
            except FileExistsError:
                pass
        except BaseException as e:
            try:
                os.write(err_fd, f"{step}: {e}".encode(errors="replace")[:2000])
            except OSError:
                pass
            raise

    return setup


@dataclass(frozen=True, slots=True)
class Exited:
    """A job process this backend started has exited (``returncode`` as subprocess reports it: -N = signal N)."""

    container: str
    pid: int
    returncode: int


# --------------------------------------------------------------------------- cgroup


class _WriteFailed(Exception):
    def __init__(self, outcome_message: str, temporary: bool) -> None:
        super().__init__(outcome_message)
        self.temporary = temporary


#: cgroup v1 ``cpu.shares``: its range and default (the kernel's)
SHARES_MIN, SHARES_MAX, SHARES_DEFAULT = 2, 262_144, 1024


def shares_of_weight(weight: int) -> int:
    """cgroup v1 ``cpu.shares`` of a ``cpu.weight``: proportional, 100 -> 1024 (as systemd converts).

    >>> [shares_of_weight(w) for w in (1, 100, 159, 3200, 10000)]
    [10, 1024, 1628, 32768, 102400]
    """
    return min(SHARES_MAX, max(SHARES_MIN, round(weight * SHARES_DEFAULT / 100)))


def weight_of_shares(shares: int) -> float:
    """The ``cpu.weight`` a ``cpu.shares`` value stands for (the inverse of :func:`shares_of_weight`).

    >>> weight_of_shares(1024), weight_of_shares(32768)
    (100.0, 3200.0)
    """
    return shares * 100 / SHARES_DEFAULT


def quota_us(cores: float, period_us: int = CFS_PERIOD_US) -> int:
    """CFS quota for *cores* (at least the kernel's minimum of 1 ms)."""
    return max(MIN_QUOTA_US, round(cores * period_us))


class CgroupBackend:
    """Writes limits straight into the managed containers' cgroup files."""

    def __init__(self, layout: CgroupLayout, *, freeze_timeout_s: float = 2.0,
                 jobs: JobRuntime | None = None, kill_wait_s: float = 5.0) -> None:
        self.layout = layout
        self.freeze_timeout_s = freeze_timeout_s
        self.kill_wait_s = kill_wait_s  #: how long processes get to vanish after SIGKILL
        self.name = f"cgroup-v{layout.version}"
        #: how jobs are started; ``None``: this backend starts none (``actuator_start_jobs`` off)
        self.jobs = jobs
        self.processes: dict[str, subprocess.Popen] = {}  # jobs started here (reaped as they end)
        self._exited: list[Exited] = []

    # ------------------------------------------------------------------ protocol

    def exists(self, container: str) -> bool:
        try:
            return self.layout.exists(container)
        except CgroupError:
            return False

    def memory_usage(self, container: str) -> float | None:
        """``usage - inactive_file``: what the kernel cannot reclaim cheaply (as kubelet's working set)."""
        v1 = self.layout.version == 1
        try:
            d = self.layout.path(container, "memory")
            usage = int(_read(d / ("memory.usage_in_bytes" if v1 else "memory.current")))
        except (OSError, ValueError):
            return None
        inactive = 0
        try:
            key = "total_inactive_file" if v1 else "inactive_file"
            for line in _read(d / "memory.stat").splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    inactive = int(v)
                    break
        except (OSError, ValueError):
            pass  # no memory.stat: count the whole usage (the safe side)
        return float(max(0, usage - inactive))

    def apply(self, command: Command) -> Outcome:
        try:
            if isinstance(command, SetLimits):
                return self._set_limits(command)
            if isinstance(command, SetCpuWeight):
                return self._set_weight(command)
            if isinstance(command, Freeze):
                return self._freeze(command.container, True)
            if isinstance(command, Thaw):
                return self._freeze(command.container, False)
            if isinstance(command, StartJob):
                return self._start(command)
            if isinstance(command, Terminate):
                return self._terminate(command)
        except CgroupError as e:
            return Outcome.failed(str(e), temporary=e.temporary)
        except OSError as e:
            return Outcome.failed(f"{type(command).__name__} on {command.container!r}: {e}",
                                  temporary=e.errno in _TEMPORARY_ERRNOS)
        except ValueError as e:  # a cgroup file holding something unexpected
            return Outcome.failed(f"{type(command).__name__} on {command.container!r}: {e}")
        return Outcome.failed(f"unknown command {command!r}")

    # ------------------------------------------------------------------ limits

    def _set_limits(self, cmd: SetLimits) -> Outcome:
        done: list[str] = []
        cpu_set: float | None = None
        mem_set: int | None = None
        try:
            if cmd.cpu_cores is not None:
                cpu_set = self._set_cpu(cmd.container, cmd.cpu_cores)
                done.append(f"cpu {cpu_set:g} cores")
            if cmd.mem_bytes is not None:
                mem_set = self._set_mem(cmd.container, cmd.mem_bytes)
                done.append(f"memory {mem_set} bytes")
        except _WriteFailed as e:
            msg = str(e) if not done else f"{e} (already set: {', '.join(done)})"
            return Outcome.failed(msg, temporary=e.temporary, cpu_cores=cpu_set, mem_bytes=mem_set)
        return Outcome.applied("set " + ", ".join(done), cpu_cores=cpu_set, mem_bytes=mem_set)

    def _set_cpu(self, container: str, cores: float) -> float:
        quota = quota_us(cores)
        d = self.layout.path(container, "cpu")
        if self.layout.version == 1:
            period_file, quota_file = d / "cpu.cfs_period_us", d / "cpu.cfs_quota_us"
            if _read_int(period_file) != CFS_PERIOD_US:
                _write(period_file, str(CFS_PERIOD_US), "CPU period")
            _write(quota_file, str(quota), "CPU quota")
            q, p = _read_int(quota_file), _read_int(period_file)
        else:
            f = d / "cpu.max"
            _write(f, f"{quota} {CFS_PERIOD_US}", "CPU limit")
            q_text, _, p_text = _read(f).strip().partition(" ")
            if q_text == "max":
                raise _WriteFailed(f"{f} still reads 'max' after writing quota {quota}", False)
            q, p = int(q_text), int(p_text or CFS_PERIOD_US)
        return q / p

    def _set_weight(self, cmd: SetCpuWeight) -> Outcome:
        d = self.layout.path(cmd.container, "cpu")
        try:
            if self.layout.version == 1:
                f, value = d / "cpu.shares", shares_of_weight(cmd.weight)
                _write(f, str(value), "CPU shares")
                got = _read_int(f)
                return Outcome.applied(f"set cpu.shares {got} (cpu.weight {cmd.weight} x 1024 / 100)")
            f = d / "cpu.weight"
            _write(f, str(cmd.weight), "CPU weight")
            return Outcome.applied(f"set cpu.weight {_read_int(f)}")
        except _WriteFailed as e:
            return Outcome.failed(str(e), temporary=e.temporary)

    def _set_mem(self, container: str, limit: int) -> int:
        d = self.layout.path(container, "memory")
        f = d / ("memory.limit_in_bytes" if self.layout.version == 1 else "memory.max")
        try:
            _write(f, str(int(limit)), "memory limit")
        except _WriteFailed as e:
            if self.layout.version == 1 and getattr(e.__cause__, "errno", None) == errno.EBUSY:
                raise _WriteFailed(
                    f"kernel refused memory limit {limit} bytes for {container!r}: usage could not be "
                    f"reclaimed below it (EBUSY)", False) from e.__cause__
            raise
        text = _read(f).strip()
        return int(limit) if text == "max" else int(text)

    # ------------------------------------------------------------------ terminate

    def _pids(self, container: str) -> set[int]:
        """Every process of the container, in any of its hierarchies (v1 lists them per controller)."""
        ctrls = ("unified",) if self.layout.version == 2 else self.layout.controllers()
        out: set[int] = set()
        for ctl in ctrls:
            try:
                text = _read(self.layout.path(container, ctl) / "cgroup.procs")
            except FileNotFoundError:
                continue
            out.update(int(x) for x in text.split())
        return out

    def _reap(self) -> None:
        """Collect the exit of jobs this backend started (else they linger as zombies of the actuator)."""
        for name, p in list(self.processes.items()):
            if p.poll() is not None:
                del self.processes[name]
                self._exited.append(Exited(name, p.pid, p.returncode))

    def exited(self) -> list[Exited]:
        """The jobs started here that exited since the last call (collected now), oldest first."""
        self._reap()
        out, self._exited = self._exited, []
        return out

    def _wait_empty(self, container: str, seconds: float) -> set[int]:
        """Wait up to *seconds* for the container to hold no process; the pids still there."""
        deadline = time.monotonic() + seconds
        while True:
            self._reap()
            left = self._pids(container)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.02)

    def _terminate(self, cmd: Terminate) -> Outcome:
        c = cmd.container
        t0 = time.monotonic()
        first = self._pids(c)
        if not first:
            return Outcome.applied("no process in the container: nothing to stop")
        said: list[str] = []
        if cmd.sigterm and cmd.grace_s > 0:
            for pid in sorted(first):
                _signal(pid, signal.SIGTERM)
            said.append(f"SIGTERM to {len(first)} process(es)")
        elif cmd.grace_s > 0:
            said.append(f"{len(first)} process(es) left to finish their checkpoint")
        left = self._wait_empty(c, cmd.grace_s) if cmd.grace_s > 0 else first
        waited = time.monotonic() - t0
        if not left:
            return Outcome.applied(f"{'; '.join(said)}; all exited within {waited:.2f} s")
        if cmd.grace_s > 0:
            said.append(f"{len(first) - len(left & first)} exited within the {cmd.grace_s:g} s grace")
        how, n = self._kill(c)
        said.append(f"SIGKILL to {n} left ({how})")
        still = self._wait_empty(c, self.kill_wait_s)
        if still:
            return Outcome.failed(f"{'; '.join(said)}; {len(still)} process(es) still there {self.kill_wait_s:g} s "
                                  f"after SIGKILL (uninterruptible sleep?): {sorted(still)[:10]}")
        return Outcome.applied(f"{'; '.join(said)}; the container is empty after {time.monotonic() - t0:.2f} s")

    def _kill(self, container: str) -> tuple[str, int]:
        """SIGKILL every process of the container with no fork racing it; (how, processes signalled)."""
        if self.layout.version == 2:
            f = self.layout.path(container) / "cgroup.kill"
            if f.exists():
                n = len(self._pids(container))
                _write(f, "1", "cgroup.kill")
                return "cgroup.kill", n
        frozen = self._freeze(container, True)
        if frozen.status != "applied":  # no freezer: kill what is listed, again until nothing new appears
            seen: set[int] = set()
            for _ in range(10):
                new = self._pids(container) - seen
                if not new:
                    break
                for pid in new:
                    _signal(pid, signal.SIGKILL)
                seen |= new
            return f"not frozen ({frozen.message}); killed until no new process appeared", len(seen)
        try:
            pids = self._pids(container)
            for pid in pids:
                _signal(pid, signal.SIGKILL)
        finally:
            self._freeze(container, False)  # frozen processes die once thawed
        return "frozen first, so none could fork", len(pids)

    # ------------------------------------------------------------------ freezer

    def _start(self, cmd: StartJob) -> Outcome:
        self._reap()
        rt = self.jobs
        c = cmd.container
        if rt is None:
            return Outcome.failed(f"not started {c!r}: this backend starts no jobs (actuator_start_jobs is off)")
        reused = self.exists(c)
        if reused and not cmd.resume:
            return Outcome.failed(f"container {c!r} already exists: not started again")
        if reused:
            left = self._pids(c)
            if left:
                return Outcome.failed(f"container {c!r} still holds {len(left)} process(es): a stopped job is "
                                      "resumed once it has exited, never started twice")
        try:  # before any cgroup: a job that cannot start safely leaves nothing behind
            work_fd, log_fd = _job_files(rt, c)
        except _Refused as e:
            return Outcome.failed(f"not started {c!r}: {e}")
        try:
            return self._start_in(cmd, rt, reused, work_fd, log_fd)
        finally:
            os.close(work_fd)
            os.close(log_fd)

    def _start_in(self, cmd: StartJob, rt: JobRuntime, reused: bool, work_fd: int, log_fd: int) -> Outcome:
        c = cmd.container
        cs: Path | None = None

        def undo() -> None:
            if not reused:
                self.layout.remove(c)
                if self.layout.version == 1 and cs is not None and cs.exists():
                    cs.rmdir()

        try:
            self.layout.create(c)
            if self.layout.version == 1:
                cs = _cpuset_dirs_v1(self.layout, c)
                procs = [self.layout.path(c, ctl) / "cgroup.procs" for ctl in self.layout.controllers()]
                procs.append(cs / "cgroup.procs")
            else:
                cs = _cpuset_dir_v2(self.layout, c)
                procs = [cs / "cgroup.procs"]
            if cmd.cpus:  # else (a resumed job) the cpuset it had
                _write(cs / "cpuset.cpus", cmd.cpus, "cpuset.cpus")
            cpus = cmd.cpus or _read(cs / "cpuset.cpus").strip() or "its parent's"
            limits = []
            if cmd.cpu_cores is not None:
                limits.append(f"cpu {self._set_cpu(c, cmd.cpu_cores):g} cores")
            if cmd.mem_bytes is not None:
                limits.append(f"memory {self._set_mem(c, cmd.mem_bytes)} bytes")
        except _WriteFailed as e:
            undo()
            return Outcome.failed(f"not started {c!r}: {e}", temporary=e.temporary)
        except BaseException:
            undo()
            raise
        err_r, err_w = os.pipe()
        try:
            setup = _child_setup([str(p) for p in procs], work_fd, rt.uid, rt.gid, os.geteuid() == 0, err_w)
            proc = subprocess.Popen(list(cmd.argv), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                    env=rt.environment(cmd), start_new_session=True, umask=0o077,
                                    preexec_fn=setup)  # noqa: PLW1509 - the only way to join the cgroups as root
        except (OSError, subprocess.SubprocessError) as e:
            os.close(err_w)
            err_w = -1
            why = os.read(err_r, 4096).decode(errors="replace") or str(e)
            undo()
            return Outcome.failed(f"cannot start {cmd.argv[0]!r} for {c!r}: {why}")
        finally:
            if err_w >= 0:
                os.close(err_w)
            os.close(err_r)
        self.processes[c] = proc
        return Outcome.applied(f"{'resumed' if cmd.resume else 'started'} pid {proc.pid} as {rt.who()} in cpuset "
                               f"{cpus}" + (" (its container again)" if reused else "")
                               + (f" with GPUs {list(cmd.gpus)}" if cmd.gpus else "")
                               + (f", limits {', '.join(limits)}" if limits else ""), pid=proc.pid)

    def _freeze(self, container: str, frozen: bool) -> Outcome:
        want = "FROZEN" if frozen else "THAWED"
        try:
            if self.layout.version == 1:
                f = self.layout.path(container, "freezer") / "freezer.state"
                _write(f, want, "freezer state")
                deadline = time.monotonic() + self.freeze_timeout_s
                state = _read(f).strip()
                while state != want and time.monotonic() < deadline:
                    time.sleep(0.01)
                    state = _read(f).strip()
                if state != want:
                    return Outcome.failed(f"{f} reads {state} {self.freeze_timeout_s:g}s after writing {want}",
                                          temporary=True)
            else:
                d = self.layout.path(container)
                _write(d / "cgroup.freeze", "1" if frozen else "0", "freeze")
                events = d / "cgroup.events"
                if events.exists():  # the kernel reports completion here; fixture trees may lack it
                    deadline = time.monotonic() + self.freeze_timeout_s
                    while _events(events).get("frozen") != ("1" if frozen else "0"):
                        if time.monotonic() > deadline:
                            return Outcome.failed(f"{events} does not report frozen={int(frozen)} "
                                                  f"{self.freeze_timeout_s:g}s after writing cgroup.freeze",
                                                  temporary=True)
                        time.sleep(0.01)
        except _WriteFailed as e:
            return Outcome.failed(str(e), temporary=e.temporary)
        except OSError as e:
            return Outcome.failed(f"cannot read freezer state of {container!r}: {e}",
                                  temporary=e.errno in _TEMPORARY_ERRNOS)
        return Outcome.applied("frozen" if frozen else "thawed")


def _cpuset_dirs_v1(layout: CgroupLayout, container: str) -> Path:
    """``cpuset/<prefix>/<c>``, each level's cpus and mems filled from its parent (v1 needs them set)."""
    root = layout.controller_root("cpuset")
    parent = root
    for part in [*layout.prefix.split("/"), layout.check_name(container)]:
        d = parent / part
        d.mkdir(exist_ok=True)
        for f in ("cpuset.cpus", "cpuset.mems"):
            if not _read(d / f).strip():
                _write(d / f, _read(parent / f).strip(), f)
        parent = d
    return parent


def _cpuset_dir_v2(layout: CgroupLayout, container: str) -> Path:
    parent = layout.root
    for part in [*layout.prefix.split("/"), layout.check_name(container)]:
        sub = parent / "cgroup.subtree_control"
        if "cpuset" not in _read(sub).split():
            _write(sub, "+cpuset", "cgroup.subtree_control")
        parent = parent / part
        parent.mkdir(exist_ok=True)
    return parent


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it exited in between


def _read(path: Path) -> str:
    with open(path) as fh:
        return fh.read()


def _read_int(path: Path) -> int:
    try:
        return int(_read(path).strip())
    except (OSError, ValueError) as e:
        raise _WriteFailed(f"cannot read {path}: {e}", isinstance(e, OSError) and e.errno in _TEMPORARY_ERRNOS) from e


def _events(path: Path) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in _read(path).splitlines() if " " in line)


def _write(path: Path, value: str, what: str) -> None:
    """One write(2) of *value* into a cgroup file; OS errors become classified failures."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # O_TRUNC: a no-op on cgroupfs
    except OSError as e:
        gone = e.errno == errno.ENOENT
        raise _WriteFailed(
            f"cannot open {path} to set {what}: {e.strerror}" + (" (container gone?)" if gone else ""),
            e.errno in _TEMPORARY_ERRNOS,
        ) from e
    try:
        os.write(fd, value.encode())
    except OSError as e:
        code = errno.errorcode.get(e.errno, e.errno)
        raise _WriteFailed(f"kernel refused {what} {value!r} in {path}: {e.strerror} ({code})",
                           e.errno in _TEMPORARY_ERRNOS) from e
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- dry run


class DryRunBackend:
    """Applies nothing: records and logs each command and reports it applied.

    *usage* reads a container's memory working set (e.g. a real cgroup
    backend's ``memory_usage``, so a dry run on a live host checks the real
    floors); without it usage is unknown and memory limits are dropped by the
    safety rules. *exists* says whether a container exists (the actuator
    passes the cgroup tree's, when there is one, so a missing container is
    rejected as the cgroup backend rejects it); without it every container
    with a managed name counts as existing. A name that is not a managed
    container's never exists.
    """

    name = "dry-run"

    def __init__(self, *, usage: Callable[[str], float | None] | None = None,
                 exists: Callable[[str], bool] | None = None, jobs: JobRuntime | None = None) -> None:
        self._usage = usage
        self._exists = exists
        #: how the cgroup backend would start jobs (``actuator_start_jobs``), for the description
        self.jobs = jobs
        self.commands: list[Command] = []

    def exists(self, container: str) -> bool:
        if not is_container_name(container):
            return False
        return True if self._exists is None else bool(self._exists(container))

    def memory_usage(self, container: str) -> float | None:
        return None if self._usage is None else self._usage(container)

    def apply(self, command: Command) -> Outcome:
        self.commands.append(command)
        log.info("dry run: would apply %r", command)
        if isinstance(command, SetLimits):
            return Outcome.applied("dry run: nothing written", cpu_cores=command.cpu_cores,
                                   mem_bytes=command.mem_bytes)
        if isinstance(command, Terminate):
            how = (f"SIGTERM, then SIGKILL after {command.grace_s:g} s" if command.sigterm and command.grace_s > 0
                   else f"SIGKILL after {command.grace_s:g} s (the job is checkpointing)" if command.grace_s > 0
                   else "SIGKILL at once")
            return Outcome.applied(f"dry run: would stop every process of {command.container!r}: {how}")
        if isinstance(command, StartJob):
            where = command.cpus or "of its container"
            head = (f"dry run: would {'resume' if command.resume else 'start'} {list(command.argv)} in cpuset {where}"
                    + (f" with GPUs {list(command.gpus)}" if command.gpus else ""))
            limits = [x for x in (None if command.cpu_cores is None else f"cpu {command.cpu_cores:g} cores",
                                  None if command.mem_bytes is None else f"memory {command.mem_bytes} bytes") if x]
            if self.jobs is None:
                return Outcome.applied(head + (f", limits {', '.join(limits)}" if limits else ""))
            rt = self.jobs
            return Outcome.applied(
                f"{head} as {rt.who()}, no supplementary groups, no_new_privs, no core dumps; working directory "
                f"{rt.workdir(command.container)}, log {rt.log_path(command.container)}; environment "
                f"{', '.join(sorted(rt.environment(command)))} (nothing else)"
                + (f"; limits {', '.join(limits)}" if limits else ""))
        if isinstance(command, SetCpuWeight):
            return Outcome.applied(f"dry run: would set cpu.weight {command.weight} (cgroup v1: cpu.shares "
                                   f"{shares_of_weight(command.weight)})")
        return Outcome.applied(f"dry run: would {type(command).__name__.lower()}")
