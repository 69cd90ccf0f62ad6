"""Every record phasewise puts on a topic, and the codec that reads and writes them; import them from here.

One module per record family (``samples``, ``jobs``, ``predictions``,
``decisions``, ``phases``), the codec (``codec``: field declarations, strict
decoding, encoding), the worker's column-wise samples decoder (``columns``)
and the JSON Schema writer (``json_schema``). Each record is a frozen
dataclass carrying ``v`` (its schema version) and ``ts`` (event time);
docs/architecture.md ("Records") says what decoding guarantees.
"""

from phasewise.kit.records.codec import (
    MAX_BYTES,
    MAX_CORES,
    MAX_MESSAGE_BYTES,
    MAX_PCT,
    SchemaError,
    brief,
    decode,
    encode,
    encode_within,
    from_dict,
    max_bytes,
    payload_text,
    to_dict,
)
from phasewise.kit.records.columns import decode_host_samples
from phasewise.kit.records.decisions import Actuation, DeadLetter, Decision
from phasewise.kit.records.jobs import (
    JOB_EVENT_KINDS,
    JOB_ID_PATTERN,
    MAX_COMMAND_ARGS,
    MAX_COMMAND_BYTES,
    MAX_JOB_EVENT_BYTES,
    TERMINAL_KINDS,
    JobControl,
    JobEvent,
    JobRequests,
    JobService,
    JobSpec,
    JobTargets,
)
from phasewise.kit.records.json_schema import json_schemas
from phasewise.kit.records.phases import ModelSnapshot, PhaseChange
from phasewise.kit.records.predictions import Interval, UtilisationPrediction
from phasewise.kit.records.samples import (
    LAYOUTS,
    MODES,
    UPDATE_MODES,
    WORKLOAD_POLICIES,
    ContainerIdentity,
    ContainerSample,
    ExecutionProfile,
    GpuSample,
    HostSamples,
    WorkloadPolicy,
)

__all__ = [
    "JOB_ID_PATTERN",
    "LAYOUTS",
    "MAX_BYTES",
    "MAX_COMMAND_ARGS",
    "MAX_COMMAND_BYTES",
    "MAX_CORES",
    "JOB_EVENT_KINDS",
    "MAX_JOB_EVENT_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_PCT",
    "MODES",
    "RECORDS",
    "TERMINAL_KINDS",
    "UPDATE_MODES",
    "WORKLOAD_POLICIES",
    "Actuation",
    "ContainerIdentity",
    "ContainerSample",
    "DeadLetter",
    "Decision",
    "ExecutionProfile",
    "GpuSample",
    "HostSamples",
    "Interval",
    "JobControl",
    "JobEvent",
    "JobRequests",
    "JobService",
    "JobSpec",
    "JobTargets",
    "ModelSnapshot",
    "PhaseChange",
    "SchemaError",
    "UtilisationPrediction",
    "WorkloadPolicy",
    "brief",
    "decode",
    "decode_host_samples",
    "encode",
    "encode_within",
    "from_dict",
    "json_schemas",
    "max_bytes",
    "payload_text",
    "to_dict",
]

#: every record class, top-level and nested (:func:`json_schemas` writes the top-level ones' schemas)
RECORDS: tuple[type, ...] = (
    HostSamples,
    ContainerSample,
    ContainerIdentity,
    WorkloadPolicy,
    GpuSample,
    JobEvent,
    JobSpec,
    JobRequests,
    JobService,
    JobTargets,
    Interval,
    UtilisationPrediction,
    Decision,
    Actuation,
    PhaseChange,
    ModelSnapshot,
    DeadLetter,
    JobControl,
    ExecutionProfile,
)
