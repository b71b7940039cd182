"""The autoscaler as the operator runs it: `python -m promptcache.operator` (a subprocess with the chart's RBAC), its
kopf timer, a real sidecar under load (working set larger than its budget). The operator grows the memory: status,
Event, DaemonSet limit and the sidecar's own budget (Resize) all follow. As in test_closed_loop, the cache's Pod is
made by hand, as a kubelet would report it (IP 127.0.0.1, Ready, the local sidecar's ports)."""
from __future__ import annotations

import pytest

from opharness import wait_for
from promptcache.operator import fleet
from promptcache.operator.builders import Owner
from promptcache.operator.kube import object_path
from support import SidecarProcess
from test_closed_loop import CHUNK_TOKENS, MIN, PC_API, SPEC, Workload, ds_memory_limit, sidecar_pod

pytestmark = pytest.mark.apiserver

ENV = {"PROMPTCACHE_OPERATOR_RESYNC_SECONDS": "2", "PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS": "1",
       "PROMPTCACHE_AUTOSCALE_INTERVAL_SECONDS": "1", "PROMPTCACHE_AUTOSCALE_WINDOW_SECONDS": "2",
       "PROMPTCACHE_AUTOSCALE_GROW_COOLDOWN_SECONDS": "2", "PROMPTCACHE_AUTOSCALE_OVERHEAD_BYTES": "0"}


def test_operator_grows_memory_under_load(start_operator, crd, kube, namespace, tmp_path):
    sidecar = SidecarProcess("--memory-bytes", str(MIN), "--chunk-tokens", str(CHUNK_TOKENS), "--device", "cpu",
                             "--data-dir", str(tmp_path / "data"), "--log-level", "warning").wait_ready()
    workload = Workload(sidecar.address)
    try:
        name = "auto"
        doc = {"apiVersion": PC_API, "kind": "PromptCache", "metadata": {"name": name, "namespace": namespace},
               "spec": {"model": {"name": SPEC.model_id, "revision": "rev-1"}, "memory": {"host": "8Mi"},
                        "cachePolicy": {"chunkTokens": CHUNK_TOKENS},
                        "autoscaling": {"enabled": True, "targetHitRatio": 0.8, "minMemory": "8Mi",
                                        "maxMemory": "64Mi"}}}
        workload.start()
        start_operator("--standalone", env=ENV)
        pc = kube.request("PATCH", object_path(PC_API, "PromptCache", namespace, name), body=doc,
                          content_type="application/apply-patch+yaml", query=[("fieldManager", "kubectl")])
        sidecar_pod(kube, Owner(name, namespace, pc["metadata"]["uid"]), sidecar)

        def grown():
            st = (kube.get(PC_API, "PromptCache", namespace, name).get("status") or {}).get("autoscaling") or {}
            return st if st.get("memoryBytes", 0) > MIN else None
        st = wait_for(grown, timeout=60, interval=0.5, what="status.autoscaling.memoryBytes above the start")
        assert st["lastDecision"]["action"] == "grow" and st["lastDecision"]["reason"] == "HitRatioBelowTarget"
        wait_for(lambda: ds_memory_limit(kube, namespace, name) >= st["memoryBytes"], timeout=10,
                 what="DaemonSet limit raised")
        wait_for(lambda: (fleet.scrape(f"http://127.0.0.1:{sidecar.metrics_port}/metrics").budget_bytes
                          > MIN), timeout=10, what="sidecar resized up")

        def grow_event():  # posted after the Resize, so it can trail what the waits above saw
            events = kube.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                  query=[("fieldSelector", f"involvedObject.name={name}")])["items"]
            return any(e["reason"] == "HitRatioBelowTarget" and e["source"]["component"] == "promptcache-autoscaler"
                       for e in events)
        wait_for(grow_event, timeout=10, what="the grow's Event")
        assert sidecar.proc.poll() is None
    finally:
        workload.stop.set()
        workload.join(10)
        sidecar.stop()
