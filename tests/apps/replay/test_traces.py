"""Trace loaders: real files, both AI4DL layouts, GenAI alignment, clear errors."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest

from phasewise.apps.replay.traces import (
    GENAI_FILES,
    TraceFormatError,
    load_ai4dl,
    load_genai2026,
    load_trace,
)

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "src" / "phasewise" / "data" / "ai4dl_sample.csv"
GENAI = REPO.parent / "shared" / "data" / "alibaba-genai2026-pods"


def test_the_shipped_ai4dl_sample_loads_as_four_containers_with_cpu_and_memory():
    tr = load_ai4dl(SAMPLE)
    assert [c.container for c in tr.containers] == [f"service1/exec{i}" for i in range(1, 5)]
    assert [len(c) for c in tr.containers] == [65, 52, 59, 28]
    c = tr.containers[0]
    assert c.t[0] == 1565962220.0 and c.usage["cpu"][0] == 0.041 and c.usage["mem"][0] == 2478080.0
    assert all(np.all(np.diff(c.t) > 0) for c in tr.containers)
    assert tr.units == {"cpu": "cores", "mem": "bytes (working set)"}
    assert tr.n_samples() == 204


def _as_r_layout(text: str) -> str:
    """What R's write.table writes: a row-number field on every data row, none in the header."""
    lines = text.splitlines()
    return "\n".join([lines[0]] + [f'"{i}",{ln}' for i, ln in enumerate(lines[1:], 1)]) + "\n"


def _as_pandas_layout(text: str) -> str:
    lines = text.splitlines()
    return "\n".join(["," + lines[0]] + [f"{i},{ln}" for i, ln in enumerate(lines[1:])]) + "\n"


@pytest.mark.parametrize("layout", [_as_r_layout, _as_pandas_layout], ids=["r-unnamed", "pandas-empty-name"])
def test_a_leading_unnamed_index_column_gives_the_same_series(tmp_path, layout):
    variant = tmp_path / "indexed.csv"
    variant.write_text(layout(SAMPLE.read_text()))
    a, b = load_ai4dl(SAMPLE), load_ai4dl(variant)
    assert [c.container for c in a.containers] == [c.container for c in b.containers]
    for ca, cb in zip(a.containers, b.containers):
        np.testing.assert_array_equal(ca.t, cb.t)
        for r in ("cpu", "mem"):
            np.testing.assert_array_equal(ca.usage[r], cb.usage[r])


