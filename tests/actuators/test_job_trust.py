"""Who may start a job: the actuator's checks of a place decision's submitter signature, pure and through handle().

Every field the submitter signed is tampered with in turn; an untrusted or missing signature, a container that is
not the job's, a spec too old or from the future, a command off the allowlist are refused with the reason; the
command started is the signed spec's, never one the decision names itself. Rotation: a key added to the trusted
directory is taken without a restart, a removed one is refused.
"""

from __future__ import annotations

import os
import uuid

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import DryRunBackend
from phasewise.actuators.commands import StartJob
from phasewise.actuators.job_trust import VerifiedJob, verify_start
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.actuators.safety import Planned, Rejected, plan
from phasewise.kit.job_signing import SubmitterKeys, key_id, spec_digest, spec_of
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from tests.job_keys import KEY, STRANGER, TRUSTED, start, write_public

NOW = 1_700_000_000.0
S = Settings().replace(host="h1")
CMD = ("/usr/bin/python3", "train.py", "--epochs", "3")


def place(job: str = "j1", *, container: str | None = None, resume: bool = False, **changes) -> Decision:
    details = {**start(job, CMD, ts=NOW - 10), "cpuset": None, "device": [], "resume": resume}
    details.update(changes)
    return Decision(id=uuid.uuid4().hex, ts=NOW, host="h1", container=container or job, action="place",
                    policy="test", details=details)


def verify(d: Decision, *, submitters=TRUSTED, settings=S, owned_by=None) -> VerifiedJob | str:
    return verify_start(d, submitters=submitters, settings=settings, now=NOW, owned_by=owned_by)


def test_a_signed_job_verifies_and_its_command_is_the_signed_spec_s():
    got = verify(place())
    assert isinstance(got, VerifiedJob), got
    assert (got.job, got.argv, got.key_id) == ("j1", CMD, key_id(KEY.public_key()))
    # a command the decision names itself (an agent's, an attacker's) is never what runs
    got = verify(place(command=["/bin/sh", "-c", "id > /tmp/pwned"]))
    assert got.argv == CMD
    p = plan(place(command=["/bin/sh"]), exists=False, usage_mem_bytes=None, host_cores=2, settings=S,
             host_cpus=frozenset({0, 1}), now=NOW, submitters=TRUSTED)
    assert isinstance(p, Planned) and p.command == StartJob("j1", "0-1", CMD, (), job="j1")


def _tampered(field: str):
    d = place()
    x = dict(d.details)
    if field == "spec":
        x["spec"] = {**x["spec"], "command": ["/bin/sh", "-c", "evil"]}
        x["spec_digest"] = spec_digest(spec_of(x["spec"]))  # a consistent digest: the signature still fails
    else:
        x[field] = {"job": "j2", "job_ts": NOW - 9, "workload": "inference", "priority": 9,
                    "job_signature": start("other", CMD, ts=NOW - 10)["job_signature"]}[field]
    container = "j2" if field == "job" else d.container
    return Decision(id=d.id, ts=d.ts, host=d.host, container=container, action="place", policy="test", details=x)


@pytest.mark.parametrize("field", ["job", "job_ts", "workload", "priority", "spec", "job_signature"])
def test_each_signed_field_changed_breaks_the_signature(field):
    why = verify(_tampered(field))
    assert isinstance(why, str) and "wrong job signature" in why, why


REFUSALS = [
    ("nobody trusted", dict(submitters=None), {}, "trusts no job submitter (job_trusted_submitters is empty)"),
    ("an empty key set", dict(submitters=SubmitterKeys.of([])), {}, "trusts no job submitter"),
    ("an unsigned job", {}, dict(job_signature=None), "carries no job signature"),
    ("an untrusted submitter", {}, dict(job_signature=start("j1", CMD, ts=NOW - 10, key=STRANGER)["job_signature"]),
     "which is not trusted"),
    ("a malformed signature", {}, dict(job_signature="ed25519:xx"), "malformed job signature"),
    ("another scheme", {}, dict(job_signature="rsa:00000000:AAAA"), "unknown scheme"),
    ("a spec changed, its digest not", {}, dict(spec={**start("j1", CMD, ts=NOW - 10)["spec"], "command": ["/bin/sh"]}),
     "changed after it was submitted"),
    ("a spec that is not one", {}, dict(spec={"model": 3}), "details.spec is not a job spec"),
    ("a time that is no number", {}, dict(job_ts="yesterday"), "details.job_ts is missing"),
    ("a boolean priority", {}, dict(priority=True), "details.priority is missing"),
    ("no job id", {}, dict(job=None), "details.job is missing"),
]


