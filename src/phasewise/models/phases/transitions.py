"""Anticipated phase transitions: per signature, the next phase and the time to it (pure).

The AI4DL follow-up (IEEE CLOUD'20) resizes a container *before* its next phase instead of after it: a job
that evaluates every few minutes, checkpoints or reloads its data needs more at a moment its earlier runs
show. A :class:`TransitionBook` keeps, per signature (``phasewise.io/signature``: the runs of one job) and
phase, the phase's last exits (how long it lasted, which phase came next) and answers, online, for a run
that has been in a phase for *d* seconds: which phase comes next within the horizon, and how likely. It is
the empirical semi-Markov hazard: of the exits of the phase that lasted longer than *d*, the share that
ended within ``d + horizon``, and among those the most frequent next phase. The phase detector's fleet
(:class:`~phasewise.models.phases.fleet.PhaseFleet`) raises a limit to the predicted phase's limit ahead
of it and lets it fall back after (every safety rule still bounds the decision). docs/phases.md,
"Anticipated transitions".

>>> book = TransitionBook(TransitionConfig(horizon_s=5.0, min_probability=0.5, min_exits=3))
>>> for dwell in (20.0, 22.0, 21.0, 40.0):      # train (phase 2) lasted ~20 s, then eval (phase 4)
...     book.learn("lm", 2, 4 if dwell < 30 else 1, dwell)
>>> book.predict("lm", 2, 2.0) is None           # 18 s to go: nothing within the horizon
True
>>> t = book.predict("lm", 2, 17.0)
>>> t.next_phase, t.probability, t.exits
(4, 0.75, 4)
>>> book.predict("lm", 2, 23.0) is None          # past every short exit: only 1 exit left, too few
True
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

__all__ = ["Transition", "TransitionBook", "TransitionConfig"]


@dataclass(frozen=True, slots=True)
class TransitionConfig:
    """The anticipation rule; the worker builds it from its ``phase_anticipate_*`` settings."""

    #: look this many seconds ahead (0: anticipation off)
    horizon_s: float
    #: raise ahead only of a transition at least this likely within the horizon
    min_probability: float = 0.5
    #: a phase of a signature predicts once this many of its exits outlived the current dwell
    min_exits: int = 3
    #: exits kept per signature and phase (the newest; a job that changed is learned anew)
    keep: int = 32
    #: signatures kept (least recently learned first out)
    max_signatures: int = 10_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.horizon_s) and self.horizon_s >= 0):
            raise ValueError(f"horizon_s must be a finite number >= 0, got {self.horizon_s!r}")
        if not 0.0 < self.min_probability <= 1.0:
            raise ValueError(f"min_probability must be in (0, 1], got {self.min_probability!r}")
        if not (isinstance(self.min_exits, int) and self.min_exits >= 1):
            raise ValueError(f"min_exits must be an integer >= 1, got {self.min_exits!r}")
        if self.keep < self.min_exits:
            raise ValueError(f"keep ({self.keep}) must be at least min_exits ({self.min_exits})")
        if self.max_signatures < 1:
            raise ValueError(f"max_signatures must be >= 1, got {self.max_signatures!r}")

    @property
    def on(self) -> bool:
        return self.horizon_s > 0


@dataclass(frozen=True, slots=True)
class Transition:
    """A likely transition of a run out of *phase* into *next_phase* within *within_s* seconds."""

    signature: str
    phase: int
    next_phase: int
    #: the share of the phase's exits (those that outlived *dwell_s*) that went to *next_phase* in time
    probability: float
    within_s: float
    #: how long the run has been in *phase*
    dwell_s: float
    #: the exits the probability rests on
    exits: int

    def explain(self) -> dict[str, Any]:
        """For a decision's ``details["anticipated"]``."""
        return {"signature": self.signature, "phase": self.phase, "next_phase": self.next_phase,
                "probability": round(self.probability, 4), "within_s": self.within_s,
                "dwell_s": round(self.dwell_s, 3), "exits": self.exits}

    def text(self) -> str:
        """For a decision's reason."""
        return (f"ahead of phase {self.phase} -> {self.next_phase} ({self.probability:.0%} of {self.exits} "
                f"earlier exits of {self.signature} within {self.within_s:g} s)")


class TransitionBook:
    """Per signature and phase, the newest exits (:meth:`learn`) and the likely next one (:meth:`predict`)."""

    def __init__(self, config: TransitionConfig) -> None:
        self.config = config
        #: signature -> phase -> exits as (dwell_s, next phase), newest last
        self._exits: OrderedDict[str, dict[int, deque[tuple[float, int]]]] = OrderedDict()
        self.learned = 0

    def learn(self, signature: str, phase: int, next_phase: int, dwell_s: float) -> None:
        """A run of *signature* left *phase* for *next_phase* after *dwell_s* seconds in it."""
        if phase < 0 or next_phase < 0 or phase == next_phase or not (math.isfinite(dwell_s) and dwell_s >= 0):
            return
        phases = self._exits.get(signature)
        if phases is None:
            phases = self._exits[signature] = {}
            while len(self._exits) > self.config.max_signatures:
                self._exits.popitem(last=False)
        else:
            self._exits.move_to_end(signature)
        ring = phases.get(phase)
        if ring is None:
            ring = phases[phase] = deque(maxlen=self.config.keep)
        ring.append((float(dwell_s), int(next_phase)))
        self.learned += 1

    def knows(self, signature: str) -> bool:
        """Whether any exit of *signature* is kept."""
        return signature in self._exits

    def exits(self, signature: str, phase: int) -> list[tuple[float, int]]:
        """The exits kept for *signature*'s *phase*, oldest first."""
        return list(self._exits.get(signature, {}).get(phase, ()))

    def predict(self, signature: str, phase: int, dwell_s: float) -> Transition | None:
        """The likely next phase of a run of *signature* in *phase* for *dwell_s* seconds, if one is at least
        ``min_probability`` likely within ``horizon_s`` (``None``: none, too few exits, or off)."""
        c = self.config
        if not c.on:
            return None
        ring = self._exits.get(signature, {}).get(phase)
        if ring is None or len(ring) < c.min_exits:
            return None
        alive = 0
        soon: dict[int, int] = {}
        end = dwell_s + c.horizon_s
        for d, q in ring:
            if d > dwell_s:
                alive += 1
                if d <= end:
                    soon[q] = soon.get(q, 0) + 1
        if alive < c.min_exits or not soon:
            return None
        q, k = max(soon.items(), key=lambda kv: (kv[1], -kv[0]))
        p = k / alive
        if p < c.min_probability:
            return None
        return Transition(signature=signature, phase=int(phase), next_phase=q, probability=p, within_s=c.horizon_s,
                          dwell_s=float(dwell_s), exits=alive)

    def __len__(self) -> int:
        return len(self._exits)
