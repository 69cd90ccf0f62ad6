"""Two of ``experiment cluster``'s job programs (the third, training, is :mod:`.trainer`).

``python -m phasewise.apps.experiment.cluster_jobs service JOB --port P --seconds S``:
the experiment's torch inference service on loopback, printing a progress line
per window with its p99 latency (``metric=``, milliseconds) and the requests
served (``step=``); ``interactive JOB --seconds S``: a session of short bursts of
work between pauses. Each ends on its own after ``--seconds`` (exit 0) or at
SIGTERM. docs/results.md, "Jobs through every role".
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
import time

__all__ = ["main"]


def _stopper() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def service(job: str, port: int, seconds: float, window_s: float) -> int:
    from phasewise.apps.experiment.inference import make_server, scrape

    stop = _stopper()
    server = make_server(port, threads=1, window_s=window_s)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    print(f"job={job} phase=ready port={server.server_address[1]}", flush=True)

    t0 = time.monotonic()
    while not stop.wait(window_s) and time.monotonic() - t0 < seconds:
        snap = scrape(server.server_address[1], timeout_s=window_s) or {}
        p99 = snap.get("p99_ms")
        fields = f"job={job} phase=train step={int(snap.get('requests', 0))}"
        if p99 is not None and snap.get("window_requests"):
            fields += f" loss={p99 / 1e3:.5f} metric={p99:.2f}"
        print(fields, flush=True)
    server.shutdown()
    server.server_close()
    print(f"job={job} phase=done", flush=True)
    return 0


def interactive(job: str, seconds: float, seed: int) -> int:
    stop = _stopper()
    rnd = random.Random(seed)
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds and not stop.is_set():
        if stop.wait(rnd.uniform(0.5, 1.5)):  # the user thinks
            break
        end = time.monotonic() + rnd.uniform(0.1, 0.3)  # then runs a cell
        x = 0
        while time.monotonic() < end:
            x = (x * 1103515245 + 12345) % 2**31
        n += 1
        print(f"job={job} phase=train step={n}", flush=True)
    print(f"job={job} phase=done step={n}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phasewise.apps.experiment.cluster_jobs")
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("service")
    s.add_argument("job")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--window", type=float, default=2.0)
    i = sub.add_parser("interactive")
    i.add_argument("job")
    i.add_argument("--seconds", type=float, required=True)
    i.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.kind == "service":
        return service(a.job, a.port, a.seconds, a.window)
    return interactive(a.job, a.seconds, a.seed)


if __name__ == "__main__":
    sys.exit(main())
