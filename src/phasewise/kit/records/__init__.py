"""Every record phasewise puts on a topic, in one module.

Producers, stream agents, actuators and outside subscribers share these
definitions. Each record is a frozen dataclass carrying ``v`` (its schema
version) and ``ts`` (event time, Unix seconds). Wire format is JSON (UTF-8).

Parsing is strict: :func:`decode` turns bytes into a record or raises
:class:`SchemaError` whose message says exactly what is wrong, so a consumer
can dead-letter the message with that reason instead of crashing. Whatever a
record holds (a null value, bytes that are not UTF-8 or not JSON, nesting
deeper than the parser's recursion limit, a number of thousands of digits,
more than :data:`MAX_MESSAGE_BYTES`), the answer is a record or a
``SchemaError``, never another exception. Integer fields hold 64-bit
integers; a reason quotes at most the first few dozen characters of a value.

JSON Schemas for subscribers are generated from these classes
(:func:`json_schemas`) into ``infra/schemas/`` and a test keeps them current.

>>> s = ContainerSample(container="job-a", cpu_cores=1.5, mem_bytes=2**30)
>>> msg = HostSamples(host="h1", ts=1.0, interval_s=1.0, containers=(s,))
>>> decode(HostSamples, encode(msg)) == msg
True
>>> decode(HostSamples, b'{"v": 1, "host": "h1"}')
Traceback (most recent call last):
...
phasewise.kit.records.SchemaError: HostSamples: missing field 'ts'
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

try:  # the worker's hot path parses and writes JSON with orjson when installed (streams extra)
    from orjson import JSONDecodeError as _FastJSONError
    from orjson import dumps as _fast_dumps
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - host agent / actuator installs
    _fast_dumps = _fast_loads = None

__all__ = [
    "SchemaError",
    "ContainerSample",
    "ContainerIdentity",
    "WorkloadPolicy",
    "LAYOUTS",
    "MODES",
    "UPDATE_MODES",
    "WORKLOAD_POLICIES",
    "GpuSample",
    "HostSamples",
    "JobEvent",
    "JobSpec",
    "JobRequests",
    "JobTargets",
    "Interval",
    "UtilisationPrediction",
    "Decision",
    "Actuation",
    "PhaseChange",
    "ModelSnapshot",
    "DeadLetter",
    "JobControl",
    "RECORDS",
    "MAX_MESSAGE_BYTES",
    "MAX_JOB_EVENT_BYTES",
    "brief",
    "encode_within",
    "max_bytes",
    "encode",
    "decode",
    "decode_host_samples",
    "from_dict",
    "to_dict",
    "json_schemas",
]

# Bounds that reject absurd values at the edge. A container using more than
# 4096 cores or 64 TiB is a broken sampler, not a workload.
MAX_CORES = 4096.0
MAX_BYTES = float(2**46)
MAX_PCT = 100.0
#: the largest message :func:`decode` parses (a cap on the memory one record can
#: take; Kafka's default message size limit is 1 MB)
MAX_MESSAGE_BYTES = 16 * 2**20
#: integer fields are 64-bit (what Kafka's other clients read)
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


class SchemaError(ValueError):
    """A message does not match its record's schema; ``str(e)`` is the reason."""


def brief(value: Any, limit: int = 60) -> str:
    """A value as a reason quotes it: ``repr`` up to *limit* characters, an array or object by its kind.

    >>> brief("x" * 100, limit=20), brief(10**80, limit=20), brief(1.5)
    ("'xxxxxxx... (102 characters)", '10000000... (81 characters)', '1.5')
    >>> brief([[1]]), brief({"a": 1})
    ('an array', 'an object')
    """
    t = type(value)
    if t is list or t is tuple:
        return "an array"
    if t is dict:
        return "an object"
    try:
        r = repr(value)
    except (ValueError, RecursionError):  # e.g. an int beyond the interpreter's digit limit
        return f"a {t.__name__}"
    return r if len(r) <= limit else f"{r[:limit - 12]}... ({len(r)} characters)"


def _f(
    *,
    default: Any = dataclasses.MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    enum: tuple[str, ...] | None = None,
    pattern: str | None = None,
    max_length: int | None = None,
    max_items: int | None = None,
    max_bytes: int | None = None,
    key_max_length: int | None = None,
    doc: str = "",
) -> Any:
    """A record field's declaration: its default and the bounds :func:`decode` checks.

    *max_length*: characters of a string, of each string of an array of
    strings, or of each value of an object of strings; *max_items*: items of
    an array, entries of an object; *max_bytes*: UTF-8 bytes of an array of
    strings' items together; *key_max_length*: characters of each key of an
    object of strings.
    """
    meta = {"minimum": minimum, "maximum": maximum, "enum": enum, "doc": doc}
    if pattern is not None:
        meta["pattern"] = pattern
    for k, v in (("max_length", max_length), ("max_items", max_items), ("max_bytes", max_bytes),
                 ("key_max_length", key_max_length)):
        if v is not None:
            meta[k] = v
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- records

