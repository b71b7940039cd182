"""The cluster tier on a real Mooncake master (loopback, TCP): two sidecar processes ("nodes", each with its own
data folder and memory) share chunks through it; a killed master leaves both serving locally, counted; tenant
isolation holds across the nodes. With two HA masters behind a real etcd, the standby takes over from a killed
leader and the nodes share chunks again."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from support import CHUNK, SMALL, SidecarProcess, free_port, make_kv, metric
from promptcache.client import PromptCacheClient
from promptcache.sidecar.cluster import decode_record, encode_record, verify
from promptcache.sidecar.store import checksum
from promptcache_devtools.procs import wait_until
from test_auth import write_secret_dir


def mooncake_master_binary() -> str:
    import mooncake  # the 'cluster' extra: mooncake-transfer-engine-non-cuda

    return str(Path(mooncake.__file__).parent / "mooncake_master")


@pytest.fixture
def master(tmp_path):
    port, admin = free_port(), free_port()
    proc = subprocess.Popen([mooncake_master_binary(), f"-rpc_port={port}", "-rpc_address=127.0.0.1",
                             f"-metrics_port={admin}", "-metrics_host=127.0.0.1"],
                            stdout=open(tmp_path / "master.log", "w"), stderr=subprocess.STDOUT)
    wait_until(lambda: _accepts(port), "the Mooncake master listening", timeout=20)
    yield proc, f"127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _fleet_credentials(tmp_path, tenants=("alice", "bob")) -> tuple[str, str]:
    """The tenants' token folder and one fleet secret (a tenant's keys are the same on every node), as paths."""
    tokens = tmp_path / "tokens"
    write_secret_dir(tokens, {t: f"{t}-token" for t in tenants})
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    return str(tokens), str(secret)


def _node(tmp_path, name: str, master: str, tokens: str, secret: str, *extra: str, env=None) -> SidecarProcess:
    data = tmp_path / name
    data.mkdir()
    return SidecarProcess("--chunk-tokens", str(CHUNK), "--memory-bytes", "8Mi", "--data-dir", str(data),
                          "--token-file", tokens, "--tenant-secret-file", secret,
                          "--cluster-master", master, "--cluster-local-hostname", "127.0.0.1",
                          "--cluster-segment-bytes", "32Mi", "--cluster-buffer-bytes", "8Mi",
                          "--cluster-retry-seconds", "30", "--log-format", "text", *extra, env=env).wait_ready()


@pytest.fixture
def nodes(tmp_path, master, request):
    """Nodes a and b; a test parametrizing `nodes` indirectly starts b with those extra flags."""
    tokens, secret = _fleet_credentials(tmp_path)
    extra = getattr(request, "param", ())
    a = _node(tmp_path, "a", master[1], tokens, secret)
    b = _node(tmp_path, "b", master[1], tokens, secret, *extra)
    for n in (a, b):
        wait_until(lambda n=n: metric(n, "promptcache_cluster_up") == 1, "a sidecar joining the cluster", 30)
    clients = {(node, t): PromptCacheClient(n.address, token=f"{t}-token", retries=0, timeout=10)
               for node, n in (("a", a), ("b", b)) for t in ("alice", "bob")}
    yield master[0], a, b, clients
    for c in clients.values():
        c.close()
    for n in (a, b):
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGKILL)  # a Mooncake client whose master is gone can take long to close
            n.proc.wait()


def _tokens(seed: int, chunks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(chunks * CHUNK)]


@pytest.mark.slow  # two sidecar processes and a master: about 25 s here
def test_a_prefix_stored_on_one_node_is_served_by_another_and_tenants_stay_apart(nodes):
    master, a, b, c = nodes
    tokens = _tokens(1, 3)
    kv = make_kv(SMALL, len(tokens))
    assert c["a", "alice"].put(SMALL, tokens, kv).stored_chunks == 3
    wait_until(lambda: metric(a, "promptcache_cluster_published_chunks_total") == 3, "A publishing 3 chunks", 10)

    # Bob on node B: another tenant's keys, whatever salt he sends: a plain miss (B asked the cluster, found none).
    for salt in (b"", b"alice"):
        spec = dataclasses.replace(SMALL, tenant_salt=salt)
        assert c["b", "bob"].lookup(spec, tokens).cached_tokens == 0
        assert c["b", "bob"].get_blobs(spec, tokens) == []
    assert metric(b, "promptcache_cluster_hits_total") == 0
    assert metric(b, "promptcache_cluster_misses_total") >= 2

    # Alice on node B: B holds nothing locally, finds the prefix in the cluster, serves it byte-exact. The Lookup
    # says where it is (the cluster) and promotes nothing; the Get promotes it (from the records the Lookup
    # fetched: each chunk crosses the network once).
    started = time.perf_counter()
    looked = c["b", "alice"].lookup(SMALL, tokens)
    lookup_ms = (time.perf_counter() - started) * 1000
    assert looked.cached_tokens == 3 * CHUNK and [ch.tier for ch in looked.chunks] == ["cluster"] * 3
    assert metric(b, 'promptcache_entries{tier="device"}') == 0
    cached, got = c["b", "alice"].get(SMALL, tokens)
    assert cached == 3 * CHUNK
    for (k, v), (k2, v2) in zip(kv, got):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert metric(b, "promptcache_cluster_hits_total") == 3
    assert metric(b, 'promptcache_hit_tokens_total{rpc="lookup",tier="cluster"}') == 3 * CHUNK
    assert metric(b, 'promptcache_hit_tokens_total{rpc="get",tier="cluster"}') == 3 * CHUNK
    # Promoted: B's memory holds it now, and B did not publish it back.
    assert [ch.tier for ch in c["b", "alice"].lookup(SMALL, tokens).chunks] == ["device"] * 3
    assert metric(b, "promptcache_cluster_published_chunks_total") == 0
    print(f"cluster lookup of 3 chunks on node B (fetch, no promotion): {lookup_ms:.1f} ms")

    # The master dies: both nodes keep serving what they hold, and a new prefix is stored and served locally.
    master.kill()
    master.wait()
    for node in ("a", "b"):
        assert c[node, "alice"].lookup(SMALL, tokens).cached_tokens == 3 * CHUNK
        assert c[node, "alice"].get(SMALL, tokens)[0] == 3 * CHUNK
    fresh = _tokens(2, 2)
    started = time.perf_counter()
    assert c["b", "alice"].put(SMALL, fresh, make_kv(SMALL, len(fresh), seed=2)).stored_chunks == 2
    assert c["b", "alice"].get(SMALL, fresh)[0] == 2 * CHUNK
    assert c["a", "alice"].lookup(SMALL, fresh).cached_tokens == 0  # A cannot reach the cluster: a local miss
    assert time.perf_counter() - started < 5
    wait_until(lambda: sum(metric(n, f'promptcache_cluster_fallbacks_total{{op="{op}",reason="{r}"}}')
                           for n in (a, b) for op in ("get", "put") for r in ("error", "timeout", "down")) > 0,
               "fallbacks counted", 10)
    assert metric(a, "promptcache_cluster_up") == 0
    assert c["a", "alice"].lookup(SMALL, fresh).cached_tokens == 0
    assert metric(a, 'promptcache_cluster_fallbacks_total{op="get",reason="down"}') >= 1


@pytest.mark.slow  # two sidecar processes and a master: about 15 s here
def test_a_new_node_warms_its_memory_from_the_prefixes_its_peers_hold_hottest_before_it_is_ready(tmp_path, master):
    tokens, secret = _fleet_credentials(tmp_path)
    a = _node(tmp_path, "a", master[1], tokens, secret, "--cluster-hot-list-seconds", "0.2")
    c = None
    try:
        wait_until(lambda: metric(a, "promptcache_cluster_up") == 1, "A joining the cluster", 30)
        alice_a = PromptCacheClient(a.address, token="alice-token", retries=0, timeout=10)
        hot, cold = _tokens(5, 3), _tokens(6, 3)
        hot_kv = make_kv(SMALL, len(hot), seed=5)
        assert alice_a.put(SMALL, cold, make_kv(SMALL, len(cold), seed=6)).stored_chunks == 3
        assert alice_a.put(SMALL, hot, hot_kv).stored_chunks == 3
        for _ in range(3):  # the hot prefix is asked for again: A's hottest
            assert alice_a.get(SMALL, hot)[0] == 3 * CHUNK
        wait_until(lambda: metric(a, "promptcache_cluster_published_chunks_total") == 6, "A publishing 6 chunks", 10)
        published = metric(a, 'promptcache_cluster_hot_lists_total{outcome="published"}')
        wait_until(lambda: metric(a, 'promptcache_cluster_hot_lists_total{outcome="published"}') >= published + 2,
                   "A publishing its hot list after the Gets", 10)

        # Whatever else a slot holds is refused, counted, and changes nothing.
        from promptcache.sidecar import hotlist
        from promptcache.sidecar.cluster import MooncakeStore

        writer = MooncakeStore(master[1], "127.0.0.1", "tcp", 16 << 20, 8 << 20)
        writer.upsert(hotlist.slot_key((hotlist.slot_of("127.0.0.1") + 1) % hotlist.HOT_SLOTS), b"PCH1 forged")
        # Node C starts with room for 3 chunks and --warmup-seconds: ready only after it fetched A's hottest prefix.
        c = _node(tmp_path, "c", master[1], tokens, secret, "--memory-bytes", "12Ki",
                  "--warmup-seconds", "20")
        assert metric(c, 'promptcache_warmup_chunks_total{source="cluster"}') == 3
        assert metric(c, 'promptcache_cluster_hot_lists_total{outcome="read"}') >= 1
        assert metric(c, 'promptcache_cluster_hot_lists_total{outcome="malformed"}') == 1
        writer.close()
        alice_c = PromptCacheClient(c.address, token="alice-token", retries=0, timeout=10)
        assert [ch.tier for ch in alice_c.lookup(SMALL, hot).chunks] == ["device"] * 3  # warm before the first call
        cached, got = alice_c.get(SMALL, hot)
        assert cached == 3 * CHUNK
        for (k, v), (k2, v2) in zip(hot_kv, got):
            assert torch.equal(k, k2) and torch.equal(v, v2)
        assert metric(c, "promptcache_cluster_hits_total") == 0  # nothing fetched on a request's path
        # The colder prefix did not fit: it is still where it was, in the cluster; Bob's keys reach neither.
        assert [ch.tier for ch in alice_c.lookup(SMALL, cold).chunks] == ["cluster"] * 3
        bob_c = PromptCacheClient(c.address, token="bob-token", retries=0, timeout=10)
        assert bob_c.lookup(SMALL, hot).cached_tokens == 0
        for client in (alice_a, alice_c, bob_c):
            client.close()
    finally:
        for n in (a, c):
            if n is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGKILL)
                n.proc.wait()


def test_a_record_is_served_only_for_its_fingerprint_before_it_expires_and_with_its_bytes():
    from promptcache.sidecar.tiers import Record

    payload = np.arange(32, dtype=np.float32).view(np.uint8)  # float32 [2, 2, 2, 4, 1]: 128 bytes
    stored = Record(b"k" * 32, b"f" * 32, b"p" * 32, 3, 1, (2, 2, 2, 4, 1), checksum(payload), payload, ttl=100.0,
                    age=0.0)
    raw = encode_record(stored, now=900.0)  # expires at 1000 (Unix time), born at 900
    record = decode_record(raw, b"k" * 32, now=999.0)
    assert record.index == 3 and record.shape == (2, 2, 2, 4, 1) and bytes(record.payload) == payload.tobytes()
    assert (record.ttl, record.age) == (1.0, 99.0)
    assert verify(record, b"f" * 32) == ""
    assert verify(record, b"g" * 32) == "fingerprint"
    assert verify(decode_record(raw, b"k" * 32, now=1000.0), b"f" * 32) == "expired"
    corrupt = bytearray(raw)
    corrupt[-1] ^= 1
    assert verify(decode_record(bytes(corrupt), b"k" * 32, 999.0), b"f" * 32) == "checksum"
    assert decode_record(b"junk", b"k" * 32, 0) is None and verify(None, b"f" * 32) == "malformed"
    assert decode_record(b"XXXX" + raw[4:], b"k" * 32, 0) is None


def _forged(payload: bytes, dtype: int = 1, shape=(2, 2, 2, 4, 1), expires: float = 1000.0, born: float = 900.0):
    """A record another node could have written: its header says what it likes, its checksum matches."""
    import struct

    from promptcache.sidecar.cluster import _HEADER, MAGIC

    body = np.frombuffer(payload, dtype=np.uint8)
    return (_HEADER.pack(MAGIC, expires, born, b"f" * 32, b"p" * 32, 0, dtype, len(shape), checksum(body))
            + struct.pack(f"<{len(shape)}I", *shape) + payload)


def test_a_record_is_served_only_with_the_models_layout_finite_values_and_finite_times():
    from promptcache.contract.keys import ModelSpec
    from promptcache.sidecar.tiers.base import ChunkLayout

    spec = ModelSpec(model_id="m", revision="", kv_dtype="float32", num_layers=2, num_kv_heads=2, head_dim=1)
    layout = ChunkLayout.of(spec, 4)
    assert (layout.dtype, layout.shape, layout.nbytes, layout.scan) == (1, (2, 2, 2, 4, 1), 128, "float32")
    good = np.arange(32, dtype=np.float32).tobytes()
    nan = np.full(32, np.nan, dtype=np.float32).tobytes()
    inf = np.arange(32, dtype=np.float32)
    inf[7] = np.inf
    cases = {
        "control": (_forged(good), ""),
        "NaN values, the right size": (_forged(nan), "nonfinite"),
        "an Inf among them": (_forged(inf.tobytes()), "nonfinite"),
        "7 bytes, shape [7], dtype 99": (_forged(b"garbage", dtype=99, shape=(7,)), "layout"),
        "twice the size": (_forged(good + good), "layout"),
        "another dtype (same bytes)": (_forged(good, dtype=2, shape=(2, 2, 2, 8, 1)), "layout"),
        "another shape (same bytes)": (_forged(good, shape=(1, 2, 4, 4, 1)), "layout"),
        "NaN expiry": (_forged(good, expires=float("nan")), "malformed"),
        "infinite expiry": (_forged(good, expires=float("inf")), "malformed"),
        "NaN birth": (_forged(good, born=float("nan")), "malformed"),
    }
    for what, (raw, why) in cases.items():
        assert verify(decode_record(raw, b"k" * 32, 999.0), b"f" * 32, layout) == why, what
    # Without the model's layout (warm-up): the record's own header must describe a chunk, its values finite.
    alone = {"control": "", "NaN values, the right size": "nonfinite", "7 bytes, shape [7], dtype 99": "layout",
             "twice the size": "layout", "another shape (same bytes)": "", "NaN expiry": "malformed"}
    for what, why in alone.items():
        assert verify(decode_record(cases[what][0], b"k" * 32, 999.0), b"f" * 32) == why, what
    # A quantized chunk's packed size is a chunk's too (its codes are checked where they are unpacked).
    from promptcache import codec

    packed = codec.packed_nbytes("k8v8", (2, 2, 2, 4, 2), "float16")
    assert verify(decode_record(_forged(bytes(packed), dtype=2, shape=(2, 2, 2, 4, 2)), b"k" * 32, 999.0),
                  b"f" * 32) == ""


def test_fleet_simulation_a_shared_tier_and_prefix_routing_each_raise_the_hit_ratio():
    from promptcache_devtools.bench import traces
    from promptcache_devtools.bench.cluster import simulate
    from promptcache_devtools.bench.replay import prepare

    reqs, ws = prepare(traces.generate("chat", seed=1, scale=0.2))
    node, shared = int(ws * 0.05), int(ws * 0.25)
    alone, _ = simulate(reqs, 4, node, 0, "random", "lru", 0)
    with_cluster, served = simulate(reqs, 4, node, shared, "random", "lru", 0)
    twice, _ = simulate(reqs, 4, node, shared, "random", "lru", 0, publish_after=2)
    routed, _ = simulate(reqs, 4, node, 0, "prefix", "lru", 0)
    assert alone < twice < with_cluster and served > 0.05
    assert alone < routed


class _StalledStore:
    """A ClusterStore whose calls take longer than any deadline (a master that stopped answering)."""

    def __init__(self):
        self.calls = 0

    def get(self, key):
        self.calls += 1
        time.sleep(1.0)

    def put(self, key, value):
        self.calls += 1
        time.sleep(1.0)

    def close(self):
        pass


def test_a_slow_cluster_costs_one_deadline_then_is_skipped_until_the_retry_time():
    from prometheus_client import CollectorRegistry

    from promptcache.sidecar.cluster import ClusterMetrics, ClusterTier

    store = _StalledStore()
    registry = CollectorRegistry()
    metrics = ClusterMetrics(registry)
    tier = ClusterTier(lambda: store, metrics, timeout_seconds=0.05, retry_seconds=30, queue_chunks=2,
                       max_record_bytes=1 << 20).start()
    try:
        assert tier.wait_joined(5)
        started = time.perf_counter()
        assert tier.fetch(b"k" * 32, b"f" * 32) is None
        assert time.perf_counter() - started < 0.5
        assert tier.fetch(b"k" * 32, b"f" * 32) is None  # marked down: not asked at all
        assert store.calls == 1
        sample = registry.get_sample_value
        assert sample("promptcache_cluster_fallbacks_total", {"op": "get", "reason": "timeout"}) == 1
        assert sample("promptcache_cluster_fallbacks_total", {"op": "get", "reason": "down"}) == 1
        assert sample("promptcache_cluster_up") == 0
        tier.publish(b"k" * 32, lambda: b"record")  # while down: dropped at once, never queued
        assert sample("promptcache_cluster_publish_dropped_total", {"reason": "down"}) == 1
    finally:
        tier.close()


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [("--tenant-quota-bytes", "4096")], indirect=True)  # one chunk of SMALL
def test_cluster_promotions_count_against_the_tenants_quota(nodes):
    """Like a disk promotion (issue 17, item 10), a chunk fetched from the cluster is charged to its owner: alice's
    three chunks from node A are served on node B, but B keeps at most her one-chunk quota of them in memory."""
    _, a, b, c = nodes
    tokens = _tokens(7, 3)
    assert c["a", "alice"].put(SMALL, tokens, make_kv(SMALL, len(tokens))).stored_chunks == 3
    wait_until(lambda: metric(a, "promptcache_cluster_published_chunks_total") == 3, "A publishing 3 chunks", 10)
    for _ in range(2):
        cached, _got = c["b", "alice"].get(SMALL, tokens)
        assert cached == 3 * CHUNK  # served: the ones over quota from the cluster's copy, uncached
        # B holds only alice's chunks: the store itself (not only her accounting) stays within her quota.
        assert metric(b, 'promptcache_entries{tier="device"}') <= 1
        assert metric(b, 'promptcache_tenant_stored_bytes{owner="alice"}') <= 4096


# --- master HA: two masters behind a real etcd ---------------------------------------------------------------------

HA_CLUSTER_ID = "promptcache-test"


def etcd_binary() -> str:
    """The etcd that hack/tools/build.sh builds for the operator tests."""
    out = subprocess.run(["bash", str(Path(__file__).parents[1] / "hack" / "tools" / "build.sh"), "--print-dir",
                          "etcd"], check=True, capture_output=True, text=True).stdout
    path = out.strip().split("=", 1)[1]
    if not os.access(path, os.X_OK):
        pytest.fail(f"no etcd at {path}: build it first with bash hack/tools/build.sh etcd", pytrace=False)
    return path


def _ha_master(tmp_path, name: str, etcd: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen([mooncake_master_binary(), "-enable_ha=true", f"-etcd_endpoints={etcd}",
                             f"-cluster_id={HA_CLUSTER_ID}", "-rpc_address=127.0.0.1", f"-rpc_port={free_port()}",
                             f"-metrics_port={free_port()}", "-metrics_host=127.0.0.1"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, log


def _serving(log: Path) -> bool:
    return "Master runtime state -> serving" in log.read_text(errors="replace")


@pytest.fixture
def ha_masters(tmp_path):
    """A one-member etcd and two Mooncake masters in HA mode: the first is the leader, the second a standby."""
    client, peer = free_port(), free_port()
    etcd = subprocess.Popen([etcd_binary(), "--data-dir", str(tmp_path / "etcd"), "--name", "test",
                             "--listen-client-urls", f"http://127.0.0.1:{client}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"test=http://127.0.0.1:{peer}",
                             "--unsafe-no-fsync", "--log-level", "warn"],
                            stdout=open(tmp_path / "etcd.log", "w"), stderr=subprocess.STDOUT)
    procs = [etcd]
    try:
        wait_until(lambda: _accepts(client), "etcd listening", timeout=20)
        leader, leader_log = _ha_master(tmp_path, "master1", f"127.0.0.1:{client}")
        procs.append(leader)
        wait_until(lambda: _serving(leader_log), "the first master leading", timeout=30)  # after a 5 s warmup
        standby, standby_log = _ha_master(tmp_path, "master2", f"127.0.0.1:{client}")
        procs.append(standby)
        wait_until(lambda: "role=standby" in standby_log.read_text(errors="replace"), "a standby master", 20)
        yield f"etcd://127.0.0.1:{client}", leader, standby_log
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow  # etcd, two masters, a failover (about 11 s in Mooncake 0.3.13) and two sidecars: about 45 s here
def test_when_the_leader_master_dies_the_standby_takes_over_and_the_nodes_share_chunks_again(tmp_path, ha_masters):
    address, leader, standby_log = ha_masters
    tokens, secret = _fleet_credentials(tmp_path, ("alice",))
    # A short retry: the tier is asked again soon after the failover. WARNING and up from Mooncake's own logging.
    flags = ("--cluster-id", HA_CLUSTER_ID, "--cluster-retry-seconds", "1", "--cluster-timeout-seconds", "1")
    a, b = (_node(tmp_path, name, address, tokens, secret, *flags, env={"GLOG_minloglevel": "1"})
            for name in ("a", "b"))
    ca, cb = (PromptCacheClient(n.address, token="alice-token", retries=0, timeout=10) for n in (a, b))
    try:
        for n in (a, b):
            wait_until(lambda n=n: metric(n, "promptcache_cluster_up") == 1, "a sidecar joining the cluster", 30)
        tokens1 = _tokens(11, 3)
        kv1 = make_kv(SMALL, len(tokens1))
        assert ca.put(SMALL, tokens1, kv1).stored_chunks == 3
        wait_until(lambda: metric(a, "promptcache_cluster_published_chunks_total") == 3, "A publishing", 10)
        assert cb.lookup(SMALL, tokens1).cached_tokens == 3 * CHUNK
        assert metric(b, "promptcache_cluster_hits_total") == 3

        # The leader dies. Until the standby leads, no master answers: both nodes serve locally, counted.
        leader.kill()
        leader.wait()
        killed = time.monotonic()
        for client in (ca, cb):
            assert client.get(SMALL, tokens1)[0] == 3 * CHUNK
        fresh = _tokens(12, 2)
        assert cb.put(SMALL, fresh, make_kv(SMALL, len(fresh), seed=12)).stored_chunks == 2
        assert cb.get(SMALL, fresh)[0] == 2 * CHUNK
        wait_until(lambda: sum(metric(n, f'promptcache_cluster_fallbacks_total{{op="{op}",reason="{r}"}}')
                               for n in (a, b) for op in ("get", "put") for r in ("error", "timeout", "down")) > 0,
                   "fallbacks counted", 15)

        # The standby takes over; a prefix stored through A after that is a cluster hit on B again, byte-exact.
        wait_until(lambda: _serving(standby_log), "the standby leading", 60)
        published = metric(a, "promptcache_cluster_published_chunks_total")
        seed = 100

        def a_publishes_a_new_prefix() -> bool:
            nonlocal seed
            seed += 1
            assert ca.put(SMALL, _tokens(seed, 2), make_kv(SMALL, 2 * CHUNK, seed=seed)).stored_chunks == 2
            time.sleep(0.5)
            return metric(a, "promptcache_cluster_published_chunks_total") >= published + 2

        wait_until(a_publishes_a_new_prefix, "A publishing through the new leader", 60)
        after = _tokens(seed, 2)
        hits = metric(b, "promptcache_cluster_hits_total")
        wait_until(lambda: cb.lookup(SMALL, after).cached_tokens == 2 * CHUNK, "B finding A's new prefix", 30)
        failover_s = time.monotonic() - killed
        cached, got = cb.get(SMALL, after)
        assert cached == 2 * CHUNK
        for (k, v), (k2, v2) in zip(make_kv(SMALL, 2 * CHUNK, seed=seed), got):
            assert torch.equal(k, k2) and torch.equal(v, v2)
        assert metric(b, "promptcache_cluster_hits_total") == hits + 2
        assert metric(b, "promptcache_cluster_up") == 1
        print(f"leader killed -> cluster hits on B again after {failover_s:.1f} s")
    finally:
        for c in (ca, cb):
            c.close()
        for n in (a, b):
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGKILL)
                n.proc.wait()


def _plain_node(tmp_path, name: str, master: str, *extra: str) -> SidecarProcess:
    """A node without authentication: every chunk is the shared namespace's."""
    data = tmp_path / name
    data.mkdir()
    return SidecarProcess("--chunk-tokens", str(CHUNK), "--memory-bytes", "8Mi", "--data-dir", str(data),
                          "--cluster-master", master, "--cluster-local-hostname", "127.0.0.1",
                          "--cluster-segment-bytes", "32Mi", "--cluster-buffer-bytes", "8Mi",
                          "--cluster-retry-seconds", "30", "--log-format", "text", *extra).wait_ready()


