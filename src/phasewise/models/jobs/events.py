"""What the steps over the job-events topic share: the refusals that make a record a dead letter, and
where each job's state goes in the changelog.

A step (:class:`~phasewise.models.jobs.priority_step.PriorityStep`,
:class:`~phasewise.models.jobs.targets_step.TargetsStep`) raises a :class:`Refused` for a valid record
it cannot take; the agent dead-letters it with the refusal's ``kind``. :class:`JobPositions` keeps, per
job, the changelog partition of its events and the offset of the last of its events the state holds, so
that events read again after a restart whose last offsets were not committed are not applied twice
(docs/architecture.md, "A sample's way"; docs/priorities.md).
"""

from __future__ import annotations

import zlib

__all__ = ["EventTimeRefused", "JobPositions", "Refused", "SignatureRefused"]


class Refused(ValueError):
    """A valid record the step cannot take: ``str(e)`` is the reason of its dead letter, :attr:`kind` its kind."""

    kind = "refused"

    def __init__(self, reason: str, kind: str | None = None) -> None:
        super().__init__(reason)
        if kind is not None:
            self.kind = kind


class SignatureRefused(Refused):
    """A record that must be signed and is not: a ``started`` event without the cluster key's signature, a
    submission no trusted submitter signed (where the agent has ``job_trusted_submitters``)."""

    kind = "signature"


class EventTimeRefused(Refused):
    """A job event stamped beyond the clock's allowance or far behind the job's newest event."""

    kind = "event_time"


class JobPositions:
    """Per job: the changelog partition its state goes to and the offset of the last of its events it holds.

    A job's state goes to the changelog partition of its job events (*partitions*: the topic's count; a
    job restored without events yet keeps its stored one, one never seen goes where its key hashes).

    >>> p = JobPositions(8)
    >>> p.note("a", 3, 10)
    >>> p.seen("a", 3, 10), p.seen("a", 3, 11), p.seen("a", 2, 5), p.partition("a")
    (True, False, False, 3)
    """

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self.partition_of: dict[str, int] = {}
        #: job -> offset of the last of its events the state holds (in its partition)
        self.offset_of: dict[str, int] = {}

    def seen(self, job: str, partition: int | None, offset: int | None) -> bool:
        """Whether the event at *offset* of *partition* is in *job*'s state already (read again after a restart)."""
        last = self.offset_of.get(job)
        return (last is not None and offset is not None and offset <= last
                and self.partition_of.get(job) == partition)

    def note(self, job: str, partition: int | None, offset: int | None) -> None:
        """*job*'s state now holds its event at *offset* of *partition* (either unknown: ``None``)."""
        if partition is not None:
            self.partition_of[job] = partition
        if offset is not None:
            self.offset_of[job] = offset

    def load(self, job: str, partition: int, offset: int | None) -> None:
        """As stored in the table."""
        self.partition_of[job] = int(partition)
        if offset is not None:
            self.offset_of[job] = int(offset)

    def partition(self, job: str) -> int:
        p = self.partition_of.get(job)
        return p if p is not None else zlib.crc32(job.encode()) % self.partitions

    def offset(self, job: str) -> int | None:
        return self.offset_of.get(job)

    def forget(self, job: str) -> None:
        self.partition_of.pop(job, None)
        self.offset_of.pop(job, None)

    def clear(self) -> None:
        self.partition_of.clear()
        self.offset_of.clear()
