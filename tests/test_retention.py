"""Retention hints (docs/retention.md): a Put's ttl_seconds gives its chunks their own sliding TTL, shorter or
longer than --ttl-seconds, capped at --max-ttl-hint-seconds (and the maximum lifetime); a bad hint is refused;
a hinted chunk is served exactly like any other. Against a real sidecar (gRPC server and client, and the bulk
channel). TTLs run on a fake clock (support.FakeClock) the tests advance."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from promptcache.client import PromptCacheClient, errors
from promptcache.client.client import encode_chunk
from support import CHUNK, SMALL, FakeClock, make_kv, metric


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def prompt(p: int, chunks: int = 2) -> list[int]:
    return [p * 10_000 + t for t in range(chunks * CHUNK)]


def test_a_short_hint_expires_before_the_servers_ttl(sidecar_factory):
    clock = FakeClock()
    s = sidecar_factory(ttl_seconds=3600.0, clock=clock)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(1), make_kv(SMALL, 2 * CHUNK, seed=1), ttl_seconds=0.5)
        c.put(SMALL, prompt(2), make_kv(SMALL, 2 * CHUNK, seed=2))
        clock.advance(0.4)
        assert c.lookup(SMALL, prompt(1)).cached_tokens == 2 * CHUNK
        clock.advance(0.2)
        assert c.lookup(SMALL, prompt(1)).cached_tokens == 0
        assert c.lookup(SMALL, prompt(2)).cached_tokens == 2 * CHUNK
    assert metric(s, 'promptcache_ttl_hints_total{capped="false"}') == 1


def test_a_long_hint_outlives_the_servers_ttl_and_slides_with_hits_bit_exact(sidecar_factory):
    clock = FakeClock()
    s = sidecar_factory(ttl_seconds=0.6, clock=clock)
    kv = make_kv(SMALL, 2 * CHUNK, seed=3)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(3), kv, ttl_seconds=30)
        c.put(SMALL, prompt(4), make_kv(SMALL, 2 * CHUNK, seed=4))
        clock.advance(1.2)
        assert c.lookup(SMALL, prompt(4)).cached_tokens == 0
        cached, got = c.get(SMALL, prompt(3))  # a hit: its own TTL again from now, not the server's 0.6 s
        assert cached == 2 * CHUNK
        for (k, v), (gk, gv) in zip(kv, got):
            assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))
        clock.advance(1.0)
        assert c.lookup(SMALL, prompt(3)).cached_tokens == 2 * CHUNK
        clock.advance(28.9)  # 29.9 s after the hit: still within its own TTL ...
        assert c.lookup(SMALL, prompt(3)).cached_tokens == 2 * CHUNK
        clock.advance(0.2)  # ... which is not forever
        assert c.lookup(SMALL, prompt(3)).cached_tokens == 0


@pytest.mark.parametrize("hint", [1e9, math.inf])
def test_an_abusive_hint_is_capped(sidecar_factory, hint):
    clock = FakeClock()
    s = sidecar_factory(ttl_seconds=0.5, max_ttl_hint_seconds=0.8, clock=clock)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(5), make_kv(SMALL, 2 * CHUNK, seed=5), ttl_seconds=hint)
        clock.advance(0.7)
        assert c.lookup(SMALL, prompt(5)).cached_tokens == 2 * CHUNK  # longer than the server's TTL ...
        clock.advance(0.2)
        assert c.lookup(SMALL, prompt(5)).cached_tokens == 0  # ... but no longer than the cap
    assert metric(s, 'promptcache_ttl_hints_total{capped="true"}') == 1


def test_the_maximum_lifetime_still_bounds_a_hinted_chunk(sidecar_factory):
    clock = FakeClock()
    s = sidecar_factory(ttl_seconds=30.0, max_lifetime_seconds=0.8, max_ttl_hint_seconds=3600.0, clock=clock)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(6), make_kv(SMALL, 2 * CHUNK, seed=6), ttl_seconds=3600)
        clock.advance(0.5)
        assert c.get(SMALL, prompt(6))[0] == 2 * CHUNK
        clock.advance(0.2)
        assert c.lookup(SMALL, prompt(6)).cached_tokens == 2 * CHUNK
        clock.advance(0.2)
        assert c.lookup(SMALL, prompt(6)).cached_tokens == 0


@pytest.mark.parametrize("hint", [-1.0, math.nan])
def test_a_bad_hint_is_refused_and_nothing_is_stored(sidecar_factory, hint):
    """The sidecar's own check, on the wire (the client refuses these before sending: the next test)."""
    import grpc

    from promptcache.contract.layout import chunk_shape
    from promptcache.contract.wire import NAME_TO_DTYPE, model_to_proto
    from promptcache.v1 import kvcache_pb2 as pb
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc

    s = sidecar_factory()
    blob = encode_chunk(SMALL, make_kv(SMALL, CHUNK, seed=7), 0, CHUNK).numpy().tobytes()
    frames = [pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL), tokens=prompt(7), ttl_seconds=hint)),
              pb.PutRequest(chunk=pb.ChunkBegin(index=0, nbytes=len(blob), shape=chunk_shape(SMALL, CHUNK),
                                                dtype=NAME_TO_DTYPE[SMALL.kv_dtype])),
              pb.PutRequest(data=blob)]
    with grpc.insecure_channel(s.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.KVCacheStub(channel).Put(iter(frames), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds" in info.value.details()
    with PromptCacheClient(s.address) as c:
        assert c.lookup(SMALL, prompt(7)).cached_tokens == 0


BAD_HINTS = [({"priority": -1}, "priority=...) must be a whole number in 0..4294967295"),
             ({"priority": 2 ** 32}, "priority=...) must be a whole number in 0..4294967295"),
             ({"priority": 1.5}, "priority=..."), ({"priority": True}, "priority=..."), ({"priority": "1"}, "priority"),
             ({"ttl_seconds": "60"}, "ttl_seconds=...) must be a number of seconds, 0 or more"),
             ({"ttl_seconds": 10 ** 400}, "ttl_seconds=...) must be a number of seconds, 0 or more"),
             ({"ttl_seconds": -5}, "ttl_seconds=..."), ({"ttl_seconds": math.nan}, "ttl_seconds=..."),
             ({"ttl_seconds": True}, "ttl_seconds=..."), ({"ttl_seconds": -math.inf}, "ttl_seconds=...")]


@pytest.fixture
def every_transport(sidecar_factory, tmp_path):
    """A sidecar with the bulk channel on a unix socket and shared-memory buffers, and a client for each transport:
    gRPC frames, shared memory, the bulk channel (memfds on the unix socket)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    s = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", shm_dir=str(shm),
                        grpc_address=f"unix:{tmp_path}/s.sock", max_pinned_fraction=0.25)
    clients = {"grpc": PromptCacheClient(s.address, timeout=10, retries=0),
               "shm": PromptCacheClient(s.address, timeout=10, retries=0, shm_dir=str(shm)),
               "bulk": PromptCacheClient(s.address, timeout=10, retries=0, bulk_address=s.bulk_address)}
    yield s, clients
    for c in clients.values():
        c.close()


@pytest.mark.parametrize("bad,words", BAD_HINTS)
def test_a_client_refuses_a_hint_out_of_range_on_every_transport_naming_it(every_transport, bad, words):
    """Unchecked, each of these failed inside the request stream: gRPC's UNKNOWN "Exception iterating requests!", the
    bulk channel's bare protobuf TypeError or ValueError."""
    s, clients = every_transport
    for n, (name, c) in enumerate(clients.items()):
        tokens = prompt(900 + n)
        with pytest.raises(ValueError) as info:
            c.put(SMALL, tokens, make_kv(SMALL, 2 * CHUNK, seed=n), **bad)
        assert "PromptCacheClient.put(" + words in str(info.value), name
        blob = {0: encode_chunk(SMALL, make_kv(SMALL, CHUNK, seed=n), 0, CHUNK)}
        with pytest.raises(ValueError) as info:
            c.put_blobs(SMALL, tokens, blob, **bad)
        assert "PromptCacheClient.put_blobs(" + words in str(info.value), name
        assert len(str(info.value)) < 400  # (10 ** 400 is shown cut short)
        assert c.lookup(SMALL, tokens).cached_tokens == 0, name  # nothing sent
    assert metric(s, 'promptcache_requests_total{code="UNKNOWN",rpc="Put"}') == 0


def test_a_client_takes_hints_in_range_none_as_the_default_and_numpy_numbers(every_transport):
    import numpy as np

    s, clients = every_transport
    for n, (name, c) in enumerate(clients.items()):
        for m, hints in enumerate(({"ttl_seconds": None, "priority": None}, {"priority": 2 ** 32 - 1},
                                   {"ttl_seconds": np.float32(30), "priority": np.int64(1)},
                                   {"ttl_seconds": 10 ** 6, "priority": np.uint32(0)})):
            tokens = prompt(950 + 10 * n + m)
            assert c.put(SMALL, tokens, make_kv(SMALL, 2 * CHUNK, seed=m), **hints).stored_chunks == 2, name
            assert c.lookup(SMALL, tokens).cached_tokens == 2 * CHUNK
    assert metric(s, 'promptcache_pins_total{result="pinned"}') == 3 * 2 * 2  # 2**32-1 and 1; 2 chunks; 3 clients
    assert metric(s, 'promptcache_ttl_hints_total{capped="false"}') == 3  # 30 s
    assert metric(s, 'promptcache_ttl_hints_total{capped="true"}') == 3  # 10**6 s: past the default 24 h


def test_the_bulk_channel_carries_the_hint(sidecar_factory, tmp_path):
    clock = FakeClock()
    s = sidecar_factory(ttl_seconds=3600.0, bulk_address=f"unix:{tmp_path}/bulk.sock", clock=clock)
    with PromptCacheClient(s.address, bulk_address=s.bulk_address) as c:
        assert c.put(SMALL, prompt(8), make_kv(SMALL, 2 * CHUNK, seed=8), ttl_seconds=0.5).stored_chunks == 2
        clock.advance(0.4)
        assert c.lookup(SMALL, prompt(8)).cached_tokens == 2 * CHUNK
        clock.advance(0.2)
        assert c.lookup(SMALL, prompt(8)).cached_tokens == 0
    assert metric(s, 'promptcache_requests_total{code="OK",rpc="Put"}') == 0  # it went through the bulk channel
    assert metric(s, 'promptcache_ttl_hints_total{capped="false"}') == 1


# --- priority: pinned prefixes -------------------------------------------------------------------------------
NB = __import__("promptcache.contract.layout", fromlist=["chunk_nbytes"]).chunk_nbytes(SMALL, CHUNK)


def _fill(c, first: int, n: int) -> None:
    for p in range(first, first + n):
        c.put(SMALL, prompt(p), make_kv(SMALL, 2 * CHUNK, seed=p))
        c.get(SMALL, prompt(p))  # a hit each: the policies count them as reused, unlike the pinned prompt


def test_a_pinned_prefix_survives_capacity_pressure_bit_exact(sidecar_factory):
    s = sidecar_factory(memory_bytes=8 * NB, max_pinned_fraction=0.25)
    system = make_kv(SMALL, 2 * CHUNK, seed=20)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(20), system, priority=1)
        c.put(SMALL, prompt(21), make_kv(SMALL, 2 * CHUNK, seed=21))  # the same, unpinned
        _fill(c, 100, 12)  # 24 chunks through an 8-chunk tier
        assert c.lookup(SMALL, prompt(21)).cached_tokens == 0
        assert [ch.tier for ch in c.lookup(SMALL, prompt(20)).chunks] == ["device"] * 2
        cached, got = c.get(SMALL, prompt(20))
    assert cached == 2 * CHUNK
    for (k, v), (gk, gv) in zip(system, got):
        assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))
    assert metric(s, 'promptcache_pins_total{result="pinned"}') == 2
    assert metric(s, 'promptcache_pinned_bytes{owner=""}') == 2 * NB
    assert s.tier.usage()["used"] <= 8 * NB


