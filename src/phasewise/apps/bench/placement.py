"""``phasewise bench placement``: decision time of the placement policies at cluster scale, and of the
placement agent's state with thousands of jobs waiting (no Kafka). docs/benchmarks.md, "What each bench
measures".
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

import numpy as np

from phasewise.kit.settings import Settings
from phasewise.models.jobs.placement import (
    POLICIES,
    Cluster,
    Gpu,
    Job,
    Node,
    PlacementConfig,
    make_policy,
    workload_types,
)

GIB = 1 << 30
_MIX = [(8, "G2", 0.36), (2, "T4", 0.34), (0, "", 0.2), (4, "V100M16", 0.04), (8, "G3", 0.03), (2, "P100", 0.03)]
_SHARES = [1.0, 1.0, 1.0, 0.81, 0.47, 0.32, 0.65, 0.23, 0.5, 0.1, 2.0, 4.0, 8.0, 0.0, 0.0]


def cluster_nodes(n: int, seed: int = 0) -> list[Node]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        g, model, _ = rng.choices(_MIX, weights=[m[2] for m in _MIX])[0]
        out.append(Node(f"node-{i:04d}", 96000 if g == 8 else 64000 if g else 32000, (512 if g == 8 else 256) * GIB,
                        gpus=(Gpu(model, 16 * GIB),) * g))
    return out


def jobs(n: int, seed: int = 1, prefix: str = "job") -> list[Job]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        share = rng.choice(_SHARES)
        out.append(Job(f"{prefix}-{i}", rng.choice([2000, 4000, 8000, 12000]), rng.choice([8, 16, 32]) * GIB,
                       gpus=share, gpu_mem_bytes=int(min(share, 1) * 12 * GIB) if share else 0,
                       priority=rng.randint(0, 2), util=rng.uniform(20, 95) if share else None))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=1500)
    p.add_argument("--jobs", type=int, default=500, help="jobs timed per policy")
    p.add_argument("--fill", type=float, default=0.5, help="share of GPUs booked before timing (default 0.5)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--observe", type=int, default=10, help="nodes with new observations between two jobs")
    p.add_argument("--online", action="store_true",
                   help="fgd, horus: fragmentation against the jobs asked about so far (as phasewise place)")
    p.add_argument("--waiting", default="",
                   help="comma list of waiting-job counts: time the placement agent's decisions with that many "
                        "jobs waiting (e.g. 3000,6000) instead of the policies alone")
    p.add_argument("--json", action="store_true")


def bench_policy(name: str, nodes: list[Node], n_jobs: int, fill: float, observe: int, online: bool = False) -> dict:
    c = Cluster(nodes, PlacementConfig(isolate_inference=Settings.default("place_isolate_inference"),
                                       horus_frag_weight=Settings.default("place_horus_frag_weight")))
    background = jobs(20 * len(nodes), seed=2, prefix="bg")
    timed = jobs(n_jobs, seed=3)
    pol = make_policy(name, None if online else workload_types(background + timed))
    filler = make_policy("first-fit")
    cap = c.gpu_capacity_milli()
    for j in background:
        if c.gpu_allocated_milli() >= fill * cap:
            break
        p = filler.place(j, c)
        if p.node:
            c.allocate(j, p)
    rng = random.Random(4)
    times, cpu, placed = [], [], 0
    for j in timed:
        for k in rng.sample(range(len(nodes)), min(observe, len(nodes))):
            n = nodes[k]
            c.upsert(Node(n.name, n.cpu_milli, n.mem_bytes, tuple(
                Gpu(g.model, g.mem_bytes, util=rng.uniform(0, 100), mem_used_bytes=rng.randint(0, 4) * GIB)
                for g in n.gpus)))
        t0, c0 = time.perf_counter(), time.process_time()
        p = pol.place(j, c)
        if p.node:
            c.allocate(j, p)
            placed += 1
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ms = np.array(times) * 1e3
    cms = np.array(cpu) * 1e3
    return {"policy": name, "nodes": len(nodes), "jobs": n_jobs, "placed": placed, "online": online,
            "gpu_alloc_ratio_before": round(fill, 3),
            "ms_per_job": {"mean": round(float(ms.mean()), 3), "p50": round(float(np.percentile(ms, 50)), 3),
                           "p99": round(float(np.percentile(ms, 99)), 3), "max": round(float(ms.max()), 3)},
            "cpu_ms_per_job": {"mean": round(float(cms.mean()), 3), "p99": round(float(np.percentile(cms, 99)), 3)}}


class _Counting:
    """A policy, counting the jobs it is asked to place."""

    def __init__(self, policy) -> None:
        self.policy, self.name, self.calls = policy, policy.name, 0

    def place(self, job: Job, cluster: Cluster):
        self.calls += 1
        return self.policy.place(job, cluster)


def _samples(n: Node, ts: float, cpu_used: float = 0.0, rng: random.Random | None = None):
    from phasewise.kit.records import GpuSample, HostSamples

    return HostSamples(host=n.name, ts=ts, interval_s=1.0, host_cpu_count=n.cpu_milli // 1000, host_cpu_cores=cpu_used,
                       host_mem_bytes=0, host_mem_total_bytes=n.mem_bytes,
                       gpus=tuple(GpuSample(index=i, uuid=f"GPU-{n.name}-{i}",
                                            util=rng.uniform(0, 100) if rng else 0.0,
                                            mem_used_bytes=rng.randint(0, 4) * GIB if rng else 0,
                                            mem_total_bytes=g.mem_bytes) for i, g in enumerate(n.gpus)))


def _submitted(j: Job, ts: float):
    from phasewise.kit.records import JobEvent, JobRequests, JobSpec

    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32, command=("python", "-c", "pass"),
                   requests=JobRequests(cpu_cores=j.cpu_milli / 1000, mem_bytes=j.mem_bytes, gpus=j.gpus,
                                        gpu_mem_bytes=j.gpu_mem_bytes or None))
    return JobEvent(job=j.job, ts=ts, kind="submitted", priority=j.priority, spec=spec)


def bench_waiting(policy: str, nodes: list[Node], waiting: int, observe: int = 10) -> dict:
    """One decision round's time with *waiting* jobs waiting, after each kind of event (docs/benchmarks.md)."""
    from phasewise.kit.settings import Settings
    from phasewise.models.jobs.placement.state import PlacementState
    from phasewise.streams.config import placement_state_config, submissions

    logging.getLogger("phasewise.models.jobs.placement.state").setLevel(logging.WARNING)  # a line per waiting job
    from phasewise.kit.settings import SPECS

    cap = {"place_max_waiting_jobs": waiting + 10} if "place_max_waiting_jobs" in SPECS else {}  # (before it existed)
    settings = Settings.from_env({"place_policy": policy, "place_prediction_wait_s": 0.0, **cap}, env={})
    s = PlacementState(placement_state_config(settings), submissions(settings))
    for n in nodes:
        s.samples(_samples(n, 1.0))
    holder = None  # one whole GPU booked through the agent (a job it can free); every other GPU booked directly
    for i, n in enumerate(nodes):
        for g in range(len(n.gpus)):
            j = Job(f"bg-{i}-{g}", 1000, 1 << 30, gpus=1.0)
            if holder is None:
                holder = j
                s.submitted(_submitted(j, 0.0), now=0.0)
                s.decide(now=0.0, ts=0.0)
                continue
            p = make_policy("first-fit").place(j, s.cluster)
            if p.node:
                s.cluster.allocate(j, p)
    assert holder is not None and holder.job in s.placed, "the cluster has no GPU"
    counting = s.policy = _Counting(s.policy)
    out: dict = {"policy": policy, "nodes": len(nodes), "waiting": waiting, "decide_s": {}, "cpu_s": {},
                 "policy_calls": {}, "placed": {}}

    def timed(what: str) -> None:
        counting.calls = 0
        t0, c0 = time.perf_counter(), time.process_time()
        made = s.decide(now=0.0, ts=1.0)
        out["decide_s"][what] = round(time.perf_counter() - t0, 4)
        out["cpu_s"][what] = round(time.process_time() - c0, 4)
        out["policy_calls"][what] = counting.calls
        out["placed"][what] = [d.container for d, _ in made]

    for k, j in enumerate(jobs(waiting, seed=7, prefix="wait")):
        gpus, gmem = (j.gpus, j.gpu_mem_bytes) if j.gpus > 0 else (1.0, 12 << 30)
        j = Job(j.job, j.cpu_milli, j.mem_bytes + k * (1 << 20), gpus=gpus, gpu_mem_bytes=gmem, priority=j.priority)
        s.submitted(_submitted(j, 1.0), now=0.0)
    timed("fill")
    out["waiting_after_fill"] = len(s.waiting)
    rng = random.Random(4)

    def observed() -> None:  # new readings from a few nodes, as samples arrive between two decisions
        for k in rng.sample(range(len(nodes)), min(observe, len(nodes))):
            s.samples(_samples(nodes[k], 2.0, rng=rng))

    observed()
    s.submitted(_submitted(Job("next", 2000, 4 << 30), 2.0), now=0.0)
    timed("next_job")
    observed()
    frag = getattr(counting.policy, "_frag", None)
    if frag is not None:
        frag._owner = None  # what the online workload's refresh does every 64 new jobs: every cache emptied
    s.submitted(_submitted(Job("next-2", 2000, 4 << 30), 2.0), now=0.0)
    timed("next_job_refresh")
    s.samples(_samples(nodes[-1], 2.0, cpu_used=0.5))
    timed("sample")
    s.finished(holder.job)
    timed("freed")
    return out


