"""Learn batches: the phase detectors' sampled windows on their way to the one learner (internal topic).

:func:`encode_learn_batch` writes one; :func:`decode_learn_batch` reads one for a model or says why
not with a :class:`~phasewise.kit.records.SchemaError`, whatever the bytes hold. Pure, no IO; the
format: docs/architecture.md, "Records".
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

try:  # learn batches are ~1 KB of numbers per window: orjson writes numpy arrays directly (streams extra)
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

from phasewise.kit.records.codec import MAX_BYTES, MAX_CORES, MAX_MESSAGE_BYTES, MAX_PCT, SchemaError, brief

__all__ = ["LEARN_BATCH_VERSION", "decode_learn_batch", "encode_learn_batch"]

#: 2: carries each window's container level (relative phase statistics); 1 is still read
LEARN_BATCH_VERSION = 2


def _finite_list(a: np.ndarray) -> list[float | None]:
    return [None if not math.isfinite(x) else x for x in np.asarray(a, dtype=np.float64).reshape(-1).tolist()]


_NUMBER_OR_NULL = frozenset((float, int, type(None)))


def _float_array(xs: Any) -> np.ndarray:
    """Inverse of :func:`_finite_list`: None becomes NaN (numpy converts it); anything but numbers and
    nulls (booleans, strings numpy would read as numbers, arrays) raises TypeError."""
    if type(xs) is not list:
        raise TypeError(f"expected a list, got {type(xs).__name__}")
    if not _NUMBER_OR_NULL.issuperset(map(type, xs)):
        raise TypeError("expected numbers or nulls")
    return np.array(xs, dtype=np.float64)


def _int_array(xs: Any) -> np.ndarray:
    """A list of integers as int64 (TypeError for anything else, OverflowError beyond 64 bits)."""
    if type(xs) is not list:
        raise TypeError(f"expected a list, got {type(xs).__name__}")
    if not {int}.issuperset(map(type, xs)):
        raise TypeError("expected integers")
    return np.array(xs, dtype=np.int64)


def _flat(a: Any, dtype: Any = np.float64) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=dtype).reshape(-1))


def encode_learn_batch(name: str, windows: np.ndarray, prev_phase: np.ndarray, usage: np.ndarray,
                       levels: np.ndarray | None = None) -> bytes:
    """JSON of a sample of ready windows ``(n, L, F)``, the phases in force, the usage to credit and
    (relative statistics) each container's level just before the frame. Missing (non-finite) numbers
    are written as null."""
    W = np.asarray(windows, dtype=np.float64)
    d: dict[str, Any] = {
        "v": LEARN_BATCH_VERSION, "model": name, "shape": list(W.shape),
        "windows": _flat(W), "prev_phase": _flat(prev_phase, np.int64), "usage": _flat(usage),
    }
    if levels is not None:
        d["levels"] = _flat(levels)
    if _orjson is not None:  # numpy arrays written directly, NaN / inf as null
        return _orjson.dumps(d, option=_orjson.OPT_SERIALIZE_NUMPY)
    for k in ("windows", "usage", "levels"):
        if k in d:
            d[k] = _finite_list(d[k])
    d["prev_phase"] = d["prev_phase"].tolist()
    return json.dumps(d, separators=(",", ":")).encode()


#: the largest value of each frame feature a learn batch may carry (the HostSamples field's maximum)
_FEATURE_MAX = {"cpu": MAX_CORES, "mem": MAX_BYTES, "gpu": MAX_PCT * 64, "gpu_mem": MAX_BYTES}


def _out_of_range(A: np.ndarray, hi: np.ndarray, what: str) -> str | None:
    """Why the rows of *A* (last axis: features) are not *what* (usage, level): a value below 0 or
    above the feature's maximum *hi* (NaN is a missing value: the normaliser skips it)."""
    with np.errstate(invalid="ignore"):
        if (A < 0).any():
            return f"negative {what}"
        if (A > hi).any():
            return f"{what} above the feature's maximum"
    return None


