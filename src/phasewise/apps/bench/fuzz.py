"""``phasewise bench fuzz``: hostile messages at a real consumer, valid ones in between.

A seeded :class:`Fuzzer` makes hostile messages of the :data:`KINDS` for one
input topic; each goes first to the consumer's decoder in this process, then
through Kafka to the real role, and the result counts what was dead-lettered,
handled, lost or crashed. docs/benchmarks.md, "Hostile input" and "What each
bench measures".
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
import types
import typing
import uuid
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.kit.records import (
    MAX_BYTES,
    MAX_CORES,
    ContainerSample,
    Decision,
    HostSamples,
    ModelSnapshot,
    SchemaError,
    decode,
    decode_host_samples,
    encode,
    to_dict,
)

TOPICS = ("samples", "decisions", "learn-windows", "models")

#: hostile kinds every topic gets
COMMON_KINDS = (
    "null", "empty", "binary", "binary-600k", "deep-array", "deep-object", "deep-in-object", "not-utf8",
    "truncated", "top-level", "huge-int", "float-overflow", "int64-overflow", "nan", "wrong-type",
    "missing-field", "negative", "above-max", "bad-version",
)
#: and those particular to a topic
TOPIC_KINDS = {
    "samples": ("container-field", "huge-string"),
    "decisions": ("enum",),
    "learn-windows": ("shape", "other-model", "ragged", "bad-phase", "bad-levels",
                      "array-wrong-type"),
    "models": ("payload-not-base64", "payload-garbage", "payload-truncated", "payload-corrupt-body",
               "payload-inflates", "payload-huge-index", "payload-header", "payload-deep-header",
               "payload-other-features", "other-name"),
}
#: ModelSnapshot has no field with a maximum
KINDS = {t: tuple(k for k in COMMON_KINDS if not (t == "models" and k == "above-max")) + TOPIC_KINDS[t]
         for t in TOPICS}

_HUGE = "__phasewise_fuzz_number__"  # placeholder replaced by a number's text after json.dumps


def _fields(cls: type) -> list[tuple[str, type, bool, bool, dict]]:
    """``(name, type, optional, required, metadata)`` of a record's fields."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, optional = hints[f.name], False
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp, optional = args[0], True
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, tp, optional, required or f.name == "v", dict(f.metadata)))
    return out


def _dump(d: Any, number: str | None = None) -> bytes:
    """JSON text of *d* (NaN / Infinity literals allowed); the placeholder, if any, becomes *number*."""
    text = json.dumps(d, separators=(",", ":"))
    if number is not None:
        text = text.replace(json.dumps(_HUGE), number)
    return text.encode()


