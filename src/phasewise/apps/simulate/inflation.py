"""FGD's experiment (Weng et al., ATC'23, §6): the pod list inflated by Monte-Carlo sampling until the
arrived GPU demand reaches a share of the cluster's GPU capacity, shuffled, placed once and never
released; per seed, the unallocated-GPU ratio against arrived workload and the cluster figures FGD's
simulator prints (docs/placement.md, "FGD's experiment: `--mode inflation`").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from phasewise.apps.simulate.engine import placement_policy
from phasewise.apps.simulate.openb import Pod
from phasewise.models.jobs.placement import MILLI, Cluster, Node, PlacementConfig
from phasewise.models.jobs.placement.fragmentation import WorkloadTypes, fragmentation
from phasewise.models.jobs.placement.interference import MEASURED_WEIGHT, CoLocationTable, InterferenceMeter, Workload

__all__ = ["SeedResult", "inflate", "run_seed", "summarise"]


def _demand(p: Pod) -> int:
    """GPU milli a pod asks for (all its GPUs)."""
    return p.job.milli * p.job.count


def inflate(pods: Sequence[Pod], nodes: Sequence[Node], ratio: float, seed: int,
            origin: dict[str, str] | None = None) -> list[Pod]:
    """FGD's workload tuning: keep every pod and add copies of pods drawn uniformly (with replacement) until
    the next draw would take the total GPU demand past *ratio* x the nodes' GPU capacity (or, when the
    list already asks for more, drop pods drawn uniformly until it does not); then order by name and
    shuffle. Deterministic per *seed*; copies are named ``<name>-tuned-<k>``; ``created`` = position.
    *origin*: filled with each copy's name -> the name of the pod it copies."""
    if not ratio > 0:
        raise ValueError(f"inflation ratio must be > 0, not {ratio}")
    if not pods:
        raise ValueError("no pods to inflate")
    rng = np.random.default_rng(seed)
    target = ratio * sum(len(n.gpus) for n in nodes) * MILLI
    out = list(pods)
    total = sum(_demand(p) for p in out)
    if total > target:
        while total > target and out:
            total -= _demand(out.pop(int(rng.integers(len(out)))))
    else:
        k = 0
        while True:
            p = pods[int(rng.integers(len(pods)))]
            if total + _demand(p) > target:
                break
            name = f"{p.job.job}-tuned-{k}"
            out.append(Pod(dataclasses.replace(p.job, job=name), 0.0, 0.0, p.timed))
            if origin is not None:
                origin[name] = p.job.job
            total += _demand(p)
            k += 1
    out.sort(key=lambda p: p.job.job)
    order = rng.permutation(len(out))
    return [Pod(out[j].job, float(i), float(i), out[j].timed) for i, j in enumerate(order)]


@dataclass
class SeedResult:
    """One policy on one inflated list. ``unallocated_pct[x]`` = 100 - allocated GPU milli in % of capacity
    once the arrived GPU demand first reached x % of capacity (x = 0 .. ratio x 100)."""

    policy: str
    seed: int
    pods: int
    failed_pods: int
    failed_gpu_milli: int
    unallocated_pct: list[float]
    alloc: dict[str, float]  # FGD's "Allocation Ratio": milli_cpu, memory, gpu (GPUs in use), milli_gpu
    idle_gpu_milli: int
    frag_gpu_milli: float  # FGD's fragmentation against the target workload, at the end
    failed_pods_at_100: int = 0  # failed before arrived GPU demand reached the capacity
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def public(self) -> dict:
        return {"seed": self.seed, "pods": self.pods, "failed_pods": self.failed_pods,
                "failed_pods_at_100": self.failed_pods_at_100,
                "failed_gpu_milli": self.failed_gpu_milli,
                "alloc_ratio": {k: round(v, 6) for k, v in self.alloc.items()},
                "idle_gpu_milli": self.idle_gpu_milli, "frag_gpu_milli": round(self.frag_gpu_milli, 1),
                "unallocated_gpu_pct_at_100": round(self.unallocated_pct[min(100, len(self.unallocated_pct) - 1)], 3),
                "unallocated_gpu_pct_at_end": round(self.unallocated_pct[-1], 3)}


