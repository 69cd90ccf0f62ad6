"""What the demo saw and what it says about it (pure): the :class:`Records` it collects, :func:`summarize`
(``phasewise demo --json``), :func:`format_summary` and :func:`view_state` (the live view's input).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.apps.demo.view import JobRow, ViewState
from phasewise.kit.records import Actuation, Decision, HostSamples, PhaseChange, encode
from phasewise.kit.units import fmt_bytes

__all__ = [
    "CgroupPoint",
    "JobProgress",
    "Records",
    "SamplePoint",
    "bounded_rules",
    "format_summary",
    "limit_source",
    "summarize",
    "throttled_cuts",
    "view_state",
]


APPLIED = ("applied", "clamped")


@dataclass(frozen=True, slots=True)
class SamplePoint:
    ts: float
    cpu_cores: float
    mem_bytes: float
    cpu_limit: float | None
    mem_limit: float | None
    oom_events: int = 0


@dataclass(frozen=True, slots=True)
class CgroupPoint:
    """The demo's own reading of a job's cgroup (wall time): the kernel's counters, not the pipeline's."""

    ts: float
    throttled_share: float  #: throttled CFS periods / periods since the previous reading
    cpu_limit: float | None
    mem_limit: float | None
    oom_kills: int  #: cumulative since the cgroup was created (a restarted job keeps its cgroup)


@dataclass
class JobProgress:
    """What a job's own progress lines said."""

    phase: str = ""
    step: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    restarts: int = 0
    exits: list[int] = field(default_factory=list)

    def update(self, line: dict) -> None:
        self.phase = str(line.get("phase", self.phase))
        if "step" in line:
            self.step = int(line["step"])
        if line.get("phase") == "train" and "loss" in line:
            loss = float(line["loss"])
            if math.isfinite(loss):
                if self.first_loss is None:
                    self.first_loss = loss
                self.last_loss = loss


@dataclass
class Records:
    """Everything the demo saw, per job: the input of :func:`summarize` and :func:`view_state`."""

    jobs: tuple[str, ...]
    samples: dict[str, list[SamplePoint]] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    actuations: list[Actuation] = field(default_factory=list)
    progress: dict[str, JobProgress] = field(default_factory=dict)
    host_messages: int = 0
    #: the CRBM phase the worker's detector put each job in (``phasewise.phases.v1``; None: none yet)
    crbm_phase: dict[str, int | None] = field(default_factory=dict)
    cgroups: dict[str, list[CgroupPoint]] = field(default_factory=dict)
    #: each CRBM phase's usage statistics as its last phase change carried them (any container's), and how
    #: often each stage a job reported was seen in it: the phase's name (:meth:`phase_name`)
    phase_stats: dict[int, dict] = field(default_factory=dict)
    phase_stages: dict[int, dict[str, int]] = field(default_factory=dict)
    #: the decisions and actuations about other containers (the jobs the demo submits, their place
    #: decisions): in ``records.jsonl``, not in the per-job figures
    others: list[Decision | Actuation] = field(default_factory=list)

    def __post_init__(self) -> None:
        for j in self.jobs:
            self.samples.setdefault(j, [])
            self.progress.setdefault(j, JobProgress())
            self.crbm_phase.setdefault(j, None)
            self.cgroups.setdefault(j, [])

    def write_jsonl(self, path: Path) -> None:
        """Everything collected, one JSON object a line with its ``type`` (``decision``, ``actuation``:
        the topic records; ``sample``, ``cgroup``: per job), for a look after the run."""
        with open(path, "w") as f:
            for d in self.decisions:
                f.write(json.dumps({"type": "decision", **json.loads(encode(d))}) + "\n")
            for a in self.actuations:
                f.write(json.dumps({"type": "actuation", **json.loads(encode(a))}) + "\n")
            for r in self.others:
                kind = "decision" if isinstance(r, Decision) else "actuation"
                f.write(json.dumps({"type": kind, **json.loads(encode(r))}) + "\n")
            for job in self.jobs:
                for p in self.samples.get(job, []):
                    f.write(json.dumps({"type": "sample", "job": job, **dataclasses.asdict(p)}) + "\n")
                for c in self.cgroups.get(job, []):
                    f.write(json.dumps({"type": "cgroup", "job": job, **dataclasses.asdict(c)}) + "\n")

    def add_phase_change(self, c: PhaseChange) -> bool:
        if c.stats:
            self.phase_stats[c.new_phase] = c.stats
        if c.container in self.crbm_phase:
            self.crbm_phase[c.container] = c.new_phase
            return True
        return False

    def add_samples(self, msg: HostSamples) -> int:
        """Keep the samples of our jobs; returns how many were kept."""
        self.host_messages += 1
        n = 0
        for c in msg.containers:
            if c.container in self.samples:
                self.samples[c.container].append(SamplePoint(
                    msg.ts, c.cpu_cores, c.mem_bytes, c.cpu_limit_cores, c.mem_limit_bytes, c.oom_events))
                n += 1
                crbm, prog = self.crbm_phase.get(c.container), self.progress.get(c.container)
                if crbm is not None and crbm >= 0 and prog is not None and prog.phase:
                    seen = self.phase_stages.setdefault(crbm, {})
                    seen[prog.phase] = seen.get(prog.phase, 0) + 1
        return n

    def phase_name(self, phase: int | None) -> str:
        """*phase* named by its profile against the other phases seen, and the stage seen most in it
        (``CPU high and flat, memory mid — like train``); empty without its statistics."""
        if phase is None or phase not in self.phase_stats:
            return ""
        from phasewise.models.phases.names import phase_names

        return phase_names(self.phase_stats, self.phase_stages).get(phase, "")

    def add_decision(self, d: Decision) -> bool:
        """Keep *d*; True where it is about one of the demo's jobs."""
        if d.container in self.samples:
            self.decisions.append(d)
            return True
        self.others.append(d)
        return False

    def add_actuation(self, a: Actuation) -> bool:
        """Keep *a*; True where it is about one of the demo's jobs."""
        if a.container in self.samples:
            self.actuations.append(a)
            return True
        self.others.append(a)
        return False


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def throttled_cuts(records: Records, job: str, *, window_s: float, threshold: float) -> list[Decision]:
    """The job's decisions that lowered its CPU limit while it was throttled (pure).

    Lowered: below the limit in force at the decision, as the demo last read it from the cgroup;
    throttled: a reading in the *window_s* before the decision had more than *threshold* of its CFS
    periods throttled. The demo's readings are the kernel's counters, independent of the worker.
    """
    pts = records.cgroups.get(job, [])
    out = []
    for d in records.decisions:
        if d.container != job or d.cpu_limit_cores is None:
            continue
        before = [p for p in pts if p.ts <= d.ts]
        if not before or before[-1].cpu_limit is not None and d.cpu_limit_cores >= before[-1].cpu_limit - 1e-9:
            continue
        if any(d.ts - window_s <= p.ts <= d.ts and p.throttled_share > threshold for p in before):
            out.append(d)
    return out


