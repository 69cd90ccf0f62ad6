"""The worker's intake limits: event-time sanity and capacity, pure."""

from __future__ import annotations

import dataclasses
import math

from phasewise.kit.records import ContainerSample, HostSamples
from phasewise.kit.settings import Settings
from phasewise.models.safety.intake import IntakeConfig, Occupancy, event_time_problem
from phasewise.models.vpa.state import StateCache
from phasewise.models.vpa.updater import UpdaterConfig, process_host_samples
from phasewise.streams.config import intake_config


def config(**kw) -> IntakeConfig:
    """The worker's intake limits under the default settings, with *kw* changed."""
    return dataclasses.replace(intake_config(Settings()), **kw)


CFG = config(max_future_s=60, max_behind_s=600, max_per_message=5, max_per_host=3, max_per_worker=4)


def test_event_time_ahead_of_the_clock_or_far_behind_the_host_is_refused_with_the_reason():
    assert event_time_problem(1060.0, now=1000.0, newest=None, config=CFG) is None
    why = event_time_problem(1000.0 + 116 * 86400, now=1000.0, newest=None, config=CFG)
    assert why is not None and "ahead of the worker clock" in why and "intake_max_future_s" in why
    assert event_time_problem(500.0, now=1000.0, newest=1000.0, config=CFG) is None
    why = event_time_problem(399.0, now=1000.0, newest=1000.0, config=CFG)
    assert why is not None and "behind the host's newest sample" in why
    assert event_time_problem(math.inf, now=1000.0, newest=None, config=CFG) is not None
    off = config(max_future_s=0, max_behind_s=0)
    assert event_time_problem(1e300, now=0.0, newest=1e301, config=off) is None


def test_a_message_too_large_is_refused_whole_and_held_containers_are_always_admitted():
    occ = Occupancy(CFG)
    assert occ.too_many(6) is not None and occ.too_many(5) is None
    occ.begin(now=0.0)
    assert occ.admit("h1", ["a", "b", "c"]).kept == ["a", "b", "c"]
    occ.begin(now=1.0)
    r = occ.admit("h1", ["a", "new1", "b", "c"])  # h1 at its cap of 3: every one is in this message
    assert r.kept == ["a", "b", "c"] and r.refused == ["new1"] and r.limit == "host" and not r.evicted
    assert r.why == "host h1 holds 3 containers (intake_max_containers_per_host), every one seen in this batch"
    r = occ.admit("h2", ["x", "x"])  # twice in one message: one container
    assert r.kept == ["x", "x"] and len(occ) == 4


def test_a_host_at_its_cap_replaces_its_own_least_recently_seen_container():
    occ = Occupancy(CFG)
    occ.begin(now=0.0)
    occ.admit("h1", ["a", "b", "c"])
    occ.begin(now=1.0)
    occ.admit("h1", ["b", "c"])  # a was not seen since t = 0
    occ.begin(now=2.0)
    r = occ.admit("h1", ["c", "d"])
    assert r.kept == ["c", "d"] and [(e.key, e.limit) for e in r.evicted] == [("h1/a", "host")]
    assert "least recently seen (2 s ago), evicted for h1/d: host h1 holds 3" in r.evicted[0].reason
    assert "h1/a" not in occ and occ.host_count("h1") == 3


FLOOD = config(max_per_message=1000, max_per_host=50, max_per_worker=100, host_active_s=120.0)


def tick(occ: Occupancy, now: float, hosts: dict[str, list[str]]) -> dict[str, object]:
    occ.begin(now)
    return {h: occ.admit(h, names) for h, names in hosts.items()}


REAL = {"r1": [f"c{i}" for i in range(10)], "r2": [f"c{i}" for i in range(10)]}


def established(occ: Occupancy, until: float) -> None:
    for t in range(int(until)):
        tick(occ, float(t), REAL)


