"""The shipped example job files (examples/jobs/): each parses, and ``phasewise submit`` publishes it signed.

docs/placement.md's "A local run, end to end" submits them; here each is submitted with a submitter
key to the module's broker and read back as the ``submitted`` event a trusted actuator would start,
and its command runs to the end on this machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.horus.submit import job_event, read_file
from phasewise.kit.job_signing import SubmitterKeys
from phasewise.kit.kafka.client import make_consumer
from phasewise.kit.records import JobEvent, SchemaError, decode
from phasewise.kit.topics import JOB_EVENTS
from tests.job_keys import KEY, write_private

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "jobs").glob("*.json"))


def test_there_are_examples():
    assert [p.name for p in EXAMPLES] == ["train-small.json"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_parses_and_its_command_runs(path):
    ev = job_event(read_file(path))
    assert ev.kind == "submitted" and ev.spec is not None and ev.spec.command
    assert ev.spec.requests.cpu_cores is not None and ev.spec.requests.mem_bytes is not None
    r = subprocess.run(list(ev.spec.command), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(" phase=train step=" in x for x in lines) and "phase=done" in lines[-1]


@pytest.mark.broker
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_submit_publishes_an_example_signed(path, settings, tmp_path):
    key = write_private(tmp_path / "alice")
    job = f"{path.stem}-{uuid.uuid4().hex[:6]}"
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "phasewise.cli", "submit", "--bootstrap",
                        settings.kafka.bootstrap, "--key", str(key), "--job", job, str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"submitted {job}" in r.stdout + r.stderr
    c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
    c.assign([TopicPartition(JOB_EVENTS.name, p, OFFSET_BEGINNING) for p in range(JOB_EVENTS.partitions)])
    got = None
    try:
        for _ in range(100):
            for m in c.consume(500, 0.2):
                if m.error() or m.key() != job.encode():
                    continue
                try:
                    got = decode(JobEvent, m.value())
                except SchemaError:
                    continue
            if got is not None:
                break
    finally:
        c.close()
    assert got is not None and got.kind == "submitted"
    assert SubmitterKeys.of([KEY.public_key()]).verify_event(got) is None  # a trusted actuator starts it
    assert got.spec.command == tuple(json.loads(path.read_text())["command"])
