"""Load real usage traces (``ai4dl``, ``genai2026``) and phasewise's own recordings (``phasewise``, written
by ``phasewise record``) into per-container time series for replay; the AI4DL sample phasewise ships.

Loaders are pure file readers: missing, negative and non-finite values are
counted in :attr:`Trace.notes`, and a bad file raises
:class:`TraceFormatError` naming the file and what is wrong. The layouts and
the alignment rules: docs/results.md, "How replay runs".
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "FORMATS",
    "GENAI_FILES",
    "ContainerSeries",
    "Trace",
    "TraceFormatError",
    "load_ai4dl",
    "load_genai2026",
    "load_phasewise",
    "load_trace",
    "sample_path",
    "subtrace",
]

#: format name -> one-line description
FORMATS: dict[str, str] = {
    "ai4dl": "AI4DL / IBM DLaaS CSV (timestamp, service, pod.id, cpu.usage.cores, mem.working.set)",
    "genai2026": "folder with Alibaba GenAI 2026 per-pod files (gpu duty cycle, gpu memory, memory util)",
    "phasewise": "a Parquet file written by phasewise record (your own cluster's samples, with provenance)",
}

#: genai2026 resource -> file stem (each read as <stem>.csv or <stem>.csv.gz)
GENAI_FILES: dict[str, str] = {
    "gpu": "pod_gpu_duty_cycle_anon",
    "gpu_mem": "pod_gpu_memory_used_bytes_anon",
    "mem": "pod_memory_util_anon",
}

AI4DL_COLUMNS: dict[str, str] = {"cpu": "cpu.usage.cores", "mem": "mem.working.set"}
AI4DL_KEYS = ("timestamp", "service", "pod.id")
GENAI_COLUMNS = ("value", "timestamp_anon", "container_ip")

_MISSING = {"", "na", "null", "none"}


class TraceFormatError(ValueError):
    """A trace file is missing, empty or not in the layout its format names."""


@dataclass(frozen=True)
class ContainerSeries:
    """One container's usage over time.

    ``t`` holds strictly increasing timestamps (seconds, float64); each array in
    ``usage`` has the same length, ``NaN`` where that resource has no value.
    """

    container: str
    t: np.ndarray
    usage: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.t)

    def valid(self, resource: str) -> np.ndarray:
        """Boolean mask of the steps where *resource* has a value."""
        u = self.usage.get(resource)
        if u is None:
            return np.zeros(len(self.t), dtype=bool)
        return ~np.isnan(u)


@dataclass(frozen=True)
class Trace:
    """A loaded trace: its containers, units per resource and loading notes."""

    format: str
    source: str
    units: dict[str, str]
    containers: list[ContainerSeries]
    notes: list[str] = field(default_factory=list)
    #: what loading changed, counted: ``{"negative_clipped": {"file column": n}, "non_finite_missing": {...}}``
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the timestamps' unit
    time_unit: str = "seconds"

    @property
    def resources(self) -> list[str]:
        return list(self.units)

    def n_samples(self) -> int:
        return sum(len(c) for c in self.containers)


# ---------------------------------------------------------------- helpers


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="", encoding="utf-8")
    return open(path, newline="", encoding="utf-8")


def _float(cell: str, path: Path, line: int, column: str) -> float:
    """The cell's number; ``NaN`` for an empty/NA cell; NaN and infinities as written (see :class:`_Cleaning`)."""
    s = cell.strip()
    if s.lower() in _MISSING:
        return math.nan
    try:
        return float(s)
    except ValueError:
        raise TraceFormatError(f"{path}: line {line}: column {column!r} is not a number: {cell!r}") from None


def _time(cell: str, path: Path, line: int, column: str) -> float:
    t = _float(cell, path, line, column)
    if math.isnan(t):
        raise TraceFormatError(f"{path}: line {line}: empty {column}")
    if math.isinf(t):
        raise TraceFormatError(f"{path}: line {line}: column {column!r} is infinite: {cell!r}")
    return t


