"""Driving the policies through a trace, one container or a whole fleet at a time: each policy asked for its
limits before it is shown the usage of the step, all scored on the same steps. :func:`decision_sequence`
exposes a policy's decisions for comparison with the Kafka path. docs/results.md, "How replay runs".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from phasewise.apps.replay.policies import NOMINAL_MEM_BYTES, PolicySpec, ScaledPolicy
from phasewise.apps.replay.results import ContainerReplay, ReplayResult, ResourceResult
from phasewise.apps.replay.traces import ContainerSeries, Trace, subtrace
from phasewise.kit.settings import PhaseSettings, Settings
from phasewise.models.policy import LimitPolicy, Limits
from phasewise.models.scoring.measures import Score, common_start, hold_last, score_steps

__all__ = [
    "decision_sequence",
    "fleet_sequences",
    "FleetDetail",
    "FleetOptions",
    "fold_of",
    "oracle_decisions",
    "pretrain_model",
    "replay_trace",
    "split_of",
]


def _usage_at(series: ContainerSeries, i: int) -> dict[str, float]:
    out = {}
    for r, u in series.usage.items():
        v = u[i]
        if not math.isnan(v):
            out[r] = float(v)
    return out


Sequence = list[tuple[float, Limits]]


def decision_sequence(policy: LimitPolicy, series: ContainerSeries,
                      explain: bool = False) -> Sequence | tuple[Sequence, list[dict]]:
    """Drive *policy* through one container: ``[(t, limits asked at t), ...]``.

    At each sample ``t`` the limits are asked first, then the usage measured at
    ``t`` is observed (only the resources with a value at ``t``). With
    *explain*, also return ``policy.explain()`` taken right after each
    ``limits(t)``.

    >>> import numpy as np
    >>> from phasewise.models.scoring.baselines import WindowPolicy
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
    """How :func:`fleet_sequences` builds and runs the shared phase model (replay's phase knobs).

    ``statistics`` and ``ratio_cap`` default to the worker's (``phase_statistics``,
    ``phase_ratio_cap``); the others are replay's own.
    """

    #: "relative" (level x ratio quantile) or "absolute" (pooled usage quantile)
    statistics: str = Settings.default("phase_statistics")
    quantile: float = 0.95
    margin: float = 0.10
    level_half_life: float = 30.0
    #: relative: the phase's usage/level quantile is used up to this (None: no cap)
    ratio_cap: float | None = PhaseSettings.cap(Settings.default("phase_ratio_cap"))
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


def _pretrain_epochs(trace: Trace, n_his: int, min_windows: int = PRETRAIN_MIN_WINDOWS) -> int:
    """The passes :func:`pretrain_model` makes over *trace*."""
    n_windows = max(1, sum(max(0, len(c) - n_his) for c in trace.containers))
    return max(1, math.ceil(min_windows / n_windows))


def _n_steps(trace: Trace) -> int:
    """How many event times :func:`_steps` yields."""
    ts = [c.t for c in trace.containers if len(c)]
    return len(np.unique(np.concatenate(ts))) if ts else 0


def pretrain_model(trace: Trace, opts: FleetOptions, min_windows: int = PRETRAIN_MIN_WINDOWS,
                   tick: Callable[[], None] | None = None):
    """A shared :class:`PhaseModel` trained on every container of *trace* (the training containers).

    Offline, as AI4DL trained its model: the containers are stepped through a
    learning :class:`PhaseFleet` in event-time order, in as many passes
    (epochs) as it takes the CRBM to see ``min_windows`` windows (the fleet's
    per-container windows and levels restart each pass; the model carries
    over). Returns the model; it never sees a container it is not given.
    """
    from phasewise.models.phases.detector import PhaseModel
    from phasewise.models.phases.features import FEATURES
    from phasewise.models.phases.fleet import PhaseFleet

    feats = tuple(f for f in FEATURES if f in trace.units)
    model = PhaseModel(features=feats)
    fleet = PhaseFleet(model, learn_every=1, statistics=opts.statistics, level_half_life=opts.level_half_life)
    for _ in range(_pretrain_epochs(trace, model.n_his, min_windows)):
        fleet.clear()
        for t, batch in _steps(trace):
            ids = [series.container for series, _ in batch]
            frames = [[_usage_at(series, i).get(f, math.nan) for f in feats] for series, i in batch]
            fleet.step(t, ids, np.array(frames, dtype=np.float64))
            if tick is not None:
                tick()
    return model


@dataclass
class FleetDetail:
    """What :func:`fleet_sequences` can also tell, per container, for the report's plots."""

    #: resource -> True at the samples where the limit in force came from the fallback
    fallback: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: the phase id the detector gave each sample (-1: none yet)
    phases: dict[str, np.ndarray] = field(default_factory=dict)


def fleet_sequences(trace: Trace, learn_every: int = 1, options: FleetOptions | None = None,
                    detail: FleetDetail | None = None,
                    progress: TextIO | None = None) -> dict[str, list[tuple[float, Limits]]]:
    """The ``phase`` policy with ONE shared model for all containers (the live worker's code).

    :class:`~phasewise.models.phases.fleet.PhaseFleet` steps every container
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

    *detail*, when given, is filled for every container (see :class:`FleetDetail`). *progress*: a
    terminal stream for a progress bar over the event times stepped (pretraining passes included).
    """
    import inspect

    from phasewise.models.phases.detector import PhaseModel

    opts = options or FleetOptions(learn_every=learn_every)
    fb_out = detail if detail is not None else FleetDetail()
    if opts.pretrain_folds >= 2:
        folds = fold_of((c.container for c in trace.containers), opts.pretrain_folds)
        parts = []
        for f in sorted(set(folds.values())):
            mine = {c for c, g in folds.items() if g == f}
            parts.append((subtrace(trace, set(folds) - mine), subtrace(trace, mine)))
    else:
        parts = [(None, trace)]
    bar = _Progress(0, progress, label="phase model", unit="event times")
    if progress is not None:  # the work ahead, counted before it starts: the bar shows from the first second
        n_his = inspect.signature(PhaseModel).parameters["n_his"].default  # pretrain_model's model's
        bar.total = sum(_n_steps(run) + (0 if train is None else _pretrain_epochs(train, n_his) * _n_steps(train))
                        for train, run in parts)
    done = [0]

    def tick() -> None:
        done[0] += 1
        bar.update(done[0])

    bar.update(0)
    out: dict[str, list[tuple[float, Limits]]] = {}
    for train, run in parts:
        model = None if train is None else pretrain_model(train, opts, tick=tick)
        out.update(_fleet_run(run, opts, model, fb_out, tick=tick))
    return out


def _fleet_run(trace: Trace, opts: FleetOptions, model: Any, detail: FleetDetail | None = None,
               tick: Callable[[], None] | None = None) -> dict[str, list[tuple[float, Limits]]]:
    from phasewise.models.phases.detector import PhaseModel
    from phasewise.models.phases.features import FEATURES
    from phasewise.models.phases.fleet import PhaseFleet
    from phasewise.models.phases.limits import ReactiveFallback

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
        if tick is not None:
            tick()
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


class _Progress:
    """A one-line progress bar on a terminal stream; silent otherwise."""

    def __init__(self, total: int, stream: TextIO | None, label: str = "replay", unit: str = "containers") -> None:
        self.total, self.stream, self.label, self.unit = total, stream, label, unit
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
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} {self.unit}")
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
