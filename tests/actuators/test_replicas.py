"""Inference replicas as real processes (docs/priorities.md, "Inference autoscaling").

On real cgroups (v1) and real processes, as root: a placed inference service starts as one replica (as
``nobody``, ``PORT`` = its port + 1) behind its endpoint; a ``scale`` decision to 3 starts two more, each in
its own cgroup, and the one endpoint answers from all three; a ``scale`` back to 1 stops them, removes their
cgroups and the endpoint answers from the first alone; a terminate takes the whole service down. Scale
decisions pass the same trust rules as starting a job.
"""

from __future__ import annotations

import http.client
import os
import random
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import NOT_SCALING, Actuator
from phasewise.actuators.backends.replicas import Balancer, replica_container
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.records import Decision, JobRequests, JobService, encode
from tests.actuators.conftest import Recorder, job_backend, job_python, job_settings, remove_started_jobs
from tests.conftest import requires_root
from tests.job_keys import STRANGER, TRUSTED
from tests.job_keys import start as signed_start

V1 = Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists() and Path("/sys/fs/cgroup/freezer").is_dir()
real_v1 = pytest.mark.skipif(not V1, reason="no cgroup v1 cpuset and freezer hierarchies")

#: a service replica: answers GET with its pid on 127.0.0.1:$PORT (one connection per request: HTTP/1.0)
SERVE = """
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = str(os.getpid()).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""


def free_ports(n: int) -> int:
    """A port P with P .. P+n-1 free on loopback now, below the kernel's ephemeral range: the suite's many
    client connections take ephemeral ports, and one taken between this check and a replica's bind made a
    replica fail to start (a flake of the full suite)."""
    lo, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, max(10_001, lo - n - 1))
        if base + n >= lo:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise AssertionError("no free port range")


def ask(port: int, timeout: float = 5.0) -> int | None:
    """The pid that answered a GET on 127.0.0.1:*port*, or None."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", "/")
        r = c.getresponse()
        body = r.read()
        c.close()
        return int(body) if r.status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None


def answering(port: int, want: int, deadline_s: float = 60.0) -> set[int]:
    """The pids answering through *port*, asked until *want* distinct ones did (or the deadline)."""
    seen: set[int] = set()
    end = time.monotonic() + deadline_s
    while len(seen) < want and time.monotonic() < end:
        pid = ask(port)
        if pid is None:
            time.sleep(0.05)
            continue
        seen.add(pid)
    return seen


def cgroup_of(pid: int, controller: str = "memory") -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    raise AssertionError(f"pid {pid} has no {controller} cgroup")


@pytest.fixture
def layout():
    lay = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    yield lay


def service_start(job: str, port: int, argv: list[str], **svc) -> dict:
    return signed_start(job, tuple(argv), workload="inference", requests=JobRequests(cpu_cores=0.2),
                        service=JobService(port=port, **svc), ts=time.time() - 1)


def decision(job: str, action: str, details: dict) -> bytes:
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="h1", container=job, action=action,
                           policy="test", details=details))


def make_actuator(settings, backend, tmp_path) -> tuple[Actuator, Recorder]:
    rec = Recorder()
    return Actuator(settings, backend, Ledger(tmp_path / "ledger.sqlite"), rec, submitters=TRUSTED,
                    metrics=ActuatorMetrics(CollectorRegistry()), host_cores=2.0), rec


