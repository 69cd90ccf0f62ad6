"""A real inference service for the priorities experiment: a small torch model behind HTTP on loopback
(``python -m phasewise.apps.experiment.inference --port P``, or ``$PORT`` as a service replica), its
:class:`Replicas` and the open-loop :class:`Load`. ``GET /metrics`` is the experiment's JSON,
``GET /metrics/prometheus`` the text exposition the autoscaler agent scrapes (a latency histogram
``http_request_duration_seconds`` and ``process_cpu_seconds_total``). docs/priorities.md, "The experiment".
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["Load", "LoadResult", "Replicas", "build_model", "make_server", "scrape", "serve"]

IN_FEATURES = 64
MAX_ROWS = 64
MAX_BODY = 1 << 20


def build_model(seed: int = 0, width: int = 256):
    import torch

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(IN_FEATURES, width), torch.nn.ReLU()]
    for _ in range(2):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers).eval()


#: the latency histogram's bucket bounds (seconds) in the Prometheus exposition
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Stats:
    """Totals, a cumulative latency histogram and a sliding window of (end time, latency, busy seconds)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.lock = threading.Lock()
        self.requests = self.errors = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket (the last: above every bound)
        self.latency_sum = 0.0
        self.recent: deque[tuple[float, float, float]] = deque()
        self.started = time.monotonic()

    def add(self, latency_s: float, busy_s: float, ok: bool) -> None:
        now = time.monotonic()
        with self.lock:
            self.requests += 1
            self.errors += 0 if ok else 1
            self.buckets[next((i for i, b in enumerate(LATENCY_BUCKETS) if latency_s <= b), len(LATENCY_BUCKETS))] += 1
            self.latency_sum += latency_s
            self.recent.append((now, latency_s, busy_s))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()

    def snapshot(self) -> dict:
        now = time.monotonic()
        with self.lock:
            self._trim(now)
            lat = sorted(x[1] for x in self.recent)
            busy = sum(x[2] for x in self.recent)
            span = min(self.window_s, max(1e-3, now - self.started))
            return {"requests": self.requests, "errors": self.errors, "window_s": self.window_s,
                    "window_requests": len(lat), "p99_ms": _pct(lat, 0.99) * 1e3 if lat else None,
                    "p50_ms": _pct(lat, 0.5) * 1e3 if lat else None, "util": min(1.0, busy / span),
                    "cpu_seconds": time.process_time()}


    def prometheus(self) -> str:
        """The text exposition: every request's latency (a histogram, seconds) and this process's CPU seconds."""
        with self.lock:
            out = ["# HELP http_request_duration_seconds Request latency.",
                   "# TYPE http_request_duration_seconds histogram"]
            n = 0
            for b, c in zip(LATENCY_BUCKETS, self.buckets, strict=False):
                n += c
                out.append(f'http_request_duration_seconds_bucket{{le="{b}"}} {n}')
            n += self.buckets[-1]
            out += [f'http_request_duration_seconds_bucket{{le="+Inf"}} {n}',
                    f"http_request_duration_seconds_count {n}", f"http_request_duration_seconds_sum {self.latency_sum}"]
        out += ["# HELP process_cpu_seconds_total CPU seconds of this process.",
                "# TYPE process_cpu_seconds_total counter", f"process_cpu_seconds_total {time.process_time()}"]
        return "\n".join(out) + "\n"


