"""``phasewise jobs [--json]`` and ``phasewise jobs describe JOB``: every job's state, where it runs, its
prediction against what it used, its progress against its targets and why it waits; one job's timeline.

Reads job events, predictions, decisions, actuations and dead letters from their beginning to their end,
and the samples of the last ``--samples`` (:mod:`phasewise.apps.jobs.read`), folds them with
:class:`~phasewise.models.jobs.view.JobsFold` and prints. With the cluster key configured
(``signing_key_file``), a state, decision or prediction not signed with it is shown as refused and changes
nothing, as the agents treat it. Narrative: docs/jobs.md, "Watching jobs".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from typing import Any

from phasewise.kit.command import add_common, arg_type
from phasewise.kit.settings import above, at_least, parse_float

__all__ = ["add_arguments", "describe_text", "read_views", "run", "table_text"]

#: job-event kinds that carry no cluster signature (the submitter signs ``submitted`` its own way)
_UNSIGNED_KINDS = ("submitted", "progress", "priority")


def _duration(text: str) -> float:
    from phasewise.apps.jobs.tail import parse_duration

    return 0.0 if text.strip() in ("0", "none") else parse_duration(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("describe", nargs="?", metavar="describe",
                   help="describe JOB: its state, timeline (every event, decision, actuation, prediction and dead "
                        "letter about it) and decisions")
    p.add_argument("job", nargs="?", metavar="JOB", help="the job to describe")
    add_common(p)
    p.add_argument("--json", action="store_true", help="print JSON (the list: {\"jobs\": [...]}; describe: the job)")
    p.add_argument("--state", action="append", metavar="STATE",
                   help="list only jobs in this state (repeat for several): waiting, placed, running, frozen, "
                        "finished, failed, terminated, rejected, lost, unknown")
    p.add_argument("--samples", type=arg_type(_duration, at_least(0), name="duration"), default=3600.0,
                   metavar="DURATION", help="what jobs used: their samples of the last DURATION (10m, 2h, 1d; 0: "
                                            "none; default 1h)")
    p.add_argument("--timeout", type=arg_type(parse_float, above(0)), default=10.0, metavar="SECONDS",
                   help="give up when no broker answers, or a topic gives nothing, for this long (default 10)")


def read_views(settings: Any, *, timeout_s: float, samples_s: float, now: float) -> tuple[Any, Counter]:
    """The fold of the cluster's records: (the :class:`JobsFold`, records refused to decode by topic)."""
    from phasewise.apps.jobs.read import Reader
    from phasewise.kit import records as R
    from phasewise.kit.signing import keyring_of
    from phasewise.kit.topics import ACTUATIONS, CONTROL, DEAD_LETTERS, DECISIONS, JOB_EVENTS, PREDICTIONS, SAMPLES
    from phasewise.models.jobs.view import JobsFold, ViewConfig

    keyring = keyring_of(settings)
    fold = JobsFold(ViewConfig(warmup_s=settings.horus.warmup_s, prediction_wait_s=settings.place.prediction_wait_s),
                    job_topics=frozenset({JOB_EVENTS.name, PREDICTIONS.name, CONTROL.name}))
    bad: Counter = Counter()

    def unsigned(msg: Any) -> str | None:
        if keyring is None:
            return None
        why = keyring.verify(msg.topic, msg.key, msg.value, msg.headers)
        return None if why is None else f"refused: {why}"

    def job_event(msg: Any, ev: Any) -> None:
        fold.job_event(ev, None if ev.kind in _UNSIGNED_KINDS else unsigned(msg))

    steps = [(JOB_EVENTS, R.JobEvent, job_event),
             (PREDICTIONS, R.UtilisationPrediction, lambda m, p: fold.prediction(p, unsigned(m))),
             (DECISIONS, R.Decision, lambda m, d: fold.decision(d, unsigned(m))),
             (ACTUATIONS, R.Actuation, lambda m, a: fold.actuation(a)),
             (DEAD_LETTERS, R.DeadLetter, lambda m, dl: fold.dead_letter(dl))]
    with Reader(settings, timeout_s=timeout_s) as reader:
        read: dict[str, list[Any]] = {topic.name: [] for topic, _cls, _add in steps}
        for msg in reader.read(list(read)):  # all at once: one wait for the partitions' ends
            read[msg.topic].append(msg)
        for topic, cls, add in steps:  # job events first: they say which containers are whose
            for msg in read.pop(topic.name):
                try:
                    rec = R.decode(cls, msg.value) if msg.value is not None else None
                except R.SchemaError:
                    rec = None
                if rec is None:
                    bad[topic.name] += 1
                    continue
                add(msg, rec)
        first, hosts = fold.first_start(), {h.encode() for h in fold.hosts()}
        if samples_s > 0 and first is not None:
            for msg in reader.read([SAMPLES.name], since=max(first, now - samples_s)):
                if msg.key is not None and msg.key not in hosts:
                    continue  # (keyed by host) no job of ours ran there: not worth decoding
                try:
                    fold.samples(R.decode_host_samples(msg.value))
                except R.SchemaError:
                    bad[SAMPLES.name] += 1
    return fold, bad


