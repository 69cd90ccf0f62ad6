"""The shared decoders and the dead-letter builder against hostile records, without Kafka.

Whatever a record holds, a decoder returns a record or raises SchemaError with
a reason; a dead letter fits the size it is given and says when it is cut.
"""

from __future__ import annotations

import base64
import json
import random
import zlib

import numpy as np
import pytest

from phasewise.apps.bench.fuzz import KINDS, TOPICS, Fuzzer, check_decoders
from phasewise.kit.kafka.client import KEY_MAX_BYTES, dead_letter
from phasewise.kit.records import (
    MAX_MESSAGE_BYTES,
    ContainerSample,
    DeadLetter,
    Decision,
    HostSamples,
    ModelSnapshot,
    SchemaError,
    columns,
    decode,
    decode_host_samples,
    encode,
    payload_text,
    to_dict,
)
from phasewise.kit.settings import Settings, SettingsError
from phasewise.models.phases.checkpoint import CheckpointError, pack, unpack

SAMPLE = to_dict(HostSamples(host="h", ts=1.0, interval_s=1.0, containers=(
    ContainerSample(container="c", cpu_cores=1.0, mem_bytes=1e8, nr_periods=3),)))


def _with(d: dict, path: tuple, text: str) -> bytes:
    """JSON of *d* with the value at *path* replaced by the raw JSON *text* (e.g. a 5000-digit number)."""
    d = json.loads(json.dumps(d))
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = "@@"
    return json.dumps(d).replace('"@@"', text).encode()


HOSTILE = [
    (None, "has no value"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
    (json.dumps(SAMPLE).encode()[:-1] + b',"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (random.Random(1).randbytes(600_000), "not valid JSON"),
    (_with(SAMPLE, ("ts",), "9" * 5000), "4300 digits"),
    (_with(SAMPLE, ("containers", 0, "cpu_cores"), "9" * 400), "too large for a number"),
    (_with(SAMPLE, ("containers", 0, "nr_periods"), str(2**63)), "not a 64-bit integer"),
    (_with(SAMPLE, ("containers", 0, "nr_periods"), str(2**70)), "not a 64-bit integer"),
    # (orjson reads it as the float -2**63: then the minimum refuses it)
    (_with(SAMPLE, ("host_cpu_count",), str(-(2**63) - 1)), "not a 64-bit integer|below the minimum 0"),
    (_with(SAMPLE, ("v",), "7" * 3000), "unsupported schema version 777"),
    (_with(SAMPLE, ("host",), json.dumps("x" * 1000)), None),  # a long host name is valid
    (b"", "not valid JSON"),
    (b"null", "expected a JSON object, got NoneType"),
    (12, "expected bytes, got int"),
]


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "json"])
@pytest.mark.parametrize("raw,why", HOSTILE, ids=range(len(HOSTILE)))
def test_samples_decoders_raise_only_schema_errors_with_a_reason(monkeypatch, fast, raw, why):
    if not fast:
        monkeypatch.setattr(columns, "_fast_loads", None)
    if why is None:
        assert decode_host_samples(raw) == decode(HostSamples, raw)
        return
    for dec in (decode_host_samples, lambda r: decode(HostSamples, r)):
        with pytest.raises(SchemaError, match=why) as e:
            dec(raw)
        assert len(str(e.value)) < 300  # a reason quotes the start of a value, never all of it


def test_a_message_over_the_size_cap_is_refused_before_it_is_parsed():
    big = b'{"v":1,"host":"' + b"h" * MAX_MESSAGE_BYTES + b'","ts":1,"interval_s":1}'
    for dec in (decode_host_samples, lambda r: decode(HostSamples, r)):
        with pytest.raises(SchemaError, match=f"larger than the limit of {MAX_MESSAGE_BYTES} bytes"):
            dec(big)


def test_the_fast_path_keeps_64_bit_integers_and_agrees_with_the_strict_parser():
    edge = _with(SAMPLE, ("containers", 0, "nr_periods"), str(2**63 - 1))
    fast, strict = decode_host_samples(edge), decode(HostSamples, edge)
    assert fast.containers[0].nr_periods == 2**63 - 1 == strict.containers[0].nr_periods