def _pct(sorted_values: list[float], q: float) -> float:
    """The *q* quantile by the nearest-rank method."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def make_server(port: int, *, threads: int = 1, window_s: float = 5.0, seed: int = 0) -> ThreadingHTTPServer:
    """The service bound to 127.0.0.1:*port* (0: any free port), not yet serving."""
    import torch

    torch.set_num_threads(max(1, threads))
    model = build_model(seed)
    model_lock = threading.Lock()
    stats = Stats(window_s)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # one line per request would cost more than the request
            pass

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._answer(200, stats.snapshot())
            elif self.path == "/metrics/prometheus":
                data = stats.prometheus().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._answer(404, {"error": f"no such path {self.path[:80]!r}"})

        def do_POST(self) -> None:
            t0 = time.monotonic()
            busy = 0.0
            ok = False
            try:
                if self.path != "/predict":
                    self._answer(404, {"error": f"no such path {self.path[:80]!r}"})
                    return
                n = int(self.headers.get("Content-Length") or 0)
                if not 0 < n <= MAX_BODY:
                    self._answer(413 if n > MAX_BODY else 400, {"error": f"body of {n} bytes"})
                    return
                try:
                    x = json.loads(self.rfile.read(n))["x"]
                    if not (isinstance(x, list) and 0 < len(x) <= MAX_ROWS
                            and all(isinstance(r, list) and len(r) == IN_FEATURES for r in x)):
                        raise ValueError(f"x must be 1..{MAX_ROWS} rows of {IN_FEATURES} numbers")
                    t = torch.tensor(x, dtype=torch.float32)
                except (ValueError, KeyError, TypeError) as e:
                    self._answer(400, {"error": str(e)[:200]})
                    return
                with model_lock:
                    b0 = time.monotonic()
                    with torch.no_grad():
                        y = model(t).argmax(dim=1).tolist()
                    busy = time.monotonic() - b0
                self._answer(200, {"y": y})
                ok = True
            finally:
                stats.add(time.monotonic() - t0, busy, ok)

    server = _Server(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


class _Server(ThreadingHTTPServer):
    #: the listen backlog. socketserver's default (5) overflows when more than five connections arrive
    #: while the accepting thread waits for a CPU: the kernel drops the SYNs, and the client's first
    #: retransmission, 1 s later, made a late answer that no server-side time saw
    request_queue_size = 128


def serve(port: int, *, threads: int = 1, window_s: float = 5.0, ready_file: Path | None = None,
          seconds: float | None = None) -> int:
    """Run the service until SIGTERM / SIGINT or for *seconds* (then finish the requests in flight and exit 0)."""
    server = make_server(port, threads=threads, window_s=window_s)
    stop = threading.Event()

    def handler(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    port = server.server_address[1]
    print(f"serving on 127.0.0.1:{port}", flush=True)
    if ready_file is not None:
        ready_file.write_text(str(port))
    stop.wait(seconds)
    server.shutdown()
    server.server_close()
    return 0


def scrape(port: int, timeout_s: float = 1.0) -> dict | None:
    """A replica's ``/metrics``, or ``None`` when it does not answer."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        c.request("GET", "/metrics")
        r = c.getresponse()
        body = r.read()
        c.close()
        return json.loads(body) if r.status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None


# --------------------------------------------------------------------------- replicas


@dataclass
class Replica:
    name: str
    port: int
    proc: subprocess.Popen


