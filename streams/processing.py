"""The worker's decision logic without Faust: samples in, VPA limit decisions out.

:func:`process_host_samples` is what the samples agent runs for every
``HostSamples`` message (and what benchmarks and tests call directly):

1. each container of the message (key ``host/container``) gets its
   :class:`~phasewise.models.vpa.VpaPolicy` from a :class:`StateCache`
   (memory first; on a miss, the loader, i.e. the worker's changelogged table,
   e.g. after a restart or a rebalance), which observes the sample
   (``policy.observe(ts, usage)``): CPU cores, memory working set, OOM kills,
   the share of CFS periods throttled, the throttled time per second of the
   message's interval and the limits in force when the sample reports them
   (the VPA weights CPU samples by the request; phasewise by the limit; for
   an unlimited resource the policy's own last limit stands in, as in replay);
2. every ``recommend_interval_s`` of event time per container (the first after
   one interval of history; ``0``: after every sample, the first included) it
   asks the policy for its limits (``policy.limits(ts)``) and emits a
   ``Decision`` (action ``limit``, policy ``vpa``) for each resource whose
   limit moved by more than ``hysteresis`` relative to the last decided limit,
   or, before any decision, the limit the sample reports (an unlimited resource
   always gets one). CPU limits are rounded up to a millicore (as VPA rounds
   CPU), memory limits up to a byte; ``details["limits"]`` keeps the policy's
   unrounded limits;
3. the same step marks the container's state dirty, so the caller persists it,
   when it emitted a decision or when ``state_write_interval_s`` of event time
   passed since the last write (a container's first write comes with its
   first decision or one write interval after it appears): table writes are
   expensive (each changelog record is its own produce request here).

This is the code path ``phasewise replay`` runs in-process: the same
``VpaPolicy`` class, asked ``limits`` and shown ``observe`` in the same way
(replay asks ``limits(t)`` before ``observe(t)``; a decision here at ``ts``
follows ``observe(ts)``, so it is the limit replay uses from the next step).

Decision ids are a hash of host, container, limits and event time: replaying
the same samples yields the same ids, and actuators apply each id once.

Nothing here does IO; time comes from the samples' event times.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from typing import Any

from phasewise.models.vpa import VpaPolicy, VpaRecommender, VpaStateError
from phasewise.schemas import MAX_BYTES, MAX_CORES, ContainerSample, Decision, HostSamples
from phasewise.settings import Settings

__all__ = [
    "POLICY",
    "ContainerEntry",
    "StateCache",
    "decision_id",
    "process_host_samples",
    "recommender_params",
    "sample_usage",
]

log = logging.getLogger(__name__)

POLICY = "vpa"
ENTRY_VERSION = 1


def recommender_params(settings: Settings) -> dict[str, Any]:
    """Constructor arguments of every container's recommender, from settings."""
    return {
        "time_scale": settings.vpa_time_scale,
        "min_cpu_cores": settings.vpa_min_cpu_cores,
        "min_mem_bytes": float(settings.vpa_min_mem_bytes),
        "throttle_threshold": settings.vpa_throttle_threshold,
        "throttle_bump": settings.vpa_throttle_bump,
    }


class ContainerEntry:
    """One container's :class:`VpaPolicy` plus the worker's bookkeeping about it."""

    __slots__ = ("decided_cpu", "decided_mem", "next_ts", "policy", "written_ts")

    def __init__(self, policy: VpaPolicy) -> None:
        self.policy = policy
        self.decided_cpu: float | None = None  # last CPU limit this worker decided
        self.decided_mem: float | None = None
        self.next_ts: float | None = None  # event time of the next recommendation
        self.written_ts: float | None = None  # event time of the last persisted state

    @property
    def model(self) -> VpaRecommender:
        """The policy's recommender."""
        return self.policy.model

    def to_state(self) -> dict[str, Any]:
        return {"v": ENTRY_VERSION, "vpa": self.policy.model.to_state(), "pl": self.policy._last,
                "dc": self.decided_cpu, "dm": self.decided_mem, "nx": self.next_ts}

    @classmethod
    def from_state(cls, state: Any, params: dict[str, Any]) -> ContainerEntry:
        if not isinstance(state, dict) or state.get("v") != ENTRY_VERSION:
            raise VpaStateError(f"unsupported container state {str(state)[:80]!r}")
        # "pl" (the policy's last limits) is absent from states written before the
        # worker ran VpaPolicy; the policy then starts with no last limits
        pstate = {"m": state["vpa"], "l": state.get("pl") or {}}
        e = cls(VpaPolicy.from_state(pstate, **params))
        e.decided_cpu, e.decided_mem, e.next_ts = state.get("dc"), state.get("dm"), state.get("nx")
        return e


