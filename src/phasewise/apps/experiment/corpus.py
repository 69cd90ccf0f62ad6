"""``phasewise experiment corpus``: record a corpus of repeated real training executions through the
product's own roles, and measure how well the phase detector's phases agree with the jobs' stages.

``corpus record --out DIR``: the embedded broker, the host agent (``phasewise produce --interval 1``,
every container each second), and one execution at a time, unlimited, in a cgroup of its own named by
its id, wrapped by ``phasewise progress --stages`` (its load, train, eval and checkpoint lines reach the
job-events topic); after each, ``phasewise record`` writes its Parquet file with the provenance header
and a ``context`` (the machine, the load average during the execution, no GPU). A ``manifest.json``
lists every execution with its kind, run, flags, split and file; a folder already holding some is
continued. ``corpus agreement [DIR]``: the phase detector as the worker runs it (replay's in-process
worker, the shipped model, frozen) over the held-out executions, and the adjusted mutual information
and adjusted Rand index between its phases and the reported stages. docs/phases.md, "The corpus".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from phasewise.apps.experiment.corpus_plan import (
    FORMAT,
    HELD_OUT_KIND,
    HELD_OUT_RUNS,
    KINDS,
    MANIFEST,
    STAGES,
    VERSION,
    CorpusError,
    Execution,
    agreement_metrics,
    plan,
    read_manifest,
    shipped_corpus,
    stage_series,
)
from phasewise.apps.experiment.corpus_recorder import Recorder, iso, machine, write_json
from phasewise.models.phases.features import PRETRAINED_MODELS

__all__ = ["CorpusError", "add_arguments", "agreement", "read_manifest", "run", "shipped_corpus"]

# --------------------------------------------------------------------------- the manifest


def tally(manifest: dict[str, Any]) -> None:
    """Write into *manifest* what it holds per kind and split, and what its plan leaves to record."""
    planned = manifest["planned"]
    got: dict[str, dict[str, int]] = {}
    for e in manifest["executions"]:
        got.setdefault(e["kind"], {"train": 0, "heldout": 0})[e["split"]] += 1
    manifest["recorded"] = {k: got.get(k, {"train": 0, "heldout": 0}) for k in planned["kinds"]}
    want = len(planned["kinds"]) * planned["runs_per_kind"]
    have = len(manifest["executions"])
    manifest["left"] = (f"{want - have} of the {want} planned executions ({len(planned['kinds'])} kinds x "
                        f"{planned['runs_per_kind']} runs) are not recorded yet: phasewise experiment corpus record "
                        "--out DIR continues the plan" if have < want else "none: every planned execution is recorded")


def _new_manifest(kinds: list[str], runs: int, command: list[str]) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION, "created": iso(time.time()), "command": command,
        "machine": machine(), "interval_s": 1.0, "stages": list(STAGES),
        "stage_words": "each job's own stage words map onto the stages: start, ready, resume -> load; error -> "
                       "train; exit -> checkpoint; a sample before the job's first line is load (the interpreter "
                       "starting and importing)",
        "split": {"held_out_kind": HELD_OUT_KIND,
                  "held_out_runs": f"run r with r % {HELD_OUT_RUNS[0]} == {HELD_OUT_RUNS[1]} of every other kind",
                  "rule": "phasewise.apps.experiment.corpus_plan.split_of(kind, run); each execution's split is "
                          "written below and checked against it when the manifest is read"},
        "kinds": {k: {"program": f"python -m {KINDS[k].module}", "data": KINDS[k].data,
                      "varies": sorted(KINDS[k].grid) + ["--seed"]} for k in kinds},
        "planned": {"kinds": kinds, "runs_per_kind": runs},
        "executions": [],
    }


def record(args: argparse.Namespace) -> int:
    prog = "phasewise experiment corpus record"
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    try:
        planned = plan(kinds, args.runs)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for flag, value in (("--max-executions", args.max_executions), ("--budget", args.budget),
                        ("--seconds", args.seconds)):
        if value is not None and not value > 0:
            print(f"{prog}: error: {flag}: must be above 0, got {value:g}", file=sys.stderr)
            return 2
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        print(f"{prog}: error: --out {out}: not a folder", file=sys.stderr)
        return 2
    command = ["phasewise", "experiment", "corpus", "record", *sys.argv[sys.argv.index("record") + 1:]] \
        if "record" in sys.argv else ["phasewise", "experiment", "corpus", "record", "--out", str(args.out)]
    if (out / MANIFEST).exists():
        try:
            manifest = read_manifest(out)
        except CorpusError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        manifest["planned"] = {"kinds": list(dict.fromkeys([*manifest["planned"]["kinds"], *kinds])),
                               "runs_per_kind": max(args.runs, manifest["planned"]["runs_per_kind"])}
        manifest.setdefault("sessions", []).append({"command": command, "started": iso(time.time())})
    else:
        out.mkdir(parents=True, exist_ok=True)
        manifest = _new_manifest(kinds, args.runs, command)
        manifest["sessions"] = [{"command": command, "started": iso(time.time())}]
    done = {e["id"] for e in manifest["executions"]}
    todo = [e for e in planned if e.id not in done][: args.max_executions]
    if args.seconds is not None:  # (a quick check; the manifest keeps the seconds each execution trained)
        todo = [Execution(e.id, e.kind, e.run, {**e.params, "--seconds": args.seconds}) for e in todo]
    if not todo:
        print(f"{prog}: every planned execution is already in {out}")
        return 0
    deadline = time.time() + args.budget if args.budget else None
    rec = Recorder(out, todo, cgroup_root=args.cgroup_root, log=sys.stderr)
    recorded = 0
    try:
        rec.start()
        for i, e in enumerate(todo):
            if deadline is not None and time.time() + float(e.params["--seconds"]) + 30 > deadline:
                print(f"{prog}: the budget leaves no time for {e.id}: stopping", file=sys.stderr)
                break
            print(f"[{i + 1}/{len(todo)}] {e.id} ({e.split}): {' '.join(e.argv('…'))}", file=sys.stderr, flush=True)
            entry = rec.execute(e, command)
            manifest["executions"].append(entry)
            tally(manifest)
            write_json(out / MANIFEST, manifest)
            recorded += 1
            print(f"    {entry['seconds']:.0f} s, {entry['samples']} samples, {entry['stages_reported']} stage "
                  f"reports, load {entry['load_avg_1m']['mean']} (max {entry['load_avg_1m']['max']})",
                  file=sys.stderr, flush=True)
    except CorpusError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        rec.close()
        tally(manifest)
        write_json(out / MANIFEST, manifest)
    print(f"recorded {recorded} execution(s) to {out}; the corpus holds {len(manifest['executions'])}")
    return 0


# --------------------------------------------------------------------------- agreement


def agreement(folder: Path, split: str = "heldout", model: str = "corpus") -> dict[str, Any]:
    """AMI and ARI between the worker's phases (the shipped *model*, frozen) and the reported stages, per kind
    and overall, over the executions of *split* (``heldout``, ``train`` or ``all``)."""
    from phasewise.apps.record.tracefile import RecordingError, read_recording
    from phasewise.apps.replay.through_kafka import KafkaReplayError, phase_series, worker_in_process
    from phasewise.apps.replay.traces import TraceFormatError, load_trace

    ami, ari = agreement_metrics()
    manifest = read_manifest(folder)
    execs = [e for e in manifest["executions"] if split == "all" or e["split"] == split]
    if not execs:
        raise CorpusError(f"{folder}: no execution in the {split} split")
    per_kind: dict[str, dict[str, list]] = {}
    rows = []
    origin = None
    for e in execs:
        path = folder / e["file"]
        try:
            trace = load_trace(path, "phasewise")
            header = read_recording(path).header
            got = worker_in_process(trace, family="phase", pretrained=model, frozen_model=True)
        except (TraceFormatError, RecordingError, KafkaReplayError) as err:
            raise CorpusError(f"execution {e['id']}: {err}") from None
        origin = got.model_origin
        ids = phase_series(trace, got.phase_changes)
        by_cid = {f"{c.get('host')}/{c.get('container')}": c for c in header.get("containers", [])}
        for series in trace.containers:
            entry = by_cid.get(series.container) or {}
            if entry.get("job") != e["id"]:
                continue  # (another container sampled at the time: not this execution)
            stages = stage_series(series.t, entry.get("stages") or [])
            phases = ids[series.container]
            k = per_kind.setdefault(e["kind"], {"phase": [], "stage": [], "samples": [0], "executions": []})
            k["samples"][0] += len(phases)
            k["executions"].append(e["id"])
            keep = phases >= 0
            k["phase"] += phases[keep].tolist()
            k["stage"] += [s for s, ok in zip(stages, keep.tolist()) if ok]
            rows.append(e["id"])
    if not rows:
        raise CorpusError(f"{folder}: no recording of the {split} split holds its execution's container")

    def score(phase: list[int], stage: list[str], samples: int, executions: list[str]) -> dict[str, Any]:
        if len(set(stage)) < 2:  # (sklearn gives 1.0 for two constant labelings: no agreement is measured)
            return {"executions": executions, "samples": samples, "samples_with_phase": len(phase), "ami": None,
                    "ari": None, "note": "fewer than two stages among the samples with a phase: undefined"}
        pairs: dict[str, dict[str, int]] = {}
        for p, s in zip(phase, stage):
            pairs.setdefault(s, {}).setdefault(str(p), 0)
            pairs[s][str(p)] += 1
        return {"executions": executions, "samples": samples, "samples_with_phase": len(phase),
                "ami": round(float(ami(stage, phase)), 4), "ari": round(float(ari(stage, phase)), 4),
                "stages": {s: sum(v.values()) for s, v in sorted(pairs.items())},
                "phases": len(set(phase)),
                "phase_by_stage": {s: dict(sorted(v.items())) for s, v in sorted(pairs.items())}}

    kinds = {k: score(v["phase"], v["stage"], v["samples"][0], v["executions"]) for k, v in sorted(per_kind.items())}
    allp = [p for v in per_kind.values() for p in v["phase"]]
    alls = [s for v in per_kind.values() for s in v["stage"]]
    overall = score(allp, alls, sum(v["samples"][0] for v in per_kind.values()), rows)
    return {"type": "corpus-agreement", "corpus": str(folder), "split": split,
            "model": f"the worker's phase detector, {origin}, frozen (replay --phase-model worker "
                     f"--phase-pretrained {model} --phase-frozen)",
            "labels": "per sample: the stage of the job's last report at or before it (load before its first); "
                      "samples before the detector's first phase are left out",
            "overall": overall, "kinds": kinds}


def format_agreement(res: dict[str, Any]) -> str:
    lines = [f"corpus {res['corpus']}, {res['split']} executions; {res['model']}",
             f"{'kind':<12} {'execs':>5} {'samples':>7} {'phased':>6} {'phases':>6} {'AMI':>7} {'ARI':>7}"]

    def f(v: float | None) -> str:
        return "—" if v is None else f"{v:.3f}"

    def row(name: str, r: dict[str, Any]) -> str:
        return (f"{name:<12} {len(r['executions']):>5} {r['samples']:>7} {r['samples_with_phase']:>6} "
                f"{r.get('phases', 0):>6} {f(r['ami']):>7} {f(r['ari']):>7}")

    lines += [row(k, r) for k, r in res["kinds"].items()]
    lines.append(row("overall", res["overall"]))
    lines.append("stages (samples with a phase): " + ", ".join(f"{s} {n}" for s, n in
                                                               res["overall"].get("stages", {}).items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase-pretrained", choices=PRETRAINED_MODELS, default=PRETRAINED_MODELS[0], metavar="MODEL",
                   dest="start_model",
                   help="the shipped model the detector runs: corpus (default; it learned on the train split) or "
                        "ai4dl")


def _path_and_split(p: argparse.ArgumentParser) -> None:
    """The corpus folder and the split scored, each execution after the other train runs of its kind."""
    p.add_argument("path", nargs="?", help="the corpus folder (default: the corpus shipped with phasewise)")
    p.add_argument("--split", choices=("heldout", "train"), default="heldout",
                   help="the executions scored (train: each after the other train runs of its kind; default: "
                        "heldout)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="corpus_command", metavar="COMMAND", required=True)
    r = sub.add_parser("record", help="run and record executions one at a time (root: a cgroup each)",
                       description="Run real training executions one at a time, unlimited, each in its own cgroup "
                                   "under phasewise progress --stages, sampled each second by phasewise produce, "
                                   "and record each with phasewise record into DIR (manifest.json lists them).")
    r.add_argument("--out", required=True, metavar="DIR", help="the corpus folder (new, or one to continue)")
    r.add_argument("--kinds", default=",".join(KINDS), help="job kinds (default %(default)s)")
    r.add_argument("--runs", type=int, default=8, help="runs of each kind (default 8)")
    r.add_argument("--max-executions", type=int, default=None, metavar="N", help="record at most N new executions")
    r.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no execution that might not end within this long of the start")
    r.add_argument("--seconds", type=float, default=None,
                   help="train each execution this long instead of its drawn 30, 45 or 60 s (a quick check)")
    r.add_argument("--cgroup-root", default="/sys/fs/cgroup")
    a = sub.add_parser("agreement", help="AMI and ARI between the worker's phases and the jobs' stages",
                       description="The worker's phase detector (the shipped model, frozen: replay's in-process "
                                   "worker) over the corpus's executions of a split; the adjusted mutual information "
                                   "and adjusted Rand index between its phases and the stages the jobs reported.")
    a.add_argument("path", nargs="?", help="the corpus folder (default: the corpus shipped with phasewise)")
    a.add_argument("--split", choices=("heldout", "train", "all"), default="heldout",
                   help="the executions scored (default: heldout)")
    _model_arg(a)
    a.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    an = sub.add_parser("anticipate", help="anticipated phase transitions on executions of known kinds, by horizon",
                        description="Each execution of the split through the worker's round (phase policy, the "
                                    "shipped model frozen, no safety rules) after the train split's runs of its kind "
                                    "(same signature), once per horizon (0: off): the limits in force scored on the "
                                    "same steps, beside VPA and the window family, and the transition book scored "
                                    "as a predictor (docs/phases.md, \"Anticipated transitions\").")
    _path_and_split(an)
    an.add_argument("--horizons", default=None, metavar="S,S,...",
                    help="horizons scored, seconds (default: 0, 5, 10, 20; 0 is anticipation off)")
    _model_arg(an)
    an.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    mo = sub.add_parser("models", help="the starting phase model judged on the train split: leave one kind out",
                        description="Per kind of the train split, a model learned on the other kinds' train "
                                    "executions (make_pretrained's procedure) against the shipped AI4DL model on "
                                    "this kind's: phase/stage agreement and the bare phase policy through the "
                                    "worker's round, against VPA, the windows and the frontier (docs/phases.md, "
                                    "\"The starting model\").")
    mo.add_argument("path", nargs="?", help="the corpus folder (default: the corpus shipped with phasewise)")
    mo.add_argument("--min-windows", type=int, default=None, metavar="N",
                    help="windows the CRBM learns at least, in passes over the executions (default: 1024, as the "
                         "shipped models)")
    mo.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    pr = sub.add_parser("prior", help="the known-job prior on executions of known kinds, against VPA and the windows",
                        description="Each execution of the split through the worker's step (the live safety rules "
                                    "and known-job priors) after the train split's runs of its kind (same "
                                    "signature); its limits scored on the steps the prior limited, beside VPA "
                                    "without the safety rules and the window family on the same steps "
                                    "(docs/priors.md).")
    _path_and_split(pr)
    pr.add_argument("--margins", default=None, metavar="M,M,...",
                    help="prior margins scored (default: 0.05, the setting's default, then 0, 0.1, 0.2)")
    pr.add_argument("--min-runs", type=int, default=3, help="earlier runs a prior needs (default 3)")
    pr.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    bo = sub.add_parser("bounds", help="what any policy could reach: hindsight bounds per block length, against the "
                                       "frontier",
                        description="Each execution of the split through the worker's round as anticipate runs it "
                                    "(the bare phase policy), beside VPA and the window family; then, per resource, "
                                    "the least allocation of a limit held constant over blocks of steps (a run, each "
                                    "reported stage segment, each segment of the detector's phase, every N steps), "
                                    "chosen knowing each block's usage, at the target fulfilment, and the slack it "
                                    "cuts against the reactive frontier (docs/results.md, \"What any policy could "
                                    "reach\").")
    _path_and_split(bo)
    bo.add_argument("--lengths", default=None, metavar="N,N,...",
                    help="fixed block lengths, in steps (default: 60, 30, 10, 5, 2)")
    bo.add_argument("--fulfilment", type=float, default=0.97,
                    help="the pooled fulfilment the bounds are held to (default 0.97, issue 24's target)")
    _model_arg(bo)
    bo.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    lv = sub.add_parser("live", help="known-job priors through produce, worker and actuate on real runs (root)",
                        description="Runs of one kind through the roles a user runs (the embedded broker, produce "
                                    "with the kind as each run's signature, worker, actuate --backend cgroup): the "
                                    "first --earlier runs have no prior, the --new ones start from theirs; the "
                                    "limits in force, OOM kills and CPU cuts while throttled, read from the topics "
                                    "(docs/priors.md).")
    lv.add_argument("--kind", default="charlstm", help="the job kind (default %(default)s)")
    lv.add_argument("--earlier", type=int, default=3, help="runs before the prior applies (default 3)")
    lv.add_argument("--new", type=int, default=2, help="runs after them (default 2)")
    lv.add_argument("--seconds", type=float, default=None,
                    help="train each run this long instead of its drawn 30, 45 or 60 s")
    lv.add_argument("--cgroup-root", default="/sys/fs/cgroup")
    lv.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _numbers(flag: str, text: str, hi: float, example: str) -> tuple[float, ...]:
    """A comma list of numbers in [0, *hi*] given to *flag*; :class:`CorpusError` in one line otherwise."""
    try:
        got = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise CorpusError(f"{flag} {text!r}: give numbers >= 0, e.g. {example}") from None
    if not all(0 <= v <= hi for v in got):
        raise CorpusError(f"{flag} {text!r}: each must be in [0, {hi:g}]")
    return got


def run(args: argparse.Namespace) -> int:
    if args.corpus_command == "record":
        return record(args)
    prog = f"phasewise experiment corpus {args.corpus_command}"
    folder = Path(args.path).expanduser() if getattr(args, "path", None) else shipped_corpus()
    try:
        if args.corpus_command == "live":
            from phasewise.apps.experiment.corpus_live import format_live, live

            res = live(args.kind, args.earlier, args.new, seconds=args.seconds, cgroup_root=args.cgroup_root)
            print(json.dumps(res, allow_nan=False) if args.json else format_live(res))
            return 0
        if args.corpus_command == "models":
            from phasewise.apps.experiment.corpus_models import format_models, models

            res = models(folder, args.min_windows)
            text = format_models(res)
        elif args.corpus_command == "anticipate":
            from phasewise.apps.experiment.corpus_anticipate import HORIZONS, anticipate, format_anticipate

            horizons = _numbers("--horizons", args.horizons, 3600, "0,10") if args.horizons else HORIZONS
            res = anticipate(folder, args.split, horizons, model=args.start_model)
            text = format_anticipate(res)
        elif args.corpus_command == "bounds":
            from phasewise.apps.experiment.corpus_bounds import LENGTHS, bounds, format_bounds

            lengths = LENGTHS
            if args.lengths:
                try:
                    lengths = tuple(int(v) for v in args.lengths.split(","))
                except ValueError:
                    raise CorpusError(f"--lengths {args.lengths!r}: give whole numbers of steps, e.g. 30,5") from None
            if not 0.0 <= args.fulfilment <= 1.0:
                raise CorpusError(f"--fulfilment {args.fulfilment:g}: give a share in [0, 1], e.g. 0.97")
            res = bounds(folder, args.split, lengths, model=args.start_model, fulfilment=args.fulfilment)
            text = format_bounds(res)
        elif args.corpus_command == "prior":
            from phasewise.apps.experiment.corpus_prior import MARGINS, format_priors, priors

            margins = _numbers("--margins", args.margins, 4, "0.05,0.1") if args.margins else MARGINS
            if args.min_runs < 1:
                raise CorpusError(f"--min-runs {args.min_runs}: at least 1")
            res = priors(folder, args.split, margins, args.min_runs)
            text = format_priors(res)
        else:
            res = agreement(folder, args.split, args.start_model)
            text = format_agreement(res)
    except CorpusError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, allow_nan=False) if args.json else text)
    return 0
