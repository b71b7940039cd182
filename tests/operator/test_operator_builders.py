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
