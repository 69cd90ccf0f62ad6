"""The job systems' settings: Horus predictions, placement, priorities (DynamoML), loss targets (TRADL).

docs/configuration.md lists them; docs/horus.md, docs/placement.md, docs/priorities.md and
docs/targets.md describe each system.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.settings.spec import Group, SettingsError, above, at_least, in_range, non_empty, parse_size, setting

__all__ = ["AutoscaleSettings", "HorusSettings", "PlacementSettings", "PrioritySettings", "TargetsSettings"]

_LOCAL_NODE = re.compile(r"^[A-Za-z0-9_.-]+=\d+(-\d+)?(,\d+(-\d+)?)*(@\d+(,\d+)*)?$")


def local_nodes_spec(v: str) -> None:
    """``NAME=CPUS[@GPUS]`` separated by ``;`` (CPUS a cpuset list such as ``0-3,6``), or empty."""
    parts = [x.strip() for x in v.split(";") if x.strip()]
    for x in parts:
        if not _LOCAL_NODE.match(x):
            raise ValueError(f"{x!r} is not NAME=CPUS[@GPUS] (e.g. s0=0-1@0)")
    names = [x.split("=")[0] for x in parts]
    if len(set(names)) != len(names):
        raise ValueError("node names repeat")


def module_list(v: str) -> None:
    """Comma-separated dotted module names (``mypkg.models, other``), or empty."""
    for m in (x.strip() for x in v.split(",")):
        if m and not all(p.isidentifier() for p in m.split(".")):
            raise ValueError(f"{m!r} is not a module name (e.g. mypkg.models)")


@dataclass(frozen=True, slots=True)
class HorusSettings(Group):
    """``phasewise horus``: utilisation predicted from job graphs, learned from the jobs it watches."""

    PREFIX: ClassVar[str] = "horus_"

    coverage: float = setting(0.8, check=in_range(0, 1, lo_open=True, hi_open=True), flag="--coverage",
                              help="nominal probability that a prediction's [lo, hi] holds the observed value")
    warmup_s: float = setting(20.0, check=at_least(0), flag="--job-warmup",
                              help="seconds after a job starts left out of its observation (its loading phase)")
    observe_s: float = setting(60.0, check=at_least(0), flag="--observe",
                               help="steady seconds of a job's samples after which it is learned")
    min_samples: int = setting(5, check=at_least(1), help="steady samples a job needs to be learned")
    worker_id: str = setting("phasewise-horus", check=non_empty, flag="--horus-id",
                             help="Faust app id (consumer group and table names) of the horus worker")
    model_modules: str = setting("", check=module_list,
                                 help="modules (comma-separated; each with its submodules) whose module:function "
                                      "models horus imports, in a child process; empty = catalog models only")
    build_timeout_s: float = setting(60.0, check=above(0),
                                     help="seconds a module:function model's graph may take to build in its child "
                                          "process before it is stopped and the job refused")
    build_memory_bytes: int = setting(4 * 2**30, parse=parse_size, check=at_least(64 * 2**20),
                                      help="address space a module:function model's child process may take beyond "
                                           "the interpreter's own, bytes")
    share_model: bool = setting(True, flag="--share-model",
                                help="share the learned model with every horus worker: publish it on the models "
                                     "topic (key horus/utilisation, signed) and learn what the others published")


@dataclass(frozen=True, slots=True)
class PlacementSettings(Group):
    """``phasewise place``: the placement worker (jobs, predictions and samples in, place decisions out)."""

    PREFIX: ClassVar[str] = "place_"

    policy: str = setting("horus", choices=("horus", "first-fit", "best-fit", "fgd"), flag="--placement",
                          help="placement policy (docs/placement.md)")
    isolate_inference: bool = setting(False, help="never put inference and training jobs on one node")
    horus_frag_weight: float = setting(1.0, check=at_least(0), flag="--horus-frag-weight",
                                       help="horus: weight of FGD's fragmentation growth (GPUs) against Horus's "
                                            "over-capacity term (co-located utilisation above 100 %); 0 = Horus's "
                                            "cost alone (docs/placement.md)")
    prediction_wait_s: float = setting(10.0, check=at_least(0), flag="--prediction-wait",
                                       help="seconds a submitted job waits for its utilisation prediction "
                                            "before it is placed on its requests alone")
    max_waiting_jobs: int = setting(10_000, check=at_least(0),
                                    help="jobs waiting for room at most; beyond, the job of lowest rank (priority, "
                                         "then submission) is refused with a dead letter; 0 = no limit")
    after_admission: bool = setting(False, help="hold each submitted job until the priority agent's admitted "
                                                "hint (priority_launcher=place), then place it on that host "
                                                "only; free it on its stopped hint")
    local_nodes: str = setting("", check=local_nodes_spec, flag="--local-nodes",
                               help="local mode: nodes are cpuset slices of this host, NAME=CPUS[@GPUS] "
                                    "separated by ';' (e.g. 's0=0-1@0;s1=2-3'); empty: nodes are the sampled hosts")
    worker_id: str = setting("phasewise-place", check=non_empty, flag="--place-id",
                             help="Faust app id (consumer group and table names) of the placement worker")


@dataclass(frozen=True, slots=True)
class TargetsSettings(Group):
    """Loss targets (TRADL): the worker's targets agent on job events (:mod:`phasewise.models.jobs.targets`)."""

    PREFIX: ClassVar[str] = "targets_"

    #: on: the worker follows job events and emits the targets' decisions and controls
    enabled: bool = setting(False, flag="--targets", help="run the targets agent on job events")
    ewma_alpha: float = setting(0.3, check=in_range(0, 1, lo_open=True),
                                help="EWMA weight of the newest reported loss or metric")
    patience: int = setting(3, check=at_least(1), help="reports in a row past a target before it counts")
    grace_s: float = setting(30.0, check=at_least(0),
                             help="seconds between checkpoint_exit at objective and the hard stop")
    shrink: float = setting(0.25, check=in_range(0, 1, lo_open=True),
                            help="a held job's CPU limit = this x node cores / jobs on the node")
    node_cores: float = setting(8.0, check=above(0),
                                help="CPU cores of a node where its samples do not say (host_cpu_count)")
    #: tradl: a job past acceptable is held while another of its node is short of acceptable; nearest: the
    #: job estimated nearest its objective gets the node, the others are held
    policy: str = setting("tradl", choices=("tradl", "nearest"),
                          help="how a node is divided among its jobs short of their objective")
    #: the TRADL share rule: off (0) by default, because its limits add up to 1/2 to n/(n+1) of the node
    #: (it leaves CPU idle while it holds) and it swings on and off around alpha x capacity
    share_alpha: float = setting(0.0, check=in_range(0, 1),
                                 help="apply the TRADL share rule above this fraction of a node's cores "
                                      "(0 = off)")
    share_interval_s: float = setting(30.0, check=at_least(0),
                                      help="seconds of samples between two applications of the share rule "
                                           "to a node")


