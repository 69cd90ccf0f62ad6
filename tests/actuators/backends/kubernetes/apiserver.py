"""A local server that speaks the parts of the Kubernetes API a node's actuator uses for jobs, with state.

It holds pods (in the API server's shape: the fixtures' ``pod-pending-job.json``), answers the node's pod
list (``fieldSelector=spec.nodeName=...``, with and without ``resourceVersion=0``), a pod's ``GET``, a
``binding`` (``POST``; ``409`` when bound already) and the node's watch (``watch=true``, chunked, one JSON
event per line, from the requested ``resourceVersion``, bookmarks omitted). A bound pod then runs as a
kubelet would report it: ``MODIFIED`` Running, then Succeeded (or Failed with its exit code) after its run
time. It is not an API server: no admission, no authorisation, no field selectors but the node's.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIX = Path(__file__).parents[2] / "fixtures" / "kubernetes"


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Loopback:
    """An HTTP server on 127.0.0.1 (a free port) whose *handler* answers from a daemon thread: ``url``,
    :meth:`close`. The tests' stand-ins for the API server start one each."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # (its request threads are daemons)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serving(make: Callable[[list], Loopback]) -> Iterator[Callable[..., Loopback]]:
    """A fixture's body: ``start(*script)`` makes a server of *make* with that script; each is closed after."""
    made: list[Loopback] = []

    def start(*script: Any) -> Loopback:
        made.append(make(list(script)))
        return made[-1]

    yield start
    for s in made:
        s.close()


class ApiServer(Loopback):
    """Pods, bindings and the node's watch; :meth:`add_pod` before the actuator binds them."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.lock = threading.Condition()
        self.rv = 6000
        self.pods: dict[str, dict] = {}  # namespace/name -> pod
        self.log: list[tuple[int, str, dict]] = []  # (resourceVersion, type, pod) of the node's pods
        self.bindings: list[tuple[str, str]] = []  # (namespace/name, node)
        self.closing = False
        srv = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                srv._get(self)

            def do_POST(self) -> None:
                srv._post(self)

            def log_message(self, *a) -> None:
                pass

        self._serve(H)

    # -- the pods' lives ------------------------------------------------------------------------

    def add_pod(self, namespace: str, name: str, job: str, *, run_s: float = 1.0, exit_code: int = 0) -> None:
        pod = json.loads((FIX / "pod-pending-job.json").read_text())
        md = pod["metadata"]
        md.update(name=name, namespace=namespace, uid=f"uid-{name}", creationTimestamp=_stamp(time.time()))
        md["annotations"]["phasewise.io/job"] = job
        with self.lock:
            self.rv += 1
            md["resourceVersion"] = str(self.rv)
            self.pods[f"{namespace}/{name}"] = {"pod": pod, "run_s": run_s, "exit_code": exit_code}

    def _change(self, key: str, status: dict, kind: str = "MODIFIED") -> None:
        with self.lock:
            pod = self.pods[key]["pod"]
            pod["status"] = status
            self.rv += 1
            pod["metadata"]["resourceVersion"] = str(self.rv)
            self.log.append((self.rv, kind, copy.deepcopy(pod)))
            self.lock.notify_all()

    def _run(self, key: str) -> None:
        """What the kubelet would report for a bound pod: running, then its end."""
        entry = self.pods[key]
        time.sleep(0.3)
        began = time.time()
        main = {"name": "main", "image": "registry.example/train:2.1", "ready": True, "restartCount": 0,
                "containerID": f"containerd://{(key.encode().hex() * 8)[:64]}", "started": True}
        self._change(key, {"phase": "Running", "qosClass": "Guaranteed", "startTime": _stamp(began),
                           "containerStatuses": [{**main, "state": {"running": {"startedAt": _stamp(began)}}}]})
        time.sleep(entry["run_s"])
        code = entry["exit_code"]
        term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                "startedAt": _stamp(began), "finishedAt": _stamp(time.time())}
        self._change(key, {"phase": "Succeeded" if code == 0 else "Failed", "qosClass": "Guaranteed",
                           "startTime": _stamp(began),
                           "containerStatuses": [{**main, "ready": False, "started": False,
                                                  "state": {"terminated": term}}]})

    # -- HTTP ------------------------------------------------------------------------------------

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: Any) -> None:
        raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/api/v1/pods":
            if q.get("fieldSelector") != f"spec.nodeName={self.node}":
                self._send(h, 400, {"kind": "Status", "status": "Failure", "code": 400, "message": "selector"})
            elif q.get("watch") == "true":
                self._watch(h, int(q.get("resourceVersion") or 0), float(q.get("timeoutSeconds") or 300))
            else:
                with self.lock:
                    items = [copy.deepcopy(e["pod"]) for e in self.pods.values()
                             if e["pod"]["spec"].get("nodeName") == self.node]
                    rv = self.rv
                self._send(h, 200, {"kind": "PodList", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(rv)}, "items": items})
            return
        parts = url.path.strip("/").split("/")  # api v1 namespaces NS pods NAME
        if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            with self.lock:
                entry = self.pods.get(f"{parts[3]}/{parts[5]}")
                pod = copy.deepcopy(entry["pod"]) if entry else None
            if pod is None:
                self._send(h, 404, (FIX / "status-404-pod.json").read_bytes())
            else:
                self._send(h, 200, pod)
            return
        self._send(h, 404, {"kind": "Status", "status": "Failure", "code": 404, "message": f"no {url.path}"})

    def _post(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(n)) if n else {}
        parts = urllib.parse.urlsplit(h.path).path.strip("/").split("/")
        if not (len(parts) == 7 and parts[4] == "pods" and parts[6] == "binding"):
            self._send(h, 404, {"kind": "Status", "status": "Failure", "code": 404, "message": "no such path"})
            return
        key = f"{parts[3]}/{parts[5]}"
        node = ((body or {}).get("target") or {}).get("name")
        with self.lock:
            entry = self.pods.get(key)
            if entry is None:
                self._send(h, 404, (FIX / "status-404-pod.json").read_bytes())
                return
            if entry["pod"]["spec"].get("nodeName"):
                self._send(h, 409, (FIX / "status-409-bound.json").read_bytes())
                return
            entry["pod"]["spec"]["nodeName"] = node
            self.bindings.append((key, node))
        self._send(h, 201, (FIX / "status-201-success.json").read_bytes())
        if node == self.node:
            with self.lock:  # it matches the node's field selector now: ADDED to its watch
                self.rv += 1
                entry["pod"]["metadata"]["resourceVersion"] = str(self.rv)
                self.log.append((self.rv, "ADDED", copy.deepcopy(entry["pod"])))
                self.lock.notify_all()
            threading.Thread(target=self._run, args=(key,), daemon=True).start()

    def _watch(self, h: BaseHTTPRequestHandler, since: int, timeout_s: float) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        end = time.monotonic() + timeout_s
        try:
            while not self.closing and time.monotonic() < end:
                with self.lock:
                    news = [e for e in self.log if e[0] > since]
                    if not news:
                        self.lock.wait(0.1)
                        continue
                for rv, kind, pod in news:
                    line = json.dumps({"type": kind, "object": pod}).encode() + b"\n"
                    h.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    h.wfile.flush()
                    since = rv
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        h.close_connection = True

    def close(self) -> None:
        self.closing = True
        with self.lock:
            self.lock.notify_all()
        super().close()
