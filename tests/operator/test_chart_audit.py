"""The Helm chart with the values platform teams set (their own values files and --sets, GitOps `helm template`, several
releases in one cluster) and with values that are wrong: each case here was a defect of the chart."""
from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from opharness import CHART, RELEASE_NS, require_tools
from test_operator_apiserver import OPTIONAL_CRDS

CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "PriorityClass", "ClusterKopfPeering",
                  "CustomResourceDefinition"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _docs(helm_offline, release: str, *args: str, namespace: str = RELEASE_NS) -> list[dict]:
    out = helm_offline("template", release, str(CHART), "--namespace", namespace, *args)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.tools
def test_operator_can_read_its_sidecar_credentials(helm_offline):
    """sidecarCredentials is a Secret volume with mode 0440, read by uid 65532. Without a pod fsGroup the kubelet
    leaves its files root:root, so the operator could not read its token or certificates (every Resize of a secured
    cache would go out without credentials); with fsGroup 65532 they are group 65532, and 0440 lets it read."""
    dep = _one(_docs(helm_offline, "promptcache", "--set", "sidecarCredentials.secretName=op-creds"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v.get("secret")]
    assert vol["secret"]["secretName"] == "op-creds"
    mode = vol["secret"]["defaultMode"]
    (c,) = pod["containers"]
    uid = c.get("securityContext", {}).get("runAsUser", pod["securityContext"]["runAsUser"])
    assert uid != 0
    # The kubelet makes Secret volume files owned by root (never by the pod's uid), group fsGroup where set.
    fs_group = pod["securityContext"].get("fsGroup")
    assert fs_group == pod["securityContext"]["runAsGroup"] == 65532, fs_group
    assert mode & 0o040, f"group (fsGroup) cannot read the credentials: {oct(mode)}"
    assert not mode & 0o007, f"credentials must not be world-readable: {oct(mode)}"


@pytest.mark.tools
def test_metrics_port_may_not_be_the_health_port(helm_offline):
    """The liveness endpoint listens on 8080: metrics.port=8080 rendered two containerPorts 8080 (server-side apply
    refuses the Deployment; a plain create accepts it and the operator fails to bind its second server)."""
    dep = _one(_docs(helm_offline, "promptcache"), "Deployment")
    ports = {p["name"]: p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports["health"] == 8080
    out = helm_offline("template", "x", str(CHART), "--set", "metrics.port=8080", check=False)
    assert out.returncode != 0 and "/metrics/port" in out.stderr, out.stderr
    dep = _one(_docs(helm_offline, "x", "--set", "metrics.port=9090"), "Deployment")
    assert "--metrics-port=9090" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.tools
def test_an_existing_service_account_must_be_named(helm_offline):
    """serviceAccount.create=false without a name bound the operator's ClusterRole (cluster-wide writes to
    DaemonSets, Deployments, Services...) to the namespace's `default` ServiceAccount, and so to every pod there."""
    out = helm_offline("template", "x", str(CHART), "--set", "serviceAccount.create=false", check=False)
    assert out.returncode != 0 and "serviceAccount.name" in out.stderr, out.stderr
    docs = _docs(helm_offline, "x", "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops-sa")
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    assert _one(docs, "ClusterRoleBinding")["subjects"] == [{"kind": "ServiceAccount", "name": "ops-sa",
                                                            "namespace": RELEASE_NS}]
    assert _one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-sa"


@pytest.mark.tools
@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_same_release_name_in_two_namespaces_does_not_collide(helm_offline, mode):
    """A namespace-restricted operator per team, each release called promptcache-operator in its own namespace: the
    ClusterRole and ClusterRoleBinding were named after the release only, so the second `helm install` failed
    (invalid ownership metadata) and, applied by a GitOps tool, the second overwrote the first one's binding. Only the
    CRDs (which Helm skips when they exist) and the PriorityClass (created by one release: priorityClass.create)
    are shared."""
    team = {"cluster-wide": [], "namespaced": ["--set", "watchNamespaces={team-a}"]}[mode]
    other = {"cluster-wide": ["--set", "peering.name=second"], "namespaced": ["--set", "watchNamespaces={team-b}"]}[mode]
    first = _docs(helm_offline, "promptcache-operator", "--include-crds", *team, namespace="team-a-system")
    second = _docs(helm_offline, "promptcache-operator", "--include-crds", *other,
                   "--set", "priorityClass.create=false", namespace="team-b-system")

    def names(docs):
        return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}
    shared = names(first) & names(second)
    assert {k for k, _, _ in shared} <= {"CustomResourceDefinition"}, sorted(shared)
    for docs, ns in ((first, "team-a-system"), (second, "team-b-system")):
        crb = _one(docs, "ClusterRoleBinding")
        assert crb["roleRef"]["name"] == _one(docs, "ClusterRole")["metadata"]["name"]
        assert crb["subjects"][0]["namespace"] == ns
        for rb in [d for d in docs if d["kind"] == "RoleBinding"]:
            assert rb["roleRef"]["name"] == next(r["metadata"]["name"] for r in docs if r["kind"] == "Role"
                                                 and r["metadata"]["namespace"] == rb["metadata"]["namespace"])


@pytest.mark.tools
def test_fullname_and_name_overrides(helm_offline):
    """fullnameOverride / nameOverride (what platform teams set to get short names) were refused by the schema."""
    docs = _docs(helm_offline, "promptcache", "--set", "fullnameOverride=pc-operator", "--set",
                 "metrics.serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true")
    dep = _one(docs, "Deployment")
    assert dep["metadata"]["name"] == "pc-operator"
    assert _one(docs, "Service")["metadata"]["name"] == "pc-operator-metrics"
    assert _one(docs, "ServiceAccount")["metadata"]["name"] == "pc-operator"
    assert 'deployment="pc-operator"' in _one(docs, "PrometheusRule")["spec"]["groups"][0]["rules"][0]["expr"]
    docs = _docs(helm_offline, "promptcache", "--set", "nameOverride=pcop")
    dep = _one(docs, "Deployment")
    assert dep["metadata"]["name"] == "promptcache-pcop"
    assert dep["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "pcop",
                                                      "app.kubernetes.io/instance": "promptcache"}
    assert _one(docs, "Service")["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    for bad in ("Bad_Name", "x" * 64):
        out = helm_offline("template", "x", str(CHART), "--set", f"fullnameOverride={bad}", check=False)
        assert out.returncode != 0 and "fullnameOverride" in out.stderr, out.stderr


@pytest.mark.tools
def test_release_names_helm_allows_render_valid_names(helm_offline):
    """Helm allows dots in release names and a leading digit: the metrics Service (a DNS-1035 label) was refused by
    the API server (`my.cache-promptcache-operator-metrics`). Dots now become dashes; a leading digit is refused by
    helm naming the way out (fullnameOverride)."""
    docs = _docs(helm_offline, "my.cache", "--set", "metrics.serviceMonitor.enabled=true")
    for d in docs:
        if d["kind"] in ("Service", "Deployment", "ServiceAccount"):
            assert DNS_LABEL.match(d["metadata"]["name"]), (d["kind"], d["metadata"]["name"])
    assert DNS_1035.match(_one(docs, "Service")["metadata"]["name"])
    out = helm_offline("template", "1cache", str(CHART), check=False)
    assert out.returncode != 0 and "fullnameOverride" in out.stderr, out.stderr
    assert _one(_docs(helm_offline, "1cache", "--set", "fullnameOverride=cache1"), "Service")["metadata"]["name"] \
        == "cache1-metrics"


# Values that are wrong; each was accepted by `helm template` and only refused by the API server at install (or sync)
# time, or not at all. Now the schema (or the template) refuses it, naming the value.
WRONG_VALUES = {
    "negative cpu": (["--set", "resources.requests.cpu=-1"], "/resources/requests/cpu"),
    "bad memory quantity": (["--set", "resources.limits.memory=128mb"], "/resources/limits/memory"),
    "resources typo": (["--set", "resources.request.cpu=1"], "/resources"),
    "image repository with a tag": (["--set", "image.repository=ghcr.io/x/op:1.0"], "/image/repository"),
    "image tag with a colon": (["--set", "image.tag=v1:2"], "/image/tag"),
    "PriorityClass system-*": (["--set", "priorityClass.name=system-mine"], "/priorityClass/name"),
    "PriorityClass not a DNS name": (["--set", "priorityClass.name=Bad_Name"], "/priorityClass/name"),
    "peering not a DNS name": (["--set", "peering.name=Bad_Name"], "/peering/name"),
    "ServiceAccount not a DNS name": (["--set", "serviceAccount.name=Bad_Name"], "/serviceAccount/name"),
    "credentials Secret not a DNS name": (["--set", "sidecarCredentials.secretName=Bad_Name"],
                                          "/sidecarCredentials/secretName"),
    "image pull Secret typo": (["--set-json", 'imagePullSecrets=[{"name":"regcred","namespace":"x"}]'],
                               "/imagePullSecrets/0"),
    "toleration operator": (["--set-json", 'tolerations=[{"key":"a","operator":"equals"}]'], "/tolerations/0/operator"),
    "pod label value": (["--set", "podLabels.team=ml platform"], "/podLabels/team"),
    "node selector value": (["--set", "nodeSelector.pool=a b"], "/nodeSelector/pool"),
    "monitoring label key": (["--set-json", 'monitoring.labels={"bad key":"x"}'], "/monitoring/labels"),
    # the chart's own labels: rendered twice (duplicate YAML keys, which strict parsers and linters refuse)
    "monitoring label the chart sets": (["--set", "metrics.serviceMonitor.enabled=true",
                                         "--set", r"monitoring.labels.app\.kubernetes\.io/part-of=monitoring"],
                                        "/monitoring/labels/app.kubernetes.io~1part-of"),
    "rule label the chart sets": (["--set", "prometheusRule.enabled=true",
                                   "--set", r"prometheusRule.labels.app\.kubernetes\.io/name=x"],
                                  "/prometheusRule/labels/app.kubernetes.io~1name"),
    "cache rule label the chart sets": (["--set", "cacheAlerts.enabled=true",
                                         "--set", r"cacheAlerts.labels.helm\.sh/chart=x"],
                                        "/cacheAlerts/labels/helm.sh~1chart"),
    "dashboard label twice": (["--set-string", "grafanaDashboard.labels.grafana_dashboard=0"],
                              "grafanaDashboard.labels may not set grafana_dashboard"),
    "dashboard label key": (["--set", "grafanaDashboard.label=bad label"], "/grafanaDashboard/label"),
}


@pytest.mark.tools
@pytest.mark.parametrize("case", list(WRONG_VALUES), ids=list(WRONG_VALUES))
def test_wrong_values_are_refused_naming_the_value(helm_offline, case):
    args, where = WRONG_VALUES[case]
    out = helm_offline("template", "x", str(CHART), *args, check=False)
    assert out.returncode != 0, f"accepted: {args}"
    assert where in out.stderr, out.stderr


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _no_duplicates(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise AssertionError(f"duplicate keys {sorted(dup)} at {node.start_mark}")
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)

PLATFORM_VALUES = {
    "monitoring": {"labels": {"release": "prometheus", "team": "ml"}},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "prometheusRule": {"enabled": True, "labels": {"severity-routing": "ml"}},
    "cacheAlerts": {"enabled": True, "labels": {"team": "ml-cache"}},
    "grafanaDashboard": {"labels": {"team": "ml"}, "annotations": {"grafana_folder": "PromptCache"}},
    "podLabels": {"team": "ml"}, "podAnnotations": {"example.com/owner": "ml-platform"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}],
    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": 1, "memory": "512Mi"}},
    "imagePullSecrets": [{"name": "regcred"}],
    "image": {"repository": "registry.corp.example:5000/ml/promptcache-operator", "digest": "sha256:" + "a" * 64},
    "sidecarCredentials": {"secretName": "op-creds"},
}


@pytest.mark.tools
def test_platform_values_render_without_duplicate_keys(helm_offline, tmp_path):
    path = tmp_path / "platform.yaml"
    path.write_text(yaml.safe_dump(PLATFORM_VALUES))
    out = helm_offline("template", "promptcache", str(CHART), "--namespace", RELEASE_NS, "-f", str(path))
    docs = [d for d in yaml.load_all(out.stdout, Loader=_UniqueKeyLoader) if d]
    sm = _one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    for rule in [d for d in docs if d["kind"] == "PrometheusRule"]:
        assert rule["metadata"]["labels"]["release"] == "prometheus"
    lint = helm_offline("lint", "--strict", str(CHART), "-f", str(path))
    assert "0 chart(s) failed" in lint.stdout and "[WARNING]" not in lint.stdout, lint.stdout


def _notes(helm_offline, tmp_path, *args: str) -> str:
    """NOTES.txt as `helm install` prints it, without a cluster: `helm template` leaves NOTES out, so a copy of the
    chart renders it into a ConfigMap."""
    import shutil

    chart = tmp_path / "chart"
    shutil.rmtree(chart, ignore_errors=True)
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_audit_notes.tpl").write_text('{{- define "audit.notes" -}}\n' + notes + "{{- end }}\n")
    (chart / "templates" / "audit-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: audit-notes\ndata:\n"
        '  notes: {{ include "audit.notes" . | quote }}\n')
    out = helm_offline("template", "x", str(chart), "--namespace", RELEASE_NS, "--show-only",
                       "templates/audit-notes.yaml", *args)
    return yaml.safe_load(out.stdout)["data"]["notes"]


@pytest.mark.tools
def test_notes_point_at_a_watched_namespace(helm_offline, tmp_path):
    """NOTES told a namespace-restricted install to `kubectl apply` the example into the current namespace, which
    the operator does not watch; and nothing said that a PriorityClass this release does not create must exist.
    (They also told every PromptCache to name priorityClass.name when it was not promptcache-node-cache: no longer
    needed, the operator's default is priorityClass.name, test_priority_class_name_reaches_every_cache_without_one.)"""
    notes = _notes(helm_offline, tmp_path, "--set", "watchNamespaces={team-a,team-b}",
                   "--set", "priorityClass.create=false", "--set", "priorityClass.name=ml-cache")
    assert "team-a, team-b" in notes
    assert "kubectl apply -n team-a " in notes
    assert "PriorityClass ml-cache" in notes and "spec.placement.priorityClassName" not in notes
    notes = _notes(helm_offline, tmp_path, "--set", "priorityClass.name=ml-cache")
    assert "PriorityClass" not in notes.split("Declare")[0]
    notes = _notes(helm_offline, tmp_path)
    assert "every namespace" in notes and "PriorityClass" not in notes.split("Declare")[0]


MATRIX = {
    "defaults": [],
    "all-on": ["--set", "prometheusRule.enabled=true", "--set", "cacheAlerts.enabled=true",
               "--set", "metrics.serviceMonitor.enabled=true", "--set", "sidecarCredentials.secretName=op-creds",
               "--set", "priorityClass.create=false"],
    "all-off": ["--set", "grafanaDashboard.enabled=false", "--set", "podDisruptionBudget.enabled=false",
                "--set", "priorityClass.create=false", "--set", "serviceAccount.create=false",
                "--set", "serviceAccount.name=existing", "--set", "replicaCount=1"],
    "overrides": ["--set", "fullnameOverride=pc-operator", "--set", "priorityClass.create=false",
                  "--set", "peering.name=pc-audit"],
}


@pytest.mark.apiserver
def test_rendered_manifests_pass_the_api_server_and_restricted_pod_security(helm_release, crd, helm_offline, kube,
                                                                            control_plane, namespace, tmp_path):
    """Every rendered object passes the real API server's validation (server-side apply, dry run, strict field
    validation) with the platform values; the operator pod, created from the Deployment's template in a namespace
    that enforces Pod Security `restricted`, is admitted. Monitoring objects need the Prometheus operator CRDs,
    which this session's API server must not get (other tests check the operator without them): left out here."""
    kubectl = require_tools("kubectl")["kubectl"]
    kube.request("PATCH", f"/api/v1/namespaces/{namespace}", content_type="application/merge-patch+json",
                 body={"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                               "pod-security.kubernetes.io/warn": "restricted"}}})
    platform = tmp_path / "platform.yaml"
    platform.write_text(yaml.safe_dump(PLATFORM_VALUES))
    monitoring = {c["spec"]["names"]["kind"] for c in OPTIONAL_CRDS if c["spec"]["group"] == "monitoring.coreos.com"}
    for name, args in {**MATRIX, "platform": ["-f", str(platform), "--set", "priorityClass.create=false"]}.items():
        docs = _docs(helm_offline, "audit", *args, namespace=namespace)
        if name == "all-off":
            kube.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                         body={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "existing"}})
        docs = [d for d in docs if d["kind"] not in monitoring]
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        p = subprocess.run([str(kubectl), "--kubeconfig", str(control_plane.kubeconfig), "apply", "--server-side",
                            "--force-conflicts", "--field-manager=audit", "--dry-run=server", "--validate=strict",
                            "-f", str(path)], capture_output=True, text=True)
        assert p.returncode == 0 and "Warning" not in p.stderr, (name, p.stdout, p.stderr)
        template = _one(docs, "Deployment")["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"psa-{name}", "namespace": namespace,
                                                               "labels": template["metadata"]["labels"]},
               "spec": template["spec"]}
        _, _, warnings = kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=pod,
                                      query=[("dryRun", "All")], with_headers=True)
        assert warnings == [], (name, warnings)



