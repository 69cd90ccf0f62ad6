"""The changes to Faust's internals (the fetch wait, the seek before the flow, the held-back commits, the
batches taken with no idle wake-up) hold on the installed versions, or fail loudly.

An upgrade of faust-streaming or aiokafka fails here first: check that the
private names still do what :mod:`phasewise.streams.faust_compat` says, then
extend its ``CHECKED``.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

import pytest

pytest.importorskip("faust")

from phasewise.streams import faust_compat  # noqa: E402


def test_the_installed_faust_and_aiokafka_are_versions_the_change_was_checked_on():
    why = faust_compat.patch_applies()
    assert why is None, (f"{why}: re-check streams/faust_compat.py against faust-streaming "
                         f"{version('faust-streaming')} and aiokafka {version('aiokafka')}, then extend CHECKED")


def test_faust_still_hard_codes_the_wait_the_change_replaces():
    from faust.transport.drivers import aiokafka as drv

    cls = drv.AIOKafkaConsumerThread
    original = getattr(cls, "_phasewise_original_create", cls._create_worker_consumer)
    assert "fetch_max_wait_ms=1500" in inspect.getsource(original), (
        "Faust no longer hard-codes fetch_max_wait_ms=1500: use its setting instead of faust_compat")


def test_aiokafka_reads_the_attribute_the_change_sets_when_the_consumer_starts():
    from aiokafka import AIOKafkaConsumer

    assert "fetch_max_wait_ms=self._fetch_max_wait_ms" in inspect.getsource(AIOKafkaConsumer.start)


def test_on_an_unchecked_version_the_change_is_not_made_and_says_so(monkeypatch, caplog):
    monkeypatch.setitem(faust_compat.CHECKED, "faust-streaming", ("99.",))
    monkeypatch.setattr(faust_compat, "_warned", [])
    assert faust_compat.patch_applies() is not None
    with caplog.at_level("WARNING"):
        assert faust_compat.bound_fetch_wait(20) is False
        assert faust_compat.seek_before_stream_flow() is False
    assert "keeps Faust's 1500 ms fetch wait" in caplog.text
    assert "records fetched before the post-recovery seek may reach the agents" in caplog.text


def test_resuming_a_source_partition_stops_the_flow_until_the_seek_resumes_it():
    from faust.transport.consumer import Consumer

    assert faust_compat.seek_before_stream_flow()
    calls: list = []

    class Stub:  # the attributes of Faust's Consumer the wrapper and the original touch
        flow_active = True
        _paused_partitions: set = set()

        def __init__(self) -> None:
            self.active: set = set()

        def _is_changelog_tp(self, tp) -> bool:
            return tp.topic.endswith("-changelog")

        def stop_flow(self) -> None:
            calls.append("stop_flow")
            self.flow_active = False

        def _get_active_partitions(self) -> set:
            return self.active

    from faust.types import TP

    c = Stub()
    Consumer.resume_partitions(c, [TP("w-vpa-state-changelog", 0)])  # recovery reading a changelog
    assert calls == [] and c.flow_active
    Consumer.resume_partitions(c, [TP("phasewise.samples.v1", 0), TP("w-vpa-state-changelog", 1)])
    assert calls == ["stop_flow"] and not c.flow_active and len(c.active) == 3


def test_faust_resumes_source_partitions_before_its_seek_and_resumes_the_flow_after_it():
    """What the wrapper relies on: both callers that resume source partitions seek, then resume the flow."""
    from faust.tables.recovery import Recovery

    for fn in (Recovery.on_recovery_completed, Recovery._resume_streams):
        src = inspect.getsource(fn)
        assert src.index("resume_partitions") < src.index("perform_seek") < src.index("resume_flow()"), fn


def test_faust_flushes_its_producer_between_choosing_offsets_and_sending_them():
    """The hold is asked in ``_commit``, after the flush that runs the commit barrier (which hands out the
    state): the order the change relies on."""
    from faust.transport.consumer import Consumer, ThreadDelegateConsumer

    src = inspect.getsource(Consumer._commit_offsets)
    assert src.index("self.app.producer.flush()") < src.index("self._commit(committable_offsets)")
    original = getattr(ThreadDelegateConsumer, "_phasewise_original_commit", ThreadDelegateConsumer._commit)
    assert "self._thread.commit(offsets)" in inspect.getsource(original)


def held_app(hold: dict, sent: list[dict]):
    """An app whose samples commits *hold* holds back, and the broker's commit call (it records what is *sent*)."""
    from types import SimpleNamespace

    async def commit(offsets):
        sent.append(dict(offsets))
        return True

    app = SimpleNamespace()
    assert faust_compat.hold_commits(app, "samples", lambda: hold)
    return app, commit


