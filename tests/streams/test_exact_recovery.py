"""Exact recovery: a real worker SIGKILLed several times mid-stream decides, record by record,
what the same logic decides in process without a kill (``--policy vpa``, state written at every commit;
``--policy phase`` at the default write interval).

The run is :func:`phasewise.apps.bench.recovery.run_once` (``phasewise bench recovery`` repeats it):
240 ticks of 4 hosts x 6 containers produced while the worker is killed and restarted, every
distinct decision id published compared with the unkilled reference.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_three_sigkills_mid_stream_give_the_unkilled_run_s_decisions(broker, tmp_path):
    from phasewise.apps.bench.recovery import run_once
    from phasewise.kit.kafka.client import ensure_topics
    from phasewise.kit.settings import Settings

    ensure_topics(Settings.from_env({"bootstrap": broker.bootstrap}, env={}))
    r = run_once(broker.bootstrap, tmp_path, kills=3, state_write_interval_s=0.0)
    assert r["reference"] > 30  # the scenario decides enough to compare
    assert (r["missing"], r["extra"]) == (0, 0), r
    assert r["published"] == r["reference"], r


def test_the_phase_policy_recovers_exactly_at_the_default_write_interval(broker, tmp_path):
    """``--policy phase`` at the default settings: a container's VPA and phase states are written together
    (the VPA state's source offset holds for both), so the restarted worker skips what they hold and
    reads the rest again (tests/models/phases/test_phase_updater.py drives the same commit and restart
    in process). The run publishes no model snapshot: both runs decide with the starting model."""
    from phasewise.apps.bench.recovery import run_once
    from phasewise.kit.kafka.client import ensure_topics
    from phasewise.kit.settings import Settings

    ensure_topics(Settings.from_env({"bootstrap": broker.bootstrap}, env={}))
    r = run_once(broker.bootstrap, tmp_path, kills=3, state_write_interval_s=Settings().worker.state_write_interval_s,
                 usage="noisy", policy="phase")
    assert r["reference"] > 30  # the scenario decides enough to compare
    assert (r["missing"], r["extra"]) == (0, 0), r
    assert r["published"] == r["reference"], r


def test_with_snapshots_landing_between_kills_no_sample_is_decided_two_ways(broker, tmp_path):
    """``--policy phase`` with the learner publishing a snapshot every second: the detectors swap models only
    at commits that hand out every unwritten state, the version is recorded with them, and a restarted worker
    decides the samples it reads again with the recorded version (``ModelPin``). The reference keeps its
    starting model, so the measure is the samples decided two ways (before this, 85 and 95 in two runs of
    ``phasewise bench recovery --policy phase --runs 1 --kills 3 --usage noisy --snapshot-interval 1``)."""
    from phasewise.apps.bench.recovery import run_once
    from phasewise.kit.kafka.client import ensure_topics
    from phasewise.kit.settings import Settings

    ensure_topics(Settings.from_env({"bootstrap": broker.bootstrap}, env={}))
    r = run_once(broker.bootstrap, tmp_path, kills=3, state_write_interval_s=Settings().worker.state_write_interval_s,
                 usage="noisy", policy="phase", snapshot_interval_s=1.0)
    assert r["snapshots_published"] >= 2 and r["repeated"] > 30, r  # models swapped, samples decided again
    assert r["conflicting_samples"] == 0, r


@pytest.mark.parametrize("policy", ["vpa", "phase"])
def test_at_the_default_write_interval_no_offset_is_committed_past_a_sample_the_stored_state_lacks(
        broker, tmp_path, policy):
    """The guarantee itself: every sample below a committed offset is in its container's stored state (its
    ``so``), at ``state_write_interval_s`` 30 (the default), where steady containers are written only
    every 30 s of event time. A restarted worker reads the rest again. With ``--policy phase`` the
    container's phase state holds them too (written with its VPA state, the same ``so``). A partition that goes
    quiet has its last samples committed once their states are written."""
    import json
    import time
    import uuid

    from confluent_kafka import Consumer, TopicPartition

    from phasewise.apps.bench.harness import scrape, wait_until
    from phasewise.kit.broker import free_port
    from phasewise.kit.kafka.client import ensure_topics, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.records import ContainerSample, HostSamples, encode
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import SAMPLES
    from tests.streams.test_expiry_worker import changelog_records

    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    host, worker_id, port = f"hold-{uuid.uuid4().hex[:6]}", f"hold-{uuid.uuid4().hex[:6]}", free_port()
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_WORKER_ID": worker_id, "PHASEWISE_WEB_PORT": "0",
           "PHASEWISE_METRICS_PORT": str(port), "PHASEWISE_DATA_DIR": str(tmp_path / "w"),
           "PHASEWISE_VPA_TIME_SCALE": "0.001", "PHASEWISE_WORKER_HOSTS": host, "PHASEWISE_POLICY": policy}
    w = RoleProcess("worker", [], env=env, log_path=tmp_path / "worker.log").start()
    metrics = f"http://127.0.0.1:{port}/metrics"
    p = make_producer(s)
    t0 = time.time() - 300

    def send(ticks) -> None:
        for t in ticks:
            p.produce(SAMPLES.name, key=host.encode(), value=encode(HostSamples(
                host=host, ts=t0 + t, interval_s=1.0, containers=tuple(
                    ContainerSample(container=f"c{c}", cpu_cores=0.5 + 0.1 * c, mem_bytes=3e8, cpu_limit_cores=4.0,
                                    mem_limit_bytes=8e9, nr_periods=10) for c in range(3)))))
        p.flush(10)

    def processed() -> float:
        try:
            return scrape(metrics).get("phasewise_worker_container_samples_total", 0.0)
        except OSError:
            return 0.0

    def ours() -> tuple[int, list[int]]:
        """The partition of this test's host and the offsets of its messages there (the broker holds others')."""
        rows = changelog_records(s, SAMPLES.name, with_positions=True)
        mine = [(q, o) for k, _v, q, o in rows if k == host]
        return mine[0][0], [o for _q, o in mine]

    def check() -> int:
        """Every sample of this host below the committed offset is in each container's stored state (its
        ``so``, the offset it learned last, at least the highest of them); returns the committed offset."""
        part, offsets = ours()
        c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": worker_id})
        try:
            (tp,) = c.committed([TopicPartition(SAMPLES.name, part)], timeout=10)
        finally:
            c.close()
        below = [o for o in offsets if o < tp.offset]
        for table in ("vpa-state", "phase-state") if policy == "phase" else ("vpa-state",):
            state = {k: json.loads(v) for k, v in changelog_records(s, f"{worker_id}-{table}-changelog") if v}
            for k in (f"{host}/c{i}" for i in range(3)):  # each message holds every container
                so = state[k].get("so") if k in state else None
                assert not below or (so is not None and so >= below[-1]), (table, k, so, tp.offset, below[-3:],
                                                                             w.log_tail())
        return len(below)

    try:
        wait_until(lambda: w.alive() and scrape_ready(metrics), 150, 0.2, "the worker ready")
        # 20 s of event time: no container reaches its 30-s write; in two bursts with a commit between
        # (the phase detector writes a container it sees first at once: one burst would be written whole)
        send(range(10))
        wait_until(lambda: processed() >= 30, 60, 0.2, "the first 10 ticks processed")
        time.sleep(4)  # a commit interval
        send(range(10, 20))
        wait_until(lambda: processed() >= 60, 60, 0.2, "the first 20 ticks processed")
        time.sleep(8)  # several commit intervals
        first = check()
        send(range(20, 60))  # past 30 s: every container's state is written, the commits move on
        wait_until(lambda: processed() >= 180, 60, 0.2, "the next 40 ticks processed")
        deadline = time.monotonic() + 60
        while (last := check()) <= first and time.monotonic() < deadline:
            time.sleep(1.0)
        assert last > first, "no commit after the containers' states were written"
        # tick 60 is written (30 s after the last write); tick 61, a commit later, is not due: its offset is
        # held back. Then the host goes quiet: within state_write_interval_s (of wall time) its state is
        # written and that offset committed, with no new record on the partition to carry it.
        send([60])
        wait_until(lambda: processed() >= 183, 60, 0.2, "tick 60 processed")
        time.sleep(4)  # a commit interval
        send([61])
        wait_until(lambda: processed() >= 186, 60, 0.2, "tick 61 processed")
        deadline = time.monotonic() + 120
        while (last := check()) < 62 and time.monotonic() < deadline:
            time.sleep(2.0)
        assert last == 62, f"the quiet partition's last sample was never committed ({last} of 62)"
    finally:
        w.stop()


def scrape_ready(url: str) -> bool:
    from phasewise.apps.bench.harness import scrape

    try:
        return scrape(url).get("phasewise_worker_ready") == 1.0
    except OSError:
        return False
