"""``phasewise replay``: replay a real usage trace through limit policies and score them.

Each container of the trace is replayed on its own, with a fresh instance of
every policy. At each sample time ``t`` a policy is first asked for its limits
(:meth:`LimitPolicy.limits`) and only then shown the usage measured at ``t``
(:meth:`LimitPolicy.observe`), so no policy sees the step it limits. The one
exception is the **oracle** (``L_t = U_t``), a reference computed by this
harness from the measured usage and labelled as such everywhere it appears.

Per resource, scores are summed over containers (see
:mod:`phasewise.models.scoring`): ``alloc_over_used`` (allocation per unit of
usage, time-weighted) and ``fulfilment`` (share of steps with usage within the
limit). All policies are scored on the same steps: a (container, resource)
is scored from the first step at which every policy managing that resource
has a limit. A policy manages a resource when it sets a limit for it (not
``None``) in some container of the run; one that never does (VPA has no GPU
model) is not scored on that resource and its row says so.

Policy families (``--policies``):

- ``vpa``: :class:`phasewise.models.vpa.VpaPolicy` (VPA-style recommender);
- ``window``: :func:`phasewise.models.baselines.window_family` (max x 1.0 and
  p95 x 1.15 over several windows); reported as its best member: the lowest
  ``alloc_over_used`` among the members reaching the reference fulfilment
  (the phase policy's; without a phase score, vpa's; without either, 95 %),
  or the highest fulfilment when none reaches it;
- ``phase``: :class:`phasewise.models.phase_policy.PhasePolicy` (phase limits);
- ``oracle``: harness special case, ``L_t = U_t``.

The phase policy is compared per resource with the **reactive frontier**
``R(f)`` (:mod:`phasewise.models.frontier`): the least ``alloc_over_used``
that any reactive member (vpa, each window member) or a linear mix of two
reaches at fulfilment ``f`` >= the phase policy's (at the highest reactive
fulfilment, said so, when the phase policy's is above every member's). The
savings row leads with ``slack_cut_vs_frontier = 1 - (phase - 1) / (R - 1)``
(the share of the slack, allocation - use, removed) and
``alloc_cut_vs_frontier = 1 - phase / R``; next to them, against the
cheapest single baseline reaching at least the phase policy's fulfilment
(or, flagged ``matched_fulfilment: false``, the closest below):
``savings_vs_best_reactive = 1 - phase_alloc_over_used / best_alloc_over_used``.

``--json`` prints one JSON object per line, each with ``"type"``: one
``setup`` line, a ``score`` line per policy family and resource, a
``savings`` line per resource (schema: ``infra/schemas/ReplayOutput.v1.json``,
:mod:`phasewise.replay_schema`).

:func:`decision_sequence` exposes a policy's per-container decisions
(``[(t, limits), ...]``) so the in-process path can be compared with the Kafka
path. With ``--through-kafka`` the policies the stream worker runs (``vpa``)
go through the real pipeline instead (:mod:`phasewise.replay_kafka`: a broker,
a ``phasewise worker`` subprocess, the trace as ``HostSamples`` messages, the
decision sequences rebuilt from the ``Decision`` records) and are scored
exactly like in-process ones; the other families still run in-process.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from phasewise.models.policy import LimitPolicy, Limits
from phasewise.models.scoring import Score, common_start, hold_last, score_steps
from phasewise.producers.traces import FORMATS, ContainerSeries, Trace, TraceFormatError, load_trace
from phasewise.settings import (
    PHASE_STATISTICS,
    SPECS,
    above,
    arg_type,
    at_least,
    in_range,
    parse_float,
    parse_int,
    parse_str,
)

__all__ = [
    "FAMILIES",
    "ORACLE",
    "ContainerReplay",
    "PolicySpec",
    "PolicyUnavailable",
    "ReplayResult",
    "ResourceResult",
    "ScaledPolicy",
    "ThroughKafkaUnsupported",
    "add_arguments",
    "decision_sequence",
    "oracle_decisions",
    "policy_specs",
    "replay_trace",
    "result_rows",
    "run",
    "sample_path",
]

ORACLE = "oracle"
FAMILIES = ("vpa", "window", "phase", ORACLE)
REACTIVE = ("vpa", "window")
ORACLE_NOTE = "harness special case: L_t = U_t, the only policy that sees the usage of the step it limits"
#: reference fulfilment for picking the best window member when neither phase nor vpa ran
DEFAULT_TARGET_FULFILMENT = 0.95


class PolicyUnavailable(RuntimeError):
    """A requested policy family cannot be built (its module is not installed or not written)."""


@dataclass(frozen=True)
class PolicySpec:
    """One policy of a run: a family member with a factory of fresh instances.

    ``factory`` is ``None`` only for the oracle, which the harness computes.
    """

    name: str
    family: str
    factory: Callable[[], LimitPolicy] | None


def sample_path() -> Path:
    """The AI4DL sample shipped with phasewise (Apache-2.0; see data/PROVENANCE.md)."""
    return Path(__file__).resolve().parent / "data" / "ai4dl_sample.csv"


# ---------------------------------------------------------------- policies


def _lazy_factory(module: str, cls: str, family: str) -> Callable[[], LimitPolicy]:
    try:
        mod = importlib.import_module(module)
        klass = getattr(mod, cls)
    except (ImportError, AttributeError) as e:
        raise PolicyUnavailable(f"policy {family!r} is not available: {module}.{cls} cannot be imported ({e})") from e
    return klass


#: nominal capacity (bytes) that turns a memory *fraction* into bytes for VPA (see :class:`ScaledPolicy`)
NOMINAL_MEM_BYTES = float(2**40)


class ScaledPolicy:
    """Harness adapter: show a policy usage multiplied by ``scales[r]`` and divide
    its limits back, so a policy that works in fixed units sees them.

    Used for VPA on traces whose ``mem`` is a utilisation fraction: VPA's memory
    histogram is in bytes (first bucket 1e7 bytes, 5 % wider buckets, floor
    250 MiB), so the fraction is shown as bytes of a nominal 1 TiB pod. Buckets
    grow geometrically, so alloc/used does not depend on the nominal size as
    long as usage stays far above the first bucket and the floor (250 MiB is
    0.02 % of 1 TiB).

    >>> from phasewise.models.baselines import WindowPolicy
    >>> p = ScaledPolicy(WindowPolicy(window=2), {"mem": 1000.0})
    >>> p.observe(0.0, {"mem": 0.5, "cpu": 2.0})
    >>> p.limits(1.0), p.inner.limits(1.0)
    ({'mem': 0.5, 'cpu': 2.0}, {'mem': 500.0, 'cpu': 2.0})
    """

    def __init__(self, inner: LimitPolicy, scales: dict[str, float]) -> None:
        self.inner = inner
        self.scales = dict(scales)
        self.name = inner.name

    def limits(self, t: float) -> Limits:
        out = dict(self.inner.limits(t))
        for r, k in self.scales.items():
            if out.get(r) is not None:
                out[r] = out[r] / k
        return out

    def observe(self, t: float, usage) -> None:
        self.inner.observe(t, {r: (v * self.scales[r] if r in self.scales else v) for r, v in usage.items()})

    def explain(self) -> dict:
        return {**self.inner.explain(), "harness_unit_scales": dict(self.scales)}


def policy_specs(families: Iterable[str], windows: tuple[int, ...] = (5, 10, 30, 60),
                 units: dict[str, str] | None = None) -> list[PolicySpec]:
    """Expand family names (``vpa``, ``window``, ``phase``, ``oracle``) into specs.

    *units* are the trace's units per resource: when ``mem`` is not in bytes,
    VPA and the phase policy (whose reactive fallback is VPA) see it through
    :class:`ScaledPolicy` (nominal 1 TiB pod).

    >>> [s.name for s in policy_specs(["window", "oracle"], windows=(5,))]
    ['window-max-5', 'window-p95x1.15-5', 'oracle']
    """
    specs: list[PolicySpec] = []
    seen: set[str] = set()
    for fam in families:
        fam = fam.strip()
        if not fam or fam in seen:
            continue
        seen.add(fam)
        if fam == "window":
            from phasewise.models.baselines import window_family

            specs += [PolicySpec(n, "window", f) for n, f in window_family(windows).items()]
        elif fam == "vpa":
            vpa = _lazy_factory("phasewise.models.vpa", "VpaPolicy", "vpa")
            mem_unit = (units or {}).get("mem", "bytes")
            if mem_unit.startswith("bytes"):
                specs.append(PolicySpec("vpa", "vpa", vpa))
            else:
                specs.append(PolicySpec("vpa", "vpa",
                                        lambda vpa=vpa: ScaledPolicy(vpa(), {"mem": NOMINAL_MEM_BYTES})))
        elif fam == "phase":
            # never the shipped pretrained model: it was trained on the AI4DL sample a replay may score
            phase = partial(_lazy_factory("phasewise.models.phase_policy", "PhasePolicy", "phase"), pretrained=False)
            if (units or {}).get("mem", "bytes").startswith("bytes"):
                specs.append(PolicySpec("phase", "phase", phase))
            else:  # same unit treatment as VPA (its reactive fallback is VPA)
                specs.append(PolicySpec("phase", "phase",
                                        lambda phase=phase: ScaledPolicy(phase(), {"mem": NOMINAL_MEM_BYTES})))
        elif fam == ORACLE:
            specs.append(PolicySpec(ORACLE, ORACLE, None))
        else:
            raise ValueError(f"unknown policy {fam!r}; known: {', '.join(FAMILIES)}")
    if not specs:
        raise ValueError("no policy named")
    return specs


# ---------------------------------------------------------------- driving one container


def _usage_at(series: ContainerSeries, i: int) -> dict[str, float]:
    out = {}
    for r, u in series.usage.items():
        v = u[i]
        if not math.isnan(v):
            out[r] = float(v)
    return out


def decision_sequence(policy: LimitPolicy, series: ContainerSeries,
                      explain: bool = False) -> list[tuple[float, Limits]] | tuple[list[tuple[float, Limits]], list[dict]]:
    """Drive *policy* through one container: ``[(t, limits asked at t), ...]``.

    At each sample ``t`` the limits are asked first, then the usage measured at
    ``t`` is observed (only the resources with a value at ``t``). With
    *explain*, also return ``policy.explain()`` taken right after each
    ``limits(t)``.

    >>> import numpy as np
    >>> from phasewise.models.baselines import WindowPolicy
    >>> s = ContainerSeries("c", np.array([0., 10., 20.]), {"cpu": np.array([1., 3., 2.])})
    >>> decision_sequence(WindowPolicy(window=2), s)
    [(0.0, {}), (10.0, {'cpu': 1.0}), (20.0, {'cpu': 3.0})]
    """
    seq: list[tuple[float, Limits]] = []
    exps: list[dict] = []
    for i, t in enumerate(series.t.tolist()):
        lim = dict(policy.limits(t))
        seq.append((t, lim))
        if explain:
            exps.append(policy.explain())
        policy.observe(t, _usage_at(series, i))
    return (seq, exps) if explain else seq


@dataclass(frozen=True)
class FleetOptions:
    """How :func:`fleet_sequences` builds and runs the shared phase model (the replay's phase knobs)."""

    statistics: str = "relative"  #: "relative" (level x ratio quantile) or "absolute" (pooled usage quantile)
    quantile: float = 0.95
    margin: float = 0.10
    level_half_life: float = 30.0
    ratio_cap: float | None = 1.5  #: relative: the phase's usage/level quantile is used up to this (None: no cap)
    learn_every: int = 1
    pretrain_folds: int = 0  #: 0: start cold; K >= 2: cross-fitted pretraining (see :func:`fleet_sequences`)
    target_fulfilment: float | None = None  #: per-container adaptive multiplier aiming at this fulfilment
    resource_quantiles: tuple[tuple[str, float], ...] = ()  #: per-resource overrides of ``quantile``
    resource_margins: tuple[tuple[str, float], ...] = ()  #: per-resource overrides of ``margin``


def fold_of(containers: Iterable[str], k: int) -> dict[str, int]:
    """Deterministic fold of each container: rank of md5(id), modulo *k* (k = #containers: leave-one-out).

    >>> fold_of(["a", "b", "c"], 3) == {c: f for f, c in enumerate(sorted("abc", key=_md5))}
    True
    """
    ids = sorted(set(containers), key=_md5)
    return {c: i % max(1, k) for i, c in enumerate(ids)}


def _md5(s: str) -> str:
    import hashlib

    return hashlib.md5(s.encode()).hexdigest()


def split_of(container: str) -> str:
    """``"tune"`` for ids whose md5's last hex digit is even, ``"holdout"`` otherwise (a fixed split).

    >>> split_of("exec1"), split_of("exec2")
    ('holdout', 'tune')
    """
    return "tune" if int(_md5(container)[-1], 16) % 2 == 0 else "holdout"


def _steps(trace: Trace) -> Iterator[tuple[float, list[tuple[ContainerSeries, int]]]]:
    """Event times in order, each with the ``(series, sample index)`` of every container sampled then."""
    events = sorted((float(t), k, i) for k, c in enumerate(trace.containers) for i, t in enumerate(c.t.tolist()))
    j = 0
    while j < len(events):
        t = events[j][0]
        batch = []
        while j < len(events) and events[j][0] == t:
            _, k, i = events[j]
            j += 1
            batch.append((trace.containers[k], i))
        yield t, batch


#: pretraining passes over the training containers go on until the CRBM saw at least this many windows
PRETRAIN_MIN_WINDOWS = 1024


def pretrain_model(trace: Trace, opts: FleetOptions, min_windows: int = PRETRAIN_MIN_WINDOWS):
    """A shared :class:`PhaseModel` trained on every container of *trace* (the training containers).

    Offline, as AI4DL trained its model: the containers are stepped through a
    learning :class:`PhaseFleet` in event-time order, in as many passes
    (epochs) as it takes the CRBM to see ``min_windows`` windows (the fleet's
    per-container windows and levels restart each pass; the model carries
    over). Returns the model; it never sees a container it is not given.
    """
    from phasewise.models.detector import FEATURES, PhaseModel
    from phasewise.models.phase_fleet import PhaseFleet

    feats = tuple(f for f in FEATURES if f in trace.units)
    model = PhaseModel(features=feats)
    fleet = PhaseFleet(model, learn_every=1, statistics=opts.statistics, level_half_life=opts.level_half_life)
    n_windows = max(1, sum(max(0, len(c) - model.n_his) for c in trace.containers))
    epochs = max(1, math.ceil(min_windows / n_windows))
    for _ in range(epochs):
        fleet.clear()
        for t, batch in _steps(trace):
            ids = [series.container for series, _ in batch]
            frames = [[_usage_at(series, i).get(f, math.nan) for f in feats] for series, i in batch]
            fleet.step(t, ids, np.array(frames, dtype=np.float64))
    return model


def _subtrace(trace: Trace, keep: set[str]) -> Trace:
    return Trace(trace.format, trace.source, trace.units, [c for c in trace.containers if c.container in keep],
                 list(trace.notes))


@dataclass
class FleetDetail:
    """What :func:`fleet_sequences` can also tell, per container, for the report's plots."""

    #: resource -> True at the samples where the limit in force came from the fallback
    fallback: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: the phase id the detector gave each sample (-1: none yet)
    phases: dict[str, np.ndarray] = field(default_factory=dict)


def fleet_sequences(trace: Trace, learn_every: int = 1, options: FleetOptions | None = None,
                    detail: FleetDetail | None = None) -> dict[str, list[tuple[float, Limits]]]:
    """The ``phase`` policy with ONE shared model for all containers (the live worker's code).

    :class:`~phasewise.models.phase_fleet.PhaseFleet` steps every container
    that has a sample at an event time in one batched call, in event-time
    order, learning inline from every ``learn_every``-th ready window (the
    live worker ships that sample to its learner instead). Its reactive
    fallback is the per-container policy's (:class:`ReactiveFallback`: VPA
    for cpu/mem, a moving-window max otherwise), scaled like VPA when memory
    is not in bytes. As everywhere in replay, the limits used at ``t`` were
    handed out by the step before ``t``.

    ``options.pretrain_folds = K >= 2``: cross-fitted pretraining. The
    containers are cut into K folds (:func:`fold_of`); the containers of fold
    f are replayed by a fleet whose model was pretrained
    (:func:`pretrain_model`) on the OTHER folds only, so no container is
    scored by a model that saw it. K = number of containers is leave-one-out.

    *detail*, when given, is filled for every container (see :class:`FleetDetail`).
    """
    opts = options or FleetOptions(learn_every=learn_every)
    fb_out = detail if detail is not None else FleetDetail()
    if opts.pretrain_folds >= 2:
        folds = fold_of((c.container for c in trace.containers), opts.pretrain_folds)
        out: dict[str, list[tuple[float, Limits]]] = {}
        for f in sorted(set(folds.values())):
            mine = {c for c, g in folds.items() if g == f}
            model = pretrain_model(_subtrace(trace, set(folds) - mine), opts)
            out.update(_fleet_run(_subtrace(trace, mine), opts, model, fb_out))
        return out
    return _fleet_run(trace, opts, None, fb_out)


def _fleet_run(trace: Trace, opts: FleetOptions, model: Any,
               detail: FleetDetail | None = None) -> dict[str, list[tuple[float, Limits]]]:
    from phasewise.models.detector import FEATURES, PhaseModel
    from phasewise.models.phase_fleet import PhaseFleet
    from phasewise.models.phase_policy import ReactiveFallback

    feats = tuple(f for f in FEATURES if f in trace.units)
    if not feats:
        raise ValueError(f"the trace has none of the phase features {list(FEATURES)}")
    scaled = not trace.units.get("mem", "bytes").startswith("bytes")
    fleet = PhaseFleet(model if model is not None else PhaseModel(features=feats), learn_every=opts.learn_every,
                       quantile=opts.quantile, margin=opts.margin, statistics=opts.statistics,
                       level_half_life=opts.level_half_life, target_fulfilment=opts.target_fulfilment,
                       ratio_cap=opts.ratio_cap,
                       resource_quantiles=dict(opts.resource_quantiles), resource_margins=dict(opts.resource_margins))
    fallback: dict[str, LimitPolicy] = {}
    handed: dict[str, Limits] = {}
    handed_src: dict[str, dict[str, bool]] = {}  # resource -> the limit in force came from the fallback
    seqs: dict[str, list[tuple[float, Limits]]] = {c.container: [] for c in trace.containers}
    srcs: dict[str, list[dict[str, bool]]] = {c.container: [] for c in trace.containers}
    phases: dict[str, list[int]] = {c.container: [] for c in trace.containers}
    for t, batch in _steps(trace):
        ids: list[str] = []
        frames: list[list[float]] = []
        fb: list[list[float]] = []
        for series, i in batch:
            c = series.container
            seqs[c].append((t, dict(handed.get(c, {}))))
            srcs[c].append(handed_src.get(c, {}))
            usage = _usage_at(series, i)
            pol = fallback.get(c)
            if pol is None:
                pol = ReactiveFallback()
                pol = ScaledPolicy(pol, {"mem": NOMINAL_MEM_BYTES}) if scaled else pol
                fallback[c] = pol
            pol.observe(t, usage)
            lim = pol.limits(t)
            ids.append(c)
            frames.append([usage.get(f, math.nan) for f in feats])
            fb.append([math.nan if lim.get(f) is None else float(lim[f]) for f in feats])
        st = fleet.step(t, ids, np.array(frames, dtype=np.float64), np.array(fb, dtype=np.float64))
        for row, (c, ph) in enumerate(zip(ids, st.phase.tolist())):
            phases[c].append(int(ph))
            lim_row, fp_row = st.limits[row].tolist(), st.from_phase[row].tolist()
            handed[c] = {f: (None if math.isnan(v) else float(v)) for f, v in zip(feats, lim_row)}
            handed_src[c] = {**handed_src.get(c, {}),
                             **{f: not p for f, v, p in zip(feats, lim_row, fp_row) if not math.isnan(v)}}
    detail = detail if detail is not None else FleetDetail()
    for c, per_step in srcs.items():
        detail.fallback[c] = {f: np.array([d.get(f, False) for d in per_step], dtype=bool) for f in feats}
        detail.phases[c] = np.array(phases[c], dtype=np.int64)
    return seqs


def oracle_decisions(series: ContainerSeries) -> list[tuple[float, Limits]]:
    """The oracle's decisions: ``L_t = U_t`` (harness special case; it sees the step's usage)."""
    return [(t, _usage_at(series, i)) for i, t in enumerate(series.t.tolist())]


def _limit_arrays(seq: list[tuple[float, Limits]], resources: Iterable[str]) -> dict[str, np.ndarray]:
    """resource -> limit per step (held over ``None``), for the resources the policy
    names in its limits at least once."""
    out = {}
    for r in resources:
        if any(r in lim for _, lim in seq):
            out[r] = hold_last([lim.get(r) for _, lim in seq])
    return out


def _fallback_steps(exps: list[dict], resources: Iterable[str]) -> dict[str, np.ndarray]:
    """Per resource, whether the phase policy's limit in force at each step came from its
    fallback (its ``explain()["sources"]``; a step whose source is not given keeps the last).

    >>> _fallback_steps([{"sources": {"cpu": "fallback"}}, {}, {"sources": {"cpu": "phase"}}], ["cpu"])
    {'cpu': array([ True,  True, False])}
    """
    out = {}
    for r in resources:
        cur = False
        vals = []
        for e in exps:
            src = (e.get("sources") or {}).get(r) if isinstance(e, dict) else None
            if src is not None:
                cur = src != "phase"
            vals.append(cur)
        out[r] = np.array(vals, dtype=bool)
    return out


def _phase_ids(exps: list[dict]) -> np.ndarray:
    """Phase id per step from the phase policy's explain() (-1 where none)."""
    ids = np.full(len(exps), -1, dtype=np.int64)
    for i, e in enumerate(exps):
        v = e.get("phase", e.get("phase_id")) if isinstance(e, dict) else None
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            ids[i] = int(v)
    return ids


# ---------------------------------------------------------------- results


@dataclass
class ResourceResult:
    """Scores of every policy on one resource, summed over containers."""

    resource: str
    unit: str
    scores: dict[str, Score] = field(default_factory=dict)
    containers: int = 0  # containers with at least one scored step
    valid_steps: int = 0  # steps with a value for this resource
    warmup_steps: int = 0  # valid steps before the common start (not scored)


@dataclass
class ContainerReplay:
    """What the report plots for one container."""

    container: str
    t: np.ndarray
    usage: dict[str, np.ndarray]
    limits: dict[str, dict[str, np.ndarray]]  # policy -> resource -> limit per step (NaN: none)
    phases: np.ndarray | None  # phase id per step (-1: none), None when no phase policy ran
    #: resource -> True at the steps where the phase policy's limit came from its fallback (None: not known)
    fallback: dict[str, np.ndarray] | None = None


@dataclass
class ReplayResult:
    trace: Trace
    specs: list[PolicySpec]
    resources: dict[str, ResourceResult]
    plotted: list[ContainerReplay]
    elapsed_s: float
    phase_info: dict[str, Any] = field(default_factory=dict)

    @property
    def families(self) -> list[str]:
        return list(dict.fromkeys(s.family for s in self.specs))

    def members(self, family: str) -> list[str]:
        return [s.name for s in self.specs if s.family == family]


class _Progress:
    """A one-line progress bar on a terminal stream; silent otherwise."""

    def __init__(self, total: int, stream: TextIO | None, label: str = "replay") -> None:
        self.total, self.stream, self.label = total, stream, label
        self._last = -1.0

    def update(self, done: int) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        fill = int(width * done / max(self.total, 1))
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} containers")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def replay_trace(trace: Trace, specs: list[PolicySpec], plot_containers: int = 6,
                 progress: TextIO | None = None,
                 sequences: dict[str, dict[str, list[tuple[float, Limits]]]] | None = None,
                 phase_info: dict[str, Any] | None = None,
                 phase_ids: dict[str, np.ndarray] | None = None,
                 phase_fallback: dict[str, dict[str, np.ndarray]] | None = None) -> ReplayResult:
    """Replay every container of *trace* through every policy in *specs* and score them.

    *sequences*: ``{policy name: {container: [(t, limits), ...]}}`` decided
    elsewhere (through Kafka, or by the worker's code); those policies are
    scored from them instead of being run in-process. *phase_info*: what the
    report says about how such a phase model started (``class``,
    ``warm_start``: ``{origin: containers}``). *phase_ids*: per container, the
    phase id at each sample (-1: none) for such a phase model, for the plots;
    *phase_fallback*: per container and resource, whether its limit in force
    at each sample came from its fallback (for the plots).
    """
    t0 = time.perf_counter()
    resources = {r: ResourceResult(r, u, {s.name: Score() for s in specs}) for r, u in trace.units.items()}
    # fallback step for series of a single sample: the trace-wide median step
    diffs = [np.diff(c.t) for c in trace.containers if len(c) > 1]
    global_dt = float(np.median(np.concatenate(diffs))) if diffs else 1.0
    plotted: list[ContainerReplay] = []
    phase_info = dict(phase_info or {})
    pending: list[tuple[str, np.ndarray, np.ndarray, dict[str, np.ndarray]]] = []
    managed: dict[str, set[str]] = {}
    bar = _Progress(len(trace.containers), progress)
    for k, series in enumerate(trace.containers):
        keep = k < plot_containers
        limits: dict[str, dict[str, np.ndarray]] = {}
        phases = None
        fallback = None
        for spec in specs:
            if sequences is not None and spec.name in sequences:
                seq = sequences[spec.name][series.container]
            elif spec.factory is None:
                seq = oracle_decisions(series)
            else:
                policy = spec.factory()
                if spec.family == "phase":
                    seq, exps = decision_sequence(policy, series, explain=True)
                    phases = _phase_ids(exps)
                    fallback = _fallback_steps(exps, series.usage)
                    _describe_phase(policy, phase_info)
                else:
                    seq = decision_sequence(policy, series)
            limits[spec.name] = _limit_arrays(seq, series.usage)
        for r, u in series.usage.items():
            ok = ~np.isnan(u)
            if ok.any():
                pending.append((r, series.t[ok], u[ok],
                                {name: lim[r][ok] for name, lim in limits.items() if r in lim}))
                managed.setdefault(r, set()).update(
                    name for name, lim in limits.items() if r in lim and not np.all(np.isnan(lim[r])))
        if phases is None and phase_ids is not None:
            phases = phase_ids.get(series.container)
        if fallback is None and phase_fallback is not None:
            fallback = phase_fallback.get(series.container)
        if keep:
            plotted.append(ContainerReplay(series.container, series.t, series.usage, limits, phases, fallback))
        bar.update(k + 1)
    # Score once every container is replayed: a policy manages r when it set a limit
    # for r in some container; in a container where it never did, it had no opinion
    # there (NaN), which holds back that (container, r) for every policy.
    for r, t_r, u_r, lim_r in pending:
        res = resources[r]
        n = len(t_r)
        res.valid_steps += n
        names = managed.get(r, set())
        if not names:
            continue
        lims = {name: lim_r.get(name, np.full(n, np.nan)) for name in names}
        start = common_start(lims.values())
        res.warmup_steps += min(start, n)
        if start >= n:
            continue
        res.containers += 1
        med = None if n > 1 else global_dt
        for name, lim in lims.items():
            res.scores[name] = res.scores[name] + score_steps(t_r, u_r, lim, start=start, median_dt=med)
    return ReplayResult(trace, specs, resources, plotted, time.perf_counter() - t0, phase_info)


