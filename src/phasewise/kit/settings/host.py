"""The host's settings: where the cgroups are, the host agent's sampling, the per-workload policy.

Read by the host agent and the actuator (docs/configuration.md; docs/kubernetes.md for layouts and modes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.records import LAYOUTS
from phasewise.kit.settings.spec import Group, above, at_least, non_empty, setting
from phasewise.models.safety.workload import DEFAULT_MODES

__all__ = ["CGROUP_LAYOUTS", "CgroupSettings", "ProducerSettings", "WorkloadSettings", "relative_cgroup_path"]

#: the cgroup layouts (:data:`phasewise.kit.records.LAYOUTS`) and ``auto`` (every layout present)
CGROUP_LAYOUTS = ("auto", *LAYOUTS)


def relative_cgroup_path(v: str) -> None:
    """A managed prefix is a relative path inside the cgroup tree (never ``..``)."""
    if not v or v.startswith("/") or ".." in v.split("/"):
        raise ValueError(f"must be a relative path inside the cgroup tree without '..', got {v!r}")


def _relative_or_empty(v: str) -> None:
    if v:
        relative_cgroup_path(v)


@dataclass(frozen=True, slots=True)
class CgroupSettings(Group):
    """Where the managed containers' cgroups are (the host agent and the actuator)."""

    PREFIX: ClassVar[str] = "cgroup_"

    root: str = setting("/sys/fs/cgroup", check=non_empty, flag="--cgroup-root",
                        help="cgroup mount: a v2 mount or a directory of v1 hierarchies")
    prefix: str = setting("phasewise", check=relative_cgroup_path, flag="--cgroup-prefix",
                          help="managed containers are the cgroups directly under "
                               "<root>/[<controller>/]<prefix>/")
    layout: str = setting("auto", choices=CGROUP_LAYOUTS, flag="--cgroup-layout",
                          help="where containers are: flat (under the prefix), docker-cgroupfs, docker-systemd, "
                               "kubepods-cgroupfs, kubepods-systemd, or auto (every layout present)")
    parent: str = setting("", check=_relative_or_empty, flag="--cgroup-parent",
                          help="where the runtimes' cgroup trees start in each hierarchy (the kubelet's "
                               "--cgroup-root, Docker's --cgroup-parent); empty = the hierarchy's root")


@dataclass(frozen=True, slots=True)
class ProducerSettings(Group):
    """The host agent (``phasewise produce``)."""

    interval_s: float = setting(1.0, check=above(0), flag="--interval",
                                help="seconds between samples")
    buffer_max_messages: int = setting(10_000, check=at_least(1),
                                       help="messages kept while the broker is away "
                                            "(the oldest dropped beyond)")
    #: seconds the host agent spends flushing buffered samples at shutdown
    flush_timeout_s: float = setting(5.0, check=at_least(0), flag="--flush-timeout",
                                     help="seconds to flush buffered samples at shutdown")
    #: where the host agent reads /proc/<pid>/cgroup to attribute GPU processes
    proc_root: str = setting("/proc", check=non_empty,
                             help="proc mount, to map GPU processes to containers")


@dataclass(frozen=True, slots=True)
class WorkloadSettings(Group):
    """Per-workload policy on this host (the host agent and the actuator): default mode, pods, policy file."""

    PREFIX: ClassVar[str] = "workload_"

    default_mode: str = setting("auto", choices=DEFAULT_MODES, flag="--default-mode",
                                help="mode of a workload without settings of its own: auto = apply in the flat "
                                     "prefix, off for Docker and Kubernetes containers (opt-in)")
    policy_file: str = setting("", flag="--policy-file",
                               help="rules matched by container name glob (JSON; YAML with PyYAML); "
                                    "empty = none")
    pods: str = setting("", flag="--kubelet-pods",
                        help="this node's pods: an http(s) URL answering a PodList (the kubelet's /pods, or "
                             "the API server's /api/v1/pods?fieldSelector=spec.nodeName=NODE) or a file; "
                             "empty = not on Kubernetes")
    pods_token_file: str = setting("", help="bearer token sent with an https pod-list request "
                                            "(e.g. the service account's token file); empty = none")
    pods_ca_file: str = setting("", help="CA certificate of the https pod-list server (e.g. the service "
                                         "account's ca.crt); empty = the system's CAs")
    pods_refresh_s: float = setting(10.0, check=above(0), help="seconds between reads of the pod list")
    docker_dir: str = setting("/var/lib/docker/containers",
                              help="Docker's per-container records (<id>/config.v2.json: name, labels); "
                                   "empty = do not read")
