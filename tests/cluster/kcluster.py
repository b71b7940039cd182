"""Helpers of tests/cluster (conftest.py holds the fixtures). The single-node cluster of tests/cluster (make test-cluster): one node for the whole session (hack/cluster/node.py
brings it up with cached binaries and images and tears it down, checking nothing is left). A cluster that cannot
start is a failure, not a skip.

PROMPTCACHE_CLUSTER_KUBECONFIG=PATH runs the tests against a node already up (`hack/cluster/node.py up`), for
iterating; the node is then left running."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack" / "cluster"))
import node as nodemod  # noqa: E402

CHART = ROOT / "charts" / "promptcache-operator"
RELEASE, RELEASE_NS = "promptcache", "promptcache-system"


def wait_for(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            got = fn()
            if got:
                return got
        except Exception as exc:  # noqa: BLE001 - not there yet
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last})" if last else ""))


class Cluster:
    def __init__(self, kubeconfig: Path, node: "nodemod.Node | None"):
        self.kubeconfig = kubeconfig
        self.node = node
        paths = nodemod.tools_quiet()
        out = subprocess.run(["bash", str(ROOT / "hack/tools/build.sh"), "--print-dir", "helm"], check=True,
                             capture_output=True, text=True).stdout.strip()
        self.kubectl_bin = paths["kubectl"]
        self.helm_bin = Path(out.split("=", 1)[1])

    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120):
        p = subprocess.run([str(self.kubectl_bin), "--kubeconfig", str(self.kubeconfig), *args], capture_output=True,
                           text=True, input=input, timeout=timeout)
        if check and p.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, doc: dict | str, namespace: str | None = None):
        text = doc if isinstance(doc, str) else json.dumps(doc)
        return self.kubectl("apply", *(["-n", namespace] if namespace else []), "-f", "-", input=text)

    def helm(self, *args: str, check: bool = True):
        home = self.kubeconfig.parent / "helm"
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(home / "cache"),
               "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
        p = subprocess.run([str(self.helm_bin), *args], capture_output=True, text=True, env=env, timeout=300)
        if check and p.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def pods(self, namespace: str, selector: str) -> list[dict]:
        return self.get("pods", "-n", namespace, "-l", selector)["items"]

    def diagnostics(self) -> str:
        out = self.kubectl("get", "pods,ds,deploy,events", "-A", "-o", "wide", check=False).stdout
        return out[-6000:]


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def restarts(pod: dict) -> int:
    return sum(c.get("restartCount", 0) for c in pod.get("status", {}).get("containerStatuses", []))


