"""``phasewise bench recovery``: a real worker SIGKILLed several times, its decisions against an unkilled run's.
docs/benchmarks.md, "What each bench measures"; docs/security.md, "Exact recovery after SIGKILL".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from phasewise.apps.bench.harness import scrape, wait_until
from phasewise.kit.broker import EmbeddedBroker, free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import ContainerSample, Decision, HostSamples, SchemaError, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DECISIONS, SAMPLES
from phasewise.models.vpa.state import StateCache
from phasewise.models.vpa.updater import worker_round
from phasewise.streams.config import state_cache, updater_config

__all__ = ["add_arguments", "messages", "reference", "run", "run_once"]

HOSTS, CONTAINERS, TICKS = 4, 6, 240


#: the worker's policies a run can use: the VPA's, or the phase detector's (the VPA its fallback)
POLICIES = ("vpa", "phase")


def worker_env(state_write_interval_s: float, policy: str = "vpa", snapshot_interval_s: float | None = None
               ) -> dict[str, str]:
    env = {"PHASEWISE_VPA_TIME_SCALE": "0.001", "PHASEWISE_VPA_UPDATE_MODE": "hysteresis",
           "PHASEWISE_SAFETY_RULES": "false", "PHASEWISE_RECOMMEND_INTERVAL_S": "1",
           "PHASEWISE_STATE_WRITE_INTERVAL_S": str(state_write_interval_s), "PHASEWISE_HYSTERESIS": "0.05",
           "PHASEWISE_POLICY": policy}
    if policy == "phase":  # by default no snapshot within the run: the detector keeps its starting model in both
        env["PHASEWISE_PHASE_SNAPSHOT_INTERVAL_S"] = "1000000" if snapshot_interval_s is None else \
            repr(float(snapshot_interval_s))
    return env


#: how the containers use what they have: ``square`` waves (limits move and decisions keep coming), or the
#: same with ``noisy`` samples (each one moves the recommendation a little, so a sample lost to a kill
#: shows as a different decision)
USAGES = ("square", "noisy")


def messages(run: str, t0: float, usage: str = "square") -> list[HostSamples]:
    """TICKS ticks of HOSTS hosts from *t0* (:data:`USAGES`); seeded."""
    rng = np.random.default_rng(7)
    base = rng.uniform(0.2, 1.0, (HOSTS, CONTAINERS))
    period = rng.integers(6, 30, (HOSTS, CONTAINERS))
    noise = rng.lognormal(0.0, 0.35, (TICKS, HOSTS, CONTAINERS)) if usage == "noisy" else \
        np.ones((TICKS, HOSTS, CONTAINERS))
    out = []
    for t in range(TICKS):
        for h in range(HOSTS):
            high = (t // period[h]) % 2
            n = noise[t, h]
            out.append(HostSamples(host=f"{run}-h{h}", ts=t0 + t, interval_s=1.0, containers=tuple(
                ContainerSample(container=f"c{c}", cpu_cores=float(base[h, c] * (1 + 2 * high[c]) * n[c]),
                                mem_bytes=float(3e8 * base[h, c] * (1 + high[c]) * n[c]), cpu_limit_cores=4.0,
                                mem_limit_bytes=8e9, nr_periods=10) for c in range(CONTAINERS))))
    return out


class _Detector:
    """The worker's phase detectors in process (what ``worker_round`` steps after the VPA)."""

    def __init__(self, settings: Settings, cache: StateCache) -> None:
        from phasewise.models.phases.updater import PhaseHooks
        from phasewise.streams.config import detector_config, initial_model

        self.hooks = PhaseHooks(detector_config(settings), cache, model=initial_model(settings)[0])
        self.shadow: list[Decision] = []

    def process_many(self, msgs: list[HostSamples]) -> list[Decision]:
        out = self.hooks.process_many(msgs)
        self.shadow = out.shadow
        return out.decisions


def reference(msgs: list[HostSamples], env: dict[str, str]) -> dict[str, Decision]:
    """The decisions of the same logic in process, no kill (by id): the worker's round over each message."""
    s = Settings.from_env(env=env)
    cache, cfg = state_cache(s), updater_config(s)
    phase = _Detector(s, cache) if s.worker.policy == "phase" else None
    return {d.id: d for m in msgs for d in worker_round(cache, [m], cfg, phase)}


