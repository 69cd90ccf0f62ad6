"""``decode_host_samples`` (the worker's fast path) answers exactly as ``decode(HostSamples, ...)``."""

import dataclasses
import json
import random

import pytest

from phasewise.kit.records import (
    MAX_BYTES,
    MAX_CORES,
    ContainerSample,
    GpuSample,
    HostSamples,
    SchemaError,
    codec,
    columns,
    decode,
    decode_host_samples,
    encode,
)
from phasewise.kit.records.columns import _fast_containers


def _use_orjson(monkeypatch, module, attr: str, which: str) -> str:
    """Run with the worker's orjson function *attr* of *module*, or without it (orjson not installed)."""
    if which == "json":
        monkeypatch.setattr(module, attr, None)
    else:
        assert getattr(module, attr) is not None, "orjson is part of the streams extra"
    return which


@pytest.fixture(autouse=True, params=["orjson", "json"])
def parser(request, monkeypatch):
    """Every test runs with the worker's orjson parse and with the stdlib one."""
    return _use_orjson(monkeypatch, columns, "_fast_loads", request.param)


def _typed(record):
    """A record as nested (field, type, value) tuples: 2 and 2.0 differ here."""
    if isinstance(record, tuple):
        return tuple(_typed(r) for r in record)
    if dataclasses.is_dataclass(record):
        return tuple((f.name, type(v := getattr(record, f.name)).__name__, _typed(v))
                     for f in dataclasses.fields(record))
    return record


def outcome(fn, raw):
    try:
        return ("ok", _typed(fn(raw)))
    except SchemaError as e:
        return ("SchemaError", str(e))
    except Exception as e:  # noqa: BLE001 - whatever strict raises, fast must raise the same
        return (type(e).__name__, str(e))


def assert_same(raw):
    strict = outcome(lambda r: decode(HostSamples, r), raw)
    fast = outcome(decode_host_samples, raw)
    assert fast == strict, raw
    return strict


def message(n=5, **top):
    cs = [encode(ContainerSample(container=f"c{j}", cpu_cores=0.1 * j + 0.05, mem_bytes=1e8 * (j + 1),
                                 cpu_limit_cores=2.0, mem_limit_bytes=4e9, nr_periods=10, throttled_periods=j % 2,
                                 throttled_s=0.01 * j, oom_events=0, gpu_util=None if j % 2 else 12.5,
                                 gpu_mem_bytes=None))
          for j in range(n)]
    d = {"v": 1, "host": "h1", "ts": 1.7e9, "interval_s": 1.0, "containers": [json.loads(c) for c in cs]}
    d.update(top)
    return d


def test_a_well_formed_message_decodes_to_the_identical_record():
    raw = json.dumps(message(100)).encode()
    kind, _ = assert_same(raw)
    assert kind == "ok"
    assert decode_host_samples(raw) == decode(HostSamples, raw)
    assert _fast_containers(json.loads(raw)["containers"]) is not None  # the fast path took it


@pytest.mark.parametrize("edit", [
    lambda d: d,
    lambda d: d.update(containers=[]),
    lambda d: d.pop("containers"),
    lambda d: d["containers"][0].update(cpu_cores=1, mem_bytes=2**30, cpu_limit_cores=4),  # ints in float fields
    lambda d: d["containers"][1].pop("gpu_util"),  # a field left to its default
    lambda d: d["containers"][2].update(extra="ignored", cpu_limit_cores=None, mem_limit_bytes=None),
    lambda d: d["containers"][0].update(nr_periods=10.0),  # integral float in an integer field: strict converts
    lambda d: d.update(gpus=[json.loads(encode(GpuSample(index=0, uuid="g", util=5.0, mem_used_bytes=1.0,
                                                         mem_total_bytes=2.0)))]),
    lambda d: d["containers"][3].update(cpu_cores=MAX_CORES, mem_bytes=MAX_BYTES, throttled_s=0),
    lambda d: d["containers"][0].update(throttled_s=1e308, cpu_cores=0.0),
], ids=["as-is", "no-containers", "containers-absent", "ints-in-float-fields", "default-field", "extra-and-null",
        "integral-float-int", "gpus", "at-the-bounds", "huge-unbounded"])
def test_valid_variants_decode_identically(edit):
    d = message()
    edit(d)
    kind, _ = assert_same(json.dumps(d))
    assert kind == "ok"


BAD_VALUES = [None, "1", True, False, -1, -0.5, 1.5, 1e300, 10**400, [], {}, "NaN", "Infinity", "-Infinity"]


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ContainerSample)])
@pytest.mark.parametrize("value", BAD_VALUES, ids=[repr(v)[:12] for v in BAD_VALUES])
def test_every_field_with_every_odd_value_gets_the_strict_answer(field, value):
    d = message()
    if value in ("NaN", "Infinity", "-Infinity") and field != "container":
        raw = json.dumps(d).replace(f'"{field}": ', f'"{field}": {value}, "_was": ', 1)  # a JSON-ish literal
    else:
        d["containers"][2][field] = value
        raw = json.dumps(d)
    assert_same(raw)