def test_names_sent_once_neither_push_out_real_containers_nor_keep_a_real_new_one_out():
    """The attack: a flood of names under invented hosts fills the worker. Before, real new containers
    were refused until the names expired (container_ttl_s, 8 days)."""
    occ = Occupancy(FLOOD)
    established(occ, 3)
    occ.begin(3.0)
    got = [occ.admit(f"fake-{i}", ["x"]) for i in range(200)]  # the first 80 fill the worker
    assert len(occ) == 100 and occ.host_count("r1") == occ.host_count("r2") == 10
    assert not any(r.evicted for r in got)  # the rest are refused: nothing real is pushed out
    assert got[80].refused == ["x"] and "every container is seen within intake_host_active_s" in got[80].why
    r = tick(occ, 4.0, {**REAL, "r1": REAL["r1"] + ["new"]})["r1"]  # a real new container, at once
    assert r.kept == REAL["r1"] + ["new"] and not r.refused
    (e,) = r.evicted
    assert e.key == "fake-0/x" and e.limit == "worker" and "seen in one batch only" in e.reason
    assert len(occ) == 100 and occ.host_count("r1") == 11


def test_names_sent_again_keep_real_new_containers_out_only_while_their_hosts_are_active():
    occ = Occupancy(FLOOD)
    established(occ, 3)
    for t in (3.0, 4.0):  # 80 invented hosts, each sent in two batches: established like real ones
        occ.begin(t)
        for i in range(80):
            occ.admit(f"fake-{i}", ["x"])
    # 82 active hosts: r1's share is 1 and it holds 10, each in its own message: its new one waits
    r = tick(occ, 5.0, {**REAL, "r1": REAL["r1"] + ["new"]})["r1"]
    assert r.refused == ["new"] and r.limit == "worker" and "its share of a full worker (1:" in r.why
    for t in range(6, 125):
        tick(occ, float(t), REAL)  # the real hosts go on sending; the invented ones are silent
    r = tick(occ, 125.0, {**REAL, "r1": REAL["r1"] + ["new"]})["r1"]
    assert r.kept == REAL["r1"] + ["new"] and not r.refused
    (e,) = r.evicted
    assert e.key == "fake-0/x" and "not seen for 121 s" in e.reason
    assert occ.host_count("r1") == 11 and occ.host_count("r2") == 10


def test_one_host_flooding_new_names_cannot_push_out_the_containers_of_others():
    occ = Occupancy(config(max_per_message=1000, max_per_host=80, max_per_worker=100, host_active_s=120.0))
    real = {f"r{i}": [f"c{j}" for j in range(10)] for i in range(4)}
    tick(occ, 0.0, real)
    tick(occ, 0.5, real)
    n = 0
    for t in range(1, 30):  # the flooder sends 40 new names a second, and the real hosts their own
        names = [f"x{n + k}" for k in range(40)]
        n += 40
        got = tick(occ, float(t), {**real, "flood": names})
        assert all(not r.refused and not r.evicted for h, r in got.items() if h != "flood")
        assert all(e.key.startswith("flood/") for e in got["flood"].evicted)
    assert [occ.host_count(h) for h in real] == [10, 10, 10, 10] and occ.host_count("flood") == 60
    # a real host's new container takes the room of one the flooder sent once
    r = tick(occ, 30.0, {**real, "r0": real["r0"] + ["new"]})["r0"]
    assert r.kept[-1] == "new" and [e.key[:6] for e in r.evicted] == ["flood/"]
    assert "seen in one batch only" in r.evicted[0].reason
    # a flooder that sends its names again cannot keep a real new container out either: it is above its
    # share (20 = 100 // 5), so a host below its share takes from it
    real["r0"].append("new")
    held = sorted(k.split("/", 1)[1] for k in occ._hosts["flood"])
    tick(occ, 31.0, {**real, "flood": held})
    assert not occ._once
    r = tick(occ, 32.0, {**real, "r1": real["r1"] + ["new"]})["r1"]
    assert r.kept[-1] == "new" and [e.key[:6] for e in r.evicted] == ["flood/"]
    assert "host flood holds 59 containers, more than its share of a full worker (20)" in r.evicted[0].reason
    assert [occ.host_count(h) for h in real] == [11, 11, 10, 10]


