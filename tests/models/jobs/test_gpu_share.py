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
