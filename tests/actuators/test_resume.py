"""Preempt and resume off the experiment, for real: the priority agent's decisions through the cgroup actuator.

A job submitted with a command is started by the actuator (``place``), stopped
by checkpoint-and-exit when a more important job needs its core (the control
delivered as the ``phasewise progress`` sidecar delivers it: SIGTERM to the
job, :class:`~phasewise.producers.progress.ChildControl`; the actuator's
``terminate`` waits for the exit), and started again from its checkpoint in
its own container when the other job finishes (``place`` with ``resume``),
losing no completed step. Needs root and cgroup v1 (cpuset).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.job_signing import sign_event, start_details
from phasewise.kit.records import JobEvent, JobRequests, JobSpec, encode
from phasewise.models.jobs.priorities import Capacity, PriorityConfig
from phasewise.models.jobs.priority_step import PriorityStep, PriorityStepConfig
from phasewise.models.jobs.submissions import Submissions
from phasewise.producers.progress import ChildControl
from tests.actuators.conftest import Recorder, job_backend, job_python, job_settings, remove_started_jobs
from tests.conftest import requires_root
from tests.job_keys import KEY, TRUSTED

#: a job that resumes from its checkpoint file, steps every 20 ms, and on SIGTERM checkpoints and exits
JOB = r"""
import os, signal, sys, time
ck = sys.argv[1]
step = int(open(ck).read()) if os.path.exists(ck) else 0
print("resume" if step else "start", step, ",".join(map(str, sorted(os.sched_getaffinity(0)))), flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
while not stop:
    time.sleep(0.02)
    step += 1
    print("step", step, flush=True)
with open(ck + ".tmp", "w") as f:
    f.write(str(step))
os.replace(ck + ".tmp", ck)
print("exit", step, flush=True)
"""


def submitted(job: str, *, priority: int, command: tuple[str, ...] = ()) -> bytes:
    """The job as ``phasewise submit --key`` publishes it: signed by the tests' trusted submitter."""
    spec = JobSpec(model="mlp", dataset="synthetic", batch_size=64, command=command,
                   requests=JobRequests(cpu_cores=1.0, mem_bytes=2**28))
    return encode(sign_event(KEY, JobEvent(job=job, ts=time.time(), kind="submitted", host="h1", priority=priority,
                                           spec=spec)))


def lines(log: Path) -> list[list[str]]:
    return [ln.split() for ln in log.read_text().splitlines()] if log.exists() else []


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@requires_root
@pytest.mark.slow
@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists(), reason="no cgroup v1 cpuset hierarchy")
@pytest.mark.parametrize("exited_first", [False, True], ids=["terminate-first", "exited-first"])
def test_a_stopped_job_is_resumed_from_its_checkpoint_in_its_container(tmp_path, exited_first):
    """*exited_first*: the job has honoured its checkpoint_exit control and its end was reported (finished, its
    container removed) before the actuator handles the terminate decision sent with the control."""
    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    s = job_settings(tmp_path)
    backend = job_backend(layout, s)
    rec = Recorder()
    act = Actuator(s, backend, Ledger(tmp_path / "l.sqlite"), rec, metrics=ActuatorMetrics(CollectorRegistry()),
                   submitters=TRUSTED)
    policy = PriorityConfig(freeze_max_wait_s=120, grace_s=10, cpu_weight_ratio=2.0)
    agent = PriorityStep(PriorityStepConfig(policy, Capacity(1.0, 2**32),
                                            "h1", 8, "self", 300.0), Submissions(start_details))
    tag = uuid.uuid4().hex[:6]
    low, hi = f"low-{tag}", f"hi-{tag}"
    log = tmp_path / "job-logs" / f"{low}.log"
    ckpt = tmp_path / "jobs" / low / "low.ckpt"  # in its working directory (it runs as nobody)
    host_cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))

    def apply(raw: bytes) -> list:
        decisions, controls = agent.handle(raw)
        for c in controls:  # what the job's progress reporter does with it
            ChildControl(backend.processes[c.job]).checkpoint_exit(c)
            if exited_first:
                rec.wait_for(lambda job=c.job: any(e.kind == "finished" for e in rec.job_events(job)))
        return [(d.action, d.container, act.handle(encode(d), b"h1", 0, 0), d) for d in decisions]

    try:
        got = apply(submitted(low, priority=0, command=(job_python(), "-c", JOB, "low.ckpt")))
        assert [(a, c, x.status) for a, c, x, _ in got] == [("place", low, "applied"), ("weight", low, "applied")]
        wait_for(lambda: sum(ln[0] == "step" for ln in lines(log)) >= 10, 30, "low's first steps")
        assert lines(log)[0] == ["start", "0", host_cpus]  # no cpuset named: the host's CPUs
        # hi needs the only core; its expected time is unknown: low is checkpointed and stopped
        got = apply(submitted(hi, priority=3))
        assert [(a, c) for a, c, _, _ in got] == [("terminate", low), ("place", hi), ("weight", hi)]
        stop, start_hi, weight_hi = (x for _, _, x, _ in got)
        # (its checkpoint_exit control came first: the job may have exited before the terminate arrived; then
        # it was reported finished and its container went with its end, and it is the stop's exit all the same)
        raced = "already ended (finished at" in stop.message
        assert raced or not exited_first, stop.message
        assert stop.status == "applied" and ("all exited" in stop.message or raced
                                             or "no process in the container" in stop.message), stop.message
        rec.wait_job_event(low, "finished" if raced else "terminated")
        assert [e.kind for e in rec.job_events(low)] == ["started", "finished" if raced else "terminated"]
        assert start_hi.status == "rejected" and "names no command" in start_hi.message  # its submitter starts it
        assert weight_hi.status == "rejected" and "does not exist" in weight_hi.message
        exited = int(next(ln for ln in lines(log) if ln[0] == "exit")[1])
        assert int(ckpt.read_text()) == exited > 0
        assert layout.exists(low) != raced and (raced or not layout.pids(low))  # stopped, its container kept
        # hi finishes: low is restarted in its container, from its checkpoint
        got = apply(encode(JobEvent(job=hi, ts=time.time(), kind="finished")))
        assert [(a, c, x.status) for a, c, x, _ in got] == [("place", low, "applied"), ("weight", low, "applied")]
        assert "resumed pid" in got[0][2].message and ("its container again" in got[0][2].message) != raced
        wait_for(lambda: any(ln[0] == "resume" for ln in lines(log)), 30, "low resumed")
        resumed = next(ln for ln in lines(log) if ln[0] == "resume")
        assert resumed == ["resume", str(exited), host_cpus]  # no completed step lost, the same CPUs
        assert layout.pids(low)
        # the same resume again (a replay under another id) while it runs is refused: a job runs once
        again = dataclasses.replace(got[0][3], id=f"again-{tag}")
        a = act.handle(encode(again), b"h1", 0, 0)
        assert a.status == "failed" and "still holds 1 process" in a.message, a.message
    finally:
        remove_started_jobs(backend, layout)