@dataclass(frozen=True, slots=True)
class PrioritySettings(Group):
    """The priority agent (``phasewise worker --priorities``): DynamoML preemption over the job events.

    :mod:`phasewise.models.jobs.priorities` decides; every host offers the same
    capacity to jobs.
    """

    PREFIX: ClassVar[str] = "priority_"

    agent: bool = setting(False, flag="--priorities",
                          help="run the priority agent on the job events (freeze / checkpoint-and-stop / resume)")
    host_cpu_cores: float = setting(0.0, check=at_least(0),
                                    help="CPU cores each host offers to jobs; 0 = this host's core count")
    host_mem_bytes: int = setting(0, parse=parse_size, check=at_least(0),
                                  help="memory each host offers to jobs; 0 = this host's memory")
    host_gpus: float = setting(0.0, check=at_least(0), help="GPUs each host offers to jobs")
    freeze_max_wait_s: float = setting(120.0, check=at_least(0),
                                       help="victims are frozen (not stopped) for expected waits up to this long")
    grace_s: float = setting(30.0, check=at_least(0),
                             help="seconds a checkpoint-and-exit gets before the hard stop")
    cpu_weights: bool = setting(True, help="send each job's CPU weight (from its priority and class) when it "
                                           "starts and when its priority changes")
    cpu_weight_ratio: float = setting(2.0, check=in_range(1, 100),
                                      help="CPU weight factor of one priority level (100 x ratio^(priority + "
                                           "class/3) in cpu.weight units)")
    #: self: the agent's own place decisions start and restart jobs (on the host's CPUs); place: it publishes
    #: admitted / stopped hints on the job events and the placement agent (--place-after-admission) places
    launcher: str = setting("self", choices=("self", "place"),
                            help="who starts an admitted job: self (the priority agent's place decision, the "
                                 "host's CPUs) or place (an admitted hint on the job events; phasewise place "
                                 "--place-after-admission chooses the CPUs and GPUs on that host)")


