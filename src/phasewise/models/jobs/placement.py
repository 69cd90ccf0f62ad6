"""Placement: which node (and which GPUs on it) a job goes to. Pure, deterministic.

One interface, four policies. A :class:`Cluster` holds the nodes' capacities,
what placements have allocated on them and what was last observed on them
(numpy arrays, one row per node, one column per GPU slot); a policy's
:meth:`~PlacementPolicy.place` reads it and returns a :class:`Placement` (the
node, the GPU indices, the cost, the runner-up nodes' costs and a reason), and
:meth:`Cluster.allocate` books it. Same cluster and job in, same decision out:
ties go to the lower node index, then the lower GPU index.

Hard rules, the same for every policy (:meth:`Cluster.feasible`):

* CPU and memory: allocated (or observed, whichever is more) + request <= capacity.
* GPU compute in milli-GPUs (1000 = one whole GPU): a fractional job (gpus < 1)
  takes ``round(gpus * 1000)`` milli of one GPU whose allocated milli + request
  <= 1000; a job of k >= 1 GPUs takes k GPUs with nothing allocated on them.
* GPU memory: allocated (or observed used, whichever is more) + the job's GPU
  memory (per GPU) <= the device's memory. A device of unknown memory (0)
  takes only jobs that ask for no GPU memory.
* A ``node_selector`` {key: value} keeps nodes whose label matches (``a|b`` =
  either); every node is labelled ``gpu_model`` with its GPUs' model.
* With ``isolate_inference``, inference jobs never share a node with training
  jobs (both ways).

Priority: :func:`place_many` decides higher ``priority`` first (ties in
submission order), so a scarce slot goes to the more important job.

Policies (:data:`POLICIES`):

``first-fit``
    the lowest-index feasible node; on it the lowest-index feasible GPUs.
``best-fit``
    the node left with the least free resources, the mean over CPU, memory and
    GPU of (free after / capacity); on it the feasible GPUs with least free milli.
``fgd``
    Fragmentation Gradient Descent (Weng et al., ATC'23). The fragmentation of
    node n for a task m, F_n(m), is the sum of the node's unallocated GPU
    milli that m cannot use: all of it when m cannot run on n at all (CPU,
    memory or GPUs short) or m asks for no GPU; otherwise the unallocated milli
    of each GPU whose free milli is below min(m's GPU demand, 1000). Against a
    target workload M of task types with popularity p_m, F_n(M) = sum_m p_m
    F_n(m). FGD places a job on the node and GPUs where F_n(M) grows least
    (the hypothetical node after placement minus the node now).
    F_n(M) is computed exactly, in integers (task counts, not float
    popularities), per group of task shapes rather than per task type, and cached
    by node version and job type; equal growths therefore tie exactly and go to
    the lower node, then the lower GPU.
``horus``
    Horus (Yeung et al., TPDS 2022) with FGD's fragmentation growth. Horus's cost
    per GPU g is 1.3 * (memory used_g + job memory) / device memory + |util_g +
    job util - 100| / 100, times 1.6 when util_g + job util > 100, + running jobs
    on g. Memory used and util are the more of what was observed and what
    placements booked; the job's util is its predicted mean GPU utilisation
    (``Job.util``), else its requested share (gpus * 100); its memory is its
    predicted GPU memory, else its request (milli-GPU shares where a device's
    memory is unknown). The utilisation term has two parts: below 100 % it is
    the GPU left idle, above 100 % the interference of over-subscribed jobs.
    Here the idle part is replaced by FGD's measure of idle capacity, the growth
    of F_n(M): a job goes where ``w * dF / 1000 + over`` is least (``w`` =
    ``PlacementConfig.horus_frag_weight``, dF in milli-GPU, ``over`` = the
    over-subscription part, summed over the GPUs it takes); ties go to Horus's
    whole cost, then the lower node and GPU. A k-GPU job takes the node's k GPUs
    of least (over, cost). A CPU-only job takes no GPU, so none of Horus's terms
    apply: it goes where fragmentation grows least. ``w = 0``: Horus's cost
    alone (lowest wins; a CPU-only job by the same formula on the host, CPU
    share as utilisation and host memory as memory).

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

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "BestFit", "Cluster", "Fgd", "FirstFit", "Gpu", "Horus", "Job", "Node", "Placement",
    "PlacementConfig", "PlacementPolicy", "POLICIES", "WORKLOADS", "WaitingJobs", "make_policy", "need_of",
    "place_many", "why_not", "workload_types",
]

WORKLOADS = ("training", "inference", "interactive")
MILLI = 1000
_INF = float("inf")


@dataclass(frozen=True)
class Gpu:
    model: str = ""
    mem_bytes: int = 0  # device memory; 0 = unknown
    util: float = 0.0  # observed recent SM utilisation, percent
    mem_used_bytes: int = 0  # observed


@dataclass(frozen=True)
class Node:
    name: str
    cpu_milli: int
    mem_bytes: int
    gpus: tuple[Gpu, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    cpu_used_milli: int = 0  # observed (all processes on the node)
    mem_used_bytes: int = 0  # observed


@dataclass(frozen=True)
class Job:
    job: str
    cpu_milli: int
    mem_bytes: int
    gpus: float = 0.0  # < 1: a share of one GPU; >= 1: whole GPUs (integer)
    gpu_mem_bytes: int = 0  # per GPU
    workload: str = "training"
    priority: int = 0
    node_selector: tuple[tuple[str, str], ...] = ()
    util: float | None = None  # predicted mean GPU utilisation per GPU, percent
    pred_gpu_mem_bytes: int | None = None  # predicted GPU memory per GPU

    @property
    def milli(self) -> int:
        """Milli-GPUs per GPU taken (1000 for whole GPUs, 0 for none)."""
        if self.gpus <= 0:
            return 0
        return MILLI if self.gpus >= 1 else max(1, round(self.gpus * MILLI))

    @property
    def count(self) -> int:
        """GPUs taken: 0, 1 (also for a share) or k."""
        return 0 if self.gpus <= 0 else max(1, int(self.gpus))


@dataclass(frozen=True)
class Placement:
    job: str
    node: str | None  # None: no node can take it now
    gpus: tuple[int, ...] = ()
    policy: str = ""
    cost: float | None = None
    reason: str = ""
    scores: Mapping[str, float] = field(default_factory=dict)  # best few nodes -> cost

    def details(self) -> dict:
        return {"device": list(self.gpus), "policy": self.policy, "cost": self.cost,
                "scores": dict(self.scores)}


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """The hard rules' options and Horus's weights; the placement worker builds them from its ``place_*``
    settings, which hold the defaults of the fields they feed (docs/architecture.md, "Defaults")."""

    isolate_inference: bool
    top_k: int = 3  # runner-up nodes reported with each decision
    horus_mem_weight: float = 1.3
    horus_over_factor: float = 1.6
    horus_frag_weight: float  # horus: weight of FGD's fragmentation growth (GPUs) against over-capacity


@dataclass
class _Alloc:
    node: int
    gpus: tuple[int, ...]
    cpu: int
    mem: int
    milli: int
    gmem: int
    util: float
    workload: str


class Cluster:
    """Nodes' capacity, allocation and observation, as arrays (row = node, column = GPU slot)."""

    def __init__(self, nodes: Sequence[Node], config: PlacementConfig):
        self.config = config
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.labels: list[dict[str, str]] = []
        g = max([len(n.gpus) for n in nodes] + [1])
        self._g = g
        z = lambda *s: np.zeros(s, np.int64)  # noqa: E731
        self.cpu_cap, self.mem_cap, self.cpu_alloc, self.mem_alloc = z(0), z(0), z(0), z(0)
        self.cpu_used, self.mem_used = z(0), z(0)
        self.ngpu = z(0)
        self.valid = np.zeros((0, g), bool)
        self.milli_alloc, self.gmem_cap, self.gmem_alloc, self.gmem_used, self.gjobs = (z(0, g) for _ in range(5))
        self.gutil_obs = np.zeros((0, g))
        self.gutil_alloc = np.zeros((0, g))
        self.n_training, self.n_inference, self.njobs = z(0), z(0), z(0)
        self.version = z(0)
        self.allocs: dict[str, _Alloc] = {}
        self._selector_masks: dict[tuple, np.ndarray] = {}
        self.upsert_many(nodes)

    # -- state ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.names)

    def _grow(self, rows: int, g: int) -> None:
        def pad(a: np.ndarray) -> np.ndarray:
            if a.ndim == 1:
                return np.concatenate([a, np.zeros(rows, a.dtype)])
            out = np.zeros((a.shape[0] + rows, g), a.dtype)
            out[: a.shape[0], : a.shape[1]] = a
            return out
        for name in ("cpu_cap", "mem_cap", "cpu_alloc", "mem_alloc", "cpu_used", "mem_used", "ngpu", "valid",
                     "milli_alloc", "gmem_cap", "gmem_alloc", "gmem_used", "gjobs", "gutil_obs", "gutil_alloc",
                     "n_training", "n_inference", "njobs", "version"):
            setattr(self, name, pad(getattr(self, name)))
        self._g = g

    def upsert_many(self, nodes: Iterable[Node]) -> None:
        nodes = list(nodes)
        new = [n for n in nodes if n.name not in self.index]
        g = max([len(n.gpus) for n in nodes] + [self._g])
        if new or g > self._g:
            self._grow(len(new), g)
            for n in new:
                self.index[n.name] = len(self.names)
                self.names.append(n.name)
                self.labels.append({})
        for n in nodes:
            self._set(self.index[n.name], n)
        self._selector_masks.clear()

    def upsert(self, node: Node) -> None:
        """Add a node or replace what is known of it (capacity, observations, labels); bookings stay."""
        self.upsert_many([node])

    def _set(self, i: int, n: Node) -> None:
        if len(n.gpus) < int(self.ngpu[i]) and self.gjobs[i, len(n.gpus):].any():
            raise ValueError(f"node {n.name}: GPUs with jobs booked on them disappeared")
        self.cpu_cap[i], self.mem_cap[i] = n.cpu_milli, n.mem_bytes
        self.cpu_used[i], self.mem_used[i] = n.cpu_used_milli, n.mem_used_bytes
        self.ngpu[i] = len(n.gpus)
        self.valid[i] = False
        self.valid[i, : len(n.gpus)] = True
        for j, gpu in enumerate(n.gpus):
            self.gmem_cap[i, j] = gpu.mem_bytes
            self.gmem_used[i, j] = gpu.mem_used_bytes
            self.gutil_obs[i, j] = gpu.util
        labels = dict(n.labels)
        models = sorted({gpu.model for gpu in n.gpus if gpu.model})
        if models:
            labels.setdefault("gpu_model", "|".join(models))
        self.labels[i] = labels
        self.version[i] += 1

    def allocate(self, job: Job, p: Placement) -> None:
        """Book *p* (a placement of *job* on this cluster)."""
        if p.node is None:
            raise ValueError(f"job {job.job}: nothing to allocate (unplaced)")
        if job.job in self.allocs:
            raise ValueError(f"job {job.job}: already placed")
        i = self.index[p.node]
        gpus = tuple(p.gpus)
        if len(gpus) != job.count or not self.feasible(job, np.array([i]))[0] or not self._gpus_ok(job, i, gpus):
            raise ValueError(f"job {job.job}: placement on {p.node} {list(gpus)} would over-commit")
        a = _Alloc(i, gpus, job.cpu_milli, job.mem_bytes, job.milli, job.gpu_mem_bytes, _job_util(job), job.workload)
        self._book(a, +1)
        self.allocs[job.job] = a

    def restore(self, job: Job, node: str, gpus: tuple[int, ...]) -> None:
        """Book again what was decided before a restart, without the feasibility check (the node's
        observed use may already include the job); GPU indices beyond the node's are dropped."""
        if job.job in self.allocs:
            return
        i = self.index[node]
        gpus = tuple(g for g in gpus if 0 <= g < int(self.ngpu[i]))
        a = _Alloc(i, gpus, job.cpu_milli, job.mem_bytes, job.milli, job.gpu_mem_bytes, _job_util(job), job.workload)
        self._book(a, +1)
        self.allocs[job.job] = a

    def release(self, job: str) -> str | None:
        """Free what *job* had booked; its node's name (None when it had nothing)."""
        a = self.allocs.pop(job, None)
        if a is None:
            return None
        self._book(a, -1)
        return self.names[a.node]

    def _book(self, a: _Alloc, s: int) -> None:
        i = a.node
        self.cpu_alloc[i] += s * a.cpu
        self.mem_alloc[i] += s * a.mem
        for j in a.gpus:
            self.milli_alloc[i, j] += s * a.milli
            self.gmem_alloc[i, j] += s * a.gmem
            self.gjobs[i, j] += s
            self.gutil_alloc[i, j] = max(0.0, self.gutil_alloc[i, j] + s * a.util)
        self.njobs[i] += s
        if a.workload == "training":
            self.n_training[i] += s
        elif a.workload == "inference":
            self.n_inference[i] += s
        self.version[i] += 1

    def _gpus_ok(self, job: Job, i: int, gpus: tuple[int, ...]) -> bool:
        ok = self._gpu_ok(job, np.array([i]))[0]
        return len(set(gpus)) == len(gpus) and all(0 <= j < self._g and ok[j] for j in gpus)

    # -- feasibility ---------------------------------------------------------------------
    def cpu_free(self, rows=slice(None)) -> np.ndarray:
        return self.cpu_cap[rows] - np.maximum(self.cpu_alloc[rows], self.cpu_used[rows])

    def mem_free(self, rows=slice(None)) -> np.ndarray:
        return self.mem_cap[rows] - np.maximum(self.mem_alloc[rows], self.mem_used[rows])

    def gmem_free(self, rows=slice(None)) -> np.ndarray:
        return self.gmem_cap[rows] - np.maximum(self.gmem_alloc[rows], self.gmem_used[rows])

    def _gpu_ok(self, job: Job, rows=slice(None)) -> np.ndarray:
        """(nodes, GPU slots): the GPUs that can take one of the job's GPUs."""
        valid = self.valid[rows]
        if job.count == 0:
            return np.zeros_like(valid)
        mem_ok = (self.gmem_free(rows) >= job.gpu_mem_bytes) if job.gpu_mem_bytes > 0 else True
        if job.gpus >= 1:
            return valid & (self.milli_alloc[rows] == 0) & mem_ok
        return valid & (self.milli_alloc[rows] + job.milli <= MILLI) & mem_ok

    def _selector(self, sel: tuple[tuple[str, str], ...]) -> np.ndarray:
        key = tuple(sorted(sel))
        m = self._selector_masks.get(key)
        if m is None:
            def match(labels: dict[str, str]) -> bool:
                for k, v in key:
                    have = set(labels.get(k, "").split("|"))
                    if not have & set(str(v).split("|")):
                        return False
                return True
            m = np.array([match(lab) for lab in self.labels], bool)
            self._selector_masks[key] = m
        return m

    def feasible(self, job: Job, rows=slice(None)) -> np.ndarray:
        """Nodes (bool per node) that can take *job* now without over-committing anything."""
        ok = (self.cpu_free(rows) >= job.cpu_milli) & (self.mem_free(rows) >= job.mem_bytes)
        if job.count:
            ok &= self._gpu_ok(job, rows).sum(axis=1) >= job.count
        if job.node_selector:
            ok &= self._selector(job.node_selector)[rows]
        if self.config.isolate_inference:
            if job.workload == "inference":
                ok &= self.n_training[rows] == 0
            elif job.workload == "training":
                ok &= self.n_inference[rows] == 0
        return ok

    # -- measures ------------------------------------------------------------------------
    def gpu_capacity_milli(self) -> int:
        return int(self.ngpu.sum()) * MILLI

    def gpu_allocated_milli(self) -> int:
        return int(self.milli_alloc.sum())

    def fragmentation(self, workload: WorkloadTypes) -> float:
        """FGD's cluster fragmentation F(M) in milli-GPUs (sum over nodes of F_n(M))."""
        return float(_frag(workload, self.cpu_free(), self.mem_free(), self._gfree()).sum())

    def _gfree(self, rows=slice(None)) -> np.ndarray:
        return np.where(self.valid[rows], MILLI - self.milli_alloc[rows], 0)


