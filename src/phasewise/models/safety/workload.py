"""Per-workload policy: what phasewise may do to each container, from annotations, a policy file or a default.

Pure: the host agent and the actuator hand in what they know of a container
(its identity, its pod's annotations, the policy file's rules) and get one
:class:`~phasewise.kit.records.WorkloadPolicy`; a workload with any bad value
is refused as a whole (mode ``off``, with the reason). The keys, their
values and the default mode: docs/kubernetes.md, "Per-workload policy".

>>> resolve(None, "kubepods-systemd").mode, resolve(None, "flat").mode
('off', 'apply')
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy only for the worker's vectorised step: the actuator image has none
    import numpy as np

from phasewise.kit.records import (
    JOB_ID_PATTERN,
    MAX_BYTES,
    MAX_CORES,
    MODES,
    UPDATE_MODES,
    WORKLOAD_POLICIES,
    ContainerSample,
    HostSamples,
    WorkloadPolicy,
)

__all__ = [
    "ANNOTATION_PREFIX",
    "DEFAULT_MODES",
    "KEYS",
    "Rule",
    "Settings",
    "StepColumns",
    "WorkloadError",
    "match_rule",
    "policy_of",
    "refusal_reason",
    "step_columns",
    "unserved",
    "parse_cpu",
    "parse_memory",
    "parse_policy_file",
    "parse_settings",
    "resolve",
    "without_off",
]

ANNOTATION_PREFIX = "phasewise.io/"
#: the host-level default mode's values
DEFAULT_MODES = ("auto", *MODES)
KEYS = ("mode", "policy", "cpu-min", "cpu-max", "memory-min", "memory-max", "priority", "class", "update-mode",
        "job", "signature")
_CLASS = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_JOB = re.compile(JOB_ID_PATTERN)


class WorkloadError(ValueError):
    """A workload's settings (or a policy file) hold a value that cannot be used; ``str(e)`` says which."""


# --------------------------------------------------------------------------- quantities

_QTY = re.compile(r"^([+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei))?$")
_SUFFIX = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60}


def _quantity(text: Any) -> float:
    """A Kubernetes resource quantity (``500m``, ``2``, ``1.5Gi``, ``1e9``) as a number.

    >>> _quantity("500m"), _quantity("1.5Gi"), _quantity("2e3"), _quantity(4)
    (0.5, 1610612736.0, 2000.0, 4.0)
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a quantity")
    if isinstance(text, (int, float)):
        v = float(text)
    else:
        if not isinstance(text, str):
            raise ValueError(f"{text!r} is not a quantity")
        m = _QTY.match(text.strip())
        if m is None:
            raise ValueError(f"{text!r} is not a quantity (e.g. 500m, 2, 512Mi, 1.5G)")
        v = float(m.group(1) + m.group(2)) if m.group(2) else float(m.group(1)) * _SUFFIX[m.group(3)]
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{text!r} is not a finite quantity >= 0")
    return v


def parse_cpu(text: Any) -> float:
    """CPU cores from a quantity, within the schema's bounds.

    >>> parse_cpu("250m")
    0.25
    """
    v = _quantity(text)
    if v > MAX_CORES:
        raise ValueError(f"{text!r} is more than {MAX_CORES:g} cores")
    return v


def parse_memory(text: Any) -> float:
    """Bytes from a quantity, within the schema's bounds.

    >>> parse_memory("64Mi")
    67108864.0
    """
    v = _quantity(text)
    if v > MAX_BYTES:
        raise ValueError(f"{text!r} is more than {MAX_BYTES:g} bytes")
    return float(math.ceil(v))


# --------------------------------------------------------------------------- a workload's settings


@dataclass(frozen=True, slots=True)
class Settings:
    """A workload's own settings, parsed (``None`` = not given); ``error`` = refused, and why."""

    source: str  #: annotation | policy-file
    mode: str | None = None
    policy: str | None = None
    cpu_min_cores: float | None = None
    cpu_max_cores: float | None = None
    mem_min_bytes: float | None = None
    mem_max_bytes: float | None = None
    priority: int | None = None
    workload_class: str | None = None
    update_mode: str | None = None
    job: str | None = None
    signature: str | None = None
    error: str | None = None


