"""``phasewise actuate``: the Kafka loop and the command line around the actuator's step.

The step is :class:`phasewise.actuators.actuator.Actuator`. The loop reads
this host's partition of the decisions topic (its own consumer group,
:func:`own_partition`), hands each message to the step, commits offsets only
after the actuations were delivered, and stops cleanly on SIGTERM / SIGINT.
Partitions, delivery and restarts: docs/operations.md, "The actuator".
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import Backend, CgroupBackend, DryRunBackend, JobSetupError, job_runtime
from phasewise.actuators.ledger import Ledger, ledger_path
from phasewise.actuators.ledger_loss import verify_ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.job_signing import JobSigningError, SubmitterKeys, trusted_submitters
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring, SigningError, keyring_of
from phasewise.kit.statedir import StateDirError, ensure_state_dir
from phasewise.kit.topics import DECISIONS

__all__ = ["Actuator", "add_arguments", "group_id", "make_backend", "run", "run_actuator", "serve", "submitters_of"]

log = logging.getLogger("phasewise.actuator")


def group_id(host: str) -> str:
    return f"phasewise-actuator-{host}"



# --------------------------------------------------------------------------- the loop


def record_time(m: Any) -> float | None:
    """A consumed record's Kafka timestamp in seconds (None where the record has none)."""
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

    kind, ms = m.timestamp()
    return None if kind == TIMESTAMP_NOT_AVAILABLE or ms is None or ms <= 0 else ms / 1000.0


def own_partition(consumer: Any, key: bytes, topic: str = DECISIONS.name) -> Callable[[Any, list], None]:
    """An ``on_assign`` callback that keeps, of the partitions the group assigns, the one holding *key*.

    The partition is :func:`phasewise.kit.kafka.partitions.partition_for` over the
    topic's partition count, read from the broker at each assignment (a topic
    that grew partitions moves the key, and the group rebalances). A second
    actuator of the same host (a rolling update) joins the same group: the
    partition is assigned to one of them, which alone reads it.
    """
    from phasewise.kit.kafka.partitions import partition_for

    def on_assign(c: Any, partitions: list) -> None:
        md = consumer.list_topics(topic, timeout=10).topics.get(topic)
        n = len(md.partitions) if md is not None and md.partitions else 0
        mine = partition_for(key, n) if n else None
        keep = [tp for tp in partitions if tp.topic == topic and tp.partition == mine]
        consumer.assign(keep)
        log.info("assigned %s; reading %s (partition of key %r among %d)",
                 sorted(tp.partition for tp in partitions),
                 f"partition {mine}" if keep else "nothing (another member of the group has it)", key, n)

    return on_assign


def serve(actuator: Actuator, consumer: Any, producer: Any, stop: threading.Event, *,
          batch: int = 100, poll_s: float = 0.5, only_key: bytes | None = None, health: Any = None) -> None:
    """Consume decisions until *stop* is set: handle, flush, then commit.

    Every message is handled (a malformed one is dead-lettered); only an error
    that is not about a message (ledger, backend, Kafka) ends the loop, after
    the offsets of the messages handled so far were committed. *only_key*: read
    only the partition records with this key go to (:func:`own_partition`).
    """
    from confluent_kafka import KafkaException

    if only_key is None:
        consumer.subscribe([DECISIONS.name])
    else:
        consumer.subscribe([DECISIONS.name], on_assign=own_partition(consumer, only_key))
    # a terminate waits out its grace (at most terminate_grace_max_s) and then its processes' end: a
    # message may take that long, and the loop is live while it does
    live_s = max(30.0, 10 * poll_s) + actuator.settings.actuator.terminate_grace_max_s
    while not stop.is_set():
        if health is not None:
            health.beat("consume", live_s)
        actuator.follow_up()  # watched resizes (update-mode in-place-or-recreate) due a check
        actuator.watched_gauge()
        # block for the first decision only, then take what is already there:
        # consume(n, timeout) alone would wait the whole timeout for n messages
        first = consumer.poll(poll_s)
        if first is None:
            continue
        msgs = [first, *consumer.consume(batch - 1, 0)]
        offsets: dict[tuple[str, int], int] = {}  # past the messages handled (applied, reported or dead-lettered)
        try:
            for m in msgs:
                if health is not None:
                    health.beat("consume", live_s)
                err = m.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    log.warning("consumer error on %s[%s]: %s", m.topic(), m.partition(), err)
                    continue
                actuator.handle(m.value(), m.key(), m.partition(), m.offset(), topic=m.topic(),
                                headers=m.headers(), produced_at=record_time(m))
                offsets[(m.topic(), m.partition())] = m.offset() + 1
        except BaseException:
            # not a record (those are dead-lettered): the ledger, the backend or Kafka failed. The
            # messages handled so far are committed, the rest is redelivered to the next actuator.
            _commit_handled(consumer, producer, offsets, stop)
            raise
        _commit_handled(consumer, producer, offsets, stop)