def test_missing_values_stay_missing_and_rows_arrive_in_any_order(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text('timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n'
                 '20,s,p,0.5,\n'
                 '10,s,p,0.25,100\n'
                 '30,s,p,NA,300\n')
    c = load_ai4dl(f).containers[0]
    np.testing.assert_array_equal(c.t, [10.0, 20.0, 30.0])
    np.testing.assert_array_equal(c.usage["cpu"], [0.25, 0.5, np.nan])
    np.testing.assert_array_equal(c.usage["mem"], [100.0, np.nan, 300.0])
    np.testing.assert_array_equal(c.valid("mem"), [True, False, True])


def test_a_missing_column_is_named_in_the_error(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("timestamp,service,pod.id,cpu.usage.cores\n1,s,p,0.5\n")
    with pytest.raises(TraceFormatError, match=r"missing column\(s\) \['mem.working.set'\]"):
        load_ai4dl(f)


@pytest.mark.parametrize("content,message", [
    ("", "empty file"),
    ("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n", "no data rows"),
    ("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n1,s,p,lots,3\n",
     "line 2: column 'cpu.usage.cores' is not a number"),
    ("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n1,s,p,1\n", "line 2: 4 fields, header has 5"),
    ("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n1,s,,1,2\n", "empty pod.id"),
])
def test_bad_ai4dl_files_get_clear_errors(tmp_path, content, message):
    f = tmp_path / "bad.csv"
    f.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        load_ai4dl(f)


def test_a_missing_file_or_a_folder_for_ai4dl_is_refused(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file"):
        load_ai4dl(tmp_path / "nope.csv")
    with pytest.raises(TraceFormatError, match="is a folder"):
        load_ai4dl(tmp_path)


def test_an_unknown_format_is_refused():
    with pytest.raises(TraceFormatError, match="unknown trace format 'parquet'"):
        load_trace(SAMPLE, "parquet")


def _write(path: Path, text: str) -> None:
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)


def _genai_folder(tmp_path: Path) -> Path:
    d = tmp_path / "genai"
    d.mkdir()
    _write(d / f"{GENAI_FILES['gpu']}.csv.gz",
           "value,timestamp_anon,container_ip\n10.0,0.0,a\n20.0,57.0,a\n5.0,57.0,b\n")
    _write(d / f"{GENAI_FILES['gpu_mem']}.csv",
           "timestamp_anon,value,container_ip\n0.0,1000.0,a\n114.0,3000.0,a\n")
    _write(d / f"{GENAI_FILES['mem']}.csv",
           "value,timestamp_anon,container_ip\r\n0.5,57.0,a\r\n0.7,57.0,a\r\n0.9,57.0,\r\n-0.00001,0.0,b\r\n")
    return d


def test_genai_files_are_joined_on_container_ip_and_aligned_on_timestamps(tmp_path):
    tr = load_genai2026(_genai_folder(tmp_path))
    a, b = tr.containers
    assert (a.container, b.container) == ("a", "b")
    np.testing.assert_array_equal(a.t, [0.0, 57.0, 114.0])
    np.testing.assert_array_equal(a.usage["gpu"], [10.0, 20.0, np.nan])
    np.testing.assert_array_equal(a.usage["gpu_mem"], [1000.0, np.nan, 3000.0])
    np.testing.assert_allclose(a.usage["mem"], [np.nan, 0.6, np.nan])  # duplicate at 57 averaged
    np.testing.assert_array_equal(b.t, [0.0, 57.0])
    np.testing.assert_array_equal(b.usage["gpu"], [np.nan, 5.0])
    np.testing.assert_array_equal(b.usage["mem"], [0.0, np.nan])  # -1e-5 clipped to 0
    assert "gpu_mem" not in b.usage  # b never reports GPU memory
    notes = " | ".join(tr.notes)
    assert "1 rows with an empty container_ip skipped" in notes
    assert "1 duplicate" in notes
    assert "1 negative value(s) clipped to 0" in notes
    assert "fraction" in tr.units["mem"] and tr.units["gpu_mem"].startswith("bytes")


def test_a_genai_folder_missing_a_file_names_it(tmp_path):
    d = _genai_folder(tmp_path)
    (d / f"{GENAI_FILES['gpu_mem']}.csv").unlink()
    with pytest.raises(TraceFormatError, match="missing pod_gpu_memory_used_bytes_anon.csv or .*csv.gz"):
        load_genai2026(d)


def test_a_genai_file_with_wrong_columns_or_a_file_instead_of_a_folder_is_refused(tmp_path):
    d = _genai_folder(tmp_path)
    _write(d / f"{GENAI_FILES['gpu_mem']}.csv", "ts,value,ip\n0,1,a\n")
    with pytest.raises(TraceFormatError, match="missing column"):
        load_genai2026(d)
    with pytest.raises(TraceFormatError, match="not a folder"):
        load_genai2026(SAMPLE)


def test_a_corrupt_gzip_gets_a_clear_error(tmp_path):
    d = _genai_folder(tmp_path)
    (d / f"{GENAI_FILES['gpu']}.csv.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(TraceFormatError, match="not a readable CSV"):
        load_genai2026(d)


@pytest.mark.skipif(not GENAI.is_dir(), reason="shared GenAI 2026 trace not present (not shipped: no licence)")
def test_the_real_genai_trace_loads_with_its_three_resources():
    tr = load_genai2026(GENAI)
    by_res = {r: [c for c in tr.containers if r in c.usage] for r in tr.units}
    assert len(by_res["gpu"]) == 105 and len(by_res["gpu_mem"]) == 106 and len(by_res["mem"]) == 147
    assert max(len(c) for c in tr.containers) == 1441
    steps = np.concatenate([np.diff(c.t) for c in tr.containers if len(c) > 1])
    assert np.median(steps) == 57.0
    gpu = np.concatenate([c.usage["gpu"][c.valid("gpu")] for c in by_res["gpu"]])
    assert 0.0 <= gpu.min() and gpu.max() <= 100.0
    mem = np.concatenate([c.usage["mem"][c.valid("mem")] for c in by_res["mem"]])
    assert 0.0 <= mem.min() and mem.max() <= 1.0 + 1e-9
    assert not any(math.isnan(v) for v in gpu)


def test_nan_and_infinite_values_are_missing_and_counted_like_negatives(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n"
                 "10,s,p,NaN,100\n"
                 "20,s,p,nan,-5\n"
                 "30,s,p,inf,300\n"
                 "40,s,p,-Infinity,\n"
                 "50,s,p,0.5,NA\n")
    tr = load_trace(f, "ai4dl")
    c = tr.containers[0]
    np.testing.assert_array_equal(c.usage["cpu"], [np.nan, np.nan, np.nan, np.nan, 0.5])
    np.testing.assert_array_equal(c.usage["mem"], [100.0, 0.0, 300.0, np.nan, np.nan])
    notes = " | ".join(tr.notes)
    assert "t.csv cpu.usage.cores: 4 NaN/infinite value(s) treated as missing (2 NaN, 2 infinite)" in notes
    assert "t.csv mem.working.set: 1 negative value(s) clipped to 0 (lowest -5)" in notes
    # empty and NA cells are plain missing values: not counted as bad values
    assert tr.counts == {"negative_clipped": {"t.csv mem.working.set": 1},
                         "non_finite_missing": {"t.csv cpu.usage.cores": 4}}


def test_a_resource_with_no_finite_value_is_named_in_the_notes(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\n10,s,p,nan,100\n20,s,p,NaN,200\n")
    tr = load_trace(f, "ai4dl")
    assert "cpu" not in tr.containers[0].usage
    assert "cpu: no value in any container: nothing to score for cpu" in tr.notes
    assert tr.counts["non_finite_missing"] == {"t.csv cpu.usage.cores": 2}


def test_genai_non_finite_values_are_counted_per_file(tmp_path):
    d = _genai_folder(tmp_path)
    _write(d / f"{GENAI_FILES['gpu_mem']}.csv",
           "timestamp_anon,value,container_ip\n0.0,1000.0,a\n57.0,inf,a\n114.0,3000.0,a\n")
    tr = load_genai2026(d)
    np.testing.assert_array_equal(tr.containers[0].usage["gpu_mem"], [1000.0, np.nan, 3000.0])
    assert tr.counts["non_finite_missing"] == {"pod_gpu_memory_used_bytes_anon.csv": 1}
    assert tr.counts["negative_clipped"] == {"pod_memory_util_anon.csv": 1}


def test_an_infinite_timestamp_is_refused(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("timestamp,service,pod.id,cpu.usage.cores,mem.working.set\ninf,s,p,1,2\n")
    with pytest.raises(TraceFormatError, match="line 2: column 'timestamp' is infinite"):
        load_ai4dl(f)
