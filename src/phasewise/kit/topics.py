"""The topics: names (with a format version), keys and partition counts, the contract with subscribers.

docs/operations.md ("Topics") lists them; a breaking change to a record gets a new topic.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topic", "TOPICS", "topic_names"]


@dataclass(frozen=True, slots=True)
class Topic:
    name: str
    key: str
    partitions: int
    compacted: bool = False
    doc: str = ""


SAMPLES = Topic("phasewise.samples.v1", "host", 8, doc="HostSamples, one per host per tick")
JOB_EVENTS = Topic("phasewise.job-events.v1", "job", 8, doc="JobEvent")
PHASES = Topic("phasewise.phases.v1", "container", 8, doc="PhaseChange")
PREDICTIONS = Topic("phasewise.predictions.v1", "job", 4, doc="UtilisationPrediction")
DECISIONS = Topic("phasewise.decisions.v1", "host", 8, doc="Decision, in order per host")
ACTUATIONS = Topic("phasewise.actuations.v1", "host", 8, doc="Actuation results, audit")
MODELS = Topic("phasewise.models.v1", "model name", 1, compacted=True, doc="ModelSnapshot")
PROFILES = Topic("phasewise.profiles.v1", "host/container", 8, compacted=True,
                 doc="ExecutionProfile: what each run of a signed workload used (the priors of its next runs)")
CONTROL = Topic("phasewise.control.v1", "job", 8, doc="JobControl: checkpoint_exit, pause, resume to a job")
DEAD_LETTERS = Topic("phasewise.deadletters.v1", "source key", 4, doc="DeadLetter")
#: internal (not in :data:`TOPICS`; ``phasewise worker --policy phase`` creates it with exactly one
#: partition, one owner): sampled detector windows for the phase learner (:mod:`phasewise.kit.records.learn_batches`)
LEARN_WINDOWS = Topic("phasewise.learn-windows.v1", "model name", 1,
                      doc="internal: sampled detector windows for the phase learner")
#: internal (not in :data:`TOPICS`; ``phasewise horus`` creates it with the samples topic's partition count):
#: job events and phase changes routed to the horus worker reading their host's samples
#: (:mod:`phasewise.kit.records.routes`)
HORUS_ROUTES = Topic("phasewise.horus-routes.v1", "host", 8,
                     doc="internal: HorusRoute, to the horus worker reading the host's samples")

TOPICS: tuple[Topic, ...] = (
    SAMPLES,
    JOB_EVENTS,
    PHASES,
    PREDICTIONS,
    DECISIONS,
    ACTUATIONS,
    MODELS,
    CONTROL,
    DEAD_LETTERS,
    PROFILES,
)


def topic_names() -> list[str]:
    return [t.name for t in TOPICS]
