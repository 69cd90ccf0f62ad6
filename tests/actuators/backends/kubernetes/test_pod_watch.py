"""Job states from the node's pod watch, at the HTTP boundary (docs/kubernetes.md, "Job states from the pod watch").

A local server on 127.0.0.1 answers the list with a PodList fixture and the
watch (``watch=true``) with a watch stream fixture: newline-delimited watch
events (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``, ``ERROR``), sent
chunked as the API server sends them. The pods are in the API server's shape
(constructed for these tests, not captured from a cluster).
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import AWAY, Actuator
from phasewise.actuators.backends.kubernetes import KubeApi, KubernetesBackend, PodDirectory, PodWatch, pod_job_state
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import JOB_EVENTS
from tests.actuators.backends.kubernetes.apiserver import Loopback, serving
from tests.actuators.conftest import Recorder

FIX = Path(__file__).parents[2] / "fixtures" / "kubernetes"
SEL = "fieldSelector=spec.nodeName%3Dgpu-node-3"
LIST = f"/api/v1/pods?{SEL}"
KEY = b"w" * 40


def watch_path(rv: str) -> str:
    return f"/api/v1/pods?{SEL}&watch=true&allowWatchBookmarks=true&timeoutSeconds=300&resourceVersion={rv}"


class Server(Loopback):
    """Answers each ``(path, fixture)`` of its script in order: a ``.json`` fixture whole, a ``.ndjson`` one as
    a chunked watch stream, one event per chunk."""

    def __init__(self, script: list[tuple[str, str]]) -> None:
        self.script, self.seen = list(script), []
        srv = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                srv.seen.append((self.path, self.headers.get("Authorization")))
                if not srv.script or srv.script[0][0] != self.path:
                    self.send_error(598, f"unexpected {self.path}")
                    return
                _, fixture = srv.script.pop(0)
                raw = (FIX / fixture).read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if fixture.endswith(".ndjson"):
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for line in raw.splitlines(keepends=True):
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                self.close_connection = True

            def log_message(self, *a) -> None:
                pass

        self._serve(H)


@pytest.fixture
def serve():
    yield from serving(Server)


def actuator(srv: Server, ledger: Ledger) -> tuple[Actuator, Recorder, KubernetesBackend]:
    api = KubeApi(srv.url, token="tok-w")
    backend = KubernetesBackend(api, PodDirectory(api, "gpu-node-3"))
    rec = Recorder()
    act = Actuator(Settings().replace(host="gpu-node-3"), backend, ledger, rec,
                   metrics=ActuatorMetrics(CollectorRegistry()), keyring=Keyring(KEY))
    return act, rec, backend


def watch(act: Actuator, backend: KubernetesBackend) -> PodWatch:
    return PodWatch(backend.api, backend.node, act.pod_seen, act.pods_listed)


def test_pod_states_read_from_the_pods():
    got = {}
    for line in (FIX / "watch-jobs.ndjson").read_text().splitlines():
        ev = json.loads(line)
        s = pod_job_state(ev["object"], deleted=ev["type"] == "DELETED") if ev["type"] != "BOOKMARK" else None
        if s is not None:
            got.setdefault(s.job, []).append((s.kind, s.exit_code, s.signal, s.oom, s.run_s))
    assert got == {
        "job-b": [("started", None, None, False, None), ("failed", 137, "SIGKILL", True, 120.0),
                  ("failed", 137, "SIGKILL", True, 120.0), ("failed", 137, "SIGKILL", True, 120.0)],
        "job-a": [("finished", 0, None, False, 1200.0)],
        "job-c": [("started", None, None, False, None), ("failed", 3, None, False, 30.0)],
        "job-d": [("started", None, None, False, None), ("started", None, None, False, None),
                  ("gone", None, None, False, None)],
        "job-e": [("failed", None, None, False, None)],
    }
    pods = json.loads((FIX / "pods-jobs-on-node.json").read_text())["items"]
    assert [pod_job_state(p) and pod_job_state(p).kind for p in pods] == ["started", "finished", None]


def test_the_watch_publishes_each_job_state_once_signed_and_lists_again_when_too_old(serve, tmp_path):
    srv = serve((LIST, "pods-jobs-on-node.json"), (watch_path("5000"), "watch-jobs.ndjson"),
                (watch_path("5090"), "watch-gone.ndjson"))
    act, rec, backend = actuator(srv, Ledger(tmp_path / "ledger.sqlite"))
    w = watch(act, backend)
    rv = w.sync()
    assert rv == "5000"
    assert [(e.job, e.kind) for e in rec.job_events()] == [("job-a", "started"), ("job-old", "finished")]
    rv = w.follow(rv)
    assert rv == "5090"  # the last resourceVersion seen (a bookmark's included)
    assert [(e.job, e.kind) for e in rec.job_events()][2:] == [
        ("job-b", "started"), ("job-a", "finished"), ("job-b", "failed"), ("job-c", "started"), ("job-c", "failed"),
        ("job-d", "started"), ("job-d", "failed"), ("job-e", "failed")]  # job-b's repeats: nothing more
    ev = {e.job: e for e in rec.job_events() if e.kind != "started"}
    b = ev["job-b"]
    assert (b.oom, b.exit_code, b.signal, b.run_s, b.host, b.container) == (True, 137, "SIGKILL", 120.0,
                                                                           "gpu-node-3", "ml/train-b")
    assert b.reason == "container main: OOMKilled (exit code 137)"
    assert (ev["job-a"].exit_code, ev["job-a"].run_s, ev["job-a"].reason) == (0, 1200.0, None)
    assert ev["job-c"].reason == "container main: Error (exit code 3): loss is NaN" and ev["job-c"].exit_code == 3
    assert ev["job-d"].reason == "pod ml/train-d was deleted before it ended (phase Running)"
    assert ev["job-e"].reason.startswith("Evicted: The node was low on resource: memory.")
    for i, (t, k, v) in enumerate(rec.sent):
        assert t == JOB_EVENTS.name and Keyring(KEY).verify(t, k, v, rec.headers[i], now=ev["job-a"].ts) is None
    assert act.metrics.registry.get_sample_value("phasewise_actuator_job_ends_ignored_total") == 2  # job-b again
    # the server says the version is too old: list again
    assert w.follow(rv) is None
    assert [p for p, _ in srv.seen] == [LIST, watch_path("5000"), watch_path("5090")]
    assert {a for _, a in srv.seen} == {"Bearer tok-w"}


def test_a_restarted_actuator_reports_pods_gone_while_away_and_nothing_twice(serve, tmp_path):
    ledger = tmp_path / "ledger.sqlite"
    srv = serve((LIST, "pods-jobs-on-node.json"), (LIST, "pods-jobs-on-node.json"))
    act, rec, backend = actuator(srv, Ledger(ledger))
    w = watch(act, backend)
    w.sync()
    # a pod that ran when the actuator stopped, and is gone at its restart
    act.ledger.record_start("ml/train-z", job="job-z", decision="pod uid-z", backend="kubernetes", pid=None,
                            now=1795000000.0)
    act.ledger.close()
    act2, rec2, backend2 = actuator(srv, Ledger(ledger))
    watch(act2, backend2).sync()
    assert [(e.job, e.kind, e.reason) for e in rec2.job_events()] == [("job-z", "failed", f"{AWAY}: its pod is gone")]


def test_a_pod_this_actuator_deleted_for_a_terminate_decision_is_terminated(serve, tmp_path):
    srv = serve((LIST, "pods-jobs-on-node.json"), (watch_path("5000"), "watch-terminated.ndjson"))
    act, rec, backend = actuator(srv, Ledger(tmp_path / "ledger.sqlite"))
    w = watch(act, backend)
    w.follow(w.sync())
    assert backend.deleted == {}
    # the same stream, had this backend deleted uid-a (as its terminate records it)
    srv2 = serve((LIST, "pods-jobs-on-node.json"), (watch_path("5000"), "watch-terminated.ndjson"))
    act2, rec2, backend2 = actuator(srv2, Ledger(":memory:"))
    backend2.deleted["uid-a"] = 1795000000.0
    w2 = watch(act2, backend2)
    w2.follow(w2.sync())
    unasked = [e for e in rec.job_events("job-a") if e.kind != "started"]
    asked = [e for e in rec2.job_events("job-a") if e.kind != "started"]
    assert [(e.kind, e.exit_code, e.signal) for e in unasked] == [("failed", 143, "SIGTERM")]
    assert [(e.kind, e.exit_code, e.signal) for e in asked] == [("terminated", 143, "SIGTERM")]
    assert asked[0].reason == "its pod was deleted for a terminate decision (container main: Error (exit code 143))"


def test_the_watch_runs_on_its_own_thread_from_the_actuators_start(serve, tmp_path):
    srv = serve((LIST, "pods-jobs-on-node.json"), (watch_path("5000"), "watch-jobs.ndjson"))
    act, rec, backend = actuator(srv, Ledger(":memory:"))
    act.recover()  # what run_actuator does before serving: the pod watch starts
    try:
        assert rec.wait_job_event("job-e", "failed").reason.startswith("Evicted")
    finally:
        backend.close()
