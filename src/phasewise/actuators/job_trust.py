"""Whether a decision may start a job's command on this host: the submitter's signature and the rules around it.

Pure: the caller passes the trusted keys (``job_trusted_submitters``), the
time and the settings, and gets the :class:`VerifiedJob` (whose signed spec's
command is the only argv the actuator may run) or the reason it is refused.
The six rules, in order: docs/security.md, "Who may start a job".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from phasewise.kit.job_signing import SubmitterKeys, spec_digest, spec_of
from phasewise.kit.records import Decision, JobSpec, brief
from phasewise.kit.settings import Settings

__all__ = ["VerifiedJob", "verify_start"]


@dataclass(frozen=True, slots=True)
class VerifiedJob:
    """A job whose start a trusted submitter signed: its id, spec and the argv to run."""

    job: str
    spec: JobSpec
    argv: tuple[str, ...]
    #: the submitter key that signed it
    key_id: str


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def verify_start(decision: Decision, *, submitters: SubmitterKeys | None, settings: Settings, now: float,
                 owned_by: str | None = None, pod: bool = False) -> VerifiedJob | str:
    """The job *decision* (a ``place``) may start here, or why it may not (one line).

    *owned_by*: the job the actuator knows the decision's container to belong
    to, if any (a resume into a container not named after its job needs it).
    *pod*: the job runs as a pod (Kubernetes): its spec's command is not run here and may be empty.
    """
    c = decision.container
    d = decision.details if isinstance(decision.details, dict) else {}
    if submitters is None or (not submitters.keys and submitters.error is None):
        return (f"place decision for {c!r}: this actuator trusts no job submitter (job_trusted_submitters is "
                f"empty): it starts no job")
    job, ts, workload, priority = d.get("job"), d.get("job_ts"), d.get("workload"), d.get("priority")
    raw_spec, digest, signature = d.get("spec"), d.get("spec_digest"), d.get("job_signature")
    if signature is None:
        return (f"place decision for {c!r} carries no job signature: its job was submitted unsigned (phasewise "
                f"submit --key), or the decision was not made from a submitted job; nothing is started")
    missing = [name for name, ok in (("job", isinstance(job, str) and job), ("job_ts", _number(ts)),
                                     ("workload", isinstance(workload, str)),
                                     ("priority", isinstance(priority, int) and not isinstance(priority, bool)),
                                     ("spec", isinstance(raw_spec, dict)), ("spec_digest", isinstance(digest, str)),
                                     ("job_signature", isinstance(signature, str))) if not ok]
    if missing:
        return f"place decision for {c!r}: details.{missing[0]} is missing or of the wrong type; nothing is started"
    try:
        spec = spec_of(raw_spec)
    except ValueError as e:
        return f"place decision for {c!r}: details.spec is not a job spec: {brief(str(e), 200)}"
    if spec_digest(spec) != digest:
        return (f"place decision for {c!r}: the spec does not have the digest details.spec_digest "
                f"{brief(digest, 20)}: it was changed after it was submitted")
    why = submitters.verify_digest(job, ts, workload, priority, digest, signature)
    if why is not None:
        return f"place decision for {c!r} (job {brief(job, 80)}): {why}"
    if c != job and not (d.get("resume") is True and owned_by == job):
        return (f"place decision for {c!r}: the container is not job {brief(job, 80)}'s (a job starts in a "
                f"container named after it, or resumes in one this actuator knows to be its own)")
    a, j = settings.actuator, settings.jobs
    age = now - ts
    if j.spec_max_age_s and age > j.spec_max_age_s:
        return (f"job {job!r} was submitted {age:.0f} s ago, more than job_spec_max_age_s "
                f"({j.spec_max_age_s:g} s): submit it again to start it")
    if a.decision_max_future_s and -age > a.decision_max_future_s:
        return (f"job {job!r} is stamped {-age:.0f} s ahead of this host's clock, more than "
                f"decision_max_future_s ({a.decision_max_future_s:g} s); nothing is started")
    argv = spec.command
    if pod:  # the kubelet runs the pod's own containers: the command and its allowlist are not this actuator's
        return VerifiedJob(job, spec, tuple(argv), signature.split(":")[1])
    if not argv:
        return (f"place decision for {c!r} names no command (its job was submitted without one): phasewise "
                f"starts no process for it; whoever submitted it starts it"
                + (" again, from its checkpoint" if d.get("resume") is True else ""))
    if not all(x and "\0" not in x for x in argv):
        return f"place decision for {c!r}: the spec's command holds an empty argument or a NUL byte"
    allowed = j.allowed()
    if allowed and argv[0] not in allowed:
        return (f"job {job!r}: command {brief(argv[0], 120)} is not in job_allowed_commands "
                f"({', '.join(allowed)}); nothing is started")
    return VerifiedJob(job, spec, tuple(argv), signature.split(":")[1])