def _job_util(job: Job) -> float:
    if job.count == 0:
        return 0.0
    return float(job.util) if job.util is not None else job.milli / 10.0


# -- the interface and the policies ------------------------------------------------------------

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
    """Horus's interference-aware cost with FGD's fragmentation growth (see the module's docstring).

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


# -- FGD's fragmentation -----------------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadTypes:
    """A target workload: task types (CPU milli, memory bytes, GPUs, milli per GPU) and how many tasks
    of each type (popularity = n / n.sum())."""

    cpu: np.ndarray
    mem: np.ndarray
    count: np.ndarray  # GPUs per task (0: CPU-only)
    milli: np.ndarray  # milli per GPU
    n: np.ndarray  # tasks of this type

    @property
    def weight(self) -> np.ndarray:
        """Popularity p_m, sums to 1."""
        return self.n / max(int(self.n.sum()), 1)

    @cached_property
    def model(self) -> _FragModel:
        return _FragModel(self)


def _task_type(j: Job) -> tuple[int, int, int, int]:
    return int(j.cpu_milli), int(j.mem_bytes), j.count, j.milli


def workload_types(jobs: Iterable[Job]) -> WorkloadTypes:
    """The distribution of task types among *jobs* (popularity = share of jobs)."""
    counts: dict[tuple[int, int, int, int], int] = {}
    for j in jobs:
        k = _task_type(j)
        counts[k] = counts.get(k, 0) + 1
    return _from_counts(counts)


def _from_counts(counts: Mapping[tuple[int, int, int, int], int]) -> WorkloadTypes:
    keys = sorted(counts)
    a = np.array(keys, np.int64).reshape(-1, 4)
    return WorkloadTypes(a[:, 0], a[:, 1], a[:, 2], a[:, 3], np.array([counts[k] for k in keys], np.int64))


@dataclass(frozen=True)
class _NodeSummary:
    """What F_n(M) needs of each node's free GPU milli (rows = nodes)."""

    total: np.ndarray  # free milli on the node
    whole: np.ndarray  # fully free GPUs
    frag: np.ndarray  # (rows, thresholds): sum of free milli of the GPUs with free < threshold


