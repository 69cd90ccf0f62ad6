"""The Horus model: priors, online learning on real profiled jobs, intervals, state; the join."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from phasewise.kit.records import ContainerSample, HostSamples
from phasewise.kit.settings import Settings
from phasewise.models.horus.graph_features import catalog_features
from phasewise.models.horus.join import HorusJoin, JoinConfig
from phasewise.models.horus.model import HorusConfig, HorusModel, HorusStateError
from phasewise.models.horus.roofline import utilisation

#: the model under the default settings (horus_coverage)
CONFIG = HorusConfig(coverage=Settings().horus.coverage)
SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"
GPUMEMNET = SHARED / "gpumemnet-mlp-profiles" / "mlp_data_step2.csv.gz"


def test_before_any_job_the_prediction_is_the_prior_and_memory_follows_the_graph():
    m = HorusModel(CONFIG)
    small = m.predict_one(catalog_features("mlp-1024x1024x10", "vectors", 32, False))
    big = m.predict_one(catalog_features("mlp-1024x1024x10", "vectors", 65536, False))
    # GPU utilisation: the roofline prior; a small batch of a small MLP is launch-bound, a big one is not
    assert small["gpu_util"].mean == pytest.approx(utilisation(catalog_features(
        "mlp-1024x1024x10", "vectors", 32, False).to_dict())) and small["gpu_util"].mean < 20
    assert big["gpu_util"].mean > 50 and small["cpu_cores"].mean == pytest.approx(1.0)
    assert big["gpu_mem_bytes"].mean > small["gpu_mem_bytes"].mean + 2**28 > 500 * 2**20
    e = small["gpu_util"]
    assert e.lo < e.mean < e.hi <= 100.0


def test_it_learns_what_it_observes_and_restores_from_its_state():
    m = HorusModel(HorusConfig(coverage=CONFIG.coverage, min_residuals=3))
    jobs = [("mlp-64x256x10", "vectors", b, 0.5 + b / 64) for b in (16, 32, 64, 128)] + \
           [("mlp-64x512x512x10", "vectors", b, 0.8 + b / 64) for b in (16, 32, 64)]
    for model, ds, b, cores in jobs:
        m.learn_one(catalog_features(model, ds, b, False), {"cpu_cores": cores})
    f = catalog_features("mlp-64x256x10", "vectors", 96, False)
    p = m.predict_one(f)["cpu_cores"]
    assert 1.2 < p.mean < 3.0  # between the neighbours (batch 64: 1.5, 128: 2.5), far from the prior 1.0
    assert m.jobs == len(jobs) and m.seen("mlp-64x256x10-relu") and not m.seen("lstm_lm")
    assert m.observations("cpu_cores") == len(jobs) and m.observations("gpu_util") == 0
    state = json.loads(json.dumps(m.to_state()))
    assert HorusModel.from_state(state, m.config).predict_one(f) == m.predict_one(f)
    with pytest.raises(HorusStateError, match="version"):
        HorusModel.from_state({"v": 99}, CONFIG)
    with pytest.raises(HorusStateError, match="malformed"):
        HorusModel.from_state({"v": 1, "obs": [[{}, {"cpu_cores": 1}, None]], "jobs": 1}, CONFIG)


def test_config_is_checked():
    with pytest.raises(ValueError, match="coverage"):
        HorusConfig(coverage=1.0)


@pytest.mark.slow
@pytest.mark.skipif(not GPUMEMNET.exists(), reason="needs ../shared/data/gpumemnet-mlp-profiles")
def test_on_real_profiled_jobs_it_beats_its_prior_and_its_intervals_cover():
    """GPUMemNet's first 60 MLP training jobs (A100, measured): each predicted before it is learned."""
    from phasewise.apps.horus.predict import evaluate, gpumemnet_rows

    rows = gpumemnet_rows(SHARED)[:60]
    out = evaluate(rows)
    assert out["scored"] == 60 and not out["errors"]
    # the prior alone (the roofline's figure, the step's own memory estimate) on the same rows
    prior = evaluate(rows, model=_Frozen(CONFIG))
    assert out["rmsle_after_20"]["gpu_util"] < 0.75 * prior["rmsle_after_20"]["gpu_util"]
    assert out["rmsle_after_20"]["gmem"] < 0.5 * prior["rmsle_after_20"]["gmem"]
    assert out["rmsle_after_20"]["gmem"] < 0.15
    assert 0.6 <= out["coverage"]["gpu_util"] <= 1.0


