"""The profiles-topic follower: every worker reads each signed run's :class:`ExecutionProfile` (its own and
the other workers'), so a new run of a known job starts from its earlier runs wherever it lands.

Read from its beginning and followed on a daemon thread started with the worker (nothing connects before);
decoded profiles wait in a bounded queue
that the samples agent drains into its :class:`~phasewise.models.priors.book.PriorBook` between batches
(the book is the event loop's alone). A record that is no profile (null, not JSON, out of bounds, unsigned
or wrongly signed with a keyring) goes to *on_bad* (a dead letter). docs/priors.md.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from phasewise.kit.records import ExecutionProfile, SchemaError, decode
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import PROFILES
from phasewise.streams.following import Following

__all__ = ["ProfileFollower"]

log = logging.getLogger(__name__)

#: profiles waiting for the agent at most (older ones go first when it falls this far behind)
MAX_WAITING = 100_000


class ProfileFollower(Following):
    """Every partition of ``phasewise.profiles.v1`` from its beginning; :meth:`drain` hands out what came."""

    def __init__(self, settings: Settings,
                 on_bad: Callable[[bytes | None, bytes | None, int, int, str], None] | None = None,
                 keyring: Keyring | None = None) -> None:
        self.settings = settings
        self.keyring = keyring
        self.on_bad = on_bad
        self._waiting: collections.deque[ExecutionProfile] = collections.deque(maxlen=MAX_WAITING)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Any = None
        self._partitions: list[int] = []
        self.read = 0
        self.bad = 0
        #: why the follower stopped without following (``None``: following, or not started)
        self.failed: str | None = None

    def _make_consumer(self) -> Any:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        from phasewise.kit.kafka.client import make_consumer

        c = make_consumer(self.settings, f"{self.settings.worker.id}-profiles-follower",
                          **{"fetch.wait.max.ms": 200})
        md = c.list_topics(PROFILES.name, timeout=10.0).topics.get(PROFILES.name)
        parts = sorted(md.partitions) if md is not None and md.error is None and md.partitions else []
        if not parts:
            c.close()
            raise RuntimeError(f"topic {PROFILES.name} does not exist (phasewise topics --create makes it)")
        self._partitions = parts
        c.assign([TopicPartition(PROFILES.name, p, OFFSET_BEGINNING) for p in parts])
        return c

    def _handle(self, msg: Any) -> None:
        if msg is None or msg.error():
            return
        key, value = msg.key(), msg.value()
        try:
            if self.keyring is not None:
                refused = self.keyring.verify(PROFILES.name, key, value, msg.headers())
                if refused is not None:
                    raise SchemaError(f"ExecutionProfile refused: {refused}")
            p = decode(ExecutionProfile, value)
            if key is not None and key != f"{p.host}/{p.container}".encode():
                raise SchemaError(f"ExecutionProfile of {p.host}/{p.container:.60} under another key")
        except Exception as e:  # noqa: BLE001 - decode raises SchemaError only; a record never stops this
            reason = str(e) if isinstance(e, SchemaError) else f"could not decode: {type(e).__name__}: {e}"
            self.bad += 1
            log.warning("profiles topic partition %s offset %s: %s", msg.partition(), msg.offset(), reason)
            if self.on_bad is not None:
                self.on_bad(value, key, msg.partition(), msg.offset(), reason)
            return
        self.read += 1
        self._waiting.append(p)

    def start(self) -> None:
        """Follow the topic from its beginning on a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="phasewise-profiles-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._consumer is None:
                self._consumer = self._make_consumer()
        except Exception as e:  # noqa: BLE001 - no topic, no broker: the worker's own runs still make priors
            self.failed = str(e)
            log.warning("known-job priors: other workers' runs are not read: %s", e)
            return
        self._follow("profiles follower")

    def drain(self) -> list[ExecutionProfile]:
        """The profiles read since the last call, in the order read."""
        out = []
        q = self._waiting
        while q:
            try:
                out.append(q.popleft())
            except IndexError:
                break
        return out