#: seconds a batch's actuations get to be delivered before its offsets are left uncommitted
COMMIT_FLUSH_S = 30.0


def _commit_handled(consumer: Any, producer: Any, offsets: dict[tuple[str, int], int],
                    stop: threading.Event | None = None) -> None:
    """Commit *offsets* once every actuation and dead letter produced so far is delivered.

    Waits up to :data:`COMMIT_FLUSH_S`, in short slices so that a stop asked
    for meanwhile (the broker gone, SIGTERM) ends the wait at once: the batch
    is then not committed, and its redelivery is answered by the ledger.
    """
    from confluent_kafka import KafkaException, TopicPartition

    deadline = time.monotonic() + COMMIT_FLUSH_S
    while True:
        left = producer.flush(max(0.0, min(0.5, deadline - time.monotonic())))
        if not left or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            break
    if left:
        # not committing: the batch is redelivered and the ledger reports it as duplicates
        log.error("%d actuation/dead-letter messages undelivered%s; offsets not committed", left,
                  " at stop" if stop is not None and stop.is_set() else f" after {COMMIT_FLUSH_S:g} s")
        return
    if offsets:
        try:
            consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                            asynchronous=False)
        except KafkaException as e:
            log.warning("offset commit failed (the ledger covers redelivery): %s", e)


def make_backend(settings: Settings) -> Backend:
    """The backend the settings name.

    Dry-run, when the cgroup tree is there, reads real memory usage and whether
    a container exists from it (a missing one is rejected, as the cgroup
    backend rejects it); without a tree, every container with a managed name
    counts as existing, and the start-up line says so.
    """
    from phasewise.kit.cgroups.fs import CgroupError
    from phasewise.kit.cgroups.workloads import layout_from_settings

    a = settings.actuator
    if a.backend == "cgroup":
        # JobSetupError: a job user this host cannot switch to (checked at start-up, not at the first job)
        jobs = job_runtime(settings) if a.start_jobs else None
        return CgroupBackend(layout_from_settings(settings), jobs=jobs)
    if settings.actuator.backend == "kubernetes":
        from phasewise.actuators.backends.kubernetes import KubeApi, KubernetesBackend, PodDirectory, RecreatePolicy

        url = settings.actuator.kube_api
        api = KubeApi(url) if url else KubeApi.in_cluster()  # ValueError: not in a cluster, bad URL
        # the node's cgroup tree (CgroupError without one): a container is acted on only where it is
        # discovered there, so the per-workload mode is resolved from its real identity
        layout = layout_from_settings(settings)
        return KubernetesBackend(api, PodDirectory(api, settings.host), present=layout.exists, node=settings.host,
                                 recreate=RecreatePolicy(deferred_timeout_s=a.kube_resize_deferred_timeout_s,
                                                         in_progress_timeout_s=a.kube_resize_in_progress_timeout_s,
                                                         check_s=a.kube_resize_check_s))
    jobs = job_runtime(settings, switches=False) if a.start_jobs else None  # described, never switched to
    try:
        real = CgroupBackend(layout_from_settings(settings))
    except CgroupError as e:
        log.info("dry run without a cgroup tree (%s): memory usage unknown, every well-named container "
                 "counts as existing", e)
        return DryRunBackend(jobs=jobs)
    return DryRunBackend(usage=real.memory_usage, exists=real.exists, jobs=jobs)


