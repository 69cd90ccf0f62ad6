"""Scoring against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.models.scoring.measures import Score, common_start, hold_last, score_steps, step_durations


def test_alloc_over_used_and_fulfilment_match_a_hand_computation():
    # t:    0   10   30   40     dt: 10, 20, 10, last = median(10, 20, 10) = 10
    # U:    1    2    4    1
    # L:    2    2    3    1     U<=L at steps 0, 1, 3 -> 3 of 4
    # sum L dt = 20 + 40 + 30 + 10 = 100 ; sum U dt = 10 + 40 + 40 + 10 = 100
    s = score_steps(np.array([0., 10., 30., 40.]), np.array([1., 2., 4., 1.]), np.array([2., 2., 3., 1.]))
    assert (s.alloc, s.used, s.fulfilled, s.steps) == (100.0, 100.0, 3, 4)
    assert s.alloc_over_used == 1.0 and s.fulfilment == 0.75


def test_scoring_from_a_start_index_skips_the_earlier_steps_but_keeps_their_durations():
    # same series scored from step 2: dt 10 (to t=40) and 10 (median) -> L: 30+10, U: 40+10
    s = score_steps(np.array([0., 10., 30., 40.]), np.array([1., 2., 4., 1.]),
                    np.array([np.nan, 2., 3., 1.]), start=2)
    assert (s.alloc, s.used, s.fulfilled, s.steps) == (40.0, 50.0, 1, 2)
    assert s.alloc_over_used == pytest.approx(0.8)


def test_scores_add_up_across_containers():
    a = Score(alloc=10, used=5, fulfilled=1, steps=2)
    b = Score(alloc=20, used=15, fulfilled=2, steps=2)
    tot = Score.total([a, b])
    assert tot == Score(30, 20, 3, 4)
    assert tot.alloc_over_used == 1.5 and tot.fulfilment == 0.75


def test_ratios_are_undefined_without_usage_or_steps():
    assert Score().alloc_over_used is None and Score().fulfilment is None
    assert Score(alloc=3, used=0, fulfilled=2, steps=2).alloc_over_used is None


def test_the_last_step_gets_the_median_and_long_gaps_count_as_one_median_step():
    np.testing.assert_array_equal(step_durations(np.array([0., 10., 20., 50.])), [10., 10., 30., 10.])
    # 6 x median > 5 x median -> replaced by the median
    np.testing.assert_array_equal(step_durations(np.array([0., 10., 20., 80.])), [10., 10., 10., 10.])
    np.testing.assert_array_equal(step_durations(np.array([5.]), median_dt=7.0), [7.])
    with pytest.raises(ValueError, match="needs median_dt"):
        step_durations(np.array([5.]))
    with pytest.raises(ValueError, match="strictly increasing"):
        step_durations(np.array([0., 0.]))


def test_a_single_sample_series_is_scored_with_the_given_median_step():
    s = score_steps(np.array([3.]), np.array([2.]), np.array([4.]), median_dt=60.0)
    assert (s.alloc, s.used, s.fulfilled, s.steps) == (240.0, 120.0, 1, 1)


def test_hold_last_keeps_the_previous_limit_where_a_policy_has_no_opinion():
    np.testing.assert_array_equal(hold_last([None, None, 1.0, None, 2.0, np.nan]),
                                  [np.nan, np.nan, 1.0, 1.0, 2.0, 2.0])
    np.testing.assert_array_equal(hold_last([]), [])


def test_the_common_start_is_where_the_slowest_policy_has_its_first_limit():
    a = np.array([1., 1., 1., 1.])
    b = np.array([np.nan, np.nan, 2., 2.])
    assert common_start([a, b]) == 2
    assert common_start([a, np.full(4, np.nan)]) == 4
    assert common_start([]) == 0


def test_missing_limits_at_scored_steps_are_an_error_not_a_silent_zero():
    with pytest.raises(ValueError, match="limit has missing values"):
        score_steps(np.array([0., 1.]), np.array([1., 1.]), np.array([np.nan, 1.]))
    with pytest.raises(ValueError, match="length mismatch"):
        score_steps(np.array([0., 1.]), np.array([1.]), np.array([1., 1.]))


def test_usage_equal_to_the_limit_counts_as_fulfilled():
    s = score_steps(np.array([0., 1.]), np.array([0.0, 3.0]), np.array([0.0, 3.0]))
    assert s.fulfilled == 2