def parse_settings(values: Mapping[str, Any] | None, *, container: str | None = None,
                   prefix: str = ANNOTATION_PREFIX, source: str = "annotation") -> Settings | None:
    """A workload's settings from annotations; ``None`` if it has none.

    Pod-wide keys are ``phasewise.io/<key>``; ``<container>.phasewise.io/<key>``
    sets *container*'s own value and wins over the pod-wide one (a sidecar
    opted out of its pod's mode, a tighter ``cpu-max`` for one container).
    Other annotations are ignored; an unknown key under *prefix* is an error
    (a misspelt key must not pass silently). A bad value gives
    ``Settings(error=...)``, never an exception.

    >>> parse_settings({"app": "x"}) is None
    True
    >>> print(parse_settings({"phasewise.io/cpu_max": "2"}).error)
    phasewise.io/cpu_max: unknown key (known: mode, policy, cpu-min, cpu-max, memory-min, memory-max, priority, \
class, update-mode, job, signature)
    >>> a = {"phasewise.io/mode": "apply", "logger.phasewise.io/mode": "off"}
    >>> parse_settings(a, container="logger").mode, parse_settings(a, container="trainer").mode
    ('off', 'apply')
    """
    if values is None:
        return None
    mine: dict[str, tuple[Any, str]] = {}
    own = f"{container}.{prefix}" if container else None
    for k, v in values.items():
        if isinstance(k, str) and k.startswith(prefix):
            mine.setdefault(k[len(prefix):], (v, k))
    if own is not None:
        for k, v in values.items():
            if isinstance(k, str) and k.startswith(own):
                mine[k[len(own):]] = (v, k)  # the container's own value wins
    if not mine:
        return None
    try:
        return _parse(mine, source)
    except WorkloadError as e:
        return Settings(source=source, error=str(e))


def _parse(mine: Mapping[str, tuple[Any, str]], source: str) -> Settings:
    """*mine*: key -> (value, the name it was given as)."""
    out: dict[str, Any] = {}
    for key in sorted(mine):
        value, where = mine[key]
        if key not in KEYS:
            raise WorkloadError(f"{where}: unknown key (known: {', '.join(KEYS)})")
        try:
            if key == "mode":
                if value not in MODES:
                    raise ValueError(f"{value!r} is not one of {', '.join(MODES)}")
                out["mode"] = value
            elif key == "policy":
                if value not in WORKLOAD_POLICIES:
                    raise ValueError(f"{value!r} is not one of {', '.join(WORKLOAD_POLICIES)}")
                out["policy"] = value
            elif key in ("cpu-min", "cpu-max"):
                out["cpu_" + key[4:] + "_cores"] = parse_cpu(value)
            elif key in ("memory-min", "memory-max"):
                out["mem_" + key[7:] + "_bytes"] = parse_memory(value)
            elif key == "priority":
                out["priority"] = _integer(value)
            elif key == "class":
                if not isinstance(value, str) or not _CLASS.match(value):
                    raise ValueError(f"{value!r} is not a lower-case word (a-z, 0-9, '-')")
                out["workload_class"] = value
            elif key == "update-mode":
                if value not in UPDATE_MODES:
                    raise ValueError(f"{value!r} is not one of {', '.join(UPDATE_MODES)}")
                out["update_mode"] = value
            elif key == "job":
                if not isinstance(value, str) or not _JOB.match(value):
                    raise ValueError(f"{value!r} is not a job id (the characters of a container name)")
                out["job"] = value
            elif key == "signature":
                if not isinstance(value, str) or not _JOB.match(value):
                    raise ValueError(f"{value!r} is not a signature (letters, digits and _.:@-, at most 201)")
                out["signature"] = value
        except ValueError as e:
            raise WorkloadError(f"{where}: {e}") from None
    for lo, hi, what in (("cpu_min_cores", "cpu_max_cores", "cpu"), ("mem_min_bytes", "mem_max_bytes", "memory")):
        if lo in out and hi in out and out[lo] > out[hi]:
            (lo_v, lo_k), (hi_v, hi_k) = mine[what + "-min"], mine[what + "-max"]
            raise WorkloadError(f"{lo_k} ({lo_v}) is above {hi_k} ({hi_v})")
    return Settings(source=source, **out)


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not an integer")
    if isinstance(value, int):
        v = value
    elif isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]{1,18}", value.strip()):
        v = int(value.strip())
    else:
        raise ValueError(f"{value!r} is not an integer")
    if abs(v) > 10**9:
        raise ValueError(f"{value!r} is outside -1e9..1e9")
    return v