@pytest.mark.tools
@pytest.mark.parametrize("value", ["podLabels", "monitoring.labels", "prometheusRule.labels", "grafanaDashboard.labels",
                                   "cacheAlerts.labels"])
def test_null_unsets_a_map_value(helm_offline, value):
    """`key: null` (or --set key=null) is how Helm users drop a default (e.g. monitoring.labels without
    kube-prometheus-stack's release label): the templates failed with `wrong type for value; expected map`."""
    docs = _docs(helm_offline, "x", "--set", f"{value}=null", "--set", "prometheusRule.enabled=true",
                 "--set", "metrics.serviceMonitor.enabled=true", "--set", "cacheAlerts.enabled=true")
    assert _one(docs, "Deployment")
    if value == "monitoring.labels":
        env = {e["name"]: e.get("value") for e in _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PROMPTCACHE_OPERATOR_MONITORING_LABELS"] == ""
        rules = [d for d in docs if d["kind"] == "PrometheusRule"]  # the operator's, and the caches' alerts
        assert len(rules) == 2 and not any("release" in r["metadata"]["labels"] for r in rules)


@pytest.mark.tools
@pytest.mark.parametrize("release_args, want", [
    (["--set", "priorityClass.name=gpu-cache"], "gpu-cache"),
    (["--set", "priorityClass.name=gpu-cache", "--set", "priorityClass.create=false"], "gpu-cache"),
    ([], "promptcache-node-cache"),
])
def test_priority_class_name_reaches_every_cache_without_one(helm_offline, release_args, want):
    """priorityClass.name=gpu-cache made the chart create gpu-cache, while every PromptCache naming no
    spec.placement.priorityClassName still got promptcache-node-cache (the CRD's default), which did not exist: the
    API server refused its sidecar pods and the cache stayed Degraded. Now the chart hands the name to the operator
    (PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS) and the CRD defaults nothing: the operator, configured as the
    chart configures it, runs such a cache's pods with the chart's PriorityClass."""
    from promptcache.operator import builders, model
    from promptcache.operator.config import OperatorConfig

    docs = _docs(helm_offline, "promptcache", *release_args, "--include-crds")
    created = [d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"]
    assert created == ([] if "priorityClass.create=false" in release_args else [want])
    # The operator as the Deployment runs it (its arguments and environment) builds a cache that names no
    # PriorityClass, as the API server hands it over (with the CRD's defaults, which the model applies).
    (container,) = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = OperatorConfig.from_args(container["args"], env)
    spec = model.PromptCacheSpec.from_dict(yaml.safe_load(
        (CHART.parents[1] / "examples" / "promptcache-minimal.yaml").read_text())["spec"])
    owner = builders.Owner(name="llama", namespace="inference", uid="u-1")
    builders.check_operator_policy(spec, config.defaults)
    children = {c["kind"]: c for c in builders.desired_children(spec, owner, builders.Capabilities(),
                                                                config.defaults)}
    assert children["DaemonSet"]["spec"]["template"]["spec"]["priorityClassName"] == want
    assert children["ResourceQuota"]["spec"]["scopeSelector"]["matchExpressions"] == [
        {"scopeName": "PriorityClass", "operator": "In", "values": [want]}]
    # How: the chart's value in the operator's environment, and no default in the CRD the chart installs.
    assert env["PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS"] == want
    assert spec.placement.priorityClassName is None
    (crd,) = [d for d in docs if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == model.GROUP]
    placement = (crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
                 ["placement"]["properties"])
    assert "default" not in placement["priorityClassName"]
