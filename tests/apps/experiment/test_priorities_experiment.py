"""The priorities experiment's parts for real: the inference service, the bounded load, the trainer's
checkpoint-and-exit, the command's errors and (slow, root) one short run of both scenarios."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from phasewise.apps.experiment.inference import IN_FEATURES, Load, make_server, scrape


@pytest.fixture(scope="module")
def server():
    s = make_server(0, window_s=5.0)
    t = threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield s.server_address[1]
    s.shutdown()
    s.server_close()


def post(port: int, body: bytes, path: str = "/predict") -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", path, body, {"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, json.loads(r.read())
    c.close()
    return out


def test_the_service_predicts_refuses_bad_input_and_counts(server):
    before = scrape(server, timeout_s=10)["requests"]
    status, body = post(server, json.dumps({"x": [[0.1] * IN_FEATURES, [-0.5] * IN_FEATURES]}).encode())
    assert status == 200 and len(body["y"]) == 2 and all(0 <= y < 10 for y in body["y"])
    for bad in (b"not json", json.dumps({"x": [[1.0] * 3]}).encode(), json.dumps({"y": 1}).encode(),
                json.dumps({"x": [[0.0] * IN_FEATURES] * 65}).encode()):
        status, body = post(server, bad)
        assert status == 400 and body["error"]
    assert post(server, b"{}", path="/other")[0] == 404
    # a request is counted as its handler ends, just after its answer is written: wait for the last one
    deadline = time.monotonic() + 30
    while (m := scrape(server, timeout_s=10))["requests"] < before + 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert m["requests"] == before + 6 and m["errors"] >= 5
    assert m["p99_ms"] >= m["p50_ms"] > 0 and 0 <= m["util"] <= 1 and m["cpu_seconds"] > 0


def test_a_burst_of_connections_waits_in_the_backlog_not_for_a_retransmission():
    """While the accepting thread does not run (a busy CPU), 40 connection requests are all queued by the
    kernel at once; with socketserver's backlog of 5 the rest had their SYNs dropped (1 s retransmission)."""
    import socket

    s = make_server(0)  # bound and listening, never accepting
    socks = []
    try:
        for _ in range(40):
            socks.append(socket.create_connection(s.server_address, timeout=10))
        # the kernel holds all 40 in the accept queue (a backlog of 5 keeps 6 and drops the others' SYNs)
        assert accept_queue(s.server_address[1], 40) == 40
    finally:
        for c in socks:
            c.close()
        s.server_close()


def accept_queue(port: int, want: int, timeout_s: float = 10.0) -> int:
    """The connections a listening 127.0.0.1:*port* holds, not yet accepted (``/proc/net/tcp``), once
    *want* or after *timeout_s* (a client's handshake can end before the listener has queued it)."""
    local = f"0100007F:{port:04X}"
    deadline = time.monotonic() + timeout_s
    while True:
        with open("/proc/net/tcp") as f:
            rows = [ln.split() for ln in f.readlines()[1:]]
        n = next(int(r[4].split(":")[1], 16) for r in rows if r[1] == local and r[3] == "0A")
        if n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def test_the_load_is_bounded_and_counts_every_request(server):
    load = Load(lambda: [server], lambda t: 40.0, workers=4, timeout_s=2.0)
    r = load.run(1.5)
    assert r.sent == r.total() > 20
    assert r.failed == 0 and len(r.latencies_ms) + r.shed == r.sent
    nowhere = Load(lambda: [], lambda t: 40.0).run(0.5)
    assert nowhere.shed == nowhere.sent > 0 and nowhere.violations(100) == nowhere.sent


def test_a_checkpoint_and_exit_loses_no_completed_step(tmp_path):
    cmd = [sys.executable, "-m", "phasewise.apps.experiment.trainer", "job", "--checkpoint-dir", str(tmp_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    steps = []
    for line in p.stdout:
        if "phase=train" in line:
            steps.append(int(line.split("step=")[1].split()[0]))
            if steps[-1] >= 20:
                break
    p.send_signal(signal.SIGUSR1)
    rest = p.stdout.read()
    assert p.wait(30) == 0
    exit_step = int(rest.split("phase=exit step=")[1].split()[0])
    assert exit_step >= steps[-1]
    out = subprocess.run([*cmd, "--seconds", "0.5"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"phase=resume step={exit_step}" in out.splitlines()[0]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phasewise.cli", "experiment", "priorities", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_bad_arguments_are_one_line_errors():
    r = cli("--scenarios", "static,bogus")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "phasewise experiment priorities: --scenarios: unknown ['bogus'] (static, managed, unweighted)"]
    r = cli("--duration", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--duration >= 6" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and the freezer")
def test_a_short_managed_run(tmp_path):
    r = cli("--duration", "8", "--scenarios", "managed", "--json", "--no-progress", "--report", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    keys = {"slo_violation_share", "p99_ms", "training_steps_per_s", "preempt_to_frozen_ms", "resume_lost_steps",
            "replicas_max"}
    assert set(out["scenarios"]) == {"managed"} and set(out["scenarios"]["managed"]) == keys
    m = out["scenarios"]["managed"]
    assert m["preempt_to_frozen_ms"] is not None and m["preempt_to_frozen_ms"] >= 0  # urgent froze train-a
    assert m["resume_lost_steps"] == 0
    assert 0 <= m["slo_violation_share"] <= 1 and m["training_steps_per_s"] > 0 and m["replicas_max"] >= 1
    detail = json.loads((tmp_path / "rep" / "results.json").read_text())["detail"]["managed"]
    kinds = [(e["kind"], e.get("job")) for e in detail["events"]]
    assert kinds.index(("arrive", "urgent")) < kinds.index(("freeze", "train-a")) < kinds.index(("start", "urgent"))
    if ("thaw", "train-a") in kinds:  # when the run outlasted urgent's exit on a busy host
        assert kinds.index(("freeze", "train-a")) < kinds.index(("thaw", "train-a"))
    # the CPU weighted by priority: written as cpu.shares through the actuator's rule and backend
    weights = {w["container"]: (w["weight"], w["status"]) for w in detail["weights"]}
    assert weights["train-a"] == (100, "applied") and weights["train-b"] == (200, "applied")
    assert weights["infer-1"] == (10000, "applied") and weights["urgent"] == (3200, "applied")
    assert set(detail["cpu_s"]) == {"steady", "urgent", "after"} and detail["cpu_s"]["steady"]["train-a"] > 0
    assert {p.name for p in (tmp_path / "rep").iterdir()} >= {"summary.md", "results.json", "latency.png",
                                                              "metrics.png", "managed"}
