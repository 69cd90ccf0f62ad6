"""The one change to Faust's internals (the fetch wait) holds on the installed versions, or fails loudly.

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
    assert "keeps Faust's 1500 ms fetch wait" in caplog.text
