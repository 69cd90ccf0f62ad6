"""FGD's fragmentation (Weng et al., ATC'23): a target workload's task types, F_n(M), and its growth.

:class:`WorkloadTypes` is a target workload, :func:`_frag` F_n(M) per node state, computed exactly in
integers per group of task shapes, and :class:`_Fragmentation` the growth of F_n(M) that placing a job
would cause, cached by node version and job type. A task type keeps its node selector (openb's GPU model
constraint): on a node it cannot go to, all the node's free GPU milli is a fragment for it, as in FGD's
simulator (docs/placement.md, "How F_n(M) is computed").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from phasewise.models.jobs.placement.cluster import _INF, MILLI, Cluster, Job

__all__ = ["WorkloadTypes", "fragmentation", "workload_types"]

@dataclass(frozen=True)
class WorkloadTypes:
    """A target workload: task types (CPU milli, memory bytes, GPUs, milli per GPU, node selector) and how
    many tasks of each type (popularity = n / n.sum())."""

    cpu: np.ndarray
    mem: np.ndarray
    count: np.ndarray  # GPUs per task (0: CPU-only)
    milli: np.ndarray  # milli per GPU
    n: np.ndarray  # tasks of this type
    selector: tuple[tuple[tuple[str, str], ...], ...] = ()  # per type; () = no type has one

    @property
    def weight(self) -> np.ndarray:
        """Popularity p_m, sums to 1."""
        return self.n / max(int(self.n.sum()), 1)

    @cached_property
    def model(self) -> _FragModel:
        return _FragModel(self)


_TaskType = tuple[int, int, int, int, tuple[tuple[str, str], ...]]


def _task_type(j: Job, memory: bool = True) -> _TaskType:
    return int(j.cpu_milli), int(j.mem_bytes) if memory else 0, j.count, j.milli, tuple(sorted(j.node_selector))


def workload_types(jobs: Iterable[Job], popular: float = 1.0, memory: bool = True) -> WorkloadTypes:
    """The distribution of task types among *jobs* (popularity = share of jobs). With *popular* < 1, only
    the most common types that together hold that share of the jobs (FGD's simulator keeps 95 %), their
    popularity renormalised; types of equal count in type order. ``memory=False``: task types without
    memory (as FGD's, CPU, GPUs and GPU model only), so memory never decides whether a task fits."""
    if not 0 < popular <= 1:
        raise ValueError(f"popular must be in (0, 1], not {popular}")
    counts: dict[_TaskType, int] = {}
    for j in jobs:
        k = _task_type(j, memory)
        counts[k] = counts.get(k, 0) + 1
    if popular < 1 and counts:
        total, kept, cum = sum(counts.values()), {}, 0
        for k in sorted(counts, key=lambda k: (-counts[k], k)):
            if cum >= popular * total:
                break
            kept[k] = counts[k]
            cum += counts[k]
        counts = kept
    return _from_counts(counts)


def _from_counts(counts: Mapping[_TaskType, int]) -> WorkloadTypes:
    keys = sorted(counts)
    a = np.array([k[:4] for k in keys], np.int64).reshape(-1, 4)
    sel = tuple(k[4] for k in keys)
    return WorkloadTypes(a[:, 0], a[:, 1], a[:, 2], a[:, 3], np.array([counts[k] for k in keys], np.int64),
                         sel if any(sel) else ())


@dataclass(frozen=True)
class _NodeSummary:
    """What F_n(M) needs of each node's free GPU milli (rows = nodes)."""

    total: np.ndarray  # free milli on the node
    whole: np.ndarray  # fully free GPUs
    frag: np.ndarray  # (rows, thresholds): sum of free milli of the GPUs with free < threshold


class _FragModel:
    """F_n(M) of FGD, exactly, in integers: milli-GPU x tasks (divide by :attr:`N` for milli-GPU).

    F_n(M) * N = sum_m n_m F_n(m) = N * free_n - sum_{m fits on n} n_m (free_n - frag_n(thr_m)), where a
    task fits when the node is one its selector allows and has its CPU and memory and (a share of u milli)
    a GPU with >= u free, or (k whole GPUs) k fully free GPUs; frag_n(u) is the free milli on GPUs with
    less than u free (u = 1000 for whole GPUs) and CPU-only tasks never fit (all free GPU milli is theirs
    a fragment). A share needs no GPU test: when no GPU has u free, frag_n(u) is all the free milli, as if
    it did not fit. The GPU task types are split into parts by selector (:attr:`selectors`; ``()`` = none);
    a part's tasks whose CPU and memory fit are counted per group (a share of u milli; k whole GPUs) with
    a table of cumulative counts over the part's (CPU, memory) values, so a node costs O(groups), not
    O(task types); ``access`` (rows, parts) says which parts a node can take (None: all).
    """

    def __init__(self, w: WorkloadTypes, max_cells: int = 1 << 21):
        n = np.asarray(w.n, np.int64)
        self.N = int(n.sum())
        gpu = w.count > 0
        share, whole = gpu & (w.milli < MILLI), gpu & (w.milli >= MILLI)
        su = np.unique(w.milli[share]).astype(np.int64)
        self.u = np.unique(np.concatenate([su, [MILLI] if whole.any() else []])).astype(np.int64)  # thresholds
        sel = list(w.selector) if w.selector else [()] * len(n)
        self.selectors = sorted({sel[i] for i in np.flatnonzero(gpu)})
        self.parts = [_Part(w, n, gpu & np.array([x == s for x in sel], bool), self.u, max_cells)
                      for s in self.selectors]

    def fitting(self, cpu_free: np.ndarray, mem_free: np.ndarray) -> list[np.ndarray]:
        """Per part, (rows, groups): tasks of each group whose CPU and memory fit in what is free."""
        return [p.fitting(cpu_free, mem_free) for p in self.parts]

    def summary(self, gfree: np.ndarray) -> _NodeSummary:
        return _NodeSummary(total=gfree.sum(axis=1), whole=(gfree == MILLI).sum(axis=1),
                            frag=(gfree[:, :, None] * (gfree[:, :, None] < self.u[None, None, :])).sum(axis=1))

    def value(self, fitting: list[np.ndarray], total: np.ndarray, whole: np.ndarray, frag: np.ndarray,
              access: np.ndarray | None = None) -> np.ndarray:
        """F_n(M) * N per row."""
        out = self.N * total
        for k, (p, fit) in enumerate(zip(self.parts, fitting, strict=True)):
            gain = p.gain(fit, total, whole, frag)
            out = out - (gain if access is None else np.where(access[:, k], gain, 0))
        return out

    def nodes(self, cpu_free: np.ndarray, mem_free: np.ndarray, gfree: np.ndarray,
              access: np.ndarray | None = None) -> np.ndarray:
        """F_n(M) * N of each node state."""
        s = self.summary(gfree)
        return self.value(self.fitting(cpu_free, mem_free), s.total, s.whole, s.frag, access)


class _Part:
    """The GPU task types of one selector: groups (a share of u milli; k whole GPUs) and the table of
    cumulative counts over (CPU, memory) (:class:`_FragModel`)."""

    def __init__(self, w: WorkloadTypes, n: np.ndarray, mask: np.ndarray, u: np.ndarray, max_cells: int):
        share, whole = mask & (w.milli < MILLI), mask & (w.milli >= MILLI)
        su = np.unique(w.milli[share]).astype(np.int64)
        wk = np.unique(w.count[whole]).astype(np.int64)
        self.need = np.concatenate([su, wk])  # per group: milli on one GPU, or whole GPUs
        self.is_share = np.arange(len(self.need)) < len(su)
        self.thr = np.searchsorted(u, np.concatenate([su, np.full(len(wk), MILLI)]))
        gid = np.full(len(n), -1, np.int64)
        gid[share] = np.searchsorted(su, w.milli[share])
        gid[whole] = len(su) + np.searchsorted(wk, w.count[whole])
        t = gid >= 0
        self.cv, self.mv = np.unique(w.cpu[t]), np.unique(w.mem[t])
        groups = len(self.need)
        self.table = None
        if (len(self.cv) + 1) * (len(self.mv) + 1) * groups <= max_cells:
            tab = np.zeros((len(self.cv) + 1, len(self.mv) + 1, groups), np.int64)
            np.add.at(tab, (np.searchsorted(self.cv, w.cpu[t]) + 1, np.searchsorted(self.mv, w.mem[t]) + 1,
                            gid[t]), n[t])
            self.table = tab.cumsum(axis=0).cumsum(axis=1)
        else:  # many distinct (CPU, memory) values: count by comparison instead
            self.t_cpu, self.t_mem = w.cpu[t], w.mem[t]
            self.onehot = np.zeros((int(t.sum()), groups))
            self.onehot[np.arange(int(t.sum())), gid[t]] = n[t]

    def fitting(self, cpu_free: np.ndarray, mem_free: np.ndarray) -> np.ndarray:
        if self.table is not None:
            return self.table[np.searchsorted(self.cv, cpu_free, "right"), np.searchsorted(self.mv, mem_free, "right")]
        ok = (cpu_free[:, None] >= self.t_cpu[None, :]) & (mem_free[:, None] >= self.t_mem[None, :])
        return np.rint(ok @ self.onehot).astype(np.int64)

    def gain(self, fitting: np.ndarray, total: np.ndarray, whole: np.ndarray, frag: np.ndarray) -> np.ndarray:
        """sum over the part's fitting tasks of (free_n - frag_n(thr_m)) per row."""
        gpu_fit = self.is_share[None, :] | (whole[:, None] >= self.need[None, :])
        return np.where(gpu_fit, fitting * (total[:, None] - frag[:, self.thr]), 0).sum(axis=1)


def _access(m: _FragModel, c: Cluster, rows=slice(None)) -> np.ndarray | None:
    """(rows, parts): the parts of *m* whose selector the nodes meet; None when no part has a selector."""
    if not any(m.selectors):
        return None
    n = len(c.cpu_cap[rows])
    return np.stack([c._selector(s)[rows] if s else np.ones(n, bool) for s in m.selectors], axis=1).reshape(
        n, len(m.selectors))


def _frag(w: WorkloadTypes, cpu_free: np.ndarray, mem_free: np.ndarray, gfree: np.ndarray,
          access: np.ndarray | None = None) -> np.ndarray:
    """F_n(M) in milli-GPU for each row (node state): cpu_free (C,), mem_free (C,), gfree (C, G) milli;
    *access* (C, parts) which selectors' parts each node meets (:func:`_access`; None: all)."""
    m = w.model
    return m.nodes(np.asarray(cpu_free), np.asarray(mem_free), np.asarray(gfree, np.int64), access) / max(m.N, 1)


class _Fragmentation:
    """FGD's fragmentation growth of placing a job, per node (and per GPU for a share of one GPU).

    Against a target workload; without one, against the jobs asked about so far, each job once however
    often it is asked (a waiting job is asked again when something frees): counts per task type are
    kept as jobs come, and the distribution is rebuilt from them at every new job for the first
    *refresh_every* jobs, then every *refresh_every* new jobs. Two
    caches keep decisions cheap: each node's F_n(M) and GPU summary by node version, and each job
    type's growth per node by node version (a job type = its CPU, memory, GPUs, GPU memory, workload
    class and selector), so only nodes whose state changed since are computed again.
    """

    def __init__(self, workload: WorkloadTypes | None = None, refresh_every: int = 64, max_types: int = 512):
        self._fixed = workload
        self._counts: dict[_TaskType, int] = {}  # task type -> jobs seen of it
        self._seen_ids: set[str] = set()
        self._seen_n = 0
        self._w = workload
        self._refresh = max(1, refresh_every)
        self._max_types = max_types
        self._owner: tuple | None = None  # (cluster, nodes, GPU slots) the caches describe
        self._types: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._demand_of: WorkloadTypes | None = None  # the workload self._demand was computed for
        self._demand: dict[tuple, float] = {}  # selector -> D_s

    def workload(self, job: Job) -> WorkloadTypes:
        if self._fixed is not None:
            return self._fixed
        if job.job not in self._seen_ids:  # online popularity: the jobs asked about so far
            self._seen_ids.add(job.job)
            k = _task_type(job)
            self._counts[k] = self._counts.get(k, 0) + 1
            self._seen_n += 1
            n = self._seen_n
            if self._w is None or n <= self._refresh or n % self._refresh == 0:
                self._w = _from_counts(self._counts)
                self._owner = None
        return self._w

    def _nodes(self, c: Cluster) -> None:
        """Bring each node's F_n(M) and summary up to its version."""
        owner = (c, len(c), c._g)
        if self._owner is None or self._owner[0] is not c or self._owner[1:] != owner[1:]:
            self._owner = owner
            self._types.clear()
            self._stamp = np.full(len(c), -1, np.int64)
            m = self._w.model
            self._before = np.zeros(len(c), np.int64)
            self._sum = m.summary(np.zeros((len(c), c._g), np.int64))
        stale = np.flatnonzero(self._stamp != c.version)
        if len(stale):
            m = self._w.model
            cpu, mem, gfree = c.cpu_free(stale), c.mem_free(stale), c._gfree(stale)
            s = m.summary(gfree)
            for name in ("total", "whole", "frag"):
                getattr(self._sum, name)[stale] = getattr(s, name)
            self._before[stale] = m.value(m.fitting(cpu, mem), s.total, s.whole, s.frag, _access(m, c, stale))
            self._stamp[stale] = c.version[stale]

    def contention(self, c: Cluster) -> np.ndarray:
        """Per node: sum over the target workload's constrained parts (selector s) whose selector the node
        meets of D_s / S_s, D_s = the part's share of the workload's GPU demand (popularity x GPUs asked),
        S_s = the share of the cluster's GPUs it can use; 0 everywhere without constrained parts. Taking a
        GPU on a node uses capacity that only those parts, crowded D_s / S_s times the average, can use.
        The D_s are computed once per target workload; the node masks are the cluster's cached ones."""
        out = np.zeros(len(c))
        w = self._w
        if self._demand_of is not w:
            self._demand_of, self._demand = w, {}
            total = float((w.n * w.milli * w.count).sum())
            if w.selector and total > 0:
                for s, d in zip(w.selector, (w.n * w.milli * w.count).tolist(), strict=True):
                    if s and d:
                        self._demand[s] = self._demand.get(s, 0.0) + d / total
        if not self._demand:
            return out
        gpus = c.ngpu
        cap = float(gpus.sum())
        for s, d in self._demand.items():
            mask = c._selector(s)
            supply = float(gpus[mask].sum()) / cap if cap > 0 else 0.0
            if supply > 0:
                out[mask] += d / supply
        return out

    def deltas(self, job: Job, c: Cluster) -> np.ndarray:
        """Growth of F_n(M) in milli-GPU if *job* goes there: (nodes,), or (nodes, GPU slots) for a share
        of one GPU (one value per GPU it could take); +inf where it cannot go."""
        self._nodes(c)
        key = (job.cpu_milli, job.mem_bytes, job.gpus, job.gpu_mem_bytes, job.workload, job.node_selector,
               c.config.isolate_inference)
        hit = self._types.pop(key, None)
        share = 0 < job.gpus < 1
        if hit is None:
            stamp = np.full(len(c), -1, np.int64)
            delta = np.full((len(c), c._g) if share else len(c), _INF)
        else:
            stamp, delta = hit
        stale = np.flatnonzero(stamp != c.version)
        if len(stale):
            delta[stale] = self._compute(job, c, stale)
            stamp[stale] = c.version[stale]
        self._types[key] = (stamp, delta)
        if len(self._types) > self._max_types:
            self._types.popitem(last=False)
        return delta

    def _compute(self, job: Job, c: Cluster, rows: np.ndarray) -> np.ndarray:
        m = self._w.model
        share = 0 < job.gpus < 1
        out = np.full((len(rows), c._g) if share else len(rows), _INF)
        ok = c.feasible(job, rows)
        r = rows[ok]
        if len(r) == 0:
            return out
        s = self._sum
        total, whole, frag = s.total[r], s.whole[r], s.frag[r]
        fit = m.fitting(c.cpu_free(r) - job.cpu_milli, c.mem_free(r) - job.mem_bytes)
        acc = _access(m, c, r)
        n = max(m.N, 1)
        if job.count == 0:
            out[ok] = (m.value(fit, total, whole, frag, acc) - self._before[r]) / n
        elif not share:  # k fully free GPUs: any k leave the same free milli behind (and no fragment)
            k = job.count
            out[ok] = (m.value(fit, total - k * MILLI, whole - k, frag, acc) - self._before[r]) / n
        else:  # one hypothetical node per GPU it could take; GPUs with the same free milli are alike
            gok = c._gpu_ok(job, r)
            gfree = c._gfree(r)
            g = gfree.shape[1]
            same = (gfree[:, :, None] == gfree[:, None, :]) & gok[:, None, :]
            rep = np.argmax(same, axis=2)  # the first GPU it could take with as much free milli
            ri, gi = np.nonzero(gok & (rep == np.arange(g)[None, :]))
            f, mj = gfree[ri, gi], job.milli
            u = m.u[None, :]
            frag2 = (frag[ri] - np.where(f[:, None] < u, f[:, None], 0)
                     + np.where((f - mj)[:, None] < u, (f - mj)[:, None], 0))
            after = m.value([x[ri] for x in fit], total[ri] - mj, whole[ri] - (f == MILLI), frag2,
                            None if acc is None else acc[ri])
            d_rep = np.zeros((len(r), g))
            d_rep[ri, gi] = (after - self._before[r][ri]) / n
            sub = np.where(gok, d_rep[np.arange(len(r))[:, None], rep], _INF)
            out[ok] = sub
        return out


def fragmentation(cluster: Cluster, workload: WorkloadTypes) -> float:
    """FGD's cluster fragmentation F(M) in milli-GPUs (sum over nodes of F_n(M))."""
    return float(_frag(workload, cluster.cpu_free(), cluster.mem_free(), cluster._gfree(),
                       _access(workload.model, cluster)).sum())
