"""Job events' size bounds: at decode, in the JSON Schema, at ``phasewise submit``, and what they bound downstream.

Every role that copies a job event into its outputs (the priority agent's and
the placement agent's decisions and state, a decision that will carry the
whole signed spec) must stay under what it may publish: the producers'
``message.max.bytes`` (1,000,000 bytes). These tests build the largest event
the decoder takes, written so that re-encoding grows it most (characters
outside the BMP: 4 bytes in UTF-8, 12 as JSON ``\\u`` escapes), and measure
what the real code derives from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phasewise.kit.records import (
    MAX_COMMAND_ARGS,
    MAX_COMMAND_BYTES,
    MAX_JOB_EVENT_BYTES,
    Decision,
    GpuSample,
    HostSamples,
    JobEvent,
    JobRequests,
    JobSpec,
    SchemaError,
    decode,
    encode,
    encode_within,
    from_dict,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[1]
#: the producers' message.max.bytes (librdkafka's default, which every role keeps)
PRODUCER_LIMIT = 1_000_000
ASTRAL = "\U0001F600"  # 4 bytes of UTF-8, 12 bytes as a JSON escape


def event(**spec) -> dict:
    base = {"model": "resnet18", "dataset": "cifar10", "batch_size": 8}
    return {"v": 1, "job": "j", "ts": 1.0, "kind": "submitted", "spec": {**base, **spec}}


def raw(d: dict) -> bytes:
    return json.dumps(d, ensure_ascii=False).encode()


@pytest.mark.parametrize("spec, reason", [
    ({"command": ["x"] * 257}, "field 'command' holds 257 items, more than 256"),
    ({"command": ["x" * 10_000, "y" * 7_000]}, "field 'command' holds 17000 bytes (UTF-8), more than 16384"),
    ({"command": [ASTRAL * 4097]}, "field 'command' holds 16388 bytes (UTF-8), more than 16384"),
    ({"model": "m" * 513}, "field 'model' is 513 characters long, more than 512"),
    ({"dataset": "d" * 65}, "field 'dataset' is 65 characters long, more than 64"),
    ({"node_selector": {str(i): "a" for i in range(65)}}, "field 'node_selector' holds 65 entries, more than 64"),
    ({"node_selector": {"k" * 318: "a"}}, "is 318 characters long, more than 317"),
    ({"node_selector": {"gpu": "a" * 1025}}, "the value of 'gpu' is 1025 characters long, more than 1024"),
    ({"node_selector": {"gpu": 1}}, "the value of 'gpu' must be a string, got int"),
    ({"targets": {"metric": "m" * 129}}, "JobTargets: field 'metric' is 129 characters long, more than 128"),
])
def test_each_bound_is_refused_at_decode_with_a_one_line_reason(spec, reason):
    with pytest.raises(SchemaError) as e:
        decode(JobEvent, raw(event(**spec)))
    assert reason in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("JobEvent: spec: JobSpec: ")


@pytest.mark.parametrize("top, reason", [
    ({"host": "h" * 256}, "field 'host' is 256 characters long, more than 255"),
    ({"container": "c" * 1025}, "field 'container' is 1025 characters long, more than 1024"),
    ({"metric_name": "m" * 129}, "field 'metric_name' is 129 characters long, more than 128"),
    ({"stage": "s" * 65}, "field 'stage' = 'sss"), ({"stage": "eval/1"}, "field 'stage' = 'eval/1' does not match"),
])
def test_the_event_s_own_names_are_bounded(top, reason):
    with pytest.raises(SchemaError, match=reason.replace("(", r"\(")):
        decode(JobEvent, raw({**event(), **top}))


def test_at_the_bounds_an_event_decodes():
    spec = {"command": ["a" * (MAX_COMMAND_BYTES - 255)] + ["b"] * (MAX_COMMAND_ARGS - 1),
            "model": "m:" + "f" * 510, "dataset": "d" * 64,
            "node_selector": {("k" * 300 + str(i)): "v" * 63 for i in range(64)}, "targets": {"metric": "m" * 128}}
    ev = decode(JobEvent, raw(event(**spec)))
    assert len(ev.spec.command) == 256 and sum(map(len, ev.spec.command)) == MAX_COMMAND_BYTES
    assert len(ev.spec.node_selector) == 64


def test_a_whole_event_is_refused_above_its_limit_before_it_is_parsed():
    d = {**event(), "pad": "x" * MAX_JOB_EVENT_BYTES}
    with pytest.raises(SchemaError, match=r"^JobEvent: message of 65\d{3} bytes is larger than the limit of 65536 "
                                          r"bytes \(JobEvent.MAX_BYTES\)$"):
        decode(JobEvent, raw(d))
    with pytest.raises(SchemaError, match="larger than the limit of 65536 bytes"):
        encode_within(from_dict(JobEvent, {**event(node_selector={f"k{i}": "v" * 1024 for i in range(64)})}))


def test_the_checked_in_json_schema_has_the_same_bounds():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "infra" / "schemas" / "JobEvent.v1.json").read_text())
    v = jsonschema.Draft202012Validator(schema)
    assert not list(v.iter_errors(event(command=["x"] * 256, node_selector={"gpu": "a" * 1024},
                                        targets={"metric": "m" * 128})))
    for spec in ({"command": ["x"] * 257}, {"model": "m" * 513}, {"dataset": "d" * 65},
                 {"node_selector": {str(i): "a" for i in range(65)}}, {"node_selector": {"k" * 318: "a"}},
                 {"node_selector": {"gpu": "a" * 1025}}, {"node_selector": {"gpu": 1}},
                 {"targets": {"metric": "m" * 129}}, {"command": ["x" * 16_385]}):
        d = event(**spec)
        assert list(v.iter_errors(d)), spec  # the schema refuses it ...
        with pytest.raises(SchemaError):  # ... and so does the decoder
            decode(JobEvent, raw(d))
    assert "at most 65536 bytes" in schema["description"]
    assert "at most 16384 bytes" in schema["$defs"]["JobSpec"]["properties"]["command"]["description"]


# ------------------------------------------------------------------------ what roles derive from the largest event


def largest_event(job: str = "j" * 201, host: str = "h" * 255) -> JobEvent:
    """The largest submitted event the decoder takes, made of characters whose escapes are longest."""
    selector = {f"{i:03d}" + "k" * 314: ASTRAL * 256 for i in range(10)}  # 10 x (317 + 1024 bytes)
    spec = {"model": "m" * 512, "dataset": "d" * 64, "batch_size": 8, "command": [ASTRAL * 64] * 64,
            "node_selector": selector, "targets": {"metric": ASTRAL * 128},
            "requests": {"cpu_cores": 1.0, "mem_bytes": 2**30, "gpus": 0.5, "gpu_mem_bytes": 2**30}}
    d = {"v": 1, "job": job, "ts": 1.0, "kind": "submitted", "host": host, "container": "c" * 1024,
         "metric_name": ASTRAL * 128, "spec": spec}
    while len(raw(d)) < MAX_JOB_EVENT_BYTES - 1400:  # fill up to the limit with what grows most
        spec["node_selector"][f"{len(selector):03d}" + "k" * 314] = ASTRAL * 256
    if len(raw(d)) > MAX_JOB_EVENT_BYTES:
        spec["node_selector"].popitem()
    data = raw(d)
    assert MAX_JOB_EVENT_BYTES - 2000 < len(data) <= MAX_JOB_EVENT_BYTES
    return decode(JobEvent, data)


def sizes(record) -> tuple[int, int]:
    """Bytes of *record* as published: UTF-8 (orjson) and ASCII-escaped (json, where orjson is absent)."""
    return len(encode(record)), len(json.dumps(to_dict(record), separators=(",", ":")).encode())


def test_a_place_decision_carrying_the_whole_signed_spec_stays_far_under_the_producer_limit():
    ev = largest_event()
    # the decision a launcher publishes to start the job: the spec, its digest and the submitter's signature
    # (docs/security.md), and the command again for display
    d = Decision(id="place-" + ev.job + "-0123abcd", ts=1.0, host=ev.host, container=ev.job, action="place",
                 policy="priority", reason="x" * 2000,
                 details={"job": ev.job, "job_ts": ev.ts, "workload": ev.workload, "priority": ev.priority,
                          "spec": to_dict(ev.spec), "spec_digest": "0" * 64,
                          "job_signature": "ed25519:01234567:" + "A" * 88, "command": list(ev.spec.command),
                          "cpuset": None, "device": []})
    utf8, escaped = sizes(d)
    assert escaped > 2 * utf8 > MAX_JOB_EVENT_BYTES  # (the escapes did grow it)
    assert escaped < PRODUCER_LIMIT // 3, escaped


def test_the_priority_agent_s_decisions_and_state_from_the_largest_event_stay_under_the_limit():
    from phasewise.kit.job_signing import start_details
    from phasewise.models.jobs.priorities import Capacity, PriorityConfig
    from phasewise.models.jobs.priority_step import PriorityStep, PriorityStepConfig
    from phasewise.models.jobs.submissions import Submissions

    ev = largest_event()
    step = PriorityStep(PriorityStepConfig(PriorityConfig(freeze_max_wait_s=60, grace_s=20, cpu_weight_ratio=4.0),
                                           Capacity(64, 2**40, 8), ev.host, 8, "self", 300.0),
                        Submissions(start_details))
    decisions, _ = step.handle(encode(ev), 0, 1)
    assert [d.action for d in decisions] == ["place", "weight"]
    assert decisions[0].details["spec"]["command"] == list(ev.spec.command)
    for d in decisions:
        assert max(sizes(d)) < PRODUCER_LIMIT // 3
    ((key, _, value),) = step.writes()
    assert key == ev.job and len(value) < PRODUCER_LIMIT // 3


def test_the_placement_agent_s_decision_and_state_from_the_largest_event_stay_under_the_limit():
    from phasewise.kit.settings import Settings
    from phasewise.models.jobs.placement.state import PlacementState
    from phasewise.streams.config import placement_state_config, submissions

    ev = largest_event()
    s = Settings.from_env({"place_prediction_wait_s": 0.0}, env={})
    state = PlacementState(placement_state_config(s), submissions(s))
    labels = {k: v for k, v in ev.spec.node_selector.items()}
    assert state.samples(HostSamples(host="n1", ts=1.0, interval_s=1.0, host_cpu_count=64, host_cpu_cores=0.0,
                                     host_mem_bytes=0.0, host_mem_total_bytes=2.0**40,
                                     gpus=(GpuSample(index=0, uuid="g", util=0.0, mem_used_bytes=0.0,
                                                     mem_total_bytes=2.0**35),)))
    state.cluster.labels[state.cluster.index["n1"]].update(labels)  # a node the selector matches
    state.submitted(ev, now=0.0)
    ((d, _),) = state.decide(now=1.0, ts=1.0)
    assert d.action == "place" and d.details["spec"]["command"] == list(ev.spec.command)
    assert max(sizes(d)) < PRODUCER_LIMIT // 3
    ((_, _, value),) = state.writes()
    assert len(value) < PRODUCER_LIMIT // 3


# ------------------------------------------------------------------------------------------------ phasewise submit


def _submit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phasewise.cli", "submit", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_submit_refuses_what_a_consumer_would_refuse_in_one_line(tmp_path):
    for change, reason in (({"command": ["python", "x" * 20_000]}, "field 'command' holds 20006 bytes"),
                           ({"node_selector": {f"k{i}": "v" * 1024 for i in range(64)}},
                            "message of 6")):
        f = tmp_path / "job.json"
        f.write_text(json.dumps({"job": "a", "model": "resnet18", "dataset": "cifar10", "batch_size": 8, **change}))
        r = _submit(str(f), "--dry-run")
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith("phasewise submit: error: ") and reason in r.stderr, r.stderr


def test_submit_notes_a_module_horus_does_not_build(tmp_path):
    import os

    f = tmp_path / "job.json"
    f.write_text(json.dumps({"job": "a", "model": "mypkg.models:build", "dataset": "cifar10", "batch_size": 8}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    r = _submit(str(f), "--dry-run", env=env)
    assert r.returncode == 0 and decode(JobEvent, r.stdout.strip()).spec.model == "mypkg.models:build"
    note, unsigned = r.stderr.splitlines(keepends=True)
    assert unsigned.startswith("phasewise submit: warning: job a is published unsigned")
    assert note == ("phasewise submit: note: model mypkg.models:build is predicted only by a horus whose "
                        "horus_model_modules lists its module (here: module mypkg.models is not in "
                        "horus_model_modules (empty: catalog models only)); without a prediction it is placed "
                        "by its requests\n")
    r = _submit(str(f), "--dry-run", env={**env, "PHASEWISE_HORUS_MODEL_MODULES": "mypkg"})
    assert r.returncode == 0 and "note:" not in r.stderr


def test_requests_bounds_are_unchanged():  # (the new bounds are names and sizes only)
    assert from_dict(JobSpec, {"model": "m", "dataset": "d", "batch_size": 1, "requests": {"gpus": 64}}).requests \
        == JobRequests(gpus=64.0)