def decode_learn_batch(raw: bytes | None, name: str, window_len: int, n_features: int,
                       features: Sequence[str] | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Parse a learn batch for model *name*: ``(windows, prev_phase, usage, levels or None)``.

    :class:`SchemaError` says why not, whatever *raw* holds (nothing else is
    raised). Version 1 batches (no levels) are read too. Every number of the
    windows, usage and levels is missing (null) or within [0, the feature's
    maximum] (*features*: the model's; without them the columns after cpu and
    mem are checked against the largest maximum); phases in force are
    integers >= -1.
    """
    if raw is None:
        raise SchemaError("learn batch: the record has no value (null, e.g. a tombstone)")
    try:
        if len(raw) > MAX_MESSAGE_BYTES:
            raise SchemaError(f"learn batch: message of {len(raw)} bytes is larger than the limit of "
                              f"{MAX_MESSAGE_BYTES} bytes (MAX_MESSAGE_BYTES)")
        try:
            d = _orjson.loads(raw) if _orjson is not None else json.loads(raw)
        except (ValueError, TypeError, MemoryError):  # orjson's error is a JSONDecodeError (a ValueError)
            if _orjson is None:
                raise
            d = json.loads(raw)  # what orjson refuses json decides (NaN: a missing value), and words the error
    except SchemaError:
        raise
    except RecursionError:
        raise SchemaError("learn batch: not valid JSON: arrays or objects nested too deeply to parse") from None
    except (ValueError, TypeError, MemoryError) as e:
        raise SchemaError(f"learn batch: not valid JSON: {str(e).split(';')[0]}") from None
    if type(d) is not dict or d.get("v") not in (1, LEARN_BATCH_VERSION) or type(d.get("v")) is not int:
        raise SchemaError(f"learn batch: unsupported version {brief(d.get('v') if type(d) is dict else d)}")
    if d.get("model") != name:
        raise SchemaError(f"learn batch: for model {brief(d.get('model'))}, this learner trains {name!r}")
    shape = d.get("shape")
    if not (type(shape) is list and len(shape) == 3 and shape[1:] == [window_len, n_features]
            and type(shape[0]) is int and 0 <= shape[0] <= MAX_MESSAGE_BYTES):
        shown = "[" + ", ".join(map(brief, shape)) + "]" if type(shape) is list and len(shape) <= 3 else brief(shape)
        raise SchemaError(f"learn batch: shape {shown}, expected [n, {window_len}, {n_features}]")
    n = shape[0]
    try:
        W = _float_array(d["windows"])
        U = _float_array(d["usage"])
        P = _int_array(d["prev_phase"])
    except KeyError as e:
        raise SchemaError(f"learn batch: missing array {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"learn batch: bad arrays: {type(e).__name__}: {brief(str(e), 200)}") from None
    if W.size != n * window_len * n_features or U.size != n * n_features or P.shape != (n,):
        raise SchemaError(f"learn batch: array sizes do not match shape {shape}")
    hi = np.array([_FEATURE_MAX[f] for f in features] if features is not None
                  else [MAX_CORES, MAX_BYTES] + [max(_FEATURE_MAX.values())] * (n_features - 2))
    W, U = W.reshape(n, window_len, n_features), U.reshape(n, n_features)
    for where, A in (("windows", W), ("usage", U)):
        why = _out_of_range(A, hi, "usage")
        if why is not None:
            raise SchemaError(f"learn batch: {why} ({where})")
    if (P < -1).any():
        raise SchemaError("learn batch: a phase in force below -1")
    levels = None
    if d.get("levels") is not None:
        try:
            levels = _float_array(d["levels"])
        except (TypeError, ValueError, OverflowError) as e:
            raise SchemaError(f"learn batch: bad levels: {type(e).__name__}: {brief(str(e), 200)}") from None
        if levels.size != n * n_features:
            raise SchemaError(f"learn batch: levels do not match shape {shape}")
        levels = levels.reshape(n, n_features)
        why = _out_of_range(levels, hi, "level")
        if why is not None:
            raise SchemaError(f"learn batch: {why}")
    return W, P, U, levels
