"""``phasewise actuate``: apply this host's decisions to its containers and report each.

For every message on the decisions topic the actuator:

1. decodes it as a :class:`~phasewise.schemas.Decision`; a message it cannot
   decode (a null value, any bytes, any size, nesting or numbers too large to
   parse, wrong types or values) goes to the dead-letter topic with the
   reason, partition and offset (a payload too large for
   ``dead_letter_max_bytes`` cut and marked ``truncated``) and the actuator
   carries on;
2. skips decisions for other hosts (see "Why every partition" below);
3. claims the decision id in the ledger; an id already there is reported as
   ``duplicate`` and not applied again;
4. plans a command under the safety rules (managed, existing container;
   CPU floor and host cap; memory never under usage, or the recent peak
   working set, + margin);
5. applies it through the backend (``cgroup`` or ``dry-run``), retrying
   temporary errors a few times with doubling backoff;
6. records the outcome in the ledger and publishes an
   :class:`~phasewise.schemas.Actuation` (key: host, with ``decision_ts`` so
   decision-to-actuation latency can be measured);
7. commits the offsets only after the actuations were delivered. Kafka
   delivery is at least once; with the ledger each decision id is applied at
   most once. An error that is no message's (ledger, backend, Kafka) stops
   the actuator with exit status 1 after committing the messages it handled.

Why every partition: decisions are keyed by host, so one host's decisions
stay in order in one partition, but which partition depends on the producing
client's partitioner (Faust/aiokafka and librdkafka hash keys differently)
and on the partition count an operator chose. So each host's actuator uses
its own consumer group (``phasewise-actuator-<host>``), reads all partitions
and ignores other hosts' decisions, which is correct for any producer and
costs little: decisions are a few per container per minute.

Stops cleanly on SIGTERM / SIGINT (finishes the batch in hand, flushes,
commits, leaves the group), also while it waits for an unreachable broker,
which it reports in one line every few seconds.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from phasewise.actuators.backends import Backend, CgroupBackend, DryRunBackend
from phasewise.actuators.commands import Outcome
from phasewise.actuators.ledger import Ledger, ledger_path
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.actuators.safety import PeakTracker, Planned, declared_peak, is_managed_name, plan
from phasewise.schemas import Actuation, Decision, SchemaError, brief, decode, encode
from phasewise.settings import Settings
from phasewise.topics import ACTUATIONS, DECISIONS

__all__ = ["Actuator", "add_arguments", "group_id", "make_backend", "run", "run_actuator", "serve"]

log = logging.getLogger("phasewise.actuator")


class _Produces(Protocol):
    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, **kw: Any) -> None: ...

    def poll(self, timeout: float = ...) -> int: ...


def group_id(host: str) -> str:
    return f"phasewise-actuator-{host}"


class Actuator:
    """Turns one decisions-topic message into at most one applied command and its Actuation.

    Kafka-free apart from ``producer.produce`` (actuations, dead letters), so
    :meth:`handle` is tested with any object that has ``produce`` and ``poll``.
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        ledger: Ledger,
        producer: _Produces,
        *,
        metrics: ActuatorMetrics | None = None,
        host_cores: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.ledger = ledger
        self.producer = producer
        self.metrics = ActuatorMetrics() if metrics is None else metrics
        self.host_cores = float(host_cores if host_cores is not None else (os.cpu_count() or 1))
        self.clock = clock
        self.sleep = sleep
        #: the working sets this actuator read, for the memory floor's recent peak
        self.peaks = PeakTracker(settings.safety.peak_window_s)

    # ------------------------------------------------------------------ one message

    def handle(self, decision_bytes: bytes | None, key: bytes | None, partition: int | None,
               offset: int | None, *, topic: str = DECISIONS.name,
               produced_at: float | None = None) -> Actuation | None:
        """Handle one message; returns the published Actuation, or ``None`` (dead-lettered / other host).

        *produced_at*: the record's Kafka timestamp (s), for the decision-to-actuation latency.
        """
        from phasewise.kafka import (
            publish_dead_letter,  # confluent_kafka only where a message is bad
        )

        try:
            d = decode(Decision, decision_bytes)
            reason = None
        except SchemaError as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - decode raises SchemaError only; a record never stops the actuator
            log.exception("decoding a decision failed")
            reason = f"could not decode: {type(e).__name__}: {e}"
        if reason is not None:
            log.warning("malformed decision at %s[%s]@%s: %s", topic, partition, offset, brief(reason, 300))
            publish_dead_letter(self.producer, source_topic=topic, reason=reason, payload=decision_bytes,
                                key=key, partition=partition, offset=offset,
                                max_bytes=self.settings.kafka.dead_letter_max_bytes)
            self.metrics.dead_letters.inc()
            return None
        if d.host != self.settings.host:
            log.debug("decision %s is for host %s, not %s: skipped", d.id, d.host, self.settings.host)
            self.metrics.ignored.inc()
            return None

        if not self.ledger.claim(d.id, container=d.container, now=self.clock()):
            prev = self.ledger.get(d.id)
            what = (f"{prev.status}" if prev and prev.status else "interrupted before its outcome was recorded")
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(prev.claimed)) if prev else "?"
            msg = f"decision already handled at {when}: {what}; not applied again"
            return self._publish(d, Outcome("duplicate", msg))

        try:
            outcome = self._decide_and_apply(d)
        except Exception as e:  # a bug must still leave a report and a ledger entry, not a silent claim
            log.exception("error handling decision %s", d.id)
            outcome = Outcome.failed(f"actuator error: {type(e).__name__}: {e}")
        self.ledger.finish(d.id, outcome.status, outcome.message)
        if produced_at is not None:
            self.metrics.decision_latency.observe(max(0.0, self.clock() - produced_at))
        return self._publish(d, outcome)

    def _decide_and_apply(self, d: Decision) -> Outcome:
        exists = is_managed_name(d.container) and self.backend.exists(d.container)
        usage = peak = None
        if exists and d.action == "limit" and d.mem_limit_bytes is not None:
            usage = self.backend.memory_usage(d.container)
            now = self.clock()
            if usage is not None and math.isfinite(usage) and usage >= 0:
                self.peaks.add(d.container, now, usage)
            own = self.peaks.peak(d.container, now)
            peak = max((v for v in (own, declared_peak(d)) if v is not None), default=None)
        p = plan(d, exists=exists, usage_mem_bytes=usage, host_cores=self.host_cores, settings=self.settings,
                 peak_mem_bytes=peak)
        if not isinstance(p, Planned):
            return Outcome("rejected", p.reason)
        out = self._apply_with_retries(p)
        if out.status != "applied":
            return out
        msg = "; ".join(m for m in (p.message, out.message) if m)
        return Outcome(p.status, msg, out.cpu_cores, out.mem_bytes)

    def _apply_with_retries(self, p: Planned) -> Outcome:
        s = self.settings
        t0 = time.perf_counter()
        attempts = max(0, s.actuator.apply_retries) + 1
        for attempt in range(attempts):
            try:
                out = self.backend.apply(p.command)
            except Exception as e:  # a backend bug must not lose the decision's report
                log.exception("backend %s raised on %r", self.backend.name, p.command)
                out = Outcome.failed(f"backend {self.backend.name} raised {type(e).__name__}: {e}")
            if out.status != "failed" or not out.temporary:
                break
            if attempt + 1 == attempts:
                out = Outcome.failed(f"{out.message} (temporary error; gave up after {attempts} attempts)",
                                     temporary=True, cpu_cores=out.cpu_cores, mem_bytes=out.mem_bytes)
                break
            delay = s.actuator.apply_retry_backoff_s * 2**attempt
            log.warning("temporary error applying %r (attempt %d/%d), retrying in %.2fs: %s",
                        p.command, attempt + 1, attempts, delay, out.message)
            self.metrics.retries.inc()
            self.sleep(delay)
        self.metrics.apply_seconds.observe(time.perf_counter() - t0)
        return out

    def _publish(self, d: Decision, out: Outcome) -> Actuation:
        def finite(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else float(x)

        act = Actuation(
            decision_id=d.id,
            ts=self.clock(),
            host=self.settings.host,
            container=d.container,
            status=out.status,
            backend=self.backend.name,
            message=out.message,
            cpu_limit_cores=finite(out.cpu_cores),
            mem_limit_bytes=finite(None if out.mem_bytes is None else float(out.mem_bytes)),
            decision_ts=d.ts,
        )
        self.producer.produce(ACTUATIONS.name, key=self.settings.host.encode(), value=encode(act))
        self.producer.poll(0)
        self.metrics.decisions.labels(status=out.status).inc()
        level = logging.WARNING if out.status in ("failed", "rejected") else logging.INFO
        log.log(level, "decision %s (%s %s, policy %s): %s %s", d.id, d.action, d.container, d.policy,
                out.status, out.message)
        return act


# --------------------------------------------------------------------------- the loop


def record_time(m: Any) -> float | None:
    """A consumed record's Kafka timestamp in seconds (None where the record has none)."""
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

    kind, ms = m.timestamp()
    return None if kind == TIMESTAMP_NOT_AVAILABLE or ms is None or ms <= 0 else ms / 1000.0


def serve(actuator: Actuator, consumer: Any, producer: Any, stop: threading.Event, *,
          batch: int = 100, poll_s: float = 0.5, health: Any = None) -> None:
    """Consume decisions until *stop* is set: handle, flush, then commit.

    Every message is handled (a malformed one is dead-lettered); only an error
    that is not about a message (ledger, backend, Kafka) ends the loop, after
    the offsets of the messages handled so far were committed.
    """
    from confluent_kafka import KafkaException

    consumer.subscribe([DECISIONS.name])
    while not stop.is_set():
        if health is not None:
            health.beat("consume", max(30.0, 10 * poll_s))
        # block for the first decision only, then take what is already there:
        # consume(n, timeout) alone would wait the whole timeout for n messages
        first = consumer.poll(poll_s)
        if first is None:
            continue
        msgs = [first, *consumer.consume(batch - 1, 0)]
        offsets: dict[tuple[str, int], int] = {}  # past the messages handled (applied, reported or dead-lettered)
        try:
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    log.warning("consumer error on %s[%s]: %s", m.topic(), m.partition(), err)
                    continue
                actuator.handle(m.value(), m.key(), m.partition(), m.offset(), topic=m.topic(),
                                produced_at=record_time(m))
                offsets[(m.topic(), m.partition())] = m.offset() + 1
        except BaseException:
            # not a record (those are dead-lettered): the ledger, the backend or Kafka failed. The
            # messages handled so far are committed, the rest is redelivered to the next actuator.
            _commit_handled(consumer, producer, offsets)
            raise
        _commit_handled(consumer, producer, offsets)


def _commit_handled(consumer: Any, producer: Any, offsets: dict[tuple[str, int], int]) -> None:
    """Commit *offsets* once every actuation and dead letter produced so far is delivered."""
    from confluent_kafka import KafkaException, TopicPartition

    left = producer.flush(30)
    if left:
        # not committing: the batch is redelivered and the ledger reports it as duplicates
        log.error("%d actuation/dead-letter messages undelivered after 30 s; offsets not committed", left)
        return
    if offsets:
        try:
            consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                            asynchronous=False)
        except KafkaException as e:
            log.warning("offset commit failed (the ledger covers redelivery): %s", e)


