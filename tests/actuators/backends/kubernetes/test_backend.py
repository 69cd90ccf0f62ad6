"""The Kubernetes backend at its HTTP boundary: a local server on 127.0.0.1 replays recorded answers.

Each answer body is a fixture in ``fixtures/kubernetes/`` shaped as the API
server sends it (Pod, PodList, PodMetrics, Scale, Status); the server checks
the method, path, content type and body of every request it receives.
"""

from __future__ import annotations

import json
import subprocess
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from phasewise.actuators.backends import Backend
from phasewise.actuators.backends.kubernetes import (
    ApiError,
    KubeApi,
    KubernetesBackend,
    PodContainer,
    PodDirectory,
    plan_resize,
)
from phasewise.actuators.commands import Bind, Evict, Freeze, Scale, SetLimits, Terminate
from tests.actuators.backends.kubernetes.apiserver import Loopback, serving
from tests.conftest import requires_root

FIX = Path(__file__).parents[2] / "fixtures" / "kubernetes"
CID = "3f1c2a9e8b7d6c5f4e3d2c1b0a99887766554433221100ffeeddccbbaa998877"
MANAGED = f"cri-containerd-{CID}.scope"
POD = "/api/v1/namespaces/ml/pods/trainer-7c9d5b8f6d-x2x9q"
METRICS = "/apis/metrics.k8s.io/v1beta1/namespaces/ml/pods/trainer-7c9d5b8f6d-x2x9q"


def fx(name: str) -> dict:
    return json.loads((FIX / name).read_text())


