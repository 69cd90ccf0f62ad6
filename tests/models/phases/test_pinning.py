"""The model pin (phasewise.models.phases.pinning): which version a worker decides with, its records, its fence."""

from __future__ import annotations

from phasewise.models.phases.pinning import ModelPin, record_key, record_value, recorded_version


def test_records_are_read_back_and_anything_else_is_no_record():
    assert recorded_version(record_value(7)) == 7
    assert recorded_version({"model_version": 7}) == 7  # as Faust hands back a value recovered from the changelog
    for raw in (None, b"", b"{", b"[]", b'{"model_version":-1}', b'{"model_version":1.5}', b'{"v":3}',
                b'{"model_version":true}'):
        assert recorded_version(raw) is None
    assert "/" not in record_key(3)  # never a container's host/container key


def test_a_first_start_keeps_its_version_swaps_at_the_next_commit_and_records_every_partition():
    pin = ModelPin(4)
    assert pin.assigned({0: None, 1: None}, {0: 100, 1: 50}, {0: None, 1: None}, [4]) is None
    assert not pin.fenced()  # no record: nothing was decided with a recorded version
    plan = pin.at_commit(None)
    assert not plan.swap and plan.records == {0: 4, 1: 4}
    assert pin.at_commit(None).records == {}  # recorded once
    plan = pin.at_commit(5)
    assert plan.swap and pin.version == 5 and plan.records == {0: 5, 1: 5}
    assert not pin.at_commit(5).swap  # not newer than the version in force


def test_a_restart_takes_the_recorded_version_and_swaps_only_past_the_ends_it_was_given():
    pin = ModelPin(9)  # the newest when the restarted worker came up
    assert pin.assigned({0: 6, 1: 6}, {0: 120, 1: 40}, {0: 100, 1: None}, [5, 6, 9]) == 6
    assert pin.version == 6 and pin.fenced()
    plan = pin.at_commit(9)
    assert not plan.swap and pin.version == 6 and plan.records == {}
    for off in range(100, 120):
        pin.processed(0, off)
    assert pin.fenced()  # partition 1 not read to its end yet
    pin.processed(1, 39)
    assert not pin.fenced()
    plan = pin.at_commit(9)
    assert plan.swap and pin.version == 9 and plan.records == {0: 9, 1: 9}


def test_partitions_recorded_apart_take_the_newest_and_an_unavailable_version_is_said():
    pin = ModelPin(9)
    assert pin.assigned({0: 6, 1: 7, 2: None}, {0: 1, 1: 1, 2: 1}, {}, [6, 7, 9]) == 7
    assert pin.disagreed == 1 and pin.at_commit(None).records == {0: 7, 2: 7}
    pin = ModelPin(9)
    assert pin.assigned({0: 6}, {0: 1}, {}, [8, 9]) is None
    assert pin.unavailable == 1 and pin.version == 9
    assert pin.at_commit(None).records == {0: 9}  # recorded as what it decides with now


def test_a_revocation_forgets_the_records_and_the_fence():
    pin = ModelPin(2)
    pin.assigned({0: 2}, {0: 10}, {0: 0}, [2])
    assert pin.fenced()
    pin.clear()
    assert not pin.fenced() and pin.at_commit(None).records == {}
