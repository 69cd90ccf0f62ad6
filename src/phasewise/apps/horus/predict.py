"""``phasewise predict``: score the Horus utilisation model on profiled jobs (``eval``), write the shared
profiles (``profiles``), measure jobs here (``measure``) and compare with Gavel (``gavel``). docs/horus.md,
"Results".
"""

from __future__ import annotations

import argparse
import ast
import csv
import gzip
import io
import json
import math
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phasewise.kit.settings import Settings
from phasewise.models.horus.catalog import FeatureError

if TYPE_CHECKING:  # torch and river are imported when a command runs, not for --help
    from phasewise.models.horus.graph_features import GraphFeatures
    from phasewise.models.horus.model import HorusModel

COLUMNS = ("model", "dataset", "batchsize", "amp", "gpu_util", "gmem")
#: CSV column -> (model target, scale from the CSV's unit to the model's)
SCORED = {"gpu_util": ("gpu_util", 1.0), "gmem": ("gpu_mem_bytes", 2.0**20),
          "cpu_cores": ("cpu_cores", 1.0), "mem": ("mem_bytes", 2.0**20)}
SHARED = Path(__file__).resolve().parents[5] / "shared" / "data"
_TRUE, _FALSE = {"true", "1", "yes", "y", "t"}, {"false", "0", "no", "n", "f", ""}


class EvalError(ValueError):
    """The CSV cannot be scored at all (one line)."""


def _rmsle(errs: list[float]) -> float | None:
    return None if not errs else round(math.sqrt(sum(errs) / len(errs)), 4)


