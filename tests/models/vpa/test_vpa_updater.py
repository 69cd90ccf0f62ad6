"""The VPA updater without Faust: process_host_samples and its cache."""

from __future__ import annotations

import json

import pytest

from phasewise.kit.records import ContainerSample, Decision, HostSamples, decode, encode
from phasewise.kit.settings import Settings
from phasewise.models.decisions import decision_id
from phasewise.models.vpa.histogram import ExponentialBuckets
from phasewise.models.vpa.state import StateCache
from phasewise.models.vpa.updater import POLICY, process_host_samples
from phasewise.streams.config import state_cache, updater_config

CPU = ExponentialBuckets(0.01, 1.05, 1000.0)
T0 = 1.7e9


def settings(**kw) -> Settings:
    """Hysteresis mode: these tests pin the timing and hysteresis mechanics (bounds mode below) of the
    VPA's own decisions, so the safety rules are off (tests/models/safety/test_safety_rules.py has them on)."""
    return Settings.from_env({"recommend_interval_s": 5.0, "hysteresis": 0.1, "vpa_time_scale": 0.001,
                              "vpa_update_mode": "hysteresis", "safety_rules": False, **kw}, env={})


def msg(ts: float, *containers: ContainerSample, host: str = "h1") -> HostSamples:
    return HostSamples(host=host, ts=ts, interval_s=1.0, containers=containers)


def c(name: str = "job", cpu: float = 0.5, mem: float = 4e8, cpu_limit: float | None = 2.0,
      mem_limit: float | None = 4e9, **kw) -> ContainerSample:
    return ContainerSample(container=name, cpu_cores=cpu, mem_bytes=mem, cpu_limit_cores=cpu_limit,
                           mem_limit_bytes=mem_limit, **kw)


def run(cache: StateCache, s: Settings, seconds: int, **kw) -> list[Decision]:
    out = []
    for i in range(seconds):
        out += process_host_samples(cache, msg(T0 + i, c(**kw)), updater_config(s))
    return out


def test_the_first_recommendation_comes_one_interval_after_the_first_sample():
    s = settings()
    cache = state_cache(s)
    assert run(cache, s, 5) == []  # t = 0..4: not yet
    (d,) = process_host_samples(cache, msg(T0 + 5, c()), updater_config(s))
    assert d.ts == T0 + 5 and d.policy == "vpa" and d.action == "limit" and d.host == "h1"
    target = CPU.start(CPU.find_bucket(0.5) + 1) * 1.15
    assert d.cpu_limit_cores == pytest.approx(target, abs=1e-3) and d.cpu_limit_cores >= target  # rounded up
    assert d.details["cpu_samples"] == 6 and d.details["previous"] == {"cpu": 2.0, "mem": 4e9}
    assert decode(Decision, encode(d)) == d  # JSON-safe: an infinite bound would not encode


def test_no_decision_while_the_target_stays_within_the_hysteresis():
    s = settings()
    cache = state_cache(s)
    first = run(cache, s, 30)
    assert len(first) == 1  # decided at t=5; the same usage keeps the same target
    # observed limit equal to the target: nothing to decide either
    cache2 = state_cache(s)
    target = first[0].cpu_limit_cores
    (only,) = run(cache2, s, 30, cpu_limit=target)
    assert only.cpu_limit_cores is None and only.mem_limit_bytes == first[0].mem_limit_bytes


def test_only_the_resource_that_moved_is_in_the_decision():
    s = settings()
    cache = state_cache(s)
    mem_target = run(cache, s, 6)[0].mem_limit_bytes
    cache2 = state_cache(s)
    (d,) = run(cache2, s, 6, mem_limit=mem_target)
    assert d.cpu_limit_cores is not None and d.mem_limit_bytes is None
    assert "cpu 2 ->" in d.reason and "mem" not in d.reason


def test_an_unlimited_container_gets_limits():
    s = settings()
    (d,) = run(state_cache(s), s, 6, cpu_limit=None, mem_limit=None)
    assert d.cpu_limit_cores and d.mem_limit_bytes and "unlimited" in d.reason


def test_a_usage_jump_beyond_the_hysteresis_gives_a_new_decision():
    s = settings()
    cache = state_cache(s)
    first = run(cache, s, 10)
    later = []
    for i in range(10, 20):
        later += process_host_samples(cache, msg(T0 + i, c(cpu=1.5)), updater_config(s))
    assert len(first) == 1 and later
    assert later[0].cpu_limit_cores > 1.5 and later[0].details["previous"]["cpu"] == first[0].cpu_limit_cores


def test_decision_ids_are_deterministic_so_replays_are_idempotent():
    s = settings()
    a = run(state_cache(s), s, 12)
    b = run(state_cache(s), s, 12)
    assert [d.id for d in a] == [d.id for d in b]
    assert decision_id(POLICY, "h", "c", 1.0, None, 5.0) != decision_id(POLICY, "h", "c", 1.0, None, 6.0)


def test_state_is_persisted_on_decisions_and_at_the_write_interval_and_restores_through_the_loader():
    s = settings(state_write_interval_s=10.0)
    cache = state_cache(s)
    written: dict[str, bytes] = {}
    writes: list[tuple[int, str]] = []
    for i in range(27):
        process_host_samples(cache, msg(T0 + i, c(), c("other")), updater_config(s))
        for k, state in cache.pop_dirty():
            written[k] = json.dumps(state).encode()
            writes.append((i, k))
    # steps every 5 s: t=5 decides (write), t=10 no (5 s < 10), t=15 write, t=20 no, t=25 write
    assert [i for i, k in writes if k == "h1/job"] == [5, 15, 25]
    assert {k for _, k in writes} == {"h1/job", "h1/other"}
    # a restarted worker: empty cache, table as loader; learning continues where it was
    fresh = state_cache(s, loader=lambda k: json.loads(written[k]) if k in written else None)
    process_host_samples(fresh, msg(T0 + 27, c()), updater_config(s))
    assert fresh.loaded == 1 and fresh.get("h1/job").model.samples == 26 + 1  # written at t=25
    assert fresh.get("h1/job").decided_cpu == cache.get("h1/job").decided_cpu


def test_a_corrupt_stored_state_is_discarded_not_fatal():
    s = settings()
    cache = state_cache(s, loader=lambda k: {"v": 99})
    assert process_host_samples(cache, msg(T0, c()), updater_config(s)) == []
    assert cache.load_errors == 1 and cache.get("h1/job").model.samples == 1


def test_a_throttled_container_gets_a_higher_limit():
    s = settings()
    (d,) = run(state_cache(s), s, 6, cpu=0.25, cpu_limit=0.25, nr_periods=10,
               throttled_periods=10)
    assert d.cpu_limit_cores > 0.25 * 1.5  # recorded at limit * 1.5, plus the margin
    assert d.details["throttled_samples"] == 6



def test_a_throttled_spinner_is_released_to_its_demand_in_one_step():
    s = settings()
    # 1 core of demand under a 0.25-core quota: 0.25 used, 0.75 s throttled per second
    (d,) = run(state_cache(s), s, 6, cpu=0.25, cpu_limit=0.25, nr_periods=10,
               throttled_periods=10, throttled_s=0.75)
    assert d.cpu_limit_cores == pytest.approx(CPU.start(CPU.find_bucket(1.0) + 1) * 1.15, abs=1e-3)


def test_in_bounds_mode_little_history_never_cuts_a_limit_but_enough_history_does():
    s = settings(vpa_update_mode="bounds")
    cache = state_cache(s)
    early = run(cache, s, 20)  # 20 s at time scale 0.001: the upper bound is still far above 2 cores
    assert [d for d in early if d.cpu_limit_cores is not None] == []
    later = [process_host_samples(cache, msg(T0 + i, c()), updater_config(s)) for i in range(20, 300)]
    cuts = [d for ds in later for d in ds if d.cpu_limit_cores is not None]
    assert cuts, "a steady 0.5-core container under a 2-core limit is eventually lowered"
    first = cuts[0]
    assert first.cpu_limit_cores < 2.0
    assert first.details["update_mode"] == "bounds"
    # the limit in force was above the upper bound when the cut was made
    assert first.details["cpu"]["upper"] < 2.0


def test_in_bounds_mode_a_limit_below_the_lower_bound_is_raised_at_once():
    s = settings(vpa_update_mode="bounds")
    cache = state_cache(s)
    out = run(cache, s, 6, cpu=0.25, cpu_limit=0.25, throttled_periods=9, nr_periods=10, throttled_s=0.7)
    raised = [d for d in out if d.cpu_limit_cores is not None]
    assert raised and raised[0].cpu_limit_cores > 0.25
