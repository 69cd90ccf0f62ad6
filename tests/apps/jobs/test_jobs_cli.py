"""``phasewise jobs``, ``jobs describe`` and ``tail`` against a private broker holding records this module
publishes: the text and the JSON they print, undecodable records, signatures, an unreachable broker, help
without the heavy imports."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phasewise.cli import main
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.records import (
    Actuation,
    ContainerSample,
    DeadLetter,
    Decision,
    HostSamples,
    Interval,
    JobEvent,
    JobRequests,
    JobSpec,
    JobTargets,
    UtilisationPrediction,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, DECISIONS, JOB_EVENTS, PREDICTIONS, SAMPLES

pytestmark = [pytest.mark.broker]

ROOT = Path(__file__).resolve().parents[3]
HOST = "node-a"
#: the records' event times are this many seconds back from when the module published them
T = {"run": 600.0, "wait": 300.0, "oom": 500.0, "done": 550.0, "rej": 450.0}
SPEC = JobSpec(model="resnet18", dataset="cifar10", batch_size=8,
               requests=JobRequests(cpu_cores=1.0, mem_bytes=2**30),
               targets=JobTargets(acceptable=1.0, objective=0.5))


def _prediction(job: str, ts: float) -> UtilisationPrediction:
    return UtilisationPrediction(job=job, ts=ts, model_version=4, gpu_util=Interval(mean=0, lo=0, hi=0),
                                 gpu_mem_bytes=Interval(mean=0, lo=0, hi=0),
                                 cpu_cores=Interval(mean=1.5, lo=1.0, hi=2.0),
                                 mem_bytes=Interval(mean=2**30, lo=2**29, hi=2**31), coverage=0.9)


@pytest.fixture(scope="module")
def cluster(broker):
    """The broker's bootstrap address and the time the records were published."""
    s = Settings.from_env({"bootstrap": broker.bootstrap, "host": "views-test"}, env={})
    ensure_topics(s)
    p = make_producer(s)
    now = time.time()

    def pub(topic, key: str, rec) -> None:
        p.produce(topic.name, key=key.encode(), value=rec if isinstance(rec, bytes) else encode(rec))

    def ev(job: str, kind: str, back: float, **kw) -> None:
        pub(JOB_EVENTS, job, JobEvent(job=job, ts=now - back, kind=kind, **kw))

    def place(job: str, back: float, cpuset: str) -> None:
        pub(DECISIONS, HOST, Decision(id=f"place-{job}", ts=now - back, host=HOST, container=job, action="place",
                                      policy="horus", reason=f"fits on {HOST}",
                                      details={"job": job, "node": HOST, "cpuset": cpuset, "gpus": []}))

    # run: submitted, predicted, placed, started, sampled, progressing
    ev("run", "submitted", T["run"], spec=SPEC, priority=3)
    pub(PREDICTIONS, "run", _prediction("run", now - T["run"] + 1))
    place("run", T["run"] - 2, "0-1")
    pub(ACTUATIONS, HOST, Actuation(decision_id="place-run", ts=now - T["run"] + 3, host=HOST, container="run",
                                    status="applied", backend="cgroup"))
    ev("run", "started", T["run"] - 4, host=HOST, container="run", pid=4321, cpuset="0-1")
    for i in range(6):  # every 20 s from 100 s after the start (past the 20 s warm-up): cpu 1.0 .. 1.5
        pub(SAMPLES, HOST, HostSamples(host=HOST, ts=now - T["run"] + 100 + 20 * i, interval_s=20.0, containers=(
            ContainerSample(container="run", cpu_cores=1.0 + 0.1 * i, mem_bytes=2**29),
            ContainerSample(container="not-a-job", cpu_cores=7.0, mem_bytes=1.0))))
    ev("run", "progress", 60.0, step=900, loss=0.8)
    # wait: submitted, refused for want of room (a dead letter)
    ev("wait", "submitted", T["wait"], spec=SPEC)
    pub(DEAD_LETTERS, "wait", DeadLetter(
        ts=now - T["wait"] + 5, source_topic=JOB_EVENTS.name, key="wait", payload="{}",
        reason="no node takes job wait now (no node has enough CPU) and 2 jobs wait for room already "
               "(place_max_waiting_jobs 2): refused, not kept; submit it again later"))
    # oom: ran and was OOM-killed; done: finished, then a second finish; rej: refused by the actuator
    ev("oom", "submitted", T["oom"], spec=SPEC)
    place("oom", T["oom"] - 1, "2")
    ev("oom", "started", T["oom"] - 2, host=HOST, container="oom", pid=99)
    ev("oom", "failed", T["oom"] - 60, host=HOST, signal="SIGKILL", oom=True, run_s=58.0,
       reason="OOM-killed in its memory limit")
    ev("done", "submitted", T["done"], spec=SPEC)
    ev("done", "finished", T["done"] - 100, host=HOST, exit_code=0, run_s=95.0)  # read before its start
    ev("done", "started", T["done"] - 5, host=HOST, container="done", pid=7)
    ev("done", "finished", T["done"] - 101, host=HOST, exit_code=0, run_s=96.0)
    ev("rej", "submitted", T["rej"], spec=SPEC)
    place("rej", T["rej"] - 1, "3")
    ev("rej", "rejected", T["rej"] - 2, host=HOST, reason="actuator_start_jobs is off")
    pub(JOB_EVENTS, "junk", b"{not json")  # a record no schema reads
    assert p.flush(20) == 0
    return broker.bootstrap, now


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