def test_the_stalest_container_goes_first_and_nothing_seen_in_the_batch_is_evicted():
    cfg = config(max_per_message=100, max_per_host=100, max_per_worker=6, host_active_s=10.0)
    occ = Occupancy(cfg)
    tick(occ, 0.0, {"old": ["a"]})
    tick(occ, 5.0, {"big": ["b1", "b2", "b3", "b4"]})
    got = tick(occ, 20.0, {"big": ["b1", "b2", "b3", "b4"], "h": ["n1", "n2"]})
    # n1 fills the worker; n2 takes old/a (not seen for 20 s > host_active_s), not one of big's
    assert [e.key for e in got["h"].evicted] == ["old/a"] and "not seen for 20 s" in got["h"].evicted[0].reason
    got = tick(occ, 21.0, {"big": ["b1", "b2", "b3", "b4"], "h": ["n1", "n2"], "h2": ["z"]})
    # full, every container seen in this batch: refused, nothing evicted
    assert got["h2"].refused == ["z"] and "or in this batch" in got["h2"].why
    assert not got["h2"].evicted


def test_the_occupancy_stays_bounded_and_consistent_under_random_traffic():
    import random

    rng = random.Random(7)
    cfg = config(max_per_message=50, max_per_host=12, max_per_worker=40, host_active_s=5.0)
    occ = Occupancy(cfg)
    for t in range(400):
        occ.begin(float(t))
        seen: set[str] = set()
        for _ in range(rng.randint(1, 6)):
            host = f"h{rng.randint(0, 15)}"
            names = [f"c{rng.randint(0, 30)}" for _ in range(rng.randint(0, 15))]
            before = set(occ._keys)
            r = occ.admit(host, names)
            seen |= {f"{host}/{n}" for n in r.kept}
            assert not {e.key for e in r.evicted} & seen  # nothing seen in this batch was evicted
            assert {e.key for e in r.evicted} <= before
            assert {f"{host}/{n}" for n in r.kept} <= set(occ._keys)
            assert len(occ) <= cfg.max_per_worker and occ.host_count(host) <= cfg.max_per_host
        if rng.random() < 0.1:
            occ.forget(rng.sample(sorted(occ._keys), min(3, len(occ))))
        counts: dict[str, int] = {}
        for k, (h, _b, _t, _e) in occ._keys.items():
            assert k.startswith(h + "/")
            counts[h] = counts.get(h, 0) + 1
        assert counts == {h: len(ks) for h, ks in occ._hosts.items()}
        assert {n: set(hs) for n, hs in occ._by_size.items()} == {
            n: {h for h, c in counts.items() if c == n} for n in set(counts.values())}
        assert occ._largest == max(counts.values(), default=0)
        assert set(occ._seen) <= set(occ._hosts) and set(occ._hbatch) == set(occ._hosts)
        assert set(occ._once) == {k for k, e in occ._keys.items() if not e[3]}
    occ.begin(400.0)
    occ.admit("h99", ["a", "b"])
    assert occ.settle({"h99/a"}.__contains__) == ["h99/b"] and "h99/b" not in occ and "h99/a" in occ
    occ.clear()
    assert len(occ) == 0 and occ.host_count("h99") == 0


def _msg(ts: float, cpu: float = 0.5) -> HostSamples:
    return HostSamples(host="h", ts=ts, interval_s=1.0, containers=(
        ContainerSample(container="c", cpu_cores=cpu, mem_bytes=3e8, cpu_limit_cores=4.0, mem_limit_bytes=8e9),))


def test_one_future_sample_learned_pins_a_container_which_is_what_the_intake_check_prevents():
    """Without the check, one sample 116 days ahead stops the container's decisions (why the check exists)."""
    cfg = UpdaterConfig(recommend_interval_s=1.0, hysteresis=0.1, update_mode="hysteresis",
                        state_write_interval_s=30.0, worker_id="w", prior_until_s=0.0,
                        profile_interval_s=60.0)
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
                        state_write_interval_s=0.0, worker_id="w", prior_until_s=0.0,
                        profile_interval_s=60.0)
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


