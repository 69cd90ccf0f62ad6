"""The model pin (phasewise.models.phases.pinning): which version decides each sample, the partitions'
histories recorded at commits, the fence."""

from __future__ import annotations

from phasewise.models.phases.pinning import (
    ModelPin,
    record_key,
    record_value,
    recorded_history,
    version_in,
)


def test_records_are_read_back_and_anything_else_is_no_record():
    assert recorded_history(record_value([(0, 3), (40, 7)])) == [(0, 3), (40, 7)]
    assert recorded_history(record_value([(0, 3), (40, 7)]))[-1][1] == 7
    assert recorded_history(b'{"model_version":7}') == [(0, 7)]  # a record from before histories
    assert recorded_history({"model_version": 7}) == [(0, 7)]  # a record from before histories, as restored
    for raw in (None, b"", b"{", b"[]", b'{"model_version":-1}', b'{"model_version":1.5}', b'{"v":3}',
                b'{"model_version":true}', b'{"model_version":7,"since":[[0,3]]}',  # its last is not 7
                b'{"model_version":7,"since":[[40,3],[0,7]]}', b'{"model_version":7,"since":[]}',
                b'{"model_version":7,"since":[[0]]}', b'{"model_version":7,"since":"x"}',
                b"[" * 100_000 + b"]" * 100_000, bytes(range(256)) * 2400):  # deep, and 600 kB of binary
        assert recorded_history(raw) is None, raw
    assert "/" not in record_key(3)  # never a container's host/container key
    assert [version_in([(10, 1), (20, 2)], o) for o in (0, 10, 19, 20, 99)] == [1, 1, 1, 2, 2]


def test_a_first_start_records_its_version_from_where_it_started_and_each_swap_from_where_it_was():
    pin = ModelPin(4)
    assert pin.assigned({0: None, 1: None}, {0: 100, 1: 50}, {0: 30, 1: None}, [4]) == set()
    assert not pin.fenced() and pin.version_at(0, 35) == 4  # no record: no fence, the version in use
    for off in range(30, 60):
        pin.processed(0, off)
    plan = pin.at_commit(None)
    assert not plan.swap and plan.records == {0: [(30, 4)], 1: [(0, 4)]}
    assert pin.at_commit(None).records == {}  # recorded once
    plan = pin.at_commit(5)  # partition 1 processed nothing since: its entry is replaced
    assert plan.swap and pin.version == 5 and plan.records == {0: [(30, 4), (60, 5)], 1: [(0, 5)]}
    assert not pin.at_commit(5).swap  # not newer than the version in force
    plan = pin.at_commit(None, {0: 75, 1: None})  # offsets committed past 60: the entry before it goes
    assert plan.records == {0: [(60, 5)]}


def test_a_restart_decides_each_sample_read_again_with_its_version_and_swaps_only_past_the_fence():
    pin = ModelPin(9)  # the newest when the restarted worker came up
    hist0 = [(0, 5), (90, 6), (110, 8)]  # 90: committed after; 110: a swap the killed worker made
    assert pin.assigned({0: hist0, 1: [(0, 6)]}, {0: 120, 1: 40}, {0: 100, 1: None}, [5, 6, 8, 9]) == set()
    assert pin.history[0] == [(90, 6), (110, 8)]  # what no restart reads again is dropped
    assert [pin.version_at(0, o) for o in (100, 109, 110, 130)] == [6, 6, 8, 8]
    assert pin.version_at(1, 3) == 6 and pin.fenced()
    plan = pin.at_commit(9)
    assert not plan.swap and plan.records == {0: [(90, 6), (110, 8)]}  # its pruning is recorded
    for off in range(100, 120):
        pin.processed(0, off)
    assert pin.fenced()  # partition 1 not read to its end yet
    pin.processed(1, 39)
    pin.version = 8  # what the last round was decided with
    assert not pin.fenced() and pin.version_at(1, 41) == 8  # from here on, one version
    plan = pin.at_commit(9)
    assert plan.swap and pin.version == 9
    assert plan.records == {0: [(90, 6), (110, 8), (120, 9)], 1: [(0, 6), (40, 9)]}


def test_a_version_gone_is_said_and_its_samples_take_the_version_in_use():
    pin = ModelPin(9)
    assert pin.assigned({0: [(0, 6), (50, 7)]}, {0: 80}, {0: 10}, [7, 9]) == {6}
    assert pin.unavailable == 1 and pin.version_at(0, 20) == 9 and pin.version_at(0, 60) == 7


def test_a_revocation_forgets_the_histories_and_the_fence():
    pin = ModelPin(2)
    pin.assigned({0: [(0, 2)]}, {0: 10}, {0: 0}, [2])
    assert pin.fenced()
    pin.clear()
    assert not pin.fenced() and pin.at_commit(None).records == {} and pin.version_at(0, 5) == 2


def test_every_sample_a_restart_could_read_again_is_named_with_the_version_that_decided_it():
    """Random runs of two partitions with commits and swaps: after each commit, the records name, for every
    offset at or past the one committed before it, the version that decided that sample, and last the
    version in force."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        pin = ModelPin(0)
        first = rng.randrange(0, 5)
        pin.assigned({0: None, 1: None}, {0: first, 1: 0}, {0: first, 1: None}, [])
        used: dict[int, dict[int, int]] = {0: {}, 1: {}}
        off, v, committed, recs = {0: first, 1: 0}, 0, {0: first, 1: None}, {}
        for _ in range(60):
            p = rng.randrange(2)
            used[p][off[p]] = v
            pin.processed(p, off[p])
            off[p] += 1
            if rng.random() < 0.2:  # a commit, with a newer version half the time
                pin.version = v
                plan = pin.at_commit(v + 1 if rng.random() < 0.5 else None, committed)
                v = pin.version
                recs.update({q: recorded_history(record_value(h)) for q, h in plan.records.items()})
                for q in (0, 1):
                    h = recs.get(q)
                    read_again = {o: w for o, w in used[q].items() if o >= (committed[q] or 0)}
                    assert not read_again or h is not None
                    assert all(version_in(h, o) == w for o, w in read_again.items()), (q, h, read_again)
                    assert h is None or h[-1][1] == v
                committed = {q: rng.randint(committed[q] or 0, off[q]) if off[q] else committed[q] for q in (0, 1)}
