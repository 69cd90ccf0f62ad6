"""``phasewise experiment targets`` and ``curves`` end to end: real jobs in cgroups, real curves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phasewise.cli", "experiment", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_bad_arguments_are_one_line_errors():
    r = cli("targets", "--jobs", "cnn,bogus", "--no-progress")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "phasewise experiment targets: error: unknown or missing --jobs/--scenarios: bogus"]
    r = cli("targets", "--acceptable-at", "0.7", "--objective-at", "0.5")
    assert r.returncode == 2 and "--acceptable-at < --objective-at" in r.stderr


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
    r = cli("targets", "--jobs", "vae,rnn", "--scenarios", "NA,FT", "--steps-scale", "0.4", "--json",
            "--no-progress", "--report", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert set(out) >= {"jobs", "reduction_vs_NA", "missed_objectives"}
    assert set(out["reduction_vs_NA"]) == {"FT"}
    for sc in ("NA", "FT"):
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
    for sc in ("NA", "FT"):  # the node's quota holds in every scenario: the jobs never used more than it
        wall = max(j["end_s"] for j in out["jobs"][sc].values())
        assert out["cpu_s_total"][sc] <= cap * wall * 1.2 + 0.1, (sc, out["cpu_s_total"][sc], wall)
    assert {p.name for p in (tmp_path / "rep").iterdir()} >= {"summary.md", "loss.png", "time_to_objective.png",
                                                              "limits.png", "result.json"}