def test_pins_are_bounded_per_owner_root_first_and_the_rest_is_evictable(sidecar_factory):
    s = sidecar_factory(memory_bytes=8 * NB, max_pinned_fraction=0.25)  # 2 chunks may be pinned
    long = [30 * 10_000 + t for t in range(4 * CHUNK)]
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, long, make_kv(SMALL, 4 * CHUNK, seed=30), priority=7)  # levels above 1 read as 1
        assert metric(s, 'promptcache_pins_total{result="pinned"}') == 2
        assert metric(s, 'promptcache_pins_total{result="refused"}') == 2
        c.put(SMALL, prompt(31), make_kv(SMALL, 2 * CHUNK, seed=31), priority=1)  # over the bound: not pinned
        assert metric(s, 'promptcache_pins_total{result="refused"}') == 4
        _fill(c, 200, 12)
        assert c.lookup(SMALL, long).cached_tokens == 2 * CHUNK  # the pinned root pair, nothing after it
    assert metric(s, 'promptcache_pinned_bytes{owner=""}') == 2 * NB


def _declare(tmp_path, **prefixes) -> str:
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps([{"name": name, "tokens": tokens} for name, tokens in prefixes.items()]))
    return str(path)


def test_a_declared_prefix_is_pinned_without_a_hint_and_survives_pressure_bit_exact(sidecar_factory, tmp_path):
    """--pinned-prefixes-file (spec.cachePolicy.pinnedPrefixes): a Put without any hint that stores a declared
    prefix pins its whole chunks (not what follows them), within the owner's bound. The control: the same traffic
    through a sidecar without the file evicts it."""
    system = prompt(60, chunks=3)
    declared = system[:2 * CHUNK + 5]  # 2 whole chunks and part of a third: the whole chunks are pinned
    kv = make_kv(SMALL, 3 * CHUNK, seed=60)
    cached = {}
    for name, extra in (("declared", dict(pinned_prefixes_file=_declare(tmp_path, **{"system-v1": declared}))),
                        ("control", {})):
        s = sidecar_factory(memory_bytes=8 * NB, max_pinned_fraction=0.25, **extra)
        with PromptCacheClient(s.address) as c:
            assert c.put(SMALL, system, kv).stored_chunks == 3
            c.put(SMALL, prompt(61), make_kv(SMALL, 2 * CHUNK, seed=61))  # not declared: not pinned
            _fill(c, 300, 12)  # 24 chunks through an 8-chunk tier
            cached[name] = c.lookup(SMALL, system).cached_tokens
            if name == "declared":
                assert s.tier.pinned_usage() == {"": 2 * NB}  # the declared chunks, not prompt 61's
                assert metric(s, 'promptcache_pinned_bytes{owner=""}') == 2 * NB
                got = c.get(SMALL, system)[1]
                for (k, v), (gk, gv) in zip(kv, got):
                    assert torch.equal(bits(gk), bits(k[:, :, :2 * CHUNK]))
                    assert torch.equal(bits(gv), bits(v[:, :, :2 * CHUNK]))
    assert cached["declared"] == 2 * CHUNK and cached["control"] < 2 * CHUNK  # (the policy may keep a root)


