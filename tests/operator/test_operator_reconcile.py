"""reconcile() with a recording fake of the thin Kube layer: the condition logic, pruning and the status-write
economy, without an API server (the real one is exercised by test_operator_apiserver.py)."""
from __future__ import annotations

from pathlib import Path

import yaml

from promptcache.operator import builders
from promptcache.operator.builders import Capabilities
from promptcache.operator.kube import ApiError
from promptcache.operator.reconcile import reconcile

ROOT = Path(__file__).resolve().parents[2]


class FakeKube:
    def __init__(self, caps=Capabilities(), pc_exists=True, fail_kind=None, objects=None):
        self.caps = caps
        self.objects: dict[str, dict] = dict(objects or {})  # "Kind/name" -> what the API server holds
        self.pc_exists = pc_exists
        self.fail_kind = fail_kind
        self.applied: list[str] = []
        self.deleted: list[str] = []
        self.status_writes: list[dict] = []

    def capabilities(self, refresh=False):
        return self.caps

    def apply(self, obj):
        if obj["kind"] == self.fail_kind:
            raise ApiError(422, '{"message": "boom"}')
        self.applied.append(builders.child_key(obj))
        self.objects[builders.child_key(obj)] = obj
        return {**obj, "metadata": {**obj["metadata"], "generation": 1}}

    def get(self, api_version, kind, namespace, name):
        return self.objects.get(f"{kind}/{name}")

    def delete(self, api_version, kind, namespace, name, uid=None):
        if self.objects.pop(f"{kind}/{name}", None) is None:
            return False
        self.deleted.append(f"{kind}/{name}")
        return True

    def priority_class_exists(self, name):
        return self.pc_exists

    def patch_status(self, namespace, name, status):
        self.status_writes.append(status)
        return {}

    def request(self, *a, **k):
        raise AssertionError("no pod listing expected while nothing is scheduled")


def body(spec_patch=None, status=None):
    doc = yaml.safe_load((ROOT / "examples" / "promptcache-minimal.yaml").read_text())
    doc["spec"].update(spec_patch or {})
    doc["metadata"].update(namespace="ns", uid="u-1", generation=3)
    doc["status"] = status or {}
    return doc


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def test_waiting_for_controller_is_progressing_not_ready():
    k = FakeKube()
    out = reconcile(k, body())
    c = conds(out.status)
    assert c["Ready"]["status"] == "False" and c["Progressing"]["status"] == "True"
    assert c["Degraded"]["status"] == "False"
    assert all(x["observedGeneration"] == 3 for x in c.values())
    assert out.status["observedGeneration"] == 3 and len(k.applied) == 5


def test_status_not_rewritten_when_nothing_changed():
    k = FakeKube()
    first = reconcile(k, body()).status
    assert len(k.status_writes) == 1
    reconcile(k, body(status=first))
    assert len(k.status_writes) == 1  # same state: no write, no resourceVersion churn


def test_apply_failure_is_degraded_and_not_ready():
    out = reconcile(FakeKube(fail_kind="ResourceQuota"), body())
    c = conds(out.status)
    assert c["Degraded"]["reason"] == "ApplyFailed" and "boom" in c["Degraded"]["message"]
    assert c["Ready"]["status"] == "False" and out.errors


def test_missing_priority_class_is_degraded():
    c = conds(reconcile(FakeKube(pc_exists=False), body()).status)
    assert c["Degraded"]["reason"] == "PriorityClassNotFound"