def run_seed(pods: Sequence[Pod], nodes: Sequence[Node], policy: str, *, ratio: float, seed: int,
             config: PlacementConfig, workload: WorkloadTypes,
             progress: Callable[[int], None] | None = None,
             interference: tuple[CoLocationTable, Mapping[str, Workload]] | None = None,
             measured_weight: float = MEASURED_WEIGHT) -> SeedResult:
    """Inflate *pods* with *seed* and place them in order under *policy*; fgd and horus (and the
    fragmentation measure) use *workload* as the target workload. With *interference* (a co-location
    table and the workload of each pod of the list; a copy runs its pod's) ``extra["interference"]``
    holds the co-located pods' measured slowdown once every pod has arrived, and ``horus-measured``
    may be the policy."""
    t0 = time.perf_counter()
    origin: dict[str, str] = {}
    ps = inflate(pods, nodes, ratio, seed, origin)
    c = Cluster(nodes, config)
    meter = copies = None
    if interference is not None:  # a copy runs the workload of the pod it copies
        table, drawn = interference
        copies = (table, {p.job.job: w for p in ps if (w := drawn.get(origin.get(p.job.job, p.job.job))) is not None})
        meter = InterferenceMeter(*copies)
    pol = placement_policy(policy, workload, copies, measured_weight)
    cap = max(c.gpu_capacity_milli(), 1)
    steps = int(math.floor(ratio * 100 + 1e-9)) + 1
    curve = np.full(steps, np.nan)
    arrived, nxt, failed, failed_milli, failed_at_100 = 0, 0, 0, 0, None
    for i, p in enumerate(ps):
        pl = pol.place(p.job, c)
        if pl.node is not None:
            c.allocate(p.job, pl)
            if meter is not None:
                i_node = c.index[pl.node]
                meter.place(p.job.job, [(i_node, g) for g in pl.gpus])
        else:
            failed += 1
            failed_milli += _demand(p)
        if failed_at_100 is None and arrived + _demand(p) > cap:  # this pod takes the demand past capacity
            failed_at_100 = failed
        arrived += _demand(p)
        while nxt < steps and arrived * 100 >= nxt * cap:
            curve[nxt] = 100.0 - 100.0 * c.gpu_allocated_milli() / cap
            nxt += 1
        if progress and (i % 200 == 0 or i == len(ps) - 1):
            progress(i + 1)
    curve[nxt:] = 100.0 - 100.0 * c.gpu_allocated_milli() / cap
    gpus = int(c.ngpu.sum())
    alloc = {"milli_cpu": float(c.cpu_alloc.sum() / max(c.cpu_cap.sum(), 1)),
             "memory": float(c.mem_alloc.sum() / max(c.mem_cap.sum(), 1)),
             "gpu": float(((c.milli_alloc > 0) & c.valid).sum() / max(gpus, 1)),
             "milli_gpu": c.gpu_allocated_milli() / cap}
    extra = {}
    if meter is not None:  # one snapshot: every pod arrived, nothing released
        meter.advance(1.0)
        extra["interference"] = meter.summary()
    return SeedResult(policy, seed, len(ps), failed, failed_milli, [float(x) for x in curve], alloc,
                      int(c._gfree().sum()), fragmentation(c, workload),
                      failed_pods_at_100=failed if failed_at_100 is None else failed_at_100,
                      wall_s=time.perf_counter() - t0, extra=extra)


def summarise(policy: str, runs: Sequence[SeedResult]) -> dict:
    """Mean and standard deviation over seeds (sample sd; 0 for one seed), and the mean curve."""
    def stat(xs: Sequence[float]) -> dict:
        a = np.asarray(xs, float)
        return {"mean": round(float(a.mean()), 3), "sd": round(float(a.std(ddof=1)) if len(a) > 1 else 0.0, 3)}

    curves = np.array([r.unallocated_pct for r in runs])
    at100 = min(100, curves.shape[1] - 1)
    return {
        "policy": policy, "seeds": len(runs),
        "unallocated_gpu_pct_at_100": stat(curves[:, at100]),
        "unallocated_gpu_pct_at_end": stat(curves[:, -1]),
        "failed_pods": stat([r.failed_pods for r in runs]),
        "failed_pods_at_100": stat([r.failed_pods_at_100 for r in runs]),
        "failed_gpus": stat([r.failed_gpu_milli / MILLI for r in runs]),
        "frag_gpus": stat([r.frag_gpu_milli / MILLI for r in runs]),
        "alloc_ratio": {k: stat([r.alloc[k] for r in runs]) for k in runs[0].alloc},
        "curve": {"arrived_pct": list(range(curves.shape[1])),
                  "unallocated_gpu_pct": [round(float(x), 3) for x in curves.mean(axis=0)]},
        "per_seed": [r.public() for r in runs],
        **({"interference": {k: stat([r.extra["interference"][k] for r in runs])
                             for k in runs[0].extra["interference"]
                             if all(r.extra["interference"][k] is not None for r in runs)}}
           if all("interference" in r.extra for r in runs) else {}),
    }
