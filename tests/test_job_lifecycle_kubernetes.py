"""The job lifecycle closes through the real roles on the Kubernetes backend, at the HTTP boundary.

``phasewise submit`` (a trusted submitter key, each job naming its pending pod) -> ``phasewise place`` (the
node from its host's samples, two CPUs) -> ``phasewise actuate --backend kubernetes`` (cluster key on,
``actuator_start_jobs``): each place decision binds the job's pod to the node (``POST .../binding``), and
the node's pod watch reports the pod's states (``started``, ``finished``, ``failed``), which free the
bookings for the next jobs. The API server is a local one with state (tests/.../kubernetes/apiserver.py:
pods in the API server's shape, its watch stream chunked as the API server sends it); no real cluster runs
here. A job that names no pod, and one whose pod names another job, are ``rejected`` with why.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.records import Decision, GpuSample, HostSamples, JobEvent, encode
from phasewise.kit.topics import DECISIONS, JOB_EVENTS, SAMPLES
from tests.actuators.backends.kubernetes.apiserver import ApiServer
from tests.job_keys import KEY, write_private
from tests.test_job_lifecycle_roles import _job_file
from tests.test_job_trust_roles import Run, Topics, _key

pytestmark = [pytest.mark.broker, pytest.mark.slow]
MIB = 1 << 20
GB = 1e9


def test_jobs_on_kubernetes_are_bound_watched_and_their_bookings_freed(broker, tmp_path):
    from phasewise.cli import main as phasewise

    tag = uuid.uuid4().hex[:6]
    node = f"k8s-node-{tag}"
    run = Run(broker, tmp_path, node)
    api = ApiServer(node)
    key_file, ring = _key(tmp_path)
    signed = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file)}
    topics = Topics(run.settings, JOB_EVENTS, DECISIONS)
    pport = free_port()
    jobs = [f"k{i}-{tag}" for i in range(6)]
    failing = jobs[2]  # its container exits 3
    nopod, stolen = f"nopod-{tag}", f"stolen-{tag}"
    for i, job in enumerate(jobs):
        api.add_pod("ml", f"train-{i}-{tag}", job, run_s=1.0, exit_code=3 if job == failing else 0)
    api.add_pod("ml", f"other-{tag}", f"someone-else-{tag}")  # a pod of another job, which `stolen` names
    try:
        run.start("place", ["--place-id", f"k8s-{tag}", "--data-dir", str(tmp_path / "p"),
                            "--metrics-port", str(pport)], {**signed, "PHASEWISE_PLACE_PREDICTION_WAIT_S": "0"})
        run.start("actuate", ["--backend", "kubernetes", "--kube-api", api.url], {
            **signed, "PHASEWISE_DATA_DIR": str(tmp_path / "a"), "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(run.trusted),
            "PHASEWISE_ACTUATOR_START_JOBS": "true", "PHASEWISE_CGROUP_PREFIX": f"pwtest-{tag}"})
        run.wait(lambda: run.ready(pport, "phasewise_place_ready"), 120, "place ready")
        run.send(SAMPLES, node, encode(HostSamples(
            host=node, ts=time.time(), interval_s=1.0, host_cpu_count=2, host_cpu_cores=0.0, host_mem_bytes=GB,
            host_mem_total_bytes=16 * GB, gpus=(GpuSample(index=0, uuid="GPU-0", util=0.0, mem_used_bytes=0,
                                                          mem_total_bytes=16 << 30),))))
        submitter = write_private(tmp_path / "alice", KEY)
        pods = {job: f"ml/train-{i}-{tag}" for i, job in enumerate(jobs)}
        for job, pod in [*pods.items(), (nopod, None), (stolen, f"ml/other-{tag}")]:
            rc = phasewise(["submit", "--bootstrap", run.settings.kafka.bootstrap, "--key", str(submitter),
                            "--timeout", "30", str(_job_file(tmp_path, job, None, pod))])
            assert rc == 0, job

        def states() -> dict[str, list[JobEvent]]:
            topics.drain()
            out: dict[str, list[JobEvent]] = {}
            for ev in topics.records(JobEvent, JOB_EVENTS):
                out.setdefault(ev.job, []).append(ev)
            return out

        def ended(job: str) -> bool:
            return any(e.kind in ("finished", "failed", "rejected", "lost") for e in states().get(job, []))

        run.wait(lambda: all(ended(j) for j in [*jobs, nopod, stolen]), 300, "every job in a terminal state")
        got = states()
        for j in jobs:
            kinds = [e.kind for e in got[j]]
            assert kinds[0] == "submitted" and "started" in kinds, (j, kinds)
            st = next(e for e in got[j] if e.kind == "started")
            assert (st.host, st.container) == (node, pods[j]), st
            end = next(e for e in got[j] if e.kind in ("finished", "failed"))
            if j == failing:
                assert (end.kind, end.exit_code) == ("failed", 3) and "exit code 3" in end.reason, end
            else:
                assert (end.kind, end.exit_code) == ("finished", 0), end
        why = {j: next(e.reason for e in got[j] if e.kind == "rejected") for j in (nopod, stolen)}
        assert "names no pod" in why[nopod] and f"names job 'someone-else-{tag}'" in why[stolen], why
        assert not any(e.kind == "lost" for evs in got.values() for e in evs)
        # each pod bound once, to this node; the states came signed by the actuator (the agents take no other)
        assert sorted(api.bindings) == sorted((p, node) for p in pods.values())
        for k, v, h in topics.got[JOB_EVENTS.name]:
            if json.loads(v)["kind"] in ("started", "finished", "failed", "rejected", "waiting"):
                assert ring.verify(JOB_EVENTS.name, k, v, h) is None, v
        # never more than the node's two CPUs' worth running at once (by the actuator's clock)
        marks = sorted((e.ts, +1 if e.kind == "started" else -1) for j in jobs for e in got[j]
                       if e.kind in ("started", "finished", "failed"))
        running, most = 0, 0
        for _ts, step in marks:
            running += step
            most = max(most, running)
        assert most <= 2, marks
        assert any(e.kind == "waiting" for j in jobs for e in got[j])  # four of them waited for a CPU
        decided = [d for d in topics.records(Decision, DECISIONS) if d.action == "place"]
        assert sorted(d.container for d in decided) == sorted([*jobs, nopod, stolen])
        m = scrape(f"http://127.0.0.1:{pport}/metrics")
        assert m.get("phasewise_place_waiting_jobs") == 0.0 and m.get("phasewise_place_jobs_lost_total") == 0.0
    finally:
        topics.close()
        run.close()
        api.close()