def _number(row: dict, col: str) -> float | None:
    raw = (row.get(col) or "").strip()
    if raw == "":
        return None
    try:
        v = float(raw)
    except ValueError:
        raise FeatureError(f"{col} = {raw[:40]!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise FeatureError(f"{col} = {raw[:40]!r} is not a finite non-negative number")
    return v


def parse_row(row: dict, columns: tuple[str, ...] = ("gpu_util", "gmem"), rules: Any = None,
              ) -> tuple[GraphFeatures, dict[str, float], str, str | None]:
    """One observed-jobs row as the model sees it: ``(features, {target: value}, model key, device)``.

    The features are the job's graph features (:func:`~phasewise.streams.horus_jobs.spec_features`: a
    ``module:function`` only where *rules*, a :class:`~phasewise.streams.horus_jobs.BuildRules`, allow
    its module, as horus does; default: catalog models only);
    the observations are the *columns* present, in the model's units. :class:`FeatureError` says why a
    row cannot be used.
    """
    from phasewise.kit.records import JobSpec
    from phasewise.models.horus.catalog import model_key
    from phasewise.streams.horus_jobs import spec_features

    amp = (row.get("amp") or "").strip().lower()
    if amp not in _TRUE | _FALSE:
        raise FeatureError(f"amp = {amp[:20]!r} is not true or false")
    try:
        batch = int(float((row.get("batchsize") or "").strip()))
    except ValueError:
        raise FeatureError(f"batchsize = {row.get('batchsize')!r} is not an integer") from None
    if batch < 1 or batch > 2**20:
        raise FeatureError(f"batchsize = {batch} is out of range 1..{2**20}")
    name = (row.get("model") or "").strip()
    spec = JobSpec(model=name, dataset=(row.get("dataset") or "").strip(), batch_size=batch, amp=amp in _TRUE)
    f = spec_features(spec, rules)
    obs = {}
    for col in columns:
        v = _number(row, col)
        if v is not None:
            target, scale = SCORED[col]
            obs[target] = v * scale
    return f, obs, model_key(name), (row.get("device") or "").strip() or None


def _score(m: HorusModel, f: GraphFeatures, obs: dict[str, float], device: str | None,
           columns: tuple[str, ...]) -> tuple[dict[str, float], dict[str, bool]]:
    """Squared log errors and interval hits of *m*'s prediction of one job, per scored column."""
    p = m.predict_one(f, device)
    errs, inside = {}, {}
    for col in columns:
        target, scale = SCORED[col]
        if target not in obs:
            continue
        y, e = obs[target] / scale, p[target]
        errs[col] = (math.log1p(e.mean / scale) - math.log1p(y)) ** 2
        inside[col] = e.lo / scale <= y <= e.hi / scale
    return errs, inside


def _summary(recs: list[dict], columns: tuple[str, ...], after: int = 20) -> dict[str, Any]:
    """RMSLE (all, after the *after*-th scored job, first sight of a model) and coverage of scored rows *recs*."""
    def col(c: str, keep: Any = lambda r: True) -> list[float]:
        return [r["errs"][c] for r in recs if c in r["errs"] and keep(r)]

    return {
        "rmsle": {c: _rmsle(col(c)) for c in columns},
        "rmsle_after_20": {c: _rmsle(col(c, lambda r: r["n"] > after)) for c in columns},
        "rmsle_first_sight": {c: _rmsle(col(c, lambda r: r["novel"])) for c in columns},
        "coverage": {c: (round(sum(v) / len(v), 3) if (v := [r["inside"][c] for r in recs if c in r["inside"]])
                         else None) for c in columns},
    }


def _parsed(rows: list[dict], columns: tuple[str, ...], rules: Any, parsed: list | None = None) -> list:
    out = []
    for i, row in enumerate(rows):
        got = parsed[i] if parsed is not None else None
        if got is None:
            try:
                got = parse_row(row, columns, rules)
            except FeatureError as e:
                got = e
        out.append(got)
    return out


def evaluate(rows: Iterable[dict], *, model: HorusModel | None = None, columns: tuple[str, ...] = ("gpu_util", "gmem"),
             bootstrap: Iterable[dict] = (), parsed: list | None = None, rules: Any = None,
             by_family: bool = False) -> dict[str, Any]:
    """Prequential scores of *rows* (dicts with :data:`COLUMNS`); the model learns each row after predicting it.

    *parsed*, when given, is :func:`parse_row` of each row already (a tuple, or the
    :class:`FeatureError` it raised), so that a caller that needs the features too builds them once.
    *by_family* adds ``families``: the same scores per architecture family (:func:`~phasewise.models.horus.
    families.family`; a ``family`` column, where the CSV has one, names it instead).
    """
    from phasewise.models.horus.families import family
    from phasewise.models.horus.model import HorusConfig, HorusModel

    rows = list(rows)
    m = model or HorusModel(HorusConfig(coverage=Settings.default("horus_coverage")))
    for row in bootstrap:
        try:
            f, obs, _, device = parse_row(row, columns, rules)
        except FeatureError:
            continue
        m.learn_one(f, obs, device)
    recs, errors = [], []
    for i, (row, got) in enumerate(zip(rows, _parsed(rows, columns, rules, parsed)), start=1):
        if isinstance(got, FeatureError):
            errors.append({"row": i, "model": (row.get("model") or "")[:80], "error": str(got)[:300]})
            continue
        f, obs, key, device = got
        errs, inside = _score(m, f, obs, device, columns)
        recs.append({"n": len(recs) + 1, "novel": not m.seen(key), "errs": errs, "inside": inside,
                     "family": (row.get("family") or "").strip() or family(key)})
        m.learn_one(f, obs, device)
    out = {"rows": len(rows), "scored": len(recs), **_summary(recs, columns),
           "nominal_coverage": m.config.coverage, "errors": errors}
    if by_family:
        out["families"] = {fam: {"jobs": len(sub), **_summary(sub, columns)}  # after_20: of the whole run
                           for fam in sorted({r["family"] for r in recs})
                           if (sub := [r for r in recs if r["family"] == fam])}
    return out


def leave_family_out(rows: list[dict], *, config: Any, columns: tuple[str, ...] = ("gpu_util", "gmem"),
                     rules: Any = None, parsed: list | None = None, train_limit: int = 0) -> dict[str, Any]:
    """Each family scored by a model that learned only the other families' rows (at most *train_limit* of
    them, in file order; 0: all), then prequentially within the family.

    Per family: ``unseen`` (RMSLE and interval coverage of its rows predicted before any of them was
    learned), ``within`` (RMSLE of its rows after its first, each predicted before being learned, the
    others learned too) and ``trained_on`` (jobs of other families learned).
    """
    from phasewise.models.horus.families import family
    from phasewise.models.horus.model import HorusModel

    ok = [(row, got) for row, got in zip(rows, _parsed(rows, columns, rules, parsed))
          if not isinstance(got, FeatureError)]
    fam_of = [(row.get("family") or "").strip() or family(got[2]) for row, got in ok]
    out: dict[str, Any] = {}
    for fam in sorted(set(fam_of)):
        m = HorusModel(config)
        train = [got for (_, got), fa in zip(ok, fam_of) if fa != fam]
        for f, obs, _, device in train[:train_limit or None]:
            m.learn_one(f, obs, device)
        test = [got for (_, got), fa in zip(ok, fam_of) if fa == fam]
        unseen = [dict(zip(("errs", "inside"), _score(m, f, obs, d, columns))) for f, obs, _, d in test]
        within = []
        for k, (f, obs, _, d) in enumerate(test):
            if k:
                within.append(_score(m, f, obs, d, columns)[0])
            m.learn_one(f, obs, d)
        out[fam] = {
            "jobs": len(test), "trained_on": min(len(train), train_limit or len(train)),
            "unseen": {c: _rmsle([u["errs"][c] for u in unseen if c in u["errs"]]) for c in columns},
            "unseen_coverage": {c: (round(sum(v) / len(v), 3) if (v := [u["inside"][c] for u in unseen
                                                                          if c in u["inside"]]) else None)
                                for c in columns},
            "within": {c: _rmsle([w[c] for w in within if c in w]) for c in columns},
        }
    return out


def read_csv(path: str) -> list[dict]:
    """Rows of an observed-jobs CSV (header names lower-cased); :class:`EvalError` when unreadable."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise EvalError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise EvalError(f"{path}: not UTF-8 text") from None
    reader = csv.DictReader(io.StringIO(text))
    header = [(h or "").strip().lower() for h in reader.fieldnames or []]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise EvalError(f"{path}: missing column(s) {', '.join(missing)} (need {','.join(COLUMNS)})")
    try:
        return [{(k or "").strip().lower(): (v if isinstance(v, str) else "") for k, v in r.items()}
                for r in reader]
    except csv.Error as e:
        raise EvalError(f"{path}: not valid CSV: {e}") from None


# --------------------------------------------------------------------------- shared profiles


def gpumemnet_rows(data: Path) -> list[dict]:
    """GPUMemNet's 3,000 MLP configurations as observed jobs (A100, mean nvidia-smi utilisation, peak memory)."""
    path = data / "gpumemnet-mlp-profiles" / "mlp_data_step2.csv.gz"
    out = []
    with gzip.open(path, "rt") as fh:
        for r in csv.DictReader(fh):
            inp = int(re.search(r"input:(\d+)", r["Filename"]).group(1))
            widths = [inp] + [a for kind, a, _ in ast.literal_eval(r["Activations-Params"]) if kind == "linear"]
            name = ("mlp-" + "x".join(map(str, widths)) + "-" + r["Activation Function"].lower()
                    + ("-bn" if int(r["Batch Normalization Layers"]) else "")
                    + ("-dropout" if int(r["Dropout Layers"]) else ""))
            out.append({"model": name, "dataset": "vectors", "batchsize": r["Batch Size"], "amp": "false",
                        "gpu_util": r["Avg GPUTL"], "gmem": r["Max GPU Memory (MiB)"], "device": "a100"})
    return out


def hydro_rows(data: Path) -> list[dict]:
    """Hydro's ResNet-18 / CIFAR-10 rows at width scale 1 and no fusion (the catalog's ResNet-18 itself)."""
    out = []
    with open(data / "hydro-profiles" / "resnet18_256.csv") as fh:
        for r in csv.DictReader(fh):
            if r["scale"] == "1" and r["fusion"] == "1":
                out.append({"model": r["model"], "dataset": r["dataset"], "batchsize": r["bs"], "amp": r["amp"],
                            "gpu_util": r["gpu_util"], "gmem": r["gmem"]})
    return out


_GAVEL = re.compile(r"(?P<model>[A-Za-z0-9-]+) \(batch size (?P<batch>\d+)\)")
#: Gavel's job names -> (catalog model, dataset)
GAVEL_MODELS = {"ResNet-18": ("resnet18", "cifar10"), "ResNet-50": ("resnet50", "imagenet"),
                "Transformer": ("transformer", "multi30k"), "LM": ("lstm_lm", "wikitext2")}


def gavel_check(data: Path, gpu: str = "v100") -> dict[str, Any]:
    """Rank correlation of the graph's FLOPs per step with Gavel's measured seconds per step (one GPU)."""
    from phasewise.apps.simulate.gavel import read_gavel
    from phasewise.models.horus.graph_features import catalog_features

    table = read_gavel(data / "gavel-throughputs" / "physical_cluster_throughputs.json.gz", gpu)
    pts = []
    for (name, scale), tput in table.isolated.items():
        m = _GAVEL.fullmatch(name)
        if scale != 1 or m is None or m["model"] not in GAVEL_MODELS or not tput:
            continue
        model, ds = GAVEL_MODELS[m["model"]]
        f = catalog_features(model, ds, int(m["batch"]), False)
        step_s = 1.0 / float(tput)
        pts.append({"model": model, "batch": int(m["batch"]), "flops": f.flops, "step_s": round(step_s, 5),
                    "achieved_tflops": round(f.flops / step_s / 1e12, 3)})

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    a, b = ranks([p["flops"] for p in pts]), ranks([p["step_s"] for p in pts])
    n = len(pts)
    rho = 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1)) if n > 2 else None
    return {"gpu": gpu, "configs": n, "spearman_flops_vs_step_time": None if rho is None else round(rho, 3),
            "points": sorted(pts, key=lambda p: (p["model"], p["batch"]))}


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    e = sub.add_parser("eval", help="score the model prequentially on a CSV of profiled jobs")
    e.add_argument("csv", metavar="OBSERVED.csv", nargs="+",
                   help="columns model,dataset,batchsize,amp,gpu_util,gmem ('-': stdin); several are read in turn")
    e.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    e.add_argument("--learn-first", metavar="CSV", action="append", default=[],
                   help="learn these rows first, unscored (repeatable)")
    e.add_argument("--limit", type=int, default=0, metavar="N", help="score the first N rows only")
    e.add_argument("--with-cpu", action="store_true",
                   help="also score columns cpu_cores and mem (MiB) where the CSV has them")
    e.add_argument("--coverage", type=float, default=Settings.default("horus_coverage"),
                   help="nominal interval coverage")
    e.add_argument("--by-family", action="store_true", help="also score each architecture family")
    e.add_argument("--leave-family-out", action="store_true",
                   help="score each family by a model that learned only the other families' jobs")
    e.add_argument("--train-limit", type=int, default=0, metavar="N",
                   help="--leave-family-out: learn at most N jobs of the other families (default: all)")
    e.add_argument("--shuffle", type=int, default=None, metavar="SEED", help="score the rows in a seeded random order")
    pr = sub.add_parser("profiles", help="write a shared profile set as an observed-jobs CSV")
    pr.add_argument("source", choices=("gpumemnet", "hydro"))
    pr.add_argument("--data", type=Path, default=SHARED, help=f"the shared data folder (default {SHARED})")
    ms = sub.add_parser("measure", help="train catalog models here and write their CPU and memory as a CSV")
    ms.add_argument("jobs", nargs="+", metavar="MODEL:DATASET:BATCH[:THREADS]")
    ms.add_argument("--seconds", type=float, default=12.0, help="steady seconds measured per job (default 12)")
    ms.add_argument("--warmup", type=float, default=4.0, help="seconds left out after start (default 4)")
    g = sub.add_parser("gavel", help="FLOPs per step vs Gavel's measured step times")
    g.add_argument("--data", type=Path, default=SHARED, help=f"the shared data folder (default {SHARED})")
    g.add_argument("--gpu", default="v100", choices=("k80", "p100", "v100"))


