"""The measured-interference scorer against hand computations on a tiny co-location table."""

from __future__ import annotations

import numpy as np
import pytest

from phasewise.models.jobs.placement import Cluster, Gpu, Job, Node, Placement, PlacementConfig, make_policy
from phasewise.models.jobs.placement.interference import (
    CoLocationTable,
    InterferenceMeter,
    MeasuredHorus,
    gpu_throughputs,
    parse_gavel,
    score,
)

A, B, C, D = ("A", 1), ("B", 1), ("C", 1), ("D", 1)
E, F, G = ("E", 2), ("F", 2), ("G", 2)
#: isolated steps/s and pairs (a next to b, b next to a), each pair stored once
TABLE = CoLocationTable(
    "tiny",
    {A: 10.0, B: 20.0, C: 5.0, D: 8.0, E: 10.0, F: 10.0, G: 10.0},
    {(A, B): (6.0, 10.0),  # A keeps 0.6, B 0.5
     (A, C): (8.0, 1.0),  # A 0.8, C 0.2
     (B, C): (22.0, 5.0),  # B 1.1 (clipped to 1), C 1.0
     (A, A): (5.0, 5.0),  # 0.5 each
     (E, F): (9.0, 9.0), (E, G): (7.0, 7.0)},  # D has no pair at all
)


def approx(v: float):
    """The summaries are rounded (slowdowns to 4 decimals, counts to 3)."""
    return pytest.approx(v, abs=1e-4)


def test_normalised_reads_either_order_clips_and_says_unmeasured():
    assert TABLE.normalised(A, B) == pytest.approx(0.6)
    assert TABLE.normalised(B, A) == pytest.approx(0.5)  # stored as (A, B): B's side is the second
    assert TABLE.normalised(B, C) == 1.0  # 22/20 measured above isolated: clipped
    assert TABLE.normalised(A, D) is None and TABLE.normalised(("Z", 1), A) is None
    assert TABLE.workloads(1) == (A, B, C, D) and TABLE.workloads(2) == (E, F, G) and TABLE.workloads(8) == ()


def test_three_on_a_gpu_multiply_their_pairs_and_the_worst_pair_bounds_it():
    a, c, b = gpu_throughputs(TABLE, [A, C, B])
    assert a == pytest.approx((0.8 * 0.6, 0.6))
    assert c == pytest.approx((0.2 * 1.0, 0.2))
    assert b == pytest.approx((0.5 * 1.0, 0.5))
    assert gpu_throughputs(TABLE, [A, D]) == [None, None]
    assert gpu_throughputs(TABLE, [A, None]) == [None, None]
    assert gpu_throughputs(TABLE, [A]) == [(1.0, 1.0)]


def test_score_of_one_placement_by_hand():
    placement = {"a1": ["g0"], "b1": ["g0"], "a2": ["g1"], "c1": ["g1"], "b2": ["g1"], "c2": ["g2"],
                 "a3": ["g3"], "d1": ["g3"]}
    wl = {"a1": A, "b1": B, "a2": A, "c1": C, "b2": B, "c2": C, "a3": A, "d1": D}
    s = score(TABLE, placement, wl)
    # g0: a1 0.4, b1 0.5; g1 (three): a2 1 - 0.48 = 0.52 (worst pair 0.4), c1 0.8, b2 0.5; g2 alone;
    # g3: A next to D is not measured -> both unmeasured
    assert s["shared_gpus"] == 3 and s["colocated_jobs"] == 7 and s["unmeasured_jobs"] == 2
    assert s["extrapolated_jobs"] == 3
    assert s["slowdown_mean"] == approx((0.4 + 0.5 + 0.52 + 0.8 + 0.5) / 5)
    assert s["slowdown_mean_worst_pair"] == approx((0.4 + 0.5 + 0.4 + 0.8 + 0.5) / 5)
    assert s["slowdown_p95"] == approx(0.8)  # 5 values: the 95th percentile is the largest
    assert s["slowed_jobs"] == 5 and s["slowed_share"] == 1.0
    assert s["lost_gpus"] == approx(2.72)
    assert s["combined_tput_mean"] == approx(((0.6 + 0.5) + (0.48 + 0.2 + 0.5)) / 2)  # g3 left out
    assert score(TABLE, placement, wl, slowed=0.5)["slowed_jobs"] == 2  # 0.52 and 0.8


def test_a_multi_gpu_job_runs_at_its_slowest_gpu_and_loses_all_its_gpus():
    s = score(TABLE, {"e": ["g5", "g6"], "f": ["g5"], "g": ["g6"]}, {"e": E, "f": F, "g": G})
    # e: 0.9 on g5, 0.7 on g6 -> 0.7, slowdown 0.3 on 2 GPUs; f 0.1, g 0.3
    assert s["colocated_jobs"] == 3 and s["slowdown_mean"] == approx((0.3 + 0.1 + 0.3) / 3)
    assert s["lost_gpus"] == approx(0.3 * 2 + 0.1 + 0.3)


