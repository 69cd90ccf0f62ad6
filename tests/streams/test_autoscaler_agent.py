"""The autoscaler agent on a real worker (``phasewise worker --autoscale``) and a private broker: a signed,
started inference service whose replica's own Prometheus endpoint shows a p99 over its SLO gets a ``scale``
decision naming the rule; a service no trusted submitter signed gets none; a record the agent cannot read is
a dead letter (the step itself: tests/models/jobs/test_autoscaler.py)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from phasewise.kit.records import Decision, JobEvent, JobRequests, JobService, encode
from tests.job_keys import STRANGER, submitted, write_public


class SlowService:
    """A replica's metrics endpoint: every scrape, 50 more requests, all between 0.5 and 1 s."""

    def __init__(self) -> None:
        self.scrapes = 0
        me = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                me.scrapes += 1
                n = 50 * me.scrapes
                body = (f'# TYPE http_request_duration_seconds histogram\n'
                        f'http_request_duration_seconds_bucket{{le="0.5"}} 0\n'
                        f'http_request_duration_seconds_bucket{{le="1.0"}} {n}\n'
                        f'http_request_duration_seconds_bucket{{le="+Inf"}} {n}\n'
                        f'http_request_duration_seconds_count {n}\n'
                        f'http_request_duration_seconds_sum {0.8 * n}\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        for _ in range(100):  # a port P whose P + 1 is free: the replica listens there
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1] - 1
            if 1024 <= self.port <= 65535 - 64:
                try:
                    self.server = ThreadingHTTPServer(("127.0.0.1", self.port + 1), H)
                    break
                except OSError:
                    continue
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.broker
@pytest.mark.slow
def test_a_real_worker_scales_a_slow_signed_service_and_no_unsigned_one(broker, tmp_path):
    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port
    from phasewise.kit.kafka.client import ensure_topics, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS
    from tests.test_poison import Reader, Sent, dead_letters, records, wait

    settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(settings)
    keys = tmp_path / "submitters"
    keys.mkdir()
    write_public(keys / "ops.pub")
    tag = uuid.uuid4().hex[:6]
    host = f"scale-{tag}"
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(keys)}
    args = ["--autoscale", "--autoscale-interval-s", "1", "--autoscale-up-cooldown-s", "0",
            "--autoscale-slo-p99-ms", "300", "--web-port", "0", "--worker-id", f"scale-{tag}",
            "--data-dir", str(tmp_path / "data"), "--metrics-port", str(port), "--host", host]
    svc, stranger = SlowService(), SlowService()
    role = RoleProcess("worker", args, env=env, log_path=tmp_path / "worker.log").start()
    try:
        wait(lambda: _ready(scrape, port), 240, "worker ready", role)  # (a busy machine: minutes)
        decisions = Reader(settings, DECISIONS.name, DECISIONS.partitions)
        letters = Reader(settings, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
        sent = Sent(make_producer(settings), JOB_EVENTS.name)
        now = time.time()
        for job, service, key in ((f"{tag}-svc", svc, None), (f"{tag}-rogue", stranger, STRANGER)):
            kw = {} if key is None else {"key": key}
            ev = submitted(job, ("/srv/serve",), ts=now, workload="inference", requests=JobRequests(cpu_cores=0.5),
                           service=JobService(port=service.port), **kw)
            sent.send(job.encode(), encode(ev), f"submitted:{job}")
            sent.send(job.encode(), encode(JobEvent(job=job, ts=now + 0.1, kind="started", host=host, container=job,
                                                    pid=4242, workload="inference")), f"started:{job}")
        sent.send(b"x", b'{"job": "x", "kind": "started"}', "poison:schema")
        sent.p.flush(10)

        def mine() -> list[Decision]:
            return [d for d in records(Decision, decisions.drain()) if d.host == host]

        wait(lambda: mine(), 120, "a scale decision", role)
        d = mine()[0]
        assert (d.action, d.container, d.policy) == ("scale", f"{tag}-svc", "autoscaler")
        assert (d.details["current"], d.details["replicas"], d.details["rule"]) == (1, 2, "slo")
        assert 500 < d.details["p99_ms"] <= 1000 and d.details["slo_p99_ms"] == 300
        assert d.details["job_signature"].startswith("ed25519:") and d.details["service"]["port"] == svc.port
        assert stranger.scrapes == 0  # a service no trusted submitter signed is not followed at all
        (poison,) = sent.where("poison:")
        wait(lambda: poison in dead_letters(letters.drain(), JOB_EVENTS.name), 30, "the dead letter", role)
        m = scrape(f"http://127.0.0.1:{port}/metrics")
        assert m['phasewise_autoscaler_decisions_total{rule="slo"}'] >= 1 and m["phasewise_autoscaler_services"] == 1
        assert role.alive()
        for r in (decisions, letters):
            r.close()
    finally:
        role.stop()
        svc.close()
        stranger.close()
    assert role.returncode() == 0, role.log_tail(40)


def _ready(scrape, port) -> bool:
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0
    except OSError:
        return False
