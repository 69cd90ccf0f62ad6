"""Small numpy helpers the vectorised models share (on the worker's hot path, per message).

>>> import numpy as np
>>> int(count_true(np.array([True, False, True]))), nan_to_none(np.float64("nan"))
(2, None)
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["all_true", "count_true", "grown", "nan_to_none"]

try:  # `if count_true(mask)`: the C count, ~10x cheaper than mask.any() on ~100 elements
    from numpy._core.multiarray import count_nonzero as count_true
except ImportError:  # pragma: no cover - another numpy layout
    count_true = np.count_nonzero


def all_true(mask: np.ndarray) -> bool:
    """Whether every element of *mask* is true (an empty mask: True)."""
    return np.count_nonzero(mask) == mask.size


def grown(a: np.ndarray, rows: int, fill: float | bool = 0) -> np.ndarray:
    """*a* with *rows* more rows (along the first axis) of *fill*.

    A zero fill is left to the OS: ``np.zeros`` takes fresh pages that become
    resident only when a row is written, so the spare rows of a doubled
    capacity cost address space, not memory, until they are used (a
    concatenation writes every one of them).

    >>> grown(np.array([[1.0, 2.0]]), 2).tolist(), grown(np.array([1]), 1, -1).tolist()
    ([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]], [1, -1])
    """
    shape = (len(a) + rows, *a.shape[1:])
    out = np.zeros(shape, a.dtype) if fill == 0 else np.full(shape, fill, a.dtype)  # NaN == 0 is false
    out[: len(a)] = a
    return out


def nan_to_none(v: float) -> float | None:
    """*v* as a Python float, ``None`` for NaN (an array's "missing" as a record's)."""
    v = float(v)
    return None if math.isnan(v) else v
