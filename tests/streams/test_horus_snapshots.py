"""The horus worker's view of the shared model, record by record (no broker): signed snapshots of
``horus/utilisation`` make the union of learned jobs; another model's records are skipped; an unsigned,
wrongly signed or undecodable one is kept for the event loop to dead-letter."""

from __future__ import annotations

from phasewise.kit.records import encode
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import MODELS
from phasewise.models.horus.snapshot import SNAPSHOT_NAME, snapshot_of
from phasewise.streams.agents.horus import HorusSnapshots

RING = Keyring(b"s" * 48)
KEY = SNAPSHOT_NAME.encode()


def obs(job: str, cpu: float) -> dict:
    return {"job": job, "f": {"flops": 1.0}, "o": {"cpu_cores": cpu}, "d": "cpu"}


def record(observations: list[dict], version: int, ring: Keyring | None = RING, key: bytes = KEY):
    value = encode(snapshot_of(observations, version, ts=1.0))
    return (MODELS.name, 0, version, key, value, ring.headers(MODELS.name, key, value) if ring else None)


def test_the_union_of_signed_snapshots_and_the_bad_ones_kept_for_dead_letters():
    snaps = HorusSnapshots(Settings(), RING, keep=3)
    assert snaps.handle(*record([obs("a", 1.0), obs("b", 2.0)], 1))
    assert snaps.handle(*record([obs("a", 1.0), obs("c", 3.0)], 2))  # another worker's, concurrent
    assert not snaps.handle(*record([obs("x", 9.0)], 3, key=b"phase-crbm/cpu+mem"))  # another model: skipped
    assert not snaps.handle(*record([obs("evil", 50.0)], 4, ring=None))  # unsigned
    assert not snaps.handle(*record([obs("evil", 50.0)], 5, ring=Keyring(b"t" * 48)))  # another key
    assert not snaps.handle(MODELS.name, 0, 6, KEY, b"{not json", RING.headers(MODELS.name, KEY, b"{not json"))
    generation, version, union, bad = snaps.take()
    assert (generation, version) == (2, 2) and [o["job"] for o in union] == ["b", "a", "c"]
    assert [(b[0].offset, b[2]) for b in bad] == [(4, "signature"), (5, "signature"), (6, "schema")]
    assert "Horus ModelSnapshot refused: unsigned" in bad[0][1]
    assert snaps.take()[3] == []  # taken once
    snaps.handle(*record([obs("d", 1.0), obs("e", 1.0)], 7))  # at most keep=3: the oldest go
    assert [o["job"] for o in snaps.take()[2]] == ["c", "d", "e"]
