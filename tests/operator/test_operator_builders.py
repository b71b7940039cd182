"""Pure builders: golden files and invariants. No API server needed.

Regenerate the golden files after an intended change:  PROMPTCACHE_UPDATE_GOLDEN=1 pytest tests/operator/test_builders.py
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.operator import builders
from promptcache.operator.builders import Capabilities, OperatorDefaults, Owner
from promptcache.operator.model import (CHUNK_TOKENS_ALLOWED, EVICTION_POLICIES, QUANTIZATION_MODES,
                                        PromptCacheSpec, SpecError)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
OWNER = Owner(name="NAME", namespace="NS", uid="00000000-0000-0000-0000-000000000001")
ALL = Capabilities(vpa=True, service_monitor=True, prometheus_rule=True)
NONE = Capabilities()


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"promptcache-{name}.yaml").read_text())


def render(name: str, caps: Capabilities) -> str:
    doc = example(name)
    owner = Owner(name=doc["metadata"]["name"], namespace="inference", uid=OWNER.uid)
    spec = PromptCacheSpec.from_dict(doc["spec"])
    return yaml.safe_dump_all(builders.desired_children(spec, owner, caps, OperatorDefaults()), sort_keys=True)


@pytest.mark.parametrize("name", ["minimal", "full"])
@pytest.mark.parametrize("caps_name,caps", [("all-crds", ALL), ("no-optional-crds", NONE)])
def test_golden(name, caps_name, caps):
    got = render(name, caps)
    path = GOLDEN / f"{name}.{caps_name}.yaml"
    if os.environ.get("PROMPTCACHE_UPDATE_GOLDEN") or not path.exists():
        path.write_text(got)
    assert got == path.read_text(), f"{path} differs; set PROMPTCACHE_UPDATE_GOLDEN=1 if the change is intended"


def _pod(ds):
    return ds["spec"]["template"]["spec"]


def full_without_zero_copy() -> dict:
    """The full example's spec less spec.zeroCopy: every other field, and the `restricted` Pod Security level
    (zero copy's hostPath needs `privileged`: test_zero_copy_* check exactly what it adds)."""
    spec = example("full")["spec"]
    del spec["zeroCopy"]
    return spec


def test_restricted_pod_security_fields():
    spec = PromptCacheSpec.from_dict(full_without_zero_copy())
    ds = builders.daemon_set(spec, OWNER, OperatorDefaults(), "h")
    pod = _pod(ds)
    assert not pod["hostNetwork"] and not pod["hostPID"] and not pod["hostIPC"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for v in pod["volumes"]:
        assert set(v) - {"name"} <= allowed_volumes
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0
        assert all("hostPort" not in p for p in c["ports"])


def test_node_local_and_headless_services():
    svc = builders.node_local_service(PromptCacheSpec.from_dict(example("minimal")["spec"]), OWNER)
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    metrics = builders.metrics_service(OWNER)
    assert metrics["spec"]["clusterIP"] == "None"


def test_quota_is_scoped_to_priority_class():
    spec = PromptCacheSpec.from_dict(example("full")["spec"])
    q = builders.resource_quota(spec, OWNER)
    assert q["spec"]["scopeSelector"]["matchExpressions"] == [
        {"scopeName": "PriorityClass", "operator": "In", "values": ["promptcache-node-cache"]}]
    assert q["spec"]["hard"]["pods"] == "32"
    assert q["spec"]["hard"]["requests.nvidia.com/gpu"] == "32"


def test_a_cache_without_a_priority_class_runs_with_the_operators_default():
    """spec.placement.priorityClassName unset (the CRD has no default) or empty: the pods and the quota's scope take
    the operator's configured PriorityClass (the chart's priorityClass.name); one the spec names wins."""
    minimal = example("minimal")["spec"]
    assert "priorityClassName" not in minimal.get("placement", {})
    gpu = OperatorDefaults(priority_class="gpu-cache")
    for placement, defaults, want in (({}, OperatorDefaults(), "promptcache-node-cache"),
                                      ({}, gpu, "gpu-cache"),
                                      ({"priorityClassName": ""}, gpu, "gpu-cache"),
                                      ({"priorityClassName": "promptcache-node-cache"}, gpu,
                                       "promptcache-node-cache"),  # stored by the old CRD default: kept
                                      ({"priorityClassName": "team-cache"}, gpu, "team-cache")):
        spec = PromptCacheSpec.from_dict({**minimal, "placement": {**minimal.get("placement", {}), **placement}})
        assert builders.priority_class_name(spec, defaults) == want
        children = {c["kind"]: c for c in builders.desired_children(spec, OWNER, NONE, defaults)}
        assert _pod(children["DaemonSet"])["priorityClassName"] == want
        assert children["ResourceQuota"]["spec"]["scopeSelector"]["matchExpressions"] == [
            {"scopeName": "PriorityClass", "operator": "In", "values": [want]}]
        builders.check_operator_policy(spec, defaults)


def test_optional_children_follow_capabilities():
    spec = PromptCacheSpec.from_dict(example("minimal")["spec"])
    kinds = lambda caps: sorted(c["kind"] for c in builders.desired_children(spec, OWNER, caps))  # noqa: E731
    assert kinds(NONE) == ["ConfigMap", "DaemonSet", "ResourceQuota", "Service", "Service"]
    assert kinds(ALL) == ["ConfigMap", "DaemonSet", "PrometheusRule", "ResourceQuota", "Service", "Service",
                          "ServiceMonitor", "VerticalPodAutoscaler"]


def test_config_change_rolls_pods():
    a = PromptCacheSpec.from_dict(example("minimal")["spec"])
    b = PromptCacheSpec.from_dict({**example("minimal")["spec"], "cachePolicy": {"ttlSeconds": 60}})
    ha = builders.config_hash(builders.config_map(a, OWNER))
    hb = builders.config_hash(builders.config_map(b, OWNER))
    assert ha != hb


@pytest.mark.parametrize("patch,field", [
    ({"memory": {"host": "0"}}, "spec.memory.host"),
    ({"memory": {"host": "-1Gi"}}, "spec.memory.host"),
    ({"cachePolicy": {"quantization": "int3"}}, "spec.cachePolicy.quantization"),
    ({"cachePolicy": {"chunkTokens": 300}}, "spec.cachePolicy.chunkTokens"),
    ({"cachePolicy": {"ttlSeconds": 0}}, "spec.cachePolicy.ttlSeconds"),
    ({"autoscaling": {"minMemory": "8Gi", "maxMemory": "4Gi"}}, "spec.autoscaling.minMemory"),
    ({"tenancy": {"mode": "Isolated"}}, "spec.tenancy.mode"),
    ({"tenancy": {"mode": "Isolated"}, "security": {"tls": {"secretName": "t"}}}, "spec.tenancy.mode"),
    ({"security": {"tokens": {"secretName": "Bad_Name"}}}, "spec.security.tokens.secretName"),
    ({"security": {"tls": {"mutual": True}}}, "spec.security.tls.secretName"),
    ({"security": {"vault": {}}}, "spec.security"),
    ({"cluster": {"protocol": "udp"}}, "spec.cluster.protocol"),
    ({"cluster": {"segmentMemory": "0"}}, "spec.cluster.segmentMemory"),
    ({"cluster": {"master": {"replicas": 2}}}, "spec.cluster.master.replicas above 1 needs"),
    ({"cluster": {"master": {"replicas": 6, "etcdEndpoints": ["etcd:2379"]}}}, "spec.cluster.master.replicas"),
    ({"cluster": {"master": {"replicas": 0}}}, "spec.cluster.master.replicas"),
    ({"cluster": {"master": {"etcdEndpoints": ["etcd"]}}}, "spec.cluster.master.etcdEndpoints"),
    ({"cluster": {"master": {"etcdEndpoints": ["http://etcd:2379"]}}}, "spec.cluster.master.etcdEndpoints"),
    ({"memory": {"host": "1Gi", "diskClaim": "disk"}}, "spec.memory.diskClaim needs spec.memory.disk"),
    ({"memory": {"host": "1Gi", "disk": "1Gi", "diskClaim": "Disk_1"}}, "spec.memory.diskClaim 'Disk_1'"),
    ({"memory": {"host": "1Gi", "warmupSnapshot": {"claimName": "Snaps"}}}, "spec.memory.warmupSnapshot.claimName"),
    ({"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [{"name": "sys", "tokens": [1, 2]}]}},
     r"spec.cachePolicy.pinnedPrefixes\[0\].tokens has 2 ids: it needs at least one chunk"),
    ({"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [{"name": "-sys", "tokens": list(range(16))}]}},
     r"spec.cachePolicy.pinnedPrefixes\[0\].name '-sys'"),
    ({"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [{"name": "a", "tokens": list(range(16))}] * 2}},
     "appears twice"),
    ({"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [{"name": "a", "tokens": [2**32] * 16}]}},
     r"tokens must be token ids"),
    ({"cachePolicy": {"chunkTokens": 16, "pinnedPrefixes": [{"name": f"p{i}", "tokens": list(range(16384))}
                                                             for i in range(5)]}}, "more than 65536 tokens in all"),
    ({"memory": {"host": "1Gi", "warmupSnapshot": {}}}, "spec.memory.warmupSnapshot.claimName is required"),
    ({"memory": {"host": "1Gi", "warmupSnapshot": {"claimName": "s", "path": "../x"}}}, "must be a relative path"),
    ({"memory": {"host": "1Gi", "warmupSnapshot": {"claimName": "s", "path": "/etc/x"}}}, "must be a relative path"),
    ({"memory": {"host": "1Gi", "warmupSnapshot": {"claimName": "s", "path": "a/../../x"}}}, "must be a relative path"),
    ({"memory": {"host": "1Gi", "warmupSnapshot": {"claimName": "s", "path": "a//b"}}}, "must be a relative path"),
    ({"memory": {"host": "1Gi", "disk": "1Gi", "warmupSeconds": 91}}, "spec.memory.warmupSeconds"),
    ({"memory": {"host": "1Gi", "disk": "1Gi", "warmupSeconds": -1}}, "spec.memory.warmupSeconds"),
    ({"memory": {"host": "8Ei"}}, "spec.memory.host must be below 8Ei"),
    ({"memory": {"host": "1Gi", "disk": "1000000Ei"}}, "spec.memory.disk must be below 8Ei"),
    ({"cluster": {"enabled": True, "segmentMemory": "9223372036854775808"}}, "spec.cluster.segmentMemory must be below"),
    ({"autoscaling": {"maxMemory": "9Ei"}}, "spec.autoscaling.maxMemory must be below 8Ei"),
    ({"model": {"name": "", "revision": "r"}}, "spec.model.name must be 1 to 253 characters"),
    ({"model": {"name": "m", "revision": "r" * 129}}, "spec.model.revision must be 1 to 128 characters"),
    # Kubernetes' own rules for what the operator writes into the DaemonSet: refused as InvalidSpec naming the spec
    # field, not as the API server's 422 on a child object
    ({"pod": {"labels": {"team": "ml infra"}}}, "spec.pod.labels: 'ml infra' is not a label value"),
    ({"pod": {"labels": {"-team": "ml"}}}, "spec.pod.labels: '-team': the name is not"),
    ({"pod": {"labels": {"Example_.com/team": "ml"}}}, "spec.pod.labels: 'Example_.com/team': the prefix"),
    ({"pod": {"annotations": {"a b": "x"}}}, "spec.pod.annotations: 'a b'"),
    ({"pod": {"annotations": {"note": "x" * 300_000}}}, "spec.pod.annotations: more than"),
    ({"placement": {"nodeSelector": {"gpu": "h100 80gb"}}}, "spec.placement.nodeSelector: 'h100 80gb'"),
    ({"monitoring": {"labels": {"release": "kube prometheus"}}}, "spec.monitoring.labels"),
    ({"placement": {"maxNodes": 0}}, "spec.placement.maxNodes must be within 1..10000"),
    ({"placement": {"priorityClassName": "Node_Cache"}}, "spec.placement.priorityClassName 'Node_Cache'"),
    ({"image": {"tag": "v1 beta"}}, "spec.image.tag 'v1 beta' is not an image tag"),
    ({"resources": {"requests": {"cpu": "lots"}}}, "spec.resources.requests.cpu: 'lots' is not a Kubernetes quantity"),
    ({"resources": {"limits": {"memory": "-1Gi"}}}, "spec.resources.limits.memory must be 0 or more"),
])
def test_model_rejects_what_the_crd_rejects(patch, field):
    spec = {**example("minimal")["spec"], **patch}
    if "memory" not in patch:
        spec["memory"] = {"host": "1Gi"}
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        PromptCacheSpec.from_dict(spec)


@pytest.mark.parametrize("memory,placement,message", [
    ({"host": "7Ei"}, {}, "times spec.placement.maxNodes 100 (the ResourceQuota's memory), is more than 8Ei"),
    ({"host": "1Ei"}, {"maxNodes": 8}, "times spec.placement.maxNodes 8"),
    ({"host": "1Gi", "disk": "8589934591Gi"}, {}, "spec.memory.disk '8589934591Gi' plus 1Gi"),
])
def test_sizes_that_fit_alone_but_not_added_up_are_refused(memory, placement, message):
    """Each size is below 8Ei, but the pod's memory times the nodes (the ResourceQuota) or the disk tier plus
    RocksDB's own files (the pod's ephemeral storage) would not be: refused before anything is built."""
    spec = {**example("minimal")["spec"], "memory": memory, "placement": placement}
    with pytest.raises(SpecError, match=re.escape(message)):
        PromptCacheSpec.from_dict(spec)
    fits = {**spec, "placement": {"maxNodes": 7}} if memory["host"] == "1Ei" else None
    if fits is not None:  # one node fewer fits: the bound is the sum, not the size
        assert builders.resource_quota(PromptCacheSpec.from_dict(fits), OWNER)["spec"]["hard"]["limits.memory"]


def _secured(security: dict, **extra) -> PromptCacheSpec:
    return PromptCacheSpec.from_dict({**example("minimal")["spec"], "security": security, **extra})


def _probe_kinds(ds) -> set[str]:
    c = _pod(ds)["containers"][0]
    return {k for name in ("startupProbe", "readinessProbe", "livenessProbe") for k in c[name]
            if k in ("grpc", "tcpSocket", "httpGet", "exec")}


def test_warm_up_is_on_with_a_disk_or_cluster_tier_and_within_the_startup_probe():
    """spec.memory.warmupSeconds (default 30) reaches the sidecar only with a disk or cluster tier to warm from, and
    stays below what the startup probe allows (periodSeconds x failureThreshold)."""
    minimal = example("minimal")["spec"]
    assert builders.sidecar_env(PromptCacheSpec.from_dict(minimal))["PROMPTCACHE_WARMUP_SECONDS"] == "0"
    with_disk = {**minimal, "memory": {**minimal["memory"], "disk": "10Gi"}}
    assert builders.sidecar_env(PromptCacheSpec.from_dict(with_disk))["PROMPTCACHE_WARMUP_SECONDS"] == "30"
    with_cluster = {**minimal, "cluster": {"enabled": True}}
    assert builders.sidecar_env(PromptCacheSpec.from_dict(with_cluster))["PROMPTCACHE_WARMUP_SECONDS"] == "30"
    off = {**minimal, "memory": {**minimal["memory"], "disk": "10Gi", "warmupSeconds": 0}}
    assert builders.sidecar_env(PromptCacheSpec.from_dict(off))["PROMPTCACHE_WARMUP_SECONDS"] == "0"
    with_snapshot = {**minimal, "memory": {**minimal["memory"], "warmupSnapshot": {"claimName": "snaps"}}}
    assert builders.sidecar_env(PromptCacheSpec.from_dict(with_snapshot))["PROMPTCACHE_WARMUP_SECONDS"] == "30"
    ds = builders.daemon_set(PromptCacheSpec.from_dict(with_disk), OWNER, OperatorDefaults(), "h")
    startup = _pod(ds)["containers"][0]["startupProbe"]
    from promptcache.operator.model import MAX_WARMUP_SECONDS
    assert MAX_WARMUP_SECONDS + 10 <= startup["periodSeconds"] * startup["failureThreshold"]


def test_no_security_keeps_plaintext_grpc_probes_and_no_secrets():
    spec = PromptCacheSpec.from_dict(example("minimal")["spec"])
    env = builders.sidecar_env(spec)
    assert env["PROMPTCACHE_ALLOW_INSECURE_REMOTE"] == "true"
    assert not {k for k in env if "TLS" in k or "TOKEN_FILE" in k or "TENANT_SECRET" in k}
    ds = builders.daemon_set(spec, OWNER, OperatorDefaults(), "h")
    assert _probe_kinds(ds) == {"grpc"}
    assert not [v for v in _pod(ds)["volumes"] if "secret" in v]
    assert not [m for m in _pod(ds)["containers"][0]["volumeMounts"] if m["mountPath"].startswith("/etc/")]


def test_tls_mounts_the_secret_sets_files_drops_insecure_and_probes_tcp():
    spec = _secured({"tls": {"secretName": "cache-tls"}})
    env = builders.sidecar_env(spec)
    assert "PROMPTCACHE_ALLOW_INSECURE_REMOTE" not in env
    assert env["PROMPTCACHE_TLS_CERT_FILE"] == "/etc/promptcache/tls/tls.crt"
    assert env["PROMPTCACHE_TLS_KEY_FILE"] == "/etc/promptcache/tls/tls.key"
    assert "PROMPTCACHE_TLS_CLIENT_CA_FILE" not in env  # mutual defaults to false
    cm = builders.config_map(spec, OWNER)
    assert {k: v for k, v in cm["data"].items() if k != "promptcache.yaml"} == env
    ds = builders.daemon_set(spec, OWNER, OperatorDefaults(), "h")
    pod = _pod(ds)
    assert _probe_kinds(ds) == {"tcpSocket"}
    assert pod["containers"][0]["livenessProbe"]["tcpSocket"] == {"port": builders.GRPC_PORT}
    assert {"name": "tls", "secret": {"secretName": "cache-tls", "defaultMode": 0o440}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "tls", "mountPath": "/etc/promptcache/tls", "readOnly": True} in mounts
    assert all("subPath" not in m for m in mounts)  # subPath mounts never see a rotated Secret


def test_mutual_tls_tokens_and_tenant_secret():
    spec = _secured({"tls": {"secretName": "cache-tls", "mutual": True}, "tokens": {"secretName": "cache-tokens"},
                     "tenantSecret": {"secretName": "cache-salt"}}, tenancy={"mode": "Isolated"})
    env = builders.sidecar_env(spec)
    assert env["PROMPTCACHE_TLS_CLIENT_CA_FILE"] == "/etc/promptcache/tls/ca.crt"
    assert env["PROMPTCACHE_TOKEN_FILE"] == "/etc/promptcache/tokens"  # a folder: one file per tenant
    assert env["PROMPTCACHE_TENANT_SECRET_FILE"] == "/etc/promptcache/tenant-secret/secret"
    pod = _pod(builders.daemon_set(spec, OWNER, OperatorDefaults(), "h"))
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"tls": "cache-tls", "tokens": "cache-tokens", "tenant-secret": "cache-salt"}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    for name in secrets:
        assert mounts[name]["readOnly"] is True and mounts[name]["mountPath"].startswith("/etc/promptcache/")


def test_tokens_without_tls_keep_grpc_probes():
    spec = _secured({"tokens": {"secretName": "cache-tokens"}}, tenancy={"mode": "Isolated"})
    env = builders.sidecar_env(spec)
    assert env["PROMPTCACHE_ALLOW_INSECURE_REMOTE"] == "true" and "PROMPTCACHE_TLS_CERT_FILE" not in env
    assert _probe_kinds(builders.daemon_set(spec, OWNER, OperatorDefaults(), "h")) == {"grpc"}


def test_secret_change_rolls_pods():
    a = builders.desired_children(_secured({}), OWNER, NONE)
    b = builders.desired_children(_secured({"tls": {"secretName": "x"}}), OWNER, NONE)
    assert a[1]["spec"]["template"] != b[1]["spec"]["template"]
    assert builders.config_hash(a[0]) != builders.config_hash(b[0])


specs = st.fixed_dictionaries({
    "model": st.just({"name": "m", "revision": "r"}),
    "memory": st.fixed_dictionaries({"host": st.sampled_from(["1Gi", "512Mi", "100G"])},
                                    optional={"disk": st.sampled_from(["10Gi", "1Ti"]),
                                              "device": st.sampled_from(["4Gi"])}),
    "gpu": st.fixed_dictionaries({"count": st.integers(0, 4)}),
    "cachePolicy": st.fixed_dictionaries({
        "chunkTokens": st.sampled_from(CHUNK_TOKENS_ALLOWED), "ttlSeconds": st.integers(1, 10**6),
        "evictionPolicy": st.sampled_from(EVICTION_POLICIES), "quantization": st.sampled_from(QUANTIZATION_MODES)}),
    "alerts": st.fixed_dictionaries({"enabled": st.booleans()}),
    "autoscaling": st.fixed_dictionaries({"enabled": st.booleans()}),
    "security": st.fixed_dictionaries({}, optional={
        "tls": st.fixed_dictionaries({"secretName": st.just("tls")}, optional={"mutual": st.booleans()}),
        "tokens": st.just({"secretName": "tokens"}), "tenantSecret": st.just({"secretName": "salt"})}),
})


@settings(max_examples=60, deadline=None)
@given(spec=specs, caps=st.builds(Capabilities, st.booleans(), st.booleans(), st.booleans()))
def test_every_child_is_owned_labelled_and_deterministic(spec, caps):
    s = PromptCacheSpec.from_dict(spec)
    children = builders.desired_children(s, OWNER, caps)
    assert children == builders.desired_children(s, OWNER, caps)
    keys = [builders.child_key(c) for c in children]
    assert len(set(keys)) == len(keys)
    for c in children:
        assert c["metadata"]["namespace"] == "NS"
        assert c["metadata"]["ownerReferences"] == [builders.owner_reference(OWNER)]
        assert c["metadata"]["labels"][builders.CACHE_LABEL] == "NAME"
    env = builders.sidecar_env(s)
    assert ("PROMPTCACHE_ALLOW_INSECURE_REMOTE" in env) == (s.security.tls is None)
    assert int(env["PROMPTCACHE_MEMORY_BYTES"]) > 0
    assert env["PROMPTCACHE_CHUNK_TOKENS"] == str(s.cachePolicy.chunkTokens)
    _sidecar_takes(env)


def _sidecar_takes(env: dict[str, str]) -> None:
    """The contract between the operator and `promptcache serve`: every variable the operator sets is a sidecar
    setting (an unknown one would be silently ignored), and the sidecar's own parser accepts every value."""
    import argparse
    import dataclasses

    from promptcache.sidecar import config

    known = {config.env_name(f.name): f.name for f in dataclasses.fields(config.Settings)}
    sidecar_vars = {k for k in env if k.startswith("PROMPTCACHE_")}
    assert sidecar_vars <= set(known), f"the sidecar has no setting for {sorted(sidecar_vars - set(known))}"
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    settings = config.settings_from_args(parser.parse_args([]), environ=env)
    for var in sidecar_vars:
        value = getattr(settings, known[var])
        if isinstance(value, bool):
            assert value == (env[var].lower() == "true"), var
        elif isinstance(value, (int, float)):
            assert value == config.parse_bytes(env[var]) if var.endswith("_BYTES") else value == float(env[var]), var
        else:
            assert value == env[var], (var, value, env[var])


def test_bulk_channel_is_served_only_without_tls():
    """The bulk channel (docs/bulk-channel.md) is plaintext: the operator opens it when gRPC is plaintext too,
    and with TLS leaves every trace of it out (env, container port, Service port)."""
    plain = PromptCacheSpec.from_dict(example("minimal")["spec"])
    tls = PromptCacheSpec.from_dict(full_without_zero_copy())  # with zero copy: its unix socket only (below)
    assert tls.security.tls is not None and plain.security.tls is None
    for spec, served in ((plain, True), (tls, False)):
        env = builders.sidecar_env(spec)
        ds = builders.daemon_set(spec, OWNER, builders.OperatorDefaults(), "h")
        ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
        svc_ports = builders.node_local_service(spec, OWNER)["spec"]["ports"]
        assert ("PROMPTCACHE_BULK_ADDRESS" in env) is served
        assert any(p["name"] == "bulk" for p in ports) is served
        assert any(p["name"] == "bulk" for p in svc_ports) is served
        if served:
            assert env["PROMPTCACHE_BULK_ADDRESS"] == f"0.0.0.0:{builders.BULK_PORT}"
            # The sidecar accepts what the operator sets (it refuses TCP bulk with TLS, and bad addresses).
            from promptcache.sidecar.config import Settings

            Settings(bulk_address=env["PROMPTCACHE_BULK_ADDRESS"], allow_insecure_remote=True).validate()


def test_pod_settings_reach_the_daemonset_and_cannot_break_its_selector():
    base = example("minimal")["spec"]
    spec = PromptCacheSpec.from_dict({**base, "pod": {
        "serviceAccountName": "cache-sa", "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
        "labels": {"team": "ml"}, "annotations": {"example.com/a": "b"}}})
    ds = builders.daemon_set(spec, OWNER, OperatorDefaults(), "h")
    pod = _pod(ds)
    assert pod["serviceAccountName"] == "cache-sa"
    assert pod["automountServiceAccountToken"] is False  # a custom ServiceAccount still gets no API token
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    meta = ds["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "ml" and meta["annotations"]["example.com/a"] == "b"
    assert ds["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
    assert meta["annotations"][builders.CONFIG_HASH_ANNOTATION] == "h"
    # Without spec.pod: the namespace's default ServiceAccount and no pull secrets, as before.
    plain = _pod(builders.daemon_set(PromptCacheSpec.from_dict(base), OWNER, OperatorDefaults(), "h"))
    assert plain["serviceAccountName"] == "default" and "imagePullSecrets" not in plain


@pytest.mark.parametrize("pod, culprit", [
    ({"labels": {"promptcache.io/cache": "other"}}, "promptcache.io/cache"),
    ({"labels": {"app.kubernetes.io/component": "x"}}, "app.kubernetes.io/component"),
    ({"annotations": {"promptcache.io/config-hash": "0"}}, "promptcache.io/config-hash"),
    ({"serviceAccountName": "Not_A_Name"}, "Not_A_Name"),
    ({"imagePullSecrets": [{"name": "-bad"}]}, "-bad"),
])
def test_pod_settings_that_would_break_the_operator_are_refused(pod, culprit):
    with pytest.raises(SpecError, match=re.escape(culprit)):
        PromptCacheSpec.from_dict({**example("minimal")["spec"], "pod": pod})


def test_monitoring_labels_merge_over_the_operator_defaults_but_not_over_its_own():
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], "monitoring": {"labels": {
        "team": "ml", "promptcache.io/cache": "spoof"}}})
    d = OperatorDefaults(monitoring_labels=(("release", "kps"),))
    for obj in (builders.service_monitor(spec, OWNER, d), builders.prometheus_rule(spec, OWNER, d)):
        labels = obj["metadata"]["labels"]
        assert labels["release"] == "kps" and labels["team"] == "ml"
        assert labels["promptcache.io/cache"] == OWNER.name, obj["kind"]
    over = PromptCacheSpec.from_dict({**example("minimal")["spec"], "monitoring": {"labels": {"release": "prom"}}})
    assert builders.service_monitor(over, OWNER, d)["metadata"]["labels"]["release"] == "prom"


def test_vpa_starts_off_until_the_autoscaler_decides():
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], "autoscaling": {"enabled": True}})
    assert builders.vertical_pod_autoscaler(spec, OWNER)["spec"]["updatePolicy"]["updateMode"] == "Off"


def test_cluster_tier_adds_a_master_and_points_the_sidecars_at_it():
    from promptcache.operator.builders import desired_children
    from promptcache.operator.model import quantity_bytes

    owner = Owner(name="c1", namespace="ns", uid="u")
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"],
                                      "cluster": {"enabled": True, "segmentMemory": "2Gi", "protocol": "rdma"}})
    children = {c["kind"] + "/" + c["metadata"]["name"]: c for c in desired_children(spec, owner, Capabilities())}
    master, service = children["Deployment/c1-mooncake-master"], children["Service/c1-mooncake-master"]
    pod_labels = master["spec"]["template"]["metadata"]["labels"]
    assert master["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"] == master["spec"]["selector"]["matchLabels"]
    # The sidecars' DaemonSet must not select the master's pod.
    ds = children["DaemonSet/c1"]
    assert not ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    env = children["ConfigMap/c1-config"]["data"]
    assert env["PROMPTCACHE_CLUSTER_MASTER"] == "c1-mooncake-master.ns.svc:50051"
    assert env["PROMPTCACHE_CLUSTER_PROTOCOL"] == "rdma" and env["PROMPTCACHE_CLUSTER_SEGMENT_BYTES"] == str(2 << 30)
    _sidecar_takes({k: v for k, v in env.items() if k.startswith("PROMPTCACHE_")})
    plain = {c["kind"] + "/" + c["metadata"]["name"]: c
             for c in desired_children(PromptCacheSpec.from_dict(example("minimal")["spec"]), owner, Capabilities())}
    assert "Deployment/c1-mooncake-master" not in plain
    mem = lambda d: quantity_bytes(d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])
    assert mem(ds) - mem(plain["DaemonSet/c1"]) == 2 << 30  # the contributed segment is in the sidecar's limit


