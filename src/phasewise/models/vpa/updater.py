"""The VPA updater: samples in, VPA limit decisions out (the worker's step, pure).

:func:`process_host_samples` (and :func:`process_many`, for a batch of
messages) is what the samples agent runs for every ``HostSamples`` message:
each container's row of the :class:`StateCache`'s fleet observes the sample,
limits are asked every ``recommend_interval_s`` of event time and become
decisions where they moved (the :class:`UpdaterConfig` rule, bounded by the
safety rules), and changed state is marked for the caller to persist. Replay
runs the same step in-process. docs/vpa.md, "The updater: the worker's
step".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from phasewise.kit.records import ContainerSample, Decision, HostSamples
from phasewise.models.arrays import all_true, count_true, nan_to_none
from phasewise.models.decisions import PHASE_POLICY, VPA_POLICY, VpaEvidence, round_limits, vpa_decision
from phasewise.models.priors.book import Prior
from phasewise.models.priors.runs import apply_priors, signatures, track_runs
from phasewise.models.safety.workload import step_columns
from phasewise.models.vpa.state import StateCache

__all__ = [
    "POLICY",
    "UPDATE_MODES",
    "RoundPhase",
    "RoundScorecard",
    "UpdaterConfig",
    "moved",
    "outside",
    "process_host_samples",
    "process_many",
    "sample_usage",
    "worker_round",
]

log = logging.getLogger(__name__)

POLICY = VPA_POLICY
#: ``hysteresis``: act on every move beyond the hysteresis; ``bounds``: only on a limit in force
#: outside the confidence bounds (the VPA updater's rule)
UPDATE_MODES = ("bounds", "hysteresis")
_NAN = math.nan

@dataclass(frozen=True)
class UpdaterConfig:
    """The VPA updater's rule (the worker builds it from its settings)."""

    #: event-time seconds between a container's recommendations (0: after every sample)
    recommend_interval_s: float
    #: a limit is re-decided when the policy's moved by more than this fraction of the last decided one
    hysteresis: float
    #: one of :data:`UPDATE_MODES`
    update_mode: str
    #: a container's state is marked for writing at least this often (event-time seconds)
    state_write_interval_s: float
    #: recorded in every decision's details
    worker_id: str
    #: a run of a signed workload younger than this (event-time seconds since its first sample) is decided
    #: from its signature's prior where the cache's :class:`PriorBook` has one (0: never; the worker sets
    #: the safety rules' ``min_history_s``: the prior stands in for the history the run lacks)
    prior_until_s: float
    #: a signed run's :class:`ExecutionProfile` is handed out this often (event-time seconds)
    profile_interval_s: float
    #: the policy of containers whose workload names none (the worker's ``--policy``). The VPA's
    #: decisions are handed out for containers decided with ``vpa`` (the safety rules bound them);
    #: for those decided with ``phase`` they only move the phase detector's fallback limits (the
    #: rules then bound the phase decisions instead)
    default_policy: str = VPA_POLICY

    def __post_init__(self) -> None:
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")
        if self.default_policy not in (VPA_POLICY, PHASE_POLICY):
            raise ValueError(f"default_policy must be {VPA_POLICY} or {PHASE_POLICY}, got {self.default_policy!r}")
        for name in ("recommend_interval_s", "hysteresis", "state_write_interval_s", "prior_until_s",
                     "profile_interval_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def sample_usage(c: ContainerSample, per_s: float) -> dict[str, float]:
    """What :meth:`VpaPolicy.observe` is shown for one container sample.

    The limits in force are included only when the sample reports one; for an
    unlimited resource the policy's own last limit stands in (as in replay).
    The worker passes the same numbers to the fleet as arrays (missing = ``NaN``).
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


def moved(new: np.ndarray, ref: np.ndarray, hysteresis: float) -> np.ndarray:
    """Element-wise: is *new* a limit to hand out, given *ref*, the limit it would replace?

    Yes when *new* is a limit (not ``NaN``) and there is no usable reference
    (``NaN``: unlimited or unknown; ``<= 0``) or *new* differs from it by more
    than *hysteresis* x *ref*.

    >>> moved(np.array([1.0, 1.2, 1.0, np.nan]), np.array([1.05, 1.0, np.nan, 1.0]), 0.1).tolist()
    [False, True, True, False]
    """
    return ~np.isnan(new) & (np.isnan(ref) | (ref <= 0) | (np.abs(new - ref) > hysteresis * ref))


def outside(ref: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """Element-wise: does the limit in force *ref* lie outside the bounds [*lower*, *upper*]?

    The VPA updater's test in ``bounds`` mode: an unlimited resource (``NaN``)
    always does; an infinite bound does not bound.

    >>> outside(np.array([0.5, 2.0, 5.0, np.nan]), np.array([1.0, 1.0, 1.0, 1.0]),
    ...         np.array([3.0, 3.0, np.inf, 3.0])).tolist()
    [True, False, False, True]
    """
    return np.isnan(ref) | (np.isfinite(lower) & (ref < lower)) | (np.isfinite(upper) & (ref > upper))


def process_host_samples(state_cache: StateCache, msg: HostSamples, config: UpdaterConfig,
                         shadow: list[Decision] | None = None) -> list[Decision]:
    """Learn every container sample of *msg*; return the limit decisions due now.

    *shadow*: where the decisions of containers decided with another policy go (the VPA's limits
    there are the phase detector's fallback, scored but never published); ``None``: they are
    returned with the others.
    """
    cs = msg.containers
    if not cs:
        return []
    host = msg.host
    keys = [f"{host}/{c.container}" for c in cs]
    rows = state_cache.rows(keys)
    if len(set(rows)) == len(rows):
        return _split(_wave(state_cache, [msg], None, cs, keys, rows, config), shadow)
    return process_many(state_cache, [msg], config, shadow)[0]


def _split(got: list[tuple[int, Decision, bool]], shadow: list[Decision] | None) -> list[Decision]:
    """The decisions of *got* to publish; the others appended to *shadow* (``None``: all are returned)."""
    if shadow is None:
        return [d for _, d, _ in got]
    shadow += [d for _, d, pub in got if not pub]
    return [d for _, d, pub in got if pub]


def process_many(state_cache: StateCache, msgs: Sequence[HostSamples], config: UpdaterConfig,
                 shadow: list[Decision] | None = None) -> list[list[Decision]]:
    """:func:`process_host_samples` of each message in turn, computed together.

    Returns each message's decisions (the same as one call per message, in
    the same order). A container's samples are learned in message order;
    different containers are independent, so the messages' containers go
    through the fleet in waves of distinct containers (one wave when no
    container repeats), which amortises the per-call cost of the vectorised
    steps over the whole batch. The dirty set (:meth:`StateCache.pop_dirty`)
    then holds every container any of the messages made dirty. *shadow*: see
    :func:`process_host_samples`.
    """
    cs: list[ContainerSample] = []
    keys: list[str] = []
    mi: list[int] = []
    for i, m in enumerate(msgs):
        host = m.host
        cs += m.containers
        keys += [f"{host}/{c.container}" for c in m.containers]
        mi += [i] * len(m.containers)
    out: list[list[Decision]] = [[] for _ in msgs]
    if not cs:
        return out
    rows = state_cache.rows(keys)
    if len(set(rows)) == len(rows):
        waves = [list(range(len(rows)))]
    else:  # a container's k-th sample of the batch goes in wave k
        seen: dict[int, int] = {}
        waves = []
        for e, r in enumerate(rows):
            k = seen.get(r, 0)
            seen[r] = k + 1
            if k == len(waves):
                waves.append([])
            waves[k].append(e)
    got: list[tuple[int, Decision, bool]] = []
    for wave in waves:
        if len(waves) == 1:
            w_mi, w_cs, w_keys, w_rows = mi, cs, keys, rows
        else:
            w_mi, w_cs = [mi[e] for e in wave], [cs[e] for e in wave]
            w_keys, w_rows = [keys[e] for e in wave], [rows[e] for e in wave]
        one = len(msgs) == 1
        got += [(wave[j], d, pub) for j, d, pub in _wave(state_cache, msgs, None if one else w_mi, w_cs, w_keys,
                                                         w_rows, config)]
    got.sort(key=lambda ed: ed[0])  # message order, container order within a message
    for e, d, pub in got:
        if pub or shadow is None:
            out[mi[e]].append(d)
        else:
            shadow.append(d)
    return out


class RoundPhase(Protocol):
    """The phase detector as a round sees it: decisions of messages with distinct hosts."""

    #: the last :meth:`process_many`'s decisions of containers decided with another policy (scored, never
    #: published)
    shadow: list[Decision]

    def process_many(self, msgs: Sequence[HostSamples]) -> list[Decision]:
        """The decisions to publish: those of the containers decided with the phase policy."""
        ...


class RoundScorecard(Protocol):
    """What a round shows the scorecard (:class:`~phasewise.models.scoring.scorecard.Scorecard`)."""

    def observe_round(self, msgs: Sequence[HostSamples]) -> None: ...

    def decide_many(self, decisions: Sequence[Decision]) -> None: ...


def worker_round(cache: StateCache, msgs: Sequence[HostSamples], config: UpdaterConfig,
                 phase: RoundPhase | None = None, scorecard: RoundScorecard | None = None) -> list[Decision]:
    """The worker's step over one round of messages (distinct hosts): the decisions to publish.

    Each container is decided with its workload's policy (``phasewise.io/policy``), else
    ``config.default_policy`` (the worker's ``--policy``). The VPA learns every sample first (its
    decided limits are the phase detector's fallback) and its decisions are published for the
    containers decided with ``vpa``; with *phase* (a worker running the phase machinery) the
    detector then steps every container of the round and its decisions are published for the
    containers decided with ``phase``. Without *phase*, every container must be decided with
    ``vpa`` (the samples agent refuses the others before this step). The samples agent runs this;
    so does replay's in-process run of the worker. A *scorecard* records the round's samples under
    the limits decided before them, then every decision of the round, the ones not published
    included (what the other policy would have done).
    """
    if scorecard is not None:
        scorecard.observe_round(msgs)
    shadow: list[Decision] | None = None if phase is None else []
    if len(msgs) == 1:
        vpa = process_host_samples(cache, msgs[0], config, shadow)
    else:
        vpa = [d for ds in process_many(cache, msgs, config, shadow) for d in ds]
    if phase is None:
        out = vpa
    else:
        out = vpa + phase.process_many(msgs) if vpa else phase.process_many(msgs)
    if scorecard is not None:
        scorecard.decide_many(out if phase is None else out + shadow + phase.shadow)
    return out


def _wave(cache: StateCache, msgs: Sequence[HostSamples], mi: list[int] | None, cs: Sequence[ContainerSample],
          keys: list[str], row_list: list[int], config: UpdaterConfig) -> list[tuple[int, Decision, bool]]:
    """One wave: distinct containers, each from ``msgs[mi[i]]`` (all from ``msgs[0]`` when *mi* is None).

    Returns ``(position in the wave, decision, published)`` triples: *published* where the container
    is decided with the VPA (its workload's policy, else the default), not where the VPA only moves
    the phase detector's fallback.
    """
    fleet = cache.fleet
    rows = np.array(row_list, dtype=np.intp)
    if mi is None:
        msg = msgs[0]
        ts: float | np.ndarray = msg.ts
        per_s: float | np.ndarray = 1.0 / msg.interval_s if msg.interval_s > 0 else 0.0
    else:
        ts = np.array([msgs[i].ts for i in mi], dtype=np.float64)
        per_s = np.array([1.0 / msgs[i].interval_s if msgs[i].interval_s > 0 else 0.0 for i in mi])
    x = np.array([(c.cpu_cores, c.mem_bytes, c.cpu_limit_cores, c.mem_limit_bytes, c.throttled_periods,
                   c.nr_periods, c.throttled_s, c.oom_events) for c in cs], dtype=np.float64)
    nr = x[:, 5]
    throttled_frac = np.divide(x[:, 4], nr, out=np.zeros(len(nr)), where=nr != 0)
    fleet.observe_many(ts, rows, x[:, 0], x[:, 1], cpu_limit=x[:, 2], mem_limit=x[:, 3], oom=x[:, 7],
                       throttled_frac=throttled_frac, throttled_cores=x[:, 6] * per_s, check_rows=False)
    # each container's policy (its workload's, else the default) and its workload's min/max
    cols = step_columns(cs, config.default_policy)
    uses = cols.uses(POLICY, config.default_policy)
    pub: np.ndarray | None = None  # rows whose VPA decisions are published (None: all, or none)
    if isinstance(uses, np.ndarray):
        if uses.all():
            uses = True
        elif not uses.any():
            uses = False
        else:
            pub = uses
    # the safety rules see every sample; they bound the VPA's decisions of the containers decided
    # with the VPA (for the others the phase detector bounds its own decisions with the same rules)
    guard = cache.guard
    if guard is not None:
        guard.observe(rows, ts, mem=x[:, 1], throttled_frac=throttled_frac, oom=x[:, 7], mem_limit=x[:, 3])
        if uses is False:
            guard = None
    # signed runs (phasewise.io/signature): their profiles, and the prior of a young one
    sig = signatures(cs) if cache.priors is not None else None
    if sig is not None:
        track_runs(cache, msgs, mi, cs, rows, ts, x, sig, config.profile_interval_s)

    interval = config.recommend_interval_s
    nx = cache._next_ts[rows]
    nx = np.where(np.isnan(nx), ts + interval, nx)  # first sample: the first recommendation one interval later
    due = ts >= nx
    if guard is not None:
        pending = guard.pending(rows)  # an OOM kill is answered at once
        due |= pending if pub is None else pending & pub
    cache._next_ts[rows] = np.where(due, ts + interval, nx)
    if not count_true(due):
        _mark_writes(cache, rows, ts, keys, None, config.state_write_interval_s)
        return []
    if all_true(due):
        at, dr, xd, tsd = np.arange(len(rows)), rows, x, ts
    else:
        at = np.flatnonzero(due)  # positions in the wave
        dr, xd = rows[at], x[at]
        tsd = ts if mi is None else ts[at]
    rec = fleet.predict_many(dr)
    lim_cpu, lim_mem = fleet.limits_many(dr, rec)  # the policy's limits from everything observed up to ts
    known: np.ndarray | None = None  # due rows decided from their signature's prior
    priors: list[Prior | None] = []
    if sig is not None and config.prior_until_s > 0 and uses is not False:
        lim_cpu, lim_mem = np.array(lim_cpu, dtype=np.float64), np.array(lim_mem, dtype=np.float64)
        known, priors = apply_priors(cache, sig, at, dr, tsd, keys, pub, lim_cpu, lim_mem, config.prior_until_s)
        if not count_true(known):
            known = None
    cpu_t, mem_t = round_limits(lim_cpu, lim_mem)
    dc, dm = cache._decided_cpu[dr], cache._decided_mem[dr]
    ref_cpu = np.where(np.isnan(dc), xd[:, 2], dc)
    ref_mem = np.where(np.isnan(dm), xd[:, 3], dm)
    h = config.hysteresis
    cpu_out = moved(cpu_t, ref_cpu, h)
    mem_out = moved(mem_t, ref_mem, h)
    act = cpu_out | mem_out
    if config.update_mode == "bounds" and count_true(act):
        # the VPA updater acts only on a limit outside the confidence bounds: with little
        # history the upper bound is far above the target, so nothing is cut early (a prior's
        # limits rest on earlier runs, not on these bounds: they are handed out as they moved)
        by_prior = None if known is None else (cpu_out & known, mem_out & known)
        idx = np.flatnonzero(act)
        fl, fu = rec.factors("lower", idx), rec.factors("upper", idx)
        for out_mask, res, ref in ((cpu_out, "cpu", ref_cpu), (mem_out, "mem", ref_mem)):
            out_mask[idx] &= outside(ref[idx], rec.estimate(res, "lower", idx, fl),
                                     rec.estimate(res, "upper", idx, fu))
        if by_prior is not None:
            cpu_out |= by_prior[0]
            mem_out |= by_prior[1]
        act = cpu_out | mem_out
    g = None
    gpos = None  # position of each due row in the guard's outcome (None: the same; -1: not guarded)
    if guard is not None:  # every due container: the rules may also raise memory unasked (OOM, peak)
        # in force: the limit this worker last decided, else the one the sample reports (as the VPA
        # rule compares with): an actuator that lags, clamps or refuses causes no repeated decisions
        in_force = np.stack([ref_cpu, ref_mem], 1)
        proposed = np.stack([np.where(cpu_out, cpu_t, _NAN), np.where(mem_out, mem_t, _NAN)], 1)
        lo = None if cols.lo is None else cols.lo[at]
        hi = None if cols.hi is None else cols.hi[at]
        if pub is None:
            g = guard.bound(dr, tsd, proposed, in_force, lo=lo, hi=hi, known=known)
            cpu_g, mem_g = round_limits(g.limits[:, 0], g.limits[:, 1])
            cpu_out = g.emit[:, 0] & ~(cpu_g == in_force[:, 0])
            mem_out = g.emit[:, 1] & ~(mem_g == in_force[:, 1])
            cpu_t, mem_t = np.where(cpu_out, cpu_g, cpu_t), np.where(mem_out, mem_g, mem_t)
            guard.commit(dr, tsd, g, np.stack([np.where(cpu_out, cpu_t, _NAN), np.where(mem_out, mem_t, _NAN)], 1))
        else:  # only the rows decided with the VPA; the others keep the bare VPA limits (the fallback)
            gi = np.flatnonzero(pub[at])
            tsg = tsd if np.ndim(tsd) == 0 else tsd[gi]
            g = guard.bound(dr[gi], tsg, proposed[gi], in_force[gi], lo=None if lo is None else lo[gi],
                            hi=None if hi is None else hi[gi], known=None if known is None else known[gi])
            cpu_g, mem_g = round_limits(g.limits[:, 0], g.limits[:, 1])
            c_o = g.emit[:, 0] & ~(cpu_g == in_force[gi, 0])
            m_o = g.emit[:, 1] & ~(mem_g == in_force[gi, 1])
            cpu_out, mem_out = cpu_out.copy(), mem_out.copy()
            cpu_t, mem_t = np.array(cpu_t, dtype=np.float64), np.array(mem_t, dtype=np.float64)
            cpu_out[gi], mem_out[gi] = c_o, m_o
            cpu_t[gi] = np.where(c_o, cpu_g, cpu_t[gi])
            mem_t[gi] = np.where(m_o, mem_g, mem_t[gi])
            guard.commit(dr[gi], tsg, g, np.stack([np.where(c_o, cpu_t[gi], _NAN), np.where(m_o, mem_t[gi], _NAN)], 1))
            gpos = np.full(len(dr), -1, dtype=np.intp)
            gpos[gi] = np.arange(len(gi))
        act = cpu_out | mem_out
    out: list[tuple[int, Decision, bool]] = []
    if count_true(act):
        idx = np.flatnonzero(act)
        fs = {b: rec.factors(b, idx) for b in ("target", "lower", "upper")}
        est = {res: {b: rec.estimate(res, b, idx, fs[b]) for b in fs} for res in ("cpu", "mem")}
        bound, pct, margin = fleet.bound, fleet.target_percentile, fleet.safety_margin
        for n, j in enumerate(idx.tolist()):
            i, row = int(at[j]), int(dr[j])
            c, msg = cs[i], msgs[0] if mi is None else msgs[mi[i]]
            cpu = float(cpu_t[j]) if cpu_out[j] else None
            mem = float(mem_t[j]) if mem_out[j] else None
            # moved from: the last decided limit, else what the sample reports
            dc, dm = nan_to_none(cache._decided_cpu[row]), nan_to_none(cache._decided_mem[row])
            previous = (dc if dc is not None else c.cpu_limit_cores, dm if dm is not None else c.mem_limit_bytes)
            if cpu is not None:
                cache._decided_cpu[row] = cpu
            if mem is not None:
                cache._decided_mem[row] = mem
            evidence = VpaEvidence(
                stats=fleet.explain(row, rec, j),
                estimates={res: {b: nan_to_none(v[n]) for b, v in est[res].items()} for res in ("cpu", "mem")},
                limits={"cpu": nan_to_none(lim_cpu[j]), "mem": nan_to_none(lim_mem[j])}, bound=bound,
                target_percentile=pct, safety_margin=margin, samples=fleet.samples(row),
                hysteresis=config.hysteresis, update_mode=config.update_mode, worker_id=config.worker_id,
                prior=None if known is None or priors[j] is None else priors[j].explain())
            if g is None:
                safety = None
            elif gpos is None:
                safety = g.explain(j)
            else:
                safety = g.explain(int(gpos[j])) if gpos[j] >= 0 else None
            out.append((i, vpa_decision(msg.host, msg.ts, c, previous, (cpu, mem), evidence, safety),
                        bool(uses) if pub is None else bool(pub[i])))
    acted = np.zeros(len(rows), dtype=bool)
    acted[at[act]] = True
    _mark_writes(cache, rows, ts, keys, acted, config.state_write_interval_s)
    return out


def _mark_writes(cache: StateCache, rows: np.ndarray, ts: float | np.ndarray, keys: list[str],
                 acted: np.ndarray | None, interval: float) -> None:
    """Mark for persisting the wave's containers that decided (*acted*) or whose last write is *interval* old.

    Every sample counts, not only recommendation steps: a container's stored
    state is never more than *interval* of event time behind it (0: written at
    every commit, so the changelog holds exactly the state at the commit).
    """
    wt = cache._written_ts[rows]
    wt = np.where(np.isnan(wt), ts, wt)  # new or reloaded: first write at a decision or one interval on
    write = ts - wt >= interval
    if acted is not None:
        write |= acted
    cache._written_ts[rows] = np.where(write, ts, wt)
    if count_true(write):
        cache.dirty.update(keys[i] for i in np.flatnonzero(write).tolist())
