"""``phasewise experiment priorities --through-roles``: static against managed with every role of the product.

The roles ``experiment cluster`` starts (the embedded broker, produce, horus,
place on one cpuset slice of the host's CPUs, worker, the cgroup actuator with
``--start-jobs``) run two CPU-bound training jobs (:mod:`.trainer`, priority 0,
0.75 core each) and the inference service (:mod:`.inference`, priority 10, 0.5
core, a signed ``service`` section: its endpoint is the actuator's balancer),
all submitted with ``phasewise submit``; the service's requests follow a stepped
open-loop rate through that endpoint. The two scenarios differ only in
configuration: ``static`` runs ``worker`` without ``--priorities`` and without
``--autoscale`` (place admits every job, one replica, every job at the default
CPU weight); ``managed`` with both (the priority agent admits, place places after
admission and sends the CPU weights by priority, the autoscaler scales the
service's replicas through the actuator). Figures: the share of requests later
than the SLO (client-side, failed and shed ones included), the training jobs'
steps per second over the load (from their progress events), the replicas the
actuator ran. docs/priorities.md, "Through the roles".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import sys
import time
import uuid
from typing import Any

from phasewise.apps.experiment.cluster import Cluster, ClusterError, Config, Progress, summarize
from phasewise.apps.experiment.cluster_plan import PlannedJob, default_trace

__all__ = ["ROLE_SCENARIOS", "PriorityCluster", "plan_jobs", "run_roles", "steps_per_s"]

#: the scenarios and their configuration: (worker --priorities, the worker's further flags and settings)
ROLE_SCENARIOS: dict[str, tuple[bool, tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    "static": (False, (), ()),
    # (the scaler aims at 0.4 of a replica's CPU limit: a second replica at the ramp's middle step, before
    # the high one; no scale-down within two minutes of a change: a replica's cold start costs more here
    # than its CPU while idle)
    "managed": (True, ("--autoscale", "--autoscale-interval-s", "1", "--autoscale-up-cooldown-s", "3",
                       "--autoscale-down-cooldown-s", "120"), (("PHASEWISE_AUTOSCALE_TARGET_UTIL", "0.4"),)),
}
#: the requests: each training job, the service (each replica's CPU limit)
TRAIN_CORES = 0.75
SERVICE_CORES = 0.5
SERVICE_PRIORITY = 10
MAX_REPLICAS = 3
#: the load starts once the service answers and every training job reports steps, at most this many seconds
#: after the service started (on a loaded host, loading torch takes tens of seconds); when it ends the
#: experiment ends the jobs (SIGTERM to each job's program: it exits 0), and each job ends on its own at the
#: latest this long after the load's run
START_WAIT_S = 180.0


def plan_jobs(tag: str, seconds: float, trainers: int = 2) -> list[PlannedJob]:
    """*trainers* training jobs (priority 0) at once, the service (priority 10) a second later; the load
    runs *seconds*."""
    bound = seconds + START_WAIT_S + 30.0
    jobs = [PlannedJob(f"train-{tag}-{i}", "train", 0.0, 0, TRAIN_CORES, 500 * 2**20, bound, hidden=256, seed=i)
            for i in range(trainers)]
    jobs.append(PlannedJob(f"svc-{tag}", "service", 1.0, SERVICE_PRIORITY, SERVICE_CORES, 600 * 2**20, bound))
    return jobs


def rate_steps(low: float, high: float) -> tuple[tuple[float, float], ...]:
    """(share of the load's run, requests per second): low, 0.7 x high (where one replica's CPU limit is
    nearly all used), high (more than one replica's limit serves), low again.

    >>> rate_steps(20, 100)
    ((0.2, 20), (0.4, 70.0), (0.8, 100), (1.0, 20))
    """
    return ((0.2, low), (0.4, round(0.7 * high, 1)), (0.8, high), (1.0, low))


def free_port_block(n: int, rnd: random.Random) -> int:
    """A port P with P .. P + n free on loopback (the service's endpoint and its replicas')."""
    for _ in range(200):
        base = rnd.randrange(20000, 40000)
        socks = []
        try:
            for p in range(base, base + n + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterError(f"no {n + 1} free consecutive ports on loopback")


#: a training job reports its step this often (at most); a window's end closer than this to its last report is
#: covered
REPORT_EVERY_S = 1.0


def steps_per_s(events: list[Any], jobs: list[str], t0: float, t1: float) -> tuple[float | None, list[str]]:
    """The training jobs' steps per second over [t0, t1] (wall time), from their progress events: each job's
    last step reported by t1 less its last by t0. And the jobs whose reports do not span the window (the
    figure then covers less of it), each with the seconds its reports missed at either end.

    >>> from types import SimpleNamespace as E
    >>> ev = [E(job="a", kind="progress", ts=t, step=10 * t) for t in range(0, 12)]
    >>> steps_per_s(ev, ["a"], 1.0, 11.0)
    (10.0, [])
    >>> steps_per_s(ev, ["a"], 1.0, 20.0)[1]
    ['a (reports end 9.0 s early)']
    """
    if t1 <= t0:
        return None, list(jobs)
    total, short = 0, []
    for job in jobs:
        prog = sorted((e.ts, e.step) for e in events if e.job == job and e.kind == "progress" and e.step is not None)
        before = [s for ts, s in prog if ts <= t0]
        upto = [s for ts, s in prog if ts <= t1]
        if not prog:
            short.append(f"{job} (no reports)")
            continue
        gaps = ([f"reports start {prog[0][0] - t0:.1f} s late"] if prog[0][0] > t0 else []) + \
               ([f"reports end {t1 - prog[-1][0]:.1f} s early"] if prog[-1][0] < t1 - REPORT_EVERY_S else [])
        if gaps:
            short.append(f"{job} ({', '.join(gaps)})")
        total += (max(upto) if upto else 0) - (max(before) if before else 0)
    return total / (t1 - t0), short


class PriorityCluster(Cluster):
    """:class:`Cluster` with this experiment's service: the inference replica program behind its signed
    ``service`` section, under the stepped rate."""

    def __init__(self, cfg: Config, jobs: list[PlannedJob], *, slo_ms: float, low: float, high: float,
                 prefix_shares: int | None = None) -> None:
        super().__init__(cfg, jobs)
        self.prefix_shares = prefix_shares
        self.slo_ms, self.steps = slo_ms, rate_steps(low, high)
        self.service_port = free_port_block(MAX_REPLICAS, random.Random(cfg.seed ^ os.getpid() ^ time.time_ns()))
        self.load_wall: tuple[float, float] | None = None
        self.no_load: str | None = None

    def start(self) -> None:
        if self.prefix_shares is not None:  # the run's cgroup prefix against the host's other processes
            from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout

            try:
                base = CgroupLayout("/sys/fs/cgroup", prefix=self.cfg.cgroup_prefix).base("cpu")
                base.mkdir(parents=True, exist_ok=True)
                (base / ("cpu.shares" if (base / "cpu.shares").exists() else "cpu.weight")).write_text(
                    str(self.prefix_shares))
            except (OSError, CgroupError) as e:
                raise ClusterError(f"--prefix-cpu-shares: {e}") from None
        super().start()

    def command(self, j: PlannedJob) -> list[str]:
        if j.kind != "service":
            return super().command(j)
        # each replica listens on $PORT (the actuator gives replica k port + k) and ends after j.seconds
        return [self.job_python, "-W", "ignore", "-m", "phasewise.apps.experiment.inference", "--seconds",
                str(j.seconds)]

    def job_file(self, j: PlannedJob, command: list[str]) -> Any:
        path = super().job_file(j, command)
        spec = json.loads(path.read_text())
        spec.pop("targets", None)  # (no worker here runs --targets)
        if j.kind == "service":
            spec["service"] = {"port": self.service_port, "metrics_path": "/metrics/prometheus",
                               # the server-side p99 misses the time a request waits for the server: half the SLO
                               "slo_p99_ms": self.slo_ms / 2, "min_replicas": 1, "max_replicas": MAX_REPLICAS}
        path.write_text(json.dumps(spec, indent=1))
        return path

    def _service_load(self, j: PlannedJob) -> None:
        from phasewise.apps.experiment.inference import Load, scrape

        # until it serves through its endpoint and every training job trains, or the run ends
        while scrape(self.service_port) is None or not self.training():
            if self.stopping.is_set():
                return
            if time.time() - self.started_at(j.job) > START_WAIT_S:
                self.no_load = (f"no load: the service or a training job not running {START_WAIT_S:.0f} s after "
                                "the service started")
                self.end_jobs()
                return
            time.sleep(0.5)
        left = self.cfg.service_s
        steps = self.steps

        def rate(t: float) -> float:
            return next((r for share, r in steps if t < share * left), steps[-1][1])

        load = Load(lambda: [self.service_port], rate, workers=64, timeout_s=2.0, seed=self.cfg.seed)
        self.load = load
        t0 = time.time()
        self.load_result = load.run(left)
        self.load_wall = (t0, time.time())
        self.end_jobs()

    def end_jobs(self) -> None:
        """SIGTERM to each job's program (not its progress reporter, which then exits as its program did):
        the trainer and the service exit 0 on it, as at the end of their time."""
        import signal

        from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout

        assert self.collector is not None
        started = {e.job: e.pid for e in self.collector.snapshot().events if e.kind == "started"}
        layout = CgroupLayout("/sys/fs/cgroup", prefix=self.cfg.cgroup_prefix)
        for j in self.jobs:
            try:
                pids = layout.pids(j.job)
            except (OSError, CgroupError):
                continue
            for pid in [p for p in pids if p != started.get(j.job)] if len(pids) > 1 else pids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def training(self) -> bool:
        """Every training job has reported a step."""
        assert self.collector is not None
        rec = self.collector.snapshot()
        stepping = {e.job for e in rec.events if e.kind == "progress" and e.step}
        return all(j.job in stepping for j in self.jobs if j.kind == "train")

    def started_at(self, job: str) -> float:
        assert self.collector is not None
        rec = self.collector.snapshot()
        return next((e.ts for e in rec.events if e.job == job and e.kind == "started"), time.time())


def scenario_figures(c: PriorityCluster, jobs: list[PlannedJob], rec: Any, wall_s: float, leaked: int | None,
                     probe: str) -> dict[str, Any]:
    s = summarize(jobs, rec, leaked=leaked, probe=probe, wall_s=wall_s, trace="none", span_s=1.0)
    svc = next(j for j in jobs if j.kind == "service")
    training = [j.job for j in jobs if j.kind == "train"]
    out: dict[str, Any] = {k: s[k] for k in ("terminal", "stuck", "outcomes", "leaked_bookings", "wall_s")}
    lr = c.load_result
    if lr is not None and c.load_wall is not None:
        total = lr.total()
        lat = sorted(lr.latencies_ms)
        out["slo_violation_share"] = round(lr.violations(c.slo_ms) / total, 4) if total else None
        out["p99_ms"] = round(lat[max(0, math.ceil(0.99 * len(lat)) - 1)], 1) if lat else None
        out["requests"] = {"sent": lr.sent, "answered": len(lat), "failed": lr.failed, "shed": lr.shed,
                           "over_slo": lr.violations(c.slo_ms)}
        sps, short = steps_per_s(rec.events, training, *c.load_wall)
        out["training_steps_per_s"] = round(sps, 2) if sps is not None else None
        out["training_not_over_the_whole_load"] = short
        out["load_s"] = round(c.load_wall[1] - c.load_wall[0], 1)
    else:
        out.update(slo_violation_share=None, p99_ms=None, requests=None, training_steps_per_s=None,
                   training_not_over_the_whole_load=training, load_s=None)
    ds = {d.id: d for d in rec.decisions if d.container == svc.job}
    scaled = [ds[a.decision_id] for a in rec.actuations if a.decision_id in ds and ds[a.decision_id].action == "scale"
              and a.status in ("applied", "clamped")]
    out["scale_decisions_applied"] = len(scaled)
    out["replicas_max"] = max([1, *(int(d.details.get("replicas", 1)) for d in scaled)])
    weights = [d for d in rec.decisions if d.action == "weight"]
    out["weights"] = {d.container: d.details.get("cpu_weight") for d in weights}
    out["dead_letters"] = s["dead_letters"]
    out["submits_failed"] = list(c.problems)
    # how each job that did not finish ended, as its actuator reported it
    out["failures"] = {e.job: {k: getattr(e, k) for k in ("kind", "exit_code", "signal", "oom", "reason")
                               if getattr(e, k, None) is not None}
                       for e in rec.events if e.kind in ("failed", "lost", "rejected")}
    if c.no_load:
        out["no_load"] = c.no_load
    return out


def run_roles(args: argparse.Namespace) -> int:
    prog = "phasewise experiment priorities"
    calibrate = getattr(args, "calibrate", False)  # the rates come from the measured capacity
    if not (args.roles_seconds >= 20 and args.slo_ms > 0 and (calibrate or (args.rate_low > 0 and args.rate_high > 0))):
        print(f"{prog}: error: --through-roles needs --roles-seconds >= 20, positive rates and SLO", file=sys.stderr)
        return 2
    if args.prefix_cpu_shares is not None and not 2 <= args.prefix_cpu_shares <= 262144:
        print(f"{prog}: error: --prefix-cpu-shares must be in [2, 262144]", file=sys.stderr)
        return 2
    chosen = list(dict.fromkeys(x.strip() for x in args.scenarios.split(",") if x.strip()))
    bad = [x for x in chosen if x not in ROLE_SCENARIOS]
    if bad or not chosen:
        print(f"{prog}: error: --through-roles runs {' and '.join(ROLE_SCENARIOS)} only, got "
              f"{', '.join(bad) or 'none'} in --scenarios", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print(f"{prog}: error: --through-roles starts jobs in cgroups as job_user: run it as root", file=sys.stderr)
        return 2
    calibration = None
    if calibrate:
        from phasewise.apps.experiment.priorities_calibrate import calibrate as measure
        from phasewise.apps.experiment.priorities_calibrate import rates_from

        if not (args.json or args.no_progress):
            print(f"{prog}: measuring one replica's capacity ({SERVICE_CORES:g} core, SLO {args.slo_ms:g} ms; "
                  "--no-calibrate or rates skip it)", file=sys.stderr)
        calibration = measure(cores=SERVICE_CORES, slo_ms=args.slo_ms)
        if not calibration.capacity_rps:
            print(f"{prog}: error: one replica served not even {calibration.steps[0][0]:g} requests/s within the "
                  f"{args.slo_ms:g} ms SLO on this host: give --rate-low and --rate-high", file=sys.stderr)
            return 1
        args.rate_low, args.rate_high = rates_from(calibration.capacity_rps)
    out: dict[str, Any] = {"seconds": args.roles_seconds, "slo_ms": args.slo_ms,
                           "calibration": calibration.to_dict() if calibration else None,
                           "prefix_cpu_shares": args.prefix_cpu_shares,
                           "rate_steps": rate_steps(args.rate_low, args.rate_high),
                           "requests_cores": {"training": TRAIN_CORES, "service_replica": SERVICE_CORES},
                           "scenarios": {}}
    for scenario in chosen:
        priorities, flags, env = ROLE_SCENARIOS[scenario]
        tag = f"{scenario[:2]}{uuid.uuid4().hex[:4]}"
        jobs = plan_jobs(tag, args.roles_seconds)
        cfg = Config(jobs=len(jobs), seed=0, trace=default_trace(), span_s=1.0, train_s=args.roles_seconds,
                     service_s=args.roles_seconds, interactive_s=0.0, timeout_s=args.roles_seconds + START_WAIT_S + 300,
                     report=None, json=args.json,
                     cgroup_prefix=f"pwprio-{tag}", keep=args.keep, priorities=priorities, targets=False,
                     worker_flags=flags, worker_env=env, slices=1)
        progress = Progress(sys.stderr.isatty() and not args.json and not args.no_progress)
        c = PriorityCluster(cfg, jobs, slo_ms=args.slo_ms, low=args.rate_low, high=args.rate_high,
                            prefix_shares=args.prefix_cpu_shares)
        t0 = time.monotonic()
        try:
            c.start()
            c.drive(progress)
            progress.end()
            leaked, probe = c.probe_leaks()
            time.sleep(2)
            assert c.collector is not None
            rec = c.collector.snapshot()
        except ClusterError as e:
            progress.end()
            c.cfg.keep = True
            c.close()
            print(f"{prog}: error: {scenario}: {e} (logs in {c.run_dir})", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            c.close()
            return 130
        out["scenarios"][scenario] = scenario_figures(c, jobs, rec, time.monotonic() - t0, leaked, probe)
        if args.keep:
            out["scenarios"][scenario]["run_dir"] = str(c.run_dir)
        c.close()
    out["targets"] = targets(out["scenarios"].get("static", {}), out["scenarios"].get("managed", {}))
    out["host"] = {"cpus": len(os.sched_getaffinity(0)), "load1_at_end": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out["scenarios"].items():
            print(f"{k}: SLO violations {v['slo_violation_share']} (p99 {v['p99_ms']} ms, {v['requests']}), "
                  f"training {v['training_steps_per_s']} steps/s, replicas at most {v['replicas_max']}, "
                  f"{v['terminal']} ended ({', '.join(f'{a} {b}' for a, b in v['outcomes'].items())}), "
                  f"{len(v['stuck'])} stuck, {v['leaked_bookings']} leaked bookings, {v['wall_s']} s")
        for k, v in out["targets"].items():
            print(f"target {k}: {v}")
    return 0


def targets(st: dict[str, Any], ma: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each met (true), missed (false) or not measurable (null)."""
    sv, mv = st.get("slo_violation_share"), ma.get("slo_violation_share")
    ss, ms = st.get("training_steps_per_s"), ma.get("training_steps_per_s")
    return {
        "static_violates": None if sv is None else sv > 0,
        "managed_violations_at_most_1pct": None if mv is None else mv <= 0.01,
        "managed_violations_below_static": None if sv is None or mv is None else mv < sv,
        "training_throughput_ratio": round(ms / ss, 4) if ss and ms is not None else None,
        "training_throughput_at_least_0.95": None if not ss or ms is None else ms >= 0.95 * ss,
    }
