"""``phasewise horus``: the Horus worker (job events + samples -> utilisation predictions; learns online).

One per cluster. Start-up as ``phasewise worker``: print the settings, wait
for the broker, create missing topics, run a Faust worker with the agents of
:mod:`phasewise.streams.agents.horus`. Exit status 0 after a clean stop; 1
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
    for name in ("data_dir", "metrics_port", "horus_coverage", "horus_warmup_s", "horus_observe_s",
                 "horus_min_samples", "horus_worker_id", "ready_stall_s"):
        add_setting(p, name)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from phasewise.streams.agents.horus import HorusMetrics, register_horus
    from phasewise.streams.worker import run_job_worker

    metrics = HorusMetrics()
    return run_job_worker(settings, "horus", settings.horus.worker_id, metrics,
                          lambda app, s: register_horus(app, s, metrics=metrics))
