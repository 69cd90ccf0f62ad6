"""One frozen settings object per process, read from ``PHASEWISE_*`` and flags.

The environment is read only here, at the edge (:meth:`Settings.from_env`);
everything else receives a :class:`Settings`. Flags override the environment,
which overrides the defaults. Every process prints its settings at start-up.

The settings come in frozen groups, one per role or concern
(:class:`KafkaSettings`, :class:`CgroupSettings`, :class:`ProducerSettings`,
:class:`WorkerSettings`, :class:`VpaSettings`, :class:`PhaseSettings`,
:class:`SafetySettings`, :class:`ActuatorSettings`), held by :class:`Settings`
next to the few every role reads (host, log level, data directory, metrics
port). Code reads a setting through its group (``settings.vpa.time_scale``);
users name it flat (``vpa_time_scale``, ``PHASEWISE_VPA_TIME_SCALE``): a group's
``PREFIX`` + the field's name, or the name the field declares. Each group
checks itself when made: every field, then the rules between its fields.

Each field declares, next to itself (:func:`setting`), its default, how a text
becomes its value (``parse``), which values it takes (``check``, ``choices``),
its flag and its help. The environment (:meth:`Settings.from_env`), the flags
(:func:`arg_type`, ``choices``) and direct construction all go through that one
declaration, so ``64Mi`` or ``nan`` is taken or refused the same way wherever it
comes from, and code that needs a default reads it (:meth:`Settings.default`).
A refused value raises :class:`SettingsError`, which names the setting as the
user gave it (``PHASEWISE_INTERVAL_S``, ``--interval``) and why.

Not pydantic-settings: keeping today's flat variable names for nested groups
would take a custom source or an alias per field (its nested form is
``PHASEWISE_VPA__TIME_SCALE``); its parsing differs from ours (``nan``, ``inf``
and ``t``/``y`` are taken as numbers and booleans unless each field says
otherwise; sizes such as ``64Mi`` need a validator anyway); its errors are
multi-line and would be rewritten into the one-line form; the flags stay
argparse; and every role, the host agent included, would install pydantic and
its compiled core for what is here a few dozen lines of layering.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import numbers
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from phasewise.kit.statedir import default_data_dir

__all__ = [
    "BACKENDS",
    "GROUPS",
    "LIMITED_FEATURES",
    "LOG_LEVELS",
    "PHASE_FEATURES",
    "PHASE_STATISTICS",
    "POLICIES",
    "SPECS",
    "VPA_UPDATE_MODES",
    "ActuatorSettings",
    "PrioritySettings",
    "TargetsSettings",
    "CgroupSettings",
    "IntakeSettings",
    "JobSettings",
    "KAFKA_SASL_MECHANISMS",
    "KAFKA_SECURITY_PROTOCOLS",
    "KafkaSettings",
    "PhaseSettings",
    "ProducerSettings",
    "SafetySettings",
    "Settings",
    "SettingsError",
    "SigningSettings",
    "Spec",
    "VpaSettings",
    "WorkerSettings",
    "WorkloadSettings",
    "arg_type",
    "parse_size",
    "setting",
    "unknown_env",
]

#: frame features the live phase detector can use, in the CRBM's column order
#: (:data:`phasewise.models.phases.detector.FEATURES`; a test keeps the two equal)
PHASE_FEATURES = ("cpu", "mem", "gpu", "gpu_mem")
#: the resources the phase policy decides limits for (always features)
LIMITED_FEATURES = ("cpu", "mem")

# the one definition of each fixed set of values (argparse ``choices`` and the environment)
LOG_LEVELS = ("debug", "info", "warning", "error")
POLICIES = ("vpa", "phase")
BACKENDS = ("cgroup", "dry-run", "kubernetes")
VPA_UPDATE_MODES = ("bounds", "hysteresis")
PHASE_STATISTICS = ("relative", "absolute")
#: the host-level default mode of a workload without settings of its own (:mod:`phasewise.models.safety.workload`)
WORKLOAD_DEFAULT_MODES = ("auto", "off", "recommend", "apply")
#: the cgroup layouts (:mod:`phasewise.kit.cgroups.layouts`) and ``auto``
CGROUP_LAYOUTS = ("auto", "flat", "docker-cgroupfs", "docker-systemd", "kubepods-cgroupfs", "kubepods-systemd")
#: Kafka's security.protocol values and the SASL mechanisms phasewise configures on every client
KAFKA_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")

ENV_PREFIX = "PHASEWISE_"


class SettingsError(ValueError):
    """A refused setting: ``str(e)`` is ``"<setting>: <why>"``, one line.

    ``SettingsError("why")`` (no setting) is a message on its own.
    """

    def __init__(self, setting: str, why: str | None = None) -> None:
        if why is None:
            setting, why = "", setting
        self.setting = setting
        self.why = why
        super().__init__(f"{setting}: {why}" if setting else why)


# --------------------------------------------------------------------------- parsers: text -> value
# Each raises ValueError(why) on a text it cannot read.


def parse_int(text: str) -> int:
    """An integer (``1_000`` too).

    >>> parse_int(" 42 ")
    42
    """
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def parse_float(text: str) -> float:
    """A finite number: ``nan`` and ``inf`` are refused (no setting means them)."""
    try:
        v = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise ValueError(f"{text!r} is not a finite number")
    return v


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false, yes/no, on/off, 1/0)")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes, with an optional decimal (``G``) or binary (``Gi``) unit, Kubernetes style.

    >>> parse_size("67108864"), parse_size("64Mi"), parse_size("1.5G"), parse_size("2KiB")
    (67108864, 67108864, 1500000000, 2048)
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 67108864, 64Mi, 1G)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_str(text: str) -> str:
    return text


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that divides them.

    >>> format_size(64 * 2**20), format_size(1000)
    ('64Mi', '1000')
    """
    for unit, k in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


# --------------------------------------------------------------------------- checks: value -> None
# Each raises ValueError(why) on a value the setting does not take.


def above(lo: float) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not v > lo:
            raise ValueError(f"must be > {lo}, got {v!r}")
    return check


def at_least(lo: float) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not v >= lo:
            raise ValueError(f"must be >= {lo}, got {v!r}")
    return check


def in_range(lo: float, hi: float, *, lo_open: bool = False,
             hi_open: bool = False) -> Callable[[Any], None]:
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(v: Any) -> None:
        if not ((lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)):
            raise ValueError(f"must be in {interval}, got {v!r}")
    return check


#: a TCP port, 0 = off
port = in_range(0, 65535)


def non_empty(v: str) -> None:
    if not v.strip():
        raise ValueError("must not be empty")


_LOCAL_NODE = re.compile(r"^[A-Za-z0-9_.-]+=\d+(-\d+)?(,\d+(-\d+)?)*(@\d+(,\d+)*)?$")


