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

A ``StartJob`` (a placed job) creates the job's managed container in every
controller, binds it to its CPUs (v1: ``cpuset/<prefix>/<c>/cpuset.cpus``,
the prefix's own ``cpuset.cpus``/``cpuset.mems`` filled from its parent;
v2: ``<prefix>/<c>/cpuset.cpus`` with ``+cpuset`` enabled on the way) and
starts the command in it: the child moves itself into the cgroups before it
runs the command, so no instruction of the job runs outside its cpuset. GPUs
are passed as ``CUDA_VISIBLE_DEVICES``; output goes to ``<log dir>/<c>.log``.
A resumed job (``resume``: stopped by checkpoint-and-exit, started again so
that it resumes from its checkpoint) reuses its container when it is still
there and empty (its weight and, unless the command names CPUs, its cpuset
stay); a container that still holds a process is refused, so a job never
runs twice.

Errors never escape ``apply``: they come back as a ``failed`` outcome marked
``temporary`` when a retry may help (EAGAIN, EINTR, ENOMEM, a busy freezer)
and permanent otherwise (missing container, permission, invalid value). A v1
memory limit the kernel refuses because usage cannot be reclaimed under it
(EBUSY) is permanent: the kernel already tried to reclaim, so it is reported
at once, not retried.
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
from typing import Protocol, runtime_checkable

from phasewise.actuators.commands import Command, Freeze, Outcome, SetCpuWeight, SetLimits, StartJob, Terminate, Thaw
from phasewise.cgroupfs import CgroupError, CgroupLayout, is_container_name

__all__ = ["CFS_PERIOD_US", "MIN_QUOTA_US", "Backend", "CgroupBackend", "DryRunBackend", "shares_of_weight",
           "weight_of_shares"]

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
                 job_log_dir: str | os.PathLike | None = None, kill_wait_s: float = 5.0) -> None:
        self.layout = layout
        self.freeze_timeout_s = freeze_timeout_s
        self.kill_wait_s = kill_wait_s  #: how long processes get to vanish after SIGKILL
        self.name = f"cgroup-v{layout.version}"
        self.job_log_dir = Path(job_log_dir) if job_log_dir is not None else None
        self.processes: dict[str, subprocess.Popen] = {}  # jobs started here (reaped as they end)

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
        c = cmd.container
        reused = self.exists(c)
        if reused and not cmd.resume:
            return Outcome.failed(f"container {c!r} already exists: not started again")
        if reused:
            left = self._pids(c)
            if left:
                return Outcome.failed(f"container {c!r} still holds {len(left)} process(es): a stopped job is "
                                      "resumed once it has exited, never started twice")
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
        env = dict(os.environ)
        if cmd.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cmd.gpus)
        out: int | object = subprocess.DEVNULL
        if self.job_log_dir is not None:
            self.job_log_dir.mkdir(parents=True, exist_ok=True)
            out = os.open(self.job_log_dir / f"{c}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        paths = [str(p) for p in procs]

        def enter() -> None:  # in the child, before exec: join the job's cgroups
            pid = str(os.getpid()).encode()
            for path in paths:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

        try:
            proc = subprocess.Popen(list(cmd.argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                    start_new_session=True, preexec_fn=enter)  # noqa: PLW1509
        except (OSError, subprocess.SubprocessError) as e:
            if not reused:
                self.layout.remove(c)
                if self.layout.version == 1:
                    cs.rmdir()
            return Outcome.failed(f"cannot start {cmd.argv[0]!r} for {c!r}: {e}")
        finally:
            if isinstance(out, int):
                os.close(out)
        self.processes[c] = proc
        return Outcome.applied(f"{'resumed' if cmd.resume else 'started'} pid {proc.pid} in cpuset {cpus}"
                               + (" (its container again)" if reused else "")
                               + (f" with GPUs {list(cmd.gpus)}" if cmd.gpus else ""))

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
                 exists: Callable[[str], bool] | None = None) -> None:
        self._usage = usage
        self._exists = exists
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
            return Outcome.applied(f"dry run: would {'resume' if command.resume else 'start'} {list(command.argv)} "
                                   f"in cpuset {where}"
                                   + (f" with GPUs {list(command.gpus)}" if command.gpus else ""))
        if isinstance(command, SetCpuWeight):
            return Outcome.applied(f"dry run: would set cpu.weight {command.weight} (cgroup v1: cpu.shares "
                                   f"{shares_of_weight(command.weight)})")
        return Outcome.applied(f"dry run: would {type(command).__name__.lower()}")
