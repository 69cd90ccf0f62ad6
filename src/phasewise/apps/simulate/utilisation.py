"""GPU utilisation for pods of a trace that has none, drawn (seeded, in pod order) from a cluster's measured
distribution, as if it were each pod's prediction (docs/placement.md, "With utilisation known").
"""

from __future__ import annotations

import csv
import random
from dataclasses import replace
from pathlib import Path

import numpy as np

from phasewise.apps.simulate.openb import Pod, TraceError

__all__ = ["UtilCdf", "load_util_cdf", "with_utilisation"]


class UtilCdf:
    """An empirical CDF of GPU utilisation: x (percent) against cumulative percent."""

    def __init__(self, name: str, x: np.ndarray, cdf: np.ndarray):
        self.name, self.x, self.cdf = name, x, cdf

    def quantile(self, q: float) -> float:
        """Utilisation at cumulative percent *q* (0..100)."""
        return float(np.clip(np.interp(q, self.cdf, self.x), 0.0, 100.0))


def load_util_cdf(spec: str) -> UtilCdf:
    """``CSV:CLUSTER`` -> the cluster's GPU utilisation CDF (one-line :class:`TraceError` otherwise)."""
    path, sep, cluster = spec.rpartition(":")
    if not sep or not path or not cluster.strip():
        raise TraceError(f"--util-cdf {spec!r}: expected CSV:CLUSTER (e.g. util_cdfs.csv:Philly)")
    p, want = Path(path), cluster.strip().lower()
    try:
        f = p.open(newline="")
    except OSError as e:
        raise TraceError(f"{p}: {e.strerror or e}") from None
    rows: dict[str, list[tuple[float, float]]] = {}
    with f:
        reader = csv.DictReader(f)
        missing = [c for c in ("cluster", "metric", "x_value", "cdf_percent") if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{p}: not a utilisation CDF list: missing column(s) {', '.join(missing)}")
        for n, row in enumerate(reader, start=2):
            if row.get("metric") != "gpu_util":
                continue
            try:
                xy = (float(row["x_value"]), float(row["cdf_percent"]))
            except (TypeError, ValueError):
                raise TraceError(f"{p}: row {n}: x_value/cdf_percent not numbers") from None
            rows.setdefault(row.get("cluster") or "", []).append(xy)
    names = sorted(rows)
    match = [c for c in names if c.lower().startswith(want)]
    if len(match) != 1:
        raise TraceError(f"{p}: cluster {cluster!r} {'is ambiguous' if match else 'not found'} "
                         f"(gpu_util clusters: {', '.join(names) or 'none'})")
    pts = sorted(rows[match[0]], key=lambda t: t[1])
    x, cdf = np.array([t[0] for t in pts]), np.array([t[1] for t in pts])
    if len(x) < 2 or np.any(np.diff(cdf) < 0) or np.any(np.diff(x) < 0):
        raise TraceError(f"{p}: cluster {match[0]!r}: not a cumulative distribution")
    return UtilCdf(match[0], x, cdf)


def with_utilisation(pods: list[Pod], cdf: UtilCdf, seed: int = 0) -> list[Pod]:
    """*pods* with every GPU pod's ``util`` drawn from *cdf* (CPU-only pods unchanged)."""
    rng = random.Random(seed)
    out = []
    for p in pods:
        q = rng.uniform(0.0, 100.0)  # drawn for every pod: a pod's draw does not depend on the others' kinds
        out.append(Pod(replace(p.job, util=cdf.quantile(q)), p.created, p.deleted) if p.job.count else p)
    return out
