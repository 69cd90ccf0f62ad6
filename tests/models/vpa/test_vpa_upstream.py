"""The Kubernetes VPA recommender's own test cases, run against phasewise's VPA.

Ported from kubernetes/autoscaler at commit 55c37cd5eb550756c5ccc5a89e9068d77797e575
(2026-08-22), ``vertical-pod-autoscaler/pkg/recommender/``: ``util/histogram_test.go``,
``util/decaying_histogram_test.go``, ``util/histogram_options_test.go``,
``logic/estimator_test.go``, ``logic/recommender_test.go``,
``model/aggregate_container_state_test.go`` and ``model/container_test.go``. Each
test names the Go test it ports; constants and expected values are upstream's.

Where phasewise represents a value differently, the test says so and compares
the meaning:

- Go keeps CPU in integer millicores and memory in integer bytes
  (``ResourceAmount``) and truncates every estimator's result to them;
  phasewise's estimators work on floats (cores, bytes) and round only when a
  limit is decided (up to a millicore, in the worker). So where Go's expected
  value is a truncation, the float is checked and its truncation compared.
- "No limit": Go caps a resource at ``MaxResourceAmount`` (1e14 millicores),
  phasewise answers ``inf``.
- Go compares ``3.14 * 1.1`` etc. as exact constant arithmetic, so its
  expected values are the decimal results (3.454), written so here.
- Go's plain ``Histogram`` is a decaying histogram whose samples all share one
  time (decay factor exactly 1), which is how it is run here.
- Times are seconds since the Unix epoch; a histogram reference time rounds
  to a multiple of the half-life from the epoch (Go: from year 1, the same
  multiples for whole hours and days).
- Go's ``AddSample`` returns ``false`` on a negative usage; phasewise raises
  ``ValueError`` (bad input gets a clear error) and learns nothing.
- Go's container tests watch the histograms through a mock; here a histogram
  that records its ``add`` / ``subtract`` calls does.

Not ported (no counterpart in a per-container limit recommender): the pod-level
``TestControlledResourcesFiltered`` / ``...Default`` and
``TestMapToListOfRecommendedContainerResources`` (API formatting),
``TestUpdateFromPolicy*`` (VPA object policy and feature gates), and
``TestAggregateContainerStateIsExpired*`` (garbage collection: phasewise's
worker forgets containers after ``container_ttl_s``, default 8 days as VPA's,
in ``streams/agents/samples.py``).
"""

from __future__ import annotations

import calendar
import math
from dataclasses import dataclass

import pytest

from phasewise.models.vpa.histogram import (
    MAX_CHECKPOINT_WEIGHT,
    DecayingHistogram,
    ExponentialBuckets,
    HistogramStateError,
    LinearBuckets,
)
from phasewise.models.vpa.recommender import (
    STATE_VERSION,
    ConfidenceMultiplier,
    MarginEstimator,
    MinResourceEstimator,
    PercentileEstimator,
    VpaRecommender,
    VpaStateError,
    confidence,
)

HOUR = 3600.0
DAY = 24 * HOUR
KB = 1024
MB = 1024 * KB

# util/histogram_test.go
VALUE_EPSILON = 1e-15  # relative precision of histogram values
WEIGHT_EPSILON = 1e-15  # absolute precision of histogram weights
ANY_TIME = 0.0
TEST_OPTIONS = LinearBuckets(size=1.0, max_value=10.0, epsilon=WEIGHT_EPSILON)

# util/decaying_histogram_test.go
START_TIME = 1234567890.0

# model/aggregations_config.go
MIN_SAMPLE_WEIGHT = 0.1
CPU_OPTIONS = ExponentialBuckets(first=0.01, ratio=1.05, max_value=1000.0, epsilon=0.001 * MIN_SAMPLE_WEIGHT)
MEM_OPTIONS = ExponentialBuckets(first=1e7, ratio=1.05, max_value=1e12, epsilon=0.001 * MIN_SAMPLE_WEIGHT)

# model/container_test.go: "2017-04-18 17:35:05" UTC
TEST_TIMESTAMP = float(calendar.timegm((2017, 4, 18, 17, 35, 5)))


def in_epsilon(expected: float, actual: float, eps: float) -> bool:
    """testify's ``InEpsilon``: relative error at most *eps*."""
    return abs(expected - actual) <= eps * abs(expected)


def histogram(buckets=TEST_OPTIONS, half_life: float = HOUR) -> DecayingHistogram:
    return DecayingHistogram(buckets, half_life)


def checkpoint_buckets(state: dict) -> dict[int, int]:
    """``{bucket: weight}`` of a serialised histogram (its ``b`` is gap-encoded)."""
    out, b, flat = {}, 0, state["b"]
    for i in range(0, len(flat), 2):
        b += flat[i]
        out[b] = flat[i + 1]
    return out


