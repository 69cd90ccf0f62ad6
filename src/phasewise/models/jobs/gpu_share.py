"""Elastic GPU sharing, pure: SM fractions and memory caps for jobs co-located on one GPU (DynamoML).

:func:`shares` gives each job its memory request (the set refused when it does not fit:
:class:`DoesNotFit`) and a whole-number percent of SMs: its request plus a proportional part of what is
left when the requests fit, else priority levels in order at their full request while every less
important job keeps ``min_percent``. :func:`share_decisions` turns the shares of one GPU into the
``share`` decisions the placement agent sends (the actuator carries them:
:mod:`phasewise.actuators.backends.gpu_share_enforcement`). Narrative: docs/priorities.md, "Elastic GPU
sharing".

>>> s = shares([ShareRequest("a", 0.5, 4 * 2**30), ShareRequest("b", 0.25, 2 * 2**30)], mem_total_bytes=16 * 2**30)
>>> [(x.job, x.sm_percent, x.mem_limit_bytes // 2**30) for x in s]
[('a', 67, 4), ('b', 33, 2)]
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import Decision

__all__ = ["DoesNotFit", "GpuShare", "ShareRequest", "placement_shares", "share_decision", "share_decisions",
           "shares"]


class DoesNotFit(ValueError):
    """The jobs' GPU memory requests exceed the GPU's memory."""


@dataclass(frozen=True, slots=True)
class ShareRequest:
    job: str
    fraction: float
    mem_bytes: float
    priority: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0 < self.fraction <= 1):
            raise ValueError(f"{self.job}: GPU fraction must be in (0, 1], got {self.fraction!r}")
        if not (math.isfinite(self.mem_bytes) and self.mem_bytes >= 0):
            raise ValueError(f"{self.job}: GPU memory must be a finite number >= 0, got {self.mem_bytes!r}")


@dataclass(frozen=True, slots=True)
class GpuShare:
    """What one job gets on its GPU."""

    job: str
    sm_percent: int
    mem_limit_bytes: int
    reason: str


def _whole(weights: list[float], total: int, floor: int) -> list[int]:
    """*total* split in proportion to *weights* as whole numbers >= *floor* (largest remainders)."""
    if not weights:
        return []
    s = sum(weights)
    raw = [max(floor, total * w / s) for w in weights]
    out = [max(floor, math.floor(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in order:
        if sum(out) >= total:
            break
        out[i] += 1
    while sum(out) > total and max(out) > floor:  # floors pushed it over: take back from the largest
        out[out.index(max(out))] -= 1
    return out


def shares(jobs: list[ShareRequest], *, mem_total_bytes: float, min_percent: int = 5) -> list[GpuShare]:
    """The shares of *jobs* co-located on one GPU (see the module doc), in the order given."""
    if not jobs:
        return []
    if len({j.job for j in jobs}) != len(jobs):
        raise ValueError("a job appears twice on one GPU")
    mem = sum(j.mem_bytes for j in jobs)
    if mem > mem_total_bytes:
        raise DoesNotFit(f"GPU memory requests {mem / 2**30:.1f} GiB exceed the GPU's "
                         f"{mem_total_bytes / 2**30:.1f} GiB")
    if len(jobs) * min_percent > 100:
        raise DoesNotFit(f"{len(jobs)} jobs cannot each get {min_percent} % of one GPU")
    asked = sum(j.fraction for j in jobs)
    pct: dict[str, int] = {}
    why: dict[str, str] = {}
    if asked <= 1.0 + 1e-9:
        for j, p in zip(jobs, _whole([j.fraction for j in jobs], 100, min_percent)):
            pct[j.job] = p
            why[j.job] = f"requests sum to {asked:.0%}: each its request plus a proportional part of the rest"
    else:
        left = 100
        tiers = sorted({j.priority for j in jobs}, reverse=True)
        for prio in tiers:
            tier = [j for j in jobs if j.priority == prio]
            below = sum(1 for j in jobs if j.priority < prio)
            avail = left - min_percent * below  # every less important job keeps at least the floor
            need = [math.ceil(j.fraction * 100 - 1e-9) for j in tier]
            if sum(need) <= avail:
                got = need
                text = "full request, in priority order"
            else:
                got = _whole([j.fraction for j in tier], avail, min_percent)
                text = f"a proportional part of the {avail} % left to priority {prio}"
            for j, p in zip(tier, got):
                pct[j.job], why[j.job] = p, f"oversubscribed ({asked:.0%}): {text}"
            left -= sum(got)
    return [GpuShare(j.job, pct[j.job], math.ceil(j.mem_bytes), why[j.job]) for j in jobs]


def share_decision(share: GpuShare, *, host: str, device: int, ts: float, container: str | None = None) -> Decision:
    """The ``share`` decision of one job's :class:`GpuShare` on GPU *device* of *host* (its container: the
    job's id unless named; ``details.job`` names the job)."""
    c = share.job if container is None else container
    raw = f"share|{host}|{share.job}|{c}|{device}|{share.sm_percent}|{share.mem_limit_bytes}|{ts!r}".encode()
    return Decision(id=hashlib.blake2b(raw, digest_size=12).hexdigest(), ts=ts, host=host, container=c,
                    action="share", policy="gpu-share", reason=share.reason,
                    details={"job": share.job, "sm_percent": share.sm_percent,
                             "mem_limit_bytes": share.mem_limit_bytes, "device": device})


