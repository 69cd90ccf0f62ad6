"""JSON Schemas of the records, for subscribers outside phasewise (``phasewise schemas --write infra/schemas``).

Written from the same field declarations the codec checks; a test keeps infra/schemas/ current.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

from phasewise.kit.records.codec import _hints, _unwrap_optional

__all__ = ["json_schemas"]

def _json_type(tp: Any, meta: dict, defs: dict) -> dict:
    tp, optional = _unwrap_optional(tp)
    if tp is float:
        s: dict = {"type": "number"}
    elif tp is int:
        s = {"type": "integer"}
    elif tp is bool:
        s = {"type": "boolean"}
    elif tp is str:
        s = {"type": "string"}
        if meta.get("enum"):
            s["enum"] = list(meta["enum"])
        if meta.get("pattern"):
            s["pattern"] = meta["pattern"]
        if meta.get("max_length") is not None:
            s["maxLength"] = meta["max_length"]
    elif tp is dict:
        s = {"type": "object"}
        if meta.get("max_items") is not None:
            s["maxProperties"] = meta["max_items"]
    elif typing.get_origin(tp) is dict:  # an object of strings
        value: dict = {"type": "string"}
        if meta.get("max_length") is not None:
            value["maxLength"] = meta["max_length"]
        s = {"type": "object", "additionalProperties": value}
        if meta.get("key_max_length") is not None:
            s["propertyNames"] = {"maxLength": meta["key_max_length"]}
        if meta.get("max_items") is not None:
            s["maxProperties"] = meta["max_items"]
    elif dataclasses.is_dataclass(tp):
        defs[tp.__name__] = _schema_body(tp, defs)
        ref: dict = {"$ref": f"#/$defs/{tp.__name__}"}
        s = {"anyOf": [ref, {"type": "null"}]} if optional else ref
        if meta.get("doc"):
            s["description"] = meta["doc"]
        return s
    elif typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is str:
        s = {"type": "array", "items": {"type": "string"}}
        if meta.get("max_length") is not None:
            s["items"]["maxLength"] = meta["max_length"]
        if meta.get("max_bytes") is not None:  # no JSON Schema keyword says it: the items' own bound, and words
            s["items"]["maxLength"] = min(meta["max_bytes"], s["items"].get("maxLength", meta["max_bytes"]))
    elif typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        defs[item.__name__] = _schema_body(item, defs)
        s = {"type": "array", "items": {"$ref": f"#/$defs/{item.__name__}"}}
    elif dataclasses.is_dataclass(tp):
        defs[tp.__name__] = _schema_body(tp, defs)
        s = {"$ref": f"#/$defs/{tp.__name__}"}
    else:
        raise TypeError(tp)
    if meta.get("max_items") is not None and s.get("type") == "array":
        s["maxItems"] = meta["max_items"]
    if meta.get("minimum") is not None:
        s["minimum"] = meta["minimum"]
    if meta.get("maximum") is not None:
        s["maximum"] = meta["maximum"]
    if meta.get("doc"):
        s["description"] = meta["doc"]
    if meta.get("max_bytes") is not None:
        s["description"] = (s.get("description", "") + f" (at most {meta['max_bytes']} bytes of UTF-8 in all)").strip()
    if optional:
        if "type" in s:
            s["type"] = [s["type"], "null"]
        else:  # a nested record
            ref = {"$ref": s.pop("$ref")}
            s = {"anyOf": [ref, {"type": "null"}], **s}
    return s


def _schema_body(cls: type, defs: dict) -> dict:
    hints = _hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        props[f.name] = _json_type(hints[f.name], f.metadata, defs)
        if f.name == "v":
            props["v"] = {"const": cls.VERSION, "description": "schema version"}  # type: ignore[attr-defined]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    if "v" in props:
        required.append("v")
    return {
        "type": "object",
        "description": (cls.__doc__ or "").strip().splitlines()[0],
        "properties": props,
        "required": required,
        "additionalProperties": True,
    }


def json_schemas(records: Iterable[type]) -> dict[str, dict]:
    """``{file name: JSON Schema}`` for every top-level record of *records* (e.g. :data:`RECORDS`)."""
    out = {}
    for cls in records:
        if "v" not in _hints(cls):
            continue  # nested records are $defs of their parents
        defs: dict = {}
        body = _schema_body(cls, defs)
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"phasewise/{cls.__name__}.v{cls.VERSION}.json",  # type: ignore[attr-defined]
            "title": cls.__name__,
            **body,
        }
        if "MAX_BYTES" in cls.__dict__:  # no JSON Schema keyword bounds a document's size: said in words
            schema["description"] += f" A message is at most {cls.MAX_BYTES} bytes."  # type: ignore[attr-defined]
        if defs:
            schema["$defs"] = defs
        out[f"{cls.__name__}.v{cls.VERSION}.json"] = schema  # type: ignore[attr-defined]
    return out
