"""Every layout on REAL cgroup v1 trees: discovery, identity, `produce --once --json`, per-workload actuation.

The test makes Kubernetes-, Docker- and flat-shaped cgroups (both drivers)
under a unique parent in the host's cpu, cpuacct, memory and freezer
hierarchies, moves a real ``sleep`` into each, samples them through the real
CLI, writes limits through the actuator and removes everything again.
The kubelet's pod list is tests/data/kubelet_pods.json (the JSON of ``GET /pods``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import CgroupBackend
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.cgroups.workloads import Workloads, read_pods
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from phasewise.models.safety.workload import parse_policy_file
from tests.actuators.conftest import Recorder
from tests.conftest import requires_root

pytestmark = requires_root

PODS = Path(__file__).resolve().parents[1] / "data" / "kubelet_pods.json"
C = {k: k * 64 for k in "12345"}  # the container ids the pod list names
SANDBOX = "e" * 64
D1, D2 = "d1" * 32, "d2" * 32  # plain Docker containers
UID_TRAIN = "0d5a4c52-1f37-4a8e-b8a5-7c7f1f3a9d01"
UID_SERVE = "6c0b7e9a-3d2f-4e8b-a1c4-9f5e2d7b8a02"
UID_WEB = "9e8d7c6b-5a49-4382-b716-a5f4e3d2c103"
UID_BAD = "2f4e6a8c-1b3d-4f5a-9c7e-0d2b4f6a8c04"


def _slice(qos: str | None, uid: str) -> str:
    u = uid.replace("-", "_")
    if qos is None:
        return f"kubepods.slice/kubepods-pod{u}.slice"
    return f"kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{u}.slice"


def tree_paths(driver: str) -> dict[str, str]:
    """container id (or a label) -> its cgroup relative to the parent, as the kubelet and Docker make them."""
    if driver == "systemd":
        train, serve, web, bad = (_slice("burstable", UID_TRAIN), _slice(None, UID_SERVE),
                                  _slice("besteffort", UID_WEB), _slice("burstable", UID_BAD))
        return {
            C["1"]: f"{train}/cri-containerd-{C['1']}.scope",
            C["2"]: f"{train}/cri-containerd-{C['2']}.scope",
            SANDBOX: f"{train}/cri-containerd-{SANDBOX}.scope",
            C["3"]: f"{serve}/cri-containerd-{C['3']}.scope",
            C["4"]: f"{web}/crio-{C['4']}.scope",
            "conmon": f"{web}/crio-conmon-{C['4']}.scope",  # CRI-O's monitor: not a container
            C["5"]: f"{bad}/cri-containerd-{C['5']}.scope",
            D2: f"system.slice/docker-{D2}.scope",
        }
    return {
        C["1"]: f"kubepods/burstable/pod{UID_TRAIN}/{C['1']}",
        C["2"]: f"kubepods/burstable/pod{UID_TRAIN}/{C['2']}",
        SANDBOX: f"kubepods/burstable/pod{UID_TRAIN}/{SANDBOX}",
        C["3"]: f"kubepods/pod{UID_SERVE}/{C['3']}",
        C["4"]: f"kubepods/besteffort/pod{UID_WEB}/{C['4']}",
        C["5"]: f"kubepods/burstable/pod{UID_BAD}/{C['5']}",
        D1: f"docker/{D1}",
    }


class RealTree:
    """Cgroups under a unique parent in every v1 hierarchy phasewise uses, each with a real process."""

    def __init__(self, tmp: Path) -> None:
        self.parent = f"pwl-{uuid.uuid4().hex[:8]}"
        self.prefix = f"{self.parent}/pw"
        self.probe = CgroupLayout("/sys/fs/cgroup", self.prefix, version=1)
        self.roots = [self.probe.controller_root(c) for c in self.probe.controllers()]
        self.procs: list[subprocess.Popen] = []
        self.dirs: list[Path] = []
        self.pause = tmp / "pause"  # a process whose comm is "pause", as a pod's sandbox runs
        shutil.copy("/bin/sleep", self.pause)

    def add(self, rel: str, *, pause: bool = False) -> int:
        for root in self.roots:
            parts = Path(rel).parts
            for i in range(1, len(parts) + 1):
                p = root.joinpath(*parts[:i])
                if not p.exists():
                    p.mkdir()
                    self.dirs.append(p)
        proc = subprocess.Popen([str(self.pause) if pause else "sleep", "600"])
        self.procs.append(proc)
        for root in self.roots:
            (root / rel / "cgroup.procs").write_text(str(proc.pid))
        return proc.pid

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        for d in sorted(self.dirs, key=lambda p: len(p.parts), reverse=True):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


@pytest.fixture(params=["cgroupfs", "systemd"])
def tree(request, tmp_path):
    t = RealTree(tmp_path)
    t.driver = request.param
    try:
        for cid, rel in tree_paths(request.param).items():
            t.add(f"{t.parent}/{rel}", pause=cid == SANDBOX)
        t.add(f"{t.prefix}/job-a")
        yield t
    finally:
        t.close()


def _policy_file(tmp_path: Path) -> Path:
    f = tmp_path / "policy.json"
    f.write_text(json.dumps({"workloads": [{"match": "d1*", "mode": "apply", "cpu-max": "2"},
                                           {"match": "d2*", "mode": "recommend"}]}))
    return f


def test_produce_once_json_lists_every_container_with_its_identity(tree, tmp_path):
    env = {**os.environ, "PHASEWISE_LOG_LEVEL": "warning"}
    out = subprocess.run(
        [sys.executable, "-m", "phasewise.cli", "produce", "--once", "--json", "--interval", "0.2",
         "--cgroup-root", "/sys/fs/cgroup", "--cgroup-prefix", tree.prefix, "--cgroup-parent", tree.parent,
         "--kubelet-pods", str(PODS), "--policy-file", str(_policy_file(tmp_path))],
        capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # one JSON object, nothing else on stdout
    assert list(doc) == ["containers"]
    got = {c["container"]: c for c in doc["containers"]}
    docker = D2 if tree.driver == "systemd" else D1
    assert set(got) == {C["1"], C["2"], C["3"], C["4"], C["5"], docker, "job-a"}  # no sandbox, no conmon
    kube = f"kubepods-{tree.driver}"
    i1 = got[C["1"]]["identity"]
    assert i1 == {"layout": kube, "container_id": C["1"], "pod_uid": UID_TRAIN, "pod_namespace": "ml",
                  "pod_name": "train-0", "container_name": "trainer", "runtime": "containerd", "qos": "burstable"}
    assert got[C["3"]]["identity"]["qos"] == "guaranteed"
    assert got[C["4"]]["identity"]["runtime"] == "cri-o" and got[C["4"]]["identity"]["qos"] == "besteffort"
    assert got[docker]["identity"]["layout"] == f"docker-{tree.driver}"
    assert got["job-a"]["identity"] == {"layout": "flat", "container_id": "job-a", "pod_uid": None,
                                        "pod_namespace": None, "pod_name": None, "container_name": None,
                                        "runtime": None, "qos": None}
    modes = {c: got[c]["workload"]["mode"] for c in got}
    assert modes == {C["1"]: "apply", C["2"]: "recommend", C["3"]: "recommend", C["4"]: "off", C["5"]: "off",
                     docker: "apply" if docker == D1 else "recommend", "job-a": "apply"}
    w1 = got[C["1"]]["workload"]
    assert (w1["cpu_max_cores"], w1["mem_min_bytes"], w1["priority"], w1["workload_class"]) == (
        1.5, 128 * 2**20, 10, "training")
    assert "'Apply' is not one of" in got[C["5"]]["workload"]["error"]
    assert got[C["4"]]["workload"]["source"] == "default"
    assert "skipped (mode off): bad per-workload setting" in out.stderr  # the refused pod is logged


def test_each_layout_setting_finds_only_its_own_containers(tree):
    expect = {"kubepods-" + tree.driver: {C[k] for k in "12345"} | {SANDBOX},
              "docker-" + tree.driver: {D2 if tree.driver == "systemd" else D1},
              "flat": {"job-a"}}
    other = "kubepods-cgroupfs" if tree.driver == "systemd" else "kubepods-systemd"
    expect[other] = set()
    for layout, ids in expect.items():
        lay = CgroupLayout("/sys/fs/cgroup", tree.prefix, layout=layout, parent=tree.parent)
        assert set(lay.containers()) == ids, layout


def _decision(i: int, cid: str, **kw) -> bytes:
    return encode(Decision(id=f"d{i}", ts=time.time(), host="h1", container=cid, action="limit", policy="vpa", **kw))


def test_actuator_writes_only_apply_containers_through_the_discovered_paths(tree, tmp_path):
    layout = CgroupLayout("/sys/fs/cgroup", tree.prefix, layout="auto", parent=tree.parent)
    workloads = Workloads(layout, pods=lambda: read_pods(str(PODS)),
                          rules=parse_policy_file(json.loads(_policy_file(tmp_path).read_text())))
    settings = Settings().replace(host="h1", mem_margin_bytes=0, mem_floor_bytes=0)
    rec = Recorder()
    act = Actuator(settings, CgroupBackend(layout), Ledger(tmp_path / "ledger.db"), rec, host_cores=8,
                   metrics=ActuatorMetrics(CollectorRegistry()), workloads=workloads)
    docker = D2 if tree.driver == "systemd" else D1
    targets = [C["1"], C["3"], C["4"], C["5"], SANDBOX, docker, "job-a"]
    for i, cid in enumerate(targets):
        act.handle(_decision(i, cid, cpu_limit_cores=3.0, mem_limit_bytes=256 * 2**20), None, 0, i)
    by = {a.container: a for a in rec.actuations()}

    def quota(cid: str) -> int:
        return int((layout.path(cid, "cpu") / "cpu.cfs_quota_us").read_text())

    # apply: written, and bounded by the workload's cpu-max (1500m) from its annotation
    assert by[C["1"]].status == "clamped" and "the workload's cpu-max" in by[C["1"]].message
    assert quota(C["1"]) == 150_000
    assert int((layout.path(C["1"], "memory") / "memory.limit_in_bytes").read_text()) == 256 * 2**20
    assert quota("job-a") == 300_000 and by["job-a"].status == "applied"  # the flat prefix: apply by default
    if docker == D1:  # policy file: d1* apply, cpu-max 2
        assert quota(D1) == 200_000
    else:  # d2* recommend
        assert by[D2].status == "rejected" and quota(D2) == -1
    # recommend, unannotated (off), refused settings, sandbox: rejected with the reason, never written
    assert by[C["3"]].status == "rejected" and "recommend mode (from annotation)" in by[C["3"]].message
    assert "not opted in (mode off, from default)" in by[C["4"]].message
    assert "settings were refused" in by[C["5"]].message and "'Apply'" in by[C["5"]].message
    assert "sandbox" in by[SANDBOX].message
    for cid in (C["3"], C["4"], C["5"], SANDBOX):
        assert quota(cid) == -1, cid
        assert by[cid].status == "rejected"
