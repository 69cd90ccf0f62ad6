"""Limit decisions as records: what both worker policies hand to the actuators, built the same way for both.

Limits are rounded as handed out (:func:`round_limits`: CPU up to a
millicore, memory up to a byte), every decision has an idempotency key
(:func:`decision_id`: a hash of policy, host, container, limits and event
time), a one-line ``reason`` and the numbers behind it in ``details``.
:func:`vpa_decision` and :func:`phase_decisions` build them. Pure.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from phasewise.kit.records import MAX_BYTES, MAX_CORES, ContainerSample, Decision
from phasewise.models.safety.guard import bounded_text

if TYPE_CHECKING:
    from phasewise.models.phases.fleet import FleetStep

__all__ = [
    "PHASE_POLICY", "VPA_POLICY", "VpaEvidence", "clean", "decision_id", "phase_decisions", "round_limits",
    "vpa_decision",
]

#: ``Decision.policy`` of the VPA updater's decisions
VPA_POLICY = "vpa"
#: ``Decision.policy`` of the phase detector's decisions
PHASE_POLICY = "phase"


def decision_id(policy: str, host: str, container: str, cpu: float | None, mem: float | None, ts: float) -> str:
    """Deterministic idempotency key of a limit decision (24 hex digits).

    >>> decision_id("vpa", "h1", "job", 1.25, None, 1700000000.0)
    '121873436690bb834add6854'
    >>> decision_id("phase", "h1", "job", 1.25, None, 1700000000.0)
    '716fd7de65900da2c078ba93'
    """
    raw = f"{policy}|{host}|{container}|{cpu!r}|{mem!r}|{ts!r}".encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def round_limits(cpu: np.ndarray, mem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Limits as handed out: CPU rounded up to a millicore (as VPA rounds CPU), memory up to a byte,
    neither above the schema's maximum (``NaN``, no limit, stays ``NaN``).

    >>> cpu, mem = round_limits(np.array([0.1234, 0.5, 1e9]), np.array([1.5, np.nan, 2.0**60]))
    >>> cpu.tolist(), mem.tolist()
    ([0.124, 0.5, 4096.0], [2.0, nan, 70368744177664.0])
    """
    return np.minimum(np.ceil(cpu * 1000.0 - 1e-9) / 1000.0, MAX_CORES), np.minimum(np.ceil(mem), MAX_BYTES)


def clean(obj: Any) -> Any:
    """JSON-safe copy of *obj*: non-finite floats become ``None``, numpy scalars Python numbers.

    >>> clean({"a": [1.0, float("nan")], "b": np.float64(2.0), "c": np.int64(3)})
    {'a': [1.0, None], 'b': 2.0, 'c': 3}
    """
    t = type(obj)  # the common exact types first (called for every decision's and change's details)
    if t is float:
        return obj if math.isfinite(obj) else None
    if t is dict:
        return {k: clean(v) for k, v in obj.items()}
    if t is str or t is int or t is bool or obj is None:
        return obj
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _fmt(v: float | None, scale: float = 1.0) -> str:
    return "unlimited" if v is None else f"{v * scale:g}"


@dataclass(frozen=True)
class VpaEvidence:
    """What one container's VPA decision rests on: written into its reason and details."""

    #: the recommender's explanation of the container (``VpaFleet.explain``: percentiles, sample
    #: counts, confidence, safety margin); copied, not changed
    stats: Mapping[str, Any]
    #: per resource (``cpu``, ``mem``), the recommender's ``lower`` / ``target`` / ``upper`` estimates
    estimates: Mapping[str, Mapping[str, float | None]]
    #: the policy's limits before rounding (``None``: no limit)
    limits: Mapping[str, float | None]
    #: which estimate the policy hands out (``target``, ``lower`` or ``upper``)
    bound: str
    #: the target's percentile and the margin added on top of it
    target_percentile: float
    safety_margin: float
    #: CPU samples the recommender learned
    samples: int
    #: the updater's rule: its hysteresis, update mode and the deciding worker
    hysteresis: float
    update_mode: str
    worker_id: str
    #: the signature's prior the limits came from (:meth:`~phasewise.models.priors.book.Prior.explain`;
    #: ``None``: the recommender's own)
    prior: Mapping[str, Any] | None = None


