"""What the job agents share about a job's lifecycle states: which end it, which change nothing and why.

:class:`Lifecycle` remembers the jobs an agent saw end (bounded, newest kept) and counts the states it
ignores: a second end (``repeated``), a state after the end (``after_end``, e.g. ``started`` after
``finished``), a state of a job it never held (``unknown_job``), a ``started`` of a job it did not place
(``not_placed``), a ``rejected`` of a job whose process started on the placement it refers to (an old
decision refused again: ``after_start``). Each ignored state is logged once per job and reason and
counted for the agent's ``*_job_states_ignored_total{why}`` metric (:meth:`Lifecycle.take_counts`).
:func:`submission_problem` is the check every agent makes of a ``submitted`` event before it books
anything. Narrative: docs/jobs.md, "Who frees what".
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from phasewise.kit.records import TERMINAL_KINDS, JobEvent
from phasewise.kit.records.jobs import targets_problem

__all__ = ["END_KINDS", "IGNORED_WHY", "MAX_ENDED", "Lifecycle", "submission_problem"]

log = logging.getLogger(__name__)

#: the states that end a job's run (``terminated`` ends it unless the agent that stopped it resumes it)
END_KINDS = TERMINAL_KINDS | {"terminated"}
#: the ends that, while the priority agent's checkpoint stop of a job is pending, are that stop's exit: a job
#: that honours the stop's control before the actuator handles the terminate decision is reported finished
#: (it saved its checkpoint and exited 0) or failed (killed by the signal), not terminated
STOP_EXITS = frozenset({"terminated", "finished", "failed"})
#: why a state was ignored (the metric's ``why`` label)
IGNORED_WHY = ("repeated", "after_end", "unknown_job", "not_placed", "after_start")
#: ended jobs remembered at most (those ended longest ago are forgotten first)
MAX_ENDED = 10_000


def submission_problem(ev: JobEvent) -> str | None:
    """Why a ``submitted`` event is refused before anything is booked for it (its loss targets in the wrong
    order for the metric's direction), or ``None``."""
    if ev.spec is None:
        return None
    why = targets_problem(ev.spec.targets)
    return None if why is None else f"JobEvent: submitted job {ev.job!r} refused: {why}"


class Lifecycle:
    """One agent's memory of the jobs it saw end, and its count of the states it ignored.

    >>> lc = Lifecycle("place")
    >>> lc.end("a", "finished", 10.0, submitted_ts=1.0)
    >>> lc.unheld("a", "finished", 12.0), lc.unheld("a", "started", 11.0), lc.unheld("b", "failed", 3.0)
    ('repeated', 'after_end', 'unknown_job')
    >>> lc.unheld("a", "finished", 10.0) is None  # the same record again (read twice): not counted
    True
    >>> lc.ignore("a", "finished", "repeated"); lc.ignore("a", "finished", "repeated"); lc.take_counts()
    {'repeated': 2}
    """

    def __init__(self, agent: str, max_ended: int = MAX_ENDED) -> None:
        self.agent = agent
        self.max_ended = max_ended
        #: job -> (the kind that ended it, its event time, its submitted event's time)
        self.ended: OrderedDict[str, tuple[str, float, float | None]] = OrderedDict()
        self._counts: dict[str, int] = {}
        self._logged: OrderedDict[tuple[str, str], None] = OrderedDict()

    def end(self, job: str, kind: str, ts: float, submitted_ts: float | None = None) -> None:
        """*job* ended by a state of *kind* at *ts* (the agent freed what it held)."""
        self.ended.pop(job, None)
        self.ended[job] = (kind, ts, submitted_ts)
        while len(self.ended) > self.max_ended:
            self.ended.popitem(last=False)

    def ended_as(self, job: str) -> tuple[str, float, float | None] | None:
        return self.ended.get(job)

    def unheld(self, job: str, kind: str, ts: float) -> str | None:
        """Why a state of a job the agent does not hold is ignored; ``None`` when it is the very state that
        ended it, read again (after a restart, or the agent's own ``lost`` coming back): not counted."""
        e = self.ended.get(job)
        if e is None:
            return "unknown_job"
        if (kind, ts) == e[:2]:
            return None
        return "repeated" if kind in END_KINDS else "after_end"

    def ignore(self, job: str, kind: str, why: str, detail: str = "") -> None:
        """Count an ignored state; log it once per job and reason."""
        self._counts[why] = self._counts.get(why, 0) + 1
        if (job, why) in self._logged:
            return
        self._logged[(job, why)] = None
        while len(self._logged) > self.max_ended:
            self._logged.popitem(last=False)
        e = self.ended.get(job)
        said = {"repeated": f"it ended already ({e[0]} at {e[1]:.3f})" if e else "it ended already",
                "after_end": f"it ended already ({e[0]} at {e[1]:.3f})" if e else "it ended already",
                "unknown_job": "no submitted event for it reached this agent",
                "not_placed": "this agent did not place it",
                "after_start": "its process started: a place decision refused now is an older one"}.get(why, why)
        log.info("%s: job %s: %s state ignored (%s), nothing changes%s", self.agent, job, kind, said,
                 f"; {detail}" if detail else "")

    def take_counts(self) -> dict[str, int]:
        """The ignored states by reason since the last call (for the agent's counter)."""
        out, self._counts = self._counts, {}
        return out
