"""Learn batches (the detectors' windows for the one learner): round trip, and why a bad one is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from phasewise.kit.records import SchemaError
from phasewise.kit.records.learn_batches import decode_learn_batch
from phasewise.models.phases.snapshots import model_name

NAME = model_name()


@pytest.mark.parametrize("writer", ["orjson", "json"])
@pytest.mark.parametrize("reader", ["orjson", "json"])
def test_learn_batches_round_trip_and_malformed_ones_say_why(monkeypatch, writer, reader):
    import phasewise.kit.records.learn_batches as pa

    assert pa._orjson is not None, "orjson is part of the streams extra"
    orj = pa._orjson

    def encode_learn_batch(*a, **kw):  # written by a worker with / without orjson
        monkeypatch.setattr(pa, "_orjson", orj if writer == "orjson" else None)
        try:
            return pa.encode_learn_batch(*a, **kw)
        finally:
            monkeypatch.setattr(pa, "_orjson", orj if reader == "orjson" else None)

    monkeypatch.setattr(pa, "_orjson", orj if reader == "orjson" else None)
    W = np.arange(24, dtype=float).reshape(4, 3, 2)
    raw = encode_learn_batch(NAME, W, np.array([0, -1, 2, 2]), W[:, -1])
    got_W, got_P, got_U, got_L = decode_learn_batch(raw, NAME, 3, 2)
    np.testing.assert_array_equal(got_W, W)
    assert got_P.tolist() == [0, -1, 2, 2] and got_U.tolist() == W[:, -1].tolist() and got_L is None
    # relative statistics: each window's container level travels with it (NaN: no level yet)
    L = np.array([[1.0, 2.0], [np.nan, 4.0], [5.0, 6.0], [7.0, 8.0]])
    *_, got_L = decode_learn_batch(encode_learn_batch(NAME, W, np.zeros(4), W[:, -1], L), NAME, 3, 2)
    np.testing.assert_array_equal(got_L, L)
    bad = json.loads(encode_learn_batch(NAME, W, np.zeros(4), W[:, -1], L))
    bad["levels"] = bad["levels"][:-1]
    with pytest.raises(SchemaError, match="levels do not match"):
        decode_learn_batch(json.dumps(bad).encode(), NAME, 3, 2)
    bad["levels"] = [-1.0] * 8
    with pytest.raises(SchemaError, match="negative level"):
        decode_learn_batch(json.dumps(bad).encode(), NAME, 3, 2)
    v1 = json.loads(raw)
    v1["v"] = 1  # written by a worker of the previous version: still learned from
    assert decode_learn_batch(json.dumps(v1).encode(), NAME, 3, 2)[3] is None
    with pytest.raises(SchemaError, match="not valid JSON"):
        decode_learn_batch(b"nope", NAME, 3, 2)
    with pytest.raises(SchemaError, match="shape"):
        decode_learn_batch(raw, NAME, 4, 2)
    with pytest.raises(SchemaError, match="this learner trains"):
        decode_learn_batch(raw, "other", 3, 2)
    W2 = W.copy()
    W2[1, 0, 0], W2[2, 1, 1] = np.nan, np.inf  # missing frames travel as null, come back as NaN
    got_W = decode_learn_batch(encode_learn_batch(NAME, W2[:, :, ::-1][:, :, ::-1], np.zeros(4), W2[:, -1]),
                               NAME, 3, 2)[0]
    assert np.isnan(got_W[1, 0, 0]) and np.isnan(got_W[2, 1, 1]) and np.isfinite(got_W).sum() == 22
    bad = json.loads(raw)
    for field, value in (("windows", "x"), ("usage", [[1.0], 2.0]), ("windows", ["a"] * 24)):
        with pytest.raises(SchemaError, match="bad arrays|array sizes"):
            decode_learn_batch(json.dumps({**bad, field: value}).encode(), NAME, 3, 2)
