"""The Helm chart: lint, rendered manifests validate against the Kubernetes schemas, install into the real API
server."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from opharness import CHART, CRD_FILE, RELEASE_NS, OperatorProcess, crd_established, wait_for
from promptcache.operator import builders
from promptcache.operator.handlers import WATCHED_CHILDREN
from promptcache.operator.kube import PLURALS, object_path

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


# --- RBAC: cluster-wide, or a Role per watched namespace (watchNamespaces) --------------------------------------------

WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "bind", "escalate", "impersonate", "*"}
# The API group of every kind the operator writes (kube.PLURALS): a kind added there fails here until it has RBAC.
KIND_GROUPS = {"ConfigMap": "", "DaemonSet": "apps", "Deployment": "apps", "Service": "", "ResourceQuota": "",
               builders.NETWORK_POLICY[1]: builders.NETWORK_POLICY[0].split("/")[0],
               builders.VPA[1]: builders.VPA[0].split("/")[0],
               builders.SERVICE_MONITOR[1]: builders.SERVICE_MONITOR[0].split("/")[0],
               builders.PROMETHEUS_RULE[1]: builders.PROMETHEUS_RULE[0].split("/")[0],
               "PromptCache": "promptcache.io"}


def _needs_in_namespace() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the operator uses in each namespace it watches (read from operator/: kube.py's
    children, handlers.py's watches, reconcile's deletes, kopf's peering and events, fleet's pod listing)."""
    assert set(PLURALS) == set(KIND_GROUPS), "a new kind in kube.PLURALS: give it RBAC in the chart's _rbac.tpl"
    needs = {(KIND_GROUPS[k], p, v) for k, p in PLURALS.items() if k != "PromptCache" for v in ("get", "create", "patch")}
    needs |= {(g, p, v) for g, _, p in WATCHED_CHILDREN for v in ("list", "watch")}
    needs |= {("apps", "deployments", "delete"), ("", "services", "delete"),
              ("networking.k8s.io", "networkpolicies", "delete"),
              ("autoscaling.k8s.io", "verticalpodautoscalers", "delete"),
              ("monitoring.coreos.com", "servicemonitors", "delete"),
              ("monitoring.coreos.com", "prometheusrules", "delete")}
    needs |= {("promptcache.io", "promptcaches", v) for v in ("get", "list", "watch", "patch")}
    needs |= {("promptcache.io", "promptcaches/status", "patch"), ("promptcache.io", "promptcaches/finalizers", "update")}
    needs |= {("kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "patch")}
    needs |= {("", "events", "create"), ("", "events", "list"), ("", "pods", "list")}
    return needs


CLUSTER_SCOPED_NEEDS = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("get", "list", "watch")} | {
    ("scheduling.k8s.io", "priorityclasses", "get")}
CLUSTER_SCOPED_RESOURCES = {"customresourcedefinitions", "namespaces", "priorityclasses", "clusterkopfpeerings"}


def _grants(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role.get("rules") or [] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def _rbac(docs: list[dict]) -> dict[str, list[dict]]:
    return {k: [d for d in docs if d["kind"] == k] for k in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")}


@pytest.mark.tools
def test_cluster_wide_rbac_is_one_cluster_role(helm_offline):
    docs = [d for d in yaml.safe_load_all(helm_offline("template", "promptcache", str(CHART), "--namespace",
                                                        RELEASE_NS).stdout) if d]
    rbac = _rbac(docs)
    assert not rbac["Role"] and not rbac["RoleBinding"]
    (cr,), (crb,) = rbac["ClusterRole"], rbac["ClusterRoleBinding"]
    want = _needs_in_namespace() | CLUSTER_SCOPED_NEEDS | {("kopf.dev", "clusterkopfpeerings", v)
                                                          for v in ("get", "list", "watch", "patch")}
    assert want <= _grants(cr), sorted(want - _grants(cr))
    assert crb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                              "name": cr["metadata"]["name"]}
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "promptcache-promptcache-operator",
                                "namespace": RELEASE_NS}]