def summarize(
    records: Records,
    *,
    duration_s: float,
    final_limits: dict[str, tuple[float | None, float | None]] | None = None,
    cleanup_problems: Sequence[str] = (),
    run_dir: str = "",
    error: str | None = None,
    policy: str = "",
    throttle_window_s: float = 5.0,
    throttle_threshold: float = 0.1,
) -> dict[str, Any]:
    """The demo's summary from what it collected (pure).

    ``decisions_made`` counts distinct decision ids seen for the demo's jobs;
    ``decisions_applied`` counts distinct decision ids with an ``applied`` or
    ``clamped`` actuation. Per job: ``cpu_used`` is the mean of the sampled
    CPU use (cores) over the run, ``mem_used`` the mean working set (bytes);
    ``*_limit_final`` come from *final_limits* (read from the cgroup at the
    end) or else the last sample (``None`` = unlimited);
    ``cpu_alloc_ratio`` / ``mem_alloc_ratio`` are the mean limit over the
    mean use across the samples that had a limit (allocation vs use: 1.0 is a
    perfect fit, 3.0 means three times more was reserved than used).
    ``cleanup`` is true when *cleanup_problems* is empty. ``oom_kills`` counts the
    kernel's OOM kills in each job's cgroup (its own counter, read by the demo;
    the samples' count when the demo could not read it), ``throttled_cuts`` the
    decisions that lowered a job's CPU while it was throttled
    (:func:`throttled_cuts`), ``restarts`` the jobs restarted after they died.
    """
    final_limits = final_limits or {}
    decided = {d.id for d in records.decisions}
    applied = {a.decision_id for a in records.actuations if a.status in APPLIED}
    jobs: dict[str, Any] = {}
    for name in records.jobs:
        pts = records.samples.get(name, [])
        cpu_lim_pts = [p for p in pts if p.cpu_limit is not None]
        mem_lim_pts = [p for p in pts if p.mem_limit is not None]
        last = pts[-1] if pts else None
        cpu_final, mem_final = final_limits.get(
            name, (last.cpu_limit if last else None, last.mem_limit if last else None))
        prog = records.progress.get(name, JobProgress())
        job_decisions = {d.id for d in records.decisions if d.container == name}
        jobs[name] = {
            "samples": len(pts),
            "cpu_used": _round(_mean(p.cpu_cores for p in pts)),
            "cpu_used_max": _round(max((p.cpu_cores for p in pts), default=None)),
            "cpu_limit_final": _round(cpu_final),
            "cpu_alloc_ratio": _round(_ratio(_mean(p.cpu_limit for p in cpu_lim_pts),  # type: ignore[misc]
                                             _mean(p.cpu_cores for p in cpu_lim_pts)), 3),
            "mem_used": _round(_mean(p.mem_bytes for p in pts), 0),
            "mem_used_max": _round(max((p.mem_bytes for p in pts), default=None), 0),
            "mem_limit_final": _round(mem_final, 0),
            "mem_alloc_ratio": _round(_ratio(_mean(p.mem_limit for p in mem_lim_pts),  # type: ignore[misc]
                                             _mean(p.mem_bytes for p in mem_lim_pts)), 3),
            "decisions": len(job_decisions),
            "decisions_applied": len(job_decisions & applied),
            "oom_kills": (records.cgroups[name][-1].oom_kills if records.cgroups.get(name)
                          else sum(p.oom_events for p in pts)),
            "throttled_cuts": len(throttled_cuts(records, name, window_s=throttle_window_s,
                                                 threshold=throttle_threshold)),
            "crbm_phase": records.crbm_phase.get(name),
            "crbm_phase_name": records.phase_name(records.crbm_phase.get(name)) or None,
            "progress_phase": prog.phase or None,  # the last phase the job's own progress lines reported
            "steps": prog.step,
            "first_loss": prog.first_loss,
            "last_loss": prog.last_loss,
            "restarts": prog.restarts,
        }
    return {
        "policy": policy,
        "duration_s": round(duration_s, 1),
        "oom_kills": sum(j["oom_kills"] for j in jobs.values()),
        "throttled_cuts": sum(j["throttled_cuts"] for j in jobs.values()),
        "restarts": sum(j["restarts"] for j in jobs.values()),
        "decisions_made": len(decided),
        "decisions_applied": len(decided & applied) if decided else len(applied),
        "actuations": len(records.actuations),
        "host_messages": records.host_messages,
        "jobs": jobs,
        "cleanup": not cleanup_problems,
        "cleanup_problems": list(cleanup_problems),
        "run_dir": run_dir,
        "error": error,
    }


