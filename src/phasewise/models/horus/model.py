"""Horus, online: a job's utilisation predicted from its graph features, learned from every job observed.

:class:`HorusModel` predicts four targets (GPU utilisation, GPU memory, CPU cores, host memory) on the
log scale as a residual over a prior (for GPU utilisation the roofline of
:mod:`~phasewise.models.horus.roofline`), by two river regressors on standardised features (for a family it
has not learned, the device's mean residual only), with a conformal interval per novelty; its state is the
observations themselves, replayed by :meth:`HorusModel.from_state`. Narrative: docs/horus.md, "The model".

>>> from phasewise.models.horus.graph_features import catalog_features
>>> m = HorusModel(HorusConfig(coverage=0.8))
>>> f = catalog_features("ppo_mlp", "lunarlander", 64, False)
>>> p0 = m.predict_one(f)
>>> m.learn_one(f, {"cpu_cores": 1.0, "mem_bytes": 3e8})
>>> m.predict_one(f)["cpu_cores"].mean
1.0
>>> m.jobs, HorusModel.from_state(m.to_state(), m.config).predict_one(f) == m.predict_one(f)
(1, True)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from river import linear_model, neighbors, preprocessing, stats

from phasewise.models.horus import roofline
from phasewise.models.horus.families import family
from phasewise.models.horus.graph_features import GraphFeatures

__all__ = ["HorusConfig", "HorusModel", "Estimate", "TARGETS", "feature_vector", "transfer_vector", "prior",
           "HorusStateError"]

TARGETS = ("gpu_util", "gpu_mem_bytes", "cpu_cores", "mem_bytes")
STATE_VERSION = 1
#: how new a job is to the model: of a family it has not learned, of a model it has not, or neither
NOVELTY = ("family", "model", "seen")
_FALLBACK = {"family": ("family", "model", "seen"), "model": ("model", "family", "seen"),
             "seen": ("seen", "model", "family")}
_MIB = 2**20


class HorusStateError(ValueError):
    """A state that cannot be restored; ``str(e)`` says why."""


@dataclass(frozen=True, slots=True)
class HorusConfig:
    """The model's parameters; ``coverage`` comes from the ``horus_coverage`` setting, which holds its default
    (docs/architecture.md, "Defaults")."""

    coverage: float  #: nominal probability that [lo, hi] holds the observed value
    neighbors: int = 5
    blr_alpha: float = 1.0  #: prior precision of the Bayesian linear regression's weights
    blr_beta: float = 10.0  #: its noise precision (on log-scale residuals)
    residual_window: int = 200
    min_residuals: int = 5
    default_spread: float = 1.0  #: log-scale half-width before min_residuals errors (x e = 2.7)
    max_observations: int = 2000
    cpu_cores_prior: float = 1.0
    gpu_runtime_bytes: float = 1200.0 * _MIB  #: CUDA context, cuDNN/cuBLAS and allocator slack beside the step
    host_runtime_bytes: float = 700.0 * _MIB  #: a torch process's own resident memory beside a GPU
    cpu_runtime_bytes: float = 300.0 * _MIB  #: a bare torch process's resident memory (device "cpu")

    def __post_init__(self) -> None:
        if not 0 < self.coverage < 1:
            raise ValueError(f"coverage must be in (0, 1), got {self.coverage}")
        if self.neighbors < 1 or self.residual_window < 1 or self.max_observations < 1:
            raise ValueError("neighbors, residual_window and max_observations must be positive")


@dataclass(frozen=True, slots=True)
class Estimate:
    mean: float
    lo: float
    hi: float


def _l(x: float) -> float:
    return math.log1p(max(0.0, float(x)))


def feature_vector(f: GraphFeatures | Mapping[str, Any], device: str | None = None) -> dict[str, float]:
    """The model's inputs: log-scaled sizes and counts of the graph, and the device type one-hot."""
    g = f.to_dict() if isinstance(f, GraphFeatures) else dict(f)
    batch = max(1, int(g["batch_size"]))
    touched = g["activation_bytes"] + g["param_bytes"]
    x = {
        "flops": _l(g["flops"]), "flops_per_sample": _l(g["flops"] / batch), "params": _l(g["params"]),
        "activations": _l(g["activation_bytes"]), "train_mem": _l(g["train_mem_bytes"]), "batch": _l(batch),
        "intensity": _l(g["flops"] / max(1, touched)), "depth": _l(g["depth"]), "input": _l(g["input_elements"]),
        "amp": float(bool(g["amp"])),
    }
    for kind in ("conv", "linear", "recurrent", "attention", "norm", "embedding"):
        x[kind] = _l(g[kind])
    if device:
        x[f"device={device.lower()}"] = 1.0
    return x


_MIX = ("conv", "linear", "recurrent", "attention", "norm", "embedding")


