"""``phasewise experiment corpus models``: a starting phase model judged on the train split alone.

For each kind of the corpus's train split, a model is learned the way ``data/make_pretrained.py`` learns
the shipped ``corpus`` model, on the train executions of the *other* kinds only, and scored on that kind's
train executions, beside the shipped AI4DL model on the same executions: the agreement of its phases with
the jobs' stages (AMI, ARI) and the bare phase policy through the worker's round (frozen, no safety rules),
scored against VPA and the window family and the reactive frontier there. It answers "does a model learned
on other jobs' 1 s executions start a new kind of job better than the AI4DL model?" without reading a
held-out execution (docs/phases.md, "The starting model").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from phasewise.apps.experiment.corpus_plan import CorpusError, agreement_metrics, stage_series
from phasewise.apps.experiment.corpus_prior import RESOURCES, _baselines, split_series

__all__ = ["format_models", "models", "train_trace"]


def train_trace(series: dict[str, Any], execs: list[dict[str, Any]]) -> Any:
    """*execs*' recorded containers as one trace (cpu, mem; one container per execution, named by its id)."""
    from phasewise.apps.replay.traces import ContainerSeries, Trace

    return Trace("phasewise", "corpus", {"cpu": "cores", "mem": "bytes"},
                 [ContainerSeries(e["id"], series[e["id"]].t, {r: series[e["id"]].usage[r] for r in RESOURCES})
                  for e in execs])


def _stages(folder: Path, e: dict[str, Any], s: Any) -> list[str]:
    from phasewise.apps.record.tracefile import RecordingError, read_recording

    try:
        header = read_recording(folder / e["file"]).header
    except RecordingError as err:
        raise CorpusError(f"execution {e['id']}: {err}") from None
    mine = [c for c in header.get("containers", []) if c.get("job") == e["id"]]
    return stage_series(s.t, (mine[0].get("stages") or []) if mine else [])


def _phases(changes: list[Any], fed: np.ndarray) -> np.ndarray:
    """The phase in force at each fed step of the scored run (-1 before its first)."""
    own = sorted((c.ts, c.new_phase) for c in changes if c.container == "run")
    if not own:
        return np.full(len(fed), -1)
    ts = np.array([t for t, _ in own])
    ph = np.array([p for _, p in own])
    k = np.searchsorted(ts, fed, side="right") - 1
    return np.where(k >= 0, ph[np.maximum(k, 0)], -1)


