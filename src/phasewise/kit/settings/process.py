""":class:`Settings`, every setting of a process: the few every role reads and one group per concern.

Also :data:`SPECS` (every setting's declaration by its flat name) and :data:`GROUPS`;
docs/architecture.md ("Settings") says how they are read, docs/configuration.md lists them.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from phasewise.kit.settings.actuator import ActuatorSettings
from phasewise.kit.settings.host import CgroupSettings, ProducerSettings, WorkloadSettings
from phasewise.kit.settings.jobs import (
    AutoscaleSettings,
    HorusSettings,
    PlacementSettings,
    PrioritySettings,
    TargetsSettings,
)
from phasewise.kit.settings.kafka import KafkaSettings
from phasewise.kit.settings.safety import IntakeSettings, SafetySettings
from phasewise.kit.settings.spec import (
    ENV_PREFIX,
    Group,
    SettingsError,
    Spec,
    group,
    is_group_field,
    non_empty,
    own_specs,
    port,
    setting,
)
from phasewise.kit.settings.trust import JobSettings, SigningSettings
from phasewise.kit.settings.worker import PhaseSettings, VpaSettings, WorkerSettings
from phasewise.kit.statedir import default_data_dir

__all__ = ["GROUPS", "LOG_LEVELS", "SPECS", "Settings", "shown", "unknown_env"]

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class Settings(Group):
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
    autoscale: AutoscaleSettings = group(AutoscaleSettings)
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
GROUPS: dict[str, type[Group]] = {f.name: f.default_factory for f in fields(Settings)
                                   if is_group_field(f)}


def _all_specs() -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    specs = [*own_specs(Settings), *(dataclasses.replace(s, group=g) for g, cls in GROUPS.items()
                                      for s in own_specs(cls))]
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


#: ``PHASEWISE_*`` variables that are no setting on purpose: the actuator sets ``PHASEWISE_JOB`` (the job's
#: id) in the environment of a job it starts, where the job's own ``phasewise progress`` reads its settings
NOT_SETTINGS = frozenset({"PHASEWISE_JOB"})


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One line per ``PHASEWISE_*`` variable that is no setting (:data:`NOT_SETTINGS` aside), naming the closest one.

    >>> env = {"PHASEWISE_BOOTSTRP": "x", "PHASEWISE_HOST": "h", "PHASEWISE_ZZZ": ""}
    >>> for line in unknown_env(env):
    ...     print(line)
    PHASEWISE_BOOTSTRP is not a setting and is ignored (did you mean PHASEWISE_BOOTSTRAP?)
    PHASEWISE_ZZZ is not a setting and is ignored
    >>> unknown_env({"PHASEWISE_JOB": "j1"})
    []
    """
    out = []
    for k in sorted(env):
        if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() not in SPECS and k not in NOT_SETTINGS:
            close = difflib.get_close_matches(k[len(ENV_PREFIX):].lower(), SPECS, n=1, cutoff=0.6)
            out.append(f"{k} is not a setting and is ignored"
                       + (f" (did you mean {SPECS[close[0]].env}?)" if close else ""))
    return out
