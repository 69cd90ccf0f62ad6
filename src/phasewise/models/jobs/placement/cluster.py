"""The cluster a placement policy reads: nodes, jobs, placements and the hard rules, as numpy arrays.

A :class:`Cluster` holds each node's capacity, what placements booked on it and what was last observed
on it (one row per node, one column per GPU slot); :meth:`Cluster.feasible` is the hard rules every
policy obeys and :meth:`Cluster.allocate` books a :class:`Placement` (docs/placement.md, "The interface
and the hard rules").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["MILLI", "WORKLOADS", "Cluster", "Gpu", "Job", "Node", "Placement", "PlacementConfig"]

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
    replicas: int = 1
    #: a frozen job's (gpus, cpu, milli, gmem, util) while it holds its memory only
    held: tuple | None = None


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

    def rescale(self, job: str, replicas: int) -> str | None:
        """Book *replicas* times the CPU and memory *job* booked for one (an inference service's local
        replicas share its node and GPUs), without the feasibility check (they run already); its node's
        name (``None``: *job* has no booking here)."""
        a = self.allocs.get(job)
        if a is None:
            return None
        k = max(1, int(replicas))
        one_cpu, one_mem = a.cpu // a.replicas, a.mem // a.replicas
        if k != a.replicas:
            self._book(a, -1)
            a.cpu, a.mem, a.replicas = one_cpu * k, one_mem * k, k
            self._book(a, +1)
        return self.names[a.node]

    def freeze(self, job: str) -> str | None:
        """*job* is frozen: it keeps its memory booked and nothing else (its CPUs and GPUs are free, as the
        priority policy counts a frozen job); its node's name (``None``: not booked here, or frozen already)."""
        a = self.allocs.get(job)
        if a is None or a.held is not None:
            return None
        self._book(a, -1)
        a.held = (a.gpus, a.cpu, a.milli, a.gmem, a.util)
        a.gpus, a.cpu, a.milli, a.gmem, a.util = (), 0, 0, 0, 0.0
        self._book(a, +1)
        return self.names[a.node]

    def thaw(self, job: str) -> str | None:
        """*job* runs again: all it booked is booked again, without the feasibility check (the priority agent
        thawed it where it fits); its node's name (``None``: not booked here, or not frozen)."""
        a = self.allocs.get(job)
        if a is None or a.held is None:
            return None
        self._book(a, -1)
        (a.gpus, a.cpu, a.milli, a.gmem, a.util), a.held = a.held, None
        self._book(a, +1)
        return self.names[a.node]

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

    def _gfree(self, rows=slice(None)) -> np.ndarray:
        return np.where(self.valid[rows], MILLI - self.milli_alloc[rows], 0)


def _job_util(job: Job) -> float:
    if job.count == 0:
        return 0.0
    return float(job.util) if job.util is not None else job.milli / 10.0