def transfer_vector(f: GraphFeatures | Mapping[str, Any], device: str | None = None) -> dict[str, float]:
    """The GPU-utilisation residual's inputs, chosen to mean the same across architectures: the analytic prior's
    step times and their balance (:mod:`~phasewise.models.horus.roofline`), arithmetic intensity, FLOPs per
    kernel, parameters x batch, the layer mix as fractions, AMP and the device type."""
    g = f.to_dict() if isinstance(f, GraphFeatures) else dict(f)
    t = roofline.step_times(g, device)
    moved = 3.0 * g["activation_bytes"] + 5.0 * g["param_bytes"] + 2.0 * g["optimizer_bytes"]
    kernels = t["kernels"] / roofline.KERNEL_S
    layers = sum(float(g[k]) for k in _MIX) or 1.0
    x = {
        "gpu_over_host": math.log(t["gpu"] / t["host"]), "compute_share": t["compute"] / t["gpu"],
        "memory_share": t["memory"] / t["gpu"], "log_gpu_s": math.log10(t["gpu"]),
        "intensity": math.log10(1.0 + g["flops"] / max(1.0, moved)), "kernels": math.log10(1.0 + kernels),
        "flops_per_kernel": math.log10(1.0 + g["flops"] / kernels),
        "params_x_batch": math.log10(1.0 + g["params"] * max(1, int(g["batch_size"]))),
        "amp": float(bool(g["amp"])),
    }
    for k in _MIX:
        x[f"mix_{k}"] = float(g[k]) / layers
    if device:
        x[f"device={device.lower()}"] = 1.0
    return x


def prior(target: str, f: Mapping[str, Any], cfg: HorusConfig, device: str | None = None) -> float:
    """What the model says of *target* before it has observed any job (natural units).

    Host memory of a job training on the CPU (*device* ``"cpu"``) holds what
    its step holds (weights, gradients, optimizer state, activations); beside a
    GPU it holds the runtime, the weights once more and a couple of batches.
    """
    if target == "gpu_util":
        return min(100.0, max(1.0, roofline.utilisation(f, device)))
    if target == "cpu_cores":
        return cfg.cpu_cores_prior
    if target == "gpu_mem_bytes":
        return f["train_mem_bytes"] + cfg.gpu_runtime_bytes
    if device is not None and device.lower() == "cpu":
        return cfg.cpu_runtime_bytes + f["train_mem_bytes"]
    return cfg.host_runtime_bytes + f["param_bytes"] + 8 * f["input_elements"] * f["batch_size"]


class _Target:
    """One target: residual learners, running mean residual, conformal errors."""

    def __init__(self, cfg: HorusConfig) -> None:
        # exact search over the last max_observations jobs: river's default engine is approximate,
        # unseeded (predictions varied from run to run) and keeps only 1,000
        self.knn = preprocessing.StandardScaler() | neighbors.KNNRegressor(
            n_neighbors=cfg.neighbors, engine=neighbors.LazySearch(window_size=cfg.max_observations))
        self.blr = preprocessing.StandardScaler() | linear_model.BayesianLinearRegression(
            alpha=cfg.blr_alpha, beta=cfg.blr_beta)
        self.mean = stats.Mean()
        self.by_device: dict[str, stats.Mean] = {}
        #: absolute log errors of the jobs learned, by how new each job was when predicted (Mondrian
        #: conformal: a job of a family never seen gets the spread of the errors on such jobs)
        self.errors: dict[str, deque[float]] = {k: deque(maxlen=cfg.residual_window) for k in NOVELTY}

    def residual(self, x: dict[str, float], novelty: str, device: str | None) -> float:
        """The log-scale residual over the prior: the mean residual of *device*'s jobs (of all jobs before
        any of it), plus, for a family already learned, what the learners make of *x*: they fit the
        families they saw and do not carry to a new one (docs/horus.md, "Across architectures")."""
        if self.mean.n == 0:
            return 0.0
        dev = self.by_device.get((device or "").lower())
        base = dev.get() if dev is not None and dev.n >= 3 else self.mean.get()
        if novelty == "family":
            return base
        return base + 0.5 * ((self.knn.predict_one(x) or 0.0) + (self.blr.predict_one(x) or 0.0))

    def learn(self, x: dict[str, float], r: float, device: str | None) -> None:
        self.mean.update(r)
        self.by_device.setdefault((device or "").lower(), stats.Mean()).update(r)
        c = r - self.mean.get()
        self.knn.learn_one(x, c)
        self.blr.learn_one(x, c)