# -- the text -------------------------------------------------------------------------------------------


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _pair(pred: dict | None, obs: dict | None, name: str, fmt: Any) -> str:
    """predicted/used, for one target."""
    p = None if pred is None else pred[name]["mean"]
    o = None if obs is None else obs.get(name)
    if p is None and o is None:
        return "-"
    return f"{fmt(p)}/{fmt(o)}"


def progress_text(v: Any) -> str:
    """A job's last progress against its targets, short."""
    pr, t = v.progress, v.targets
    if pr is None and t is None:
        return "-"
    text = "no progress yet" if pr is None or pr["value"] is None else (
        f"{pr['metric']} {pr['value']:.4g}" + (f" @{pr['step']}" if pr.get("step") is not None else ""))
    if t is not None:
        if t["reached"] is not None:
            text += f", {t['reached']} {_num(t[t['reached']])} reached"
        else:
            text += f", toward {_num(t['acceptable'])}/{_num(t['objective'])}"
    return text


def ending_text(v: Any) -> str:
    """How an ended job ended: exit code, signal, OOM kill, run time."""
    from phasewise.models.jobs.view import age

    how = [f"exit code {v.exit_code}" if v.exit_code is not None else None, v.signal,
           "OOM-killed" if v.oom else None, f"ran {age(v.run_s)}" if v.run_s is not None else None]
    return ", ".join(h for h in how if h)


def why_text(v: Any) -> str:
    """The WHY column: why a job waits; how and why an ended one ended."""
    if v.state in ("finished", "failed", "terminated", "rejected", "lost"):
        how = ending_text(v)
        return f"{how}: {v.reason}" if how and v.reason else how or v.reason or ""
    return v.reason or ""


def table_text(views: list[Any], now: float) -> str:
    """The jobs as ``phasewise jobs`` lists them."""
    from phasewise.apps.jobs.tail import printable
    from phasewise.models.jobs.view import age, size

    gpu = any((v.prediction and v.prediction["gpu_util"]["mean"] > 0) or (v.observed and v.observed.get("gpu_util"))
              or v.gpus for v in views)
    head = ["JOB", "STATE", "AGE", "CLASS", "PRI", "HOST", "CPUS"] + (["GPUS"] if gpu else []) + [
        "CPU pred/used", "MEM pred/used"] + (["GPU% pred/used"] if gpu else []) + ["PROGRESS", "WHY"]
    rows = []
    for v in views:
        row = [v.job, v.state, age(None if v.since is None else now - v.since), v.workload, str(v.priority),
               v.host or "-", v.cpuset or "-"]
        if gpu:
            row.append(",".join(v.gpus) or "-")
        row += [_pair(v.prediction, v.observed, "cpu_cores", _num), _pair(v.prediction, v.observed, "mem_bytes", size)]
        if gpu:
            row.append(_pair(v.prediction, v.observed, "gpu_util", _num))
        row += [progress_text(v), why_text(v)]
        rows.append(row)
    rows = [[printable(c) for c in r] for r in rows]  # what records say, never a terminal's control sequence
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in [head, *rows]]
    return "\n".join(x.rstrip() for x in lines)


