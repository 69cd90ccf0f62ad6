"""Containers that stop sending samples are forgotten after a time to live (event time)."""

from __future__ import annotations

import numpy as np

from phasewise.kit.records import ContainerSample, HostSamples
from phasewise.kit.settings import Settings
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.fleet import PhaseFleet
from phasewise.models.vpa.updater import process_host_samples
from phasewise.streams.config import state_cache, updater_config


def msg(ts: float, names: list[str]) -> HostSamples:
    cs = tuple(ContainerSample(container=n, cpu_cores=0.5 + 0.1 * i, mem_bytes=5e8 + 1e7 * i,
                               cpu_limit_cores=2.0, mem_limit_bytes=4e9) for i, n in enumerate(names))
    return HostSamples(host="h", ts=ts, interval_s=1.0, containers=cs)


def test_the_vpa_cache_expires_containers_not_seen_since_the_cutoff_and_reuses_their_rows():
    s = Settings.from_env({"recommend_interval_s": 1, "vpa_time_scale": 0.001}, env={})
    cache = state_cache(s)
    for t in range(10):
        process_host_samples(cache, msg(1000.0 + t, ["a", "b", "c"]), updater_config(s))
    for t in range(10, 20):  # "b" stopped
        process_host_samples(cache, msg(1000.0 + t, ["a", "c"]), updater_config(s))
    rows_before = cache.fleet._rows
    assert cache.expire(1015.0) == ["h/b"]
    assert "h/b" not in cache and "h/a" in cache and len(cache) == 2
    assert "h/b" not in {k for k, _ in cache.pop_dirty()}
    # a new container takes the freed row, with fresh state
    process_host_samples(cache, msg(1020.0, ["a", "c", "d"]), updater_config(s))
    assert cache.fleet._rows == rows_before
    assert cache.get("h/d").model.samples == 1
    # nothing newer than the cutoff goes
    assert cache.expire(1015.0) == []


def test_an_expired_container_that_comes_back_starts_fresh_unless_its_table_entry_remains():
    s = Settings.from_env({"recommend_interval_s": 1, "vpa_time_scale": 0.001}, env={})
    table: dict[str, dict] = {}
    cache = state_cache(s, loader=table.get)
    for t in range(5):
        process_host_samples(cache, msg(100.0 + t, ["a"]), updater_config(s))
    table.update(cache.pop_dirty() or [("h/a", cache.state_of("h/a"))])
    assert cache.expire(200.0) == ["h/a"]
    process_host_samples(cache, msg(201.0, ["a"]), updater_config(s))
    assert cache.loaded == 1  # the caller did not delete the table entry: it is reloaded
    for k in cache.expire(300.0):
        table.pop(k, None)
    process_host_samples(cache, msg(301.0, ["a"]), updater_config(s))
    assert cache.get("h/a").model.samples == 1 and cache.loaded == 1


def test_the_phase_fleet_expires_containers_by_their_newest_step():
    m = PhaseModel(features=("cpu", "mem"), n_hid=6, n_his=2, warmup=32, seed=0)
    fleet = PhaseFleet(m, learn_every=1, min_phase_samples=5)
    fb = np.array([[4.0, 8e9]] * 3)
    for t in range(30):
        fleet.step(float(t), ["a", "b", "c"], np.array([[0.5, 5e8], [1.0, 9e8], [0.2, 2e8]]), fallback_limits=fb)
    for t in range(30, 40):
        fleet.step(float(t), ["a", "c"], np.array([[0.5, 5e8], [0.2, 2e8]]), fallback_limits=fb[:2])
    assert fleet.expire(35.0) == ["b"]
    assert "b" not in fleet and len(fleet) == 2
    assert fleet.expire(35.0) == []
    # the freed row serves a new container, which starts with an empty window
    out = fleet.step(40.0, ["a", "c", "d"], np.array([[0.5, 5e8], [0.2, 2e8], [3.0, 3e9]]), fallback_limits=fb)
    assert "d" in fleet and not out.from_phase[2].any()
    assert fleet.expire(40.0) == []  # a container stepped at the cutoff stays


def test_a_host_whose_clock_runs_ahead_does_not_expire_the_other_hosts_containers():
    import dataclasses

    from prometheus_client import CollectorRegistry

    from phasewise.streams.agents.samples import Expiry
    from phasewise.streams.metrics import WorkerMetrics
    from phasewise.streams.output import CommitBarrier, OutputSender

    class Table:  # the Faust table's surface Expiry uses
        data: dict = {}

    s = Settings.from_env({"recommend_interval_s": 1, "vpa_time_scale": 0.001}, env={})
    cache = state_cache(s)
    barrier = CommitBarrier(OutputSender(producer=None))
    writes = barrier.table(Table())
    now = [1000.0]
    expiry = Expiry(100.0, cache, Table(), writes, barrier.partitions, None, WorkerMetrics(CollectorRegistry()),
                    clock=lambda: now[0])
    for t in range(5):
        m = msg(995.0 + t, ["a"])
        process_host_samples(cache, m, updater_config(s))
        expiry.after("h", m.ts)
    ahead = dataclasses.replace(msg(1000.0 + 10 * 86400, ["x"]), host="fast")  # 10 days ahead, TTL 100 s
    barrier.partitions.note("fast", 0)
    barrier.partitions.note("h", 0)
    process_host_samples(cache, ahead, updater_config(s))
    assert expiry.after("fast", ahead.ts) == [] and "h/a" in cache  # counted as now, not 10 days on
    now[0] = 1200.0  # but real time passing does expire a container that stopped
    assert expiry.after("h", 1200.0) == ["h/a"]
