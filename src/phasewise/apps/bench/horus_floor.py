"""``phasewise bench horus-floor``: how low GPU-utilisation error can go on GPUMemNet's jobs, offline learners
against the online Horus model (needs scikit-learn: ``phasewise[analysis]``). docs/benchmarks.md, "What each
bench measures"; docs/horus.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

TARGET = 0.15
#: CSV column -> (model target, the CSV's unit in the model's)
_COLUMNS = {"gpu_util": ("gpu_util", 1.0), "gmem": ("gpu_mem_bytes", 2.0**20)}
_SIZES = "20,50,100,200,500,1000"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.apps.horus.predict import SHARED

    p.add_argument("--data", type=Path, default=SHARED, help=f"the shared data folder (default {SHARED})")
    p.add_argument("--rows", type=int, default=0, metavar="N", help="the first N jobs only (default: all 3,000)")
    p.add_argument("--folds", type=int, default=10, help="cross-validation folds (default 10)")
    p.add_argument("--sizes", default=_SIZES, help=f"learning-curve training sizes (default {_SIZES})")
    p.add_argument("--repeats", type=int, default=10, help="random draws per learning-curve size (default 10)")
    p.add_argument("--trees", type=int, default=200, help="random-forest trees (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _learners(seed: int, trees: int) -> dict:
    from sklearn.dummy import DummyRegressor
    from sklearn.ensemble import HistGradientBoostingRegressor, RandomForestRegressor
    from sklearn.linear_model import Ridge
    from sklearn.neighbors import KNeighborsRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return {
        "hist_gradient_boosting": lambda: HistGradientBoostingRegressor(random_state=seed),
        "random_forest": lambda: RandomForestRegressor(n_estimators=trees, random_state=seed, n_jobs=-1),
        "knn": lambda: make_pipeline(StandardScaler(), KNeighborsRegressor(n_neighbors=5)),
        "ridge": lambda: make_pipeline(StandardScaler(), Ridge(alpha=1.0)),
        "mean": lambda: DummyRegressor(strategy="mean"),
    }


def _rmsle(pred, truth) -> float:
    import numpy as np

    return float(np.sqrt(np.mean((np.asarray(pred) - np.asarray(truth)) ** 2)))


def _cross_validate(learners: dict, X, base, y, folds: int, seed: int) -> tuple[dict, dict, dict]:
    """Pooled out-of-fold RMSLE of each learner, the spread of its per-fold RMSLE, its out-of-fold predictions."""
    import numpy as np
    from sklearn.model_selection import KFold

    splits = list(KFold(n_splits=folds, shuffle=True, random_state=seed).split(X))
    pooled, sd, preds = {}, {}, {}
    for name, make in learners.items():
        pred = np.empty_like(y)
        per_fold = []
        for train, test in splits:
            pred[test] = base[test] + make().fit(X[train], y[train] - base[train]).predict(X[test])
            per_fold.append(_rmsle(pred[test], y[test]))
        pooled[name] = round(_rmsle(pred, y), 4)
        sd[name] = round(float(np.std(per_fold, ddof=1)), 4)
        preds[name] = pred
    return pooled, sd, preds


def _concentration(pred, y, share: float = 0.01) -> dict:
    """How much of the squared log error the worst *share* of jobs make, and what they measured (natural units)."""
    import numpy as np

    se = (pred - y) ** 2
    k = max(1, int(round(share * len(y))))
    worst = np.argsort(se)[::-1][:k]
    rest = np.delete(se, worst)
    return {"jobs": k, "share_of_squared_error": round(float(se[worst].sum() / se.sum()), 3),
            "rmsle_of_the_rest": round(float(np.sqrt(rest.mean())), 4),
            "measured_median": round(float(np.median(np.expm1(y[worst]))), 2),
            "predicted_median": round(float(np.median(np.expm1(pred[worst]))), 2),
            "measured_median_all": round(float(np.median(np.expm1(y))), 2)}


def _learning_curve(learners: dict, X, base, y, sizes: list[int], repeats: int, seed: int,
                    main: str = "random_forest") -> list[dict]:
    """RMSLE on all the other jobs of each learner trained on n random jobs: *main*'s mean and sd, the others' mean."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        scores: dict[str, list[float]] = {k: [] for k in learners}
        for _ in range(repeats):
            order = rng.permutation(len(y))
            train, test = order[:n], order[n:]
            for name, make in learners.items():
                pred = base[test] + make().fit(X[train], y[train] - base[train]).predict(X[test])
                scores[name].append(_rmsle(pred, y[test]))
        s = scores[main]
        out.append({"train_jobs": n, "test_jobs": len(y) - n, "rmsle_mean": round(float(np.mean(s)), 4),
                    "rmsle_sd": round(float(np.std(s, ddof=1)), 4) if repeats > 1 else None,
                    "repeats": repeats, "by_learner": {k: round(float(np.mean(v)), 4) for k, v in scores.items()}})
    return out