def checkpoint(total: float, weights: dict[int, int], ref: float | None = None) -> dict:
    """A serialised histogram holding upstream's ``HistogramCheckpoint`` fields."""
    flat, prev = [], 0
    for b in sorted(weights):
        flat += [b - prev, weights[b]]
        prev = b
    return {"r": ref, "t": total, "b": flat}


def go_equals(a: DecayingHistogram, b: DecayingHistogram) -> bool:
    """Go's ``decayingHistogram.Equals``: same options, half-life, reference and
    non-empty bucket range, bucket weights within 1e-15."""
    if a.buckets != b.buckets or a.half_life != b.half_life or a.reference != b.reference:
        return False
    eps = a.buckets.epsilon
    wa, wb = a.weights(), b.weights()
    ne_a = [k for k, v in wa.items() if v >= eps]
    ne_b = [k for k, v in wb.items() if v >= eps]
    if (min(ne_a, default=None), max(ne_a, default=None)) != (min(ne_b, default=None), max(ne_b, default=None)):
        return False
    if not ne_a:
        return True
    return all(abs(wa.get(k, 0.0) - wb.get(k, 0.0)) <= 1e-15 for k in range(min(ne_a), max(ne_a) + 1))


# =========================================================================== util/histogram_test.go


def test_percentiles_empty_histogram():
    """Go: TestPercentilesEmptyHistogram."""
    h = histogram()
    for p in (-0.5, 0.0, 0.5, 1.0, 1.5):
        assert h.percentile(p) == 0.0


def test_percentiles():
    """Go: TestPercentiles (histogram {1: 1, 2: 2, 3: 3, 4: 4})."""
    h = histogram()
    for i in range(1, 5):
        h.add(float(i), float(i), ANY_TIME)
    want = {0.0: 2, 0.1: 2, 0.2: 3, 0.3: 3, 0.4: 4, 0.5: 4, 0.6: 4, 0.7: 5, 0.8: 5, 0.9: 5, 1.0: 5}
    for p, v in want.items():
        assert in_epsilon(v, h.percentile(p), VALUE_EPSILON), p


def test_percentile_out_of_bounds():
    """Go: TestPercentileOutOfBounds."""
    h = histogram(LinearBuckets(size=0.1, max_value=1.0, epsilon=WEIGHT_EPSILON))
    h.add(0.1, 0.1, ANY_TIME)
    h.add(0.2, 0.2, ANY_TIME)
    assert in_epsilon(0.2, h.percentile(-0.1), VALUE_EPSILON)
    assert in_epsilon(0.3, h.percentile(1.1), VALUE_EPSILON)
    # fill the boundary buckets
    h.add(0.0, 0.1, ANY_TIME)
    h.add(1.0, 0.2, ANY_TIME)
    assert in_epsilon(0.1, h.percentile(-0.1), VALUE_EPSILON)
    assert in_epsilon(1.0, h.percentile(1.1), VALUE_EPSILON)


def test_empty_histogram():
    """Go: TestEmptyHistogram."""
    h = histogram(LinearBuckets(size=0.1, max_value=1.0, epsilon=WEIGHT_EPSILON))
    assert h.is_empty()
    h.add(0.1, WEIGHT_EPSILON * 2.5, ANY_TIME)  # weight = epsilon * 2.5
    assert not h.is_empty()
    h.subtract(0.1, WEIGHT_EPSILON, ANY_TIME)  # weight = epsilon * 1.5
    assert not h.is_empty()
    h.subtract(0.1, WEIGHT_EPSILON, ANY_TIME)  # weight = epsilon * 0.5
    assert h.is_empty()


def test_non_empty_on_epsilon_addition():
    """Go: TestNonEmptyOnEpsilonAddition."""
    h = histogram(LinearBuckets(size=0.1, max_value=1.0, epsilon=WEIGHT_EPSILON))
    assert h.is_empty()
    h.add(9.9, WEIGHT_EPSILON * 3, ANY_TIME)
    assert not h.is_empty()
    h.add(0.1, WEIGHT_EPSILON * 0.3, ANY_TIME)
    assert not h.is_empty()
    h.add(999.9, WEIGHT_EPSILON * 0.3, ANY_TIME)
    assert not h.is_empty()


def test_histogram_merge():
    """Go: TestHistogramMerge."""
    h1 = histogram()
    h1.add(1, 1, ANY_TIME)
    h1.add(2, 1, ANY_TIME)
    h2 = histogram()
    h2.add(2, 1, ANY_TIME)
    h2.add(3, 1, ANY_TIME)
    expected = histogram()
    for v in (1, 2, 2, 3):
        expected.add(v, 1, ANY_TIME)
    h1.merge(h2)
    assert go_equals(h1, expected)


def test_histogram_save_to_checkpoint_empty():
    """Go: TestHistogramSaveToCheckpointEmpty."""
    s = histogram().to_state()
    assert s["t"] == 0.0
    assert checkpoint_buckets(s) == {}