def _describe_phase(policy: Any, info: dict[str, Any]) -> None:
    """Accumulate what the report says about how the phase model started, per container."""
    inner = getattr(policy, "inner", policy)  # through ScaledPolicy
    info.setdefault("class", f"{type(inner).__module__}.{type(inner).__qualname__}")
    if inner is not policy:
        info["harness_unit_scales"] = dict(policy.scales)
    if hasattr(inner, "pretrained"):
        info["pretrained_allowed"] = bool(inner.pretrained)
    start = getattr(inner, "warm_start", None)
    if start is not None:
        counts = info.setdefault("warm_start", {})
        counts[str(start)] = counts.get(str(start), 0) + 1


# ---------------------------------------------------------------- summaries


def _pick(scores: dict[str, Score], names: list[str], target_fulfilled: float) -> tuple[str, bool] | None:
    """Lowest alloc among *names* with fulfilled >= target (matched), else the
    highest fulfilment below it (ties: lowest alloc), flagged unmatched."""
    cands = [n for n in names if scores[n].steps > 0 and scores[n].alloc_over_used is not None]
    if not cands:
        return None
    ok = [n for n in cands if scores[n].fulfilled >= target_fulfilled]
    if ok:
        return min(ok, key=lambda n: (scores[n].alloc, n)), True
    return min(cands, key=lambda n: (-scores[n].fulfilled, scores[n].alloc, n)), False