@pytest.mark.tools
def test_watch_namespaces_puts_namespaced_rbac_in_a_role_per_namespace(helm_offline):
    """With watchNamespaces the ServiceAccount may write nothing outside them: the ClusterRole only reads
    cluster-scoped objects (CRDs, namespaces for kopf, PriorityClasses); each watched namespace gets a Role and
    RoleBinding with everything the operator does there. Together they grant what the cluster-wide ClusterRole does
    (less its ClusterKopfPeering): the split loses nothing."""
    watched = ["team-a", "team-b"]
    out = helm_offline("template", "promptcache", str(CHART), "--namespace", RELEASE_NS,
                       "--set", "watchNamespaces={%s}" % ",".join(watched))
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    rbac = _rbac(docs)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    sa = {"kind": "ServiceAccount", "name": dep["spec"]["template"]["spec"]["serviceAccountName"],
          "namespace": RELEASE_NS}

    (cr,), (crb,) = rbac["ClusterRole"], rbac["ClusterRoleBinding"]
    granted = _grants(cr)
    assert not {g for g in granted if g[2] in WRITE_VERBS}, sorted(g for g in granted if g[2] in WRITE_VERBS)
    assert {r for _, r, _ in granted} <= CLUSTER_SCOPED_RESOURCES - {"clusterkopfpeerings"}, sorted(granted)
    assert CLUSTER_SCOPED_NEEDS | {("", "namespaces", v) for v in ("list", "watch")} <= granted, sorted(granted)
    assert crb["roleRef"]["kind"] == "ClusterRole" and crb["roleRef"]["name"] == cr["metadata"]["name"]
    assert crb["subjects"] == [sa]

    assert sorted(r["metadata"]["namespace"] for r in rbac["Role"]) == watched
    assert sorted(b["metadata"]["namespace"] for b in rbac["RoleBinding"]) == watched
    cluster_wide = _rbac([d for d in yaml.safe_load_all(helm_offline(
        "template", "promptcache", str(CHART), "--namespace", RELEASE_NS).stdout) if d])["ClusterRole"][0]
    for ns in watched:
        role = next(r for r in rbac["Role"] if r["metadata"]["namespace"] == ns)
        binding = next(b for b in rbac["RoleBinding"] if b["metadata"]["namespace"] == ns)
        assert role["metadata"]["labels"] == cr["metadata"]["labels"]
        assert role["metadata"]["name"] == cr["metadata"]["name"] == binding["metadata"]["name"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [sa]
        got = _grants(role)
        assert _needs_in_namespace() <= got, sorted(_needs_in_namespace() - got)
        assert not {r for _, r, _ in got} & CLUSTER_SCOPED_RESOURCES, sorted(got)
        assert got == {g for g in _grants(cluster_wide) if g[1] not in CLUSTER_SCOPED_RESOURCES}
    # Each watched namespace also has the KopfPeering the replicas coordinate through; no ClusterKopfPeering.
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "KopfPeering") == watched
    assert not [d for d in docs if d["kind"] == "ClusterKopfPeering"]


@pytest.mark.tools
@pytest.mark.parametrize("value", ["{team-*}", "{Team_A}", "{team-a,team-a}"])
def test_watch_namespaces_must_be_distinct_namespace_names(helm_offline, value):
    """A Role, RoleBinding and KopfPeering go into each: a kopf pattern names no namespace to create them in."""
    out = helm_offline("template", "x", str(CHART), "--set", f"watchNamespaces={value}", check=False)
    assert out.returncode != 0 and "watchNamespaces" in out.stderr, out.stderr


NS_RELEASE, NS_RELEASE_NS = "pc-ns", "pc-ns-system"


def _allowed(kube, sa: str, sa_ns: str, verb: str, group: str, resource: str, namespace: str | None = None) -> bool:
    """SubjectAccessReview: may the ServiceAccount do this (RBAC authorization, as the API server decides)."""
    resource, _, sub = resource.partition("/")
    attrs = {"verb": verb, "group": group, "resource": resource}
    if sub:
        attrs["subresource"] = sub
    if namespace:
        attrs["namespace"] = namespace
    review = kube.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body={
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": f"system:serviceaccount:{sa_ns}:{sa}", "resourceAttributes": attrs,
                 "groups": ["system:serviceaccounts", f"system:serviceaccounts:{sa_ns}", "system:authenticated"]}})
    return bool(review["status"].get("allowed"))