#: where a container's cgroup was found (:mod:`phasewise.kit.cgroups.layouts`)
LAYOUTS = ("flat", "docker-cgroupfs", "docker-systemd", "kubepods-cgroupfs", "kubepods-systemd")
#: what phasewise may do to a workload: nothing, decide and publish only, or decide and write
MODES = ("off", "recommend", "apply")
#: the limit policies a workload may ask for
WORKLOAD_POLICIES = ("vpa", "phase")
#: how a resize is carried out on Kubernetes: in place only, or in place with eviction as the fallback
#: (VPA's InPlaceOrRecreate)
UPDATE_MODES = ("in-place", "in-place-or-recreate")
#: a job id: the characters of a managed container name (cgroupfs)
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,200}$"


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerIdentity:
    """Who a container is: where its cgroup was found and, where known, its pod and name."""

    layout: str = _f(enum=LAYOUTS, doc="the cgroup layout it was found in")
    container_id: str | None = _f(default=None, doc="the runtime's container id (flat: the cgroup name)")
    pod_uid: str | None = _f(default=None, doc="Kubernetes pod UID")
    pod_namespace: str | None = _f(default=None)
    pod_name: str | None = _f(default=None)
    container_name: str | None = _f(default=None, doc="the container's name in its pod (or Docker's name)")
    runtime: str | None = _f(default=None, enum=("containerd", "cri-o", "docker"))
    qos: str | None = _f(default=None, enum=("guaranteed", "burstable", "besteffort"),
                         doc="Kubernetes QoS class of the pod")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadPolicy:
    """The per-workload policy the host agent resolved for a container (annotations, policy file, default)."""

    mode: str = _f(enum=MODES, doc="off: ignored; recommend: decided, never written; apply: decided and written")
    source: str = _f(default="default", enum=("annotation", "policy-file", "default"),
                     doc="where the mode came from")
    policy: str | None = _f(default=None, enum=WORKLOAD_POLICIES,
                            doc="limit policy asked for (vpa, phase); null = the worker's")
    cpu_min_cores: float | None = _f(default=None, minimum=0, maximum=MAX_CORES)
    cpu_max_cores: float | None = _f(default=None, minimum=0, maximum=MAX_CORES)
    mem_min_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)
    mem_max_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)
    priority: int | None = _f(default=None, doc="higher is more important")
    workload_class: str | None = _f(default=None, doc="training | inference | interactive, or the operator's own")
    update_mode: str | None = _f(default=None, enum=UPDATE_MODES,
                                 doc="Kubernetes: in-place (null: the default) or in-place-or-recreate (evict when "
                                     "a resize is infeasible or stays pending)")
    error: str | None = _f(default=None, doc="why the workload's policy was refused (mode is then off)")
    job: str | None = _f(default=None, pattern=JOB_ID_PATTERN,
                         doc="the job this container belongs to (phasewise.io/job): an actuator freezes, "
                             "weights or terminates it for that job's decisions")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerSample:
    """One container's usage over the producer's last interval."""

    VERSION: ClassVar[int] = 1
    container: str = _f(doc="container id: cgroup path relative to the managed root")
    cpu_cores: float = _f(minimum=0, maximum=MAX_CORES, doc="CPU cores used (mean over interval)")
    mem_bytes: float = _f(minimum=0, maximum=MAX_BYTES, doc="memory working set, bytes")
    cpu_limit_cores: float | None = _f(
        default=None, minimum=0, maximum=MAX_CORES, doc="current CPU limit; null = unlimited"
    )
    mem_limit_bytes: float | None = _f(
        default=None, minimum=0, maximum=MAX_BYTES, doc="current memory limit; null = unlimited"
    )
    throttled_periods: int = _f(default=0, minimum=0, doc="CFS periods throttled (delta)")
    nr_periods: int = _f(default=0, minimum=0, doc="CFS periods elapsed (delta)")
    throttled_s: float = _f(default=0.0, minimum=0, doc="time throttled, seconds (delta)")
    oom_events: int = _f(default=0, minimum=0, doc="OOM kills (delta)")
    gpu_util: float | None = _f(
        default=None, minimum=0, maximum=MAX_PCT * 64, doc="GPU SM utilisation, percent summed over GPUs"
    )
    gpu_mem_bytes: float | None = _f(
        default=None, minimum=0, maximum=MAX_BYTES, doc="GPU memory used by its processes, bytes"
    )
    identity: ContainerIdentity | None = _f(default=None, doc="who the container is; null = unknown")
    workload: WorkloadPolicy | None = _f(default=None, doc="its per-workload policy; null = not resolved")


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSample:
    """One GPU of a host."""

    VERSION: ClassVar[int] = 1
    index: int = _f(minimum=0)
    uuid: str = _f()
    util: float = _f(minimum=0, maximum=MAX_PCT, doc="SM utilisation, percent")
    mem_used_bytes: float = _f(minimum=0, maximum=MAX_BYTES)
    mem_total_bytes: float = _f(minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSamples:
    """One message per host per tick holding all its containers (key: host)."""

    VERSION: ClassVar[int] = 1
    host: str = _f()
    ts: float = _f(minimum=0, doc="event time of the end of the interval, Unix seconds")
    interval_s: float = _f(minimum=0, maximum=86400)
    containers: tuple[ContainerSample, ...] = _f(default=())
    gpus: tuple[GpuSample, ...] = _f(default=())
    host_cpu_cores: float | None = _f(default=None, minimum=0, maximum=MAX_CORES)
    host_cpu_count: int | None = _f(default=None, minimum=0)
    host_mem_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)
    host_mem_total_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)
    v: int = _f(default=1)


