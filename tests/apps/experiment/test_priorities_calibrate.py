"""One replica's capacity for ``experiment priorities --through-roles``: the ramp's rule, and a real replica
in a real cgroup."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from phasewise.apps.experiment.priorities_calibrate import LATE_SHARE, calibrate, capacity_from, rates_from
from tests.conftest import is_root


def test_one_late_step_is_noise_and_two_in_a_row_end_the_ramp():
    ok, late = 10.0, 900.0
    # 100 requests a step; step 2 has 2 % late (a moment of noise), steps 4 and 5 are past the SLO
    tl = []
    for k, share in enumerate([0.0, 0.0, 0.02, 0.0, 0.5, 0.3, 0.0]):
        tl += [(k + i / 100, late if i < share * 100 else ok) for i in range(100)]
    cap, steps = capacity_from(tl, [10, 20, 30, 40, 50, 60, 70], step_s=1.0, slo_ms=300.0)
    assert cap == 40 and [n for _, n, _ in steps] == [100] * 7
    # exactly LATE_SHARE late is within; failed and shed requests (inf) are late
    tl = [(0.0 + i / 100, late if i < LATE_SHARE * 100 else ok) for i in range(100)]
    tl += [(1.0 + i / 100, math.inf) for i in range(100)] + [(2.0 + i / 100, math.inf) for i in range(100)]
    assert capacity_from(tl, [10, 20, 30], step_s=1.0, slo_ms=300.0)[0] == 10
    # a step with no request at all counts as late (the replica answered nothing)
    assert capacity_from([(0.5, ok)], [10, 20, 30], step_s=1.0, slo_ms=300.0)[0] == 10


def test_the_rates_put_one_replica_s_capacity_at_the_middle_step():
    from phasewise.apps.experiment.priorities_roles import rate_steps

    low, high = rates_from(200.0)
    steps = rate_steps(low, high)
    assert steps[1][1] == pytest.approx(200.0, abs=0.1) and steps[2][1] > 200.0 and low == 50.0


@pytest.mark.slow
@pytest.mark.skipif(not (is_root() and Path("/sys/fs/cgroup/cpu").is_dir()), reason="needs root and cgroup v1 cpu")
def test_a_real_replica_is_ramped_in_its_own_cgroup_and_nothing_is_left_behind(tmp_path):
    before = {p.name for p in Path("/sys/fs/cgroup/cpu").iterdir() if p.name.startswith("pwcal-")}
    # a 2-s SLO at 10 and 20 requests/s (each a few ms of work): served, on a busy machine too
    c = calibrate(cores=0.5, slo_ms=2000.0, first_rate=10.0, factor=2.0, step_s=1.5, max_steps=2, log_dir=tmp_path)
    assert c.capacity_rps == 20.0, c
    assert [r for r, _, _ in c.steps] == [10.0, 20.0] and all(n > 0 for _, n, _ in c.steps)
    # an SLO no request can meet: two steps, then the ramp ends (not the 24 it may have)
    c = calibrate(cores=0.5, slo_ms=1e-6, first_rate=10.0, factor=1.25, step_s=1.5, max_steps=24, log_dir=tmp_path)
    assert c.capacity_rps == 0.0 and 2 <= len(c.steps) <= 4, c
    after = {p.name for p in Path("/sys/fs/cgroup/cpu").iterdir() if p.name.startswith("pwcal-")}
    assert after == before  # its cgroups removed
    assert "calibrate-1.log" in {p.name for p in tmp_path.iterdir()}  # the replica's own log, where asked
    assert len(c.cores_used) >= 2 and all(0 <= u < 1.0 for u in c.cores_used), c  # within its half core (+ noise)


def test_the_bound_is_the_replica_s_limit_only_when_it_used_it_in_the_first_step_past_the_slo():
    from phasewise.apps.experiment.priorities_calibrate import Calibration

    steps = ((10.0, 50, 0.0), (20.0, 90, 0.05), (30.0, 100, 0.0), (40.0, 120, 0.3), (50.0, 1, 1.0))
    # (the late step at 20/s is noise: the capacity is 30; the first step past it is 40/s)
    assert Calibration(30.0, steps, 0.5, 300.0, (0.1, 0.2, 0.3, 0.48, 0.5)).bound == "replica"
    assert Calibration(30.0, steps, 0.5, 300.0, (0.1, 0.5, 0.3, 0.2, 0.5)).bound == "host"
    assert Calibration(30.0, steps, 0.5, 300.0, (0.1, 0.2, 0.3)).bound == "unknown"
    assert Calibration(50.0, steps[:3], 0.5, 300.0, (0.1, 0.2, 0.3)).bound == "none"
    d = Calibration(30.0, steps, 0.5, 300.0, (0.1, 0.2, 0.3, 0.48, math.nan)).to_dict()
    assert d["bound"] == "replica" and d["steps"][3]["cores_used"] == 0.48 and d["steps"][4]["cores_used"] is None