def _write_forged(writer, fp: bytes, key: bytes, payload: bytes, dtype: int, shape, expires: float) -> None:
    """What a node whose sidecar is broken or hostile could write under a valid key: a header of its choosing and
    a matching checksum."""
    import struct

    from promptcache.sidecar.cluster import _HEADER, MAGIC, store_key

    header = _HEADER.pack(MAGIC, expires, time.time(), fp, bytes(32), 0, dtype, len(shape),
                          checksum(np.frombuffer(payload, dtype=np.uint8)))
    writer.put(store_key(key), header + struct.pack(f"<{len(shape)}I", *shape) + payload)


@pytest.mark.slow  # a sidecar process and a master: about 10 s here
def test_forged_cluster_records_of_the_wrong_layout_values_or_times_are_refused_and_counted(tmp_path, master):
    from promptcache.contract import keys as keyspec
    from promptcache.contract.layout import chunk_nbytes, chunk_shape
    from promptcache.sidecar.cluster import MooncakeStore

    b = _plain_node(tmp_path, "b", master[1])
    writer = MooncakeStore(master[1], "127.0.0.1", "tcp", 16 << 20, 8 << 20)
    client = PromptCacheClient(b.address, retries=0, timeout=10)
    try:
        wait_until(lambda: metric(b, "promptcache_cluster_up") == 1, "B joining the cluster", 30)
        # A Put tells B the model's layout (TierStack.layout_of), as a request resolving the model does where the
        # engine notes it: a record whose bytes would be a chunk of another shape is then refused too.
        assert client.put(SMALL, _tokens(99, 1), make_kv(SMALL, CHUNK)).stored_chunks == 1
        fp, shape, n = keyspec.fingerprint(SMALL), chunk_shape(SMALL, CHUNK), chunk_nbytes(SMALL, CHUNK)
        dtype = 2 if SMALL.kv_dtype == "float16" else 1
        item = np.dtype(SMALL.kv_dtype)
        good = np.random.default_rng(0).standard_normal(n // item.itemsize).astype(item).tobytes()
        cases = {  # what: (payload, dtype, shape, expires, the reason counted)
            "control": (good, dtype, shape, time.time() + 3600, None),
            "NaN values": (np.full(n // item.itemsize, np.nan, item).tobytes(), dtype, shape, time.time() + 3600,
                           "nonfinite"),
            "7 bytes, shape [7], dtype 99": (b"garbage", 99, (7,), time.time() + 3600, "layout"),
            "twice the size": (good + good, dtype, shape, time.time() + 3600, "layout"),
            "the model's bytes, another shape": (good, dtype, (shape[0], shape[1] * shape[2], 1, *shape[3:]),
                                                 time.time() + 3600, "layout"),
            "NaN expiry": (good, dtype, shape, float("nan"), "malformed"),
        }
        for seed, (what, (payload, dt, shp, expires, why)) in enumerate(cases.items(), start=1):
            tokens = _tokens(100 + seed, 1)
            key = keyspec.chunk_keys(fp, tokens, CHUNK)[0]
            _write_forged(writer, fp, key, payload, dt, shp, expires)
            before = metric(b, f'promptcache_cluster_rejected_total{{reason="{why}"}}') if why else 0
            looked = client.lookup(SMALL, tokens)
            blobs = client.get_blobs(SMALL, tokens)
            if why is None:
                assert looked.cached_tokens == CHUNK and len(blobs) == 1, what
                assert bytes(blobs[0].numpy().tobytes()) == payload, what
                continue
            assert looked.cached_tokens == 0 and blobs == [], what
            assert metric(b, f'promptcache_cluster_rejected_total{{reason="{why}"}}') >= before + 1, what
            assert [ch.tier for ch in client.lookup(SMALL, tokens).chunks] == [], what  # nothing was promoted
        assert metric(b, 'promptcache_entries{tier="device"}') == 2  # the Put's chunk and the control only
    finally:
        client.close()
        writer.close()
        if b.proc.poll() is None:
            b.proc.send_signal(signal.SIGKILL)
            b.proc.wait()


@pytest.mark.slow  # a sidecar process and a master: about 10 s here
def test_a_forged_hot_list_warms_no_unknown_owner_no_bad_chunk_and_no_inflated_hits(tmp_path, master):
    from promptcache.contract import keys as keyspec
    from promptcache.contract.layout import chunk_nbytes, chunk_shape
    from promptcache.sidecar import hotlist
    from promptcache.sidecar.cluster import MooncakeStore

    tokens_dir, secret = _fleet_credentials(tmp_path)
    writer = MooncakeStore(master[1], "127.0.0.1", "tcp", 16 << 20, 8 << 20)
    c = None
    try:
        fp, shape, n = keyspec.fingerprint(SMALL), chunk_shape(SMALL, CHUNK), chunk_nbytes(SMALL, CHUNK)
        dtype = 2 if SMALL.kv_dtype == "float16" else 1
        item = np.dtype(SMALL.kv_dtype)
        good = np.random.default_rng(1).standard_normal(n // item.itemsize).astype(item).tobytes()
        later = time.time() + 3600
        entries = []
        for i, (payload, dt, shp, expires, owner) in enumerate([
                (good, dtype, shape, later, ""),  # the one chunk warmed
                (good, dtype, shape, later, 'x"} injected_metric{a="1"} 1'),  # an owner nobody configured
                (good, dtype, shape, later, "group:nobody"),  # a group that is not configured
                (b"\x01", 1, (1,), later, "alice"),  # a real tenant charged for a byte that is no chunk
                (np.full(n // item.itemsize, np.nan, item).tobytes(), dtype, shape, later, ""),
                (good, dtype, shape, float("nan"), "")]):
            key = keyspec.chunk_keys(fp, _tokens(200 + i, 1), CHUNK)[0]
            _write_forged(writer, fp, key, payload, dt, shp, expires)
            entries.append(hotlist.HotEntry(key, fp, owner, 0xFFFFFFFF))
        writer.upsert(hotlist.slot_key(3), hotlist.encode(entries, time.time()))
        c = _node(tmp_path, "c", master[1], tokens_dir, secret, "--warmup-seconds", "20")
        assert metric(c, 'promptcache_warmup_chunks_total{source="cluster"}') == 1
        assert metric(c, 'promptcache_entries{tier="device"}') == 1
        assert metric(c, 'promptcache_cluster_rejected_total{reason="layout"}') == 1
        assert metric(c, 'promptcache_cluster_rejected_total{reason="nonfinite"}') == 1
        assert metric(c, 'promptcache_cluster_rejected_total{reason="malformed"}') == 1
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=10).read().decode()
        owners = [line for line in text.splitlines() if line.startswith("promptcache_tenant_stored_bytes{")]
        assert all('owner=""' in line for line in owners), owners  # nobody was charged but the shared namespace
        assert "injected_metric" not in text
    finally:
        writer.close()
        if c is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGKILL)
            c.proc.wait()
