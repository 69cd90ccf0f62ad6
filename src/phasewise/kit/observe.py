"""Every role's HTTP endpoint on ``metrics_port``: ``/metrics``, ``/healthz``, ``/readyz``, its own JSON views.

:class:`Health` holds the loops' heartbeats and the role's readiness test; both health answers are
one line of plain text (docs/deployment.md, "Metrics"; docs/runbooks.md).
"""

from __future__ import annotations

import json
import platform
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from phasewise import __version__

__all__ = ["Health", "HealthServer", "build_info", "serve"]

#: the role names ``phasewise_build_info{role}`` takes
ROLES = ("producer", "worker", "actuator", "horus", "place")


def build_info(registry: CollectorRegistry, role: str) -> Gauge:
    """``phasewise_build_info{version, python, role} 1`` on *registry*."""
    g = Gauge("phasewise_build_info", "phasewise version and Python of this process (always 1)",
              ["version", "python", "role"], registry=registry)
    g.labels(version=__version__, python=platform.python_version(), role=role).set(1)
    return g


class Health:
    """A role's liveness (its loops' heartbeats) and readiness (its own test).

    *ready*: returns None when ready, else why not (one line).
    """

    def __init__(self, ready: Callable[[], str | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ready = ready
        self.clock = clock
        self._lock = threading.Lock()
        self._beats: dict[str, tuple[float, float]] = {}  # loop -> (last beat, allowance s)

    def beat(self, loop: str, allowance_s: float) -> None:
        """Loop *loop* is alive now; it is dead if it does not beat again within *allowance_s*."""
        with self._lock:
            self._beats[loop] = (self.clock(), allowance_s)

    def since(self, loop: str) -> float | None:
        """Seconds since *loop*'s last beat (None: never)."""
        with self._lock:
            b = self._beats.get(loop)
        return None if b is None else self.clock() - b[0]

    def live(self) -> str | None:
        """None while every loop beat within its allowance; else which did not."""
        now = self.clock()
        with self._lock:
            late = [(name, now - at) for name, (at, allow) in self._beats.items() if now - at > allow]
        if late:
            return "; ".join(f"{name} loop silent for {s:.0f} s" for name, s in late)
        return None

    def ready(self) -> str | None:
        why = self.live()
        if why is not None:
            return why
        if self._ready is None:
            return None
        try:
            return self._ready()
        except Exception as e:  # noqa: BLE001 - a probe answers, it does not crash the server
            return f"readiness check failed: {type(e).__name__}: {e}"


class HealthServer:
    """The HTTP server (a daemon thread) of :func:`serve`; ``port`` is the one bound."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self.server = server
        self.thread = thread
        self.address, self.port = server.server_address[:2]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: a JSON view: the request's query (first value of each name) -> (HTTP status, JSON body)
View = Callable[[dict[str, str]], tuple[int, Any]]


def serve(registry: CollectorRegistry, port: int, health: Health, addr: str = "127.0.0.1",
          views: Mapping[str, View] | None = None) -> HealthServer:
    """``/metrics``, ``/healthz``, ``/readyz`` and *views* (path -> :data:`View`) on *addr*:*port* (0: any
    free port), in a daemon thread. A view runs on the server's thread: one that reads state another
    thread changes hands the work to that thread itself (the worker's runs on its event loop)."""
    views = dict(views or {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path, _, query = self.path.partition("?")
            view = views.get(path)
            if view is not None:
                q = {k: v[0] for k, v in urllib.parse.parse_qs(query).items()}
                try:
                    status, body = view(q)
                except Exception as e:  # noqa: BLE001 - a view answers, it does not crash the server
                    status, body = 500, {"error": f"{type(e).__name__}: {e}"}
                self._send(status, json.dumps(body).encode(), "application/json")
            elif path == "/metrics":  # ?name[]=S&name[]=...: only those samples (prometheus_client's own filter)
                names = urllib.parse.parse_qs(query).get("name[]")
                self._send(200, generate_latest(registry.restricted_registry(names) if names else registry),
                           CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/livez"):
                self._answer(health.live())
            elif path == "/readyz":
                self._answer(health.ready())
            else:
                known = ", ".join(["/metrics", "/healthz", "/readyz", *views])
                self._send(404, f"not found: {known}\n".encode(), "text/plain; charset=utf-8")

        def _answer(self, why: str | None) -> None:
            body = b"ok\n" if why is None else why.encode() + b"\n"
            self._send(200 if why is None else 503, body, "text/plain; charset=utf-8")

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes and probes every few seconds: not logged
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="phasewise-http", daemon=True)
    thread.start()
    return HealthServer(server, thread)
