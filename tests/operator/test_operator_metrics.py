"""The operator's reading of the sidecar's Prometheus endpoint (for status.hitRatio and status.memoryBytes)."""
from __future__ import annotations

import pytest

from promptcache.operator import metrics


def test_parse_sums_over_labels():
    text = "\n".join([
        "# HELP promptcache_hit_tokens_total prompt tokens found cached, by tier",
        "# TYPE promptcache_hit_tokens_total counter",
        'promptcache_hit_tokens_total{rpc="Lookup",tier="device"} 300.0',
        'promptcache_hit_tokens_total{rpc="Get",tier="disk"} 100.0',
        'promptcache_hit_tokens_created{rpc="Get",tier="disk"} 1.7e9',
        'promptcache_missed_tokens_total{rpc="Lookup"} 600.0',
        'promptcache_stored_bytes{tier="device"} 1024',
        'promptcache_stored_bytes{tier="disk"} 2048',
        "promptcache_stored_bytes_bogus NaN",
    ])
    s = metrics.parse(text)
    assert (s.hit_tokens, s.missed_tokens, s.stored_bytes) == (400, 600, 3072)
    assert metrics.summarize([s, None]) == {"hitRatio": 0.4, "memoryBytes": 3072}
    assert metrics.summarize([None]) == {}
    assert metrics.summarize([metrics.Sample()]) == {"memoryBytes": 0}


def test_parse_the_real_sidecar_exposition():
    """Against what the sidecar's own metrics module exposes (names and _total suffixes)."""
    sidecar_metrics = pytest.importorskip("promptcache.sidecar.metrics")
    prometheus_client = pytest.importorskip("prometheus_client")

    class Tier:
        def __init__(self, used):
            self.used = used

        def usage(self):
            return {"entries": 1, "used": self.used, "budget": 1 << 20}

    m = sidecar_metrics.Metrics()
    m.watch({"device": Tier(5000), "disk": Tier(7000)})
    m.hit_tokens.labels("Lookup", "device").inc(30)
    m.missed_tokens.labels("Lookup").inc(70)
    s = metrics.parse(prometheus_client.generate_latest(m.registry).decode())
    assert (s.hit_tokens, s.missed_tokens, s.stored_bytes) == (30, 70, 12000)


def test_scrape_unreachable_is_none():
    assert metrics.scrape("http://127.0.0.1:9/metrics", timeout=0.5) is None