def _decision_text(d: Decision) -> str:
    parts = []
    if d.cpu_limit_cores is not None:
        parts.append(f"cpu {d.cpu_limit_cores:.2f}")
    if d.mem_limit_bytes is not None:
        parts.append(f"mem {fmt_bytes(d.mem_limit_bytes)}")
    what = " ".join(parts) if parts else d.action
    return f"{d.action} {what} ({d.policy})" if parts else f"{what} ({d.policy})"


def limit_source(d: Decision) -> str:
    """Where a decision's limits came from, for the view: ``phase 3``, ``vpa fallback``, ``vpa``, ``mixed``.

    >>> limit_source(Decision(id="x", ts=0.0, host="h", container="c", action="limit", policy="phase",
    ...                       cpu_limit_cores=1.0, details={"source": "phase", "phase": 3}))
    'phase 3'
    """
    det = d.details if isinstance(d.details, dict) else {}
    if d.policy != "phase":
        return d.policy
    src = det.get("source")
    if src == "phase":
        return f"phase {det.get('phase')}"
    if src == "fallback:vpa":
        return "vpa fallback"
    return str(src or "phase")


def bounded_rules(d: Decision) -> str:
    """The safety rules that bounded a decision, for the view: ``cpu:step mem:peak,oom`` (empty: none)."""
    safety = d.details.get("safety") if isinstance(d.details, dict) else None
    by = safety.get("bounded_by") if isinstance(safety, dict) else None
    if not isinstance(by, dict):
        return ""
    return " ".join(f"{r}:{','.join(map(str, rules))}" for r, rules in by.items() if isinstance(rules, list))


