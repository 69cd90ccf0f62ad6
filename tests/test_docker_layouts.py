"""A real Docker container in the docker-cgroupfs layout, named from Docker's own record.

A private ``dockerd`` (:class:`tests.test_docker.Dockerd`, cgroupfs driver)
with ``--cgroup-parent /<parent>/docker`` puts its containers where a Docker
host does, ``docker/<id>``, under a unique parent. ``phasewise produce --once
--json`` with ``--cgroup-parent <parent>`` finds the container in the
``docker-cgroupfs`` layout and names it from ``<data-root>/containers/<id>/config.v2.json``;
a policy file opts it in by that name, and the actuator writes its limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from phasewise.actuators.backends import CgroupBackend
from phasewise.actuators.commands import SetLimits
from phasewise.kit.cgroups.fs import CgroupLayout
from tests.test_docker import IMAGE, SPIN, Dockerd
from tests.test_docker import pytestmark as docker_marks

pytestmark = docker_marks


@pytest.fixture(scope="module")
def dockerd_nested():
    parent = f"pwl-{uuid.uuid4().hex[:8]}"
    d = Dockerd(parent=f"{parent}/docker")
    d.outer = parent
    try:
        d.start()
        d.import_busybox()
        yield d
    finally:
        d.stop()
        for ctrl in Path("/sys/fs/cgroup").iterdir():
            try:
                (ctrl / parent).rmdir()
            except OSError:
                pass


def test_a_docker_container_is_found_named_opted_in_and_limited(dockerd_nested, tmp_path):
    d = dockerd_nested
    name = f"web-{uuid.uuid4().hex[:6]}"
    cid = d.docker("run", "-d", "--name", name, IMAGE, "/bin/sh", "-c", SPIN).stdout.decode().strip()
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"workloads": [{"match": "web-*", "mode": "apply", "cpu-max": "500m"}]}))
    env = {**os.environ, "PHASEWISE_LOG_LEVEL": "warning"}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "phasewise.cli", "produce", "--once", "--json", "--interval", "0.5",
             "--cgroup-root", "/sys/fs/cgroup", "--cgroup-parent", d.outer, "--cgroup-layout", "docker-cgroupfs",
             "--policy-file", str(policy)],
            capture_output=True, text=True, timeout=60,
            env={**env, "PHASEWISE_WORKLOAD_DOCKER_DIR": str(d.dir / "root" / "containers")})
        assert out.returncode == 0, out.stderr
        (c,) = json.loads(out.stdout)["containers"]
        assert c["container"] == cid
        assert c["identity"] == {"layout": "docker-cgroupfs", "container_id": cid, "pod_uid": None,
                                 "pod_namespace": None, "pod_name": None, "container_name": name,
                                 "runtime": "docker", "qos": None}
        assert c["workload"]["mode"] == "apply" and c["workload"]["source"] == "policy-file"
        assert c["cpu_cores"] > 0  # it spins (its share of 2 cores depends on the load)
        layout = CgroupLayout("/sys/fs/cgroup", layout="docker-cgroupfs", parent=d.outer)
        assert CgroupBackend(layout).apply(SetLimits(cid, cpu_cores=0.5)).status == "applied"
        inside = d.docker("exec", cid, "cat", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us", check=False)
        quota = Path(f"/sys/fs/cgroup/cpu/{d.outer}/docker/{cid}/cpu.cfs_quota_us").read_text().strip()
        assert quota == "50000", (quota, inside.stdout)
    finally:
        d.docker("rm", "-f", cid, check=False)
