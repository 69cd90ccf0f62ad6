"""What a replay found: the scores per resource, the ``score`` and ``savings`` rows it prints, and the text
table; the window family as its best member, the phase policy against the reactive frontier.
docs/results.md, "How replay runs".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phasewise.apps.replay.policies import ORACLE, ORACLE_NOTE, REACTIVE, PolicySpec
from phasewise.apps.replay.traces import Trace
from phasewise.models.scoring.measures import Score

__all__ = [
    "ContainerReplay",
    "format_table",
    "mix_text",
    "ReplayResult",
    "ResourceResult",
    "result_rows",
]


#: reference fulfilment for picking the best window member when neither phase nor vpa ran
DEFAULT_TARGET_FULFILMENT = 0.95


@dataclass
class ResourceResult:
    """Scores of every policy on one resource, summed over containers."""

    resource: str
    unit: str
    scores: dict[str, Score] = field(default_factory=dict)
    containers: int = 0  # containers with at least one scored step
    valid_steps: int = 0  # steps with a value for this resource
    warmup_steps: int = 0  # valid steps before the common start (not scored)


@dataclass
class ContainerReplay:
    """What the report plots for one container."""

    container: str
    t: np.ndarray
    usage: dict[str, np.ndarray]
    limits: dict[str, dict[str, np.ndarray]]  # policy -> resource -> limit per step (NaN: none)
    phases: np.ndarray | None  # phase id per step (-1: none), None when no phase policy ran
    #: resource -> True at the steps where the phase policy's limit came from its fallback (None: not known)
    fallback: dict[str, np.ndarray] | None = None


@dataclass
class ReplayResult:
    trace: Trace
    specs: list[PolicySpec]
    resources: dict[str, ResourceResult]
    plotted: list[ContainerReplay]
    elapsed_s: float
    phase_info: dict[str, Any] = field(default_factory=dict)

    @property
    def families(self) -> list[str]:
        return list(dict.fromkeys(s.family for s in self.specs))

    def members(self, family: str) -> list[str]:
        return [s.name for s in self.specs if s.family == family]


def _pick(scores: dict[str, Score], names: list[str], target_fulfilled: float) -> tuple[str, bool] | None:
    """Lowest alloc among *names* with fulfilled >= target (matched), else the
    highest fulfilment below it (ties: lowest alloc), flagged unmatched."""
    cands = [n for n in names if scores[n].steps > 0 and scores[n].alloc_over_used is not None]
    if not cands:
        return None
    ok = [n for n in cands if scores[n].fulfilled >= target_fulfilled]
    if ok:
        return min(ok, key=lambda n: (scores[n].alloc, n)), True
    return min(cands, key=lambda n: (-scores[n].fulfilled, scores[n].alloc, n)), False


def _num(v: float | None, nd: int = 6) -> float | None:
    return None if v is None else round(float(v), nd)


def _frontier_fields(sc: dict[str, Score], reactive: list[str]) -> dict[str, Any]:
    """The phase policy against the reactive frontier of *reactive* (see :mod:`phasewise.models.scoring.frontier`)."""
    from phasewise.models.scoring.frontier import MIN_SLACK, alloc_cut, frontier, frontier_at, slack_cut

    pts = {n: (sc[n].alloc_over_used, sc[n].fulfilment) for n in reactive if sc[n].steps > 0}
    p = sc["phase"]
    at = frontier_at(pts, p.fulfilment)
    if at is None:  # pragma: no cover - the caller checked that some reactive member has a score
        return {}
    out: dict[str, Any] = {
        "slack_cut_vs_frontier": _num(slack_cut(p.alloc_over_used, at.alloc)),
        "alloc_cut_vs_frontier": _num(alloc_cut(p.alloc_over_used, at.alloc)),
        "frontier_alloc_at_phase_fulfilment": _num(at.alloc),
        "frontier_fulfilment": _num(at.fulfilment),
        "frontier_mix": {n: _num(w) for n, w in at.mix},
        "phase_fulfilment_above_every_reactive": at.above_every_member,
        "frontier": [{"member": v.name, "alloc_over_used": _num(v.alloc), "fulfilment": _num(v.fulfilment)}
                     for v in frontier(pts)],
    }
    if at.above_every_member:
        out["frontier_note"] = (f"the phase policy's fulfilment ({p.fulfilment:.2%}) is above every reactive "
                                f"baseline's; compared at the highest, {at.fulfilment:.2%}")
    if at.alloc < 1.0 + MIN_SLACK:
        out["slack_note"] = (f"the frontier allocates {at.alloc:.4g} x the use there (less than {1 + MIN_SLACK:g}): "
                             "no slack to cut")
    return out


def result_rows(result: ReplayResult) -> tuple[list[dict], list[dict]]:
    """(one row per (policy family, resource), one savings row per resource)."""
    rows: list[dict] = []
    savings: list[dict] = []
    fams = result.families
    for r, res in result.resources.items():
        sc = res.scores
        steps = max((s.steps for s in sc.values()), default=0)
        ref = next((f for f in ("phase", "vpa") if f in fams and sc[f].steps > 0), None)
        if ref is not None:
            target, target_from = sc[ref].fulfilled, ref
        else:
            target, target_from = DEFAULT_TARGET_FULFILMENT * steps, f"{DEFAULT_TARGET_FULFILMENT:.0%}"
        for fam in fams:
            base = {"type": "score", "policy": fam, "resource": r}
            if fam == "window":
                picked = _pick(sc, result.members("window"), target)
                name = picked[0] if picked else result.members("window")[0]
                row = {**base, **_score_fields(sc[name]), "member": name,
                       "member_choice": f"lowest alloc_over_used reaching {target_from} fulfilment"
                       if picked and picked[1] else f"highest fulfilment (none reached {target_from})",
                       "members": {n: _score_fields(sc[n]) for n in result.members("window")}}
            else:
                row = {**base, **_score_fields(sc[fam])}
                if fam == ORACLE:
                    row["note"] = ORACLE_NOTE
                elif sc[fam].steps == 0:
                    row["note"] = "no score: the policy sets no limit for this resource"
            row["unit"] = res.unit
            row["containers"] = res.containers
            rows.append(row)
        srow: dict[str, Any] = {"type": "savings", "resource": r, "slack_cut_vs_frontier": None,
                                "alloc_cut_vs_frontier": None, "savings_vs_best_reactive": None}
        reactive = [n for f in REACTIVE if f in fams for n in result.members(f)]
        if "phase" not in fams:
            srow["reason"] = "phase policy not in this run"
        elif not reactive:
            srow["reason"] = "no reactive baseline (vpa, window) in this run"
        elif sc["phase"].steps == 0 or sc["phase"].alloc_over_used is None:
            srow["reason"] = "no scored step with usage for this resource"
        else:
            picked = _pick(sc, reactive, sc["phase"].fulfilled)
            if picked is None:
                srow["reason"] = "no reactive baseline has a score"
            else:
                srow.update(_frontier_fields(sc, reactive))
                best, matched = picked
                b = sc[best]
                p = sc["phase"]
                srow.update({
                    "savings_vs_best_reactive": _num(1.0 - p.alloc / b.alloc) if b.alloc > 0 else None,
                    "best_reactive": best,
                    "best_reactive_alloc_over_used": _num(b.alloc_over_used),
                    "best_reactive_fulfilment": _num(b.fulfilment),
                    "phase_alloc_over_used": _num(p.alloc_over_used),
                    "phase_fulfilment": _num(p.fulfilment),
                    "matched_fulfilment": matched,
                })
                if not matched:
                    srow["flag"] = "no reactive baseline reaches the phase policy's fulfilment; closest below used"
        if ORACLE in fams:
            srow["oracle_alloc_over_used"] = _num(sc[ORACLE].alloc_over_used)
        srow["steps"] = steps
        srow["warmup_steps_not_scored"] = res.warmup_steps
        savings.append(srow)
    return rows, savings


def _score_fields(s: Score) -> dict[str, Any]:
    return {"alloc_over_used": _num(s.alloc_over_used), "fulfilment": _num(s.fulfilment), "steps": s.steps}


def mix_text(mix: dict[str, float]) -> str:
    """``{"a": 0.25, "b": 0.75}`` -> ``"0.25 a + 0.75 b"``; one member: its name.

    >>> mix_text({"window-max-30": 0.25, "window-max-60": 0.75}), mix_text({"vpa": 1.0})
    ('0.25 window-max-30 + 0.75 window-max-60', 'vpa')
    """
    if len(mix) == 1:
        return next(iter(mix))
    return " + ".join(f"{w:.2f} {n}" for n, w in mix.items())


def format_table(rows: list[dict], savings: list[dict]) -> str:
    """Readable table of the rows and savings."""

    def f(v: Any, pct: bool = False) -> str:
        if v is None:
            return "-"
        return f"{v:.1%}" if pct else f"{v:.3f}"

    lines = [f"{'resource':9s} {'policy':8s} {'alloc/used':>10s} {'fulfilment':>10s} {'steps':>7s}  detail"]
    for r in rows:
        detail = r.get("member", "") or ("oracle: sees U_t" if r["policy"] == ORACLE else r.get("note", ""))
        lines.append(f"{r['resource']:9s} {r['policy']:8s} {f(r['alloc_over_used']):>10s} "
                     f"{f(r['fulfilment'], True):>10s} {r['steps']:>7d}  {detail}")
    lines.append("")
    for s in savings:
        r = s["resource"]
        if s.get("frontier_alloc_at_phase_fulfilment") is None:
            lines.append(f"{r:9s} vs reactive frontier: - ({s.get('reason', 'undefined')})")
            continue
        above = (f"  [phase fulfilment {f(s['phase_fulfilment'], True)} is above every reactive baseline's: "
                 "compared at the highest]" if s["phase_fulfilment_above_every_reactive"] else "")
        lines.append(f"{r:9s} vs reactive frontier at {f(s['frontier_fulfilment'], True)}: slack cut "
                     f"{f(s['slack_cut_vs_frontier'], True)}, allocation cut {f(s['alloc_cut_vs_frontier'], True)} "
                     f"(alloc/used: phase {f(s['phase_alloc_over_used'])}, frontier "
                     f"{f(s['frontier_alloc_at_phase_fulfilment'])} = {mix_text(s['frontier_mix'])}){above}")
        flag = "" if s["matched_fulfilment"] else "  [UNMATCHED: closest baseline below phase fulfilment]"
        lines.append(f"{'':9s} vs cheapest single baseline at >= phase fulfilment ({s['best_reactive']}, "
                     f"{f(s['best_reactive_fulfilment'], True)}): allocation cut "
                     f"{f(s['savings_vs_best_reactive'], True)}{flag}")
    return "\n".join(lines)
