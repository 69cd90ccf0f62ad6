"""Watching started jobs end: one thread blocked in ``poll`` on their pidfds, woken by each exit.

:class:`ExitWatcher` holds a pidfd (``pidfd_open``) for every job process the
cgroup backend started, or found again after a restart, and reports each exit
once, with how it ended: for its own children the wait status
(``waitid(P_PIDFD, WNOWAIT)``, then reaped through their ``Popen``); for a
process it is not the parent of (a job started before a restart), the exit
status the kernel keeps for the pidfd (``PIDFD_GET_INFO``, Linux 6.15) or, while
the process is a zombie, ``/proc/<pid>/stat``'s ``exit_code``, else unknown.
No per-job loop, no polling: docs/jobs.md, "Actuator".
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ExitStatus", "ExitWatcher", "proc_identity", "signal_name"]

log = logging.getLogger(__name__)

#: ``PIDFD_GET_INFO`` (linux/pidfd.h): ``_IOWR(0xFF, 11, struct pidfd_info)``, its first 64 bytes
#: (``mask`` at 0, ``exit_code`` at 60); ``PIDFD_INFO_EXIT`` in the mask says the exit status is there
_PIDFD_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 1 << 3


def signal_name(n: int) -> str:
    """``SIGKILL`` for 9; real-time signals as ``SIGRTMIN+N``.

    >>> signal_name(9), signal_name(15), signal_name(signal.SIGRTMIN + 2)
    ('SIGKILL', 'SIGTERM', 'SIGRTMIN+2')
    """
    try:
        return signal.Signals(n).name
    except ValueError:
        if signal.SIGRTMIN < n <= signal.SIGRTMAX:
            return f"SIGRTMIN+{n - signal.SIGRTMIN}"
        return f"SIG{n}"


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a process ended: its exit code, or the signal that killed it; both ``None``: not known."""

    exit_code: int | None = None
    signal: int | None = None
    #: where the status came from: ``waited`` (its parent's wait), ``pidfd`` (the kernel's pidfd exit
    #: information), ``zombie`` (/proc/<pid>/stat of the unreaped process), ``unknown``
    source: str = "unknown"

    @property
    def known(self) -> bool:
        return self.exit_code is not None or self.signal is not None

    @classmethod
    def of_wait_status(cls, status: int, source: str) -> ExitStatus:
        """From a ``waitpid``-style status word."""
        if os.WIFSIGNALED(status):
            return cls(None, os.WTERMSIG(status), source)
        if os.WIFEXITED(status):
            return cls(os.WEXITSTATUS(status), None, source)
        return cls(source="unknown")

    @classmethod
    def of_returncode(cls, rc: int, source: str) -> ExitStatus:
        """From a ``subprocess`` return code (``-N``: signal N)."""
        return cls(None, -rc, source) if rc < 0 else cls(rc, None, source)

    @property
    def returncode(self) -> int | None:
        """As ``subprocess`` reports it (``-N``: signal N); ``None``: not known."""
        if self.signal is not None:
            return -self.signal
        return self.exit_code


