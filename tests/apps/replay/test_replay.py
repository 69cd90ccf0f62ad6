"""Replay harness and ``phasewise replay`` end to end (in-process)."""

from __future__ import annotations

import importlib.util
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from phasewise.apps.replay.driving import _Progress, decision_sequence, oracle_decisions, replay_trace
from phasewise.apps.replay.policies import PolicySpec, ScaledPolicy, policy_specs
from phasewise.apps.replay.results import result_rows
from phasewise.apps.replay.traces import ContainerSeries, Trace, load_ai4dl
from phasewise.cli import main
from phasewise.models.scoring.baselines import WindowPolicy

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "src" / "phasewise" / "data" / "ai4dl_sample.csv"
GENAI = REPO.parent / "shared" / "data" / "alibaba-genai2026-pods"
HAS_VPA = importlib.util.find_spec("phasewise.models.vpa.recommender") is not None
HAS_PHASE = importlib.util.find_spec("phasewise.models.phases.limits") is not None


class Recorder:
    """Sets limit = 1.0 and checks it was never shown a sample at or after the time it is asked about."""

    name = "recorder"

    def __init__(self, log: list) -> None:
        self.log = log
        self.seen: list[float] = []

    def limits(self, t):
        assert all(s < t for s in self.seen), f"saw {max(self.seen)} before limits({t})"
        self.log.append(("limits", t))
        return {"cpu": 1.0, "mem": 1.0}

    def observe(self, t, usage):
        assert self.log[-1] == ("limits", t), "observe(t) before limits(t)"
        self.seen.append(t)
        self.log.append(("observe", t))

    def explain(self):
        return {}


class Late:
    """No opinion for the first `k` steps, then the previous sample's usage (cpu only)."""

    name = "late"

    def __init__(self, k: int) -> None:
        self.k, self.n, self.last = k, 0, None

    def limits(self, t):
        return {"cpu": self.last if self.n >= self.k else None}

    def observe(self, t, usage):
        self.n += 1
        self.last = usage.get("cpu", self.last)

    def explain(self):
        return {"n": self.n}


class Generous:
    """A constant, very large limit: fulfils every step."""

    name = "generous"

    def limits(self, t):
        return {"cpu": 1e6, "mem": 1e15}

    def observe(self, t, usage):
        pass

    def explain(self):
        return {"phase": 3}


def test_no_policy_is_shown_a_sample_before_it_is_asked_for_that_steps_limits():
    log: list = []
    trace = load_ai4dl(SAMPLE)
    replay_trace(trace, [PolicySpec("recorder", "recorder", lambda: Recorder(log))], plot_containers=0)
    asked = [t for kind, t in log if kind == "limits"]
    assert len(asked) == trace.n_samples()
    # strictly alternating limits(t) / observe(t), per container in time order
    assert [k for k, _ in log] == ["limits", "observe"] * trace.n_samples()


def test_decision_sequence_lists_the_limits_asked_at_each_sample_time():
    s = ContainerSeries("c", np.array([0., 10., 20., 30.]),
                        {"cpu": np.array([1., 3., np.nan, 2.]), "mem": np.array([5., np.nan, 7., 6.])})
    seq = decision_sequence(WindowPolicy(window=2), s)
    assert seq == [(0.0, {}), (10.0, {"cpu": 1.0, "mem": 5.0}), (20.0, {"cpu": 3.0, "mem": 5.0}),
                   (30.0, {"cpu": 3.0, "mem": 7.0})]
    seq, exps = decision_sequence(WindowPolicy(window=2), s, explain=True)
    assert len(exps) == 4 and exps[0]["samples"] == {}
    assert oracle_decisions(s)[1] == (10.0, {"cpu": 3.0})


def _spec(name, family, make):
    return PolicySpec(name, family, make)


def test_the_oracle_scores_one_and_every_policy_is_scored_on_the_same_steps():
    trace = load_ai4dl(SAMPLE)
    specs = policy_specs(["window", "oracle"], windows=(5, 30))
    res = replay_trace(trace, specs)
    for r in ("cpu", "mem"):
        sc = res.resources[r].scores
        assert sc["oracle"].alloc_over_used == pytest.approx(1.0) and sc["oracle"].fulfilment == 1.0
        assert len({s.steps for s in sc.values()}) == 1
        # the window needs one observation: the first sample of each of the 4 containers is not scored
        assert sc["oracle"].steps == 204 - 4 and res.resources[r].warmup_steps == 4