def test_a_declared_prefix_is_pinned_by_a_put_that_only_covers_it_and_stays_bounded(sidecar_factory, tmp_path):
    long = [70 * 10_000 + t for t in range(4 * CHUNK)]
    s = sidecar_factory(memory_bytes=8 * NB, max_pinned_fraction=0.25,  # 2 chunks may be pinned
                        pinned_prefixes_file=_declare(tmp_path, long=long))
    kv = make_kv(SMALL, 4 * CHUNK, seed=70)
    with PromptCacheClient(s.address) as c:
        assert c.put(SMALL, long[:CHUNK], [(k[:, :, :CHUNK], v[:, :, :CHUNK]) for k, v in kv]).stored_chunks == 1
        assert s.tier.pinned_usage() == {"": NB}
        # the rest, as vLLM's connector puts it: the whole prompt's tokens, the chunks after the cached one
        c.put(SMALL, long, kv, start_chunk=1)
        assert s.tier.pinned_usage() == {"": 2 * NB}  # the bound: 2 of the 4 declared chunks, root first
        assert metric(s, 'promptcache_pins_total{result="refused"}') == 2
        _fill(c, 400, 12)
        assert c.lookup(SMALL, long).cached_tokens == 2 * CHUNK


@pytest.mark.parametrize("warmup_seconds", [0.0, 30.0])
def test_a_declared_prefix_is_pinned_again_when_it_comes_back_from_the_disk_tier(sidecar_factory, tmp_path,
                                                                              warmup_seconds):
    """A pin lives in memory, but a declared prefix is pinned again when it returns after a restart: by warm-up
    before the sidecar is ready, or by the Get that promotes it (root first, within the bound). Undeclared chunks
    come back unpinned."""
    system = prompt(80, chunks=3)
    declared = _declare(tmp_path, system=system[:2 * CHUNK])
    flags = dict(memory_bytes=8 * NB, max_pinned_fraction=0.25, pinned_prefixes_file=declared,
                 data_dir=str(tmp_path / "data"), disk_bytes=64 * NB, disk_min_free_bytes=0)
    kv = make_kv(SMALL, 3 * CHUNK, seed=80)
    first = sidecar_factory(**flags)
    with PromptCacheClient(first.address) as c:
        assert c.put(SMALL, system, kv).stored_chunks == 3
    assert first.tier.pinned_usage() == {"": 2 * NB}
    first.stop()  # graceful: memory goes to the disk tier, the pins with nothing
    again = sidecar_factory(**flags, warmup_seconds=warmup_seconds)
    assert again.warmup.ready.wait(30)
    with PromptCacheClient(again.address) as c:
        if not warmup_seconds:
            assert again.tier.pinned_usage() == {}
            assert c.get(SMALL, system)[0] == 3 * CHUNK  # promoted from disk, root first
        assert again.tier.pinned_usage() == {"": 2 * NB}  # chunks 0 and 1 pinned, chunk 2 not
        _fill(c, 500, 12)
        assert c.lookup(SMALL, system).cached_tokens >= 2 * CHUNK
        assert [ch.tier for ch in c.lookup(SMALL, system).chunks][:2] == ["device"] * 2


