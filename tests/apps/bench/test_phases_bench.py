"""``phasewise bench phases`` end to end on a small fleet (its own embedded broker)."""

from __future__ import annotations

import argparse
import json

import pytest

from phasewise.apps.bench import phases


def args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    phases.add_arguments(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("features", ["cpu,mem", "cpu,mem,gpu,gpu_mem"])
def test_the_pure_measurement_reports_rate_and_state_per_container(capsys, features):
    assert phases.run(args(containers=200, per_host=100, pure_ticks=5, pure_only=True, json=True,
                           features=features)) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["pure_step_samples_per_s"] > 0 and out["decode_included"] is True and out["features"] == features
    assert 0 < out["bytes_per_container"] <= 4096
    assert out["samples_per_s"] is None and out["phases_open"] >= 2


def test_bad_features_are_refused_with_the_reason(capsys):
    from phasewise.cli import main

    assert main(["bench", "phases", "--pure-only", "--features", "cpu,tpu"]) == 2
    assert capsys.readouterr().err == ("phasewise bench phases: error: --features: unknown feature(s) tpu; "
                                       "choose from cpu,mem,gpu,gpu_mem\n")


@pytest.mark.broker
@pytest.mark.slow
def test_a_phase_worker_drains_a_backlog_with_the_crbm_in_the_loop():
    # with GPU features: the worker runs PHASEWISE_PHASE_FEATURES=cpu,mem,gpu,gpu_mem end to end
    # (its snapshot is the 4-feature model; the samples carry GPU use)
    # ~3 s of backlog on a quiet machine: more than the scrape interval, so it is timed (a backlog that
    # drains between two scrapes has no rate: samples_per_s null)
    out = phases.run_bench(args(containers=200, per_host=100, seconds=600, pure_ticks=3,
                                features="cpu,mem,gpu,gpu_mem"))
    assert out["samples_per_s"] > 0 and out["worker_model_version"] >= 1
    assert out["worker_phase_changes"] > 0  # the detectors ran the warm snapshot on every sample
    assert out["worker_decisions"] > 0
    assert out["worker_rss_bytes_per_container"] >= 0
