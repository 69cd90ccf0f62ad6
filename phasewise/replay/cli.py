"""``phasewise replay``: its flags, and the run from a trace to the table, the JSON lines and the report.

``--json`` prints one JSON object per line, each with ``"type"``: one
``setup`` line, a ``score`` line per policy family and resource, a
``savings`` line per resource (schema: ``infra/schemas/ReplayOutput.v1.json``,
:mod:`phasewise.replay_schema`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.replay.driving import (
    FleetDetail,
    FleetOptions,
    fleet_sequences,
    replay_trace,
    split_of,
)
from phasewise.replay.kafka import (
    KafkaReplayError,
    ThroughKafkaUnsupported,
    fallback_series,
    phase_series,
    through_kafka,
    worker_in_process,
    worker_origin,
)
from phasewise.replay.policies import PolicyUnavailable, policy_specs
from phasewise.replay.results import format_table, result_rows
from phasewise.replay.traces import (
    FORMATS,
    Trace,
    TraceFormatError,
    load_trace,
    sample_path,
    subtrace,
)
from phasewise.settings import (
    PHASE_STATISTICS,
    SPECS,
    above,
    arg_type,
    at_least,
    in_range,
    parse_float,
    parse_int,
    parse_str,
)

__all__ = [
    "add_arguments",
    "replay_command",
    "run",
    "trace_fields",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.cli import add_setting

    p.add_argument("path", nargs="?", help="trace file (ai4dl) or folder (genai2026); "
                   "default: the AI4DL sample shipped with phasewise")
    p.add_argument("--format", choices=sorted(FORMATS), default="ai4dl",
                   help="trace layout: " + "; ".join(f"{k} = {v}" for k, v in FORMATS.items()))
    p.add_argument("--policies", default="vpa,window,phase,oracle",
                   help="comma-separated policy families among vpa, window, phase, oracle (default: all)")
    p.add_argument("--windows", default="5,10,30,60", type=arg_type(parse_str, _check_windows),
                   help="window sizes (samples) of the window family (default 5,10,30,60)")
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
    p.add_argument("--phase-pretrained", action="store_true",
                   help="--phase-model worker / --through-kafka: start from the shipped model pretrained on the "
                        "AI4DL sample (default: cold; a trace must not be scored by a model that saw it)")
    p.add_argument("--phase-frozen", action="store_true",
                   help="--phase-model worker / --through-kafka: the learner never updates the detectors' model "
                        "(needs --phase-pretrained); the two paths then decide identically")
    p.add_argument("--safety", action="store_true",
                   help="--phase-model worker / --through-kafka: the worker's live safety rules bound its decisions "
                        "(safety_rules with the live defaults); default off: the bare policy's decisions are scored")
    p.add_argument("--phase-stats", choices=PHASE_STATISTICS, default="relative",
                   help="--phase-model fleet or worker, --through-kafka: per-phase statistics of usage relative to "
                        "each container's level (default) or of absolute usage (the pooled design before)")
    p.add_argument("--phase-quantile", type=arg_type(parse_float, in_range(0, 1, lo_open=True)), default=0.95, help="--phase-model fleet: phase quantile "
                   "(default 0.95)")
    p.add_argument("--phase-margin", type=arg_type(parse_float, at_least(0)), default=0.10, help="--phase-model fleet: margin over the "
                   "quantile (default 0.10)")
    p.add_argument("--level-half-life", type=arg_type(parse_float, above(0)), default=30.0, help="--phase-model fleet, relative: "
                   "half-life in samples of the decaying max that is a container's level (default 30)")
    p.add_argument("--phase-ratio-cap", type=arg_type(parse_float, SPECS["phase_ratio_cap"].validate), default=1.5,
                   metavar="C",
                   help="--phase-model fleet, relative: use a phase's quantile of usage/level up to C, so a limit is "
                        "at most level x C x (1 + margin) (default 1.5, see the README; 0 = no cap)")
    p.add_argument("--phase-resource-quantiles", default="", metavar="R=Q,...", type=arg_type(parse_str, _per_resource),
                   help="--phase-model fleet: per-resource quantiles overriding --phase-quantile, e.g. mem=0.97")
    p.add_argument("--phase-resource-margins", default="", metavar="R=M,...", type=arg_type(parse_str, _per_resource),
                   help="--phase-model fleet: per-resource margins overriding --phase-margin, e.g. mem=0")
    p.add_argument("--phase-target-fulfilment", type=arg_type(parse_float, in_range(0, 1, lo_open=True)), default=None,
                   metavar="F",
                   help="--phase-model fleet: each container adapts a multiplier of its phase limits online "
                        "from its own misses, aiming at this fulfilment (default: off)")
    p.add_argument("--pretrain-folds", type=arg_type(parse_int, _check_folds), default=0, metavar="K",
                   help="--phase-model fleet: cross-fitted pretraining; each of K container folds is scored "
                        "by a model pretrained on the other folds only (0: start cold; K = number of "
                        "containers: leave-one-out)")
    p.add_argument("--split", choices=("all", "tune", "holdout"), default="all",
                   help="replay only the containers of this fixed split (md5 of the id: even last hex digit = "
                        "tune, odd = holdout)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line instead of a table")
    p.add_argument("--report", metavar="DIR", help="write PNG plots and summary.md into DIR")
    p.add_argument("--plot-containers", type=arg_type(parse_int, at_least(0)), default=6, help="containers plotted in the report (default 6)")
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


def replay_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (written into the report)."""
    parts = ["phasewise", "replay"]
    if args.path is not None:
        parts.append(args.path)
    parts += ["--format", args.format, "--policies", args.policies]
    if args.windows != "5,10,30,60":
        parts += ["--windows", args.windows]
    if args.through_kafka:
        parts.append("--through-kafka")
        if getattr(args, "bootstrap", None):
            parts += ["--bootstrap", args.bootstrap]
    for flag in ("phase_pretrained", "phase_frozen", "safety"):
        if getattr(args, flag, False):
            parts.append("--" + flag.replace("_", "-"))
    if getattr(args, "phase_model", "container") == "worker" or args.through_kafka:
        if getattr(args, "phase_model", "container") == "worker":
            parts += ["--phase-model", "worker"]
        if getattr(args, "phase_stats", "relative") != "relative":
            parts += ["--phase-stats", args.phase_stats]
    elif getattr(args, "phase_model", "container") != "container":
        parts += ["--phase-model", args.phase_model]
        d = {"phase_stats": "relative", "phase_quantile": 0.95, "phase_margin": 0.10, "level_half_life": 30.0,
             "phase_ratio_cap": 1.5,
             "phase_resource_quantiles": "", "phase_resource_margins": "", "phase_target_fulfilment": None,
             "pretrain_folds": 0}
        for k, v in d.items():
            if getattr(args, k, v) != v:
                parts += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    if getattr(args, "split", "all") != "all":
        parts += ["--split", args.split]
    if args.json:
        parts.append("--json")
    if args.report:
        parts += ["--report", args.report]
    if args.plot_containers != 6:
        parts += ["--plot-containers", str(args.plot_containers)]
    return " ".join(shlex.quote(p) for p in parts)


