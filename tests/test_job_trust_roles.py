"""Who may start a job, on real roles and a private broker: only a trusted submitter's signed job runs.

- Without a cluster key, a forged ``place`` decision (any command, or a real job's signed fields aimed at
  another container or with its command changed) starts nothing: the actuator rejects it with the reason.
- With the cluster key on, a writer of the job events alone (no submitter key) submits a job with a command:
  ``worker --priorities`` and ``place`` decide it, both signing, but the actuator starts nothing; a job signed
  by an untrusted key is refused; a job signed by a trusted submitter is started. Forged lifecycle records
  (a ``started`` event naming another container, an ``admitted`` hint) are dead-lettered, and so is a forged
  decision. Both launcher modes: the priority agent's own place decisions, and the placement agent's after
  its admission hints (placement with signing on, end to end).

With root and a cgroup v1 cpuset hierarchy the actuator is the cgroup backend and the jobs' command (a
``touch`` of a marker file) really runs or not; elsewhere the dry-run backend says what it would start.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    Actuation,
    DeadLetter,
    Decision,
    GpuSample,
    HostSamples,
    Interval,
    JobEvent,
    JobRequests,
    SchemaError,
    UtilisationPrediction,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, DECISIONS, JOB_EVENTS, PREDICTIONS, SAMPLES
from tests.conftest import is_root
from tests.job_keys import KEY, STRANGER, start, submitted, write_public

pytestmark = [pytest.mark.broker, pytest.mark.slow]
GB = 1e9
CPUS = sorted(os.sched_getaffinity(0))
REAL = is_root() and Path("/sys/fs/cgroup/cpuset/cpuset.cpus").exists()


class Topics:
    """Every record of some topics from their start, with its headers."""

    def __init__(self, settings: Settings, *topics) -> None:
        self.c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
        self.c.assign([TopicPartition(t.name, p, OFFSET_BEGINNING) for t in topics for p in range(t.partitions)])
        self.got: dict[str, list[tuple[bytes | None, bytes, list]]] = {t.name: [] for t in topics}

    def drain(self) -> None:
        for m in self.c.consume(500, 0.2):
            if not m.error() and m.value() is not None:
                self.got[m.topic()].append((m.key(), m.value(), m.headers() or []))

    def records(self, cls, topic) -> list:
        out = []
        for _k, v, _h in self.got[topic.name]:
            try:
                out.append(decode(cls, v))
            except SchemaError:
                pass
        return out

    def close(self) -> None:
        self.c.close()


class Run:
    """The roles of one test, the marker directory its jobs touch, and the cgroups its actuator made."""

    def __init__(self, broker, tmp_path: Path, host: str) -> None:
        self.settings = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
        ensure_topics(self.settings)
        self.tmp, self.host = tmp_path, host
        self.roles: list[RoleProcess] = []
        # the jobs' command touches a file here (a directory any job user may write, whoever runs it)
        self.marks = Path(tempfile.mkdtemp(prefix="pw-trust-"))
        os.chmod(self.marks, 0o1777)
        self.layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1) \
            if REAL else None
        trusted = tmp_path / "submitters"
        trusted.mkdir(mode=0o755)
        write_public(trusted / "alice.pub", KEY)
        self.trusted = trusted
        self.producer = make_producer(self.settings, partitioner=PARTITIONER)

    def command(self, job: str) -> tuple[str, ...]:
        return ("/bin/touch", str(self.marks / job))

    def ran(self, job: str) -> bool:
        return (self.marks / job).exists()

    def start(self, role: str, args: list[str], env: dict[str, str]) -> RoleProcess:
        r = RoleProcess(role, args, env={"PHASEWISE_BOOTSTRAP": self.settings.kafka.bootstrap,
                                         "PHASEWISE_HOST": self.host, **env},
                        log_path=self.tmp / f"{role}-{len(self.roles)}.log").start()
        self.roles.append(r)
        return r

    def actuator(self, env: dict[str, str]) -> RoleProcess:
        backend = ["--backend", "cgroup"] if REAL else ["--backend", "dry-run", "--cgroup-root",
                                                        str(self.tmp / "no-cgroups")]
        return self.start("actuate", backend, {
            **env, "PHASEWISE_DATA_DIR": str(self.tmp / "a"), "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(self.trusted),
            # (the process jail's opt-in to starting jobs, where this build has it; a warning where not)
            "PHASEWISE_ACTUATOR_START_JOBS": "true",
            **({"PHASEWISE_CGROUP_PREFIX": self.layout.prefix} if REAL else {})})

    def wait(self, pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for r in self.roles:
                assert r.alive(), f"{what}: {r.name} died:\n{r.log_tail(60)}"
            if pred():
                return
            time.sleep(0.2)
        raise TimeoutError(f"no {what} within {timeout_s:.0f} s:\n" + "\n".join(r.log_tail(30) for r in self.roles))

    def ready(self, port: int, metric: str) -> bool:
        try:
            return scrape(f"http://127.0.0.1:{port}/metrics").get(metric) == 1.0
        except OSError:
            return False

    def send(self, topic, key: str, value: bytes, headers=None) -> None:
        self.producer.produce(topic.name, key=key.encode(), value=value, headers=headers)
        assert self.producer.flush(10) == 0

    def close(self) -> None:
        for r in self.roles:
            r.stop()
        codes = {r.name: r.returncode() for r in self.roles}
        shutil.rmtree(self.marks, ignore_errors=True)
        if self.layout is not None:  # the jobs' cgroups (their command, a touch, has exited)
            for c in self.layout.containers():
                self.layout.remove(c)
            cs = self.layout.controller_root("cpuset") / self.layout.prefix
            for d in sorted(cs.glob("*"), reverse=True) if cs.exists() else []:
                if d.is_dir():
                    d.rmdir()
            if cs.exists():
                cs.rmdir()
            for c in self.layout.controllers():
                try:
                    self.layout.base(c).rmdir()
                except OSError:
                    pass
        assert all(code == 0 for code in codes.values()), (codes, [r.log_tail(30) for r in self.roles])


def started(act: Actuation) -> bool:
    return act.status == "applied" and ("started pid" in act.message or "would start" in act.message)


def place_actuations(run: Run, topics: Topics) -> dict[str, Actuation]:
    """This host's actuations of place decisions, by container (the weights that follow are left out)."""
    topics.drain()
    places = {d.id for d in topics.records(Decision, DECISIONS) if d.action == "place"}
    return {a.container: a for a in topics.records(Actuation, ACTUATIONS)
            if a.host == run.host and a.decision_id in places}


