"""``experiment targets --through-roles``: NA and FT through every role, differing only by ``worker --targets``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phasewise.apps.experiment.cluster_report import OBJECTIVE, Records
from phasewise.apps.experiment.targets_roles import ROLE_SCENARIOS, oracle_bound, plan_jobs
from phasewise.kit.records import JobEvent
from tests.conftest import is_root


def test_the_scenarios_differ_only_by_the_targets_setting_and_the_jobs_queue():
    assert ROLE_SCENARIOS == {"NA": False, "FT": True}
    jobs = plan_jobs(4, "x", 30.0, 1.0)
    assert [j.arrival_s for j in jobs] == [0.0, 1.0, 2.0, 3.0]
    assert all(j.kind == "train" and j.cpu == 1.0 and j.seconds == 30.0 for j in jobs)
    assert len({j.hidden for j in jobs}) == 4 and len({j.job for j in jobs}) == 4


def test_the_oracle_runs_each_job_only_to_its_objective_on_the_slices_in_submission_order():
    jobs = plan_jobs(3, "o", 30.0, 1.0)
    a, b, c = (j.job for j in jobs)

    def ev(job, kind, ts, loss=None):
        return JobEvent(job=job, ts=ts, kind=kind, loss=loss, step=None if loss is None else 1)

    # NA: each started when its slice freed at its budget's end, reaching its objective 10, 20 and 5 s in
    events = [ev(a, "submitted", 100.0), ev(b, "submitted", 101.0), ev(c, "submitted", 102.0),
              ev(a, "started", 100.5), ev(b, "started", 101.5), ev(a, "progress", 105.0, OBJECTIVE * 2),
              ev(a, "progress", 110.5, OBJECTIVE), ev(b, "progress", 121.5, OBJECTIVE / 2),
              ev(c, "started", 131.0), ev(c, "progress", 136.0, OBJECTIVE)]
    # the oracle: a [0, 10], b [1, 21], c waits for a's slice: [10, 15] -> 10, 20, 13 from submission
    assert oracle_bound(jobs, Records(events=events), slices=2) == pytest.approx(43 / 3, abs=0.01)
    assert oracle_bound(jobs, Records(events=events[:-1]), slices=2) is None  # c never reached it


def test_through_the_roles_only_na_and_ft_are_scenarios_and_others_are_refused_in_one_line(capsys):
    from phasewise.cli import main

    assert main(["experiment", "targets", "--through-roles", "2", "--scenarios", "FT,SR"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs NA and FT only, got SR" in err, err


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.skipif(not (is_root() and Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists()),
                    reason="needs root and a cgroup v1 cpuset hierarchy")
def test_ft_stops_each_job_at_its_objective_through_the_roles():
    # FT alone: NA is the same run without `worker --targets` (every job trains its whole budget, ~90 CPU-s of
    # this suite's time); a job running to its budget through the roles is the demo's and the cluster's test
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "phasewise.cli", "experiment", "targets",
                        "--through-roles", "3", "--roles-seconds", "30", "--scenarios", "FT", "--json"],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert set(s["scenarios"]) == {"FT"}, s
    sc = s["scenarios"]["FT"]
    assert sc["stuck"] == [] and sc["terminal"] == 3 and sc["outcomes"] == {"finished": 3}, sc
    # every FT job reached its objective (it is stopped there), the three queued on the slices
    assert s["missed_objectives"] == {"FT": 0} and sc["objectives_reached"] == 3, s
    # (whether FT's runs are shorter than NA's is the experiment's figure, not this test's)
    assert s["ft_vs_na_time_to_objective"] is None and s["oracle_mean_time_to_objective_s"] is None, s
