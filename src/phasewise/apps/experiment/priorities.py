"""``phasewise experiment priorities``: DynamoML's preemption, CPU weights and autoscaling, static vs managed,
with a real inference service and real training jobs in managed cgroups. ``--through-roles`` runs it with
the product's roles (:mod:`.priorities_roles`); without it, this module's own in-process control loop (the
policy, the scaler and the cgroup backend called directly, no broker). What runs, what is measured:
docs/priorities.md, "The experiment" and "Through the roles".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.actuators.backends import CgroupBackend
from phasewise.actuators.commands import Freeze, SetCpuWeight, SetLimits, Thaw
from phasewise.actuators.safety import Planned, plan_weight
from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from phasewise.models.jobs.autoscaler import Autoscaler, AutoscalerConfig
from phasewise.models.jobs.priorities import Action, Capacity, JobRequest, PriorityConfig, PriorityPolicy, to_decision

__all__ = ["add_arguments", "run", "run_scenario"]

HOST = "local"
#: the scenarios: static limits, the agent with CPU weights, the agent without them
SCENARIOS = ("static", "managed", "unweighted")
#: the thirds of a run: steady (two training jobs, the service), urgent (its job runs), after (it left)
PHASES = ("steady", "urgent", "after")
GiB = 2**30
REPLICA_CORES = 0.5
INFERENCE_PRIORITY = 10
#: --through-roles: the service's low and high request rates (per second)
ROLES_RATES = (20.0, 80.0)


@dataclass
class Options:
    duration_s: float = 30.0
    slo_ms: float = 300.0
    rate_low: float = 10.0
    rate_high: float = 60.0
    capacity_cores: float = 2.0
    max_replicas: int = 2
    grace_s: float = 10.0
    weight_ratio: float = 2.0
    cgroup_root: str = "/sys/fs/cgroup"


@dataclass
class JobRun:
    """A training job's process(es) and what its progress lines said."""

    name: str
    cores: float
    proc: subprocess.Popen | None = None
    step: int = 0              #: the last completed step reported
    steps_done: int = 0        #: steps completed in this scenario, over every run of it
    lost: int = 0
    before_preempt: int | None = None  #: last completed step when it was preempted
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None
    seen: threading.Event = field(default_factory=threading.Event)
    exited_step: int | None = None


