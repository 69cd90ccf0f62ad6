"""A ``scale`` decision on the Kubernetes backend, at its HTTP boundary: the actuator verifies the service's
signed spec and PATCHes its Deployment's ``scale`` subresource (recorded answers replayed by a local server)."""

from __future__ import annotations

import time
import uuid

from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends.kubernetes import KubeApi, KubernetesBackend
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.records import Decision, JobService, encode
from phasewise.kit.settings import Settings
from tests.actuators.backends.kubernetes.test_backend import serve  # noqa: F401 - the fixture
from tests.actuators.conftest import Recorder
from tests.job_keys import TRUSTED
from tests.job_keys import start as signed_start

PATH = "/apis/apps/v1/namespaces/serving/deployments/llm-server/scale"


def scale(job: str, replicas: int, **svc) -> bytes:
    start = signed_start(job, ("/srv/serve",), workload="inference", ts=time.time() - 1,
                         service=JobService(port=20000, **svc))
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="gpu-node-3", container=job, action="scale",
                           policy="autoscaler", details={**start, "replicas": replicas, "rule": "slo"}))


def actuator(url: str) -> tuple[Actuator, Recorder]:
    rec = Recorder()
    backend = KubernetesBackend(KubeApi(url, token="tok-1"), lambda c: None)
    s = Settings().replace(host="gpu-node-3", actuator_max_replicas=8)
    return Actuator(s, backend, Ledger(":memory:"), rec, submitters=TRUSTED,
                    metrics=ActuatorMetrics(CollectorRegistry()), host_cores=8.0), rec


def test_a_scale_decision_patches_the_deployments_scale_subresource(serve):  # noqa: F811
    r = serve(("PATCH", PATH, 200, "scale-200.json"), ("PATCH", PATH, 200, "scale-200.json"))
    act, rec = actuator(r.url)
    a = act.handle(scale("llm", 3, deployment="serving/llm-server"), None, 0, 1)
    assert a.status == "applied" and "deployment serving/llm-server scaled to 3 replicas" in a.message, a.message
    assert r.seen[0]["type"] == "application/merge-patch+json" and r.seen[0]["body"] == {"spec": {"replicas": 3}}
    assert r.seen[0]["auth"] == "Bearer tok-1"
    # beyond the signed spec's max_replicas: clamped, the rule named, the clamped number sent
    a = act.handle(scale("llm", 12, deployment="serving/llm-server", max_replicas=5), None, 0, 2)
    assert a.status == "clamped" and "replicas 12 lowered to its signed spec's service.max_replicas (5)" in a.message
    assert r.seen[1]["body"] == {"spec": {"replicas": 5}}
    assert [x.decision_id for x in rec.actuations()] and len(rec.actuations()) == 2  # audited as every decision
    # each a scaled state: the count the API answered (the recorded response says 3), the most, no host (the
    # Deployment's pods are placed by Kubernetes)
    evs = [e for e in rec.job_events("llm") if e.kind == "scaled"]
    assert [(e.replicas, e.max_replicas, e.host) for e in evs] == [(3, 8, None), (3, 5, None)]
    assert evs[1].reason == "replicas 12 lowered to its signed spec's service.max_replicas (5)"


def test_a_throttled_patch_is_retried_and_a_service_without_a_deployment_is_refused(serve):  # noqa: F811
    r = serve(("PATCH", PATH, 429, "status-429-pdb.json", {"Retry-After": "0"}), ("PATCH", PATH, 200, "scale-200.json"))
    act, _ = actuator(r.url)
    act.sleep = lambda s: None
    a = act.handle(scale("llm", 3, deployment="serving/llm-server"), None, 0, 1)
    assert a.status == "applied" and len(r.seen) == 2, a.message
    a = act.handle(scale("llm", 3), None, 0, 2)
    assert a.status == "rejected" and "names no Kubernetes Deployment" in a.message
    assert len(r.seen) == 2  # nothing sent
