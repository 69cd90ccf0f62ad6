"""The priority agent: job events -> freeze / thaw / terminate decisions and controls; poison -> dead letters."""

from __future__ import annotations

import json
import uuid

import pytest

from phasewise.models.priorities import Capacity, PriorityConfig
from phasewise.schemas import (
    Decision,
    JobControl,
    JobEvent,
    JobRequests,
    JobSpec,
    SchemaError,
    encode,
    to_dict,
)
from phasewise.streams.priority_agents import PriorityStep, Refused
from tests.conftest import private_broker_fixture
from tests.test_poison import poison

broker = private_broker_fixture()  # job events from other tests would change the placements

GB = 1e9


def submitted(job: str, ts: float, *, cpu: float, priority: int = 0, expected_s: float | None = None,
              host: str | None = "n1", workload: str = "training") -> bytes:
    spec = JobSpec(model="resnet50", dataset="cifar10", batch_size=32, expected_s=expected_s,
                   requests=JobRequests(cpu_cores=cpu, mem_bytes=1 * GB))
    return encode(JobEvent(job=job, ts=ts, kind="submitted", host=host, priority=priority, workload=workload,
                           spec=spec))


def finished(job: str, ts: float) -> bytes:
    return encode(JobEvent(job=job, ts=ts, kind="finished"))


JOB_POISON = poison(to_dict(JobEvent(job="p", ts=1.0, kind="submitted")), "ts",
                    {"priority": "high", "workload": 3}, wrong_reason="must be")


def valid_stream(prefix: str = "", host: str = "n1") -> list[bytes]:
    return [submitted(f"{prefix}low", 1, cpu=2, host=host),
            submitted(f"{prefix}hi", 2, cpu=1, priority=5, expected_s=30, host=host),
            submitted(f"{prefix}infer", 3, cpu=1, priority=9, workload="inference", host=host),
            finished(f"{prefix}hi", 50), finished(f"{prefix}infer", 60)]


#: low starts; hi (short) freezes it; infer fits beside hi; hi ends (low needs 2 cores, 1 is free: waits);
#: infer ends: low thawed
EXPECTED = [("place", "low"), ("freeze", "low"), ("place", "hi"), ("place", "infer"), ("thaw", "low")]


def step() -> PriorityStep:
    return PriorityStep(PriorityConfig(freeze_max_wait_s=60, grace_s=20), Capacity(2, 8 * GB), "n1")


def run(s: PriorityStep, records: list) -> tuple[list[Decision], list[JobControl], list[str]]:
    ds, cs, bad = [], [], []
    for r in records:
        try:
            d, c = s.handle(r)
        except (SchemaError, Refused) as e:
            bad.append(str(e))
            continue
        ds += d
        cs += c
    return ds, cs, bad


def test_valid_events_give_the_policy_s_decisions_in_order():
    ds, cs, bad = run(step(), valid_stream())
    assert bad == [] and cs == []
    assert [(d.action, d.container) for d in ds] == EXPECTED
    assert all(d.policy == "priority" and d.host == "n1" for d in ds)


def test_checkpoint_and_stop_sends_a_checkpoint_exit_control():
    s = step()
    ds, cs, bad = run(s, [submitted("low", 1, cpu=2), submitted("hi", 2, cpu=2, priority=1)])
    assert [(d.action, d.container, d.details.get("mode")) for d in ds] == [
        ("place", "low", None), ("terminate", "low", "checkpoint"), ("place", "hi", None)]
    assert [(c.job, c.action, c.grace_s) for c in cs] == [("low", "checkpoint_exit", 20.0)]
    ds, cs, bad = run(s, [finished("hi", 9)])
    assert [(d.action, d.container, d.details["resume"]) for d in ds] == [("place", "low", True)]


def test_poison_between_valid_records_is_refused_with_reasons_and_nothing_valid_is_lost():
    records = []
    valid = valid_stream()
    kinds = list(JOB_POISON)
    for i, v in enumerate(valid):
        records.append(v)
        records.append(JOB_POISON[kinds[i % len(kinds)]][0])
    records += [JOB_POISON[k][0] for k in kinds]
    no_spec = encode(JobEvent(job="nospec", ts=4, kind="submitted"))
    records += [no_spec, submitted("low", 70, cpu=1)]  # a second submission of a known job
    ds, cs, bad = run(step(), records)
    ref_ds, _, _ = run(step(), valid)
    assert ds == ref_ds
    assert len(bad) == len(valid) + len(kinds) + 2
    for k in kinds:
        assert any(JOB_POISON[k][1] in b for b in bad), k
    assert "carries no spec" in bad[-2] and "already submitted" in bad[-1]


