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
    "scaling": ("phasewise.apps.bench.scaling",
                "1, 2, 4 ... workers of one group over the samples topic's partitions: samples/s in total and each"),
    "recovery": ("phasewise.apps.bench.recovery",
                 "a worker SIGKILLed mid-stream: its decisions against an unkilled run's"),
    "flood": ("phasewise.apps.bench.flood", "a flood of new containers: worker resident bytes per container, the cap"),
    "horus-floor": ("phasewise.apps.bench.horus_floor",
                    "GPU-utilisation RMSLE on GPUMemNet's jobs: offline learners vs the online model (scikit-learn)"),
}


def _lazy(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """A parser class whose flags come from its bench's module when it parses: the module (and what it
    imports: numpy, torch, the broker client) is loaded only for the bench chosen, not for ``--help``."""

    class LazyBench(base):  # type: ignore[misc, valid-type]
        module: str | None = None

        def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
            module, self.module = self.module, None
            if module is not None:
                try:
                    importlib.import_module(module).add_arguments(self)
                except ImportError as e:  # a bench whose module is missing says so when chosen
                    self.set_defaults(_missing=str(e))
            return super().parse_known_args(args, namespace)

    return LazyBench


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True, parser_class=_lazy(type(p)))
    for name, (module, help_) in BENCHES.items():
        sub.add_parser(name, help=help_, description=help_).module = module


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_missing", None):
        print(f"bench {args.bench} unavailable: {args._missing}")
        return 2
    return importlib.import_module(BENCHES[args.bench][0]).run(args)