#: seconds a stopping actuator waits for its last messages' delivery
FINAL_FLUSH_S = 3.0


def run_actuator(settings: Settings, backend: Backend, stop: threading.Event, *,
                 metrics: ActuatorMetrics | None = None, ledger: Ledger | None = None,
                 host_cores: float | None = None, workloads: Any = None,
                 keyring: Keyring | None = None, health: Any = None,
                 submitters: SubmitterKeys | None = None) -> None:
    """Build the Kafka clients and ledger, then :func:`serve` until *stop* is set.

    With ``create_topics``, first waits for the broker (saying so every few
    seconds) or for *stop*. At the end, actuations not yet delivered get
    :data:`FINAL_FLUSH_S` and are counted in the log if still undelivered.
    """
    from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer, wait_for_broker

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
    if keyring is None:
        keyring = keyring_of(settings)
    if submitters is None:
        submitters = submitters_of(settings)
    actuator = Actuator(settings, backend, ledger, producer, metrics=metrics, host_cores=host_cores,
                        workloads=workloads, keyring=keyring, submitters=submitters)
    consumer = make_consumer(settings, group_id(settings.host), **lag_statistics(actuator.metrics))
    only = settings.host.encode() if settings.actuator.read_partitions == "host" else None
    if actuator.replicas is not None and (n := actuator.replicas.reopen()):  # the endpoints it served before
        log.info("reopened %d service endpoint(s)", n)
    try:
        # a new ledger that replaces a lost one is restored before anything is applied
        if not verify_ledger(settings, ledger, consumer, actuator.metrics, stop, group=group_id(settings.host)):
            return
        # the jobs a previous actuator started: watched again, or reported as ended while it was away
        found = actuator.recover()
        if any(found.values()):
            log.info("registry of started jobs: %d running (watched again), %d ended while no actuator watched, "
                     "%d ends published now", found["watched"], found["ended"], found["republished"])
        serve(actuator, consumer, producer, stop, only_key=only, health=health)
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()  # stop watching its jobs: they run on, and the next actuator finds them again
        consumer.close()
        if actuator.replicas is not None:  # (the replicas run on; their endpoints reopen at the next start)
            actuator.replicas.close()
        left = producer.flush(FINAL_FLUSH_S)
        if left:
            # their decisions' offsets were not committed: they come again and the ledger answers "duplicate"
            log.error("stopping with %d actuation/dead-letter message(s) undelivered after %g s", left,
                      FINAL_FLUSH_S)
        if own_ledger:
            ledger.close()


def submitters_of(settings: Settings) -> SubmitterKeys | None:
    """The keys ``job_trusted_submitters`` names (``None``: it is empty); :class:`JobSigningError` (one line)."""
    return trusted_submitters(settings.jobs.trusted_submitters)


def lag_statistics(metrics: ActuatorMetrics, every_ms: int = 5000) -> dict[str, Any]:
    """Consumer options that keep ``phasewise_actuator_consumer_lag{topic}`` current (librdkafka statistics)."""
    from phasewise.kit.kafka.client import lag_by_topic

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
    from phasewise.kit.command import add_common, add_setting

    add_common(p)
    for name in ("backend", "kube_api", "cgroup_root", "cgroup_prefix", "cgroup_layout", "cgroup_parent",
                 "cpu_floor_cores", "mem_margin_bytes", "mem_floor_bytes", "metrics_port", "bind_address", "data_dir",
                 "workload_default_mode", "workload_policy_file", "workload_pods", "terminate_grace_s",
                 "terminate_grace_max_s", "cpu_weight_min", "cpu_weight_max", "actuator_start_jobs", "job_user",
                 "job_group", "job_trusted_submitters", "job_spec_max_age_s", "job_allowed_commands"):
        add_setting(p, name, help={"data_dir": "where the ledger of applied decisions lives"}.get(name))