def test_the_slowest_policy_sets_the_warm_up_for_all_and_unmanaged_resources_are_not_scored():
    trace = load_ai4dl(SAMPLE)
    specs = [_spec("late", "late", lambda: Late(10))] + policy_specs(["window", "oracle"], windows=(5,))
    res = replay_trace(trace, specs)
    cpu, mem = res.resources["cpu"], res.resources["mem"]
    assert {s.steps for s in cpu.scores.values()} == {204 - 4 * 10}
    assert cpu.warmup_steps == 40
    # Late never sets a mem limit: it does not hold back the others there, and gets no mem score
    assert mem.scores["late"].steps == 0
    assert mem.scores["oracle"].steps == mem.scores["window-max-5"].steps == 204 - 4


class Silent:
    """Names every resource it has seen but never sets a limit (a policy without a GPU model)."""

    name = "silent"

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def limits(self, t):
        return {r: None for r in self.seen}

    def observe(self, t, usage):
        self.seen.update(usage)

    def explain(self):
        return {}


def test_a_policy_that_never_sets_a_limit_for_a_resource_does_not_hold_back_the_others():
    trace = load_ai4dl(SAMPLE)
    res = replay_trace(trace, [_spec("silent", "silent", Silent)] + policy_specs(["oracle"]))
    for r in ("cpu", "mem"):
        assert res.resources[r].scores["silent"].steps == 0
        assert res.resources[r].scores["oracle"].steps == 204


def test_savings_are_against_the_cheapest_reactive_baseline_at_matched_fulfilment():
    trace = load_ai4dl(SAMPLE)
    specs = [_spec("phase", "phase", lambda: WindowPolicy(30, "p95", 1.15))] + \
        policy_specs(["window", "oracle"], windows=(5, 10, 30, 60))
    res = replay_trace(trace, specs)
    rows, savings = result_rows(res)
    for r in ("cpu", "mem"):
        sc = res.resources[r].scores
        phase = sc["phase"]
        reached = [n for n in res.members("window") if sc[n].fulfilled >= phase.fulfilled]
        best = min(reached, key=lambda n: sc[n].alloc)
        srow = next(s for s in savings if s["resource"] == r)
        assert srow["best_reactive"] == best and srow["matched_fulfilment"] is True
        assert srow["savings_vs_best_reactive"] == pytest.approx(1 - phase.alloc / sc[best].alloc, abs=1e-6)
        wrow = next(x for x in rows if x["policy"] == "window" and x["resource"] == r)
        assert wrow["member"] == best  # same rule picks the reported window member
        assert set(wrow["members"]) == set(res.members("window"))


def test_an_unreachable_phase_fulfilment_is_flagged_and_the_closest_baseline_used():
    trace = load_ai4dl(SAMPLE)
    specs = [_spec("phase", "phase", Generous)] + policy_specs(["window"], windows=(5, 60))
    res = replay_trace(trace, specs)
    _, savings = result_rows(res)
    mem = next(s for s in savings if s["resource"] == "mem")
    sc = res.resources["mem"].scores
    assert sc["phase"].fulfilment == 1.0
    top = max(sc[n].fulfilled for n in res.members("window"))
    assert top < sc["phase"].fulfilled
    assert mem["matched_fulfilment"] is False and "flag" in mem
    assert sc[mem["best_reactive"]].fulfilled == top
    assert mem["savings_vs_best_reactive"] < 0  # a huge constant limit costs more


def _scored(points: dict[str, tuple[float, int]], steps: int = 200):
    """A ReplayResult on one resource whose policies scored (alloc_over_used, steps fulfilled) of *steps*."""
    from phasewise.apps.replay.results import ReplayResult, ResourceResult
    from phasewise.models.scoring.measures import Score

    fam = {"vpa": "vpa", "phase": "phase", "oracle": "oracle"}
    specs = [PolicySpec(n, fam.get(n, "window"), None) for n in points]
    scores = {n: Score(alloc=a * 100.0, used=100.0, fulfilled=k, steps=steps) for n, (a, k) in points.items()}
    tr = Trace("ai4dl", "hand", {"cpu": "cores"}, [])
    return ReplayResult(tr, specs, {"cpu": ResourceResult("cpu", "cores", scores)}, [], 0.0)