def run_once(bootstrap: str, work: Path, kills: int, state_write_interval_s: float, usage: str = "square",
             policy: str = "vpa", snapshot_interval_s: float | None = None) -> dict:
    s = Settings.from_env({"bootstrap": bootstrap}, env={})
    run = f"kill-{uuid.uuid4().hex[:6]}"
    env0 = worker_env(state_write_interval_s, policy, snapshot_interval_s)
    msgs = messages(run, time.time() - TICKS - 120, usage)
    want = reference(msgs, env0)
    port = free_port()
    worker_id = f"recovery-{uuid.uuid4().hex[:6]}"
    env = {**env0, "PHASEWISE_BOOTSTRAP": bootstrap, "PHASEWISE_WEB_PORT": "0", "PHASEWISE_METRICS_PORT": str(port),
           "PHASEWISE_DATA_DIR": str(work / run), "PHASEWISE_WORKER_ID": worker_id}
    log_path = work / f"{run}-worker.log"

    def start() -> RoleProcess:
        w = RoleProcess("worker", [], env=env, log_path=log_path, append=True).start()

        def ready() -> bool:
            if not w.alive():
                raise RuntimeError("worker exited:\n" + w.log_tail())
            try:
                return scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0
            except OSError:
                return False
        wait_until(ready, 90, 0.1, "the worker to be ready")
        return w

    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    reader = make_consumer(s, f"recovery-reader-{uuid.uuid4().hex[:6]}")
    reader.assign([TopicPartition(DECISIONS.name, p, OFFSET_BEGINNING) for p in range(DECISIONS.partitions)])
    got: list[str] = []
    sample_of: dict[str, tuple[str, str, float]] = {}  # decision id -> the sample it decided

    def read(for_s: float) -> None:
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline:
            m = reader.poll(0.1)
            if m is None or m.error():
                continue
            try:
                d = decode(Decision, m.value())
            except SchemaError:
                continue
            if d.host.startswith(run):
                got.append(d.id)
                sample_of[d.id] = (d.host, d.container, d.ts)

    p = make_producer(s)
    done = threading.Event()

    def produce() -> None:
        for i, m in enumerate(msgs):
            p.produce(SAMPLES.name, key=m.host.encode(), value=encode(m))
            if i % HOSTS == HOSTS - 1:
                p.poll(0)
                time.sleep(0.06)
        p.flush(30)
        done.set()

    worker = start()
    threading.Thread(target=produce, daemon=True).start()
    try:
        for k in range(kills):
            read(2.0 + k)
            os.killpg(worker.pid, signal.SIGKILL)
            worker.proc.wait(10)
            worker.stop()
            worker = start()
        done.wait(120)
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": worker_id})
        try:
            parts = [TopicPartition(SAMPLES.name, q) for q in range(SAMPLES.partitions)]
            deadline = time.monotonic() + 120
            while True:
                read(1.0)
                committed = {tp.partition: tp.offset for tp in c.committed(parts, timeout=10)}
                ends = {q: c.get_watermark_offsets(TopicPartition(SAMPLES.name, q), timeout=10)[1]
                        for q in range(SAMPLES.partitions)}
                if all(committed[q] == ends[q] or ends[q] == 0 for q in ends):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"samples not all committed: {committed} of {ends}")
        finally:
            c.close()
        read(2.0)
    finally:
        worker.stop()
        reader.close()
    seen = set(got)
    per_sample: dict[tuple[str, str, float], set[str]] = {}
    for i in seen:
        per_sample.setdefault(sample_of[i], set()).add(i)
    return {"reference": len(want), "published": len(seen), "missing": len(set(want) - seen),
            "extra": len(seen - set(want)), "repeated": len(got) - len(seen), "kills": kills,
            # samples decided two ways (a restarted worker deciding a sample read again otherwise than the
            # killed one had): what exactness forbids, also where snapshots make the reference moot
            "conflicting_samples": sum(1 for ids in per_sample.values() if len(ids) > 1),
            "snapshots_published": snapshots_published(bootstrap) if snapshot_interval_s is not None else 0}


def snapshots_published(bootstrap: str) -> int:
    """Records on the models topic (the learner's snapshots of this run's broker)."""
    from confluent_kafka import Consumer, TopicPartition

    from phasewise.kit.topics import MODELS

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"recovery-models-{uuid.uuid4().hex[:6]}"})
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition(MODELS.name, 0), timeout=10)
        return hi - lo
    finally:
        c.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs per run")
    p.add_argument("--runs", type=int, default=3, help="runs, each with a fresh worker group")
    p.add_argument("--state-write-interval", type=float, default=None,
                   help="the worker's state_write_interval_s (default: the setting's default; 0: every touched "
                        "container at every commit)")
    p.add_argument("--usage", choices=USAGES, default="square",
                   help="square waves, or the same with noisy samples (each sample moves the decisions)")
    p.add_argument("--policy", choices=POLICIES, default="vpa",
                   help="the worker's policy (phase: the detector on the shipped starting model, no snapshot "
                        "published within a run, the VPA its fallback)")
    p.add_argument("--snapshot-interval", type=float, default=None,
                   help="--policy phase: the learner publishes a model snapshot this often (seconds) during the "
                        "run, so the detectors swap models between kills; the in-process reference keeps its "
                        "starting model, so judge by conflicting_samples (default: no snapshot within a run)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(a: argparse.Namespace) -> int:
    interval = Settings().worker.state_write_interval_s if a.state_write_interval is None else \
        a.state_write_interval
    work = Path(tempfile.mkdtemp(prefix="phasewise-recovery-"))
    runs = []
    for i in range(a.runs):  # a broker per run: a run's worker reads no earlier run's samples
        with EmbeddedBroker(log_path=work / f"broker-{i}.log") as broker:
            ensure_topics(Settings.from_env({"bootstrap": broker.bootstrap}, env={}))
            runs.append(run_once(broker.bootstrap, work, a.kills, interval, a.usage, a.policy,
                                 a.snapshot_interval if a.policy == "phase" else None))
    out = {"policy": a.policy, "state_write_interval_s": interval, "usage": a.usage, "runs": runs,
           "snapshot_interval_s": a.snapshot_interval if a.policy == "phase" else None,
           "exact_runs": sum(1 for r in runs if not r["missing"] and not r["extra"]),
           "runs_without_conflicts": sum(1 for r in runs if not r["conflicting_samples"])}
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0