def metric_name(v: str) -> None:
    """A Prometheus metric name."""
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,127}", v):
        raise ValueError(f"{v!r} is not a Prometheus metric name")


@dataclass(frozen=True, slots=True)
class AutoscaleSettings(Group):
    """The autoscaler agent (``phasewise worker --autoscale``): inference replicas from each service's SLO.

    :mod:`phasewise.models.jobs.autoscaler` decides; a service's own ``service`` section (its job spec) may
    set its SLO and replica bounds, these are the defaults. docs/priorities.md, "Inference autoscaling".
    """

    PREFIX: ClassVar[str] = "autoscale_"

    enabled: bool = setting(False, flag="--autoscale",
                            help="run the autoscaler agent: scrape each inference service, publish scale decisions")
    interval_s: float = setting(5.0, check=above(0), help="seconds between two scrapes of a service")
    slo_p99_ms: float = setting(200.0, check=above(0), help="a service's p99 latency SLO where its spec names none")
    target_util: float = setting(0.6, check=in_range(0, 1, lo_open=True),
                                 help="CPU utilisation per replica (of its CPU request) the scaler aims at")
    tolerance: float = setting(0.1, check=in_range(0, 1),
                               help="relative distance from target_util within which utilisation changes nothing")
    down_latency_fraction: float = setting(0.5, check=in_range(0, 1),
                                           help="no scale-down while the p99 is above this fraction of the SLO")
    min_replicas: int = setting(1, check=at_least(1), help="replicas of a service at least, where its spec names none")
    max_replicas: int = setting(4, check=in_range(1, 64), help="replicas of a service at most, where its spec names "
                                                               "none")
    max_step: int = setting(2, check=at_least(1), help="replicas one decision adds or removes at most")
    up_step: int = setting(1, check=at_least(1), help="replicas a p99 over the SLO adds at least")
    up_cooldown_s: float = setting(15.0, check=at_least(0), help="seconds after a change before a scale-up")
    down_cooldown_s: float = setting(120.0, check=at_least(0), help="seconds after a change before a scale-down")
    scrape_timeout_s: float = setting(2.0, check=above(0), help="seconds a replica's metrics endpoint may take")
    latency_metric: str = setting("http_request_duration_seconds", check=metric_name,
                                  help="the request latency histogram (seconds) where a service's spec names none")
    cpu_metric: str = setting("process_cpu_seconds_total", check=metric_name,
                              help="the counter of CPU seconds each replica reports (prometheus_client's default)")

    def _rules(self) -> None:
        if self.min_replicas > self.max_replicas:
            raise SettingsError("autoscale_min_replicas", f"must be <= autoscale_max_replicas ({self.max_replicas}), "
                                f"got {self.min_replicas}")