def _num(v: float | None, nd: int = 6) -> float | None:
    return None if v is None else round(float(v), nd)


def _frontier_fields(sc: dict[str, Score], reactive: list[str]) -> dict[str, Any]:
    """The phase policy against the reactive frontier of *reactive* (see :mod:`phasewise.models.frontier`)."""
    from phasewise.models.frontier import alloc_cut, frontier, frontier_at, slack_cut

    pts = {n: (sc[n].alloc_over_used, sc[n].fulfilment) for n in reactive if sc[n].steps > 0}
    p = sc["phase"]
    at = frontier_at(pts, p.fulfilment)
    if at is None:  # pragma: no cover - the caller checked that some reactive member has a score
        return {}
    out: dict[str, Any] = {
        "slack_cut_vs_frontier": _num(slack_cut(p.alloc_over_used, at.alloc)),
        "alloc_cut_vs_frontier": _num(alloc_cut(p.alloc_over_used, at.alloc)),
        "frontier_alloc_at_phase_fulfilment": _num(at.alloc),
        "frontier_fulfilment": _num(at.fulfilment),
        "frontier_mix": {n: _num(w) for n, w in at.mix},
        "phase_fulfilment_above_every_reactive": at.above_every_member,
        "frontier": [{"member": v.name, "alloc_over_used": _num(v.alloc), "fulfilment": _num(v.fulfilment)}
                     for v in frontier(pts)],
    }
    if at.above_every_member:
        out["frontier_note"] = (f"the phase policy's fulfilment ({p.fulfilment:.2%}) is above every reactive "
                                f"baseline's; compared at the highest, {at.fulfilment:.2%}")
    if at.alloc <= 1.0:
        out["slack_note"] = "the frontier allocates at most the use there: no slack to cut"
    return out


