"""A phase named by its profile, for people: ``CPU high and bursty, memory mid and flat`` instead of a bare id.

Each resource's level is the phase's median usage against the highest p90 any open phase has for it
(high: at least :data:`HIGH`, low: at most :data:`LOW`, else mid); its shape is the spread from the
median to the p90 (flat: within :data:`FLAT` of the p90, bursty: the median under :data:`BURSTY` of it).
A resource no phase uses (under :data:`IDLE_FLOOR`) is left out. Phases whose words coincide are told apart
by their medians (``CPU high, memory high (0.69 cores, 351 MiB)``); a phase that has no statistics yet (never
credited any usage) is named so. With the stages a job reported while in
the phase, the one seen most (more than half the time) ends the name: ``— like train``. Pure; the
statistics are :meth:`~phasewise.models.phases.clusterer.PhaseStats.summary`'s (``p50``, ``p90``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

__all__ = ["BURSTY", "FLAT", "HIGH", "IDLE_FLOOR", "LOW", "UNSEEN", "phase_names"]

#: median / the highest p90 among the phases: at least HIGH is high, at most LOW low
HIGH = 0.6
LOW = 0.2
#: (p90 - p50) / p90: at most FLAT is flat, at least BURSTY bursty
FLAT = 0.1
BURSTY = 0.5
#: below these the resource is unused in every phase and the name leaves it out (cores, bytes, percent)
IDLE_FLOOR = {"cpu": 0.01, "mem": 2**20, "gpu": 1.0, "gpu_mem": 2**20}
_LABELS = {"cpu": "CPU", "mem": "memory", "gpu": "GPU", "gpu_mem": "GPU memory"}
#: a phase never credited any usage
UNSEEN = "no statistics yet"


def _median(r: str, s: Mapping[str, float]) -> str:
    v = float(s.get("p50", 0.0))
    if r in ("mem", "gpu_mem"):
        return f"{v / 2**20:.0f} MiB"
    return f"{v:.0f} %" if r == "gpu" else f"{v:.2f} cores"


def _words(r: str, s: Mapping[str, float], ref: float) -> str:
    p50, p90 = float(s.get("p50", 0.0)), float(s.get("p90", s.get("p50", 0.0)))
    level = p50 / ref
    word = "high" if level >= HIGH else "low" if level <= LOW else "mid"
    if p90 > 0:
        spread = (p90 - p50) / p90
        if spread <= FLAT:
            word += " and flat"
        elif spread >= BURSTY:
            word += " and bursty"
    return f"{_LABELS.get(r, r)} {word}"


def phase_names(stats: Mapping[int, Mapping[str, Mapping[str, float]]],
                stages: Mapping[int, Mapping[str, int]] | None = None) -> dict[int, str]:
    """Each phase's name from every open phase's statistics (``{phase: {resource: {"p50", "p90", ...}}}``)
    and, where given, how often each stage a job reported was seen in it (``{phase: {stage: count}}``).

    >>> stats = {0: {"cpu": {"p50": 1.9, "p90": 2.0}, "mem": {"p50": 1.0e9, "p90": 1.05e9}},
    ...          1: {"cpu": {"p50": 0.1, "p90": 0.4}, "mem": {"p50": 0.5e9, "p90": 0.9e9}}}
    >>> names = phase_names(stats, {0: {"train": 9, "eval": 1}, 1: {"eval": 2, "checkpoint": 2}})
    >>> names[0]
    'CPU high and flat, memory high and flat — like train'
    >>> names[1]
    'CPU low and bursty, memory mid'
    >>> stats[2] = {"cpu": {"p50": 1.7, "p90": 1.8}, "mem": {"p50": 0.95e9, "p90": 1.0e9}}
    >>> stats[3] = {}
    >>> names = phase_names(stats)
    >>> names[0]
    'CPU high and flat, memory high and flat (1.90 cores, 954 MiB)'
    >>> names[2], names[3]
    ('CPU high and flat, memory high and flat (1.70 cores, 906 MiB)', 'no statistics yet')
    """
    refs: dict[str, float] = {}
    for per in stats.values():
        for r, s in per.items():
            refs[r] = max(refs.get(r, 0.0), float(s.get("p90", s.get("p50", 0.0)) or 0.0))
    words: dict[int, str] = {}
    for p, per in stats.items():
        parts = [_words(r, s, refs[r]) for r, s in per.items()
                 if refs.get(r, 0.0) > IDLE_FLOOR.get(r, 0.0) and "p50" in s]
        has = any("p50" in s for s in per.values())
        words[p] = ", ".join(parts) if parts else "idle" if has else UNSEEN
    twice = {w for w, n in Counter(words.values()).items() if n > 1 and w != UNSEEN}
    out: dict[int, str] = {}
    for p, per in stats.items():
        name = words[p]
        if name in twice:
            medians = [_median(r, s) for r, s in per.items() if refs.get(r, 0.0) > IDLE_FLOOR.get(r, 0.0)
                       and "p50" in s]
            if medians:
                name += f" ({', '.join(medians)})"
        seen = (stages or {}).get(p) or {}
        total = sum(seen.values())
        if total:
            stage, n = max(seen.items(), key=lambda kv: (kv[1], kv[0]))
            if 2 * n > total:
                name += f" — like {stage}"
        out[p] = name
    return out
