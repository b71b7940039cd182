"""Zero copy on the bulk channel (docs/bulk-channel.md, "Lent chunks"): stored chunks live in sealed memfds that
the sidecar lends to clients on its unix socket, against a real sidecar and the real client.

What must hold: clients read exactly what was stored; no client can change, resize or punch holes in lent
memory (the kernel's seals refuse it, whatever the client does with its descriptor); corrupt chunks are
never lent; descriptors are not leaked; and the feature turns itself off where it would be unsafe.
"""
from __future__ import annotations

import ctypes
import fcntl
import gc
import mmap
import os
import socket
import time

import grpc
import pytest
import torch

from promptcache.contract import bulkwire
from promptcache.client import PromptCacheClient
from promptcache.client.bulk import LentChunks
from promptcache.sidecar.config import Settings
from promptcache.sidecar.memfd import ChunkMemory
from promptcache.sidecar.app import Sidecar
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.contract.wire import model_to_proto
from support import CHUNK, SMALL, make_kv, mapping_permissions, metric
from test_auth import token_dir  # noqa: F401 - fixture

TOKENS = list(range(3 * CHUNK))


@pytest.fixture
def lending(sidecar_factory, tmp_path):
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", bulk_zero_copy="on")
    assert sidecar.tier.host_memory is not None
    return sidecar


def _client(sidecar, **kw) -> PromptCacheClient:
    return PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, **kw)


def _open_lending(sidecar) -> tuple[socket.socket, bulkwire.FrameReader]:
    family, addr = bulkwire.parse_address(sidecar.bulk_address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(addr)
    reader = bulkwire.FrameReader(s, descriptors=True)
    bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1, sealed_memfds=True)))
    assert reader.frame().status.sealed_memfds
    return s, reader


def _lent_fds(s, reader, tokens=TOKENS) -> list[tuple[pb.ChunkBegin, int]]:
    bulkwire.send(s, pb.BulkFrame(get=pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens)))
    got = []
    while True:
        frame = reader.frame()
        if frame.WhichOneof("frame") == "status":
            assert frame.status.code == 0
            return got
        assert frame.chunk.sealed_memfd
        got.append((frame.chunk, reader.take_fd()))


def test_lent_chunks_are_the_stored_bytes_without_a_copy(lending):
    kv = make_kv(SMALL, len(TOKENS))
    with _client(lending) as c:
        c.put(SMALL, TOKENS, kv)
        n, got = c.get(SMALL, TOKENS)
        views = c.get_blobs(SMALL, TOKENS, copy=False)
        stored = [lending.tier._entries[ch.key].data for ch in c.lookup(SMALL, TOKENS).chunks]
    assert n == len(TOKENS)
    for (k, v), (gk, gv) in zip(kv, got):
        assert torch.equal(gk, k) and torch.equal(gv, v)
    assert all(torch.equal(a, b) for a, b in zip(views, stored))
    # Lent, not copied: the one shared buffer attached is the one the put went through (the gets wrote nothing
    # there), and the sidecar counted every chunk as lent.
    assert metric(lending, "promptcache_bulk_lent_chunks_total") == 6
    assert metric(lending, 'promptcache_requests_total{code="OK",rpc="BulkBuffer"}') == 1
    assert metric(lending, 'promptcache_requests_total{code="OK",rpc="BulkPut"}') == 1
    assert metric(lending, 'promptcache_requests_total{code="OK",rpc="Get"}') == 0


