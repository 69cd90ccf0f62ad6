"""The resize -> evict fallback (``phasewise.io/update-mode: in-place-or-recreate``) at the HTTP boundary.

Recorded-form answers (``fixtures/kubernetes/``) replayed by a local server, as in ``test_backend.py``:
the fallback evicts, through the Eviction API, a pod whose resize is Infeasible, failed in the kubelet, or
stays Deferred / in progress past its timeout; a disruption budget's 429 is tried again later; a pod no
controller recreates is never evicted; ``in-place`` (the default) never evicts.
"""

from __future__ import annotations

import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends.kubernetes import (
    KubeApi,
    KubernetesBackend,
    PodDirectory,
    RecreatePolicy,
    resize_state,
)
from phasewise.actuators.commands import SetLimits
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.records import Decision, WorkloadPolicy, encode
from phasewise.kit.settings import Settings
from phasewise.models.safety.workload import parse_policy_file, parse_settings, resolve
from tests.actuators.backends.kubernetes.test_backend import CID, LIST, MANAGED, METRICS, POD, fx
from tests.actuators.backends.kubernetes.test_backend import serve as serve  # noqa: F401 - the fixture

RECREATE = "in-place-or-recreate"
#: the fixtures' PodResizePending / PodResizeInProgress lastTransitionTime, 2026-11-24T10:01:12Z
PENDING_SINCE = resize_state(fx("pod-deferred.json")).since
EVICT = ("POST", POD + "/eviction", 201, "status-201-success.json")
EVICTION_BODY = {"apiVersion": "policy/v1", "kind": "Eviction",
                 "metadata": {"name": "trainer-7c9d5b8f6d-x2x9q", "namespace": "ml"}}


def backend(r, now: list[float], **kw) -> KubernetesBackend:
    api = KubeApi(r.url, token="tok")
    return KubernetesBackend(api, PodDirectory(api, "gpu-node-3", clock=lambda: 0.0), clock=lambda: now[0],
                             recreate=RecreatePolicy(**kw))


# --------------------------------------------------------------------------- the rule, pure


def test_the_update_mode_is_a_workload_setting():
    s = parse_settings({"phasewise.io/mode": "apply", "phasewise.io/update-mode": RECREATE})
    assert resolve(s, "kubepods-systemd").update_mode == RECREATE
    assert resolve(parse_settings({"phasewise.io/mode": "apply"}), "kubepods-systemd").update_mode is None
    bad = resolve(parse_settings({"phasewise.io/mode": "apply", "phasewise.io/update-mode": "Recreate"}), "flat")
    assert bad.mode == "off" and "update-mode: 'Recreate' is not one of in-place, in-place-or-recreate" in bad.error
    rules = parse_policy_file({"workloads": [{"match": "train-*", "mode": "apply", "update-mode": RECREATE}]})
    assert rules[0].settings.update_mode == RECREATE


# --------------------------------------------------------------------------- the backend, at the HTTP boundary


@pytest.mark.parametrize("fixture", ["pod-infeasible.json", "pod-deferred.json", "pod-inprogress.json",
                                     "pod-inprogress-error.json"])
def test_in_place_never_evicts_however_long_the_resize_waits(serve, fixture):
    r = serve(LIST, ("GET", POD, 200, fixture))
    now = [PENDING_SINCE + 86400.0]  # a day pending
    b = backend(r, now)
    out = b.apply(SetLimits(MANAGED, cpu_cores=80.0))  # update_mode in-place, the default
    assert out.status == "failed" and "evicted" not in out.message
    assert [s["method"] for s in r.seen] == ["GET", "GET"] and not b.watched
    assert b.follow_up(now[0] + 1e6) == []