class Replicas:
    """Service replicas as processes, each moved into its own managed cgroup by *place* before it serves."""

    def __init__(self, prefix: str, place: Callable[[str, int], None], unplace: Callable[[str], None],
                 log_dir: Path, *, threads: int = 1) -> None:
        self.prefix, self.place, self.unplace, self.log_dir, self.threads = prefix, place, unplace, log_dir, threads
        self.live: list[Replica] = []
        self.standby: dict[str, Replica] = {}  # started and loaded, not in the balancer
        self._n = 0
        self.lock = threading.Lock()
        self.max_seen = 0

    def ports(self) -> list[int]:
        with self.lock:
            return [r.port for r in self.live]

    def names(self) -> list[str]:
        with self.lock:
            return [r.name for r in self.live]

    def prestart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start replica *name* as a warm standby: loaded and answering, but sent no requests until
        :meth:`start` names it (a cold start costs seconds: the interpreter, torch, the model)."""
        r = self._spawn(name, timeout_s)
        with self.lock:
            self.standby[name] = r

    def start(self, name: str | None = None, timeout_s: float = 60.0) -> Replica:
        """One more replica in the balancer (named *name*, else ``<prefix>-<n>``): the standby of that name
        at once, else a cold start; returns when it answers."""
        self._n += 1
        name = name or f"{self.prefix}-{self._n}"
        with self.lock:
            r = self.standby.pop(name, None)
        if r is None:
            r = self._spawn(name, timeout_s)
        with self.lock:
            self.live.append(r)
            self.max_seen = max(self.max_seen, len(self.live))
        return r

    def _spawn(self, name: str, timeout_s: float) -> Replica:
        ready = self.log_dir / f"{name}.port"
        ready.unlink(missing_ok=True)
        log = open(self.log_dir / f"{name}.log", "w")
        # held before it imports torch: it waits on stdin until it is in its cgroup
        code = ("import sys; sys.stdin.readline(); from phasewise.apps.experiment.inference import main; "
                "raise SystemExit(main(sys.argv[1:]))")
        p = subprocess.Popen([sys.executable, "-c", code, "--port", "0", "--threads", str(self.threads),
                              "--ready-file", str(ready)], stdin=subprocess.PIPE, stdout=log,
                             stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(self.threads)})
        log.close()
        self.place(name, p.pid)
        p.stdin.write(b"go\n")
        p.stdin.close()
        deadline = time.monotonic() + timeout_s
        while not ready.exists() or not ready.read_text().strip():
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                self.unplace(name)
                tail = (self.log_dir / f"{name}.log").read_text()[-2000:]
                raise RuntimeError(f"replica {name} did not start: {tail}")
            time.sleep(0.05)
        return Replica(name, int(ready.read_text()), p)

    def stop_one(self) -> str | None:
        """Stop the newest replica (it leaves the balancer first); its name."""
        with self.lock:
            if not self.live:
                return None
            r = self.live.pop()
        self._stop(r)
        return r.name

    def _stop(self, r: Replica) -> None:
        r.proc.send_signal(signal.SIGTERM)
        try:
            r.proc.wait(10)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
        self.unplace(r.name)

    def close(self) -> None:
        while self.stop_one() is not None:
            pass
        with self.lock:
            standby, self.standby = list(self.standby.values()), {}
        for r in standby:
            self._stop(r)


# --------------------------------------------------------------------------- load


@dataclass
class LoadResult:
    latencies_ms: list[float] = field(default_factory=list)  #: of requests answered 200
    failed: int = 0   #: errors and timeouts
    shed: int = 0     #: arrivals that found every worker busy
    sent: int = 0
    timeline: list[tuple[float, float]] = field(default_factory=list)  #: (arrival offset s, latency ms or inf)

    def violations(self, slo_ms: float) -> int:
        return sum(1 for x in self.latencies_ms if x > slo_ms) + self.failed + self.shed

    def total(self) -> int:
        return len(self.latencies_ms) + self.failed + self.shed


class Load:
    """Open-loop requests at ``rate(t)`` per second, at most *workers* in flight, round-robin over ``ports()``."""

    def __init__(self, ports: Callable[[], list[int]], rate: Callable[[float], float], *, workers: int = 32,
                 timeout_s: float = 2.0, rows: int = 8, seed: int = 0) -> None:
        import random

        self.ports, self.rate, self.timeout_s = ports, rate, timeout_s
        rnd = random.Random(seed)
        self.body = json.dumps({"x": [[rnd.uniform(-1, 1) for _ in range(IN_FEATURES)] for _ in range(rows)]}
                               ).encode()
        self.result = LoadResult()
        self.lock = threading.Lock()
        self.sem = threading.BoundedSemaphore(workers)
        self.rnd = rnd
        self.stop = threading.Event()
        self.rr = 0

    def _one(self, port: int, t_arr: float, t0: float) -> None:
        lat = math.inf
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=self.timeout_s)
            c.request("POST", "/predict", self.body, {"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            c.close()
            if r.status == 200:
                lat = (time.monotonic() - t_arr) * 1e3
        except (OSError, http.client.HTTPException):
            pass
        finally:
            self.sem.release()
        with self.lock:
            if math.isfinite(lat):
                self.result.latencies_ms.append(lat)
            else:
                self.result.failed += 1
            self.result.timeline.append((t_arr - t0, lat))

    def run(self, duration_s: float) -> LoadResult:
        """Send for *duration_s* seconds, then wait for the requests in flight (at most the client timeout)."""
        t0 = time.monotonic()
        nxt = t0  # the next arrival (open loop: arrivals do not wait for answers, late ones go at once)
        threads: list[threading.Thread] = []
        while not self.stop.is_set():
            now = time.monotonic()
            if now - t0 >= duration_s:
                break
            if now < nxt:
                time.sleep(min(nxt - now, 0.2))
                continue
            arrival = nxt
            nxt += self.rnd.expovariate(max(1e-3, self.rate(nxt - t0)))
            ports = self.ports()
            with self.lock:
                self.result.sent += 1
            if not ports or not self.sem.acquire(blocking=False):
                with self.lock:
                    self.result.shed += 1
                    self.result.timeline.append((arrival - t0, math.inf))
                continue
            self.rr += 1
            th = threading.Thread(target=self._one, args=(ports[self.rr % len(ports)], arrival, t0), daemon=True)
            th.start()
            threads.append(th)
            if len(threads) > 256:
                threads = [t for t in threads if t.is_alive()]
        for th in threads:
            th.join(self.timeout_s + 1)
        return self.result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phasewise.apps.experiment.inference",
                                description="serve the experiment's torch model over HTTP on 127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT") or 0),
                   help="port on 127.0.0.1 (default: $PORT, a service replica's; 0: any free one)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--window", type=float, default=5.0, help="seconds of the p99 / utilisation window")
    p.add_argument("--ready-file", type=Path, help="write the bound port here once serving")
    p.add_argument("--seconds", type=float, default=None, help="serve this long, then exit 0 (default: until "
                                                                "SIGTERM)")
    a = p.parse_args(argv)
    return serve(a.port, threads=a.threads, window_s=a.window, ready_file=a.ready_file, seconds=a.seconds)


if __name__ == "__main__":
    raise SystemExit(main())