def describe_text(v: Any, now: float) -> str:
    """One job as ``phasewise jobs describe`` shows it (ages back from *now*)."""
    from phasewise.apps.jobs.tail import printable
    from phasewise.models.jobs.view import TARGETS, age, cores, size

    def ago(ts: float | None) -> str:
        return "-" if ts is None else f"{age(now - ts)} ago"

    fmt = {"cpu_cores": cores, "mem_bytes": size, "gpu_util": lambda x: f"{x:.3g}%",
           "gpu_mem_bytes": size}
    out = [f"Job:          {v.job}",
           f"State:        {v.state}" + (f" (since {ago(v.since)})" if v.since is not None else ""),
           f"Class:        {v.workload}",
           f"Priority:     {v.priority}",
           f"Submitted:    {ago(v.submitted)}"]
    if v.reason:
        out.append(f"{'Why:' if v.state == 'waiting' else 'Reason:':<14}{v.reason}")
    if v.spec:
        sp = v.spec
        names = {"cpu_cores": "cpu", "mem_bytes": "mem", "gpus": "gpus", "gpu_mem_bytes": "gpu mem"}
        req = ", ".join(f"{names.get(k, k)} {fmt[k](x) if k in fmt else _num(x)}" for k, x in sp["requests"].items()
                        if x is not None and x != 0) or "none stated"
        out.append(f"Spec:         {sp['model']} on {sp['dataset']}, batch {sp['batch_size']}; requests {req}")
    where = [f"host {v.host}" if v.host else None, f"node {v.node}" if v.node else None,
             f"container {v.container}" if v.container else None, f"pid {v.pid}" if v.pid else None]
    if any(where):
        out.append(f"Runs on:      {', '.join(w for w in where if w)}")
    if v.cpuset or v.gpus:
        out.append(f"CPUs / GPUs:  {v.cpuset or '-'} / {','.join(v.gpus) or '-'}")
    if ending_text(v):
        out.append(f"Ended:        {ending_text(v)}")
    out.append("Utilisation:  " + ("none predicted or observed" if not (v.prediction or v.observed) else ""))
    if v.prediction or v.observed:
        p, o = v.prediction, v.observed
        errors = (p or {}).get("log_error") or {}
        out.append(f"  {'':14}{'predicted (mean [lo, hi])':<36}{'observed (mean)':<16}"
                   + ("Horus's log error" if errors else ""))
        for name in TARGETS:
            pt = "-" if p is None else (f"{fmt[name](p[name]['mean'])} [{fmt[name](p[name]['lo'])}, "
                                        f"{fmt[name](p[name]['hi'])}]")
            ot = "-" if o is None or o.get(name) is None else fmt[name](o[name])
            et = f"{errors[name]:.3g}" if isinstance(errors.get(name), (int, float)) else ("-" if errors else "")
            out.append(f"  {name:<14}{pt:<36}{ot:<16}{et}".rstrip())
        if p is not None:
            out.append(f"  predicted by model v{p['model_version']} {ago(p['ts'])}"
                       + (" (first job of its model)" if p["first_sight"] else ""))
        if o is not None and o.get("source") == "horus":
            out.append(f"  observed by Horus when it learned the job, {ago(o['last'])}")
        elif o is not None:
            out.append(f"  observed over {o['samples']} samples, {ago(o['first'])} to {ago(o['last'])}")
    out.append(f"Progress:     {progress_text(v)}")
    if v.decisions:
        out.append(f"Decisions:    {', '.join(v.decisions)}")
    out.append("Events:")
    rows = [("AGE", "FROM", "KIND", "MESSAGE")] + [
        (age(now - e.ts), e.source, e.kind, e.text + (f"  [ignored: {e.ignored}]" if e.ignored else ""))
        for e in v.timeline]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows]
    return "\n".join(printable(x.rstrip()) for x in out)  # what records say, never a control sequence


def run(args: argparse.Namespace) -> int:
    from phasewise.apps.jobs.read import ReadError
    from phasewise.kit.command import settings_from_args
    from phasewise.kit.kafka.client import BrokerUnavailable
    from phasewise.kit.signing import SigningError
    from phasewise.models.jobs.view import STATES

    if args.describe not in (None, "describe"):  # a job id alone, or a word jobs does not know
        print(f"phasewise jobs: error: {args.describe!r}: did you mean phasewise jobs describe {args.describe}?",
              file=sys.stderr)
        return 2
    if args.describe and not args.job:
        print("phasewise jobs: error: describe: which job? phasewise jobs describe JOB", file=sys.stderr)
        return 2
    bad_states = sorted(set(args.state or ()) - set(STATES))
    if bad_states:
        print(f"phasewise jobs: error: --state: unknown {', '.join(bad_states)}; one of {', '.join(STATES)}",
              file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    if settings.log_level != "debug":  # the one line the command ends with says it; no commentary while waiting
        logging.getLogger("phasewise.kafka.client").setLevel(logging.ERROR)
    now = time.time()
    try:
        fold, bad = read_views(settings, timeout_s=args.timeout, samples_s=args.samples, now=now)
    except (BrokerUnavailable, ReadError) as e:
        print(f"phasewise jobs: {e}", file=sys.stderr)
        return 1
    except SigningError as e:
        print(f"phasewise jobs: error: {e}", file=sys.stderr)
        return 2
    for topic, n in sorted(bad.items()):
        print(f"phasewise jobs: warning: {n} record(s) of {topic} do not decode and are left out "
              f"(phasewise tail {topic} shows each, with why)", file=sys.stderr)
    if args.describe:
        v = fold.view(args.job, now)
        if v is None:
            print(f"phasewise jobs: no record names job {args.job!r}", file=sys.stderr)
            return 1
        print(json.dumps(v.to_dict(), indent=2) if args.json else describe_text(v, now))
        return 0
    views = [v for v in fold.views(now) if not args.state or v.state in args.state]
    if args.json:
        print(json.dumps({"now": now, "jobs": [v.to_dict(timeline=False) for v in views]}, indent=2))
    elif views:
        print(table_text(views, now))
    else:
        print("no jobs" + (f" in state {', '.join(args.state)}" if args.state else ""), file=sys.stderr)
    return 0
