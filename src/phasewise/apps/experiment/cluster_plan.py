"""The workload of ``phasewise experiment cluster``: which jobs arrive when, pure (no IO but reading the trace).

Arrivals keep the inter-arrival times of a real trace (the Pollux artifact's
workloads, sampled by its authors from Microsoft's Philly trace), scaled so the
first *n* arrivals span a few minutes; the mix is training jobs with loss targets
(small MLPs of different widths), one inference service and interactive
sessions, with mixed priorities. docs/results.md, "Jobs through every role".
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PlannedJob", "TraceError", "default_trace", "plan", "read_arrivals", "scale_arrivals"]

#: the Pollux artifact's first evaluation workload (160 job arrivals sampled from the Philly trace)
TRACE_NAME = "pollux-traces/workloads/workload-1.csv"
#: the training jobs' hidden widths: different models, so horus sees different graphs and CPU needs
WIDTHS = (64, 128, 256, 384)
#: the trainer's loss objective and acceptable loss (its MSE to the teacher; measured: about 0.1 at the
#: start, under 0.002 after a few hundred to a few thousand steps, by width)
OBJECTIVE = 0.002
ACCEPTABLE = 0.005
#: an interactive session's share of the jobs (one in INTERACTIVE_EVERY)
INTERACTIVE_EVERY = 6


class TraceError(ValueError):
    """The trace cannot be read; ``str(e)`` says why."""


@dataclass(frozen=True, slots=True)
class PlannedJob:
    """One job of the run: what to submit and when (seconds after the start)."""

    job: str
    kind: str  #: train | service | interactive
    arrival_s: float
    priority: int
    cpu: float  #: requested cores
    mem_bytes: int
    seconds: float  #: how long it runs at most (a training job usually stops at its objective first)
    hidden: int = 256  #: training: the MLP's hidden width
    seed: int = 0

    @property
    def workload(self) -> str:
        return {"train": "training", "service": "inference", "interactive": "interactive"}[self.kind]

    @property
    def model(self) -> str:
        """The catalog name of what it runs (horus predicts from it)."""
        if self.kind == "service":
            return "mlp-64x256x256x256x10-relu"
        if self.kind == "interactive":
            return "mlp-64x64x8-relu"
        return f"mlp-64x{self.hidden}x{self.hidden}x8-relu"


def default_trace() -> Path:
    return Path(__file__).resolve().parents[5] / "shared" / "data" / TRACE_NAME


def read_arrivals(path: Path) -> list[float]:
    """The ``time`` column (seconds) of a Pollux workload CSV, sorted."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror or e} (the Pollux workloads are in ../shared/data/pollux-traces)") \
            from None
    try:
        times = sorted(float(r["time"]) for r in rows)
    except (KeyError, TypeError, ValueError):
        raise TraceError(f"{path}: not a Pollux workload (needs a numeric 'time' column)") from None
    if len(times) < 2:
        raise TraceError(f"{path}: fewer than two arrivals")
    return times


def scale_arrivals(times: list[float], n: int, span_s: float) -> list[float]:
    """The first *n* arrivals' offsets from the first, scaled so the last is at *span_s*.

    The trace's inter-arrival gaps keep their proportions; with more jobs than the trace has
    arrivals, the gaps repeat.

    >>> scale_arrivals([100, 110, 130, 170], 4, 14.0)
    [0.0, 2.0, 6.0, 14.0]
    >>> scale_arrivals([0, 1, 3], 5, 8.0)
    [0.0, 1.333, 4.0, 5.333, 8.0]
    """
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    out = [0.0]
    for i in range(n - 1):
        out.append(out[-1] + gaps[i % len(gaps)])
    last = out[-1]
    if last <= 0:
        return [span_s * i / max(1, n - 1) for i in range(n)]
    return [round(t * span_s / last, 3) for t in out]


def plan(n: int, *, arrivals: list[float], seed: int = 0, train_s: float = 40.0, service_s: float = 90.0,
         interactive_s: float = 20.0, tag: str = "") -> list[PlannedJob]:
    """*n* jobs at *arrivals*: the service third, an interactive session every few, training the rest.

    Priorities are mixed: training 0 (best effort) or 1, interactive 2, the service 3.

    >>> jobs = plan(8, arrivals=[float(i) for i in range(8)], seed=1)
    >>> [j.kind for j in jobs]
    ['train', 'train', 'service', 'train', 'train', 'interactive', 'train', 'train']
    >>> len({j.job for j in jobs}), jobs[2].priority
    (8, 3)
    """
    if n < 1:
        raise ValueError("n must be at least 1")
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        at = arrivals[i]
        name = f"{tag}{i:02d}"
        if i == 2 or (n < 3 and i == n - 1 and n > 1):
            out.append(PlannedJob(f"svc-{name}", "service", at, 3, 0.5, 600 * 2**20, service_s, seed=i))
        elif i % INTERACTIVE_EVERY == INTERACTIVE_EVERY - 1:
            out.append(PlannedJob(f"int-{name}", "interactive", at, 2, 0.25, 300 * 2**20, interactive_s, seed=i))
        else:
            out.append(PlannedJob(f"train-{name}", "train", at, rnd.choice((0, 0, 1)), 0.5, 500 * 2**20,
                                  train_s, hidden=WIDTHS[rnd.randrange(len(WIDTHS))], seed=i))
    return out
