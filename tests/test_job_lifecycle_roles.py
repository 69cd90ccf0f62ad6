"""The job lifecycle closes through the real roles on a private broker (issue 23's "nine jobs").

docs/placement.md's local run: ``phasewise submit`` (a trusted submitter key) -> ``phasewise place`` (two
one-CPU slices of this host) -> ``phasewise actuate`` (cgroup backend, ``actuator_start_jobs``), with the
cluster key on. Nine one-CPU jobs and one without a command: the first two start at once, each end
(``finished``, signed by the actuator) frees a slice for the next, so the later seven are started too;
the command-less one is ``rejected`` by the actuator and frees its slice; the finished jobs' cgroups are
removed. The test publishes only the
host's sample (the placement agent's nodes); every job event is a role's. Needs root and cgroup v1's
cpuset controller (the cgroup backend).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.records import DeadLetter, Decision, JobEvent
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, SAMPLES
from tests.job_keys import KEY, write_private
from tests.test_job_trust_roles import CPUS, REAL, Run, Topics, _key, _sample

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(not REAL or len(CPUS) < 2,
                                 reason="needs root, cgroup v1's cpuset controller and two CPUs")]
MIB = 1 << 20


def _job_file(tmp_path: Path, job: str, command: list[str] | None, pod: str | None = None) -> Path:
    """A one-CPU job file; its command (a host's actuator runs it) or its pod (Kubernetes binds it), if any."""
    f = tmp_path / f"{job}.json"
    body = {"job": job, "model": "resnet18", "dataset": "cifar10", "batch_size": 8,
            "requests": {"cpu_cores": 1, "mem_bytes": 64 * MIB}}
    if command:
        body["command"] = command
    if pod:
        body["pod"] = pod
    f.write_text(json.dumps(body))
    return f


def test_nine_one_cpu_jobs_on_two_one_cpu_nodes_all_end_and_every_booking_frees(broker, tmp_path):
    from phasewise.cli import main as phasewise

    tag = uuid.uuid4().hex[:6]
    run = Run(broker, tmp_path, f"life-{tag}")
    key_file, ring = _key(tmp_path)
    signed = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file)}
    topics = Topics(run.settings, JOB_EVENTS, DECISIONS, DEAD_LETTERS)
    pport = free_port()
    jobs = [f"j{i}-{tag}" for i in range(9)]
    bare = f"bare-{tag}"  # no command: placed, refused by the actuator
    try:
        run.start("place", ["--local-nodes", f"s0={CPUS[0]};s1={CPUS[1]}", "--place-id", f"life-{tag}",
                            "--data-dir", str(tmp_path / "p"), "--metrics-port", str(pport)],
                  {**signed, "PHASEWISE_PLACE_PREDICTION_WAIT_S": "0"})
        run.actuator(signed)
        run.wait(lambda: run.ready(pport, "phasewise_place_ready"), 120, "place ready")
        run.send(SAMPLES, run.host, _sample(run))
        submitter = write_private(tmp_path / "alice", KEY)
        for job in [bare, *jobs]:
            command = None if job == bare else ["/bin/sleep", "1"]
            rc = phasewise(["submit", "--bootstrap", run.settings.kafka.bootstrap, "--key", str(submitter),
                            "--timeout", "30", str(_job_file(tmp_path, job, command))])
            assert rc == 0, job

        def states() -> dict[str, list[JobEvent]]:
            topics.drain()
            out: dict[str, list[JobEvent]] = {}
            for ev in topics.records(JobEvent, JOB_EVENTS):
                out.setdefault(ev.job, []).append(ev)
            return out

        def ended(job: str, kinds=("finished", "failed", "rejected", "lost")) -> bool:
            return any(e.kind in kinds for e in states().get(job, []))

        run.wait(lambda: all(ended(j) for j in [bare, *jobs]), 300, "every job in a terminal state")
        got = states()
        # every job started and finished on its own, exit 0; the command-less one was rejected, with why
        for j in jobs:
            kinds = [e.kind for e in got[j]]
            assert kinds[0] == "submitted" and "started" in kinds and "finished" in kinds, (j, kinds)
            fin = next(e for e in got[j] if e.kind == "finished")
            assert fin.exit_code == 0 and fin.run_s is not None and fin.run_s >= 0.9, fin
        # a finished job's cgroups go with it (the actuator removes them once its end is published)
        run.wait(lambda: run.layout.containers() == [], 60, "no job container left")
        rejected = [e for e in got[bare] if e.kind == "rejected"]
        assert rejected and rejected[0].reason, got[bare]
        assert not any(e.kind == "lost" for evs in got.values() for e in evs)
        # the jobs that found no room were told why, by the placement agent, before they were placed
        waited = [e for evs in got.values() for e in evs if e.kind == "waiting"]
        assert waited and all("no node has enough CPU" in e.reason for e in waited), waited
        for e in waited:
            kinds = [x.kind for x in got[e.job]]
            assert kinds.index("waiting") < kinds.index("started"), kinds
        # each state the actuator wrote is signed with the cluster key (the agents take no other)
        for k, v, h in topics.got[JOB_EVENTS.name]:
            if json.loads(v)["kind"] in ("started", "finished", "rejected", "waiting"):
                assert ring.verify(JOB_EVENTS.name, k, v, h) is None, v
        # never more than the two one-CPU slices' worth running at once (by the actuator's clock)
        marks = sorted((e.ts, +1 if e.kind == "started" else -1) for j in jobs for e in got[j]
                       if e.kind in ("started", "finished"))
        running, most = 0, 0
        for _ts, step in sorted(marks, key=lambda m: (m[0], m[1])):
            running += step
            most = max(most, running)
        assert most <= 2, marks
        # one place decision per job (ten), each signed; none waits, no booking is left and nothing was lost
        decided = [d for d in topics.records(Decision, DECISIONS) if d.action == "place" and d.host == run.host]
        assert sorted(d.container for d in decided) == sorted([bare, *jobs])
        m = scrape(f"http://127.0.0.1:{pport}/metrics")
        assert m.get("phasewise_place_waiting_jobs") == 0.0 and m.get("phasewise_place_decisions_total") == 10.0
        assert m.get("phasewise_place_jobs_lost_total") == 0.0
        assert not [dl for dl in topics.records(DeadLetter, DEAD_LETTERS) if dl.source_topic == JOB_EVENTS.name]
        # the same id again: refused by submit, one line, nothing published
        assert phasewise(["submit", "--bootstrap", run.settings.kafka.bootstrap, "--key", str(submitter),
                          "--timeout", "30", str(_job_file(tmp_path, jobs[0], ["/bin/sleep", "1"]))]) == 1
        assert sum(1 for e in states()[jobs[0]] if e.kind == "submitted") == 1
    finally:
        topics.close()
        run.close()
