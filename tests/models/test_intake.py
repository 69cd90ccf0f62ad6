"""The worker's intake limits: event-time sanity and capacity, pure."""

from __future__ import annotations

import math

from phasewise.models.intake import Admission, IntakeConfig, event_time_problem
from phasewise.models.vpa_updater import StateCache, UpdaterConfig, process_host_samples
from phasewise.schemas import ContainerSample, HostSamples

CFG = IntakeConfig(max_future_s=60, max_behind_s=600, max_per_message=5, max_per_host=3, max_per_worker=4)


def test_event_time_ahead_of_the_clock_or_far_behind_the_host_is_refused_with_the_reason():
    assert event_time_problem(1060.0, now=1000.0, newest=None, config=CFG) is None
    why = event_time_problem(1000.0 + 116 * 86400, now=1000.0, newest=None, config=CFG)
    assert why is not None and "ahead of the worker clock" in why and "intake_max_future_s" in why
    assert event_time_problem(500.0, now=1000.0, newest=1000.0, config=CFG) is None
    why = event_time_problem(399.0, now=1000.0, newest=1000.0, config=CFG)
    assert why is not None and "behind the host's newest sample" in why
    assert event_time_problem(math.inf, now=1000.0, newest=None, config=CFG) is not None
    off = IntakeConfig(max_future_s=0, max_behind_s=0)
    assert event_time_problem(1e300, now=0.0, newest=1e301, config=off) is None


def test_capacity_admits_held_containers_first_and_counts_a_batch_in_order():
    held = {"h1/a", "h1/b", "h1/c"}
    counts = {"h1": 3}
    a = Admission(CFG, held=held.__contains__, host_count=lambda h: counts.get(h, 0), total=3)
    assert a.too_many(6) is not None and a.too_many(5) is None
    kept, refused, why = a.admit("h1", ["a", "new1", "b", "c"])
    assert kept == ["a", "b", "c"] and refused == ["new1"] and a.limit == "host" and "h1 holds 3" in why
    kept, refused, why = a.admit("h2", ["x", "y"])  # the worker holds 3: one more fits
    assert kept == ["x"] and refused == ["y"] and a.limit == "worker"
    kept, refused, why = a.admit("h2", ["x", "x"])  # admitted earlier in the batch: held from now on
    assert kept == ["x", "x"] and refused == [] and why is None


def _msg(ts: float, cpu: float = 0.5) -> HostSamples:
    return HostSamples(host="h", ts=ts, interval_s=1.0, containers=(
        ContainerSample(container="c", cpu_cores=cpu, mem_bytes=3e8, cpu_limit_cores=4.0, mem_limit_bytes=8e9),))


def test_one_future_sample_learned_pins_a_container_which_is_what_the_intake_check_prevents():
    """Without the check, one sample 116 days ahead stops the container's decisions (why the check exists)."""
    cfg = UpdaterConfig(recommend_interval_s=1.0, hysteresis=0.1, update_mode="hysteresis",
                        state_write_interval_s=30.0, worker_id="w")
    pinned, guarded = StateCache({"time_scale": 0.001}), StateCache({"time_scale": 0.001})
    t0, future = 1.7e9, 1.7e9 + 116 * 86400
    got = {"pinned": 0, "guarded": 0}
    newest = None
    for i in range(60):
        ts = t0 + i
        for name, cache in (("pinned", pinned), ("guarded", guarded)):
            if i == 5:  # the hostile sample
                if name == "pinned" or event_time_problem(future, now=ts, newest=newest, config=CFG) is None:
                    process_host_samples(cache, _msg(future), cfg)
            n = len(process_host_samples(cache, _msg(ts, cpu=0.5 if i < 30 else 3.0), cfg))
            got[name] += n if i > 5 else 0
        newest = ts
    assert got["pinned"] == 0  # pinned: nothing decided after the future sample
    assert got["guarded"] >= 1  # refused: decisions go on (the demand jump at i = 30 is decided)


def test_a_restarted_cache_skips_per_container_the_messages_its_stored_state_already_learned():
    """``so``: the source offset a state learned last travels with it; a reload skips what it holds."""
    import json

    cfg = UpdaterConfig(recommend_interval_s=1.0, hysteresis=0.1, update_mode="hysteresis",
                        state_write_interval_s=0.0, worker_id="w")
    names = [f"c{i}" for i in range(300)]  # more than the fleet's first 256 rows: the arrays grow

    def msg(t: int, which=names) -> HostSamples:
        return HostSamples(host="h", ts=1.7e9 + t, interval_s=1.0, containers=tuple(
            ContainerSample(container=n, cpu_cores=0.5, mem_bytes=3e8) for n in which))

    cache = StateCache({"time_scale": 0.001})
    for t in range(3):
        m = cache.unlearned(msg(t), offset=t)
        assert len(m.containers) == 300
        process_host_samples(cache, m, cfg)
        cache.learned(m, offset=t)
    stored = {k: json.loads(json.dumps(v)) for k, v in cache.pop_dirty()}
    assert {v["so"] for v in stored.values()} == {2}
    stored["h/c0"]["so"] = 1  # this one's stored state is older: it must learn offset 2 again
    again = StateCache({"time_scale": 0.001}, loader=stored.get)
    assert [c.container for c in again.unlearned(msg(2), offset=2).containers] == ["c0"]
    assert len(again.unlearned(msg(3), offset=3).containers) == 300