def test_the_commits_are_held_back_to_the_oldest_sample_no_stored_state_holds():
    """``hold_back``: per source partition, the first offset learned since a container's state was handed out;
    a container whose samples stopped is handed out once ``max_unwritten_s`` passed, releasing the hold."""
    cfg = UpdaterConfig(recommend_interval_s=1.0, hysteresis=0.1, update_mode="hysteresis",
                        state_write_interval_s=30.0, worker_id="w", prior_until_s=0.0,
                        profile_interval_s=60.0)

    def msg(host: str, t: int, names=("a", "b")) -> HostSamples:
        return HostSamples(host=host, ts=1.7e9 + t, interval_s=1.0, containers=tuple(
            ContainerSample(container=n, cpu_cores=0.5, mem_bytes=3e8) for n in names))

    cache = StateCache({"time_scale": 0.001})
    for t, (host, part) in enumerate([("h1", 0), ("h2", 1), ("h1", 0), ("h2", 1)]):
        m = msg(host, t)
        process_host_samples(cache, m, cfg)
        cache.learned(m, offset=10 * t, partition=part, now=100.0 + t)
    assert cache.hold_back() == {0: 0, 1: 10}                   # (marked or not, nothing handed out yet)
    cache.dirty.update({"h1/a", "h1/b", "h2/a", "h2/b"})
    assert len(cache.pop_dirty(now=104.0, max_unwritten_s=30.0)) == 4
    assert cache.hold_back() == {}                              # every learned sample is in a handed-out state
    m = msg("h1", 5, names=("a",))
    process_host_samples(cache, m, cfg)
    cache.learned(m, offset=50, partition=0, now=105.0)
    m = msg("h2", 6)
    process_host_samples(cache, m, cfg)
    cache.learned(m, offset=60, partition=1, now=106.0)
    cache.dirty.discard("h1/a"), cache.dirty.discard("h2/a"), cache.dirty.discard("h2/b")
    held = cache.hold_back()
    assert held[0] == 50 and held[1] == 60
    # h2's containers written: partition 1 free; h1/a's samples stopped: handed out after 30 s
    cache.dirty.update({"h2/a", "h2/b"})
    assert {k for k, _ in cache.pop_dirty(now=110.0, max_unwritten_s=30.0)} == {"h2/a", "h2/b"}
    assert cache.hold_back() == {0: 50}
    assert {k for k, _ in cache.pop_dirty(now=135.5, max_unwritten_s=30.0)} == {"h1/a"}
    assert cache.hold_back() == {}
    # without a partition (the phase worker's caller): nothing is held
    m = msg("h3", 7)
    process_host_samples(cache, m, cfg)
    cache.learned(m, offset=70)
    assert cache.hold_back() == {}


def test_the_refusals_say_why_in_the_words_of_their_settings():
    """The module's former example: each refusal names the setting that made it."""
    cfg = config(max_future_s=60, max_behind_s=600, max_per_message=3, max_per_host=2, max_per_worker=10)
    assert (event_time_problem(1000.0 + 61, now=1000.0, newest=None, config=cfg)
            == "event time 1061 is 61 s ahead of the worker clock (allowed: 60 s; intake_max_future_s)")
    assert (event_time_problem(300.0, now=1000.0, newest=1000.0, config=cfg)
            == "event time 300 is 700 s behind the host's newest sample (allowed: 600 s; intake_max_behind_s)")
    occ = Occupancy(cfg)
    occ.begin(now=0.0)
    r = occ.admit("h", ["a", "b", "c"])
    assert (r.kept, r.refused) == (["a", "b"], ["c"])
    assert r.why == "host h holds 2 containers (intake_max_containers_per_host), every one seen in this batch"