def run(args: argparse.Namespace) -> int:
    prog = f"phasewise predict {args.what}"
    if args.what == "profiles":
        try:
            rows = gpumemnet_rows(args.data) if args.source == "gpumemnet" else hydro_rows(args.data)
        except OSError as e:
            print(f"{prog}: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
            return 2
        w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]) if rows else list(COLUMNS))
        w.writeheader()
        w.writerows(rows)
        return 0
    if args.what == "measure":
        from phasewise.apps.horus.measure import measure

        w = None
        for spec in args.jobs:
            parts = spec.split(":")
            try:
                model, ds, batch = parts[0], parts[1], int(parts[2])
                threads = int(parts[3]) if len(parts) > 3 else 1
            except (IndexError, ValueError):
                print(f"{prog}: error: {spec!r}: expected MODEL:DATASET:BATCH[:THREADS]", file=sys.stderr)
                return 2
            try:
                row = measure(model, ds, batch, seconds=args.seconds, warmup=args.warmup, threads=threads)
            except RuntimeError as e:
                print(f"{prog}: {e}", file=sys.stderr)
                continue
            if w is None:
                w = csv.DictWriter(sys.stdout, fieldnames=list(row))
                w.writeheader()
            w.writerow(row)
            sys.stdout.flush()
        return 0
    if args.what == "gavel":
        from phasewise.apps.simulate.openb import TraceError

        try:
            print(json.dumps(gavel_check(args.data, args.gpu), indent=1))
        except TraceError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        return 0
    if not 0 < args.coverage < 1:
        print(f"{prog}: error: --coverage: must be in (0, 1), got {args.coverage}", file=sys.stderr)
        return 2
    try:
        rows = [r for path in args.csv for r in read_csv(path)]
        boot = [r for b in args.learn_first for r in read_csv(b)]
    except EvalError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    from phasewise.kit.settings import Settings, SettingsError
    from phasewise.streams.horus_jobs import BuildRules

    try:  # a module:function row is built as horus builds it: only from horus_model_modules, in a child
        rules = BuildRules.from_settings(Settings.from_env())
    except SettingsError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.limit > 0:
        rows = rows[:args.limit]
    cols = ("gpu_util", "gmem") + (tuple(c for c in ("cpu_cores", "mem") if c in rows[0]) if args.with_cpu
                                   and rows else ())
    from phasewise.models.horus.model import HorusConfig, HorusModel

    if args.shuffle is not None:
        import random

        random.Random(args.shuffle).shuffle(rows)
    config = HorusConfig(coverage=args.coverage)
    if args.leave_family_out:
        fams = leave_family_out(rows, config=config, columns=cols, rules=rules, train_limit=args.train_limit)
        if args.json:
            print(json.dumps({"rows": len(rows), "nominal_coverage": args.coverage, "families": fams}))
            return 0
        print(f"{'family':14s} {'jobs':>5s} {'learned':>7s}  " + "  ".join(
            f"{c + ' ' + k:>20s}" for c in cols for k in ("unseen", "coverage", "within")))
        for fam, v in fams.items():
            print(f"{fam[:14]:14s} {v['jobs']:5d} {v['trained_on']:7d}  " + "  ".join(
                f"{str(v[k][c]):>20s}" for c in cols for k in ("unseen", "unseen_coverage", "within")))
        return 0
    out = evaluate(rows, model=HorusModel(config), columns=cols, bootstrap=boot, rules=rules,
                   by_family=args.by_family)
    if args.json:
        print(json.dumps(out))
        return 0
    for k in ("rmsle", "rmsle_after_20", "rmsle_first_sight", "coverage"):
        print(f"{k:18s} " + "  ".join(f"{c}={v}" for c, v in out[k].items()))
    print(f"rows {out['rows']}, scored {out['scored']}, errors {len(out['errors'])}")
    for e in out["errors"][:10]:
        print(f"  row {e['row']}: {e['error']}")
    for fam, v in out.get("families", {}).items():
        print(f"  {fam[:14]:14s} jobs {v['jobs']:5d}  " + "  ".join(
            f"{k.removeprefix('rmsle_')} " + "/".join(str(v[k][c]) for c in cols)
            for k in ("rmsle", "rmsle_first_sight", "rmsle_after_20", "coverage")))
    return 0
