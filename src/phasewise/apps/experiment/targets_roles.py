"""``phasewise experiment targets --through-roles N``: NA against FT with every role of the product.

The same N real training jobs (:mod:`.trainer`, a loss objective each) are
submitted with ``phasewise submit`` to the roles ``experiment cluster`` starts
(broker, produce, horus, place on cpuset slices, worker, the cgroup actuator);
each asks for a whole slice, so they queue. The two scenarios differ only in
configuration: NA runs ``worker`` without ``--targets`` (every job trains its
whole budget), FT with it (a job is asked to checkpoint and exit at its
objective, and its slice goes to the next). Time to objective is read from the
job events (submission to the first progress report at or past the objective).
``--scenarios FT`` (or ``NA``) runs one of them.
docs/results.md, "Jobs through every role".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

from phasewise.apps.experiment.cluster import (
    Cluster,
    ClusterError,
    Config,
    Progress,
    summarize,
)
from phasewise.apps.experiment.cluster_plan import WIDTHS, PlannedJob, default_trace

__all__ = ["run_roles"]

#: the scenarios through the roles and the worker's setting each is: NA without --targets, FT with
ROLE_SCENARIOS = {"NA": False, "FT": True}


def plan_jobs(n: int, tag: str, seconds: float, cores: float) -> list[PlannedJob]:
    """*n* training jobs, one every second, each asking for *cores* (a whole slice)."""
    return [PlannedJob(f"train-{tag}-{i:02d}", "train", float(i), 0, cores, 500 * 2**20, seconds,
                       hidden=WIDTHS[i % len(WIDTHS)], seed=i) for i in range(n)]


def oracle_bound(jobs: list[PlannedJob], rec: Any, slices: int) -> float | None:
    """The mean time to objective (from submission) of an oracle that stops each job exactly at its objective,
    from NA's measured runs: each job's time from its ``started`` to its first progress at the objective, the
    jobs on *slices* slices in submission order at their submission times, with no start-up cost between
    them. ``None`` where a job never reached its objective in NA (the bound needs every job's)."""
    from phasewise.apps.experiment.cluster_report import OBJECTIVE

    submitted = {e.job: e.ts for e in rec.events if e.kind == "submitted"}
    started = {}
    for e in rec.events:
        if e.kind == "started":
            started.setdefault(e.job, e.ts)
    need = {}
    for e in rec.events:
        if (e.kind == "progress" and e.job in started and e.job not in need and e.loss is not None
                and e.loss <= OBJECTIVE and e.ts >= started[e.job]):
            need[e.job] = e.ts - started[e.job]
    if any(j.job not in need or j.job not in submitted for j in jobs):
        return None
    t0 = min(submitted[j.job] for j in jobs)
    free = [0.0] * max(1, slices)
    done = []
    for j in sorted(jobs, key=lambda j: submitted[j.job]):
        arrive = submitted[j.job] - t0
        i = min(range(len(free)), key=free.__getitem__)
        begin = max(arrive, free[i])
        free[i] = begin + need[j.job]
        done.append(free[i] - arrive)
    return round(sum(done) / len(done), 2)


def run_roles(args: argparse.Namespace) -> int:
    prog = "phasewise experiment targets"
    n = args.through_roles
    if n < 1:
        print(f"{prog}: error: --through-roles needs at least 1 job", file=sys.stderr)
        return 2
    chosen = [s.strip().upper() for s in (args.scenarios or ",".join(ROLE_SCENARIOS)).split(",") if s.strip()]
    bad = [s for s in chosen if s not in ROLE_SCENARIOS]
    if bad or not chosen:
        print(f"{prog}: error: --through-roles runs {' and '.join(ROLE_SCENARIOS)} only, got "
              f"{', '.join(bad) or 'none'} in --scenarios", file=sys.stderr)
        return 2
    import os

    cores = float(max(1, len(os.sched_getaffinity(0)) // 2))
    out: dict[str, Any] = {"jobs": n, "seconds": args.roles_seconds, "scenarios": {},
                           "oracle_mean_time_to_objective_s": None}
    for scenario in dict.fromkeys(chosen):
        targets = ROLE_SCENARIOS[scenario]
        tag = f"{scenario.lower()}{uuid.uuid4().hex[:4]}"
        jobs = plan_jobs(n, tag, args.roles_seconds, cores)
        cfg = Config(jobs=n, seed=0, trace=default_trace(), span_s=float(n - 1), train_s=args.roles_seconds,
                     service_s=0.0, interactive_s=0.0, timeout_s=None, report=None, json=args.json,
                     cgroup_prefix=f"pwtargets-{tag}", keep=False, priorities=False, targets=targets)
        progress = Progress(sys.stderr.isatty() and not args.json and not args.no_progress)
        c = Cluster(cfg, jobs)
        t0 = time.monotonic()
        try:
            c.start()
            c.drive(progress)
            progress.end()
            assert c.collector is not None
            time.sleep(2)
            rec = c.collector.snapshot()
        except ClusterError as e:
            progress.end()
            print(f"{prog}: error: {scenario}: {e}", file=sys.stderr)
            c.close()
            return 1
        c.close()
        s = summarize(jobs, rec, leaked=None, probe="not run", wall_s=time.monotonic() - t0, trace="none",
                      span_s=float(n - 1))
        out["scenarios"][scenario] = {k: s[k] for k in ("terminal", "stuck", "outcomes", "mean_time_to_objective_s",
                                                         "objectives_reached", "mean_wait_s", "mean_run_s",
                                                         "wall_s")}
        if scenario == "NA":  # every job trains its whole budget: each one's own time to its objective is seen
            out["oracle_mean_time_to_objective_s"] = oracle_bound(jobs, rec, len(c.nodes))
    na, ft = (out["scenarios"].get(k, {}).get("mean_time_to_objective_s") for k in ("NA", "FT"))
    out["ft_vs_na_time_to_objective"] = round(ft / na - 1, 4) if na and ft else None
    out["missed_objectives"] = {k: n - v["objectives_reached"] for k, v in out["scenarios"].items()}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out["scenarios"].items():
            print(f"{k}: {v['objectives_reached']}/{n} at objective, mean time to objective "
                  f"{v['mean_time_to_objective_s']} s (from submission), {v['terminal']} ended "
                  f"({', '.join(f'{a} {b}' for a, b in v['outcomes'].items())}), {len(v['stuck'])} stuck, "
                  f"{v['wall_s']} s")
        if len(out["scenarios"]) == 2:
            print(f"FT vs NA, mean time to objective: {out['ft_vs_na_time_to_objective']}; oracle bound (from "
                  f"NA's runs, no start-up cost): {out['oracle_mean_time_to_objective_s']} s")
    return 0