def test_the_offsets_sent_are_held_back_and_never_behind_what_was_sent_before():
    import asyncio
    from types import SimpleNamespace

    from faust.transport.consumer import ThreadDelegateConsumer
    from faust.types import TP

    sent: list[dict] = []
    hold = {0: 40}
    app, commit = held_app(hold, sent)
    consumer = SimpleNamespace(app=app, _thread=SimpleNamespace(commit=commit))
    s0, s1, d0 = TP("samples", 0), TP("samples", 1), TP("decisions", 0)
    run = lambda offsets: asyncio.run(ThreadDelegateConsumer._commit(consumer, offsets))  # noqa: E731
    assert run({s0: 50, s1: 70, d0: 5})
    assert sent[-1] == {s0: 40, s1: 70, d0: 5}
    assert run({s0: 60})                       # still held at 40, sent already: nothing to send
    assert len(sent) == 1
    hold.clear()
    assert run({s0: 61}) and sent[-1] == {s0: 61}
    plain = SimpleNamespace(app=SimpleNamespace(), _thread=SimpleNamespace(commit=commit))  # another app: untouched
    asyncio.run(ThreadDelegateConsumer._commit(plain, {s0: 3}))
    assert sent[-1] == {s0: 3}


def test_an_offset_held_back_on_a_partition_that_goes_quiet_is_committed_once_the_state_holds_it():
    """Faust forgets the records behind an offset once it chose it: with no new record on the partition, the
    held-back offset is offered again at each periodic commit until the hold lets it through; after a
    rebalance (Faust's committed offset read back from the broker) it is dropped."""
    import asyncio
    from types import SimpleNamespace

    from faust.transport.consumer import Consumer, ThreadDelegateConsumer
    from faust.types import TP

    s0, s1 = TP("samples", 0), TP("samples", 1)
    sent: list[dict] = []
    acked: dict = {}      # the offset Faust would choose anew, per partition (taken once, as Faust does)
    committed: dict = {}  # Faust's own idea of what it committed
    hold = {0: 40}
    app, commit = held_app(hold, sent)
    consumer = SimpleNamespace(app=app, _thread=SimpleNamespace(commit=commit), _committed_offset=committed,
                               _new_offset=lambda tp: acked.pop(tp, None),
                               _should_commit=lambda tp, o: committed.get(tp) is None or o > committed[tp])

    def periodic_commit() -> None:  # Faust's _commit_tps and _commit_offsets, reduced to what they do here
        offsets = Consumer._filter_committable_offsets(consumer, iter([s0, s1]))
        if offsets:
            asyncio.run(ThreadDelegateConsumer._commit(consumer, offsets))
            committed.update(offsets)

    acked.update({s0: 50, s1: 70})
    periodic_commit()
    assert sent == [{s0: 40, s1: 70}]
    periodic_commit()                   # nothing new, still held: nothing sent
    assert sent == [{s0: 40, s1: 70}]
    hold.clear()                        # the state holding offsets 40..49 was written
    periodic_commit()
    assert sent[-1] == {s0: 50}
    periodic_commit()                   # sent: not offered again
    assert len(sent) == 2

    hold[0] = 55
    acked[s0] = 60
    periodic_commit()
    assert sent[-1] == {s0: 55}
    committed[s0] = 55                  # a rebalance: Faust read the broker's committed offset back
    hold.clear()
    periodic_commit()
    assert len(sent) == 3               # the wanted 60 belonged to the earlier assignment: dropped


def seeking_consumer(broker_committed: dict, faust_committed: dict, first: int = 0):
    """A consumer whose broker holds *broker_committed* (None: no offset) and whose Faust believes
    *faust_committed*; its seeks are recorded in ``seeks``."""
    from types import SimpleNamespace

    seeks: list = []

    async def seek_to_committed():  # aiokafka's: seeks only the partitions committed above 0
        for tp, o in broker_committed.items():
            if o and o > 0:
                seeks.append((tp, o))
        return dict(broker_committed)

    async def earliest_offsets(*tps):
        return {tp: first for tp in tps}

    async def _seek(tp, offset):
        seeks.append((tp, offset))

    return SimpleNamespace(seek_to_committed=seek_to_committed, earliest_offsets=earliest_offsets, _seek=_seek,
                           app=SimpleNamespace(conf=SimpleNamespace(consumer_auto_offset_reset="earliest")),
                           _is_changelog_tp=lambda tp: tp.topic.endswith("-changelog"), _read_offset={},
                           _committed_offset=dict(faust_committed), seeks=seeks)


