"""phasewise simulate on every openb 2023 list form (real excerpts), FGD's inflation experiment, and FGD's
fragmentation on GPU-model-constrained nodes against hand computations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from phasewise.apps.simulate.inflation import inflate, run_seed, summarise
from phasewise.apps.simulate.openb import TraceError, load_nodes, load_pods
from phasewise.cli import main
from phasewise.models.jobs.placement import (
    Cluster,
    Fgd,
    Gpu,
    Horus,
    Job,
    Node,
    Placement,
    PlacementConfig,
    fragmentation,
    workload_types,
)
from phasewise.models.jobs.placement.fragmentation import _Fragmentation

CONFIG = PlacementConfig(isolate_inference=False, horus_frag_weight=1.0)
DATA = Path(__file__).parent / "data" / "openb"  # real rows of the published lists (data/openb/PROVENANCE.txt)
GIB = 1 << 30
V100 = (("gpu_model", "V100M32"),)


# -- every list form -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,rows,timed,selectors,multi", [
    ("pods_gpuspec33.csv", 32, True, 16, 0),  # 11 columns, 16 rows with a GPU model constraint
    ("pods_cpu050.csv", 20, True, 0, None),
    ("pods_gpushare100.csv", 20, True, 0, None),
    ("pods_multigpu50.csv", 27, False, 0, 3),  # 5 columns: no gpu_spec, qos or times
])
def test_each_published_form_reads(name, rows, timed, selectors, multi):
    pods = load_pods(DATA / name)
    assert len(pods) == rows and all(p.timed is timed for p in pods)
    assert sum(1 for p in pods if p.job.node_selector) == selectors
    if multi is not None:
        assert sum(1 for p in pods if p.job.count > 1) >= multi
    if not timed:  # file order, one step per row
        assert [p.created for p in pods] == [float(i) for i in range(rows)]
        assert [p.job.job for p in pods][:2] == ["openb-pod-0000", "openb-pod-0001"]
    spec = [p.job.node_selector for p in pods if p.job.node_selector]
    assert all(k == "gpu_model" for s in spec for k, _ in s)
    nodes = load_nodes(DATA / "nodes_gpu.csv")
    assert len(nodes) == 15 and {n.gpus[0].model for n in nodes} == {"P100", "V100M32", "V100M16", "G2", "T4"}


def test_the_multigpu_form_runs_in_fill_and_inflation_and_is_refused_for_timed(capsys):
    pods, nodes = str(DATA / "pods_multigpu50.csv"), str(DATA / "nodes_gpu.csv")
    assert main(["simulate", pods, "--nodes", nodes, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no creation_time and deletion_time: use --mode fill or inflation" in err and "\n" not in err
    assert main(["simulate", pods, "--nodes", nodes, "--mode", "fill", "--quiet", "--json", "--jobs", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 4


@pytest.mark.parametrize("head,why", [
    ("name,cpu_milli,memory_mib,num_gpu", "missing column(s) gpu_milli (expected name,cpu_milli"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time", "creation_time without deletion_time"),
    ("sn,cpu_milli,memory_mib,gpu,model", "missing column(s) name, num_gpu, gpu_milli"),
])
def test_anything_else_is_one_clear_line(tmp_path, capsys, head, why):
    p = tmp_path / "pods.csv"
    p.write_text(head + "\n")
    rc = main(["simulate", str(p), "--nodes", str(DATA / "nodes_gpu.csv"), "--mode", "fill", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and why in err and "not an openb pod list" in err and "\n" not in err
    with pytest.raises(TraceError, match="not an openb node list"):
        load_nodes(DATA / "pods_cpu050.csv")


# -- FGD's inflation experiment ------------------------------------------------------------------------

def _demand(pods):
    return sum(p.job.milli * p.job.count for p in pods)


def test_inflation_is_deterministic_per_seed_and_stops_where_fgd_does():
    pods, nodes = load_pods(DATA / "pods_gpuspec33.csv"), load_nodes(DATA / "nodes_gpu.csv")
    cap = sum(len(n.gpus) for n in nodes) * 1000
    assert _demand(pods) < 1.3 * cap  # the excerpt asks for less: inflate up
    a, b, c = (inflate(pods, nodes, 1.3, s) for s in (42, 42, 43))
    assert [p.job for p in a] == [p.job for p in b] and [p.job for p in a] != [p.job for p in c]
    assert _demand(a) <= 1.3 * cap and len(a) > len(pods)
    assert {p.job.job for p in pods} <= {p.job.job for p in a}  # every pod kept, copies added
    assert len({p.job.job for p in a}) == len(a) and [p.created for p in a] == [float(i) for i in range(len(a))]
    small = inflate(pods, nodes, 0.05, 1)  # asks for more than 5 %: pods dropped until it does not
    assert _demand(small) <= 0.05 * cap and len(small) < len(pods)


def test_run_seed_is_deterministic_and_its_curve_is_unallocated_against_arrived():
    pods, nodes = load_pods(DATA / "pods_gpuspec33.csv"), load_nodes(DATA / "nodes_gpu.csv")
    w = workload_types((p.job for p in pods), popular=0.95)
    runs = [run_seed(pods, nodes, "fgd", ratio=1.3, seed=s, config=CONFIG, workload=w) for s in (7, 7, 8)]
    assert runs[0].public() == runs[1].public() and runs[0].unallocated_pct == runs[1].unallocated_pct
    curve = runs[0].unallocated_pct
    assert len(curve) == 131 and curve[0] <= 100.0 and min(curve) >= 0.0
    # nothing leaves: what is allocated never shrinks as more arrives
    assert all(b <= a + 1e-9 for a, b in zip(curve, curve[1:]))
    s = summarise("fgd", runs)
    assert s["seeds"] == 3 and len(s["curve"]["unallocated_gpu_pct"]) == 131
    assert s["unallocated_gpu_pct_at_100"]["mean"] == pytest.approx(np.mean([r.unallocated_pct[100] for r in runs]),
                                                                    abs=1e-3)


def test_cli_inflation_json(capsys, tmp_path):
    args = ["simulate", str(DATA / "pods_gpuspec33.csv"), "--nodes", str(DATA / "nodes_gpu.csv"), "--mode",
            "inflation", "--seeds", "1-2,5", "--policies", "fgd,first-fit", "--json", "--quiet", "--jobs", "1"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "inflation" and doc["seeds"] == [1, 2, 5] and doc["gpus"] == 74
    assert [r["policy"] for r in doc["results"]] == ["fgd", "first-fit"]
    r = doc["results"][0]
    assert {"unallocated_gpu_pct_at_100", "failed_pods", "failed_pods_at_100", "frag_gpus", "alloc_ratio", "curve",
            "per_seed"} <= set(r)
    assert all(x["failed_pods_at_100"] <= x["failed_pods"] for x in r["per_seed"])
    assert set(r["alloc_ratio"]) == {"milli_cpu", "memory", "gpu", "milli_gpu"} and len(r["per_seed"]) == 3
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["results"] == doc["results"]
    assert main(args[:7] + ["x-1", "--quiet"]) == 2 and "--seeds" in capsys.readouterr().err
    assert main(args + ["--report", str(tmp_path / "rep")]) == 0
    capsys.readouterr()
    assert (tmp_path / "rep" / "unallocated.png").stat().st_size > 0
    assert "| fgd |" in (tmp_path / "rep" / "summary.md").read_text()


# -- FGD's fragmentation on constrained nodes, by hand ------------------------------------------------

def _two_nodes():
    """n0 (V100M32) and n1 (T4), two GPUs each, GPU 1 of each 0.7 taken: free milli [1000, 300] on both."""
    nodes = [Node("n0", 32000, 64 * GIB, gpus=(Gpu("V100M32"),) * 2),
             Node("n1", 32000, 64 * GIB, gpus=(Gpu("T4"),) * 2)]
    c = Cluster(nodes, CONFIG)
    for n in ("n0", "n1"):
        c.allocate(Job(f"busy-{n}", 1000, GIB, gpus=0.7), Placement(f"busy-{n}", n, (1,), "test"))
    return c


def test_fragmentation_counts_a_node_the_selector_rules_out_as_all_fragment():
    c = _two_nodes()
    # target workload: a V100M32-only whole GPU (1 task) and an unconstrained half GPU (1 task); N = 2
    w = workload_types([Job("a", 1000, GIB, gpus=1.0, node_selector=V100), Job("b", 1000, GIB, gpus=0.5)])
    # n0 (V100): a fits, its fragment = free milli on GPUs with < 1000 free = 300; b fits, fragment 300
    #   F = (300 + 300) / 2 = 300
    # n1 (T4): a cannot go there: all 1300 free milli are its fragment; b fits, fragment 300
    #   F = (1300 + 300) / 2 = 800
    assert fragmentation(c, w) == pytest.approx(300 + 800)
    # blind to the selector (the old model), n1 would count as n0 does: 300 + 300
    blind = workload_types([Job("a", 1000, GIB, gpus=1.0), Job("b", 1000, GIB, gpus=0.5)])
    assert fragmentation(c, blind) == pytest.approx(300 + 300)


def test_fgd_keeps_the_constrained_model_for_the_constrained_type():
    c = _two_nodes()
    w = workload_types([Job("a", 1000, GIB, gpus=1.0, node_selector=V100), Job("b", 1000, GIB, gpus=0.5)])
    job = Job("free", 1000, GIB, gpus=1.0)  # unconstrained whole GPU
    # on n0: after [0, 300]: a no longer fits (300), b has no GPU with 500 (300): F 300, growth 0
    # on n1: after [0, 300]: a still ruled out (300), b 300: F 300, growth 300 - 800 = -500
    d = _Fragmentation(w).deltas(job, c)
    assert d.tolist() == pytest.approx([0.0, -500.0])
    assert Fgd(w).place(job, c).node == "n1"  # the T4, leaving the V100 to the V100-only type
    # blind to the selector both growths are 0 and the tie goes to the lower index, the V100
    blind = workload_types([Job("a", 1000, GIB, gpus=1.0), Job("b", 1000, GIB, gpus=0.5)])
    assert Fgd(blind).place(job, c).node == "n0"
    # a half GPU: per GPU it could take; on n1's GPU 0 (1000 free): after [500, 300]: a ruled out 800,
    # b fits on GPU 0, fragment 300: F (800 + 300) / 2 = 550, growth -250; on n0's GPU 0: a no longer
    # fits (800), b 300: F 550, growth +250
    half = _Fragmentation(w).deltas(Job("h", 1000, GIB, gpus=0.5), c)
    assert half[0, 0] == pytest.approx(250.0) and half[1, 0] == pytest.approx(-250.0)
    assert np.isinf(half[0, 1]) and np.isinf(half[1, 1])  # 300 free: a half does not fit there


def test_workload_types_popular_keeps_the_commonest_types():
    jobs = [Job(f"a{i}", 1000, GIB, gpus=1.0) for i in range(6)] + [Job(f"b{i}", 1000, GIB, gpus=0.5)
                                                                     for i in range(3)] + [Job("c", 2000, GIB)]
    assert workload_types(jobs).n.sum() == 10
    w = workload_types(jobs, popular=0.8)  # 6 (60 %) then 3 (90 % >= 80 %): the single c is dropped
    assert sorted(w.n.tolist()) == [3, 6] and w.weight.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        workload_types(jobs, popular=0)
    # FGD's task types have no memory: two memory sizes make one type
    both = [Job("m1", 1000, GIB, gpus=0.5), Job("m2", 1000, 8 * GIB, gpus=0.5)]
    assert len(workload_types(both).n) == 2 and workload_types(both, memory=False).n.tolist() == [2]


def test_horus_charges_capacity_only_constrained_types_can_use():
    # n0: a T4 node with one of its two GPUs taken; n1: a G2 node with four free GPUs (6 GPUs in all)
    nodes = [Node("n0", 32000, 64 * GIB, gpus=(Gpu("T4"),) * 2), Node("n1", 32000, 64 * GIB, gpus=(Gpu("G2"),) * 4)]
    c = Cluster(nodes, CONFIG)
    c.allocate(Job("busy", 1000, GIB, gpus=1.0), Placement("busy", "n0", (1,), "test"))
    t4 = (("gpu_model", "T4"),)
    # target: 4 T4-only one-GPU tasks, 1 unconstrained one-GPU task, 1 unconstrained four-GPU task (N = 6)
    w = workload_types([Job(f"a{i}", 1000, GIB, gpus=1.0, node_selector=t4) for i in range(4)]
                       + [Job("b", 1000, GIB, gpus=1.0), Job("c", 1000, GIB, gpus=4.0)])
    # the T4-only part asks for 4000 of 9000 milli (D = 4/9) and can use 2 of the 6 GPUs (S = 1/3): 4/3 on n0
    assert _Fragmentation(w).contention(c).tolist() == pytest.approx([4 / 3, 0.0])
    job = Job("free", 1000, GIB, gpus=1.0)
    # FGD: on n0 the node fills (c's 1000 fragment goes): -1000/6; on n1 the four a's lose 1000 each, c no
    # longer fits (3000): (12000 + 3000 - 16000) / 6 = -1000/6 too: a tie, to the lower index, the T4
    assert _Fragmentation(w).deltas(job, c).tolist() == pytest.approx([-1000 / 6, -1000 / 6])
    assert Fgd(w).place(job, c).node == "n0"
    # horus adds 1 GPU x 4/3 on n0: the G2 goes to the unconstrained job, the T4 stays for the T4-only tasks
    assert Horus(w).place(job, c).node == "n1"
    unconstrained = workload_types([Job("b", 1000, GIB, gpus=1.0), Job("c", 1000, GIB, gpus=4.0)])
    assert not _Fragmentation(unconstrained).contention(c).any()  # no constrained part: nothing charged