def _rows(path: Path, required: Iterable[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, {column: cell}) for each data row; checks the header.

    Accepts a leading index column without a header name (one field more per
    row than the header, as R writes it) or with an empty name (pandas).
    """
    if not path.is_file():
        raise TraceFormatError(f"{path}: no such file")
    required = list(required)
    try:
        with _open_text(path) as fh:
            reader = csv.reader(fh)
            try:
                header = next(reader)
            except StopIteration:
                raise TraceFormatError(f"{path}: empty file (no header line)") from None
            header = [h.strip() for h in header]
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceFormatError(
                    f"{path}: missing column(s) {missing}; found {header}"
                )
            idx = {c: header.index(c) for c in required}
            n_rows = 0
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) == len(header) + 1:  # unnamed leading index column (R)
                    row = row[1:]
                elif len(row) != len(header):
                    raise TraceFormatError(
                        f"{path}: line {line}: {len(row)} fields, header has {len(header)}"
                    )
                n_rows += 1
                yield line, {c: row[i] for c, i in idx.items()}
            if n_rows == 0:
                raise TraceFormatError(f"{path}: no data rows after the header")
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, csv.Error) as e:
        raise TraceFormatError(f"{path}: not a readable CSV file ({e})") from e


class _Cleaning:
    """Usage values as replay takes them, counted per source (file and column).

    Negative values are clipped to 0 (with the lowest seen); NaN and
    infinite values written in the file become missing values.

    >>> c = _Cleaning()
    >>> [c.cell(v, Path("f.csv"), 2, "value", "f.csv value") for v in ("1.5", "-0.25", "NaN", "inf", "")]
    [1.5, 0.0, nan, nan, nan]
    >>> for note in c.notes():
    ...     print(note)
    f.csv value: 1 negative value(s) clipped to 0 (lowest -0.25)
    f.csv value: 2 NaN/infinite value(s) treated as missing (1 NaN, 1 infinite)
    >>> c.counts()
    {'negative_clipped': {'f.csv value': 1}, 'non_finite_missing': {'f.csv value': 2}}
    """

    def __init__(self) -> None:
        self.negative: dict[str, int] = {}
        self.lowest: dict[str, float] = {}
        self.nan: dict[str, int] = {}
        self.inf: dict[str, int] = {}

    def value(self, v: float, name: str) -> float:
        if math.isnan(v):
            return v  # an empty/NA cell (counted by the caller's missing-value rules) or a written NaN
        if math.isinf(v):
            self.inf[name] = self.inf.get(name, 0) + 1
            return math.nan
        if v < 0:
            self.negative[name] = self.negative.get(name, 0) + 1
            self.lowest[name] = min(self.lowest.get(name, 0.0), v)
            return 0.0
        return v

    def written_nan(self, name: str) -> float:
        self.nan[name] = self.nan.get(name, 0) + 1
        return math.nan

    def cell(self, cell: str, path: Path, line: int, column: str, name: str) -> float:
        """Parse a usage cell: empty/NA -> missing (not counted), NaN/inf -> missing (counted), < 0 -> 0."""
        v = _float(cell, path, line, column)
        if math.isnan(v) and cell.strip().lower() not in _MISSING:
            return self.written_nan(name)
        return self.value(v, name)

    def notes(self) -> list[str]:
        out = [f"{name}: {n} negative value(s) clipped to 0 (lowest {self.lowest[name]:.3g})"
               for name, n in self.negative.items()]
        for name in dict.fromkeys([*self.nan, *self.inf]):
            a, b = self.nan.get(name, 0), self.inf.get(name, 0)
            out.append(f"{name}: {a + b} NaN/infinite value(s) treated as missing ({a} NaN, {b} infinite)")
        return out

    def counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        if self.negative:
            out["negative_clipped"] = dict(self.negative)
        bad = {n: self.nan.get(n, 0) + self.inf.get(n, 0) for n in dict.fromkeys([*self.nan, *self.inf])}
        if bad:
            out["non_finite_missing"] = bad
        return out


def _assemble(
    points: dict[str, dict[float, dict[str, list[float]]]], resources: list[str]
) -> tuple[list[ContainerSeries], int]:
    """container -> t -> resource -> values  =>  aligned ContainerSeries.

    Returns the series (sorted by container id) and how many duplicate
    (container, t, resource) values were averaged.
    """
    out: list[ContainerSeries] = []
    dups = 0
    for cid in sorted(points):
        by_t = points[cid]
        ts = sorted(by_t)
        t = np.asarray(ts, dtype=np.float64)
        usage = {r: np.full(len(ts), np.nan) for r in resources}
        for i, ti in enumerate(ts):
            for r, vals in by_t[ti].items():
                vals = [v for v in vals if not math.isnan(v)]
                if not vals:
                    continue
                if len(vals) > 1:
                    dups += len(vals) - 1
                usage[r][i] = sum(vals) / len(vals)
        # keep only the resources this container ever reports
        usage = {r: u for r, u in usage.items() if not np.all(np.isnan(u))}
        if usage:
            out.append(ContainerSeries(cid, t, usage))
    return out, dups


# ---------------------------------------------------------------- loaders


def load_ai4dl(path: str | Path) -> Trace:
    """Read an AI4DL / IBM DLaaS CSV (docs/results.md, "How replay runs").

    >>> from importlib.resources import files
    >>> tr = load_ai4dl(files("phasewise") / "data" / "ai4dl_sample.csv")
    >>> [(c.container, len(c)) for c in tr.containers]
    [('service1/exec1', 65), ('service1/exec2', 52), ('service1/exec3', 59), ('service1/exec4', 28)]
    >>> tr.units
    {'cpu': 'cores', 'mem': 'bytes (working set)'}
    """
    path = Path(path)
    if path.is_dir():
        raise TraceFormatError(f"{path}: is a folder; --format ai4dl reads one CSV file")
    resources = list(AI4DL_COLUMNS)
    clean = _Cleaning()
    points: dict[str, dict[float, dict[str, list[float]]]] = {}
    for line, row in _rows(path, [*AI4DL_KEYS, *AI4DL_COLUMNS.values()]):
        t = _time(row["timestamp"], path, line, "timestamp")
        pod = row["pod.id"].strip()
        if not pod:
            raise TraceFormatError(f"{path}: line {line}: empty pod.id")
        cid = f"{row['service'].strip()}/{pod}"
        slot = points.setdefault(cid, {}).setdefault(t, {})
        for r, col in AI4DL_COLUMNS.items():
            v = clean.cell(row[col], path, line, col, f"{path.name} {col}")
            slot.setdefault(r, []).append(v)
    containers, dups = _assemble(points, resources)
    notes = [f"{dups} duplicate (container, timestamp) values averaged"] if dups else []
    notes += clean.notes()
    return Trace("ai4dl", str(path), {"cpu": "cores", "mem": "bytes (working set)"}, containers, notes,
                 clean.counts())


def _genai_file(folder: Path, stem: str) -> Path:
    for suffix in (".csv", ".csv.gz"):
        p = folder / f"{stem}{suffix}"
        if p.is_file():
            return p
    raise TraceFormatError(f"{folder}: missing {stem}.csv or {stem}.csv.gz")


def load_genai2026(folder: str | Path) -> Trace:
    """Read the three per-pod files of Alibaba's GenAI 2026 trace from *folder*.

    The ``mem`` resource stays the memory **utilisation fraction** the trace
    publishes (values scaled by the publisher); ``gpu`` is duty cycle in
    percent of one GPU, ``gpu_mem`` bytes.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceFormatError(f"{folder}: not a folder; --format genai2026 reads a folder holding "
                               + ", ".join(f"{s}.csv[.gz]" for s in GENAI_FILES.values()))
    files = {r: _genai_file(folder, stem) for r, stem in GENAI_FILES.items()}
    points: dict[str, dict[float, dict[str, list[float]]]] = {}
    unattributed: dict[str, int] = {}
    clean = _Cleaning()
    for r, path in files.items():
        for line, row in _rows(path, GENAI_COLUMNS):
            t = _time(row["timestamp_anon"], path, line, "timestamp_anon")
            cid = row["container_ip"].strip()
            if not cid:  # cannot be attributed to a pod: skipped and counted
                unattributed[path.name] = unattributed.get(path.name, 0) + 1
                continue
            v = clean.cell(row["value"], path, line, "value", path.name)
            points.setdefault(cid, {}).setdefault(t, {}).setdefault(r, []).append(v)
    containers, dups = _assemble(points, list(GENAI_FILES))
    notes = [
        ("mem is the memory utilisation fraction (0-1) as published, not bytes; "
         "values are scaled by the publisher (anonymisation)"),
        "timestamps are the publisher's anonymised time units (steps of 57)",
    ]
    for name, n in unattributed.items():
        notes.append(f"{name}: {n} rows with an empty container_ip skipped (no pod to attribute them to)")
    if dups:
        notes.append(f"{dups} duplicate (container, timestamp) values averaged")
    notes += clean.notes()
    units = {
        "gpu": "percent of one GPU (duty cycle)",
        "gpu_mem": "bytes (GPU memory used)",
        "mem": "fraction of the pod's memory (utilisation, 0-1)",
    }
    return Trace("genai2026", str(folder), units, containers, notes, clean.counts(),
                 time_unit="anonymised seconds (one sample every 57: about a minute)")


def load_phasewise(path: str | Path) -> Trace:
    """Read a recording written by ``phasewise record`` (docs/results.md, "Record your own cluster").

    Each container is ``host/container``; what the recording's reader dropped or doubts (clock steps back,
    gaps, containers its header does not describe) is in the notes and counts, and so are negative
    (clipped to 0) and infinite (missing) values a hand-edited file may hold.
    """
    from phasewise.apps.record.tracefile import RecordingError, read_recording

    try:
        rec = read_recording(path)
    except RecordingError as e:
        raise TraceFormatError(str(e)) from None
    name = Path(path).name
    negative: dict[str, int] = {}
    non_finite: dict[str, int] = {}
    containers = []
    for cid, (t, usage) in rec.series.items():
        clean = {}
        for r, u in usage.items():
            u = u.copy()
            inf, neg = np.isinf(u), u < 0
            if inf.any():
                non_finite[f"{name} {r}"] = non_finite.get(f"{name} {r}", 0) + int(inf.sum())
                u[inf] = np.nan
            if neg.any():
                negative[f"{name} {r}"] = negative.get(f"{name} {r}", 0) + int(neg.sum())
                u[neg] = 0.0
            clean[r] = u
        if clean and len(t):
            containers.append(ContainerSeries(cid, t, clean))
    notes = list(rec.notes)
    notes += [f"{k}: {n} negative value(s) clipped to 0" for k, n in negative.items()]
    notes += [f"{k}: {n} infinite value(s) treated as missing" for k, n in non_finite.items()]
    counts: dict[str, dict[str, int]] = {}
    if negative:
        counts["negative_clipped"] = negative
    if non_finite:
        counts["non_finite_missing"] = non_finite
    units = {"cpu": "cores", "mem": "bytes (working set)", "gpu": "percent (SM utilisation, summed over its GPUs)",
             "gpu_mem": "bytes (GPU memory used)"}
    present = {r for c in containers for r in c.usage}
    interval = rec.header.get("interval_s")
    return Trace("phasewise", str(path), {r: u for r, u in units.items() if r in present or r in ("cpu", "mem")},
                 containers, notes, counts,
                 time_unit="Unix seconds" + (f" (one sample every {interval:.3g} s)" if interval else ""))


_LOADERS: dict[str, Callable[[str | Path], Trace]] = {"ai4dl": load_ai4dl, "genai2026": load_genai2026,
                                                      "phasewise": load_phasewise}


def load_trace(path: str | Path, format: str) -> Trace:
    """Load *path* in the named *format* (a key of :data:`FORMATS`)."""
    try:
        loader = _LOADERS[format]
    except KeyError:
        raise TraceFormatError(f"unknown trace format {format!r}; known: {sorted(_LOADERS)}") from None
    trace = loader(path)
    if not trace.containers:
        raise TraceFormatError(f"{path}: no container has any usage value")
    for r in trace.units:
        if not any(r in c.usage for c in trace.containers):
            trace.notes.append(f"{r}: no value in any container: nothing to score for {r}")
    return trace


def sample_path() -> Path:
    """The AI4DL sample shipped with phasewise (Apache-2.0; see data/PROVENANCE.md)."""
    return Path(__file__).resolve().parents[2] / "data" / "ai4dl_sample.csv"


def subtrace(trace: Trace, keep: set[str]) -> Trace:
    """*trace* with only the containers named in *keep*."""
    return Trace(trace.format, trace.source, trace.units, [c for c in trace.containers if c.container in keep],
                 list(trace.notes))
