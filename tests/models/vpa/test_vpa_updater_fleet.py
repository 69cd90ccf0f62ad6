"""process_host_samples on the VPA fleet decides exactly what the per-container VpaPolicy code decided.

The reference below is the worker's step as it was before the fleet (one
``VpaPolicy`` per container, frozen here verbatim apart from names): the
fleet-backed ``process_host_samples`` must give the same decisions (ids,
limits, reasons, details), mark the same containers dirty with the same
table values, and read tables the reference wrote (and vice versa).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from phasewise.apps.bench.logic import messages as bench_messages
from phasewise.kit.records import (
    MAX_BYTES,
    MAX_CORES,
    ContainerSample,
    Decision,
    HostSamples,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.models.decisions import decision_id
from phasewise.models.vpa.recommender import VpaPolicy, VpaRecommender, VpaStateError
from phasewise.models.vpa.state import ENTRY_VERSION, StateCache
from phasewise.models.vpa.updater import (
    POLICY,
    process_host_samples,
    process_many,
    sample_usage,
)
from phasewise.streams.config import recommender_params, state_cache, updater_config

T0 = 1.7e9

# ---------------------------------------------------------------- the reference (pre-fleet code)

class RefEntry:
    """One container's :class:`VpaPolicy` plus the worker's bookkeeping about it."""

    __slots__ = ("decided_cpu", "decided_mem", "next_ts", "policy", "written_ts")

    def __init__(self, policy: VpaPolicy) -> None:
        self.policy = policy
        self.decided_cpu: float | None = None  # last CPU limit this worker decided
        self.decided_mem: float | None = None
        self.next_ts: float | None = None  # event time of the next recommendation
        self.written_ts: float | None = None  # event time of the last persisted state

    @property
    def model(self) -> VpaRecommender:
        """The policy's recommender."""
        return self.policy.model

    def to_state(self) -> dict[str, Any]:
        return {"v": ENTRY_VERSION, "vpa": self.policy.model.to_state(), "pl": self.policy._last,
                "dc": self.decided_cpu, "dm": self.decided_mem, "nx": self.next_ts}

    @classmethod
    def from_state(cls, state: Any, params: dict[str, Any]) -> RefEntry:
        if not isinstance(state, dict) or state.get("v") != ENTRY_VERSION:
            raise VpaStateError(f"unsupported container state {str(state)[:80]!r}")
        # "pl" (the policy's last limits) is absent from states written before the
        # worker ran VpaPolicy; the policy then starts with no last limits
        pstate = {"m": state["vpa"], "l": state.get("pl") or {}}
        e = cls(VpaPolicy.from_state(pstate, **params))
        e.decided_cpu, e.decided_mem, e.next_ts = state.get("dc"), state.get("dm"), state.get("nx")
        return e


class RefCache:
    """Per-container entries in memory, loaded through *loader* on a miss.

    *loader* maps a key to a stored state (or ``None``); the worker passes its
    table's ``get``. Keys whose state changed enough to be persisted collect
    in :attr:`dirty`; :meth:`pop_dirty` hands them out once.
    """

    def __init__(self, params: dict[str, Any] | None = None,
                 loader: Callable[[str], Any] | None = None) -> None:
        self.params = dict(params or {})
        self.loader = loader
        self._entries: dict[str, RefEntry] = {}
        self.dirty: set[str] = set()
        self.loaded = 0  # entries restored through the loader
        self.load_errors = 0

    @classmethod
    def from_settings(cls, settings: Settings, loader: Callable[[str], Any] | None = None) -> RefCache:
        return cls(recommender_params(settings), loader)

    def get(self, key: str) -> RefEntry:
        e = self._entries.get(key)
        if e is not None:
            return e
        if self.loader is not None:
            try:
                state = self.loader(key)
                if state is not None:
                    e = RefEntry.from_state(state, self.params)
                    self.loaded += 1
            except (ValueError, TypeError):  # VpaStateError, undecodable or foreign values
                self.load_errors += 1
        if e is None:
            e = RefEntry(VpaPolicy(**self.params))
        self._entries[key] = e
        return e

    def pop_dirty(self) -> list[tuple[str, dict[str, Any]]]:
        out = [(k, self._entries[k].to_state()) for k in self.dirty if k in self._entries]
        self.dirty.clear()
        return out

    def clear(self) -> None:
        """Forget every entry (after a rebalance the table is the truth)."""
        self._entries.clear()
        self.dirty.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries


