"""``phasewise bench phases`` end to end on a small fleet (its own embedded broker)."""

from __future__ import annotations

import argparse
import json

import pytest

from phasewise.bench import phases


def args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    phases.add_arguments(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_the_pure_measurement_reports_rate_and_state_per_container(capsys):
    assert phases.run(args(containers=200, per_host=100, pure_ticks=5, pure_only=True, json=True)) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["pure_step_samples_per_s"] > 0 and out["decode_included"] is True
    assert 0 < out["bytes_per_container"] <= 4096
    assert out["samples_per_s"] is None and out["phases_open"] >= 2


@pytest.mark.broker
@pytest.mark.slow
def test_a_phase_worker_drains_a_backlog_with_the_crbm_in_the_loop():
    out = phases.run_bench(args(containers=200, per_host=100, seconds=200, pure_ticks=3))  # ~1 s of backlog
    assert out["samples_per_s"] > 0 and out["worker_model_version"] >= 1
    assert out["worker_phase_changes"] > 0  # the detectors ran the warm snapshot on every sample
    assert out["worker_rss_bytes_per_container"] >= 0