def test_aiokafka_seeks_no_partition_without_a_committed_offset_and_faust_keeps_its_own_for_it():
    """What the seek change mends, on the installed versions: aiokafka seeks a partition only when its
    committed offset is above 0, and Faust's ``perform_seek`` leaves its committed offset for a partition the
    broker has none for as it was (here, from a commit that failed in a rebalance)."""
    import asyncio

    from aiokafka import AIOKafkaConsumer
    from faust.transport.consumer import Consumer
    from faust.types import TP

    assert "if offset and offset > 0:" in inspect.getsource(AIOKafkaConsumer.seek_to_committed)
    assert faust_compat.seek_before_stream_flow()
    s0, s3 = TP("samples", 0), TP("samples", 3)
    c = seeking_consumer({s0: 50, s3: None}, {s0: 60, s3: 240})
    asyncio.run(Consumer._phasewise_original_seek(c))
    assert c.seeks == [(s0, 50)]                       # s3: no seek, its position wherever the fetcher left it
    assert c._committed_offset == {s0: 50, s3: 240}    # and Faust still believes 240: it acks nothing below


def test_after_the_seek_a_partition_without_a_committed_offset_starts_from_its_first_record():
    import asyncio

    from faust.transport.consumer import Consumer
    from faust.types import TP

    assert faust_compat.seek_before_stream_flow()
    s0, s3, s4, ch = TP("samples", 0), TP("samples", 3), TP("samples", 4), TP("w-vpa-state-changelog", 3)
    c = seeking_consumer({s0: 50, s3: None, s4: 0, ch: None}, {s0: 60, s3: 240}, first=7)
    asyncio.run(Consumer.perform_seek(c))
    assert sorted(c.seeks) == [(s0, 50), (s3, 7), (s4, 7)]  # a changelog partition is the recovery's, not sought
    assert c._committed_offset == {s0: 50, s3: None, s4: None, ch: None}
    assert c._read_offset == {s0: 50, s3: None, s4: 0, ch: None}


def test_an_app_that_starts_from_the_latest_record_is_not_sought_back_to_the_first():
    import asyncio

    from faust.transport.consumer import Consumer
    from faust.types import TP

    assert faust_compat.seek_before_stream_flow()
    s3 = TP("samples", 3)
    c = seeking_consumer({s3: None}, {s3: 240})
    c.app.conf.consumer_auto_offset_reset = "latest"
    asyncio.run(Consumer.perform_seek(c))
    assert c.seeks == [] and c._committed_offset == {s3: None}


class _Stream:
    """What :func:`faust_compat.take_batches` uses of a Faust ``Stream`` (each name checked against Faust's
    below): values put on :attr:`queue` reach the processors one at a time, as Faust's passive drainer
    hands them on; every wait with a timeout is counted (a wake-up)."""

    def __init__(self) -> None:
        import asyncio

        self.queue: asyncio.Queue = asyncio.Queue()
        self.channel, self.enable_acks, self.should_stop = [], True, False
        self._processors: list = []
        self._active_agens: set = set()
        self.current_event = None
        self.acked: list = []
        self.timed_waits = 0

    def add_processor(self, fn) -> None:
        self._processors.append(fn)

    def _enable_passive(self, channel) -> None:
        import asyncio

        async def drain() -> None:
            while True:
                self.current_event = value = await self.queue.get()
                for fn in list(self._processors):
                    await fn(value)

        self.drainer = asyncio.ensure_future(drain())

    async def wait(self, event) -> None:
        await event.wait()

    async def wait_for_stopped(self, event, timeout=None) -> bool:
        import asyncio

        if timeout is not None:
            self.timed_waits += 1
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        return self.should_stop

    async def ack(self, event) -> bool:
        self.acked.append(event)
        return True

    async def crash(self, exc) -> None:
        raise exc


def test_take_batches_yields_at_most_max_events_in_order_acks_them_and_does_not_wake_while_idle():
    import asyncio

    from faust.streams import Stream

    missing = [n for n in ("channel", "enable_acks", "should_stop", "_processors", "_active_agens", "current_event",
                           "add_processor", "_enable_passive", "wait", "wait_for_stopped", "ack", "crash")
               if not hasattr(Stream, n) and n not in Stream.__init__.__code__.co_names]
    assert missing == [], f"Faust's Stream no longer has {missing}: re-check faust_compat.take_batches"

    async def run() -> tuple[list[list[int]], _Stream]:
        s = _Stream()
        batches: list[list[int]] = []
        agen = faust_compat.take_batches(s, 3, 0.05)
        assert agen in s._active_agens  # closed by the stream's on_stop, as Faust's own
        got = asyncio.Event()

        async def consume() -> None:
            async for events in agen:
                batches.append(list(events))
                got.set()

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.2)  # idle: no event, so no timed wait
        idle_waits = s.timed_waits
        for v in range(7):
            s.queue.put_nowait(v)
        while sum(len(b) for b in batches) < 7:
            got.clear()
            await got.wait()
        assert s.enable_acks is False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        s.drainer.cancel()
        await asyncio.gather(s.drainer, return_exceptions=True)
        assert idle_waits == 0, idle_waits
        return batches, s

    batches, s = asyncio.run(run())
    assert [v for b in batches for v in b] == list(range(7)) and max(len(b) for b in batches) <= 3
    assert s.acked == list(range(7)) and s.enable_acks is True and s._processors == []