def _moved(new: float | None, ref: float | None, hysteresis: float) -> bool:
    if new is None:
        return False
    if ref is None or ref <= 0:
        return True
    return abs(new - ref) > hysteresis * ref


def _outside(ref: float | None, bounds: dict[str, float]) -> bool:
    """Whether the limit in force lies outside [lower, upper] (unlimited: always)."""
    if ref is None:
        return True
    lo, up = bounds.get("lower"), bounds.get("upper")
    return (lo is not None and math.isfinite(lo) and ref < lo) or (
        up is not None and math.isfinite(up) and ref > up)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _decide(entry: RefEntry, host: str, c: ContainerSample, ts: float,
            settings: Settings) -> Decision | None:
    p = entry.policy
    lim = p.limits(ts)  # the policy's limits from everything observed up to ts
    cpu_t, mem_t = lim.get("cpu"), lim.get("mem")
    if cpu_t is not None:
        cpu_t = min(math.ceil(cpu_t * 1000.0 - 1e-9) / 1000.0, MAX_CORES)
    if mem_t is not None:
        mem_t = float(min(math.ceil(mem_t), MAX_BYTES))
    ref_cpu = entry.decided_cpu if entry.decided_cpu is not None else c.cpu_limit_cores
    ref_mem = entry.decided_mem if entry.decided_mem is not None else c.mem_limit_bytes
    h = settings.worker.hysteresis
    cpu_out = cpu_t if _moved(cpu_t, ref_cpu, h) else None
    mem_out = mem_t if _moved(mem_t, ref_mem, h) else None
    rec = None
    if settings.vpa.update_mode == "bounds" and (cpu_out is not None or mem_out is not None):
        # the VPA updater acts only on a limit outside the confidence bounds: with little
        # history the upper bound is far above the target, so nothing is cut early
        rec = p.model.predict_one()
        if cpu_out is not None and not _outside(ref_cpu, rec["cpu"]):
            cpu_out = None
        if mem_out is not None and not _outside(ref_mem, rec["mem"]):
            mem_out = None
    if cpu_out is None and mem_out is None:
        return None
    why = []
    if cpu_out is not None:
        why.append(f"cpu {_fmt(ref_cpu)} -> {cpu_out:g} cores")
        entry.decided_cpu = cpu_out
    if mem_out is not None:
        why.append(f"mem {_fmt(ref_mem, 2**-20)} -> {mem_out / 2**20:.0f} MiB")
        entry.decided_mem = mem_out
    m = p.model
    rec = rec or m.predict_one()
    details = m.explain()
    details["cpu"] = {k: _finite(v) for k, v in rec["cpu"].items()}
    details["mem"] = {k: _finite(v) for k, v in rec["mem"].items()}
    details["limits"] = {"cpu": lim.get("cpu"), "mem": lim.get("mem"), "bound": p.bound}
    details["previous"] = {"cpu": ref_cpu, "mem": ref_mem}
    details["observed"] = {"cpu": c.cpu_limit_cores, "mem": c.mem_limit_bytes}
    details["hysteresis"] = h
    details["update_mode"] = settings.vpa.update_mode
    details["worker_id"] = settings.worker.id
    details["confidence"] = _finite(details["confidence"])
    reason = (f"vpa {p.bound} (p{m.target_percentile * 100:g} of {m.samples} samples "
              f"+{m.safety_margin * 100:g}%): " + "; ".join(why))
    return Decision(
        id=decision_id(POLICY, host, c.container, cpu_out, mem_out, ts),
        ts=ts, host=host, container=c.container, action="limit", policy=POLICY, reason=reason,
        cpu_limit_cores=cpu_out, mem_limit_bytes=mem_out, details=details,
    )