def test_ha_cluster_masters_elect_a_leader_through_etcd_and_the_sidecars_follow_it():
    """spec.cluster.master with etcdEndpoints: Mooncake's HA mode, as tested on loopback in tests/test_cluster.py
    (enable_ha, etcd_endpoints, cluster_id on the masters; etcd://... and the same cluster id on the sidecars)."""
    from promptcache.operator.builders import desired_children

    owner = Owner(name="c1", namespace="ns", uid="u")
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], "cluster": {
        "enabled": True, "master": {"replicas": 3, "etcdEndpoints": ["etcd-0.etcd:2379", "etcd-1.etcd:2379"]}}})
    children = {c["kind"] + "/" + c["metadata"]["name"]: c for c in desired_children(spec, owner, Capabilities())}
    master = children["Deployment/c1-mooncake-master"]
    assert master["spec"]["replicas"] == 3
    assert master["spec"]["strategy"]["type"] == "RollingUpdate"  # the lease, not the operator, keeps one leader
    container = master["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert {"-enable_ha=true", "-etcd_endpoints=etcd-0.etcd:2379;etcd-1.etcd:2379", "-cluster_id=promptcache.ns.c1",
            "-rpc_address=$(POD_IP)"} <= set(args)
    assert container["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    # A standby opens no RPC port: probing it would keep every standby unready and stall a rolling update.
    assert container["readinessProbe"]["tcpSocket"]["port"] == builders.MASTER_METRICS_PORT
    env = children["ConfigMap/c1-config"]["data"]
    assert env["PROMPTCACHE_CLUSTER_MASTER"] == "etcd://etcd-0.etcd:2379;etcd-1.etcd:2379"
    assert env["PROMPTCACHE_CLUSTER_ID"] == "promptcache.ns.c1"
    _sidecar_takes({k: v for k, v in env.items() if k.startswith("PROMPTCACHE_")})

    single = PromptCacheSpec.from_dict({**example("minimal")["spec"], "cluster": {"enabled": True}})
    one = {c["kind"] + "/" + c["metadata"]["name"]: c for c in desired_children(single, owner, Capabilities())}
    assert one["Deployment/c1-mooncake-master"]["spec"]["strategy"] == {"type": "Recreate"}
    assert "-enable_ha=true" not in one["Deployment/c1-mooncake-master"]["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert "PROMPTCACHE_CLUSTER_ID" not in one["ConfigMap/c1-config"]["data"]


def _zero_copy(extra: dict | None = None, host_path: str = "/run/promptcache") -> PromptCacheSpec:
    return PromptCacheSpec.from_dict({**example("minimal")["spec"], "zeroCopy": {"hostPath": host_path},
                                      **(extra or {})})


def test_zero_copy_puts_the_bulk_socket_in_a_node_directory_per_cache():
    """spec.zeroCopy.hostPath: the DaemonSet mounts <hostPath>/<namespace>.<name> (DirectoryOrCreate) at
    /run/promptcache, the sidecar serves its bulk channel there on a unix socket (0660) besides TCP, and a root
    init container with only CHOWN and FOWNER hands the directory to uid/gid 65532 (0750). Everything else stays as
    `restricted` wants it; the Service is unchanged (the socket is reached through the node's filesystem)."""
    spec = _zero_copy()
    env = builders.sidecar_env(spec)
    assert env["PROMPTCACHE_BULK_ADDRESS"] == f"0.0.0.0:{builders.BULK_PORT},unix:/run/promptcache/bulk.sock"
    assert env["PROMPTCACHE_BULK_SOCKET_MODE"] == "0660"
    pod = _pod(builders.daemon_set(spec, OWNER, OperatorDefaults(), "h"))
    (vol,) = [v for v in pod["volumes"] if "hostPath" in v]
    assert vol == {"name": "bulk-socket", "hostPath": {"path": "/run/promptcache/NS.NAME", "type": "DirectoryOrCreate"}}
    assert builders.socket_host_dir(spec, OWNER) == "/run/promptcache/NS.NAME"
    (c,) = pod["containers"]
    assert {"name": "bulk-socket", "mountPath": "/run/promptcache"} in c["volumeMounts"]
    assert c["securityContext"] == builders.restricted_container_security()
    (init,) = pod["initContainers"]
    assert init["command"] == ["sh", "-c", 'chmod 0750 "$0" && chown 65532:65532 "$0"', "/run/promptcache"]
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]} and sc["readOnlyRootFilesystem"]
    assert init["volumeMounts"] == [{"name": "bulk-socket", "mountPath": "/run/promptcache"}]
    assert init["image"] == c["image"]
    ports = [p["name"] for p in builders.node_local_service(spec, OWNER)["spec"]["ports"]]
    assert ports == ["grpc", "bulk"]
    # Without zero copy: no hostPath, no init container, no unix socket (the minimal golden file stays as it was).
    plain = _pod(builders.daemon_set(PromptCacheSpec.from_dict(example("minimal")["spec"]), OWNER,
                                     OperatorDefaults(), "h"))
    assert "initContainers" not in plain and not [v for v in plain["volumes"] if "hostPath" in v]
    # The sidecar accepts what the operator sets.
    from promptcache.sidecar.config import Settings

    Settings(bulk_address=env["PROMPTCACHE_BULK_ADDRESS"], bulk_socket_mode=env["PROMPTCACHE_BULK_SOCKET_MODE"],
             allow_insecure_remote=True).validate()