class Scenario:
    def __init__(self, name: str, opt: Options, workdir: Path, progress: Any) -> None:
        self.name, self.opt, self.dir, self.progress = name, opt, workdir, progress
        self.layout = CgroupLayout(opt.cgroup_root, prefix=f"phasewise-exp-{uuid.uuid4().hex[:8]}")
        self.settings = Settings()  # the actuator's default bounds (cpu_weight_min, cpu_weight_max)
        self.backend = CgroupBackend(self.layout)
        self.ckpt = workdir / "checkpoints"
        self.jobs = {"train-a": JobRun("train-a", 0.5), "train-b": JobRun("train-b", 0.5),
                     "urgent": JobRun("urgent", 1.0)}
        self.decisions: list[Decision] = []
        self.events: list[dict] = []
        self.freeze_ms: list[float] = []
        self.trace: list[dict] = []  # what the autoscaler read each second
        self.cpu_prev: dict[int, tuple[float, float]] = {}
        self.t0 = time.monotonic()
        self.lock = threading.RLock()   # the jobs' progress counters
        self.plock = threading.Lock()   # the policy and its actuation, one caller at a time
        self.replica_n = 1
        self.starting: list[threading.Thread] = []
        self.weights: dict[str, int] = {}  # container -> the CPU weight the policy gave it
        self.weighed: list[dict] = []  # each weight written: container, weight, the backend's answer
        self.wlock = threading.Lock()
        self.cpu_seen: dict[str, int] = {}  # container -> cpuacct.usage (ns) at the last reading
        self.cpu_s: dict[str, dict[str, float]] = {p: {} for p in PHASES}
        from phasewise.apps.experiment.inference import Replicas

        self.replicas = Replicas("infer", self.place, self.unplace, workdir)

    # -------------------------------------------------------------- containers

    def place(self, name: str, pid: int, cores: float = REPLICA_CORES) -> None:
        self.layout.create(name)
        self.layout.attach(name, pid)
        out = self.backend.apply(SetLimits(name, cpu_cores=cores))
        if out.status not in ("applied", "clamped"):
            raise CgroupError(f"cannot limit {name}: {out.message}")
        self._weigh(name)  # a weight decided before its container existed (a cold start, a restart)

    def _weigh(self, name: str) -> None:
        """Write *name*'s weight when it has one and its container exists (whichever comes last writes it)."""
        with self.wlock:
            w = self.weights.get(name)
            if w is None or not self.layout.exists(name):
                return
            out = self.backend.apply(SetCpuWeight(name, w))
            self.weighed.append({"t": round(time.monotonic() - self.t0, 3), "container": name, "weight": w,
                                 "status": out.status, "message": out.message})

    def sample_cpu(self, t: float) -> None:
        """Add each container's CPU time since the last reading to the run's third *t* falls in."""
        phase = PHASES[min(2, int(3 * t / self.opt.duration_s))] if t >= 0 else None
        for c in self.layout.containers():
            try:
                now = int((self.layout.path(c, "cpuacct") / "cpuacct.usage").read_text())
            except (OSError, ValueError, CgroupError):
                continue
            before = self.cpu_seen.get(c)
            self.cpu_seen[c] = now
            if phase is not None and before is not None and now >= before:
                got = self.cpu_s[phase]
                got[c] = got.get(c, 0.0) + (now - before) / 1e9

    def unplace(self, name: str) -> None:
        self.cpu_seen.pop(name, None)  # (its CPU since the last reading is not counted)
        try:
            self.backend.apply(Thaw(name))  # a frozen process cannot exit
            self.layout.remove(name, timeout_s=10)
        except CgroupError:
            pass

    def note(self, kind: str, **kw: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 3), "kind": kind, **kw})

    # -------------------------------------------------------------- training jobs

    def start_job(self, j: JobRun, *, hold: bool = False) -> None:
        """Start *j*'s process in its cgroup (*hold*: loaded, then waiting for :meth:`release`)."""
        code = ("import sys; sys.stdin.readline(); from phasewise.apps.experiment.trainer import main; "
                "raise SystemExit(main(sys.argv[1:]))")
        argv = [sys.executable, "-c", code, j.name, "--checkpoint-dir", str(self.ckpt)]
        if hold:
            argv.append("--hold")
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.place(j.name, p.pid, j.cores)
        p.stdin.write("go\n")
        p.stdin.flush()
        if not hold:
            p.stdin.close()
        j.proc, j.exited_step = p, None
        j.seen.clear()
        j.reader = threading.Thread(target=self._read, args=(j, p), daemon=True)
        j.reader.start()

    def release(self, j: JobRun) -> None:
        """Let a held job train (its arrival)."""
        j.proc.stdin.write("go\n")
        j.proc.stdin.close()

    def _read(self, j: JobRun, p: subprocess.Popen) -> None:
        from phasewise.apps.experiment.trainer import parse_line

        for line in p.stdout:
            f = parse_line(line)
            if "step" not in f:
                continue
            step, phase = int(f["step"]), f.get("phase")
            with self.lock:
                if phase in ("start", "resume"):
                    if j.before_preempt is not None:  # a restart from its checkpoint
                        j.lost += max(0, j.before_preempt - step)
                        j.before_preempt = None
                    j.step = step
                else:
                    if phase == "exit":
                        j.exited_step = step
                    if step > j.step:
                        j.steps_done += step - j.step
                        j.step = step
                j.seen.set()

    def stop_job(self, j: JobRun, checkpoint: bool) -> None:
        """Checkpoint-and-exit (SIGUSR1), a hard stop after the grace period; or SIGTERM."""
        p = j.proc
        if p is None or p.poll() is not None:
            return
        t0 = time.monotonic()
        p.send_signal(signal.SIGUSR1 if checkpoint else signal.SIGTERM)
        try:
            p.wait(self.opt.grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            self.note("hard-stop", job=j.name)
        self.note("exited", job=j.name, after_s=round(time.monotonic() - t0, 3))
        if j.reader is not None:
            j.reader.join(5)
        self.unplace(j.name)

    # -------------------------------------------------------------- the run

    def rate(self, t: float) -> float:
        return self.opt.rate_low if t < self.opt.duration_s / 2 else self.opt.rate_high

    def run(self, managed: bool, weighted: bool = False) -> dict:
        from phasewise.apps.experiment.inference import Load

        S = self.opt.duration_s
        try:
            policy = PriorityPolicy(PriorityConfig(freeze_max_wait_s=S / 2, grace_s=self.opt.grace_s,
                                                   cpu_weight_ratio=self.opt.weight_ratio if weighted else None),
                                    {HOST: Capacity(self.opt.capacity_cores, 64 * GiB)})
            # the server-side p99 misses the time a request waits to be accepted: the scaler aims at half the SLO
            a = self.settings.autoscale  # the agent's defaults, where the experiment sets nothing of its own
            scaler = Autoscaler(AutoscalerConfig(slo_p99_ms=self.opt.slo_ms / 2, target_util=0.6, min_replicas=1,
                                                 max_replicas=self.opt.max_replicas if managed else 1,
                                                 up_cooldown_s=3.0, down_cooldown_s=S, max_step=1,
                                                 tolerance=a.tolerance, down_latency_fraction=a.down_latency_fraction,
                                                 up_step=a.up_step))
            # the steady start: two training jobs and one replica, running before the clock starts
            for name, prio in (("train-a", 0), ("train-b", 1)):
                if managed:
                    self.act(policy.submit(JobRequest(name, HOST, cpu_cores=0.5, mem_bytes=GiB, priority=prio),
                                           now=0.0), policy)
                else:
                    self.start_job(self.jobs[name])
            if managed:
                self.act(policy.submit(JobRequest("infer-1", HOST, cpu_cores=REPLICA_CORES, mem_bytes=GiB,
                                                  priority=INFERENCE_PRIORITY, workload="inference"), now=0.0),
                         policy)
            else:
                self.replicas.start()
            if managed:  # warm standbys for the scale-ups (an idle process each; no CPU until admitted)
                for n in range(2, self.opt.max_replicas + 1):
                    th = threading.Thread(target=self.replicas.prestart, args=(f"infer-{n}",), daemon=True)
                    th.start()
                    self.starting.append(th)
            self.start_job(self.jobs["urgent"], hold=True)  # warm: loaded, waiting for its arrival
            for th in self.starting:
                th.join(120)
            for j in self.jobs.values():
                j.seen.wait(120)
            t0, self.t0 = self.t0, time.monotonic()
            for e in [*self.events, *self.weighed]:  # what happened before the clock started has negative times
                e["t"] = round(e["t"] - (self.t0 - t0), 3)
            for j in self.jobs.values():  # count from here
                with self.lock:
                    j.steps_done = 0
            load = Load(self.replicas.ports, self.rate, workers=64, timeout_s=2.0)
            lt = threading.Thread(target=load.run, args=(S,), daemon=True)
            lt.start()
            urgent_at, urgent_end = S / 3, 2 * S / 3
            urgent_started = urgent_done = False
            next_scale = next_cpu = 0.0
            self.sample_cpu(-1.0)  # the readings the first second counts from
            while lt.is_alive():
                t = time.monotonic() - self.t0
                if t >= next_cpu:
                    next_cpu = t + 1.0
                    self.sample_cpu(t)
                if not urgent_started and t >= urgent_at:
                    urgent_started = True
                    self.note("arrive", job="urgent")
                    if managed:
                        with self.plock:
                            self.act(policy.submit(JobRequest("urgent", HOST, cpu_cores=1.0, mem_bytes=GiB,
                                                              priority=5, expected_s=urgent_end - urgent_at),
                                                   now=t), policy)
                    else:
                        self.release(self.jobs["urgent"])
                if urgent_started and not urgent_done and t >= urgent_end:
                    urgent_done = True
                    threading.Thread(target=self.finish_urgent, args=(policy if managed else None, t),
                                     daemon=True).start()
                if managed and t >= next_scale and t >= 1.0:
                    next_scale = t + 1.0
                    with self.plock:
                        self.autoscale(scaler, policy, t)
                self.progress(self.name, t, S, len(self.replicas.ports()))
                time.sleep(0.1)
            lt.join()
            elapsed = time.monotonic() - self.t0
            self.sample_cpu(min(elapsed, S - 1e-6))
            res = load.result
            lat = sorted(res.latencies_ms)
            total = res.total()
            with self.lock:
                steps = sum(j.steps_done for j in self.jobs.values())
                lost = sum(j.lost for j in self.jobs.values())
            out = {
                "slo_violation_share": res.violations(self.opt.slo_ms) / total if total else None,
                "p99_ms": lat[max(0, math.ceil(0.99 * len(lat)) - 1)] if lat else None,
                "training_steps_per_s": steps / elapsed,
                "preempt_to_frozen_ms": max(self.freeze_ms) if self.freeze_ms else None,
                "resume_lost_steps": lost if managed else None,
                "replicas_max": self.replicas.max_seen,
            }
            out["detail"] = {"requests": total, "answered": len(lat), "failed": res.failed, "shed": res.shed,
                             "steps": {n: j.steps_done for n, j in self.jobs.items()},
                             "freeze_ms": self.freeze_ms, "elapsed_s": elapsed,
                             "timeline": [(round(a, 3), None if math.isinf(b) else round(b, 2))
                                          for a, b in sorted(res.timeline)],
                             "events": self.events, "autoscaler": self.trace,
                             "cpu_s": {p: {c: round(v, 3) for c, v in sorted(d.items())}
                                       for p, d in self.cpu_s.items()},
                             "weights": self.weighed}
            return out
        finally:
            self.close()

    def finish_urgent(self, policy: PriorityPolicy | None, t: float) -> None:
        """The urgent job's time is up: it stops, and (managed) its capacity goes back in priority order."""
        self.stop_job(self.jobs["urgent"], checkpoint=False)
        self.note("finish", job="urgent")
        if policy is not None:
            with self.plock:
                self.act(policy.finish("urgent", now=time.monotonic() - self.t0), policy)

    def autoscale(self, scaler: Autoscaler, policy: PriorityPolicy, t: float) -> None:
        from phasewise.apps.experiment.inference import scrape

        ports = self.replicas.ports()
        stats, utils = [], []
        now = time.monotonic()
        for port in ports:
            s = scrape(port, timeout_s=2.0)
            if s is None:
                continue
            stats.append(s)
            prev = self.cpu_prev.get(port)
            self.cpu_prev[port] = (now, s["cpu_seconds"])
            if prev is not None and now > prev[0]:  # CPU used over the last interval / the replica's limit
                utils.append((s["cpu_seconds"] - prev[1]) / (now - prev[0]) / REPLICA_CORES)
        self.trace.append({"t": round(t, 2), "replicas": len(ports), "answered": len(stats),
                           "cpu_util": [round(u, 3) for u in utils], "p99_ms": [s["p99_ms"] for s in stats]})
        if not stats:
            return
        util = sum(utils) / len(utils) if utils else None
        p99s = [s["p99_ms"] for s in stats if s["p99_ms"] is not None]
        p99 = max(p99s) if p99s else None
        n = sum(1 for j in policy.states() if j.startswith("infer-"))  # serving, starting or waiting
        sc = scaler.step(now=t, replicas=n, util=util, p99_ms=p99)
        if sc is None:
            return
        d = Decision(id=uuid.uuid4().hex, ts=time.time(), host=HOST, container="infer", action="scale",
                     policy="autoscaler", reason=sc.reason, details={**sc.details, "replicas": sc.replicas,
                                                                     "current": sc.current})
        self.decisions.append(d)
        self.note("scale", to=sc.replicas, reason=sc.reason)
        if sc.replicas > sc.current:
            self.replica_n += 1
            name = f"infer-{self.replica_n}"
            self.act(policy.submit(JobRequest(name, HOST, cpu_cores=REPLICA_CORES, mem_bytes=GiB,
                                              priority=INFERENCE_PRIORITY, workload="inference"), now=t), policy)
        else:
            names = self.replicas.names()
            if names:
                self.replicas.stop_one()
                self.act(policy.finish(names[-1], now=t), policy)

    def act(self, actions: list[Action], policy: PriorityPolicy) -> None:
        """Carry out the policy's actions on this host (the local actuator)."""
        for a in actions:
            ts = time.time()
            d = to_decision(a, ts)
            self.decisions.append(d)
            self.note(a.kind, job=a.job, reason=a.reason)
            if a.kind == "weight":  # through the actuator's safety rule (its bounds) to the cgroup backend
                p = plan_weight(d, settings=self.settings)
                if isinstance(p, Planned):
                    with self.wlock:
                        self.weights[a.job] = p.command.weight
                    self._weigh(a.job)
                continue
            if a.job.startswith("infer-"):
                if a.kind in ("start", "restart", "thaw"):  # a cold start takes seconds: not on the control loop
                    th = threading.Thread(target=self._start_replica, args=(a.job,), daemon=True)
                    th.start()
                    self.starting.append(th)
                continue  # a replica is never a victim: nothing ranks below inference's priority here
            j = self.jobs[a.job]
            if a.kind == "freeze":
                with self.lock:
                    j.before_preempt = j.step
                out = self.backend.apply(Freeze(a.job))  # returns once freezer.state reads FROZEN
                ms = (time.time() - d.ts) * 1e3
                if out.status == "applied":
                    self.freeze_ms.append(ms)
                self.note("frozen", job=a.job, ms=round(ms, 2), status=out.status)
            elif a.kind == "thaw":
                self.backend.apply(Thaw(a.job))
                threading.Thread(target=self._after_thaw, args=(j,), daemon=True).start()
            elif a.kind == "checkpoint_stop":
                self.stop_job(j, checkpoint=True)
                with self.lock:
                    j.before_preempt = j.step
                self.note("stopped", job=a.job, step=j.exited_step)
            elif a.kind == "start" and j.proc is not None and j.proc.poll() is None:
                self.release(j)  # warm and waiting: its arrival
            elif a.kind in ("start", "restart"):
                self.start_job(j)

    def _start_replica(self, name: str) -> None:
        try:
            self.replicas.start(name)
            self.note("serving", job=name)
        except (RuntimeError, OSError) as e:
            self.note("replica-failed", job=name, reason=str(e)[-300:])

    def _after_thaw(self, j: JobRun) -> None:
        """A thawed job's next report: a step below the one it had reached would be a lost step."""
        with self.lock:
            before = j.before_preempt
            j.seen.clear()
        j.seen.wait(10)
        with self.lock:
            if before is not None:
                j.lost += max(0, before - j.step)
                j.before_preempt = None

    def close(self) -> None:
        for th in self.starting:
            th.join(60)
        self.replicas.close()
        for j in self.jobs.values():
            if j.proc is not None and j.proc.poll() is None:
                self.backend.apply(Thaw(j.name))
                j.proc.kill()
                j.proc.wait()
            try:
                self.layout.remove(j.name, timeout_s=5)
            except CgroupError:
                pass
        for c in self.layout.controllers():
            try:
                self.layout.base(c).rmdir()
            except OSError:
                pass


def run_scenario(name: str, opt: Options, workdir: Path, progress=lambda *a: None) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    sc = Scenario(name, opt, workdir, progress)
    out = sc.run(managed=name != "static", weighted=name == "managed")
    with open(workdir / "decisions.jsonl", "wb") as f:
        for d in sc.decisions:
            f.write(encode(d) + b"\n")
    return out


class Bar:
    """A one-line progress bar on stderr (redrawn in place on a terminal, every 10 % otherwise)."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream, self.tty, self.last = stream, stream.isatty(), None

    def __call__(self, name: str, t: float, total: float, replicas: int) -> None:
        frac = min(1.0, t / total)
        if not self.tty:
            key = (name, int(frac * 10))
            if key == self.last:
                return
            self.last = key
        bar = "#" * int(frac * 30)
        line = f"[{name:>7}] {bar:<30} {t:5.1f}/{total:.0f} s  replicas={replicas}"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")


KEYS = ("slo_violation_share", "p99_ms", "training_steps_per_s", "preempt_to_frozen_ms", "resume_lost_steps",
        "replicas_max")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Options()
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds per scenario")
    p.add_argument("--scenarios", default="static,managed",
                   help="comma-separated: static, managed (the agent, CPU weights by priority), unweighted (the "
                        "agent without the weights); --through-roles: static and managed")
    p.add_argument("--slo-ms", type=float, default=d.slo_ms, help="inference latency SLO (client-side), ms")
    p.add_argument("--rate-low", type=float, default=None,
                   help=f"requests/s in the first half (default {d.rate_low:g}; --through-roles: the first and "
                        f"last fifth, default {ROLES_RATES[0]:g})")
    p.add_argument("--rate-high", type=float, default=None,
                   help=f"requests/s in the second half (default {d.rate_high:g}; --through-roles: 0.7 x this for "
                        "the second fifth, this for the two next; without either rate, one replica's capacity "
                        "measured first sets both: 0.7 x high is that capacity, low a quarter of it)")
    p.add_argument("--no-calibrate", action="store_true",
                   help=f"--through-roles without rates: the fixed rates {ROLES_RATES[0]:g} and {ROLES_RATES[1]:g} "
                        "instead of measuring one replica's capacity first")
    p.add_argument("--capacity", type=float, default=d.capacity_cores, help="cores the host offers to the jobs")
    p.add_argument("--max-replicas", type=int, default=d.max_replicas)
    p.add_argument("--grace", type=float, default=d.grace_s, help="seconds a checkpoint-and-exit gets")
    p.add_argument("--weight-ratio", type=float, default=d.weight_ratio,
                   help="managed: CPU weight factor of one priority level (cpu_weight)")
    p.add_argument("--cgroup-root", default=d.cgroup_root)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    from phasewise.kit.command import report_dir

    p.add_argument("--report", type=report_dir, help="write results.json, summary.md and plots here")
    p.add_argument("--through-roles", action="store_true",
                   help="run static and managed with every role of the product (broker, produce, horus, place, "
                        "worker, the cgroup actuator) instead of this process's own control loop; "
                        "docs/priorities.md, \"Through the roles\"")
    p.add_argument("--roles-seconds", type=float, default=120.0,
                   help="--through-roles: seconds of the service's load in each scenario (default 120)")
    p.add_argument("--keep", action="store_true", help="--through-roles: keep each scenario's folder (role logs)")
    p.add_argument("--prefix-cpu-shares", type=int, default=None, metavar="N",
                   help="--through-roles: the run's cgroup prefix's cpu.shares (v2: cpu.weight) against the host's "
                        "other processes, in both scenarios (default: the kernel's, 1024)")


def run(args: argparse.Namespace) -> int:
    if args.through_roles:
        from phasewise.apps.experiment.priorities_roles import run_roles

        # neither rate given: one replica's capacity on this host sets them (priorities_calibrate)
        args.calibrate = args.rate_low is None and args.rate_high is None and not args.no_calibrate
        if not args.calibrate:
            args.rate_low = ROLES_RATES[0] if args.rate_low is None else args.rate_low
            args.rate_high = ROLES_RATES[1] if args.rate_high is None else args.rate_high
        return run_roles(args)
    d = Options()
    args.rate_low = d.rate_low if args.rate_low is None else args.rate_low
    args.rate_high = d.rate_high if args.rate_high is None else args.rate_high
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or not scenarios:
        print(f"phasewise experiment priorities: --scenarios: unknown {bad or 'none'} ({', '.join(SCENARIOS)})",
              file=sys.stderr)
        return 2
    if not (1 <= args.weight_ratio <= 100):
        print("phasewise experiment priorities: --weight-ratio must be in [1, 100]", file=sys.stderr)
        return 2
    if not (args.duration >= 6 and args.rate_low > 0 and args.rate_high > 0 and args.slo_ms > 0
            and args.capacity >= 2.0 and args.max_replicas >= 1):
        print("phasewise experiment priorities: need --duration >= 6, positive rates and SLO, --capacity >= 2 "
              "(the jobs' steady requests), --max-replicas >= 1", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("phasewise experiment priorities: needs root (it creates cgroups and freezes them)", file=sys.stderr)
        return 2
    try:
        CgroupLayout(args.cgroup_root, prefix="phasewise-exp-probe").controller_root("freezer")
    except CgroupError as e:
        print(f"phasewise experiment priorities: {e}", file=sys.stderr)
        return 2
    opt = Options(duration_s=args.duration, slo_ms=args.slo_ms, rate_low=args.rate_low, rate_high=args.rate_high,
                  capacity_cores=args.capacity, max_replicas=args.max_replicas, grace_s=args.grace,
                  weight_ratio=args.weight_ratio, cgroup_root=args.cgroup_root)
    bar = Bar() if not args.no_progress else (lambda *a: None)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="phasewise-prio-") as tmp:
        base = args.report if args.report else Path(tmp)
        for s in scenarios:
            results[s] = run_scenario(s, opt, base / s, bar)
        if isinstance(bar, Bar):
            bar.done()
    load1 = os.getloadavg()[0]
    out = {"scenarios": {s: {k: r[k] for k in KEYS} for s, r in results.items()},
           "options": {k: getattr(opt, k) for k in ("duration_s", "slo_ms", "rate_low", "rate_high",
                                                     "capacity_cores", "max_replicas", "grace_s",
                                                     "weight_ratio")},
           "host": {"cpus": os.cpu_count(), "load1_at_end": round(load1, 2)}}
    if args.report:
        from phasewise.apps.experiment.priorities_report import write_report

        write_report(args.report, out, results)
    if args.json:
        print(json.dumps(out))
    else:
        for s, r in out["scenarios"].items():
            print(s, " ".join(f"{k}={_fmt(v)}" for k, v in r.items()))
    return 0


def _fmt(v: Any) -> str:
    return "null" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