# -- phasewise jobs ---------------------------------------------------------------------------------------


def test_jobs_lists_each_job_with_its_state_host_use_progress_and_why(cluster, capsys):
    bootstrap, _now = cluster
    rc, out, err = run_cli(capsys, "jobs", "--bootstrap", bootstrap)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:7] == ["JOB", "STATE", "AGE", "CLASS", "PRI", "HOST", "CPUS"]
    rows = {ln.split()[0]: ln for ln in lines[1:] if ln.split()[0] in T}  # (other tests add jobs of their own)
    assert list(rows) == ["run", "done", "oom", "rej", "wait"]  # by submission
    assert rows["run"].split()[1:7] == ["running", rows["run"].split()[2], "training", "3", HOST, "0-1"]
    assert "1.5/1.25" in rows["run"] and "1Gi/512Mi" in rows["run"]  # predicted/used (mean of 6 samples)
    assert "loss 0.8 @900, acceptable 1 reached" in rows["run"]
    assert rows["oom"].split()[1] == "failed" and "OOM-killed in its memory limit" in rows["oom"]
    assert rows["done"].split()[1] == "finished" and rows["done"].endswith("exit code 0, ran 1m35s")
    assert rows["oom"].endswith("SIGKILL, OOM-killed, ran 58s: OOM-killed in its memory limit")
    assert rows["rej"].split()[1] == "rejected" and rows["rej"].endswith("actuator_start_jobs is off")
    assert rows["wait"].split()[1] == "waiting"
    assert "dead letter (phasewise.job-events.v1): no node takes job wait now" in rows["wait"]
    assert re.search(r"\d+ record\(s\) of phasewise.job-events.v1 do not decode", err)


def test_jobs_json_and_state_filter(cluster, capsys):
    bootstrap, now = cluster
    rc, out, err = run_cli(capsys, "jobs", "--json", "--bootstrap", bootstrap)
    assert rc == 0, err
    jobs = {j["job"]: j for j in json.loads(out)["jobs"] if j["job"] in T}
    assert {j: v["state"] for j, v in jobs.items()} == {
        "run": "running", "wait": "waiting", "oom": "failed", "done": "finished", "rej": "rejected"}
    run = jobs["run"]
    assert (run["host"], run["pid"], run["cpuset"], run["priority"]) == (HOST, 4321, "0-1", 3)
    assert run["observed"]["samples"] == 6 and run["observed"]["cpu_cores"] == pytest.approx(1.25)
    assert run["prediction"]["cpu_cores"] == {"mean": 1.5, "lo": 1.0, "hi": 2.0}
    assert run["targets"]["reached"] == "acceptable" and run["progress"]["step"] == 900
    assert run["since"] == pytest.approx(now - T["run"] + 4)
    assert jobs["oom"]["oom"] is True and jobs["oom"]["signal"] == "SIGKILL"
    assert "timeline" not in run
    rc, out, _ = run_cli(capsys, "jobs", "--json", "--state", "failed", "--state", "rejected", "--bootstrap", bootstrap)
    assert sorted(j["job"] for j in json.loads(out)["jobs"] if j["job"] in T) == ["oom", "rej"]


