"""Helpers for the actuator tests."""

from __future__ import annotations

import pytest

from phasewise.schemas import Actuation, DeadLetter, decode
from phasewise.topics import ACTUATIONS, DEAD_LETTERS


class Recorder:
    """Collects what an Actuator produces, for tests of ``handle`` without a broker."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []

    def produce(self, topic, value=None, key=None, **kw):
        self.sent.append((topic, key, value))

    def poll(self, timeout=0):
        return 0

    def actuations(self) -> list[Actuation]:
        return [decode(Actuation, v) for t, _, v in self.sent if t == ACTUATIONS.name]

    def dead_letters(self) -> list[DeadLetter]:
        return [decode(DeadLetter, v) for t, _, v in self.sent if t == DEAD_LETTERS.name]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def remove_started_jobs(backend, layout) -> None:
    """After a test that started real jobs through *backend*: kill them, remove their cgroups, the
    prefix's cpuset slices and the prefix itself (what a failed run would otherwise leave behind)."""
    for p in backend.processes.values():
        p.kill()
        p.wait()
    for c in layout.containers():
        layout.remove(c)
    cs = layout.controller_root("cpuset") / layout.prefix
    for d in sorted(cs.glob("*"), reverse=True):
        if d.is_dir():
            d.rmdir()
    if cs.exists():
        cs.rmdir()
    for c in layout.controllers():
        try:
            layout.base(c).rmdir()
        except OSError:
            pass