def test_zero_copy_with_tls_serves_only_the_unix_socket():
    """TLS keeps the plaintext bulk channel off TCP (no port, no Service port) but the node-local unix socket is
    served: the sidecar allows a unix bulk address with TLS, and its clients authenticate by bearer token."""
    spec = _zero_copy({"security": {"tls": {"secretName": "t"}, "tokens": {"secretName": "k"}}})
    env = builders.sidecar_env(spec)
    assert env["PROMPTCACHE_BULK_ADDRESS"] == "unix:/run/promptcache/bulk.sock"
    pod = _pod(builders.daemon_set(spec, OWNER, OperatorDefaults(), "h"))
    assert not [p for p in pod["containers"][0]["ports"] if p["name"] == "bulk"]
    assert [p["name"] for p in builders.node_local_service(spec, OWNER)["spec"]["ports"]] == ["grpc"]
    from promptcache.sidecar.config import Settings

    Settings(bulk_address=env["PROMPTCACHE_BULK_ADDRESS"], tls_cert_file="/c", tls_key_file="/k",
             token_file="/t", grpc_address="0.0.0.0:50051").validate()


def test_zero_copy_change_rolls_pods_and_two_caches_never_share_a_socket():
    a = builders.desired_children(PromptCacheSpec.from_dict(example("minimal")["spec"]), OWNER, NONE)
    b = builders.desired_children(_zero_copy(), OWNER, NONE)
    assert a[1]["spec"]["template"]["metadata"]["annotations"] != b[1]["spec"]["template"]["metadata"]["annotations"]
    other = Owner(name="NAME", namespace="NS2", uid=OWNER.uid)
    assert builders.socket_host_dir(_zero_copy(), other) != builders.socket_host_dir(_zero_copy(), OWNER)