def test_histogram_save_to_checkpoint():
    """Go: TestHistogramSaveToCheckpoint."""
    h = histogram()
    h.add(1, 1, ANY_TIME)
    s = h.to_state()
    assert s["t"] == 1.0
    assert checkpoint_buckets(s) == {TEST_OPTIONS.find_bucket(1): MAX_CHECKPOINT_WEIGHT}


def test_histogram_save_to_checkpoint_drops_relatively_small_values():
    """Go: TestHistogramSaveToCheckpointDropsRelativelySmallValues."""
    h = histogram()
    v1, w1 = 1.0, 1.0
    v2, w2 = 2.0, 100000.0
    h.add(v1, w1, ANY_TIME)
    h.add(v2, w2, ANY_TIME)
    b1, b2 = TEST_OPTIONS.find_bucket(v1), TEST_OPTIONS.find_bucket(v2)
    assert b1 != b2
    assert w1 < (w2 / MAX_CHECKPOINT_WEIGHT) / 2
    s = h.to_state()
    assert s["t"] == 100001.0  # w1 + w2
    assert checkpoint_buckets(s) == {b2: MAX_CHECKPOINT_WEIGHT}  # bucket 1 is dropped


def test_histogram_save_to_checkpoint_for_multiple_values():
    """Go: TestHistogramSaveToCheckpointForMultipleValues."""
    h = histogram()
    vw = ((1.0, 1.0), (2.0, 10000.0), (3.0, 50.0))
    for v, w in vw:
        h.add(v, w, ANY_TIME)
    b1, b2, b3 = (TEST_OPTIONS.find_bucket(v) for v, _ in vw)
    assert len({b1, b2, b3}) == 3
    s = h.to_state()
    assert s["t"] == 10051.0  # w1 + w2 + w3
    assert checkpoint_buckets(s) == {b1: 1, b2: 10000, b3: 50}


def test_histogram_load_from_checkpoint():
    """Go: TestHistogramLoadFromCheckpoint."""
    h = histogram().load_state(checkpoint(6.0, {0: 1, 1: 2}))
    assert h.total_weight == 6.0
    assert h.weights() == {0: 2.0, 1: 4.0}


@pytest.mark.parametrize(("go_test", "total", "weights"), [
    ("TestHistogramLoadFromCheckpointReturnsErrorOnNegativeBucket", 1.0, {-1: 1}),
    ("TestHistogramLoadFromCheckpointReturnsErrorOnInvalidBucket", 1.0, {99: 1}),
    ("TestHistogramLoadFromCheckpointReturnsErrorNegativeTotaWeight", -1.0, {}),
])
def test_histogram_load_from_checkpoint_returns_error(go_test, total, weights):
    """Go: the three TestHistogramLoadFromCheckpointReturnsError* cases (negative bucket: a negative gap here)."""
    h = histogram()
    with pytest.raises(HistogramStateError):
        h.load_state(checkpoint(total, weights))
    assert h.is_empty()


def test_histogram_load_from_checkpoint_returns_error_on_nil_input():
    """Go: TestHistogramLoadFromCheckpointReturnsErrorOnNilInput."""
    with pytest.raises(HistogramStateError):
        histogram().load_state(None)  # type: ignore[arg-type]


def test_histogram_is_not_empty_after_saving_and_loading_checkpoints_with_boundary_values():
    """Go: TestHistogramIsNotEmptyAfterSavingAndLoadingCheckpointsWithBoundaryValues (autoscaler#7726)."""
    h = histogram()
    h.add(1, WEIGHT_EPSILON, ANY_TIME)
    h.add(2, MAX_CHECKPOINT_WEIGHT * WEIGHT_EPSILON - WEIGHT_EPSILON, ANY_TIME)
    assert not h.is_empty()
    loaded = histogram().load_state(h.to_state())
    assert not loaded.is_empty()


# =========================================================================== util/decaying_histogram_test.go


def test_percentiles_empty_decaying_histogram():
    """Go: TestPercentilesEmptyDecayingHistogram."""
    h = histogram(half_life=HOUR)
    for p in (-0.5, 0.0, 0.5, 1.0, 1.5):
        assert h.percentile(p) == 0.0


def test_simple_decay():
    """Go: TestSimpleDecay."""
    h = histogram(half_life=HOUR)
    h.add(2, 1000, START_TIME)  # a very large weight
    # 20 half-lives later: relatively 2^20 * 0.001 > 1000 times heavier
    h.add(1, 1, START_TIME + 20 * HOUR)
    assert in_epsilon(2, h.percentile(0.999), VALUE_EPSILON)
    assert in_epsilon(3, h.percentile(1.0), VALUE_EPSILON)


def test_longterm_decay():
    """Go: TestLongtermDecay (the decay factor passes 2^maxDecayExponent)."""
    h = histogram(half_life=HOUR)
    h.add(2, 1, START_TIME)
    h.add(1, 1, START_TIME + 101 * HOUR)
    assert in_epsilon(2, h.percentile(1.0), VALUE_EPSILON)


