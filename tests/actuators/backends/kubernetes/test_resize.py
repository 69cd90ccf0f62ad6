"""The pure resize rules (``backends/kubernetes/resize.py``): quantities, resize states, the patch, when to recreate.

The pods are the recorded API answers in ``fixtures/kubernetes/``; no server.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from phasewise.actuators.backends.kubernetes.resize import (
    RecreatePolicy,
    ResizeState,
    parse_quantity,
    plan_resize,
    recreatable,
    recreate_reason,
    resize_state,
)
from tests.actuators.backends.kubernetes.test_backend import fx

#: the fixtures' PodResizePending / PodResizeInProgress lastTransitionTime, 2026-11-24T10:01:12Z
PENDING_SINCE = resize_state(fx("pod-deferred.json")).since


def test_burstable_resize_that_would_become_guaranteed_is_refused():
    pod = fx("pod-burstable.json")
    # cpu limit 2 -> 0.5 == request 500m and memory limit -> 1Gi == request: every request == limit
    plan = plan_resize(pod, "worker", cpu_cores=0.5, mem_bytes=2**30)
    assert plan.patch is None and "Guaranteed" in plan.refused and not plan.temporary


def test_memory_restart_policy_not_resized_cpu_still_is():
    plan = plan_resize(fx("pod-memory-restart.json"), "worker", cpu_cores=3.0, mem_bytes=2**30, mem_usage=1.0)
    assert plan.patch == {"spec": {"containers": [{"name": "worker", "resources": {
        "requests": {"cpu": "3000m"}, "limits": {"cpu": "3000m"}}}]}}
    assert "RestartContainer" in plan.refused and plan.mem_bytes is None


def test_infeasible_replaced_by_a_smaller_resize():
    pod = fx("pod-infeasible.json")  # 64 cores found infeasible
    assert plan_resize(pod, "worker", cpu_cores=4.0, mem_bytes=None).patch is not None
    assert plan_resize(pod, "worker", cpu_cores=80.0, mem_bytes=None).patch is None


def test_legacy_resize_status_field():
    assert resize_state({"status": {"resize": "Deferred"}}).state == "deferred"
    assert resize_state({"status": {"conditions": [{"type": "PodResizePending", "status": "False"}]}}).state == "none"


def test_quantities():
    assert parse_quantity("1830412k") == 1830412000.0
    assert parse_quantity("1.5Gi") == 1.5 * 2**30
    with pytest.raises(ValueError):
        parse_quantity("12 cores")


def test_when_the_fallback_evicts():
    p = RecreatePolicy(deferred_timeout_s=300, in_progress_timeout_s=3600)
    # the condition's own clock
    assert PENDING_SINCE == datetime(2026, 11, 24, 10, 1, 12, tzinfo=UTC).timestamp()
    assert recreate_reason(ResizeState("infeasible", "no room"), 0.0, p).startswith("the node can never fit")
    assert recreate_reason(ResizeState("error", "busy"), 0.0, p).startswith("the kubelet reported an error")
    assert recreate_reason(ResizeState("deferred"), 300.0, p) is None
    assert "Deferred for 301 s" in recreate_reason(ResizeState("deferred"), 301.0, p)
    assert recreate_reason(ResizeState("in-progress"), 3600.0, p) is None
    assert "in progress for 3601 s" in recreate_reason(ResizeState("in-progress"), 3601.0, p)
    assert recreate_reason(ResizeState("deferred"), None, p) is None  # no start known: no timeout passed
    assert recreate_reason(ResizeState("none"), 1e9, p) is None


def test_only_a_pod_a_controller_recreates_elsewhere_is_evictable():
    assert recreatable(fx("pod-deferred.json")) == (None, "ReplicaSet/trainer-7c9d5b8f6d")
    assert "no controller" in recreatable(fx("pod-deferred-bare.json"))[0]
    ds = {"metadata": {"ownerReferences": [{"kind": "DaemonSet", "name": "agent", "controller": True}]}}
    assert "same node" in recreatable(ds)[0]
    static = {"metadata": {"ownerReferences": [{"kind": "Node", "name": "gpu-node-3", "controller": True}]}}
    assert "static pod" in recreatable(static)[0]
    not_ctl = {"metadata": {"ownerReferences": [{"kind": "ReplicaSet", "name": "x", "controller": False}]}}
    assert "no controller" in recreatable(not_ctl)[0]
