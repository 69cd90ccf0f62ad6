"""``models/arrays.py``: the rows a grown array adds are zero pages the OS maps only when written."""

from __future__ import annotations

import os

import numpy as np
import pytest

from phasewise.apps.bench.harness import rss_bytes
from phasewise.models.arrays import grown


def resident_bytes() -> int:
    return rss_bytes(os.getpid())


@pytest.mark.parametrize("fill", [0.0, np.nan, -1.0])
def test_grown_keeps_the_rows_and_fills_the_new_ones(fill):
    a = np.arange(6.0).reshape(3, 2)
    g = grown(a, 2, fill)
    assert g.shape == (5, 2) and g.dtype == a.dtype
    assert (g[:3] == a).all()
    np.testing.assert_array_equal(g[3:], np.full((2, 2), fill))
    assert grown(np.array([True]), 2).tolist() == [True, False, False]


def test_the_spare_rows_of_a_zero_fill_are_not_resident_until_written():
    a = np.ones((1000, 176))
    before = resident_bytes()
    g = grown(a, 100_000)  # 141 MB of address space
    assert resident_bytes() - before < 20e6
    g[50_000:60_000] = 1.0  # 14 MB written: resident now
    assert resident_bytes() - before > 10e6
    full = np.concatenate([a, np.zeros((100_000, 176))])  # what a concatenation costs: every row
    assert resident_bytes() - before > 130e6
    del g, full
