"""phasewise bench placement: it times every policy and books without over-committing."""

from __future__ import annotations

import json

from phasewise.cli import main


def test_bench_placement_json(capsys):
    assert main(["bench", "placement", "--nodes", "60", "--jobs", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["horus", "first-fit", "best-fit", "fgd"]
    for r in out["results"]:
        assert r["nodes"] == 60 and 0 < r["placed"] <= 30
        m = r["ms_per_job"]
        assert 0 < m["p50"] <= m["p99"] <= m["max"] and r["online"] is False


def test_bench_placement_online(capsys):
    assert main(["bench", "placement", "--nodes", "40", "--jobs", "80", "--online", "--policies", "fgd,horus"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in out] == ["fgd", "horus"] and all("CPU" in x for x in out)


def test_bench_placement_bad_options(capsys):
    assert main(["bench", "placement", "--policies", "nope"]) == 2
    assert "nope" in capsys.readouterr().out


def test_bench_placement_waiting_jobs(capsys):
    """--waiting: one decision round of the placement agent's state per event, with that many jobs waiting;
    the next job and a node's sample ask the policy about one job and none, whatever the count."""
    assert main(["bench", "placement", "--nodes", "40", "--waiting", "50,100", "--policies", "first-fit",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["waiting"]) for r in out["waiting"]] == [("first-fit", 50), ("first-fit", 100)]
    for r in out["waiting"]:
        assert r["waiting_after_fill"] == r["waiting"] and r["placed"]["fill"] == []
        assert r["placed"]["next_job"] == ["next"] and r["policy_calls"]["next_job"] == 1
        assert r["policy_calls"]["sample"] == 0 and r["placed"]["freed"]  # a freed GPU takes waiting jobs
        assert set(r["decide_s"]) == {"fill", "next_job", "next_job_refresh", "sample", "freed"}
    assert main(["bench", "placement", "--waiting", "many"]) == 2
