"""Prometheus metrics of the host agent (``phasewise produce``), on the registry passed in (tests pass a
fresh one); each metric's help text says what it counts (docs/operations.md, "Metrics and alerts").
"""

from __future__ import annotations

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

__all__ = ["ProducerMetrics"]


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = REGISTRY if registry is None else registry
        self.registry = r
        self.samples = Counter("phasewise_producer_samples_total", "HostSamples messages built", registry=r)
        self.delivered = Counter("phasewise_producer_delivered_total", "messages acknowledged by the broker",
                                 registry=r)
        self.buffered = Gauge("phasewise_producer_buffered", "messages waiting for the broker", registry=r)
        self.dropped = Counter("phasewise_producer_dropped_total", "messages dropped: buffer full", registry=r)
        self.containers = Gauge("phasewise_producer_containers", "containers in the last message", registry=r)
        self.containers_empty = Gauge("phasewise_producer_containers_empty",
                                      "containers the last tick skipped: their cgroup holds no process", registry=r)
        self.workloads = Gauge("phasewise_producer_workloads", "containers in the last message by resolved mode",
                               ["mode"], registry=r)
        self.workloads_refused = Gauge("phasewise_producer_workloads_refused",
                                       "containers in the last message whose per-workload settings were refused",
                                       registry=r)
        self.sample_seconds = Histogram(
            "phasewise_producer_sample_seconds", "time to sample all containers for one tick",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=r,
        )
        from phasewise.kit.observe import build_info

        self.build_info = build_info(r, "producer")

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose ``/metrics`` on *port* (a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