@pytest.mark.parametrize("warmup_seconds", [0.0, 30.0])
def test_a_priority_hints_pin_survives_a_restart_through_the_disk_tier(sidecar_factory, tmp_path, warmup_seconds):
    """A Put's priority hint pins its chunks in memory; a graceful stop sends them to the disk tier marked as
    pinned, and they are pinned again when warm-up or a Get brings them back (root first, within the bound), so
    the pinned prefix survives pressure after the restart too, bit-exact. A chunk that was not pinned comes back
    unpinned."""
    flags = dict(memory_bytes=8 * NB, max_pinned_fraction=0.25, data_dir=str(tmp_path / "data"),
                 disk_bytes=64 * NB, disk_min_free_bytes=0)
    hinted, plain = prompt(90), prompt(91)
    kv = make_kv(SMALL, 2 * CHUNK, seed=90)
    first = sidecar_factory(**flags)
    with PromptCacheClient(first.address) as c:
        c.put(SMALL, hinted, kv, priority=1)
        c.put(SMALL, plain, make_kv(SMALL, 2 * CHUNK, seed=91))
    assert first.tier.pinned_usage() == {"": 2 * NB}
    first.stop()  # graceful: memory goes to the disk tier, the pins marked in its records
    again = sidecar_factory(**flags, warmup_seconds=warmup_seconds)
    assert again.warmup.ready.wait(30)
    with PromptCacheClient(again.address) as c:
        if not warmup_seconds:
            assert again.tier.pinned_usage() == {}
            assert c.get(SMALL, hinted)[0] == 2 * CHUNK  # promoted from disk, root first
            assert c.get(SMALL, plain)[0] == 2 * CHUNK
        assert again.tier.pinned_usage() == {"": 2 * NB}  # the hinted prompt's chunks, not the plain one's
        _fill(c, 600, 12)  # 24 chunks through an 8-chunk tier
        assert [ch.tier for ch in c.lookup(SMALL, hinted).chunks] == ["device"] * 2
        cached, got = c.get(SMALL, hinted)
        assert cached == 2 * CHUNK
        for (k, v), (gk, gv) in zip(kv, got):
            assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))
        assert [ch.tier for ch in c.lookup(SMALL, plain).chunks] != ["device"] * 2


