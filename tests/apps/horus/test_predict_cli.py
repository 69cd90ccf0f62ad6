"""``phasewise predict eval``: the output's shape, per-row errors, one-line errors for a bad CSV."""

from __future__ import annotations

import json

from phasewise.cli import main

CSV = """model,dataset,batchsize,amp,gpu_util,gmem,notes
ResNet-18,CIFAR-10,32,False,45.0,1800,first
CycleGAN,monet2photo,1,False,60,3000,not in the catalog
mlp-64x128x10,vectors,64,false,20,1200,
MLP-64x128x10,Vectors,128,false,25,,
"""


def test_eval_prints_the_scores_and_per_row_errors(tmp_path, capsys):
    f = tmp_path / "observed.csv"
    f.write_text(CSV)
    assert main(["predict", "eval", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"rows", "rmsle", "rmsle_after_20", "rmsle_first_sight"}
    assert out["rows"] == 4 and out["scored"] == 3
    assert set(out["rmsle"]) == {"gpu_util", "gmem"} and out["rmsle_after_20"]["gpu_util"] is None
    assert out["errors"] == [{"row": 2, "model": "CycleGAN", "error": out["errors"][0]["error"]}]
    assert "unknown model 'CycleGAN'" in out["errors"][0]["error"]
    # rows 1 and 3 are first sight (two models; row 2 was never learned); row 4 is the MLP again
    first = tmp_path / "first.csv"
    first.write_text("\n".join(CSV.splitlines()[i] for i in (0, 1, 3)) + "\n")
    assert main(["predict", "eval", str(first), "--json"]) == 0
    only = json.loads(capsys.readouterr().out)
    assert out["rmsle_first_sight"] == only["rmsle"] and out["rmsle"] != only["rmsle"]


def test_a_csv_without_the_columns_is_one_line_and_exit_2(tmp_path, capsys):
    f = tmp_path / "observed.csv"
    f.write_text("model,dataset,bs\nresnet18,cifar10,32\n")
    assert main(["predict", "eval", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing column(s) batchsize, amp, gpu_util, gmem" in err
    assert main(["predict", "eval", str(tmp_path / "nope.csv")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_eval_builds_a_module_function_only_as_horus_would(tmp_path, capsys, monkeypatch):
    """Catalog only by default (nothing imported); with the module listed, in a child process: os:abort is
    a row's error, and the evaluation goes on."""
    f = tmp_path / "observed.csv"
    f.write_text("model,dataset,batchsize,amp,gpu_util,gmem\nos:abort,vectors,8,false,20,100\n"
                 "mlp-8x4,vectors,8,false,20,100\n")
    monkeypatch.delenv("PHASEWISE_HORUS_MODEL_MODULES", raising=False)
    assert main(["predict", "eval", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scored"] == 1 and "module os is not in horus_model_modules" in out["errors"][0]["error"]
    monkeypatch.setenv("PHASEWISE_HORUS_MODEL_MODULES", "os")
    assert main(["predict", "eval", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scored"] == 1 and "the process building it died of SIGABRT" in out["errors"][0]["error"]
    monkeypatch.setenv("PHASEWISE_HORUS_MODEL_MODULES", "not a module")
    assert main(["predict", "eval", str(f), "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PHASEWISE_HORUS_MODEL_MODULES" in err and "is not a module name" in err


FAMILIES_CSV = """model,dataset,batchsize,amp,gpu_util,gmem,device
mlp-64x128x10,vectors,64,false,20,1400,h100
ppo_mlp,lunarlander,64,false,13,1370,h100
mlp-64x128x10,vectors,256,false,24,1420,h100
neumf,movielens,256,false,16,1375,h100
ppo_mlp,lunarlander,1024,true,16,1371,h100
mlp-32x64x64x10,vectors,64,false,18,1400,h100
neumf,movielens,2048,false,25,1375,h100
"""


def test_eval_scores_each_family_and_each_family_left_out(tmp_path, capsys):
    import math

    from phasewise.apps.horus.predict import parse_row, read_csv
    from phasewise.models.horus.model import HorusConfig, HorusModel

    f = tmp_path / "observed.csv"
    f.write_text(FAMILIES_CSV)
    assert main(["predict", "eval", str(f), "--by-family", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fams = out["families"]
    assert set(fams) == {"mlp", "rl-mlp", "recommender"} and sum(v["jobs"] for v in fams.values()) == 7
    assert fams["mlp"]["jobs"] == 3 and set(fams["mlp"]) >= {"rmsle", "rmsle_first_sight", "coverage"}

    assert main(["predict", "eval", str(f), "--leave-family-out", "--json", "--coverage", "0.8"]) == 0
    lfo = json.loads(capsys.readouterr().out)["families"]
    assert {k: (v["jobs"], v["trained_on"]) for k, v in lfo.items()} == {
        "mlp": (3, 4), "rl-mlp": (2, 5), "recommender": (2, 5)}
    # unseen: the recommender's rows predicted by a model that learned only the five others
    rows = [parse_row(r) for r in read_csv(str(f))]
    m = HorusModel(HorusConfig(coverage=0.8))
    for feats, obs, key, dev in rows:
        if key != "neumf":
            m.learn_one(feats, obs, dev)
    errs = [(math.log1p(m.predict_one(feats, dev)["gpu_util"].mean) - math.log1p(obs["gpu_util"])) ** 2
            for feats, obs, key, dev in rows if key == "neumf"]
    assert lfo["recommender"]["unseen"]["gpu_util"] == round(math.sqrt(sum(errs) / 2), 4)
    assert lfo["recommender"]["within"]["gpu_util"] is not None  # its second row, after its first was learned

    assert main(["predict", "eval", str(f), "--leave-family-out", "--train-limit", "2"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split()[:3] == ["family", "jobs", "learned"] and len(text) == 4
    assert [line.split()[:3] for line in text[1:]] == [["mlp", "3", "2"], ["recommender", "2", "2"],
                                                       ["rl-mlp", "2", "2"]]


def test_gavel_reads_the_shared_loader_and_a_missing_file_is_one_line(tmp_path, capsys):
    import gzip

    d = tmp_path / "gavel-throughputs"
    d.mkdir()
    raw = {"v100": {"('ResNet-18 (batch size 32)', 1)": {"null": 20.0}, "('ResNet-18 (batch size 64)', 1)":
                    {"null": 10.0}, "('ResNet-18 (batch size 64)', 2)": {"null": 15.0}, "('A3C', 1)": {"null": 5.0}}}
    with gzip.open(d / "physical_cluster_throughputs.json.gz", "wt") as fh:
        json.dump(raw, fh)
    assert main(["predict", "gavel", "--data", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)  # single-GPU catalog models only: not the 2-GPU entry, not A3C
    assert out["configs"] == 2 and [p["step_s"] for p in out["points"]] == [0.05, 0.1]
    assert main(["predict", "gavel", "--data", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "No such file" in err and len(err.strip().splitlines()) == 1
