"""The job record and ``phasewise submit``: round trip, one-line errors, a real publish."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phasewise.apps.horus.submit import SpecError, job_event
from phasewise.kit.records import RECORDS, JobEvent, JobSpec, JobTargets, SchemaError, decode, encode, json_schemas

GOOD = {"job": "rn18-a", "model": "ResNet-18", "dataset": "CIFAR-10", "batch_size": 128, "priority": 2,
        "workload": "inference", "requests": {"cpu_cores": 2, "gpus": 0.5},
        "targets": {"acceptable": 0.5, "objective": 0.3}, "command": ["python", "train.py"]}


def test_a_submitted_job_round_trips_with_its_nested_spec():
    e = job_event(GOOD, ts=5.0)
    assert e.kind == "submitted" and e.priority == 2 and e.workload == "inference"
    assert e.spec.requests.gpus == 0.5 and e.spec.requests.cpu_cores == 2.0 and e.spec.requests.mem_bytes is None
    assert e.spec.targets == JobTargets(acceptable=0.5, objective=0.3) and e.spec.command == ("python", "train.py")
    assert decode(JobEvent, encode(e)) == e
    nested = {**{k: v for k, v in GOOD.items() if k not in JobSpec.__dataclass_fields__}, "spec":
              {k: v for k, v in GOOD.items() if k in JobSpec.__dataclass_fields__}}
    assert job_event(nested, ts=5.0) == e


@pytest.mark.parametrize("change, reason", [
    ({"batch_size": 0}, "field 'batch_size' = 0 is below the minimum 1"),
    ({"batch_size": 10**9}, "is above the maximum"),
    ({"dataset": "mnist"}, "spec.dataset: unknown dataset 'mnist'"),
    ({"model": "alexnet"}, "spec.model: unknown model 'alexnet'"),
    ({"job": "a b"}, "field 'job' = 'a b' does not match"),
    ({"workload": "batch"}, "field 'workload' = 'batch' is not one of"),
    ({"command": "python train.py"}, "field 'command' must be an array of strings"),
    ({"requests": {"gpus": -1}}, "requests: JobRequests: field 'gpus' = -1.0 is below the minimum 0"),
    ({"targets": {"direction": "up"}}, "field 'direction' = 'up' is not one of"),
    ({"batchsize": 4}, "unknown field 'batchsize' (did you mean 'batch_size'?"),
    # inside requests and targets too (the decoder would drop them): with the closest valid name
    ({"requests": {"cpu": 2}}, "spec.requests: unknown field 'cpu' (did you mean 'cpu_cores'?"),
    ({"requests": {"gpus": 1, "memory": 2**30}}, "spec.requests: unknown field 'memory' (did you mean 'mem_bytes'?"),
    ({"targets": {"acceptable": 0.5, "objectve": 0.3}}, "spec.targets: unknown field 'objectve' (did you mean "
                                                         "'objective'?"),
    # loss targets in the wrong order for the metric's direction
    ({"targets": {"acceptable": 0.3, "objective": 0.5}}, "spec.targets: objective 0.5 is above acceptable 0.3, but "
                                                          "direction min needs objective <= acceptable"),
    ({"targets": {"metric": "acc", "direction": "max", "acceptable": 0.9, "objective": 0.8}},
     "spec.targets: objective 0.8 is below acceptable 0.9, but direction max needs objective >= acceptable"),
])
def test_a_bad_spec_is_refused_with_its_reason(change, reason):
    with pytest.raises(SpecError, match=None) as e:
        job_event({**GOOD, **change}, ts=1.0)
    assert reason in str(e.value)


def test_an_unknown_key_under_spec_is_refused_too():
    nested = {"job": "j", "spec": {"model": "resnet18", "dataset": "cifar10", "batch_size": 8, "gpu": 1}}
    with pytest.raises(SpecError, match=r"^spec: unknown field 'gpu' \(spec has amp, batch_size"):
        job_event(nested, ts=1.0)
    ok = {"requests": {"cpu_cores": 1}, "targets": {"metric": "acc", "direction": "max", "acceptable": 0.8,
                                                   "objective": 0.9}}
    assert job_event({**GOOD, **ok}, ts=1.0).spec.targets.objective == 0.9


def test_progress_and_started_events_decode_and_wrong_kinds_do_not():
    started = JobEvent(job="j", ts=1.0, kind="started", host="h1", container="j")
    progress = JobEvent(job="j", ts=2.0, kind="progress", step=10, loss=0.5, metric=0.9, metric_name="acc",
                        epoch=0.5)
    for e in (started, progress):
        assert decode(JobEvent, encode(e)) == e
    with pytest.raises(SchemaError, match="field 'kind' = 'queued' is not one of"):
        decode(JobEvent, b'{"v":1,"job":"j","ts":1,"kind":"queued"}')
    with pytest.raises(SchemaError, match="spec: JobSpec: missing field 'batch_size'"):
        decode(JobEvent, b'{"v":1,"job":"j","ts":1,"kind":"submitted","spec":{"model":"x","dataset":"y"}}')


def test_the_json_schema_nests_the_spec():
    s = json_schemas(RECORDS)["JobEvent.v1.json"]
    assert s["properties"]["spec"]["anyOf"][0] == {"$ref": "#/$defs/JobSpec"}
    assert s["$defs"]["JobSpec"]["properties"]["requests"] == {"$ref": "#/$defs/JobRequests"}
    assert s["$defs"]["JobSpec"]["properties"]["command"]["items"] == {"type": "string", "maxLength": 16384}


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phasewise.cli", "submit", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_submit_cli_bad_file_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "job.json"
    bad.write_text(json.dumps({**GOOD, "dataset": "mnist"}))
    r = _cli(str(bad), "--dry-run")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("phasewise submit: error: spec.dataset: unknown dataset 'mnist'")
    assert len(r.stderr.splitlines()) == 1
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    r = _cli(str(deep), "--dry-run")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "not valid JSON" in r.stderr


@pytest.mark.broker
def test_submit_publishes_the_event_keyed_by_job(settings, tmp_path):
    from phasewise.kit.kafka.client import make_consumer
    from phasewise.kit.topics import JOB_EVENTS

    f = tmp_path / "job.json"
    f.write_text(json.dumps({**GOOD, "job": f"sub-{settings.host}"}))
    r = _cli(str(f), "--bootstrap", settings.kafka.bootstrap, "--timeout", "20")
    assert r.returncode == 0, r.stderr
    c = make_consumer(settings, f"test-submit-{settings.host}")
    c.subscribe([JOB_EVENTS.name])
    try:
        got = None
        for _ in range(100):
            m = c.poll(0.5)
            if m is not None and not m.error() and m.key() == f"sub-{settings.host}".encode():
                got = decode(JobEvent, m.value())
                break
    finally:
        c.close()
    assert got is not None and got.kind == "submitted" and got.spec.model == "ResNet-18"
    # the same id again: refused with one line, nothing published
    r = _cli(str(f), "--bootstrap", settings.kafka.bootstrap, "--timeout", "20")
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    *_warning, last = r.stderr.splitlines()  # (after the unsigned warning)
    assert last.startswith(f"phasewise submit: error: job id sub-{settings.host} already submitted (at ")
    assert last.endswith("submit it under another id (--job NAME)")
    # another id from the same file goes through
    r = _cli(str(f), "--job", f"sub2-{settings.host}", "--bootstrap", settings.kafka.bootstrap, "--timeout", "20")
    assert r.returncode == 0, r.stderr
