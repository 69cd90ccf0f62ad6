"""The join of job events with their container's samples, pure: what a job used over its steady phase.

:class:`HorusJoin` knows a job from its ``submitted`` event, where it runs from its ``started`` event,
leaves out its loading phase (until the container's first phase change or ``warmup_s``), averages its
steady samples and observes it once (``observe_s`` of them, or at ``finished`` with ``min_samples``);
:meth:`HorusJoin.pop_dirty` / :meth:`HorusJoin.load` carry each job's state to a table and back.
Narrative: docs/horus.md, "The worker".

>>> from phasewise.kit.records import ContainerSample, HostSamples
>>> j = HorusJoin(JoinConfig(warmup_s=0, min_samples=2, observe_s=2))
>>> j.submitted("a", 0.0, {"flops": 1}, "mlp", None, {"cpu_cores": 1.0})
>>> j.started("a", "h1", "c1", 10.0)
>>> obs = []
>>> for t in (11.0, 12.0, 13.0):
...     obs += j.samples(HostSamples(host="h1", ts=t, interval_s=1.0,
...                      containers=(ContainerSample(container="c1", cpu_cores=2.0, mem_bytes=1e9),)))
>>> obs[0].observed
{'cpu_cores': 2.0, 'mem_bytes': 1000000000.0}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import HostSamples

__all__ = ["JoinConfig", "HorusJoin", "Observation"]

#: sums kept per job: sample field -> observed target
_SUMS = {"cpu_cores": "cpu_cores", "mem_bytes": "mem_bytes", "gpu_util": "gpu_util", "gpu_mem_bytes": "gpu_mem_bytes"}


@dataclass(frozen=True, slots=True)
class JoinConfig:
    """When a job's samples make an observation; from the ``horus_*`` settings, which hold the defaults
    (docs/architecture.md, "Defaults")."""

    warmup_s: float  #: seconds after start left out (the loading phase)
    min_samples: int  #: steady samples needed for an observation
    observe_s: float  #: steady seconds after which the job is observed (it may run for days)


@dataclass(frozen=True, slots=True)
class Observation:
    job: str
    ts: float
    features: dict
    model: str
    device: str | None
    observed: dict  #: target -> mean over the steady samples
    predicted: dict  #: target -> the mean predicted at submission (for the error metric)
    intervals: dict = dataclasses.field(default_factory=dict)  #: target -> [lo, hi] predicted at submission
    first_sight: bool = False  #: the prediction's (no job of its model had been learned)
    model_version: int = 0  #: the prediction's (jobs the model had learned)


class HorusJoin:
    def __init__(self, config: JoinConfig) -> None:
        self.config = config
        self._jobs: dict[str, dict[str, Any]] = {}
        self._where: dict[tuple[str, str], str] = {}  # (host, container) -> job
        self._dirty: set[str] = set()

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job: str) -> bool:
        return job in self._jobs

    def state(self, job: str) -> dict[str, Any] | None:
        """The job's JSON-able join state (None: forgotten)."""
        s = self._jobs.get(job)
        return None if s is None else dict(s)

    def load(self, job: str, state: Mapping[str, Any]) -> None:
        """Take back a state :meth:`state` returned (after a restart)."""
        s = dict(state)
        self._jobs[job] = s
        if s.get("h") is not None and s.get("c") is not None:
            self._where[(s["h"], s["c"])] = job

    def pop_dirty(self) -> list[tuple[str, dict[str, Any] | None]]:
        """``(job, state or None when forgotten)`` of the jobs changed since the last call."""
        out = [(j, self.state(j)) for j in sorted(self._dirty)]
        self._dirty.clear()
        return out

    def submitted(self, job: str, ts: float, features: dict, model: str, device: str | None,
                  predicted: Mapping[str, float], intervals: Mapping[str, tuple[float, float]] | None = None,
                  *, first_sight: bool = False, model_version: int = 0) -> None:
        old = self._jobs.get(job, {})
        self._jobs[job] = {"f": features, "m": model, "d": device, "p": dict(predicted), "ts": ts,
                           "pi": {t: list(v) for t, v in (intervals or {}).items()}, "fs": first_sight,
                           "mv": model_version,
                           "h": old.get("h"), "c": old.get("c"), "t0": old.get("t0"),
                           "n": 0, "s": {}, "ns": {}, "first": None, "last": None, "done": False}
        self._dirty.add(job)

    def started(self, job: str, host: str, container: str, ts: float) -> None:
        s = self._jobs.get(job)
        if s is None:  # started before (or without) its submission: remember where, learn nothing
            s = self._jobs[job] = {"f": None, "m": None, "d": None, "p": {}, "ts": ts, "n": 0, "s": {}, "ns": {},
                                   "first": None, "last": None, "done": False}
        if s.get("h") is not None:
            self._where.pop((s["h"], s["c"]), None)
        s.update(h=host, c=container, t0=ts, sf=None)
        self._where[(host, container)] = job
        self._dirty.add(job)

    def phase_change(self, host: str, container: str, ts: float) -> None:
        """The container entered a new phase at *ts*: the first one after its job started ends the loading."""
        job = self._where.get((host, container))
        if job is None:
            return
        s = self._jobs[job]
        if s.get("t0") is not None and ts > s["t0"] and s.get("sf") is None:
            s["sf"] = ts
            self._dirty.add(job)

    def finished(self, job: str, ts: float) -> Observation | None:
        """The job ended: its observation if it has enough steady samples and was not observed yet; forgets it."""
        s = self._jobs.get(job)
        if s is None:
            return None
        obs = None
        if not s["done"] and s["n"] >= self.config.min_samples:
            obs = self._observe(job, s, ts)
        self.forget(job)
        return obs

    def forget(self, job: str) -> None:
        s = self._jobs.pop(job, None)
        if s is not None and s.get("h") is not None:
            if self._where.get((s["h"], s["c"])) == job:
                del self._where[(s["h"], s["c"])]
        self._dirty.add(job)

    def samples(self, hs: HostSamples) -> list[Observation]:
        """Add a host's samples to the jobs running there; the observations that became complete."""
        out = []
        if not self._where:
            return out
        cfg = self.config
        for cs in hs.containers:
            job = self._where.get((hs.host, cs.container))
            if job is None:
                continue
            s = self._jobs[job]
            steady_from = s["t0"] + cfg.warmup_s if s.get("sf") is None else min(s["sf"], s["t0"] + cfg.warmup_s)
            if s["done"] or s["f"] is None or hs.ts < steady_from:
                continue
            if s["last"] is not None and hs.ts <= s["last"]:
                continue  # a sample seen before (a re-read after a restart) or out of order
            s["n"] += 1
            for fld, tgt in _SUMS.items():
                v = getattr(cs, fld)
                if v is not None:
                    s["s"][tgt] = s["s"].get(tgt, 0.0) + float(v)
                    s["ns"][tgt] = s["ns"].get(tgt, 0) + 1
            if s["first"] is None:
                s["first"] = hs.ts
            s["last"] = hs.ts
            self._dirty.add(job)
            if s["n"] >= cfg.min_samples and s["last"] - s["first"] >= cfg.observe_s:
                out.append(self._observe(job, s, hs.ts))
        return out

    def _observe(self, job: str, s: dict[str, Any], ts: float) -> Observation:
        s["done"] = True
        self._dirty.add(job)
        observed = {t: s["s"][t] / s["ns"][t] for t in s["s"] if s["ns"].get(t)}
        return Observation(job=job, ts=ts, features=s["f"], model=s["m"], device=s["d"], observed=observed,
                           predicted=dict(s["p"]), intervals=dict(s.get("pi") or {}),
                           first_sight=bool(s.get("fs")), model_version=int(s.get("mv") or 0))
