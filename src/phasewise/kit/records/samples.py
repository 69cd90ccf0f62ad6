"""What the host agent publishes: one :class:`HostSamples` per host per tick, its containers' usage.

With who each container is and the per-workload policy the host agent resolved for it
(docs/kubernetes.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records.codec import MAX_BYTES, MAX_CORES, MAX_PCT, field
from phasewise.kit.records.jobs import JOB_ID_PATTERN

__all__ = ["LAYOUTS", "MODES", "UPDATE_MODES", "WORKLOAD_POLICIES", "ContainerIdentity", "ContainerSample",
           "ExecutionProfile", "GpuSample", "HostSamples", "WorkloadPolicy"]

#: where a container's cgroup was found (:mod:`phasewise.kit.cgroups.layouts`)
LAYOUTS = ("flat", "docker-cgroupfs", "docker-systemd", "kubepods-cgroupfs", "kubepods-systemd")
#: what phasewise may do to a workload: nothing, decide and publish only, or decide and write
MODES = ("off", "recommend", "apply")
#: the limit policies a workload may ask for
WORKLOAD_POLICIES = ("vpa", "phase")
#: how a resize is carried out on Kubernetes: in place only, or in place with eviction as the fallback
#: (VPA's InPlaceOrRecreate)
UPDATE_MODES = ("in-place", "in-place-or-recreate")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerIdentity:
    """Who a container is: where its cgroup was found and, where known, its pod and name."""

    layout: str = field(enum=LAYOUTS, doc="the cgroup layout it was found in")
    container_id: str | None = field(default=None, doc="the runtime's container id (flat: the cgroup name)")
    pod_uid: str | None = field(default=None, doc="Kubernetes pod UID")
    pod_namespace: str | None = field(default=None)
    pod_name: str | None = field(default=None)
    container_name: str | None = field(default=None, doc="the container's name in its pod (or Docker's name)")
    runtime: str | None = field(default=None, enum=("containerd", "cri-o", "docker"))
    qos: str | None = field(default=None, enum=("guaranteed", "burstable", "besteffort"),
                            doc="Kubernetes QoS class of the pod")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadPolicy:
    """The per-workload policy the host agent resolved for a container (annotations, policy file, default)."""

    mode: str = field(enum=MODES, doc="off: ignored; recommend: decided, never written; apply: decided and written")
    source: str = field(default="default", enum=("annotation", "policy-file", "default"),
                        doc="where the mode came from")
    policy: str | None = field(default=None, enum=WORKLOAD_POLICIES,
                               doc="limit policy asked for (vpa, phase); null = the worker's")
    cpu_min_cores: float | None = field(default=None, minimum=0, maximum=MAX_CORES)
    cpu_max_cores: float | None = field(default=None, minimum=0, maximum=MAX_CORES)
    mem_min_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)
    mem_max_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)
    priority: int | None = field(default=None, doc="higher is more important")
    workload_class: str | None = field(default=None, doc="training | inference | interactive, or the operator's own")
    update_mode: str | None = field(default=None, enum=UPDATE_MODES,
                                    doc="Kubernetes: in-place (null: the default) or in-place-or-recreate (evict when "
                                        "a resize is infeasible or stays pending)")
    error: str | None = field(default=None, doc="why the workload's policy was refused (mode is then off)")
    job: str | None = field(default=None, pattern=JOB_ID_PATTERN,
                            doc="the job this container belongs to (phasewise.io/job): an actuator freezes, "
                                "weights or terminates it for that job's decisions")
    signature: str | None = field(default=None, pattern=JOB_ID_PATTERN,
                                  doc="what makes runs of this workload the same job (phasewise.io/signature): "
                                      "a new run starts from the limits its earlier runs needed")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerSample:
    """One container's usage over the producer's last interval."""

    VERSION: ClassVar[int] = 1
    container: str = field(doc="container id: cgroup path relative to the managed root")
    cpu_cores: float = field(minimum=0, maximum=MAX_CORES, doc="CPU cores used (mean over interval)")
    mem_bytes: float = field(minimum=0, maximum=MAX_BYTES, doc="memory working set, bytes")
    cpu_limit_cores: float | None = field(
        default=None, minimum=0, maximum=MAX_CORES, doc="current CPU limit; null = unlimited"
    )
    mem_limit_bytes: float | None = field(
        default=None, minimum=0, maximum=MAX_BYTES, doc="current memory limit; null = unlimited"
    )
    throttled_periods: int = field(default=0, minimum=0, doc="CFS periods throttled (delta)")
    nr_periods: int = field(default=0, minimum=0, doc="CFS periods elapsed (delta)")
    throttled_s: float = field(default=0.0, minimum=0, doc="time throttled, seconds (delta)")
    oom_events: int = field(default=0, minimum=0, doc="OOM kills (delta)")
    gpu_util: float | None = field(
        default=None, minimum=0, maximum=MAX_PCT * 64, doc="GPU SM utilisation, percent summed over GPUs"
    )
    gpu_mem_bytes: float | None = field(
        default=None, minimum=0, maximum=MAX_BYTES, doc="GPU memory used by its processes, bytes"
    )
    identity: ContainerIdentity | None = field(default=None, doc="who the container is; null = unknown")
    workload: WorkloadPolicy | None = field(default=None, doc="its per-workload policy; null = not resolved")


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSample:
    """One GPU of a host."""

    VERSION: ClassVar[int] = 1
    index: int = field(minimum=0)
    uuid: str = field()
    util: float = field(minimum=0, maximum=MAX_PCT, doc="SM utilisation, percent")
    mem_used_bytes: float = field(minimum=0, maximum=MAX_BYTES)
    mem_total_bytes: float = field(minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSamples:
    """One message per host per tick holding all its containers (key: host)."""

    VERSION: ClassVar[int] = 1
    host: str = field()
    ts: float = field(minimum=0, doc="event time of the end of the interval, Unix seconds")
    interval_s: float = field(minimum=0, maximum=86400)
    containers: tuple[ContainerSample, ...] = field(default=())
    gpus: tuple[GpuSample, ...] = field(default=())
    host_cpu_cores: float | None = field(default=None, minimum=0, maximum=MAX_CORES)
    host_cpu_count: int | None = field(default=None, minimum=0)
    host_mem_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)
    host_mem_total_bytes: float | None = field(default=None, minimum=0, maximum=MAX_BYTES)
    v: int = field(default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionProfile:
    """What one run of a signed workload used so far (key: ``host/container``; a compacted topic keeps the
    newest per run). Workers publish it for containers whose workload has a ``signature`` and read every
    one back: the runs of a signature are the prior of its next run (docs/priors.md)."""

    VERSION: ClassVar[int] = 1
    signature: str = field(pattern=JOB_ID_PATTERN, doc="the workload's signature (phasewise.io/signature)")
    host: str = field()
    container: str = field(doc="container id on the host")
    ts: float = field(minimum=0, doc="event time of the newest sample counted")
    start: float = field(minimum=0, doc="event time of the run's first sample the worker saw")
    samples: int = field(minimum=1, doc="samples counted")
    cpu_peak_cores: float = field(minimum=0, maximum=MAX_CORES, doc="the highest CPU use of one sample")
    mem_peak_bytes: float = field(minimum=0, maximum=MAX_BYTES, doc="the highest working set of one sample")
    v: int = field(default=1)
