"""The live phase path: detector hooks and learner (pure), then a real ``--policy phase`` worker."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.bench.harness import RoleProcess, scrape
from phasewise.infra.broker import free_port
from phasewise.kafka import make_consumer, make_producer
from phasewise.models.detector import PhaseModel, learn
from phasewise.models.vpa_updater import process_host_samples, process_many
from phasewise.schemas import (
    ContainerSample,
    Decision,
    HostSamples,
    ModelSnapshot,
    PhaseChange,
    SchemaError,
    decode,
    encode,
)
from phasewise.settings import Settings
from phasewise.streams.config import state_cache, updater_config
from phasewise.streams.phase_agents import (
    Learner,
    PhaseHooks,
    decode_learn_batch,
    model_name,
    model_of,
)
from phasewise.topics import DECISIONS, MODELS, PHASES, SAMPLES

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


@pytest.mark.parametrize("writer", ["orjson", "json"])
@pytest.mark.parametrize("reader", ["orjson", "json"])
def test_learn_batches_round_trip_and_malformed_ones_say_why(monkeypatch, writer, reader):
    import phasewise.streams.phase_agents as pa

    assert pa._orjson is not None, "orjson is part of the streams extra"
    orj = pa._orjson

    def encode_learn_batch(*a, **kw):  # written by a worker with / without orjson
        monkeypatch.setattr(pa, "_orjson", orj if writer == "orjson" else None)
        try:
            return pa.encode_learn_batch(*a, **kw)
        finally:
            monkeypatch.setattr(pa, "_orjson", orj if reader == "orjson" else None)

    monkeypatch.setattr(pa, "_orjson", orj if reader == "orjson" else None)
    W = np.arange(24, dtype=float).reshape(4, 3, 2)
    raw = encode_learn_batch(NAME, W, np.array([0, -1, 2, 2]), W[:, -1])
    got_W, got_P, got_U, got_L = decode_learn_batch(raw, NAME, 3, 2)
    np.testing.assert_array_equal(got_W, W)
    assert got_P.tolist() == [0, -1, 2, 2] and got_U.tolist() == W[:, -1].tolist() and got_L is None
    # relative statistics: each window's container level travels with it (NaN: no level yet)
    L = np.array([[1.0, 2.0], [np.nan, 4.0], [5.0, 6.0], [7.0, 8.0]])
    *_, got_L = decode_learn_batch(encode_learn_batch(NAME, W, np.zeros(4), W[:, -1], L), NAME, 3, 2)
    np.testing.assert_array_equal(got_L, L)
    bad = json.loads(encode_learn_batch(NAME, W, np.zeros(4), W[:, -1], L))
    bad["levels"] = bad["levels"][:-1]
    with pytest.raises(SchemaError, match="levels do not match"):
        decode_learn_batch(json.dumps(bad).encode(), NAME, 3, 2)
    bad["levels"] = [-1.0] * 8
    with pytest.raises(SchemaError, match="negative level"):
        decode_learn_batch(json.dumps(bad).encode(), NAME, 3, 2)
    v1 = json.loads(raw)
    v1["v"] = 1  # written by a worker of the previous version: still learned from
    assert decode_learn_batch(json.dumps(v1).encode(), NAME, 3, 2)[3] is None
    with pytest.raises(SchemaError, match="not valid JSON"):
        decode_learn_batch(b"nope", NAME, 3, 2)
    with pytest.raises(SchemaError, match="shape"):
        decode_learn_batch(raw, NAME, 4, 2)
    with pytest.raises(SchemaError, match="this learner trains"):
        decode_learn_batch(raw, "other", 3, 2)
    W2 = W.copy()
    W2[1, 0, 0], W2[2, 1, 1] = np.nan, np.inf  # missing frames travel as null, come back as NaN
    got_W = decode_learn_batch(encode_learn_batch(NAME, W2[:, :, ::-1][:, :, ::-1], np.zeros(4), W2[:, -1]),
                               NAME, 3, 2)[0]
    assert np.isnan(got_W[1, 0, 0]) and np.isnan(got_W[2, 1, 1]) and np.isfinite(got_W).sum() == 22
    bad = json.loads(raw)
    for field, value in (("windows", "x"), ("usage", [[1.0], 2.0]), ("windows", ["a"] * 24)):
        with pytest.raises(SchemaError, match="bad arrays|array sizes"):
            decode_learn_batch(json.dumps({**bad, field: value}).encode(), NAME, 3, 2)


def test_a_cold_learner_takes_small_steps_until_warm_then_one_step_per_batch(monkeypatch):
    import phasewise.streams.phase_agents as pa

    steps: list[int] = []
    real = pa.learn

    def counting(model, windows, **kw):
        steps.append(len(windows))
        assert all(len(v) == len(windows) for v in kw.values() if v is not None)  # the slices line up
        return real(model, windows, **kw)

    monkeypatch.setattr(pa, "learn", counting)
    lr = Learner(PhaseModel(features=("cpu", "mem"), seed=1, warmup=64))
    W = np.array([[regime(t + k) for k in range(lr.model.window_len)] for t in range(100)])
    levels = W[:, -1] * 1.5
    assert lr.learn(W, np.full(100, -1), W[:, -1], levels) == 100
    assert steps == [16, 16, 16, 16, 36]  # warm after 64 windows: the rest in one step
    assert lr.learn(W, np.full(100, -1), W[:, -1]) == 100
    assert steps[-1] == 100 and lr.samples_seen == 200 and lr.model.crbm.n_seen == 200


def test_the_learner_publishes_monotonic_versions_only_after_learning_and_rebases_on_newer_ones():
    m = warm_model()
    lr = Learner(m.clone(), version=3)
    assert lr.snapshot() is None
    W = np.array([[regime(t + k) for k in range(3)] for t in range(10)])
    lr.learn(W, np.full(10, -1), W[:, -1])
    s = lr.snapshot()
    assert s is not None and s.version == 4 and s.samples_seen == 10 and lr.snapshot() is None
    assert model_of(s).to_bytes() == lr.model.to_bytes()
    newer = ModelSnapshot(name=NAME, ts=1.0, version=9, payload_b64=s.payload_b64, samples_seen=99)
    assert lr.rebase(newer, model_of(newer)) and lr.version == 9 and not lr.rebase(s, model_of(s))


def test_hooks_emit_phase_changes_and_phase_decisions_with_vpa_as_the_fallback():
    s = Settings.from_env({"recommend_interval_s": 1.0, "vpa_time_scale": 0.001, "safety_rules": False,
                           "phase_learn_every": 2,
                           "phase_learn_batch": 16}, env={})
    cache = state_cache(s)
    model = warm_model()
    hooks = PhaseHooks(s, cache, model=model, version=1)
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
    assert d.details["stats"]["cpu"]["p95"] * 1.1 <= d.cpu_limit_cores + 1e-3
    assert d.details["statistics"] == "relative" and d.details["stats"]["cpu"]["level_before"] > 0
    assert batches > 0
    for d in decisions:  # every decision is a valid record
        assert decode(Decision, encode(d)) == d



def test_hooks_hold_learn_windows_until_a_batch_is_full_and_hand_out_the_rest_on_request():
    s = Settings.from_env({"recommend_interval_s": 1.0, "vpa_time_scale": 0.001, "safety_rules": False,
                           "phase_learn_every": 1,
                           "phase_learn_batch": 7}, env={})
    cache = state_cache(s)
    hooks = PhaseHooks(s, cache, model=warm_model(), version=1)
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
    s = Settings.from_env({"recommend_interval_s": 1.0, "vpa_time_scale": 0.001, "safety_rules": False,
                           "phase_learn_every": 3,
                           "phase_learn_batch": 1}, env={})
    caches = [state_cache(s), state_cache(s)]
    per_msg, batched = (PhaseHooks(s, c, model=warm_model(), version=1) for c in caches)
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
    s = Settings.from_env({"recommend_interval_s": 1.0, "vpa_time_scale": 0.001, "safety_rules": False,
                           "phase_learn_every": 1,
                           "phase_learn_batch": 1000, "phase_features": "gpu_mem,gpu,mem,cpu"}, env={})
    assert s.phase_feature_tuple() == GPU4
    model = PhaseModel(features=GPU4, n_his=2, warmup=32, seed=0)
    W = np.array([[gpu_regime(t + k) for k in range(3)] for t in range(160)])
    for _ in range(4):
        learn(model, W)
    cache = state_cache(s)
    hooks = PhaseHooks(s, cache, model=model, version=1)
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


def test_phase_features_are_checked_and_pick_the_starting_model():
    from phasewise.models.detector import FEATURES as MODEL_FEATURES
    from phasewise.settings import PHASE_FEATURES, SettingsError
    from phasewise.streams.phase_agents import initial_model

    assert PHASE_FEATURES == tuple(MODEL_FEATURES)
    for bad, why in (("cpu,gpu", "must hold cpu,mem"), ("cpu,mem,tpu", "unknown feature"),
                     ("cpu,mem,mem", "twice")):
        with pytest.raises(SettingsError, match=why):
            Settings.from_env({"phase_features": bad}, env={})
    m, origin = initial_model(Settings.from_env({}, env={}))
    assert m.features == ("cpu", "mem") and origin.startswith("pretrained") and m.ready
    m, origin = initial_model(Settings.from_env({"phase_features": "cpu,mem,gpu"}, env={}))
    assert m.features == ("cpu", "mem", "gpu") and origin == "cold" and not m.ready
    with pytest.raises(SettingsError, match="phase_ratio_cap"):
        Settings.from_env({"phase_ratio_cap": -1.0}, env={})
    for cap, want in ((1.5, 1.5), (0.0, float("inf"))):  # 0 = no cap
        s = Settings.from_env({"phase_ratio_cap": cap}, env={})
        assert PhaseHooks(s, state_cache(s), model=warm_model()).fleet.ratio_cap == want
    with pytest.raises(ValueError, match="must include"):
        PhaseHooks(Settings.from_env({}, env={}), state_cache(Settings.from_env({}, env={})),
                   model=PhaseModel(features=("mem", "gpu")))


# ---------------------------------------------------------------------------------------- a real worker
class Worker:
    def __init__(self, settings: Settings, tmp, worker_id: str) -> None:
        self.metrics_port = free_port()
        self.tmp = tmp
        # the phase pipeline's own decisions: tests/streams/test_safety_rules.py runs one with the rules on
        env = {"PHASEWISE_BOOTSTRAP": settings.bootstrap, "PHASEWISE_VPA_TIME_SCALE": "0.001",
               "PHASEWISE_LOG_LEVEL": "info", "PHASEWISE_SAFETY_RULES": "false"}
        self.args = ["--policy", "phase", "--snapshot-interval", "1", "--learn-every", "1", "--phase-warmup", "32",
                     "--recommend-interval", "1", "--web-port", "0", "--worker-id", worker_id,
                     "--data-dir", str(tmp / "data"), "--metrics-port", str(self.metrics_port)]
        self.env = env
        self.role: RoleProcess | None = None

    def start(self, timeout_s: float = 60.0) -> Worker:
        self.role = RoleProcess("worker", self.args, env=self.env,
                                log_path=self.tmp / f"worker-{uuid.uuid4().hex[:4]}.log").start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.role.alive(), "worker exited:\n" + self.role.log_tail()
            try:
                if self.metric("phasewise_worker_ready") == 1.0:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("worker not ready:\n" + self.role.log_tail())

    def metric(self, name: str) -> float:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics").get(name, 0.0)

    def log(self) -> str:
        assert self.role is not None
        return self.role.log_path.read_text(errors="replace")


def read_until(settings: Settings, topic: str, partitions: int, pred, timeout_s: float, what: str) -> list:
    c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    hits: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None or m.error():
                if hits:
                    return hits
                continue
            v = pred(m)
            if v is not None:
                hits.append(v)
        if hits:
            return hits
        raise TimeoutError(f"no {what} within {timeout_s:.0f}s")
    finally:
        c.close()


def _snapshot(m):
    try:
        s = decode(ModelSnapshot, m.value())
    except SchemaError:
        return None
    return s if s.name == NAME else None


@pytest.mark.broker
@pytest.mark.slow
def test_a_phase_worker_publishes_snapshots_and_phase_changes_and_a_restart_resumes_from_the_snapshot(
        settings, tmp_path):
    w = Worker(settings, tmp_path, f"pwtest-phase-{uuid.uuid4().hex[:6]}").start()
    host = f"ph-{uuid.uuid4().hex[:6]}"
    p = make_producer(settings)
    t0 = time.time() - 3600

    def send(lo: int, hi: int) -> None:
        for t in range(lo, hi):
            p.produce(SAMPLES.name, key=host.encode(), value=encode(msg(host, t0 + t, {"job": regime(t)})))
        p.flush(10)

    try:
        send(0, 120)  # the learner warms the shared model up on the detectors' windows
        deadline = time.monotonic() + 40
        warm = None
        while warm is None and time.monotonic() < deadline:
            snaps = read_until(settings, MODELS.name, 1, _snapshot, 5, "model snapshot")
            warm = next((s for s in reversed(snaps) if model_of(s).ready), None)
        assert warm is not None, "no warm snapshot:\n" + w.role.log_tail()
        deadline = time.monotonic() + 20
        while w.metric("phasewise_worker_model_version") < warm.version and time.monotonic() < deadline:
            time.sleep(0.2)
        send(120, 240)  # now the detector knows the phases: the regime switches are phase changes

        def change(m):
            try:
                c = decode(PhaseChange, m.value())
            except SchemaError:
                return None
            return c if c.host == host and c.container == "job" else None

        changes = read_until(settings, PHASES.name, PHASES.partitions, change, 30, "phase change")
        assert any(c.old_phase is not None and c.new_phase != c.old_phase for c in changes), changes

        def decision(m):
            try:
                d = decode(Decision, m.value())
            except SchemaError:
                return None
            return d if d.host == host else None

        ds = read_until(settings, DECISIONS.name, DECISIONS.partitions, decision, 20, "decision")
        assert ds and all(d.policy == "phase" for d in ds)
        assert {d.details["source"] for d in ds} <= {"phase", "fallback:vpa", "mixed"}
        assert w.metric("phasewise_worker_snapshots_published_total") >= 1
        assert w.metric("phasewise_worker_phase_changes_total") >= 2
        version = w.metric("phasewise_worker_model_version")
        assert w.role.stop() == 0

        w.start()  # a restart resumes from the newest snapshot on the compacted topic
        assert w.metric("phasewise_worker_model_version") >= version
        assert "phase detector starts from snapshot v" in w.log()
    finally:
        if w.role is not None:
            w.role.stop()
