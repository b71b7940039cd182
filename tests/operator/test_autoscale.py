"""Autoscaler pieces without an API server: metrics parsing and aggregation, the rates from the fleet's scrapes, the
Prometheus source (against a stand-in HTTP server answering the query API), the tuned children, config from env,
and Resize over gRPC (the generated promptcache.v1 messages) against a stand-in server and a real sidecar process."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent import futures
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from promptcache.operator import autoscale, builders, fleet
from promptcache.operator.builders import Capabilities, Owner
from promptcache.operator.fleet import Counters, PodRates, Tokens
from promptcache.operator.model import PromptCacheSpec

Mi = 1 << 20
EXPOSITION = "\n".join([
    'promptcache_hit_tokens_total{rpc="Lookup",tier="device"} 300.0',
    'promptcache_hit_tokens_total{rpc="Lookup",tier="disk"} 100.0',
    'promptcache_missed_tokens_total{rpc="Lookup"} 600.0',
    'promptcache_evictions_total{tier="device",reason="capacity"} 40.0',
    'promptcache_evictions_total{tier="device",reason="ttl"} 7.0',
    'promptcache_evictions_total{tier="disk",reason="capacity"} 9.0',
    'promptcache_eviction_entry_age_seconds_sum{reason="capacity"} 400.0',
    'promptcache_eviction_entry_age_seconds_count{reason="capacity"} 40.0',
    'promptcache_eviction_entry_age_seconds_bucket{reason="capacity",le="10.0"} 3.0',
    'promptcache_stored_bytes{tier="device"} 1024',
    'promptcache_stored_bytes{tier="disk"} 999999',
    'promptcache_budget_bytes{tier="device"} 2048',
    'promptcache_committed_bytes{tier="device"} 1500',
])


def test_parse_counts_disk_hits_as_memory_misses():
    c = fleet.parse(EXPOSITION)
    assert c == Counters(tokens=Tokens(memory_hits=300, any_tier_hits=400, lookups=1000), capacity_evictions=40,
                         capacity_age_sum=400, capacity_age_count=40, stored_bytes=1024,
                         all_tiers_stored_bytes=1024 + 999999, budget_bytes=2048, committed_bytes=1500)
    assert c.tokens.memory_hit_ratio == 0.3


MRC = "\n".join([
    'promptcache_mrc_hit_tokens_total{capacity_bytes="1048576"} 100.0',
    'promptcache_mrc_hit_tokens_total{capacity_bytes="4194304"} 700.0',
    'promptcache_mrc_lookup_tokens_total{capacity_bytes="1048576"} 1000.0',
    'promptcache_mrc_lookup_tokens_total{capacity_bytes="4194304"} 1000.0',
    'promptcache_mrc_hit_ratio{capacity_bytes="1048576"} 0.1',
])


def test_parse_and_rate_the_miss_ratio_curve():
    c = fleet.parse(EXPOSITION + "\n" + MRC)
    assert c.mrc_hit_tokens == ((1 * Mi, 100.0), (4 * Mi, 700.0))
    assert c.mrc_lookup_tokens == ((1 * Mi, 1000.0), (4 * Mi, 1000.0))
    assert c.tokens.memory_hits == 300   # the curve's counters are not the cache's
    later = fleet.parse(EXPOSITION + "\n" + MRC.replace("700.0", "1600.0").replace("1000.0", "2000.0"))
    r = fleet.rates(c, later, 10.0)
    assert r.mrc_hits_per_s == ((1 * Mi, 0.0), (4 * Mi, 90.0))
    assert r.mrc_lookups_per_s == ((1 * Mi, 100.0), (4 * Mi, 100.0))
    assert fleet.aggregate([r]).curve == ((1 * Mi, 0.0), (4 * Mi, 0.9))
    assert fleet.aggregate([fleet.rates(c, c, 10.0)]).curve is None   # nothing sampled


def test_curve_pools_the_nodes_at_the_sizes_they_share():
    a = PodRates(Tokens(90, 90, 100), 2.0, 20.0, 2.0, 100, 200, ((1, 10.0), (2, 30.0), (3, 40.0)),
                 ((1, 50.0), (2, 50.0), (3, 50.0)))
    b = PodRates(Tokens(10, 10, 100), 0.0, 0.0, 0.0, 50, 200, ((2, 20.0), (3, 40.0)), ((2, 50.0), (3, 50.0)))
    c = PodRates(Tokens(10, 10, 100), 0.0, 0.0, 0.0, 50, 200)   # runs no curve
    assert fleet.aggregate([a, b, c]).curve == ((2, 0.5), (3, 0.8))


def test_aggregate_over_nodes():
    a = PodRates(Tokens(90, 95, 100), 2.0, 20.0, 2.0, 100, 200)
    b = PodRates(Tokens(10, 10, 100), 0.0, 0.0, 0.0, 50, 200)
    s = fleet.aggregate([a, b])
    assert s.hit_ratio == 0.5 and s.lookup_tokens_per_s == 100 and s.capacity_evictions_per_s == 2.0
    assert s.eviction_age_s == 10.0 and s.stored_bytes == 100
    idle = fleet.aggregate([PodRates(Tokens(), 0, 0, 0, 0, 0)])
    assert idle.hit_ratio is None and idle.eviction_age_s is None
    assert fleet.aggregate([]) is None


class Pods:
    """The API server's pod listing, as fleet.discover reads it."""

    def __init__(self, *ready: bool):
        self.ready = list(ready)

    def request(self, method, path, query=None, **_):
        return {"items": [{"metadata": {"name": f"p{i}"}, "spec": {"nodeName": f"n{i}"},
                           "status": {"podIP": f"10.0.0.{i}", "conditions": [{"type": "Ready", "status": str(r)}]}}
                          for i, r in enumerate(self.ready)]}


