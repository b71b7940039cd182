"""Typed model of the PromptCache spec (promptcache.io/v1alpha1).

The API server applies the CRD's defaults before the operator sees an object; this model applies the same
defaults so the pure builders (and their golden tests) can start from a minimal dict. tests/operator/
test_operator_consistency.py checks these dataclasses, the CRD schema and the chart's values.schema.json against each
other (field names, defaults, enums).
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, get_args, get_origin

from promptcache.contract import quantity

GROUP = "promptcache.io"
VERSION = "v1alpha1"
KIND = "PromptCache"
PLURAL = "promptcaches"

QUANTIZATION_MODES = ("none", "k8v8", "k8v4", "k6v4z")
EVICTION_POLICIES = ("lru", "lru-prefix", "lfu", "wtinylfu", "rate", "rate-class", "rate-hazard")
TENANCY_MODES = ("Shared", "Isolated")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
CHUNK_TOKENS_ALLOWED = tuple(2 ** i for i in range(4, 17))  # 16 .. 65536

DEFAULT_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
DEFAULT_TOLERATIONS = ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)
# The operator's built-in default PriorityClass of the cache pods (a PromptCache without
# spec.placement.priorityClassName runs with the operator's configured one: PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS,
# which the chart sets from priorityClass.name; this name where that is unset). builders.priority_class_name.
DEFAULT_PRIORITY_CLASS = "promptcache-node-cache"


class SpecError(ValueError):
    """The spec is invalid (the CRD's validation should have caught it first)."""


def parse_quantity(text: str | int) -> Decimal:
    """Kubernetes quantity -> exact number ('16Gi' -> 17179869184; promptcache.contract.quantity). Raises SpecError."""
    try:
        return quantity.parse_quantity(text)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def format_bytes(n: int) -> str:
    """Bytes as the shortest exact binary quantity: 17716740096 -> '16896Mi'."""
    for suffix, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def quantity_bytes(text: str | int) -> int:
    """Whole bytes, a fraction rounded up as Kubernetes does."""
    try:
        return quantity.parse_bytes(text)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_priority_class_name(name: str) -> bool:
    """Whether `name` can name a PriorityClass (a DNS-1123 subdomain: at most 253 lower-case letters, digits, '-'
    and '.', alphanumeric at both ends of each dot-separated part)."""
    return len(name) <= 253 and bool(_SECRET_NAME.fullmatch(name))


ISOLATED_MESSAGE = ("spec.tenancy.mode Isolated requires spec.security.tokens or spec.security.tls.mutual: "
                    "tenants are told apart by their credentials")


_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
# The CRD's patterns of spec.image.tag, spec.image.repository and spec.alerts.for are these, anchored with ^...$
# (tests/operator/test_operator_consistency.py checks that they are the same).
_IMAGE_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# An image repository without tag or digest (the distribution reference grammar): an optional registry host, read
# as one only where it has a '.' or a :port or is localhost (its name may hold upper case), then '/'-separated
# lower-case path components (alphanumerics joined by '.', '_', '__' or '-'s).
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = (rf"(?:localhost(?::[0-9]+)?|{_DOMAIN_PART}(?:\.{_DOMAIN_PART})+(?::[0-9]+)?|{_DOMAIN_PART}:[0-9]+)")
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_IMAGE_REPOSITORY = re.compile(rf"(?:{_DOMAIN}/)?{_PATH_PART}(?:/{_PATH_PART})*")
IMAGE_REPOSITORY_MAX = 255
# A Prometheus duration (prometheus/common model.ParseDuration, and the PrometheusRule CRD's `for`): units from
# years down to milliseconds, each at most once and in that order, or 0; not empty.
_PROM_DURATION = re.compile(r"(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                            r"(([0-9]+)ms)?)")
MAX_ANNOTATIONS_BYTES = 256 * 1024  # the API server's limit on an object's annotations, keys and values together


def label_key_error(key: str, shown: str | None = None) -> str:
    """Why `key` is not a Kubernetes label or annotation key ("" when it is): [prefix/]name, the prefix a DNS
    subdomain of at most 253 characters, the name at most 63 alphanumerics with '-', '_' or '.' inside. `shown`:
    the key as the message names it (default `key`)."""
    shown = key if shown is None else shown
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _SECRET_NAME.fullmatch(prefix)):
        return f"{shown!r}: the prefix is not a DNS subdomain"
    if not _LABEL_NAME.fullmatch(name):
        return f"{shown!r}: the name is not 1-63 letters, digits, '-', '_' or '.' (alphanumeric at both ends)"
    return ""


def annotation_key_error(key: str) -> str:
    """Why `key` is not an annotation key ("" when it is): the API server checks annotation keys as label keys
    after lower-casing them (apimachinery ValidateAnnotations), so `Example.COM/Owner` is one."""
    return label_key_error(key.lower(), key)


