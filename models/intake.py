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

__all__ = ["Admission", "IntakeConfig", "event_time_problem"]


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


def event_time_problem(ts: float, *, now: float, newest: float | None, config: IntakeConfig) -> str | None:
    """Why a message stamped *ts* must not be learned (``None``: it may).

    *now*: the worker's clock; *newest*: the newest event time admitted for
    the message's host (``None``: none yet).
    """
    if not math.isfinite(ts):
        return f"event time {ts!r} is not a finite number"
    ahead = ts - now
    if config.max_future_s and ahead > config.max_future_s:
        return (f"event time {ts:.0f} is {ahead:.0f} s ahead of the worker clock "
                f"(allowed: {config.max_future_s:g} s; intake_max_future_s)")
    if config.max_behind_s and newest is not None and newest - ts > config.max_behind_s:
        return (f"event time {ts:.0f} is {newest - ts:.0f} s behind the host's newest sample "
                f"(allowed: {config.max_behind_s:g} s; intake_max_behind_s)")
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
