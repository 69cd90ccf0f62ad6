"""``phasewise place``: the placement worker (job events + predictions + samples -> place decisions).

One per cluster (it needs every job and every host). Start-up as ``phasewise worker``: print the settings, wait
for the broker, create missing topics, run a Faust worker with the agents of
:mod:`phasewise.streams.agents.placement`. Exit status 0 after a clean stop; 1
when an agent died or an output could not be delivered (nothing is committed
after that; a restart resumes from the last commit with the state written
then).
"""

from __future__ import annotations

import argparse

from phasewise.kit.command import add_common, add_setting, settings_from_args

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    for name in ("data_dir", "metrics_port", "place_policy", "place_isolate_inference", "place_horus_frag_weight",
                 "place_prediction_wait_s", "place_local_nodes", "place_worker_id", "place_after_admission",
                 "ready_stall_s"):
        add_setting(p, name)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from phasewise.streams.agents.placement import PlacementMetrics, register_placement
    from phasewise.streams.worker import run_job_worker

    metrics = PlacementMetrics()
    return run_job_worker(settings, "place", settings.place.worker_id, metrics,
                          lambda app, s: register_placement(app, s, metrics=metrics))