@requires_root
@real_v1
def test_a_service_scales_from_one_to_three_real_replicas_behind_one_endpoint_and_back(tmp_path, layout):
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    act, rec = make_actuator(s, backend, tmp_path)
    port = free_ports(5)
    job = f"svc-{uuid.uuid4().hex[:6]}"
    start = service_start(job, port, [job_python(), "-c", SERVE], max_replicas=4)
    try:
        a = act.handle(decision(job, "place", {"cpuset": None, "device": [], **start}), None, 0, 1)
        assert a.status == "applied", a.message
        assert f"service endpoint 127.0.0.1:{port} -> replica 1 on port {port + 1}" in a.message
        (first,) = answering(port, 1)
        assert first == act.ledger.started_job(job).pid
        assert cgroup_of(first).endswith(f"/{layout.prefix}/{job}")

        from phasewise.actuators.commands import SetCpuWeight

        assert backend.apply(SetCpuWeight(job, 3200)).status == "applied"  # (the service's priority weight)
        a = act.handle(decision(job, "scale", {**start, "replicas": 3}), None, 0, 2)
        assert a.status == "applied", a.message
        assert f"3 replica(s) [1, 2, 3] behind 127.0.0.1:{port}" in a.message
        # the new replicas run at the service's weight, not the default one
        assert a.message.count("cpu weight 3200") == 2, a.message
        for k in (2, 3):
            assert (layout.path(replica_container(job, k), "cpu") / "cpu.shares").read_text().strip() == "32768"
        pids = answering(port, 3)
        assert len(pids) == 3 and first in pids
        groups = {cgroup_of(p) for p in pids}
        assert groups == {f"/{layout.prefix}/{replica_container(job, k)}" for k in (1, 2, 3)}
        for p in pids:  # each as the job user, each with its own PORT
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{p}/environ").read_text().split("\0") if kv)
            st = os.stat(f"/proc/{p}")
            assert st.st_uid == 65534 and env["PHASEWISE_JOB"] in (job, replica_container(job, 2),
                                                                    replica_container(job, 3))
            assert int(env["PORT"]) in (port + 1, port + 2, port + 3)
        # each replica container is in the registry, its cpuset the first's
        for k in (2, 3):
            row = act.ledger.started_job(replica_container(job, k))
            assert row is not None and row.ended is None and row.pid in pids
            assert (layout.path(replica_container(job, k), "cpuset") / "cpuset.cpus").read_text() == \
                (layout.path(job, "cpuset") / "cpuset.cpus").read_text()
        # the service's scaled state says how many run and the most this actuator runs
        (sc,) = [e for e in rec.job_events(job) if e.kind == "scaled"]
        assert (sc.replicas, sc.max_replicas, sc.host, sc.container) == (3, 4, "h1", job) and sc.reason is None
        # replica 3 dies on its own: the service's scaled state says 2 run now
        third = act.ledger.started_job(replica_container(job, 3)).pid
        os.kill(third, signal.SIGKILL)
        rec.wait_for(lambda: [e for e in rec.job_events(job) if e.kind == "scaled" and e.replicas == 2])
        (sc,) = [e for e in rec.job_events(job) if e.kind == "scaled" and e.replicas == 2]
        assert "ended on its own" in sc.reason and replica_container(job, 3) in sc.reason
        pids = answering(port, 2)
        assert len(pids) == 2
        a = act.handle(decision(job, "scale", {**start, "replicas": 3}), None, 0, 21)
        assert a.status == "applied" and "3 replica(s)" in a.message, a.message
        pids = answering(port, 3)

        a = act.handle(decision(job, "scale", {**start, "replicas": 1}), None, 0, 3)
        assert a.status == "applied" and "1 replica(s) [1]" in a.message and "replica 3 stopped" in a.message
        assert [e.replicas for e in rec.job_events(job) if e.kind == "scaled"] == [3, 2, 3, 1]
        assert {ask(port) for _ in range(6)} == {first}
        for p in pids - {first}:
            assert not Path(f"/proc/{p}").exists() or "zombie" in Path(f"/proc/{p}/status").read_text()
        for k in (2, 3):
            assert not layout.exists(replica_container(job, k))
            assert act.ledger.started_job(replica_container(job, k)).ended is not None

        # the endpoints served are kept: a new actuator (a restart) opens them again
        act.replicas.close()
        assert ask(port, timeout=1) is None
        again, _ = make_actuator(s, backend, tmp_path)
        assert again.replicas.reopen() == 1 and answering(port, 1) == {first}
        # a terminate of the service ends its other replicas and its endpoint
        again.handle(decision(job, "scale", {**start, "replicas": 2}), None, 0, 4)
        assert len(answering(port, 2)) == 2
        own = again.ledger.started_job(job)
        assert own is not None
        t = again.handle(decision(job, "terminate", {"grace_s": 2}), None, 0, 5)
        assert t.status == "applied" and "endpoint 127.0.0.1" in t.message and "closed" in t.message, t.message
        assert ask(port, timeout=1) is None and not layout.exists(replica_container(job, 2))
        again.replicas.close()
    finally:
        act.replicas.close()
        remove_started_jobs(backend, layout)


