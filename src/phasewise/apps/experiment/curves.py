"""``phasewise experiment curves``: target detection replayed over real training curves (MLPerf Training v1.0,
Pollux), counting when each curve reached, stayed past and was declared at its targets, and the false early
stops. docs/targets.md, "Replay over real curves".
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasewise.kit.settings import Settings
from phasewise.models.jobs.targets import Targets, TargetsConfig, TargetTracker, passed

SHARED = Path(__file__).resolve().parents[5] / "shared" / "data"
MLPERF = "mlperf-v1.0-nvidia-dgxa100-curves"
POLLUX = "pollux-traces"
#: Pollux metrics whose lower value is better
POLLUX_LOWER = ("deepspeech2", "yolov3")


@dataclass(frozen=True)
class Curve:
    source: str
    model: str
    run: str
    x: tuple[float, ...]  #: seconds since the run's start (epochs where times are not real)
    y: tuple[float, ...]
    direction: str
    objective: float
    x_unit: str = "s"


class CurveError(ValueError):
    """The curves cannot be read; ``str(e)`` says where and why."""


def _float(v: str) -> float | None:
    try:
        f = float(v)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def mlperf_curves(folder: Path) -> list[Curve]:
    targets: dict[str, tuple[str, float]] = {}
    with open(folder / "quality_targets.csv", newline="") as f:
        for row in csv.DictReader(f):
            t = _float(row["target"].split()[0])
            if t is not None:
                targets[row["benchmark"]] = ("max" if row["direction"] == "higher" else "min", t)
    series: dict[tuple[str, str, str], list[tuple[float, float]]] = defaultdict(list)
    with gzip.open(folder / "mlperf_v1.0_nvidia_dgxa100_events.csv.gz", "rt", newline="") as f:
        for row in csv.DictReader(f):
            if row["key"] != "eval_accuracy" or row["benchmark"] not in targets:
                continue
            y = _float(row["value"])  # maskrcnn's value is a JSON dict: not one number, skipped
            x = _float(row["epoch_or_step"] if row["benchmark"] == "dlrm" else row["t_since_run_start_s"])
            if y is not None and x is not None:
                series[(row["system"], row["benchmark"], row["run"])].append((x, y))
    out = []
    for (system, bench, run), pts in sorted(series.items()):
        pts.sort()
        direction, objective = targets[bench]
        out.append(Curve("mlperf", bench, f"{system}/{run}", tuple(p[0] for p in pts), tuple(p[1] for p in pts),
                         direction, objective, "epoch" if bench == "dlrm" else "s"))
    return out


def pollux_curves(folder: Path) -> list[Curve]:
    raw: dict[str, list[tuple[str, list[float]]]] = defaultdict(list)
    for path in sorted((folder / "traces").glob("*/validation-*.csv")):
        with open(path, newline="") as f:
            ys = [v for v in (_float(r["metric"]) for r in csv.DictReader(f)) if v is not None]
        if ys:
            raw[path.parent.name].append((path.stem.split("-", 1)[1], ys))
    out = []
    for model, runs in sorted(raw.items()):
        direction = "min" if model in POLLUX_LOWER else "max"
        best = [min(ys) if direction == "min" else max(ys) for _, ys in runs]
        worst_i = max(range(len(runs)), key=lambda i: best[i]) if direction == "min" else \
            min(range(len(runs)), key=lambda i: best[i])
        span = abs(runs[worst_i][1][0] - best[worst_i])
        objective = best[worst_i] + (0.01 * span if direction == "min" else -0.01 * span)
        for batch, ys in sorted(runs, key=lambda r: int(r[0])):
            out.append(Curve("pollux", model, f"batch-{batch}", tuple(float(i + 1) for i in range(len(ys))),
                             tuple(ys), direction, objective, "epoch"))
    return out


def load_curves(root: Path = SHARED) -> list[Curve]:
    curves = []
    for name, loader in ((MLPERF, mlperf_curves), (POLLUX, pollux_curves)):
        folder = root / name
        if not folder.is_dir():
            raise CurveError(f"{folder}: no such folder (the real curves are in ../shared/data)")
        try:
            curves += loader(folder)
        except (OSError, KeyError, csv.Error) as e:
            raise CurveError(f"{folder}: {e}") from e
    return curves


def _first(xs: Iterable[bool]) -> int | None:
    return next((i for i, ok in enumerate(xs) if ok), None)


def _stayed(ys: tuple[float, ...], target: float, direction: str) -> int | None:
    """Index from which every value is past *target* (None: the last one is not)."""
    i = len(ys)
    while i > 0 and passed(ys[i - 1], target, direction):
        i -= 1
    return i if i < len(ys) else None


def evaluate(curve: Curve, config: TargetsConfig, acceptable_gap: float = 0.10) -> dict[str, Any]:
    """One curve through the tracker: reached / stayed / declared per tier (as x values)."""
    gap = acceptable_gap * abs(curve.objective - curve.y[0])
    acceptable = curve.objective + gap if curve.direction == "min" else curve.objective - gap
    targets = Targets(acceptable=acceptable, objective=curve.objective, direction=curve.direction,
                      metric="metric")
    tracker = TargetTracker(targets, config)
    declared: dict[str, int] = {}
    for i, (x, y) in enumerate(zip(curve.x, curve.y)):
        for ev in tracker.update(ts=x, step=i, value=y):
            declared.setdefault(ev.kind, i)
    out: dict[str, Any] = {"source": curve.source, "model": curve.model, "run": curve.run,
                           "direction": curve.direction, "points": len(curve.y), "x_unit": curve.x_unit}
    for tier, target in (("acceptable", acceptable), ("objective", curve.objective)):
        reached = _first(passed(y, target, curve.direction) for y in curve.y)
        stayed = _stayed(curve.y, target, curve.direction)
        d = declared.get(tier)
        out[tier] = {
            "target": target,
            "reached": None if reached is None else curve.x[reached],
            "stayed": None if stayed is None else curve.x[stayed],
            "declared": None if d is None else curve.x[d],
            "before_reached": d is not None and (reached is None or d < reached),
            "early": d is not None and (stayed is None or d < stayed),
            "missed": d is None and reached is not None,
            "reached_last_point_only": reached == len(curve.y) - 1,
            "lag_points": None if d is None or stayed is None else d - stayed,
        }
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = f"{r['source']}/{r['model']}"
        s = by.setdefault(key, {"runs": 0, "objective_declared": 0, "objective_before_reached": 0,
                                "false_early_stops": 0, "objective_not_declared": 0, "acceptable_early": 0,
                                "reached_at_end_only": 0,
                                "lag_points": []})
        o, a = r["objective"], r["acceptable"]
        s["runs"] += 1
        s["objective_declared"] += o["declared"] is not None
        s["objective_before_reached"] += o["before_reached"]
        s["false_early_stops"] += o["early"]
        s["objective_not_declared"] += o["missed"]
        s["acceptable_early"] += a["early"]
        s["reached_at_end_only"] += o["reached_last_point_only"]
        if o["lag_points"] is not None:
            s["lag_points"].append(o["lag_points"])
    total = {k: sum(s[k] for s in by.values()) for k in ("runs", "objective_declared", "objective_before_reached",
                                                          "false_early_stops", "objective_not_declared",
                                                          "acceptable_early", "reached_at_end_only")}
    for s in by.values():
        lags = s.pop("lag_points")
        s["mean_lag_points"] = round(sum(lags) / len(lags), 2) if lags else None
    return {"total": total, "by_model": by}


def replay(config: TargetsConfig, root: Path = SHARED, acceptable_gap: float = 0.10) -> dict[str, Any]:
    rows = [evaluate(c, config, acceptable_gap) for c in load_curves(root)]
    return {"config": {"smoothing": config.smoothing, "alpha": config.alpha, "window": config.window,
                       "patience": config.patience}, "acceptable_gap": acceptable_gap,
            "summary": summarise(rows), "runs": rows}


def add_arguments(p: argparse.ArgumentParser) -> None:
    own = {f.name: f.default for f in dataclasses.fields(TargetsConfig)}  # (the defaults no setting holds)
    p.add_argument("--data", type=Path, default=SHARED, help=f"folder holding {MLPERF}/ and {POLLUX}/")
    p.add_argument("--smoothing", choices=("ewma", "median", "none"), default=own["smoothing"])
    p.add_argument("--alpha", type=float, default=Settings.default("targets_ewma_alpha"),
                   help="EWMA weight of the newest value")
    p.add_argument("--window", type=int, default=own["window"], help="median window (reports)")
    p.add_argument("--patience", type=int, default=Settings.default("targets_patience"),
                   help="reports in a row past a target")
    p.add_argument("--acceptable-gap", type=float, default=0.10,
                   help="acceptable = objective relaxed by this fraction of the first-to-objective distance")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        config = TargetsConfig(smoothing=args.smoothing, alpha=args.alpha, window=args.window,
                               patience=args.patience, grace_s=Settings.default("targets_grace_s"))
        result = replay(config, args.data, args.acceptable_gap)
    except (ValueError, CurveError) as e:
        print(f"phasewise experiment curves: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["summary"]
    print(f"{'curves':<26}{'runs':>5}{'declared':>9}{'before':>7}{'early':>6}{'missed':>7}{'at-end':>7}{'lag':>6}")
    for key, m in sorted(s["by_model"].items()):
        print(f"{key:<26}{m['runs']:>5}{m['objective_declared']:>9}{m['objective_before_reached']:>7}"
              f"{m['false_early_stops']:>6}{m['objective_not_declared']:>7}{m['reached_at_end_only']:>7}"
              f"{str(m['mean_lag_points']):>6}")
    t = s["total"]
    print(f"{'total':<26}{t['runs']:>5}{t['objective_declared']:>9}{t['objective_before_reached']:>7}"
          f"{t['false_early_stops']:>6}{t['objective_not_declared']:>7}{t['reached_at_end_only']:>7}")
    return 1 if t["objective_before_reached"] else 0
