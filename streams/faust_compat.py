"""The one change phasewise makes to Faust's internals, fenced by the versions it was checked on.

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
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

__all__ = ["CHECKED", "bound_fetch_wait", "patch_applies"]

log = logging.getLogger(__name__)

#: distribution -> the version prefixes (major.minor) the change was checked on
CHECKED = {"faust-streaming": ("0.15.",), "aiokafka": ("0.14.",)}

_warned: list[str] = []


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


def bound_fetch_wait(ms: int) -> bool:
    """Bound the Faust worker consumer's fetch long-poll to *ms*; False (and one warning) when not applied."""
    why = patch_applies()
    if why is not None:
        if why not in _warned:
            _warned.append(why)
            log.warning("%s: the worker keeps Faust's 1500 ms fetch wait (slower on the embedded broker)", why)
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
