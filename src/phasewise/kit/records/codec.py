"""The records' codec: a field's declaration with its bounds, strict JSON decoding, encoding.

:func:`decode` turns bytes into a record or raises :class:`SchemaError` with
the reason, and nothing else, whatever the bytes hold; :func:`encode` writes
compact JSON (orjson when installed). docs/architecture.md ("Records") says
what the codec guarantees and why.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from typing import Any, TypeVar

try:  # the worker's hot path writes JSON with orjson when installed (streams extra)
    from orjson import dumps as _fast_dumps
except ImportError:  # pragma: no cover - host agent / actuator installs
    _fast_dumps = None

__all__ = [
    "MAX_BYTES",
    "MAX_CORES",
    "MAX_MESSAGE_BYTES",
    "MAX_PCT",
    "SchemaError",
    "brief",
    "decode",
    "encode",
    "encode_within",
    "field",
    "from_dict",
    "max_bytes",
    "payload_text",
    "to_dict",
]

# Bounds that reject absurd values at the edge. A container using more than
# 4096 cores or 64 TiB is a broken sampler, not a workload.
MAX_CORES = 4096.0
MAX_BYTES = float(2**46)
MAX_PCT = 100.0
#: the largest message :func:`decode` parses (a cap on the memory one record can
#: take; Kafka's default message size limit is 1 MB)
MAX_MESSAGE_BYTES = 16 * 2**20
#: integer fields are 64-bit (what Kafka's other clients read)
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


class SchemaError(ValueError):
    """A message does not match its record's schema; ``str(e)`` is the reason."""


def brief(value: Any, limit: int = 60) -> str:
    """A value as a reason quotes it: ``repr`` up to *limit* characters, an array or object by its kind.

    >>> brief("x" * 100, limit=20), brief(10**80, limit=20), brief(1.5)
    ("'xxxxxxx... (102 characters)", '10000000... (81 characters)', '1.5')
    >>> brief([[1]]), brief({"a": 1})
    ('an array', 'an object')
    """
    t = type(value)
    if t is list or t is tuple:
        return "an array"
    if t is dict:
        return "an object"
    try:
        r = repr(value)
    except (ValueError, RecursionError):  # e.g. an int beyond the interpreter's digit limit
        return f"a {t.__name__}"
    return r if len(r) <= limit else f"{r[:limit - 12]}... ({len(r)} characters)"


def field(
    *,
    default: Any = dataclasses.MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    enum: tuple[str, ...] | None = None,
    pattern: str | None = None,
    max_length: int | None = None,
    max_items: int | None = None,
    max_bytes: int | None = None,
    key_max_length: int | None = None,
    doc: str = "",
) -> Any:
    """A record field's declaration: its default and the bounds :func:`decode` checks.

    *max_length*: characters of a string, of each string of an array of
    strings, or of each value of an object of strings; *max_items*: items of
    an array, entries of an object; *max_bytes*: UTF-8 bytes of an array of
    strings' items together; *key_max_length*: characters of each key of an
    object of strings.
    """
    meta = {"minimum": minimum, "maximum": maximum, "enum": enum, "doc": doc}
    if pattern is not None:
        meta["pattern"] = pattern
    for k, v in (("max_length", max_length), ("max_items", max_items), ("max_bytes", max_bytes),
                 ("key_max_length", key_max_length)):
        if v is not None:
            meta[k] = v
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


R = TypeVar("R")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = typing.get_type_hints(cls)
        h.pop("VERSION", None)
        h.pop("MAX_BYTES", None)
        _HINTS[cls] = h
    return h


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _number_converter(cls: str, name: str, meta: dict, integer: bool, optional: bool):
    lo, hi = meta.get("minimum"), meta.get("maximum")
    kind = "an integer" if integer else "a number"

    def convert(value: Any) -> Any:
        if value is None:
            if optional:
                return None
            raise SchemaError(f"{cls}: field '{name}' must not be null")
        t = type(value)
        if t is bool or (t is not int and t is not float):
            raise SchemaError(f"{cls}: field '{name}' must be {kind}, got {t.__name__}")
        if integer:
            if t is float:
                if not value.is_integer():
                    raise SchemaError(f"{cls}: field '{name}' must be an integer, got {value!r}")
                value = int(value)
            if value < _INT_MIN or value > _INT_MAX:
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is not a 64-bit integer")
        else:
            try:
                value = float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is too large for a number") from None
            if value != value or value in (math.inf, -math.inf):
                raise SchemaError(f"{cls}: field '{name}' must be finite, got {value!r}")
        if lo is not None and value < lo:
            raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is above the maximum {hi:g}")
        return value

    return convert


