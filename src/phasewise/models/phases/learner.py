"""The phase learner: the one trainer of the model every worker's detectors share, publishing the next snapshot
when it learned something. Pure: the agent decodes and publishes. docs/phases.md, "In the worker".
"""

from __future__ import annotations

import numpy as np

from phasewise.kit.records import ModelSnapshot
from phasewise.models.phases.detector import PhaseModel, learn
from phasewise.models.phases.snapshots import snapshot_of

__all__ = ["Learner"]


class Learner:
    """The one trainer of the shared model (state of the learner agent)."""

    def __init__(self, model: PhaseModel, version: int = 0, samples_seen: int = 0) -> None:
        self.model = model
        self.version = version  # version this model descends from / was published as
        self.samples_seen = samples_seen
        self.dirty = False

    def rebase(self, snap: ModelSnapshot, model: PhaseModel) -> bool:
        """Continue from a newer snapshot someone else published (e.g. the previous owner)."""
        if snap.version <= self.version:
            return False
        self.model, self.version, self.samples_seen = model.clone(), snap.version, snap.samples_seen
        return True

    #: while the CRBM is cold (fewer than its warm-up windows seen) a batch is learned in CD steps of
    #: this many windows, so that a cold model takes many small steps before phases are assigned
    #: (steady state: one step per batch, which is what makes large batches cheap)
    WARMUP_STEP = 16

    def learn(self, windows: np.ndarray, prev_phase: np.ndarray, usage: np.ndarray,
              levels: np.ndarray | None = None) -> int:
        """Train on a learn batch's arrays (:func:`phasewise.kit.records.learn_batches.decode_learn_batch`);
        returns the windows learned."""
        n = len(windows)
        if not n:
            return 0
        m = self.model
        i = 0
        while i < n:
            k = n - i if m.crbm.n_seen >= m.warmup else self.WARMUP_STEP
            sl = slice(i, i + k)
            learn(m, windows[sl], stats_phases=prev_phase[sl], usage=usage[sl],
                  levels=None if levels is None else levels[sl])
            i += k
        self.samples_seen += n
        self.dirty = True
        return len(windows)

    def snapshot(self, ts: float) -> ModelSnapshot | None:
        """The next snapshot, published at *ts* (wall time), if the model learned since the last one
        (then marks it published)."""
        if not self.dirty:
            return None
        self.version += 1
        self.dirty = False
        return snapshot_of(self.model, self.version, self.samples_seen, ts)