class _FragModel:
    """F_n(M) of FGD, exactly, in integers: milli-GPU x tasks (divide by :attr:`N` for milli-GPU).

    F_n(M) * N = sum_m n_m F_n(m) = N * free_n - sum_{m fits on n} n_m (free_n - frag_n(thr_m)), where a
    task fits when the node has its CPU and memory and (a share of u milli) a GPU with >= u free, or
    (k whole GPUs) k fully free GPUs; frag_n(u) is the free milli on GPUs with less than u free
    (u = 1000 for whole GPUs) and CPU-only tasks never fit (all free GPU milli is theirs a fragment).
    A share needs no GPU test: when no GPU has u free, frag_n(u) is all the free milli, as if it did not
    fit. The tasks whose CPU and memory fit are counted per group (a share of u milli; k whole GPUs)
    with a table of cumulative counts over the workload's (CPU, memory) values, so a node costs
    O(groups), not O(task types).
    """

    def __init__(self, w: WorkloadTypes, max_cells: int = 1 << 21):
        n = np.asarray(w.n, np.int64)
        self.N = int(n.sum())
        gpu = w.count > 0
        share, whole = gpu & (w.milli < MILLI), gpu & (w.milli >= MILLI)
        su = np.unique(w.milli[share]).astype(np.int64)
        wk = np.unique(w.count[whole]).astype(np.int64)
        self.u = np.unique(np.concatenate([su, [MILLI] if len(wk) else []])).astype(np.int64)  # thresholds
        self.need = np.concatenate([su, wk])  # per group: milli on one GPU, or whole GPUs
        self.is_share = np.arange(len(self.need)) < len(su)
        self.thr = np.searchsorted(self.u, np.concatenate([su, np.full(len(wk), MILLI)]))
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
        """(rows, groups): tasks of each group whose CPU and memory fit in what is free."""
        if self.table is not None:
            return self.table[np.searchsorted(self.cv, cpu_free, "right"), np.searchsorted(self.mv, mem_free, "right")]
        ok = (cpu_free[:, None] >= self.t_cpu[None, :]) & (mem_free[:, None] >= self.t_mem[None, :])
        return np.rint(ok @ self.onehot).astype(np.int64)

    def summary(self, gfree: np.ndarray) -> _NodeSummary:
        return _NodeSummary(total=gfree.sum(axis=1), whole=(gfree == MILLI).sum(axis=1),
                            frag=(gfree[:, :, None] * (gfree[:, :, None] < self.u[None, None, :])).sum(axis=1))

    def value(self, fitting: np.ndarray, total: np.ndarray, whole: np.ndarray, frag: np.ndarray) -> np.ndarray:
        """F_n(M) * N per row."""
        if not len(self.need):
            return self.N * total
        gpu_fit = self.is_share[None, :] | (whole[:, None] >= self.need[None, :])
        gain = np.where(gpu_fit, fitting * (total[:, None] - frag[:, self.thr]), 0)
        return self.N * total - gain.sum(axis=1)

    def nodes(self, cpu_free: np.ndarray, mem_free: np.ndarray, gfree: np.ndarray) -> np.ndarray:
        """F_n(M) * N of each node state."""
        s = self.summary(gfree)
        return self.value(self.fitting(cpu_free, mem_free), s.total, s.whole, s.frag)