@pytest.mark.parametrize("allowed,path,ok", [
    (("/run/promptcache",), "/run/promptcache", True),
    (("/run/promptcache",), "/run/promptcache/team-a", True),
    (("/run/promptcache",), "/run/promptcache2", False),
    (("/run/promptcache",), "/var/lib/kubelet", False),
    (("/run/promptcache", "/var/run/pc"), "/var/run/pc/x", True),
    ((), "/run/promptcache", False),
])
def test_zero_copy_host_path_must_be_one_the_operator_allows(allowed, path, ok):
    spec = _zero_copy(host_path=path)
    defaults = OperatorDefaults(zero_copy_host_paths=allowed)
    if ok:
        builders.check_operator_policy(spec, defaults)
    else:
        with pytest.raises(SpecError, match=r"spec\.zeroCopy\.hostPath .* is not allowed by this operator.*"
                                            r"zeroCopy\.allowedHostPaths"):
            builders.check_operator_policy(spec, defaults)
    builders.check_operator_policy(PromptCacheSpec.from_dict(example("minimal")["spec"]), defaults)  # no zero copy


def test_zero_copy_allowed_host_paths_from_the_chart_env():
    env = {"PROMPTCACHE_OPERATOR_ZERO_COPY_HOST_PATHS": "/run/promptcache, /var/run/pc/"}
    assert OperatorDefaults.from_env(env).zero_copy_host_paths == ("/run/promptcache", "/var/run/pc")
    assert OperatorDefaults.from_env({"PROMPTCACHE_OPERATOR_ZERO_COPY_HOST_PATHS": ""}).zero_copy_host_paths == ()
    assert OperatorDefaults.from_env({}).zero_copy_host_paths == ("/run/promptcache",)