#: the largest batch size a job spec may name (anything above is a typo, not a workload)
MAX_BATCH = 2**20
#: a job's command: at most this many arguments and this many UTF-8 bytes in all. A training job's
#: command line is tens to hundreds of bytes (an interpreter, a script, its flags); 16 KiB leaves room
#: for long flag lists and a JSON argument while a decision that carries the whole spec stays small
#: (Linux itself takes up to 2 MiB of arguments: the limit is ours, see docs/security.md)
MAX_COMMAND_ARGS = 256
MAX_COMMAND_BYTES = 16 * 2**10
#: a model name: a catalog name, an ``mlp-...`` name (65 widths of up to 6 digits and its suffixes take
#: about 470 characters) or ``module:function``
MAX_MODEL_NAME = 512
#: a dataset name (the catalog's are at most 16 characters, with their aliases)
MAX_DATASET_NAME = 64
#: a node selector: entries; a key as long as a Kubernetes label key (a 253-character prefix, "/",
#: a 63-character name); a value as long as 16 label values of 63 characters joined by "|"
MAX_SELECTOR_ENTRIES = 64
MAX_SELECTOR_KEY = 317
MAX_SELECTOR_VALUE = 1024
#: a metric's name (targets, progress)
MAX_METRIC_NAME = 128
#: a host name (a DNS name is at most 253 characters) and a container name (a cgroup path below the
#: managed root) in a job event
MAX_HOST_NAME = 255
MAX_CONTAINER_NAME = 1024
#: a whole job event as published: its fields' own bounds take about 40 KB at most; re-encoded (text
#: escaped as ASCII grows at most threefold) inside a decision with the signature, a role's outputs
#: stay far under the producers' 1,000,000-byte message limit (docs/security.md, "Record sizes")
MAX_JOB_EVENT_BYTES = 64 * 2**10


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRequests:
    """Resources a job asks for; null = not stated (the predictions stand in)."""

    cpu_cores: float | None = _f(default=None, minimum=0, maximum=MAX_CORES)
    mem_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)
    gpus: float = _f(default=0.0, minimum=0, maximum=64, doc="GPUs; fractional allowed, e.g. 0.5")
    gpu_mem_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobTargets:
    """A training job's two-tier target on a metric it reports (TRADL's <acceptable, objective>)."""

    metric: str = _f(default="loss", max_length=MAX_METRIC_NAME)
    direction: str = _f(default="min", enum=("min", "max"))
    acceptable: float | None = _f(default=None)
    objective: float | None = _f(default=None)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """What a submitted job runs: its model, data, batch, precision and requests."""

    model: str = _f(max_length=MAX_MODEL_NAME,
                    doc="catalog name (e.g. resnet50) or module:function returning an nn.Module")
    dataset: str = _f(max_length=MAX_DATASET_NAME, doc="catalog dataset name (e.g. cifar10); gives the input shape")
    batch_size: int = _f(minimum=1, maximum=MAX_BATCH)
    amp: bool = _f(default=False, doc="automatic mixed precision")
    requests: JobRequests = _f(default=JobRequests())
    targets: JobTargets | None = _f(default=None)
    command: tuple[str, ...] = _f(default=(), max_items=MAX_COMMAND_ARGS, max_bytes=MAX_COMMAND_BYTES,
                                  doc="argv that starts the job locally")
    node_selector: dict[str, str] = _f(default={}, max_items=MAX_SELECTOR_ENTRIES, key_max_length=MAX_SELECTOR_KEY,
                                       max_length=MAX_SELECTOR_VALUE,
                                       doc="node labels the job needs, e.g. a GPU model (a value may list "
                                           "alternatives: a|b)")
    expected_s: float | None = _f(default=None, minimum=0, maximum=86400 * 365,
                                  doc="seconds the job expects to run once started; null = unknown (long)")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """A job's life: submitted (with its spec), started (where), progress, a new priority, finished (key: job).

    ``admitted`` and ``stopped`` are the priority agent's hints to the placement
    agent (``priority_launcher=place``): the job may start (or resume) now on
    ``host``; the job was stopped by checkpoint-and-exit and holds nothing.
    A consumer ignores the kinds it does not act on.
    """

    VERSION: ClassVar[int] = 1
    #: the largest message :func:`decode` takes for this record (the others: :data:`MAX_MESSAGE_BYTES`)
    MAX_BYTES: ClassVar[int] = MAX_JOB_EVENT_BYTES
    job: str = _f(pattern=JOB_ID_PATTERN, doc="job id (the characters of a container name)")
    ts: float = _f(minimum=0)
    kind: str = _f(enum=("submitted", "started", "progress", "priority", "finished", "admitted", "stopped"),
                   doc="priority: the job's priority is now `priority` (its class stays the submitted one); "
                       "admitted: the priority agent let the job start (or resume, `resume`) on `host` now, "
                       "for the placement agent to place there; stopped: the priority agent stopped the job "
                       "by checkpoint-and-exit (what it booked is free; a frozen job is not stopped)")
    host: str | None = _f(default=None, max_length=MAX_HOST_NAME,
                          doc="where it runs (kind started), where it was admitted (kind admitted)")
    container: str | None = _f(default=None, max_length=MAX_CONTAINER_NAME,
                               doc="its container (kinds started, admitted)")
    pid: int | None = _f(default=None, minimum=1, maximum=2**31 - 1,
                         doc="kind started: the process the actuator started (on `host`)")
    workload: str = _f(default="training", enum=("training", "inference", "interactive"))
    priority: int = _f(default=0, doc="higher is more important")
    spec: JobSpec | None = _f(default=None, doc="kind submitted only")
    step: int | None = _f(default=None, minimum=0)
    loss: float | None = _f(default=None)
    metric: float | None = _f(default=None)
    metric_name: str | None = _f(default=None, max_length=MAX_METRIC_NAME)
    epoch: float | None = _f(default=None, minimum=0)
    resume: bool = _f(default=False, doc="kind admitted: the job restarts from its checkpoint (it was stopped)")
    signature: str | None = _f(default=None, pattern=r"^[a-z0-9]{1,16}:[0-9a-f]{8}:[A-Za-z0-9+/=]{1,200}$",
                               doc="kind submitted: the submitter's signature, ed25519:<key id>:<base64>, over "
                                   "job, ts, workload, priority and the spec's digest (phasewise.kit.job_signing); "
                                   "an unsigned job is placed and predicted but never started by an actuator")
    v: int = _f(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A predicted quantity: its mean and an interval [lo, hi] at the prediction's coverage."""

    mean: float = _f(minimum=0)
    lo: float = _f(minimum=0)
    hi: float = _f(minimum=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilisationPrediction:
    """What a submitted job will use, predicted from its computation graph before it runs (key: job)."""

    VERSION: ClassVar[int] = 1
    job: str = _f()
    ts: float = _f(minimum=0)
    model_version: int = _f(minimum=0, doc="jobs the model had learned from when it predicted")
    device: str | None = _f(default=None, doc="GPU model the prediction is for; null = any")
    gpu_util: Interval = _f(doc="mean GPU utilisation over the steady phase, percent of one GPU (0-100)")
    gpu_mem_bytes: Interval = _f(doc="GPU memory, bytes")
    cpu_cores: Interval = _f(doc="mean CPU cores over the steady phase")
    mem_bytes: Interval = _f(doc="host memory (working set), bytes")
    coverage: float = _f(minimum=0, maximum=1, doc="nominal probability that [lo, hi] holds the observed value")
    first_sight: bool = _f(default=True, doc="no job of this model had been observed")
    features: dict = _f(default={}, doc="the graph features the prediction used")
    v: int = _f(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What a policy wants done to one container (key: host)."""

    VERSION: ClassVar[int] = 1
    id: str = _f(doc="idempotency key: an actuator applies each id at most once")
    ts: float = _f(minimum=0)
    host: str = _f()
    container: str = _f()
    action: str = _f(enum=("limit", "freeze", "thaw", "terminate", "place", "scale", "share", "weight"))
    policy: str = _f(doc="policy that produced it, e.g. vpa, phase")
    reason: str = _f(default="")
    cpu_limit_cores: float | None = _f(default=None, minimum=0, maximum=MAX_CORES)
    mem_limit_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)
    details: dict = _f(default={}, doc="the numbers behind the decision")
    v: int = _f(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Actuation:
    """What an actuator did with a decision (key: host)."""

    VERSION: ClassVar[int] = 1
    decision_id: str = _f()
    ts: float = _f(minimum=0)
    host: str = _f()
    container: str = _f()
    status: str = _f(enum=("applied", "clamped", "duplicate", "rejected", "failed"))
    backend: str = _f()
    message: str = _f(default="")
    cpu_limit_cores: float | None = _f(default=None, minimum=0, maximum=MAX_CORES)
    mem_limit_bytes: float | None = _f(default=None, minimum=0, maximum=MAX_BYTES)
    decision_ts: float | None = _f(default=None, minimum=0)
    v: int = _f(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChange:
    """A container entered a new phase (key: container)."""

    VERSION: ClassVar[int] = 1
    container: str = _f()
    host: str = _f()
    ts: float = _f(minimum=0)
    old_phase: int | None = _f(default=None)
    new_phase: int = _f(minimum=0)
    since: float = _f(minimum=0, doc="event time the old phase began")
    stats: dict = _f(default={}, doc="per-resource statistics of the new phase")
    v: int = _f(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSnapshot:
    """A serialised model (compacted topic, key: model name)."""

    VERSION: ClassVar[int] = 1
    name: str = _f()
    ts: float = _f(minimum=0)
    version: int = _f(minimum=0, doc="monotonic snapshot counter")
    payload_b64: str = _f(doc="base64 of the model checkpoint")
    samples_seen: int = _f(default=0, minimum=0)
    v: int = _f(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """A message that could not be processed, with why (key: source key)."""

    VERSION: ClassVar[int] = 1
    ts: float = _f(minimum=0)
    source_topic: str = _f()
    partition: int | None = _f(default=None)
    offset: int | None = _f(default=None)
    reason: str = _f()
    payload: str = _f(doc="the original bytes, UTF-8 with backslash escapes for invalid bytes "
                          "(only their start when truncated)")
    key: str | None = _f(default=None)
    payload_bytes: int | None = _f(default=None, minimum=0,
                                   doc="size of the original value in bytes; null: the record had no value")
    truncated: bool = _f(default=False, doc="payload (or key) holds only the start of the original, cut so "
                                            "that the dead letter fits the broker's message size limit")
    v: int = _f(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobControl:
    """An instruction to a running job, delivered by its progress reporter (key: job).

    ``checkpoint_exit``: save a checkpoint and exit within ``grace_s`` seconds (after it,
    the sender may stop the job hard); ``pause``: stop stepping until ``resume``.
    A job's reporter runs each ``id`` at most once.
    """

    VERSION: ClassVar[int] = 1
    id: str = _f(doc="idempotency key: a reporter delivers each id at most once")
    job: str = _f(pattern=JOB_ID_PATTERN, doc="job id (the key; the characters of a container name)")
    ts: float = _f(minimum=0)
    action: str = _f(enum=("checkpoint_exit", "pause", "resume"))
    policy: str = _f(default="", doc="who sent it, e.g. targets, priorities")
    reason: str = _f(default="", doc="why, naming the rule or target behind it")
    grace_s: float | None = _f(default=None, minimum=0, maximum=86400,
                               doc="checkpoint_exit: seconds the job has before a hard stop")
    v: int = _f(default=1)


RECORDS: tuple[type, ...] = (
    HostSamples,
    ContainerSample,
    ContainerIdentity,
    WorkloadPolicy,
    GpuSample,
    JobEvent,
    JobSpec,
    JobRequests,
    JobTargets,
    Interval,
    UtilisationPrediction,
    Decision,
    Actuation,
    PhaseChange,
    ModelSnapshot,
    DeadLetter,
    JobControl,
)

R = TypeVar("R")

# --------------------------------------------------------------------------- parsing

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = typing.get_type_hints(cls)
        h.pop("VERSION", None)
        h.pop("MAX_BYTES", None)
        _HINTS[cls] = h
    return h


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _number_converter(cls: str, name: str, meta: dict, integer: bool, optional: bool):
    lo, hi = meta.get("minimum"), meta.get("maximum")
    kind = "an integer" if integer else "a number"

    def convert(value: Any) -> Any:
        if value is None:
            if optional:
                return None
            raise SchemaError(f"{cls}: field '{name}' must not be null")
        t = type(value)
        if t is bool or (t is not int and t is not float):
            raise SchemaError(f"{cls}: field '{name}' must be {kind}, got {t.__name__}")
        if integer:
            if t is float:
                if not value.is_integer():
                    raise SchemaError(f"{cls}: field '{name}' must be an integer, got {value!r}")
                value = int(value)
            if value < _INT_MIN or value > _INT_MAX:
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is not a 64-bit integer")
        else:
            try:
                value = float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is too large for a number") from None
            if value != value or value in (math.inf, -math.inf):
                raise SchemaError(f"{cls}: field '{name}' must be finite, got {value!r}")
        if lo is not None and value < lo:
            raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is above the maximum {hi:g}")
        return value

    return convert


def _converter(cls: str, name: str, tp: Any, meta: dict):
    """A function validating and converting one field's decoded JSON value."""
    tp, optional = _unwrap_optional(tp)
    if tp is float or tp is int:
        return _number_converter(cls, name, meta, tp is int, optional)

    def null_or(check):
        def convert(value: Any) -> Any:
            if value is None:
                if optional:
                    return None
                raise SchemaError(f"{cls}: field '{name}' must not be null")
            return check(value)

        return convert

    max_length, max_items, max_bytes = meta.get("max_length"), meta.get("max_items"), meta.get("max_bytes")
    if tp is str:
        enum = meta.get("enum")
        pattern = re.compile(meta["pattern"]) if meta.get("pattern") else None

        def check_str(value: Any) -> str:
            if type(value) is not str:
                raise SchemaError(f"{cls}: field '{name}' must be a string, got {type(value).__name__}")
            if max_length is not None and len(value) > max_length:
                raise SchemaError(f"{cls}: field '{name}' is {len(value)} characters long, more than "
                                  f"{max_length}")
            if enum and value not in enum:
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} is not one of {list(enum)}")
            if pattern is not None and not pattern.match(value):
                raise SchemaError(f"{cls}: field '{name}' = {brief(value)} does not match {pattern.pattern}")
            return value

        return null_or(check_str)
    if tp is bool:

        def check_bool(value: Any) -> bool:
            if type(value) is not bool:
                raise SchemaError(f"{cls}: field '{name}' must be true or false, got {type(value).__name__}")
            return value

        return null_or(check_bool)
    if tp is dict:

        def check_dict(value: Any) -> dict:
            if type(value) is not dict:
                raise SchemaError(f"{cls}: field '{name}' must be an object")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} entries, more than {max_items}")
            return value

        return null_or(check_dict)
    if typing.get_origin(tp) is dict and typing.get_args(tp) == (str, str):
        key_max = meta.get("key_max_length")

        def check_labels(value: Any) -> dict:
            if type(value) is not dict:
                raise SchemaError(f"{cls}: field '{name}' must be an object")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} entries, more than {max_items}")
            for k, v in value.items():
                if type(v) is not str:
                    raise SchemaError(f"{cls}: field '{name}': the value of {brief(k)} must be a string, "
                                      f"got {type(v).__name__}")
                if key_max is not None and len(k) > key_max:
                    raise SchemaError(f"{cls}: field '{name}': key {brief(k)} is {len(k)} characters long, "
                                      f"more than {key_max}")
                if max_length is not None and len(v) > max_length:
                    raise SchemaError(f"{cls}: field '{name}': the value of {brief(k)} is {len(v)} characters "
                                      f"long, more than {max_length}")
            return value

        return null_or(check_labels)
    if dataclasses.is_dataclass(tp):  # a nested record (e.g. JobEvent.spec)

        def check_nested(value: Any) -> Any:
            try:
                return _parser(tp)(value)
            except SchemaError as e:
                raise SchemaError(f"{cls}: {name}: {e}") from None

        return null_or(check_nested)
    if typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is str:

        def check_strings(value: Any) -> tuple:
            if type(value) is not list or any(type(x) is not str for x in value):
                raise SchemaError(f"{cls}: field '{name}' must be an array of strings")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} items, more than {max_items}")
            if max_length is not None:
                for i, x in enumerate(value):
                    if len(x) > max_length:
                        raise SchemaError(f"{cls}: field '{name}'[{i}] is {len(x)} characters long, more than "
                                          f"{max_length}")
            if max_bytes is not None:
                # (lone surrogates, which JSON escapes can spell, are counted as the 3 bytes they would take)
                size = sum(len(x.encode("utf-8", "surrogatepass")) for x in value)
                if size > max_bytes:
                    raise SchemaError(f"{cls}: field '{name}' holds {size} bytes (UTF-8), more than {max_bytes}")
            return tuple(value)

        return null_or(check_strings)
    if typing.get_origin(tp) is tuple:
        item_tp = typing.get_args(tp)[0]

        def check_items(value: Any) -> tuple:
            if type(value) is not list:
                raise SchemaError(f"{cls}: field '{name}' must be an array")
            if max_items is not None and len(value) > max_items:
                raise SchemaError(f"{cls}: field '{name}' holds {len(value)} items, more than {max_items}")
            build = _parser(item_tp)
            out = []
            for i, item in enumerate(value):
                try:
                    out.append(build(item))
                except SchemaError as e:
                    raise SchemaError(f"{cls}: {name}[{i}]: {e}") from None
            return tuple(out)

        return null_or(check_items)
    raise TypeError(f"unsupported field type {tp!r}")  # a bug in this module, not bad input