def _frag(w: WorkloadTypes, cpu_free: np.ndarray, mem_free: np.ndarray, gfree: np.ndarray) -> np.ndarray:
    """F_n(M) in milli-GPU for each row (node state): cpu_free (C,), mem_free (C,), gfree (C, G) milli."""
    m = w.model
    return m.nodes(np.asarray(cpu_free), np.asarray(mem_free), np.asarray(gfree, np.int64)) / max(m.N, 1)


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
        self._counts: dict[tuple[int, int, int, int], int] = {}  # task type -> jobs seen of it
        self._seen_ids: set[str] = set()
        self._seen_n = 0
        self._w = workload
        self._refresh = max(1, refresh_every)
        self._max_types = max_types
        self._owner: tuple | None = None  # (cluster, nodes, GPU slots) the caches describe
        self._types: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()

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
            self._before[stale] = m.value(m.fitting(cpu, mem), s.total, s.whole, s.frag)
            self._stamp[stale] = c.version[stale]

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
        n = max(m.N, 1)
        if job.count == 0:
            out[ok] = (m.value(fit, total, whole, frag) - self._before[r]) / n
        elif not share:  # k fully free GPUs: any k leave the same free milli behind (and no fragment)
            k = job.count
            out[ok] = (m.value(fit, total - k * MILLI, whole - k, frag) - self._before[r]) / n
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
            after = m.value(fit[ri], total[ri] - mj, whole[ri] - (f == MILLI), frag2)
            d_rep = np.zeros((len(r), g))
            d_rep[ri, gi] = (after - self._before[r][ri]) / n
            sub = np.where(gok, d_rep[np.arange(len(r))[:, None], rep], _INF)
            out[ok] = sub
        return out


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


