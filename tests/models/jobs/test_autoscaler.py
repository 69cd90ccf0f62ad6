"""The inference autoscaler: utilisation and SLO rule, cool-downs, bounds."""

from __future__ import annotations

import pytest

from phasewise.models.jobs.autoscaler import Autoscaler, AutoscalerConfig


def scaler(**kw) -> Autoscaler:
    cfg = dict(slo_p99_ms=100, target_util=0.5, min_replicas=1, max_replicas=4, up_cooldown_s=10,
               down_cooldown_s=60, max_step=2)
    return Autoscaler(AutoscalerConfig(**{**cfg, **kw}))


def test_utilisation_scales_like_hpa_within_tolerance_nothing():
    a = scaler()
    assert a.step(now=0, replicas=2, util=0.53, p99_ms=20) is None      # 6 % off target: tolerated
    s = a.step(now=0, replicas=2, util=0.9, p99_ms=20)
    assert (s.current, s.replicas) == (2, 4) and "utilisation" in s.reason


def test_latency_over_the_slo_adds_a_replica_even_at_low_utilisation():
    s = scaler().step(now=0, replicas=1, util=0.3, p99_ms=150)
    assert s.replicas == 2 and "p99 150 ms > SLO 100 ms" in s.reason


def test_no_scale_down_while_latency_is_near_the_slo():
    a = scaler()
    assert a.step(now=0, replicas=3, util=0.1, p99_ms=80) is None        # 80 > 0.5 x 100
    assert a.step(now=0, replicas=3, util=0.1, p99_ms=30).replicas == 1


def test_cool_downs():
    a = scaler()
    assert a.step(now=0, replicas=1, util=0.9, p99_ms=200).replicas == 2
    assert a.step(now=9.9, replicas=2, util=0.9, p99_ms=200) is None     # up cool-down
    assert a.step(now=10, replicas=2, util=0.9, p99_ms=200).replicas == 4
    assert a.step(now=60, replicas=4, util=0.05, p99_ms=5) is None       # down cool-down from the last change
    assert a.step(now=70, replicas=4, util=0.05, p99_ms=5).replicas == 2  # at most max_step down
    assert a.step(now=129, replicas=2, util=0.05, p99_ms=5) is None
    assert a.step(now=130, replicas=2, util=0.05, p99_ms=5).replicas == 1


def test_bounds_and_step_limits():
    a = scaler(max_replicas=3, target_util=0.25)  # wants 4
    assert a.step(now=0, replicas=1, util=1.0, p99_ms=500).replicas == 3   # +2 at most, and max 3
    assert a.step(now=100, replicas=3, util=1.0, p99_ms=500) is None      # at max: nothing to do
    assert scaler().step(now=0, replicas=1, util=0.0, p99_ms=1) is None  # at min
    assert scaler().step(now=0, replicas=7, util=0.5, p99_ms=1).replicas == 4   # outside: back inside at once
    assert scaler().step(now=0, replicas=2, util=None, p99_ms=None) is None   # no signal, no change


def test_state_round_trip_keeps_the_cool_down():
    a = scaler()
    a.step(now=0, replicas=1, util=0.9, p99_ms=200)
    b = Autoscaler.from_state(a.config, a.to_state())
    assert b.step(now=5, replicas=2, util=0.9, p99_ms=200) is None


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalerConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="slo_p99_ms"):
        AutoscalerConfig(slo_p99_ms=0)
