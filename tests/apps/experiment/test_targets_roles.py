"""``experiment targets --through-roles``: NA and FT through every role, differing only by ``worker --targets``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phasewise.apps.experiment.targets_roles import ROLE_SCENARIOS, plan_jobs
from tests.conftest import is_root


def test_the_scenarios_differ_only_by_the_targets_setting_and_the_jobs_queue():
    assert ROLE_SCENARIOS == {"NA": False, "FT": True}
    jobs = plan_jobs(4, "x", 30.0, 1.0)
    assert [j.arrival_s for j in jobs] == [0.0, 1.0, 2.0, 3.0]
    assert all(j.kind == "train" and j.cpu == 1.0 and j.seconds == 30.0 for j in jobs)
    assert len({j.hidden for j in jobs}) == 4 and len({j.job for j in jobs}) == 4


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.skipif(not (is_root() and Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists()),
                    reason="needs root and a cgroup v1 cpuset hierarchy")
def test_ft_stops_each_job_at_its_objective_through_the_roles():
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "phasewise.cli", "experiment", "targets",
                        "--through-roles", "3", "--roles-seconds", "30", "--json"],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    for name, sc in s["scenarios"].items():
        assert sc["stuck"] == [] and sc["terminal"] == 3, (name, sc)
        assert sc["outcomes"] == {"finished": 3}, (name, sc)
    # every FT job reached its objective (it is stopped there); NA's train their whole budget
    assert s["missed_objectives"]["FT"] == 0, s
    assert s["scenarios"]["FT"]["mean_run_s"] < s["scenarios"]["NA"]["mean_run_s"], s
