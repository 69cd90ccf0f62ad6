"""``phasewise produce``: the host agent. Samples the managed containers every interval, publishes one
``HostSamples`` per host to Kafka.

A drift-free schedule, a bounded buffer that keeps order while the broker is
away (dropping the oldest when full), a clean stop on SIGTERM, and
``--once`` to print what this host would publish: docs/operations.md, "The
host agent".
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import SAMPLES, Topic

__all__ = ["Agent", "Outgoing", "Publisher", "SampleBuffer", "add_arguments", "run"]

log = logging.getLogger(__name__)

#: librdkafka settings for an agent that must survive outages: fail a stuck
#: message after 10 s (it is then re-queued by the agent, in order), reconnect
#: quickly, and keep per-host order across retries.
PRODUCER_CONFIG = {
    "message.timeout.ms": 10_000,
    "reconnect.backoff.ms": 100,
    "reconnect.backoff.max.ms": 1_000,
    "max.in.flight.requests.per.connection": 1,
    "linger.ms": 5,
}


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One encoded message waiting for the broker; ``seq`` orders re-queued messages."""

    seq: int
    key: bytes
    value: bytes


class SampleBuffer:
    """Bounded FIFO of :class:`Outgoing` messages; when full, the oldest is dropped.

    >>> b = SampleBuffer(2)
    >>> for i in range(3):
    ...     _ = b.push(Outgoing(i, b"h", b"%d" % i))
    >>> [m.seq for m in b.take(10)], b.dropped
    ([1, 2], 1)
    """

    def __init__(self, max_messages: int) -> None:
        if max_messages < 1:
            raise ValueError(f"buffer_max_messages must be >= 1, got {max_messages}")
        self.max_messages = max_messages
        self.dropped = 0
        self._q: deque[Outgoing] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def push(self, msg: Outgoing) -> int:
        """Append *msg*; returns how many old messages were dropped to make room."""
        self._q.append(msg)
        return self._trim()

    def requeue(self, msgs: Iterable[Outgoing]) -> int:
        """Put *msgs* back at the front in ``seq`` order (they are older than the rest)."""
        self._q.extendleft(sorted(msgs, key=lambda m: m.seq, reverse=True))
        return self._trim()

    def take(self, n: int) -> list[Outgoing]:
        """Remove and return up to *n* oldest messages."""
        out = []
        while self._q and len(out) < n:
            out.append(self._q.popleft())
        return out

    def _trim(self) -> int:
        dropped = 0
        while len(self._q) > self.max_messages:
            self._q.popleft()
            dropped += 1
        self.dropped += dropped
        return dropped