# --------------------------------------------------------------------------- the policy file


@dataclass(frozen=True, slots=True)
class Rule:
    """One policy-file rule: workloads whose name matches ``match`` (a glob) get ``settings``."""

    match: str
    settings: Settings


def parse_policy_file(data: Any) -> tuple[Rule, ...]:
    """The rules of a decoded policy file: ``{"workloads": [{"match": GLOB, KEY: VALUE, ...}, ...]}``.

    Unlike annotations, a policy file is the operator's configuration: any bad
    rule refuses the whole file (:class:`WorkloadError`, one line naming the rule).

    >>> rules = parse_policy_file({"workloads": [{"match": "train-*", "mode": "apply", "cpu-max": 2}]})
    >>> rules[0].match, rules[0].settings.mode, rules[0].settings.cpu_max_cores
    ('train-*', 'apply', 2.0)
    """
    if not isinstance(data, dict):
        raise WorkloadError("policy file: expected an object with a 'workloads' list")
    unknown = sorted(set(data) - {"workloads"})
    if unknown:
        raise WorkloadError(f"policy file: unknown top-level key {unknown[0]!r} (expected 'workloads')")
    items = data.get("workloads", [])
    if not isinstance(items, list):
        raise WorkloadError("policy file: 'workloads' must be a list")
    rules = []
    for i, item in enumerate(items):
        where = f"policy file: workloads[{i}]"
        if not isinstance(item, dict):
            raise WorkloadError(f"{where}: expected an object")
        match = item.get("match")
        if not isinstance(match, str) or not match:
            raise WorkloadError(f"{where}: 'match' (a glob on the container name) is required")
        rest = {k: v for k, v in item.items() if k != "match"}
        if not rest:
            raise WorkloadError(f"{where}: no settings besides 'match'")
        try:
            s = _parse({k: (v, k) for k, v in rest.items()}, "policy-file")
        except WorkloadError as e:
            raise WorkloadError(f"{where} ({match}): {e}") from None
        rules.append(Rule(match, s))
    return tuple(rules)


def match_rule(rules: Sequence[Rule], names: Sequence[str | None]) -> Settings | None:
    """The settings of the first rule whose glob matches any of *names* (container name, id).

    >>> r = parse_policy_file({"workloads": [{"match": "db*", "mode": "off"}, {"match": "*", "mode": "recommend"}]})
    >>> match_rule(r, ["db-1"]).mode, match_rule(r, ["web"]).mode, match_rule((), ["web"])
    ('off', 'recommend', None)
    """
    for rule in rules:
        if any(n is not None and fnmatch.fnmatchcase(n, rule.match) for n in names):
            return rule.settings
    return None


# --------------------------------------------------------------------------- resolution


