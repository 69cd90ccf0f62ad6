"""The phase detectors of one worker: samples in, phase changes, phase decisions and learn windows out.

:class:`PhaseHooks` runs one frozen :class:`~phasewise.models.phases.fleet.PhaseFleet`
step per round of messages after the VPA updater (whose limits are the
fallback), bounds the phase decisions by the safety rules, holds learn
windows for the learner and swaps to newer snapshots between messages. Pure
apart from reading the latest snapshot through a callable. docs/phases.md,
"In the worker".
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phasewise.kit.records import Decision, HostSamples, ModelSnapshot, PhaseChange
from phasewise.kit.records.learn_batches import encode_learn_batch
from phasewise.models.decisions import PHASE_POLICY, clean, phase_decisions, round_limits
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.features import LIMITED
from phasewise.models.phases.fleet import FleetStep, PhaseFleet
from phasewise.models.phases.snapshots import model_name
from phasewise.models.phases.transitions import TransitionBook, TransitionConfig
from phasewise.models.priors.book import Prior
from phasewise.models.priors.runs import apply_priors, signatures
from phasewise.models.safety.guard import GuardOutcome
from phasewise.models.safety.workload import StepColumns, step_columns
from phasewise.models.vpa.state import StateCache

__all__ = ["POLICY", "DetectorConfig", "PhaseHooks", "PhaseOutput"]

log = logging.getLogger(__name__)

POLICY = PHASE_POLICY
#: HostSamples' per-container field of each feature (None in a sample = missing)
_FIELD = {"cpu": "cpu_cores", "mem": "mem_bytes", "gpu": "gpu_util", "gpu_mem": "gpu_mem_bytes"}


@dataclass(frozen=True)
class DetectorConfig:
    """The live detectors' parameters; the worker builds them from its settings (which hold their defaults)."""

    #: the lowest CPU (cores) and memory (bytes) limits handed out (the VPA's minimums)
    min_cpu_cores: float
    min_mem_bytes: float
    #: every this-many-th ready window goes to the learner
    learn_every: int
    #: windows held before they are handed out as one learn batch (at least 1)
    learn_batch: int
    #: which phase statistics set the limits: ``relative`` or ``absolute`` (:class:`PhaseFleet`)
    statistics: str
    #: a container's state is marked for writing at least this often (event-time seconds)
    state_write_interval_s: float
    #: the largest phase ratio quantile used with relative statistics (``None``: no cap)
    ratio_cap: float | None
    #: the policy of containers whose workload names none (the worker's ``--policy``): the phase
    #: decisions are published for the containers decided with ``phase``, the others' are scored only
    default_policy: str
    #: anticipated transitions of signed containers (``None`` or a zero horizon: off)
    anticipate: TransitionConfig | None
    #: a young signed run (younger than this, seconds) whose signature has a prior in the VPA cache's
    #: book is limited from the prior, as the VPA's containers are (0: no priors; docs/priors.md)
    prior_until_s: float
    #: per limited resource, phase limit = phase quantile x (1 + margin) (absent: the fleet's default, 0.1)
    margins: Mapping[str, float]


@dataclass
class PhaseOutput:
    """What one detector step produced: decisions to publish, phase changes, a full learn batch, and the
    decisions of containers decided with another policy (``shadow``: scored, never published)."""

    decisions: list[Decision]
    changes: list[PhaseChange]
    learn_batch: bytes | None
    shadow: list[Decision] = field(default_factory=list)


#: the fields of a phase change the round sets itself (the rest come from the detector, made JSON-safe)
_OWN = frozenset({"stats", "host", "container"})


class _Rows:
    """The safety rules' outcome over some rows of a step, read by the step's row index (None: not bounded)."""

    def __init__(self, outcome: GuardOutcome, rows: np.ndarray, n: int) -> None:
        self.outcome = outcome
        self.pos = np.full(n, -1, dtype=np.intp)
        self.pos[rows] = np.arange(len(rows))

    def explain(self, i: int) -> dict[str, Any] | None:
        return self.explain_rows([i])[0]

    def explain_rows(self, rows: Any) -> list[dict[str, Any] | None]:
        """:meth:`explain` of each of *rows* (step rows)."""
        pos = self.pos[np.asarray(rows, dtype=np.intp)]
        got = iter(self.outcome.explain_rows(pos[pos >= 0]))
        return [None if j < 0 else next(got) for j in pos.tolist()]