def result_rows(result: ReplayResult) -> tuple[list[dict], list[dict]]:
    """(one row per (policy family, resource), one savings row per resource)."""
    rows: list[dict] = []
    savings: list[dict] = []
    fams = result.families
    for r, res in result.resources.items():
        sc = res.scores
        steps = max((s.steps for s in sc.values()), default=0)
        ref = next((f for f in ("phase", "vpa") if f in fams and sc[f].steps > 0), None)
        if ref is not None:
            target, target_from = sc[ref].fulfilled, ref
        else:
            target, target_from = DEFAULT_TARGET_FULFILMENT * steps, f"{DEFAULT_TARGET_FULFILMENT:.0%}"
        for fam in fams:
            base = {"type": "score", "policy": fam, "resource": r}
            if fam == "window":
                picked = _pick(sc, result.members("window"), target)
                name = picked[0] if picked else result.members("window")[0]
                row = {**base, **_score_fields(sc[name]), "member": name,
                       "member_choice": f"lowest alloc_over_used reaching {target_from} fulfilment"
                       if picked and picked[1] else f"highest fulfilment (none reached {target_from})",
                       "members": {n: _score_fields(sc[n]) for n in result.members("window")}}
            else:
                row = {**base, **_score_fields(sc[fam])}
                if fam == ORACLE:
                    row["note"] = ORACLE_NOTE
                elif sc[fam].steps == 0:
                    row["note"] = "no score: the policy sets no limit for this resource"
            row["unit"] = res.unit
            row["containers"] = res.containers
            rows.append(row)
        srow: dict[str, Any] = {"type": "savings", "resource": r, "slack_cut_vs_frontier": None,
                                "alloc_cut_vs_frontier": None, "savings_vs_best_reactive": None}
        reactive = [n for f in REACTIVE if f in fams for n in result.members(f)]
        if "phase" not in fams:
            srow["reason"] = "phase policy not in this run"
        elif not reactive:
            srow["reason"] = "no reactive baseline (vpa, window) in this run"
        elif sc["phase"].steps == 0 or sc["phase"].alloc_over_used is None:
            srow["reason"] = "no scored step with usage for this resource"
        else:
            picked = _pick(sc, reactive, sc["phase"].fulfilled)
            if picked is None:
                srow["reason"] = "no reactive baseline has a score"
            else:
                srow.update(_frontier_fields(sc, reactive))
                best, matched = picked
                b = sc[best]
                p = sc["phase"]
                srow.update({
                    "savings_vs_best_reactive": _num(1.0 - p.alloc / b.alloc) if b.alloc > 0 else None,
                    "best_reactive": best,
                    "best_reactive_alloc_over_used": _num(b.alloc_over_used),
                    "best_reactive_fulfilment": _num(b.fulfilment),
                    "phase_alloc_over_used": _num(p.alloc_over_used),
                    "phase_fulfilment": _num(p.fulfilment),
                    "matched_fulfilment": matched,
                })
                if not matched:
                    srow["flag"] = "no reactive baseline reaches the phase policy's fulfilment; closest below used"
        if ORACLE in fams:
            srow["oracle_alloc_over_used"] = _num(sc[ORACLE].alloc_over_used)
        srow["steps"] = steps
        srow["warmup_steps_not_scored"] = res.warmup_steps
        savings.append(srow)
    return rows, savings


