"""``phasewise simulate PODS.csv --format openb --nodes NODES.csv``: placement policies on a real pod list,
one line per policy or ``--json``, ``--report DIR`` for plots; ``--mode inflation`` runs FGD's experiment
over seeds; ``--interference gavel[:GPU]`` scores the placements by Gavel's measured co-location slowdown
(docs/placement.md, "Simulation on openb 2023", "Interference measured").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from phasewise.apps.simulate.engine import MODES, simulate, speed_up
from phasewise.apps.simulate.gavel import GAVEL_FILE, GPU_TYPES, draw_workloads, load_gavel
from phasewise.apps.simulate.inflation import run_seed, summarise
from phasewise.apps.simulate.openb import TraceError, load_nodes, load_pods
from phasewise.apps.simulate.utilisation import load_util_cdf, with_utilisation
from phasewise.kit.command import report_dir
from phasewise.kit.settings import Settings
from phasewise.models.jobs.placement import POLICIES, PlacementConfig, workload_types
from phasewise.models.jobs.placement.interference import MEASURED_WEIGHT, SLOWED, MeasuredHorus

FORMATS = ("openb",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pods", metavar="PODS.csv", help="pod list (openb: openb_pod_list_*.csv)")
    p.add_argument("--format", choices=FORMATS, default="openb", help="pod and node list format (default openb)")
    p.add_argument("--nodes", metavar="NODES.csv", required=True, help="node list (openb: openb_node_list_*.csv)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated placement policies among {', '.join(POLICIES)} (default all), and "
                        f"{MeasuredHorus.name} (horus scoring by the measured slowdown) with --interference")
    p.add_argument("--mode", choices=(*MODES, "inflation"), default="timed",
                   help="timed: the trace's clock, pods wait in a queue and leave; fill: pods arrive in list "
                        "order and never leave; inflation: FGD's experiment, the list inflated by sampling to "
                        "--inflation-ratio x GPU capacity and shuffled, per seed (default timed)")
    p.add_argument("--inflation-ratio", type=float, default=1.3,
                   help="inflation: arrived GPU demand to reach, as a share of GPU capacity (FGD's -tune; default 1.3)")
    p.add_argument("--seeds", default="42-51",
                   help="inflation: seeds, comma-separated or a range A-B (FGD's -tuneseed 42..51; default 42-51)")
    p.add_argument("--typical", type=float, default=None, metavar="SHARE",
                   help="fgd/horus target workload: the most common task types holding this share of the pods "
                        "(FGD's simulator: 0.95; default 0.95 in inflation mode, 1 otherwise); in inflation mode "
                        "the task types leave memory out, as FGD's do")
    p.add_argument("--speed-up", type=float, default=1.0,
                   help="timed mode: arrivals this many times closer together, durations unchanged (default 1)")
    p.add_argument("--isolate-inference", action="store_true",
                   help="never put inference and training pods on one node")
    frag_weight = Settings.default("place_horus_frag_weight")
    p.add_argument("--horus-frag-weight", type=float, default=frag_weight, metavar="W",
                   help="horus: weight of FGD's fragmentation growth (GPUs) against Horus's over-capacity term; "
                        f"0 = Horus's cost alone (default {frag_weight:g})")
    p.add_argument("--util-cdf", metavar="CSV:CLUSTER",
                   help="give every GPU pod a utilisation drawn from a cluster's measured GPU utilisation CDF "
                        "(acmetrace-util-cdfs/util_cdfs.csv:Philly) and measure overloaded GPUs")
    p.add_argument("--util-seed", type=int, default=0, help="seed of the utilisation draw (default 0)")
    p.add_argument("--interference", metavar="gavel[:GPU]",
                   help="give every GPU pod a workload drawn from Gavel's measured ones and report the co-located "
                        f"pods' measured slowdown (GPU among {', '.join(GPU_TYPES)}; default v100; not with "
                        "--mode inflation)")
    p.add_argument("--interference-seed", type=int, default=0, help="seed of the workload draw (default 0)")
    p.add_argument("--measured-weight", type=float, default=MEASURED_WEIGHT, metavar="W",
                   help=f"{MeasuredHorus.name}: weight of the measured loss (GPUs of throughput) against the "
                        f"fragmentation growth (default {MEASURED_WEIGHT:g}; docs/placement.md)")
    p.add_argument("--gavel-file", metavar="JSON.gz", default=str(GAVEL_FILE),
                   help="Gavel's throughput file (default: the shared physical_cluster_throughputs.json.gz)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--report", metavar="DIR", type=report_dir,
                   help="write plots (allocation, fragmentation) and summary.md here")
    p.add_argument("--jobs", type=int, default=0,
                   help="policies simulated in parallel processes (default: one per policy, at most the CPUs)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per 25 % otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO | None):
        self.label, self.total, self.stream = label, max(total, 1), stream
        self.tty = bool(stream and stream.isatty())
        self._shown = -1

    def __call__(self, done: int) -> None:
        if self.stream is None:
            return
        pct = int(100 * done / self.total)
        if self.tty:
            fill = pct * 30 // 100
            self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (30 - fill)}] {done}/{self.total} pods")
            if done >= self.total:
                self.stream.write("\n")
        elif pct // 25 > self._shown:
            self._shown = pct // 25
            self.stream.write(f"{self.label}: {done}/{self.total} pods ({pct}%)\n")
        self.stream.flush()


_done = None  # in a pool worker: the shared count of pods simulated


def _init(counter) -> None:
    global _done
    _done = counter


def _one(task):
    name, pods, nodes, mode, config, w, inter, mw = task
    last = [0]

    def bump(n: int) -> None:
        with _done.get_lock():
            _done.value += n - last[0]
        last[0] = n
    return simulate(pods, nodes, name, mode, config=config, progress=bump, workload=w, interference=inter,
                    measured_weight=mw)


def _parallel(names, pods, nodes, mode, config, w, jobs, stream, inter=None, mw=MEASURED_WEIGHT):
    """The policies in *jobs* processes (fork); one bar over all of them. Results in *names* order."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    counter = ctx.Value("q", 0)
    bar = Progress(",".join(names), len(pods) * len(names), stream)
    with ctx.Pool(jobs, initializer=_init, initargs=(counter,)) as pool:
        pending = pool.map_async(_one, [(n, pods, nodes, mode, config, w, inter, mw) for n in names])
        while not pending.ready():
            pending.wait(0.2)
            bar(min(counter.value, bar.total))
        results = pending.get()
    bar(bar.total)
    return results


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        lo, hi = int(a), int(b) if sep else int(a)
        if hi < lo:
            raise ValueError(part)
        out.extend(range(lo, hi + 1))
    return out


