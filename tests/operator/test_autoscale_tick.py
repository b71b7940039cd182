"""autoscale.tick's actuation order and failure handling, with an in-memory stand-in for the Kubernetes I/O layer
(the real API server path is covered by test_closed_loop.py and test_autoscale_operator.py; this one covers the
VPA path, whose CRD the shared test API server must not carry, and the failure cases)."""
from __future__ import annotations

from typing import Any

import pytest

from promptcache.operator import autoscale, fleet, tuning
from promptcache.operator.builders import Capabilities, OperatorDefaults
from promptcache.operator.fleet import Counters, Observation
from promptcache.operator.model import quantity_bytes

Mi = 1 << 20
Gi = 1 << 30
LOG: list[str] = []


class FakeKube:
    def __init__(self, vpa: bool):
        self.caps = Capabilities(vpa=vpa)
        self.objects: dict[str, dict[str, Any]] = {}
        self.status: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.hold_limit_at: int | None = None   # stand-in for a VPA that has not applied a raise yet
        self.pods: list[dict[str, Any]] = []    # none known: the VPA's / DaemonSet's limit counts

    def capabilities(self, refresh: bool = False) -> Capabilities:
        return self.caps

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        LOG.append(f"apply {obj['kind']}")
        self.objects[obj["kind"]] = obj
        return obj

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get(kind)
        if obj is not None and self.hold_limit_at is not None and kind == "VerticalPodAutoscaler":
            obj = autoscale._copy(obj)
            obj["spec"]["resourcePolicy"]["containerPolicies"][0]["maxAllowed"] = {"memory": str(self.hold_limit_at)}
        return obj

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        LOG.append("status")
        self.status.update(status)
        return {}

    def request(self, method: str, path: str, body: Any = None, query: Any = None, **_: Any) -> Any:
        if method == "POST" and path.endswith("/events"):
            self.events.append(body)
            return body
        if method == "GET" and path.endswith("/pods"):   # two ready sidecars, with the limits set in self.pods
            limits = {p["metadata"]["name"]: p for p in self.pods}
            return {"items": [{"metadata": {"name": f"pod-{i}"},
                               "spec": {"nodeName": f"node-{i}",
                                        **({"containers": limits[f"pod-{i}"]["spec"]["containers"]}
                                           if f"pod-{i}" in limits else {})},
                               "status": {**(limits[f"pod-{i}"]["status"] if f"pod-{i}" in limits else {}),
                                          "podIP": f"10.0.0.{i}", "conditions": [{"type": "Ready", "status": "True"}]}}
                              for i in (1, 2)]}
        raise AssertionError(f"unexpected {method} {path}")


class FixedSource:
    def __init__(self, signal: tuning.Signal, budget: int):
        self.sig, self.budget = signal, budget

    def signal(self, obs: Observation):
        return self.sig, {e.pod: Counters(budget_bytes=self.budget) for e in obs.ready}


def unscraped() -> fleet.Fleet:
    """The sidecars' signal and budgets come from FixedSource: nothing is dialled."""
    return fleet.Fleet(scrape=lambda url, timeout: None)


def resizer(fail: set[str] = frozenset()):
    def call(target: str, budget: int, timeout: float) -> dict[str, int]:
        if target in fail:
            raise autoscale.ResizeError(f"{target}: UNAVAILABLE: down")
        LOG.append(f"resize {target} {budget}")
        return {"evicted_chunks": 0}
    return call


CFG = autoscale.Config(overhead_bytes=512 * Mi, policy=tuning.Policy(grow_cooldown_s=0, shrink_cooldown_s=0))
LOW = tuning.Signal(hit_ratio=0.3, lookup_tokens_per_s=1e4, capacity_evictions_per_s=5, eviction_age_s=20,
                    stored_bytes=4 * Gi)
IDLE = tuning.Signal(hit_ratio=None, lookup_tokens_per_s=0, capacity_evictions_per_s=0, stored_bytes=4 * Gi)


def body(memory: int | None = None) -> dict[str, Any]:
    st = {"autoscaling": {"memoryBytes": memory}} if memory else {}
    return {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}, "status": st,
            "spec": {"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"},
                     "autoscaling": {"enabled": True, "minMemory": "2Gi", "maxMemory": "16Gi"}}}


