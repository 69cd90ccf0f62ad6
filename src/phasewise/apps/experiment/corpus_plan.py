"""The corpus of repeated real executions: which executions (:func:`plan`), their fixed split
(:func:`split_of`), the manifest's checks (:func:`check_manifest`) and each sample's stage
(:func:`stage_series`), pure; and the corpus folder's manifest read and checked (:func:`read_manifest`).
docs/phases.md, "The corpus".

An execution is one run of one job *kind* with its own seed, batch size, data size and
eval/checkpoint intervals, drawn from the kind's grid by a generator seeded with the kind and
the run index only, so run *r* of a kind is the same execution in every plan that holds it.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT", "HELD_OUT_KIND", "HELD_OUT_RUNS", "KINDS", "MANIFEST", "STAGES", "VERSION", "CorpusError",
           "Execution", "ManifestError", "canonical_stage", "check_manifest", "execution_id", "plan", "read_manifest",
           "shipped_corpus", "split_of", "stage_series"]

FORMAT = "phasewise-corpus"
VERSION = 1

#: the stages every job's own words map onto (:func:`canonical_stage`)
STAGES = ("load", "train", "eval", "checkpoint", "done")
_STAGE_OF = {"load": "load", "start": "load", "ready": "load", "resume": "load",
             "train": "train", "error": "train",
             "eval": "eval",
             "checkpoint": "checkpoint", "exit": "checkpoint",
             "done": "done"}

#: the split: the whole kind held out, and the runs of every other kind held out (run index r with
#: r % HELD_OUT_RUNS[0] == HELD_OUT_RUNS[1]: runs 1, 5, 9, ...)
HELD_OUT_KIND = "convlm"
HELD_OUT_RUNS = (4, 1)


@dataclass(frozen=True)
class Kind:
    """A job kind: the program that runs it and the grid its executions are drawn from."""

    name: str
    module: str
    #: what it trains on, in words
    data: str
    #: flag -> the values an execution draws from
    grid: dict[str, tuple[Any, ...]] = field(default_factory=dict)


_DEMO = "phasewise.apps.demo.jobs"
_DEMO_GRID: dict[str, tuple[Any, ...]] = {
    "--seconds": (30, 45, 60), "--batch-size": (16, 32, 64), "--scale": (0.25, 0.5, 1.0),
    "--eval-every": (8, 12, 16), "--checkpoint-every": (10, 15, 25), "--eval-batches": (4, 8, 16)}

#: the job kinds, in the order a plan interleaves them
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("charlstm", _DEMO, "the Python standard library's source, as bytes (2-layer LSTM, 192 units)", _DEMO_GRID),
    Kind("transformer", _DEMO, "the Python standard library's source, as Python tokens (2-layer causal "
                               "transformer, 128 wide)", _DEMO_GRID),
    Kind("forecaster", _DEMO, "windows of the shipped AI4DL trace (an MLP forecasting CPU and memory)",
         {f: v for f, v in _DEMO_GRID.items() if f != "--scale"}),  # (its data is the whole trace)
    Kind("convlm", _DEMO, "the standard library's test sources, as bytes (dilated causal convolutions)", _DEMO_GRID),
    Kind("mlp", "phasewise.apps.experiment.trainer", "a random teacher network's outputs on Gaussian inputs "
                                                     "(an MLP student, the cluster experiment's trainer)",
         {"--seconds": (30, 45, 60), "--batch-size": (32, 64, 256), "--rows": (50_000, 200_000, 500_000),
          "--hidden": (128, 256, 512), "--eval-every": (5, 10, 15), "--checkpoint-every": (8, 12, 20)}),
    Kind("gru", "phasewise.apps.experiment.targets_jobs", "the standard library's source, as bytes (a 48-unit "
                                                          "GRU, one of the targets experiment's jobs)",
         {"--seconds": (30, 45, 60), "--report-every": (10, 25, 50)}),
)}


@dataclass(frozen=True)
class Execution:
    """One planned execution: its id (the job id and the container's name), kind, run index and flags."""

    id: str
    kind: str
    run: int
    params: dict[str, Any]

    @property
    def split(self) -> str:
        return split_of(self.kind, self.run)

    def argv(self, checkpoint_dir: str) -> list[str]:
        """The job's arguments after ``python -m MODULE`` (the checkpoint folder is the run's own)."""
        k = KINDS[self.kind]
        flags = [str(x) for f, v in sorted(self.params.items()) for x in (f, v)]
        if k.module == "phasewise.apps.experiment.trainer":
            return [self.id, "--checkpoint-dir", checkpoint_dir, *flags]
        threads = ["--threads", "1"] if k.module == _DEMO else []
        return [self.kind, *threads, "--checkpoint-dir", checkpoint_dir, *flags]


def execution_id(kind: str, run: int) -> str:
    """The execution's id: its job id and its container's name.

    >>> execution_id("charlstm", 3)
    'charlstm-r03'
    """
    return f"{kind}-r{run:02d}"


def _draw(kind: str, run: int) -> dict[str, Any]:
    k = KINDS[kind]
    rnd = random.Random(zlib.crc32(f"{kind}/{run}".encode()))
    params = {flag: rnd.choice(values) for flag, values in sorted(k.grid.items())}
    params["--seed"] = run
    return params


def plan(kinds: Sequence[str], runs: int) -> list[Execution]:
    """Runs ``0..runs-1`` of each kind, interleaved (run 0 of every kind, then run 1, ...), so a recording
    stopped early holds about as many runs of each kind.

    >>> [e.id for e in plan(["mlp", "charlstm"], 2)]
    ['mlp-r00', 'charlstm-r00', 'mlp-r01', 'charlstm-r01']
    >>> plan(["mlp"], 3)[1].params == plan(["mlp", "convlm"], 5)[2].params  # run 1 of mlp, whatever the plan
    True
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown job kind {unknown[0]!r}; the kinds are {', '.join(KINDS)}")
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    return [Execution(execution_id(k, r), k, r, _draw(k, r)) for r in range(runs) for k in dict.fromkeys(kinds)]


def split_of(kind: str, run: int) -> str:
    """``"heldout"`` for every run of :data:`HELD_OUT_KIND` and runs 1, 5, 9, ... of the others; else ``"train"``.

    >>> [split_of("mlp", r) for r in range(5)], split_of("convlm", 0)
    (['train', 'heldout', 'train', 'train', 'train'], 'heldout')
    """
    if kind == HELD_OUT_KIND:
        return "heldout"
    m, k = HELD_OUT_RUNS
    return "heldout" if run % m == k else "train"


class ManifestError(ValueError):
    """A corpus manifest that cannot be used; ``str(e)`` says why in one line."""


def check_manifest(manifest: Any) -> list[dict[str, Any]]:
    """The manifest's executions, checked: each once, each with its kind, run, file and the split
    :func:`split_of` gives it; :class:`ManifestError` otherwise."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"not a corpus manifest (no \"format\": \"{FORMAT}\")")
    if manifest.get("version") != VERSION:
        raise ManifestError(f"corpus manifest version {manifest.get('version')!r}; this phasewise reads {VERSION}")
    execs = manifest.get("executions")
    if not isinstance(execs, list):
        raise ManifestError("the manifest has no list of executions")
    seen: set[str] = set()
    for i, e in enumerate(execs):
        if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in ("id", "kind", "file", "split")) \
                or not isinstance(e.get("run"), int) or isinstance(e.get("run"), bool):
            raise ManifestError(f"execution {i}: needs a text id, kind, file and split and an integer run")
        if e["id"] in seen:
            raise ManifestError(f"execution {e['id']!r} is listed twice")
        seen.add(e["id"])
        if e["split"] != split_of(e["kind"], e["run"]):
            raise ManifestError(f"execution {e['id']!r}: split {e['split']!r}, but the corpus's fixed split puts it "
                                f"in {split_of(e['kind'], e['run'])!r}")
        if "/" in e["file"] or e["file"].startswith("."):
            raise ManifestError(f"execution {e['id']!r}: file {e['file']!r} is not a file name in the corpus folder")
    return execs


