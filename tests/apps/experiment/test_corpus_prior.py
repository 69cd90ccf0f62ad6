"""``experiment corpus prior``: the known-job prior through the worker's step on the shipped corpus's
recordings; the limits it sets keep the safety rules, the figures and their one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from phasewise.apps.experiment.corpus import read_manifest, shipped_corpus
from phasewise.apps.experiment.corpus_prior import execution_series, priors, run_with_prior
from phasewise.kit.settings import Settings
from tests.apps.experiment.test_corpus import _cli

MIB = 2**20


def _runs(kind: str) -> tuple[list, object]:
    folder = shipped_corpus()
    execs = read_manifest(folder)["executions"]
    train = [execution_series(folder, e) for e in execs if e["kind"] == kind and e["split"] == "train"]
    held = next(e for e in execs if e["kind"] == kind and e["split"] == "heldout")
    return train, execution_series(folder, held)


def test_a_recorded_run_after_its_kinds_runs_is_limited_from_the_prior_and_never_under_its_own_peak():
    train, run = _runs("charlstm")
    s = Settings.from_env({"prior_margin": 0.05}, env={})
    lim, decisions = run_with_prior(s, train, run, "charlstm")
    assert decisions and all(d.details["prior"]["runs"] == len(train) for d in decisions)
    peak = max(float(np.nanmax(t.usage["mem"])) for t in train)
    mem = lim["mem"]
    on = np.flatnonzero(~np.isnan(mem))
    assert len(on) > 0.8 * len(mem)  # from its first recommendation on (5 s)
    assert (mem[on] >= peak * 1.05 - 1).all()  # the prior: the earlier runs' highest peak + the margin
    for d in decisions:  # each decision: never under the run's own peak so far + the actuator's margin
        k = int(np.flatnonzero(run.t == d.ts)[0])
        if d.mem_limit_bytes is not None:
            assert d.mem_limit_bytes >= np.nanmax(run.usage["mem"][:k + 1]) + 64 * MIB - 1
    cold, none = run_with_prior(Settings.from_env({"prior_min_runs": 0}, env={}), train, run, "charlstm")
    assert none == [] and np.isnan(cold["mem"]).all()  # priors off: no history, no limit (15 minutes)


def test_the_held_out_figures_of_the_shipped_corpus():
    res = priors(shipped_corpus(), "heldout", margins=(0.05,))
    r = res["results"][0]
    assert r["executions"] == 10 and sorted(r["cold"]) == [f"convlm-r{i:02d}" for i in range(8)]
    assert r["steps_limited"] > 0.8 * r["steps"]
    for name in ("cpu", "mem"):
        v = r["resources"][name]
        assert v["prior"]["fulfilment"] >= v["vpa"]["fulfilment"]
        assert v["prior"]["overruns"] <= v["vpa"]["overruns"]
        assert set(v["members"]) >= {"vpa", "window-max-60"}
    assert priors(shipped_corpus(), "heldout", margins=(0.05,)) == res  # deterministic


def test_bad_arguments_are_one_line_errors():
    r = _cli("prior", "--margins", "0.1,x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--margins" in r.stderr, r.stderr
    r = _cli("prior", "--min-runs", "0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--min-runs" in r.stderr, r.stderr


@pytest.mark.slow
def test_the_command_prints_json():
    r = _cli("prior", "--margins", "0.05", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["type"] == "corpus-prior" and res["results"][0]["margin"] == 0.05


def test_a_recorded_run_decided_with_the_phase_policy_starts_from_its_prior_too():
    from phasewise.apps.experiment.corpus_anticipate import run_with_transitions, worker_settings

    train, run = _runs("charlstm")
    rules = {"safety_rules": True}  # the live rules: 15 minutes of history before a first limit
    lim, decisions, _, fed = run_with_transitions(worker_settings(0.0, "corpus", rules), train, run, "charlstm")
    assert decisions and all(d.policy == "phase" for d in decisions)
    assert decisions[0].reason.startswith(f"prior of {len(train)} earlier runs of charlstm")
    assert decisions[0].details["source"] == "prior" and decisions[0].details["prior"]["runs"] == len(train)
    on = np.flatnonzero(~np.isnan(lim["mem"]))
    assert len(on) > 0.8 * len(lim["mem"])  # limited from its first recommendation on, not after 15 minutes
    peak = max(float(np.nanmax(t.usage["mem"])) for t in train)
    assert (lim["mem"][on] >= peak * 1.05 - 1).all()
    for d in decisions:  # never under the run's own peak so far + the actuator's margin
        k = int(np.flatnonzero(np.isclose(fed, d.ts))[0])
        if d.mem_limit_bytes is not None:
            assert d.mem_limit_bytes >= np.nanmax(run.usage["mem"][:k + 1]) + 64 * MIB - 1
    none, cold, _, _ = run_with_transitions(worker_settings(0.0, "corpus", {**rules, "prior_min_runs": 0}), train, run,
                                            "charlstm")
    assert cold == [] and np.isnan(none["mem"]).all()  # no prior: the history rule holds every limit back
