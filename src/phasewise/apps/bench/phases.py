"""``phasewise bench phases``: the phase detector with the CRBM in the loop, samples/s (the pure step in
process, and a real ``worker --policy phase``) and memory per container. docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from phasewise.apps.bench.harness import (
    bench_hosts,
    drain_backlog,
    host_message,
    print_result,
    rss_bytes,
    scrape,
    square_wave_gpu,
    square_wave_usage,
    wait_until,
    worker_bench_env,
)
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import decode_host_samples, encode
from phasewise.models.phases.detector import PhaseModel, learn, relative_usage
from phasewise.models.phases.fleet import PhaseFleet


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import arg_type
    from phasewise.kit.settings import SPECS, above, at_least, parse_float, parse_int, parse_str

    count = arg_type(parse_int, at_least(1))
    p.add_argument("--containers", type=count, default=1000)
    p.add_argument("--seconds", type=arg_type(parse_float, above(0)), default=20.0,
                   help="ticks in the worker's backlog")
    p.add_argument("--per-host", type=count, default=100, help="containers per host message")
    p.add_argument("--pure-ticks", type=count, default=30, help="ticks of the in-process step measurement")
    p.add_argument("--pure-only", action="store_true", help="skip the worker measurement")
    p.add_argument("--safety", choices=["on", "off"], default="on",
                   help="the worker's safety rules (default on, their windows scaled to the bench's minutes; "
                        "off: to measure what they cost)")
    p.add_argument("--bootstrap", help="use this Kafka instead of an embedded broker")
    features = SPECS["phase_features"]
    p.add_argument("--features", default=features.default,
                   type=arg_type(parse_str, features.validate),
                   help="the detector's frame features (the worker's phase_features): cpu,mem or with gpu,gpu_mem "
                        "(the samples then carry GPU use following the same square waves)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep-logs", action="store_true", help="print where role logs are kept")


def _hosts(n: int, per_host: int) -> list[tuple[str, list[str]]]:
    return bench_hosts(n, per_host, "phb")


def _usage(n: int, t: float, seed: int, features: tuple[str, ...]) -> np.ndarray:
    """(n, len(features)) usage at tick *t*: the bench's square waves (GPU columns follow the same waves)."""
    cols = dict(zip(("cpu", "mem"), square_wave_usage(n, t, seed)))
    if "gpu" in features or "gpu_mem" in features:
        cols.update(zip(("gpu", "gpu_mem"), square_wave_gpu(n, t, seed)))
    return np.stack([cols[f] for f in features], axis=1)


def warm_model(seed: int = 0, features: tuple[str, ...] = ("cpu", "mem")) -> PhaseModel:
    """A PhaseModel trained on the benchmark's usage, with (absolute and relative) statistics for its phases."""
    m = PhaseModel(features=features, seed=seed)
    L = m.window_len
    frames = np.stack([_usage(200, t, 7, m.features) for t in range(40)], axis=1)  # (200, 40, F)
    W = np.concatenate([frames[:, k:k + L] for k in range(40 - L)])
    for _ in range(3):
        learn(m, W)
    P = m.predict(W)
    m.clusterer.update_stats(P, W[:, -1])
    # relative statistics (the worker's default): usage / the container's level just before the frame,
    # the level taken as the running max of its usage (the fleet keeps a slowly decaying max)
    level = np.maximum.accumulate(frames, axis=1)
    m.clusterer.update_rel_stats(P, relative_usage(W[:, -1], np.concatenate([level[:, k + L - 2]
                                                                             for k in range(40 - L)])))
    if not m.ready:
        raise RuntimeError("benchmark model did not warm up")
    return m


def pure_rate(model: PhaseModel, hosts: list[tuple[str, list[str]]], ticks: int) -> tuple[float, float, int]:
    """(container samples/s of decode + fleet step, bytes per container, phase changes)."""
    feats = model.features
    gpu = feats != ("cpu", "mem")
    fleet = PhaseFleet(model, frozen=True, limited=("cpu", "mem"))
    msgs = []
    for k in range(ticks):
        for i, (host, cs) in enumerate(hosts):
            cpu, mem = square_wave_usage(len(cs), k, i)
            g, gm = square_wave_gpu(len(cs), k, i)
            msgs.append(host_message(host, 1.7e9 + k, cs, cpu.tolist(), mem.tolist(), cpu_limit=2.0, mem_limit=4e9,
                                     gpu=g.tolist() if gpu else None, gpu_mem=gm.tolist() if gpu else None))
    fields = [{"cpu": "cpu_cores", "mem": "mem_bytes", "gpu": "gpu_util", "gpu_mem": "gpu_mem_bytes"}[f]
              for f in feats]
    n = 0
    changes = 0
    t0 = time.perf_counter()
    for raw in msgs:
        hs = decode_host_samples(raw)
        keys = [f"{hs.host}/{c.container}" for c in hs.containers]
        X = np.array([[getattr(c, f) for f in fields] for c in hs.containers], dtype=np.float64)
        fb = np.full((len(keys), len(feats)), np.nan)
        fb[:, :2] = [(c.cpu_limit_cores or np.nan, c.mem_limit_bytes or np.nan) for c in hs.containers]
        out = fleet.step(hs.ts, keys, X, fallback_limits=fb, host=hs.host)
        changes += len(out.changes)
        n += len(keys)
    dt = time.perf_counter() - t0
    return n / dt, fleet.state_bytes(), changes


