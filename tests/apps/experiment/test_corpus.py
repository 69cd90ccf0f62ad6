"""``experiment corpus``: the plan and its fixed split, the manifest's checks, each sample's stage, the
agreement figures on the shipped corpus, the one-line errors, and a short real recording (root) that
round-trips through ``replay --format phasewise``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from phasewise.apps.experiment.corpus import CorpusError, agreement, read_manifest, shipped_corpus
from phasewise.apps.experiment.corpus_plan import (
    HELD_OUT_KIND,
    KINDS,
    ManifestError,
    canonical_stage,
    check_manifest,
    plan,
    split_of,
    stage_series,
)
from tests.conftest import is_root

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "phasewise.cli", "experiment", "corpus", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


# ---------------------------------------------------------------- the plan and the split


def test_the_plan_is_deterministic_and_each_run_is_the_same_execution_in_every_plan():
    a, b = plan(list(KINDS), 8), plan(list(KINDS), 8)
    assert a == b and len(a) == 8 * len(KINDS) and len({e.id for e in a}) == len(a)
    small = {e.id: e for e in plan(["mlp", "charlstm"], 3)}
    assert all(small[e.id] == e for e in a if e.id in small)
    # the runs of a kind differ in what they vary (seed always; the rest drawn from the kind's grid)
    runs = [e.params for e in a if e.kind == "charlstm"]
    assert [p["--seed"] for p in runs] == list(range(8))
    assert len({tuple(sorted(p.items())) for p in runs}) == 8
    assert len({p["--batch-size"] for p in runs}) > 1 and len({p["--eval-every"] for p in runs}) > 1
    with pytest.raises(ValueError, match="unknown job kind 'resnet'"):
        plan(["resnet"], 2)


def test_the_split_holds_out_a_whole_kind_and_some_runs_of_every_other_and_covers_each_execution_once():
    execs = plan(list(KINDS), 8)
    by = {}
    for e in execs:
        by.setdefault((e.kind, e.split), []).append(e.run)
    assert by[(HELD_OUT_KIND, "heldout")] == list(range(8)) and (HELD_OUT_KIND, "train") not in by
    for k in KINDS:
        if k != HELD_OUT_KIND:
            assert by[(k, "heldout")] == [1, 5] and by[(k, "train")] == [0, 2, 3, 4, 6, 7]
    assert sum(len(v) for v in by.values()) == len(execs)
    assert all(split_of(e.kind, e.run) == e.split for e in execs)


def _manifest(execs: list[dict]) -> dict:
    return {"format": "phasewise-corpus", "version": 1, "executions": execs}


def _entry(kind: str, run: int, **kw) -> dict:
    return {"id": f"{kind}-r{run:02d}", "kind": kind, "run": run, "split": split_of(kind, run),
            "file": f"{kind}-r{run:02d}.parquet", **kw}


def test_a_manifest_with_a_twice_listed_execution_a_moved_split_or_a_path_is_refused():
    assert len(check_manifest(_manifest([_entry("mlp", 0), _entry("mlp", 1)]))) == 2
    with pytest.raises(ManifestError, match="listed twice"):
        check_manifest(_manifest([_entry("mlp", 0), _entry("mlp", 0)]))
    with pytest.raises(ManifestError, match="fixed split puts it in 'heldout'"):
        check_manifest(_manifest([_entry("mlp", 1, split="train")]))
    with pytest.raises(ManifestError, match="not a file name"):
        check_manifest(_manifest([_entry("mlp", 0, file="../x.parquet")]))
    with pytest.raises(ManifestError, match="not a corpus manifest"):
        check_manifest({"executions": []})


def test_each_sample_takes_the_stage_of_the_last_report_before_it():
    t = np.arange(10.0)
    reports = [{"ts": 2.5, "stage": "start"}, {"ts": 3.0, "stage": "train"}, {"ts": 5.2, "stage": "eval"},
               {"ts": 5.9, "stage": "eval"}, {"ts": 6.1, "stage": "train"}, {"ts": 7.5, "stage": "exit"},
               {"ts": 8.0, "stage": "warmup"}, {"ts": float("nan"), "stage": "done"}, {"ts": 8.5}]
    assert stage_series(t, reports) == ["load"] * 3 + ["train"] * 3 + ["eval", "train", "checkpoint", "checkpoint"]
    assert stage_series(t[:2], []) == ["load", "load"]


# ---------------------------------------------------------------- the shipped corpus


def test_the_shipped_corpus_has_every_recording_its_manifest_lists_with_provenance():
    folder = shipped_corpus()
    manifest = read_manifest(folder)
    execs = manifest["executions"]
    kinds = {e["kind"] for e in execs}
    assert len(kinds) >= 5 and HELD_OUT_KIND in kinds
    assert {e["split"] for e in execs} == {"train", "heldout"}
    assert "no GPU" in manifest["machine"]["gpu"]
    from phasewise.apps.record.tracefile import read_recording

    for e in execs:
        rec = read_recording(folder / e["file"])
        ctx = rec.header["context"]
        assert ctx["execution"]["id"] == e["id"] and ctx["load_avg_1m"]["mean"] is not None
        mine = [c for c in rec.header["containers"] if c["job"] == e["id"]]
        assert len(mine) == 1 and mine[0]["command"][:4] == ["phasewise", "progress", "--stages", "--job"]
        assert {"load", "train"} <= {canonical_stage(s.get("stage")) for s in mine[0]["stages"]}
    assert sum((folder / e["file"]).stat().st_size for e in execs) < 5 * 2**20


def test_agreement_on_the_shipped_corpus_scores_the_held_out_executions_per_kind_and_overall():
    res = agreement(shipped_corpus())
    manifest = read_manifest(shipped_corpus())
    held = sorted(e["id"] for e in manifest["executions"] if e["split"] == "heldout")
    assert sorted(res["overall"]["executions"]) == held
    assert HELD_OUT_KIND in res["kinds"]
    for r in [res["overall"], *res["kinds"].values()]:
        assert r["samples_with_phase"] > 0
        assert -1.0 <= r["ami"] <= 1.0 and -1.0 <= r["ari"] <= 1.0
    again = agreement(shipped_corpus())
    assert again == res  # the shipped model, frozen: the same figures every time


def test_bad_corpus_folders_are_one_line_errors(tmp_path):
    with pytest.raises(CorpusError, match="no such folder"):
        read_manifest(tmp_path / "none")
    with pytest.raises(CorpusError, match="not a corpus folder"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest([_entry("mlp", 0), _entry("mlp", 0)])))
    r = _cli("agreement", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "listed twice" in r.stderr, r.stderr
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest([_entry("mlp", 1)])))
    r = _cli("agreement", str(tmp_path), "--json")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "mlp-r01" in r.stderr, r.stderr
    r = _cli("record", "--out", str(tmp_path / "c"), "--kinds", "mlp,resnet")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown job kind 'resnet'" in r.stderr, r.stderr
    r = _cli("record", "--out", str(tmp_path / "c"), "--runs", "0")
    assert r.returncode == 2 and "runs must be at least 1" in r.stderr, r.stderr


# ---------------------------------------------------------------- a real recording


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.skipif(not is_root(), reason="needs root to create cgroups")
def test_a_short_real_recording_round_trips_through_replay(tmp_path, assert_replay_output):
    out = tmp_path / "corpus"
    r = _cli("record", "--out", str(out), "--kinds", "mlp", "--runs", "1", "--seconds", "12")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = read_manifest(out)
    [e] = manifest["executions"]
    assert e["id"] == "mlp-r00" and e["split"] == "train" and e["exit_code"] == 0 and e["params"]["--seconds"] == 12
    assert e["samples"] >= 10 and e["load_avg_1m"]["samples"] >= 10
    from phasewise.apps.record.tracefile import read_recording

    header = read_recording(out / e["file"]).header
    [c] = [c for c in header["containers"] if c["job"] == "mlp-r00"]
    stages = [s["stage"] for s in c["stages"]]
    # (its drawn checkpoint interval, 20 s, is longer than this run's 12 s of training)
    assert stages[0] in ("load", "start") and {"train", "eval", "done"} <= set(stages), stages
    assert c["command"][-len(e["command"]):] == e["command"] and header["context"]["execution"]["id"] == "mlp-r00"
    rp = subprocess.run([sys.executable, "-W", "ignore", "-m", "phasewise.cli", "replay", str(out / e["file"]),
                         "--format", "phasewise", "--policies", "vpa,phase", "--json"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert rp.returncode == 0, rp.stderr[-2000:]
    lines = [json.loads(x) for x in rp.stdout.splitlines()]
    assert_replay_output(lines)
    assert lines[0]["trace"]["containers"] == 1 and lines[0]["trace"]["samples"] == e["samples"]
    # continued: a second session adds the next run, keeps the first
    r = _cli("record", "--out", str(out), "--kinds", "mlp", "--runs", "1")
    assert r.returncode == 0 and "already" in r.stdout, r.stdout + r.stderr
