"""The operator (`python -m promptcache.operator`, a subprocess authenticated as the chart's ServiceAccount, so it
runs with exactly the chart's RBAC) against the real API server."""
from __future__ import annotations

import copy
import os
import pwd
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from opharness import apply_crd, wait_for
from promptcache.operator import builders
from promptcache.operator.builders import Capabilities, OperatorDefaults, Owner
from promptcache.operator.kube import ApiError, object_path
from promptcache.operator.model import PromptCacheSpec

pytestmark = pytest.mark.apiserver

ROOT = Path(__file__).resolve().parents[2]
PC_API = "promptcache.io/v1alpha1"
CORE_CHILDREN = [("v1", "ConfigMap", "{}-config"), ("apps/v1", "DaemonSet", "{}"), ("v1", "Service", "{}"),
                 ("v1", "Service", "{}-metrics"), ("v1", "ResourceQuota", "{}-quota")]
# With spec.cluster.enabled (the full example): the Mooncake master, and the NetworkPolicies around the tier.
CLUSTER_CHILDREN = [("apps/v1", "Deployment", "{}-mooncake-master"), ("v1", "Service", "{}-mooncake-master"),
                    (*builders.NETWORK_POLICY, "{}-mooncake-master"), (*builders.NETWORK_POLICY, "{}")]
OPTIONAL_CHILDREN = [(builders.VPA[0], builders.VPA[1], "{}"),
                     (builders.SERVICE_MONITOR[0], builders.SERVICE_MONITOR[1], "{}"),
                     (builders.PROMETHEUS_RULE[0], builders.PROMETHEUS_RULE[1], "{}")]


def example(name: str = "minimal") -> dict:
    return yaml.safe_load((ROOT / "examples" / f"promptcache-{name}.yaml").read_text())


def _restricted_spec(doc: dict) -> dict:
    """An example's spec less spec.zeroCopy, whose hostPath needs the privileged Pod Security level."""
    return {k: v for k, v in doc["spec"].items() if k != "zeroCopy"}


def apply_pc(kube, namespace: str, doc: dict, name: str | None = None) -> dict:
    doc = copy.deepcopy(doc)
    if name:
        doc["metadata"]["name"] = name
    doc["metadata"]["namespace"] = namespace
    return kube.request("PATCH", object_path(PC_API, "PromptCache", namespace, doc["metadata"]["name"]), body=doc,
                        content_type="application/apply-patch+yaml",
                        query=[("fieldManager", "kubectl"), ("force", "true")])


def get_pc(kube, namespace: str, name: str) -> dict | None:
    return kube.get(PC_API, "PromptCache", namespace, name)


def children(kube, namespace: str, name: str, kinds=CORE_CHILDREN) -> dict[str, dict | None]:
    return {f"{k}/{n.format(name)}": kube.get(a, k, namespace, n.format(name)) for a, k, n in kinds}


def all_present(kube, namespace, name, kinds=CORE_CHILDREN):
    got = children(kube, namespace, name, kinds)
    return got if all(got.values()) else None


def conditions(pc: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (pc.get("status") or {}).get("conditions") or []}


