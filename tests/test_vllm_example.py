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
