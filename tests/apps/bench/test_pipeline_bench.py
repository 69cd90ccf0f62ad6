"""``phasewise bench pipeline`` end to end on a small fleet (its own embedded broker): the README's latency
command, at a size the suite can afford. The figures are the bench's to report, not the test's to judge."""

from __future__ import annotations

import argparse

import pytest

from phasewise.apps.bench import pipeline

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_samples_reach_the_actuator_and_every_figure_is_reported():
    """Two hosts ticking half a second apart (``--hosts-tick spread``; the default sends both at once: the
    same loop without the waits)."""
    p = argparse.ArgumentParser()
    pipeline.add_arguments(p)
    out = pipeline.run_bench(p.parse_args(["--policy", "phase", "--containers", "100", "--per-host", "50",
                                           "--seconds", "5", "--latency-seconds", "6", "--raw-messages", "500",
                                           "--hosts-tick", "spread"]))
    assert out["raw_consume_per_s"] > 0
    assert out["samples_per_s"] is None or out["samples_per_s"] > 0
    assert out["actuations_measured"] > 0 and out["decisions_measured"] > 0, out
    assert 0 < out["p50_ms"] <= out["p99_ms"] and 0 < out["worker_p50_ms"] <= out["worker_p99_ms"]
    assert out["containers"] == 100 and out["policy"] == "phase" and out["safety"] == "on"
    assert out["hosts_tick"] == "spread" and out["per_host"] == 50