def test_a_forged_place_decision_starts_nothing_without_a_cluster_key(broker, tmp_path):
    run = Run(broker, tmp_path, f"forge-{uuid.uuid4().hex[:6]}")
    topics = Topics(run.settings, ACTUATIONS, DECISIONS)
    try:
        run.actuator({})
        tag = uuid.uuid4().hex[:6]

        def place(container: str, details: dict) -> Decision:
            return Decision(id=f"{container}-{uuid.uuid4().hex[:6]}", ts=time.time(), host=run.host,
                            container=container, action="place", policy="forged",
                            details={"cpuset": None, "device": [], **details})

        shell, victim, changed, good = (f"{x}-{tag}" for x in ("shell", "victim", "changed", "good"))
        signed = start(good, run.command(good), ts=time.time() - 1)
        other = start(changed, run.command(changed), ts=time.time() - 1)
        forged = {
            # the attack of the review: any command, as root, from one record
            shell: place(shell, {"command": list(run.command(shell))}),
            # a trusted job's signed fields, aimed at another container
            victim: place(victim, signed),
            # ... or a trusted job's with its command changed (the spec no longer has the signed digest)
            changed: place(changed, {**other, "spec": {**other["spec"], "command": list(run.command(shell))}}),
        }
        for d in forged.values():
            run.send(DECISIONS, run.host, encode(d))
        run.send(DECISIONS, run.host, encode(place(good, signed)))

        run.wait(lambda: set(forged) | {good} <= set(place_actuations(run, topics)), 60, "the four actuations")
        got = place_actuations(run, topics)
        assert "carries no job signature" in got[shell].message
        assert f"the container is not job '{good}''s" in got[victim].message
        assert "changed after it was submitted" in got[changed].message
        assert all(got[c].status == "rejected" for c in forged), got
        assert started(got[good]), got[good]
        if REAL:
            run.wait(lambda: run.ran(good), 30, "the signed job's command")
            assert not any(run.ran(c) for c in forged)
            assert not any(run.layout.exists(c) for c in forged)
    finally:
        topics.close()
        run.close()