def test_decisions_and_snapshots_decode_to_schema_errors_too():
    d = to_dict(Decision(id="i", ts=1.0, host="h", container="c", action="limit", policy="p"))
    for raw, why in [(None, "has no value"), (b"[" * 100_000, "nested too deeply"),
                     (_with(d, ("ts",), "1" * 5000), "4300 digits"), (_with(d, ("action",), json.dumps("x" * 10**5)),
                                                                       "is not one of"),
                     (_with(d, ("details",), "[" * 5000 + "]" * 5000), "nested too deeply")]:
        with pytest.raises(SchemaError, match=why) as e:
            decode(Decision, raw)
        assert len(str(e.value)) < 300
    with pytest.raises(SchemaError, match="field 'version' = 1000.* is not a 64-bit integer"):
        decode(ModelSnapshot, json.dumps({"v": 1, "name": "m", "ts": 1, "version": 10**30, "payload_b64": ""}))


# ---------------------------------------------------------------------- dead letters


def test_a_dead_letter_keeps_a_payload_that_fits_whole():
    raw = json.dumps(SAMPLE).encode()
    key, value, dl = dead_letter(source_topic="t", reason="bad", payload=raw, key=b"h", partition=3, offset=9)
    assert key == b"h" and not dl.truncated and dl.payload == raw.decode() and dl.payload_bytes == len(raw)
    assert decode(DeadLetter, value) == dl and (dl.partition, dl.offset) == (3, 9)
    _, _, tomb = dead_letter(source_topic="t", reason="null", payload=None)
    assert tomb.payload == "" and tomb.payload_bytes is None and not tomb.truncated


@pytest.mark.parametrize("max_bytes", [16_384, 100_000, 900_000])
@pytest.mark.parametrize("payload", [random.Random(2).randbytes(600_000), b"\x01" * 600_000,
                                     "é".encode() * 500_000, b"[" * 2_000_000],
                         ids=["random", "control", "utf8", "ascii"])
def test_a_dead_letter_is_cut_to_fit_and_says_so(payload, max_bytes):
    key = random.Random(3).randbytes(5000)
    k, value, dl = dead_letter(source_topic="t", reason="r" * 10_000, payload=payload, key=key, max_bytes=max_bytes)
    assert len(k) + len(value) <= max_bytes
    assert decode(DeadLetter, value) == dl
    assert dl.truncated and dl.payload_bytes == len(payload) and len(k) <= KEY_MAX_BYTES
    assert payload_text(payload).startswith(dl.payload) and len(dl.payload) > 0
    assert len(dl.reason) <= 2000 and dl.reason.endswith("(10000 characters)")
    if payload[:2] == "é".encode():
        assert "\\x" not in dl.payload  # cut between characters, not inside one
    # the room is used: what was kept is most of what fits
    assert len(k) + len(value) > 0.8 * max_bytes


def test_the_dead_letter_limit_is_a_setting_within_what_producers_send():
    s = Settings.from_env(env={"PHASEWISE_DEAD_LETTER_MAX_BYTES": "100000"})
    assert s.kafka.dead_letter_max_bytes == 100_000
    with pytest.raises(SettingsError, match="DEAD_LETTER_MAX_BYTES: must be in \\[16384, 1000000\\]"):
        Settings.from_env(env={"PHASEWISE_DEAD_LETTER_MAX_BYTES": "2000000"})


# ---------------------------------------------------------------------- model checkpoints


def test_a_checkpoint_that_inflates_is_truncated_or_is_garbage_is_refused():
    blob = pack("demo", 1, {"a": 1}, {"w": np.arange(10.0)})
    hlen = int.from_bytes(blob[4:8], "little")
    head, body = blob[: 8 + hlen], blob[8 + hlen:]
    cases = {
        "inflates": head + zlib.compress(b"\0" * 2**24),
        "truncated stream": head + body[:-2],
        "trailing bytes": head + body + b"xx",
        "bad dtype": head.replace(b'"<f8"', b'"|O8"') if b'"<f8"' in head else None,
        "huge index": head.replace(b'"nbytes":80', b'"nbytes":99999999999999'),
        "deep header": blob[:4] + (200_002).to_bytes(4, "little") + b"[" * 100_001 + b"]" * 100_001 + body,
        "header length": blob[:4] + (2**32 - 1).to_bytes(4, "little") + blob[8:],
        "not an object": blob[:4] + (2).to_bytes(4, "little") + b"[]" + body,
    }
    for what, bad in cases.items():
        assert bad is not None and bad != blob, what
        with pytest.raises(CheckpointError):
            unpack(bad, "demo", 1)
    assert unpack(blob, "demo", 1)[1]["w"].tolist() == list(np.arange(10.0))


# ---------------------------------------------------------------------- learn batches and snapshots


