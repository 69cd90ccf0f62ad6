"""Safety rules: floors, caps and rejections, pure and table-driven."""

from __future__ import annotations

import math

import pytest

from phasewise.actuators.commands import Freeze, SetLimits, Terminate, Thaw
from phasewise.actuators.safety import Cap, Floor, Planned, Rejected, Requested, Unsafe, plan
from phasewise.kit.records import Decision
from phasewise.kit.settings import Settings
from tests.job_keys import TRUSTED, start

MiB = 2**20
S = Settings().replace(host="h1", cpu_floor_cores=0.1, mem_margin_bytes=64 * MiB,
                       mem_floor_bytes=32 * MiB)


def decision(**kw) -> Decision:
    base = dict(id="d1", ts=1.0, host="h1", container="job-a", action="limit", policy="test")
    return Decision(**{**base, **kw})


def plan_for(*, exists=True, usage=100 * MiB, host_cores=4.0, **kw):
    return plan(decision(**kw), exists=exists, usage_mem_bytes=usage, host_cores=host_cores, settings=S,
                submitters=TRUSTED, host_cpus=frozenset({0}))


# (decision fields, usage, expected cpu, expected mem, expected status, words in message)
CASES = [
    ("cpu inside the bounds is applied as asked",
     dict(cpu_limit_cores=1.5), None, 1.5, None, "applied", []),
    ("cpu below the floor is raised to the floor",
     dict(cpu_limit_cores=0.01), None, 0.1, None, "clamped", ["CPU floor"]),
    ("cpu of zero is raised to the floor",
     dict(cpu_limit_cores=0.0), None, 0.1, None, "clamped", ["CPU floor"]),
    ("cpu above the host is lowered to the host's cores",
     dict(cpu_limit_cores=64.0), None, 4.0, None, "clamped", ["host's cores"]),
    ("memory above usage + margin is applied as asked",
     dict(mem_limit_bytes=500 * MiB), 100 * MiB, None, 500 * MiB, "applied", []),
    ("memory below usage is raised to usage + margin",
     dict(mem_limit_bytes=10 * MiB), 100 * MiB, None, 164 * MiB, "clamped",
     ["current usage 100.0 MiB", "margin 64.0 MiB"]),
    ("memory between usage and usage + margin is raised to usage + margin",
     dict(mem_limit_bytes=120 * MiB), 100 * MiB, None, 164 * MiB, "clamped", ["current usage"]),
    ("memory of an idle container is raised to the static floor then usage + margin",
     dict(mem_limit_bytes=1 * MiB), 0.0, None, 64 * MiB, "clamped", ["memory floor", "current usage"]),
    ("both limits are bounded independently",
     dict(cpu_limit_cores=0.01, mem_limit_bytes=10 * MiB), 100 * MiB, 0.1, 164 * MiB, "clamped",
     ["CPU floor", "current usage"]),
    ("an unknown usage drops the memory limit but keeps the cpu one",
     dict(cpu_limit_cores=2.0, mem_limit_bytes=500 * MiB), None, 2.0, None, "clamped", ["memory limit dropped"]),
]


@pytest.mark.parametrize("name,fields,usage,cpu,mem,status,words", CASES, ids=[c[0] for c in CASES])
def test_limits_are_bounded_by_the_floors_and_caps(name, fields, usage, cpu, mem, status, words):
    p = plan_for(usage=usage, **fields)
    assert isinstance(p, Planned), p
    assert p.command == SetLimits("job-a", cpu_cores=cpu, mem_bytes=mem)
    assert p.status == status
    for w in words:
        assert w in p.message
    if status == "applied":
        assert p.message == ""