def proc_identity(pid: int) -> tuple[str, int, int] | None:
    """``(state, starttime, exit_code)`` of ``/proc/<pid>/stat`` (starttime in clock ticks since boot,
    exit_code the wait status of a zombie, 0 while it runs); ``None``: no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = text.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    try:
        return rest[0], int(rest[19]), int(rest[49]) if len(rest) > 49 else 0
    except (IndexError, ValueError):
        return None


def _pidfd_exit(fd: int) -> int | None:
    """The wait status the kernel keeps for a reaped process's pidfd (Linux >= 6.15), else ``None``."""
    buf = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("=Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(fd, _PIDFD_GET_INFO, buf, True)
    except OSError:
        return None  # an older kernel (ENOTTY, EINVAL), or gone without exit information (ESRCH)
    if not struct.unpack_from("=Q", buf, 0)[0] & _PIDFD_INFO_EXIT:
        return None  # not reaped yet: the kernel has no exit information for it
    return struct.unpack_from("=i", buf, 60)[0]


@dataclass
class _Watched:
    key: str
    pid: int
    fd: int
    proc: subprocess.Popen | None  #: the child's Popen, ``None``: a process this actuator is not the parent of
    starttime: int | None  #: /proc/<pid>/stat starttime, checked before trusting a zombie's exit code
    data: Any


class ExitWatcher:
    """One thread that reports each watched process's end once: ``on_exit(key, pid, status, data, ended)``.

    *on_exit* runs on the watcher's thread; an exception in it is logged and
    the watch goes on. ``ended`` is the wall-clock time the exit was seen.
    """

    def __init__(self, on_exit: Callable[[str, int, ExitStatus, Any, float], None], *,
                 clock: Callable[[], float] = time.time) -> None:
        self.on_exit = on_exit
        self.clock = clock
        self._lock = threading.Lock()
        self._by_fd: dict[int, _Watched] = {}
        self._added: list[_Watched] = []
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_fd) + len(self._added)

    def keys(self) -> list[str]:
        """The keys watched now."""
        with self._lock:
            return [w.key for w in (*self._by_fd.values(), *self._added)]

    def watch_child(self, key: str, proc: subprocess.Popen, data: Any = None) -> None:
        """Watch a child this process started (its exit status is waited for, then it is reaped)."""
        fd = os.pidfd_open(proc.pid)  # a child is not reaped until its Popen is polled: never ESRCH here
        self._add(_Watched(key, proc.pid, fd, proc, proc_start(proc.pid), data))

    def adopt(self, key: str, pid: int, starttime: int | None, data: Any = None,
              check: Callable[[int], bool] | None = None) -> str | None:
        """Watch a process this one did not start (found again after a restart); ``None`` when watched,
        else why not (it is gone, or *pid* now names another process).

        The pidfd is opened first and the process checked after (its ``starttime``, then *check*): a
        pidfd always names the process it was opened for, so a pid reused in between is caught.
        """
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return f"no process {pid}"
        except OSError as e:
            return f"cannot watch process {pid}: {e.strerror}"
        ident = proc_identity(pid)
        why = None
        if ident is None:
            why = f"no process {pid}"
        elif starttime is not None and ident[1] != starttime:
            why = f"pid {pid} names another process now (started at tick {ident[1]}, not {starttime})"
        elif ident[0] in ("Z", "X"):
            why = f"process {pid} has exited"
        elif check is not None and not check(pid):
            why = f"process {pid} is not in the job's cgroup any more"
        if why is not None:
            os.close(fd)
            return why
        self._add(_Watched(key, pid, fd, None, starttime, data))
        return None

    def _add(self, w: _Watched) -> None:
        with self._lock:
            if self._closed:
                os.close(w.fd)
                raise RuntimeError("the exit watcher is closed")
            self._added.append(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="phasewise-exit-watcher", daemon=True)
                self._thread.start()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # already woken

    def close(self) -> None:
        """Stop watching (the processes run on); the thread ends."""
        with self._lock:
            self._closed = True
            t = self._thread
        self._wake()
        if t is not None and t is not threading.current_thread():
            t.join(5)
        with self._lock:
            for w in (*self._by_fd.values(), *self._added):
                os.close(w.fd)
            self._by_fd.clear()
            self._added.clear()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        while True:
            with self._lock:
                if self._closed:
                    return
                for w in self._added:
                    self._by_fd[w.fd] = w
                    poller.register(w.fd, select.POLLIN)
                self._added.clear()
            try:
                ready = poller.poll()  # blocks until a watched process ends or a new one is added
            except InterruptedError:
                continue
            for fd, _ in ready:
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                with self._lock:
                    w = self._by_fd.pop(fd, None)
                if w is None:
                    continue
                poller.unregister(fd)
                try:
                    status = self._status(w)
                except Exception:  # noqa: BLE001 - the end is still reported, its status unknown
                    log.exception("reading the exit status of %s (pid %d) failed", w.key, w.pid)
                    status = ExitStatus()
                finally:
                    os.close(fd)
                try:
                    self.on_exit(w.key, w.pid, status, w.data, self.clock())
                except Exception:  # noqa: BLE001 - one report's failure must not end the watch of the others
                    log.exception("reporting the end of %s (pid %d) failed", w.key, w.pid)

    def _status(self, w: _Watched) -> ExitStatus:
        if w.proc is not None:
            return _child_status(w)
        st = _pidfd_exit(w.fd)
        if st is not None:
            return ExitStatus.of_wait_status(st, "pidfd")
        ident = proc_identity(w.pid)
        if ident is not None and ident[0] == "Z" and (w.starttime is None or ident[1] == w.starttime):
            return ExitStatus.of_wait_status(ident[2], "zombie")
        st = _pidfd_exit(w.fd)  # reaped meanwhile
        return ExitStatus.of_wait_status(st, "pidfd") if st is not None else ExitStatus()


def proc_start(pid: int) -> int | None:
    """The process's ``starttime`` (clock ticks since boot), ``None`` if it is gone."""
    ident = proc_identity(pid)
    return None if ident is None else ident[1]


def _child_status(w: _Watched) -> ExitStatus:
    """A child's status without reaping it (``WNOWAIT``), then reaped through its ``Popen`` (whose lock
    keeps a concurrent ``Popen.wait`` consistent)."""
    assert w.proc is not None
    try:
        si = os.waitid(os.P_PIDFD, w.fd, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped by its Popen already (someone waited on it)
        rc = w.proc.wait()
        return ExitStatus.of_returncode(rc, "waited")
    except OSError as e:
        if e.errno != errno.EINTR:
            log.warning("waitid on pid %d: %s", w.pid, e)
        rc = w.proc.wait()
        return ExitStatus.of_returncode(rc, "waited")
    w.proc.poll()  # reap it
    if si is None:
        return ExitStatus.of_returncode(w.proc.wait(), "waited")
    if si.si_code == os.CLD_EXITED:
        return ExitStatus(si.si_status, None, "waited")
    return ExitStatus(None, si.si_status, "waited")  # CLD_KILLED, CLD_DUMPED