def annotations_bytes(annotations: dict[str, str]) -> int:
    """What the API server counts against its 256 KiB: the UTF-8 bytes of every key and value."""
    return sum(len(k.encode()) + len(str(v).encode()) for k, v in annotations.items())


def prometheus_duration_error(value: str) -> str:
    """Why `value` is not a Prometheus duration ("" when it is)."""
    if value and _PROM_DURATION.fullmatch(value):
        return ""
    return (f"{value!r} is not a Prometheus duration (units y, w, d, h, m, s, ms, each at most once and in that "
            "order, such as 10m, 1h30m, 1d or 1w)")


def label_value_error(value: str) -> str:
    """Why `value` is not a Kubernetes label value ("" when it is): empty, or a name as label_key_error's."""
    return "" if value == "" or _LABEL_NAME.fullmatch(value) else (
        f"{value!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends)")


def isolated_identity(sec: "Security") -> bool:
    """Whether the sidecar authenticates callers (a token folder or mTLS), which tenant isolation is keyed by."""
    return sec.tokens is not None or (sec.tls is not None and sec.tls.mutual)


def _positive_quantity(path: str, value: str | None) -> None:
    """A size in bytes: positive, and below 8Ei (what the sidecar's flags and a Kubernetes resource value hold)."""
    if value is not None and parse_quantity(value) <= 0:
        raise SpecError(f"{path} must be a positive quantity, got {value!r}")
    if value is not None and parse_quantity(value) > quantity.MAX_INT64:
        raise SpecError(f"{path} must be below 8Ei (2^63 bytes, what the sidecar and a Kubernetes resource value "
                        f"hold), got {value!r}")


STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")  # and hugepages-<page size>
RESOURCE_NAME_HELP = ("cpu, memory, ephemeral-storage, hugepages-<page size>, or a fully qualified DOMAIN/NAME such as "
                      "nvidia.com/gpu")


def is_extended_resource(name: str) -> bool:
    """An extended resource (nvidia.com/gpu): a DOMAIN/NAME outside kubernetes.io."""
    domain = name.partition("/")[0]
    return "/" in name and domain != "kubernetes.io" and not domain.endswith(".kubernetes.io")


def not_overcommittable(name: str) -> bool:
    """Extended resources and huge pages: the API server wants a limit, and a request equal to it."""
    return is_extended_resource(name) or name.startswith("hugepages-")


def resource_name_error(name: str) -> str:
    """Why `name` is not a container resource name the API server accepts ("" when it is)."""
    if "/" not in name:
        if name in STANDARD_RESOURCES:
            return ""
        if name.startswith("hugepages-"):
            try:
                if quantity.parse_quantity(name[len("hugepages-"):]) > 0:
                    return ""
            except ValueError:
                pass
        return f"{name!r} is not a resource name ({RESOURCE_NAME_HELP})"
    if not is_extended_resource(name):
        return f"{name!r} is not a resource a container can set (kubernetes.io names are reserved)"
    if label_key_error(name) or name.startswith("requests."):
        return f"{name!r} is not a resource name ({RESOURCE_NAME_HELP})"
    return ""


def validate_resources(path: str, requests: dict[str, str | int], limits: dict[str, str | int]) -> dict[
        tuple[str, str], Decimal]:
    """A container's explicit requests and limits (`path`: spec.resources or spec.cluster.master.resources): names,
    quantities, and the API server's rules between a request and its limit. Returns the parsed amounts."""
    amounts: dict[tuple[str, str], Decimal] = {}
    for kind, values in (("requests", requests), ("limits", limits)):
        for name, value in values.items():
            problem = resource_name_error(name)
            if problem:
                raise SpecError(f"{path}.{kind}: {problem}")
            try:
                amount = parse_quantity(value)
            except SpecError:
                raise SpecError(f"{path}.{kind}.{name}: {value!r} is not a Kubernetes quantity") from None
            if amount < 0 or amount > quantity.MAX_INT64:
                raise SpecError(f"{path}.{kind}.{name} must be 0 or more and below 8Ei, got {value!r}")
            if is_extended_resource(name) and amount != amount.to_integral_value():
                raise SpecError(f"{path}.{kind}.{name} must be a whole number (an extended resource), got {value!r}")
            amounts[kind, name] = amount
    for name in sorted(requests.keys() & limits.keys()):
        req, lim = amounts["requests", name], amounts["limits", name]
        if not_overcommittable(name) and req != lim:
            raise SpecError(f"{path}.requests.{name} {requests[name]!r} must equal {path}.limits.{name} "
                            f"{limits[name]!r}: {name} cannot be overcommitted (give one of them and the operator "
                            "sets the other)")
        if req > lim:
            raise SpecError(f"{path}.requests.{name} {requests[name]!r} is above {path}.limits.{name} "
                            f"{limits[name]!r}: a request may not exceed its limit")
    return amounts


