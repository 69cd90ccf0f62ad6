"""``phasewise bench flood``: a worker's resident memory per container under a flood of new containers, and
its cap holding beyond them. docs/benchmarks.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from phasewise.apps.bench.harness import bench_hosts, host_message, produce_messages, rss_bytes, scrape, wait_until
from phasewise.kit.broker import EmbeddedBroker, free_port
from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.settings import Settings
from phasewise.kit.topics import SAMPLES

__all__ = ["add_arguments", "run"]

SAMPLES_COUNTER = "phasewise_worker_container_samples_total"
REFUSED = "phasewise_worker_containers_refused_total"
EVICTED = "phasewise_worker_containers_evicted_total"
TABLE_WRITES = "phasewise_worker_table_writes_total"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--containers", type=int, default=100_000, help="containers admitted (= the worker's cap)")
    p.add_argument("--per-message", type=int, default=1000, help="containers per host message")
    p.add_argument("--ticks", type=int, default=3, help="samples per container")
    p.add_argument("--beyond", type=int, default=50_000, help="new containers sent once the cap is reached")
    p.add_argument("--policy", choices=("vpa", "phase"), default="vpa", help="the worker's policy")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(a: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="phasewise-flood-"))
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
        ensure_topics(s)
        port = free_port()
        trim_s = Settings.from_env({}, env=dict(os.environ)).worker.heap_trim_interval_s
        env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_DATA_DIR": str(work / "worker"),
               "PHASEWISE_METRICS_PORT": str(port), "PHASEWISE_WEB_PORT": "0",
               "PHASEWISE_RECOMMEND_INTERVAL_S": "1", "PHASEWISE_VPA_TIME_SCALE": "0.001",
               "PHASEWISE_POLICY": a.policy, "PHASEWISE_INTAKE_MAX_CONTAINERS_PER_WORKER": str(a.containers),
               "PHASEWISE_INTAKE_MAX_CONTAINERS_PER_MESSAGE": str(max(a.per_message, 1))}
        worker = RoleProcess("worker", [], env=env, log_path=work / "worker.log").start()
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            def metric(name: str) -> float:
                try:
                    return scrape(url).get(name, 0.0)
                except OSError:
                    return -1.0

            def ready() -> bool:
                if not worker.alive():
                    raise RuntimeError("worker exited:\n" + worker.log_tail())
                return metric("phasewise_worker_ready") >= 1.0

            wait_until(ready, 120, 0.2, "the worker to be ready")
            time.sleep(2.0)
            rss0 = rss_bytes(worker.pid)
            producer = make_producer(s, **{"linger.ms": 20})
            hosts = bench_hosts(a.containers, a.per_message, "flood")
            t_base = time.time() - a.ticks - 120
            t0 = time.perf_counter()

            def ticks():
                for k in range(a.ticks):
                    for host, cs in hosts:
                        yield host.encode(), host_message(host, t_base + k, cs, [0.5] * len(cs),
                                                          [3e8 + 1e6 * (k % 2)] * len(cs), cpu_limit=2.0,
                                                          mem_limit=4e9)
            produce_messages(producer, SAMPLES.name, ticks())
            producer.flush(60)
            wait_until(lambda: metric(SAMPLES_COUNTER) >= a.containers * a.ticks, 1800, 0.5, "the flood")
            seconds = time.perf_counter() - t0
            # the resident cost includes the state table's copy of each container's state (memory store),
            # written at the commits after its first samples
            wait_until(lambda: metric(TABLE_WRITES) >= a.containers, 600, 0.5, "every container's state written")
            time.sleep(trim_s + 2.0)  # ... and the heap's free memory handed back (heap_trim_interval_s)
            rss1 = rss_bytes(worker.pid)
            refused0 = sum(metric(f'{REFUSED}{{limit="{k}"}}') for k in ("message", "host", "worker"))
            evicted0 = sum(metric(f'{EVICTED}{{limit="{k}"}}') for k in ("host", "worker"))
            extra = bench_hosts(a.beyond, a.per_message, "beyond")
            produce_messages(producer, SAMPLES.name, (
                (h.encode(), host_message(h, t_base + a.ticks, cs, [0.5] * len(cs), [3e8] * len(cs)))
                for h, cs in extra))
            producer.flush(60)

            def refused() -> float:
                return sum(metric(f'{REFUSED}{{limit="{k}"}}') for k in ("message", "host", "worker")) - refused0

            def evicted() -> float:
                return sum(metric(f'{EVICTED}{{limit="{k}"}}') for k in ("host", "worker")) - evicted0
            wait_until(lambda: refused() + evicted() >= a.beyond, 600, 0.5, "the refusals and evictions")
            time.sleep(trim_s + 2.0)
            rss2 = rss_bytes(worker.pid)
            out = {"policy": a.policy, "containers": a.containers, "per_message": a.per_message, "ticks": a.ticks,
                   "seconds": round(seconds, 1), "rss_idle_bytes": rss0, "rss_bytes": rss1,
                   "rss_bytes_per_container": round((rss1 - rss0) / a.containers), "heap_trim_interval_s": trim_s,
                   "containers_held": metric("phasewise_worker_containers"), "table_writes": metric(TABLE_WRITES),
                   "beyond": a.beyond, "containers_refused": refused(), "containers_evicted": evicted(),
                   "rss_growth_beyond_cap_bytes": rss2 - rss1}
        finally:
            worker.stop()
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0