def test_decaying_histogram_percentiles():
    """Go: TestDecayingHistogramPercentiles (values and weights 1..4, one half-life apart)."""
    h = histogram(half_life=HOUR)
    t = START_TIME
    for i in range(1, 5):
        h.add(float(i), float(i), t)
        t += HOUR
    want = {0.00: 2, 0.02: 2, 0.03: 3, 0.10: 3, 0.11: 4, 0.34: 4, 0.35: 5, 1.00: 5}
    for p, v in want.items():
        assert in_epsilon(v, h.percentile(p), VALUE_EPSILON), p


def test_no_decay():
    """Go: TestNoDecay."""
    h = histogram(half_life=HOUR)
    for i in range(1, 5):
        h.add(float(i), float(i), START_TIME)
    want = {0.0: 2, 0.2: 3, 0.1: 2, 0.3: 3, 0.4: 4, 0.5: 4, 0.6: 4, 0.7: 5, 0.8: 5, 0.9: 5, 1.0: 5}
    for p, v in want.items():
        assert in_epsilon(v, h.percentile(p), VALUE_EPSILON), p


def test_decaying_histogram_merge():
    """Go: TestDecayingHistogramMerge."""
    h1 = histogram(half_life=HOUR)
    h1.add(1, 1, START_TIME)
    h1.add(2, 1, START_TIME + HOUR)
    h2 = histogram(half_life=HOUR)
    h2.add(2, 1, START_TIME + 2 * HOUR)
    h2.add(3, 1, START_TIME + HOUR)
    expected = histogram(half_life=HOUR)
    expected.add(2, 1, START_TIME + 2 * HOUR)
    expected.add(2, 1, START_TIME + HOUR)
    expected.add(3, 1, START_TIME + HOUR)
    expected.add(1, 1, START_TIME)
    h1.merge(h2)
    assert go_equals(h1, expected)


def test_decaying_histogram_save_to_checkpoint():
    """Go: TestDecayingHistogramSaveToCheckpoint."""
    d = histogram(half_life=HOUR)
    d.add(2, 1, START_TIME + 100 * HOUR)
    assert d.reference is not None  # Go: not the zero time
    s = d.to_state()
    assert s["r"] == d.reference
    assert checkpoint_buckets(s) and s["t"] != 0


def test_decaying_histogram_load_from_checkpoint():
    """Go: TestDecayingHistogramLoadFromCheckpoint."""
    timestamp = float(calendar.timegm((2018, 1, 2, 3, 4, 5)))
    d = histogram(half_life=HOUR).load_state(checkpoint(6.0, {0: 1}, ref=timestamp))
    assert not d.is_empty()
    assert d.reference == timestamp


# =========================================================================== util/histogram_options_test.go


def test_linear_histogram_options():
    """Go: TestLinearHistogramOptions."""
    o = LinearBuckets(size=0.3, max_value=5.0, epsilon=0.001)
    assert o.epsilon == 0.001
    assert o.num_buckets == 18
    assert o.start(0) == 0.0
    assert o.start(17) == 5.1
    assert o.find_bucket(-1.0) == 0
    assert o.find_bucket(0.0) == 0
    assert o.find_bucket(1.3) == 4
    assert o.find_bucket(100.0) == 17


def test_exponential_histogram_options():
    """Go: TestExponentialHistogramOptions."""
    o = ExponentialBuckets(first=40.0, ratio=1.5, max_value=500.0, epsilon=0.001)
    assert o.epsilon == 0.001
    assert o.num_buckets == 6
    assert [o.start(i) for i in range(6)] == [0.0, 40.0, 100.0, 190.0, 325.0, 527.5]
    assert o.find_bucket(-1.0) == 0
    assert o.find_bucket(39.99) == 0
    assert o.find_bucket(40.0) == 1
    assert o.find_bucket(100.0) == 2
    assert o.find_bucket(900.0) == 5


# =========================================================================== logic/estimator_test.go


@dataclass(frozen=True)
class Const:
    """Go's ``NewConstCPUEstimator`` / ``NewConstMemoryEstimator``."""

    value: float

    def __call__(self, s: VpaRecommender) -> float:
        return self.value


def cpu_samples(n: int, step: float, t0: float = 0.0) -> VpaRecommender:
    """A recommender fed *n* CPU samples of 1 core, *step* seconds apart (Go: ``s.AddSample`` in a loop)."""
    s = VpaRecommender()
    for i in range(n):
        s.learn_one({"t": t0 + i * step, "cpu": 1.0})
    return s


def test_percentile_estimator():
    """Go: TestPercentileEstimator (histograms with the default options, filled directly)."""
    s = VpaRecommender()
    assert s._cpu.buckets == CPU_OPTIONS and s._mem.buckets == MEM_OPTIONS  # upstream's aggregations config
    for v in (1.0, 2.0, 3.0):
        s._cpu.add(v, 1.0, ANY_TIME)
    for v in (1e9, 2e9, 3e9):
        s._mem.add(v, 1.0, ANY_TIME)
    max_relative_error = 0.05  # histogram rounding
    assert in_epsilon(1.0, PercentileEstimator("cpu", 0.2)(s), max_relative_error)
    assert in_epsilon(2e9, PercentileEstimator("mem", 0.5)(s), max_relative_error)


