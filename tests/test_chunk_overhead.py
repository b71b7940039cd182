"""--chunk-overhead-bytes: what each memory-tier chunk costs the process beyond its bytes (its index entry, the
eviction policy's state and ghosts, tenancy) is counted in --memory-bytes. A client chooses its chunk size through
its model's layout (one layer, one head, head_dim 1, fp8: 256 bytes a chunk), and before this a 16 MiB budget held
65,536 such chunks and the process grew by about 6 KB for each: 400 MiB and more (an adversarial resource-bounds
audit)."""
from __future__ import annotations

import psutil

from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes
from support import SidecarProcess

TINY = ModelSpec("audit/tiny-chunks", "v1", "float16", num_layers=1, num_kv_heads=1, head_dim=2)
CT = 16
OVERHEAD = "8Ki"  # the default (SidecarProcess sets 0 for the other tests)


def test_tiny_chunks_are_counted_with_their_bookkeeping_by_default():
    from promptcache.sidecar.config import Settings

    assert Settings().chunk_overhead_bytes == 8 << 10  # what OVERHEAD says
    nbytes = chunk_nbytes(TINY, CT)  # 128 bytes
    budget = 4 << 20
    sidecar = SidecarProcess("--memory-bytes", str(budget), "--chunk-tokens", str(CT),
                             env={"PROMPTCACHE_CHUNK_OVERHEAD_BYTES": OVERHEAD}).wait_ready()
    try:
        rss0 = psutil.Process(sidecar.proc.pid).memory_info().rss
        with PromptCacheClient(sidecar.address, timeout=30) as client:
            blob = bytes(nbytes)
            for seed in range(40):  # 40 prefixes of 64 chunks: 2,560 chunks offered
                tokens = [seed * 1_000_000 + i for i in range(64 * CT)]
                client.put_blobs(TINY, tokens, {i: blob for i in range(64)})
        held = _held_entries(sidecar)
        assert held <= budget // (nbytes + (8 << 10)) + 1, held  # 506 at most, not 32,768
        assert held >= 256
        grown = psutil.Process(sidecar.proc.pid).memory_info().rss - rss0
        assert grown < 2 * budget, grown
    finally:
        sidecar.stop()


def _held_entries(sidecar: SidecarProcess) -> int:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith('promptcache_entries{tier="device"}'):
            return int(float(line.split()[-1]))
    raise AssertionError("promptcache_entries{tier=\"device\"} not in /metrics")
