"""The cluster experiment's figures: what the topics say of each job, the summary, the report's plots.

docs/results.md ("Jobs through every role") says what each figure means.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.apps.experiment.cluster_plan import ACCEPTABLE, OBJECTIVE, PlannedJob
from phasewise.kit.records import TERMINAL_KINDS

__all__ = ["LIFECYCLE", "SLO_MS", "WARMUP_S", "Records", "format_summary", "is_terminal", "job_states",
           "prediction_errors", "summarize", "write_report"]

#: the service's latency objective: p99 of a window at most this (milliseconds)
SLO_MS = 50.0
#: job-event kinds that say where a job is in its life (progress and priority do not)
LIFECYCLE = ("submitted", "admitted", "started", "rejected", "frozen", "thawed", "finished", "failed",
             "terminated", "lost", "stopped", "waiting")
#: seconds after a job starts left out of its observed CPU use (its loading phase)
WARMUP_S = 3.0


# --------------------------------------------------------------------------- records and the summary


@dataclass
class Records:
    """What the run read back from the topics, in arrival order."""

    events: list[Any] = field(default_factory=list)       # JobEvent
    decisions: list[Any] = field(default_factory=list)    # Decision
    predictions: list[Any] = field(default_factory=list)  # UtilisationPrediction
    samples: list[Any] = field(default_factory=list)      # HostSamples
    actuations: list[Any] = field(default_factory=list)   # Actuation
    dead_letters: list[Any] = field(default_factory=list)  # DeadLetter


def job_states(events: list[Any]) -> dict[str, list[Any]]:
    """Each job's lifecycle events in the order the topic holds them."""
    out: dict[str, list[Any]] = defaultdict(list)
    for e in events:
        if e.kind in LIFECYCLE:
            out[e.job].append(e)
    return out


def is_terminal(states: list[Any]) -> bool:
    """Ended: a terminal state, or terminated with nothing after it (no resume)."""
    for i, e in enumerate(states):
        if e.kind in TERMINAL_KINDS:
            return True
        if e.kind == "terminated" and not any(x.kind in ("admitted", "started") for x in states[i + 1:]):
            return True
    return False


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def prediction_errors(jobs: list[PlannedJob], rec: Records) -> list[tuple[str, float]]:
    """|ln(predicted / observed)| of each job's mean CPU cores, in submission order.

    Predicted: the job's first utilisation prediction (``cpu_cores.mean``); observed: the mean of its
    container's samples after its first :data:`WARMUP_S` seconds of running.
    """
    first_pred: dict[str, float] = {}
    for p in rec.predictions:
        first_pred.setdefault(p.job, p.cpu_cores.mean)
    container = {e.job: (e.container or e.job) for e in rec.events if e.kind == "started"}
    started = {e.job: e.ts for e in rec.events if e.kind == "started"}
    use: dict[str, list[float]] = defaultdict(list)
    for hs in rec.samples:
        for c in hs.containers:
            use[c.container].append((hs.ts, c.cpu_cores))  # type: ignore[arg-type]
    out = []
    for j in jobs:
        pred = first_pred.get(j.job)
        if pred is None or j.job not in started:
            continue
        obs = [cores for ts, cores in use.get(container[j.job], []) if ts >= started[j.job] + WARMUP_S]
        mean_obs = sum(obs) / len(obs) if obs else 0.0
        if pred > 0 and mean_obs > 0.01:
            out.append((j.job, abs(math.log(pred / mean_obs))))
    return out


