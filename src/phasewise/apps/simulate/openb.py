"""Reading the Alibaba openb 2023 pod and node lists (Weng et al., ATC'23) into placement records
(docs/placement.md, "Simulation on openb 2023").
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from phasewise.models.jobs.placement import Gpu, Job, Node

__all__ = ["Pod", "QOS_PRIORITY", "TraceError", "load_nodes", "load_pods"]

MIB = 1 << 20
QOS_PRIORITY = {"Guaranteed": 3, "LS": 2, "Burstable": 1, "BE": 0}
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "creation_time", "deletion_time")
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu")


class TraceError(ValueError):
    """A pod or node list that cannot be read (one line: file, row, why)."""


@dataclass(frozen=True)
class Pod:
    job: Job
    created: float
    deleted: float

    @property
    def duration(self) -> float:
        return max(0.0, self.deleted - self.created)


def _rows(path: str | Path, columns: tuple[str, ...]):
    p = Path(path)
    try:
        f = p.open(newline="")
    except OSError as e:
        raise TraceError(f"{p}: {e.strerror or e}") from None
    with f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{p}: not an openb list: missing column(s) {', '.join(missing)}")
        yield from enumerate(reader, start=2)


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
    """The pods in creation order (ties in file order)."""
    pods = []
    for n, row in _rows(path, POD_COLUMNS):
        k = _num(path, n, row, "num_gpu")
        milli = _num(path, n, row, "gpu_milli")
        if k == 1 and not 0 < milli <= 1000:
            raise TraceError(f"{path}: row {n}: gpu_milli={milli} must be in 1..1000 for one GPU")
        gpus = 0.0 if k == 0 else (milli / 1000.0 if k == 1 else float(k))
        spec = (row.get("gpu_spec") or "").strip()
        created = _num(path, n, row, "creation_time", float)
        deleted = _num(path, n, row, "deletion_time", float)
        job = Job(row["name"], cpu_milli=_num(path, n, row, "cpu_milli"),
                  mem_bytes=_num(path, n, row, "memory_mib") * MIB, gpus=gpus,
                  priority=QOS_PRIORITY.get((row.get("qos") or "").strip(), 0),
                  node_selector=(("gpu_model", spec),) if spec and spec.lower() != "nan" else ())
        pods.append(Pod(job, created, max(created, deleted)))
    pods.sort(key=lambda p: p.created)  # stable: ties keep file order
    return pods


def load_nodes(path: str | Path) -> list[Node]:
    nodes = []
    for n, row in _rows(path, NODE_COLUMNS):
        g = _num(path, n, row, "gpu")
        model = (row.get("model") or "").strip()
        nodes.append(Node(row["sn"], _num(path, n, row, "cpu_milli"), _num(path, n, row, "memory_mib") * MIB,
                          gpus=(Gpu(model),) * g))
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes
