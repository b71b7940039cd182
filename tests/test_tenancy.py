"""Tenant isolation: with auth on, neither the content nor the existence of another tenant's chunks is
observable — not through results, status codes or timing — except through opt-in sharing groups; per-tenant
quotas evict only the tenant's own chunks."""
from __future__ import annotations

import os

import dataclasses
import random
import time

import grpc
import pytest
import torch

from support import CHUNK, SMALL, make_kv
from promptcache.client import PromptCacheClient, errors
from promptcache.contract.layout import chunk_nbytes
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import model_to_proto
from test_auth import write_secret_dir

NBYTES = chunk_nbytes(SMALL, CHUNK)
TENANTS = ("alice", "bob", "carol", "ops")


@pytest.fixture
def tokens(tmp_path):
    d = tmp_path / "tokens"
    write_secret_dir(d, {t: f"{t}-token" for t in TENANTS})
    return str(d)


@pytest.fixture
def multi(sidecar_factory, tokens):
    sidecar = sidecar_factory(token_file=tokens, sharing_groups="public=*;team=alice,bob", admin_tenants="ops")
    clients = {t: PromptCacheClient(sidecar.address, token=f"{t}-token", retries=0, timeout=10) for t in TENANTS}
    yield sidecar, clients
    for c in clients.values():
        c.close()


def prefix(seed: int, chunks: int = 2) -> list[int]:
    return [seed * 100_000 + i for i in range(chunks * CHUNK)]


def test_another_tenants_chunks_are_invisible(multi):
    sidecar, c = multi
    alice, bob = c["alice"], c["bob"]
    tokens = prefix(1, 3)
    kv = make_kv(SMALL, len(tokens))
    assert alice.put(SMALL, tokens, kv).stored_chunks == 3
    fresh = prefix(2, 3)
    # Whatever salt bob sends (none, alice's, random), he sees a plain miss: same result, same status.
    for salt in (b"", b"alice", b"\x00" * 32):
        spec = dataclasses.replace(SMALL, tenant_salt=salt)
        assert bob.lookup(spec, tokens).cached_tokens == bob.lookup(spec, fresh).cached_tokens == 0
        assert bob.get_blobs(spec, tokens) == bob.get_blobs(spec, fresh) == []
        assert bob.delete(spec, tokens) == bob.delete(spec, fresh) == 0
    # Bob's Put of the same prefix is stored as his own (not "skipped": that would reveal alice's copy).
    r = bob.put(SMALL, tokens, make_kv(SMALL, len(tokens), seed=9))
    assert (r.stored_chunks, r.skipped_chunks) == (3, 0)
    assert bob.purge(SMALL) == (3, 3 * NBYTES)  # only his own
    cached, got = alice.get(SMALL, tokens)
    assert cached == 3 * CHUNK and all((g[0] == k[0]).all() and (g[1] == k[1]).all() for g, k in zip(got, kv))
    # Stats of a tenant show its own usage only; whole-cache Stats and Resize are for admin tenants.
    assert bob.stats().tiers[0].entries == 0 and alice.stats().tiers[0].entries == 3
    assert c["ops"].stats().tiers[0].entries == 3
    with pytest.raises(errors.PermissionDenied):
        alice.resize(4 << 20)
    assert c["ops"].resize(16 << 20).memory_bytes == 16 << 20


def test_shared_tenancy_with_authentication(sidecar_factory, tokens):
    """--tenancy shared (the operator's spec.tenancy.mode Shared): callers still authenticate, admin-only calls
    stay admin-only, but every tenant reuses every other tenant's prefixes."""
    sidecar = sidecar_factory(token_file=tokens, tenancy="shared", admin_tenants="ops")
    with PromptCacheClient(sidecar.address, token="alice-token", retries=0) as alice, \
            PromptCacheClient(sidecar.address, token="bob-token", retries=0) as bob, \
            PromptCacheClient(sidecar.address, retries=0) as nobody:
        tokens_ = prefix(7, 2)
        kv = make_kv(SMALL, len(tokens_))
        assert alice.put(SMALL, tokens_, kv).stored_chunks == 2
        cached, got = bob.get(SMALL, tokens_)
        assert cached == 2 * CHUNK and all(torch.equal(g[0], k[0]) for g, k in zip(got, kv))
        assert bob.put(SMALL, tokens_, kv).skipped_chunks == 2
        with pytest.raises(errors.Unauthenticated):
            nobody.lookup(SMALL, tokens_)
        with pytest.raises(errors.PermissionDenied):
            bob.resize(16 << 20)


