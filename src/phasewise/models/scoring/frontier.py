"""The reactive frontier: the least allocation reactive baselines (or a mix of two) need for a fulfilment.

:func:`frontier_at` finds it on the lower convex hull of the baselines'
points; :func:`alloc_cut` and :func:`slack_cut` compare the phase policy
with it. docs/results.md, "How the scores are computed".

>>> at = frontier_at({"a": (1.2, 0.90), "b": (1.6, 0.98)}, 0.94)
>>> round(at.alloc, 6), round(slack_cut(1.3, at.alloc), 4)
(1.4, 0.25)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["FrontierPoint", "Vertex", "alloc_cut", "frontier", "frontier_at", "slack_cut"]

#: fulfilments closer than this are the same fulfilment (they are ratios of step counts)
EPS = 1e-12


@dataclass(frozen=True)
class Vertex:
    """A member on the frontier."""

    name: str
    alloc: float  #: its alloc_over_used
    fulfilment: float


@dataclass(frozen=True)
class FrontierPoint:
    """The frontier at one fulfilment.

    ``fulfilment`` is where it was taken: the fulfilment asked for, or the
    highest any member reaches when the one asked for is above it
    (``above_every_member``). ``mix`` is how to reach it: ``((member,
    share of time), ...)``, one member or two.
    """

    fulfilment: float
    alloc: float
    mix: tuple[tuple[str, float], ...]
    above_every_member: bool


def _points(points: Mapping[str, tuple[float | None, float | None]]) -> list[Vertex]:
    out = []
    for name, (a, f) in points.items():
        if a is None or f is None or not (math.isfinite(a) and math.isfinite(f)):
            continue
        out.append(Vertex(name, float(a), float(f)))
    return out


def frontier(points: Mapping[str, tuple[float | None, float | None]]) -> list[Vertex]:
    """The members on the frontier, by increasing fulfilment.

    *points*: ``{member: (alloc_over_used, fulfilment)}``; members without a
    score (``None``/NaN) are left out. The first vertex is the cheapest member
    (on a tie, the one with the higher fulfilment); from each vertex the next
    is the member of higher fulfilment reached by the least slope (on a tie,
    the farthest). Members above the hull, or dominated, are not vertices.

    >>> pts = {"a": (1.1, 0.80), "b": (1.3, 0.95), "c": (1.8, 0.99),
    ...        "dominated": (1.5, 0.90), "above": (1.25, 0.85)}
    >>> [v.name for v in frontier(pts)]
    ['a', 'b', 'c']
    >>> frontier({"x": (None, None)})
    []
    """
    pts = _points(points)
    if not pts:
        return []
    v = min(pts, key=lambda p: (p.alloc, -p.fulfilment, p.name))
    out = [v]
    while True:
        right = [p for p in pts if p.fulfilment > v.fulfilment + EPS]
        if not right:
            return out
        v = min(right, key=lambda p: ((p.alloc - v.alloc) / (p.fulfilment - v.fulfilment), -p.fulfilment, p.name))
        out.append(v)


def frontier_at(points: Mapping[str, tuple[float | None, float | None]], fulfilment: float) -> FrontierPoint | None:
    """``R(fulfilment)``, with the member(s) that reach it; ``None`` without any scored member.

    >>> pts = {"a": (1.1, 0.80), "b": (1.3, 0.95), "c": (1.8, 0.99)}
    >>> at = frontier_at(pts, 0.97)            # half way from b to c
    >>> round(at.alloc, 6), [(n, round(w, 6)) for n, w in at.mix], at.above_every_member
    (1.55, [('b', 0.5), ('c', 0.5)], False)
    >>> frontier_at(pts, 0.5)                  # below the cheapest member: that member
    FrontierPoint(fulfilment=0.5, alloc=1.1, mix=(('a', 1.0),), above_every_member=False)
    >>> frontier_at(pts, 1.0)                  # above every member: at the highest one
    FrontierPoint(fulfilment=0.99, alloc=1.8, mix=(('c', 1.0),), above_every_member=True)
    """
    verts = frontier(points)
    if not verts:
        return None
    f = float(fulfilment)
    first, last = verts[0], verts[-1]
    if f <= first.fulfilment + EPS:
        return FrontierPoint(f, first.alloc, ((first.name, 1.0),), False)
    if f > last.fulfilment + EPS:
        return FrontierPoint(last.fulfilment, last.alloc, ((last.name, 1.0),), True)
    for lo, hi in zip(verts, verts[1:]):
        if f <= hi.fulfilment + EPS:
            w = min(1.0, (f - lo.fulfilment) / (hi.fulfilment - lo.fulfilment))
            alloc = lo.alloc + w * (hi.alloc - lo.alloc)
            mix = tuple((n, s) for n, s in ((lo.name, 1.0 - w), (hi.name, w)) if s > EPS)
            return FrontierPoint(f, alloc, mix, False)
    raise AssertionError("unreachable: f lies within the vertices' fulfilments")  # pragma: no cover


def alloc_cut(phase: float, frontier_alloc: float) -> float | None:
    """``1 - phase / R``: the share of the frontier's allocation not needed; ``None`` when ``R <= 0``.

    >>> round(alloc_cut(1.1, 1.2), 6), alloc_cut(1.0, 0.0)
    (0.083333, None)
    """
    return 1.0 - phase / frontier_alloc if frontier_alloc > 0 else None


#: the least slack (``R - 1``) a slack cut is measured against: below it the ratio is noise over a near-zero
#: denominator (a frontier at 1.00005 turned an allocation 8 % over use into a "cut" of -1,500,000 %)
MIN_SLACK = 0.01


def slack_cut(phase: float, frontier_alloc: float) -> float | None:
    """``1 - (phase - 1) / (R - 1)``: the share of the frontier's slack removed.

    ``None`` when the frontier leaves less than :data:`MIN_SLACK` of slack (``R < 1.01``:
    the baselines allocate about the use there, or less, so there is no slack to cut).
    Above 1 means the phase policy allocates less than use in total.

    >>> round(slack_cut(1.1, 1.2), 6), slack_cut(1.2, 1.2), slack_cut(1.0, 0.95), slack_cut(1.08, 1.00005)
    (0.5, 0.0, None, None)
    """
    return 1.0 - (phase - 1.0) / (frontier_alloc - 1.0) if frontier_alloc >= 1.0 + MIN_SLACK else None
