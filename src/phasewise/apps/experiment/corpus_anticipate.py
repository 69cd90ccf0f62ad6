"""``phasewise experiment corpus anticipate``: anticipated phase transitions scored on the corpus.

Each scored execution runs through the worker's own round (the VPA updater, then the phase detectors,
:func:`~phasewise.models.vpa.updater.worker_round`, as ``phasewise worker --policy phase`` runs it; the
shipped model, frozen, so every horizon sees the same phases) after the train split's runs of its kind,
fed first, one after the other, as earlier runs of the same signature: their phase exits are what the
transition book knows when the scored run starts, and the scored run's own exits are learned as they
happen. The bare policy is scored (no safety rules: they keep every corpus execution unlimited, all of
them being shorter than ``safety_min_history_s``), for each horizon (0: anticipation off) on the same
steps, beside the reactive members (VPA and the window family) and the reactive frontier there.
docs/phases.md, "Anticipated transitions".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.apps.experiment.corpus_plan import CorpusError
from phasewise.apps.experiment.corpus_prior import RESOURCES, _baselines, in_force, split_series
from phasewise.kit.records import ContainerSample, HostSamples, WorkloadPolicy

__all__ = ["HORIZONS", "anticipate", "format_anticipate", "run_with_transitions"]

#: horizons scored by default: off (the setting's default), then 5, 10 and 20 s
HORIZONS = (0.0, 5.0, 10.0, 20.0)
#: seconds of event time between two fed runs
GAP_S = 30.0


def worker_settings(horizon: float, model: str, overrides: dict[str, Any] | None) -> Any:
    """A replay phase worker's settings (the shipped *model*, frozen, no safety rules unless *overrides*
    say so) with anticipation at *horizon* seconds (0: off)."""
    from phasewise.apps.replay.through_kafka import replay_settings_env
    from phasewise.apps.replay.traces import Trace
    from phasewise.kit.settings import Settings

    env = replay_settings_env("phase", Trace("corpus", "-", {"cpu": "cores", "mem": "bytes"}, []),
                              frozen_model=True, pretrained=model)
    return Settings.from_env({"bootstrap": "in-process", "host": "corpus", "phase_anticipate_horizon_s": horizon,
                              **(overrides or {})}, env=env)


def run_with_transitions(settings: Any, earlier: Sequence[Any], series: Any, signature: str,
                         workload: WorkloadPolicy | None = None, model: Any = None
                         ) -> tuple[dict[str, np.ndarray], list[Any], list[Any], np.ndarray]:
    """*series* through the worker's round after *earlier* (runs of *signature*, one after the other); per
    resource the phase limit in force at each of its steps (NaN: none), its decisions, the phase changes of
    every run fed (containers ``earlier-<i>`` and ``run``) and its steps' event times as fed. *workload*:
    every run's workload settings (default: mode ``apply`` and the signature); *model*: a PhaseModel to run
    instead of the settings' shipped one."""
    from phasewise.apps.replay.through_kafka import _InProcessPhase
    from phasewise.models.vpa.updater import worker_round
    from phasewise.streams.config import state_cache, updater_config

    cache, config = state_cache(settings), updater_config(settings)
    phase = _InProcessPhase(settings, cache, frozen=True, model=model)
    workload = workload or WorkloadPolicy(mode="apply", signature=signature)
    clock = [0.0]

    def feed(name: str, s: Any) -> list[tuple[int, Any]]:
        out = []
        cpu, mem = s.usage["cpu"], s.usage["mem"]
        t0 = float(s.t[0])
        for k, t in enumerate(s.t.tolist()):
            if np.isnan(cpu[k]) or np.isnan(mem[k]):
                continue
            c = ContainerSample(container=name, cpu_cores=float(cpu[k]), mem_bytes=float(mem[k]), nr_periods=10,
                                workload=workload)
            ts = clock[0] + (t - t0)
            for d in worker_round(cache, [HostSamples(host="corpus", ts=ts, interval_s=1.0, containers=(c,))],
                                  config, phase):
                if d.policy == "phase" and d.container == name:
                    out.append((k, d))
        clock[0] += float(s.t[-1]) - t0 + GAP_S
        return out

    for i, s in enumerate(earlier):
        feed(f"earlier-{i}", s)
    start = clock[0]
    got = feed("run", series)
    return in_force(len(series.t), got), [d for _, d in got], phase.changes, start + (series.t - float(series.t[0]))


