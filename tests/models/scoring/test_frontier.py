"""The reactive frontier against hand computations and against its definition."""

from __future__ import annotations

import itertools
import random

import pytest

from phasewise.models.scoring.frontier import alloc_cut, frontier, frontier_at, slack_cut


def test_two_members_mix_along_the_line_between_them():
    # vpa (1.5, 96 %), window (1.2, 90 %): at 94 % a user alternates them 1/3 window, 2/3 vpa
    # R = 1.2 + (1.5 - 1.2) * (0.94 - 0.90) / (0.96 - 0.90) = 1.2 + 0.3 * 2/3 = 1.4
    pts = {"vpa": (1.5, 0.96), "window-max-5": (1.2, 0.90)}
    at = frontier_at(pts, 0.94)
    assert at.alloc == pytest.approx(1.4)
    assert dict(at.mix) == pytest.approx({"window-max-5": 1 / 3, "vpa": 2 / 3})
    assert at.fulfilment == 0.94 and not at.above_every_member
    # a phase policy at 1.3 there: allocation 1 - 1.3/1.4 = 7.14 % less; slack 0.3 vs 0.4: 25 % less
    assert alloc_cut(1.3, at.alloc) == pytest.approx(1 - 1.3 / 1.4)
    assert slack_cut(1.3, at.alloc) == pytest.approx(0.25)
    # at a member's own fulfilment the frontier is that member
    assert frontier_at(pts, 0.96).alloc == pytest.approx(1.5)
    assert frontier_at(pts, 0.90).alloc == pytest.approx(1.2)


def test_three_members_the_middle_one_below_the_chord_is_a_vertex():
    # a (1.1, 80 %), b (1.3, 95 %), c (1.8, 99 %): b lies below the chord a-c (at 95 %: 1.1 + 0.7 * 15/19 = 1.65)
    pts = {"a": (1.1, 0.80), "b": (1.3, 0.95), "c": (1.8, 0.99)}
    assert [v.name for v in frontier(pts)] == ["a", "b", "c"]
    # 90 %: between a and b, 2/3 of the way: 1.1 + 0.2 * 2/3
    assert frontier_at(pts, 0.90).alloc == pytest.approx(1.1 + 0.2 * 2 / 3)
    # 97 %: half way from b to c: 1.55; the single-member rule would take c (1.8)
    at = frontier_at(pts, 0.97)
    assert at.alloc == pytest.approx(1.55) and dict(at.mix) == pytest.approx({"b": 0.5, "c": 0.5})
    assert slack_cut(1.44, at.alloc) == pytest.approx(1 - 0.44 / 0.55)


def test_three_members_the_middle_one_above_the_chord_is_not_a_vertex():
    # b (1.5, 90 %) is above the chord a-c (at 90 %: 1.1 + 0.7 * 10/19 = 1.468): mixing a and c is cheaper
    pts = {"a": (1.1, 0.80), "b": (1.5, 0.90), "c": (1.8, 0.99)}
    assert [v.name for v in frontier(pts)] == ["a", "c"]
    at = frontier_at(pts, 0.90)
    assert at.alloc == pytest.approx(1.1 + 0.7 * 10 / 19) and at.alloc < 1.5
    assert {n for n, _ in at.mix} == {"a", "c"}


def test_dominated_members_and_ties_do_not_change_the_frontier():
    pts = {"a": (1.1, 0.80), "b": (1.3, 0.95), "c": (1.8, 0.99),
           "dearer-same-fulfilment": (1.4, 0.95), "dearer-lower": (1.9, 0.98), "cheap-tie": (1.1, 0.70)}
    assert [v.name for v in frontier(pts)] == ["a", "b", "c"]


def test_above_every_member_the_comparison_is_at_the_highest_fulfilment_and_says_so():
    pts = {"a": (1.1, 0.80), "b": (1.3, 0.95), "c": (1.8, 0.99)}
    at = frontier_at(pts, 1.0)
    assert at.above_every_member and at.fulfilment == 0.99 and at.alloc == 1.8 and at.mix == (("c", 1.0),)
    # the highest-fulfilment member need not be the dearest: the frontier ends at it all the same
    at = frontier_at({"x": (2.0, 0.95), "y": (1.7, 0.97)}, 0.99)
    assert at.above_every_member and at.alloc == 1.7 and at.mix == (("y", 1.0),)
    assert frontier_at({"x": (2.0, 0.95), "y": (1.7, 0.97)}, 0.90).alloc == 1.7  # y dominates x


def test_no_slack_to_cut_when_the_frontier_allocates_at_most_use():
    assert slack_cut(0.9, 1.0) is None and slack_cut(1.05, 0.98) is None
    # nor about the use: under 1 % of slack, the ratio is noise over a near-zero denominator
    assert slack_cut(1.08, 1.000046) is None and slack_cut(1.0, 1.0099) is None
    assert slack_cut(1.005, 1.01) == pytest.approx(0.5)
    assert frontier_at({"a": (None, None)}, 0.9) is None and frontier_at({}, 0.9) is None


def _by_definition(pts: dict, f: float) -> float | None:
    """min alloc over members at >= f and over mixes of two members reaching exactly f."""
    best = None
    for a, g in pts.values():
        if g >= f - 1e-12:
            best = a if best is None else min(best, a)
    for (a1, g1), (a2, g2) in itertools.permutations(pts.values(), 2):
        if g1 < f < g2:
            w = (f - g1) / (g2 - g1)
            v = a1 + w * (a2 - a1)
            best = v if best is None else min(best, v)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_frontier_is_the_least_allocation_of_any_member_or_mix_of_two(seed):
    rng = random.Random(seed)
    pts = {f"m{i}": (rng.uniform(0.8, 3.0), rng.uniform(0.6, 1.0)) for i in range(rng.randint(1, 9))}
    top = max(g for _, g in pts.values())
    prev = None
    for k in range(41):
        f = 0.55 + 0.45 * k / 40
        at = frontier_at(pts, f)
        if f > top + 1e-12:
            assert at.above_every_member and at.fulfilment == top
            assert at.alloc == pytest.approx(_by_definition(pts, top))
        else:
            assert at.alloc == pytest.approx(_by_definition(pts, f), abs=1e-9)
            # the mix reaches f at that allocation
            assert sum(w for _, w in at.mix) == pytest.approx(1.0)
            assert sum(w * pts[n][1] for n, w in at.mix) >= f - 1e-9
            assert sum(w * pts[n][0] for n, w in at.mix) == pytest.approx(at.alloc)
        assert prev is None or at.alloc >= prev - 1e-12  # non-decreasing in f
        prev = at.alloc
