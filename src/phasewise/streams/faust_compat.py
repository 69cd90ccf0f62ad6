"""The two changes phasewise makes to Faust's internals, fenced by the versions they were checked on.

**Fetch wait.**

Faust (faust-streaming) builds the worker's aiokafka consumer with a fixed
``fetch_max_wait_ms=1500`` and offers no setting for it. The embedded broker
does not answer a waiting fetch when data arrives, so each hop of the
pipeline would add up to 1.5 s of latency; :func:`bound_fetch_wait` sets the
consumer's wait to ``kafka_fetch_wait_max_ms`` after Faust builds it and
before it starts (on Kafka a shorter wait only adds idle round trips).

The change touches two private names: Faust's
``AIOKafkaConsumerThread._create_worker_consumer`` and aiokafka's
``AIOKafkaConsumer._fetch_max_wait_ms`` (read by its fetcher at ``start()``).
It is made only on the Faust and aiokafka versions in :data:`CHECKED`; on
any other the worker logs one warning and runs with Faust's 1.5 s wait
(correct, slower on the embedded broker). ``tests/streams/test_faust_compat.py``
fails when the installed versions are not in :data:`CHECKED` or the private
names moved, so an upgrade is a deliberate step: check, then extend
:data:`CHECKED`.

**No record before the seek.** After a rebalance Faust reads the table
changelogs with the source partitions paused in its own bookkeeping only:
aiokafka goes on fetching them and Faust drops what it fetched, so their
fetch positions move past the committed offsets. When recovery completes,
Faust resumes the source partitions *with the flow running* and only then
seeks them back to the committed offsets: in between, records from the
advanced positions reach the agents. A restarted worker then learned, e.g.,
offsets 143-145 of a partition before 21-142, and skipped 21-142 when the seek
brought them back (its state already held offset 145): the differing
decisions after a SIGKILL. :func:`seek_before_stream_flow` makes the resuming
of any source partition stop the flow first; both of Faust's callers then
seek to the committed offsets and resume the flow, and a consumer whose flow
is stopped yields no record (it seeks back instead). It wraps the public
``Consumer.resume_partitions`` and uses ``stop_flow``, ``flow_active`` and
``_is_changelog_tp``; same version fence.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

__all__ = ["CHECKED", "bound_fetch_wait", "patch_applies", "seek_before_stream_flow"]

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
    return True
