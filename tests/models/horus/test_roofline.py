"""The analytic prior of GPU utilisation on roofline cases whose answer is known."""

from __future__ import annotations

import pytest

from phasewise.models.horus import roofline as R
from phasewise.models.horus.families import family

STEP = dict(flops=0, activation_bytes=0, param_bytes=0, optimizer_bytes=0, kernels=100, amp=False)


def test_a_compute_bound_step_takes_its_flops_at_the_attainable_peak_and_keeps_the_gpu_busy():
    g = dict(STEP, flops=1e13)
    t = R.step_times(g, "v100")
    assert t["compute"] == pytest.approx(1e13 / (15.7e12 * R.COMPUTE_EFFICIENCY))
    assert t["gpu"] == pytest.approx(t["compute"] + 100 * R.KERNEL_S) and t["gpu"] > t["host"]
    assert R.utilisation(g, "v100") == pytest.approx(100.0)
    # AMP runs the same FLOPs on the FP16 tensor cores: 8x faster on a V100 (125 vs 15.7 TFLOP/s)
    amp = R.step_times(dict(g, amp=True), "v100")
    assert t["compute"] / amp["compute"] == pytest.approx(125 / 15.7)


def test_a_memory_bound_step_takes_its_bytes_at_the_bandwidth_and_a_faster_memory_shortens_it():
    g = dict(STEP, activation_bytes=4e9, param_bytes=1e8, optimizer_bytes=2e8)
    moved = 3 * 4e9 + 5 * 1e8 + 2 * 2e8
    h100, h200 = R.step_times(g, "h100"), R.step_times(g, "h200")
    assert h100["memory"] == pytest.approx(moved / (3.35e12 * R.MEMORY_EFFICIENCY))
    assert h200["memory"] == pytest.approx(h100["memory"] * 3.35 / 4.8) and h100["compute"] == 0
    assert R.utilisation(g, "h100") == pytest.approx(100.0)


def test_a_launch_bound_step_keeps_the_gpu_busy_for_its_kernels_over_the_hosts_time():
    g = dict(STEP, flops=1e6, kernels=40)
    t = R.step_times(g, "a100")
    assert t["host"] == pytest.approx(40 * R.LAUNCH_S + R.STEP_S) and t["host"] > t["gpu"]
    u = R.utilisation(g, "a100")
    assert u == pytest.approx(100 * t["gpu"] / t["host"]) and u < 20
    # twice the kernels: more busy time, but the host's fixed cost per step is shared
    assert R.utilisation(dict(g, kernels=80), "a100") > R.utilisation(g, "a100")


def test_devices_are_found_by_type_and_an_unknown_one_is_an_a100():
    assert R.peaks("NVIDIA-A100-SXM4-40GB") == R.PEAKS["a100"] == R.peaks(None) == R.peaks("tpu")
    assert R.peaks("h100") == R.PEAKS["h100"] and R.peaks("nvidia-h200") == R.PEAKS["h200"]
    # features from before kernels were counted: an estimate from the layers
    old = dict(STEP, kernels=0, depth=10, norm=5)
    assert R.step_times(old)["kernels"] == pytest.approx((9 * 10 + 12 * 5 + 8) * R.KERNEL_S)


def test_families_group_the_catalog_by_architecture():
    assert {family(m) for m in ("resnet18", "resnet50")} == {"resnet"}
    assert family("bert_base") == family("transformer") == "transformer"
    assert family("mlp-8x4-relu") == "mlp" and family("ppo_mlp") == "rl-mlp" and family("a.b:c") == "a.b:c"
