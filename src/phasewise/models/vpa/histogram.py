"""Decaying histograms with exponential buckets, as the Kubernetes VPA keeps them (pure Python).

:class:`ExponentialBuckets` and :class:`LinearBuckets` are VPA's bucket
schemes; :class:`DecayingHistogram` halves a sample's weight every
half-life, answers VPA's percentile and serialises as VPA's checkpoint.
The definitions and the small differences from upstream: docs/vpa.md,
"Histograms".

>>> ExponentialBuckets(first=1.0, ratio=2.0, max_value=100.0).start(3)
7.0
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_CHECKPOINT_WEIGHT", "Buckets", "DecayingHistogram", "ExponentialBuckets", "HistogramStateError",
           "LinearBuckets"]

#: heaviest bucket's weight in a serialised histogram (VPA's MaxCheckpointWeight)
MAX_CHECKPOINT_WEIGHT = 10_000
#: the reference timestamp moves forward when a sample is this many half-lives past it
MAX_DECAY_EXPONENT = 100
STATE_VERSION = 1


class HistogramStateError(ValueError):
    """A serialised histogram cannot be loaded; ``str(e)`` says why."""


class ExponentialBuckets:
    """Bucket boundaries growing by ``ratio``: VPA's ``exponentialHistogramOptions``.

    Parameters
    ----------
    first
        Size of bucket 0, which covers ``[0, first)``.
    ratio
        Each bucket is ``ratio`` times as wide as the previous one (> 1).
    max_value
        The last bucket starts at or above this value.
    epsilon
        A bucket with less weight than this counts as empty.
    """

    __slots__ = ("_log_ratio", "_starts", "epsilon", "first", "max_value", "num_buckets", "ratio")

    def __init__(self, first: float, ratio: float, max_value: float, epsilon: float = 1e-4) -> None:
        if not (first > 0 and max_value > 0 and epsilon > 0):
            raise ValueError("first, max_value and epsilon must be > 0")
        if not ratio > 1:
            raise ValueError(f"ratio must be > 1, got {ratio}")
        self.first = float(first)
        self.ratio = float(ratio)
        self.max_value = float(max_value)
        self.epsilon = float(epsilon)
        self._log_ratio = math.log(self.ratio)
        self.num_buckets = math.ceil(math.log(max_value * (ratio - 1) / first + 1) / self._log_ratio) + 1
        self._starts = [self._start_formula(i) for i in range(self.num_buckets)]

    def _start_formula(self, i: int) -> float:
        if i == 0:
            return 0.0
        return self.first * (self.ratio**i - 1) / (self.ratio - 1)

    def start(self, bucket: int) -> float:
        """Lower bound of *bucket* (its values are ``>= start``)."""
        if not 0 <= bucket < self.num_buckets:
            raise IndexError(f"bucket {bucket} out of range [0, {self.num_buckets - 1}]")
        return self._starts[bucket]

    def end(self, bucket: int) -> float:
        """Upper bound of *bucket*; the last bucket is open, so its start."""
        if bucket >= self.num_buckets - 1:
            return self._starts[self.num_buckets - 1]
        return self._starts[bucket + 1]

    def find_bucket(self, value: float) -> int:
        """Index of the bucket holding *value* (clamped to the first / last one)."""
        if not value >= self.first:  # also catches NaN
            return 0
        b = int(math.log(value * (self.ratio - 1) / self.first + 1) / self._log_ratio)
        last = self.num_buckets - 1
        if b >= last:
            return last
        starts = self._starts
        if value < starts[b]:  # log rounded up across a boundary
            b -= 1
        elif value >= starts[b + 1]:  # log rounded down just below a boundary
            b += 1
        return b

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExponentialBuckets) and (
            self.first, self.ratio, self.max_value, self.epsilon
        ) == (other.first, other.ratio, other.max_value, other.epsilon)

    def __hash__(self) -> int:
        return hash((self.first, self.ratio, self.max_value, self.epsilon))

    def __repr__(self) -> str:
        return (f"ExponentialBuckets(first={self.first:g}, ratio={self.ratio:g}, "
                f"max_value={self.max_value:g}, epsilon={self.epsilon:g})")


class LinearBuckets:
    """Buckets of one size: VPA's ``linearHistogramOptions``.

    Bucket ``n`` covers ``[n * size, (n + 1) * size)``; there are
    ``ceil(max_value / size) + 1`` of them, the last one open-ended. Values
    below 0 land in bucket 0, values above the range in the last bucket.

    >>> b = LinearBuckets(size=0.3, max_value=5.0)
    >>> b.num_buckets, b.find_bucket(1.3), b.find_bucket(100.0), b.start(2)
    (18, 4, 17, 0.6)
    """

    __slots__ = ("epsilon", "max_value", "num_buckets", "size")

    def __init__(self, size: float, max_value: float, epsilon: float = 1e-4) -> None:
        if not (size > 0 and max_value > 0 and epsilon > 0):
            raise ValueError("size, max_value and epsilon must be > 0")
        self.size = float(size)
        self.max_value = float(max_value)
        self.epsilon = float(epsilon)
        self.num_buckets = math.ceil(self.max_value / self.size) + 1

    def start(self, bucket: int) -> float:
        """Lower bound of *bucket* (its values are ``>= start``)."""
        if not 0 <= bucket < self.num_buckets:
            raise IndexError(f"bucket {bucket} out of range [0, {self.num_buckets - 1}]")
        return bucket * self.size

    def end(self, bucket: int) -> float:
        """Upper bound of *bucket*; the last bucket is open, so its start."""
        return self.start(min(bucket + 1, self.num_buckets - 1))

    def find_bucket(self, value: float) -> int:
        """Index of the bucket holding *value* (clamped to the first / last one)."""
        q = value / self.size
        if not q >= 1:  # also catches NaN
            return 0
        if q >= self.num_buckets:
            return self.num_buckets - 1
        return int(q)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LinearBuckets) and (
            self.size, self.max_value, self.epsilon) == (other.size, other.max_value, other.epsilon)

    def __hash__(self) -> int:
        return hash((self.size, self.max_value, self.epsilon))

    def __repr__(self) -> str:
        return f"LinearBuckets(size={self.size:g}, max_value={self.max_value:g}, epsilon={self.epsilon:g})"


#: a bucketing scheme a :class:`DecayingHistogram` can use
Buckets = ExponentialBuckets | LinearBuckets


class DecayingHistogram:
    """A histogram whose samples lose half their weight every ``half_life`` seconds.

    Parameters
    ----------
    buckets
        The bucketing scheme (shared, immutable): :class:`ExponentialBuckets`
        or :class:`LinearBuckets`.
    half_life
        Seconds after which a sample counts half as much as a fresh one.

    Examples
    --------
    >>> h = DecayingHistogram(ExponentialBuckets(0.01, 1.05, 1000.0), half_life=86400.0)
    >>> h.is_empty()
    True
    >>> for t in range(10):
    ...     h.add(1.0, 1.0, t=float(t))
    >>> round(h.percentile(0.9), 4)   # end of the bucket holding 1.0
    1.0163
    """

    __slots__ = ("_ref", "_total", "_w", "buckets", "half_life")

    def __init__(self, buckets: Buckets, half_life: float) -> None:
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.buckets = buckets
        self.half_life = float(half_life)
        self._w: dict[int, float] = {}
        self._total = 0.0
        self._ref: float | None = None  # None until the first sample fixes it

    # ------------------------------------------------------------------ updates

    def _decay_factor(self, t: float) -> float:
        ref = self._ref
        hl = self.half_life
        if ref is None:
            self._ref = ref = math.floor(t / hl + 0.5) * hl
        elif t > ref + hl * MAX_DECAY_EXPONENT:
            self._shift_reference(t)
            ref = self._ref
        return 2.0 ** ((t - ref) / hl)  # type: ignore[operator]

    def _shift_reference(self, t: float) -> None:
        hl = self.half_life
        new_ref = math.floor(t / hl + 0.5) * hl
        old_ref = self._ref if self._ref is not None else new_ref
        exponent = math.floor((old_ref - new_ref) / hl + 0.5)
        self._scale(math.ldexp(1.0, exponent))
        self._ref = new_ref

    def _scale(self, factor: float) -> None:
        eps = self.buckets.epsilon
        w = self._w
        for b in list(w):
            v = w[b] * factor
            if v < eps:
                del w[b]
            else:
                w[b] = v
        self._total = math.fsum(w.values()) if w else 0.0

    def add(self, value: float, weight: float, t: float) -> None:
        """Add *value* with *weight* observed at time *t* (seconds)."""
        if weight < 0:
            raise ValueError(f"sample weight must be non-negative, got {weight}")
        w = weight * self._decay_factor(t)
        b = self.buckets.find_bucket(value)
        self._w[b] = self._w.get(b, 0.0) + w
        self._total += w

    def subtract(self, value: float, weight: float, t: float) -> None:
        """Remove a sample added earlier with the same *value*, *weight* and *t*."""
        if weight < 0:
            raise ValueError(f"sample weight must be non-negative, got {weight}")
        w = weight * self._decay_factor(t)
        b = self.buckets.find_bucket(value)
        have = self._w.get(b, 0.0)
        if w > have - self.buckets.epsilon:
            w = have
        left = have - w
        self._total -= w
        if left < self.buckets.epsilon:
            self._w.pop(b, None)
            self._total -= left
        else:
            self._w[b] = left
        if not self._w:
            self._total = 0.0

    def merge(self, other: DecayingHistogram) -> None:
        """Add every sample of *other* (same buckets and half-life) into this one."""
        if other.buckets != self.buckets:
            raise ValueError("can't merge histograms with different buckets")
        if other.half_life != self.half_life:
            raise ValueError("can't merge decaying histograms with different half-lives")
        if other._ref is None:
            return
        factor = 1.0
        if self._ref is None:
            self._ref = other._ref
        elif self._ref < other._ref:  # align the older reference with the younger one
            self._shift_reference(other._ref)
        elif other._ref < self._ref:
            factor = math.ldexp(1.0, round((other._ref - self._ref) / self.half_life))
        eps = self.buckets.epsilon
        for b, v in other._w.items():
            v *= factor
            if v >= eps or b in self._w:
                self._w[b] = self._w.get(b, 0.0) + v
        self._total = math.fsum(self._w.values())

    # ------------------------------------------------------------------ queries

    def is_empty(self) -> bool:
        eps = self.buckets.epsilon
        return not any(v >= eps for v in self._w.values())

    @property
    def total_weight(self) -> float:
        """Sum of stored (decayed, relative) weights."""
        return self._total

    @property
    def reference(self) -> float | None:
        return self._ref

    def weights(self) -> dict[int, float]:
        """``{bucket: weight}`` of the non-empty buckets, a copy."""
        return dict(self._w)

    def percentile(self, p: float) -> float:
        """End of the bucket where the cumulative weight reaches ``p`` of the total.

        ``p`` is a fraction in ``[0, 1]``. An empty histogram returns ``0.0``.
        """
        return self.percentiles((p,))[0]

    def percentiles(self, ps: tuple[float, ...]) -> tuple[float, ...]:
        """Several percentiles with one pass over the sorted buckets."""
        w = self._w
        eps = self.buckets.epsilon
        keys = sorted(w)
        nonempty = [b for b in keys if w[b] >= eps]
        if not nonempty:
            return tuple(0.0 for _ in ps)
        lo, hi = nonempty[0], nonempty[-1]
        span = [b for b in keys if lo <= b < hi]
        out = []
        total = self._total
        for p in ps:
            threshold = p * total
            partial = 0.0
            chosen = hi
            for b in span:
                partial += w[b]
                if partial >= threshold:
                    chosen = b
                    break
            out.append(self.buckets.end(chosen))
        return tuple(out)

    # ------------------------------------------------------------------ state

    def to_state(self) -> dict[str, Any]:
        """Compact JSON-able form: ``{"r": reference, "t": total, "b": [gap, weight, ...]}``.

        ``b`` is flat: for each non-empty bucket in order, the gap from the
        previous bucket's index (the first gap is from 0) and its weight.
        Weights are rescaled so the heaviest bucket holds ``10000`` and rounded
        to integers; buckets that round to zero are dropped (as VPA checkpoints).
        """
        eps = self.buckets.epsilon
        items = sorted((b, v) for b, v in self._w.items() if v >= eps)
        flat: list[int] = []
        if items:
            ratio = MAX_CHECKPOINT_WEIGHT / max(v for _, v in items)
            prev = 0
            for b, v in items:
                n = math.floor(v * ratio + 0.5)
                if n > 0:
                    flat += (b - prev, n)
                    prev = b
        return {"r": self._ref, "t": float(f"{self._total:.9g}"), "b": flat}

    def load_state(self, state: dict[str, Any]) -> DecayingHistogram:
        """Replace this histogram's contents with a :meth:`to_state` dict."""
        try:
            ref, total, flat = state["r"], float(state["t"]), state["b"]
            if len(flat) % 2:
                raise ValueError("odd number of items in 'b'")
        except (KeyError, TypeError, ValueError) as e:
            raise HistogramStateError(f"histogram state is malformed: {e!r}") from None
        if not (total >= 0 and math.isfinite(total)):
            raise HistogramStateError(f"histogram state has an invalid total weight {total!r}")
        n = self.buckets.num_buckets
        pairs: list[tuple[int, int]] = []
        b = 0
        for i in range(0, len(flat), 2):
            gap, c = flat[i], flat[i + 1]
            if not (isinstance(gap, int) and gap >= 0 and isinstance(c, int) and c >= 0):
                raise HistogramStateError(f"histogram state has an invalid entry {[gap, c]!r}")
            b += gap
            if b >= n:
                raise HistogramStateError(f"histogram state has bucket {b} outside [0, {n - 1}]")
            pairs.append((b, c))
        s = sum(c for _, c in pairs)
        self._w = {}
        self._total = 0.0
        self._ref = None if ref is None else float(ref)
        if s == 0:
            return self
        ratio = total / s
        for b, c in pairs:
            if c > 0:
                self._w[b] = self._w.get(b, 0.0) + c * ratio
        self._total = total
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DecayingHistogram):
            return NotImplemented
        return (self.buckets == other.buckets and self.half_life == other.half_life
                and self._ref == other._ref and self._w.keys() == other._w.keys()
                and all(abs(v - other._w[b]) <= 1e-12 * max(1.0, abs(v)) for b, v in self._w.items()))

    def __repr__(self) -> str:
        return (f"DecayingHistogram(buckets={len(self._w)} non-empty, total={self._total:.4g}, "
                f"half_life={self.half_life:g}s, reference={self._ref})")
