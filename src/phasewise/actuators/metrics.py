"""Prometheus metrics of the actuator (``phasewise actuate``).

Every metric is registered on the registry passed in, so tests use a fresh
``CollectorRegistry()``; the process uses the default one and serves it on
``--metrics-port``.

- ``phasewise_actuator_decisions_total{status}``: this host's decisions by
  outcome (applied, clamped, duplicate, rejected, failed);
- ``phasewise_actuator_apply_seconds``: time a backend took to apply a command
  (retries included);
- ``phasewise_actuator_dead_letters_total``: malformed decisions dead-lettered;
- ``phasewise_actuator_ignored_total``: well-formed decisions for other hosts;
- ``phasewise_actuator_retries_total``: retries after temporary backend errors;
- ``phasewise_actuator_refused_total{reason}``: this host's decisions refused
  before the safety rules: ``signature`` (unsigned or wrongly signed while
  ``signing_key_file`` is set; dead-lettered), ``stale`` (older than
  ``decision_max_age_s``) or ``future`` (stamped beyond
  ``decision_max_future_s``), both reported as ``rejected`` actuations;
  ``jobs_off`` (a ``place`` decision while ``actuator_start_jobs`` is off)
  and ``not_owner`` (a freeze, thaw, terminate, weight or resume of a
  container this actuator did not start for that job), ``rejected`` too.
- ``phasewise_actuator_decision_to_actuation_seconds``: from the decision's
  record time on the decisions topic (when the worker produced it) to its
  outcome here (duplicates left out);
- ``phasewise_actuator_consumer_lag{topic}``: decisions not yet read
  (librdkafka's statistics, every 5 s);
- ``phasewise_actuator_ledger_lost_timestamp_seconds``: when this actuator
  found at start-up that its ledger had been lost (a new ledger while its
  consumer group has committed offsets), Unix seconds; 0: not since it
  started (:mod:`phasewise.actuators.ledger_loss`);
- ``phasewise_actuator_ledger_restored_total``: decision ids entered into
  such a new ledger from the actuator's own actuations;
- ``phasewise_build_info{version,python,role="actuator"}``: 1.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from phasewise.actuators.commands import STATUSES
from phasewise.kit.topics import DECISIONS

__all__ = ["FALLBACK_OUTCOMES", "LATENCY_BUCKETS", "REFUSALS", "ActuatorMetrics"]

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
        from phasewise.kit.observe import build_info

        self.build_info = build_info(registry, "actuator")
