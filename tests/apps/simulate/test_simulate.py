"""phasewise simulate: the queue, giving up, determinism, the JSON, the report, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phasewise.apps.simulate.engine import simulate, speed_up
from phasewise.apps.simulate.openb import TraceError, load_nodes, load_pods
from phasewise.cli import main
from phasewise.models.jobs.placement import PlacementConfig

#: the placement rules the simulations run with (the place_* settings' defaults)
CONFIG = PlacementConfig(isolate_inference=False, horus_frag_weight=1.0)
REPO = Path(__file__).resolve().parents[3]
OPENB = REPO.parent / "shared" / "data" / "alibaba-openb-2023"
POD_HEAD = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
            "creation_time,deletion_time,scheduled_time")


def _write(tmp_path: Path, pods: list[str], nodes: list[str]) -> tuple[Path, Path]:
    p, n = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    p.write_text("\n".join([POD_HEAD, *pods]) + "\n")
    n.write_text("\n".join(["sn,cpu_milli,memory_mib,gpu,model", *nodes]) + "\n")
    return p, n


@pytest.fixture
def small(tmp_path):
    # one node with one GPU; p0 holds it 0..100; p1 (whole GPU) waits until 100; p2 gives up at 50;
    # p3 (LS, higher priority than p1's BE) arrives later but is served first when the GPU frees
    return _write(tmp_path, [
        "p0,1000,1024,1,1000,,LS,Running,0,100,0",
        "p1,1000,1024,1,1000,,BE,Running,10,500,",
        "p2,1000,1024,1,1000,,BE,Running,20,50,",
        "p3,1000,1024,1,600,,LS,Running,30,400,",
        "p4,1000,1024,0,0,,LS,Running,40,60,",
    ], ["n0,4000,8192,1,T4"])


def test_timed_queue_priorities_and_giving_up(small):
    pods, nodes = load_pods(small[0]), load_nodes(small[1])
    assert [p.job.priority for p in pods] == [2, 0, 0, 2, 2]
    r = simulate(pods, nodes, "first-fit", "timed", config=CONFIG)
    # p2 gives up (deleted at 50 while waiting); p3 placed at 100 (delay 70), runs 370 s; p1 cannot share
    # the GPU with p3 (it wants all of it) and waits until 470 (delay 460); p4 runs at once on the CPU
    assert r.unplaced_pods == 1 and r.placed == 4
    assert r.mean_queue_delay_s == pytest.approx((0 + 70 + 460 + 0) / 4)


def test_fill_mode_and_determinism(small):
    pods, nodes = load_pods(small[0]), load_nodes(small[1])
    r = simulate(pods, nodes, "fgd", "fill", config=CONFIG)
    assert (r.placed, r.unplaced_pods, r.mean_queue_delay_s) == (2, 3, 0.0)  # p0 and p4; nothing leaves
    assert r.gpu_alloc_ratio == 1.0
    again = simulate(pods, nodes, "fgd", "fill", config=CONFIG)
    assert again.public() == r.public() and again.series == r.series


def test_speed_up_keeps_durations(small):
    pods = load_pods(small[0])
    fast = speed_up(pods, 10)
    assert [p.duration for p in fast] == [p.duration for p in pods] and fast[1].created == 1.0


def test_cli_json_and_report(small, tmp_path, capsys):
    rc = main(["simulate", str(small[0]), "--format", "openb", "--nodes", str(small[1]), "--jobs", "1",
               "--policies", "horus,first-fit,best-fit,fgd", "--json", "--report", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert rc == 0
    doc = json.loads(out)
    assert [r["policy"] for r in doc["results"]] == ["horus", "first-fit", "best-fit", "fgd"]
    for r in doc["results"]:
        assert set(r) == {"policy", "gpu_alloc_ratio", "fragmented_gpus", "unplaced_pods", "mean_queue_delay_s"}
        assert r["unplaced_pods"] == 1
    assert "5/5 pods" in err  # the progress bar
    for f in ("allocation.png", "fragmentation.png", "summary.md"):
        assert (tmp_path / "rep" / f).stat().st_size > 0
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "| fgd |" in summary
    assert "Fewest unplaced pods (1): **horus**, **first-fit**, **best-fit**, **fgd**." in summary
    # in parallel processes: the same results, one bar over all policies
    assert main(["simulate", str(small[0]), "--nodes", str(small[1]), "--jobs", "2", "--json"]) == 0
    out2, err2 = capsys.readouterr()
    assert json.loads(out2) == doc and "20/20 pods" in err2


@pytest.mark.parametrize("pods,nodes,why", [
    (["p0,x,1024,1,1000,,LS,Running,0,100,0"], ["n0,4000,8192,1,T4"], "cpu_milli='x' is not a number"),
    (["p0,1,1024,1,0,,LS,Running,0,100,0"], ["n0,4000,8192,1,T4"], "gpu_milli=0 must be in 1..1000"),
    ([], [], "no nodes"),
])
def test_bad_lists_are_one_line_errors(tmp_path, capsys, pods, nodes, why):
    p, n = _write(tmp_path, pods, nodes)
    rc = main(["simulate", str(p), "--nodes", str(n), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and len(err.strip().splitlines()) == 1


def test_bad_policy_and_missing_file(tmp_path, capsys, small):
    assert main(["simulate", str(small[0]), "--nodes", str(small[1]), "--policies", "horus,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err
    with pytest.raises(TraceError, match="No such file"):
        load_pods(tmp_path / "absent.csv")
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="missing column"):
        load_nodes(tmp_path / "x.csv")


@pytest.mark.skipif(not OPENB.is_dir(), reason="shared openb 2023 lists not present")
def test_real_openb_slice_fgd_beats_first_fit_on_fill():
    pods = load_pods(OPENB / "v2023_openb_pod_list_default.csv")[:1500]
    nodes = load_nodes(OPENB / "v2023_openb_node_list_all_node.csv")[:250]
    assert pods[0].job.gpus == 1.0 and any(0 < p.job.gpus < 1 for p in pods)
    res = {name: simulate(pods, nodes, name, "fill", config=CONFIG) for name in ("first-fit", "fgd")}
    assert res["fgd"].unplaced_pods > 0  # the slice overfills the nodes: placement decides
    assert res["fgd"].fragmented_gpus <= res["first-fit"].fragmented_gpus
    assert simulate(pods, nodes, "fgd", "fill", config=CONFIG).public() == res["fgd"].public()


CDF_HEAD = "cluster,metric,source_pkl,x_value,cdf_percent"


def _cdf(tmp_path: Path) -> Path:
    # cluster A: half the jobs at 0 %, the rest 90 % (as Philly: idle or busy); B: another metric only
    p = tmp_path / "cdf.csv"
    p.write_text("\n".join([CDF_HEAD, "A(x),gpu_util,a.pkl,0,0", "A(x),gpu_util,a.pkl,0,50",
                            "A(x),gpu_util,a.pkl,90,50.001", "A(x),gpu_util,a.pkl,90,100",
                            '"B(y,z)",cpu_util,b.pkl,10,100']) + "\n")
    return p


def test_utilisation_drawn_from_a_cdf(tmp_path):
    from phasewise.apps.simulate.utilisation import load_util_cdf, with_utilisation

    cdf = load_util_cdf(f"{_cdf(tmp_path)}:a")  # prefix, any case
    assert cdf.name == "A(x)" and cdf.quantile(10) == 0.0 and cdf.quantile(80) == 90.0
    pods = load_pods(_write(tmp_path, [f"p{i},1000,1024,{i % 2},{500 if i % 2 else 0},,LS,Running,{i},100,0"
                                       for i in range(40)], ["n0,4000,8192,1,T4"])[0])
    got = with_utilisation(pods, cdf, seed=3)
    utils = [p.job.util for p in got]
    assert all(u is None for u in utils[0::2])  # CPU-only pods get none
    assert set(utils[1::2]) <= {0.0, 90.0} and len(set(utils[1::2])) == 2
    assert [p.job.util for p in with_utilisation(pods, cdf, seed=3)] == utils  # seeded
    assert [p.job.util for p in with_utilisation(pods, cdf, seed=4)] != utils


def test_overloaded_gpus_measured_when_pods_carry_utilisation(tmp_path, capsys):
    # one GPU; three 0.3-GPU pods at 90 % each would be 270 %; two GPUs let horus keep them apart
    busy = [f"p{i},100,64,1,300,,LS,Running,{i},100,0" for i in range(3)]
    p, n = _write(tmp_path, busy, ["n0,4000,8192,2,T4"])
    cdf = tmp_path / "busy.csv"
    cdf.write_text("\n".join([CDF_HEAD, "C,gpu_util,c.pkl,90,0", "C,gpu_util,c.pkl,90,100"]) + "\n")
    args = ["simulate", str(p), "--nodes", str(n), "--mode", "fill", "--json", "--quiet", "--jobs", "1",
            "--util-cdf", f"{cdf}:C", "--policies", "horus,first-fit"]
    assert main(args) == 0
    res = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    # first-fit stacks all three on GPU 0: 270 % -> 1 overloaded GPU, 1.7 GPUs above 100 %; horus puts the
    # third beside one of the others (one GPU at 180 %: 0.8 above), never all three together
    assert res["first-fit"]["overloaded_gpus"] == 1 and res["first-fit"]["excess_util_gpus"] == pytest.approx(1.7)
    assert res["horus"]["overloaded_gpus"] == 1 and res["horus"]["excess_util_gpus"] == pytest.approx(0.8)
    assert main(args + ["--horus-frag-weight", "0"]) == 0  # the weight changes horus only
    again = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert again["first-fit"] == res["first-fit"]
    assert main(args[:-2] + ["--report", str(tmp_path / "rep")]) == 0
    capsys.readouterr()
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "overloaded GPUs" in summary and "busy.csv:C" in summary


@pytest.mark.parametrize("spec,why", [
    ("nocolon", "expected CSV:CLUSTER"),
    ("{cdf}:Z", "'Z' not found (gpu_util clusters: A(x))"),
    ("{absent}:A", "No such file"),
])
def test_bad_util_cdf_is_a_one_line_error(tmp_path, capsys, small, spec, why):
    spec = spec.format(cdf=_cdf(tmp_path), absent=tmp_path / "absent.csv")
    rc = main(["simulate", str(small[0]), "--nodes", str(small[1]), "--quiet", "--util-cdf", spec])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and len(err.strip().splitlines()) == 1
    assert main(["simulate", str(small[0]), "--nodes", str(small[1]), "--horus-frag-weight", "-1"]) == 2
    assert "--horus-frag-weight" in capsys.readouterr().err


def test_the_plots_have_titles_and_say_which_policy_is_drawn_over_an_identical_one(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from phasewise.apps.simulate import report

    figs = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: (figs.append(self), save(self, *a, **kw))[1])
    same = {"t": [0, 1, 2], "alloc": [0.1, 0.5, 0.9]}
    results = [SimpleNamespace(policy="fgd", series=same), SimpleNamespace(policy="horus", series=dict(same)),
               SimpleNamespace(policy="first-fit", series={"t": [0, 1, 2], "alloc": [0.1, 0.4, 0.8]})]
    report._plot(tmp_path / "a.png", results, "alloc", "GPU allocated (%)", "pods arrived", 100.0, "the title")
    [fig] = figs
    ax = fig.axes[0]
    assert ax.get_title() == "the title" and (tmp_path / "a.png").stat().st_size > 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "fgd", "horus (same as fgd: dashed on top of it)", "first-fit"]
    assert [line.get_linestyle() for line in ax.get_lines()] == ["-", "--", "-"]
