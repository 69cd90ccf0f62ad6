"""Measured co-location interference: a table of pairwise co-located throughputs (Gavel's, OSDI'20) and a
meter that scores a placement by each co-located job's measured slowdown, once or time-weighted as jobs
come and go. Pure: the table comes parsed (:func:`parse_gavel` takes the JSON already read).
Narrative, the rule for three or more jobs on one GPU and the figures: docs/placement.md, "Interference
measured".
"""

from __future__ import annotations

import ast
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from phasewise.models.jobs.placement.cluster import Cluster, Job
from phasewise.models.jobs.placement.fragmentation import WorkloadTypes
from phasewise.models.jobs.placement.policies import Horus

__all__ = ["MEASURED_WEIGHT", "SLOWED", "CoLocationTable", "InterferenceMeter", "MeasuredHorus", "Workload",
           "gpu_throughputs", "parse_gavel", "score"]

#: a workload: (Gavel's job type, e.g. "ResNet-50 (batch size 64)", scale factor = GPUs it runs on)
Workload = tuple[str, int]
#: a co-located job slowed by more than this share of its isolated throughput counts as "slowed"
SLOWED = 0.2
#: horus-measured's weight on the measured loss against the fragmentation growth (docs/placement.md)
MEASURED_WEIGHT = 1.0


@dataclass(frozen=True)
class CoLocationTable:
    """Isolated throughputs and pairwise co-located throughputs (the same unit, e.g. steps/s).

    ``pairs[(a, b)] = (tput of a next to b, tput of b next to a)``; a pair may be stored once in either order.
    """

    gpu: str
    isolated: Mapping[Workload, float]
    pairs: Mapping[tuple[Workload, Workload], tuple[float, float]]

    def workloads(self, scale: int = 1) -> tuple[Workload, ...]:
        """The workloads on *scale* GPUs with a positive isolated throughput, sorted."""
        return tuple(sorted(w for w, t in self.isolated.items() if w[1] == scale and t > 0))

    def normalised(self, a: Workload, b: Workload) -> float | None:
        """a's throughput next to b over a's isolated throughput, clipped to [0, 1]; None: not measured."""
        iso = self.isolated.get(a, 0.0)
        if not iso > 0:
            return None
        pair = self.pairs.get((a, b))
        if pair is not None:
            t = pair[0]
        else:
            pair = self.pairs.get((b, a))
            if pair is None:
                return None
            t = pair[1]
        return min(1.0, max(0.0, t / iso))


def _key(text: str) -> Workload:
    v = ast.literal_eval(text)
    if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int)):
        raise ValueError(f"not a ('<job type>', scale factor) key: {text[:80]!r}")
    return v[0], v[1]


def parse_gavel(raw: Mapping[str, Mapping], gpu: str) -> CoLocationTable:
    """Gavel's ``{gpu_type: {"('<job type>', sf)": {"null": isolated, "('<other>', sf)": [self, other]}}}``
    (already read) -> the *gpu* type's table. ``KeyError`` for an unknown GPU type, ``ValueError`` for a
    malformed entry."""
    table = raw[gpu]
    isolated: dict[Workload, float] = {}
    pairs: dict[tuple[Workload, Workload], tuple[float, float]] = {}
    for key, entry in table.items():
        a = _key(key)
        for other, t in entry.items():
            if other == "null":
                isolated[a] = float(t or 0.0)
                continue
            b = _key(other)
            if not (isinstance(t, (list, tuple)) and len(t) == 2):
                raise ValueError(f"{key} next to {other}: not a [self, other] pair")
            pairs[(a, b)] = (float(t[0]), float(t[1]))
    return CoLocationTable(gpu, isolated, pairs)


def gpu_throughputs(table: CoLocationTable, workloads: Sequence[Workload | None],
                    ) -> list[tuple[float, float] | None]:
    """Each job's normalised throughput on one GPU shared by *workloads*: ``(product, worst pair)`` or
    None where a job's workload or one of its pairs is not measured.

    ``product``: the product over its neighbours of its pairwise normalised throughput (for two jobs, the
    measured pair itself); ``worst pair``: the smallest of them, an upper bound on its throughput as long as
    a further neighbour never speeds a job up. A job alone gets ``(1, 1)``."""
    out: list[tuple[float, float] | None] = []
    for i, w in enumerate(workloads):
        prod, worst, known = 1.0, 1.0, w is not None
        for j, o in enumerate(workloads):
            if j == i or not known:
                continue
            n = table.normalised(w, o) if o is not None else None
            if n is None:
                known = False
                break
            prod *= n
            worst = min(worst, n)
        out.append((prod, worst) if known else None)
    return out


