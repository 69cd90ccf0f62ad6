"""The four changes phasewise makes to Faust's internals, fenced by the versions they were checked on
(:data:`CHECKED`): :func:`bound_fetch_wait` (the consumer's fetch wait from
``kafka_fetch_wait_max_ms``), :func:`seek_before_stream_flow` (no record reaches an agent before a
resumed partition is sought back to its committed offset, or to its first record where none is),
:func:`hold_commits` (a source offset is committed no further than the state that learned its records is
stored) and :func:`take_batches` (a stream's batches, with no wake-up while nothing arrives). Why, and
what they touch: docs/worker.md, "Changes to Faust's internals".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["CHECKED", "bound_fetch_wait", "held_offsets", "hold_commits", "patch_applies", "seek_before_stream_flow",
           "still_wanted", "take_batches"]

log = logging.getLogger(__name__)

#: distribution -> the version prefixes (major.minor) the change was checked on
CHECKED = {"faust-streaming": ("0.15.",), "aiokafka": ("0.14.",)}

_warned: list[tuple[str, str]] = []


def _installed(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def patch_applies() -> str | None:
    """None when the installed Faust and aiokafka are ones the change was checked on; else why not."""
    for dist, prefixes in CHECKED.items():
        v = _installed(dist)
        if not v.startswith(prefixes):
            return f"{dist} {v} is not a version the fetch-wait change was checked on ({', '.join(prefixes)}x)"
    from faust.transport.drivers import aiokafka as drv

    if not callable(getattr(drv.AIOKafkaConsumerThread, "_create_worker_consumer", None)):
        return "Faust's AIOKafkaConsumerThread._create_worker_consumer is gone"
    return None


def _applies(consequence: str) -> bool:
    """Whether a change may be made; if not, one warning per reason and *consequence*."""
    why = patch_applies()
    if why is None:
        return True
    if (why, consequence) not in _warned:
        _warned.append((why, consequence))
        log.warning("%s: %s", why, consequence)
    return False


def bound_fetch_wait(ms: int) -> bool:
    """Bound the Faust worker consumer's fetch long-poll to *ms*; False (and one warning) when not applied."""
    if not _applies("the worker keeps Faust's 1500 ms fetch wait (slower on the embedded broker)"):
        return False
    from faust.transport.drivers import aiokafka as drv

    cls = drv.AIOKafkaConsumerThread
    original = getattr(cls, "_phasewise_original_create", None) or cls._create_worker_consumer

    def create(self, transport):  # type: ignore[no-untyped-def]
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = ms  # read by aiokafka's Fetcher at start()
        return consumer

    cls._phasewise_original_create = original
    cls._create_worker_consumer = create
    return True


def seek_before_stream_flow() -> bool:
    """Stop Faust's flow whenever source partitions are resumed, until its seek resumes it.

    False (and one warning) when the installed versions are not the checked ones.
    """
    if not _applies("records fetched before the post-recovery seek may reach the agents"):
        return False
    from faust.transport.consumer import Consumer

    original = getattr(Consumer, "_phasewise_original_resume", None) or Consumer.resume_partitions

    def resume_partitions(self, tps):  # type: ignore[no-untyped-def]
        tps = list(tps)
        if self.flow_active and any(not self._is_changelog_tp(tp) for tp in tps):
            # the caller seeks to the committed offsets next, then resumes the flow
            self.stop_flow()
        return original(self, tps)

    Consumer._phasewise_original_resume = original
    Consumer.resume_partitions = resume_partitions
    if not hasattr(Consumer, "_phasewise_original_seek"):
        Consumer._phasewise_original_seek = Consumer.perform_seek
    Consumer.perform_seek = perform_seek
    return True


async def perform_seek(self) -> None:  # type: ignore[no-untyped-def]
    """Faust's ``Consumer.perform_seek`` (seek every assigned partition to its committed offset), where a source
    partition the broker holds no committed offset for (or 0) starts from its first record.

    aiokafka's ``seek_to_committed`` seeks only partitions whose committed offset is above 0, and Faust then
    keeps its own committed offset for the others. Such a partition's fetch position is wherever the
    fetcher left it: past the records Faust dropped while it recovered the tables, so a worker that was
    killed before its first commit of a partition never processed those records, and never committed the
    partition. And a commit that failed in a rebalance (Faust records it as done) left Faust believing an
    offset the broker does not hold: records read again below it are never acknowledged. Here both are the
    broker's: the position its first record (what ``consumer_auto_offset_reset="earliest"`` means), Faust's
    committed offset none.
    """
    from faust.transport.consumer import ensure_TP

    committed = await self.seek_to_committed()
    unset = [tp for tp, o in committed.items() if not o and not self._is_changelog_tp(tp)]
    if unset and self.app.conf.consumer_auto_offset_reset == "earliest":  # phasewise's apps
        for tp, first in (await self.earliest_offsets(*unset)).items():
            await self._seek(tp, first)
    self._read_offset.update({tp: o if o is not None and o >= 0 else None for tp, o in committed.items()})
    self._committed_offset.update({ensure_TP(tp): o if o else None for tp, o in committed.items()})


