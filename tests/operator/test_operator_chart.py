"""The Helm chart: lint, rendered manifests validate against the Kubernetes schemas, install into the real API
server."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opharness import CHART, CRD_FILE, RELEASE_NS, crd_established

ROOT = Path(__file__).resolve().parents[2]
K8S_SCHEMA_VERSION = "1.34.0"

VALUE_SETS = {
    "defaults": [],
    "single-replica": ["--set", "replicaCount=1"],
    "namespaced": ["--set", "watchNamespaces={team-a,team-b}", "--set", "prometheusRule.enabled=true",
                   "--set", "priorityClass.create=false", "--set", "image.digest=sha256:" + "a" * 64],
}


@pytest.mark.tools
@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_helm_lint_clean(helm_offline, values):
    out = helm_offline("lint", "--strict", str(CHART), *VALUE_SETS[values])
    assert "0 chart(s) failed" in out.stdout, out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.tools
def test_values_schema_rejects_bad_values(helm_offline):
    out = helm_offline("template", "x", str(CHART), "--set", "logFormat=xml", check=False)
    assert out.returncode != 0 and "logFormat" in out.stderr


@pytest.mark.tools
@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_rendered_manifests_validate_strict(helm_offline, tmp_path, values):
    out = helm_offline("template", "promptcache", str(CHART), "--namespace", RELEASE_NS, "--include-crds",
                       *VALUE_SETS[values])
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = sorted({d["kind"] for d in docs})
    assert {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "ServiceAccount"} <= set(kinds)
    path = tmp_path / "rendered.yaml"
    path.write_text(out.stdout)
    v = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_SCHEMA_VERSION,
                        str(path)], capture_output=True, text=True)
    if v.returncode != 0 and "No module named kubernetes_validate.__main__" in v.stderr:
        v = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k",
                            K8S_SCHEMA_VERSION, str(path)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "ERROR" not in v.stdout, v.stdout


@pytest.mark.tools
def test_deployment_is_restricted_and_probed(helm_offline):
    out = helm_offline("template", "promptcache", str(CHART), "--namespace", RELEASE_NS)
    dep = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(c)
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert "--peering=promptcache-operator" in c["args"]
    assert dep["spec"]["replicas"] == 2
    # The peering identity is the pod's name, and USER is set: the uid 65532 need not be in any passwd file.
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["USER"]["value"]


def test_golden_children_validate_strict(tmp_path):
    """The operator's own output (golden files) validates against the Kubernetes schemas too."""
    golden = Path(__file__).parent / "golden"
    files = sorted(golden.glob("*.yaml"))
    assert files
    v = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k",
                        K8S_SCHEMA_VERSION, *map(str, files)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.apiserver
def test_helm_install_establishes_crds(helm_release, helm, kube):
    assert crd_established(kube, yaml.safe_load(CRD_FILE.read_text())["metadata"]["name"])
    crd = kube.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/promptcaches.promptcache.io")
    managers = {m["manager"] for m in crd["metadata"].get("managedFields", [])}
    assert any("helm" in m for m in managers), managers  # created by helm, not by a test fixture
    assert crd_established(kube, "clusterkopfpeerings.kopf.dev")
    status = helm("status", "promptcache", "--namespace", RELEASE_NS, "-o", "json")
    assert '"status":"deployed"' in status.stdout.replace(" ", "")
    dep = kube.request("GET", f"/apis/apps/v1/namespaces/{RELEASE_NS}/deployments/promptcache-promptcache-operator")
    assert dep["spec"]["replicas"] == 2
    assert kube.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/promptcache-operator")
    assert kube.request("GET", "/apis/scheduling.k8s.io/v1/priorityclasses/promptcache-node-cache")
    print(f"helm install took {helm_release['seconds']:.2f}s")


@pytest.mark.apiserver
def test_chart_deployment_draws_no_pod_security_warning(helm_release, helm_offline, kube, namespace):
    kube.request("PATCH", f"/api/v1/namespaces/{namespace}", content_type="application/merge-patch+json",
                 body={"metadata": {"labels": {"pod-security.kubernetes.io/warn": "restricted",
                                               "pod-security.kubernetes.io/enforce": "restricted"}}})
    out = helm_offline("template", "promptcache", str(CHART), "--namespace", namespace)
    dep = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
    _, _, warnings = kube.apply(dep, with_headers=True)
    assert warnings == []


