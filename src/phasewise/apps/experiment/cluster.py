"""``phasewise experiment cluster``: a trace-driven mix of real small jobs through every role of the product.

It starts what a user starts on one host (the embedded broker, ``produce``,
``horus``, ``place`` on cpuset slices, ``worker --targets``, ``actuate`` with the
cgroup backend and ``--start-jobs``), makes a submitter key and a cluster key for
the run, and submits with ``phasewise submit`` training jobs with loss targets,
one inference service under a stepped load and interactive sessions, at the
inter-arrival times of a real trace scaled to minutes. Every figure it prints is
computed from the topics (job events, decisions, predictions, samples); a job
that never reached an end state is listed as stuck with its last state.
docs/results.md, "Jobs through every role".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasewise.apps.experiment.cluster_plan import (
    ACCEPTABLE,
    OBJECTIVE,
    PlannedJob,
    TraceError,
    default_trace,
    plan,
    read_arrivals,
    scale_arrivals,
)
from phasewise.apps.experiment.cluster_report import (
    SLO_MS,
    Records,
    format_summary,
    is_terminal,
    job_states,
    summarize,
    write_report,
)

__all__ = ["SLO_MS", "ClusterError", "Records", "add_arguments", "is_terminal", "run", "summarize"]

#: the service's load steps: (share of its run, requests per second)
LOAD_STEPS = ((0.25, 4.0), (0.5, 8.0), (0.75, 16.0), (1.0, 8.0))


class ClusterError(RuntimeError):
    """The experiment cannot run here; ``str(e)`` says why."""


# --------------------------------------------------------------------------- the run


def check_report_dir(path: str | None) -> Path | None:
    """The report folder, refused (before any work) when it exists and is not an empty folder."""
    if path is None:
        return None
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise ClusterError(f"--report {path}: exists and is not an empty folder")
    parent = p.parent if not p.exists() else p
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise ClusterError(f"--report {path}: {parent} is not writable")
    return p


def node_slices(cpus: list[int], n: int = 2) -> str:
    """The place worker's local nodes: *cpus* cut into *n* cpuset slices.

    >>> node_slices([0, 1]), node_slices([0, 1, 2, 3, 4])
    ('s0=0;s1=1', 's0=0,1;s1=2,3,4')
    """
    n = max(1, min(n, len(cpus)))
    size = len(cpus) // n
    parts = [cpus[i * size:(i + 1) * size] if i < n - 1 else cpus[i * size:] for i in range(n)]
    return ";".join(f"s{i}=" + ",".join(map(str, p)) for i, p in enumerate(parts))


class Collector(threading.Thread):
    """Reads the topics from their start into :class:`Records` until stopped."""

    def __init__(self, settings: Any) -> None:
        super().__init__(daemon=True, name="collector")
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        from phasewise.kit.kafka.client import make_consumer
        from phasewise.kit.records import (
            Actuation,
            DeadLetter,
            Decision,
            HostSamples,
            JobEvent,
            UtilisationPrediction,
        )
        from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, DECISIONS, JOB_EVENTS, PREDICTIONS, SAMPLES

        self.kinds = {JOB_EVENTS.name: (JobEvent, "events"), DECISIONS.name: (Decision, "decisions"),
                      PREDICTIONS.name: (UtilisationPrediction, "predictions"), SAMPLES.name: (HostSamples, "samples"),
                      ACTUATIONS.name: (Actuation, "actuations"), DEAD_LETTERS.name: (DeadLetter, "dead_letters")}
        topics = (JOB_EVENTS, DECISIONS, PREDICTIONS, SAMPLES, ACTUATIONS, DEAD_LETTERS)
        # the run's record, not one of its hops: an idle fetch every 200 ms is enough
        self.consumer = make_consumer(settings, f"phasewise-cluster-{uuid.uuid4().hex[:8]}",
                                      **{"fetch.wait.max.ms": 200})
        self.consumer.assign([TopicPartition(t.name, p, OFFSET_BEGINNING) for t in topics
                              for p in range(t.partitions)])
        self.records = Records()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.undecodable = 0

    def run(self) -> None:
        from phasewise.kit.records import SchemaError, decode

        while not self.stop.is_set():
            for m in self.consumer.consume(500, 0.2):
                if m.error() or m.value() is None:
                    continue
                cls, attr = self.kinds[m.topic()]
                try:
                    r = decode(cls, m.value())
                except SchemaError:
                    self.undecodable += 1
                    continue
                with self.lock:
                    getattr(self.records, attr).append(r)
        self.consumer.close()

    def snapshot(self) -> Records:
        with self.lock:
            r = self.records
            return Records(list(r.events), list(r.decisions), list(r.predictions), list(r.samples),
                           list(r.actuations), list(r.dead_letters))


@dataclass
class Config:
    jobs: int
    seed: int
    trace: Path
    span_s: float
    train_s: float
    service_s: float
    interactive_s: float
    timeout_s: float | None
    report: Path | None
    json: bool
    cgroup_prefix: str
    keep: bool
    job_python: str | None = None
    priorities: bool = True
    targets: bool = True
    host: str = "cluster"
    #: the worker's further flags (e.g. ``--autoscale`` and its settings)
    worker_flags: tuple[str, ...] = ()
    #: the worker's further settings (``PHASEWISE_*`` variables)
    worker_env: tuple[tuple[str, str], ...] = ()
    #: the place worker's local nodes: this host's CPUs cut into this many cpuset slices
    slices: int = 2


class Cluster:
    """One run: the roles, the submissions, the service's load, the leak probe; ``close`` undoes it all."""

    def __init__(self, cfg: Config, jobs: list[PlannedJob]) -> None:
        self.cfg, self.jobs = cfg, jobs
        self.stack = contextlib.ExitStack()
        self.run_dir = Path(tempfile.mkdtemp(prefix="phasewise-cluster-"))
        os.chmod(self.run_dir, 0o755)  # the jobs (job_user) read their folder below
        self.roles: dict[str, Any] = {}
        self.collector: Collector | None = None
        self.ports: dict[str, int] = {}
        self.t0 = time.time()
        self.load_result: Any = None
        self.problems: list[str] = []

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        from phasewise.kit.broker import EmbeddedBroker, free_port
        from phasewise.kit.job_signing import write_key_pair
        from phasewise.kit.kafka.client import ensure_topics
        from phasewise.kit.settings import Settings

        cfg = self.cfg
        if os.geteuid() != 0:
            raise ClusterError("experiment cluster starts jobs in cgroups as job_user: run it as root")
        if not Path("/sys/fs/cgroup/cpuset").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
            raise ClusterError("no cgroup hierarchy at /sys/fs/cgroup")
        self._job_interpreter()
        broker = EmbeddedBroker(log_path=self.run_dir / "broker.log")
        broker.start()
        self.stack.callback(broker.stop)
        self.bootstrap = broker.bootstrap
        self.settings = Settings.from_env({"bootstrap": broker.bootstrap, "host": cfg.host}, env={})
        ensure_topics(self.settings)
        self.collector = Collector(self.settings)
        self.collector.start()
        self.stack.callback(self._stop_collector)

        # this run's keys: the submitter's (Ed25519) and the cluster's (HMAC), in a folder only root enters
        keys = Path(tempfile.mkdtemp(prefix="phasewise-cluster-keys-"))
        self.stack.callback(shutil.rmtree, keys, True)
        self.submitter_key = keys / "submitter"
        write_key_pair(str(self.submitter_key))
        trusted = keys / "trusted"
        trusted.mkdir(mode=0o755)
        shutil.copy(f"{self.submitter_key}.pub", trusted / "submitter.pub")
        import base64

        cluster_key = keys / "cluster.key"
        fd = os.open(cluster_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(base64.b64encode(os.urandom(48)))

        self.ckpt = self.run_dir / "checkpoints"
        self.ckpt.mkdir()
        os.chmod(self.ckpt, 0o1777)
        self.env = {
            "PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_HOST": cfg.host,
            "PHASEWISE_SIGNING_KEY_FILE": str(cluster_key), "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(trusted),
            "PHASEWISE_CGROUP_PREFIX": cfg.cgroup_prefix, "PHASEWISE_INTERVAL_S": "1",
            "PHASEWISE_LOG_LEVEL": "info",
        }
        nodes = node_slices(sorted(os.sched_getaffinity(0)), cfg.slices)
        self.nodes = [n.split("=")[0] for n in nodes.split(";")]
        self.node_cpus = {n.split("=")[0]: len(n.split("=")[1].split(",")) for n in nodes.split(";")}
        job_env = ";".join(["PATH=/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1",
                            "PYTHONDONTWRITEBYTECODE=1", f"PHASEWISE_DATA_DIR={self.run_dir / 'job-state'}",
                            # the jobs run this installation's programs
                            f"PYTHONPATH={self.job_pythonpath}"])
        roles = {
            "produce": (["--interval", "1"], {}),
            "horus": ([], {"PHASEWISE_HORUS_WARMUP_S": "3", "PHASEWISE_HORUS_OBSERVE_S": "10",
                           "PHASEWISE_HORUS_MIN_SAMPLES": "3"}),
            "place": (["--local-nodes", nodes, "--prediction-wait", "5",
                       *(["--place-after-admission"] if cfg.priorities else [])], {}),
            "worker": ([*(["--targets"] if cfg.targets else []),
                        *(["--priorities", "--priority-launcher", "place"] if cfg.priorities else []),
                        *cfg.worker_flags],
                       {"PHASEWISE_TARGETS_GRACE_S": "10",
                        "PHASEWISE_PRIORITY_HOST_CPU_CORES": str(len(os.sched_getaffinity(0))),
                        "PHASEWISE_PRIORITY_GRACE_S": "10", **dict(cfg.worker_env)}),
            "actuate": (["--backend", "cgroup", "--start-jobs"], {"PHASEWISE_JOB_ENV": job_env}),
        }
        from phasewise.kit.procs import RoleProcess

        self.stack.callback(self._stop_roles)
        for role, (args, extra) in roles.items():
            port = free_port()
            self.ports[role] = port
            r = RoleProcess(role, args, env={**self.env, **extra, "PHASEWISE_METRICS_PORT": str(port),
                                             "PHASEWISE_DATA_DIR": str(self.run_dir / role)},
                            log_path=self.run_dir / f"{role}.log", python_flags=("-W", "ignore"))
            self.roles[role] = r.start()
        self.stack.callback(self._remove_cgroups)
        self._wait_ready()

    def _job_interpreter(self) -> None:
        """The interpreter and module path the jobs run with, as the actuator's job_user.

        This interpreter where job_user may run it; else the same Python version's system interpreter
        with this installation's packages on ``PYTHONPATH`` (an interpreter under a private home, as
        pyenv's, is out of job_user's reach). :class:`ClusterError` where neither imports the trainer.
        """
        import site
        import subprocess

        import phasewise
        from phasewise.kit.settings import Settings

        user = Settings.from_env({}).actuator.job_user
        paths = [*(os.environ.get("PYTHONPATH") or "").split(":"),
                 str(Path(phasewise.__file__).resolve().parents[1]), *site.getsitepackages()]
        self.job_pythonpath = ":".join(p for p in dict.fromkeys(paths) if p)
        v = sys.version_info
        candidates = [self.cfg.job_python] if self.cfg.job_python else [
            sys.executable, f"/usr/bin/python{v.major}.{v.minor}", f"/usr/local/bin/python{v.major}.{v.minor}"]
        why = ""
        for py in candidates:
            try:
                r = subprocess.run([py, "-c", "import torch, phasewise.apps.experiment.trainer"], user=user,
                                   env={"PATH": "/usr/bin:/bin", "PYTHONPATH": self.job_pythonpath}, cwd="/",
                                   capture_output=True, text=True, timeout=300)
                if r.returncode == 0:
                    self.job_python = py
                    return
                why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            except (OSError, subprocess.SubprocessError) as e:
                why = str(e)
        raise ClusterError(f"the jobs run as job_user {user!r}, who cannot run {' or '.join(candidates)} with "
                           f"phasewise and torch: {why} (--job-python names another interpreter)")

    def _wait_ready(self, stall_s: float = 90.0, tries: int = 5) -> None:
        """Until the Faust roles say ready; one that stalls is restarted, as a supervisor would (a Faust
        worker sometimes never joins its group on a loaded machine)."""
        from phasewise.apps.bench.harness import scrape

        gauges = {"worker": "phasewise_worker_ready", "horus": "phasewise_horus_ready",
                  "place": "phasewise_place_ready"}
        since = dict.fromkeys(gauges, time.monotonic())
        restarts = dict.fromkeys(gauges, 0)
        waiting = dict(gauges)
        while waiting:
            self.check_roles()
            for role, g in list(waiting.items()):
                with contextlib.suppress(OSError):
                    if scrape(f"http://127.0.0.1:{self.ports[role]}/metrics").get(g) == 1.0:
                        del waiting[role]
                        continue
                if time.monotonic() - since[role] > stall_s:
                    if restarts[role] + 1 >= tries:
                        raise ClusterError(f"phasewise {role} not ready after {tries} starts of {stall_s:.0f} s; "
                                           f"logs in {self.run_dir}")
                    restarts[role] += 1
                    print(f"experiment cluster: phasewise {role} not ready within {stall_s:.0f} s: restarting it",
                          file=sys.stderr)
                    r = self.roles[role]
                    r.stop()
                    r.append = True
                    r.start()
                    since[role] = time.monotonic()
            time.sleep(0.5)

    def check_roles(self) -> None:
        for role, r in self.roles.items():
            if not r.alive():
                raise ClusterError(f"phasewise {role} exited with {r.returncode()}:\n{r.log_tail(20)}")

    # ---------------------------------------------------------------- jobs

    def command(self, j: PlannedJob) -> list[str]:
        py = self.job_python
        if j.kind == "train":
            prog = ["-m", "phasewise.apps.experiment.trainer", j.job, "--checkpoint-dir", str(self.ckpt),
                    "--seconds", str(j.seconds), "--hidden", str(j.hidden), "--seed", str(j.seed)]
        elif j.kind == "service":
            from phasewise.kit.broker import free_port

            self.service_port = free_port()
            prog = ["-m", "phasewise.apps.experiment.cluster_jobs", "service", j.job, "--port",
                    str(self.service_port), "--seconds", str(j.seconds)]
        else:
            prog = ["-m", "phasewise.apps.experiment.cluster_jobs", "interactive", j.job, "--seconds",
                    str(j.seconds), "--seed", str(j.seed)]
        return [py, "-m", "phasewise.cli", "progress", "--bootstrap", self.bootstrap, "--job", j.job, "--",
                py, "-W", "ignore", *prog]

    def job_file(self, j: PlannedJob, command: list[str]) -> Path:
        spec: dict[str, Any] = {
            "job": j.job, "workload": j.workload, "priority": j.priority, "model": j.model, "dataset": "vectors",
            "batch_size": 64 if j.kind == "train" else 8,
            "requests": {"cpu_cores": j.cpu, "mem_bytes": j.mem_bytes}, "command": command,
            "expected_s": j.seconds,
        }
        if j.kind == "train":
            spec["targets"] = {"metric": "loss", "direction": "min", "acceptable": ACCEPTABLE,
                               "objective": OBJECTIVE}
        path = self.run_dir / "submitted" / f"{j.job}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(spec, indent=1))
        return path

    def submit(self, j: PlannedJob) -> None:
        from phasewise.kit.procs import RoleProcess

        path = self.job_file(j, self.command(j))
        p = RoleProcess("submit", ["--key", str(self.submitter_key), str(path)], env=self.env,
                        log_path=self.run_dir / "submitted" / f"{j.job}.log", python_flags=("-W", "ignore")).start()
        self.submits.append((j.job, p))

    def _service_load(self, j: PlannedJob) -> None:
        from phasewise.apps.experiment.inference import Load, scrape

        while scrape(self.service_port) is None:  # until it serves (it loads torch first), or the run ends
            if self.stopping.is_set():
                return
            time.sleep(0.5)
        left = max(1.0, j.seconds - 1.0)  # it serves j.seconds from then on

        def rate(t: float) -> float:
            return next((r for share, r in LOAD_STEPS if t < share * left), LOAD_STEPS[-1][1])

        load = Load(lambda: [self.service_port], rate, workers=16, timeout_s=2.0, seed=self.cfg.seed)
        self.load = load
        self.load_result = load.run(left)

    def drive(self, progress: Any) -> None:
        """Submit the jobs at their arrival times, load the service, until every job ends or the deadline."""
        self.submits: list[tuple[str, Any]] = []
        self.stopping = threading.Event()
        assert self.collector is not None
        t_start = time.monotonic()
        pending = list(self.jobs)
        last_arrival = max(j.arrival_s for j in self.jobs)
        # (default: the last arrival, then every job's run one after another, and three minutes more)
        timeout = self.cfg.timeout_s or (last_arrival + sum(j.seconds for j in self.jobs) + 180)
        load_thread: threading.Thread | None = None
        svc = next((j for j in self.jobs if j.kind == "service"), None)
        while True:
            now = time.monotonic() - t_start
            while pending and pending[0].arrival_s <= now:
                self.submit(pending.pop(0))
            for job, p in self.submits:
                rc = p.returncode()
                if rc not in (None, 0) and job not in self.problems:
                    self.problems.append(job)
                    progress.note(f"submit of {job} failed ({rc}): {p.log_tail(3)}")
            self.check_roles()
            rec = self.collector.snapshot()
            states = job_states(rec.events)
            if svc is not None and load_thread is None and any(e.kind == "started" for e in states.get(svc.job, [])):
                load_thread = threading.Thread(target=self._service_load, args=(svc,), daemon=True)
                load_thread.start()
            done = sum(1 for j in self.jobs if is_terminal(states.get(j.job, [])))
            running = sum(1 for j in self.jobs if not is_terminal(states.get(j.job, []))
                          and any(e.kind == "started" for e in states.get(j.job, [])))
            progress.update(done, running, len(self.jobs) - len(pending), len(self.jobs), now)
            if not pending and done == len(self.jobs):
                break
            if now > timeout:
                progress.note(f"deadline of {timeout:.0f} s reached with {len(self.jobs) - done} jobs not ended")
                break
            time.sleep(0.5)
        self.stopping.set()
        if load_thread is not None:
            if getattr(self, "load", None) is not None:
                self.load.stop.set()
            load_thread.join(10)

    def probe_leaks(self, timeout_s: float = 60.0) -> tuple[int | None, str]:
        """Submit one job per node asking for the node's every core; each not placed in time is a node whose
        capacity was not all returned (a lower bound on the leaked bookings)."""
        assert self.collector is not None
        tag = uuid.uuid4().hex[:4]
        probes = []
        for node in self.nodes:
            j = PlannedJob(f"probe-{node}-{tag}", "probe", 0.0, 0, float(self.node_cpus[node]), 2**20, 10.0)
            path = self.run_dir / "submitted" / f"{j.job}.json"
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps({"job": j.job, "model": "mlp-64x64x8-relu", "dataset": "vectors",
                                        "batch_size": 1, "expected_s": 10,
                                        "requests": {"cpu_cores": j.cpu, "mem_bytes": j.mem_bytes},
                                        "command": ["/bin/sleep", "10"]}))
            from phasewise.kit.procs import RoleProcess

            RoleProcess("submit", ["--key", str(self.submitter_key), str(path)], env=self.env,
                        log_path=path.with_suffix(".log"), python_flags=("-W", "ignore")).start()
            probes.append(j.job)
        deadline = time.monotonic() + timeout_s
        placed: set[str] = set()
        while time.monotonic() < deadline and len(placed) < len(probes):
            rec = self.collector.snapshot()
            placed = {d.container for d in rec.decisions if d.action == "place" and d.container in probes}
            time.sleep(0.5)
        leaked = len(probes) - len(placed)
        return leaked, (f"{len(placed)} of {len(probes)} whole-node probe jobs placed within {timeout_s:.0f} s "
                        f"after the run")

    # ---------------------------------------------------------------- stop

    def _stop_collector(self) -> None:
        if self.collector is not None:
            self.collector.stop.set()
            self.collector.join(10)

    def _stop_roles(self) -> None:
        for r in self.roles.values():
            r.stop()

    def _remove_cgroups(self) -> None:
        from phasewise.kit.cgroups.fs import CgroupLayout

        with contextlib.suppress(Exception):
            layout = CgroupLayout("/sys/fs/cgroup", prefix=self.cfg.cgroup_prefix)
            for c in layout.containers():  # (a job the priority agent froze takes SIGKILL only once thawed)
                state = (layout.controller_root("freezer") / layout.prefix / c / "freezer.state" if layout.version == 1
                         else layout.path(c) / "cgroup.freeze")
                with contextlib.suppress(OSError):
                    state.write_text("THAWED" if layout.version == 1 else "0")
                for pid in layout.pids(c):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                deadline = time.monotonic() + 5
                while layout.pids(c) and time.monotonic() < deadline:
                    time.sleep(0.05)
                with contextlib.suppress(Exception):
                    layout.remove(c)
            roots = ([layout.root / layout.prefix] if layout.version == 2
                     else [layout.controller_root(c) / layout.prefix for c in (*layout.controllers(), "cpuset")])
            for base in roots:
                for d in sorted(base.glob("**/"), reverse=True) if base.exists() else []:
                    with contextlib.suppress(OSError):
                        d.rmdir()

    def close(self) -> None:
        self.stack.close()
        if not self.cfg.keep:
            shutil.rmtree(self.run_dir, ignore_errors=True)


