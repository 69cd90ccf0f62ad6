"""No poison pill, nothing lost: real roles fed every kind of bad record between valid ones.

A real ``phasewise worker`` (``--policy vpa`` and ``--policy phase``) and a real
``phasewise actuate`` (dry-run backend) run as subprocesses on the session's
embedded broker. Between valid records each input topic gets: a null value, a
100,000-deep JSON array, 600 kB of random bytes, a 5,000-digit integer inside
otherwise valid JSON, 100,000-deep nesting inside a valid-looking object, and
fields of the wrong types. Every valid record must be handled (a decision, an
actuation, windows learned, a snapshot loaded), every bad one dead-lettered
with its reason (the 600 kB one truncated to fit, and marked so), and the
process must live to the end and stop with status 0. An agent that dies on
something else stops the worker with status 1, and a worker that takes over
handles every record the dead one had not.
"""

from __future__ import annotations

import functools
import json
import random
import sys
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    Actuation,
    ContainerSample,
    DeadLetter,
    Decision,
    ExecutionProfile,
    HostSamples,
    ModelSnapshot,
    SchemaError,
    decode,
    encode,
    to_dict,
)
from phasewise.kit.settings import Settings
from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, DECISIONS, MODELS, PROFILES, SAMPLES

pytestmark = [pytest.mark.broker, pytest.mark.slow]

T0 = time.time() - 3600
_PLACEHOLDER = "__number__"


def _with_number(d: dict, field: str, digits: int = 5000) -> bytes:
    """JSON of *d* with *field* set to an integer of *digits* digits (json.dumps refuses to write one)."""
    text = json.dumps({**d, field: _PLACEHOLDER}, separators=(",", ":"))
    return text.replace(f'"{_PLACEHOLDER}"', "7" * digits).encode()


def _deep_inside(d: dict, depth: int = 100_000) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode()[:-1] + b',"extra":' + b"[" * depth + b"]" * depth + b"}"