def _converter(cls: str, name: str, tp: Any, meta: dict):
    """A function validating and converting one field's decoded JSON value."""
    tp, optional = _unwrap_optional(tp)
    if tp is float or tp is int:
        return _number_converter(cls, name, meta, tp is int, optional)

    def null_or(check):
        def convert(value: Any) -> Any:
            if value is None:
                if optional:
                    return None
                raise SchemaError(f"{cls}: field '{name}' must not be null")
            return check(value)

        return convert

    max_length, max_items, max_bytes = meta.get("max_length"), meta.get("max_items"), meta.get("max_bytes")
    if tp is str:
        enum = meta.get("enum")
        pattern = re.compile(meta["pattern"]) if meta.get("pattern") else None

        def check_str(value: Any) -> str:
            if type(value) is not str:
                raise SchemaError(f"{cls}: field '{name}' must be a string, got {type(value).__name__}")
            if max_length is not None and len(value) > max_length:
                raise SchemaError(f"{cls}: field '{name}' is {len(value)} characters long, more than "
                                  f"{max_length}")
            if enum and value not in enum:
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is not one of {list(enum)}")
            if pattern is not None and not pattern.match(value):
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} does not match {pattern.pattern}")
            return value

        return null_or(check_str)
    if tp is bool:

        def check_bool(value: Any) -> bool:
            if type(value) is not bool:
                raise SchemaError(f"{cls}: field '{name}' must be true or false, got {type(value).__name__}")
            return value

        return null_or(check_bool)
    if tp is dict:

        def check_dict(value: Any) -> dict:
            if type(value) is not dict:
                raise SchemaError(f"{cls}: field '{name}' must be an object")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} entries, more than {max_items}")
            return value

        return null_or(check_dict)
    if typing.get_origin(tp) is dict and typing.get_args(tp) == (str, str):
        key_max = meta.get("key_max_length")

        def check_labels(value: Any) -> dict:
            if type(value) is not dict:
                raise SchemaError(f"{cls}: field '{name}' must be an object")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} entries, more than {max_items}")
            for k, v in value.items():
                if type(v) is not str:
                    raise SchemaError(f"{cls}: field '{name}': the value of {brief(k)} must be a string, "
                                      f"got {type(v).__name__}")
                if key_max is not None and len(k) > key_max:
                    raise SchemaError(f"{cls}: field '{name}': key {brief(k)} is {len(k)} characters long, "
                                      f"more than {key_max}")
                if max_length is not None and len(v) > max_length:
                    raise SchemaError(f"{cls}: field '{name}': the value of {brief(k)} is {len(v)} characters "
                                      f"long, more than {max_length}")
            return value

        return null_or(check_labels)
    if dataclasses.is_dataclass(tp):  # a nested record (e.g. JobEvent.spec)

        def check_nested(value: Any) -> Any:
            try:
                return _parser(tp)(value)
            except SchemaError as e:
                raise SchemaError(f"{cls}: {name}: {e}") from None

        return null_or(check_nested)
    if typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is str:

        def check_strings(value: Any) -> tuple:
            if type(value) is not list or any(type(x) is not str for x in value):
                raise SchemaError(f"{cls}: field '{name}' must be an array of strings")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} items, more than {max_items}")
            if max_length is not None:
                for i, x in enumerate(value):
                    if len(x) > max_length:
                        raise SchemaError(f"{cls}: field '{name}'[{i}] is {len(x)} characters long, more than "
                                          f"{max_length}")
            if max_bytes is not None:
                # (lone surrogates, which JSON escapes can spell, are counted as the 3 bytes they would take)
                size = sum(len(x.encode("utf-8", "surrogatepass")) for x in value)
                if size > max_bytes:
                    raise SchemaError(f"{cls}: field '{name}' holds {size} bytes (UTF-8), more than {max_bytes}")
            return tuple(value)

        return null_or(check_strings)
    if typing.get_origin(tp) is tuple:
        item_tp = typing.get_args(tp)[0]

        def check_items(value: Any) -> tuple:
            if type(value) is not list:
                raise SchemaError(f"{cls}: field '{name}' must be an array")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} items, more than {max_items}")
            build = _parser(item_tp)
            out = []
            for i, item in enumerate(value):
                try:
                    out.append(build(item))
                except SchemaError as e:
                    raise SchemaError(f"{cls}: {name}[{i}]: {e}") from None
            return tuple(out)

        return null_or(check_items)
    raise TypeError(f"unsupported field type {tp!r}")  # a bug in this module, not bad input


