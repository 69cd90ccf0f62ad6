"""Decaying exponential histograms, checked against numbers computed by hand."""

from __future__ import annotations

import json
import math
import random

import pytest

from phasewise.models.vpa.histogram import DecayingHistogram, ExponentialBuckets, HistogramStateError

# first=1, ratio=2: bucket starts 0, 1, 3, 7, 15, 31, 63, 127 (the last, open bucket)
SIMPLE = ExponentialBuckets(first=1.0, ratio=2.0, max_value=100.0)
CPU = ExponentialBuckets(first=0.01, ratio=1.05, max_value=1000.0)
MEM = ExponentialBuckets(first=1e7, ratio=1.05, max_value=1e12)


def test_bucket_count_and_starts_follow_the_geometric_formula():
    assert SIMPLE.num_buckets == 8  # ceil(log2(100 * 1 / 1 + 1)) + 1
    assert [SIMPLE.start(i) for i in range(8)] == [0, 1, 3, 7, 15, 31, 63, 127]
    assert CPU.num_buckets == 176  # ceil(log(1000 * 0.05 / 0.01 + 1) / log 1.05) + 1
    assert CPU.start(1) == pytest.approx(0.01)
    assert CPU.start(2) == pytest.approx(0.0205)  # 0.01 + 0.0105
    assert CPU.start(CPU.num_buckets - 1) >= 1000.0 > CPU.start(CPU.num_buckets - 2)


def test_values_fall_into_the_bucket_whose_range_holds_them():
    assert [SIMPLE.find_bucket(v) for v in (0.0, 0.99, 1.0, 2.99, 3.0, 6.9, 7.0)] == [0, 0, 1, 1, 2, 2, 3]
    assert SIMPLE.find_bucket(1e9) == 7  # above the range: the last bucket
    assert SIMPLE.find_bucket(-1.0) == 0 and SIMPLE.find_bucket(math.nan) == 0
    assert CPU.find_bucket(0.005) == 0 and CPU.find_bucket(0.02) == 1 and CPU.find_bucket(0.0205) == 2
    assert CPU.find_bucket(1.0) == 36  # log(1 * 0.05 / 0.01 + 1) / log(1.05) = 36.7


def test_every_bucket_start_maps_back_to_its_own_bucket():
    for b in (CPU, MEM):
        for i in range(b.num_buckets):
            assert b.find_bucket(b.start(i)) == i
    rng = random.Random(1)
    for _ in range(5000):
        v = rng.uniform(0, 1200)
        i = CPU.find_bucket(v)
        assert CPU.start(i) <= v and (i == CPU.num_buckets - 1 or v < CPU.start(i + 1))


def weighted() -> DecayingHistogram:
    h = DecayingHistogram(SIMPLE, half_life=1e9)  # no noticeable decay
    for value, weight in ((0.5, 1.0), (2.0, 2.0), (5.0, 3.0), (10.0, 4.0)):
        h.add(value, weight, t=0.0)
    return h


def test_percentile_is_the_end_of_the_bucket_where_cumulative_weight_reaches_it():
    h = weighted()  # buckets 0..3 hold 1, 2, 3, 4 (total 10)
    assert h.percentile(0.0) == 1.0  # first non-empty bucket's end
    assert h.percentile(0.1) == 1.0  # 1 >= 1
    assert h.percentile(0.3) == 3.0  # 1 + 2 >= 3
    assert h.percentile(0.5) == 7.0  # 1 + 2 + 3 >= 5
    assert h.percentile(0.95) == 15.0  # reaches the last non-empty bucket
    assert h.percentile(1.0) == 15.0


def test_percentile_of_the_open_last_bucket_is_its_start():
    h = DecayingHistogram(SIMPLE, half_life=1e9)
    h.add(1e6, 1.0, t=0.0)
    assert h.percentile(0.5) == 127.0


def test_an_empty_histogram_is_empty_and_answers_zero():
    h = DecayingHistogram(SIMPLE, half_life=10.0)
    assert h.is_empty() and h.percentile(0.9) == 0.0
    h.add(2.0, 1.0, t=0.0)
    assert not h.is_empty()


def test_a_sample_one_half_life_later_weighs_twice_as_much():
    h = DecayingHistogram(SIMPLE, half_life=10.0)
    h.add(2.0, 1.0, t=0.0)
    h.add(5.0, 1.0, t=10.0)
    h.add(10.0, 1.0, t=20.0)
    assert h.weights() == pytest.approx({1: 1.0, 2: 2.0, 3: 4.0})
    assert h.total_weight == pytest.approx(7.0)
    # median: 1 + 2 < 3.5 <= 1 + 2 + 4, so the newest sample's bucket
    assert h.percentile(0.5) == 15.0


def test_the_reference_moves_forward_after_100_half_lives_without_changing_ratios():
    h = DecayingHistogram(SIMPLE, half_life=1.0)
    h.add(2.0, 1.0, t=0.0)
    h.add(5.0, 1.0, t=99.0)  # stored weight 2**99
    h.add(10.0, 1.0, t=101.0)  # beyond reference + 100 half-lives: shift to 101
    assert h.reference == 101.0
    # 2**-101 fell below epsilon and is gone; 2**99 -> 2**-2; the new one weighs 2**0
    assert h.weights() == pytest.approx({2: 0.25, 3: 1.0})
    assert h.total_weight == pytest.approx(1.25)


