"""The simulation: pods arrive, the policy places them on the cluster, pods leave (``timed``) or not
(``fill``), and :class:`PolicyResult` measures allocation, fragmentation, unplaced pods, queue delay,
with utilisations overload and, with measured co-location throughputs, the co-located pods' slowdown.
Modes and measures: docs/placement.md, "Simulation on openb 2023".
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phasewise.apps.simulate.openb import Pod
from phasewise.models.jobs.placement import (
    Cluster,
    Node,
    PlacementConfig,
    WorkloadTypes,
    make_policy,
    workload_types,
)
from phasewise.models.jobs.placement.fragmentation import _access, _frag
from phasewise.models.jobs.placement.interference import (
    MEASURED_WEIGHT,
    CoLocationTable,
    InterferenceMeter,
    MeasuredHorus,
    Workload,
)

__all__ = ["MODES", "PolicyResult", "simulate", "speed_up"]

MODES = ("timed", "fill")
_LEAVE, _GIVE_UP, _ARRIVE = 0, 1, 2  # order of events at one instant: free first


@dataclass
class PolicyResult:
    policy: str
    gpu_alloc_ratio: float
    fragmented_gpus: float
    unplaced_pods: int
    mean_queue_delay_s: float
    overloaded_gpus: float | None = None  # only when the pods carry a utilisation
    excess_util_gpus: float | None = None
    pods: int = 0
    placed: int = 0
    unplaced_gpu_milli: int = 0
    decide_s: float = 0.0  # wall time in the policy
    wall_s: float = 0.0
    series: dict[str, list[float]] = field(default_factory=dict)  # t, alloc, frag
    interference: dict | None = None  # only with measured co-location throughputs

    def public(self) -> dict:
        out = {"policy": self.policy, "gpu_alloc_ratio": round(self.gpu_alloc_ratio, 6),
               "fragmented_gpus": round(self.fragmented_gpus, 3), "unplaced_pods": self.unplaced_pods,
               "mean_queue_delay_s": round(self.mean_queue_delay_s, 3)}
        if self.overloaded_gpus is not None:
            out |= {"overloaded_gpus": round(self.overloaded_gpus, 3),
                    "excess_util_gpus": round(float(self.excess_util_gpus or 0.0), 3)}
        if self.interference is not None:
            out["interference"] = dict(self.interference)
        return out


class _Frag:
    """Per-node F_n(M), recomputed for the nodes whose state changed."""

    def __init__(self, c: Cluster, w):
        self.c, self.w = c, w
        self.per_node = _frag(w, c.cpu_free(), c.mem_free(), c._gfree(), _access(w.model, c))
        self.seen = c.version.copy()

    def total(self) -> float:
        changed = np.flatnonzero(self.seen != self.c.version)
        if len(changed):
            c = self.c
            self.per_node[changed] = _frag(self.w, c.cpu_free(changed), c.mem_free(changed), c._gfree(changed),
                                           _access(self.w.model, c, changed))
            self.seen[changed] = c.version[changed]
        return float(self.per_node.sum())


def speed_up(pods: Sequence[Pod], factor: float) -> list[Pod]:
    """Arrivals *factor* times closer together (creation times / factor), durations unchanged."""
    if not factor > 0:
        raise ValueError(f"speed-up must be > 0, not {factor}")
    return [Pod(p.job, p.created / factor, p.created / factor + p.duration) for p in pods]


def placement_policy(policy: str, workload: WorkloadTypes,
                     interference: tuple[CoLocationTable, Mapping[str, Workload]] | None,
                     measured_weight: float = MEASURED_WEIGHT) -> Any:
    """The policy named *policy* (``horus-measured`` needs *interference*: a table and the pods' workloads;
    *measured_weight*: its weight on the measured loss)."""
    if policy == MeasuredHorus.name:
        if interference is None:
            raise ValueError(f"{policy} needs measured co-location throughputs (interference)")
        return MeasuredHorus(*interference, workload=workload, weight=measured_weight)
    return make_policy(policy, workload)


def simulate(pods: Sequence[Pod], nodes: Sequence[Node], policy: str, mode: str = "timed", *,
             config: PlacementConfig, progress: Callable[[int], None] | None = None,
             max_points: int = 2000, workload: WorkloadTypes | None = None,
             interference: tuple[CoLocationTable, Mapping[str, Workload]] | None = None,
             measured_weight: float = MEASURED_WEIGHT) -> PolicyResult:
    """Run *pods* against *nodes* under *policy*; deterministic for the same input. *config* sets the
    hard rules' options and horus's weights; fgd and horus measure fragmentation against *workload*
    (default: the pods' own distribution of task types). With *interference* (a co-location table and
    each pod's workload) the result carries the co-located pods' measured slowdown: after the last
    arrival in ``fill``, time-weighted over the arrivals' span in ``timed``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
    t0 = time.perf_counter()
    c = Cluster(nodes, config)
    w = workload if workload is not None else workload_types(p.job for p in pods)
    pol = placement_policy(policy, w, interference, measured_weight)
    frag = _Frag(c, workload_types(p.job for p in pods if p.job.count))
    cap = max(c.gpu_capacity_milli(), 1)
    decide = 0.0
    placed_at: dict[int, float] = {}
    unplaced: list[int] = []
    ts, allocs, frags, overs, excess = [], [], [], [], []
    with_util = any(p.job.util is not None for p in pods)
    area_alloc = area_frag = area_over = area_excess = 0.0
    last_t: float | None = None
    first_t = pods[0].created if pods else 0.0
    meter = InterferenceMeter(*interference) if interference is not None else None
    meter_t = first_t

    end_t = pods[-1].created if pods else 0.0  # measures are averaged over the arrivals' span

    def record(t: float) -> None:
        nonlocal area_alloc, area_frag, area_over, area_excess, last_t
        a, f = c.gpu_allocated_milli() / cap, frag.total() / 1000.0
        o = e = 0.0
        if with_util:
            above = np.maximum(c.gutil_alloc - 100.0, 0.0)
            o, e = float((above > 1e-9).sum()), float(above.sum() / 100.0)
        if last_t is not None and allocs and last_t < end_t:
            dt = min(t, end_t) - last_t
            area_alloc += allocs[-1] * dt
            area_frag += frags[-1] * dt
            area_over += overs[-1] * dt
            area_excess += excess[-1] * dt
        if ts and ts[-1] == t:
            allocs[-1], frags[-1], overs[-1], excess[-1] = a, f, o, e
        else:
            ts.append(t), allocs.append(a), frags.append(f), overs.append(o), excess.append(e)
        last_t = t

    def try_place(i: int, t: float) -> bool:
        nonlocal decide
        job = pods[i].job
        d0 = time.perf_counter()
        p = pol.place(job, c)
        decide += time.perf_counter() - d0
        if p.node is None:
            return False
        c.allocate(job, p)
        if meter is not None:
            i_node = c.index[p.node]
            meter.place(job.job, [(i_node, g) for g in p.gpus])
        placed_at[i] = t
        return True

    def tick(t: float) -> None:
        """Timed: add the co-location state that held from the last event until *t* (before it changes)."""
        nonlocal meter_t
        if meter is not None and t > meter_t and meter_t < end_t:
            meter.advance(min(t, end_t) - meter_t)
            meter_t = min(t, end_t)

    if mode == "fill":
        for i, pod in enumerate(pods):
            if not try_place(i, pod.created):
                unplaced.append(i)
            record(float(i))  # the x axis of fill is arrivals
            if progress and (i % 200 == 0 or i == len(pods) - 1):
                progress(i + 1)
        alloc_ratio, frag_gpus = allocs[-1] if allocs else 0.0, frags[-1] if frags else 0.0
        over_gpus, excess_gpus = (overs[-1], excess[-1]) if overs else (0.0, 0.0)
    else:
        events: list[tuple[float, int, int]] = [(p.created, _ARRIVE, i) for i, p in enumerate(pods)]
        heapq.heapify(events)
        queue: list[tuple[int, int]] = []  # (-priority, index), kept sorted
        waiting: set[int] = set()
        arrived = 0
        while events:
            t, kind, i = heapq.heappop(events)
            tick(t)
            if kind == _ARRIVE:
                arrived += 1
                if try_place(i, t):
                    heapq.heappush(events, (t + pods[i].duration, _LEAVE, i))
                else:
                    waiting.add(i)
                    queue.append((-pods[i].job.priority, i))
                    queue.sort()
                    heapq.heappush(events, (pods[i].deleted, _GIVE_UP, i))
                if progress and (arrived % 200 == 0 or arrived == len(pods)):
                    progress(arrived)
            elif kind == _GIVE_UP:
                if i in waiting:
                    waiting.discard(i)
                    queue.remove((-pods[i].job.priority, i))
                    unplaced.append(i)
            else:
                node = c.release(pods[i].job.job)
                if meter is not None:
                    meter.release(pods[i].job.job)
                if queue and node is not None:
                    row = np.array([c.index[node]])
                    for q in list(queue):
                        j = q[1]
                        if c.feasible(pods[j].job, row)[0] and try_place(j, t):
                            queue.remove(q)
                            waiting.discard(j)
                            heapq.heappush(events, (t + pods[j].duration, _LEAVE, j))
            record(t)
        span = end_t - first_t
        alloc_ratio = area_alloc / span if span > 0 else (allocs[-1] if allocs else 0.0)
        frag_gpus = area_frag / span if span > 0 else (frags[-1] if frags else 0.0)
        over_gpus = area_over / span if span > 0 else (overs[-1] if overs else 0.0)
        excess_gpus = area_excess / span if span > 0 else (excess[-1] if excess else 0.0)
    if meter is not None and meter.acc.weight == 0:  # fill, or a timed list whose pods all arrive at once
        meter.advance(1.0)
    delays = [placed_at[i] - pods[i].created for i in placed_at]
    step = max(1, len(ts) // max_points)
    return PolicyResult(
        policy=policy, gpu_alloc_ratio=float(alloc_ratio), fragmented_gpus=float(frag_gpus),
        unplaced_pods=len(unplaced), mean_queue_delay_s=float(np.mean(delays)) if delays else 0.0,
        overloaded_gpus=float(over_gpus) if with_util else None,
        excess_util_gpus=float(excess_gpus) if with_util else None,
        pods=len(pods), placed=len(placed_at),
        unplaced_gpu_milli=sum(pods[i].job.milli * pods[i].job.count for i in unplaced),
        decide_s=decide, wall_s=time.perf_counter() - t0,
        series={"t": ts[::step], "alloc": allocs[::step], "frag": frags[::step]},
        interference=meter.summary() if meter is not None else None,
    )
