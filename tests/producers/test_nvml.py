"""NVML sampling at its boundary: a fake nvml module object and a fixture /proc tree.

No GPU exists on the development host; checking against real hardware needs an
NVIDIA host (see the module docstring of phasewise.producers.nvml).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from phasewise.producers.nvml import NvmlSampler, container_from_cgroup_text, container_of_pid
from phasewise.producers.sampler import HostSampler


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    """Same function names as pynvml; GPUs given as dicts."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[dict], init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self):
        self.inits += 1
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=h["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=h["used"], total=h["total"], free=h["total"] - h["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if h.get("procs_error"):
            raise FakeNVMLError("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in h["procs"]]


def fake_proc(root: Path, cgroups: dict[int, str]) -> Path:
    for pid, text in cgroups.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(text)
    return root


GiB = 2**30


@pytest.fixture
def proc(tmp_path) -> Path:
    return fake_proc(tmp_path / "proc", {
        101: "0::/phasewise/job-a\n",  # v2
        102: "12:memory:/phasewise/job-a/worker-1\n4:cpu,cpuacct:/phasewise/job-a/worker-1\n0::/\n",  # v1, nested
        201: "4:memory:/kubepods/phasewise/job-b\n3:cpu,cpuacct:/kubepods/phasewise/job-b\n",  # v1 under a parent
        301: "0::/user.slice/user-1000.slice/session-2.scope\n",  # not managed
    })


def test_cgroup_lines_of_both_versions_map_to_the_managed_container():
    assert container_from_cgroup_text("0::/phasewise/job-a\n", "phasewise") == "job-a"
    assert container_from_cgroup_text("7:cpu,cpuacct:/phasewise/job-a/sub\n", "phasewise") == "job-a"
    assert container_from_cgroup_text("0::/a/b/job-c\n", "a/b") == "job-c"
    assert container_from_cgroup_text("0::/phasewise\n", "phasewise") is None  # the prefix itself
    assert container_from_cgroup_text("0::/phasewise-other/job\n", "phasewise") is None
    assert container_from_cgroup_text("garbage\n", "phasewise") is None


def test_a_pid_without_a_proc_entry_maps_to_nothing(proc):
    assert container_of_pid(999, "phasewise", proc) is None
    assert container_of_pid(201, "phasewise", proc) == "job-b"


def test_per_gpu_samples_and_memory_weighted_attribution(proc):
    nv = FakeNvml([
        # GPU 0: 80% busy; job-a 6 GiB (2 procs), job-b 2 GiB -> a 60%, b 20%
        {"uuid": "GPU-0", "util": 80, "used": 8 * GiB, "total": 16 * GiB,
         "procs": [(101, 4 * GiB), (102, 2 * GiB), (201, 2 * GiB)]},
        # GPU 1: 50% busy; job-b 1 GiB, an unmanaged process 3 GiB -> b 12.5%
        {"uuid": "GPU-1", "util": 50, "used": 4 * GiB, "total": 16 * GiB,
         "procs": [(201, 1 * GiB), (301, 3 * GiB)]},
    ])
    r = NvmlSampler(nv, prefix="phasewise", proc_root=proc).sample()
    assert r is not None
    assert [(g.index, g.uuid, g.util, g.mem_used_bytes, g.mem_total_bytes) for g in r.gpus] == [
        (0, "GPU-0", 80.0, 8.0 * GiB, 16.0 * GiB),
        (1, "GPU-1", 50.0, 4.0 * GiB, 16.0 * GiB),
    ]
    assert set(r.containers) == {"job-a", "job-b"}
    util_a, mem_a = r.containers["job-a"]
    util_b, mem_b = r.containers["job-b"]
    assert util_a == pytest.approx(60.0) and mem_a == 6 * GiB
    assert util_b == pytest.approx(20.0 + 12.5) and mem_b == 3 * GiB


def test_without_process_memory_the_util_is_split_per_process(proc):
    nv = FakeNvml([{"uuid": "GPU-0", "util": 90, "used": 1, "total": 2,
                    "procs": [(101, None), (201, None), (301, None)]}])
    r = NvmlSampler(nv, proc_root=proc).sample()
    assert r.containers["job-a"] == (pytest.approx(30.0), 0.0)
    assert r.containers["job-b"] == (pytest.approx(30.0), 0.0)


def test_a_gpu_whose_process_list_fails_is_still_reported_without_attribution(proc):
    nv = FakeNvml([{"uuid": "GPU-0", "util": 10, "used": 1, "total": 2, "procs": [], "procs_error": True},
                   {"uuid": "GPU-1", "util": 40, "used": 1, "total": 2, "procs": [(101, 5)]}])
    r = NvmlSampler(nv, proc_root=proc).sample()
    assert [g.uuid for g in r.gpus] == ["GPU-0", "GPU-1"]
    assert r.containers == {"job-a": (pytest.approx(40.0), 5.0)}


def test_no_nvidia_gpu_logs_once_and_reports_nothing(proc, caplog):
    nv = FakeNvml([], init_error=FakeNVMLError("NVML Shared Library Not Found"))
    s = NvmlSampler(nv, proc_root=proc)
    with caplog.at_level(logging.WARNING):
        assert s.sample() is None
        assert s.sample() is None
    lines = [r.getMessage() for r in caplog.records if "no NVIDIA GPU" in r.getMessage()]
    assert lines == [("no NVIDIA GPU: NVML unavailable (FakeNVMLError: NVML Shared Library Not Found); "
                     "GPU fields omitted")]
    assert nv.inits == 1  # not retried every tick


def test_zero_devices_counts_as_no_gpu(proc, caplog):
    nv = FakeNvml([])
    assert NvmlSampler(nv, proc_root=proc).sample() is None
    assert "no NVIDIA GPU: NVML unavailable (no devices)" in caplog.text
    assert nv.shutdowns == 1


def test_host_sampler_puts_gpu_fields_on_containers_and_gpus_on_the_message(v2tree, proc):
    v2tree.set("job-a", cpu_s=1.0)
    v2tree.set("job-c", cpu_s=1.0)  # no GPU process: 0 on a GPU host, not absent
    nv = FakeNvml([{"uuid": "GPU-0", "util": 70, "used": 3 * GiB, "total": 16 * GiB,
                    "procs": [(101, 3 * GiB)]}])
    t = [0.0]
    s = HostSampler(v2tree.layout, nvml=nv, proc_root=proc, host="h1", monotonic=lambda: t[0])
    s.sample()
    t[0] += 1.0
    msg = s.sample()
    got = {c.container: (c.gpu_util, c.gpu_mem_bytes) for c in msg.containers}
    assert got == {"job-a": (pytest.approx(70.0), 3.0 * GiB), "job-c": (0.0, 0.0)}
    assert [g.uuid for g in msg.gpus] == ["GPU-0"]
    s.close()
    assert nv.shutdowns == 1


def test_host_sampler_without_nvml_omits_gpu_fields(v2tree, proc):
    v2tree.set("job-a", cpu_s=1.0)
    nv = FakeNvml([], init_error=FakeNVMLError("Driver Not Loaded"))
    t = [0.0]
    s = HostSampler(v2tree.layout, nvml=nv, proc_root=proc, host="h1", monotonic=lambda: t[0])
    s.sample()
    t[0] += 1.0
    msg = s.sample()
    assert msg.gpus == ()
    assert [(c.gpu_util, c.gpu_mem_bytes) for c in msg.containers] == [(None, None)]


def test_gpu_processes_in_pod_and_docker_containers_are_attributed_to_the_container_id(tmp_path):
    pod, dock = "a1" * 32, "b2" * 32
    uid = "0d5a4c52_1f37_4a8e_b8a5_7c7f1f3a9d01"
    proc = fake_proc(tmp_path / "proc", {
        11: f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
            f"cri-containerd-{pod}.scope\n",
        12: f"12:memory:/docker/{dock}\n4:cpu,cpuacct:/docker/{dock}\n",
        13: "0::/phasewise/job-a\n",
        14: "0::/system.slice/containerd.service\n",  # the runtime itself: not a container
    })
    nv = FakeNvml([{"uuid": "GPU-0", "util": 100, "used": 8 * GiB, "total": 16 * GiB,
                    "procs": [(11, 4 * GiB), (12, 2 * GiB), (13, 1 * GiB), (14, 1 * GiB)]}])
    r = NvmlSampler(nv, proc_root=proc, layouts=("flat", "docker-cgroupfs", "kubepods-systemd")).sample()
    assert set(r.containers) == {pod, dock, "job-a"}
    assert r.containers[pod] == (pytest.approx(50.0), 4 * GiB)
    flat_only = NvmlSampler(FakeNvml(nv.gpus), proc_root=proc).sample()  # the flat layout alone, as before
    assert set(flat_only.containers) == {"job-a"}
