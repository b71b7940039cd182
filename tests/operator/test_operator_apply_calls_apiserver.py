"""apply_controlled() against the real API server: a steady reconcile applies each child in one call (no read
first), and the ownership guarantee holds all the same: an object changed since the operator last wrote it is read
again, and one that is no longer controlled by the PromptCache (orphaned, replaced by someone else's, or changed
between the operator's read and its write) is left untouched and reported (Degraded, NameConflict)."""
from __future__ import annotations

from typing import Any

import pytest

from promptcache.operator.kube import Kube, configuration_from_environment, object_path
from promptcache.operator.reconcile import reconcile
from test_operator_apiserver import apply_pc, conditions, example, get_pc

pytestmark = pytest.mark.apiserver


class Counting(Kube):
    """The operator's client, counting its calls (method, path)."""

    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.calls: list[tuple[str, str]] = []
        self.after_get = None   # called with (kind, name, got) after each read of an object

    def request(self, method: str, path: str, *a: Any, **k: Any) -> Any:
        self.calls.append((method, path))
        return super().request(method, path, *a, **k)

    def get(self, api_version: str, kind: str, namespace: str | None, name: str):
        got = super().get(api_version, kind, namespace, name)
        if self.after_get:
            self.after_get(kind, name, got)
        return got


@pytest.fixture
def as_operator(operator_kubeconfig) -> Counting:
    return Counting(configuration_from_environment(str(operator_kubeconfig)), crd_cache_seconds=0)


def _child_calls(k: Counting, paths: set[str]) -> tuple[list[str], list[str]]:
    gets = [p for m, p in k.calls if m == "GET" and p in paths]
    applies = [p for m, p in k.calls if m == "PATCH" and p in paths]
    return gets, applies


def _first_reconcile(kube, k: Counting, namespace: str, name: str) -> set[str]:
    apply_pc(kube, namespace, example(), name)
    out = reconcile(k, get_pc(kube, namespace, name))
    assert not out.errors and not out.conflicts, (out.errors, out.conflicts)
    paths = {p for m, p in k.calls if m == "PATCH" and not p.endswith("/status")}
    assert len(paths) == len(out.applied) >= 5
    return paths


def test_a_steady_reconcile_applies_each_child_in_one_call(kube, crd, namespace, as_operator):
    paths = _first_reconcile(kube, as_operator, namespace, "steady")
    gets, applies = _child_calls(as_operator, paths)
    print(f"first reconcile: {len(gets)} child GETs, {len(applies)} applies")   # each child read, then created
    for _ in range(2):
        as_operator.calls.clear()
        out = reconcile(as_operator, get_pc(kube, namespace, "steady"))
        assert not out.errors and not out.conflicts
        gets, applies = _child_calls(as_operator, paths)
        print(f"steady reconcile: {len(gets)} child GETs, {len(applies)} applies, {len(as_operator.calls)} calls")
        assert gets == [] and sorted(applies) == sorted(paths)

    # The DaemonSet controller writes its status: that child alone is read again, then applied.
    ds = object_path("apps/v1", "DaemonSet", namespace, "steady")
    kube.request("PATCH", ds + "/status", body={"status": {"desiredNumberScheduled": 0, "currentNumberScheduled": 0,
                                                           "numberMisscheduled": 0, "numberReady": 0,
                                                           "observedGeneration": 1}},
                 content_type="application/merge-patch+json")
    as_operator.calls.clear()
    out = reconcile(as_operator, get_pc(kube, namespace, "steady"))
    assert not out.errors and not out.conflicts
    gets, applies = _child_calls(as_operator, paths)
    assert gets == [ds]
    assert applies.count(ds) == 2 and len(applies) == len(paths) + 1   # refused as changed (409), read, applied


