"""Detector step: batched == per-container, PhaseChange records, state size, snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.kit.records import PhaseChange, from_dict
from phasewise.models.phases.checkpoint import CheckpointError
from phasewise.models.phases.detector import PhaseModel, Windows, detect, learn


def frames_for(rng, n_containers: int, t: int) -> np.ndarray:
    """Containers alternating between idle and busy with per-container offsets."""
    busy = ((t + np.arange(n_containers) * 7) // 15) % 2 == 1
    cpu = np.where(busy, rng.uniform(0.9, 1.1, n_containers), rng.uniform(0.0, 0.05, n_containers))
    mem = np.where(busy, rng.uniform(8e8, 9e8, n_containers), rng.uniform(1e8, 1.2e8, n_containers))
    return np.c_[cpu, mem]


@pytest.fixture(scope="module")
def warm_model() -> PhaseModel:
    rng = np.random.default_rng(0)
    m = PhaseModel(features=("cpu", "mem"), warmup=64, seed=0)
    w = Windows(m.window_len, m.n_features)
    ids = [f"c{i}" for i in range(40)]
    for t in range(120):
        res = detect(m, w, ids, frames_for(rng, 40, t), float(t))
        if res.ready.any():
            learn(m, res.windows[res.ready], stats_phases=res.prev_phase, usage=frames_for(rng, 40, t))
    assert m.ready and m.clusterer.n_phases >= 2
    return m


def test_batched_detect_equals_the_per_container_path(warm_model):
    rng = np.random.default_rng(1)
    ids = [f"k{i}" for i in range(30)]
    batched, single = Windows(warm_model.window_len, 2), Windows(warm_model.window_len, 2)
    for t in range(60):
        X = frames_for(rng, 30, t)
        b = detect(warm_model, batched, ids, X, float(t), host="h1")
        per = [detect(warm_model, single, [c], X[i : i + 1], float(t), host="h1") for i, c in enumerate(ids)]
        np.testing.assert_array_equal(b.phase, [p.phase[0] for p in per])
        np.testing.assert_array_equal(b.changed, [p.changed[0] for p in per])
        np.testing.assert_array_equal(b.since, [p.since[0] for p in per])
        np.testing.assert_array_equal(b.prev_phase, [p.prev_phase[0] for p in per])
        assert b.changes == [c for p in per for c in p.changes]


def test_phase_changes_are_valid_phasechange_records(warm_model):
    rng = np.random.default_rng(2)
    w = Windows(warm_model.window_len, 2)
    ids = [f"p{i}" for i in range(20)]
    changes = []
    for t in range(60):
        changes += detect(warm_model, w, ids, frames_for(rng, 20, t), 1000.0 + t, host="h9").changes
    assert changes, "idle/busy containers must change phase"
    for c in changes:
        rec = from_dict(PhaseChange, {**c, "v": 1})
        assert rec.host == "h9" and rec.since <= rec.ts
        assert rec.old_phase is None or rec.old_phase != rec.new_phase
    second = [c for c in changes if c["old_phase"] is not None]
    assert second and all(c["stats"] for c in second)


def test_phase_is_unknown_until_the_window_is_full():
    m = PhaseModel(features=("cpu", "mem"), n_his=3, warmup=0)
    m.clusterer.learn_one(np.zeros(m.n_hid))
    w = Windows(m.window_len, 2)
    seen = [int(detect(m, w, ["a"], np.array([[0.5, 1e8]]), float(t)).phase[0]) for t in range(5)]
    assert seen[:3] == [-1, -1, -1] and seen[3] >= 0


def test_state_per_container_stays_under_4_kib():
    m = PhaseModel(features=("cpu", "mem", "gpu", "gpu_mem"))
    w = Windows(m.window_len, m.n_features)
    rng = np.random.default_rng(3)
    ids = [f"pod-{i:05d}-trainer-{'x' * 20}" for i in range(2000)]
    detect(m, w, ids, rng.uniform(0, 1, (2000, 4)), 0.0)
    assert w.state_bytes() <= 4096


def test_a_container_twice_in_one_batch_is_rejected():
    m = PhaseModel()
    with pytest.raises(ValueError, match="twice"):
        detect(m, Windows(m.window_len, 2), ["a", "a"], np.zeros((2, 2)), 0.0)
    with pytest.raises(ValueError, match="shape"):
        detect(m, Windows(m.window_len, 2), ["a"], np.zeros((1, 3)), 0.0)


def test_snapshot_round_trip_gives_the_same_phases_and_rejects_other_versions(warm_model, monkeypatch):
    rng = np.random.default_rng(4)
    W = np.stack([frames_for(rng, 50, t) for t in range(warm_model.window_len)], axis=1)
    m2 = PhaseModel.from_bytes(warm_model.to_bytes())
    np.testing.assert_array_equal(m2.predict(W), warm_model.predict(W))
    blob = warm_model.to_bytes()
    monkeypatch.setattr(PhaseModel, "VERSION", 7)
    with pytest.raises(CheckpointError, match="version"):
        PhaseModel.from_bytes(blob)


def test_learn_with_copy_leaves_the_snapshot_untouched(warm_model):
    rng = np.random.default_rng(5)
    W = np.stack([frames_for(rng, 50, t) for t in range(warm_model.window_len)], axis=1)
    before = warm_model.to_bytes()
    new = learn(warm_model, W, copy=True)
    assert warm_model.to_bytes() == before
    assert new.crbm.n_seen == warm_model.crbm.n_seen + 50