def test_isolated_tenancy_needs_authentication(sidecar_factory):
    with pytest.raises(ValueError, match="--tenancy isolated needs authentication"):
        sidecar_factory(tenancy="isolated")


def test_quantization_setting_refuses_other_modes(sidecar_factory):
    sidecar = sidecar_factory(quantization="k8v4")
    k8v4 = dataclasses.replace(SMALL, kv_dtype="float16", quantization="k8v4")
    with PromptCacheClient(sidecar.address, retries=0) as c:
        assert c.lookup(k8v4, prefix(1)).cached_tokens == 0
        with pytest.raises(errors.FailedPrecondition, match="keeps k8v4 chunks only"):
            c.lookup(SMALL, prefix(1))
        with pytest.raises(errors.FailedPrecondition, match="--quantization"):
            c.put(SMALL, prefix(1), make_kv(SMALL, 2 * CHUNK))


def test_sharing_groups_are_opt_in(multi):
    _, c = multi
    public = dataclasses.replace(SMALL, tenant_salt=b"share:public")
    team = dataclasses.replace(SMALL, tenant_salt=b"share:team")
    tokens = prefix(3)
    assert c["alice"].put(public, tokens, make_kv(SMALL, len(tokens))).stored_chunks == 2
    assert c["carol"].lookup(public, tokens).cached_tokens == 2 * CHUNK  # public=*: everyone
    assert c["carol"].lookup(SMALL, tokens).cached_tokens == 0           # not without opting in
    assert c["alice"].lookup(SMALL, tokens).cached_tokens == 0           # alice's own namespace is separate
    c["bob"].put(team, tokens, make_kv(SMALL, len(tokens)))
    assert c["alice"].lookup(team, tokens).cached_tokens == 2 * CHUNK
    with pytest.raises(errors.PermissionDenied, match="not a member of sharing group 'team'"):
        c["carol"].lookup(team, tokens)
    with pytest.raises(errors.PermissionDenied):
        c["carol"].lookup(dataclasses.replace(SMALL, tenant_salt=b"share:nonexistent"), tokens)


def test_quota_evicts_only_the_tenants_own_chunks(sidecar_factory, tokens):
    sidecar = sidecar_factory(token_file=tokens, tenant_quota_bytes=3 * NBYTES,
                              tenant_quotas=f"carol={NBYTES // 2}", admin_tenants="ops")
    with PromptCacheClient(sidecar.address, token="alice-token") as alice, \
            PromptCacheClient(sidecar.address, token="bob-token") as bob, \
            PromptCacheClient(sidecar.address, token="carol-token", retries=0) as carol:
        bob_tokens = prefix(10, 2)
        bob.put(SMALL, bob_tokens, make_kv(SMALL, len(bob_tokens)))
        for seed in range(5):
            t = prefix(20 + seed, 2)
            assert alice.put(SMALL, t, make_kv(SMALL, len(t), seed=seed)).stored_chunks == 2
            own = alice.stats().tiers[0]
            assert own.bytes_used <= 3 * NBYTES and own.bytes_budget == 3 * NBYTES
        # Alice's newest prefix is cached; her oldest were evicted; bob's are untouched.
        assert alice.lookup(SMALL, prefix(24, 2)).cached_tokens == 2 * CHUNK
        assert alice.lookup(SMALL, prefix(20, 2)).cached_tokens == 0
        assert bob.lookup(SMALL, bob_tokens).cached_tokens == 2 * CHUNK
        with pytest.raises(errors.ResourceExhausted, match="exceeds the quota"):
            carol.put(SMALL, bob_tokens, make_kv(SMALL, len(bob_tokens)))
        assert sidecar.tenancy.usage("alice")["used"] == 3 * NBYTES
        # Accounting agrees with the store: the tenants' charges add up to the bytes it holds.
        total = sum(u["used"] for u in sidecar.tenancy.owners().values())
        assert total == sidecar.tier.usage()["used"]
        assert all(u["reserved"] == 0 for u in sidecar.tenancy.owners().values())


