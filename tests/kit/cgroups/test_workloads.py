"""Layout paths, the kubelet's pod list (file and HTTP), the policy file, and Workloads' bookkeeping."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from pathlib import Path

import pytest

from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.cgroups.layouts import classify, classify_proc_cgroup
from phasewise.kit.cgroups.workloads import PodList, Workloads, load_policy_file, parse_pod_list, read_pods
from phasewise.models.safety.workload import WorkloadError

PODS = Path(__file__).resolve().parents[2] / "data" / "kubelet_pods.json"
ID = "0123456789abcdef" * 4
UID = "0d5a4c52-1f37-4a8e-b8a5-7c7f1f3a9d01"
UID_ = UID.replace("-", "_")


@pytest.mark.parametrize("rel, want", [
    (f"kubepods/pod{UID}/{ID}", ("kubepods-cgroupfs", "guaranteed", UID, None)),
    (f"kubepods/besteffort/pod{UID}/{ID}", ("kubepods-cgroupfs", "besteffort", UID, None)),
    (f"kubepods/burstable/pod{UID}/{ID}/sub", ("kubepods-cgroupfs", "burstable", UID, None)),
    (f"kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope", ("kubepods-systemd", "guaranteed", UID, "cri-o")),
    (f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{ID}.scope",
     ("kubepods-systemd", "burstable", UID, "docker")),
    (f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{ID}.scope/x",
     ("kubepods-systemd", "besteffort", UID, "containerd")),
    (f"docker/{ID}", ("docker-cgroupfs", None, None, "docker")),
    (f"system.slice/docker-{ID}.scope", ("docker-systemd", None, None, "docker")),
])
def test_container_paths_are_classified(rel, want):
    m = classify(rel)
    assert (m.layout, m.qos, m.pod_uid, m.runtime) == want
    assert m.container_id == ID
    assert rel.startswith(m.rel) and m.rel.rstrip(".scope").endswith(ID)


@pytest.mark.parametrize("rel", [
    f"kubepods/burstable/pod{UID}",  # the pod, not a container
    f"kubepods/gold/pod{UID}/{ID}",  # no such QoS class
    f"kubepods/burstable/pod{UID}/{ID[:12]}",  # not a full id
    f"kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{UID_}.slice/crio-{ID}.scope",  # mixed QoS
    f"kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{ID}.scope",  # CRI-O's monitor
    f"kubepods.slice/kubepods-pod{UID_}.slice/rkt-{ID}.scope",
    "system.slice/containerd.service",
    f"system.slice/docker-{ID}.mount",
    "docker/buildkit",
    f"user.slice/docker-{ID}.scope",
])
def test_other_cgroups_are_not_containers(rel):
    assert classify(rel) is None


def test_proc_cgroup_lines_name_the_container_for_gpu_attribution():
    v2 = f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope\n"
    assert classify_proc_cgroup(v2) == ID
    v1 = f"12:memory:/k8s/kubepods/burstable/pod{UID}/{ID}\n11:cpu,cpuacct:/k8s/kubepods/burstable/pod{UID}/{ID}\n"
    assert classify_proc_cgroup(v1, parent="k8s") == ID
    assert classify_proc_cgroup(v1) is None  # under another parent than the one configured
    assert classify_proc_cgroup(v2, layouts=("docker-systemd",)) is None


def test_a_bad_layout_or_parent_is_refused(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    with pytest.raises(CgroupError, match="cgroup layout must be one of"):
        CgroupLayout(tmp_path, layout="k8s")
    with pytest.raises(CgroupError, match="invalid cgroup parent"):
        CgroupLayout(tmp_path, layout="auto", parent="../etc")


# --------------------------------------------------------------------------- the pod list


def test_the_kubelets_pod_list_is_read():
    pods = read_pods(str(PODS))
    assert len(pods.pods) == 4
    train = pods.pods[UID]
    assert (train.namespace, train.name, train.qos) == ("ml", "train-0", "burstable")
    assert train.containers["1" * 64] == ("trainer", "containerd")
    assert train.annotations["phasewise.io/mode"] == "apply"
    assert pods.by_container["4" * 64] == "9e8d7c6b-5a49-4382-b716-a5f4e3d2c103"
    assert pods.pods[pods.by_container["4" * 64]].containers["4" * 64][1] == "cri-o"


@pytest.mark.parametrize("doc", [[], {"kind": "PodList"}, {"items": {}}, "x", None])
def test_what_is_not_a_pod_list_is_refused(doc):
    with pytest.raises(ValueError, match="not a pod list"):
        parse_pod_list(doc)


def test_odd_pods_and_statuses_are_taken_as_far_as_they_go():
    doc = {"items": [None, {"metadata": {}}, {"metadata": {"uid": "u1", "annotations": "x"},
                                              "status": {"containerStatuses": [
                                                  {"name": "a"}, {"containerID": "nourl"},
                                                  {"containerID": "containerd://" + ID, "name": 5},
                                                  "junk"], "qosClass": "Gold"}}]}
    pods = parse_pod_list(doc)
    assert list(pods.pods) == ["u1"]
    p = pods.pods["u1"]
    assert p.containers == {ID: (None, "containerd")} and p.annotations == {} and p.qos is None


class _Kubelet(http.server.BaseHTTPRequestHandler):
    body = PODS.read_bytes()
    seen: list = []

    def do_GET(self):  # noqa: N802
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        if self.path != "/pods":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


@pytest.fixture
def kubelet():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Kubelet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Kubelet.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_the_pod_list_is_read_over_http_with_the_token(kubelet, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    pods = read_pods(kubelet + "/pods", token_file=str(tok))
    assert len(pods.pods) == 4
    assert _Kubelet.seen == [("/pods", "Bearer s3cret")]
    with pytest.raises(OSError):
        read_pods(kubelet + "/nope")


def test_an_unreadable_pod_list_keeps_the_last_one_and_says_so_once(tmp_path, caplog):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    layout = CgroupLayout(tmp_path, layout="auto")
    calls = []

    def pods() -> PodList:
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionRefusedError("kubelet down")
        return read_pods(str(PODS))

    t = [0.0]
    w = Workloads(layout, pods=pods, refresh_s=10, monotonic=lambda: t[0])
    w._refresh()
    with caplog.at_level(logging.WARNING, logger="phasewise.kit.cgroups.workloads"):
        for step in (11, 22, 33):
            t[0] = step
            w._refresh()
    assert len(calls) == 4
    assert len(w._pods.pods) == 4  # the last good list
    assert sum("cannot read the kubelet's pod list" in r.message for r in caplog.records) == 1


# --------------------------------------------------------------------------- the policy file


def test_the_policy_file_is_read_and_a_bad_one_is_one_line(tmp_path):
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"workloads": [{"match": "job-*", "mode": "recommend"}]}))
    assert load_policy_file(str(good))[0].settings.mode == "recommend"
    bad = tmp_path / "bad.json"
    bad.write_text('{"workloads": [{"match": "x", "mode": "apply", "cpu-max": "lots"}]}')
    with pytest.raises(WorkloadError) as e:
        load_policy_file(str(bad))
    assert str(e.value).startswith(f"{bad}: policy file: workloads[0] (x): cpu-max: 'lots' is not a quantity")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_policy_file(str(broken))
    with pytest.raises(WorkloadError, match="No such file"):
        load_policy_file(str(tmp_path / "missing.json"))


# --------------------------------------------------------------------------- Docker's records


def _docker_record(d: Path, cid: str, name: str, labels: dict) -> None:
    (d / cid).mkdir(parents=True)
    (d / cid / "config.v2.json").write_text(json.dumps({
        "ID": cid, "Created": "2026-11-20T09:12:03.118765432Z", "Path": "python", "Args": ["serve.py"],
        "Name": "/" + name, "Driver": "overlay2",
        "Config": {"Hostname": cid[:12], "Image": "registry.example/web:1.0", "Labels": labels},
        "State": {"Running": True, "Pid": 4242}}))


def test_docker_names_and_kubernetes_labels_identify_containers_and_sandboxes(tmp_path):
    root = tmp_path / "cgroup"
    (root / "system.slice" / f"docker-{ID}.scope").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    sandbox = "5a" * 32
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    (root / pod / f"docker-{sandbox}.scope").mkdir(parents=True)
    app = "6b" * 32
    (root / pod / f"docker-{app}.scope").mkdir(parents=True)
    docker = tmp_path / "containers"
    _docker_record(docker, ID, "web-frontend", {"com.example.team": "ml"})
    k8s = {"io.kubernetes.pod.name": "train-9", "io.kubernetes.pod.namespace": "ml", "io.kubernetes.pod.uid": UID}
    _docker_record(docker, sandbox, "k8s_POD_train-9_ml_x_0", {**k8s, "io.kubernetes.docker.type": "podsandbox"})
    _docker_record(docker, app, "k8s_trainer_train-9_ml_x_0",
                   {**k8s, "io.kubernetes.docker.type": "container", "io.kubernetes.container.name": "trainer"})
    rules = (tmp_path / "p.json")
    rules.write_text(json.dumps({"workloads": [{"match": "web-*", "mode": "recommend"}]}))
    layout = CgroupLayout(root, layout="auto")
    w = Workloads(layout, rules=load_policy_file(str(rules)), docker_dir=str(docker), proc_root=str(tmp_path))
    assert sorted(layout.containers()) == sorted([ID, sandbox, app])
    ident, policy = w.describe(ID)
    assert (ident.layout, ident.container_name, ident.runtime) == ("docker-systemd", "web-frontend", "docker")
    assert (policy.mode, policy.source) == ("recommend", "policy-file")  # matched by its Docker name
    assert w.describe(sandbox) is None
    ident, policy = w.describe(app)
    assert (ident.pod_namespace, ident.pod_name, ident.container_name, ident.qos) == ("ml", "train-9", "trainer",
                                                                                      "burstable")
    assert policy.mode == "off"  # a runtime's container without settings: the auto default


@pytest.fixture
def api_server(tmp_path):
    """An https server on 127.0.0.1 with a certificate signed by a CA of the test's own (openssl)."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.crt",
        "-days", "1", "-extfile", "ext")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "srv.crt", tmp_path / "srv.key")
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _ApiServer.seen = []
    yield f"https://127.0.0.1:{srv.server_address[1]}", str(tmp_path / "ca.crt")
    srv.shutdown()
    srv.server_close()


class _ApiServer(_Kubelet):
    def do_GET(self):  # noqa: N802
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        if self.path != "/api/v1/pods?fieldSelector=spec.nodeName=gpu-node-1":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


def test_the_pods_of_this_node_are_read_from_the_api_server_over_tls(api_server, tmp_path):
    url, ca = api_server
    tok = tmp_path / "sa-token"
    tok.write_text("eyJhbGciOi.test\n")
    pods = read_pods(url + "/api/v1/pods?fieldSelector=spec.nodeName=gpu-node-1", token_file=str(tok), ca_file=ca)
    assert len(pods.pods) == 4
    assert _ApiServer.seen[-1][1] == "Bearer eyJhbGciOi.test"
    with pytest.raises(OSError):  # without the CA the certificate is not trusted
        read_pods(url + "/api/v1/pods?fieldSelector=spec.nodeName=gpu-node-1")
