"""Each container is decided with the policy its workload names (``phasewise.io/policy``), the worker's
``--policy`` being the default: through the worker's step (``worker_round``), the refusal of a policy
the worker does not run, and what ``phasewise explain`` shows."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.kit.records import ContainerSample, Decision, HostSamples, WorkloadPolicy
from phasewise.kit.settings import Settings
from phasewise.models.phases.detector import PhaseModel, learn
from phasewise.models.phases.updater import PhaseHooks
from phasewise.models.safety.workload import policy_of, refusal_reason, step_columns, unserved
from phasewise.models.scoring.scorecard import ScorecardConfig
from phasewise.models.vpa.updater import worker_round
from phasewise.streams import explain
from phasewise.streams.config import detector_config, state_cache, updater_config
from phasewise.streams.scorecard import LiveScorecard

MIB = 2**20
ASKS = {None: None, "vpa": WorkloadPolicy(mode="apply", source="annotation", policy="vpa"),
        "phase": WorkloadPolicy(mode="apply", source="annotation", policy="phase")}


def regime(t: int) -> tuple[float, float]:
    return (1.5, 1.5e9) if (t // 20) % 2 else (0.05, 2e8)


def warm_model() -> PhaseModel:
    m = PhaseModel(features=("cpu", "mem"), n_his=2, warmup=32, seed=0)
    W = np.array([[regime(t + k) for k in range(3)] for t in range(160)])
    for _ in range(4):
        learn(m, W)
    m.clusterer.update_stats(m.predict(W), W[:, -1])
    m.clusterer.update_rel_stats(m.predict(W), W[:, -1] / W[:, -1].max(axis=0))
    return m


class Phase:
    """The phase side of a worker as ``worker_round`` drives it (what the agent's PhaseAgents does)."""

    def __init__(self, settings: Settings, cache) -> None:
        self.hooks = PhaseHooks(detector_config(settings), cache, model=warm_model(), version=1)
        self.shadow: list[Decision] = []

    def process_many(self, msgs):
        out = self.hooks.process_many(msgs)
        self.shadow = out.shadow
        return out.decisions


def settings(policy: str, safety: bool = True, **kw) -> Settings:
    return Settings.from_env({"policy": policy, "recommend_interval_s": 1.0, "vpa_time_scale": 0.001,
                              "hysteresis": 0.05, "safety_rules": safety, "safety_min_history_s": 10.0,
                              "safety_cooldown_s": 5.0, "safety_peak_window_s": 60.0, **kw}, env={})


def run(policy: str, asks: dict[str, WorkloadPolicy | None], seconds: int = 90, phase: bool = True,
        scorecard: LiveScorecard | None = None, shadow: list | None = None):
    """A worker with default *policy* over containers named after what their workload asks (*asks*);
    *shadow* collects the phase decisions not published (None: the detector builds none)."""
    s = settings(policy)
    cache = state_cache(s)
    ph = Phase(s, cache) if phase else None
    if ph is not None:
        ph.hooks.keep_shadow = shadow is not None or scorecard is not None
    published: list[Decision] = []
    for t in range(seconds):
        cpu, mem = regime(t)
        hs = HostSamples(host="h1", ts=1000.0 + t, interval_s=1.0, containers=tuple(
            ContainerSample(container=name, cpu_cores=cpu, mem_bytes=mem, cpu_limit_cores=4.0, mem_limit_bytes=8e9,
                            nr_periods=10, workload=w) for name, w in asks.items()))
        published += worker_round(cache, [hs], updater_config(s), ph, scorecard)
        if ph is not None and (shadow is not None or not ph.hooks.keep_shadow):
            (shadow if shadow is not None else NOT_BUILT).extend(ph.shadow)
    return published, cache


NOT_BUILT: list[Decision] = []  # what a detector told to build no shadow decisions built anyway (must stay empty)


def by_container(decisions: list[Decision]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for d in decisions:
        out.setdefault(d.container, set()).add(d.policy)
    return out


@pytest.mark.parametrize("default", ["vpa", "phase"])
def test_each_container_is_decided_with_its_workloads_policy_and_the_default_fills_in(default):
    asks = {"plain": None, "wants-vpa": ASKS["vpa"], "wants-phase": ASKS["phase"]}
    published, _ = run(default, asks)
    got = by_container(published)
    assert got == {"plain": {default}, "wants-vpa": {"vpa"}, "wants-phase": {"phase"}}
    # the safety rules bound the decisions published, and only those: every one says which rule bounded it
    assert all("safety" in d.details for d in published)


def test_one_policy_per_container_whatever_the_others():
    """A container's decisions do not depend on what its neighbours' workloads ask for."""
    alone, _ = run("phase", {"x": ASKS["vpa"]})
    mixed, _ = run("phase", {"x": ASKS["vpa"], "y": ASKS["phase"], "z": None})
    assert [(d.id, d.cpu_limit_cores, d.mem_limit_bytes) for d in alone] == \
        [(d.id, d.cpu_limit_cores, d.mem_limit_bytes) for d in mixed if d.container == "x"]


def test_the_policy_not_published_is_scored_as_the_bare_policy():
    sc = LiveScorecard(ScorecardConfig(windows_s=(60.0,), buckets=5, samples=0), policy="phase",
                       served=("vpa", "phase"))
    run("phase", {"wants-vpa": ASKS["vpa"], "plain": None}, scorecard=sc)
    for key in ("h1/wants-vpa", "h1/plain"):
        rows = {(r["resource"], r["policy"]): r for r in sc.explain(key)["scorecard"]}
        assert rows[("cpu", "vpa")].get("steps", 0) > 0 and rows[("cpu", "phase")].get("steps", 0) > 0, key
    card = sc.explain("h1/wants-vpa")
    assert card["policy"] == "vpa" and card["worker_policy"] == "phase"
    assert "(policy vpa: the workload's, from annotation; worker default phase)" in explain.format_card(card)
    assert sc.explain("h1/plain")["policy"] == "phase"


def test_a_vpa_worker_without_the_phase_machinery_refuses_a_phase_workload_visibly():
    hs = HostSamples(host="h1", ts=1.0, interval_s=1.0, containers=tuple(
        ContainerSample(container=n, cpu_cores=1.0, mem_bytes=1e9, workload=w)
        for n, w in (("plain", None), ("wants-phase", ASKS["phase"]), ("wants-vpa", ASKS["vpa"]))))
    kept, refused = unserved(hs, "vpa", ("vpa",))
    assert [c.container for c in kept.containers] == ["plain", "wants-vpa"]
    assert [c.container for c in refused] == ["wants-phase"]
    assert unserved(hs, "vpa", ("vpa", "phase")) == (hs, ())  # --phase-workloads or --policy phase: all served
    why = refusal_reason(refused[0], "vpa", ("vpa",))
    assert "asks for policy phase (from annotation)" in why and "not decided" in why and "--phase-workloads" in why
    # what explain shows for it
    sc = LiveScorecard(ScorecardConfig(windows_s=(60.0,), buckets=5, samples=0), policy="vpa")
    sc.observe_round([kept])
    sc.refuse("h1/wants-phase", refused[0], why)
    status, body = sc.view(None)
    assert status == 200 and body["refused"] == ["h1/wants-phase"]
    status, card = sc.view("wants-phase")
    assert status == 200 and card["refused"] == why and card["policy"] == "phase" and card["worker_policy"] == "vpa"
    text = explain.format_card(card)
    assert "(policy phase: the workload's, from annotation; worker default vpa)" in text and f"refused: {why}" in text
    # its workload no longer asks for phase: decided again, no longer listed as refused
    sc.observe_round([HostSamples(host="h1", ts=2.0, interval_s=1.0, containers=(
        ContainerSample(container="wants-phase", cpu_cores=1.0, mem_bytes=1e9),))])
    assert sc.view(None)[1]["refused"] == []


def test_a_refused_container_is_never_decided_through_the_step():
    """With the refused containers dropped before the step (as the samples agent does), a vpa-only
    worker publishes nothing for them, and nothing of another policy."""
    s = settings("vpa")
    cache = state_cache(s)
    published: list[Decision] = []
    for t in range(60):
        hs = HostSamples(host="h1", ts=1000.0 + t, interval_s=1.0, containers=tuple(
            ContainerSample(container=n, cpu_cores=0.2, mem_bytes=3e8, cpu_limit_cores=4.0, mem_limit_bytes=8e9,
                            nr_periods=10, workload=w) for n, w in (("plain", None), ("wants-phase", ASKS["phase"]))))
        kept, _ = unserved(hs, "vpa", s.worker.served_policies())
        published += worker_round(cache, [kept], updater_config(s))
    assert by_container(published) == {"plain": {"vpa"}}
    assert "h1/wants-phase" not in cache


def test_served_policies():
    assert Settings.from_env({}, env={}).worker.served_policies() == ("vpa",)
    assert Settings.from_env({"phase_workloads": True}, env={}).worker.served_policies() == ("vpa", "phase")
    assert Settings.from_env({"policy": "phase"}, env={}).worker.served_policies() == ("vpa", "phase")


def test_step_columns_of_plain_samples_cost_nothing_extra():
    cs = [ContainerSample(container=str(i), cpu_cores=1.0, mem_bytes=1.0, workload=WorkloadPolicy(mode="apply"))
          for i in range(5)]
    col = step_columns(cs, "vpa")
    assert col.policies is None and col.lo is None and col.hi is None and col.uses("vpa", "vpa") is True
    assert policy_of(cs[0], "phase") == "phase"


def test_without_a_scorecard_the_unpublished_phase_decisions_are_not_even_built():
    asks = {"wants-vpa": ASKS["vpa"], "plain": None}
    kept: list[Decision] = []
    with_shadow, _ = run("phase", asks, shadow=kept)
    without, _ = run("phase", asks)
    assert [d.id for d in with_shadow] == [d.id for d in without]  # the same decisions published
    assert kept and {d.container for d in kept} == {"wants-vpa"} and {d.policy for d in kept} == {"phase"}
    assert NOT_BUILT == []