def run(a: argparse.Namespace) -> int:
    if a.waiting:
        try:
            counts = [int(x) for x in a.waiting.split(",") if x.strip()]
        except ValueError:
            counts = []
        names = [n.strip() for n in a.policies.split(",") if n.strip()]
        if not counts or min(counts) < 1 or a.nodes < 1 or any(n not in POLICIES for n in names):
            print("bench placement: error: --waiting takes a comma list of counts >= 1 (and known policies)")
            return 2
        nodes = cluster_nodes(a.nodes)
        res = [bench_waiting(name, nodes, w, a.observe) for name in names for w in counts]
        if a.json:
            print(json.dumps({"waiting": res}))
        else:
            for r in res:
                print(f"{r['policy']:>10} {r['waiting']:>6} waiting on {r['nodes']} nodes: "
                      + ", ".join(f"{k} {v:.3f} s ({r['policy_calls'][k]} asked)" for k, v in r["decide_s"].items()))
        return 0
    names = [n.strip() for n in a.policies.split(",") if n.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or a.nodes < 1 or a.jobs < 1 or not 0 <= a.fill < 1:
        print(f"bench placement: error: bad options ({', '.join(bad) or 'nodes/jobs >= 1, 0 <= fill < 1'})")
        return 2
    nodes = cluster_nodes(a.nodes)
    out = {"results": [bench_policy(n, nodes, a.jobs, a.fill, a.observe, a.online) for n in names], "target_ms": 10}
    if a.json:
        print(json.dumps(out))
    else:
        for r in out["results"]:
            m = r["ms_per_job"]
            cm = r["cpu_ms_per_job"]
            print(f"{r['policy']:>10}: {m['mean']:.2f} ms/job mean, p50 {m['p50']:.2f}, p99 {m['p99']:.2f}, "
                  f"max {m['max']:.2f} (CPU {cm['mean']:.2f} mean, p99 {cm['p99']:.2f}) at {r['nodes']} nodes "
                  f"({r['placed']}/{r['jobs']} placed)")
    return 0
