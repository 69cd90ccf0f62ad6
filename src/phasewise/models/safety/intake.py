"""What the worker admits of a samples message before it reaches any per-container state (pure).

Two rules, each saying *why* when it refuses, so the caller dead-letters the
refused part with that reason: the event time (:func:`event_time_problem`:
not too far ahead of the worker's clock, nor behind the host's newest
sample) and capacity (:class:`Occupancy`: caps per message, host and worker,
with least-recently-seen eviction and per-host fairness). The caller passes
``now``. docs/security.md, "Event time", "Bounded state" and "Caps under a
flood".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Admitted", "EventClock", "Eviction", "IntakeConfig", "Occupancy", "event_time_problem"]


@dataclass(frozen=True)
class IntakeConfig:
    """The worker's intake limits, 0 = no limit; the worker builds them from its ``intake_*`` settings
    (:func:`phasewise.streams.config.intake_config`), which hold their defaults (docs/architecture.md, "Defaults")."""

    #: seconds a sample's event time may lie ahead of the worker's clock
    max_future_s: float
    #: seconds a sample's event time may lie behind the newest admitted sample of its host
    max_behind_s: float
    #: containers one message may hold
    max_per_message: int
    #: containers one host may have in the worker
    max_per_host: int
    #: containers the worker holds in all
    max_per_worker: int
    #: seconds after its last admitted message a host still counts as active (it divides a full
    #: worker into shares) and a container still counts as seen (older: evicted first)
    host_active_s: float


def event_time_problem(ts: float, *, now: float, newest: float | None, config: IntakeConfig,
                       newest_of: str = "the host's newest sample") -> str | None:
    """Why a message stamped *ts* must not be learned (``None``: it may).

    *now*: the worker's clock; *newest*: the newest event time admitted for
    the message's host (``None``: none yet), which *newest_of* names in the reason.
    """
    if not math.isfinite(ts):
        return f"event time {ts!r} is not a finite number"
    ahead = ts - now
    if config.max_future_s and ahead > config.max_future_s:
        return (f"event time {ts:.0f} is {ahead:.0f} s ahead of the worker clock "
                f"(allowed: {config.max_future_s:g} s; intake_max_future_s)")
    if config.max_behind_s and newest is not None and newest - ts > config.max_behind_s:
        return (f"event time {ts:.0f} is {newest - ts:.0f} s behind {newest_of} "
                f"(allowed: {config.max_behind_s:g} s; intake_max_behind_s)")
    return None


class EventClock:
    """The event-time rule per key for records other than a worker's samples (job, progress and
    phase events; the samples a job worker reads), with the newest admitted time of each key.

    The same two bounds as samples (:func:`event_time_problem`): ahead of the clock by more than
    ``max_future_s`` is refused, and behind the key's newest admitted event by more than
    ``max_behind_s``. A refused record changes nothing, so one future-stamped event cannot pin a
    job's state. At most *max_keys* keys are remembered (least recently seen forgotten first;
    a forgotten key is checked against the clock only), so a flood of new keys cannot grow it.
    After a restart the newest times start empty: the clock bound holds at once, the behind bound
    from each key's first admitted record on.

    >>> cfg = IntakeConfig(max_future_s=60, max_behind_s=600, max_per_message=0, max_per_host=0, max_per_worker=0,
    ...                    host_active_s=120)
    >>> clock = EventClock(cfg, what="job", max_keys=2)
    >>> clock.admit("a", 1000.0, now=1000.0) is None
    True
    >>> clock.admit("a", 2000.0, now=1000.0)
    'event time 2000 is 1000 s ahead of the worker clock (allowed: 60 s; intake_max_future_s)'
    >>> clock.admit("a", 300.0, now=1000.0)
    "event time 300 is 700 s behind the job's newest event (allowed: 600 s; intake_max_behind_s)"
    >>> clock.admit("b", 1.0, now=1000.0), clock.admit("c", 1.0, now=1000.0), len(clock)
    (None, None, 2)
    """

    def __init__(self, config: IntakeConfig, *, what: str = "job", max_keys: int = 100_000) -> None:
        from collections import OrderedDict

        self.config = config
        self.newest_of = f"the {what}'s newest event"
        self.max_keys = max(1, max_keys)
        self._newest: OrderedDict[str, float] = OrderedDict()
        self.refused = 0

    def __len__(self) -> int:
        return len(self._newest)

    def admit(self, key: str, ts: float, *, now: float) -> str | None:
        """Why the record of *key* stamped *ts* is refused (``None``: admitted, *key*'s newest updated)."""
        newest = self._newest.get(key)
        why = event_time_problem(ts, now=now, newest=newest, config=self.config, newest_of=self.newest_of)
        if why is not None:
            self.refused += 1
            return why
        if newest is None or ts > newest:
            self._newest[key] = ts
        self._newest.move_to_end(key)
        while len(self._newest) > self.max_keys:
            self._newest.popitem(last=False)
        return None


@dataclass(frozen=True)
class Eviction:
    """A container dropped to make room for a new one: its ``host/container`` key, the limit that was
    full (``host`` or ``worker``) and why this one went."""

    key: str
    limit: str
    reason: str


@dataclass(frozen=True)
class Admitted:
    """What :meth:`Occupancy.admit` decided for one message."""

    kept: list[str]  #: container names admitted (held before, or new), in order
    refused: list[str]  #: container names refused, in order
    why: str | None  #: the reason of the first refusal
    limit: str | None  #: the limit that refused the first one (``host`` or ``worker``)
    evicted: list[Eviction]  #: containers dropped to admit new ones


class Occupancy:
    """The containers a worker holds, least recently seen first, and which one makes room for a new one.

    Every container of an admitted message is *seen* now (moved to the back of
    the order); :meth:`begin` starts a batch (the caller passes its clock,
    ``now``). A container or host seen in two batches or more is *established*;
    one seen in a single batch is not (names sent once). A container the
    worker does not hold yet is admitted; when a limit is full, another
    container is evicted for it:

    1. **Per host**: a host holding ``max_per_host`` containers replaces its
       own least recently seen one.
    2. **Worker full** (``max_per_worker``): a host's *share* is
       ``max_per_worker`` divided by the active established hosts (a message
       in the last ``host_active_s`` seconds; the new container's host
       counted too). A host at or above its share replaces its own least
       recently seen container: it cannot take more than its share. A host
       below it takes, in this order: the worker's least recently seen
       container if it was not seen for ``host_active_s`` (stale); the least
       recently seen container seen in one batch only; and, if the host is
       established, the least recently seen container of the host holding
       the most, when that one is above its share.

    A container seen in the current batch is never evicted (a host's own
    message protects all of its containers), and neither is an established
    container seen within ``host_active_s`` of a host within its share: when
    nothing may go, the new container is refused, with the reason. So names
    sent once (under invented hosts or a real one) neither push out a real
    container nor keep a real new one out: they are the first to go. Memory
    is bounded by ``max_per_worker`` entries; every operation is O(1) per
    container, except :meth:`forget`, O(keys).

    >>> occ = Occupancy(IntakeConfig(max_future_s=0, max_behind_s=0, max_per_message=0, max_per_host=2,
    ...                              max_per_worker=3, host_active_s=60))
    >>> occ.begin(now=0.0)
    >>> occ.admit("h", ["a", "b"]).kept
    ['a', 'b']
    >>> occ.begin(now=1.0)
    >>> r = occ.admit("h", ["b", "c"])  # h is at its cap: its least recently seen container makes room
    >>> r.kept, [e.key for e in r.evicted]
    (['b', 'c'], ['h/a'])
    >>> r = occ.admit("h", ["d"])  # b and c were seen in this batch: nothing of h's may go
    >>> r.refused, r.limit
    (['d'], 'host')
    """

    def __init__(self, config: IntakeConfig) -> None:
        from collections import OrderedDict

        self._od = OrderedDict
        self.config = config
        #: key -> [host, batch last seen, time last seen, established], least recently seen first
        self._keys: OrderedDict[str, list[Any]] = OrderedDict()
        self._once: OrderedDict[str, None] = OrderedDict()  # keys seen in one batch only, oldest first
        self._hosts: dict[str, OrderedDict[str, None]] = {}  # host -> its keys, least recently seen first
        self._hbatch: dict[str, list[Any]] = {}  # host -> [batch of its last message, established]
        self._seen: OrderedDict[str, float] = OrderedDict()  # established host -> time of its last message
        self._by_size: dict[int, dict[str, None]] = {}  # n -> the hosts holding n containers (insertion order)
        self._largest = 0
        self._added: list[str] = []  # keys admitted in this batch
        self.batch = 0
        self.now = 0.0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def host_count(self, host: str) -> int:
        """How many containers *host* holds."""
        keys = self._hosts.get(host)
        return len(keys) if keys else 0

    def begin(self, now: float) -> None:
        """A new batch, at worker time *now*: the containers seen from here on are protected until the next."""
        self.batch += 1
        self.now = float(now)
        self._added = []

    def too_many(self, n: int) -> str | None:
        """Why a message of *n* containers is refused whole (``None``: it is not)."""
        cap = self.config.max_per_message
        if cap and n > cap:
            return f"message holds {n} containers (allowed: {cap}; intake_max_containers_per_message)"
        return None

    def active_hosts(self, host: str | None = None) -> int:
        """Established hosts with a message in the last ``host_active_s`` (and *host*, if given)."""
        seen, cutoff = self._seen, self.now - self.config.host_active_s
        while seen:
            h, t = next(iter(seen.items()))
            if t >= cutoff:
                break
            del seen[h]  # inactive: it keeps its containers, it no longer divides the worker
        return len(seen) + (1 if host is not None and host not in seen else 0)

    def share(self, host: str) -> int:
        """*host*'s share of a full worker: ``max_per_worker`` over the active hosts (at least 1)."""
        return max(1, self.config.max_per_worker // self.active_hosts(host))

    def established(self, host: str) -> bool:
        """Whether *host* sent messages in two batches or more (and holds a container)."""
        h = self._hbatch.get(host)
        return bool(h and h[1])

    # -- the order ---------------------------------------------------------------------
    def _resize(self, host: str, old: int, new: int) -> None:
        by = self._by_size
        if old:
            b = by[old]
            del b[host]
            if not b:
                del by[old]
        if new:
            by.setdefault(new, {})[host] = None
            if new > self._largest:
                self._largest = new
        while self._largest and self._largest not in by:
            self._largest -= 1

    def _host_seen(self, host: str) -> None:
        """*host*'s message was admitted in this batch (it holds a container)."""
        h = self._hbatch.get(host)
        if h is None:
            self._hbatch[host] = [self.batch, False]
            return
        if h[0] != self.batch:
            h[0], h[1] = self.batch, True
        if h[1]:
            self._seen[host] = self.now
            self._seen.move_to_end(host)

    def _add(self, key: str, host: str) -> None:
        keys = self._hosts.get(host)
        if keys is None:
            keys = self._hosts[host] = self._od()
        n = len(keys)
        keys[key] = None
        self._keys[key] = [host, self.batch, self.now, False]
        self._once[key] = None
        self._added.append(key)
        self._resize(host, n, n + 1)

    def _drop(self, key: str) -> bool:
        entry = self._keys.pop(key, None)
        if entry is None:
            return False
        if not entry[3]:
            del self._once[key]
        host = entry[0]
        keys = self._hosts[host]
        n = len(keys)
        del keys[key]
        if not keys:
            del self._hosts[host]
            del self._hbatch[host]
            self._seen.pop(host, None)
        self._resize(host, n, n - 1)
        return True

    def _evictable(self, key: str | None) -> str | None:
        """*key* unless it was seen in this batch."""
        return key if key is not None and self._keys[key][1] != self.batch else None

    def _oldest_of(self, host: str) -> str | None:
        """*host*'s least recently seen container not seen in this batch (``None``: none)."""
        keys = self._hosts.get(host)
        return self._evictable(next(iter(keys))) if keys else None

    def _worker_victim(self, host: str, count: int) -> tuple[str | None, str]:
        """The container to evict for a new one of *host* (holding *count*) in a full worker, and why."""
        share = self.share(host)
        if count >= share:
            return self._oldest_of(host), (f"host {host} holds {count} containers, its share of a full worker "
                                           f"({share}: intake_max_containers_per_worker / "
                                           f"{self.active_hosts(host)} active hosts)")
        oldest = self._evictable(next(iter(self._keys))) if self._keys else None
        if oldest is not None:
            idle = self.now - self._keys[oldest][2]
            if idle > self.config.host_active_s:
                return oldest, f"not seen for {idle:.0f} s (intake_host_active_s {self.config.host_active_s:g})"
        once = self._evictable(next(iter(self._once))) if self._once else None
        if once is not None:
            return once, "seen in one batch only"
        if self._largest > share and self.established(host):
            big = next(iter(self._by_size[self._largest]))
            k = self._oldest_of(big)
            if k is not None:
                return k, f"host {big} holds {self._largest} containers, more than its share of a full worker ({share})"
        return None, ("every container is seen within intake_host_active_s, of a host within its share "
                      f"({share}), or in this batch")

    # -- admission ---------------------------------------------------------------------
    def admit(self, host: str, names: Sequence[str]) -> Admitted:
        """Admit the containers *names* of one message of *host*: held ones are seen now, new ones
        added, evicting others where a limit is full (see the class)."""
        cfg = self.config
        keys, once = self._keys, self._once
        batch, now = self.batch, self.now
        own = self._hosts.get(host)
        new: list[tuple[str, str]] = []
        if own:  # first every held one: a host's own message protects its containers
            kget, kmove, omove = keys.get, keys.move_to_end, own.move_to_end
            prefix = host + "/"
            for name in names:
                key = prefix + name
                entry = kget(key)
                if entry is None:
                    new.append((name, key))
                elif entry[1] != batch:  # (seen earlier in this batch: already at the back)
                    if not entry[3]:
                        entry[3] = True  # seen in a second batch: established
                        del once[key]
                    entry[1] = batch
                    entry[2] = now
                    kmove(key)
                    omove(key)
            self._host_seen(host)
        else:
            new = [(name, f"{host}/{name}") for name in names]
        if not new:
            return Admitted(list(names), [], None, None, [])
        refused: set[str] = set()
        evicted: list[Eviction] = []
        why: str | None = None
        limit: str | None = None
        for name, key in new:
            if key in keys:  # twice in the message: admitted above
                continue
            count = self.host_count(host)
            victim, lim, reason = None, None, ""
            if cfg.max_per_host and count >= cfg.max_per_host:
                lim = "host"
                victim = self._oldest_of(host)
                reason = f"host {host} holds {count} containers (intake_max_containers_per_host)"
                if victim is None:
                    reason += ", every one seen in this batch"
            elif cfg.max_per_worker and len(keys) >= cfg.max_per_worker:
                lim = "worker"
                victim, reason = self._worker_victim(host, count)
                reason = f"the worker holds {len(keys)} containers (intake_max_containers_per_worker): {reason}"
            if lim is not None and victim is None:
                refused.add(name)
                if why is None:
                    why, limit = reason, lim
                continue
            if victim is not None:
                idle = now - keys[victim][2]
                self._drop(victim)
                evicted.append(Eviction(victim, lim, f"least recently seen ({idle:.0f} s ago), evicted for "
                                                     f"{key}: {reason}"))
            first = host not in self._hbatch
            self._add(key, host)
            if first:
                self._host_seen(host)
        kept = [n for n in names if n not in refused]
        return Admitted(kept, [n for n in names if n in refused], why, limit, evicted)

    def forget(self, keys: Iterable[str]) -> int:
        """Drop *keys* (expired: the worker no longer holds them); returns how many were held."""
        return sum(self._drop(k) for k in keys)

    def settle(self, held: Callable[[str], bool]) -> list[str]:
        """End of a batch: drop the containers admitted in it that the worker did not take (*held* is
        false: e.g. a message that failed); returns them."""
        gone = [k for k in self._added if k in self._keys and not held(k)]
        for k in gone:
            self._drop(k)
        self._added = []
        return gone

    def clear(self) -> None:
        """Forget every container (the worker's partitions were reassigned)."""
        for d in (self._keys, self._once, self._hosts, self._hbatch, self._seen, self._by_size):
            d.clear()
        self._largest = 0
        self._added = []