def summarize(jobs: list[PlannedJob], rec: Records, *, leaked: int | None, probe: str, wall_s: float,
              trace: str, span_s: float) -> dict[str, Any]:
    """The run's figures, from the records alone."""
    states = job_states(rec.events)
    submitted = {e.job: e.ts for e in rec.events if e.kind == "submitted"}
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    outcomes: dict[str, int] = defaultdict(int)
    stuck = []
    for j in jobs:
        st = states.get(j.job, [])
        for e in st:
            if e.kind == "started":
                started.setdefault(j.job, e.ts)
        if is_terminal(st):
            end = next(e for e in st if e.kind in TERMINAL_KINDS or e.kind == "terminated")
            ended[j.job] = end.ts
            outcomes[end.kind] += 1
        else:
            last = st[-1] if st else None
            placed = [d for d in rec.decisions if d.action == "place" and d.container == j.job]
            what = last.kind if last else "never submitted"
            why = (f"last state {what}" + (f" on {last.host}" if last and last.host else "")
                   + (f" ({last.reason})" if last and last.kind == "waiting" and last.reason else "")
                   + (f"; placed by {placed[-1].policy}" if placed else "; no place decision"))
            stuck.append({"job": j.job, "state": what, "reason": why})
    # time to objective: the first progress report at or past the job's objective, from its submission
    reached: dict[str, float] = {}
    for e in rec.events:
        if e.kind != "progress" or e.job in reached or e.job not in submitted or e.loss is None:
            continue
        if e.job.startswith("train-") and e.loss <= OBJECTIVE:
            reached[e.job] = e.ts - submitted[e.job]
    training = [j.job for j in jobs if j.kind == "train"]
    # the service's SLO: the share of its windows (with requests) whose p99 was above SLO_MS
    windows = [e.metric for e in rec.events if e.kind == "progress" and e.job.startswith("svc-")
               and e.metric is not None]
    errs = prediction_errors(jobs, rec)
    dl_kinds: dict[str, int] = defaultdict(int)
    for d in rec.dead_letters:
        dl_kinds[f"{d.source_topic}: {d.reason[:100]}"] += 1
    waits = [started[j] - submitted[j] for j in started if j in submitted]
    runs = [ended[j] - started[j] for j in ended if j in started]
    return {
        "jobs": len(jobs),
        "terminal": sum(1 for j in jobs if is_terminal(states.get(j.job, []))),
        "stuck": stuck,
        "outcomes": dict(sorted(outcomes.items())),
        "leaked_bookings": leaked,
        "leak_probe": probe,
        "slo_ms": SLO_MS,
        "slo_violation_share": (round(sum(1 for w in windows if w > SLO_MS) / len(windows), 4)
                                if windows else None),
        "service_windows": len(windows),
        "mean_time_to_objective_s": _mean(list(reached.values())),
        "objectives_reached": len(reached),
        "training_jobs": len(training),
        "objective_loss": OBJECTIVE,
        "prediction_log_error_first_10": _mean([e for _, e in errs[:10]]),
        "prediction_log_error_last_10": _mean([e for _, e in errs[-10:]]) if len(errs) >= 10 else None,
        "predicted_jobs_compared": len(errs),
        "model_versions": sorted({p.model_version for p in rec.predictions}),
        "mean_wait_s": _mean(waits),
        "mean_run_s": _mean(runs),
        "dead_letters": dict(sorted(dl_kinds.items())),
        "wall_s": round(wall_s, 1),
        "trace": trace,
        "arrival_span_s": span_s,
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"experiment cluster: {s['jobs']} jobs, {s['terminal']} in an end state "
             f"({', '.join(f'{k} {v}' for k, v in s['outcomes'].items()) or 'none'}), "
             f"{len(s['stuck'])} stuck, leaked bookings {s['leaked_bookings']} ({s['leak_probe']})"]
    for x in s["stuck"]:
        lines.append(f"  stuck {x['job']}: {x['reason']}")
    lines.append(f"service: p99 over {s['slo_ms']:.0f} ms in {s['slo_violation_share']} of "
                 f"{s['service_windows']} windows")
    lines.append(f"training: {s['objectives_reached']}/{s['training_jobs']} reached loss {s['objective_loss']}, "
                 f"mean time to objective {s['mean_time_to_objective_s']} s (from submission); "
                 f"mean wait {s['mean_wait_s']} s, mean run {s['mean_run_s']} s")
    lines.append(f"horus: |ln(predicted/observed CPU)| first 10 {s['prediction_log_error_first_10']}, "
                 f"last 10 {s['prediction_log_error_last_10']} ({s['predicted_jobs_compared']} jobs; "
                 f"model versions {s['model_versions']})")
    lines.append(f"dead letters {s['dead_letters'] or 'none'}; {s['wall_s']} s; arrivals from {s['trace']} "
                 f"scaled to {s['arrival_span_s']} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the report


def write_report(folder: Path, jobs: list[PlannedJob], rec: Records, summary: dict[str, Any], t0: float) -> None:
    """A timeline plot per job (its states, and its loss or p99 latency), an overview and the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (folder / "summary.txt").write_text(format_summary(summary) + "\n")
    states = job_states(rec.events)
    progress: dict[str, list[Any]] = defaultdict(list)
    for e in rec.events:
        if e.kind == "progress":
            progress[e.job].append(e)
    colours = {"finished": "tab:green", "failed": "tab:red", "rejected": "tab:orange", "lost": "tab:purple",
               "terminated": "tab:brown"}
    fig, ax = plt.subplots(figsize=(10, 0.25 * len(jobs) + 1.5))
    for i, j in enumerate(jobs):
        st = states.get(j.job, [])
        ts = {e.kind: e.ts - t0 for e in reversed(st)}
        sub, start = ts.get("submitted"), ts.get("started")
        end_ev = next((e for e in st if e.kind in colours), None)
        end = end_ev.ts - t0 if end_ev else None
        if sub is not None:
            ax.barh(i, (start if start is not None else (end or sub + 1)) - sub, left=sub, color="lightgrey")
        if start is not None:
            ax.barh(i, (end if end is not None else start + 1) - start, left=start,
                    color=colours.get(end_ev.kind, "tab:blue") if end_ev else "tab:blue",
                    hatch=None if end_ev else "//")
    ax.set_yticks(range(len(jobs)), [j.job for j in jobs], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the start (grey: waiting; green finished, red failed, hatched: no end state)")
    fig.tight_layout()
    fig.savefig(folder / "timeline.png", dpi=110)
    plt.close(fig)
    jobs_dir = folder / "jobs"
    jobs_dir.mkdir(exist_ok=True)
    for j in jobs:
        fig, ax = plt.subplots(figsize=(7, 3))
        pts = progress.get(j.job, [])
        if j.kind == "service":
            xs = [e.ts - t0 for e in pts if e.metric is not None]
            ys = [e.metric for e in pts if e.metric is not None]
            ax.plot(xs, ys, ".-", label="p99 latency, ms")
            ax.axhline(SLO_MS, color="red", lw=0.8, label="SLO")
        else:
            xs = [e.ts - t0 for e in pts if e.loss is not None]
            ys = [e.loss for e in pts if e.loss is not None]
            if ys:
                ax.plot(xs, ys, ".-", ms=2, label="loss")
                ax.set_yscale("log")
                if j.kind == "train":
                    ax.axhline(OBJECTIVE, color="green", lw=0.8, label="objective")
                    ax.axhline(ACCEPTABLE, color="orange", lw=0.8, label="acceptable")
        for e in states.get(j.job, []):
            ax.axvline(e.ts - t0, color=colours.get(e.kind, "grey"), lw=0.8, ls="--")
            ax.annotate(e.kind, (e.ts - t0, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                        va="top")
        ax.set_title(f"{j.job} ({j.workload}, priority {j.priority})", fontsize=9)
        ax.set_xlabel("seconds since the start")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="lower left")
        fig.tight_layout()
        fig.savefig(jobs_dir / f"{j.job}.png", dpi=90)
        plt.close(fig)
