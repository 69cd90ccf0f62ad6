"""The worker's settings as the pure models' configurations.

The decision logic in :mod:`phasewise.models` reads no settings: it takes
small frozen configurations (:class:`~phasewise.models.vpa_updater.UpdaterConfig`,
:class:`~phasewise.models.guard.GuardConfig`, the recommender's parameters,
:class:`~phasewise.models.phase_updater.DetectorConfig`) and a starting
model. This module builds them from a :class:`~phasewise.settings.Settings`
for the agents, replay and the tests. No Faust: importing it starts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phasewise.models.detector import PhaseModel
from phasewise.models.guard import GuardConfig
from phasewise.models.phase_updater import DetectorConfig
from phasewise.models.vpa_updater import StateCache, UpdaterConfig
from phasewise.settings import Settings

__all__ = ["detector_config", "guard_config", "initial_model", "recommender_params", "state_cache",
           "updater_config"]


def recommender_params(settings: Settings) -> dict[str, Any]:
    """Constructor arguments of every container's recommender, from settings."""
    return {
        "time_scale": settings.vpa_time_scale,
        "min_cpu_cores": settings.vpa_min_cpu_cores,
        "min_mem_bytes": float(settings.vpa_min_mem_bytes),
        "throttle_threshold": settings.vpa_throttle_threshold,
        "throttle_bump": settings.vpa_throttle_bump,
    }


def guard_config(settings: Settings) -> GuardConfig | None:
    """The safety rules' parameters from settings (``None``: ``safety_rules`` off)."""
    if not settings.safety_rules:
        return None
    return GuardConfig(
        min_history_s=settings.safety_min_history_s, cooldown_s=settings.safety_cooldown_s,
        max_decrease=settings.safety_max_decrease, peak_window_s=settings.safety_peak_window_s,
        mem_margin_bytes=float(settings.mem_margin_bytes), throttle_threshold=settings.vpa_throttle_threshold,
        # a throttled container's CPU samples are censored: no CPU cut until a cooldown of them is not
        throttle_window_s=settings.safety_cooldown_s,
    )


def updater_config(settings: Settings) -> UpdaterConfig:
    """The VPA updater's rule from settings (its decisions are emitted under ``--policy vpa``)."""
    return UpdaterConfig(
        recommend_interval_s=settings.recommend_interval_s, hysteresis=settings.hysteresis,
        update_mode=settings.vpa_update_mode, state_write_interval_s=settings.state_write_interval_s,
        worker_id=settings.worker_id, emits_decisions=settings.policy != "phase",
    )


def state_cache(settings: Settings, loader: Callable[[str], Any] | None = None) -> StateCache:
    """The VPA updater's per-container state, configured from settings; *loader*: see :class:`StateCache`."""
    return StateCache(recommender_params(settings), loader, guard_config(settings))


def detector_config(settings: Settings) -> DetectorConfig:
    """The phase detectors' parameters from settings (``phase_ratio_cap`` 0: no cap)."""
    return DetectorConfig(
        min_cpu_cores=settings.vpa_min_cpu_cores, min_mem_bytes=float(settings.vpa_min_mem_bytes),
        learn_every=settings.phase_learn_every, learn_batch=settings.phase_learn_batch,
        statistics=settings.phase_statistics, state_write_interval_s=settings.state_write_interval_s,
        ratio_cap=settings.phase_ratio_cap or None,
    )


def initial_model(settings: Settings) -> tuple[PhaseModel, str]:
    """The shipped pretrained model when its features match (and ``phase_pretrained``), else a cold one;
    with where it came from."""
    features = settings.phase_feature_tuple()
    try:
        from phasewise.models.phase_policy import PRETRAINED_AI4DL, load_pretrained
    except ImportError:  # the policy module is optional for the live path
        load_pretrained = None  # type: ignore[assignment]
    if not settings.phase_pretrained:
        load_pretrained = None  # type: ignore[assignment]
    if load_pretrained is not None:
        m = load_pretrained()
        if m is not None and m.features == features:
            return m, f"pretrained {PRETRAINED_AI4DL}"
    return PhaseModel(features=features, warmup=settings.phase_warmup), "cold"
