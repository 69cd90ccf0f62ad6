"""Which model snapshot a worker's detectors decide with, so that a restart decides as an unkilled worker did.

The detectors of a worker used to swap to a newer snapshot between any two messages: when the
snapshot arrived, in wall time. A worker killed and restarted reads again the samples its stored
states do not hold, and decided them with whatever snapshot was newest then. :class:`ModelPin` makes
the swap points part of the committed state instead:

- the detectors swap only at an offset commit (a *checkpoint*), and each samples partition's record
  (:data:`RECORD_PREFIX` + partition, in the phase table, delivered before the offsets are committed)
  keeps its *history*: from which offset on each version decided its samples, back to the offset last
  committed (the samples a restart reads again start there or later);
- a worker given partitions decides each sample it reads again with the version its partition's history
  names for that offset (:meth:`ModelPin.version_at`; the samples agent steps a round per version), until
  it has processed every record the partitions held when it got them (the *fence*: the killed worker
  decided nothing past them); from there it decides with one version, swapped at its commits.

No state is written at a swap: the history says which samples each version decided, so the states
stay written at their own interval. Pure: the streams layer (:mod:`phasewise.streams.agents.phases`)
feeds it the assignment, the records, the partitions' ends and each processed offset, and asks it at
every commit. Narrative: docs/worker.md, "Exact recovery across model snapshots".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RECORD_PREFIX", "CommitPlan", "History", "ModelPin", "record_key", "record_value", "recorded_history",
           "version_in"]

log = logging.getLogger(__name__)

#: the phase table key of a samples partition's record (no "/": never a container's ``host/container`` key)
RECORD_PREFIX = "model-in-force@"

#: a partition's history: ``(from_offset, version)``, offsets rising; a version decides from its offset to the next
History = list[tuple[int, int]]


def record_key(partition: int) -> str:
    return f"{RECORD_PREFIX}{int(partition)}"


def record_value(history: History) -> bytes:
    """The record of a partition's *history*: compact JSON, ``{"model_version": <the last>, "since": [[offset,
    version], ...]}``."""
    return json.dumps({"model_version": history[-1][1], "since": [[int(o), int(v)] for o, v in history]},
                      separators=(",", ":")).encode()


def recorded_history(raw: Any) -> History | None:
    """The history a stored record holds (None: no record, or one that is not a record of this kind). A
    record with a version only (written before histories) is that version from offset 0."""
    try:
        got = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
        v = got["model_version"]
        since = got.get("since")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, MemoryError):
        return None  # (a 100,000-deep array, binary, not an object: no record)
    if type(v) is not int or v < 0:
        return None
    if since is None:
        return [(0, v)]
    try:
        h = [(o, w) for o, w in since]
    except (TypeError, ValueError):
        return None
    if not h or any(type(o) is not int or type(w) is not int or o < 0 or w < 0 for o, w in h) or \
            any(b[0] < a[0] for a, b in zip(h, h[1:])) or h[-1][1] != v:
        return None
    return h


def version_in(history: History, offset: int) -> int:
    """The version *history* names for *offset* (the first entry's before it begins)."""
    v = history[0][1]
    for o, w in history:
        if o > offset:
            break
        v = w
    return v


@dataclass
class CommitPlan:
    """What one commit does: swap to the newer snapshot, and the records to write (partition -> history)."""

    swap: bool = False
    records: dict[int, History] = field(default_factory=dict)


class ModelPin:
    """The model versions a worker's detectors decide with, its records and its fence (see the module)."""

    def __init__(self, version: int = 0) -> None:
        #: the version the detectors decide with outside the fence (kept by the caller as it swaps)
        self.version = int(version)
        #: per assigned samples partition, its history (as found, then as this worker extends it)
        self.history: dict[int, History] = {}
        #: per assigned partition, the end offset when it was assigned (None: no fence)
        self.fence: dict[int, int] | None = None
        #: per assigned partition, the offset after the last record processed (or committed)
        self.done: dict[int, int] = {}
        #: per assigned partition, the offset its history starts at when it has none (the committed one)
        self._start: dict[int, int] = {}
        self._changed: set[int] = set()
        #: versions a history named that were not available (decided with the version in use instead)
        self.unavailable = 0
        self._available: set[int] = set()

    def assigned(self, histories: Mapping[int, History | None], ends: Mapping[int, int],
                 committed: Mapping[int, int | None], available: Iterable[int]) -> set[int]:
        """Partitions were assigned: *histories* their records' (None: none), *ends* their end offsets now,
        *committed* their committed offsets (None: none), *available* the versions the caller can decide
        with. Returns the versions the histories name from the committed offsets on that are not available
        (their samples read again are decided with the version in use: not exact for them). Until every
        partition has been processed to its end (the fence), :meth:`version_at` names each sample's version."""
        self.done = {p: int(o) for p, o in committed.items() if o is not None}
        self._start = {p: int(committed.get(p) or 0) for p in ends}
        self.history = {p: list(h) for p, h in histories.items() if h}
        self._changed = set()
        for p in list(self.history):  # only what a restart reads again matters
            self._prune(p, self._start.get(p, 0))
        self.fence = {p: int(e) for p, e in ends.items()} if self.history else None
        self._available = set(available)
        needed = {v for h in self.history.values() for _, v in h}
        missing = needed - self._available
        if missing:
            self.unavailable += 1
            log.warning("model version(s) %s, in force when these partitions were last committed, are no longer "
                        "on the models topic: deciding their samples read again with v%d (they may be decided "
                        "differently)", sorted(missing), self.version)
        return missing

    def version_at(self, partition: int, offset: int) -> int:
        """The version to decide a sample of *partition* at *offset* with: inside the fence, its history's
        (where available); else the version in use."""
        if self.fence is None:
            return self.version
        h = self.history.get(partition)
        if not h:
            return self.version
        v = version_in(h, offset)
        return v if v in self._available else self.version

    def processed(self, partition: int, offset: int) -> None:
        """A record of *partition* at *offset* was processed."""
        if offset + 1 > self.done.get(partition, -1):
            self.done[partition] = offset + 1

    def fenced(self) -> bool:
        """Whether some partition is not yet processed to its end at assignment (the next commit, once it is,
        goes on with the version in use)."""
        fence = self.fence
        if fence is not None and all(self.done.get(p, 0) >= end for p, end in fence.items()):
            self.fence = fence = None
        return fence is not None

    def _extend(self, partition: int, version: int) -> None:
        """*version* decides *partition*'s samples from the next one processed on."""
        h = self.history.setdefault(partition, [])
        if h and h[-1][1] == version:
            return
        self._changed.add(partition)
        if not h:  # a first record: this worker decided everything since the offset it started at
            h.append((self._start.get(partition, 0), version))
            return
        at = max(self.done.get(partition, 0), h[-1][0])
        if h[-1][0] == at:  # nothing was decided with the last entry's version: it goes
            h.pop()
            if h and h[-1][1] == version:
                return
        h.append((at, version))

    def _prune(self, partition: int, committed: int) -> None:
        """Drop the entries no restart can need: those ending at or before the *committed* offset."""
        h = self.history.get(partition)
        if not h:
            return
        k = 0
        while k + 1 < len(h) and h[k + 1][0] <= committed:
            k += 1
        if k:
            del h[:k]
            self._changed.add(partition)

    def at_commit(self, newer: int | None, committed: Mapping[int, int | None] | None = None) -> CommitPlan:
        """The plan of a commit; *newer*: the version of a newer snapshot available (None: none); *committed*:
        the partitions' offsets committed so far (a restart reads again from there or later). Swaps when a
        newer version is available and no fence holds; every assigned partition whose history changed (a
        first record, a swap, entries no restart needs any more) is recorded."""
        plan = CommitPlan()
        if not self.fenced():
            for p in self._start:  # what decided the samples processed so far
                self._extend(p, self.version)
            if newer is not None and newer > self.version:
                plan.swap = True
                self.version = int(newer)
                for p in self._start:  # and from the next one on
                    self._extend(p, self.version)
        for p, o in (committed or {}).items():
            if o is not None and p in self.history:
                self._prune(p, int(o))
        for p in sorted(self._changed):
            if p in self.history and p in self._start:
                plan.records[p] = list(self.history[p])
        self._changed = set()
        return plan

    def clear(self) -> None:
        """Partitions were revoked: no histories, no fence until the next assignment."""
        self.history, self.fence, self.done, self._start, self._changed = {}, None, {}, {}, set()
        self._available = set()
