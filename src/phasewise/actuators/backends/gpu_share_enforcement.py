"""GPU-share decisions carried to what can enforce them: CUDA MPS environment, HAMi pod resources, else advisory.

Nothing here starts MPS or talks to a cluster: :func:`mps_env` and
:func:`hami_resources` build what those take, :func:`carry` says which
applies and reports the rest as advisory. Who enforces what, and when:
docs/priorities.md, "Elastic GPU sharing".

>>> mps_env(sm_percent=40, mem_limit_bytes=3 * 2**30, device=0)
{'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE': '40', 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT': '0=3072M'}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from phasewise.kit.records import Decision
from phasewise.models.jobs.gpu_share import GpuShare

__all__ = ["BACKENDS", "Carried", "carry", "hami_resources", "mps_env", "share_decision"]

#: where a share can go: ``mps`` (a job started under CUDA MPS), ``hami`` (a Kubernetes pod), ``none``
BACKENDS = ("mps", "hami", "none")
ANNOTATION = "phasewise.io/gpu-share"
_MiB = 2**20


def _check(sm_percent: int, mem_limit_bytes: int) -> None:
    if isinstance(sm_percent, bool) or not isinstance(sm_percent, int) or not 1 <= sm_percent <= 100:
        raise ValueError(f"sm_percent must be an integer in 1..100, got {sm_percent!r}")
    if isinstance(mem_limit_bytes, bool) or not isinstance(mem_limit_bytes, int) or mem_limit_bytes < _MiB:
        raise ValueError(f"mem_limit_bytes must be an integer of at least 1 MiB, got {mem_limit_bytes!r}")


def mps_env(*, sm_percent: int, mem_limit_bytes: int, device: int = 0) -> dict[str, str]:
    """The environment of an MPS client held to the share (memory rounded down to whole MiB)."""
    _check(sm_percent, mem_limit_bytes)
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm_percent),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{int(device)}={mem_limit_bytes // _MiB}M"}


def hami_resources(*, sm_percent: int, mem_limit_bytes: int) -> dict[str, str]:
    """A container's HAMi resource limits for the share (one vGPU, cores in percent, memory in MiB)."""
    _check(sm_percent, mem_limit_bytes)
    return {"nvidia.com/gpu": "1", "nvidia.com/gpucores": str(sm_percent),
            "nvidia.com/gpumem": str(mem_limit_bytes // _MiB)}


def share_decision(share: GpuShare, *, host: str, device: int, ts: float) -> Decision:
    """The ``share`` decision of one job's :class:`~phasewise.models.jobs.gpu_share.GpuShare`."""
    raw = f"share|{host}|{share.job}|{device}|{share.sm_percent}|{share.mem_limit_bytes}|{ts!r}".encode()
    return Decision(id=hashlib.blake2b(raw, digest_size=12).hexdigest(), ts=ts, host=host, container=share.job,
                    action="share", policy="gpu-share", reason=share.reason,
                    details={"sm_percent": share.sm_percent, "mem_limit_bytes": share.mem_limit_bytes,
                             "device": device})


@dataclass(frozen=True, slots=True)
class Carried:
    """How a share decision reaches its job: ``enforced`` or advisory, and what carries it."""

    enforced: bool
    backend: str
    env: dict
    resources: dict
    annotations: dict
    message: str


def carry(decision: Decision, backend: str, *, running: bool) -> Carried:
    """What *backend* does with a ``share`` decision for a job that is *running* or about to start."""
    if decision.action != "share":
        raise ValueError(f"not a share decision: action {decision.action!r}")
    if backend not in BACKENDS:
        raise ValueError(f"GPU share backend must be one of {list(BACKENDS)}, got {backend!r}")
    d = decision.details
    try:
        sm, mem, dev = d["sm_percent"], d["mem_limit_bytes"], d.get("device", 0)
        _check(sm, mem)
    except (KeyError, ValueError) as e:
        raise ValueError(f"share decision {decision.id}: {e}") from None
    if backend == "mps":
        env = mps_env(sm_percent=sm, mem_limit_bytes=mem, device=dev)
        if running:
            return Carried(False, backend, env, {}, {},
                           "advisory until restart: MPS reads the limits when the client starts")
        return Carried(True, backend, env, {}, {}, f"enforced by MPS: {sm} % of threads, {mem // _MiB} MiB")
    if backend == "hami":
        ann = {ANNOTATION: json.dumps({"sm_percent": sm, "mem_limit_bytes": mem, "decision": decision.id},
                                      separators=(",", ":"))}
        res = hami_resources(sm_percent=sm, mem_limit_bytes=mem)
        msg = (f"enforced by HAMi from the pod's next creation: {sm} % cores, {mem // _MiB} MiB" if running
               else f"enforced by HAMi: {sm} % cores, {mem // _MiB} MiB")
        return Carried(not running, backend, {}, res, ann, msg)
    return Carried(False, backend, {}, {}, {}, "advisory: no MPS or HAMi here to enforce the share")
