"""An analytic prior of a training job's GPU utilisation from its graph and the GPU's peak figures: a step
keeps the GPU busy for its compute and memory time (roofline: FLOPs at the peak rate, bytes at the memory
bandwidth, each at an attainable fraction) plus a minimum time per kernel, while the host needs a launch
time per kernel and a fixed time per step; the GPU is busy for the first over the longer of the two.
Narrative: docs/horus.md, "Across architectures".

>>> g = dict(flops=4e12, activation_bytes=2e9, param_bytes=1e8, optimizer_bytes=2e8, kernels=200, amp=False)
>>> round(utilisation(g, "a100"), 1)   # compute-bound: the GPU is the bottleneck
100.0
>>> tiny = dict(g, flops=4e6, activation_bytes=2e5, param_bytes=4e4, optimizer_bytes=8e4, kernels=30)
>>> utilisation(tiny, "a100") < 20    # launch-bound: the host is
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Peaks", "PEAKS", "peaks", "step_times", "utilisation"]


@dataclass(frozen=True, slots=True)
class Peaks:
    """A GPU's datasheet figures: FP32 and dense FP16 tensor FLOP/s, memory bandwidth (bytes/s)."""

    fp32: float
    fp16: float
    bandwidth: float


#: device type (as node selectors and samples name it) -> its peaks (datasheet, SXM parts where there are two)
PEAKS: dict[str, Peaks] = {
    "k80": Peaks(4.1e12, 4.1e12, 240e9), "p100": Peaks(10.6e12, 21.2e12, 732e9),
    "v100": Peaks(15.7e12, 125e12, 900e9), "t4": Peaks(8.1e12, 65e12, 320e9),
    "a10": Peaks(31.2e12, 125e12, 600e9), "a100": Peaks(19.5e12, 312e12, 1.555e12),
    "l4": Peaks(30.3e12, 121e12, 300e9), "l40s": Peaks(91.6e12, 362e12, 864e9),
    "h100": Peaks(67e12, 989e12, 3.35e12), "h200": Peaks(67e12, 989e12, 4.8e12),
}
#: an unnamed GPU is taken for an A100
DEFAULT_DEVICE = "a100"

#: attainable fractions of the peaks, seconds per kernel on the GPU and on the host, host seconds per step
#: (chosen on the measured families other than the held-out one: docs/horus.md, "Across architectures")
COMPUTE_EFFICIENCY = 0.7
MEMORY_EFFICIENCY = 0.6
KERNEL_S = 12e-6
LAUNCH_S = 30e-6
STEP_S = 1.5e-3


def peaks(device: str | None) -> Peaks:
    """The peaks of *device* (case-insensitive; a name containing a known type, e.g. ``nvidia-a100-40gb``, is
    that type); unknown or None: :data:`DEFAULT_DEVICE`'s."""
    d = (device or "").lower()
    if d in PEAKS:
        return PEAKS[d]
    for k in sorted(PEAKS, key=len, reverse=True):
        if k in d:
            return PEAKS[k]
    return PEAKS[DEFAULT_DEVICE]


def step_times(g: Mapping[str, Any], device: str | None = None) -> dict[str, float]:
    """Seconds one training step of graph features *g* needs: ``compute``, ``memory``, ``kernels`` (on the GPU),
    ``gpu`` (their sum) and ``host`` (launching its kernels plus the step's fixed cost)."""
    p = peaks(device)
    amp = bool(g.get("amp"))
    kernels = float(g.get("kernels") or 0) or 9.0 * float(g.get("depth", 1)) + 12.0 * float(g.get("norm", 0)) + 8
    # forward writes what backward reads, backward writes as much again; weights are read twice, their gradients
    # written once, and the optimizer reads and writes weights, gradients and its state
    moved = 3.0 * g["activation_bytes"] + 5.0 * g["param_bytes"] + 2.0 * g["optimizer_bytes"]
    t = {"compute": g["flops"] / ((p.fp16 if amp else p.fp32) * COMPUTE_EFFICIENCY),
         "memory": moved / (p.bandwidth * MEMORY_EFFICIENCY), "kernels": kernels * KERNEL_S}
    t["gpu"] = t["compute"] + t["memory"] + t["kernels"]
    t["host"] = kernels * LAUNCH_S + STEP_S
    return t


def utilisation(g: Mapping[str, Any], device: str | None = None) -> float:
    """Percent of the time the GPU is busy training graph *g* on *device*: its time over the step's."""
    t = step_times(g, device)
    return 100.0 * t["gpu"] / max(t["gpu"], t["host"])
