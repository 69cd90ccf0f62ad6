"""Elastic GPU shares: proportional when they fit, priority order when oversubscribed, memory never."""

from __future__ import annotations

import pytest

from phasewise.models.jobs.gpu_share import DoesNotFit, ShareRequest, shares

GiB = 2**30


def pct(s):
    return {x.job: x.sm_percent for x in s}


def test_alone_a_job_gets_the_whole_gpu_and_leftovers_are_shared_in_proportion():
    assert pct(shares([ShareRequest("a", 0.3, GiB)], mem_total_bytes=16 * GiB)) == {"a": 100}
    assert pct(shares([ShareRequest("a", 0.3, GiB), ShareRequest("b", 0.1, GiB)], mem_total_bytes=16 * GiB)) == {
        "a": 75, "b": 25}


def test_oversubscribed_compute_goes_in_priority_order_then_proportionally_with_a_floor():
    s = shares([ShareRequest("lo1", 0.4, GiB), ShareRequest("hi", 0.7, GiB, priority=5),
                ShareRequest("lo2", 0.2, GiB)], mem_total_bytes=16 * GiB)
    assert pct(s) == {"hi": 70, "lo1": 20, "lo2": 10}
    assert sum(pct(s).values()) == 100
    s = shares([ShareRequest("hi", 1.0, GiB, priority=9), ShareRequest("lo", 0.5, GiB)], mem_total_bytes=16 * GiB)
    assert pct(s) == {"hi": 95, "lo": 5}


def test_memory_caps_are_the_requests_and_must_fit():
    s = shares([ShareRequest("a", 0.5, 3 * GiB), ShareRequest("b", 0.5, 5 * GiB)], mem_total_bytes=8 * GiB)
    assert [x.mem_limit_bytes for x in s] == [3 * GiB, 5 * GiB]
    with pytest.raises(DoesNotFit, match="exceed"):
        shares([ShareRequest("a", 0.5, 5 * GiB), ShareRequest("b", 0.5, 5 * GiB)], mem_total_bytes=8 * GiB)


def test_percentages_are_whole_and_never_exceed_100():
    for n in range(1, 20):
        s = shares([ShareRequest(f"j{i}", 0.13, GiB // 32) for i in range(n)], mem_total_bytes=16 * GiB)
        assert sum(pct(s).values()) <= 100 and all(5 <= p <= 100 for p in pct(s).values())


def test_bad_requests():
    with pytest.raises(ValueError, match="fraction"):
        ShareRequest("a", 0.0, 1)
    with pytest.raises(ValueError, match="twice"):
        shares([ShareRequest("a", 0.5, 1), ShareRequest("a", 0.5, 1)], mem_total_bytes=GiB)


def test_the_placement_agent_shares_a_gpu_between_fractional_jobs():
    """A job placed on a share of one GPU comes with the share decisions of every job booked on that GPU
    (its own first); a whole-GPU job with none."""
    from phasewise.models.jobs.gpu_share import placement_shares
    from tests.models.jobs.test_placement_state import GIB, _job, _pred, _sample, _state

    s = _state(place_prediction_wait_s=0.0)
    s.samples(_sample("h1", gpus=1))
    s.submitted(_job("a", gpus=0.5, priority=1), now=0.0)
    s.prediction(_pred("a", 40.0))
    [(da, _)] = s.decide(now=1.0, ts=10.0)
    [alone] = placement_shares(s, da, 10.0)
    assert (alone.action, alone.container, alone.host, alone.details["job"]) == ("share", "a", "h1", "a")
    assert alone.details["sm_percent"] == 100 and alone.details["mem_limit_bytes"] == 4 * GIB
    s.submitted(_job("b", gpus=0.25), now=1.0)
    s.prediction(_pred("b", 20.0))
    [(db, _)] = s.decide(now=2.0, ts=11.0)
    assert db.details["device"] == da.details["device"]
    both = placement_shares(s, db, 11.0)
    assert [(d.container, d.details["sm_percent"]) for d in both] == [("b", 33), ("a", 67)]
    assert all(d.details["device"] == da.details["device"][0] and d.policy == "gpu-share" for d in both)
    assert "proportional part" in both[0].reason
    s.submitted(_job("w", gpus=1.0), now=2.0)
    s.samples(_sample("h2", gpus=1))
    s.prediction(_pred("w", 90.0))
    [(dw, _)] = s.decide(now=3.0, ts=12.0)
    assert placement_shares(s, dw, 12.0) == []