def _one_seed(task):
    name, pods, nodes, ratio, seed, config, w, inter, mw = task
    return run_seed(pods, nodes, name, ratio=ratio, seed=seed, config=config, workload=w, interference=inter,
                    measured_weight=mw)


def _inflation(args, names, pods, nodes, config, w, jobs, stream, inter) -> int:
    try:
        seeds = _seeds(args.seeds)
    except ValueError:
        print(f"phasewise simulate: error: --seeds: {args.seeds!r} is not a list of seeds (42,43 or 42-51)",
              file=sys.stderr)
        return 2
    tasks = [(n, pods, nodes, args.inflation_ratio, s, config, w, inter, args.measured_weight)
             for n in names for s in seeds]
    t0 = time.perf_counter()
    if jobs <= 1:
        runs = []
        for k, t in enumerate(tasks):
            runs.append(_one_seed(t))
            if stream:
                stream.write(f"inflation: {k + 1}/{len(tasks)} runs ({t[0]}, seed {t[4]})\n")
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            runs = []
            for k, r in enumerate(pool.imap(_one_seed, tasks)):
                runs.append(r)
                if stream:
                    stream.write(f"inflation: {k + 1}/{len(tasks)} runs ({r.policy}, seed {r.seed})\n")
    out = [summarise(n, [r for r in runs if r.policy == n]) for n in names]
    wall = time.perf_counter() - t0
    if args.report:
        from phasewise.apps.simulate.report import write_inflation_report

        write_inflation_report(args.report, out, args=args, pods=pods, nodes=nodes, seeds=seeds)
    if args.json:
        doc = {"mode": "inflation", "inflation_ratio": args.inflation_ratio, "seeds": seeds,
               "pods": len(pods), "nodes": len(nodes), "gpus": sum(len(n.gpus) for n in nodes),
               "results": out, "wall_s": round(wall, 1)}
        if inter is not None:
            doc["interference"] = _about(args, inter)
        print(json.dumps(doc))
    else:
        for r in out:
            u, e = r["unallocated_gpu_pct_at_100"], r["unallocated_gpu_pct_at_end"]
            a = r["alloc_ratio"]["milli_gpu"]
            print(f"{r['policy']:>10}: unallocated GPU {u['mean']:.2f} % (sd {u['sd']:.2f}) at 100 % arrived, "
                  f"{e['mean']:.2f} % at {args.inflation_ratio:.0%}; GPU allocated {a['mean']:.2%}, "
                  f"failed {r['failed_pods']['mean']:.0f} pods ({r['failed_gpus']['mean']:.0f} GPUs), "
                  f"fragmented {r['frag_gpus']['mean']:.1f} GPUs; {r['seeds']} seeds"
                  + _interference_text(r.get("interference"), lambda v: v["mean"]))
    return 0


def _interference_text(m: dict | None, stat: Callable[[Any], float] = lambda v: v) -> str:
    """The measured co-location figures for a result's text line ('' without); *stat* reads a figure (an
    inflation summary holds each as {"mean", "sd"} over seeds: its mean)."""
    if not m:
        return ""
    mean = m.get("slowdown_mean")
    return (f", co-located {stat(m['colocated_jobs']):.1f} pods, measured slowdown mean "
            f"{'n/a' if mean is None else format(stat(mean), '.1%')}, {stat(m['slowed_jobs']):.1f} pods slowed "
            f"> 20 %, lost {stat(m['lost_gpus']):.1f} GPUs")


