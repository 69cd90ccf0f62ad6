"""GPU shares at the boundary: what a job under MPS is started with, what a HAMi pod gets, advisory otherwise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phasewise.actuators.backends.gpu_share_enforcement import carry, hami_resources, mps_env, share_decision
from phasewise.kit.records import Decision, decode, encode
from phasewise.models.jobs.gpu_share import ShareRequest, shares

GiB = 2**30


def decisions():
    s = shares([ShareRequest("infer", 0.6, 6 * GiB, priority=5), ShareRequest("train", 0.6, 8 * GiB)],
               mem_total_bytes=16 * GiB)
    return [share_decision(x, host="h1", device=1, ts=100.0) for x in s]


def test_share_decisions_are_valid_records():
    ds = decisions()
    assert [(d.container, d.details["sm_percent"]) for d in ds] == [("infer", 60), ("train", 40)]
    assert all(decode(Decision, encode(d)) == d for d in ds)


def test_a_job_started_under_mps_gets_the_share_in_its_environment():
    d = decisions()[1]
    c = carry(d, "mps", running=False)
    assert c.enforced and c.env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
                                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=8192M"}
    # the environment a real child process is started with
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'],"
                          " os.environ['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT'])"],
                         env={"PATH": "/usr/bin:/bin", **c.env}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["40", "1=8192M"]
    running = carry(d, "mps", running=True)
    assert not running.enforced and "advisory until restart" in running.message


def test_hami_resources_and_annotation():
    d = decisions()[0]
    c = carry(d, "hami", running=False)
    assert c.enforced and c.resources == {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "60",
                                          "nvidia.com/gpumem": "6144"}
    assert json.loads(c.annotations["phasewise.io/gpu-share"])["decision"] == d.id
    assert not carry(d, "hami", running=True).enforced


def test_without_an_enforcer_the_share_is_advisory():
    c = carry(decisions()[0], "none", running=True)
    assert not c.enforced and c.message.startswith("advisory")


def test_a_daemon_is_seen_by_its_control_fifo_or_its_control_socket(tmp_path):
    """CUDA's older MPS daemons make ``control`` a FIFO; CUDA 13's (seen on an H100) a Unix socket."""
    import os
    import socket

    from phasewise.actuators.backends.gpu_share_enforcement import mps_daemon

    fifo, sock, none = tmp_path / "fifo", tmp_path / "sock", tmp_path / "none"
    for d in (fifo, sock, none):
        d.mkdir()
    os.mkfifo(fifo / "control")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(sock / "control"))
        (none / "control").write_text("")  # a plain file is no daemon
        assert mps_daemon(str(fifo)) and mps_daemon(str(sock))
        assert not mps_daemon(str(none)) and not mps_daemon(str(tmp_path / "missing"))
    finally:
        s.close()


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="sm_percent"):
        mps_env(sm_percent=0, mem_limit_bytes=GiB)
    with pytest.raises(ValueError, match="1 MiB"):
        hami_resources(sm_percent=10, mem_limit_bytes=10)
    bad = Decision(id="x", ts=1.0, host="h", container="c", action="share", policy="p", details={"sm_percent": 50})
    with pytest.raises(ValueError, match="mem_limit_bytes"):
        carry(bad, "mps", running=False)
    with pytest.raises(ValueError, match="backend"):
        carry(decisions()[0], "vgpu", running=False)
