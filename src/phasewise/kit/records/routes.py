"""A job's state or a container's phase change on its way to the horus worker that reads its host's samples.

Internal to ``phasewise horus`` (topic ``phasewise.horus-routes.v1``, key: host, the samples topic's
partition of that host): horus workers sharing one ``horus_worker_id`` split the job events by job and
the samples by host, so the worker that reads a job's events routes its ``started`` event (with the
job's prediction: what the join learns from) and its end to the worker that reads its host's samples,
and every phase change goes the same way. Narrative: docs/horus.md, "More than one worker".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records.codec import field
from phasewise.kit.records.jobs import MAX_HOST_NAME, JobEvent
from phasewise.kit.records.phases import PhaseChange
from phasewise.kit.records.predictions import UtilisationPrediction

__all__ = ["ROUTE_KINDS", "HorusRoute"]

#: started: where a job runs (``event``, and ``prediction`` when it was submitted); end: its end (``event``);
#: phase: a container's phase change (``phase``)
ROUTE_KINDS = ("started", "end", "phase")


@dataclass(frozen=True, slots=True, kw_only=True)
class HorusRoute:
    """A job event or a phase change for the horus worker reading *host*'s samples (internal; key: host)."""

    VERSION: ClassVar[int] = 1
    host: str = field(max_length=MAX_HOST_NAME)
    kind: str = field(enum=ROUTE_KINDS)
    ts: float = field(minimum=0)
    event: JobEvent | None = field(default=None, doc="kinds started and end: the job's event")
    phase: PhaseChange | None = field(default=None, doc="kind phase: the phase change")
    prediction: UtilisationPrediction | None = field(default=None,
                                                     doc="kind started: the job's prediction at submission")
    model: str | None = field(default=None, max_length=512, doc="kind started: the job's model key")
    v: int = field(default=1)
