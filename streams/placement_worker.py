"""``phasewise place``: the placement worker (job events + predictions + samples -> place decisions).

One per cluster (it needs every job and every host). Start-up as ``phasewise worker``: print the settings, wait
for the broker, create missing topics, run a Faust worker with the agents of
:mod:`phasewise.streams.placement_agents`. Exit status 0 after a clean stop; 1
when an agent died or an output could not be delivered (nothing is committed
after that; a restart resumes from the last commit with the state written
then).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from phasewise.cli import add_common, add_setting, settings_from_args, stop_on_signals

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    for name in ("data_dir", "metrics_port", "place_policy", "place_isolate_inference", "place_prediction_wait_s",
                 "place_local_nodes", "place_worker_id"):
        add_setting(p, name)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from phasewise.kafka import BrokerUnavailable, ensure_topics, wait_for_broker
    from phasewise.streams.app import create_app
    from phasewise.streams.placement_agents import PlacementMetrics, register_placement
    from phasewise.streams.worker import FAUST_LEVELS, make_worker

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
            print(f"phasewise place: {e}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
    metrics = PlacementMetrics()
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
        log.info("metrics on :%d/metrics", settings.metrics_port)
    app_settings = settings.replace(worker_id=settings.place.worker_id, web_port=0)
    app = create_app(app_settings, register_agents=False)
    register_placement(app, settings, metrics=metrics)
    worker = make_worker(app, settings.kafka.bootstrap, loglevel=FAUST_LEVELS.get(settings.log_level, "info"),
                         quiet=True, redirect_stdouts=False)
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
