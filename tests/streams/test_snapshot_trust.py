"""Bounded, authentic model snapshots at the follower: size limits, a decompression bomb, versions, signatures."""

from __future__ import annotations

import base64
import json
import struct
import tracemalloc
import zlib

from phasewise.kit.records import ModelSnapshot, encode
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import MODELS
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.snapshots import model_name, snapshot_of
from phasewise.streams.follower import SnapshotFollower

MODEL = PhaseModel(features=("cpu", "mem"), n_hid=4, n_his=1, warmup=8)
NAME = model_name(MODEL.features)
KEY = NAME.encode()


class Msg:
    def __init__(self, value, offset, headers=None):
        self._v, self._o, self._h = value, offset, headers

    def error(self):
        return None

    def value(self):
        return self._v

    def key(self):
        return KEY

    def offset(self):
        return self._o

    def headers(self):
        return self._h


def follower(settings: Settings | None = None, keyring=None):
    bad: list[tuple[int, str]] = []
    f = SnapshotFollower(settings or Settings(), NAME, on_bad=lambda v, k, o, why: bad.append((o, why)),
                         keyring=keyring)
    return f, bad


def bomb(unpacked: int) -> bytes:
    """A PhaseModel checkpoint whose one array of *unpacked* zero bytes compresses to ~1/1000 of that."""
    header = json.dumps({"kind": "PhaseModel", "version": PhaseModel.VERSION, "meta": {"params": {}}, "arrays": {
        "normalizer": {"dtype": "|u1", "shape": [unpacked], "offset": 0, "nbytes": unpacked}}}).encode()
    z = zlib.compressobj(9)
    chunk = bytes(2**20)
    body = b"".join(z.compress(chunk) for _ in range(unpacked // 2**20)) + z.flush()
    return b"PWCK" + struct.pack("<I", len(header)) + header + body


def test_a_decompression_bomb_is_refused_before_it_grows_in_memory():
    raw = bomb(400 * 2**20)
    assert len(raw) < 600_000  # ~400 KB that would unpack to 400 MiB
    snap = ModelSnapshot(name=NAME, ts=1.7e9, version=3, payload_b64=base64.b64encode(raw).decode())
    f, bad = follower()
    value = encode(snap)
    tracemalloc.start()
    try:
        f._handle(Msg(value, 0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [o for o, _ in bad] == [0]
    assert "419430400 bytes, more than the 67108864 left to unpack (phase_snapshot_max_unpacked_bytes)" in bad[0][1]
    assert peak < 8 * 2**20, peak  # a few copies of the 540 kB message, never the 400 MiB
    f, bad = follower(Settings().replace(phase_snapshot_max_bytes=100_000))
    f._handle(Msg(value, 1))
    assert "larger than phase_snapshot_max_bytes (100000)" in bad[0][1]


def test_a_snapshot_far_past_the_version_in_use_is_refused_so_genuine_ones_still_follow():
    f, bad = follower(Settings().replace(phase_snapshot_max_version_step=10))
    f._handle(Msg(encode(snapshot_of(MODEL, 5, 1, 1.7e9)), 0))
    f._handle(Msg(encode(snapshot_of(MODEL, 10**9, 1, 1.7e9)), 1))  # forged: would pin the model
    f._handle(Msg(encode(snapshot_of(MODEL, 2**60, 1, 1.7e9)), 2))
    f._handle(Msg(encode(snapshot_of(MODEL, 15, 2, 1.7e9)), 3))  # the learner's next: within the step
    assert [o for o, _ in bad] == [1, 2] and "phase_snapshot_max_version_step (10)" in bad[0][1]
    assert "version above" in bad[1][1]
    assert f.latest()[0].version == 15


def test_with_a_key_only_snapshots_signed_with_it_are_followed():
    ring = Keyring(b"s" * 32)
    f, bad = follower(keyring=ring)
    good = encode(snapshot_of(MODEL, 5, 1, 1.7e9))
    forged = encode(snapshot_of(MODEL, 6, 1, 1.7e9))
    f._handle(Msg(forged, 0))  # unsigned
    f._handle(Msg(forged, 1, Keyring(b"t" * 32).headers(MODELS.name, KEY, forged)))  # another key
    f._handle(Msg(forged, 2, ring.headers(MODELS.name, KEY, good)))  # a genuine signature on other bytes
    f._handle(Msg(good, 3, ring.headers(MODELS.name, KEY, good)))
    assert [o for o, _ in bad] == [0, 1, 2]
    assert "unsigned" in bad[0][1] and "unknown key" in bad[1][1] and "wrong signature" in bad[2][1]
    assert f.latest()[0].version == 5


def test_a_ladder_of_unsigned_snapshots_walks_the_version_up_only_without_a_key():
    """Each step of the ladder is within phase_snapshot_max_version_step of the last, so the step bound
    alone lets it walk the version up (every later genuine snapshot then looks old). With a key, a version
    is taken only from a snapshot signed with it: the ladder is refused rung by rung, also at start-up
    (nothing in use yet), and the learner's next signed snapshot is followed."""
    step = 10
    settings = Settings().replace(phase_snapshot_max_version_step=step)
    genuine = encode(snapshot_of(MODEL, 5, 1, 1.7e9))
    ladder = [encode(snapshot_of(MODEL, 5 + step * k, 1, 1.7e9)) for k in range(1, 41)]
    f, bad = follower(settings)
    f._handle(Msg(genuine, 0))
    for i, v in enumerate(ladder):
        f._handle(Msg(v, i + 1))
    assert not bad and f.latest()[0].version == 5 + 40 * step  # no key: nothing tells the ladder apart

    ring = Keyring(b"s" * 32)
    f, bad = follower(settings, keyring=ring)
    f._handle(Msg(encode(snapshot_of(MODEL, 2**52, 1, 1.7e9)), 0))  # at start-up, nothing in use yet
    f._handle(Msg(genuine, 1, ring.headers(MODELS.name, KEY, genuine)))
    for i, v in enumerate(ladder):
        f._handle(Msg(v, i + 2))
    assert f.latest()[0].version == 5
    assert [o for o, _ in bad] == [0, *range(2, 42)] and all("unsigned" in why for _, why in bad)
    nxt = encode(snapshot_of(MODEL, 6, 2, 1.7e9))
    f._handle(Msg(nxt, 99, ring.headers(MODELS.name, KEY, nxt)))
    assert f.latest()[0].version == 6


def test_the_newest_valid_versions_are_kept_for_a_restarted_worker_and_refused_ones_are_not():
    """A worker restarted on the version in force at its last commit gets it from the follower: the RECENT
    newest valid snapshots are kept (older ones read after newer ones too), none that was refused."""
    from phasewise.streams.follower import RECENT

    f, bad = follower()
    for i, v in enumerate([3, 1, 2]):  # the topic's order need not be the versions'
        f._handle(Msg(encode(snapshot_of(MODEL, v, 1, 1.7e9)), i))
    f._handle(Msg(b"{not json", 3))
    assert f.versions() == [1, 2, 3] and f.latest()[0].version == 3 and len(bad) == 1
    got = f.version(2)
    assert got is not None and got[0].version == 2 and isinstance(got[1], PhaseModel)
    assert f.version(7) is None
    for v in range(4, 4 + RECENT):
        f._handle(Msg(encode(snapshot_of(MODEL, v, 1, 1.7e9)), v))
    assert f.versions() == list(range(4, 4 + RECENT)) and f.version(3) is None