class StateCache:
    """Per-container entries in memory, loaded through *loader* on a miss.

    *loader* maps a key to a stored state (or ``None``); the worker passes its
    table's ``get``. Keys whose state changed enough to be persisted collect
    in :attr:`dirty`; :meth:`pop_dirty` hands them out once.
    """

    def __init__(self, params: dict[str, Any] | None = None,
                 loader: Callable[[str], Any] | None = None) -> None:
        self.params = dict(params or {})
        self.loader = loader
        self._entries: dict[str, ContainerEntry] = {}
        self.dirty: set[str] = set()
        self.loaded = 0  # entries restored through the loader
        self.load_errors = 0

    @classmethod
    def from_settings(cls, settings: Settings, loader: Callable[[str], Any] | None = None) -> StateCache:
        return cls(recommender_params(settings), loader)

    def get(self, key: str) -> ContainerEntry:
        e = self._entries.get(key)
        if e is not None:
            return e
        if self.loader is not None:
            try:
                state = self.loader(key)
                if state is not None:
                    e = ContainerEntry.from_state(state, self.params)
                    self.loaded += 1
            except (ValueError, TypeError) as err:  # VpaStateError, undecodable or foreign values
                self.load_errors += 1
                log.warning("discarding stored state of %s: %s", key, err)
        if e is None:
            e = ContainerEntry(VpaPolicy(**self.params))
        self._entries[key] = e
        return e

    def pop_dirty(self) -> list[tuple[str, dict[str, Any]]]:
        out = [(k, self._entries[k].to_state()) for k in self.dirty if k in self._entries]
        self.dirty.clear()
        return out

    def clear(self) -> None:
        """Forget every entry (after a rebalance the table is the truth)."""
        self._entries.clear()
        self.dirty.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries


def decision_id(host: str, container: str, cpu: float | None, mem: float | None, ts: float) -> str:
    """Deterministic idempotency key of a limit decision."""
    raw = f"{POLICY}|{host}|{container}|{cpu!r}|{mem!r}|{ts!r}".encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def _moved(new: float | None, ref: float | None, hysteresis: float) -> bool:
    if new is None:
        return False
    if ref is None or ref <= 0:
        return True
    return abs(new - ref) > hysteresis * ref


