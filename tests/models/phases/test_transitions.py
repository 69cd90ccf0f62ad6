"""The transition book: per signature and phase, the newest exits and the likely next phase (pure)."""

from __future__ import annotations

import math

import pytest

from phasewise.models.phases.transitions import TransitionBook, TransitionConfig


def book(**kw) -> TransitionBook:
    return TransitionBook(TransitionConfig(**{"horizon_s": 5.0, "min_probability": 0.5, "min_exits": 3, **kw}))


def test_the_probability_is_the_share_of_the_exits_that_outlived_the_dwell_and_ended_within_the_horizon():
    exits = [(10.0, 4), (12.0, 4), (13.0, 1), (30.0, 4), (31.0, 4)]
    b, low = book(), book(min_probability=0.4)
    for d, q in exits:
        b.learn("lm", 2, q, d)
        low.learn("lm", 2, q, d)
    # at 8 s: all 5 exits outlived it; within (8, 13]: 10 and 12 to phase 4, 13 to phase 1 -> 4 with 2/5
    t = low.predict("lm", 2, 8.0)
    assert (t.next_phase, t.probability, t.exits, t.within_s, t.dwell_s) == (4, 0.4, 5, 5.0, 8.0)
    assert b.predict("lm", 2, 8.0) is None  # 0.4 < 0.5
    # at 11 s: 4 outlived it (12, 13, 30, 31); within (11, 16]: 12 to 4, 13 to 1 -> 4 with 1/4
    assert low.predict("lm", 2, 11.0) is None
    # at 26 s: 30 and 31 outlived it, both to 4 within the horizon, but 2 exits are fewer than 3
    assert low.predict("lm", 2, 26.0) is None
    two = book(min_exits=2)
    for d, q in exits:
        two.learn("lm", 2, q, d)
    t = two.predict("lm", 2, 26.0)
    assert (t.next_phase, t.probability, t.exits) == (4, 1.0, 2)
    assert two.predict("lm", 2, 20.0) is None  # 30 and 31 are more than 5 s away
    assert two.predict("lm", 2, 31.0) is None  # past every exit
    assert two.predict("lm", 3, 26.0) is None and two.predict("other", 2, 26.0) is None


def test_self_transitions_unknown_phases_and_bad_dwells_are_not_learned_and_a_zero_horizon_is_off():
    b = book(min_exits=1)
    for args in [(2, 2, 5.0), (-1, 3, 5.0), (2, -1, 5.0), (2, 3, -1.0), (2, 3, math.nan), (2, 3, math.inf)]:
        b.learn("lm", *args)
    assert b.learned == 0 and not b.knows("lm") and b.exits("lm", 2) == []
    b.learn("lm", 2, 3, 5.0)
    assert b.knows("lm") and b.exits("lm", 2) == [(5.0, 3)] and b.predict("lm", 2, 1.0).next_phase == 3
    off = TransitionBook(TransitionConfig(horizon_s=0.0, min_exits=1))
    off.learn("lm", 2, 3, 5.0)
    assert off.predict("lm", 2, 4.9) is None


def test_a_phase_keeps_its_newest_exits_and_the_least_recently_learned_signature_goes_first():
    b = TransitionBook(TransitionConfig(horizon_s=5.0, min_exits=1, keep=3, max_signatures=2))
    for i in range(5):
        b.learn("a", 1, 2, float(i))
    assert b.exits("a", 1) == [(2.0, 2), (3.0, 2), (4.0, 2)]
    b.learn("b", 1, 2, 1.0)
    b.learn("a", 1, 2, 1.0)  # a is now the most recent
    b.learn("c", 1, 2, 1.0)
    assert b.knows("a") and b.knows("c") and not b.knows("b") and len(b) == 2


def test_ties_go_to_the_lower_phase_and_the_explanation_names_the_transition():
    b = book(min_exits=2)
    for d, q in [(6.0, 7), (7.0, 3)]:
        b.learn("job", 1, q, d)
    t = b.predict("job", 1, 5.0)
    assert t.next_phase == 3 and t.probability == 0.5
    assert t.explain() == {"signature": "job", "phase": 1, "next_phase": 3, "probability": 0.5, "within_s": 5.0,
                           "dwell_s": 5.0, "exits": 2}
    assert t.text() == "ahead of phase 1 -> 3 (50% of 2 earlier exits of job within 5 s)"


@pytest.mark.parametrize("kw, message", [
    ({"horizon_s": -1.0}, "horizon_s"), ({"horizon_s": math.inf}, "horizon_s"),
    ({"horizon_s": 5.0, "min_probability": 0.0}, "min_probability"),
    ({"horizon_s": 5.0, "min_probability": 1.5}, "min_probability"),
    ({"horizon_s": 5.0, "min_exits": 0}, "min_exits"),
    ({"horizon_s": 5.0, "min_exits": 40, "keep": 32}, "keep"),
    ({"horizon_s": 5.0, "max_signatures": 0}, "max_signatures"),
])
def test_bad_configurations_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        TransitionConfig(**kw)
