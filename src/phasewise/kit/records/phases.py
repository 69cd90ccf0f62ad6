"""The phase path's records: a container's new phase (:class:`PhaseChange`), a model snapshot
(:class:`ModelSnapshot`, on a compacted topic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records.codec import field

__all__ = ["ModelSnapshot", "PhaseChange"]

@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChange:
    """A container entered a new phase (key: container)."""

    VERSION: ClassVar[int] = 1
    container: str = field()
    host: str = field()
    ts: float = field(minimum=0)
    old_phase: int | None = field(default=None)
    new_phase: int = field(minimum=0)
    since: float = field(minimum=0, doc="event time the old phase began")
    stats: dict = field(default={}, doc="per-resource statistics of the new phase")
    v: int = field(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSnapshot:
    """A serialised model (compacted topic, key: model name)."""

    VERSION: ClassVar[int] = 1
    name: str = field()
    ts: float = field(minimum=0)
    version: int = field(minimum=0, doc="monotonic snapshot counter")
    payload_b64: str = field(doc="base64 of the model checkpoint")
    samples_seen: int = field(default=0, minimum=0)
    v: int = field(default=1)
