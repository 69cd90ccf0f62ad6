"""One service replica's capacity on this host, for ``experiment priorities --through-roles``'s load.

The experiment compares static and managed where one replica cannot serve the high load; on a quiet or a
large host a fixed rate can leave one replica within its SLO, and then both scenarios meet it and the run
says nothing. :func:`calibrate` starts one replica of the experiment's inference program in a cgroup with
the replica's CPU limit (the cgroup backend, as the actuator writes it), sends it an open-loop ramp of
request rates, and returns the highest rate it served within the SLO (at most 1 % of a step's requests
later than the SLO, failed or shed) before two steps in a row were not (one late step alone is the host's
noise: another process took the CPUs for a moment). :func:`rates_from` turns it into the run's low and high
rates. The load generator shares the host: what is measured is one replica's capacity as the run's own
load generator reaches it, and the calibration says which bound it (``bound``): the replica's CPU limit
(it used at least 90 % of it in the first step past the SLO) or the host (it used less: it waited for a CPU
or the requests waited for the generator), where more replicas cannot help.
docs/priorities.md, "Through the roles".
"""

from __future__ import annotations

import math
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Calibration", "calibrate", "capacity_from", "rates_from"]

#: the ramp: the first rate, the factor between steps, seconds per step (the first step also warms the model)
FIRST_RATE = 5.0
FACTOR = 1.25
STEP_S = 4.0
MAX_STEPS = 24
#: a step is within the SLO when at most this share of its requests was later (failed and shed count as late)
LATE_SHARE = 0.01


#: the replica's limit bound the capacity when it used at least this share of it in the first step past the SLO
LIMIT_BOUND = 0.9


@dataclass(frozen=True)
class Calibration:
    capacity_rps: float  #: the highest rate served within the SLO (0: not even the first)
    steps: tuple[tuple[float, int, float], ...]  #: (rate, requests, share later than the SLO) per step
    cores: float
    slo_ms: float
    cores_used: tuple[float, ...] = ()  #: the replica's CPU per step (cores; NaN: not read)

    @property
    def bound(self) -> str:
        """``replica`` (its CPU limit), ``host`` (less than LIMIT_BOUND of it used) or ``none`` (no step
        missed the SLO)."""
        late = next((k for k, (rate, n, share) in enumerate(self.steps)
                     if rate > self.capacity_rps and (not n or share > LATE_SHARE)), None)
        if late is None or late >= len(self.cores_used) or not math.isfinite(self.cores_used[late]):
            return "none" if late is None else "unknown"
        return "replica" if self.cores_used[late] >= LIMIT_BOUND * self.cores else "host"

    def to_dict(self) -> dict:
        return {"capacity_rps": self.capacity_rps, "cores": self.cores, "slo_ms": self.slo_ms, "bound": self.bound,
                "steps": [{"rate": r, "requests": n, "late_share": round(s, 4),
                           "cores_used": round(self.cores_used[k], 3) if k < len(self.cores_used)
                           and math.isfinite(self.cores_used[k]) else None}
                          for k, (r, n, s) in enumerate(self.steps)]}