@pytest.mark.parametrize("patch,words", [
    ({"zeroCopy": {"hostPath": "run/promptcache"}}, "spec.zeroCopy.hostPath 'run/promptcache' must be an absolute"),
    ({"zeroCopy": {"hostPath": "/"}}, "must be an absolute"),
    ({"zeroCopy": {"hostPath": "/run/../etc"}}, "must be an absolute"),
    ({"zeroCopy": {"hostPath": "/run/promptcache/"}}, "must be an absolute"),
    ({"zeroCopy": {"hostPath": "/" + "a" * 128}}, "must be an absolute"),
    ({"zeroCopy": {"hostPath": "/run/pc"}, "security": {"tls": {"secretName": "t", "mutual": True}}},
     "spec.zeroCopy with spec.security.tls.mutual needs spec.security.tokens"),
])
def test_model_rejects_bad_zero_copy(patch, words):
    with pytest.raises(SpecError, match=re.escape(words)):
        PromptCacheSpec.from_dict({**example("minimal")["spec"], **patch})


def test_a_warm_up_snapshot_is_read_from_its_claim_mounted_read_only():
    """spec.memory.warmupSnapshot: the claim is a read-only volume of the pod, the sidecar is pointed at the file
    inside it, and nothing else changes (no snapshot: no volume, no variable)."""
    minimal = example("minimal")["spec"]
    spec = PromptCacheSpec.from_dict({**minimal, "memory": {**minimal["memory"], "warmupSnapshot": {
        "claimName": "snaps", "path": "fleet-a/hot.pcsnap"}}})
    env = builders.sidecar_env(spec)
    assert env["PROMPTCACHE_WARMUP_SNAPSHOT"] == f"{builders.SNAPSHOT_DIR}/fleet-a/hot.pcsnap"
    pod = _pod(builders.daemon_set(spec, OWNER, OperatorDefaults(), "h"))
    claim = {"claimName": "snaps", "readOnly": True}
    assert {"name": "warmup-snapshot", "persistentVolumeClaim": claim} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "warmup-snapshot", "mountPath": builders.SNAPSHOT_DIR, "readOnly": True} in mounts
    default_path = PromptCacheSpec.from_dict({**minimal, "memory": {**minimal["memory"], "warmupSnapshot": {
        "claimName": "snaps"}}})
    assert builders.sidecar_env(default_path)["PROMPTCACHE_WARMUP_SNAPSHOT"].endswith("/snapshot.pcsnap")
    plain = PromptCacheSpec.from_dict(minimal)
    assert "PROMPTCACHE_WARMUP_SNAPSHOT" not in builders.sidecar_env(plain)
    assert all(v["name"] != "warmup-snapshot" for v in _pod(builders.daemon_set(plain, OWNER, OperatorDefaults(),
                                                                                "h"))["volumes"])