def test_events_of_other_kinds_change_nothing():
    s = step()
    run(s, [submitted("a", 1, cpu=1)])
    before = s.policy.to_state()
    ds, cs, bad = run(s, [encode(JobEvent(job="a", ts=2, kind="progress", step=3, loss=0.5)),
                          encode(JobEvent(job="a", ts=2, kind="started", host="n1", container="a"))])
    assert (ds, cs, bad) == ([], [], []) and s.policy.to_state() == before


# ------------------------------------------------------------------------------------- a real worker


@pytest.mark.broker
@pytest.mark.slow
def test_a_real_worker_with_priorities_decides_every_valid_event_and_dead_letters_every_poison(broker, tmp_path):
    from phasewise.kafka import ensure_topics, make_producer
    from phasewise.procs import RoleProcess
    from phasewise.settings import Settings
    from phasewise.topics import CONTROL, DEAD_LETTERS, DECISIONS, JOB_EVENTS
    from tests.test_poison import Reader, Sent, dead_letters, records, wait

    settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(settings)
    tag = uuid.uuid4().hex[:6]
    host = f"prio-{tag}"
    from phasewise.bench.harness import scrape
    from phasewise.infra.broker import free_port

    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_PRIORITY_HOST_CPU_CORES": "2", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G"}
    args = ["--priorities", "--priority-freeze-max-wait-s", "60", "--priority-grace-s", "20", "--web-port", "0",
            "--worker-id", f"prio-{tag}", "--data-dir", str(tmp_path / "data"), "--metrics-port", str(port),
            "--host", host]
    role = RoleProcess("worker", args, env=env, log_path=tmp_path / "worker.log").start()
    try:
        wait(lambda: _ready(scrape, port), 90, "worker ready", role)
        decisions = Reader(settings, DECISIONS.name, DECISIONS.partitions)
        letters = Reader(settings, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
        controls = Reader(settings, CONTROL.name, CONTROL.partitions)
        sent = Sent(make_producer(settings), JOB_EVENTS.name)
        kinds = list(JOB_POISON)
        # one key for all: one partition, so the events keep their order
        for i, v in enumerate(valid_stream(f"{tag}-", host=host)):
            sent.send(tag.encode(), v, f"valid:{i}")
            sent.send(tag.encode(), JOB_POISON[kinds[i % len(kinds)]][0], f"poison:{kinds[i % len(kinds)]}")
        for k in kinds[len(valid_stream()):]:
            sent.send(tag.encode(), JOB_POISON[k][0], f"poison:{k}")
        # big (unknown duration) needs low's 2 cores: low is checkpointed and stopped
        sent.send(tag.encode(), submitted(f"{tag}-big", 101, cpu=2, priority=3, host=host), "valid:big")
        sent.p.flush(10)

        def mine() -> list[Decision]:
            return [d for d in records(Decision, decisions.drain()) if d.host == host]

        wait(lambda: len(mine()) >= len(EXPECTED) + 2, 60, "every priority decision", role)
        got = [(d.action, d.container.removeprefix(f"{tag}-")) for d in mine()]
        assert got == [*EXPECTED, ("terminate", "low"), ("place", "big")]
        wait(lambda: any(c.job == f"{tag}-low" and c.action == "checkpoint_exit"
                         for c in records(JobControl, controls.drain())), 30, "the checkpoint_exit control", role)
        poisoned = sent.where("poison:")
        wait(lambda: set(poisoned) <= set(dead_letters(letters.drain(), JOB_EVENTS.name)), 30,
             "every dead letter", role)
        dl = dead_letters(letters.values, JOB_EVENTS.name)
        for at, label in poisoned.items():
            assert JOB_POISON[label.split(":")[1]][1] in dl[at].reason, (label, dl[at].reason)
        assert role.alive()
        for r in (decisions, letters, controls):
            r.close()
    finally:
        role.stop()
    assert role.returncode() == 0, role.log_tail(40)


def _ready(scrape, port) -> bool:
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0
    except OSError:
        return False


def test_the_records_are_json():  # the fixtures' own sanity: valid events parse as JSON objects
    assert all(isinstance(json.loads(v), dict) for v in valid_stream())
