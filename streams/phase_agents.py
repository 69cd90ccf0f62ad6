"""The live phase path of ``phasewise worker --policy phase``: detectors, one learner, snapshots.

With ``settings.policy == "phase"`` the samples agent (see
:mod:`phasewise.streams.agents`) still runs the VPA recommenders (they are the
fallback), then hands each round of ``HostSamples`` messages (distinct hosts)
to :class:`PhaseHooks`:

- **detector** (every worker, for the hosts of its partitions): one batched
  :meth:`~phasewise.models.phase_fleet.PhaseFleet.step` over the round's
  containers with the worker's current snapshot, frozen (detectors never
  train). Phase changes go to ``phasewise.phases.v1`` as ``PhaseChange``
  (key: container). Limit decisions carry ``policy="phase"``; their
  ``details["source"]`` says where the limits came from: ``"phase"`` (the
  phase's pooled quantile x (1 + margin); details add the phase id and the
  statistics used), ``"fallback:vpa"`` (model cold, window not full or phase
  new: the VPA's last decided limit for that resource), or ``"mixed"`` (one
  resource each way; ``details["sources"]`` per resource). The VPA's own
  decisions are NOT emitted in this mode: a VPA decision only moves the
  fallback limit, which the phase decision then hands out when it applies.
  Per container the detector keeps its window, phase and limit basis in the
  changelogged table ``phase-state`` (key ``host/container``), marked for
  writing on a phase change or every ``state_write_interval_s`` of event time
  and written at the next offset commit (latest per container); a worker
  that restarts or takes over a partition resumes from it. Decisions, phase
  changes and learn windows go through the worker's output producer and are
  delivered before the offsets of their source messages are committed
  (:mod:`phasewise.streams.output`).
- **learner split**: every ``phase_learn_every``-th ready window (with the
  usage to credit to the phase that was in force) is sent to the internal
  1-partition topic ``phasewise.learn-windows.v1``, in batches of
  ``phase_learn_batch`` windows (a partial batch at every offset commit; the
  learner makes one CD step per batch); ONE learner agent (the
  worker owning that single partition) trains the shared model and, every
  ``phase_snapshot_interval_s`` when it learned something, publishes a
  ``ModelSnapshot`` (payload: base64 of ``PhaseModel.to_bytes()``, version =
  newest known + 1) to the compacted ``phasewise.models.v1``, key = model name.
  A learner that takes the partition over re-bases on the newest snapshot.
- **snapshot follower**: each worker reads ``phasewise.models.v1`` to its end
  at start-up with a plain confluent consumer (assigned, no group: nothing to
  join, works the same on the embedded broker) and keeps following it on a
  daemon thread that decodes new snapshots off the event loop; detectors swap
  to a newer snapshot between messages. With no snapshot, a worker starts
  from the shipped pretrained model when its features are (cpu, mem) and
  ``phase_pretrained`` is on (the default), else cold (phase limits then
  start once the learner's first warm snapshot lands).

Frames are the features of ``phase_features`` (default ``cpu,mem``; with
``gpu,gpu_mem`` a sample's ``gpu_util`` / ``gpu_mem_bytes`` are columns too, a
missing reading is NaN). Only ``cpu`` and ``mem`` get limits and decisions
(:data:`LIMITED`); GPU columns shape the phases. The model's features name it
on the models topic (:func:`model_name`), so each feature set is its own model.

Learn-window batches are an internal format (JSON, versioned, below); one
the learner cannot decode (:func:`decode_learn_batch`) or learn from is
dead-lettered with the reason, and so is a record of this worker's model on
the models topic that is no usable snapshot (:class:`SnapshotFollower`; each
worker follows the topic, so each dead-letters it).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:  # learn batches are ~1 KB of numbers per window: orjson writes numpy arrays directly (streams extra)
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

from phasewise.models.decisions import round_limits
from phasewise.models.detector import PhaseModel, learn
from phasewise.models.guard import GuardOutcome, bounded_text
from phasewise.models.phase_fleet import FleetStep, PhaseFleet
from phasewise.models.vpa_updater import StateCache
from phasewise.schemas import (
    MAX_BYTES,
    MAX_CORES,
    MAX_MESSAGE_BYTES,
    MAX_PCT,
    Decision,
    HostSamples,
    ModelSnapshot,
    PhaseChange,
    SchemaError,
    brief,
    decode,
    encode,
)
from phasewise.settings import LIMITED_FEATURES, Settings
from phasewise.topics import MODELS, Topic

__all__ = [
    "FEATURES", "LEARN_WINDOWS", "LIMITED", "POLICY", "TABLE_NAME", "Learner", "PhaseHooks", "SnapshotFollower",
    "decode_learn_batch", "encode_learn_batch", "ensure_phase_topics", "initial_model", "model_name",
    "phase_decisions", "register_phase",
]

log = logging.getLogger(__name__)

POLICY = "phase"
TABLE_NAME = "phase-state"
#: default frame features of the live detector (``phase_features``; the shipped pretrained model's)
FEATURES = ("cpu", "mem")
#: the resources phase decisions limit; other features (gpu, gpu_mem) only shape the phases
LIMITED = LIMITED_FEATURES
#: HostSamples' per-container field of each feature (None in a sample = missing)
_FIELD = {"cpu": "cpu_cores", "mem": "mem_bytes", "gpu": "gpu_util", "gpu_mem": "gpu_mem_bytes"}
#: internal: sampled detector windows for the one learner (1 partition = one owner)
LEARN_WINDOWS = Topic("phasewise.learn-windows.v1", "model name", 1,
                      doc="internal: sampled detector windows for the phase learner")
#: 2: carries each window's container level (relative phase statistics); 1 is still read
LEARN_BATCH_VERSION = 2


def model_name(features: tuple[str, ...] = FEATURES) -> str:
    """Key of the shared model on the models topic."""
    return "phase-crbm/" + "+".join(features)


def ensure_phase_topics(settings: Settings) -> list[str]:
    """Create the learn-windows topic with exactly one partition (whatever ``topic_partitions`` says)."""
    from phasewise.kafka import ensure_topics

    return ensure_topics(dataclasses.replace(settings, topic_partitions=0), [LEARN_WINDOWS])


# ---------------------------------------------------------------------- learn batches (internal wire format)
def _finite_list(a: np.ndarray) -> list[float | None]:
    return [None if not math.isfinite(x) else x for x in np.asarray(a, dtype=np.float64).reshape(-1).tolist()]


_NUMBER_OR_NULL = frozenset((float, int, type(None)))


def _float_array(xs: Any) -> np.ndarray:
    """Inverse of :func:`_finite_list`: None becomes NaN (numpy converts it); anything but numbers and
    nulls (booleans, strings numpy would read as numbers, arrays) raises TypeError."""
    if type(xs) is not list:
        raise TypeError(f"expected a list, got {type(xs).__name__}")
    if not _NUMBER_OR_NULL.issuperset(map(type, xs)):
        raise TypeError("expected numbers or nulls")
    return np.array(xs, dtype=np.float64)


def _int_array(xs: Any) -> np.ndarray:
    """A list of integers as int64 (TypeError for anything else, OverflowError beyond 64 bits)."""
    if type(xs) is not list:
        raise TypeError(f"expected a list, got {type(xs).__name__}")
    if not {int}.issuperset(map(type, xs)):
        raise TypeError("expected integers")
    return np.array(xs, dtype=np.int64)


def _flat(a: Any, dtype: Any = np.float64) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=dtype).reshape(-1))


def encode_learn_batch(name: str, windows: np.ndarray, prev_phase: np.ndarray, usage: np.ndarray,
                       levels: np.ndarray | None = None) -> bytes:
    """JSON of a sample of ready windows ``(n, L, F)``, the phases in force, the usage to credit and
    (relative statistics) each container's level just before the frame. Missing (non-finite) numbers
    are written as null."""
    W = np.asarray(windows, dtype=np.float64)
    d: dict[str, Any] = {
        "v": LEARN_BATCH_VERSION, "model": name, "shape": list(W.shape),
        "windows": _flat(W), "prev_phase": _flat(prev_phase, np.int64), "usage": _flat(usage),
    }
    if levels is not None:
        d["levels"] = _flat(levels)
    if _orjson is not None:  # numpy arrays written directly, NaN / inf as null
        return _orjson.dumps(d, option=_orjson.OPT_SERIALIZE_NUMPY)
    for k in ("windows", "usage", "levels"):
        if k in d:
            d[k] = _finite_list(d[k])
    d["prev_phase"] = d["prev_phase"].tolist()
    return json.dumps(d, separators=(",", ":")).encode()


#: the largest value of each frame feature a learn batch may carry (the HostSamples field's maximum)
_FEATURE_MAX = {"cpu": MAX_CORES, "mem": MAX_BYTES, "gpu": MAX_PCT * 64, "gpu_mem": MAX_BYTES}


def _out_of_range(A: np.ndarray, hi: np.ndarray, what: str) -> str | None:
    """Why the rows of *A* (last axis: features) are not *what* (usage, level): a value below 0 or
    above the feature's maximum *hi* (NaN is a missing value: the normaliser skips it)."""
    with np.errstate(invalid="ignore"):
        if (A < 0).any():
            return f"negative {what}"
        if (A > hi).any():
            return f"{what} above the feature's maximum"
    return None


