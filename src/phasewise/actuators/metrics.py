"""Prometheus metrics of the actuator (``phasewise actuate``), on the registry passed in (tests pass a fresh one).

Each metric's help text says what it counts; the list, with the alerts that
read them: docs/operations.md, "Metrics and alerts", and docs/deployment.md,
"Metrics".
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from phasewise.actuators.commands import STATUSES
from phasewise.kit.topics import DECISIONS

__all__ = ["ACTUATOR_JOB_STATES", "FALLBACK_OUTCOMES", "LATENCY_BUCKETS", "RECOVERY_OUTCOMES", "REFUSALS",
           "ActuatorMetrics"]

#: the job states an actuator publishes (docs/jobs.md, "Lifecycle")
ACTUATOR_JOB_STATES = ("started", "rejected", "frozen", "thawed", "finished", "failed", "terminated", "scaled")
#: what a restarted actuator found of each job of its registry (docs/jobs.md, "Actuator")
RECOVERY_OUTCOMES = ("watched", "ended", "republished")

#: why a decision is refused before the safety rules see it
REFUSALS = ("signature", "stale", "future", "jobs_off", "not_owner")
#: what came of a resize -> evict fallback (:mod:`phasewise.actuators.backends.kubernetes`)
FALLBACK_OUTCOMES = ("evicted", "waiting", "not_recreatable", "failed")
#: seconds, for the pipeline's latencies (a hop is ~10 ms on a quiet cluster, minutes when backed up)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ActuatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = REGISTRY if registry is None else registry
        self.registry = registry
        self.decisions = Counter("phasewise_actuator_decisions", "this host's decisions by outcome",
                                 ["status"], registry=registry)
        for s in STATUSES:  # export zeros so rate() works from the first scrape
            self.decisions.labels(status=s)
        self.apply_seconds = Histogram(
            "phasewise_actuator_apply_seconds", "time to apply one command, retries included",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )
        self.dead_letters = Counter("phasewise_actuator_dead_letters", "malformed decisions dead-lettered",
                                    registry=registry)
        self.ignored = Counter("phasewise_actuator_ignored", "decisions for other hosts, skipped",
                               registry=registry)
        self.retries = Counter("phasewise_actuator_retries", "retries after temporary backend errors",
                               registry=registry)
        self.refused = Counter("phasewise_actuator_refused", "decisions refused before the safety rules",
                               ["reason"], registry=registry)
        for r in REFUSALS:
            self.refused.labels(reason=r)
        self.decision_latency = Histogram(
            "phasewise_actuator_decision_to_actuation_seconds",
            "decision record produced (Kafka timestamp) to its outcome on this host",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.resize_fallbacks = Counter(
            "phasewise_actuator_resize_fallbacks",
            "resize -> evict fallbacks (update-mode in-place-or-recreate) by outcome: evicted; waiting (a "
            "disruption budget refused the eviction: tried again later); not_recreatable (no controller would "
            "recreate the pod: not evicted); failed", ["outcome"], registry=registry)
        for o in FALLBACK_OUTCOMES:
            self.resize_fallbacks.labels(outcome=o)
        self.consumer_lag = Gauge("phasewise_actuator_consumer_lag", "records not yet read, by topic",
                                  ["topic"], registry=registry)
        self.consumer_lag.labels(topic=DECISIONS.name)
        self.ledger_lost = Gauge("phasewise_actuator_ledger_lost_timestamp_seconds",
                                 "when the actuator found its ledger lost at start-up (Unix s; 0: not)",
                                 registry=registry)
        self.ledger_restored = Counter("phasewise_actuator_ledger_restored",
                                       "decision ids restored into a new ledger from this host's actuations",
                                       registry=registry)
        self.job_states = Counter("phasewise_actuator_job_states",
                                  "job states this actuator published on the job-events topic, by kind",
                                  ["kind"], registry=registry)
        for k in ACTUATOR_JOB_STATES:
            self.job_states.labels(kind=k)
        self.job_ends_ignored = Counter(
            "phasewise_actuator_job_ends_ignored",
            "process ends seen for no running job of the registry (reported already, or the container's job "
            "replaced): nothing published", registry=registry)
        self.jobs_recovered = Counter(
            "phasewise_actuator_jobs_recovered",
            "at start-up, the registry's jobs: watched (still running, watched again), ended (ended while no "
            "actuator watched them: reported), republished (an end decided but not published before the stop)",
            ["outcome"], registry=registry)
        for o in RECOVERY_OUTCOMES:
            self.jobs_recovered.labels(outcome=o)
        self.job_cgroups_removed = Counter(
            "phasewise_actuator_job_cgroups_removed",
            "ended jobs' containers (not a checkpoint stop's): removed (their cgroups), or left (a process still "
            "in one, or a cgroup busy: the log says which)", ["outcome"], registry=registry)
        for o in ("removed", "left"):
            self.job_cgroups_removed.labels(outcome=o)
        self.jobs_watched = Gauge("phasewise_actuator_jobs_watched", "job processes whose end is watched now",
                                  registry=registry)
        from phasewise.kit.observe import build_info

        self.build_info = build_info(registry, "actuator")