class Fuzzer:
    """Seeded hostile (and valid) messages for one input topic of phasewise.

    *host*: the actuator's host (decisions); *model*: the worker's phase model
    (learn windows: its window length and features; models: its name and a
    valid payload).
    """

    def __init__(self, topic: str, seed: int = 0, *, host: str = "fuzz-host", model: Any = None,
                 messages: int = 0) -> None:
        if topic not in TOPICS:
            raise ValueError(f"topic must be one of {', '.join(TOPICS)}, got {topic!r}")
        self.topic = topic
        self.rng = random.Random(seed)
        self.host = host
        self.run = uuid.UUID(int=self.rng.getrandbits(128)).hex[:8]
        # valid message i is stamped t0 + i: all of them in the past (the worker refuses samples stamped more
        # than intake_max_future_s ahead of its clock), the first an hour and *messages* seconds ago
        self.t0 = time.time() - 3600.0 - max(0, int(messages))
        self.model = model
        if topic in ("learn-windows", "models"):
            from phasewise.models.phases.snapshots import model_name

            if model is None:
                raise ValueError(f"--topic {topic} needs the worker's phase model")
            self.name = model_name(model.features)
            self.payload = model.to_bytes()
        self.version = int(time.time() * 1000)  # model snapshots: above any time-stamped version

    # ------------------------------------------------------------------ valid messages
    def valid(self, i: int) -> tuple[bytes | None, bytes, str]:
        """``(key, value, token)`` of valid message *i*; the token names the evidence it was handled."""
        r = self.rng
        if self.topic == "samples":
            host, c = f"fuzz-{self.run}-h{i % 7}", f"v{i:06d}"
            hs = HostSamples(host=host, ts=self.t0 + i, interval_s=1.0, containers=(
                ContainerSample(container=c, cpu_cores=r.uniform(0.05, 3.0), mem_bytes=r.uniform(1e7, 4e9),
                                nr_periods=10),))
            return host.encode(), encode(hs), f"{host}/{c}"
        if self.topic == "decisions":
            d = Decision(id=f"fuzz-{self.run}-{i}", ts=self.t0 + i, host=self.host, container=f"v{i:06d}",
                         action="limit", policy="fuzz", reason="valid", cpu_limit_cores=r.uniform(0.1, 2.0))
            return self.host.encode(), encode(d), d.id
        if self.topic == "learn-windows":
            from phasewise.kit.records.learn_batches import encode_learn_batch

            n = r.randint(1, 8)
            W, U, LV = self._usage((n, self.model.window_len)), self._usage((n,)), self._usage((n,))
            P = np.array([r.randint(-1, 3) for _ in range(n)])
            return self.name.encode(), encode_learn_batch(self.name, W, P, U, LV), str(n)
        from phasewise.models.phases.snapshots import snapshot_of

        self.version += 1
        snap = snapshot_of(self.model, self.version, i, self.t0 + i)
        return self.name.encode(), encode(snap), str(self.version)

    def _usage(self, shape: tuple[int, ...]) -> np.ndarray:
        """Valid frames of the model's features, *shape* + (features,)."""
        hi = {"cpu": 4.0, "mem": 8e9, "gpu": 100.0, "gpu_mem": 8e9}
        cols = [np.array([self.rng.uniform(0.0, hi[f]) for _ in range(int(np.prod(shape)))]).reshape(shape)
                for f in self.model.features]
        return np.stack(cols, axis=-1)

    # ------------------------------------------------------------------ hostile messages
    def key(self) -> bytes | None:
        r = self.rng
        if self.topic == "models":
            return self.name.encode()  # the follower's own key: every hostile record is for it
        x = r.random()
        if x < 0.1:
            return None
        if x < 0.15:
            return r.randbytes(r.randint(1, 64))
        if x < 0.18:
            return r.randbytes(5000)  # a key too large for a dead letter: cut, and said so
        return f"fuzz-{self.run}-h{r.randint(0, 6)}".encode()

    def hostile(self) -> tuple[str, bytes | None, bytes | None]:
        """``(kind, key, value)`` of one hostile message (600 kB ones a quarter as often as the others)."""
        kinds = KINDS[self.topic]
        kind = self.rng.choices(kinds, [0.25 if k == "binary-600k" else 1.0 for k in kinds])[0]
        return kind, self.key(), self.make(kind)

    def base(self) -> tuple[dict, type | None]:
        """A valid message of the topic as a dict, and its record class (None: learn batch)."""
        r = self.rng
        if self.topic == "samples":
            cs = [ContainerSample(container=f"h{j}", cpu_cores=r.uniform(0, 4), mem_bytes=r.uniform(1e6, 1e10),
                                  cpu_limit_cores=4.0, nr_periods=10) for j in range(r.randint(1, 5))]
            return to_dict(HostSamples(host=f"fuzz-{self.run}-x", ts=self.t0, interval_s=1.0,
                                       containers=tuple(cs))), HostSamples
        if self.topic == "decisions":
            return to_dict(Decision(id=uuid.uuid4().hex, ts=self.t0, host=self.host, container="c", action="limit",
                                    policy="fuzz", cpu_limit_cores=1.0, details={"a": [1, 2]})), Decision
        if self.topic == "learn-windows":
            _, raw, _ = self.valid(0)
            return json.loads(raw), None
        snap = ModelSnapshot(name=self.name, ts=self.t0, version=self.version + 1,
                             payload_b64=base64.b64encode(self.payload).decode(), samples_seen=1)
        return to_dict(snap), ModelSnapshot

    def make(self, kind: str) -> bytes | None:
        r = self.rng
        if kind == "null":
            return None
        if kind == "empty":
            return b""
        if kind == "binary":
            return r.randbytes(r.randint(1, 4096) if r.random() < 0.95 else r.randint(4097, 600_000))
        if kind == "binary-600k":
            return r.randbytes(600_000)
        if kind == "deep-array":
            return b"[" * (100_000 if r.random() < 0.3 else r.randint(1100, 100_000))
        if kind == "deep-object":
            d = r.randint(1100, 30_000)
            return b'{"a":' * d + b"1" + b"}" * d
        if kind == "top-level":
            return r.choice([b"null", b"[]", b'"x"', b"1", b"true", b"[{}]"])
        d, cls = self.base()
        raw = _dump(d)
        if kind == "deep-in-object":
            depth = r.randint(1100, 50_000)
            inner = b"[" * depth + b"]" * depth if r.random() < 0.5 else b'{"a":' * depth + b"0" + b"}" * depth
            return raw[:-1] + b',"zz":' + inner + b"}"
        if kind == "not-utf8":
            i = r.randint(0, len(raw))
            return raw[:i] + bytes([r.randint(0x80, 0xFF)]) + raw[i:]
        if kind == "truncated":
            return raw[: r.randint(1, len(raw) - 1)]
        if self.topic == "learn-windows":
            return self._learn(kind, d)
        if self.topic == "models" and (kind.startswith("payload-") or kind == "other-name"):
            return self._model(kind, d)
        if kind == "container-field":
            j = r.randrange(len(d["containers"]))
            sub, text = self._mutate(d["containers"][j], ContainerSample,
                                     r.choice([k for k in COMMON_KINDS if k in _FIELD_KINDS]))
            d["containers"][j] = sub
            return _dump(d, text)
        if kind == "huge-string":  # a string of up to 200 kB where a number goes
            d["ts"] = "x" * r.randint(1, 200_000)
            return _dump(d)
        d, text = self._mutate(d, cls, kind)
        return _dump(d, text)

    def _mutate(self, d: dict, cls: type, kind: str) -> tuple[dict, str | None]:
        """*d* with one field made invalid the *kind* way; the text of a placeholder number, if any."""
        r = self.rng
        fs = _fields(cls)
        nums = [f for f in fs if f[1] in (int, float) and f[0] != "v"]
        if kind == "huge-int":
            f = r.choice(nums)
            d[f[0]] = _HUGE
            return d, str(r.randint(1, 9)) + "".join(r.choice("0123456789") for _ in range(r.randint(4300, 8000)))
        if kind == "float-overflow":
            f = r.choice([f for f in nums if f[1] is float])
            d[f[0]] = _HUGE
            return d, str(r.randint(1, 9)) + "0" * r.randint(310, 4000)
        if kind == "int64-overflow":
            ints = [f for f in fs if f[1] is int and f[0] != "v"]
            if not ints:  # Decision has none: the version, far beyond 64 bits
                d["v"] = 2**63 + r.randint(0, 10**6)
                return d, None
            d[r.choice(ints)[0]] = 2**63 + r.randint(0, 10**12) if r.random() < 0.5 else 2**64 + r.randint(0, 10**20)
            return d, None
        if kind == "nan":
            d[r.choice(nums)[0]] = r.choice([math.nan, math.inf, -math.inf])
            return d, None
        if kind == "wrong-type":
            name, tp, optional, _, _ = r.choice(fs)
            if tp in (int, float):
                bad = [str(r.random()), [1], {"a": 1}, True, False] + ([1.5] if tp is int else [])
            elif tp is str:
                bad = [1, 2.5, [], {"a": "b"}, True]
            elif tp is dict:
                bad = [[], "x", 1, True]
            else:  # arrays of records
                bad = [{}, "x", 1, [1, 2], [[]]]
            d[name] = r.choice(bad)
            return d, None
        if kind == "missing-field":
            del d[r.choice([f for f in fs if f[3]])[0]]
            return d, None
        if kind == "negative":
            name, tp, *_ = r.choice([f for f in nums if f[4].get("minimum") is not None])
            d[name] = -r.randint(1, 10**6) if tp is int else -r.uniform(1e-6, 1e9)
            return d, None
        if kind == "above-max":
            name, tp, _, _, meta = r.choice([f for f in nums if f[4].get("maximum") is not None])
            hi = meta["maximum"]
            d[name] = int(hi) + r.randint(1, 10**6) if tp is int else hi * (1.0 + r.uniform(1e-3, 10.0))
            return d, None
        if kind == "bad-version":
            bad = r.choice([0, 2, 99, -1, "1", None, True, [1], 1.5, {"v": 1}])
            if bad is None:
                del d["v"]
            else:
                d["v"] = bad
            return d, None
        if kind == "enum":
            name = r.choice([f[0] for f in fs if f[4].get("enum")])
            d[name] = r.choice(["", "LIMIT", "delete", "x" * r.randint(1, 100_000), "limit "])
            return d, None
        raise ValueError(f"no field mutation {kind!r} for {cls.__name__}")

    def _learn(self, kind: str, d: dict) -> bytes:
        r = self.rng
        n, L, F = d["shape"]
        text = None
        if kind in ("huge-int", "float-overflow"):
            d[r.choice(["windows", "usage", "levels"])][r.randrange(n * F)] = _HUGE
            text = ("9" * r.randint(4300, 8000)) if kind == "huge-int" else "1" + "0" * r.randint(310, 4000)
        elif kind == "int64-overflow":
            d["prev_phase"][r.randrange(n)] = 2**63 + r.randint(0, 10**6)
        elif kind == "nan":  # an infinity literal (null and NaN are missing values: allowed)
            key = r.choice(["windows", "usage", "levels"])
            d[key][r.randrange(n * F)] = r.choice([math.inf, -math.inf])
        elif kind == "wrong-type":
            key = r.choice(["windows", "usage", "prev_phase", "levels", "shape", "model"])
            d[key] = r.choice([{"a": 1}, "x", 1, True] if key != "model" else [1, 2, {}])
        elif kind == "array-wrong-type":  # arrays of strings, objects or arrays where numbers go
            key = r.choice(["windows", "usage", "prev_phase", "levels"])
            d[key] = [r.choice(["x", {"a": 1}, [1.0, 2.0], [], True])] * len(d[key])
        elif kind == "missing-field":
            del d[r.choice(["v", "model", "shape", "windows", "usage", "prev_phase"])]
        elif kind == "negative":
            key = r.choice(["windows", "usage", "levels"])
            d[key][r.randrange(len(d[key]))] = -r.uniform(1e-6, 1e9)
        elif kind == "above-max":
            key = r.choice(["windows", "usage", "levels"])
            i = r.randrange(len(d[key]))
            d[key][i] = (MAX_CORES if i % F == 0 else MAX_BYTES) * (1 + r.uniform(0.01, 10))
        elif kind == "bad-version":
            d["v"] = r.choice([0, 3, "2", None, True, [2], 1.5])
        elif kind == "shape":
            d["shape"] = r.choice([[n, L + 1, F], [n, L, F + 1], [n + 1, L, F], [-1, L, F], [n, L], "x",
                                   [n * 10**20, L, F], [1.5, L, F], None])
        elif kind == "other-model":
            d["model"] = r.choice(["phase-crbm/cpu", self.name + "+gpu", "", "x" * 5000])
        elif kind == "ragged":
            d["windows"] = [[1.0, 2.0], [3.0]] + d["windows"][3:]
        elif kind == "bad-phase":
            d["prev_phase"][r.randrange(n)] = -r.randint(2, 10**6)
        elif kind == "bad-levels":
            d["levels"] = r.choice([d["levels"][:-1], [-1.0] * len(d["levels"]), "x"])
        else:
            raise ValueError(f"no learn-batch mutation {kind!r}")
        return _dump(d, text)

    def _model(self, kind: str, d: dict) -> bytes:
        r = self.rng
        good = self.payload
        body_at = 8 + int.from_bytes(good[4:8], "little")
        if kind == "other-name":
            d["name"] = r.choice(["phase-crbm/cpu", "", "x" * 3000, self.name + " "])
            return _dump(d)
        if kind == "payload-not-base64":
            d["payload_b64"] = r.choice(["!!!!", "abc", base64.b64encode(good).decode()[:-3] + "*==", "ünï"])
            return _dump(d)
        if kind == "payload-garbage":
            blob = r.randbytes(r.randint(0, 20_000))
        elif kind == "payload-truncated":
            blob = good[: r.randint(0, len(good) - 1)]
        elif kind == "payload-corrupt-body":
            i = r.randrange(body_at, len(good))
            blob = good[:i] + bytes([good[i] ^ r.randint(1, 255)]) + good[i + 1:]
        elif kind == "payload-inflates":  # a small body that inflates far beyond the index's sizes
            blob = good[:body_at] + zlib.compress(b"\0" * r.randint(1, 8) * 2**20, 1)
        elif kind == "payload-huge-index":
            hdr = json.loads(good[8:body_at])
            name = r.choice(sorted(hdr["arrays"]))
            hdr["arrays"][name]["nbytes"] = r.choice([10**12, 2**62, -1, "x"])
            h = json.dumps(hdr).encode()
            blob = good[:4] + len(h).to_bytes(4, "little") + h + good[body_at:]
        elif kind == "payload-header":
            h = r.choice([b"[]", b"null", b'{"kind":"PhaseModel"}', b'{"kind":"CRBM","version":1}',
                          b"\xff\xfe", b'{"kind":"PhaseModel","version":2,"meta":{},"arrays":[]}'])
            blob = good[:4] + len(h).to_bytes(4, "little") + h + good[body_at:]
            if r.random() < 0.3:  # a header length beyond the data
                blob = good[:4] + (2**32 - 1).to_bytes(4, "little") + good[8:]
        elif kind == "payload-deep-header":
            depth = r.randint(1100, 50_000)
            h = b"[" * depth + b"]" * depth
            blob = good[:4] + len(h).to_bytes(4, "little") + h + good[body_at:]
        elif kind == "payload-other-features":
            from phasewise.models.phases.detector import PhaseModel

            feats = r.choice([("cpu", "mem", "gpu"), ("cpu", "mem", "gpu", "gpu_mem"), ("cpu", "mem", "gpu_mem")])
            blob = PhaseModel(features=feats, n_hid=4, n_his=1, warmup=8, seed=r.randint(0, 9)).to_bytes()
        else:
            raise ValueError(f"no model mutation {kind!r}")
        d["payload_b64"] = base64.b64encode(blob).decode()
        return _dump(d)