def test_confidence_multiplier():
    """Go: TestConfidenceMultiplier."""
    cpu, mem = Const(3.14), Const(3.14e9)
    s = VpaRecommender()
    # no history: Go answers MaxResourceAmount (1e14 millicores), phasewise inf: no limit
    assert ConfidenceMultiplier(1.0, 1.0, DAY, cpu)(s) == math.inf
    assert ConfidenceMultiplier(1.0, -1.0, DAY, cpu)(s) == 0.0
    s = cpu_samples(9, 2 * 60.0)
    assert confidence(s, DAY) == 0.00625  # 9 / (60 * 24)
    # 3.14 * (1 + 0.1 / 0.00625) ** 2 = 907.46; 3.14e9 * ... = 9.0746e11
    assert ConfidenceMultiplier(0.1, 2.0, DAY, cpu)(s) == pytest.approx(907.46, rel=1e-15)
    assert ConfidenceMultiplier(0.1, 2.0, DAY, mem)(s) == pytest.approx(9.0746e11, rel=1e-15)


def test_confidence_multiplier_with_custom_interval():
    """Go: TestConfidenceMultiplierWithCustomInterval (an 18-minute confidence interval)."""
    interval = 18 * 60.0
    s = cpu_samples(9, 2 * 60.0)
    assert confidence(s, interval) == 0.5  # 9 / 18
    cores = ConfidenceMultiplier(0.1, 2.0, interval, Const(3.14))(s)
    # 3.14 * (1 + 0.1 / 0.5) ** 2 = 4.5216 cores; Go's 4.521 is that truncated to millicores
    assert cores == pytest.approx(4.5216, rel=1e-15)
    assert math.floor(cores * 1000) / 1000 == 4.521
    assert ConfidenceMultiplier(0.1, 2.0, interval, Const(3.14e9))(s) == pytest.approx(4.5216e9, rel=1e-15)


def test_confidence_multiplier_no_history():
    """Go: TestConfidenceMultiplierNoHistory (Go: 1e14 millicores; phasewise: inf)."""
    assert ConfidenceMultiplier(0.1, 2.0, DAY, Const(3.14))(VpaRecommender()) == math.inf


def test_margin_estimator():
    """Go: TestMarginEstimator (10 % margin)."""
    s = VpaRecommender()
    assert MarginEstimator(0.1, Const(3.14))(s) == 3.454  # Go's constant 3.14*1.1
    assert MarginEstimator(0.1, Const(3.14e9))(s) == 3.454e9


def test_min_resources_estimator():
    """Go: TestMinResourcesEstimator."""
    s = VpaRecommender()
    assert MinResourceEstimator(0.2, Const(3.14))(s) == 3.14
    assert MinResourceEstimator(2e7, Const(4e8))(s) == 4e8


# =========================================================================== logic/recommender_test.go

MIN_CPU_MILLICORES = 25.0
MIN_MEMORY_MB = 250.0


def test_min_resources_applied():
    """Go: TestMinResourcesApplied (constant estimates of 1 millicore and 1e6 bytes under the pod minimums)."""
    min_cpu, min_mem = MIN_CPU_MILLICORES / 1000, MIN_MEMORY_MB * 1024 * 1024
    s = VpaRecommender()
    assert MinResourceEstimator(min_cpu, Const(0.001))(s) == 0.025
    assert MinResourceEstimator(min_mem, Const(1e6))(s) == 250 * MB
    # the same through the recommender's own estimators: 1 millicore and 1e6 bytes measured
    r = VpaRecommender(min_cpu_cores=min_cpu, min_mem_bytes=min_mem)
    r.learn_one({"t": TEST_TIMESTAMP, "cpu": 0.001, "mem": 1e6})
    rec = r.predict_one()
    assert rec["cpu"]["target"] == 0.025 and rec["mem"]["target"] == 250 * MB


def test_min_resources_split_across_containers():
    """Go: TestMinResourcesSplitAcrossContainers.

    Go splits the pod's minimums evenly over its containers; phasewise's floors
    are per container, so a pod of two is configured with half of each. Go's
    CPU value, 12.5 millicores, is truncated to 12.
    """
    r = VpaRecommender(min_cpu_cores=MIN_CPU_MILLICORES / 1000 / 2, min_mem_bytes=MIN_MEMORY_MB * 1024 * 1024 / 2)
    r.learn_one({"t": TEST_TIMESTAMP, "cpu": 0.001, "mem": 1e6})
    rec = r.predict_one()
    assert rec["cpu"]["target"] == 0.0125 and math.floor(rec["cpu"]["target"] * 1000) == 12
    assert rec["mem"]["target"] == 250 * MB / 2


# =========================================================================== model/aggregate_container_state_test.go