def test_pinned_prefixes_reach_the_sidecar_as_a_file_of_the_caches_config_map():
    """spec.cachePolicy.pinnedPrefixes: one key of the cache's ConfigMap (its tokens once), mounted read-only and
    named by --pinned-prefixes-file; the file is what the sidecar's own parser accepts. None: no key, no volume."""
    import json

    from promptcache.sidecar import pinned

    minimal = example("minimal")["spec"]
    tokens = list(range(1000, 1000 + 300))
    spec = PromptCacheSpec.from_dict({**minimal, "cachePolicy": {"chunkTokens": 256, "pinnedPrefixes": [
        {"name": "system-v1", "tokens": tokens}]}})
    cm = builders.config_map(spec, OWNER)
    path = builders.sidecar_env(spec)["PROMPTCACHE_PINNED_PREFIXES_FILE"]
    assert path == f"{builders.PINNED_DIR}/{builders.PINNED_FILE}"
    assert cm["data"]["PROMPTCACHE_PINNED_PREFIXES_FILE"] == path
    parsed = pinned.parse(cm["data"][builders.PINNED_FILE], "cm", 256, 1 << 20)
    assert [(p.name, list(p.tokens)) for p in parsed] == [("system-v1", tokens)]
    assert str(tokens[5]) not in cm["data"]["promptcache.yaml"]  # the summary names it, without its tokens
    pod = _pod(builders.daemon_set(spec, OWNER, OperatorDefaults(), "h"))
    assert {"name": "pinned-prefixes", "configMap": {"name": f"{OWNER.name}-config", "items": [
        {"key": builders.PINNED_FILE, "path": builders.PINNED_FILE}]}} in pod["volumes"]
    assert {"name": "pinned-prefixes", "mountPath": builders.PINNED_DIR, "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
    plain = PromptCacheSpec.from_dict(minimal)
    assert builders.PINNED_FILE not in builders.config_map(plain, OWNER)["data"]
    assert "PROMPTCACHE_PINNED_PREFIXES_FILE" not in builders.sidecar_env(plain)
    assert "pinnedPrefixes" not in builders.config_map(plain, OWNER)["data"]["promptcache.yaml"]


# -- child names, resources, quota arithmetic, and what the API server refuses (audit against kube-apiserver 1.34) --

BASE = {"model": {"name": "m", "revision": "r"}, "memory": {"host": "16Gi"}}
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def crd_name_max() -> int:
    """The longest PromptCache name the CRD admits (its metadata.name rule)."""
    text = (ROOT / "crds" / "promptcache.io_promptcaches.yaml").read_text()
    return int(re.search(r"self\.metadata\.name\.size\(\) <= (\d+)", text).group(1))


cache_names = st.integers(1, 55).flatmap(lambda n: st.from_regex(rf"\A[a-z]([-a-z0-9]{{{max(n - 2, 0)}}}[a-z0-9])?\Z"
                                                                 if n > 1 else r"\A[a-z]\Z"))


@settings(max_examples=80, deadline=None)
@given(name=cache_names, ha=st.booleans())
def test_every_child_name_is_within_its_kinds_limit(name, ha):
    """For every name the CRD admits, each child's name fits its kind (a Service's is a DNS-1035 label of at most
    63 characters, every other a DNS-1123 subdomain), its label values are label values, and the sidecars are
    pointed at the master Service that is built. Names that fit unchanged stay as they were (upgrades)."""
    assert len(name) <= crd_name_max() == 55  # the strategy covers every length the CRD admits
    cluster = {"enabled": True, **({"master": {"replicas": 2, "etcdEndpoints": ["etcd:2379"]}} if ha else {})}
    spec = PromptCacheSpec.from_dict({**BASE, "cluster": cluster})
    owner = Owner(name=name, namespace="ns", uid="u")
    children = builders.desired_children(spec, owner, ALL)
    for c in children:
        n = c["metadata"]["name"]
        if c["kind"] == "Service":
            assert len(n) <= 63 and _DNS_1035.fullmatch(n), n
        assert len(n) <= 253 and _DNS_1123_SUBDOMAIN.fullmatch(n), n
        for value in c["metadata"]["labels"].values():
            assert len(value) <= 63 and re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", value)
    services = {c["metadata"]["name"] for c in children if c["kind"] == "Service"}
    assert {name, builders.metrics_name(name), builders.master_name(owner)} == services
    if not ha:
        env = next(c for c in children if c["kind"] == "ConfigMap")["data"]
        assert env["PROMPTCACHE_CLUSTER_MASTER"] == f"{builders.master_name(owner)}.ns.svc:50051"
    for suffix in ("-mooncake-master", "-metrics"):
        if len(name + suffix) <= 63:
            assert builders.child_name(name, suffix) == name + suffix


def test_long_names_get_a_stable_hash_and_stay_apart():
    a, b = "a" * 54 + "b", "a" * 54 + "c"
    na, nb = (builders.master_name(Owner(name=n, namespace="ns", uid="u")) for n in (a, b))
    assert len(na) == len(nb) == 63 and na != nb
    assert na.endswith("-mooncake-master") and na == builders.master_name(Owner(name=a, namespace="x", uid="v"))
    assert builders.master_name(Owner(name="a" * 47, namespace="ns", uid="u")) == "a" * 47 + "-mooncake-master"
    cut = builders.master_name(Owner(name="a" * 37 + "-" + "b" * 17, namespace="ns", uid="u"))  # cut at the '-'
    assert re.fullmatch(r"a{37}-[0-9a-f]{8}-mooncake-master", cut), cut


def _res(patch: dict) -> dict:
    return builders.daemon_set(PromptCacheSpec.from_dict({**BASE, **patch}), OWNER, OperatorDefaults(),
                               "h")["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_explicit_resources_are_reconciled_with_the_derived_ones():
    # (a) an explicit limit below a default request: the request is lowered to it
    r = _res({"resources": {"limits": {"cpu": "200m"}}})
    assert r["requests"]["cpu"] == "200m" and r["limits"]["cpu"] == "200m"
    # (b) an explicit request above a derived limit: the limit is raised to it
    r = _res({"resources": {"requests": {"memory": "32Gi"}}})
    assert r["requests"]["memory"] == r["limits"]["memory"] == "32Gi"
    # (e) an extended resource on one side: the other side the same (an explicit value over gpu.count)
    r = _res({"gpu": {"count": 1}, "resources": {"requests": {"nvidia.com/gpu": "2"}}})
    assert r["requests"]["nvidia.com/gpu"] == r["limits"]["nvidia.com/gpu"] == "2"
    r = _res({"resources": {"limits": {"example.com/fpga": 1}}})
    assert r["requests"]["example.com/fpga"] == r["limits"]["example.com/fpga"] == "1"
    # untouched where nothing conflicts
    r = _res({"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "8", "memory": "64Gi"}}})
    assert (r["requests"]["cpu"], r["limits"]["cpu"], r["requests"]["memory"], r["limits"]["memory"]) == (
        "2", "8", "16896Mi", "64Gi")
    for r in (_res({"resources": {"limits": {"cpu": "200m"}}}), _res({"resources": {"requests": {"memory": "32Gi"}}})):
        for name in r["requests"].keys() & r["limits"].keys():
            assert builders.parse_quantity(r["requests"][name]) <= builders.parse_quantity(r["limits"][name])


def test_master_resources_are_validated_and_reconciled_the_same_way():
    spec = PromptCacheSpec.from_dict({**BASE, "cluster": {"enabled": True, "master": {"resources": {
        "limits": {"cpu": "50m"}, "requests": {"memory": "1Gi"}}}}})
    r = builders.mooncake_master(spec, OWNER, OperatorDefaults())["spec"]["template"]["spec"]["containers"][0][
        "resources"]
    assert r == {"requests": {"cpu": "50m", "memory": "1Gi"}, "limits": {"cpu": "50m", "memory": "1Gi"}}


@pytest.mark.parametrize("resources,words", [
    # (c) a memory limit at or below what the cache itself holds (16Gi): OOM once it is full
    ({"limits": {"memory": "16Gi"}}, "spec.resources.limits.memory '16Gi' is not above the 16Gi the cache itself"),
    ({"limits": {"memory": "8Gi"}}, "spec.resources.limits.memory '8Gi' is not above the 16Gi the cache itself"),
    # (d) an explicit request above the explicit limit
    ({"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}, "spec.resources.requests.cpu '2' is above "
                                                         "spec.resources.limits.cpu '1'"),
    # (e) an extended resource with different request and limit
    ({"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "1"}},
     "spec.resources.requests.nvidia.com/gpu '2' must equal spec.resources.limits.nvidia.com/gpu '1'"),
    ({"requests": {"nvidia.com/gpu": "0.5"}}, "spec.resources.requests.nvidia.com/gpu must be a whole number"),
    ({"requests": {"gpu": "1"}}, "spec.resources.requests: 'gpu' is not a resource name"),
    ({"limits": {"Memory": "1Gi"}}, "spec.resources.limits: 'Memory' is not a resource name"),
    ({"limits": {"kubernetes.io/foo": "1"}},
     "spec.resources.limits: 'kubernetes.io/foo' is not a resource a container"),
    ({"limits": {"hugepages-big": "1"}}, "spec.resources.limits: 'hugepages-big' is not a resource name"),
])
def test_resources_the_api_server_would_refuse_are_refused_naming_the_field(resources, words):
    with pytest.raises(SpecError, match=re.escape(words)):
        PromptCacheSpec.from_dict({**BASE, "resources": resources})


def test_disk_limit_below_the_disk_tier_is_refused():
    with pytest.raises(SpecError, match=re.escape("spec.resources.limits.ephemeral-storage '10Gi' is not above the "
                                                  "10Gi the cache itself holds")):
        PromptCacheSpec.from_dict({**BASE, "memory": {"host": "1Gi", "disk": "10Gi"},
                                   "resources": {"limits": {"ephemeral-storage": "10Gi"}}})


def test_a_tight_memory_limit_above_the_cache_is_the_users_call():
    """Between the cache's own bytes and the operator's default (plus 512Mi for the process) a limit is taken, the
    request lowered to it (tests/cluster's OOM scenario sets the budget plus 256Mi on purpose)."""
    spec = PromptCacheSpec.from_dict({**BASE, "resources": {"limits": {"memory": "16640Mi"}}})
    r = builders.daemon_set(spec, OWNER, OperatorDefaults(), "h")["spec"]["template"]["spec"]["containers"][0][
        "resources"]
    assert r["limits"]["memory"] == r["requests"]["memory"] == "16640Mi"


@pytest.mark.parametrize("resources,words", [
    ({"requests": {"cpu": "lots"}}, "spec.cluster.master.resources.requests.cpu: 'lots' is not a Kubernetes quantity"),
    ({"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}, "spec.cluster.master.resources.requests.cpu '2' is above"),
    ({"limits": {"gpu": "1"}}, "spec.cluster.master.resources.limits: 'gpu' is not a resource name"),
])
def test_master_resources_are_refused_like_the_sidecars(resources, words):
    with pytest.raises(SpecError, match=re.escape(words)):
        PromptCacheSpec.from_dict({**BASE, "cluster": {"enabled": True, "master": {"resources": resources}}})


@pytest.mark.parametrize("resources,n,hard", [
    ({"requests": {"cpu": "0.5"}}, 10, {"requests.cpu": "5"}),
    ({"requests": {"cpu": "1.5"}}, 10, {"requests.cpu": "15"}),
    ({"requests": {"cpu": "0.25"}, "limits": {"cpu": "1.05"}}, 3, {"requests.cpu": "750m", "limits.cpu": "3150m"}),
    ({}, 100, {"requests.cpu": "25", "requests.memory": "1650Gi", "limits.memory": "1650Gi"}),
    ({"requests": {"memory": "1.5Gi"}, "limits": {"memory": "17Gi"}}, 3, {"requests.memory": "4608Mi",
                                                                          "limits.memory": "51Gi"}),
    ({"requests": {"memory": "20G"}}, 7, {"requests.memory": "136718750Ki", "limits.memory": "136718750Ki"}),
    ({"limits": {"nvidia.com/gpu": 2}}, 10, {"requests.nvidia.com/gpu": "20"}),
])
def test_quota_multiplies_exactly(resources, n, hard):
    spec = PromptCacheSpec.from_dict({**BASE, "resources": resources, "placement": {"maxNodes": n}})
    got = builders.resource_quota(spec, OWNER)["spec"]["hard"]
    assert {k: got[k] for k in hard} == hard
    for q in got.values():  # the API server's own canonical form: what it stores is what the operator applies
        assert builders.format_quantity(builders.parse_quantity(q), binary=q.endswith("i")) == q


@pytest.mark.parametrize("tolerations,words", [
    ([{"key": "a", "operator": "Exists", "value": "x"}], "spec.placement.tolerations[0].value must be empty"),
    ([{"key": "a", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}],
     "spec.placement.tolerations[0].tolerationSeconds needs effect NoExecute"),
    ([{"key": "a", "operator": "Equal", "value": "v", "tolerationSeconds": 30}],
     "spec.placement.tolerations[0].tolerationSeconds needs effect NoExecute"),
    ([{"operator": "Exists"}, {"key": "a b", "operator": "Exists"}], "spec.placement.tolerations[1].key: 'a b'"),
    ([{"operator": "Equal", "value": "x"}], "spec.placement.tolerations[0].operator must be Exists when key is empty"),
    ([{"key": "a", "value": "x y"}], "spec.placement.tolerations[0].value: 'x y' is not a label value"),
    ([{"key": "a", "operator": "In"}], "spec.placement.tolerations[0].operator must be one of Exists, Equal"),
    ([{"key": "a", "operator": "Exists", "effect": "NoRun"}], "spec.placement.tolerations[0].effect must be one of"),
])
def test_tolerations_the_api_server_would_refuse(tolerations, words):
    with pytest.raises(SpecError, match=re.escape(words)):
        PromptCacheSpec.from_dict({**BASE, "placement": {"tolerations": tolerations}})
    ok = [{"operator": "Exists"}, {"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute",
                                   "tolerationSeconds": 60}, {"key": "example.com/Dedicated"}]
    PromptCacheSpec.from_dict({**BASE, "placement": {"tolerations": ok}})


@pytest.mark.parametrize("repository", [
    "registry.local:5000/team/img@sha256:" + "a" * 64, "registry.local:5000/team/img:1.2", "img:1.2",
    "registry.local/Team/img", "Team/img", "team//img", "/img", "img/", "registry.local:5000",
    "-img", "team/img-", "a" * 256])
def test_image_repository_with_a_tag_digest_or_an_upper_case_path_is_refused(repository):
    with pytest.raises(SpecError, match=r"spec\.image\.repository .* spec\.image\.tag or spec\.image\.digest"):
        PromptCacheSpec.from_dict({**BASE, "image": {"repository": repository}})


@pytest.mark.parametrize("repository", ["registry.local:5000/team/img", "ghcr.io/promptcache/promptcache-sidecar",
                                        "img", "localhost/a__b.c--d/e", "10.0.0.1:5000/x",
                                        "Registry.Local:5000/team/img"])  # (a registry's host name may have capitals)
def test_image_repository_accepted(repository):
    spec = PromptCacheSpec.from_dict({**BASE, "image": {"repository": repository}})
    image = builders.daemon_set(spec, OWNER, OperatorDefaults(), "h")["spec"]["template"]["spec"]["containers"][0][
        "image"]
    assert image == f"{repository}:0.1.0"


@pytest.mark.parametrize("duration,ok", [
    ("10m", True), ("1h30m", True), ("1d", True), ("1w", True), ("1y", True), ("0", True), ("500ms", True),
    ("1y2w3d4h5m6s7ms", True), ("", False), ("10", False), ("30m1h", False), ("1.5h", False), ("10 m", False),
    ("1h1h", False), ("-1m", False)])
def test_alerts_for_takes_prometheus_durations(duration, ok):
    spec = {**BASE, "alerts": {"for": duration}}
    if not ok:
        with pytest.raises(SpecError, match=r"spec\.alerts\.for: .* is not a Prometheus duration"):
            PromptCacheSpec.from_dict(spec)
        return
    rule = builders.prometheus_rule(PromptCacheSpec.from_dict(spec), OWNER)
    assert duration in {r.get("for") for r in rule["spec"]["groups"][0]["rules"]}


def test_annotation_keys_are_checked_as_the_api_server_does():
    """Annotation keys are qualified names after lower-casing (label keys are not); the 256 KiB counts bytes."""
    PromptCacheSpec.from_dict({**BASE, "pod": {"annotations": {"Example.COM/Owner": "x"}}})
    with pytest.raises(SpecError, match=re.escape("spec.pod.labels: 'Example.COM/owner': the prefix")):
        PromptCacheSpec.from_dict({**BASE, "pod": {"labels": {"Example.COM/owner": "x"}}})
    with pytest.raises(SpecError, match=re.escape("spec.pod.annotations: 'Example_.COM/Owner': the prefix")):
        PromptCacheSpec.from_dict({**BASE, "pod": {"annotations": {"Example_.COM/Owner": "x"}}})
    # 100k three-byte characters: 300 KB though 100k characters
    with pytest.raises(SpecError, match="spec.pod.annotations: more than"):
        PromptCacheSpec.from_dict({**BASE, "pod": {"annotations": {"note": "\u20ac" * 100_000}}})
    PromptCacheSpec.from_dict({**BASE, "pod": {"annotations": {"note": "x" * 100_000}}})


# --- what a PromptCache's creator may put into the pods (audit: pod scheduling / annotations, spec.image) --------
@pytest.mark.parametrize("key", ["container.apparmor.security.beta.kubernetes.io/sidecar",
                                 "seccomp.security.alpha.kubernetes.io/pod", "sidecar.istio.io/inject",
                                 "istio.io/rev", "proxy.istio.io/config", "traffic.sidecar.istio.io/excludePorts",
                                 "cluster-autoscaler.kubernetes.io/safe-to-evict", "config.linkerd.io/skip-ports"])
def test_security_relevant_pod_annotations_are_refused(key):
    with pytest.raises(SpecError, match=f"spec.pod.annotations may not set {re.escape(key)}"):
        PromptCacheSpec.from_dict({**example("minimal")["spec"], "pod": {"annotations": {key: "x"}}})


def test_other_pod_annotations_are_kept():
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], "pod": {"annotations": {
        "example.com/owner": "ml", "notistio.io/x": "y"}}})
    assert spec.pod.annotations == {"example.com/owner": "ml", "notistio.io/x": "y"}


@pytest.mark.parametrize("pc", ["system-node-critical", "system-cluster-critical"])
def test_system_priority_classes_need_the_operators_policy(pc):
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], "placement": {"priorityClassName": pc}})
    with pytest.raises(SpecError, match=f"spec.placement.priorityClassName {pc} is not allowed.*"
                                        "allowedSystemPriorityClasses"):
        builders.check_operator_policy(spec, OperatorDefaults())
    builders.check_operator_policy(spec, OperatorDefaults(system_priority_classes=(pc,)))
    env = {"PROMPTCACHE_OPERATOR_SYSTEM_PRIORITY_CLASSES": f" {pc},system-x "}
    assert OperatorDefaults.from_env(env).system_priority_classes == (pc, "system-x")
    assert OperatorDefaults.from_env({}).system_priority_classes == ()


@pytest.mark.parametrize("allowed,repo,ok", [
    (None, None, True),                                                  # the operator's image
    (None, OperatorDefaults().image_repository, True),
    (None, "registry.example/x", False),                                  # default: only the operator's image
    (None, OperatorDefaults().image_repository + "-evil", False),
    (("registry.corp/ml/",), "registry.corp/ml/cache", True),
    (("registry.corp/ml",), "registry.corp/mlx/cache", False),
    (("registry.corp/ml",), OperatorDefaults().image_repository, True),   # the operator's own always
    ((), "registry.example/x", True),                                     # empty: any
])
def test_image_repositories_the_operator_allows(allowed, repo, ok):
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], **({"image": {"repository": repo}} if repo
                                                                        else {})})
    defaults = OperatorDefaults(image_repositories=allowed)
    if ok:
        builders.check_operator_policy(spec, defaults)
    else:
        with pytest.raises(SpecError, match=f"spec.image.repository {re.escape(repo)} is not allowed.*"
                                            "allowedImageRepositories"):
            builders.check_operator_policy(spec, defaults)


