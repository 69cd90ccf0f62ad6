"""The demo's live terminal view: one table row per training job, redrawn about once a second.

:func:`render` is pure (a :class:`ViewState` in, the screen's text out);
:class:`LiveView` only moves the cursor with ANSI escapes on the terminal's
alternate screen. :data:`LEGEND` says what each column means.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Self, TextIO

from phasewise.kit.units import fmt_bytes, fmt_cores

__all__ = ["LEGEND", "JobRow", "LiveView", "ViewState", "render"]

#: the lines under the table, so nothing on the screen needs the code to be read
LEGEND = (
    "stage: the job's own progress (load, train, eval, checkpoint); crbm: the phase the worker's CRBM put it in,",
    "  named below by its profile against the other phases (like X: the stage its jobs reported most while in it)",
    "use%: use / limit; limit from: what set the last decision: phase N (that phase's statistics), vpa fallback",
    "  (the phase policy while its model is cold or the phase new) or vpa; +cpu:step: the safety rules that bounded it",
    "[applied]: the actuator set the limits; [clamped]: set after its own floors changed one; [rejected]: refused",
)


@dataclass
class JobRow:
    """What the view shows for one job; ``None`` = not known yet."""

    name: str
    cpu_cores: float | None = None
    cpu_limit: float | None = None
    mem_bytes: float | None = None
    mem_limit: float | None = None
    phase: str = ""
    step: int | None = None
    loss: float | None = None
    decisions: int = 0
    applied: int = 0
    last_decision: str = ""
    last_reason: str = ""
    last_status: str = ""
    state: str = "starting"
    restarts: int = 0
    oom_kills: int = 0
    crbm_phase: int | None = None  #: the CRBM phase id the worker's detector assigned (None: none yet)
    crbm_name: str = ""  #: that phase named by its profile: "CPU high and flat, memory mid — like train"
    source: str = ""  #: where the last decision's limits came from: "phase 3", "vpa fallback", "vpa"
    bounded: str = ""  #: the safety rules that bounded the last decision, e.g. "cpu:step mem:peak"


@dataclass
class ViewState:
    elapsed_s: float
    jobs: list[JobRow]
    host: str = ""
    bootstrap: str = ""
    run_dir: str = ""
    decisions_total: int = 0
    applied_total: int = 0
    samples_total: int = 0
    roles: dict[str, str] = field(default_factory=dict)
    duration_s: float | None = None
    notes: list[str] = field(default_factory=list)


def _pct(used: float | None, limit: float | None) -> str:
    if used is None or not limit:
        return ""
    return f"{100 * used / limit:3.0f}%"


def _clip(s: str, width: int) -> str:
    return s if len(s) <= width else s[: max(0, width - 1)] + "…"


def _hms(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def render(state: ViewState, width: int = 120) -> str:
    """The whole screen as text (no escape codes)."""
    width = max(80, width)
    head = f"phasewise demo  elapsed {_hms(state.elapsed_s)}"
    if state.duration_s:
        head += f" / {_hms(state.duration_s)}"
    head += f"  host {state.host}  broker {state.bootstrap}"
    lines = [_clip(head, width)]
    roles = "  ".join(f"{k}: {v}" for k, v in state.roles.items())
    lines.append(_clip(
        f"samples {state.samples_total}  decisions {state.decisions_total}  applied {state.applied_total}"
        + (f"  |  {roles}" if roles else ""), width))
    lines.append("")
    cols = (f"{'job':<12} {'stage':<10} {'crbm':>4}  {'cpu':>5} {'limit':>6} {'use%':>4}  {'memory':>7} "
            f"{'limit':>7} {'use%':>4}  {'step':>6} {'loss':>7}  {'dec':>3} {'app':>3}  limit from")
    lines.append(_clip(cols, width))
    lines.append("-" * min(width, len(cols) + 20))
    for j in state.jobs:
        loss = "-" if j.loss is None else f"{j.loss:.3f}"
        step = "-" if j.step is None else str(j.step)
        stage = j.phase if j.state == "running" else j.state
        crbm = "-" if j.crbm_phase is None else str(j.crbm_phase)
        source = (j.source or "-") + (f" +{j.bounded}" if j.bounded else "")
        row = (f"{_clip(j.name, 12):<12} {_clip(stage, 10):<10} {crbm:>4}  {fmt_cores(j.cpu_cores):>5} "
               f"{fmt_cores(j.cpu_limit):>6} {_pct(j.cpu_cores, j.cpu_limit):>4}  {fmt_bytes(j.mem_bytes):>7} "
               f"{fmt_bytes(j.mem_limit):>7} {_pct(j.mem_bytes, j.mem_limit):>4}  {step:>6} {loss:>7}  "
               f"{j.decisions:>3} {j.applied:>3}  {source}")
        lines.append(_clip(row, width))
        decision = j.last_decision or "(none yet)"
        if j.last_status:
            decision += f" [{j.last_status}]"
        extra = [f"last: {decision}"]
        if j.crbm_name:
            extra.insert(0, f"crbm {j.crbm_phase}: {j.crbm_name};")
        if j.last_reason:
            extra.append(f"why: {j.last_reason}")
        if j.restarts or j.oom_kills:
            extra.append(f"restarts {j.restarts}, OOM kills {j.oom_kills}")
        lines.append(_clip(" " * 13 + "  ".join(extra), width))
    lines.append("")
    for line in LEGEND:
        lines.append(_clip(line, width))
    for note in state.notes:
        lines.append(_clip(note, width))
    if state.run_dir:
        lines.append(_clip(f"logs: {state.run_dir}", width))
    lines.append("Ctrl-C stops the demo and prints the summary.")
    return "\n".join(lines) + "\n"


class LiveView:
    """Redraw :func:`render` output in place (a context manager)."""

    def __init__(self, out: TextIO | None = None, *, min_interval_s: float = 1.0,
                 plain_every_s: float = 10.0) -> None:
        self.out = out or sys.stdout
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.min_interval_s = min_interval_s if self.tty else plain_every_s
        self._last = 0.0

    def __enter__(self) -> Self:
        if self.tty:
            self.out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide cursor
            self.out.flush()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            self.out.write("\x1b[?25h\x1b[?1049l")  # show cursor, back to the normal screen
            self.out.flush()

    def width(self) -> int:
        import shutil

        return shutil.get_terminal_size((120, 40)).columns

    def draw(self, state: ViewState, *, force: bool = False) -> bool:
        """Redraw if at least ``min_interval_s`` passed (or *force*); True if drawn."""
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return False
        self._last = now
        text = render(state, self.width())
        if self.tty:
            body = "\x1b[K\n".join(text.rstrip("\n").split("\n"))
            self.out.write("\x1b[H" + body + "\x1b[K\n\x1b[J")
        else:
            self.out.write(text + "\n")
        self.out.flush()
        return True