def test_aggregate_state_by_container_name():
    """Go: TestAggregateStateByContainerName.

    phasewise recommends per container and does not pool containers of one
    name across pods; what upstream's pooled state holds for ``app-A`` is the
    merge of its two containers' histograms, checked here against the samples
    written out (CPU at ``minSampleWeight``, memory peaks at the window end).
    """
    names = ["app-A", "app-B", "app-A", "app-C"]
    cpu = [1.0, 5.0, 3.0, 5.0]
    mem = [2e9, 10e9, 4e9, 10e9]
    rs = [VpaRecommender() for _ in names]
    for r, c in zip(rs, cpu):
        r.learn_one({"t": TEST_TIMESTAMP, "cpu": c, "cpu_limit": 3.14})  # testRequest: 3.14 cores
    for r, m in zip(rs, mem):
        r.learn_one({"t": TEST_TIMESTAMP, "mem": m, "mem_limit": 3.14e9})
    counts: dict[str, int] = {}
    for n, r in zip(names, rs):
        counts[n] = counts.get(n, 0) + r.samples
    assert counts == {"app-A": 2, "app-B": 1, "app-C": 1}

    a0, a2 = rs[0], rs[2]
    actual_cpu = histogram(CPU_OPTIONS, DAY)
    actual_mem = histogram(MEM_OPTIONS, DAY)
    for r in (a0, a2):
        actual_cpu.merge(r._cpu)
        actual_mem.merge(r._mem)
    expected_cpu = histogram(CPU_OPTIONS, DAY)
    expected_cpu.add(1.0, MIN_SAMPLE_WEIGHT, TEST_TIMESTAMP)
    expected_cpu.add(3.0, MIN_SAMPLE_WEIGHT, TEST_TIMESTAMP)
    expected_mem = histogram(MEM_OPTIONS, DAY)
    expected_mem.add(2e9, 1.0, a0._window_end)
    expected_mem.add(4e9, 1.0, a2._window_end)
    assert go_equals(expected_cpu, actual_cpu)
    assert go_equals(expected_mem, actual_mem)


T1 = float(calendar.timegm((2018, 1, 1, 2, 3, 4)))
T2 = float(calendar.timegm((2018, 2, 1, 2, 3, 4)))


def test_aggregate_container_state_save_to_checkpoint():
    """Go: TestAggregateContainerStateSaveToCheckpoint (phasewise's state has no wall-clock update time)."""
    cs = VpaRecommender()
    cs._first_t, cs._last_t, cs._n = T1, T2, 10
    cs._cpu.add(1, 33, T2)
    cs._mem.add(1, 55, T1)
    cs._mem.add(10000000, 55, T1)
    state = cs.to_state()
    assert state["f"] == T1 and state["l"] == T2 and state["n"] == 10
    assert state["v"] == STATE_VERSION
    assert len(checkpoint_buckets(state["c"])) == 1
    assert len(checkpoint_buckets(state["m"])) == 2


def test_aggregate_container_state_load_from_checkpoint_fails_for_version_mismatch():
    """Go: TestAggregateContainerStateLoadFromCheckpointFailsForVersionMismatch."""
    with pytest.raises(VpaStateError, match="version"):
        VpaRecommender.from_state({**VpaRecommender().to_state(), "v": "foo"})


def test_aggregate_container_state_load_from_checkpoint():
    """Go: TestAggregateContainerStateLoadFromCheckpoint."""
    state = {**VpaRecommender().to_state(), "f": T1, "l": T2, "n": 20,
             "m": checkpoint(33.0, {0: 10}), "c": checkpoint(44.0, {0: 10})}
    cs = VpaRecommender.from_state(state)
    assert cs._first_t == T1 and cs._last_t == T2 and cs.samples == 20
    assert not cs._cpu.is_empty()
    assert not cs._mem.is_empty()


# =========================================================================== model/container_test.go


class RecordingHistogram(DecayingHistogram):
    """A decaying histogram that records its updates (Go: ``util.MockHistogram``)."""

    __slots__ = ("calls",)

    def __init__(self, h: DecayingHistogram) -> None:
        super().__init__(h.buckets, h.half_life)
        self.calls: list[tuple] = []

    def add(self, value: float, weight: float, t: float) -> None:
        self.calls.append(("add", value, weight, t))
        super().add(value, weight, t)

    def subtract(self, value: float, weight: float, t: float) -> None:
        self.calls.append(("subtract", value, weight, t))
        super().subtract(value, weight, t)


def container(**params) -> VpaRecommender:
    """Go's ``newContainerTest``: OOM bump 1.2, min bump 100 MiB, the default 24 h memory interval."""
    c = VpaRecommender(oom_bump_ratio=1.2, oom_min_bump_bytes=1.048576e08, **params)
    c._cpu = RecordingHistogram(c._cpu)
    c._mem = RecordingHistogram(c._mem)
    return c


def cpu_sample(c: VpaRecommender, t: float, cores: float) -> None:
    c.learn_one({"t": t, "cpu": cores, "cpu_limit": 2.3})  # TestRequest: 2.3 cores


