"""``phasewise experiment targets``: TRADL's NA / AO / FT / SR scenarios with real small training jobs on this
machine, and the oracle (the most any policy could cut the mean time to objective).

The jobs run in cgroups under one parent whose CPU quota is the node; the
tracker and the division are the worker's own pure code, the limits go
through the actuator's cgroup backend, the stops through the sidecar's
control; no broker. docs/targets.md, "Experiment: NA / AO / FT / SR with
real jobs".
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.actuators.backends import CgroupBackend
from phasewise.actuators.commands import SetLimits
from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.settings import Settings
from phasewise.models.jobs.targets import (
    NodeJob,
    Smoother,
    Targets,
    TargetsConfig,
    TargetTracker,
    decide,
    node_limits,
    remaining_work,
)
from phasewise.producers.progress import ChildControl, parse_line

JOBS = ("cnn", "gru", "lstm", "vae", "rnn")
SCENARIOS = ("NA", "AO", "FT", "SR")
#: the scenarios that stop a job at its objective
STOPPING = ("FT", "SR")
#: training steps of each job's whole run (NA); chosen so the jobs need different CPU times
#: (measured alone on one core: vae ~2 ms/step, rnn ~3.5, cnn ~7.5, lstm ~10, gru ~13)
DEFAULT_STEPS = {"vae": 500, "rnn": 450, "cnn": 250, "lstm": 250, "gru": 225}
REPORT_EVERY = 10


@dataclass
class JobRun:
    name: str
    steps_budget: int
    proc: subprocess.Popen | None = None
    container: str = ""
    tracker: TargetTracker | None = None
    control: ChildControl | None = None
    t_acceptable: float | None = None
    t_objective: float | None = None
    t_end: float | None = None
    step: int = 0
    cpu_s: float | None = None
    cpu_to_objective_s: float | None = None  #: its cgroup's CPU-seconds from the start to the objective
    first: float | None = None  #: its first smoothed loss
    cpu_at_report: float | None = None  #: its CPU-seconds at its latest report
    stopped_by: str = ""
    exit_code: int | None = None
    limit: float | None = None
    series: list[tuple[float, int, float, float]] = field(default_factory=list)  # t, step, loss, smoothed
    limits: list[tuple[float, float | None]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


class ExperimentError(RuntimeError):
    """The experiment cannot run here; ``str(e)`` says why."""


def _reader(name: str, stream, out: queue.Queue, ready: threading.Event) -> None:
    for line in stream:
        if "phase=ready" in line:
            ready.set()
        p = parse_line(line)
        if p is not None:
            out.put((name, time.monotonic(), p["step"], p["loss"]))
    out.put((name, time.monotonic(), None, None))


class Node:
    """The parent cgroup (the node, *capacity* cores) and one child cgroup per job."""

    def __init__(self, capacity: float, root: Path = Path("/sys/fs/cgroup")) -> None:
        try:
            self.layout = CgroupLayout(root, prefix=f"phasewise-exp-{os.getpid()}")
            self.layout.create("probe")
            self.layout.remove("probe")
            base = self.layout.base("cpu")
            if self.layout.version == 1:
                (base / "cpu.cfs_period_us").write_text("100000")
                (base / "cpu.cfs_quota_us").write_text(str(int(capacity * 100000)))
            else:
                (base / "cpu.max").write_text(f"{int(capacity * 100000)} 100000")
        except (CgroupError, OSError) as e:
            raise ExperimentError(f"needs writable cgroups (root) for the node's CPU quota: {e}") from None
        self.backend = CgroupBackend(self.layout)
        self.capacity = capacity

    def cpu_seconds(self, container: str) -> float | None:
        try:
            if self.layout.version == 1:
                return int((self.layout.path(container, "cpuacct") / "cpuacct.usage").read_text()) / 1e9
            for line in (self.layout.path(container) / "cpu.stat").read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "usage_usec":
                    return int(v) / 1e6
        except (OSError, ValueError, CgroupError):
            return None
        return None

    def remove(self, containers: list[str]) -> None:
        """Remove the jobs' cgroups (their processes have exited); the node stays."""
        for c in containers:
            try:
                self.layout.remove(c)
            except CgroupError:
                pass

    def quota_cores(self) -> float | None:
        """The node's CPU quota as read back (None: unlimited or unreadable)."""
        base = self.layout.base("cpu")
        try:
            if self.layout.version == 1:
                q = int((base / "cpu.cfs_quota_us").read_text())
                return None if q < 0 else q / int((base / "cpu.cfs_period_us").read_text())
            q_text, _, p_text = (base / "cpu.max").read_text().partition(" ")
            return None if q_text == "max" else int(q_text) / int(p_text)
        except (OSError, ValueError):
            return None

    def close(self, containers: list[str]) -> None:
        """Remove the jobs' cgroups and the node's."""
        self.remove(containers)
        for ctrl in self.layout.controllers():
            try:
                self.layout.base(ctrl).rmdir()
            except OSError:
                pass


