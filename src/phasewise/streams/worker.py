"""The stream workers' entry: ``phasewise worker`` (samples -> limit decisions), ``phasewise horus`` and
``phasewise place`` (the job workers).

Each prints its settings, waits for the broker (SIGTERM or SIGINT end the wait, exit status 0), creates
missing topics and runs a Faust worker in this process with its agents (:mod:`phasewise.streams.agents`);
flags and settings are checked before torch or Faust load. Exit status 0 after a clean stop; 1 when an
agent died, an output could not be delivered (nothing is committed after that: a restart resumes from
the last commit) or it stayed not ready for ``ready_stall_s`` while the broker answered
(:class:`ReadyGuard`); 2 on a configuration error. Narrative: docs/operations.md and docs/deployment.md.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.command import add_common, add_setting, exit_now, settings_from_args, stop_on_signals
from phasewise.kit.settings import Settings

__all__ = ["FAUST_LEVELS", "HORUS", "PLACE", "JobRole", "add_arguments", "run"]

log = logging.getLogger(__name__)

#: phasewise log level -> Faust / mode log level
FAUST_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error", "critical": "crit"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    for name in ("recommend_interval_s", "hysteresis", "data_dir", "web_port", "metrics_port", "bind_address",
                 "worker_id", "policy", "phase_workloads", "phase_snapshot_interval_s", "phase_learn_every",
                 "phase_learn_batch", "phase_warmup", "phase_pretrained_model", "phase_anticipate_horizon_s",
                 "phase_anticipate_min_probability", "phase_anticipate_min_exits",
                 "phase_statistics", "phase_features", "container_ttl_s", "vpa_time_scale", "targets_enabled",
                 "targets_policy", "targets_shrink", "targets_share_alpha", "targets_share_interval_s",
                 "targets_grace_s", "priority_agent", "priority_freeze_max_wait_s", "priority_grace_s",
                 "priority_cpu_weights", "priority_cpu_weight_ratio", "priority_launcher", "autoscale_enabled",
                 "autoscale_interval_s", "autoscale_slo_p99_ms", "autoscale_min_replicas", "autoscale_max_replicas",
                 "autoscale_up_cooldown_s", "autoscale_down_cooldown_s", "ready_stall_s", "start_stall_s",
                 "prior_min_runs", "prior_margin", "prior_min_run_s", "prior_profile_interval_s",
                 "scorecard_buckets", "scorecard_samples", "scorecard_windows"):
        add_setting(p, name, help={"data_dir": "Faust data directory"}.get(name))


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


def heap_trimmer() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` (gives the heap's free pages back to the OS), or None under another C library."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def trim_heap_every(app: object, seconds: float) -> bool:
    """Give freed heap memory back to the OS every *seconds* (0: never); False where it is not done.

    glibc raises its mmap threshold each time a large block is freed, so
    numpy's later large arrays (a round's transients, a grown fleet) come
    from the heap, and the holes they leave stay resident: after a flood of
    100,000 new containers a third of the worker's resident memory was such
    free space (docs/benchmarks.md). ``malloc_trim`` returns it, on the
    event loop (a walk of the heap's free chunks: ~7 ms on 800 MB, 80 ms
    handing back 750 MB); glibc's thresholds are left as they are, so the hot
    path keeps reusing its heap between trims.
    """
    trim = heap_trimmer() if seconds > 0 else None
    if trim is None:
        return False

    @app.timer(seconds)  # type: ignore[attr-defined]
    async def _trim() -> None:
        trim()

    return True


def state_dir_problem(settings: Settings) -> str | None:
    """Why the Faust worker's ``data_dir`` cannot be used (created 0700 when missing), or None."""
    from phasewise.kit.statedir import StateDirError, ensure_state_dir

    try:
        ensure_state_dir(settings.data_dir)
    except StateDirError as e:
        return str(e)
    return None


#: seconds the worker's event loop may be silent before /healthz says it is not live
LOOP_SILENCE_S = 30.0
#: ... and before its first timer ran (start-up: imports, waiting for the broker, table recovery)
LOOP_START_S = 600.0