def _fmt(v: float | None, scale: float = 1.0) -> str:
    return "unlimited" if v is None else f"{v * scale:g}"


def reference_process(state_cache: RefCache, msg: HostSamples, settings: Settings) -> list[Decision]:
    """Learn every container sample of *msg*; return the limit decisions due now."""
    out: list[Decision] = []
    ts = msg.ts
    host = msg.host
    interval = settings.worker.recommend_interval_s
    write_interval = settings.worker.state_write_interval_s
    dirty = state_cache.dirty
    per_s = 1.0 / msg.interval_s if msg.interval_s > 0 else 0.0
    for c in msg.containers:
        key = f"{host}/{c.container}"
        entry = state_cache.get(key)
        entry.policy.observe(ts, sample_usage(c, per_s))
        nx = entry.next_ts
        if nx is None:  # first sample: the first recommendation one interval later
            nx = ts + interval
        d = None
        if ts < nx:
            entry.next_ts = nx
        else:
            entry.next_ts = ts + interval
            d = _decide(entry, host, c, ts, settings)
            if d is not None:
                out.append(d)
        # every sample, not only recommendation steps, checks the write interval
        if entry.written_ts is None:  # new or reloaded: first write at a decision or one interval on
            entry.written_ts = ts
        if d is not None or ts - entry.written_ts >= write_interval:
            dirty.add(key)
            entry.written_ts = ts
    return out


# ---------------------------------------------------------------- equality


def make_settings(**kw: Any) -> Settings:
    # the VPA's own decisions against VpaPolicy: safety rules off (tests/models/safety/test_safety_rules.py)
    return Settings.from_env({"vpa_time_scale": 0.001, "safety_rules": False, **kw}, env={})


def run_both(msgs: list[HostSamples], s: Settings, ref: RefCache, new: StateCache,
             tables: tuple[dict, dict] | None = None) -> int:
    """Feed both caches; assert equal decisions and writes after every message. Returns #decisions."""
    n = 0
    for m in msgs:
        want = reference_process(ref, m, s)
        got = process_host_samples(new, m, updater_config(s))
        assert got == want, (m.host, m.ts)
        # same JSON, key order included (compared decoded: the reference's floor is an int 262144000
        # or a float depending on which VpaRecommender filled models/vpa/recommender.py's lru_cache first)
        assert [list(json.loads(encode(d))["details"]) for d in got] == [
            list(json.loads(encode(d))["details"]) for d in want]
        assert [json.loads(encode(d)) for d in got] == [json.loads(encode(d)) for d in want]
        w_ref, w_new = sorted(ref.pop_dirty()), sorted(new.pop_dirty())
        assert w_new == w_ref, (m.host, m.ts)
        if tables is not None:
            for table, writes in zip(tables, (w_ref, w_new)):
                table.update((k, json.dumps(v, separators=(",", ":"))) for k, v in writes)
        n += len(got)
    assert len(new) == len(ref)
    return n


@pytest.mark.parametrize(("interval", "mode"), [(1.0, "bounds"), (5.0, "bounds"), (0.0, "hysteresis"),
                                                (3.0, "hysteresis")])
def test_bench_messages_get_the_decisions_and_writes_of_the_per_container_code(interval, mode):
    s = make_settings(recommend_interval_s=interval, vpa_update_mode=mode, state_write_interval_s=7.0)
    msgs = [m for t in range(40) for m in bench_messages(120, 50, t)]
    n = run_both(msgs, s, RefCache.from_settings(s), state_cache(s))
    assert n > 20


