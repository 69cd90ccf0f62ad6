"""Reading the Alibaba openb 2023 pod and node lists (Weng et al., ATC'23) into placement records: every
published pod list form (default, cpu*, gpushare*, gpuspec* with their 11 columns; multigpu* with the 5
resource columns only, no GPU model, QoS or times) and both node lists (docs/placement.md, "Simulation on
openb 2023").
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from phasewise.models.jobs.placement import Gpu, Job, Node

__all__ = ["Pod", "QOS_PRIORITY", "TraceError", "load_nodes", "load_pods"]

MIB = 1 << 20
QOS_PRIORITY = {"Guaranteed": 3, "LS": 2, "Burstable": 1, "BE": 0}
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")  # every form has these
TIME_COLUMNS = ("creation_time", "deletion_time")  # all forms but multigpu*: both or neither
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu")
_POD_FORM = "name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,qos,pod_phase,creation_time,deletion_time,...]"
_NODE_FORM = "sn,cpu_milli,memory_mib,gpu[,model]"


class TraceError(ValueError):
    """A pod or node list that cannot be read (one line: file, row, why)."""


@dataclass(frozen=True)
class Pod:
    job: Job
    created: float  # without times in the list: the row's place in it (0, 1, ...)
    deleted: float
    timed: bool = True  # False: the list has no creation and deletion times

    @property
    def duration(self) -> float:
        return max(0.0, self.deleted - self.created)


def _rows(path: str | Path, columns: tuple[str, ...], form: str, what: str):
    """(row number, row) of a CSV with *columns*; the header's names first, as row 1."""
    p = Path(path)
    try:
        f = p.open(newline="")
    except OSError as e:
        raise TraceError(f"{p}: {e.strerror or e}") from None
    with f:
        reader = csv.DictReader(f)
        try:
            names = reader.fieldnames or []
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{p}: not an openb {what} list: {e}") from None
        missing = [c for c in columns if c not in names]
        if missing:
            raise TraceError(f"{p}: not an openb {what} list: missing column(s) {', '.join(missing)} "
                             f"(expected {form})")
        yield 1, names
        try:
            yield from enumerate(reader, start=2)
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{p}: row {reader.line_num}: {e}") from None


def _num(p: Path | str, n: int, row: dict, col: str, kind=int, minimum: float = 0):
    v = row.get(col)
    try:
        x = kind(float(v)) if kind is int else kind(v)
    except (TypeError, ValueError):
        raise TraceError(f"{p}: row {n}: {col}={v!r} is not a number") from None
    if x < minimum:
        raise TraceError(f"{p}: row {n}: {col}={v!r} is below {minimum}")
    return x


def load_pods(path: str | Path) -> list[Pod]:
    """The pods in creation order (ties in file order); a list without times keeps file order and its
    pods have ``timed=False``."""
    pods = []
    rows = _rows(path, POD_COLUMNS, _POD_FORM, "pod")
    _, names = next(rows)
    has = [c in names for c in TIME_COLUMNS]
    if any(has) and not all(has):
        raise TraceError(f"{path}: not an openb pod list: {TIME_COLUMNS[has.index(True)]} without "
                         f"{TIME_COLUMNS[has.index(False)]}")
    timed = all(has)
    for n, row in rows:
        if not (row.get("name") or "").strip():
            raise TraceError(f"{path}: row {n}: no name")
        k = _num(path, n, row, "num_gpu")
        milli = _num(path, n, row, "gpu_milli")
        if k == 1 and not 0 < milli <= 1000:
            raise TraceError(f"{path}: row {n}: gpu_milli={milli} must be in 1..1000 for one GPU")
        gpus = 0.0 if k == 0 else (milli / 1000.0 if k == 1 else float(k))
        spec = (row.get("gpu_spec") or "").strip()
        if timed:
            created = _num(path, n, row, "creation_time", float)
            deleted = _num(path, n, row, "deletion_time", float)
        else:
            created = deleted = float(n - 2)
        job = Job(row["name"], cpu_milli=_num(path, n, row, "cpu_milli"),
                  mem_bytes=_num(path, n, row, "memory_mib") * MIB, gpus=gpus,
                  priority=QOS_PRIORITY.get((row.get("qos") or "").strip(), 0),
                  node_selector=(("gpu_model", spec),) if spec and spec.lower() != "nan" else ())
        pods.append(Pod(job, created, max(created, deleted), timed))
    pods.sort(key=lambda p: p.created)  # stable: ties keep file order
    return pods


def load_nodes(path: str | Path) -> list[Node]:
    nodes = []
    rows = _rows(path, NODE_COLUMNS, _NODE_FORM, "node")
    next(rows)
    for n, row in rows:
        g = _num(path, n, row, "gpu")
        model = (row.get("model") or "").strip()
        nodes.append(Node(row["sn"], _num(path, n, row, "cpu_milli"), _num(path, n, row, "memory_mib") * MIB,
                          gpus=(Gpu(model),) * g))
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes
