"""Pure functions: PromptCache spec -> child manifests. No I/O; golden-file tested (tests/operator/golden/).

Children of a PromptCache named N in namespace NS:
  ConfigMap      N-config    sidecar settings as PROMPTCACHE_* variables (envFrom) plus promptcache.yaml
  DaemonSet      N           one sidecar per selected GPU node; restricted Pod Security Standard
  Service        N           node-local gRPC endpoint (internalTrafficPolicy: Local)
  Service        N-metrics   headless, for Prometheus
  ResourceQuota  N-quota     scoped by PriorityClass to the cache pods only
  VerticalPodAutoscaler N    if the VPA CRD is installed (updateMode Off until the autoscaler decides a size)
  ServiceMonitor N           if the Prometheus operator CRDs are installed
  PrometheusRule N           if installed and spec.alerts.enabled
With spec.cluster.enabled, the cluster tier (docs/cluster.md):
  Deployment     N-mooncake-master   the Mooncake master
  Service        N-mooncake-master   its RPC port
  NetworkPolicy  N-mooncake-master   the master's RPC port from this cache's sidecars only
  NetworkPolicy  N                   the sidecars: any port from this cache's sidecars and masters, else their
                                     declared ports only (Mooncake's transfer ports are unauthenticated)
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import yaml

from . import alerts
# (MEMORY_OVERHEAD, format_bytes: autoscale reads them here)
from .model import (DEFAULT_PRIORITY_CLASS, DISK_OVERHEAD, GROUP, KIND, MEMORY_OVERHEAD, VERSION,  # noqa: F401
                    PromptCacheSpec, SpecError, format_bytes, is_extended_resource, is_priority_class_name,
                    isolated_identity, not_overcommittable, parse_quantity, quantity_bytes, to_dict)

GRPC_PORT = 50051
BULK_PORT = 50052  # the bulk channel (docs/bulk-channel.md); plaintext, so only without TLS
METRICS_PORT = 9400
MASTER_PORT = 50051  # the Mooncake master's RPC port (docs/cluster.md)
MASTER_METRICS_PORT = 9003
CONTAINER = "sidecar"
MANAGED_BY = "promptcache-operator"
CACHE_LABEL = f"{GROUP}/cache"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
DATA_DIR = "/var/cache/promptcache"
RUN_AS = 65532
SECRETS_DIR = "/etc/promptcache"
# spec.security: volume name, mount path, and the sidecar settings pointing into it (docs/security.md).
TLS_DIR = f"{SECRETS_DIR}/tls"
TOKENS_DIR = f"{SECRETS_DIR}/tokens"
TENANT_SECRET_DIR = f"{SECRETS_DIR}/tenant-secret"
SECRET_MODE = 0o440  # owner and fsGroup (65532) read; the kubelet applies fsGroup to Secret volumes
# spec.zeroCopy: the bulk channel's unix socket, in the node directory <hostPath>/<namespace>.<name> mounted here.
SOCKET_DIR = "/run/promptcache"
SNAPSHOT_DIR = "/var/lib/promptcache-snapshot"  # spec.memory.warmupSnapshot's claim, read-only
PINNED_DIR = "/etc/promptcache-pinned"  # spec.cachePolicy.pinnedPrefixes, a key of the cache's ConfigMap
PINNED_FILE = "pinned-prefixes.json"
BULK_SOCKET = f"{SOCKET_DIR}/bulk.sock"
SOCKET_MODE = "0660"  # the sidecar's uid and group 65532 connect; inference pods join the group (supplementalGroups)
SOCKET_DIR_MODE = "0750"
DEFAULT_ZERO_COPY_HOST_PATHS = ("/run/promptcache",)

VPA = ("autoscaling.k8s.io/v1", "VerticalPodAutoscaler")
SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
PROMETHEUS_RULE = ("monitoring.coreos.com/v1", "PrometheusRule")
NETWORK_POLICY = ("networking.k8s.io/v1", "NetworkPolicy")
OPTIONAL_CRDS = {
    "VerticalPodAutoscaler": "verticalpodautoscalers.autoscaling.k8s.io",
    "ServiceMonitor": "servicemonitors.monitoring.coreos.com",
    "PrometheusRule": "prometheusrules.monitoring.coreos.com",
}


@dataclass(frozen=True)
class OperatorDefaults:
    """What the operator fills in where a PromptCache leaves it out (the chart sets these by env)."""

    image_repository: str = "ghcr.io/promptcache/promptcache-sidecar"
    image_tag: str = "0.1.0"
    image_pull_policy: str = "IfNotPresent"
    monitoring_labels: tuple[tuple[str, str], ...] = tuple(alerts.DEFAULT_MONITORING_LABELS.items())
    runbook_base_url: str = alerts.RUNBOOK_BASE
    # The tenant the operator authenticates as towards secured sidecars (its token's file name in a cache's
    # tokens Secret, or its client certificate's common name); made an admin tenant of every such cache.
    operator_tenant: str = "promptcache-operator"
    # Node directories a PromptCache's spec.zeroCopy.hostPath may be or be under (chart value
    # zeroCopy.allowedHostPaths); empty: zero copy is refused.
    zero_copy_host_paths: tuple[str, ...] = DEFAULT_ZERO_COPY_HOST_PATHS
    # PriorityClass of the pods of a PromptCache that names none in spec.placement.priorityClassName (chart value
    # priorityClass.name, the PriorityClass the chart creates); priority_class_name.
    priority_class: str = DEFAULT_PRIORITY_CLASS
    # PriorityClasses named system-* (system-node-critical, system-cluster-critical) a PromptCache may use (chart
    # value allowedSystemPriorityClasses); default none: they outrank and preempt the cluster's own components.
    system_priority_classes: tuple[str, ...] = ()
    # Image repositories (prefixes) a PromptCache's spec.image.repository may be or be under (chart value
    # allowedImageRepositories). None: only image_repository (the operator's own sidecar image); (): any.
    image_repositories: tuple[str, ...] | None = None
    # Whether a PromptCache may tolerate every taint (a toleration with no key and operator Exists) and select or
    # tolerate control-plane nodes (node-role.kubernetes.io/control-plane or /master in spec.placement's
    # nodeSelector, affinity or tolerations) (chart value allowControlPlanePlacement); default no: the cache's
    # pods would run beside the API server and etcd, on nodes kept for them.
    allow_control_plane_placement: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "OperatorDefaults":
        d = cls()
        system_priority_classes = tuple(p.strip() for p in
                                        env.get("PROMPTCACHE_OPERATOR_SYSTEM_PRIORITY_CLASSES", "").split(",")
                                        if p.strip())
        return cls(
            image_repository=env.get("PROMPTCACHE_SIDECAR_IMAGE_REPOSITORY", d.image_repository),
            image_tag=env.get("PROMPTCACHE_SIDECAR_IMAGE_TAG", d.image_tag),
            image_pull_policy=env.get("PROMPTCACHE_SIDECAR_IMAGE_PULL_POLICY", d.image_pull_policy),
            monitoring_labels=tuple(sorted(alerts.monitoring_labels_from_env(env).items())),
            runbook_base_url=env.get("PROMPTCACHE_OPERATOR_RUNBOOK_BASE_URL", d.runbook_base_url),
            operator_tenant=env.get("PROMPTCACHE_OPERATOR_TENANT", d.operator_tenant),
            zero_copy_host_paths=(tuple(p.strip().rstrip("/") or "/" for p in
                                        env["PROMPTCACHE_OPERATOR_ZERO_COPY_HOST_PATHS"].split(",") if p.strip())
                                  if "PROMPTCACHE_OPERATOR_ZERO_COPY_HOST_PATHS" in env else d.zero_copy_host_paths),
            priority_class=_priority_class(env, system_priority_classes, d.priority_class),
            system_priority_classes=system_priority_classes,
            image_repositories=(tuple(p.strip() for p in env["PROMPTCACHE_OPERATOR_IMAGE_REPOSITORIES"].split(",")
                                      if p.strip())
                                if "PROMPTCACHE_OPERATOR_IMAGE_REPOSITORIES" in env else d.image_repositories),
            allow_control_plane_placement=_flag(env, "PROMPTCACHE_OPERATOR_ALLOW_CONTROL_PLANE_PLACEMENT",
                                                d.allow_control_plane_placement),
        )


DEFAULT_PRIORITY_CLASS_ENV = "PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS"


def _priority_class(env: Mapping[str, str], system_priority_classes: tuple[str, ...], default: str) -> str:
    """The operator's default PriorityClass from the environment (unset or empty: `default`), refused (ValueError)
    naming the variable when no PriorityClass could have that name, or when it is a system-* one the operator
    does not allow (every PromptCache naming none would be refused)."""
    raw = env.get(DEFAULT_PRIORITY_CLASS_ENV, "")
    name = raw.strip()
    if not name:
        return default
    if not is_priority_class_name(name):
        raise ValueError(f"{DEFAULT_PRIORITY_CLASS_ENV}={raw!r} is not a PriorityClass name (a DNS-1123 subdomain: "
                         "at most 253 lower-case letters, digits, '-' and '.', starting and ending with a letter or "
                         "digit)")
    if name.startswith("system-") and name not in system_priority_classes:
        raise ValueError(f"{DEFAULT_PRIORITY_CLASS_ENV}={raw!r} is a system-* PriorityClass that "
                         "PROMPTCACHE_OPERATOR_SYSTEM_PRIORITY_CLASSES does not allow (chart values priorityClass.name "
                         "and allowedSystemPriorityClasses)")
    return name


def priority_class_name(spec: PromptCacheSpec, defaults: OperatorDefaults) -> str:
    """The PriorityClass a cache's pods run with (and its ResourceQuota is scoped to): spec.placement.
    priorityClassName, or where that is unset (or empty) the operator's default (chart value priorityClass.name)."""
    return spec.placement.priorityClassName or defaults.priority_class


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A true/false setting from the environment, refused (ValueError) naming the variable when it is neither."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("0", "false", "no"):
        return False
    raise ValueError(f"{name}={env[name]!r} is not true or false")


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class Capabilities:
    """Which optional CRDs the API server has."""

    vpa: bool = False
    service_monitor: bool = False
    prometheus_rule: bool = False


DNS_LABEL_MAX = 63  # a Service's name (DNS-1035 label)
DNS_SUBDOMAIN_MAX = 253  # most other objects' names (DNS-1123 subdomain)


def child_name(name: str, suffix: str, limit: int = DNS_LABEL_MAX) -> str:
    """`name` + `suffix` within `limit` characters. Unchanged where it fits (children keep their names across
    upgrades); longer: the name cut short, '-', 8 hex digits of the full name's sha256, then the suffix, so two long
    names sharing a beginning still differ, and the result is the same on every reconcile."""
    full = f"{name}{suffix}"
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    head = name[:max(limit - len(suffix) - len(digest) - 1, 0)].rstrip("-.")
    return f"{head}-{digest}{suffix}" if head else f"{digest}{suffix}"


def config_name(owner: Owner) -> str:
    return child_name(owner.name, "-config", DNS_SUBDOMAIN_MAX)


def quota_name(owner: Owner) -> str:
    return child_name(owner.name, "-quota", DNS_SUBDOMAIN_MAX)


def metrics_name(owner_name: str) -> str:
    """The headless metrics Service (its name is the `service` label of every sidecar series)."""
    return child_name(owner_name, "-metrics")


def labels(owner: Owner) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "promptcache",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": "cache-sidecar",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        CACHE_LABEL: owner.name,
    }


def selector(owner: Owner) -> dict[str, str]:
    return {CACHE_LABEL: owner.name, "app.kubernetes.io/component": "cache-sidecar"}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(owner: Owner, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": {**labels(owner), **(extra_labels or {})},
            "ownerReferences": [owner_reference(owner)]}


def _image(spec: PromptCacheSpec, d: OperatorDefaults) -> tuple[str, str]:
    repo = spec.image.repository or d.image_repository
    ref = f"{repo}@{spec.image.digest}" if spec.image.digest else f"{repo}:{spec.image.tag or d.image_tag}"
    return ref, spec.image.pullPolicy or d.image_pull_policy


def _bytes(q: str) -> str:
    return str(quantity_bytes(q))


def restricted_container_security() -> dict[str, Any]:
    """A container securityContext that the restricted Pod Security Standard admits (a new dict each time)."""
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def sidecar_env(spec: PromptCacheSpec, defaults: OperatorDefaults = OperatorDefaults()) -> dict[str, str]:
    """PROMPTCACHE_* settings of `promptcache serve` (see sidecar/promptcache/sidecar/config.py)."""
    on_gpu = spec.gpu.count > 0
    budget = spec.memory.device if (on_gpu and spec.memory.device) else spec.memory.host
    env = {
        "PROMPTCACHE_GRPC_ADDRESS": f"0.0.0.0:{GRPC_PORT}",
        "PROMPTCACHE_ALLOW_INSECURE_REMOTE": "true",  # node-local Service only; see docs/operator.md
        "PROMPTCACHE_METRICS_HOST": "0.0.0.0",
        "PROMPTCACHE_METRICS_PORT": str(METRICS_PORT),
        "PROMPTCACHE_DEVICE": "cuda" if on_gpu else "cpu",
        "PROMPTCACHE_MEMORY_BYTES": _bytes(budget),
        "PROMPTCACHE_CHUNK_TOKENS": str(spec.cachePolicy.chunkTokens),
        "PROMPTCACHE_TTL_SECONDS": str(spec.cachePolicy.ttlSeconds),
        "PROMPTCACHE_MAX_LIFETIME_SECONDS": str(spec.cachePolicy.maxLifetimeSeconds),
        "PROMPTCACHE_EVICTION_POLICY": spec.cachePolicy.evictionPolicy,
        "PROMPTCACHE_QUANTIZATION": spec.cachePolicy.quantization,
        "PROMPTCACHE_TENANCY": spec.tenancy.mode.lower(),
        "PROMPTCACHE_DATA_DIR": DATA_DIR,
        "PROMPTCACHE_DISK_BYTES": _bytes(spec.memory.disk) if spec.memory.disk else "0",
        # the index's RAM bound, counted in the container's memory (container_memory_bytes)
        "PROMPTCACHE_DISK_INDEX_BYTES": str(spec.disk_index_bytes()),
        # nothing to warm from without a disk or cluster tier or a snapshot
        "PROMPTCACHE_WARMUP_SECONDS": str(spec.memory.warmupSeconds if (spec.memory.disk or spec.cluster.enabled or
                                                                         spec.memory.warmupSnapshot) else 0),
        "PROMPTCACHE_LOG_FORMAT": "json",
    }
    if spec.cachePolicy.pinnedPrefixes:
        env["PROMPTCACHE_PINNED_PREFIXES_FILE"] = f"{PINNED_DIR}/{PINNED_FILE}"
    if spec.memory.warmupSnapshot is not None:
        env["PROMPTCACHE_WARMUP_SNAPSHOT"] = f"{SNAPSHOT_DIR}/{spec.memory.warmupSnapshot.path}"
    if spec.cachePolicy.maxChunkBytes:
        env["PROMPTCACHE_MAX_CHUNK_BYTES"] = _bytes(spec.cachePolicy.maxChunkBytes)
    if spec.cluster.enabled:
        env["PROMPTCACHE_CLUSTER_PROTOCOL"] = spec.cluster.protocol
        env["PROMPTCACHE_CLUSTER_SEGMENT_BYTES"] = _bytes(spec.cluster.segmentMemory)
    env.update(security_env(spec))
    if isolated_identity(spec.security) and spec.autoscaling.enabled:
        # Resize is an admin call once callers authenticate: the autoscaler's identity must be allowed it.
        env["PROMPTCACHE_ADMIN_TENANTS"] = defaults.operator_tenant
    if spec.security.tls is not None:
        del env["PROMPTCACHE_ALLOW_INSECURE_REMOTE"]  # TLS: never fall back to plaintext
    bulk = ([f"0.0.0.0:{BULK_PORT}"] if _bulk_channel(spec) else []) + ([f"unix:{BULK_SOCKET}"] if
                                                                        spec.zeroCopy.hostPath else [])
    if bulk:
        env["PROMPTCACHE_BULK_ADDRESS"] = ",".join(bulk)
    if spec.zeroCopy.hostPath:
        env["PROMPTCACHE_BULK_SOCKET_MODE"] = SOCKET_MODE
    return dict(sorted(env.items()))


def _bulk_channel(spec: PromptCacheSpec) -> bool:
    """The bulk channel has no TLS (and so no client certificates): served on TCP only where gRPC is plaintext
    too. Its unix socket (spec.zeroCopy) never leaves the node, so it is served with TLS as well."""
    return spec.security.tls is None


def socket_host_dir(spec: PromptCacheSpec, owner: Owner) -> str | None:
    """The node directory of this cache's bulk socket (spec.zeroCopy.hostPath): one per cache, so two caches on a
    node never share a socket. Inference pods mount it (hostPath, type Directory) and dial
    unix:<their mount>/bulk.sock. None without zero copy."""
    if not spec.zeroCopy.hostPath:
        return None
    return f"{spec.zeroCopy.hostPath}/{owner.namespace}.{owner.name}"


def _under(value: str, prefixes: tuple[str, ...]) -> bool:
    return any(value == p.rstrip("/") or value.startswith(p.rstrip("/") + "/") for p in prefixes)


CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


def _obj(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _objs(x: Any) -> list[dict[str, Any]]:
    return [_obj(v) for v in x] if isinstance(x, list) else []


def control_plane_placement(placement: Any) -> str | None:
    """Pure: the first field of spec.placement (`placement`: model.Placement) that tolerates every taint or puts
    the cache's pods on control-plane nodes, with what it says, or None:
      - a toleration with no key and operator Exists (it tolerates every taint, the control plane's included);
      - a toleration of the control-plane taint (key node-role.kubernetes.io/control-plane or /master);
      - a nodeSelector on a control-plane label;
      - a node affinity term (required or preferred) with an In or Exists expression on a control-plane label.
    NotIn and DoesNotExist on those labels keep pods off the control plane and are fine."""
    for i, t in enumerate(placement.tolerations):
        if not t.key and t.operator == "Exists":
            return (f"spec.placement.tolerations[{i}] (operator Exists with no key) tolerates every taint, the "
                    "control-plane nodes' included")
        if t.key in CONTROL_PLANE_LABELS:
            return f"spec.placement.tolerations[{i}] tolerates the control-plane taint {t.key}"
    for key in sorted(placement.nodeSelector):
        if key in CONTROL_PLANE_LABELS:
            return f"spec.placement.nodeSelector selects control-plane nodes ({key})"
    na = _obj(_obj(placement.affinity).get("nodeAffinity"))   # copied verbatim: any shape
    terms = [(f"requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}]", t)
             for i, t in enumerate(_objs(_obj(na.get("requiredDuringSchedulingIgnoredDuringExecution"))
                                         .get("nodeSelectorTerms")))]
    terms += [(f"preferredDuringSchedulingIgnoredDuringExecution[{i}].preference", _obj(p.get("preference")))
              for i, p in enumerate(_objs(na.get("preferredDuringSchedulingIgnoredDuringExecution")))]
    for where, term in terms:
        for j, e in enumerate(_objs(term.get("matchExpressions"))):
            if e.get("key") in CONTROL_PLANE_LABELS and e.get("operator") in ("In", "Exists"):
                return (f"spec.placement.affinity.nodeAffinity.{where}.matchExpressions[{j}] selects "
                        f"control-plane nodes ({e['key']} {e['operator']})")
    return None


def check_operator_policy(spec: PromptCacheSpec, defaults: OperatorDefaults) -> None:
    """What the cluster's operator allows beyond the CRD (chart values): spec.zeroCopy.hostPath must be one of
    zeroCopy.allowedHostPaths or under one; a system-* spec.placement.priorityClassName must be in
    allowedSystemPriorityClasses; spec.image.repository must be the operator's sidecar image or under one of
    allowedImageRepositories; spec.placement may neither tolerate every taint nor select or tolerate control-plane
    nodes unless allowControlPlanePlacement. Raises SpecError (the PromptCache's InvalidSpec condition)."""
    if not defaults.allow_control_plane_placement:
        problem = control_plane_placement(spec.placement)
        if problem:
            raise SpecError(f"{problem}: not allowed by this operator: the cache's pods would run on the "
                            "control-plane nodes, beside the API server and etcd (chart value "
                            "allowControlPlanePlacement)")
    pc = spec.placement.priorityClassName  # (the operator's default was checked at its start)
    if pc and pc.startswith("system-") and pc not in defaults.system_priority_classes:
        raise SpecError(f"spec.placement.priorityClassName {pc} is not allowed by this operator: system-* "
                        "PriorityClasses outrank the cluster's own components (chart value "
                        "allowedSystemPriorityClasses)")
    repo = spec.image.repository
    allowed_repos = (defaults.image_repository,) if defaults.image_repositories is None \
        else defaults.image_repositories
    if repo is not None and repo != defaults.image_repository and allowed_repos \
            and not _under(repo, allowed_repos):
        raise SpecError(f"spec.image.repository {repo} is not allowed by this operator: it must be, or be under, "
                        f"{', '.join(allowed_repos)} (chart value allowedImageRepositories)")
    path = spec.zeroCopy.hostPath
    if path is None:
        return
    allowed = defaults.zero_copy_host_paths
    if not any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed):
        raise SpecError(f"spec.zeroCopy.hostPath {path} is not allowed by this operator: it must be "
                        + (f"one of, or under, {', '.join(allowed)}" if allowed else "empty (zero copy is off)")
                        + " (chart value zeroCopy.allowedHostPaths)")


def socket_dir_init_container(image: str, pull: str) -> dict[str, Any]:
    """Root for one command, two capabilities: the hostPath directory the kubelet creates root-owned 0755 becomes
    the sidecar's (uid and group 65532, 0750), so the non-root sidecar can create its socket there and only the
    group reaches it. chmod before chown: once 65532 owns it, root would need FOWNER (kept for a restarted pod,
    whose directory 65532 already owns)."""
    return {
        "name": "socket-dir",
        "image": image,
        "imagePullPolicy": pull,
        "command": ["sh", "-c", f'chmod {SOCKET_DIR_MODE} "$0" && chown {RUN_AS}:{RUN_AS} "$0"', SOCKET_DIR],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "16Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": False,
            "runAsUser": 0,
            "runAsGroup": 0,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "bulk-socket", "mountPath": SOCKET_DIR}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def security_env(spec: PromptCacheSpec) -> dict[str, str]:
    """Sidecar settings pointing at the mounted Secrets (only those spec.security configures)."""
    sec = spec.security
    env: dict[str, str] = {}
    if sec.tls is not None:
        env["PROMPTCACHE_TLS_CERT_FILE"] = f"{TLS_DIR}/tls.crt"
        env["PROMPTCACHE_TLS_KEY_FILE"] = f"{TLS_DIR}/tls.key"
        if sec.tls.mutual:
            env["PROMPTCACHE_TLS_CLIENT_CA_FILE"] = f"{TLS_DIR}/ca.crt"
    if sec.tokens is not None:
        env["PROMPTCACHE_TOKEN_FILE"] = TOKENS_DIR
    if sec.tenantSecret is not None:
        env["PROMPTCACHE_TENANT_SECRET_FILE"] = f"{TENANT_SECRET_DIR}/secret"
    return env