def prediction_quality(config: Any, changes: Sequence[Any], steps: dict[str, np.ndarray], signature: str,
                       scored: str = "run") -> dict[str, Any]:
    """The transition book as a predictor on recorded phase sequences: the runs' *changes* (PhaseChange, in
    the order the runs were fed) are learned as they happen; at each step of run *scored* (*steps*: each
    container's step times) where it predicts, whether the predicted transition came within the horizon.

    ``precision``: predictions followed by that transition in time; ``recall``: the scored run's transitions
    predicted at the step before them; ``base_rate``: the share of its phased steps followed by some
    transition within the horizon (what always predicting one would score as precision, at best)."""
    from phasewise.models.phases.transitions import TransitionBook

    book = TransitionBook(config)
    h = config.horizon_s
    by: dict[str, list[Any]] = {}
    for c in changes:
        by.setdefault(c.container, []).append(c)
    for name, cs in by.items():
        if name != scored:
            for c in cs:
                if c.old_phase is not None:
                    book.learn(signature, c.old_phase, c.new_phase, c.ts - c.since)
    own = sorted(by.get(scored, []), key=lambda c: c.ts)
    t_all = steps[scored]
    predicted = hits = phased = soon = 0
    caught = 0
    j = 0  # own[j] is the next change after the step
    phase, since = -1, 0.0
    prev_pred = None
    for t in t_all.tolist():
        while j < len(own) and own[j].ts <= t:
            c = own[j]
            if c.old_phase is not None:
                if prev_pred is not None and prev_pred == (c.old_phase, c.new_phase):
                    caught += 1
                book.learn(signature, c.old_phase, c.new_phase, c.ts - c.since)
            phase, since = c.new_phase, c.ts
            j += 1
        prev_pred = None
        if phase < 0:
            continue
        phased += 1
        nxt = own[j] if j < len(own) else None
        came = nxt is not None and nxt.ts <= t + h
        soon += came
        tr = book.predict(signature, phase, t - since)
        if tr is None:
            continue
        predicted += 1
        prev_pred = (phase, tr.next_phase)
        hits += bool(came and nxt.new_phase == tr.next_phase)
    exits = sum(1 for c in own if c.old_phase is not None)
    return {"phased_steps": phased, "predicted": predicted, "hits": hits, "transitions": exits, "caught": caught,
            "steps_followed_by_a_transition": soon}


