"""phasewise simulate --interference: Gavel's file read, workloads drawn per seed, the figures in the JSON and
the report, and the flag's one-line errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from phasewise.apps.simulate.engine import simulate
from phasewise.apps.simulate.gavel import GAVEL_FILE, draw_workloads, load_gavel, read_gavel
from phasewise.apps.simulate.openb import TraceError, load_nodes, load_pods
from phasewise.cli import main
from phasewise.models.jobs.placement import PlacementConfig

CONFIG = PlacementConfig(isolate_inference=False, horus_frag_weight=1.0)
POD_HEAD = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
            "creation_time,deletion_time,scheduled_time")
KEYS = {"shared_gpus", "colocated_jobs", "unmeasured_jobs", "extrapolated_jobs", "slowdown_mean", "slowdown_p95",
        "slowdown_mean_worst_pair", "slowed_jobs", "slowed_share", "lost_gpus", "combined_tput_mean"}
RN18_16, RN18_256 = ("ResNet-18 (batch size 16)", 1), ("ResNet-18 (batch size 256)", 1)


def _gavel(tmp_path: Path) -> Path:
    """A Gavel-format file with one single-GPU workload X (each keeps 0.4 next to another X) and one 2-GPU Y."""
    p = tmp_path / "tput.json.gz"
    raw = {"v100": {"('X', 1)": {"null": 10.0, "('X', 1)": [4.0, 4.0]}, "('Y', 2)": {"null": 3.0}},
           "k80": {"('X', 1)": {"null": 0.0}}}
    with gzip.open(p, "wt") as fh:
        json.dump(raw, fh)
    return p


def _lists(tmp_path: Path, pods: list[str]) -> tuple[Path, Path]:
    p, n = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    p.write_text("\n".join([POD_HEAD, *pods]) + "\n")
    n.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,8000,8192,1,V100\nn1,8000,8192,2,V100\n")
    return p, n


@pytest.mark.skipif(not GAVEL_FILE.is_file(), reason="shared gavel-throughputs not present")
def test_the_real_file_reads_with_a_known_pair():
    t = read_gavel(GAVEL_FILE, "v100")
    assert len(t.workloads(1)) == 26 and len(t.pairs) == 1759
    assert t.isolated[RN18_16] == pytest.approx(32.353384328946916)
    # physical_cluster_throughputs.json, v100, ResNet-18 bs 16 next to bs 256: [24.4546..., 10.3002...]
    assert t.normalised(RN18_16, RN18_256) == pytest.approx(24.45464779058787 / 32.353384328946916)
    assert t.normalised(RN18_256, RN18_16) == pytest.approx(10.300256501360458 / 11.949277372202666)
    assert load_gavel("gavel", GAVEL_FILE).gpu == "v100" and load_gavel("gavel:K80", GAVEL_FILE).gpu == "k80"


def test_workloads_drawn_per_seed_by_gpu_count(tmp_path):
    t = load_gavel("gavel:v100", _gavel(tmp_path))
    pods = load_pods(_lists(tmp_path, [
        "s0,100,64,1,500,,LS,Running,0,10,0", "c0,100,64,0,0,,LS,Running,1,10,0",
        "w2,100,64,2,1000,,LS,Running,2,10,0", "w3,100,64,3,1000,,LS,Running,3,10,0",
        "w1,100,64,1,1000,,LS,Running,4,10,0"])[0])
    got = draw_workloads(pods, t, seed=1)
    # the CPU pod gets none, nor the 3-GPU pod (no workload measured on 3 GPUs); a share and a whole GPU: 1-GPU
    assert got == {"s0": ("X", 1), "w2": ("Y", 2), "w1": ("X", 1)}


@pytest.mark.skipif(not GAVEL_FILE.is_file(), reason="shared gavel-throughputs not present")
def test_the_draw_is_deterministic_per_seed_and_uniform_enough(tmp_path):
    t = read_gavel(GAVEL_FILE, "v100")
    pods = load_pods(_lists(tmp_path, [f"p{i},100,64,1,{100 + i % 900},,LS,Running,{i},9999,0"
                                       for i in range(2600)])[0])
    a = draw_workloads(pods, t, seed=7)
    assert draw_workloads(pods, t, seed=7) == a and draw_workloads(pods, t, seed=8) != a
    counts = {w: 0 for w in t.workloads(1)}
    for w in a.values():
        counts[w] += 1
    assert len(a) == 2600 and min(counts.values()) > 50 and max(counts.values()) < 150  # 100 expected each


def test_json_and_report_carry_both_measures_fill_and_timed(tmp_path, capsys):
    # n0 has one GPU: s0 and s1 (0.5 each) share it from t=50 (s1 waits for nothing: first-fit puts it on
    # n0 beside s0); c0 is CPU-only and arrives at 100, the last arrival
    p, n = _lists(tmp_path, ["s0,100,64,1,500,,LS,Running,0,1000,0", "s1,100,64,1,500,,LS,Running,50,1000,0",
                             "c0,100,64,0,0,,LS,Running,100,1000,0"])
    g = _gavel(tmp_path)
    base = ["simulate", str(p), "--nodes", str(n), "--json", "--quiet", "--jobs", "1", "--policies", "first-fit",
            "--interference", "gavel", "--gavel-file", str(g), "--interference-seed", "3"]
    assert main(base + ["--mode", "fill", "--report", str(tmp_path / "rep")]) == 0
    doc = json.loads(capsys.readouterr().out)
    m = doc["results"][0]["interference"]
    assert set(m) == KEYS
    # each X keeps 0.4 next to the other: slowdown 0.6 each, 1.2 GPUs lost, the GPU does 0.8 of one X alone
    assert (m["shared_gpus"], m["colocated_jobs"], m["extrapolated_jobs"], m["unmeasured_jobs"]) == (1, 2, 0, 0)
    assert m["slowdown_mean"] == pytest.approx(0.6) and m["slowdown_p95"] == pytest.approx(0.6)
    assert m["slowed_jobs"] == 2 and m["lost_gpus"] == pytest.approx(1.2)
    assert m["combined_tput_mean"] == pytest.approx(0.8)
    about = doc["interference"]
    assert (about["source"], about["gpu"], about["seed"], about["workloads"], about["pods_with_workload"]) == (
        "gavel", "v100", 3, 1, 2)
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "## Interference: measured slowdown" in summary and "| first-fit | 1.0 | 2.0 | 0.0 | 60.0% |" in summary
    # timed: the two share the GPU from 50 to 100 of the arrivals' span 0..100: half the time
    assert main(base + ["--mode", "timed"]) == 0
    t = json.loads(capsys.readouterr().out)["results"][0]["interference"]
    assert t["colocated_jobs"] == pytest.approx(1.0) and t["shared_gpus"] == pytest.approx(0.5)
    assert t["slowdown_mean"] == pytest.approx(0.6) and t["lost_gpus"] == pytest.approx(0.6)
    # without the flag: no interference key anywhere (the default output is unchanged)
    assert main(base[:-6] + ["--mode", "fill"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert set(plain) == {"results"} and "interference" not in plain["results"][0]


def test_the_engine_scores_every_policy_the_same_pods(tmp_path):
    p, n = _lists(tmp_path, [f"s{i},100,64,1,300,,LS,Running,{i},1000,0" for i in range(6)])
    pods, nodes = load_pods(p), load_nodes(n)
    t = load_gavel("gavel", _gavel(tmp_path))
    inter = (t, draw_workloads(pods, t, 0))
    res = {name: simulate(pods, nodes, name, "fill", config=CONFIG, interference=inter)
           for name in ("first-fit", "best-fit")}
    for r in res.values():
        assert r.placed == 6 and r.interference["colocated_jobs"] == 6
    # first-fit: three 0.3 shares on n0's GPU, three on n1's first GPU: each keeps 0.4 x 0.4 (extrapolated)
    ff = res["first-fit"].interference
    assert ff["extrapolated_jobs"] == 6 and ff["slowdown_mean"] == pytest.approx(1 - 0.4 * 0.4)
    assert ff["slowdown_mean_worst_pair"] == pytest.approx(0.6) and ff["lost_gpus"] == pytest.approx(6 * 0.84)
    again = simulate(pods, nodes, "first-fit", "fill", config=CONFIG, interference=(t, draw_workloads(pods, t, 0)))
    assert again.public() == res["first-fit"].public()


@pytest.mark.parametrize("spec,extra,why", [
    ("gavel:a100", [], "unknown GPU type 'a100' (choose among k80, p100, v100)"),
    ("philly", [], "expected gavel[:GPU]"),
    ("gavel", ["--gavel-file", "{absent}"], "No such file"),
    ("gavel", ["--gavel-file", "{junk}"], "not a Gavel throughput file"),
    ("gavel:p100", ["--gavel-file", "{tiny}"], "no GPU type 'p100' (types: k80, v100)"),
    ("gavel:k80", ["--gavel-file", "{tiny}"], "has no single-GPU workload"),
])
def test_bad_interference_is_a_one_line_error(tmp_path, capsys, spec, extra, why):
    p, n = _lists(tmp_path, ["s0,100,64,1,500,,LS,Running,0,10,0"])
    (tmp_path / "junk.gz").write_bytes(b"not gzip")
    files = {"absent": tmp_path / "absent.json.gz", "junk": tmp_path / "junk.gz", "tiny": _gavel(tmp_path)}
    extra = [e.format(**files) for e in extra]
    rc = main(["simulate", str(p), "--nodes", str(n), "--quiet", "--interference", spec, *extra])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and len(err.strip().splitlines()) == 1
    with pytest.raises(TraceError, match="expected gavel"):
        load_gavel("gavel-ish", files["tiny"])


def test_fgd_inflation_scores_the_measured_slowdown_and_a_copy_runs_its_pods_workload(tmp_path, capsys):
    # six 0.3-GPU shares on 3 GPUs, inflated to 100 % of capacity: four copies; 3 fit on a GPU (0.9)
    p, n = _lists(tmp_path, [f"s{i},100,64,1,300,,LS,Running,{i},1000,0" for i in range(6)])
    args = ["simulate", str(p), "--nodes", str(n), "--quiet", "--json", "--mode", "inflation", "--jobs", "1",
            "--inflation-ratio", "1.0", "--seeds", "1-2", "--policies", "first-fit,horus-measured",
            "--interference", "gavel", "--gavel-file", str(_gavel(tmp_path))]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["interference"]["pods_with_workload"] == 6 and doc["interference"]["source"] == "gavel"
    for r in doc["results"]:
        m = r["interference"]
        assert set(m) <= KEYS and m["colocated_jobs"]["mean"] == 9  # 10 pods, 9 placed, 3 on each GPU
        assert m["unmeasured_jobs"]["mean"] == 0  # the copies carry their pods' workloads
        assert m["slowdown_mean"]["mean"] == pytest.approx(1 - 0.4 * 0.4) and m["slowdown_mean"]["sd"] == 0
        assert r["failed_pods"]["mean"] == 1
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["results"] == doc["results"]  # deterministic per seed
    # without the flag no interference key, and horus-measured is refused in one line
    assert main([a for a in args[:-6]] + ["--policies", "first-fit"]) == 0
    assert "interference" not in json.loads(capsys.readouterr().out)["results"][0]


def test_horus_measured_only_with_interference(tmp_path, capsys):
    p, n = _lists(tmp_path, ["s0,100,64,1,600,,LS,Running,0,10,0", "s1,100,64,1,400,,LS,Running,1,10,0"])
    assert main(["simulate", str(p), "--nodes", str(n), "--quiet", "--policies", "horus-measured"]) == 2
    err = capsys.readouterr().err
    assert "unknown horus-measured" in err and "horus-measured with --interference" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["simulate", str(p), "--nodes", str(n), "--quiet", "--json", "--mode", "fill", "--jobs", "1",
                 "--policies", "horus-measured,horus", "--interference", "gavel", "--gavel-file",
                 str(_gavel(tmp_path))]) == 0
    res = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    # 0.6 + 0.4 fill one GPU exactly: horus packs them (FGD's growth); two X on one GPU lose 1.2 GPUs,
    # more than the fragmentation of keeping them apart: horus-measured does
    assert res["horus"]["interference"]["colocated_jobs"] == 2
    assert res["horus-measured"]["interference"]["colocated_jobs"] == 0
    # with no weight on the measured loss the fragmentation decides, as for horus: they share the GPU
    assert main(["simulate", str(p), "--nodes", str(n), "--quiet", "--json", "--mode", "fill", "--jobs", "1",
                 "--policies", "horus-measured", "--interference", "gavel", "--gavel-file", str(_gavel(tmp_path)),
                 "--measured-weight", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["interference"]["colocated_jobs"] == 2
    assert main(["simulate", str(p), "--nodes", str(n), "--quiet", "--measured-weight", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--measured-weight: must be a number >= 0" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="needs measured co-location"):
        simulate(load_pods(p), load_nodes(n), "horus-measured", "fill", config=CONFIG)
