"""The worker's live scorecard: fed by worker_round, scraped as bounded metrics, shown by ``phasewise explain``."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from phasewise.kit.records import ContainerSample, HostSamples
from phasewise.kit.settings import Settings
from phasewise.models.phases.names import UNSEEN
from phasewise.models.scoring.scorecard import ScorecardConfig
from phasewise.models.vpa.updater import worker_round
from phasewise.streams import explain
from phasewise.streams.config import state_cache, updater_config
from phasewise.streams.scorecard import LiveScorecard


def run_worker(n: int = 120, hosts=("h1", "h2")) -> LiveScorecard:
    settings = Settings.from_env({}, env={"PHASEWISE_VPA_TIME_SCALE": "0.001", "PHASEWISE_RECOMMEND_INTERVAL_S": "5",
                                          "PHASEWISE_VPA_UPDATE_MODE": "hysteresis",
                                          "PHASEWISE_SAFETY_RULES": "false"})
    cache, cfg = state_cache(settings), updater_config(settings)
    sc = LiveScorecard(ScorecardConfig(windows_s=(60.0, 600.0), buckets=5, samples=0), vpa_cache=cache)
    for i in range(n):
        msgs = [HostSamples(host=h, ts=1000.0 + 5 * i, interval_s=5.0, containers=(
            ContainerSample(container="train", cpu_cores=1.0 + (i % 7) / 10, mem_bytes=2e9 + 1e7 * (i % 5),
                            cpu_limit_cores=4.0, mem_limit_bytes=8e9),
            ContainerSample(container=f"only-{h}", cpu_cores=0.5, mem_bytes=1e9))) for h in hosts]
        worker_round(cache, msgs, cfg, None, sc)
    return sc


@pytest.fixture(scope="module")
def sc() -> LiveScorecard:
    return run_worker()


def test_metrics_are_the_fleet_totals_with_bounded_labels(sc):
    reg = CollectorRegistry()
    reg.register(sc)
    text = generate_latest(reg).decode()
    assert "h1" not in text and "train" not in text  # never a container or host in a label
    totals = sc.model.totals()
    v = totals[600.0]["cpu"]["vpa"]
    want = reg.get_sample_value("phasewise_worker_scorecard_alloc_over_used",
                                {"policy": "vpa", "resource": "cpu", "window": "600s"})
    assert v.steps > 0 and want == pytest.approx(v.alloc_over_used)
    lim = reg.get_sample_value("phasewise_worker_scorecard_fulfilment",
                               {"policy": "limit", "resource": "cpu", "window": "60s"})
    assert lim == 1.0  # 4 cores in force, at most 1.6 used
    assert reg.get_sample_value("phasewise_worker_scorecard_steps",
                                {"policy": "phase", "resource": "cpu", "window": "60s"}) is None


def test_explain_view(sc):
    assert sc.view(None) == (200, {"containers": ["h1/only-h1", "h1/train", "h2/only-h2", "h2/train"], "refused": []})
    status, body = sc.view("train")
    assert status == 409 and "h1/train" in body["error"]
    status, body = sc.view("only-h2")
    assert status == 200 and body["container"] == "h2/only-h2"
    json.dumps(body, allow_nan=False)  # valid JSON: no inf/nan
    assert body["now"]["cpu"]["limit"] is None  # unlimited
    rows = {(r["window_s"], r["resource"], r["policy"]): r for r in body["scorecard"]}
    assert rows[(600.0, "cpu", "limit")]["note"] == "no limit in this window"
    assert rows[(600.0, "cpu", "vpa")]["steps"] > 0
    assert body["vpa"]["recommendation"]["cpu"]["target"] > 0 and body["phase"] is None
    assert sc.view("nope")[0] == 404


class _Serve:
    """The scorecard view on phasewise's own metrics server, as ``phasewise worker`` serves it."""

    def __init__(self, sc: LiveScorecard) -> None:
        from phasewise.kit.observe import Health, serve

        self.server = serve(CollectorRegistry(), 0, Health(),
                            views={"/scorecard/": lambda q: sc.view(q.get("container"))})
        self.url = f"http://127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.server.close()


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    explain.add_arguments(p)
    return p.parse_args(argv)


def test_explain_command_over_two_workers(sc, capsys):
    other = run_worker(n=3, hosts=("h9",))
    a, b = _Serve(sc), _Serve(other)
    try:
        assert explain.run(_args("h2/train", "--worker", b.url, "--worker", a.url)) == 0
        out = capsys.readouterr().out
        assert out.startswith("container h2/train") and "scorecard" in out
        assert any(line.split()[:3] == ["600s", "cpu", "vpa"] for line in out.splitlines())
        assert explain.run(_args("only-h9", "--worker", a.url, "--worker", b.url, "--json")) == 0
        assert json.loads(capsys.readouterr().out)["container"] == "h9/only-h9"
        assert explain.run(_args("--worker", a.url)) == 0
        assert "h1/train" in capsys.readouterr().out
        assert explain.run(_args("ghost", "--worker", a.url)) == 1
        assert "no worker holds container 'ghost'" in capsys.readouterr().err
        assert explain.run(_args("train", "--worker", a.url)) == 1  # on two hosts: name one
        assert "several hosts" in capsys.readouterr().err
    finally:
        a.close()
        b.close()


