"""Hindsight bounds: the least allocation a limit held constant over blocks of steps can reach.

A policy whose limit changes only at block boundaries (a run, a stage, a
phase, every B seconds) cannot allocate less than :func:`block_bound` says,
even when it knows each block's usage in advance: the bound chooses, for
every block, the one limit that costs least, and which steps to leave over
their limit, under one budget of failures for all blocks together (the pooled
fulfilment the frontier is read at). Comparing the bound of a block length
with the reactive frontier says how far a target of "slack cut" is reachable
by any policy that decides at that resolution. docs/results.md, "What any
policy could reach".

>>> import numpy as np
>>> blocks = [(np.array([1., 1., 4.]), np.ones(3)), (np.array([2., 2.]), np.ones(2))]
>>> b = block_bound(blocks, 0.8)        # one failure allowed: leave the 4 over its block's limit
>>> (b.alloc, b.used, b.fulfilled, b.steps)
(7.0, 10.0, 4, 5)
>>> block_bound(blocks, 1.0).alloc     # none allowed: each block at its highest use
16.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from phasewise.models.scoring.measures import Score

__all__ = ["block_bound", "blocks_of_labels", "blocks_of_length", "split"]


def block_bound(blocks: Sequence[tuple[np.ndarray, np.ndarray]], fulfilment: float) -> Score:
    """The least ``sum(L dt)`` over *blocks* (each ``(used, dt)``) with one limit per block and at least
    *fulfilment* of all steps within their limit; the :class:`Score` of that optimum.

    Exact (dynamic programming over the number of steps left over their limit): a block that leaves its
    ``k`` highest steps over pays its ``k+1``-th highest use for every step (or nothing when it leaves
    all of them over).

    >>> import numpy as np
    >>> block_bound([(np.array([3., 1.]), np.array([1., 1.]))], 0.5).alloc   # fail the 3: limit 1 for both
    2.0
    >>> block_bound([], 0.97)
    Score(alloc=0.0, used=0.0, fulfilled=0, steps=0)
    """
    if not 0.0 <= fulfilment <= 1.0:
        raise ValueError(f"fulfilment {fulfilment!r} is not in [0, 1]")
    n_steps = sum(len(u) for u, _ in blocks)
    if n_steps == 0:
        return Score()
    budget = int(math.floor((1.0 - fulfilment) * n_steps + 1e-9))
    best = np.full(budget + 1, np.inf)  # best[b]: the least allocation with exactly b steps over
    best[0] = 0.0
    used = 0.0
    for u, dt in blocks:
        u = np.asarray(u, dtype=np.float64)
        dt = np.asarray(dt, dtype=np.float64)
        if len(u) != len(dt):
            raise ValueError(f"a block has {len(u)} uses and {len(dt)} durations")
        if len(u) == 0:
            continue
        if np.any(~np.isfinite(u)) or np.any(~np.isfinite(dt)):
            raise ValueError("a block holds a missing or infinite value")
        used += float(np.dot(u, dt))
        span = float(dt.sum())
        desc = np.sort(u)[::-1]
        kmax = min(len(u), budget)
        cost = np.empty(kmax + 1)
        cost[: min(kmax + 1, len(u))] = desc[: min(kmax + 1, len(u))] * span
        if kmax == len(u):
            cost[kmax] = 0.0  # every step of the block over: no limit to pay for
        new = best + cost[0]
        for k in range(1, kmax + 1):
            np.minimum(new[k:], best[: budget + 1 - k] + cost[k], out=new[k:])
        best = new
    over = int(np.argmin(best))
    return Score(alloc=float(best[over]), used=used, fulfilled=n_steps - over, steps=n_steps)


def blocks_of_labels(labels: Sequence[object]) -> list[np.ndarray]:
    """Index arrays of the maximal runs of equal consecutive *labels*.

    >>> [b.tolist() for b in blocks_of_labels(["load", "train", "train", "eval", "train"])]
    [[0], [1, 2], [3], [4]]
    """
    out: list[np.ndarray] = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            out.append(np.arange(start, i))
            start = i
    return out


def blocks_of_length(n: int, length: int) -> list[np.ndarray]:
    """Index arrays of consecutive blocks of *length* steps over *n* steps (the last may be shorter).

    >>> [b.tolist() for b in blocks_of_length(5, 2)]
    [[0, 1], [2, 3], [4]]
    """
    if length < 1:
        raise ValueError(f"a block of {length} steps")
    return [np.arange(s, min(n, s + length)) for s in range(0, n, length)]


def split(used: np.ndarray, dt: np.ndarray, index_blocks: Iterable[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(used, dt)`` of each block of indices."""
    return [(used[b], dt[b]) for b in index_blocks if len(b)]
