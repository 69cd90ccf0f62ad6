"""``experiment corpus bounds`` on the shipped corpus: the phase policy's figures are anticipate's, the bounds
fall as blocks get finer (nested lengths) and sit at the target fulfilment; the CLI's output and errors."""

from __future__ import annotations

import json

import pytest

from phasewise.apps.experiment.corpus import shipped_corpus
from phasewise.apps.experiment.corpus_anticipate import anticipate
from phasewise.apps.experiment.corpus_bounds import bounds
from tests.apps.experiment.test_corpus import _cli


def test_held_out_bounds_beside_the_phase_policy():
    res = bounds(shipped_corpus(), "heldout")
    ref = anticipate(shipped_corpus(), "heldout", horizons=(0.0,))["results"][0]["resources"]
    assert res["executions"] == 18 and res["step_s"] == pytest.approx(1.0, abs=0.01)
    for r in ("cpu", "mem"):
        v = res["resources"][r]
        # the same steps and the same bare policy as anticipate's horizon 0
        assert v["steps"] == ref[r]["steps"]
        assert v["phase"]["alloc_over_used"] == ref[r]["alloc_over_used"]
        assert v["phase"]["slack_cut_vs_frontier"] == ref[r]["slack_cut_vs_frontier"]
        rows = {row["blocks"]: row for row in v["hindsight"]}
        assert all(row["fulfilment"] >= 0.97 for row in rows.values())
        nested = [rows[k]["alloc_over_used"] for k in ("run", "60 steps", "30 steps", "10 steps", "5 steps")]
        assert nested == sorted(nested, reverse=True)
        assert rows["stage"]["alloc_over_used"] <= rows["run"]["alloc_over_used"]
        assert rows["run"]["count"] == 18 and rows["phase"]["count"] > rows["run"]["count"]
        # knowing each run's use in advance already beats the phase policy: the figures are bounds
        assert rows["run"]["alloc_over_used"] < v["phase"]["alloc_over_used"]


def test_the_command_prints_json_and_one_line_errors():
    r = _cli("bounds", "--lengths", "30,5", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["type"] == "corpus-bounds"
    assert [row["blocks"] for row in res["resources"]["cpu"]["hindsight"]] == ["run", "stage", "phase", "30 steps",
                                                                              "5 steps"]
    for args, word in ((("--lengths", "0"), "--lengths"), (("--lengths", "x"), "--lengths"),
                       (("--fulfilment", "1.5"), "--fulfilment")):
        r = _cli("bounds", *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and word in r.stderr, r.stderr
