"""Phase limits for one container (:class:`PhasePolicy`): the AI4DL limit policy behind the
:class:`~phasewise.models.policy.LimitPolicy` contract, running the live detector's step on a batch of one,
so replay and the worker agree on every phase. Pure. docs/phases.md, "Limits".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from importlib import resources as _res
from typing import Any

import numpy as np

from phasewise.models.phases.detector import PhaseModel, Windows, detect, learn
from phasewise.models.phases.features import FEATURES, PRETRAINED_MODELS
from phasewise.models.phases.fleet import phase_limits
from phasewise.models.policy import LimitPolicy, Limits, Usage

__all__ = ["PhasePolicy", "ReactiveFallback", "load_pretrained", "PRETRAINED", "PRETRAINED_AI4DL",
           "PRETRAINED_CORPUS", "pretrained_origin"]

#: file name (in ``phasewise/data/``) of the model pretrained on all 4 containers of the Apache-2.0
#: AI4DL sample (cpu, mem); how it was made: ``data/make_pretrained.py`` and PROVENANCE.md
PRETRAINED_AI4DL = "ai4dl_cpu_mem.pwck"
#: file name of the model pretrained on the train split of the shipped corpus (cpu, mem; the default)
PRETRAINED_CORPUS = "corpus_cpu_mem.pwck"
#: the shipped pretrained models by name (``phase_pretrained_model``), the default first
PRETRAINED = {"corpus": PRETRAINED_CORPUS, "ai4dl": PRETRAINED_AI4DL}
assert tuple(PRETRAINED) == PRETRAINED_MODELS
_ORIGIN = {
    "corpus": "phasewise's corpus, train split: 30 real executions of 5 kinds of training job, 1 s samples",
    "ai4dl": "AI4DL IBM DLaaS sample, Apache-2.0",
}


def pretrained_origin(name: str) -> str:
    """How a warm start from the shipped model *name* is described (``"pretrained FILE (what it saw)"``).

    >>> pretrained_origin("ai4dl")
    'pretrained ai4dl_cpu_mem.pwck (AI4DL IBM DLaaS sample, Apache-2.0)'
    """
    return f"pretrained {PRETRAINED[name]} ({_ORIGIN[name]})"


def load_pretrained(name: str = PRETRAINED_CORPUS) -> PhaseModel | None:
    """The shipped pretrained snapshot *name* (``phasewise/data/``), or ``None`` if it is not installed.

    A snapshot written by an older build raises ``CheckpointError`` (rebuild it with
    ``data/make_pretrained.py``) rather than being silently ignored.
    """
    try:
        data = (_res.files("phasewise") / "data" / name).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return None
    return PhaseModel.from_bytes(data)


class ReactiveFallback:
    """VPA for CPU and memory, a moving-window max for resources VPA does not cover.

    The default ``fallback`` of :class:`PhasePolicy`. Each resource's limit is
    the first non-``None`` answer of the policies, in order.

    Examples
    --------
    >>> fb = ReactiveFallback()
    >>> fb.observe(0.0, {"gpu": 40.0})
    >>> fb.limits(1.0)["gpu"]
    40.0
    """

    name = "vpa+window-max"

    def __init__(self, policies: list[LimitPolicy] | None = None) -> None:
        if policies is None:
            from phasewise.models.scoring.baselines import WindowPolicy
            from phasewise.models.vpa.recommender import VpaPolicy

            policies = [VpaPolicy(), WindowPolicy(window=30, stat="max", margin=1.0)]
        self.policies = policies
        self._last: Limits = {}

    def limits(self, t: float) -> Limits:
        out: Limits = {}
        for p in self.policies:
            for r, v in p.limits(t).items():
                if out.get(r) is None:
                    out[r] = v
        self._last = out
        return dict(out)

    def observe(self, t: float, usage: Usage) -> None:
        for p in self.policies:
            p.observe(t, usage)

    def explain(self) -> dict:
        return {"policies": [getattr(p, "name", type(p).__name__) for p in self.policies], "limits": self._last}


class PhasePolicy:
    """Per-container phase limits with a reactive fallback while the phase is unknown.

    Parameters
    ----------
    fallback
        Reactive :class:`LimitPolicy` used while cold / while the phase is new
        (``None``: :class:`ReactiveFallback`, VPA + moving-window max).
    floors
        Per-resource safety floors; no limit is ever set below them.
    model
        A :class:`PhaseModel` (or its bytes) to start from; it is cloned, the
        caller's copy is never modified. ``None``: the shipped AI4DL
        pretrained model when the container's resources are CPU and memory
        and ``pretrained`` is true, else a fresh model.
    pretrained
        Whether ``model=None`` may use the shipped pretrained model.
    pretrained_model
        Which one (:data:`PRETRAINED`: ``corpus``, the default, or ``ai4dl``).
    quantile, margin
        Limit = phase ``quantile`` x (1 + ``margin``).
    min_phase_samples
        A phase's statistics are used once they hold this many samples.
    change_threshold
        Within a phase, limits are re-set only when the quantile moved by
        more than this fraction.
    learn_every
        The CRBM learns every this many windows (normaliser and clusterer
        learn every window).
    learn
        ``False`` freezes the model: phases come from the given snapshot
        alone and no statistics change (a detector holding a published
        snapshot does the same).
    model_params
        Extra :class:`PhaseModel` arguments for a fresh model.

    Examples
    --------
    >>> class Const:  # any LimitPolicy works as the fallback
    ...     name = "const"
    ...     def limits(self, t): return {"cpu": 4.0, "mem": 8e9}
    ...     def observe(self, t, usage): pass
    ...     def explain(self): return {}
    >>> p = PhasePolicy(fallback=Const(), floors={"cpu": 0.1, "mem": 1e8}, pretrained=False,
    ...                 model_params={"warmup": 16})
    >>> p.limits(0.0)                                      # cold: the fallback's limits
    {'cpu': 4.0, 'mem': 8000000000.0}
    >>> for t in range(200):
    ...     busy = (t // 25) % 2 == 1
    ...     _ = p.limits(float(t))
    ...     p.observe(float(t), {"cpu": 1.0 if busy else 0.02, "mem": 9e8 if busy else 2e8})
    >>> p.explain()["source"]
    'phase'
    >>> p.limits(200.0)["cpu"] >= 0.1                      # never below the floor
    True
    """

    name = "phase"

    def __init__(
        self,
        fallback: LimitPolicy | None = None,
        floors: Mapping[str, float] | None = None,
        model: PhaseModel | bytes | None = None,
        pretrained: bool = True,
        pretrained_model: str = "corpus",
        quantile: float = 0.95,
        margin: float = 0.10,
        min_phase_samples: int = 10,
        change_threshold: float = 0.05,
        learn_every: int = 1,
        learn: bool = True,
        model_params: Mapping[str, Any] | None = None,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.fallback = fallback if fallback is not None else ReactiveFallback()
        self.floors = dict(floors or {})
        self.model = model
        self.pretrained = pretrained
        if pretrained_model not in PRETRAINED:
            raise ValueError(f"pretrained_model must be one of {sorted(PRETRAINED)}, got {pretrained_model!r}")
        self.pretrained_model = pretrained_model
        self.quantile = float(quantile)
        self.margin = float(margin)
        self.min_phase_samples = int(min_phase_samples)
        self.change_threshold = float(change_threshold)
        self.learn_every = max(1, int(learn_every))
        self.learn = bool(learn)
        self.model_params = dict(model_params or {})
        self.warm_start: str = "none (model built on first observation)"
        self._model: PhaseModel | None = None
        self._windows: Windows | None = None
        self._phase = -1
        self._since = 0.0
        self._n_windows = 0
        self._limits: Limits = {}
        self._basis: dict[str, float] = {}  # phase quantile behind each phase-set limit
        self._limit_phase = -1
        self._source: dict[str, str] = {}
        self._stats_used: dict[str, Any] = {}

    # ------------------------------------------------------------------ model
    def _build(self, usage: Usage) -> PhaseModel:
        feats = tuple(f for f in FEATURES if f in usage)
        if not feats:
            raise ValueError(f"usage has none of the phase features {list(FEATURES)}: {sorted(usage)}")
        m: PhaseModel | None = None
        if isinstance(self.model, (bytes, bytearray)):
            m = PhaseModel.from_bytes(bytes(self.model))
            self.warm_start = "model given as bytes"
        elif isinstance(self.model, PhaseModel):
            m = self.model.clone()
            self.warm_start = "model given"
        elif self.pretrained and feats == ("cpu", "mem"):
            m = load_pretrained(PRETRAINED[self.pretrained_model])
            if m is not None:
                self.warm_start = pretrained_origin(self.pretrained_model)
        if m is None:
            m = PhaseModel(features=feats, **self.model_params)
            self.warm_start = "cold (fresh model)"
        return m

    @property
    def phase_model(self) -> PhaseModel | None:
        """This container's model (``None`` before the first observation)."""
        return self._model

    # ------------------------------------------------------------------ contract
    def observe(self, t: float, usage: Usage) -> None:
        self.fallback.observe(t, usage)
        if self._model is None:
            self._model = self._build(usage)
            self._windows = Windows(self._model.window_len, self._model.n_features, capacity=1)
        m, w = self._model, self._windows
        assert w is not None
        frame = np.array([[usage.get(f, math.nan) for f in m.features]], dtype=np.float64)
        frame = np.where(np.isfinite(frame), np.maximum(frame, 0.0), np.nan)
        res = detect(m, w, ["c"], frame, t)
        # credit this step's usage to the phase that was in force for it
        prev = int(res.prev_phase[0])
        if res.ready[0]:
            self._n_windows += 1
        if res.ready[0] and self.learn:
            crbm_turn = self._n_windows % self.learn_every == 0
            win = res.windows[:1]
            if crbm_turn:
                learn(m, win, stats_phases=res.prev_phase, usage=frame)
            else:
                m.normalizer.learn_many(win[:, -1, :])
                if m.crbm.n_seen >= m.warmup:
                    z = m.normalizer.transform_many(win).reshape(1, -1).astype(np.float32)
                    m.clusterer.learn_many(m.crbm.predict_many(z))
                if prev >= 0:
                    m.clusterer.update_stats(res.prev_phase, frame)
        phase = int(res.phase[0])
        if phase != self._phase and phase >= 0:
            self._since = float(res.since[0])
        self._phase = phase

    def limits(self, t: float) -> Limits:
        fb = self.fallback.limits(t)
        m = self._model
        out: Limits = {}
        source: dict[str, str] = {}
        stats_used: dict[str, Any] = {}
        phase = self._phase
        slot = -1
        if m is not None and m.ready and phase >= 0:
            slot = int(m.clusterer.slots_of(np.array([phase]))[0])
        q = None
        counts = None
        if slot >= 0:
            q = m.clusterer.stats.quantiles(slot, (self.quantile,))[0]
            counts = m.clusterer.stats.count(slot)
        resources = list(dict.fromkeys([*fb.keys(), *(m.features if m is not None else ())]))
        feats = m.features if m is not None else ()
        if feats:  # the fleet's limit rule, on this one container's row
            R = len(feats)
            lim, basis, from_phase, _ = phase_limits(
                (q if q is not None else np.full(R, np.nan))[None],
                (counts if counts is not None else np.zeros(R))[None],
                np.array([phase]), np.array([slot >= 0]),
                np.array([[self._basis.get(r, np.nan) for r in feats]]), np.array([self._limit_phase]),
                np.array([[self._source.get(r) == "phase" for r in feats]]),
                np.full((1, R), np.nan),  # the fallback is applied below, for every resource alike
                np.array([[float(self.floors.get(r, 0.0)) for r in feats]]),
                margin=self.margin, min_phase_samples=self.min_phase_samples,
                change_threshold=self.change_threshold,
            )
        for r in resources:
            i = feats.index(r) if r in feats else -1
            if i >= 0 and from_phase[0, i]:
                out[r] = float(lim[0, i])
                source[r] = "phase"
                self._basis[r] = float(basis[0, i])
                stats_used[r] = {
                    f"p{round(self.quantile * 100)}": float(q[i]),
                    "count": int(counts[i]),
                    "basis": float(basis[0, i]),
                }
                continue
            v = fb.get(r)
            out[r] = None if v is None else max(float(v), float(self.floors.get(r, 0.0)))
            source[r] = "fallback"
            self._basis.pop(r, None)
        self._limit_phase = phase if slot >= 0 else -1
        self._limits = out
        self._source = source
        self._stats_used = stats_used
        return dict(out)

    def explain(self) -> dict:
        m = self._model
        return {
            "phase": self._phase if self._phase >= 0 else None,
            "since": self._since,
            "source": "phase" if "phase" in self._source.values() else "fallback",
            "sources": dict(self._source),
            "limits": dict(self._limits),
            "quantile": self.quantile,
            "margin": self.margin,
            "stats": dict(self._stats_used),
            "phases_open": m.clusterer.phase_ids if m is not None else [],
            "windows_seen": self._n_windows,
            "warm": bool(m is not None and m.ready),
            "warm_start": self.warm_start,
            "fallback": self.fallback.explain() if "fallback" in self._source.values() else None,
        }