def run(args: argparse.Namespace) -> int:
    from phasewise.kit.cgroups.fs import CgroupError
    from phasewise.kit.cgroups.workloads import layout_from_settings, workloads_from_settings
    from phasewise.kit.command import settings_from_args, stop_on_signals
    from phasewise.models.safety.workload import WorkloadError

    settings = settings_from_args(args)
    try:
        keyring = keyring_of(settings)
        submitters = submitters_of(settings)
    except (SigningError, JobSigningError) as e:
        print(f"phasewise actuate: error: {e}", file=sys.stderr)
        return 2
    if settings.actuator.start_jobs and submitters is None:
        print("phasewise actuate: error: actuator_start_jobs is on but job_trusted_submitters is empty: "
              "name the public keys of the submitters whose signed jobs this actuator may start "
              "(phasewise keys submitter PATH writes a pair)", file=sys.stderr)
        return 2
    try:
        # 0711: the jobs it starts, as job_user, reach their working directories below it; list nothing
        ensure_state_dir(settings.data_dir, mode=0o711)
    except StateDirError as e:
        print(f"phasewise actuate: error: data_dir: {e}", file=sys.stderr)
        return 2
    try:
        backend = make_backend(settings)
    except JobSetupError as e:
        print(f"phasewise actuate: error: {e}", file=sys.stderr)
        return 2
    except CgroupError as e:
        print(f"phasewise actuate: error: cgroup_root: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the kubernetes backend's configuration
        print(f"phasewise actuate: error: kube_api: {e}", file=sys.stderr)
        return 2
    try:
        workloads = workloads_from_settings(settings, layout_from_settings(settings))
    except CgroupError:
        workloads = None  # dry run without a cgroup tree: the default mode decides
    except WorkloadError as e:
        print(f"phasewise actuate: error: workload_policy_file: {e}", file=sys.stderr)
        return 2
    print(settings.describe(), flush=True)
    jobs = getattr(backend, "jobs", None)
    if jobs is not None:
        starts = f"{'would start' if backend.name == 'dry-run' else 'starts'} jobs as {jobs.who()} in {jobs.work_root}"
    else:
        starts = "starts no jobs" + (" (actuator_start_jobs is off)" if backend.name != "kubernetes" else "")
    print(f"actuator: backend={backend.name} group={group_id(settings.host)} "
          f"ledger={ledger_path(settings.data_dir, settings.host)} host_cores={os.cpu_count()} {starts}", flush=True)
    if settings.actuator.start_jobs and submitters is not None:
        print("actuator: starts the jobs signed by the trusted submitter keys " + submitters.describe(), flush=True)

    metrics = ActuatorMetrics()
    from phasewise.kit.kafka.client import kafka_log
    from phasewise.kit.observe import Health

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
        from phasewise.kit.observe import serve as serve_http

        serve_http(metrics.registry, settings.metrics_port, health, settings.bind_address)
        log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", settings.bind_address,
                 settings.metrics_port)

    stop = threading.Event()
    try:
        with stop_on_signals(stop) as received:
            run_actuator(settings, backend, stop, metrics=metrics, workloads=workloads, keyring=keyring, health=health,
                         submitters=submitters)
    except Exception:
        log.critical("actuator failed; exiting with status 1 (unhandled messages are redelivered)", exc_info=True)
        return 1
    if received:
        log.info("%s: stopped", signal.Signals(received[0]).name)
    log.info("actuator stopped")
    return 0
