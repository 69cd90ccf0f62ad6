"""``phasewise record --out FILE``: the samples topic (or, with ``--sample-host``, this host's containers read
directly by the host agent's own sampler, no Kafka) to a Parquet trace file with a provenance header
(:mod:`phasewise.apps.record.tracefile`), for ``phasewise replay --format phasewise``.

From the topic it reads as ``phasewise tail`` does (:class:`~phasewise.apps.jobs.read.Reader`: every
partition assigned, no consumer group, nothing committed), then the job-events topic for each
container's job, command and progress. A record that does not decode is counted with its reason, in the
summary line and the header; it is not dead-lettered: the recorder is a reader beside the consumers
that own the records (the worker dead-letters them), and it publishes nothing. Narrative:
docs/results.md, "Record your own cluster".
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from phasewise.kit.command import add_common, arg_type
from phasewise.kit.settings import above, at_least, parse_float, parse_int
from phasewise.kit.topics import JOB_EVENTS, SAMPLES

__all__ = ["add_arguments", "record_command", "run"]

log = logging.getLogger(__name__)


def _duration(text: str) -> float:
    from phasewise.apps.jobs.tail import parse_duration

    return parse_duration(text)


def _since(text: str) -> float:
    from phasewise.apps.jobs.tail import parse_since

    return parse_since(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import add_setting
    from phasewise.kit.settings import SPECS

    add_common(p)
    p.add_argument("--out", metavar="FILE", required=True, help="the Parquet file to write")
    p.add_argument("--topic", default=SAMPLES.name, metavar="TOPIC",
                   help="the topic of HostSamples records to record (default %(default)s)")
    p.add_argument("--jobs-topic", default=JOB_EVENTS.name, metavar="TOPIC",
                   help="job events: each container's job, its command and the progress it reported "
                        "(default %(default)s; 'none': skip)")
    p.add_argument("--since", metavar="WHEN", type=arg_type(_since),
                   help="from the first record stamped at or after WHEN: a duration back (10m, 2h, 1d) or an ISO "
                        "time (2026-01-01T12:00:00Z); default: the topic's beginning (with --duration: now)")
    p.add_argument("--until", metavar="WHEN", type=arg_type(_since),
                   help="leave out records stamped after WHEN (same forms as --since)")
    p.add_argument("--duration", metavar="D", type=arg_type(_duration, above(0), name="duration"),
                   help="keep recording new records for D (90s, 10m, 2h) instead of stopping at the topic's end; "
                        "with --sample-host: sample for D")
    p.add_argument("--max-records", metavar="N", type=arg_type(parse_int, at_least(1)),
                   help="stop after N samples messages (one per host per tick)")
    p.add_argument("--sample-host", action="store_true",
                   help="sample this host's containers directly with the host agent's sampler (its cgroup "
                        "settings; --host names it) instead of reading a topic: no Kafka")
    for name in ("interval_s", "cgroup_root", "cgroup_prefix", "cgroup_layout", "cgroup_parent"):
        add_setting(p, name, help=f"--sample-host: {SPECS[name].help}")
    p.add_argument("--context", metavar="JSON_FILE",
                   help="a JSON object kept in the header as 'context': what the recording is for and where it "
                        "was made (the machine, its load, the experiment)")
    p.add_argument("--timeout", type=arg_type(parse_float, above(0)), default=10.0, metavar="SECONDS",
                   help="give up when no broker answers, or no records come, for this long (default 10)")


#: the flags record_command writes, in order (the cgroup ones only with --sample-host)
_FLAGS = ("out", "topic", "jobs_topic", "since", "until", "duration", "max_records", "sample_host", "context",
          "bootstrap", "host", "interval_s", "cgroup_root", "cgroup_prefix", "cgroup_layout", "cgroup_parent")


def record_command(args: argparse.Namespace, raw: dict[str, str] | None = None) -> list[str]:
    """The command line that records the same again, as the header keeps it: the flags given.

    >>> ns = argparse.Namespace(out="run.parquet", topic=SAMPLES.name, jobs_topic=JOB_EVENTS.name, since=None,
    ...                         until=None, duration=600.0, max_records=None, sample_host=False, bootstrap=None)
    >>> record_command(ns, {"duration": "10m"})
    ['phasewise', 'record', '--out', 'run.parquet', '--duration', '10m']
    """
    from phasewise.kit.settings import SPECS

    raw = raw or {}
    out = ["phasewise", "record"]
    for name in _FLAGS:
        v = getattr(args, name, None)
        if v is None or v is False or (name == "topic" and v == SAMPLES.name) or \
                (name == "jobs_topic" and v == JOB_EVENTS.name):
            continue
        flag = "--" + name.replace("_", "-")
        out.append(SPECS[name].flag or flag if name in SPECS else flag)
        if v is not True:
            out.append(raw.get(name, str(v)))
    return out


def _raw_flags() -> dict[str, str]:
    """The text each flag was given as (``10m``, not 600.0), from the process's command line."""
    raw: dict[str, str] = {}
    argv = sys.argv[1:]
    for i, a in enumerate(argv):
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            if eq:
                raw[name.replace("-", "_")] = value
            elif i + 1 < len(argv):
                raw[name.replace("-", "_")] = argv[i + 1]
    return raw


