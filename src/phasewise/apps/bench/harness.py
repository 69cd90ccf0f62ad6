"""Pieces the benchmarks share: message floods and scrapes of the real roles, run as subprocesses
(:mod:`phasewise.kit.procs`), so the figures include Kafka, Faust and JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phasewise.kit.records import ContainerSample, HostSamples, encode

__all__ = ["BacklogWindow", "bench_hosts", "square_wave_gpu", "square_wave_usage", "host_message", "scrape",
           "rss_bytes", "cpu_seconds", "produce_messages", "drain_backlog", "print_result"]

#: the worker's container-sample counter the throughput benchmarks read
SAMPLES_COUNTER = "phasewise_worker_container_samples_total"
#: the worker's time in the flushes before offset commits
FLUSH_COUNTER = "phasewise_worker_commit_flush_seconds_total"


def bench_hosts(n: int, per_host: int, prefix: str) -> list[tuple[str, list[str]]]:
    """*n* containers split into hosts of *per_host*: ``[(host, [container, ...]), ...]``."""
    out = []
    for i in range(math.ceil(n / per_host)):
        k = min(per_host, n - i * per_host)
        out.append((f"{prefix}-h{i:03d}", [f"c{i:03d}-{j:04d}" for j in range(k)]))
    return out


def square_wave_usage(n: int, t: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(cpu cores, memory bytes) at tick *t*: per container a square wave between two levels."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.2, 1.0, n)
    period = rng.integers(8, 20, n)
    high = ((t // period) % 2).astype(float)
    return base * (1.0 + 1.5 * high), (base * 4e8) * (1.0 + 0.8 * high)


def square_wave_gpu(n: int, t: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(GPU util percent, GPU memory bytes) following :func:`square_wave_usage`'s waves (same seed)."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.2, 1.0, n)
    period = rng.integers(8, 20, n)
    high = ((t // period) % 2).astype(float)
    return 5.0 + 90.0 * base * high, (base * 8e9) * (1.0 + 1.0 * high)


def host_message(host: str, ts: float, containers: list[str], cpu: list[float], mem: list[float],
                 cpu_limit: float | None = None, mem_limit: float | None = None,
                 gpu: list[float] | None = None, gpu_mem: list[float] | None = None) -> bytes:
    n = len(containers)
    gpu_, gpu_mem_ = gpu or [None] * n, gpu_mem or [None] * n
    return encode(HostSamples(
        host=host, ts=ts, interval_s=1.0,
        containers=tuple(
            ContainerSample(container=c, cpu_cores=u, mem_bytes=m, cpu_limit_cores=cpu_limit,
                            mem_limit_bytes=mem_limit, nr_periods=10, gpu_util=g, gpu_mem_bytes=gm)
            for c, u, m, g, gm in zip(containers, cpu, mem, gpu_, gpu_mem_)
        ),
    ))


def produce_messages(producer, topic: str, items: Iterable[tuple[bytes, bytes]]) -> int:
    n = 0
    for key, value in items:
        while True:
            try:
                producer.produce(topic, key=key, value=value)
                break
            except BufferError:
                producer.poll(0.05)
        n += 1
        if n % 1000 == 0:
            producer.poll(0)
    producer.flush(60)
    return n


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Prometheus text exposition -> {sample name with labels: value}."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process *pid*, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class BacklogWindow:
    """What a worker did between 10 % and 90 % of a backlog (see :func:`drain_backlog`)."""

    samples: float  #: container samples processed
    seconds: float  #: wall time
    cpu_s: float  #: the worker's CPU seconds, all threads
    flush_s: float  #: the worker's pre-commit flush seconds
    #: with several workers: each one's container samples and CPU seconds in the window
    per_worker: tuple[tuple[float, float], ...] = ()

    @property
    def cpu_us_per_sample(self) -> float:
        return self.cpu_s / max(1.0, self.samples) * 1e6


def drain_backlog(producer, topic: str, hosts: list[tuple[str, list[str]]], ticks: int,
                  metrics_url: str | list[str], pid: int | list[int], gpu: bool = False) -> BacklogWindow:
    """Flood *ticks* ticks of every host's message onto *topic* and time worker *pid* draining them
    (several workers of one group: a list of their metrics URLs and pids, their counters summed).

    One message per host per tick (:func:`square_wave_usage` seeded by the
    host's index, limits 2 cores / 4 GB, event times in the past). The window
    runs from 10 % to 90 % of the backlog by the worker's
    ``phasewise_worker_container_samples_total`` (scraped from *metrics_url*);
    returns once the whole backlog is processed. The counters are scraped every
    100 ms, each alone (``?name[]=``: a whole scrape costs the worker milliseconds
    of CPU, ~7 % of it at this rate), so a backlog that drains in less than that has no window; where
    the scrapes were too slow to see it (a worker starved of CPU answers them
    late), the window runs from the end of the flood to the whole backlog, and where the worker kept up
    with the flood itself (a slow producer on a loaded machine), from the flood's start (a lower bound).
    *gpu*: the samples also carry GPU use (:func:`square_wave_gpu`).
    """
    urls = [metrics_url] if isinstance(metrics_url, str) else list(metrics_url)
    pids = [pid] if isinstance(pid, int) else list(pid)

    def each(name: str = SAMPLES_COUNTER) -> list[float]:  # that counter alone: a whole scrape costs ms of CPU
        return [scrape(f"{u}?name[]={name}").get(name, 0.0) for u in urls]

    def counter(name: str = SAMPLES_COUNTER) -> float:
        return sum(each(name))

    def cpu() -> list[float]:
        return [cpu_seconds(p) for p in pids]

    t_base = time.time() - ticks - 60
    start_each, t_start, cpu_start, fl_start = each(), time.perf_counter(), cpu(), counter(FLUSH_COUNTER)
    start = sum(start_each)

    def flood():
        for k in range(ticks):
            for i, (host, cs) in enumerate(hosts):
                cpu, mem = square_wave_usage(len(cs), k, i)
                g, gm = square_wave_gpu(len(cs), k, i) if gpu else (None, None)
                yield host.encode(), host_message(host, t_base + k, cs, cpu.tolist(), mem.tolist(),
                                                  cpu_limit=2.0, mem_limit=4e9,
                                                  gpu=None if g is None else g.tolist(),
                                                  gpu_mem=None if gm is None else gm.tolist())

    produce_messages(producer, topic, flood())
    c_0, t_0, cpu_0, fl_0 = each(), time.perf_counter(), cpu(), counter(FLUSH_COUNTER)
    expected = start + sum(len(cs) for _, cs in hosts) * ticks
    lo, hi = start + 0.1 * (expected - start), start + 0.9 * (expected - start)
    wait_until(lambda: counter() >= lo, 600, 0.1, "10% of the backlog")
    c_lo, t_lo, cpu_lo, fl_lo = each(), time.perf_counter(), cpu(), counter(FLUSH_COUNTER)
    wait_until(lambda: counter() >= hi, 600, 0.1, "90% of the backlog")
    c_hi, t_hi, cpu_hi, fl_hi = each(), time.perf_counter(), cpu(), counter(FLUSH_COUNTER)
    wait_until(lambda: counter() >= expected, 600, 0.1, "the whole backlog")
    if sum(c_hi) == sum(c_lo):  # scrapes slower than the drain (a worker starved of CPU answers late): the
        # 10-90 % window closed; the window is then from the end of the flood to the whole backlog
        c_lo, t_lo, cpu_lo, fl_lo = c_0, t_0, cpu_0, fl_0
        c_hi, t_hi, cpu_hi, fl_hi = each(), time.perf_counter(), cpu(), counter(FLUSH_COUNTER)
        if sum(c_hi) == sum(c_lo):  # and the worker kept up with a slow flood (a loaded machine): from the
            # flood's start, its producing included (a lower bound on the worker's rate)
            c_lo, t_lo, cpu_lo, fl_lo = start_each, t_start, cpu_start, fl_start
    per = tuple((b - a, y - x) for a, b, x, y in zip(c_lo, c_hi, cpu_lo, cpu_hi, strict=True))
    return BacklogWindow(sum(c_hi) - sum(c_lo), t_hi - t_lo, sum(cpu_hi) - sum(cpu_lo), fl_hi - fl_lo,
                         per if len(per) > 1 else ())


def dumps(obj: dict) -> str:
    return json.dumps(obj, sort_keys=False)


def print_result(result: dict, as_json: bool, width: int = 32) -> int:
    """A bench's figures: one JSON object, or a line each (the name padded to *width*); exit status 0."""
    if as_json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:{width}s} {v}")
    return 0


