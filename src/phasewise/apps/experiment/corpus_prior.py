"""``phasewise experiment corpus prior``: the known-job prior scored on the corpus's executions.

Each scored execution runs through the worker's own step (the VPA updater with the live safety rules and
its :class:`~phasewise.models.priors.book.PriorBook`, as ``phasewise worker`` builds them from settings) after
the earlier runs of its kind, fed first as other containers of the same signature: their profiles are the
prior. Its limits in force at each step (a decision applies from the next sample) are scored against what it
used, on the steps where the prior set a limit, beside the reactive baselines (VPA without the safety rules,
the window family) on the same steps and the reactive frontier there. A cold start under the safety rules
sets no limit before ``safety_min_history_s`` (15 minutes by default): every corpus execution is shorter, so
a cold start runs each one unlimited. docs/priors.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.apps.experiment.corpus_plan import CorpusError, read_manifest
from phasewise.kit.records import ContainerSample, HostSamples, WorkloadPolicy
from phasewise.kit.settings import Settings

__all__ = ["MARGINS", "execution_series", "format_priors", "priors", "in_force", "run_with_prior",
           "split_series"]

#: the margins scored by default (the first figure is the setting's default)
MARGINS = (0.05, 0.0, 0.10, 0.20)
RESOURCES = ("cpu", "mem")


def execution_series(folder: Path, e: dict[str, Any]) -> Any:
    """The recorded container of execution *e* (a replay :class:`ContainerSeries`)."""
    from phasewise.apps.record.tracefile import RecordingError, read_recording
    from phasewise.apps.replay.traces import TraceFormatError, load_trace

    path = folder / e["file"]
    try:
        trace = load_trace(path, "phasewise")
        header = read_recording(path).header
    except (TraceFormatError, RecordingError) as err:
        raise CorpusError(f"execution {e['id']}: {err}") from None
    jobs = {f"{c.get('host')}/{c.get('container')}": c.get("job") for c in header.get("containers", [])}
    for s in trace.containers:
        if jobs.get(s.container) == e["id"]:
            return s
    raise CorpusError(f"execution {e['id']}: its recording holds no container of the job")


def split_series(folder: Path, split: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The train executions, those of *split* (scored), and the recorded container of each, by id."""
    execs = read_manifest(folder)["executions"]
    train = [e for e in execs if e["split"] == "train"]
    scored = [e for e in execs if e["split"] == split]
    if not scored:
        raise CorpusError(f"{folder}: no execution in the {split} split")
    return train, scored, {e["id"]: execution_series(folder, e) for e in execs if e in train or e in scored}


def run_with_prior(settings: Settings, earlier: Sequence[Any], series: Any, signature: str
                   ) -> tuple[dict[str, np.ndarray], list[Any]]:
    """*series* through the worker's step after *earlier* (runs of the same *signature*); per resource the
    limit in force at each of its steps (NaN: none), and its decisions."""
    from phasewise.models.vpa.updater import process_host_samples
    from phasewise.streams.config import state_cache, updater_config

    cache, config = state_cache(settings), updater_config(settings)
    workload = WorkloadPolicy(mode="apply", signature=signature)

    def feed(name: str, s: Any) -> list[Any]:
        out = []
        cpu, mem = s.usage["cpu"], s.usage["mem"]
        for k, t in enumerate(s.t.tolist()):
            if np.isnan(cpu[k]) or np.isnan(mem[k]):
                continue
            c = ContainerSample(container=name, cpu_cores=float(cpu[k]), mem_bytes=float(mem[k]), nr_periods=10,
                                workload=workload)
            for d in process_host_samples(cache, HostSamples(host="corpus", ts=t, interval_s=1.0, containers=(c,)),
                                          config):
                out.append((k, d))
        return out

    for i, s in enumerate(earlier):
        feed(f"earlier-{i}", s)
    got = feed("run", series)
    return in_force(len(series.t), got), [d for _, d in got]


def in_force(n: int, got: Sequence[tuple[int, Any]]) -> dict[str, np.ndarray]:
    """Per resource, the limit in force at each of *n* steps from *got*'s ``(step, decision)`` pairs: a
    decision at step k holds from step k + 1 on (NaN: none yet)."""
    limits = {r: np.full(n, np.nan) for r in RESOURCES}
    for k, d in got:
        for r, v in (("cpu", d.cpu_limit_cores), ("mem", d.mem_limit_bytes)):
            if v is not None:
                limits[r][k + 1:] = v
    return limits


def _baselines(series: Any) -> dict[str, dict[str, np.ndarray]]:
    """The reactive members' limits at each step (VPA without the safety rules, the window family)."""
    from phasewise.apps.replay.driving import decision_sequence
    from phasewise.models.scoring.baselines import window_family
    from phasewise.models.scoring.measures import hold_last
    from phasewise.models.vpa.recommender import VpaPolicy

    members = {"vpa": VpaPolicy, **window_family()}
    out = {}
    for name, make in members.items():
        seq = decision_sequence(make(), series)
        out[name] = {r: hold_last(np.array([np.nan if lim.get(r) is None else lim[r] for _, lim in seq],
                                           dtype=np.float64)) for r in RESOURCES}
    return out


def _settings(margin: float, min_runs: int, overrides: dict[str, Any] | None) -> Settings:
    return Settings.from_env({"prior_margin": margin, "prior_min_runs": min_runs, **(overrides or {})}, env={})