def watch(app: object, metrics: object, *, lag_every_s: float = 5.0, ready: str = "phasewise_worker_ready",
          probe: object = None) -> object:
    """A Faust worker's :class:`~phasewise.kit.observe.Health`, and its consumer lag metric where it has one.

    Live while the event loop runs a 1 s timer (a wedged loop stops it);
    ready while the broker answers (*probe*, a :class:`~phasewise.kit.kafka.client.BrokerProbe`:
    aiokafka keeps no state a check could read) and the gauge *ready* is 1
    (``phasewise_worker_ready``, ``phasewise_horus_ready``,
    ``phasewise_place_ready``: partitions assigned, tables recovered, no agent
    dead). The gauge drops to 0 when a rebalance revokes the partitions (as
    after a broker outage) and is 1 again when it completes. With
    ``metrics.consumer_lag``, every *lag_every_s* ``consumer_lag{topic}`` is
    the sum over the assigned partitions of high watermark - position.
    """
    from phasewise.kit.observe import Health

    def not_ready() -> str | None:
        down = probe.outage() if probe is not None else None  # type: ignore[attr-defined]
        if down is not None:
            return down
        if metrics.registry.get_sample_value(ready) != 1:  # type: ignore[attr-defined]
            return f"{not_ready_reason(app)} (or an agent died)"
        return None

    health = Health(ready=not_ready)
    health.beat("event", LOOP_START_S)  # until the app's timers run: torch, the broker, recovery

    @app.on_partitions_revoked.connect  # type: ignore[attr-defined]
    async def _unready(app: object, revoked: object, **kwargs: object) -> None:
        metrics.ready.set(0)  # type: ignore[attr-defined]  # until the rebalance completes

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


def built_consumer(app: object) -> Any:
    """*app*'s Faust consumer, or None while Faust has not built it yet.

    For the threads that watch the worker (the guards, ``/readyz``): ``app.consumer`` builds the consumer on
    first use, and one built in such a thread binds its consumer thread to that thread's event loop, not
    the worker's (Faust's start then fails with a future "attached to a different loop", or hangs).
    """
    return getattr(app, "_consumer", None)


def built_recovery(app: object) -> Any:
    """*app*'s table recovery service, or None while Faust has not built it (as :func:`built_consumer`)."""
    tables = getattr(app, "__dict__", {}).get("tables")  # Faust's cached property, once built
    return getattr(tables, "_recovery", None)


def not_ready_reason(app: object) -> str:
    """What a Faust worker that is not ready waits for: the group, its changelog recovery, or the rebalance's end."""
    try:
        assigned = len(built_consumer(app).assignment())
    except Exception:  # noqa: BLE001 - the consumer is not built or not started yet
        assigned = 0
    if not assigned:
        return "no partitions assigned yet (joining the consumer group)"
    recovery = built_recovery(app)
    if recovery is not None and getattr(recovery, "in_recovery", False):
        try:
            left = recovery.active_remaining()
            parts = ", ".join(f"{tp.topic}[{tp.partition}] at {recovery.active_offsets[tp]} of {hw}"
                              for tp, hw in sorted(recovery.active_highwaters.items())[:4]
                              if left.get(tp, 0) > 0)
            return f"recovering tables from their changelogs: {sum(left.values())} records left ({parts})"
        except Exception:  # noqa: BLE001 - read from another thread while it changes: say less
            return "recovering tables from their changelogs"
    return f"{assigned} partitions assigned; waiting for the table recovery and the rebalance to complete"


def recovery_progress(app: object) -> tuple[int, int] | None:
    """What moves while a Faust worker makes progress towards ready: its assigned partitions and the
    offsets its recovery reached (None when they cannot be read now)."""
    try:
        recovery = built_recovery(app)
        offsets = sum(v for v in list(recovery.active_offsets.values()) if v is not None)
        offsets += sum(v for v in list(recovery.standby_offsets.values()) if v is not None)
        return len(built_consumer(app).assignment()), offsets
    except Exception:  # noqa: BLE001 - not built yet, or changing under us
        return None


