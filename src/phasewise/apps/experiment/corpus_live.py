"""``phasewise experiment corpus live``: known-job priors through the roles a user runs, on real executions.

The embedded broker, ``phasewise produce`` (its policy file gives each execution's workload mode ``apply``
and its kind as ``phasewise.io/signature``), ``phasewise worker`` and ``phasewise actuate --backend cgroup``;
then *earlier* + *new* executions of one corpus kind, one at a time in cgroups of their own. The first
*earlier* runs have too few earlier runs for a prior (cold: the safety rules keep them unlimited); each
later one starts from their profiles. Every figure is read back from the topics: the limits in force as the
host agent sampled them, OOM kills, CPU cuts while throttled, the decisions and whether a prior made them.
docs/priors.md.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phasewise.apps.experiment.corpus_plan import KINDS, CorpusError, Execution, plan
from phasewise.apps.experiment.corpus_recorder import Recorder

__all__ = ["THROTTLED", "execution_figures", "format_live", "live"]

#: a sample counts as throttled above this share of its CFS periods (the worker's vpa_throttle_threshold)
THROTTLED = 0.1


def _read_all(settings: Any, topic: Any, cls: type) -> list[Any]:
    """Every record of *topic* that decodes as *cls*, from its beginning to its end now (the subscribers'
    reader: a partition ends at its EOF, not at a high watermark a broker may report short)."""
    from phasewise.apps.jobs.read import Reader
    from phasewise.kit.records import SchemaError, decode

    out = []
    with Reader(settings) as reader:
        for m in reader.read([topic.name]):
            try:
                out.append(decode(cls, m.value))
            except SchemaError:
                pass
    return out


def execution_figures(samples: list[tuple[float, Any]], decisions: list[Any]) -> dict[str, Any]:
    """One execution's figures from its container's samples (``(ts, ContainerSample)``, any order) and the
    decisions for it."""
    samples = sorted(samples, key=lambda x: x[0])
    n = len(samples)
    t0 = samples[0][0] if samples else 0.0
    first = next((ts - t0 for ts, c in samples if c.mem_limit_bytes is not None or c.cpu_limit_cores is not None),
                 None)
    cpu_l = [(c.cpu_limit_cores, c.cpu_cores) for _, c in samples if c.cpu_limit_cores is not None]
    mem_l = [(c.mem_limit_bytes, c.mem_bytes) for _, c in samples if c.mem_limit_bytes is not None]

    def share(c: Any) -> float:
        return c.throttled_periods / c.nr_periods if c.nr_periods else 0.0

    cuts = 0  # a CPU limit lowered after a sample throttled in more than THROTTLED of its periods
    for (_, a), (_, b) in zip(samples, samples[1:]):
        if (a.cpu_limit_cores is not None and b.cpu_limit_cores is not None and b.cpu_limit_cores < a.cpu_limit_cores
                and share(a) > THROTTLED):
            cuts += 1
    return {
        "samples": n,
        "limited_samples": sum(1 for _, c in samples if c.mem_limit_bytes is not None or c.cpu_limit_cores is not None),
        "first_limit_after_s": None if first is None else round(first, 1),
        "cpu_alloc_over_used": round(sum(x for x, _ in cpu_l) / sum(u for _, u in cpu_l), 3)
        if cpu_l and sum(u for _, u in cpu_l) > 0 else None,
        "mem_alloc_over_used": round(sum(x for x, _ in mem_l) / sum(u for _, u in mem_l), 3)
        if mem_l and sum(u for _, u in mem_l) > 0 else None,
        "throttled_samples": sum(1 for _, c in samples if share(c) > THROTTLED),
        "oom_kills": sum(c.oom_events for _, c in samples),
        "cpu_cuts_while_throttled": cuts,
        "decisions": len(decisions),
        "decisions_from_prior": sum(1 for d in decisions if "prior" in (d.details or {})),
    }


def live(kind: str, earlier: int, new: int, *, seconds: float | None = None, cgroup_root: str = "/sys/fs/cgroup",
         log: Any = sys.stderr) -> dict[str, Any]:
    """Run *earlier* + *new* executions of *kind* through the roles (see the module); the figures."""
    from phasewise.kit.records import Decision, HostSamples
    from phasewise.kit.topics import DECISIONS, SAMPLES

    if kind not in KINDS:
        raise CorpusError(f"unknown job kind {kind!r} (one of {', '.join(KINDS)})")
    if earlier < 1 or new < 1:
        raise CorpusError("--earlier and --new must be at least 1")
    if seconds is not None and not seconds > 0:
        raise CorpusError(f"--seconds must be above 0, got {seconds:g}")
    runs = plan([kind], earlier + new)
    if seconds is not None:
        runs = [Execution(e.id, e.kind, e.run, {**e.params, "--seconds": seconds}) for e in runs]
    env = {"PHASEWISE_PRIOR_MIN_RUNS": str(earlier), "PHASEWISE_PRIOR_MIN_RUN_S": "10",
           "PHASEWISE_PRIOR_PROFILE_INTERVAL_S": "5"}
    out = Path(tempfile.mkdtemp(prefix="phasewise-live-"))
    rec = Recorder(out, runs, cgroup_root=cgroup_root, log=log, live=env)
    command = ["phasewise", "experiment", "corpus", "live", "--kind", kind]
    entries = []
    try:
        rec.start()
        for i, e in enumerate(runs):
            print(f"[{i + 1}/{len(runs)}] {e.id}: {' '.join(e.argv('…'))}", file=log, flush=True)
            entries.append(rec.execute(e, command, record=False))
        time.sleep(6.0)  # the last decisions and samples reach their topics
        hs = _read_all(rec.settings, SAMPLES, HostSamples)
        ds = _read_all(rec.settings, DECISIONS, Decision)
    finally:
        rec.close()
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    by_run = []
    for i, (e, entry) in enumerate(zip(runs, entries)):
        mine = [(h.ts, c) for h in hs if h.host == rec.host for c in h.containers if c.container == e.id]
        fig = execution_figures(mine, [d for d in ds if d.container == e.id])
        by_run.append({"id": e.id, "earlier_runs": i, "prior_possible": i >= earlier, "seconds": entry["seconds"],
                       "params": e.params, **fig})
    return {"type": "corpus-live", "kind": kind, "earlier": earlier, "new": new,
            "settings": {**env, "safety rules": "on, the defaults (safety_min_history_s 900)"},
            "runs": by_run,
            "totals": {name: {k: sum(r[k] for r in by_run if r["prior_possible"] == possible)
                              for k in ("samples", "limited_samples", "oom_kills", "cpu_cuts_while_throttled",
                                        "decisions_from_prior")}
                       for name, possible in (("cold", False), ("with_prior", True))}}


def format_live(res: dict[str, Any]) -> str:
    lines = [f"{res['kind']}: {res['earlier']} runs without a prior, then {res['new']} with one; through produce, "
             "worker and actuate --backend cgroup",
             f"{'run':<16} {'prior':>5} {'samples':>7} {'limited':>7} {'first':>6} {'cpu a/u':>7} {'mem a/u':>7} "
             f"{'throttled':>9} {'oom':>3} {'cuts':>4}"]

    def f(v: Any, w: int) -> str:
        return f"{'—' if v is None else v:>{w}}"

    for r in res["runs"]:
        lines.append(f"{r['id']:<16} {'yes' if r['decisions_from_prior'] else 'no':>5} {r['samples']:>7} "
                     f"{r['limited_samples']:>7} {f(r['first_limit_after_s'], 6)} {f(r['cpu_alloc_over_used'], 7)} "
                     f"{f(r['mem_alloc_over_used'], 7)} {r['throttled_samples']:>9} {r['oom_kills']:>3} "
                     f"{r['cpu_cuts_while_throttled']:>4}")
    return "\n".join(lines)
