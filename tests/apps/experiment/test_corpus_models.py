"""``experiment corpus models``: the starting phase model judged on the train split alone, leaving each kind
out of the model that scores it."""

from __future__ import annotations

from phasewise.apps.experiment.corpus import read_manifest, shipped_corpus
from phasewise.apps.experiment.corpus_models import models
from tests.apps.experiment.test_corpus import _cli


def test_each_train_kind_is_scored_by_a_model_that_never_saw_it_and_the_choice_holds():
    res = models(shipped_corpus())
    train = [e for e in read_manifest(shipped_corpus())["executions"] if e["split"] == "train"]
    kinds = sorted({e["kind"] for e in train})
    assert sorted(res["kinds"]) == kinds and res["split"] == "train"
    for k, v in res["kinds"].items():
        assert k not in v["learned_on"] and sorted([*v["learned_on"], k]) == kinds
        assert v["executions"] == sum(e["kind"] == k for e in train)
        for n in ("left_out", "ai4dl"):
            assert v[n]["samples_with_phase"] > 0 and -1 <= v[n]["ami"] <= 1
            assert v[n]["cpu"]["steps"] == v["left_out"]["cpu"]["steps"]  # the same steps for both models
    o = res["overall"]
    assert o["left_out"]["phases"] is None  # one model per kind: no pooled phase count
    # what the default rests on: a model learned on other kinds' 1 s runs starts a new kind with less slack
    # than the AI4DL model, on CPU and memory
    for r in ("cpu", "mem"):
        assert o["left_out"][r]["slack_cut_vs_frontier"] > o["ai4dl"][r]["slack_cut_vs_frontier"]


def test_a_bad_window_count_is_a_one_line_error():
    r = _cli("models", "--min-windows", "0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--min-windows" in r.stderr, r.stderr
