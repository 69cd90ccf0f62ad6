"""``trim_heap_every``: a Faust worker hands the heap's free memory back to the OS on a timer (glibc)."""

from __future__ import annotations

import ctypes
import os

import pytest

from phasewise.apps.bench.harness import rss_bytes
from phasewise.streams.worker import heap_trimmer, trim_heap_every


def resident_bytes() -> int:
    return rss_bytes(os.getpid())


glibc = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="needs glibc (malloc_trim)")


class App:
    """The one part of a Faust app the trim uses: ``app.timer(seconds)`` registering a coroutine."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, object]] = []

    def timer(self, seconds: float):
        def register(fn):
            self.timers.append((seconds, fn))
            return fn
        return register


@glibc
def test_a_trim_gives_back_the_holes_freed_blocks_leave_in_the_heap():
    # 1 KiB blocks come from malloc's heap (not pymalloc's arenas): keep one in 64, free the rest
    blocks = [bytes(1024) for _ in range(150_000)]
    kept = blocks[::64]
    del blocks
    before = resident_bytes()
    trim = heap_trimmer()
    assert trim is not None
    trim()
    assert before - resident_bytes() > 50e6, (before, resident_bytes())
    assert len(kept) == 2344


@glibc
def test_the_worker_trims_on_a_timer_of_its_setting_and_not_at_zero():
    import asyncio

    app = App()
    assert trim_heap_every(app, 30.0) is True
    (seconds, fn), = app.timers
    assert seconds == 30.0
    asyncio.run(fn())  # a trim: returns nothing, raises nothing
    off = App()
    assert trim_heap_every(off, 0.0) is False and off.timers == []