def resolve(own: Settings | None, layout: str, default_mode: str = "auto") -> WorkloadPolicy:
    """The workload's policy: its own settings where it has them, else the host default.

    *own*: from annotations or the policy file (``None``: none);
    *layout*: where its cgroup is (``flat`` or a runtime layout);
    *default_mode*: the host's (``auto``: ``apply`` for flat, ``off`` otherwise).
    Own settings without a ``mode`` take the default mode, with their bounds.
    """
    if default_mode not in DEFAULT_MODES:
        raise ValueError(f"default mode must be one of {DEFAULT_MODES}, got {default_mode!r}")
    default = ("apply" if layout == "flat" else "off") if default_mode == "auto" else default_mode
    if own is None:
        return WorkloadPolicy(mode=default, source="default")
    if own.error is not None:
        return WorkloadPolicy(mode="off", source=own.source, error=own.error)
    return WorkloadPolicy(mode=own.mode or default, source=own.source, policy=own.policy,
                          cpu_min_cores=own.cpu_min_cores, cpu_max_cores=own.cpu_max_cores,
                          mem_min_bytes=own.mem_min_bytes, mem_max_bytes=own.mem_max_bytes,
                          priority=own.priority, workload_class=own.workload_class, update_mode=own.update_mode,
                          job=own.job, signature=own.signature)


def without_off(samples: HostSamples) -> HostSamples:
    """*samples* without the containers whose workload mode is ``off`` (the worker decides nothing for them).

    Samples that carry no resolved policy (an older host agent) are kept.

    >>> from phasewise.kit.records import ContainerSample
    >>> cs = [ContainerSample(container=c, cpu_cores=1.0, mem_bytes=1.0, workload=WorkloadPolicy(mode=m))
    ...       for c, m in (("a", "off"), ("b", "recommend"), ("c", "apply"))]
    >>> hs = HostSamples(host="h", ts=1.0, interval_s=1.0, containers=tuple(cs))
    >>> [c.container for c in without_off(hs).containers]
    ['b', 'c']
    """
    keep = tuple(c for c in samples.containers if c.workload is None or c.workload.mode != "off")
    if len(keep) == len(samples.containers):
        return samples
    return dataclasses.replace(samples, containers=keep)


# --------------------------------------------------------------------------- what the worker's step needs


def policy_of(c: ContainerSample, default: str) -> str:
    """The limit policy *c* is decided with: its workload's own (``phasewise.io/policy``), else *default*.

    >>> c = ContainerSample(container="a", cpu_cores=1.0, mem_bytes=1.0, workload=WorkloadPolicy(mode="apply"))
    >>> asks = dataclasses.replace(c, workload=WorkloadPolicy(mode="apply", policy="phase"))
    >>> policy_of(c, "vpa"), policy_of(asks, "vpa")
    ('vpa', 'phase')
    """
    w = c.workload
    return default if w is None or w.policy is None else w.policy


@dataclass(frozen=True, slots=True)
class StepColumns:
    """The workloads' settings of a step's samples, as the vectorised step uses them.

    ``policies``: each row's limit policy (:func:`policy_of`), ``None`` when every row takes the
    default; ``lo`` / ``hi``: ``(n, 2)`` CPU cores and memory bytes of the workloads' own minimum and
    maximum limits (NaN: none), ``None`` when no row has any.
    """

    policies: tuple[str, ...] | None
    lo: np.ndarray | None
    hi: np.ndarray | None

    def uses(self, policy: str, default: str) -> np.ndarray | bool:
        """Rows decided with *policy*: a bool array, or one bool when every row takes *default*."""
        if self.policies is None:
            return policy == default
        import numpy as np

        return np.array([p == policy for p in self.policies], dtype=bool)

    def take(self, idx: np.ndarray) -> StepColumns:
        """The columns of rows *idx*."""
        pol = None if self.policies is None else tuple(self.policies[i] for i in idx.tolist())
        return StepColumns(pol, None if self.lo is None else self.lo[idx], None if self.hi is None else self.hi[idx])


_NO_COLUMNS = StepColumns(None, None, None)