def test_infeasible_is_evicted_at_once_and_the_outcome_says_so(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-infeasible.json"), EVICT)
    b = backend(r, [PENDING_SINCE + 5.0])
    out = b.apply(SetLimits(MANAGED, cpu_cores=80.0, update_mode=RECREATE))
    assert out.status == "failed" and not out.temporary
    assert "not applied: the node can never fit the resize (Infeasible): Node didn't have enough capacity" \
        in out.message
    assert "pod ml/trainer-7c9d5b8f6d-x2x9q evicted (in-place-or-recreate): ReplicaSet/trainer-7c9d5b8f6d " \
           "recreates it with its template's resources" in out.message
    assert r.seen[-1]["body"] == EVICTION_BODY and r.seen[-1]["type"] == "application/json"
    assert r.seen[-1]["auth"] == "Bearer tok" and not r.script and not b.watched


def test_a_smaller_request_replaces_an_infeasible_one_in_place_before_any_eviction(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-infeasible.json"), ("PATCH", POD + "/resize", 200, "resize-200.json"))
    b = backend(r, [PENDING_SINCE + 5.0])
    out = b.apply(SetLimits(MANAGED, cpu_cores=4.0, update_mode=RECREATE))
    assert out.status == "applied" and "accepted" in out.message and "watched" in out.message
    assert [s["method"] for s in r.seen] == ["GET", "GET", "PATCH"] and MANAGED in b.watched


def test_deferred_waits_its_timeout_from_the_conditions_transition_time_then_evicts(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-deferred.json"),
              ("GET", POD, 200, "pod-deferred.json"),  # the first check: 200 s deferred, still waiting
              ("GET", POD, 200, "pod-deferred.json"), EVICT)  # the next: 320 s, evicted
    now = [PENDING_SINCE + 100.0]
    b = backend(r, now, deferred_timeout_s=300.0, check_s=30.0)
    out = b.apply(SetLimits(MANAGED, cpu_cores=10.0, update_mode=RECREATE))
    assert out.status == "failed" and not out.temporary and "deferred" in out.message
    assert "watched (update-mode in-place-or-recreate): the pod is evicted after 300 s deferred" in out.message
    assert MANAGED in b.watched and [s["method"] for s in r.seen] == ["GET", "GET"]
    assert b.follow_up(PENDING_SINCE + 120.0) == []  # not due a check yet: no request
    assert len(r.seen) == 2
    assert b.follow_up(PENDING_SINCE + 200.0) == [] and len(r.seen) == 3
    got = b.follow_up(PENDING_SINCE + 320.0)
    assert len(got) == 1 and got[0][0] == MANAGED
    assert "the resize stayed Deferred for 320 s (more than 300 s)" in got[0][1].message
    assert "evicted" in got[0][1].message and not b.watched and not r.script


def test_an_accepted_resize_is_watched_until_done(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-guaranteed.json"), ("PATCH", POD + "/resize", 200, "resize-200.json"),
              ("GET", POD, 200, "pod-inprogress.json"),  # applying: within the hour
              ("GET", POD, 200, "pod-guaranteed.json"))  # done: no pending condition
    now = [PENDING_SINCE]
    b = backend(r, now, check_s=10.0)
    assert b.apply(SetLimits(MANAGED, cpu_cores=1.5, update_mode=RECREATE)).status == "applied"
    assert b.follow_up(PENDING_SINCE + 10.0) == [] and MANAGED in b.watched
    assert b.follow_up(PENDING_SINCE + 20.0) == [] and not b.watched and not r.script
    assert b.follow_up(PENDING_SINCE + 1e6) == [] and len(r.seen) == 5  # nothing watched: nothing read


def test_a_kubelet_error_applying_an_accepted_resize_evicts(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-guaranteed.json"), ("PATCH", POD + "/resize", 200, "resize-200.json"),
              ("GET", POD, 200, "pod-inprogress-error.json"), EVICT)
    b = backend(r, [PENDING_SINCE], check_s=10.0)
    assert b.apply(SetLimits(MANAGED, cpu_cores=1.5, update_mode=RECREATE)).status == "applied"
    (container, out), = b.follow_up(PENDING_SINCE + 10.0)
    assert "the kubelet reported an error applying the resize: Failed to apply the resize" in out.message
    assert "evicted" in out.message and not r.script


def test_in_progress_times_out_after_an_hour_counted_from_the_send_without_a_transition_time(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-guaranteed.json"), ("PATCH", POD + "/resize", 200, "resize-200.json"),
              # before 1.33: status.resize InProgress, no condition, no transition time
              ("GET", POD, 200, "pod-inprogress-legacy.json"), ("GET", POD, 200, "pod-inprogress-legacy.json"), EVICT)
    t0 = 1_000_000.0
    b = backend(r, [t0], in_progress_timeout_s=3600.0, check_s=60.0)
    assert b.apply(SetLimits(MANAGED, cpu_cores=1.5, update_mode=RECREATE)).status == "applied"
    assert b.follow_up(t0 + 3600.0) == [] and MANAGED in b.watched
    (_, out), = b.follow_up(t0 + 3661.0)
    assert "stayed in progress for 3661 s (more than 3600 s)" in out.message and not r.script


def test_a_disruption_budget_defers_the_eviction_it_is_not_a_failure_of_it(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-infeasible.json"),
              ("POST", POD + "/eviction", 429, "status-429-pdb.json", {"Retry-After": "90"}),
              ("GET", POD, 200, "pod-infeasible.json"),
              ("POST", POD + "/eviction", 429, "status-429-pdb.json"),
              ("GET", POD, 200, "pod-infeasible.json"), EVICT)
    seen: list[str] = []
    b = backend(r, [PENDING_SINCE], check_s=30.0)
    b.on_fallback = seen.append
    out = b.apply(SetLimits(MANAGED, cpu_cores=80.0, update_mode=RECREATE))
    assert out.status == "failed" and not out.temporary
    assert "eviction (in-place-or-recreate) not allowed yet (HTTP 429 TooManyRequests: Cannot evict pod as it " \
           "would violate the pod's disruption budget.)" in out.message and "tried again every 30 s" in out.message
    assert MANAGED in b.watched
    assert b.follow_up(PENDING_SINCE + 60.0) == [] and len(r.seen) == 3  # Retry-After 90 s: not yet
    assert b.follow_up(PENDING_SINCE + 90.0) == [] and MANAGED in b.watched  # still refused: still watched
    (_, out), = b.follow_up(PENDING_SINCE + 120.0)
    assert "evicted" in out.message and not b.watched and not r.script
    assert seen == ["waiting", "waiting", "evicted"]


def test_a_pod_no_controller_recreates_is_never_evicted(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-deferred-bare.json"))
    b = backend(r, [PENDING_SINCE + 1000.0])
    out = b.apply(SetLimits(MANAGED, cpu_cores=10.0, update_mode=RECREATE))
    assert out.status == "failed" and "not evicted (in-place-or-recreate): the pod has no controller" in out.message
    assert [s["method"] for s in r.seen] == ["GET", "GET"] and not b.watched


def test_a_pod_gone_is_no_longer_watched(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-deferred.json"), ("GET", POD, 404, "status-404-pod.json"))
    b = backend(r, [PENDING_SINCE])
    b.apply(SetLimits(MANAGED, cpu_cores=10.0, update_mode=RECREATE))
    assert MANAGED in b.watched
    assert b.follow_up(PENDING_SINCE + 1000.0) == [] and not b.watched and not r.script


# --------------------------------------------------------------------------- through the actuator


class _Workloads:
    """This host's per-workload policy as the actuator reads it: one pod opted in with the fallback."""

    def __init__(self, policy: WorkloadPolicy) -> None:
        self.policy = policy

    def describe(self, container: str):
        return None, self.policy


def test_the_actuator_publishes_the_fallbacks_outcome_as_a_further_actuation_of_the_decision(serve, recorder):
    r = serve(LIST, ("GET", METRICS, 200, "podmetrics.json"), ("GET", POD, 200, "pod-guaranteed.json"),
              ("GET", METRICS, 200, "podmetrics.json"), ("PATCH", POD + "/resize", 200, "resize-200.json"),
              ("GET", POD, 200, "pod-deferred.json"), EVICT)
    now = [time.time()]
    api = KubeApi(r.url)
    kube = KubernetesBackend(api, PodDirectory(api, "gpu-node-3"), clock=lambda: now[0],
                             recreate=RecreatePolicy(deferred_timeout_s=300.0, check_s=30.0))
    metrics = ActuatorMetrics(CollectorRegistry())
    ledger = Ledger(":memory:")
    a = Actuator(Settings().replace(host="gpu-node-3"), kube, ledger, recorder, metrics=metrics, host_cores=16.0,
                 clock=lambda: now[0],
                 workloads=_Workloads(WorkloadPolicy(mode="apply", source="annotation", update_mode=RECREATE)))
    d = Decision(id=uuid.uuid4().hex, ts=now[0], host="gpu-node-3", container=CID, action="limit", policy="vpa",
                 reason="test", cpu_limit_cores=1.5, mem_limit_bytes=3 * 2**30)
    assert a.handle(encode(d), b"gpu-node-3", 0, 0).status == "applied"
    assert a.follow_up() == []  # not due a check
    now[0] += 30.0  # the first check: the kubelet deferred the resize at 10:01:12, more than 300 s ago
    (act,) = a.follow_up()
    assert act.decision_id == d.id and act.container == CID and act.status == "failed"
    assert f"Deferred for {now[0] - PENDING_SINCE:.0f} s" in act.message
    assert "evicted (in-place-or-recreate)" in act.message
    assert [x.decision_id for x in recorder.actuations()] == [d.id, d.id]
    assert ledger.get(d.id).status == "failed" and "evicted" in ledger.get(d.id).message
    reg = metrics.registry
    assert reg.get_sample_value("phasewise_actuator_resize_fallbacks_total", {"outcome": "evicted"}) == 1.0
    # the follow-up is not counted as another decision
    assert reg.get_sample_value("phasewise_actuator_decisions_total", {"status": "applied"}) == 1.0
    assert reg.get_sample_value("phasewise_actuator_decisions_total", {"status": "failed"}) == 0.0
    assert a.follow_up() == [] and not r.script


def test_the_plan_carries_the_workloads_update_mode():
    from phasewise.actuators.safety import plan

    d = Decision(id="x", ts=1.0, host="h", container="job-a", action="limit", policy="vpa", cpu_limit_cores=1.0)
    s = Settings().replace(host="h")
    got = plan(d, exists=True, usage_mem_bytes=None, host_cores=8, settings=s,
               workload=WorkloadPolicy(mode="apply", update_mode=RECREATE))
    assert got.command.update_mode == RECREATE
    assert plan(d, exists=True, usage_mem_bytes=None, host_cores=8, settings=s).command.update_mode == "in-place"