def test_status_says_which_priority_class_the_cache_uses():
    """The operator's default PriorityClass (the chart's priorityClass.name) where the spec names none: looked up,
    reported in status.priorityClassName, and named in PriorityClassNotFound as the operator's default."""
    class Recording(FakeKube):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.looked_up: list[str] = []

        def priority_class_exists(self, name):
            self.looked_up.append(name)
            return self.pc_exists

    gpu = builders.OperatorDefaults(priority_class="gpu-cache")
    k = Recording()
    assert reconcile(k, body(), gpu).status["priorityClassName"] == "gpu-cache"
    assert k.looked_up == ["gpu-cache"]
    k = Recording(pc_exists=False)
    c = conds(reconcile(k, body(), gpu).status)
    assert c["Degraded"]["reason"] == "PriorityClassNotFound"
    assert c["Degraded"]["message"].startswith("PriorityClass gpu-cache (the operator's default, chart value "
                                               "priorityClass.name")
    k = Recording(pc_exists=False)
    out = reconcile(k, body({"placement": {"priorityClassName": "team-cache"}}), gpu)
    assert out.status["priorityClassName"] == "team-cache" and k.looked_up == ["team-cache"]
    assert conds(out.status)["Degraded"]["message"].startswith("PriorityClass team-cache does not exist")


def test_requested_autoscaling_without_vpa_crd_is_degraded_but_unrequested_is_not():
    c = conds(reconcile(FakeKube(), body({"autoscaling": {"enabled": True}})).status)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "OptionalCRDMissing"
    c = conds(reconcile(FakeKube(), body()).status)
    assert c["Degraded"]["status"] == "False" and c["Autoscaling"]["reason"] == "CRDNotInstalled"


def owned(kind, name, uid="u-1", controller=True):
    """An object as the API server holds it: controlled by the PromptCache `uid` (None: no ownerReference)."""
    refs = [{"apiVersion": "promptcache.io/v1alpha1", "kind": "PromptCache", "name": "x", "uid": uid,
             "controller": controller}] if uid else []
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "uid": f"obj-{kind}-{name}",
                                       "ownerReferences": refs}}


def test_disabled_alerts_prune_the_rule():
    k = FakeKube(caps=Capabilities(vpa=True, service_monitor=True, prometheus_rule=True),
                 objects={"PrometheusRule/llama-8b": owned("PrometheusRule", "llama-8b")})
    reconcile(k, body({"alerts": {"enabled": False}}))
    assert k.deleted == ["PrometheusRule/llama-8b"]
    assert "PrometheusRule/llama-8b" not in k.applied and "VerticalPodAutoscaler/llama-8b" in k.applied


def test_invalid_spec_is_reported_not_applied():
    k = FakeKube()
    out = reconcile(k, body({"cachePolicy": {"chunkTokens": 100}}))
    assert out.invalid_spec and not k.applied
    assert conds(out.status)["Degraded"]["reason"] == "InvalidSpec"


def test_cluster_tier_runs_a_master_reports_it_and_prunes_it_when_turned_off():
    k = FakeKube()
    reconcile(k, body({"cluster": {"enabled": True}}))
    master = "llama-8b-mooncake-master"
    tier = [f"Deployment/{master}", f"Service/{master}", f"NetworkPolicy/{master}", "NetworkPolicy/llama-8b"]
    assert set(tier) <= set(k.applied)
    status = k.status_writes[-1]
    assert set(tier) <= set(status["children"])
    assert status["clusterMasterReady"] is False  # the fake's Deployment reports no ready replica
    k2 = FakeKube(objects=k.objects)
    reconcile(k2, body({"cluster": {"enabled": False}}, status=status))
    assert k2.deleted == tier
    assert k2.status_writes[-1]["clusterMasterReady"] is None
    k3 = FakeKube()
    reconcile(k3, body())  # never had a master: nothing to delete
    assert k3.deleted == []


# --- a ResourceQuota refusing sidecar pods (issue #28, scenario 5; asserted on a real node in tests/cluster) -------
REFUSAL = ('Error creating: pods "c-abcde" is forbidden: exceeded quota: tenant, requested: limits.memory=1536Mi, '
           'used: limits.memory=0, limited: limits.memory=512Mi')


def _ds(desired, current):
    return {"status": {"desiredNumberScheduled": desired, "currentNumberScheduled": current}}


def _event(message, reason="FailedCreate", at="2026-01-01T00:00:00Z"):
    return {"reason": reason, "message": message, "lastTimestamp": at}


