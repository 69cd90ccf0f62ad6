"""Model snapshots: the shared phase model as a ``ModelSnapshot`` record, and back (refused, with the reason,
when the payload is no usable model). Pure. docs/phases.md, "In the worker".

>>> from phasewise.models.phases.detector import PhaseModel
>>> m = PhaseModel(features=("cpu", "mem"), n_hid=4, n_his=1)
>>> snapshot_of(m, 3, 10, ts=1.7e9).name
'phase-crbm/cpu+mem'
"""

from __future__ import annotations

import base64

from phasewise.kit.records import ModelSnapshot, SchemaError, brief
from phasewise.models.phases.checkpoint import MAX_BODY_BYTES, inflate_budget
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.features import LIMITED

__all__ = ["FEATURES", "model_name", "model_of", "snapshot_of"]

#: default frame features of the live detector (``phase_features``; the shipped pretrained model's)
FEATURES = ("cpu", "mem")


def model_name(features: tuple[str, ...] = FEATURES) -> str:
    """Key of the shared model on the models topic."""
    return "phase-crbm/" + "+".join(features)


def snapshot_of(model: PhaseModel, version: int, samples_seen: int, ts: float) -> ModelSnapshot:
    """The snapshot of *model* as published at *ts* (wall time), its *version* and the windows it learned."""
    return ModelSnapshot(name=model_name(model.features), ts=ts, version=version,
                         payload_b64=base64.b64encode(model.to_bytes()).decode(), samples_seen=samples_seen)


def model_of(snap: ModelSnapshot, *, max_bytes: int | None = None, max_unpacked_bytes: int | None = None
             ) -> PhaseModel:
    """The model a snapshot carries; :class:`SchemaError` (only) when its payload is no usable PhaseModel.

    *max_bytes*: the checkpoint's largest size (compressed), checked before the
    payload is decoded; *max_unpacked_bytes*: what its arrays, nested
    checkpoints included, may inflate to, checked before inflating
    (:func:`~phasewise.models.phases.checkpoint.inflate_budget`).
    """
    packed = len(snap.payload_b64) // 4 * 3
    if max_bytes is not None and packed > max_bytes:
        raise SchemaError(f"ModelSnapshot {brief(snap.name)} v{snap.version}: checkpoint of about {packed} bytes "
                          f"is larger than phase_snapshot_max_bytes ({max_bytes})")
    try:
        with inflate_budget(MAX_BODY_BYTES if max_unpacked_bytes is None else max_unpacked_bytes,
                            "phase_snapshot_max_unpacked_bytes"):
            model = PhaseModel.from_bytes(base64.b64decode(snap.payload_b64, validate=True))
        if not set(LIMITED) <= set(model.features):
            raise ValueError(f"features {list(model.features)} lack {list(LIMITED)}")
        return model
    except Exception as e:  # noqa: BLE001 - whatever the payload holds, it is a reason, not a crash
        why = f"{type(e).__name__}: {brief(str(e), 300)}"
        raise SchemaError(f"ModelSnapshot {brief(snap.name)} v{snap.version}: payload is no PhaseModel: "
                          f"{why}") from None
