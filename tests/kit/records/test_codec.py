import json
import math
from pathlib import Path

import pytest

from phasewise.cli.schemas import render
from phasewise.kit.records import (
    ContainerSample,
    Decision,
    HostSamples,
    SchemaError,
    decode,
    encode,
)

ROOT = Path(__file__).resolve().parents[3]


def good_sample(**over):
    d = {"v": 1, "host": "h1", "ts": 1700000000.0, "interval_s": 1.0,
         "containers": [{"container": "phasewise/a", "cpu_cores": 0.5, "mem_bytes": 1e8}]}
    d.update(over)
    return d


def test_checked_in_json_schemas_are_current():
    for name, text in render().items():
        path = ROOT / "infra" / "schemas" / name
        assert path.exists(), f"{name} missing: run `make schemas`"
        assert path.read_text() == text, f"{name} stale: run `make schemas`"


def test_a_valid_host_message_round_trips():
    msg = decode(HostSamples, json.dumps(good_sample()))
    assert msg.containers[0].cpu_cores == 0.5
    assert decode(HostSamples, encode(msg)) == msg


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (json.dumps(good_sample(v=2)), "unsupported schema version 2"),
        (json.dumps({k: v for k, v in good_sample().items() if k != "host"}), "missing field 'host'"),
        (json.dumps(good_sample(ts=-5)), "'ts' = -5.0 is below the minimum 0"),
        (json.dumps(good_sample(containers=[{"container": "a", "cpu_cores": 1e30, "mem_bytes": 1}])),
         "containers[0]: ContainerSample: field 'cpu_cores' = 1e+30 is above the maximum"),
        (json.dumps(good_sample(containers=[{"container": "a", "cpu_cores": -1, "mem_bytes": 1}])),
         "below the minimum 0"),
        (json.dumps(good_sample(interval_s="1")), "'interval_s' must be a number"),
        (json.dumps(good_sample(containers=[{"container": "a", "mem_bytes": 1}])), "missing field 'cpu_cores'"),
        (json.dumps([1, 2]), "expected a JSON object"),
    ],
)
def test_bad_messages_are_rejected_with_the_reason(raw, reason):
    with pytest.raises(SchemaError) as e:
        decode(HostSamples, raw)
    assert reason in str(e.value)


def test_nan_is_rejected_even_though_python_json_accepts_it():
    raw = '{"v":1,"host":"h","ts":1,"interval_s":1,"containers":[{"container":"a","cpu_cores":NaN,"mem_bytes":1}]}'
    with pytest.raises(SchemaError, match="must be finite"):
        decode(HostSamples, raw)


def test_encode_refuses_non_finite_numbers():
    with pytest.raises(ValueError):
        encode(ContainerSample(container="a", cpu_cores=math.inf, mem_bytes=1))


def test_decision_action_must_be_known():
    d = {"v": 1, "id": "x", "ts": 1, "host": "h", "container": "c", "action": "explode", "policy": "vpa"}
    with pytest.raises(SchemaError, match="not one of"):
        decode(Decision, json.dumps(d))