def step_columns(cs: Sequence[ContainerSample], default: str) -> StepColumns:
    """:class:`StepColumns` of samples *cs*, with *default* the policy of rows whose workload names none.

    One pass over the samples when no workload names a policy or bounds (the usual case: ~0.1 us per
    sample), so the worker's batched step stays batched.

    >>> w = WorkloadPolicy(mode="apply", policy="phase", cpu_max_cores=2.0)
    >>> cs = [ContainerSample(container=n, cpu_cores=1.0, mem_bytes=1.0, workload=x)
    ...       for n, x in (("a", None), ("b", w))]
    >>> col = step_columns(cs, "vpa")
    >>> col.policies, col.uses("vpa", "vpa").tolist(), col.hi.tolist()
    (('vpa', 'phase'), [True, False], [[nan, nan], [2.0, nan]])
    >>> step_columns(cs[:1], "vpa")
    StepColumns(policies=None, lo=None, hi=None)
    """
    if not any((w := c.workload) is not None
               and (w.policy is not None or w.cpu_min_cores is not None or w.cpu_max_cores is not None
                    or w.mem_min_bytes is not None or w.mem_max_bytes is not None) for c in cs):
        return _NO_COLUMNS
    ws = [c.workload for c in cs]
    pol = tuple(default if w is None or w.policy is None else w.policy for w in ws)
    if all(p == default for p in pol):
        pol = None
    if any(w is not None and (w.cpu_min_cores is not None or w.cpu_max_cores is not None
                              or w.mem_min_bytes is not None or w.mem_max_bytes is not None) for w in ws):
        import numpy as np

        # None -> NaN in a float array
        lo = np.array([(None, None) if w is None else (w.cpu_min_cores, w.mem_min_bytes) for w in ws], dtype=float)
        hi = np.array([(None, None) if w is None else (w.cpu_max_cores, w.mem_max_bytes) for w in ws], dtype=float)
        if np.isnan(lo).all():
            lo = None
        if np.isnan(hi).all():
            hi = None
    else:
        lo = hi = None
    return StepColumns(pol, lo, hi)


def unserved(samples: HostSamples, default: str, served: Sequence[str]
             ) -> tuple[HostSamples, tuple[ContainerSample, ...]]:
    """*samples* without the containers whose workload asks for a policy not in *served*, and those.

    A worker decides a container only with the policy its workload names (``phasewise.io/policy``),
    never silently with another: the containers it cannot serve are refused, not decided.

    >>> from phasewise.kit.records import ContainerSample
    >>> cs = [ContainerSample(container=c, cpu_cores=1.0, mem_bytes=1.0,
    ...                       workload=WorkloadPolicy(mode="apply", policy=p))
    ...       for c, p in (("a", None), ("b", "phase"), ("c", "vpa"))]
    >>> hs = HostSamples(host="h", ts=1.0, interval_s=1.0, containers=tuple(cs))
    >>> kept, refused = unserved(hs, "vpa", ("vpa",))
    >>> [c.container for c in kept.containers], [c.container for c in refused]
    (['a', 'c'], ['b'])
    """
    if all(p in served for p in WORKLOAD_POLICIES) or not any(
            (w := c.workload) is not None and w.policy is not None and w.policy not in served
            for c in samples.containers):
        return samples, ()
    keep, out = [], []
    for c in samples.containers:
        (keep if policy_of(c, default) in served else out).append(c)
    return dataclasses.replace(samples, containers=tuple(keep)), tuple(out)


def refusal_reason(c: ContainerSample, default: str, served: Sequence[str]) -> str:
    """Why a worker serving *served* (default *default*) does not decide *c* (see :func:`unserved`).

    >>> c = ContainerSample(container="b", cpu_cores=1.0, mem_bytes=1.0,
    ...                     workload=WorkloadPolicy(mode="apply", source="annotation", policy="phase"))
    >>> print(refusal_reason(c, "vpa", ("vpa",)))
    its workload asks for policy phase (from annotation), which this worker does not run (--policy vpa without \
--phase-workloads): not decided; run the worker with --phase-workloads or --policy phase
    """
    w = c.workload
    asked = policy_of(c, default)
    where = f" (from {w.source})" if w is not None else ""
    return (f"its workload asks for policy {asked}{where}, which this worker does not run (--policy {default} "
            f"without --phase-workloads): not decided; run the worker with --phase-workloads or --policy phase")
