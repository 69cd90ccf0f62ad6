"""Prometheus metrics of the stream worker (``phasewise worker``).

Every metric is registered on the registry passed in (tests use a fresh
``CollectorRegistry()``); the process serves the default one on
``--metrics-port`` (0 = no endpoint).

- ``phasewise_worker_messages_total``: HostSamples messages processed;
- ``phasewise_worker_container_samples_total``: container samples learned;
- ``phasewise_worker_decisions_total``: limit decisions emitted;
- ``phasewise_worker_dead_letters_total{kind}``: messages dead-lettered,
  ``kind`` = ``schema`` (malformed input), ``processing`` (valid input the
  worker failed on), ``event_time`` (stamped too far ahead of the worker's
  clock or behind its host's newest sample) or ``capacity`` (containers
  beyond the intake limits);
- ``phasewise_worker_containers_refused_total{limit}``: container samples
  refused by an intake capacity limit (``limit``: message, host, worker):
  a whole message too large, or no other container could make room;
- ``phasewise_worker_containers_evicted_total{limit}``: containers dropped
  (state, table entries) to admit new ones when the per-host or per-worker
  limit was full (``limit``: host, worker), least recently seen first;
- ``phasewise_worker_delivery_errors_total{topic}``: output records (decisions,
  phase changes, learn windows, dead letters) librdkafka failed to deliver;
  after one, the worker commits no further offsets and stops (see
  :mod:`phasewise.streams.output`);
- ``phasewise_worker_table_writes_total``: container states written to the
  changelogged tables (latest per container, at each offset commit);
- ``phasewise_worker_commit_flush_seconds_total``: wall time of the flushes
  Faust awaits before committing offsets (outputs delivered, container
  states written to the changelogs);
- ``phasewise_worker_process_seconds_total``: time spent in the decision logic;
- ``phasewise_worker_containers``: containers held in memory;
- ``phasewise_worker_safety_bounded_total{rule}``: proposed limits (per container
  and resource, at each decision step) a safety rule changed or held back
  (``rule``: history, throttled, oom, cooldown, step, peak);
- ``phasewise_worker_ready``: 1 once the worker has its partitions and has
  recovered its tables;
- ``--policy phase`` only: ``phasewise_worker_phase_changes_total`` (PhaseChange
  records sent), ``phasewise_worker_model_version`` (snapshot version the
  detectors use, 0 = none yet), ``phasewise_worker_model_snapshot_latest``
  (newest valid snapshot read from the models topic; the detectors move to it
  at their next message), ``phasewise_worker_snapshots_published_total``
  and ``phasewise_worker_windows_learned_total`` (this worker as the learner).

- ``phasewise_worker_recommendations_total{policy}``: decisions emitted by
  policy (``vpa``, ``phase``; anything else counts as ``other``);
- ``phasewise_worker_sample_to_decision_seconds{policy}``: from a sample's
  time (``ts``, the host agent's clock) to the decision it led to being sent;
- ``phasewise_worker_consumer_lag{topic}``: records not yet fetched on the
  partitions this worker is assigned (high watermark - position, every 5 s);
- ``phasewise_build_info{version,python,role="worker"}``: 1.

Labels are bounded: the policies, the dead-letter kinds, the safety rules and
the topics phasewise declares; never a host or container.
``delivery_errors_total{topic}`` starts at 0 for every output topic, so a
first error is an increase.

``phasewise_worker_ready`` drops to 0 when an agent dies; the worker then
stops with exit status 1 (see :func:`phasewise.streams.agents.samples.fail_worker_on_agent_error`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from phasewise.kit.records import WORKLOAD_POLICIES
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, LEARN_WINDOWS, PHASES

__all__ = ["DEAD_LETTER_KINDS", "EVICTION_LIMITS", "LATENCY_BUCKETS", "OUTPUT_TOPICS", "REFUSAL_LIMITS",
           "WorkerMetrics"]

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
        for pol in (*WORKLOAD_POLICIES, "other"):
            self.recommendations.labels(policy=pol)
            self.sample_to_decision.labels(policy=pol)
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
        self.ready = Gauge("phasewise_worker_ready", "1 once partitions are assigned and tables recovered, "
                           "0 again when an agent died", registry=registry)

    def decided(self, decisions: Iterable, now: float | None = None) -> None:
        """Count *decisions* (``Decision`` records just sent) by policy, with their sample-to-decision time."""
        now = time.time() if now is None else now
        for d in decisions:
            pol = d.policy if d.policy in WORKLOAD_POLICIES else "other"
            self.recommendations.labels(policy=pol).inc()
            self.sample_to_decision.labels(policy=pol).observe(max(0.0, now - d.ts))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
