"""The cgroup backend: limits, CPU weight, freezer, terminate and started jobs, in cgroup v1 or v2 files.

:class:`CgroupBackend` writes each command into the managed container's own
cgroup files (one ``write(2)`` each, read back) and classifies what the
kernel refuses as a temporary or permanent failure. Which file each command
writes, how a weight becomes v1 ``cpu.shares`` and how a ``Terminate`` stops
every process race-free: docs/operations.md, "Backends".
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from phasewise.actuators.backends.job_watch import ExitStatus, ExitWatcher, proc_identity, proc_start
from phasewise.actuators.backends.started_jobs import JobExit, JobRefused, JobRuntime, child_setup, job_files
from phasewise.actuators.commands import Command, Freeze, Outcome, SetCpuWeight, SetLimits, StartJob, Terminate, Thaw
from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout

__all__ = ["CFS_PERIOD_US", "MIN_QUOTA_US", "CgroupBackend", "quota_us", "shares_of_weight", "weight_of_shares"]

log = logging.getLogger(__name__)

CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000
_TEMPORARY_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.ENOMEM, errno.EBUSY}


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
        self.processes: dict[str, subprocess.Popen] = {}  # jobs started here, until they end
        #: called on the watcher's thread with each watched job's end (the actuator's report)
        self.on_exit: Callable[[JobExit], None] = lambda e: None
        self._watcher: ExitWatcher | None = None
        #: what a start recorded of each job process: ``(pid, /proc starttime, OOM kills at its start)``
        self._identity: dict[str, tuple[int, int | None, int | None]] = {}

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

    # ------------------------------------------------------------------ watching the jobs end (job_watch.py)

    def oom_kills(self, container: str) -> int | None:
        """How many processes the kernel's OOM killer killed in the container's memory cgroup so far
        (v1 ``memory.oom_control``, v2 ``memory.events``: ``oom_kill``); ``None``: not readable."""
        f = "memory.oom_control" if self.layout.version == 1 else "memory.events"
        try:
            text = _read(self.layout.path(container, "memory") / f)
        except (OSError, CgroupError):
            return None
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                try:
                    return int(v)
                except ValueError:
                    return None
        return None  # a kernel before 4.13 has no oom_kill count

    def identity(self, container: str) -> tuple[int, int | None, int | None] | None:
        """``(pid, /proc starttime, OOM kills at its start)`` of the job this backend last started in
        *container* (for the registry: a restarted actuator finds the same process again)."""
        return self._identity.get(container)

    def watching(self) -> list[str]:
        """The containers whose job process is watched now."""
        return [] if self._watcher is None else self._watcher.keys()

    def _watch(self) -> ExitWatcher:
        if self._watcher is None:
            self._watcher = ExitWatcher(self._ended)
        return self._watcher

    def adopt(self, container: str, pid: int, starttime: int | None, oom_base: int | None) -> str | None:
        """Watch again a job process a previous actuator started (it is no longer this one's child):
        ``None`` when it runs and is watched, else why not (it ended, or the pid is another process's)."""
        def in_cgroup(p: int) -> bool:
            try:
                return p in self._pids(container)
            except (OSError, CgroupError):
                return False

        why = self._watch().adopt(container, pid, starttime, data=oom_base, check=in_cgroup)
        if why is None:
            self._identity[container] = (pid, starttime, oom_base)
        return why

    def ended_while_away(self, container: str, pid: int, starttime: int | None, oom_base: int | None) -> JobExit:
        """What is known of a job process that ended while no actuator watched it: its exit status if it
        is still an unreaped zombie (the same process: its start time), whether it was OOM-killed."""
        status = ExitStatus()
        ident = proc_identity(pid)
        if ident is not None and ident[0] == "Z" and starttime is not None and ident[1] == starttime:
            status = ExitStatus.of_wait_status(ident[2], "zombie")
        return self._exit_of(container, pid, status, oom_base, time.time())

    def cgroup_of(self, container: str) -> str | None:
        """The container's cgroup as a path below the cgroup mount (v1: in each hierarchy), for ``started``."""
        try:
            return str(self.layout.path(container, "cpu").relative_to(self.layout.controller_root("cpu")))
        except (CgroupError, ValueError):
            return None

    def _exit_of(self, container: str, pid: int, status: ExitStatus, oom_base: int | None,
                 ended: float) -> JobExit:
        now = self.oom_kills(container)
        oom = now is not None and now > (oom_base or 0)
        return JobExit(container, pid, status.exit_code, status.signal, oom, status.source, ended,
                       oom_kills=None if now is None else now - (oom_base or 0))

    def _ended(self, container: str, pid: int, status: ExitStatus, oom_base: object, ended: float) -> None:
        """The watcher's report of an exit: the process is forgotten, then the end handed on."""
        if self.processes.get(container) is not None and self.processes[container].pid == pid:
            del self.processes[container]
        e = self._exit_of(container, pid, status, oom_base if isinstance(oom_base, int) else None, ended)
        self.on_exit(e)

    def close(self) -> None:
        """Stop watching the jobs (they run on; a restarted actuator finds them again)."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None

    def _wait_empty(self, container: str, seconds: float) -> set[int]:
        """Wait up to *seconds* for the container to hold no process; the pids still there."""
        deadline = time.monotonic() + seconds
        while True:
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

    def remove_container(self, container: str, timeout_s: float = 2.0) -> str | None:
        """Remove an ended job's container: its cgroups and (v1) the cpuset slice its start made. ``None``
        once gone (or never there), else why it stays (a process still in it, a cgroup still busy)."""
        try:
            left = self._pids(container)
            if left:
                return f"{len(left)} process(es) still in it: {sorted(left)[:5]}"
            self.layout.remove(container, timeout_s)
            if self.layout.version == 1:
                d = self.layout.path(container, "cpuset")
                if d.exists():
                    d.rmdir()
        except (OSError, CgroupError) as e:
            return str(e)
        self._identity.pop(container, None)
        return None

    # ------------------------------------------------------------------ started jobs (started_jobs.py: the child)

    def _start(self, cmd: StartJob) -> Outcome:
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
            work_fd, log_fd = job_files(rt, c)
        except JobRefused as e:
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
        oom_base = self.oom_kills(c)  # a resumed job's container counts its earlier kills too
        err_r, err_w = os.pipe()
        try:
            setup = child_setup([str(p) for p in procs], work_fd, rt.uid, rt.gid, os.geteuid() == 0, err_w)
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
        self._identity[c] = (proc.pid, proc_start(proc.pid), oom_base)
        try:
            self._watch().watch_child(c, proc, data=oom_base)
        except (OSError, RuntimeError) as e:  # it runs: started, not failed; its end is found at the next start
            log.error("job %s (pid %d) started but its end cannot be watched: %s", c, proc.pid, e)
        return Outcome.applied(f"{'resumed' if cmd.resume else 'started'} pid {proc.pid} as {rt.who()} in cpuset "
                               f"{cpus}" + (" (its container again)" if reused else "")
                               + (f" with GPUs {list(cmd.gpus)}" if cmd.gpus else "")
                               + (f", limits {', '.join(limits)}" if limits else ""), pid=proc.pid)

    # ------------------------------------------------------------------ freezer

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

