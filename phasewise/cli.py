"""``phasewise``: one CLI, one subcommand per role.

Each role lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs,
so a host agent never imports torch or Faust.

Before any role runs, the ``PHASEWISE_*`` environment and the flags are read
into :class:`~phasewise.settings.Settings` (every role checks all of them). A
configuration error, from a flag or the environment, is one line on stderr,
``phasewise ROLE: error: <setting>: <why>``, and exit status 2; a
``PHASEWISE_*`` variable that is no setting gets a one-line warning.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from phasewise import __version__

#: subcommand -> (module, one-line help)
ROLES: dict[str, tuple[str, str]] = {
    "demo": ("phasewise.demo.run", "local demo: broker, worker, producer, actuator and 3 real training jobs"),
    "broker": ("phasewise.infra.broker_cli", "run the embedded Kafka-compatible broker (Tansu) on loopback"),
    "worker": ("phasewise.streams.worker", "run the Faust stream processor (samples -> decisions)"),
    "produce": ("phasewise.producers.agent", "run the host agent: sample containers, publish to Kafka"),
    "progress": ("phasewise.producers.progress",
                 "progress sidecar: a job's step/loss lines to Kafka, the control channel to the job"),
    "actuate": ("phasewise.actuators.consumer", "run the actuator: apply this host's decisions"),
    "explain": ("phasewise.streams.explain", "a container's limits, recommendations, phase and live scorecard"),
    "replay": ("phasewise.replay.cli", "replay a real trace through the policies and score them"),
    "simulate": ("phasewise.simulate.cli", "replay a pod list against a node list through the placement policies"),
    "bench": ("phasewise.bench.cli", "throughput / latency / memory benchmarks"),
    "experiment": ("phasewise.experiment.cli", "experiments with real jobs under a policy (targets, priorities)"),
    "schemas": ("phasewise.schemas_cli", "write or check the JSON Schemas of every topic"),
    "topics": ("phasewise.topics_cli", "create the topics on a cluster (idempotent) and list them"),
    "keys": ("phasewise.keys_cli", "make a key pair: keys submitter PATH (a job submitter's Ed25519 key)"),
    "submit": ("phasewise.horus.submit", "publish a job (JOB.json|yaml) on the job-events topic"),
    "horus": ("phasewise.streams.horus_worker", "run the Horus worker (jobs + samples -> utilisation predictions)"),
    "place": ("phasewise.streams.placement_worker", "run the placement worker (jobs + predictions + samples -> "
                                                    "place decisions)"),
    "predict": ("phasewise.horus.predict", "score the utilisation model on profiled jobs; read shared profiles"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``phasewise ROLE: error: --flag: why`` (exit status 2)."""

    #: the name errors start with (the role's, also for errors the top-level parser finds)
    error_prog: str | None = None

    def error(self, message: str) -> Any:
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        self.exit(2, f"{self.error_prog or self.prog}: error: {message}\n")


def add_setting(p: argparse.ArgumentParser, name: str, *, help: str | None = None,
                flag: str | None = None) -> argparse.Action:
    """The flag of setting *name*: its parse, check, choices and help come from its declaration.

    The help ends with the environment variable and the default.
    """
    from phasewise.settings import SPECS, arg_type, default_text

    spec = SPECS[name]
    flag = flag or spec.flag or "--" + name.replace("_", "-")
    text = f"{help or spec.help} (env {spec.env}; default {default_text(name)})".replace("%", "%%")
    if spec.kind == "bool":
        return p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
    if spec.choices is not None:
        return p.add_argument(flag, dest=name, choices=spec.choices, help=text)
    return p.add_argument(flag, dest=name, type=arg_type(spec.parse, spec.validate, name=spec.kind), help=text)


def add_common(p: argparse.ArgumentParser) -> None:
    """Flags every Kafka-facing role takes; each also reads PHASEWISE_<NAME>."""
    add_setting(p, "bootstrap")
    add_setting(p, "host")
    add_setting(p, "log_level")


def settings_from_args(args: argparse.Namespace, **extra: Any):
    """The process's one Settings: defaults < environment < flags."""
    from phasewise.settings import SPECS, Settings

    overrides = {k: v for k, v in vars(args).items() if k in SPECS}
    overrides.update(extra)
    return Settings.from_env(overrides)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[list[int]]:
    """While inside: SIGINT and SIGTERM set *stop* (and are listed in the yielded list).

    The handler only records: logging from a signal handler can deadlock. The
    previous handlers come back on exit. Outside the main thread: no handlers.
    """
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
    try:
        yield received
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="phasewise", description=__doc__.splitlines()[0])
    if load in ROLES:
        parser.error_prog = f"phasewise {load}"
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
        print(f"phasewise {role}: error: missing dependency ({e}); install the role's extra, "
              f"e.g. pip install 'phasewise[{_extra_for(role)}]'", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a flag's one-line error (status 2)
        return e.code if isinstance(e.code, int) else 2
    if args.role is None:
        parser.print_help()
        return 2
    from phasewise.settings import SettingsError, unknown_env

    prog = f"phasewise {args.role}"
    for line in unknown_env(os.environ):
        print(f"{prog}: warning: {line}", file=sys.stderr)
    module = importlib.import_module(ROLES[args.role][0])
    try:
        settings = settings_from_args(args)  # every role checks the whole environment
        from phasewise.kafka_security import check_security

        check_security(settings.kafka)  # the Kafka TLS and secret files, before any role starts
        setup_logging(settings.log_level)
        return int(module.run(args) or 0)
    except SettingsError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _extra_for(role: str | None) -> str:
    return {"worker": "streams", "replay": "streams,report", "produce": "producer", "progress": "producer",
            "horus": "streams", "predict": "streams", "place": "streams", "actuate": "actuator", "broker": "broker",
            "bench": "all", "demo": "all", "simulate": "streams,report", "experiment": "all"}.get(role or "", "all")


if __name__ == "__main__":
    raise SystemExit(main())
