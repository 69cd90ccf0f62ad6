"""``phasewise actuate`` as an operator runs it: a subprocess, metrics, SIGTERM."""

from __future__ import annotations

import time
import uuid

import pytest

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import Decision, encode
from phasewise.kit.topics import DECISIONS

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_the_actuate_role_applies_reports_metrics_and_stops_on_sigterm(settings, tmp_path):
    port = free_port()
    role = RoleProcess(
        "actuate",
        # no cgroup tree: the dry run counts every well-named container as existing
        ["--backend", "dry-run", "--metrics-port", str(port), "--cpu-floor", "0.2", "--mem-margin", "32Mi",
         "--cgroup-root", str(tmp_path / "no-cgroups")],
        env={"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_HOST": settings.host,
             "PHASEWISE_DATA_DIR": str(tmp_path)},
        log_path=tmp_path / "actuator.log",
    ).start()
    try:
        p = make_producer(settings, partitioner=PARTITIONER)  # as the worker: the host's partition
        d = Decision(id=uuid.uuid4().hex, ts=time.time(), host=settings.host, container="job-a",
                     action="limit", policy="test", cpu_limit_cores=0.01)
        p.produce(DECISIONS.name, key=settings.host.encode(), value=encode(d))
        assert p.flush(10) == 0
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 40
        clamped = 0.0
        while time.monotonic() < deadline and clamped < 1:
            assert role.alive(), role.log_tail()
            try:
                clamped = scrape(url).get('phasewise_actuator_decisions_total{status="clamped"}', 0.0)
            except OSError:
                pass
            time.sleep(0.3)
        assert clamped == 1, role.log_tail()
    finally:
        rc = role.stop(timeout_s=15)
    log = (tmp_path / "actuator.log").read_text()
    assert rc == 0, log
    assert "settings: " in log and "cpu_floor_cores=0.2" in log and f"mem_margin_bytes={32 * 2**20}" in log
    assert "raised to the CPU floor (0.2 cores)" in log
    assert "SIGTERM: stopped" in log and "actuator stopped" in log
    assert (tmp_path / f"actuator-{settings.host}.sqlite").exists()


@pytest.mark.parametrize("module", ["phasewise.actuators.consumer", "phasewise.actuators.actuator",
                                    "phasewise.actuators.backends", "phasewise.actuators.backends.kubernetes"])
def test_the_actuator_imports_nothing_of_the_worker_s_extras(module):
    """The actuator image installs ``phasewise[actuator]`` only: no numpy, torch, river or faust."""
    import subprocess
    import sys

    heavy = ("numpy", "torch", "river", "faust", "aiokafka")
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
