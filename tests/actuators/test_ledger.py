"""The ledger: each decision id claimed once, across restarts, bounded."""

from __future__ import annotations

import time

import pytest

from phasewise.actuators.ledger import Ledger, ledger_path


def test_a_decision_id_can_be_claimed_only_once():
    with Ledger(":memory:") as led:
        assert led.claim("d1", container="c", now=1.0)
        assert not led.claim("d1", container="c", now=2.0)
        assert led.claim("d2", container="c", now=2.0)
        assert len(led) == 2


def test_the_ledger_survives_a_restart(tmp_path):
    path = ledger_path(tmp_path, "host-1")
    t0 = time.time()  # (re-opening prunes entries older than max_age_s against the clock)
    with Ledger(path) as led:
        assert led.claim("d1", container="job-a", now=t0)
        led.finish("d1", "clamped", "cpu raised to the floor")
        assert led.claim("d2", container="job-a", now=t0 + 1)  # claimed, then "crash" before finish
    with Ledger(path) as led:
        assert not led.claim("d1", container="job-a", now=t0 + 100)
        e = led.get("d1")
        assert (e.status, e.message, e.claimed) == ("clamped", "cpu raised to the floor", t0)
        assert not led.claim("d2", container="job-a", now=t0 + 100)
        assert led.get("d2").status is None  # interrupted: reported, never re-applied


def test_each_host_gets_its_own_file_with_a_safe_name(tmp_path):
    assert ledger_path(tmp_path, "node-1.example") == tmp_path / "actuator-node-1.example.sqlite"
    assert ledger_path(tmp_path, "a/../b").name == "actuator-a_.._b.sqlite"


def test_old_entries_are_pruned_by_age(tmp_path):
    with Ledger(tmp_path / "l.sqlite", max_age_s=10) as led:
        led.claim("old", container="c", now=100.0)
        led.claim("new", container="c", now=105.0)
        assert led.prune(now=112.0) == 1
        assert "old" not in led and "new" in led


def test_the_ledger_keeps_only_the_newest_rows_beyond_its_bound():
    with Ledger(":memory:", max_rows=3, prune_every=2) as led:
        for i in range(6):
            led.claim(f"d{i}", container="c", now=1000.0 + i)
        led.prune(now=1006.0)
        assert len(led) == 3
        assert all(f"d{i}" in led for i in (3, 4, 5))


def test_finishing_an_unclaimed_decision_is_an_error():
    with Ledger(":memory:") as led, pytest.raises(KeyError, match="not claimed"):
        led.finish("nope", "applied")


def test_terminations_survive_a_restart_until_the_container_is_started_again(tmp_path):
    import time

    now = time.time()
    with Ledger(tmp_path / "l.sqlite", max_age_s=100) as led:
        led.record_termination("job-a", "t1", now=now)
        assert led.terminated("job-b") is None
    with Ledger(tmp_path / "l.sqlite", max_age_s=100) as led:  # opening prunes what is older than 100 s
        assert led.terminated("job-a") == ("t1", now)
        led.forget_termination("job-a")
        assert led.terminated("job-a") is None
        led.record_termination("job-c", "t2", now=now)
        led.prune(now=now + 101.0)
        assert led.terminated("job-c") is None