def decode_learn_batch(raw: bytes | None, name: str, window_len: int, n_features: int,
                       features: Sequence[str] | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Parse a learn batch for model *name*: ``(windows, prev_phase, usage, levels or None)``.

    :class:`SchemaError` says why not, whatever *raw* holds (nothing else is
    raised). Version 1 batches (no levels) are read too. Every number of the
    windows, usage and levels is missing (null) or within [0, the feature's
    maximum] (*features*: the model's; without them the columns after cpu and
    mem are checked against the largest maximum); phases in force are
    integers >= -1.
    """
    if raw is None:
        raise SchemaError("learn batch: the record has no value (null, e.g. a tombstone)")
    try:
        if len(raw) > MAX_MESSAGE_BYTES:
            raise SchemaError(f"learn batch: message of {len(raw)} bytes is larger than the limit of "
                              f"{MAX_MESSAGE_BYTES} bytes (MAX_MESSAGE_BYTES)")
        try:
            d = _orjson.loads(raw) if _orjson is not None else json.loads(raw)
        except (ValueError, TypeError, MemoryError):  # orjson's error is a JSONDecodeError (a ValueError)
            if _orjson is None:
                raise
            d = json.loads(raw)  # what orjson refuses json decides (NaN: a missing value), and words the error
    except SchemaError:
        raise
    except RecursionError:
        raise SchemaError("learn batch: not valid JSON: arrays or objects nested too deeply to parse") from None
    except (ValueError, TypeError, MemoryError) as e:
        raise SchemaError(f"learn batch: not valid JSON: {str(e).split(';')[0]}") from None
    if type(d) is not dict or d.get("v") not in (1, LEARN_BATCH_VERSION) or type(d.get("v")) is not int:
        raise SchemaError(f"learn batch: unsupported version {brief(d.get('v') if type(d) is dict else d)}")
    if d.get("model") != name:
        raise SchemaError(f"learn batch: for model {brief(d.get('model'))}, this learner trains {name!r}")
    shape = d.get("shape")
    if not (type(shape) is list and len(shape) == 3 and shape[1:] == [window_len, n_features]
            and type(shape[0]) is int and 0 <= shape[0] <= MAX_MESSAGE_BYTES):
        shown = "[" + ", ".join(map(brief, shape)) + "]" if type(shape) is list and len(shape) <= 3 else brief(shape)
        raise SchemaError(f"learn batch: shape {shown}, expected [n, {window_len}, {n_features}]")
    n = shape[0]
    try:
        W = _float_array(d["windows"])
        U = _float_array(d["usage"])
        P = _int_array(d["prev_phase"])
    except KeyError as e:
        raise SchemaError(f"learn batch: missing array {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"learn batch: bad arrays: {type(e).__name__}: {brief(str(e), 200)}") from None
    if W.size != n * window_len * n_features or U.size != n * n_features or P.shape != (n,):
        raise SchemaError(f"learn batch: array sizes do not match shape {shape}")
    hi = np.array([_FEATURE_MAX[f] for f in features] if features is not None
                  else [MAX_CORES, MAX_BYTES] + [max(_FEATURE_MAX.values())] * (n_features - 2))
    W, U = W.reshape(n, window_len, n_features), U.reshape(n, n_features)
    for where, A in (("windows", W), ("usage", U)):
        why = _out_of_range(A, hi, "usage")
        if why is not None:
            raise SchemaError(f"learn batch: {why} ({where})")
    if (P < -1).any():
        raise SchemaError("learn batch: a phase in force below -1")
    levels = None
    if d.get("levels") is not None:
        try:
            levels = _float_array(d["levels"])
        except (TypeError, ValueError, OverflowError) as e:
            raise SchemaError(f"learn batch: bad levels: {type(e).__name__}: {brief(str(e), 200)}") from None
        if levels.size != n * n_features:
            raise SchemaError(f"learn batch: levels do not match shape {shape}")
        levels = levels.reshape(n, n_features)
        why = _out_of_range(levels, hi, "level")
        if why is not None:
            raise SchemaError(f"learn batch: {why}")
    return W, P, U, levels


# ---------------------------------------------------------------------- models
def initial_model(settings: Settings) -> tuple[PhaseModel, str]:
    """The shipped pretrained model when its features match (and ``phase_pretrained``), else a cold one;
    with where it came from."""
    features = settings.phase_feature_tuple()
    try:
        from phasewise.models.phase_policy import PRETRAINED_AI4DL, load_pretrained
    except ImportError:  # the policy module is optional for the live path
        load_pretrained = None  # type: ignore[assignment]
    if not settings.phase_pretrained:
        load_pretrained = None  # type: ignore[assignment]
    if load_pretrained is not None:
        m = load_pretrained()
        if m is not None and m.features == features:
            return m, f"pretrained {PRETRAINED_AI4DL}"
    return PhaseModel(features=features, warmup=settings.phase_warmup), "cold"


def snapshot_of(model: PhaseModel, version: int, samples_seen: int) -> ModelSnapshot:
    return ModelSnapshot(name=model_name(model.features), ts=time.time(), version=version,
                         payload_b64=base64.b64encode(model.to_bytes()).decode(), samples_seen=samples_seen)


def model_of(snap: ModelSnapshot) -> PhaseModel:
    """The model a snapshot carries; :class:`SchemaError` (only) when its payload is no usable PhaseModel."""
    try:
        model = PhaseModel.from_bytes(base64.b64decode(snap.payload_b64, validate=True))
        if not set(LIMITED) <= set(model.features):
            raise ValueError(f"features {list(model.features)} lack {list(LIMITED)}")
        return model
    except Exception as e:  # noqa: BLE001 - whatever the payload holds, it is a reason, not a crash
        why = f"{type(e).__name__}: {brief(str(e), 300)}"
        raise SchemaError(f"ModelSnapshot {brief(snap.name)} v{snap.version}: payload is no PhaseModel: {why}") from None


class SnapshotFollower:
    """The newest ``ModelSnapshot`` of one model name, read from the compacted models topic.

    :meth:`load_latest` reads the topic to its end (blocking, at start-up);
    :meth:`start` keeps following it on a daemon thread. :meth:`latest` is
    safe to call from the event loop. A record of this model (its key, or no
    key and its name) that cannot be decoded or loaded as a model (null value,
    malformed JSON, a payload that is no PhaseModel checkpoint) goes to
    *on_bad* (value, key, offset, reason), whatever its version; each newer
    valid snapshot to *on_loaded*.
    """

    def __init__(self, settings: Settings, name: str,
                 on_bad: Callable[[bytes | None, bytes | None, int, str], None] | None = None,
                 on_loaded: Callable[[ModelSnapshot], None] | None = None) -> None:
        self.settings = settings
        self.name = name
        self.on_bad = on_bad
        self.on_loaded = on_loaded
        self._lock = threading.Lock()
        self._latest: tuple[ModelSnapshot, PhaseModel] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Any = None

    def _make_consumer(self) -> Any:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        from phasewise.kafka import make_consumer

        c = make_consumer(self.settings, f"{self.settings.worker_id}-models-follower", **{"fetch.wait.max.ms": 200})
        c.assign([TopicPartition(MODELS.name, 0, OFFSET_BEGINNING)])
        return c

    def _handle(self, msg: Any) -> None:
        if msg is None or msg.error():
            return
        key = msg.key()
        if key is not None and key.decode(errors="replace") != self.name:
            return  # another model's snapshots share the topic
        try:
            snap = decode(ModelSnapshot, msg.value())
            if snap.name != self.name:
                if key is None:
                    return  # another model's snapshot, without a key
                raise SchemaError(f"ModelSnapshot: name {brief(snap.name)} under the key of {self.name!r}")
            model = model_of(snap)  # every snapshot of this name is checked, old ones too
            if model_name(model.features) != self.name:
                raise SchemaError(f"ModelSnapshot {self.name} v{snap.version}: the payload is a model of "
                                  f"{model_name(model.features)!r}")
        except Exception as e:  # noqa: BLE001 - decode and model_of raise SchemaError only; a record never stops this
            reason = str(e) if isinstance(e, SchemaError) else f"could not decode: {type(e).__name__}: {e}"
            log.warning("models topic offset %s: %s", msg.offset(), reason)
            if self.on_bad is not None:
                self.on_bad(msg.value(), key, msg.offset(), reason)
            return
        current = self._latest
        if current is not None and snap.version <= current[0].version:
            return
        with self._lock:
            self._latest = (snap, model)
        if self.on_loaded is not None:
            self.on_loaded(snap)
        log.info("model snapshot %s v%d available (%d windows learned)", snap.name, snap.version, snap.samples_seen)

    def load_latest(self, timeout_s: float = 10.0) -> ModelSnapshot | None:
        """Read the models topic to its current end; returns the newest snapshot of this name."""
        from confluent_kafka import TopicPartition

        if self._consumer is None:
            self._consumer = self._make_consumer()
        c = self._consumer
        lo, hi = c.get_watermark_offsets(TopicPartition(MODELS.name, 0), timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        pos = lo - 1
        while pos < hi - 1 and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                pos = m.offset()
                self._handle(m)
        latest = self._latest
        return None if latest is None else latest[0]

    def start(self) -> None:
        if self._consumer is None:
            self._consumer = self._make_consumer()
        self._thread = threading.Thread(target=self._run, name="phasewise-models-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        c = self._consumer
        try:
            while not self._stop.is_set():
                try:
                    self._handle(c.poll(0.5))
                except Exception:  # keep following; a broken record must not stop snapshot updates
                    log.exception("models follower: unexpected error")
        finally:
            c.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif self._consumer is not None:
            self._consumer.close()
        self._consumer = None

    def latest(self) -> tuple[ModelSnapshot, PhaseModel] | None:
        with self._lock:
            return self._latest


class Learner:
    """The one trainer of the shared model (state of the learner agent)."""

    def __init__(self, model: PhaseModel, version: int = 0, samples_seen: int = 0) -> None:
        self.model = model
        self.version = version  # version this model descends from / was published as
        self.samples_seen = samples_seen
        self.dirty = False

    def rebase(self, snap: ModelSnapshot, model: PhaseModel) -> bool:
        """Continue from a newer snapshot someone else published (e.g. the previous owner)."""
        if snap.version <= self.version:
            return False
        self.model, self.version, self.samples_seen = model.clone(), snap.version, snap.samples_seen
        return True

    #: while the CRBM is cold (fewer than its warm-up windows seen) a batch is learned in CD steps of
    #: this many windows, so that a cold model takes many small steps before phases are assigned
    #: (steady state: one step per batch, which is what makes large batches cheap)
    WARMUP_STEP = 16

    def learn(self, windows: np.ndarray, prev_phase: np.ndarray, usage: np.ndarray,
              levels: np.ndarray | None = None) -> int:
        n = len(windows)
        if not n:
            return 0
        m = self.model
        i = 0
        while i < n:
            k = n - i if m.crbm.n_seen >= m.warmup else self.WARMUP_STEP
            sl = slice(i, i + k)
            learn(m, windows[sl], stats_phases=prev_phase[sl], usage=usage[sl],
                  levels=None if levels is None else levels[sl])
            i += k
        self.samples_seen += n
        self.dirty = True
        return len(windows)

    def snapshot(self) -> ModelSnapshot | None:
        """The next snapshot if the model learned since the last one (then marks it published)."""
        if not self.dirty:
            return None
        self.version += 1
        self.dirty = False
        return snapshot_of(self.model, self.version, self.samples_seen)


# ---------------------------------------------------------------------- decisions
def decision_id(host: str, container: str, cpu: float | None, mem: float | None, ts: float) -> str:
    raw = f"{POLICY}|{host}|{container}|{cpu!r}|{mem!r}|{ts!r}".encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def _clean(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become None."""
    t = type(obj)  # the common exact types first (called for every decision's and change's details)
    if t is float:
        return obj if math.isfinite(obj) else None
    if t is dict:
        return {k: _clean(v) for k, v in obj.items()}
    if t is str or t is int or t is bool or obj is None:
        return obj
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def phase_decisions(out: FleetStep, hosts: Sequence[str], names: Sequence[str], ts: Sequence[float], *,
                    quantile: float, margin: float, safety: GuardOutcome | None = None) -> list[Decision]:
    """``Decision`` (policy ``phase``) for each row of *out* with a limit to hand out (*hosts*, *names*,
    *ts*: per row); *safety*: the safety rules' outcome over the same rows (``details["safety"]``)."""
    rows = out.rows_to_decide()
    if not len(rows):
        return []
    decisions = []
    res = out.resources
    ci, mi = res.index("cpu"), res.index("mem")
    limits, decide, changed = out.limits[rows].tolist(), out.decide[rows].tolist(), out.changed[rows].tolist()
    margin = _clean(margin)
    for k, (i, ex) in enumerate(zip(rows.tolist(), out.explain_rows(rows, quantile))):
        cpu = limits[k][ci] if decide[k][ci] else None
        mem = limits[k][mi] if decide[k][mi] else None
        if cpu is not None:
            cpu = min(math.ceil(cpu * 1000.0 - 1e-9) / 1000.0, MAX_CORES)
        if mem is not None:
            mem = float(min(math.ceil(mem), MAX_BYTES))
        srcs = {}
        why = []
        if cpu is not None:
            srcs["cpu"] = src = "phase" if ex["sources"]["cpu"] == "phase" else "fallback:vpa"
            why.append(f"cpu -> {cpu:g} cores ({src})")
        if mem is not None:
            srcs["mem"] = src = "phase" if ex["sources"]["mem"] == "phase" else "fallback:vpa"
            why.append(f"mem -> {mem / 2**20:.0f} MiB ({src})")
        kinds = set(srcs.values())
        source = kinds.pop() if len(kinds) == 1 else "mixed"
        phase = ex["phase"]
        head = f"phase {phase}" if phase is not None else "phase unknown"
        # explain_rows gives finite numbers or None; quantile and margin are settings
        details = {**ex, "source": source, "sources": srcs, "quantile": quantile, "margin": margin,
                   "changed": changed[k]}
        reason = f"{head}: " + "; ".join(why)
        if safety is not None:
            details["safety"] = sx = safety.explain(i)
            reason += bounded_text(sx)
        name, host, t = names[i], hosts[i], ts[i]
        decisions.append(Decision(
            id=decision_id(host, name, cpu, mem, t), ts=t, host=host, container=name, action="limit",
            policy=POLICY, reason=reason, cpu_limit_cores=cpu, mem_limit_bytes=mem, details=details,
        ))
    return decisions


@dataclasses.dataclass
class PhaseOutput:
    decisions: list[Decision]
    changes: list[PhaseChange]
    learn_batch: bytes | None


class PhaseHooks:
    """The detector side of one worker: fleet step per message, snapshot swaps, what to send.

    Pure apart from reading the follower's latest snapshot; the agent sends
    what :meth:`process` returns and persists what :meth:`pop_dirty` hands out.
    """

    def __init__(self, settings: Settings, vpa_cache: StateCache, *, model: PhaseModel, version: int = 0,
                 loader: Callable[[str], Any] | None = None,
                 latest: Callable[[], tuple[ModelSnapshot, PhaseModel] | None] | None = None) -> None:
        self.settings = settings
        self.vpa_cache = vpa_cache
        self.latest = latest
        self.version = version
        self.name = model_name(model.features)
        self.loader = loader
        feats = model.features
        if any(r not in feats for r in LIMITED):
            raise ValueError(f"the phase model's features {feats} must include {LIMITED}")
        self.fleet = self._fleet(model)
        self._fields = [_FIELD[f] for f in feats]
        self._cpu_mem_only = feats == LIMITED
        self._limited_cols = None if self._cpu_mem_only else [feats.index(r) for r in LIMITED]
        self._carried: list[tuple[str, dict[str, Any]]] = []  # marked states of a replaced fleet
        self.learn_batch = max(1, int(settings.phase_learn_batch))
        self._learn_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._learn_n = 0  # windows held in _learn_parts

    def _fleet(self, model: PhaseModel) -> PhaseFleet:
        s = self.settings
        return PhaseFleet(model, floors={"cpu": s.vpa_min_cpu_cores, "mem": float(s.vpa_min_mem_bytes)},
                          learn_every=s.phase_learn_every, frozen=True, statistics=s.phase_statistics,
                          state_write_interval_s=s.state_write_interval_s, loader=self.loader, limited=LIMITED,
                          ratio_cap=s.phase_ratio_cap or None)

    def follow(self) -> bool:
        """Swap to the follower's newest snapshot if it is newer; True if swapped."""
        got = self.latest() if self.latest is not None else None
        if got is None or got[0].version <= self.version:
            return False
        snap, model = got
        try:
            self.fleet.set_model(model)
        except ValueError as e:  # another window length: containers restart their windows
            log.warning("snapshot v%d does not fit the detector state (%s); windows restart", snap.version, e)
            self._carried += self.fleet.pop_dirty()  # still persisted at the next commit
            self.fleet = self._fleet(model)
            self._learn_parts, self._learn_n = [], 0  # windows of the old length: the learner would refuse them
        self.version = snap.version
        log.info("detector now on model snapshot v%d", snap.version)
        return True

    def clear(self) -> None:
        self.fleet.clear()
        self._carried = []

    def pop_dirty(self) -> list[tuple[str, dict[str, Any]]]:
        """States marked for persisting since the last call (each container once, latest state)."""
        out = self.fleet.pop_dirty()
        if self._carried:
            seen = {k for k, _ in out}
            out += [(k, st) for k, st in self._carried if k not in seen]
            self._carried = []
        return out

    def process(self, hs: HostSamples, vpa_decisions: list[Decision] | None = None) -> PhaseOutput:
        """Run the detector over *hs* (after the VPA learned it: its decided limits are the fallback).

        *vpa_decisions* only moved the fallback limits; they are not emitted (unused here).
        """
        return self.process_many([hs])

    def process_many(self, msgs: Sequence[HostSamples]) -> PhaseOutput:
        """:meth:`process` of several messages as ONE fleet step; their containers must be distinct.

        The same decisions (in message order), phase changes and learn windows
        as one call per message in turn: each container's row depends only on
        its own state and the frozen snapshot. One step over a batch costs
        about half as much per sample as one per 100-container message (the
        numpy / torch calls' fixed costs are shared).
        """
        self.follow()
        msgs = [m for m in msgs if m.containers]
        if not msgs:
            return PhaseOutput([], [], None)
        hosts: list[str] = []
        names: list[str] = []
        keys: list[str] = []
        ts: list[float] = []
        for m in msgs:
            host, n = m.host, len(m.containers)
            got = [c.container for c in m.containers]
            names += got
            keys += [f"{host}/{c}" for c in got]
            hosts += [host] * n
            ts += [m.ts] * n
        if len(msgs) > 1 and len(set(keys)) != len(keys):
            raise ValueError("process_many: a container appears in two of the messages; step them in turn")
        observed = None  # the limits the samples report (None -> NaN: unlimited), for the safety rules
        guarded = self.vpa_cache.guard is not None
        if self._cpu_mem_only and guarded:  # one pass over the samples for both
            A = np.array([(c.cpu_cores, c.mem_bytes, c.cpu_limit_cores, c.mem_limit_bytes)
                          for m in msgs for c in m.containers], dtype=np.float64)
            X, observed = A[:, :2], A[:, 2:]
        elif self._cpu_mem_only:
            X = np.array([(c.cpu_cores, c.mem_bytes) for m in msgs for c in m.containers], dtype=np.float64)
        else:  # a missing GPU reading (None) is NaN: the normaliser treats it as missing
            get = self._fields
            X = np.array([[math.nan if (v := getattr(c, f)) is None else v for f in get]
                          for m in msgs for c in m.containers], dtype=np.float64)
        decided = self.vpa_cache.decided_limits
        cols = self._limited_cols

        def fallback(idx: np.ndarray) -> np.ndarray:
            got = decided([keys[i] for i in idx])  # the VPA's decided (cpu, mem) limits (NaN: none yet)
            if cols is None:
                return got
            out = np.full((len(idx), len(self._fields)), np.nan)
            out[:, cols] = got  # features that are not limited have no fallback
            return out

        one = len(msgs) == 1
        out = self.fleet.step(msgs[0].ts if one else np.array(ts), keys, X, fallback_limits=fallback,
                              host=msgs[0].host)
        safety = None
        if guarded:
            if observed is None:
                observed = np.array([(c.cpu_limit_cores, c.mem_limit_bytes) for m in msgs for c in m.containers],
                                    dtype=np.float64)
            safety = self._guard(out, observed, keys, ts)
        decisions = phase_decisions(out, hosts, names, ts, quantile=self.fleet.quantile, margin=self.fleet.margin,
                                    safety=safety)
        changes = []
        if out.changes:
            row = {k: i for i, k in enumerate(keys)}
            for c in out.changes:
                i = row[c["container"]]
                changes.append(PhaseChange(**_clean({**c, "host": hosts[i], "container": names[i]})))
        batch = None
        if len(out.sample):
            sel = out.sample
            self._learn_parts.append((out.windows[sel], out.prev_phase[sel], out.frames[sel],
                                      None if out.levels is None else out.levels[sel]))
            self._learn_n += len(sel)
            if self._learn_n >= self.learn_batch:
                batch = self.take_learn_batch()
        return PhaseOutput(decisions, changes, batch)

    def _guard(self, out: FleetStep, observed: np.ndarray, keys: list[str], ts: list[float]) -> GuardOutcome:
        """The safety rules over the step's proposed limits (the VPA learned the samples, so the
        rules saw them), with *observed* ``(n, 2)`` the limits the samples report: *out*'s ``decide`` / ``limits`` become what may be handed out, the fleet
        records it, and the VPA entries of containers with a decision are marked for persisting."""
        cache = self.vpa_cache
        guard = cache.guard
        cols = [out.resources.index(r) for r in LIMITED]
        rows = np.array(cache.rows(keys), dtype=np.intp)
        proposed = np.where(out.decide[:, cols], out.limits[:, cols], np.nan)
        # in force: what the sample reports (the truth, also after someone else changed it), else what
        # the rules last let out (replay's samples report no limits)
        in_force = np.where(np.isnan(observed), guard.last_limits(rows), observed)
        t = np.array(ts, dtype=np.float64)
        g = guard.bound(rows, t, proposed, in_force)
        cpu, mem = round_limits(g.limits[:, 0], g.limits[:, 1])
        given = np.stack([cpu, mem], 1)
        emit = g.emit & ~(given == in_force)
        given = np.where(emit, given, np.nan)
        guard.commit(rows, t, g, given)
        # what the fleet compares its next limits with: the limit handed out, or nothing where a
        # proposal was held back (it is proposed again at the next step)
        R = len(out.resources)
        touched = np.zeros((len(keys), R), dtype=bool)
        touched[:, cols] = out.decide[:, cols] | emit
        handed = np.full((len(keys), R), np.nan)
        handed[:, cols] = given
        self.fleet.hand_out(out, handed, touched)
        out.decide[:, cols] = emit
        out.limits[:, cols] = np.where(emit, given, out.limits[:, cols])
        if emit.any():
            cache.dirty.update(keys[i] for i in np.flatnonzero(emit.any(axis=1)).tolist())
        return g

    def take_learn_batch(self) -> bytes | None:
        """The learn windows held so far as one learn batch (None if none); the hold is emptied.

        Windows are held until ``phase_learn_batch`` of them are ready: a learn
        step costs ~0.7 ms however few windows it gets, so per-message batches
        of a few windows made the learner the worker's largest cost. The agent
        also takes a partial batch before every offset commit.
        """
        parts = self._learn_parts
        if not parts:
            return None
        self._learn_parts, self._learn_n = [], 0
        lv = None if any(p[3] is None for p in parts) else np.concatenate([p[3] for p in parts])
        return encode_learn_batch(self.name, np.concatenate([p[0] for p in parts]),
                                  np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]), lv)


