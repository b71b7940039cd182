"""Garbage collection pauses (docs/operating.md): `promptcache serve` freezes what its imports made, and /metrics
shows every collection's pause by generation."""
from __future__ import annotations

import gc
import re

import torch
from prometheus_client import generate_latest

from promptcache.sidecar.metrics import Metrics
from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.store import MemoryTier
from support import SidecarProcess


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def test_serve_freezes_what_its_imports_made_and_reports_pauses():
    """A real `promptcache serve`: torch's, grpc's and numpy's objects (about 190,000) are out of the collector's
    sight from start-up, so that a full collection scans only what serving makes (an idle sidecar's took 34-72 ms)."""
    import urllib.request

    sidecar = SidecarProcess("--memory-bytes", str(64 << 20)).wait_ready()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        sidecar.stop()
    assert _sample(text, "promptcache_gc_frozen_objects") > 100_000
    assert 'promptcache_gc_pause_seconds_bucket{generation="2",le="+Inf"}' in text


def test_a_full_collection_is_counted_with_its_pause():
    metrics = Metrics()
    name = 'promptcache_gc_pause_seconds_count{generation="2"}'
    before = _sample(generate_latest(metrics.registry).decode(), name)
    gc.collect()
    text = generate_latest(Metrics().registry).decode()  # (a second registry: the process's pauses, once each)
    assert _sample(text, name) >= before + 1
    assert _sample(text, 'promptcache_gc_pause_seconds_sum{generation="2"}') > 0


def test_a_chunk_held_leaves_no_dict_or_heap_item_for_the_collector():
    """Per chunk the collector tracks its entry, its tensor and its numpy view's base, the policy's statistics and
    the parent's set of children: an entry's __dict__ and an expiry-heap item that named the entry are gone."""
    tier = MemoryTier(1 << 20, torch.device("cpu"), make_policy("rate-hazard"), ttl_seconds=60, protect_memory=False)
    parent = b"\0" * 32
    for i in range(64):
        key = i.to_bytes(32, "little")
        r = tier.reserve(64, key, parent)
        tier.commit(r, key=key, fingerprint=b"f", parent=parent, index=i, data=tier.host_buffer(r), checksum_value=0,
                    shape=(64,), dtype=0)
        parent = key
    entry = tier.peek(parent, b"f")
    assert not hasattr(entry, "__dict__")
    gc.collect()  # (untracks tuples of atoms)
    assert not any(gc.is_tracked(item) for item in tier._expiry.items)
