"""``phasewise demo``: the whole closed loop on this machine, with real training jobs.

It starts a broker, a cgroup per job, the three roles and the jobs, shows
the live view until Ctrl-C, SIGTERM or ``--duration``, restarts a job that
dies, and on exit removes everything and checks that nothing is left. Needs
root. The summary is :func:`phasewise.apps.demo.summary.summarize`'s.
docs/operations.md, "The demo" and "The demo summary".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from phasewise.apps.demo.cgroups import (
    DEFAULT_PREFIX,
    NEED_ROOT,
    DemoError,
    _end_processes,
    check_cgroups,
    clear_stale,
    local_nodes,
    owned_dirs,
    read_limits,
    set_limits,
)
from phasewise.apps.demo.jobs import DEFAULT_JOBS, JOBS, parse_progress
from phasewise.apps.demo.summary import CgroupPoint, Records, format_summary, summarize, view_state
from phasewise.apps.demo.view import LiveView, ViewState
from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.procs import ManagedProcess, RoleProcess
from phasewise.kit.records import (
    Actuation,
    Decision,
    HostSamples,
    JobEvent,
    PhaseChange,
    SchemaError,
    decode,
)

__all__ = ["Demo", "DemoError", "add_arguments", "run"]

log = logging.getLogger(__name__)

#: what ``--submit`` submits (a source checkout's example job)
EXAMPLE_JOB = Path(__file__).resolve().parents[4] / "examples" / "jobs" / "train-small.json"
#: the wrapper that puts itself into the job's cgroup(s), then becomes the job
ATTACH_SH = 'pid=$$; while [ "$1" != "--" ]; do echo "$pid" > "$1" || exit 97; shift; done; shift; exec "$@"'


# --------------------------------------------------------------------------- processes


class JobProcess(ManagedProcess):
    """A training job started inside its cgroup; its progress read from its log."""

    def __init__(self, name: str, layout: CgroupLayout, *, env: dict[str, str], log_path: Path,
                 checkpoint_dir: Path, threads: int = 1) -> None:
        procs = ([layout.path(name) / "cgroup.procs"] if layout.version == 2
                 else [layout.path(name, c) / "cgroup.procs" for c in layout.controllers()])
        cmd = ["/bin/sh", "-c", ATTACH_SH, "sh", *map(str, procs), "--",
               sys.executable, "-W", "ignore", "-m", "phasewise.apps.demo.jobs", name, "--threads", str(threads),
               "--checkpoint-dir", str(checkpoint_dir)]
        super().__init__(name, cmd, env=env, log_path=log_path, append=True)
        self.layout = layout
        self._offset = 0

    def start(self, timeout_s: float = 5.0) -> JobProcess:
        super().start()
        deadline = time.monotonic() + timeout_s
        while self.pid not in self.layout.pids(self.name):
            rc = self.returncode()
            if rc is not None:
                raise DemoError(f"job {self.name} exited with {rc} before joining its cgroup "
                                f"(97 = could not write cgroup.procs):\n{self.log_tail(20)}")
            if time.monotonic() > deadline:
                raise DemoError(f"job {self.name} (pid {self.pid}) did not appear in its cgroup")
            time.sleep(0.01)
        return self

    def read_progress(self) -> list[dict]:
        """Progress lines written since the last call."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [d for d in map(parse_progress, data[:end].decode(errors="replace").splitlines()) if d]


# --------------------------------------------------------------------------- the demo


@dataclass
class Config:
    jobs: tuple[str, ...]
    duration_s: float | None
    json: bool
    cgroup_root: str
    cgroup_prefix: str
    interval_s: float
    recommend_interval_s: float
    vpa_time_scale: float
    start_cpu: float
    start_mem: int
    host: str
    data_dir: str
    max_restarts: int
    log_level: str
    policy: str
    #: the worker's vpa_throttle_threshold (the demo's roles read the same environment)
    throttle_threshold: float
    #: jobs submitted with ``phasewise submit`` (examples/jobs/train-small.json) that ``place`` places and the
    #: actuator starts and reports until they end; 0: none
    submit: int = 0


