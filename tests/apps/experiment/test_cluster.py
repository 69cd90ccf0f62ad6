"""``experiment cluster``: its plan and figures from hand-made records, its errors, and a short real run.

The real run (root, cgroups) starts every role on the experiment's own embedded broker, submits a few
jobs with a submitter key, and checks from the topics that every job reached an end state and that no
booking leaked (the whole-node probe jobs are placed).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from phasewise.apps.experiment.cluster import (
    SLO_MS,
    ClusterError,
    Records,
    check_report_dir,
    is_terminal,
    summarize,
)
from phasewise.apps.experiment.cluster_plan import (
    OBJECTIVE,
    TraceError,
    default_trace,
    plan,
    read_arrivals,
    scale_arrivals,
)
from phasewise.kit.records import ContainerSample, HostSamples, Interval, JobEvent, UtilisationPrediction
from tests.conftest import is_root

#: the Pollux arrivals the experiment reads (../shared beside the clone, as CI has it)
needs_trace = pytest.mark.skipif(not default_trace().is_file(), reason="../shared/data/pollux-traces not present")


def ev(job: str, kind: str, ts: float, **kw) -> JobEvent:
    return JobEvent(job=job, ts=ts, kind=kind, **kw)


def pred(job: str, cores: float) -> UtilisationPrediction:
    iv = Interval(mean=cores, lo=cores / 2, hi=cores * 2)
    return UtilisationPrediction(job=job, ts=1.0, model_version=0, gpu_util=Interval(mean=0, lo=0, hi=0),
                                 gpu_mem_bytes=Interval(mean=0, lo=0, hi=0), cpu_cores=iv,
                                 mem_bytes=Interval(mean=1e8, lo=1e8, hi=1e8), coverage=0.8)


@needs_trace
def test_the_trace_shapes_the_arrivals():
    times = read_arrivals(default_trace())
    assert len(times) == 160 and times == sorted(times)
    arr = scale_arrivals(times, 30, 240.0)
    assert arr[0] == 0.0 and arr[-1] == 240.0 and arr == sorted(arr)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)][:29]
    scaled = [b - a for a, b in zip(arr, arr[1:], strict=False)]
    k = 240.0 / sum(gaps)
    assert all(math.isclose(s, g * k, abs_tol=0.002) for s, g in zip(scaled, gaps, strict=True))


def test_the_plan_mixes_kinds_and_priorities():
    jobs = plan(30, arrivals=[float(i) for i in range(30)], seed=0, tag="t-")
    kinds = [j.kind for j in jobs]
    assert kinds.count("service") == 1 and kinds.count("interactive") == 5 and kinds.count("train") == 24
    assert {j.priority for j in jobs if j.kind == "train"} == {0, 1}
    assert len({j.hidden for j in jobs if j.kind == "train"}) > 1
    assert len({j.job for j in jobs}) == 30


def test_a_bad_trace_and_report_folder_are_one_line_errors(tmp_path):
    bad = tmp_path / "w.csv"
    bad.write_text("name,when\na,1\n")
    with pytest.raises(TraceError, match="needs a numeric 'time' column"):
        read_arrivals(bad)
    with pytest.raises(TraceError, match="No such file"):
        read_arrivals(tmp_path / "missing.csv")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ClusterError, match="not an empty folder"):
        check_report_dir(str(tmp_path / "full"))
    assert check_report_dir(str(tmp_path / "new" / "r")) == tmp_path / "new" / "r"
    r = subprocess.run([sys.executable, "-m", "phasewise.cli", "experiment", "cluster", "--report",
                        str(tmp_path / "full")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "not an empty folder" in r.stderr


def test_terminal_states():
    assert is_terminal([ev("a", "submitted", 1), ev("a", "started", 2), ev("a", "finished", 3)])
    assert is_terminal([ev("a", "submitted", 1), ev("a", "rejected", 2, reason="no command")])
    assert not is_terminal([ev("a", "submitted", 1), ev("a", "started", 2)])
    # stopped by checkpoint-and-exit, then resumed: not ended
    assert not is_terminal([ev("a", "started", 1), ev("a", "terminated", 2), ev("a", "admitted", 3)])
    assert is_terminal([ev("a", "started", 1), ev("a", "terminated", 2)])


def test_the_summary_is_computed_from_the_records():
    jobs = plan(4, arrivals=[0.0, 1.0, 2.0, 3.0], seed=0, tag="s-")
    t, t2, svc, t3 = (j.job for j in jobs)
    rec = Records()
    rec.events = [
        ev(t, "submitted", 100.0), ev(t, "started", 102.0, container=t),
        ev(t, "progress", 110.0, step=5, loss=OBJECTIVE * 2), ev(t, "progress", 112.0, step=9, loss=OBJECTIVE),
        ev(t, "finished", 113.0, exit_code=0, run_s=11.0),
        ev(t2, "submitted", 101.0), ev(t2, "started", 103.0, container=t2, host="h"),
        ev(svc, "submitted", 102.0), ev(svc, "started", 104.0, container=svc),
        ev(svc, "progress", 106.0, step=10, metric=SLO_MS * 2), ev(svc, "progress", 108.0, step=20, metric=5.0),
        ev(svc, "progress", 110.0, step=30, metric=6.0), ev(svc, "progress", 112.0, step=40, metric=7.0),
        ev(svc, "failed", 114.0, exit_code=1, reason="exited 1"),
        ev(t3, "submitted", 103.0), ev(t3, "rejected", 104.0, reason="no command"),
    ]
    rec.decisions = [SimpleNamespace(action="place", container=t2, policy="horus")]
    rec.predictions = [pred(t, 0.5), pred(t, 9.0), pred(t2, 1.0)]
    rec.samples = [HostSamples(host="h", ts=ts, interval_s=1.0, containers=(
        ContainerSample(container=t, cpu_cores=1.0, mem_bytes=1e8),
        ContainerSample(container=t2, cpu_cores=0.25 if ts < 106 else 0.5, mem_bytes=1e8))) for ts in
        (103.0, 104.0, 107.0, 108.0)]
    s = summarize(jobs, rec, leaked=0, probe="p", wall_s=1.0, trace="x", span_s=3.0)
    assert s["jobs"] == 4 and s["terminal"] == 3
    assert s["stuck"] == [{"job": t2, "state": "started", "reason": "last state started on h; placed by horus"}]
    assert s["outcomes"] == {"failed": 1, "finished": 1, "rejected": 1}
    assert s["mean_time_to_objective_s"] == 12.0 and s["objectives_reached"] == 1
    assert s["slo_violation_share"] == 0.25 and s["service_windows"] == 4
    # t: the first prediction (0.5) against 1.0 observed after the warm-up; t2: 1.0 against 0.5
    assert s["predicted_jobs_compared"] == 2
    assert s["prediction_log_error_first_10"] == round(math.log(2), 4)
    assert s["prediction_log_error_last_10"] is None  # fewer than ten jobs compared
    assert s["mean_wait_s"] == 2.0


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.skipif(not (is_root() and Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists()),
                    reason="needs root and a cgroup v1 cpuset hierarchy")
@needs_trace
def test_a_short_run_ends_every_job_and_leaks_no_booking(tmp_path):
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "phasewise.cli", "experiment", "cluster", "--jobs", "6",
                        "--span", "20", "--train-seconds", "25", "--service-seconds", "30",
                        "--interactive-seconds", "8", "--timeout", "400", "--json",
                        "--report", str(tmp_path / "report")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["jobs"] == 6
    assert s["stuck"] == [], (s, r.stderr[-2000:])
    assert s["terminal"] == 6
    assert s["leaked_bookings"] == 0, s["leak_probe"]
    assert s["service_windows"] > 0
    assert (tmp_path / "report" / "timeline.png").exists()
    assert len(list((tmp_path / "report" / "jobs").glob("*.png"))) == 6