def run_scenario(scenario: str, jobs: list[str], steps: dict[str, int], node: Node,
                 targets: dict[str, Targets] | None, config: TargetsConfig, *, shrink: float, grace_s: float,
                 share_alpha: float | None, timeout_s: float, progress=None) -> dict[str, JobRun]:
    """Run the jobs together under *scenario* (``calibrate``, NA, AO, FT); each job's record."""
    if node.quota_cores() is None or abs(node.quota_cores() - node.capacity) > 1e-3:
        raise ExperimentError(f"{scenario}: the node's CPU quota reads {node.quota_cores()}, "
                              f"expected {node.capacity:g} cores")
    q: queue.Queue = queue.Queue()
    runs: dict[str, JobRun] = {}
    ckpt = Path(tempfile.mkdtemp(prefix="phasewise-exp-ckpt-"))
    ready: dict[str, threading.Event] = {}
    for name in jobs:
        r = JobRun(name, steps[name], container=f"{scenario.lower()}-{name}")
        node.layout.create(r.container)
        r.proc = subprocess.Popen(
            [sys.executable, "-m", "phasewise.apps.experiment.targets_jobs", name, "--steps", str(steps[name]),
             "--report-every", str(REPORT_EVERY), "--checkpoint-dir", str(ckpt),
             "--wait-for-go"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        r.control = ChildControl(r.proc, grace_s)
        if targets is not None:
            r.tracker = TargetTracker(targets[name], config)
        ready[name] = threading.Event()
        threading.Thread(target=_reader, args=(name, r.proc.stdout, q, ready[name]), daemon=True).start()
        r.limits.append((0.0, None))
        runs[name] = r
    deadline = time.monotonic() + timeout_s
    for name, ev in ready.items():  # the start barrier: every job loaded, then all start at once
        if not ev.wait(max(0.0, deadline - time.monotonic())):
            for r in runs.values():
                r.proc.kill()
            node.remove([r.container for r in runs.values()])
            raise ExperimentError(f"{scenario}: job {name} did not load within {timeout_s:g} s")
    for r in runs.values():  # loading ran outside the node; training runs inside it
        node.layout.attach(r.container, r.proc.pid)
    cpu_at_start = {n: node.cpu_seconds(r.container) or 0.0 for n, r in runs.items()}
    t0 = time.monotonic()
    for r in runs.values():
        r.proc.stdin.write("go\n")
        r.proc.stdin.flush()
    smoothers = {n: Smoother(config) for n in jobs}
    alive = set(jobs)
    last_cpu: dict[str, tuple[float, float]] = {}
    use: dict[str, float] = {}
    favoured: list[str | None] = [None]
    next_use = t0 + 1.0

    def cpu_now(n: str) -> float:
        return (node.cpu_seconds(runs[n].container) or 0.0) - cpu_at_start[n]

    try:
        while alive and time.monotonic() - t0 < timeout_s:
            try:
                name, t, step, loss = q.get(timeout=0.2)
            except queue.Empty:
                name = None
            now = time.monotonic()
            if name is not None:
                r = runs[name]
                if step is None:  # the job's stdout closed: it ended
                    r.exit_code = r.proc.wait()
                    r.t_end = t - t0
                    r.cpu_s = cpu_now(name)
                    r.control.cancel()
                    alive.discard(name)
                    r.stopped_by = r.stopped_by or "budget"
                elif loss is not None:
                    r.step = step
                    smoothed = smoothers[name].learn_one(loss)
                    r.series.append((t - t0, step, loss, smoothed))
                    r.cpu_at_report = cpu_now(name)
                    if r.tracker is not None:
                        for ev in r.tracker.update(ts=t - t0, step=step, value=loss):
                            r.reasons.append(ev.reason)
                            if ev.kind == "acceptable":
                                r.t_acceptable = t - t0
                            elif ev.kind == "objective":
                                r.t_objective = t - t0
                                r.cpu_to_objective_s = r.cpu_at_report
                                if scenario in STOPPING:
                                    _, ctrl = decide(ev, host="local", container=r.container, shrink_to_cores=None,
                                                     grace_s=grace_s)
                                    r.control.checkpoint_exit(ctrl)
                                    r.stopped_by = "objective"
                        if r.first is None:
                            r.first = r.tracker.smoothed
            if share_alpha is not None and now >= next_use:  # each job's use over the last second
                next_use = now + 1.0
                for n in alive:
                    cpu = node.cpu_seconds(runs[n].container)
                    if cpu is not None and n in last_cpu:
                        use[n] = (cpu - last_cpu[n][0]) / max(1e-3, now - last_cpu[n][1])
                    if cpu is not None:
                        last_cpu[n] = (cpu, now)
            if scenario in ("AO", "FT", "SR"):
                # the jobs short of their objective divide the node (AO: every running job, it stops none)
                short = [n for n in sorted(alive) if scenario == "AO" or runs[n].t_objective is None]
                views = {n: NodeJob(runs[n].t_acceptable is not None, use.get(n),
                                    remaining_work(runs[n].cpu_at_report, runs[n].first, runs[n].tracker.smoothed,
                                                   runs[n].tracker.targets.objective)
                                    if runs[n].tracker is not None else None)
                         for n in short}
                plan = node_limits(views, node.capacity, policy="nearest" if scenario == "SR" else "tradl",
                                   shrink=shrink, alpha=share_alpha, favoured=favoured[0], host="node")
                favoured[0] = plan.favoured or favoured[0]
                for n, lim in plan.limits.items():
                    if lim != runs[n].limit:
                        out = node.backend.apply(SetLimits(runs[n].container,
                                                           cpu_cores=node.capacity if lim is None else lim))
                        if out.status == "applied":
                            runs[n].limit = lim
                            runs[n].limits.append((now - t0, lim))
                            runs[n].reasons.append(plan.reasons[n])
            if progress is not None:
                progress(scenario, runs, now - t0)
    finally:
        for r in runs.values():
            if r.proc is not None and r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
                r.stopped_by = r.stopped_by or "timeout"
                r.t_end = time.monotonic() - t0
                r.cpu_s = (node.cpu_seconds(r.container) or 0.0) - cpu_at_start.get(r.name, 0.0)
        node.remove([r.container for r in runs.values()])
        for f in ckpt.glob("*"):
            f.unlink()
        ckpt.rmdir()
    return runs


def calibrate(jobs: list[str], steps: dict[str, int], node: Node, config: TargetsConfig, acceptable_at: float,
              objective_at: float, timeout_s: float, progress=None) -> dict[str, Targets]:
    """Each job's targets: its smoothed loss at *acceptable_at* and *objective_at* of its step budget."""
    cal_steps = {n: max(REPORT_EVERY * 4, int(steps[n] * objective_at)) for n in jobs}
    runs = run_scenario("calibrate", jobs, cal_steps, node, None, config, shrink=1.0, grace_s=0.0,
                        share_alpha=None, timeout_s=timeout_s, progress=progress)
    out = {}
    for n in jobs:
        series = runs[n].series
        if not series:
            raise ExperimentError(f"calibration: job {n} reported no progress (exit {runs[n].exit_code})")

        def at(frac: float, series=series, n=n) -> float:
            want = steps[n] * frac
            return min(series, key=lambda p: abs(p[1] - want))[3]
        a, o = at(acceptable_at), at(objective_at)
        out[n] = Targets(acceptable=max(a, o), objective=o, direction="min", metric="loss")
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def srpt_times(work: list[float], capacity: float) -> list[float]:
    """Times to objective under shortest-remaining-work-first: the jobs one after another, least work first.

    With every job present from the start, this order minimises the mean completion time of
    jobs sharing one processor (Schrage 1968); on a node no job can use more of than it has, it
    is the least mean time to objective of any policy that divides the node's CPU and stops
    jobs at their objective.

    >>> srpt_times([2.0, 1.0, 1.0], capacity=0.5)
    [2.0, 4.0, 8.0]
    """
    out, done = [], 0.0
    for w in sorted(work):
        done += w
        out.append(done / capacity)
    return out


def ps_times(work: dict[str, float], budgets: dict[str, float], capacity: float) -> dict[str, float]:
    """Times to objective when the jobs share the node equally and each runs until its budget (NA as a fluid).

    Every running job gets ``capacity / running``; a job reaches its objective after *work*
    CPU-seconds and leaves after *budgets* (its whole run).

    >>> ps_times({"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 2.0}, capacity=1.0)  # both run past their objective
    {'a': 2.0, 'b': 2.0}
    >>> ps_times({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}, capacity=1.0)  # a leaves at its objective
    {'a': 2.0, 'b': 3.0}
    """
    level, t = 0.0, 0.0  # CPU-seconds every running job has had; the time
    running = set(work)
    out: dict[str, float] = {}
    while running and len(out) < len(work):
        nxt = min([work[j] for j in running if j not in out and work[j] > level]
                  + [budgets[j] for j in running if budgets[j] > level], default=None)
        if nxt is None:
            break
        t += (nxt - level) * len(running) / capacity
        level = nxt
        for j in sorted(running):  # in name order: the result's order does not depend on string hashing
            if j not in out and work[j] <= level + 1e-12:
                out[j] = t
            if budgets[j] <= level + 1e-12:
                running.discard(j)
    return out


def oracle(results: dict[str, dict[str, JobRun]], capacity: float, na_mean: float | None) -> dict[str, Any] | None:
    """The best mean time to objective for the measured work to objective, and what it means against NA.

    The work is each job's CPU-seconds to its objective in NA (it is the same in every
    scenario: fixed seeds, the same steps; a job that missed it counts with the CPU it used,
    which makes the bound looser, never tighter). ``bound_if_budgets_unbounded``: the most any
    policy could save if NA ran every job past the last objective (every job shares the node
    until then: NA's mean is ``sum(W) / C``), which is at most ``(n - 1) / (2n)`` for equal works
    and ``1 - 1/n`` in the limit of one job holding all the work.
    """
    runs = results.get("NA") or next(iter(results.values()), None)
    if not runs:
        return None
    work = {n: (r.cpu_to_objective_s if r.cpu_to_objective_s is not None else r.cpu_s) for n, r in runs.items()}
    if any(w is None or w <= 0 for w in work.values()):
        return None
    budgets = {n: max(work[n], r.cpu_s or 0.0) for n, r in runs.items()}
    best = srpt_times(list(work.values()), capacity)
    best_mean = sum(best) / len(best)
    fluid = ps_times(work, budgets, capacity)
    n = len(work)
    unbounded = sum(work.values()) / capacity  # NA's mean when no job ends before the last objective
    return {
        "from": "NA" if "NA" in results else next(iter(results)),
        "work_to_objective_cpu_s": {k: round(v, 3) for k, v in work.items()},
        "budget_cpu_s": {k: round(v, 3) for k, v in budgets.items()},
        "srpt_mean_time_to_objective_s": round(best_mean, 2),
        "oracle_reduction": None if not na_mean else round(1 - best_mean / na_mean, 4),
        "na_fluid_mean_time_to_objective_s": round(sum(fluid.values()) / max(1, len(fluid)), 2),
        "bound_if_budgets_unbounded": round(1 - best_mean / unbounded, 4),
        "bound_equal_jobs": round((n - 1) / (2 * n), 4),
        # a job sharing the node with fewer others spends a little less CPU per step (caches): each scenario's
        # own work to objective, and the bound it gives against NA
        "by_scenario": {sc: _srpt_of(rs, capacity, na_mean) for sc, rs in results.items()},
    }


def _srpt_of(runs: dict[str, JobRun], capacity: float, na_mean: float | None) -> dict[str, Any] | None:
    work = [r.cpu_to_objective_s if r.cpu_to_objective_s is not None else r.cpu_s for r in runs.values()]
    if any(w is None or w <= 0 for w in work):
        return None
    mean = sum(srpt_times(work, capacity)) / len(work)  # type: ignore[arg-type]
    return {"work_to_objective_cpu_s": round(sum(work), 3), "srpt_mean_time_to_objective_s": round(mean, 2),  # type: ignore[arg-type]
            "oracle_reduction": None if not na_mean else round(1 - mean / na_mean, 4)}


def summarise(results: dict[str, dict[str, JobRun]], targets: dict[str, Targets],
              capacity: float | None = None) -> dict[str, Any]:
    jobs_out: dict[str, dict[str, Any]] = {}
    means: dict[str, float | None] = {}
    missed: dict[str, list[str]] = {}
    for sc, runs in results.items():
        jobs_out[sc] = {}
        missed[sc] = sorted(n for n, r in runs.items() if r.t_objective is None)
        # a job that missed its objective counts with its end (a lower bound on its time to objective)
        means[sc] = _mean([r.t_objective if r.t_objective is not None else (r.t_end or 0.0) for r in runs.values()])
        for n, r in runs.items():
            jobs_out[sc][n] = {
                "time_to_acceptable_s": None if r.t_acceptable is None else round(r.t_acceptable, 2),
                "time_to_objective_s": None if r.t_objective is None else round(r.t_objective, 2),
                "cpu_to_objective_s": None if r.cpu_to_objective_s is None else round(r.cpu_to_objective_s, 3),
                "end_s": None if r.t_end is None else round(r.t_end, 2),
                "cpu_s": None if r.cpu_s is None else round(r.cpu_s, 2),
                "steps": r.step, "steps_budget": r.steps_budget, "stopped_by": r.stopped_by,
                "exit_code": r.exit_code, "acceptable": targets[n].acceptable, "objective": targets[n].objective,
                "decisions": r.reasons,
            }
    base = means.get("NA")
    reduction = {sc: (None if base in (None, 0) or means[sc] is None else round(1 - means[sc] / base, 4))
                 for sc in results if sc != "NA"}
    bound = oracle(results, capacity, base) if capacity else None
    return {"jobs": jobs_out, "mean_time_to_objective_s": {k: None if v is None else round(v, 2)
                                                           for k, v in means.items()},
            "reduction_vs_NA": reduction, "missed_objectives": missed,
            "oracle_reduction": None if bound is None else bound["oracle_reduction"], "oracle": bound,
            "cpu_s_total": {sc: round(sum(r.cpu_s or 0.0 for r in runs.values()), 2) for sc, runs in results.items()}}


class Bar:
    """One line on stderr: scenario, jobs at acceptable / objective / ended, seconds."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._last = 0.0

    def __call__(self, scenario: str, runs: dict[str, JobRun], elapsed: float) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < 0.5:
            return
        self._last = now
        n = len(runs)
        ended = sum(r.t_end is not None for r in runs.values())
        acc = sum(r.t_acceptable is not None for r in runs.values())
        obj = sum(r.t_objective is not None for r in runs.values())
        done = sum(min(1.0, r.step / r.steps_budget) for r in runs.values()) / n
        bar = "#" * int(done * 30)
        sys.stderr.write(f"\r{scenario:>9} [{bar:<30}] {done:4.0%} acceptable {acc}/{n} objective {obj}/{n} "
                         f"ended {ended}/{n} {elapsed:5.1f} s")
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    p.add_argument("--scenarios", default=None,
                   help="comma-separated, of NA, AO, FT, SR (default all; --through-roles: NA and FT, the two it runs)")
    p.add_argument("--capacity", type=float, default=0.25,
                   help="the node's CPU cores (the parent cgroup's quota; below what the machine gives the jobs, "
                        "so the node, not other work on the machine, is what they share)")
    p.add_argument("--steps-scale", type=float, default=1.0, help="multiply every job's step budget")
    p.add_argument("--acceptable-at", type=float, default=0.35, help="acceptable = smoothed loss at this fraction "
                                                                    "of the step budget in calibration")
    p.add_argument("--objective-at", type=float, default=0.6, help="objective = smoothed loss at this fraction")
    p.add_argument("--shrink", type=float, default=0.25, help="a held job's limit = this x capacity / jobs")
    p.add_argument("--grace-s", type=float, default=5.0, help="checkpoint_exit grace before the hard stop")
    p.add_argument("--share-alpha", type=float, default=None, help="also apply the TRADL share rule at this alpha")
    p.add_argument("--alpha", type=float, default=Settings.default("targets_ewma_alpha"),
                   help="EWMA weight of the newest loss")
    p.add_argument("--patience", type=int, default=Settings.default("targets_patience"),
                   help="reports in a row past a target")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per scenario")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from phasewise.kit.command import report_dir

    p.add_argument("--report", type=report_dir, help="write plots and summary.md here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--through-roles", type=int, default=0, metavar="N",
                   help="instead: N training jobs through every role of the product (submit, place, the cgroup "
                        "actuator), NA (worker without --targets) against FT (with it)")
    p.add_argument("--roles-seconds", type=float, default=40.0,
                   help="--through-roles: each job's training budget, seconds (default 40)")


def run(args: argparse.Namespace) -> int:
    prog = "phasewise experiment targets"
    if args.through_roles:
        from phasewise.apps.experiment.targets_roles import run_roles

        return run_roles(args)
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    scenarios = [s.strip().upper() for s in (args.scenarios or ",".join(SCENARIOS)).split(",") if s.strip()]
    bad = [j for j in jobs if j not in JOBS] + [s for s in scenarios if s not in SCENARIOS]
    if bad or not jobs or not scenarios:
        print(f"{prog}: error: unknown or missing --jobs/--scenarios: {', '.join(bad) or 'none given'}",
              file=sys.stderr)
        return 2
    if not (0 < args.acceptable_at < args.objective_at <= 1) or not 0 < args.shrink <= 1 or args.capacity <= 0:
        print(f"{prog}: error: need 0 < --acceptable-at < --objective-at <= 1, 0 < --shrink <= 1, --capacity > 0",
              file=sys.stderr)
        return 2
    try:
        config = TargetsConfig(alpha=args.alpha, patience=args.patience, grace_s=args.grace_s)
        node = Node(args.capacity)
    except (ValueError, ExperimentError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    steps = {j: max(REPORT_EVERY * 5, int(DEFAULT_STEPS[j] * args.steps_scale)) for j in jobs}
    bar = Bar(not args.no_progress)
    t_start = time.monotonic()
    load_before = os.getloadavg()
    try:
        targets = calibrate(jobs, steps, node, config, args.acceptable_at, args.objective_at, args.timeout_s, bar)
        bar.end()
        results = {}
        for sc in scenarios:
            results[sc] = run_scenario(sc, jobs, steps, node, targets, config, shrink=args.shrink,
                                       grace_s=args.grace_s, share_alpha=args.share_alpha,
                                       timeout_s=args.timeout_s, progress=bar)
            bar.end()
    except ExperimentError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    finally:
        node.close([])
    out = summarise(results, targets, args.capacity)
    out["setup"] = {"jobs": jobs, "scenarios": scenarios, "capacity_cores": args.capacity, "steps": steps,
                    "acceptable_at": args.acceptable_at, "objective_at": args.objective_at, "shrink": args.shrink,
                    "grace_s": args.grace_s, "share_alpha": args.share_alpha,
                    "smoothing": config.describe(), "patience": config.patience,
                    "host_cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "wall_s": round(time.monotonic() - t_start, 1)}
    if args.report:
        from phasewise.apps.experiment.targets_report import write_targets_report

        write_targets_report(args.report, out, results)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'scenario':<9}{'mean t-obj s':>13}{'reduction':>10}{'missed':>8}{'cpu s':>8}")
        for sc in scenarios:
            red = out["reduction_vs_NA"].get(sc)
            print(f"{sc:<9}{out['mean_time_to_objective_s'][sc]:>13}{'' if red is None else f'{red:.1%}':>10}"
                  f"{len(out['missed_objectives'][sc]):>8}{out['cpu_s_total'][sc]:>8}")
        if out["oracle_reduction"] is not None:
            o = out["oracle"]
            print(f"oracle (shortest remaining work first on the measured work to objective): mean "
                  f"{o['srpt_mean_time_to_objective_s']} s, reduction {o['oracle_reduction']:.1%}; "
                  f"{o['bound_if_budgets_unbounded']:.1%} if NA ran every job past the last objective")
    return 0