class Replay(Loopback):
    """Answers requests from a script of ``(method, path, status, fixture, headers)``, in order."""

    def __init__(self, script: list[tuple]) -> None:
        self.script = list(script)
        self.seen: list[dict] = []
        replay = self

        class H(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                replay.seen.append({"method": self.command, "path": self.path, "body": body,
                                    "type": self.headers.get("Content-Type"),
                                    "auth": self.headers.get("Authorization")})
                if not replay.script:
                    self.send_error(599, "unexpected request")
                    return
                method, path, status, fixture, headers = (*replay.script.pop(0), {})[:5]
                if (self.command, self.path) != (method, path):
                    self.send_error(598, f"expected {method} {path}")
                    return
                raw = (FIX / fixture).read_bytes() if fixture else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_PATCH = do_DELETE = _answer

            def log_message(self, *a) -> None:
                pass

        self._serve(H)


@pytest.fixture
def serve():
    yield from serving(Replay)


def backend(r: Replay, token: str = "tok-1") -> KubernetesBackend:
    api = KubeApi(r.url, token=token)
    return KubernetesBackend(api, PodDirectory(api, "gpu-node-3"))


LIST = ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-3&resourceVersion=0", 200, "pods-on-node.json")


def test_is_a_backend_and_acts_only_on_containers_present_on_the_node():
    assert isinstance(KubernetesBackend(KubeApi("http://127.0.0.1:1"), lambda c: None), Backend)
    listed = KubernetesBackend(KubeApi("http://127.0.0.1:1"), lambda c: PodContainer("ml", "p", "c"),
                               present=lambda c: c == "here")
    assert listed.exists("here") and not listed.exists("elsewhere")


def test_resize_guaranteed_keeps_requests_equal_limits(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-guaranteed.json"), ("GET", METRICS, 200, "podmetrics.json"),
              ("PATCH", POD + "/resize", 200, "resize-200.json"))
    out = backend(r).apply(SetLimits(MANAGED, cpu_cores=1.5, mem_bytes=3 * 2**30))
    assert out.status == "applied", out
    assert (out.cpu_cores, out.mem_bytes) == (1.5, 3 * 2**30)
    patch = r.seen[-1]
    assert patch["type"] == "application/strategic-merge-patch+json"
    assert patch["auth"] == "Bearer tok-1"
    assert patch["body"] == {"spec": {"containers": [{"name": "worker", "resources": {
        "requests": {"cpu": "1500m", "memory": str(3 * 2**30)},
        "limits": {"cpu": "1500m", "memory": str(3 * 2**30)}}}]}}
    assert not r.script


def test_resize_burstable_moves_limit_and_only_a_request_above_it(serve):
    pod = fx("pod-burstable.json")
    plan = plan_resize(pod, "worker", cpu_cores=0.25, mem_bytes=2 * 2**30)
    assert plan.patch == {"spec": {"containers": [{"name": "worker", "resources": {
        "requests": {"cpu": "250m"}, "limits": {"cpu": "250m", "memory": str(2 * 2**30)}}}]}}


def test_besteffort_is_refused_without_a_request(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-besteffort.json"))
    out = backend(r).apply(SetLimits(MANAGED, cpu_cores=1.0))
    assert out.status == "failed" and not out.temporary and "BestEffort" in out.message
    assert [s["method"] for s in r.seen] == ["GET", "GET"]  # nothing patched


def test_memory_never_decreased_below_working_set(serve):
    # podmetrics says 2621440Ki (2.5 GiB) in use: a 2 GiB limit would be left in progress by the kubelet
    r = serve(LIST, ("GET", POD, 200, "pod-guaranteed.json"), ("GET", METRICS, 200, "podmetrics.json"))
    out = backend(r).apply(SetLimits(MANAGED, mem_bytes=2 * 2**30))
    assert out.status == "failed" and "working set" in out.message
    assert all(s["method"] == "GET" for s in r.seen)


@pytest.mark.parametrize("fixture,temporary,word", [
    ("pod-deferred.json", True, "deferred"),
    ("pod-inprogress.json", True, "in progress"),
    ("pod-infeasible.json", False, "Infeasible"),
])
def test_resize_conditions(serve, fixture, temporary, word):
    r = serve(LIST, ("GET", POD, 200, fixture))
    out = backend(r).apply(SetLimits(MANAGED, cpu_cores=80.0))
    assert out.status == "failed" and out.temporary is temporary and word in out.message, out
    assert all(s["method"] == "GET" for s in r.seen)


@pytest.mark.parametrize("status,fixture,temporary,text", [
    (409, "status-409-conflict.json", True, "object has been modified"),
    (422, "status-422-qos.json", False, "QOS Class may not change"),
    (404, "status-404-pod.json", False, "not found"),
    (403, "status-403-forbidden.json", False, "pods/resize"),
])
def test_resize_errors_carry_status_message(serve, status, fixture, temporary, text):
    r = serve(LIST, ("GET", POD, 200, "pod-guaranteed.json"), ("PATCH", POD + "/resize", status, fixture))
    out = backend(r).apply(SetLimits(MANAGED, cpu_cores=1.5))
    assert out.status == "failed" and out.temporary is temporary and f"HTTP {status}" in out.message
    assert text in out.message


def test_pod_gone_and_unknown_container(serve):
    r = serve(LIST, ("GET", POD, 404, "status-404-pod.json"))
    assert backend(r).apply(SetLimits(MANAGED, cpu_cores=1.0)).status == "failed"
    r2 = serve(LIST, LIST)
    now = [0.0]
    api = KubeApi(r2.url)
    b = KubernetesBackend(api, PodDirectory(api, "gpu-node-3", clock=lambda: now[0]))
    gone = "cri-containerd-" + "0" * 64 + ".scope"
    assert not b.exists(gone)
    assert b.exists(MANAGED) is True and not b.exists(gone)  # from the cache
    assert len(r2.seen) == 1
    now[0] = 2.0  # a miss on a list older than miss_refresh_s lists again
    assert not b.exists(gone) and len(r2.seen) == 2
    assert not b.exists("not-a-container-id") and len(r2.seen) == 2


def test_evict_created_and_disruption_budget(serve):
    r = serve(LIST, ("POST", POD + "/eviction", 201, "status-201-success.json"),
              ("POST", POD + "/eviction", 429, "status-429-pdb.json"))
    b = backend(r)
    assert b.apply(Evict(MANAGED, grace_period_s=30)).status == "applied"
    assert r.seen[-1]["body"] == {"apiVersion": "policy/v1", "kind": "Eviction",
                                  "metadata": {"name": "trainer-7c9d5b8f6d-x2x9q", "namespace": "ml"},
                                  "deleteOptions": {"gracePeriodSeconds": 30}}
    out = b.apply(Evict(MANAGED))
    assert out.status == "failed" and out.temporary and "disruption budget" in out.message


def test_terminate_deletes_the_pod_holding_the_container_with_its_grace_and_uid(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-guaranteed.json"), ("DELETE", POD, 200, "pod-terminating.json"))
    b = backend(r)
    out = b.apply(Terminate(MANAGED, grace_s=12.4))
    assert out.status == "applied", out
    assert list(b.deleted) == ["6a1f7b2c-3d4e-4f50-9a6b-7c8d9e0f1a2b"]  # its end is ``terminated`` (pod watch)
    assert r.seen[-1]["body"] == {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 13,
                                  "preconditions": {"uid": "6a1f7b2c-3d4e-4f50-9a6b-7c8d9e0f1a2b"}}
    assert r.seen[-1]["type"] == "application/json"
    assert out.message == ("deleted pod ml/trainer-7c9d5b8f6d-x2x9q uid 6a1f7b2c-3d4e-4f50-9a6b-7c8d9e0f1a2b "
                           "(terminating since 2026-11-24T10:02:41Z): the kubelet sends SIGTERM, then SIGKILL after "
                           "13 s; its controller ReplicaSet/trainer-7c9d5b8f6d may start a new pod")
    assert not r.script


def test_terminate_never_deletes_twice_nor_another_pod(serve):
    r = serve(LIST, ("GET", POD, 200, "pod-terminating.json"),  # already terminating: no DELETE
              ("GET", POD, 200, "pod-recreated.json"),  # a new pod under the name: no DELETE
              ("GET", POD, 200, "pod-guaranteed.json"), ("DELETE", POD, 409, "status-409-precondition.json"),
              ("GET", POD, 404, "status-404-pod.json"))
    b = backend(r)
    out = b.apply(Terminate(MANAGED, grace_s=0))
    assert out.status == "applied" and "already terminating" in out.message and "not deleted again" in out.message
    out = b.apply(Terminate(MANAGED, grace_s=0))
    assert out.status == "failed" and "does not hold container 3f1c2a9e8b7d" in out.message, out
    out = b.apply(Terminate(MANAGED, grace_s=0))  # replaced between the GET and the DELETE: the uid says so
    assert out.status == "failed" and not out.temporary and "not the pod that held the container" in out.message
    assert r.seen[4]["body"]["gracePeriodSeconds"] == 0
    out = b.apply(Terminate(MANAGED, grace_s=5))
    assert out.status == "applied" and "gone already" in out.message
    assert [s["method"] for s in r.seen].count("DELETE") == 1 and not r.script
    assert b.deleted == {}  # no pod deleted: no end taken for a terminate decision's


def test_bind_and_already_bound(serve):
    path = "/api/v1/namespaces/default/pods/job-42/binding"
    r = serve(("POST", path, 201, "status-201-success.json"), ("POST", path, 409, "status-409-bound.json"))
    b = backend(r)
    assert b.apply(Bind("job-42", "gpu-node-3")).status == "applied"
    assert r.seen[0]["body"]["target"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-3"}
    out = b.apply(Bind("job-42", "gpu-node-3"))
    assert out.status == "failed" and "already assigned" in out.message


def test_a_jobs_bind_checks_the_pod_names_the_job_and_is_not_bound_elsewhere(serve):
    pod = "/api/v1/namespaces/ml/pods/train-b"
    r = serve(("GET", pod, 200, "pod-pending-job.json"), ("POST", pod + "/binding", 201, "status-201-success.json"),
              ("GET", pod, 200, "pod-pending-job.json"), ("GET", pod, 404, "status-404-pod.json"))
    b = backend(r)
    out = b.apply(Bind("train-b", "gpu-node-3", "ml", job="job-b"))
    assert out.status == "applied" and r.seen[1]["body"]["target"]["name"] == "gpu-node-3", out
    out = b.apply(Bind("train-b", "gpu-node-3", "ml", job="job-x"))  # the pod names another job: no request
    assert out.status == "rejected" and "names job 'job-b'" in out.message and len(r.seen) == 3
    out = b.apply(Bind("train-b", "gpu-node-3", "ml", job="job-b"))
    assert out.status == "rejected" and "does not exist" in out.message


def test_scale_and_throttled(serve):
    path = "/apis/apps/v1/namespaces/serving/deployments/llm-server/scale"
    r = serve(("PATCH", path, 200, "scale-200.json"), ("PATCH", path, 429, "status-429-pdb.json", {"Retry-After": "2"}))
    b = backend(r)
    out = b.apply(Scale("llm-server", 3, namespace="serving"))
    assert out.status == "applied" and "3 replicas" in out.message
    assert r.seen[0]["type"] == "application/merge-patch+json" and r.seen[0]["body"] == {"spec": {"replicas": 3}}
    api = KubeApi(r.url)
    with pytest.raises(ApiError) as e:
        api.request("PATCH", path, {"spec": {"replicas": 3}})
    assert e.value.status == 429 and e.value.retry_after_s == 2.0 and e.value.temporary


def test_freeze_is_not_possible_and_unreachable_is_temporary():
    b = KubernetesBackend(KubeApi("http://127.0.0.1:9", timeout_s=0.5), lambda c: PodContainer("ml", "p", "c"))
    assert "cannot freeze" in b.apply(Freeze("x")).message
    out = b.apply(SetLimits("x", cpu_cores=1.0))
    assert out.status == "failed" and out.temporary


def test_the_client_turns_every_failure_into_an_api_error_for_requests_and_watches(serve, tmp_path):
    """An error answer (its Status), no answer, an unreadable token and an answer that is not JSON: each an
    ApiError with the status (0: no answer), for a request and for a watch alike."""
    r = serve(("GET", POD, 403, "status-403-forbidden.json"), ("GET", "/w", 403, "status-403-forbidden.json"),
              ("GET", POD, 200, "watch-jobs.ndjson"))
    api = KubeApi(r.url, token="t")
    for call in (lambda a: a.request("GET", POD), lambda a: list(a.stream("/w", read_timeout_s=5))):
        with pytest.raises(ApiError) as e:
            call(api)
        assert e.value.status == 403 and e.value.reason == "Forbidden" and not e.value.temporary
        with pytest.raises(ApiError) as e:
            call(KubeApi("http://127.0.0.1:9", timeout_s=0.5))
        assert e.value.status == 0 and e.value.reason == "Unreachable" and e.value.temporary
        with pytest.raises(ApiError) as e:
            call(KubeApi(r.url, token_file=tmp_path / "no-token"))
        assert e.value.reason == "TokenUnreadable" and "cannot read the service account token" in str(e.value)
    with pytest.raises(ApiError) as e:  # a watch stream is lines of JSON, not one JSON answer
        api.request("GET", POD)
    assert e.value.reason == "BadAnswer"
    assert [s["path"] for s in r.seen] == [POD, "/w", POD]  # the unreadable token sent nothing


def test_memory_usage_from_metrics_api(serve):
    r = serve(LIST, ("GET", METRICS, 200, "podmetrics.json"))
    assert backend(r).memory_usage(MANAGED) == 2.5 * 2**30


def test_in_cluster_config_rereads_rotated_token_and_verifies_tls(tmp_path):
    """TLS against a local server whose certificate the service account's CA bundle signs."""
    key, crt = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "ca.crt").write_bytes(crt.read_bytes())
    (sa / "token").write_text("first\n")
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        KubeApi.in_cluster(sa, env={})
    import ssl

    r = Replay([("GET", POD, 200, "pod-guaranteed.json"), ("GET", POD, 200, "pod-guaranteed.json")])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    r.server.socket = ctx.wrap_socket(r.server.socket, server_side=True)
    try:
        port = r.server.server_address[1]
        api = KubeApi.in_cluster(sa, env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)})
        assert api.request("GET", POD)["metadata"]["namespace"] == "ml"
        (sa / "token").write_text("second\n")
        api.request("GET", POD)
        assert [s["auth"] for s in r.seen] == ["Bearer first", "Bearer second"]
        with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED"):  # without the CA: refused
            KubeApi(f"https://127.0.0.1:{port}").request("GET", POD)
    finally:
        r.close()


def test_actuate_outside_a_cluster_is_a_one_line_error(tmp_path):
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "PHASEWISE_"))}
    p = subprocess.run([sys.executable, "-m", "phasewise.cli", "actuate", "--backend", "kubernetes",
                        "--data-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == ["phasewise actuate: error: kube_api: not in a cluster: "
                                             "KUBERNETES_SERVICE_HOST is not set"]


def test_the_actuator_resizes_through_the_backend(serve, recorder):
    """A decision for a pod's container id: managed name, memory floor from metrics.k8s.io, resize."""
    import time
    import uuid

    from prometheus_client import CollectorRegistry

    from phasewise.actuators.actuator import Actuator
    from phasewise.actuators.ledger import Ledger
    from phasewise.actuators.metrics import ActuatorMetrics
    from phasewise.kit.records import Decision, encode
    from phasewise.kit.settings import Settings

    r = serve(LIST, ("GET", METRICS, 200, "podmetrics.json"), ("GET", POD, 200, "pod-guaranteed.json"),
              ("GET", METRICS, 200, "podmetrics.json"), ("PATCH", POD + "/resize", 200, "resize-200.json"))
    a = Actuator(Settings().replace(host="gpu-node-3"), backend(r), Ledger(":memory:"), recorder,
                 metrics=ActuatorMetrics(CollectorRegistry()), host_cores=16.0, clock=time.time)
    d = Decision(id=uuid.uuid4().hex, ts=time.time(), host="gpu-node-3", container=CID, action="limit", policy="vpa",
                 reason="test", cpu_limit_cores=1.5, mem_limit_bytes=3 * 2**30)
    act = a.handle(encode(d), b"gpu-node-3", 0, 0)
    assert act.status == "applied", act.message
    assert act.backend == "kubernetes" and act.cpu_limit_cores == 1.5 and act.mem_limit_bytes == 3 * 2**30
    assert r.seen[-1]["method"] == "PATCH" and not r.script


@requires_root
def test_recommend_is_never_resized_apply_is_unannotated_ignored(serve, tmp_path):
    """On a real cgroup tree (the kubepods systemd layout) with the kubelet's pod list: only the pod
    annotated apply gets a resize request; recommend and unannotated pods get no request at all."""
    import copy
    import time

    from prometheus_client import CollectorRegistry

    from phasewise.actuators.actuator import Actuator
    from phasewise.actuators.ledger import Ledger
    from phasewise.actuators.metrics import ActuatorMetrics
    from phasewise.kit.cgroups.fs import CgroupLayout
    from phasewise.kit.cgroups.workloads import Workloads, read_pods
    from phasewise.kit.records import Decision, encode
    from phasewise.kit.settings import Settings
    from tests.actuators.conftest import Recorder
    from tests.producers.test_layouts_real import PODS, C, RealTree, tree_paths

    pods = json.loads(PODS.read_text())
    train = next(p for p in pods["items"] if p["metadata"]["name"] == "train-0")
    pod = {"kind": "Pod", "apiVersion": "v1", **copy.deepcopy(train)}
    pod["spec"]["containers"][0]["resources"]["limits"] = {"cpu": "2", "memory": "2Gi"}
    (tmp_path / "pod.json").write_text(json.dumps(pod))
    resized = copy.deepcopy(pod)
    resized["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "500m", "memory": "536870912"},
                                                     "limits": {"cpu": "1", "memory": "536870912"}}
    (tmp_path / "resized.json").write_text(json.dumps(resized))
    metrics = fx("podmetrics.json")
    metrics["metadata"].update(name="train-0", namespace="ml")
    metrics["containers"] = [{"name": "trainer", "usage": {"cpu": "412m", "memory": "300Mi"}},
                             {"name": "logger", "usage": {"cpu": "3m", "memory": "20Mi"}}]
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    pod_path = "/api/v1/namespaces/ml/pods/train-0"
    metrics_path = "/apis/metrics.k8s.io/v1beta1/namespaces/ml/pods/train-0"
    r = serve(("GET", LIST[1], 200, str(PODS)), ("GET", metrics_path, 200, str(tmp_path / "metrics.json")),
              ("GET", pod_path, 200, str(tmp_path / "pod.json")),
              ("GET", metrics_path, 200, str(tmp_path / "metrics.json")),
              ("PATCH", pod_path + "/resize", 200, str(tmp_path / "resized.json")))
    tree = RealTree(tmp_path)
    try:
        for rel in tree_paths("systemd").values():
            tree.add(f"{tree.parent}/{rel}")
        tree.add(f"{tree.prefix}/job-a")
        layout = CgroupLayout("/sys/fs/cgroup", tree.prefix, layout="auto", parent=tree.parent)
        workloads = Workloads(layout, pods=lambda: read_pods(str(PODS)))
        rec = Recorder()
        api = KubeApi(r.url)
        kube = KubernetesBackend(api, PodDirectory(api, "gpu-node-3"), present=layout.exists)
        act = Actuator(Settings().replace(host="gpu-node-3", mem_margin_bytes=0), kube, Ledger(":memory:"),
                       rec, metrics=ActuatorMetrics(CollectorRegistry()), host_cores=8, clock=time.time,
                       workloads=workloads)
        for i, cid in enumerate((C["1"], C["3"], C["4"])):
            d = Decision(id=f"k{i}", ts=time.time(), host="gpu-node-3", container=cid, action="limit", policy="vpa",
                         reason="test", cpu_limit_cores=1.0, mem_limit_bytes=512 * 2**20)
            act.handle(encode(d), None, 0, i)
    finally:
        tree.close()
    by = {a.container: a for a in rec.actuations()}
    assert by[C["1"]].status == "applied" and by[C["1"]].backend == "kubernetes", by[C["1"]].message
    assert r.seen[-1]["body"] == {"spec": {"containers": [{"name": "trainer", "resources": {
        "requests": {"memory": "536870912"}, "limits": {"cpu": "1000m", "memory": "536870912"}}}]}}
    assert by[C["3"]].status == "rejected" and "recommend mode (from annotation)" in by[C["3"]].message
    assert by[C["4"]].status == "rejected" and "not opted in (mode off" in by[C["4"]].message
    assert [s["method"] for s in r.seen] == ["GET", "GET", "GET", "GET", "PATCH"] and not r.script
