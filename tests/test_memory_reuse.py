"""The memory tier reuses the host memory of chunks that left (MemoryTier._give_back): never while a reader still
holds the chunk, never beyond the budget, and a Put into reused memory takes no page faults."""
from __future__ import annotations

import resource

import torch

from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.store import MemoryTier

N = 64 << 10


def tier(budget_chunks: int = 4, recycle: bool = True) -> MemoryTier:
    budget = budget_chunks * N
    return MemoryTier(budget, torch.device("cpu"), make_policy("lru", capacity=budget), 60.0, recycle=recycle)


def store(t: MemoryTier, i: int, fill: int | None = None) -> torch.Tensor:
    key = i.to_bytes(4, "little") * 8
    r = t.reserve(N, key, bytes(32))
    host = t.host_buffer(r)
    host.fill_(i % 251 if fill is None else fill)
    assert t.commit(r, key=key, fingerprint=b"f" * 32, parent=bytes(32), index=0, data=host, checksum_value=0,
                    shape=(N,), dtype=0)
    return host


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_an_evicted_chunks_memory_is_the_next_chunks():
    t = tier()
    first = [store(t, i).data_ptr() for i in range(4)]
    again = store(t, 4)  # evicts chunk 0 (LRU) for room
    assert again.data_ptr() == first[0]
    assert t.holds(key(4), b"f" * 32) and not t.holds(key(0), b"f" * 32)


def test_memory_a_reader_holds_is_not_reused_until_it_lets_go():
    t = tier()
    for i in range(4):
        store(t, i, fill=7)
    held = t.acquire(key(0), b"f" * 32)  # a Get is sending chunk 0
    ptr = held.data.data_ptr()
    t.delete([key(0)], b"f" * 32)
    fresh = store(t, 10, fill=9)
    assert fresh.data_ptr() != ptr and bool((held.data == 7).all())  # the reader's bytes are untouched
    t.release_lease(held)
    t.delete([key(1)], b"f" * 32)
    assert {store(t, 11).data_ptr(), store(t, 12).data_ptr()} >= {ptr}


def test_free_memory_and_stored_bytes_never_pass_the_budget():
    t = tier(budget_chunks=4)
    for i in range(4):
        store(t, i)
    t.purge(b"f" * 32)
    assert t._free_bytes == 4 * N  # all four kept: the budget is free
    t.resize(2 * N)
    assert t._free_bytes == 0  # a shrink gives it back to the system
    for i in range(8):
        store(t, 20 + i)
        assert t._free_bytes + t.usage()["used"] <= t.budget


def test_a_put_cut_short_gives_its_memory_back():
    t = tier()
    r = t.reserve(N, key(30), bytes(32))
    ptr = t.host_buffer(r).data_ptr()
    t.release(r)
    assert store(t, 31).data_ptr() == ptr


def test_recycle_off_never_reuses():
    t = tier(recycle=False)
    for i in range(4):
        store(t, i)
    t.purge(b"f" * 32)
    assert t._free_bytes == 0


BIG = 1 << 20


def _put_round(t: MemoryTier, base: int, n: int = 8) -> None:
    for i in range(n):
        r = t.reserve(BIG, key(base + i), bytes(32))
        host = t.host_buffer(r)
        host.fill_(1)
        t.commit(r, key=key(base + i), fingerprint=b"f" * 32, parent=bytes(32), index=0, data=host,
                 checksum_value=0, shape=(BIG,), dtype=0)


def _faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_puts_into_reused_memory_take_no_page_faults():
    """1 MiB chunks: memory given back by a purge is the next Puts' (4 KiB pages would fault 256 times a chunk)."""
    t = MemoryTier(8 * BIG, torch.device("cpu"), make_policy("lru", capacity=8 * BIG), 60.0)
    _put_round(t, 0)

    def rounds():
        for k in range(1, 4):
            t.purge(b"f" * 32)
            _put_round(t, 100 * k)
    faults = _faults(rounds)
    assert faults <= 64, f"{faults} page faults for 24 MiB of Puts into reused memory"
