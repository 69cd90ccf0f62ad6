"""Placement policies: never over-commit, priorities, isolation, determinism, FGD and Horus by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest

from phasewise.kit.settings import Settings
from phasewise.models.jobs.placement import (
    MILLI,
    POLICIES,
    Cluster,
    Fgd,
    Gpu,
    Horus,
    Job,
    Node,
    Placement,
    PlacementConfig,
    make_policy,
    place_many,
    workload_types,
)
from phasewise.models.jobs.placement.fragmentation import _frag, _FragModel

GIB = 1 << 30


def config(**kw) -> PlacementConfig:
    """The placement worker's rules under the default settings (``place_*``), with *kw* changed."""
    p = Settings().place
    return PlacementConfig(**{"isolate_inference": p.isolate_inference, "horus_frag_weight": p.horus_frag_weight,
                              **kw})


CONFIG = config()


def _nodes(n=6, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        g = rng.choice([0, 1, 2, 4, 8])
        out.append(Node(f"n{i}", rng.choice([8000, 32000]), rng.choice([32, 128]) * GIB,
                        gpus=(Gpu(rng.choice(["T4", "V100"]), 16 * GIB),) * g))
    return out


def _jobs(n=120, seed=1):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        gpus = rng.choice([0, 0.1, 0.25, 0.5, 0.7, 1, 2, 4])
        out.append(Job(f"j{i}", rng.choice([500, 2000, 6000]), rng.choice([1, 4, 16]) * GIB, gpus=gpus,
                       gpu_mem_bytes=rng.choice([0, 2, 6]) * GIB if gpus else 0, priority=rng.randint(0, 3),
                       workload=rng.choice(["training", "inference"]), util=rng.choice([None, 30.0, 90.0])))
    return out


def _check_not_overcommitted(c: Cluster) -> None:
    assert (c.cpu_alloc <= c.cpu_cap).all() and (c.mem_alloc <= c.mem_cap).all()
    assert (c.milli_alloc <= MILLI).all() and (c.milli_alloc[~c.valid] == 0).all()
    assert (c.gmem_alloc <= c.gmem_cap).all()


@pytest.mark.parametrize("name", list(POLICIES))
def test_never_overcommits_and_is_deterministic(name):
    nodes, jobs = _nodes(), _jobs()
    runs = []
    for _ in range(2):
        c = Cluster(nodes, CONFIG)
        ps = place_many(jobs, c, make_policy(name))
        _check_not_overcommitted(c)
        runs.append([(p.node, p.gpus, p.cost) for p in ps])
        placed = [p for p in ps if p.node]
        assert placed and len(placed) < len(jobs)  # the cluster fills: both outcomes are exercised
        for j, p in zip(jobs, ps):
            if p.node:
                assert len(p.gpus) == j.count and p.reason.startswith(name)
            else:
                assert p.reason.startswith("no node")
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", list(POLICIES))
def test_higher_priority_gets_the_scarce_gpu(name):
    c = Cluster([Node("a", 8000, 8 * GIB, gpus=(Gpu("T4", 16 * GIB),))], CONFIG)
    low, high = Job("low", 1000, GIB, gpus=1, priority=0), Job("high", 1000, GIB, gpus=1, priority=5)
    ps = place_many([low, high], c, make_policy(name))
    assert ps[0].node is None and ps[1].node == "a"


@pytest.mark.parametrize("name", list(POLICIES))
def test_inference_isolated_from_training_when_configured(name):
    nodes = [Node("a", 8000, 8 * GIB, gpus=(Gpu("T4", 16 * GIB),) * 2),
             Node("b", 8000, 8 * GIB, gpus=(Gpu("T4", 16 * GIB),) * 2)]
    jobs = [Job("t", 1000, GIB, gpus=0.5), Job("i", 1000, GIB, gpus=0.2, workload="inference"),
            Job("t2", 1000, GIB, gpus=0.2), Job("i2", 1000, GIB, gpus=0.2, workload="inference")]
    c = Cluster(nodes, config(isolate_inference=True))
    ps = {p.job: p.node for p in place_many(jobs, c, make_policy(name))}
    assert ps["t"] == ps["t2"] and ps["i"] == ps["i2"] and ps["t"] != ps["i"]
    c2 = Cluster(nodes[:1], config(isolate_inference=True))
    ps2 = place_many(jobs[:2], c2, make_policy(name))
    assert ps2[1].node is None and "isolated" in ps2[1].reason


def test_gpu_memory_never_overcommitted_even_with_room_in_milli():
    c = Cluster([Node("a", 8000, 8 * GIB, gpus=(Gpu("T4", 16 * GIB, mem_used_bytes=10 * GIB),))], CONFIG)
    p = Horus().place(Job("j", 100, GIB, gpus=0.1, gpu_mem_bytes=8 * GIB), c)
    assert p.node is None and "GPU memory" in p.reason
    with pytest.raises(ValueError, match="over-commit"):
        from phasewise.models.jobs.placement import Placement
        c.allocate(Job("j", 100, GIB, gpus=0.1, gpu_mem_bytes=8 * GIB), Placement("j", "a", (0,)))


def test_node_selector_alternatives():
    c = Cluster([Node("a", 8000, 8 * GIB, gpus=(Gpu("T4"),)), Node("b", 8000, 8 * GIB, gpus=(Gpu("V100M32"),))],
                CONFIG)
    job = Job("j", 100, GIB, gpus=0.5, node_selector=(("gpu_model", "V100M16|V100M32"),))
    assert {make_policy(n).place(job, c).node for n in POLICIES} == {"b"}


def test_horus_cost_alone_by_hand():
    # horus_frag_weight 0: Horus's cost alone. One node, two 16 GiB GPUs: GPU 0 runs a job booked at
    # 60 % util and 8 GiB; GPU 1 is idle
    c = Cluster([Node("a", 8000, 32 * GIB, gpus=(Gpu("T4", 16 * GIB),) * 2)], config(horus_frag_weight=0))
    c.allocate(Job("old", 100, GIB, gpus=0.6, gpu_mem_bytes=8 * GIB, util=60.0),
               Horus().place(Job("old", 100, GIB, gpus=0.6, gpu_mem_bytes=8 * GIB, util=60.0), c))
    assert c.allocs["old"].gpus == (0,)
    job = Job("new", 100, GIB, gpus=0.3, gpu_mem_bytes=4 * GIB, util=50.0)
    g0 = 1.3 * (8 / 16 + 4 / 16) + abs(60 + 50 - 100) / 100 * 1.6 + 1  # over 100: x1.6, one job running
    g1 = 1.3 * (0 + 4 / 16) + abs(0 + 50 - 100) / 100 + 0
    p = Horus().place(job, c)
    assert p.gpus == (1,) and p.cost == pytest.approx(min(g0, g1)) and g1 < g0
    costs = Horus()._gpu_costs(job, c, np.array([0]))[0]
    assert costs == pytest.approx([g0, g1])


# A 2-GPU node and a workload of 60 % whole-GPU and 40 % half-GPU tasks (as openb: mostly whole GPUs).
# GPU 0 already holds a half-GPU job. A second half on GPU 0 fills it: F(M) goes from 0.6 * 500 (GPU 0's
# 500 free are a fragment for whole-GPU tasks) to 0, a change of -300 milli-GPU. On GPU 1 it leaves two
# half-free GPUs: no whole-GPU task fits any more, F(M) = 0.6 * 1000, a change of +300.
_HALVES = workload_types([Job("w", 1000, GIB, gpus=1.0)] * 3 + [Job("h", 1000, GIB, gpus=0.5)] * 2)


def _half_taken(first_util, config=CONFIG, observed=0.0):
    c = Cluster([Node("a", 8000, 32 * GIB, gpus=(Gpu("T4", 16 * GIB, util=observed), Gpu("T4", 16 * GIB)))],
                config)
    first = Job("first", 1000, GIB, gpus=0.5, util=first_util)
    c.allocate(first, Placement("first", "a", (0,)))
    return c


@pytest.mark.parametrize("util,gpu,over", [
    (90.0, 1, 0.0),  # two busy jobs: 90 + 90 = 180 % on GPU 0, over capacity 0.8 * 1.6 = 1.28 > 0.6 GPU
    (20.0, 0, 0.0),  # two light jobs: 40 % together, no interference predicted: pack them
    (None, 0, 0.0),  # no prediction: the requests (50 % each) add up to 100 %, not over: pack them
])
def test_horus_separates_two_busy_jobs_and_packs_the_rest(util, gpu, over):
    c = _half_taken(util)
    job = Job("second", 1000, GIB, gpus=0.5, util=util)
    p = Horus(_HALVES).place(job, c)
    assert p.gpus == (gpu,) and p.cost == pytest.approx(-0.3 if gpu == 0 else 0.3 + over)
    assert p.reason.startswith("horus: fragmentation change " + ("-300" if gpu == 0 else "+300"))
    # FGD (no utilisation) packs even the busy pair; Horus's cost alone spreads even the light pair
    assert Fgd(_HALVES).place(job, c).gpus == (0,)
    assert Horus(_HALVES).place(job, _half_taken(util, config(horus_frag_weight=0))).gpus == (1,)


def test_horus_by_hand_and_its_weight():
    c = _half_taken(90.0)
    job = Job("second", 1000, GIB, gpus=0.5, util=90.0)
    over = (90 + 90 - 100) / 100 * 1.6
    d = Horus(_HALVES)._frag.deltas(job, c)
    assert d[0].tolist() == [-300.0, 300.0]  # per GPU, milli-GPU
    for w, gpu in [(1.0, 1), (2.0, 1), (3.0, 0)]:  # GPU 0 wins once w * 0.6 GPU outweighs 1.28
        p = Horus(_HALVES).place(job, _half_taken(90.0, config(horus_frag_weight=w)))
        assert p.gpus == (gpu,)
        assert p.cost == pytest.approx(min(w * -0.3 + over, w * 0.3))


def test_horus_avoids_a_gpu_observed_busy():
    # no prediction for either job; GPU 0 is observed at 95 % (samples) although only 50 % is booked:
    # 95 + 50 = 145 %, over capacity 0.45 * 1.6 = 0.72 > the 0.6 GPU that packing would save
    c = _half_taken(None, observed=95.0)
    p = Horus(_HALVES).place(Job("second", 1000, GIB, gpus=0.5), c)
    assert p.gpus == (1,) and p.cost == pytest.approx(0.3)


def test_fgd_fragmentation_by_hand():
    # target workload: half 0.5-GPU tasks, half 1-GPU tasks (1 core, 1 GiB each)
    w = workload_types([Job("a", 1000, GIB, gpus=0.5), Job("b", 1000, GIB, gpus=1.0)])
    gfree = np.array([[300, 1000, 600]])  # free milli per GPU
    # 0.5 task: only GPU 0 (300 < 500) is a fragment -> 300; 1-GPU task: GPUs 0 and 2 -> 900
    assert _frag(w, np.array([4000]), np.array([8 * GIB]), gfree)[0] == pytest.approx(0.5 * 300 + 0.5 * 900)
    # no CPU left: every task fails, all free GPU is fragment
    assert _frag(w, np.array([500]), np.array([8 * GIB]), gfree)[0] == pytest.approx(1900)
    # a CPU-only task type sees all free GPUs as fragments
    w2 = workload_types([Job("c", 1000, GIB)])
    assert _frag(w2, np.array([4000]), np.array([8 * GIB]), gfree)[0] == pytest.approx(1900)


def test_fgd_places_where_fragmentation_grows_least():
    # mostly 0.5-GPU workload; node a's GPU has 600 free, node b's is empty. A 0.5 job on a leaves 100,
    # a fragment for the 0.5 tasks; on b it leaves 500, still usable. FGD prefers b; best-fit prefers a.
    nodes = [Node("a", 8000, 8 * GIB, gpus=(Gpu("T4"),)), Node("b", 8000, 8 * GIB, gpus=(Gpu("T4"),))]
    c = Cluster(nodes, CONFIG)
    c.allocate(Job("x", 100, GIB, gpus=0.4), make_policy("first-fit").place(Job("x", 100, GIB, gpus=0.4), c))
    w = workload_types([Job("t", 100, GIB, gpus=0.5)] * 9 + [Job("u", 100, GIB, gpus=0.1)])
    job = Job("j", 100, GIB, gpus=0.5)
    before = _frag(w, c.cpu_free(), c.mem_free(), c._gfree())
    assert before.tolist() == pytest.approx([0, 0])  # 600 free >= 500: not a fragment yet
    p = Fgd(w).place(job, c)
    # on a: 100 left, fragment for the 0.5 tasks (0.9*100); on b: 500 left, no fragment
    assert p.node == "b" and p.cost == pytest.approx(0.0)
    assert p.scores["a"] == pytest.approx(0.9 * 100)
    assert make_policy("best-fit").place(job, c).node == "a"


def test_fgd_cache_follows_changes():
    nodes = _nodes(8, seed=3)
    jobs = _jobs(80, seed=4)
    w = workload_types(jobs)
    c1, c2 = Cluster(nodes, CONFIG), Cluster(nodes, CONFIG)
    cached = Fgd(w)
    for j in jobs:  # a fresh policy each time (no cache) decides the same as the cached one
        p1, p2 = cached.place(j, c1), Fgd(w).place(j, c2)
        assert (p1.node, p1.gpus, p1.cost) == (p2.node, p2.gpus, p2.cost)
        if p1.node:
            c1.allocate(j, p1), c2.allocate(j, p2)
    c1.release(jobs[0].job), c2.release(jobs[0].job)
    p1, p2 = cached.place(jobs[0], c1), Fgd(w).place(jobs[0], c2)
    assert (p1.node, p1.gpus) == (p2.node, p2.gpus)


def test_release_and_observations():
    c = Cluster([Node("a", 8000, 8 * GIB, gpus=(Gpu("T4", 16 * GIB),))], CONFIG)
    j = Job("j", 4000, GIB, gpus=1)
    c.allocate(j, make_policy("first-fit").place(j, c))
    assert make_policy("first-fit").place(Job("k", 100, GIB, gpus=0.1), c).node is None
    assert c.release("j") == "a" and c.release("j") is None
    # observed use counts even without bookings: 7.5 of 8 cores busy
    c.upsert(Node("a", 8000, 8 * GIB, gpus=(Gpu("T4", 16 * GIB),), cpu_used_milli=7500))
    assert make_policy("horus").place(Job("k", 1000, GIB), c).node is None
    with pytest.raises(ValueError, match="unknown placement policy"):
        make_policy("nope")


def test_fgd_online_workload_refreshes_and_stays_deterministic():
    nodes, jobs = _nodes(8, seed=5), _jobs(150, seed=6)
    runs = []
    for _ in range(2):
        c, pol = Cluster(nodes, CONFIG), Fgd(refresh_every=16)
        runs.append([(p.node, p.gpus) for p in place_many(jobs, c, pol)])
        _check_not_overcommitted(c)
        # after 150 jobs the distribution in force is the one of the first 144 (the last refresh)
        assert pol._w.weight.sum() == pytest.approx(1.0)
        assert pol._seen == 150
        asked = [jobs[i] for i in sorted(range(len(jobs)), key=lambda i: (-jobs[i].priority, i))]  # place_many
        assert (pol._w.n == workload_types(asked[:144]).n).all()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["fgd", "horus"])