def canonical_stage(word: str | None) -> str | None:
    """A job's own stage word as one of :data:`STAGES` (None: not a stage word).

    >>> canonical_stage("ready"), canonical_stage("exit"), canonical_stage("eval"), canonical_stage("warmup")
    ('load', 'checkpoint', 'eval', None)
    """
    return _STAGE_OF.get(word or "")


def stage_series(t: np.ndarray, reports: Iterable[dict[str, Any]]) -> list[str]:
    """The stage of each sample at times *t*: the stage of the last report at or before it, ``load`` before
    the first (the interpreter starting and importing: the job's load, before it can say so).

    Reports are the recording header's stage points (``{"ts": ..., "stage": ...}``); those without a
    known stage word are skipped.

    >>> stage_series(np.array([1., 2., 3., 4., 5.]), [{"ts": 1.5, "stage": "load"}, {"ts": 2.5, "stage": "train"},
    ...              {"ts": 3.9, "stage": "eval"}, {"ts": 4.2, "stage": "train"}])
    ['load', 'load', 'train', 'eval', 'train']
    """
    points = sorted(((float(r["ts"]), s) for r in reports
                     if isinstance(r, dict) and isinstance(r.get("ts"), (int, float)) and math.isfinite(r["ts"])
                     and (s := canonical_stage(r.get("stage"))) is not None), key=lambda p: p[0])
    if not points:
        return ["load"] * len(t)
    ts = np.array([p for p, _ in points])
    k = np.searchsorted(ts, np.asarray(t, dtype=np.float64), side="right") - 1
    return ["load" if i < 0 else points[i][1] for i in k.tolist()]


# --------------------------------------------------------------------------- the folder

MANIFEST = "manifest.json"


class CorpusError(RuntimeError):
    """The corpus cannot be recorded or read; ``str(e)`` says why in one line."""


def agreement_metrics() -> tuple[Any, Any]:
    """scikit-learn's adjusted mutual information and adjusted Rand index (the ``analysis`` extra)."""
    try:
        from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score
    except ImportError:
        raise CorpusError("scikit-learn is not installed: pip install 'phasewise[analysis]'") from None
    return adjusted_mutual_info_score, adjusted_rand_score


def shipped_corpus() -> Path:
    """The corpus shipped with phasewise (package data)."""
    return Path(__file__).resolve().parents[2] / "data" / "corpus"


def read_manifest(folder: Path) -> dict[str, Any]:
    """The corpus folder's manifest, checked (:func:`~.corpus_plan.check_manifest`); :class:`CorpusError`."""
    path = folder / MANIFEST
    if folder.is_file():
        raise CorpusError(f"{folder}: a file; a corpus is a folder with {MANIFEST} (phasewise experiment corpus "
                          "record --out DIR)")
    if not folder.is_dir():
        raise CorpusError(f"{folder}: no such folder")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorpusError(f"{folder}: no {MANIFEST}: not a corpus folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorpusError(f"{path}: not readable JSON ({e})") from None
    try:
        check_manifest(manifest)
    except ManifestError as e:
        raise CorpusError(f"{path}: {e}") from None
    return manifest
