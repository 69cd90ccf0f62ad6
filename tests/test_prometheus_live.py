"""A real Prometheus (Debian's ``prometheus``) scrapes the three running roles and alerts when one stops.

The host agent (on a fixture cgroup tree), the worker and the actuator run as
subprocesses against the embedded broker, each with its metrics and health
endpoint; Prometheus scrapes them every second with the shipped scrape
config's job names and evaluates the shipped alert rules with every ``for:``
cut to a few seconds. The test checks each role answers ``/readyz``, that
Prometheus sees every role up with its build_info, then stops the actuator
and waits for ``PhasewiseTargetDown`` to go pending, then firing.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from phasewise.kit.broker import free_port
from phasewise.kit.procs import ManagedProcess, RoleProcess
from tests.producers.conftest import CgTree

PROMETHEUS = shutil.which("prometheus")
REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package "
                                                             "'prometheus'; `make tools` installs it)")]

JOBS = {"producer": "phasewise-producer", "worker": "phasewise-worker", "actuator": "phasewise-actuator"}


def http(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def wait_for(what: str, check, timeout_s: float, logs=()) -> object:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)
    tails = "\n".join(f"--- {r.name}\n{r.log_tail(15)}" for r in logs)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{tails}")


def test_prometheus_sees_every_role_and_fires_target_down_when_the_actuator_stops(settings, tmp_path):
    ports = {role: free_port() for role in JOBS}
    tree = CgTree(tmp_path / "cgroup", 2)
    tree.set("job-a", cpu_s=1.0, mem=200 * 2**20)
    common = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_HOST": settings.host,
              "PHASEWISE_LOG_LEVEL": "info", "PHASEWISE_BIND_ADDRESS": "127.0.0.1",
              "PHASEWISE_CGROUP_ROOT": str(tree.root), "PHASEWISE_CGROUP_PREFIX": tree.prefix}
    roles = {
        "producer": RoleProcess("produce", [], log_path=tmp_path / "producer.log",
                                env={**common, "PHASEWISE_METRICS_PORT": str(ports["producer"])}),
        "worker": RoleProcess("worker", [], log_path=tmp_path / "worker.log",
                              env={**common, "PHASEWISE_METRICS_PORT": str(ports["worker"]),
                                   "PHASEWISE_WEB_PORT": "0", "PHASEWISE_DATA_DIR": str(tmp_path / "w"),
                                   "PHASEWISE_WORKER_ID": f"pw-prom-{settings.host}"}),
        "actuator": RoleProcess("actuate", ["--backend", "dry-run"], log_path=tmp_path / "actuator.log",
                                env={**common, "PHASEWISE_METRICS_PORT": str(ports["actuator"]),
                                     "PHASEWISE_DATA_DIR": str(tmp_path / "a")}),
    }
    # the shipped rules, every `for:` cut to 3 s so the test sees pending, then firing
    rules = (REPO / "infra/prometheus/phasewise-rules.yml").read_text()
    (tmp_path / "rules.yml").write_text(re.sub(r"(\n\s+for: )\d+m", r"\g<1>3s", rules))
    scrape = "\n".join(f"  - job_name: {job}\n    static_configs: [{{targets: ['127.0.0.1:{ports[role]}']}}]"
                       for role, job in JOBS.items())
    (tmp_path / "prometheus.yml").write_text(
        f"global: {{scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 900ms}}\n"
        f"rule_files: [{tmp_path / 'rules.yml'}]\nscrape_configs:\n{scrape}\n")
    prom_port = free_port()
    prom = ManagedProcess("prometheus", [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                         f"--web.listen-address=127.0.0.1:{prom_port}"],
                          env={}, log_path=tmp_path / "prometheus.log")
    api = f"http://127.0.0.1:{prom_port}/api/v1"
    procs = [*roles.values(), prom]
    try:
        for p in procs:
            p.start()
        # every role answers its probes on its metrics port
        for role, port in ports.items():
            wait_for(f"{role} /readyz", lambda port=port: http(f"http://127.0.0.1:{port}/readyz")[0] == 200,
                     90, procs)
            assert http(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")

        def query(q: str) -> list[dict]:
            status, body = http(f"{api}/query?query={urllib.parse.quote(q)}")
            return json.loads(body)["data"]["result"] if status == 200 else []

        # Prometheus scrapes all three, each with its build_info
        wait_for("all targets up", lambda: len(query('up{job=~"phasewise-.*"} == 1')) == 3, 30, procs)
        roles_seen = {r["metric"]["role"] for r in query("phasewise_build_info")}
        assert roles_seen == {"producer", "worker", "actuator"}
        assert query('phasewise_worker_delivery_errors_total{topic="phasewise.decisions.v1"}')[0]["value"][1] == "0"
        assert not query('ALERTS{alertname="PhasewiseTargetDown"}')

        assert roles["actuator"].stop(timeout_s=15) == 0

        def alert_state(state: str):
            status, body = http(f"{api}/alerts")
            if status != 200:
                return None
            return [a for a in json.loads(body)["data"]["alerts"]
                    if a["labels"]["alertname"] == "PhasewiseTargetDown" and a["state"] == state]

        pending = wait_for("PhasewiseTargetDown pending", lambda: alert_state("pending"), 20, procs)
        assert pending[0]["labels"]["job"] == "phasewise-actuator"
        firing = wait_for("PhasewiseTargetDown firing", lambda: alert_state("firing"), 20, procs)
        assert firing[0]["labels"]["job"] == "phasewise-actuator"
        assert firing[0]["annotations"]["runbook_url"] == "docs/runbooks.md#phasewisetargetdown"
        # the other roles stay up and quiet
        assert {r["metric"]["job"] for r in query("up == 1")} == {"phasewise-producer", "phasewise-worker"}
    finally:
        for p in procs:
            if p.alive():
                p.stop(timeout_s=20)
    assert not any(p.leftovers() for p in procs)