def test_online_workload_counts_each_job_once(name):
    c = Cluster([Node("a", 8000, 8 * GIB, gpus=(Gpu("T4"),))], CONFIG)
    pol = make_policy(name)
    big, small = Job("big", 1000, GIB, gpus=1.0), Job("small", 1000, GIB, gpus=0.5)
    for _ in range(5):  # a waiting job asked about again and again counts once
        pol.place(big, c)
    pol.place(small, c)
    assert pol._frag._seen_n == 2 and pol._frag._w.n.tolist() == [1, 1]


# -- the fast F_n(M) and FGD against the definition ---------------------------------------------

def _frag_definition(w, cpu_free, mem_free, gfree, exact=True):
    """F_n(M) straight from FGD's definition, one task type at a time: exact (F * N, integers) or, with
    exact=False, in float popularities summed as the first implementation did (f @ p)."""
    total = gfree.sum(axis=1)
    whole = (gfree == MILLI).sum(axis=1)
    top = gfree.max(axis=1)
    f = np.zeros((len(total), len(w.n)), np.int64)
    for t, (cpu, mem, count, milli) in enumerate(zip(w.cpu, w.mem, w.count, w.milli)):
        gpu_ok = np.zeros(len(total), bool) if count == 0 else (whole >= count if milli >= MILLI else top >= milli)
        fits = gpu_ok & (cpu_free >= cpu) & (mem_free >= mem)
        frag = (gfree * (gfree < min(milli, MILLI))).sum(axis=1)
        f[:, t] = np.where(fits, frag, total)
    return f @ w.n if exact else f @ (w.n / w.n.sum())


