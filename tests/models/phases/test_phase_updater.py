"""The phase detectors of a worker (PhaseHooks) without Kafka: phase changes, decisions, learn windows."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.kit.records import (
    ContainerSample,
    Decision,
    HostSamples,
    ModelSnapshot,
    PhaseChange,
    decode,
    encode,
)
from phasewise.kit.records.learn_batches import decode_learn_batch
from phasewise.kit.settings import Settings
from phasewise.models.phases.detector import PhaseModel, learn
from phasewise.models.phases.learner import Learner
from phasewise.models.phases.snapshots import model_name
from phasewise.models.phases.updater import PhaseHooks
from phasewise.models.vpa.updater import process_host_samples, process_many
from phasewise.streams.config import detector_config, state_cache, updater_config

NAME = model_name()


def msg(host: str, ts: float, usage: dict[str, tuple[float, float]]) -> HostSamples:
    return HostSamples(host=host, ts=ts, interval_s=1.0, containers=tuple(
        ContainerSample(container=c, cpu_cores=cpu, mem_bytes=mem, cpu_limit_cores=4.0, mem_limit_bytes=8e9,
                        nr_periods=10) for c, (cpu, mem) in usage.items()))


def regime(t: int, period: int = 20) -> tuple[float, float]:
    return (1.5, 1.5e9) if (t // period) % 2 else (0.05, 2e8)


def warm_model() -> PhaseModel:
    m = PhaseModel(features=("cpu", "mem"), n_his=2, warmup=32, seed=0)
    W = np.array([[regime(t + k) for k in range(3)] for t in range(160)])
    for _ in range(4):
        learn(m, W)
    assert m.ready
    return m


def test_hooks_emit_phase_changes_and_phase_decisions_with_vpa_as_the_fallback():
    s = Settings.from_env({"policy": "phase", "recommend_interval_s": 1.0, "vpa_time_scale": 0.001,
                           "safety_rules": False,
                           "phase_learn_every": 2,
                           "phase_learn_batch": 16}, env={})
    cache = state_cache(s)
    model = warm_model()
    hooks = PhaseHooks(detector_config(s), cache, model=model, version=1)
    decisions, changes, batches = [], [], 0
    for t in range(80):
        hs = msg("h1", 1000.0 + t, {"job": regime(t), "steady": (0.5, 5e8)})
        out = hooks.process(hs, process_host_samples(cache, hs, updater_config(s)))
        decisions += out.decisions
        changes += out.changes
        batches += out.learn_batch is not None
        if t == 40:  # the learner's snapshot lands: statistics for the phases appear
            W = np.array([[regime(k + j) for j in range(3)] for k in range(120)])
            model.clusterer.update_stats(model.predict(W), W[:, -1])
            # relative statistics (the worker's default): usage / the container's level
            model.clusterer.update_rel_stats(model.predict(W), W[:, -1] / W[:, -1].max(axis=0))
            hooks.latest = lambda m=model: (ModelSnapshot(name=NAME, ts=1.0, version=2, payload_b64="",
                                                          samples_seen=0), m)
    assert hooks.version == 2
    job_changes = [c for c in changes if c.container == "job"]
    assert all(isinstance(c, PhaseChange) and c.host == "h1" for c in job_changes)
    assert sum(c.old_phase is not None for c in job_changes) >= 3  # a change per regime switch
    assert all(d.policy == "phase" for d in decisions)
    fb = [d for d in decisions if d.details["source"] == "fallback:vpa"]
    ph = [d for d in decisions if d.details["source"] == "phase" and d.container == "job"]
    assert fb and ph
    d = ph[-1]
    assert d.details["phase"] is not None and d.details["stats"]["cpu"]["count"] >= 10
    assert d.details["margin"] == {"cpu": 0.05, "mem": 0.1}  # the settings' margins, each resource's own
    assert d.details["stats"]["cpu"]["p95"] * 1.05 <= d.cpu_limit_cores + 1e-3
    assert d.details["statistics"] == "relative" and d.details["stats"]["cpu"]["level_before"] > 0
    assert batches > 0
    for d in decisions:  # every decision is a valid record
        assert decode(Decision, encode(d)) == d



def test_hooks_hold_learn_windows_until_a_batch_is_full_and_hand_out_the_rest_on_request():
    s = Settings.from_env({"policy": "phase", "recommend_interval_s": 1.0, "vpa_time_scale": 0.001,
                           "safety_rules": False,
                           "phase_learn_every": 1,
                           "phase_learn_batch": 7}, env={})
    cache = state_cache(s)
    hooks = PhaseHooks(detector_config(s), cache, model=warm_model(), version=1)
    L, F = hooks.fleet.model.window_len, hooks.fleet.model.n_features
    sizes, ready = [], 0
    for t in range(12):  # 3 containers per message: 3 ready windows per message once windows are full
        hs = msg("h1", 1000.0 + t, {"a": regime(t), "b": (0.5, 5e8), "c": (0.2, 2e8)})
        out = hooks.process(hs, process_host_samples(cache, hs, updater_config(s)))
        ready += 3 if t >= L - 1 else 0
        if out.learn_batch is not None:
            W, P, U, LV = decode_learn_batch(out.learn_batch, NAME, L, F)
            sizes.append(len(W))
            assert P.shape == (len(W),) and U.shape == (len(W), F) and LV is not None and LV.shape == U.shape
    assert sizes and all(n >= 7 for n in sizes) and all(n < 7 + 3 for n in sizes)  # full batches only
    rest = hooks.take_learn_batch()
    assert rest is not None and hooks.take_learn_batch() is None  # the hold is emptied
    sizes.append(len(decode_learn_batch(rest, NAME, L, F)[0]))
    assert sum(sizes) == ready  # every sampled window is sent exactly once



def test_one_step_over_several_hosts_messages_decides_exactly_as_one_step_per_message():
    s = Settings.from_env({"policy": "phase", "recommend_interval_s": 1.0, "vpa_time_scale": 0.001,
                           "safety_rules": False,
                           "phase_learn_every": 3,
                           "phase_learn_batch": 1}, env={})
    caches = [state_cache(s), state_cache(s)]
    per_msg, batched = (PhaseHooks(detector_config(s), c, model=warm_model(), version=1) for c in caches)
    got: list[list] = [[], []]
    for t in range(60):  # 3 hosts per tick, each with a container changing regime at its own period
        msgs = [msg(f"h{h}", 1000.0 + t + 0.1 * h, {"job": regime(t + 5 * h, 12 + 4 * h), "idle": (0.1, 1e8)})
                for h in range(3)]
        for m in msgs:
            process_host_samples(caches[0], m, updater_config(s))
            out = per_msg.process(m)
            got[0].append((out.decisions, out.changes, out.learn_batch))
        process_many(caches[1], msgs, updater_config(s))
        out = batched.process_many(msgs)
        got[1].append((out.decisions, out.changes, out.learn_batch))
    flat = [[x for step in g for x in step[0]] for g in got]
    assert flat[0] == flat[1] and len({d.host for d in flat[0]}) == 3  # decisions, in message order
    changes = [[x for step in g for x in step[1]] for g in got]
    assert changes[0] == changes[1] and {c.host for c in changes[0]} == {"h0", "h1", "h2"}
    windows = [np.concatenate([decode_learn_batch(b, NAME, 3, 2)[0] for *_, b in g if b is not None]) for g in got]
    assert np.array_equal(windows[0], windows[1])  # the same learn sample
    with pytest.raises(ValueError, match="appears in two"):
        batched.process_many([msgs[0], msgs[0]])


GPU4 = ("cpu", "mem", "gpu", "gpu_mem")


def gpu_regime(t: int, period: int = 20) -> tuple[float, float, float, float]:
    """cpu and mem constant; only the GPU tells a busy phase from an idle one."""
    return (0.5, 5e8, 90.0, 3e10) if (t // period) % 2 else (0.5, 5e8, 3.0, 2e9)


def gpu_msg(host: str, ts: float, with_gpu: dict[str, tuple], cpu_only: dict[str, tuple[float, float]]
            ) -> HostSamples:
    cs = [ContainerSample(container=c, cpu_cores=u[0], mem_bytes=u[1], gpu_util=u[2], gpu_mem_bytes=u[3],
                          nr_periods=10) for c, u in with_gpu.items()]
    cs += [ContainerSample(container=c, cpu_cores=cpu, mem_bytes=mem, nr_periods=10)
           for c, (cpu, mem) in cpu_only.items()]
    return HostSamples(host=host, ts=ts, interval_s=1.0, containers=tuple(cs))


def test_gpu_features_shape_the_phases_but_only_cpu_and_mem_get_limits():
    s = Settings.from_env({"policy": "phase", "recommend_interval_s": 1.0, "vpa_time_scale": 0.001,
                           "safety_rules": False,
                           "phase_learn_every": 1,
                           "phase_learn_batch": 1000, "phase_features": "gpu_mem,gpu,mem,cpu"}, env={})
    assert s.phase.feature_tuple() == GPU4
    model = PhaseModel(features=GPU4, n_his=2, warmup=32, seed=0)
    W = np.array([[gpu_regime(t + k) for k in range(3)] for t in range(160)])
    for _ in range(4):
        learn(model, W)
    cache = state_cache(s)
    hooks = PhaseHooks(detector_config(s), cache, model=model, version=1)
    decisions, changes = [], []
    for t in range(100):
        hs = gpu_msg("h1", 1000.0 + t, {"train": gpu_regime(t)}, {"web": (0.3, 4e8)})
        process_host_samples(cache, hs, updater_config(s))
        out = hooks.process_many([hs])
        decisions += out.decisions
        changes += out.changes
        if t == 40:  # a snapshot with phase statistics lands
            V = np.array([[gpu_regime(k + j) for j in range(3)] for k in range(120)])
            model.clusterer.update_rel_stats(model.predict(V), V[:, -1] / V[:, -1].max(axis=0))
            hooks.latest = lambda m=model: (ModelSnapshot(name=model_name(GPU4), ts=1.0, version=2,
                                                          payload_b64="", samples_seen=0), m)
    # cpu and mem never move: the train container's phase changes come from its GPU columns
    train = [c for c in changes if c.container == "train"]
    assert sum(c.old_phase is not None for c in train) >= 3
    assert {d.container for d in decisions} == {"train", "web"}  # a GPU-less container is tracked too
    assert any(d.details["source"] == "fallback:vpa" for d in decisions)  # cold phases: VPA's cpu/mem limits
    ph = [d for d in decisions if d.details["source"] == "phase"]
    assert ph
    for d in decisions:
        assert set(d.details["sources"]) <= {"cpu", "mem"} and set(d.details["stats"]) <= {"cpu", "mem"}
        assert d.cpu_limit_cores is not None or d.mem_limit_bytes is not None
        assert decode(Decision, encode(d)) == d
    # the learner gets 4-feature windows; the GPU-less container's GPU readings are missing (NaN)
    Wb, P, U, LV = decode_learn_batch(hooks.take_learn_batch(), model_name(GPU4), hooks.fleet.model.window_len, 4)
    assert Wb.shape[2] == 4 and np.isnan(U[:, 2]).any() and (U[:, 2] >= 90).any()
    assert Learner(model.clone(), 2, 0).learn(Wb, P, U, LV) == len(Wb)


class _Round:
    """The worker's phase side as ``worker_round`` steps it (decisions out, shadow kept)."""

    def __init__(self, hooks: PhaseHooks) -> None:
        self.hooks, self.shadow = hooks, []

    def process_many(self, msgs):
        out = self.hooks.process_many(msgs)
        self.shadow = out.shadow
        return out.decisions


