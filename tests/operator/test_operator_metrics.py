"""The operator's reading of the sidecar's Prometheus endpoint (fleet.parse; status.hitRatio, anyTierHitRatio and
memoryBytes)."""
from __future__ import annotations

import pytest

from promptcache.operator import fleet


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
    s = fleet.parse(text)
    assert s.tokens == fleet.Tokens(memory_hits=300, any_tier_hits=400, lookups=1000)
    assert (s.stored_bytes, s.all_tiers_stored_bytes) == (1024, 3072)
    assert fleet.status_usage([s]) == {"hitRatio": 0.3, "anyTierHitRatio": 0.4, "memoryBytes": 3072}
    assert fleet.status_usage([]) == {}
    assert fleet.status_usage([fleet.Counters()]) == {"memoryBytes": 0}


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
    m.hit_tokens.labels("Get", "cluster").inc(10)
    m.missed_tokens.labels("Lookup").inc(60)
    s = fleet.parse(prometheus_client.generate_latest(m.registry).decode())
    assert s.tokens == fleet.Tokens(memory_hits=30, any_tier_hits=40, lookups=100)
    assert (s.stored_bytes, s.all_tiers_stored_bytes, s.budget_bytes) == (5000, 12000, 1 << 20)
    assert (s.tokens.memory_hit_ratio, s.tokens.any_tier_hit_ratio) == (0.3, 0.4)


def test_malformed_exposition_is_refused():
    with pytest.raises(ValueError):
        fleet.parse("promptcache_hit_tokens_total not-a-number\n")


def test_scrape_unreachable_is_none():
    assert fleet.scrape("http://127.0.0.1:9/metrics", timeout=0.5) is None


def test_scrape_of_an_endless_or_trickling_answer_is_bounded():
    """Whatever answers on a pod's address is read at most MAX_SCRAPE_BYTES, within the scrape's timeout in all."""
    import http.server
    import threading
    import time

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"promptcache_x 1\n" * 4096 if self.path == "/flood" else b"#")
                    if self.path != "/flood":
                        time.sleep(0.05)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        t = time.monotonic()
        assert fleet.scrape(f"http://127.0.0.1:{port}/flood", timeout=5) is None  # over the byte bound
        assert fleet.scrape(f"http://127.0.0.1:{port}/trickle", timeout=1) is None  # past the deadline
        assert time.monotonic() - t < 10
    finally:
        server.shutdown()
        server.server_close()
