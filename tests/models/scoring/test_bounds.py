"""The hindsight block bound: the exact optimum (checked against every choice on small cases), its edges,
and that a finer partition never bounds higher."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from phasewise.models.scoring.bounds import block_bound, blocks_of_labels, blocks_of_length, split


def _brute(blocks, fulfilment):
    """Every choice of limit per block among its own uses and 0 (any other limit costs more for the same
    steps within it): the least allocation with enough steps within their limits."""
    n = sum(len(u) for u, _ in blocks)
    need = math.ceil(fulfilment * n - 1e-9)
    best = math.inf
    for limits in itertools.product(*[[0.0, *sorted(set(u.tolist()))] for u, _ in blocks]):
        ok = sum(int(np.count_nonzero(u <= lim)) for (u, _), lim in zip(blocks, limits))
        if ok >= need:
            best = min(best, sum(lim * float(dt.sum()) for (_, dt), lim in zip(blocks, limits)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_is_the_least_allocation_of_any_choice_of_limits(seed):
    rng = np.random.default_rng(seed)
    blocks = [(rng.choice([0.5, 1.0, 1.5, 2.0, 4.0], size=int(k)), rng.uniform(0.5, 2.0, size=int(k)))
              for k in rng.integers(1, 4, size=int(rng.integers(1, 5)))]
    n = sum(len(u) for u, _ in blocks)
    for f in (1.0, 0.9, 0.75, 0.5, 0.0):
        got = block_bound(blocks, f)
        assert got.alloc == pytest.approx(_brute(blocks, f)), (f, blocks)
        assert got.steps == n and got.fulfilled >= math.ceil(f * n - 1e-9)
        assert got.used == pytest.approx(sum(float(np.dot(u, dt)) for u, dt in blocks))


def test_a_finer_partition_never_bounds_higher():
    rng = np.random.default_rng(7)
    used = rng.lognormal(0.0, 0.5, size=300)
    dt = np.ones(300)
    prev = math.inf
    for length in (300, 60, 30, 10, 5, 1):
        b = block_bound(split(used, dt, blocks_of_length(300, length)), 0.97)
        assert b.alloc <= prev + 1e-9 and b.fulfilment >= 0.97
        prev = b.alloc
    # one step per block and 3 % of the steps free to fail: the oracle's allocation less the 9 dearest steps
    assert prev == pytest.approx(float(np.sort(used)[:-9].sum()))


def test_the_blocks_and_bad_input():
    assert [b.tolist() for b in blocks_of_labels([1, 1, -1, 1])] == [[0, 1], [2], [3]]
    assert blocks_of_labels([]) == []
    with pytest.raises(ValueError, match="block of 0"):
        blocks_of_length(4, 0)
    with pytest.raises(ValueError, match="not in"):
        block_bound([(np.ones(2), np.ones(2))], 1.5)
    with pytest.raises(ValueError, match="missing"):
        block_bound([(np.array([1.0, np.nan]), np.ones(2))], 0.9)
    with pytest.raises(ValueError, match="durations"):
        block_bound([(np.ones(2), np.ones(3))], 0.9)
