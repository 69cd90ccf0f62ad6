"""Who each container is on this host and its per-workload policy (:class:`Workloads`), for the host agent
and the actuator.

It joins the cgroup path, this node's pod list, Docker's records and the policy file to the containers
a :class:`~phasewise.kit.cgroups.fs.CgroupLayout` finds; the resolution itself is pure
(:mod:`phasewise.models.safety.workload`). docs/kubernetes.md ("Identity", "Per-workload policy").
"""

from __future__ import annotations

import json
import logging
import ssl
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.records import ContainerIdentity, WorkloadPolicy
from phasewise.models.safety.workload import (
    Rule,
    WorkloadError,
    match_rule,
    parse_policy_file,
    parse_settings,
    resolve,
)

__all__ = ["DockerInfo", "Pod", "PodList", "Workloads", "layout_from_settings", "load_policy_file",
           "parse_docker_config", "parse_pod_list", "read_docker", "read_pods", "workloads_from_settings"]

log = logging.getLogger(__name__)

_RUNTIME_SCHEMES = {"containerd": "containerd", "cri-o": "cri-o", "docker": "docker"}
_QOS = {"Guaranteed": "guaranteed", "Burstable": "burstable", "BestEffort": "besteffort"}


@dataclass(frozen=True, slots=True)
class Pod:
    uid: str
    namespace: str | None
    name: str | None
    annotations: dict
    qos: str | None
    #: container id -> (container name, runtime)
    containers: dict


@dataclass(frozen=True, slots=True)
class PodList:
    """The kubelet's pods, by UID, and the pod of each container id."""

    pods: dict = field(default_factory=dict)
    by_container: dict = field(default_factory=dict)


def parse_pod_list(data: Any) -> PodList:
    """A ``v1 PodList`` (what the kubelet's ``/pods`` returns) → :class:`PodList`; ValueError if not one.

    Container ids come from ``status.containerStatuses[].containerID``
    (``containerd://<id>``, ``cri-o://<id>``, ``docker://<id>``), init and
    ephemeral containers included. Pods or statuses missing fields are taken
    as far as they go; a document that is not a pod list is refused.
    """
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise ValueError("not a pod list: expected an object with an 'items' list")
    pods: dict[str, Pod] = {}
    by_container: dict[str, str] = {}
    for item in data["items"]:
        if not isinstance(item, dict):
            continue
        meta = item.get("metadata") if isinstance(item.get("metadata"), dict) else {}
        status = item.get("status") if isinstance(item.get("status"), dict) else {}
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid:
            continue
        ann = meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {}
        containers: dict[str, tuple[str | None, str | None]] = {}
        for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
            statuses = status.get(key)
            for cs in statuses if isinstance(statuses, list) else ():
                if not isinstance(cs, dict) or not isinstance(cs.get("containerID"), str):
                    continue
                scheme, sep, cid = cs["containerID"].partition("://")
                if not sep or not cid:
                    continue
                name = cs.get("name") if isinstance(cs.get("name"), str) else None
                containers[cid] = (name, _RUNTIME_SCHEMES.get(scheme))
                by_container[cid] = uid
        ns, name = meta.get("namespace"), meta.get("name")
        pods[uid] = Pod(uid=uid, namespace=ns if isinstance(ns, str) else None,
                        name=name if isinstance(name, str) else None,
                        annotations={k: v for k, v in ann.items() if isinstance(k, str)},
                        qos=_QOS.get(status.get("qosClass")), containers=containers)
    return PodList(pods, by_container)


@dataclass(frozen=True, slots=True)
class DockerInfo:
    name: str | None
    labels: dict


def parse_docker_config(data: Any) -> DockerInfo:
    """Docker's ``config.v2.json`` of a container → its name (without the leading ``/``) and labels."""
    if not isinstance(data, dict):
        raise ValueError("not a Docker container config: expected an object")
    name = data.get("Name")
    cfg = data.get("Config") if isinstance(data.get("Config"), dict) else {}
    labels = cfg.get("Labels") if isinstance(cfg.get("Labels"), dict) else {}
    return DockerInfo(name.lstrip("/") or None if isinstance(name, str) else None,
                      {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)})


def read_docker(docker_dir: str, container_id: str) -> DockerInfo | None:
    """What Docker records of *container_id* under *docker_dir*; ``None`` if it has no readable record."""
    try:
        raw = (Path(docker_dir) / container_id / "config.v2.json").read_bytes()
        return parse_docker_config(json.loads(raw))
    except (OSError, ValueError, RecursionError):
        return None