def test_a_client_cannot_change_lent_memory(lending):
    """Every way a client could alter or shrink a lent memfd is refused by the kernel, through the descriptor
    it was given and through a read-write reopen of it; the sidecar then serves the same bytes."""
    with _client(lending) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        before = [b.clone() for b in c.get_blobs(SMALL, TOKENS)]
    s, reader = _open_lending(lending)
    (begin, fd), *rest = _lent_fds(s, reader)
    for _, other in rest:
        os.close(other)
    reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        for target in (fd, reopened):
            with pytest.raises(PermissionError):
                mmap.mmap(target, begin.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(target, b"\xff" * 16, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(target, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(target, begin.nbytes * 2)
            with pytest.raises(PermissionError):
                fcntl.fcntl(target, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            punch = libc.fallocate(target, 0x02 | 0x01, ctypes.c_long(0), ctypes.c_long(4096))  # PUNCH_HOLE
            assert punch == -1 and ctypes.get_errno() == 1  # EPERM
        # A private mapping may be written: the writes stay in this process.
        private = mmap.mmap(fd, begin.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        private[:16] = b"\xff" * 16
        private.close()
    finally:
        os.close(reopened)
        os.close(fd)
        s.close()
    with _client(lending) as c:
        after = c.get_blobs(SMALL, TOKENS)
    assert len(after) == 3 and all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_chunk_is_sealed_and_verified_at_its_first_lend_and_never_hashed_again(lending, monkeypatch):
    """A stored chunk's memfd stays unsealed, its memory reusable, until the chunk is first read. The first lend
    seals it and makes the sidecar's own mapping read-only, then verifies it there (one hash per chunk): from then
    on nothing can change it, so later lends hash nothing."""
    from promptcache.sidecar import engine

    with _client(lending) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        entries = [lending.tier._entries[ch.key] for ch in c.lookup(SMALL, TOKENS).chunks]
        assert not any(e.memfd.sealed or e.immutable for e in entries)
        assert {mapping_permissions(e.data.data_ptr()) for e in entries} == {"rw-s"}
        hashed, real = [], engine.checksum
        monkeypatch.setattr(engine, "checksum", lambda buf: hashed.append(buf) or real(buf))
        assert len(c.get_blobs(SMALL, TOKENS)) == 3
        assert len(hashed) == 3  # the first lend: sealed, then verified where the client maps it
        assert all(e.memfd.sealed and e.memfd.immutable and e.immutable for e in entries)
        assert {mapping_permissions(e.data.data_ptr()) for e in entries} == {"r--s"}
        hashed.clear()
        assert len(c.get_blobs(SMALL, TOKENS)) == 3
        assert hashed == []
    assert metric(lending, "promptcache_bulk_lent_chunks_total") == 6


def test_unread_chunks_memory_is_reused_and_a_lent_chunk_never_is(sidecar_factory, tmp_path):
    """Chunks nobody read leave their memfds to the next chunks when evicted (no new memfd, no fresh pages for
    every Put into a full tier); a chunk that was lent is sealed, so its memfd is never written again: the
    client's mapping still holds what it was lent after the tier turned over many times (LRU, so the lent
    chunks go too)."""
    lending = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", bulk_zero_copy="on", eviction_policy="lru")
    kv = make_kv(SMALL, len(TOKENS))
    nbytes = lending.tier.usage()["budget"]
    with _client(lending) as c:
        c.put(SMALL, TOKENS, kv)
        lent = c.get_blobs(SMALL, TOKENS, copy=False)  # views of the lent memfds, mapped in this process
        lent_bytes = [bytes(v.numpy()) for v in lent]
        keys = {ch.key for ch in c.lookup(SMALL, TOKENS).chunks}
        lent_memfds = [lending.tier._entries[k].memfd for k in keys]  # held: their ids stay theirs
        chunk = len(lent_bytes[0])
        reused = 0
        for round_ in range(3 * (nbytes // (3 * chunk)) + 3):  # three turnovers of the tier
            before = {id(e.memfd) for e in lending.tier._entries.values()}
            tokens = [10**6 + round_ * len(TOKENS) + i for i in range(len(TOKENS))]
            assert c.put(SMALL, tokens, make_kv(SMALL, len(TOKENS), seed=round_ + 1)).stored_chunks == 3
            for e in lending.tier._entries.values():
                assert e.key in keys or all(e.memfd is not m for m in lent_memfds)  # never another chunk's
                reused += e.key not in keys and id(e.memfd) in before  # an evicted chunk's memfd, again
        assert all(k not in lending.tier._entries for k in keys)  # the lent chunks were evicted
        assert [bytes(v.numpy()) for v in lent] == lent_bytes  # unchanged: sealed, never reused
        assert reused > 0
    live = lending.tier.host_memory.live
    assert live <= nbytes // chunk + 3  # memfds reused, not one per chunk ever stored
    assert metric(lending, "promptcache_bulk_lent_chunks_total") == 3


def test_a_corrupt_chunk_is_never_lent_where_its_mapping_stayed_writable(lending):
    """Where the mapping could not be made read-only (mprotect refused), each lend verifies the chunk: one whose
    bytes changed is dropped, never lent. The refusal is simulated by making the mapping writable again."""
    libc = ctypes.CDLL(None, use_errno=True)
    with _client(lending) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        keys = [ch.key for ch in c.lookup(SMALL, TOKENS).chunks]
        entry = lending.tier._entries[keys[1]]
        page = entry.data.data_ptr()
        assert libc.mprotect(ctypes.c_void_p(page), ctypes.c_size_t(4096), mmap.PROT_READ | mmap.PROT_WRITE) == 0
        entry.memfd.immutable = False
        entry.data[3] ^= 0x01
        assert len(c.get_blobs(SMALL, TOKENS)) == 1
    assert metric(lending, 'promptcache_checksum_failures_total{tier="device"}') == 1
    assert metric(lending, "promptcache_bulk_lent_chunks_total") == 1


def test_lent_and_copied_chunks_mix_in_order(lending):
    """Past the descriptor budget chunks live in plain memory: one answer then lends some chunks and sends the
    others' bytes on the socket, in chunk order."""
    lending.tier.host_memory.limit = lending.tier.host_memory.live + 1  # room for one more memfd chunk only
    kv = make_kv(SMALL, len(TOKENS))
    with _client(lending) as c:
        c.put(SMALL, TOKENS, kv)
        n, got = c.get(SMALL, TOKENS)
    assert n == len(TOKENS)
    for (k, v), (gk, gv) in zip(kv, got):
        assert torch.equal(gk, k) and torch.equal(gv, v)
    assert metric(lending, "promptcache_bulk_lent_chunks_total") == 1


def test_lent_mappings_are_reused_and_bounded(lending):
    with _client(lending) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        first = c.get_blobs(SMALL, TOKENS, copy=False)
        second = c.get_blobs(SMALL, TOKENS, copy=False)
        assert [a.data_ptr() for a in first] == [b.data_ptr() for b in second]  # mapped once, reused
        assert c._bulk.lent.mapped_bytes == sum(b.numel() for b in first)
    with _client(lending, bulk_lent_cache_bytes=0) as c:  # nothing kept: each get maps anew
        a, b = c.get_blobs(SMALL, TOKENS, copy=False), c.get_blobs(SMALL, TOKENS, copy=False)
        assert c._bulk.lent.mapped_bytes == 0
        assert all(torch.equal(x, y) and x.data_ptr() != y.data_ptr() for x, y in zip(a, b))


def test_lent_cache_drops_idle_mappings_and_keeps_within_bytes(lending):
    with _client(lending) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        nbytes = c.get_blobs(SMALL, TOKENS)[0].numel()
    s, reader = _open_lending(lending)
    try:
        cache = LentChunks(max_bytes=2 * nbytes, idle_seconds=3600)
        for begin, fd in _lent_fds(s, reader):
            cache.take(fd, begin)
        assert cache.mapped_bytes == 2 * nbytes  # the oldest of three went
        cache.idle_seconds = 0.05
        time.sleep(0.1)
        begin, fd = _lent_fds(s, reader, TOKENS[:CHUNK])[0]
        cache.take(fd, begin)
        assert cache.mapped_bytes == nbytes  # the two idle ones went; the one just taken stays
    finally:
        s.close()


def test_evicted_lent_memory_stays_intact_while_mapped_and_descriptors_are_released(lending):
    base_fds = len(os.listdir("/proc/self/fd"))
    with _client(lending, bulk_lent_cache_bytes=0) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        held = c.get_blobs(SMALL, TOKENS, copy=False)
        expected = [b.clone() for b in held]
        for _ in range(50):
            c.get_blobs(SMALL, TOKENS, copy=False)
        assert lending.tier.host_memory.live == 3
        c.purge(SMALL)
        gc.collect()
        assert lending.tier.host_memory.live == 0  # the sidecar's descriptors are closed...
        assert all(torch.equal(a, b) for a, b in zip(held, expected))  # ...and what the client maps is intact
        assert len(c.get_blobs(SMALL, TOKENS)) == 0
    del held
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= base_fds + 2  # no descriptor leaked on either side


def test_put_may_not_claim_a_sealed_memfd(lending):
    with _client(lending) as c:
        stub = c._stub
        header = pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL), tokens=TOKENS[:CHUNK]))
        blob = torch.zeros(2 * 2 * 2 * CHUNK * 8 * 4, dtype=torch.uint8)
        chunk = pb.PutRequest(chunk=pb.ChunkBegin(index=0, nbytes=blob.numel(), shape=[2, 2, 2, CHUNK, 8],
                                                  dtype=pb.DTYPE_FLOAT32, sealed_memfd=True))
        with pytest.raises(grpc.RpcError) as exc:
            stub.Put(iter([header, chunk, pb.PutRequest(data=blob.numpy().tobytes())]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sealed_memfd" in exc.value.details()


def test_zero_copy_is_off_for_isolated_tenants_unless_asked(sidecar_factory, tmp_path, token_dir):  # noqa: F811
    auto = sidecar_factory(bulk_address=f"unix:{tmp_path}/a.sock", token_file=str(token_dir))
    assert auto.tenancy.isolate and auto.tier.host_memory is None
    on = sidecar_factory(bulk_address=f"unix:{tmp_path}/b.sock", token_file=str(token_dir), bulk_zero_copy="on")
    assert on.tier.host_memory is not None
    with _client(on, token="alice-token-1") as alice, _client(on, token="bob-token-1") as bob:
        alice.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        assert len(alice.get_blobs(SMALL, TOKENS)) == 3
        assert bob.get_blobs(SMALL, TOKENS) == []  # lending changes how chunks travel, not who may read them
    assert metric(on, "promptcache_bulk_lent_chunks_total") == 3


@pytest.mark.parametrize("overrides, words", [
    ({"bulk_address": "127.0.0.1:0", "bulk_zero_copy": "on"}, "needs a unix-socket --bulk-address"),
    ({"bulk_zero_copy": "sometimes"}, "--bulk-zero-copy must be auto, on or off"),
])
def test_bad_zero_copy_settings_are_refused(overrides, words):
    with pytest.raises(ValueError, match=words):
        Sidecar(Settings(grpc_address="127.0.0.1:0", metrics_port=0, **overrides))


def test_chunk_memory_falls_back_to_plain_memory_past_its_limit():
    pool = ChunkMemory(limit=1)
    first, memfd = pool.allocate(4096)
    second, none = pool.allocate(4096)
    assert memfd is not None and none is None and pool.live == 1
    assert memfd.seal() and memfd.sealed
    del memfd
    gc.collect()
    assert pool.live == 0  # the descriptor goes with its SealedChunk...
    assert int(first.sum()) == 0  # ...while the mapping lives on with the tensor


def test_one_sidecar_serves_a_unix_socket_with_zero_copy_and_tcp_without(sidecar_factory, tmp_path):
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock,127.0.0.1:0")
    unix, tcp = sidecar.bulk_addresses
    assert unix == f"unix:{tmp_path}/bulk.sock" and tcp.startswith("127.0.0.1:") and not tcp.endswith(":0")
    kv = make_kv(SMALL, len(TOKENS))
    with PromptCacheClient(sidecar.address, bulk_address=unix) as near, \
            PromptCacheClient(sidecar.address, bulk_address=tcp) as far:
        near.put(SMALL, TOKENS, kv)
        for c in (near, far):
            n, got = c.get(SMALL, TOKENS)
            assert n == len(TOKENS) and all(torch.equal(a, b) for (a, _), (b, _) in zip(kv, got))
    assert metric(sidecar, "promptcache_bulk_lent_chunks_total") == 3  # the unix client's get only
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkGet"}') == 2


@pytest.mark.parametrize("address, words", [
    ("unix:/tmp/a.sock,nowhere", "not HOST:PORT or unix:/PATH"),
    ("127.0.0.1:7000,127.0.0.1:7000", "names an address twice"),
    ("unix:/tmp/a.sock,10.1.2.3:7000", "10.1.2.3:7000 is not loopback"),
])
def test_bad_bulk_address_lists_name_the_bad_address(address, words):
    with pytest.raises(ValueError, match=words):
        Sidecar(Settings(grpc_address="127.0.0.1:0", metrics_port=0, bulk_address=address))