def optional_crd(group: str, kind: str, plural: str) -> dict:
    """A minimal CRD for an optional integration (the operator only needs the resource to exist)."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}",
                         # *.k8s.io groups need this (the upstream VPA CRD carries the same annotation)
                         "annotations": {"api-approved.kubernetes.io":
                                         "https://github.com/kubernetes/kubernetes/pull/63797"}},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {"type": "object",
                                                                  "x-kubernetes-preserve-unknown-fields": True}}}]}}


OPTIONAL_CRDS = [optional_crd("autoscaling.k8s.io", "VerticalPodAutoscaler", "verticalpodautoscalers"),
                 optional_crd("monitoring.coreos.com", "ServiceMonitor", "servicemonitors"),
                 optional_crd("monitoring.coreos.com", "PrometheusRule", "prometheusrules")]

FAST = {"PROMPTCACHE_OPERATOR_RESYNC_SECONDS": "2", "PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS": "1"}


@pytest.fixture
def operator(start_operator, crd, kube, namespace):
    """One standalone operator, warmed up: it has reconciled a canary PromptCache."""
    op = start_operator("--standalone", env=FAST)
    apply_pc(kube, namespace, example(), name="canary")
    wait_for(lambda: all_present(kube, namespace, "canary"), timeout=60, what="operator warm-up (canary children)\n"
             + op.log.name)
    return op


def test_children_created_with_owner_references_within_5s(operator, kube, namespace):
    start = time.monotonic()
    pc = apply_pc(kube, namespace, example())
    got = wait_for(lambda: all_present(kube, namespace, "llama-8b"), timeout=5, interval=0.02,
                   what="all children within 5 s")
    elapsed = time.monotonic() - start
    print(f"apply -> all {len(got)} children: {elapsed * 1000:.0f} ms")
    uid = pc["metadata"]["uid"]
    for key, obj in got.items():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": PC_API, "kind": "PromptCache", "name": "llama-8b", "uid": uid,
                       "controller": True, "blockOwnerDeletion": True}, key
        assert any(m["manager"] == "promptcache-operator" and m["operation"] == "Apply"
                   for m in obj["metadata"]["managedFields"]), key
    # What was applied is exactly what the pure builders compute.
    spec = PromptCacheSpec.from_dict(get_pc(kube, namespace, "llama-8b")["spec"])
    want = builders.config_map(spec, Owner("llama-8b", namespace, uid))
    assert got["ConfigMap/llama-8b-config"]["data"] == want["data"]
    svc = got["Service/llama-8b"]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert got["Service/llama-8b-metrics"]["spec"]["clusterIP"] == "None"
    quota = got["ResourceQuota/llama-8b-quota"]
    assert quota["spec"]["scopeSelector"]["matchExpressions"][0]["scopeName"] == "PriorityClass"

    # Status tells the truth: no DaemonSet controller runs here, so the rollout is pending.
    def status_written():
        s = get_pc(kube, namespace, "llama-8b").get("status") or {}
        return s if s.get("observedGeneration") == 1 and s.get("conditions") else None
    status = wait_for(status_written, timeout=5, what="status")
    c = conditions({"status": status})
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "WaitingForDaemonSetController"
    assert c["Progressing"]["status"] == "True"
    assert c["Degraded"]["status"] == "False", c["Degraded"]
    assert all(x["observedGeneration"] == 1 and x["lastTransitionTime"] for x in c.values())
    assert c["Autoscaling"]["status"] == "False" and c["Autoscaling"]["reason"] == "CRDNotInstalled"
    assert "verticalpodautoscalers.autoscaling.k8s.io" in c["Autoscaling"]["message"]
    assert c["Monitoring"]["reason"] == "CRDNotInstalled"
    assert sorted(status["children"]) == sorted(got)


def test_a_cache_naming_no_priority_class_gets_the_operators_default(start_operator, crd, kube, namespace):
    """The CRD defaults no spec.placement.priorityClassName: the operator's own default
    (PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS, the chart's priorityClass.name) reaches the pods and the quota,
    status.priorityClassName (kept by the CRD's status schema) says which, and a missing one is PriorityClassNotFound
    until it exists."""
    pc = f"{namespace}-gpu-cache"
    start_operator("--standalone", env={**FAST, "PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS": pc})
    apply_pc(kube, namespace, example())
    got = wait_for(lambda: all_present(kube, namespace, "llama-8b"), timeout=30, what="children")
    assert "priorityClassName" not in get_pc(kube, namespace, "llama-8b")["spec"]["placement"]
    assert got["DaemonSet/llama-8b"]["spec"]["template"]["spec"]["priorityClassName"] == pc
    assert got["ResourceQuota/llama-8b-quota"]["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == [pc]

    def degraded(reason):
        s = get_pc(kube, namespace, "llama-8b").get("status") or {}
        d = conditions({"status": s}).get("Degraded") or {}
        return s if d.get("reason") == reason else None
    status = wait_for(lambda: degraded("PriorityClassNotFound"), timeout=15, what="PriorityClassNotFound")
    assert status["priorityClassName"] == pc
    message = conditions({"status": status})["Degraded"]["message"]
    assert message.startswith(f"PriorityClass {pc} (the operator's default"), message
    kube.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses",
                 body={"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": pc},
                       "value": 1000})
    try:
        status = wait_for(lambda: degraded("AsExpected"), timeout=20, what="Degraded cleared once it exists")
        assert status["priorityClassName"] == pc
    finally:
        kube.request("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{pc}")


def test_spec_change_updates_children(operator, kube, namespace):
    apply_pc(kube, namespace, example())
    before = wait_for(lambda: all_present(kube, namespace, "llama-8b"), timeout=5)
    doc = example()
    doc["spec"]["memory"]["host"] = "8Gi"
    doc["spec"]["cachePolicy"] = {"ttlSeconds": 60, "quantization": "k8v8"}
    apply_pc(kube, namespace, doc)

    def updated():
        got = children(kube, namespace, "llama-8b")
        cm = got["ConfigMap/llama-8b-config"]["data"]
        quota = got["ResourceQuota/llama-8b-quota"]["spec"]["hard"]
        return got if (cm["PROMPTCACHE_TTL_SECONDS"] == "60" and cm["PROMPTCACHE_QUANTIZATION"] == "k8v8"
                       and quota["requests.memory"] != before["ResourceQuota/llama-8b-quota"]["spec"]["hard"][
                           "requests.memory"]) else None
    after = wait_for(updated, timeout=5, what="children updated")
    ds_b = before["DaemonSet/llama-8b"]["spec"]["template"]
    ds_a = after["DaemonSet/llama-8b"]["spec"]["template"]
    assert ds_a["metadata"]["annotations"][builders.CONFIG_HASH_ANNOTATION] != \
        ds_b["metadata"]["annotations"][builders.CONFIG_HASH_ANNOTATION]  # pods roll on config change
    assert ds_a["spec"]["containers"][0]["resources"]["requests"]["memory"] == "8704Mi"
    assert after["ResourceQuota/llama-8b-quota"]["spec"]["hard"]["requests.memory"] == "850Gi"  # 100 x 8704Mi
    assert after["ConfigMap/llama-8b-config"]["data"]["PROMPTCACHE_MEMORY_BYTES"] == str(8 * 2**30)
    wait_for(lambda: (get_pc(kube, namespace, "llama-8b").get("status") or {}).get("observedGeneration") == 2,
             timeout=5, what="observedGeneration 2")


def test_delete_leaves_only_what_gc_removes(operator, kube, namespace):
    pc = apply_pc(kube, namespace, example())
    got = wait_for(lambda: all_present(kube, namespace, "llama-8b"), timeout=5)
    kube.delete(PC_API, "PromptCache", namespace, "llama-8b")
    # No finalizer holds the PromptCache back (the operator registers no delete handler).
    wait_for(lambda: get_pc(kube, namespace, "llama-8b") is None, timeout=5, what="PromptCache gone")
    # Everything the operator made for it carries an owner reference to the deleted uid, so the garbage
    # collector (absent here) removes all of it.
    labelled = []
    for api, plural in (("api/v1", "configmaps"), ("apis/apps/v1", "daemonsets"), ("api/v1", "services"),
                        ("api/v1", "resourcequotas")):
        items = kube.request("GET", f"/{api}/namespaces/{namespace}/{plural}",
                             query=[("labelSelector", f"{builders.CACHE_LABEL}=llama-8b")])["items"]
        labelled += items
    assert len(labelled) == len(got)
    for obj in labelled:
        refs = obj["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == [pc["metadata"]["uid"]], obj["metadata"]["name"]
    time.sleep(3)  # a resync period: the operator does not recreate anything for the deleted object
    assert get_pc(kube, namespace, "llama-8b") is None


def test_optional_crds_missing_then_installed(operator, kube, namespace):
    doc = example()
    doc["spec"]["autoscaling"] = {"enabled": True, "minMemory": "8Gi", "maxMemory": "32Gi"}
    apply_pc(kube, namespace, doc)

    def cond(type_, status, reason=None):
        def check():
            c = conditions(get_pc(kube, namespace, "llama-8b")).get(type_)
            return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
        return check
    deg = wait_for(cond("Degraded", "True", "OptionalCRDMissing"), timeout=5, what="Degraded: VPA CRD missing")
    assert "verticalpodautoscalers.autoscaling.k8s.io" in deg["message"]
    assert cond("Autoscaling", "False", "CRDNotInstalled")()
    assert all_present(kube, namespace, "llama-8b")  # the core children exist regardless

    try:
        for c in OPTIONAL_CRDS:
            apply_crd(kube, c)
        # Picked up by the resync timer (no event on the PromptCache itself).
        got = wait_for(lambda: all_present(kube, namespace, "llama-8b", CORE_CHILDREN + OPTIONAL_CHILDREN),
                       timeout=15, what="VPA, ServiceMonitor, PrometheusRule created")
        vpa = got["VerticalPodAutoscaler/llama-8b"]
        # Off until the autoscaler decides: the VPA's recommender must not evict cache pods on its own.
        assert vpa["spec"]["updatePolicy"]["updateMode"] == "Off"
        # kube-prometheus-stack's default selectors match its release label.
        for key in ("ServiceMonitor/llama-8b", "PrometheusRule/llama-8b"):
            assert got[key]["metadata"]["labels"]["release"] == "kube-prometheus-stack", key
        assert vpa["spec"]["resourcePolicy"]["containerPolicies"][0]["maxAllowed"] == {"memory": "32Gi"}
        for key in ("VerticalPodAutoscaler/llama-8b", "ServiceMonitor/llama-8b", "PrometheusRule/llama-8b"):
            assert got[key]["metadata"]["ownerReferences"][0]["kind"] == "PromptCache"
        wait_for(cond("Degraded", "False"), timeout=10, what="Degraded False once the VPA CRD exists")
        wait_for(cond("Autoscaling", "True"), timeout=5)
        wait_for(cond("Monitoring", "True"), timeout=5)
        # Disabling alerts removes the PrometheusRule.
        doc["spec"]["alerts"] = {"enabled": False}
        apply_pc(kube, namespace, doc)
        wait_for(lambda: kube.get(*builders.PROMETHEUS_RULE, namespace, "llama-8b") is None, timeout=5,
                 what="PrometheusRule pruned")
    finally:
        for c in OPTIONAL_CRDS:
            try:
                kube.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{c['metadata']['name']}")
            except ApiError:
                pass
        for c in OPTIONAL_CRDS:
            wait_for(lambda c=c: _crd_gone(kube, c), timeout=30, what="optional CRD removed")


def _crd_gone(kube, c) -> bool:
    try:
        kube.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{c['metadata']['name']}")
        return False
    except ApiError as exc:
        return exc.status == 404


def test_daemonset_draws_no_pod_security_warning(kube, crd, namespace):
    kube.request("PATCH", f"/api/v1/namespaces/{namespace}", content_type="application/merge-patch+json",
                 body={"metadata": {"labels": {"pod-security.kubernetes.io/warn": "restricted",
                                               "pod-security.kubernetes.io/warn-version": "latest",
                                               "pod-security.kubernetes.io/audit": "restricted"}}})
    owner = Owner("llama-8b", namespace, "00000000-0000-0000-0000-000000000009")
    for name in ("minimal", "full"):
        spec = PromptCacheSpec.from_dict(_restricted_spec(example(name)))
        ds = builders.desired_children(spec, owner, Capabilities(), OperatorDefaults())[1]
        assert ds["kind"] == "DaemonSet"
        if name == "full":  # spec.security: the Secrets are mounted as volumes, probes are tcpSocket
            assert {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"] if "secret" in v} == {
                "tls", "tokens", "tenant-secret"}
        ds["metadata"].pop("ownerReferences")  # the owner uid is made up here
        _, _, warnings = kube.apply(ds, with_headers=True)
        assert warnings == [], warnings
    # Control: the same API server does warn about a DaemonSet that breaks the restricted profile.
    bad = copy.deepcopy(ds)
    bad["metadata"]["name"] = "bad"
    bad["spec"]["template"]["spec"]["hostNetwork"] = True
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    _, _, warnings = kube.apply(bad, with_headers=True)
    assert any("restricted" in w for w in warnings), warnings
    # spec.zeroCopy (the full example sets it): what `restricted` refuses is exactly its socket directory (a hostPath)
    # and the init container that hands it to uid 65532 (root, CHOWN and FOWNER): docs/operator.md says privileged.
    zc = builders.desired_children(PromptCacheSpec.from_dict(example("full")["spec"]), owner, Capabilities(),
                                   OperatorDefaults())[1]
    zc["metadata"].pop("ownerReferences")
    zc["metadata"]["name"] = "zero-copy"
    _, _, warnings = kube.apply(zc, with_headers=True)
    (w,) = warnings
    w = w.replace('\\"', '"')
    named = re.findall(r'(?:container|volume) "([^"]+)"', w)
    assert "restricted:latest" in w and '"hostPath"' in w and set(named) == {"socket-dir", "bulk-socket"}, w


@pytest.mark.parametrize("ha", [False, True])
@pytest.mark.parametrize("tls", [False, True])
def test_network_policies_are_taken_as_built(kube, namespace, ha, tls):
    """The cluster tier's NetworkPolicies, applied as built (TLS or not: the bulk port; HA or not: the masters'
    rule): the API server takes them without a warning and stores exactly that spec (nothing it defaults differs,
    so a resync's apply changes nothing)."""
    owner = Owner("qwen-32b", namespace, "00000000-0000-0000-0000-000000000009")
    spec = _restricted_spec(example("full"))
    spec["cluster"] = {"enabled": True, **({"master": {"replicas": 2, "etcdEndpoints": ["etcd:2379"]}} if ha else {})}
    if not tls:  # (the tokens stay: isolated tenants need them)
        spec["security"] = {k: v for k, v in spec["security"].items() if k != "tls"}
    policies = [c for c in builders.desired_children(PromptCacheSpec.from_dict(spec), owner, Capabilities())
                if c["kind"] == "NetworkPolicy"]
    assert len(policies) == 2
    assert (builders.BULK_PORT in {p["port"] for r in policies[1]["spec"]["ingress"] for p in r.get("ports", [])}) \
        == (not tls)
    for policy in policies:
        policy["metadata"].pop("ownerReferences")  # the owner uid is made up here
        got, _, warnings = kube.apply(policy, with_headers=True)
        assert warnings == [], warnings
        assert got["spec"] == policy["spec"]


def test_operator_created_daemonset_passes_restricted(start_operator, crd, kube, namespace):
    """With `enforce=restricted` on the namespace as well, the operator's own DaemonSet is admitted, and a dry-run
    re-apply of it returns no warning."""
    kube.request("PATCH", f"/api/v1/namespaces/{namespace}", content_type="application/merge-patch+json",
                 body={"metadata": {"labels": {"pod-security.kubernetes.io/warn": "restricted",
                                               "pod-security.kubernetes.io/enforce": "restricted"}}})
    op = start_operator("--standalone", env=FAST)
    full = example("full")
    full["spec"] = _restricted_spec(full)  # spec.zeroCopy needs privileged (test_daemonset_draws_no_pod_security_...)
    apply_pc(kube, namespace, full)
    got = wait_for(lambda: all_present(kube, namespace, "qwen-32b", CORE_CHILDREN + CLUSTER_CHILDREN), timeout=30,
                   what="children")
    for kind, name in (("DaemonSet", "qwen-32b"), ("Deployment", "qwen-32b-mooncake-master")):
        body = {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name, "namespace": namespace},
                "spec": got[f"{kind}/{name}"]["spec"]}
        _, _, warnings = kube.request("PATCH", object_path("apps/v1", kind, namespace, name), body=body,
                                      content_type="application/apply-patch+yaml", with_headers=True,
                                      query=[("fieldManager", "check"), ("dryRun", "All"), ("force", "true")])
        assert warnings == [], kind
    assert "API server warning" not in op.output()


def test_restart_mid_reconcile_converges(start_operator, crd, kube, namespace):
    # A fault from outside the operator: a ResourceQuota in the namespace that allows no DaemonSet and no Service,
    # so the API server refuses 3 of the 5 core children (403, exceeded quota) and the first operator gets only
    # 2 applied. It is killed (-9) in that state; the quota goes; a second operator starts.
    hard = {"count/daemonsets.apps": "0", "services": "0"}
    kube.request("POST", f"/api/v1/namespaces/{namespace}/resourcequotas",
                 body={"apiVersion": "v1", "kind": "ResourceQuota",
                       "metadata": {"name": "no-daemonsets-or-services", "namespace": namespace},
                       "spec": {"hard": hard}})
    # No quota controller runs here: the usage it would record (nothing yet), so admission compares against it.
    kube.request("PATCH", f"/api/v1/namespaces/{namespace}/resourcequotas/no-daemonsets-or-services/status",
                 content_type="application/merge-patch+json",
                 body={"status": {"hard": hard, "used": {k: "0" for k in hard}}})
    first = start_operator("--standalone", name="first", env=FAST)
    pc = apply_pc(kube, namespace, example("full"))

    def refused():
        degraded = conditions(get_pc(kube, namespace, "qwen-32b")).get("Degraded") or {}
        return degraded.get("reason") == "ApplyFailed" and "exceeded quota" in degraded.get("message", "")
    wait_for(refused, timeout=60, what="first operator refused some children")
    partial = children(kube, namespace, "qwen-32b")
    assert sum(v is not None for v in partial.values()) == 2, {k: v is not None for k, v in partial.items()}
    first.kill(signal.SIGKILL)
    kube.delete("v1", "ResourceQuota", namespace, "no-daemonsets-or-services")

    start_operator("--standalone", env=FAST, name="second")
    got = wait_for(lambda: all_present(kube, namespace, "qwen-32b", CORE_CHILDREN + CLUSTER_CHILDREN), timeout=60,
                   what="convergence after restart")
    # Same state as an uninterrupted reconcile computes.
    spec = PromptCacheSpec.from_dict(get_pc(kube, namespace, "qwen-32b")["spec"])
    owner = Owner("qwen-32b", namespace, pc["metadata"]["uid"])
    want = {builders.child_key(c): c for c in builders.desired_children(spec, owner, Capabilities())}
    assert set(want) == set(got)
    assert got["ConfigMap/qwen-32b-config"]["data"] == want["ConfigMap/qwen-32b-config"]["data"]
    assert got["DaemonSet/qwen-32b"]["spec"]["template"]["metadata"]["annotations"] == \
        want["DaemonSet/qwen-32b"]["spec"]["template"]["metadata"]["annotations"]
    assert got["ResourceQuota/qwen-32b-quota"]["spec"]["hard"] == want["ResourceQuota/qwen-32b-quota"]["spec"]["hard"]
    wait_for(lambda: (get_pc(kube, namespace, "qwen-32b").get("status") or {}).get("observedGeneration") == 1,
             timeout=10, what="status after restart")
    # No controller manager here: the master Deployment never gets a ready replica, and the status says so.
    assert get_pc(kube, namespace, "qwen-32b")["status"]["clusterMasterReady"] is False
    # And it stays put: resyncs re-apply identical state without bumping resourceVersions.
    rv = {k: v["metadata"]["resourceVersion"] for k, v in got.items()}
    time.sleep(4.5)
    now = children(kube, namespace, "qwen-32b", CORE_CHILDREN + CLUSTER_CHILDREN)
    assert {k: v["metadata"]["resourceVersion"] for k, v in now.items()} == rv


def _priority(op) -> int:
    m = wait_for(lambda: re.search(r"peering promptcache-operator, priority (\d+)", op.output()), timeout=60,
                 what="operator start")
    return int(m.group(1))


def test_two_replicas_do_not_fight(start_operator, crd, kube, namespace):
    """Two replicas with kopf peering (as the chart deploys them): the one with the higher priority works, the
    other stands by; no resourceVersion churn; when the active one stops, the standby takes over."""
    a = start_operator(env=FAST, name="replica-a")
    b = start_operator(env=FAST, name="replica-b")
    active, standby = (a, b) if _priority(a) > _priority(b) else (b, a)

    def peers():
        st = kube.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/promptcache-operator").get("status") or {}
        return len(st) == 2
    wait_for(peers, timeout=60, what="both replicas registered in the ClusterKopfPeering")
    time.sleep(1.5)  # let the lower-priority replica process the peering event and pause
    names = [f"pc-{i}" for i in range(3)]
    for n in names:
        apply_pc(kube, namespace, example(), name=n)
    for n in names:
        wait_for(lambda n=n: all_present(kube, namespace, n), timeout=15, what=f"children of {n}")
    for n in names:
        wait_for(lambda n=n: (get_pc(kube, namespace, n).get("status") or {}).get("observedGeneration") == 1,
                 timeout=10, what=f"status of {n}")
    time.sleep(1)  # kopf's own bookkeeping patch right after the handler
    rv = {n: {k: v["metadata"]["resourceVersion"] for k, v in children(kube, namespace, n).items()} for n in names}
    pc_rv = {n: get_pc(kube, namespace, n)["metadata"]["resourceVersion"] for n in names}
    time.sleep(5)  # two resync periods
    assert {n: {k: v["metadata"]["resourceVersion"] for k, v in children(kube, namespace, n).items()}
            for n in names} == rv, "children keep changing: the replicas fight"
    assert {n: get_pc(kube, namespace, n)["metadata"]["resourceVersion"] for n in names} == pc_rv
    wait_for(lambda: all(f"reconciled {namespace}/{n}" in active.output() for n in names), timeout=10,
             what="the active replica reconciled every PromptCache")
    assert f"reconciled {namespace}/" not in standby.output(), "the standby replica worked too"

    # Hand-over: the active replica stops (as in a rolling update); the standby resumes and serves new objects.
    active.kill(signal.SIGTERM)
    apply_pc(kube, namespace, example(), name="after-handover")
    wait_for(lambda: all_present(kube, namespace, "after-handover"), timeout=30, what="standby took over")
    wait_for(lambda: f"reconciled {namespace}/after-handover" in standby.output(), timeout=10,
             what="the standby reconciled it")


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop to uid 65532")
def test_operator_runs_as_a_uid_without_a_passwd_entry(start_operator, crd, kube, namespace):
    """The chart's uid 65532 with no passwd entry and no USER/LOGNAME (as in a pod of the operator image before it
    had one): kopf's default peering identity (getpass.getuser()) raised KeyError and the pod crash-looped. The
    operator, a real process under that uid, joins the peering under its own identity and reconciles."""
    uid = 65532
    try:
        pwd.getpwuid(uid)
        pytest.skip(f"uid {uid} has a passwd entry on this machine")
    except KeyError:
        pass
    # Only DAC capabilities are kept (ambient), so this uid can read the checkout and venv under /root.
    caps = "+dac_override,+dac_read_search"
    wrap = ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", f"--inh-caps={caps}",
            f"--ambient-caps={caps}", "--")
    op = start_operator(env=FAST, name="uid65532", wrap=wrap,
                        unset=("USER", "LOGNAME", "LNAME", "USERNAME", "POD_ID", "POD_NAME"))

    def registered():
        st = kube.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/promptcache-operator").get("status") or {}
        return [k for k in st if k.startswith(f"uid{uid}@")]
    wait_for(lambda: registered() or op.proc.poll() is not None, timeout=60,
             what="the uid-65532 operator in the ClusterKopfPeering")
    assert op.proc.poll() is None, f"the operator exited {op.proc.returncode}:\n{op.output()[-3000:]}"
    apply_pc(kube, namespace, example(), name="nopasswd")
    wait_for(lambda: all_present(kube, namespace, "nopasswd"), timeout=60, what="children of nopasswd")
    assert "getpwuid" not in op.output()
    assert op.proc.poll() is None