def test_pins_that_come_back_from_disk_stay_within_the_owners_bound(sidecar_factory, tmp_path):
    """Pins marked on disk are hints, not grants: a restart with a smaller --max-pinned-fraction pins again only
    what the new bound allows, root first."""
    flags = dict(memory_bytes=8 * NB, data_dir=str(tmp_path / "data"), disk_bytes=64 * NB, disk_min_free_bytes=0)
    long = [92 * 10_000 + t for t in range(4 * CHUNK)]
    first = sidecar_factory(**flags, max_pinned_fraction=0.5)  # 4 chunks may be pinned
    with PromptCacheClient(first.address) as c:
        c.put(SMALL, long, make_kv(SMALL, 4 * CHUNK, seed=92), priority=1)
    assert first.tier.pinned_usage() == {"": 4 * NB}
    first.stop()
    again = sidecar_factory(**flags, max_pinned_fraction=0.25, warmup_seconds=30.0)  # 2 chunks may be pinned
    assert again.warmup.ready.wait(30)
    assert again.tier.pinned_usage() == {"": 2 * NB}
    with PromptCacheClient(again.address) as c:
        _fill(c, 700, 12)
        tiers = [ch.tier for ch in c.lookup(SMALL, long).chunks]
        assert tiers[:2] == ["device"] * 2 and "device" not in tiers[2:]  # the pinned root pair stays in memory