def view_state(records: Records, *, elapsed_s: float, job_states: dict[str, str] | None = None,
               **kw: Any) -> ViewState:
    """The live view's input from the records (pure)."""
    job_states = job_states or {}
    last_dec: dict[str, Decision] = {}
    for d in records.decisions:
        last_dec[d.container] = d
    status: dict[str, str] = {}
    applied: dict[str, set[str]] = {j: set() for j in records.jobs}
    for a in records.actuations:
        if a.status != "duplicate" or a.decision_id not in status:  # a re-delivery keeps the first outcome
            status[a.decision_id] = a.status
        if a.status in APPLIED:
            applied[a.container].add(a.decision_id)
    rows = []
    for name in records.jobs:
        pts = records.samples.get(name, [])
        p = pts[-1] if pts else None
        prog = records.progress.get(name, JobProgress())
        d = last_dec.get(name)
        rows.append(JobRow(
            name=name,
            cpu_cores=p.cpu_cores if p else None,
            cpu_limit=p.cpu_limit if p else None,
            mem_bytes=p.mem_bytes if p else None,
            mem_limit=p.mem_limit if p else None,
            phase=prog.phase,
            step=prog.step,
            loss=prog.last_loss,
            decisions=len({x.id for x in records.decisions if x.container == name}),
            applied=len(applied[name]),
            last_decision=_decision_text(d) if d else "",
            last_reason=d.reason if d else "",
            last_status=status.get(d.id, "pending") if d else "",
            state=job_states.get(name, "running"),
            restarts=prog.restarts,
            oom_kills=(records.cgroups[name][-1].oom_kills if records.cgroups.get(name)
                       else sum(x.oom_events for x in pts)),
            crbm_phase=records.crbm_phase.get(name),
            crbm_name=records.phase_name(records.crbm_phase.get(name)),
            source=limit_source(d) if d else "",
            bounded=bounded_rules(d) if d else "",
        ))
    decided = {d.id for d in records.decisions}
    return ViewState(
        elapsed_s=elapsed_s,
        jobs=rows,
        decisions_total=len(decided),
        applied_total=len({a.decision_id for a in records.actuations if a.status in APPLIED}),
        samples_total=sum(len(v) for v in records.samples.values()),
        **kw,
    )


def format_summary(s: dict[str, Any]) -> str:
    """The summary as text for a terminal."""
    if s.get("error") and not any(j["samples"] for j in s["jobs"].values()):
        cleanup = ("cleanup: nothing this run made is left behind" if s["cleanup"]
                   else "cleanup FAILED: " + "; ".join(s["cleanup_problems"]))
        return f"phasewise demo failed: {s['error']}\n{cleanup}\nlogs: {s['run_dir']}"
    lines = [
        (f"phasewise demo ({s['policy']} policy): {s['duration_s']:.0f} s, {s['decisions_made']} decisions made, "
         f"{s['decisions_applied']} applied ({s['actuations']} actuations); OOM kills {s['oom_kills']}, "
         f"CPU cuts while throttled {s['throttled_cuts']}, restarts {s['restarts']}"),
        "",
        (f"{'job':<12} {'cpu used':>9} {'cpu limit':>10} {'alloc/use':>9}  {'mem used':>9} {'mem limit':>10} "
         f"{'alloc/use':>9}  {'dec':>3} {'app':>3}  {'steps':>6} {'loss':>15}"),
    ]
    for name, j in s["jobs"].items():
        def num(x: float | None, f: str = ".2f") -> str:
            return "-" if x is None else format(x, f)

        loss = (f"{num(j['first_loss'], '.3f')} -> {num(j['last_loss'], '.3f')}"
                if j["first_loss"] is not None else "-")
        lines.append(
            f"{name:<12} {num(j['cpu_used']):>9} {num(j['cpu_limit_final']) if j['cpu_limit_final'] else 'none':>10} "
            f"{num(j['cpu_alloc_ratio']):>9}  {fmt_bytes(j['mem_used']):>9} "
            f"{fmt_bytes(j['mem_limit_final']) if j['mem_limit_final'] else 'none':>10} "
            f"{num(j['mem_alloc_ratio']):>9}  {j['decisions']:>3} {j['decisions_applied']:>3}  "
            f"{j['steps'] if j['steps'] is not None else '-':>6} {loss:>15}"
            + (f"  restarts {j['restarts']}, OOM kills {j['oom_kills']}" if j["restarts"] or j["oom_kills"] else "")
        )
    named = [(name, j["crbm_phase"], j.get("crbm_phase_name")) for name, j in s["jobs"].items()
             if j.get("crbm_phase_name")]
    if named:
        lines.append("")
        lines += [f"{name:<12} ended in CRBM phase {p}: {text}" for name, p, text in named]
    lines.append("")
    lines.append("used: mean over the run; limit: at the end (none = unlimited); alloc/use: mean limit / mean use "
                 "(1.0 = no slack); dec/app: decisions made / applied")
    if s["cleanup"]:
        lines.append("cleanup: all processes stopped, cgroups removed, broker stopped; nothing left behind")
    else:
        lines.append("cleanup FAILED: " + "; ".join(s["cleanup_problems"]))
    if s.get("error"):
        lines.append(f"error: {s['error']}")
    lines.append(f"logs: {s['run_dir']}")
    return "\n".join(lines)
