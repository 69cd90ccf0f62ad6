"""``phasewise replay --through-kafka``: the pipeline's decisions equal in-process replay's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from phasewise.apps.replay.driving import decision_sequence, replay_trace
from phasewise.apps.replay.policies import NOMINAL_MEM_BYTES, PolicySpec, policy_specs
from phasewise.apps.replay.results import result_rows
from phasewise.apps.replay.through_kafka import (
    END_CONTAINER,
    KafkaReplayError,
    rebuild_sequences,
    replay_through_kafka,
    trace_messages,
    worker_policies,
)
from phasewise.apps.replay.traces import ContainerSeries, Trace, load_ai4dl
from phasewise.cli import main
from phasewise.kit.settings import Settings

SAMPLE = Path(__file__).resolve().parents[3] / "src" / "phasewise" / "data" / "ai4dl_sample.csv"


def small_trace(containers: int = 2, steps: int = 40) -> Trace:
    full = load_ai4dl(SAMPLE)
    picked = [c for c in full.containers if len(c) >= steps][:containers]
    assert len(picked) == containers
    return Trace(full.format, full.source, dict(full.units),
                 [ContainerSeries(c.container, c.t[:steps], {r: u[:steps] for r, u in c.usage.items()})
                  for c in picked])


def fraction_trace() -> Trace:
    """cpu in cores, mem as a utilisation fraction (as GenAI publishes it)."""
    rng = np.random.default_rng(3)
    t = np.arange(30, dtype=float) * 57.0
    return Trace("synthetic", "-", {"cpu": "cores", "mem": "fraction of the pod's memory (utilisation, 0-1)"},
                 [ContainerSeries("pod-a", t, {"cpu": rng.uniform(0.2, 2.0, 30), "mem": rng.uniform(0.1, 0.6, 30)})])


def in_process(trace: Trace) -> dict[str, list]:
    (spec,) = policy_specs(["vpa"], units=trace.units)
    return {s.container: decision_sequence(spec.factory(), s) for s in trace.containers}


def assert_same_sequences(got: dict[str, list], want: dict[str, list]) -> None:
    assert got.keys() == want.keys()
    for c, seq in want.items():
        other = got[c]
        assert [t for t, _ in other] == [t for t, _ in seq], c
        decided = 0
        for (t, a), (_, b) in zip(other, seq):
            assert a.keys() == b.keys(), (c, t)
            for r in a:
                if b[r] is None:
                    assert a[r] is None, (c, t, r)
                else:
                    decided += 1
                    assert a[r] == pytest.approx(b[r], rel=1e-9, abs=0), (c, t, r, a[r], b[r])
        assert decided > len(seq)  # limits for both resources from the second step on


# ---------------------------------------------------------------- without a broker


@pytest.mark.parametrize("trace", [small_trace(), fraction_trace()], ids=["ai4dl", "mem-fraction"])
def test_the_worker_step_decides_what_in_process_replay_decides(trace):
    """The worker's step (worker_in_process: the replay worker's settings) == VpaPolicy in-process."""
    from phasewise.apps.replay.through_kafka import mem_scale, worker_in_process

    got = worker_in_process(trace, family="vpa", host="replay-h")
    decisions = got.decisions
    assert decisions and all(d.details["hysteresis"] == 0.0 for d in decisions)
    assert all(d.container != END_CONTAINER for d in decisions)
    assert_same_sequences(got.sequences, in_process(trace))
    assert rebuild_sequences(trace, decisions, mem_scale(trace)) == got.sequences


def regime_trace(containers: int = 12, steps: int = 360, gpu: bool = True) -> Trace:
    """Square-wave jobs (period 40-90 s, 10 s steps), with GPU columns following the same waves."""
    rng = np.random.default_rng(5)
    t = np.arange(steps, dtype=float) * 10.0
    out = []
    for k in range(containers):
        base, period = rng.uniform(0.3, 1.0), rng.integers(4, 9)
        high = ((np.arange(steps) // period) % 2).astype(float)
        usage = {"cpu": base * (1 + 1.5 * high), "mem": base * 4e8 * (1 + 0.8 * high)}
        if gpu:
            usage.update({"gpu": 5 + 85 * base * high, "gpu_mem": base * 8e9 * (1 + high)})
        out.append(ContainerSeries(f"job-{k}", t, usage))
    units = {"cpu": "cores", "mem": "bytes"}
    if gpu:
        units.update({"gpu": "percent", "gpu_mem": "bytes"})
    return Trace("synthetic", "-", units, out)


def test_the_phase_worker_in_process_learns_on_event_time_and_uses_the_traces_gpu_columns():
    from phasewise.apps.replay.through_kafka import worker_in_process

    trace = regime_trace()
    msgs = trace_messages(trace, "h")
    assert msgs[0].containers[0].gpu_util == trace.containers[0].usage["gpu"][0]
    got = worker_in_process(trace, family="phase")
    assert got.settings_env["PHASEWISE_PHASE_FEATURES"] == "cpu,mem,gpu,gpu_mem"
    assert got.model_origin == "cold" and got.snapshots > 0  # the learner warmed the shared model
    sources = {d.details["source"] for d in got.decisions}
    assert "fallback:vpa" in sources and "phase" in sources  # VPA while cold, then phase limits
    assert worker_in_process(trace, family="phase").decisions == got.decisions  # deterministic
    # the detectors' phase changes give the report its phase ids along time
    from phasewise.apps.replay.through_kafka import phase_series

    ids = phase_series(trace, got.phase_changes)
    assert all(len(ids[c.container]) == len(c) for c in trace.containers)
    assert len(set(ids["job-0"].tolist()) - {-1}) >= 2 and ids["job-0"][0] == -1  # none before the first
    res = replay_trace(trace, [PolicySpec("phase", "phase", None)], plot_containers=2,
                       sequences={"phase": got.sequences}, phase_ids=ids)
    assert res.plotted[0].phases is ids["job-0"]
    frozen = worker_in_process(trace, family="phase", frozen_model=True)
    assert frozen.snapshots == 0 and {d.details["source"] for d in frozen.decisions} == {"fallback:vpa"}
    with pytest.raises(KafkaReplayError, match="not a worker policy"):
        worker_in_process(trace, family="window")


def test_the_report_says_what_a_through_kafka_phase_worker_starts_from():
    from phasewise.apps.replay.through_kafka import worker_origin

    ai4dl, gpu = small_trace(), regime_trace()
    assert worker_origin(ai4dl, pretrained=False) == "cold"
    assert worker_origin(ai4dl, pretrained=True).startswith("pretrained corpus_cpu_mem")  # the default
    assert worker_origin(ai4dl, pretrained="ai4dl").startswith("pretrained ai4dl_cpu_mem")
    assert worker_origin(gpu, pretrained=True) == "cold"  # the shipped model has no GPU features
    assert worker_origin(ai4dl, pretrained=False, bootstrap="k:9092").endswith("already on the models topic")


def test_replay_runs_the_workers_phase_code_in_process(capsys, tmp_path, assert_replay_output):
    rc = main(["replay", str(SAMPLE), "--policies", "vpa,phase", "--phase-model", "worker", "--json", "--quiet",
               "--report", str(tmp_path / "cold")])
    assert rc == 0
    summary = (tmp_path / "cold" / "summary.md").read_text()
    assert "phasewise worker --policy phase (in-process" in summary and "4 container(s): cold" in summary
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]  # nothing but JSON on stdout
    phase = [x for x in lines if x.get("policy") == "phase"]
    assert {x["resource"] for x in phase} == {"cpu", "mem"} and all(x["steps"] > 0 for x in phase)
    assert_replay_output(lines)
    setup = lines[0]
    assert setup["type"] == "setup" and setup["phase_start"] == {"cold": 4}
    assert setup["phase_model"] == "worker" and setup["pretrained"] is False and setup["model_origin"] == "cold"
    plotted = sorted((tmp_path / "cold").glob("container-*.png"))
    assert len(plotted) == 4 and (tmp_path / "cold" / "tradeoff.png").is_file()
    assert main(["replay", str(SAMPLE), "--policies", "phase", "--phase-model", "worker", "--phase-frozen"]) == 2
    assert "needs --phase-pretrained" in capsys.readouterr().err
    assert main(["replay", str(SAMPLE), "--policies", "phase", "--phase-model", "worker", "--phase-pretrained",
                 "ai4dl", "--quiet", "--report", str(tmp_path / "warm")]) == 0
    summary = (tmp_path / "warm" / "summary.md").read_text()
    assert "pretrained ai4dl_cpu_mem.pwck" in summary and "read its numbers on this trace as in-sample" in summary
    assert "--phase-pretrained ai4dl" in summary  # the command that reproduces the run
    # the default model never saw the AI4DL sample: no in-sample warning
    assert main(["replay", str(SAMPLE), "--policies", "phase", "--phase-model", "worker", "--phase-pretrained",
                 "--quiet", "--report", str(tmp_path / "corpus")]) == 0
    summary = (tmp_path / "corpus" / "summary.md").read_text()
    assert "pretrained corpus_cpu_mem.pwck" in summary and "train split of its corpus" in summary
    assert "in-sample" not in summary
    assert main(["replay", str(SAMPLE), "--policies", "phase", "--phase-pretrained"]) == 2
    assert "apply to --phase-model worker" in capsys.readouterr().err


def test_messages_follow_event_time_and_scale_a_memory_fraction_to_bytes():
    tr = fraction_trace()
    msgs = trace_messages(tr, "h", NOMINAL_MEM_BYTES)
    assert [m.ts for m in msgs] == sorted(m.ts for m in msgs)
    assert msgs[0].containers[0].mem_bytes == tr.containers[0].usage["mem"][0] * NOMINAL_MEM_BYTES
    assert msgs[-1].containers[0].container == END_CONTAINER and msgs[-1].ts == msgs[-2].ts + 1.0


def test_a_sample_with_cpu_but_no_memory_cannot_go_through_kafka():
    tr = small_trace(1, 5)
    mem = tr.containers[0].usage["mem"].copy()
    mem[2] = math.nan
    bad = Trace(tr.format, tr.source, tr.units,
                [ContainerSeries(tr.containers[0].container, tr.containers[0].t, {"cpu": tr.containers[0].usage["cpu"],
                                                                                  "mem": mem})])
    with pytest.raises(KafkaReplayError, match="has cpu but no mem"):
        trace_messages(bad, "h")


# ---------------------------------------------------------------- through the real pipeline


def test_the_kafka_pipeline_decides_exactly_what_in_process_replay_decides_and_scores_the_same(broker, tmp_path):
    trace = small_trace(2, 40)
    result = replay_through_kafka(trace, bootstrap=broker.bootstrap, workdir=tmp_path, timeout_s=120)
    assert result.decisions and {d.host for d in result.decisions} == {result.host}
    assert_same_sequences(result.sequences, in_process(trace))
    # the enforced limits are the policy's rounded up to a millicore / a byte
    for d in result.decisions:
        if d.cpu_limit_cores is not None:
            raw = d.details["limits"]["cpu"]
            assert raw <= d.cpu_limit_cores < raw + 0.001 + 1e-9
    specs = policy_specs(["vpa"], units=trace.units)
    local = result_rows(replay_trace(trace, specs))
    kafka = result_rows(replay_trace(trace, specs, sequences={"vpa": result.sequences}))
    assert kafka == local
    assert all(r["steps"] > 0 for r in local[0])


def test_the_cli_through_kafka_prints_the_scores_of_the_in_process_replay(capsys):
    args = ["replay", str(SAMPLE), "--format", "ai4dl", "--policies", "vpa", "--json"]
    assert main(args) == 0
    local = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(args + ["--through-kafka"]) == 0  # starts its own embedded broker
    out = capsys.readouterr()
    kafka = [json.loads(line) for line in out.out.splitlines()]
    assert "through kafka: vpa" in out.err
    assert kafka[0]["type"] == "setup" and kafka[0]["through_kafka"] is True and local[0]["through_kafka"] is False
    local, kafka = local[1:], kafka[1:]  # the setup lines differ in the command and the time taken
    rows = [r for r in local if r["type"] == "score"]
    assert rows and len(kafka) == len(local)
    for a, b in zip(local, kafka):
        assert (a.get("alloc_over_used"), a.get("fulfilment"), a.get("steps")) == \
               (b.get("alloc_over_used"), b.get("fulfilment"), b.get("steps"))
        assert a == b


def test_the_phase_worker_replays_a_trace_through_kafka_into_scored_decision_sequences(broker, tmp_path):
    if "phase" not in worker_policies():
        pytest.skip("the worker has no --policy phase in this build")
    trace = small_trace(2, 40)
    result = replay_through_kafka(trace, family="phase", bootstrap=broker.bootstrap, workdir=tmp_path,
                                  timeout_s=120)
    assert result.decisions and {(d.host, d.policy) for d in result.decisions} == {(result.host, "phase")}
    for s in trace.containers:
        seq = result.sequences[s.container]
        assert [t for t, _ in seq] == s.t.tolist()
        assert seq[0][1] == {"cpu": None, "mem": None}  # nothing decided before the first sample
        mine = sorted((d for d in result.decisions if d.container == s.container), key=lambda d: d.ts)
        last = mine[-1]
        if last.ts < s.t[-1]:  # held from the last decision on
            held = seq[-1][1]
            assert last.cpu_limit_cores is None or held["cpu"] == last.cpu_limit_cores
            assert last.mem_limit_bytes is None or held["mem"] == last.mem_limit_bytes
    spec = PolicySpec("phase", "phase", None)  # decided through Kafka, not built here
    rows, _ = result_rows(replay_trace(trace, [spec], sequences={"phase": result.sequences}))
    assert {r["resource"] for r in rows} == {"cpu", "mem"} and all(r["steps"] > 0 for r in rows)


def test_a_frozen_phase_worker_through_kafka_decides_exactly_what_its_own_step_decides_in_process(tmp_path):
    if "phase" not in worker_policies():
        pytest.skip("the worker has no --policy phase in this build")
    from phasewise.apps.replay.through_kafka import worker_in_process

    trace = small_trace(2, 40)
    # its own broker: no snapshot on the models topic, so the worker starts from the shipped model
    result = replay_through_kafka(trace, family="phase", workdir=tmp_path, timeout_s=180, frozen_model=True,
                                  pretrained=True)
    s = Settings.from_env(env=result.settings_env)
    assert s.worker.policy == "phase" and s.phase.snapshot_interval_s > 1e6 and s.phase.pretrained
    local = worker_in_process(trace, family="phase", host=result.host, frozen_model=True, pretrained=True)
    assert local.model_origin.startswith("pretrained") and local.snapshots == 0
    assert {k: v for k, v in local.settings_env.items()} == {k: v for k, v in result.settings_env.items()
                                                             if k in local.settings_env}
    want = local.decisions
    assert result.decisions == want  # every field, the ids and the details included, in order
    assert result.sequences == local.sequences  # and so the scored limits
    sources = {d.details["source"] for d in want}
    assert "phase" in sources or "mixed" in sources  # phase statistics decided, not only the VPA fallback