@pytest.mark.parametrize("doc, fragment", [
    ("{", "not JSON"),
    ('{"name": "a"}', "must be a JSON list"),
    ('[{"name": "a"}]', 'entry 0 must be an object with exactly "name" and "tokens"'),
    ('[{"name": "a", "tokens": [], "x": 1}]', 'exactly "name" and "tokens"'),
    ('[{"name": "../a", "tokens": []}]', "entry 0: name '../a' must be"),
    ('[{"name": "a", "tokens": [1, -1]}]', "prefix 'a': tokens must be a list of token ids"),
    ('[{"name": "a", "tokens": [1, true]}]', "prefix 'a': tokens must be a list of token ids"),
    ('[{"name": "a", "tokens": [4294967296]}]', "prefix 'a': tokens must be a list of token ids"),
    ('[{"name": "a", "tokens": [1, 2]}]', "fewer than one chunk of 16"),
    (json.dumps([{"name": "a", "tokens": list(range(16))}, {"name": "a", "tokens": list(range(16))}]),
     "name 'a' appears twice"),
    (json.dumps([{"name": f"p{i}", "tokens": list(range(16))} for i in range(65)]), "65 prefixes, more than 64"),
])
def test_a_bad_pinned_prefixes_file_is_refused_naming_the_file_and_the_entry(sidecar_factory, tmp_path, doc,
                                                                               fragment):
    path = tmp_path / "pinned.json"
    path.write_text(doc)
    with pytest.raises(ValueError, match=re.escape(f"--pinned-prefixes-file {path}: ") + ".*" + re.escape(fragment)):
        sidecar_factory(pinned_prefixes_file=str(path))
    with pytest.raises(ValueError, match="no such file"):
        sidecar_factory(pinned_prefixes_file=str(tmp_path / "missing.json"))


def test_pinning_off_and_a_pinned_chunk_still_expires(sidecar_factory):
    s = sidecar_factory(memory_bytes=8 * NB, max_pinned_fraction=0.0)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(40), make_kv(SMALL, 2 * CHUNK, seed=40), priority=1)
        assert metric(s, 'promptcache_pins_total{result="refused"}') == 2
    clock = FakeClock()
    s2 = sidecar_factory(memory_bytes=8 * NB, max_pinned_fraction=0.25, clock=clock)
    with PromptCacheClient(s2.address) as c:
        c.put(SMALL, prompt(41), make_kv(SMALL, 2 * CHUNK, seed=41), priority=1, ttl_seconds=0.5)
        assert s2.tier.pinned_usage() == {"": 2 * NB}
        clock.advance(0.6)
        assert c.lookup(SMALL, prompt(41)).cached_tokens == 0  # pinned is not forever: its TTL holds
    s2.tier.expire()  # (what the TTL sweeper does): the expired pinned chunks leave, and their pin with them
    assert s2.tier.pinned_usage() == {}


