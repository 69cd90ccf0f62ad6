"""Inference replica autoscaling from utilisation and a latency SLO, pure (DynamoML's auto-scaling
operator): Kubernetes HPA's rule (``ceil(replicas * util / target_util)`` outside a tolerance) with a
latency term (a p99 over the SLO asks for a replica; no scale-down near the SLO), clamped, in steps of
at most ``max_step``, with up and down cool-downs. Time comes in as ``now``. Narrative:
docs/priorities.md, "Inference autoscaling".

>>> a = Autoscaler(AutoscalerConfig(slo_p99_ms=100, min_replicas=1, max_replicas=4, up_cooldown_s=5,
...                                 down_cooldown_s=30))
>>> a.step(now=0, replicas=1, util=0.95, p99_ms=140).replicas
2
>>> a.step(now=2, replicas=2, util=0.95, p99_ms=140) is None     # inside the up cool-down
True
>>> a.step(now=40, replicas=2, util=0.1, p99_ms=10).replicas
1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Autoscaler", "AutoscalerConfig", "Scale"]


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    slo_p99_ms: float = 200.0
    target_util: float = 0.6
    tolerance: float = 0.1
    down_latency_fraction: float = 0.5
    min_replicas: int = 1
    max_replicas: int = 4
    max_step: int = 2
    up_step: int = 1
    up_cooldown_s: float = 5.0
    down_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if not (isinstance(self.min_replicas, int) and isinstance(self.max_replicas, int)
                and 0 <= self.min_replicas <= self.max_replicas):
            raise ValueError(f"need integers 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                             f"{self.max_replicas}")
        for name in ("slo_p99_ms", "target_util"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"AutoscalerConfig.{name} must be > 0, got {v!r}")
        for name in ("tolerance", "down_latency_fraction", "up_cooldown_s", "down_cooldown_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"AutoscalerConfig.{name} must be >= 0, got {v!r}")
        if self.max_step < 1 or self.up_step < 1:
            raise ValueError("AutoscalerConfig.max_step and up_step must be >= 1")


@dataclass(frozen=True, slots=True)
class Scale:
    """Change a service from ``current`` to ``replicas``, and why."""

    current: int
    replicas: int
    reason: str
    details: dict


class Autoscaler:
    """One service's scaler; its only state is the time of its last change."""

    VERSION = 1

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._last_change: float | None = None

    def desired(self, replicas: int, util: float | None, p99_ms: float | None) -> tuple[int, list[str]]:
        """The replica count the rule wants now, ignoring cool-downs, and the reasons."""
        c = self.config
        why: list[str] = []
        want = replicas
        if util is not None and math.isfinite(util) and replicas > 0:
            ratio = util / c.target_util
            if abs(ratio - 1.0) > c.tolerance:
                want = math.ceil(replicas * ratio - 1e-9)
                why.append(f"utilisation {util:.0%} vs target {c.target_util:.0%}")
        over = p99_ms is not None and math.isfinite(p99_ms) and p99_ms > c.slo_p99_ms
        if over and want < replicas + c.up_step:
            want = replicas + c.up_step
            why.append(f"p99 {p99_ms:.0f} ms > SLO {c.slo_p99_ms:g} ms")
        elif over:
            why.append(f"p99 {p99_ms:.0f} ms > SLO {c.slo_p99_ms:g} ms")
        if want < replicas:
            calm = p99_ms is None or (math.isfinite(p99_ms) and p99_ms <= c.down_latency_fraction * c.slo_p99_ms)
            if not calm:
                why.append(f"no scale-down: p99 {p99_ms:.0f} ms > {c.down_latency_fraction:g} x SLO")
                want = replicas
        want = max(c.min_replicas, min(c.max_replicas, want))
        want = max(replicas - c.max_step, min(replicas + c.max_step, want))
        return want, why

    def step(self, *, now: float, replicas: int, util: float | None, p99_ms: float | None) -> Scale | None:
        """A :class:`Scale` when the service should change now, else ``None``."""
        c = self.config
        want, why = self.desired(replicas, util, p99_ms)
        if replicas < c.min_replicas or replicas > c.max_replicas:  # bounds first, no cool-down
            want = max(c.min_replicas, min(c.max_replicas, replicas))
            why = [f"outside [{c.min_replicas}, {c.max_replicas}]"]
        elif want == replicas:
            return None
        else:
            since = math.inf if self._last_change is None else now - self._last_change
            cool = c.up_cooldown_s if want > replicas else c.down_cooldown_s
            if since < cool:
                return None
        self._last_change = now
        details = {"util": util, "p99_ms": p99_ms, "slo_p99_ms": c.slo_p99_ms, "target_util": c.target_util,
                   "min_replicas": c.min_replicas, "max_replicas": c.max_replicas}
        return Scale(replicas, want, f"scale {replicas} -> {want}: " + "; ".join(why), details)

    def to_state(self) -> dict:
        return {"v": self.VERSION, "last_change": self._last_change}

    @classmethod
    def from_state(cls, config: AutoscalerConfig, state: dict) -> Autoscaler:
        if state.get("v") != cls.VERSION:
            raise ValueError(f"Autoscaler state version {state.get('v')!r} is not {cls.VERSION}")
        a = cls(config)
        a._last_change = state["last_change"]
        return a
