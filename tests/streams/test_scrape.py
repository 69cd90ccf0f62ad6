"""The autoscaler's Prometheus scrape client: the text exposition format as prometheus_client writes it (and as
other clients do), summed over labels; what is not usable is a one-line reason; the HTTP fetch, bounded."""

from __future__ import annotations

import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from phasewise.models.jobs.autoscaler import Target
from phasewise.streams.scrape import ScrapeError, fetch, parse, scrape_target

INF = math.inf


def exposition() -> str:
    """A service's metrics as prometheus_client serves them: a labelled latency histogram and a CPU counter."""
    reg = CollectorRegistry()
    h = Histogram("http_request_duration_seconds", "latency", ["path"], buckets=(0.01, 0.1, 1.0), registry=reg)
    for v in (0.005, 0.005, 0.05, 0.5):
        h.labels(path="/predict").observe(v)
    h.labels(path="/health").observe(0.001)
    Counter("process_cpu_seconds", "cpu", registry=reg).inc(12.5)
    return generate_latest(reg).decode()


def test_prometheus_clients_own_exposition_is_read_summed_over_labels():
    s = parse(exposition(), 7.0, "http_request_duration_seconds", "process_cpu_seconds_total")
    assert s.t == 7.0
    assert s.buckets == ((0.01, 3.0), (0.1, 4.0), (1.0, 5.0), (INF, 5.0))
    assert s.count == 5.0 and s.cpu_seconds == 12.5


def test_other_writers_text_and_absent_metrics():
    text = """# HELP req_seconds Request latency.
# TYPE req_seconds histogram
req_seconds_bucket{le="0.1"} 3
req_seconds_bucket{le="+Inf"} 4
req_seconds_sum 0.9
req_seconds_count 4
"""
    s = parse(text, 1.0, "req_seconds", "process_cpu_seconds_total")
    assert s.buckets == ((0.1, 3.0), (INF, 4.0)) and s.count == 4.0 and s.cpu_seconds is None
    empty = parse("# nothing here\n", 1.0, "req_seconds", "process_cpu_seconds_total")
    assert (empty.buckets, empty.count, empty.cpu_seconds) == ((), None, None)


@pytest.mark.parametrize("text, why", [
    ("this is { not prometheus\n", "not the Prometheus text format"),
    ('req_seconds_bucket{le="fast"} 3\nreq_seconds_bucket{le="+Inf"} 4\n', "without a numeric le"),
    ('req_seconds_bucket{le="0.1"} 3\n', 'no le="+Inf" bucket'),
    ('req_seconds_bucket{le="0.1"} 5\nreq_seconds_bucket{le="+Inf"} 4\n', "not cumulative"),
    ('req_seconds_bucket{le="0.1"} -1\nreq_seconds_bucket{le="+Inf"} 4\n', "not a finite count"),
    ('req_seconds_count NaN\n', "not a finite count"),
])
def test_what_is_not_usable_says_why_in_one_line(text, why):
    with pytest.raises(ScrapeError, match=re.escape(why)) as e:
        parse(text, 1.0, "req_seconds", "process_cpu_seconds_total")
    assert "\n" not in str(e.value)


class _Metrics(BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a) -> None:
        pass


@pytest.fixture
def endpoint():
    servers = []

    def start(body: bytes, status: int = 200) -> str:
        h = type("H", (_Metrics,), {"body": body, "status": status})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), h)
        threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/metrics"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_fetch_and_scrape_a_live_endpoint(endpoint):
    ok = endpoint(exposition().encode())
    bad = endpoint(b"", status=500)
    big = endpoint(b"#" * 200)
    assert "http_request_duration_seconds_bucket" in fetch(ok, 5)
    with pytest.raises(ScrapeError, match="HTTP 500"):
        fetch(bad, 5)
    with pytest.raises(ScrapeError, match="more than 100 bytes"):
        fetch(big, 5, max_bytes=100)
    errors = []
    got = scrape_target(Target("svc", (ok, bad, "http://127.0.0.1:9/metrics"), "http_request_duration_seconds",
                               "process_cpu_seconds_total"), 5, lambda: 3.0, lambda u, why: errors.append(u))
    assert got[ok].count == 5.0 and got[bad] is None and got["http://127.0.0.1:9/metrics"] is None
    assert errors == [bad, "http://127.0.0.1:9/metrics"]