def read_pods(source: str, *, token_file: str = "", ca_file: str = "", timeout_s: float = 5.0) -> PodList:
    """Read and parse the pod list at *source*: an ``http(s)://`` URL or a file.

    The URL is the kubelet's ``/pods`` (read-only port) or the API server's
    ``/api/v1/pods?fieldSelector=spec.nodeName=<node>``: both answer a v1
    PodList. *token_file*: a bearer token sent with it (a service account's);
    *ca_file*: the CA that signed the server's certificate (else the system's).
    """
    if source.startswith(("http://", "https://")):
        req = urllib.request.Request(source, headers={"Accept": "application/json"})
        if token_file:
            req.add_header("Authorization", f"Bearer {Path(token_file).read_text().strip()}")
        ctx = ssl.create_default_context(cafile=ca_file) if ca_file and source.startswith("https://") else None
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:  # noqa: S310 - operator's URL
            raw = resp.read(64 * 2**20 + 1)
    else:
        raw = Path(source).read_bytes()
    if len(raw) > 64 * 2**20:
        raise ValueError("pod list larger than 64 MiB")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"pod list is not JSON: {e}") from None
    return parse_pod_list(data)


def load_policy_file(path: str) -> tuple[Rule, ...]:
    """The rules of the policy file at *path* (``.json``, or ``.yaml``/``.yml`` with PyYAML); WorkloadError."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise WorkloadError(f"policy file {path}: {e.strerror or e}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise WorkloadError(f"policy file {path}: YAML needs PyYAML (pip install pyyaml); "
                                "or write the same rules as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise WorkloadError(f"policy file {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise WorkloadError(f"policy file {path}: not valid JSON: {e}") from None
    try:
        return parse_policy_file(data)
    except WorkloadError as e:
        raise WorkloadError(f"{path}: {e}") from None


class Workloads:
    """Identity and policy of this host's containers (see the module doc).

    *pods*: a function returning the current :class:`PodList` (e.g.
    ``lambda: read_pods(url)``), ``None`` off Kubernetes; *rules*: the policy
    file's; *default_mode*: the host's (``auto``, ``off``, ``recommend``,
    ``apply``); *proc_root*: where ``<pid>/comm`` tells a pause process.
    """

    def __init__(self, layout: CgroupLayout, *, pods: Callable[[], PodList] | None = None,
                 rules: tuple[Rule, ...] = (), default_mode: str = "auto", refresh_s: float = 10.0,
                 proc_root: str = "/proc", docker_dir: str = "",
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        self.docker_dir = docker_dir
        self.rules = rules
        self.default_mode = default_mode
        self.refresh_s = refresh_s
        self.proc_root = Path(proc_root)
        self.monotonic = monotonic
        self._read_pods = pods
        self._pods = PodList()
        self._pods_at: float | None = None
        self._pods_failing = False
        #: workloads refused for a bad setting: container id -> the reason (the latest)
        self.refused: dict[str, str] = {}
        self.refused_total = 0
        self._logged: set[tuple[str, str]] = set()
        #: per container id: (monotonic time read, value) of what is read from files, kept refresh_s
        self._docker: dict[str, tuple[float, DockerInfo | None]] = {}
        self._pause: dict[str, bool] = {}  # settled answers only (a cgroup with processes)

    # ------------------------------------------------------------------ pods

    def _refresh(self, *, force: bool = False) -> None:
        if self._read_pods is None:
            return
        now = self.monotonic()
        min_gap = 2.0 if force else self.refresh_s  # an unknown container asks again, at most every 2 s
        if self._pods_at is not None and now - self._pods_at < min_gap:
            return
        self._pods_at = now
        try:
            self._pods = self._read_pods()
        except Exception as e:  # noqa: BLE001 - any failure to read the kubelet keeps the last list
            if not self._pods_failing:
                log.warning("cannot read the kubelet's pod list (%s: %s); using the last one read", type(e).__name__,
                            e)
            self._pods_failing = True
            return
        if self._pods_failing:
            log.info("kubelet pod list readable again (%d pods)", len(self._pods.pods))
        self._pods_failing = False

    def _pod_of(self, found_uid: str | None, cid: str) -> tuple[Pod | None, bool]:
        """(the pod of container *cid*, whether the kubelet lists *cid* among its containers)."""
        self._refresh()
        uid = self._pods.by_container.get(cid)
        if uid is None and self._read_pods is not None:
            self._refresh(force=True)
            uid = self._pods.by_container.get(cid)
        if uid is not None:
            return self._pods.pods.get(uid), True
        return (self._pods.pods.get(found_uid) if found_uid else None), False

    # ------------------------------------------------------------------ per container

    def is_pause(self, container: str) -> bool:
        """Whether every process of the container is a ``pause`` (a pod's sandbox)."""
        known = self._pause.get(container)
        if known is not None:
            return known
        answer = self._read_pause(container)
        if answer is not None:
            if len(self._pause) > 100_000:
                self._pause.clear()
            self._pause[container] = answer
        return bool(answer)

    def _read_pause(self, container: str) -> bool | None:
        """``is_pause`` read from the files; ``None`` while the cgroup has no process (not settled)."""
        try:
            procs = (self.layout.path(container, "memory" if self.layout.version == 1 else "cpu")
                     / "cgroup.procs").read_text().split()
        except (OSError, CgroupError):
            return False
        if not procs:
            return None
        for pid in procs[:16]:
            try:
                if (self.proc_root / pid / "comm").read_text().strip() != "pause":
                    return False
            except OSError:
                return None
        return True

    def _docker_of(self, container: str) -> DockerInfo | None:
        now = self.monotonic()
        hit = self._docker.get(container)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        if len(self._docker) > 100_000:
            self._docker.clear()
        info = read_docker(self.docker_dir, container)
        self._docker[container] = (now, info)
        return info

    def describe(self, container: str) -> tuple[ContainerIdentity, WorkloadPolicy] | None:
        """The container's identity and policy; ``None`` for a pod's sandbox (not a workload)."""
        ident = self.layout.identity(container)
        pod = None
        docker = None
        if self.docker_dir and ident.runtime in ("docker", None) and ident.layout != "flat":
            docker = self._docker_of(container)
            if docker is not None:
                if docker.labels.get("io.kubernetes.docker.type") == "podsandbox":
                    return None
                lab = docker.labels
                ident = ContainerIdentity(
                    layout=ident.layout, container_id=ident.container_id,
                    pod_uid=ident.pod_uid or lab.get("io.kubernetes.pod.uid"),
                    pod_namespace=lab.get("io.kubernetes.pod.namespace"), pod_name=lab.get("io.kubernetes.pod.name"),
                    container_name=lab.get("io.kubernetes.container.name") or docker.name, runtime="docker",
                    qos=ident.qos)
        if ident.layout.startswith("kubepods"):
            pod, listed = self._pod_of(ident.pod_uid, container)
            if self.is_pause(container) or (pod is not None and not listed and pod.containers):
                return None
        name = ident.container_name
        own = None
        if pod is not None:
            cname, runtime = pod.containers.get(container, (ident.container_name, None))
            name = cname
            ident = ContainerIdentity(layout=ident.layout, container_id=ident.container_id, pod_uid=pod.uid,
                                      pod_namespace=pod.namespace, pod_name=pod.name, container_name=cname,
                                      runtime=runtime or ident.runtime, qos=ident.qos or pod.qos)
            own = parse_settings(pod.annotations, container=cname)
        elif ident.layout == "flat":
            name = container
        if own is None and self.rules:
            names = [name, container]
            if pod is not None and pod.name is not None:
                names.append(f"{pod.namespace}/{pod.name}/{name}" if name else f"{pod.namespace}/{pod.name}")
            own = match_rule(self.rules, names)
        policy = resolve(own, ident.layout, self.default_mode)
        if policy.error is not None:
            self._refuse(container, ident, policy.error)
        else:
            self.refused.pop(container, None)
        return ident, policy

    def _refuse(self, container: str, ident: ContainerIdentity, why: str) -> None:
        if self.refused.get(container) != why:
            self.refused_total += 1
        self.refused[container] = why
        if (container, why) not in self._logged:
            self._logged.add((container, why))
            who = (f"pod {ident.pod_namespace}/{ident.pod_name} container {ident.container_name or container[:12]}"
                   if ident.pod_name else f"container {container}")
            log.warning("%s skipped (mode off): bad per-workload setting: %s", who, why)


def layout_from_settings(settings: Any) -> CgroupLayout:
    """The cgroup layout the settings describe; :class:`CgroupError` if the root or a value is unusable."""
    c = settings.cgroup
    return CgroupLayout(c.root, c.prefix, layout=c.layout, parent=c.parent)


def workloads_from_settings(settings: Any, layout: CgroupLayout) -> Workloads:
    """This host's :class:`Workloads`; :class:`WorkloadError` for an unusable policy file."""
    w = settings.workload
    rules = load_policy_file(w.policy_file) if w.policy_file else ()
    pods = None
    if w.pods:
        src, token, ca = w.pods, w.pods_token_file, w.pods_ca_file

        def pods() -> PodList:
            return read_pods(src, token_file=token, ca_file=ca)

    return Workloads(layout, pods=pods, rules=rules, default_mode=w.default_mode, refresh_s=w.pods_refresh_s,
                     proc_root=settings.producer.proc_root, docker_dir=w.docker_dir)