def _jobs(run: Run, tag: str) -> dict[str, JobEvent]:
    """An unsigned job, one signed by a key nobody trusts, one signed by the trusted submitter."""
    jobs = {}
    for name, key in (("unsigned", None), ("stranger", STRANGER), ("trusted", KEY)):
        job = f"{name}-{tag}"
        jobs[name] = submitted(job, run.command(job), key=key, host=run.host, ts=time.time(),
                               requests=JobRequests(cpu_cores=0.25, mem_bytes=0.1 * GB))
    return jobs


def _check_the_chain(run: Run, topics: Topics, jobs: dict[str, JobEvent], ring: Keyring, policy: str) -> None:
    names = {ev.job for ev in jobs.values()}
    run.wait(lambda: names <= set(place_actuations(run, topics)), 90, "every job's place decision acted on")
    got = place_actuations(run, topics)
    assert "carries no job signature" in got[jobs["unsigned"].job].message
    assert "which is not trusted" in got[jobs["stranger"].job].message
    assert got[jobs["unsigned"].job].status == got[jobs["stranger"].job].status == "rejected"
    assert started(got[jobs["trusted"].job]), got[jobs["trusted"].job]
    # every place decision was made (by the agent named) and signed with the cluster key; none carries a command
    placed = [(k, v, h) for k, v, h in topics.got[DECISIONS.name] if b'"action":"place"' in v]
    decided = {}
    for k, v, h in placed:
        d = decode(Decision, v)
        if d.host == run.host and d.container in names:
            assert ring.verify(DECISIONS.name, k, v, h) is None, d
            decided[d.container] = d
    assert names <= set(decided) and {decided[n].policy for n in names} == {policy}
    assert all("command" not in decided[n].details for n in names)
    if REAL:
        run.wait(lambda: run.ran(jobs["trusted"].job), 30, "the trusted job's command")
        assert not run.ran(jobs["unsigned"].job) and not run.ran(jobs["stranger"].job)


def _key(tmp_path: Path) -> tuple[Path, Keyring]:
    f = tmp_path / "cluster.key"
    f.write_bytes(os.urandom(48).hex().encode())
    os.chmod(f, 0o600)
    return f, Keyring(f.read_bytes().strip())


def _sample(run: Run) -> bytes:
    return encode(HostSamples(host=run.host, ts=time.time(), interval_s=1.0, host_cpu_count=len(CPUS),
                              host_cpu_cores=0.0, host_mem_bytes=GB, host_mem_total_bytes=16 * GB,
                              gpus=(GpuSample(index=0, uuid="GPU-0", util=0.0, mem_used_bytes=0,
                                              mem_total_bytes=16 << 30),)))