def test_savings_against_a_frontier_of_two_members_match_a_hand_computation(assert_replay_output):
    # vpa (1.5, 96 %), window (1.2, 90 %); the phase policy at (1.3, 94 %):
    # R(94 %) = 1.2 + 0.3 * (4 / 6) = 1.4; slack 0.3 vs 0.4 -> 25 % cut; allocation 1 - 1.3/1.4
    _, (row,) = result_rows(_scored({"vpa": (1.5, 192), "window-max-5": (1.2, 180), "phase": (1.3, 188)}))
    assert row["type"] == "savings"
    assert row["frontier_alloc_at_phase_fulfilment"] == pytest.approx(1.4)
    assert row["slack_cut_vs_frontier"] == pytest.approx(0.25)
    assert row["alloc_cut_vs_frontier"] == pytest.approx(1 - 1.3 / 1.4, abs=1e-6)
    assert row["frontier_mix"] == pytest.approx({"window-max-5": 1 / 3, "vpa": 2 / 3}, abs=1e-6)
    assert row["phase_fulfilment_above_every_reactive"] is False and row["frontier_fulfilment"] == 0.94
    # the single-baseline rule still compares with vpa, the only member at >= 94 %
    assert row["best_reactive"] == "vpa" and row["savings_vs_best_reactive"] == pytest.approx(1 - 1.3 / 1.5, abs=1e-6)
    assert_replay_output([row])


def test_savings_against_a_frontier_of_three_members_match_a_hand_computation(assert_replay_output):
    # a (1.1, 80 %), b (1.3, 95 %), vpa (1.8, 99 %), a dominated d (1.6, 90 %); phase (1.5, 97 %):
    # R(97 %) = half way from b to vpa = 1.55; slack cut 1 - 0.5/0.55; single rule: vpa, 1 - 1.5/1.8
    pts = {"vpa": (1.8, 198), "window-a": (1.1, 160), "window-b": (1.3, 190), "window-d": (1.6, 180),
           "phase": (1.5, 194)}
    _, (row,) = result_rows(_scored(pts))
    assert [v["member"] for v in row["frontier"]] == ["window-a", "window-b", "vpa"]
    assert row["frontier_alloc_at_phase_fulfilment"] == pytest.approx(1.55)
    assert row["slack_cut_vs_frontier"] == pytest.approx(1 - 0.5 / 0.55, abs=1e-6)
    assert row["alloc_cut_vs_frontier"] == pytest.approx(1 - 1.5 / 1.55, abs=1e-6)
    assert row["savings_vs_best_reactive"] == pytest.approx(1 - 1.5 / 1.8, abs=1e-6)
    assert_replay_output([row])


def test_a_phase_fulfilment_above_every_reactive_member_is_compared_at_the_highest_and_said(
        assert_replay_output):
    pts = {"vpa": (1.8, 198), "window-a": (1.1, 160), "window-b": (1.3, 190), "phase": (2.0, 200)}
    _, (row,) = result_rows(_scored(pts))
    assert row["phase_fulfilment_above_every_reactive"] is True
    assert row["frontier_fulfilment"] == 0.99 and row["frontier_alloc_at_phase_fulfilment"] == 1.8
    assert row["slack_cut_vs_frontier"] == pytest.approx(1 - 1.0 / 0.8)  # 25 % more slack than vpa's
    assert "above every reactive baseline" in row["frontier_note"]
    assert row["matched_fulfilment"] is False
    assert_replay_output([row])


def test_phase_ids_come_from_the_phase_policys_explain():
    trace = load_ai4dl(SAMPLE)
    res = replay_trace(trace, [_spec("phase", "phase", Generous)], plot_containers=2)
    assert len(res.plotted) == 2
    assert set(res.plotted[0].phases.tolist()) == {3}


def test_scaled_policy_shows_usage_in_other_units_and_scales_limits_back():
    p = ScaledPolicy(WindowPolicy(window=3), {"mem": 2.0 ** 40})
    for t, v in enumerate([0.25, 0.5, 0.125]):
        p.observe(float(t), {"mem": v})
    assert p.inner.limits(3.0)["mem"] == 0.5 * 2 ** 40
    assert p.limits(3.0)["mem"] == 0.5
    assert p.explain()["harness_unit_scales"] == {"mem": 2.0 ** 40}


@pytest.mark.skipif(not HAS_VPA, reason="phasewise.models.vpa.recommender not written yet")
def test_vpa_sees_a_memory_fraction_as_bytes_of_a_nominal_pod():
    frac = policy_specs(["vpa"], units={"mem": "fraction of the pod's memory"})[0].factory()
    byt = policy_specs(["vpa"], units={"mem": "bytes"})[0].factory()
    assert isinstance(frac, ScaledPolicy) and not isinstance(byt, ScaledPolicy)


