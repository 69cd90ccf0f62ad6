"""What a job step asks of the kit about a ``submitted`` event, passed in as callables (models import no kit).

:class:`Submissions` carries the start details a decision copies from the event
(:func:`phasewise.kit.job_signing.start_details`) and the trusted submitters' check (``None``: every
job is taken); :func:`phasewise.streams.config.submissions` builds it from settings. See
docs/security.md for what the actuator verifies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from phasewise.kit.records import JobEvent

__all__ = ["Submissions"]


@dataclass(frozen=True)
class Submissions:
    #: a submitted event -> the JSON-ready fields a start decision copies from it (raises ValueError without spec)
    details: Callable[[JobEvent], dict]
    #: a submitted event -> why it is refused (no trusted submitter signed it), ``None`` when taken;
    #: ``None``: every submission is taken (no ``job_trusted_submitters``)
    check: Callable[[JobEvent], str | None] | None = None