def test_with_signing_on_only_a_trusted_submitter_s_job_starts_placed_after_admission(broker, tmp_path):
    """The priority agent admits (signed hints), the placement agent places (signed decisions)."""
    run = Run(broker, tmp_path, f"adm-{uuid.uuid4().hex[:6]}")
    key_file, ring = _key(tmp_path)
    topics = Topics(run.settings, ACTUATIONS, DECISIONS, DEAD_LETTERS)
    tag = uuid.uuid4().hex[:6]
    signed = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file)}
    wport, pport = free_port(), free_port()
    try:
        run.start("worker", ["--priorities", "--priority-launcher", "place", "--web-port", "0", "--worker-id",
                             f"adm-{tag}", "--data-dir", str(tmp_path / "w"), "--metrics-port", str(wport)],
                  {**signed, "PHASEWISE_PRIORITY_HOST_CPU_CORES": "4", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G"})
        run.start("place", ["--place-after-admission", "--local-nodes", f"s0={CPUS[0]}-{CPUS[-1]}", "--place-id",
                            f"adm-place-{tag}", "--data-dir", str(tmp_path / "p"), "--metrics-port", str(pport)],
                  {**signed, "PHASEWISE_PLACE_PREDICTION_WAIT_S": "0"})
        run.actuator(signed)
        run.wait(lambda: run.ready(wport, "phasewise_worker_ready") and run.ready(pport, "phasewise_place_ready"),
                 120, "worker and place ready")
        run.send(SAMPLES, run.host, _sample(run))
        jobs = _jobs(run, tag)
        for ev in jobs.values():
            run.send(JOB_EVENTS, ev.job, encode(ev))
        # a job-events writer without the cluster key: a started event naming another container, an admitted
        # hint for a job of its own; and a forged decision
        trusted = jobs["trusted"].job
        fake_start = encode(JobEvent(job=trusted, ts=time.time(), kind="started", host=run.host, container="victim"))
        run.send(JOB_EVENTS, trusted, fake_start)
        ghost = f"ghost-{tag}"
        run.send(JOB_EVENTS, ghost, encode(JobEvent(job=ghost, ts=time.time(), kind="admitted", host=run.host)))
        forged = encode(Decision(id=f"forged-{tag}", ts=time.time(), host=run.host, container=f"forged-{tag}",
                                 action="place", policy="forged", details=start(f"forged-{tag}", ("/bin/true",))))
        run.send(DECISIONS, run.host, forged)
        # ... and a prediction (horus signs its own)
        iv = Interval(mean=50.0, lo=40.0, hi=60.0)
        run.send(PREDICTIONS, trusted, encode(UtilisationPrediction(
            job=trusted, ts=time.time(), model_version=1, gpu_util=iv, gpu_mem_bytes=iv, cpu_cores=iv, mem_bytes=iv,
            coverage=0.8)))
        _check_the_chain(run, topics, jobs, ring, "horus")

        def letters() -> list[DeadLetter]:
            topics.drain()
            return topics.records(DeadLetter, DEAD_LETTERS)

        def reasons(topic) -> list[str]:
            return [dl.reason for dl in letters() if dl.source_topic == topic.name]

        run.wait(lambda: any(f"JobEvent started {trusted}" in r for r in reasons(JOB_EVENTS))
                 and any("admitted" in r for r in reasons(JOB_EVENTS))
                 and any(f"forged-{tag}" in r for r in reasons(DECISIONS))
                 and any(f"prediction for {trusted} refused" in r for r in reasons(PREDICTIONS)), 60,
                 "the forged records' dead letters")
        jr = reasons(JOB_EVENTS)
        assert any(f"JobEvent started {trusted}: not signed by the cluster key (unsigned" in r for r in jr), jr
        assert any(f"JobEvent admitted {ghost} refused: unsigned" in r for r in jr), jr
        assert any("refused: unsigned" in r for r in reasons(DECISIONS))
        assert any(f"prediction for {trusted} refused: unsigned" in r for r in reasons(PREDICTIONS))
        # the hints the priority agent published were signed, and the placement agent took them
        hints = [(k, v, h) for k, v, h in _read(run.settings, JOB_EVENTS) if b'"kind":"admitted"' in v
                 and json.loads(v)["host"] == run.host and json.loads(v)["job"] != ghost]
        assert len(hints) == 3 and all(ring.verify(JOB_EVENTS.name, k, v, h) is None for k, v, h in hints)
        assert all(a.container != "victim" for a in topics.records(Actuation, ACTUATIONS))
    finally:
        topics.close()
        run.close()


def test_with_signing_on_the_priority_agent_s_own_place_decisions(broker, tmp_path):
    """priority_launcher=self: the worker's own place decisions carry the signed job; the actuator verifies it."""
    run = Run(broker, tmp_path, f"self-{uuid.uuid4().hex[:6]}")
    key_file, ring = _key(tmp_path)
    topics = Topics(run.settings, ACTUATIONS, DECISIONS)
    tag = uuid.uuid4().hex[:6]
    signed = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file)}
    wport = free_port()
    try:
        run.start("worker", ["--priorities", "--web-port", "0", "--worker-id", f"self-{tag}", "--data-dir",
                             str(tmp_path / "w"), "--metrics-port", str(wport)],
                  {**signed, "PHASEWISE_PRIORITY_HOST_CPU_CORES": "4", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G"})
        run.actuator(signed)
        run.wait(lambda: run.ready(wport, "phasewise_worker_ready"), 120, "worker ready")
        jobs = _jobs(run, tag)
        for ev in jobs.values():
            run.send(JOB_EVENTS, ev.job, encode(ev))
        _check_the_chain(run, topics, jobs, ring, "priority")
    finally:
        topics.close()
        run.close()


def test_a_worker_that_trusts_submitters_lets_a_stranger_s_job_book_nothing_and_preempt_nobody(broker, tmp_path):
    """With job_trusted_submitters on the priority agent, a job-events writer's important job is dead-lettered:
    the running job it would have preempted is neither frozen nor stopped."""
    run = Run(broker, tmp_path, f"pre-{uuid.uuid4().hex[:6]}")
    key_file, _ring = _key(tmp_path)
    topics = Topics(run.settings, ACTUATIONS, DECISIONS, DEAD_LETTERS)
    tag = uuid.uuid4().hex[:6]
    signed = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file)}
    wport = free_port()
    try:
        run.start("worker", ["--priorities", "--web-port", "0", "--worker-id", f"pre-{tag}", "--data-dir",
                             str(tmp_path / "w"), "--metrics-port", str(wport)],
                  {**signed, "PHASEWISE_PRIORITY_HOST_CPU_CORES": "1", "PHASEWISE_PRIORITY_HOST_MEM_BYTES": "8G",
                   "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(run.trusted)})
        run.actuator(signed)
        run.wait(lambda: run.ready(wport, "phasewise_worker_ready"), 120, "worker ready")
        mine, theirs, unsigned = f"mine-{tag}", f"theirs-{tag}", f"unsigned-{tag}"
        run.send(JOB_EVENTS, mine, encode(submitted(mine, run.command(mine), host=run.host,
                                                    requests=JobRequests(cpu_cores=1.0, mem_bytes=0.1 * GB))))
        run.wait(lambda: started(place_actuations(run, topics).get(mine, Actuation(
            decision_id="-", ts=0, host="-", container="-", status="failed", backend="-"))), 60, "my job started")
        # the whole host, at priority 9 (short, so the policy would freeze mine): a stranger's key, and none
        for job, key in ((theirs, STRANGER), (unsigned, None)):
            run.send(JOB_EVENTS, job, encode(submitted(job, run.command(job), host=run.host, key=key, priority=9,
                                                       expected_s=10, requests=JobRequests(cpu_cores=1.0,
                                                                                           mem_bytes=0.1 * GB))))

        def reasons() -> dict[str, str]:
            topics.drain()
            return {dl.key: dl.reason for dl in topics.records(DeadLetter, DEAD_LETTERS)
                    if dl.source_topic == JOB_EVENTS.name}

        run.wait(lambda: {theirs, unsigned} <= set(reasons()), 60, "the two dead letters")
        why = reasons()
        assert "which is not trusted" in why[theirs] and "not signed by a submitter" in why[unsigned], why
        ds = [d for d in topics.records(Decision, DECISIONS) if d.host == run.host]
        assert [(d.action, d.container) for d in ds] == [("place", mine), ("weight", mine)], ds
        if REAL:
            assert run.ran(mine) and not run.ran(theirs) and not run.ran(unsigned)
    finally:
        topics.close()
        run.close()


def _read(settings: Settings, topic) -> list[tuple[bytes | None, bytes, list]]:
    t = Topics(settings, topic)
    try:
        for _ in range(10):
            t.drain()
        return t.got[topic.name]
    finally:
        t.close()