def test_learn_batches_refuse_what_is_no_usage():
    from phasewise.kit.records.learn_batches import decode_learn_batch, encode_learn_batch

    W = np.full((2, 3, 2), 1.0)
    good = json.loads(encode_learn_batch("m", W, np.array([-1, 0]), W[:, -1], W[:, -1]))
    assert decode_learn_batch(json.dumps(good).encode(), "m", 3, 2)[0].shape == (2, 3, 2)
    for change, why in [({"windows": [True] * 12}, "bad arrays"), ({"usage": ["1.5"] * 4}, "bad arrays"),
                        ({"prev_phase": [0, 1.5]}, "bad arrays"), ({"prev_phase": [0, -2]}, "below -1"),
                        ({"prev_phase": [0, 2**64]}, "bad arrays"), ({"usage": [1e300] * 4}, "above the feature"),
                        ({"levels": [5000.0, 1.0] * 2}, "level above"), ({"shape": [10**30, 3, 2]}, "shape"),
                        ({"v": True}, "unsupported version"), ({"model": "x" * 10**5}, "for model 'xxx")]:
        with pytest.raises(SchemaError, match=why) as e:
            decode_learn_batch(json.dumps({**good, **change}).encode(), "m", 3, 2, ("cpu", "mem"))
        assert len(str(e.value)) < 400
    for raw, why in [(None, "has no value"), (b"[" * 100_000, "nested too deeply"),
                     (random.Random(4).randbytes(600_000), "not valid JSON"),
                     (json.dumps(good, separators=(",", ":")).replace('"v":2', '"v":' + "9" * 5000).encode(),
                      "4300 digits")]:
        with pytest.raises(SchemaError, match=why):
            decode_learn_batch(raw, "m", 3, 2)


class _Msg:
    def __init__(self, value, key, offset):
        self._v, self._k, self._o = value, key, offset

    def error(self):
        return None

    def value(self):
        return self._v

    def key(self):
        return self._k

    def offset(self):
        return self._o


def test_the_snapshot_follower_dead_letters_every_bad_record_of_its_model_whatever_its_version():
    from phasewise.models.phases.detector import PhaseModel
    from phasewise.models.phases.snapshots import model_name, snapshot_of
    from phasewise.streams.follower import SnapshotFollower

    model = PhaseModel(features=("cpu", "mem"), n_hid=4, n_his=1, warmup=8)
    name = model_name(model.features)
    bad, loaded = [], []
    f = SnapshotFollower(Settings(), name, on_bad=lambda v, k, o, why: bad.append((o, why)),
                         on_loaded=lambda s: loaded.append(s.version))
    snap = snapshot_of(model, 5, 1, 1.7e9)
    other = snapshot_of(PhaseModel(features=("cpu", "mem", "gpu"), n_hid=4, n_his=1), 9, 1, 1.7e9)
    key = name.encode()
    records = [
        (encode(snap), key), (None, key), (b"[" * 100_000, key), (random.Random(5).randbytes(600_000), key),
        (encode(ModelSnapshot(**{**to_dict(snap), "version": 1, "payload_b64": "!!"})), key),  # old and broken
        (encode(ModelSnapshot(**{**to_dict(other), "name": name})), key),  # a model of other features
        (encode(ModelSnapshot(**{**to_dict(snap), "version": 7, "payload_b64": base64.b64encode(
            b"PWCK" + (2**31).to_bytes(4, "little")).decode()})), key),
        (encode(other), other.name.encode()),  # another model's: not this follower's business
        (encode(snapshot_of(model, 4, 1, 1.7e9)), key),  # older than the newest: ignored
        (encode(snapshot_of(model, 6, 2, 1.7e9)), key),
    ]
    for i, (value, k) in enumerate(records):
        f._handle(_Msg(value, k, i))
    assert [o for o, _ in bad] == [1, 2, 3, 4, 5, 6]
    assert "has no value" in bad[0][1] and "nested too deeply" in bad[1][1] and "payload is no PhaseModel" in bad[3][1]
    assert "a model of 'phase-crbm/cpu+mem+gpu'" in bad[4][1]
    assert loaded == [5, 6] and f.latest()[0].version == 6


# ---------------------------------------------------------------------- the fuzz generator, in process


@pytest.mark.parametrize("topic", TOPICS)
def test_thousands_of_generated_hostile_messages_are_all_refused_with_a_reason(topic):
    from phasewise.models.phases.detector import PhaseModel

    model = PhaseModel(features=("cpu", "mem"), n_hid=4, n_his=1, warmup=8) if topic in (
        "learn-windows", "models") else None
    got = check_decoders(Fuzzer(topic, seed=11, model=model), 2000, model)
    assert got["decoder_crashes"] == 0, got["crashed"]
    assert got["generator_valid"] == {}, got["generator_valid"]
    assert got["rejected_with_reason"] == 2000
    assert set(got["kinds"]) == set(KINDS[topic])  # every kind drawn
