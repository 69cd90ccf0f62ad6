"""GPU-share decisions carried to what can enforce them: CUDA MPS environment, HAMi pod resources, else advisory.

Nothing here starts MPS or talks to a cluster: :func:`mps_env` and
:func:`hami_resources` build what those take, :func:`carry` says which
applies and reports the rest as advisory, :func:`start_environment` is what
a job started under a share gets (the MPS variables and directories) and
whether an MPS control daemon is there to enforce it. Who enforces what, and
when: docs/priorities.md, "Elastic GPU sharing".

>>> mps_env(sm_percent=40, mem_limit_bytes=3 * 2**30, device=0)
{'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE': '40', 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT': '0=3072M'}
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from phasewise.kit.records import Decision
from phasewise.models.jobs.gpu_share import share_decision

__all__ = ["BACKENDS", "Carried", "MPS_LOG_DIR", "MPS_PIPE_DIR", "carry", "hami_resources", "mps_daemon", "mps_env",
           "share_decision", "start_environment"]

#: where a share can go: ``mps`` (a job started under CUDA MPS), ``hami`` (a Kubernetes pod), ``none``
BACKENDS = ("mps", "hami", "none")
ANNOTATION = "phasewise.io/gpu-share"
#: CUDA's defaults, where the actuator's environment names no other (``CUDA_MPS_PIPE_DIRECTORY`` /
#: ``CUDA_MPS_LOG_DIRECTORY``, as the control daemon was started with)
MPS_PIPE_DIR = "/tmp/nvidia-mps"
MPS_LOG_DIR = "/var/log/nvidia-mps"
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


def mps_daemon(pipe_dir: str) -> bool:
    """Whether an MPS control daemon serves *pipe_dir*: its ``control`` endpoint is there, a FIFO (older CUDA)
    or a Unix socket (CUDA 13's daemon, seen on an H100)."""
    try:
        mode = os.stat(Path(pipe_dir) / "control").st_mode
        return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except OSError:
        return False


def start_environment(decision: Decision, *, visible: tuple[int, ...] | None = None,
                      environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], bool, str]:
    """``(environment, enforced, message)`` of a job started under *decision*'s share on this host: the MPS
    limits and the pipe and log directories (the actuator's own ``CUDA_MPS_*_DIRECTORY``, else CUDA's
    defaults), enforced only where an MPS control daemon serves that pipe directory, else advisory.
    *visible*: the GPUs the job sees (its ``CUDA_VISIBLE_DEVICES``): the memory limit names the share's
    GPU by its ordinal among them, as the job's CUDA numbers it. :class:`ValueError` for a share
    decision without valid limits."""
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIR
    logs = environ.get("CUDA_MPS_LOG_DIRECTORY") or MPS_LOG_DIR
    up = mps_daemon(pipe)
    c = carry(decision, "mps" if up else "none", running=False)
    d = decision.details
    dev = d.get("device", 0)
    if visible and dev in visible:
        dev = visible.index(dev)
    env = {**mps_env(sm_percent=d["sm_percent"], mem_limit_bytes=d["mem_limit_bytes"], device=dev),
           "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
    if up:
        return env, True, c.message
    return env, False, (f"GPU share advisory: no MPS control daemon serves {pipe} (no control pipe), so nothing "
                        f"enforces {d['sm_percent']} % of threads and {d['mem_limit_bytes'] // _MiB} MiB; "
                        "the job's environment carries them")