def random_sample(rng: random.Random, name: str, phase: float) -> ContainerSample:
    limited = rng.random() < 0.7
    nr = rng.choice((0, 10, 100))
    return ContainerSample(
        container=name,
        cpu_cores=rng.choice((0.0, rng.uniform(0.01, 3.0) * phase, 0.5)),
        mem_bytes=rng.choice((rng.uniform(5e7, 6e9) * phase, 4e8)),
        cpu_limit_cores=rng.choice((0.25, 1.0, 2.0, 4.0)) if limited else None,
        mem_limit_bytes=rng.choice((5e8, 2e9, 8e9)) if rng.random() < 0.7 else None,
        nr_periods=nr, throttled_periods=rng.randint(0, nr),
        throttled_s=rng.choice((0.0, 0.0, rng.uniform(0.0, 2.0))),
        oom_events=1 if rng.random() < 0.03 else 0,
    )


def random_messages(seed: int, ticks: int) -> list[HostSamples]:
    """Irregular hosts: late, repeated and out-of-order messages, containers coming and going,
    the same container twice in one message; time_scale 0.001 crosses memory intervals and decay."""
    rng = random.Random(seed)
    hosts = {f"h{i}": [f"c{j}" for j in range(rng.randint(1, 12))] for i in range(4)}
    out = []
    clock = {h: T0 + rng.uniform(0, 5) for h in hosts}
    for tick in range(ticks):
        for h, names in hosts.items():
            r = rng.random()
            if r < 0.05:
                continue  # a lost message
            step = rng.choice((1.0, 1.0, 0.5, 2.0, 0.0, -3.0, 90.0)) if r > 0.1 else 9000.0
            clock[h] += step
            present = [n for n in names if rng.random() < 0.9]
            if present and rng.random() < 0.05:
                present.append(present[0])  # a container twice in one message
            phase = 1.0 + (tick // 30) % 3
            cs = tuple(random_sample(rng, n, phase) for n in present)
            out.append(HostSamples(host=h, ts=clock[h], interval_s=rng.choice((1.0, 2.0, 0.0)), containers=cs))
    return out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["bounds", "hysteresis"])
def test_irregular_random_messages_and_a_restart_from_the_tables_decide_alike(seed, mode):
    s = make_settings(recommend_interval_s=2.0, vpa_update_mode=mode, state_write_interval_s=5.0)
    msgs = random_messages(seed, 240)
    tables: tuple[dict, dict] = ({}, {})
    ref, new = RefCache.from_settings(s), state_cache(s)
    n = run_both(msgs[:500], s, ref, new, tables)
    assert tables[0] == tables[1] and tables[0]
    # a restart: each side reloads its own table (identical) and carries on
    ref = RefCache.from_settings(s, loader=lambda k: json.loads(tables[0][k]) if k in tables[0] else None)
    new = state_cache(s, loader=lambda k: json.loads(tables[1][k]) if k in tables[1] else None)
    n += run_both(msgs[500:], s, ref, new, tables)
    assert new.loaded == ref.loaded > 0
    assert n > 30


def test_a_table_written_by_the_per_container_code_loads_into_the_fleet_and_back():
    s = make_settings(recommend_interval_s=1.0, vpa_update_mode="hysteresis", state_write_interval_s=3.0)
    msgs = random_messages(7, 120)
    old_table: dict[str, str] = {}
    ref = RefCache.from_settings(s)
    for m in msgs[:250]:
        reference_process(ref, m, s)
        old_table.update((k, json.dumps(v)) for k, v in ref.pop_dirty())
    # an upgraded worker recovers the old changelog...
    ref2 = RefCache.from_settings(s, loader=lambda k: json.loads(old_table[k]) if k in old_table else None)
    new = state_cache(s, loader=lambda k: json.loads(old_table[k]) if k in old_table else None)
    run_both(msgs[250:350], s, ref2, new)
    assert new.loaded > 0
    # ...and what the fleet writes, the per-container code reads (a rollback)
    for k in list(new._index):
        state = new.state_of(k)
        assert state == ref2.get(k).to_state()
        back = RefEntry.from_state(json.loads(json.dumps(state)), recommender_params(s))
        assert back.to_state() == state