class ThroughKafkaUnsupported(RuntimeError):
    """A policy family of the run cannot go through the Kafka pipeline in this build."""


def _through_kafka(trace: Trace, specs: list[PolicySpec], bootstrap: str | None,
                   **kw: Any) -> dict[str, dict[str, list[tuple[float, Limits]]]]:
    """Decision sequences of the worker's policy families in *specs*, through the real pipeline."""
    from phasewise.replay_kafka import kafka_sequences, worker_policies

    families = [s.family for s in specs]
    runs = worker_policies()
    if "phase" in families and "phase" not in runs:
        raise ThroughKafkaUnsupported(
            "--through-kafka cannot run the phase policy: phasewise worker has no `--policy phase` "
            "in this build (streams/worker.py, streams/phase_agents.py); drop phase from "
            "--policies or run without --through-kafka")
    kafka = [f for f in dict.fromkeys(families) if f in runs]
    if not kafka:
        raise ThroughKafkaUnsupported("--through-kafka: none of the policies runs in the stream worker "
                                      f"(it runs {', '.join(runs)}); add one to --policies")
    seqs, info = kafka_sequences(trace, kafka, bootstrap=bootstrap, **kw)
    for fam, i in info.items():
        print(f"through kafka: {fam}: {i['messages']} messages, {i['decisions']} decisions from "
              f"phasewise worker {i['worker_id']} (host {i['host']}) via {i['bootstrap']} "
              f"in {i['elapsed_s']} s", file=sys.stderr)
    others = sorted({f for f in families if f not in kafka})
    if others:
        print(f"in-process: {', '.join(others)} (not run by the stream worker)", file=sys.stderr)
    return {s.name: seqs[s.family] for s in specs if s.family in seqs}


