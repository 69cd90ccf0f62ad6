"""The Kafka clients' own logs: an unreachable broker is one line every few seconds."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError

from phasewise.kit.kafka.client import FoldRepeats, KafkaLog, kafka_log

FMT = "%s [%s] %s"  # how confluent-kafka calls a client's ``logger``
REFUSED = "127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 failed: Connection refused (after 0ms in state CONNECT)"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_an_unreachable_broker_is_one_line_every_five_seconds_however_often_it_is_reported(caplog):
    clock = Clock()
    klog = KafkaLog("127.0.0.1:9", clock=clock)
    with caplog.at_level(logging.INFO, logger="phasewise.kafka.client"):
        for i in range(50):  # librdkafka retries every ~50-100 ms; two clients report the same outage
            klog.log(40, FMT, "FAIL", f"rdkafka#producer-{i % 2}", REFUSED)
            klog.error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
            clock.t += 0.098
        assert lines(caplog) == ["no Kafka broker answers at 127.0.0.1:9 (Connection refused); retrying"]
        clock.t = 1005.0
        klog.error(KafkaError(KafkaError._TRANSPORT, REFUSED))
        assert lines(caplog)[-1] == "no Kafka broker answers at 127.0.0.1:9 (Connection refused) for 5 s; retrying"
        assert len(caplog.records) == 2 and all(r.levelno == logging.WARNING for r in caplog.records)
        clock.t = 1007.0
        klog.reachable()
        assert lines(caplog)[-1] == "Kafka broker at 127.0.0.1:9 answers (after 7 s)"
        klog.reachable()  # said once
        assert len(caplog.records) == 3


def test_a_new_outage_after_a_quiet_spell_counts_from_its_own_start(caplog):
    clock = Clock()
    klog = KafkaLog("b:9092", clock=clock)
    with caplog.at_level(logging.WARNING, logger="phasewise.kafka.client"):
        klog.log(40, FMT, "FAIL", "rdkafka#consumer-1", REFUSED)
        clock.t += 3600  # the broker came back (nobody said so), then went away again
        klog.log(40, FMT, "FAIL", "rdkafka#consumer-1", "[thrd:b:9092/1]: b:9092/1: Disconnected (after 5ms in "
                                                         "state UP)")
    assert lines(caplog) == ["no Kafka broker answers at b:9092 (Connection refused); retrying",
                             "no Kafka broker answers at b:9092 (Disconnected); retrying"]


def test_other_client_lines_are_folded_by_shape(caplog):
    clock = Clock()
    klog = KafkaLog("b:9092", clock=clock)
    with caplog.at_level(logging.INFO, logger="phasewise.kafka.client"):
        for ms in range(6010, 6020):
            klog.log(30, FMT, "SESSTMOUT", "rdkafka#consumer-1", f"session timed out after {ms} ms")
        clock.t += 5
        klog.log(30, FMT, "SESSTMOUT", "rdkafka#consumer-1", "session timed out after 6100 ms")
        klog.error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied", fatal=True))
    assert lines(caplog) == ["librdkafka SESSTMOUT: session timed out after 6010 ms",
                             "librdkafka SESSTMOUT: session timed out after 6100 ms (9 more like this)",
                             "kafka: denied"]
    assert caplog.records[-1].levelno == logging.ERROR


def test_every_client_of_a_process_shares_one_kafka_log_per_bootstrap():
    assert kafka_log("x:1") is kafka_log("x:1") and kafka_log("x:1") is not kafka_log("x:2")


def test_fold_repeats_lets_one_line_of_a_shape_through_every_few_seconds():
    clock = Clock()
    f = FoldRepeats(every_s=5.0, clock=clock)

    def rec(name: str, msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)

    passed = []
    for i in range(20):
        r = rec("aiokafka.conn", "Unable connect to node with id %s: [Errno 111] Connect call failed ('127.0.0.1', %s)",
                1, 40000 + i)
        if f.filter(r):
            passed.append(r.getMessage())
        mine = rec("phasewise.streams.agents.samples", "decision %s", i)
        assert f.filter(mine), "phasewise's own lines always pass"
        clock.t += 0.3
    assert passed == ["Unable connect to node with id 1: [Errno 111] Connect call failed ('127.0.0.1', 40000)",
                      "Unable connect to node with id 1: [Errno 111] Connect call failed ('127.0.0.1', 40017) "
                      "(16 more like this in the last 5 s)"]
