"""The contract every limit policy meets, live and in replay.

A policy keeps one container's state. At each step it is first asked for the
limits that hold for the coming step (:meth:`LimitPolicy.limits`), using only
what it has observed so far, and then shown the usage actually measured at
that step (:meth:`LimitPolicy.observe`). Replay scores ``L_t`` against ``U_t``
this way, so no policy ever sees the future; the live worker calls the same
two methods as samples arrive and turns changed limits into decisions.

Resources are named by the keys of :data:`RESOURCES`; a policy returns a limit
for every resource it has seen usage of (``None`` while it has no opinion yet,
which the caller treats as "leave the current limit").

Policies are pure: no IO, no clocks (time comes in as ``t``), no globals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

__all__ = ["RESOURCES", "LimitPolicy", "Limits", "Usage"]

#: resource name -> unit
RESOURCES: dict[str, str] = {
    "cpu": "cores",
    "mem": "bytes",
    "gpu": "percent of one GPU (SM utilisation)",
    "gpu_mem": "bytes",
}

Usage = Mapping[str, float]
Limits = dict[str, float | None]


@runtime_checkable
class LimitPolicy(Protocol):
    #: short policy name, e.g. "vpa", "window-max-10", "phase", "oracle"
    name: str

    def limits(self, t: float) -> Limits:
        """Limits for the step starting at *t*, from observations before *t*."""
        ...

    def observe(self, t: float, usage: Usage) -> None:
        """Usage measured at step *t* (after :meth:`limits` was asked for *t*)."""
        ...

    def explain(self) -> dict:
        """The numbers behind the latest limits (for a Decision's ``details``)."""
        ...
