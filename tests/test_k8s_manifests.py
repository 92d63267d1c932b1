"""deploy/kubernetes/ checked offline: every object against the Kubernetes API schemas (kubernetes-validate,
strict: an unknown or misspelt field fails), and what gem-node needs from its manifests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from gemini.k8s import devices as dv  # noqa: E402
from gemini.k8s.nodeconfig import parse_node_config  # noqa: E402

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted(p for p in (DEPLOY / "kubernetes").glob("*.yaml") if p.name != "kustomization.yaml")
# the oldest and newest releases gem-node is meant for (PodResources Get is beta from 1.28; device plugins v1beta1)
VERSIONS = ["1.30.0", "1.35.0"]


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in MANIFESTS:
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.name}#{i}", doc))
    return out


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in documents() if d["kind"] == kind]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,doc", documents(), ids=[n for n, _ in documents()])
def test_every_object_is_valid_against_the_api_schema(name, doc, version):
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name} is not a valid {doc.get('kind')} for Kubernetes {version}: {exc.message} at "
                    f"{'/'.join(str(p) for p in exc.path)}")


def test_kustomization_lists_every_install_manifest():
    kust = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    installed = {p.name for p in MANIFESTS} - {"sample-pod.yaml"}
    assert set(kust["resources"]) == installed


def test_rbac_is_least_privilege():
    (role,) = by_kind("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = by_kind("ClusterRoleBinding")
    (account,) = by_kind("ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert not by_kind("Role") and not by_kind("RoleBinding")


def test_daemonset_has_what_gem_node_needs():
    (ds,) = by_kind("DaemonSet")
    (configmap,) = by_kind("ConfigMap")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True                                   # /proc/<pid>/cgroup of other pods' processes
    assert spec["nodeSelector"] == {"gemini.io/enabled": "true"}
    assert spec["serviceAccountName"] == by_kind("ServiceAccount")[0]["metadata"]["name"]
    (c,) = spec["containers"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert host["device-plugins"] == mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert host["pod-resources"] == mounts["pod-resources"] == "/var/lib/kubelet/pod-resources"
    # the host directory of Allocate's mounts is the same path inside gem-node, so the paths it hands the
    # kubelet are host paths
    assert host["gemini"] == mounts["gemini"] == "/var/lib/gemini"
    assert c["args"][c["args"].index("--root") + 1] == "/var/lib/gemini"
    # the board pages, the same way: a host path on the host's /run (a tmpfs)
    assert host["board"] == mounts["board"] == c["args"][c["args"].index("--board-root") + 1] == "/run/gemini/board"
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    port = int(annotations["prometheus.io/port"])
    assert annotations["prometheus.io/scrape"] == "true"
    assert port in [p["containerPort"] for p in c["ports"]]
    node_yaml = yaml.safe_load(configmap["data"]["node.yaml"])
    cfg = parse_node_config(node_yaml, "configmap node.yaml")      # gem-node would accept it
    assert cfg.metrics_port == port
    assert any(v.get("configMap", {}).get("name") == configmap["metadata"]["name"] for v in spec["volumes"])


def test_sample_pod_asks_for_both_resources():
    (pod,) = by_kind("Pod")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert set(limits) == set(dv.RESOURCES)
    assert all(k.startswith("gemini.io/") for k in pod["metadata"]["annotations"])
    assert pod["spec"]["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def test_grafana_dashboard_queries_gem_node_metrics():
    dash = json.loads((DEPLOY / "grafana" / "gemini-pods.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    from gemini.k8s import metrics
    documented = metrics.__doc__ or ""
    for name in ("gemini_pod_gpu_share_ratio", "gemini_pod_gpu_min_share_ratio", "gemini_pod_gpu_max_share_ratio",
                 "gemini_pod_gpu_memory_used_bytes", "gemini_pod_gpu_memory_limit_bytes"):
        assert any(name in e for e in exprs), f"no panel shows {name}"
    for e in exprs:
        for word in e.replace("(", " ").replace(")", " ").replace("{", " ").split():
            if word.startswith("gemini_"):
                assert word.removesuffix("_total") in documented or word in documented, f"{word} is not exported"