@pytest.mark.apiserver
def test_namespaced_release_operator_works_with_only_its_roles(helm, kube, crd, namespace, control_plane, tmp_path):
    """A second release with watchNamespaces={namespace}: its ServiceAccount may do what the operator needs in that
    namespace and write nothing elsewhere (kube-system, its own namespace); the operator, authenticated as it and
    peering through the chart's KopfPeering, reconciles a PromptCache there without a single 403."""
    helm("install", NS_RELEASE, str(CHART), "--namespace", NS_RELEASE_NS, "--create-namespace",
         "--set", f"watchNamespaces={{{namespace}}}", "--set", "priorityClass.create=false",
         "--set", "replicaCount=1")
    op = None
    try:
        sa = f"{NS_RELEASE}-promptcache-operator"
        for group, resource, verb in sorted(_needs_in_namespace()):
            assert _allowed(kube, sa, NS_RELEASE_NS, verb, group, resource, namespace), (verb, group, resource)
        for other in ("kube-system", NS_RELEASE_NS, "default"):
            for group, resource, verb in [("apps", "daemonsets", "create"), ("apps", "deployments", "delete"),
                                          ("", "resourcequotas", "patch"), ("", "services", "patch"),
                                          ("", "configmaps", "list"), ("", "pods", "list"),
                                          ("promptcache.io", "promptcaches/status", "patch")]:
                assert not _allowed(kube, sa, NS_RELEASE_NS, verb, group, resource, other), (other, verb, resource)
        for group, resource, verb in [("apps", "daemonsets", "create"), ("", "configmaps", "list"),
                                      ("kopf.dev", "clusterkopfpeerings", "patch")]:  # in all namespaces at once
            assert not _allowed(kube, sa, NS_RELEASE_NS, verb, group, resource), (verb, resource)

        tr = kube.request("POST", f"/api/v1/namespaces/{NS_RELEASE_NS}/serviceaccounts/{sa}/token",
                          body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                "spec": {"expirationSeconds": 3600}})
        cfg = yaml.safe_load(control_plane.kubeconfig.read_text())
        cfg["users"] = [{"name": "admin", "user": {"token": tr["status"]["token"]}}]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(cfg))
        # as the chart's Deployment runs it: peering (the KopfPeering in the namespace), --namespace per entry
        op = OperatorProcess(kubeconfig, tmp_path / "operator.log", "--namespace", namespace,
                             env={"PROMPTCACHE_OPERATOR_RESYNC_SECONDS": "2",
                                  "PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS": "1"})
        full = yaml.safe_load((ROOT / "examples" / "promptcache-full.yaml").read_text())
        full["spec"].pop("zeroCopy", None)
        full["metadata"]["namespace"] = namespace
        name = full["metadata"]["name"]
        kube.request("PATCH", object_path("promptcache.io/v1alpha1", "PromptCache", namespace, name), body=full,
                     content_type="application/apply-patch+yaml", query=[("fieldManager", "kubectl"), ("force", "true")])
        kinds = [("v1", "ConfigMap", f"{name}-config"), ("apps/v1", "DaemonSet", name), ("v1", "Service", name),
                 ("v1", "ResourceQuota", f"{name}-quota"), ("apps/v1", "Deployment", f"{name}-mooncake-master"),
                 ("v1", "Service", f"{name}-mooncake-master"),
                 (*builders.NETWORK_POLICY, f"{name}-mooncake-master"), (*builders.NETWORK_POLICY, name)]
        wait_for(lambda: all(kube.get(a, k, namespace, n) for a, k, n in kinds) or op.proc.poll() is not None,
                 timeout=60, what="children of the PromptCache in the watched namespace")
        assert op.proc.poll() is None, f"the operator exited {op.proc.returncode}:\n{op.output()[-3000:]}"

        def status():
            pc = kube.get("promptcache.io/v1alpha1", "PromptCache", namespace, name) or {}
            return (pc.get("status") or {}).get("observedGeneration") == pc["metadata"]["generation"]
        wait_for(status, timeout=30, what="status written")
        wait_for(lambda: f"reconciled {namespace}/{name}" in op.output(), timeout=10, what="this operator reconciled")
        peering = kube.request("GET", f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/promptcache-operator")
        assert peering.get("status"), "the operator did not register in the namespace's KopfPeering"
        time.sleep(3)  # a resync period or so: the timers and child watches run with the Role too
        log = op.output()
        for word in ("HTTP 403", "Forbidden", "is forbidden", "Not enough permissions"):
            assert word not in log, log[-4000:]
    finally:
        if op is not None:
            op.kill(signal.SIGTERM)
        helm("uninstall", NS_RELEASE, "--namespace", NS_RELEASE_NS)