def _stats_model() -> PhaseModel:
    model = warm_model()
    W = np.array([[regime(k + j) for j in range(3)] for k in range(120)])
    model.clusterer.update_stats(model.predict(W), W[:, -1])
    model.clusterer.update_rel_stats(model.predict(W), W[:, -1] / W[:, -1].max(axis=0))
    return model


@pytest.mark.parametrize("together", [True, False])
def test_a_restart_from_the_stored_states_decides_what_an_unkilled_worker_decides(together):
    """The samples agent's commit and restart, in process: a commit every 5 messages writes the marked
    states (the VPA's through ``pop_with``, then the phase's) and commits the samples' offset no further
    than ``hold_back``; a kill loses everything in memory, and the restarted worker loads the stored states,
    reads from the committed offset and skips what a stored state holds (``unlearned``). The decisions are
    those of a run without a kill. Written apart (the VPA's and the phase's states each when due), the phase
    steps the samples again over a VPA state that already learned them: other decisions."""
    import json

    from phasewise.models.vpa.updater import worker_round

    s = Settings.from_env({"policy": "phase", "recommend_interval_s": 1.0, "vpa_time_scale": 0.001,
                           "safety_rules": False, "hysteresis": 0.05}, env={})
    cfg, model = updater_config(s), _stats_model()
    rng = np.random.default_rng(3)
    msgs = [msg("h1", 1000.0 + t, {"job": regime(t, 7), "slow": regime(t, 23),
                                   "noisy": (float(rng.uniform(0.1, 1.2)), float(rng.uniform(2e8, 9e8))),
                                   "steady": (0.5, 5e8)})  # written seldom: it holds the commits back
            for t in range(240)]

    def start(vpa: dict, phase: dict):
        cache = state_cache(s, loader=lambda k: json.loads(vpa[k]) if k in vpa else None)
        hooks = PhaseHooks(detector_config(s), cache, model=model.clone(),
                           loader=lambda k: json.loads(phase[k]) if k in phase else None)
        return cache, hooks

    cache, hooks = start({}, {})
    want = {d.id for m in msgs for d in worker_round(cache, [m], cfg, _Round(hooks))}

    vpa, phase = {}, {}
    cache, hooks = start(vpa, phase)
    got, pos, committed, kills, skipped = set(), 0, 0, {53, 121, 188}, 0
    while pos < len(msgs):
        m = cache.unlearned(msgs[pos], pos)
        skipped += len(msgs[pos].containers) - len(m.containers)
        got.update(d.id for d in worker_round(cache, [m], cfg, _Round(hooks)))
        cache.learned(m, pos, 0, now=float(pos))
        pos += 1
        if pos % 5 == 0:  # a commit: the states, then the offsets
            states = (hooks.pop_with(float(pos), 30.0) if together
                      else cache.pop_dirty(float(pos), 30.0))
            vpa.update((k, json.dumps(st)) for k, st in states)
            phase_states = hooks.pop_dirty()
            phase.update((k, json.dumps(st)) for k, st in phase_states)
            if together:  # the same containers, holding the same samples
                assert sorted(k for k, _ in phase_states) == sorted(k for k, _ in states)
                assert all(st["so"] == cache.source_offset(k) >= pos - 1 for k, st in phase_states)
            committed = min(pos, cache.hold_back().get(0, pos))
        if pos in kills:
            kills.discard(pos)
            cache, hooks = start(vpa, phase)
            pos = committed
    assert len(want) > 40 and skipped  # enough decisions to tell a difference; samples read again were skipped
    if together:
        assert got == want
    else:
        assert got != want


