"""Get throughput from inside a pod (tests/cluster/test_node_scenarios.py::test_in_cluster_get_throughput mounts this
file from a ConfigMap into a pod of the sidecar image). Usage: python3 get_bench.py TARGETS_JSON [REPEATS]
TARGETS_JSON: [{"name": ..., "grpc": "HOST:PORT", "bulk": "HOST:PORT" | "unix:/PATH" | null, "metrics": URL?}, ...]
Prints one JSON line: {name: {size_mib: {"get_mb_s": median, "cached_tokens": n}}}."""
from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request

import torch

from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec

# 32 KiB of KV per token (4 layers x K,V x 8 heads x 128 x fp32): 8 MiB = 256 tokens (1 chunk), 64 MiB = 2048 (8).
SPEC = ModelSpec("bench/in-cluster", "r1", "float32", num_layers=4, num_kv_heads=8, head_dim=128)
SIZES_MIB = (8, 64)


def main() -> int:
    targets = json.loads(sys.argv[1])
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    out: dict = {}
    for size in SIZES_MIB:
        n = size * 32
        tokens = list(range(size * 100000, size * 100000 + n))
        g = torch.Generator().manual_seed(size)
        kv = [(torch.randn(1, 8, n, 128, generator=g), torch.randn(1, 8, n, 128, generator=g)) for _ in range(4)]
        for t in targets:
            with PromptCacheClient(t["grpc"], timeout=120, bulk_address=t.get("bulk")) as c:
                c.put(SPEC, tokens, kv)
                times = []
                cached = 0
                for _ in range(repeats + 1):  # the first is a warm-up (connections, lent memfd mappings)
                    start = time.perf_counter()
                    cached, got = c.get(SPEC, tokens)
                    times.append(time.perf_counter() - start)
                    assert cached == n and torch.equal(got[0][0], kv[0][0]), (t["name"], cached)
                    del got
                out.setdefault(t["name"], {})[size] = {
                    "get_mb_s": round(size * 1.048576 / statistics.median(times[1:])), "cached_tokens": cached}
    # What the sidecars counted: chunks lent as memfds (the zero-copy path really taken, not a copy fallback).
    for t in targets:
        if t.get("metrics"):
            text = urllib.request.urlopen(t["metrics"], timeout=10).read().decode()
            lent = sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("promptcache_bulk_lent_chunks_total"))
            out[t["name"]]["lent_chunks"] = lent
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