# ---------------------------------------------------------------------- Faust wiring
def register_phase(app: Any, settings: Settings, *, vpa_cache: Any, partitions: int, metrics: Any,
                   dead_letter: Callable[..., Any], outputs: Any, barrier: Any) -> Any:
    """Add the phase table, the learner agent, the snapshot timer and the follower to *app*.

    *outputs*: the worker's :class:`~phasewise.streams.output.OutputSender`;
    *barrier*: its :class:`~phasewise.streams.output.CommitBarrier` (the phase
    table's writes are held there until the next commit).
    Returns an object with ``process_many(msgs) -> decisions`` (a round of
    messages with distinct hosts), ``flush()`` (sends what the last round
    produced; the phase table's marked states are collected by *barrier* at
    each commit), ``clear()``, ``expire(cutoff)`` and ``delete(keys)``.
    """
    import faust

    from phasewise.kafka import make_producer, publish_dead_letter
    from phasewise.streams.topics import _topic
    from phasewise.topics import PHASES

    name = model_name(settings.phase_feature_tuple())
    name_key = name.encode()
    table = app.Table(TABLE_NAME, default=None, partitions=partitions,
                      schema=faust.Schema(key_type=str, key_serializer="json", value_serializer="raw"),
                      help="per-container phase detector state (key: host/container)")
    models_t = _topic(app, MODELS)
    learn_t = _topic(app, LEARN_WINDOWS, 1)
    hooks_ref: list[PhaseHooks] = []
    writes = barrier.table(table, lambda: hooks_ref[0].pop_dirty())  # marked states, collected at each commit

    dl_producer: list[Any] = []

    def on_bad(value: bytes | None, key: bytes | None, offset: int, reason: str) -> None:
        if not dl_producer:
            dl_producer.append(make_producer(settings))
        publish_dead_letter(dl_producer[0], source_topic=MODELS.name, reason=reason, payload=value, key=key,
                            partition=0, offset=offset, max_bytes=settings.dead_letter_max_bytes)
        dl_producer[0].poll(0)
        metrics.dead_letters.labels(kind="schema").inc()

    def on_loaded(snap: ModelSnapshot) -> None:
        metrics.snapshot_latest.set(snap.version)

    follower = SnapshotFollower(settings, name, on_bad=on_bad, on_loaded=on_loaded)
    snap = follower.load_latest()
    if snap is not None:
        got = follower.latest()
        assert got is not None
        model, origin, version = got[1].clone(), f"snapshot v{snap.version}", snap.version
        learner = Learner(got[1].clone(), snap.version, snap.samples_seen)
    else:
        model, origin = initial_model(settings)
        version = 0
        learner = Learner(model.clone(), 0, 0)
    log.info("phase detector starts from %s (model %s, warm=%s)", origin, name, model.ready)
    metrics.model_version.set(version)
    follower.start()
    hooks = PhaseHooks(settings, vpa_cache, model=model, version=version, loader=writes.get_state,
                       latest=follower.latest)
    hooks_ref.append(hooks)
    pending: list[PhaseOutput] = []

    @app.agent(learn_t, name="phasewise.phase-learner")
    async def on_learn_windows(stream: Any) -> None:
        async for event in stream.events():
            got = follower.latest()
            if got is not None and learner.rebase(*got):
                log.info("learner re-based on snapshot v%d", learner.version)
            m = learner.model
            try:
                W, P, U, LV = decode_learn_batch(event.message.value, name, m.window_len, m.n_features, m.features)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            except Exception as e:  # noqa: BLE001 - decode raises SchemaError only; a record never stops the agent
                log.exception("decoding a learn batch failed")
                await dead_letter(event, f"could not decode: {type(e).__name__}: {e}", "schema")
                continue
            try:
                metrics.windows_learned.inc(learner.learn(W, P, U, LV))
            except Exception as e:  # noqa: BLE001 - a bug on valid input: keep the message, keep going
                log.exception("learning a valid learn batch failed")
                await dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")

    @app.timer(interval=settings.phase_snapshot_interval_s)
    async def publish_snapshot() -> None:
        snap = learner.snapshot()
        if snap is None:
            return
        await models_t.send(key=name_key, value=encode(snap))
        metrics.snapshots_published.inc()
        log.info("published model snapshot %s v%d (%d windows learned, warm=%s)", name, snap.version,
                 snap.samples_seen, learner.model.ready)

    @app.on_before_shutdown.connect
    async def _stop_follower(app: Any, **kwargs: Any) -> None:
        follower.stop()

    class Hooks:
        def process_many(self, msgs: Sequence[HostSamples]) -> list[Decision]:
            """The detector over messages with distinct containers (one fleet step); their decisions."""
            out = hooks.process_many(msgs)
            metrics.model_version.set(hooks.version)
            pending.append(out)
            return out.decisions

        def flush(self) -> None:
            while pending:
                out = pending.pop(0)
                for c in out.changes:
                    outputs.send(PHASES.name, c.container.encode(), encode(c))
                    log.debug("phase change %s/%s: %s -> %s", c.host, c.container, c.old_phase, c.new_phase)
                if out.changes:
                    metrics.phase_changes.inc(len(out.changes))
                if out.learn_batch is not None:
                    outputs.send(LEARN_WINDOWS.name, name_key, out.learn_batch)

        def send_learn_batch(self) -> None:
            """Send the learn windows held so far (run before every offset commit)."""
            batch = hooks.take_learn_batch()
            if batch is not None:
                outputs.send(LEARN_WINDOWS.name, name_key, batch)

        def clear(self) -> None:
            hooks.clear()

        def expire(self, cutoff: float) -> list[str]:
            """Forget the detector's containers whose newest sample is older than *cutoff*."""
            return hooks.fleet.expire(cutoff)

        def delete(self, keys: Any) -> None:
            """Delete *keys* from the phase table (at the next commit), where it holds them."""
            for k in keys:
                if writes.get(k) is not None:
                    writes.delete(k)

    h = Hooks()
    barrier.before.append(h.send_learn_batch)  # a partial batch goes out with every commit
    h.hooks, h.learner, h.follower, h.table = hooks, learner, follower, table  # type: ignore[attr-defined]
    return h