class Publisher:
    """Moves messages from a :class:`SampleBuffer` through a confluent-kafka producer.

    While the broker answers, messages are dispatched as they come. Until the
    first delivery succeeds, and after any failed delivery, only one batch is
    in flight at a time (a probe) and new messages wait in the bounded buffer;
    failed messages go back to the front of the buffer and the next probe
    retries them first, in order.
    """

    def __init__(self, producer: Any, topic: Topic, buffer: SampleBuffer, *, metrics: Any = None,
                 max_batch: int = 1000) -> None:
        self.producer = producer
        self.topic = topic
        self.buffer = buffer
        self.metrics = metrics
        self.max_batch = max_batch
        self.delivered = 0
        self._seq = 0
        self._inflight = 0
        self._failed: list[Outgoing] = []
        # unproven until the first delivery: one probe batch at a time, the rest waits in the buffer
        self._healthy = False
        self._outage_since: float | None = None

    @property
    def healthy(self) -> bool:
        """The last delivery succeeded (False before the first one and during an outage)."""
        return self._healthy

    @property
    def pending(self) -> int:
        """Messages not yet acknowledged (buffered + in flight + awaiting re-queue)."""
        return len(self.buffer) + self._inflight + len(self._failed)

    def submit(self, key: bytes, value: bytes) -> None:
        self._seq += 1
        dropped = self.buffer.push(Outgoing(self._seq, key, value))
        if dropped:
            if self.metrics is not None:
                self.metrics.dropped.inc(dropped)
            log.warning("sample buffer full (%d messages): dropped the %d oldest", self.buffer.max_messages,
                        dropped)
        self._dispatch()

    def pump(self, timeout_s: float = 0.0) -> None:
        """Serve delivery reports (waiting up to *timeout_s*) and dispatch what can go."""
        self.producer.poll(timeout_s)
        self._dispatch()

    def _on_delivery(self, item: Outgoing) -> Callable[[Any, Any], None]:
        def report(err: Any, _msg: Any) -> None:
            self._inflight -= 1
            if err is not None:
                self._failed.append(item)
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    log.warning("broker unavailable (%s); buffering samples (up to %d)", err,
                                self.buffer.max_messages)
                self._healthy = False
            else:
                self.delivered += 1
                if self.metrics is not None:
                    self.metrics.delivered.inc()
                if self._outage_since is not None:
                    log.info("broker back after %.1f s; flushing %d buffered message(s) in order",
                             time.monotonic() - self._outage_since, self.pending)
                    self._outage_since = None
                self._healthy = True
            if self._inflight == 0 and self._failed:
                dropped = self.buffer.requeue(self._failed)
                self._failed = []
                if dropped and self.metrics is not None:
                    self.metrics.dropped.inc(dropped)

        return report

    def _dispatch(self) -> None:
        while len(self.buffer) and (self._healthy or (self._inflight == 0 and not self._failed)):
            batch = self.buffer.take(self.max_batch)
            for i, m in enumerate(batch):
                try:
                    self.producer.produce(self.topic.name, key=m.key, value=m.value,
                                          on_delivery=self._on_delivery(m))
                except BufferError:  # librdkafka's local queue is full: retry on the next pump
                    self.buffer.requeue(batch[i:])
                    self._update_gauge()
                    return
                self._inflight += 1
            if not self._healthy:
                break  # one probe batch at a time during an outage
        self._update_gauge()

    def _update_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.buffered.set(self.pending)

    def flush(self, timeout_s: float) -> int:
        """Try to deliver everything within *timeout_s*; returns how many are still unsent."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            self.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        self._update_gauge()
        return self.pending


class Agent:
    """The produce loop: sample, encode, publish, on a drift-free schedule."""

    def __init__(self, settings: Settings, sampler: Any, *, producer: Any = None, metrics: Any = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        from phasewise.producers.metrics import ProducerMetrics

        self.settings = settings
        self.sampler = sampler
        self.metrics = metrics if metrics is not None else ProducerMetrics()
        self.publisher = Publisher(None, SAMPLES,
                                   SampleBuffer(settings.producer.buffer_max_messages),
                                   metrics=self.metrics)
        if producer is None:
            from phasewise.kit.kafka.client import make_producer

            # librdkafka's log and errors go to phasewise.kit.kafka.client.KafkaLog: an unreachable
            # broker is one line every few seconds
            producer = make_producer(settings, **PRODUCER_CONFIG)
        self.publisher.producer = producer
        self.monotonic = monotonic
        self.ticks = 0
        self._key = settings.host.encode()
        from phasewise.kit.observe import Health

        #: live while the sampling loop ticks; ready while the broker takes the samples
        self.health = Health(ready=self._not_ready)

    def _not_ready(self) -> str | None:
        if self.ticks == 0:
            return "no sample taken yet"
        if not self.publisher.healthy:
            return (f"samples are not delivered ({self.publisher.pending} waiting for the broker at "
                    f"{self.settings.kafka.bootstrap})")
        return None

    def _beat(self) -> None:
        self.health.beat("sampling", max(10.0, 3 * self.settings.producer.interval_s))

    def baseline(self) -> None:
        """First reading: establishes counters, publishes nothing."""
        self.sampler.sample()

    def tick(self) -> None:
        """Sample once and hand the message to the publisher; never raises."""
        t0 = time.perf_counter()
        try:
            msg = self.sampler.sample()
        except Exception:
            log.exception("sampling failed; tick skipped")
            return
        self.metrics.sample_seconds.observe(time.perf_counter() - t0)
        self.metrics.samples.inc()
        self.metrics.containers.set(len(msg.containers))
        self.metrics.containers_empty.set(self.sampler.empty)
        modes = {"off": 0, "recommend": 0, "apply": 0}
        refused = 0
        for c in msg.containers:
            if c.workload is not None:
                modes[c.workload.mode] += 1
                refused += c.workload.error is not None
        for mode, n in modes.items():
            self.metrics.workloads.labels(mode=mode).set(n)
        self.metrics.workloads_refused.set(refused)
        self.publisher.submit(self._key, encode(msg))
        self.ticks += 1

    def run(self, stop: threading.Event, max_ticks: int | None = None) -> None:
        """Tick every ``interval_s`` until *stop* is set (or *max_ticks* published)."""
        interval = self.settings.producer.interval_s
        self._beat()
        self.baseline()
        start = self.monotonic()
        k = 0
        while not stop.is_set() and (max_ticks is None or self.ticks < max_ticks):
            k += 1
            due = start + k * interval
            while not stop.is_set():
                self._beat()
                left = due - self.monotonic()
                if left <= 0:
                    break
                self.publisher.pump(min(left, 0.1))
            if stop.is_set():
                break
            self.tick()
            late = self.monotonic() - (start + (k + 1) * interval)
            if late > 0:
                skip = math.ceil(late / interval)
                log.warning("sampling overran the %.3g s interval; skipping %d tick(s)", interval, skip)
                k += skip

    def close(self, timeout_s: float) -> int:
        """Flush for up to *timeout_s*; returns messages that could not be delivered."""
        left = self.publisher.flush(timeout_s)
        if left:
            log.warning("stopping with %d sample message(s) undelivered after %.1f s", left, timeout_s)
        else:
            log.info("all sample messages delivered (%d)", self.publisher.delivered)
        self.sampler.close()
        return left


def _ensure_topics_until_ok(settings: Settings, stop: threading.Event) -> None:
    """Create the samples topic, retrying in the background while the broker is away."""
    from phasewise.kit.kafka.client import ensure_topics, listening

    warned = False
    while not stop.is_set():
        try:
            if not listening(settings.kafka.bootstrap):
                raise ConnectionError(f"nothing listens at {settings.kafka.bootstrap}")
            ensure_topics(settings, [SAMPLES], timeout_s=5.0)
            return
        except Exception as e:  # noqa: BLE001 - retried until the broker answers
            if not warned:
                log.warning("cannot create topic %s yet (%s); retrying in the background", SAMPLES.name, e)
                warned = True
            stop.wait(2.0)


# --------------------------------------------------------------------------- CLI role


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import add_common, add_setting

    add_common(p)
    for name in ("interval_s", "cgroup_root", "cgroup_prefix", "cgroup_layout", "cgroup_parent", "metrics_port",
                 "bind_address", "flush_timeout_s", "workload_default_mode", "workload_policy_file", "workload_pods"):
        add_setting(p, name)
    p.add_argument("--once", action="store_true",
                   help="print one HostSamples JSON (after one interval) to stdout and exit; no Kafka")
    p.add_argument("--json", action="store_true",
                   help="with --once: print only {\"containers\": [...]} (each with its identity and policy)")


def run(args: argparse.Namespace) -> int:
    from phasewise.kit.cgroups.fs import CgroupError
    from phasewise.kit.command import settings_from_args, stop_on_signals
    from phasewise.producers.sampler import HostSampler

    settings = settings_from_args(args)
    once = bool(getattr(args, "once", False))
    as_json = bool(getattr(args, "json", False))
    if as_json and not once:
        print("phasewise produce: error: --json goes with --once", file=sys.stderr)
        return 2
    from phasewise.kit.cgroups.workloads import layout_from_settings, workloads_from_settings
    from phasewise.models.safety.workload import WorkloadError

    try:
        layout = layout_from_settings(settings)
    except CgroupError as e:
        print(f"phasewise produce: error: cgroup_root: {e}", file=sys.stderr)
        return 2
    try:
        workloads = workloads_from_settings(settings, layout)
    except WorkloadError as e:
        print(f"phasewise produce: error: workload_policy_file: {e}", file=sys.stderr)
        return 2
    print(settings.describe(), file=sys.stderr if once else sys.stdout, flush=True)
    sampler = HostSampler(layout, proc_root=settings.producer.proc_root, host=settings.host, workloads=workloads)
    log.info("sampling cgroup v%d containers under %s (layout %s, prefix %r%s) every %g s",
             layout.version, layout.root, layout.layout, layout.prefix,
             f", parent {layout.parent!r}" if layout.parent else "", settings.producer.interval_s)

    if once:
        sampler.sample()
        time.sleep(settings.producer.interval_s)
        msg = sampler.sample()
        if as_json:
            import json

            from phasewise.kit.records import to_dict

            print(json.dumps({"containers": [to_dict(c) for c in msg.containers]}), flush=True)
        else:
            print(encode(msg).decode(), flush=True)
        if not msg.containers:
            print(f"phasewise produce: no containers under prefix {layout.prefix!r} (layout {layout.layout}) in "
                  f"{layout.root}; `phasewise demo` runs its jobs under --cgroup-prefix phasewise-demo",
                  file=sys.stderr)
        sampler.close()
        return 0

    agent = Agent(settings, sampler)
    if settings.metrics_port:
        from phasewise.kit.observe import serve

        serve(agent.metrics.registry, settings.metrics_port, agent.health, settings.bind_address)
        log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", settings.bind_address,
                 settings.metrics_port)
    stop = threading.Event()
    with stop_on_signals(stop) as received:
        if settings.kafka.create_topics:
            threading.Thread(target=_ensure_topics_until_ok, args=(settings, stop), name="ensure-topics",
                             daemon=True).start()
        agent.run(stop)
    if received:
        log.info("signal %d: stopping", received[0])
    flush_s = settings.producer.flush_timeout_s
    from phasewise.kit.kafka.client import listening

    if agent.publisher.pending and not listening(settings.kafka.bootstrap):
        log.warning("nothing listens at %s: not waiting for it to flush", settings.kafka.bootstrap)
        flush_s = 0.0
    agent.close(flush_s)
    return 0