class Progress:
    """One status line on a terminal (stderr), nothing otherwise; notes always go to stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.width = 0

    def update(self, done: int, running: int, submitted: int, total: int, t: float) -> None:
        if not self.enabled:
            return
        bar = int(30 * done / max(total, 1))
        line = (f"\r[{'#' * bar}{'.' * (30 - bar)}] {done}/{total} ended, {running} running, "
                f"{submitted - done - running} waiting, {total - submitted} to arrive, {t:.0f} s")
        self.width = max(self.width, len(line))
        sys.stderr.write(line.ljust(self.width))
        sys.stderr.flush()

    def note(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write("\n")
        print(f"experiment cluster: {text}", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=30, help="jobs to submit (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, default=None,
                   help="a Pollux workload CSV whose arrival times shape the run's (default: "
                        "../shared/data/pollux-traces/workloads/workload-1.csv)")
    p.add_argument("--span", type=float, default=None, metavar="SECONDS",
                   help="the arrivals' span after scaling (default 8 s per job)")
    p.add_argument("--train-seconds", type=float, default=40.0, help="a training job's longest run (default 40)")
    p.add_argument("--service-seconds", type=float, default=None,
                   help="the inference service's run (default: the arrivals' span, at least 40 s)")
    p.add_argument("--interactive-seconds", type=float, default=15.0)
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="give up on jobs not ended this long after the start (default: from the plan)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--report", metavar="DIR", help="write a timeline plot per job and the summary here "
                                                   "(a new or empty folder)")
    p.add_argument("--cgroup-prefix", default=None, help="cgroup folder of the run's jobs (default: a new one)")
    p.add_argument("--keep", action="store_true", help="keep the run's folder (role logs, job files)")
    p.add_argument("--no-priorities", dest="priorities", action="store_false",
                   help="no priority agent: place admits every job itself (default: worker --priorities decides "
                        "when, with checkpoint-and-stop, freeze and CPU weights; place decides where)")
    p.add_argument("--job-python", metavar="PATH", help="the interpreter the jobs run with as job_user (default: "
                                                        "this one, else this Python version's in /usr/bin)")


def run(args: argparse.Namespace) -> int:
    prog = "phasewise experiment cluster"
    try:
        report = check_report_dir(args.report)
        if args.jobs < 1:
            raise ClusterError("--jobs must be at least 1")
        trace = args.trace or default_trace()
        span = args.span if args.span is not None else 8.0 * args.jobs
        arrivals = scale_arrivals(read_arrivals(trace), args.jobs, span)
    except (ClusterError, TraceError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    tag = uuid.uuid4().hex[:4]
    service_s = args.service_seconds or max(40.0, span)
    jobs = plan(args.jobs, arrivals=arrivals, seed=args.seed, train_s=args.train_seconds, service_s=service_s,
                interactive_s=args.interactive_seconds, tag=f"{tag}-")
    cfg = Config(jobs=args.jobs, seed=args.seed, trace=trace, span_s=span, train_s=args.train_seconds,
                 service_s=service_s, interactive_s=args.interactive_seconds, timeout_s=args.timeout, report=report,
                 json=args.json, cgroup_prefix=args.cgroup_prefix or f"pwcluster-{tag}", keep=args.keep,
                 job_python=args.job_python, priorities=args.priorities)
    progress = Progress(sys.stderr.isatty() and not args.json)
    c = Cluster(cfg, jobs)
    t0 = time.monotonic()
    try:
        c.start()
        c.drive(progress)
        progress.end()
        leaked, probe = c.probe_leaks()
        assert c.collector is not None
        time.sleep(2)  # the last records of the probes' decisions and the jobs' ends
        rec = c.collector.snapshot()
    except ClusterError as e:
        progress.end()
        c.cfg.keep = True  # (the role logs say why)
        c.close()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.end()
        c.close()
        return 130
    name = trace.name if trace == default_trace() else str(trace)
    summary = summarize(jobs, rec, leaked=leaked, probe=probe, wall_s=time.monotonic() - t0,
                        trace=f"pollux {name}" if trace == default_trace() else name, span_s=span)
    if c.load_result is not None:
        lr = c.load_result
        summary["service_requests"] = {"sent": lr.sent, "answered": len(lr.latencies_ms), "failed": lr.failed,
                                       "shed": lr.shed, "client_over_slo": lr.violations(SLO_MS)}
    if report is not None:
        write_report(report, jobs, rec, summary, c.t0)
    if cfg.keep:
        summary["run_dir"] = str(c.run_dir)
    c.close()
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0
