"""``phasewise replay``: its flags, and the run from a trace to the table, the JSON lines and the report
(docs/results.md; the ``--json`` schema is :mod:`phasewise.kit.records.replay_output`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.apps.replay.driving import (
    FleetDetail,
    FleetOptions,
    fleet_sequences,
    replay_trace,
    split_of,
)
from phasewise.apps.replay.policies import PolicyUnavailable, policy_specs
from phasewise.apps.replay.results import format_table, result_rows
from phasewise.apps.replay.through_kafka import (
    KafkaReplayError,
    ThroughKafkaUnsupported,
    fallback_series,
    phase_series,
    through_kafka,
    worker_in_process,
    worker_origin,
)
from phasewise.apps.replay.traces import (
    FORMATS,
    Trace,
    TraceFormatError,
    load_trace,
    sample_path,
    subtrace,
)
from phasewise.kit.command import arg_type, report_dir
from phasewise.kit.settings import (
    PHASE_STATISTICS,
    SPECS,
    PhaseSettings,
    Settings,
    above,
    at_least,
    in_range,
    parse_float,
    parse_int,
    parse_str,
)
from phasewise.models.phases.features import PRETRAINED_MODELS

__all__ = [
    "add_arguments",
    "replay_command",
    "run",
    "trace_fields",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import add_setting

    fleet = FleetOptions()  # the fleet's knobs: replay's own, and the worker's phase settings

    p.add_argument("path", nargs="?", help="trace file (ai4dl) or folder (genai2026); "
                   "default: the AI4DL sample shipped with phasewise")
    p.add_argument("--format", choices=sorted(FORMATS), default="ai4dl",
                   help="trace layout: " + "; ".join(f"{k} = {v}" for k, v in FORMATS.items()))
    p.add_argument("--policies", default="vpa,window,phase,oracle",
                   help="comma-separated policy families among vpa, window, phase, oracle (default: all)")
    p.add_argument("--windows", default="5,10,30,60", type=arg_type(parse_str, _check_windows),
                   help="window sizes (samples) of the window family (default %(default)s)")
    p.add_argument("--through-kafka", action="store_true",
                   help="run the policies the stream worker runs (vpa) through a broker and a real "
                        "phasewise worker instead of in-process; the others stay in-process")
    p.add_argument("--bootstrap", help="with --through-kafka: use this broker instead of starting an "
                   "embedded one (the replay worker reads the whole samples topic and publishes "
                   "decisions for every host in it: not a broker live actuators listen to)")
    p.add_argument("--phase-model", choices=("container", "fleet", "worker"), default="container",
                   help="phase policy: one model per container (default); one model shared by all "
                        "containers (fleet: the worker's detector with replay's own fallback and knobs); or "
                        "the worker's own code in-process (worker: VPA fallback, decisions, learner; what "
                        "--through-kafka runs through a broker)")
    p.add_argument("--phase-pretrained", nargs="?", const=PRETRAINED_MODELS[0], default=None, dest="phase_start_model",
                   choices=PRETRAINED_MODELS, metavar="MODEL",
                   help="--phase-model worker / --through-kafka: start from a shipped pretrained model: corpus (the "
                        "default: the train split of phasewise's corpus) or ai4dl (the AI4DL sample) (default: "
                        "cold; a trace must not be scored by a model that saw it)")
    p.add_argument("--phase-frozen", action="store_true",
                   help="--phase-model worker / --through-kafka: the learner never updates the detectors' model "
                        "(needs --phase-pretrained); the two paths then decide identically")
    p.add_argument("--safety", action="store_true",
                   help="--phase-model worker / --through-kafka: the worker's live safety rules bound its decisions "
                        "(safety_rules with the live defaults); default off: the bare policy's decisions are scored")
    p.add_argument("--phase-stats", choices=PHASE_STATISTICS,
                   default=Settings.default("phase_statistics"),
                   help="--phase-model fleet or worker, --through-kafka: per-phase statistics of usage relative to "
                        "each container's level (default) or of absolute usage (the pooled design before)")
    p.add_argument("--phase-quantile", type=arg_type(parse_float, in_range(0, 1, lo_open=True)),
                   default=fleet.quantile,
                   help="--phase-model fleet: phase quantile (default %(default)s)")
    p.add_argument("--phase-margin", type=arg_type(parse_float, at_least(0)), default=fleet.margin,
                   help="--phase-model fleet: margin over the quantile (default %(default)s)")
    p.add_argument("--level-half-life", type=arg_type(parse_float, above(0)),
                   default=fleet.level_half_life,
                   help="--phase-model fleet, relative: half-life in samples of the decaying max "
                        "that is a container's level (default %(default)s)")
    cap = SPECS["phase_ratio_cap"]  # the worker's phase_ratio_cap: its check and default
    p.add_argument("--phase-ratio-cap", type=arg_type(parse_float, cap.validate),
                   default=cap.default, metavar="C",
                   help="--phase-model fleet, relative: use a phase's quantile of usage/level up "
                        "to C, so a limit is at most level x C x (1 + margin) (default "
                        "%(default)s, see docs/results.md; 0 = no cap)")
    p.add_argument("--phase-resource-quantiles", default="", metavar="R=Q,...", type=arg_type(parse_str, _per_resource),
                   help="--phase-model fleet: per-resource quantiles overriding --phase-quantile, e.g. mem=0.97")
    p.add_argument("--phase-resource-margins", default="", metavar="R=M,...", type=arg_type(parse_str, _per_resource),
                   help="--phase-model fleet: per-resource margins overriding --phase-margin, e.g. mem=0")
    p.add_argument("--phase-target-fulfilment", type=arg_type(parse_float, in_range(0, 1, lo_open=True)), default=None,
                   metavar="F",
                   help="--phase-model fleet: each container adapts a multiplier of its phase limits online "
                        "from its own misses, aiming at this fulfilment (default: off)")
    p.add_argument("--pretrain-folds", type=arg_type(parse_int, _check_folds),
                   default=fleet.pretrain_folds, metavar="K",
                   help="--phase-model fleet: cross-fitted pretraining; each of K container folds is scored "
                        "by a model pretrained on the other folds only (0: start cold; K = number of "
                        "containers: leave-one-out)")
    p.add_argument("--split", choices=("all", "tune", "holdout"), default="all",
                   help="replay only the containers of this fixed split (md5 of the id: even last hex digit = "
                        "tune, odd = holdout)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line instead of a table")
    p.add_argument("--report", metavar="DIR", type=report_dir, help="write PNG plots and summary.md into DIR")
    p.add_argument("--plot-containers", type=arg_type(parse_int, at_least(0)), default=6,
                   help="containers plotted in the report (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_setting(p, "log_level")


def _check_windows(text: str) -> None:
    """Window sizes: a comma list of positive integers."""
    try:
        windows = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        windows = []
    if not windows or min(windows) < 1:
        raise ValueError(f"must be positive integers, e.g. 5,10,30,60; got {text!r}")


def _check_folds(k: int) -> None:
    if k < 0 or k == 1:
        raise ValueError(f"must be 0 (no pretraining) or at least 2 folds, got {k}")


def _per_resource(text: str) -> tuple[tuple[str, float], ...]:
    """``"mem=0.97,gpu=0.9"`` -> ``(("mem", 0.97), ("gpu", 0.9))``.

    >>> _per_resource("mem=0.97, gpu_mem=0.98")
    (('mem', 0.97), ('gpu_mem', 0.98))
    """
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, val = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out.append((name.strip(), parse_float(val)))
        except ValueError:
            raise ValueError(f"expected RESOURCE=NUMBER (a finite number), got {part!r}") from None
    return tuple(out)


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every flag's value when it is not given (the parser's defaults)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return vars(p.parse_args([]))


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag's value: *args*' own, else the parser's default."""
    return {**_defaults(), **vars(args)}