@pytest.mark.parametrize("name, kw, changes, why", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_say_why(name, kw, changes, why):
    d = place()
    d.details.update(changes)
    got = verify(d, **kw)
    assert isinstance(got, str) and why in got, got


def test_the_container_must_be_the_job_s():
    # a signed job aimed at another container (a victim's) is refused
    why = verify(place("j1", container="victim"))
    assert "the container is not job 'j1''s" in why
    # a resume into a container not named after the job only where the actuator knows it to be the job's
    assert "is not job" in verify(place("j1", container="j1-ctr", resume=True))
    assert "is not job" in verify(place("j1", container="j1-ctr", resume=True), owned_by="someone-else")
    assert isinstance(verify(place("j1", container="j1-ctr", resume=True), owned_by="j1"), VerifiedJob)
    assert "is not job" in verify(place("j1", container="j1-ctr", resume=False), owned_by="j1")


def test_the_spec_s_age_and_clock():
    old = place()
    old.details.update(start("j1", CMD, ts=NOW - 8 * 86400))
    assert "more than job_spec_max_age_s (604800 s): submit it again" in verify(old)
    assert isinstance(verify(old, settings=S.replace(job_spec_max_age_s=0)), VerifiedJob)  # 0: no limit
    ahead = place()
    ahead.details.update(start("j1", CMD, ts=NOW + 3600))
    assert "ahead of this host's clock" in verify(ahead)


def test_a_job_without_a_command_is_its_submitter_s_to_start():
    d = place()
    d.details.update(start("j1", (), ts=NOW - 10))
    assert "names no command" in verify(d) and "whoever submitted it starts it" in verify(d)
    d.details["resume"] = True
    assert verify(d).endswith("again, from its checkpoint")


def test_the_operator_s_allowlist_of_executables():
    s = S.replace(job_allowed_commands="/usr/bin/python3,/opt/venv/bin/python")
    assert isinstance(verify(place(), settings=s), VerifiedJob)
    d = place()
    d.details.update(start("j1", ("python3", "train.py"), ts=NOW - 10))  # by name: not the allowed path
    assert "command 'python3' is not in job_allowed_commands (/usr/bin/python3, /opt/venv/bin/python)" in verify(
        d, settings=s)


def test_an_unreadable_trusted_set_refuses_every_job(tmp_path):
    d = tmp_path / "trusted"
    d.mkdir(mode=0o755)
    write_public(d / "alice.pub")
    keys = SubmitterKeys.load(str(d))
    assert isinstance(verify(place(), submitters=keys), VerifiedJob)
    (d / "mallory.pub").write_text("not a key")
    os.chmod(d / "mallory.pub", 0o644)
    assert keys.refresh() and keys.error is not None
    why = verify(place(), submitters=keys)
    assert "the trusted submitters cannot be read" in why and "mallory.pub is not a public key" in why


# --------------------------------------------------------------------------- through the actuator


def actuator(recorder, submitters, **settings):
    backend = DryRunBackend(exists=lambda c: False)  # (no container exists before its job starts)
    settings.setdefault("actuator_start_jobs", True)
    a = Actuator(Settings().replace(host="h1", **settings), backend, Ledger(":memory:"), recorder,
                 metrics=ActuatorMetrics(CollectorRegistry()), host_cores=2.0, clock=lambda: NOW,
                 submitters=submitters)
    return a, backend


def test_the_actuator_starts_only_signed_jobs_and_reads_a_rotated_key_set_again(recorder, tmp_path):
    trusted = tmp_path / "submitters"
    trusted.mkdir(mode=0o755)
    write_public(trusted / "old.pub", KEY)
    a, backend = actuator(recorder, SubmitterKeys.load(str(trusted)))
    # an agent's (or an attacker's) command in an unsigned decision: nothing started
    forged = Decision(id="forged", ts=NOW, host="h1", container="evil", action="place", policy="forged",
                      details={"command": ["/bin/sh", "-c", "id"], "cpuset": None, "device": []})
    act = a.handle(encode(forged), b"h1", 0, 0)
    assert act.status == "rejected" and "carries no job signature" in act.message and backend.commands == []
    act = a.handle(encode(place("j1")), b"h1", 0, 1)
    assert act.status == "applied" and [c.argv for c in backend.commands] == [CMD]
    # rotation: the new key is added to the directory, no restart: its jobs start
    new_key = STRANGER
    d = place("j2")
    d.details.update(start("j2", CMD, ts=NOW - 10, key=new_key))
    assert "not trusted" in a.handle(encode(d), b"h1", 0, 2).message
    write_public(trusted / "new.pub", new_key)
    d2 = Decision(**{**{f: getattr(d, f) for f in ("ts", "host", "container", "action", "policy", "details")},
                     "id": "j2-again"})
    assert a.handle(encode(d2), b"h1", 0, 3).status == "applied"
    # ... and the old one removed: its jobs are refused
    (trusted / "old.pub").unlink()
    act = a.handle(encode(place("j3")), b"h1", 0, 4)
    assert act.status == "rejected" and "not trusted" in act.message
    assert [c.container for c in backend.commands] == ["j1", "j2"]


def test_rejected_unless_the_plan_verifies(recorder):
    a, backend = actuator(recorder, None)
    act = a.handle(encode(place("j1")), b"h1", 0, 0)
    assert act.status == "rejected" and "job_trusted_submitters is empty" in act.message and not backend.commands
    assert isinstance(plan(place(), exists=False, usage_mem_bytes=None, host_cores=2, settings=S,
                           host_cpus=frozenset({0}), now=NOW), Rejected)


def test_a_started_job_s_limits_are_its_signed_requests():
    from phasewise.kit.records import JobRequests

    details = {**start("j2", CMD, ts=NOW - 10, requests=JobRequests(cpu_cores=1.5, mem_bytes=2.0**30)),
               "cpuset": None, "device": []}
    d = Decision(id="r", ts=NOW, host="h1", container="j2", action="place", policy="test", details=details)
    p = plan(d, exists=False, usage_mem_bytes=None, host_cores=2, settings=S, host_cpus=frozenset({0, 1}), now=NOW,
             submitters=TRUSTED)
    assert isinstance(p, Planned)
    assert (p.command.cpu_cores, p.command.mem_bytes) == (1.5, 2**30)
    # a request the decision states itself changes nothing: only the signed spec counts
    d2 = Decision(id="r2", ts=NOW, host="h1", container="j2", action="place", policy="test",
                  details={**details, "requests": {"cpu_cores": 64}})
    p2 = plan(d2, exists=False, usage_mem_bytes=None, host_cores=2, settings=S, host_cpus=frozenset({0, 1}),
              now=NOW, submitters=TRUSTED)
    assert p2.command.cpu_cores == 1.5
