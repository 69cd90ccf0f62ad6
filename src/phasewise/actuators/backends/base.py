"""The :class:`Backend` protocol: what the actuator asks of every backend (cgroup, dry-run, kubernetes).

A backend does IO only; the safety rules ran before it is called
(:mod:`phasewise.actuators.safety`). ``apply`` never raises for an OS or API
error: it returns a ``failed`` outcome, marked ``temporary`` when a retry may
help (docs/operations.md, "Backends").
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from phasewise.actuators.commands import Command, Outcome

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    #: shown as ``Actuation.backend``
    name: str

    def apply(self, command: Command) -> Outcome:
        """Carry out *command*; never raises for an OS error (a ``failed`` outcome instead)."""
        ...

    def memory_usage(self, container: str) -> float | None:
        """The container's memory working set in bytes, ``None`` if it cannot be read."""
        ...

    def exists(self, container: str) -> bool:
        """Whether the managed container exists now."""
        ...
