"""The experiment's inference service as a product service: its latency histogram and CPU counter in the
Prometheus text format, read by the autoscaler's scrape client; its port from ``$PORT`` (a replica's)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from phasewise.apps.experiment.inference import IN_FEATURES, make_server
from phasewise.streams.scrape import parse


def test_the_service_serves_the_exposition_the_autoscaler_reads():
    s = make_server(0)
    threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = s.server_address[1]
    try:
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"x": [[0.0] * IN_FEATURES]}).encode()
        for _ in range(3):
            req = urllib.request.Request(f"{url}/predict", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
        deadline = time.monotonic() + 30
        while True:  # a request is counted just after its answer is sent: wait for the third one
            with urllib.request.urlopen(f"{url}/metrics/prometheus", timeout=30) as r:
                got = parse(r.read().decode(), 1.0, "http_request_duration_seconds", "process_cpu_seconds_total")
            if got.count == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert got.count == 3 and got.buckets[-1] == (float("inf"), 3.0) and got.cpu_seconds > 0
    finally:
        s.shutdown()
        s.server_close()


def test_the_port_comes_from_the_environment_of_a_replica(monkeypatch):
    import phasewise.apps.experiment.inference as inf

    ports: list[int] = []
    monkeypatch.setattr(inf, "serve", lambda port, **kw: ports.append(port) or 0)
    monkeypatch.setenv("PORT", "18001")
    assert inf.main([]) == 0 and inf.main(["--port", "0"]) == 0
    monkeypatch.delenv("PORT")
    assert inf.main([]) == 0
    assert ports == [18001, 0, 0]