@dataclass
class _Acc:
    """Weighted sums of the co-located jobs' and shared GPUs' figures."""

    weight: float = 0.0  # of the snapshots (time, or 1 for one snapshot)
    shared_gpus: float = 0.0
    colocated: float = 0.0
    unmeasured: float = 0.0
    extrapolated: float = 0.0
    slowed: float = 0.0
    lost: float = 0.0
    measured_w: float = 0.0  # job-weight of the measured co-located jobs
    sum_slow: float = 0.0
    sum_slow_worst: float = 0.0
    hist: dict[float, float] = field(default_factory=dict)  # slowdown (4 decimals) -> job-weight
    gpu_w: float = 0.0  # weight of the fully measured shared GPUs
    sum_combined: float = 0.0


class InterferenceMeter:
    """Which jobs share which GPU, and their measured slowdowns, kept as jobs are placed and released.

    A GPU is any hashable; a job placed on several GPUs (scale factor k) keeps the lowest throughput of its
    GPUs (synchronous training runs at its slowest GPU's pace). :meth:`advance` adds the current state with
    a weight (a time step, or 1 for one snapshot); :meth:`summary` reports the weighted figures."""

    def __init__(self, table: CoLocationTable, workloads: Mapping[str, Workload], slowed: float = SLOWED):
        self.table, self.workloads, self.slowed = table, workloads, slowed
        self.on: dict[Hashable, list[str]] = {}  # GPU -> jobs, in placement order
        self.gpus_of: dict[str, tuple[Hashable, ...]] = {}
        self.gpu_vals: dict[Hashable, dict[str, tuple[float, float] | None]] = {}  # shared GPUs only
        self.job_vals: dict[str, tuple[float, float] | None] = {}  # jobs on a shared GPU
        self.acc = _Acc()

    def place(self, job: str, gpus: Iterable[Hashable]) -> None:
        gpus = tuple(gpus)
        if not gpus or job in self.gpus_of:
            return
        self.gpus_of[job] = gpus
        for g in gpus:
            self.on.setdefault(g, []).append(job)
        self._update(gpus)

    def release(self, job: str) -> None:
        gpus = self.gpus_of.pop(job, None)
        if gpus is None:
            return
        for g in gpus:
            jobs = self.on[g]
            jobs.remove(job)
            if not jobs:
                del self.on[g]
        self.job_vals.pop(job, None)
        self._update(gpus)

    def _update(self, gpus: tuple[Hashable, ...]) -> None:
        touched: set[str] = set()
        for g in gpus:
            jobs = self.on.get(g, [])
            touched.update(jobs)
            if len(jobs) < 2:
                self.gpu_vals.pop(g, None)
                continue
            vals = gpu_throughputs(self.table, [self.workloads.get(j) for j in jobs])
            self.gpu_vals[g] = dict(zip(jobs, vals))
        for j in touched:
            shared = [self.gpu_vals[g][j] for g in self.gpus_of[j] if g in self.gpu_vals]
            if not shared:
                self.job_vals.pop(j, None)
            elif any(v is None for v in shared):
                self.job_vals[j] = None
            else:
                self.job_vals[j] = (min(v[0] for v in shared), min(v[1] for v in shared))

    def _extrapolated(self, job: str) -> bool:
        return any(len(self.on[g]) > 2 for g in self.gpus_of[job])

    def advance(self, weight: float) -> None:
        """Add the current state, weighted by *weight* (> 0; a smaller one adds nothing)."""
        if not weight > 0:
            return
        a = self.acc
        a.weight += weight
        a.shared_gpus += weight * len(self.gpu_vals)
        for j, v in self.job_vals.items():
            a.colocated += weight
            if v is None:
                a.unmeasured += weight
                continue
            s, s_worst = 1.0 - v[0], 1.0 - v[1]
            k = len(self.gpus_of[j])
            a.measured_w += weight
            a.sum_slow += weight * s
            a.sum_slow_worst += weight * s_worst
            a.lost += weight * s * k
            if s > self.slowed:
                a.slowed += weight
            if self._extrapolated(j):
                a.extrapolated += weight
            key = round(s, 4)
            a.hist[key] = a.hist.get(key, 0.0) + weight
        for vals in self.gpu_vals.values():
            if all(v is not None for v in vals.values()):
                a.gpu_w += weight
                a.sum_combined += weight * sum(v[0] for v in vals.values())

    def summary(self) -> dict:
        """The weighted figures (counts: weighted means; slowdowns: over measured co-located job-weight)."""
        a = self.acc
        w = a.weight or 1.0
        q = _quantile(a.hist, 0.95)
        return {
            "shared_gpus": round(a.shared_gpus / w, 3),
            "colocated_jobs": round(a.colocated / w, 3),
            "unmeasured_jobs": round(a.unmeasured / w, 3),
            "extrapolated_jobs": round(a.extrapolated / w, 3),
            "slowdown_mean": round(a.sum_slow / a.measured_w, 4) if a.measured_w else None,
            "slowdown_p95": q,
            "slowdown_mean_worst_pair": round(a.sum_slow_worst / a.measured_w, 4) if a.measured_w else None,
            "slowed_jobs": round(a.slowed / w, 3),
            "slowed_share": round(a.slowed / a.measured_w, 4) if a.measured_w else None,
            "lost_gpus": round(a.lost / w, 3),
            "combined_tput_mean": round(a.sum_combined / a.gpu_w, 4) if a.gpu_w else None,
        }