def anticipate(folder: Path, split: str = "heldout", horizons: Sequence[float] = HORIZONS, model: str = "corpus",
               overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each horizon's scores over the executions of *split* (``train``: each train execution after the other
    train runs of its kind, leave one out), on the steps where every horizon and reactive member had a
    limit."""
    from phasewise.models.scoring.frontier import frontier_at, slack_cut
    from phasewise.models.scoring.measures import Score, score_steps
    from phasewise.streams.config import detector_config

    if not horizons:
        raise CorpusError("no horizon to score")
    train, scored, series = split_series(folder, split)
    tot: dict[float, dict[str, Score]] = {h: {} for h in horizons}
    base_tot: dict[str, dict[str, Score]] = {r: {} for r in RESOURCES}
    overruns = {h: {r: 0 for r in RESOURCES} for h in horizons}
    raises = {h: 0 for h in horizons}
    transitions: dict[float, dict[str, int]] = {h: {} for h in horizons}
    quality: dict[float, dict[str, int]] = {h: {} for h in horizons}
    steps = 0
    per_exec = []
    for e in scored:
        sr = series[e["id"]]
        earlier = [series[t["id"]] for t in train if t["kind"] == e["kind"] and t["id"] != e["id"]]
        lims = {}
        for h in horizons:
            st = worker_settings(h, model, overrides)
            lims[h], ds, changes, fed_t = run_with_transitions(st, earlier, sr, e["kind"])
            if h > 0:
                q = prediction_quality(detector_config(st).anticipate, changes, {"run": fed_t}, e["kind"])
                acc = quality[h]
                for k, v in q.items():
                    acc[k] = acc.get(k, 0) + v
            for d in ds:
                ah = d.details.get("anticipated")
                if ah is not None:
                    raises[h] += 1
                    key = f"{ah['phase']}->{ah['next_phase']}"
                    transitions[h][key] = transitions[h].get(key, 0) + 1
        base = _baselines(sr)
        row: dict[str, Any] = {"id": e["id"], "earlier": len(earlier)}
        for r in RESOURCES:
            u = sr.usage[r]
            ok = ~np.isnan(u)
            for h in horizons:
                ok &= ~np.isnan(lims[h][r])
            for b in base.values():
                ok &= ~np.isnan(b[r])
            idx = np.flatnonzero(ok)
            if len(idx) < 2:
                continue
            t = sr.t[idx]
            if r == "mem":
                steps += len(idx)
            row[r] = {}
            for h in horizons:
                sc = score_steps(t, u[idx], lims[h][r][idx])
                overruns[h][r] += sc.steps - sc.fulfilled
                tot[h][r] = tot[h].get(r, Score()) + sc
                row[r][str(h)] = sc.steps - sc.fulfilled
            for name, b in base.items():
                base_tot[r][name] = base_tot[r].get(name, Score()) + score_steps(t, u[idx], b[r][idx])
        per_exec.append(row)
    results = []
    for h in horizons:
        per_resource = {}
        for r in RESOURCES:
            if r not in tot[h]:
                continue
            p = tot[h][r]
            pts = {n: (v.alloc_over_used, v.fulfilment) for n, v in base_tot[r].items()}
            at = frontier_at(pts, p.fulfilment)
            cut = None if at is None else slack_cut(p.alloc_over_used, at.alloc)
            vpa = base_tot[r]["vpa"]
            per_resource[r] = {
                "alloc_over_used": round(p.alloc_over_used, 4), "fulfilment": round(p.fulfilment, 4),
                "steps": p.steps, "overruns": overruns[h][r], "vpa_overruns": vpa.steps - vpa.fulfilled,
                "vpa": [round(vpa.alloc_over_used, 4), round(vpa.fulfilment, 4)],
                "frontier_at_fulfilment": None if at is None else round(at.alloc, 4),
                "slack_cut_vs_frontier": None if cut is None else round(cut, 4),
            }
        q = quality[h]
        if q:
            q = {**q, "precision": round(q["hits"] / q["predicted"], 4) if q["predicted"] else None,
                 "recall": round(q["caught"] / q["transitions"], 4) if q["transitions"] else None,
                 "base_rate": round(q["steps_followed_by_a_transition"] / q["phased_steps"], 4)
                 if q["phased_steps"] else None}
        results.append({"horizon_s": h, "raised_decisions": raises[h], "transitions": transitions[h],
                        "prediction": q or None, "resources": per_resource})
    return {"type": "corpus-anticipate", "corpus": str(folder), "split": split,
            "earlier_runs": "the train split's runs of the same kind" + (" but the one scored" if split == "train"
                                                                          else ""),
            "model": f"the worker's phase detector, the shipped {model} model, frozen; the bare policy (no safety "
                     "rules)",
            "executions": len(scored), "steps": steps, "results": results, "per_execution_overruns": per_exec}


def format_anticipate(res: dict[str, Any]) -> str:
    lines = [f"corpus {res['corpus']}, {res['executions']} {res['split']} executions after {res['earlier_runs']}; "
             f"{res['model']}; {res['steps']} steps scored",
             f"{'horizon':>7} {'raised':>6} {'res':>3}  {'a/u':>6} {'fulf':>7} {'overruns':>8}  {'vpa':>16}  "
             f"{'frontier':>8} {'slack cut':>9}"]
    for r in res["results"]:
        for name, v in r["resources"].items():
            cut, fr = v["slack_cut_vs_frontier"], v["frontier_at_fulfilment"]
            lines.append(f"{r['horizon_s']:>6g}s {r['raised_decisions']:>6} {name:>3}  {v['alloc_over_used']:>6.3f} "
                         f"{v['fulfilment'] * 100:>6.1f}% {v['overruns']:>8}  "
                         f"{v['vpa'][0]:>6.3f} {v['vpa'][1] * 100:>5.1f}% {v['vpa_overruns']:>3}  "
                         f"{'—' if fr is None else f'{fr:.3f}':>8} {'—' if cut is None else f'{cut * 100:.1f} %':>9}")
    return "\n".join(lines)