#: the worker's safety rules, scaled to a demo of minutes (live defaults: 900 s of history, one
#: decrease per 300 s, peaks over 3600 s): the rules are the same, only their windows are shorter
DEMO_SAFETY = {"safety_min_history_s": 30.0, "safety_cooldown_s": 15.0, "safety_max_decrease": 0.3,
               "safety_peak_window_s": 180.0}


class _Signals:
    """SIGINT/SIGTERM set a flag the loop checks, so cleanup is never interrupted."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Self:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            log.warning("already stopping; cleanup continues")
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


class Demo:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(cfg.data_dir) / f"demo-{stamp}-{os.getpid()}"
        self.records = Records(cfg.jobs)
        self.problems: list[str] = []
        self.final_limits: dict[str, tuple[float | None, float | None]] = {}
        self.layout: CgroupLayout | None = None
        self.jobs: dict[str, JobProcess] = {}
        self.roles: dict[str, ManagedProcess] = {}
        self.all_procs: list[ManagedProcess] = []
        self.job_states: dict[str, str] = {}
        self.bootstrap = ""
        self.broker_port: int | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self.error: str | None = None
        self._cg_prev: dict[str, tuple[int, int]] = {}
        #: the cgroup directories this run owns (the prefix, and its parents it created), deepest first:
        #: what cleanup removes and verifies; empty until the prefix was found free
        self.owned: list[Path] = []
        self.consumer: Any = None
        self.worker_port: int | None = None
        self.looped = False  #: the live loop ran (a demo stopped while starting has no records to wait for)
        self.signals = _Signals()
        #: the submitted jobs' states, in words (``--submit``)
        self.submitted: dict[str, str] = {}
        self.submitter_key: Path | None = None
        self.place_port: int | None = None
        self.role_env: dict[str, str] = {}

    # ---------------------------------------------------------------- lifecycle

    def run(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "jobs").mkdir(exist_ok=True)
        with self.signals, self._log_to_file():
            try:
                with contextlib.ExitStack() as stack:
                    self._start(stack)
                    self._loop()
            except DemoError as e:
                self.error = str(e)
                log.error("%s", e)
            except Exception as e:  # an unexpected bug: still clean up and report it
                self.error = f"{type(e).__name__}: {e}"
                log.exception("demo failed")
            finally:
                self.ended = time.monotonic()
                self._verify_clean()
                self._step("write records.jsonl", self.records.write_jsonl, self.run_dir / "records.jsonl")
        return self.summary()

    @contextlib.contextmanager
    def _log_to_file(self) -> Any:
        """Log to ``demo.log`` in the run directory; with the live view, *only* there
        (a line on stderr would tear the screen)."""
        root = logging.getLogger()
        handler = logging.FileHandler(self.run_dir / "demo.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        muted = [] if self.cfg.json else [h for h in root.handlers
                                          if isinstance(h, logging.StreamHandler)
                                          and not isinstance(h, logging.FileHandler)]
        for h in muted:
            root.removeHandler(h)
        try:
            yield
        finally:
            root.removeHandler(handler)
            handler.close()
            for h in muted:
                root.addHandler(h)

    def summary(self) -> dict[str, Any]:
        end = self.ended or time.monotonic()
        return summarize(self.records, duration_s=end - self.started, final_limits=self.final_limits,
                         cleanup_problems=self.problems, run_dir=str(self.run_dir), error=self.error,
                         policy=self.cfg.policy, throttle_window_s=self.cfg.recommend_interval_s,
                         throttle_threshold=self.cfg.throttle_threshold)

    def _read_cgroups(self) -> None:
        """The demo's own reading of each job's cgroup counters (throttling, limits, OOM kills)."""
        from phasewise.producers.cgroup_reader import read_container

        if self.layout is None:
            return
        now = time.time()
        for name in self.cfg.jobs:
            try:
                c = read_container(self.layout, name)
            except (OSError, CgroupError):
                c = None
            if c is None:
                continue
            prev = self._cg_prev.get(name)
            share = 0.0
            if prev is not None and c.nr_periods > prev[0]:
                share = (c.nr_throttled - prev[1]) / (c.nr_periods - prev[0])
            self._cg_prev[name] = (c.nr_periods, c.nr_throttled)
            mem_limit = None if c.mem_limit_bytes is None else float(c.mem_limit_bytes)
            self.records.cgroups[name].append(CgroupPoint(now, share, c.cpu_limit_cores, mem_limit, c.oom_kills))

    def _stop_requested(self) -> None:
        if self.signals.requested:
            raise DemoError(f"stopped by {self.signals.requested} while starting")

    def _start(self, stack: contextlib.ExitStack) -> None:
        from phasewise.kit.broker import EmbeddedBroker
        from phasewise.kit.kafka.client import ensure_topics, make_consumer
        from phasewise.kit.settings import Settings
        from phasewise.kit.topics import ACTUATIONS, DECISIONS, PHASES, SAMPLES

        cfg = self.cfg
        layout = check_cgroups(cfg.cgroup_root, cfg.cgroup_prefix)
        self.layout = layout
        for d in clear_stale(layout):
            log.info("removed stale cgroup %s", d)

        broker = EmbeddedBroker(log_path=self.run_dir / "broker.log")
        log.info("starting the embedded broker")
        broker.start()
        self.bootstrap, self.broker_port = broker.bootstrap, broker.port
        stack.callback(self._step, "stop the broker", broker.stop)
        settings = Settings.from_env({"bootstrap": broker.bootstrap, "host": cfg.host,
                                      "data_dir": str(self.run_dir)}, env={})
        ensure_topics(settings)
        self._stop_requested()

        self.owned = owned_dirs(layout)
        stack.callback(self._remove_cgroups)
        # after the roles stopped (callbacks run last first): what they published meanwhile is read
        stack.callback(self._drain)
        for name in cfg.jobs:
            layout.create(name)
            set_limits(layout, name, cfg.start_cpu, cfg.start_mem)

        env = self._role_env(settings, self._signing_key(stack))
        self.role_env = env
        stack.callback(self._stop_roles)
        roles = {
            "worker": [],
            "actuate": ["--backend", "cgroup"],
            "produce": [],
        }
        from phasewise.kit.broker import free_port

        role_env: dict[str, dict[str, str]] = {}
        if cfg.submit:  # the jobs' half: place on cpuset slices of this host, the actuator starts signed jobs
            trusted = self._submitter_key(stack)
            self.place_port = free_port()
            roles["place"] = ["--local-nodes", local_nodes(sorted(os.sched_getaffinity(0))), "--prediction-wait", "2"]
            roles["actuate"].append("--start-jobs")
            role_env["actuate"] = {"PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(trusted)}
            role_env["place"] = {"PHASEWISE_METRICS_PORT": str(self.place_port)}
        # the worker's metrics port, where `phasewise explain` reads its /scorecard/ view (the view says how)
        self.worker_port = free_port()
        role_env["worker"] = {"PHASEWISE_METRICS_PORT": str(self.worker_port)}
        for role, extra in roles.items():
            log_path = self.run_dir / f"{role}.log"
            p = RoleProcess(role, extra, env={**env, "PHASEWISE_DATA_DIR": str(self.run_dir / role),
                                              **role_env.get(role, {})},
                            log_path=log_path, python_flags=("-W", "ignore"))
            self.roles[role] = p
            self.all_procs.append(p)
            p.start()
            log.info("started phasewise %s (pid %d), log %s", role, p.pid, log_path)
        log.info("look inside: %s", "; ".join(self.hints()))

        consumer = make_consumer(settings, f"phasewise-demo-{uuid.uuid4().hex[:8]}")
        from phasewise.kit.topics import JOB_EVENTS

        consumer.subscribe([SAMPLES.name, DECISIONS.name, ACTUATIONS.name, PHASES.name, JOB_EVENTS.name])
        self.consumer = consumer
        self.topics = {SAMPLES.name: HostSamples, DECISIONS.name: Decision, ACTUATIONS.name: Actuation,
                       PHASES.name: PhaseChange, JOB_EVENTS.name: JobEvent}
        self._stop_requested()

        stack.callback(self._stop_jobs)
        job_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        for name in cfg.jobs:
            self._start_job(name, job_env)
        self.job_env = job_env

    def _signing_key(self, stack: contextlib.ExitStack) -> Path:
        """This run's signing key: a file only this user reads, in a directory only this user enters,
        removed when the demo ends (after the roles stop)."""
        import base64
        import shutil
        import tempfile

        from phasewise.kit.signing import key_id

        key_dir = Path(tempfile.mkdtemp(prefix="phasewise-demo-key-"))  # mode 0700
        stack.callback(shutil.rmtree, key_dir, True)
        key = base64.b64encode(os.urandom(48))
        path = key_dir / "cluster.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
        log.info("decisions are signed with this run's key %s (%s, removed on exit)", key_id(key), path)
        return path

    def _submitter_key(self, stack: contextlib.ExitStack) -> Path:
        """This run's submitter key pair (``--submit``), removed on exit; returns the trusted keys' folder."""
        import shutil
        import tempfile

        from phasewise.kit.job_signing import write_key_pair

        if not EXAMPLE_JOB.is_file():
            raise DemoError(f"--submit submits {EXAMPLE_JOB}, which this installation lacks (a source checkout "
                            f"has it); run with --submit 0")
        key_dir = Path(tempfile.mkdtemp(prefix="phasewise-demo-submitter-"))  # mode 0700
        stack.callback(shutil.rmtree, key_dir, True)
        self.submitter_key = key_dir / "demo"
        kid = write_key_pair(str(self.submitter_key))
        trusted = key_dir / "trusted"
        trusted.mkdir(mode=0o755)
        shutil.copy(f"{self.submitter_key}.pub", trusted / "demo.pub")
        log.info("jobs are submitted with this run's submitter key %s, which the actuator trusts", kid)
        return trusted

    def _submit_tick(self) -> None:
        """Once ``place`` is ready, submit the ``--submit`` jobs (each a ``phasewise submit``)."""
        if not self.cfg.submit or self.submitted or self.place_port is None:
            return
        from phasewise.apps.bench.harness import scrape

        try:
            if scrape(f"http://127.0.0.1:{self.place_port}/metrics").get("phasewise_place_ready") != 1.0:
                return
        except OSError:
            return
        for i in range(self.cfg.submit):
            job = f"demo-submit-{i + 1}"
            p = RoleProcess("submit", ["--key", str(self.submitter_key), "--job", job, str(EXAMPLE_JOB)],
                            env=self.role_env, log_path=self.run_dir / f"submit-{job}.log",
                            python_flags=("-W", "ignore"))
            self.all_procs.append(p)
            p.start()
            self.submitted[job] = "submitting"
            log.info("submitting %s (%s)", job, EXAMPLE_JOB)

    def _job_event(self, ev: JobEvent) -> None:
        if ev.job not in self.submitted:
            return
        text = {
            "submitted": "submitted",
            "started": f"started on {ev.host} (pid {ev.pid}, cpuset {ev.cpuset})",
            "finished": f"finished: exit {ev.exit_code} after {ev.run_s or 0:.1f} s",
            "failed": f"failed: {ev.reason or ev.exit_code}",
            "rejected": f"rejected: {ev.reason}",
            "lost": f"lost: {ev.reason}",
            "terminated": f"terminated: {ev.reason or ev.signal}",
        }.get(ev.kind)
        if text is not None:
            self.submitted[ev.job] = text
            log.info("job %s %s", ev.job, text)

    def _role_env(self, settings: Any, key_file: Path) -> dict[str, str]:
        cfg = self.cfg
        return {
            "PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap,
            "PHASEWISE_HOST": cfg.host,
            "PHASEWISE_CGROUP_ROOT": cfg.cgroup_root,
            "PHASEWISE_CGROUP_PREFIX": cfg.cgroup_prefix,
            "PHASEWISE_INTERVAL_S": str(cfg.interval_s),
            "PHASEWISE_RECOMMEND_INTERVAL_S": str(cfg.recommend_interval_s),
            "PHASEWISE_VPA_TIME_SCALE": str(cfg.vpa_time_scale),
            "PHASEWISE_SIGNING_KEY_FILE": str(key_file),
            "PHASEWISE_BACKEND": "cgroup",
            "PHASEWISE_METRICS_PORT": "0",
            "PHASEWISE_LOG_LEVEL": cfg.log_level,
            "PHASEWISE_POLICY": cfg.policy,
            **{f"PHASEWISE_{k.upper()}": repr(v) for k, v in DEMO_SAFETY.items()},
        }

    def _start_job(self, name: str, env: dict[str, str]) -> None:
        assert self.layout is not None
        ckpt = self.run_dir / "checkpoints" / name
        ckpt.mkdir(parents=True, exist_ok=True)
        j = JobProcess(name, self.layout, env=env, log_path=self.run_dir / "jobs" / f"{name}.log",
                       checkpoint_dir=ckpt)
        old = self.jobs.get(name)
        if old is not None:  # a restart keeps the log offset and the sessions to check at cleanup
            j._offset, j.sids = old._offset, old.sids
        self.jobs[name] = j
        self.all_procs = [p for p in self.all_procs if p is not old] + [j]
        j.start()
        self.job_states[name] = "running"
        log.info("started job %s (pid %d) in its cgroup", name, j.pid)

    # ---------------------------------------------------------------- running

    def _loop(self) -> None:
        self.looped = True
        cfg = self.cfg
        deadline = None if cfg.duration_s is None else self.started + cfg.duration_s
        view = None if cfg.json else LiveView()
        next_tick = 0.0
        restart_at: dict[str, float] = {}
        with view or contextlib.nullcontext():
            while not self.signals.requested and (deadline is None or time.monotonic() < deadline):
                for m in self.consumer.consume(num_messages=200, timeout=0.2):
                    self._handle(m)
                now = time.monotonic()
                if now < next_tick:
                    continue
                next_tick = now + cfg.interval_s
                self._read_cgroups()
                self._submit_tick()
                for role, p in self.roles.items():
                    if not p.alive():
                        raise DemoError(f"phasewise {role} exited with {p.returncode()}; "
                                        f"last lines of {p.log_path}:\n{p.log_tail(20)}")
                for name, j in self.jobs.items():
                    for line in j.read_progress():
                        self.records.progress[name].update(line)
                    rc = j.returncode()
                    if rc is None or name in restart_at:
                        continue
                    prog = self.records.progress[name]
                    prog.exits.append(rc)
                    why = "killed (SIGKILL: OOM?)" if rc == -signal.SIGKILL else f"exited {rc}"
                    if prog.restarts < cfg.max_restarts:
                        self.job_states[name] = f"{why}; restarting"
                        restart_at[name] = now + 2.0
                    else:
                        self.job_states[name] = why
                    log.warning("job %s %s", name, why)
                for name, at in list(restart_at.items()):
                    if now >= at:
                        del restart_at[name]
                        self.jobs[name].stop(1)
                        self.records.progress[name].restarts += 1
                        self._start_job(name, self.job_env)
                if view is not None:
                    view.draw(self._view_state(), force=True)
        if self.signals.requested:
            log.info("stopping (%s)", self.signals.requested)

    def _view_state(self) -> ViewState:
        roles = {r: ("up" if p.alive() else f"exited {p.returncode()}") for r, p in self.roles.items()}
        notes = [f"submitted job {j}: {s}" for j, s in self.submitted.items()]
        if self.cfg.submit and not self.submitted:
            notes.append(f"{self.cfg.submit} jobs to submit once phasewise place is ready")
        return view_state(self.records, elapsed_s=time.monotonic() - self.started, job_states=self.job_states,
                          host=self.cfg.host, bootstrap=self.bootstrap, run_dir=str(self.run_dir),
                          roles=roles, duration_s=self.cfg.duration_s, notes=[*self.hints(), *notes])

    def hints(self) -> list[str]:
        """The commands that look inside this running demo, from another terminal."""
        cfg = self.cfg
        root = "" if cfg.cgroup_root == "/sys/fs/cgroup" else f" --cgroup-root {cfg.cgroup_root}"
        out = []
        if self.worker_port is not None:
            out.append(f"why a limit: phasewise explain --worker http://127.0.0.1:{self.worker_port} {cfg.jobs[0]}")
        out.append(f"what the host agent sees: phasewise produce --once --json --cgroup-prefix {cfg.cgroup_prefix}"
                   + root)
        return out

    def _handle(self, m: Any) -> None:
        if m.error():
            log.debug("consumer: %s", m.error())
            return
        cls = self.topics.get(m.topic())
        if cls is None:
            return
        try:
            rec = decode(cls, m.value())
        except SchemaError as e:  # the worker dead-letters bad input; the demo only watches
            log.warning("ignoring a malformed %s message: %s", m.topic(), e)
            return
        if cls is JobEvent:
            self._job_event(rec)
            return
        if cls is Decision and rec.action == "place" and self.submitted.get(rec.container) in ("submitting",
                                                                                             "submitted"):
            self.submitted[rec.container] = f"placed: {rec.reason}"
        if cls is Decision:  # every decision and actuation on this run's broker, a place decision's host a slice
            self.records.add_decision(rec)
        elif cls is Actuation:
            self.records.add_actuation(rec)
        elif rec.host != self.cfg.host:
            return
        elif cls is HostSamples:
            self.records.add_samples(rec)
        else:
            self.records.add_phase_change(rec)

    # ---------------------------------------------------------------- cleanup

    def _step(self, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - every cleanup step runs whatever failed before
            self.problems.append(f"could not {what}: {e}")
            log.error("could not %s: %s", what, e)

    def _stop_jobs(self) -> None:
        for j in self.jobs.values():
            j.terminate()
        for name, j in self.jobs.items():
            self._step(f"stop job {name}", j.stop, 15.0)
            for line in j.read_progress():
                self.records.progress[name].update(line)

    def _stop_roles(self) -> None:
        # the producer first (no new samples), then the actuator and the worker together
        order = [["produce"], ["actuate", "worker", "place"]]
        for group in order:
            procs = [self.roles[r] for r in group if r in self.roles]
            for p in procs:
                p.terminate()
            for p in procs:
                self._step(f"stop phasewise {p.name}", p.stop, 20.0)

    def _remove_cgroups(self) -> None:
        layout = self.layout
        if layout is None:
            return
        self._read_cgroups()  # the last reading of the kernel's counters, before the cgroups go
        for name in self.cfg.jobs:
            if not layout.exists(name):
                continue
            try:
                self.final_limits[name] = read_limits(layout, name)
            except (OSError, CgroupError) as e:
                log.warning("could not read the final limits of %s: %s", name, e)
            self._step(f"remove the cgroup of {name}", layout.remove, name, 10.0)
        for name in layout.containers():  # the submitted jobs' cgroups, made by this run's actuator
            if name not in self.cfg.jobs:
                self._step(f"stop the submitted job {name}", _end_processes, layout, name)
                self._step(f"remove the cgroup of {name}", layout.remove, name, 10.0)
        for d in self.owned:  # deepest first; below the prefix, what this run's actuator made (cpuset slices)
            if d.is_dir():
                for sub in sorted((p for p in d.rglob("*") if p.is_dir()), reverse=True):
                    self._step(f"remove {sub}", sub.rmdir)
                self._step(f"remove {d}", d.rmdir)
        ckpt = self.run_dir / "checkpoints"
        if ckpt.is_dir():
            import shutil

            self._step("remove the checkpoints", shutil.rmtree, ckpt)

    def _drain(self, timeout_s: float = 30.0) -> None:
        """Read the topics to the end and close the consumer, once the roles stopped: the decisions and
        actuations they published while stopping belong in the summary and ``records.jsonl``."""
        c, self.consumer = self.consumer, None
        if c is None:
            return
        try:
            deadline = time.monotonic() + timeout_s
            while self.looped and not c.assignment():  # a short run can end before its consumer joined
                for m in c.consume(num_messages=500, timeout=0.2):
                    self._handle(m)
                if time.monotonic() > deadline:
                    raise DemoError(f"the demo's consumer was given no partitions within {timeout_s:g} s")
            parts = c.assignment()
            ends = {}
            for tp in parts:
                lo, hi = c.get_watermark_offsets(tp, timeout=5.0)
                if hi > lo:
                    ends[(tp.topic, tp.partition)] = hi
            while ends:
                for m in c.consume(num_messages=500, timeout=0.2):
                    self._handle(m)
                for tp in c.position(parts):
                    if ends.get((tp.topic, tp.partition), 0) <= tp.offset:
                        ends.pop((tp.topic, tp.partition), None)
                if ends and time.monotonic() > deadline:
                    left = ", ".join(f"{t}[{p}] up to {o}" for (t, p), o in sorted(ends.items()))
                    raise DemoError(f"not all records read within {timeout_s:g} s: {left}")
        except Exception as e:  # noqa: BLE001 - nothing is left behind by it: said, not a cleanup failure
            log.warning("the summary and records.jsonl may miss the last records: %s", e)
        finally:
            c.close()

    def _verify_clean(self) -> None:
        for p in self.all_procs:
            left = p.leftovers()
            if left:
                self.problems.append(f"{p.name}: processes {left} still running")
        for d in self.owned:  # only what this run made: another demo's cgroups are not ours to report
            if d.exists():
                self.problems.append(f"cgroup directory {d} still exists")
        if self.broker_port is not None:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", self.broker_port)) == 0:
                    self.problems.append(f"something still listens on the broker port {self.broker_port}")


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import add_setting, arg_type
    from phasewise.kit.records import WORKLOAD_POLICIES
    from phasewise.kit.settings import SPECS, above, at_least, parse_float, parse_int, parse_size

    def like(name: str) -> object:  # a demo flag that becomes the roles' setting *name*
        return arg_type(SPECS[name].parse, SPECS[name].validate, name=SPECS[name].kind)

    def default(name: str) -> object:  # ... and where the demo keeps the roles' default
        return SPECS[name].default

    p.add_argument("--duration", type=arg_type(parse_float, above(0)), metavar="SECONDS",
                   help="stop after this many seconds (default: run until Ctrl-C)")
    p.add_argument("--json", action="store_true",
                   help="no live view; print the summary as one JSON object on stdout")
    p.add_argument("--cgroup-root", default=default("cgroup_root"), type=like("cgroup_root"),
                   help="cgroup mount (v1 hierarchies or v2)")
    p.add_argument("--cgroup-prefix", default=DEFAULT_PREFIX, type=like("cgroup_prefix"),
                   help="parent cgroup of the jobs")
    p.add_argument("--interval", type=like("interval_s"), default=default("interval_s"),
                   help="sampling interval, seconds")
    p.add_argument("--jobs", nargs="+", choices=JOBS, default=list(DEFAULT_JOBS), metavar="JOB",
                   help=f"training jobs to run (default: {' '.join(DEFAULT_JOBS)})")
    p.add_argument("--policy", choices=WORKLOAD_POLICIES, default="phase",
                   help="the worker's limit policy: phase (CRBM phases, VPA as the fallback; default) or vpa")
    p.add_argument("--recommend-interval", type=like("recommend_interval_s"),
                   default=default("recommend_interval_s"),
                   help="worker: seconds between recommendations per container "
                        "(default %(default)s)")
    p.add_argument("--vpa-time-scale", type=like("vpa_time_scale"), default=0.001,
                   help="worker: VPA durations x this (demo default 0.001: a VPA day lasts 86 s)")
    p.add_argument("--start-cpu", type=arg_type(parse_float, above(0)), default=0.5,
                   help="starting CPU limit per job, cores (below a job's ~1 core of demand, so the loop "
                        "raises it early)")
    p.add_argument("--start-mem", type=arg_type(parse_size, above(0), name="size"), default=2**30,  # 1 GiB
                   help="starting memory limit per job (a size: bytes, 512Mi, 1Gi; 1G = 10**9; default 1Gi)")
    p.add_argument("--max-restarts", type=arg_type(parse_int, at_least(0)), default=3,
                   help="restarts per job that dies")
    p.add_argument("--submit", type=arg_type(parse_int, at_least(0)), default=3, metavar="N",
                   help="also submit N jobs (examples/jobs/train-small.json) with this run's submitter key: "
                        "phasewise place places them on cpuset slices, the actuator starts and reports them until "
                        "they finish, the live view shows their states (default 3; 0: none)")
    add_setting(p, "host", help="host name on the wire")
    add_setting(p, "data_dir", help="where the run directory goes")
    add_setting(p, "log_level", help="log level of the demo and its roles; with the live view the demo logs only "
                                     "to demo.log in the run directory")


def run(args: argparse.Namespace) -> int:
    from phasewise.kit.settings import Settings

    base = Settings.from_env({"host": args.host, "data_dir": args.data_dir})
    level = args.log_level or "info"
    logging.getLogger().setLevel(getattr(logging, level.upper()))
    if args.duration is not None and args.duration <= 0:
        print("phasewise demo: --duration must be > 0", file=sys.stderr)
        return 2
    cfg = Config(jobs=tuple(dict.fromkeys(args.jobs)), duration_s=args.duration, json=args.json,
                 cgroup_root=args.cgroup_root, cgroup_prefix=args.cgroup_prefix, interval_s=args.interval,
                 recommend_interval_s=args.recommend_interval, vpa_time_scale=args.vpa_time_scale,
                 start_cpu=args.start_cpu, start_mem=args.start_mem, host=base.host, data_dir=base.data_dir,
                 max_restarts=args.max_restarts, log_level=args.log_level or "info", policy=args.policy,
                 throttle_threshold=base.vpa.throttle_threshold, submit=args.submit)
    if os.geteuid() != 0:
        print(f"phasewise demo: {NEED_ROOT}", file=sys.stderr)
        return 2
    from phasewise.kit.statedir import StateDirError, ensure_state_dir

    try:
        # 0711: the actuator's job directories lie below it (its run directory's "actuate")
        ensure_state_dir(cfg.data_dir, mode=0o711)
    except StateDirError as e:
        print(f"phasewise demo: error: data_dir: {e}", file=sys.stderr)
        return 2
    demo = Demo(cfg)
    summary = demo.run()
    summary["submitted_jobs"] = dict(demo.submitted)
    if args.json:
        print(json.dumps(summary, allow_nan=False, default=_json_default))
    else:
        print(format_summary(summary))
        for job, state in demo.submitted.items():
            print(f"submitted job {job}: {state}")
    if summary["error"] and not summary["error"].startswith("stopped by"):
        return 1
    return 0 if summary["cleanup"] else 1


def _json_default(o: Any) -> Any:
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
