"""``experiment priorities --through-roles``: static and managed through every role, differing only by the
worker's ``--priorities`` and ``--autoscale``."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phasewise.apps.experiment.priorities_roles import (
    MAX_REPLICAS,
    ROLE_SCENARIOS,
    PriorityCluster,
    free_port_block,
    plan_jobs,
    rate_steps,
    targets,
)
from tests.conftest import is_root


def test_the_scenarios_differ_only_by_the_workers_configuration():
    assert set(ROLE_SCENARIOS) == {"static", "managed"}
    assert ROLE_SCENARIOS["static"] == (False, (), ())
    priorities, flags, env = ROLE_SCENARIOS["managed"]
    assert priorities and flags[0] == "--autoscale" and all(k.startswith("PHASEWISE_AUTOSCALE_") for k, _ in env)
    jobs = plan_jobs("x", 60.0)
    assert [(j.kind, j.priority) for j in jobs] == [("train", 0), ("train", 0), ("service", 10)]
    # the jobs ask for the whole host between them (2 cores: nobody waits for admission) and outlast the load
    assert sum(j.cpu for j in jobs) == 2.0 and all(j.seconds > 60.0 for j in jobs)


def test_the_rate_ramps_up_past_one_replica_and_down():
    steps = rate_steps(20.0, 100.0)
    assert [r for _, r in steps] == [20.0, 70.0, 100.0, 20.0] and steps[-1][0] == 1.0


def test_the_port_block_is_free_and_a_taken_port_is_skipped():
    rnd = random.Random(3)
    base = free_port_block(MAX_REPLICAS, rnd)
    with socket.socket() as s:  # the first pick of the same sequence, taken: another block comes back
        s.bind(("127.0.0.1", base + 1))
        other = free_port_block(MAX_REPLICAS, random.Random(3))
        assert not (other <= base + 1 <= other + MAX_REPLICAS)


def test_the_service_spec_names_its_endpoint_replicas_and_half_the_slo(tmp_path):
    from phasewise.apps.experiment.cluster import Config

    jobs = plan_jobs("t", 30.0)
    cfg = Config(jobs=3, seed=0, trace=tmp_path, span_s=1.0, train_s=30.0, service_s=30.0, interactive_s=0.0,
                 timeout_s=None, report=None, json=True, cgroup_prefix="pwprio-t", keep=False)
    c = PriorityCluster(cfg, jobs, slo_ms=300.0, low=20.0, high=100.0)
    try:
        c.job_python, c.ckpt, c.bootstrap = sys.executable, tmp_path, "127.0.0.1:9"
        svc = jobs[-1]
        spec = json.loads(c.job_file(svc, c.command(svc)).read_text())
        assert spec["workload"] == "inference" and spec["priority"] == 10
        assert spec["service"] == {"port": c.service_port, "metrics_path": "/metrics/prometheus",
                                   "slo_p99_ms": 150.0, "min_replicas": 1, "max_replicas": MAX_REPLICAS}
        assert spec["command"][-4:] == ["-m", "phasewise.apps.experiment.inference", "--seconds", str(svc.seconds)]
        train = json.loads(c.job_file(jobs[0], c.command(jobs[0])).read_text())
        assert "targets" not in train and "service" not in train
    finally:
        c.close()


def test_the_targets_say_met_missed_or_not_measured():
    st = {"slo_violation_share": 0.2, "training_steps_per_s": 100.0}
    assert targets(st, {"slo_violation_share": 0.005, "training_steps_per_s": 96.0}) == {
        "static_violates": True, "managed_violations_at_most_1pct": True,
        "managed_violations_below_static": True, "training_throughput_ratio": 0.96,
        "training_throughput_at_least_0.95": True}
    missed = targets(st, {"slo_violation_share": 0.03, "training_steps_per_s": 90.0})
    assert missed["managed_violations_at_most_1pct"] is False and missed["training_throughput_at_least_0.95"] is False
    assert targets({"slo_violation_share": None, "training_steps_per_s": None}, st)["static_violates"] is None


def test_through_the_roles_only_static_and_managed_are_scenarios_and_others_are_refused_in_one_line(capsys):
    from phasewise.cli import main

    assert main(["experiment", "priorities", "--through-roles", "--no-calibrate", "--scenarios",
                 "managed,unweighted"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs static and managed only, got unweighted" in err, err


def test_one_scenario_leaves_the_targets_that_compare_two_unmeasured():
    t = targets({}, {"slo_violation_share": 0.005, "training_steps_per_s": 96.0})
    assert t["managed_violations_at_most_1pct"] is True
    assert t["static_violates"] is None and t["training_throughput_ratio"] is None


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.skipif(not (is_root() and Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists()),
                    reason="needs root and a cgroup v1 cpuset hierarchy")
def test_managed_runs_to_the_end_through_the_roles():
    # managed alone: static is the same run with the worker's default configuration (no --priorities, no
    # --autoscale; ~50 CPU-s of this suite), the configuration every other roles test runs
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "phasewise.cli", "experiment", "priorities",
                        "--through-roles", "--roles-seconds", "20", "--no-calibrate", "--scenarios", "managed",
                        "--json"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert set(s["scenarios"]) == {"managed"}
    sc = s["scenarios"]["managed"]
    assert sc["stuck"] == [] and sc["terminal"] == 3 and sc["outcomes"] == {"finished": 3}, \
        (sc["outcomes"], sc["failures"], sc)
    assert sc["leaked_bookings"] == 0, sc
    assert sc["requests"]["sent"] > 0 and sc["training_steps_per_s"] > 0, sc
    assert s["targets"]["static_violates"] is None and s["targets"]["training_throughput_ratio"] is None
    # the priority agent's weights: the service's the highest
    w = sc["weights"]
    svc = next(k for k in w if k.startswith("svc-"))
    assert all(w[svc] > v for k, v in w.items() if k.startswith("train-")), w