# -- the jobs waiting for room ------------------------------------------------------------------

def need_of(job: Job, config: PlacementConfig | None = None) -> tuple:
    """What decides whether *job* fits a node (:meth:`Cluster.feasible`): CPU, memory, GPUs, GPU memory,
    node selector and, with ``isolate_inference``, its workload class. Jobs with the same need fit the
    same nodes."""
    workload = job.workload if config is not None and config.isolate_inference else ""
    return (job.cpu_milli, job.mem_bytes, job.gpus, job.gpu_mem_bytes, workload, tuple(sorted(job.node_selector)))


class WaitingJobs:
    """Jobs no node could take when they were tried, indexed by what they need, in rank order.

    A waiting job fits nowhere; bookings only take room, so it can fit again only after a node gained
    room (a booking freed, a sample showing less use or more capacity, a new node). :meth:`could_fit`
    returns the jobs whose need fits one of those nodes, so a freed booking retries only the jobs it
    could take (one vectorised test per distinct need, then the exact test for the needs that pass),
    instead of every waiting job. Jobs of one need are alike for feasibility: if the first of them
    does not fit, none does. :meth:`worst` is the job of lowest rank (the first to go when the
    waiting jobs are capped).

    >>> c = Cluster([Node("a", 4000, 8 << 30)], PlacementConfig(isolate_inference=False, horus_frag_weight=1.0))
    >>> w = WaitingJobs()
    >>> w.add("big", Job("big", 8000, 1 << 30), rank=(0, 1.0, "big"))
    >>> w.add("small", Job("small", 2000, 1 << 30), rank=(0, 2.0, "small"))
    >>> w.could_fit(c, np.array([0]))
    ['small']
    >>> w.worst()
    ((0, 2.0, 'small'), 'small')
    """

    def __init__(self, config: PlacementConfig | None = None) -> None:
        self.config = config
        self._need_of: dict[str, tuple] = {}  # job -> its need
        self._jobs: dict[tuple, dict[str, None]] = {}  # need -> its jobs
        self._example: dict[tuple, Job] = {}  # need -> a job of it (for the exact test)
        self._rank_of: dict[str, tuple] = {}
        self._ranked: list[tuple[tuple, str]] = []  # (rank, job), sorted: best first
        self._arrays: tuple[list[tuple], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._need_of)

    def __contains__(self, job: object) -> bool:
        return job in self._need_of

    def needs(self) -> int:
        """Distinct needs among the waiting jobs."""
        return len(self._jobs)

    def add(self, job_id: str, job: Job, rank: tuple) -> None:
        """*job_id* waits (again), needing what *job* needs, at *rank* (lower ranks are better)."""
        self.remove(job_id)
        need = need_of(job, self.config)
        jobs = self._jobs.get(need)
        if jobs is None:
            jobs = self._jobs[need] = {}
            self._example[need] = job
            self._arrays = None
        jobs[job_id] = None
        self._need_of[job_id] = need
        self._rank_of[job_id] = rank
        bisect.insort(self._ranked, (rank, job_id))

    def remove(self, job_id: str) -> bool:
        need = self._need_of.pop(job_id, None)
        if need is None:
            return False
        jobs = self._jobs[need]
        del jobs[job_id]
        if not jobs:
            del self._jobs[need], self._example[need]
            self._arrays = None
        item = (self._rank_of.pop(job_id), job_id)
        i = bisect.bisect_left(self._ranked, item)
        del self._ranked[i]
        return True

    def worst(self) -> tuple[tuple, str] | None:
        """``(rank, job)`` of the waiting job of lowest rank (``None``: none waits)."""
        return self._ranked[-1] if self._ranked else None

    def _needs(self) -> tuple[list[tuple], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._arrays is None:
            needs = list(self._jobs)
            ex = [self._example[n] for n in needs]
            self._arrays = (needs, np.array([j.cpu_milli for j in ex], np.int64),
                            np.array([j.mem_bytes for j in ex], np.int64),
                            np.array([j.count for j in ex], np.int64), np.array([j.milli for j in ex], np.int64))
        return self._arrays

    def could_fit(self, cluster: Cluster, rows: np.ndarray) -> list[str]:
        """The waiting jobs whose need fits one of the nodes *rows* now (in no particular order)."""
        rows = np.asarray(rows, np.intp)
        if not len(rows) or not self._need_of:
            return []
        needs, cpu, mem, count, milli = self._needs()
        ok = (cpu[:, None] <= cluster.cpu_free(rows)[None, :]) & (mem[:, None] <= cluster.mem_free(rows)[None, :])
        gfree = cluster._gfree(rows)
        whole = (gfree == MILLI).sum(axis=1)  # fully free GPUs per node
        most = gfree.max(axis=1) if gfree.shape[1] else np.zeros(len(rows), np.int64)  # the freest GPU's milli
        ok &= np.where((count == 0)[:, None], True,
                       np.where((milli >= MILLI)[:, None], whole[None, :] >= count[:, None],
                                most[None, :] >= milli[:, None]))
        out: list[str] = []
        for i in np.flatnonzero(ok.any(axis=1)).tolist():  # the exact test: GPU memory, selectors, isolation
            need = needs[i]
            if cluster.feasible(self._example[need], rows).any():
                out.extend(self._jobs[need])
        return out