def replay_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (written into the report).

    It names the flags that are not at their defaults.
    """
    o, d = _options(args), _defaults()
    parts = ["phasewise", "replay"]
    if o["path"] is not None:
        parts.append(o["path"])
    parts += ["--format", o["format"], "--policies", o["policies"]]
    if o["windows"] != d["windows"]:
        parts += ["--windows", o["windows"]]
    if o["through_kafka"]:
        parts.append("--through-kafka")
        if o["bootstrap"]:
            parts += ["--bootstrap", o["bootstrap"]]
    if o["phase_start_model"]:
        parts.append("--phase-pretrained")
        if o["phase_start_model"] != PRETRAINED_MODELS[0]:
            parts.append(o["phase_start_model"])
    for flag in ("phase_frozen", "safety"):
        if o[flag]:
            parts.append("--" + flag.replace("_", "-"))
    if o["phase_model"] == "worker" or o["through_kafka"]:
        if o["phase_model"] == "worker":
            parts += ["--phase-model", "worker"]
        if o["phase_stats"] != d["phase_stats"]:
            parts += ["--phase-stats", o["phase_stats"]]
    elif o["phase_model"] != d["phase_model"]:
        parts += ["--phase-model", o["phase_model"]]
        for k in ("phase_stats", "phase_quantile", "phase_margin", "level_half_life",
                  "phase_ratio_cap", "phase_resource_quantiles", "phase_resource_margins",
                  "phase_target_fulfilment", "pretrain_folds"):
            if o[k] != d[k]:
                parts += ["--" + k.replace("_", "-"), str(o[k])]
    if o["split"] != d["split"]:
        parts += ["--split", o["split"]]
    if o["json"]:
        parts.append("--json")
    if o["report"]:
        parts += ["--report", str(o["report"])]
    if o["plot_containers"] != d["plot_containers"]:
        parts += ["--plot-containers", str(o["plot_containers"])]
    return " ".join(shlex.quote(p) for p in parts)


def run(args: argparse.Namespace) -> int:
    command = replay_command(args)
    o = _options(args)
    if o["bootstrap"] and not args.through_kafka:
        print("phasewise replay: error: --bootstrap: needs --through-kafka", file=sys.stderr)
        return 2
    try:
        windows = tuple(int(w) for w in args.windows.split(",") if w.strip())
        if not windows or min(windows) < 1:
            raise ValueError
    except ValueError:
        print(f"phasewise replay: error: --windows: must be positive integers, got {args.windows!r}", file=sys.stderr)
        return 2
    path = args.path
    if path is None:
        if args.format != "ai4dl":
            print("phasewise replay: error: PATH: required for --format genai2026", file=sys.stderr)
            return 2
        path = str(sample_path())
    show = None if args.quiet or not sys.stderr.isatty() else sys.stderr  # progress, on a terminal only
    if show is not None:
        print(f"replay: reading {path}", file=show, flush=True)
    try:
        trace = load_trace(path, args.format)
    except TraceFormatError as e:
        print(f"phasewise replay: {e}", file=sys.stderr)
        return 2
    split = o["split"]
    if split != "all":
        trace = subtrace(trace, {c.container for c in trace.containers if split_of(c.container) == split})
        if not trace.containers:
            print(f"phasewise replay: error: --split: no container of the trace is in the {split} split",
                  file=sys.stderr)
            return 2
    try:
        rq = _per_resource(o["phase_resource_quantiles"])
        rm = _per_resource(o["phase_resource_margins"])
    except ValueError as e:
        print(f"phasewise replay: error: --phase-resource-quantiles/margins: {e}", file=sys.stderr)
        return 2
    opts = FleetOptions(statistics=o["phase_stats"], resource_quantiles=rq, resource_margins=rm,
                        target_fulfilment=o["phase_target_fulfilment"],
                        quantile=o["phase_quantile"], margin=o["phase_margin"],
                        level_half_life=o["level_half_life"],
                        ratio_cap=PhaseSettings.cap(o["phase_ratio_cap"]),
                        pretrain_folds=o["pretrain_folds"])
    try:
        specs = policy_specs(args.policies.split(","), windows=windows, units=trace.units)
    except (ValueError, PolicyUnavailable) as e:
        print(f"phasewise replay: error: --policies: {e}", file=sys.stderr)
        return 2
    phase_model = o["phase_model"]
    pretrained, frozen = o["phase_start_model"], o["phase_frozen"]
    safety = bool(o["safety"])
    if (pretrained or frozen or safety) and phase_model != "worker" and not args.through_kafka:
        print("phasewise replay: error: --phase-pretrained/--phase-frozen/--safety: apply to --phase-model worker "
              "and --through-kafka", file=sys.stderr)
        return 2
    if frozen and not pretrained:
        print("phasewise replay: error: --phase-frozen: needs --phase-pretrained (a frozen cold model never warms: "
              "the policy would be its VPA fallback throughout)", file=sys.stderr)
        return 2
    sequences = None
    phase_ids = None
    phase_fallback: dict[str, dict[str, np.ndarray]] | None = None
    worker_info: dict[str, Any] = {}
    has_phase = any(sp.name == "phase" for sp in specs)
    if args.through_kafka:
        try:
            sequences = through_kafka(trace, specs, o["bootstrap"], frozen_model=frozen,
                                      pretrained=pretrained, statistics=o["phase_stats"],
                                      safety=safety)
        except ThroughKafkaUnsupported as e:
            print(f"phasewise replay: error: --through-kafka: {e}", file=sys.stderr)
            return 2
        except KafkaReplayError as e:
            print(f"phasewise replay --through-kafka: {e}", file=sys.stderr)
            return 1
    if phase_model == "worker" and any(sp.name == "phase" for sp in specs) and "phase" not in (sequences or {}):
        try:
            got = worker_in_process(trace, family="phase", frozen_model=frozen, pretrained=pretrained,
                                    statistics=o["phase_stats"], safety=safety)
        except KafkaReplayError as e:
            print(f"phasewise replay: --phase-model worker: {e}", file=sys.stderr)
            return 2
        sequences = {**(sequences or {}), "phase": got.sequences}
        phase_ids = phase_series(trace, got.phase_changes)
        phase_fallback = fallback_series(trace, got.decisions)
        worker_info = {"model_origin": got.model_origin, "snapshots": got.snapshots,
                       "phase_features": got.settings_env.get("PHASEWISE_PHASE_FEATURES"),
                       "decisions": len(got.decisions)}
        print(f"phase (worker, in-process): {len(got.decisions)} decisions over {got.messages} messages, "
              f"features {worker_info['phase_features']}, started {got.model_origin}, "
              f"{got.snapshots} snapshots, {got.elapsed_s:.1f} s", file=sys.stderr)
    if phase_model == "fleet" and any(sp.name == "phase" for sp in specs):
        if sequences is not None and "phase" in sequences:
            print("phasewise replay: error: --phase-model: fleet runs in-process only (the worker's phase path "
                  "is already the fleet)", file=sys.stderr)
            return 2
        try:
            detail = FleetDetail()
            sequences = {**(sequences or {}), "phase": fleet_sequences(trace, options=opts, detail=detail,
                                                                       progress=show)}
            phase_fallback, phase_ids = detail.fallback, detail.phases
        except ValueError as e:
            print(f"phasewise replay: {e}", file=sys.stderr)
            return 2
    phase_info = None
    if has_phase and (phase_model == "worker" or args.through_kafka):
        origin = worker_info.get("model_origin") or worker_origin(
            trace, pretrained=pretrained, statistics=o["phase_stats"], bootstrap=o["bootstrap"])
        where = "through Kafka" if args.through_kafka else "in-process"
        phase_info = {"class": f"phasewise worker --policy phase ({where}; one model shared by all containers)",
                      "warm_start": {origin: len(trace.containers)}}
    elif has_phase and phase_model == "fleet":
        k = opts.pretrain_folds
        origin = (f"pretrained on the other {k - 1} of {k} container folds (cross-fitted)" if k >= 2 else "cold")
        phase_info = {"class": "one model shared by all containers (replay --phase-model fleet)",
                      "warm_start": {origin: len(trace.containers)}}
    result = replay_trace(trace, specs, plot_containers=max(0, args.plot_containers), progress=show,
                          sequences=sequences, phase_info=phase_info, phase_ids=phase_ids,
                          phase_fallback=phase_fallback)
    rows, savings = result_rows(result)
    setup: dict[str, Any] = {"type": "setup", "command": command, **trace_fields(trace),
                             "policies": [sp.name for sp in specs],
                             "phase_model": ("worker" if args.through_kafka and has_phase else phase_model)
                             if has_phase else None,
                             "phase_start": result.phase_info.get("warm_start") if has_phase else None,
                             "split": split, "windows": list(windows), "through_kafka": bool(args.through_kafka),
                             "elapsed_s": round(result.elapsed_s, 3)}
    if setup["phase_model"] == "worker" and has_phase:
        setup.update({"pretrained": bool(pretrained), "pretrained_model": pretrained or None,
                      "frozen": frozen, "safety_rules": safety,
                      "statistics": o["phase_stats"],
                      **worker_info})
    if setup["phase_model"] == "fleet":
        setup.update({k: getattr(opts, k) for k in ("statistics", "quantile", "margin", "level_half_life", "ratio_cap",
                                                    "target_fulfilment", "pretrain_folds")})
        setup["resource_quantiles"] = dict(opts.resource_quantiles)
        setup["resource_margins"] = dict(opts.resource_margins)
    unscored = [r for r, res in result.resources.items() if res.valid_steps == 0]
    if args.json:
        for n in trace.notes:  # stdout holds only JSON; a person running it still sees what loading did
            print(f"phasewise replay: note: {n}", file=sys.stderr)
        for row in [setup, *rows, *savings]:
            print(json.dumps(row, sort_keys=False, allow_nan=False))
    else:
        print(f"trace: {trace.format} {trace.source}: {len(trace.containers)} containers, "
              f"{trace.n_samples()} samples; replayed in {result.elapsed_s:.1f} s")
        for n in trace.notes:
            print(f"note: {n}")
        print(format_table(rows, savings))
    for r in unscored:
        print(f"phasewise replay: warning: {r}: no value in the trace, so no step is scored for it "
              "(see the notes)", file=sys.stderr)
    if args.report:
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font cache lines are not the report
        from phasewise.apps.replay.report import write_report

        written = write_report(result, rows, savings, Path(args.report), command=command, setup=setup)
        print(f"report: {len(written)} files in {args.report}", file=sys.stderr)
    return 0


def trace_fields(trace: Trace) -> dict[str, Any]:
    """What the setup line says about the trace: where from, its size, units and what loading changed."""
    return {"trace": {"format": trace.format, "source": trace.source, "containers": len(trace.containers),
                      "samples": trace.n_samples(), "units": dict(trace.units), "time_unit": trace.time_unit,
                      "notes": list(trace.notes),
                      "negative_clipped": dict(trace.counts.get("negative_clipped", {})),
                      "non_finite_missing": dict(trace.counts.get("non_finite_missing", {}))}}
