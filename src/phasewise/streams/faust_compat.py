"""The two changes phasewise makes to Faust's internals, fenced by the versions they were checked on
(:data:`CHECKED`): :func:`bound_fetch_wait` (the consumer's fetch wait from
``kafka_fetch_wait_max_ms``) and :func:`seek_before_stream_flow` (no record reaches an agent before a
resumed partition is sought back to its committed offset). Why, and what they touch: docs/worker.md,
"Two changes to Faust's internals".
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
