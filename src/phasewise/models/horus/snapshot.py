"""The Horus model shared between horus workers: its learned observations as a ``ModelSnapshot``, and back.

The model's state is the observations it learned (:meth:`~phasewise.models.horus.model.HorusModel.to_state`
replays them), so a snapshot carries those, each with its job id: a worker that reads one learns the jobs
it has not learned yet (:meth:`~phasewise.models.horus.state.HorusState.merge`), and no job is learned twice
across workers. Payload: zlib-compressed JSON, base64. Pure; refused with the reason (:class:`SchemaError`)
when the payload is no such list. Narrative: docs/horus.md, "Sharing the model".

>>> s = snapshot_of([{"job": "a", "f": {"flops": 1.0}, "o": {"cpu_cores": 0.5}, "d": "cpu"}], 3, ts=1.7e9)
>>> s.name, s.version, s.samples_seen, observations_of(s)[0]["job"]
('horus/utilisation', 3, 1, 'a')
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from typing import Any

from phasewise.kit.records import ModelSnapshot, SchemaError, brief

__all__ = ["SNAPSHOT_NAME", "MAX_SNAPSHOT_BYTES", "observations_of", "snapshot_of"]

#: the key (and name) of the Horus model on the models topic
SNAPSHOT_NAME = "horus/utilisation"
#: the largest payload read, compressed and inflated (2,000 observations are about 1.5 MB of JSON)
MAX_SNAPSHOT_BYTES = 16 * 2**20
_FORMAT = 1


def snapshot_of(observations: list[dict[str, Any]], version: int, ts: float) -> ModelSnapshot:
    """The snapshot of *observations* (``{"job", "f", "o", "d"}`` each, in the order learned)."""
    body = json.dumps({"format": _FORMAT, "obs": observations}, separators=(",", ":")).encode()
    return ModelSnapshot(name=SNAPSHOT_NAME, ts=ts, version=version,
                         payload_b64=base64.b64encode(zlib.compress(body, 6)).decode(),
                         samples_seen=len(observations))


def _number_map(x: Any, what: str) -> dict[str, float]:
    if not isinstance(x, dict):
        raise ValueError(f"{what} is {type(x).__name__}, not an object")
    out = {}
    for k, v in x.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{what}[{brief(str(k), 40)}] is not a finite number")
        out[str(k)] = float(v)
    return out


def observations_of(snap: ModelSnapshot, *, max_bytes: int = MAX_SNAPSHOT_BYTES) -> list[dict[str, Any]]:
    """The observations *snap* carries, checked field by field; :class:`SchemaError` (only) otherwise."""
    where = f"ModelSnapshot {brief(snap.name)} v{snap.version}"
    if snap.name != SNAPSHOT_NAME:
        raise SchemaError(f"{where}: not the Horus model ({SNAPSHOT_NAME})")
    if len(snap.payload_b64) // 4 * 3 > max_bytes:
        raise SchemaError(f"{where}: payload larger than {max_bytes} bytes")
    try:
        z = zlib.decompressobj()
        body = z.decompress(base64.b64decode(snap.payload_b64, validate=True), max_bytes)
        if z.unconsumed_tail:
            raise ValueError(f"inflates to more than {max_bytes} bytes")
        doc = json.loads(body)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("obs"), list):
            raise ValueError(f"not a Horus observation list of format {_FORMAT}")
        out = []
        for i, o in enumerate(doc["obs"]):
            if not isinstance(o, dict) or not isinstance(o.get("job"), str) or not o["job"]:
                raise ValueError(f"observation {i} has no job id")
            d = o.get("d")
            if d is not None and not isinstance(d, str):
                raise ValueError(f"observation {i}: device is {type(d).__name__}")
            f, obs = o.get("f"), _number_map(o.get("o"), f"observation {i} observed")
            if not isinstance(f, dict):
                raise ValueError(f"observation {i}: features are {type(f).__name__}, not an object")
            out.append({"job": o["job"], "f": f, "o": obs, "d": d})
        return out
    except (ValueError, TypeError, binascii.Error, zlib.error, RecursionError) as e:
        raise SchemaError(f"{where}: payload is no Horus model: {type(e).__name__}: {brief(str(e), 300)}") from None