def run(args: argparse.Namespace) -> int:
    prog = "phasewise simulate"
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    known = [*POLICIES, MeasuredHorus.name] if args.interference else list(POLICIES)
    bad = [n for n in names if n not in known]
    if bad or not names:
        more = "" if args.interference else f"; {MeasuredHorus.name} with --interference"
        print(f"{prog}: error: --policies: unknown {', '.join(bad) or '(none given)'} "
              f"(choose among {', '.join(known)}{more})", file=sys.stderr)
        return 2
    if not args.speed_up > 0:
        print(f"{prog}: error: --speed-up: must be > 0", file=sys.stderr)
        return 2
    for flag, v in (("--horus-frag-weight", args.horus_frag_weight), ("--measured-weight", args.measured_weight)):
        if not (v >= 0 and math.isfinite(v)):
            print(f"{prog}: error: {flag}: must be a number >= 0", file=sys.stderr)
            return 2
    if not (args.inflation_ratio > 0 and math.isfinite(args.inflation_ratio)):
        print(f"{prog}: error: --inflation-ratio: must be a number > 0", file=sys.stderr)
        return 2
    typical = args.typical if args.typical is not None else (0.95 if args.mode == "inflation" else 1.0)
    if not 0 < typical <= 1:
        print(f"{prog}: error: --typical: must be in (0, 1]", file=sys.stderr)
        return 2
    inter = None
    try:
        pods = load_pods(args.pods)
        nodes = load_nodes(args.nodes)
        if args.util_cdf:
            pods = with_utilisation(pods, load_util_cdf(args.util_cdf), args.util_seed)
        if args.interference:
            table = load_gavel(args.interference, args.gavel_file)
            inter = (table, draw_workloads(pods, table, args.interference_seed))
    except TraceError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if not pods:
        print(f"{prog}: error: {args.pods}: no pods", file=sys.stderr)
        return 2
    if args.mode == "timed" and not pods[0].timed:
        print(f"{prog}: error: {args.pods} has no creation_time and deletion_time: use --mode fill or inflation",
              file=sys.stderr)
        return 2
    if args.speed_up != 1.0:
        pods = speed_up(pods, args.speed_up)
    config = PlacementConfig(isolate_inference=args.isolate_inference, horus_frag_weight=args.horus_frag_weight)
    # inflation runs FGD's experiment: its simulator's task types have no memory
    w = workload_types((p.job for p in pods), popular=typical, memory=args.mode != "inflation")
    t0 = time.perf_counter()
    jobs = args.jobs if args.jobs > 0 else min(len(names), os.cpu_count() or 1)
    stream = None if args.quiet else sys.stderr
    if args.mode == "inflation":
        return _inflation(args, names, pods, nodes, config, w, args.jobs if args.jobs > 0 else (os.cpu_count() or 1),
                          stream, inter)
    if jobs <= 1 or len(names) == 1:
        results = []
        for name in names:
            results.append(simulate(pods, nodes, name, args.mode, config=config,
                                    progress=Progress(name, len(pods), stream), workload=w, interference=inter,
                                    measured_weight=args.measured_weight))
    else:
        results = _parallel(names, pods, nodes, args.mode, config, w, jobs, stream, inter, args.measured_weight)
    wall = time.perf_counter() - t0
    if args.report:
        from phasewise.apps.simulate.report import write_report

        write_report(args.report, results, args=args, pods=pods, nodes=nodes, wall_s=wall,
                     interference=_about(args, inter))
    if args.json:
        doc = {"results": [r.public() for r in results]}
        if inter is not None:
            doc["interference"] = _about(args, inter)
        print(json.dumps(doc))
    else:
        for r in results:
            over = (f", overloaded {r.overloaded_gpus:.1f} GPUs ({r.excess_util_gpus:.1f} GPUs above 100 %)"
                    if r.overloaded_gpus is not None else "")
            over += _interference_text(r.interference)
            print(f"{r.policy:>10}: GPU allocated {r.gpu_alloc_ratio:.2%}, fragmented {r.fragmented_gpus:.1f} GPUs, "
                  f"unplaced {r.unplaced_pods}/{r.pods} pods, mean queue delay {r.mean_queue_delay_s:.1f} s"
                  f"{over} ({r.wall_s:.1f} s)")
    return 0


def _about(args: argparse.Namespace, inter) -> dict | None:
    """What the interference figures were measured with (None without ``--interference``)."""
    if inter is None:
        return None
    table, drawn = inter
    return {"source": "gavel", "gpu": table.gpu, "file": args.gavel_file, "seed": args.interference_seed,
            "workloads": len(table.workloads(1)), "pods_with_workload": len(drawn), "slowed_above": SLOWED,
            "rule": "product of pairwise normalised throughputs (worst pair: slowdown_mean_worst_pair)"}