def share_decisions(jobs: list[ShareRequest], *, mem_total_bytes: float, host: str, device: int, ts: float,
                    containers: dict[str, str] | None = None, min_percent: int = 5) -> list[Decision]:
    """The ``share`` decisions of the jobs sharing GPU *device* (:func:`shares`, in the order given; a job's
    container from *containers*, else its id). A GPU whose memory is unknown (*mem_total_bytes* 0) is taken
    to hold the requests. :class:`DoesNotFit` as :func:`shares`.

    >>> ds = share_decisions([ShareRequest("a", 0.5, 2**30), ShareRequest("b", 0.5, 2**30)], mem_total_bytes=0,
    ...                      host="h1", device=0, ts=1.0, containers={"a": "a-1"})
    >>> [(d.container, d.details["sm_percent"]) for d in ds]
    [('a-1', 50), ('b', 50)]
    """
    total = mem_total_bytes if mem_total_bytes > 0 else sum(j.mem_bytes for j in jobs)
    containers = containers or {}
    return [share_decision(s, host=host, device=device, ts=ts, container=containers.get(s.job))
            for s in shares(jobs, mem_total_bytes=total, min_percent=min_percent)]


def placement_shares(state: Any, place: Decision, ts: float) -> list[Decision]:
    """The ``share`` decisions that go with *place*, a placement agent's decision (*state*: its
    :class:`~phasewise.models.jobs.placement.state.PlacementState`): for a job that takes a share of one GPU
    (0 < ``requests.gpus`` < 1), the shares of every job booked on that GPU, the placed job's first (its
    actuator holds it until the place decision starts the job). Empty for any other job, or where the
    GPU's memory requests do not fit (the booking allowed it: nothing to divide)."""
    job = place.details.get("job", place.container)
    gpus = place.details.get("device") or []
    ev = state.events.get(job)
    if ev is None or ev.spec is None or not 0 < ev.spec.requests.gpus < 1 or len(gpus) != 1:
        return []
    cluster, g = state.cluster, gpus[0]
    node = cluster.index.get(place.details.get("node"))
    if node is None:
        return []
    on_gpu = sorted((j for j, a in cluster.allocs.items() if a.node == node and g in a.gpus and 0 < a.milli < 1000),
                    key=lambda j: (j != job, j))
    reqs, containers = [], {job: place.container}
    for j in on_gpu:
        a, other = cluster.allocs[j], state.events.get(j)
        reqs.append(ShareRequest(j, a.milli / 1000, float(a.gmem), other.priority if other is not None else 0))
    try:
        return share_decisions(reqs, mem_total_bytes=float(cluster.gmem_cap[node, g]), host=place.host, device=g,
                               ts=ts, containers=containers)
    except (DoesNotFit, ValueError):
        return []
