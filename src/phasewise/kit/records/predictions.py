"""Horus's prediction of what a submitted job will use (:class:`UtilisationPrediction`, docs/horus.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records.codec import field

__all__ = ["Interval", "UtilisationPrediction"]

@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A predicted quantity: its mean and an interval [lo, hi] at the prediction's coverage."""

    mean: float = field(minimum=0)
    lo: float = field(minimum=0)
    hi: float = field(minimum=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilisationPrediction:
    """What a submitted job will use, predicted from its computation graph before it runs (key: job)."""

    VERSION: ClassVar[int] = 1
    job: str = field()
    ts: float = field(minimum=0)
    model_version: int = field(minimum=0, doc="jobs the model had learned from when it predicted")
    device: str | None = field(default=None, doc="GPU model the prediction is for; null = any")
    gpu_util: Interval = field(doc="mean GPU utilisation over the steady phase, percent of one GPU (0-100)")
    gpu_mem_bytes: Interval = field(doc="GPU memory, bytes")
    cpu_cores: Interval = field(doc="mean CPU cores over the steady phase")
    mem_bytes: Interval = field(doc="host memory (working set), bytes")
    coverage: float = field(minimum=0, maximum=1, doc="nominal probability that [lo, hi] holds the observed value")
    first_sight: bool = field(default=True, doc="no job of this model had been observed")
    features: dict = field(default={}, doc="the graph features the prediction used")
    observed: dict = field(default={}, max_items=8,
                           doc="once the job is learned: target -> mean over its steady phase (the same prediction "
                               "published again with what was observed)")
    log_error: dict = field(default={}, max_items=8,
                            doc="once the job is learned: target -> |log1p(predicted mean) - log1p(observed)|")
    v: int = field(default=1)