def vpa_decision(host: str, ts: float, sample: ContainerSample, previous: tuple[float | None, float | None],
                 new: tuple[float | None, float | None], evidence: VpaEvidence,
                 safety: dict[str, Any] | None = None) -> Decision:
    """The VPA's ``Decision`` for the container of *sample* (of *host*'s message at *ts*).

    *previous*: the CPU / memory limits the decision moves from (the last
    decided, else what the sample reports; ``None``: unlimited); *new*: the
    rounded limits it hands out (``None``: that resource is left as it is);
    *safety*: the safety rules' account of the container
    (:meth:`~phasewise.models.safety.guard.GuardOutcome.explain`), if they ran.
    """
    ref_cpu, ref_mem = previous
    cpu, mem = new
    why = []
    if cpu is not None:
        why.append(f"cpu {_fmt(ref_cpu)} -> {cpu:g} cores")
    if mem is not None:
        why.append(f"mem {_fmt(ref_mem, 2**-20)} -> {mem / 2**20:.0f} MiB")
    ev = evidence
    details = dict(ev.stats)
    details["cpu"] = {k: _finite(v) for k, v in ev.estimates["cpu"].items()}
    details["mem"] = {k: _finite(v) for k, v in ev.estimates["mem"].items()}
    details["limits"] = {"cpu": ev.limits["cpu"], "mem": ev.limits["mem"], "bound": ev.bound}
    details["previous"] = {"cpu": ref_cpu, "mem": ref_mem}
    details["observed"] = {"cpu": sample.cpu_limit_cores, "mem": sample.mem_limit_bytes}
    details["hysteresis"] = ev.hysteresis
    details["update_mode"] = ev.update_mode
    details["worker_id"] = ev.worker_id
    details["confidence"] = _finite(details["confidence"])
    if ev.prior is not None:
        details["prior"] = dict(ev.prior)
        reason = (f"prior of {ev.prior['runs']} earlier runs of {ev.prior['signature']} (highest peaks "
                  f"+{ev.prior['margin'] * 100:g}%, {ev.samples} samples of this run): " + "; ".join(why))
    else:
        reason = (f"vpa {ev.bound} (p{ev.target_percentile * 100:g} of {ev.samples} samples "
                  f"+{ev.safety_margin * 100:g}%): " + "; ".join(why))
    if safety is not None:
        details["safety"] = safety
        reason += bounded_text(safety)
    return Decision(
        id=decision_id(VPA_POLICY, host, sample.container, cpu, mem, ts),
        ts=ts, host=host, container=sample.container, action="limit", policy=VPA_POLICY, reason=reason,
        cpu_limit_cores=cpu, mem_limit_bytes=mem, details=details,
    )


def phase_decisions(out: FleetStep, hosts: Sequence[str], names: Sequence[str], ts: Sequence[float], *,
                    quantile: float, margin: float | Mapping[str, float], safety: Any = None,
                    priors: Mapping[int, Any] | None = None) -> list[Decision]:
    """``Decision`` (policy ``phase``) for each row of *out* with a limit to hand out (*hosts*, *names*,
    *ts*: per row); *safety*: the safety rules' outcome over the same rows (a
    :class:`~phasewise.models.safety.guard.GuardOutcome`, or anything whose ``explain_rows(rows)`` gives
    each row's ``details["safety"]``, None for a row the rules did not bound).

    ``details["source"]`` says where the limits came from: ``"phase"`` (the
    phase's statistics), ``"fallback:vpa"`` (the VPA's last decided limit) or
    ``"mixed"`` (one resource each way; ``details["sources"]`` per resource). *priors*: the rows
    limited from their signature's known-job prior (a :class:`~phasewise.models.priors.book.Prior`
    each): their source is ``"prior"`` and ``details["prior"]`` says which runs.
    """
    rows = out.rows_to_decide()
    if not len(rows):
        return []
    decisions = []
    res = out.resources
    ci, mi = res.index("cpu"), res.index("mem")
    decide, changed = out.decide[rows].tolist(), out.changed[rows].tolist()
    cpus, mems = (a.tolist() for a in round_limits(out.limits[rows, ci], out.limits[rows, mi]))
    margin = clean(margin)
    sxs = [None] * len(rows) if safety is None else safety.explain_rows(rows)
    for k, (i, ex) in enumerate(zip(rows.tolist(), out.explain_rows(rows, quantile))):
        cpu = cpus[k] if decide[k][ci] else None
        mem = mems[k] if decide[k][mi] else None
        srcs = {}
        why = []
        prior = priors.get(i) if priors else None
        if cpu is not None:
            srcs["cpu"] = src = ("prior" if prior is not None else
                                 "phase" if ex["sources"]["cpu"] == "phase" else "fallback:vpa")
            why.append(f"cpu -> {cpu:g} cores ({src})")
        if mem is not None:
            srcs["mem"] = src = ("prior" if prior is not None else
                                 "phase" if ex["sources"]["mem"] == "phase" else "fallback:vpa")
            why.append(f"mem -> {mem / 2**20:.0f} MiB ({src})")
        kinds = set(srcs.values())
        source = kinds.pop() if len(kinds) == 1 else "mixed"
        phase = ex["phase"]
        head = f"phase {phase}" if phase is not None else "phase unknown"
        # explain_rows gives finite numbers or None; quantile and margin are settings
        details = {**ex, "source": source, "sources": srcs, "quantile": quantile, "margin": margin,
                   "changed": changed[k]}
        reason = f"{head}: " + "; ".join(why)
        if prior is not None:
            details["prior"] = prior.explain()
            reason = f"prior of {prior.runs} earlier runs of {prior.signature}, {reason}"
        if (ahead := out.ahead.get(i)) is not None:
            reason += "; " + ahead[0].text()
        sx = sxs[k]
        if sx is not None:
            details["safety"] = sx
            reason += bounded_text(sx)
        name, host, t = names[i], hosts[i], ts[i]
        decisions.append(Decision(
            id=decision_id(PHASE_POLICY, host, name, cpu, mem, t), ts=t, host=host, container=name,
            action="limit", policy=PHASE_POLICY, reason=reason, cpu_limit_cores=cpu, mem_limit_bytes=mem,
            details=details,
        ))
    return decisions
