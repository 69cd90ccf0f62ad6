"""The frame features a phase model may use and the ones its decisions limit (docs/results.md).

Defined here alone, without numpy or torch, so that the settings
(:mod:`phasewise.kit.settings`, ``phase_features``) check against the same
names the detector reads.
"""

from __future__ import annotations

__all__ = ["FEATURES", "LIMITED", "PRETRAINED_MODELS"]

#: features a frame may carry, in this order, with their units
FEATURES: dict[str, str] = {
    "cpu": "cores",
    "mem": "bytes",
    "gpu": "percent",
    "gpu_mem": "bytes",
}
#: the features phase decisions set limits for (always features); the others only shape the phases
LIMITED = ("cpu", "mem")
#: the pretrained phase models phasewise ships (``phase_pretrained_model``), the default first: ``corpus``
#: learned on the train split of the shipped corpus of real training executions sampled each second,
#: ``ai4dl`` on the AI4DL IBM DLaaS sample (docs/phases.md, "The starting model")
PRETRAINED_MODELS = ("corpus", "ai4dl")
