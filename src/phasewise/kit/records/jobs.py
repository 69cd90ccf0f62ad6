"""A job's records: its spec (:class:`JobSpec`), its life (:class:`JobEvent`), instructions to it (:class:`JobControl`).

docs/horus.md says how a job is submitted, docs/security.md how it is signed and bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records.codec import MAX_BYTES, MAX_CORES, field

__all__ = ["JOB_EVENT_KINDS", "JOB_ID_PATTERN", "MAX_JOB_EVENT_BYTES", "STAGE_PATTERN", "TERMINAL_KINDS",
           "JobControl", "JobEvent", "JobRequests", "JobService", "JobSpec",
           "JobTargets", "closest_name", "targets_problem", "unknown_field"]

#: a job id: the characters of a managed container name (cgroupfs)
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,200}$"

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
#: a stage a job reports (``phase=eval`` in its progress lines): a word
STAGE_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"
#: a host name (a DNS name is at most 253 characters) and a container name (a cgroup path below the
#: managed root) in a job event
MAX_HOST_NAME = 255
MAX_CONTAINER_NAME = 1024
#: a cpuset list ("0-3,8,10-11"): 64 CPU ranges of up to 4 digits each
MAX_CPUSET = 1024
#: GPUs one job may be given, and a device's name (an index, or a UUID such as GPU-<36 hex and dashes>
#: or MIG-<...>)
MAX_DEVICES = 64
MAX_DEVICE_NAME = 96
#: a state's reason (a rejected placement, a failure, a lost booking), in words
MAX_REASON = 1024
#: a job's states (docs/jobs.md, "Lifecycle"); :data:`TERMINAL_KINDS` end it (``terminated`` does unless it
#: is resumed, which only the agent that stopped it knows)
JOB_EVENT_KINDS = ("submitted", "started", "progress", "priority", "finished", "admitted", "stopped",
                   "rejected", "frozen", "thawed", "failed", "terminated", "lost", "waiting", "scaled")
TERMINAL_KINDS = frozenset({"finished", "failed", "rejected", "lost"})
#: a whole job event as published: its fields' own bounds take about 40 KB at most; re-encoded (text
#: escaped as ASCII grows at most threefold) inside a decision with the signature, a role's outputs
#: stay far under the producers' 1,000,000-byte message limit (docs/security.md, "Record sizes")
MAX_JOB_EVENT_BYTES = 64 * 2**10


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRequests:
    """Resources a job asks for; null = not stated (the predictions stand in)."""

    cpu_cores: float | None = field(default=None, minimum=0, maximum=MAX_CORES)
    mem_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)
    gpus: float = field(default=0.0, minimum=0, maximum=64, doc="GPUs; fractional allowed, e.g. 0.5")
    gpu_mem_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobTargets:
    """A training job's two-tier target on a metric it reports (TRADL's <acceptable, objective>)."""

    metric: str = field(default="loss", max_length=MAX_METRIC_NAME)
    direction: str = field(default="min", enum=("min", "max"))
    acceptable: float | None = field(default=None)
    objective: float | None = field(default=None)


#: replicas of one service at most (a replica k listens on the service's port + k)
MAX_REPLICAS = 64
#: a Prometheus metric name
METRIC_NAME_PATTERN = r"^[a-zA-Z_:][a-zA-Z0-9_:]{0,127}$"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobService:
    """An inference job's service: one endpoint, replicas behind it, an SLO (docs/priorities.md,
    "Inference autoscaling"). Null bounds take the ``autoscale_*`` settings."""

    port: int = field(minimum=1024, maximum=65535 - MAX_REPLICAS,
                      doc="the service's one endpoint, 127.0.0.1:port on its host (the actuator's balancer); "
                          "replica k gets PORT=port+k")
    metrics_path: str = field(default="/metrics", pattern=r"^/[A-Za-z0-9_./-]{0,200}$",
                              doc="each replica's Prometheus endpoint (text exposition format)")
    latency_metric: str | None = field(default=None, pattern=METRIC_NAME_PATTERN,
                                       doc="the request latency histogram (seconds; null: autoscale_latency_metric)")
    min_replicas: int | None = field(default=None, minimum=1, maximum=MAX_REPLICAS)
    max_replicas: int | None = field(default=None, minimum=1, maximum=MAX_REPLICAS)
    slo_p99_ms: float | None = field(default=None, minimum=0.001, maximum=3.6e6,
                                     doc="p99 request latency the service must keep (null: autoscale_slo_p99_ms)")
    deployment: str | None = field(default=None, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/"
                                                         r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
                                   doc="Kubernetes: the NAMESPACE/NAME Deployment whose scale subresource the "
                                       "replicas are (null: local replicas)")
    metrics_url: str | None = field(default=None, pattern=r"^https?://[^\s]{1,500}$",
                                    doc="a Prometheus endpoint for the whole service, scraped instead of each "
                                        "replica's (e.g. on Kubernetes)")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """What a submitted job runs: its model, data, batch, precision and requests."""

    model: str = field(max_length=MAX_MODEL_NAME,
                       doc="catalog name (e.g. resnet50) or module:function returning an nn.Module")
    dataset: str = field(max_length=MAX_DATASET_NAME, doc="catalog dataset name (e.g. cifar10); gives the input shape")
    batch_size: int = field(minimum=1, maximum=MAX_BATCH)
    amp: bool = field(default=False, doc="automatic mixed precision")
    requests: JobRequests = field(default=JobRequests())
    targets: JobTargets | None = field(default=None)
    command: tuple[str, ...] = field(default=(), max_items=MAX_COMMAND_ARGS, max_bytes=MAX_COMMAND_BYTES,
                                     doc="argv that starts the job locally")
    node_selector: dict[str, str] = field(default={}, max_items=MAX_SELECTOR_ENTRIES, key_max_length=MAX_SELECTOR_KEY,
                                          max_length=MAX_SELECTOR_VALUE,
                                          doc="node labels the job needs, e.g. a GPU model (a value may list "
                                              "alternatives: a|b)")
    expected_s: float | None = field(default=None, minimum=0, maximum=86400 * 365,
                                     doc="seconds the job expects to run once started; null = unknown (long)")
    service: JobService | None = field(default=None, doc="inference: the service its replicas make up")
    pod: str | None = field(default=None, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/"
                                                  r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
                            doc="Kubernetes: the NAMESPACE/NAME pod that runs the job, left pending for phasewise "
                                "(its schedulerName not the default scheduler's, its phasewise.io/job the job id); "
                                "its place decision binds it to the node")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """A job's life (key: job): submitted (with its spec), where it started, how it ended, progress, a new priority.

    The states and who writes each are in docs/jobs.md ("Lifecycle"): ``submitted``
    by the submitter; ``started``, ``rejected``, ``frozen``, ``thawed``,
    ``finished``, ``failed`` and ``terminated`` by the actuator that applied the
    place, freeze, thaw or terminate decision; ``lost`` by the agent that released
    a booking no actuator reported on; ``admitted`` and ``stopped`` are the
    priority agent's hints to the placement agent (``priority_launcher=place``;
    ``stopped`` with either launcher: the targets agent reads it too).
    ``finished``, ``failed``, ``rejected`` and ``lost`` end a job; ``terminated``
    ends it unless the priority agent resumes it. A consumer ignores the kinds it
    does not act on.
    """

    VERSION: ClassVar[int] = 1
    #: the largest message :func:`decode` takes for this record (the others: :data:`MAX_MESSAGE_BYTES`)
    MAX_BYTES: ClassVar[int] = MAX_JOB_EVENT_BYTES
    job: str = field(pattern=JOB_ID_PATTERN, doc="job id (the characters of a container name)")
    ts: float = field(minimum=0)
    kind: str = field(enum=JOB_EVENT_KINDS,
                      doc="started: the actuator started it (host, container, pid, cgroup, cpuset, devices); "
                          "rejected: the actuator refused its place decision (reason); frozen, thawed: a freeze "
                          "or thaw decision was applied to it; finished: its process exited 0 on its own; "
                          "failed: it exited non-zero, by a signal or OOM-killed without being asked to "
                          "(exit_code, signal, oom, reason); terminated: a terminate decision ended it; lost: "
                          "no actuator reported it within job_start_timeout_s of its placement and its booking "
                          "was released (reason); "
                          "priority: the job's priority is now `priority` (its class stays the submitted one); "
                          "admitted: the priority agent let the job start (or resume, `resume`) on `host` now, "
                          "for the placement agent to place there; stopped: the priority agent stopped the job "
                          "by checkpoint-and-exit (what it booked is free; a frozen job is not stopped); waiting: the "
                          "placement agent found no node for it (reason; sent when the reason changes); scaled: "
                          "an inference service's replicas running now (replicas), after a scale decision or a "
                          "replica's own end, and the most its actuator runs (max_replicas); host: where they run "
                          "(the first replica's host), none where Kubernetes' scheduler places a Deployment's pods")
    host: str | None = field(default=None, max_length=MAX_HOST_NAME,
                             doc="where it runs (kind started), where it was admitted (kind admitted)")
    container: str | None = field(default=None, max_length=MAX_CONTAINER_NAME,
                                  doc="its container (kinds started, admitted)")
    pid: int | None = field(default=None, minimum=1, maximum=2**31 - 1,
                            doc="kind started: the process the actuator started (on `host`)")
    cgroup: str | None = field(default=None, max_length=MAX_CONTAINER_NAME,
                               doc="kind started: the job's cgroup on `host` (a path below the cgroup mount)")
    cpuset: str | None = field(default=None, max_length=MAX_CPUSET,
                               doc="kind started: the CPUs it may run on, in cpuset list form (e.g. 0-3,8)")
    devices: tuple[str, ...] = field(default=(), max_items=MAX_DEVICES, max_length=MAX_DEVICE_NAME,
                                     doc="kind started: the GPUs it was given (indices or UUIDs)")
    exit_code: int | None = field(default=None, minimum=0, maximum=255,
                                  doc="finished, failed, terminated: the process's exit status when it exited")
    signal: str | None = field(default=None, pattern=r"^SIG[A-Z0-9+-]{1,12}$",
                               doc="failed, terminated: the signal that ended it (e.g. SIGKILL)")
    oom: bool = field(default=False, doc="failed: the kernel's OOM killer ended it in its memory limit")
    run_s: float | None = field(default=None, minimum=0,
                                doc="finished, failed, terminated: seconds from its start to its end")
    reason: str | None = field(default=None, max_length=MAX_REASON,
                               doc="rejected, failed, lost, terminated: why, in words; waiting: why no node takes it")
    workload: str = field(default="training", enum=("training", "inference", "interactive"))
    priority: int = field(default=0, doc="higher is more important")
    spec: JobSpec | None = field(default=None, doc="kind submitted only")
    step: int | None = field(default=None, minimum=0)
    loss: float | None = field(default=None)
    metric: float | None = field(default=None)
    metric_name: str | None = field(default=None, max_length=MAX_METRIC_NAME)
    epoch: float | None = field(default=None, minimum=0)
    stage: str | None = field(default=None, pattern=STAGE_PATTERN,
                              doc="kind progress: the stage of its run the job says it is in (load, train, eval, "
                                  "checkpoint, done, or its own word), from `phasewise progress --stages`; null: "
                                  "not said (a training step's report)")
    replicas: int | None = field(default=None, minimum=0, maximum=MAX_REPLICAS,
                                 doc="kind scaled: the service's replicas running now (the first one included)")
    max_replicas: int | None = field(default=None, minimum=0, maximum=MAX_REPLICAS,
                                     doc="kind scaled: the most replicas of this service its actuator runs "
                                         "(the lower of its spec's service.max_replicas and actuator_max_replicas)")
    resume: bool = field(default=False, doc="kind admitted: the job restarts from its checkpoint (it was stopped)")
    signature: str | None = field(default=None, pattern=r"^[a-z0-9]{1,16}:[0-9a-f]{8}:[A-Za-z0-9+/=]{1,200}$",
                                  doc="kind submitted: the submitter's signature, ed25519:<key id>:<base64>, over "
                                      "job, ts, workload, priority and the spec's digest (phasewise.kit.job_signing); "
                                      "an unsigned job is placed and predicted but never started by an actuator")
    v: int = field(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobControl:
    """An instruction to a running job, delivered by its progress reporter (key: job).

    ``checkpoint_exit``: save a checkpoint and exit within ``grace_s`` seconds (after it,
    the sender may stop the job hard); ``pause``: stop stepping until ``resume``.
    A job's reporter runs each ``id`` at most once.
    """

    VERSION: ClassVar[int] = 1
    id: str = field(doc="idempotency key: a reporter delivers each id at most once")
    job: str = field(pattern=JOB_ID_PATTERN, doc="job id (the key; the characters of a container name)")
    ts: float = field(minimum=0)
    action: str = field(enum=("checkpoint_exit", "pause", "resume"))
    policy: str = field(default="", doc="who sent it, e.g. targets, priorities")
    reason: str = field(default="", doc="why, naming the rule or target behind it")
    grace_s: float | None = field(default=None, minimum=0, maximum=86400,
                                  doc="checkpoint_exit: seconds the job has before a hard stop")
    v: int = field(default=1)


def closest_name(name: str, names: list[str] | tuple[str, ...] | frozenset[str] | set[str]) -> str | None:
    """The name of *names* closest to *name* (a typo's, or one that names the same thing), or ``None``.

    >>> closest_name("cpu", ("cpu_cores", "mem_bytes", "gpus", "gpu_mem_bytes"))
    'cpu_cores'
    >>> closest_name("memory", ("cpu_cores", "mem_bytes", "gpus", "gpu_mem_bytes"))
    'mem_bytes'
    >>> closest_name("zzz", ("cpu_cores", "gpus")) is None
    True
    """
    import difflib

    pool = sorted(names)
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    if close:
        return close[0]
    # a prefix or an abbreviation of one name only ("cpu" -> cpu_cores, "mem" -> mem_bytes)
    low = name.lower()
    hits = [n for n in pool if n.startswith(low) or low.startswith(n.split("_")[0])]
    if len(hits) == 1:
        return hits[0]
    hits = [n for n in pool if difflib.SequenceMatcher(None, low, n).ratio() >= 0.4]
    return hits[0] if len(hits) == 1 else None


def unknown_field(data: dict, cls: type, where: str) -> str | None:
    """Why *data* (the JSON object of a *cls* record at *where*) is refused for a key *cls* does not have,
    naming the closest valid name; ``None`` when every key is known. The codec skips unknown keys (a newer
    writer's fields); a person's job file must not lose a request to a typo.

    >>> print(unknown_field({"cpu": 2}, JobRequests, "spec.requests"))  # doctest: +NORMALIZE_WHITESPACE
    spec.requests: unknown field 'cpu' (did you mean 'cpu_cores'? requests has cpu_cores, gpu_mem_bytes,
    gpus, mem_bytes)
    """
    names = tuple(sorted(cls.__dataclass_fields__))  # type: ignore[attr-defined]
    extra = sorted(k for k in data if k not in names)
    if not extra:
        return None
    k = extra[0]
    near = closest_name(str(k), names)
    hint = f"did you mean {near!r}? " if near else ""
    return f"{where}: unknown field {k!r} ({hint}{where.rpartition('.')[2]} has {', '.join(names)})"


def targets_problem(t: JobTargets | None) -> str | None:
    """Why a job's two-tier target is in the wrong order for its metric's direction (``min``: the objective is
    at or below acceptable; ``max``: at or above), or ``None``.

    >>> print(targets_problem(JobTargets(direction="min", acceptable=0.5, objective=1.0)))
    ... # doctest: +NORMALIZE_WHITESPACE
    targets: objective 1 is above acceptable 0.5, but direction min needs objective <= acceptable
    (swap them, or set direction max)
    >>> targets_problem(JobTargets(direction="max", metric="accuracy", acceptable=0.8, objective=0.9)) is None
    True
    """
    if t is None or t.acceptable is None or t.objective is None:
        return None
    a, o = t.acceptable, t.objective
    if t.direction == "min" and o > a:
        return (f"targets: objective {o:g} is above acceptable {a:g}, but direction min needs objective <= "
                f"acceptable (swap them, or set direction max)")
    if t.direction == "max" and o < a:
        return (f"targets: objective {o:g} is below acceptable {a:g}, but direction max needs objective >= "
                f"acceptable (swap them, or set direction min)")
    return None
