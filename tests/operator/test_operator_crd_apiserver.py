"""The PromptCache CRD in a real kube-apiserver: examples apply, defaults land, invalid specs are rejected with a
message naming the field."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from promptcache.operator.kube import ApiError, object_path

pytestmark = pytest.mark.apiserver

ROOT = Path(__file__).resolve().parents[2]


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"promptcache-{name}.yaml").read_text())


def apply(kube, obj: dict, namespace: str, dry_run: bool = False):
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    query = [("fieldManager", "kubectl"), ("force", "true")] + ([("dryRun", "All")] if dry_run else [])
    return kube.request("PATCH", object_path(obj["apiVersion"], obj["kind"], namespace, obj["metadata"]["name"]),
                        body=obj, content_type="application/apply-patch+yaml", query=query)


def test_crd_established_and_discoverable(kube, crd):
    res = kube.request("GET", "/apis/promptcache.io/v1alpha1")["resources"]
    pc = next(r for r in res if r["name"] == "promptcaches")
    assert pc["kind"] == "PromptCache" and pc["namespaced"] and pc["shortNames"] == ["pc", "pcache"]
    assert any(r["name"] == "promptcaches/status" for r in res)


@pytest.mark.parametrize("name", ["minimal", "full"])
def test_examples_apply(kube, crd, namespace, name):
    got = apply(kube, example(name), namespace)
    assert got["metadata"]["generation"] == 1
    if name == "minimal":  # the CRD's defaults are filled in by the API server
        spec = got["spec"]
        assert spec["placement"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert spec["placement"]["tolerations"][0]["key"] == "nvidia.com/gpu"
        # No default: the operator's (the chart's priorityClass.name) applies, not one stored in the object.
        assert "priorityClassName" not in spec["placement"]
        assert spec["cachePolicy"] == {"chunkTokens": 256, "ttlSeconds": 14400, "maxLifetimeSeconds": 86400,
                                       "evictionPolicy": "rate-hazard",
                                       "quantization": "none"}
        assert spec["gpu"] == {"resourceName": "nvidia.com/gpu", "count": 0}
        assert spec["tenancy"] == {"mode": "Shared"}
        assert spec["alerts"]["enabled"] is True and spec["alerts"]["for"] == "10m"


def test_printer_columns_served(kube, crd, namespace):
    """`kubectl get pc` asks for a Table: the CRD's printer columns are served."""
    apply(kube, example("minimal"), namespace)
    cfg = kube.cfg
    r = kube.pool.request("GET", f"{cfg.host}/apis/promptcache.io/v1alpha1/namespaces/{namespace}/promptcaches",
                          headers={"Authorization": kube.authorization(),
                                   "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    table = json.loads(r.data)
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names[:1] == ["Name"] and {"Ready", "Hit-Ratio", "Memory", "Age"} <= set(names), names


INVALID = [
    ("memory.host zero", {"memory": {"host": "0"}}, "spec.memory.host"),
    ("memory.host negative", {"memory": {"host": "-4Gi"}}, "spec.memory.host"),
    ("memory.device negative", {"memory": {"host": "1Gi", "device": "-1"}}, "spec.memory.device"),
    ("memory.disk zero", {"memory": {"host": "1Gi", "disk": "0Gi"}}, "spec.memory.disk"),
    ("memory.host not a quantity", {"memory": {"host": "lots"}}, "spec.memory.host"),
    ("memory.host 8Ei or more", {"memory": {"host": "8Ei"}}, "spec.memory.host must be a positive quantity below 8Ei"),
    ("memory.disk beyond int64", {"memory": {"host": "1Gi", "disk": "1000000Ei"}}, "spec.memory.disk"),
    ("cluster segment beyond int64", {"cluster": {"enabled": True, "segmentMemory": "9223372036854775808"}},
     "spec.cluster.segmentMemory"),
    ("diskClaim without disk", {"memory": {"host": "1Gi", "diskClaim": "disk"}}, "spec.memory"),
    ("diskClaim not a claim name", {"memory": {"host": "1Gi", "disk": "1Gi", "diskClaim": "Disk_1"}},
     "spec.memory.diskClaim"),
    ("pinned prefix shorter than a chunk", {"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [
        {"name": "sys", "tokens": [1, 2, 3]}]}}, "pinnedPrefixes needs at least chunkTokens"),
    ("pinned prefix token out of range", {"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [
        {"name": "sys", "tokens": [-1] * 16}]}}, "spec.cachePolicy.pinnedPrefixes[0].tokens[0]"),
    ("pinned prefixes with one name twice", {"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [
        {"name": "sys", "tokens": list(range(16))}, {"name": "sys", "tokens": list(range(16))}]}}, "must be unique"),
    ("pinned prefixes over 65536 tokens", {"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [
        {"name": f"p{i}", "tokens": [7] * 16384} for i in range(5)]}}, "at most 65536 tokens in all"),
    ("warmupSnapshot without a claim", {"memory": {"host": "1Gi", "warmupSnapshot": {"path": "a.pcsnap"}}},
     "spec.memory.warmupSnapshot.claimName"),
    ("warmupSnapshot path out of the claim", {"memory": {"host": "1Gi", "warmupSnapshot": {
        "claimName": "snaps", "path": "../etc/passwd"}}}, "spec.memory.warmupSnapshot.path"),
    ("warmupSnapshot absolute path", {"memory": {"host": "1Gi", "warmupSnapshot": {
        "claimName": "snaps", "path": "/etc/passwd"}}}, "spec.memory.warmupSnapshot.path"),
    ("warm-up past the startup probe", {"memory": {"host": "1Gi", "disk": "1Gi", "warmupSeconds": 91}},
     "spec.memory.warmupSeconds"),
    ("unknown quantization", {"cachePolicy": {"quantization": "int3"}}, "spec.cachePolicy.quantization"),
    ("unknown eviction policy", {"cachePolicy": {"evictionPolicy": "random"}}, "spec.cachePolicy.evictionPolicy"),
    ("chunk not power of two", {"cachePolicy": {"chunkTokens": 300}}, "spec.cachePolicy.chunkTokens"),
    ("chunk too small", {"cachePolicy": {"chunkTokens": 8}}, "spec.cachePolicy.chunkTokens"),
    ("TTL zero", {"cachePolicy": {"ttlSeconds": 0}}, "spec.cachePolicy.ttlSeconds"),
    ("autoscaling min > max", {"autoscaling": {"minMemory": "64Gi", "maxMemory": "32Gi"}},
     "spec.autoscaling.minMemory"),
    ("hit ratio above 1", {"autoscaling": {"targetHitRatio": 1.5}}, "spec.autoscaling.targetHitRatio"),
    ("both revision and digest", {"model": {"name": "m", "revision": "r", "weightsDigest": "sha256:" + "a" * 64}},
     "spec.model"),
    ("no model name", {"model": {"revision": "r"}}, "spec.model.name"),
    ("negative gpu count", {"gpu": {"count": -1}}, "spec.gpu.count"),
    ("Isolated without credentials", {"tenancy": {"mode": "Isolated"}}, "spec.tenancy.mode"),
    ("Isolated with one-way TLS only", {"tenancy": {"mode": "Isolated"}, "security": {"tls": {"secretName": "t"}}},
     "spec.tenancy.mode"),
    ("secret name not DNS-1123", {"security": {"tokens": {"secretName": "Bad_Name"}}},
     "spec.security.tokens.secretName"),
    ("tls without a secret", {"security": {"tls": {"mutual": True}}}, "spec.security.tls.secretName"),
    ("tenant secret name empty", {"security": {"tenantSecret": {"secretName": ""}}},
     "spec.security.tenantSecret.secretName"),
    ("cluster protocol unknown", {"cluster": {"enabled": True, "protocol": "udp"}}, "spec.cluster.protocol"),
    ("cluster segment zero", {"cluster": {"enabled": True, "segmentMemory": "0"}}, "spec.cluster.segmentMemory"),
    ("cluster masters without etcd", {"cluster": {"enabled": True, "master": {"replicas": 2}}},
     "spec.cluster.master"),
    ("cluster masters too many", {"cluster": {"master": {"replicas": 6, "etcdEndpoints": ["etcd:2379"]}}},
     "spec.cluster.master.replicas"),
    ("cluster etcd endpoint not HOST:PORT", {"cluster": {"master": {"etcdEndpoints": ["http://etcd:2379"]}}},
     "spec.cluster.master.etcdEndpoints"),
    ("zeroCopy hostPath relative", {"zeroCopy": {"hostPath": "run/promptcache"}}, "spec.zeroCopy.hostPath"),
    ("zeroCopy hostPath root", {"zeroCopy": {"hostPath": "/"}}, "spec.zeroCopy.hostPath"),
    ("zeroCopy hostPath with ..", {"zeroCopy": {"hostPath": "/run/../etc"}}, "spec.zeroCopy.hostPath"),
    ("zeroCopy hostPath trailing /", {"zeroCopy": {"hostPath": "/run/promptcache/"}}, "spec.zeroCopy.hostPath"),
    ("zeroCopy with mTLS and no tokens", {"zeroCopy": {"hostPath": "/run/pc"},
                                          "security": {"tls": {"secretName": "t", "mutual": True}}},
     "spec.zeroCopy.hostPath"),
    # tolerations the API server would refuse on the DaemonSet's pods
    ("toleration Exists with a value", {"placement": {"tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "a", "operator": "Exists", "value": "x"}]}}, "spec.placement.tolerations[1].value"),
    ("toleration seconds without NoExecute", {"placement": {"tolerations": [
        {"key": "a", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}]}},
     "spec.placement.tolerations[0].tolerationSeconds"),
    ("toleration key not a label key", {"placement": {"tolerations": [{"key": "a b", "operator": "Exists"}]}},
     "spec.placement.tolerations[0].key"),
    ("toleration without key and not Exists", {"placement": {"tolerations": [{"operator": "Equal", "value": "x"}]}},
     "spec.placement.tolerations[0].operator"),
    ("toleration value not a label value", {"placement": {"tolerations": [
        {"key": "a", "operator": "Equal", "value": "x y"}]}}, "spec.placement.tolerations[0].value"),
    ("toleration operator unknown", {"placement": {"tolerations": [{"key": "a", "operator": "In"}]}},
     "spec.placement.tolerations[0].operator"),
    ("toleration effect unknown", {"placement": {"tolerations": [{"key": "a", "operator": "Exists",
                                                                 "effect": "NoRun"}]}},
     "spec.placement.tolerations[0].effect"),
    ("image repository with a digest", {"image": {"repository": "registry.local:5000/team/img@sha256:" + "a" * 64}},
     "spec.image.repository"),
    ("image repository with a tag", {"image": {"repository": "registry.local:5000/team/img:1.2"}},
     "spec.image.repository"),
    ("image repository upper case", {"image": {"repository": "Registry.local/Team/Img"}}, "spec.image.repository"),
    ("image tag with a space", {"image": {"tag": "v1 beta"}}, "spec.image.tag"),
    ("alerts for not a duration", {"alerts": {"for": "10 minutes"}}, "spec.alerts.for"),
    ("alerts for units out of order", {"alerts": {"for": "30m1h"}}, "spec.alerts.for"),
    ("alerts for empty", {"alerts": {"for": ""}}, "spec.alerts.for"),
    ("resource name unknown", {"resources": {"requests": {"gpu": "1"}}}, "spec.resources.requests"),
    ("resource quantity bad", {"resources": {"limits": {"cpu": "lots"}}}, "spec.resources.limits"),
    ("master resource quantity bad", {"cluster": {"master": {"resources": {"requests": {"cpu": "lots"}}}}},
     "spec.cluster.master.resources.requests"),
    ("master resource name unknown", {"cluster": {"master": {"resources": {"limits": {"Memory": "1Gi"}}}}},
     "spec.cluster.master.resources.limits"),
]


@pytest.mark.parametrize("patch", [
    {"placement": {"tolerations": [{"operator": "Exists"}, {"key": "k", "operator": "Equal", "value": "v",
                                                            "effect": "NoExecute", "tolerationSeconds": 60},
                                   {"key": "example.com/Dedicated", "value": "", "effect": ""}]}},
    {"image": {"repository": "registry.local:5000/team/img", "tag": "1.2_rc-1"}},
    {"image": {"repository": "localhost/a__b.c--d/e"}},
    {"alerts": {"for": "1h30m"}}, {"alerts": {"for": "1d"}}, {"alerts": {"for": "1w"}}, {"alerts": {"for": "0"}},
    {"alerts": {"for": "1y2w3d4h5m6s7ms"}},
    {"resources": {"requests": {"cpu": "0.5", "memory": 1073741824, "hugepages-2Mi": "0"},
                   "limits": {"example.com/fpga": 1}}},
])
def test_valid_specs_accepted_by_crd_and_model(kube, crd, namespace, patch):
    """What the CRD admits the model admits too (and the other way round: INVALID above, test_operator_builders)."""
    from promptcache.operator.model import PromptCacheSpec

    obj = example("minimal")
    obj["spec"].update(patch)
    apply(kube, obj, namespace, dry_run=True)
    PromptCacheSpec.from_dict(obj["spec"])


def test_children_of_a_longest_named_cache_are_admitted(kube, crd, namespace):
    """A PromptCache whose name is as long as the CRD allows, with the cluster tier, explicit resources the
    operator has to reconcile with its own (a CPU limit below its default request, a memory request above its
    derived limit, a one-sided GPU request): the API server admits every child it builds (dry run)."""
    import re as _re

    from promptcache.operator import builders
    from promptcache.operator.model import PromptCacheSpec

    most = int(_re.search(r"metadata\.name\.size\(\) <= (\d+)", (ROOT / "crds" / "promptcache.io_promptcaches.yaml")
                          .read_text()).group(1))
    name = "c" + "x" * (most - 1)
    spec = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "16Gi"},
                                      "gpu": {"count": 1}, "cluster": {"enabled": True, "master": {"resources": {
                                          "limits": {"cpu": "50m"}, "requests": {"memory": "1Gi"}}}},
                                      "resources": {"limits": {"cpu": "200m"},
                                                    "requests": {"memory": "32Gi", "nvidia.com/gpu": "2"}},
                                      "placement": {"maxNodes": 10}})
    owner = builders.Owner(name=name, namespace=namespace, uid="00000000-0000-0000-0000-000000000001")
    for child in builders.desired_children(spec, owner, builders.Capabilities()):
        child["metadata"].pop("ownerReferences")  # no such owner in the API server; the dry run needs none
        apply(kube, child, namespace, dry_run=True)


