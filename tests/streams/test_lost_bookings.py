"""``phasewise place`` releases a booking no actuator reports on (docs/jobs.md, "Who frees what"): with no
actuator running and ``job_start_timeout_s`` 3 s, each placed job is lost in turn: a ``lost`` job event
signed with the cluster key, a dead letter of kind ``lost`` holding its submitted event, the counter; the
job that waited takes the freed slice. States that change nothing are counted by why."""

from __future__ import annotations

import time
import uuid

import pytest

from phasewise.kit.records import DeadLetter, Decision, JobEvent, JobRequests, JobSpec, decode, encode
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, SAMPLES
from tests.test_job_trust_roles import Run, Topics, _key, _sample

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def _submitted(job: str) -> bytes:
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=8, requests=JobRequests(cpu_cores=1.0))
    return encode(JobEvent(job=job, ts=time.time(), kind="submitted", spec=spec))


def test_a_placed_job_no_actuator_starts_is_lost_and_its_slice_goes_to_the_next(broker, tmp_path):
    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port

    tag = uuid.uuid4().hex[:6]
    run = Run(broker, tmp_path, f"lost-{tag}")
    key_file, ring = _key(tmp_path)
    topics = Topics(run.settings, JOB_EVENTS, DECISIONS, DEAD_LETTERS)
    pport = free_port()
    first, second = f"a-{tag}", f"b-{tag}"
    try:
        run.start("place", ["--local-nodes", "s0=0", "--place-id", f"lost-{tag}", "--data-dir", str(tmp_path / "p"),
                            "--metrics-port", str(pport)],
                  {"PHASEWISE_SIGNING_KEY_FILE": str(key_file), "PHASEWISE_PLACE_PREDICTION_WAIT_S": "0",
                   "PHASEWISE_JOB_START_TIMEOUT_S": "3"})
        run.wait(lambda: run.ready(pport, "phasewise_place_ready"), 120, "place ready")
        run.send(SAMPLES, run.host, _sample(run))
        run.send(JOB_EVENTS, first, _submitted(first))
        run.send(JOB_EVENTS, second, _submitted(second))

        def events(kind: str) -> dict[str, tuple[JobEvent, bytes, bytes, list]]:
            topics.drain()
            out = {}
            for k, v, h in topics.got[JOB_EVENTS.name]:
                ev = decode(JobEvent, v)
                if ev.kind == kind:
                    out[ev.job] = (ev, k, v, h)
            return out

        run.wait(lambda: {first, second} <= set(events("lost")), 120, "both jobs lost in turn")
        lost = events("lost")
        for job in (first, second):
            ev, k, v, h = lost[job]
            assert ring.verify(JOB_EVENTS.name, k, v, h) is None  # signed with the cluster key
            assert ev.reason.startswith("no sign of life: no started event within job_start_timeout_s 3 s of its "
                                        "place decision at ") and " on s0; its booking is released" in ev.reason
        placed = [d for d in topics.records(Decision, DECISIONS) if d.action == "place" and d.host == run.host]
        # the two submissions may sit in different partitions: either is placed first, the other only once
        # the first one's slice was released
        assert sorted(d.container for d in placed) == sorted([first, second])
        assert placed[1].ts >= lost[placed[0].container][0].ts
        letters = [dl for dl in topics.records(DeadLetter, DEAD_LETTERS) if dl.source_topic == JOB_EVENTS.name]
        assert sorted(dl.key for dl in letters) == sorted([first, second])
        assert all(dl.reason.startswith(f"job {dl.key} lost: no sign of life") for dl in letters)
        assert all(decode(JobEvent, dl.payload.encode()).kind == "submitted" for dl in letters)
        # a started event after the end changes nothing; it is counted
        late = encode(JobEvent(job=first, ts=time.time(), kind="started", host=run.host, container=first))
        run.send(JOB_EVENTS, first, late, headers=ring.headers(JOB_EVENTS.name, first.encode(), late))

        def metrics() -> dict:
            return scrape(f"http://127.0.0.1:{pport}/metrics")

        run.wait(lambda: metrics().get('phasewise_place_job_states_ignored_total{why="after_end"}') == 1.0, 60,
                 "the late started counted")
        m = metrics()
        assert m.get("phasewise_place_jobs_lost_total") == 2.0 and m.get("phasewise_place_waiting_jobs") == 0.0
        assert m.get('phasewise_place_dead_letters_total{kind="lost"}') == 2.0
    finally:
        topics.close()
        run.close()