class ReadyGuard:
    """How long a Faust worker has been stuck: not ready, its broker answering, no progress.

    Fed by :meth:`tick` (pure; the clock is injectable). The clock restarts
    when the worker is ready, while the broker is gone (an outage is not the
    worker's to end) and whenever *progress* changes (a long recovery that
    moves is not stuck).
    """

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic,
                 ever_ready: Callable[[], bool] | None = None) -> None:
        self.stall_s = stall_s
        self.clock = clock
        self.since: float | None = None
        self._progress: object = None
        #: why the worker was stopped (set once, by the caller of :meth:`tick`)
        self.fired: str | None = None
        self._ready_once = False
        self._ever_ready = ever_ready

    @property
    def ready_once(self) -> bool:
        """Whether the worker was ever ready: seen by :meth:`tick`, or said by *ever_ready* (the ready gauge,
        which knows of a readiness shorter than the ticks' period)."""
        return self._ready_once or (self._ever_ready is not None and self._ever_ready())

    def tick(self, ready: bool, broker_down: bool, progress: object = None) -> float | None:
        """Seconds stuck, once more than ``stall_s`` (0: never); else None."""
        now = self.clock()
        self._ready_once = self._ready_once or ready
        if ready or broker_down:
            self.since, self._progress = None, None
            return None
        if self.since is None or (progress is not None and progress != self._progress):
            self.since = now
            if progress is not None:
                self._progress = progress
            return None
        stuck = now - self.since
        return stuck if self.stall_s and stuck > self.stall_s and self.fired is None else None


#: the signals a Faust worker of this process was stopped by (its own ready guard's SIGTERM included)
_SIGNALLED: list[object] = []
#: how many times a role that fails before it was ever ready starts afresh in its own process
START_ATTEMPTS = 3
#: the attempt this process is (set for the next one when it starts afresh)
START_ATTEMPT_ENV = "_PHASEWISE_START_ATTEMPT"


class StartGuard:
    """How long a Faust worker that was never ready has gone without its consumer subscribing to its topics.

    Faust subscribes in its own start, before any group join, as soon as its agents and tables are set up:
    a worker past that step is waiting for the broker or the group (:class:`ReadyGuard`'s watch), one short
    of it for long is stuck in its start (declaring its internal topics or handing the subscription to its
    consumer thread, a call that never returned), which only a fresh process ends. Pure, like
    :class:`ReadyGuard`; the clock restarts while the broker is gone.

    >>> t = [0.0]
    >>> g = StartGuard(30.0, clock=lambda: t[0])
    >>> g.tick(False, False, False), t.__setitem__(0, 31.0), g.tick(False, False, False)
    (None, None, 31.0)
    >>> g.tick(False, False, True), t.__setitem__(0, 99.0), g.tick(False, False, False)  # subscribed once: done
    (None, None, None)
    """

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.clock = clock
        self.since: float | None = None
        self.done = not stall_s

    def tick(self, ready: bool, broker_down: bool, subscribed: bool) -> float | None:
        """Seconds without a subscription, once more than ``stall_s``; else None (and always None once the
        worker subscribed or was ready, or with ``stall_s`` 0)."""
        now = self.clock()
        self.done = self.done or ready or subscribed
        if self.done or broker_down:
            self.since = None
            return None
        if self.since is None:
            self.since = now
            return None
        stuck = now - self.since
        return stuck if stuck > self.stall_s else None


def consumer_subscribed(app: object) -> bool:
    """Whether the Faust worker's Kafka consumer has subscribed to its topics (read from another thread)."""
    try:
        consumer = built_consumer(app)._thread._consumer
        return consumer is not None and bool(consumer.subscription())
    except Exception:  # noqa: BLE001 - not built yet
        return False


def guard_readiness(app: object, metrics: object, guard: ReadyGuard, probe: object, *, role: str,
                    ready: str = "phasewise_worker_ready", every_s: float = 1.0,
                    start: StartGuard | None = None, attempt: int = START_ATTEMPTS) -> threading.Thread:
    """A daemon thread that stops this process (SIGTERM, so Faust stops as on a signal; the role's exit status
    is then 1) once *guard* finds the worker stuck, with one critical line saying what it waited for; and
    that replaces it with a fresh start of the same command (:func:`_exec_afresh`, start *attempt* of
    :data:`START_ATTEMPTS`) once *start* finds Faust's own start stuck.

    A thread, not an app timer: Faust starts its timers only after the first table recovery."""

    def loop() -> None:
        while guard.fired is None:
            time.sleep(every_s)
            is_ready = metrics.registry.get_sample_value(ready) == 1  # type: ignore[attr-defined]
            down = probe.outage() is not None  # type: ignore[attr-defined]
            if start is not None and not start.done:
                late = start.tick(is_ready, down, consumer_subscribed(app))
                if late is not None and start_afresh(1, ready_once=guard.ready_once, asked_to_stop=bool(_SIGNALLED),
                                                     attempt=attempt):
                    _exec_afresh(role, attempt, f"its consumer had not subscribed to its topics {late:.0f} s into "
                                                f"Faust's start (start_stall_s={start.stall_s:g})")
            stuck = guard.tick(is_ready, down, recovery_progress(app))
            if stuck is None:
                continue
            guard.fired = (f"not ready after {stuck:.0f} s without progress while the broker answers: "
                           f"{not_ready_reason(app)}")
            log.critical("phasewise %s: %s; exiting with status 1 so that it is started afresh (ready_stall_s=%g)",
                         role, guard.fired, guard.stall_s)
            os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=loop, name="phasewise-ready-guard", daemon=True)
    t.start()
    return t