_FIELD_KINDS = {"huge-int", "float-overflow", "int64-overflow", "nan", "wrong-type", "missing-field", "negative",
                "above-max"}


# ---------------------------------------------------------------------- the decoders the consumers run
def decoder(topic: str, model: Any = None) -> Callable[[bytes | None], Any]:
    """The function the consumer of *topic* decodes a record value with (raises SchemaError when bad)."""
    if topic == "samples":
        return decode_host_samples
    if topic == "decisions":
        return lambda raw: decode(Decision, raw)
    from phasewise.kit.records.learn_batches import decode_learn_batch
    from phasewise.models.phases.snapshots import model_name, model_of

    name = model_name(model.features)
    if topic == "learn-windows":
        return lambda raw: decode_learn_batch(raw, name, model.window_len, model.n_features, model.features)

    def snapshot(raw: bytes | None) -> Any:  # SnapshotFollower._handle's checks, keyed by this model
        snap = decode(ModelSnapshot, raw)
        if snap.name != name:
            raise SchemaError(f"ModelSnapshot: name {snap.name!r} under the key of {name!r}")
        m = model_of(snap)
        if model_name(m.features) != name:
            raise SchemaError("a model of other features")
        return m

    return snapshot


def check_decoders(fz: Fuzzer, n: int, model: Any = None) -> dict[str, Any]:
    """*n* hostile messages straight into the topic's decoder: counts of rejected / accepted / crashed."""
    dec = decoder(fz.topic, model)
    rejected, crashed, accepted = 0, Counter(), Counter()
    kinds: Counter = Counter()
    t0 = time.perf_counter()
    for _ in range(n):
        kind, _, value = fz.hostile()
        kinds[kind] += 1
        try:
            dec(value)
        except SchemaError as e:
            rejected += int(bool(str(e)))
            continue
        except BaseException as e:  # noqa: BLE001 - what this counts
            crashed[f"{kind}: {type(e).__name__}"] += 1
            continue
        accepted[kind] += 1
    return {"messages": n, "rejected_with_reason": rejected, "decoder_crashes": sum(crashed.values()),
            "crashed": dict(crashed), "generator_valid": dict(accepted), "kinds": dict(sorted(kinds.items())),
            "seconds": round(time.perf_counter() - t0, 2)}