def test_scrapes_within_every_s_reuse_the_last_scoring():
    now = [0.0]
    sc = LiveScorecard(ScorecardConfig(windows_s=(60.0,), buckets=5, samples=0), every_s=10.0, share=1e-9,
                       clock=lambda: now[0])
    reg = CollectorRegistry()
    reg.register(sc)

    def steps() -> float | None:
        return reg.get_sample_value("phasewise_worker_scorecard_steps",
                                    {"policy": "limit", "resource": "cpu", "window": "60s"})

    def round_(ts: float) -> None:
        sc.observe_round([HostSamples(host="h", ts=ts, interval_s=1.0, containers=(
            ContainerSample(container="c", cpu_cores=1.0, mem_bytes=1e9, cpu_limit_cores=2.0),))])

    round_(1.0)
    round_(2.0)
    assert steps() == 2
    round_(3.0)
    now[0] = 9.9
    assert steps() == 2  # the cached scoring
    now[0] = 10.0
    assert steps() == 2  # the last scoring took > 1e-8 s: at most share 1e-9 of the time, so not yet
    sc.share = 1.0
    assert steps() == 3


def test_explain_shows_identity_and_mode_and_off_is_not_scored(capsys):
    from phasewise.kit.records import ContainerIdentity, WorkloadPolicy

    cid = "3f1c2a9e8b7d6c5f4e3d2c1b0a99887766554433221100ffeeddccbbaa998877"
    who = ContainerIdentity(layout="kubepods-systemd", container_id=cid, pod_namespace="ml", pod_name="trainer-0",
                            container_name="worker", runtime="containerd", qos="burstable")
    sc = LiveScorecard(ScorecardConfig(windows_s=(60.0,), buckets=5, samples=0))
    for i in range(3):
        sc.observe_round([HostSamples(host="n1", ts=10.0 + i, interval_s=1.0, containers=(
            ContainerSample(container=cid, cpu_cores=1.0, mem_bytes=1e9, cpu_limit_cores=2.0, identity=who,
                            workload=WorkloadPolicy(mode="recommend", source="annotation", cpu_max_cores=4.0)),
            ContainerSample(container="ignored", cpu_cores=1.0, mem_bytes=1e9,
                            workload=WorkloadPolicy(mode="off")),
        ))])
    assert sc.containers() == [f"n1/{cid}"]  # the off one is not managed, so not scored
    status, card = sc.view(cid)
    assert status == 200 and card["identity"]["pod_name"] == "trainer-0" and card["workload"]["mode"] == "recommend"
    text = explain.format_card(card)
    assert "pod ml/trainer-0 container worker (qos burstable, containerd, layout kubepods-systemd)" in text
    assert "mode recommend (from annotation): decided and published, never written" in text