def _ks(a: list[float], b: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: max |F_a - F_b|; 0.5 + D/2 is the accuracy of the best
    threshold classifier an attacker could build from one latency."""
    xs = sorted(set(a) | set(b))
    a, b = sorted(a), sorted(b)
    import bisect

    return max(abs(bisect.bisect_right(a, x) / len(a) - bisect.bisect_right(b, x) / len(b)) for x in xs)


def _latencies(stub, token, model, targets, kinds, rpc):
    out = {k: [] for k in set(kinds)}
    md = [("authorization", f"Bearer {token}")]
    for kind, tokens in zip(kinds, targets):
        if rpc == "lookup":
            req = pb.LookupRequest(model=model, tokens=tokens)
            t0 = time.perf_counter()
            stub.Lookup(req, metadata=md, timeout=10)
        else:
            req = pb.GetRequest(model=model, tokens=tokens)
            t0 = time.perf_counter()
            list(stub.Get(req, metadata=md, timeout=10))
        out[kind].append(time.perf_counter() - t0)
    return out


@pytest.mark.timeout(300)
def test_no_timing_channel_across_tenants(multi):
    """Bob times Lookup and Get of prefixes alice cached against prefixes nobody cached, interleaved at random.
    The two latency distributions must be indistinguishable (KS distance below 0.2: an attacker's best
    single-sample guess is right at most 60% of the time), while the same measurement on his own cached
    prefixes (the positive control: a shared cache) tells them apart."""
    sidecar, c = multi
    n, chunks = 250, 16
    cached = [prefix(1000 + i, chunks) for i in range(20)]
    for t in cached:
        c["alice"].put(SMALL, t, make_kv(SMALL, len(t)))
        c["bob"].put(dataclasses.replace(SMALL, tenant_salt=b"bob-own"), t, make_kv(SMALL, len(t)))
    rng = random.Random(7)
    model = model_to_proto(SMALL)
    own = model_to_proto(dataclasses.replace(SMALL, tenant_salt=b"bob-own"))
    results = {}
    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.KVCacheStub(ch)
        _latencies(stub, "bob-token", model, cached[:5], ["w"] * 5, "lookup")  # warm-up
        for rpc in ("lookup", "get"):
            kinds = [rng.choice(("other", "fresh")) for _ in range(2 * n)]
            targets = [rng.choice(cached) if k == "other" else prefix(5000 + i, chunks) for i, k in enumerate(kinds)]
            lat = _latencies(stub, "bob-token", model, targets, kinds, rpc)
            results[rpc] = _ks(lat["other"], lat["fresh"])
            # Positive control: the same measurement where the prefixes are in bob's own namespace.
            ctrl = _latencies(stub, "bob-token", own, targets, kinds, rpc)
            results[rpc + "-control"] = _ks(ctrl["other"], ctrl["fresh"])
    print("KS distances:", {k: round(v, 3) for k, v in results.items()})
    assert results["lookup"] < 0.2 and results["get"] < 0.2, results
    assert results["get-control"] > 0.5, results  # the method detects a real hit/miss difference


def test_tenant_metrics(multi):
    sidecar, c = multi
    tokens = prefix(77)
    c["alice"].put(SMALL, tokens, make_kv(SMALL, len(tokens)))
    c["bob"].put(dataclasses.replace(SMALL, tenant_salt=b"share:public"), tokens, make_kv(SMALL, len(tokens)))
    from prometheus_client import generate_latest

    text = generate_latest(sidecar.metrics.registry).decode()
    assert f'promptcache_tenant_stored_bytes{{owner="alice"}} {float(2 * NBYTES)}' in text
    assert f'promptcache_tenant_entries{{owner="group:public"}} 2.0' in text


def test_chunks_promoted_from_disk_count_against_the_quota(sidecar_factory, tokens, tmp_path):
    """A tenant cannot hold more memory than its quota by letting its chunks spill and reading them back."""
    quota = 2 * NBYTES
    sidecar = sidecar_factory(token_file=tokens, tenant_quotas=f"alice={quota}", memory_bytes=6 * NBYTES,
                              disk_bytes=64 << 20, data_dir=str(tmp_path / "data"), eviction_policy="lru",
                              admin_tenants="ops")
    with PromptCacheClient(sidecar.address, token="alice-token") as alice, \
            PromptCacheClient(sidecar.address, token="bob-token") as bob:
        first, second = prefix(30, 2), prefix(31, 2)
        kv_first = make_kv(SMALL, len(first), seed=30)
        assert alice.put(SMALL, first, kv_first).stored_chunks == 2
        alice_fps = {e.fingerprint for e in sidecar.tier._entries.values()}

        def alice_in_memory() -> int:
            """Bytes the memory tier holds under alice's namespace, counted from the store itself."""
            return sum(e.accounted for e in list(sidecar.tier._entries.values()) if e.fingerprint in alice_fps)

        for seed in range(3):  # bob fills memory: alice's chunks are demoted to disk by capacity
            t = prefix(40 + seed, 2)
            bob.put(SMALL, t, make_kv(SMALL, len(t), seed=40 + seed))
        assert sidecar.spill.disk.flush(10)
        assert [ch.tier for ch in alice.lookup(SMALL, first).chunks] == ["disk", "disk"]
        assert alice.put(SMALL, second, make_kv(SMALL, len(second), seed=31)).stored_chunks == 2
        assert alice_in_memory() == quota
        # Reading the spilled prefix back: served exactly, but not promoted past the quota.
        cached, got = alice.get(SMALL, first)
        assert cached == 2 * CHUNK
        assert all(torch.equal(g[0], k[0]) and torch.equal(g[1], k[1]) for g, k in zip(got, kv_first))
        assert alice_in_memory() <= quota
        assert sidecar.tenancy.usage("alice")["used"] == alice_in_memory()
        assert alice.stats().tiers[0].bytes_used <= quota
        assert [ch.tier for ch in alice.lookup(SMALL, first).chunks] == ["disk", "disk"]  # still on disk
        # With room in the quota a promotion happens, and it is charged.
        assert alice.delete(SMALL, second) == 2
        assert alice.get(SMALL, first)[0] == 2 * CHUNK
        assert [ch.tier for ch in alice.lookup(SMALL, first).chunks] == ["device", "device"]
        assert sidecar.tenancy.usage("alice")["used"] == alice_in_memory() == quota
        # ... and counts as hers: her next Put evicts her own chunks to stay within the quota.
        assert alice.put(SMALL, second, make_kv(SMALL, len(second), seed=31)).stored_chunks == 2
        assert sidecar.tenancy.usage("alice")["used"] == alice_in_memory() == quota
        total = sum(u["used"] for u in sidecar.tenancy.owners().values())
        assert total == sidecar.tier.usage()["used"]


def test_warm_up_charges_each_chunk_to_its_recorded_owner_within_the_quota(sidecar_factory, tokens, tmp_path):
    """Warm-up has no caller: each chunk it brings back from disk is charged to the owner its disk record names
    (index version 2), within that owner's quota (never evicting), and stays in its owner's namespace."""
    data = str(tmp_path / "data")
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))  # the same tenant salts after the restart
    common = dict(token_file=tokens, tenant_secret_file=str(secret), memory_bytes=16 * NBYTES,
                  disk_bytes=64 << 20, data_dir=data)
    first = sidecar_factory(**common)
    mine, theirs = prefix(50, 3), prefix(51, 2)
    kv = make_kv(SMALL, len(mine), seed=50)
    with PromptCacheClient(first.address, token="alice-token") as alice, \
            PromptCacheClient(first.address, token="bob-token") as bob:
        assert alice.put(SMALL, mine, kv).stored_chunks == 3
        assert bob.put(SMALL, theirs, make_kv(SMALL, len(theirs), seed=51)).stored_chunks == 2
    first.stop()  # graceful: everything is demoted with its owner
    second = sidecar_factory(**common, tenant_quotas=f"alice={2 * NBYTES}", warmup_seconds=30.0)
    assert second.warmup.ready.wait(30)
    assert second.warmup.report["disk_chunks"] == 4  # bob's 2, alice's first 2: her quota holds no more
    assert second.tenancy.usage("alice")["used"] == 2 * NBYTES
    assert second.tenancy.usage("bob")["used"] == 2 * NBYTES
    with PromptCacheClient(second.address, token="alice-token") as alice, \
            PromptCacheClient(second.address, token="bob-token") as bob:
        assert [ch.tier for ch in alice.lookup(SMALL, mine).chunks] == ["device", "device", "disk"]
        assert [ch.tier for ch in bob.lookup(SMALL, theirs).chunks] == ["device", "device"]
        assert bob.lookup(SMALL, mine).cached_tokens == 0  # still alice's namespace only
        cached, got = alice.get(SMALL, mine)
    assert cached == 3 * CHUNK
    assert all(torch.equal(g[0], k[0]) and torch.equal(g[1], k[1]) for g, k in zip(got, kv))


