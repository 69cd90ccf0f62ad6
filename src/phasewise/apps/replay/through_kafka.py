"""``phasewise replay --through-kafka``: the same trace through a broker and a real ``phasewise worker``.

It produces the trace as ``HostSamples``, reads back the decisions the worker
published and rebuilds each container's decision sequence, so both paths are
scored alike (vpa's decisions equal in-process replay's; tested).
:func:`worker_in_process` runs the worker's own step in this process
(``--phase-model worker``). The procedure and its caveats: docs/results.md,
"How replay runs".
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.apps.replay.policies import NOMINAL_MEM_BYTES, PolicySpec
from phasewise.apps.replay.traces import Trace
from phasewise.kit.records import (
    MAX_BYTES,
    MAX_CORES,
    ContainerSample,
    Decision,
    HostSamples,
    PhaseChange,
    SchemaError,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.models.policy import Limits
from phasewise.models.scoring.scorecard import decision_limits

__all__ = [
    "END_CONTAINER",
    "WORKER_RESOURCES",
    "KafkaReplayError",
    "KafkaReplayResult",
    "ThroughKafkaUnsupported",
    "mem_scale",
    "phase_series",
    "fallback_series",
    "rebuild_sequences",
    "replay_through_kafka",
    "replay_settings_env",
    "trace_features",
    "through_kafka",
    "trace_messages",
    "worker_in_process",
    "worker_origin",
    "worker_policies",
]

#: container name of the end marker sample (not a trace container)
END_CONTAINER = "__phasewise_replay_end__"
#: resources the worker's VPA policy manages
WORKER_RESOURCES = ("cpu", "mem")
#: the phase statistics a replay worker runs unless asked (the worker's ``phase_statistics``)
STATISTICS: str = Settings.default("phase_statistics")


class KafkaReplayError(RuntimeError):
    """The trace cannot go through the pipeline, or the pipeline failed; ``str(e)`` says why."""


def worker_policies() -> list[str]:
    """Policy families ``phasewise worker`` can run in this build (from its ``--policy`` flag)."""
    from phasewise.streams import worker

    p = argparse.ArgumentParser(add_help=False)
    worker.add_arguments(p)
    for a in p._actions:
        if "--policy" in a.option_strings:
            return list(a.choices) if a.choices else ["vpa"]
    return ["vpa"]


def mem_scale(trace: Trace) -> float:
    """Multiplier from the trace's ``mem`` unit to bytes (in-process replay's :class:`ScaledPolicy`)."""
    return 1.0 if trace.units.get("mem", "bytes").startswith("bytes") else NOMINAL_MEM_BYTES


# ---------------------------------------------------------------- pure parts


def trace_messages(trace: Trace, host: str, scale_mem: float = 1.0) -> list[HostSamples]:
    """The trace as one :class:`HostSamples` per timestamp, in event-time order, plus the end marker.

    >>> import numpy as np
    >>> from phasewise.apps.replay.traces import ContainerSeries
    >>> tr = Trace("t", "-", {"cpu": "cores", "mem": "bytes"}, [
    ...     ContainerSeries("a", np.array([1., 2.]), {"cpu": np.array([.5, .6]), "mem": np.array([1e8, 2e8])}),
    ...     ContainerSeries("b", np.array([2.]), {"cpu": np.array([1.]), "mem": np.array([3e8])})])
    >>> [(m.ts, [c.container for c in m.containers]) for m in trace_messages(tr, "h")]
    [(1.0, ['a']), (2.0, ['a', 'b']), (3.0, ['__phasewise_replay_end__'])]
    """
    has = {r: r in trace.units for r in WORKER_RESOURCES}
    if not any(has.values()):
        raise KafkaReplayError(f"the trace has neither cpu nor mem ({', '.join(trace.units)}); "
                               "the worker's policy manages only those")
    by_t: dict[float, list[ContainerSample]] = {}
    for s in trace.containers:
        if s.container == END_CONTAINER:
            raise KafkaReplayError(f"container name {END_CONTAINER!r} is reserved for the end marker")
        cpu = s.usage.get("cpu")
        mem = s.usage.get("mem")
        gpu = s.usage.get("gpu")
        gpu_mem = s.usage.get("gpu_mem")
        for i, t in enumerate(s.t.tolist()):
            c_v = float(cpu[i]) if cpu is not None else math.nan
            m_v = float(mem[i]) if mem is not None else math.nan
            present = [r for r, v in (("cpu", c_v), ("mem", m_v)) if has[r] and not math.isnan(v)]
            if not present:
                continue  # nothing the worker's policy manages at this step
            missing = [r for r in WORKER_RESOURCES if has[r] and r not in present]
            if missing:
                raise KafkaReplayError(
                    f"container {s.container!r} at t={t:g} has {present[0]} but no {missing[0]}: a "
                    "HostSamples container sample needs both, so this step cannot go through Kafka")
            if t < 0:
                raise KafkaReplayError(f"container {s.container!r}: negative event time t={t:g} (Kafka needs >= 0)")
            c_v = c_v if has["cpu"] else 0.0
            m_v = m_v * scale_mem if has["mem"] else 0.0
            if c_v > MAX_CORES or m_v > MAX_BYTES:
                raise KafkaReplayError(f"container {s.container!r} at t={t:g}: usage beyond the schema's "
                                       f"bounds (cpu {c_v:g} > {MAX_CORES:g} or mem {m_v:g} > {MAX_BYTES:g})")
            g_v = None if gpu is None or math.isnan(gpu[i]) else float(gpu[i])
            gm_v = None if gpu_mem is None or math.isnan(gpu_mem[i]) else float(gpu_mem[i])
            by_t.setdefault(t, []).append(ContainerSample(container=s.container, cpu_cores=c_v, mem_bytes=m_v,
                                                          gpu_util=g_v, gpu_mem_bytes=gm_v))
    if not by_t:
        raise KafkaReplayError("the trace has no cpu or mem sample to replay")
    out: list[HostSamples] = []
    prev = None
    for t in sorted(by_t):
        dt = 0.0 if prev is None else min(t - prev, 86400.0)
        out.append(HostSamples(host=host, ts=t, interval_s=dt, containers=tuple(by_t[t])))
        prev = t
    end = ContainerSample(container=END_CONTAINER, cpu_cores=1.0, mem_bytes=1e9)
    out.append(HostSamples(host=host, ts=prev + 1.0, interval_s=1.0, containers=(end,)))
    return out


def rebuild_sequences(trace: Trace, decisions: Iterable[Decision],
                      scale_mem: float = 1.0) -> dict[str, list[tuple[float, Limits]]]:
    """Per container, ``[(t, limits in force at t), ...]`` from the worker's decisions.

    The limit at sample ``t_i`` is the last decided at an event time before
    ``t_i`` (``None`` before any); values are the policy's own limits
    (``details["limits"]``, falling back to the decision's rounded limit),
    memory divided by *scale_mem*. Keys: the worker's resources present in the trace.

    >>> import numpy as np
    >>> from phasewise.apps.replay.traces import ContainerSeries
    >>> tr = Trace("t", "-", {"cpu": "cores"}, [ContainerSeries("a", np.array([1., 2., 3.]),
    ...     {"cpu": np.array([.5, .6, .7])})])
    >>> d = Decision(id="x", ts=1.0, host="h", container="a", action="limit", policy="vpa", reason="",
    ...              cpu_limit_cores=0.6, details={"limits": {"cpu": 0.575}})
    >>> rebuild_sequences(tr, [d])["a"]
    [(1.0, {'cpu': None}), (2.0, {'cpu': 0.575}), (3.0, {'cpu': 0.575})]
    """
    resources = [r for r in WORKER_RESOURCES if r in trace.units]
    per: dict[str, list[tuple[float, dict[str, float]]]] = {}
    for d in decisions:
        vals = {r: v / scale_mem if r == "mem" else v
                for r, v in decision_limits(d.cpu_limit_cores, d.mem_limit_bytes, d.details).items()}
        if vals:
            per.setdefault(d.container, []).append((d.ts, vals))
    out: dict[str, list[tuple[float, Limits]]] = {}
    for s in trace.containers:
        ds = sorted(per.get(s.container, []), key=lambda x: x[0])
        cur: Limits = {r: None for r in resources}
        seq: list[tuple[float, Limits]] = []
        k = 0
        for t in s.t.tolist():
            while k < len(ds) and ds[k][0] < t:
                for r, v in ds[k][1].items():
                    if r in cur:
                        cur[r] = v
                k += 1
            seq.append((t, dict(cur)))
        out[s.container] = seq
    return out


# ---------------------------------------------------------------- the pipeline


@dataclass
class KafkaReplayResult:
    """What went through the pipeline and what came back."""

    host: str
    worker_id: str
    sequences: dict[str, list[tuple[float, Limits]]]  # container -> [(t, limits)]
    messages: int
    decisions: list[Decision] = field(default_factory=list)
    elapsed_s: float = 0.0
    bootstrap: str = ""
    #: the worker's PHASEWISE_* settings (``Settings.from_env(env=...)`` rebuilds them)
    settings_env: dict[str, str] = field(default_factory=dict)
    #: phase, in-process: the model the detectors started from, and the snapshots the learner made
    model_origin: str = ""
    snapshots: int = 0
    #: phase, in-process: the detectors' phase changes (:func:`phase_series` turns them into ids per step)
    phase_changes: list[PhaseChange] = field(default_factory=list)


def trace_features(trace: Trace) -> str:
    """The worker's ``phase_features`` for *trace*: cpu, mem, and the GPU columns the trace has.

    >>> import numpy as np
    >>> trace_features(Trace("t", "-", {"mem": "bytes", "gpu": "percent"}, []))
    'cpu,mem,gpu'
    """
    return ",".join(["cpu", "mem"] + [r for r in ("gpu", "gpu_mem") if r in trace.units])


def replay_settings_env(family: str, trace: Trace, *, frozen_model: bool = False,
                        pretrained: bool | str = False, statistics: str = STATISTICS,
                        safety: bool = False) -> dict[str, str]:
    """The ``PHASEWISE_*`` settings of a replay worker (through Kafka and in-process alike).

    Besides what docs/results.md, "How replay runs", lists: the phase detector's features are
    :func:`trace_features`; *pretrained*: start from the shipped model (a name: that one; else
    cold: a shipped model may have seen the trace a replay scores); *frozen_model*: the learner publishes no snapshot;
    *statistics*: ``phase_statistics`` (relative, the worker's default, or absolute);
    *safety*: the live safety rules bound the decisions (``safety_rules``; off by
    default, so replay scores what the bare policy decides).
    """
    env = {
        "PHASEWISE_POLICY": family,
        "PHASEWISE_RECOMMEND_INTERVAL_S": "0",
        "PHASEWISE_HYSTERESIS": "0",
        # in-process replay never forgets a container; a trace's gaps may exceed the TTL
        "PHASEWISE_CONTAINER_TTL_S": "0",
        # the VPA settings keep their defaults: those of the in-process VpaPolicy (a test keeps
        # the two equal), time scale 1 included
        # follow the policy's limits step by step (the replay compares every limit)
        "PHASEWISE_VPA_UPDATE_MODE": "hysteresis",
        "PHASEWISE_PHASE_FEATURES": trace_features(trace),
        "PHASEWISE_PHASE_PRETRAINED": "true" if pretrained else "false",
        # True: the settings' default model; a name: that shipped model
        **({"PHASEWISE_PHASE_PRETRAINED_MODEL": pretrained} if isinstance(pretrained, str) else {}),
        "PHASEWISE_PHASE_STATISTICS": statistics,
        "PHASEWISE_SAFETY_RULES": "true" if safety else "false",
    }
    if frozen_model:
        env["PHASEWISE_PHASE_SNAPSHOT_INTERVAL_S"] = repr(FROZEN_SNAPSHOT_INTERVAL_S)
    return env


def _worker_env(bootstrap: str, worker_id: str, data_dir: Path, metrics_port: int, host: str,
                settings_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    env.update(settings_env)
    env.update({
        "PHASEWISE_BOOTSTRAP": bootstrap,
        "PHASEWISE_WORKER_ID": worker_id,
        "PHASEWISE_DATA_DIR": str(data_dir),
        "PHASEWISE_WEB_PORT": "0",
        "PHASEWISE_METRICS_PORT": str(metrics_port),
        # never act on other hosts' samples when pointed at a live cluster
        "PHASEWISE_WORKER_HOSTS": host,
        "PHASEWISE_LOG_LEVEL": "warning",
    })
    return env


#: --policy phase with frozen_model: the learner publishes no snapshot within this many seconds
FROZEN_SNAPSHOT_INTERVAL_S = 1e7


def replay_through_kafka(trace: Trace, *, family: str = "vpa", bootstrap: str | None = None,
                         workdir: str | Path | None = None, timeout_s: float = 300.0,
                         frozen_model: bool = False, pretrained: bool | str = False,
                         statistics: str = STATISTICS, safety: bool = False) -> KafkaReplayResult:
    """Send *trace* through a broker and a ``phasewise worker``; rebuild its decision sequences.

    *bootstrap*: an existing broker (default: start an embedded one for the
    run). *workdir*: where the broker's and the worker's logs go (default: a
    temporary directory, kept and named in errors). *pretrained* (phase):
    with no snapshot on the models topic the worker starts from the shipped
    pretrained model (default: cold). *frozen_model* (phase): the worker's
    learner publishes no snapshot during the run, so its detectors keep the
    model they start from and its decisions are deterministic:
    :func:`worker_in_process` over the same trace decides the same (a test
    checks it).
    """
    if family not in worker_policies():
        raise KafkaReplayError(f"policy {family!r} cannot run through Kafka: phasewise worker runs "
                               f"{', '.join(worker_policies())} here")
    from phasewise.kit.broker import EmbeddedBroker, free_port
    from phasewise.kit.kafka.client import BrokerUnavailable, ensure_topics, make_consumer, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.topics import DECISIONS, SAMPLES

    t0 = time.perf_counter()
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="phasewise-replay-"))
    work.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:8]
    host = f"replay-{run_id}"
    worker_id = f"phasewise-replay-{run_id}"
    scale = mem_scale(trace)
    messages = trace_messages(trace, host, scale)
    broker = None if bootstrap else EmbeddedBroker(log_path=work / "broker.log").start()
    boot = bootstrap or broker.bootstrap  # type: ignore[union-attr]
    worker: RoleProcess | None = None
    consumer = None
    try:
        s = Settings.from_env({"bootstrap": boot, "host": host}, env={})
        try:
            ensure_topics(s)
        except BrokerUnavailable as e:
            raise KafkaReplayError(str(e)) from e
        # read decisions from where the topic ends now (assigned, no group join)
        from confluent_kafka import TopicPartition

        consumer = make_consumer(s, f"{worker_id}-reader")
        md = consumer.list_topics(DECISIONS.name, timeout=10).topics[DECISIONS.name]
        tps = []
        for p in md.partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(DECISIONS.name, p), timeout=10)
            tps.append(TopicPartition(DECISIONS.name, p, high))
        consumer.assign(tps)

        worker = RoleProcess("worker", [], env={}, log_path=work / "worker.log")
        worker.env = _worker_env(boot, worker_id, work / "worker-data", free_port(), host,
                                 replay_settings_env(family, trace, frozen_model=frozen_model,
                                                     pretrained=pretrained, statistics=statistics,
                                                     safety=safety))
        worker.start()

        producer = make_producer(s)
        for m in messages:
            while True:
                try:
                    producer.produce(SAMPLES.name, key=host.encode(), value=encode(m))
                    break
                except BufferError:
                    producer.poll(0.05)
        if producer.flush(60) != 0:
            raise KafkaReplayError("could not deliver every sample to the broker within 60 s")

        got: list[Decision] = []
        done = False
        deadline = time.monotonic() + timeout_s
        while not done:
            if time.monotonic() > deadline:
                raise KafkaReplayError(f"no end-of-replay decision within {timeout_s:.0f} s "
                                       f"({len(got)} decisions so far); worker log:\n{worker.log_tail()}")
            if not worker.alive():
                raise KafkaReplayError(f"phasewise worker exited (status {worker.proc.returncode}):\n"
                                       f"{worker.log_tail()}")
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            try:
                d = decode(Decision, msg.value())
            except SchemaError:  # someone else's record on a shared topic
                continue
            if d.host != host or d.policy != family:
                continue
            if family == "vpa" and (d.details or {}).get("worker_id") != worker_id:
                continue  # another worker on this broker decided about our host
            if d.container == END_CONTAINER:
                done = True
            else:
                got.append(d)
        seqs = rebuild_sequences(trace, got, scale)
        return KafkaReplayResult(host, worker_id, seqs, len(messages), got, time.perf_counter() - t0, boot,
                                 {k: v for k, v in worker.env.items() if k.startswith("PHASEWISE_")})
    finally:
        if consumer is not None:
            consumer.close()
        if worker is not None:
            worker.stop()
        if broker is not None:
            broker.stop()


class _InProcessPhase:
    """The phase side of a worker, in-process: detectors, and the learner on event time.

    The detectors are the worker's :class:`~phasewise.models.phases.updater.PhaseHooks`.
    Live, learn batches go to the learner agent through a topic and the
    learner publishes a snapshot every ``phase_snapshot_interval_s`` of wall
    time, which detectors pick up whenever it arrives. Here the learner learns
    each batch at once and snapshots every ``phase_snapshot_interval_s`` of
    *event* time (after taking the partial batch, as before a commit): the
    same code, on a deterministic clock.
    """

    def __init__(self, settings: Any, cache: Any, frozen: bool, model: Any = None) -> None:
        from phasewise.models.phases.learner import Learner
        from phasewise.models.phases.updater import PhaseHooks
        from phasewise.streams.config import detector_config, initial_model

        # *model*: a PhaseModel to start from instead of the settings' (an experiment's own)
        model, self.origin = initial_model(settings) if model is None else (model, "given")
        self.interval = float(settings.phase.snapshot_interval_s)
        self.frozen = frozen
        self.latest: tuple[Any, Any] | None = None
        self.hooks = PhaseHooks(detector_config(settings), cache, model=model.clone(), version=0,
                                latest=lambda: self.latest)
        self.learner = Learner(model.clone(), 0, 0)
        self.next_snapshot: float | None = None
        self.snapshots = 0
        self.changes: list[PhaseChange] = []
        self.shadow: list[Decision] = []  # the last round's decisions of containers decided with the VPA

    def _learn(self, batch: bytes | None) -> None:
        from phasewise.kit.records.learn_batches import decode_learn_batch

        if batch is None or self.frozen:
            return
        m = self.learner.model
        self.learner.learn(*decode_learn_batch(batch, self.hooks.name, m.window_len, m.n_features))

    def process_many(self, msgs: Sequence[HostSamples]) -> list[Decision]:
        from phasewise.models.phases.snapshots import model_of

        out = self.hooks.process_many(msgs)
        self.shadow = out.shadow
        self.changes += out.changes
        self._learn(out.learn_batch)
        t = max(m.ts for m in msgs)
        if self.next_snapshot is None:
            self.next_snapshot = t + self.interval
        elif t >= self.next_snapshot and not self.frozen:
            self._learn(self.hooks.take_learn_batch())
            snap = self.learner.snapshot(time.time())
            if snap is not None:  # what a detector's follower decodes from the models topic
                self.latest = (snap, model_of(snap))
                self.snapshots += 1
            self.next_snapshot = t + self.interval
        return out.decisions


def worker_in_process(trace: Trace, *, family: str = "phase", host: str = "replay", frozen_model: bool = False,
                      pretrained: bool | str = False, statistics: str = STATISTICS,
                      safety: bool = False, scorecard: Any = None) -> KafkaReplayResult:
    """What :func:`replay_through_kafka` does, without Kafka: the worker's own step in this process.

    The same messages (:func:`trace_messages`), the same settings
    (:func:`replay_settings_env`) and the step the samples agent runs
    (:func:`~phasewise.models.vpa.updater.worker_round`, one message per round
    as one replay host's messages are), so the decisions are the worker's.
    ``phase``: see :class:`_InProcessPhase` for the learner's clock; with
    *frozen_model* nothing is learned and the decisions equal, record for
    record, those a real worker publishes through Kafka for the same *host*
    (tested). ``messages`` counts the end marker; its decision is dropped.
    *scorecard*: a :class:`~phasewise.models.scoring.scorecard.Scorecard` the rounds
    feed, as the worker's does.
    """
    if family not in ("vpa", "phase"):
        raise KafkaReplayError(f"policy {family!r} is not a worker policy (vpa, phase)")
    from phasewise.models.vpa.updater import worker_round
    from phasewise.streams.config import state_cache, updater_config

    t0 = time.perf_counter()
    env = replay_settings_env(family, trace, frozen_model=frozen_model, pretrained=pretrained,
                              statistics=statistics, safety=safety)
    settings = Settings.from_env({"bootstrap": "in-process", "host": host}, env=env)
    cache, updater = state_cache(settings), updater_config(settings)
    scale = mem_scale(trace)
    messages = trace_messages(trace, host, scale)
    phase = _InProcessPhase(settings, cache, frozen_model) if family == "phase" else None
    got: list[Decision] = []
    # a live detector logs each snapshot it swaps to (every ~30 s); a replay swaps hundreds of times a second
    quiet = logging.getLogger("phasewise.models.phases.updater")
    level = quiet.level
    quiet.setLevel(max(logging.WARNING, quiet.getEffectiveLevel()))
    try:
        for m in messages:
            got += worker_round(cache, [m], updater, phase, scorecard)
    finally:
        quiet.setLevel(level)
    got = [d for d in got if d.container != END_CONTAINER]
    return KafkaReplayResult(host, "in-process", rebuild_sequences(trace, got, scale), len(messages), got,
                             time.perf_counter() - t0, "", env, phase.origin if phase else "",
                             phase.snapshots if phase else 0, phase.changes if phase else [])


def phase_series(trace: Trace, changes: Iterable[PhaseChange]) -> dict[str, np.ndarray]:
    """Per container, the phase id in force at each of its samples (-1 before its first phase).

    A change at event time ``ts`` holds from the sample at ``ts`` on.

    >>> from phasewise.apps.replay.traces import ContainerSeries
    >>> tr = Trace("t", "-", {"cpu": "cores"}, [ContainerSeries("a", np.array([1., 2., 3., 4.]),
    ...     {"cpu": np.ones(4)})])
    >>> ch = [PhaseChange(container="a", host="h", ts=2.0, new_phase=0, since=2.0),
    ...       PhaseChange(container="a", host="h", ts=4.0, old_phase=0, new_phase=3, since=2.0)]
    >>> phase_series(tr, ch)["a"].tolist()
    [-1, 0, 0, 3]
    """
    per: dict[str, list[tuple[float, int]]] = {}
    for c in changes:
        per.setdefault(c.container, []).append((c.ts, c.new_phase))
    out: dict[str, np.ndarray] = {}
    for s in trace.containers:
        ch = sorted(per.get(s.container, []))
        ids = np.full(len(s), -1, dtype=np.int64)
        if ch:
            ts = np.array([t for t, _ in ch])
            ph = np.array([p for _, p in ch], dtype=np.int64)
            k = np.searchsorted(ts, s.t, side="right") - 1  # the last change at or before each sample
            ids = np.where(k >= 0, ph[np.maximum(k, 0)], -1)
        out[s.container] = ids
    return out


def fallback_series(trace: Trace, decisions: Iterable[Decision]) -> dict[str, dict[str, np.ndarray]]:
    """Per container and resource, whether the phase worker's limit in force at each sample
    came from its fallback (``details["sources"]`` of the decision that set it; the limit
    decided at ``ts`` holds from the next sample on, as in :func:`rebuild_sequences`).

    >>> from phasewise.apps.replay.traces import ContainerSeries
    >>> tr = Trace("t", "-", {"cpu": "cores"}, [ContainerSeries("a", np.array([1., 2., 3.]),
    ...     {"cpu": np.ones(3)})])
    >>> d = [Decision(id="x", ts=1.0, host="h", container="a", action="limit", policy="phase",
    ...               cpu_limit_cores=1.0, details={"sources": {"cpu": "fallback:vpa"}}),
    ...      Decision(id="y", ts=2.0, host="h", container="a", action="limit", policy="phase",
    ...               cpu_limit_cores=1.5, details={"sources": {"cpu": "phase"}})]
    >>> fallback_series(tr, d)["a"]["cpu"].tolist()
    [False, True, False]
    """
    resources = [r for r in WORKER_RESOURCES if r in trace.units]
    per: dict[str, list[tuple[float, dict[str, bool]]]] = {}
    for d in decisions:
        srcs = (d.details or {}).get("sources") or {}
        vals = {r: str(srcs.get(r, "")).startswith("fallback")
                for r, field_ in (("cpu", d.cpu_limit_cores), ("mem", d.mem_limit_bytes)) if field_ is not None}
        if vals:
            per.setdefault(d.container, []).append((d.ts, vals))
    out: dict[str, dict[str, np.ndarray]] = {}
    for s in trace.containers:
        ds = sorted(per.get(s.container, []), key=lambda x: x[0])
        cur = {r: False for r in resources}
        rows: dict[str, list[bool]] = {r: [] for r in resources}
        k = 0
        for t in s.t.tolist():
            while k < len(ds) and ds[k][0] < t:
                cur.update({r: v for r, v in ds[k][1].items() if r in cur})
                k += 1
            for r in resources:
                rows[r].append(cur[r])
        out[s.container] = {r: np.array(v, dtype=bool) for r, v in rows.items()}
    return out


def kafka_sequences(trace: Trace, families: Iterable[str], **kw: Any) -> tuple[dict[str, dict], dict[str, Any]]:
    """``{family: {container: seq}}`` for each worker family of *families*, and run info."""
    seqs: dict[str, dict] = {}
    info: dict[str, Any] = {}
    for fam in families:
        r = replay_through_kafka(trace, family=fam, **kw)
        seqs[fam] = r.sequences
        info[fam] = {"host": r.host, "worker_id": r.worker_id, "messages": r.messages,
                     "decisions": len(r.decisions), "elapsed_s": round(r.elapsed_s, 1), "bootstrap": r.bootstrap}
    return seqs, info


class ThroughKafkaUnsupported(RuntimeError):
    """A policy family of the run cannot go through the Kafka pipeline in this build."""


def through_kafka(trace: Trace, specs: list[PolicySpec], bootstrap: str | None,
                  **kw: Any) -> dict[str, dict[str, list[tuple[float, Limits]]]]:
    """Decision sequences of the worker's policy families in *specs*, through the real pipeline."""
    families = [s.family for s in specs]
    runs = worker_policies()
    if "phase" in families and "phase" not in runs:
        raise ThroughKafkaUnsupported(
            "--through-kafka cannot run the phase policy: phasewise worker has no `--policy phase` "
            "in this build (streams/worker.py, streams/agents/phases.py); drop phase from "
            "--policies or run without --through-kafka")
    kafka = [f for f in dict.fromkeys(families) if f in runs]
    if not kafka:
        raise ThroughKafkaUnsupported("--through-kafka: none of the policies runs in the stream worker "
                                      f"(it runs {', '.join(runs)}); add one to --policies")
    seqs, info = kafka_sequences(trace, kafka, bootstrap=bootstrap, **kw)
    for fam, i in info.items():
        print(f"through kafka: {fam}: {i['messages']} messages, {i['decisions']} decisions from "
              f"phasewise worker {i['worker_id']} (host {i['host']}) via {i['bootstrap']} "
              f"in {i['elapsed_s']} s", file=sys.stderr)
    others = sorted({f for f in families if f not in kafka})
    if others:
        print(f"in-process: {', '.join(others)} (not run by the stream worker)", file=sys.stderr)
    return {s.name: seqs[s.family] for s in specs if s.family in seqs}


def worker_origin(trace: Trace, *, pretrained: bool | str, statistics: str = STATISTICS,
                  bootstrap: str | None = None) -> str:
    """What a replay's phase worker starts from (for the report), by the worker's own rule.

    :func:`~phasewise.streams.config.initial_model` under the replay
    worker's settings; with *bootstrap* (a broker that may already hold
    snapshots) the worker would start from the newest one instead.
    """
    from phasewise.streams.config import initial_model

    env = replay_settings_env("phase", trace, pretrained=pretrained, statistics=statistics)
    origin = initial_model(Settings.from_env({"bootstrap": "-"}, env=env))[1]
    return origin + (", unless a snapshot was already on the models topic" if bootstrap else "")
