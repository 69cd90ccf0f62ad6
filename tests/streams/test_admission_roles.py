"""The priority agent as the clock, the placement agent as the launcher: two real roles on a private broker.

``phasewise worker --priorities --priority-launcher place`` decides when (admission, checkpoint-and-stop,
freeze, resume order) and publishes admitted / stopped hints; ``phasewise place --place-after-admission``
(local mode: two cpuset slices of the host) places each admitted job on that host and starts it.
"""

from __future__ import annotations

import time
import uuid

import pytest

from phasewise.kit.records import DeadLetter, Decision, GpuSample, HostSamples, JobEvent, JobRequests, JobSpec, encode

pytestmark = [pytest.mark.broker, pytest.mark.slow]
GB = 1e9


def _submitted(job: str, ts: float, host: str, *, priority: int = 0, expected_s: float | None = None) -> bytes:
    spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32, expected_s=expected_s,
                   command=("python", "train.py", "--job", job),
                   requests=JobRequests(cpu_cores=2.0, mem_bytes=1 * GB))
    return encode(JobEvent(job=job, ts=ts, kind="submitted", host=host, priority=priority, spec=spec))


def test_the_priority_agent_decides_when_and_the_placement_agent_where(broker, tmp_path):
    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port
    from phasewise.kit.kafka.client import ensure_topics, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, SAMPLES
    from tests.test_poison import Reader, records

    settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(settings)
    tag = uuid.uuid4().hex[:6]
    host = f"adm-{tag}"
    low, hi, mid = f"{tag}-low", f"{tag}-hi", f"{tag}-mid"
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_PRIORITY_HOST_CPU_CORES": "2", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G",
           "PHASEWISE_PLACE_PREDICTION_WAIT_S": "0"}
    wport, pport = free_port(), free_port()
    worker = RoleProcess("worker", ["--priorities", "--priority-launcher", "place", "--priority-freeze-max-wait-s",
                                    "60", "--web-port", "0", "--worker-id", f"adm-{tag}", "--data-dir",
                                    str(tmp_path / "w"), "--metrics-port", str(wport), "--host", host],
                         env=env, log_path=tmp_path / "worker.log").start()
    place = RoleProcess("place", ["--place-after-admission", "--local-nodes", "s0=0-1;s1=2-3", "--place-id",
                                  f"adm-place-{tag}", "--data-dir", str(tmp_path / "p"), "--metrics-port", str(pport),
                                  "--host", host], env=env, log_path=tmp_path / "place.log").start()
    roles = (worker, place)

    def wait(pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for r in roles:
                assert r.alive(), f"{what}: a role died:\n{r.log_tail(60)}"
            if pred():
                return
            time.sleep(0.2)
        raise TimeoutError(f"no {what} within {timeout_s:.0f} s:\n" + "\n".join(r.log_tail(30) for r in roles))

    def ready(port: int, metric: str) -> bool:
        try:
            return scrape(f"http://127.0.0.1:{port}/metrics").get(metric) == 1.0
        except OSError:
            return False

    try:
        wait(lambda: ready(wport, "phasewise_worker_ready") and ready(pport, "phasewise_place_ready"), 90,
             "both roles ready")
        decisions = Reader(settings, DECISIONS.name, DECISIONS.partitions)
        letters = Reader(settings, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
        p = make_producer(settings)
        # this host as the placement agent's nodes: 4 CPUs, two slices of 2
        p.produce(SAMPLES.name, key=host.encode(), value=encode(HostSamples(
            host=host, ts=time.time(), interval_s=1.0, host_cpu_count=4, host_cpu_cores=0.0, host_mem_bytes=GB,
            host_mem_total_bytes=16 * GB, gpus=(GpuSample(index=0, uuid="GPU-0", util=0.0, mem_used_bytes=0,
                                                           mem_total_bytes=16 << 30),))))

        def mine() -> list[Decision]:
            return [d for d in records(Decision, decisions.drain()) if d.host == host]

        def of(policy: str) -> list[tuple]:
            return [(d.action, d.container) for d in mine() if (d.policy == "priority") == (policy == "priority")]

        def send(job: str, value: bytes) -> None:
            p.produce(JOB_EVENTS.name, key=job.encode(), value=value)
            p.flush(10)

        # low fits the priority agent's 2 cores: admitted, placed (with its slice) by the placement agent
        send(low, _submitted(low, 1, host))
        wait(lambda: ("place", low) in of("place"), 45, "low placed")
        # hi (priority 3, running time unknown) needs low's cores: low is checkpointed and stopped by the
        # priority agent, hi placed by the placement agent
        send(hi, _submitted(hi, 2, host, priority=3))
        wait(lambda: ("place", hi) in of("place") and ("terminate", low) in of("priority"), 45, "hi placed")
        # hi ends: the priority agent resumes low, the placement agent starts it with its resume command
        send(hi, encode(JobEvent(job=hi, ts=3, kind="finished")))
        wait(lambda: of("place").count(("place", low)) == 2, 45, "low resumed")
        # mid (priority 5, 30 s expected) freezes low: a frozen job keeps its slice, mid gets the other one
        send(mid, _submitted(mid, 4, host, priority=5, expected_s=30))
        wait(lambda: ("place", mid) in of("place") and ("freeze", low) in of("priority"), 45, "mid placed")

        ds = mine()
        placed = [d for d in ds if d.action == "place"]
        assert [d.container for d in placed] == [low, hi, low, mid]
        assert all(d.policy == "horus" and d.details["node"] in ("s0", "s1") for d in placed)  # none from priority
        assert all(d.details["cpuset"] == {"s0": "0-1", "s1": "2-3"}[d.details["node"]] for d in placed)
        assert all(d.details["spec"]["command"] == ["python", "train.py", "--job", d.container] for d in placed)
        assert all("command" not in d.details and d.details["job"] == d.container for d in placed)
        assert [d.details["resume"] for d in placed] == [False, False, True, False]
        assert len({d.id for d in placed}) == 4
        assert placed[3].details["node"] != placed[2].details["node"]  # frozen low kept its slice
        assert [(d.action, d.container) for d in ds if d.policy == "priority"] == [
            ("weight", low), ("terminate", low), ("weight", hi), ("weight", low), ("freeze", low), ("weight", mid)]
        for i, d in enumerate(ds):  # each start's weight follows its place decision (the placement agent's)
            if d.action == "place":
                w = next(x for x in ds[i + 1:] if x.action == "weight" and x.container == d.container)
                assert w.reason.endswith("; restarted" if d.details["resume"] else "; started"), w.reason
        terminate = next(d for d in ds if d.action == "terminate")
        assert terminate.details["mode"] == "checkpoint" and f"preempted by {hi}" in terminate.reason
        # the hints on the job events are nobody's dead letter
        assert not [dl for dl in records(DeadLetter, letters.drain()) if dl.source_topic == JOB_EVENTS.name]
        for r in (decisions, letters):
            r.close()
    finally:
        for r in roles:
            r.stop()
    for r in roles:
        assert r.returncode() == 0, r.log_tail(40)
    # no cluster key: each role says once, at start, that what it publishes is unsigned
    for r, says in ((place, "phasewise place: decisions are published unsigned: actuators with signing_key_file "
                            "set refuse them"),
                    (worker, "phasewise worker: decisions and hints are published unsigned: actuators and "
                             "placement workers with signing_key_file set refuse them")):
        assert r.log_path.read_text().count(says) == 1, r.log_tail(40)
