"""CPU weights by priority through the actuator: the safety rule, every backend, and CFS for real (cgroup v1).

The real test: two CPU-spinning processes, each started by a ``place`` decision
in its own managed container bound to the same CPU (cpuset), weighted by
``weight`` decisions from the priority rule (priority 0 and 2: weights 100 and
400, ``cpu.shares`` 1024 and 4096), get CPU time (``cpuacct.usage``) in about
that ratio. Other processes on the host take their part of the CPU too (the
managed prefix competes with them at its own weight): the ratio between the two
siblings holds whatever is left for them, so the test waits for enough CPU
time, not for a fixed wall time.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import CgroupBackend, DryRunBackend, shares_of_weight, weight_of_shares
from phasewise.actuators.backends.kubernetes import KubeApi, KubernetesBackend, PodContainer
from phasewise.actuators.commands import SetCpuWeight
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.actuators.safety import Planned, Rejected, plan
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from phasewise.models.jobs.priorities import Action, cpu_weight, to_decision
from tests.actuators.conftest import Recorder, job_backend, job_python, job_settings, own, remove_started_jobs
from tests.conftest import requires_root
from tests.job_keys import TRUSTED
from tests.job_keys import start as signed_start

S = Settings().replace(host="h1", cpu_weight_min=10, cpu_weight_max=5000)


def weight_decision(container: str, weight, *, did: str | None = None, host: str = "h1") -> Decision:
    return Decision(id=did or uuid.uuid4().hex, ts=time.time(), host=host, container=container, action="weight",
                    policy="priority", reason="test", details={"cpu_weight": weight})


def planned(d: Decision, exists: bool = True) -> Planned | Rejected:
    return plan(d, exists=exists, usage_mem_bytes=None, host_cores=2, settings=S)


def test_the_safety_rule_holds_the_weight_in_its_bounds_and_refuses_what_is_not_one():
    p = planned(weight_decision("job-a", 400))
    assert p.command == SetCpuWeight("job-a", 400) and p.status == "applied"
    p = planned(weight_decision("job-a", 2.6))
    assert p.command.weight == 10 and "raised to cpu_weight_min (10)" in p.message and p.status == "clamped"
    p = planned(weight_decision("job-a", 10**6))
    assert p.command.weight == 5000 and "lowered to cpu_weight_max (5000)" in p.message
    assert planned(weight_decision("job-a", 123.6)).command.weight == 124
    for bad in (None, "100", True, -1, math.nan, math.inf, [100]):
        r = planned(weight_decision("job-a", bad))
        assert isinstance(r, Rejected) and "weight decision for 'job-a'" in r.reason, bad
    assert "does not exist" in planned(weight_decision("job-a", 100), exists=False).reason
    assert "not a managed container name" in planned(weight_decision("../etc", 100)).reason


def test_the_actuator_weights_only_opted_in_containers(tmp_path):
    for mode, status in (("apply", "applied"), ("recommend", "rejected"), ("off", "rejected")):
        backend = DryRunBackend()
        rec = Recorder()
        act = Actuator(S.replace(workload_default_mode=mode), backend, Ledger(tmp_path / f"{mode}.sqlite"), rec,
                       metrics=ActuatorMetrics(CollectorRegistry()))
        own(act, "job-a")
        a = act.handle(encode(weight_decision("job-a", 3200)), b"h1", 0, 1)
        assert a.status == status, (mode, a.message)
        assert backend.commands == ([SetCpuWeight("job-a", 3200)] if mode == "apply" else [])
        if mode == "apply":
            assert "would set cpu.weight 3200 (cgroup v1: cpu.shares 32768)" in a.message


def test_v1_shares_are_proportional_to_the_weight():
    assert shares_of_weight(100) == 1024  # the two defaults
    for w in (1, 10, 159, 400, 3200, 10000):
        assert abs(weight_of_shares(shares_of_weight(w)) - w) <= 0.05 * w + 0.1
    assert shares_of_weight(400) / shares_of_weight(100) == 4.0  # ratios kept
    assert shares_of_weight(0) == 2 and shares_of_weight(10**6) == 262144  # the kernel's range


def test_v2_writes_cpu_weight(tmp_path):
    root = tmp_path / "cg2"
    d = root / "pw" / "job-a"
    d.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for name, text in {"cpu.weight": "100\n", "cpu.max": "max 100000\n", "cgroup.controllers": "cpu memory\n"}.items():
        (d / name).write_text(text)
    out = CgroupBackend(CgroupLayout(root, prefix="pw")).apply(SetCpuWeight("job-a", 3200))
    assert out.status == "applied" and out.message == "set cpu.weight 3200"
    assert (d / "cpu.weight").read_text() == "3200"
    gone = CgroupBackend(CgroupLayout(root, prefix="pw")).apply(SetCpuWeight("job-b", 100))
    assert gone.status == "failed" and "container gone" in gone.message


def test_kubernetes_reports_a_weight_as_advisory():
    b = KubernetesBackend(KubeApi("http://127.0.0.1:9", timeout_s=0.5), lambda c: PodContainer("ml", "p", "c"))
    out = b.apply(SetCpuWeight("c", 3200))  # no request reaches the (absent) API server
    assert out.status == "rejected" and out.message.startswith("advisory, not applied")
    assert "32 cores" in out.message


# ------------------------------------------------------------------------------------- for real (cgroup v1)

SPIN = "import os\nwhile True:\n    pass\n"


def _usage_ns(layout: CgroupLayout, c: str) -> int:
    return int((layout.path(c, "cpuacct") / "cpuacct.usage").read_text())


@requires_root
@pytest.mark.slow
@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists()
                    or not Path("/sys/fs/cgroup/cpu/cpu.shares").exists(), reason="no cgroup v1 cpu and cpuset")
def test_two_spinning_jobs_on_one_cpu_get_cpu_in_the_ratio_of_their_weights(tmp_path):
    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    rec = Recorder()
    act = Actuator(s, backend, Ledger(tmp_path / "l.sqlite"), rec, metrics=ActuatorMetrics(CollectorRegistry()),
                   submitters=TRUSTED)
    cpu = str(sorted(os.sched_getaffinity(0))[-1])
    tag = uuid.uuid4().hex[:6]
    jobs = {f"low-{tag}": 0, f"high-{tag}": 2}  # priorities: weights 100 and 400
    try:
        for i, (job, prio) in enumerate(jobs.items()):
            start = Decision(id=f"start-{job}", ts=time.time(), host="h1", container=job, action="place",
                             policy="priority", reason="test",
                             details={"cpuset": cpu, "device": [],
                                      **signed_start(job, (job_python(), "-c", SPIN), ts=time.time() - 1)})
            assert act.handle(encode(start), b"h1", 0, 2 * i).status == "applied"
            w = cpu_weight(prio, "training")
            d = to_decision(Action("weight", job, "h1", "test", {"cpu_weight": w}), time.time())
            a = act.handle(encode(d), b"h1", 0, 2 * i + 1)
            assert a.status == "applied", a.message
            assert int((layout.path(job, "cpu") / "cpu.shares").read_text()) == shares_of_weight(w)
        low, high = jobs
        assert [cpu_weight(p, "training") for p in jobs.values()] == [100, 400]
        time.sleep(0.5)  # both spinning (python started)
        u0 = {j: _usage_ns(layout, j) for j in jobs}
        t0 = time.monotonic()
        # enough CPU time for a stable ratio (CFS divides in slices of a few ms), however busy the host
        while time.monotonic() - t0 < 60:
            time.sleep(0.5)
            got = {j: _usage_ns(layout, j) - u0[j] for j in jobs}
            if sum(got.values()) >= 3e9 and time.monotonic() - t0 >= 3:
                break
        assert got[low] > 0, "the low-weight job got no CPU at all"
        ratio = got[high] / got[low]
        load = os.getloadavg()[0]
        print(f"CPU {got[high] / 1e9:.2f} s vs {got[low] / 1e9:.2f} s in {time.monotonic() - t0:.1f} s: "
              f"ratio {ratio:.2f} (weights 4:1), load {load:.2f}")
        assert 2.5 <= ratio <= 6.5, (got, ratio, load)
    finally:
        remove_started_jobs(backend, layout)
