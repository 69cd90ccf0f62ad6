"""A lost ledger is noticed and rebuilt before the actuator applies anything.

:func:`verify_ledger` asks the broker whether this host's consumer group has
committed offsets on the decisions topic; if it has, the new ledger replaces
a lost one: the actuator says so loudly (log, metric, alert) and restores
the decision ids it handled from its own recent actuations before it
applies anything. What this restores and what not: docs/security.md, "A
lost ledger"; docs/runbooks.md, "PhasewiseActuatorLedgerLost".
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from phasewise.actuators.ledger import Ledger
from phasewise.kit.records import Actuation, SchemaError, decode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import ACTUATIONS, DECISIONS

__all__ = ["LedgerRestoreError", "group_has_run", "restore_from_actuations", "restore_since", "verify_ledger"]

log = logging.getLogger("phasewise.actuator")

#: seconds of clock difference allowed between this host and the broker's record times
CLOCK_SKEW_S = 60.0
#: seconds the restore may take before the actuator gives up (and retries at its next start)
RESTORE_TIMEOUT_S = 300.0
#: seconds between tries while the broker does not answer
RETRY_S = 5.0


class LedgerRestoreError(RuntimeError):
    """The actuations could not be read to their end: the ledger stays unverified."""


def group_has_run(consumer: Any, topic: str = DECISIONS.name, timeout_s: float = 10.0) -> bool:
    """Whether *consumer*'s group has committed an offset on any partition of *topic*.

    Raises ``KafkaException`` when the broker does not answer.
    """
    from confluent_kafka import TopicPartition

    md = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if md is None or md.error is not None or not md.partitions:
        return False
    committed = consumer.committed([TopicPartition(topic, p) for p in md.partitions], timeout=timeout_s)
    return any(tp.error is None and tp.offset >= 0 for tp in committed)


def restore_since(settings: Settings, now: float) -> float:
    """The oldest actuation time that matters: older decisions are refused by their age."""
    a = settings.actuator
    if not a.decision_max_age_s:  # no age limit: as far back as the ledger itself keeps entries
        return now - a.ledger_max_age_days * 86400
    return now - a.decision_max_age_s - a.decision_max_future_s - CLOCK_SKEW_S


def restore_from_actuations(settings: Settings, ledger: Ledger, *, since: float, group: str,
                            timeout_s: float = RESTORE_TIMEOUT_S, stop: threading.Event | None = None) -> int:
    """Enter into *ledger* the decision ids of this host's actuations published since *since* (Unix s).

    Reads every partition of the actuations topic from the first record at or
    after *since* to its end (the end read at the start; on the embedded
    broker, whose high watermark can be the first offset of the last batch,
    what that last fetch brought is read too). Returns how many ids were
    entered; raises :class:`LedgerRestoreError` if it could not finish.
    *group*: the actuator's consumer group (the reader's own id is derived from it).
    """
    from confluent_kafka import KafkaException, TopicPartition

    from phasewise.kit.kafka.client import make_consumer

    host = settings.host
    key = host.encode()
    c = make_consumer(settings, f"{group}-ledger-restore")  # assigned: it never joins a group or commits
    deadline = time.monotonic() + timeout_s
    restored = seen = 0
    try:
        md = c.list_topics(ACTUATIONS.name, timeout=10).topics.get(ACTUATIONS.name)
        if md is None or md.error is not None:
            raise LedgerRestoreError(f"topic {ACTUATIONS.name} cannot be read: {md.error if md else 'missing'}")
        wanted = [TopicPartition(ACTUATIONS.name, p, int(since * 1000)) for p in sorted(md.partitions)]
        ends: dict[int, int] = {}
        assign = []
        for tp in c.offsets_for_times(wanted, timeout=10):
            if tp.error is not None:
                raise LedgerRestoreError(f"{ACTUATIONS.name}[{tp.partition}]: no offset for the time: {tp.error}")
            if tp.offset < 0:  # no record at or after *since*
                continue
            high = c.get_watermark_offsets(TopicPartition(ACTUATIONS.name, tp.partition), timeout=10)[1]
            if high > tp.offset:
                ends[tp.partition] = high
                assign.append(tp)
        c.assign(assign)

        def take(m: Any) -> None:
            nonlocal restored, seen
            if m.key() != key:
                return
            try:
                a = decode(Actuation, m.value())
            except SchemaError:
                return  # not ours to judge here; the topic's readers dead-letter it
            if a.host != host:
                return
            seen += 1
            note = f"restored from its actuation of {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(a.ts))}"
            if ledger.restore(a.decision_id, container=a.container, claimed=a.ts, status=a.status,
                              message=f"{a.message} ({note})" if a.message else note):
                restored += 1

        while ends:
            if stop is not None and stop.is_set():
                raise LedgerRestoreError("stopped before the actuations were read")
            if time.monotonic() > deadline:
                raise LedgerRestoreError(f"actuations not read to their end within {timeout_s:g} s "
                                         f"(partitions {sorted(ends)} left)")
            for m in c.consume(500, 0.5):
                err = m.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    continue
                take(m)
                end = ends.get(m.partition())
                if end is not None and m.offset() + 1 >= end:
                    del ends[m.partition()]
        # records the last fetches brought beyond the high watermarks read at the start
        for _ in range(20):
            batch = c.consume(500, 0.2)
            if not batch:
                break
            for m in batch:
                if m.error() is None:
                    take(m)
    finally:
        c.close()
    log.info("read %d actuations of host %s since %s; %d decision ids restored", seen, host,
             time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)), restored)
    return restored


def verify_ledger(settings: Settings, ledger: Ledger, consumer: Any, metrics: Any, stop: threading.Event, *,
                  group: str, clock: Any = time.time) -> bool:
    """Check an unverified *ledger* against *consumer*'s group (*group*) and restore it if it replaces a lost one.

    Waits for the broker meanwhile (retrying every :data:`RETRY_S`); ``False``
    when *stop* was set first. Raises :class:`LedgerRestoreError` when the
    actuations could not be read (the ledger stays unverified).
    """
    from confluent_kafka import KafkaException

    if not ledger.unverified:
        return True
    while True:
        try:
            ran = group_has_run(consumer)
            break
        except KafkaException as e:
            log.warning("cannot check the new ledger against the consumer group yet: %s; retrying", e)
            if stop.wait(RETRY_S):
                return False
    if not ran:
        log.info("new ledger %s: consumer group has no committed offsets (a first start)", ledger.path)
        ledger.verified()
        return True
    now = clock()
    since = restore_since(settings, now)
    metrics.ledger_lost.set(now)
    log.error("LEDGER LOST: %s is new, but this host's consumer group has committed offsets on %s, so this "
              "actuator ran before and its ledger of applied decisions is gone (deleted, or its state volume "
              "lost). Restoring the decisions it handled from its actuations since %s before applying anything; "
              "see docs/runbooks.md#phasewiseactuatorledgerlost", ledger.path, DECISIONS.name,
              time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)))
    try:
        n = restore_from_actuations(settings, ledger, since=since, group=group, stop=stop)
    except LedgerRestoreError:
        if stop.is_set():
            log.info("stopped while restoring the ledger; it is restored again at the next start")
            return False
        raise
    metrics.ledger_restored.inc(n)
    ledger.verified()
    log.warning("ledger %s restored: %d decision ids handled before the loss will not be applied again", ledger.path,
                n)
    return True
