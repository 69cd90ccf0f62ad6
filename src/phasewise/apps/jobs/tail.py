"""``phasewise tail TOPIC``: a topic's records decoded by their schema, read as a subscriber reads them.

From the beginning (or ``--since``) to the end, or on (``--follow``); ``--key`` and ``--filter FIELD=VALUE``
(dotted paths into nested fields; a list matches when one of its items does) pick records; ``--json``
prints one object a line (topic, partition, offset, key, timestamp, value). A record that does not decode
is printed with why (with ``--filter``, counted on stderr). Narrative, and the same with kcat: docs/jobs.md,
"Watching jobs".
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from phasewise.kit.command import add_common, arg_type
from phasewise.kit.settings import above, parse_float
from phasewise.kit.topics import (
    ACTUATIONS,
    CONTROL,
    DEAD_LETTERS,
    DECISIONS,
    JOB_EVENTS,
    MODELS,
    PHASES,
    PREDICTIONS,
    PROFILES,
    SAMPLES,
    TOPICS,
    Topic,
)

__all__ = ["RECORD_OF", "add_arguments", "decoder", "matches", "parse_duration", "parse_filter", "parse_since",
           "printable", "resolve_topic", "run"]

#: each topic's record (class name, in :mod:`phasewise.kit.records`)
RECORD_OF: dict[str, str] = {
    SAMPLES.name: "HostSamples",
    JOB_EVENTS.name: "JobEvent",
    PHASES.name: "PhaseChange",
    PREDICTIONS.name: "UtilisationPrediction",
    DECISIONS.name: "Decision",
    ACTUATIONS.name: "Actuation",
    MODELS.name: "ModelSnapshot",
    CONTROL.name: "JobControl",
    DEAD_LETTERS.name: "DeadLetter",
    PROFILES.name: "ExecutionProfile",
}
assert set(RECORD_OF) == {t.name for t in TOPICS}, "every topic has its record"

#: strings longer than this are shortened in the text output (a model snapshot's payload); --json prints all
TEXT_STRING_MAX = 200

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")


def printable(text: str) -> str:
    r"""*text* for a terminal: every character that is not printable (a control character, an escape
    sequence's ESC, a newline inside a field) written as its escape, as ``repr`` writes it.

    >>> printable("ok \x1b[2J\nnext")
    'ok \\x1b[2J\\nnext'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def short(t: Topic) -> str:
    """``phasewise.job-events.v1`` -> ``job-events``."""
    return t.name.removeprefix("phasewise.").rsplit(".v", 1)[0]


def resolve_topic(name: str) -> Topic:
    """A topic by its name or short name (``job-events``); ValueError naming the topics otherwise."""
    for t in TOPICS:
        if name in (t.name, short(t)):
            return t
    raise ValueError(f"unknown topic {name!r}; one of: " + ", ".join(short(t) for t in TOPICS)
                     + " (or their full names, e.g. " + JOB_EVENTS.name + ")")


def parse_duration(text: str) -> float:
    """A duration: ``90s``, ``10m``, ``2h``, ``1.5d`` -> seconds.

    >>> parse_duration("10m"), parse_duration("1.5d")
    (600.0, 129600.0)
    """
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (90s, 10m, 2h, 1d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: a duration back from now (``90s``, ``10m``, ``2h``, ``1d``) or an ISO 8601 time (UTC
    without a zone) -> Unix seconds.

    >>> parse_since("10m", now=1000.0), parse_since("2026-01-01T00:00:00Z")
    (400.0, 1767225600.0)
    """
    if _DURATION.match(text):
        return (time.time() if now is None else now) - parse_duration(text)
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (10m, 2h, 90s, 1d) nor an ISO time "
                         "(2026-01-01T12:00:00Z)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def parse_filter(text: str) -> tuple[list[str], str]:
    """``FIELD=VALUE`` -> (the field's path, the value); FIELD may be dotted (``spec.requests.gpus``)."""
    path, eq, value = text.partition("=")
    if not eq or not path.strip() or any(not p for p in path.strip().split(".")):
        raise ValueError(f"{text!r} is not FIELD=VALUE (FIELD may be dotted: details.job=j1)")
    return path.strip().split("."), value


def _equal(field: Any, value: str) -> bool:
    if field is None:
        return value.lower() in ("null", "none", "")
    if isinstance(field, bool):
        return value.lower() == str(field).lower()
    if isinstance(field, (int, float)):
        try:
            return float(value) == float(field)
        except ValueError:
            return False
    if isinstance(field, str):
        return fnmatch.fnmatchcase(field, value)
    return json.dumps(field, sort_keys=True) == value


def matches(value: Any, path: list[str], want: str) -> bool:
    """Does the field at *path* of *value* (a decoded record as a dict) equal *want*? A list on the way
    matches when one of its items does; a string matches a glob (``train-*``); a missing field matches
    nothing.

    >>> rec = {"host": "h1", "containers": [{"container": "a", "cpu_cores": 1.0}, {"container": "b"}]}
    >>> matches(rec, ["containers", "container"], "b"), matches(rec, ["containers", "cpu_cores"], "1")
    (True, True)
    >>> matches(rec, ["host"], "h*"), matches(rec, ["nothing"], "x")
    (True, False)
    """
    if isinstance(value, list):
        return any(matches(v, path, want) for v in value)
    if not path:
        return _equal(value, want)
    if not isinstance(value, dict) or path[0] not in value:
        return False
    return matches(value[path[0]], path[1:], want)


def decoder(topic: Topic) -> Callable[[bytes | None], dict]:
    """*topic*'s records -> their fields as a dict; :class:`~phasewise.kit.records.SchemaError` says why not."""
    from phasewise.kit import records as R

    if topic is SAMPLES:
        return lambda raw: R.to_dict(R.decode_host_samples(raw))
    cls = getattr(R, RECORD_OF[topic.name])

    def decode(raw: bytes | None) -> dict:
        if raw is None:
            raise R.SchemaError(f"{cls.__name__}: the record has no value (null, e.g. a tombstone)")
        return R.to_dict(R.decode(cls, raw))

    return decode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topic", metavar="TOPIC",
                   help="a topic, by its short name (" + ", ".join(short(t) for t in TOPICS) + ") or full name")
    add_common(p)
    p.add_argument("--key", metavar="K", help="only records with this key (a job id, a host, a container)")
    p.add_argument("--filter", action="append", default=[], metavar="FIELD=VALUE", type=arg_type(parse_filter),
                   help="only records whose FIELD equals VALUE; dotted paths reach nested fields "
                        "(details.job=j1, containers.container=train-*); a string VALUE may be a glob; "
                        "repeat: all must hold")
    p.add_argument("--since", metavar="WHEN", type=arg_type(parse_since),
                   help="from the first record stamped at or after WHEN: a duration back (10m, 2h, 1d) or an "
                        "ISO time (2026-01-01T12:00:00Z); default: from the beginning")
    p.add_argument("--json", action="store_true",
                   help="one JSON object a line: topic, partition, offset, key, timestamp, value (or error)")
    p.add_argument("--follow", "-f", action="store_true", help="keep reading new records until interrupted")
    p.add_argument("--timeout", type=arg_type(parse_float, above(0)), default=10.0, metavar="SECONDS",
                   help="give up when no broker answers, or no records come, for this long (default 10)")


def _key_text(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        from phasewise.kit.records import payload_text

        return payload_text(key)


def _shorten(v: Any) -> Any:
    """The text output's value: null fields left out, long strings cut (``--json`` prints all)."""
    if isinstance(v, str) and len(v) > TEXT_STRING_MAX:
        return f"{v[:60]}...({len(v)} characters)"
    if isinstance(v, dict):
        return {k: _shorten(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_shorten(x) for x in v]
    return v


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def line(msg: Any, value: dict | None, error: str | None, *, as_json: bool) -> str:
    """One record as ``tail`` prints it."""
    key = _key_text(msg.key)
    if as_json:
        out: dict[str, Any] = {"topic": msg.topic, "partition": msg.partition, "offset": msg.offset, "key": key,
                               "timestamp": msg.timestamp}
        if error is None:
            out["value"] = value
        else:
            from phasewise.kit.records import payload_text

            out["error"] = error
            out["payload"] = payload_text(msg.value[:4096] if msg.value is not None else None)
            out["payload_bytes"] = None if msg.value is None else len(msg.value)
        return json.dumps(out, separators=(",", ":"), allow_nan=False)
    head = f"{_when(msg.timestamp)} {msg.partition}@{msg.offset} key={printable(key) if key is not None else '-'}"
    if error is None:
        return f"{head} {json.dumps(_shorten(value), separators=(',', ':'), allow_nan=False)}"
    from phasewise.kit.records import brief

    size = "no value" if msg.value is None else f"{len(msg.value)} bytes"
    return f"{head} UNDECODABLE ({size}): {printable(error)}; payload {brief(msg.value, 120)}"


def run(args: argparse.Namespace) -> int:
    import threading

    from phasewise.apps.jobs.read import Reader, ReadError
    from phasewise.kit.command import settings_from_args, stop_on_signals
    from phasewise.kit.kafka.client import BrokerUnavailable
    from phasewise.kit.records import SchemaError

    try:
        topic = resolve_topic(args.topic)
    except ValueError as e:
        print(f"phasewise tail: error: TOPIC: {e}", file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    if settings.log_level != "debug":  # the one line the command ends with says it; no commentary while waiting
        logging.getLogger("phasewise.kafka.client").setLevel(logging.ERROR)
    decode = decoder(topic)
    want_key = None if args.key is None else args.key.encode()
    stop = threading.Event()
    hidden = 0  # records that do not decode, which no --filter can match: counted, said at the end
    try:
        with stop_on_signals(stop), Reader(settings, timeout_s=args.timeout) as reader:
            if reader.partitions(topic.name) is None:
                print(f"phasewise tail: topic {topic.name} does not exist on {settings.kafka.bootstrap} "
                      "(create the topics: phasewise topics)", file=sys.stderr)
                return 1
            for msg in reader.read([topic.name], since=args.since, follow=args.follow, stop=stop):
                if want_key is not None and msg.key != want_key:
                    continue
                try:
                    value, error = decode(msg.value), None
                except SchemaError as e:
                    value, error = None, str(e)
                if args.filter and error is not None:
                    hidden += 1
                    continue
                if error is None and not all(matches(value, path, want) for path, want in args.filter):
                    continue
                print(line(msg, value, error, as_json=args.json), flush=args.follow)
    except BrokerUnavailable as e:
        print(f"phasewise tail: {e}", file=sys.stderr)
        return 1
    except ReadError as e:
        print(f"phasewise tail: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. | head: the reader went away
        sys.stderr.close()
        return 0
    if hidden:
        print(f"phasewise tail: {hidden} record(s) did not decode, so no --filter could match them (without "
              "--filter they are printed, with why)", file=sys.stderr)
    return 0
