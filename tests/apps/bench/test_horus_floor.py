"""phasewise bench horus-floor: offline learners against the online Horus model on GPUMemNet's jobs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from phasewise.cli import main

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"  # ../shared beside the clone
GPUMEMNET = SHARED / "gpumemnet-mlp-profiles" / "mlp_data_step2.csv.gz"


@pytest.mark.skipif(not GPUMEMNET.exists(), reason="needs ../shared/data/gpumemnet-mlp-profiles")
def test_bench_horus_floor_json(capsys):
    pytest.importorskip("sklearn", reason="needs scikit-learn: pip install 'phasewise[analysis]'")
    assert main(["bench", "horus-floor", "--rows", "200", "--folds", "3", "--sizes", "20,50,100",
                 "--repeats", "2", "--trees", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 200 and out["unusable"] == 0 and out["cv_folds"] == 3 and out["target"] == 0.15
    # the online model's own inputs, less those constant over these jobs (the device, conv layers, ...)
    assert {"flops", "params", "batch", "linear", "train_mem"} <= set(out["features"])
    assert "device=a100" not in out["features"] and "conv" not in out["features"]
    cv = out["offline_cv_rmsle"]
    assert set(cv) == {"hist_gradient_boosting", "random_forest", "knn", "ridge", "mean"}
    assert all(math.isfinite(v) and 0.05 < v < 1.0 for v in cv.values())
    assert all(cv[k] < cv["mean"] for k in ("hist_gradient_boosting", "random_forest"))  # the features carry signal
    assert out["best_offline"]["rmsle"] == min(v for k, v in cv.items() if k != "mean")
    curve = out["learning_curve"]
    assert [c["train_jobs"] for c in curve] == [20, 50, 100]
    for c in curve:
        assert c["repeats"] == 2 and c["test_jobs"] == 200 - c["train_jobs"]
        assert 0.05 < c["rmsle_mean"] < 1.0 and 0 <= c["rmsle_sd"] < 0.5
        assert set(c["by_learner"]) == set(cv) and c["by_learner"]["random_forest"] == c["rmsle_mean"]
        assert all(math.isfinite(v) and 0.05 < v < 1.5 for v in c["by_learner"].values())
    w = out["worst_1pct"]
    assert w["jobs"] == 2 and 0 < w["share_of_squared_error"] <= 1 and 0 < w["rmsle_of_the_rest"] < cv[
        out["best_offline"]["learner"]]
    assert 0 < w["measured_median"] <= 100 and 0 < w["predicted_median"] <= 100
    assert 0.05 < out["online_after_20"] < 1.0 and 0.05 < out["online_all"] < 1.0
    assert set(out["target_met"]) == {"online_after_20", "offline_cv_best", "learning_curve_at_20"}
    mem = out["gpu_mem"]
    assert all(math.isfinite(v) and 0 < v < 1.0 for v in mem["offline_cv_rmsle"].values())
    assert 0 < mem["online_after_20"] < 0.5 and len(mem["learning_curve"]) == 3
    assert out["seconds"]["total"] >= out["seconds"]["features"] > 0


@pytest.mark.skipif(not GPUMEMNET.exists(), reason="needs ../shared/data/gpumemnet-mlp-profiles")
def test_bench_horus_floor_is_reproducible(capsys):
    """Fixed seeds: the same options give the same figures."""
    pytest.importorskip("sklearn", reason="needs scikit-learn: pip install 'phasewise[analysis]'")
    args = ["bench", "horus-floor", "--rows", "80", "--folds", "2", "--sizes", "20", "--repeats", "2",
            "--trees", "10", "--json"]
    runs = []
    for _ in range(2):
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out)
        out.pop("seconds")
        runs.append(out)
    assert runs[0] == runs[1]


def test_bench_horus_floor_without_sklearn_says_how_to_get_it():
    code = ("import sys; sys.modules['sklearn'] = None\n"
            "from phasewise.cli import main\n"
            "sys.exit(main(['bench', 'horus-floor', '--json']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "phasewise bench horus-floor: error: needs scikit-learn: pip install 'phasewise[analysis]'"]


def test_bench_horus_floor_bad_options(capsys):
    pytest.importorskip("sklearn", reason="needs scikit-learn: pip install 'phasewise[analysis]'")
    assert main(["bench", "horus-floor", "--folds", "1"]) == 2
    assert "bad options" in capsys.readouterr().err
    assert main(["bench", "horus-floor", "--data", "/nonexistent"]) == 2
    assert "No such file" in capsys.readouterr().err
