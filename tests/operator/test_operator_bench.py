"""Timing: apply -> every child present, for one PromptCache and for 100 applied at once.

    pytest tests/operator/test_operator_bench.py -s -q      # prints the figures; also bench-results/operator.json
"""
from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from opharness import wait_for
from test_operator_apiserver import all_present, apply_pc, example

pytestmark = pytest.mark.apiserver

ROOT = Path(__file__).resolve().parents[2]
KINDS = (("api/v1", "configmaps"), ("apis/apps/v1", "daemonsets"), ("api/v1", "services"),
         ("api/v1", "resourcequotas"))
PER_CACHE = {"configmaps": 1, "daemonsets": 1, "services": 2, "resourcequotas": 1}


def count_children(kube, namespace: str) -> dict[str, int]:
    sel = [("labelSelector", "app.kubernetes.io/managed-by=promptcache-operator")]
    return {plural: len(kube.request("GET", f"/{api}/namespaces/{namespace}/{plural}", query=sel)["items"])
            for api, plural in KINDS}


def test_apply_to_children_latency(start_operator, crd, kube, namespace, capsys):
    op = start_operator("--standalone", env={"PROMPTCACHE_OPERATOR_RESYNC_SECONDS": "60"}, name="bench")
    apply_pc(kube, namespace, example(), name="warmup")
    wait_for(lambda: all_present(kube, namespace, "warmup"), timeout=60, what="warm-up")

    singles = []
    for i in range(5):
        t0 = time.monotonic()
        apply_pc(kube, namespace, example(), name=f"single-{i}")
        wait_for(lambda i=i: all_present(kube, namespace, f"single-{i}"), timeout=5, interval=0.01,
                 what=f"children of single-{i} within 5 s")
        singles.append(time.monotonic() - t0)

    n = 100
    before = count_children(kube, namespace)
    want = {k: before[k] + n * v for k, v in PER_CACHE.items()}
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: apply_pc(kube, namespace, example(), name=f"many-{i:03d}"), range(n)))
    applied = time.monotonic() - t0
    wait_for(lambda: count_children(kube, namespace) == want, timeout=180, interval=0.25,
             what=f"children of {n} PromptCaches")
    all_children = time.monotonic() - t0

    def statuses_done():
        items = kube.request("GET", f"/apis/promptcache.io/v1alpha1/namespaces/{namespace}/promptcaches")["items"]
        return sum(1 for it in items if it["metadata"]["name"].startswith("many-")
                   and (it.get("status") or {}).get("observedGeneration") == 1) == n
    wait_for(statuses_done, timeout=180, interval=0.2, what="statuses")
    all_status = time.monotonic() - t0

    result = {
        "single_apply_to_all_children_seconds": {"min": min(singles), "median": statistics.median(singles),
                                                 "max": max(singles), "runs": len(singles)},
        "batch": {"promptcaches": n, "children": n * sum(PER_CACHE.values()), "apply_all_seconds": applied,
                  "apply_to_all_children_seconds": all_children, "apply_to_all_status_seconds": all_status},
        "machine": "2 cores, operator + kube-apiserver + etcd + test client on the same machine",
    }
    out = ROOT / "bench-results" / "operator.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    with capsys.disabled():
        print(f"\n[operator bench] 1 PromptCache, apply -> all 5 children: median "
              f"{statistics.median(singles) * 1000:.0f} ms (min {min(singles) * 1000:.0f}, "
              f"max {max(singles) * 1000:.0f}, {len(singles)} runs)")
        print(f"[operator bench] {n} PromptCaches at once: applied in {applied:.2f} s, all {n * 5} children after "
              f"{all_children:.2f} s, all statuses after {all_status:.2f} s")
    assert max(singles) <= 5.0
    assert "Traceback" not in op.output()
