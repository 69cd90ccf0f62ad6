"""The recording file without a broker: what the header says, what ``replay --format phasewise`` reads back,
and recordings that are broken (not Parquet, no header, a newer version, missing columns) or doubtful (a
clock stepped back, gaps, containers the header does not describe)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from phasewise.apps.record.tracefile import METADATA_KEY, Recorder, read_recording
from phasewise.apps.replay.traces import TraceFormatError, load_trace
from phasewise.cli import main
from phasewise.kit.records import (
    ContainerIdentity,
    ContainerSample,
    HostSamples,
    JobEvent,
    JobRequests,
    JobSpec,
    WorkloadPolicy,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SPEC = JobSpec(model="resnet18", dataset="cifar10", batch_size=8, requests=JobRequests(cpu_cores=1.0),
               command=("python", "train.py", "--epochs", "3"))


def _tick(host: str, ts: float, **cpu: float) -> HostSamples:
    return HostSamples(host=host, ts=ts, interval_s=1.0, containers=tuple(
        ContainerSample(container=name, cpu_cores=v, mem_bytes=1e8 + 1e6 * ts,
                        identity=ContainerIdentity(layout="flat", container_id=name),
                        workload=WorkloadPolicy(mode="recommend", job="j1") if name == "train" else None)
        for name, v in cpu.items()))


def _recording(tmp_path, ticks, events=()):
    r = Recorder()
    for t in ticks:
        r.add_samples(t)
    for e in events:
        r.add_job_event(e)
    path = tmp_path / "run.parquet"
    header = r.write(path, source={"kind": "test"}, command=["phasewise", "record", "--out", str(path)])
    return path, header


def test_the_header_names_hosts_span_interval_and_each_containers_identity_job_command_and_stages(tmp_path):
    ticks = [_tick("h1", 100.0 + i, train=2.0, idle=0.1) for i in range(5)] + [_tick("h2", 101.0, other=0.5)]
    events = [JobEvent(job="j1", ts=99.0, kind="submitted", spec=SPEC),
              JobEvent(job="j1", ts=100.5, kind="started", host="h1", container="train"),
              JobEvent(job="j1", ts=101.0, kind="progress", step=10, loss=2.5),
              JobEvent(job="j1", ts=103.0, kind="progress", step=20, loss=1.5, epoch=1.0),
              JobEvent(job="other-job", ts=50.0, kind="submitted", spec=SPEC)]
    path, header = _recording(tmp_path, ticks, events)
    stored = json.loads(pq.ParquetFile(path).schema_arrow.metadata[METADATA_KEY])
    assert stored == header
    assert header["format"] == "phasewise-recording" and header["version"] == 1
    assert header["command"] == ["phasewise", "record", "--out", str(path)]
    assert set(header["hosts"]) == {"h1", "h2"} and header["hosts"]["h1"]["ticks"] == 5
    assert header["span"]["start"] == 100.0 and header["span"]["end"] == 104.0 and header["interval_s"] == 1.0
    by = {(c["host"], c["container"]): c for c in header["containers"]}
    assert set(by) == {("h1", "train"), ("h1", "idle"), ("h2", "other")}
    train = by[("h1", "train")]
    assert train["identity"] == {"layout": "flat", "container_id": "train", "pod_uid": None, "pod_namespace": None,
                                 "pod_name": None, "container_name": None, "runtime": None, "qos": None}
    assert train["job"] == "j1" and train["command"] == ["python", "train.py", "--epochs", "3"]
    assert [s["step"] for s in train["stages"]] == [10, 20] and train["stages"][1]["epoch"] == 1.0
    assert train["samples"] == 5 and [e["kind"] for e in train["events"]] == ["submitted", "started"]
    assert by[("h1", "idle")]["job"] is None and "command" not in by[("h1", "idle")]
    assert header["records"]["jobs_described"] == 1  # other-job has no container in the recording
    table = pq.read_table(path)
    assert {(h, c, j) for h, c, j in zip(*(table.column(k).to_pylist() for k in ("host", "container", "job")))} == {
        ("h1", "train", "j1"), ("h1", "idle", None), ("h2", "other", None)}


def test_the_stages_a_job_reported_and_a_context_are_kept_in_the_header(tmp_path):
    ticks = [_tick("h1", 100.0 + i, train=2.0) for i in range(3)]
    events = [JobEvent(job="j1", ts=100.2, kind="progress", step=0, stage="load"),
              JobEvent(job="j1", ts=101.0, kind="progress", step=1, loss=2.5, stage="train"),
              JobEvent(job="j1", ts=101.5, kind="progress", step=1, stage="eval")]
    r = Recorder()
    for t in ticks:
        r.add_samples(t)
    for e in events:
        r.add_job_event(e)
    context = {"machine": {"gpu": "none"}, "load_avg_1m": {"mean": 1.5}}
    header = r.write(tmp_path / "run.parquet", source={"kind": "test"}, command=["phasewise", "record"],
                     context=context)
    [train] = header["containers"]
    assert [(s["stage"], s["step"]) for s in train["stages"]] == [("load", 0), ("train", 1), ("eval", 1)]
    assert header["context"] == context == read_recording(tmp_path / "run.parquet").header["context"]
    assert "context" not in r.provenance(source={}, command=[])  # none given: none written


def test_replay_reads_a_recording_back_as_one_series_per_host_and_container(tmp_path):
    path, _ = _recording(tmp_path, [_tick("h1", 100.0 + i, train=1.0 + i, idle=0.1) for i in range(4)])
    trace = load_trace(path, "phasewise")
    assert trace.format == "phasewise" and trace.units == {"cpu": "cores", "mem": "bytes (working set)"}
    assert [c.container for c in trace.containers] == ["h1/idle", "h1/train"]
    train = trace.containers[1]
    assert train.t.tolist() == [100.0, 101.0, 102.0, 103.0]
    assert train.usage["cpu"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert trace.notes == []


def test_a_clock_stepping_back_gaps_and_unknown_containers_are_counted_not_fatal(tmp_path):
    ticks = [_tick("h1", t, train=1.0) for t in (100.0, 101.0, 102.0, 101.5, 103.0, 110.0, 111.0)]
    path, header = _recording(tmp_path, ticks)
    assert header["hosts"]["h1"]["clock_steps_back"] == 1
    # a container the header does not describe: rows added to the file by hand
    table = pq.read_table(path)
    extra = {name: [table.column(name)[0].as_py()] * 2 for name in table.column_names}
    extra.update(container=["stranger", "stranger"], ts=[100.0, 101.0])
    table = pa.concat_tables([table, pa.table(extra, schema=table.schema)])
    pq.write_table(table, path)
    trace = load_trace(path, "phasewise")
    train = next(c for c in trace.containers if c.container == "h1/train")
    assert train.t.tolist() == [100.0, 101.0, 102.0, 103.0, 110.0, 111.0]
    rec = read_recording(path)
    assert rec.counts == {"clock_steps_back": 1, "gaps": 1, "unknown_containers": 1}
    text = "\n".join(trace.notes)
    assert "1 sample(s) stamped at or before their container's previous one dropped" in text
    assert "1 gap(s) longer than 3 sampling intervals in 1 container(s) (longest 7 s)" in text
    assert "1 container(s) with samples but no entry in the provenance header" in text and "h1/stranger" in text


def _broken(tmp_path, kind):
    path = tmp_path / "bad.parquet"
    good, header = _recording(tmp_path, [_tick("h1", 100.0, train=1.0)])
    if kind == "not parquet":
        path.write_text("host,ts\nh1,1\n")
    elif kind == "no header":
        pq.write_table(pq.read_table(good).replace_schema_metadata({}), path)
    elif kind == "newer version":
        meta = {METADATA_KEY: json.dumps({**header, "version": 2}).encode()}
        pq.write_table(pq.read_table(good).replace_schema_metadata(meta), path)
    elif kind == "missing column":
        table = pq.read_table(good)
        pq.write_table(table.drop_columns(["cpu_cores"]), path)
    elif kind == "empty":
        table = pq.read_table(good)
        pq.write_table(table.slice(0, 0), path)
    return path


@pytest.mark.parametrize("kind, says", [
    ("not parquet", "not a readable Parquet file"),
    ("no header", "a Parquet file without phasewise's provenance header"),
    ("newer version", "recording version 2; this phasewise (0.1.0) reads version 1"),
    ("missing column", "missing column(s) ['cpu_cores']"),
    ("empty", "no container has any usage value"),
])
def test_a_broken_recording_is_one_line_and_exit_2(tmp_path, capsys, kind, says):
    path = _broken(tmp_path, kind)
    with pytest.raises(TraceFormatError, match=r"^" + str(path).replace(".", r"\.")):
        load_trace(path, "phasewise")
    assert main(["replay", str(path), "--format", "phasewise", "--policies", "vpa", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith("phasewise replay: "), err


def test_a_folder_or_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(TraceFormatError, match="is a folder; --format phasewise reads one file"):
        load_trace(tmp_path, "phasewise")
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "nothing.parquet", "phasewise")


def test_negative_and_infinite_values_in_a_hand_edited_file_are_clipped_and_counted(tmp_path):
    path, _ = _recording(tmp_path, [_tick("h1", 100.0 + i, train=1.0) for i in range(3)])
    table = pq.read_table(path)
    cpu = table.column("cpu_cores").to_pylist()
    cpu[0], cpu[1] = -0.5, float("inf")
    table = table.set_column(table.column_names.index("cpu_cores"), "cpu_cores", pa.array(cpu, pa.float64()))
    pq.write_table(table, path)
    trace = load_trace(path, "phasewise")
    u = trace.containers[0].usage["cpu"]
    assert u[0] == 0.0 and np.isnan(u[1]) and u[2] == 1.0
    assert trace.counts == {"negative_clipped": {"run.parquet cpu": 1}, "non_finite_missing": {"run.parquet cpu": 1}}


def test_without_pyarrow_record_and_replay_say_which_extra_in_one_line(tmp_path, capsys, monkeypatch):
    path, _ = _recording(tmp_path, [_tick("h1", 100.0, train=1.0)])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    assert main(["record", "--out", str(tmp_path / "x.parquet")]) == 2
    assert main(["replay", str(path), "--format", "phasewise", "--policies", "vpa"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["phasewise record: error: pyarrow is not installed: pip install 'phasewise[record]' (Parquet "
                   "recordings)",
                   "phasewise replay: pyarrow is not installed: pip install 'phasewise[record]' (Parquet recordings)"]


def test_record_help_imports_no_heavy_library():
    code = ("import sys\nfrom phasewise.cli import main\nassert main(['record', '--help']) == 0\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'faust', 'confluent_kafka', "
            "'river', 'pyarrow'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