# ---------------------------------------------------------------------- through Kafka, against the real role
def _model() -> Any:
    from phasewise.kit.settings import Settings
    from phasewise.streams.config import initial_model

    return initial_model(Settings())[0]


def run_fuzz(args: argparse.Namespace) -> dict[str, Any]:
    model = _model() if args.topic in ("learn-windows", "models") else None
    host = f"fuzz-act-{uuid.uuid4().hex[:6]}"
    if args.decoders_only:
        return {"topic": args.topic, "seed": args.seed,
                **check_decoders(Fuzzer(args.topic, args.seed, host=host, model=model), args.messages, model)}
    return _through_kafka(args, model, host)


def _through_kafka(args: argparse.Namespace, model: Any, host: str) -> dict[str, Any]:
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    from phasewise.apps.bench.harness import scrape, wait_until
    from phasewise.kit.broker import EmbeddedBroker, free_port
    from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.records import Actuation, DeadLetter
    from phasewise.kit.settings import Settings
    from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, DECISIONS, MODELS, SAMPLES

    workdir = Path(tempfile.mkdtemp(prefix="phasewise-bench-fuzz-"))
    broker = None if args.bootstrap else EmbeddedBroker(log_path=workdir / "broker.log").start()
    bootstrap = args.bootstrap or broker.bootstrap
    role = None
    readers: list[Any] = []
    try:
        s = Settings.from_env({"bootstrap": bootstrap}, env={})
        ensure_topics(s)
        metrics_port = free_port()
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        env = {"PHASEWISE_BOOTSTRAP": bootstrap, "PHASEWISE_DATA_DIR": str(workdir / "role"),
               "PHASEWISE_METRICS_PORT": str(metrics_port), "PHASEWISE_LOG_LEVEL": "info"}
        if args.topic == "decisions":
            # hostile records come under any key: the actuator reads every partition, so each one is
            # decoded (with the default, only the host's partition is read)
            env["PHASEWISE_ACTUATOR_READ_PARTITIONS"] = "all"
            role = RoleProcess("actuate", ["--backend", "dry-run", "--host", host], env=env,
                               log_path=workdir / "actuator.log")
            source = DECISIONS.name
        else:
            policy = args.policy if args.topic == "samples" else "phase"
            env.update({"PHASEWISE_POLICY": policy, "PHASEWISE_WEB_PORT": "0", "PHASEWISE_RECOMMEND_INTERVAL_S": "0",
                        "PHASEWISE_VPA_TIME_SCALE": "0.001",
                        "PHASEWISE_WORKER_ID": f"phasewise-fuzz-{uuid.uuid4().hex[:6]}",
                        # a valid sample counts as handled when it gets a decision: the safety rules would
                        # hold some back on purpose (their own tests are tests/streams/test_safety_rules.py)
                        "PHASEWISE_SAFETY_RULES": "false"})
            role = RoleProcess("worker", [], env=env, log_path=workdir / "worker.log")
            if policy == "phase":
                from phasewise.kit.topics import LEARN_WINDOWS
                from phasewise.streams.agents.phases import ensure_phase_topics

                ensure_phase_topics(s)
            source = {"samples": SAMPLES.name, "models": MODELS.name}.get(args.topic) or LEARN_WINDOWS.name
        role.start()

        def up() -> bool:
            if not role.alive():
                raise RuntimeError(f"{role.cmd[3]} exited:\n{role.log_tail()}")
            try:
                m = scrape(url)
            except OSError:
                return False
            return args.topic == "decisions" or m.get("phasewise_worker_ready", 0.0) >= 1.0

        wait_until(up, 120, 0.2, "the role to be ready")

        def reader(topic: str, partitions: int) -> Any:
            c = make_consumer(s, f"phasewise-fuzz-reader-{uuid.uuid4().hex[:6]}")
            c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
            readers.append(c)
            return c

        dl_reader = reader(DEAD_LETTERS.name, DEAD_LETTERS.partitions)
        ev_reader = (reader(DECISIONS.name, DECISIONS.partitions) if args.topic == "samples" else
                     reader(ACTUATIONS.name, ACTUATIONS.partitions) if args.topic == "decisions" else None)

        fz = Fuzzer(args.topic, args.seed, host=host, model=model, messages=args.messages)
        dec = decoder(args.topic, model)
        producer = make_producer(s, **{"linger.ms": 20})
        hostile: dict[tuple[int, int], str] = {}  # (partition, offset) -> kind
        valid_at: dict[tuple[int, int], str] = {}
        tokens: list[str] = []
        kinds: Counter = Counter()
        decoder_crashes: Counter = Counter()
        sent_bytes = 0

        def delivered(into: dict, what: str) -> Callable[[Any, Any], None]:
            def cb(err: Any, msg: Any) -> None:
                if err is not None:
                    raise RuntimeError(f"could not produce a fuzz message: {err}")
                into[(msg.partition(), msg.offset())] = what
            return cb

        def produce(key: bytes | None, value: bytes | None, cb: Callable[[Any, Any], None]) -> None:
            while True:
                try:
                    producer.produce(source, key=key, value=value, on_delivery=cb)
                    return
                except BufferError:
                    producer.poll(0.05)

        t0 = time.monotonic()
        valid_sum = 0
        for i in range(args.messages):
            kind, key, value = fz.hostile()
            try:
                dec(value)
                raise RuntimeError(f"the generator made a valid message of kind {kind!r}: a bug in apps/bench/fuzz.py")
            except SchemaError:
                pass
            except RuntimeError:
                raise
            except BaseException as e:  # noqa: BLE001 - counted: the decoder must raise SchemaError only
                decoder_crashes[f"{kind}: {type(e).__name__}"] += 1
            kinds[kind] += 1
            sent_bytes += len(value or b"")
            produce(key, value, delivered(hostile, kind))
            if (i + 1) % args.valid_every == 0:
                k, v, token = fz.valid(i)
                tokens.append(token)
                valid_sum += int(token) if args.topic == "learn-windows" else 0
                produce(k, v, delivered(valid_at, token))
            producer.poll(0)
        left = producer.flush(120)
        if left:
            raise RuntimeError(f"{left} fuzz messages not delivered")
        produced_s = time.monotonic() - t0

        letters: dict[tuple[int, int], DeadLetter] = {}
        seen: set[str] = set()
        deadline = time.monotonic() + args.timeout

        def evidence_done() -> bool:
            if args.topic == "learn-windows":
                return scrape(url).get("phasewise_worker_windows_learned_total", 0.0) >= valid_sum
            if args.topic == "models":
                return not tokens or scrape(url).get("phasewise_worker_model_snapshot_latest", 0.0) >= int(tokens[-1])
            return len(seen) >= len(tokens)

        while time.monotonic() < deadline and role.alive():
            for m in dl_reader.consume(500, 0.2):
                if m.error():
                    continue
                try:
                    dl = decode(DeadLetter, m.value())
                except SchemaError:
                    continue
                if dl.source_topic == source and dl.partition is not None and dl.offset is not None:
                    letters[(dl.partition, dl.offset)] = dl
            if ev_reader is not None:
                for m in ev_reader.consume(500, 0.05):
                    if m.error():
                        continue
                    if args.topic == "samples":
                        d = decode(Decision, m.value())
                        seen.add(f"{d.host}/{d.container}")
                    else:
                        seen.add(decode(Actuation, m.value()).decision_id)
            if all(k in letters for k in hostile) and evidence_done():
                break
        alive = role.alive()
        metrics = scrape(url) if alive else {}
        handled_s = time.monotonic() - t0
        exit_code = role.stop(30)
        role = None
        if args.topic == "learn-windows":
            learned = metrics.get("phasewise_worker_windows_learned_total", 0.0)
            valid_handled = len(tokens) if learned >= valid_sum else None  # only the total is observable
            # (None: fewer windows learned than sent, which batches is not known)
        elif args.topic == "models":
            latest = metrics.get("phasewise_worker_model_snapshot_latest", 0.0)
            ok = not tokens or latest >= int(tokens[-1])
            valid_handled = sum(1 for k in valid_at if k not in letters) if ok else 0
        else:
            valid_handled = len(set(tokens) & seen)
        got = [letters[k] for k in hostile if k in letters]
        out = {
            "topic": args.topic, "role": "actuate --backend dry-run" if args.topic == "decisions" else
            f"worker --policy {args.policy if args.topic == 'samples' else 'phase'}",
            "seed": args.seed, "messages": len(hostile), "hostile_mb": round(sent_bytes / 2**20, 1),
            "dead_lettered": sum(1 for dl in got if dl.reason), "not_dead_lettered": len(hostile) - len(got),
            "truncated_dead_letters": sum(1 for dl in got if dl.truncated),
            "valid": len(tokens), "valid_handled": valid_handled,
            "valid_lost": None if valid_handled is None else len(tokens) - valid_handled,
            "valid_dead_lettered": sum(1 for k in valid_at if k in letters),
            "crashes": 0 if alive else 1, "exit_code": exit_code, "decoder_crashes": sum(decoder_crashes.values()),
            "kinds": dict(sorted(kinds.items())), "produce_s": round(produced_s, 1), "seconds": round(handled_s, 1),
            "logs": str(workdir) if args.keep_logs else None,
        }
        if args.topic == "learn-windows":
            out["valid_windows"], out["windows_learned"] = valid_sum, int(metrics.get(
                "phasewise_worker_windows_learned_total", 0.0))
        if decoder_crashes:
            out["decoder_crashed"] = dict(decoder_crashes)
        return out
    finally:
        for c in readers:
            c.close()
        if role is not None:
            role.stop(30)
        if broker:
            broker.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.records import WORKLOAD_POLICIES
    from phasewise.kit.settings import Settings

    p.add_argument("--topic", choices=TOPICS, required=True, help="the input topic to fuzz")
    p.add_argument("--messages", type=int, default=10_000, help="hostile messages (default 10000)")
    p.add_argument("--valid-every", type=int, default=5, help="one valid message after every N hostile ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", choices=WORKLOAD_POLICIES, default=Settings.default("policy"),
                   help="the worker's policy (--topic samples)")
    p.add_argument("--decoders-only", action="store_true",
                   help="only the in-process decoder check: no broker, no role (fast)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the role to handle everything after the last message")
    p.add_argument("--bootstrap", help="use this Kafka instead of an embedded broker")
    p.add_argument("--keep-logs", action="store_true", help="print where the role's log is kept")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.messages < 1 or args.valid_every < 1:
        print("phasewise bench fuzz: --messages and --valid-every must be >= 1", file=sys.stderr)
        return 2
    result = run_fuzz(args)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:26s} {v}")
    ok = (result.get("decoder_crashes", 0) == 0 and not result.get("generator_valid")
          and result.get("not_dead_lettered", 0) == 0 and not result.get("crashes")
          and result.get("valid_lost", 0) == 0 and not result.get("valid_dead_lettered")
          and result.get("exit_code", 0) == 0)  # valid_lost None: not all of them were seen handled
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
