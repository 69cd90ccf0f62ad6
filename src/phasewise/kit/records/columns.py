"""The worker's fast decoder of host samples: :func:`decode_host_samples`, column by column.

The same record, the same accept or refuse answer and the same reason as
``decode(HostSamples, raw)``, at a fraction of the cost: the containers are
checked column-wise from the fields' own declarations, and whatever the fast
checks do not take as it stands goes through the strict parser.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from typing import Any

from phasewise.kit.records.codec import (
    _INT_MAX,
    _INT_MIN,
    MAX_MESSAGE_BYTES,
    SchemaError,
    _hints,
    _unwrap_optional,
    decode,
    from_dict,
)
from phasewise.kit.records.samples import ContainerSample, HostSamples

try:  # the worker's hot path parses JSON with orjson when installed (streams extra)
    from orjson import JSONDecodeError as _FastJSONError
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - host agent / actuator installs
    _fast_loads = None

__all__ = ["decode_host_samples"]

_NoneType = type(None)


class _Column:
    """How the fast path checks one ContainerSample field, from the same metadata as the strict parser."""

    __slots__ = ("name", "kind", "optional", "lo", "hi", "slot", "record", "enum", "max_length")

    def __init__(self, cls: type, f: dataclasses.Field) -> None:
        tp, self.optional = _unwrap_optional(_hints(cls)[f.name])
        self.kind = "record" if dataclasses.is_dataclass(tp) else {float: "float", int: "int", str: "str"}[tp]
        self.record = tp if self.kind == "record" else None
        self.name = f.name
        self.lo, self.hi = f.metadata.get("minimum"), f.metadata.get("maximum")
        self.enum = frozenset(f.metadata["enum"]) if f.metadata.get("enum") else None
        self.max_length = f.metadata.get("max_length")
        if self.kind == "int":  # the strict parser's 64-bit range
            self.lo = _INT_MIN if self.lo is None else self.lo
            self.hi = _INT_MAX if self.hi is None else self.hi
        self.slot = cls.__dict__[f.name]  # the slot's member descriptor

    def check(self, col: tuple) -> tuple | None:
        """The converted column if every value passes exactly as the strict parser would pass it, else None."""
        types = set(map(type, col))
        if self.optional and _NoneType in types:
            types.discard(_NoneType)
            vals = [x for x in col if x is not None]
        else:
            vals = col
        if not types:
            return col
        if self.kind == "record":  # nested records (identity, workload): checked column-wise in turn
            if types != {dict}:
                return None
            recs = _fast_rows(self.record, vals)
            if recs is None:
                return None
            if len(recs) == len(col):
                return recs
            it = iter(recs)
            return tuple(None if x is None else next(it) for x in col)
        if self.kind == "str":
            if types != {str}:
                return None
            if self.max_length is not None and max(map(len, vals)) > self.max_length:
                return None
            return None if self.enum is not None and not set(vals) <= self.enum else col
        if self.kind == "int":
            if types != {int}:
                return None  # integral floats, bools, others: the strict parser decides
            if self.lo is not None and min(vals) < self.lo or self.hi is not None and max(vals) > self.hi:
                return None
            return col
        if not types <= {float, int}:
            return None
        if int in types:  # the strict parser stores float(value)
            col = tuple(x if x is None else float(x) for x in col)
            vals = [x for x in col if x is not None]
        # NaN or an infinity makes the sum non-finite (so can finite values whose sum
        # overflows: those take the strict path, which accepts them)
        if not math.isfinite(sum(vals)):
            return None
        if self.lo is not None and min(vals) < self.lo or self.hi is not None and max(vals) > self.hi:
            return None
        return col


_TABLES: dict[type, tuple[tuple[_Column, ...], Any, Any]] = {}


def _table(cls: type) -> tuple[tuple[_Column, ...], Any, Any]:
    """(columns, row getter, builder) of the fast path for record *cls*, made once."""
    t = _TABLES.get(cls)
    if t is None:
        cols = tuple(_Column(cls, f) for f in dataclasses.fields(cls))
        # rows of checked values -> records, bypassing __init__ (one slot store per field,
        # unrolled: the values were validated and converted exactly as __init__'s caller would)
        args = ", ".join(f"a{i}" for i in range(len(cols)))
        body = "; ".join(f"s{i}(o, a{i})" for i in range(len(cols)))
        src = (f"def build(rows):\n    out = []\n    for {args}{',' if len(cols) == 1 else ''} in rows:\n"
               f"        o = new(cls); {body}; out.append(o)\n    return tuple(out)\n")
        ns: dict[str, Any] = {"new": object.__new__, "cls": cls,
                              **{f"s{i}": c.slot.__set__ for i, c in enumerate(cols)}}
        exec(compile(src, f"<phasewise.kit.records fast {cls.__name__}>", "exec"), ns)
        names = [c.name for c in cols]
        getter = operator.itemgetter(*names) if len(names) > 1 else (lambda d, n=names[0]: (d[n],))
        t = _TABLES[cls] = (cols, getter, ns["build"])
    return t


def _fast_rows(cls: type, items: list) -> tuple | None:
    """Records *cls* of a list of dicts, column-wise; None = let the strict parser decide."""
    cols, getter, build = _table(cls)
    try:
        rows = list(map(getter, items))
    except KeyError:  # a field left to its default: the strict parser fills it in
        return None
    checked = []
    try:
        for c, col in zip(cols, zip(*rows)):
            col = c.check(col)
            if col is None:
                return None
            checked.append(col)
    except (OverflowError, ValueError, TypeError):  # e.g. an int too large for a float: strict says what
        return None
    return build(zip(*checked))


def _fast_containers(items: Any) -> tuple[ContainerSample, ...] | None:
    """``containers`` of a HostSamples message, column-wise; None = let the strict parser decide."""
    if type(items) is not list:
        return None
    if not items:
        return ()
    if set(map(type, items)) != {dict}:
        return None
    return _fast_rows(ContainerSample, items)


def decode_host_samples(raw: bytes | str) -> HostSamples:
    """``decode(HostSamples, raw)``, faster: same record, same accept/reject answer, same reason.

    The containers are checked column by column (types, finiteness and bounds
    from the same field metadata). Anything the fast checks do not accept as
    they stand (a missing field left to its default, an integral float in an
    integer field, any invalid value) goes through the strict parser, which
    returns the record or raises :class:`SchemaError` with its reason.

    The JSON is parsed with orjson when it is installed. orjson refuses a
    little that ``json.loads`` takes (``NaN``/``Infinity`` literals, integers
    beyond 64 bits, lone surrogate escapes): those go through the strict
    parser too, so the answer never depends on which parser is installed.
    Like :func:`decode`, it raises nothing but :class:`SchemaError`.
    """
    if type(raw) is not bytes or len(raw) > MAX_MESSAGE_BYTES:
        return decode(HostSamples, raw)  # null, text, too large: the strict parser decides
    if _fast_loads is not None:
        try:
            data = _fast_loads(raw)
        except (_FastJSONError, TypeError, MemoryError):
            return decode(HostSamples, raw)  # the strict parser decides, and words the error
    else:
        try:
            data = json.loads(raw)
        except (ValueError, TypeError, RecursionError, MemoryError):
            return decode(HostSamples, raw)  # the strict parser words the error
    if type(data) is dict and "containers" in data:
        cs = _fast_containers(data["containers"])
        if cs is not None:
            try:
                top = from_dict(HostSamples, {**data, "containers": []})
            except SchemaError:
                return from_dict(HostSamples, data)  # the first error in field order, as strict reports it
            return dataclasses.replace(top, containers=cs)
    return from_dict(HostSamples, data)