def test_subtracting_a_sample_removes_its_weight_and_never_goes_negative():
    h = DecayingHistogram(SIMPLE, half_life=10.0)
    h.add(2.0, 1.0, t=0.0)
    h.add(5.0, 1.0, t=0.0)
    h.subtract(5.0, 1.0, t=0.0)
    assert h.weights() == pytest.approx({1: 1.0}) and h.total_weight == pytest.approx(1.0)
    assert h.percentile(1.0) == 3.0
    h.subtract(2.0, 5.0, t=0.0)  # more than is there: the bucket empties
    assert h.is_empty() and h.total_weight == 0.0
    with pytest.raises(ValueError):
        h.add(1.0, -1.0, t=0.0)


def test_merging_equals_adding_every_sample_to_one_histogram():
    a = DecayingHistogram(SIMPLE, half_life=10.0)
    b = DecayingHistogram(SIMPLE, half_life=10.0)
    both = DecayingHistogram(SIMPLE, half_life=10.0)
    for h, v, t in ((a, 2.0, 0.0), (b, 5.0, 10.0), (b, 10.0, 12.0)):
        h.add(v, 1.0, t)
        both.add(v, 1.0, t)
    a.merge(b)
    # a's reference moved to b's (10): its sample now weighs 0.5
    assert a.reference == 10.0
    assert a.weights() == pytest.approx({1: 0.5, 2: 1.0, 3: 2 ** 0.2})
    ratio = both.total_weight / a.total_weight
    assert {k: v * ratio for k, v in a.weights().items()} == pytest.approx(both.weights())
    for p in (0.1, 0.3, 0.5, 0.9):
        assert a.percentile(p) == both.percentile(p)
    # the other way round: the newer histogram absorbs the older one without moving
    c = DecayingHistogram(SIMPLE, half_life=10.0)
    c.add(5.0, 1.0, 10.0)
    d = DecayingHistogram(SIMPLE, half_life=10.0)
    d.add(2.0, 1.0, 0.0)
    c.merge(d)
    assert c.reference == 10.0 and c.weights() == pytest.approx({1: 0.5, 2: 1.0})
    with pytest.raises(ValueError):
        c.merge(DecayingHistogram(SIMPLE, half_life=5.0))


def test_serialisation_round_trips_weights_and_percentiles():
    h = weighted()
    state = json.loads(json.dumps(h.to_state()))
    assert state["b"] == [0, 2500, 1, 5000, 1, 7500, 1, 10000]  # gaps and weights scaled to max 10000
    back = DecayingHistogram(SIMPLE, half_life=1e9).load_state(state)
    assert back.weights() == pytest.approx(h.weights())
    assert back.total_weight == pytest.approx(10.0) and back.reference == 0.0
    for p in (0.0, 0.1, 0.3, 0.5, 0.95):
        assert back.percentile(p) == h.percentile(p)


def test_a_realistic_stream_of_10k_samples_serialises_in_a_few_hundred_bytes():
    rng = random.Random(7)
    h = DecayingHistogram(CPU, half_life=86400.0)
    for i in range(10_000):
        h.add(max(0.0, rng.gauss(1.5, 0.5)), 1.0, t=1.7e9 + 10.0 * i)
    blob = json.dumps(h.to_state(), separators=(",", ":"))
    assert len(blob) < 1024
    back = DecayingHistogram(CPU, half_life=86400.0).load_state(json.loads(blob))
    for p in (0.5, 0.9, 0.95):
        assert back.percentile(p) == h.percentile(p)


def test_even_a_histogram_with_every_bucket_filled_stays_under_2_kib():
    h = DecayingHistogram(CPU, half_life=86400.0)
    for i in range(CPU.num_buckets):
        h.add(CPU.start(i), 1.0 + (i % 7), t=0.0)
    assert len(h.weights()) == CPU.num_buckets
    assert len(json.dumps(h.to_state(), separators=(",", ":"))) < 2048


@pytest.mark.parametrize("state, why", [
    ({"r": 0.0, "t": 1.0}, "malformed"),
    ({"r": 0.0, "t": -1.0, "b": []}, "total weight"),
    ({"r": 0.0, "t": 1.0, "b": [9, 1]}, "outside"),
    ({"r": 0.0, "t": 1.0, "b": [1, -3]}, "invalid entry"),
    ({"r": 0.0, "t": 1.0, "b": [1]}, "malformed"),
])
def test_loading_a_broken_state_says_what_is_wrong(state, why):
    with pytest.raises(HistogramStateError, match=why):
        DecayingHistogram(SIMPLE, half_life=1.0).load_state(state)


def test_buckets_grow_geometrically_and_a_percentile_is_the_end_of_its_bucket():
    """The module's former example: bucket starts 0, 1, 3, 7, ...; a later sample weighs twice an hour on."""
    b = ExponentialBuckets(first=1.0, ratio=2.0, max_value=100.0)
    assert (b.num_buckets, b.find_bucket(0.5), b.find_bucket(1.0), b.find_bucket(2.9)) == (8, 0, 1, 1)
    assert (b.start(1), b.start(2), b.start(3)) == (1.0, 3.0, 7.0)
    h = DecayingHistogram(b, half_life=3600.0)
    h.add(2.0, 1.0, t=0.0)  # bucket 1 = [1, 3)
    h.add(5.0, 1.0, t=3600.0)  # bucket 2 = [3, 7), twice the weight an hour later
    assert (h.percentile(0.3), h.percentile(0.5)) == (3.0, 7.0)