def _random_states(rng, rows=400, slots=8):
    part = rng.choice([0, 100, 250, 400, 500, 700, 990], (rows, slots))
    gfree = np.where(rng.random((rows, slots)) < 0.3, MILLI, part)
    gfree[rng.random((rows, slots)) < 0.2] = 0
    return rng.integers(-2000, 40000, rows), rng.integers(0, 64, rows) * GIB, gfree.astype(np.int64)


def test_fast_fragmentation_equals_the_definition():
    rng = np.random.default_rng(7)
    jobs = [Job(f"t{i}", int(rng.choice([0, 1000, 4000, 8000, 30000])), int(rng.choice([0, 2, 16, 48])) * GIB,
                gpus=float(rng.choice([0, 0.1, 0.25, 0.5, 0.6, 0.99, 1, 2, 4, 8]))) for i in range(300)]
    w = workload_types(jobs)
    cpu, mem, gfree = _random_states(rng)
    want = _frag_definition(w, cpu, mem, gfree)
    assert all(p.table is not None for p in w.model.parts) and (w.model.nodes(cpu, mem, gfree) == want).all()
    small = _FragModel(w, max_cells=0)  # the comparison path, for workloads of many (CPU, memory) values
    assert all(p.table is None for p in small.parts) and (small.nodes(cpu, mem, gfree) == want).all()
    assert _frag(w, cpu, mem, gfree) == pytest.approx(want / w.n.sum(), abs=1e-9)
    assert (_FragModel(workload_types([])).nodes(cpu, mem, gfree) == 0).all()


