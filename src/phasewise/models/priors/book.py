"""Known-job priors: a workload's earlier runs set the limits of its next run until that run has history.

Workers publish an :class:`~phasewise.kit.records.ExecutionProfile` for each run of a workload with a
``signature`` (``phasewise.io/signature``): its peak CPU and working set so far. A :class:`PriorBook`
keeps the newest runs of each signature; a new run of a signature with at least ``min_runs`` earlier
runs (each seen for ``min_run_s``) starts from :meth:`PriorBook.prior`: the highest peak of those runs
plus ``margin``, per resource. It is what Autopilot-style recommenders do for a job they have seen
before, instead of running it unlimited until its own history is long enough. Pure.
docs/priors.md.

>>> from phasewise.kit.records import ExecutionProfile
>>> book = PriorBook(PriorConfig(min_runs=2, margin=0.1, min_run_s=30.0))
>>> for i, (cpu, mem) in enumerate([(1.0, 4e8), (1.5, 5e8), (0.8, 3e8)]):
...     book.learn(ExecutionProfile(signature="train-lm", host="h", container=f"run-{i}", ts=100.0 + i,
...                                 start=10.0 + i, samples=90, cpu_peak_cores=cpu, mem_peak_bytes=mem))
>>> p = book.prior("train-lm", exclude="h/run-2")
>>> p.runs, round(p.cpu_cores, 6), p.mem_bytes
(2, 1.65, 550000000.0)
>>> book.prior("train-lm", exclude="h/run-0").runs, book.prior("unknown") is None
(2, True)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import ExecutionProfile

__all__ = ["Prior", "PriorBook", "PriorConfig"]


@dataclass(frozen=True, slots=True)
class PriorConfig:
    """The priors' rule; the worker builds it from its ``prior_*`` settings
    (:func:`phasewise.streams.config.prior_config`)."""

    #: earlier runs a signature needs before its new runs start from them (0: priors off)
    min_runs: int
    #: a prior is the highest peak of the earlier runs x (1 + margin)
    margin: float
    #: a run counts once the worker saw it for this many seconds of event time
    min_run_s: float
    #: newest runs kept per signature (older ones are forgotten: a job that changed is learned anew)
    keep: int = 8
    #: signatures kept (least recently learned first out)
    max_signatures: int = 10_000

    def __post_init__(self) -> None:
        if not (isinstance(self.min_runs, int) and self.min_runs >= 0):
            raise ValueError(f"min_runs must be an integer >= 0, got {self.min_runs!r}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {self.margin!r}")
        if not (math.isfinite(self.min_run_s) and self.min_run_s >= 0):
            raise ValueError(f"min_run_s must be a finite number >= 0, got {self.min_run_s!r}")
        if self.keep < max(1, self.min_runs):
            raise ValueError(f"keep ({self.keep}) must be at least min_runs ({self.min_runs}) and 1")
        if self.max_signatures < 1:
            raise ValueError(f"max_signatures must be >= 1, got {self.max_signatures!r}")


@dataclass(frozen=True, slots=True)
class Prior:
    """The limits a new run of *signature* starts from, and the earlier runs behind them."""

    signature: str
    #: earlier runs it rests on
    runs: int
    cpu_cores: float
    mem_bytes: float
    #: the highest peaks of those runs (before the margin)
    cpu_peak_cores: float
    mem_peak_bytes: float
    margin: float

    def explain(self) -> dict[str, Any]:
        """For a decision's ``details["prior"]``."""
        return {"signature": self.signature, "runs": self.runs, "cpu_peak_cores": self.cpu_peak_cores,
                "mem_peak_bytes": self.mem_peak_bytes, "margin": self.margin,
                "limits": {"cpu": self.cpu_cores, "mem": self.mem_bytes}}


def _run_key(p: ExecutionProfile) -> str:
    return f"{p.host}/{p.container}"


class PriorBook:
    """The newest runs of each signature (:meth:`learn`) and the prior of a new run (:meth:`prior`)."""

    def __init__(self, config: PriorConfig) -> None:
        self.config = config
        #: signature -> {run key: profile}, signatures in least-recently-learned order
        self._runs: OrderedDict[str, dict[str, ExecutionProfile]] = OrderedDict()
        #: per signature, the priors asked since its runs last changed (key: the run left out, or None)
        self._memo: dict[str, dict[str | None, Prior | None]] = {}
        self.learned = 0

    def learn(self, p: ExecutionProfile) -> None:
        """Take *p*, the newest profile of its run (an older one of the same run is ignored)."""
        runs = self._runs.get(p.signature)
        if runs is None:
            runs = self._runs[p.signature] = {}
            while len(self._runs) > self.config.max_signatures:
                self._memo.pop(self._runs.popitem(last=False)[0], None)
        else:
            self._runs.move_to_end(p.signature)
        key = _run_key(p)
        old = runs.get(key)
        if old is not None and old.ts > p.ts:
            return
        runs[key] = p
        self._memo.pop(p.signature, None)
        self.learned += 1
        if len(runs) > self.config.keep:  # the run that started first goes
            del runs[min(runs, key=lambda k: (runs[k].start, k))]

    def runs(self, signature: str) -> list[ExecutionProfile]:
        """The runs kept for *signature*, oldest start first."""
        return sorted(self._runs.get(signature, {}).values(), key=lambda p: (p.start, _run_key(p)))

    def prior(self, signature: str, exclude: str | None = None) -> Prior | None:
        """The prior of a new run of *signature* (``None``: too few earlier runs, or priors off).

        *exclude*: the new run's own key (``host/container``): a run is never its own prior.
        """
        c = self.config
        if c.min_runs <= 0:
            return None
        runs = self._runs.get(signature)
        if not runs:
            return None
        memo = self._memo.setdefault(signature, {})
        mk = exclude if exclude in runs else None  # a run not in the book leaves nothing out
        if mk in memo:
            return memo[mk]
        memo[mk] = got = self._prior(signature, runs, mk)
        return got

    def _prior(self, signature: str, runs: dict[str, ExecutionProfile], exclude: str | None) -> Prior | None:
        c = self.config
        seen = [p for k, p in runs.items() if k != exclude and p.ts - p.start >= c.min_run_s]
        if len(seen) < c.min_runs:
            return None
        cpu = max(p.cpu_peak_cores for p in seen)
        mem = max(p.mem_peak_bytes for p in seen)
        return Prior(signature=signature, runs=len(seen), cpu_cores=cpu * (1.0 + c.margin),
                     mem_bytes=mem * (1.0 + c.margin), cpu_peak_cores=cpu, mem_peak_bytes=mem, margin=c.margin)

    def __len__(self) -> int:
        return len(self._runs)