class _Frozen(HorusModel):
    """The model that never learns (its prior), for comparison."""

    def learn_one(self, f, observed, device=None):  # noqa: D401
        return None


def test_eval_reports_unknown_names_per_row_and_scores_the_rest():
    from phasewise.apps.horus.predict import evaluate

    first = utilisation(catalog_features("resnet18", "cifar10", 32, False).to_dict())
    rows = [{"model": "ResNet-18", "dataset": "CIFAR-10", "batchsize": "32", "amp": "False", "gpu_util": str(first),
             "gmem": "2000"},
            {"model": "CycleGAN", "dataset": "monet2photo", "batchsize": "1", "amp": "False", "gpu_util": "60",
             "gmem": "3000"},
            {"model": "resnet18", "dataset": "cifar10", "batchsize": "x", "amp": "False", "gpu_util": "50",
             "gmem": "2000"},
            {"model": "resnet18", "dataset": "cifar10", "batchsize": "64", "amp": "False", "gpu_util": "60",
             "gmem": ""}]
    out = evaluate(rows)
    assert out["rows"] == 4 and out["scored"] == 2
    assert [e["row"] for e in out["errors"]] == [2, 3]
    assert "unknown" in out["errors"][0]["error"] and "batchsize" in out["errors"][1]["error"]
    # first row: the prior's figure exactly; the fourth: seen model, so not first sight; gmem missing there
    assert out["rmsle_first_sight"]["gpu_util"] == pytest.approx(0.0, abs=1e-9)
    assert out["rmsle"]["gpu_util"] > 0 and out["rmsle_after_20"]["gpu_util"] is None


def _hs(ts: float, cpu: float, mem: float = 1e9, host: str = "h1", container: str = "c1") -> HostSamples:
    return HostSamples(host=host, ts=ts, interval_s=1.0,
                       containers=(ContainerSample(container=container, cpu_cores=cpu, mem_bytes=mem),))


def test_the_join_leaves_out_warmup_observes_once_and_survives_a_restart():
    cfg = JoinConfig(warmup_s=5, min_samples=3, observe_s=4)
    j = HorusJoin(cfg)
    j.submitted("a", 0.0, {"model": "m"}, "m", None, {"cpu_cores": 1.0})
    j.started("a", "h1", "c1", 100.0)
    out = []
    for t in range(100, 104):  # warm-up: left out
        out += j.samples(_hs(t, cpu=9.0))
    out += j.samples(_hs(106, cpu=2.0, container="other"))  # another container: not this job
    out += j.samples(_hs(106, cpu=2.0))
    out += j.samples(_hs(107, cpu=4.0))
    # restart: the state written so far is all the new join gets; a re-read sample is not counted twice
    saved = dict(j.pop_dirty())
    k = HorusJoin(cfg)
    k.load("a", json.loads(json.dumps(saved["a"])))
    out += k.samples(_hs(107, cpu=4.0))
    for t in (108, 110, 111):
        out += k.samples(_hs(t, cpu=3.0))
    assert len(out) == 1
    o = out[0]
    assert o.observed["cpu_cores"] == pytest.approx((2 + 4 + 3 + 3) / 4) and o.predicted == {"cpu_cores": 1.0}
    assert k.finished("a", 120.0) is None and "a" not in k  # observed already; forgotten
    assert dict(k.pop_dirty())["a"] is None