def _outside(ref: float | None, bounds: dict[str, float]) -> bool:
    """Whether the limit in force lies outside [lower, upper] (unlimited: always)."""
    if ref is None:
        return True
    lo, up = bounds.get("lower"), bounds.get("upper")
    return (lo is not None and math.isfinite(lo) and ref < lo) or (
        up is not None and math.isfinite(up) and ref > up)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _decide(entry: ContainerEntry, host: str, c: ContainerSample, ts: float,
            settings: Settings) -> Decision | None:
    p = entry.policy
    lim = p.limits(ts)  # the policy's limits from everything observed up to ts
    cpu_t, mem_t = lim.get("cpu"), lim.get("mem")
    if cpu_t is not None:
        cpu_t = min(math.ceil(cpu_t * 1000.0 - 1e-9) / 1000.0, MAX_CORES)
    if mem_t is not None:
        mem_t = float(min(math.ceil(mem_t), MAX_BYTES))
    ref_cpu = entry.decided_cpu if entry.decided_cpu is not None else c.cpu_limit_cores
    ref_mem = entry.decided_mem if entry.decided_mem is not None else c.mem_limit_bytes
    h = settings.hysteresis
    cpu_out = cpu_t if _moved(cpu_t, ref_cpu, h) else None
    mem_out = mem_t if _moved(mem_t, ref_mem, h) else None
    rec = None
    if settings.vpa_update_mode == "bounds" and (cpu_out is not None or mem_out is not None):
        # the VPA updater acts only on a limit outside the confidence bounds: with little
        # history the upper bound is far above the target, so nothing is cut early
        rec = p.model.predict_one()
        if cpu_out is not None and not _outside(ref_cpu, rec["cpu"]):
            cpu_out = None
        if mem_out is not None and not _outside(ref_mem, rec["mem"]):
            mem_out = None
    if cpu_out is None and mem_out is None:
        return None
    why = []
    if cpu_out is not None:
        why.append(f"cpu {_fmt(ref_cpu)} -> {cpu_out:g} cores")
        entry.decided_cpu = cpu_out
    if mem_out is not None:
        why.append(f"mem {_fmt(ref_mem, 2**-20)} -> {mem_out / 2**20:.0f} MiB")
        entry.decided_mem = mem_out
    m = p.model
    rec = rec or m.predict_one()
    details = m.explain()
    details["cpu"] = {k: _finite(v) for k, v in rec["cpu"].items()}
    details["mem"] = {k: _finite(v) for k, v in rec["mem"].items()}
    details["limits"] = {"cpu": lim.get("cpu"), "mem": lim.get("mem"), "bound": p.bound}
    details["previous"] = {"cpu": ref_cpu, "mem": ref_mem}
    details["observed"] = {"cpu": c.cpu_limit_cores, "mem": c.mem_limit_bytes}
    details["hysteresis"] = h
    details["update_mode"] = settings.vpa_update_mode
    details["worker_id"] = settings.worker_id
    details["confidence"] = _finite(details["confidence"])
    reason = (f"vpa {p.bound} (p{m.target_percentile * 100:g} of {m.samples} samples "
              f"+{m.safety_margin * 100:g}%): " + "; ".join(why))
    return Decision(
        id=decision_id(host, c.container, cpu_out, mem_out, ts),
        ts=ts, host=host, container=c.container, action="limit", policy=POLICY, reason=reason,
        cpu_limit_cores=cpu_out, mem_limit_bytes=mem_out, details=details,
    )


def sample_usage(c: ContainerSample, per_s: float) -> dict[str, float]:
    """What :meth:`VpaPolicy.observe` is shown for one container sample.

    The limits in force are included only when the sample reports one; for an
    unlimited resource the policy's own last limit stands in (as in replay).
    """
    nr = c.nr_periods
    usage = {
        "cpu": c.cpu_cores, "mem": c.mem_bytes, "oom": c.oom_events,
        "throttled_frac": c.throttled_periods / nr if nr else 0.0,
        "throttled_cores": c.throttled_s * per_s,
    }
    if c.cpu_limit_cores is not None:
        usage["cpu_limit"] = c.cpu_limit_cores
    if c.mem_limit_bytes is not None:
        usage["mem_limit"] = c.mem_limit_bytes
    return usage


def _fmt(v: float | None, scale: float = 1.0) -> str:
    return "unlimited" if v is None else f"{v * scale:g}"


def process_host_samples(state_cache: StateCache, msg: HostSamples, settings: Settings) -> list[Decision]:
    """Learn every container sample of *msg*; return the limit decisions due now."""
    out: list[Decision] = []
    ts = msg.ts
    host = msg.host
    interval = settings.recommend_interval_s
    write_interval = settings.state_write_interval_s
    dirty = state_cache.dirty
    per_s = 1.0 / msg.interval_s if msg.interval_s > 0 else 0.0
    for c in msg.containers:
        key = f"{host}/{c.container}"
        entry = state_cache.get(key)
        entry.policy.observe(ts, sample_usage(c, per_s))
        nx = entry.next_ts
        if nx is None:  # first sample: the first recommendation one interval later
            nx = ts + interval
        if ts < nx:
            entry.next_ts = nx
            continue
        entry.next_ts = ts + interval
        d = _decide(entry, host, c, ts, settings)
        if d is not None:
            out.append(d)
        if entry.written_ts is None:  # new or reloaded: first write at a decision or one interval on
            entry.written_ts = ts
        if d is not None or ts - entry.written_ts >= write_interval:
            dirty.add(key)
            entry.written_ts = ts
    return out