def worker_origin(trace: Trace, *, pretrained: bool, statistics: str = "relative",
                  bootstrap: str | None = None) -> str:
    """What a replay's phase worker starts from (for the report), by the worker's own rule.

    :func:`~phasewise.streams.config.initial_model` under the replay
    worker's settings; with *bootstrap* (a broker that may already hold
    snapshots) the worker would start from the newest one instead.
    """
    from phasewise.replay_kafka import replay_settings_env
    from phasewise.settings import Settings
    from phasewise.streams.config import initial_model

    env = replay_settings_env("phase", trace, pretrained=pretrained, statistics=statistics)
    origin = initial_model(Settings.from_env({"bootstrap": "-"}, env=env))[1]
    return origin + (", unless a snapshot was already on the models topic" if bootstrap else "")


def _score_fields(s: Score) -> dict[str, Any]:
    return {"alloc_over_used": _num(s.alloc_over_used), "fulfilment": _num(s.fulfilment), "steps": s.steps}


def mix_text(mix: dict[str, float]) -> str:
    """``{"a": 0.25, "b": 0.75}`` -> ``"0.25 a + 0.75 b"``; one member: its name.

    >>> mix_text({"window-max-30": 0.25, "window-max-60": 0.75}), mix_text({"vpa": 1.0})
    ('0.25 window-max-30 + 0.75 window-max-60', 'vpa')
    """
    if len(mix) == 1:
        return next(iter(mix))
    return " + ".join(f"{w:.2f} {n}" for n, w in mix.items())