def security_volumes(spec: PromptCacheSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for spec.security's Secrets: whole-Secret volumes (no subPath, so rotations reach
    the sidecar), read-only."""
    sec = spec.security
    refs = [("tls", sec.tls, TLS_DIR), ("tokens", sec.tokens, TOKENS_DIR),
            ("tenant-secret", sec.tenantSecret, TENANT_SECRET_DIR)]
    volumes, mounts = [], []
    for name, ref, path in refs:
        if ref is None:
            continue
        volumes.append({"name": name, "secret": {"secretName": ref.secretName, "defaultMode": SECRET_MODE}})
        mounts.append({"name": name, "mountPath": path, "readOnly": True})
    return volumes, mounts


def _probes(spec: PromptCacheSpec) -> dict[str, dict[str, Any]]:
    """kubelet's gRPC probe speaks plaintext only: with TLS, probe that the gRPC port accepts connections."""
    kind = "tcpSocket" if spec.security.tls is not None else "grpc"
    return {
        "startupProbe": {kind: {"port": GRPC_PORT}, "periodSeconds": 2, "failureThreshold": 60},
        "readinessProbe": {kind: {"port": GRPC_PORT}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {kind: {"port": GRPC_PORT}, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def config_map(spec: PromptCacheSpec, owner: Owner, defaults: OperatorDefaults = OperatorDefaults()
               ) -> dict[str, Any]:
    policy = to_dict(spec.cachePolicy)
    # their tokens are in a key of their own, once; none: not in the summary (its hash rolls the DaemonSet)
    pins = [{"name": p.name, "tokens": len(p.tokens)} for p in spec.cachePolicy.pinnedPrefixes]
    if pins:
        policy["pinnedPrefixes"] = pins
    else:
        policy.pop("pinnedPrefixes", None)
    summary = {"model": to_dict(spec.model), "memory": to_dict(spec.memory), "gpu": to_dict(spec.gpu),
               "cachePolicy": policy, "tenancy": to_dict(spec.tenancy), "autoscaling": to_dict(spec.autoscaling)}
    env = sidecar_env(spec, defaults)
    if spec.cluster.enabled:
        env["PROMPTCACHE_CLUSTER_MASTER"] = cluster_master_address(spec, owner)
        if spec.cluster.master.ha:
            env["PROMPTCACHE_CLUSTER_ID"] = cluster_id(owner)
        summary["cluster"] = to_dict(spec.cluster)
    data = {**dict(sorted(env.items())), "promptcache.yaml": yaml.safe_dump(summary, sort_keys=True)}
    if spec.cachePolicy.pinnedPrefixes:  # the sidecar's --pinned-prefixes-file (a volume of this key)
        data[PINNED_FILE] = json.dumps([{"name": p.name, "tokens": list(p.tokens)}
                                        for p in spec.cachePolicy.pinnedPrefixes], separators=(",", ":"))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(owner, config_name(owner)),
            "data": data}


def config_hash(cm: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cm["data"], sort_keys=True).encode()).hexdigest()[:16]


def _resources(spec: PromptCacheSpec) -> dict[str, Any]:
    memory = format_bytes(spec.container_memory_bytes())
    requests: dict[str, Any] = {"cpu": "250m", "memory": memory}
    limits: dict[str, Any] = {"memory": memory}
    if spec.memory.disk and not spec.memory.diskClaim:  # on a claim the disk tier is not ephemeral storage
        disk = format_bytes(quantity_bytes(spec.memory.disk) + DISK_OVERHEAD)
        requests["ephemeral-storage"] = disk
        limits["ephemeral-storage"] = disk
    if spec.gpu.count > 0:
        requests[spec.gpu.resourceName] = str(spec.gpu.count)
        limits[spec.gpu.resourceName] = str(spec.gpu.count)
    return merge_resources(requests, limits, spec.resources.requests, spec.resources.limits)


def merge_resources(requests: dict[str, str], limits: dict[str, str], explicit_requests: Mapping[str, Any],
                    explicit_limits: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The operator's requests and limits with a spec's explicit ones over them, so that the API server takes the
    result (the spec's validation has refused an explicit request above its explicit limit, and an explicit
    limit at or below the bytes the cache itself holds):
      - an extended resource or huge pages given on one side only: the other side the same (they cannot be
        overcommitted);
      - an explicit limit below the operator's request (limits.cpu 200m, the default request 250m): the request
        lowered to the limit;
      - an explicit request above the operator's limit (requests.memory above the derived limit): the limit
        raised to the request."""
    req = {**requests, **{k: str(v) for k, v in explicit_requests.items()}}
    lim = {**limits, **{k: str(v) for k, v in explicit_limits.items()}}
    for name in explicit_requests.keys() | explicit_limits.keys():
        if not_overcommittable(name):
            if name not in explicit_limits:
                lim[name] = req[name]
            elif name not in explicit_requests:
                req[name] = lim[name]
    for name in req.keys() & lim.keys():
        if parse_quantity(req[name]) > parse_quantity(lim[name]):
            if name in explicit_limits and name not in explicit_requests:
                req[name] = lim[name]
            elif name in explicit_requests and name not in explicit_limits:
                lim[name] = req[name]
            else:  # both the operator's, or both explicit (refused by validate): never built
                raise SpecError(f"resources.requests.{name} {req[name]} is above resources.limits.{name} {lim[name]}")
    return {"requests": dict(sorted(req.items())), "limits": dict(sorted(lim.items()))}


def daemon_set(spec: PromptCacheSpec, owner: Owner, defaults: OperatorDefaults, cfg_hash: str) -> dict[str, Any]:
    image, pull = _image(spec, defaults)
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    data_volume: dict[str, Any] = {"name": "data", "emptyDir": {}}
    data_mount: dict[str, Any] = {"name": "data", "mountPath": DATA_DIR}
    node_env: list[dict[str, Any]] = []
    if spec.memory.diskClaim:
        # The disk tier on a PersistentVolumeClaim (allowed under `restricted`), one subdirectory per node: a
        # replaced pod finds its node's RocksDB again. fsGroup makes the claim's root writable for uid 65532.
        data_volume = {"name": "data", "persistentVolumeClaim": {"claimName": spec.memory.diskClaim}}
        data_mount["subPathExpr"] = "$(NODE_NAME)"
        node_env = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    elif spec.memory.disk:
        data_volume["emptyDir"]["sizeLimit"] = spec.memory.disk
    volumes.insert(0, data_volume)
    secret_volumes, secret_mounts = security_volumes(spec)
    volumes += secret_volumes
    file_mounts: list[dict[str, Any]] = []  # files the sidecar reads (pinned prefixes, a snapshot)
    if spec.cachePolicy.pinnedPrefixes:
        volumes.append({"name": "pinned-prefixes", "configMap": {
            "name": config_name(owner), "items": [{"key": PINNED_FILE, "path": PINNED_FILE}]}})
        file_mounts.append({"name": "pinned-prefixes", "mountPath": PINNED_DIR, "readOnly": True})
    if spec.memory.warmupSnapshot is not None:
        volumes.append({"name": "warmup-snapshot", "persistentVolumeClaim": {
            "claimName": spec.memory.warmupSnapshot.claimName, "readOnly": True}})
        file_mounts.append({"name": "warmup-snapshot", "mountPath": SNAPSHOT_DIR, "readOnly": True})
    socket_mounts: list[dict[str, Any]] = []
    host_dir = socket_host_dir(spec, owner)
    if host_dir:
        volumes.append({"name": "bulk-socket", "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}})
        socket_mounts = [{"name": "bulk-socket", "mountPath": SOCKET_DIR}]
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": pull,
        "args": ["serve"],
        "envFrom": [{"configMapRef": {"name": config_name(owner)}}],
        # The root filesystem is read-only: libraries that cache under $HOME (torch, triton) use the tmp volume.
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "TMPDIR", "value": "/tmp"}, *node_env],
        "ports": sidecar_ports(spec),
        **_probes(spec),
        "resources": _resources(spec),
        "securityContext": restricted_container_security(),
        "volumeMounts": [data_mount, {"name": "tmp", "mountPath": "/tmp"},
                         *secret_mounts, *file_mounts, *socket_mounts],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": spec.pod.serviceAccountName,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "priorityClassName": priority_class_name(spec, defaults),
        "nodeSelector": dict(sorted(spec.placement.nodeSelector.items())),
        "tolerations": to_dict(spec.placement.tolerations),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": volumes,
    }
    if host_dir:
        pod_spec["initContainers"] = [socket_dir_init_container(image, pull)]
    if spec.pod.imagePullSecrets:
        pod_spec["imagePullSecrets"] = to_dict(spec.pod.imagePullSecrets)
    if spec.placement.affinity:
        pod_spec["affinity"] = spec.placement.affinity
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "selector": {"matchLabels": selector(owner)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": dict(sorted({**spec.pod.labels, **labels(owner)}.items())),
                    "annotations": dict(sorted({**spec.pod.annotations, CONFIG_HASH_ANNOTATION: cfg_hash,
                                                f"{GROUP}/model": spec.model.name}.items())),
                },
                "spec": pod_spec,
            },
        },
    }


def sidecar_ports(spec: PromptCacheSpec) -> list[dict[str, Any]]:
    """The sidecar container's ports: what it serves to clients and Prometheus (gRPC, the bulk channel on TCP
    where it is plaintext, metrics). Mooncake's transfer ports (the cluster tier) are not among them: Mooncake picks
    them at run time. The cluster tier's NetworkPolicy opens exactly these to everyone."""
    return [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            *([{"name": "bulk", "containerPort": BULK_PORT, "protocol": "TCP"}] if _bulk_channel(spec) else []),
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]


def node_local_service(spec: PromptCacheSpec, owner: Owner) -> dict[str, Any]:
    ports = [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]
    if _bulk_channel(spec):
        ports.append({"name": "bulk", "port": BULK_PORT, "targetPort": "bulk", "protocol": "TCP",
                      "appProtocol": "promptcache.io/bulk-v1"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "type": "ClusterIP",
            "internalTrafficPolicy": "Local",
            "selector": selector(owner),
            "ports": ports,
        },
    }


def master_name(owner: Owner) -> str:
    """The Mooncake master's Deployment and Service (a DNS-1035 label: at most 63 characters)."""
    return child_name(owner.name, "-mooncake-master")


def _master_selector(owner: Owner) -> dict[str, str]:
    return {CACHE_LABEL: owner.name, "app.kubernetes.io/component": "cluster-master"}


def cluster_id(owner: Owner) -> str:
    """The HA masters' -cluster_id: their key prefix in etcd, so caches sharing one etcd stay apart."""
    return f"promptcache.{owner.namespace}.{owner.name}"


def cluster_master_address(spec: PromptCacheSpec, owner: Owner) -> str:
    """The sidecars' --cluster-master: the master's Service, or with HA the etcd through which they find the
    leader (Mooncake's client syntax etcd://HOST:PORT;HOST:PORT)."""
    if spec.cluster.master.ha:
        return "etcd://" + ";".join(spec.cluster.master.etcdEndpoints)
    return f"{master_name(owner)}.{owner.namespace}.svc:{MASTER_PORT}"


def mooncake_master(spec: PromptCacheSpec, owner: Owner, defaults: OperatorDefaults) -> dict[str, Any]:
    """The cluster tier's Mooncake master (docs/cluster.md): the binary ships in the sidecar image (the 'cluster'
    extra). Without etcd: one replica, recreated on upgrade (two masters would split the index). With etcd:
    Mooncake's HA mode, `replicas` masters of which the one holding the etcd lease leads; a standby does not open
    its RPC port, so the probes use the metrics port, and a rolling update hands the lease over."""
    master = spec.cluster.master
    image, pull = _image(spec, defaults)
    resources = merge_resources({"cpu": "100m", "memory": "256Mi"}, {"memory": "256Mi"},
                                master.resources.requests, master.resources.limits)
    component = {"app.kubernetes.io/component": "cluster-master"}
    probe_port = MASTER_METRICS_PORT if master.ha else MASTER_PORT
    container = {
        "name": "mooncake-master",
        "image": image,
        "imagePullPolicy": pull,
        "command": ["mooncake_master"],
        "args": [f"-rpc_port={MASTER_PORT}", "-rpc_address=0.0.0.0", f"-metrics_port={MASTER_METRICS_PORT}",
                 "-metrics_host=0.0.0.0", "-enable_http_metadata_server=false"],
        "ports": [{"name": "rpc", "containerPort": MASTER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": MASTER_METRICS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": probe_port}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": probe_port}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": resources,
        "securityContext": restricted_container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": spec.pod.serviceAccountName,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }
    strategy: dict[str, Any] = {"type": "Recreate"}
    if master.ha:
        # The address a master publishes in etcd when it leads: its pod IP.
        container["args"] = [a.replace("-rpc_address=0.0.0.0", "-rpc_address=$(POD_IP)") for a in container["args"]]
        container["args"] += ["-enable_ha=true", "-etcd_endpoints=" + ";".join(master.etcdEndpoints),
                              f"-cluster_id={cluster_id(owner)}"]
        container["env"] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        pod_spec["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": _master_selector(owner)}}}]}}
    if spec.pod.imagePullSecrets:
        pod_spec["imagePullSecrets"] = to_dict(spec.pod.imagePullSecrets)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, master_name(owner), component),
        "spec": {
            "replicas": master.replicas,
            "strategy": strategy,
            "selector": {"matchLabels": _master_selector(owner)},
            "template": {"metadata": {"labels": dict(sorted({**labels(owner), **component}.items()))},
                         "spec": pod_spec},
        },
    }


