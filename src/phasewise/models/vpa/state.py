"""The VPA worker's per-container state: :class:`StateCache` (the fleet's rows, what each container was last
decided, when its state was last written, which samples it has learned) and :class:`ContainerEntry`, one row's
view and its table value. :mod:`phasewise.models.vpa.updater` steps it; docs/vpa.md, "The updater: the worker's
step"."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from phasewise.kit.records import ExecutionProfile, HostSamples
from phasewise.models.arrays import count_true, grown, nan_to_none
from phasewise.models.priors.book import PriorBook
from phasewise.models.safety.guard import GuardConfig, LimitGuard
from phasewise.models.vpa.fleet import VpaFleet
from phasewise.models.vpa.recommender import VpaPolicy, VpaRecommender, VpaStateError

__all__ = ["ENTRY_VERSION", "ContainerEntry", "StateCache"]

log = logging.getLogger(__name__)

#: format of the table values (:meth:`ContainerEntry.to_state`)
ENTRY_VERSION = 1
_NAN = math.nan


def _num(v: Any, what: str) -> float:
    if v is None:
        return _NAN
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise VpaStateError(f"container state: {what} must be a number or null, got {v!r:.40}")
    return float(v)


class ContainerEntry:
    """One container of a :class:`StateCache`: a view of its row (live, not a copy).

    ``decided_cpu`` / ``decided_mem`` (the last limits this worker decided),
    ``next_ts`` (event time of the next recommendation) and ``written_ts``
    (of the last persisted state) read and write the cache's arrays;
    :attr:`model` and :attr:`policy` are exact snapshots of the container's
    recommender / policy (copies: changing them changes nothing here).
    """

    __slots__ = ("_cache", "key", "row")

    def __init__(self, cache: StateCache, key: str, row: int) -> None:
        self._cache = cache
        self.key = key
        self.row = row

    def _get(self, name: str) -> float | None:
        return nan_to_none(getattr(self._cache, name)[self.row])

    def _set(self, name: str, v: float | None) -> None:
        getattr(self._cache, name)[self.row] = _NAN if v is None else v

    decided_cpu = property(lambda self: self._get("_decided_cpu"), lambda self, v: self._set("_decided_cpu", v))
    decided_mem = property(lambda self: self._get("_decided_mem"), lambda self, v: self._set("_decided_mem", v))
    next_ts = property(lambda self: self._get("_next_ts"), lambda self, v: self._set("_next_ts", v))
    written_ts = property(lambda self: self._get("_written_ts"), lambda self, v: self._set("_written_ts", v))

    @property
    def model(self) -> VpaRecommender:
        """An exact copy of the container's recommender."""
        return self._cache.fleet.recommender(self.row)

    @property
    def policy(self) -> VpaPolicy:
        """An exact copy of the container's :class:`VpaPolicy` (its recommender and last limits)."""
        return self._cache.fleet.policy(self.row)

    def to_state(self) -> dict[str, Any]:
        """The table value: ``{"v", "vpa", "pl", "dc", "dm", "nx"}`` and, with the safety rules on, ``"g"``
        (:meth:`~phasewise.models.safety.guard.LimitGuard.state_of`)."""
        fleet = self._cache.fleet
        out = {"v": ENTRY_VERSION, "vpa": fleet.recommender_state(self.row), "pl": fleet.last_limits(self.row),
               "dc": self.decided_cpu, "dm": self.decided_mem, "nx": self.next_ts}
        if self._cache.guard is not None:
            out["g"] = self._cache.guard.state_of(self.row)
        start = self._get("_x_start")
        if start is not None:  # a signed run's profile so far
            out["x"] = [start, self._get("_x_n"), self._get("_x_cpu"), self._get("_x_mem")]
        so = self._get("_source_offset")
        if so is not None:
            out["so"] = int(so)
        return out

    def __repr__(self) -> str:
        return f"ContainerEntry({self.key!r}, decided_cpu={self.decided_cpu}, decided_mem={self.decided_mem})"


