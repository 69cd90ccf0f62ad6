"""``phasewise worker``: the Faust stream processor (samples -> VPA limit decisions).

Reads ``HostSamples`` from the samples topic, keeps a VPA recommender per
container (state in a changelogged table, so a restarted worker recovers it),
and writes a ``Decision`` to the decisions topic whenever a container's
recommended limit moves by more than the hysteresis. A record it cannot
decode or process (whatever its size, nesting or bytes) goes to the
dead-letter topic with the reason. Start several workers with the same
``worker_id`` to split the hosts between them.

Start-up: print the settings, wait for the broker (saying so in one line
every few seconds; SIGTERM or SIGINT end the wait, exit status 0), create
missing topics, start a Faust worker in this process (log levels map to
Faust's crit|error|warn|info|debug; the Kafka client's repeated lines are
folded). SIGTERM and SIGINT stop it cleanly (Faust's worker installs those
handlers; it also installs SIGUSR1 to log a stack dump). Exit status 0 after
a clean stop; 1 when an agent died (on anything but a record, which is
dead-lettered) or an output could not be delivered: nothing is committed
after that, and a restarted worker takes over from the last commit.

The decision logic itself is pure and usable without Faust:
:func:`phasewise.models.vpa_updater.process_host_samples` and
:class:`phasewise.models.phase_updater.PhaseHooks`. Flags and settings are
checked before torch loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable

from phasewise.cli import add_common, add_setting, settings_from_args, stop_on_signals
from phasewise.settings import Settings

__all__ = ["FAUST_LEVELS", "add_arguments", "run"]

log = logging.getLogger(__name__)

#: phasewise log level -> Faust / mode log level
FAUST_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error", "critical": "crit"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    for name in ("recommend_interval_s", "hysteresis", "data_dir", "web_port", "metrics_port", "worker_id",
                 "policy", "phase_workloads", "phase_snapshot_interval_s", "phase_learn_every", "phase_learn_batch",
                 "phase_warmup",
                 "phase_statistics", "phase_features", "container_ttl_s", "vpa_time_scale", "targets_enabled",
                 "targets_policy", "targets_shrink", "targets_share_alpha", "targets_share_interval_s",
                 "targets_grace_s", "priority_agent", "priority_freeze_max_wait_s", "priority_grace_s",
                 "priority_cpu_weights", "priority_cpu_weight_ratio", "priority_launcher"):
        add_setting(p, name, help={"data_dir": "Faust data directory"}.get(name))


def samples_partitions(settings: Settings) -> int:
    """The samples topic's real partition count (the state table must match it)."""
    from phasewise.kafka import make_admin
    from phasewise.topics import SAMPLES

    md = make_admin(settings).list_topics(SAMPLES.name, timeout=10)
    t = md.topics.get(SAMPLES.name)
    if t is None or t.error is not None or not t.partitions:
        return settings.kafka.topic_partitions or SAMPLES.partitions
    return len(t.partitions)


def single_threaded_torch() -> int:
    """Run torch ops on the calling thread only (unless ``OMP_NUM_THREADS`` says otherwise).

    The detector's CRBM multiplies ~100-row matrices once per message from one
    event loop: intra-op threads cannot speed that up, and on a busy host their
    spin-waits cost more than the maths (measured on 2 shared cores: the batched
    step fell from ~70k to ~10k samples/s with torch's default 2 threads).
    Returns the thread count in force.
    """
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    return torch.get_num_threads()


def freeze_heap_when_ready(app: object) -> None:
    """``gc.freeze()`` once, when the worker first has its partitions.

    By then the process holds ~220k long-lived objects (torch, Faust, aiokafka,
    the model); each full (generation 2) garbage collection traversed all of
    them: ~100 ms with the event loop stopped, every few tens of seconds, a
    p99 latency spike. Frozen objects are never collected (they live for the
    process anyway); objects created afterwards, container state included, are
    collected as before.
    """
    import gc

    frozen = []

    @app.on_rebalance_complete.connect  # type: ignore[attr-defined]
    async def _freeze(app: object, **kwargs: object) -> None:
        if not frozen:
            gc.collect()
            gc.freeze()
            frozen.append(gc.get_freeze_count())
            log.info("froze %d start-up objects out of garbage collection", frozen[0])