def mooncake_master_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, master_name(owner), {"app.kubernetes.io/component": "cluster-master"}),
        "spec": {"type": "ClusterIP", "selector": _master_selector(owner),
                 "ports": [{"name": "rpc", "port": MASTER_PORT, "targetPort": "rpc", "protocol": "TCP"}]},
    }


def _network_policy(owner: Owner, name: str, pods: dict[str, str], ingress: list[dict[str, Any]],
                    extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": NETWORK_POLICY[0],
        "kind": NETWORK_POLICY[1],
        "metadata": _meta(owner, name, extra_labels),
        "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def master_network_policy(spec: PromptCacheSpec, owner: Owner) -> dict[str, Any]:
    """Who reaches the Mooncake master (the cluster tier has no authentication: docs/security.md, "The cluster
    tier"): its RPC port only this cache's sidecar pods; with HA, the other masters on any port (they elect through
    etcd today, but are as trusted as each other, and Mooncake's proposed hot standby talks master to master); its
    metrics port everyone, as the sidecars' metrics port (Prometheus runs in a namespace the operator cannot know,
    and the series are usage, not records; the kubelet's probes come from the node, which a NetworkPolicy does not
    filter). Ingress only: the masters' egress (to etcd) is not restricted."""
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": selector(owner)}}],
         "ports": [{"protocol": "TCP", "port": MASTER_PORT}]}]
    if spec.cluster.master.ha:
        ingress.append({"from": [{"podSelector": {"matchLabels": _master_selector(owner)}}]})
    ingress.append({"ports": [{"protocol": "TCP", "port": MASTER_METRICS_PORT}]})
    return _network_policy(owner, master_name(owner), _master_selector(owner), ingress,
                           {"app.kubernetes.io/component": "cluster-master"})


