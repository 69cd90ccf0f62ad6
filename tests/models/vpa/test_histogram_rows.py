"""The fleet's dense histogram rows (``models/vpa/histogram_rows.py``), as the fleet configures them."""

from __future__ import annotations

import math

import numpy as np

from phasewise.models.vpa.fleet import VpaFleet
from phasewise.models.vpa.histogram import ExponentialBuckets

CPU = ExponentialBuckets(0.01, 1.05, 1000.0)
MEM = ExponentialBuckets(1e7, 1.05, 1e12)
T0 = 1.7e9


def test_bucket_lookup_matches_the_reference_at_every_bucket_edge_and_near_the_top():
    fleet = VpaFleet()
    for h, b in ((fleet._cpu, CPU), (fleet._mem, MEM)):
        starts = [b.start(i) for i in range(b.num_buckets)]
        vals = []
        for s in starts:
            vals += [s, math.nextafter(s, 0), math.nextafter(s, math.inf)]
        vals += [b.first * 0.3, 0.0, b.max_value * 3, b.max_value * 0.999, 1e300]
        got = h.find(np.array(vals))
        assert got.tolist() == [b.find_bucket(v) for v in vals]


def test_first_and_last_non_empty_buckets_follow_every_update():
    rng = np.random.default_rng(4)
    fleet = VpaFleet()
    rows = fleet.add_rows(6)
    h = fleet._mem
    for step in range(200):
        vals = rng.choice([MEM.start(i) for i in (10, 20, 30, 40, 50)], size=6)
        t = np.full(6, T0 + step * 100.0)
        if step % 2:
            h.subtract(rows, vals, 1.0, t)
        else:
            h.add(rows, vals, 1.0, t)
        lo, hi = h.lo[rows].copy(), h.hi[rows].copy()
        h.rescan(rows)
        assert lo.tolist() == h.lo[rows].tolist() and hi.tolist() == h.hi[rows].tolist(), step
