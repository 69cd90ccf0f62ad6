"""``share`` decisions through the actuator: held for a job's start, the job started under the CUDA MPS
environment (advisory without an MPS control daemon, enforced with one), advisory for a job that runs;
on Kubernetes the pod annotated (recorded HTTP). No GPU here: what the job is started with is checked,
not what a GPU does with it."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import DryRunBackend
from phasewise.actuators.backends.gpu_share_enforcement import mps_daemon, start_environment
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.records import Decision, decode, encode
from phasewise.kit.settings import Settings
from phasewise.models.jobs.gpu_share import GpuShare, share_decision
from tests.actuators.conftest import Recorder, job_backend, job_python, job_settings, remove_started_jobs
from tests.actuators.test_place_cpuset import _decision
from tests.conftest import requires_root
from tests.job_keys import TRUSTED

GiB = 2**30
#: the job writes what it was started with (whole, by a rename), then runs until it is stopped
ENV = "import json, os, time; f = open('env.tmp', 'w'); json.dump({k: v for k, v in os.environ.items() " \
      "if k.startswith(('CUDA_', 'PHASEWISE_'))}, f); f.close(); os.rename('env.tmp', 'env.json'); time.sleep(600)"


def share(job: str, sm: int = 40, mem: int = 3 * GiB, device: int = 1, host: str = "h1") -> Decision:
    return share_decision(GpuShare(job, sm, mem, "test"), host=host, device=device, ts=time.time())


def test_the_start_environment_says_advisory_without_an_mps_daemon_and_enforced_with_one(tmp_path):
    d = share("j")
    env, enforced, msg = start_environment(d, visible=(1,), environ={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert not enforced and msg.startswith("GPU share advisory: no MPS control daemon serves")
    assert env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M",
                   "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "CUDA_MPS_LOG_DIRECTORY": "/var/log/nvidia-mps"}
    # the job sees GPUs 0 and 1: the share's GPU 1 is its ordinal 1; with no list, the host's index
    assert start_environment(d, visible=(0, 1), environ={})[0]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=3072M"
    assert start_environment(d, environ={})[0]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=3072M"
    (tmp_path / "control").write_text("")  # a file, not the daemon's FIFO
    assert not mps_daemon(str(tmp_path))
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")
    env, enforced, msg = start_environment(d, visible=(1,), environ={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path),
                                                                      "CUDA_MPS_LOG_DIRECTORY": "/l"})
    assert enforced and msg == "enforced by MPS: 40 % of threads, 3072 MiB" and env["CUDA_MPS_LOG_DIRECTORY"] == "/l"


def test_share_decisions_are_held_for_the_start_and_advisory_for_a_running_job(tmp_path):
    rec = Recorder()
    act = Actuator(Settings().replace(host="h1", data_dir=str(tmp_path), actuator_start_jobs=True),
                   DryRunBackend(exists=lambda c: False),
                   Ledger(tmp_path / "l.sqlite"), rec, metrics=ActuatorMetrics(CollectorRegistry()),
                   submitters=TRUSTED)
    a = act.handle(encode(share("j1")), b"h1", 0, 1)
    assert a.status == "applied" and "held for the start of job j1" in a.message and "40 %" in a.message
    assert act.ledger.held_shares() == 1
    bad = Decision(id="s-bad", ts=time.time(), host="h1", container="j2", action="share", policy="gpu-share",
                   details={"sm_percent": 0, "mem_limit_bytes": GiB})
    r = act.handle(encode(bad), b"h1", 0, 2)
    assert r.status == "rejected" and "sm_percent" in r.message and act.ledger.take_share("j2") is None
    assert decode(Decision, act.ledger.take_share("j1")).details["sm_percent"] == 40
    assert act.ledger.held_shares() == 0
    other = Decision(id="s-x", ts=time.time(), host="h1", container="../x", action="share", policy="gpu-share",
                     details={"sm_percent": 10, "mem_limit_bytes": GiB})
    assert "not a managed container name" in act.handle(encode(other), b"h1", 0, 3).message


@requires_root
@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists(), reason="no cgroup v1 cpuset hierarchy")
def test_a_placed_job_with_a_share_starts_under_the_mps_environment(tmp_path):
    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    rec = Recorder()
    act = Actuator(s, backend, Ledger(tmp_path / "ledger.sqlite"), rec, metrics=ActuatorMetrics(CollectorRegistry()),
                   submitters=TRUSTED)
    job = f"job-{uuid.uuid4().hex[:6]}"
    cpu = sorted(os.sched_getaffinity(0))[-1]
    try:
        held = act.handle(encode(share(job, sm=25, mem=2 * GiB, device=1)), b"h1", 0, 1)
        assert held.status == "applied", held.message
        # the actuator restarts between the share and the place decision: the share is in its ledger
        act.ledger.close()
        act = Actuator(s, backend, Ledger(tmp_path / "ledger.sqlite"), rec,
                       metrics=ActuatorMetrics(CollectorRegistry()), submitters=TRUSTED)
        a = act.handle(encode(_decision(job, str(cpu), [job_python(), "-c", ENV], device=(1,))), b"h1", 0, 2)
        assert a.status == "applied" and "GPU share advisory: no MPS control daemon" in a.message, a.message
        assert act.ledger.held_shares() == 0
        written, deadline = tmp_path / "jobs" / job / "env.json", time.monotonic() + 60
        while not written.exists() and backend.processes[job].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        env = json.loads(written.read_text())
        assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["PHASEWISE_JOB"] == job
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"  # GPU 1 is the job's device 0
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
        # a share for the job now running: advisory until it starts again
        late = act.handle(encode(share(job, sm=50, mem=2 * GiB, device=1)), b"h1", 0, 3)
        assert late.status == "rejected" and "advisory until restart" in late.message, late.message
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in late.message
    finally:
        remove_started_jobs(backend, layout)


def test_on_kubernetes_a_share_annotates_the_jobs_pod(tmp_path):
    """At the HTTP boundary (recorded answers): the pod holding the job's container gets the share's
    annotation by a strategic-merge PATCH; the actuation names the HAMi limits and says when they hold."""
    from phasewise.kit.records import WorkloadPolicy
    from tests.actuators.backends.kubernetes.test_backend import CID, LIST, POD, Replay, backend

    class Workloads:  # the pod's annotations: mode apply, the job's (phasewise.io/job)
        def describe(self, container):
            return None, WorkloadPolicy(mode="apply", source="annotation", job="trainer")

    r = Replay([LIST, ("PATCH", POD, 200, "pod-guaranteed.json")])
    try:
        rec = Recorder()
        a = Actuator(Settings().replace(host="gpu-node-3"), backend(r), Ledger(":memory:"), rec,
                     metrics=ActuatorMetrics(CollectorRegistry()), workloads=Workloads())
        d = share_decision(GpuShare("trainer", 30, 4 * GiB, "test"), host="gpu-node-3", device=0, ts=time.time(),
                           container=CID)
        act = a.handle(encode(d), b"gpu-node-3", 0, 0)
        assert act.status == "rejected" and "enforced by HAMi from the pod's next creation" in act.message, act.message
        assert "nvidia.com/gpucores=30" in act.message and "nvidia.com/gpumem=4096" in act.message
        patch = r.seen[-1]
        assert (patch["method"], patch["path"]) == ("PATCH", POD)
        assert patch["type"] == "application/strategic-merge-patch+json"
        ann = json.loads(patch["body"]["metadata"]["annotations"]["phasewise.io/gpu-share"])
        assert ann == {"sm_percent": 30, "mem_limit_bytes": 4 * GiB, "decision": d.id}
        assert not r.script
    finally:
        r.close()