def run(args: argparse.Namespace) -> int:
    from phasewise.apps.record.tracefile import Recorder, RecordingError, pyarrow_or_error
    from phasewise.kit.command import settings_from_args, stop_on_signals

    prog = "phasewise record"
    try:
        pyarrow_or_error()  # before minutes of recording, not after
    except RecordingError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser()
    if out.is_dir() or not out.parent.is_dir():
        print(f"{prog}: error: --out: {'is a folder' if out.is_dir() else f'no folder {out.parent}'}",
              file=sys.stderr)
        return 2
    if args.since is not None and args.until is not None and args.until < args.since:
        print(f"{prog}: error: --until: before --since", file=sys.stderr)
        return 2
    if args.sample_host and (args.since is not None or args.until is not None):
        print(f"{prog}: error: --since/--until: read a topic; --sample-host samples from now", file=sys.stderr)
        return 2
    if args.duration is not None and args.until is not None:
        print(f"{prog}: error: --duration: goes with --since, not --until", file=sys.stderr)
        return 2
    context = None
    if getattr(args, "context", None):
        try:
            context = _read_context(Path(args.context).expanduser())
        except ValueError as e:
            print(f"{prog}: error: --context: {e}", file=sys.stderr)
            return 2
    settings = settings_from_args(args)
    if settings.log_level != "debug":
        logging.getLogger("phasewise.kafka.client").setLevel(logging.ERROR)
    recorder = Recorder()
    stop = threading.Event()
    with stop_on_signals(stop):
        if args.duration is not None:
            timer = threading.Timer(args.duration, stop.set)
            timer.daemon = True
            timer.start()
        if args.sample_host:
            status, source = _sample(settings, args, recorder, stop, prog)
        else:
            status, source = _read(settings, args, recorder, stop, prog)
    if status is not None:
        return status
    if recorder.rows == 0:
        where = source.get("topic") or f"the containers under {source.get('cgroup_root')}"
        print(f"{prog}: no container samples from {where} ({recorder.messages} samples messages, "
              f"{recorder.undecodable} undecodable): nothing written", file=sys.stderr)
        return 1
    try:
        header = recorder.write(out, source=source, command=record_command(args, _raw_flags()), context=context)
    except RecordingError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    span = header["span"]
    interval = header["interval_s"]
    print(f"recorded {recorder.rows} samples of {len(header['containers'])} containers on {len(header['hosts'])} "
          f"host(s) over {span['seconds']:.1f} s (one every {interval:.3g} s) to {out} ({out.stat().st_size} bytes); "
          f"{header['records']['jobs_described']} job(s) described" if interval else
          f"recorded {recorder.rows} samples of {len(header['containers'])} containers to {out}")
    if recorder.undecodable:
        reasons = "; ".join(f"{n}x {r}" for r, n in recorder.reasons.most_common(3))
        print(f"{prog}: {recorder.undecodable} record(s) did not decode and are not in the file (counted in its "
              f"header): {reasons}", file=sys.stderr)
    return 0


def _read_context(path: Path) -> dict[str, Any]:
    """The ``--context`` file's JSON object; ValueError (one line) when it is not one."""
    import json

    try:
        value = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: not JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ValueError(f"{path}: holds NaN or infinity, which the header's JSON cannot") from None
    return value


