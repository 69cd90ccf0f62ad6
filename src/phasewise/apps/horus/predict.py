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


def evaluate(rows: Iterable[dict], *, model: HorusModel | None = None, columns: tuple[str, ...] = ("gpu_util", "gmem"),
             bootstrap: Iterable[dict] = (), parsed: list | None = None, rules: Any = None) -> dict[str, Any]:
    """Prequential scores of *rows* (dicts with :data:`COLUMNS`); the model learns each row after predicting it.

    *parsed*, when given, is :func:`parse_row` of each row already (a tuple, or the
    :class:`FeatureError` it raised), so that a caller that needs the features too builds them once.
    """
    from phasewise.models.horus.model import HorusConfig, HorusModel

    m = model or HorusModel(HorusConfig(coverage=Settings.default("horus_coverage")))

    def parse(row: dict, i: int) -> tuple[GraphFeatures, dict[str, float], str, str | None]:
        if parsed is not None:
            got = parsed[i - 1]
            if isinstance(got, FeatureError):
                raise got
            return got
        return parse_row(row, columns, rules)

    for row in bootstrap:
        try:
            f, obs, _, device = parse_row(row, columns, rules)
        except FeatureError:
            continue
        m.learn_one(f, obs, device)
    sq: dict[str, list[float]] = {c: [] for c in columns}
    after: dict[str, list[float]] = {c: [] for c in columns}
    first: dict[str, list[float]] = {c: [] for c in columns}
    inside: dict[str, list[bool]] = {c: [] for c in columns}
    errors, n_rows, scored = [], 0, 0
    for i, row in enumerate(rows, start=1):
        n_rows += 1
        try:
            f, obs, key, device = parse(row, i)
        except FeatureError as e:
            errors.append({"row": i, "model": (row.get("model") or "")[:80], "error": str(e)[:300]})
            continue
        p = m.predict_one(f, device)
        novel = not m.seen(key)
        scored += 1
        for col in columns:
            target, scale = SCORED[col]
            if target not in obs:
                continue
            y = obs[target] / scale
            e = p[target]
            err = (math.log1p(e.mean / scale) - math.log1p(y)) ** 2
            sq[col].append(err)
            if scored > 20:
                after[col].append(err)
            if novel:
                first[col].append(err)
            inside[col].append(e.lo / scale <= y <= e.hi / scale)
        m.learn_one(f, obs, device)
    return {
        "rows": n_rows,
        "scored": scored,
        "rmsle": {c: _rmsle(v) for c, v in sq.items()},
        "rmsle_after_20": {c: _rmsle(v) for c, v in after.items()},
        "rmsle_first_sight": {c: _rmsle(v) for c, v in first.items()},
        "coverage": {c: (round(sum(v) / len(v), 3) if v else None) for c, v in inside.items()},
        "nominal_coverage": m.config.coverage,
        "errors": errors,
    }


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


_GAVEL = re.compile(r"\('(?P<model>[A-Za-z0-9-]+) \(batch size (?P<batch>\d+)\)', 1\)")
#: Gavel's job names -> (catalog model, dataset)
GAVEL_MODELS = {"ResNet-18": ("resnet18", "cifar10"), "ResNet-50": ("resnet50", "imagenet"),
                "Transformer": ("transformer", "multi30k"), "LM": ("lstm_lm", "wikitext2")}


def gavel_check(data: Path, gpu: str = "v100") -> dict[str, Any]:
    """Rank correlation of the graph's FLOPs per step with Gavel's measured seconds per step (one GPU)."""
    from phasewise.models.horus.graph_features import catalog_features

    with gzip.open(data / "gavel-throughputs" / "physical_cluster_throughputs.json.gz", "rt") as fh:
        table = json.load(fh)[gpu]
    pts = []
    for key, entry in table.items():
        m = _GAVEL.fullmatch(key)
        if m is None or m["model"] not in GAVEL_MODELS or not entry.get("null"):
            continue
        model, ds = GAVEL_MODELS[m["model"]]
        f = catalog_features(model, ds, int(m["batch"]), False)
        step_s = 1.0 / float(entry["null"])
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
    e.add_argument("csv", metavar="OBSERVED.csv", help="columns model,dataset,batchsize,amp,gpu_util,gmem ('-': stdin)")
    e.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    e.add_argument("--learn-first", metavar="CSV", action="append", default=[],
                   help="learn these rows first, unscored (repeatable)")
    e.add_argument("--limit", type=int, default=0, metavar="N", help="score the first N rows only")
    e.add_argument("--with-cpu", action="store_true",
                   help="also score columns cpu_cores and mem (MiB) where the CSV has them")
    e.add_argument("--coverage", type=float, default=Settings.default("horus_coverage"),
                   help="nominal interval coverage")
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
        try:
            print(json.dumps(gavel_check(args.data, args.gpu), indent=1))
        except OSError as e:
            print(f"{prog}: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
            return 2
        return 0
    if not 0 < args.coverage < 1:
        print(f"{prog}: error: --coverage: must be in (0, 1), got {args.coverage}", file=sys.stderr)
        return 2
    try:
        rows = read_csv(args.csv)
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

    out = evaluate(rows, model=HorusModel(HorusConfig(coverage=args.coverage)), columns=cols, bootstrap=boot,
                   rules=rules)
    if args.json:
        print(json.dumps(out))
    else:
        for k in ("rmsle", "rmsle_after_20", "rmsle_first_sight", "coverage"):
            print(f"{k:18s} " + "  ".join(f"{c}={v}" for c, v in out[k].items()))
        print(f"rows {out['rows']}, scored {out['scored']}, errors {len(out['errors'])}")
        for e in out["errors"][:10]:
            print(f"  row {e['row']}: {e['error']}")
    return 0
