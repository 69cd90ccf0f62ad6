"""``phasewise``: the one CLI, a subcommand per role, app and small command (:data:`ROLES`).

Each role is a module (or ``module:object``) exposing ``add_arguments(parser)``
and ``run(args) -> int``; modules are imported only when their subcommand runs,
so a host agent never imports torch or Faust.

Before any role runs, the ``PHASEWISE_*`` environment and the flags are read
into :class:`~phasewise.kit.settings.Settings` (every role checks all of them). A
configuration error, from a flag or the environment, is one line on stderr,
``phasewise ROLE: error: <setting>: <why>``, and exit status 2; a
``PHASEWISE_*`` variable that is no setting gets a one-line warning.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
from typing import Any

from phasewise import __version__
from phasewise.kit.command import settings_from_args

#: subcommand -> (module or module:object, one-line help)
ROLES: dict[str, tuple[str, str]] = {
    "demo": ("phasewise.apps.demo.run", "local demo: broker, worker, producer, actuator and 3 real training jobs"),
    "broker": ("phasewise.cli.broker", "run the embedded Kafka-compatible broker (Tansu) on loopback"),
    "worker": ("phasewise.streams.worker", "run the Faust stream processor (samples -> decisions)"),
    "produce": ("phasewise.producers.host_agent", "run the host agent: sample containers, publish to Kafka"),
    "progress": ("phasewise.producers.progress",
                 "progress sidecar: a job's step/loss lines to Kafka, the control channel to the job"),
    "actuate": ("phasewise.actuators.consumer", "run the actuator: apply this host's decisions"),
    "explain": ("phasewise.streams.explain", "a container's limits, recommendations, phase and live scorecard"),
    "replay": ("phasewise.apps.replay.cli", "replay a real trace through the policies and score them"),
    "record": ("phasewise.apps.record.cli", "record the samples topic (or this host) to a Parquet trace for replay"),
    "simulate": ("phasewise.apps.simulate.cli", "replay a pod list against a node list through the placement policies"),
    "bench": ("phasewise.apps.bench.cli", "throughput / latency / memory benchmarks"),
    "experiment": ("phasewise.apps.experiment.cli", "experiments with real jobs under a policy (targets, priorities)"),
    "schemas": ("phasewise.cli.schemas", "write or check the JSON Schemas of every topic"),
    "topics": ("phasewise.cli.topics", "create the topics on a cluster (idempotent) and list them"),
    "keys": ("phasewise.cli.keys", "make a key pair: keys submitter PATH (a job submitter's Ed25519 key)"),
    "submit": ("phasewise.apps.horus.submit", "publish a job (JOB.json|yaml) on the job-events topic"),
    "horus": ("phasewise.streams.worker:HORUS", "run the Horus worker (jobs + samples -> utilisation predictions)"),
    "place": ("phasewise.streams.worker:PLACE", "run the placement worker (jobs + predictions + samples -> "
                                                "place decisions)"),
    "predict": ("phasewise.apps.horus.predict", "score the utilisation model on profiled jobs; read shared profiles"),
    "jobs": ("phasewise.apps.jobs.cli", "the jobs: state, host, prediction vs use, progress, why one waits; "
                                        "jobs describe JOB: its timeline"),
    "tail": ("phasewise.apps.jobs.tail", "print a topic's records decoded (--key, --filter, --since, --json, "
                                         "--follow)"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``phasewise ROLE: error: --flag: why`` (exit status 2)."""

    #: the name errors start with (the role's, also for errors the top-level parser finds)
    error_prog: str | None = None

    def error(self, message: str) -> Any:
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        self.exit(2, f"{self.error_prog or self.prog}: error: {message}\n")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def role_of(spec: str) -> Any:
    """The object a :data:`ROLES` entry names: a module, or ``module:object``."""
    module, _, name = spec.partition(":")
    m = importlib.import_module(module)
    return getattr(m, name) if name else m


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="phasewise", description=__doc__.splitlines()[0])
    if load in ROLES:
        parser.error_prog = f"phasewise {load}"
    parser.add_argument("--version", action="version", version=f"phasewise {__version__}")
    sub = parser.add_subparsers(dest="role", metavar="ROLE")
    for name, (module, help_) in ROLES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if load in (name, "*"):
            role_of(module).add_arguments(p)
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
    from phasewise.kit.settings import SettingsError, unknown_env

    prog = f"phasewise {args.role}"
    for line in unknown_env(os.environ):
        print(f"{prog}: warning: {line}", file=sys.stderr)
    module = role_of(ROLES[args.role][0])
    if args.role in _CLEANS_UP:
        # SIGTERM (timeout, a supervisor, kill) ends it as Ctrl-C would, through its cleanup: the broker
        # and roles it started are stopped, not left behind
        signal.signal(signal.SIGTERM, _terminated)
    try:
        settings = settings_from_args(args)  # every role checks the whole environment
        from phasewise.kit.kafka.security import check_security

        check_security(settings.kafka)  # the Kafka TLS and secret files, before any role starts
        setup_logging(settings.log_level)
        return int(module.run(args) or 0)
    except SettingsError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


#: commands that start a broker, roles or jobs of their own and stop them in their cleanup
_CLEANS_UP = frozenset({"bench", "experiment"})


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _extra_for(role: str | None) -> str:
    return {"worker": "streams", "replay": "streams,report", "record": "record", "produce": "producer",
            "progress": "producer", "horus": "streams", "predict": "streams", "place": "streams", "actuate": "actuator",
            "broker": "broker", "bench": "all", "demo": "all", "simulate": "streams,report",
            "experiment": "all"}.get(role or "", "all")


if __name__ == "__main__":
    raise SystemExit(main())