def state_dir_problem(settings: Settings) -> str | None:
    """Why the Faust worker's ``data_dir`` cannot be used (created 0700 when missing), or None."""
    from phasewise.statedir import StateDirError, ensure_state_dir

    try:
        ensure_state_dir(settings.data_dir)
    except StateDirError as e:
        return str(e)
    return None


#: seconds the worker's event loop may be silent before /healthz says it is not live
LOOP_SILENCE_S = 30.0
#: ... and before its first timer ran (start-up: imports, waiting for the broker, table recovery)
LOOP_START_S = 600.0


def watch(app: object, metrics: object, *, lag_every_s: float = 5.0, ready: str = "phasewise_worker_ready") -> object:
    """A Faust worker's :class:`~phasewise.observe.Health`, and its consumer lag metric where it has one.

    Live while the event loop runs a 1 s timer (a wedged loop stops it);
    ready while the gauge *ready* is 1 (``phasewise_worker_ready``,
    ``phasewise_horus_ready``, ``phasewise_place_ready``: partitions assigned,
    tables recovered, no agent dead). With ``metrics.consumer_lag``, every
    *lag_every_s* ``consumer_lag{topic}`` is the sum over the assigned
    partitions of high watermark - position.
    """
    from phasewise.observe import Health

    def not_ready() -> str | None:
        if metrics.registry.get_sample_value(ready) != 1:  # type: ignore[attr-defined]
            return "partitions not assigned or tables not recovered yet (or an agent died)"
        return None

    health = Health(ready=not_ready)
    health.beat("event", LOOP_START_S)  # until the app's timers run: torch, the broker, recovery

    @app.timer(1.0)  # type: ignore[attr-defined]
    async def _beat() -> None:
        health.beat("event", LOOP_SILENCE_S)

    if not hasattr(metrics, "consumer_lag"):
        return health

    @app.timer(lag_every_s)  # type: ignore[attr-defined]
    async def _lag() -> None:
        consumer = app.consumer  # type: ignore[attr-defined]
        lag: dict[str, int] = {}
        for tp in list(consumer.assignment()):
            try:
                high = consumer.highwater(tp)
                pos = await consumer.position(tp)
            except Exception:  # noqa: BLE001 - a partition being revoked; the next round has it right
                continue
            if high is None or pos is None:
                continue
            lag[tp.topic] = lag.get(tp.topic, 0) + max(0, high - pos)
        for topic, n in lag.items():
            metrics.consumer_lag.labels(topic=topic).set(n)  # type: ignore[attr-defined]

    return health


#: seconds a stopping worker may take when its broker is unreachable (Faust's own
#: shutdown then waits on the Kafka client indefinitely); with a broker, STOP_GRACE_S
STOP_UNREACHABLE_S = 3.0
STOP_GRACE_S = 60.0


def make_worker(app: object, bootstrap: str, **kw: object) -> object:
    """A ``faust.Worker`` that tames the Kafka client while the broker is away.

    - its log handlers fold repeated lines (:class:`~phasewise.kafka.FoldRepeats`):
      aiokafka logs every failed reconnect, several a second;
    - on SIGINT / SIGTERM it stops as Faust does, but if the process is still
      there after :data:`STOP_UNREACHABLE_S` (nothing listens at *bootstrap*) or
      :data:`STOP_GRACE_S`, it says so and exits with status 1. Nothing is lost
      that a restart does not redo: offsets not committed are processed again
      and decisions carry idempotency keys.
    """
    import faust

    from phasewise.kafka import FoldRepeats, listening

    class Worker(faust.Worker):
        def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
            super().on_setup_root_logger(logger, level)
            for h in logger.handlers:
                h.addFilter(FoldRepeats())

        def _schedule_shutdown(self, signal: object) -> None:
            if not getattr(self, "_phasewise_watchdog", None):
                grace = STOP_GRACE_S if listening(bootstrap, 0.5) else STOP_UNREACHABLE_S
                self._phasewise_watchdog = threading.Timer(grace, _stop_now, args=(grace,))
                self._phasewise_watchdog.daemon = True
                self._phasewise_watchdog.start()
            super()._schedule_shutdown(signal)

    return Worker(app, **kw)


