"""Retention hints (docs/retention.md): a Put's ttl_seconds gives its chunks their own sliding TTL, shorter or
longer than --ttl-seconds, capped at --max-ttl-hint-seconds (and the maximum lifetime); a bad hint is refused;
a hinted chunk is served exactly like any other. Against a real sidecar (gRPC server and client, and the bulk
channel)."""
from __future__ import annotations

import math
import time

import pytest
import torch

from promptcache.client import PromptCacheClient, errors
from support import CHUNK, SMALL, make_kv, metric


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def prompt(p: int, chunks: int = 2) -> list[int]:
    return [p * 10_000 + t for t in range(chunks * CHUNK)]


def test_a_short_hint_expires_before_the_servers_ttl(sidecar_factory):
    s = sidecar_factory(ttl_seconds=3600.0)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(1), make_kv(SMALL, 2 * CHUNK, seed=1), ttl_seconds=0.5)
        c.put(SMALL, prompt(2), make_kv(SMALL, 2 * CHUNK, seed=2))
        assert c.lookup(SMALL, prompt(1)).cached_tokens == 2 * CHUNK
        time.sleep(1.0)
        assert c.lookup(SMALL, prompt(1)).cached_tokens == 0
        assert c.lookup(SMALL, prompt(2)).cached_tokens == 2 * CHUNK
    assert metric(s, 'promptcache_ttl_hints_total{capped="false"}') == 1


def test_a_long_hint_outlives_the_servers_ttl_and_slides_with_hits_bit_exact(sidecar_factory):
    s = sidecar_factory(ttl_seconds=0.6)
    kv = make_kv(SMALL, 2 * CHUNK, seed=3)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(3), kv, ttl_seconds=30)
        c.put(SMALL, prompt(4), make_kv(SMALL, 2 * CHUNK, seed=4))
        time.sleep(1.2)
        assert c.lookup(SMALL, prompt(4)).cached_tokens == 0
        cached, got = c.get(SMALL, prompt(3))  # a hit: its own TTL again from now, not the server's 0.6 s
        assert cached == 2 * CHUNK
        for (k, v), (gk, gv) in zip(kv, got):
            assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))
        time.sleep(1.0)
        assert c.lookup(SMALL, prompt(3)).cached_tokens == 2 * CHUNK


@pytest.mark.parametrize("hint", [1e9, math.inf])
def test_an_abusive_hint_is_capped(sidecar_factory, hint):
    s = sidecar_factory(ttl_seconds=0.5, max_ttl_hint_seconds=0.8)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(5), make_kv(SMALL, 2 * CHUNK, seed=5), ttl_seconds=hint)
        time.sleep(0.6)
        assert c.lookup(SMALL, prompt(5)).cached_tokens == 2 * CHUNK  # longer than the server's TTL ...
        time.sleep(0.6)
        assert c.lookup(SMALL, prompt(5)).cached_tokens == 0  # ... but no longer than the cap
    assert metric(s, 'promptcache_ttl_hints_total{capped="true"}') == 1


def test_the_maximum_lifetime_still_bounds_a_hinted_chunk(sidecar_factory):
    s = sidecar_factory(ttl_seconds=30.0, max_lifetime_seconds=0.8, max_ttl_hint_seconds=3600.0)
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompt(6), make_kv(SMALL, 2 * CHUNK, seed=6), ttl_seconds=3600)
        time.sleep(0.5)
        assert c.get(SMALL, prompt(6))[0] == 2 * CHUNK
        time.sleep(0.5)
        assert c.lookup(SMALL, prompt(6)).cached_tokens == 0


@pytest.mark.parametrize("hint", [-1.0, math.nan])
def test_a_bad_hint_is_refused_and_nothing_is_stored(sidecar_factory, hint):
    s = sidecar_factory()
    with PromptCacheClient(s.address) as c:
        with pytest.raises(errors.InvalidArgument, match="ttl_seconds"):
            c.put(SMALL, prompt(7), make_kv(SMALL, 2 * CHUNK, seed=7), ttl_seconds=hint)
        assert c.lookup(SMALL, prompt(7)).cached_tokens == 0


def test_the_bulk_channel_carries_the_hint(sidecar_factory, tmp_path):
    s = sidecar_factory(ttl_seconds=3600.0, bulk_address=f"unix:{tmp_path}/bulk.sock")
    with PromptCacheClient(s.address, bulk_address=s.bulk_address) as c:
        assert c.put(SMALL, prompt(8), make_kv(SMALL, 2 * CHUNK, seed=8), ttl_seconds=0.5).stored_chunks == 2
        time.sleep(1.0)
        assert c.lookup(SMALL, prompt(8)).cached_tokens == 0
    assert metric(s, 'promptcache_requests_total{code="OK",rpc="Put"}') == 0  # it went through the bulk channel
    assert metric(s, 'promptcache_ttl_hints_total{capped="false"}') == 1
