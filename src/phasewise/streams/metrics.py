"""Prometheus metrics of the stream workers: :class:`WorkerMetrics` (``phasewise worker``,
``phasewise_worker_*``), :class:`HorusMetrics` and :class:`PlacementMetrics` (``phasewise_<role>_*``,
on :class:`JobWorkerMetrics`). Labels are bounded (policies, dead-letter kinds, safety rules,
phasewise's topics; never a host or container). The list and what each counts: docs/worker.md,
"Metrics".
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Summary, start_http_server

from phasewise.kit.records import WORKLOAD_POLICIES
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, LEARN_WINDOWS, PHASES, PREDICTIONS, Topic
from phasewise.models.jobs.lifecycle import IGNORED_WHY


class ReadyGauge(Gauge):
    """A role's ready gauge that remembers whether it was ever set to 1 (:attr:`ever`), where readiness is
    reached: a watcher sampling it could miss a readiness that lasted less than its period."""

    ever = False

    def set(self, value: float) -> None:
        if value == 1:
            self.ever = True
        super().set(value)

__all__ = ["DEAD_LETTER_KINDS", "EVICTION_LIMITS", "LATENCY_BUCKETS", "OUTPUT_TOPICS", "REFUSAL_LIMITS",
           "HorusMetrics", "JobWorkerMetrics", "PlacementMetrics", "WorkerMetrics"]

DEAD_LETTER_KINDS = ("schema", "processing", "event_time", "capacity")
#: the intake limits a container can be refused by (``intake_max_containers_per_<limit>``)
REFUSAL_LIMITS = ("message", "host", "worker")
#: the intake limits that, full, evict a container for a new one
EVICTION_LIMITS = ("host", "worker")
#: the topics the worker's output producer writes (phasewise.streams.output)
OUTPUT_TOPICS = (DECISIONS.name, PHASES.name, LEARN_WINDOWS.name, DEAD_LETTERS.name)
#: seconds, for the pipeline's latencies (a hop is ~10 ms on a quiet cluster, minutes when backed up)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = REGISTRY if registry is None else registry
        self.registry = registry
        self.messages = Counter("phasewise_worker_messages", "HostSamples messages processed",
                                registry=registry)
        self.container_samples = Counter("phasewise_worker_container_samples",
                                         "container samples learned", registry=registry)
        self.decisions = Counter("phasewise_worker_decisions", "limit decisions emitted",
                                 registry=registry)
        self.dead_letters = Counter("phasewise_worker_dead_letters", "messages dead-lettered",
                                    ["kind"], registry=registry)
        for k in DEAD_LETTER_KINDS:
            self.dead_letters.labels(kind=k)
        self.containers_refused = Counter("phasewise_worker_containers_refused",
                                          "container samples refused by an intake capacity limit", ["limit"],
                                          registry=registry)
        for k in REFUSAL_LIMITS:
            self.containers_refused.labels(limit=k)
        self.containers_evicted = Counter("phasewise_worker_containers_evicted",
                                          "containers dropped to admit new ones at a full intake limit, least "
                                          "recently seen first", ["limit"], registry=registry)
        for k in EVICTION_LIMITS:
            self.containers_evicted.labels(limit=k)
        self.policy_refused = Counter("phasewise_worker_policy_refused",
                                      "container samples not decided: their workload asks for a policy this "
                                      "worker does not run (phasewise.io/policy)", ["policy"], registry=registry)
        for pol in WORKLOAD_POLICIES:
            self.policy_refused.labels(policy=pol)
        self.delivery_errors = Counter("phasewise_worker_delivery_errors",
                                       "output records not delivered (no offsets are committed after one)",
                                       ["topic"], registry=registry)
        for t in OUTPUT_TOPICS:  # zeros: a first error is an increase (rate() and increase() see it)
            self.delivery_errors.labels(topic=t)
        self.recommendations = Counter("phasewise_worker_recommendations", "decisions emitted, by policy",
                                       ["policy"], registry=registry)
        self.sample_to_decision = Histogram(
            "phasewise_worker_sample_to_decision_seconds", "sample time (ts) to its decision being sent",
            ["policy"], buckets=LATENCY_BUCKETS, registry=registry)
        # each policy's children, looked up once (labels() takes a lock and builds a key on every call)
        self._decided = {pol: (self.recommendations.labels(policy=pol), self.sample_to_decision.labels(policy=pol))
                         for pol in (*WORKLOAD_POLICIES, "other")}
        self.consumer_lag = Gauge("phasewise_worker_consumer_lag",
                                  "records not yet fetched on this worker's partitions, by topic", ["topic"],
                                  registry=registry)
        from phasewise.kit.observe import build_info

        self.build_info = build_info(registry, "worker")
        self.table_writes = Counter("phasewise_worker_table_writes",
                                    "container states written to the changelogged tables", registry=registry)
        self.commit_flush_seconds = Counter("phasewise_worker_commit_flush_seconds",
                                            "wall time of the flushes before offset commits", registry=registry)
        self.containers_expired = Counter("phasewise_worker_containers_expired",
                                          "containers forgotten after container_ttl_s without a sample",
                                          registry=registry)
        self.process_seconds = Counter("phasewise_worker_process_seconds",
                                       "seconds spent in the decision logic", registry=registry)
        self.containers = Gauge("phasewise_worker_containers", "containers held in memory",
                                registry=registry)
        self.phase_changes = Counter("phasewise_worker_phase_changes", "PhaseChange records sent",
                                     registry=registry)
        self.model_version = Gauge("phasewise_worker_model_version",
                                   "phase model snapshot version the detectors use (0 = none)", registry=registry)
        self.snapshot_latest = Gauge("phasewise_worker_model_snapshot_latest",
                                     "newest valid phase model snapshot version read from the models topic "
                                     "(0 = none)", registry=registry)
        self.model_pins = Counter("phasewise_worker_model_pins",
                                  "assignments whose samples partitions' records name model versions (outcome: "
                                  "pinned = every version they name for the samples read again is kept, "
                                  "unavailable = some were gone: those samples are decided with the version in "
                                  "use)", ["outcome"],
                                  registry=registry)
        self.snapshots_published = Counter("phasewise_worker_snapshots_published",
                                           "phase model snapshots published by this worker's learner",
                                           registry=registry)
        self.windows_learned = Counter("phasewise_worker_windows_learned",
                                       "windows the phase learner trained on", registry=registry)
        from phasewise.models.safety.guard import RULES

        self.safety_bounded = Counter("phasewise_worker_safety_bounded",
                                      "proposed limits a safety rule changed or held back", ["rule"],
                                      registry=registry)
        for r in RULES:
            self.safety_bounded.labels(rule=r)
        self.ready = ReadyGauge("phasewise_worker_ready", "1 once partitions are assigned and tables recovered, "
                                "0 again when an agent died", registry=registry)
        # the job agents beside the samples agent (worker --priorities, --targets)
        self.job_states_ignored = Counter("phasewise_worker_job_states_ignored",
                                          "job lifecycle states that changed nothing: repeated, after the job "
                                          "ended, of a job the agent does not hold", ["agent", "why"],
                                          registry=registry)
        self.jobs_lost = Counter("phasewise_worker_jobs_lost", "jobs started by the agent and released as lost: "
                                 "no started event within job_start_timeout_s", ["agent"], registry=registry)
        self.profiles = Counter("phasewise_worker_profiles", "run profiles of signed workloads: published by this "
                                "worker, read from the profiles topic (all workers')", ["way"], registry=registry)
        self.prior_decisions = Counter("phasewise_worker_prior_decisions",
                                       "decisions whose limits came from a signature's prior (known-job priors)",
                                       registry=registry)
        for way in ("published", "read"):
            self.profiles.labels(way=way)
        for agent in ("priorities", "targets"):
            for why in IGNORED_WHY:
                self.job_states_ignored.labels(agent=agent, why=why)
        self.jobs_lost.labels(agent="priorities")

    def decided(self, decisions: Iterable, now: float | None = None) -> None:
        """Count *decisions* (``Decision`` records just sent) by policy, with their sample-to-decision time."""
        now = time.time() if now is None else now
        children = self._decided
        counts: dict[str, int] = {}
        priors = 0
        for d in decisions:
            pol = d.policy if d.policy in children else "other"
            counts[pol] = counts.get(pol, 0) + 1
            details = getattr(d, "details", None)
            if details and "prior" in details:
                priors += 1
            children[pol][1].observe(max(0.0, now - d.ts))
        for pol, n in counts.items():
            children[pol][0].inc(n)
        if priors:
            self.prior_decisions.inc(priors)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


class JobWorkerMetrics:
    """What every job worker (``phasewise horus``, ``phasewise place``) counts, named ``phasewise_<role>_*``
    on *registry* (default: one of its own); *output*: the topic it writes besides the dead letters."""

    def __init__(self, role: str, output: Topic, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        self.dead_letters = Counter(f"phasewise_{role}_dead_letters", "records dead-lettered", ["kind"],
                                    registry=registry)
        self.delivery_errors = Counter(f"phasewise_{role}_delivery_errors", "output records not delivered",
                                       ["topic"], registry=registry)
        for t in (output, DEAD_LETTERS):  # zeros: a first error is an increase (rate() and increase() see it)
            self.delivery_errors.labels(topic=t.name)
        self.table_writes = Counter(f"phasewise_{role}_table_writes", "state table writes", registry=registry)
        self.commit_flush_seconds = Counter(f"phasewise_{role}_commit_flush_seconds", "seconds in commit flushes",
                                            registry=registry)
        self.ready = ReadyGauge(f"phasewise_{role}_ready", "1 once partitions are assigned and state restored",
                                registry=registry)
        from phasewise.kit.observe import build_info

        self.build_info = build_info(registry, role)


class HorusMetrics(JobWorkerMetrics):
    """``phasewise horus``'s metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__("horus", PREDICTIONS, registry)
        registry = self.registry
        self.predictions = Counter("phasewise_horus_predictions", "predictions published", registry=registry)
        self.learned = Counter("phasewise_horus_jobs_learned", "jobs observed and learned", registry=registry)
        self.error = Summary("phasewise_horus_prediction_log_error",
                             "|log1p(predicted) - log1p(observed)| of learned jobs' predictions at submission",
                             ["target"], registry=registry)
        self.last_error = Gauge("phasewise_horus_last_prediction_log_error",
                                "|log1p(predicted) - log1p(observed)| of the last job learned", ["target"],
                                registry=registry)
        self.shared_learned = Counter("phasewise_horus_shared_jobs_learned",
                                      "jobs learned from the model other horus workers shared", registry=registry)
        self.snapshots = Counter("phasewise_horus_snapshots_published", "shared model snapshots published",
                                 registry=registry)
        self.job_states_ignored = Counter("phasewise_horus_job_states_ignored",
                                          "job lifecycle states that changed nothing: repeated, after the job "
                                          "ended, of a job it does not hold", ["why"], registry=registry)
        for why in IGNORED_WHY:  # zeros: a first one is an increase
            self.job_states_ignored.labels(why=why)
        self.jobs = Gauge("phasewise_horus_jobs", "jobs held: booked (their events read here) and joined (their "
                          "host's samples read here)", registry=registry)
        self.routes = Counter("phasewise_horus_routes", "job starts, ends and phase changes routed to the worker "
                              "reading their host's samples", ["kind"], registry=registry)
        for kind in ("started", "end", "phase"):
            self.routes.labels(kind=kind)
        self.off_route = Counter("phasewise_horus_samples_off_route", "host samples read on another partition than "
                                 "their host's routes (not CRC32-partitioned by host)", registry=registry)
        self.model_jobs = Gauge("phasewise_horus_model_jobs", "jobs the model learned from", registry=registry)


class PlacementMetrics(JobWorkerMetrics):
    """``phasewise place``'s metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__("place", DECISIONS, registry)
        registry = self.registry
        self.decisions = Counter("phasewise_place_decisions", "place decisions published", registry=registry)
        self.decide_seconds = Summary("phasewise_place_decide_seconds", "policy time per decision",
                                      registry=registry)
        self.waiting = Gauge("phasewise_place_waiting_jobs", "jobs no node can take yet", registry=registry)
        self.nodes = Gauge("phasewise_place_nodes", "nodes known", registry=registry)
        self.job_states_ignored = Counter("phasewise_place_job_states_ignored",
                                          "job lifecycle states that changed nothing: repeated, after the job "
                                          "ended, of a job it does not hold or did not place", ["why"],
                                          registry=registry)
        for why in IGNORED_WHY:  # zeros: a first one is an increase
            self.job_states_ignored.labels(why=why)
        self.jobs_lost = Counter("phasewise_place_jobs_lost", "placed jobs released as lost: no started event "
                                 "within job_start_timeout_s of the place decision", registry=registry)