def run(kube: FakeKube, b: dict, signal: tuning.Signal, budget: int, fail: set[str] = frozenset()):
    LOG.clear()
    return autoscale.tick(kube, b, unscraped(), CFG, OperatorDefaults(), resizer(fail),
                          source=FixedSource(signal, budget))


def test_grow_with_vpa_raises_the_limit_before_resizing():
    kube = FakeKube(vpa=True)
    start = 4 * Gi + 512 * Mi
    out = run(kube, body(), LOW, start - 512 * Mi)
    assert out.decision.action == tuning.GROW and out.memory_bytes == 6912 * Mi
    new_budget = 6912 * Mi - 512 * Mi
    assert LOG == ["status", "apply ConfigMap", "apply VerticalPodAutoscaler",
                   f"resize 10.0.0.1:50051 {new_budget}", f"resize 10.0.0.2:50051 {new_budget}"]
    pol = kube.objects["VerticalPodAutoscaler"]["spec"]["resourcePolicy"]["containerPolicies"][0]
    assert quantity_bytes(pol["minAllowed"]["memory"]) == quantity_bytes(pol["maxAllowed"]["memory"]) == 6912 * Mi
    assert kube.objects["VerticalPodAutoscaler"]["spec"]["updatePolicy"]["updateMode"] == "InPlaceOrRecreate"
    assert "DaemonSet" not in kube.objects
    assert kube.status["autoscaling"]["lastDecision"]["reason"] == "HitRatioBelowTarget"
    assert [e["reason"] for e in kube.events] == ["HitRatioBelowTarget"]


def test_grow_waits_while_the_applied_limit_is_below():
    kube = FakeKube(vpa=True)
    kube.hold_limit_at = 4 * Gi + 512 * Mi     # the VPA object still says the old maximum
    out = run(kube, body(), LOW, 4 * Gi)
    assert out.decision.action == tuning.GROW and out.steps[-3:] == ["wait-limit pod-1", "wait-limit pod-2",
                                                                  "event HitRatioBelowTarget"]
    assert not any(x.startswith("resize") for x in LOG)
    # Next tick (level-based): still below -> no Resize up; once the limit is there -> Resize.
    b = body(kube.status["autoscaling"]["memoryBytes"])
    b["status"]["autoscaling"]["lastChangeTime"] = kube.status["autoscaling"]["lastChangeTime"]
    hold = autoscale.Config(overhead_bytes=512 * Mi, policy=tuning.Policy(grow_cooldown_s=1e9))
    LOG.clear()
    out = autoscale.tick(kube, b, unscraped(), hold, OperatorDefaults(), resizer(), source=FixedSource(LOW, 4 * Gi))
    assert out.decision.reason == "Cooldown" and not any(x.startswith("resize") for x in LOG)
    assert out.steps[:2] == ["wait-limit pod-1", "wait-limit pod-2"]
    kube.hold_limit_at = None
    LOG.clear()
    autoscale.tick(kube, b, unscraped(), hold, OperatorDefaults(), resizer(), source=FixedSource(LOW, 4 * Gi))
    assert [x for x in LOG if x.startswith("resize")] == [f"resize 10.0.0.{i}:50051 {6400 * Mi}" for i in (1, 2)]