def test_image_repositories_from_the_chart_environment():
    assert OperatorDefaults.from_env({}).image_repositories is None
    assert OperatorDefaults.from_env({"PROMPTCACHE_OPERATOR_IMAGE_REPOSITORIES": ""}).image_repositories == ()
    env = {"PROMPTCACHE_OPERATOR_IMAGE_REPOSITORIES": "registry.corp/ml/, ghcr.io/x"}
    assert OperatorDefaults.from_env(env).image_repositories == ("registry.corp/ml/", "ghcr.io/x")


@pytest.mark.parametrize("disk", ["1Gi", "200Gi", "10Ti"])
def test_the_disk_tiers_index_is_bounded_and_counted_in_the_containers_memory(disk):
    """The sidecar's disk-tier index takes RAM per record whatever the chunk's size (--disk-index-bytes bounds it;
    docs/disk-tier.md): the operator gives it the sidecar's own default bound and counts it in the container's
    memory, and the autoscaler's budget leaves it out, so a full disk tier of tiny records cannot take the sidecar
    past its limit (OOM-killed, and the same index loaded again at every restart)."""
    from promptcache.operator import autoscale
    from promptcache.sidecar.disk import default_index_bytes

    minimal = example("minimal")["spec"]
    spec = PromptCacheSpec.from_dict({**minimal, "memory": {**minimal.get("memory", {}), "disk": disk}})
    bare = PromptCacheSpec.from_dict(minimal)
    index = default_index_bytes(builders.quantity_bytes(disk))
    assert spec.disk_index_bytes() == index and bare.disk_index_bytes() == 0
    assert spec.container_memory_bytes() - bare.container_memory_bytes() == index
    assert builders.config_map(spec, OWNER)["data"]["PROMPTCACHE_DISK_INDEX_BYTES"] == str(index)
    config = autoscale.Config()
    assert autoscale.overhead(spec, config) == config.overhead_bytes + index
    assert autoscale.initial_memory(spec, autoscale.overhead(spec, config)) - index == \
        autoscale.initial_memory(bare, autoscale.overhead(bare, config))


