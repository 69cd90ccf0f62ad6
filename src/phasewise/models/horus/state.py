"""The Horus agent's state, one record at a time: the utilisation model, the join of jobs with their
samples, and the table records they make.

Two sides, because horus workers sharing one ``horus_worker_id`` read the job events by job and the
samples by host. The **job side** predicts a submitted job's utilisation from its graph features
(:meth:`~HorusState.predict`) and keeps it in its book until the job ends; a ``started`` event
(:meth:`~HorusState.started`) and the job's end (:meth:`~HorusState.end`) become
:class:`~phasewise.kit.records.routes.HorusRoute` records for the worker that reads the job's host. The
**host side** takes those routes (:meth:`~HorusState.route`: where the job runs, with its prediction, its
end, and the containers' phase changes), averages the job's steady samples (:meth:`~HorusState.samples`)
and learns it once it has enough of them or ends, once per job. The model is rebuilt from the learned
observations, in order, when the agent restores its table; :meth:`~HorusState.merge` learns those another
horus worker shared (:mod:`phasewise.models.horus.snapshot`) and :meth:`~HorusState.shared` is what this
one shares. Narrative: docs/horus.md, "The worker" and "More than one worker".
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import HostSamples, Interval, JobEvent, UtilisationPrediction, from_dict, to_dict
from phasewise.kit.records.routes import HorusRoute
from phasewise.models.horus.catalog import model_key
from phasewise.models.horus.graph_features import FeatureError, GraphFeatures
from phasewise.models.horus.join import HorusJoin, JoinConfig, Observation
from phasewise.models.horus.model import TARGETS, HorusConfig, HorusModel
from phasewise.models.jobs.lifecycle import Lifecycle

__all__ = ["DEVICE_KEYS", "LEARNED_AT_END", "HorusState", "HorusStateConfig", "device_of"]

log = logging.getLogger(__name__)

#: node_selector keys that name a GPU model
DEVICE_KEYS = ("gpu", "gpu_model", "nvidia.com/gpu.product", "accelerator")
#: the ends after which a job that ran is learned (if it was not yet); ``rejected`` and ``lost`` learn nothing
LEARNED_AT_END = frozenset({"finished", "failed", "terminated"})


@dataclass(frozen=True)
class HorusStateConfig:
    """The Horus agent's parameters (:func:`phasewise.streams.config.horus_state_config` maps the
    ``horus_*`` settings onto them)."""

    #: the utilisation model's
    model: HorusConfig
    #: when a job's samples are steady and enough to learn from
    join: JoinConfig
    #: the job-events topic's partition count (the table's): a job's book entry goes to its job's partition,
    #: a job's join state to its host's (the samples topic is co-partitioned with it where workers share a group)
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
    """The model, the book of the jobs whose events this worker reads and the join of the jobs running on
    the hosts whose samples it reads, and their table records (``job/<id>``: a job's book entry, in its
    job's partition; ``run/<id>``: a job's join state, in its host's; ``obs/<n>``: a learned observation);
    the agents hold one."""

    def __init__(self, config: HorusStateConfig) -> None:
        self.config = config
        self.model_config = config.model
        self.join_config = config.join
        self.partitions = config.partitions
        self.model = HorusModel(self.model_config)
        self.join = HorusJoin(self.join_config)
        #: job side: job -> {"p": its prediction (a record's dict) or None, "m": model key, "ts", "h", "c"}
        self.book: dict[str, dict[str, Any]] = {}
        self._book_dirty: set[str] = set()
        self._run_partition: dict[str, int] = {}  # job -> the partition of its join state (for its delete)
        self._writes: dict[str, tuple[int, bytes | None]] = {}  # key -> (partition, value) for the next commit
        self.seq = 0
        #: the observations the model holds, by job, in the order learned (what :meth:`shared` gives)
        self.kept: OrderedDict[str, dict[str, Any]] = OrderedDict()
        #: the jobs seen end, and the lifecycle states ignored (repeated, after the end, of an unknown job)
        self.lifecycle = Lifecycle("horus")
        #: the newest shared snapshot version seen (this worker's next one is above it)
        self.snapshot_version = 0
        #: ``() -> the table partitions this worker holds now`` (set by the agent; ``None``: all of them)
        self.owned: Callable[[], set[int] | None] | None = None

    # -- table ---------------------------------------------------------------------------
    def partition(self, key: str) -> int:
        """The table partition of *key*: a job's book entry that of its job (the job-events topic's, CRC32 as
        librdkafka's default partitioner), an observation that of its key."""
        return zlib.crc32(key.encode()) % self.partitions

    def put(self, key: str, value: Any, partition: int | None = None) -> None:
        self._writes[key] = (self.partition(key) if partition is None else partition, None if value is None
                             else json.dumps(value, separators=(",", ":")).encode())

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the records changed since the last call (the
        book's and the join's changed jobs included)."""
        for job in sorted(self._book_dirty):
            self.put(f"job/{job}", self.book.get(job), self.partition(job))
        self._book_dirty.clear()
        for job, st in self.join.pop_dirty():
            if st is not None and st.get("h") is not None:
                self._run_partition[job] = self.partition(st["h"])
            part = self._run_partition.get(job, self.partition(job))
            if st is None:
                self._run_partition.pop(job, None)
            self.put(f"run/{job}", st, part)
        out = [(k, p, v) for k, (p, v) in self._writes.items()]
        self._writes.clear()
        return out

    def restore(self, items: Any, owned: set[int] | None = None) -> int:
        """Rebuild from the table's ``(key, value)`` items: observations replayed in order, book entries and
        join states loaded (only those of the partitions in *owned*, or else :attr:`owned`'s, where given:
        what this worker reads; an observation is the model's wherever it is); how many records."""
        if owned is None and self.owned is not None:
            owned = self.owned()
        self.model = HorusModel(self.model_config)
        self.join = HorusJoin(self.join_config)
        self.book.clear()
        self._run_partition.clear()
        self.kept.clear()
        obs, books, runs = [], [], []
        for k, raw in items:
            if raw is None:
                continue
            if k.startswith("obs/"):
                obs.append((int(k[4:]), _value(raw)))
            elif k.startswith("job/"):
                books.append((k[4:], _value(raw)))
            elif k.startswith("run/"):
                runs.append((k[4:], _value(raw)))
        for n, o in sorted(obs):
            self.model.learn_one(o["f"], o["o"], o.get("d"))
            self._keep(o.get("job") or f"#{n}", o)
        self.seq = max((n for n, _ in obs), default=-1) + 1
        for job, b in books:
            if owned is not None and self.partition(job) not in owned:
                continue
            if "n" in b:  # a join state as one worker kept both sides before: the job's book and its join
                runs.append((job, b))
                b = {"p": None, "m": b.get("m"), "ts": b.get("ts"), "h": b.get("h"), "c": b.get("c")}
            self.book[job] = b
        for job, st in runs:
            part = self.partition(st["h"]) if st.get("h") is not None else self.partition(job)
            if owned is not None and part not in owned:
                continue
            self.join.load(job, st)
            self._run_partition[job] = part
        log.info("restored %d learned jobs, %d booked and %d joined", len(obs), len(self.book), len(self.join))
        return len(obs) + len(self.book) + len(self.join)

    # -- job side ------------------------------------------------------------------------
    def _booked(self, job: str) -> None:
        self._book_dirty.add(job)

    def predict(self, event: JobEvent, f: GraphFeatures) -> UtilisationPrediction:
        """The prediction of a ``submitted`` event whose graph has features *f*; the job is booked with it."""
        spec = event.spec
        assert spec is not None
        device = device_of(spec.node_selector) or ("cpu" if spec.requests.gpus == 0 else None)
        p = self.model.predict_one(f, device)
        key = model_key(spec.model)
        pred = UtilisationPrediction(
            job=event.job, ts=event.ts, model_version=self.model.jobs, device=device,
            **{t: Interval(mean=p[t].mean, lo=p[t].lo, hi=p[t].hi) for t in TARGETS},
            coverage=self.model_config.coverage, first_sight=not self.model.seen(key), features=f.to_dict())
        old = self.book.get(event.job, {})
        self.book[event.job] = {"p": to_dict(pred), "m": key, "ts": event.ts, "h": old.get("h"), "c": old.get("c")}
        self._booked(event.job)
        return pred

    def started(self, event: JobEvent) -> HorusRoute | None:
        """A ``started`` event (its signature checked by the agent): the route to the worker reading its host,
        with the job's prediction (``None``: after the job's end, ignored and counted)."""
        if event.host is None or event.container is None:
            raise FeatureError("a started event needs host and container")
        if event.job in self.lifecycle.ended:
            if (why := self.lifecycle.unheld(event.job, event.kind, event.ts)) is not None:
                self.lifecycle.ignore(event.job, event.kind, why)
            return None
        # started before (or without) its submission: where it runs is routed, nothing is learned from it
        b = self.book.setdefault(event.job, {"p": None, "m": None, "ts": event.ts})
        b.update(h=event.host, c=event.container)
        self._booked(event.job)
        pred = None if b.get("p") is None else from_dict(UtilisationPrediction, b["p"])
        return HorusRoute(host=event.host, kind="started", ts=event.ts, event=event, prediction=pred,
                          model=b.get("m"))

    def end(self, event: JobEvent) -> HorusRoute | None:
        """A job's end (``finished``, ``failed``, ``terminated``, ``rejected``, ``lost``; signed, checked by the
        agent): forgotten here, and routed to the worker reading its host where it ran (``None``: it never
        started, or it is no job held here, ignored and counted unless read again)."""
        b = self.book.pop(event.job, None)
        if b is None:
            if (why := self.lifecycle.unheld(event.job, event.kind, event.ts)) is not None:
                self.lifecycle.ignore(event.job, event.kind, why)
            return None
        self.lifecycle.end(event.job, event.kind, event.ts)
        self._booked(event.job)
        if b.get("h") is None:
            return None
        return HorusRoute(host=b["h"], kind="end", ts=event.ts, event=event)

    # -- host side -----------------------------------------------------------------------
    def route(self, r: HorusRoute) -> list[tuple[Observation, dict[str, float]]]:
        """A route to this worker (its host's samples are read here): a job started there (it joins, with
        its prediction), a job's end (learned now where it ran and was not yet, and forgotten) or a phase
        change (the first after a job started ends its loading); what was learned."""
        if r.kind == "phase":
            if r.phase is not None:
                self.join.phase_change(r.phase.host, r.phase.container, r.phase.ts)
            return []
        ev = r.event
        if ev is None:
            raise FeatureError(f"a {r.kind} route needs its job event")
        if r.kind == "started":
            if ev.host is None or ev.container is None:
                raise FeatureError("a started route needs host and container")
            st = self.join.state(ev.job)
            if st is not None and (st.get("h"), st.get("c"), st.get("t0")) == (ev.host, ev.container, ev.ts):
                return []  # the same route again (its sender restarted before its commit)
            pr = r.prediction
            if st is None and pr is not None:
                self.join.submitted(ev.job, pr.ts, dict(pr.features), r.model or "", pr.device,
                                    {t: getattr(pr, t).mean for t in TARGETS},
                                    {t: (getattr(pr, t).lo, getattr(pr, t).hi) for t in TARGETS},
                                    first_sight=pr.first_sight, model_version=pr.model_version)
            self.join.started(ev.job, ev.host, ev.container, ev.ts)
            log.info("job %s joined: %s/%s%s", ev.job, ev.host, ev.container,
                     "" if pr is not None or st is not None else " (no prediction: nothing to learn)")
            return []
        if ev.kind in LEARNED_AT_END:
            obs = self.join.finished(ev.job, ev.ts)
            return self.learn_all([obs] if obs is not None else [])
        self.join.forget(ev.job)  # it never ran here: nothing to learn
        return []

    def samples(self, hs: HostSamples) -> list[tuple[Observation, dict[str, float]]]:
        """A host's samples, joined with the started jobs' containers; the jobs learned."""
        return self.learn_all(self.join.samples(hs))

    # -- learning ------------------------------------------------------------------------
    def _keep(self, job: str, o: dict[str, Any]) -> None:
        self.kept.pop(job, None)
        self.kept[job] = {"job": job, "f": o["f"], "o": o["o"], "d": o.get("d")}
        while len(self.kept) > self.model_config.max_observations:
            self.kept.popitem(last=False)

    def _record(self, job: str, features: dict, observed: dict, device: str | None, **extra: Any) -> None:
        """Learn one observation and write it to the table (the oldest beyond the model's window goes)."""
        self.model.learn_one(features, observed, device)
        rec = {"f": features, "o": observed, "d": device, "job": job, **extra}
        self.put(f"obs/{self.seq:012d}", rec)
        self._keep(job, rec)
        old = self.seq - self.model_config.max_observations
        if old >= 0:
            self.put(f"obs/{old:012d}", None)
        self.seq += 1

    def learn(self, o: Observation) -> dict[str, float] | None:
        """Learn one observation; its prediction's absolute log error per target (``None``: the job was
        learned already, here or by another horus worker, and is not learned again)."""
        if o.job in self.kept:
            return None
        self._record(o.job, o.features, o.observed, o.device)
        return {t: abs(math.log1p(o.predicted[t]) - math.log1p(v)) for t, v in o.observed.items()
                if t in o.predicted}

    def learn_all(self, observations: list[Observation]) -> list[tuple[Observation, dict[str, float]]]:
        """:meth:`learn` each, in order: ``(observation, its absolute log error per target)`` of those learned."""
        out = []
        for o in observations:
            errors = self.learn(o)
            if errors is None:
                log.info("job %s was learned already (a shared snapshot): not learned again", o.job)
                continue
            out.append((o, errors))
            log.info("learned job %s (%s): %s", o.job, o.model,
                     ", ".join(f"{t}={v:.4g}" for t, v in sorted(o.observed.items())))
        return out

    def outcome(self, o: Observation, errors: dict[str, float]) -> UtilisationPrediction | None:
        """The prediction *o*'s job got at submission, published again with what was observed and the log
        error per target (``None`` for a job learned without its prediction's intervals: before this was kept)."""
        if not all(t in o.predicted and t in o.intervals for t in TARGETS):
            return None
        return UtilisationPrediction(
            job=o.job, ts=o.ts, model_version=o.model_version, device=o.device,
            **{t: Interval(mean=o.predicted[t], lo=o.intervals[t][0], hi=o.intervals[t][1]) for t in TARGETS},
            coverage=self.model_config.coverage, first_sight=o.first_sight, features=o.features,
            observed={t: float(v) for t, v in o.observed.items()}, log_error=dict(errors))

    # -- sharing -------------------------------------------------------------------------
    def shared(self) -> list[dict[str, Any]]:
        """The observations this worker shares (``{"job", "f", "o", "d"}``, in the order learned)."""
        return list(self.kept.values())

    def merge(self, observations: list[dict[str, Any]], version: int) -> int:
        """Learn the shared *observations* (a snapshot's, :func:`~phasewise.models.horus.snapshot.observations_of`)
        of jobs not learned here, in order; how many. *version*: the snapshot's (this worker's next is above)."""
        self.snapshot_version = max(self.snapshot_version, version)
        n = 0
        for o in observations:
            if o["job"] in self.kept:
                continue
            try:
                self._record(o["job"], o["f"], o["o"], o["d"], shared=True)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                log.warning("shared observation of job %s not learned: %s: %s", o["job"], type(e).__name__, e)
                continue
            n += 1
        return n
