"""The priorities experiment's report: results.json, summary.md and two plots (PNG, matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["cpu_groups", "cpu_table", "write_report"]

TARGETS = {
    "preempt_to_frozen_ms": "decision -> frozen <= 1000 ms",
    "resume_lost_steps": "resumed jobs lose no completed step (0)",
    "slo_violation_share": "managed <= 1 % of requests and below static",
    "training_steps_per_s": "managed no lower than static",
}


def _cell(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def verdicts(out: dict) -> list[str]:
    """One line per target: met / missed, from the figures."""
    s = out["scenarios"]
    m, st = s.get("managed"), s.get("static")
    lines = []
    if m is None:
        return ["no managed scenario: no target checked"]
    f = m["preempt_to_frozen_ms"]
    lines.append(f"decision -> frozen <= 1 s: {'met' if f is not None and f <= 1000 else 'missed'} "
                 f"({_cell(f)} ms, the worst freeze)")
    lost = m["resume_lost_steps"]
    lines.append(f"resumed jobs lose no completed step: {'met' if lost == 0 else 'missed'} ({_cell(lost)} lost)")
    v = m["slo_violation_share"]
    sv = st["slo_violation_share"] if st else None
    if v is None:
        verdict = "missed (no requests)"
    elif v > 0.01:
        verdict = "missed"
    elif sv is None or v < sv:
        verdict = "met"
    elif v == sv == 0:
        verdict = "met for <= 1 %; static had none either, so 'below static' cannot show"
    else:
        verdict = "missed (not below static)"
    lines.append(f"inference SLO violations <= 1 % and below static: {verdict} "
                 f"(managed {_cell(v)}, static {_cell(sv)})")
    if st is not None:
        ok = m["training_steps_per_s"] >= st["training_steps_per_s"]
        lines.append(f"training throughput no lower than static: {'met' if ok else 'missed'} "
                     f"(managed {m['training_steps_per_s']:.1f}, static {st['training_steps_per_s']:.1f} steps/s)")
    return lines


def cpu_groups(cpu_s: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per third of the run, the CPU seconds of the replicas (``inference``) and of each training job.

    >>> cpu_groups({"after": {"infer-1": 1.0, "infer-2": 0.5, "train-a": 0.25}})
    {'after': {'inference': 1.5, 'train-a': 0.25}}
    """
    out: dict[str, dict[str, float]] = {}
    for phase, by in cpu_s.items():
        g: dict[str, float] = {}
        for c, v in by.items():
            k = "inference" if c.startswith("infer-") else c
            g[k] = round(g.get(k, 0.0) + v, 3)
        out[phase] = g
    return out


def cpu_table(results: dict) -> list[str]:
    rows = ["| scenario | third | inference | train-a | train-b | urgent | inference share |", "|---" * 7 + "|"]
    for name, r in results.items():
        for phase, g in cpu_groups(r["detail"].get("cpu_s", {})).items():
            tot = sum(g.values())
            share = f"{g.get('inference', 0.0) / tot:.0%}" if tot else "n/a"
            rows.append(f"| {name} | {phase} | " + " | ".join(f"{g.get(k, 0.0):.2f}" for k in (
                "inference", "train-a", "train-b", "urgent")) + f" | {share} |")
    return rows


def write_report(folder: Path, out: dict, results: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({**out, "detail": {s: r["detail"] for s, r in results.items()}},
                                                    indent=1))
    keys = list(next(iter(out["scenarios"].values())).keys())
    rows = ["| scenario | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for s, r in out["scenarios"].items():
        rows.append(f"| {s} | " + " | ".join(_cell(r[k]) for k in keys) + " |")
    o = out["options"]
    text = ["# phasewise experiment priorities", "",
            f"{o['duration_s']:g} s per scenario; load {o['rate_low']:g} -> {o['rate_high']:g} requests/s at half "
            f"time; SLO {o['slo_ms']:g} ms; {o['capacity_cores']:g} cores offered; host: {out['host']['cpus']} CPUs, "
            f"load average {out['host']['load1_at_end']} at the end.", "", *rows, "", "## Targets", "",
            *[f"- {x}" for x in verdicts(out)], "", "## Events (managed)", ""]
    for e in results.get("managed", {}).get("detail", {}).get("events", []):
        text.append(f"- {e['t']:.1f} s {e['kind']} {e.get('job', '')} {e.get('reason', '')}".rstrip())
    text += ["", "## CPU seconds by third of the run", "",
             "Per scenario, what the inference replicas and the training jobs got (`cpuacct.usage`, read every "
             "second): steady (before `urgent`), urgent (while it runs), after (it left).", "",
             *cpu_table(results), "",
             "Plots: `latency.png` (each request's client-side latency over time), `metrics.png`."]
    (folder / "summary.md").write_text("\n".join(text) + "\n")
    _plots(folder, out, results)


def _plots(folder: Path, out: dict, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = out["options"]["slo_ms"]
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3.2 * len(results)), sharex=True, squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], results.items()):
        tl = r["detail"]["timeline"]
        ok = [(t, y) for t, y in tl if y is not None]
        bad = [t for t, y in tl if y is None]
        ax.scatter([t for t, _ in ok], [y for _, y in ok], s=4, label="answered")
        if bad:
            ax.scatter(bad, [slo * 1.5] * len(bad), s=8, marker="x", color="red", label="failed / shed")
        ax.axhline(slo, color="k", ls="--", lw=1, label=f"SLO {slo:g} ms")
        for e in r["detail"]["events"]:
            if e["kind"] in ("freeze", "thaw", "checkpoint_stop", "restart", "scale", "arrive", "finish"):
                ax.axvline(e["t"], color="grey", lw=0.6)
                ax.text(e["t"], ax.get_ylim()[1] * 0.9, f"{e['kind']} {e.get('job', e.get('to', ''))}",
                        rotation=90, fontsize=6, va="top")
        ax.set_yscale("log")
        ax.set_ylabel("latency, ms")
        ax.set_title(f"{name}: violations {r['slo_violation_share'] or 0:.1%}, p99 {r['p99_ms'] or 0:.0f} ms, "
                     f"replicas max {r['replicas_max']}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(folder / "latency.png", dpi=110)
    plt.close(fig)

    keys = ["slo_violation_share", "p99_ms", "training_steps_per_s", "replicas_max"]
    fig, axes = plt.subplots(1, len(keys), figsize=(12, 3))
    for ax, k in zip(axes, keys):
        names = list(out["scenarios"])
        colours = {"static": "#999", "managed": "#3a7", "unweighted": "#d94"}
        ax.bar(names, [out["scenarios"][n][k] or 0 for n in names], color=[colours.get(n, "#555") for n in names])
        ax.set_title(k, fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / "metrics.png", dpi=110)
    plt.close(fig)
