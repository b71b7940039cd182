"""examples/vllm-deployment.yaml: valid Kubernetes objects, and its --kv-transfer-config names this connector."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "vllm-deployment.yaml"


def test_example_is_valid_kubernetes():
    v = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.34.0", str(EXAMPLE)],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr


def test_example_wires_the_connector_to_the_node_local_service():
    deployment = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    arg = next(a for a in container["args"] if a.startswith("--kv-transfer-config="))
    config = json.loads(arg.split("=", 1)[1])
    assert config["kv_connector"] == "PromptCacheConnector" and config["kv_role"] == "kv_both"
    module = REPO / "sidecar" / (config["kv_connector_module_path"].replace(".", "/") + ".py")
    assert module.exists() and "class PromptCacheConnector(" in module.read_text()
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PROMPTCACHE_ADDRESS"].endswith(".svc:50051")
    assert env["PROMPTCACHE_BULK_ADDRESS"].endswith(".svc:50052")


def test_zero_copy_variant_shares_the_sidecars_socket_under_restricted():
    """The native-sidecar Deployment: the cache is an init container with restartPolicy Always whose bulk socket is
    in an emptyDir the vllm container mounts too, and nothing in the pod needs more than `restricted`."""
    dep = next(d for d in yaml.safe_load_all(EXAMPLE.read_text())
               if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-zero-copy")
    pod = dep["spec"]["template"]["spec"]
    (side,) = pod["initContainers"]
    assert side["restartPolicy"] == "Always" and "grpc" in side["startupProbe"]
    sock = next(a.split("=", 1)[1] for a in side["args"] if a.startswith("--bulk-address="))
    assert sock.startswith("unix:/run/promptcache/")
    vllm = pod["containers"][0]
    env = {e["name"]: e["value"] for e in vllm["env"]}
    assert env["PROMPTCACHE_BULK_ADDRESS"] == sock
    shared = {m["name"] for m in side["volumeMounts"]} & {m["name"] for m in vllm["volumeMounts"]}
    assert shared and all("emptyDir" in v for v in pod["volumes"] if v["name"] in shared)
    assert all(set(v) <= {"name", "emptyDir", "configMap", "secret", "projected"} for v in pod["volumes"])
    assert pod["securityContext"]["runAsNonRoot"] and not any(
        k in pod for k in ("hostNetwork", "hostPID", "hostIPC"))
    for c in (side, vllm):
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_node_zero_copy_variant_mounts_the_operators_socket_directory():
    """The DaemonSet-sidecar zero copy Deployment: it mounts the node directory the operator gives a PromptCache
    with spec.zeroCopy.hostPath (builders.socket_host_dir), joins the socket's group and dials the socket the
    operator's sidecar serves there."""
    from promptcache.operator import builders
    from promptcache.operator.model import PromptCacheSpec

    dep = next(d for d in yaml.safe_load_all(EXAMPLE.read_text())
               if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-node-zero-copy")
    pod = dep["spec"]["template"]["spec"]
    spec = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "1Gi"},
                                      "zeroCopy": {"hostPath": "/run/promptcache"}})
    owner = builders.Owner(name="promptcache", namespace="promptcache-system", uid="u")
    (vol,) = pod["volumes"]
    assert vol["hostPath"] == {"path": builders.socket_host_dir(spec, owner), "type": "Directory"}
    (c,) = pod["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
    env = {e["name"]: e["value"] for e in c["env"]}
    served = builders.sidecar_env(spec)["PROMPTCACHE_BULK_ADDRESS"].split(",")
    assert env["PROMPTCACHE_BULK_ADDRESS"] == f"unix:{mount['mountPath']}/bulk.sock" == served[-1]
    assert int(builders.RUN_AS) in pod["securityContext"]["supplementalGroups"]
    assert builders.sidecar_env(spec)["PROMPTCACHE_BULK_SOCKET_MODE"] == "0660"  # the group may connect
