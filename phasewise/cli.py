"""``phasewise``: one CLI, one subcommand per role.

Each role lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs,
so a host agent never imports torch or Faust.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from phasewise import __version__

#: subcommand -> (module, one-line help)
ROLES: dict[str, tuple[str, str]] = {
    "demo": ("phasewise.demo", "local demo: broker, worker, producer, actuator and 3 real training jobs"),
    "broker": ("phasewise.infra.broker_cli", "run the embedded Kafka-compatible broker (Tansu) on loopback"),
    "worker": ("phasewise.streams.worker", "run the Faust stream processor (samples -> decisions)"),
    "produce": ("phasewise.producers.agent", "run the host agent: sample containers, publish to Kafka"),
    "actuate": ("phasewise.actuators.consumer", "run the actuator: apply this host's decisions"),
    "replay": ("phasewise.replay", "replay a real trace through the policies and score them"),
    "bench": ("phasewise.bench.cli", "throughput / latency / memory benchmarks"),
    "schemas": ("phasewise.schemas_cli", "write or check the JSON Schemas of every topic"),
    "topics": ("phasewise.topics_cli", "create the topics on a cluster (idempotent) and list them"),
}


def add_common(p: argparse.ArgumentParser) -> None:
    """Flags every Kafka-facing role takes; each also reads PHASEWISE_<NAME>."""
    p.add_argument("--bootstrap", help="Kafka bootstrap address (env PHASEWISE_BOOTSTRAP; default 127.0.0.1:9092)")
    p.add_argument("--host", help="this host's name (env PHASEWISE_HOST; default: hostname)")
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"],
                   help="log level (env PHASEWISE_LOG_LEVEL; default info)")


def settings_from_args(args: argparse.Namespace, **extra: Any):
    """The process's one Settings: defaults < environment < flags."""
    from phasewise.settings import Settings, fields_of

    overrides = {k: v for k, v in vars(args).items() if k in fields_of(Settings)}
    overrides.update(extra)
    return Settings.from_env(overrides)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasewise", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"phasewise {__version__}")
    sub = parser.add_subparsers(dest="role", metavar="ROLE")
    for name, (module, help_) in ROLES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if load in (name, "*"):
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    role = next((a for a in argv if not a.startswith("-")), None)
    if role not in ROLES:
        role = None
    try:
        parser = build_parser(load=role)
    except ImportError as e:
        print(f"phasewise {role}: missing dependency ({e}); install the role's extra, "
              f"e.g. pip install 'phasewise[{_extra_for(role)}]'", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.role is None:
        parser.print_help()
        return 2
    setup_logging(getattr(args, "log_level", None) or "info")
    module = importlib.import_module(ROLES[args.role][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


def _extra_for(role: str | None) -> str:
    return {"worker": "streams", "replay": "streams,report", "produce": "producer",
            "actuate": "actuator", "broker": "broker", "bench": "all", "demo": "all"}.get(role or "", "all")


if __name__ == "__main__":
    raise SystemExit(main())
