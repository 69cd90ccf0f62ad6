"""The actuator's ledger (SQLite, one file per host): which decision ids it handled, which containers it
terminated, the GPU shares held for jobs not started yet, and the registry of the jobs it started, kept
across restarts.

An id is *claimed* before it is applied and its outcome recorded after, so a
redelivered decision is applied at most once; the tables are bounded by age
and rows. A ledger this open created is *unverified* until
:func:`phasewise.actuators.ledger_loss.verify_ledger` checked it.
docs/operations.md, "The ledger"; docs/security.md, "A lost ledger".
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Entry", "Ledger", "StartedJob", "ledger_path"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    id        TEXT PRIMARY KEY,
    container TEXT NOT NULL,
    claimed   REAL NOT NULL,
    status    TEXT,          -- NULL while claimed but not finished
    message   TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS decisions_claimed ON decisions (claimed);
CREATE TABLE IF NOT EXISTS terminations (
    container TEXT PRIMARY KEY,
    decision  TEXT NOT NULL,
    at        REAL NOT NULL,
    resumable INTEGER NOT NULL DEFAULT 0  -- a checkpoint stop: its agent may resume the job in its container
);
CREATE TABLE IF NOT EXISTS ledger_state (
    key       TEXT PRIMARY KEY,  -- 'unverified': created empty here, not yet checked for a lost predecessor
    value     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    container   TEXT PRIMARY KEY,
    job         TEXT NOT NULL,
    spec_digest TEXT NOT NULL DEFAULT '',
    backend     TEXT NOT NULL,   -- a dry run's "start" owns nothing for a real backend
    decision    TEXT NOT NULL,   -- the place decision that started it (last)
    pid         INTEGER,         -- NULL: a dry run
    started     REAL NOT NULL,
    ended       REAL,            -- NULL while it runs (as far as this actuator knows)
    exit_status INTEGER,         -- the process's wait status as subprocess reports it (-N: signal N)
    proc_start  INTEGER,         -- /proc/<pid>/stat starttime: the same process, not a reused pid
    oom_base    INTEGER,         -- the memory cgroup's OOM kill count when it started
    end_event   BLOB,            -- the terminal job event (finished, failed, terminated), as published
    published   REAL             -- when end_event was handed to the producer (NULL: not yet)
);
CREATE TABLE IF NOT EXISTS held_shares (
    container TEXT PRIMARY KEY,  -- a job not started yet: its place decision starts it under this share
    decision  BLOB NOT NULL,     -- the share decision, as verified
    held      REAL NOT NULL
);
"""
#: columns added to ``jobs`` after it first shipped (a ledger from before gets them, empty)
_JOBS_ADDED = (("proc_start", "INTEGER"), ("oom_base", "INTEGER"), ("end_event", "BLOB"), ("published", "REAL"))
_JOB_COLUMNS = ("container, job, spec_digest, backend, decision, pid, started, ended, exit_status, proc_start, "
                "oom_base, end_event, published")


@dataclass(frozen=True, slots=True)
class Entry:
    id: str
    container: str
    claimed: float
    status: str | None
    message: str


@dataclass(frozen=True, slots=True)
class StartedJob:
    """A job container this actuator started (its registry row)."""

    container: str
    job: str
    spec_digest: str
    backend: str
    decision: str
    pid: int | None
    started: float
    ended: float | None
    exit_status: int | None
    proc_start: int | None = None
    oom_base: int | None = None
    #: the terminal job event decided for its end (encoded), and when it was published
    end_event: bytes | None = None
    published: float | None = None