@pytest.mark.parametrize("raw", [
    b"not json", b"\xff\xfe", b"[1, 2]", b"{}", b'{"v": 2}', b'"text"', b"null",
    json.dumps(message(containers="no")), json.dumps(message(containers=[1, 2])),
    json.dumps(message(containers=[None])),
    json.dumps(message(host=5)), json.dumps(message(ts=-1)), json.dumps(message(v=True)),
    json.dumps({k: v for k, v in message().items() if k != "host"}),
])
def test_malformed_messages_get_the_strict_reason(raw):
    kind, _ = assert_same(raw)
    assert kind != "ok"


@pytest.mark.parametrize("raw", [
    '{"v": 1, "host": "h\\ud800", "ts": 1, "interval_s": 1, "containers": []}',  # a lone surrogate escape
    '{"v": 1, "host": "h", "ts": 18446744073709551616, "interval_s": 1, "containers": []}',  # 2**64
    '{"v": 1, "host": "h", "host": "g", "ts": 1, "interval_s": 1, "containers": []}',  # a duplicate key
    '{"v": 1, "host": "h", "ts": 1e400, "interval_s": 1, "containers": []}',  # overflows to inf
    b'{"v": 1, "host": "h\xc3", "ts": 1, "interval_s": 1, "containers": []}',  # invalid UTF-8
])
def test_json_that_parsers_treat_differently_gets_the_strict_answer(raw):
    assert_same(raw)


def test_a_top_level_error_and_a_container_error_report_what_strict_reports_first():
    d = message(interval_s="1")
    d["containers"][1]["cpu_cores"] = -3
    kind, reason = assert_same(json.dumps(d))
    assert kind == "SchemaError" and "interval_s" in reason
    d = message(gpus="x")  # after containers in field order
    d["containers"][1]["cpu_cores"] = -3
    kind, reason = assert_same(json.dumps(d))
    assert "containers[1]" in reason


def test_random_mutations_of_valid_messages_agree_with_the_strict_parser():
    rng = random.Random(7)
    fields = [f.name for f in dataclasses.fields(ContainerSample)]
    values = BAD_VALUES + [0, 0.0, 2, 3.25, 2**40, MAX_CORES + 1, MAX_BYTES * 2, "c", 64 * 100.0 + 1]
    accepted = rejected = 0
    for _ in range(1500):
        d = message(rng.randint(1, 8))
        for _ in range(rng.randint(1, 3)):
            dicts = [c for c in d["containers"] if isinstance(c, dict)]
            if not dicts:
                break
            c = rng.choice(dicts)
            action = rng.random()
            if action < 0.8:
                c[rng.choice(fields)] = rng.choice(values)
            elif action < 0.9:
                c.pop(rng.choice(fields), None)
            else:
                d["containers"][rng.randrange(len(d["containers"]))] = rng.choice([None, 1, "x", [], {}])
        kind, _ = assert_same(json.dumps(d))
        accepted += kind == "ok"
        rejected += kind != "ok"
    assert accepted > 50 and rejected > 500  # both answers were exercised


@pytest.fixture(params=["orjson", "json"])
def writer(request, monkeypatch):
    """encode() with orjson (the worker) and with the stdlib."""
    return _use_orjson(monkeypatch, codec, "_fast_dumps", request.param)


def _records():
    import numpy as np

    from phasewise.kit.records import DeadLetter, Decision, PhaseChange

    return [
        decode(HostSamples, json.dumps(message(3))),
        Decision(id="x", ts=1.0, host="h", container="c", action="limit", policy="phase", reason="r\u00e9 \u2192",
                 cpu_limit_cores=1.5e-05, mem_limit_bytes=None,
                 details={"a": [1, 2.5, None, np.float64(0.25)], "b": {"c": "d", "e": 1e300}}),
        PhaseChange(container="c", host="h", ts=2.0, old_phase=None, new_phase=3, since=1.0, stats={"p": 0.1}),
        DeadLetter(ts=3.0, source_topic="t", reason="why", payload="\\xff"),
    ]


def test_encode_writes_the_json_values_of_the_fields_as_compact_utf8(writer):
    for r in _records():
        raw = encode(r)
        reference = json.dumps(dataclasses.asdict(r), separators=(",", ":"), allow_nan=False)
        assert json.loads(raw.decode("utf-8")) == json.loads(reference)
        assert b" " not in raw.replace(b"r\xc3\xa9 \xe2\x86\x92", b"").replace(b"\\u00e9 \\u2192", b"")
        assert type(r).__name__ == "HostSamples" or decode(type(r), raw) == r  # the record reads back


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_number_anywhere_is_refused_by_both_writers(writer, bad):
    import numpy as np

    from phasewise.kit.records import Decision

    with pytest.raises(ValueError, match="not a finite number"):
        encode(ContainerSample(container="a", cpu_cores=bad, mem_bytes=1))
    base = dict(id="x", ts=1.0, host="h", container="c", action="limit", policy="phase")
    for details in ({"a": bad}, {"a": {"b": [1.0, bad]}}, {"a": [np.float64(bad)]}):
        with pytest.raises(ValueError, match="not a finite number"):
            encode(Decision(**base, details=details))
    with pytest.raises(ValueError, match="not a finite number"):
        encode(Decision(**base, cpu_limit_cores=np.float64(bad)))