def _fgd_definition(job, c, w, exact=True):
    """FGD from the definition: for every feasible node and every GPU the job could take there (the first
    k free GPUs for whole ones), the hypothetical node's F_n(M) minus the node's. A list of (node index,
    GPUs, growth) in node order, then GPU order; growth in F * N (exact) or milli-GPU (float)."""
    rows = np.flatnonzero(c.feasible(job))
    if not len(rows):
        return []
    gfree = c._gfree(rows)
    before = _frag_definition(w, c.cpu_free(rows), c.mem_free(rows), gfree, exact)
    gok = c._gpu_ok(job, rows)
    cands, after = [], []  # (row position, GPUs), the hypothetical node's free milli
    for k in range(len(rows)):
        if job.count == 0:
            cands.append((k, ())), after.append(gfree[k])
        elif job.gpus >= 1:
            take = np.flatnonzero(gok[k])[: job.count]
            a = gfree[k].copy()
            a[take] = 0
            cands.append((k, tuple(int(x) for x in take))), after.append(a)
        else:
            for j in np.flatnonzero(gok[k]):
                a = gfree[k].copy()
                a[j] -= job.milli
                cands.append((k, (int(j),))), after.append(a)
    pos = np.array([k for k, _ in cands])
    grown = _frag_definition(w, c.cpu_free(rows[pos]) - job.cpu_milli, c.mem_free(rows[pos]) - job.mem_bytes,
                             np.array(after), exact) - before[pos]
    return [(int(rows[k]), gpus, d) for (k, gpus), d in zip(cands, grown)]