class StateCache:
    """Per-container state in memory (one :class:`VpaFleet` row each), loaded through *loader* on a miss.

    *loader* maps a key to a stored state (or ``None``); the worker passes its
    table's ``get``. Keys whose state changed enough to be persisted collect
    in :attr:`dirty`; :meth:`pop_dirty` hands them out once.
    """

    #: per row: ``_unwritten_from`` the source offset of the first sample learned since its state was last
    #: handed out (NaN: none), ``_unwritten_since`` when (the caller's clock), ``_source_partition`` its partition
    #: ``_x_start`` / ``_x_n`` / ``_x_cpu`` / ``_x_mem``: a signed run's first sample time, samples and peaks
    #: (its :class:`ExecutionProfile`), ``_x_pub`` when its next profile is handed out
    _BOOK = ("_decided_cpu", "_decided_mem", "_next_ts", "_written_ts", "_source_offset", "_unwritten_from",
             "_unwritten_since", "_source_partition", "_x_start", "_x_n", "_x_cpu", "_x_mem", "_x_pub")

    def __init__(self, params: dict[str, Any] | None = None,
                 loader: Callable[[str], Any] | None = None, guard: GuardConfig | None = None,
                 priors: PriorBook | None = None) -> None:
        self.params = dict(params or {})
        self.loader = loader
        self.fleet = VpaFleet(capacity=256, **self.params)
        #: the safety rules' per-container state, in the fleet's rows (None: rules off)
        self.guard = None if guard is None else LimitGuard(guard, self.fleet.capacity)
        self._index: dict[str, int] = {}
        self._free: list[int] = []  # rows of expired containers, reused first
        self._per_host: dict[str, int] = {}  # containers held per host (the key's part before its first "/")
        for name in self._BOOK:
            setattr(self, name, np.full(self.fleet.capacity, _NAN))
        self.dirty: set[str] = set()
        #: the signatures' earlier runs (None: no priors; no profiles are made either)
        self.priors = priors
        #: profiles of signed runs made by the step, for the caller to publish (:meth:`pop_profiles`)
        self.profiles: list[ExecutionProfile] = []
        self.loaded = 0  # entries restored through the loader
        self.load_errors = 0

    def _new_rows(self, keys: list[str]) -> None:
        """Rows for *keys* (distinct, none known yet): fresh, or loaded through the loader."""
        fleet = self.fleet
        reuse = [self._free.pop() for _ in range(min(len(keys), len(self._free)))]
        rows = np.array(reuse, dtype=np.intp)
        if reuse:
            fleet.reset_rows(rows)
        if len(keys) > len(reuse):
            rows = np.concatenate([rows, fleet.add_rows(len(keys) - len(reuse))])
        cap = fleet.capacity
        if len(self._decided_cpu) < cap:
            for name in self._BOOK:
                a = getattr(self, name)
                setattr(self, name, grown(a, cap - len(a), _NAN))
        for name in self._BOOK:
            getattr(self, name)[rows] = _NAN
        guard = self.guard
        if guard is not None:
            guard.ensure(cap)
            guard.reset(rows)
        for key, row in zip(keys, rows.tolist()):
            if self.loader is not None:
                try:
                    state = self.loader(key)
                    if state is not None:
                        self._load(row, state)
                        self.loaded += 1
                except (ValueError, TypeError) as err:  # VpaStateError, undecodable or foreign values
                    self.load_errors += 1
                    log.warning("discarding stored state of %s: %s", key, err)
                    fleet.reset_rows(np.array([row]))
                    for name in self._BOOK:
                        getattr(self, name)[row] = _NAN
                    if guard is not None:
                        guard.reset(np.array([row]))
            self._index[key] = row
            host = key.split("/", 1)[0]
            self._per_host[host] = self._per_host.get(host, 0) + 1

    def _load(self, row: int, state: Any) -> None:
        if not isinstance(state, dict) or state.get("v") != ENTRY_VERSION:
            raise VpaStateError(f"unsupported container state {str(state)[:80]!r}")
        if "vpa" not in state:
            raise VpaStateError("container state has no 'vpa' (recommender state)")
        book = [_num(state.get(k), k) for k in ("dc", "dm", "nx")]
        # "pl" (the policy's last limits) is absent from states written before the
        # worker ran VpaPolicy; the policy then starts with no last limits
        self.fleet.load_recommender_state(row, state["vpa"], state.get("pl") or {})
        self._decided_cpu[row], self._decided_mem[row], self._next_ts[row] = book
        self._source_offset[row] = _num(state.get("so"), "so")  # absent: written before source offsets
        # "g" (the safety rules' state) is absent from states written with the rules off or before
        # them: the rules then start afresh (no history yet, so nothing is lowered for a while)
        if self.guard is not None and state.get("g") is not None:
            self.guard.load(row, state["g"])
        x = state.get("x")  # a signed run's profile (absent: none, or written before priors)
        if x is not None:
            if not isinstance(x, list) or len(x) != 4:
                raise VpaStateError(f"container state: x must be a list of 4 numbers, got {x!r:.40}")
            self._x_start[row], self._x_n[row], self._x_cpu[row], self._x_mem[row] = (
                _num(v, "x") for v in x)

    def row(self, key: str) -> int:
        """The fleet row of *key* (created, or loaded through the loader, on a miss)."""
        r = self._index.get(key)
        if r is None:
            self._new_rows([key])
            r = self._index[key]
        return r

    def rows(self, keys: Sequence[str]) -> list[int]:
        """:meth:`row` of every key, in order."""
        get = self._index.get
        out = [get(k) for k in keys]
        if None in out:  # allocate the new ones together, in order (a key twice gets one row)
            self._new_rows(list(dict.fromkeys(k for k, r in zip(keys, out) if r is None)))
            out = [get(k) for k in keys]
        return out

    def get(self, key: str) -> ContainerEntry:
        return ContainerEntry(self, key, self.row(key))

    def decided_limits(self, keys: Sequence[str]) -> np.ndarray:
        """``(len(keys), 2)`` array of the decided CPU / memory limits (``NaN``: none yet).

        The vectorised form of ``get(key).decided_cpu`` / ``.decided_mem``
        (a miss creates or loads the entry, as :meth:`get` does).
        """
        rows = np.array(self.rows(keys), dtype=np.intp)
        return np.stack([self._decided_cpu[rows], self._decided_mem[rows]], axis=1)

    def state_of(self, key: str) -> dict[str, Any]:
        """The table value of *key* (see :meth:`ContainerEntry.to_state`)."""
        return ContainerEntry(self, key, self._index[key]).to_state()

    def pop_dirty(self, now: float | None = None, max_unwritten_s: float | None = None
                  ) -> list[tuple[str, dict[str, Any]]]:
        """The states to persist, once each: the containers marked, and (given *now* and *max_unwritten_s*)
        those holding samples learned more than *max_unwritten_s* ago and not persisted since (a container
        whose samples stopped is not marked by a sample again)."""
        idx = self._index
        if now is not None and max_unwritten_s is not None and idx:
            keys = list(idx)
            rows = np.fromiter(idx.values(), dtype=np.intp, count=len(keys))
            old = np.flatnonzero(self._unwritten_since[rows] <= now - max_unwritten_s)  # NaN: none
            self.dirty.update(keys[i] for i in old.tolist())
        out = []
        for k in self.dirty:
            r = idx.get(k)
            if r is None:
                continue
            out.append((k, ContainerEntry(self, k, r).to_state()))
            self._unwritten_from[r] = self._unwritten_since[r] = _NAN
        self.dirty.clear()
        return out

    def pop_profiles(self) -> list[ExecutionProfile]:
        """The profiles the step made since the last call, once each."""
        out, self.profiles = self.profiles, []
        return out

    def hold_back(self) -> dict[int, int]:
        """Per source partition, the offset of the oldest sample a held container learned and no state handed
        out by :meth:`pop_dirty` holds yet: committing no further than it, a worker killed now and restarted
        reads those samples again (and :meth:`unlearned` skips what a stored state holds), so it learns
        exactly what an unkilled one did. Partitions without such a sample are absent."""
        if not self._index:
            return {}
        rows = np.fromiter(self._index.values(), dtype=np.intp, count=len(self._index))
        uf, part = self._unwritten_from[rows], self._source_partition[rows]
        keep = ~np.isnan(uf) & ~np.isnan(part)
        if not count_true(keep):
            return {}
        out: dict[int, int] = {}
        for p, o in zip(part[keep].astype(np.int64).tolist(), uf[keep].astype(np.int64).tolist()):
            if p not in out or o < out[p]:
                out[p] = o
        return out

    def expire(self, before_ts: float) -> list[str]:
        """Forget every container whose newest sample is older than *before_ts* (event time).

        Returns their keys, so the caller deletes them from its table too. A
        container that never had a sample learned counts as expired. Their
        rows are reused for new containers; pending writes of them are dropped.
        """
        if not self._index:
            return []
        keys = list(self._index)
        rows = np.fromiter(self._index.values(), dtype=np.intp, count=len(keys))
        last = self.fleet.last_sample_time(rows)
        gone = np.flatnonzero(~(last >= before_ts))  # NaN (no sample) expires too
        out = [keys[i] for i in gone.tolist()]
        per_host = self._per_host
        for k in out:
            self._free.append(self._index.pop(k))
            self.dirty.discard(k)
            host = k.split("/", 1)[0]
            per_host[host] -= 1
            if not per_host[host]:
                del per_host[host]
        return out

    def forget(self, keys: Iterable[str]) -> list[str]:
        """Forget *keys* (evicted): their rows are reused, pending writes of them dropped; returns those held."""
        out = []
        per_host = self._per_host
        for k in keys:
            row = self._index.pop(k, None)
            if row is None:
                continue
            self._free.append(row)
            self.dirty.discard(k)
            host = k.split("/", 1)[0]
            per_host[host] -= 1
            if not per_host[host]:
                del per_host[host]
            out.append(k)
        return out

    def clear(self) -> None:
        """Forget every entry (after a rebalance the table is the truth)."""
        self._index.clear()
        self._free.clear()
        self._per_host.clear()
        self.fleet.clear()
        self.dirty.clear()

    def source_offset(self, key: str) -> int | None:
        """The source offset of the newest sample *key*'s state learned (None: not held, or never noted)."""
        r = self._index.get(key)
        so = None if r is None else self._source_offset[r]
        return None if so is None or math.isnan(so) else int(so)

    def unlearned(self, msg: HostSamples, offset: int) -> HostSamples:
        """*msg* without the containers whose state already learned its source message (at *offset*).

        A host's messages come in order from one partition. A worker killed
        after a commit's state reached the changelog but before its source
        offsets were committed reads those messages again; the containers
        whose stored state holds them (``"so"``, :meth:`learned`) skip them,
        so no sample is learned twice.
        """
        keys = [f"{msg.host}/{c.container}" for c in msg.containers]
        if not keys:
            return msg
        rows = np.array(self.rows(keys), dtype=np.intp)  # first: new rows may grow the arrays
        src = self._source_offset[rows]
        seen = src >= offset  # NaN (never noted) is False
        if not count_true(seen):
            return msg
        return dataclasses.replace(msg, containers=tuple(c for c, s in zip(msg.containers, seen.tolist())
                                                         if not s))

    def learned(self, msg: HostSamples, offset: int, partition: int | None = None, now: float | None = None) -> None:
        """Note that the containers of *msg* learned the source message at *offset* (kept in their state), of
        *partition* at *now* (the caller's clock; both given: counted in :meth:`hold_back` until handed out)."""
        idx = self._index
        rows = [r for r in (idx.get(f"{msg.host}/{c.container}") for c in msg.containers) if r is not None]
        if rows:
            r = np.array(rows, dtype=np.intp)
            self._source_offset[r] = offset
            if partition is not None and now is not None:
                fresh = r[np.isnan(self._unwritten_from[r])]
                self._unwritten_from[fresh] = offset
                self._unwritten_since[fresh] = now
                self._source_partition[r] = partition

    def host_count(self, host: str) -> int:
        """How many containers of *host* the cache holds (keys ``host/...``)."""
        return self._per_host.get(host, 0)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index