def test_fleet_rates_and_counter_reset():
    now = [0.0]
    texts = iter([EXPOSITION, EXPOSITION.replace("300.0", "400.0").replace("600.0", "700.0"),
                  EXPOSITION.replace("300.0", "50.0")])   # third: the sidecar restarted (counter went down)
    src = fleet.Fleet(window_s=10, max_age_s=0, clock=lambda: now[0],
                      scrape=lambda url, timeout: fleet.parse(next(texts)))
    owner = Owner("c", "ns", "u")
    pods = Pods(True)
    assert src.signal(src.observe(pods, owner))[0] is None          # one sample: no rate yet
    now[0] = 10.0
    s, latest = src.signal(src.observe(pods, owner))
    assert s.hit_ratio == 0.5 and s.lookup_tokens_per_s == 20.0 and latest["p0"].budget_bytes == 2048
    now[0] = 20.0
    s, _ = src.signal(src.observe(pods, owner))
    assert s.lookup_tokens_per_s >= 0   # a reset never yields a negative rate
    now[0] = 30.0
    assert src.signal(src.observe(Pods(False), owner))[0] is None   # not ready: not scraped


class _Prom(BaseHTTPRequestHandler):
    queries: list[str] = []

    def do_GET(self):  # noqa: N802
        q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["query"][0]
        self.queries.append(q)
        if "promptcache_mrc_hit_tokens_total" in q:   # by pod and size
            result = [{"metric": {"pod": "p1", "capacity_bytes": str(size)}, "value": [0, str(v)]}
                      for size, v in ((8 * Mi, 20), (16 * Mi, 36))]
        elif "promptcache_mrc_lookup_tokens_total" in q:
            result = [{"metric": {"pod": "p1", "capacity_bytes": str(size)}, "value": [0, "40"]}
                      for size in (8 * Mi, 16 * Mi)]
        else:
            result = None
        value = {"promptcache_missed_tokens_total": 5,   # hits: 30 from memory, 35 in all tiers
                 'promptcache_hit_tokens_total{namespace="ml",service="llama-metrics",tier="device"}': 30,
                 "promptcache_hit_tokens_total{": 35,
                 "promptcache_evictions_total": 2, "_sum": 20, "_count": 2, "promptcache_stored_bytes": 5 * Mi,
                 "promptcache_budget_bytes": 8 * Mi}
        if result is None:
            v = next(v for k, v in value.items() if k in q)
            result = [{"metric": {"pod": "p1"}, "value": [0, str(v)]}]
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


OBSERVED = fleet.Observation("ml", "llama", 0.0, (), {})


def test_prometheus_source():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Prom)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        src = fleet.PrometheusSource(f"http://127.0.0.1:{srv.server_port}", window_s=120)
        s, latest = src.signal(OBSERVED)
        assert s.hit_ratio == 0.75 and s.capacity_evictions_per_s == 2 and s.eviction_age_s == 10
        assert s.curve == ((8 * Mi, 0.5), (16 * Mi, 0.9))
        assert latest["p1"].budget_bytes == 8 * Mi
        assert all('namespace="ml",service="llama-metrics"' in q and "[120s]" in q
                   for q in _Prom.queries if "rate(" in q)
    finally:
        srv.shutdown()
    assert fleet.PrometheusSource("http://127.0.0.1:9", timeout_s=0.5).signal(OBSERVED) == (None, {})


SPEC = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"},
                                  "autoscaling": {"enabled": True, "minMemory": "2Gi", "maxMemory": "16Gi"}})
OWNER = Owner("c", "ns", "uid")
CFG = autoscale.Config(overhead_bytes=512 * Mi, vpa_update_mode="Initial")


def by_kind(children):
    return {c["kind"]: c for c in children}


