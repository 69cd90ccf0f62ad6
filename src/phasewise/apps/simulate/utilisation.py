"""GPU utilisation for pods of a trace that has none, drawn from a measured distribution.

openb records requests only. To see what the interference side of a policy
does, ``phasewise simulate --util-cdf CSV:CLUSTER`` gives every GPU pod a
utilisation (percent of one GPU, per GPU) drawn from a cluster's measured
distribution of per-GPU utilisation: the long-format CDF list of
``acmetrace-util-cdfs/util_cdfs.csv`` (``cluster,metric,source_pkl,x_value,
cdf_percent``; the rows of ``metric`` ``gpu_util`` of the cluster whose name
starts with CLUSTER, case-insensitively). The draw is inverse-transform
sampling with a seeded generator in pod order, so every policy sees the same
utilisations and a run is reproducible. The pod's ``util`` is what a
prediction would be: policies that read predictions (horus) use it, the
others ignore it; the simulator measures co-located utilisation above 100 %.

What it assumes: a pod's utilisation is not capped by its requested share
(GPU time-slicing without a compute limit, Horus's setting), and utilisation
is independent of the pod's size.
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
