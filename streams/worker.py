"""``phasewise worker``: the Faust stream processor (samples -> VPA limit decisions).

Reads ``HostSamples`` from the samples topic, keeps a VPA recommender per
container (state in a changelogged table, so a restarted worker recovers it),
and writes a ``Decision`` to the decisions topic whenever a container's
recommended limit moves by more than the hysteresis. A record it cannot
decode or process (whatever its size, nesting or bytes) goes to the
dead-letter topic with the reason. Start several workers with the same
``worker_id`` to split the hosts between them.

Start-up: create missing topics, print the settings, start a Faust worker
in this process (log levels map to Faust's crit|error|warn|info|debug).
SIGTERM and SIGINT stop it cleanly (Faust's worker installs those handlers;
it also installs SIGUSR1 to log a stack dump). Exit status 0 after a clean stop;
1 when an agent died (on anything but a record, which is dead-lettered) or an
output could not be delivered: nothing is committed after that, and a
restarted worker takes over from the last commit.

The decision logic itself is :func:`process_host_samples` (re-exported from
:mod:`phasewise.streams.processing`), pure and usable without Faust.
"""

from __future__ import annotations

import argparse
import logging
import sys

from phasewise.cli import add_common, settings_from_args
from phasewise.settings import Settings, SettingsError
from phasewise.streams.processing import StateCache, process_host_samples

__all__ = ["FAUST_LEVELS", "StateCache", "add_arguments", "process_host_samples", "run"]

log = logging.getLogger(__name__)

#: phasewise log level -> Faust / mode log level
FAUST_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error", "critical": "crit"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--recommend-interval", dest="recommend_interval_s", type=float,
                   help="seconds of event time between a container's recommendations, 0 = after every "
                        "sample (env PHASEWISE_RECOMMEND_INTERVAL_S; default 5)")
    p.add_argument("--hysteresis", type=float,
                   help="relative change of a limit needed for a decision (env PHASEWISE_HYSTERESIS; default 0.10)")
    p.add_argument("--data-dir", dest="data_dir",
                   help="Faust data directory (env PHASEWISE_DATA_DIR; default /tmp/phasewise)")
    p.add_argument("--web-port", dest="web_port", type=int,
                   help="Faust web port, 0 = no web server (env PHASEWISE_WEB_PORT; default 6066)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int,
                   help="Prometheus port, 0 = none (env PHASEWISE_METRICS_PORT; default 0)")
    p.add_argument("--worker-id", dest="worker_id",
                   help="Faust app id = consumer group (env PHASEWISE_WORKER_ID; default phasewise-worker)")
    p.add_argument("--policy", choices=["vpa", "phase"],
                   help="vpa: VPA limits; phase: limits from the shared CRBM phase model with VPA as the "
                        "fallback (env PHASEWISE_POLICY; default vpa)")
    p.add_argument("--snapshot-interval", dest="phase_snapshot_interval_s", type=float,
                   help="--policy phase: seconds between the learner's model snapshots "
                        "(env PHASEWISE_PHASE_SNAPSHOT_INTERVAL_S; default 30)")
    p.add_argument("--learn-every", dest="phase_learn_every", type=int,
                   help="--policy phase: detectors send every k-th ready window to the learner "
                        "(env PHASEWISE_PHASE_LEARN_EVERY; default 10)")
    p.add_argument("--learn-batch", dest="phase_learn_batch", type=int,
                   help="--policy phase: learn windows go to the learner in batches of this many, one CD "
                        "step each (env PHASEWISE_PHASE_LEARN_BATCH; default 128)")
    p.add_argument("--phase-warmup", dest="phase_warmup", type=int,
                   help="--policy phase: windows a cold CRBM learns before phases are assigned "
                        "(env PHASEWISE_PHASE_WARMUP; default 256)")
    p.add_argument("--phase-statistics", dest="phase_statistics", choices=["relative", "absolute"],
                   help="--policy phase: limits from the container's level x the phase's quantile of "
                        "usage/level (relative) or the phase's pooled usage quantile (absolute) "
                        "(env PHASEWISE_PHASE_STATISTICS; default relative)")
    p.add_argument("--phase-features", dest="phase_features",
                   help="--policy phase: the CRBM's frame features, a comma list of cpu,mem,gpu,gpu_mem "
                        "holding cpu and mem (env PHASEWISE_PHASE_FEATURES; default cpu,mem; add gpu,gpu_mem "
                        "on GPU hosts)")
    p.add_argument("--container-ttl", dest="container_ttl_s", type=float,
                   help="seconds of event time without a sample after which a container is forgotten, "
                        "0 = never (env PHASEWISE_CONTAINER_TTL_S; default 691200 = 8 days)")
    p.add_argument("--vpa-time-scale", dest="vpa_time_scale", type=float,
                   help="multiply VPA's 24 h half-lives and intervals by this (1 = Kubernetes VPA; "
                        "0.001 = a day in 86.4 s) (env PHASEWISE_VPA_TIME_SCALE; default 1)")


