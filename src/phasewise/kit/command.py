"""What every role's command shares: its settings as flags (argparse adapters), its one Settings, a stop on
SIGINT/SIGTERM, and the exit of last resort.

The CLI (:mod:`phasewise.cli`) builds a subcommand per role from these (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def arg_type(parse: Callable[[str], Any], check: Callable[[Any], None] | None = None,
             name: str | None = None) -> Callable[[str], Any]:
    """An argparse ``type=``: *parse* then *check*, a ValueError's reason as the flag's error.

    >>> from phasewise.kit.settings import above, parse_float
    >>> arg_type(parse_float, above(0))("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be > 0, got -1.0
    """
    def convert(text: str) -> Any:
        try:
            value = parse(text)
            if check is not None:
                check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    convert.__name__ = name or getattr(parse, "__name__", "value")
    return convert


def report_dir(text: str) -> Path:
    """An argparse ``type=`` for ``--report DIR``: the folder, made if missing and written to once, when the
    flags are read: a folder that cannot take the report is a one-line error before the run, not a
    traceback after it."""
    import os
    import tempfile

    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".phasewise-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write a report in {text}: {e.strerror or e}") from None
    return path


def add_setting(p: argparse.ArgumentParser, name: str, *, help: str | None = None,
                flag: str | None = None) -> argparse.Action:
    """The flag of setting *name*: its parse, check, choices and help come from its declaration.

    The help ends with the environment variable and the default.
    """
    from phasewise.kit.settings import SPECS, default_text

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
    from phasewise.kit.settings import SPECS, Settings

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


def exit_now(logger: logging.Logger, level: int, message: str, *args: Any) -> None:
    """Log *message*, flush the logs and end this process with status 1 at once (no clean-up, no
    ``finally``, no atexit: for a role whose stop cannot finish; what it did not commit is done again at
    its next start)."""
    logger.log(level, message, *args)
    logging.shutdown()
    os._exit(1)