def test_describe_shows_the_timeline_with_ages_and_the_decisions(cluster, capsys):
    bootstrap, _now = cluster
    rc, out, err = run_cli(capsys, "jobs", "describe", "run", "--bootstrap", bootstrap)
    assert rc == 0, err
    assert re.search(r"^State: +running \(since (9m5\ds|1\dm\d*s?) ago\)$", out, re.M)  # started 596 s back
    assert "Runs on:      host node-a, container run, pid 4321" in out
    assert "Spec:         resnet18 on cifar10, batch 8; requests cpu 1 core, mem 1Gi" in out
    assert "observed over 6 samples" in out and "predicted by model v4" in out
    assert "Decisions:    place-run" in out
    events = out[out.index("Events:"):].splitlines()[1:]
    assert events[0].split() == ["AGE", "FROM", "KIND", "MESSAGE"]
    assert [ln.split()[1:3] for ln in events[1:]] == [
        ["job-events", "submitted"], ["predictions", "prediction"], ["decisions", "place"],
        ["actuations", "applied"], ["job-events", "started"], ["job-events", "progress"]]
    assert re.fullmatch(r"1\dm\d*s?", events[1].split()[0])  # submitted 600 s back


def test_describe_marks_what_changed_nothing_and_json_has_the_timeline(cluster, capsys):
    bootstrap, _now = cluster
    rc, out, err = run_cli(capsys, "jobs", "describe", "done", "--json", "--bootstrap", bootstrap)
    assert rc == 0, err
    d = json.loads(out)
    assert d["state"] == "finished" and d["run_s"] == 95.0  # the first finish by event time
    assert [(e["kind"], e["ignored"]) for e in d["timeline"]] == [
        ("submitted", None), ("started", None), ("finished", None), ("finished", "after finished")]
    rc, out, _ = run_cli(capsys, "jobs", "describe", "wait", "--bootstrap", bootstrap)
    assert "Why:          dead letter (phasewise.job-events.v1): no node takes job wait" in out
    assert "deadletters  dead letter" in out


def test_describe_of_an_unknown_job_and_bad_arguments(cluster, capsys):
    bootstrap, _now = cluster
    rc, _out, err = run_cli(capsys, "jobs", "describe", "nobody", "--bootstrap", bootstrap)
    assert rc == 1 and "no record names job 'nobody'" in err
    rc, _out, err = run_cli(capsys, "jobs", "describe", "--bootstrap", bootstrap)
    assert rc == 2 and err.strip() == "phasewise jobs: error: describe: which job? phasewise jobs describe JOB"
    rc, _out, err = run_cli(capsys, "jobs", "run", "--bootstrap", bootstrap)
    assert rc == 2 and err.strip() == "phasewise jobs: error: 'run': did you mean phasewise jobs describe run?"
    rc, _out, err = run_cli(capsys, "jobs", "--state", "sleeping", "--bootstrap", bootstrap)
    assert rc == 2 and "--state: unknown sleeping" in err


