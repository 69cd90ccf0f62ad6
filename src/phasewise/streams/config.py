"""The roles' settings as the pure models' configurations (settings -> configs, nowhere else).

The decision logic in :mod:`phasewise.models` reads no settings: it takes small frozen configurations
(the VPA updater's, the safety rules', the phase detectors', the placement, priority, targets and Horus
steps') and a starting model; this module builds them from a :class:`~phasewise.kit.settings.Settings`
for the agents, replay, the benchmarks and the tests. No Faust: importing it starts nothing. The
settings themselves: docs/configuration.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phasewise.kit.records import JobEvent
from phasewise.kit.settings import PhaseSettings, Settings
from phasewise.kit.topics import JOB_EVENTS
from phasewise.models.jobs.autoscaler import AutoscalerConfig, AutoscaleStepConfig
from phasewise.models.jobs.placement.cluster import PlacementConfig
from phasewise.models.jobs.placement.state import PlacementStateConfig
from phasewise.models.jobs.priorities import Capacity, PriorityConfig
from phasewise.models.jobs.priority_step import PriorityStepConfig
from phasewise.models.jobs.submissions import Submissions
from phasewise.models.jobs.targets import TargetsConfig
from phasewise.models.jobs.targets_step import TargetsStepConfig
from phasewise.models.priors.book import PriorBook, PriorConfig
from phasewise.models.safety.guard import GuardConfig
from phasewise.models.safety.intake import IntakeConfig
from phasewise.models.vpa.state import StateCache
from phasewise.models.vpa.updater import UpdaterConfig

if TYPE_CHECKING:  # (river: imported by the horus role alone; torch by the phase detector alone)
    from phasewise.models.horus.state import HorusStateConfig
    from phasewise.models.phases.detector import PhaseModel
    from phasewise.models.phases.updater import DetectorConfig

__all__ = ["autoscale_step_config", "detector_config", "guard_config", "horus_state_config", "initial_model",
           "intake_config", "job_partitions", "parse_local_nodes", "placement_state_config", "prior_config",
           "priority_step_config", "recommender_params", "samples_partitions", "state_cache", "submissions",
           "targets_step_config", "updater_config"]


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
        # a signed run's prior stands in for the history the safety rules ask of it (none without the rules)
        prior_until_s=settings.safety.min_history_s if settings.safety.rules and worker.prior_min_runs else 0.0,
        profile_interval_s=worker.prior_profile_interval_s,
    )


def prior_config(settings: Settings) -> PriorConfig:
    """The known-job priors' rule from settings (``prior_min_runs`` 0: off)."""
    worker = settings.worker
    return PriorConfig(min_runs=worker.prior_min_runs, margin=worker.prior_margin,
                       min_run_s=worker.prior_min_run_s, keep=max(8, worker.prior_min_runs))


def state_cache(settings: Settings, loader: Callable[[str], Any] | None = None) -> StateCache:
    """The VPA updater's per-container state, configured from settings; *loader*: see :class:`StateCache`."""
    priors = PriorBook(prior_config(settings)) if settings.worker.prior_min_runs else None
    return StateCache(recommender_params(settings), loader, guard_config(settings), priors)


def detector_config(settings: Settings) -> DetectorConfig:
    """The phase detectors' parameters from settings (``phase_ratio_cap`` 0: no cap)."""
    from phasewise.models.phases.transitions import TransitionConfig
    from phasewise.models.phases.updater import DetectorConfig

    phase = settings.phase
    return DetectorConfig(
        min_cpu_cores=settings.vpa.min_cpu_cores, min_mem_bytes=float(settings.vpa.min_mem_bytes),
        learn_every=phase.learn_every, learn_batch=phase.learn_batch, statistics=phase.statistics,
        state_write_interval_s=settings.worker.state_write_interval_s,
        ratio_cap=PhaseSettings.cap(phase.ratio_cap), default_policy=settings.worker.policy,
        margins={"cpu": phase.cpu_margin, "mem": phase.mem_margin},
        anticipate=TransitionConfig(horizon_s=phase.anticipate_horizon_s,
                                    min_probability=phase.anticipate_min_probability,
                                    min_exits=phase.anticipate_min_exits,
                                    keep=max(32, phase.anticipate_min_exits)),
        prior_until_s=(settings.safety.min_history_s if settings.safety.rules and settings.worker.prior_min_runs
                       else 0.0),
    )


def initial_model(settings: Settings) -> tuple[PhaseModel, str]:
    """The shipped pretrained model ``phase_pretrained_model`` when its features match (and
    ``phase_pretrained``), else a cold one; with where it came from."""
    from phasewise.models.phases.detector import PhaseModel

    features = settings.phase.feature_tuple()
    if settings.phase.pretrained:
        from phasewise.models.phases.limits import PRETRAINED, load_pretrained

        name = settings.phase.pretrained_model
        m = load_pretrained(PRETRAINED[name])
        if m is not None and m.features == features:
            return m, f"pretrained {PRETRAINED[name]}"
    return PhaseModel(features=features, warmup=settings.phase.warmup), "cold"


# -- the job roles ---------------------------------------------------------------------------------