_PARSERS: dict[type, Any] = {}


def _parser(cls: type):
    """Compile (once per class) a function dict -> record that validates every field."""
    parse = _PARSERS.get(cls)
    if parse is not None:
        return parse
    name = cls.__name__
    hints = _hints(cls)
    specs = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append((f.name, required, _converter(name, f.name, hints[f.name], f.metadata)))
    versioned = "v" in hints
    version = getattr(cls, "VERSION", None)

    def parse(data: Any) -> Any:
        if type(data) is not dict:
            raise SchemaError(f"{name}: expected a JSON object, got {type(data).__name__}")
        if versioned:
            v = data.get("v")
            if v is None:
                raise SchemaError(f"{name}: missing field 'v' (schema version)")
            if v != version or type(v) is bool:
                raise SchemaError(f"{name}: unsupported schema version {brief(v)} (this build reads v{version})")
        kwargs = {}
        for fname, required, convert in specs:
            if fname in data:
                kwargs[fname] = convert(data[fname])
            elif required:
                raise SchemaError(f"{name}: missing field '{fname}'")
        return cls(**kwargs)

    _PARSERS[cls] = parse
    return parse


def from_dict(cls: type[R], data: dict) -> R:
    """Build a record from a decoded JSON object, validating every field."""
    return _parser(cls)(data)


_RECORD_TYPES: dict[type, bool] = {}


def _is_record(t: type) -> bool:
    """Whether values of type *t* are records (dataclasses), which :func:`to_dict` writes as objects."""
    known = _RECORD_TYPES.get(t)
    if known is None:
        known = _RECORD_TYPES[t] = dataclasses.is_dataclass(t)
    return known


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}

_isfinite = math.isfinite


def _not_finite(where: str, value: Any) -> ValueError:
    return ValueError(f"{where}: {value!r} is not a finite number (JSON has none)")


def _check_finite(tree: Any, where: str) -> None:
    """Refuse a non-finite float anywhere in a free-form dict / list (``details``, ``stats``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for v in (node.values() if isinstance(node, dict) else node):
            t = type(v)  # the exact common types first: this runs over every decision's details
            if t is float:
                if not _isfinite(v):
                    raise _not_finite(where, v)
            elif t is dict or t is list:
                stack.append(v)
            elif t is str or t is int or t is bool or v is None:
                continue
            elif isinstance(v, float):
                if not _isfinite(v):
                    raise _not_finite(where, v)
            elif isinstance(v, (dict, list, tuple)):
                stack.append(v)


def to_dict(record: Any) -> dict:
    """The record's fields as JSON-ready values; a non-finite float anywhere raises ``ValueError``."""
    cls = type(record)
    names = _FIELD_NAMES.get(cls)
    if names is None:  # dataclasses.fields() once per class, not per record
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(record))
    out = {}
    for name in names:
        value = getattr(record, name)
        t = type(value)
        if isinstance(value, float):  # numpy.float64 included
            if not _isfinite(value):
                raise _not_finite(f"{cls.__name__}.{name}", value)
        elif t is tuple:
            value = [x if type(x) is str else to_dict(x) for x in value]
        elif t is dict or t is list:
            _check_finite(value, f"{cls.__name__}.{name}")
        elif _is_record(t):  # a nested record
            value = to_dict(value)
        out[name] = value
    return out