def test_a_state_not_signed_with_the_cluster_key_is_refused(broker, tmp_path, capsys, monkeypatch):
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(os.urandom(48).hex().encode())
    os.chmod(key_file, 0o600)
    ring = Keyring(key_file.read_bytes().strip())
    s = Settings.from_env({"bootstrap": broker.bootstrap, "host": "views-test"}, env={})
    ensure_topics(s)
    p = make_producer(s)
    now = time.time()
    started = encode(JobEvent(job="sig", ts=now - 5, kind="started", host=HOST, container="sig", pid=5))
    p.produce(JOB_EVENTS.name, key=b"sig", value=encode(JobEvent(job="sig", ts=now - 9, kind="submitted", spec=SPEC)))
    p.produce(JOB_EVENTS.name, key=b"sig", value=started, headers=ring.headers(JOB_EVENTS.name, b"sig", started))
    p.produce(JOB_EVENTS.name, key=b"sig", value=encode(JobEvent(job="sig", ts=now - 1, kind="finished", exit_code=0)))
    assert p.flush(20) == 0
    monkeypatch.setenv("PHASEWISE_SIGNING_KEY_FILE", str(key_file))
    rc, out, err = run_cli(capsys, "jobs", "describe", "sig", "--json", "--bootstrap", broker.bootstrap)
    assert rc == 0, err
    d = json.loads(out)
    assert d["state"] == "running"
    assert [(e["kind"], (e["ignored"] or "")[:8]) for e in d["timeline"]] == [
        ("submitted", ""), ("started", ""), ("finished", "refused:")]


def test_control_characters_in_records_reach_no_terminal(broker, capsys):
    s = Settings.from_env({"bootstrap": broker.bootstrap, "host": "views-test"}, env={})
    ensure_topics(s)
    p = make_producer(s)
    now = time.time()
    p.produce(JOB_EVENTS.name, key=b"esc", value=encode(JobEvent(job="esc", ts=now - 9, kind="submitted", spec=SPEC)))
    p.produce(JOB_EVENTS.name, key=b"esc", value=encode(JobEvent(job="esc", ts=now - 5, kind="rejected",
                                                                 host="h\x1b[2J", reason="bad\x1b]0;owned\x07\nline")))
    p.produce(JOB_EVENTS.name, key=b"\x1b[31mred", value=b"\x1b[31m")
    assert p.flush(20) == 0
    for args in (["jobs"], ["jobs", "describe", "esc"], ["tail", "job-events"]):
        rc, out, err = run_cli(capsys, *args, "--bootstrap", broker.bootstrap)
        assert rc == 0, err
        assert "\x1b" not in out and "\x07" not in out, args
    rc, out, _ = run_cli(capsys, "jobs", "describe", "esc", "--bootstrap", broker.bootstrap)
    assert "bad\\x1b]0;owned\\x07\\nline" in out


# -- phasewise tail ---------------------------------------------------------------------------------------


def test_tail_prints_decoded_records_by_key_and_the_undecodable_one_with_why(cluster, capsys):
    bootstrap, _now = cluster
    rc, out, err = run_cli(capsys, "tail", "job-events", "--key", "done", "--json", "--bootstrap", bootstrap)
    assert rc == 0, err
    recs = [json.loads(ln) for ln in out.splitlines()]
    assert [r["value"]["kind"] for r in recs] == ["submitted", "finished", "started", "finished"]  # as published
    assert {(r["topic"], r["key"]) for r in recs} == {(JOB_EVENTS.name, "done")}
    assert [r["offset"] for r in recs] == sorted(r["offset"] for r in recs)
    rc, out, err = run_cli(capsys, "tail", "job-events", "--key", "junk", "--bootstrap", bootstrap)
    assert rc == 0, err
    assert "key=junk UNDECODABLE (9 bytes): JobEvent: not valid JSON" in out
    rc, out, _ = run_cli(capsys, "tail", JOB_EVENTS.name, "--key", "junk", "--json", "--bootstrap", bootstrap)
    junk = json.loads(out)
    assert junk["error"].startswith("JobEvent: not valid JSON") and junk["payload"] == "{not json"


