"""Moving-window baselines against hand computations and numpy."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.models.policy import LimitPolicy
from phasewise.models.scoring.baselines import WindowPolicy, percentile, window_family


def test_window_max_is_the_maximum_of_the_last_w_samples():
    p = WindowPolicy(window=3, stat="max")
    got = []
    for t, cpu in enumerate([2.0, 5.0, 1.0, 1.0, 1.0, 3.0]):
        got.append(p.limits(float(t)).get("cpu"))
        p.observe(float(t), {"cpu": cpu})
    # before t: [], [2], [2,5], [2,5,1], [5,1,1], [1,1,1]
    assert got == [None, 2.0, 5.0, 5.0, 5.0, 1.0]


def test_window_p95_with_margin_matches_a_hand_computation():
    p = WindowPolicy(window=5, stat="p95", margin=1.15)
    for t, v in enumerate([10.0, 0.0, 30.0, 20.0, 40.0, 50.0]):  # window keeps 0, 30, 20, 40, 50
        p.observe(float(t), {"mem": v})
    # sorted 0 20 30 40 50; rank 0.95 * 4 = 3.8 -> 40 + 0.8 * 10 = 48; x 1.15 = 55.2
    assert p.limits(6.0)["mem"] == pytest.approx(55.2)


def test_percentile_matches_numpy_on_random_windows():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 17, 60):
        x = rng.exponential(size=n)
        assert percentile(sorted(x.tolist()), 95) == pytest.approx(np.percentile(x, 95))


def test_the_sliding_p95_matches_numpy_over_a_long_stream():
    rng = np.random.default_rng(1)
    x = rng.gamma(2.0, size=300)
    p = WindowPolicy(window=30, stat="p95", margin=1.0)
    for i, v in enumerate(x):
        if i:
            assert p.limits(float(i))["gpu"] == pytest.approx(np.percentile(x[max(0, i - 30):i], 95))
        p.observe(float(i), {"gpu": float(v)})


def test_each_resource_keeps_its_own_window_and_missing_values_are_skipped():
    p = WindowPolicy(window=2, stat="max")
    p.observe(0.0, {"cpu": 1.0, "mem": 100.0})
    p.observe(1.0, {"cpu": 2.0})
    p.observe(2.0, {"cpu": 3.0, "mem": float("nan")})
    assert p.limits(3.0) == {"cpu": 3.0, "mem": 100.0}
    assert p.explain()["samples"] == {"cpu": 2, "mem": 1}


def test_window_policies_meet_the_limit_policy_contract():
    for name, make in window_family().items():
        p = make()
        assert isinstance(p, LimitPolicy) and p.name == name
    assert sorted(window_family((5, 60))) == ["window-max-5", "window-max-60",
                                              "window-p95x1.15-5", "window-p95x1.15-60"]


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"window": 2.5}, {"stat": "mean"}, {"margin": 0}])
def test_bad_window_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        WindowPolicy(**kwargs)


def test_fresh_family_members_share_no_state():
    make = window_family((5,))["window-max-5"]
    a, b = make(), make()
    a.observe(0.0, {"cpu": 9.0})
    assert b.limits(1.0) == {}