def mem_sample(c: VpaRecommender, t: float, b: float) -> None:
    c.learn_one({"t": t, "mem": b})


def test_aggregate_container_usage_samples():
    """Go: TestAggregateContainerUsageSamples (usage 3140 millicores = 3.14 cores)."""
    c = container()
    interval = DAY
    step = interval / 2
    cpu_sample(c, TEST_TIMESTAMP, 3.14)
    mem_sample(c, TEST_TIMESTAMP, 5)
    cpu_sample(c, TEST_TIMESTAMP + step, 6.28)
    mem_sample(c, TEST_TIMESTAMP + step, 10)
    cpu_sample(c, TEST_TIMESTAMP + 2 * step, 1.57)
    mem_sample(c, TEST_TIMESTAMP + 2 * step, 2)
    # CPU: every sample at minSampleWeight, whatever the request / limit
    assert c._cpu.calls == [("add", 3.14, MIN_SAMPLE_WEIGHT, TEST_TIMESTAMP),
                            ("add", 6.28, MIN_SAMPLE_WEIGHT, TEST_TIMESTAMP + step),
                            ("add", 1.57, MIN_SAMPLE_WEIGHT, TEST_TIMESTAMP + 2 * step)]
    # memory: one peak per interval, at the interval's end
    window_end = TEST_TIMESTAMP + interval
    assert c._mem.calls == [("add", 5.0, 1.0, window_end),
                            ("subtract", 5.0, 1.0, window_end),
                            ("add", 10.0, 1.0, window_end),
                            ("add", 2.0, 1.0, window_end + interval)]
    # invalid samples are discarded: out of order, negative CPU, negative memory (phasewise: an error)
    cpu_sample(c, TEST_TIMESTAMP + 2 * step, 1.0)
    with pytest.raises(ValueError):
        cpu_sample(c, TEST_TIMESTAMP + 4 * step, -1.0)
    with pytest.raises(ValueError):
        mem_sample(c, TEST_TIMESTAMP + 4 * step, -1000)
    assert len(c._cpu.calls) == 3 and len(c._mem.calls) == 4 and c.samples == 3


def test_record_oom_increased_by_bump_up():
    """Go: TestRecordOOMIncreasedByBumpUp (the memory request, 1000 MiB, is phasewise's memory limit)."""
    c = container()
    assert c.record_oom(TEST_TIMESTAMP, 1000 * MB) is True
    assert c._mem.calls == [("add", 1200.0 * MB, 1.0, TEST_TIMESTAMP + DAY)]  # +20 %


def test_record_oom_dont_run_away():
    """Go: TestRecordOOMDontRunAway."""
    c = container()
    window_end = TEST_TIMESTAMP + DAY
    assert c.record_oom(TEST_TIMESTAMP, 1000 * MB) is True
    assert c._mem.calls == [("add", 1200.0 * MB, 1.0, window_end)]
    # new smaller OOMs don't change the peak
    assert c.record_oom(TEST_TIMESTAMP, 999 * MB) is True
    assert c.record_oom(TEST_TIMESTAMP, 999 * MB) is True
    assert len(c._mem.calls) == 1
    # a larger one raises it
    assert c.record_oom(TEST_TIMESTAMP, 2000 * MB) is True
    assert c._mem.calls[1:] == [("subtract", 1200.0 * MB, 1.0, window_end), ("add", 2400.0 * MB, 1.0, window_end)]


def test_record_oom_increased_by_min():
    """Go: TestRecordOOMIncreasedByMin (at least 100 MiB)."""
    c = container()
    assert c.record_oom(TEST_TIMESTAMP, 1 * MB) is True
    assert c._mem.calls == [("add", 101.0 * MB, 1.0, TEST_TIMESTAMP + DAY)]


def test_record_oom_maxed_with_known_sample():
    """Go: TestRecordOOMMaxedWithKnownSample (the last peak, above the request, is bumped)."""
    c = container()
    window_end = TEST_TIMESTAMP + DAY
    mem_sample(c, TEST_TIMESTAMP, 3000 * MB)
    assert c.record_oom(TEST_TIMESTAMP, 1000 * MB) is True
    assert c._mem.calls == [("add", 3000.0 * MB, 1.0, window_end),
                            ("subtract", 3000.0 * MB, 1.0, window_end),
                            ("add", 3600.0 * MB, 1.0, window_end)]


def test_record_oom_discards_old_sample():
    """Go: TestRecordOOMDiscardsOldSample (an OOM 30 h before the last memory sample)."""
    c = container()
    mem_sample(c, TEST_TIMESTAMP, 1000 * MB)
    assert c.record_oom(TEST_TIMESTAMP - 30 * HOUR, 1000 * MB) is False
    assert c._mem.calls == [("add", 1000.0 * MB, 1.0, TEST_TIMESTAMP + DAY)]