def test_tail_filters_on_dotted_fields_and_lists(cluster, capsys):
    bootstrap, _now = cluster
    rc, out, err = run_cli(capsys, "tail", "decisions", "--filter", "details.job=r*", "--filter", "action=place",
                           "--json", "--bootstrap", bootstrap)
    assert rc == 0, err
    assert sorted(json.loads(ln)["value"]["id"] for ln in out.splitlines()) == ["place-rej", "place-run"]
    rc, out, _ = run_cli(capsys, "tail", "samples", "--filter", "containers.container=run", "--filter",
                         "containers.cpu_cores=1.5", "--bootstrap", bootstrap)
    assert len(out.splitlines()) == 1 and '"cpu_cores":1.5' in out
    assert "null" not in out  # the text output leaves null fields out
    rc, out, err = run_cli(capsys, "tail", "job-events", "--filter", "oom=true", "--json", "--bootstrap", bootstrap)
    assert [json.loads(ln)["key"] for ln in out.splitlines()] == ["oom"]
    assert re.search(r"\d+ record\(s\) did not decode, so no --filter could match them", err)  # junk, and others'

    rc, _out, err = run_cli(capsys, "tail", "job-events", "--filter", "kind", "--bootstrap", bootstrap)
    assert rc == 2 and "--filter: 'kind' is not FIELD=VALUE" in err


def test_tail_reads_every_record_of_a_batch(broker, capsys):
    """The embedded broker reports a partition's high watermark as the first offset of its last batch + 1:
    read to the partition's end, not to that mark, every record of a batch is printed."""
    s = Settings.from_env({"bootstrap": broker.bootstrap, "host": "views-test"}, env={})
    ensure_topics(s)
    p = make_producer(s, **{"linger.ms": 200})  # one batch
    now = time.time()
    for step in range(50):
        p.produce(JOB_EVENTS.name, key=b"batch", value=encode(JobEvent(job="batch", ts=now, kind="progress",
                                                                        step=step, loss=1.0)))
    assert p.flush(20) == 0
    rc, out, err = run_cli(capsys, "tail", "job-events", "--key", "batch", "--json", "--bootstrap", broker.bootstrap)
    assert rc == 0, err
    assert [json.loads(ln)["value"]["step"] for ln in out.splitlines()] == list(range(50))


def test_tail_since(cluster, capsys):
    bootstrap, now = cluster
    rc, out, _ = run_cli(capsys, "tail", "predictions", "--since", "1h", "--bootstrap", bootstrap)
    assert rc == 0 and len(out.splitlines()) == 1
    later = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 3600))
    rc, out, _ = run_cli(capsys, "tail", "predictions", "--since", later, "--bootstrap", bootstrap)
    assert rc == 0 and out == ""
    rc, _out, err = run_cli(capsys, "tail", "predictions", "--since", "yesterday", "--bootstrap", bootstrap)
    assert rc == 2 and "--since: 'yesterday' is neither a duration" in err
    rc, _out, err = run_cli(capsys, "tail", "nonsense", "--bootstrap", bootstrap)
    assert rc == 2 and "unknown topic 'nonsense'; one of: samples, job-events" in err


def test_tail_follow_prints_new_records_until_interrupted(cluster):
    bootstrap, now = cluster
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    proc = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "tail", "job-events", "--follow", "--json",
                             "--key", "follow", "--bootstrap", bootstrap], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        s = Settings.from_env({"bootstrap": bootstrap, "host": "views-test"}, env={})
        p = make_producer(s)
        seen: list[dict] = []
        for step in (1, 2):
            p.produce(JOB_EVENTS.name, key=b"follow",
                      value=encode(JobEvent(job="follow", ts=now, kind="progress", step=step, loss=1.0)))
            assert p.flush(20) == 0
            deadline = time.monotonic() + 60
            while len(seen) < step:
                assert time.monotonic() < deadline, "no line from tail --follow within 60 s"
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if ready:
                    seen.append(json.loads(proc.stdout.readline()))
        assert [r["value"]["step"] for r in seen] == [1, 2]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- no broker, help ------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["jobs"], ["jobs", "describe", "x"], ["tail", "job-events"]])
def test_an_unreachable_broker_is_one_line(args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    env["PHASEWISE_BOOTSTRAP"] = f"127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "phasewise.cli", *args, "--timeout", "1"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"phasewise {args[0]}: no Kafka broker answered at 127.0.0.1:")


def test_help_imports_no_heavy_library():
    code = ("import sys\nfrom phasewise.cli import main\nfor role in ('jobs', 'tail'):\n"
            "    assert main([role, '--help']) == 0\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'faust', 'confluent_kafka', "
            "'river'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
    assert "describe JOB" in r.stdout and "--filter FIELD=VALUE" in r.stdout