def test_unknown_policies_are_refused():
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        policy_specs(["magic"])


def test_the_progress_bar_counts_containers_and_is_silent_without_a_stream():
    buf = io.StringIO()
    bar = _Progress(3, buf)
    bar.update(3)
    assert "3/3 containers" in buf.getvalue() and buf.getvalue().endswith("\n")
    _Progress(3, None).update(1)  # no stream, nothing to write to


# ---------------------------------------------------------------- CLI


def test_the_output_schema_refuses_untyped_lines_and_unknown_fields():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "infra" / "schemas" / "ReplayOutput.v1.json").read_text())
    v = jsonschema.Draft202012Validator(schema)
    row = {"type": "score", "policy": "vpa", "resource": "cpu", "alloc_over_used": 1.5, "fulfilment": 0.97,
           "steps": 10, "unit": "cores", "containers": 1}
    assert v.is_valid(row)
    assert not v.is_valid({k: x for k, x in row.items() if k != "type"})
    assert not v.is_valid({**row, "type": "savings"})
    assert not v.is_valid({**row, "surprise": 1})
    assert not v.is_valid({**row, "fulfilment": 1.5})


def _policies() -> str:
    return ",".join(p for p, ok in (("vpa", HAS_VPA), ("window", True), ("phase", HAS_PHASE), ("oracle", True)) if ok)


