"""Versioned, pickle-free checkpoint format shared by the phase models.

A checkpoint is ``MAGIC | u32 header length | JSON header | zlib(raw array bytes)``.
The header names the model kind, its checkpoint version, its constructor
arguments and learned scalars (``meta``), and where each numpy array lies in
the payload. Loading checks the magic, the kind and the version and raises
:class:`CheckpointError` with the reason, so a worker that reads a snapshot
written by another build says so instead of running on garbage. No pickle:
a snapshot read from a topic cannot execute code.

>>> import numpy as np
>>> blob = pack("demo", 1, {"a": 2}, {"w": np.arange(3.0)})
>>> meta, arrays = unpack(blob, "demo", 1)
>>> meta["a"], arrays["w"].tolist()
(2, [0.0, 1.0, 2.0])
>>> try:
...     unpack(blob, "demo", 2)
... except CheckpointError as e:
...     print(e)
demo checkpoint has version 1; this build reads version 2
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

__all__ = ["CheckpointError", "pack", "unpack"]

MAGIC = b"PWCK"


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; ``str(e)`` says why."""


def pack(kind: str, version: int, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """Serialise *meta* (JSON-able) and *arrays* (numpy) under *kind* / *version*."""
    index: dict[str, dict[str, Any]] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        raw = a.tobytes()
        index[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": len(raw)}
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps(
        {"kind": kind, "version": version, "meta": meta, "arrays": index},
        separators=(",", ":"),
        allow_nan=True,
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + zlib.compress(b"".join(chunks), 1)


def unpack(data: bytes, kind: str, version: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of :func:`pack`; raises :class:`CheckpointError` on any mismatch."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointError(f"{kind} checkpoint must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < 8 or data[:4] != MAGIC:
        raise CheckpointError(f"not a phasewise checkpoint (expected a {kind} checkpoint)")
    (hlen,) = struct.unpack("<I", data[4:8])
    try:
        header = json.loads(data[8 : 8 + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{kind} checkpoint header is corrupt: {e}") from None
    if header.get("kind") != kind:
        raise CheckpointError(f"checkpoint holds a {header.get('kind')!r}, not a {kind!r}")
    if header.get("version") != version:
        raise CheckpointError(
            f"{kind} checkpoint has version {header.get('version')}; this build reads version {version}"
        )
    try:
        body = zlib.decompress(data[8 + hlen :])
    except zlib.error as e:
        raise CheckpointError(f"{kind} checkpoint body is corrupt: {e}") from None
    arrays: dict[str, np.ndarray] = {}
    for name, spec in header["arrays"].items():
        start, n = spec["offset"], spec["nbytes"]
        if start + n > len(body):
            raise CheckpointError(f"{kind} checkpoint is truncated (array {name!r})")
        arrays[name] = (
            np.frombuffer(body[start : start + n], dtype=np.dtype(spec["dtype"])).reshape(spec["shape"]).copy()
        )
    return header["meta"], arrays