def test_time_weighted_as_jobs_come_and_go():
    m = InterferenceMeter(TABLE, {"a": A, "b": B, "c": C})
    m.place("a", ["g"])
    m.advance(2.0)  # alone: nothing co-located
    m.place("b", ["g"])
    m.advance(3.0)  # a 0.4, b 0.5
    m.place("c", ["g"])
    m.advance(1.0)  # a 0.52, b 0.5, c 0.8
    m.release("b")
    m.advance(4.0)  # a 0.2, c 0.8
    m.release("a")
    m.advance(0.0)  # no weight: nothing added
    s = m.summary()
    assert s["colocated_jobs"] == approx((2 * 3 + 3 * 1 + 2 * 4) / 10)
    assert s["shared_gpus"] == approx(8 / 10)
    assert s["extrapolated_jobs"] == approx(3 / 10)
    job_time = 6 + 3 + 8
    assert s["slowdown_mean"] == approx(((0.4 + 0.5) * 3 + (0.52 + 0.5 + 0.8) + (0.2 + 0.8) * 4) / job_time)
    assert s["lost_gpus"] == approx(((0.4 + 0.5) * 3 + (0.52 + 0.5 + 0.8) + (0.2 + 0.8) * 4) / 10)
    assert m.job_vals == {} and m.gpu_vals == {}  # c alone again
    m.release("c")
    assert m.on == {} and m.gpus_of == {}


def test_an_empty_placement_has_no_slowdown():
    s = score(TABLE, {}, {})
    assert s["colocated_jobs"] == 0 and s["slowdown_mean"] is None and s["slowdown_p95"] is None
    assert s["combined_tput_mean"] is None and s["lost_gpus"] == 0


def test_parse_gavel_keys_and_errors():
    raw = {"v100": {"('LM (batch size 5)', 1)": {"null": 100.0, "('A3C', 1)": [50.0, 3.0]},
                    "('A3C', 1)": {"null": 6.0, "('LM (batch size 5)', 1)": [3.0, 50.0]}}}
    t = parse_gavel(raw, "v100")
    assert t.isolated == {("LM (batch size 5)", 1): 100.0, ("A3C", 1): 6.0}
    assert t.normalised(("LM (batch size 5)", 1), ("A3C", 1)) == 0.5
    assert t.normalised(("A3C", 1), ("LM (batch size 5)", 1)) == 0.5
    with pytest.raises(KeyError):
        parse_gavel(raw, "k80")
    with pytest.raises(ValueError, match="scale factor"):
        parse_gavel({"x": {"'LM'": {"null": 1.0}}}, "x")
    with pytest.raises(ValueError, match="pair"):
        parse_gavel({"x": {"('A', 1)": {"null": 1.0, "('B', 1)": 3.0}}}, "x")


def test_measured_horus_puts_a_job_where_the_measured_loss_is_least():
    # one node, two GPUs: an A on GPU 0, a B on GPU 1; the new job is another A (0.3 GPU each)
    c = Cluster([Node("n", 8000, 8 << 30, gpus=(Gpu("V100"),) * 2)],
                PlacementConfig(isolate_inference=False, horus_frag_weight=1.0))
    wl = {"a0": A, "b0": B, "new": A, "d0": D}
    jobs = {k: Job(k, 100, 1 << 20, gpus=0.3) for k in wl}
    c.allocate(jobs["a0"], Placement("a0", "n", (0,)))
    c.allocate(jobs["b0"], Placement("b0", "n", (1,)))
    pol = MeasuredHorus(TABLE, wl)
    # next to A both keep 0.5: 1.0 lost; next to B, A keeps 0.6 and B 0.5: 0.9 lost -> GPU 1
    p = pol.place(jobs["new"], c)
    assert (p.node, p.gpus) == ("n", (1,))
    # plain horus (requests as utilisation: never over 100 %) ranks both GPUs alike and takes the lower index
    assert make_policy("horus").place(jobs["new"], c).gpus == (0,)
    # B leaves and D comes: the policy follows the cluster's bookings; next to D nothing is measured, so
    # Horus's own term (0 here) stands against 1.0 measured next to A
    c.release("b0")
    c.allocate(jobs["d0"], Placement("d0", "n", (1,)))
    assert pol.place(jobs["new"], c).gpus == (1,)
    assert pol._on == {(0, 0): ["a0"], (0, 1): ["d0"]}
    # a job without a workload is placed as horus places it
    assert pol.place(Job("x", 100, 1 << 20, gpus=0.3), c).gpus == make_policy("horus").place(
        Job("x", 100, 1 << 20, gpus=0.3), c).gpus


def test_the_measured_loss_s_weight_scales_it_against_the_fragmentation_term():
    c = Cluster([Node("n", 8000, 8 << 30, gpus=(Gpu("V100"),) * 2)],
                PlacementConfig(isolate_inference=False, horus_frag_weight=1.0))
    wl = {"a0": A, "b0": B, "new": A}
    jobs = {k: Job(k, 100, 1 << 20, gpus=0.3) for k in wl}
    c.allocate(jobs["a0"], Placement("a0", "n", (0,)))
    c.allocate(jobs["b0"], Placement("b0", "n", (1,)))
    rows = np.array([0])
    h1, over1 = MeasuredHorus(TABLE, wl)._gpu_terms(jobs["new"], c, rows)
    assert over1[0].tolist() == pytest.approx([1.0, 0.9])  # the measured losses (as above)
    for w in (0.0, 0.25, 3.0):
        h, over = MeasuredHorus(TABLE, wl, weight=w)._gpu_terms(jobs["new"], c, rows)
        assert over[0].tolist() == pytest.approx([w * 1.0, w * 0.9]) and np.array_equal(h, h1)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight"):
            MeasuredHorus(TABLE, wl, weight=bad)
