"""What every live decision of the worker passes: the safety rules and the samples' intake limits.

docs/configuration.md lists them; docs/security.md says what they defend against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phasewise.kit.settings.spec import Group, above, at_least, in_range, setting

__all__ = ["IntakeSettings", "SafetySettings"]

@dataclass(frozen=True, slots=True)
class SafetySettings(Group):
    """The safety rules every live decision of the worker passes, whatever the policy.

    :mod:`phasewise.models.safety.guard` applies them.
    """

    PREFIX: ClassVar[str] = "safety_"

    #: on: every decision of the worker passes the rules below; off only to replay what a bare
    #: policy decides (replay turns it off unless --safety)
    rules: bool = setting(True, help="every decision of the worker passes the safety rules")
    #: no limit is lowered (nor first set on an unlimited container) before this much history
    min_history_s: float = setting(900.0, check=at_least(0),
                                   help="no limit is lowered before this many seconds of history")
    #: at most one decrease per resource per this long; no memory decrease this long after
    #: an OOM kill
    cooldown_s: float = setting(300.0, check=at_least(0),
                                help="seconds between two decreases of a resource "
                                     "(and after an OOM kill)")
    #: one decision lowers a limit by at most this fraction of the limit in force
    max_decrease: float = setting(0.25, check=in_range(0, 1, lo_open=True),
                                  help="largest fraction of a limit one decision takes away")
    #: memory limits never go below the container's peak working set over this long
    #: + the actuator's mem_margin_bytes
    peak_window_s: float = setting(3600.0, check=above(0),
                                   help="memory limits stay above the peak working set of this "
                                        "many seconds + mem_margin_bytes")


@dataclass(frozen=True, slots=True)
class IntakeSettings(Group):
    """What the worker admits from the samples topic before any per-container state sees it.

    A message beyond the event-time limits is dead-lettered whole. When a capacity limit is
    full, a new container evicts the least recently seen one of its host or of the worker (a host
    cannot take more than its share of a full worker), counted in
    ``phasewise_worker_containers_evicted_total``; a container is refused (dead-lettered, counted in
    ``phasewise_worker_containers_refused_total``) only when none may go. 0 = no limit.
    """

    PREFIX: ClassVar[str] = "intake_"

    max_future_s: float = setting(300.0, check=at_least(0),
                                  help="refuse samples stamped more than this many seconds ahead of the "
                                       "worker's clock")
    max_behind_s: float = setting(3600.0, check=at_least(0),
                                  help="refuse samples stamped more than this many seconds before their "
                                       "host's newest sample")
    max_containers_per_message: int = setting(10_000, check=at_least(0),
                                              help="refuse a samples message holding more containers")
    max_containers_per_host: int = setting(10_000, check=at_least(0),
                                           help="containers one host may have in a worker; a new one beyond "
                                                "evicts the host's least recently seen")
    max_containers_per_worker: int = setting(200_000, check=at_least(0),
                                             help="containers one worker holds; a new one beyond evicts the "
                                                  "least recently seen, a host at its share its own")
    host_active_s: float = setting(120.0, check=above(0),
                                   help="seconds after its last message a host divides a full worker into "
                                        "shares; containers not seen for longer are evicted first")