@pytest.mark.tools
def test_renders_as_a_dependency_of_an_umbrella_chart_with_global_values(helm_offline, tmp_path):
    """Helm hands an umbrella chart's `global` values to every subchart; the values schema must accept them."""
    import shutil

    umbrella = tmp_path / "platform"
    (umbrella / "charts").mkdir(parents=True)
    shutil.copytree(CHART, umbrella / "charts" / CHART.name)
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": CHART.name, "version": yaml.safe_load((CHART / "Chart.yaml").read_text())["version"],
                          "alias": "cache"}]}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({
        "global": {"imageRegistry": "registry.example.com", "storageClass": "fast"},
        "cache": {"replicaCount": 1, "monitoring": {"labels": {"release": "prometheus"}},
                  "prometheusRule": {"enabled": True}}}))
    out = helm_offline("template", "platform", str(umbrella), "--namespace", RELEASE_NS)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PROMPTCACHE_OPERATOR_MONITORING_LABELS"] == "release=prometheus"
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"


@pytest.mark.tools
def test_monitoring_labels_reach_every_monitoring_object(helm_offline):
    """kube-prometheus-stack selects ServiceMonitors and PrometheusRules by its release label: by default the
    chart's own rules and (through the operator's environment) the operator's carry it."""
    out = helm_offline("template", "promptcache", str(CHART), "--namespace", RELEASE_NS,
                       "--set", "prometheusRule.enabled=true", "--set", "cacheAlerts.enabled=true",
                       "--set", "cacheAlerts.labels.team=ml")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert len(rules) == 2
    for r in rules:
        assert r["metadata"]["labels"]["release"] == "kube-prometheus-stack", r["metadata"]["name"]
    assert next(r for r in rules if r["metadata"]["name"].endswith("-caches"))["metadata"]["labels"]["team"] == "ml"
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PROMPTCACHE_OPERATOR_MONITORING_LABELS"] == "release=kube-prometheus-stack"


def _label_maps(doc: dict):
    """Every label map of a rendered object: its own, a pod template's, a selector's."""
    yield doc["metadata"].get("labels") or {}
    spec = doc.get("spec") or {}
    if isinstance(spec, dict):
        yield ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        sel = spec.get("selector") or {}
        yield sel.get("matchLabels", sel) if isinstance(sel, dict) else {}


@pytest.mark.tools
def test_longest_release_name_keeps_names_and_labels_within_63(helm_offline):
    """Helm allows release names of 53 characters; the fullname is cut to 63 before a suffix, so the metrics
    Service was `<63 characters>-metrics` and the API server refused it."""
    release = "ml-platform-inference-cache-ops-prod1-" + "x" * 15
    assert len(release) == 53
    out = helm_offline("template", release, str(CHART), "--namespace", "t1", "--set", "prometheusRule.enabled=true",
                       "--set", "cacheAlerts.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
                       "--set", "grafanaDashboard.enabled=true", "--set", "podLabels.team=ml")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    assert services
    for name in services:
        assert len(name) <= 63 and not name.endswith("-"), name
    assert any(name.endswith("-metrics") for name in services)
    for d in docs:
        for labels in _label_maps(d):
            for key, value in labels.items():
                assert len(str(value)) <= 63, (d["kind"], key, value)
    # a release name that fits keeps its names (upgrades)
    short = [d for d in yaml.safe_load_all(helm_offline("template", "promptcache", str(CHART)).stdout)
             if d and d["kind"] == "Service"]
    assert [d["metadata"]["name"] for d in short] == ["promptcache-promptcache-operator-metrics"]


@pytest.mark.tools
@pytest.mark.parametrize("key", ["app.kubernetes.io/name", "app.kubernetes.io/instance"])
def test_pod_labels_cannot_override_the_selector(helm_offline, key):
    escaped = key.replace(".", r"\.")
    out = helm_offline("template", "x", str(CHART), "--set", f"podLabels.{escaped}=other", check=False)
    assert out.returncode != 0 and f"podLabels may not set {key}" in out.stderr, out.stderr
    out = helm_offline("template", "x", str(CHART), "--set", "podLabels.team=ml")
    dep = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml" and dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