def run(a: argparse.Namespace) -> int:
    prog = "phasewise bench horus-floor"
    try:
        import numpy as np
        import sklearn  # noqa: F401
    except ImportError:
        print(f"{prog}: error: needs scikit-learn: pip install 'phasewise[analysis]'", file=sys.stderr)
        return 2
    try:
        sizes = sorted({int(s) for s in a.sizes.split(",") if s.strip()})
    except ValueError:
        sizes = []
    if a.rows < 0 or a.folds < 2 or a.repeats < 1 or a.trees < 1 or not sizes or sizes[0] < 2:
        print(f"{prog}: error: bad options (rows >= 0, folds >= 2, repeats >= 1, trees >= 1, "
              "sizes: integers >= 2 separated by commas)", file=sys.stderr)
        return 2

    from phasewise.apps.horus.predict import evaluate, gpumemnet_rows, parse_row
    from phasewise.kit.settings import Settings
    from phasewise.models.horus.graph_features import FeatureError
    from phasewise.models.horus.model import HorusConfig, feature_vector, prior

    t0 = time.perf_counter()
    try:
        rows = gpumemnet_rows(a.data)
    except OSError as e:
        print(f"{prog}: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    if a.rows:
        rows = rows[:a.rows]
    parsed: list = []
    for row in rows:
        try:
            parsed.append(parse_row(row, tuple(_COLUMNS)))
        except FeatureError as e:
            parsed.append(e)
    t_features = time.perf_counter() - t0
    ok = [p for p in parsed if not isinstance(p, FeatureError) and all(t in p[1] for t, _ in _COLUMNS.values())]
    sizes = [n for n in sizes if n <= len(ok) - max(10, len(ok) // 10)]  # leave jobs to score
    if len(ok) < 2 * a.folds or not sizes:
        print(f"{prog}: error: {len(ok)} usable jobs: too few for {a.folds} folds and the learning curve",
              file=sys.stderr)
        return 2

    # the online model's own inputs; columns the same for every job (the device, here) carry nothing
    vecs = [feature_vector(f, device) for f, _, _, device in ok]
    names = sorted({k for v in vecs for k in v})
    X = np.array([[v.get(k, 0.0) for k in names] for v in vecs])
    keep = X.std(axis=0) > 0
    names = [k for k, kept in zip(names, keep) if kept]
    X = X[:, keep]
    cfg = HorusConfig(coverage=Settings.default("horus_coverage"))
    learners = _learners(a.seed, a.trees)

    t1 = time.perf_counter()
    online = evaluate(rows, parsed=parsed)
    t_online = time.perf_counter() - t1

    targets = {}
    t2 = time.perf_counter()
    for col, (target, scale) in _COLUMNS.items():
        # log1p in the CSV's unit, as RMSLE is measured; the learners fit the residual over the model's prior
        y = np.array([math.log1p(obs[target] / scale) for _, obs, _, _ in ok])
        base = np.array([math.log1p(prior(target, f.to_dict(), cfg, device) / scale) for f, _, _, device in ok])
        cv, cv_sd, preds = _cross_validate(learners, X, base, y, a.folds, a.seed)
        # the memory's curve with the random forest alone: it is not the question, and is cheap that way
        curve = _learning_curve(learners if col == "gpu_util" else {"random_forest": learners["random_forest"]},
                                X, base, y, sizes, a.repeats, a.seed)
        best = min((k for k in cv if k != "mean"), key=cv.get)
        targets[col] = {"cv": cv, "cv_sd": cv_sd, "curve": curve, "best": best,
                        "worst": _concentration(preds[best], y)}
    t_offline = time.perf_counter() - t2

    util, mem = targets["gpu_util"], targets["gmem"]
    best = util["best"]
    out = {
        "data": "gpumemnet-mlp-profiles",
        "rows": len(rows),
        "unusable": len(parsed) - len(ok),  # no graph, or a measurement missing
        "features": names,
        "cv_folds": a.folds,
        "seed": a.seed,
        "offline_cv_rmsle": util["cv"],
        "offline_cv_rmsle_fold_sd": util["cv_sd"],
        "best_offline": {"learner": best, "rmsle": util["cv"][best]},
        "worst_1pct": util["worst"],
        "learning_curve_learner": "random_forest",
        "learning_curve": util["curve"],
        "online_after_20": online["rmsle_after_20"]["gpu_util"],
        "online_all": online["rmsle"]["gpu_util"],
        "target": TARGET,
        "target_met": {"online_after_20": (online["rmsle_after_20"]["gpu_util"] or math.inf) <= TARGET,
                       "offline_cv_best": util["cv"][best] <= TARGET,
                       "learning_curve_at_20": min(util["curve"][0]["by_learner"].values()) <= TARGET
                       if util["curve"][0]["train_jobs"] <= 20 else None},
        "gpu_mem": {"offline_cv_rmsle": mem["cv"], "learning_curve": [
            {k: c[k] for k in ("train_jobs", "rmsle_mean", "rmsle_sd")} for c in mem["curve"]],
            "online_after_20": online["rmsle_after_20"]["gmem"], "online_all": online["rmsle"]["gmem"]},
        "seconds": {"features": round(t_features, 1), "online": round(t_online, 1),
                    "offline": round(t_offline, 1), "total": round(time.perf_counter() - t0, 1)},
    }
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"GPU utilisation, RMSLE on {len(ok)} GPUMemNet jobs ({len(names)} graph features), target {TARGET}:")
    print(f"  online model, after its 20th job:     {out['online_after_20']}")
    print(f"  offline, {a.folds}-fold CV:  " + "  ".join(f"{k}={v}" for k, v in util["cv"].items()))
    print("  random forest trained on n jobs:  " + "  ".join(
        f"{c['train_jobs']}: {c['rmsle_mean']}±{c['rmsle_sd']}" for c in util["curve"]))
    w = util["worst"]
    print(f"  the worst {w['jobs']} jobs ({w['measured_median']} % measured, {w['predicted_median']} % predicted, "
          f"median) make {w['share_of_squared_error']:.0%} of {best}'s squared error")
    print(f"GPU memory, RMSLE: online after 20 {out['gpu_mem']['online_after_20']}, offline CV "
          + "  ".join(f"{k}={v}" for k, v in mem["cv"].items()))
    print(f"{out['seconds']['total']} s (graph features {out['seconds']['features']} s)")
    return 0