def run(args: argparse.Namespace) -> int:
    command = replay_command(args)
    if getattr(args, "bootstrap", None) and not args.through_kafka:
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
    try:
        trace = load_trace(path, args.format)
    except TraceFormatError as e:
        print(f"phasewise replay: {e}", file=sys.stderr)
        return 2
    split = getattr(args, "split", "all")
    if split != "all":
        trace = subtrace(trace, {c.container for c in trace.containers if split_of(c.container) == split})
        if not trace.containers:
            print(f"phasewise replay: error: --split: no container of the trace is in the {split} split",
                  file=sys.stderr)
            return 2
    try:
        rq = _per_resource(getattr(args, "phase_resource_quantiles", ""))
        rm = _per_resource(getattr(args, "phase_resource_margins", ""))
    except ValueError as e:
        print(f"phasewise replay: error: --phase-resource-quantiles/margins: {e}", file=sys.stderr)
        return 2
    opts = FleetOptions(statistics=getattr(args, "phase_stats", "relative"),
                        resource_quantiles=rq, resource_margins=rm,
                        target_fulfilment=getattr(args, "phase_target_fulfilment", None),
                        quantile=getattr(args, "phase_quantile", 0.95), margin=getattr(args, "phase_margin", 0.10),
                        level_half_life=getattr(args, "level_half_life", 30.0),
                        ratio_cap=(getattr(args, "phase_ratio_cap", 1.5) or None),
                        pretrain_folds=getattr(args, "pretrain_folds", 0))
    try:
        specs = policy_specs(args.policies.split(","), windows=windows, units=trace.units)
    except (ValueError, PolicyUnavailable) as e:
        print(f"phasewise replay: error: --policies: {e}", file=sys.stderr)
        return 2
    phase_model = getattr(args, "phase_model", "container")
    pretrained, frozen = getattr(args, "phase_pretrained", False), getattr(args, "phase_frozen", False)
    safety = bool(getattr(args, "safety", False))
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
            sequences = through_kafka(trace, specs, getattr(args, "bootstrap", None), frozen_model=frozen,
                                      pretrained=pretrained, statistics=getattr(args, "phase_stats", "relative"),
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
                                    statistics=getattr(args, "phase_stats", "relative"), safety=safety)
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
            sequences = {**(sequences or {}), "phase": fleet_sequences(trace, options=opts, detail=detail)}
            phase_fallback, phase_ids = detail.fallback, detail.phases
        except ValueError as e:
            print(f"phasewise replay: {e}", file=sys.stderr)
            return 2
    show = None if args.quiet or not sys.stderr.isatty() else sys.stderr
    phase_info = None
    if has_phase and (phase_model == "worker" or args.through_kafka):
        origin = worker_info.get("model_origin") or worker_origin(
            trace, pretrained=pretrained, statistics=getattr(args, "phase_stats", "relative"),
            bootstrap=getattr(args, "bootstrap", None))
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
        setup.update({"pretrained": pretrained, "frozen": frozen, "safety_rules": safety,
                      "statistics": getattr(args, "phase_stats", "relative"),
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
        from phasewise.replay.report import write_report

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
