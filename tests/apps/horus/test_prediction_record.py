"""The UtilisationPrediction record: nested intervals round trip, bad values are refused."""

from __future__ import annotations

import pytest

from phasewise.kit.records import RECORDS, Interval, SchemaError, UtilisationPrediction, decode, encode, json_schemas


def test_a_prediction_round_trips():
    iv = Interval(mean=40.0, lo=30.0, hi=55.0)
    p = UtilisationPrediction(job="j1", ts=3.0, model_version=7, gpu_util=iv, gpu_mem_bytes=Interval(
        mean=2e9, lo=1e9, hi=3e9), cpu_cores=Interval(mean=1.0, lo=0.5, hi=2.0), mem_bytes=Interval(
        mean=1e9, lo=5e8, hi=2e9), coverage=0.8, first_sight=False, features={"flops": 1.5e9, "conv": 20})
    assert decode(UtilisationPrediction, encode(p)) == p


def test_a_prediction_without_an_interval_or_with_a_negative_one_is_refused():
    with pytest.raises(SchemaError, match="missing field 'gpu_util'"):
        decode(UtilisationPrediction, b'{"v":1,"job":"j","ts":1,"model_version":0,"coverage":0.8}')
    raw = (b'{"v":1,"job":"j","ts":1,"model_version":0,"coverage":0.8,"gpu_util":{"mean":-1,"lo":0,"hi":1},'
           b'"gpu_mem_bytes":{"mean":1,"lo":0,"hi":1},"cpu_cores":{"mean":1,"lo":0,"hi":1},'
           b'"mem_bytes":{"mean":1,"lo":0,"hi":1}}')
    with pytest.raises(SchemaError, match="gpu_util: Interval: field 'mean' = -1.0 is below the minimum 0"):
        decode(UtilisationPrediction, raw)
    schema = json_schemas(RECORDS)["UtilisationPrediction.v1.json"]
    assert schema["$defs"]["Interval"]["required"] == ["mean", "lo", "hi"]