CLAIM_NAME = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"  # a PersistentVolumeClaim's name (DNS subdomain)
# spec.cachePolicy.pinnedPrefixes: what the CRD allows (and the sidecar's --pinned-prefixes-file accepts), kept well
# under the API server's object size (token ids cost up to 11 bytes each in JSON)
MAX_PINNED_PREFIXES = 16
MAX_PINNED_TOKENS = 16384
MAX_PINNED_TOKENS_TOTAL = 65536
MAX_TOKEN_ID = (1 << 32) - 1
PINNED_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
SNAPSHOT_PATH = r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*"  # no '..', no absolute path
# What the sidecar container takes beyond its budgets (its resources; the autoscaler subtracts it from a target).
MEMORY_OVERHEAD = 512 * 2**20  # process + gRPC buffers on top of the cache budget
DISK_OVERHEAD = 2**30  # RocksDB's own files (logs, manifests, a write being compacted) next to the disk budget
# The disk tier's index RAM bound the operator gives a sidecar (--disk-index-bytes): disk / 64, at least 64Mi
DISK_INDEX_PER_BUDGET = 64
DISK_INDEX_MIN = 64 * 2**20
MODEL_NAME_MAX, MODEL_REVISION_MAX = 253, 128  # spec.model.name and .revision, as the CRD bounds them
MAX_WARMUP_SECONDS = 90  # spec.memory.warmupSeconds: under the sidecar startup probe's 120 s

@dataclass(frozen=True)
class Toleration:
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = None


@dataclass(frozen=True)
class Model:
    name: str
    revision: str | None = None
    weightsDigest: str | None = None


@dataclass(frozen=True)
class Placement:
    nodeSelector: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_NODE_SELECTOR))
    affinity: dict[str, Any] | None = None
    tolerations: tuple[Toleration, ...] = tuple(Toleration(**t) for t in DEFAULT_TOLERATIONS)
    maxNodes: int = 100
    # None or "": the operator's default PriorityClass (builders.priority_class_name); the CRD has no default, so
    # the chart's priorityClass.name reaches every PromptCache that names none.
    priorityClassName: str | None = None


@dataclass(frozen=True)
class WarmupSnapshot:
    """A snapshot file (`promptcache export`) on a PersistentVolumeClaim, loaded into every sidecar's memory tier at
    start (docs/warmup.md): the claim is mounted read-only, so it must allow many nodes to read it (ReadOnlyMany or
    ReadWriteMany) when the cache runs on several."""
    claimName: str
    path: str = "snapshot.pcsnap"  # inside the claim: segments of letters, digits, '.', '_', '-', none starting '.'


@dataclass(frozen=True)
class Memory:
    host: str
    device: str | None = None
    disk: str | None = None
    # A PersistentVolumeClaim for the disk tier instead of an emptyDir, so stored prefixes survive the pod's
    # replacement (rolling update, eviction, deletion); each node's sidecar uses its own subdirectory (the node's
    # name). None: an emptyDir (lost with the pod). docs/operator.md, "The disk tier across pod replacement".
    diskClaim: str | None = None
    # At most this long after a start the sidecar fills its memory tier from its disk tier, then from what the cluster
    # tier's nodes hold hottest, before it reports ready (docs/warmup.md); below the startup probe's 120 s. 0: none.
    warmupSeconds: int = 30
    # A snapshot file loaded at start (before the disk and cluster tiers, within warmupSeconds). None: none.
    warmupSnapshot: WarmupSnapshot | None = None


@dataclass(frozen=True)
class Gpu:
    resourceName: str = "nvidia.com/gpu"
    count: int = 0


@dataclass(frozen=True)
class PinnedPrefix:
    """Token ids of a prefix every sidecar pins when a Put stores or covers it (a system prompt): its whole chunks
    are passed over by capacity eviction, within the per-tenant bound (docs/retention.md)."""
    name: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class CachePolicy:
    chunkTokens: int = 256
    ttlSeconds: int = 14400          # sliding: extended by every hit
    maxLifetimeSeconds: int = 86400  # absolute cap after the first store
    evictionPolicy: Literal["lru", "lru-prefix", "lfu", "wtinylfu", "rate", "rate-class", "rate-hazard"] = "rate-hazard"  # sidecar's
    quantization: Literal["none", "k8v8", "k8v4", "k6v4z"] = "none"
    maxChunkBytes: str | None = None
    pinnedPrefixes: tuple[PinnedPrefix, ...] = ()


@dataclass(frozen=True)
class Tenancy:
    mode: Literal["Shared", "Isolated"] = "Shared"


@dataclass(frozen=True)
class TlsSecret:
    secretName: str
    mutual: bool = False