def priors(folder: Path, split: str = "heldout", margins: Sequence[float] = MARGINS, min_runs: int = 3,
           overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each margin's scores over the executions of *split* whose kind has earlier runs in the train split
    (``train``: each train execution after the other train runs of its kind, leave one out)."""
    from phasewise.models.scoring.frontier import frontier_at, slack_cut
    from phasewise.models.scoring.measures import Score, score_steps

    if not margins:
        raise CorpusError("no margin to score")
    train, scored, series = split_series(folder, split)
    base = {e["id"]: _baselines(series[e["id"]]) for e in scored}
    results = []
    for margin in margins:
        s = _settings(margin, min_runs, overrides)
        tot: dict[str, dict[str, Score]] = {r: {} for r in RESOURCES}
        limited = total = runs_limited = executions = 0
        cold = []
        overruns = {r: 0 for r in RESOURCES}
        for e in scored:
            earlier = [series[t["id"]] for t in train if t["kind"] == e["kind"] and t["id"] != e["id"]]
            if len(earlier) < min_runs:
                cold.append(e["id"])
                continue
            executions += 1
            sr = series[e["id"]]
            lim, _ = run_with_prior(s, earlier, sr, e["kind"])
            total += len(sr.t)
            on = ~np.isnan(lim["cpu"]) | ~np.isnan(lim["mem"])
            limited += int(np.count_nonzero(on))
            runs_limited += bool(on.any())
            for r in RESOURCES:
                u = sr.usage[r]
                steps = ~np.isnan(lim[r]) & ~np.isnan(u)
                for b in base[e["id"]].values():
                    steps &= ~np.isnan(b[r])
                if not steps.any():
                    continue
                idx = np.flatnonzero(steps)
                t = sr.t[idx]
                if len(t) < 2:
                    continue
                sc = score_steps(t, u[idx], lim[r][idx])
                overruns[r] += sc.steps - sc.fulfilled
                tot[r]["prior"] = tot[r].get("prior", Score()) + sc
                for name, b in base[e["id"]].items():
                    tot[r][name] = tot[r].get(name, Score()) + score_steps(t, u[idx], b[r][idx])
        per_resource = {}
        for r in RESOURCES:
            if "prior" not in tot[r]:
                continue
            pts = {n: (v.alloc_over_used, v.fulfilment) for n, v in tot[r].items() if n != "prior"}
            p = tot[r]["prior"]
            at = frontier_at(pts, p.fulfilment)
            cut = None if at is None else slack_cut(p.alloc_over_used, at.alloc)
            per_resource[r] = {
                "prior": {"alloc_over_used": round(p.alloc_over_used, 4), "fulfilment": round(p.fulfilment, 4),
                          "steps": p.steps, "overruns": overruns[r]},
                "vpa": {"alloc_over_used": round(pts["vpa"][0], 4), "fulfilment": round(pts["vpa"][1], 4),
                        "overruns": tot[r]["vpa"].steps - tot[r]["vpa"].fulfilled},
                "frontier_at_prior_fulfilment": None if at is None else round(at.alloc, 4),
                "frontier_mix": None if at is None else [[m, round(w, 3)] for m, w in at.mix],
                "prior_fulfilment_above_every_reactive": None if at is None else at.above_every_member,
                "slack_cut_vs_frontier": None if cut is None else round(cut, 4),
                "members": {n: [round(a, 4), round(f, 4)] for n, (a, f) in sorted(pts.items())},
            }
        results.append({"margin": margin, "executions": executions, "runs_limited": runs_limited,
                        "steps": total, "steps_limited": limited, "cold": cold, "resources": per_resource})
    return {"type": "corpus-prior", "corpus": str(folder), "split": split, "min_runs": min_runs,
            "earlier_runs": "the train split's runs of the same kind" + (" but the one scored" if split == "train"
                                                                          else ""),
            "cold_start": "under the safety rules a run without a prior gets no limit before safety_min_history_s "
                          f"({s.safety.min_history_s:g} s): every step unlimited",
            "results": results}


def format_priors(res: dict[str, Any]) -> str:
    lines = [f"corpus {res['corpus']}, {res['split']} executions after {res['earlier_runs']} "
             f"(at least {res['min_runs']})", res["cold_start"],
             f"{'margin':>6} {'runs':>4} {'limited':>9} {'res':>3}  {'prior a/u, fulf':>16}  {'vpa a/u, fulf':>16}  "
             f"{'frontier':>8} {'slack cut':>9}"]
    for r in res["results"]:
        for name, v in r["resources"].items():
            p, vpa = v["prior"], v["vpa"]
            cut = v["slack_cut_vs_frontier"]
            fr = v["frontier_at_prior_fulfilment"]
            lines.append(f"{r['margin']:>6.2f} {r['executions']:>4} {r['steps_limited']:>4}/{r['steps']:<4} "
                         f"{name:>3}  {p['alloc_over_used']:>7.3f} {p['fulfilment'] * 100:>6.1f} %  "
                         f"{vpa['alloc_over_used']:>7.3f} {vpa['fulfilment'] * 100:>6.1f} %  "
                         f"{'—' if fr is None else f'{fr:.3f}':>8} {'—' if cut is None else f'{cut * 100:.1f} %':>9}")
        if r["cold"]:
            lines.append(f"       no earlier runs (cold, unlimited): {', '.join(r['cold'])}")
    return "\n".join(lines)