def worker_rate(args: argparse.Namespace, model: PhaseModel, hosts: list[tuple[str, list[str]]],
                workdir: Path) -> dict:
    from phasewise.kit.broker import EmbeddedBroker, free_port
    from phasewise.kit.kafka.client import ensure_topics, make_producer
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import MODELS, SAMPLES
    from phasewise.models.phases.snapshots import model_name, snapshot_of

    broker = None if args.bootstrap else EmbeddedBroker(log_path=workdir / "broker.log").start()
    bootstrap = args.bootstrap or broker.bootstrap
    worker = None
    try:
        s = Settings.from_env({"bootstrap": bootstrap}, env={})
        ensure_topics(s)
        producer = make_producer(s, **{"linger.ms": 20})
        # the detectors start from this warm snapshot (a newer one than any on the topic)
        snap = snapshot_of(model, int(time.time()), int(model.crbm.n_seen), time.time())
        producer.produce(MODELS.name, key=model_name(model.features).encode(), value=encode(snap))
        producer.flush(10)
        metrics_port = free_port()
        env = {
            **worker_bench_env(bootstrap, workdir / "worker", metrics_port, getattr(args, "safety", "on") == "on",
                               "phase"),
            "PHASEWISE_PHASE_FEATURES": ",".join(model.features),
            "PHASEWISE_WORKER_ID": f"phasewise-bench-phases-{snap.version}",
        }
        worker = RoleProcess("worker", [], env=env, log_path=workdir / "worker.log").start()
        url = f"http://127.0.0.1:{metrics_port}/metrics"

        def ready() -> bool:
            if not worker.alive():
                raise RuntimeError("worker exited:\n" + worker.log_tail())
            try:
                m = scrape(url)
            except OSError:
                return False
            return (m.get("phasewise_worker_ready", 0.0) >= 1.0
                    and m.get("phasewise_worker_model_version", 0) >= snap.version)

        wait_until(ready, 120, what="the worker to be ready on the warm snapshot")
        rss0 = rss_bytes(worker.pid)
        w = drain_backlog(producer, SAMPLES.name, hosts, max(1, int(args.seconds)), url, worker.pid,
                          gpu=model.features != ("cpu", "mem"))
        m = scrape(url)
        rss1 = rss_bytes(worker.pid)
        return {
            # null when the backlog drained between two scrapes (too small to time)
            "samples_per_s": round(w.samples / w.seconds, 1) if w.samples > 0 and w.seconds > 0 else None,
            # the same window: the worker's CPU (all threads) per sample, and how much of the
            # window went to flushes before offset commits (outputs, changelog records)
            "worker_cpu_us_per_sample": round(w.cpu_us_per_sample, 1),
            "worker_commit_flush_s_in_window": round(w.flush_s, 3),
            "window_s": round(w.seconds, 3),
            "worker_rss_bytes_per_container": round(max(0.0, (rss1 - rss0) / args.containers), 1),
            "worker_phase_changes": int(m.get("phasewise_worker_phase_changes_total", 0)),
            "worker_decisions": int(m.get("phasewise_worker_decisions_total", 0)),
            "worker_model_version": int(m.get("phasewise_worker_model_version", 0)),
        }
    finally:
        if worker is not None:
            worker.stop()
        if broker:
            broker.stop()


def run_bench(args: argparse.Namespace) -> dict:
    from phasewise.kit.settings import PhaseSettings

    features = PhaseSettings(features=args.features).feature_tuple()
    workdir = Path(tempfile.mkdtemp(prefix="phasewise-bench-phases-"))
    hosts = _hosts(args.containers, args.per_host)
    from phasewise.streams.worker import single_threaded_torch

    threads = single_threaded_torch()  # as the --policy phase worker runs torch
    model = warm_model(features=features)
    pure, state_bytes, changes = pure_rate(PhaseModel.from_bytes(model.to_bytes()), hosts, args.pure_ticks)
    out = {
        "samples_per_s": None,
        "bytes_per_container": round(state_bytes, 1),
        "pure_step_samples_per_s": round(pure, 1),
        "decode_included": True,
        "torch_threads": threads,
        "pure_phase_changes": changes,
        "containers": args.containers,
        "features": ",".join(features),
        "safety": getattr(args, "safety", "on"),
        "per_host": args.per_host,
        "phases_open": len(model.clusterer.phase_ids),
    }
    if not args.pure_only:
        out.update(worker_rate(args, model, hosts, workdir))
    out["logs"] = str(workdir) if args.keep_logs else None
    return out


def run(args: argparse.Namespace) -> int:
    return print_result(run_bench(args), args.json, 32)


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
