"""The jobs waiting for room, indexed by what they need, so a node that gains room retries only the jobs it
could take (docs/placement.md, "Waiting jobs: retried where room came, capped")."""

from __future__ import annotations

import bisect

import numpy as np

from phasewise.models.jobs.placement.cluster import MILLI, Cluster, Job, PlacementConfig

__all__ = ["WaitingJobs", "need_of"]


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

    >>> from phasewise.models.jobs.placement.cluster import Node
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
