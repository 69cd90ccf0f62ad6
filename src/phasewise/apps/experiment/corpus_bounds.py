"""``phasewise experiment corpus bounds``: what any policy could reach on the corpus, in hindsight.

Each scored execution runs through the worker's round as ``corpus anticipate`` runs it (the bare phase
policy, the shipped model frozen, after the train runs of its kind), beside the reactive members, on the
same steps. Then, per resource, :func:`~phasewise.models.scoring.bounds.block_bound` gives the least
allocation of a limit held constant over blocks of steps (a whole run, each stage segment the job
reported, each segment of the detector's own phase, every B seconds) when it is chosen knowing the
block's usage in advance, at the target's fulfilment, and the slack it cuts against the reactive
frontier there. A block a policy cannot see into is a bound on every policy that decides at that
resolution: if limits that follow the phases, knowing each phase segment's future, cannot remove half
of the frontier's slack, no phase policy can. docs/results.md, "What any policy could reach".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.apps.experiment.corpus_plan import CorpusError
from phasewise.apps.experiment.corpus_prior import RESOURCES, _baselines, split_series

__all__ = ["LENGTHS", "TARGET_FULFILMENT", "bounds", "format_bounds"]

#: the fulfilment issue 24's slack-cut target is read at
TARGET_FULFILMENT = 0.97
#: fixed block lengths scored by default, in steps (1 s each in the shipped corpus)
LENGTHS = (60, 30, 10, 5, 2)


def bounds(folder: Path, split: str = "heldout", lengths: Sequence[int] = LENGTHS, model: str = "corpus",
           fulfilment: float = TARGET_FULFILMENT) -> dict[str, Any]:
    """Per resource: the bare phase policy, the reactive members and, per block kind, the hindsight bound at
    *fulfilment* with the frontier there, over the executions of *split* (on the steps where the phase policy
    and every reactive member had a limit)."""
    from phasewise.apps.experiment.corpus_anticipate import run_with_transitions, worker_settings
    from phasewise.apps.experiment.corpus_models import _phases, _stages
    from phasewise.models.scoring.bounds import block_bound, blocks_of_labels, blocks_of_length
    from phasewise.models.scoring.bounds import split as cut
    from phasewise.models.scoring.frontier import frontier_at, slack_cut
    from phasewise.models.scoring.measures import Score, score_steps, step_durations

    if any(n < 1 for n in lengths):
        raise CorpusError(f"--lengths {','.join(map(str, lengths))}: each block is at least 1 step")
    train, scored, series = split_series(folder, split)
    kinds = ["run", "stage", "phase", *(f"{n} steps" for n in lengths)]
    blocks: dict[str, dict[str, list[Any]]] = {r: {k: [] for k in kinds} for r in RESOURCES}
    phase_tot: dict[str, Score] = {}
    base_tot: dict[str, dict[str, Score]] = {r: {} for r in RESOURCES}
    intervals = []
    for e in scored:
        sr = series[e["id"]]
        earlier = [series[t["id"]] for t in train if t["kind"] == e["kind"] and t["id"] != e["id"]]
        st = worker_settings(0.0, model, None)
        lims, _, changes, fed_t = run_with_transitions(st, earlier, sr, e["kind"])
        stages = _stages(folder, e, sr)
        phases = _phases(changes, fed_t)
        base = _baselines(sr)
        if len(sr.t) > 1:
            intervals.append(float(np.median(np.diff(sr.t))))
        for r in RESOURCES:
            u = sr.usage[r]
            ok = ~np.isnan(u) & ~np.isnan(lims[r])
            for b in base.values():
                ok &= ~np.isnan(b[r])
            idx = np.flatnonzero(ok)
            if len(idx) < 2:
                continue
            t, used = sr.t[idx], u[idx]
            dt = step_durations(t)
            phase_tot[r] = phase_tot.get(r, Score()) + score_steps(t, used, lims[r][idx])
            for name, b in base.items():
                base_tot[r][name] = base_tot[r].get(name, Score()) + score_steps(t, used, b[r][idx])
            acc = blocks[r]
            acc["run"] += cut(used, dt, [np.arange(len(idx))])
            acc["stage"] += cut(used, dt, blocks_of_labels([stages[i] for i in idx]))
            acc["phase"] += cut(used, dt, blocks_of_labels(phases[idx].tolist()))
            for n in lengths:
                acc[f"{n} steps"] += cut(used, dt, blocks_of_length(len(idx), n))
    step_s = float(np.median(intervals)) if intervals else None
    per_resource: dict[str, Any] = {}
    for r in RESOURCES:
        if r not in phase_tot:
            continue
        pts = {n: (v.alloc_over_used, v.fulfilment) for n, v in base_tot[r].items()}
        p = phase_tot[r]
        at = frontier_at(pts, p.fulfilment)
        rows = []
        for k in kinds:
            b = block_bound(blocks[r][k], fulfilment)
            fat = frontier_at(pts, b.fulfilment)
            cut_k = None if fat is None else slack_cut(b.alloc_over_used, fat.alloc)
            rows.append({"blocks": k, "count": len(blocks[r][k]),
                         "alloc_over_used": round(b.alloc_over_used, 4), "fulfilment": round(b.fulfilment, 4),
                         "frontier_at_fulfilment": None if fat is None else round(fat.alloc, 4),
                         "slack_cut_vs_frontier": None if cut_k is None else round(cut_k, 4)})
        pcut = None if at is None else slack_cut(p.alloc_over_used, at.alloc)
        per_resource[r] = {
            "steps": p.steps,
            "phase": {"alloc_over_used": round(p.alloc_over_used, 4), "fulfilment": round(p.fulfilment, 4),
                      "frontier_at_fulfilment": None if at is None else round(at.alloc, 4),
                      "slack_cut_vs_frontier": None if pcut is None else round(pcut, 4)},
            "reactive": {n: [round(v.alloc_over_used, 4), round(v.fulfilment, 4)]
                         for n, v in sorted(base_tot[r].items())},
            "hindsight": rows,
        }
    return {"type": "corpus-bounds", "corpus": str(folder), "split": split, "executions": len(scored),
            "fulfilment": fulfilment, "step_s": step_s,
            "model": f"the worker's phase detector, the shipped {model} model, frozen; the bare policy (no safety "
                     "rules), after the train split's runs of the same kind",
            "bound": "the least allocation of one limit per block chosen knowing the block's usage, with the "
                     "steps left over their limit chosen too, under one budget for all blocks "
                     f"(pooled fulfilment >= {fulfilment:g})",
            "resources": per_resource}


def format_bounds(res: dict[str, Any]) -> str:
    def f(v: Any, pct: bool = False) -> str:
        if v is None:
            return "-"
        return f"{v * 100:+.1f} %" if pct else f"{v:.3f}"

    step = f", {res['step_s']:g} s a step" if res.get("step_s") else ""
    lines = [f"corpus {res['corpus']}, {res['executions']} {res['split']} executions{step}; hindsight bounds at "
             f"fulfilment >= {res['fulfilment']:g} (one limit per block, knowing its usage)"]
    for r, v in res["resources"].items():
        p = v["phase"]
        lines.append(f"\n{r} ({v['steps']} steps)")
        lines.append(f"  {'limit held per':<16} {'blocks':>6} {'alloc/used':>10} {'fulfil.':>8} {'frontier':>9} "
                     f"{'slack cut':>10}")
        lines.append(f"  {'(phase policy)':<16} {'':>6} {f(p['alloc_over_used']):>10} "
                     f"{p['fulfilment'] * 100:>7.1f}% {f(p['frontier_at_fulfilment']):>9} "
                     f"{f(p['slack_cut_vs_frontier'], True):>10}")
        for row in v["hindsight"]:
            lines.append(f"  {row['blocks']:<16} {row['count']:>6} {f(row['alloc_over_used']):>10} "
                         f"{row['fulfilment'] * 100:>7.1f}% {f(row['frontier_at_fulfilment']):>9} "
                         f"{f(row['slack_cut_vs_frontier'], True):>10}")
    return "\n".join(lines)