@dataclass(frozen=True)
class SecretRef:
    secretName: str


@dataclass(frozen=True)
class Security:
    """Secrets the operator mounts into the sidecars (docs/security.md, "Operator wiring")."""

    tls: TlsSecret | None = None
    tokens: SecretRef | None = None
    tenantSecret: SecretRef | None = None


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    targetHitRatio: float = 0.8
    minMemory: str | None = None
    maxMemory: str | None = None


@dataclass(frozen=True)
class Alerts:
    enabled: bool = True
    hitRatioBelow: float = 0.2
    memoryUtilizationAbove: float = 0.95
    evictionsPerSecondAbove: float = 100
    for_: str = field(default="10m", metadata={"json": "for"})


@dataclass(frozen=True)
class Image:
    repository: str | None = None
    tag: str | None = None
    digest: str | None = None
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] | None = None


@dataclass(frozen=True)
class LocalObjectReference:
    name: str


# Labels and annotations the operator sets on the sidecar pods itself; a spec may not override them (the
# DaemonSet's selector and the restart-on-config-change hash depend on them).
RESERVED_POD_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                       "app.kubernetes.io/managed-by", f"{GROUP}/cache")
RESERVED_POD_ANNOTATIONS = (f"{GROUP}/config-hash", f"{GROUP}/model")
# Annotation key prefixes that change the pod's security or the cluster's treatment of it (AppArmor / seccomp
# profiles, service-mesh injection and its settings, the cluster autoscaler's eviction): a PromptCache's creator
# may not set them on the pods the operator creates (docs/security.md, "The operator"). The CRD's rule on
# spec.pod.annotations matches keys with RESERVED_POD_ANNOTATION_PATTERN too (test_operator_consistency.py).
RESERVED_POD_ANNOTATION_PREFIXES = ("container.apparmor.security.beta.kubernetes.io/",
                                    "seccomp.security.alpha.kubernetes.io/", "cluster-autoscaler.kubernetes.io/",
                                    "istio.io/", "*.istio.io/", "linkerd.io/", "*.linkerd.io/")
RESERVED_POD_ANNOTATION_PATTERN = (
    "^(container\\.apparmor\\.security\\.beta\\.kubernetes\\.io|seccomp\\.security\\.alpha\\.kubernetes\\.io"
    "|cluster-autoscaler\\.kubernetes\\.io|([^/]*\\.)?istio\\.io|([^/]*\\.)?linkerd\\.io)/")
_RESERVED_POD_ANNOTATION = re.compile(RESERVED_POD_ANNOTATION_PATTERN)


