"""``phasewise experiment targets`` and ``curves`` end to end: real jobs in cgroups, real curves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phasewise.cli", "experiment", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_bad_arguments_are_one_line_errors():
    r = cli("targets", "--jobs", "cnn,bogus", "--no-progress")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "phasewise experiment targets: error: unknown or missing --jobs/--scenarios: bogus"]
    r = cli("targets", "--acceptable-at", "0.7", "--objective-at", "0.5")
    assert r.returncode == 2 and "--acceptable-at < --objective-at" in r.stderr


def test_the_oracle_is_shortest_remaining_work_first_and_equal_jobs_save_at_most_n_minus_1_over_2n():
    from phasewise.apps.experiment.targets import JobRun, oracle, ps_times, srpt_times

    work = {f"j{i}": 1.0 for i in range(5)}
    na = ps_times(work, dict.fromkeys(work, 10.0), capacity=1.0)  # NA runs every job past every objective
    assert set(na.values()) == {5.0}
    best = srpt_times(list(work.values()), capacity=1.0)
    assert best == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert 1 - (sum(best) / 5) / 5.0 == pytest.approx(0.4)  # (n - 1) / 2n
    # NA's jobs end at their objective: nothing wasted past it, the bound is smaller
    assert ps_times({"a": 1.0, "b": 3.0}, {"a": 1.0, "b": 3.0}, capacity=1.0) == {"a": 2.0, "b": 4.0}
    runs = {}
    for name, w, total in (("a", 1.0, 2.0), ("b", 2.0, 3.0), ("c", 4.0, 6.0)):
        r = JobRun(name, 100)
        r.cpu_to_objective_s, r.cpu_s = w, total
        runs[name] = r
    na_fluid = ps_times({"a": 1.0, "b": 2.0, "c": 4.0}, {"a": 2.0, "b": 3.0, "c": 6.0}, capacity=0.5)
    na_mean = sum(na_fluid.values()) / 3
    o = oracle({"NA": runs}, capacity=0.5, na_mean=na_mean)
    assert o["srpt_mean_time_to_objective_s"] == pytest.approx((2 + 6 + 14) / 3, abs=0.01)
    assert o["na_fluid_mean_time_to_objective_s"] == pytest.approx(na_mean, abs=0.01)
    assert o["oracle_reduction"] == pytest.approx(1 - (22 / 3) / na_mean, abs=1e-4)
    assert o["bound_if_budgets_unbounded"] == pytest.approx(1 - (22 / 3) / (7 / 0.5), abs=1e-4)
    assert o["bound_equal_jobs"] == pytest.approx(1 / 3, abs=1e-4)


@pytest.mark.skipif(not (SHARED / "pollux-traces").is_dir(), reason="../shared/data not present")
def test_curves_json_counts_no_objective_before_the_curve_reached_it():
    r = cli("curves", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["summary"]["total"]["objective_before_reached"] == 0
    assert {"mlperf/resnet", "pollux/cifar10", "pollux/yolov3"} <= set(out["summary"]["by_model"])


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for the jobs' cgroups")
def test_two_real_jobs_under_na_and_ft(tmp_path):
    r = cli("targets", "--jobs", "vae,rnn", "--scenarios", "NA,FT,SR", "--steps-scale", "0.4", "--json",
            "--no-progress", "--report", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert set(out) >= {"jobs", "reduction_vs_NA", "missed_objectives", "oracle_reduction", "oracle"}
    assert set(out["reduction_vs_NA"]) == {"FT", "SR"}
    assert 0 <= out["oracle_reduction"] < 1 and out["oracle"]["bound_equal_jobs"] == 0.25
    assert set(out["oracle"]["work_to_objective_cpu_s"]) == {"vae", "rnn"}
    # SR held one job while the other was nearer its objective, and said why
    assert any("nearest first" in d for j in out["jobs"]["SR"].values() for d in j["decisions"])
    for sc in ("NA", "FT", "SR"):
        for job in ("vae", "rnn"):
            j = out["jobs"][sc][job]
            assert j["time_to_acceptable_s"] is not None and j["cpu_s"] > 0
    na, ft = out["jobs"]["NA"], out["jobs"]["FT"]
    for job in ("vae", "rnn"):
        assert na[job]["steps"] == na[job]["steps_budget"] and na[job]["stopped_by"] == "budget"
        if ft[job]["time_to_objective_s"] is not None:  # FT stops a job at its objective, gracefully
            assert ft[job]["stopped_by"] == "objective" and ft[job]["steps"] < ft[job]["steps_budget"]
            assert ft[job]["exit_code"] == 0
            assert any("objective" in d for d in ft[job]["decisions"])
    cap = out["setup"]["capacity_cores"]
    for sc in ("NA", "FT", "SR"):  # the node's quota holds in every scenario: the jobs never used more than it
        wall = max(j["end_s"] for j in out["jobs"][sc].values())
        assert out["cpu_s_total"][sc] <= cap * wall * 1.2 + 0.1, (sc, out["cpu_s_total"][sc], wall)
    assert {p.name for p in (tmp_path / "rep").iterdir()} >= {"summary.md", "loss.png", "time_to_objective.png",
                                                              "limits.png", "result.json"}