def test_quota_exceeded_names_the_quota_while_pods_are_missing():
    from promptcache.operator.reconcile import quota_exceeded
    got = quota_exceeded(_ds(1, 0), [_event("older: exceeded quota: x", at="2026-01-01T00:00:00Z"),
                                     _event(REFUSAL, at="2026-01-01T00:01:00Z")])
    assert got == "1/1 sidecar pods not created: " + REFUSAL.removeprefix("Error creating: ")


def test_quota_exceeded_is_none_when_pods_exist_or_the_refusal_is_another():
    from promptcache.operator.reconcile import quota_exceeded
    assert quota_exceeded(_ds(1, 1), [_event(REFUSAL)]) is None  # the quota was raised since: old event
    assert quota_exceeded(_ds(1, 0), [_event('pods "c" is forbidden: violates PodSecurity')]) is None
    assert quota_exceeded(_ds(1, 0), [_event(REFUSAL, reason="SuccessfulCreate")]) is None
    assert quota_exceeded(None, [_event(REFUSAL)]) is None
    assert quota_exceeded(_ds(1, 0), []) is None


def test_quota_refusal_makes_the_cache_degraded_and_not_ready():
    from promptcache.operator.model import PromptCacheSpec
    from promptcache.operator.reconcile import compute_conditions
    spec = PromptCacheSpec.from_dict(body()["spec"])
    ds = {"metadata": {"generation": 1},
          "status": {"observedGeneration": 1, "desiredNumberScheduled": 1, "currentNumberScheduled": 0,
                     "numberReady": 0, "updatedNumberScheduled": 0}}
    c = {x["type"]: x for x in compute_conditions(spec, 3, Capabilities(), ds, [], True, "1/1 ... exceeded quota")[0]}
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "QuotaExceeded")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "QuotaExceeded")
    assert "exceeded quota" in c["Ready"]["message"]
    c = {x["type"]: x for x in compute_conditions(spec, 3, Capabilities(), ds, [], True, None)[0]}
    assert c["Ready"]["reason"] == "RollingOut" and c["Degraded"]["status"] == "False"  # negative control


def test_zero_copy_host_path_the_operator_does_not_allow_is_invalid_spec_not_applied():
    """spec.zeroCopy.hostPath outside the chart's zeroCopy.allowedHostPaths: nothing applied, InvalidSpec naming
    the value; an allowed one is applied with its hostPath volume."""
    from promptcache.operator.builders import OperatorDefaults

    k = FakeKube()
    out = reconcile(k, body({"zeroCopy": {"hostPath": "/var/lib/kubelet"}}),
                    OperatorDefaults(zero_copy_host_paths=("/run/promptcache",)))
    assert out.invalid_spec and not k.applied
    ready = conds(out.status)["Ready"]
    assert ready["reason"] == "InvalidSpec" and "/var/lib/kubelet is not allowed" in ready["message"]
    k = FakeKube()
    out = reconcile(k, body({"zeroCopy": {"hostPath": "/run/promptcache"}}), OperatorDefaults())
    assert not out.invalid_spec and "DaemonSet/llama-8b" in k.applied


PSA_REFUSAL = ('Error creating: pods "zc-abcde" is forbidden: violates PodSecurity "restricted:latest": '
               'restricted volume types (volume "bulk-socket" uses restricted volume type "hostPath"), '
               'runAsNonRoot != true (container "socket-dir" must not set securityContext.runAsNonRoot=false)')


