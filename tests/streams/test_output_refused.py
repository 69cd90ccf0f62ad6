"""A record refused for itself (too large) goes to its input's handler; the worker goes on (phasewise.streams.output).

librdkafka refuses a record larger than ``message.max.bytes`` at ``produce()``
(the real client here, no broker needed); a broker refuses one in its delivery
report, which the fake producer of tests/streams/test_output.py reports with a
real ``KafkaError`` (the embedded broker takes records of any size).
"""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from prometheus_client import CollectorRegistry

from phasewise.kit.settings import Settings
from phasewise.streams.job_inputs import Input, dead_letterer, refused_output
from phasewise.streams.metrics import WorkerMetrics
from phasewise.streams.output import CommitBarrier, DeliveryFailed, OutputSender, record_refusal
from tests.streams.test_output import FakeProducer, FakeTable, changelog


class BrokerRefuses(FakeProducer):
    """Delivery reports as a broker gives them: records over *limit* bytes refused as too large; records
    to *down* topics failed by the network."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.down: set[str] = set()

    def poll(self, timeout: float) -> int:
        n = 0
        while self.queued and self.releasable > 0:
            msg, cb = self.queued.pop(0)
            self.releasable -= 1
            if msg.topic() in self.down:
                err = KafkaError(KafkaError._TRANSPORT)
            elif len(msg.value or b"") > self.limit:
                err = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
            else:
                err = None
                self.delivered.append(msg)
            cb(err, _Msg(msg))
            n += 1
        return n


class _Msg:
    """A delivery report's message (confluent-kafka's methods)."""

    def __init__(self, m) -> None:
        self.m = m

    def topic(self) -> str:
        return self.m.topic()

    def value(self) -> bytes:
        return self.m.value


def test_librdkafka_refusing_a_record_at_produce_calls_its_handler_and_nothing_fails():
    p = Producer({"bootstrap.servers": "127.0.0.1:1", "message.max.bytes": 10_000})  # the real client
    out = OutputSender(p)
    got: list[str] = []
    out.send("decisions", b"h", b"x" * 20_000, on_refused=got.append)
    assert len(got) == 1 and "decisions refused a record of 20000 bytes" in got[0], got
    assert "too large" in got[0].lower()
    assert (out.refused, out.sent, out.failure) == (1, 0, None)
    asyncio.run(out.flush())  # nothing in flight, nothing failed
    with pytest.raises(KafkaException):  # without a handler: as before, the caller's error
        out.send("decisions", b"h", b"x" * 20_000)


def test_a_broker_refusal_in_the_delivery_report_calls_the_handler_and_the_flush_waits_for_what_it_sent():
    p = BrokerRefuses(limit=100)
    out = OutputSender(p, poll_interval_s=0.001)

    async def scenario():
        out.send("decisions", b"h", b"small")
        out.send("decisions", b"h", b"x" * 500, on_refused=lambda why: out.send("letters", b"k", b"letter: " +
                                                                                 why.encode()[:60]))
        flush = asyncio.ensure_future(out.flush())
        p.releasable = 2
        await asyncio.sleep(0.02)
        assert not flush.done()  # the handler's letter is out, not delivered: the flush waits for it
        assert [m.topic() for m, _ in p.queued] == ["letters"]
        p.releasable = 1
        await asyncio.wait_for(flush, 1.0)
        assert [m.value[:40] for m in p.delivered] == [b"small", b"letter: decisions refused a record of 50"]
        assert (out.refused, out.failure) == (1, None)

    asyncio.run(scenario())


def test_a_network_failure_still_fails_even_with_a_handler():
    p = BrokerRefuses(limit=100)
    p.down = {"decisions"}
    out = OutputSender(p, poll_interval_s=0.001)
    called: list[str] = []
    out.send("decisions", b"h", b"small", on_refused=called.append)
    p.releasable = 1
    with pytest.raises(DeliveryFailed, match="decisions"):  # sent again after a restart, it may well go
        asyncio.run(out.flush())
    assert called == []


def test_record_refusal_names_only_errors_about_the_record():
    assert record_refusal(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), "t", 5) is not None
    assert record_refusal(KafkaError(KafkaError.INVALID_RECORD), "t", 5) is not None
    for code in (KafkaError._TRANSPORT, KafkaError._MSG_TIMED_OUT, KafkaError.NOT_LEADER_FOR_PARTITION,
                 KafkaError.TOPIC_AUTHORIZATION_FAILED):
        assert record_refusal(KafkaError(code), "t", 5) is None
    assert record_refusal(None, "t", 5) is None and record_refusal("broker says no", "t", 5) is None


def test_the_input_of_a_refused_output_is_a_dead_letter_and_its_state_change_goes_with_the_same_commit():
    """The barrier takes again what the handlers changed (here: a job forgotten), in the commit that
    delivered their dead letters; a handler's dead letter names the input and why."""
    from phasewise.kit.records import DeadLetter, decode

    p = BrokerRefuses(limit=700)  # (the dead letter, ~400 bytes, fits)
    metrics = WorkerMetrics(CollectorRegistry())
    out = OutputSender(p, metrics, poll_interval_s=0.001)
    barrier = CommitBarrier(out, metrics)
    writes = barrier.table(FakeTable())
    state: dict[str, bytes | None] = {"job/a": b"placed"}
    held: dict[str, bytes | None] = dict(state)

    def hold() -> None:
        for k, v in held.items():
            writes.put(k, v, 0)
        held.clear()

    barrier.before.append(hold)
    dead_letter = dead_letterer(Settings.from_env({}, env={}), out, metrics)
    letter = refused_output(dead_letter, Input("phasewise.job-events.v1", b"a", b'{"job":"a"}', 0, 7))

    def forget(why: str) -> None:
        held["job/a"] = None  # the job is forgotten: a tombstone in this commit
        letter(why)

    async def scenario():
        out.send("phasewise.decisions.v1", b"h", b"d" * 1000, on_refused=forget)
        commit = asyncio.ensure_future(barrier.before_commit())
        for _ in range(200):
            p.releasable = len(p.queued)
            await asyncio.sleep(0.005)
            if commit.done():
                break
        await asyncio.wait_for(commit, 1.0)

    asyncio.run(scenario())
    # the forgetting, not the stale "placed"
    assert [(k, v) for _, k, v in changelog(p.delivered)] == [(b'"job/a"', None)] * 2  # (and its seal)
    (dl,) = [decode(DeadLetter, m.value) for m in p.delivered if m.topic() == "phasewise.deadletters.v1"]
    assert (dl.source_topic, dl.key, dl.offset) == ("phasewise.job-events.v1", "a", 7)
    assert dl.reason.startswith("an output record this input caused was refused: phasewise.decisions.v1 "
                                "refused a record of 1000 bytes")
    assert metrics.registry.get_sample_value("phasewise_worker_dead_letters_total", {"kind": "output_refused"}) == 1
