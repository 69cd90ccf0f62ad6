"""``phasewise experiment NAME``: the dispatcher to one experiment module.

Each entry of :data:`EXPERIMENTS` names a module with ``add_arguments(parser)`` and
``run(args) -> int``. The module is imported only to build its own parser and run
it; an experiment whose module is not in this installation is not offered.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

#: experiment -> (module, one-line help)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "targets": ("phasewise.apps.experiment.targets",
                "TRADL loss targets: real small training jobs under NA / AO / FT, time to targets"),
    "curves": ("phasewise.apps.experiment.curves",
               "target detection replayed over real training curves (MLPerf v1.0, Pollux)"),
    "priorities": ("phasewise.apps.experiment.priorities",
                   "DynamoML priorities: inference service, preemption, autoscaling, static vs managed"),
    "cluster": ("phasewise.apps.experiment.cluster",
                "a trace-driven mix of real jobs through every role: submit, place, start, end, leaks"),
    "corpus": ("phasewise.apps.experiment.corpus",
               "record repeated real training executions with their stages; phase/stage agreement (AMI, ARI)"),
}


def available() -> dict[str, tuple[str, str]]:
    """The experiments whose module is installed."""
    return {name: entry for name, entry in EXPERIMENTS.items() if importlib.util.find_spec(entry[0]) is not None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for name, (module, help_) in available().items():
        sp = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(module).add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(EXPERIMENTS[args.experiment][0]).run(args) or 0)