def test_a_shrink_below_what_is_pinned_unpins_deepest_first_to_the_new_bound(sidecar_factory):
    s = sidecar_factory(memory_bytes=8 * NB, max_pinned_fraction=0.5)
    long = [50 * 10_000 + t for t in range(4 * CHUNK)]
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, long, make_kv(SMALL, 4 * CHUNK, seed=50), priority=1)
        assert s.tier.pinned_usage() == {"": 4 * NB}
        r = c.resize(2 * NB)  # a pin never blocks a resize, nor keeps more than the new size's bound pinned
        assert r.memory_bytes == 2 * NB and s.tier.budget == 2 * NB and s.tier.usage()["used"] <= 2 * NB
        assert s.tier.pinned_usage() == {"": NB}  # half of the new size in all, and 0.5 of it for the owner
        assert [e.index for e in s.tier.snapshot() if e.pinned] == [0]  # the root: still a whole prefix
        assert metric(s, 'promptcache_pins_total{result="unpinned"}') == 3
        assert metric(s, 'promptcache_pinned_bytes{owner=""}') == NB
        assert c.lookup(SMALL, long).cached_tokens >= CHUNK
        _fill(c, 500, 3)  # capacity eviction has room: the unpinned half of the budget
        assert c.lookup(SMALL, long).cached_tokens >= CHUNK


def test_a_shrink_unpins_every_owner_to_its_new_bound_and_other_tenants_can_store(sidecar_factory, tmp_path):
    """The audit's case: two tenants pin all they may (half the budget), the operator's autoscaler shrinks the
    budget; before, the pins were then the whole new budget and every other tenant's Put was RESOURCE_EXHAUSTED
    until they expired."""
    from test_auth import write_secret_dir

    write_secret_dir(tmp_path / "tokens", {t: f"{t}-token" for t in ("alice", "bob", "carol", "ops")})
    s = sidecar_factory(token_file=str(tmp_path / "tokens"), admin_tenants="ops", memory_bytes=32 * NB,
                        max_pinned_fraction=0.25)  # 8 chunks pinned per tenant, 16 in all
    clients = {t: PromptCacheClient(s.address, token=f"{t}-token", retries=0, timeout=10)
               for t in ("alice", "bob", "carol", "ops")}
    try:
        system = {t: [p * 10_000 + i for i in range(8 * CHUNK)] for t, p in (("alice", 70), ("carol", 71))}
        kv = {t: make_kv(SMALL, 8 * CHUNK, seed=p) for t, p in (("alice", 70), ("carol", 71))}
        for t in system:
            clients[t].put(SMALL, system[t], kv[t], priority=1)
        assert s.tier.pinned_usage() == {"alice": 8 * NB, "carol": 8 * NB}
        clients["ops"].resize(8 * NB)  # each tenant may pin 2 chunks now, 4 in all
        assert s.tier.pinned_usage() == {"alice": 2 * NB, "carol": 2 * NB}
        assert metric(s, 'promptcache_pinned_bytes{owner="alice"}') == 2 * NB
        assert metric(s, 'promptcache_pinned_bytes{owner="carol"}') == 2 * NB
        assert metric(s, 'promptcache_pins_total{result="unpinned"}') == 12
        assert sorted((e.owner, e.index) for e in s.tier.snapshot() if e.pinned) == [
            ("alice", 0), ("alice", 1), ("carol", 0), ("carol", 1)]  # each a whole prefix from the root
        for p in range(80, 86):  # 12 chunks of bob's through what the pins leave of an 8-chunk tier
            assert clients["bob"].put(SMALL, prompt(p), make_kv(SMALL, 2 * CHUNK, seed=p)).stored_chunks == 2
            assert clients["bob"].lookup(SMALL, prompt(p)).cached_tokens == 2 * CHUNK
        assert s.tier.usage()["used"] <= 8 * NB
        for t in system:  # the pinned roots stayed, bit-exact
            cached, got = clients[t].get(SMALL, system[t])
            assert cached == 2 * CHUNK
            for (k, v), (gk, gv) in zip(kv[t], got):
                assert torch.equal(bits(gk), bits(k[:, :, :2 * CHUNK]))
                assert torch.equal(bits(gv), bits(v[:, :, :2 * CHUNK]))
    finally:
        for c in clients.values():
            c.close()