def wait_until(pred, timeout_s: float, interval_s: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def worker_bench_env(bootstrap: str, data_dir: Path, metrics_port: int, safety: bool, policy: str) -> dict[str, str]:
    """The environment of the worker a throughput bench starts: a recommendation every second of event time
    on a VPA day scaled to 86 s (usage that moves yields decisions within the run), the safety rules as
    :func:`safety_env` makes them, the deployed log level (the figures hold for a worker as deployed)."""
    from phasewise.kit.broker import free_port

    return {
        "PHASEWISE_BOOTSTRAP": bootstrap,
        "PHASEWISE_DATA_DIR": str(data_dir),
        "PHASEWISE_METRICS_PORT": str(metrics_port),
        "PHASEWISE_WEB_PORT": str(free_port()),
        "PHASEWISE_RECOMMEND_INTERVAL_S": "1",
        "PHASEWISE_VPA_TIME_SCALE": "0.001",
        "PHASEWISE_LOG_LEVEL": "info",
        **safety_env(safety),
        "PHASEWISE_POLICY": policy,
    }


def safety_env(on: bool, scale: float = 1 / 30) -> dict[str, str]:
    """The worker's safety-rule settings for a bench: on, with the rules' windows scaled by *scale* to the
    bench's minutes of backlog (the live 900 s of history, 300 s cooldown and 3600 s peak window become
    30 s, 10 s and 120 s: longer than the square waves' periods, so the rules work as live, on a run the
    length of a bench), or off (``--safety off``: what they cost)."""
    from phasewise.kit.settings import SPECS

    if not on:
        return {"PHASEWISE_SAFETY_RULES": "false"}
    out = {"PHASEWISE_SAFETY_RULES": "true"}
    for k in ("safety_min_history_s", "safety_cooldown_s", "safety_peak_window_s"):
        out[SPECS[k].env] = repr(SPECS[k].default * scale)
    return out