# --- the cluster tier's NetworkPolicies ----------------------------------------------------------------------------

def _admits(policy: dict, pod_labels: dict[str, str], port: int) -> bool:
    """Whether `policy` lets a pod of the same namespace with `pod_labels` reach `port` (TCP) of the pods it selects
    (NetworkPolicy semantics, for the peers these policies use: podSelector.matchLabels only)."""
    def peer(p: dict) -> bool:
        assert set(p) == {"podSelector"} and set(p["podSelector"]) == {"matchLabels"}, p  # same namespace only
        return p["podSelector"]["matchLabels"].items() <= pod_labels.items()
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if (not rule.get("from") or any(peer(p) for p in rule["from"])) and \
                (not ports or any(p["port"] == port and p["protocol"] == "TCP" for p in ports)):
            return True
    return False


def _policies(spec: PromptCacheSpec, owner: Owner) -> tuple[dict, dict, dict, dict]:
    """(the masters' policy, the sidecars' policy, the master Deployment, the DaemonSet)."""
    children = {builders.child_key(c): c for c in builders.desired_children(spec, owner, ALL)}
    master = builders.master_name(owner)
    return (children[f"NetworkPolicy/{master}"], children[f"NetworkPolicy/{owner.name}"],
            children[f"Deployment/{master}"], children[f"DaemonSet/{owner.name}"])


def test_without_the_cluster_tier_there_is_no_network_policy():
    for name in ("minimal", "full"):
        spec = {**example(name)["spec"], "cluster": {"enabled": False}}
        kinds = {c["kind"] for c in builders.desired_children(PromptCacheSpec.from_dict(spec), OWNER, ALL)}
        assert "NetworkPolicy" not in kinds


def test_a_cache_can_leave_the_network_policies_to_its_namespace():
    """cluster.networkPolicies false: the master and its Service as before, no NetworkPolicy (they add up: ours open
    the sidecars' serving ports to every pod, which a namespace that denies by default may not want)."""
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], "cluster": {"enabled": True,
                                                                                 "networkPolicies": False}})
    kinds = [c["kind"] for c in builders.desired_children(spec, OWNER, ALL)]
    assert "NetworkPolicy" not in kinds and kinds.count("Deployment") == 1 and kinds.count("Service") == 3
    assert PromptCacheSpec.from_dict({**example("minimal")["spec"], "cluster": {"enabled": True}}
                                     ).cluster.networkPolicies is True


def test_network_policies_select_the_tiers_pods_and_keep_the_store_to_them():
    owner = Owner(name="c1", namespace="ns", uid="u")
    spec = PromptCacheSpec.from_dict({**example("minimal")["spec"], "cluster": {"enabled": True}})
    mp, sp, master, ds = _policies(spec, owner)
    assert mp["metadata"]["name"] == "c1-mooncake-master" and sp["metadata"]["name"] == "c1"
    assert mp["spec"]["podSelector"] == master["spec"]["selector"]
    assert sp["spec"]["podSelector"] == ds["spec"]["selector"]
    assert mp["spec"]["policyTypes"] == sp["spec"]["policyTypes"] == ["Ingress"]  # egress (etcd) is not touched
    assert mp["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": builders.selector(owner)}}],
         "ports": [{"protocol": "TCP", "port": builders.MASTER_PORT}]},
        {"ports": [{"protocol": "TCP", "port": builders.MASTER_METRICS_PORT}]}]
    assert sp["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": builders.selector(owner)}},
                  {"podSelector": {"matchLabels": builders._master_selector(owner)}}]},
        {"ports": [{"protocol": "TCP", "port": p} for p in (builders.GRPC_PORT, builders.BULK_PORT,
                                                            builders.METRICS_PORT)]}]
    # HA: the masters reach each other too (any port); still nobody else reaches the RPC port.
    ha = PromptCacheSpec.from_dict({**example("minimal")["spec"], "cluster": {
        "enabled": True, "master": {"replicas": 2, "etcdEndpoints": ["etcd:2379"]}}})
    mp_ha = _policies(ha, owner)[0]
    assert {"from": [{"podSelector": {"matchLabels": builders._master_selector(owner)}}]} in mp_ha["spec"]["ingress"]


@settings(max_examples=40, deadline=None)
@given(tls=st.booleans(), ha=st.booleans(), zero_copy=st.booleans(), other_port=st.integers(1, 65535),
       name=st.sampled_from(["c1", "a" * 55]))
def test_network_policies_let_everyone_reach_the_served_ports_and_only_the_tier_the_rest(tls, ha, zero_copy,
                                                                                         other_port, name):
    """Property: every port the sidecar container declares is reachable from any pod; any other port of a sidecar
    (Mooncake's transfer ports, picked at run time) only from this cache's sidecars and masters; the master's RPC
    port only from this cache's sidecars (and, with HA, the other masters), its metrics port from anyone. A pod of
    another PromptCache, or one carrying only part of the labels, is anyone."""
    owner = Owner(name=name, namespace="ns", uid="u")
    spec = {**example("minimal")["spec"], "cluster": {
        "enabled": True, **({"master": {"replicas": 2, "etcdEndpoints": ["etcd:2379"]}} if ha else {})}}
    if tls:
        spec["security"] = {"tls": {"secretName": "tls"}}
    if zero_copy:
        spec["zeroCopy"] = {"hostPath": "/run/promptcache"}
    mp, sp, master, ds = _policies(PromptCacheSpec.from_dict(spec), owner)
    sidecar_pod = ds["spec"]["template"]["metadata"]["labels"]
    master_pod = master["spec"]["template"]["metadata"]["labels"]
    strangers = [{}, {"app": "vllm"}, {**builders.selector(Owner("other", "ns", "u2"))},
                 {builders.CACHE_LABEL: name}, {**builders.labels(owner), "app.kubernetes.io/component": "other"}]
    containers = ds["spec"]["template"]["spec"]["containers"] + ds["spec"]["template"]["spec"].get("initContainers", [])
    served = {p["containerPort"] for c in containers for p in c.get("ports", [])}
    assert {builders.GRPC_PORT, builders.METRICS_PORT} <= served and (builders.BULK_PORT in served) == (not tls)
    for port in served | {other_port}:
        for stranger in strangers:
            assert _admits(sp, stranger, port) == (port in served), (stranger, port)
        assert _admits(sp, sidecar_pod, port) and _admits(sp, master_pod, port)
    for stranger in strangers:
        assert not _admits(mp, stranger, builders.MASTER_PORT)
        assert _admits(mp, stranger, builders.MASTER_METRICS_PORT)
        assert _admits(mp, stranger, other_port) == (other_port == builders.MASTER_METRICS_PORT)
    assert _admits(mp, sidecar_pod, builders.MASTER_PORT)
    assert _admits(mp, sidecar_pod, other_port) == (other_port in (builders.MASTER_PORT, builders.MASTER_METRICS_PORT))
    assert _admits(mp, master_pod, other_port) == (ha or other_port == builders.MASTER_METRICS_PORT)
