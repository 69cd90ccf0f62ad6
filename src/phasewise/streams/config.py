"""The worker's settings as the pure models' configurations.

The decision logic in :mod:`phasewise.models` reads no settings: it takes
small frozen configurations (:class:`~phasewise.models.vpa.updater.UpdaterConfig`,
:class:`~phasewise.models.safety.guard.GuardConfig`, the recommender's parameters,
:class:`~phasewise.models.phases.updater.DetectorConfig`) and a starting
model. This module builds them from a :class:`~phasewise.kit.settings.Settings`
for the agents, replay and the tests. No Faust: importing it starts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phasewise.kit.settings import PhaseSettings, Settings
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.updater import DetectorConfig
from phasewise.models.safety.guard import GuardConfig
from phasewise.models.safety.intake import IntakeConfig
from phasewise.models.vpa.updater import StateCache, UpdaterConfig

__all__ = ["detector_config", "guard_config", "initial_model", "intake_config", "recommender_params",
           "state_cache", "updater_config"]


def recommender_params(settings: Settings) -> dict[str, Any]:
    """Constructor arguments of every container's recommender, from settings."""
    return {
        "time_scale": settings.vpa.time_scale,
        "min_cpu_cores": settings.vpa.min_cpu_cores,
        "min_mem_bytes": float(settings.vpa.min_mem_bytes),
        "throttle_threshold": settings.vpa.throttle_threshold,
        "throttle_bump": settings.vpa.throttle_bump,
    }


def intake_config(settings: Settings) -> IntakeConfig:
    """What the samples agent admits (event time, capacity), from the ``intake_*`` settings."""
    i = settings.intake
    return IntakeConfig(max_future_s=i.max_future_s, max_behind_s=i.max_behind_s,
                        max_per_message=i.max_containers_per_message, max_per_host=i.max_containers_per_host,
                        max_per_worker=i.max_containers_per_worker, host_active_s=i.host_active_s)


def guard_config(settings: Settings) -> GuardConfig | None:
    """The safety rules' parameters from settings (``None``: ``safety_rules`` off)."""
    if not settings.safety.rules:
        return None
    safety = settings.safety
    return GuardConfig(
        min_history_s=safety.min_history_s, cooldown_s=safety.cooldown_s,
        max_decrease=safety.max_decrease, peak_window_s=safety.peak_window_s,
        # the actuator's margin: the rules' peak floor is the floor the actuator keeps
        mem_margin_bytes=float(settings.actuator.mem_margin_bytes),
        throttle_threshold=settings.vpa.throttle_threshold,
        # a throttled container's CPU samples are censored: no CPU cut until a cooldown of them is not
        throttle_window_s=safety.cooldown_s,
    )


def updater_config(settings: Settings) -> UpdaterConfig:
    """The VPA updater's rule from settings (its decisions are emitted for the containers decided with
    ``vpa``: the worker's ``--policy`` unless their workload names another)."""
    worker = settings.worker
    return UpdaterConfig(
        recommend_interval_s=worker.recommend_interval_s, hysteresis=worker.hysteresis,
        update_mode=settings.vpa.update_mode, state_write_interval_s=worker.state_write_interval_s,
        worker_id=worker.id, default_policy=worker.policy,
    )


def state_cache(settings: Settings, loader: Callable[[str], Any] | None = None) -> StateCache:
    """The VPA updater's per-container state, configured from settings; *loader*: see :class:`StateCache`."""
    return StateCache(recommender_params(settings), loader, guard_config(settings))


def detector_config(settings: Settings) -> DetectorConfig:
    """The phase detectors' parameters from settings (``phase_ratio_cap`` 0: no cap)."""
    phase = settings.phase
    return DetectorConfig(
        min_cpu_cores=settings.vpa.min_cpu_cores, min_mem_bytes=float(settings.vpa.min_mem_bytes),
        learn_every=phase.learn_every, learn_batch=phase.learn_batch, statistics=phase.statistics,
        state_write_interval_s=settings.worker.state_write_interval_s,
        ratio_cap=PhaseSettings.cap(phase.ratio_cap), default_policy=settings.worker.policy,
    )


def initial_model(settings: Settings) -> tuple[PhaseModel, str]:
    """The shipped pretrained model when its features match (and ``phase_pretrained``), else a cold one;
    with where it came from."""
    features = settings.phase.feature_tuple()
    try:
        from phasewise.models.phases.limits import PRETRAINED_AI4DL, load_pretrained
    except ImportError:  # the policy module is optional for the live path
        load_pretrained = None  # type: ignore[assignment]
    if not settings.phase.pretrained:
        load_pretrained = None  # type: ignore[assignment]
    if load_pretrained is not None:
        m = load_pretrained()
        if m is not None and m.features == features:
            return m, f"pretrained {PRETRAINED_AI4DL}"
    return PhaseModel(features=features, warmup=settings.phase.warmup), "cold"
