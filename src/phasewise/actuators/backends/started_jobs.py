"""Starting a job unprivileged: who it runs as (:class:`JobRuntime`), its files, and the child's setup.

The cgroup backend calls :func:`job_files` (the working directory and log,
opened without following links) and :func:`child_setup` (the ``preexec_fn``
that joins the job's cgroups, drops to the job user and sets
``no_new_privs``) for every ``StartJob``. What a started job can and cannot
do, and why each step is where it is: docs/security.md, "What a started job
can do".
"""

from __future__ import annotations

import ctypes
import errno
import grp
import os
import pwd
import resource
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasewise.actuators.commands import StartJob
from phasewise.kit.settings import parse_job_env

__all__ = ["JOB_PATH", "JobExit", "JobRefused", "JobRuntime", "JobSetupError", "child_setup", "job_files",
           "job_runtime"]


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


class JobRefused(Exception):
    """A job's working directory or log cannot be used safely (the message says why)."""


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, *, at: int | None, shown: Path, what: str) -> int:
    """Open directory *name* (relative to the directory fd *at*) without following a link in its place."""
    try:
        return os.open(name, _DIR, dir_fd=at)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise JobRefused(f"{what} {shown} is a symbolic link or not a directory: not followed") from None
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
        raise JobRefused(f"{what} {shown} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; "
                         f"it must be uid {owner}'s and writable by it alone: refused")
    os.fchmod(fd, mode)
    return fd


def job_files(rt: JobRuntime, container: str) -> tuple[int, int]:
    """(working directory fd, log fd) of a job about to start; :class:`JobRefused` where unsafe.

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
                    raise JobRefused(f"job log {rt.log_path(container)} is a symbolic link: "
                                     "not followed") from None
                raise
            st = os.fstat(log)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != me:
                raise JobRefused(f"job log {rt.log_path(container)} is not a plain file of this actuator's "
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
                raise JobRefused(f"working directory {rt.workdir(container)} exists and belongs to uid "
                                 f"{st.st_uid}, not to the job user {rt.user} (uid {rt.uid}): refused")
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


def child_setup(procs: list[str], work_fd: int, uid: int, gid: int, switch: bool, err_fd: int) -> Callable[[], None]:
    """The ``preexec_fn`` of a started job, run in the child between fork and exec.

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
class JobExit:
    """A started job's process has ended, and what is known of how.

    ``exit_code`` (it exited) or ``signal`` (the number of the signal that killed it); both ``None``:
    not known (it ended while no actuator watched it). ``oom``: the kernel's OOM killer killed a
    process in the job's memory cgroup during its run (``oom_kills`` of them; ``None``: the count
    could not be read). ``source``: where the status came from (``waited``, ``pidfd``, ``zombie``,
    ``unknown``; :class:`phasewise.actuators.backends.job_watch.ExitStatus`). ``ended``: when the end
    was seen (wall clock).
    """

    container: str
    pid: int
    exit_code: int | None
    signal: int | None
    oom: bool
    source: str
    ended: float
    oom_kills: int | None = None

    @property
    def known(self) -> bool:
        return self.exit_code is not None or self.signal is not None

    @property
    def returncode(self) -> int | None:
        """As ``subprocess`` reports it (``-N``: signal N); ``None``: not known."""
        return -self.signal if self.signal is not None else self.exit_code