def format_table(rows: list[dict], savings: list[dict]) -> str:
    """Readable table of the rows and savings."""

    def f(v: Any, pct: bool = False) -> str:
        if v is None:
            return "-"
        return f"{v:.1%}" if pct else f"{v:.3f}"

    lines = [f"{'resource':9s} {'policy':8s} {'alloc/used':>10s} {'fulfilment':>10s} {'steps':>7s}  detail"]
    for r in rows:
        detail = r.get("member", "") or ("oracle: sees U_t" if r["policy"] == ORACLE else r.get("note", ""))
        lines.append(f"{r['resource']:9s} {r['policy']:8s} {f(r['alloc_over_used']):>10s} "
                     f"{f(r['fulfilment'], True):>10s} {r['steps']:>7d}  {detail}")
    lines.append("")
    for s in savings:
        r = s["resource"]
        if s.get("frontier_alloc_at_phase_fulfilment") is None:
            lines.append(f"{r:9s} vs reactive frontier: - ({s.get('reason', 'undefined')})")
            continue
        above = (f"  [phase fulfilment {f(s['phase_fulfilment'], True)} is above every reactive baseline's: "
                 "compared at the highest]" if s["phase_fulfilment_above_every_reactive"] else "")
        lines.append(f"{r:9s} vs reactive frontier at {f(s['frontier_fulfilment'], True)}: slack cut "
                     f"{f(s['slack_cut_vs_frontier'], True)}, allocation cut {f(s['alloc_cut_vs_frontier'], True)} "
                     f"(alloc/used: phase {f(s['phase_alloc_over_used'])}, frontier "
                     f"{f(s['frontier_alloc_at_phase_fulfilment'])} = {mix_text(s['frontier_mix'])}){above}")
        flag = "" if s["matched_fulfilment"] else "  [UNMATCHED: closest baseline below phase fulfilment]"
        lines.append(f"{'':9s} vs cheapest single baseline at >= phase fulfilment ({s['best_reactive']}, "
                     f"{f(s['best_reactive_fulfilment'], True)}): allocation cut "
                     f"{f(s['savings_vs_best_reactive'], True)}{flag}")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.cli import add_setting

    p.add_argument("path", nargs="?", help="trace file (ai4dl) or folder (genai2026); "
                   "default: the AI4DL sample shipped with phasewise")
    p.add_argument("--format", choices=sorted(FORMATS), default="ai4dl",
                   help="trace layout: " + "; ".join(f"{k} = {v}" for k, v in FORMATS.items()))
    p.add_argument("--policies", default="vpa,window,phase,oracle",
                   help="comma-separated policy families among vpa, window, phase, oracle (default: all)")
    p.add_argument("--windows", default="5,10,30,60", type=arg_type(parse_str, _check_windows),
                   help="window sizes (samples) of the window family (default 5,10,30,60)")
    p.add_argument("--through-kafka", action="store_true",
                   help="run the policies the stream worker runs (vpa) through a broker and a real "
                        "phasewise worker instead of in-process; the others stay in-process")
    p.add_argument("--bootstrap", help="with --through-kafka: use this broker instead of starting an "
                   "embedded one (the replay worker reads the whole samples topic and publishes "
                   "decisions for every host in it: not a broker live actuators listen to)")
    p.add_argument("--phase-model", choices=("container", "fleet", "worker"), default="container",
                   help="phase policy: one model per container (default); one model shared by all "
                        "containers (fleet: the worker's detector with replay's own fallback and knobs); or "
                        "the worker's own code in-process (worker: VPA fallback, decisions, learner; what "
                        "--through-kafka runs through a broker)")
    p.add_argument("--phase-pretrained", action="store_true",
                   help="--phase-model worker / --through-kafka: start from the shipped model pretrained on the "
                        "AI4DL sample (default: cold; a trace must not be scored by a model that saw it)")
    p.add_argument("--phase-frozen", action="store_true",
                   help="--phase-model worker / --through-kafka: the learner never updates the detectors' model "
                        "(needs --phase-pretrained); the two paths then decide identically")
    p.add_argument("--safety", action="store_true",
                   help="--phase-model worker / --through-kafka: the worker's live safety rules bound its decisions "
                        "(safety_rules with the live defaults); default off: the bare policy's decisions are scored")
    p.add_argument("--phase-stats", choices=PHASE_STATISTICS, default="relative",
                   help="--phase-model fleet or worker, --through-kafka: per-phase statistics of usage relative to "
                        "each container's level (default) or of absolute usage (the pooled design before)")
    p.add_argument("--phase-quantile", type=arg_type(parse_float, in_range(0, 1, lo_open=True)), default=0.95, help="--phase-model fleet: phase quantile "
                   "(default 0.95)")
    p.add_argument("--phase-margin", type=arg_type(parse_float, at_least(0)), default=0.10, help="--phase-model fleet: margin over the "
                   "quantile (default 0.10)")
    p.add_argument("--level-half-life", type=arg_type(parse_float, above(0)), default=30.0, help="--phase-model fleet, relative: "
                   "half-life in samples of the decaying max that is a container's level (default 30)")
    p.add_argument("--phase-ratio-cap", type=arg_type(parse_float, SPECS["phase_ratio_cap"].validate), default=1.5,
                   metavar="C",
                   help="--phase-model fleet, relative: use a phase's quantile of usage/level up to C, so a limit is "
                        "at most level x C x (1 + margin) (default 1.5, see the README; 0 = no cap)")
    p.add_argument("--phase-resource-quantiles", default="", metavar="R=Q,...", type=arg_type(parse_str, _per_resource),
                   help="--phase-model fleet: per-resource quantiles overriding --phase-quantile, e.g. mem=0.97")
    p.add_argument("--phase-resource-margins", default="", metavar="R=M,...", type=arg_type(parse_str, _per_resource),
                   help="--phase-model fleet: per-resource margins overriding --phase-margin, e.g. mem=0")
    p.add_argument("--phase-target-fulfilment", type=arg_type(parse_float, in_range(0, 1, lo_open=True)), default=None,
                   metavar="F",
                   help="--phase-model fleet: each container adapts a multiplier of its phase limits online "
                        "from its own misses, aiming at this fulfilment (default: off)")
    p.add_argument("--pretrain-folds", type=arg_type(parse_int, _check_folds), default=0, metavar="K",
                   help="--phase-model fleet: cross-fitted pretraining; each of K container folds is scored "
                        "by a model pretrained on the other folds only (0: start cold; K = number of "
                        "containers: leave-one-out)")
    p.add_argument("--split", choices=("all", "tune", "holdout"), default="all",
                   help="replay only the containers of this fixed split (md5 of the id: even last hex digit = "
                        "tune, odd = holdout)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line instead of a table")
    p.add_argument("--report", metavar="DIR", help="write PNG plots and summary.md into DIR")
    p.add_argument("--plot-containers", type=arg_type(parse_int, at_least(0)), default=6, help="containers plotted in the report (default 6)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_setting(p, "log_level")


def _check_windows(text: str) -> None:
    """Window sizes: a comma list of positive integers."""
    try:
        windows = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        windows = []
    if not windows or min(windows) < 1:
        raise ValueError(f"must be positive integers, e.g. 5,10,30,60; got {text!r}")


def _check_folds(k: int) -> None:
    if k < 0 or k == 1:
        raise ValueError(f"must be 0 (no pretraining) or at least 2 folds, got {k}")


def _per_resource(text: str) -> tuple[tuple[str, float], ...]:
    """``"mem=0.97,gpu=0.9"`` -> ``(("mem", 0.97), ("gpu", 0.9))``.

    >>> _per_resource("mem=0.97, gpu_mem=0.98")
    (('mem', 0.97), ('gpu_mem', 0.98))
    """
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, val = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out.append((name.strip(), parse_float(val)))
        except ValueError:
            raise ValueError(f"expected RESOURCE=NUMBER (a finite number), got {part!r}") from None
    return tuple(out)


def replay_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (written into the report)."""
    parts = ["phasewise", "replay"]
    if args.path is not None:
        parts.append(args.path)
    parts += ["--format", args.format, "--policies", args.policies]
    if args.windows != "5,10,30,60":
        parts += ["--windows", args.windows]
    if args.through_kafka:
        parts.append("--through-kafka")
        if getattr(args, "bootstrap", None):
            parts += ["--bootstrap", args.bootstrap]
    for flag in ("phase_pretrained", "phase_frozen", "safety"):
        if getattr(args, flag, False):
            parts.append("--" + flag.replace("_", "-"))
    if getattr(args, "phase_model", "container") == "worker" or args.through_kafka:
        if getattr(args, "phase_model", "container") == "worker":
            parts += ["--phase-model", "worker"]
        if getattr(args, "phase_stats", "relative") != "relative":
            parts += ["--phase-stats", args.phase_stats]
    elif getattr(args, "phase_model", "container") != "container":
        parts += ["--phase-model", args.phase_model]
        d = {"phase_stats": "relative", "phase_quantile": 0.95, "phase_margin": 0.10, "level_half_life": 30.0,
             "phase_ratio_cap": 1.5,
             "phase_resource_quantiles": "", "phase_resource_margins": "", "phase_target_fulfilment": None,
             "pretrain_folds": 0}
        for k, v in d.items():
            if getattr(args, k, v) != v:
                parts += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    if getattr(args, "split", "all") != "all":
        parts += ["--split", args.split]
    if args.json:
        parts.append("--json")
    if args.report:
        parts += ["--report", args.report]
    if args.plot_containers != 6:
        parts += ["--plot-containers", str(args.plot_containers)]
    return " ".join(shlex.quote(p) for p in parts)


def run(args: argparse.Namespace) -> int:
    command = replay_command(args)
    if getattr(args, "bootstrap", None) and not args.through_kafka:
        print("phasewise replay: error: --bootstrap: needs --through-kafka", file=sys.stderr)
        return 2
    try:
        windows = tuple(int(w) for w in args.windows.split(",") if w.strip())
        if not windows or min(windows) < 1:
            raise ValueError
    except ValueError:
        print(f"phasewise replay: error: --windows: must be positive integers, got {args.windows!r}", file=sys.stderr)
        return 2
    path = args.path
    if path is None:
        if args.format != "ai4dl":
            print("phasewise replay: error: PATH: required for --format genai2026", file=sys.stderr)
            return 2
        path = str(sample_path())
    try:
        trace = load_trace(path, args.format)
    except TraceFormatError as e:
        print(f"phasewise replay: {e}", file=sys.stderr)
        return 2
    split = getattr(args, "split", "all")
    if split != "all":
        trace = _subtrace(trace, {c.container for c in trace.containers if split_of(c.container) == split})
        if not trace.containers:
            print(f"phasewise replay: error: --split: no container of the trace is in the {split} split",
                  file=sys.stderr)
            return 2
    try:
        rq = _per_resource(getattr(args, "phase_resource_quantiles", ""))
        rm = _per_resource(getattr(args, "phase_resource_margins", ""))
    except ValueError as e:
        print(f"phasewise replay: error: --phase-resource-quantiles/margins: {e}", file=sys.stderr)
        return 2
    opts = FleetOptions(statistics=getattr(args, "phase_stats", "relative"),
                        resource_quantiles=rq, resource_margins=rm,
                        target_fulfilment=getattr(args, "phase_target_fulfilment", None),
                        quantile=getattr(args, "phase_quantile", 0.95), margin=getattr(args, "phase_margin", 0.10),
                        level_half_life=getattr(args, "level_half_life", 30.0),
                        ratio_cap=(getattr(args, "phase_ratio_cap", 1.5) or None),
                        pretrain_folds=getattr(args, "pretrain_folds", 0))
    try:
        specs = policy_specs(args.policies.split(","), windows=windows, units=trace.units)
    except (ValueError, PolicyUnavailable) as e:
        print(f"phasewise replay: error: --policies: {e}", file=sys.stderr)
        return 2
    phase_model = getattr(args, "phase_model", "container")
    pretrained, frozen = getattr(args, "phase_pretrained", False), getattr(args, "phase_frozen", False)
    safety = bool(getattr(args, "safety", False))
    if (pretrained or frozen or safety) and phase_model != "worker" and not args.through_kafka:
        print("phasewise replay: error: --phase-pretrained/--phase-frozen/--safety: apply to --phase-model worker "
              "and --through-kafka", file=sys.stderr)
        return 2
    if frozen and not pretrained:
        print("phasewise replay: error: --phase-frozen: needs --phase-pretrained (a frozen cold model never warms: "
              "the policy would be its VPA fallback throughout)", file=sys.stderr)
        return 2
    sequences = None
    phase_ids = None
    phase_fallback: dict[str, dict[str, np.ndarray]] | None = None
    worker_info: dict[str, Any] = {}
    has_phase = any(sp.name == "phase" for sp in specs)
    if args.through_kafka:
        from phasewise.replay_kafka import KafkaReplayError

        try:
            sequences = _through_kafka(trace, specs, getattr(args, "bootstrap", None), frozen_model=frozen,
                                       pretrained=pretrained, statistics=getattr(args, "phase_stats", "relative"),
                                       safety=safety)
        except ThroughKafkaUnsupported as e:
            print(f"phasewise replay: error: --through-kafka: {e}", file=sys.stderr)
            return 2
        except KafkaReplayError as e:
            print(f"phasewise replay --through-kafka: {e}", file=sys.stderr)
            return 1
    if phase_model == "worker" and any(sp.name == "phase" for sp in specs) and "phase" not in (sequences or {}):
        from phasewise.replay_kafka import KafkaReplayError, worker_in_process

        try:
            got = worker_in_process(trace, family="phase", frozen_model=frozen, pretrained=pretrained,
                                    statistics=getattr(args, "phase_stats", "relative"), safety=safety)
        except KafkaReplayError as e:
            print(f"phasewise replay: --phase-model worker: {e}", file=sys.stderr)
            return 2
        sequences = {**(sequences or {}), "phase": got.sequences}
        from phasewise.replay_kafka import fallback_series, phase_series

        phase_ids = phase_series(trace, got.phase_changes)
        phase_fallback = fallback_series(trace, got.decisions)
        worker_info = {"model_origin": got.model_origin, "snapshots": got.snapshots,
                       "phase_features": got.settings_env.get("PHASEWISE_PHASE_FEATURES"),
                       "decisions": len(got.decisions)}
        print(f"phase (worker, in-process): {len(got.decisions)} decisions over {got.messages} messages, "
              f"features {worker_info['phase_features']}, started {got.model_origin}, "
              f"{got.snapshots} snapshots, {got.elapsed_s:.1f} s", file=sys.stderr)
    if phase_model == "fleet" and any(sp.name == "phase" for sp in specs):
        if sequences is not None and "phase" in sequences:
            print("phasewise replay: error: --phase-model: fleet runs in-process only (the worker's phase path "
                  "is already the fleet)", file=sys.stderr)
            return 2
        try:
            detail = FleetDetail()
            sequences = {**(sequences or {}), "phase": fleet_sequences(trace, options=opts, detail=detail)}
            phase_fallback, phase_ids = detail.fallback, detail.phases
        except ValueError as e:
            print(f"phasewise replay: {e}", file=sys.stderr)
            return 2
    show = None if args.quiet or not sys.stderr.isatty() else sys.stderr
    phase_info = None
    if has_phase and (phase_model == "worker" or args.through_kafka):
        origin = worker_info.get("model_origin") or worker_origin(
            trace, pretrained=pretrained, statistics=getattr(args, "phase_stats", "relative"),
            bootstrap=getattr(args, "bootstrap", None))
        where = "through Kafka" if args.through_kafka else "in-process"
        phase_info = {"class": f"phasewise worker --policy phase ({where}; one model shared by all containers)",
                      "warm_start": {origin: len(trace.containers)}}
    elif has_phase and phase_model == "fleet":
        k = opts.pretrain_folds
        origin = (f"pretrained on the other {k - 1} of {k} container folds (cross-fitted)" if k >= 2 else "cold")
        phase_info = {"class": "one model shared by all containers (replay --phase-model fleet)",
                      "warm_start": {origin: len(trace.containers)}}
    result = replay_trace(trace, specs, plot_containers=max(0, args.plot_containers), progress=show,
                          sequences=sequences, phase_info=phase_info, phase_ids=phase_ids,
                          phase_fallback=phase_fallback)
    rows, savings = result_rows(result)
    setup: dict[str, Any] = {"type": "setup", "command": command, **trace_fields(trace),
                             "policies": [sp.name for sp in specs],
                             "phase_model": ("worker" if args.through_kafka and has_phase else phase_model)
                             if has_phase else None,
                             "phase_start": result.phase_info.get("warm_start") if has_phase else None,
                             "split": split, "windows": list(windows), "through_kafka": bool(args.through_kafka),
                             "elapsed_s": round(result.elapsed_s, 3)}
    if setup["phase_model"] == "worker" and has_phase:
        setup.update({"pretrained": pretrained, "frozen": frozen, "safety_rules": safety,
                      "statistics": getattr(args, "phase_stats", "relative"),
                      **worker_info})
    if setup["phase_model"] == "fleet":
        setup.update({k: getattr(opts, k) for k in ("statistics", "quantile", "margin", "level_half_life", "ratio_cap",
                                                    "target_fulfilment", "pretrain_folds")})
        setup["resource_quantiles"] = dict(opts.resource_quantiles)
        setup["resource_margins"] = dict(opts.resource_margins)
    unscored = [r for r, res in result.resources.items() if res.valid_steps == 0]
    if args.json:
        for n in trace.notes:  # stdout holds only JSON; a person running it still sees what loading did
            print(f"phasewise replay: note: {n}", file=sys.stderr)
        for row in [setup, *rows, *savings]:
            print(json.dumps(row, sort_keys=False, allow_nan=False))
    else:
        print(f"trace: {trace.format} {trace.source}: {len(trace.containers)} containers, "
              f"{trace.n_samples()} samples; replayed in {result.elapsed_s:.1f} s")
        for n in trace.notes:
            print(f"note: {n}")
        print(format_table(rows, savings))
    for r in unscored:
        print(f"phasewise replay: warning: {r}: no value in the trace, so no step is scored for it "
              "(see the notes)", file=sys.stderr)
    if args.report:
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font cache lines are not the report
        from phasewise.report import write_report

        written = write_report(result, rows, savings, Path(args.report), command=command, setup=setup)
        print(f"report: {len(written)} files in {args.report}", file=sys.stderr)
    return 0


def trace_fields(trace: Trace) -> dict[str, Any]:
    """What the setup line says about the trace: where from, its size, units and what loading changed."""
    return {"trace": {"format": trace.format, "source": trace.source, "containers": len(trace.containers),
                      "samples": trace.n_samples(), "units": dict(trace.units), "time_unit": trace.time_unit,
                      "notes": list(trace.notes),
                      "negative_clipped": dict(trace.counts.get("negative_clipped", {})),
                      "non_finite_missing": dict(trace.counts.get("non_finite_missing", {}))}}