class HorusModel:
    """Predicts a job's four utilisation targets from its graph features; learns from observed jobs."""

    def __init__(self, config: HorusConfig) -> None:
        self.config = config
        self._targets = {t: _Target(self.config) for t in TARGETS}
        self._obs: deque[tuple[dict, dict, str | None]] = deque(maxlen=self.config.max_observations)
        self._seen: set[str] = set()
        self._families: set[str] = set()
        self._jobs = 0

    @property
    def jobs(self) -> int:
        """Jobs learned from (the predictions' ``model_version``)."""
        return self._jobs

    def seen(self, model: str) -> bool:
        """Whether a job of *model* (canonical name) was learned from."""
        return model in self._seen

    def novelty(self, model: str) -> str:
        """How new a job of *model* (canonical name) is: one of :data:`NOVELTY`."""
        if model in self._seen:
            return "seen"
        return "model" if family(model) in self._families else "family"

    def observations(self, target: str) -> int:
        return self._targets[target].mean.n

    def _spread(self, target: str, novelty: str) -> float:
        pools = self._targets[target].errors
        errs = next((pools[k] for k in _FALLBACK[novelty] if len(pools[k]) >= self.config.min_residuals), None)
        if errs is None:
            return self.config.default_spread
        s = sorted(errs)
        k = min(len(s) - 1, math.ceil(self.config.coverage * (len(s) + 1)) - 1)
        return s[k]

    def _log_mean(self, target: str, g: Mapping[str, Any], x: dict[str, float], xt: dict[str, float],
                  device: str | None) -> float:
        return _l(prior(target, g, self.config, device)) + self._targets[target].residual(
            xt if target == "gpu_util" else x, self.novelty(str(g.get("model"))), device)

    def predict_one(self, f: GraphFeatures | Mapping[str, Any], device: str | None = None) -> dict[str, Estimate]:
        """``{target: Estimate(mean, lo, hi)}`` in natural units (percent, bytes, cores)."""
        g = f.to_dict() if isinstance(f, GraphFeatures) else f
        x = feature_vector(g, device)
        xt = {**x, **transfer_vector(g, device)}
        novelty = self.novelty(str(g.get("model")))
        out = {}
        for t in TARGETS:
            m = self._log_mean(t, g, x, xt, device)
            s = self._spread(t, novelty)
            hi = math.expm1(m + s)
            if t == "gpu_util":
                hi = min(hi, 100.0)
            out[t] = Estimate(mean=max(0.0, math.expm1(m)), lo=max(0.0, math.expm1(m - s)), hi=max(0.0, hi))
        if out["gpu_util"].mean > 100.0:
            e = out["gpu_util"]
            out["gpu_util"] = Estimate(100.0, min(e.lo, 100.0), 100.0)
        return out

    def learn_one(self, f: GraphFeatures | Mapping[str, Any], observed: Mapping[str, float],
                  device: str | None = None) -> None:
        """Learn one observed job: *observed* holds the targets measured (any subset of :data:`TARGETS`)."""
        g = f.to_dict() if isinstance(f, GraphFeatures) else dict(f)
        obs = {t: float(v) for t, v in observed.items() if t in self._targets and v is not None
               and math.isfinite(float(v)) and float(v) >= 0}
        if not obs:
            return
        self._learn(g, obs, device)
        self._obs.append((g, obs, device))

    def _learn(self, g: dict, obs: dict[str, float], device: str | None) -> None:
        x = feature_vector(g, device)
        xt = {**x, **transfer_vector(g, device)}
        novelty = self.novelty(str(g.get("model")))
        for t, y in obs.items():
            ly = _l(y)
            tgt = self._targets[t]
            tgt.errors[novelty].append(abs(ly - self._log_mean(t, g, x, xt, device)))
            tgt.learn(xt if t == "gpu_util" else x, ly - _l(prior(t, g, self.config, device)), device)
        self._seen.add(str(g.get("model")))
        self._families.add(family(str(g.get("model"))))
        self._jobs += 1

    # ------------------------------------------------------------------ state

    def to_state(self) -> dict[str, Any]:
        """JSON-able state: the observations kept (replayed on restore) and the job count."""
        return {"v": STATE_VERSION, "jobs": self._jobs,
                "obs": [[g, o, d] for g, o, d in self._obs]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], config: HorusConfig) -> HorusModel:
        """The model *state* describes (its observations replayed in order)."""
        if not isinstance(state, Mapping) or state.get("v") != STATE_VERSION:
            got = state.get("v") if isinstance(state, Mapping) else type(state).__name__
            raise HorusStateError(f"unsupported Horus state version {got!r} (this build reads v{STATE_VERSION})")
        m = cls(config)
        try:
            for g, o, d in state["obs"]:
                m._learn(dict(g), {t: float(v) for t, v in o.items()}, d)
                m._obs.append((dict(g), dict(o), d))
            m._jobs = int(state["jobs"])
        except (KeyError, TypeError, ValueError) as e:
            raise HorusStateError(f"Horus state is malformed: {type(e).__name__}: {e}") from None
        return m
