"""``phasewise bench pipeline``: the closed loop's throughput, latency and memory, in one run against one
broker (the broker's own ceiling, a real worker's samples/s, sample-to-actuation latency through a dry-run
actuator, bytes per container). docs/benchmarks.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import OFFSET_END, TIMESTAMP_CREATE_TIME, TopicPartition

from phasewise.apps.bench.harness import (
    bench_hosts,
    drain_backlog,
    host_message,
    print_result,
    produce_messages,
    rss_bytes,
    scrape,
    square_wave_usage,
    wait_until,
    worker_bench_env,
)
from phasewise.kit.broker import EmbeddedBroker, free_port
from phasewise.kit.command import arg_type
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import WORKLOAD_POLICIES, Actuation, Decision, SchemaError, decode
from phasewise.kit.settings import Settings, above, at_least, parse_float, parse_int
from phasewise.kit.topics import ACTUATIONS, DECISIONS, SAMPLES, Topic
from phasewise.producers.host_agent import PRODUCER_CONFIG


def add_arguments(p: argparse.ArgumentParser) -> None:
    count, seconds = arg_type(parse_int, at_least(1)), arg_type(parse_float, above(0))
    p.add_argument("--containers", type=count, default=1000)
    p.add_argument("--seconds", type=seconds, default=20.0, help="length of the throughput flood")
    p.add_argument("--per-host", type=count, default=100, help="containers per host message")
    p.add_argument("--latency-seconds", type=seconds, default=20.0)
    p.add_argument("--raw-messages", type=count, default=20000)
    p.add_argument("--policy", choices=WORKLOAD_POLICIES, default=Settings.default("policy"),
                   help="the worker's policy (phase: the CRBM detector with its VPA fallback, starting from the "
                        "shipped pretrained model)")
    p.add_argument("--safety", choices=["on", "off"], default="on",
                   help="the worker's safety rules (default on, their windows scaled to the bench's minutes; "
                        "off: to measure what they cost)")
    p.add_argument("--hosts-tick", choices=["together", "spread"], default="together",
                   help="latency: every host sends its samples at the same instant of each second (together: one "
                        "round of every container, the worst case), or host i of n at i/n s into the second "
                        "(spread: as independent host agents, started at different times, do)")
    p.add_argument("--bootstrap", help="use this Kafka instead of an embedded broker")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep-logs", action="store_true", help="print where role logs are kept")


def _hosts(n: int, per_host: int) -> list[tuple[str, list[str]]]:
    return bench_hosts(n, per_host, "bench")


def _usage(n: int, t: float, seed: int):
    cpu, mem = square_wave_usage(n, t, seed)
    return cpu.tolist(), mem.tolist()


def raw_consume_rate(settings: Settings, value: bytes, n: int) -> float:
    topic = Topic(f"phasewise.bench-raw.{uuid.uuid4().hex[:6]}", "host", 1)
    ensure_topics(settings, [topic])
    p = make_producer(settings, **{"linger.ms": 20, "batch.num.messages": 10000})
    produce_messages(p, topic.name, ((b"h", value) for _ in range(n)))
    c = make_consumer(settings, f"bench-raw-{uuid.uuid4().hex[:6]}", **{"fetch.max.bytes": 52428800})
    c.subscribe([topic.name])
    got, t0 = 0, None
    deadline = time.monotonic() + 120
    while got < n and time.monotonic() < deadline:
        msgs = c.consume(1000, 1.0)
        for m in msgs:
            if m.error():
                continue
            if t0 is None:
                t0 = time.perf_counter()
            got += 1
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    c.close()
    return got / elapsed if elapsed > 0 else float("nan")


def run_bench(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="phasewise-bench-"))
    broker = None if args.bootstrap else EmbeddedBroker(log_path=workdir / "broker.log").start()
    bootstrap = args.bootstrap or broker.bootstrap
    roles: list[RoleProcess] = []
    try:
        s = Settings.from_env({"bootstrap": bootstrap}, env={})
        ensure_topics(s)
        hosts = _hosts(args.containers, args.per_host)
        cpu0, mem0 = _usage(args.per_host, 0, 0)
        sample_value = host_message(hosts[0][0], time.time(), hosts[0][1], cpu0, mem0)
        raw = raw_consume_rate(s, sample_value, args.raw_messages)

        metrics_port = free_port()
        env = worker_bench_env(bootstrap, workdir / "worker", metrics_port, getattr(args, "safety", "on") == "on",
                               args.policy)
        worker = RoleProcess("worker", [], env=env, log_path=workdir / "worker.log").start()
        roles.append(worker)
        url = f"http://127.0.0.1:{metrics_port}/metrics"

        def ready() -> bool:
            if not worker.alive():
                raise RuntimeError("worker exited:\n" + worker.log_tail())
            try:
                return scrape(url).get("phasewise_worker_ready", 0.0) >= 1.0
            except OSError:
                return False

        wait_until(ready, 90, what="the worker to be ready")
        rss0 = rss_bytes(worker.pid)

        # --- throughput: a backlog the worker drains as fast as it can
        producer = make_producer(s, **{"linger.ms": 20})
        ticks = max(1, int(args.seconds))
        w = drain_backlog(producer, SAMPLES.name, hosts, ticks, url, worker.pid)
        # a backlog drained within one scrape cannot be timed: say so rather than print 0
        samples_per_s = w.samples / w.seconds if w.samples > 0 and w.seconds > 0 else None
        rss1 = rss_bytes(worker.pid)
        bytes_per_container = max(0.0, (rss1 - rss0) / args.containers)

        # --- latency at 1 Hz with a dry-run actuator for the first host
        host0 = hosts[0][0]
        act_env = {**env, "PHASEWISE_HOST": host0, "PHASEWISE_DATA_DIR": str(workdir / "actuator"),
                   "PHASEWISE_METRICS_PORT": "0"}
        roles.append(RoleProcess("actuate", ["--backend", "dry-run"], env=act_env,
                                 log_path=workdir / "actuator.log").start())
        consumer = make_consumer(s, f"bench-lat-{uuid.uuid4().hex[:6]}", **{"auto.offset.reset": "latest"})
        consumer.subscribe([ACTUATIONS.name])
        # the worker's share: every host's decisions, read as they are produced (no group: no join)
        dec_consumer = make_consumer(s, f"bench-dec-{uuid.uuid4().hex[:6]}")
        dec_consumer.assign([TopicPartition(DECISIONS.name, p, OFFSET_END) for p in range(DECISIONS.partitions)])
        act_start = time.time()
        for _ in range(50):  # join the group before the measured window
            consumer.poll(0.1)
            if consumer.assignment():
                break
        # samples as the host agent sends them (its producer settings, not the flood's)
        agent_producer = make_producer(s, **PRODUCER_CONFIG)
        tick = [ticks]

        spread = args.hosts_tick == "spread"

        def collect_until(t: float, since: float, latencies: list[float], worker_latencies: list[float]) -> None:
            while time.time() < t:
                _collect(consumer.poll(min(0.01, max(0.0, t - time.time()))), host0, since, latencies)
                for m in dec_consumer.consume(1000, 0):
                    _collect_decision(m, since, worker_latencies)

        def run_ticks(since: float, until, latencies: list[float], worker_latencies: list[float]) -> None:
            t_next = time.time()
            while not until():
                t_tick, now = t_next, time.time()
                k = tick[0]
                for i, (host, cs) in enumerate(hosts):
                    if spread:  # host i of n sends at i/n s into the second
                        collect_until(t_tick + i / len(hosts), since, latencies, worker_latencies)
                    cpu, mem = _usage(len(cs), k, i)
                    agent_producer.produce(SAMPLES.name, key=host.encode(), value=host_message(
                        host, time.time() if spread else now, cs, cpu, mem, cpu_limit=2.0, mem_limit=4e9))
                    if spread:
                        agent_producer.poll(0)
                agent_producer.poll(0)
                tick[0] += 1
                t_next += 1.0
                collect_until(t_next, since, latencies, worker_latencies)

        # warm-up, not measured: a freshly started actuator first reads the decisions topic's
        # backlog (the flood's decisions, all hosts); the target is the steady state at 1 Hz
        warm: list[float] = []
        run_ticks(act_start, lambda: bool(warm) or time.time() - act_start > 60, warm, [])
        latency_warmup_s = time.time() - act_start
        latencies: list[float] = []
        worker_latencies: list[float] = []
        lat_start = time.time()
        run_ticks(lat_start, lambda: time.time() - lat_start >= args.latency_seconds, latencies, worker_latencies)
        agent_producer.flush(10)
        end = time.time() + 5
        while time.time() < end:
            _collect(consumer.poll(0.1), host0, lat_start, latencies)
            for m in dec_consumer.consume(1000, 0.1):
                _collect_decision(m, lat_start, worker_latencies)
        consumer.close()
        dec_consumer.close()

        lat_ms = np.array(latencies) * 1000.0
        w_ms = np.array(worker_latencies) * 1000.0
        return {
            "samples_per_s": None if samples_per_s is None else round(samples_per_s, 1),
            "worker_cpu_us_per_sample": round(w.cpu_us_per_sample, 1),
            "worker_commit_flush_s_in_window": round(w.flush_s, 3),
            "raw_consume_per_s": round(raw, 1),
            "p50_ms": round(float(np.percentile(lat_ms, 50)), 1) if len(lat_ms) else None,
            "p99_ms": round(float(np.percentile(lat_ms, 99)), 1) if len(lat_ms) else None,
            "bytes_per_container": round(bytes_per_container, 1),
            "containers": args.containers,
            "per_host": args.per_host,
            "policy": args.policy,
            "safety": getattr(args, "safety", "on"),
            "hosts_tick": args.hosts_tick,
            "actuations_measured": int(len(lat_ms)),
            "worker_p50_ms": round(float(np.percentile(w_ms, 50)), 1) if len(w_ms) else None,
            "worker_p99_ms": round(float(np.percentile(w_ms, 99)), 1) if len(w_ms) else None,
            "decisions_measured": int(len(w_ms)),
            "latency_warmup_s": round(latency_warmup_s, 1),
            "first_actuation_ms": round(min(warm) * 1000.0, 1) if warm else None,
            "raw_unit": "messages/s",
            "logs": str(workdir) if args.keep_logs else None,
        }
    finally:
        for r in reversed(roles):
            r.stop()
        if broker:
            broker.stop()


def _collect(m, host: str, since: float, out: list[float]) -> None:
    if m is None or m.error():
        return
    a = decode(Actuation, m.value())
    if a.host == host and a.decision_ts is not None and a.decision_ts >= since:
        out.append(a.ts - a.decision_ts)


def _collect_decision(m, since: float, out: list[float]) -> None:
    """Sample event time -> decision produced (the record's CreateTime, stamped by the worker's producer)."""
    if m is None or m.error():
        return
    try:
        d = decode(Decision, m.value())
    except SchemaError:
        return
    kind, ts_ms = m.timestamp()
    if d.ts >= since and kind == TIMESTAMP_CREATE_TIME:
        out.append(ts_ms / 1000.0 - d.ts)


def run(args: argparse.Namespace) -> int:
    return print_result(run_bench(args), args.json, 22)


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