def check(settings: Settings) -> None:
    if settings.policy not in ("vpa", "phase"):
        raise SettingsError(f"policy must be 'vpa' or 'phase', got {settings.policy!r}")
    if settings.phase_statistics not in ("relative", "absolute"):
        raise SettingsError(f"phase_statistics must be 'relative' or 'absolute', got {settings.phase_statistics!r}")
    settings.phase_feature_tuple()  # SettingsError when invalid
    if settings.phase_ratio_cap < 0:
        raise SettingsError(f"phase_ratio_cap must be >= 0 (0 = no cap), got {settings.phase_ratio_cap}")
    if settings.container_ttl_s < 0:
        raise SettingsError(f"container_ttl_s must be >= 0 (0 = never), got {settings.container_ttl_s}")
    if settings.phase_snapshot_interval_s <= 0 or settings.phase_learn_every < 1 or settings.phase_warmup < 0:
        raise SettingsError("phase_snapshot_interval_s must be > 0, phase_learn_every >= 1, phase_warmup >= 0")
    if settings.worker_batch_max < 1 or settings.worker_batch_wait_ms < 0:
        raise SettingsError("worker_batch_max must be >= 1 and worker_batch_wait_ms >= 0")
    if settings.phase_learn_batch < 1:
        raise SettingsError(f"phase_learn_batch must be >= 1, got {settings.phase_learn_batch}")
    if settings.recommend_interval_s < 0:
        raise SettingsError(f"recommend_interval_s must be >= 0 (0 = on every sample), got {settings.recommend_interval_s}")
    if settings.vpa_time_scale <= 0:
        raise SettingsError(f"vpa_time_scale must be > 0, got {settings.vpa_time_scale}")
    if settings.vpa_min_cpu_cores < 0 or settings.vpa_min_mem_bytes < 0:
        raise SettingsError("vpa_min_cpu_cores and vpa_min_mem_bytes must be >= 0")
    if not 0 <= settings.web_port < 65536 or not 0 <= settings.metrics_port < 65536:
        raise SettingsError("web_port and metrics_port must be in [0, 65535]")


def samples_partitions(settings: Settings) -> int:
    """The samples topic's real partition count (the state table must match it)."""
    from confluent_kafka.admin import AdminClient

    from phasewise.topics import SAMPLES

    md = AdminClient(settings.kafka_common()).list_topics(SAMPLES.name, timeout=10)
    t = md.topics.get(SAMPLES.name)
    if t is None or t.error is not None or not t.partitions:
        return settings.topic_partitions or SAMPLES.partitions
    return len(t.partitions)


def single_threaded_torch() -> int:
    """Run torch ops on the calling thread only (unless ``OMP_NUM_THREADS`` says otherwise).

    The detector's CRBM multiplies ~100-row matrices once per message from one
    event loop: intra-op threads cannot speed that up, and on a busy host their
    spin-waits cost more than the maths (measured on 2 shared cores: the batched
    step fell from ~70k to ~10k samples/s with torch's default 2 threads).
    Returns the thread count in force.
    """
    import os

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


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        check(settings)
    except SettingsError as e:
        print(f"phasewise worker: {e}", file=sys.stderr)
        return 2
    import faust

    from phasewise.kafka import BrokerUnavailable, ensure_topics, wait_for_broker
    from phasewise.streams.app import create_app
    from phasewise.streams.metrics import WorkerMetrics

    print(settings.describe(), flush=True)
    try:
        if settings.create_topics:
            ensure_topics(settings)
        else:
            wait_for_broker(settings)
        if settings.policy == "phase":
            from phasewise.streams.phase_agents import ensure_phase_topics

            ensure_phase_topics(settings)
        partitions = samples_partitions(settings)
    except BrokerUnavailable as e:
        print(f"phasewise worker: {e}", file=sys.stderr)
        return 1
    if settings.policy == "phase":
        single_threaded_torch()
    metrics = WorkerMetrics()
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
        log.info("metrics on :%d/metrics", settings.metrics_port)
    app = create_app(settings, samples_partitions=partitions, metrics=metrics)
    freeze_heap_when_ready(app)
    worker = faust.Worker(app, loglevel=FAUST_LEVELS.get(settings.log_level, "info"),
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
