"""The targets experiment's report: PNG plots and ``summary.md`` in a folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_targets_report(folder: Path, out: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    scenarios = list(results)
    jobs = out["setup"]["jobs"]
    colours = {j: plt.cm.tab10(i) for i, j in enumerate(jobs)}

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4), sharey=False, squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        for j, r in results[sc].items():
            if r.series:
                t, _, _, s = zip(*r.series)
                first = r.series[0][3]
                ax.plot(t, [v / first for v in s], color=colours[j], label=j)
            o = out["jobs"][sc][j]["objective"] / (r.series[0][3] if r.series else 1)
            ax.axhline(o, color=colours[j], lw=0.6, ls=":")
            if r.t_objective is not None:
                ax.axvline(r.t_objective, color=colours[j], lw=0.6, ls="--")
        ax.set_title(f"{sc}: smoothed loss / first (dotted: objective)")
        ax.set_xlabel("seconds since start")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = folder / "loss.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    written.append(p)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(scenarios)
    for k, sc in enumerate(scenarios):
        vals = [out["jobs"][sc][j]["time_to_objective_s"] or 0 for j in jobs]
        ax.bar([i + k * width for i in range(len(jobs))], vals, width, label=sc)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(jobs))], jobs)
    ax.set_ylabel("time to objective, s (0 = missed)")
    ax.legend()
    fig.tight_layout()
    p = folder / "time_to_objective.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    written.append(p)

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 3), squeeze=False)
    cap = out["setup"]["capacity_cores"]
    for ax, sc in zip(axes[0], scenarios):
        for j, r in results[sc].items():
            pts = r.limits + [(r.t_end or 0.0, r.limit)]
            ax.step([t for t, _ in pts], [cap if v is None else v for _, v in pts], where="post",
                    color=colours[j], label=j)
        ax.set_title(f"{sc}: CPU limit, cores (node {cap:g})")
        ax.set_xlabel("seconds since start")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = folder / "limits.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    written.append(p)

    lines = [f"# Targets experiment ({' / '.join(scenarios)})", "",
             f"Setup: `{json.dumps(out['setup'])}`", ""]
    o = out.get("oracle")
    if o and o["oracle_reduction"] is not None:
        lines += [f"Oracle (shortest remaining work first on the work to objective measured in {o['from']}, "
                  f"{o['work_to_objective_cpu_s']} CPU-s): mean time to objective {o['srpt_mean_time_to_objective_s']} "
                  f"s, **{o['oracle_reduction']:.1%}** below NA: no policy that divides the node and stops jobs at "
                  f"their objective does better on this mix. With NA running every job past the last objective the "
                  f"bound would be {o['bound_if_budgets_unbounded']:.1%} ({o['bound_equal_jobs']:.1%} for equal "
                  "jobs).", ""]
    lines += ["| scenario | mean time to objective, s | reduction vs NA | missed objectives | CPU s |",
              "|---|---|---|---|---|"]
    for sc in scenarios:
        red = out["reduction_vs_NA"].get(sc)
        lines.append(f"| {sc} | {out['mean_time_to_objective_s'][sc]} | {'' if red is None else f'{red:.1%}'} | "
                     f"{', '.join(out['missed_objectives'][sc]) or 'none'} | {out['cpu_s_total'][sc]} |")
    lines += ["", "| scenario | job | to acceptable, s | to objective, s | end, s | CPU s | steps | stopped by |",
              "|---|---|---|---|---|---|---|---|"]
    for sc in scenarios:
        for j in jobs:
            r = out["jobs"][sc][j]
            lines.append(f"| {sc} | {j} | {r['time_to_acceptable_s']} | {r['time_to_objective_s']} | {r['end_s']} | "
                         f"{r['cpu_s']} | {r['steps']}/{r['steps_budget']} | {r['stopped_by']} |")
    lines += ["", "![loss](loss.png)", "", "![time to objective](time_to_objective.png)", "",
              "![limits](limits.png)", ""]
    p = folder / "summary.md"
    p.write_text("\n".join(lines))
    written.append(p)
    (folder / "result.json").write_text(json.dumps(out, indent=1))
    return written