def test_adjust_children_vpa_and_daemonset_fallback():
    status = {"autoscaling": {"memoryBytes": 6 * 1024 * Mi}}
    plain = builders.desired_children(SPEC, OWNER, Capabilities(vpa=True))
    got = by_kind(autoscale.adjust_children(plain, SPEC, status, CFG))
    pol = got["VerticalPodAutoscaler"]["spec"]["resourcePolicy"]["containerPolicies"][0]
    assert pol["minAllowed"] == pol["maxAllowed"] == {"memory": "6Gi"}
    assert got["VerticalPodAutoscaler"]["spec"]["updatePolicy"]["updateMode"] == "Initial"
    assert got["ConfigMap"]["data"]["PROMPTCACHE_MEMORY_BYTES"] == str(6 * 1024 * Mi - 512 * Mi)
    assert got["DaemonSet"] == by_kind(plain)["DaemonSet"]      # the VPA sets the pods' resources
    # Without a VPA the DaemonSet carries the limit; the config hash does not change (no restart for the budget).
    plain = builders.desired_children(SPEC, OWNER, Capabilities())
    got = by_kind(autoscale.adjust_children(plain, SPEC, status, CFG))
    res = got["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["memory"] == res["requests"]["memory"] == "6Gi"
    ann = "promptcache.io/config-hash"
    assert (got["DaemonSet"]["spec"]["template"]["metadata"]["annotations"][ann]
            == by_kind(plain)["DaemonSet"]["spec"]["template"]["metadata"]["annotations"][ann])
    # Nothing tuned yet, or autoscaling off: untouched.
    assert autoscale.adjust_children(plain, SPEC, {}, CFG) == plain
    off = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"}})
    assert autoscale.adjust_children(plain, off, status, CFG) == plain


def test_bounds_and_config_from_env():
    assert autoscale.bounds(SPEC, 512 * Mi) == (2 << 30, 16 << 30)
    only_max = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"},
                                          "autoscaling": {"enabled": True, "maxMemory": "8Gi"}})
    assert autoscale.bounds(only_max, 0) == (4 << 30, 8 << 30)
    c = autoscale.Config.from_env({"PROMPTCACHE_AUTOSCALE_GROW_COOLDOWN_SECONDS": "7",
                                   "PROMPTCACHE_AUTOSCALE_VPA_UPDATE_MODE": "Initial"})
    assert c.policy.grow_cooldown_s == 7 and c.vpa_update_mode == "Initial"
    with pytest.raises(ValueError):
        autoscale.Config.from_env({"PROMPTCACHE_AUTOSCALE_VPA_UPDATE_MODE": "Sometimes"})


def test_grpc_resize_against_a_real_sidecar(tmp_path):
    from support import SidecarProcess

    s = SidecarProcess("--memory-bytes", str(64 * Mi), "--device", "cpu", "--data-dir", str(tmp_path)).wait_ready()
    try:
        r = autoscale.grpc_resize(s.address, 32 * Mi, 5)
        assert r["previous_bytes"] == 64 * Mi and r["memory_bytes"] == 32 * Mi
        with pytest.raises(autoscale.ResizeError, match="INVALID_ARGUMENT"):
            autoscale.grpc_resize(s.address, -1, 5)
    finally:
        s.stop()
    with pytest.raises(autoscale.ResizeError, match="UNAVAILABLE"):
        autoscale.grpc_resize(s.address, 32 * Mi, 2)


def test_grpc_resize_speaks_the_generated_messages():
    """What the operator sends is exactly kvcache_pb2.ResizeRequest's encoding, and what it returns is the server's
    ResizeResponse decoded by the stub (no hand-written varints: a budget over 32 bits and 64-bit counters too)."""
    import grpc
    from promptcache.v1 import kvcache_pb2 as pb

    seen: list[bytes] = []
    reply = pb.ResizeResponse(previous_bytes=(1 << 40) + 3, memory_bytes=(5 << 32) + 1, evicted_chunks=300,
                              bytes_used=(1 << 63) + 7, committed_bytes=12, waited_milliseconds=4)

    def resize(raw: bytes, context) -> bytes:   # raw bytes both ways: no deserializer on the server
        seen.append(raw)
        return reply.SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "promptcache.v1.KVCache", {"Resize": grpc.unary_unary_rpc_method_handler(resize)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for budget in (1, 127, 128, 300 * Mi, (5 << 32) + 1, (1 << 63) - 1, -1):
            r = autoscale.grpc_resize(f"127.0.0.1:{port}", budget, 5)
            assert seen[-1] == pb.ResizeRequest(memory_bytes=budget).SerializeToString()
            assert pb.ResizeRequest.FromString(seen[-1]).memory_bytes == budget
            assert r == {"previous_bytes": reply.previous_bytes, "memory_bytes": reply.memory_bytes,
                         "evicted_chunks": reply.evicted_chunks, "bytes_used": reply.bytes_used}
        with pytest.raises(autoscale.ResizeError, match="budget"):   # not an int64: refused before any call
            autoscale.grpc_resize(f"127.0.0.1:{port}", 1 << 63, 5)
        assert len(seen) == 7
    finally:
        server.stop(None)


def test_operator_imports_neither_torch_nor_the_sidecar():
    """The operator image has no torch and no sidecar or client code: the autoscaler and the stubs it uses import
    without them."""
    code = ("import sys, promptcache.operator.autoscale, promptcache.v1.kvcache_pb2\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
            " or m.startswith(('promptcache.sidecar', 'promptcache.client')))\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