#: seconds a stopping worker may take when its broker is unreachable (Faust's own
#: shutdown then waits on the Kafka client indefinitely); with a broker, STOP_GRACE_S
STOP_UNREACHABLE_S = 3.0
STOP_GRACE_S = 60.0


def make_worker(app: object, bootstrap: str, *, on_start_crash: Callable[[BaseException], None] | None = None,
                **kw: object) -> object:
    """A ``faust.Worker`` that tames the Kafka client while the broker is away.

    - its log handlers fold repeated lines (:class:`~phasewise.kit.kafka.client.FoldRepeats`):
      aiokafka logs every failed reconnect, several a second;
    - on SIGINT / SIGTERM it stops as Faust does, but if the process is still
      there after :data:`STOP_UNREACHABLE_S` (nothing listens at *bootstrap*) or
      :data:`STOP_GRACE_S`, it says so and exits with status 1. Nothing is lost
      that a restart does not redo: offsets not committed are processed again
      and decisions carry idempotency keys;
    - an exception out of Faust's start goes to *on_start_crash* first (which may replace the process:
      Faust's own shutdown after such a crash can hang on a future of another loop).
    """
    import faust

    from phasewise.kit.kafka.client import FoldRepeats, listening

    class Worker(faust.Worker):
        def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
            super().on_setup_root_logger(logger, level)
            for h in logger.handlers:
                h.addFilter(FoldRepeats())

        async def start(self) -> None:
            try:
                await super().start()
            except Exception as e:
                if on_start_crash is not None:
                    on_start_crash(e)
                raise

        def _schedule_shutdown(self, signal: object) -> None:
            _SIGNALLED.append(signal)
            if not getattr(self, "_phasewise_watchdog", None):
                grace = STOP_GRACE_S if listening(bootstrap, 0.5) else STOP_UNREACHABLE_S
                self._phasewise_watchdog = threading.Timer(grace, _stop_now, args=(grace,))
                self._phasewise_watchdog.daemon = True
                self._phasewise_watchdog.start()
            super()._schedule_shutdown(signal)

    return Worker(app, **kw)



def start_afresh(code: int, *, ready_once: bool, asked_to_stop: bool, attempt: int,
                 attempts: int = START_ATTEMPTS) -> bool:
    """Whether a Faust role that ended with exit status *code* starts afresh: it failed before it was ever
    ready, nobody asked it to stop, and attempts are left. A crash in Faust's
    start (a consumer thread not started yet when the table manager starts, a task left pending) ends the
    process before any work; starting again, as a supervisor would, is what recovers it.

    >>> start_afresh(1, ready_once=False, asked_to_stop=False, attempt=1)
    True
    >>> start_afresh(1, ready_once=True, asked_to_stop=False, attempt=1)  # it worked: its supervisor decides
    False
    >>> start_afresh(1, ready_once=False, asked_to_stop=False, attempt=3)
    False
    """
    return code != 0 and not ready_once and not asked_to_stop and attempt < attempts


def _exec_afresh(role: str, attempt: int, why: str) -> None:
    """Replace this process with the same command (its pid stays: a supervisor or a test sees one process)."""
    log.critical("phasewise %s: %s before it was ever ready; starting afresh (attempt %d of %d)", role, why,
                 attempt + 1, START_ATTEMPTS)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**os.environ, START_ATTEMPT_ENV: str(attempt + 1)})