def test_pod_security_refusal_makes_the_cache_degraded_not_ready_and_says_what_zero_copy_needs():
    """A namespace whose Pod Security level refuses the sidecar pods (a spec.zeroCopy cache outside a
    privileged namespace): Ready=False/Degraded=True PodSecurityViolation with the API server's message and, with
    zero copy, the level it needs. Only while pods are missing; quota refusals stay QuotaExceeded."""
    from promptcache.operator.model import PromptCacheSpec
    from promptcache.operator.reconcile import compute_conditions, pod_security_refused, quota_exceeded

    zc = PromptCacheSpec.from_dict(body({"zeroCopy": {"hostPath": "/run/promptcache"}})["spec"])
    plain = PromptCacheSpec.from_dict(body()["spec"])
    got = pod_security_refused(zc, _ds(1, 0), [_event(REFUSAL), _event(PSA_REFUSAL)])
    assert got.startswith("1/1 sidecar pods not created: " + PSA_REFUSAL.removeprefix("Error creating: "))
    assert "needs the privileged Pod Security level" in got
    assert "privileged" not in pod_security_refused(plain, _ds(1, 0), [_event(PSA_REFUSAL)])
    assert pod_security_refused(zc, _ds(1, 1), [_event(PSA_REFUSAL)]) is None
    assert pod_security_refused(zc, _ds(1, 0), [_event(REFUSAL)]) is None
    assert quota_exceeded(_ds(1, 0), [_event(PSA_REFUSAL)]) is None
    ds = {"metadata": {"generation": 1},
          "status": {"observedGeneration": 1, "desiredNumberScheduled": 1, "currentNumberScheduled": 0,
                     "numberReady": 0, "updatedNumberScheduled": 0}}
    c = {x["type"]: x for x in compute_conditions(zc, 3, Capabilities(), ds, [], True, None, got)[0]}
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "PodSecurityViolation")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "PodSecurityViolation")
    assert "violates PodSecurity" in c["Ready"]["message"]


# --- objects this PromptCache did not create (audit: name collisions, pruning by name) ---------------------------
def test_name_conflict_leaves_foreign_objects_untouched_and_reports_them():
    """An admin's ResourceQuota, a Service of another PromptCache and an unowned ConfigMap holding the children's
    names are neither applied over (no rewrite, no ownerReference for the garbage collector) nor fatal for the
    other children; the status names each (Degraded/NameConflict, not Ready)."""
    foreign = {"ResourceQuota/llama-8b-quota": owned("ResourceQuota", "llama-8b-quota", uid=None),
               "Service/llama-8b": owned("Service", "llama-8b", uid="someone-else"),
               "ConfigMap/llama-8b-config": owned("ConfigMap", "llama-8b-config", uid="u-1", controller=False)}
    k = FakeKube(objects=foreign)
    out = reconcile(k, body())
    assert sorted(k.applied) == ["DaemonSet/llama-8b", "Service/llama-8b-metrics"]
    assert all(k.objects[key] is foreign[key] for key in foreign)  # untouched
    c = conds(out.status)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "NameConflict"
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "NameConflict"
    for key in foreign:
        assert key in c["Degraded"]["message"]
    assert "controlled by PromptCache x" in c["Degraded"]["message"]
    assert out.status["children"] == ["DaemonSet/llama-8b", "Service/llama-8b-metrics"]


def test_children_this_promptcache_controls_are_applied_over():
    mine = {"Service/llama-8b": owned("Service", "llama-8b")}
    out = reconcile(FakeKube(objects=mine), body())
    assert not out.conflicts and conds(out.status)["Degraded"]["status"] == "False"


def test_pruning_deletes_only_what_this_promptcache_controls():
    """Alerts off / cluster tier off: a PrometheusRule, ServiceMonitor or master of the same name that this
    PromptCache does not control stays."""
    caps = Capabilities(vpa=True, service_monitor=True, prometheus_rule=True)
    master = "llama-8b-mooncake-master"
    foreign = {"PrometheusRule/llama-8b": owned("PrometheusRule", "llama-8b", uid=None),
               f"Deployment/{master}": owned("Deployment", master, uid="someone-else"),
               f"Service/{master}": owned("Service", master, uid="u-1", controller=False),
               f"NetworkPolicy/{master}": owned("NetworkPolicy", master, uid="someone-else"),
               "NetworkPolicy/llama-8b": owned("NetworkPolicy", "llama-8b", uid=None)}
    k = FakeKube(caps=caps, objects=foreign)
    status = {"children": [f"Deployment/{master}", f"Service/{master}", f"NetworkPolicy/{master}",
                           "NetworkPolicy/llama-8b"]}
    out = reconcile(k, body({"alerts": {"enabled": False}}, status=status))
    assert k.deleted == [] and out.deleted == []
    assert all(k.objects[key] is foreign[key] for key in foreign)
