"""What the roles decide and do: :class:`Decision` (a policy's), :class:`Actuation` (an actuator's),
and :class:`DeadLetter` (a record any consumer could not handle, with why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records.codec import MAX_BYTES, MAX_CORES, field

__all__ = ["Actuation", "DeadLetter", "Decision"]

@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What a policy wants done to one container (key: host)."""

    VERSION: ClassVar[int] = 1
    id: str = field(doc="idempotency key: an actuator applies each id at most once")
    ts: float = field(minimum=0)
    host: str = field()
    container: str = field()
    action: str = field(enum=("limit", "freeze", "thaw", "terminate", "place", "scale", "share", "weight"))
    policy: str = field(doc="policy that produced it, e.g. vpa, phase")
    reason: str = field(default="")
    cpu_limit_cores: float | None = field(default=None, minimum=0, maximum=MAX_CORES)
    mem_limit_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)
    details: dict = field(default={}, doc="the numbers behind the decision")
    v: int = field(default=1)

    @property
    def is_checkpoint_stop(self) -> bool:
        """A ``terminate`` that stops a job at a checkpoint (``details.mode``), for its agent to resume it (the
        priority agent's preemption); any other terminate (a target's hard stop, an operator's) ends the job."""
        d = self.details
        return self.action == "terminate" and isinstance(d, dict) and d.get("mode") == "checkpoint"

    @property
    def is_resume(self) -> bool:
        """A ``place`` that starts again a job its agent stopped (``details.resume``)."""
        return self.action == "place" and isinstance(self.details, dict) and self.details.get("resume") is True


@dataclass(frozen=True, slots=True, kw_only=True)
class Actuation:
    """What an actuator did with a decision (key: host)."""

    VERSION: ClassVar[int] = 1
    decision_id: str = field()
    ts: float = field(minimum=0)
    host: str = field()
    container: str = field()
    status: str = field(enum=("applied", "clamped", "duplicate", "rejected", "failed"))
    backend: str = field()
    message: str = field(default="")
    cpu_limit_cores: float | None = field(default=None, minimum=0, maximum=MAX_CORES)
    mem_limit_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)
    decision_ts: float | None = field(default=None, minimum=0)
    v: int = field(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """A message that could not be processed, with why (key: source key)."""

    VERSION: ClassVar[int] = 1
    ts: float = field(minimum=0)
    source_topic: str = field()
    partition: int | None = field(default=None)
    offset: int | None = field(default=None)
    reason: str = field()
    payload: str = field(doc="the original bytes, UTF-8 with backslash escapes for invalid bytes "
                             "(only their start when truncated)")
    key: str | None = field(default=None)
    payload_bytes: int | None = field(default=None, minimum=0,
                                      doc="size of the original value in bytes; null: the record had no value")
    truncated: bool = field(default=False, doc="payload (or key) holds only the start of the original, cut so "
                                               "that the dead letter fits the broker's message size limit")
    v: int = field(default=1)
