"""Gavel's measured throughputs (``../shared/data/gavel-throughputs``): the file read into a
:class:`~phasewise.models.jobs.placement.interference.CoLocationTable` (also for ``phasewise predict
gavel``), and a workload drawn for every GPU pod of a trace, seeded, for ``phasewise simulate
--interference`` (docs/placement.md, "Interference measured").
"""

from __future__ import annotations

import gzip
import json
import random
import zlib
from collections.abc import Sequence
from pathlib import Path

from phasewise.apps.simulate.openb import Pod, TraceError
from phasewise.models.jobs.placement.interference import CoLocationTable, Workload, parse_gavel

__all__ = ["GAVEL_FILE", "GPU_TYPES", "draw_workloads", "load_gavel", "read_gavel"]

GAVEL_FILE = (Path(__file__).resolve().parents[5] / "shared" / "data" / "gavel-throughputs"
              / "physical_cluster_throughputs.json.gz")
#: the GPU types measured with co-location (the ``*_unconsolidated`` entries are other placements)
GPU_TYPES = ("k80", "p100", "v100")


def read_gavel(path: str | Path, gpu: str = "v100") -> CoLocationTable:
    """The *gpu* type's table from Gavel's throughput file (gzipped or not); one-line :class:`TraceError`."""
    p = Path(path)
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as fh:
            raw = json.load(fh)
    except (ValueError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise TraceError(f"{p}: not a Gavel throughput file: {str(e).splitlines()[0][:120]}") from None
    except OSError as e:
        raise TraceError(f"{p}: {e.strerror or e}") from None
    if not isinstance(raw, dict) or gpu not in raw:
        have = ", ".join(sorted(raw)) if isinstance(raw, dict) else "none"
        raise TraceError(f"{p}: no GPU type {gpu!r} (types: {have})")
    try:
        return parse_gavel(raw, gpu)
    except (ValueError, SyntaxError, TypeError, AttributeError) as e:
        raise TraceError(f"{p}: GPU type {gpu!r}: {str(e).splitlines()[0][:120]}") from None


def load_gavel(spec: str, path: str | Path = GAVEL_FILE) -> CoLocationTable:
    """``gavel[:GPU]`` (GPU among :data:`GPU_TYPES`, default v100) -> its table from *path*."""
    source, _, gpu = spec.partition(":")
    gpu = gpu.strip().lower() or "v100"
    if source.strip().lower() != "gavel":
        raise TraceError(f"--interference {spec!r}: expected gavel[:GPU] (GPU: {', '.join(GPU_TYPES)})")
    if gpu not in GPU_TYPES:
        raise TraceError(f"--interference {spec!r}: unknown GPU type {gpu!r} (choose among {', '.join(GPU_TYPES)})")
    table = read_gavel(path, gpu)
    if not table.workloads(1):
        raise TraceError(f"{path}: GPU type {gpu!r} has no single-GPU workload with a measured throughput")
    return table


def draw_workloads(pods: Sequence[Pod], table: CoLocationTable, seed: int = 0) -> dict[str, Workload]:
    """A workload for every GPU pod, drawn uniformly (seeded, in pod order) among the table's workloads on as
    many GPUs as the pod takes (a GPU share: one); a pod whose GPU count the table never measured gets
    none. One draw per pod whatever its kind, so a pod's workload does not depend on the others' kinds."""
    rng = random.Random(seed)
    by_scale: dict[int, tuple[Workload, ...]] = {}
    out: dict[str, Workload] = {}
    for p in pods:
        u = rng.random()
        k = p.job.count
        if not k:
            continue
        if k not in by_scale:
            by_scale[k] = table.workloads(k)
        choices = by_scale[k]
        if choices:
            out[p.job.job] = choices[min(int(u * len(choices)), len(choices) - 1)]
    return out
