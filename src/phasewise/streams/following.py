"""A topic followed on a daemon thread (the models and profiles followers' shared loop). No torch, no
Faust: a VPA worker's profiles follower loads nothing it does not need.
"""

from __future__ import annotations

import abc
import logging
import threading
from typing import Any

__all__ = ["Following"]

log = logging.getLogger(__name__)


class Following(abc.ABC):
    """A topic followed on a daemon thread: :meth:`_follow` polls the consumer into ``_handle`` until
    :meth:`stop`; an error on one record is logged and the following goes on."""

    _consumer: Any
    _thread: threading.Thread | None
    _stop: threading.Event

    @abc.abstractmethod
    def _handle(self, msg: Any) -> None:
        """Take one polled message (``None`` when the poll timed out)."""

    def _follow(self, what: str) -> None:
        c = self._consumer
        try:
            while not self._stop.is_set():
                try:
                    self._handle(c.poll(0.5))
                except Exception:  # keep following; a broken record must not stop what the topic feeds
                    log.exception("%s: unexpected error", what)
        finally:
            c.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif self._consumer is not None:
            self._consumer.close()
        self._consumer = None