def test_pins_are_bounded_per_tenant_and_a_quota_evicts_the_unpinned_first(sidecar_factory, tokens):
    """A priority hint pins within --max-pinned-fraction of the tenant's quota; the pinned chunks count in the
    quota, and the quota's own evictions take the tenant's unpinned chunks first."""
    sidecar = sidecar_factory(token_file=tokens, tenant_quotas=f"alice={4 * NBYTES}", memory_bytes=16 * NBYTES,
                              max_pinned_fraction=0.5)
    system = prefix(60, 2)
    kv = make_kv(SMALL, len(system), seed=60)
    with PromptCacheClient(sidecar.address, token="alice-token") as alice, \
            PromptCacheClient(sidecar.address, token="bob-token") as bob:
        assert alice.put(SMALL, system, kv, priority=1).stored_chunks == 2
        other = prefix(61, 3)
        alice.put(SMALL, other, make_kv(SMALL, len(other), seed=61), priority=1)  # past her 2-chunk pin bound
        assert sidecar.tier.pinned_usage() == {"alice": 2 * NBYTES}
        for seed in range(62, 66):  # her quota (4 chunks) evicts: never the pinned pair
            t = prefix(seed, 2)
            alice.put(SMALL, t, make_kv(SMALL, len(t), seed=seed))
        assert sidecar.tenancy.usage("alice")["used"] <= 4 * NBYTES
        cached, got = alice.get(SMALL, system)
        assert cached == 2 * CHUNK
        assert all(torch.equal(g[0], k[0]) and torch.equal(g[1], k[1]) for g, k in zip(got, kv))
        theirs = prefix(70, 2)
        bob.put(SMALL, theirs, make_kv(SMALL, len(theirs), seed=70), priority=1)  # bob's own bound (no quota)
        assert sidecar.tier.pinned_usage() == {"alice": 2 * NBYTES, "bob": 2 * NBYTES}


def test_quota_counts_each_chunk_as_the_memory_tier_does(sidecar_factory):
    """--chunk-overhead-bytes: a chunk is charged its bytes plus the per-chunk overhead (entry.accounted). The quota
    check must reserve the same, or a tenant holds more than its quota (48 KiB under a 40 KiB quota here, with
    the default 8 KiB overhead and 4 KiB chunks: the check reserved 4 KiB and the chunk was charged 12 KiB)."""
    nb = chunk_nbytes(SMALL, CHUNK)
    quota = 10 * nb
    sidecar = sidecar_factory(tenant_quota_bytes=quota, chunk_overhead_bytes=8 << 10)
    with PromptCacheClient(sidecar.address, timeout=20) as client:
        for seed in range(8):
            client.put_blobs(SMALL, [seed * 100_000 + i for i in range(CHUNK)], {0: bytes(nb)})
            usage = sidecar.tenancy._usage.get("")
            assert usage is None or usage.used <= quota, (usage.used, quota)