def make_backend(settings: Settings) -> Backend:
    """The backend the settings name; dry-run reads real memory usage when the cgroup tree is there."""
    from phasewise.cgroupfs import CgroupError, CgroupLayout

    if settings.actuator.backend == "cgroup":
        return CgroupBackend(CgroupLayout(settings.cgroup.root, settings.cgroup.prefix))
    try:
        layout = CgroupLayout(settings.cgroup.root, settings.cgroup.prefix)
        reader = CgroupBackend(layout).memory_usage
    except CgroupError:
        reader = None
    return DryRunBackend(usage=reader)


#: seconds a stopping actuator waits for its last messages' delivery
FINAL_FLUSH_S = 3.0


def run_actuator(settings: Settings, backend: Backend, stop: threading.Event, *,
                 metrics: ActuatorMetrics | None = None, ledger: Ledger | None = None,
                 host_cores: float | None = None, health: Any = None) -> None:
    """Build the Kafka clients and ledger, then :func:`serve` until *stop* is set.

    With ``create_topics``, first waits for the broker (saying so every few
    seconds) or for *stop*. At the end, actuations not yet delivered get
    :data:`FINAL_FLUSH_S` and are counted in the log if still undelivered.
    """
    from phasewise.kafka import ensure_topics, make_consumer, make_producer, wait_for_broker

    if settings.kafka.create_topics:
        if not wait_for_broker(settings, None, stop=stop):
            return
        ensure_topics(settings)
    own_ledger = ledger is None
    if ledger is None:
        ledger = Ledger(ledger_path(settings.data_dir, settings.host),
                        max_age_s=settings.actuator.ledger_max_age_days * 86400,
                        max_rows=settings.actuator.ledger_max_rows)
    producer = make_producer(settings, on_delivery=_delivery_report)
    actuator = Actuator(settings, backend, ledger, producer, metrics=metrics, host_cores=host_cores)
    consumer = make_consumer(settings, group_id(settings.host), **lag_statistics(actuator.metrics))
    try:
        serve(actuator, consumer, producer, stop, health=health)
    finally:
        consumer.close()
        left = producer.flush(FINAL_FLUSH_S)
        if left:
            # their decisions' offsets were not committed: they come again and the ledger answers "duplicate"
            log.error("stopping with %d actuation/dead-letter message(s) undelivered after %g s", left,
                      FINAL_FLUSH_S)
        if own_ledger:
            ledger.close()