REJECTIONS = [
    ("a container id with a slash", dict(container="../other"), {}, "not a managed container name"),
    ("a nested path", dict(container="a/b"), {}, "not a managed container name"),
    ("an empty container id", dict(container=""), {}, "not a managed container name"),
    ("a container that does not exist", {}, dict(exists=False), "does not exist"),
    ("a limit decision with no limits", {}, {}, "no limits"),
    ("an action no actuator performs", dict(action="share"), {}, "not performed by this actuator"),
    ("a terminate for a container that does not exist", dict(action="terminate"), dict(exists=False),
     "does not exist"),
    ("a place action for a container that exists", dict(action="place", details=start("job-a", ts=1.0)), {},
     "already exists"),
    ("a place action without a signed job", dict(action="place", details={"command": ["sh"]}), dict(exists=False),
     "no job signature"),
    ("only a memory limit with unknown usage", dict(mem_limit_bytes=500 * MiB), dict(usage=None), "unknown"),
    ("a NaN usage with only a memory limit", dict(mem_limit_bytes=500 * MiB), dict(usage=math.nan), "unknown"),
    ("a cpu limit on a host of unknown size", dict(cpu_limit_cores=1.0), dict(host_cores=math.nan), "core count"),
]


@pytest.mark.parametrize("name,fields,observed,reason", REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_unsafe_decisions_are_rejected_with_a_reason(name, fields, observed, reason):
    p = plan_for(**observed, **fields)
    assert isinstance(p, Rejected), p
    assert reason in p.reason


def test_non_finite_limits_are_rejected_even_though_the_schema_guards_them():
    # Decision() built directly skips decode's validation, as a buggy in-process caller would
    for bad in (math.nan, math.inf, -1.0):
        p = plan_for(cpu_limit_cores=bad)
        assert isinstance(p, Rejected) and "finite" in p.reason
        p = plan_for(mem_limit_bytes=bad)
        assert isinstance(p, Rejected) and "finite" in p.reason


def test_freeze_and_thaw_plan_their_commands_for_existing_managed_containers():
    assert plan_for(action="freeze").command == Freeze("job-a")
    assert plan_for(action="thaw").command == Thaw("job-a")
    assert isinstance(plan_for(action="freeze", exists=False), Rejected)


def test_memory_limits_are_whole_bytes_rounded_up():
    p = plan_for(mem_limit_bytes=1000.5 * MiB + 0.25, usage=1.0)
    assert p.command.mem_bytes == math.ceil(1000.5 * MiB + 0.25)


def test_the_floor_wins_when_the_host_has_fewer_cores_than_the_floor():
    p = plan_for(cpu_limit_cores=1.0, host_cores=0.05)
    assert p.command.cpu_cores == 0.1
    assert "host's cores" in p.message and "CPU floor" in p.message


def test_rules_compose_by_wrapping_and_report_every_change():
    rule = Floor(Cap(Requested("cpu"), 8.0, "the cap"), 1.0, "the floor")
    assert rule(4.0).value == 4.0 and rule(4.0).notes == ()
    assert rule(0.5).value == 1.0 and rule(0.5).notes == ("cpu 0.5 cores raised to the floor (1 cores)",)
    assert rule(9.0).value == 8.0 and "lowered to the cap" in rule(9.0).notes[0]
    with pytest.raises(Unsafe):
        rule(math.inf)


def test_memory_is_never_set_below_the_recent_peak_plus_margin():
    from phasewise.actuators.safety import plan

    s = Settings().replace(host="h1", mem_margin_bytes=64 * 2**20, mem_floor_bytes=0)
    d = Decision(id="d", ts=1.0, host="h1", container="job", action="limit", policy="phase",
                 mem_limit_bytes=300 * 2**20)
    p = plan(d, exists=True, usage_mem_bytes=200 * 2**20, host_cores=4, settings=s, peak_mem_bytes=700 * 2**20)
    assert p.command.mem_bytes == 764 * 2**20 and p.status == "clamped"
    assert "the recent peak 700.0 MiB + margin 64.0 MiB" in p.message
    p = plan(d, exists=True, usage_mem_bytes=200 * 2**20, host_cores=4, settings=s, peak_mem_bytes=100 * 2**20)
    assert p.command.mem_bytes == 300 * 2**20 and p.status == "applied"  # above usage + margin already


def test_the_peak_tracker_keeps_the_window_maximum_per_container():
    import random

    from phasewise.actuators.safety import PeakTracker

    rng = random.Random(4)
    p = PeakTracker(window_s=50.0)
    seen = []
    t = 0.0
    for _ in range(500):
        t += rng.uniform(0, 5)
        v = rng.uniform(0, 1e9)
        seen.append((t, v))
        p.add("c", t, v)
        assert p.peak("c", t) == max(x for s_, x in seen if s_ >= t - 50.0)
    small = PeakTracker(window_s=10.0, max_containers=2)
    for i, c in enumerate(("a", "b", "c")):
        small.add(c, float(i), 1.0)
    assert small.peak("a", 3.0) is None and small.peak("c", 3.0) == 1.0


def test_a_declared_peak_must_be_a_sane_number():
    from phasewise.actuators.safety import declared_peak

    def dec(safety):
        return Decision(id="d", ts=1.0, host="h1", container="job", action="limit", policy="vpa",
                        mem_limit_bytes=1.0, details={"safety": safety} if safety is not None else {})

    assert declared_peak(dec({"peak_mem_bytes": 5e8})) == 5e8
    for bad in (None, {"peak_mem_bytes": None}, {"peak_mem_bytes": "5e8"}, {"peak_mem_bytes": -1},
                {"peak_mem_bytes": True}, "x"):
        assert declared_peak(dec(bad)) is None


# (decision details, seconds since the decision, expected command, status, words in the message or reason)
TERMINATE = [
    ("no grace named: the actuator's default", {}, 0.0, Terminate("job-a", 10.0), "applied", []),
    ("the decision's grace", {"grace_s": 2.5}, 0.0, Terminate("job-a", 2.5), "applied", []),
    ("a hard stop", {"grace_s": 0}, 0.0, Terminate("job-a", 0.0), "applied", []),
    ("a grace above the cap is lowered to it", {"grace_s": 600}, 0.0, Terminate("job-a", 30.0), "clamped",
     ["grace 600 s lowered to terminate_grace_max_s (30 s)"]),
    ("a checkpoint in progress gets no SIGTERM and what is left of its grace",
     {"mode": "checkpoint", "grace_s": 20}, 12.0, Terminate("job-a", 8.0, sigterm=False), "applied", []),
    ("a checkpoint whose grace is over is killed at once",
     {"mode": "checkpoint", "grace_s": 20}, 25.0, Terminate("job-a", 0.0, sigterm=False), "applied", []),
    ("a negative grace", {"grace_s": -1}, 0.0, None, "rejected", ["details.grace_s -1 is not a finite number"]),
    ("a grace that is not a number", {"grace_s": "soon"}, 0.0, None, "rejected", ["details.grace_s 'soon'"]),
    ("a grace that is a boolean", {"grace_s": True}, 0.0, None, "rejected", ["details.grace_s True"]),
]


@pytest.mark.parametrize("name,details,elapsed,command,status,words", TERMINATE, ids=[t[0] for t in TERMINATE])
def test_terminate_grace_is_bounded_and_a_checkpoint_is_not_cut_short(name, details, elapsed, command, status,
                                                                       words):
    s = S.replace(terminate_grace_s=10.0, terminate_grace_max_s=30.0)
    d = decision(action="terminate", ts=1000.0, details=details)
    p = plan(d, exists=True, usage_mem_bytes=None, host_cores=4.0, settings=s, now=1000.0 + elapsed)
    assert p.status == status, p
    if command is not None:
        assert p.command == command
    for w in words:
        assert w in (p.message if isinstance(p, Planned) else p.reason)


def test_a_container_is_terminated_once():
    d = decision(action="terminate")
    p = plan(d, exists=True, usage_mem_bytes=None, host_cores=4.0, settings=S, terminated="by decision t0 at T")
    assert isinstance(p, Rejected)
    assert p.reason == "container 'job-a' was already terminated (by decision t0 at T): a container is terminated once"
    assert isinstance(plan(decision(action="terminate", container="../x"), exists=True, usage_mem_bytes=None,
                           host_cores=4.0, settings=S), Rejected)