def test_shrink_resizes_first_then_lowers_the_daemonset_limit():
    kube = FakeKube(vpa=False)
    mem = 8 * Gi
    out = run(kube, body(mem), IDLE, mem - 512 * Mi)
    assert out.decision.action == tuning.SHRINK
    new = out.memory_bytes
    assert LOG[:2] == [f"resize 10.0.0.{i}:50051 {new - 512 * Mi}" for i in (1, 2)]
    assert LOG[2:] == ["status", "apply ConfigMap", "apply DaemonSet"]
    res = kube.objects["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert quantity_bytes(res["limits"]["memory"]) == new
    assert kube.objects["ConfigMap"]["data"]["PROMPTCACHE_MEMORY_BYTES"] == str(new - 512 * Mi)


def test_failed_resize_keeps_the_limit_and_warns():
    kube = FakeKube(vpa=False)
    out = run(kube, body(8 * Gi), IDLE, 8 * Gi - 512 * Mi, fail={"10.0.0.2:50051"})
    assert out.decision.action == tuning.SHRINK and out.errors
    assert not any(x.startswith("apply") or x == "status" for x in LOG)
    assert kube.events[-1]["type"] == "Warning" and kube.events[-1]["reason"] == "ResizeFailed"


def test_hold_records_the_decision_once():
    kube = FakeKube(vpa=False)
    on = tuning.Signal(hit_ratio=0.82, lookup_tokens_per_s=1e4, capacity_evictions_per_s=0, stored_bytes=4 * Gi)
    run(kube, body(), on, 4 * Gi)
    assert LOG == ["status"] and kube.status["autoscaling"]["lastDecision"]["reason"] == "OnTarget"
    b = body(kube.status["autoscaling"]["memoryBytes"])
    b["status"]["autoscaling"] = kube.status["autoscaling"]
    run(kube, b, on, 4 * Gi)
    assert LOG == []       # same decision: no status write, no Event
    assert kube.events == []


def test_disabled_or_invalid_does_nothing():
    kube = FakeKube(vpa=False)
    b = body()
    b["spec"]["autoscaling"]["enabled"] = False
    assert run(kube, b, LOW, 4 * Gi).decision is None and LOG == []
    b["spec"]["memory"]["host"] = "-1"
    assert run(kube, b, LOW, 4 * Gi).decision is None


def test_grow_resizes_only_pods_whose_own_limit_was_raised():
    """With a VPA the object says the new maximum at once, but each pod gets it when the in-place resize lands:
    the kubelet's report in containerStatuses decides."""
    kube = FakeKube(vpa=True)

    def pod(name: str, limit: str) -> dict[str, Any]:
        return {"metadata": {"name": name},
                "spec": {"containers": [{"name": "sidecar", "resources": {"limits": {"memory": "99Gi"}}}]},
                "status": {"containerStatuses": [{"name": "sidecar", "resources": {"limits": {"memory": limit}}}]}}
    kube.pods = [pod("pod-1", "6912Mi"), pod("pod-2", "4608Mi")]   # pod-2: still the old limit
    out = run(kube, body(), LOW, 4 * Gi)
    assert out.decision.action == tuning.GROW
    assert [x for x in LOG if x.startswith("resize")] == [f"resize 10.0.0.1:50051 {6400 * Mi}"]
    assert "wait-limit pod-2" in out.steps


# --- the operator's credentials go only to its own, authenticating, TLS-serving sidecars (audit: token leak) -----
def _spec(**patch: Any):
    from promptcache.operator.model import PromptCacheSpec
    return PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"}, **patch})


TLS_TOKENS = {"tls": {"secretName": "tls"}, "tokens": {"secretName": "tokens"}}


@pytest.mark.parametrize("patch,send,skip", [
    ({}, False, None),                                                   # no authentication: Resize without
    ({"security": {"tls": {"secretName": "tls"}}}, False, None),          # TLS, callers not authenticated
    ({"security": TLS_TOKENS}, True, None),
    ({"security": {"tls": {"secretName": "tls", "mutual": True}}}, True, None),
    ({"security": TLS_TOKENS, "image": {"repository": OperatorDefaults().image_repository, "tag": "0.2.0"}},
     True, None),
    ({"security": {"tokens": {"secretName": "tokens"}}}, False, "serve without TLS"),
    ({"security": TLS_TOKENS, "image": {"repository": "registry.example/x"}}, False, "registry.example/x"),
])
def test_credentials_policy(patch, send, skip):
    got_send, got_skip = autoscale.credentials_policy(_spec(**patch), OperatorDefaults())
    assert got_send is send
    assert (got_skip is None) if skip is None else (skip in got_skip)


def test_a_tenant_image_gets_no_resize_and_an_event_says_why():
    """The default resizer of a secured cache running an image of its creator's choice dials nothing."""
    kube = FakeKube(vpa=False)
    b = body(8 * Gi)
    b["spec"].update(security=TLS_TOKENS, image={"repository": "registry.example/x"})
    LOG.clear()
    out = autoscale.tick(kube, b, unscraped(), CFG, OperatorDefaults(), None, source=FixedSource(IDLE, 8 * Gi))
    assert out.decision.action == tuning.SHRINK and out.errors and all("not sent" in e for e in out.errors)
    assert [e["reason"] for e in kube.events] == ["ResizeSkipped", "ResizeFailed"]
    assert "registry.example/x" in kube.events[0]["message"]
    assert not any(x.startswith("apply") for x in LOG)
