"""Resize never leaves committed bytes above the budget (issue 17, item 7): a shrink cannot free what Puts and Gets
in flight hold, so it admits new Puts under the new size at once, evicts, waits for those calls to let go, and only
then makes the new size the budget; if they do not let go in time, the budget stays as it was."""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import torch

from support import CHUNK, metrics_text
from promptcache.client import PromptCacheClient, errors
from promptcache.client.client import encode_chunk
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes, chunk_shape
from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.store import MemoryTier, NoRoom
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import model_to_proto

BIG = ModelSpec("test/big", "rev-1", "float32", num_layers=8, num_kv_heads=8, head_dim=64)
BIG_BYTES = chunk_nbytes(BIG, CHUNK)  # 512 KiB
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # each stalled call on its own connection


def blob(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # finite float32 values: the sidecar refuses NaN and Inf
    return torch.randn(BIG_BYTES // 4, generator=g).view(torch.uint8)


def stalled_put(channel, tokens: list[int], release: threading.Event):
    """A Put that announces one BIG chunk (the sidecar reserves its bytes), sends half of it and stops."""
    data = blob(0).numpy().tobytes()

    def frames():
        yield pb.PutRequest(header=pb.PutHeader(model=model_to_proto(BIG), tokens=tokens))
        yield pb.PutRequest(chunk=pb.ChunkBegin(index=0, nbytes=BIG_BYTES, shape=list(chunk_shape(BIG, CHUNK)),
                                                dtype=pb.DTYPE_FLOAT32))
        yield pb.PutRequest(data=data[: BIG_BYTES // 2])
        release.wait(60)

    return pb_grpc.KVCacheStub(channel).Put.future(frames(), timeout=60)


def committed(usage: dict) -> int:
    return usage["used"] + usage["reserved"] + usage["draining"]


def eventually(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


# --- the store alone -------------------------------------------------------------------------------------------
def tier(budget: int) -> MemoryTier:
    return MemoryTier(budget, torch.device("cpu"), make_policy("lru", capacity=budget), ttl_seconds=3600)


def store(t: MemoryTier, key: bytes, nbytes: int = 1000) -> None:
    r = t.reserve(nbytes, key, b"")
    t.commit(r, key=key, fingerprint=b"f", parent=b"", index=0, data=torch.zeros(nbytes, dtype=torch.uint8),
             checksum_value=0, shape=(nbytes,), dtype=0)


def test_shrink_waits_for_a_reservation_and_lease_then_applies():
    t = tier(10_000)
    for i in range(4):
        store(t, bytes([i]))
    leased = t.acquire(bytes([0]), b"f")
    held = t.reserve(3000, b"put", b"")
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(t.resize(2500, wait_seconds=10)))
    worker.start()
    assert eventually(lambda: t.usage()["draining"] == 1000)  # the leased entry was evicted too
    # While the shrink waits, the old budget is still the one reported, committed bytes are under it, and a new
    # reservation must fit under the new size.
    u = t.usage()
    assert u["budget"] == 10_000 and committed(u) <= 10_000 and worker.is_alive()
    with pytest.raises(NoRoom):
        t.reserve(1000, b"late", b"")
    t.release_lease(leased)
    time.sleep(0.1)
    assert worker.is_alive()  # the reservation (3000 bytes, more than 2500) is still held
    t.release(held)
    worker.join(5)
    (r,) = outcome
    assert r.done and r.previous == 10_000 and r.evicted == 4 and r.committed == 0 and r.waited > 0.1
    assert t.usage()["budget"] == 2500


def test_shrink_evicts_what_a_put_in_flight_stores():
    t = tier(10_000)
    held = t.reserve(4000, b"put", b"")
    worker = threading.Thread(target=lambda: t.resize(2500, wait_seconds=10))
    worker.start()
    time.sleep(0.1)
    assert worker.is_alive() and t.usage()["budget"] == 10_000
    t.commit(held, key=b"put", fingerprint=b"f", parent=b"", index=0, data=torch.zeros(4000, dtype=torch.uint8),
             checksum_value=0, shape=(4000,), dtype=0)
    worker.join(5)
    u = t.usage()
    assert not worker.is_alive() and u["budget"] == 2500 and committed(u) == 0
    assert t.peek(b"put", b"f") is None


def test_shrink_that_runs_out_of_time_keeps_the_old_budget():
    t = tier(10_000)
    store(t, b"a")
    held = t.reserve(4000, b"put", b"")
    r = t.resize(2000, wait_seconds=0.2)
    assert not r.done and r.reserved == 4000 and r.evicted == 1 and r.waited >= 0.2
    u = t.usage()
    assert u["budget"] == 10_000 and committed(u) == 4000
    assert t.reserve(5000, b"next", b"")  # the old budget applies again
    t.release(held)


def test_grow_applies_at_once():
    t = tier(2000)
    t.reserve(2000, b"put", b"")
    r = t.resize(8000, wait_seconds=10)
    assert r.done and r.waited == 0.0 and t.usage()["budget"] == 8000


def prefix_of(t: MemoryTier, owner: str, n: int, nbytes: int = 1000) -> list[bytes]:
    """A prefix of `n` chunks of `owner`'s, root first (each the parent of the next)."""
    keys, parent = [], b""
    for i in range(n):
        key = f"{owner}/{i}".encode()
        r = t.reserve(nbytes, key, parent)
        t.commit(r, key=key, fingerprint=b"f", parent=parent, index=i, data=torch.zeros(nbytes, dtype=torch.uint8),
                 checksum_value=0, shape=(nbytes,), dtype=0, owner=owner)
        keys.append(key)
        parent = key
    return keys


def pinned_keys(t: MemoryTier) -> set[bytes]:
    return {e.key for e in t.snapshot() if e.pinned}


def test_a_shrink_unpins_each_owner_deepest_first_down_to_its_new_bound():
    t = tier(20_000)
    t.owner_pin_limit = lambda owner, budget: budget * 3 // 10  # as --max-pinned-fraction 0.3
    a, b = prefix_of(t, "a", 6), prefix_of(t, "b", 2)
    assert all(t.pin(k, b"f") for k in a + b)  # 6000 and 2000: within 6000 each, 10,000 in all
    r = t.resize(10_000)  # bounds now 3000 each, 5000 in all
    assert r.done and r.unpinned == 3 and r.evicted == 0
    assert t.pinned_usage() == {"a": 3000, "b": 2000}
    assert pinned_keys(t) == set(a[:3] + b)  # what stays pinned is a whole prefix from the root
    for i in range(5):  # the unpinned chunks are the policy's again: capacity eviction takes them, not the pinned
        store(t, f"new/{i}".encode())
    held = {e.key for e in t.snapshot()}
    assert set(a[:3] + b) <= held and not set(a[3:]) & held
    assert t.pinned_usage() == {"a": 3000, "b": 2000}


def test_a_shrink_unpins_to_half_the_new_size_so_capacity_eviction_has_room():
    t = tier(8000)  # no per-owner bound: only all owners' half of the budget
    keys = prefix_of(t, "a", 4)
    assert all(t.pin(k, b"f") for k in keys) and t.pin(prefix_of(t, "b", 1)[0], b"f") is False  # half is 4000
    r = t.resize(4000)  # the 4 pinned chunks fit in it, but half of it is 2000
    assert r.done and r.unpinned == 2 and t.pinned_usage() == {"a": 2000}
    assert pinned_keys(t) == set(keys[:2])
    for i in range(4):  # before the fix: NoRoom, the whole budget pinned
        store(t, f"new/{i}".encode())
    assert t.usage()["used"] <= 4000 and pinned_keys(t) == set(keys[:2])


def test_pins_within_the_new_bounds_survive_a_shrink_and_a_pin_is_bounded_by_a_pending_shrink():
    t = tier(20_000)
    t.owner_pin_limit = lambda owner, budget: budget // 4
    keys = prefix_of(t, "a", 4)
    assert all(t.pin(k, b"f") for k in keys[:2])
    for i in range(10):
        store(t, f"other/{i}".encode())
    r = t.resize(10_000)  # 2000 pinned: within a quarter of 10,000
    assert r.done and r.unpinned == 0 and t.pinned_usage() == {"a": 2000} and pinned_keys(t) == set(keys[:2])
    assert t.usage()["used"] <= 10_000
    t.resize(20_000)
    for i in range(10):
        store(t, f"more/{i}".encode())
    rest = prefix_of(t, "b", 3)  # the most recently stored: what the LRU evicts last
    leased = t.lease(b"more/0", b"f")  # a Get in flight of a chunk the next shrink evicts: it waits for it
    worker = threading.Thread(target=lambda: t.resize(8000, wait_seconds=10))
    worker.start()
    assert eventually(lambda: t.usage()["draining"] == 1000)
    assert worker.is_alive() and t.usage()["budget"] == 20_000
    # while the shrink waits, b's bound is a quarter of 8000 (2000), not of the 20,000 still reported
    assert [t.pin(k, b"f") for k in rest] == [True, True, False]
    t.release_lease(leased)
    worker.join(5)
    assert t.usage()["budget"] == 8000 and t.pinned_usage() == {"a": 2000, "b": 2000}


# --- a real sidecar under load ---------------------------------------------------------------------------------
@pytest.mark.slow  # timing under load; the shrink logic itself is tested above without threads
def test_shrink_under_load_never_leaves_committed_bytes_above_the_budget(sidecar_factory):
    """Writers and readers hammer the sidecar; at each shrink, two Puts hold reservations (stalled half-way) and a
    reader holds a lease on a 512 KiB chunk (stalled: it stops reading a 24 MiB Get). Each holds more than the
    new size, so the shrink must wait for all of them (the idle watchdog cancels them after 1.5 s). Sampled all
    along and right after each Resize returns, committed bytes are never above the budget."""
    big = 128 << 20  # room for what the writers add while a round sets up: the long prompt stays cached
    sidecar = sidecar_factory(memory_bytes=big, stream_idle_seconds=1.5, eviction_policy="lru")
    t = sidecar.tier
    stop = threading.Event()
    over: list[dict] = []
    failures: list[BaseException] = []

    def sample():
        while not stop.is_set():
            u = t.usage()
            if committed(u) > u["budget"]:
                over.append(u)

    def write(seed: int):
        rnd = random.Random(seed)
        with PromptCacheClient(sidecar.address, timeout=20, retries=0) as c:
            while not stop.is_set():
                n = rnd.randint(1, 3)
                tokens = [rnd.randrange(1 << 20) for _ in range(n * CHUNK)]
                try:
                    c.put_blobs(BIG, tokens, {i: blob(rnd.randrange(1000)) for i in range(n)})
                except errors.ResourceExhausted:
                    pass  # no room while the budget is small
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    failures.append(exc)
                    return
                time.sleep(0.01)

    def read(seed: int, prompts: list[list[int]]):
        rnd = random.Random(seed)
        with PromptCacheClient(sidecar.address, timeout=20, retries=0) as c:
            while not stop.is_set():
                try:
                    c.get_blobs(BIG, rnd.choice(prompts))
                except Exception as exc:  # noqa: BLE001
                    failures.append(exc)
                    return

    with PromptCacheClient(sidecar.address, timeout=30) as admin:
        hot = [[p * 100_000 + i for i in range(4 * CHUNK)] for p in range(8)]
        for p in hot:
            admin.put_blobs(BIG, p, {i: blob(i) for i in range(4)})
        threads = [threading.Thread(target=sample, daemon=True)]
        threads += [threading.Thread(target=write, args=(s,), daemon=True) for s in range(2)]
        threads += [threading.Thread(target=read, args=(s, hot), daemon=True) for s in range(2)]
        for th in threads:
            th.start()
        try:
            for round_ in range(2):
                assert admin.resize(big).memory_bytes == big
                long_prompt = [10_000_000 * (round_ + 1) + i for i in range(48 * CHUNK)]
                assert admin.put_blobs(BIG, long_prompt, {i: blob(i) for i in range(48)}).stored_chunks == 48
                release = threading.Event()
                with grpc.insecure_channel(sidecar.address, options=OWN_CONNECTION) as get_ch, \
                        grpc.insecure_channel(sidecar.address, options=OWN_CONNECTION) as put_ch:
                    stream = pb_grpc.KVCacheStub(get_ch).Get(
                        pb.GetRequest(model=model_to_proto(BIG), tokens=long_prompt), timeout=60)
                    next(stream)  # then the reader stops: the server blocks mid-chunk, holding its lease
                    puts = [stalled_put(put_ch, [round_ * 1000 + k] * CHUNK, release) for k in range(2)]
                    assert eventually(lambda: t.usage()["reserved"] >= 2 * BIG_BYTES)
                    time.sleep(0.5)  # until the Get's server side blocks on flow control
                    target = BIG_BYTES // 2  # less than the stalled Get's lease, or either stalled Put, alone holds
                    r = admin.resize(target, timeout=20)
                    after = t.usage()
                    assert committed(after) <= target, after
                    assert after["budget"] == target == r.memory_bytes
                    assert r.committed_bytes <= target and r.waited_milliseconds > 0
                    text = metrics_text(sidecar)
                    gauges = {name: float(line.split()[-1]) for line in text.splitlines()
                              for name in ("promptcache_committed_bytes", "promptcache_budget_bytes")
                              if line.startswith(name + '{tier="device"}')}
                    assert gauges["promptcache_committed_bytes"] <= gauges["promptcache_budget_bytes"] == target
                    release.set()
                    # All three were cancelled by the idle watchdog (nothing of the Puts stored): the shrink
                    # waited for them.
                    for f in puts:
                        with pytest.raises(grpc.RpcError):
                            f.result(timeout=10)
                    with pytest.raises(grpc.RpcError) as info:
                        for _ in stream:
                            pass
                    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            stop.set()
            for th in threads:
                th.join(30)
    assert not failures, failures
    assert not over, over[:3]


def test_shrink_blocked_past_the_deadline_fails_and_keeps_the_budget(sidecar_factory):
    sidecar = sidecar_factory(memory_bytes=8 << 20, stream_idle_seconds=0)
    release = threading.Event()
    with grpc.insecure_channel(sidecar.address, options=OWN_CONNECTION) as ch, \
            PromptCacheClient(sidecar.address) as admin:
        fut = stalled_put(ch, list(range(CHUNK)), release)
        assert eventually(lambda: sidecar.tier.usage()["reserved"] == BIG_BYTES)
        with pytest.raises(errors.DeadlineExceeded) as info:
            admin.resize(BIG_BYTES // 2, timeout=1.5)
        assert f"{BIG_BYTES} reserved by Puts in flight" in str(info.value)
        assert f"the budget stays {8 << 20} bytes" in str(info.value)
        assert admin.stats().tiers[0].bytes_budget == 8 << 20
        release.set()
        with pytest.raises(grpc.RpcError):
            fut.result(timeout=10)
        assert eventually(lambda: sidecar.tier.usage()["reserved"] == 0)
        assert admin.resize(BIG_BYTES // 2).memory_bytes == BIG_BYTES // 2
