"""What the worker admits of a samples message before it reaches any per-container state (pure).

Two rules, each answering *why* when it refuses, so the caller can
dead-letter the refused part with that reason:

1. **Event time** (:func:`event_time_problem`): a message stamped beyond the
   worker's clock plus ``max_future_s`` would pin its containers' state in
   the future (their next recommendation, their histograms' reference time,
   their expiry) until the clock catches up; one stamped more than
   ``max_behind_s`` before the newest sample of its host already admitted
   would be learned out of order. Both are refused whole (the host's
   containers share the message's event time). Refused, not clamped: a
   clamped time is a wrong one that the VPA would learn silently, and a
   host whose clock is off should be seen (the dead letters and their
   metric), not quietly rewritten.
2. **Capacity** (:class:`Admission`): a message holding more than
   ``max_per_message`` containers is refused whole; a container this worker
   does not hold yet is admitted only while its host holds fewer than
   ``max_per_host`` and the worker fewer than ``max_per_worker`` containers.
   Containers already held are always admitted, so a flood of new names
   cannot push out the containers being managed.

Nothing here reads a clock: the caller passes ``now``.

>>> cfg = IntakeConfig(max_future_s=60, max_behind_s=600, max_per_message=3, max_per_host=2,
...                    max_per_worker=10)
>>> event_time_problem(1000.0 + 61, now=1000.0, newest=None, config=cfg)
'event time 1061 is 61 s ahead of the worker clock (allowed: 60 s; intake_max_future_s)'
>>> event_time_problem(300.0, now=1000.0, newest=1000.0, config=cfg)
"event time 300 is 700 s behind the host's newest sample (allowed: 600 s; intake_max_behind_s)"
>>> a = Admission(cfg, held=lambda key: False, host_count=lambda host: 0, total=0)
>>> a.admit("h", ["a", "b", "c"])
(['a', 'b'], ['c'], 'host h holds 2 containers (intake_max_containers_per_host)')
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Admission", "EventClock", "IntakeConfig", "event_time_problem"]


@dataclass(frozen=True)
class IntakeConfig:
    """The worker's intake limits (it builds them from its ``intake_*`` settings); 0 = no limit."""

    #: seconds a sample's event time may lie ahead of the worker's clock
    max_future_s: float = 300.0
    #: seconds a sample's event time may lie behind the newest admitted sample of its host
    max_behind_s: float = 3600.0
    #: containers one message may hold
    max_per_message: int = 10_000
    #: containers one host may have in the worker
    max_per_host: int = 10_000
    #: containers the worker holds in all
    max_per_worker: int = 200_000


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

    >>> clock = EventClock(IntakeConfig(max_future_s=60, max_behind_s=600), what="job", max_keys=2)
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


class Admission:
    """Which containers of each message in a batch are admitted under the capacity limits.

    *held*: whether the worker holds a ``host/container`` key already;
    *host_count*: how many containers a host has in the worker; *total*: how
    many the worker holds. Containers admitted by earlier calls on the same
    object count against the limits of later ones (a batch's messages are
    admitted in order before any is processed).
    """

    def __init__(self, config: IntakeConfig, *, held: Callable[[str], bool], host_count: Callable[[str], int],
                 total: int) -> None:
        self.config = config
        self.held = held
        self.host_count = host_count
        self.total = total
        self._added: dict[str, int] = {}
        self._new: set[str] = set()
        self.limit: str | None = None

    def too_many(self, n: int) -> str | None:
        """Why a message of *n* containers is refused whole (``None``: it is not)."""
        cap = self.config.max_per_message
        if cap and n > cap:
            return f"message holds {n} containers (allowed: {cap}; intake_max_containers_per_message)"
        return None

    def admit(self, host: str, names: Sequence[str]) -> tuple[list[str], list[str], str | None]:
        """``(admitted, refused, why)`` of the message's container *names* (in order).

        :attr:`limit` then names the limit that refused the first one (``host`` or ``worker``).
        """
        cfg = self.config
        kept: list[str] = []
        refused: list[str] = []
        why: str | None = None
        self.limit: str | None = None
        count = self.host_count(host) + self._added.get(host, 0)
        for name in names:
            key = f"{host}/{name}"
            if key in self._new or self.held(key):
                kept.append(name)
                continue
            if cfg.max_per_host and count >= cfg.max_per_host:
                refused.append(name)
                if why is None:
                    why, self.limit = f"host {host} holds {count} containers (intake_max_containers_per_host)", "host"
                continue
            if cfg.max_per_worker and self.total >= cfg.max_per_worker:
                refused.append(name)
                if why is None:
                    why = f"the worker holds {self.total} containers (intake_max_containers_per_worker)"
                    self.limit = "worker"
                continue
            kept.append(name)
            self._new.add(key)
            count += 1
            self.total += 1
            self._added[host] = self._added.get(host, 0) + 1
        return kept, refused, why