def lag_statistics(metrics: ActuatorMetrics, every_ms: int = 5000) -> dict[str, Any]:
    """Consumer options that keep ``phasewise_actuator_consumer_lag{topic}`` current (librdkafka statistics)."""
    from phasewise.kafka import lag_by_topic

    def on_stats(doc: str) -> None:
        try:
            lags = lag_by_topic(doc)
        except ValueError:
            return
        for topic, lag in lags.items():
            if topic == DECISIONS.name:  # the one topic this consumer reads: a bounded label
                metrics.consumer_lag.labels(topic=topic).set(lag)

    return {"statistics.interval.ms": every_ms, "stats_cb": on_stats}


def _delivery_report(err: Any, msg: Any) -> None:
    if err is not None:
        log.error("could not deliver to %s: %s", msg.topic(), err)


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.cli import add_common, add_setting

    add_common(p)
    for name in ("backend", "cgroup_root", "cgroup_prefix", "cpu_floor_cores", "mem_margin_bytes",
                 "mem_floor_bytes", "metrics_port", "data_dir"):
        add_setting(p, name, help={"data_dir": "where the ledger of applied decisions lives"}.get(name))


def run(args: argparse.Namespace) -> int:
    from phasewise.cgroupfs import CgroupError
    from phasewise.cli import settings_from_args, stop_on_signals

    settings = settings_from_args(args)
    try:
        backend = make_backend(settings)
    except CgroupError as e:
        print(f"phasewise actuate: error: cgroup_root: {e}", file=sys.stderr)
        return 2
    print(settings.describe(), flush=True)
    print(f"actuator: backend={backend.name} group={group_id(settings.host)} "
          f"ledger={ledger_path(settings.data_dir, settings.host)} host_cores={os.cpu_count()}", flush=True)

    metrics = ActuatorMetrics()
    from phasewise.kafka import kafka_log
    from phasewise.observe import Health

    klog = kafka_log(settings.kafka.bootstrap)

    def not_ready() -> str | None:
        if health.since("consume") is None:
            return f"waiting for the broker at {settings.kafka.bootstrap}"
        why = klog.outage()
        if why is not None:
            return f"no Kafka broker answers at {settings.kafka.bootstrap} ({why})"
        return None

    #: live while the consume loop turns (or the wait for the broker does); ready while consuming
    health = Health(ready=not_ready)
    health.beat("start", 1e9)  # the wait for the broker at start-up may last: live, not ready
    if settings.metrics_port:
        from phasewise.observe import serve as serve_http

        serve_http(metrics.registry, settings.metrics_port, health, settings.bind_address)
        log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", settings.bind_address,
                 settings.metrics_port)

    stop = threading.Event()
    try:
        with stop_on_signals(stop) as received:
            run_actuator(settings, backend, stop, metrics=metrics, health=health)
    except Exception:
        log.critical("actuator failed; exiting with status 1 (unhandled messages are redelivered)", exc_info=True)
        return 1
    if received:
        log.info("%s: stopped", signal.Signals(received[0]).name)
    log.info("actuator stopped")
    return 0
