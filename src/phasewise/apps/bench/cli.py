"""``phasewise bench``: benchmarks that print numbers (one JSON object with --json)."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "pipeline": ("phasewise.apps.bench.pipeline", "closed loop: samples/s through the worker, latency, memory"),
    "phases": ("phasewise.apps.bench.phases", "phase detector with the CRBM in the loop: samples/s, memory"),
    "fuzz": ("phasewise.apps.bench.fuzz", "hostile messages at a real consumer: dead letters, crashes, valid lost"),
    "logic": ("phasewise.apps.bench.logic", "the VPA decision logic alone, no Kafka: us per container sample"),
    "placement": ("phasewise.apps.bench.placement", "placement decision time per job at cluster scale (1,500 nodes)"),
    "recovery": ("phasewise.apps.bench.recovery",
                 "a worker SIGKILLed mid-stream: its decisions against an unkilled run's"),
    "flood": ("phasewise.apps.bench.flood", "a flood of new containers: worker resident bytes per container, the cap"),
    "horus-floor": ("phasewise.apps.bench.horus_floor",
                    "GPU-utilisation RMSLE on GPUMemNet's jobs: offline learners vs the online model (scikit-learn)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_) in BENCHES.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        try:
            importlib.import_module(module).add_arguments(sp)
        except ImportError as e:  # a bench whose module is missing says so when chosen
            sp.set_defaults(_missing=str(e))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_missing", None):
        print(f"bench {args.bench} unavailable: {args._missing}")
        return 2
    return importlib.import_module(BENCHES[args.bench][0]).run(args)
