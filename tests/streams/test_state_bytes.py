"""Container states are stored with orjson (``streams.output.state_bytes``), which writes a non-finite number
as null where ``json.dumps`` wrote NaN. That is safe only while every state source writes a missing or
non-finite number as None itself: checked here for the VPA entry (fleet, histograms, safety rules, the
book, a signed run's profile) and the phase fleet, with every float array they read set to NaN (the arrays'
"missing") in a row, and the stored bytes read back by the loaders. (No array holds an infinity: every value
comes from samples and records checked finite on intake.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from phasewise.kit.records import ContainerSample, HostSamples, WorkloadPolicy
from phasewise.kit.settings import Settings
from phasewise.models.phases.updater import PhaseHooks
from phasewise.models.vpa.updater import worker_round
from phasewise.streams.config import detector_config, initial_model, state_cache, updater_config
from phasewise.streams.output import state_bytes

S = Settings.from_env({"policy": "phase", "prior_min_runs": 1}, env={})


def _worker(n: int = 3, ticks: int = 40):
    cache = state_cache(S)
    hooks = PhaseHooks(detector_config(S), cache, model=initial_model(S)[0])
    cfg = updater_config(S)
    for k in range(ticks):
        cs = tuple(ContainerSample(container=f"c{i}", cpu_cores=0.2 + 0.1 * i + 0.05 * (k % 3),
                                   mem_bytes=3e8 + 1e7 * (k % 5), nr_periods=10,
                                   workload=WorkloadPolicy(mode="apply", signature=f"job-{i}"))
                   for i in range(n))
        worker_round(cache, [HostSamples(host="h", ts=1.7e9 + k, interval_s=1.0, containers=cs)], cfg, hooks)
    return cache, hooks


def _non_finite(o, path="$"):
    if isinstance(o, float):
        return [] if math.isfinite(o) else [path]
    if isinstance(o, dict):
        return [p for k, v in o.items() for p in _non_finite(v, f"{path}.{k}")]
    if isinstance(o, (list, tuple)):
        return [p for i, v in enumerate(o) for p in _non_finite(v, f"{path}[{i}]")]
    return []


def _float_arrays(obj, seen=None):
    """Every float numpy array reachable from *obj*'s attributes (one level into plain helper objects)."""
    seen = set() if seen is None else seen
    out = []
    for name, v in vars(obj).items():
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.ndim >= 1:
            out.append((name, v))
        elif hasattr(v, "__dict__") and type(v).__module__.startswith("phasewise.models"):
            out += [(f"{name}.{n}", a) for n, a in _float_arrays(v, seen)]
    return out


def test_every_vpa_state_is_finite_with_every_array_missing_in_its_row():
    cache, _ = _worker()
    key = "h/c1"
    row = cache._index[key]
    arrays = _float_arrays(cache)
    assert len(arrays) > 20  # the book, the fleet's arrays, the histograms, the guard's
    for _, a in arrays:
        if a.shape[0] > row:
            a[row] = np.nan
    state = cache.state_of(key)
    assert _non_finite(state) == []
    stored = json.loads(state_bytes(state))
    assert stored == json.loads(json.dumps(state))
    fresh = state_cache(S)
    fresh.loader = {key: stored}.get
    fresh.rows([key])  # the loader takes it back
    assert fresh.load_errors == 0 and fresh.loaded == 1


def test_every_phase_state_is_finite_with_every_array_missing_in_its_row():
    _, hooks = _worker()
    fleet = hooks.fleet
    c = "h/c1"
    row = fleet._windows._index[c]
    arrays = _float_arrays(fleet)
    assert any(n.endswith("since") for n, _ in arrays) and any(n.endswith("frames") for n, _ in arrays)
    for name, a in arrays:
        if a.shape[0] > row and not name.startswith("model"):
            a[row] = np.nan
    state = fleet.state_of(c)
    assert _non_finite(state) == []
    stored = json.loads(state_bytes(state))
    fleet.load_state(c, stored)  # the loader reads the stored nulls back (a missing multiplier as 0)
    again = json.loads(state_bytes(fleet.state_of(c)))
    assert {k: v for k, v in again.items() if k != "sc"} == {k: v for k, v in stored.items() if k != "sc"}


def test_states_of_a_run_round_trip_through_the_stored_bytes():
    cache, hooks = _worker()
    vpa, phase = cache.pop_dirty(), hooks.pop_dirty()
    assert vpa and phase
    for _, s in (*vpa, *phase):
        assert _non_finite(s) == []
        assert json.loads(state_bytes(s)) == s  # orjson's bytes hold json's values
    fresh = state_cache(S)
    fresh.loader = dict((k, json.loads(state_bytes(s))) for k, s in vpa).get
    for k, s in vpa:
        fresh.rows([k])
        assert fresh.state_of(k) == s


def test_a_commit_collects_its_states_with_the_garbage_collector_paused_and_resumes_it():
    import gc

    from phasewise.streams.output import DeferredWrites, PartitionMap

    parts = PartitionMap()
    parts.note("h", 3)
    seen = []

    def source():
        seen.append(gc.isenabled())
        return [("h/c0", {"v": 1, "x": [1.5, None]})]

    writes = DeferredWrites(table={}, source=source, partitions=parts)
    assert gc.isenabled()
    assert writes.take() == {"h/c0": (3, b'{"v":1,"x":[1.5,null]}')}
    assert seen == [False] and gc.isenabled()

    def broken():
        raise RuntimeError("a state source failed")

    with pytest.raises(RuntimeError):
        DeferredWrites(table={}, source=broken, partitions=parts).take()
    assert gc.isenabled()  # resumed on the way out
    gc.disable()
    try:  # one paused by someone else stays paused
        writes.take()
        assert not gc.isenabled()
    finally:
        gc.enable()
