"""Placement actuation for real: a placed job starts in a cpuset cgroup (v1) bound to its CPUs (needs root)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import DryRunBackend
from phasewise.actuators.commands import StartJob
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.actuators.safety import Rejected, plan
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from tests.actuators.conftest import Recorder, job_backend, job_python, job_settings, remove_started_jobs
from tests.conftest import requires_root
from tests.job_keys import TRUSTED, start

#: written by the job into its working directory (it runs as nobody: the test's own directories are closed to it)
REPORT = "import json, os, sys; json.dump({'cpus': sorted(os.sched_getaffinity(0)), 'cg': open('/proc/self/cgroup')" \
         ".read(), 'gpus': os.environ.get('CUDA_VISIBLE_DEVICES')}, open('report.json', 'w'))"
CPUS = sorted(os.sched_getaffinity(0))


def _decision(job: str, cpuset: str, argv: list[str], device=(0,), host="h1") -> Decision:
    """A place decision of *job* as the placement agent makes it: the submitted job as signed, with *argv*."""
    return Decision(id=f"place-{job}", ts=time.time(), host=host, container=job, action="place", policy="horus",
                    reason="test", details={"cpuset": cpuset, "device": list(device), "node": "s1",
                                            **start(job, argv, ts=time.time() - 1)})


def test_plan_place_rules():
    s = Settings().replace(host="h1")

    def plan_it(d, exists=False):
        return plan(d, exists=exists, usage_mem_bytes=None, host_cores=2, settings=s, host_cpus=frozenset({0, 1}),
                    now=time.time(), submitters=TRUSTED)

    ok = plan_it(_decision("j", "0", ["true"]))
    assert ok.command == StartJob("j", "0", ("true",), (0,), job="j")
    bad = [(_decision("j", "0-7", ["true"]), "not within this host's CPUs"),
           (_decision("j", "x", ["true"]), "not a cpuset list"),
           (_decision("j", "0", []), "names no command"),
           (_decision("j", "0", [""]), "holds an empty argument"),
           (_decision("j", "0", ["true"], device=(-1,)), "GPU indices"),
           (_decision("../j", "0", ["true"]), "not a managed container name")]
    for d, why in bad:
        r = plan_it(d)
        assert isinstance(r, Rejected) and why in r.reason, (d.details, r)
    r = plan_it(_decision("j", "0", ["true"]), exists=True)
    assert isinstance(r, Rejected) and "already exists" in r.reason


def test_dry_run_starts_nothing(tmp_path):
    out = DryRunBackend().apply(StartJob("j", "0", ("touch", str(tmp_path / "x")), (1,)))
    assert out.status == "applied" and "would start" in out.message and "GPUs [1]" in out.message
    assert not (tmp_path / "x").exists()


@requires_root
@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists(), reason="no cgroup v1 cpuset hierarchy")
def test_placed_job_runs_in_its_cpuset(tmp_path):
    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    rec = Recorder()
    act = Actuator(s, backend, Ledger(tmp_path / "ledger.sqlite"), rec,
                   metrics=ActuatorMetrics(CollectorRegistry()), submitters=TRUSTED)
    job, cpu = f"job-{uuid.uuid4().hex[:6]}", CPUS[-1]
    report = tmp_path / "jobs" / job / "report.json"
    argv = [job_python(), "-c", REPORT]
    try:
        a = act.handle(encode(_decision(job, str(cpu), argv, device=(0, 1))), b"h1", 0, 1)
        assert a.status == "applied" and f"cpuset {cpu}" in a.message, a.message
        rec.wait_job_event(job, "finished")
        got = json.loads(report.read_text())
        assert got["cpus"] == [cpu] and got["gpus"] == "0,1"
        cg = dict(line.split(":", 2)[1:] for line in got["cg"].splitlines())
        assert cg["cpuset"] == f"/{layout.prefix}/{job}" and cg["memory"] == f"/{layout.prefix}/{job}"
        with act.lock:  # finished: its cgroups and its cpuset slice went with its end
            assert not layout.exists(job) and not (layout.controller_root("cpuset") / layout.prefix / job).exists()
        # the same decision again is a duplicate; another decision for the same job is refused
        assert act.handle(encode(_decision(job, str(cpu), argv)), b"h1", 0, 2).status == "duplicate"
        again = dataclasses.replace(_decision(job, str(cpu), argv), id=f"place-{job}-again")
        refused = act.handle(encode(again), b"h1", 0, 3)  # its container is gone; the registry remembers
        assert refused.status == "rejected" and refused.message == (
            f"job {job!r} already ran in container {job!r} and finished: a placed job is started once")
        # a resume is its agent's restart of a job it stopped (one that honoured the stop's control before the
        # terminate decision came was reported finished): it starts again, in a container made again
        report.unlink()
        resumed = dataclasses.replace(_decision(job, str(cpu), argv), id=f"place-{job}-resume")
        resumed.details["resume"] = True
        a = act.handle(encode(resumed), b"h1", 0, 4)
        assert a.status == "applied" and a.message.startswith("resumed pid "), a.message
        rec.wait_job_event(job, "finished", count=2)
        assert json.loads(report.read_text())["cpus"] == [cpu]
        # a command that cannot start fails and leaves no cgroup behind
        bad = act.handle(encode(_decision(f"{job}-b", str(cpu), ["/nonexistent/cmd"])), b"h1", 0, 5)
        assert bad.status == "failed" and not layout.exists(f"{job}-b")
        assert not (layout.controller_root("cpuset") / layout.prefix / f"{job}-b").exists()
    finally:
        remove_started_jobs(backend, layout)


def test_on_kubernetes_a_place_decision_binds_the_pod_its_signed_spec_names():
    s = Settings().replace(host="gpu-node-3")

    def plan_it(d):
        return plan(d, exists=False, usage_mem_bytes=None, host_cores=2, settings=s, host_cpus=None,
                    now=time.time(), submitters=TRUSTED, kubernetes=True)

    def decision(job: str, **spec_kw) -> Decision:
        return Decision(id=f"place-{job}", ts=time.time(), host="gpu-node-3", container=job, action="place",
                        policy="horus", reason="test",
                        details={"node": "gpu-node-3", **start(job, ts=time.time() - 1, **spec_kw)})

    from phasewise.actuators.commands import Bind

    ok = plan_it(decision("j", pod="ml/train-j"))
    assert ok.command == Bind("train-j", "gpu-node-3", "ml", job="j")
    r = plan_it(decision("j"))
    assert isinstance(r, Rejected) and "names no pod (spec.pod" in r.reason
    d = decision("j", pod="ml/train-j")  # an agent cannot aim the bind at another pod: the spec is signed
    d.details["spec"]["pod"] = "kube-system/coredns"
    r = plan_it(d)
    assert isinstance(r, Rejected) and "changed after it was submitted" in r.reason
