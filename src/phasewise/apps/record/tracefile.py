"""The recording file: one Parquet row per container per sample, and a provenance header (the file's
key-value metadata, JSON under :data:`METADATA_KEY`) naming the hosts, the time span, the sampling
interval, each container's identity and, where known, its job, the job's command and the stages it
reported through the progress channel, the phasewise version and the command line.

:class:`Recorder` folds decoded records into rows and provenance (no IO until :meth:`Recorder.write`);
:func:`read_recording` checks a file and gives its series back, with what it dropped or doubts counted
in notes (clock steps back, gaps, containers the header does not describe). pyarrow (the ``record``
extra) is imported only to write or read. Narrative: docs/results.md, "Record your own cluster".
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from phasewise import __version__
from phasewise.kit.records import HostSamples, JobEvent, to_dict

__all__ = ["COLUMNS", "FORMAT", "GAP_FACTOR", "MAX_STAGES", "METADATA_KEY", "VERSION", "Recorder", "Recording",
           "RecordingError", "pyarrow_or_error", "read_recording"]

#: the provenance header's key in the Parquet key-value metadata, and the format it names
METADATA_KEY = b"phasewise.recording"
FORMAT = "phasewise-recording"
VERSION = 1
#: a job's progress points kept in the header (the first ones; the header counts them all)
MAX_STAGES = 1000
#: a job's other events (started, finished, ...) kept in the header
MAX_EVENTS = 100
#: a step between a container's samples longer than this many sampling intervals is a gap
GAP_FACTOR = 3.0
#: undecodable records: the reasons kept (the count is of all)
MAX_REASONS = 20

#: column -> (arrow type name, nullable); the order they are written in
COLUMNS: dict[str, tuple[str, bool]] = {
    "host": ("string", False),
    "ts": ("float64", False),
    "interval_s": ("float64", False),
    "container": ("string", False),
    "cpu_cores": ("float64", False),
    "mem_bytes": ("float64", False),
    "cpu_limit_cores": ("float64", True),
    "mem_limit_bytes": ("float64", True),
    "throttled_periods": ("int64", False),
    "nr_periods": ("int64", False),
    "throttled_s": ("float64", False),
    "oom_events": ("int64", False),
    "gpu_util": ("float64", True),
    "gpu_mem_bytes": ("float64", True),
    "job": ("string", True),
    "partition": ("int32", True),
    "offset": ("int64", True),
}
#: the columns replay needs
REQUIRED = ("host", "ts", "container", "cpu_cores", "mem_bytes")


class RecordingError(ValueError):
    """A recording cannot be written or read: one line says why."""


def pyarrow_or_error() -> Any:
    """pyarrow, or :class:`RecordingError` saying which extra installs it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise RecordingError("pyarrow is not installed: pip install 'phasewise[record]' (Parquet recordings)") \
            from None
    return pyarrow


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


@dataclass
class _Host:
    ticks: int = 0
    first: float = math.inf
    last: float = -math.inf
    previous: float | None = None
    steps_back: int = 0
    intervals: list[float] = field(default_factory=list)


@dataclass
class _Container:
    host: str
    name: str
    samples: int = 0
    first: float = math.inf
    last: float = -math.inf
    identity: dict | None = None
    workload: dict | None = None
    job: str | None = None


@dataclass
class _Job:
    command: list[str] | None = None
    model: str | None = None
    dataset: str | None = None
    workload: str | None = None
    stages: list[dict] = field(default_factory=list)
    stages_total: int = 0
    events: list[dict] = field(default_factory=list)
    placed: set[tuple[str, str]] = field(default_factory=set)