def _snapshot_models() -> dict[int, PhaseModel]:
    """Versions of one model whose phase statistics differ (each decides other limits)."""
    W = np.array([[regime(k + j) for j in range(3)] for k in range(120)])
    out = {}
    for v, scale in ((1, 1.0), (2, 1.6), (3, 0.6)):
        m = warm_model()
        m.clusterer.update_stats(m.predict(W), W[:, -1] * scale)
        m.clusterer.update_rel_stats(m.predict(W), np.minimum(scale * W[:, -1] / W[:, -1].max(axis=0), 1.0))
        out[v] = m
    out[4] = out[2]
    return out


@pytest.mark.parametrize("pinned", [True, False])
def test_a_restart_across_model_snapshots_decides_the_samples_read_again_as_they_were_decided(pinned):
    """Snapshots land while a worker runs (in wall time, which goes on across a kill). The detectors swap only
    at a commit, which records from which offset each version decided (the partition's history; no state is
    written for it), and a restarted worker decides each sample it reads again with the version the history
    names for it, and swaps no further until it has processed what its partition held when it started
    (``ModelPin``): every decision a restarted worker makes for a sample the killed one had read is one the
    killed one (or one before it) made. Swapping at every step instead (``pinned`` False, the detectors as
    they were), the samples read again are decided with a newer model."""
    import json

    from phasewise.kit.records import ModelSnapshot
    from phasewise.models.phases.pinning import ModelPin, record_key, record_value, recorded_history
    from phasewise.models.vpa.updater import worker_round

    s = Settings.from_env({"policy": "phase", "recommend_interval_s": 1.0, "vpa_time_scale": 0.001,
                           "safety_rules": False, "hysteresis": 0.05, "state_write_interval_s": 100.0}, env={})
    cfg, models = updater_config(s), _snapshot_models()
    lands = {1: -1, 2: 37, 3: 62, 4: 150}  # the wall time at which each version becomes available
    rng = np.random.default_rng(3)
    msgs = [msg("h1", 1000.0 + t, {"job": regime(t, 7), "slow": regime(t, 23),
                                   "noisy": (float(rng.uniform(0.1, 1.2)), float(rng.uniform(2e8, 9e8))),
                                   "steady": (0.5, 5e8)})  # written seldom: it holds the commits back
            for t in range(240)]
    clock = [0]

    def snapshot(v: int):
        return ModelSnapshot(name=model_name(models[v].features), ts=1.0, version=v, payload_b64=""), models[v]

    def latest():
        return snapshot(max(k for k, t in lands.items() if t <= clock[0]))

    def start(vpa: dict, phase: dict, end: int, committed: int | None):
        cache = state_cache(s, loader=lambda k: json.loads(vpa[k]) if k in vpa else None)
        snap, model = latest()  # a worker starts on the newest snapshot
        hooks = PhaseHooks(detector_config(s), cache, model=model, version=snap.version,
                           loader=lambda k: json.loads(phase[k]) if k in phase else None, latest=latest)
        hooks.swap_on_step = not pinned
        pin = ModelPin(hooks.version)
        if pinned:
            available = [k for k, t in lands.items() if t <= clock[0]]
            assert not pin.assigned({0: recorded_history(phase.get(record_key(0)))}, {0: end}, {0: committed},
                                    available)
        return cache, hooks, pin

    def commit(cache, hooks, pin, pos, vpa, phase, committed):
        if pinned:  # what the phase agents do at the barrier's first step
            newer = hooks.newer()
            pin.version = hooks.version
            plan = pin.at_commit(None if newer is None else newer[0].version, {0: committed})
            if plan.swap:
                hooks.use(*newer)
            for _, h in plan.records.items():
                phase[record_key(0)] = record_value(h)
        states = hooks.pop_with(float(clock[0]), 100.0)
        vpa.update((k, json.dumps(st)) for k, st in states)
        phase.update((k, json.dumps(st)) for k, st in hooks.pop_dirty())
        return min(pos, cache.hold_back().get(0, pos))

    def run(kills: set[int]):
        """``(position, decision id, incarnation)`` of every decision, and the positions of the kills."""
        vpa, phase = {}, {}
        clock[0] = 0
        cache, hooks, pin = start(vpa, phase, len(msgs), None)
        out, pos, committed, inc, killed_at = [], 0, None, 0, []
        while pos < len(msgs):
            if pinned and (v := pin.version_at(0, pos)) != hooks.version:  # what the samples agent does
                hooks.use(*snapshot(v))
                pin.version = v
            m = cache.unlearned(msgs[pos], pos)
            out += [(pos, d.id, inc) for d in worker_round(cache, [m], cfg, _Round(hooks))]
            cache.learned(m, pos, 0, now=float(clock[0]))
            pin.processed(0, pos)
            pos += 1
            clock[0] += 1
            if pos % 10 == 0:
                committed = commit(cache, hooks, pin, pos, vpa, phase, committed)
            if pos in kills:
                kills.discard(pos)
                killed_at.append(pos)
                clock[0] += 9  # the restart takes a while: a snapshot may land meanwhile
                cache, hooks, pin = start(vpa, phase, pos + 2, committed)  # it had fetched 2 more
                pos, inc = committed or 0, inc + 1
        return out, killed_at

    want, _ = run(set())
    got, killed_at = run({58, 128, 198})
    made: dict[tuple[int, int], set[str]] = {}
    for p, i, inc in got:
        made.setdefault((p, inc), set()).add(i)
    again, differ = 0, []
    for p, i, inc in got:  # a restarted incarnation's decisions for the samples the one before it had read
        if inc > 0 and p < killed_at[inc - 1]:
            again += 1
            if i not in set().union(*(made.get((p, k), set()) for k in range(inc))):
                differ.append((p, inc, i))
    assert {(p, i) for p, i, inc in got if inc == 0} <= {(p, i) for p, i, _ in want}
    assert again > 10 and killed_at == [58, 128, 198]
    if pinned:
        assert not differ
    else:
        assert differ