def poison(valid: dict, number_field: str, wrong: dict, wrong_reason: str = "must be", *,
           max_bytes: int | None = None) -> dict[str, tuple[bytes | None, str]]:
    """The poison kinds: ``{kind: (value, what its dead letter's reason says)}``.

    *max_bytes*: the record's own message limit (``JobEvent.MAX_BYTES``): each kind is made to fit under
    it (so that its own reason is what refuses it), and one more, a valid record padded past it, is refused
    for its size.
    """
    rnd = random.Random(7)
    room = 100_000 if max_bytes is None else min(100_000, (max_bytes - len(json.dumps(valid)) - 64) // 2)
    out = {
        "null": (None, "has no value"),
        "deep-array": (b"[" * room, "nested too deeply"),
        "binary-600k": (rnd.randbytes(600_000 if max_bytes is None else max_bytes - 1), "not valid JSON"),
        "huge-int": (_with_number(valid, number_field), "4300 digits"),
        "deep-in-object": (_deep_inside(valid, room), "nested too deeply"),
        "wrong-types": (json.dumps({**valid, **wrong}).encode(), wrong_reason),
    }
    if max_bytes is not None:
        out["too-large"] = (json.dumps({**valid, "pad": "x" * max_bytes}).encode(), "larger than the limit")
    return out


class Sent:
    """Records produced to one topic, with their partition and offset once delivered."""

    def __init__(self, producer, topic: str) -> None:
        self.p, self.topic = producer, topic
        self.at: dict[tuple[int, int], str] = {}  # (partition, offset) -> label

    def send(self, key: bytes | None, value: bytes | None, label: str) -> None:
        def cb(err, msg) -> None:
            assert err is None, err
            self.at[(msg.partition(), msg.offset())] = label

        self.p.produce(self.topic, key=key, value=value, on_delivery=cb)
        self.p.poll(0)

    def where(self, prefix: str) -> dict[tuple[int, int], str]:
        return {k: v for k, v in self.at.items() if v.startswith(prefix)}


class Reader:
    def __init__(self, settings: Settings, topic: str, partitions: int) -> None:
        self.c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
        self.c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.values: list = []

    def drain(self) -> list:
        for m in self.c.consume(500, 0.2):
            if not m.error():
                self.values.append(m.value())
        return self.values

    def close(self) -> None:
        self.c.close()


def records(cls, values: list) -> list:
    """The values that decode as *cls* (other tests put malformed records on the shared topics)."""
    out = []
    for v in values:
        try:
            out.append(decode(cls, v))
        except SchemaError:
            pass
    return out


def dead_letters(values: list, topic: str) -> dict[tuple[int, int], DeadLetter]:
    out = {}
    for v in values:
        try:
            dl = decode(DeadLetter, v)
        except SchemaError:
            continue
        if dl.source_topic == topic:
            out[(dl.partition, dl.offset)] = dl
    return out


def wait(pred, timeout_s: float, what: str, role: RoleProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert role.alive(), f"{what}: the role died:\n{role.log_tail(60)}"
        if pred():
            return
        time.sleep(0.2)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s:\n{role.log_tail(40)}")


def check_dead_letters(letters: dict, sent: dict[tuple[int, int], str], kinds: dict) -> None:
    """Every poison record of *sent* (label ``poison:<kind>``) has its dead letter, with its reason."""
    for at, label in sent.items():
        kind = label.split(":")[1]
        dl = letters[at]
        value, why = kinds[kind]
        assert why in dl.reason, (kind, dl.reason)
        assert dl.payload_bytes == (None if value is None else len(value))
        if kind == "binary-600k":
            assert dl.truncated and 0 < len(dl.payload.encode()) < 900_000, kind
        elif value is not None and kind != "binary-600k":
            assert not dl.truncated and dl.payload == value.decode(), kind


def start_worker(settings: Settings, tmp_path, policy: str, worker_id: str, *, fault: str | None = None):
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_VPA_TIME_SCALE": "0.001",
           "PHASEWISE_LOG_LEVEL": "info", "PHASEWISE_PHASE_SNAPSHOT_INTERVAL_S": "3600",
           "PHASEWISE_SAFETY_RULES": "false"}  # every valid sample decided: nothing lost is what is counted
    args = ["--policy", policy, "--recommend-interval", "0", "--web-port", "0", "--worker-id", worker_id,
            "--data-dir", str(tmp_path / f"data-{uuid.uuid4().hex[:4]}"), "--metrics-port", str(port)]
    role = RoleProcess("worker", args, env=env, log_path=tmp_path / f"worker-{uuid.uuid4().hex[:4]}.log")
    if fault is not None:  # the same worker, with one failure injected that is no record's fault
        role.cmd = [sys.executable, "-c", fault, "worker", *args]
    role.start()
    url = f"http://127.0.0.1:{port}/metrics"

    def ready() -> bool:
        try:
            return scrape(url).get("phasewise_worker_ready") == 1.0
        except OSError:
            return False

    wait(ready, 150, "worker ready", role)
    return role, url


def valid_sample(host: str, i: int) -> bytes:
    return encode(HostSamples(host=host, ts=T0 + i, interval_s=1.0, containers=(
        ContainerSample(container=f"v{i:04d}", cpu_cores=0.5, mem_bytes=3e8, nr_periods=10),)))


SAMPLE_POISON = poison(to_dict(HostSamples(host="poison", ts=T0, interval_s=1.0, containers=(
    ContainerSample(container="c", cpu_cores=1.0, mem_bytes=1e8),))), "ts",
    {"host": 7, "ts": "yesterday", "containers": {"c": 1}})


def send_samples(sent: Sent, host: str, n_valid: int) -> None:
    """*n_valid* valid samples (one new container each), every poison kind twice in between."""
    kinds = list(SAMPLE_POISON)
    for i in range(n_valid):
        sent.send(host.encode(), valid_sample(host, i), f"valid:{host}/v{i:04d}")
        if i % 4 == 3 and (i // 4) < 2 * len(kinds):
            kind = kinds[(i // 4) % len(kinds)]
            sent.send(host.encode(), SAMPLE_POISON[kind][0], f"poison:{kind}")
    assert sent.p.flush(60) == 0


@pytest.mark.parametrize("policy", ["vpa", "phase"])
def test_a_worker_dead_letters_every_poison_kind_and_decides_every_valid_record(broker, tmp_path, policy):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    if policy == "phase":
        from phasewise.streams.agents.phases import ensure_phase_topics

        ensure_phase_topics(s)
    role, url = start_worker(s, tmp_path, policy, f"pwtest-poison-{uuid.uuid4().hex[:6]}")
    letters_r = Reader(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
    decisions_r = Reader(s, DECISIONS.name, DECISIONS.partitions)
    try:
        host = f"poison-{uuid.uuid4().hex[:6]}"
        samples = Sent(make_producer(s), SAMPLES.name)
        send_samples(samples, host, 60)
        learn = models = profiles = None
        if policy == "phase":
            learn, models, learned, last_version = _phase_inputs(s)
        else:  # the known-job priors' follower reads the profiles topic
            profiles = _profile_inputs(s)
        m0 = scrape(url)

        want = {label.split(":", 1)[1] for label in samples.where("valid").values()}

        def decided() -> set[str]:
            return {f"{d.host}/{d.container}" for d in records(Decision, decisions_r.drain())} & want

        wait(lambda: decided() == want, 120, "decision for every valid sample", role)
        poisoned = samples.where("poison")
        wait(lambda: set(poisoned) <= set(dead_letters(letters_r.drain(), SAMPLES.name)), 60,
             "dead letter for every poison sample", role)
        check_dead_letters(dead_letters(letters_r.values, SAMPLES.name), poisoned, SAMPLE_POISON)
        if policy == "phase":
            from phasewise.kit.topics import LEARN_WINDOWS

            # every valid learn batch learned (the detectors send none: their windows are not full)
            wait(lambda: scrape(url).get("phasewise_worker_windows_learned_total", 0) >= learned, 60,
                 "every valid learn batch learned", role)
            wait(lambda: scrape(url).get("phasewise_worker_model_snapshot_latest", 0) == last_version, 60,
                 "the last valid snapshot loaded", role)
            for sent, topic, kinds in ((learn, LEARN_WINDOWS.name, learn_poison()),
                                       (models, MODELS.name, model_poison())):
                wait(lambda sent=sent, topic=topic: set(sent.where("poison")) <= set(
                    dead_letters(letters_r.drain(), topic)), 60, f"dead letter for every poison record on {topic}",
                    role)
                check_dead_letters(dead_letters(letters_r.values, topic), sent.where("poison"), kinds)
                assert not set(sent.where("valid")) & set(dead_letters(letters_r.values, topic))
        if profiles is not None:
            wait(lambda: set(profiles.where("poison")) <= set(dead_letters(letters_r.drain(), PROFILES.name)), 60,
                 "dead letter for every poison record on the profiles topic", role)
            check_dead_letters(dead_letters(letters_r.values, PROFILES.name), profiles.where("poison"),
                               profile_poison())
            assert not set(profiles.where("valid")) & set(dead_letters(letters_r.values, PROFILES.name))
        assert not set(samples.where("valid")) & set(dead_letters(letters_r.values, SAMPLES.name))
        m = scrape(url)
        n_bad = len(poisoned) + (0 if learn is None else len(learn.where("poison")) + len(models.where("poison")))
        n_bad += 0 if profiles is None else len(profiles.where("poison"))
        # (the worker also reads what other tests left on the topics: at least ours)
        assert m['phasewise_worker_dead_letters_total{kind="schema"}'] >= n_bad
        assert m["phasewise_worker_ready"] == 1.0 and role.alive()
        assert m0["phasewise_worker_ready"] == 1.0
    finally:
        letters_r.close()
        decisions_r.close()
        rc = role.stop(30)
    assert rc == 0, role.log_tail(40)
    assert "died" not in role.log_path.read_text(errors="replace")


def _valid_profile(i: int) -> ExecutionProfile:
    return ExecutionProfile(signature="poison-job", host="poison-profiles", container=f"run-{i}", ts=T0 + 60,
                            start=T0, samples=60, cpu_peak_cores=1.0, mem_peak_bytes=3e8)


def profile_poison() -> dict[str, tuple[bytes | None, str]]:
    return poison(to_dict(_valid_profile(0)), "ts", {"samples": "many", "cpu_peak_cores": [1]})


def _profile_inputs(s: Settings) -> Sent:
    """Valid profiles with every poison kind between them, on the profiles topic."""
    sent = Sent(make_producer(s), PROFILES.name)
    for i, (kind, (value, _)) in enumerate(profile_poison().items()):
        p = _valid_profile(i)
        sent.send(f"{p.host}/{p.container}".encode(), encode(p), "valid:profile")
        sent.send(b"poison-profiles/x", value, f"poison:{kind}")
    assert sent.p.flush(60) == 0
    return sent


@functools.cache
def shipped_model():
    """The model a --policy phase worker starts from with no snapshot (its learner's too)."""
    from phasewise.streams.config import initial_model

    return initial_model(Settings())[0]


def _learn_batch(name: str, n: int, seed: int) -> bytes:
    from phasewise.kit.records.learn_batches import encode_learn_batch

    L = shipped_model().window_len
    rng = np.random.default_rng(seed)
    W = np.stack([rng.uniform(0, 4, (n, L)), rng.uniform(1e8, 4e9, (n, L))], axis=-1)
    return encode_learn_batch(name, W, np.full(n, -1), W[:, -1], W[:, -1] * 1.2)


def _snapshot(version: int) -> bytes:
    from phasewise.models.phases.snapshots import snapshot_of

    return encode(snapshot_of(shipped_model(), version, 1, time.time()))


@functools.cache
def learn_poison() -> dict:
    from phasewise.models.phases.snapshots import model_name

    valid = json.loads(_learn_batch(model_name(shipped_model().features), 2, 0))
    return poison(valid, "v", {"windows": "many", "prev_phase": [True, "x"]}, "bad arrays")


@functools.cache
def model_poison() -> dict:
    from phasewise.models.phases.snapshots import snapshot_of

    snap = to_dict(snapshot_of(shipped_model(), 1, 1, time.time()))
    kinds = poison(snap, "version", {"version": "two", "payload_b64": 5})
    return {**kinds, "not-a-model": (encode(ModelSnapshot(name=snap["name"], ts=T0, version=2**40,
                                                           payload_b64="UFdDSwAAAAA=")), "payload is no PhaseModel")}


def _phase_inputs(s: Settings):
    """Valid learn batches and snapshots with every poison kind between them; what the worker must learn."""
    from phasewise.kit.topics import LEARN_WINDOWS
    from phasewise.models.phases.snapshots import model_name

    name = model_name(shipped_model().features)
    learn, models = Sent(make_producer(s), LEARN_WINDOWS.name), Sent(make_producer(s), MODELS.name)
    learned = 0
    for i, (kind, (value, _)) in enumerate(learn_poison().items()):
        learn.send(name.encode(), _learn_batch(name, 3 + i, i), "valid:learn")
        learned += 3 + i
        learn.send(name.encode(), value, f"poison:{kind}")
    learn.send(name.encode(), _learn_batch(name, 5, 99), "valid:learn")
    learned += 5
    version = int(time.time() * 1000)
    for kind, (value, _) in model_poison().items():
        version += 1
        models.send(name.encode(), _snapshot(version), "valid:snapshot")
        models.send(name.encode(), value, f"poison:{kind}")
    version += 1
    models.send(name.encode(), _snapshot(version), "valid:snapshot")
    assert learn.p.flush(60) == 0 and models.p.flush(60) == 0
    return learn, models, learned, version


DECISION_POISON = poison(to_dict(Decision(id="x", ts=T0, host="h", container="c", action="limit", policy="t",
                                          cpu_limit_cores=1.0)), "ts", {"id": 5, "action": ["limit"],
                                                                        "details": "none"})


def test_an_actuator_dead_letters_every_poison_kind_and_reports_every_valid_decision(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    host = f"poison-act-{uuid.uuid4().hex[:6]}"
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_LOG_LEVEL": "info"}
    args = ["--backend", "dry-run", "--host", host, "--data-dir", str(tmp_path / "act"),
            "--cgroup-root", str(tmp_path / "no-cgroups")]  # every well-named container counts as existing

    def actuator() -> RoleProcess:
        return RoleProcess("actuate", args, env=env, log_path=tmp_path / f"act-{uuid.uuid4().hex[:4]}.log").start()

    role = actuator()
    letters_r = Reader(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
    acts_r = Reader(s, ACTUATIONS.name, ACTUATIONS.partitions)
    try:
        sent = Sent(make_producer(s, partitioner=PARTITIONER), DECISIONS.name)  # the host's partition
        ids = []
        kinds = list(DECISION_POISON)
        for i in range(40):
            d = Decision(id=f"{host}-{i}", ts=T0 + i, host=host, container=f"v{i}", action="limit",
                         policy="test", cpu_limit_cores=1.0)
            ids.append(d.id)
            sent.send(host.encode(), encode(d), f"valid:{d.id}")
            if i % 3 == 2 and (i // 3) < 2 * len(kinds):
                kind = kinds[(i // 3) % len(kinds)]
                sent.send(host.encode(), DECISION_POISON[kind][0], f"poison:{kind}")
        assert sent.p.flush(60) == 0

        def reported() -> set[str]:
            return {a.decision_id for a in records(Actuation, acts_r.drain())} & set(ids)

        wait(lambda: reported() == set(ids), 90, "an actuation for every valid decision", role)
        poisoned = sent.where("poison")
        wait(lambda: set(poisoned) <= set(dead_letters(letters_r.drain(), DECISIONS.name)), 60,
             "dead letter for every poison decision", role)
        letters = dead_letters(letters_r.values, DECISIONS.name)
        check_dead_letters(letters, poisoned, DECISION_POISON)
        assert not set(sent.where("valid")) & set(letters)
        n_acts, n_letters = len(acts_r.values), len(letters_r.values)
        assert role.stop(30) == 0, role.log_tail(40)
        # everything handled was committed: a restarted actuator (same group) has nothing to redo
        role = actuator()
        time.sleep(12)  # a group join on the embedded broker takes ~half the 6 s session timeout
        assert role.alive(), role.log_tail(40)
        assert len(acts_r.drain()) == n_acts and len(letters_r.drain()) == n_letters
    finally:
        letters_r.close()
        acts_r.close()
        rc = role.stop(30)
    assert rc == 0, role.log_tail(40)


def _where_it_stood(settings: Settings, group: str, sent: Sent, missing: set[str], metrics_url: str) -> str:
    """The group's committed offsets and the watermarks of the partitions the test wrote to, the first
    missing samples' offsets and the second worker's message counters: what a failure needs to be read."""
    c = make_consumer(settings, group)
    try:
        parts = sorted({p for p, _ in sent.at})
        committed = c.committed([TopicPartition(SAMPLES.name, p) for p in parts], timeout=10)
        marks = {p: c.get_watermark_offsets(TopicPartition(SAMPLES.name, p), timeout=10) for p in parts}
    finally:
        c.close()
    where = {label.split(":", 1)[1]: at for at, label in sent.at.items() if label.startswith("valid:")}
    first = sorted((where[m], m) for m in missing)[:5]
    try:
        counters = {k: v for k, v in scrape(metrics_url).items() if "messages" in k or "samples" in k}
    except OSError as e:
        counters = {"scrape failed": str(e)}
    return (f"committed {[(t.partition, t.offset) for t in committed]}, watermarks {marks}, "
            f"{len(missing)} missing, first {first}; role2 counters {counters}")


#: a worker whose samples agent fails (not on a record) at the 25th valid message of this test, mid-batch
FAULT = """
import sys
import phasewise.streams.output as out
real, calls = out.PartitionMap.note, [0]
def note(self, host, *a, **kw):
    calls[0] += host.startswith("fault-")
    if calls[0] == 25:
        raise RuntimeError("injected failure: not a record's fault")
    return real(self, host, *a, **kw)
out.PartitionMap.note = note
from phasewise.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_agent_stops_the_worker_with_status_1_and_the_next_worker_loses_nothing(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    worker_id = f"pwtest-fault-{uuid.uuid4().hex[:6]}"
    role, _ = start_worker(s, tmp_path, "vpa", worker_id, fault=FAULT)
    decisions_r = Reader(s, DECISIONS.name, DECISIONS.partitions)
    try:
        host = f"fault-{uuid.uuid4().hex[:6]}"
        # one record per batch, as a host agent's one message per tick is: 216 records in a few batches made the
        # embedded broker report the partition's high watermark at the last batch's first offset (40 of 216 in
        # one failed run), and the second worker, which reads from the start, stopped short of the rest
        sent = Sent(make_producer(s, **{"linger.ms": 0, "batch.num.messages": 1}), SAMPLES.name)
        send_samples(sent, host, 200)
        deadline = time.monotonic() + 60
        while role.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not role.alive(), "the worker went on with a dead agent"
        assert role.proc.returncode == 1
        log = role.log_path.read_text(errors="replace")
        assert "agent phasewise.vpa-samples died: RuntimeError: injected failure" in log
        # the same consumer group takes over: every valid sample is decided (none was committed unhandled)
        role2, url2 = start_worker(s, tmp_path, "vpa", worker_id)
        want = {label.split(":", 1)[1] for label in sent.where("valid").values()}

        def decided() -> set[str]:
            return {f"{d.host}/{d.container}" for d in records(Decision, decisions_r.drain())}

        try:
            try:
                wait(lambda: want <= decided(), 120, "a decision for every valid sample", role2)
            except TimeoutError as e:  # say where the group stood, what was missing and what role2 counted
                raise AssertionError(f"{e}\n{_where_it_stood(s, worker_id, sent, want - decided(), url2)}") from None
        finally:
            assert role2.stop(30) == 0
    finally:
        decisions_r.close()
        role.stop(5)
