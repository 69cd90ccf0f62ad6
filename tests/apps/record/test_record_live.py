"""``phasewise record`` on a real run: a real ``phasewise produce`` samples a cgroup tree whose counters a
thread advances and publishes to a private broker, with a job's submission, placement and progress on the
job-events topic and a record that does not decode on the samples topic; ``record`` writes the file and
``replay --format phasewise --json`` scores every policy on it. Also ``record --sample-host`` (no Kafka)
and the one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.records import ContainerSample, HostSamples, JobEvent, JobRequests, JobSpec, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import JOB_EVENTS, SAMPLES
from tests.producers.conftest import CgTree

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[3]
HOST = "rec-host"
COMMAND = ("python", "train.py", "--epochs", "2")


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    return subprocess.run([sys.executable, "-m", "phasewise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


class Load(threading.Thread):
    """Advances the tree's counters as two running containers would: train busy then idle, serve steady."""

    def __init__(self, tree: CgTree) -> None:
        super().__init__(daemon=True)
        self.tree, self.halt = tree, threading.Event()

    def run(self) -> None:
        cpu = {"train": 0.0, "serve": 0.0}
        k = 0
        while not self.halt.wait(0.05):
            k += 1
            cpu["train"] += 0.05 * (1.6 if (k // 20) % 2 == 0 else 0.3)
            cpu["serve"] += 0.05 * 0.5
            self.tree.set("train", cpu_s=cpu["train"], mem=(300 + 2 * (k % 50)) * 2**20)
            self.tree.set("serve", cpu_s=cpu["serve"], mem=120 * 2**20)


@pytest.mark.broker
@pytest.mark.slow
def test_a_recorded_run_replays_and_every_policy_is_scored(broker, tmp_path, assert_replay_output):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tree = CgTree(tmp_path / "cgroup", 2)
    load = Load(tree)
    tree.set("train", mem=2**28)
    tree.set("serve", mem=2**27)
    now = time.time()
    p = make_producer(s)
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=8, requests=JobRequests(cpu_cores=1.0),
                   command=COMMAND)
    events = [JobEvent(job="j-rec", ts=now - 2, kind="submitted", spec=spec),
              JobEvent(job="j-rec", ts=now - 1, kind="started", host=HOST, container="train"),
              *(JobEvent(job="j-rec", ts=now + i, kind="progress", step=100 * i, loss=2.0 / i) for i in (1, 2, 3))]
    for ev in events:
        p.produce(JOB_EVENTS.name, key=b"j-rec", value=encode(ev))
    p.produce(SAMPLES.name, key=HOST.encode(), value=b"{not a HostSamples record")
    assert p.flush(30) == 0
    load.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    produce = subprocess.Popen(
        [sys.executable, "-m", "phasewise.cli", "produce", "--interval", "0.1", "--host", HOST, "--bootstrap",
         broker.bootstrap, "--cgroup-root", str(tree.root), "--cgroup-prefix", tree.prefix],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out = tmp_path / "run.parquet"
    try:
        # follows the topic until 60 samples messages came (the run is 6 s of samples); --duration bounds it
        r = _cli("record", "--bootstrap", broker.bootstrap, "--since", "10m", "--duration", "150s",
                 "--max-records", "60", "--out", str(out))
    finally:
        produce.send_signal(signal.SIGTERM)
        produce.communicate(timeout=60)
        load.halt.set()
        load.join(10)
    assert r.returncode == 0, r.stderr
    # a tick may miss a container whose files the load thread was rewriting (the sampler skips it, or takes a
    # new baseline): between one and two rows per message
    m = re.match(r"recorded (\d+) samples of 2 containers on 1 host\(s\)", r.stdout)
    assert m and 60 <= int(m.group(1)) <= 120, r.stdout
    rows = int(m.group(1))
    assert "1 job(s) described" in r.stdout
    assert "1 record(s) did not decode and are not in the file" in r.stderr

    import pyarrow.parquet as pq

    from phasewise.apps.record.tracefile import METADATA_KEY

    header = json.loads(pq.ParquetFile(out).schema_arrow.metadata[METADATA_KEY])
    assert header["source"]["topic"] == SAMPLES.name and header["source"]["jobs_topic"] == JOB_EVENTS.name
    assert header["command"][:2] == ["phasewise", "record"] and "--max-records" in header["command"]
    assert header["hosts"][HOST]["ticks"] == 60 and header["hosts"][HOST]["clock_steps_back"] == 0
    assert header["interval_s"] == pytest.approx(0.1, abs=0.08)
    assert header["records"]["undecodable"] == 1
    by = {c["container"]: c for c in header["containers"]}
    assert set(by) == {"train", "serve"}
    assert by["train"]["identity"]["layout"] == "flat" and by["train"]["identity"]["container_id"] == "train"
    assert by["train"]["job"] == "j-rec" and by["train"]["command"] == list(COMMAND)
    assert [st["step"] for st in by["train"]["stages"]] == [100, 200, 300]
    assert by["serve"]["job"] is None
    table = pq.read_table(out)  # the rows name the job the started event placed in the container
    assert set(zip(table.column("container").to_pylist(), table.column("job").to_pylist())) == {
        ("train", "j-rec"), ("serve", None)}

    r = _cli("replay", str(out), "--format", "phasewise", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert_replay_output(lines)
    setup = lines[0]
    assert setup["type"] == "setup" and setup["trace"]["format"] == "phasewise"
    assert setup["trace"]["containers"] == 2 and setup["trace"]["samples"] == rows
    assert any("did not decode when it was recorded" in n for n in setup["trace"]["notes"])
    scored = {(row["policy"], row["resource"]) for row in lines if row["type"] == "score"}
    assert scored == {(p, r) for p in ("vpa", "window", "phase", "oracle") for r in ("cpu", "mem")}, scored
    assert all(row["steps"] > 0 for row in lines if row["type"] == "score")


def test_sample_host_records_this_hosts_containers_without_kafka(tmp_path):
    tree = CgTree(tmp_path / "cgroup", 2)
    tree.set("job-a", cpu_s=1.0, mem=2**20)
    out = tmp_path / "host.parquet"
    r = _cli("record", "--sample-host", "--host", "h-direct", "--interval", "0.05", "--max-records", "4",
             "--cgroup-root", str(tree.root), "--cgroup-prefix", tree.prefix, "--bootstrap", f"127.0.0.1:{free_port()}",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("recorded 4 samples of 1 containers on 1 host(s)"), r.stdout
    from phasewise.apps.record.tracefile import read_recording

    rec = read_recording(out)
    assert rec.header["source"]["kind"] == "host" and list(rec.header["hosts"]) == ["h-direct"]
    assert list(rec.series) == ["h-direct/job-a"] and len(rec.series["h-direct/job-a"][0]) == 4


@pytest.mark.parametrize("args, says, rc", [
    (["--since", "yesterday"], "phasewise record: error: --since: 'yesterday' is neither a duration", 2),
    (["--sample-host", "--since", "1h"], "phasewise record: error: --since/--until: read a topic", 2),
    (["--duration", "1m", "--until", "1h"], "phasewise record: error: --duration: goes with --since", 2),
    (["--max-records", "0"], "phasewise record: error: --max-records: must be >= 1", 2),
    (["--timeout", "1"], "phasewise record: no Kafka broker answered at 127.0.0.1:", 1),
    (["--context", "/nonexistent/ctx.json"], "phasewise record: error: --context: /nonexistent/ctx.json: No such", 2),
    (["--context", str(ROOT / "pyproject.toml")], "phasewise record: error: --context: ", 2),
    (["--context", str(ROOT / "infra" / "schemas" / "JobEvent.v1.json"), "--timeout", "1"],
     "phasewise record: no Kafka broker answered", 1),  # (a JSON object: taken)
])
def test_bad_flags_and_an_unreachable_broker_are_one_line(tmp_path, args, says, rc):
    r = _cli("record", "--out", str(tmp_path / "x.parquet"), "--bootstrap", f"127.0.0.1:{free_port()}", *args)
    assert r.returncode == rc
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), lines
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.broker
def test_until_before_every_record_writes_nothing_and_says_so(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    p = make_producer(s)
    p.produce(SAMPLES.name, key=b"h-until", value=encode(HostSamples(host="h-until", ts=time.time(), interval_s=1.0,
                                                                     containers=(ContainerSample(
                                                                         container="c", cpu_cores=1.0,
                                                                         mem_bytes=1e6),))))
    assert p.flush(30) == 0
    out = tmp_path / "none.parquet"
    r = _cli("record", "--bootstrap", broker.bootstrap, "--until", "1h", "--out", str(out))
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.strip() == (f"phasewise record: no container samples from {SAMPLES.name} (0 samples messages, "
                                "0 undecodable): nothing written")
