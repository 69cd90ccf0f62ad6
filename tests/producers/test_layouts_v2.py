"""Every layout on cgroup v2 fixture trees (the host's cgroup2 mount has no controllers to delegate).

The files are written as the kernel lays them out in the unified tree; the
sampler reads them through layout discovery and the backend writes limits
into the discovered containers' ``cpu.max`` and ``memory.max``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phasewise.actuators.backends import CgroupBackend
from phasewise.actuators.commands import SetLimits
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.cgroups.workloads import Workloads, read_pods
from phasewise.producers.sampler import HostSampler

PODS = Path(__file__).resolve().parents[1] / "data" / "kubelet_pods.json"
C1, C3, C4 = "1" * 64, "3" * 64, "4" * 64
SANDBOX, D = "e" * 64, "d0" * 32
UID_TRAIN = "0d5a4c52-1f37-4a8e-b8a5-7c7f1f3a9d01"
UID_SERVE = "6c0b7e9a-3d2f-4e8b-a1c4-9f5e2d7b8a02"
UID_WEB = "9e8d7c6b-5a49-4382-b716-a5f4e3d2c103"


def u(uid: str) -> str:
    return uid.replace("-", "_")


TREES = {
    "kubepods-systemd": {
        C1: f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u(UID_TRAIN)}.slice/"
            f"cri-containerd-{C1}.scope",
        SANDBOX: f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u(UID_TRAIN)}.slice/"
                 f"cri-containerd-{SANDBOX}.scope",
        C3: f"kubepods.slice/kubepods-pod{u(UID_SERVE)}.slice/cri-containerd-{C3}.scope",
        C4: f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u(UID_WEB)}.slice/crio-{C4}.scope",
    },
    "kubepods-cgroupfs": {
        C1: f"kubepods/burstable/pod{UID_TRAIN}/{C1}",
        SANDBOX: f"kubepods/burstable/pod{UID_TRAIN}/{SANDBOX}",
        C3: f"kubepods/pod{UID_SERVE}/{C3}",
        C4: f"kubepods/besteffort/pod{UID_WEB}/{C4}",
    },
    "docker-systemd": {D: f"system.slice/docker-{D}.scope"},
    "docker-cgroupfs": {D: f"docker/{D}"},
    "flat": {"job-a": "phasewise/job-a"},
}


def write_v2(d: Path, *, cpu_usec: int, mem: int, pid: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.stat").write_text(f"usage_usec {cpu_usec}\nuser_usec 1\nsystem_usec 1\n"
                                "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")
    (d / "memory.current").write_text(f"{mem}\n")
    (d / "memory.stat").write_text("anon 4096\nfile 0\ninactive_file 0\n")
    (d / "cpu.max").write_text("max 100000\n")
    (d / "memory.max").write_text("max\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    (d / "cgroup.procs").write_text(f"{pid}\n")


@pytest.fixture(params=list(TREES))
def v2(request, tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    proc = tmp_path / "proc"
    for pid, (cid, rel) in enumerate(TREES[request.param].items(), start=100):
        write_v2(root / "k8s" / rel if request.param != "flat" else root / rel, cpu_usec=0, mem=2**20, pid=pid)
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "comm").write_text("pause\n" if cid == SANDBOX else "python3\n")
    return request.param, root, proc


def test_each_v2_layout_is_sampled_with_identity_and_written_through_discovery(v2):
    name, root, proc = v2
    layout = CgroupLayout(root, layout=name, parent="k8s")
    assert layout.version == 2
    w = Workloads(layout, pods=lambda: read_pods(str(PODS)), proc_root=str(proc), default_mode="recommend")
    t = [0.0]
    sampler = HostSampler(layout, gpu=False, workloads=w, monotonic=lambda: t[0], host="h")
    sampler.sample()
    tree = TREES[name]
    for rel in tree.values():
        base = root / rel if name == "flat" else root / "k8s" / rel
        (base / "cpu.stat").write_text("usage_usec 500000\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")
    t[0] = 1.0
    got = {s.container: s for s in sampler.sample().containers}
    assert set(got) == set(tree) - {SANDBOX}
    for cid, s in got.items():
        assert s.identity.layout == name and s.identity.container_id == cid
        assert s.cpu_cores == pytest.approx(0.5)
    if name.startswith("kubepods"):
        assert (got[C1].identity.pod_name, got[C1].identity.container_name) == ("train-0", "trainer")
        assert got[C1].identity.qos == "burstable" and got[C3].identity.qos == "guaranteed"
        assert got[C4].identity.runtime == "cri-o"
        assert (got[C1].workload.mode, got[C3].workload.mode, got[C4].workload.mode) == ("apply", "recommend",
                                                                                      "recommend")
    target = next(iter(got))
    out = CgroupBackend(layout).apply(SetLimits(target, cpu_cores=1.25, mem_bytes=2**30))
    assert out.status == "applied", out.message
    assert (layout.path(target) / "cpu.max").read_text() == "125000 100000"
    assert (layout.path(target) / "memory.max").read_text() == str(2**30)
    assert layout.path(target).relative_to(root).as_posix().endswith(tree[target])


def test_a_container_that_vanishes_is_dropped_and_its_id_no_longer_resolves(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    rel = TREES["kubepods-systemd"][C3]
    write_v2(root / rel, cpu_usec=0, mem=1, pid=1)
    layout = CgroupLayout(root, layout="auto")
    assert layout.containers() == [C3] and layout.exists(C3)
    for f in (root / rel).iterdir():
        f.unlink()
    (root / rel).rmdir()
    assert layout.containers() == [] and not layout.exists(C3)
    assert CgroupBackend(layout).apply(SetLimits(C3, cpu_cores=1.0)).status == "failed"


def test_the_agent_exports_how_many_workloads_are_in_each_mode_and_refused():
    from prometheus_client import CollectorRegistry

    from phasewise.kit.records import ContainerSample, HostSamples, WorkloadPolicy
    from phasewise.kit.settings import Settings
    from phasewise.producers.host_agent import Agent
    from phasewise.producers.metrics import ProducerMetrics

    modes = [("a", "apply", None), ("b", "recommend", None), ("c", "off", None), ("d", "off", "bad"),
             ("e", "apply", None)]
    msg = HostSamples(host="h", ts=1.0, interval_s=1.0, containers=tuple(
        ContainerSample(container=c, cpu_cores=0.0, mem_bytes=0.0, workload=WorkloadPolicy(mode=m, error=e))
        for c, m, e in modes))

    class Sampler:
        empty = 3  # containers the tick skipped: no process in their cgroup

        def sample(self):
            return msg

    class Producer:
        def produce(self, *a, **kw):
            pass

        def poll(self, timeout=0):
            return 0

    agent = Agent(Settings().replace(host="h"), Sampler(), producer=Producer(),
                  metrics=ProducerMetrics(CollectorRegistry()))
    agent.tick()
    reg = agent.metrics.registry
    got = {m: reg.get_sample_value("phasewise_producer_workloads", {"mode": m}) for m in ("off", "recommend", "apply")}
    assert got == {"off": 2, "recommend": 1, "apply": 2}
    assert reg.get_sample_value("phasewise_producer_workloads_refused") == 1
    assert reg.get_sample_value("phasewise_producer_containers_empty") == 3
