"""Replay report (``--report DIR``): ``tradeoff.png``, a plot per container and ``summary.md``, drawn with
matplotlib's Agg backend (no display needed). What each shows: docs/results.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from phasewise.apps.replay.policies import ORACLE, ORACLE_NOTE
from phasewise.apps.replay.results import ReplayResult, format_table, mix_text
from phasewise.apps.replay.traces import sample_path
from phasewise.models.scoring.frontier import frontier

__all__ = ["write_report"]

#: line colours; the phase bands use none of these hues
_COLORS = {"usage": "black", "vpa": "tab:blue", "window": "tab:orange", "phase": "tab:green", ORACLE: "dimgray"}
#: pale background colours for phase ids (no blue, orange or green), cycled with hatches
_BANDS = ["#f7e479", "#d5c1f0", "#f6b8cf", "#cfcfcf", "#e3c59b", "#f29a9a", "#bfe6ef", "#dcdca0"]
_HATCHES = ["", "//", "..", "xx"]
TARGET = 0.97  #: the fulfilment target line drawn on the trade-off plot


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


def short_member(name: str) -> str:
    """A window member's name as plotted.

    >>> short_member("window-p95x1.15-10"), short_member("window-max-5"), short_member("vpa")
    ('p95×1.15 W=10', 'max W=5', 'vpa')
    """
    m = re.fullmatch(r"window-(.+)-(\d+)", name)
    if not m:
        return name
    stat = re.sub(r"(\d)x(\d)", "\\1×\\2", m.group(1))
    return f"{stat} W={m.group(2)}"


def group_label(names: list[str]) -> str:
    """Members at one point, in one label.

    >>> group_label(["window-p95x1.15-60", "window-p95x1.15-30", "window-p95x1.15-10"])
    'p95×1.15 W=10/30/60'
    >>> group_label(["vpa", "window-max-5"])
    'vpa = max W=5'
    """
    parsed = [re.fullmatch(r"window-(.+)-(\d+)", n) for n in names]
    if len(names) > 1 and all(parsed) and len({m.group(1) for m in parsed}) == 1:
        ws = sorted(int(m.group(2)) for m in parsed)
        return short_member(names[0]).rsplit(" W=", 1)[0] + " W=" + "/".join(map(str, ws))
    return " = ".join(short_member(n) for n in names)


def trace_title(result: ReplayResult, setup: dict | None = None) -> str:
    """The trace as a title names it: the file or folder, and the split when one was replayed."""
    tr = result.trace
    src = Path(tr.source)
    name = "AI4DL sample (IBM DLaaS)" if src.resolve() == sample_path().resolve() else src.name
    split = (setup or {}).get("split", "all")
    return name + (f", {split} split" if split != "all" else "")


def phase_start_text(result: ReplayResult) -> str:
    """How the phase model started, in a few words (for titles)."""
    if "phase" not in result.families:
        return "phase policy not in this run"
    starts: dict[str, int] = result.phase_info.get("warm_start", {})
    if not starts:
        return "phase model: start not reported"
    if len(starts) == 1:
        return f"phase model started {next(iter(starts))}"
    return "phase model started " + ", ".join(f"{s} ({n})" for s, n in starts.items())


# ---------------------------------------------------------------- units


def _value_scale(unit: str, top: float) -> tuple[float, str]:
    """(divide values by, axis unit) for a resource's unit and its largest value.

    >>> _value_scale("bytes (working set)", 3 * 2**30), _value_scale("bytes", 300 * 2**20)
    ((1073741824.0, 'GiB (working set)'), (1048576.0, 'MiB'))
    >>> _value_scale("fraction of the pod's memory (utilisation, 0-1)", 0.5)
    (0.01, "% of the pod's memory")
    >>> _value_scale("percent of one GPU (duty cycle)", 50.0), _value_scale("cores", 2.0)
    ((1.0, '% of one GPU (duty cycle)'), (1.0, 'cores'))
    """
    if unit.startswith("bytes"):
        what = unit[len("bytes"):].strip()
        for div, name in ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1.0, "bytes")):
            if top >= 2 * div or div == 1.0:
                return div, name + (f" {what}" if what else "")
    if unit.startswith("fraction"):
        return 0.01, "% of the pod's memory"
    if unit.startswith("percent of"):
        return 1.0, "%" + unit[len("percent"):]
    return 1.0, unit


def _time_scale(span: float, time_unit: str) -> tuple[float, str]:
    """(divide times by, axis label) for a container's time span.

    >>> _time_scale(1100.0, "seconds")
    (1.0, "time since the container's first sample [s]")
    >>> _time_scale(82080.0, "anonymised seconds (one sample every 57: about a minute)")
    (3600.0, "time since the container's first sample [h; the trace's anonymised seconds / 3600]")
    """
    anon = time_unit.startswith("anonymised")
    if span > 2 * 3600:
        div, name = 3600.0, "h"
    else:
        div, name = 1.0, "s"
    if anon:
        name += "; the trace's anonymised seconds" + (" / 3600" if div > 1 else "")
    return div, f"time since the container's first sample [{name}]"


# ---------------------------------------------------------------- container plots


def _clip_top(usage: np.ndarray, limits: list[np.ndarray]) -> tuple[float, bool]:
    """Upper y limit and whether limit values are cut off by it (then marked).

    Everything is shown unless a few limit values reach far above the rest:
    then the axis ends above usage and the bulk of the limits.

    >>> _clip_top(np.ones(10), [np.full(100, 1.2)])               # all shown
    (1.296, False)
    >>> top, cut = _clip_top(np.ones(10), [np.append(np.full(99, 1.2), 9.0)])  # one spike: cut, marked
    >>> round(top, 3), cut
    (1.38, True)
    """
    u = usage[np.isfinite(usage)]
    vals = np.concatenate([v[np.isfinite(v)] for v in limits]) if limits else np.array([])
    top_u = float(u.max()) if len(u) else 0.0
    if not len(vals):
        return (top_u or 1.0) * 1.08, False
    bulk = max(top_u, float(np.quantile(vals, 0.98)))
    top_all = max(top_u, float(vals.max()))
    if bulk > 0 and top_all > 1.5 * bulk:
        return bulk * 1.15, True
    return (top_all or 1.0) * 1.08, False


def _bottom(usage: np.ndarray, limits: list[np.ndarray], top: float) -> float:
    """Lower y limit: 0, unless every value sits high above it (then just under the lowest).

    >>> _bottom(np.array([0.85, 0.9]), [np.array([0.95, 1.0])], 1.1)
    0.83
    >>> _bottom(np.array([0.1, 0.9]), [], 1.0)
    0.0
    """
    vals = np.concatenate([usage[np.isfinite(usage)], *[v[np.isfinite(v)] for v in limits]])
    if not len(vals):
        return 0.0
    low = float(vals.min())
    if low <= 0.4 * top:
        return 0.0
    return round(max(0.0, low - 0.08 * (top - low)), 12)


def _plot_container(result: ReplayResult, c, members: dict[str, dict[str, str]], path: Path,
                    setup: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    units = result.trace.units
    families = result.families
    res = list(c.usage)
    t_div, t_label = _time_scale(float(c.t[-1] - c.t[0]) if len(c.t) > 1 else 0.0, result.trace.time_unit)
    t = (c.t - c.t[0]) / t_div
    t_end = np.append(t[1:], t[-1] + (t[-1] - t[-2] if len(t) > 1 else 1.0 / t_div))
    fig, axes = plt.subplots(len(res), 1, figsize=(13, 3.1 * len(res) + 0.9), sharex=True, squeeze=False,
                             layout="constrained")
    phases_seen: list[int] = []
    fallback_share: dict[str, float] = {}
    for ax, r in zip(axes[:, 0], res):
        u = c.usage[r]
        ok = ~np.isnan(u)
        lims: dict[str, tuple[str, np.ndarray]] = {}
        for fam in families:
            if fam == ORACLE:
                continue  # L_t = U_t: the usage line itself
            name = members.get(r, {}).get(fam, fam)
            lim = c.limits.get(name, {}).get(r)
            if lim is not None and np.isfinite(lim).any():
                lims[fam] = (name, lim)
        top, clipped = _clip_top(u, [v for _, v in lims.values()])
        div, y_unit = _value_scale(units.get(r, ""), top)
        if c.phases is not None:
            spans: dict[int, list[tuple[float, float]]] = {}
            for a, b, ph in _phase_spans(t, c.phases):
                if ph not in phases_seen:
                    phases_seen.append(ph)
                spans.setdefault(ph, []).append((a, b - a))
            for ph, bars in spans.items():  # one collection per phase, the full height of the panel
                k = ph  # a phase keeps its colour in every panel and container
                ax.broken_barh(bars, (0, 1), transform=ax.get_xaxis_transform(), facecolor=_BANDS[k % len(_BANDS)],
                               alpha=0.55, lw=0, hatch=_HATCHES[(k // len(_BANDS)) % len(_HATCHES)],
                               edgecolor="white", zorder=0)
        handles: list[Any] = []
        # each line holds its last value to the end of its last step, like the fallback band
        h = ax.step(np.append(t[ok], t_end[ok][-1:]), np.append(u[ok], u[ok][-1:]) / div, where="post",
                    color=_COLORS["usage"], lw=1.3, zorder=5, label="usage (measured)")[0]
        handles.append(h)
        for fam, (name, lim) in lims.items():
            label = "vpa" if fam == "vpa" else (f"window ({short_member(name)})" if fam == "window" else fam)
            y = np.minimum(lim, top) / div
            fb = (c.fallback or {}).get(r) if fam == "phase" else None
            if fb is not None and fb.any():
                own = np.where(fb, np.nan, y)
                fallback_share[r] = float(fb[np.isfinite(lim)].mean()) if np.isfinite(lim).any() else 0.0
                # the fallback steps as a wide pale band: the vpa line it equals stays visible on top of it
                segs = [((t[i], y[i]), (t_end[i], y[i])) for i in np.flatnonzero(fb & np.isfinite(y))]
                from matplotlib.collections import LineCollection

                ax.add_collection(LineCollection(segs, colors=_COLORS["phase"], linewidths=7, alpha=0.3,
                                                 zorder=2, capstyle="butt"))
                handles.append(Line2D([], [], color=_COLORS["phase"], lw=7, alpha=0.3,
                                      label="phase policy on its fallback" + (" (= VPA)" if r in ("cpu", "mem")
                                                                              else " (reactive)")))
                h = ax.step(np.append(t, t_end[-1]), np.append(own, own[-1]), where="post", color=_COLORS["phase"],
                            lw=1.6, zorder=4, label="phase policy: its phase's limit")[0]
                if np.isfinite(own).any():
                    handles.append(h)
            else:
                lw = 1.6 if fam == "phase" else 1.1
                handles.append(ax.step(np.append(t, t_end[-1]), np.append(y, y[-1]), where="post",
                                       color=_COLORS.get(fam), lw=lw, zorder=3,
                                       label=label if fam != "phase" else "phase policy")[0])
            if clipped and np.nanmax(lim) > top:
                over = np.flatnonzero(np.isfinite(lim) & (lim > top))
                ax.plot(t[over], np.full(len(over), top / div), ls="none", marker="^", ms=6,
                        color=_COLORS.get(fam), clip_on=False, zorder=6)
        if clipped:
            hi = max(float(np.nanmax(v)) for _, v in lims.values())
            handles.append(Line2D([], [], ls="none", marker="^", color="gray",
                                  label=f"limit above the axis (up to {hi / div:.3g})"))
        ax.set_ylim(_bottom(u, [v for _, v in lims.values()], top) / div, top / div)
        ax.set_xlim(t[0], t_end[-1])
        ax.set_ylabel(f"{r}\n[{y_unit}]", fontsize=9)
        ax.grid(alpha=0.3, zorder=1)
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0,
                  frameon=False)
    if phases_seen:
        shown = sorted(phases_seen)
        keys = [Patch(facecolor=_BANDS[ph % len(_BANDS)], alpha=0.55,
                      hatch=_HATCHES[(ph // len(_BANDS)) % len(_HATCHES)], edgecolor="white", label=f"phase {ph}")
                for ph in shown[:16]]
        if len(shown) > 16:
            keys.append(Patch(facecolor="white", label=f"+{len(shown) - 16} more phases"))
        keys.append(Patch(facecolor="white", edgecolor="lightgray", label="no phase yet"))
        # the figure's own legend, so the layout makes room for it beside every panel's legend (a second
        # legend added to the last panel as an artist was left out of the layout: with one resource, the
        # panel's legend was cut at the right edge)
        fig.legend(handles=keys, loc="outside right lower", fontsize=8, frameon=False, title="background: phase",
                   title_fontsize=8, ncol=2 if len(keys) > 8 else 1)
    sub = []
    if "phase" not in families:
        sub.append("phase policy not in this run")
    elif c.phases is None:
        sub.append("phases not reported")
    elif not phases_seen:
        sub.append("the phase policy reported no phase (cold throughout)")
    if fallback_share:
        sub.append("phase policy on its fallback at " + ", ".join(
            f"{v:.0%} of {r} steps" for r, v in fallback_share.items()))
    title = f"{trace_title(result, setup)}: container {c.container}"
    fig.suptitle(title + ("\n" + "; ".join(sub) if sub else ""), fontsize=10)
    axes[-1, 0].set_xlabel(t_label)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------- trade-off plot


def _reactive_points(rows: list[dict], resource: str) -> dict[str, tuple[float, float]]:
    """member -> (alloc_over_used, fulfilment) of every scored reactive baseline on *resource*."""
    pts: dict[str, tuple[float, float]] = {}
    for r in rows:
        if r["resource"] != resource:
            continue
        if r["policy"] == "vpa" and r["steps"] > 0 and r["alloc_over_used"] is not None:
            pts["vpa"] = (r["alloc_over_used"], r["fulfilment"])
        elif r["policy"] == "window":
            for n, s in r["members"].items():
                if s["steps"] > 0 and s["alloc_over_used"] is not None:
                    pts[n] = (s["alloc_over_used"], s["fulfilment"])
    return pts


def _row(rows: list[dict], resource: str, policy: str) -> dict | None:
    return next((r for r in rows if r["resource"] == resource and r["policy"] == policy), None)


def _groups(pts: dict[str, tuple[float, float]], xr: float, yr: float) -> list[tuple[list[str], float, float]]:
    """Members drawn at (nearly) the same place, grouped: [(names, alloc, fulfilment)], by fulfilment.

    >>> _groups({"a": (1.0, 0.9), "b": (1.0001, 0.9), "c": (2.0, 0.95)}, 1.0, 0.1)
    [(['a', 'b'], 1.0, 0.9), (['c'], 2.0, 0.95)]
    """
    out: list[tuple[list[str], float, float]] = []
    for name, (a, f) in sorted(pts.items(), key=lambda x: (x[1][1], x[1][0], x[0])):
        for names, ga, gf in out:
            if abs(a - ga) <= 0.006 * xr and abs(f - gf) <= 0.006 * yr:
                names.append(name)
                break
        else:
            out.append(([name], a, f))
    return out


#: label offsets tried in turn (points), with their alignment
_OFFSETS = [((7, 0), "left", "center"), ((-7, 0), "right", "center"), ((0, 8), "center", "bottom"),
            ((0, -8), "center", "top"), ((7, 9), "left", "bottom"), ((7, -9), "left", "top"),
            ((-7, 9), "right", "bottom"), ((-7, -9), "right", "top"), ((10, 18), "left", "bottom"),
            ((10, -18), "left", "top")]


def _place_labels(fig, ax, labels: list[tuple[str, float, float, float]], markers: list) -> None:
    """Annotate each (text, x, y, marker radius in points) where it overlaps no label placed
    before, no marker (x, y, radius) nor region ``("axes", (x0, y0, x1, y1))`` and stays inside the axes
    (the first offset when none does)."""
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    px = fig.dpi / 72.0
    taken = []
    for m in markers:
        if m[0] == "axes":  # a region in axes fraction (an inset)
            x0, y0, x1, y1 = m[1]
            (ax0, ay0), (ax1, ay1) = ax.transAxes.transform([(x0, y0), (x1, y1)])
            taken.append(Bbox.from_extents(ax0, ay0, ax1, ay1))
            continue
        mx, my, rad = m
        cx, cy = ax.transData.transform((mx, my))
        taken.append(Bbox.from_extents(cx - rad * px, cy - rad * px, cx + rad * px, cy + rad * px))
    for text, x, y, rad in labels:
        best = None
        for (dx, dy), ha, va in _OFFSETS:
            k = max(1.0, (rad + 3.0) / 7.0)  # clear of the point's own marker
            ann = ax.annotate(text, (x, y), xytext=(dx * k, dy * k), textcoords="offset points", fontsize=7,
                              ha=ha, va=va, zorder=8, annotation_clip=False)
            bb = ann.get_window_extent(renderer).expanded(1.04, 1.1)
            ok = (not any(bb.overlaps(o) for o in taken) and inside.contains(bb.x0, bb.y0)
                  and inside.contains(bb.x1, bb.y1))
            if ok:
                best = (ann, bb)
                break
            ann.remove()
        if best is None:
            (dx, dy), ha, va = _OFFSETS[0]
            k = max(1.0, (rad + 3.0) / 7.0)
            ann = ax.annotate(text, (x, y), xytext=(dx * k, dy * k), textcoords="offset points", fontsize=7,
                              ha=ha, va=va, zorder=8, annotation_clip=False)
            best = (ann, ann.get_window_extent(renderer))
        taken.append(best[1])


def _draw(ax, pts: dict[str, tuple[float, float]], phase: tuple[float, float] | None,
          at: tuple[float, float] | None, lims: tuple[float, float, float, float]):
    """Draw one trade-off panel (or its zoomed inset) within *lims*; return (labels, markers, below)."""
    x_lo, x_hi, y_lo, y_hi = lims
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, y_hi)
    xr, yr = x_hi - x_lo, y_hi - y_lo
    verts = frontier(pts)
    if verts:  # the frontier, and right of it what reactive baselines (and mixes of two) reach
        ys = np.concatenate([[min(y_lo, verts[0].fulfilment)], [v.fulfilment for v in verts]])
        xs = np.concatenate([[verts[0].alloc], [v.alloc for v in verts]])
        ax.fill_betweenx(ys, xs, max(x_hi, xs.max()), color="#bbbbbb", alpha=0.25, lw=0, zorder=0)
        ax.plot(xs, ys, color="#555555", lw=1.6, zorder=2)
    ax.axhline(TARGET, color="tab:red", ls="--", lw=0.9, zorder=1)
    labels: list[tuple[str, float, float, float]] = []
    markers: list[tuple[float, float, float]] = []
    below: list[str] = []
    groups = _groups(pts, xr, yr)
    phase_with: list[str] = []

    def inside(a: float, f: float) -> bool:
        return x_lo <= a <= x_hi and y_lo <= f <= y_hi

    if phase is not None:
        pa, pf = phase
        # under the reactive markers: a member at the same point (its fallback) stays visible on it
        ax.plot([pa], [pf], ls="none", marker="*", ms=20, color=_COLORS["phase"], mec="black", mew=0.6, zorder=3)
        markers.append((pa, pf, 10.0))
        for names, a, f in groups:
            if abs(a - pa) <= 0.006 * xr and abs(f - pf) <= 0.006 * yr:
                phase_with = names
    for names, a, f in groups:
        fam = "vpa" if "vpa" in names else "window"
        if f < y_lo:
            if x_lo <= a <= x_hi:
                ax.plot([a], [y_lo], ls="none", marker="v", ms=7, color=_COLORS[fam], mec="black", mew=0.5,
                        zorder=4, clip_on=False)
            below += [f"{short_member(nm)} ({a:.3f}, {f:.1%})" for nm in names]
            continue
        ax.plot([a], [f], ls="none", marker="s" if fam == "vpa" else "o", ms=7, color=_COLORS[fam],
                mec="black", mew=0.5, zorder=4)
        if inside(a, f):
            markers.append((a, f, 4.0))
            if names is not phase_with:
                labels.append((group_label(names), a, f, 4.0))
    ax.plot([1.0], [1.0], ls="none", marker="D", ms=7, color=_COLORS[ORACLE], zorder=4)
    if inside(1.0, 1.0):
        markers.append((1.0, 1.0, 4.0))
        labels.append(("oracle", 1.0, 1.0, 4.0))
    if phase is not None:
        labels.insert(0, ("phase policy" + (f" = {group_label(phase_with)}" if phase_with else ""), pa, pf, 10.0))
        if at is not None:
            R, fR = at
            ax.plot([R], [fR], ls="none", marker="x", ms=11, mew=2, color="#333333", zorder=5)
            markers.append((R, fR, 5.0))
            if abs(R - pa) > 1e-9 or abs(fR - pf) > 1e-9:
                ax.annotate("", (R, fR), (pa, pf), zorder=5,
                            arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.9, "shrinkA": 8, "shrinkB": 5})
    ax.grid(alpha=0.3)
    return labels, markers, below


def _crowd(pts: dict[str, tuple[float, float]], phase: tuple[float, float] | None,
           at: tuple[float, float] | None, lims: tuple[float, float, float, float]
           ) -> tuple[float, float, float, float] | None:
    """Limits of a zoomed view around the phase policy when points crowd it, else None."""
    if phase is None:
        return None
    x_lo, x_hi, y_lo, y_hi = lims
    xr, yr = x_hi - x_lo, y_hi - y_lo
    pa, pf = phase
    near = [(a, f) for a, f in [*pts.values(), *([at] if at else [])]
            if abs(a - pa) <= 0.15 * xr and abs(f - pf) <= 0.06 * yr]
    if len(near) < 2 or all(abs(a - pa) <= 0.004 * xr and abs(f - pf) <= 0.004 * yr for a, f in near):
        return None  # nothing crowds it, or all of it sits on one point
    xs = [pa, *(a for a, _ in near)]
    ys = [pf, *(f for _, f in near)]
    dx = max(max(xs) - min(xs), 1e-3)
    dy = max(max(ys) - min(ys), 2e-4)
    return min(xs) - 0.25 * dx, max(xs) + 0.45 * dx, min(ys) - 0.3 * dy, max(ys) + 0.3 * dy


def _plot_tradeoff(result: ReplayResult, rows: list[dict], savings: list[dict], path: Path,
                   setup: dict | None) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import PercentFormatter

    resources = [r for r in result.resources if _reactive_points(rows, r) or
                 (_row(rows, r, "phase") or {}).get("steps")]
    if not resources:
        resources = list(result.resources)
    panels = []
    for r in resources:
        pts = _reactive_points(rows, r)
        row = _row(rows, r, "phase")
        srow = next((s for s in savings if s["resource"] == r), {})
        phase = ((row["alloc_over_used"], row["fulfilment"])
                 if row is not None and row["steps"] > 0 and row["alloc_over_used"] is not None else None)
        fs = [f for _, f in pts.values()] + ([phase[1]] if phase else [])
        at = None
        if srow.get("frontier_alloc_at_phase_fulfilment") is not None:
            at = (srow["frontier_alloc_at_phase_fulfilment"], srow["frontier_fulfilment"])
        lims = zoom = None
        if fs:
            ref = min(phase[1], TARGET) if phase else TARGET
            y_lo = min(max(min(fs), ref - 0.12), TARGET - 0.01)  # members far below sit on the bottom edge
            pad = max(0.004, 0.06 * (1.0 - y_lo))
            shown = [a for a, f in pts.values() if f >= y_lo - pad] + [1.0] + ([phase[0]] if phase else [])
            xpad = 0.08 * (max(shown) - min(shown) or 1.0)
            # room for the labels right of the points
            lims = (min(shown) - xpad, max(shown) + 2.5 * xpad, y_lo - pad, 1.0 + pad)
            zoom = _crowd(pts, phase, at, lims)
        panels.append((r, pts, srow, phase, at, lims, zoom))
    n = len(panels)
    zoomed = any(p[-1] is not None for p in panels)
    fig, axes = plt.subplots(2 if zoomed else 1, n, figsize=(6.6 * n, 10.2 if zoomed else 6.8), squeeze=False,
                             layout="constrained", dpi=90, gridspec_kw={"height_ratios": [1.8, 1]} if zoomed else None)
    pending = []
    for k, (r, pts, srow, phase, at, lims, zoom) in enumerate(panels):
        ax = axes[0, k]
        if zoomed:
            axes[1, k].set_axis_off()
        if lims is None:
            ax.text(0.5, 0.5, f"{r}: nothing scored", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        labels, markers, below = _draw(ax, pts, phase, at, lims)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=1 if (lims[3] - lims[2]) < 0.1 else 0))
        if zoom is not None:  # the crowd around the phase policy, magnified in the panel below
            z = axes[1, k]
            z.set_axis_on()
            z_labels, z_markers, _ = _draw(z, pts, phase, at, zoom)
            z.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=2))
            z.tick_params(labelsize=8)
            z.set_title(f"{r}: zoomed around the phase policy (the grey box above)", fontsize=9)
            z.set_xlabel("allocated / used", fontsize=8)
            z.set_ylabel("fulfilment", fontsize=8)
            ax.indicate_inset((zoom[0], zoom[2], zoom[1] - zoom[0], zoom[3] - zoom[2]), edgecolor="#777777",
                              alpha=0.9)
            labels = [lb for lb in labels if lb[0] == "oracle" or not (zoom[0] <= lb[1] <= zoom[1]
                                                                         and zoom[2] <= lb[2] <= zoom[3])]
            pending.append((z, z_labels, z_markers))
        title = [f"{r} [{result.trace.units.get(r, '')}], "
                 f"{max((x['steps'] for x in rows if x['resource'] == r), default=0):,} scored steps"]
        if phase and at:
            sc = srow.get("slack_cut_vs_frontier")
            mix = mix_text({short_member(k): v for k, v in srow["frontier_mix"].items()})
            title += textwrap.wrap(f"phase {phase[0]:.3f} at {phase[1]:.1%}; frontier {at[0]:.3f} at {at[1]:.1%} "
                                   f"({mix})", 88)
            if srow.get("phase_fulfilment_above_every_reactive"):
                title.append("(the phase policy's fulfilment is above every reactive one: compared at the highest)")
            title.append((f"slack cut vs frontier {sc:+.1%}" if sc is not None else "no slack to cut")
                         + f", allocation cut {srow['alloc_cut_vs_frontier']:+.1%}")
        xlabel = "allocated / used  (time-weighted; 1 = the oracle)"
        if below:
            xlabel += "\n" + "\n".join(textwrap.wrap("▼ below the axis: " + ", ".join(below), 62))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fulfilment  [% of steps with use ≤ limit]")
        ax.set_title("\n".join(title), fontsize=9)
        pending.append((ax, labels, markers))
    keys = [Line2D([], [], ls="none", marker="*", ms=14, color=_COLORS["phase"], mec="black", label="phase policy"),
            Line2D([], [], ls="none", marker="s", ms=7, color=_COLORS["vpa"], mec="black", label="vpa"),
            Line2D([], [], ls="none", marker="o", ms=7, color=_COLORS["window"], mec="black",
                   label="window members (max or p95×1.15 over W samples)"),
            Line2D([], [], ls="none", marker="D", ms=7, color=_COLORS[ORACLE],
                   label="oracle (sees the step it limits)"),
            Line2D([], [], color="#555555", lw=1.6, label="reactive frontier R(f)"),
            Line2D([], [], ls="none", marker="x", ms=11, mew=2, color="#333333",
                   label="frontier at the phase policy's fulfilment"),
            Patch(facecolor="#bbbbbb", alpha=0.25, label="reached by reactive baselines or a mix of two"),
            Line2D([], [], color="tab:red", ls="--", lw=0.9, label=f"{TARGET:.0%} fulfilment")]
    fig.legend(handles=keys, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    tr = result.trace
    fig.suptitle(f"{trace_title(result, setup)}: {len(tr.containers)} containers, {tr.n_samples():,} samples; "
                 f"{phase_start_text(result)}\nfulfilment against allocation: up and left is better",
                 fontsize=10)
    fig.canvas.draw()  # lay out first: labels are placed in display space
    for ax, labels, markers in pending:
        _place_labels(fig, ax, labels, markers)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------- summary


def _provenance(result: ReplayResult) -> list[str]:
    tr = result.trace
    src = Path(tr.source)
    lines = [(f"- Trace: `{tr.source}` (format `{tr.format}`), {len(tr.containers)} containers, "
              f"{tr.n_samples()} samples.")]
    if src.resolve() == sample_path().resolve():
        lines.append("- Source: the AI4DL authors' IBM DLaaS sample, https://github.com/BSC-IBM/AI4DL "
                     "commit 620d78dc0dafca1fa0bd77e2a138149de54076c9, `examples/1 - detecting phases/sample.csv`, "
                     "Apache-2.0, copied byte for byte (see `data/PROVENANCE.md`).")
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
    lines.append("- Units: " + "; ".join(f"`{r}` = {u}" for r, u in tr.units.items())
                 + f"; time = {tr.time_unit}.")
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
    ai4dl = [s for s in starts if s.startswith(("pretrained ai4dl", "model given"))]
    corpus = [s for s in starts if s.startswith("pretrained corpus")]
    if ai4dl:
        text += (" A warm start uses the checkpoint shipped with phasewise, trained only on the Apache-2.0 "
                 "AI4DL sample (`data/ai4dl_sample.csv`)")
        if result.trace.format == "ai4dl" and Path(result.trace.source).resolve() == sample_path().resolve():
            text += ("; that is the replayed trace, so the phase model saw this data before the replay: "
                     "read its numbers on this trace as in-sample")
        text += "."
    elif corpus:
        text += (" A warm start uses the checkpoint shipped with phasewise, trained only on the train split of "
                 "its corpus (`data/corpus/`, the executions whose split is train in its manifest)")
        if Path(result.trace.source).resolve().parent == (sample_path().parent / "corpus").resolve():
            text += ("; if the replayed execution is one of those, the phase model saw it before the replay: "
                     "read its numbers as in-sample")
        text += "."
    elif any(s.startswith("pretrained on the other") for s in starts):
        text += " Each container was scored by a model pretrained only on the other folds' containers."
    else:
        text += (" No container started from a pretrained checkpoint: the model learned online from the "
                 "replayed stream only.")
    if "harness_unit_scales" in info:
        text += (f" Memory was shown to it (and to VPA) as bytes of a nominal pod: usage x "
                 f"{info['harness_unit_scales']}.")
    return text


MEASURE = ("**Measure.** What an operator pays for beyond use is the *slack*, allocation − use. Per resource, "
           "`alloc/used` = Σ limit·Δt ÷ Σ use·Δt over all containers (1 = the oracle, which sees the step it "
           "limits) and `fulfilment` = the share of steps whose use was within the limit. The **reactive "
           "frontier** R(f) is the least alloc/used that any reactive baseline (vpa or a window member) or an "
           "alternation of two of them reaches at fulfilment ≥ f. At the phase policy's fulfilment, "
           "**slack cut** = 1 − (phase − 1) ÷ (R − 1): 100 % = no slack left, 0 % = as much slack as the "
           "frontier, negative = more; allocation cut = 1 − phase ÷ R.")


def verdict(s: dict) -> str:
    """One sentence: does the phase policy beat the reactive frontier on this resource?

    >>> verdict({"resource": "mem", "slack_cut_vs_frontier": 0.5, "alloc_cut_vs_frontier": 0.05,
    ...          "phase_alloc_over_used": 1.1, "phase_fulfilment": 0.98, "frontier_fulfilment": 0.98,
    ...          "frontier_alloc_at_phase_fulfilment": 1.2, "frontier_mix": {"vpa": 1.0},
    ...          "phase_fulfilment_above_every_reactive": False}).split(": ", 2)
    ['`mem`', 'the phase policy **beats** the reactive frontier', 'at 98.0% fulfilment it allocates 1.100× use, \
the frontier 1.200× (vpa): slack cut +50.0%, allocation cut +5.0%.']
    """
    r = s["resource"]
    if s.get("frontier_alloc_at_phase_fulfilment") is None:
        return f"`{r}`: not compared ({s.get('reason', 'undefined')})."
    sc = s.get("slack_cut_vs_frontier")
    cut = s["alloc_cut_vs_frontier"]
    if sc is None:
        word = "beats" if cut > 0.0005 else ("matches" if cut > -0.0005 else "does not beat")
    else:
        word = "beats" if sc > 0.005 else ("matches" if sc > -0.005 else "does not beat")
    pa, pf, R, fR = (s["phase_alloc_over_used"], s["phase_fulfilment"], s["frontier_alloc_at_phase_fulfilment"],
                     s["frontier_fulfilment"])
    at = (f"at {pf:.1%} fulfilment" if not s["phase_fulfilment_above_every_reactive"] else
          f"at {pf:.1%} fulfilment, above every reactive baseline's (compared at the highest, {fR:.1%})")
    sc_text = f"slack cut {sc:+.1%}" if sc is not None else "no slack to cut (R < 1.01)"
    return (f"`{r}`: the phase policy **{word}** the reactive frontier: {at} it allocates {pa:.3f}× use, "
            f"the frontier {R:.3f}× ({mix_text(s['frontier_mix'])}): {sc_text}, allocation cut {cut:+.1%}.")


def write_report(result: ReplayResult, rows: list[dict], savings: list[dict], out_dir: Path,
                 command: str, setup: dict | None = None) -> list[Path]:
    """Write the plots and ``summary.md`` into *out_dir*; return the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    tp = out_dir / "tradeoff.png"
    _plot_tradeoff(result, rows, savings, tp, setup)
    written.append(tp)
    members = _members_by_resource(rows)
    fams = result.families
    plots = []
    for i, c in enumerate(result.plotted):
        p = out_dir / f"container-{i + 1}-{_safe(c.container)}.png"
        _plot_container(result, c, members, p, setup)
        written.append(p)
        plots.append((c.container, p.name))

    md: list[str] = [f"# phasewise replay: {trace_title(result, setup)}", "", MEASURE, "",
                     "![fulfilment against allocation per resource](tradeoff.png)", ""]
    if "phase" in fams:
        md += [f"- {verdict(s)}" for s in savings]
    else:
        md.append("- The phase policy was not part of this run: the plot shows the reactive baselines only.")
    md += ["", "Command:", "", "```", command, "```", ""]
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
    md += ["## Against the reactive frontier", ""]
    for s in savings:
        if s.get("frontier_alloc_at_phase_fulfilment") is None:
            md.append(f"- `{s['resource']}`: not computed ({s.get('reason', 'undefined')}).")
            continue
        verts = ", ".join(f"{short_member(v['member'])} ({v['alloc_over_used']:.3f}, {v['fulfilment']:.1%})"
                          for v in s["frontier"])
        md.append(f"- `{s['resource']}`: frontier members (alloc/used, fulfilment) by fulfilment: {verts}."
                  + (f" {s['frontier_note']}." if s.get("frontier_note") else ""))
    md += ["", ("Against the cheapest *single* baseline whose fulfilment is at least the phase policy's (vpa or "
                "any window member; else the closest below, flagged): allocation cut = 1 − phase ÷ that "
                "baseline. This jumps with the spacing of the window family, which is why the frontier leads."),
           ""]
    for s in savings:
        if s["savings_vs_best_reactive"] is None:
            md.append(f"- `{s['resource']}`: not computed ({s.get('reason', 'undefined')}).")
        else:
            flag = "" if s["matched_fulfilment"] else " **UNMATCHED: no reactive baseline reached the phase " \
                                                      "policy's fulfilment; closest below used.**"
            md.append(f"- `{s['resource']}`: {s['savings_vs_best_reactive']:+.1%} vs `{s['best_reactive']}` "
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
           ("- Mixing two reactive baselines (alternating them) is taken to reach the straight line between "
            "their points; the frontier is the best any user of the reactive baselines could do with them."),
           f"- {_phase_statement(result)}", ""]
    md += ["## Plots", "",
           "- `tradeoff.png`: per resource, fulfilment against alloc/used for every policy, with the frontier."]
    for cid, name in plots:
        md.append(f"- `{name}`: container `{cid}`: usage (black) and the limit each policy set"
                  + ("; the phase policy's fallback steps as a wide pale green band; background = phase id"
                     if "phase" in fams else "; no phases (phase policy not in this run)")
                  + "; ▲ = a limit above the axis.")
    md += ["", f"Replay time (in-process): {result.elapsed_s:.2f} s.", ""]
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(md), encoding="utf-8")
    written.append(summary)
    return written
