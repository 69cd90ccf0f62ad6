"""The policies a replay runs: the families (``vpa``, ``window``, ``phase``; the ``oracle`` is the harness's
special case), their specs and factories, and :class:`ScaledPolicy` for traces in fractions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from phasewise.models.policy import LimitPolicy, Limits

__all__ = [
    "FAMILIES",
    "NOMINAL_MEM_BYTES",
    "ORACLE",
    "ORACLE_NOTE",
    "policy_specs",
    "PolicySpec",
    "PolicyUnavailable",
    "REACTIVE",
    "ScaledPolicy",
]


ORACLE = "oracle"


FAMILIES = ("vpa", "window", "phase", ORACLE)


REACTIVE = ("vpa", "window")


ORACLE_NOTE = "harness special case: L_t = U_t, the only policy that sees the usage of the step it limits"


class PolicyUnavailable(RuntimeError):
    """A requested policy family cannot be built (its module is not installed or not written)."""


@dataclass(frozen=True)
class PolicySpec:
    """One policy of a run: a family member with a factory of fresh instances.

    ``factory`` is ``None`` only for the oracle, which the harness computes.
    """

    name: str
    family: str
    factory: Callable[[], LimitPolicy] | None


def _lazy_factory(module: str, cls: str, family: str) -> Callable[[], LimitPolicy]:
    try:
        mod = importlib.import_module(module)
        klass = getattr(mod, cls)
    except (ImportError, AttributeError) as e:
        raise PolicyUnavailable(f"policy {family!r} is not available: {module}.{cls} cannot be imported ({e})") from e
    return klass


#: nominal capacity (bytes) that turns a memory *fraction* into bytes for VPA (see :class:`ScaledPolicy`)
NOMINAL_MEM_BYTES = float(2**40)


class ScaledPolicy:
    """Harness adapter: show a policy usage multiplied by ``scales[r]`` and divide
    its limits back, so a policy that works in fixed units sees them.

    Used for VPA on traces whose ``mem`` is a utilisation fraction: VPA's memory
    histogram is in bytes (first bucket 1e7 bytes, 5 % wider buckets, floor
    250 MiB), so the fraction is shown as bytes of a nominal 1 TiB pod. Buckets
    grow geometrically, so alloc/used does not depend on the nominal size as
    long as usage stays far above the first bucket and the floor (250 MiB is
    0.02 % of 1 TiB).

    >>> from phasewise.models.scoring.baselines import WindowPolicy
    >>> p = ScaledPolicy(WindowPolicy(window=2), {"mem": 1000.0})
    >>> p.observe(0.0, {"mem": 0.5, "cpu": 2.0})
    >>> p.limits(1.0), p.inner.limits(1.0)
    ({'mem': 0.5, 'cpu': 2.0}, {'mem': 500.0, 'cpu': 2.0})
    """

    def __init__(self, inner: LimitPolicy, scales: dict[str, float]) -> None:
        self.inner = inner
        self.scales = dict(scales)
        self.name = inner.name

    def limits(self, t: float) -> Limits:
        out = dict(self.inner.limits(t))
        for r, k in self.scales.items():
            if out.get(r) is not None:
                out[r] = out[r] / k
        return out

    def observe(self, t: float, usage) -> None:
        self.inner.observe(t, {r: (v * self.scales[r] if r in self.scales else v) for r, v in usage.items()})

    def explain(self) -> dict:
        return {**self.inner.explain(), "harness_unit_scales": dict(self.scales)}


def policy_specs(families: Iterable[str], windows: tuple[int, ...] = (5, 10, 30, 60),
                 units: dict[str, str] | None = None) -> list[PolicySpec]:
    """Expand family names (``vpa``, ``window``, ``phase``, ``oracle``) into specs.

    *units* are the trace's units per resource: when ``mem`` is not in bytes,
    VPA and the phase policy (whose reactive fallback is VPA) see it through
    :class:`ScaledPolicy` (nominal 1 TiB pod).

    >>> [s.name for s in policy_specs(["window", "oracle"], windows=(5,))]
    ['window-max-5', 'window-p95x1.15-5', 'oracle']
    """
    specs: list[PolicySpec] = []
    seen: set[str] = set()
    for fam in families:
        fam = fam.strip()
        if not fam or fam in seen:
            continue
        seen.add(fam)
        if fam == "window":
            from phasewise.models.scoring.baselines import window_family

            specs += [PolicySpec(n, "window", f) for n, f in window_family(windows).items()]
        elif fam == "vpa":
            vpa = _lazy_factory("phasewise.models.vpa.recommender", "VpaPolicy", "vpa")
            mem_unit = (units or {}).get("mem", "bytes")
            if mem_unit.startswith("bytes"):
                specs.append(PolicySpec("vpa", "vpa", vpa))
            else:
                specs.append(PolicySpec("vpa", "vpa",
                                        lambda vpa=vpa: ScaledPolicy(vpa(), {"mem": NOMINAL_MEM_BYTES})))
        elif fam == "phase":
            # never the shipped pretrained model: it was trained on the AI4DL sample a replay may score
            phase = partial(_lazy_factory("phasewise.models.phases.limits", "PhasePolicy", "phase"), pretrained=False)
            if (units or {}).get("mem", "bytes").startswith("bytes"):
                specs.append(PolicySpec("phase", "phase", phase))
            else:  # same unit treatment as VPA (its reactive fallback is VPA)
                specs.append(PolicySpec("phase", "phase",
                                        lambda phase=phase: ScaledPolicy(phase(), {"mem": NOMINAL_MEM_BYTES})))
        elif fam == ORACLE:
            specs.append(PolicySpec(ORACLE, ORACLE, None))
        else:
            raise ValueError(f"unknown policy {fam!r}; known: {', '.join(FAMILIES)}")
    if not specs:
        raise ValueError("no policy named")
    return specs