def test_record_oom_in_new_window():
    """Go: TestRecordOOMInNewWindow."""
    c = container()
    window_end = TEST_TIMESTAMP + DAY
    mem_sample(c, TEST_TIMESTAMP, 2000 * MB)
    assert c.record_oom(TEST_TIMESTAMP + 2 * DAY, 1000 * MB) is True
    assert c._mem.calls == [("add", 2000.0 * MB, 1.0, window_end),
                            ("add", 2400.0 * MB, 1.0, window_end + 2 * DAY)]


def test_record_oom_fresh_oom_near_window_boundary_is_not_discarded():
    """Go: TestRecordOOMFreshOOMNearWindowBoundaryIsNotDiscarded (autoscaler#8548)."""
    c = container()
    mem_sample(c, TEST_TIMESTAMP, 100 * MB)  # the window now ends at TEST_TIMESTAMP + 1 day
    boundary = TEST_TIMESTAMP + DAY
    window_end = TEST_TIMESTAMP + 2 * DAY
    mem_sample(c, boundary, 2000 * MB)  # exactly on the boundary: the window moves a day on
    # an OOM one second before that sample is fresh: recorded, 2000 MiB bumped to 2400 MiB
    assert c.record_oom(boundary - 1, 1000 * MB) is True
    assert c._mem.calls == [("add", 100.0 * MB, 1.0, boundary),
                            ("add", 2000.0 * MB, 1.0, window_end),
                            ("subtract", 2000.0 * MB, 1.0, window_end),
                            ("add", 2400.0 * MB, 1.0, window_end)]


def test_memory_samples_with_custom_aggregation_interval():
    """Go: TestMemorySamplesWithCustomAggregationInterval (a 1 h interval: samples 2 h apart, two peaks)."""
    c = container(mem_aggregation_interval_s=HOUR)
    window_end = TEST_TIMESTAMP + HOUR
    mem_sample(c, TEST_TIMESTAMP, 5)
    mem_sample(c, TEST_TIMESTAMP + 2 * HOUR, 10)
    assert c._mem.calls == [("add", 5.0, 1.0, window_end), ("add", 10.0, 1.0, window_end + 2 * HOUR)]
    assert c._cpu.calls == []


def test_memory_peak_update_within_custom_interval():
    """Go: TestMemoryPeakUpdateWithinCustomInterval."""
    c = container(mem_aggregation_interval_s=HOUR)
    window_end = TEST_TIMESTAMP + HOUR
    mem_sample(c, TEST_TIMESTAMP, 5)
    mem_sample(c, TEST_TIMESTAMP + 30 * 60, 10)
    assert c._mem.calls == [("add", 5.0, 1.0, window_end),
                            ("subtract", 5.0, 1.0, window_end),
                            ("add", 10.0, 1.0, window_end)]


def test_record_oom_discards_old_sample_with_custom_interval():
    """Go: TestRecordOOMDiscardsOldSampleWithCustomInterval."""
    c = container(mem_aggregation_interval_s=HOUR)
    mem_sample(c, TEST_TIMESTAMP, 1000 * MB)
    assert c.record_oom(TEST_TIMESTAMP - 2 * HOUR, 1000 * MB) is False
    assert c._mem.calls == [("add", 1000.0 * MB, 1.0, TEST_TIMESTAMP + HOUR)]


def test_record_oom_in_new_window_with_custom_interval():
    """Go: TestRecordOOMInNewWindowWithCustomInterval."""
    c = container(mem_aggregation_interval_s=HOUR)
    window_end = TEST_TIMESTAMP + HOUR
    mem_sample(c, TEST_TIMESTAMP, 2000 * MB)
    assert c.record_oom(TEST_TIMESTAMP + 2 * HOUR, 1000 * MB) is True
    assert c._mem.calls == [("add", 2000.0 * MB, 1.0, window_end),
                            ("add", 2400.0 * MB, 1.0, window_end + 2 * HOUR)]


def test_record_oom_discards_old_sample_with_custom_interval_count():
    """Go: TestRecordOOMDiscardsOldSampleWithCustomIntervalCount.

    The interval count (2 here) sets upstream's garbage-collection window only;
    phasewise's recommender has no such parameter, and the OOM rule is the same.
    """
    c = container()
    mem_sample(c, TEST_TIMESTAMP, 1000 * MB)
    assert c.record_oom(TEST_TIMESTAMP - 3 * DAY, 1000 * MB) is False
    assert c._mem.calls == [("add", 1000.0 * MB, 1.0, TEST_TIMESTAMP + DAY)]


def test_memory_samples_with_custom_aggregation_interval_count():
    """Go: TestMemorySamplesWithCustomAggregationIntervalCount (count 16: peaks as with the default)."""
    c = container()
    window_end = TEST_TIMESTAMP + DAY
    mem_sample(c, TEST_TIMESTAMP, 5)
    mem_sample(c, TEST_TIMESTAMP + 2 * DAY, 10)
    assert c._mem.calls == [("add", 5.0, 1.0, window_end), ("add", 10.0, 1.0, window_end + 2 * DAY)]
    assert c._cpu.calls == []
