"""``phasewise bench scaling``: 1, 2, 4 ... workers of one consumer group draining one samples backlog.

For each worker count N (``--workers 1,2,4``): a fresh embedded broker (the samples topic's 8 partitions),
N ``phasewise worker`` processes with one ``worker_id`` (one consumer group, each its own data directory and
metrics port), the same backlog as ``bench pipeline``'s (``--containers`` in hosts of ``--per-host``), and
the window from 10 % to 90 % of it: total samples/s, and each worker's samples/s, share of the samples
and CPU microseconds per sample. Narrative: docs/benchmarks.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from phasewise.apps.bench.harness import bench_hosts, drain_backlog, scrape, wait_until
from phasewise.kit.broker import EmbeddedBroker, free_port
from phasewise.kit.command import arg_type
from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.settings import Settings, above, at_least, parse_float, parse_int
from phasewise.kit.topics import SAMPLES

__all__ = ["add_arguments", "run", "run_one"]


def worker_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (each 1..16)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of worker counts: {text!r} (e.g. 1,2,4)") from None
    if not out or any(not 1 <= n <= 16 for n in out):
        raise argparse.ArgumentTypeError(f"worker counts must be 1..16, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    count, seconds = arg_type(parse_int, at_least(1)), arg_type(parse_float, above(0))
    p.add_argument("--workers", type=worker_counts, default=[1, 2, 4], help="worker counts to run, e.g. 1,2,4")
    p.add_argument("--containers", type=count, default=2000)
    p.add_argument("--per-host", type=count, default=25, help="containers per host message (more hosts spread "
                                                                "over the partitions more evenly)")
    p.add_argument("--seconds", type=seconds, default=20.0, help="ticks of backlog (one message per host each)")
    p.add_argument("--json", action="store_true")


def _ready(url: str) -> bool:
    try:
        return scrape(url).get("phasewise_worker_ready", 0.0) >= 1.0
    except OSError:
        return False


def run_one(n: int, args: argparse.Namespace, work: Path) -> dict:
    """One run with *n* workers on a fresh broker."""
    with EmbeddedBroker(log_path=work / f"broker-{n}.log") as broker:
        s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
        ensure_topics(s)
        group = f"scaling-{n}-{int(time.time())}"
        workers, urls = [], []
        try:
            for i in range(n):
                port = free_port()
                env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_WORKER_ID": group,
                       "PHASEWISE_DATA_DIR": str(work / f"w{n}-{i}"), "PHASEWISE_METRICS_PORT": str(port),
                       "PHASEWISE_WEB_PORT": "0", "PHASEWISE_RECOMMEND_INTERVAL_S": "1",
                       "PHASEWISE_VPA_TIME_SCALE": "0.001"}
                workers.append(RoleProcess("worker", [], env=env, log_path=work / f"worker-{n}-{i}.log").start())
                urls.append(f"http://127.0.0.1:{port}/metrics")

            def all_ready() -> bool:
                for w in workers:
                    if not w.alive():
                        raise RuntimeError("a worker exited:\n" + w.log_tail())
                return all(_ready(u) for u in urls)

            wait_until(all_ready, 300, 0.5, f"{n} workers ready")
            # a group of n settles through n joins: ready for a few seconds in a row
            t_stable = time.monotonic()
            while time.monotonic() - t_stable < 8.0:
                if not all_ready():
                    wait_until(all_ready, 120, 0.5, f"{n} workers ready again")
                    t_stable = time.monotonic()
                time.sleep(0.5)
            hosts = bench_hosts(args.containers, args.per_host, "scale")
            w = drain_backlog(make_producer(s, **{"linger.ms": 20}), SAMPLES.name, hosts, max(1, int(args.seconds)),
                              urls, [x.pid for x in workers])
        finally:
            for x in workers:
                x.stop()
    per = w.per_worker or ((w.samples, w.cpu_s),)
    total = w.samples / w.seconds if w.seconds > 0 else None
    return {"workers": n, "samples_per_s": None if total is None else round(total, 1),
            "per_worker": [{"samples_per_s": round(c / w.seconds, 1) if w.seconds > 0 else None,
                            "share": round(c / w.samples, 3) if w.samples else None,
                            "cpu_us_per_sample": round(cpu / c * 1e6, 1) if c else None} for c, cpu in per],
            "window_s": round(w.seconds, 2)}


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="phasewise-scaling-"))
    runs = [run_one(n, args, work) for n in args.workers]
    base = runs[0]["samples_per_s"]
    for r in runs:
        r["vs_first"] = round(r["samples_per_s"] / base, 2) if base and r["samples_per_s"] else None
    out = {"containers": args.containers, "per_host": args.per_host, "partitions": SAMPLES.partitions,
           "runs": runs, "logs": str(work)}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0