def samples_partitions(settings: Settings) -> int:
    """The samples topic's real partition count, asked of the broker (the state tables and the horus routes
    must match it); the configured one where the broker does not say."""
    from phasewise.kit.kafka.client import make_admin
    from phasewise.kit.topics import SAMPLES

    md = make_admin(settings).list_topics(SAMPLES.name, timeout=10)
    t = md.topics.get(SAMPLES.name)
    if t is None or t.error is not None or not t.partitions:
        return settings.kafka.topic_partitions or SAMPLES.partitions
    return len(t.partitions)


def job_partitions(settings: Settings) -> int:
    """The job-events topic's partition count (the job agents' tables are co-partitioned with it)."""
    return settings.kafka.topic_partitions or JOB_EVENTS.partitions


def submissions(settings: Settings) -> Submissions:
    """A submitted event's start details and, with ``job_trusted_submitters``, the trusted submitters'
    check (their key files read again when they change)."""
    from phasewise.kit.job_signing import start_details, trusted_submitters

    keys = trusted_submitters(settings.jobs.trusted_submitters)
    if keys is None:
        return Submissions(start_details)

    def check(event: JobEvent) -> str | None:
        keys.refresh()
        return keys.verify_event(event)

    return Submissions(start_details, check)


def parse_local_nodes(text: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """``place_local_nodes`` ``s0=0-1@0;s1=2-3`` -> ((name, cpuset, gpu indices), ...) (the setting's
    check ran already).

    >>> parse_local_nodes("s0=0-1@0;s1=2,4")
    (('s0', '0-1', (0,)), ('s1', '2,4', ()))
    """
    out = []
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        name, rest = part.split("=", 1)
        cpus, _, gpus = rest.partition("@")
        out.append((name, cpus, tuple(int(g) for g in gpus.split(",")) if gpus else ()))
    return tuple(out)


def placement_state_config(settings: Settings, partitions: int | None = None) -> PlacementStateConfig:
    """The placement agent's parameters from the ``place_*`` settings (and, after admission, the priority
    agent's CPU weight rule); *partitions*: the job-events topic's (default: :func:`job_partitions`)."""
    p, pr = settings.place, settings.priority
    return PlacementStateConfig(
        host=settings.host, policy=p.policy,
        cluster=PlacementConfig(isolate_inference=p.isolate_inference, horus_frag_weight=p.horus_frag_weight),
        prediction_wait_s=p.prediction_wait_s, max_waiting_jobs=p.max_waiting_jobs,
        local_nodes=parse_local_nodes(p.local_nodes),
        partitions=partitions if partitions is not None else job_partitions(settings),
        after_admission=p.after_admission, weight_ratio=pr.cpu_weight_ratio if pr.cpu_weights else None,
        start_timeout_s=settings.jobs.start_timeout_s)


def priority_step_config(settings: Settings) -> PriorityStepConfig:
    """The priority agent's parameters from the ``priority_*`` settings; every host's capacity is
    ``priority_host_*`` (0: this host's cores and memory)."""
    p = settings.priority
    cpu = p.host_cpu_cores or float(os.cpu_count() or 1)
    mem = float(p.host_mem_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return PriorityStepConfig(
        policy=PriorityConfig(freeze_max_wait_s=p.freeze_max_wait_s, grace_s=p.grace_s,
                              cpu_weight_ratio=p.cpu_weight_ratio if p.cpu_weights else None),
        capacity=Capacity(cpu, mem, p.host_gpus), default_host=settings.host,
        partitions=job_partitions(settings), launcher=p.launcher, start_timeout_s=settings.jobs.start_timeout_s)


def targets_step_config(settings: Settings) -> TargetsStepConfig:
    """The targets agent's parameters from the ``targets_*`` settings (``targets_share_alpha`` 0: the
    share rule off)."""
    t = settings.targets
    return TargetsStepConfig(
        tracker=TargetsConfig(smoothing="ewma", alpha=t.ewma_alpha, patience=t.patience, grace_s=t.grace_s),
        node_cores=t.node_cores, shrink=t.shrink, policy=t.policy, share_alpha=t.share_alpha or None,
        share_interval_s=t.share_interval_s, default_host=settings.host, partitions=job_partitions(settings))


def horus_state_config(settings: Settings) -> HorusStateConfig:
    """The Horus agent's parameters from the ``horus_*`` settings."""
    from phasewise.models.horus.join import JoinConfig
    from phasewise.models.horus.model import HorusConfig
    from phasewise.models.horus.state import HorusStateConfig

    h = settings.horus
    return HorusStateConfig(model=HorusConfig(coverage=h.coverage),
                            join=JoinConfig(warmup_s=h.warmup_s, min_samples=h.min_samples, observe_s=h.observe_s),
                            partitions=job_partitions(settings))


def autoscale_step_config(settings: Settings) -> AutoscaleStepConfig:
    """The autoscaler agent's parameters from the ``autoscale_*`` settings."""
    a = settings.autoscale
    return AutoscaleStepConfig(
        scaler=AutoscalerConfig(slo_p99_ms=a.slo_p99_ms, target_util=a.target_util, tolerance=a.tolerance,
                                down_latency_fraction=a.down_latency_fraction,
                                min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                                max_step=a.max_step, up_step=a.up_step, up_cooldown_s=a.up_cooldown_s,
                                down_cooldown_s=a.down_cooldown_s),
        latency_metric=a.latency_metric, cpu_metric=a.cpu_metric, partitions=job_partitions(settings))