def _least(cands):
    """The first candidate of least growth (node order, then GPU order)."""
    best = None
    for i, gpus, d in cands:
        if best is None or d < best[2]:
            best = (i, gpus, d)
    return best


def test_fgd_decides_as_the_definition_and_as_before_on_a_seeded_scenario():
    """The vectorised, cached FGD against FGD computed from the definition, job by job, every candidate,
    on a cluster that fills, sees observations change under it and jobs leave; and against the first
    implementation's float arithmetic: where that one decided otherwise, it was an exact tie its
    rounding broke (ties go to the lower node, then GPU, as documented)."""
    from phasewise.apps.bench.placement import cluster_nodes
    from phasewise.apps.bench.placement import jobs as bench_jobs

    rng = random.Random(11)
    nodes = cluster_nodes(40, seed=12)  # openb's node mix: many nodes alike, so ties are common
    jobs = bench_jobs(220, seed=13)
    w = workload_types(jobs)
    c, pol = Cluster(nodes, CONFIG), Fgd(w)
    n, same, ties = int(w.n.sum()), 0, 0
    for k, j in enumerate(jobs):
        if k % 7 == 3:  # a node's observed use changes (a sample arrives)
            node = nodes[rng.randrange(len(nodes))]
            c.upsert(Node(node.name, node.cpu_milli, node.mem_bytes, node.gpus, cpu_used_milli=rng.choice([0, 9000]),
                          mem_used_bytes=rng.choice([0, 40 * GIB])))
        if k % 11 == 5 and c.allocs:  # a job leaves
            c.release(sorted(c.allocs)[0])
        p = pol.place(j, c)
        cands = _fgd_definition(j, c, w)
        if not cands:
            assert p.node is None
            continue
        d = pol._frag.deltas(j, c)
        got = [d[i, gpus[0]] if d.ndim == 2 else d[i] for i, gpus, _ in cands]
        assert got == [x / n for _, _, x in cands]  # every candidate's growth, exactly
        assert np.isinf(d).sum() == d.size - len(cands)  # and nothing else is a candidate
        i, gpus, least = _least(cands)
        assert (p.node, p.gpus, p.cost) == (c.names[i], gpus, least / n)
        oi, ogpus, _ = _least(_fgd_definition(j, c, w, exact=False))
        if (oi, ogpus) == (i, gpus):
            same += 1
        else:  # the old float sums chose another candidate: its exact growth is the least too
            assert dict(((ci, cg), x) for ci, cg, x in cands)[(oi, ogpus)] == least
            ties += 1
        c.allocate(j, p)
    assert same > 150 and ties > 0 and c.allocs


