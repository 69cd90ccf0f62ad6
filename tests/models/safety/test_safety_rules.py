"""The safety rules in the worker's step, under both policies, in a simulated closed loop.

A container's demand (CPU with bursts, memory with checkpoint spikes) runs
against the limits the worker decides, applied at once as an actuator would:
CPU use is capped at the limit (and then throttled), memory above the limit
is an OOM kill (the job restarts small). Every decision is then checked
against the rules, computed here from the samples themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.kit.records import ContainerSample, Decision, HostSamples, WorkloadPolicy
from phasewise.kit.settings import Settings
from phasewise.models.phases.detector import PhaseModel, learn
from phasewise.models.phases.updater import PhaseHooks
from phasewise.models.safety.guard import LimitGuard
from phasewise.models.vpa.updater import process_host_samples
from phasewise.streams.config import detector_config, state_cache, updater_config

MIB = 2**20
RULES = {"safety_min_history_s": 60.0, "safety_cooldown_s": 30.0, "safety_max_decrease": 0.25,
         "safety_peak_window_s": 240.0, "mem_margin_bytes": 32 * MIB}


def settings(policy: str, **kw) -> Settings:
    return Settings.from_env({"policy": policy, "recommend_interval_s": 5.0, "vpa_time_scale": 0.001,
                              "hysteresis": 0.05, **RULES, **kw}, env={})


def warm_model() -> PhaseModel:
    m = PhaseModel(features=("cpu", "mem"), n_his=2, warmup=32, seed=0)
    W = np.array([[demand(t + k) for k in range(3)] for t in range(0, 480, 3)])
    for _ in range(4):
        learn(m, W)
    m.clusterer.update_stats(m.predict(W), W[:, -1])
    m.clusterer.update_rel_stats(m.predict(W), W[:, -1] / W[:, -1].max(axis=0))
    return m


def demand(t: int) -> tuple[float, float]:
    """A training job: CPU 0.3 cores with bursts to 1.2 every 100 s; memory 300 MiB with a 3 s
    checkpoint spike to 700 MiB every 120 s."""
    cpu = 1.2 if t % 100 < 20 else 0.3
    mem = 700 * MIB if t % 120 < 3 else 300 * MIB
    return cpu, float(mem)


class Loop:
    """One container's closed loop: the worker's decisions are its limits from the next second."""

    def __init__(self, policy: str, workload: WorkloadPolicy | None = None, **kw) -> None:
        self.s = settings(policy, **kw)
        self.workload = workload  # the container's per-workload policy (its min/max), as the host agent sends it
        self.cache = state_cache(self.s)
        self.hooks = (PhaseHooks(detector_config(self.s), self.cache, model=warm_model(), version=1)
                      if policy == "phase" else None)
        self.cpu_limit, self.mem_limit = 2.0, float(2**31)
        self.samples: list[tuple[float, float, float, float]] = []  # ts, cpu use, mem use, throttled share
        self.decisions: list[tuple[Decision, float, float]] = []  # decision, cpu and mem in force before
        self.ooms = 0
        self.restart_until = -1

    def run(self, seconds: int, t0: float = 10_000.0) -> Loop:
        for k in range(seconds):
            t = t0 + k
            want_cpu, want_mem = demand(k)
            if k < self.restart_until:  # restarting after a kill: small
                want_mem = 100 * MIB
            oom = 0
            if want_mem > self.mem_limit:
                oom, want_mem, self.restart_until = 1, 50 * MIB, k + 10
                self.ooms += 1
            used = min(want_cpu, self.cpu_limit)
            thr = 1.0 if want_cpu > self.cpu_limit else 0.0
            self.samples.append((t, used, want_mem, thr))
            c = ContainerSample(container="job", cpu_cores=used, mem_bytes=want_mem, cpu_limit_cores=self.cpu_limit,
                                mem_limit_bytes=self.mem_limit, nr_periods=10, throttled_periods=int(10 * thr),
                                throttled_s=0.1 * thr, oom_events=oom, workload=self.workload)
            hs = HostSamples(host="h1", ts=t, interval_s=1.0, containers=(c,))
            got = process_host_samples(self.cache, hs, updater_config(self.s))
            if self.hooks is not None:
                got = self.hooks.process_many([hs]).decisions
            for d in got:
                self.decisions.append((d, self.cpu_limit, self.mem_limit))
                if d.cpu_limit_cores is not None:
                    self.cpu_limit = d.cpu_limit_cores
                if d.mem_limit_bytes is not None:
                    self.mem_limit = d.mem_limit_bytes
        return self


@pytest.fixture(scope="module", params=["vpa", "phase"])
def loop(request) -> Loop:
    return Loop(request.param).run(1500)


def test_no_limit_is_lowered_before_the_minimum_history(loop):
    first = loop.samples[0][0]
    for d, cpu0, mem0 in loop.decisions:
        if d.ts - first < RULES["safety_min_history_s"]:
            assert d.cpu_limit_cores is None or d.cpu_limit_cores >= cpu0, d.reason
            assert d.mem_limit_bytes is None or d.mem_limit_bytes >= mem0, d.reason


def test_cpu_is_never_lowered_while_the_container_was_throttled(loop):
    window = loop.s.safety.cooldown_s  # the rules wait a cooldown of unthrottled samples
    thr_at = [t for t, _, _, thr in loop.samples if thr > loop.s.vpa.throttle_threshold]
    cuts = [d for d, cpu0, _ in loop.decisions if d.cpu_limit_cores is not None and d.cpu_limit_cores < cpu0]
    assert cuts, "the loop should lower CPU at some point"
    for d in cuts:
        assert not any(d.ts - window <= t <= d.ts for t in thr_at), d.reason


def test_memory_is_never_set_below_the_recent_peak_plus_margin(loop):
    w = RULES["safety_peak_window_s"] / LimitGuard.PEAK_BUCKETS
    covered = (LimitGuard.PEAK_BUCKETS - 1) * w  # the buckets always cover this much of the window
    mem_sets = [d for d, _, _ in loop.decisions if d.mem_limit_bytes is not None]
    assert mem_sets
    for d in mem_sets:
        peak = max(m for t, _, m, _ in loop.samples if d.ts - covered <= t <= d.ts)
        assert d.mem_limit_bytes >= peak + RULES["mem_margin_bytes"], d.reason


def test_decreases_are_spaced_by_the_cooldown_and_bounded_in_size(loop):
    last: dict[str, float] = {}
    for d, cpu0, mem0 in loop.decisions:
        for res, new, old in (("cpu", d.cpu_limit_cores, cpu0), ("mem", d.mem_limit_bytes, mem0)):
            if new is None or new >= old:
                continue
            assert new >= old * (1 - RULES["safety_max_decrease"]) - 1e-9, d.reason
            if res in last:
                assert d.ts - last[res] >= RULES["safety_cooldown_s"], d.reason
            last[res] = d.ts


def test_every_decision_says_which_rules_bounded_it(loop):
    seen: set[str] = set()
    for d, _, _ in loop.decisions:
        safety = d.details["safety"]
        assert set(safety) == {"bounded_by", "in_force", "peak_mem_bytes", "mem_floor_bytes"}
        for res, rules in safety["bounded_by"].items():
            seen.update(rules)
            assert f"{res} by {', '.join(rules)}" in d.reason
    assert "step" in seen, seen


def test_the_rules_keep_the_loop_free_of_oom_kills_that_the_bare_policy_causes(loop):
    policy = loop.s.worker.policy
    bare = Loop(policy, safety_rules=False).run(1500)
    assert loop.ooms == 0
    if policy == "phase":  # the VPA keeps its own memory above these spikes; the phase policy does not
        assert bare.ooms > 0, "without the rules the phase policy cuts under the checkpoint spikes"
    assert all("safety" not in d.details for d, _, _ in bare.decisions)


@pytest.mark.parametrize("policy", ["vpa", "phase"])
def test_an_oom_kill_is_answered_at_once_above_vpas_bump(policy):
    lp = Loop(policy, safety_min_history_s=0.0)
    lp.run(30)
    lp.mem_limit = 200 * MIB  # someone set it too low: the next checkpoint spike is killed
    lp.run(20, t0=10_030.0)
    assert lp.ooms == 1
    answer = [d for d, _, mem0 in lp.decisions if d.ts == 10_030.0 and d.mem_limit_bytes is not None]
    assert answer, [(d.ts, d.reason) for d, _, _ in lp.decisions]
    assert answer[0].mem_limit_bytes >= max(1.2 * 200 * MIB, 200 * MIB + 100 * MIB)


# --------------------------------------------------------------------------- the workload's own min/max

BOUNDS = WorkloadPolicy(mode="apply", source="annotation", cpu_min_cores=0.4, cpu_max_cores=0.9,
                        mem_min_bytes=float(400 * MIB), mem_max_bytes=float(600 * MIB))


@pytest.fixture(scope="module", params=["vpa", "phase"])
def bounded(request) -> Loop:
    return Loop(request.param, workload=BOUNDS).run(1500)


def test_every_decision_of_the_worker_keeps_the_workloads_min_and_max(bounded):
    """cpu-min 0.4 / cpu-max 0.9 / memory-min 400Mi / memory-max 600Mi (bursts to 1.2 cores and spikes
    to 700 MiB): every published limit is within them, as the actuator would clamp it, except memory
    under the recent peak + margin (the max gives way, as the actuator's does)."""
    assert bounded.decisions
    named: set[str] = set()
    for d, _, _ in bounded.decisions:
        by = (d.details.get("safety") or {}).get("bounded_by", {})
        named |= {r for rules in by.values() for r in rules}
        if d.cpu_limit_cores is not None:
            assert 0.4 <= d.cpu_limit_cores <= 0.9, d.reason
        if d.mem_limit_bytes is not None:
            assert d.mem_limit_bytes >= 400 * MIB, d.reason
            if d.mem_limit_bytes > 600 * MIB:
                assert "peak" in by.get("mem", []) or "oom" in by.get("mem", []), d.reason
    assert "workload_max" in named, "the bursts should have pressed against cpu-max"
    assert any("workload_max" in (d.details["safety"]["bounded_by"].get("cpu") or []) and "workload_max" in d.reason
               for d, _, _ in bounded.decisions)


def test_without_bounds_the_same_loop_goes_past_them():
    free = Loop("vpa").run(1500)
    assert any(d.cpu_limit_cores is not None and d.cpu_limit_cores > 0.9 for d, _, _ in free.decisions)