def capacity_from(timeline: list[tuple[float, float]], rates: list[float], *, step_s: float, slo_ms: float
                  ) -> tuple[float, tuple[tuple[float, int, float], ...]]:
    """The highest rate of *rates* (step k from ``k * step_s``) whose requests were answered within *slo_ms*
    (a share of at most LATE_SHARE later; ``inf`` latency: failed or shed) before two steps in a row were
    not; with each step's figures.

    >>> late, ok = 900.0, 10.0
    >>> tl = [(0.5, ok), (1.5, late), (2.5, ok), (3.5, late), (4.5, late), (5.5, ok)]
    >>> capacity_from(tl, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], step_s=1.0, slo_ms=300)
    (3.0, ((1.0, 1, 0.0), (2.0, 1, 1.0), (3.0, 1, 0.0), (4.0, 1, 1.0), (5.0, 1, 1.0), (6.0, 1, 0.0)))
    """
    counts = [[0, 0] for _ in rates]
    for t, lat in timeline:
        k = int(t // step_s)
        if 0 <= k < len(rates):
            counts[k][0] += 1
            counts[k][1] += not (lat <= slo_ms)
    steps = tuple((r, n, late / n if n else 1.0) for r, (n, late) in zip(rates, counts))
    capacity, missed = 0.0, 0
    for r, n, share in steps:
        missed = missed + 1 if not n or share > LATE_SHARE else 0
        if missed == 2:
            break
        if not missed:
            capacity = r
    return capacity, steps


def rates_from(capacity_rps: float) -> tuple[float, float]:
    """(low, high) for :func:`~phasewise.apps.experiment.priorities_roles.rate_steps`: its middle step
    (0.7 x high) is one replica's capacity, its high step needs a second replica, its low steps a quarter
    of one.

    >>> rates_from(56.0)
    (14.0, 80.0)
    """
    return round(capacity_rps / 4, 1), round(capacity_rps / 0.7, 1)


def calibrate(*, cores: float, slo_ms: float, cgroup_root: str = "/sys/fs/cgroup", seed: int = 0,
              log_dir: Path | None = None, first_rate: float = FIRST_RATE, factor: float = FACTOR,
              step_s: float = STEP_S, max_steps: int = MAX_STEPS) -> Calibration:
    """Ramp one replica limited to *cores* (root: it makes a cgroup) until two steps in a row miss *slo_ms*
    (or *max_steps* steps ran): rates ``first_rate * factor ** k``, *step_s* seconds each."""
    from phasewise.actuators.backends import CgroupBackend
    from phasewise.actuators.commands import SetLimits
    from phasewise.apps.experiment.inference import Load, Replicas
    from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout

    layout = CgroupLayout(cgroup_root, prefix=f"pwcal-{uuid.uuid4().hex[:6]}")
    backend = CgroupBackend(layout)

    def place(name: str, pid: int) -> None:
        layout.create(name)
        layout.attach(name, pid)
        out = backend.apply(SetLimits(name, cpu_cores=cores))
        if out.status not in ("applied", "clamped"):
            raise CgroupError(f"cannot limit the calibration replica: {out.message}")

    def cpu_s(name: str) -> float:
        """The replica's CPU time so far (s; NaN: not readable)."""
        try:
            if layout.version == 1:
                return int((layout.path(name, "cpuacct") / "cpuacct.usage").read_text()) / 1e9
            stat = dict(ln.split() for ln in (layout.path(name) / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
        except (OSError, ValueError, KeyError, CgroupError):
            return math.nan

    def unplace(name: str) -> None:
        try:
            layout.remove(name)
        except CgroupError:
            pass

    with tempfile.TemporaryDirectory(prefix="phasewise-calibrate-") as tmp:
        replicas = Replicas("calibrate", place, unplace, log_dir or Path(tmp))
        try:
            replica = replicas.start()
            port = replica.port
            # the replica's CPU time at each step's start (monotonic time, CPU s)
            marks = [(time.monotonic(), cpu_s(replica.name))]
            rates = [round(first_rate * factor ** k, 1) for k in range(max_steps)]
            load = Load(lambda: [port], lambda t: rates[min(int(t // step_s), len(rates) - 1)], workers=64,
                        timeout_s=2.0, seed=seed)
            # stop after two steps in a row past the SLO (what comes after them says nothing more)
            done = {"k": 0}

            def watch(t: float) -> float:
                k = min(int(t // step_s), len(rates) - 1)
                if k > done["k"]:
                    done["k"] = k
                    marks.append((time.monotonic(), cpu_s(replica.name)))
                    _, steps = capacity_from(list(load.result.timeline), rates[:k], step_s=step_s, slo_ms=slo_ms)
                    if len(steps) >= 2 and all(n == 0 or share > LATE_SHARE for _, n, share in steps[-2:]):
                        load.stop.set()
                return rates[k]

            load.rate = watch
            result = load.run(step_s * len(rates))
        finally:
            replicas.close()  # (its cgroup removed with it)
            for c in layout.controllers() if layout.version == 1 else ("cpu",):
                try:
                    layout.base(c).rmdir()
                except (OSError, CgroupError):
                    pass
    done_steps = max(1, math.ceil(max((t for t, _ in result.timeline), default=0.0) / step_s))
    capacity, steps = capacity_from(result.timeline, rates[:done_steps], step_s=step_s, slo_ms=slo_ms)
    used = tuple((c1 - c0) / (t1 - t0) if t1 > t0 else math.nan for (t0, c0), (t1, c1) in zip(marks, marks[1:]))
    return Calibration(capacity, steps, cores, slo_ms, used)
