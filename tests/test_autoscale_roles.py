"""Inference autoscaling through the real roles, on a private broker, with the cluster key on
(docs/priorities.md, "Inference autoscaling in the product").

``worker --priorities --autoscale`` and ``actuate --start-jobs``: a trusted submitter's inference service
(one request at a time, 100 ms each, its own Prometheus histogram) is placed by the priority agent and
started by the actuator behind its endpoint; under six closed-loop clients (a queue of six: ~600 ms) its p99
is over the 400 ms SLO, the autoscaler's signed ``scale`` decision (rule ``slo``) makes the actuator start a
second replica in its own cgroup, both answer through the same endpoint and the clients' median latency
falls (a queue of three each: ~300 ms, under the SLO and above half of it, so no scale-down while loaded);
when the load stops the service goes back to one replica. Needs root and cgroup v1 (real processes in real cgroups).
"""

from __future__ import annotations

import http.client
import threading
import time
import uuid

import pytest

from phasewise.actuators.backends.replicas import replica_container
from phasewise.kit.broker import free_port
from phasewise.kit.records import Actuation, Decision, JobEvent, JobRequests, JobService, encode
from phasewise.kit.topics import ACTUATIONS, DECISIONS, JOB_EVENTS
from tests.actuators.conftest import job_python
from tests.actuators.test_replicas import cgroup_of, free_ports
from tests.conftest import is_root
from tests.job_keys import KEY, submitted
from tests.test_job_trust_roles import REAL, Run, Topics, _key

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(not (is_root() and REAL), reason="needs root and cgroup v1 (real replicas)")]