_PARSERS: dict[type, Any] = {}


def _parser(cls: type):
    """Compile (once per class) a function dict -> record that validates every field."""
    parse = _PARSERS.get(cls)
    if parse is not None:
        return parse
    name = cls.__name__
    hints = _hints(cls)
    specs = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append((f.name, required, _converter(name, f.name, hints[f.name], f.metadata)))
    versioned = "v" in hints
    version = getattr(cls, "VERSION", None)

    def parse(data: Any) -> Any:
        if type(data) is not dict:
            raise SchemaError(f"{name}: expected a JSON object, got {type(data).__name__}")
        if versioned:
            v = data.get("v")
            if v is None:
                raise SchemaError(f"{name}: missing field 'v' (schema version)")
            if v != version or type(v) is bool:
                raise SchemaError(f"{name}: unsupported schema version {brief(v)} (this build reads v{version})")
        kwargs = {}
        for fname, required, convert in specs:
            if fname in data:
                kwargs[fname] = convert(data[fname])
            elif required:
                raise SchemaError(f"{name}: missing field '{fname}'")
        return cls(**kwargs)

    _PARSERS[cls] = parse
    return parse


def from_dict(cls: type[R], data: dict) -> R:
    """Build a record from a decoded JSON object, validating every field."""
    return _parser(cls)(data)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}