def ledger_path(data_dir: str | os.PathLike, host: str) -> Path:
    """``<data_dir>/actuator-<host>.sqlite`` (host made file-name safe)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "_"
    return Path(data_dir) / f"actuator-{safe}.sqlite"


class Ledger:
    """Decision ids this actuator handled (docs/operations.md, "The ledger")."""

    def __init__(self, path: str | os.PathLike, *, max_age_s: float = 30 * 86400,
                 max_rows: int = 100_000, prune_every: int = 1000) -> None:
        if max_rows < 1 or max_age_s <= 0:
            raise ValueError("ledger bounds must be positive (max_rows >= 1, max_age_s > 0)")
        self.path = str(path)
        self.max_age_s = max_age_s
        self.max_rows = max_rows
        self.prune_every = prune_every
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False: the consumer thread owns it; tests may read it from another
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL" if self.path != ":memory:" else "PRAGMA journal_mode=MEMORY")
        self._db.execute("PRAGMA synchronous=NORMAL")
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'decisions'").fetchone() is None:
            # a new ledger: marked before the tables exist, so that no crash can leave it looking old
            self._db.execute("CREATE TABLE IF NOT EXISTS ledger_state (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute("INSERT OR IGNORE INTO ledger_state (key, value) VALUES ('unverified', ?)",
                             (repr(time.time()),))
        self._db.executescript(_SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
        for col, kind in _JOBS_ADDED:
            if col not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {col} {kind}")
        if "resumable" not in {r[1] for r in self._db.execute("PRAGMA table_info(terminations)")}:
            self._db.execute("ALTER TABLE terminations ADD COLUMN resumable INTEGER NOT NULL DEFAULT 0")
        self._claims = 0
        self.prune()

    def claim(self, decision_id: str, *, container: str, now: float | None = None) -> bool:
        """Record that *decision_id* is being handled; ``False`` if it already was."""
        now = time.time() if now is None else now
        cur = self._db.execute(
            "INSERT OR IGNORE INTO decisions (id, container, claimed) VALUES (?, ?, ?)",
            (decision_id, container, now),
        )
        claimed = cur.rowcount == 1
        if claimed:
            self._claims += 1
            if self._claims % self.prune_every == 0:
                self.prune(now)
        return claimed

    def finish(self, decision_id: str, status: str, message: str = "") -> None:
        """Record the outcome of a claimed decision."""
        cur = self._db.execute("UPDATE decisions SET status = ?, message = ? WHERE id = ?",
                               (status, message, decision_id))
        if cur.rowcount != 1:
            raise KeyError(f"decision {decision_id!r} was not claimed in the ledger")

    def get(self, decision_id: str) -> Entry | None:
        row = self._db.execute("SELECT id, container, claimed, status, message FROM decisions WHERE id = ?",
                               (decision_id,)).fetchone()
        return None if row is None else Entry(*row)

    @property
    def unverified(self) -> bool:
        """True from this ledger's creation until :meth:`verified`: it may replace a lost one."""
        return self._db.execute("SELECT 1 FROM ledger_state WHERE key = 'unverified'").fetchone() is not None

    def verified(self) -> None:
        """The ledger was checked (and restored where it replaced a lost one): clear the mark."""
        self._db.execute("DELETE FROM ledger_state WHERE key = 'unverified'")

    def restore(self, decision_id: str, *, container: str, claimed: float, status: str, message: str = "") -> bool:
        """Enter a decision handled before this ledger existed; ``False`` if the id is already there."""
        cur = self._db.execute(
            "INSERT OR IGNORE INTO decisions (id, container, claimed, status, message) VALUES (?, ?, ?, ?, ?)",
            (decision_id, container, claimed, status, message))
        return cur.rowcount == 1

    def terminated(self, container: str) -> tuple[str, float] | None:
        """``(decision id, time)`` of this actuator's termination of *container*, if any."""
        row = self._db.execute("SELECT decision, at FROM terminations WHERE container = ?", (container,)).fetchone()
        return None if row is None else (row[0], row[1])

    def record_termination(self, container: str, decision_id: str, now: float | None = None, *,
                           resumable: bool = False) -> None:
        """*container* was terminated by *decision_id* (*resumable*: a checkpoint stop, whose job its agent
        may resume in the container)."""
        self._db.execute("INSERT OR REPLACE INTO terminations (container, decision, at, resumable) "
                         "VALUES (?, ?, ?, ?)", (container, decision_id, time.time() if now is None else now,
                                                 int(resumable)))

    def resumable(self, container: str) -> bool:
        """Whether *container*'s termination (if any) was a checkpoint stop whose job may be resumed there."""
        row = self._db.execute("SELECT resumable FROM terminations WHERE container = ?", (container,)).fetchone()
        return row is not None and bool(row[0])

    def forget_termination(self, container: str) -> None:
        """*container* was started again: it may be terminated again."""
        self._db.execute("DELETE FROM terminations WHERE container = ?", (container,))

    # ------------------------------------------------------------------ GPU shares held for a start

    def hold_share(self, container: str, decision: bytes, *, most: int, now: float | None = None) -> None:
        """Keep *decision* (a verified ``share``) for *container*'s start, replacing an earlier one; at most
        *most* are held (the oldest beyond go)."""
        self._db.execute("INSERT OR REPLACE INTO held_shares (container, decision, held) VALUES (?, ?, ?)",
                         (container, decision, time.time() if now is None else now))
        self._db.execute("DELETE FROM held_shares WHERE container NOT IN "
                         "(SELECT container FROM held_shares ORDER BY held DESC LIMIT ?)", (most,))

    def take_share(self, container: str) -> bytes | None:
        """The share held for *container*'s start, no longer held (``None``: none)."""
        row = self._db.execute("SELECT decision FROM held_shares WHERE container = ?", (container,)).fetchone()
        if row is None:
            return None
        self._db.execute("DELETE FROM held_shares WHERE container = ?", (container,))
        return bytes(row[0])

    def held_shares(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM held_shares").fetchone()[0]

    # ------------------------------------------------------------------ the jobs it started

    def record_start(self, container: str, *, job: str, decision: str, backend: str, pid: int | None,
                     spec_digest: str = "", now: float | None = None, proc_start: int | None = None,
                     oom_base: int | None = None) -> None:
        """This actuator started *job* in *container* (a new start, or a resume: the row is replaced).

        *proc_start*: the process's ``/proc/<pid>/stat`` starttime (so that a restarted actuator tells
        it from a later process under the same pid); *oom_base*: its memory cgroup's OOM kill count then.
        """
        self._db.execute(
            "INSERT OR REPLACE INTO jobs (container, job, spec_digest, backend, decision, pid, started, ended, "
            "exit_status, proc_start, oom_base, end_event, published) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, ?, NULL, NULL)",
            (container, job, spec_digest, backend, decision, pid, time.time() if now is None else now,
             proc_start, oom_base))

    def started_job(self, container: str) -> StartedJob | None:
        """The registry row of *container*, if this actuator started a job in it."""
        row = self._db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE container = ?", (container,)).fetchone()
        return None if row is None else StartedJob(*row)

    def running_jobs(self, backend: str) -> list[StartedJob]:
        """The jobs *backend* started that have no recorded end (oldest first): a restarted actuator's
        to find again."""
        rows = self._db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE backend = ? AND ended IS NULL "
                                "ORDER BY started", (backend,)).fetchall()
        return [StartedJob(*r) for r in rows]

    def unpublished_ends(self) -> list[StartedJob]:
        """The jobs whose terminal event was decided but not published (an actuator stopped in between)."""
        rows = self._db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE end_event IS NOT NULL AND published "
                                "IS NULL ORDER BY ended").fetchall()
        return [StartedJob(*r) for r in rows]

    def record_end(self, container: str, *, pid: int | None = None, exit_status: int | None = None,
                   now: float | None = None, end_event: bytes | None = None) -> bool:
        """The job in *container* ended (its process *pid*, when given, exited with *exit_status*).

        ``False`` when there is no running job of that container (and pid) to end: an exit reported
        after a resume started a new process is not the new process's end. *end_event*: the terminal
        job event decided for it, to publish (:meth:`record_published` once it is).
        """
        sql = "UPDATE jobs SET ended = ?, exit_status = ?, end_event = ? WHERE container = ? AND ended IS NULL"
        args: tuple = (time.time() if now is None else now, exit_status, end_event, container)
        if pid is not None:
            sql += " AND pid = ?"
            args += (pid,)
        return self._db.execute(sql, args).rowcount == 1

    def record_published(self, container: str, *, pid: int | None, now: float | None = None) -> None:
        """The terminal event of *container*'s job (process *pid*) was handed to the producer."""
        self._db.execute("UPDATE jobs SET published = ? WHERE container = ? AND pid IS ? AND end_event IS NOT NULL",
                         (time.time() if now is None else now, container, pid))

    def __contains__(self, decision_id: str) -> bool:
        return self.get(decision_id) is not None

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]

    def prune(self, now: float | None = None) -> int:
        """Drop entries older than ``max_age_s`` and beyond the newest ``max_rows``; returns how many."""
        now = time.time() if now is None else now
        n = self._db.execute("DELETE FROM decisions WHERE claimed < ?", (now - self.max_age_s,)).rowcount
        self._db.execute("DELETE FROM terminations WHERE at < ?", (now - self.max_age_s,))
        self._db.execute("DELETE FROM held_shares WHERE held < ?", (now - self.max_age_s,))
        self._db.execute("DELETE FROM jobs WHERE ended IS NOT NULL AND ended < ? AND (end_event IS NULL OR "
                         "published IS NOT NULL)", (now - self.max_age_s,))
        n += self._db.execute(
            "DELETE FROM decisions WHERE id NOT IN "
            "(SELECT id FROM decisions ORDER BY claimed DESC LIMIT ?)", (self.max_rows,)
        ).rowcount
        return n

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