def test_entries_expose_the_decided_limits_and_exact_policy_copies():
    s = make_settings(recommend_interval_s=1.0, vpa_update_mode="hysteresis")
    msgs = random_messages(3, 60)
    ref, new = RefCache.from_settings(s), state_cache(s)
    run_both(msgs, s, ref, new)
    for key in ref._entries:
        r, e = ref.get(key), new.get(key)
        assert (e.decided_cpu, e.decided_mem, e.next_ts, e.written_ts) == (
            r.decided_cpu, r.decided_mem, r.next_ts, r.written_ts)
        assert e.model.to_state() == r.model.to_state() and e.model._cpu._w == r.model._cpu._w
        assert e.policy._last == r.policy._last
        assert key in new
    keys = list(ref._entries)
    both = new.decided_limits(keys)
    assert [(None if math.isnan(a) else a, None if math.isnan(b) else b) for a, b in both.tolist()] == [
        (ref.get(k).decided_cpu, ref.get(k).decided_mem) for k in keys]
    e.decided_cpu = 1.5
    assert new.get(key).decided_cpu == 1.5
    new.clear()
    assert len(new) == 0 and key not in new


def test_stored_states_the_fleet_cannot_use_are_discarded_and_counted():
    s = make_settings()
    good = {"v": ENTRY_VERSION, "vpa": VpaRecommender().to_state(), "dc": 1.0}
    stored = {"h/a": {"v": 99}, "h/b": {"v": ENTRY_VERSION}, "h/c": {**good, "dc": "x"},
              "h/d": {**good, "pl": [1]}, "h/e": good}
    new = state_cache(s, loader=stored.get)
    cs = tuple(ContainerSample(container=n, cpu_cores=0.5, mem_bytes=4e8) for n in "abcde")
    process_host_samples(new, HostSamples(host="h", ts=T0, interval_s=1.0, containers=cs), updater_config(s))
    assert new.load_errors == 4 and new.loaded == 1
    assert new.get("h/e").decided_cpu == 1.0 and new.get("h/a").decided_cpu is None
    assert new.get("h/b").model.samples == 1  # fresh state, then this sample


@pytest.mark.parametrize("mode", ["bounds", "hysteresis"])
def test_batches_of_messages_decide_what_one_message_at_a_time_decides(mode):
    """process_many == process_host_samples per message, with repeated containers across and within messages."""
    s = make_settings(recommend_interval_s=2.0, vpa_update_mode=mode, state_write_interval_s=5.0)
    msgs = random_messages(5, 150) + [m for t in range(12) for m in bench_messages(60, 20, t)]
    rng = random.Random(2)
    ref, new = RefCache.from_settings(s), state_cache(s)
    i = n = 0
    while i < len(msgs):
        batch = msgs[i:i + rng.choice((1, 2, 5, 17))]
        i += len(batch)
        want, dirty = [], set()
        for m in batch:
            want.append(reference_process(ref, m, s))
            dirty |= {k for k, _ in ref.pop_dirty()}
        got = process_many(new, batch, updater_config(s))
        assert got == want
        n += sum(map(len, got))
        written = dict(new.pop_dirty())
        assert written.keys() == dirty
        assert all(v == ref.get(k).to_state() for k, v in written.items())  # the latest state of each
    assert n > 50 and len(new) == len(ref)
    assert process_many(new, [], updater_config(s)) == [] and process_many(new, [HostSamples(
        host="h", ts=T0, interval_s=1.0, containers=())], updater_config(s)) == [[]]
