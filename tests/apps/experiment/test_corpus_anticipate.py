"""``experiment corpus anticipate`` and the anticipation rule on the shipped corpus's recorded executions: the
transition book learns from the phase exits of the earlier runs of a job, the worker's round raises a limit
ahead of a predicted transition and lets it fall after, inside the safety rules; the figures and errors."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.apps.experiment.corpus import agreement, read_manifest, shipped_corpus
from phasewise.apps.experiment.corpus_anticipate import anticipate, run_with_transitions, worker_settings
from phasewise.apps.experiment.corpus_prior import execution_series
from phasewise.kit.records import WorkloadPolicy
from tests.apps.experiment.test_corpus import _cli


def _runs(eid: str) -> tuple[list, object, str]:
    folder = shipped_corpus()
    execs = read_manifest(folder)["executions"]
    e = next(x for x in execs if x["id"] == eid)
    train = [execution_series(folder, x) for x in execs if x["kind"] == e["kind"] and x["split"] == "train"]
    return train, execution_series(folder, e), e["kind"]


def test_on_a_recorded_run_limits_rise_only_ahead_of_a_predicted_transition_and_fall_back_after():
    train, run, kind = _runs("forecaster-r05")
    off, none, changes, _ = run_with_transitions(worker_settings(0.0, "corpus", None), train, run, kind)
    on, decisions, changes_on, _ = run_with_transitions(worker_settings(10.0, "corpus", None), train, run, kind)
    assert not any("anticipated" in d.details for d in none)
    assert [(c.container, c.ts, c.new_phase) for c in changes] == [(c.container, c.ts, c.new_phase)
                                                                   for c in changes_on]  # the same phases
    ahead = [d for d in decisions if "anticipated" in d.details]
    assert ahead
    for d in ahead:
        a = d.details["anticipated"]
        assert a["signature"] == kind and a["phase"] == d.details["phase"] and a["next_phase"] != a["phase"]
        assert a["probability"] >= 0.5 and a["exits"] >= 3 and a["within_s"] == 10.0 and a["raised"]
        assert f"ahead of phase {a['phase']} -> {a['next_phase']}" in d.reason
    raised_any = False
    for r in ("cpu", "mem"):
        assert (np.isnan(on[r]) == np.isnan(off[r])).all()  # never a limit where there was none
        both = ~np.isnan(off[r])
        assert (on[r][both] >= off[r][both] * (1 - 1e-9)).all()  # only ever raised
        raised = both & (on[r] > off[r] * (1 + 1e-9))
        raised_any |= bool(raised.any())
        if raised.any():  # and lowered after: a raised step later followed by the phase's own limit again
            after = np.flatnonzero(raised)[0]
            assert (np.isclose(on[r][after:], off[r][after:]) & both[after:]).any()
    assert raised_any
    # a workload without a signature is never anticipated: the same limits as with anticipation off
    plain, unsigned, _, _ = run_with_transitions(worker_settings(10.0, "corpus", None), train, run, kind,
                                                 WorkloadPolicy(mode="apply"))
    assert not any("anticipated" in d.details for d in unsigned)
    for r in ("cpu", "mem"):
        assert np.array_equal(plain[r], off[r], equal_nan=True)


def test_a_raise_ahead_stays_inside_the_safety_rules():
    train, run, kind = _runs("forecaster-r05")
    rules = {"safety_rules": True, "safety_min_history_s": 0}
    cap = 1.15  # below the CPU limit a raise ahead asks for (1.23 cores)
    on, decisions, _, fed = run_with_transitions(worker_settings(10.0, "corpus", rules), train, run, kind,
                                                 WorkloadPolicy(mode="apply", signature=kind, cpu_max_cores=cap))
    assert np.nanmax(on["cpu"]) <= cap + 1e-9
    ahead = [d for d in decisions if "anticipated" in d.details]
    assert any("workload_max" in d.details["safety"]["bounded_by"].get("cpu", []) for d in ahead)
    mem = run.usage["mem"]
    for d in decisions:  # memory never under the run's own peak so far
        k = int(np.flatnonzero(np.isclose(fed, d.ts))[0])
        if d.mem_limit_bytes is not None:
            assert d.mem_limit_bytes >= np.nanmax(mem[:k + 1])


def test_the_held_out_figures_and_the_predictor_on_recorded_sequences():
    res = anticipate(shipped_corpus(), "heldout", horizons=(0.0, 10.0))
    off, on = res["results"]
    assert res["executions"] == 18 and off["horizon_s"] == 0.0 and off["raised_decisions"] == 0
    assert off["prediction"] is None and on["raised_decisions"] > 0
    for r in ("cpu", "mem"):  # the same steps; raising never adds an overrun
        assert off["resources"][r]["steps"] == on["resources"][r]["steps"]
        assert on["resources"][r]["overruns"] <= off["resources"][r]["overruns"]
        assert on["resources"][r]["alloc_over_used"] >= off["resources"][r]["alloc_over_used"]
    q = on["prediction"]
    assert 0 < q["hits"] <= q["predicted"] <= q["phased_steps"] and 0 < q["caught"] <= q["transitions"]
    assert q["precision"] == round(q["hits"] / q["predicted"], 4)
    assert anticipate(shipped_corpus(), "heldout", horizons=(0.0, 10.0)) == res  # deterministic


def test_the_default_model_follows_the_stages_better_than_the_ai4dl_one_on_held_out_executions():
    corpus, ai4dl = agreement(shipped_corpus()), agreement(shipped_corpus(), model="ai4dl")
    assert "corpus_cpu_mem.pwck" in corpus["model"] and "ai4dl_cpu_mem.pwck" in ai4dl["model"]
    assert corpus["overall"]["ami"] > ai4dl["overall"]["ami"]
    assert corpus["overall"]["ari"] > ai4dl["overall"]["ari"]


@pytest.mark.parametrize("args, word", [(("--horizons", "5,x"), "--horizons"), (("--horizons", "-1"), "--horizons"),
                                        (("--horizons", "9000"), "--horizons")])
def test_bad_arguments_are_one_line_errors(args, word):
    r = _cli("anticipate", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and word in r.stderr, r.stderr