def test_status_reports_nodes_hit_ratio_and_readiness(start_operator, crd, kube, namespace):
    """Stand-ins for what a kubelet and the DaemonSet controller would write (a Pod bound to a node with an IP,
    the DaemonSet's status), plus a metrics endpoint on loopback: the operator's status follows them."""
    import http.server
    import threading

    body = "\n".join(['promptcache_hit_tokens_total{rpc="Lookup",tier="device"} 750',
                      'promptcache_missed_tokens_total{rpc="Lookup"} 250',
                      'promptcache_stored_bytes{tier="device"} 123456']).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        start_operator("--standalone", env=FAST)
        pc = apply_pc(kube, namespace, example())
        got = wait_for(lambda: all_present(kube, namespace, "llama-8b"), timeout=30, what="children")
        owner = Owner("llama-8b", namespace, pc["metadata"]["uid"])
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "llama-8b-abcde", "namespace": namespace, "labels": builders.labels(owner)},
               "spec": {"nodeName": "gpu-node-1", "containers": [{
                   "name": "sidecar", "image": "sidecar:test",
                   "ports": [{"name": "metrics", "containerPort": port}]}]}}   # where the operator scrapes
        kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=pod)
        kube.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/llama-8b-abcde/status",
                     content_type="application/merge-patch+json",
                     body={"status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                                      "conditions": [{"type": "Ready", "status": "True"}]}})
        gen = got["DaemonSet/llama-8b"]["metadata"]["generation"]
        kube.request("PATCH", f"/apis/apps/v1/namespaces/{namespace}/daemonsets/llama-8b/status",
                     content_type="application/merge-patch+json",
                     body={"status": {"observedGeneration": gen, "desiredNumberScheduled": 1, "numberReady": 1,
                                      "updatedNumberScheduled": 1, "currentNumberScheduled": 1,
                                      "numberMisscheduled": 0, "numberAvailable": 1}})

        def ready():
            st = get_pc(kube, namespace, "llama-8b").get("status") or {}
            return st if conditions({"status": st}).get("Ready", {}).get("status") == "True" else None
        st = wait_for(ready, timeout=15, what="Ready=True")
        assert st["nodes"] == [{"nodeName": "gpu-node-1", "endpoint": "127.0.0.1:50051", "ready": True}]
        assert st["hitRatio"] == 0.75 and st["memoryBytes"] == 123456
        assert (st["desiredNodes"], st["readyNodes"]) == (1, 1)
        c = conditions({"status": st})
        assert c["Ready"]["reason"] == "AllSidecarsReady"
        assert c["Progressing"]["status"] == "False"
        # kubectl's view: the printer columns show it.
        cfg = kube.cfg
        r = kube.pool.request("GET", f"{cfg.host}/apis/promptcache.io/v1alpha1/namespaces/{namespace}/promptcaches",
                              headers={"Authorization": kube.authorization(),
                                       "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
        import json
        table = json.loads(r.data)
        cols = [c["name"] for c in table["columnDefinitions"]]
        row = dict(zip(cols, table["rows"][0]["cells"]))
        assert (row["Ready"], row["Desired"], row["Hit-Ratio"], row["Memory"], row["Status"]) == \
            (1, 1, 0.75, "16Gi", "AllSidecarsReady")
    finally:
        server.shutdown()


def test_children_deleted_or_edited_by_hand_are_repaired_within_2s(start_operator, crd, kube, namespace):
    """The children are watched: drift is repaired at once, not at the next resync (set to 5 minutes here, so
    only the watch can do it)."""
    op = start_operator("--standalone", env={**FAST, "PROMPTCACHE_OPERATOR_RESYNC_SECONDS": "300"})
    apply_pc(kube, namespace, example())
    got = wait_for(lambda: all_present(kube, namespace, "llama-8b"), timeout=60, what="children\n" + op.log.name)
    ds_path = object_path("apps/v1", "DaemonSet", namespace, "llama-8b")
    image = got["DaemonSet/llama-8b"]["spec"]["template"]["spec"]["containers"][0]["image"]

    # An image edited by hand (as `kubectl set image` would, another field manager) is put back.
    kube.request("PATCH", ds_path, content_type="application/strategic-merge-patch+json",
                 query=[("fieldManager", "kubectl-set")],
                 body={"spec": {"template": {"spec": {"containers": [{"name": "sidecar", "image": "evil:latest"}]}}}})
    start = time.monotonic()
    wait_for(lambda: kube.get("apps/v1", "DaemonSet", namespace, "llama-8b")["spec"]["template"]["spec"]
             ["containers"][0]["image"] == image, timeout=2, interval=0.02, what="image edit reverted within 2 s")
    print(f"edited image reverted after {(time.monotonic() - start) * 1000:.0f} ms")

    # Children deleted by hand come back.
    for api, kind, name in (("apps/v1", "DaemonSet", "llama-8b"), ("v1", "Service", "llama-8b"),
                            ("v1", "ConfigMap", "llama-8b-config")):
        old_uid = kube.get(api, kind, namespace, name)["metadata"]["uid"]
        kube.delete(api, kind, namespace, name)
        start = time.monotonic()

        def recreated():
            obj = kube.get(api, kind, namespace, name)
            return obj is not None and obj["metadata"]["uid"] != old_uid
        wait_for(recreated, timeout=2, interval=0.02, what=f"{kind}/{name} recreated within 2 s")
        print(f"{kind}/{name} recreated after {(time.monotonic() - start) * 1000:.0f} ms")

    # Steady state: the operator's own applies raise no events, so it does not reconcile in a loop.
    reconciles = lambda: op.output().count("reconciled ")  # noqa: E731
    time.sleep(1.0)
    settled = reconciles()
    time.sleep(3.0)
    assert reconciles() - settled <= 1, op.output()[-3000:]


def test_operator_without_its_peering_object_refuses_to_start(start_operator, crd, kube):
    """Without --standalone kopf would wait for a missing peering object silently, doing nothing."""
    op = start_operator("--peering", "no-such-peering", env=FAST)
    assert op.proc.wait(timeout=60) == 2
    out = op.output()
    assert "ClusterKopfPeering 'no-such-peering'" in out and "--standalone" in out, out[-2000:]


def test_crd_refuses_pod_settings_that_would_break_the_operator(crd, kube, namespace):
    doc = example()
    doc["spec"]["pod"] = {"labels": {"promptcache.io/cache": "other"}}
    with pytest.raises(ApiError) as exc:
        apply_pc(kube, namespace, doc, name="bad-labels")
    assert exc.value.status == 422 and "spec.pod.labels may not set" in exc.value.body
    doc["spec"]["pod"] = {"imagePullSecrets": [{"name": "Bad_Name"}]}
    with pytest.raises(ApiError) as exc:
        apply_pc(kube, namespace, doc, name="bad-secret")
    assert exc.value.status == 422 and "imagePullSecrets" in exc.value.body
    doc["spec"]["pod"] = {"serviceAccountName": "cache-sa", "imagePullSecrets": [{"name": "regcred"}],
                          "labels": {"team": "ml"}, "annotations": {"example.com/x": "y"}}
    ok = apply_pc(kube, namespace, doc, name="good-pod")
    assert ok["spec"]["pod"]["serviceAccountName"] == "cache-sa"
    defaulted = apply_pc(kube, namespace, example(), name="defaulted-pod")
    assert defaulted["spec"]["pod"] == {"serviceAccountName": "default"}


def test_operator_exports_each_caches_conditions(operator, kube, namespace):
    """PromptCacheDegraded reads the operator's own series: a cache's conditions appear, follow the status, and
    go when the cache is deleted."""
    import re as _re

    apply_pc(kube, namespace, example())
    wait_for(lambda: all_present(kube, namespace, "llama-8b"), timeout=10)

    def value(cond: str) -> float | None:
        m = _re.search(rf'promptcache_operator_cache_condition{{condition="{cond}",name="llama-8b",'
                       rf'namespace="{namespace}"}} (\S+)', operator.metrics())
        return float(m.group(1)) if m else None
    # No DaemonSet controller runs here: Ready is False, Progressing True, Degraded False.
    wait_for(lambda: value("Progressing") == 1.0 and value("Ready") == 0.0 and value("Degraded") == 0.0,
             timeout=10, what="conditions exported")
    assert 'promptcache_operator_reconciles_total{name="llama-8b",namespace="%s",result="ok"}' % namespace \
        in operator.metrics()
    kube.delete(PC_API, "PromptCache", namespace, "llama-8b")
    wait_for(lambda: value("Ready") is None, timeout=10, what="series dropped with the cache")