def test_pins_within_the_new_bounds_survive_a_shrink_bit_exact(sidecar_factory):
    s = sidecar_factory(memory_bytes=16 * NB, max_pinned_fraction=0.25)
    system = make_kv(SMALL, 2 * CHUNK, seed=90)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(90), system, priority=1)
        _fill(c, 600, 7)  # the tier full
        c.resize(8 * NB)  # the owner's bound is 2 chunks now: what it has pinned
        assert s.tier.pinned_usage() == {"": 2 * NB}
        assert metric(s, 'promptcache_pins_total{result="unpinned"}') == 0
        _fill(c, 700, 12)  # 24 chunks through the 8-chunk tier
        cached, got = c.get(SMALL, prompt(90))
    assert cached == 2 * CHUNK
    for (k, v), (gk, gv) in zip(system, got):
        assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))
    assert metric(s, 'promptcache_pinned_bytes{owner=""}') == 2 * NB
    assert s.tier.usage()["used"] <= 8 * NB


def test_a_ttl_hint_is_kept_through_the_disk_tier(sidecar_factory, tmp_path):
    """Demoted to disk and promoted back, a hinted chunk still slides with its own TTL, not the server's."""
    clock = FakeClock()
    s = sidecar_factory(memory_bytes=2 * NB, disk_bytes=64 << 20, data_dir=str(tmp_path / "data"), ttl_seconds=0.6,
                        clock=clock)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(60), make_kv(SMALL, 2 * CHUNK, seed=60), ttl_seconds=30)
        c.put(SMALL, prompt(61), make_kv(SMALL, 2 * CHUNK, seed=61), ttl_seconds=30)  # 60 goes to disk
        assert s.spill.disk.flush(10)
        assert [ch.tier for ch in c.lookup(SMALL, prompt(60)).chunks] == ["disk", "disk"]
        assert s.spill.disk.entry(c.lookup(SMALL, prompt(60)).chunks[0].key).ttl_hint == 30
        clock.advance(0.8)  # past the server's TTL
        assert c.get(SMALL, prompt(60))[0] == 2 * CHUNK  # promoted back
        assert c.get(SMALL, prompt(60))[0] == 2 * CHUNK  # a hit in memory: slides by its own 30 s
        clock.advance(0.8)
        assert c.lookup(SMALL, prompt(60)).cached_tokens == 2 * CHUNK
        clock.advance(29.4)  # 30.2 s after that hit
        assert c.lookup(SMALL, prompt(60)).cached_tokens == 0


def test_declared_prefixes_match_a_put_by_its_tokens_as_its_keys_would():
    """PinnedPrefixes.leading compares tokens, not keys (a client changing its salt on every Put made the sidecar
    hash every declared prefix again each time): under any fingerprint it gives what matching the Put's chunk keys
    against the prefixes' keys gives, for prompts that follow a prefix for a while and then leave it."""
    import random

    from promptcache.contract import keys as keyspec
    from promptcache.sidecar.pinned import PinnedPrefix, PinnedPrefixes

    rng = random.Random(7)
    ct = 4
    shared = [rng.randrange(50) for _ in range(3 * ct)]
    prefixes = [PinnedPrefix("a", tuple(shared + [1] * (2 * ct))), PinnedPrefix("b", tuple(shared + [2] * (3 * ct + 1))),
                PinnedPrefix("c", tuple(rng.randrange(50) for _ in range(5 * ct)))]
    declared = PinnedPrefixes(prefixes, ct)
    for trial in range(300):
        fingerprint = bytes([trial % 256]) * 32
        base = list(rng.choice(prefixes).tokens)
        cut = rng.randrange(len(base) + 1)
        prompt = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(3 * ct))]
        if not prompt:
            continue
        known = declared.keys(fingerprint)
        by_keys = 0
        for key in keyspec.iter_chunk_keys(fingerprint, prompt, ct):
            if key not in known:
                break
            by_keys += 1
        assert declared.leading(prompt) == by_keys, (cut, prompt)