@dataclass(frozen=True)
class Pod:
    """Settings of the sidecar pods: private registries, workload identity, pod metadata."""

    serviceAccountName: str = "default"
    imagePullSecrets: tuple[LocalObjectReference, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Monitoring:
    """Labels of the cache's ServiceMonitor and PrometheusRule, merged over the operator's defaults (chart value
    monitoring.labels): what Prometheus' serviceMonitorSelector and ruleSelector match."""

    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Resources:
    requests: dict[str, str | int] = field(default_factory=dict)
    limits: dict[str, str | int] = field(default_factory=dict)


CLUSTER_PROTOCOLS = ("tcp", "rdma")
CLUSTER_HA_MESSAGE = ("spec.cluster.master.replicas above 1 needs spec.cluster.master.etcdEndpoints: "
                      "Mooncake's HA masters elect their leader through etcd")


CLUSTER_MASTER_MAX_REPLICAS = 5
# HOST:PORT of an etcd member (the CRD's pattern says the same)
_ETCD_ENDPOINT = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?:[0-9]{1,5}$")


@dataclass(frozen=True)
class ClusterMaster:
    """The Mooncake master Deployment. Without etcdEndpoints: one replica (a restarted master only empties the
    tier). With them: Mooncake's HA mode, `replicas` masters electing a leader through that etcd, the sidecars
    following the leader (docs/cluster.md)."""

    replicas: int = 1
    etcdEndpoints: tuple[str, ...] = ()
    resources: Resources = field(default_factory=Resources)

    @property
    def ha(self) -> bool:
        return bool(self.etcdEndpoints)


@dataclass(frozen=True)
class Cluster:
    """The cluster tier (docs/cluster.md): a Mooncake master, and every sidecar joining it."""

    enabled: bool = False
    protocol: Literal["tcp", "rdma"] = "tcp"
    segmentMemory: str = "1Gi"  # host memory each sidecar contributes to the cluster store
    master: ClusterMaster = field(default_factory=ClusterMaster)
    # The two NetworkPolicies that keep strangers off the unauthenticated store (builders.master_network_policy,
    # sidecar_network_policy). False: the platform team writes its own (they are additive: ours open the sidecars'
    # serving ports to every pod, which a namespace that denies by default may not want).
    networkPolicies: bool = True


# A node directory for spec.zeroCopy.hostPath: absolute, no empty, '.' or '..' component, no trailing '/' (the CRD's
# pattern and rule say the same).
_HOST_PATH = re.compile(r"^(/[A-Za-z0-9_.-]+)+$")
HOST_PATH_MAX = 128
ZERO_COPY_MTLS_MESSAGE = ("spec.zeroCopy with spec.security.tls.mutual needs spec.security.tokens: bulk-channel "
                          "clients authenticate with a bearer token (they present no certificate)")


@dataclass(frozen=True)
class ZeroCopy:
    """Zero copy for inference pods on the sidecar's node (docs/operator.md, "Zero copy on Kubernetes"): the bulk
    channel's unix socket in a node directory, <hostPath>/<namespace>.<name>/bulk.sock, that inference pods mount
    (hostPath), so a Get lends the stored chunks as sealed memfds. None: the bulk channel on TCP only. A hostPath
    needs the `privileged` Pod Security level in the cache's namespace and in the inference pods'."""

    hostPath: str | None = None


@dataclass(frozen=True)
class PromptCacheSpec:
    model: Model
    memory: Memory
    placement: Placement = field(default_factory=Placement)
    gpu: Gpu = field(default_factory=Gpu)
    cachePolicy: CachePolicy = field(default_factory=CachePolicy)
    tenancy: Tenancy = field(default_factory=Tenancy)
    security: Security = field(default_factory=Security)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    alerts: Alerts = field(default_factory=Alerts)
    image: Image = field(default_factory=Image)
    resources: Resources = field(default_factory=Resources)
    pod: Pod = field(default_factory=Pod)
    monitoring: Monitoring = field(default_factory=Monitoring)
    cluster: Cluster = field(default_factory=Cluster)
    zeroCopy: ZeroCopy = field(default_factory=ZeroCopy)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PromptCacheSpec":
        spec = _build(cls, data or {}, "spec")
        spec.validate()
        return spec

    def _validate_pinned_prefixes(self) -> None:
        pins = self.cachePolicy.pinnedPrefixes
        if len(pins) > MAX_PINNED_PREFIXES:
            raise SpecError(f"spec.cachePolicy.pinnedPrefixes: {len(pins)} prefixes, more than {MAX_PINNED_PREFIXES}")
        names: set[str] = set()
        for i, pin in enumerate(pins):
            where = f"spec.cachePolicy.pinnedPrefixes[{i}]"
            if not re.fullmatch(PINNED_NAME, pin.name):
                raise SpecError(f"{where}.name {pin.name!r} must be 1-63 letters, digits, '.', '_' or '-', starting "
                                "with a letter or digit")
            if pin.name in names:
                raise SpecError(f"{where}.name {pin.name!r} appears twice")
            names.add(pin.name)
            if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in pin.tokens):
                raise SpecError(f"{where}.tokens must be token ids (integers 0..{MAX_TOKEN_ID})")
            if not self.cachePolicy.chunkTokens <= len(pin.tokens) <= MAX_PINNED_TOKENS:
                raise SpecError(f"{where}.tokens has {len(pin.tokens)} ids: it needs at least one chunk "
                                f"(spec.cachePolicy.chunkTokens {self.cachePolicy.chunkTokens}) and at most "
                                f"{MAX_PINNED_TOKENS}")
        if sum(len(p.tokens) for p in pins) > MAX_PINNED_TOKENS_TOTAL:
            raise SpecError(f"spec.cachePolicy.pinnedPrefixes: more than {MAX_PINNED_TOKENS_TOTAL} tokens in all")

    def validate(self) -> "PromptCacheSpec":
        """The CRD's rules, repeated so the builders never see a spec the API server would reject."""
        if (self.model.revision is None) == (self.model.weightsDigest is None):
            raise SpecError("exactly one of spec.model.revision or spec.model.weightsDigest must be set")
        for name, most in (("name", MODEL_NAME_MAX), ("revision", MODEL_REVISION_MAX)):
            value = getattr(self.model, name)
            if value is not None and not 1 <= len(value) <= most:
                raise SpecError(f"spec.model.{name} must be 1 to {most} characters, got {len(value)}")
        for name in ("host", "device", "disk"):
            _positive_quantity(f"spec.memory.{name}", getattr(self.memory, name))
        if self.memory.diskClaim is not None:
            if not self.memory.disk:
                raise SpecError("spec.memory.diskClaim needs spec.memory.disk (the disk tier's size)")
            if not re.fullmatch(CLAIM_NAME, self.memory.diskClaim):
                raise SpecError(f"spec.memory.diskClaim {self.memory.diskClaim!r} is not a PersistentVolumeClaim "
                                "name (lowercase letters, digits, '-' and '.')")
        snap = self.memory.warmupSnapshot
        if snap is not None:
            if not re.fullmatch(CLAIM_NAME, snap.claimName):
                raise SpecError(f"spec.memory.warmupSnapshot.claimName {snap.claimName!r} is not a "
                                "PersistentVolumeClaim name (lowercase letters, digits, '-' and '.')")
            if len(snap.path) > 255 or not re.fullmatch(SNAPSHOT_PATH, snap.path):
                raise SpecError(f"spec.memory.warmupSnapshot.path {snap.path!r} must be a relative path inside the "
                                "claim: '/'-separated segments of letters, digits, '.', '_' and '-', none starting "
                                "with '.', at most 255 characters")
        if not 0 <= self.memory.warmupSeconds <= MAX_WARMUP_SECONDS:
            raise SpecError(f"spec.memory.warmupSeconds must be between 0 and {MAX_WARMUP_SECONDS} (the startup "
                            f"probe allows 120 s), not {self.memory.warmupSeconds}")
        _positive_quantity("spec.cachePolicy.maxChunkBytes", self.cachePolicy.maxChunkBytes)
        _positive_quantity("spec.cluster.segmentMemory", self.cluster.segmentMemory)
        if self.cluster.protocol not in CLUSTER_PROTOCOLS:
            raise SpecError(f"spec.cluster.protocol must be one of {', '.join(CLUSTER_PROTOCOLS)}")
        master = self.cluster.master
        if not 1 <= master.replicas <= CLUSTER_MASTER_MAX_REPLICAS:
            raise SpecError(f"spec.cluster.master.replicas must be within 1..{CLUSTER_MASTER_MAX_REPLICAS}")
        if master.replicas > 1 and not master.ha:
            raise SpecError(CLUSTER_HA_MESSAGE)
        for endpoint in master.etcdEndpoints:
            if not _ETCD_ENDPOINT.match(endpoint):
                raise SpecError(f"spec.cluster.master.etcdEndpoints: {endpoint!r} is not HOST:PORT")
        _positive_quantity("spec.autoscaling.minMemory", self.autoscaling.minMemory)
        _positive_quantity("spec.autoscaling.maxMemory", self.autoscaling.maxMemory)
        if self.cachePolicy.chunkTokens not in CHUNK_TOKENS_ALLOWED:
            raise SpecError("spec.cachePolicy.chunkTokens must be a power of two between 16 and 65536")
        self._validate_pinned_prefixes()
        if self.cachePolicy.ttlSeconds < 1:
            raise SpecError("spec.cachePolicy.ttlSeconds must be at least 1")
        if self.cachePolicy.maxLifetimeSeconds < 1:
            raise SpecError("spec.cachePolicy.maxLifetimeSeconds must be at least 1")
        if self.cachePolicy.quantization not in QUANTIZATION_MODES:
            raise SpecError(f"spec.cachePolicy.quantization must be one of {', '.join(QUANTIZATION_MODES)}")
        if self.cachePolicy.evictionPolicy not in EVICTION_POLICIES:
            raise SpecError(f"spec.cachePolicy.evictionPolicy must be one of {', '.join(EVICTION_POLICIES)}")
        a = self.autoscaling
        if a.minMemory and a.maxMemory and parse_quantity(a.minMemory) > parse_quantity(a.maxMemory):
            raise SpecError("spec.autoscaling.minMemory must not be greater than spec.autoscaling.maxMemory")
        if self.gpu.count < 0:
            raise SpecError("spec.gpu.count must not be negative")
        sec = self.security
        for name in ("tls", "tokens", "tenantSecret"):
            ref = getattr(sec, name)
            if ref is not None and (len(ref.secretName) > 253 or not _SECRET_NAME.match(ref.secretName)):
                raise SpecError(f"spec.security.{name}.secretName must be a Secret name (DNS-1123 subdomain)")
        if self.tenancy.mode == "Isolated" and not isolated_identity(sec):
            raise SpecError(ISOLATED_MESSAGE)
        host_path = self.zeroCopy.hostPath
        if host_path is not None:
            if (len(host_path) > HOST_PATH_MAX or not _HOST_PATH.match(host_path)
                    or any(part in (".", "..") for part in host_path.split("/"))):
                raise SpecError(f"spec.zeroCopy.hostPath {host_path!r} must be an absolute node directory of at most "
                                f"{HOST_PATH_MAX} characters (letters, digits, '_', '.', '-' between '/', no '.' or "
                                "'..' component, no trailing '/')")
            if sec.tls is not None and sec.tls.mutual and sec.tokens is None:
                raise SpecError(ZERO_COPY_MTLS_MESSAGE)
        pod = self.pod
        for name in (pod.serviceAccountName, *(r.name for r in pod.imagePullSecrets)):
            if len(name) > 253 or not _SECRET_NAME.match(name):
                raise SpecError(f"spec.pod: {name!r} is not a valid object name (DNS-1123 subdomain)")
        for where, labels in (("spec.pod.labels", pod.labels), ("spec.placement.nodeSelector",
                                                                 self.placement.nodeSelector),
                              ("spec.monitoring.labels", self.monitoring.labels)):
            for key, value in labels.items():
                problem = label_key_error(key) or label_value_error(str(value))
                if problem:
                    raise SpecError(f"{where}: {problem}")
        for key in pod.annotations:
            problem = annotation_key_error(key)
            if problem:
                raise SpecError(f"spec.pod.annotations: {problem}")
        if annotations_bytes(pod.annotations) > MAX_ANNOTATIONS_BYTES - 4096:
            raise SpecError(f"spec.pod.annotations: more than {MAX_ANNOTATIONS_BYTES - 4096} bytes in all (the API "
                            "server allows 256 KiB, and the operator adds its own)")
        if not 1 <= self.placement.maxNodes <= 10000:
            raise SpecError(f"spec.placement.maxNodes must be within 1..10000, got {self.placement.maxNodes}")
        pc = self.placement.priorityClassName
        if pc and not is_priority_class_name(pc):
            raise SpecError(f"spec.placement.priorityClassName {pc!r} is not a PriorityClass name (DNS-1123 "
                            "subdomain)")
        if self.image.tag is not None and not _IMAGE_TAG.fullmatch(self.image.tag):
            raise SpecError(f"spec.image.tag {self.image.tag!r} is not an image tag (letters, digits, '_', '.', '-', "
                            "at most 128, not starting with '.' or '-')")
        repo = self.image.repository
        if repo is not None and (len(repo) > IMAGE_REPOSITORY_MAX or not _IMAGE_REPOSITORY.fullmatch(repo)):
            raise SpecError(f"spec.image.repository {repo!r} is not an image repository: [HOST[:PORT]/]PATH, the "
                            f"path in lower case, at most {IMAGE_REPOSITORY_MAX} characters, without a tag or digest "
                            "(give those in spec.image.tag or spec.image.digest)")
        problem = prometheus_duration_error(self.alerts.for_)
        if problem:
            raise SpecError(f"spec.alerts.for: {problem}")
        self._validate_tolerations()
        validate_resources("spec.cluster.master.resources", master.resources.requests, master.resources.limits)
        amounts = validate_resources("spec.resources", self.resources.requests, self.resources.limits)
        # An explicit limit at or below what the cache itself fills: the sidecar would be killed once it is full
        # (OOM, or evicted for its disk). Between that and the operator's default (the cache plus its estimate of
        # the process's own, MEMORY_OVERHEAD / DISK_OVERHEAD) is the user's call: a tight limit is a choice.
        segment = quantity_bytes(self.cluster.segmentMemory) if self.cluster.enabled else 0
        fills = {"memory": (quantity_bytes(self.memory.host) + segment,
                            "spec.memory.host" + (" plus spec.cluster.segmentMemory" if segment else "")
                            + f"; the sidecar would be OOM-killed once it is full (the operator's default limit adds "
                            f"{MEMORY_OVERHEAD >> 20}Mi for the process)")}
        if self.memory.disk and not self.memory.diskClaim:
            fills["ephemeral-storage"] = (quantity_bytes(self.memory.disk), "spec.memory.disk; the pod would be "
                                          f"evicted once it is full (the operator's default limit adds "
                                          f"{DISK_OVERHEAD >> 30}Gi for RocksDB's own files)")
        for name, (cache, why) in fills.items():
            if ("limits", name) in amounts and amounts["limits", name] <= cache:
                raise SpecError(f"spec.resources.limits.{name} {self.resources.limits[name]!r} is not above the "
                                f"{format_bytes(cache)} the cache itself holds ({why})")
        for what, given, reserved in (("labels", pod.labels, RESERVED_POD_LABELS),
                                      ("annotations", pod.annotations, RESERVED_POD_ANNOTATIONS)):
            taken = sorted(set(given) & set(reserved))
            if taken:
                raise SpecError(f"spec.pod.{what} may not set {', '.join(taken)}: the operator sets them")
        taken = sorted(k for k in pod.annotations if _RESERVED_POD_ANNOTATION.match(k))
        if taken:
            raise SpecError(f"spec.pod.annotations may not set {', '.join(taken)}: annotations under "
                            f"{', '.join(RESERVED_POD_ANNOTATION_PREFIXES)} change the pods' security or scheduling")
        # Each size fits on its own (above); what the operator adds them up to must fit too.
        if self.memory.disk and quantity_bytes(self.memory.disk) + DISK_OVERHEAD > quantity.MAX_INT64:
            raise SpecError(f"spec.memory.disk {self.memory.disk!r} plus {DISK_OVERHEAD >> 30}Gi for RocksDB's own "
                            "files (the pod's ephemeral storage) is more than 8Ei")
        if self.container_memory_bytes() * self.placement.maxNodes > quantity.MAX_INT64:
            raise SpecError(f"spec.memory.host {self.memory.host!r} plus spec.cluster.segmentMemory, "
                            f"{MEMORY_OVERHEAD >> 20}Mi for the process and the disk tier's index (spec.memory.disk "
                            f"/ {DISK_INDEX_PER_BUDGET}, at least {DISK_INDEX_MIN >> 20}Mi), times "
                            f"spec.placement.maxNodes {self.placement.maxNodes} (the ResourceQuota's memory), is more "
                            "than 8Ei")
        return self

    def _validate_tolerations(self) -> None:
        """What the API server checks of a toleration beyond the CRD's enums (core/v1 validateTolerations)."""
        for i, t in enumerate(self.placement.tolerations):
            where = f"spec.placement.tolerations[{i}]"
            if t.key:
                problem = label_key_error(t.key)
                if problem:
                    raise SpecError(f"{where}.key: {problem}")
            elif t.operator != "Exists":
                raise SpecError(f"{where}.operator must be Exists when key is empty (which tolerates every taint)")
            if t.operator == "Exists":
                if t.value:
                    raise SpecError(f"{where}.value must be empty when operator is Exists, got {t.value!r}")
            elif t.value:
                problem = label_value_error(t.value)
                if problem:
                    raise SpecError(f"{where}.value: {problem}")
            if t.tolerationSeconds is not None and t.effect != "NoExecute":
                raise SpecError(f"{where}.tolerationSeconds needs effect NoExecute, got effect {t.effect!r}")

    def disk_request_bytes(self) -> int:
        """The sidecar's ephemeral storage with an emptyDir disk tier: the tier and RocksDB's own files."""
        return quantity_bytes(self.memory.disk) + DISK_OVERHEAD if self.memory.disk else 0

    def disk_index_bytes(self) -> int:
        """The RAM the sidecar's disk-tier index may take (its --disk-index-bytes, which the operator sets to this and
        counts in the container's memory): the sidecar's own default, spec.memory.disk / 64 and at least 64Mi
        (promptcache.sidecar.disk.default_index_bytes; a test holds them equal); 0 without a disk tier."""
        if not self.memory.disk:
            return 0
        return max(DISK_INDEX_MIN, quantity_bytes(self.memory.disk) // DISK_INDEX_PER_BUDGET)

    def process_overhead_bytes(self) -> int:
        """What the sidecar's container holds beyond its cache budget and cluster segment: the process's own
        (MEMORY_OVERHEAD) and its disk-tier index. The autoscaler's budget is the tuned memory less this."""
        return MEMORY_OVERHEAD + self.disk_index_bytes()

    def container_memory_bytes(self) -> int:
        """The sidecar container's memory request and limit: the host budget, the cluster segment it contributes,
        the process's own and its disk-tier index."""
        segment = quantity_bytes(self.cluster.segmentMemory) if self.cluster.enabled else 0
        return quantity_bytes(self.memory.host) + segment + self.process_overhead_bytes()


def json_name(f: dataclasses.Field) -> str:
    return f.metadata.get("json", f.name)


def _build(tp: Any, value: Any, path: str) -> Any:
    """Build dataclass/typed value `tp` from JSON-like `value`, applying dataclass defaults."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SpecError(f"{path} must be an object")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        known = set()
        for f in dataclasses.fields(tp):
            key = json_name(f)
            known.add(key)
            if key in value and value[key] is not None:
                kwargs[f.name] = _build(hints[f.name], value[key], f"{path}.{key}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(f"{path}.{key} is required")
        unknown = set(value) - known
        if unknown:
            raise SpecError(f"{path} has unknown fields: {', '.join(sorted(unknown))}")
        return tp(**kwargs)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        last: Exception | None = None
        for a in args:
            try:
                return _build(a, value, path)
            except SpecError as exc:
                last = exc
        raise last or SpecError(f"{path} has an invalid value")
    if origin is Literal:
        if value not in get_args(tp):
            raise SpecError(f"{path} must be one of {', '.join(map(str, get_args(tp)))}, got {value!r}")
        return value
    if origin is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        if not isinstance(value, list | tuple):
            raise SpecError(f"{path} must be a list")
        return tuple(_build(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(f"{path} must be an object")
        _, vt = get_args(tp)
        if vt is Any:
            return dict(value)
        return {str(k): _build(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{path} must be a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{path} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"{path} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(f"{path} must be a string")
        return value
    raise SpecError(f"{path}: unsupported type {tp!r}")


def to_dict(obj: Any) -> Any:
    """Dataclass -> JSON-like dict (None fields left out)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is not None:
                out[json_name(f)] = to_dict(v)
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