def test_a_job_that_finishes_early_is_observed_at_finish_if_it_has_enough_samples():
    j = HorusJoin(JoinConfig(warmup_s=0, min_samples=2, observe_s=1000))
    j.submitted("b", 0.0, {"model": "m"}, "m", "t4", {})
    j.started("b", "h1", "c1", 0.0)
    assert j.samples(_hs(1, cpu=1.0)) == [] and j.finished("b", 2.0) is None  # one sample: not enough
    j.submitted("c", 0.0, {"model": "m"}, "m", "t4", {})
    j.started("c", "h1", "c1", 0.0)
    j.samples(_hs(1, cpu=1.0))
    j.samples(_hs(2, cpu=3.0, mem=3e9))
    o = j.finished("c", 3.0)
    assert o is not None and o.observed == {"cpu_cores": 2.0, "mem_bytes": 2e9} and o.device == "t4"
    assert math.isfinite(o.ts)


def test_on_real_cpu_jobs_measured_here_learning_beats_the_prior():
    """18 real training jobs of catalog models on this machine (tests/apps/horus/data), each predicted, then learned."""
    from phasewise.apps.horus.predict import evaluate, read_csv

    rows = read_csv(str(Path(__file__).resolve().parents[2] / "apps" / "horus" / "data" / "measured_cpu_jobs.csv"))
    learned = evaluate(rows, columns=("cpu_cores", "mem"))
    prior = evaluate(rows, model=_Frozen(CONFIG), columns=("cpu_cores", "mem"))
    assert learned["scored"] == 18 and not learned["errors"]
    assert learned["rmsle"]["cpu_cores"] < 0.6 * prior["rmsle"]["cpu_cores"]
    assert learned["rmsle"]["mem"] < prior["rmsle"]["mem"] < 0.5


def test_the_first_phase_change_after_start_ends_the_loading_phase_early():
    j = HorusJoin(JoinConfig(warmup_s=100, min_samples=2, observe_s=1))
    j.submitted("p", 0.0, {"model": "m"}, "m", None, {})
    j.started("p", "h1", "c1", 10.0)
    j.phase_change("h1", "other", 12.0)  # another container's phase: nothing
    assert j.samples(_hs(13, cpu=5.0)) == []
    j.phase_change("h1", "c1", 14.0)
    j.phase_change("h1", "c1", 16.0)  # only the first counts
    out = j.samples(_hs(13.5, cpu=5.0)) + j.samples(_hs(14, cpu=1.0)) + j.samples(_hs(15, cpu=3.0))
    assert len(out) == 1 and out[0].observed["cpu_cores"] == 2.0


def test_a_job_of_a_family_never_learned_gets_the_prior_and_the_device_bias_and_wider_intervals():
    """The learners fit the families they saw; a new family gets the prior plus the device's mean residual, and
    the spread of the errors made on jobs of families new at the time (Mondrian conformal)."""
    m = HorusModel(HorusConfig(coverage=0.8, min_residuals=2))
    jobs = [("resnet18", "cifar10", b) for b in (16, 32, 64, 128)] + [("vgg16", "cifar10", b) for b in (16, 32, 64)]
    for model, ds, b in jobs:
        f = catalog_features(model, ds, b, False)
        m.learn_one(f, {"gpu_util": 0.5 * utilisation(f.to_dict(), "h100")}, "h100")
    assert m.novelty("resnet50") == "model" and m.novelty("bert_base") == "family" and m.novelty("vgg16") == "seen"
    new = catalog_features("bert_base", "squad", 4, False)
    p = m.predict_one(new, "h100")["gpu_util"]
    bias = sum(math.log1p(0.5 * u) - math.log1p(u) for u in
               [utilisation(catalog_features(mo, d, b, False).to_dict(), "h100") for mo, d, b in jobs]) / len(jobs)
    assert math.log1p(p.mean) == pytest.approx(math.log1p(utilisation(new.to_dict(), "h100")) + bias)
    # two jobs were of a new family when predicted (resnet's first, vgg's first): their errors set the spread
    seen = m.predict_one(catalog_features("vgg16", "cifar10", 48, False), "h100")["gpu_util"]
    assert math.log(p.hi + 1) - math.log(p.mean + 1) >= math.log(seen.hi + 1) - math.log(seen.mean + 1)