def hold_commits(app: object, topic: str, hold_back: Callable[[], Mapping[int, int]]) -> bool:
    """Commit *topic*'s offsets on *app* no further than *hold_back* says, per partition, when they are sent.

    Faust picks the offsets to commit from the records its agents acknowledged, then awaits its producer's
    flush (where the commit barrier hands out the state to store), then commits. *hold_back* is asked
    after that flush: ``{partition: the oldest offset the stored state does not hold yet}``; an offset
    beyond it is lowered to it, and a partition whose lowered offset is not beyond the one this consumer
    last committed is left out. Faust's own bookkeeping keeps the offsets it chose (it does not read
    them again), so only a restarted or rebalanced worker reads the held-back records, and the state
    skips what it holds.

    Faust forgets the records behind an offset it chose once it is sent, so a partition whose records
    stop (an idle host, the end of a backlog) would keep its held-back offset until a restart. The
    offset Faust chose is kept as wanted while Faust still believes it committed it, and offered again
    at each of Faust's periodic commits (whose flush hands out the states written by then) until it is
    sent; after a rebalance Faust reads the committed offset from the broker again, and a wanted offset
    it no longer matches is dropped. False (and one warning) when not applied.
    """
    if not _applies("a killed worker's state may miss up to state_write_interval_s of samples (exact "
                    "recovery needs state_write_interval_s=0)"):
        return False
    from faust.transport.consumer import Consumer, ThreadDelegateConsumer

    original = getattr(ThreadDelegateConsumer, "_phasewise_original_commit", None) or ThreadDelegateConsumer._commit
    choose = getattr(Consumer, "_phasewise_original_filter", None) or Consumer._filter_committable_offsets

    async def _commit(self, offsets):  # type: ignore[no-untyped-def]
        holds = getattr(self.app, "_phasewise_holds", None)
        if holds:
            chosen = offsets
            sent = self.__dict__.setdefault("_phasewise_sent", {})
            wanted = self.__dict__.setdefault("_phasewise_wanted", {})
            offsets = held_offsets(chosen, holds, sent)
            for tp, o in chosen.items():  # held below Faust's choice: offered again until sent
                if offsets.get(tp, sent.get(tp, -1)) < o:
                    wanted[tp] = o
            if not offsets:
                return True
        done = await original(self, offsets)
        if done and holds:
            sent.update(offsets)
            for tp in [tp for tp, o in wanted.items() if sent.get(tp, -1) >= o]:
                del wanted[tp]
        return done

    def _filter_committable_offsets(self, tps):  # type: ignore[no-untyped-def]
        tps = list(tps)
        out = choose(self, tps)
        wanted = self.__dict__.get("_phasewise_wanted")
        if wanted:
            out.update(still_wanted(tps, out, wanted, self._committed_offset))
        return out

    ThreadDelegateConsumer._phasewise_original_commit = original
    ThreadDelegateConsumer._commit = _commit
    Consumer._phasewise_original_filter = choose
    Consumer._filter_committable_offsets = _filter_committable_offsets
    holds = getattr(app, "_phasewise_holds", None)
    if holds is None:
        holds = {}
        app._phasewise_holds = holds  # type: ignore[attr-defined]
    holds[topic] = hold_back
    return True


def still_wanted(tps: list[Any], chosen: Mapping[Any, int], wanted: dict[Any, int],
                 committed: Mapping[Any, int | None]) -> dict[Any, int]:
    """The wanted offsets of *tps* to offer again (those Faust did not *chosen* anew), dropping from *wanted*
    each one Faust no longer believes *committed* (a rebalance read the broker's offset back).

    >>> wanted = {"a": 9, "b": 5, "c": 7}
    >>> still_wanted(["a", "b"], {"b": 6}, wanted, {"a": 9, "b": 5, "c": 3})
    {'a': 9}
    >>> sorted(wanted)            # c: Faust's committed offset is the broker's again (3), not 7
    ['a', 'b']
    """
    out = {}
    for tp in [tp for tp, o in wanted.items() if committed.get(tp) != o]:
        del wanted[tp]
    for tp in tps:
        if tp not in chosen and (o := wanted.get(tp)) is not None:
            out[tp] = o
    return out


