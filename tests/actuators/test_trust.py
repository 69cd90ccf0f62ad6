"""Fresh and authentic decisions: the actuator's age limits and signature checks, handle() without Kafka."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import DryRunBackend
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from phasewise.kit.signing import HEADER, Keyring, SigningError, keyring_of
from phasewise.kit.topics import DECISIONS
from tests.actuators.conftest import own

NOW = time.time()
KEY, OLD, OTHER = b"k" * 40, b"o" * 40, b"x" * 40


def decision(ts: float = NOW - 1.0, **kw) -> tuple[bytes, bytes]:
    d = Decision(**{"id": uuid.uuid4().hex, "ts": ts, "host": "h1", "container": "job-a", "action": "freeze",
                    "policy": "test", **kw})
    return b"h1", encode(d)


def actuator(recorder, keyring=None, **settings):
    metrics = ActuatorMetrics(CollectorRegistry())
    backend = DryRunBackend()
    a = Actuator(Settings().replace(host="h1", **settings), backend, Ledger(":memory:"), recorder,
                 metrics=metrics, host_cores=4.0, clock=lambda: NOW, keyring=keyring)
    own(a, "job-a")
    return a, backend, metrics


def refused(metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("phasewise_actuator_refused_total", {"reason": reason})


@pytest.mark.parametrize("ts, why, reason", [
    (0.0, "decision_max_age_s", "stale"),
    (NOW - 601, "decision_max_age_s", "stale"),
    (NOW + 301, "decision_max_future_s", "future"),
    (1e300, "decision_max_future_s", "future"),
], ids=["epoch", "601s-old", "301s-ahead", "1e300"])
def test_stale_and_future_decisions_are_rejected_with_the_reason_and_not_claimed(recorder, ts, why, reason):
    a, backend, metrics = actuator(recorder)
    key, raw = decision(ts)
    act = a.handle(raw, key, 0, 0)
    assert act.status == "rejected" and why in act.message and backend.commands == []
    assert refused(metrics, reason) == 1
    assert a.ledger.get(act.decision_id) is None  # a refused id is not taken from a later genuine decision


def test_fresh_decisions_apply_and_the_limits_can_be_turned_off(recorder):
    a, backend, _ = actuator(recorder)
    assert a.handle(*decision(NOW - 599)[::-1], 0, 0).status == "applied"
    a, backend, _ = actuator(recorder, decision_max_age_s=0, decision_max_future_s=0)
    assert a.handle(decision(0.0)[1], b"h1", 0, 1).status == "applied"


def test_signed_decisions_apply_and_unsigned_or_wrongly_signed_ones_are_dead_lettered(recorder):
    ring = Keyring(KEY)
    a, backend, metrics = actuator(recorder, ring)
    key, raw = decision()
    good = [(HEADER, ring.sign(DECISIONS.name, key, raw))]
    cases = {
        "unsigned": (raw, None),
        "wrong signature": (raw.replace(b'"freeze"', b'"thaw"'), good),  # the signed record, changed
        "unknown key": (raw, Keyring(OTHER).headers(DECISIONS.name, key, raw)),
        "malformed": (raw, [(HEADER, b"v1:zz")]),
    }
    for what, (value, headers) in cases.items():
        assert a.handle(value, key, 0, 1, headers=headers) is None, what
    letters = recorder.dead_letters()
    assert [d.reason.split(": ", 1)[1][:14] for d in letters] == [
        "unsigned: no p", "wrong signatur", "signed with an", "malformed phas"]
    assert backend.commands == [] and refused(metrics, "signature") == 4
    other_topic = Keyring(KEY).headers("phasewise.actuations.v1", key, raw)  # signed for another topic
    assert a.handle(raw, key, 0, 2, headers=other_topic) is None
    act = a.handle(raw, key, 0, 3, headers=good)
    assert act.status == "applied" and len(backend.commands) == 1


def test_the_previous_key_is_accepted_until_its_grace_time_only(recorder):
    key, raw = decision()
    old_headers = Keyring(OLD).headers(DECISIONS.name, key, raw)
    a, _, _ = actuator(recorder, Keyring(KEY, OLD, previous_until=NOW + 60))
    assert a.handle(raw, key, 0, 0, headers=old_headers).status == "applied"
    a, _, _ = actuator(recorder, Keyring(KEY, OLD, previous_until=NOW - 1))
    assert a.handle(raw, key, 0, 1, headers=old_headers) is None
    assert "accepted only until" in recorder.dead_letters()[-1].reason


def test_key_files_are_read_strictly_with_one_line_errors(tmp_path):
    def settings(**kw):
        return Settings().replace(**kw)

    assert keyring_of(settings()) is None
    short, good, loose = tmp_path / "short", tmp_path / "good", tmp_path / "loose"
    for p, data, mode in ((short, b"abc\n", 0o600), (good, KEY + b"\n", 0o600), (loose, KEY, 0o644)):
        p.write_bytes(data)
        os.chmod(p, mode)
    for kw, why in (({"signing_key_file": str(tmp_path / "none")}, "cannot read"),
                    ({"signing_key_file": str(short)}, "at least 32"),
                    ({"signing_key_file": str(loose)}, "chmod 600"),
                    ({"signing_previous_key_file": str(good)}, "without signing_key_file"),
                    ({"signing_key_file": str(good), "signing_previous_key_file": str(good)},
                     "signing_previous_key_until")):
        with pytest.raises(SigningError, match=why) as e:
            keyring_of(settings(**kw))
        assert "\n" not in str(e.value)
    ring = keyring_of(settings(signing_key_file=str(good)))
    assert ring.key == KEY  # the trailing newline is not part of the key