_isfinite = math.isfinite


def _not_finite(where: str, value: Any) -> ValueError:
    return ValueError(f"{where}: {value!r} is not a finite number (JSON has none)")


def _check_finite(tree: Any, where: str) -> None:
    """Refuse a non-finite float anywhere in a free-form dict / list (``details``, ``stats``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for v in (node.values() if isinstance(node, dict) else node):
            if isinstance(v, float):
                if not _isfinite(v):
                    raise _not_finite(where, v)
            elif isinstance(v, (dict, list, tuple)):
                stack.append(v)


def to_dict(record: Any) -> dict:
    """The record's fields as JSON-ready values; a non-finite float anywhere raises ``ValueError``."""
    cls = type(record)
    names = _FIELD_NAMES.get(cls)
    if names is None:  # dataclasses.fields() once per class, not per record
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(record))
    out = {}
    for name in names:
        value = getattr(record, name)
        t = type(value)
        if isinstance(value, float):  # numpy.float64 included
            if not _isfinite(value):
                raise _not_finite(f"{cls.__name__}.{name}", value)
        elif t is tuple:
            value = [x if type(x) is str else to_dict(x) for x in value]
        elif t is dict or t is list:
            _check_finite(value, f"{cls.__name__}.{name}")
        elif t in RECORDS:  # a nested record
            value = to_dict(value)
        out[name] = value
    return out


