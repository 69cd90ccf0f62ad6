"""Subprocesses of the demo, the benchmarks, replay and the tests: :class:`ManagedProcess`, :class:`RoleProcess`.

Each runs in its own session with its output in a log file; ``stop`` ends the whole process group
and reaps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ManagedProcess", "RoleProcess", "session_pids"]

log = logging.getLogger(__name__)


def session_pids(sid: int, proc_root: str = "/proc") -> list[int]:
    """Pids of live (non-zombie) processes in session *sid*."""
    out = []
    for d in os.listdir(proc_root):
        if not d.isdigit():
            continue
        try:
            with open(f"{proc_root}/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # fields after the ")" closing the command name: state ppid pgrp session ...
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) >= 4 and rest[0] != "Z" and int(rest[3]) == sid:
            out.append(int(d))
    return out


class ManagedProcess:
    """*cmd* in a subprocess of its own session, stdin closed, stdout and stderr in *log_path*.

    *env* is the whole environment of the process. *append*: add to the log
    (a restarted process keeps its earlier lines) instead of starting it afresh.
    ``stop`` signals the whole process group (SIGTERM, then SIGKILL after
    *timeout_s*) and reaps it; :meth:`leftovers` lists any process of its
    sessions still alive.
    """

    def __init__(self, name: str, cmd: Sequence[str], *, env: dict[str, str], log_path: Path,
                 cwd: str | None = None, append: bool = False) -> None:
        self.name, self.cmd, self.env, self.log_path, self.cwd = name, list(cmd), env, log_path, cwd
        self.append = append
        self.proc: subprocess.Popen | None = None
        self._log: Any = None
        self.sids: list[int] = []

    def start(self) -> ManagedProcess:
        self._log = open(self.log_path, "ab" if self.append else "wb")  # noqa: SIM115 - open while it runs
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.cwd)
        self.sids.append(self.proc.pid)  # a new session's id is its leader's pid
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM the process group without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        p = self.proc
        if p is None:
            return None
        self.terminate()
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs of SIGTERM; killing it", self.name, timeout_s)
        # kill whatever is left of the group (also children of a leader that exited)
        for sid in self.sids:
            if session_pids(sid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(sid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
        # killed processes that are not our children vanish a moment later: wait for that
        deadline = time.monotonic() + 5
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._log:
            self._log.close()
            self._log = None
        return p.returncode

    def leftovers(self) -> list[int]:
        return [pid for sid in self.sids for pid in session_pids(sid)]

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class RoleProcess(ManagedProcess):
    """``phasewise <role> ...`` (``python -m phasewise.cli``) with this process's environment and *env*.

    *python_flags* go to the interpreter (e.g. ``("-W", "ignore")``).
    """

    def __init__(self, role: str, args: Iterable[str], *, env: dict[str, str], log_path: Path,
                 python_flags: Sequence[str] = (), append: bool = False) -> None:
        super().__init__(role, [sys.executable, *python_flags, "-m", "phasewise.cli", role, *args],
                         env={**os.environ, **env}, log_path=log_path, append=append)