#: the service: one request at a time (a model behind a lock), 100 ms each; its latency histogram and CPU
#: counter in the Prometheus text format on /metrics
SERVICE = """
import http.server, os, threading, time
BOUNDS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
model, lock, counts, total = threading.Lock(), threading.Lock(), [0] * 8, [0.0]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/metrics":
            with lock:
                out, c = ["# TYPE http_request_duration_seconds histogram"], 0
                for b, n in zip(BOUNDS, counts):
                    c += n
                    out.append('http_request_duration_seconds_bucket{le="%g"} %d' % (b, c))
                c += counts[-1]
                out += ['http_request_duration_seconds_bucket{le="+Inf"} %d' % c,
                        "http_request_duration_seconds_count %d" % c, "http_request_duration_seconds_sum %f" % total[0]]
            out += ["# TYPE process_cpu_seconds_total counter", "process_cpu_seconds_total %f" % time.process_time()]
            body = ("\\n".join(out) + "\\n").encode()
        else:
            t0 = time.monotonic()
            with model:
                time.sleep(0.1)
            d = time.monotonic() - t0
            with lock:
                counts[next((i for i, b in enumerate(BOUNDS) if d <= b), len(BOUNDS))] += 1
                total[0] += d
            body = str(os.getpid()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""


class Load:
    """*clients* closed-loop clients through 127.0.0.1:*port*: each request's latency and answering pid."""

    def __init__(self, port: int, clients: int = 6) -> None:
        self.port, self.stop = port, threading.Event()
        self.got: list[tuple[float, float, int | None]] = []  # (end time, latency s, pid)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            pid = None
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/predict")
                r = c.getresponse()
                pid = int(r.read()) if r.status == 200 else None
                c.close()
            except (OSError, ValueError, http.client.HTTPException):
                time.sleep(0.05)
                continue
            self.got.append((time.monotonic(), time.monotonic() - t0, pid))

    def quantile_ms(self, q: float, since: float, until: float = float("inf")) -> float:
        lat = sorted(x[1] for x in self.got if since <= x[0] < until)
        assert lat, "no request answered in the window"
        return lat[max(0, int(q * len(lat)) - 1)] * 1e3

    def first_answer(self, pid: int) -> float:
        return min(x[0] for x in self.got if x[2] == pid)

    def pids(self, since: float) -> set[int]:
        return {x[2] for x in self.got if x[0] >= since and x[2] is not None}

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def test_a_slow_service_gets_a_second_replica_through_the_real_roles_and_loses_it_when_idle(broker, tmp_path):
    run = Run(broker, tmp_path, f"as-{uuid.uuid4().hex[:6]}")
    key_file, ring = _key(tmp_path)
    topics = Topics(run.settings, ACTUATIONS, DECISIONS, JOB_EVENTS)
    tag = uuid.uuid4().hex[:6]
    signed = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file)}
    wport, port = free_port(), free_ports(4)
    job = f"svc-{tag}"
    load = None
    try:
        run.start("worker", ["--priorities", "--autoscale", "--autoscale-interval-s", "1",
                             "--autoscale-up-cooldown-s", "0", "--autoscale-down-cooldown-s", "3",
                             "--autoscale-slo-p99-ms", "400", "--web-port", "0", "--worker-id", f"as-{tag}",
                             "--data-dir", str(tmp_path / "w"), "--metrics-port", str(wport)],
                  {**signed, "PHASEWISE_PRIORITY_HOST_CPU_CORES": "4", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G",
                   "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(run.trusted)})
        run.actuator(signed)
        run.wait(lambda: run.ready(wport, "phasewise_worker_ready"), 240, "the worker ready")
        ev = submitted(job, (job_python(), "-c", SERVICE), key=KEY, host=run.host, ts=time.time(),
                       workload="inference", priority=5, requests=JobRequests(cpu_cores=0.5, mem_bytes=2**28),
                       service=JobService(port=port, max_replicas=2))
        run.send(JOB_EVENTS, job, encode(ev))

        def actuations(action: str) -> list[tuple[Decision, Actuation]]:
            topics.drain()
            ds = {d.id: d for d in topics.records(Decision, DECISIONS) if d.container == job and d.action == action}
            return [(ds[a.decision_id], a) for a in topics.records(Actuation, ACTUATIONS) if a.decision_id in ds]

        run.wait(lambda: actuations("place"), 180, "the service placed and started")
        (_, placed), = actuations("place")
        assert placed.status == "applied" and f"service endpoint 127.0.0.1:{port}" in placed.message, placed
        load = Load(port)
        t_load = time.monotonic()
        run.wait(lambda: actuations("scale"), 180, "a scale decision applied")
        (d, a), = actuations("scale")
        t_scaled = time.monotonic()
        assert (d.details["current"], d.details["replicas"], d.details["rule"]) == (1, 2, "slo"), d
        assert d.details["p99_ms"] > 400 and d.policy == "autoscaler"
        assert a.status == "applied" and "2 replica(s) [1, 2]" in a.message, a
        raw = [(k, v, h) for k, v, h in topics.got[DECISIONS.name] if decode_id(v) == d.id]
        assert ring.verify(DECISIONS.name, *raw[0]) is None  # signed with the cluster key
        run.wait(lambda: len(load.pids(t_scaled)) == 2, 60, "both replicas answering through the endpoint")
        pids = load.pids(t_scaled)
        groups = {cgroup_of(p) for p in pids}
        assert groups == {f"/{run.layout.prefix}/{replica_container(job, k)}" for k in (1, 2)}
        t_two = max(load.first_answer(p) for p in pids)
        time.sleep(8)  # (the load on two replicas, measured)
        one = [load.quantile_ms(q, t_load, t_scaled) for q in (0.5, 0.99)]
        two = [load.quantile_ms(q, t_two) for q in (0.5, 0.99)]
        print(f"clients through the endpoint: p50 {one[0]:.0f} ms, p99 {one[1]:.0f} ms with 1 replica; "
              f"p50 {two[0]:.0f} ms, p99 {two[1]:.0f} ms with 2")
        assert two[0] < one[0]  # a queue of three, not six
        load.close()
        run.wait(lambda: len(actuations("scale")) >= 2, 60, "the scale-down when idle")
        (d2, a2) = actuations("scale")[1]
        assert d2.details["replicas"] == 1 and a2.status == "applied" and "replica 2 stopped" in a2.message, a2
        assert not run.layout.exists(replica_container(job, 2))

        def scaled() -> list[JobEvent]:
            topics.drain()
            return [e for e in topics.records(JobEvent, JOB_EVENTS) if e.job == job and e.kind == "scaled"]

        # the actuator's count of each change, with the most it runs (the spec's max_replicas, 2)
        run.wait(lambda: len(scaled()) >= 2, 30, "the service's scaled states")
        assert [(e.replicas, e.max_replicas) for e in scaled()] == [(2, 2), (1, 2)]
    finally:
        if load is not None:
            load.close()
        topics.close()
        kill_services(run)  # (the actuator leaves the jobs it started running when it stops)
        run.close()


def kill_services(run: Run) -> None:
    """SIGKILL what the test's service replicas left in its cgroups."""
    import os
    import signal

    for c in run.layout.containers():
        procs = run.layout.path(c, "memory") / "cgroup.procs"
        for pid in procs.read_text().split() if procs.exists() else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while procs.exists() and procs.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)


def decode_id(v: bytes) -> str | None:
    from phasewise.kit.records import SchemaError, decode

    try:
        return decode(Decision, v).id
    except SchemaError:
        return None
