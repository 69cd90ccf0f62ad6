"""One recording session of ``phasewise experiment corpus``: the embedded broker, the host agent and one
execution at a time in a cgroup of its own, recorded with ``phasewise record``; with *live* the worker
and the cgroup actuator run too and the executions are limited as a user's would be (``corpus live``).
docs/phases.md, "The corpus"; docs/priors.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from phasewise.apps.experiment.corpus_plan import KINDS, CorpusError, Execution

__all__ = ["ATTACH_SH", "SETTLE_S", "Recorder", "iso", "machine", "write_json"]

#: the wrapper that puts itself into the execution's cgroup(s), then becomes the job (as the demo's)
ATTACH_SH = 'pid=$$; while [ "$1" != "--" ]; do echo "$pid" > "$1" || exit 97; shift; done; shift; exec "$@"'
#: after an execution ends and its cgroup is removed: the host agent's last samples of it reach the topic
SETTLE_S = 2.5


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(value, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def machine() -> dict[str, Any]:
    """What the provenance says about this machine: CPUs, memory, kernel, Python, torch, GPU (none here)."""
    from importlib.metadata import PackageNotFoundError, version

    cpu_model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = None
    gpu = [str(p) for p in Path("/dev").glob("nvidia[0-9]*")]
    return {"hostname": socket.gethostname(), "cpu_model": cpu_model, "logical_cpus": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)), "mem_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch,
            "gpu": (f"NVIDIA device files {gpu}" if gpu else
                    "none: no GPU on this machine (no /dev/nvidia*), so no GPU job was recorded and the "
                    "recordings' gpu columns are empty")}


class Recorder:
    """One recording session: the broker, the host agent, one execution at a time; ``close`` undoes it."""

    def __init__(self, out: Path, todo: list[Execution], *, cgroup_root: str, log: Any,
                 live: dict[str, str] | None = None) -> None:
        """*live*: run ``phasewise worker`` (with these settings, as environment variables) and ``phasewise
        actuate --backend cgroup`` beside the host agent, each execution's workload in mode ``apply`` with its
        kind as its signature (``phasewise.io/signature``, through the host agent's policy file)."""
        self.out, self.todo, self.log, self.live = out, todo, log, live
        self.stack = contextlib.ExitStack()
        self.run_dir = Path(tempfile.mkdtemp(prefix="phasewise-corpus-"))
        self.stack.callback(shutil.rmtree, self.run_dir, True)
        self.prefix = f"pwcorpus-{uuid.uuid4().hex[:6]}"
        self.cgroup_root = cgroup_root
        self.host = socket.gethostname()

    def start(self) -> None:
        from phasewise.apps.demo.cgroups import DemoError, check_cgroups
        from phasewise.kit.broker import EmbeddedBroker, free_port
        from phasewise.kit.kafka.client import ensure_topics, make_producer
        from phasewise.kit.procs import RoleProcess
        from phasewise.kit.settings import Settings

        try:
            self.layout = check_cgroups(self.cgroup_root, self.prefix)
        except DemoError as e:
            raise CorpusError(str(e).replace("the demo", "corpus record").replace("sudo make demo", "it as root")) \
                from None
        self.stack.callback(self._remove_prefix)
        broker = EmbeddedBroker(log_path=self.run_dir / "broker.log")
        broker.start()
        self.stack.callback(broker.stop)
        self.bootstrap = broker.bootstrap
        self.settings = Settings.from_env({"bootstrap": broker.bootstrap, "host": self.host}, env={})
        ensure_topics(self.settings)
        self.producer = make_producer(self.settings)
        # each execution's container names its job (phasewise.io/job, through the host agent's policy file)
        policy = self.run_dir / "workloads.json"
        policy.write_text(json.dumps({"workloads": [
            {"match": e.id, "job": e.id, "mode": "recommend"} if self.live is None
            else {"match": e.id, "job": e.id, "mode": "apply", "signature": e.kind} for e in self.todo]}))
        self.env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_HOST": self.host,
                    "PHASEWISE_CGROUP_ROOT": self.cgroup_root, "PHASEWISE_CGROUP_PREFIX": self.prefix,
                    "PHASEWISE_WORKLOAD_POLICY_FILE": str(policy), "PHASEWISE_INTERVAL_S": "1",
                    "PHASEWISE_LOG_LEVEL": "warning"}
        agent = RoleProcess("produce", ["--interval", "1"],
                            env={**self.env, "PHASEWISE_METRICS_PORT": str(free_port()),
                                 "PHASEWISE_DATA_DIR": str(self.run_dir / "produce")},
                            log_path=self.run_dir / "produce.log", python_flags=("-W", "ignore")).start()
        self.agent = agent
        self.stack.callback(agent.stop)
        roles = [agent]
        ports = {}
        if self.live is not None:  # the worker decides, the actuator applies to the execution's cgroup
            for role, args, extra in (("worker", [], self.live), ("actuate", ["--backend", "cgroup"], {})):
                ports[role] = free_port()
                p = RoleProcess(role, args, env={**self.env, **extra, "PHASEWISE_METRICS_PORT": str(ports[role]),
                                                 "PHASEWISE_DATA_DIR": str(self.run_dir / role)},
                                log_path=self.run_dir / f"{role}.log", python_flags=("-W", "ignore")).start()
                self.stack.callback(p.stop)
                roles.append(p)
        time.sleep(2.0)
        deadline = time.monotonic() + 180.0
        while True:
            for p in roles:
                if not p.alive():
                    raise CorpusError(f"phasewise {p.name} exited with {p.returncode()}: {p.log_tail(5)}")
            if "worker" not in ports or _ready(ports["worker"]):
                break
            if time.monotonic() > deadline:
                raise CorpusError(f"phasewise worker not ready within 180 s: {roles[1].log_tail(5)}")
            time.sleep(0.5)

    def _remove_prefix(self) -> None:
        layout = getattr(self, "layout", None)
        if layout is None:
            return
        from phasewise.apps.demo.cgroups import _end_processes

        for name in layout.containers():
            with contextlib.suppress(Exception):
                _end_processes(layout, name)
                layout.remove(name)
        tops = [layout.root] if layout.version == 2 else [layout.controller_root(c) for c in layout.controllers()]
        for top in tops:
            with contextlib.suppress(OSError):
                (top / self.prefix).rmdir()

    def _submit(self, e: Execution, command: list[str]) -> None:
        """The execution's job, as ``phasewise submit`` makes it (unsigned: nothing starts it but this run)."""
        from phasewise.apps.horus.submit import job_event
        from phasewise.kit.records import encode_within
        from phasewise.kit.topics import JOB_EVENTS

        batch = int(e.params.get("--batch-size") or 0) or 1
        text = KINDS[e.kind].module != "phasewise.apps.experiment.trainer" and e.kind != "forecaster"
        ev = job_event({"job": e.id, "model": f"{KINDS[e.kind].module}:{e.kind}",
                        "dataset": "wikitext2" if text else "vectors", "batch_size": batch, "command": command,
                        "expected_s": float(e.params["--seconds"])})
        self.producer.produce(JOB_EVENTS.name, key=e.id.encode(), value=encode_within(ev))
        if self.producer.flush(10.0):
            raise CorpusError(f"the broker did not take the job event of {e.id}")

    def execute(self, e: Execution, corpus_command: list[str], record: bool = True) -> dict[str, Any]:
        """Run *e* to its end in its cgroup, then (*record*) record it; its manifest entry."""
        from phasewise.apps.demo.cgroups import _end_processes
        from phasewise.kit.procs import ManagedProcess, RoleProcess

        layout = self.layout
        ckpt = f"checkpoints/{e.id}"
        job = ["python", "-W", "ignore", "-m", KINDS[e.kind].module, *e.argv(ckpt)]
        command = ["phasewise", "progress", "--stages", "--job", e.id, "--", *job]
        self._submit(e, command)
        layout.create(e.id)
        procs = ([layout.path(e.id) / "cgroup.procs"] if layout.version == 2
                 else [layout.path(e.id, c) / "cgroup.procs" for c in layout.controllers()])
        real = [sys.executable, "-m", "phasewise.cli", "progress", "--stages", "--job", e.id, "--",
                sys.executable, *job[1:]]
        env = {**os.environ, "PHASEWISE_BOOTSTRAP": self.bootstrap, "PHASEWISE_LOG_LEVEL": "warning",
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        log_path = self.run_dir / f"{e.id}.log"
        proc = ManagedProcess(e.id, ["/bin/sh", "-c", ATTACH_SH, "sh", *map(str, procs), "--", *real], env=env,
                              log_path=log_path, cwd=str(self.run_dir))
        limit_s = float(e.params["--seconds"]) + 240.0  # loading on a busy machine, and teardown
        loads: list[float] = []
        t0 = time.time()
        proc.start()
        timed_out = False
        while proc.alive():
            loads.append(os.getloadavg()[0])
            if time.time() - t0 > limit_s:
                timed_out = True
                proc.stop()
                break
            time.sleep(1.0)
        t1 = time.time()
        rc = proc.returncode()
        proc.stop()
        try:
            _end_processes(layout, e.id)
            layout.remove(e.id)
        except Exception as err:  # (DemoError, CgroupError, OSError: a process that would not end)
            raise CorpusError(f"execution {e.id}: its cgroup could not be emptied and removed: {err}") from None
        time.sleep(SETTLE_S)
        if rc != 0 or timed_out:
            what = f"ran past {limit_s:.0f} s" if timed_out else f"exited {rc}"
            raise CorpusError(f"execution {e.id} {what}: {proc.log_tail(5)}")
        load = {"start": round(loads[0], 2) if loads else None,
                "mean": round(sum(loads) / len(loads), 2) if loads else None,
                "max": round(max(loads), 2) if loads else None, "samples": len(loads),
                "note": "the 1-minute load average of the whole machine, read each second during the execution "
                        f"(the execution itself adds about 1; the machine has {os.cpu_count()} CPUs and was shared)"}
        entry: dict[str, Any] = {
            "id": e.id, "kind": e.kind, "run": e.run, "split": e.split, "file": f"{e.id}.parquet",
            "params": dict(e.params), "command": command, "start_utc": iso(t0), "end_utc": iso(t1),
            "seconds": round(t1 - t0, 1), "exit_code": rc, "load_avg_1m": load}
        if not record:
            return entry
        context = {"experiment": "phasewise experiment corpus", "corpus_command": corpus_command,
                   "execution": {k: entry[k] for k in ("id", "kind", "run", "split", "params", "command")},
                   "unlimited": "no CPU or memory limit was set on the execution's cgroup",
                   "machine": machine(), "load_avg_1m": load}
        ctx = self.run_dir / f"{e.id}.context.json"
        write_json(ctx, context)
        part = self.out / f"{e.id}.parquet.part"
        rec = RoleProcess("record", ["--out", str(part), "--since", iso(t0 - 1.0), "--until", iso(t1 + SETTLE_S),
                                     "--context", str(ctx), "--timeout", "30"],
                          env=self.env, log_path=self.run_dir / f"{e.id}.record.log", python_flags=("-W", "ignore"))
        rec.start()
        try:
            rrc = rec.proc.wait(300) if rec.proc is not None else 1
        except Exception:
            rrc = None
        rec.stop()
        if rrc != 0 or not part.is_file():
            part.unlink(missing_ok=True)
            raise CorpusError(f"phasewise record of {e.id} failed ({rrc}): {rec.log_tail(5)}")
        part.replace(self.out / entry["file"])
        from phasewise.apps.record.tracefile import read_recording

        header = read_recording(self.out / entry["file"]).header
        mine = [c for c in header.get("containers", []) if c.get("job") == e.id]
        entry["samples"] = sum(c.get("samples", 0) for c in mine)
        entry["stages_reported"] = sum(c.get("stages_total", 0) for c in mine)
        return entry

    def close(self) -> None:
        self.stack.close()


def _ready(port: int) -> bool:
    """Whether the worker serving metrics on *port* says it is ready."""
    from phasewise.apps.bench.harness import scrape

    try:
        return scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0
    except OSError:
        return False