#: what json.dumps(..., separators=(",", ":"), allow_nan=False) builds per call, built once
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _orjson_default(obj: Any) -> Any:
    """What orjson leaves to a callback and ``json.dumps`` writes: float subclasses (e.g. numpy.float64)."""
    if isinstance(obj, float):
        return float(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def encode(record: Any) -> bytes:
    """Compact UTF-8 JSON of a record (orjson when installed, ~2x faster on decisions; else ``json``).

    The two write the same JSON values (number and non-ASCII text spellings
    may differ: ``1e-05`` / ``1e-5``, ``\\u00e9`` / UTF-8); a non-finite
    number anywhere is refused with ``ValueError`` by both.
    """
    d = to_dict(record)
    if _fast_dumps is not None:
        return _fast_dumps(d, default=_orjson_default)
    return _ENCODER.encode(d).encode()


def _unparsable(name: str, raw: Any, e: BaseException) -> SchemaError:
    """The reason *raw* could not be parsed as JSON (``json.loads`` raised *e*)."""
    if raw is None:
        return SchemaError(f"{name}: the record has no value (null, e.g. a tombstone); expected a JSON object")
    if isinstance(e, RecursionError):
        return SchemaError(f"{name}: not valid JSON: arrays or objects nested too deeply to parse")
    if isinstance(e, MemoryError):
        return SchemaError(f"{name}: not valid JSON: out of memory parsing {len(raw)} bytes")
    if isinstance(e, TypeError):
        return SchemaError(f"{name}: expected bytes, got {type(raw).__name__}")
    if isinstance(e, (UnicodeDecodeError, json.JSONDecodeError)):
        return SchemaError(f"{name}: not valid JSON: {e}")
    # ValueError: an integer literal longer than the interpreter converts (sys.get_int_max_str_digits())
    return SchemaError(f"{name}: not valid JSON: {str(e).split(';')[0]}")


def max_bytes(cls: type) -> int:
    """The largest message of record *cls* that :func:`decode` takes (its ``MAX_BYTES``, else
    :data:`MAX_MESSAGE_BYTES`)."""
    return getattr(cls, "MAX_BYTES", MAX_MESSAGE_BYTES)


def _too_large(name: str, raw: bytes | str, limit: int = MAX_MESSAGE_BYTES) -> SchemaError:
    which = "MAX_MESSAGE_BYTES" if limit == MAX_MESSAGE_BYTES else f"{name}.MAX_BYTES"
    return SchemaError(f"{name}: message of {len(raw)} bytes is larger than the limit of "
                       f"{limit} bytes ({which})")


def encode_within(record: Any) -> bytes:
    """:func:`encode`, refusing with :class:`SchemaError` a record larger than :func:`decode` takes back.

    What a writer of a bounded record (``phasewise submit``) calls: a record
    it publishes is one every consumer reads.
    """
    value = encode(record)
    limit = max_bytes(type(record))
    if len(value) > limit:
        raise _too_large(type(record).__name__, value, limit)
    return value


def decode(cls: type[R], raw: bytes | str) -> R:
    """Parse and validate one message; :class:`SchemaError` says why not (and nothing else is raised).

    >>> from phasewise.kit.records import ContainerSample, Decision, HostSamples
    >>> s = ContainerSample(container="job-a", cpu_cores=1.5, mem_bytes=2**30)
    >>> msg = HostSamples(host="h1", ts=1.0, interval_s=1.0, containers=(s,))
    >>> decode(HostSamples, encode(msg)) == msg
    True
    >>> decode(HostSamples, b'{"v": 1, "host": "h1"}')
    Traceback (most recent call last):
    ...
    phasewise.kit.records.codec.SchemaError: HostSamples: missing field 'ts'
    >>> decode(Decision, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    phasewise...SchemaError: Decision: the record has no value (null, e.g. a tombstone); expected a JSON object
    >>> decode(Decision, b"[" * 100_000)
    Traceback (most recent call last):
    ...
    phasewise.kit.records.codec.SchemaError: Decision: not valid JSON: arrays or objects nested too deeply to parse
    """
    try:
        limit = max_bytes(cls)
        if len(raw) > limit:
            raise _too_large(cls.__name__, raw, limit)
        data = json.loads(raw)
    except SchemaError:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        raise _unparsable(cls.__name__, raw, e) from None
    return from_dict(cls, data)


def payload_text(raw: bytes | None) -> str:
    """Lossless text form of arbitrary bytes for a dead letter."""
    if raw is None:
        return ""
    return raw.decode("utf-8", errors="backslashreplace")