class Recorder:
    """Samples and job events in, rows and a provenance header out.

    >>> from phasewise.kit.records import ContainerSample, HostSamples
    >>> r = Recorder()
    >>> for t in (10.0, 11.0, 12.0):
    ...     r.add_samples(HostSamples(host="h", ts=t, interval_s=1.0,
    ...                               containers=(ContainerSample(container="c", cpu_cores=0.5, mem_bytes=1e6),)))
    >>> r.rows, r.provenance(source={"kind": "test"}, command=["phasewise", "record"])["interval_s"]
    (3, 1.0)
    """

    def __init__(self) -> None:
        self.columns: dict[str, list] = {c: [] for c in COLUMNS}
        self.hosts: dict[str, _Host] = {}
        self.containers: dict[tuple[str, str], _Container] = {}
        self.jobs: dict[str, _Job] = {}
        self.messages = 0
        self.undecodable = 0
        self.reasons: Counter[str] = Counter()
        self.job_events = 0

    @property
    def rows(self) -> int:
        return len(self.columns["host"])

    def add_samples(self, msg: HostSamples, *, partition: int | None = None, offset: int | None = None) -> None:
        """One host's tick: a row per container."""
        self.messages += 1
        h = self.hosts.setdefault(msg.host, _Host())
        h.ticks += 1
        h.first, h.last = min(h.first, msg.ts), max(h.last, msg.ts)
        if h.previous is not None and msg.ts <= h.previous:
            h.steps_back += 1
        h.previous = msg.ts
        if msg.interval_s > 0:
            h.intervals.append(msg.interval_s)
        col = self.columns
        for c in msg.containers:
            job = c.workload.job if c.workload is not None else None
            who = self.containers.get((msg.host, c.container))
            if who is None:
                who = self.containers[(msg.host, c.container)] = _Container(msg.host, c.container)
            who.samples += 1
            who.first, who.last = min(who.first, msg.ts), max(who.last, msg.ts)
            if c.identity is not None:
                who.identity = to_dict(c.identity)
            if c.workload is not None:
                who.workload = to_dict(c.workload)
            who.job = job or who.job
            for name, value in (("host", msg.host), ("ts", msg.ts), ("interval_s", msg.interval_s),
                                ("container", c.container), ("cpu_cores", c.cpu_cores), ("mem_bytes", c.mem_bytes),
                                ("cpu_limit_cores", c.cpu_limit_cores), ("mem_limit_bytes", c.mem_limit_bytes),
                                ("throttled_periods", c.throttled_periods), ("nr_periods", c.nr_periods),
                                ("throttled_s", c.throttled_s), ("oom_events", c.oom_events),
                                ("gpu_util", c.gpu_util), ("gpu_mem_bytes", c.gpu_mem_bytes), ("job", job),
                                ("partition", partition), ("offset", offset)):
                col[name].append(value)

    def add_job_event(self, ev: JobEvent) -> None:
        """A job's submission (its command), placement (its container), progress (its stages) or state."""
        self.job_events += 1
        j = self.jobs.setdefault(ev.job, _Job())
        if ev.kind == "submitted" and ev.spec is not None:
            j.command = list(ev.spec.command) or None
            j.model, j.dataset, j.workload = ev.spec.model, ev.spec.dataset, ev.workload
        elif ev.kind == "progress":
            j.stages_total += 1
            if len(j.stages) < MAX_STAGES:
                point = {"ts": ev.ts, "stage": ev.stage, "step": ev.step, "epoch": ev.epoch, "loss": ev.loss,
                         "metric": ev.metric, "metric_name": ev.metric_name}
                j.stages.append({k: v for k, v in point.items() if v is not None})
            return
        if ev.kind == "started" and ev.host and ev.container:
            j.placed.add((ev.host, ev.container))
        if len(j.events) < MAX_EVENTS:
            point = {"ts": ev.ts, "kind": ev.kind, "host": ev.host, "container": ev.container,
                     "exit_code": ev.exit_code, "reason": ev.reason}
            j.events.append({k: v for k, v in point.items() if v is not None})

    def refuse(self, reason: str) -> None:
        """A record that did not decode: counted, its reason kept (the first :data:`MAX_REASONS` kinds)."""
        self.undecodable += 1
        if reason in self.reasons or len(self.reasons) < MAX_REASONS:
            self.reasons[reason] += 1

    def _job_of(self, key: tuple[str, str], who: _Container) -> str | None:
        if who.job:
            return who.job
        host, name = key
        for job, j in self.jobs.items():  # placed there by an actuator (the started event names it)
            if any(h == host and (c == name or c.endswith("/" + name) or name.endswith("/" + c)) for h, c in j.placed):
                return job
        return None

    def provenance(self, *, source: dict[str, Any], command: list[str],
                   context: dict[str, Any] | None = None) -> dict[str, Any]:
        """The header: what was recorded, from where, by which command; *context*: what the person recording
        adds (the machine, its load, the experiment), kept as it is under ``context``."""
        ts = self.columns["ts"]
        start, end = (min(ts), max(ts)) if ts else (None, None)
        intervals = [i for h in self.hosts.values() for i in h.intervals]
        containers, used = [], set()
        for key in sorted(self.containers):
            who = self.containers[key]
            job = self._job_of(key, who)
            entry: dict[str, Any] = {"host": who.host, "container": who.name, "identity": who.identity,
                                     "workload": who.workload, "job": job, "samples": who.samples,
                                     "first_ts": who.first, "last_ts": who.last}
            if job is not None and job in self.jobs:
                used.add(job)
                j = self.jobs[job]
                entry.update({"command": j.command, "model": j.model, "dataset": j.dataset,
                              "stages": j.stages, "stages_total": j.stages_total, "events": j.events})
            containers.append(entry)
        return {
            "format": FORMAT, "version": VERSION, "phasewise_version": __version__, "command": list(command),
            **({"context": context} if context is not None else {}),
            "created": _iso(datetime.now(UTC).timestamp()), "source": source,
            "hosts": {name: {"ticks": h.ticks, "first_ts": h.first, "last_ts": h.last,
                             "interval_s": statistics.median(h.intervals) if h.intervals else None,
                             "clock_steps_back": h.steps_back}
                      for name, h in sorted(self.hosts.items())},
            "span": {"start": start, "end": end, "seconds": None if start is None else end - start,
                     "start_utc": _iso(start), "end_utc": _iso(end)},
            "interval_s": statistics.median(intervals) if intervals else None,
            "containers": containers,
            "records": {"samples_messages": self.messages, "rows": self.rows, "job_events": self.job_events,
                        "jobs_described": len(used), "undecodable": self.undecodable,
                        "undecodable_reasons": dict(self.reasons)},
        }

    def write(self, path: str | Path, *, source: dict[str, Any], command: list[str],
              context: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the rows and the header to *path* (Parquet, zstd); returns the header."""
        pa = pyarrow_or_error()
        import pyarrow.parquet as pq

        header = self.provenance(source=source, command=command, context=context)
        jobs = {(c["host"], c["container"]): c["job"] for c in header["containers"]}
        self.columns["job"] = [job or jobs.get((h, c)) for h, c, job in  # the job a started event named, too
                               zip(self.columns["host"], self.columns["container"], self.columns["job"])]
        schema = pa.schema([pa.field(name, getattr(pa, kind)(), nullable=nullable)
                            for name, (kind, nullable) in COLUMNS.items()],
                           metadata={METADATA_KEY: json.dumps(header, allow_nan=False).encode()})
        table = pa.table({name: pa.array(self.columns[name], type=schema.field(name).type) for name in COLUMNS},
                         schema=schema)
        path = Path(path)
        tmp = path.with_name(path.name + ".part")
        try:
            pq.write_table(table, tmp, compression="zstd")
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise RecordingError(f"{path}: cannot write: {e.strerror or e}") from None
        return header


# ---------------------------------------------------------------- reading


@dataclass
class Recording:
    """A recording as replay takes it: per container (``host/container``) its times and usage, the header,
    and what reading dropped or doubts (``notes``, ``counts``)."""

    header: dict[str, Any]
    series: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]
    notes: list[str]
    counts: dict[str, int]


#: replay resource -> column
RESOURCES = {"cpu": "cpu_cores", "mem": "mem_bytes", "gpu": "gpu_util", "gpu_mem": "gpu_mem_bytes"}


def _header(path: Path, metadata: dict[bytes, bytes] | None) -> dict[str, Any]:
    raw = (metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise RecordingError(f"{path}: a Parquet file without phasewise's provenance header (key "
                             f"{METADATA_KEY.decode()}): not written by phasewise record")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise RecordingError(f"{path}: the provenance header is not JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RecordingError(f"{path}: the provenance header names no {FORMAT} format")
    if header.get("version") != VERSION:
        raise RecordingError(f"{path}: recording version {header.get('version')!r}; this phasewise "
                             f"({__version__}) reads version {VERSION}")
    return header


def read_recording(path: str | Path) -> Recording:
    """Read and check a recording; :class:`RecordingError` (one line) when it is not one.

    Per container, the rows in the order recorded: a sample stamped at or before the container's
    previous one (a clock stepped back, or a record read twice) is dropped and counted; steps longer
    than :data:`GAP_FACTOR` sampling intervals are counted as gaps (replay scores the samples on
    either side as consecutive); containers the header does not describe, or describes without an
    identity, are counted. Rows without a host, time or container, or with a time that is no
    number, are dropped and counted.
    """
    path = Path(path)
    if path.is_dir():
        raise RecordingError(f"{path}: is a folder; --format phasewise reads one file (phasewise record --out FILE)")
    if not path.is_file():
        raise RecordingError(f"{path}: no such file")
    pyarrow_or_error()
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        header = _header(path, pf.schema_arrow.metadata)
        names = set(pf.schema_arrow.names)
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            raise RecordingError(f"{path}: missing column(s) {missing}; found {sorted(names)}")
        wanted = [c for c in (*REQUIRED, "gpu_util", "gpu_mem_bytes", "interval_s") if c in names]
        table = pf.read(columns=wanted)
    except (pa.ArrowException, OSError) as e:
        raise RecordingError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    cols: dict[str, np.ndarray] = {}
    for c in wanted:
        try:
            arr = table.column(c)
            if c in ("host", "container"):
                cols[c] = np.asarray(arr.to_pylist(), dtype=object)
            else:
                cols[c] = np.asarray(arr.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
        except (pa.ArrowException, ValueError) as e:
            raise RecordingError(f"{path}: column {c!r} is not {'text' if c in ('host', 'container') else 'numbers'}"
                                 f" ({str(e).splitlines()[0]})") from None
    return _fold(header, cols)


def _fold(header: dict[str, Any], cols: dict[str, np.ndarray]) -> Recording:
    n = len(cols["ts"])
    counts: Counter[str] = Counter()
    notes: list[str] = []
    by: dict[str, list[int]] = {}
    for i in range(n):
        host, name, t = cols["host"][i], cols["container"][i], cols["ts"][i]
        if not host or not name or not math.isfinite(t):
            counts["rows_incomplete"] += 1
            continue
        by.setdefault(f"{host}/{name}", []).append(i)
    if counts["rows_incomplete"]:
        notes.append(f"{counts['rows_incomplete']} row(s) without a host, container or finite time dropped")
    known = {f"{c.get('host')}/{c.get('container')}": c for c in header.get("containers") or []
             if isinstance(c, dict)}
    host_interval = {h: (v or {}).get("interval_s") for h, v in (header.get("hosts") or {}).items()
                     if isinstance(v, dict)}
    series: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
    stepped_back: Counter[str] = Counter()
    gaps, gap_containers, longest = 0, 0, 0.0
    unknown: list[str] = []
    anonymous: list[str] = []
    for cid in sorted(by):
        rows = by[cid]
        keep, last = [], -math.inf
        for i in rows:
            if cols["ts"][i] <= last:
                stepped_back[cols["host"][i]] += 1
                continue
            keep.append(i)
            last = cols["ts"][i]
        idx = np.asarray(keep, dtype=np.int64)
        t = cols["ts"][idx]
        usage = {r: cols[c][idx] for r, c in RESOURCES.items() if c in cols and not np.all(np.isnan(cols[c][idx]))}
        host = cols["host"][rows[0]]
        interval = host_interval.get(host)
        if not (isinstance(interval, (int, float)) and interval > 0) and "interval_s" in cols:
            ok = cols["interval_s"][idx]
            ok = ok[np.isfinite(ok) & (ok > 0)]
            interval = float(np.median(ok)) if len(ok) else None
        if interval and len(t) > 1:
            steps = np.diff(t)
            long = steps > GAP_FACTOR * interval
            if long.any():
                gaps += int(long.sum())
                gap_containers += 1
                longest = max(longest, float(steps.max()))
        if cid not in known:
            unknown.append(cid)
        elif not known[cid].get("identity"):
            anonymous.append(cid)
        series[cid] = (t, usage)
    if stepped_back:
        total = sum(stepped_back.values())
        counts["clock_steps_back"] = total
        hosts = ", ".join(f"{h} ({k})" for h, k in sorted(stepped_back.items()))
        notes.append(f"{total} sample(s) stamped at or before their container's previous one dropped (a clock "
                     f"stepped back, or a record read twice): {hosts}")
    if gaps:
        counts["gaps"] = gaps
        notes.append(f"{gaps} gap(s) longer than {GAP_FACTOR:g} sampling intervals in {gap_containers} "
                     f"container(s) (longest {longest:.3g} s): the samples on either side are scored as consecutive")
    if unknown:
        counts["unknown_containers"] = len(unknown)
        notes.append(f"{len(unknown)} container(s) with samples but no entry in the provenance header (identity and "
                     f"job unknown), e.g. {_first(unknown)}")
    if anonymous:
        counts["containers_without_identity"] = len(anonymous)
        notes.append(f"{len(anonymous)} container(s) the host agent could not identify (no identity in the header), "
                     f"e.g. {_first(anonymous)}")
    bad = (header.get("records") or {}).get("undecodable")
    if isinstance(bad, int) and bad:
        counts["undecodable_at_record"] = bad
        notes.append(f"{bad} record(s) on the topic did not decode when it was recorded (not in the file)")
    return Recording(header, series, notes, dict(counts))


def _first(items: Iterable[str], k: int = 3) -> str:
    items = list(items)
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")
