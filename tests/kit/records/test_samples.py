"""The container identity and per-workload policy nested in ContainerSample: strict and fast paths agree."""

import json

import pytest

from phasewise.kit.records import (
    RECORDS,
    ContainerIdentity,
    ContainerSample,
    HostSamples,
    SchemaError,
    WorkloadPolicy,
    decode,
    decode_host_samples,
    encode,
    json_schemas,
)
from phasewise.kit.records.columns import _fast_containers


def _msg(**cs):
    s = ContainerSample(
        container="0123abcd", cpu_cores=0.5, mem_bytes=1e8,
        identity=ContainerIdentity(layout="kubepods-systemd", container_id="0123abcd", pod_uid="u-1",
                                   pod_namespace="ml", pod_name="train-0", container_name="trainer",
                                   runtime="containerd", qos="burstable"),
        workload=WorkloadPolicy(mode="recommend", source="annotation", cpu_max_cores=4.0, priority=3))
    d = json.loads(encode(HostSamples(host="h", ts=1.0, interval_s=1.0, containers=(s,))))
    d["containers"][0].update(cs)
    return d


def test_identity_and_policy_round_trip_on_the_fast_path():
    raw = json.dumps(_msg()).encode()
    h = decode(HostSamples, raw)
    assert decode_host_samples(raw) == h
    assert _fast_containers(json.loads(raw)["containers"]) is not None
    assert h.containers[0].identity.pod_name == "train-0"
    assert h.containers[0].workload.mode == "recommend"
    assert decode(HostSamples, encode(h)) == h


@pytest.mark.parametrize("bad", [
    {"identity": {"layout": "lxc"}},
    {"identity": {"container_id": "x"}},  # layout is required
    {"identity": {"layout": "flat", "qos": "gold"}},
    {"identity": "kubepods"},
    {"workload": {"mode": "yes"}},
    {"workload": {"mode": "apply", "cpu_max_cores": -1}},
    {"workload": {"mode": "apply", "priority": 1.5}},
])
def test_bad_identity_or_policy_is_refused_with_the_same_reason_by_both_paths(bad):
    raw = json.dumps(_msg(**bad))
    with pytest.raises(SchemaError) as strict:
        decode(HostSamples, raw)
    with pytest.raises(SchemaError) as fast:
        decode_host_samples(raw.encode())
    assert str(strict.value) == str(fast.value)
    assert "containers[0]" in str(strict.value)


def test_samples_without_identity_still_decode():
    d = _msg()
    del d["containers"][0]["identity"], d["containers"][0]["workload"]
    h = decode_host_samples(json.dumps(d).encode())
    assert h.containers[0].identity is None and h.containers[0].workload is None


def test_json_schema_refers_to_the_nested_records():
    s = json_schemas(RECORDS)["HostSamples.v1.json"]
    ident = s["$defs"]["ContainerSample"]["properties"]["identity"]
    assert ident["anyOf"][0] == {"$ref": "#/$defs/ContainerIdentity"}
    assert s["$defs"]["ContainerIdentity"]["required"] == ["layout"]
    assert "apply" in s["$defs"]["WorkloadPolicy"]["properties"]["mode"]["enum"]


def _outcome(fn, raw):
    try:
        return "ok", fn(raw)
    except SchemaError as e:
        return "SchemaError", str(e)


def test_random_mutations_of_identity_and_policy_get_the_strict_answer():
    import random


    rng = random.Random(13)
    fields = {"identity": ["layout", "container_id", "pod_uid", "pod_namespace", "pod_name", "container_name",
                           "runtime", "qos"],
              "workload": ["mode", "source", "policy", "cpu_min_cores", "cpu_max_cores", "mem_min_bytes",
                           "mem_max_bytes", "priority", "workload_class", "error"]}
    values = [None, "", "x", "flat", "kubepods-cgroupfs", "docker", "cri-o", "burstable", "off", "apply",
              "annotation", 0, 1, -1, 1.5, 2.0, 1e300, True, [], {}, 5000.0, 2**40]
    ok = refused = fast = 0
    for _ in range(600):
        d = _msg()
        d["containers"] = [json.loads(json.dumps(d["containers"][0])) for _ in range(rng.randint(1, 4))]
        for _ in range(rng.randint(1, 3)):
            c = rng.choice(d["containers"])
            which = rng.choice(["identity", "workload"])
            r = rng.random()
            if r < 0.1:
                c[which] = rng.choice([None, "x", [], {}, 1])
            elif isinstance(c.get(which), dict):
                if r < 0.2:
                    c[which].pop(rng.choice(fields[which]), None)
                else:
                    c[which][rng.choice(fields[which])] = rng.choice(values)
        raw = json.dumps(d).encode()
        strict = _outcome(lambda r: decode(HostSamples, r), raw)
        assert _outcome(decode_host_samples, raw) == strict, raw
        ok += strict[0] == "ok"
        refused += strict[0] != "ok"
        fast += strict[0] == "ok" and _fast_containers(json.loads(raw)["containers"]) is not None
    assert ok > 50 and refused > 200 and fast > 20  # every answer, and the fast path itself, exercised