def test_a_checkpoint_stop_is_resumable_and_a_ledger_from_before_the_column_gains_it(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite"
    with Ledger(path) as led:
        led.record_termination("job-a", "t1", resumable=True)
        led.record_termination("job-b", "t2")
        assert (led.resumable("job-a"), led.resumable("job-b"), led.resumable("job-c")) == (True, False, False)
    with sqlite3.connect(path) as db:  # as a ledger written before the column was
        db.execute("ALTER TABLE terminations DROP COLUMN resumable")
    with Ledger(path) as led:
        assert led.terminated("job-a") is not None and not led.resumable("job-a")  # kept, as a plain terminate
        led.record_termination("job-a", "t3", resumable=True)
        assert led.resumable("job-a")


# --------------------------------------------------------------------------- a new ledger is unverified


def test_a_new_ledger_is_unverified_until_checked_and_a_deleted_one_is_new_again(tmp_path):
    path = ledger_path(tmp_path, "h")
    with Ledger(path) as led:
        assert led.unverified
    with Ledger(path) as led:  # not checked yet (stopped, or the check failed): still unverified
        assert led.unverified
        led.verified()
        assert not led.unverified
        assert led.claim("d1", container="c")
    with Ledger(path) as led:
        assert not led.unverified and "d1" in led
    for p in tmp_path.glob(path.name + "*"):  # the database and its WAL files
        p.unlink()
    with Ledger(path) as led:
        assert led.unverified and "d1" not in led


def test_a_ledger_of_the_earlier_format_is_not_taken_for_a_new_one(tmp_path):
    import sqlite3

    path = ledger_path(tmp_path, "h")
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE decisions (id TEXT PRIMARY KEY, container TEXT NOT NULL, claimed REAL NOT NULL,"
                     " status TEXT, message TEXT NOT NULL DEFAULT '');"
                     "CREATE TABLE terminations (container TEXT PRIMARY KEY, decision TEXT NOT NULL,"
                     " at REAL NOT NULL);")
    db.close()
    with Ledger(path) as led:
        assert not led.unverified


def test_restored_decisions_are_duplicates_and_a_restore_never_overwrites():
    with Ledger(":memory:") as led:
        assert led.claim("d1", container="c", now=time.time())
        led.finish("d1", "applied", "set cpu 1")
        assert not led.restore("d1", container="c", claimed=1.0, status="failed", message="x")
        assert led.get("d1").status == "applied"
        now = time.time()
        assert led.restore("d2", container="c", claimed=now, status="clamped", message="restored")
        assert not led.claim("d2", container="c", now=now)
        assert (led.get("d2").status, led.get("d2").message) == ("clamped", "restored")


def test_the_registry_of_started_jobs_survives_a_restart_and_records_their_end(tmp_path):
    path = ledger_path(tmp_path, "h1")
    t0 = time.time()
    with Ledger(path) as led:
        led.record_start("ctr-a", job="job-a", decision="p1", backend="cgroup-v1", pid=100, spec_digest="ab" * 32,
                         now=t0)
        assert led.started_job("other") is None
    with Ledger(path) as led:
        row = led.started_job("ctr-a")
        assert (row.job, row.decision, row.backend, row.pid, row.spec_digest, row.started, row.ended) == (
            "job-a", "p1", "cgroup-v1", 100, "ab" * 32, t0, None)
        assert not led.record_end("ctr-a", pid=99, exit_status=0, now=t0 + 1)  # not its process
        assert led.record_end("ctr-a", pid=100, exit_status=-9, now=t0 + 2)
        assert not led.record_end("ctr-a", now=t0 + 3)  # ended already: the first end stands
        row = led.started_job("ctr-a")
        assert (row.ended, row.exit_status) == (t0 + 2, -9)
        # resumed: the same container, a new process, running again
        led.record_start("ctr-a", job="job-a", decision="p2", backend="cgroup-v1", pid=200, now=t0 + 4)
        row = led.started_job("ctr-a")
        assert (row.decision, row.pid, row.started, row.ended, row.exit_status) == ("p2", 200, t0 + 4, None, None)


def test_ended_jobs_are_pruned_with_old_decisions_and_running_ones_are_kept():
    with Ledger(":memory:", max_age_s=100) as led:
        led.record_start("done", job="done", decision="p1", backend="b", pid=1, now=0.0)
        led.record_start("running", job="running", decision="p2", backend="b", pid=2, now=0.0)
        led.record_end("done", now=10.0)
        led.prune(now=200.0)
        assert led.started_job("done") is None and led.started_job("running") is not None


def test_held_shares_are_kept_across_an_open_bounded_and_taken_once(tmp_path):
    path, t = tmp_path / "l.sqlite", time.time()
    with Ledger(path) as led:
        for i in range(5):
            led.hold_share(f"j{i}", f"share {i}".encode(), most=3, now=t + i)
        led.hold_share("j4", b"share 4 again", most=3, now=t + 10)   # a newer share replaces the held one
    with Ledger(path) as led:
        assert led.held_shares() == 3 and led.take_share("j0") is None and led.take_share("j1") is None
        assert led.take_share("j4") == b"share 4 again" and led.take_share("j4") is None
        led.prune(now=t + led.max_age_s + 4)                         # older than max_age_s: dropped
        assert led.held_shares() == 0