@requires_root
@real_v1
def test_scale_decisions_pass_the_trust_rules_of_starting_a_job(tmp_path, layout):
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    act, rec = make_actuator(s, backend, tmp_path)
    port = free_ports(4)
    job = f"svc-{uuid.uuid4().hex[:6]}"
    start = service_start(job, port, [job_python(), "-c", SERVE], max_replicas=2)
    try:
        # not started by this actuator: nothing is started for it
        a = act.handle(decision(job, "scale", {**start, "replicas": 2}), None, 0, 1)
        assert a.status == "rejected" and "does not exist" in a.message
        assert act.handle(decision(job, "place", {"cpuset": None, "device": [], **start}), None, 0, 2).status == \
            "applied"
        # another spec of the job (even a trusted one), a stranger's signature: refused
        other = service_start(job, port, ["/bin/sh", "-c", "echo other"], max_replicas=2)
        a = act.handle(decision(job, "scale", {**other, "replicas": 2}), None, 0, 3)
        assert a.status == "rejected" and "not the spec its first replica was started with" in a.message, a.message
        stranger = signed_start(job, (job_python(), "-c", SERVE), key=STRANGER, workload="inference",
                                service=JobService(port=port), ts=time.time() - 1)
        assert act.handle(decision(job, "scale", {**stranger, "replicas": 2}), None, 0, 4).status == "rejected"
        # more than the signed spec's max_replicas: clamped, and the message names the rule
        a = act.handle(decision(job, "scale", {**start, "replicas": 9}), None, 0, 5)
        assert a.status == "clamped" and "lowered to its signed spec's service.max_replicas (2)" in a.message
        assert len(answering(port, 2)) == 2
        (sc,) = [e for e in rec.job_events(job) if e.kind == "scaled"]   # (the refused ones changed nothing)
        assert (sc.replicas, sc.max_replicas) == (2, 2) and "lowered to" in sc.reason
        a = act.handle(decision(job, "scale", {**start, "replicas": 0}), None, 0, 6)
        assert a.status == "clamped" and "raised to 1" in a.message
        bad = act.handle(decision(job, "scale", {**start, "replicas": "3"}), None, 0, 7)
        assert bad.status == "rejected" and "not an integer" in bad.message
    finally:
        act.replicas.close()
        remove_started_jobs(backend, layout)


def test_without_started_jobs_no_replica_is_started(tmp_path):
    from phasewise.actuators.backends import DryRunBackend
    from phasewise.kit.settings import Settings

    s = Settings().replace(host="h1", data_dir=str(tmp_path))
    act = Actuator(s, DryRunBackend(), Ledger(":memory:"), Recorder(), submitters=TRUSTED,
                   metrics=ActuatorMetrics(CollectorRegistry()), host_cores=2.0)
    start = service_start("svc", 20000, ["/bin/true"])
    a = act.handle(decision("svc", "scale", {**start, "replicas": 2}), None, 0, 1)
    assert a.status == "rejected" and a.message == NOT_SCALING


def test_the_balancer_hands_connections_in_turn_and_skips_a_replica_that_refuses():
    import threading

    servers = []
    for _ in range(2):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        servers.append(srv)

    def answer(srv: socket.socket, tag: bytes) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(100)
                conn.sendall(tag + data)

    for srv, tag in zip(servers, (b"a:", b"b:"), strict=True):
        threading.Thread(target=answer, args=(srv, tag), daemon=True).start()
    port = free_ports(1)
    b = Balancer(port)
    try:
        dead = free_ports(1)  # nothing listens there
        b.set_ports([servers[0].getsockname()[1], dead, servers[1].getsockname()[1]])
        got = []
        for i in range(4):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(f"q{i}".encode())
                c.shutdown(socket.SHUT_WR)
                got.append(c.recv(100))
        assert got == [b"a:q0", b"b:q1", b"a:q2", b"b:q3"]
        with pytest.raises(OSError, match="cannot listen"):
            Balancer(port)  # the port is the balancer's
        b.set_ports([])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            assert c.recv(10) == b""  # no replica: closed
    finally:
        b.close()
        for srv in servers:
            srv.close()