def _stop_now(grace: float) -> None:
    exit_now(log, logging.WARNING, "not stopped %g s after the signal (the Kafka client waits for an unreachable "
             "broker): exiting now; uncommitted samples are processed again at the next start", grace)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    keyring, refused = start_checks(settings, "worker")  # before Faust, torch and the models are imported
    if refused:
        return 2
    from phasewise.kit.kafka.client import BrokerUnavailable, ensure_topics, wait_for_broker
    from phasewise.streams.app import create_app
    from phasewise.streams.metrics import WorkerMetrics

    if keyring is None:
        hints = settings.priority.agent and settings.priority.launcher == "place"
        warn_unsigned("worker", "decisions and hints" if hints else "decisions",
                      "actuators and placement workers" if hints else "actuators")
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
                from phasewise.streams.agents.phases import ensure_phase_topics

                ensure_phase_topics(settings)
            from phasewise.streams.config import samples_partitions

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
    views: dict[str, Any] = {}
    app = create_app(settings, samples_partitions=partitions, metrics=metrics, views=views)
    freeze_heap_when_ready(app)
    from phasewise.kit.topics import SAMPLES

    return run_faust(app, settings, metrics, role="worker", ready="phasewise_worker_ready", inputs=(SAMPLES.name,),
                     views=views)


def run_faust(app: object, settings: Settings, metrics: object, *, role: str, ready: str,
              inputs: tuple[str, ...], views: dict[str, Any] | None = None) -> int:
    """Run a built Faust *app* as this process's worker until it stops; its exit status.

    With its health (:func:`watch`) and *views* (the worker's ``/scorecard/``) on
    ``metrics_port``, a broker probe on the *inputs* topics, and the guard that
    stops a worker stuck not ready (``ready_stall_s``; exit status 1 then,
    whatever Faust's).
    """
    from phasewise.kit.kafka.client import BrokerProbe

    probe = BrokerProbe(settings, inputs).start()
    health = watch(app, metrics, ready=ready, probe=probe)
    trim_heap_every(app, settings.worker.heap_trim_interval_s)
    if settings.metrics_port:
        from phasewise.kit.observe import serve

        serve(metrics.registry, settings.metrics_port, health, settings.bind_address,  # type: ignore[attr-defined]
              views=views)
        log.info("metrics and health on %s:%d (%s)", settings.bind_address, settings.metrics_port,
                 ", ".join(["/metrics", "/healthz", "/readyz", *(views or {})]))
    try:
        attempt = max(1, int(os.environ.get(START_ATTEMPT_ENV, "1")))
    except ValueError:
        attempt = 1
    guard = ReadyGuard(settings.worker.ready_stall_s,
                       ever_ready=lambda: bool(getattr(metrics.ready, "ever", False)))  # type: ignore[attr-defined]
    guard_readiness(app, metrics, guard, probe, role=role, ready=ready,
                    start=StartGuard(settings.worker.start_stall_s), attempt=attempt)

    def crashed(e: BaseException) -> None:  # before Faust's shutdown, which such a crash can hang
        if start_afresh(1, ready_once=guard.ready_once, asked_to_stop=bool(_SIGNALLED), attempt=attempt):
            _exec_afresh(role, attempt, f"Faust's start failed: {type(e).__name__}: {str(e)[:300]}")

    worker = make_worker(app, settings.kafka.bootstrap, on_start_crash=crashed,
                         loglevel=FAUST_LEVELS.get(settings.log_level, "info"),
                         quiet=True, redirect_stdouts=False)
    # Faust's terminal spinner (levels warn and above) sets the root logger to DEBUG so that
    # every debug record of faust/aiokafka reaches its handler: ~5% of the worker's CPU for
    # nothing in a log file. No spinner: the root logger stays at the chosen level.
    worker.spinner = None
    code: int = 0
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        probe.close()
    code = 1 if guard.fired is not None else code
    # a crash before it was ever ready starts afresh here; a stall the guard stopped is its supervisor's to
    # restart (the guard's line says why), as is anything after it was ready
    if guard.fired is None and start_afresh(code, ready_once=guard.ready_once, asked_to_stop=bool(_SIGNALLED),
                                            attempt=attempt):
        _exec_afresh(role, attempt, f"Faust stopped with exit status {code}")
    return code


def start_checks(settings: Settings, role: str) -> tuple[Any, bool]:
    """What a worker role checks before it touches the broker (the signing key file, the trusted
    submitters, the data dir), then its settings printed: ``(keyring or None, False)``, or
    ``(None, True)`` after a one-line error on stderr (the role exits 2)."""
    from phasewise.kit.job_signing import JobSigningError, trusted_submitters
    from phasewise.kit.signing import SigningError, keyring_of

    try:
        keyring = keyring_of(settings)  # a key file that cannot be used stops the role here, in one line
        trusted_submitters(settings.jobs.trusted_submitters)
    except (SigningError, JobSigningError) as e:
        print(f"phasewise {role}: error: {e}", file=sys.stderr)
        return None, True
    if (why := state_dir_problem(settings)) is not None:
        print(f"phasewise {role}: error: data_dir: {why}", file=sys.stderr)
        return None, True
    print(settings.describe(), flush=True)
    return keyring, False


