"""A CPU tier that does not lend keeps each chunk in a mapping of its own (memfd.ProtectedMemory), made read-only
once a Get verified the bytes where they lie (MemoryTier.seal): later Gets send it without hashing it again, a stray
write faults instead of corrupting it, reused memory is writable again, and a chunk never read costs no mprotect."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from promptcache.client import PromptCacheClient
from promptcache.sidecar.memfd import ProtectedMemory
from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.store import MemoryTier
from support import CHUNK, SMALL, make_kv, mapping_permissions

N = 64 << 10
FP = b"f" * 32


def _tier(budget_chunks: int = 4) -> MemoryTier:
    budget = budget_chunks * N
    return MemoryTier(budget, torch.device("cpu"), make_policy("lru", capacity=budget), 60.0)


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _store(t: MemoryTier, i: int, read: bool = True) -> torch.Tensor:
    """Store chunk i; `read`: a Get verified it where it lies (MemoryTier.seal)."""
    r = t.reserve(N, _key(i), bytes(32))
    host = t.host_buffer(r)
    host.fill_(i % 251)  # the bytes arrive: the memory must be writable
    assert t.commit(r, key=_key(i), fingerprint=FP, parent=bytes(32), index=0, data=host, checksum_value=0,
                    shape=(N,), dtype=0)
    if read:
        entry = t.acquire(_key(i), FP)
        t.seal(entry)
        t.release_lease(entry)
    return host


def test_the_first_get_verifies_a_chunk_and_makes_it_read_only_later_gets_do_not_hash_it(sidecar, monkeypatch):
    from promptcache.sidecar import engine

    tokens = list(range(3 * CHUNK))
    kv = make_kv(SMALL, len(tokens))
    hashed, real = [], engine.checksum
    monkeypatch.setattr(engine, "checksum", lambda buf: hashed.append(buf) or real(buf))
    with PromptCacheClient(sidecar.address) as c:
        c.put(SMALL, tokens, kv)
        entries = [sidecar.tier._entries[ch.key] for ch in c.lookup(SMALL, tokens).chunks]
        assert all(e.protectable and not e.immutable for e in entries)  # a Put pays no mprotect
        assert {mapping_permissions(e.data.data_ptr()) for e in entries} == {"rw-p"}
        first = c.get_blobs(SMALL, tokens)
        assert len(hashed) == 3 and all(e.immutable for e in entries)
        assert {mapping_permissions(e.data.data_ptr()) for e in entries} == {"r--p"}
        second = c.get_blobs(SMALL, tokens)
    assert len(hashed) == 3  # not hashed again
    assert all(torch.equal(a, b) and torch.equal(a, e.data) for a, b, e in zip(first, second, entries))


def test_a_stray_write_into_a_stored_chunk_faults_instead_of_corrupting_it():
    script = textwrap.dedent("""
        import torch
        from promptcache.sidecar.policies import make_policy
        from promptcache.sidecar.store import MemoryTier
        t = MemoryTier(1 << 20, torch.device("cpu"), make_policy("lru", capacity=1 << 20), 60.0)
        r = t.reserve(65536, b"k" * 32, bytes(32))
        host = t.host_buffer(r)
        host.fill_(3)
        t.commit(r, key=b"k" * 32, fingerprint=b"f" * 32, parent=bytes(32), index=0, data=host, checksum_value=0,
                 shape=(65536,), dtype=0)
        entry = t.acquire(b"k" * 32, b"f" * 32)
        t.seal(entry)  # a Get verified it
        assert entry.immutable
        print("stored", flush=True)
        host[100] = 4
        print("written", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["stored"], (proc.stdout, proc.stderr)
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])  # SIGSEGV


def test_reused_memory_is_writable_again_and_read_only_once_stored_again():
    t = _tier()
    first = [_store(t, i).data_ptr() for i in range(4)]
    again = _store(t, 4)  # evicts chunk 0 (LRU) and receives into its memory, written by fill_ above
    assert again.data_ptr() == first[0] and bool((again == 4).all())
    assert t._entries[_key(4)].immutable and mapping_permissions(again.data_ptr()) == "r--p"


def test_a_chunk_evicted_while_a_reader_holds_it_is_not_made_read_only():
    t = _tier()
    for i in range(4):
        _store(t, i, read=False)
    entry = t.acquire(_key(0), FP)
    t.delete([_key(0)], FP)
    t.seal(entry)  # its memory goes back to the free list when the reader lets go: no mprotect pair for nothing
    assert not entry.immutable and mapping_permissions(entry.data.data_ptr()) == "rw-p"
    t.release_lease(entry)


def test_past_the_mapping_bound_chunks_get_plain_memory_and_are_hashed():
    pool = ProtectedMemory(limit=1)
    a, own_a = pool.allocate(N)
    b, own_b = pool.allocate(N)
    assert (own_a, own_b) == (True, False) and pool.live == 1
    del a
    import gc

    gc.collect()
    assert pool.live == 0  # unmapped with its last view: the slot is free again
    c, own_c = pool.allocate(N)
    assert own_c and b.numel() == c.numel() == N