def test_explain_shows_the_phase_with_the_phase_policy():
    """--policy phase: the view carries the detector's phase, its source per resource and the VPA's numbers."""
    from phasewise.apps.replay.through_kafka import _InProcessPhase, replay_settings_env, trace_messages
    from phasewise.apps.replay.traces import ContainerSeries, Trace

    t = 5.0 * np.arange(120) + 1.0
    trace = Trace("synthetic", "-", {"cpu": "cores", "mem": "bytes"}, [ContainerSeries(
        "c0", t, {"cpu": np.where((t // 150) % 2 == 0, 0.5, 2.0), "mem": np.where((t // 150) % 2 == 0, 1e9, 3e9)})])
    settings = Settings.from_env({"bootstrap": "in-process", "host": "h"},
                                 env=replay_settings_env("phase", trace, frozen_model=True))
    cache, cfg = state_cache(settings), updater_config(settings)
    phase = _InProcessPhase(settings, cache, True)
    sc = LiveScorecard(ScorecardConfig(windows_s=(300.0,), buckets=5, samples=0), vpa_cache=cache, phase=phase,
                       policy="phase")
    for m in trace_messages(trace, "h"):
        worker_round(cache, [m], cfg, phase, sc)
    status, card = sc.view("h/c0")
    assert status == 200 and card["policy"] == "phase"
    ph = card["phase"]
    assert isinstance(ph["phase"], int) and set(ph["from_phase"]) >= {"cpu", "mem"}
    assert card["now"]["cpu"]["phase"] is not None and card["vpa"]["numbers"]["cpu_samples"] == 120
    rows = {(r["resource"], r["policy"]): r for r in card["scorecard"]}
    assert rows[("cpu", "phase")]["steps"] > 0 and rows[("cpu", "vpa")]["steps"] == rows[("cpu", "phase")]["steps"]
    assert "phase: " in explain.format_card(card)


def test_explain_names_the_phase_by_its_profile_with_the_shipped_model():
    """A pretrained frozen model puts the container in one of its phases; the card and explain name it by its
    profile against the model's other phases."""
    from phasewise.apps.replay.through_kafka import _InProcessPhase, replay_settings_env, trace_messages
    from phasewise.apps.replay.traces import ContainerSeries, Trace

    t = 5.0 * np.arange(120) + 1.0
    trace = Trace("synthetic", "-", {"cpu": "cores", "mem": "bytes"}, [ContainerSeries(
        "c0", t, {"cpu": np.full(len(t), 1.05), "mem": np.full(len(t), 0.87e9)})])
    settings = Settings.from_env({"bootstrap": "in-process", "host": "h"},
                                 env=replay_settings_env("phase", trace, frozen_model=True, pretrained=True))
    cache, cfg = state_cache(settings), updater_config(settings)
    phase = _InProcessPhase(settings, cache, True)
    sc = LiveScorecard(ScorecardConfig(windows_s=(300.0,), buckets=5, samples=0), vpa_cache=cache, phase=phase,
                       policy="phase")
    for m in trace_messages(trace, "h"):
        worker_round(cache, [m], cfg, phase, sc)
    ph = sc.view("h/c0")[1]["phase"]
    assert ph["phase"] >= 0, ph
    ids = phase.hooks.fleet.model.clusterer.phase_ids
    names = {p: sc._phase_name(p) for p in ids}
    seen = {p: n for p, n in names.items() if n != UNSEEN}  # (a phase never credited has no profile)
    assert len(set(seen.values())) == len(seen) >= 2, names  # the profiles tell the phases apart
    assert ph["name"] == names[ph["phase"]] and ph["name"].startswith("CPU ")
    assert f"phase {ph['phase']} ({ph['name']})" in explain.format_card(sc.view("h/c0")[1])


def test_explain_reads_like_kubectl_describe_ages_units_and_the_vpa_target():
    card = {"container": "h1/train", "policy": "phase", "worker_policy": "phase",
            "now": {"t": 10_000.0, "cpu": {"used": 0.5, "limit": 0.75, "vpa": None, "phase": 0.6},
                    "mem": {"used": 3 * 2**30, "limit": None, "vpa": None, "phase": 3.5 * 2**30}},
            "vpa": {"recommendation": {"cpu": {"target": 0.61, "lower": 0.4, "upper": None},
                                       "mem": {"target": 3.25 * 2**30, "lower": 3 * 2**30, "upper": 4 * 2**30}},
                    "numbers": {"cpu_samples": 120, "mem_peaks": 2, "history_s": 599.0, "confidence": 0.5}},
            "phase": {"phase": 2, "since": 10_000.0 - 80, "model_version": 3,
                      "from_phase": {"cpu": True, "mem": False}, "basis_quantile": {"cpu": 0.52, "mem": None}},
            "scorecard": []}
    text = explain.format_card(card, now=10_000.0 + 3725)
    assert "last sample 1h02m ago (02:46:40 UTC)" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  cpu") or
            line.startswith("  memory")}
    assert rows["cpu"][2:] == ["0.5", "0.75", "0.61", "0.6"]  # the VPA's target where it decides nothing
    assert rows["memory"][1:] == ["3Gi", "-", "3.25Gi", "3.5Gi"]
    assert "vpa cpu: target 0.61 cores, bounds 0.4 cores to no upper bound yet" in text
    assert "vpa memory: target 3.25Gi, bounds 3Gi to 4Gi" in text
    assert "vpa history: 120 cpu samples, 2 memory peaks over 9m59s, confidence 0.5" in text
    assert "phase 2 for 1m20s (model v3):" in text
    named = explain.format_card({**card, "phase": {**card["phase"], "name": "CPU high and flat, memory mid"}},
                                now=10_000.0 + 3725)
    assert "phase 2 (CPU high and flat, memory mid) for 1m20s (model v3):" in named
    assert "  cpu: the limit comes from this phase's usage (basis 0.52 cores)" in text
    assert "  memory: the limit comes from the VPA fallback" in text
    assert "{" not in text and "10000" not in text  # no dict reprs, no raw event times
    cold = explain.format_card({**card, "phase": {**card["phase"], "phase": -1, "since": 0.0}}, now=10_005.0)
    assert "phase: none yet" in cold and "last sample 5s ago" in cold