#: what json.dumps(..., separators=(",", ":"), allow_nan=False) builds per call, built once
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _orjson_default(obj: Any) -> Any:
    """What orjson leaves to a callback and ``json.dumps`` writes: float subclasses (e.g. numpy.float64)."""
    if isinstance(obj, float):
        return float(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def encode(record: Any) -> bytes:
    """Compact UTF-8 JSON of a record (orjson when installed, ~2x faster on decisions; else ``json``).

    The two write the same JSON values (number and non-ASCII text spellings
    may differ: ``1e-05`` / ``1e-5``, ``\\u00e9`` / UTF-8); a non-finite
    number anywhere is refused with ``ValueError`` by both.
    """
    d = to_dict(record)
    if _fast_dumps is not None:
        return _fast_dumps(d, default=_orjson_default)
    return _ENCODER.encode(d).encode()


def _unparsable(name: str, raw: Any, e: BaseException) -> SchemaError:
    """The reason *raw* could not be parsed as JSON (``json.loads`` raised *e*)."""
    if raw is None:
        return SchemaError(f"{name}: the record has no value (null, e.g. a tombstone); expected a JSON object")
    if isinstance(e, RecursionError):
        return SchemaError(f"{name}: not valid JSON: arrays or objects nested too deeply to parse")
    if isinstance(e, MemoryError):
        return SchemaError(f"{name}: not valid JSON: out of memory parsing {len(raw)} bytes")
    if isinstance(e, TypeError):
        return SchemaError(f"{name}: expected bytes, got {type(raw).__name__}")
    if isinstance(e, (UnicodeDecodeError, json.JSONDecodeError)):
        return SchemaError(f"{name}: not valid JSON: {e}")
    # ValueError: an integer literal longer than the interpreter converts (sys.get_int_max_str_digits())
    return SchemaError(f"{name}: not valid JSON: {str(e).split(';')[0]}")


def max_bytes(cls: type) -> int:
    """The largest message of record *cls* that :func:`decode` takes (its ``MAX_BYTES``, else
    :data:`MAX_MESSAGE_BYTES`)."""
    return getattr(cls, "MAX_BYTES", MAX_MESSAGE_BYTES)


def _too_large(name: str, raw: bytes | str, limit: int = MAX_MESSAGE_BYTES) -> SchemaError:
    which = "MAX_MESSAGE_BYTES" if limit == MAX_MESSAGE_BYTES else f"{name}.MAX_BYTES"
    return SchemaError(f"{name}: message of {len(raw)} bytes is larger than the limit of "
                       f"{limit} bytes ({which})")


def encode_within(record: Any) -> bytes:
    """:func:`encode`, refusing with :class:`SchemaError` a record larger than :func:`decode` takes back.

    What a writer of a bounded record (``phasewise submit``) calls: a record
    it publishes is one every consumer reads.
    """
    value = encode(record)
    limit = max_bytes(type(record))
    if len(value) > limit:
        raise _too_large(type(record).__name__, value, limit)
    return value


def decode(cls: type[R], raw: bytes | str) -> R:
    """Parse and validate one message; :class:`SchemaError` says why not (and nothing else is raised).

    >>> decode(Decision, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    phasewise...SchemaError: Decision: the record has no value (null, e.g. a tombstone); expected a JSON object
    >>> decode(Decision, b"[" * 100_000)
    Traceback (most recent call last):
    ...
    phasewise.kit.records.SchemaError: Decision: not valid JSON: arrays or objects nested too deeply to parse
    """
    try:
        limit = max_bytes(cls)
        if len(raw) > limit:
            raise _too_large(cls.__name__, raw, limit)
        data = json.loads(raw)
    except SchemaError:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        raise _unparsable(cls.__name__, raw, e) from None
    return from_dict(cls, data)


# --------------------------------------------------------------------------- fast path: HostSamples

_NoneType = type(None)


class _Column:
    """How the fast path checks one ContainerSample field, from the same metadata as the strict parser."""

    __slots__ = ("name", "kind", "optional", "lo", "hi", "slot", "record", "enum", "max_length")

    def __init__(self, cls: type, f: dataclasses.Field) -> None:
        tp, self.optional = _unwrap_optional(_hints(cls)[f.name])
        self.kind = "record" if dataclasses.is_dataclass(tp) else {float: "float", int: "int", str: "str"}[tp]
        self.record = tp if self.kind == "record" else None
        self.name = f.name
        self.lo, self.hi = f.metadata.get("minimum"), f.metadata.get("maximum")
        self.enum = frozenset(f.metadata["enum"]) if f.metadata.get("enum") else None
        self.max_length = f.metadata.get("max_length")
        if self.kind == "int":  # the strict parser's 64-bit range
            self.lo = _INT_MIN if self.lo is None else self.lo
            self.hi = _INT_MAX if self.hi is None else self.hi
        self.slot = cls.__dict__[f.name]  # the slot's member descriptor

    def check(self, col: tuple) -> tuple | None:
        """The converted column if every value passes exactly as the strict parser would pass it, else None."""
        types = set(map(type, col))
        if self.optional and _NoneType in types:
            types.discard(_NoneType)
            vals = [x for x in col if x is not None]
        else:
            vals = col
        if not types:
            return col
        if self.kind == "record":  # nested records (identity, workload): checked column-wise in turn
            if types != {dict}:
                return None
            recs = _fast_rows(self.record, vals)
            if recs is None:
                return None
            if len(recs) == len(col):
                return recs
            it = iter(recs)
            return tuple(None if x is None else next(it) for x in col)
        if self.kind == "str":
            if types != {str}:
                return None
            if self.max_length is not None and max(map(len, vals)) > self.max_length:
                return None
            return None if self.enum is not None and not set(vals) <= self.enum else col
        if self.kind == "int":
            if types != {int}:
                return None  # integral floats, bools, others: the strict parser decides
            if self.lo is not None and min(vals) < self.lo or self.hi is not None and max(vals) > self.hi:
                return None
            return col
        if not types <= {float, int}:
            return None
        if int in types:  # the strict parser stores float(value)
            col = tuple(x if x is None else float(x) for x in col)
            vals = [x for x in col if x is not None]
        # NaN or an infinity makes the sum non-finite (so can finite values whose sum
        # overflows: those take the strict path, which accepts them)
        if not math.isfinite(sum(vals)):
            return None
        if self.lo is not None and min(vals) < self.lo or self.hi is not None and max(vals) > self.hi:
            return None
        return col


_TABLES: dict[type, tuple[tuple[_Column, ...], Any, Any]] = {}


def _table(cls: type) -> tuple[tuple[_Column, ...], Any, Any]:
    """(columns, row getter, builder) of the fast path for record *cls*, made once."""
    t = _TABLES.get(cls)
    if t is None:
        cols = tuple(_Column(cls, f) for f in dataclasses.fields(cls))
        # rows of checked values -> records, bypassing __init__ (one slot store per field,
        # unrolled: the values were validated and converted exactly as __init__'s caller would)
        args = ", ".join(f"a{i}" for i in range(len(cols)))
        body = "; ".join(f"s{i}(o, a{i})" for i in range(len(cols)))
        src = (f"def build(rows):\n    out = []\n    for {args}{',' if len(cols) == 1 else ''} in rows:\n"
               f"        o = new(cls); {body}; out.append(o)\n    return tuple(out)\n")
        ns: dict[str, Any] = {"new": object.__new__, "cls": cls,
                              **{f"s{i}": c.slot.__set__ for i, c in enumerate(cols)}}
        exec(compile(src, f"<phasewise.kit.records fast {cls.__name__}>", "exec"), ns)
        names = [c.name for c in cols]
        getter = operator.itemgetter(*names) if len(names) > 1 else (lambda d, n=names[0]: (d[n],))
        t = _TABLES[cls] = (cols, getter, ns["build"])
    return t


def _cs_columns() -> tuple[_Column, ...]:
    return _table(ContainerSample)[0]


def _fast_rows(cls: type, items: list) -> tuple | None:
    """Records *cls* of a list of dicts, column-wise; None = let the strict parser decide."""
    cols, getter, build = _table(cls)
    try:
        rows = list(map(getter, items))
    except KeyError:  # a field left to its default: the strict parser fills it in
        return None
    checked = []
    try:
        for c, col in zip(cols, zip(*rows)):
            col = c.check(col)
            if col is None:
                return None
            checked.append(col)
    except (OverflowError, ValueError, TypeError):  # e.g. an int too large for a float: strict says what
        return None
    return build(zip(*checked))


def _fast_containers(items: Any) -> tuple[ContainerSample, ...] | None:
    """``containers`` of a HostSamples message, column-wise; None = let the strict parser decide."""
    if type(items) is not list:
        return None
    if not items:
        return ()
    if set(map(type, items)) != {dict}:
        return None
    return _fast_rows(ContainerSample, items)


def decode_host_samples(raw: bytes | str) -> HostSamples:
    """``decode(HostSamples, raw)``, faster: same record, same accept/reject answer, same reason.

    The containers are checked column by column (types, finiteness and bounds
    from the same field metadata). Anything the fast checks do not accept as
    they stand (a missing field left to its default, an integral float in an
    integer field, any invalid value) goes through the strict parser, which
    returns the record or raises :class:`SchemaError` with its reason.

    The JSON is parsed with orjson when it is installed. orjson refuses a
    little that ``json.loads`` takes (``NaN``/``Infinity`` literals, integers
    beyond 64 bits, lone surrogate escapes): those go through the strict
    parser too, so the answer never depends on which parser is installed.
    Like :func:`decode`, it raises nothing but :class:`SchemaError`.
    """
    if type(raw) is not bytes or len(raw) > MAX_MESSAGE_BYTES:
        return decode(HostSamples, raw)  # null, text, too large: the strict parser decides
    if _fast_loads is not None:
        try:
            data = _fast_loads(raw)
        except (_FastJSONError, TypeError, MemoryError):
            return decode(HostSamples, raw)  # the strict parser decides, and words the error
    else:
        try:
            data = json.loads(raw)
        except (ValueError, TypeError, RecursionError, MemoryError):
            return decode(HostSamples, raw)  # the strict parser words the error
    if type(data) is dict and "containers" in data:
        cs = _fast_containers(data["containers"])
        if cs is not None:
            try:
                top = from_dict(HostSamples, {**data, "containers": []})
            except SchemaError:
                return from_dict(HostSamples, data)  # the first error in field order, as strict reports it
            return dataclasses.replace(top, containers=cs)
    return from_dict(HostSamples, data)


def payload_text(raw: bytes | None) -> str:
    """Lossless text form of arbitrary bytes for a dead letter."""
    if raw is None:
        return ""
    return raw.decode("utf-8", errors="backslashreplace")


# --------------------------------------------------------------------------- JSON Schema


def _json_type(tp: Any, meta: dict, defs: dict) -> dict:
    tp, optional = _unwrap_optional(tp)
    if tp is float:
        s: dict = {"type": "number"}
    elif tp is int:
        s = {"type": "integer"}
    elif tp is bool:
        s = {"type": "boolean"}
    elif tp is str:
        s = {"type": "string"}
        if meta.get("enum"):
            s["enum"] = list(meta["enum"])
        if meta.get("pattern"):
            s["pattern"] = meta["pattern"]
        if meta.get("max_length") is not None:
            s["maxLength"] = meta["max_length"]
    elif tp is dict:
        s = {"type": "object"}
        if meta.get("max_items") is not None:
            s["maxProperties"] = meta["max_items"]
    elif typing.get_origin(tp) is dict:  # an object of strings
        value: dict = {"type": "string"}
        if meta.get("max_length") is not None:
            value["maxLength"] = meta["max_length"]
        s = {"type": "object", "additionalProperties": value}
        if meta.get("key_max_length") is not None:
            s["propertyNames"] = {"maxLength": meta["key_max_length"]}
        if meta.get("max_items") is not None:
            s["maxProperties"] = meta["max_items"]
    elif dataclasses.is_dataclass(tp):
        defs[tp.__name__] = _schema_body(tp, defs)
        ref: dict = {"$ref": f"#/$defs/{tp.__name__}"}
        s = {"anyOf": [ref, {"type": "null"}]} if optional else ref
        if meta.get("doc"):
            s["description"] = meta["doc"]
        return s
    elif typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is str:
        s = {"type": "array", "items": {"type": "string"}}
        if meta.get("max_length") is not None:
            s["items"]["maxLength"] = meta["max_length"]
        if meta.get("max_bytes") is not None:  # no JSON Schema keyword says it: the items' own bound, and words
            s["items"]["maxLength"] = min(meta["max_bytes"], s["items"].get("maxLength", meta["max_bytes"]))
    elif typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        defs[item.__name__] = _schema_body(item, defs)
        s = {"type": "array", "items": {"$ref": f"#/$defs/{item.__name__}"}}
    elif dataclasses.is_dataclass(tp):
        defs[tp.__name__] = _schema_body(tp, defs)
        s = {"$ref": f"#/$defs/{tp.__name__}"}
    else:
        raise TypeError(tp)
    if meta.get("max_items") is not None and s.get("type") == "array":
        s["maxItems"] = meta["max_items"]
    if meta.get("minimum") is not None:
        s["minimum"] = meta["minimum"]
    if meta.get("maximum") is not None:
        s["maximum"] = meta["maximum"]
    if meta.get("doc"):
        s["description"] = meta["doc"]
    if meta.get("max_bytes") is not None:
        s["description"] = (s.get("description", "") + f" (at most {meta['max_bytes']} bytes of UTF-8 in all)").strip()
    if optional:
        if "type" in s:
            s["type"] = [s["type"], "null"]
        else:  # a nested record
            ref = {"$ref": s.pop("$ref")}
            s = {"anyOf": [ref, {"type": "null"}], **s}
    return s


def _schema_body(cls: type, defs: dict) -> dict:
    hints = _hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        props[f.name] = _json_type(hints[f.name], f.metadata, defs)
        if f.name == "v":
            props["v"] = {"const": cls.VERSION, "description": "schema version"}  # type: ignore[attr-defined]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    if "v" in props:
        required.append("v")
    return {
        "type": "object",
        "description": (cls.__doc__ or "").strip().splitlines()[0],
        "properties": props,
        "required": required,
        "additionalProperties": True,
    }


def json_schemas() -> dict[str, dict]:
    """``{file name: JSON Schema}`` for every top-level record."""
    out = {}
    for cls in RECORDS:
        if "v" not in _hints(cls):
            continue  # nested records are $defs of their parents
        defs: dict = {}
        body = _schema_body(cls, defs)
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"phasewise/{cls.__name__}.v{cls.VERSION}.json",  # type: ignore[attr-defined]
            "title": cls.__name__,
            **body,
        }
        if "MAX_BYTES" in cls.__dict__:  # no JSON Schema keyword bounds a document's size: said in words
            schema["description"] += f" A message is at most {cls.MAX_BYTES} bytes."  # type: ignore[attr-defined]
        if defs:
            schema["$defs"] = defs
        out[f"{cls.__name__}.v{cls.VERSION}.json"] = schema  # type: ignore[attr-defined]
    return out