def _quantile(hist: Mapping[float, float], q: float) -> float | None:
    """The smallest value whose cumulative weight reaches *q* of the total (None when empty)."""
    total = sum(hist.values())
    if not total > 0:
        return None
    run = 0.0
    keys = sorted(hist)
    for k in keys:
        run += hist[k]
        if run >= q * total - 1e-12 * total:
            return k
    return keys[-1]


def score(table: CoLocationTable, placement: Mapping[str, Sequence[Hashable]], workloads: Mapping[str, Workload],
          slowed: float = SLOWED) -> dict:
    """One placement (job -> GPUs) scored as it stands: :meth:`InterferenceMeter.summary` of one snapshot."""
    m = InterferenceMeter(table, workloads, slowed)
    for job, gpus in placement.items():
        m.place(job, gpus)
    m.advance(1.0)
    return m.summary()


def _lost(table: CoLocationTable, occupants: tuple[Workload | None, ...]) -> float | None:
    """The slowdowns of one GPU's jobs summed (product rule); None when one is not measured."""
    if len(occupants) < 2:
        return 0.0
    vals = gpu_throughputs(table, occupants)
    if any(v is None for v in vals):
        return None
    return sum(1.0 - v[0] for v in vals)


class MeasuredHorus(Horus):
    """horus with the measured table in place of its utilisation-sum proxy: for a job whose workload is
    known, a GPU's over-capacity term becomes the throughput the GPU's jobs would lose by its coming (the
    rise of their summed slowdowns, in isolated GPUs); where the job or a neighbour is not measured, Horus's
    term stays. Everything else (fragmentation weight, ties) is horus's (docs/placement.md, "Interference
    measured"). *weight* scales the measured loss against the fragmentation term (1: as Horus's term)."""

    name = "horus-measured"

    def __init__(self, table: CoLocationTable, workloads: Mapping[str, Workload],
                 workload: WorkloadTypes | None = None, refresh_every: int = 64, weight: float = MEASURED_WEIGHT):
        super().__init__(workload, refresh_every)
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"the measured loss's weight must be a number >= 0, not {weight!r}")
        self.table, self.workloads, self.weight = table, workloads, float(weight)
        self._on: dict[tuple[int, int], list[str]] = {}  # (node row, GPU) -> jobs, from the cluster's bookings
        self._booked: dict[str, tuple[tuple[int, int], ...]] = {}
        self._lost: dict[tuple, float | None] = {}

    def _sync(self, c: Cluster) -> None:
        allocs = c.allocs
        for job in self._booked.keys() - allocs.keys():
            for g in self._booked.pop(job):
                self._on[g].remove(job)
        for job in allocs.keys() - self._booked.keys():
            a = allocs[job]
            gs = tuple((a.node, j) for j in a.gpus)
            self._booked[job] = gs
            for g in gs:
                self._on.setdefault(g, []).append(job)

    def _lost_of(self, occupants: tuple[Workload | None, ...]) -> float | None:
        key = tuple(sorted(occupants, key=lambda w: ("", 0) if w is None else w))
        if key not in self._lost:
            self._lost[key] = _lost(self.table, key)
        return self._lost[key]

    def _gpu_terms(self, job: Job, c: Cluster, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h, over = super()._gpu_terms(job, c, rows)
        w = self.workloads.get(job.job)
        if w is None or job.count == 0:
            return h, over
        self._sync(c)
        over = over.copy()
        for r, g in zip(*np.nonzero(c._gpu_ok(job, rows) & (c.gjobs[rows] > 0))):
            jobs = self._on.get((int(rows[r]), int(g)), ())
            if not jobs:
                continue
            now = tuple(self.workloads.get(j) for j in jobs)
            before, after = self._lost_of(now), self._lost_of((*now, w))
            if before is not None and after is not None:
                over[r, g] = self.weight * (after - before)
        return h, over