@pytest.mark.parametrize("label,patch,field", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_specs_rejected_naming_the_field(kube, crd, namespace, label, patch, field):
    obj = example("minimal")
    obj["metadata"]["name"] = "bad"
    obj["spec"].update(patch)
    with pytest.raises(ApiError) as info:
        apply(kube, obj, namespace)
    err = info.value
    assert err.status == 422, err
    assert field in err.message, f"{label}: {err.message}"


def test_valid_autoscaling_bounds_accepted(kube, crd, namespace):
    obj = example("minimal")
    obj["spec"]["autoscaling"] = {"enabled": True, "minMemory": "512Mi", "maxMemory": "1Gi"}
    apply(kube, obj, namespace, dry_run=True)


@pytest.mark.parametrize("security", [
    {"tokens": {"secretName": "cache-tokens"}},
    {"tls": {"secretName": "cache-tls", "mutual": True}, "tenantSecret": {"secretName": "cache.salt"}},
])
def test_valid_security_accepted(kube, crd, namespace, security):
    obj = example("minimal")
    obj["spec"]["tenancy"] = {"mode": "Isolated"}
    obj["spec"]["security"] = security
    got = apply(kube, obj, namespace, dry_run=True)
    if "tls" in security:
        assert got["spec"]["security"]["tls"] == {"secretName": "cache-tls", "mutual": True}
    obj["spec"]["tenancy"] = {"mode": "Shared"}
    obj["spec"]["security"] = {"tls": {"secretName": "cache-tls"}}  # one-way TLS is fine when Shared
    got = apply(kube, obj, namespace, dry_run=True)
    assert got["spec"]["security"]["tls"] == {"secretName": "cache-tls", "mutual": False}  # the default


def test_name_too_long_for_children_rejected(kube, crd, namespace):
    obj = example("minimal")
    obj["metadata"]["name"] = "x" * 60
    with pytest.raises(ApiError) as info:
        apply(kube, obj, namespace)
    assert "metadata.name" in info.value.message


def test_status_is_a_subresource(kube, crd, namespace):
    """Writes to the main resource ignore status; /status ignores spec."""
    obj = example("minimal")
    obj["status"] = {"readyNodes": 7}
    got = apply(kube, obj, namespace)
    assert "readyNodes" not in (got.get("status") or {})
    got = kube.patch_status(namespace, "llama-8b", {"readyNodes": 3, "observedGeneration": 1})
    assert got["status"]["readyNodes"] == 3


@pytest.fixture(scope="session")
def kubectl(control_plane):
    from opharness import require_tools
    binary = require_tools("kubectl")["kubectl"]

    def run(*args: str, check: bool = True):
        import subprocess
        p = subprocess.run([str(binary), "--kubeconfig", str(control_plane.kubeconfig), *args],
                           capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {p.stdout}{p.stderr}")
        return p
    return run


@pytest.mark.parametrize("name", ["minimal", "full"])
def test_kubectl_apply_examples(kubectl, crd, namespace, name):
    out = kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples" / f"promptcache-{name}.yaml"))
    assert "promptcache.promptcache.io/" in out.stdout and "created" in out.stdout
    out = kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples" / f"promptcache-{name}.yaml"))
    assert "unchanged" in out.stdout
    table = kubectl("get", "pcache", "-n", namespace).stdout  # `pc` is PriorityClass's short name in kubectl
    assert table.split()[:7] == ["NAME", "READY", "DESIRED", "HIT-RATIO", "MEMORY", "STATUS", "AGE"], table


def test_kubectl_apply_invalid_names_the_field(kubectl, crd, namespace, tmp_path):
    obj = example("minimal")
    obj["spec"]["cachePolicy"] = {"chunkTokens": 100, "ttlSeconds": 0}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(obj))
    out = kubectl("apply", "-n", namespace, "-f", str(path), check=False)
    assert out.returncode != 0
    assert "spec.cachePolicy.chunkTokens" in out.stderr and "spec.cachePolicy.ttlSeconds" in out.stderr, out.stderr


@pytest.mark.parametrize("key,ok", [("sidecar.istio.io/inject", False), ("istio.io/rev", False),
                                    ("container.apparmor.security.beta.kubernetes.io/sidecar", False),
                                    ("seccomp.security.alpha.kubernetes.io/pod", False),
                                    ("cluster-autoscaler.kubernetes.io/safe-to-evict", False),
                                    ("example.com/owner", True)])
def test_crd_refuses_security_relevant_pod_annotations(kube, crd, namespace, key, ok):
    doc = example("minimal")
    doc["spec"]["pod"] = {"annotations": {key: "x"}}
    if ok:
        apply(kube, doc, namespace, dry_run=True)
    else:
        with pytest.raises(ApiError, match="spec.pod.annotations may not set keys under"):
            apply(kube, doc, namespace, dry_run=True)
