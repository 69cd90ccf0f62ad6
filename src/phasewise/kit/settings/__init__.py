"""One frozen :class:`Settings` per process, read from ``PHASEWISE_*`` and flags; import every name from here.

The package holds the frame a setting is declared in (``spec``), the groups by
area (``kafka``, ``host``, ``worker``, ``safety``, ``actuator``, ``trust``,
``jobs``), :class:`Settings` itself (``process``) and the reference writer
(``reference``; ``python -m phasewise.kit.settings > docs/configuration.md``).
Code outside the package imports from ``phasewise.kit.settings`` only.
docs/architecture.md ("Settings") says how settings are declared and read.
"""

from phasewise.kit.settings.actuator import BACKENDS, JOB_ENV_PER_JOB, ActuatorSettings, parse_job_env
from phasewise.kit.settings.host import (
    CGROUP_LAYOUTS,
    CgroupSettings,
    ProducerSettings,
    WorkloadSettings,
    relative_cgroup_path,
)
from phasewise.kit.settings.jobs import (
    AutoscaleSettings,
    HorusSettings,
    PlacementSettings,
    PrioritySettings,
    TargetsSettings,
)
from phasewise.kit.settings.kafka import KAFKA_SASL_MECHANISMS, KAFKA_SECURITY_PROTOCOLS, KafkaSettings
from phasewise.kit.settings.process import GROUPS, LOG_LEVELS, SPECS, Settings, shown, unknown_env
from phasewise.kit.settings.reference import default_text, reference
from phasewise.kit.settings.safety import IntakeSettings, SafetySettings
from phasewise.kit.settings.spec import (
    ENV_PREFIX,
    SettingsError,
    Spec,
    above,
    at_least,
    format_size,
    in_range,
    non_empty,
    one_of,
    parse_bool,
    parse_float,
    parse_int,
    parse_size,
    parse_str,
    port,
    setting,
)
from phasewise.kit.settings.trust import JobSettings, SigningSettings
from phasewise.kit.settings.worker import (
    PHASE_STATISTICS,
    VPA_UPDATE_MODES,
    PhaseSettings,
    VpaSettings,
    WorkerSettings,
    feature_tuple,
)

__all__ = [
    "AutoscaleSettings",
    "BACKENDS",
    "CGROUP_LAYOUTS",
    "ENV_PREFIX",
    "GROUPS",
    "JOB_ENV_PER_JOB",
    "KAFKA_SASL_MECHANISMS",
    "KAFKA_SECURITY_PROTOCOLS",
    "LOG_LEVELS",
    "PHASE_STATISTICS",
    "SPECS",
    "VPA_UPDATE_MODES",
    "ActuatorSettings",
    "CgroupSettings",
    "HorusSettings",
    "IntakeSettings",
    "JobSettings",
    "KafkaSettings",
    "PhaseSettings",
    "PlacementSettings",
    "PrioritySettings",
    "ProducerSettings",
    "SafetySettings",
    "Settings",
    "SettingsError",
    "SigningSettings",
    "Spec",
    "TargetsSettings",
    "VpaSettings",
    "WorkerSettings",
    "WorkloadSettings",
    "above",
    "at_least",
    "default_text",
    "feature_tuple",
    "format_size",
    "in_range",
    "non_empty",
    "one_of",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_job_env",
    "parse_size",
    "parse_str",
    "port",
    "reference",
    "relative_cgroup_path",
    "setting",
    "shown",
    "unknown_env",
]