def local_nodes_spec(v: str) -> None:
    """``NAME=CPUS[@GPUS]`` separated by ``;`` (CPUS a cpuset list such as ``0-3,6``), or empty."""
    parts = [x.strip() for x in v.split(";") if x.strip()]
    for x in parts:
        if not _LOCAL_NODE.match(x):
            raise ValueError(f"{x!r} is not NAME=CPUS[@GPUS] (e.g. s0=0-1@0)")
    names = [x.split("=")[0] for x in parts]
    if len(set(names)) != len(names):
        raise ValueError("node names repeat")


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
            spec = SPECS.get(name[len(ENV_PREFIX):].lower())
            if spec is not None and (spec.secret or spec.name.endswith("_file")):
                raise ValueError(f"{name} is a secret (or a file's path) of phasewise: a job never gets it")
        if any(n == name for n, _ in out):
            raise ValueError(f"{name} is given twice")
        out.append((name, value.strip()))
    return tuple(out)


def _job_env(v: str) -> None:
    parse_job_env(v)


def module_list(v: str) -> None:
    """Comma-separated dotted module names (``mypkg.models, other``), or empty."""
    for m in (x.strip() for x in v.split(",")):
        if m and not all(p.isidentifier() for p in m.split(".")):
            raise ValueError(f"{m!r} is not a module name (e.g. mypkg.models)")


def one_of(choices: tuple[str, ...]) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if v not in choices:
            raise ValueError(f"invalid choice: {v!r} (choose from {', '.join(map(repr, choices))})")
    return check


def feature_tuple(text: str) -> tuple[str, ...]:
    """A comma list of :data:`PHASE_FEATURES` holding :data:`LIMITED_FEATURES`, in that order.

    >>> feature_tuple("gpu_mem, mem,cpu")
    ('cpu', 'mem', 'gpu_mem')
    """
    got = [f.strip() for f in text.split(",") if f.strip()]
    unknown = sorted(set(got) - set(PHASE_FEATURES))
    if unknown:
        raise ValueError(f"unknown feature(s) {', '.join(unknown)}; "
                         f"choose from {','.join(PHASE_FEATURES)}")
    if len(set(got)) != len(got):
        raise ValueError(f"lists a feature twice: {text!r}")
    missing = [f for f in LIMITED_FEATURES if f not in got]
    if missing:
        raise ValueError(f"must hold {','.join(LIMITED_FEATURES)} (the resources the phase policy "
                         f"limits); {','.join(missing)} missing in {text!r}")
    return tuple(f for f in PHASE_FEATURES if f in got)