class PhaseHooks:
    """The detector side of one worker: fleet step per message, snapshot swaps, what to send.

    Pure apart from reading the follower's latest snapshot; the agent sends
    what :meth:`process` returns and persists what :meth:`pop_dirty` hands out.
    """

    def __init__(self, config: DetectorConfig, vpa_cache: StateCache, *, model: PhaseModel, version: int = 0,
                 loader: Callable[[str], Any] | None = None,
                 latest: Callable[[], tuple[ModelSnapshot, PhaseModel] | None] | None = None) -> None:
        self.config = config
        self.vpa_cache = vpa_cache
        self.latest = latest
        self.version = version
        self.name = model_name(model.features)
        self.loader = loader
        feats = model.features
        if any(r not in feats for r in LIMITED):
            raise ValueError(f"the phase model's features {feats} must include {LIMITED}")
        #: the signed containers' phase exits, per signature (kept across snapshot swaps)
        self.transitions = (TransitionBook(config.anticipate) if config.anticipate is not None
                            and config.anticipate.on else None)
        #: young signed runs start from their signature's prior (the VPA cache's book, shared with the VPA)
        self._priors_on = config.prior_until_s > 0 and vpa_cache.priors is not None and vpa_cache.guard is not None
        self.fleet = self._fleet(model)
        #: what each limited resource's phase limits apply (every fleet of these hooks is built from one config)
        self._margins = {r: self.fleet.resource_margins.get(r, self.fleet.margin) for r in LIMITED}
        self._fields = [_FIELD[f] for f in feats]
        self._getter = operator.attrgetter(*self._fields)  # a frame's fields of a sample (None -> NaN in the array)
        self._cpu_mem_only = feats == LIMITED
        self._limited_cols = None if self._cpu_mem_only else [feats.index(r) for r in LIMITED]
        self._carried: list[tuple[str, dict[str, Any]]] = []  # marked states of a replaced fleet
        self.learn_batch = max(1, int(config.learn_batch))
        #: build the decisions of containers decided with another policy (``PhaseOutput.shadow``): the
        #: live scorecard scores them; without one the agent turns this off and they cost nothing
        self.keep_shadow = True
        self._learn_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._learn_n = 0  # windows held in _learn_parts
        #: swap to a newer snapshot at every step (in process: replay, experiments); a worker swaps only at
        #: its commits instead (:mod:`phasewise.models.phases.pinning`) and turns this off
        self.swap_on_step = True

    def _fleet(self, model: PhaseModel) -> PhaseFleet:
        c = self.config
        return PhaseFleet(model, floors={"cpu": c.min_cpu_cores, "mem": float(c.min_mem_bytes)},
                          learn_every=c.learn_every, frozen=True, statistics=c.statistics,
                          state_write_interval_s=c.state_write_interval_s, loader=self.loader, limited=LIMITED,
                          ratio_cap=c.ratio_cap, transitions=self.transitions, resource_margins=dict(c.margins))

    def newer(self) -> tuple[ModelSnapshot, PhaseModel] | None:
        """The follower's newest snapshot if it is newer than the one in use (None: none)."""
        got = self.latest() if self.latest is not None else None
        return None if got is None or got[0].version <= self.version else got

    def follow(self) -> bool:
        """Swap to the follower's newest snapshot if it is newer; True if swapped."""
        got = self.newer()
        if got is None:
            return False
        self.use(*got)
        return True

    def use(self, snap: ModelSnapshot, model: PhaseModel) -> None:
        """Decide with *model* (snapshot *snap*) from the next step on; the containers keep their state."""
        try:
            self.fleet.set_model(model)
        except ValueError as e:  # another window length: containers restart their windows
            log.warning("snapshot v%d does not fit the detector state (%s); windows restart", snap.version, e)
            self._carried += self.fleet.pop_dirty()  # still persisted at the next commit
            self.fleet = self._fleet(model)
            self._learn_parts, self._learn_n = [], 0  # windows of the old length: the learner would refuse them
        self.version = snap.version
        log.info("detector now on model snapshot v%d", snap.version)

    def clear(self) -> None:
        self.fleet.clear()
        self._carried = []

    def pop_dirty(self) -> list[tuple[str, dict[str, Any]]]:
        """States marked for persisting since the last call (each container once, latest state), each with
        ``"so"``, the source offset of the newest sample it holds (the VPA state's, written with it:
        :meth:`pop_with`) where the VPA noted one."""
        out = self.fleet.pop_dirty()
        offset = self.vpa_cache.source_offset
        for k, st in out:
            if (so := offset(k)) is not None:
                st["so"] = so
        if self._carried:
            seen = {k for k, _ in out}
            out += [(k, st) for k, st in self._carried if k not in seen]
            self._carried = []
        return out

    def pop_with(self, now: float | None = None, max_unwritten_s: float | None = None
                 ) -> list[tuple[str, dict[str, Any]]]:
        """The VPA states the VPA cache hands out (:meth:`StateCache.pop_dirty`), a container's written whenever
        its phase state is, and the phase states marked to go with them (run before :meth:`pop_dirty`).

        A container's two states are written together, so both hold the same samples: the VPA state's
        source offset is the phase state's too, and a restarted worker that skips the samples a stored
        state holds (:meth:`StateCache.unlearned`) skips them for both. Written apart, the phase would
        read a VPA fallback and rule state newer or older than the samples it steps again.
        """
        fleet, cache = self.fleet, self.vpa_cache
        cache.dirty.update(k for k in fleet.marked() if k in cache)
        out = cache.pop_dirty(now, max_unwritten_s)
        fleet.mark(k for k, _ in out)
        return out

    def process(self, hs: HostSamples, vpa_decisions: list[Decision] | None = None) -> PhaseOutput:
        """Run the detector over *hs* (after the VPA learned it: its decided limits are the fallback).

        *vpa_decisions* only moved the fallback limits; they are not emitted (unused here).
        """
        return self.process_many([hs])

    def process_many(self, msgs: Sequence[HostSamples]) -> PhaseOutput:
        """:meth:`process` of several messages as ONE fleet step; their containers must be distinct.

        The same decisions (in message order), phase changes and learn windows
        as one call per message in turn: each container's row depends only on
        its own state and the frozen snapshot. One step over a batch costs
        about half as much per sample as one per 100-container message (the
        numpy / torch calls' fixed costs are shared).
        """
        if self.swap_on_step:
            self.follow()
        msgs = [m for m in msgs if m.containers]
        if not msgs:
            return PhaseOutput([], [], None)
        hosts: list[str] = []
        names: list[str] = []
        keys: list[str] = []
        ts: list[float] = []
        for m in msgs:
            host, n = m.host, len(m.containers)
            got = [c.container for c in m.containers]
            names += got
            keys += [f"{host}/{c}" for c in got]
            hosts += [host] * n
            ts += [m.ts] * n
        one_msg = len(msgs) == 1
        if len(msgs) > 1 and len(set(keys)) != len(keys):
            raise ValueError("process_many: a container appears in two of the messages; step them in turn")
        observed = None  # the limits the samples report (None -> NaN: unlimited), for the safety rules
        guarded = self.vpa_cache.guard is not None
        if self._cpu_mem_only and guarded:  # one pass over the samples for both
            A = np.array([(c.cpu_cores, c.mem_bytes, c.cpu_limit_cores, c.mem_limit_bytes)
                          for m in msgs for c in m.containers], dtype=np.float64)
            X, observed = A[:, :2], A[:, 2:]
        elif self._cpu_mem_only:
            X = np.array([(c.cpu_cores, c.mem_bytes) for m in msgs for c in m.containers], dtype=np.float64)
        else:  # a missing GPU reading (None) is NaN: the normaliser treats it as missing
            X = np.array(list(map(self._getter, (c for m in msgs for c in m.containers))), dtype=np.float64)
        decided = self.vpa_cache.decided_limits
        cols = self._limited_cols

        def fallback(idx: np.ndarray) -> np.ndarray:
            got = decided([keys[i] for i in idx])  # the VPA's decided (cpu, mem) limits (NaN: none yet)
            if cols is None:
                return got
            out = np.full((len(idx), len(self._fields)), np.nan)
            out[:, cols] = got  # features that are not limited have no fallback
            return out

        cs = [c for m in msgs for c in m.containers] if not one_msg else msgs[0].containers
        wcols = step_columns(cs, self.config.default_policy)
        sig = signatures(cs) if self.transitions is not None or self._priors_on else None
        out = self.fleet.step(msgs[0].ts if one_msg else np.array(ts), keys, X, fallback_limits=fallback,
                              host=msgs[0].host, signatures=sig)
        safety = None
        priors: dict[int, Prior] = {}
        if guarded:
            if observed is None:
                observed = np.array([(c.cpu_limit_cores, c.mem_limit_bytes) for m in msgs for c in m.containers],
                                    dtype=np.float64)
            safety, priors = self._guard(out, observed, keys, ts, wcols, sig)
        phase_rows = wcols.uses(POLICY, self.config.default_policy)
        if not self.keep_shadow and phase_rows is not True:  # nobody scores the others' decisions: none built
            if phase_rows is False:
                out.decide[:] = False
            else:
                out.decide[~phase_rows] = False
        decisions = phase_decisions(out, hosts, names, ts, quantile=self.fleet.quantile, margin=self._margins,
                                    safety=safety, priors=priors)
        shadow: list[Decision] = []
        if phase_rows is False:
            decisions, shadow = [], decisions
        elif phase_rows is not True and decisions:
            mine = {k for k, p in zip(keys, phase_rows.tolist()) if p}
            shadow = [d for d in decisions if f"{d.host}/{d.container}" not in mine]
            decisions = [d for d in decisions if f"{d.host}/{d.container}" in mine]
        changes = []
        if out.changes:
            row = {k: i for i, k in enumerate(keys)}
            stats: dict[int, Any] = {}  # a phase's statistics, made JSON-safe once per round (shared, never changed)
            for c in out.changes:
                i = row[c["container"]]
                st = stats.get(id(c["stats"]))
                if st is None:
                    st = stats[id(c["stats"])] = clean(c["stats"])
                changes.append(PhaseChange(**{k: clean(v) for k, v in c.items() if k not in _OWN},
                                           host=hosts[i], container=names[i], stats=st))
        batch = None
        if len(out.sample):
            sel = out.sample
            self._learn_parts.append((out.windows[sel], out.prev_phase[sel], out.frames[sel],
                                      None if out.levels is None else out.levels[sel]))
            self._learn_n += len(sel)
            if self._learn_n >= self.learn_batch:
                batch = self.take_learn_batch()
        return PhaseOutput(decisions, changes, batch, shadow)

    def _guard(self, out: FleetStep, observed: np.ndarray, keys: list[str], ts: list[float],
               columns: StepColumns, sig: list[str | None] | None
               ) -> tuple[GuardOutcome | _Rows | None, dict[int, Prior]]:
        """The safety rules over the step's proposed limits (the VPA learned the samples, so the
        rules saw them), with *observed* ``(n, 2)`` the limits the samples report and the
        workloads' own min/max (*columns*): *out*'s ``decide`` / ``limits`` become what may be
        handed out, the fleet records it, and the VPA entries of containers with a decision are
        marked for persisting. Only the containers decided with the phase policy are bounded (the
        rules' state follows the decisions published); the others keep the bare policy's limits.
        A young signed run whose signature has a prior (*sig*: each row's signature) is proposed
        the prior's limits, never under its own peaks x (1 + margin), and the history rule counts
        the earlier runs (:func:`~phasewise.models.priors.runs.apply_priors`, as for the VPA's rows).
        Returns what :func:`phase_decisions` reads each row's ``details.safety`` from (None: no row
        is bounded), and the prior of each step row limited from one."""
        cache = self.vpa_cache
        guard = cache.guard
        cols = [out.resources.index(r) for r in LIMITED]
        uses = columns.uses(POLICY, self.config.default_policy)
        if uses is False or (uses is not True and not uses.any()):
            return None, {}
        sub = None if uses is True or uses.all() else np.flatnonzero(uses)
        if sub is None:
            cells: Any = (slice(None), cols)
            sk, sts, sobs, lo, hi = keys, ts, observed, columns.lo, columns.hi
        else:
            cells = np.ix_(sub, cols)
            sk, sts, sobs = [keys[i] for i in sub.tolist()], [ts[i] for i in sub.tolist()], observed[sub]
            lo = None if columns.lo is None else columns.lo[sub]
            hi = None if columns.hi is None else columns.hi[sub]
        rows = np.array(cache.rows(sk), dtype=np.intp)
        proposed = np.where(out.decide[cells], out.limits[cells], np.nan)
        # in force: the limit the rules last let out, else the one the sample reports (an actuator that
        # lags, clamps or refuses causes no repeated decisions)
        last = guard.last_limits(rows)
        in_force = np.where(np.isnan(last), sobs, last)
        t = np.array(sts, dtype=np.float64)
        known = None
        prior_rows: dict[int, Prior] = {}
        if sig is not None and self._priors_on:
            ssig = sig if sub is None else [sig[i] for i in sub.tolist()]
            lim_cpu, lim_mem = proposed[:, 0].copy(), proposed[:, 1].copy()
            known, got = apply_priors(cache, ssig, np.arange(len(sk)), rows, t, sk, None, lim_cpu, lim_mem,
                                      self.config.prior_until_s)
            if known.any():
                proposed = np.where(known[:, None], np.stack([lim_cpu, lim_mem], 1), proposed)
                at = np.arange(len(keys)) if sub is None else sub
                prior_rows = {int(at[j]): p for j, p in enumerate(got) if p is not None}
            else:
                known = None
        g = guard.bound(rows, t, proposed, in_force, lo=lo, hi=hi, known=known)
        cpu, mem = round_limits(g.limits[:, 0], g.limits[:, 1])
        given = np.stack([cpu, mem], 1)
        emit = g.emit & ~(given == in_force)
        given = np.where(emit, given, np.nan)
        guard.commit(rows, t, g, given)
        # what the fleet compares its next limits with: the limit handed out, or nothing where a
        # proposal was held back (it is proposed again at the next step)
        R = len(out.resources)
        touched = np.zeros((len(keys), R), dtype=bool)
        touched[cells] = out.decide[cells] | emit
        handed = np.full((len(keys), R), np.nan)
        handed[cells] = given
        self.fleet.hand_out(out, handed, touched)
        out.decide[cells] = emit
        out.limits[cells] = np.where(emit, given, out.limits[cells])
        if emit.any():
            cache.dirty.update(sk[i] for i in np.flatnonzero(emit.any(axis=1)).tolist())
        if sub is None:
            return g, prior_rows
        return _Rows(g, sub, len(keys)), prior_rows

    def take_learn_batch(self) -> bytes | None:
        """The learn windows held so far as one learn batch (None if none); the hold is emptied.

        Windows are held until ``phase_learn_batch`` of them are ready: a learn
        step costs ~0.7 ms however few windows it gets, so per-message batches
        of a few windows made the learner the worker's largest cost. The agent
        also takes a partial batch before every offset commit.
        """
        parts = self._learn_parts
        if not parts:
            return None
        self._learn_parts, self._learn_n = [], 0
        lv = None if any(p[3] is None for p in parts) else np.concatenate([p[3] for p in parts])
        return encode_learn_batch(self.name, np.concatenate([p[0] for p in parts]),
                                  np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]), lv)