def test_children_orphaned_or_replaced_since_the_last_write_are_left_alone(kube, crd, namespace, as_operator):
    _first_reconcile(kube, as_operator, namespace, "moved")
    cm_path = object_path("v1", "ConfigMap", namespace, "moved-config")
    # Someone with write access orphans the ConfigMap (its controller ownerReference removed) ...
    orphan = kube.request("PATCH", cm_path, body={"metadata": {"ownerReferences": None}},
                          content_type="application/merge-patch+json")
    # ... and replaces the node-local Service by one of their own.
    kube.delete("v1", "Service", namespace, "moved")
    svc = kube.request("POST", object_path("v1", "Service", namespace),
                       body={"apiVersion": "v1", "kind": "Service", "metadata": {"name": "moved"},
                             "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]}})
    out = reconcile(as_operator, get_pc(kube, namespace, "moved"))
    assert not out.errors, out.errors
    assert len(out.conflicts) == 2 and {c.split(" ")[0] for c in out.conflicts} == {"ConfigMap/moved-config",
                                                                                    "Service/moved"}
    for before, (kind, name) in ((orphan, ("ConfigMap", "moved-config")), (svc, ("Service", "moved"))):
        after = kube.get("v1", kind, namespace, name)
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], kind  # not written
        assert not after["metadata"].get("ownerReferences"), kind
    assert conditions(get_pc(kube, namespace, "moved"))["Degraded"]["reason"] == "NameConflict"


def test_a_child_orphaned_between_the_read_and_the_write_is_left_alone(kube, crd, namespace, operator_kubeconfig):
    """A fresh operator process (nothing remembered): it reads the ConfigMap, still its own; before its apply
    arrives, someone orphans it. The apply is refused (the object changed since the read), the object read again,
    and left untouched."""
    name = "raced"
    seed = Counting(configuration_from_environment(str(operator_kubeconfig)), crd_cache_seconds=0)
    _first_reconcile(kube, seed, namespace, name)
    cm_path = object_path("v1", "ConfigMap", namespace, f"{name}-config")
    fresh = Counting(configuration_from_environment(str(operator_kubeconfig)), crd_cache_seconds=0)
    orphaned: list[dict] = []

    def orphan_after_read(kind: str, child: str, got: Any) -> None:
        if kind == "ConfigMap" and child == f"{name}-config" and not orphaned:
            assert got["metadata"]["ownerReferences"]   # the read saw it controlled by the PromptCache
            orphaned.append(kube.request("PATCH", cm_path, body={"metadata": {"ownerReferences": None}},
                                         content_type="application/merge-patch+json"))
    fresh.after_get = orphan_after_read
    out = reconcile(fresh, get_pc(kube, namespace, name))
    assert orphaned and not out.errors, out.errors
    assert [c.split(" ")[0] for c in out.conflicts] == [f"ConfigMap/{name}-config"]
    after = kube.get("v1", "ConfigMap", namespace, f"{name}-config")
    assert after["metadata"]["resourceVersion"] == orphaned[0]["metadata"]["resourceVersion"]
    assert not after["metadata"].get("ownerReferences")


def test_a_child_that_changes_on_every_attempt_is_still_applied_after_a_check():
    """The pinned applies (uid and resourceVersion preconditions) conflict when another controller writes the child
    between the read and the write (a DaemonSet's status during a rollout). After APPLY_ATTEMPTS - 1 conflicts the
    last attempt applies as before the pins, right after reading and checking the controller: the reconcile goes
    on instead of failing where the unpinned apply never did."""
    from promptcache.operator.kube import APPLY_ATTEMPTS, ApiError, apply_controlled

    owner = "uid-owner"
    current = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "c", "namespace": "ns", "uid": "uid-c", "resourceVersion": "1",
                            "ownerReferences": [{"controller": True, "uid": owner}]}}

    class Busy:  # every pinned apply loses the race; each read sees a newer version
        applies: list[dict] = []

        def get(self, api_version, kind, namespace, name):
            md = current["metadata"]
            md["resourceVersion"] = str(int(md["resourceVersion"]) + 1)
            return current

        def apply(self, obj):
            self.applies.append(obj)
            if "resourceVersion" in obj["metadata"]:
                raise ApiError(409, '{"message": "the object has been modified"}')
            return current

    kube = Busy()
    wanted = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}, "data": {}}
    assert apply_controlled(kube, wanted, owner) is current
    assert len(kube.applies) == APPLY_ATTEMPTS and "resourceVersion" not in kube.applies[-1]["metadata"]
