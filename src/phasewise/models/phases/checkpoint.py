"""Versioned, pickle-free checkpoint format shared by the phase models (docs/phases.md, "The model").

>>> import numpy as np
>>> meta, arrays = unpack(pack("demo", 1, {"a": 2}, {"w": np.arange(3.0)}), "demo", 1)
>>> meta["a"], arrays["w"].tolist()
(2, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import contextlib
import json
import struct
import zlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np

__all__ = ["CheckpointError", "inflate_budget", "pack", "unpack"]

MAGIC = b"PWCK"
#: the most array bytes a checkpoint may hold (phasewise's models take kilobytes)
MAX_BODY_BYTES = 2**30


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; ``str(e)`` says why."""


#: bytes the checkpoints unpacked in the current :func:`inflate_budget` may still inflate to, and its name
_BUDGET: ContextVar[list | None] = ContextVar("phasewise_checkpoint_budget", default=None)


@contextlib.contextmanager
def inflate_budget(max_bytes: int, name: str = "") -> Iterator[None]:
    """Every :func:`unpack` inside together inflates at most *max_bytes* (nested checkpoints included).

    A checkpoint whose index names more than what is left is refused before
    anything is inflated, and the inflater never produces more than the index
    names, so a small compressed bomb never grows in memory. *name* (the
    limit's setting) is named in the refusal.

    >>> import numpy as np
    >>> blob = pack("demo", 1, {}, {"w": np.zeros(1000)})
    >>> with inflate_budget(4000):
    ...     try:
    ...         unpack(blob, "demo", 1)
    ...     except CheckpointError as e:
    ...         print(e)
    demo checkpoint index names 8000 bytes, more than the 4000 left to unpack
    """
    token = _BUDGET.set([int(max_bytes), name])
    try:
        yield
    finally:
        _BUDGET.reset(token)


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
    if 8 + hlen > len(data):
        raise CheckpointError(f"{kind} checkpoint is truncated (header)")
    try:
        header = json.loads(data[8 : 8 + hlen])
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, an int of too many digits
        raise CheckpointError(f"{kind} checkpoint header is corrupt: {type(e).__name__}") from None
    if type(header) is not dict:
        raise CheckpointError(f"{kind} checkpoint header is corrupt: not an object")
    if header.get("kind") != kind:
        raise CheckpointError(f"checkpoint holds a {str(header.get('kind'))[:40]!r}, not a {kind!r}")
    if header.get("version") != version:
        raise CheckpointError(
            f"{kind} checkpoint has version {str(header.get('version'))[:40]}; this build reads version {version}"
        )
    index = header.get("arrays")
    if type(index) is not dict or type(header.get("meta")) is not dict or not all(
        type(sp) is dict and type(sp.get("offset")) is int and type(sp.get("nbytes")) is int
        and sp["offset"] >= 0 and sp["nbytes"] >= 0 for sp in index.values()
    ):
        raise CheckpointError(f"{kind} checkpoint header is corrupt: bad array index")
    size = max((sp["offset"] + sp["nbytes"] for sp in index.values()), default=0)
    if size > MAX_BODY_BYTES:
        raise CheckpointError(f"{kind} checkpoint index names {size} bytes, more than {MAX_BODY_BYTES}")
    budget = _BUDGET.get()
    if budget is not None:
        if size > budget[0]:
            raise CheckpointError(f"{kind} checkpoint index names {size} bytes, more than the {budget[0]} left "
                                  f"to unpack" + (f" ({budget[1]})" if budget[1] else ""))
        budget[0] -= size
    try:  # at most the bytes the index names: a small body cannot inflate to gigabytes
        inflate = zlib.decompressobj()
        body = inflate.decompress(data[8 + hlen :], size + 1)
    except zlib.error as e:
        raise CheckpointError(f"{kind} checkpoint body is corrupt: {e}") from None
    if len(body) > size or inflate.unconsumed_tail:
        raise CheckpointError(f"{kind} checkpoint body is larger than its index says")
    if not inflate.eof or inflate.unused_data:
        raise CheckpointError(f"{kind} checkpoint body is truncated or has trailing bytes")
    arrays: dict[str, np.ndarray] = {}
    for name, spec in index.items():
        start, n = spec["offset"], spec["nbytes"]
        if start + n > len(body):
            raise CheckpointError(f"{kind} checkpoint is truncated (array {name!r})")
        try:
            dtype = np.dtype(spec["dtype"])
            if dtype.hasobject:
                raise TypeError("object arrays are not data")
            arrays[name] = np.frombuffer(body[start : start + n], dtype=dtype).reshape(spec["shape"]).copy()
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{kind} checkpoint array {name!r} is corrupt: {type(e).__name__}: {e}") from None
    return header["meta"], arrays