def models(folder: Path, min_windows: int | None = None) -> dict[str, Any]:
    """Leave-one-kind-out on the train split: per kind and pooled, the model learned on the other kinds
    against the shipped AI4DL model (see the module)."""
    from phasewise.apps.experiment.corpus_anticipate import run_with_transitions, worker_settings
    from phasewise.apps.replay.driving import PRETRAIN_MIN_WINDOWS, FleetOptions, pretrain_model
    from phasewise.models.phases.limits import PRETRAINED, load_pretrained
    from phasewise.models.scoring.frontier import frontier_at, slack_cut
    from phasewise.models.scoring.measures import Score, score_steps

    ami, ari = agreement_metrics()
    windows = PRETRAIN_MIN_WINDOWS if min_windows is None else int(min_windows)
    if windows < 1:
        raise CorpusError(f"--min-windows {windows}: at least 1")
    train, _, series = split_series(folder, "train")
    kinds = sorted({e["kind"] for e in train})
    if len(kinds) < 2:
        raise CorpusError(f"{folder}: leaving one kind out needs train executions of two kinds at least")
    settings = worker_settings(0.0, "corpus", None)
    ai4dl = load_pretrained(PRETRAINED["ai4dl"])
    names = ("left_out", "ai4dl")
    pooled: dict[str, dict[str, Any]] = {n: {"phase": [], "stage": [], "score": {r: Score() for r in RESOURCES}}
                                         for n in names}
    base_pooled: dict[str, dict[str, Score]] = {r: {} for r in RESOURCES}
    per_kind = {}

    def figures(acc: dict[str, Any], base: dict[str, dict[str, Score]]) -> dict[str, Any]:
        out: dict[str, Any] = {"ami": None, "ari": None, "phases": len(set(acc["phase"])),
                               "samples_with_phase": len(acc["phase"])}
        if len(set(acc["stage"])) >= 2:
            out["ami"] = round(float(ami(acc["stage"], acc["phase"])), 4)
            out["ari"] = round(float(ari(acc["stage"], acc["phase"])), 4)
        for r in RESOURCES:
            sc = acc["score"][r]
            at = frontier_at({n: (v.alloc_over_used, v.fulfilment) for n, v in base[r].items()}, sc.fulfilment)
            out[r] = {"alloc_over_used": round(sc.alloc_over_used, 4), "fulfilment": round(sc.fulfilment, 4),
                      "over": sc.steps - sc.fulfilled, "steps": sc.steps,
                      "frontier": None if at is None else round(at.alloc, 4),
                      "slack_cut_vs_frontier": None if at is None else round(slack_cut(sc.alloc_over_used,
                                                                                         at.alloc), 4)}
        return out

    for k in kinds:
        learned = pretrain_model(train_trace(series, [e for e in train if e["kind"] != k]), FleetOptions(),
                                 windows)
        runs = [e for e in train if e["kind"] == k]
        acc = {n: {"phase": [], "stage": [], "score": {r: Score() for r in RESOURCES}} for n in names}
        base_k: dict[str, dict[str, Score]] = {r: {} for r in RESOURCES}
        for e in runs:
            s = series[e["id"]]
            stages = _stages(folder, e, s)
            base = _baselines(s)
            got = {n: run_with_transitions(settings, [], s, k, model=m.clone())
                   for n, m in (("left_out", learned), ("ai4dl", ai4dl))}
            for r in RESOURCES:  # the steps where both models and every reactive member had a limit
                ok = ~np.isnan(s.usage[r])
                for lim, *_ in got.values():
                    ok &= ~np.isnan(lim[r])
                for b in base.values():
                    ok &= ~np.isnan(b[r])
                idx = np.flatnonzero(ok)
                if len(idx) < 2:
                    continue
                t, u = s.t[idx], s.usage[r][idx]
                for n, (lim, *_) in got.items():
                    sc = score_steps(t, u, lim[r][idx])
                    acc[n]["score"][r] += sc
                    pooled[n]["score"][r] += sc
                for b, v in base.items():
                    sc = score_steps(t, u, v[r][idx])
                    base_k[r][b] = base_k[r].get(b, Score()) + sc
                    base_pooled[r][b] = base_pooled[r].get(b, Score()) + sc
            for n, (_, _, changes, fed) in got.items():
                ph = _phases(changes, fed)
                keep = ph >= 0
                for target in (acc[n], pooled[n]):
                    target["phase"] += ph[keep].tolist()
                    target["stage"] += [x for x, y in zip(stages, keep.tolist()) if y]
        per_kind[k] = {"executions": len(runs), "learned_on": [x for x in kinds if x != k],
                       "left_out": figures(acc["left_out"], base_k), "ai4dl": figures(acc["ai4dl"], base_k)}
    overall = {n: figures(pooled[n], base_pooled) for n in names}
    # one model per left-out kind: their phase ids are not each other's, so pooled agreement means nothing;
    # the overall agreement of both is the per-kind figures' mean weighted by samples with a phase
    for n in names:
        for m in ("ami", "ari"):
            vals = [(v[n][m], v[n]["samples_with_phase"]) for v in per_kind.values() if v[n][m] is not None]
            total = sum(x for _, x in vals)
            overall[n][m] = round(sum(v * x for v, x in vals) / total, 4) if total else None
    overall["left_out"]["phases"] = None
    return {"type": "corpus-models", "corpus": str(folder), "split": "train", "min_windows": windows,
            "rule": "per kind: a model learned (make_pretrained's procedure) on the other kinds' train executions, "
                    "scored on this kind's; the shipped ai4dl model on the same executions; the bare phase policy "
                    "(frozen, no safety rules) through the worker's round",
            "overall_agreement": "the per-kind figures' mean weighted by samples with a phase (each kind has its own "
                                 "left-out model); the policy's figures are pooled over every step",
            "kinds": per_kind, "overall": overall}


def format_models(res: dict[str, Any]) -> str:
    lines = [f"corpus {res['corpus']}, train executions, leave one kind out (min windows {res['min_windows']})",
             f"{'kind':<12} {'model':<9} {'phases':>6} {'AMI':>6} {'ARI':>6}  {'cpu a/u fulf cut':>22}  "
             f"{'mem a/u fulf cut':>22}"]

    def cell(v: dict[str, Any]) -> str:
        cut = v["slack_cut_vs_frontier"]
        return (f"{v['alloc_over_used']:>6.3f} {v['fulfilment'] * 100:>5.1f}% "
                f"{'—' if cut is None else f'{cut * 100:+.1f}%':>8}")

    def f(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f}"

    rows = [*res["kinds"].items(), ("overall", res["overall"])]
    for k, v in rows:
        for n in ("left_out", "ai4dl"):
            m = v[n]
            phases = "—" if m["phases"] is None else m["phases"]
            lines.append(f"{k:<12} {n:<9} {phases:>6} {f(m['ami']):>6} {f(m['ari']):>6}  {cell(m['cpu'])}  "
                         f"{cell(m['mem'])}")
    return "\n".join(lines)
