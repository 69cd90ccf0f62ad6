"""Phase clusterer: stable ids under drift, new regimes, bounded count, merges; quantile stats."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.models.phases.checkpoint import CheckpointError
from phasewise.models.phases.clusterer import PhaseClusterer, PhaseStats


def blob(rng, centre, n, dim=4, spread=0.02):
    return rng.normal(centre, spread, size=(n, dim))


def test_phase_ids_persist_while_their_centroids_drift():
    rng = np.random.default_rng(0)
    cl = PhaseClusterer(max_phases=6, resources=("cpu",))
    cl.learn_many(blob(rng, 0.2, 50))
    cl.learn_many(blob(rng, 0.8, 50))
    assert cl.phase_ids == [0, 1]
    for step in range(200):  # phase 0 drifts from 0.2 to 0.45 in small steps
        centre = 0.2 + 0.25 * step / 199
        ids_a = cl.learn_many(blob(rng, centre, 10))
        ids_b = cl.learn_many(blob(rng, 0.8, 10))
        assert set(ids_a.tolist()) == {0} and set(ids_b.tolist()) == {1}
    assert cl.phase_ids == [0, 1]
    assert abs(cl.centroid(0).mean() - 0.45) < 0.05


def test_a_new_regime_opens_a_new_id_and_leaves_old_ids_alone():
    rng = np.random.default_rng(1)
    cl = PhaseClusterer(max_phases=6, resources=("cpu",))
    cl.learn_many(blob(rng, 0.1, 100))
    cl.learn_many(blob(rng, 0.9, 100))
    new = cl.learn_many(blob(rng, [0.1, 0.9, 0.1, 0.9], 100))
    assert set(new.tolist()) == {2}
    assert cl.predict_one(np.full(4, 0.1)) == 0 and cl.predict_one(np.full(4, 0.9)) == 1


def test_phase_count_is_bounded_and_far_points_join_the_nearest_when_full():
    rng = np.random.default_rng(2)
    cl = PhaseClusterer(max_phases=5, merge_factor=0.0, resources=("cpu",))
    for k in range(30):
        ids = cl.learn_many(blob(rng, [3.0 * k, 0, 0, 0], 20))  # each regime far from all others
        assert cl.n_phases <= 5
        assert set(ids.tolist()) <= set(cl.phase_ids)
    assert cl.n_phases == 5


def test_converging_centroids_merge_into_the_older_id_with_both_statistics():
    # two slots only: the converging points cannot open a third phase on the way
    cl = PhaseClusterer(max_phases=2, min_new_distance=0.05, merge_factor=1.0, eta_min=0.2, resources=("cpu",))
    first = cl.learn_one(np.zeros(2))
    second = cl.learn_one(np.array([0.1, 0.0]))
    assert (first, second) == (0, 1)
    cl.update_stats(np.array([0, 1]), np.array([[1.0], [3.0]]))
    rng = np.random.default_rng(3)
    for _ in range(50):  # both phases get points around the middle: they converge
        cl.learn_many(np.c_[rng.normal(0.05, 0.02, 20), rng.normal(0.0, 0.02, 20)])
        if cl.n_phases == 1:
            break
    assert cl.phase_ids == [0]
    assert cl.phase_stats(0)["cpu"]["count"] == 2
    assert cl.phase_stats(0)["cpu"]["max"] == 3.0
    assert cl.phase_stats(1) == {}


def test_ids_are_never_reused_after_a_merge():
    cl = PhaseClusterer(max_phases=2, min_new_distance=0.05, merge_factor=1.0, eta_min=0.5, resources=("cpu",))
    cl.learn_one(np.zeros(2))
    cl.learn_one(np.array([0.1, 0.0]))
    rng = np.random.default_rng(4)
    while cl.n_phases > 1:
        cl.learn_many(np.c_[rng.normal(0.05, 0.03, 20), rng.normal(0.0, 0.03, 20)])
    new = cl.learn_one(np.array([5.0, 5.0]))
    assert new == 2


@pytest.mark.parametrize("dist", ["lognormal", "uniform", "bimodal"])
def test_quantiles_max_and_count_match_numpy(dist):
    rng = np.random.default_rng(5)
    n = 5000
    if dist == "lognormal":
        x = rng.lognormal(0.0, 1.0, n)
    elif dist == "uniform":
        x = rng.uniform(0.5, 2.0, n)
    else:
        x = np.where(rng.random(n) < 0.7, rng.normal(1.0, 0.05, n), rng.normal(10.0, 0.5, n))
    mem = x * 2**30
    st = PhaseStats(3, resources=("cpu", "mem"))
    st.update(np.full(n, 1), np.c_[x, mem])
    s = st.summary(1)
    for q in (0.5, 0.9, 0.95, 0.99):
        exact = np.quantile(x, q)
        assert s["cpu"][f"p{round(q * 100)}"] == pytest.approx(exact, rel=0.02)
        assert s["mem"][f"p{round(q * 100)}"] == pytest.approx(exact * 2**30, rel=0.02)
    assert s["cpu"]["max"] == x.max() and s["cpu"]["count"] == n
    assert st.summary(0) == {}


def test_missing_values_and_unknown_slots_are_skipped():
    st = PhaseStats(2, resources=("cpu", "mem"))
    st.update(np.array([0, -1, 0]), np.array([[1.0, np.nan], [5.0, 5.0], [2.0, 3.0]]))
    assert st.count(0).tolist() == [2, 1]
    assert st.maximum(0).tolist() == [2.0, 3.0]


def test_decaying_statistics_follow_the_recent_level():
    st = PhaseStats(1, resources=("cpu",), half_life=50)
    st.update(np.zeros(1000, int), np.full((1000, 1), 4.0))
    # after 600 samples (12 half-lives) the old level weighs 1000 / 2**12 ~ 0.24 samples
    # against ~72 recent ones: under 5%, so p95 is the recent level
    for _ in range(600):
        st.update(np.zeros(1, int), np.array([[1.0]]))
    assert st.quantiles(0, (0.95,))[0, 0] == pytest.approx(1.0, rel=0.02)


def test_clusterer_checkpoint_round_trip_and_version_check(monkeypatch):
    rng = np.random.default_rng(6)
    cl = PhaseClusterer(resources=("cpu",))
    ids = cl.learn_many(np.r_[blob(rng, 0.2, 50), blob(rng, 0.8, 50)])
    cl.update_stats(ids, rng.uniform(0, 1, (100, 1)))
    cl2 = PhaseClusterer.from_bytes(cl.to_bytes())
    H = rng.uniform(0, 1, (200, 4))
    np.testing.assert_array_equal(cl2.predict_many(H), cl.predict_many(H))
    assert cl2.phase_stats(0) == cl.phase_stats(0)
    blob_ = cl.to_bytes()
    monkeypatch.setattr(PhaseClusterer, "VERSION", 9)
    with pytest.raises(CheckpointError, match="version"):
        PhaseClusterer.from_bytes(blob_)


def test_learn_many_returns_the_same_ids_as_predict_after_learning():
    rng = np.random.default_rng(7)
    cl = PhaseClusterer(resources=("cpu",))
    H = np.r_[blob(rng, 0.2, 30), blob(rng, 0.8, 30)]
    ids = cl.learn_many(H)
    np.testing.assert_array_equal(ids, cl.predict_many(H))