def _stop_now(grace: float) -> None:
    log.warning("not stopped %g s after the signal (the Kafka client waits for an unreachable broker): "
                "exiting now; uncommitted samples are processed again at the next start", grace)
    logging.shutdown()
    os._exit(1)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from phasewise.kafka import BrokerUnavailable, ensure_topics, wait_for_broker
    from phasewise.signing import SigningError, keyring_of
    from phasewise.streams.app import create_app
    from phasewise.streams.metrics import WorkerMetrics

    try:
        keyring_of(settings)  # a key file that cannot be used stops the worker here, in one line
    except SigningError as e:
        print(f"phasewise worker: error: {e}", file=sys.stderr)
        return 2
    if (why := state_dir_problem(settings)) is not None:
        print(f"phasewise worker: error: data_dir: {why}", file=sys.stderr)
        return 2
    print(settings.describe(), flush=True)
    stop = threading.Event()
    # until Faust runs (it installs its own handlers), a signal ends the wait for the broker
    with stop_on_signals(stop) as received:
        try:
            if not wait_for_broker(settings, None, stop=stop):
                log.info("signal %d: stopping before the broker answered", received[0])
                return 0
            if settings.kafka.create_topics:
                ensure_topics(settings)
            if "phase" in settings.worker.served_policies():
                from phasewise.streams.phase_agents import ensure_phase_topics

                ensure_phase_topics(settings)
            partitions = samples_partitions(settings)
        except BrokerUnavailable as e:
            print(f"phasewise worker: {e}", file=sys.stderr)
            return 1
        if stop.is_set():
            log.info("signal %d: stopping", received[0])
            return 0
    if "phase" in settings.worker.served_policies():
        single_threaded_torch()
    metrics = WorkerMetrics()
    app = create_app(settings, samples_partitions=partitions, metrics=metrics)
    health = watch(app, metrics)
    if settings.metrics_port:
        from phasewise.observe import serve

        serve(metrics.registry, settings.metrics_port, health, settings.bind_address)
        log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", settings.bind_address,
                 settings.metrics_port)
    freeze_heap_when_ready(app)
    worker = make_worker(app, settings.kafka.bootstrap,
                         loglevel=FAUST_LEVELS.get(settings.log_level, "info"),
                         quiet=True, redirect_stdouts=False)
    # Faust's terminal spinner (levels warn and above) sets the root logger to DEBUG so that
    # every debug record of faust/aiokafka reaches its handler: ~5% of the worker's CPU for
    # nothing in a log file. No spinner: the root logger stays at the chosen level.
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def run_job_worker(settings: Settings, role: str, worker_id: str, metrics: object,
                   register: Callable[[object, Settings], None]) -> int:
    """A cluster-wide job worker (``phasewise horus``, ``phasewise place``): print the settings,
    wait for the broker, create missing topics, run a Faust app with id *worker_id* whose agents
    *register(app, settings)* adds, with *metrics* and its health on ``metrics_port`` at
    ``bind_address`` (``/metrics``, ``/healthz``: the event loop runs; ``/readyz``:
    ``phasewise_<role>_ready`` is 1). Exit status 0 after a clean stop; 1 when the broker is
    unavailable, an agent died or an output could not be delivered."""
    from phasewise.kafka import BrokerUnavailable, ensure_topics, wait_for_broker
    from phasewise.streams.app import create_app

    if (why := state_dir_problem(settings)) is not None:
        print(f"phasewise {role}: error: data_dir: {why}", file=sys.stderr)
        return 2
    print(settings.describe(), flush=True)
    stop = threading.Event()
    with stop_on_signals(stop) as received:
        try:
            if not wait_for_broker(settings, None, stop=stop):
                log.info("signal %d: stopping before the broker answered", received[0])
                return 0
            if settings.kafka.create_topics:
                ensure_topics(settings)
        except BrokerUnavailable as e:
            print(f"phasewise {role}: {e}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
    app = create_app(settings.replace(worker_id=worker_id, web_port=0), register_agents=False)
    register(app, settings)
    health = watch(app, metrics, ready=f"phasewise_{role}_ready")
    if settings.metrics_port:
        from phasewise.observe import serve

        serve(metrics.registry, settings.metrics_port, health, settings.bind_address)  # type: ignore[attr-defined]
        log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", settings.bind_address,
                 settings.metrics_port)
    worker = make_worker(app, settings.kafka.bootstrap, loglevel=FAUST_LEVELS.get(settings.log_level, "info"),
                         quiet=True, redirect_stdouts=False)
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