def test_the_waiting_index_finds_exactly_the_jobs_that_fit_the_nodes_asked_about():
    """``WaitingJobs.could_fit`` (a prefilter, then the exact test per need) against ``Cluster.feasible`` for
    every job: random clusters with bookings, exact fits included (a share of what is left, a whole GPU)."""
    from phasewise.models.jobs.placement import FirstFit, WaitingJobs

    rng = random.Random(11)
    for _ in range(30):
        nodes = [Node(f"n{i}", rng.choice([2000, 4000, 8000]), rng.choice([4, 8, 16]) << 30,
                      gpus=(Gpu("T4", 16 << 30),) * rng.choice([0, 1, 2, 4]),
                      labels=(("zone", rng.choice("ab")),)) for i in range(5)]
        c = Cluster(nodes, config(isolate_inference=rng.random() < 0.5))
        pol = FirstFit()
        for k in range(12):  # some bookings: shares of GPUs, whole GPUs, CPU only
            j = Job(f"b{k}", rng.choice([500, 1000, 2000]), rng.choice([1, 2]) << 30,
                    gpus=rng.choice([0, 0.25, 0.5, 1]), workload=rng.choice(["training", "inference"]))
            p = pol.place(j, c)
            if p.node:
                c.allocate(j, p)
        w = WaitingJobs(c.config)
        jobs = [Job(f"w{k}", rng.choice([500, 1000, 2000, 4000, 8000]), rng.choice([1, 2, 8]) << 30,
                    gpus=rng.choice([0, 0.25, 0.5, 0.75, 1, 2, 4]), gpu_mem_bytes=rng.choice([0, 4 << 30, 16 << 30]),
                    workload=rng.choice(["training", "inference"]),
                    node_selector=rng.choice([(), (("zone", "a"),)])) for k in range(40)]
        for k, j in enumerate(jobs):
            w.add(j.job, j, rank=(0, float(k), j.job))
        rows = np.array(sorted(rng.sample(range(5), rng.randint(1, 5))))
        assert set(w.could_fit(c, rows)) == {j.job for j in jobs if c.feasible(j, rows).any()}
        assert len(w) == 40 and w.worst()[1] == "w39"
        for j in jobs[::2]:
            w.remove(j.job)
        assert len(w) == 20 and w.worst()[1] == "w39" and set(w.could_fit(c, rows)) <= {j.job for j in jobs[1::2]}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_places_a_job_exactly_when_some_node_is_feasible(name):
    """What the placement agent relies on to skip the policy for a waiting job that fits nowhere
    (Cluster.feasible) and to try one job of a need for all of that need: a policy leaves a job
    unplaced exactly when no node is feasible for it."""
    rng = random.Random(3)
    for _ in range(20):
        nodes = [Node(f"n{i}", rng.choice([2000, 8000]), rng.choice([4, 16]) << 30,
                      gpus=(Gpu("T4", 16 << 30, util=rng.uniform(0, 100)),) * rng.choice([0, 1, 2, 4]))
                 for i in range(6)]
        c = Cluster(nodes, config(isolate_inference=rng.random() < 0.5))
        pol = make_policy(name)
        for k in range(30):
            j = Job(f"j{k}", rng.choice([500, 1000, 4000]), rng.choice([1, 4]) << 30,
                    gpus=rng.choice([0, 0.25, 0.5, 1, 2, 4]), gpu_mem_bytes=rng.choice([0, 4 << 30, 16 << 30]),
                    workload=rng.choice(["training", "inference"]), util=rng.choice([None, 60.0]))
            p = pol.place(j, c)
            assert (p.node is not None) == bool(c.feasible(j).any()), (name, j)
            if p.node is not None:
                c.allocate(j, p)
