"""Cost of the worker's VPA decision logic alone, without Kafka or Faust.

``phasewise bench logic`` (or ``python -m phasewise.apps.bench.logic``); docs/benchmarks.md, "What each bench
measures".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from phasewise.kit.records import ContainerSample, HostSamples, WorkloadPolicy
from phasewise.kit.settings import Settings
from phasewise.models.vpa.updater import process_host_samples
from phasewise.streams.config import state_cache, updater_config


def messages(containers: int, per_host: int, tick: int, seed: int = 0, signed: float = 0.0) -> list[HostSamples]:
    """One tick of every host's samples; a share *signed* of the containers are runs of 10 signed jobs."""
    rng = random.Random(seed * 1_000_003 + tick)
    every = round(1 / signed) if signed > 0 else 0
    jobs = [WorkloadPolicy(mode="apply", signature=f"job-{k}") for k in range(10)]
    out = []
    for h in range(0, containers, per_host):
        cs = tuple(
            ContainerSample(container=f"c{h + j}", cpu_cores=rng.uniform(0.1, 2.0) * (1 + (tick // 20 + j) % 2),
                            mem_bytes=rng.uniform(1e8, 2e9), cpu_limit_cores=4.0, mem_limit_bytes=8e9,
                            nr_periods=10, throttled_periods=rng.choice((0, 0, 0, 5)),
                            workload=jobs[(h + j) % 10] if every and (h + j) % every == 0 else None)
            for j in range(min(per_host, containers - h))
        )
        out.append(HostSamples(host=f"h{h // per_host}", ts=1.7e9 + tick, interval_s=1.0, containers=cs))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--containers", type=int, default=1000)
    p.add_argument("--per-host", type=int, default=100)
    p.add_argument("--ticks", type=int, default=60)
    p.add_argument("--recommend-interval", type=float,
                   default=Settings.default("recommend_interval_s"),
                   help="seconds (= ticks) between a container's recommendations")
    p.add_argument("--signed", type=float, default=0.0,
                   help="share of the containers whose workload has a signature (known-job priors), 0..1")


def run(a: argparse.Namespace) -> int:
    s = Settings.from_env({"recommend_interval_s": a.recommend_interval, "vpa_time_scale": 0.001}, env={})
    if not 0.0 <= a.signed <= 1.0:
        print(f"phasewise bench logic: error: --signed {a.signed}: a share in [0, 1]", file=sys.stderr)
        return 2
    ticks = [messages(a.containers, a.per_host, t, signed=a.signed) for t in range(a.ticks)]
    cache, config = state_cache(s), updater_config(s)
    decisions = profiles = 0
    logic = persist = 0.0
    state_bytes = 0
    for msgs in ticks:
        for m in msgs:
            t0 = time.perf_counter()
            decisions += len(process_host_samples(cache, m, config))
            t1 = time.perf_counter()
            profiles += len(cache.pop_profiles())
            for _k, st in cache.pop_dirty():
                state_bytes = len(json.dumps(st, separators=(",", ":")).encode())
            persist += time.perf_counter() - t1
            logic += t1 - t0
    n = a.containers * a.ticks
    print(json.dumps({
        "container_samples": n,
        "decisions": decisions,
        "signed_share": a.signed,
        "profiles": profiles,
        "us_per_sample_logic": round(logic / n * 1e6, 2),
        "us_per_sample_with_state_serialisation": round((logic + persist) / n * 1e6, 2),
        "state_bytes_per_container": state_bytes,
    }))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
