"""The placement policies: horus, first-fit, best-fit and fgd, one interface (:class:`PlacementPolicy`).

A policy's :meth:`~PlacementPolicy.place` reads a :class:`~phasewise.models.jobs.placement.cluster.Cluster`
and returns a :class:`~phasewise.models.jobs.placement.cluster.Placement` (node, GPUs, cost, the runner-up
nodes' costs, a reason); same cluster and job in, same decision out, ties to the lower node index, then
the lower GPU index. What each policy minimises: docs/placement.md, "The policies".

>>> from phasewise.models.jobs.placement.cluster import Gpu, Node, PlacementConfig
>>> nodes = [Node("a", 8000, 32 << 30, gpus=(Gpu("T4", 16 << 30),) * 2),
...          Node("b", 8000, 32 << 30, gpus=(Gpu("T4", 16 << 30),))]
>>> c = Cluster(nodes, PlacementConfig(isolate_inference=False, horus_frag_weight=1.0))
>>> job = Job("j1", cpu_milli=1000, mem_bytes=1 << 30, gpus=0.5, gpu_mem_bytes=4 << 30)
>>> p = FirstFit().place(job, c)
>>> (p.node, p.gpus)
('a', (0,))
>>> c.allocate(job, p)
>>> Horus().place(Job("j2", 1000, 1 << 30, gpus=0.5, gpu_mem_bytes=4 << 30), c).gpus
(1,)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from phasewise.models.jobs.placement.cluster import _INF, MILLI, Cluster, Job, Placement, _job_util
from phasewise.models.jobs.placement.fragmentation import WorkloadTypes, _Fragmentation

__all__ = ["POLICIES", "BestFit", "Fgd", "FirstFit", "Horus", "PlacementPolicy", "make_policy", "place_many",
           "why_not"]

@runtime_checkable
class PlacementPolicy(Protocol):
    name: str

    def place(self, job: Job, cluster: Cluster) -> Placement:
        """Where *job* goes now (``node=None`` when nowhere); reads *cluster*, changes nothing."""
        ...


def _unplaced(job: Job, policy: str, cluster: Cluster) -> Placement:
    return Placement(job.job, None, (), policy, None, _why_not(job, cluster))


def why_not(job: Job, cluster: Cluster) -> str:
    """Why no node can take *job* now (the reason of an unplaced :class:`Placement`)."""
    return _why_not(job, cluster)


def _why_not(job: Job, c: Cluster) -> str:
    if len(c) == 0:
        return "no nodes known"
    checks = [("CPU", c.cpu_free() >= job.cpu_milli), ("memory", c.mem_free() >= job.mem_bytes)]
    if job.count:
        checks.append((f"{job.count} GPU(s) of {job.milli} milli"
                       + (f" and {job.gpu_mem_bytes} B GPU memory" if job.gpu_mem_bytes else ""),
                       c._gpu_ok(job).sum(axis=1) >= job.count))
    if job.node_selector:
        checks.append((f"selector {dict(job.node_selector)}", c._selector(job.node_selector)))
    short = [name for name, ok in checks if not ok.any()]
    if short:
        return "no node has enough " + ", ".join(short)
    return "no node has all of " + ", ".join(name for name, _ in checks) + (
        " (inference isolated from training)" if c.config.isolate_inference else "")


def _decide(job: Job, c: Cluster, policy: str, cost: np.ndarray, gpu_pick, what: str,
            tie: np.ndarray | None = None, reason=None) -> Placement:
    """Lowest *cost* wins, then lowest *tie* (when given), then the lower index; *cost* is +inf where
    infeasible. *reason*, when given, writes the reason's middle from the chosen node's index."""
    finite = np.isfinite(cost)
    if not finite.any():
        return _unplaced(job, policy, c)
    k = max(1, c.config.top_k)
    idx = np.arange(len(cost))
    if tie is None:
        best = int(np.argmin(cost))  # the first minimum: the lower index on ties
        top = np.argpartition(cost, k - 1)[:k] if len(cost) > k else idx
        order = top[np.lexsort((top, cost[top]))]
    else:
        order = np.lexsort((idx, tie, cost))
        best = int(order[0])
    scores = {c.names[int(i)]: round(float(cost[i]), 6) for i in order[:k] if finite[i]}
    gpus = tuple(int(j) for j in gpu_pick(best)) if job.count else ()
    middle = reason(best) if reason else f"{what} {float(cost[best]):.4g}"
    reason_line = f"{policy}: {middle} on {c.names[best]}" + (
        f" GPU {list(gpus)}" if gpus else "") + f" among {int(finite.sum())} feasible nodes"
    return Placement(job.job, c.names[best], gpus, policy, float(cost[best]), reason_line, scores)


class FirstFit:
    name = "first-fit"

    def place(self, job: Job, cluster: Cluster) -> Placement:
        ok = cluster.feasible(job)
        cost = np.where(ok, np.arange(len(ok), dtype=float), _INF)
        gok = cluster._gpu_ok(job) if job.count else None
        return _decide(job, cluster, self.name, cost, lambda i: np.flatnonzero(gok[i])[: job.count], "node index")


class BestFit:
    name = "best-fit"

    def place(self, job: Job, cluster: Cluster) -> Placement:
        c = cluster
        ok = c.feasible(job)
        cpu_left = (c.cpu_free() - job.cpu_milli) / np.maximum(c.cpu_cap, 1)
        mem_left = (c.mem_free() - job.mem_bytes) / np.maximum(c.mem_cap, 1)
        gfree = c._gfree().sum(axis=1) - job.milli * job.count
        gpu_left = np.where(c.ngpu > 0, gfree / np.maximum(c.ngpu * MILLI, 1), 0.0)
        cost = np.where(ok, (cpu_left + mem_left + gpu_left) / 3.0, _INF)
        gok = c._gpu_ok(job) if job.count else None

        def pick(i: int) -> np.ndarray:
            free = np.where(gok[i], MILLI - c.milli_alloc[i], MILLI + 1)
            return np.lexsort((np.arange(len(free)), free))[: job.count]
        return _decide(job, c, self.name, cost, pick, "free share left")


class Horus:
    """Horus's interference-aware cost with FGD's fragmentation growth (docs/placement.md, "The policies").

    Per node (and its GPUs) the policy minimises ``w * dF / 1000 + over`` (``w`` =
    ``PlacementConfig.horus_frag_weight``; ``dF`` = FGD's growth of F_n(M) in milli-GPU; ``over`` =
    Horus's over-capacity term, ``1.6 * max(0, util now + job util - 100) / 100`` per GPU it takes),
    then Horus's whole cost, then the lower index.
    """

    name = "horus"

    def __init__(self, workload: WorkloadTypes | None = None, refresh_every: int = 64):
        self._frag = _Fragmentation(workload, refresh_every)

    def _gpu_costs(self, job: Job, c: Cluster, rows: np.ndarray) -> np.ndarray:
        return self._gpu_terms(job, c, rows)[0]

    def _gpu_terms(self, job: Job, c: Cluster, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(Horus's cost, its over-capacity term) per GPU of *rows*."""
        cfg = c.config
        gcap = c.gmem_cap[rows]
        known = gcap > 0
        cap = np.maximum(gcap, 1)
        milli = c.milli_alloc[rows]
        jmem = job.pred_gpu_mem_bytes if job.pred_gpu_mem_bytes is not None else job.gpu_mem_bytes
        mem_now = np.where(known, np.maximum(c.gmem_alloc[rows], c.gmem_used[rows]) / cap, milli / MILLI)
        mem_job = np.where(known, jmem / cap, job.milli / MILLI)
        s = np.maximum(c.gutil_obs[rows], c.gutil_alloc[rows]) + _job_util(job)
        util = np.abs(s - 100.0) / 100.0 * np.where(s > 100.0, cfg.horus_over_factor, 1.0)
        over = np.where(s > 100.0, util, 0.0)
        return cfg.horus_mem_weight * (mem_now + mem_job) + util + c.gjobs[rows], over

    def place(self, job: Job, cluster: Cluster) -> Placement:
        c = cluster
        cfg = c.config
        wf = cfg.horus_frag_weight
        if wf <= 0:
            return self._place_alone(job, c)
        self._frag.workload(job)
        d = self._frag.deltas(job, c)
        if job.count == 0:  # no GPU taken: none of Horus's GPU terms apply
            return _decide(job, c, self.name, d.copy(), None, "fragmentation change (milli-GPU)")
        ok = c.feasible(job)
        rows = np.flatnonzero(ok)
        key, tie, gd, ov = (np.full(len(c), _INF) for _ in range(4))
        order = np.zeros((0, 1), np.int64)
        if len(rows):
            h, over = self._gpu_terms(job, c, rows)
            gok = c._gpu_ok(job, rows)
            share = d.ndim == 2  # a share of one GPU: the growth depends on the GPU
            gkey = np.where(gok, over + wf * d[rows] / MILLI if share else over, _INF)
            h = np.where(gok, h, _INF)
            order = np.lexsort((h, gkey), axis=1)[:, : job.count]  # per node: least key, then cost, then index
            key[rows] = np.take_along_axis(gkey, order, axis=1).sum(axis=1)
            tie[rows] = np.take_along_axis(h, order, axis=1).sum(axis=1)
            ov[rows] = np.take_along_axis(np.where(gok, over, 0.0), order, axis=1).sum(axis=1)
            gd[rows] = d[rows, order[:, 0]] if share else d[rows]
            if not share:
                key[rows] += wf * d[rows] / MILLI
            key[rows] += wf * job.count * job.milli / MILLI * self._frag.contention(c)[rows]
        return _decide(job, c, self.name, key, lambda i: np.sort(order[np.searchsorted(rows, i)]), "",
                       tie=tie, reason=lambda i: (f"fragmentation change {gd[i]:+.4g} milli-GPU x {wf:g} "
                                                  f"+ over capacity {ov[i]:.3g}, Horus cost {tie[i]:.4g}"))

    def _place_alone(self, job: Job, c: Cluster) -> Placement:
        """Horus's cost alone (``horus_frag_weight`` 0)."""
        ok = c.feasible(job)
        cfg = c.config
        if job.count == 0:
            mem = (np.maximum(c.mem_alloc, c.mem_used) + job.mem_bytes) / np.maximum(c.mem_cap, 1)
            s = (np.maximum(c.cpu_alloc, c.cpu_used) + job.cpu_milli) / np.maximum(c.cpu_cap, 1) * 100.0
            util = np.abs(s - 100.0) / 100.0 * np.where(s > 100.0, cfg.horus_over_factor, 1.0)
            cost = np.where(ok, cfg.horus_mem_weight * mem + util + c.njobs, _INF)
            return _decide(job, c, self.name, cost, None, "host cost")
        rows = np.flatnonzero(ok)
        cost = np.full(len(c), _INF)
        order = np.zeros((0, 1), np.int64)
        if len(rows):
            gcost = np.where(c._gpu_ok(job, rows), self._gpu_costs(job, c, rows), _INF)
            if job.count == 1:
                order = np.argmin(gcost, axis=1)[:, None]  # first minimum: lower GPU index on ties
            else:
                order = np.argsort(gcost, axis=1, kind="stable")[:, : job.count]
            cost[rows] = np.take_along_axis(gcost, order, axis=1).sum(axis=1)
        return _decide(job, c, self.name, cost, lambda i: np.sort(order[np.searchsorted(rows, i)]), "cost")


class Fgd:
    """FGD against a target workload; without one, against the jobs it has been asked to place
    (:class:`_Fragmentation`)."""

    name = "fgd"

    def __init__(self, workload: WorkloadTypes | None = None, refresh_every: int = 64):
        self._frag = _Fragmentation(workload, refresh_every)

    @property
    def _w(self) -> WorkloadTypes | None:
        return self._frag._w

    @property
    def _seen(self) -> int:
        """Distinct jobs asked about (online workload)."""
        return self._frag._seen_n

    def place(self, job: Job, cluster: Cluster) -> Placement:
        c = cluster
        self._frag.workload(job)
        d = self._frag.deltas(job, c)
        if d.ndim == 2:  # a share: per node the GPU of least growth, ties to the lower GPU index
            first = np.argmin(d, axis=1)
            delta = d[np.arange(len(d)), first]
        else:
            delta = d

        def pick(i: int) -> np.ndarray:
            if d.ndim == 2:
                return np.array([first[i]])
            return np.flatnonzero(c._gpu_ok(job, np.array([i]))[0])[: job.count]
        return _decide(job, c, self.name, delta.copy(), pick, "fragmentation change (milli-GPU)")


POLICIES = {"horus": Horus, "first-fit": FirstFit, "best-fit": BestFit, "fgd": Fgd}


def make_policy(name: str, workload: WorkloadTypes | None = None) -> PlacementPolicy:
    """A policy by name; *workload* is the target workload of fgd's and horus's fragmentation (none: the
    jobs asked about so far)."""
    if name not in POLICIES:
        raise ValueError(f"unknown placement policy {name!r} (one of {', '.join(POLICIES)})")
    return POLICIES[name](workload) if name in ("fgd", "horus") else POLICIES[name]()


def place_many(jobs: Sequence[Job], cluster: Cluster, policy: PlacementPolicy) -> list[Placement]:
    """Decide and book *jobs*, higher priority first (ties in the given order); placements in input order."""
    order = sorted(range(len(jobs)), key=lambda i: (-jobs[i].priority, i))
    out: dict[int, Placement] = {}
    for i in order:
        p = policy.place(jobs[i], cluster)
        if p.node is not None:
            cluster.allocate(jobs[i], p)
        out[i] = p
    return [out[i] for i in range(len(jobs))]
