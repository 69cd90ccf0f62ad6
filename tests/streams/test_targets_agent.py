"""The targets agent on a real worker: limits, the objective's control and the hard stop through the broker,
bad records dead-lettered (the step itself: tests/models/jobs/test_targets_step.py)."""

from __future__ import annotations

import json

import pytest

from phasewise.kit.topics import CONTROL, DECISIONS
from tests.models.jobs.test_targets_step import BAD, progress, started, submitted


@pytest.mark.broker
@pytest.mark.slow
def test_the_worker_with_targets_through_the_broker(settings, tmp_path):
    import os
    import subprocess
    import sys
    import time
    import uuid

    from phasewise.kit.kafka.client import make_consumer, make_producer
    from phasewise.kit.topics import DEAD_LETTERS, JOB_EVENTS

    env = {**os.environ, "PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_TARGETS_ENABLED": "true",
           "PHASEWISE_TARGETS_PATIENCE": "1", "PHASEWISE_TARGETS_EWMA_ALPHA": "1", "PHASEWISE_TARGETS_GRACE_S": "1"}
    job = f"job-{uuid.uuid4().hex[:6]}"
    w = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "worker", "--web-port", "0", "--worker-id",
                          f"t-{uuid.uuid4().hex[:6]}", "--data-dir", str(tmp_path)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p = make_producer(settings)
        k = job.encode()
        now = time.time()
        p.produce(JOB_EVENTS.name, key=k, value=submitted(job, ts=now))
        p.produce(JOB_EVENTS.name, key=k, value=submitted(f"{job}-b", ts=now))  # short of acceptable beside it
        p.produce(JOB_EVENTS.name, key=k, value=started(job, host=f"node-{job}", ts=now))
        p.produce(JOB_EVENTS.name, key=k, value=started(f"{job}-b", host=f"node-{job}", ts=now))
        for raw, _ in BAD[:3]:
            p.produce(JOB_EVENTS.name, key=k, value=raw)
        for i, loss in enumerate([2.0, 0.9, 0.4], 1):
            p.produce(JOB_EVENTS.name, key=k, value=progress(job, i, loss, ts=now + i))
        p.flush(10)
        c = make_consumer(settings, f"t-{uuid.uuid4().hex[:8]}")
        c.subscribe([DECISIONS.name, CONTROL.name, DEAD_LETTERS.name])
        got: list[tuple[str, dict]] = []
        deadline = time.monotonic() + 90
        try:
            while time.monotonic() < deadline and len(got) < 6:
                m = c.poll(0.5)
                if m is None or m.error() or m.value() is None:
                    continue
                try:  # the topics hold other tests' records too, some of them not JSON on purpose
                    v = json.loads(m.value())
                except (ValueError, RecursionError):
                    continue
                if isinstance(v, dict) and (m.key() == k or v.get("container") == job):
                    got.append((m.topic(), v))
        finally:
            c.close()
        assert w.poll() is None, "the worker must keep running"
    finally:
        w.terminate()
        w.wait(30)
    kinds = sorted((t, v.get("action")) for t, v in got)
    assert kinds == sorted([(DECISIONS.name, "limit"), (CONTROL.name, "checkpoint_exit"),
                            (DECISIONS.name, "terminate")] + [(DEAD_LETTERS.name, None)] * 3), kinds