def _windows(text: str) -> tuple[float, ...]:
    """Comma-separated positive seconds, e.g. ``600,3600``."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError("give at least one window, e.g. 600,3600")
    out = tuple(parse_float(p) for p in parts)
    if any(w <= 0 for w in out):
        raise ValueError(f"windows must be positive seconds, got {text!r}")
    return out


def relative_cgroup_path(v: str) -> None:
    """A managed prefix is a relative path inside the cgroup tree (never ``..``)."""
    if not v or v.startswith("/") or ".." in v.split("/"):
        raise ValueError(f"must be a relative path inside the cgroup tree without '..', got {v!r}")


def _relative_or_empty(v: str) -> None:
    if v:
        relative_cgroup_path(v)


def _check_features(v: str) -> None:
    feature_tuple(v)


# --------------------------------------------------------------------------- field declarations


#: field type -> (parser of its text, check that a value is of that type)
def _is_int(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"must be an integer, got {v!r}")


def _is_number(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {v!r}")


def _is_bool(v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")


def _is_str(v: Any) -> None:
    if not isinstance(v, str):
        raise ValueError(f"must be a string, got {v!r}")


_KINDS: dict[str, tuple[Callable[[str], Any], Callable[[Any], None]]] = {
    "int": (parse_int, _is_int),
    "float": (parse_float, _is_number),
    "bool": (parse_bool, _is_bool),
    "str": (parse_str, _is_str),
}

_META = "phasewise"
_GROUP = "phasewise-group"


def setting(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
            parse: Callable[[str], Any] | None = None, check: Callable[[Any], None] | None = None,
            choices: tuple[str, ...] | None = None, flag: str | None = None, help: str = "",
            name: str | None = None, secret: bool = False) -> Any:
    """A settings field with how it is read and checked.

    *parse*: text (environment, flag) -> value, raising ValueError(why); default
    by the field's type (``int``, ``float`` finite, ``bool``, ``str``).
    *check*: value -> None, raising ValueError(why). *choices*: the only values
    taken (argparse ``choices`` too). *flag*: the command-line flag, where a
    role has one. *help*: one line for ``--help``. *name*: the setting's name
    (``PHASEWISE_<NAME>``) where it is not the group's prefix + the field's name.
    *secret*: a password or key: never printed (:meth:`Settings.describe`
    shows ``'***'``, ``repr`` leaves it out), and a refused value is not quoted
    in the error.
    """
    meta = {_META: {"parse": parse, "check": check, "choices": choices, "flag": flag, "help": help,
                    "name": name, "secret": secret}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=not secret)
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


def group(cls: type) -> Any:
    """A :class:`Settings` field holding one group of settings (its defaults unless given)."""
    return dataclasses.field(default_factory=cls, metadata={_GROUP: True})


@dataclass(frozen=True, slots=True)
class Spec:
    """How one setting is read from text and checked (from its field's declaration)."""

    name: str
    kind: str
    parse: Callable[[str], Any]
    type_check: Callable[[Any], None]
    check: Callable[[Any], None] | None
    choices: tuple[str, ...] | None
    flag: str | None
    help: str
    #: the field: ``Settings.<group>.<field>``, or ``Settings.<field>`` where *group* is None
    field: str
    #: the default (``dataclasses.MISSING`` where *factory* computes it)
    default: Any
    factory: Callable[[], Any] | None = None
    group: str | None = None
    #: a password or key: shown as ``'***'`` wherever settings are printed
    secret: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    def validate(self, value: Any) -> None:
        """ValueError(why) unless *value* is one this setting takes."""
        self.type_check(value)
        if self.choices is not None:
            one_of(self.choices)(value)
        if self.check is not None:
            self.check(value)

    def read(self, text: str) -> Any:
        """Parse *text* and validate the value; ValueError(why) otherwise."""
        value = self.parse(text)
        self.validate(value)
        return value


def _spec(f: dataclasses.Field, prefix: str) -> Spec:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    default_parse, type_check = _KINDS.get(kind, (parse_str, lambda v: None))
    meta = f.metadata.get(_META, {})
    factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
    return Spec(name=meta.get("name") or prefix + f.name, kind=kind,
                parse=meta.get("parse") or default_parse, type_check=type_check,
                check=meta.get("check"), choices=meta.get("choices"), flag=meta.get("flag"),
                help=meta.get("help", ""), field=f.name, default=f.default, factory=factory,
                secret=meta.get("secret", False))


_OWN_SPECS: dict[type, tuple[Spec, ...]] = {}


def _own_specs(cls: type) -> tuple[Spec, ...]:
    """The settings a group (or :class:`Settings`) declares itself, in field order."""
    specs = _OWN_SPECS.get(cls)
    if specs is None:
        prefix = getattr(cls, "PREFIX", "")
        specs = tuple(_spec(f, prefix) for f in fields(cls) if _GROUP not in f.metadata)
        _OWN_SPECS[cls] = specs
    return specs


class _Group:
    """A frozen group of settings that validates itself when made.

    Each field against its declaration, then the rules between the group's
    fields (:meth:`_rules`); a refused value raises :class:`SettingsError`
    naming the setting (``vpa_time_scale``). ``PREFIX`` + a field's name is its
    setting's name unless the field declares ``name=``.
    """

    __slots__ = ()
    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in _own_specs(type(self)):
            try:
                spec.validate(getattr(self, spec.field))
            except ValueError as e:
                raise SettingsError(spec.name, "refused (a secret's value is not shown)" if spec.secret
                                    else str(e)) from None
        self._rules()

    def _rules(self) -> None:
        """SettingsError if the group's fields break a rule between them."""


# --------------------------------------------------------------------------- the groups


@dataclass(frozen=True, slots=True)
class KafkaSettings(_Group):
    """Every Kafka client: the brokers, the consumer group's timing, topics, dead letters."""

    bootstrap: str = setting("127.0.0.1:9092", check=non_empty, flag="--bootstrap",
                             help="Kafka bootstrap address(es), comma-separated")
    #: consumer session timeout; the embedded broker completes a group join
    #: after about half of it, so local runs keep it short
    session_timeout_ms: int = setting(6000, check=above(0),
                                      help="consumer group session timeout, ms")
    heartbeat_interval_ms: int = setting(1500, check=above(0), help="consumer group heartbeat, ms")
    #: longest a fetch waits for data; the embedded broker does not answer a
    #: waiting fetch when data arrives, so this bounds end-to-end latency there
    #: (on Kafka it only bounds idle round trips)
    fetch_wait_max_ms: int = setting(20, check=at_least(0),
                                     help="longest a fetch waits for data, ms")
    create_topics: bool = setting(True, help="create missing topics at start-up")
    topic_partitions: int = setting(0, check=at_least(0), flag="--partitions",
                                    help="every topic's partition count "
                                         "(0 = each topic's documented default)")
    #: a dead letter (key and value) takes at most this many bytes: a payload that would not fit is
    #: cut and the dead letter says so (``truncated``). It must fit the broker's message size limit
    #: (Kafka's default: 1 MB; the producers' librdkafka default: 1,000,000 bytes)
    dead_letter_max_bytes: int = setting(900_000, parse=parse_size,
                                         check=in_range(16_384, 1_000_000),
                                         help="largest dead letter, bytes "
                                              "(fits the broker's message size)")

    #: TLS and SASL reach every client: the confluent-kafka producers, consumers and admin
    #: clients of every role, and the worker's Faust/aiokafka clients (phasewise.kit.kafka.security)
    security_protocol: str = setting("PLAINTEXT", choices=KAFKA_SECURITY_PROTOCOLS,
                                     name="kafka_security_protocol",
                                     help="how clients talk to the brokers")
    sasl_mechanism: str = setting("PLAIN", choices=KAFKA_SASL_MECHANISMS, name="kafka_sasl_mechanism",
                                  help="SASL mechanism (SASL_* protocols)")
    sasl_username: str = setting("", name="kafka_sasl_username",
                                 help="SASL user (PLAIN, SCRAM-*)")
    sasl_password: str = setting("", name="kafka_sasl_password", secret=True,
                                 help="SASL password (PLAIN, SCRAM-*); or kafka_sasl_password_file")
    sasl_password_file: str = setting("", name="kafka_sasl_password_file",
                                      help="file holding the SASL password (a mounted secret)")
    #: OAUTHBEARER: the client-credentials grant against an OpenID Connect token endpoint
    oauth_token_url: str = setting("", name="kafka_oauth_token_url",
                                   help="OAUTHBEARER: the OIDC token endpoint (https://...)")
    oauth_client_id: str = setting("", name="kafka_oauth_client_id", help="OAUTHBEARER: client id")
    oauth_client_secret: str = setting("", name="kafka_oauth_client_secret", secret=True,
                                       help="OAUTHBEARER: client secret; or kafka_oauth_client_secret_file")
    oauth_client_secret_file: str = setting("", name="kafka_oauth_client_secret_file",
                                            help="file holding the OAUTHBEARER client secret")
    oauth_scope: str = setting("", name="kafka_oauth_scope", help="OAUTHBEARER: scope(s) asked for")
    ssl_ca_file: str = setting("", name="kafka_ssl_ca_file",
                               help="PEM CA bundle the brokers' certificates are checked against "
                                    "(empty: the system's)")
    ssl_cert_file: str = setting("", name="kafka_ssl_cert_file",
                                 help="PEM client certificate (mutual TLS)")
    ssl_key_file: str = setting("", name="kafka_ssl_key_file", help="PEM client key (mutual TLS)")
    ssl_key_password: str = setting("", name="kafka_ssl_key_password", secret=True,
                                    help="the client key's password; or kafka_ssl_key_password_file")
    ssl_key_password_file: str = setting("", name="kafka_ssl_key_password_file",
                                         help="file holding the client key's password")
    ssl_check_hostname: bool = setting(True, name="kafka_ssl_check_hostname",
                                       help="check that a broker's certificate names it")

    def _rules(self) -> None:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise SettingsError("heartbeat_interval_ms", f"must be below session_timeout_ms "
                                f"({self.session_timeout_ms}), got {self.heartbeat_interval_ms}")
        for value, file, name in ((self.sasl_password, self.sasl_password_file, "kafka_sasl_password"),
                                  (self.oauth_client_secret, self.oauth_client_secret_file,
                                   "kafka_oauth_client_secret"),
                                  (self.ssl_key_password, self.ssl_key_password_file, "kafka_ssl_key_password")):
            if value and file:
                raise SettingsError(name, f"given twice: set {name} or {name}_file, not both")
        # what SASL and TLS need (credentials, readable files, a certificate with its key) is checked
        # at start-up and when a client is made (phasewise.kit.kafka.security.check_security), so each
        # of these settings can be given alone

    def common(self) -> dict[str, Any]:
        """The brokers every Kafka client of phasewise starts from.

        :func:`phasewise.kit.kafka.security.librdkafka_conf` adds TLS and SASL.
        """
        return {"bootstrap.servers": self.bootstrap}


@dataclass(frozen=True, slots=True)
class CgroupSettings(_Group):
    """Where the managed containers' cgroups are (the host agent and the actuator)."""

    PREFIX: ClassVar[str] = "cgroup_"

    root: str = setting("/sys/fs/cgroup", check=non_empty, flag="--cgroup-root",
                        help="cgroup mount: a v2 mount or a directory of v1 hierarchies")
    prefix: str = setting("phasewise", check=relative_cgroup_path, flag="--cgroup-prefix",
                          help="managed containers are the cgroups directly under "
                               "<root>/[<controller>/]<prefix>/")
    layout: str = setting("auto", choices=CGROUP_LAYOUTS, flag="--cgroup-layout",
                          help="where containers are: flat (under the prefix), docker-cgroupfs, docker-systemd, "
                               "kubepods-cgroupfs, kubepods-systemd, or auto (every layout present)")
    parent: str = setting("", check=_relative_or_empty, flag="--cgroup-parent",
                          help="where the runtimes' cgroup trees start in each hierarchy (the kubelet's "
                               "--cgroup-root, Docker's --cgroup-parent); empty = the hierarchy's root")


@dataclass(frozen=True, slots=True)
class ProducerSettings(_Group):
    """The host agent (``phasewise produce``)."""

    interval_s: float = setting(1.0, check=above(0), flag="--interval",
                                help="seconds between samples")
    buffer_max_messages: int = setting(10_000, check=at_least(1),
                                       help="messages kept while the broker is away "
                                            "(the oldest dropped beyond)")
    #: seconds the host agent spends flushing buffered samples at shutdown
    flush_timeout_s: float = setting(5.0, check=at_least(0), flag="--flush-timeout",
                                     help="seconds to flush buffered samples at shutdown")
    #: where the host agent reads /proc/<pid>/cgroup to attribute GPU processes
    proc_root: str = setting("/proc", check=non_empty,
                             help="proc mount, to map GPU processes to containers")


@dataclass(frozen=True, slots=True)
class WorkerSettings(_Group):
    """The stream worker (``phasewise worker``), whatever its policy."""

    id: str = setting("phasewise-worker", check=non_empty, flag="--worker-id", name="worker_id",
                      help="Faust app id = consumer group of all workers")
    web_port: int = setting(0, check=port, flag="--web-port",
                            help="Faust's web server port (its own views and the tables' contents), 0 = none; "
                                 "the worker's /scorecard/ view is on metrics_port")
    policy: str = setting("vpa", choices=POLICIES, flag="--policy",
                          help="the policy of workloads that name none (phasewise.io/policy): vpa: VPA "
                               "limits; phase: limits from the shared CRBM phase model with VPA as the fallback")
    #: with --policy vpa, run the phase machinery too (detector, learner, model follower), so workloads
    #: whose phasewise.io/policy is phase are decided with it; without it they are refused (not decided)
    phase_workloads: bool = setting(False, flag="--phase-workloads",
                                    help="with --policy vpa: also run the phase machinery, for workloads whose "
                                         "phasewise.io/policy is phase (without it they are refused, not decided)")
    recommend_interval_s: float = setting(5.0, check=at_least(0), flag="--recommend-interval",
                                          help="seconds of event time between a container's "
                                               "recommendations, 0 = after every sample")
    hysteresis: float = setting(0.10, check=in_range(0, 1, hi_open=True), flag="--hysteresis",
                                help="relative change of a limit needed for a decision")
    #: only these hosts' samples are processed (comma-separated; empty = all)
    hosts: str = setting("", name="worker_hosts",
                         help="process only these hosts' samples (comma-separated; empty = all)")
    #: the worker persists a container's state (a changelogged table write, ~300 us)
    #: when it decides, else at most once per this many seconds of event time
    #: (checked at every sample); samples since the last write are lost if the
    #: worker is killed; 0: every touched container is written at every commit, and a
    #: restarted worker decides exactly as an unkilled one (docs/security.md)
    state_write_interval_s: float = setting(30.0, check=at_least(0),
                                            help="seconds of event time between a container's "
                                                 "table writes (0 = at every commit: exact "
                                                 "recovery after a kill)")
    #: a container with no sample for this long (event time) is dropped from the
    #: worker's memory and tables (VPA garbage-collects after 8 days); 0 = never
    container_ttl_s: float = setting(691_200.0, check=at_least(0), flag="--container-ttl",
                                     help="seconds of event time without a sample after which a "
                                          "container is forgotten, 0 = never")
    #: the samples agent takes up to this many messages at a time and steps the
    #: containers of distinct hosts together (vectorised: ~half the cost per sample)
    batch_max: int = setting(16, check=at_least(1), name="worker_batch_max",
                             help="messages the samples agent steps together")
    #: ... waiting at most this long for them to arrive (adds at most this to latency)
    batch_wait_ms: float = setting(5.0, check=at_least(0), name="worker_batch_wait_ms",
                                   help="longest wait for such a batch, ms")

    #: a Faust worker (worker, horus, place) that stays not ready this long while its broker answers and its
    #: changelog recovery does not move says why and exits with status 1 (a supervisor restarts it)
    ready_stall_s: float = setting(300.0, check=at_least(0), flag="--ready-stall",
                                   help="seconds a Faust worker (worker, horus, place) may stay not ready while its "
                                        "broker answers and its table recovery makes no progress, before it says "
                                        "why and exits with status 1, 0 = wait forever")

    #: the live scorecard (docs/kubernetes.md): samples kept per container (0 = no scorecard)
    #: and the sliding windows of event time it scores
    scorecard_samples: int = setting(300, check=at_least(0), flag="--scorecard-samples",
                                     help="samples kept per container for the live scorecard (72 bytes each), "
                                          "0 = none")
    scorecard_windows: str = setting("60,300", check=lambda v: _windows(v) and None,
                                     flag="--scorecard-windows",
                                     help="the scorecard's sliding windows, seconds of event time, comma-separated")

    def scorecard_windows_s(self) -> tuple[float, ...]:
        """``scorecard_windows`` as seconds."""
        return _windows(self.scorecard_windows)

    def served_policies(self) -> tuple[str, ...]:
        """The limit policies this worker decides with: the VPA always (it is the phase policy's
        fallback), the phase policy with ``--policy phase`` or ``--phase-workloads``."""
        return ("vpa", "phase") if self.policy == "phase" or self.phase_workloads else ("vpa",)

    def host_set(self) -> frozenset[str]:
        """``worker_hosts`` as a set (empty: every host)."""
        return frozenset(h.strip() for h in self.hosts.split(",") if h.strip())


@dataclass(frozen=True, slots=True)
class VpaSettings(_Group):
    """The worker's VPA recommender and updater (``--policy vpa``; the phase policy's fallback)."""

    PREFIX: ClassVar[str] = "vpa_"

    #: multiplies every VPA duration (24 h half-lives, memory interval, confidence
    #: interval): 1 = Kubernetes VPA; 0.001 = a VPA "day" lasts 86.4 s (demo, tests)
    time_scale: float = setting(1.0, check=above(0), flag="--vpa-time-scale",
                                help="multiply VPA's 24 h half-lives and intervals by this "
                                     "(1 = Kubernetes VPA; 0.001 = a day in 86.4 s)")
    #: floors of every recommendation (VPA: 25 millicores, 250 MiB)
    min_cpu_cores: float = setting(0.025, check=at_least(0),
                                   help="VPA's minimum CPU recommendation, cores")
    min_mem_bytes: int = setting(250 * 2**20, parse=parse_size, check=at_least(0),
                                 help="VPA's minimum memory recommendation, e.g. 250Mi")
    #: phasewise's throttling bump: a sample throttled in more than this share of
    #: CFS periods is recorded as limit * (1 + vpa_throttle_bump)
    throttle_threshold: float = setting(0.1, check=in_range(0, 1),
                                        help="share of throttled CFS periods above which a CPU "
                                             "sample is censored")
    throttle_bump: float = setting(0.5, check=at_least(0), help="a censored CPU sample counts as "
                                                                 "limit x (1 + bump)")
    #: "bounds" acts like the VPA updater (a limit changes only when the one in
    #: force lies outside the recommender's [lower, upper] confidence bounds, then
    #: to the target); "hysteresis" follows the target whenever it moves by more
    #: than hysteresis
    update_mode: str = setting("bounds", choices=VPA_UPDATE_MODES,
                               help="when a VPA limit changes: outside the confidence bounds, "
                                    "or past the hysteresis")


@dataclass(frozen=True, slots=True)
class PhaseSettings(_Group):
    """The worker's live phase path (``--policy phase``): detectors, learner, limits."""

    PREFIX: ClassVar[str] = "phase_"

    #: the phase learner publishes a model snapshot this often (when it learned something)
    snapshot_interval_s: float = setting(30.0, check=above(0), flag="--snapshot-interval",
                                         help="--policy phase: seconds between the learner's model "
                                              "snapshots")
    #: detectors send every this many ready windows (fleet-wide) to the learner
    learn_every: int = setting(10, check=at_least(1), flag="--learn-every",
                               help="--policy phase: detectors send every k-th ready window to "
                                    "the learner")
    #: windows the CRBM of a cold model learns before phases are assigned
    warmup: int = setting(256, check=at_least(0), flag="--phase-warmup",
                          help="--policy phase: windows a cold CRBM learns before phases are "
                               "assigned")
    #: relative: a phase limit is the container's level (decaying max of its own
    #: usage) x the phase's quantile of usage/level x (1 + margin); absolute: the
    #: phase's pooled usage quantile x (1 + margin) (the design before; worse in replay)
    statistics: str = setting("relative", choices=PHASE_STATISTICS, flag="--phase-statistics",
                              help="--policy phase: limits from the container's level x the "
                                   "phase's quantile of usage/level (relative) or the phase's "
                                   "pooled usage quantile (absolute)")
    #: detectors hold learn windows until this many are ready and send them as
    #: one batch (also a partial one at every offset commit); the learner makes
    #: one CD step per batch (a step costs ~0.7 ms however small its batch),
    #: steps of 16 windows while the model is cold
    learn_batch: int = setting(128, check=at_least(1), flag="--learn-batch",
                               help="--policy phase: learn windows go to the learner in batches "
                                    "of this many, one CD step each")
    #: the CRBM's frame features, a comma list of PHASE_FEATURES that holds cpu
    #: and mem (the limited resources); add gpu,gpu_mem on GPU hosts (host
    #: agents with NVML report them per container; a container without a GPU
    #: has them missing). The shipped pretrained model is cpu,mem: any other
    #: set starts cold and is a different model on the topic
    features: str = setting("cpu,mem", check=_check_features, flag="--phase-features",
                            help="--policy phase: the CRBM's frame features, a comma list of "
                                 "cpu,mem,gpu,gpu_mem holding cpu and mem (add gpu,gpu_mem on "
                                 "GPU hosts)")
    #: no snapshot on the models topic yet: start from the shipped model
    #: pretrained on the AI4DL sample (when features is cpu,mem); false = start
    #: cold (replay sets it so, unless asked: a trace must not be scored by a
    #: model that saw it)
    pretrained: bool = setting(True, help="--policy phase: start from the shipped pretrained model")
    #: relative statistics: a phase's quantile of usage/level is used up to this,
    #: so a limit is at most level x cap x (1 + margin); 0 = no cap (uncapped,
    #: start-up ramps made limits several times the use in replay)
    ratio_cap: float = setting(1.5, check=at_least(0),
                               help="--policy phase: cap on a phase's quantile of usage/level "
                                    "(0 = no cap)")
    #: a model snapshot's checkpoint may take this many bytes compressed, and unpack to at most this
    #: many (checked before inflating, and by a bounded inflater: a small bomb never grows in memory)
    snapshot_max_bytes: int = setting(4 * 2**20, parse=parse_size, check=at_least(1024),
                                      help="--policy phase: largest model snapshot, compressed, e.g. 4Mi")
    snapshot_max_unpacked_bytes: int = setting(64 * 2**20, parse=parse_size, check=at_least(1024),
                                               help="--policy phase: largest model snapshot, unpacked")
    #: a snapshot whose version is more than this past the one in use is refused (a forged huge
    #: version would make every later genuine snapshot look old)
    snapshot_max_version_step: int = setting(1000, check=at_least(1),
                                             help="--policy phase: refuse a snapshot more than this many "
                                                  "versions past the one in use")

    @staticmethod
    def cap(ratio_cap: float) -> float | None:
        """A ``phase_ratio_cap`` value as the models take it: 0 means no cap (``None``).

        >>> PhaseSettings.cap(1.5), PhaseSettings.cap(0)
        (1.5, None)
        """
        return ratio_cap or None

    def feature_tuple(self) -> tuple[str, ...]:
        """``phase_features`` parsed, in :data:`PHASE_FEATURES` order.

        >>> PhaseSettings(features="gpu_mem, mem,cpu").feature_tuple()
        ('cpu', 'mem', 'gpu_mem')
        """
        return feature_tuple(self.features)


@dataclass(frozen=True, slots=True)
class SafetySettings(_Group):
    """The safety rules every live decision of the worker passes, whatever the policy.

    :mod:`phasewise.models.safety.guard` applies them.
    """

    PREFIX: ClassVar[str] = "safety_"

    #: on: every decision of the worker passes the rules below; off only to replay what a bare
    #: policy decides (replay turns it off unless --safety)
    rules: bool = setting(True, help="every decision of the worker passes the safety rules")
    #: no limit is lowered (nor first set on an unlimited container) before this much history
    min_history_s: float = setting(900.0, check=at_least(0),
                                   help="no limit is lowered before this many seconds of history")
    #: at most one decrease per resource per this long; no memory decrease this long after
    #: an OOM kill
    cooldown_s: float = setting(300.0, check=at_least(0),
                                help="seconds between two decreases of a resource "
                                     "(and after an OOM kill)")
    #: one decision lowers a limit by at most this fraction of the limit in force
    max_decrease: float = setting(0.25, check=in_range(0, 1, lo_open=True),
                                  help="largest fraction of a limit one decision takes away")
    #: memory limits never go below the container's peak working set over this long
    #: + the actuator's mem_margin_bytes
    peak_window_s: float = setting(3600.0, check=above(0),
                                   help="memory limits stay above the peak working set of this "
                                        "many seconds + mem_margin_bytes")


@dataclass(frozen=True, slots=True)
class ActuatorSettings(_Group):
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
    job_user: str = setting("nobody", check=user_name, flag="--job-user",
                            help="the user (name or uid) started jobs run as; root is refused unless "
                                 "job_allow_root")
    job_group: str = setting("", check=account_name, flag="--job-group",
                             help="the group (name or gid) started jobs run as; empty: job_user's primary group")
    job_allow_root: bool = setting(False, help="let job_user / job_group be root (uid or gid 0)")
    job_env: str = setting("", check=_job_env,
                           help="NAME=VALUE;... added to a started job's environment (PATH, LANG, "
                                "OMP_NUM_THREADS, ...); nothing else of the actuator's is passed on")

    def _rules(self) -> None:
        if self.cpu_weight_min > self.cpu_weight_max:
            raise SettingsError("cpu_weight_min", f"must be <= cpu_weight_max ({self.cpu_weight_max}), "
                                f"got {self.cpu_weight_min}")


@dataclass(frozen=True, slots=True)
class IntakeSettings(_Group):
    """What the worker admits from the samples topic before any per-container state sees it.

    A message beyond the event-time limits is dead-lettered whole. When a capacity limit is
    full, a new container evicts the least recently seen one of its host or of the worker (a host
    cannot take more than its share of a full worker), counted in
    ``phasewise_worker_containers_evicted_total``; a container is refused (dead-lettered, counted in
    ``phasewise_worker_containers_refused_total``) only when none may go. 0 = no limit.
    """

    PREFIX: ClassVar[str] = "intake_"

    max_future_s: float = setting(300.0, check=at_least(0),
                                  help="refuse samples stamped more than this many seconds ahead of the "
                                       "worker's clock")
    max_behind_s: float = setting(3600.0, check=at_least(0),
                                  help="refuse samples stamped more than this many seconds before their "
                                       "host's newest sample")
    max_containers_per_message: int = setting(10_000, check=at_least(0),
                                              help="refuse a samples message holding more containers")
    max_containers_per_host: int = setting(10_000, check=at_least(0),
                                           help="containers one host may have in a worker; a new one beyond "
                                                "evicts the host's least recently seen")
    max_containers_per_worker: int = setting(200_000, check=at_least(0),
                                             help="containers one worker holds; a new one beyond evicts the "
                                                  "least recently seen, a host at its share its own")
    host_active_s: float = setting(120.0, check=above(0),
                                   help="seconds after its last message a host divides a full worker into "
                                        "shares; containers not seen for longer are evicted first")


@dataclass(frozen=True, slots=True)
class SigningSettings(_Group):
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
class JobSettings(_Group):
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
    allowed_commands: str = setting("", check=absolute_paths,
                                    help="executables (absolute paths, comma-separated) a started job's command "
                                         "may name first; empty = any command a trusted submitter signed")

    def allowed(self) -> tuple[str, ...]:
        """``allowed_commands`` as a tuple (empty: no allowlist)."""
        return tuple(x.strip() for x in self.allowed_commands.split(",") if x.strip())


@dataclass(frozen=True, slots=True)
class WorkloadSettings(_Group):
    """Per-workload policy on this host (the host agent and the actuator): default mode, pods, policy file."""

    PREFIX: ClassVar[str] = "workload_"

    default_mode: str = setting("auto", choices=WORKLOAD_DEFAULT_MODES, flag="--default-mode",
                                help="mode of a workload without settings of its own: auto = apply in the flat "
                                     "prefix, off for Docker and Kubernetes containers (opt-in)")
    policy_file: str = setting("", flag="--policy-file",
                               help="rules matched by container name glob (JSON; YAML with PyYAML); "
                                    "empty = none")
    pods: str = setting("", flag="--kubelet-pods",
                        help="this node's pods: an http(s) URL answering a PodList (the kubelet's /pods, or "
                             "the API server's /api/v1/pods?fieldSelector=spec.nodeName=NODE) or a file; "
                             "empty = not on Kubernetes")
    pods_token_file: str = setting("", help="bearer token sent with an https pod-list request "
                                            "(e.g. the service account's token file); empty = none")
    pods_ca_file: str = setting("", help="CA certificate of the https pod-list server (e.g. the service "
                                         "account's ca.crt); empty = the system's CAs")
    pods_refresh_s: float = setting(10.0, check=above(0), help="seconds between reads of the pod list")
    docker_dir: str = setting("/var/lib/docker/containers",
                              help="Docker's per-container records (<id>/config.v2.json: name, labels); "
                                   "empty = do not read")


@dataclass(frozen=True, slots=True)
class HorusSettings(_Group):
    """``phasewise horus``: utilisation predicted from job graphs, learned from the jobs it watches."""

    PREFIX: ClassVar[str] = "horus_"

    coverage: float = setting(0.8, check=in_range(0, 1, lo_open=True, hi_open=True), flag="--coverage",
                              help="nominal probability that a prediction's [lo, hi] holds the observed value")
    warmup_s: float = setting(20.0, check=at_least(0), flag="--job-warmup",
                              help="seconds after a job starts left out of its observation (its loading phase)")
    observe_s: float = setting(60.0, check=at_least(0), flag="--observe",
                               help="steady seconds of a job's samples after which it is learned")
    min_samples: int = setting(5, check=at_least(1), help="steady samples a job needs to be learned")
    worker_id: str = setting("phasewise-horus", check=non_empty, flag="--horus-id",
                             help="Faust app id (consumer group and table names) of the horus worker")
    model_modules: str = setting("", check=module_list,
                                 help="modules (comma-separated; each with its submodules) whose module:function "
                                      "models horus imports, in a child process; empty = catalog models only")
    build_timeout_s: float = setting(60.0, check=above(0),
                                     help="seconds a module:function model's graph may take to build in its child "
                                          "process before it is stopped and the job refused")
    build_memory_bytes: int = setting(4 * 2**30, parse=parse_size, check=at_least(64 * 2**20),
                                      help="address space a module:function model's child process may take beyond "
                                           "the interpreter's own, bytes")


@dataclass(frozen=True, slots=True)
class PlacementSettings(_Group):
    """``phasewise place``: the placement worker (jobs, predictions and samples in, place decisions out)."""

    PREFIX: ClassVar[str] = "place_"

    policy: str = setting("horus", choices=("horus", "first-fit", "best-fit", "fgd"), flag="--placement",
                          help="placement policy (docs/placement.md)")
    isolate_inference: bool = setting(False, help="never put inference and training jobs on one node")
    horus_frag_weight: float = setting(1.0, check=at_least(0), flag="--horus-frag-weight",
                                       help="horus: weight of FGD's fragmentation growth (GPUs) against Horus's "
                                            "over-capacity term (co-located utilisation above 100 %); 0 = Horus's "
                                            "cost alone (docs/placement.md)")
    prediction_wait_s: float = setting(10.0, check=at_least(0), flag="--prediction-wait",
                                       help="seconds a submitted job waits for its utilisation prediction "
                                            "before it is placed on its requests alone")
    max_waiting_jobs: int = setting(10_000, check=at_least(0),
                                    help="jobs waiting for room at most; beyond, the job of lowest rank (priority, "
                                         "then submission) is refused with a dead letter; 0 = no limit")
    after_admission: bool = setting(False, help="hold each submitted job until the priority agent's admitted "
                                                "hint (priority_launcher=place), then place it on that host "
                                                "only; free it on its stopped hint")
    local_nodes: str = setting("", check=local_nodes_spec, flag="--local-nodes",
                               help="local mode: nodes are cpuset slices of this host, NAME=CPUS[@GPUS] "
                                    "separated by ';' (e.g. 's0=0-1@0;s1=2-3'); empty: nodes are the sampled hosts")
    worker_id: str = setting("phasewise-place", check=non_empty, flag="--place-id",
                             help="Faust app id (consumer group and table names) of the placement worker")


@dataclass(frozen=True, slots=True)
class TargetsSettings(_Group):
    """Loss targets (TRADL): the worker's targets agent on job events (:mod:`phasewise.models.jobs.targets`)."""

    PREFIX: ClassVar[str] = "targets_"

    #: on: the worker follows job events and emits the targets' decisions and controls
    enabled: bool = setting(False, flag="--targets", help="run the targets agent on job events")
    ewma_alpha: float = setting(0.3, check=in_range(0, 1, lo_open=True),
                                help="EWMA weight of the newest reported loss or metric")
    patience: int = setting(3, check=at_least(1), help="reports in a row past a target before it counts")
    grace_s: float = setting(30.0, check=at_least(0),
                             help="seconds between checkpoint_exit at objective and the hard stop")
    shrink: float = setting(0.25, check=in_range(0, 1, lo_open=True),
                            help="a held job's CPU limit = this x node cores / jobs on the node")
    node_cores: float = setting(8.0, check=above(0),
                                help="CPU cores of a node where its samples do not say (host_cpu_count)")
    #: tradl: a job past acceptable is held while another of its node is short of acceptable; nearest: the
    #: job estimated nearest its objective gets the node, the others are held
    policy: str = setting("tradl", choices=("tradl", "nearest"),
                          help="how a node is divided among its jobs short of their objective")
    #: the TRADL share rule: off (0) by default, because its limits add up to 1/2 to n/(n+1) of the node
    #: (it leaves CPU idle while it holds) and it swings on and off around alpha x capacity
    share_alpha: float = setting(0.0, check=in_range(0, 1),
                                 help="apply the TRADL share rule above this fraction of a node's cores "
                                      "(0 = off)")
    share_interval_s: float = setting(30.0, check=at_least(0),
                                      help="seconds of samples between two applications of the share rule "
                                           "to a node")


# --------------------------------------------------------------------------- a process's settings


@dataclass(frozen=True, slots=True)
class PrioritySettings(_Group):
    """The priority agent (``phasewise worker --priorities``): DynamoML preemption over the job events.

    :mod:`phasewise.models.jobs.priorities` decides; every host offers the same
    capacity to jobs.
    """

    PREFIX: ClassVar[str] = "priority_"

    agent: bool = setting(False, flag="--priorities",
                          help="run the priority agent on the job events (freeze / checkpoint-and-stop / resume)")
    host_cpu_cores: float = setting(0.0, check=at_least(0),
                                    help="CPU cores each host offers to jobs; 0 = this host's core count")
    host_mem_bytes: int = setting(0, parse=parse_size, check=at_least(0),
                                  help="memory each host offers to jobs; 0 = this host's memory")
    host_gpus: float = setting(0.0, check=at_least(0), help="GPUs each host offers to jobs")
    freeze_max_wait_s: float = setting(120.0, check=at_least(0),
                                       help="victims are frozen (not stopped) for expected waits up to this long")
    grace_s: float = setting(30.0, check=at_least(0),
                             help="seconds a checkpoint-and-exit gets before the hard stop")
    cpu_weights: bool = setting(True, help="send each job's CPU weight (from its priority and class) when it "
                                           "starts and when its priority changes")
    cpu_weight_ratio: float = setting(2.0, check=in_range(1, 100),
                                      help="CPU weight factor of one priority level (100 x ratio^(priority + "
                                           "class/3) in cpu.weight units)")
    #: self: the agent's own place decisions start and restart jobs (on the host's CPUs); place: it publishes
    #: admitted / stopped hints on the job events and the placement agent (--place-after-admission) places
    launcher: str = setting("self", choices=("self", "place"),
                            help="who starts an admitted job: self (the priority agent's place decision, the "
                                 "host's CPUs) or place (an admitted hint on the job events; phasewise place "
                                 "--place-after-admission chooses the CPUs and GPUs on that host)")


@dataclass(frozen=True, slots=True)
class Settings(_Group):
    """Every setting of a process: the few every role reads, and one group per role or concern.

    A setting is read through its group (``settings.vpa.time_scale``); its flat
    name (``vpa_time_scale``, ``PHASEWISE_VPA_TIME_SCALE``) is how the
    environment, the flags, :meth:`from_env`, :meth:`replace` and
    :meth:`describe` name it.
    """

    host: str = setting(factory=socket.gethostname, check=non_empty, flag="--host",
                        help="this host's name")
    log_level: str = setting("info", choices=LOG_LEVELS, flag="--log-level", help="log level")
    #: never under /tmp: another local user could create it first (docs/security.md, "State directories")
    data_dir: str = setting(factory=default_data_dir, check=non_empty, flag="--data-dir",
                            help="worker state, actuator ledger, job logs, demo run directories; created "
                                 "private if missing, refused if another user owns it or may write it")
    metrics_port: int = setting(0, check=port, flag="--metrics-port",
                                help="port of /metrics, /healthz and /readyz, 0 = none")
    #: the address the metrics and health endpoints (and the worker's Faust web server) listen on:
    #: loopback by default, so a role started on a host exposes nothing; the images set 0.0.0.0,
    #: as a pod's probes and Prometheus reach it at the pod's address
    bind_address: str = setting("127.0.0.1", check=non_empty, flag="--bind-address",
                                help="address of the metrics and health endpoints (0.0.0.0 in a pod)")
    kafka: KafkaSettings = group(KafkaSettings)
    cgroup: CgroupSettings = group(CgroupSettings)
    producer: ProducerSettings = group(ProducerSettings)
    worker: WorkerSettings = group(WorkerSettings)
    vpa: VpaSettings = group(VpaSettings)
    phase: PhaseSettings = group(PhaseSettings)
    safety: SafetySettings = group(SafetySettings)
    actuator: ActuatorSettings = group(ActuatorSettings)
    workload: WorkloadSettings = group(WorkloadSettings)
    horus: HorusSettings = group(HorusSettings)
    place: PlacementSettings = group(PlacementSettings)
    priority: PrioritySettings = group(PrioritySettings)
    targets: TargetsSettings = group(TargetsSettings)
    intake: IntakeSettings = group(IntakeSettings)
    signing: SigningSettings = group(SigningSettings)
    jobs: JobSettings = group(JobSettings)

    def _rules(self) -> None:
        for name, cls in GROUPS.items():
            if type(getattr(self, name)) is not cls:
                raise SettingsError(name, f"must be a {cls.__name__}, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, overrides: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> Settings:
        """Defaults < ``PHASEWISE_<NAME>`` environment < explicit overrides (flags).

        *overrides* are keyed by setting name (``vpa_time_scale``); ``None``
        values mean "flag not given". The environment takes the same forms as
        the flags (``64Mi``, ``true``, the same choices). A refused value
        raises :class:`SettingsError` naming where it came from: the
        environment variable, or the setting for an override.
        """
        env = os.environ if env is None else env
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        unknown = sorted(set(given) - SPECS.keys())
        if unknown:
            raise SettingsError(unknown[0], "unknown setting")
        values: dict[str, Any] = {}
        source: dict[str, str] = {}
        for name, spec in SPECS.items():
            if name in given:
                values[name] = given[name]
                continue
            raw = env.get(spec.env)
            if raw is None:
                continue
            try:
                values[name] = spec.parse(raw)
            except ValueError as e:
                raise SettingsError(spec.env, str(e)) from None
            source[name] = spec.env
        try:
            return cls._build(values)
        except SettingsError as e:
            raise SettingsError(source.get(e.setting, e.setting), e.why) from None

    @classmethod
    def _build(cls, values: Mapping[str, Any], base: Settings | None = None) -> Settings:
        """*base* (else the defaults) with the settings in *values* (by name) changed."""
        unknown = sorted(set(values) - SPECS.keys())
        if unknown:
            raise SettingsError(unknown[0], "unknown setting")
        top: dict[str, Any] = {}
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            spec = SPECS[name]
            if spec.group is None:
                top[spec.field] = value
            else:
                by_group.setdefault(spec.group, {})[spec.field] = value
        if base is None:
            return cls(**top, **{g: GROUPS[g](**kw) for g, kw in by_group.items()})
        return dataclasses.replace(base, **top, **{g: dataclasses.replace(getattr(base, g), **kw)
                                                   for g, kw in by_group.items()})

    def replace(self, **changes: Any) -> Settings:
        """These settings with some changed, by setting name: ``s.replace(vpa_time_scale=0.001)``.

        >>> Settings(host="h").replace(topic_partitions=3, host="g").kafka.topic_partitions
        3
        """
        return self._build(changes, base=self)

    @classmethod
    def spec(cls, name: str) -> Spec:
        return SPECS[name]

    @classmethod
    def default(cls, name: str) -> Any:
        """Setting *name*'s default (the one definition of it).

        >>> Settings.default("vpa_time_scale"), Settings.default("phase_features")
        (1.0, 'cpu,mem')
        """
        return SPECS[name].default_value()

    def get(self, name: str) -> Any:
        """Setting *name*'s value, by its flat name (for code that handles settings by name)."""
        spec = SPECS[name]
        return getattr(self if spec.group is None else getattr(self, spec.group), spec.field)

    def flat(self) -> dict[str, Any]:
        """Every setting's value by name, in :data:`SPECS` order."""
        return {name: self.get(name) for name in SPECS}

    def describe(self) -> str:
        """Every setting as ``name=value``; a secret that is set shows as ``'***'``."""
        return "settings: " + " ".join(f"{k}={shown(k, v)!r}" for k, v in self.flat().items())


#: group attribute of :class:`Settings` -> its class, in field order
GROUPS: dict[str, type[_Group]] = {f.name: f.default_factory for f in fields(Settings)
                                   if _GROUP in f.metadata}


def _all_specs() -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    specs = [*_own_specs(Settings), *(dataclasses.replace(s, group=g) for g, cls in GROUPS.items()
                                      for s in _own_specs(cls))]
    for s in specs:
        if s.name in out:
            raise TypeError(f"two settings named {s.name!r}")
        out[s.name] = s
    return out


#: every setting's declaration, by name: the role-independent ones, then each group's
SPECS: dict[str, Spec] = _all_specs()


def shown(name: str, value: Any) -> Any:
    """*value* of setting *name* as it may be printed: ``'***'`` for a secret that is set.

    >>> shown("kafka_sasl_password", "hunter2"), shown("kafka_sasl_password", ""), shown("host", "h")
    ('***', '', 'h')
    """
    return "***" if SPECS[name].secret and value else value


def default_text(name: str) -> str:
    """A setting's default as a user would write it (``64Mi``, ``hostname``)."""
    spec = SPECS[name]
    if spec.default is dataclasses.MISSING:
        return {"host": "hostname",
                "data_dir": "/var/lib/phasewise as root, else $XDG_STATE_HOME/phasewise or ~/.local/state/phasewise",
                }.get(name, "computed")
    if spec.parse is parse_size:
        return format_size(spec.default)
    if isinstance(spec.default, bool):
        return str(spec.default).lower()
    return str(spec.default) if spec.default != "" else "(empty)"


def reference() -> str:
    """``docs/configuration.md``: every setting by group, with its variable, flag, default and meaning.

    Written from the declarations, so each default and check stays written once
    (``python -m phasewise.kit.settings > docs/configuration.md``; a test keeps the file current).
    """
    lines = [
        "# Configuration",
        "",
        "<!-- written by `python -m phasewise.kit.settings > docs/configuration.md`; a test keeps it current -->",
        "",
        "Every setting is read from its `PHASEWISE_<NAME>` environment variable and, where a role has one,",
        "its flag; a flag wins over the environment, which wins over the default. The environment takes the",
        "flags' forms: sizes as `67108864`, `64Mi` or `1G` (`Mi`/`Gi` binary, `M`/`G` decimal), booleans as",
        "`true`/`false`, `yes`/`no`, `on`/`off`, `1`/`0`; `nan` and `inf` are refused. A refused value stops",
        "the role with one line, `phasewise ROLE: error: <setting>: <why>`, and exit status 2; an unknown",
        "`PHASEWISE_*` variable gets a warning naming the closest setting. Each role prints the settings it",
        "runs with at start-up.",
        "",
    ]

    def section(title: str, doc: str, names: list[str]) -> None:
        lines.extend([f"## {title}", "", doc, "",
                      "| variable | flag | default | meaning |", "|---|---|---|---|"])
        for name in names:
            spec = SPECS[name]
            meaning = spec.help + (f" (one of: {', '.join(spec.choices)})" if spec.choices else "")
            lines.append(f"| `{spec.env}` | {f'`{spec.flag}`' if spec.flag else ''} | `{default_text(name)}` | "
                         f"{meaning} |")
        lines.append("")

    top = [n for n, sp in SPECS.items() if sp.group is None]
    section("Every role", "Read by every role.", top)
    for attr, cls in GROUPS.items():
        doc = " ".join((cls.__doc__ or "").split())
        section(f"`{attr}`", doc, [n for n, sp in SPECS.items() if sp.group == attr])
    return "\n".join(lines).rstrip() + "\n"


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One line per ``PHASEWISE_*`` variable that is no setting, naming the closest one.

    >>> env = {"PHASEWISE_BOOTSTRP": "x", "PHASEWISE_HOST": "h", "PHASEWISE_ZZZ": ""}
    >>> for line in unknown_env(env):
    ...     print(line)
    PHASEWISE_BOOTSTRP is not a setting and is ignored (did you mean PHASEWISE_BOOTSTRAP?)
    PHASEWISE_ZZZ is not a setting and is ignored
    """
    out = []
    for k in sorted(env):
        if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() not in SPECS:
            close = difflib.get_close_matches(k[len(ENV_PREFIX):].lower(), SPECS, n=1, cutoff=0.6)
            out.append(f"{k} is not a setting and is ignored"
                       + (f" (did you mean {SPECS[close[0]].env}?)" if close else ""))
    return out


def arg_type(parse: Callable[[str], Any], check: Callable[[Any], None] | None = None,
             name: str | None = None) -> Callable[[str], Any]:
    """An argparse ``type=``: *parse* then *check*, a ValueError's reason as the flag's error.

    >>> arg_type(parse_float, above(0))("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be > 0, got -1.0
    """
    def convert(text: str) -> Any:
        try:
            value = parse(text)
            if check is not None:
                check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    convert.__name__ = name or getattr(parse, "__name__", "value")
    return convert


if __name__ == "__main__":  # pragma: no cover - writes docs/configuration.md
    print(reference(), end="")
