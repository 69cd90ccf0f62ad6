"""Replay report: PNG plots per container and a Markdown summary.

:func:`write_report` writes into a folder:

- ``container-<n>.png`` for the first few containers (``--plot-containers``):
  one panel per resource with the measured usage, the limits each policy set
  (the window family shown by its reported member for that resource) and, when
  the phase policy ran, the phase it was in coloured along time;
- ``scores.png``: allocation over usage and fulfilment per policy and resource;
- ``summary.md``: the table, the savings at matched fulfilment, the data's
  provenance and units, the fairness rules and the exact command.

Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from phasewise.replay import ORACLE, ORACLE_NOTE, ReplayResult, format_table, sample_path

__all__ = ["write_report"]

_COLORS = {"vpa": "tab:blue", "window": "tab:orange", "phase": "tab:green", ORACLE: "tab:gray"}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:60]


def _members_by_resource(rows: list[dict]) -> dict[str, dict[str, str]]:
    """resource -> family -> the member plotted for it."""
    out: dict[str, dict[str, str]] = {}
    for r in rows:
        out.setdefault(r["resource"], {})[r["policy"]] = r.get("member", r["policy"])
    return out


def _phase_spans(t: np.ndarray, ids: np.ndarray) -> list[tuple[float, float, int]]:
    """Contiguous (start, end, phase) runs; a run ends where the next begins."""
    spans = []
    i = 0
    n = len(ids)
    while i < n:
        j = i
        while j + 1 < n and ids[j + 1] == ids[i]:
            j += 1
        end = t[j + 1] if j + 1 < n else t[j] + (t[j] - t[j - 1] if j > 0 else 1.0)
        if ids[i] >= 0:
            spans.append((float(t[i]), float(end), int(ids[i])))
        i = j + 1
    return spans


def _plot_container(c, members: dict[str, dict[str, str]], families: list[str], path: Path,
                    units: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = list(c.usage)
    fig, axes = plt.subplots(len(res), 1, figsize=(11, 2.8 * len(res)), sharex=True, squeeze=False)
    t = (c.t - c.t[0])
    phase_cmap = plt.get_cmap("tab20")
    seen_phases: set[int] = set()
    for ax, r in zip(axes[:, 0], res):
        if c.phases is not None:
            for a, b, ph in _phase_spans(t, c.phases):
                ax.axvspan(a, b, color=phase_cmap(ph % 20), alpha=0.18, lw=0)
                seen_phases.add(ph)
        u = c.usage[r]
        ok = ~np.isnan(u)
        ax.step(t[ok], u[ok], where="post", color="black", lw=1.2, label="usage")
        for fam in families:
            if fam == ORACLE:
                continue  # L_t = U_t: the usage line itself
            name = members.get(r, {}).get(fam, fam)
            lim = c.limits.get(name, {}).get(r)
            if lim is None:
                continue
            label = fam if name == fam else f"{fam} ({name})"
            ax.step(t, lim, where="post", color=_COLORS.get(fam), lw=1.0, label=label)
        ax.set_ylabel(f"{r}\n[{units.get(r, '')}]", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=4)  # per panel: members differ by resource
    title = f"container {c.container}"
    if c.phases is None:
        title += "  (phase policy not in this run: no phases shown)"
    elif seen_phases:
        title += f"  (background: phase ids {sorted(seen_phases)})"
    else:
        title += "  (phase policy reported no phase id)"
    axes[0, 0].set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("time since first sample [trace time units]")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_scores(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    resources = list(dict.fromkeys(r["resource"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
    w = 0.8 / max(len(policies), 1)
    x = np.arange(len(resources))
    for i, p in enumerate(policies):
        vals = {r["resource"]: r for r in rows if r["policy"] == p}
        a1.bar(x + i * w, [vals[r]["alloc_over_used"] or 0 for r in resources], w, label=p,
               color=_COLORS.get(p))
        a2.bar(x + i * w, [(vals[r]["fulfilment"] or 0) * 100 for r in resources], w, label=p,
               color=_COLORS.get(p))
    for a, yl in ((a1, "allocated / used"), (a2, "fulfilment [% of steps]")):
        a.set_xticks(x + w * (len(policies) - 1) / 2, resources)
        a.set_ylabel(yl)
        a.grid(axis="y", alpha=0.3)
    a1.axhline(1.0, color="black", lw=0.8)
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _provenance(result: ReplayResult) -> list[str]:
    tr = result.trace
    src = Path(tr.source)
    lines = [(f"- Trace: `{tr.source}` (format `{tr.format}`), {len(tr.containers)} containers, "
              f"{tr.n_samples()} samples.")]
    if src.resolve() == sample_path().resolve():
        lines.append("- Source: the AI4DL authors' IBM DLaaS sample, https://github.com/BSC-IBM/AI4DL "
                     "commit 620d78dc0dafca1fa0bd77e2a138149de54076c9, `examples/1 - detecting phases/sample.csv`, "
                     "Apache-2.0, copied byte for byte (see `phasewise/data/PROVENANCE.md`).")
    folder = src if src.is_dir() else src.parent
    for name in ("PROVENANCE.txt", "PROVENANCE.md"):
        p = folder / name
        if p.is_file() and src.resolve() != sample_path().resolve():
            head = [ln.strip() for ln in p.read_text(encoding="utf-8", errors="replace").splitlines()
                    if ln.strip()][:3]
            lines.append(f"- Provenance ({p.name} next to the data): " + " / ".join(head))
    if tr.format == "genai2026":
        lines.append("- Alibaba GenAI 2026 pod trace (diffusion-model inference serving): no licence stated "
                     "upstream; read from a local copy, not shipped with phasewise. Values are scaled by the "
                     "publisher; timestamps are anonymised units.")
    lines.append("- Units: " + "; ".join(f"`{r}` = {u}" for r, u in tr.units.items()) + ".")
    for n in tr.notes:
        lines.append(f"- Loading note: {n}.")
    return lines


def _phase_statement(result: ReplayResult) -> str:
    if "phase" not in result.families:
        return ("The phase policy was not part of this run (not requested or not available yet); "
                "no phase plot colouring and no savings are reported.")
    info = result.phase_info
    starts: dict[str, int] = info.get("warm_start", {})
    if not starts:
        return (f"The phase model ({info.get('class', 'PhasePolicy')}) reported nothing about how it started; "
                "treat it as cold unless its documentation says otherwise.")
    parts = "; ".join(f"{n} container(s): {s}" for s, n in starts.items())
    text = f"How the phase model ({info.get('class')}) started, per container: {parts}."
    warm = [s for s in starts if s.startswith(("pretrained", "model given"))]
    if warm:
        text += (" A warm start uses the checkpoint shipped with phasewise, trained only on the Apache-2.0 "
                 "AI4DL sample (`phasewise/data/ai4dl_sample.csv`)")
        if result.trace.format == "ai4dl" and Path(result.trace.source).resolve() == sample_path().resolve():
            text += ("; that is the replayed trace, so the phase model saw this data before the replay: "
                     "read its numbers on this trace as in-sample")
        text += "."
    else:
        text += " No container started from a pretrained checkpoint: the model learned online from the replayed stream only."
    if "harness_unit_scales" in info:
        text += (f" Memory was shown to it (and to VPA) as bytes of a nominal pod: usage x "
                 f"{info['harness_unit_scales']}.")
    return text


def write_report(result: ReplayResult, rows: list[dict], savings: list[dict], out_dir: Path,
                 command: str) -> list[Path]:
    """Write the plots and ``summary.md`` into *out_dir*; return the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    members = _members_by_resource(rows)
    fams = result.families
    plots = []
    for i, c in enumerate(result.plotted):
        p = out_dir / f"container-{i + 1}-{_safe(c.container)}.png"
        _plot_container(c, members, fams, p, result.trace.units)
        written.append(p)
        plots.append((c.container, p.name))
    sp = out_dir / "scores.png"
    _plot_scores(rows, sp)
    written.append(sp)

    md: list[str] = ["# phasewise replay report", "", "Command:", "", "```", command, "```", ""]
    md += ["## Data", "", *_provenance(result), ""]
    md += ["## Scores", "", ("Per resource, summed over containers: `alloc_over_used` = sum(L dt) / sum(U dt); "
                             "`fulfilment` = share of steps with U <= L. Every policy managing a resource is "
                             "scored on the same steps."), ""]
    md += ["| resource | policy | alloc / used | fulfilment | steps | detail |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        detail = r.get("member", "")
        if r["policy"] == ORACLE:
            detail = "oracle: harness special case, sees U_t"
        a = "-" if r["alloc_over_used"] is None else f"{r['alloc_over_used']:.3f}"
        f = "-" if r["fulfilment"] is None else f"{r['fulfilment']:.1%}"
        md.append(f"| {r['resource']} | {r['policy']} | {a} | {f} | {r['steps']} | {detail} |")
    md.append("")
    if "window" in fams:
        md += [("Window family members (the table shows the member picked per resource: lowest alloc/used "
                "among members reaching the phase policy's fulfilment — vpa's without phase, 95 % without "
                "either — else the highest fulfilment):"), ""]
        md += ["| resource | member | alloc / used | fulfilment |", "|---|---|---:|---:|"]
        for r in rows:
            if r["policy"] != "window":
                continue
            for name, s in r["members"].items():
                a = "-" if s["alloc_over_used"] is None else f"{s['alloc_over_used']:.3f}"
                f = "-" if s["fulfilment"] is None else f"{s['fulfilment']:.1%}"
                md.append(f"| {r['resource']} | {name} | {a} | {f} |")
        md.append("")
    md += ["## Savings at matched fulfilment", "",
           ("Best reactive baseline = vpa or any window member reaching at least the phase policy's fulfilment "
            "(lowest alloc/used among those), or the closest below, flagged. "
            "savings = 1 - phase alloc/used ÷ best reactive alloc/used."), ""]
    for s in savings:
        if s["savings_vs_best_reactive"] is None:
            md.append(f"- `{s['resource']}`: not computed ({s.get('reason', 'undefined')}).")
        else:
            flag = "" if s["matched_fulfilment"] else " **UNMATCHED: no reactive baseline reached the phase " \
                                                      "policy's fulfilment; closest below used.**"
            md.append(f"- `{s['resource']}`: {s['savings_vs_best_reactive']:.1%} vs `{s['best_reactive']}` "
                      f"(alloc/used {s['phase_alloc_over_used']:.3f} vs {s['best_reactive_alloc_over_used']:.3f}; "
                      f"fulfilment {s['phase_fulfilment']:.1%} vs {s['best_reactive_fulfilment']:.1%}).{flag}")
    md += ["", "Plain-text table:", "", "```", format_table(rows, savings), "```", ""]
    md += ["## Fairness", "",
           ("- No policy sees the future: at each sample time t every policy is asked for its limits before it "
            "is shown the usage measured at t (`LimitPolicy.limits` then `observe`), one fresh instance per "
            "container."),
           f"- The oracle is the exception and is labelled so: {ORACLE_NOTE}.",
           ("- Warm-up: a (container, resource) is scored from the first step at which every policy managing "
            "that resource has a limit; the same steps are scored for all of them. A policy that never sets "
            "a limit for a resource (VPA has no GPU model) is not scored on it. After its first limit, a "
            "policy's `None` keeps its previous limit (as in the live pipeline). Steps not scored for warm-up: "
            + ", ".join(f"{s['resource']} {s['warmup_steps_not_scored']}" for s in savings) + "."),
           ("- dt is the time to the container's next sample of that resource; the last sample gets the median "
            "step; a gap longer than 5 median steps counts as one median step (no allocation or usage is "
            "charged across time without data). A resource is scored only at steps where it has a value."),
           f"- {_phase_statement(result)}", ""]
    md += ["## Plots", "", "- `scores.png`: alloc/used and fulfilment per policy and resource."]
    for cid, name in plots:
        md.append(f"- `{name}`: container `{cid}`: usage (black), limits per policy"
                  + ("; background colour = phase id" if "phase" in fams else "; no phases (phase policy not in this run)")
                  + ".")
    md += ["", f"Replay time (in-process): {result.elapsed_s:.2f} s.", ""]
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(md), encoding="utf-8")
    written.append(summary)
    return written