def sidecar_network_policy(spec: PromptCacheSpec, owner: Owner) -> dict[str, Any]:
    """Who reaches the sidecar pods once they join the cluster tier: this cache's sidecars and masters on any port
    (Mooncake's transfer engine listens on ports it picks at run time, and the records it serves are not
    authenticated), everyone else only on the ports the sidecar container declares (sidecar_ports: gRPC, the bulk
    channel when it is on, metrics), as before the policy. Ingress only."""
    peers = [{"podSelector": {"matchLabels": selector(owner)}},
             {"podSelector": {"matchLabels": _master_selector(owner)}}]
    served = [{"protocol": p["protocol"], "port": p["containerPort"]} for p in sidecar_ports(spec)]
    return _network_policy(owner, owner.name, selector(owner), [{"from": peers}, {"ports": served}])


def metrics_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, metrics_name(owner.name), {f"{GROUP}/metrics": "true"}),
        "spec": {
            "clusterIP": "None",
            "selector": selector(owner),
            "ports": [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


def resource_quota(spec: PromptCacheSpec, owner: Owner, defaults: OperatorDefaults = OperatorDefaults()
                   ) -> dict[str, Any]:
    """Caps what pods of the cache's PriorityClass may take in this namespace (one pod per node, at most
    spec.placement.maxNodes nodes); inference pods of other priority classes are not counted."""
    res = _resources(spec)
    n = spec.placement.maxNodes
    hard = {"pods": str(n)}
    # A PriorityClass-scoped quota may only track pods, cpu and memory (the API server rejects ephemeral-storage
    # with "unsupported scope applied to resource") and extended resources (only as requests.*).
    for kind, values in (("requests", res["requests"]), ("limits", res["limits"])):
        for r, v in values.items():
            if r in ("cpu", "memory"):
                hard[f"{kind}.{r}"] = _times(v, n, r)
            elif kind == "requests" and "/" in r:
                hard[f"requests.{r}"] = _times(v, n, r)
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": _meta(owner, quota_name(owner)),
        "spec": {
            "hard": dict(sorted(hard.items())),
            "scopeSelector": {"matchExpressions": [
                {"scopeName": "PriorityClass", "operator": "In", "values": [priority_class_name(spec, defaults)]}]},
        },
    }


def _times(q: str, n: int, resource: str = "") -> str:
    """`n` times the quantity `q`, exactly (decimal arithmetic), in canonical form: a whole number of bytes as the
    shortest binary quantity (memory, ephemeral-storage, hugepages), another whole number plain ('5'), a fraction in
    milli-units ('1500m'), or finer where it must be (the API server keeps nano-units)."""
    return format_quantity(parse_quantity(q) * n, binary=resource in ("memory", "ephemeral-storage")
                           or resource.startswith("hugepages-"))


def format_quantity(value: Decimal, binary: bool = False) -> str:
    """An exact quantity as its canonical string: 5 -> '5', 0.5 -> '500m', 2^30 bytes -> '1Gi' (binary)."""
    if value == value.to_integral_value():
        return format_bytes(int(value)) if binary else str(int(value))
    for suffix, scale in (("m", 3), ("u", 6), ("n", 9)):
        scaled = value.scaleb(scale)
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{suffix}"
    return f"{int(value.scaleb(9).to_integral_value(rounding='ROUND_CEILING'))}n"  # as the API server rounds


def vertical_pod_autoscaler(spec: PromptCacheSpec, owner: Owner) -> dict[str, Any]:
    policy: dict[str, Any] = {"containerName": CONTAINER, "controlledResources": ["memory"],
                              "controlledValues": "RequestsAndLimits"}
    if spec.autoscaling.minMemory:
        policy["minAllowed"] = {"memory": spec.autoscaling.minMemory}
    if spec.autoscaling.maxMemory:
        policy["maxAllowed"] = {"memory": spec.autoscaling.maxMemory}
    return {
        "apiVersion": VPA[0],
        "kind": VPA[1],
        "metadata": _meta(owner, owner.name),
        "spec": {
            "targetRef": {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": owner.name},
            # Off until the autoscaler's first decision (autoscale.adjust_children then sets the configured mode):
            # in any other mode the VPA's own recommender could evict cache pods, and their memory tier, at once.
            "updatePolicy": {"updateMode": "Off"},
            "resourcePolicy": {"containerPolicies": [policy]},
        },
    }


def _monitoring_meta(spec: PromptCacheSpec, owner: Owner, defaults: OperatorDefaults) -> dict[str, Any]:
    """Metadata of the ServiceMonitor and PrometheusRule: the labels Prometheus selects them by (the operator's
    defaults, then spec.monitoring.labels) under the operator's own, which stay authoritative."""
    selection = {**dict(defaults.monitoring_labels), **spec.monitoring.labels}
    return _meta(owner, owner.name, {k: v for k, v in selection.items() if k not in labels(owner)})


def service_monitor(spec: PromptCacheSpec, owner: Owner, defaults: OperatorDefaults = OperatorDefaults()
                    ) -> dict[str, Any]:
    return {
        "apiVersion": SERVICE_MONITOR[0],
        "kind": SERVICE_MONITOR[1],
        "metadata": _monitoring_meta(spec, owner, defaults),
        "spec": {
            "selector": {"matchLabels": {CACHE_LABEL: owner.name, f"{GROUP}/metrics": "true"}},
            "endpoints": [{"port": "metrics", "interval": "30s", "path": "/metrics"}],
        },
    }


def prometheus_rule(spec: PromptCacheSpec, owner: Owner, defaults: OperatorDefaults = OperatorDefaults()
                    ) -> dict[str, Any]:
    """The cache alerts of promptcache.operator.alerts (shared with the chart), for this cache's series only."""
    sel = f'namespace="{owner.namespace}",service="{metrics_name(owner.name)}"'
    rules = alerts.rules(sel, alerts.thresholds_from_spec(spec.alerts), defaults.runbook_base_url)
    return {
        "apiVersion": PROMETHEUS_RULE[0],
        "kind": PROMETHEUS_RULE[1],
        "metadata": _monitoring_meta(spec, owner, defaults),
        "spec": {"groups": [{"name": f"promptcache.{owner.namespace}.{owner.name}", "rules": rules}]},
    }


def desired_children(spec: PromptCacheSpec, owner: Owner, caps: Capabilities,
                     defaults: OperatorDefaults = OperatorDefaults()) -> list[dict[str, Any]]:
    """Every child this PromptCache should have, given which optional CRDs exist. Deterministic."""
    cm = config_map(spec, owner, defaults)
    children = [cm, daemon_set(spec, owner, defaults, config_hash(cm)), node_local_service(spec, owner),
                metrics_service(owner), resource_quota(spec, owner, defaults)]
    if spec.cluster.enabled:
        children += [mooncake_master(spec, owner, defaults), mooncake_master_service(owner)]
        if spec.cluster.networkPolicies:
            children += [master_network_policy(spec, owner), sidecar_network_policy(spec, owner)]
    if caps.vpa:
        children.append(vertical_pod_autoscaler(spec, owner))
    if caps.service_monitor:
        children.append(service_monitor(spec, owner, defaults))
    if caps.prometheus_rule and spec.alerts.enabled:
        children.append(prometheus_rule(spec, owner, defaults))
    return children


def child_key(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"