def warn_unsigned(role: str, what: str, readers: str = "actuators") -> None:
    """The one start-up warning of a role that publishes *what* without a cluster key (*readers* refuse them)."""
    log.warning("phasewise %s: %s are published unsigned: %s with signing_key_file set refuse them "
                "(set signing_key_file; docs/security.md)", role, what, readers)


def run_job_worker(settings: Settings, role: str, worker_id: str, metrics: object,
                   register: Callable[[object, Settings], object], publishes: str = "decisions",
                   readers: str = "actuators", *, keyring: Any) -> int:
    """A cluster-wide job worker (:class:`JobRole`): print the settings,
    wait for the broker, create missing topics, run a Faust app with id *worker_id* whose agents
    *register(app, settings)* adds, with *metrics* and its health on ``metrics_port`` at
    ``bind_address`` (``/metrics``, ``/healthz``: the event loop runs; ``/readyz``: the broker
    answers and ``phasewise_<role>_ready`` is 1). Exit status 0 after a clean stop; 1 when the broker is
    unavailable, an agent died, an output could not be delivered or it was stuck not ready
    (``ready_stall_s``). *keyring*: what :func:`start_checks` returned (``None``: unsigned; the role runs
    them before it imports its agents, so a key file that cannot be used stops it before torch or river is
    loaded)."""
    from phasewise.kit.kafka.client import BrokerUnavailable, ensure_topics, wait_for_broker
    from phasewise.streams.app import create_app

    if keyring is None:
        warn_unsigned(role, publishes, readers)
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
    from phasewise.streams.agents.scaffold import SetupError

    app = create_app(settings.replace(worker_id=worker_id, web_port=0), register_agents=False)
    try:
        register(app, settings)
    except SetupError as e:
        print(f"phasewise {role}: error: {e}", file=sys.stderr)
        return 2
    from phasewise.kit.topics import JOB_EVENTS

    return run_faust(app, settings, metrics, role=role, ready=f"phasewise_{role}_ready", inputs=(JOB_EVENTS.name,))


@dataclass(frozen=True)
class JobRole:
    """A cluster-wide job worker's subcommand (``phasewise horus``, ``phasewise place``): its flags, its
    agents' module (a :class:`~phasewise.streams.agents.scaffold.JobAgent` named ``agent``, imported when it
    runs), its metrics, its worker id and what it publishes (the one warning without a cluster key)."""

    name: str
    flags: tuple[str, ...]
    agents: str
    metrics: str
    worker_id: Callable[[Settings], str]
    publishes: str = "decisions"
    readers: str = "actuators"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_common(p)
        for name in self.flags:
            add_setting(p, name)

    def run(self, args: argparse.Namespace) -> int:
        settings = settings_from_args(args)
        keyring, refused = start_checks(settings, self.name)  # before the agents (torch, river) are imported
        if refused:
            return 2
        from phasewise.streams import metrics as worker_metrics

        metrics = getattr(worker_metrics, self.metrics)()
        agent = importlib.import_module(self.agents).agent
        return run_job_worker(settings, self.name, self.worker_id(settings), metrics,
                              lambda app, s: agent.register(app, s, metrics=metrics), self.publishes, self.readers,
                              keyring=keyring)


#: ``phasewise horus``: the Horus worker (job events + samples -> utilisation predictions; learns online)
HORUS = JobRole("horus", ("data_dir", "metrics_port", "bind_address", "horus_coverage", "horus_warmup_s",
                          "horus_observe_s", "horus_min_samples", "horus_worker_id", "horus_share_model",
                          "ready_stall_s", "start_stall_s"),
                "phasewise.streams.agents.horus", "HorusMetrics", lambda s: s.horus.worker_id,
                "predictions", "placement workers")
#: ``phasewise place``: the placement worker (job events + predictions + samples -> place decisions)
PLACE = JobRole("place", ("data_dir", "metrics_port", "bind_address", "place_policy", "place_isolate_inference",
                          "place_horus_frag_weight", "place_prediction_wait_s", "place_local_nodes",
                          "place_worker_id", "place_after_admission", "ready_stall_s", "start_stall_s"),
                "phasewise.streams.agents.placement", "PlacementMetrics", lambda s: s.place.worker_id)