def test_the_cli_prints_a_setup_line_then_one_score_line_per_policy_and_resource_then_savings(
        capsys, assert_replay_output):
    rc = main(["replay", str(SAMPLE), "--format", "ai4dl", "--policies", _policies(), "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [json.loads(ln) for ln in out.splitlines()]
    assert_replay_output(lines)
    fams = _policies().split(",")
    assert [x["type"] for x in lines] == ["setup"] + ["score"] * len(fams) * 2 + ["savings"] * 2
    rows = [x for x in lines if x["type"] == "score"]
    savings = [x for x in lines if x["type"] == "savings"]
    setup = lines[0]
    assert setup["trace"]["containers"] == 4 and setup["trace"]["samples"] == 204
    assert setup["trace"]["non_finite_missing"] == {} and setup["command"].startswith("phasewise replay")
    for x in rows:
        assert set(x) >= {"policy", "resource", "alloc_over_used", "fulfilment", "steps"}
        assert x["resource"] in ("cpu", "mem") and x["policy"] in fams
    oracle = [x for x in rows if x["policy"] == "oracle"]
    assert all(x["alloc_over_used"] == 1.0 and x["fulfilment"] == 1.0 for x in oracle)
    window = [x for x in rows if x["policy"] == "window"]
    assert all(x["member"] in x["members"] for x in window)
    if not HAS_PHASE:
        assert all(s["savings_vs_best_reactive"] is None for s in savings)


def test_the_cli_writes_a_report_with_plots_and_a_summary(tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["replay", str(SAMPLE), "--policies", _policies(), "--report", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "alloc/used" in text and "oracle" in text and "vs reactive frontier at" in text
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["container-1-service1_exec1.png", "container-2-service1_exec2.png",
                    "container-3-service1_exec3.png", "container-4-service1_exec4.png", "tradeoff.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    summary = (out / "summary.md").read_text()
    assert f"phasewise replay {SAMPLE} --format ai4dl --policies {_policies()} --report {out}" in summary
    assert "No policy sees the future" in summary and "Apache-2.0" in summary
    assert "| cpu | window |" in summary
    # the measure first, then the trade-off plot, then a verdict per resource, then the rest
    head = summary.split("## Data")[0]
    assert head.index("**Measure.**") < head.index("(tradeoff.png)")
    if HAS_PHASE:
        for r in ("cpu", "mem"):
            assert re.search(rf"- `{r}`: the phase policy \*\*(beats|matches|does not beat)\*\* the reactive "
                             rf"frontier: at [0-9.]+% fulfilment", head), head


def test_nan_usage_is_counted_in_the_setup_line_and_an_unscored_resource_is_warned_about(
        tmp_path, capsys, assert_replay_output):
    f = tmp_path / "nan.csv"
    rows = [f"{10 * i},s,p,{'NaN' if i % 2 else 'inf'},{100 + i}" for i in range(30)]
    f.write_text("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n" + "\n".join(rows) + "\n")
    assert main(["replay", str(f), "--policies", "window,oracle", "--json"]) == 0
    out = capsys.readouterr()
    lines = [json.loads(ln) for ln in out.out.splitlines()]
    assert_replay_output(lines)
    setup = lines[0]
    assert setup["trace"]["non_finite_missing"] == {"nan.csv cpu.usage.cores": 30}
    assert any("30 NaN/infinite value(s) treated as missing (15 NaN, 15 infinite)" in n
               for n in setup["trace"]["notes"])
    assert "cpu: no value in the trace, so no step is scored for it" in out.err
    assert "note: nan.csv cpu.usage.cores: 30 NaN/infinite" in out.err
    cpu = [x for x in lines if x["type"] == "score" and x["resource"] == "cpu"]
    assert cpu and all(x["steps"] == 0 for x in cpu)


def test_json_with_a_report_writes_only_json_to_stdout(tmp_path, capsys, assert_replay_output):
    import logging

    logging.getLogger().setLevel(logging.DEBUG)  # whatever matplotlib logs must not reach stdout
    assert main(["replay", str(SAMPLE), "--policies", _policies(), "--json", "--quiet",
                 "--report", str(tmp_path / "r"), "--log-level", "debug"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(ln.startswith("{") for ln in lines)
    assert_replay_output([json.loads(ln) for ln in lines])


def test_through_kafka_without_a_policy_the_worker_runs_is_refused_with_exit_status_2(capsys):
    assert main(["replay", str(SAMPLE), "--policies", "window", "--through-kafka"]) == 2
    assert "none of the policies runs in the stream worker" in capsys.readouterr().err


def test_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["replay", str(bad), "--policies", "window"]) == 2
    assert "missing column" in capsys.readouterr().err
    assert main(["replay", str(SAMPLE), "--policies", "window,crystal-ball"]) == 2
    assert "unknown policy 'crystal-ball'" in capsys.readouterr().err
    assert main(["replay", str(SAMPLE), "--windows", "0"]) == 2



@pytest.mark.skipif(not GENAI.is_dir(), reason="shared GenAI 2026 trace not present (not shipped: no licence)")
def test_the_genai_trace_replays_gpu_gpu_memory_and_memory(capsys):
    rc = main(["replay", str(GENAI), "--format", "genai2026", "--policies", "window,oracle",
               "--windows", "10", "--json"])
    assert rc == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    got = {(x["policy"], x["resource"]): x for x in rows if "policy" in x}
    assert set(got) == {(p, r) for p in ("window", "oracle") for r in ("gpu", "gpu_mem", "mem")}
    assert got[("window", "gpu")]["containers"] == 105
    assert "fraction" in got[("oracle", "mem")]["unit"]
    assert all(x["steps"] > 100_000 for x in got.values())


def test_a_container_where_one_policy_never_had_an_opinion_is_scored_for_no_policy():
    short = ContainerSeries("short", np.array([0.0]), {"cpu": np.array([1.0])})
    longer = ContainerSeries("long", np.array([0.0, 10.0, 20.0]), {"cpu": np.array([1.0, 2.0, 2.0])})
    tr = Trace("ai4dl", "mem", {"cpu": "cores"}, [short, longer])
    res = replay_trace(tr, policy_specs(["window", "oracle"], windows=(5,)))
    cpu = res.resources["cpu"]
    # the window has no opinion at the first sample of each container: 'short' is not
    # scored at all (not even for the oracle), 'long' from its second sample
    assert {s.steps for s in cpu.scores.values()} == {2}
    assert cpu.containers == 1 and cpu.warmup_steps == 2 and cpu.valid_steps == 4
    rows, _ = result_rows(res)
    # window limits 1.0 then 2.0 against usage 2.0, 2.0
    assert {r["policy"]: r["fulfilment"] for r in rows} == {"window": 0.5, "oracle": 1.0}


def test_the_shared_model_fleet_replays_with_limits_decided_before_each_step():
    from phasewise.apps.replay.driving import fleet_sequences
    from phasewise.apps.replay.traces import load_trace

    trace = load_trace(SAMPLE, "ai4dl")
    seqs = fleet_sequences(trace)
    assert set(seqs) == {c.container for c in trace.containers}
    for c in trace.containers:
        seq = seqs[c.container]
        assert [t for t, _ in seq] == c.t.tolist()
        assert seq[0][1] == {}  # nothing observed before the first sample: no limit yet
        # a limit handed out for step t never depends on the usage at t: change the
        # trace from t on and the sequence up to t is the same
    cut = trace.containers[0]
    k = len(cut.t) // 2
    changed_usage = {r: u.copy() for r, u in cut.usage.items()}
    for u in changed_usage.values():
        u[k:] *= 7.0
    from phasewise.apps.replay.traces import ContainerSeries, Trace

    other = Trace(trace.format, trace.source, trace.units,
                  [ContainerSeries(cut.container, cut.t, changed_usage), *trace.containers[1:]])
    a, b = seqs[cut.container], fleet_sequences(other)[cut.container]
    assert a[: k + 1] == b[: k + 1]


def test_the_fleet_tells_per_sample_its_phase_and_whether_its_limit_came_from_the_fallback():
    from phasewise.apps.replay.driving import FleetDetail, fleet_sequences

    trace = load_ai4dl(SAMPLE)
    detail = FleetDetail()
    seqs = fleet_sequences(trace, detail=detail)
    for c in trace.containers:
        n = len(c)
        assert detail.phases[c.container].shape == (n,) and detail.phases[c.container].min() >= -1
        for r in ("cpu", "mem"):
            fb = detail.fallback[c.container][r]
            assert fb.dtype == bool and fb.shape == (n,)
            assert not fb[0]  # no limit in force before the first sample: from nothing
            # a limit from the fallback is in force only where a limit is in force at all
            has = np.array([lim.get(r) is not None for _, lim in seqs[c.container]])
            assert not (fb & ~np.maximum.accumulate(has)).any()
    assert any(detail.fallback[c.container]["cpu"].any() for c in trace.containers)


@pytest.mark.parametrize("folds", [0, 2])
def test_the_fleet_shows_its_progress_from_its_first_step_to_its_last(folds):
    """The shared model's run (and its pretraining passes) can take minutes: a bar over every event time
    it steps, drawn before the first one."""
    from phasewise.apps.replay.driving import FleetOptions, fleet_sequences

    trace = load_ai4dl(SAMPLE)
    out = io.StringIO()
    fleet_sequences(trace, options=FleetOptions(pretrain_folds=folds), progress=out)
    frames = out.getvalue().split("\r")[1:]
    first, last = frames[0], frames[-1]
    total = int(last.split("/")[1].split()[0])
    assert first.startswith("phase model [") and first.endswith(f" 0/{total} event times")
    assert last == f"phase model [{'#' * 30}] {total}/{total} event times\n"
    steps = len({t for c in trace.containers for t in c.t.tolist()})
    assert total == steps if folds == 0 else total >= 2 * steps  # the pretraining passes counted too


def test_phase_model_fleet_is_a_replay_option(capsys):
    assert main(["replay", str(SAMPLE), "--policies", "vpa,phase", "--phase-model", "fleet", "--json",
                 "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(r.get("policy") == "phase" and r["steps"] > 0 for r in rows)


def test_a_container_plot_with_one_resource_keeps_its_legends_inside_the_figure(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from phasewise.apps.replay.report import write_report

    boxes: dict[str, tuple] = {}  # saved file -> (figure box, its legends' boxes) as drawn
    save = Figure.savefig

    def saving(self, path, *a, **kw):
        save(self, path, *a, **kw)
        r = self.canvas.get_renderer()
        legends = [*self.legends, *(ax.get_legend() for ax in self.axes if ax.get_legend())]
        boxes[Path(path).name] = (self.bbox, [leg.get_window_extent(r) for leg in legends])

    monkeypatch.setattr(Figure, "savefig", saving)
    tr = load_ai4dl(SAMPLE)
    one = Trace(tr.format, tr.source, {"cpu": tr.units["cpu"]},
                [ContainerSeries(c.container, c.t, {"cpu": c.usage["cpu"]}) for c in tr.containers[:2]])
    phases = {c.container: (np.arange(len(c)) // 20) % 3 for c in one.containers}  # a phase key beside it
    res = replay_trace(one, policy_specs(["vpa", "window", "oracle"], windows=(60,), units=one.units),
                       plot_containers=1, phase_ids=phases)
    rows, savings = result_rows(res)
    write_report(res, rows, savings, tmp_path, command="phasewise replay")
    [(fig_box, legends)] = [v for name, v in boxes.items() if name.startswith("container-")]
    assert len(legends) == 2  # the policies' and the phase key
    for box in legends:
        assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 + 0.5, (box, fig_box)
