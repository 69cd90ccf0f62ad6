"""The contract every limit policy meets, live and in replay: asked :meth:`LimitPolicy.limits` for the coming
step with what it has seen so far, then shown the usage measured (:meth:`LimitPolicy.observe`), so no policy
sees the future. Pure: no IO, no clock (time comes in as ``t``), no globals.
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
