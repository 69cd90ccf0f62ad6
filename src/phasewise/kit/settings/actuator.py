"""The actuator's settings: its backend, clamps, retries, ledger, and how it starts jobs.

docs/configuration.md lists them; docs/security.md says what a started job may do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from phasewise.kit.settings.spec import (
    ENV_PREFIX,
    Group,
    SettingsError,
    above,
    at_least,
    declared,
    in_range,
    non_empty,
    parse_size,
    setting,
)

__all__ = ["BACKENDS", "JOB_ENV_PER_JOB", "ActuatorSettings", "parse_job_env"]

BACKENDS = ("cgroup", "dry-run", "kubernetes")


_ACCOUNT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def account_name(v: str) -> None:
    """A user or group name (``nobody``) or a numeric id (``65534``), or empty."""
    if v and not _ACCOUNT.match(v):
        raise ValueError(f"{v!r} is not a user or group name or a numeric id")


def user_name(v: str) -> None:
    non_empty(v)
    account_name(v)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: what the actuator sets per started job; ``job_env`` cannot set them
JOB_ENV_PER_JOB = ("HOME", "TMPDIR", "PHASEWISE_JOB", "CUDA_VISIBLE_DEVICES")


def parse_job_env(text: str) -> tuple[tuple[str, str], ...]:
    """``job_env``: ``NAME=VALUE`` pairs separated by ``;`` or new lines (each trimmed), in order.

    Refused: a name set per job (:data:`JOB_ENV_PER_JOB`), a name given twice, and a
    ``PHASEWISE_*`` setting that is a secret or names a file (a key, a password): a job
    never gets the actuator's credentials.

    >>> parse_job_env("OMP_NUM_THREADS=1; PATH=/opt/venv/bin:/usr/bin")
    (('OMP_NUM_THREADS', '1'), ('PATH', '/opt/venv/bin:/usr/bin'))
    >>> parse_job_env("PHASEWISE_KAFKA_SASL_PASSWORD=x")
    Traceback (most recent call last):
    ...
    ValueError: PHASEWISE_KAFKA_SASL_PASSWORD is a secret (or a file's path) of phasewise: a job never gets it
    """
    out: list[tuple[str, str]] = []
    for part in re.split(r"[;\n]", text):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not _ENV_NAME.match(name):
            raise ValueError(f"{part!r} is not NAME=VALUE (e.g. OMP_NUM_THREADS=1)")
        if "\0" in value:
            raise ValueError(f"{name}: a value cannot hold a NUL byte")
        if name in JOB_ENV_PER_JOB:
            raise ValueError(f"{name} is set per job by the actuator; job_env cannot set it")
        if name.startswith(ENV_PREFIX):
            spec = declared(name[len(ENV_PREFIX):].lower())
            if spec is not None and (spec.secret or spec.name.endswith("_file")):
                raise ValueError(f"{name} is a secret (or a file's path) of phasewise: a job never gets it")
        if any(n == name for n, _ in out):
            raise ValueError(f"{name} is given twice")
        out.append((name, value.strip()))
    return tuple(out)


def _job_env(v: str) -> None:
    parse_job_env(v)


@dataclass(frozen=True, slots=True)
class ActuatorSettings(Group):
    """The actuator (``phasewise actuate``): its backend, its clamps, its retries and its ledger.

    ``mem_margin_bytes`` is the actuator's clamp (a memory limit stays above the
    current usage + it); the worker's safety rules read the same margin for
    their peak floor, so the worker never decides a limit the actuator would
    raise again.
    """

    backend: str = setting("cgroup", choices=BACKENDS, flag="--backend",
                           help="cgroup: write cgroup files; dry-run: log and report only; "
                                "kubernetes: the pod resize API (docs/kubernetes.md)")
    kube_api: str = setting("", flag="--kube-api",
                            help="Kubernetes API server URL; empty: in-cluster (service account token + CA)")
    #: update-mode in-place-or-recreate: a resize still Deferred / in progress this long is given up and
    #: the pod evicted (VPA's InPlaceOrRecreate: 5 min, 1 h); watched resizes are read again this often
    kube_resize_deferred_timeout_s: float = setting(300.0, check=above(0),
                                                    help="in-place-or-recreate: evict a pod whose resize stays "
                                                         "Deferred this many seconds")
    kube_resize_in_progress_timeout_s: float = setting(3600.0, check=above(0),
                                                       help="in-place-or-recreate: evict a pod whose resize stays "
                                                            "in progress this many seconds")
    kube_resize_check_s: float = setting(30.0, check=above(0),
                                         help="in-place-or-recreate: seconds between reads of a pod whose resize "
                                              "is pending")
    cpu_floor_cores: float = setting(0.05, check=above(0), flag="--cpu-floor",
                                     help="never set a CPU limit below this many cores")
    mem_margin_bytes: int = setting(64 * 2**20, parse=parse_size, check=at_least(0),
                                    flag="--mem-margin",
                                    help="memory limit >= current usage + this, e.g. 64Mi")
    mem_floor_bytes: int = setting(64 * 2**20, parse=parse_size, check=at_least(0),
                                   flag="--mem-floor",
                                   help="never set a memory limit below this, e.g. 64Mi")
    #: temporary backend errors: retries after the first attempt, first backoff (doubles)
    apply_retries: int = setting(3, check=at_least(0),
                                 help="retries after a temporary backend error")
    apply_retry_backoff_s: float = setting(0.2, check=at_least(0),
                                           help="first retry delay, s (doubles)")
    #: ledger of applied decision ids: keep entries this long (must exceed the
    #: decisions topic's retention) and at most this many
    ledger_max_age_days: float = setting(30.0, check=above(0),
                                         help="days applied decision ids are kept")
    ledger_max_rows: int = setting(100_000, check=at_least(1),
                                   help="applied decision ids kept at most")
    #: host: read only the decisions partition this host's key maps to (murmur2, as the worker's
    #: producer); all: every partition, skipping other hosts' decisions
    read_partitions: str = setting("host", choices=("host", "all"), name="actuator_read_partitions",
                                   help="host: read only the decisions partition of this host's key "
                                        "(murmur2); all: every partition")
    #: a decision whose event time is older than this (by the actuator's clock) is refused: a
    #: replayed or long-delayed decision must not set limits the worker no longer stands by
    decision_max_age_s: float = setting(600.0, check=at_least(0),
                                        help="refuse decisions older than this many seconds (0 = any age)")
    #: ... or stamped further than this in the future (a clock that runs ahead, or a forged time)
    decision_max_future_s: float = setting(300.0, check=at_least(0),
                                           help="refuse decisions stamped more than this many seconds ahead "
                                                "of the actuator's clock")
    #: a terminate decision: SIGTERM, then SIGKILL to what is left after the grace (the decision's
    #: ``details.grace_s``, else this), never longer than the cap (the actuator waits it out)
    terminate_grace_s: float = setting(10.0, check=at_least(0),
                                       help="terminate: seconds between SIGTERM and SIGKILL when the decision "
                                            "names none")
    terminate_grace_max_s: float = setting(30.0, check=at_least(0),
                                           help="terminate: the longest grace the actuator waits (it handles "
                                                "this host's next decisions after it)")
    #: a weight decision's CPU weight (cgroup v2 cpu.weight units) is held in [min, max]: the floor
    #: keeps the least weighted job progressing (it gets >= min / the sum of its siblings' weights of
    #: a contended CPU), the cap bounds what one container takes from its managed siblings
    cpu_weight_min: int = setting(10, check=in_range(1, 10_000),
                                  help="weight: never set a CPU weight (cpu.weight units, 1-10000) below this")
    cpu_weight_max: int = setting(10_000, check=in_range(1, 10_000),
                                  help="weight: never set a CPU weight (cpu.weight units, 1-10000) above this")
    #: starting processes is opt-in: off, a place decision is rejected (docs/security.md, "What a started
    #: job can do"); on, a job runs as job_user/job_group with an environment built from scratch
    start_jobs: bool = setting(False, name="actuator_start_jobs", flag="--start-jobs",
                               help="start the commands of placed jobs (place decisions); off: they are rejected")
    #: a job that ended is over (its id cannot be placed again, only resumed): its cgroups go with it, once
    #: its end is published; one a checkpoint stop terminated keeps them (the priority agent resumes it there)
    remove_ended_jobs: bool = setting(True, name="actuator_remove_ended_jobs",
                                      help="remove a started job's cgroups once it ended (a job a checkpoint "
                                           "stop terminated keeps them: it is resumed there)")
    job_user: str = setting("nobody", check=user_name, flag="--job-user",
                            help="the user (name or uid) started jobs run as; root is refused unless "
                                 "job_allow_root")
    job_group: str = setting("", check=account_name, flag="--job-group",
                             help="the group (name or gid) started jobs run as; empty: job_user's primary group")
    job_allow_root: bool = setting(False, help="let job_user / job_group be root (uid or gid 0)")
    #: a scale decision never makes a service's replicas more than this (nor more than its signed spec's
    #: max_replicas): each is a process of the submitter's command (docs/priorities.md)
    max_replicas: int = setting(8, check=in_range(1, 64), name="actuator_max_replicas",
                                help="scale: replicas of one service this actuator runs at most")
    job_env: str = setting("", check=_job_env,
                           help="NAME=VALUE;... added to a started job's environment (PATH, LANG, "
                                "OMP_NUM_THREADS, ...); nothing else of the actuator's is passed on")

    def _rules(self) -> None:
        if self.cpu_weight_min > self.cpu_weight_max:
            raise SettingsError("cpu_weight_min", f"must be <= cpu_weight_max ({self.cpu_weight_max}), "
                                f"got {self.cpu_weight_min}")
