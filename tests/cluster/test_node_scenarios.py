"""Scenarios on a real single-node Kubernetes (kubelet, containerd, runc, kube-proxy; images built locally): the
chart, the operator, the sidecars and what they promise (docs/operator.md), asserted on what the cluster did."""
from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kcluster import RELEASE_NS, _ready, restarts, wait_for

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
GPU_LABEL = "nvidia.com/gpu.present"
OPERATOR = "app.kubernetes.io/name=promptcache-operator"


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
