"""The worker's live scorecard: the pure :class:`~phasewise.models.scoring.scorecard.Scorecard` behind a
lock (:class:`LiveScorecard`), its Prometheus collector (scored when scraped) and its ``/scorecard/``
view, which ``phasewise explain`` reads. Narrative: docs/worker.md, "The live scorecard".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from phasewise.kit.records import ContainerSample, Decision, HostSamples
from phasewise.models.safety.workload import policy_of
from phasewise.models.scoring.scorecard import POLICIES, RESOURCES, ScorecardConfig, make_scorecard

__all__ = ["LiveScorecard", "window_label"]


def window_label(w: float) -> str:
    """``600.0`` -> ``"600s"``."""
    return f"{w:g}s"


class LiveScorecard:
    """:class:`~phasewise.models.scoring.scorecard.Scorecard` (or its exact variant) for the worker
    (thread-safe, with views)."""

    #: refused containers remembered for ``explain`` at most (the oldest are forgotten first)
    MAX_REFUSED = 10_000

    def __init__(self, config: ScorecardConfig, *, vpa_cache: Any = None, phase: Any = None,
                 policy: str = "vpa", served: Sequence[str] = ("vpa",), every_s: float = 1.0, share: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = make_scorecard(config)
        self.lock = threading.Lock()
        #: *policy*: the worker's default (``--policy``); *served*: every policy it decides with
        self.vpa_cache, self.phase, self.policy, self.served = vpa_cache, phase, policy, tuple(served)
        #: containers refused a policy the worker does not run: key -> (their last sample, why)
        self._refused: dict[str, tuple[ContainerSample, str]] = {}
        #: a scrape rescores when the last scoring is older than *every_s* and than its own duration / *share*
        #: (scoring takes at most that share of a core, however often Prometheus or a bench scrapes)
        self.every_s, self.share, self.clock = every_s, share, clock
        self._totals: tuple[float, dict] | None = None
        self._took = 0.0
        self._last_msg: dict[str, HostSamples] = {}

    # ------------------------------------------------------------------ fed by worker_round

    def observe_round(self, msgs: Sequence[HostSamples]) -> None:
        with self.lock:
            self.model.observe_round(msgs)
            for m in msgs:  # who each container is and its mode, looked up when explained
                self._last_msg[m.host] = m
            if self._refused:  # decided again (its workload changed): no longer refused
                for m in msgs:
                    for c in m.containers:
                        self._refused.pop(f"{m.host}/{c.container}", None)

    def refuse(self, key: str, sample: ContainerSample, reason: str) -> None:
        """Remember that container *key* is refused (a policy this worker does not run), and why."""
        with self.lock:
            self._refused.pop(key, None)
            self._refused[key] = (sample, reason)
            if len(self._refused) > self.MAX_REFUSED:
                del self._refused[next(iter(self._refused))]
            if key in self.model:  # decided before, refused now: its scores stop here
                self.model.forget([key])

    def decide_many(self, decisions: Sequence[Decision]) -> None:
        if decisions:
            with self.lock:
                self.model.decide_many(decisions)

    def forget(self, keys: Iterable[str]) -> None:
        with self.lock:
            self.model.forget(keys)

    def clear(self) -> None:
        with self.lock:
            self.model.clear()
            self._last_msg.clear()
            self._refused.clear()

    # ------------------------------------------------------------------ metrics

    def collect(self) -> Iterable[Any]:
        """The Prometheus collector protocol: the fleet's scores per (policy, resource, window)."""
        from prometheus_client.core import GaugeMetricFamily

        labels = ["policy", "resource", "window"]
        fams = {
            "alloc_over_used": GaugeMetricFamily(
                "phasewise_worker_scorecard_alloc_over_used",
                "sum(limit x dt) / sum(used x dt) over the window, all containers (as phasewise replay)",
                labels=labels),
            "fulfilment": GaugeMetricFamily(
                "phasewise_worker_scorecard_fulfilment",
                "share of scored samples whose usage the limit covered, all containers (as phasewise replay)",
                labels=labels),
            "steps": GaugeMetricFamily("phasewise_worker_scorecard_steps", "samples scored in the window",
                                       labels=labels),
        }
        now = self.clock()
        if self._totals is None or now - self._totals[0] >= max(self.every_s, self._took / self.share):
            t0 = time.perf_counter()
            with self.lock:  # copy the summaries (a memcpy), score outside the lock
                chunks = self.model.chunks()
            self._totals = (now, self.model.totals_of(chunks))
            self._took = time.perf_counter() - t0
        totals = self._totals[1]
        for w, per_r in totals.items():
            for r in RESOURCES:
                for p in POLICIES:
                    s = per_r[r].get(p)
                    if s is None:
                        continue
                    lab = [p, r, window_label(w)]
                    fams["steps"].add_metric(lab, s.steps)
                    if s.alloc_over_used is not None:
                        fams["alloc_over_used"].add_metric(lab, s.alloc_over_used)
                    if s.fulfilment is not None:
                        fams["fulfilment"].add_metric(lab, s.fulfilment)
        yield from fams.values()

    def describe(self) -> Iterable[Any]:
        return []  # collected lazily: nothing is scored at registration

    # ------------------------------------------------------------------ the explain view

    def containers(self) -> list[str]:
        with self.lock:
            return sorted(self.model.keys())

    def refused(self) -> list[str]:
        """The containers refused a policy this worker does not run (remembered for ``explain``)."""
        with self.lock:
            return sorted(self._refused)

    def find(self, container: str) -> list[str]:
        """Keys matching *container*: ``host/container`` exactly, else every host's ``container``
        (held or refused)."""
        with self.lock:
            if container in self.model or container in self._refused:
                return [container]
            keys = set(self.model.keys()) | set(self._refused)
            return sorted(k for k in keys if k.partition("/")[2] == container)

    def explain(self, key: str) -> dict[str, Any] | None:
        """Everything ``phasewise explain`` shows for one ``host/container`` (None: not held here).

        ``policy`` is the policy the container is decided with (its workload's, else the worker's
        default, ``worker_policy``); a refused container's card says why in ``refused``."""
        with self.lock:
            if key not in self.model:
                got = self._refused.get(key)
                if got is None:
                    return None
                c, reason = got
                return {"container": key, "policy": policy_of(c, self.policy), "worker_policy": self.policy,
                        "served": list(self.served), "refused": reason, "identity": _plain(c.identity),
                        "workload": _plain(c.workload)}
            card = self.model.card(key)
            who = self._who(key)
            c = who.pop("sample")
            out: dict[str, Any] = {"container": key, "policy": self.policy if c is None else policy_of(c, self.policy),
                                   "worker_policy": self.policy, "served": list(self.served), **card}
            out.update(who)
            out["vpa"] = self._vpa(key)
            out["phase"] = self._phase(key)
        return out

    def _who(self, key: str) -> dict[str, Any]:
        """The container's last sample, identity and per-workload policy, from its host's last message."""
        host, _, name = key.partition("/")
        m = self._last_msg.get(host)
        c = next((c for c in m.containers if c.container == name), None) if m is not None else None
        if c is None:
            return {"sample": None, "identity": None, "workload": None}
        return {"sample": c, "identity": _plain(c.identity), "workload": _plain(c.workload)}

    def _vpa(self, key: str) -> dict[str, Any] | None:
        cache = self.vpa_cache
        if cache is None or key not in cache:
            return None
        e = cache.get(key)
        model = e.model
        return {"decided": {"cpu": e.decided_cpu, "mem": e.decided_mem},
                "recommendation": _clean(model.predict_one()), "numbers": _clean(model.explain())}

    def _phase(self, key: str) -> dict[str, Any] | None:
        if self.phase is None:
            return None
        try:
            st = self.phase.hooks.fleet.state_of(key)
        except KeyError:
            return None
        feats = list(self.phase.hooks.fleet.resources)
        return {"phase": st.get("p"), "since": st.get("s"), "model_version": self.phase.hooks.version,
                "name": self._phase_name(st.get("p")),
                "handed": dict(zip(feats, st.get("h") or [])),
                "from_phase": dict(zip(feats, st.get("src") or [])),
                "basis_quantile": dict(zip(feats, st.get("b") or []))}

    def _phase_name(self, phase: int | None) -> str | None:
        """The phase named by its profile against the other open phases (:mod:`phasewise.models.phases.names`)."""
        if phase is None or phase < 0:
            return None
        from phasewise.models.phases.names import phase_names

        clusterer = self.phase.hooks.fleet.model.clusterer
        return phase_names({p: clusterer.phase_stats(p) for p in clusterer.phase_ids}).get(phase)

    def view(self, container: str | None) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) of ``GET /scorecard/[?container=...]``."""
        if not container:
            return 200, {"containers": self.containers(), "refused": self.refused()}
        keys = self.find(container)
        if not keys:
            return 404, {"error": f"no container {container!r} on this worker"}
        if len(keys) > 1:
            return 409, {"error": f"{container!r} is on several hosts; name one of: {', '.join(keys)}"}
        got = self.explain(keys[0])
        return (200, got) if got is not None else (404, {"error": f"container {container!r} just left"})


def _plain(rec: Any) -> dict[str, Any] | None:
    """A record as a dict without its ``None`` fields (``None`` for no record)."""
    if rec is None:
        return None
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(rec).items() if v is not None}


def _clean(obj: Any) -> Any:
    """Non-finite floats as None (JSON has no inf/nan)."""
    import math

    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


