"""The simulation report: ``allocation.png``, ``fragmentation.png`` and ``summary.md`` (matplotlib's Agg
backend).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from phasewise.apps.simulate.engine import PolicyResult

__all__ = ["write_report"]


def _plot(path: Path, results: list[PolicyResult], key: str, ylabel: str, xlabel: str, scale: float,
          title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn: list[tuple[str, list, list[float]]] = []
    for r in results:
        t, y = list(r.series["t"]), [v * scale for v in r.series[key]]
        # a policy that placed exactly like an earlier one would hide under its line: say so, dash it on top
        same = next((name for name, t0, y0 in drawn if t0 == t and y0 == y), None)
        ax.plot(t, y, label=r.policy if same is None else f"{r.policy} (same as {same}: dashed on top of it)",
                lw=1.2, ls="-" if same is None else (0, (4, 3)), zorder=2 + len(drawn))
        drawn.append((r.policy, t, y))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interference_lines(results: list[PolicyResult], about: dict, mode: str) -> list[str]:
    """The measured-slowdown table beside Horus's utilisation-sum proxy (when the pods carry utilisations)."""
    util = results[0].overloaded_gpus is not None
    pct = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
    when = "after the last arrival" if mode == "fill" else "time-weighted over the arrivals' span"
    lines = [
        "## Interference: measured slowdown" + (" and the utilisation-sum proxy" if util else ""), "",
        f"Every GPU pod carries a workload drawn uniformly among Gavel's {about['workloads']} single-GPU "
        f"workloads measured on {about['gpu']} (multi-GPU pods: among those on as many GPUs; seed {about['seed']}); "
        "a pod's slowdown on a shared GPU is 1 - its measured co-located throughput / its isolated throughput, "
        f"the product over its neighbours' pairs when a GPU holds three or more pods ({when}).", "",
        "| policy | " + ("overloaded GPUs (proxy) | utilisation above 100 % (GPUs) | " if util else "")
        + "shared GPUs | co-located pods | of them on 3+ | mean slowdown | p95 slowdown | worst-pair mean "
        f"| slowed > {about['slowed_above']:.0%} | lost (GPUs) | combined throughput per shared GPU |",
        "|---|" + ("---:|---:|" if util else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r.interference or {}
        proxy = f" {r.overloaded_gpus:.1f} | {r.excess_util_gpus:.1f} |" if util else ""
        comb = "n/a" if m.get("combined_tput_mean") is None else f"{m['combined_tput_mean']:.2f}"
        lines.append(f"| {r.policy} |{proxy} {m['shared_gpus']:.1f} | {m['colocated_jobs']:.1f} | "
                     f"{m['extrapolated_jobs']:.1f} | {pct(m['slowdown_mean'])} | {pct(m['slowdown_p95'])} | "
                     f"{pct(m['slowdown_mean_worst_pair'])} | {m['slowed_jobs']:.1f} ({pct(m['slowed_share'])}) | "
                     f"{m['lost_gpus']:.1f} | {comb} |")
    lines += ["", "Lost = the co-located pods' slowdowns summed, in isolated GPUs' worth of throughput; combined "
              "throughput = the normalised throughputs of a shared GPU's pods summed (above 1: sharing did more "
              "than one pod alone). Worst-pair mean: each pod's slowest single pair, a lower bound on its "
              "slowdown." + ("" if util else " Add `--util-cdf` for Horus's utilisation-sum proxy beside these."),
              ""]
    return lines


def write_report(folder: str | Path, results: list[PolicyResult], *, args: argparse.Namespace, pods, nodes,
                 wall_s: float, interference: dict | None = None) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    xlabel = "pods arrived" if args.mode == "fill" else "trace time (s)"
    gpus = sum(len(n.gpus) for n in nodes)
    what = f"{len(pods)} pods on {len(nodes)} nodes ({gpus} GPUs), mode {args.mode}"
    _plot(out / "allocation.png", results, "alloc", "GPU allocated (%)", xlabel, 100.0,
          f"GPU allocation by placement policy: {what}")
    _plot(out / "fragmentation.png", results, "frag", "fragmented GPUs (FGD measure)", xlabel, 1.0,
          f"GPU fragmentation by placement policy: {what}")
    util = results and results[0].overloaded_gpus is not None
    lines = [
        "# Placement simulation", "",
        f"{len(pods)} pods from `{args.pods}` on {len(nodes)} nodes ({gpus} GPUs) from `{args.nodes}`, "
        f"mode `{args.mode}`" + (f", arrivals sped up {args.speed_up:g}x" if args.speed_up != 1 else "") + ".", "",
        "| policy | GPU allocated | fragmented GPUs | unplaced pods | unplaced GPUs | mean queue delay (s) "
        + ("| overloaded GPUs | utilisation above 100 % (GPUs) " if util else "") + "| wall (s) |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if util else "") + "---:|",
    ]
    for r in results:
        over = f" {r.overloaded_gpus:.1f} | {r.excess_util_gpus:.1f} |" if util else ""
        lines.append(f"| {r.policy} | {r.gpu_alloc_ratio:.2%} | {r.fragmented_gpus:.1f} | {r.unplaced_pods} | "
                     f"{r.unplaced_gpu_milli / 1000:.1f} | {r.mean_queue_delay_s:.1f} |{over} {r.wall_s:.1f} |")
    fewest = min(r.unplaced_pods for r in results)
    best = ", ".join(f"**{r.policy}**" for r in results if r.unplaced_pods == fewest)
    w = args.horus_frag_weight
    horus = ("horus ranks nodes by its fragmentation weight x FGD's fragmentation growth + Horus's over-capacity "
             "term (co-located utilisation above 100 %), then by Horus's whole cost; a CPU-only pod by "
             f"fragmentation growth alone (weight {w:g})" if w > 0 else "horus ranks nodes by Horus's cost alone "
             "(fragmentation weight 0)")
    source = (f"GPU pods carry a utilisation drawn from `{args.util_cdf}` (seed {args.util_seed}); an overloaded "
              "GPU is one whose co-located pods' utilisations add up to more than 100 %." if util else
              "openb has no utilisation or GPU memory: the Horus cost uses each pod's requested GPU share as both "
              "its utilisation (gpu_milli / 10 %) and its memory share (gpu_milli / 1000), so its over-capacity "
              "term is never positive.")
    lines += [
        "", f"Fewest unplaced pods ({fewest}): {best}.", "",
        "![GPU allocation](allocation.png)", "", "![fragmentation](fragmentation.png)", "",
        "Measures (see docs/placement.md): GPU allocated = allocated / total GPU milli "
        + ("after the last arrival" if args.mode == "fill" else "time-weighted over the arrivals' span")
        + "; fragmented GPUs = FGD's fragmentation against the pod list's GPU pods; unplaced = never placed; "
        "queue delay = placement time - creation time over placed pods.", "",
        horus + ". " + source, "",
        *(_interference_lines(results, interference, args.mode) if interference and results else []),
        f"Total wall time {wall_s:.1f} s.", "",
        "Command: `phasewise simulate " + " ".join(shlex.quote(a) for a in sys.argv[2:]) + "`", "",
    ]
    (out / "summary.md").write_text("\n".join(lines))


def write_inflation_report(folder: str | Path, results: list[dict], *, args: argparse.Namespace, pods, nodes,
                           seeds: list[int]) -> None:
    """``unallocated.png`` (FGD's figure: unallocated GPU share against arrived workload, mean over seeds)
    and ``summary.md`` for ``--mode inflation``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    gpus = sum(len(n.gpus) for n in nodes)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot(r["curve"]["arrived_pct"], r["curve"]["unallocated_gpu_pct"], label=r["policy"], lw=1.2)
    ax.plot([0, 100], [100, 0], ls=":", color="grey", label="ideal")
    ax.set_xlim(70, args.inflation_ratio * 100)
    ax.set_ylim(0, 30)
    ax.set_xlabel("arrived workload (% of cluster GPU capacity)")
    ax.set_ylabel("unallocated GPU (%)")
    ax.set_title(f"FGD's experiment: {len(pods)} pods inflated to {args.inflation_ratio:g}x on {gpus} GPUs, "
                 f"mean of {len(seeds)} seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "unallocated.png", dpi=110)
    plt.close(fig)
    lines = [
        "# Placement simulation: FGD's inflation experiment", "",
        f"{len(pods)} pods from `{args.pods}` on {len(nodes)} nodes ({gpus} GPUs) from `{args.nodes}`, inflated to "
        f"{args.inflation_ratio:g} x the GPU capacity and shuffled, seeds {', '.join(map(str, seeds))}.", "",
        "| policy | unallocated GPU at 100 % arrived | at the end | failed pods by 100 % | failed pods "
        "| GPU allocated |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        u, e = r["unallocated_gpu_pct_at_100"], r["unallocated_gpu_pct_at_end"]
        lines.append(f"| {r['policy']} | {u['mean']:.2f} % ± {u['sd']:.2f} | {e['mean']:.2f} % ± {e['sd']:.2f} | "
                     f"{r['failed_pods_at_100']['mean']:.0f} | {r['failed_pods']['mean']:.0f} | "
                     f"{r['alloc_ratio']['milli_gpu']['mean']:.2%} |")
    lines += ["", "![unallocated GPU](unallocated.png)", "",
              "Mean ± sd over seeds. See docs/placement.md, \"FGD's experiment\".", "",
              "Command: `phasewise simulate " + " ".join(shlex.quote(a) for a in sys.argv[2:]) + "`", ""]
    (out / "summary.md").write_text("\n".join(lines))