def _read(settings: Any, args: argparse.Namespace, recorder: Any, stop: threading.Event,
          prog: str) -> tuple[int | None, dict[str, Any]]:
    from phasewise.apps.jobs.read import Reader, ReadError
    from phasewise.kit import records as R
    from phasewise.kit.kafka.client import BrokerUnavailable

    since = args.since if args.since is not None or args.duration is None else time.time()
    source: dict[str, Any] = {"kind": "topic", "bootstrap": settings.kafka.bootstrap, "topic": args.topic,
                              "since": since, "until": args.until, "follow_s": args.duration}
    try:
        with Reader(settings, timeout_s=args.timeout) as reader:
            if reader.partitions(args.topic) is None:
                print(f"{prog}: topic {args.topic} does not exist on {settings.kafka.bootstrap} "
                      "(create the topics: phasewise topics)", file=sys.stderr)
                return 1, source
            for msg in reader.read([args.topic], since=since, follow=args.duration is not None, stop=stop):
                if args.until is not None and msg.timestamp is not None and msg.timestamp > args.until:
                    continue
                if msg.value is None:
                    recorder.refuse("HostSamples: the record has no value (null, e.g. a tombstone)")
                    continue
                try:
                    samples = R.decode_host_samples(msg.value)
                except R.SchemaError as e:
                    recorder.refuse(str(e)[:300])
                    continue
                if args.until is not None and msg.timestamp is None and samples.ts > args.until:
                    continue
                recorder.add_samples(samples, partition=msg.partition, offset=msg.offset)
                if args.max_records is not None and recorder.messages >= args.max_records:
                    break
            jobs = args.jobs_topic if args.jobs_topic != "none" else None
            source["jobs_topic"] = jobs
            if jobs is not None and reader.partitions(jobs) is None:
                source["jobs_topic"] = None
                print(f"{prog}: note: no topic {jobs}: containers are recorded without their jobs", file=sys.stderr)
            elif jobs is not None and recorder.rows:
                for msg in reader.read([jobs]):  # from the beginning: a job's submission precedes its samples
                    try:
                        recorder.add_job_event(R.decode(R.JobEvent, msg.value))
                    except R.SchemaError:
                        continue  # the header describes what it can; the samples are the recording
    except BrokerUnavailable as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1, source
    except ReadError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1, source
    return None, source


def _sample(settings: Any, args: argparse.Namespace, recorder: Any, stop: threading.Event,
            prog: str) -> tuple[int | None, dict[str, Any]]:
    from phasewise.kit.cgroups.fs import CgroupError
    from phasewise.kit.cgroups.workloads import layout_from_settings, workloads_from_settings
    from phasewise.models.safety.workload import WorkloadError
    from phasewise.producers.sampler import HostSampler

    try:
        layout = layout_from_settings(settings)
        workloads = workloads_from_settings(settings, layout)
    except CgroupError as e:
        print(f"{prog}: error: cgroup_root: {e}", file=sys.stderr)
        return 2, {}
    except WorkloadError as e:
        print(f"{prog}: error: workload_policy_file: {e}", file=sys.stderr)
        return 2, {}
    interval = settings.producer.interval_s
    source: dict[str, Any] = {"kind": "host", "host": settings.host, "cgroup_root": str(layout.root),
                              "cgroup_prefix": layout.prefix, "cgroup_layout": layout.layout,
                              "cgroup_version": layout.version, "interval_s": interval}
    sampler = HostSampler(layout, proc_root=settings.producer.proc_root, host=settings.host, workloads=workloads)
    print(f"{prog}: sampling the containers under {layout.root} (prefix {layout.prefix!r}) every {interval:g} s"
          + ("" if args.duration or args.max_records else " until interrupted"), file=sys.stderr, flush=True)
    try:
        sampler.sample()  # the baseline: counters, no interval yet
        start = time.monotonic()
        k = 0
        while not stop.is_set():
            k += 1
            if stop.wait(max(0.0, start + k * interval - time.monotonic())):
                break
            recorder.add_samples(sampler.sample())
            if args.max_records is not None and recorder.messages >= args.max_records:
                break
    finally:
        sampler.close()
    return None, source
