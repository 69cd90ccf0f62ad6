"""Who is trusted: the HMAC key that signs decisions and model snapshots, the submitters whose jobs start.

docs/configuration.md lists the settings; docs/security.md is the design they configure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.settings.spec import Group, at_least, setting

__all__ = ["JobSettings", "SigningSettings"]

@dataclass(frozen=True, slots=True)
class SigningSettings(Group):
    """HMAC-SHA256 signatures on decisions and model snapshots (``docs/security.md``).

    With a key file, the worker signs what it publishes and the actuator and the
    snapshot follower refuse records that are unsigned or wrongly signed; without
    one, nothing is signed or checked. A key file holds at least 32 bytes of secret.
    """

    PREFIX: ClassVar[str] = "signing_"

    key_file: str = setting("", help="file holding the cluster's HMAC key (empty = no signing)")
    previous_key_file: str = setting("", help="the key before the last rotation, still accepted "
                                              "until signing_previous_key_until")
    previous_key_until: float = setting(0.0, check=at_least(0),
                                        help="Unix time until which the previous key is accepted")


def absolute_paths(v: str) -> None:
    """A comma list of absolute paths (or empty)."""
    for x in (p.strip() for p in v.split(",")):
        if x and not x.startswith("/"):
            raise ValueError(f"{x!r} is not an absolute path (an executable is named by its absolute path)")


@dataclass(frozen=True, slots=True)
class JobSettings(Group):
    """Who may have a job's command started (``docs/security.md``, "Who may start a job").

    ``phasewise submit`` signs a job with the submitter's Ed25519 key; an
    actuator starts a job's command only when a key of ``job_trusted_submitters``
    signed it, the spec is younger than ``job_spec_max_age_s`` and, with an
    allowlist, its executable is on it (:mod:`phasewise.kit.job_signing`). The
    agents (``worker --priorities``, ``place``) given the same keys take no
    other job.
    """

    PREFIX: ClassVar[str] = "job_"

    submitter_key_file: str = setting("", flag="--key",
                                      help="the submitter's Ed25519 private key phasewise submit signs jobs with "
                                           "(make one with phasewise keys submitter PATH); empty = publish unsigned "
                                           "(no actuator starts an unsigned job)")
    trusted_submitters: str = setting("", help="public keys whose signed jobs an actuator starts (and, set for "
                                               "worker --priorities and place, the only jobs they take): files "
                                               "and/or directories of *.pub, comma-separated; empty = an actuator "
                                               "starts no job, the agents take every job")
    spec_max_age_s: float = setting(7 * 86400.0, check=at_least(0),
                                    help="an actuator refuses to start a job submitted longer ago than this "
                                         "(0 = no limit)")
    start_timeout_s: float = setting(300.0, check=at_least(0),
                                     help="a placed job no actuator reports started within this many seconds of "
                                          "its place decision (or, for worker --priorities placing itself, its "
                                          "admission) is lost: its booking is released, with a lost job event, a "
                                          "dead letter and phasewise_*_jobs_lost_total (0 = never)")
    allowed_commands: str = setting("", check=absolute_paths,
                                    help="executables (absolute paths, comma-separated) a started job's command "
                                         "may name first; empty = any command a trusted submitter signed")

    def allowed(self) -> tuple[str, ...]:
        """``allowed_commands`` as a tuple (empty: no allowlist)."""
        return tuple(x.strip() for x in self.allowed_commands.split(",") if x.strip())