def held_offsets(offsets: Mapping[Any, int], holds: Mapping[str, Callable[[], Mapping[int, int]]],
                 sent: Mapping[Any, int] | None = None) -> dict[Any, int]:
    """*offsets* (``TP -> offset``) lowered to the holds of their topics; those not beyond what was *sent*
    before (the committed offsets) left out.

    >>> from collections import namedtuple
    >>> TP = namedtuple("TP", "topic partition")
    >>> a0, a1, b0 = TP("a", 0), TP("a", 1), TP("b", 0)
    >>> out = held_offsets({a0: 50, a1: 70, b0: 9}, {"a": lambda: {0: 40, 1: 90}}, {a0: 40})
    >>> sorted((tp.topic, tp.partition, o) for tp, o in out.items())   # a0 held at 40, committed already
    [('a', 1, 70), ('b', 0, 9)]
    """
    cache = {t: dict(fn()) for t, fn in holds.items()}
    out = {}
    for tp, offset in offsets.items():
        h = cache.get(tp.topic, {}).get(tp.partition)
        if h is not None and h < offset:
            offset = h
        prev = (sent or {}).get(tp)
        if prev is not None and offset <= prev:
            continue
        out[tp] = offset
    return out


def take_batches(stream: Any, max_: int, within: float) -> AsyncGenerator[list[Any], None]:
    """*stream*'s events in lists of at most *max_*, each yielded *within* seconds after its first event arrived (or
    once full): Faust's ``Stream.take_events`` but for one thing. Faust's waits *within* for a full buffer again
    and again while nothing arrives (every 5 ms by default: 200 idle wake-ups a second, a third or more of an idle
    worker's CPU: docs/worker.md); here a batch's wait starts at its first event, and an empty buffer waits for
    one without a timeout. The latency a batch adds is the same bound (*within* after its first event; 0: none,
    where Faust's reads 0 as no timeout at all). Faust's own ``take_events`` where the versions are not the
    checked ones."""
    if not _applies("an idle worker wakes every worker_batch_wait_ms (Faust's take_events)"):
        return stream.take_events(max_, within=within)  # type: ignore[no-any-return]
    agen = _take_batches(stream, max_, within)
    stream._active_agens.add(agen)  # closed by the stream's on_stop, as Faust tracks its own take_events
    return agen


async def _take_batches(stream: Any, max_: int, within: float) -> AsyncGenerator[list[Any], None]:
    """Faust 0.15's ``Stream.take_events``, with the empty buffer's wait on a first event (``first``)."""
    from mode.utils.aiter import aiter
    from mode.utils.futures import notify

    buffer: list[Any] = []
    events: list[Any] = []
    first, buffer_full, buffer_consumed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    stream_enable_acks: bool = stream.enable_acks
    buffer_consuming: asyncio.Future | None = None
    channel_it = aiter(stream.channel)

    async def add_to_buffer(value: Any) -> Any:
        nonlocal buffer_consuming
        try:
            if buffer_consuming is not None:  # the batch taken is being consumed: wait for it
                try:
                    await buffer_consuming
                finally:
                    buffer_consuming = None
            buffer.append(value)
            event = stream.current_event
            if event is None:
                raise RuntimeError("Take buffer found current_event is None")
            events.append(event)
            first.set()
            if len(buffer) >= max_:
                buffer_full.set()
                buffer_consumed.clear()  # never more than max_ in a batch
                await stream.wait(buffer_consumed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Faust's own handling: logged, the stream crashes
            log.exception("error adding to the take buffer: %r", exc)
            await stream.crash(exc)
        return value

    stream.enable_acks = False  # the events of a batch are acknowledged once it was consumed
    stream.add_processor(add_to_buffer)
    stream._enable_passive(channel_it)
    try:
        while not stream.should_stop:
            if not buffer:
                await stream.wait_for_stopped(first)
            await stream.wait_for_stopped(buffer_full, timeout=within)
            if buffer:
                buffer_consuming = asyncio.get_running_loop().create_future()
                try:
                    yield list(events)
                finally:
                    buffer.clear()
                    for event in events:
                        await stream.ack(event)
                    events.clear()
                    first.clear()
                    buffer_full.clear()
                    notify(buffer_consuming)  # the next event is added after this
                    buffer_consumed.set()
    finally:
        stream.enable_acks = stream_enable_acks
        stream._processors.remove(add_to_buffer)
