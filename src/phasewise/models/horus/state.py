"""The Horus agent's state, one record at a time: the utilisation model, the join of jobs with their
samples, and the table records they make.

:class:`HorusState` predicts a submitted job's utilisation from its graph features
(:meth:`~HorusState.predict`), follows where it runs (:meth:`~HorusState.started`), averages its steady
samples (:meth:`~HorusState.samples`, :meth:`~HorusState.phase_change`) and learns it once it has enough
of them or finishes (:meth:`~HorusState.finished`); a job that fails, is rejected or lost is forgotten
(:meth:`~HorusState.ended`). The model is rebuilt from the learned observations,
in order, when the agent restores its table. Narrative: docs/horus.md, "The worker".
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import HostSamples, Interval, JobEvent, PhaseChange, UtilisationPrediction
from phasewise.models.horus.catalog import model_key
from phasewise.models.horus.graph_features import FeatureError, GraphFeatures
from phasewise.models.horus.join import HorusJoin, JoinConfig, Observation
from phasewise.models.horus.model import TARGETS, HorusConfig, HorusModel

__all__ = ["DEVICE_KEYS", "HorusState", "HorusStateConfig", "device_of"]

log = logging.getLogger(__name__)

#: node_selector keys that name a GPU model
DEVICE_KEYS = ("gpu", "gpu_model", "nvidia.com/gpu.product", "accelerator")


@dataclass(frozen=True)
class HorusStateConfig:
    """The Horus agent's parameters (:func:`phasewise.streams.config.horus_state_config` maps the
    ``horus_*`` settings onto them)."""

    #: the utilisation model's
    model: HorusConfig
    #: when a job's samples are steady and enough to learn from
    join: JoinConfig
    #: the job-events topic's partition count (the table's: a record goes to the partition of its key)
    partitions: int


def device_of(node_selector: dict) -> str | None:
    """The GPU model a job's node selector names (:data:`DEVICE_KEYS`), or ``None``.

    >>> device_of({"nvidia.com/gpu.product": "A100"}), device_of({"zone": "a"})
    ('A100', None)
    """
    for k in DEVICE_KEYS:
        v = node_selector.get(k)
        if isinstance(v, str) and v:
            return v
    return None


def _value(raw: Any) -> Any:
    """A table value as written (JSON bytes) or as Faust restored it (decoded JSON)."""
    return json.loads(raw) if isinstance(raw, (bytes, str)) else raw


class HorusState:
    """The model and the join, and their table records (``job/<id>``: a job's join state, ``obs/<n>``: a
    learned observation); the agents hold one."""

    def __init__(self, config: HorusStateConfig) -> None:
        self.config = config
        self.model_config = config.model
        self.join_config = config.join
        self.partitions = config.partitions
        self.model = HorusModel(self.model_config)
        self.join = HorusJoin(self.join_config)
        self._writes: dict[str, tuple[int, bytes | None]] = {}  # key -> (partition, value) for the next commit
        self.seq = 0

    # -- table ---------------------------------------------------------------------------
    def partition(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.partitions

    def put(self, key: str, value: Any) -> None:
        self._writes[key] = (self.partition(key), None if value is None else json.dumps(
            value, separators=(",", ":")).encode())

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the records changed since the last call (the
        join's changed jobs included)."""
        for job, s in self.join.pop_dirty():
            self.put(f"job/{job}", s)
        out = [(k, p, v) for k, (p, v) in self._writes.items()]
        self._writes.clear()
        return out

    def restore(self, items: Any) -> int:
        """Rebuild from the table's ``(key, value)`` items: observations replayed in order, jobs loaded; how
        many records."""
        self.model = HorusModel(self.model_config)
        self.join = HorusJoin(self.join_config)
        obs, jobs = [], []
        for k, raw in items:
            if raw is None:
                continue
            if k.startswith("obs/"):
                obs.append((int(k[4:]), _value(raw)))
            elif k.startswith("job/"):
                jobs.append((k[4:], _value(raw)))
        for _, o in sorted(obs):
            self.model.learn_one(o["f"], o["o"], o.get("d"))
        self.seq = max((n for n, _ in obs), default=-1) + 1
        for job, s in jobs:
            self.join.load(job, s)
        log.info("restored %d learned jobs and %d tracked jobs", len(obs), len(jobs))
        return len(obs) + len(jobs)

    # -- records -------------------------------------------------------------------------
    def predict(self, event: JobEvent, f: GraphFeatures) -> UtilisationPrediction:
        """The prediction of a ``submitted`` event whose graph has features *f*; the job joins."""
        spec = event.spec
        assert spec is not None
        device = device_of(spec.node_selector) or ("cpu" if spec.requests.gpus == 0 else None)
        p = self.model.predict_one(f, device)
        key = model_key(spec.model)
        feats = f.to_dict()
        self.join.submitted(event.job, event.ts, feats, key, device, {t: p[t].mean for t in TARGETS})
        return UtilisationPrediction(
            job=event.job, ts=event.ts, model_version=self.model.jobs, device=device,
            **{t: Interval(mean=p[t].mean, lo=p[t].lo, hi=p[t].hi) for t in TARGETS},
            coverage=self.model_config.coverage, first_sight=not self.model.seen(key), features=feats)

    def started(self, event: JobEvent) -> None:
        """A ``started`` event (its signature checked by the agent): where the job runs."""
        if event.host is None or event.container is None:
            raise FeatureError("a started event needs host and container")
        self.join.started(event.job, event.host, event.container, event.ts)

    def finished(self, event: JobEvent) -> list[tuple[Observation, dict[str, float]]]:
        """A ``finished`` event: the job observed (when it was long enough) and forgotten; what it learned."""
        obs = self.join.finished(event.job, event.ts)
        return self.learn_all([obs] if obs is not None else [])

    def ended(self, event: JobEvent) -> None:
        """A ``failed``, ``rejected`` or ``lost`` event (signed, checked by the agent): the job is forgotten,
        nothing learned from it (docs/jobs.md, "Who frees what")."""
        if event.job in self.join:
            self.join.forget(event.job)

    def phase_change(self, pc: PhaseChange) -> None:
        """A container's phase change (the first after its job started ends the loading phase)."""
        self.join.phase_change(pc.host, pc.container, pc.ts)

    def samples(self, hs: HostSamples) -> list[tuple[Observation, dict[str, float]]]:
        """A host's samples, joined with the started jobs' containers; the jobs learned."""
        return self.learn_all(self.join.samples(hs))

    # -- learning ------------------------------------------------------------------------
    def learn(self, o: Observation) -> dict[str, float]:
        """Learn one observation; its prediction's absolute log error per target."""
        self.model.learn_one(o.features, o.observed, o.device)
        self.put(f"obs/{self.seq:012d}", {"f": o.features, "o": o.observed, "d": o.device, "job": o.job})
        old = self.seq - self.model_config.max_observations
        if old >= 0:
            self.put(f"obs/{old:012d}", None)
        self.seq += 1
        return {t: abs(math.log1p(o.predicted[t]) - math.log1p(v)) for t, v in o.observed.items()
                if t in o.predicted}

    def learn_all(self, observations: list[Observation]) -> list[tuple[Observation, dict[str, float]]]:
        """:meth:`learn` each, in order: ``(observation, its absolute log error per target)``."""
        out = []
        for o in observations:
            out.append((o, self.learn(o)))
            log.info("learned job %s (%s): %s", o.job, o.model,
                     ", ".join(f"{t}={v:.4g}" for t, v in sorted(o.observed.items())))
        return out
