"""Which model snapshot a worker's detectors decide with, so that a restart decides as an unkilled worker did.

The detectors of a worker used to swap to a newer snapshot between any two messages: when the
snapshot arrived, in wall time. A worker killed and restarted reads again the samples its stored
states do not hold, and decided them with whatever snapshot was newest then. :class:`ModelPin` makes
the swap points part of the committed state instead:

- the detectors swap only at an offset commit (a *checkpoint*): the commit that swaps hands out every
  container's state that holds a sample not yet stored, so every sample decided with the older model
  is held by a stored state, and a restarted worker skips it (``StateCache.unlearned``);
- the version in force after that commit is written with it, one record per samples partition
  (:data:`RECORD_PREFIX` + partition, in the phase table), delivered before the offsets are committed;
- a worker given partitions starts on the version recorded for them (:meth:`ModelPin.assigned`), and
  swaps no further until it has processed every record that was in those partitions when it got them
  (the *fence*: the killed worker cannot have decided anything past them, and it decided everything up to
  them with the recorded version).

Pure: the streams layer (:mod:`phasewise.streams.agents.phases`) feeds it the assignment, the records,
the partitions' ends and each processed offset, and asks it at every commit. Narrative: docs/worker.md,
"Exact recovery across model snapshots".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RECORD_PREFIX", "CommitPlan", "ModelPin", "record_key", "record_value", "recorded_version"]

log = logging.getLogger(__name__)

#: the phase table key of a samples partition's record (no "/": never a container's ``host/container`` key)
RECORD_PREFIX = "model-in-force@"


def record_key(partition: int) -> str:
    return f"{RECORD_PREFIX}{int(partition)}"


def record_value(version: int) -> bytes:
    """The record of the model version in force from a checkpoint on (compact JSON, as the states are)."""
    return json.dumps({"model_version": int(version)}, separators=(",", ":")).encode()


def recorded_version(raw: Any) -> int | None:
    """The version a stored record names (None: no record, or one that is not a record of this kind)."""
    try:
        got = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
        v = got["model_version"]
    except (ValueError, TypeError, KeyError):
        return None
    return v if type(v) is int and v >= 0 else None


@dataclass
class CommitPlan:
    """What one commit does: swap to the newer snapshot (after handing out every unwritten state), and
    the records to write (partition -> version in force)."""

    swap: bool = False
    records: dict[int, int] = field(default_factory=dict)


class ModelPin:
    """The model version a worker's detectors are pinned to, its records and its fence (see the module)."""

    def __init__(self, version: int = 0) -> None:
        #: the version the detectors decide with
        self.version = int(version)
        #: per assigned samples partition, the version its record names (as written or as found)
        self.recorded: dict[int, int | None] = {}
        #: per assigned partition, the end offset when it was assigned (None: no fence, swaps are free)
        self.fence: dict[int, int] | None = None
        #: per assigned partition, the offset after the last record processed (or committed) since then
        self.done: dict[int, int] = {}
        #: counts for the metrics and the log: pins whose version was not available, partitions whose
        #: records named different versions
        self.unavailable = 0
        self.disagreed = 0

    def assigned(self, recorded: Mapping[int, int | None], ends: Mapping[int, int],
                 committed: Mapping[int, int | None], available: Iterable[int]) -> int | None:
        """Partitions were assigned: *recorded* the version each one's record names (None: none),
        *ends* their end offsets now, *committed* their committed offsets (None: none). Returns the version
        to decide with from here (None: keep the current one): the recorded one, the newest of them where
        they differ (the others' samples read again are decided with it: not exact for them), if
        *available* holds it. Swaps wait until every partition has been processed to its end (the fence)."""
        self.recorded = dict(recorded)
        self.done = {p: int(o) for p, o in committed.items() if o is not None}
        named = {v for v in recorded.values() if v is not None}
        # no record: no worker decided these partitions with a recorded version (a first start), nothing to fence
        self.fence = {p: int(e) for p, e in ends.items()} if named else None
        if not named:
            return None
        want = max(named)
        if len(named) > 1:
            self.disagreed += 1
            log.warning("the assigned partitions were decided with model versions %s: deciding their samples "
                        "read again with v%d (those of the others may differ from what was published)",
                        sorted(named), want)
        if want == self.version:
            return None
        if want not in set(available):
            self.unavailable += 1
            log.warning("model v%d, in force when these partitions were last committed, is no longer on the "
                        "models topic: deciding with v%d (samples read again may be decided differently)",
                        want, self.version)
            return None
        self.version = want
        return want

    def processed(self, partition: int, offset: int) -> None:
        """A record of *partition* at *offset* was processed."""
        if offset + 1 > self.done.get(partition, -1):
            self.done[partition] = offset + 1

    def fenced(self) -> bool:
        """Whether swaps still wait (some partition not yet processed to its end at assignment)."""
        fence = self.fence
        if fence is None:
            return False
        if all(self.done.get(p, 0) >= end for p, end in fence.items()):
            self.fence = None
            return False
        return True

    def at_commit(self, newer: int | None) -> CommitPlan:
        """The plan of a commit; *newer*: the version of a newer snapshot available (None: none). Swaps
        when one is and no fence holds; records every assigned partition whose record does not name the
        version in force from this commit on."""
        plan = CommitPlan()
        if newer is not None and newer > self.version and not self.fenced():
            plan.swap = True
            self.version = int(newer)
        for p, v in self.recorded.items():
            if v != self.version:
                plan.records[p] = self.version
        self.recorded.update(plan.records)
        return plan

    def clear(self) -> None:
        """Partitions were revoked: no records, no fence until the next assignment."""
        self.recorded, self.fence, self.done = {}, None, {}
