"""What a worker does with a record it refuses: :func:`dead_letterer` (to ``phasewise.deadletters.v1``
through the worker's outputs, counted by kind), :func:`refused_output` (an output refused for itself
makes its input a dead letter of kind ``output_refused``) and :func:`event_time_gate` (the event-time
rule of :mod:`phasewise.models.safety.intake` per kind of key). Narrative: docs/worker.md;
docs/security.md, "Event time".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.kafka.client import dead_letter as make_dead_letter
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS
from phasewise.models.safety.intake import EventClock
from phasewise.streams.config import intake_config

__all__ = ["Input", "dead_letterer", "event_time_gate", "refused_output"]

log = logging.getLogger(__name__)

DeadLetter = Callable[[Any, str, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Input:
    """An input record as a dead letter names it, where no Faust event is at hand (the place agent's jobs)."""

    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None
    offset: int | None = None


def dead_letterer(settings: Settings, outputs: Any, metrics: Any) -> DeadLetter:
    """``await dead_letter(event, reason, kind)``; *metrics* has a ``dead_letters`` counter by ``kind``.

    ``dead_letter.now(message, reason, kind)`` does the same synchronously for a Faust message or an
    :class:`Input` (from a delivery callback).
    """

    def now(msg: Any, reason: str, kind: str) -> None:
        key, value, dl = make_dead_letter(source_topic=msg.topic, reason=reason, payload=msg.value, key=msg.key,
                                          partition=msg.partition, offset=msg.offset,
                                          max_bytes=settings.kafka.dead_letter_max_bytes)
        outputs.send(DEAD_LETTERS.name, key, value)
        metrics.dead_letters.labels(kind=kind).inc()
        log.warning("dead-lettered %s[%s]@%s%s: %s", msg.topic, msg.partition, msg.offset,
                    " (payload truncated)" if dl.truncated else "", dl.reason)

    async def dead_letter(event: Any, reason: str, kind: str) -> None:
        now(event.message, reason, kind)

    dead_letter.now = now  # type: ignore[attr-defined]
    return dead_letter


def refused_output(dead_letter: Any, event: Any) -> Callable[[str], None]:
    """The ``on_refused`` handler of the outputs *event* (a Faust event, or an :class:`Input`) causes: the
    record becomes a dead letter of kind ``output_refused`` naming the refused output."""
    msg = event if isinstance(event, Input) else event.message

    def refused(why: str) -> None:
        dead_letter.now(msg, f"an output record this input caused was refused: {why}", "output_refused")

    return refused


def event_time_gate(settings: Settings, kinds: Iterable[str],
                    dead_letter: DeadLetter) -> Callable[[Any, str, str, float], Awaitable[bool]]:
    """``await refused(event, kind, key, ts)``: whether the record is dead-lettered by the event-time rule
    (*kind*: one of *kinds*, the kind of key its newest time is kept per)."""
    intake = intake_config(settings)
    clocks = {kind: EventClock(intake, what=kind) for kind in kinds}

    async def refused(event: Any, kind: str, key: str, ts: float) -> bool:
        why = clocks[kind].admit(key, ts, now=time.time())
        if why is None:
            return False
        await dead_letter(event, why, "event_time")
        return True

    return refused
