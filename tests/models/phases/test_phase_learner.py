"""The one learner of the shared phase model: warm-up steps, snapshots, re-basing."""

from __future__ import annotations

import numpy as np

from phasewise.kit.records import ModelSnapshot
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.learner import Learner
from phasewise.models.phases.snapshots import model_name, model_of
from tests.models.phases.test_phase_updater import regime, warm_model

NAME = model_name()
T = 1.7e9  # wall time a snapshot is published at


def test_a_cold_learner_takes_small_steps_until_warm_then_one_step_per_batch(monkeypatch):
    import phasewise.models.phases.learner as pa

    steps: list[int] = []
    real = pa.learn

    def counting(model, windows, **kw):
        steps.append(len(windows))
        assert all(len(v) == len(windows) for v in kw.values() if v is not None)  # the slices line up
        return real(model, windows, **kw)

    monkeypatch.setattr(pa, "learn", counting)
    lr = Learner(PhaseModel(features=("cpu", "mem"), seed=1, warmup=64))
    W = np.array([[regime(t + k) for k in range(lr.model.window_len)] for t in range(100)])
    levels = W[:, -1] * 1.5
    assert lr.learn(W, np.full(100, -1), W[:, -1], levels) == 100
    assert steps == [16, 16, 16, 16, 36]  # warm after 64 windows: the rest in one step
    assert lr.learn(W, np.full(100, -1), W[:, -1]) == 100
    assert steps[-1] == 100 and lr.samples_seen == 200 and lr.model.crbm.n_seen == 200


def test_the_learner_publishes_monotonic_versions_only_after_learning_and_rebases_on_newer_ones():
    m = warm_model()
    lr = Learner(m.clone(), version=3)
    assert lr.snapshot(T) is None
    W = np.array([[regime(t + k) for k in range(3)] for t in range(10)])
    lr.learn(W, np.full(10, -1), W[:, -1])
    s = lr.snapshot(T)
    assert s is not None and s.version == 4 and s.samples_seen == 10 and lr.snapshot(T) is None
    assert model_of(s).to_bytes() == lr.model.to_bytes()
    newer = ModelSnapshot(name=NAME, ts=1.0, version=9, payload_b64=s.payload_b64, samples_seen=99)
    assert lr.rebase(newer, model_of(newer)) and lr.version == 9 and not lr.rebase(s, model_of(s))
