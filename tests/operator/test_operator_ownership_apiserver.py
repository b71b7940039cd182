"""reconcile() as the chart's ServiceAccount against the real API server, where a tenant (who may only create
PromptCaches) names a PromptCache so that its children's names are objects someone else made (audit of the
operator's threat model, docs/security.md "The operator"): those objects are neither rewritten nor given a
controller ownerReference (through which the garbage collector would delete them with the PromptCache), nor
pruned; the status says which (Degraded, reason NameConflict)."""
from __future__ import annotations

import copy

import pytest

from promptcache.operator.kube import Kube, configuration_from_environment, object_path
from promptcache.operator.reconcile import reconcile
from test_operator_apiserver import apply_pc, conditions, example, get_pc

pytestmark = pytest.mark.apiserver


def admin_apply(kube, obj: dict) -> dict:
    md = obj["metadata"]
    return kube.request("PATCH", object_path(obj["apiVersion"], obj["kind"], md["namespace"], md["name"]),
                        body=obj, content_type="application/apply-patch+yaml",
                        query=[("fieldManager", "namespace-admin"), ("force", "true")])


@pytest.fixture
def as_operator(operator_kubeconfig) -> Kube:
    return Kube(configuration_from_environment(str(operator_kubeconfig)), crd_cache_seconds=0)


def test_children_names_held_by_the_admins_objects_are_left_alone(kube, crd, namespace, as_operator):
    quota = admin_apply(kube, {"apiVersion": "v1", "kind": "ResourceQuota",
                               "metadata": {"name": "compute-quota", "namespace": namespace},
                               "spec": {"hard": {"pods": "4", "requests.cpu": "2"}}})
    svc = admin_apply(kube, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": namespace},
                             "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]}})
    cm = admin_apply(kube, {"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": "payments-config", "namespace": namespace},
                            "data": {"DB_HOST": "db.internal"}})
    for name in ("compute", "web", "payments"):
        apply_pc(kube, namespace, example(), name)
        out = reconcile(as_operator, get_pc(kube, namespace, name))
        assert not out.errors, out.errors
        assert len(out.conflicts) == 1 and len(out.applied) == 4, (out.applied, out.conflicts)
        c = conditions(get_pc(kube, namespace, name))
        assert c["Degraded"]["reason"] == "NameConflict" and c["Ready"]["status"] == "False"
    for before, (kind, name) in ((quota, ("ResourceQuota", "compute-quota")), (svc, ("Service", "web")),
                                 (cm, ("ConfigMap", "payments-config"))):
        after = kube.get("v1", kind, namespace, name)
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], kind  # not written
        assert not after["metadata"].get("ownerReferences"), kind
    msg = conditions(get_pc(kube, namespace, "web"))["Degraded"]["message"]
    assert "Service/web already exists" in msg

    # Once the admin's object is gone, the next reconcile creates the child.
    kube.delete("v1", "Service", namespace, "web")
    out = reconcile(as_operator, get_pc(kube, namespace, "web"))
    assert not out.conflicts and "Service/web" in out.applied
    assert conditions(get_pc(kube, namespace, "web"))["Degraded"]["status"] == "False"


def test_pruning_leaves_objects_of_the_same_name_it_does_not_control(kube, crd, namespace, as_operator):
    """The cluster tier turned off: a Deployment / Service named like the master that another PromptCache
    controls stays, and so does an admin's NetworkPolicy named like the tier's; the cache's own master and
    NetworkPolicies go."""
    doc = example()
    apply_pc(kube, namespace, doc, "c1")
    other = copy.deepcopy(doc)
    other["spec"]["cluster"] = {"enabled": True}
    apply_pc(kube, namespace, other, "c2")
    assert not reconcile(as_operator, get_pc(kube, namespace, "c2")).errors
    # A PromptCache "c1" whose recorded status lists a master it never had (its name c1-mooncake-master is free):
    # the admin's Deployment of that name stays when c1 prunes it.
    dep = admin_apply(kube, {"apiVersion": "apps/v1", "kind": "Deployment",
                             "metadata": {"name": "c1-mooncake-master", "namespace": namespace},
                             "spec": {"selector": {"matchLabels": {"app": "x"}},
                                      "template": {"metadata": {"labels": {"app": "x"}},
                                                   "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}})
    # And the admin's NetworkPolicy named like c1's sidecar policy.
    policy = admin_apply(kube, {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                "metadata": {"name": "c1", "namespace": namespace},
                                "spec": {"podSelector": {"matchLabels": {"app": "x"}}, "policyTypes": ["Ingress"]}})
    body = get_pc(kube, namespace, "c1")
    body["status"] = {"children": ["Deployment/c1-mooncake-master", "Service/c1-mooncake-master",
                                   "NetworkPolicy/c1-mooncake-master", "NetworkPolicy/c1"]}
    out = reconcile(as_operator, body)
    assert out.deleted == [] and kube.get("apps/v1", "Deployment", namespace, "c1-mooncake-master") is not None
    assert kube.get("apps/v1", "Deployment", namespace, "c1-mooncake-master")["metadata"]["uid"] == \
        dep["metadata"]["uid"]
    assert kube.get("networking.k8s.io/v1", "NetworkPolicy", namespace, "c1")["metadata"]["uid"] == \
        policy["metadata"]["uid"]
    # c2 turns its tier off: its own master and NetworkPolicies are deleted.
    other["spec"]["cluster"] = {"enabled": False}
    apply_pc(kube, namespace, other, "c2")
    out = reconcile(as_operator, get_pc(kube, namespace, "c2"))
    assert sorted(out.deleted) == ["Deployment/c2-mooncake-master", "NetworkPolicy/c2",
                                   "NetworkPolicy/c2-mooncake-master", "Service/c2-mooncake-master"]
    assert kube.get("networking.k8s.io/v1", "NetworkPolicy", namespace, "c2") is None
