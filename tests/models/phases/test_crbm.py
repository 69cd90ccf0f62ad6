"""CRBM: hand-checked conditionals, free energy and CD-1 step; learning; seeding; checkpoints."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from phasewise.apps.replay.traces import load_ai4dl, sample_path
from phasewise.models.phases.checkpoint import CheckpointError
from phasewise.models.phases.crbm import CRBM
from phasewise.models.phases.normalize import OnlineNormalizer

# a tiny model: n_vis=2, n_hid=1, n_his=1 with fixed weights
W = np.array([[0.5, -0.3]])
B = np.array([[0.2, 0.1]])
A = np.array([[0.1, 0.0], [0.0, 0.2]])
BH = np.array([0.1])
BV = np.array([0.05, -0.05])
X = np.array([1.0, -1.0, 0.5, 2.0])  # history frame (c), then current frame (v)


def sig(z):
    return 1.0 / (1.0 + np.exp(-z))


def tiny(sigma: float = 1.0, **kw) -> CRBM:
    m = CRBM(n_vis=2, n_hid=1, n_his=1, sigma=sigma, dtype="float64", sample_hidden=False, **kw)
    m.W, m.B, m.A = torch.tensor(W), torch.tensor(B), torch.tensor(A)
    m.b_h, m.b_v = torch.tensor(BH), torch.tensor(BV)
    return m


def by_hand(sigma: float):
    c, v = X[:2] / sigma, X[2:] / sigma
    h0 = sig(W @ v + B @ c + BH)
    v1 = W.T @ h0 + A @ c + BV
    h1 = sig(W @ v1 + B @ c + BH)
    a = A @ c + BV
    free = 0.5 * ((v - a) ** 2).sum() - np.log1p(np.exp(W @ v + B @ c + BH)).sum()
    grads = {
        "W": np.outer(h0, v) - np.outer(h1, v1),
        "B": np.outer(h0, c) - np.outer(h1, c),
        "A": np.outer(v - v1, c),
        "b_h": h0 - h1,
        "b_v": v - v1,
    }
    return h0, v1 * sigma, free, grads


@pytest.mark.parametrize("sigma", [1.0, 0.5])
def test_hidden_probabilities_visible_mean_and_free_energy_match_a_hand_computation(sigma):
    m = tiny(sigma)
    h0, v1, free, _ = by_hand(sigma)
    np.testing.assert_allclose(m.predict_one(X), h0, rtol=1e-12)
    np.testing.assert_allclose(m.reconstruct_many(X[None])[0], v1, rtol=1e-12)
    np.testing.assert_allclose(m.free_energy_many(X[None])[0], free, rtol=1e-12)


def test_free_energy_is_minus_log_of_the_unnormalised_marginal_over_hidden_states():
    m = tiny(1.0)
    c, v = X[:2], X[2:]
    a = A @ c + BV
    bh = B @ c + BH

    def energy(h):
        return 0.5 * ((v - a) ** 2).sum() - h @ bh - h @ (W @ v)

    marg = sum(np.exp(-energy(np.array([h]))) for h in (0.0, 1.0))
    np.testing.assert_allclose(m.free_energy_many(X[None])[0], -np.log(marg), rtol=1e-12)


def test_positive_phase_of_the_gradient_is_the_derivative_of_minus_free_energy():
    m = tiny(1.0)
    Wt = torch.tensor(W, requires_grad=True)
    c, v = torch.tensor(X[:2]), torch.tensor(X[2:])
    a = torch.tensor(A) @ c + torch.tensor(BV)
    hidden = Wt @ v + torch.tensor(B) @ c + torch.tensor(BH)
    free = 0.5 * ((v - a) ** 2).sum() - torch.nn.functional.softplus(hidden).sum()
    (-free).backward()
    h0 = m.predict_one(X)
    np.testing.assert_allclose(Wt.grad.numpy(), np.outer(h0, X[2:]), rtol=1e-12)


@pytest.mark.parametrize("sigma", [1.0, 0.5])
def test_one_cd1_step_moves_every_parameter_along_the_hand_computed_direction(sigma):
    m = tiny(sigma, lr=0.1, momentum=0.0, weight_decay=0.0)
    _, _, _, g = by_hand(sigma)
    got = m.gradients(X[None])
    for name in ("W", "B", "A", "b_h", "b_v"):
        np.testing.assert_allclose(got[name].numpy(), g[name], rtol=1e-12, atol=1e-15)
    before = {n: getattr(m, n).clone().numpy() for n in ("W", "B", "A", "b_h", "b_v")}
    m.learn_one(X)
    for name in before:
        np.testing.assert_allclose(getattr(m, name).numpy() - before[name], 0.1 * g[name], rtol=1e-10, atol=1e-15)
    assert m.n_seen == 1


def ai4dl_windows(n_his: int = 3) -> np.ndarray:
    tr = load_ai4dl(sample_path())
    norm = OnlineNormalizer(2, log_features=(True, True))
    wins = []
    for c in tr.containers:
        F = np.c_[c.usage["cpu"], c.usage["mem"]]
        norm.learn_many(F)
        for i in range(n_his, len(F)):
            wins.append(F[i - n_his : i + 1])
    return norm.transform_many(np.array(wins)).reshape(len(wins), -1)


def test_learning_reduces_reconstruction_error_on_the_real_ai4dl_trace():
    X_ = ai4dl_windows()
    m = CRBM(n_vis=2, n_hid=10, n_his=3, seed=0)
    before = m.reconstruction_error(X_)
    for _ in range(300):
        m.learn_many(X_)
    after = m.reconstruction_error(X_)
    assert after < 0.5 * before, (before, after)


def test_same_seed_same_model_and_different_seed_different_model():
    X_ = ai4dl_windows()
    runs = []
    for seed in (3, 3, 4):
        m = CRBM(n_vis=2, n_hid=5, n_his=3, seed=seed)
        for _ in range(20):
            m.learn_many(X_)
        runs.append(m.predict_many(X_))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.allclose(runs[0], runs[2])


def test_checkpoint_round_trip_keeps_parameters_momentum_and_random_state():
    X_ = ai4dl_windows()
    m = CRBM(n_vis=2, n_hid=5, n_his=3, seed=1)
    for _ in range(5):
        m.learn_many(X_)
    m2 = CRBM.from_bytes(m.to_bytes())
    m3 = pickle.loads(pickle.dumps(m))
    for other in (m2, m3):
        np.testing.assert_array_equal(other.predict_many(X_), m.predict_many(X_))
    # identical continuation: same momentum buffers and generator state
    m.learn_many(X_)
    m2.learn_many(X_)
    np.testing.assert_array_equal(m.W.numpy(), m2.W.numpy())


def test_loading_a_checkpoint_of_another_version_raises_a_clear_error(monkeypatch):
    blob = CRBM(n_vis=2, n_hid=3, n_his=1).to_bytes()
    monkeypatch.setattr(CRBM, "VERSION", 2)
    with pytest.raises(CheckpointError, match="CRBM checkpoint has version 1; this build reads version 2"):
        CRBM.from_bytes(blob)
    with pytest.raises(CheckpointError, match="not a phasewise checkpoint"):
        CRBM.from_bytes(b"garbage")


def test_bad_windows_are_rejected_with_the_expected_shape_in_the_message():
    m = CRBM(n_vis=2, n_hid=3, n_his=1)
    with pytest.raises(ValueError, match=r"expected windows of 4 values"):
        m.learn_many(np.zeros((3, 5)))
    with pytest.raises(ValueError, match="NaN"):
        m.predict_one([0.0, np.nan, 0.0, 0.0])


def test_windows_may_be_given_as_frames_or_dicts():
    m = CRBM(n_vis=2, n_hid=3, n_his=1, seed=0)
    frames = [[0.1, 0.2], [0.3, 0.4]]
    flat = m.predict_one(CRBM.window(frames))
    np.testing.assert_array_equal(m.predict_many(np.array([frames]))[0], flat)
    np.testing.assert_array_equal(m.predict_one({i: v for i, v in enumerate(CRBM.window(frames))}), flat)
