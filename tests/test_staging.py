"""The save and load threads' host staging (client/staging.py), and the sidecar's page-locked copies of a CUDA tier's
chunks (sidecar/sinks.py): chunks bit-exact as split_chunks makes them, one
reused buffer within its capacity, never handed to two saves at once, loads that go around it only after the stream,
and every way it cannot stage falls back to plain copies.
Page-locking is CUDA's (tests/test_cuda.py runs it on a GPU); here the buffer path runs on CPU tensors with a
recording register function in its place."""
from __future__ import annotations

import pytest
import torch

from promptcache.client.staging import GRAIN, HostStaging
from promptcache.client.vllm_layout import split_chunks


class Registrar:
    def __init__(self, result=True):
        self.result, self.registered, self.unregistered = result, [], []

    def register(self, t):
        if isinstance(self.result, Exception):
            raise self.result
        self.registered.append((t.data_ptr(), t.numel()))
        return self.result

    def unregister(self, t):
        self.unregistered.append((t.data_ptr(), t.numel()))


def kv(tokens=64, dtype=torch.bfloat16, seed=0):
    x = torch.randn(3, 2, 2, tokens, 8, generator=torch.Generator().manual_seed(seed))
    return x.to(dtype)


def staging(capacity=1 << 20, registrar=None, synced=None):
    r = registrar or Registrar()
    sync = (lambda device: synced.append(device)) if synced is not None else (lambda device: None)
    return HostStaging(capacity, devices=("cpu",), register=r.register, unregister=r.unregister,
                       synchronize=sync), r


def same(a, b):
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in zip(a, b)) \
        and len(a) == len(b)


def inside(t, buf_ptr, size):
    return buf_ptr <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= buf_ptr + size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_staged_chunks_are_split_chunks_in_one_reused_page_locked_buffer(dtype):
    s, r = staging()
    x = kv(dtype=dtype)
    with s.chunks(x, 16) as chunks:
        assert same(chunks, split_chunks(x, 16)) and all(c.is_contiguous() and c.dtype == dtype for c in chunks)
        (ptr, size), = r.registered
        assert size == s.nbytes == 1 << 20 and s.pinned  # GRAIN-rounded, capped at the capacity
        assert all(inside(c, ptr, size) for c in chunks)
    y = kv(dtype=dtype, seed=1)
    with s.chunks(y, 32) as again:
        assert same(again, split_chunks(y, 32)) and again[0].data_ptr() == ptr  # the same buffer, not re-registered
    assert len(r.registered) == 1 and s.staged == 2 and s.unstaged == 0


def test_a_save_that_finds_the_buffer_in_use_gets_fresh_copies_and_the_holders_bytes_stay():
    s, _ = staging()
    x, y = kv(seed=1), kv(seed=2)
    with s.chunks(x, 16) as held:
        before = [c.clone() for c in held]
        with s.chunks(y, 16) as other:  # (another thread, in the connector: the lock is not re-entrant)
            assert same(other, split_chunks(y, 16))
            assert not any(inside(o, held[0].data_ptr(), s.nbytes) for o in other)
        assert same(held, before) and same(held, split_chunks(x, 16))
    assert (s.staged, s.unstaged) == (1, 1)


def test_a_save_larger_than_the_capacity_is_not_staged_and_nothing_is_allocated():
    s, r = staging(capacity=4096)
    x = kv()  # 3*2*2*64*8 bf16 = 12 KiB
    with s.chunks(x, 32) as chunks:
        assert same(chunks, split_chunks(x, 32))
    assert (s.staged, s.unstaged, s.nbytes, r.registered) == (0, 1, 0, [])
    s0, r0 = staging(capacity=0)
    with s0.chunks(x, 32) as chunks:
        assert same(chunks, split_chunks(x, 32))
    assert s0.nbytes == 0 and r0.registered == []


def test_the_buffer_grows_in_grains_within_the_capacity_and_unpins_what_it_replaces():
    s, r = staging(capacity=3 * GRAIN)
    small, big = torch.zeros(GRAIN // 2, dtype=torch.uint8), torch.ones(GRAIN + 8, dtype=torch.uint8)
    with s.chunks(small.view(1, 1, 1, -1, 1), GRAIN // 2) as chunks:
        assert same(chunks, [small.view(1, 1, 1, -1, 1)])
    assert s.nbytes == GRAIN
    with s.chunks(big.view(1, 1, 1, -1, 1), GRAIN + 8) as chunks:
        assert same(chunks, [big.view(1, 1, 1, -1, 1)])
    assert s.nbytes == 2 * GRAIN and [n for _, n in r.registered] == [GRAIN, 2 * GRAIN]
    assert r.unregistered == r.registered[:1]
    s.close()
    assert r.unregistered == r.registered and s.nbytes == 0


@pytest.mark.parametrize("result", [False, OSError("cudaErrorHostMemoryAlreadyRegistered")])
def test_a_buffer_that_cannot_be_page_locked_is_used_pageable_and_never_unregistered(result):
    s, r = staging(registrar=Registrar(result))
    x = kv()
    with s.chunks(x, 16) as chunks:
        assert same(chunks, split_chunks(x, 16))
    assert not s.pinned and s.staged == 1
    s.close()
    assert r.unregistered == []


def test_tensors_of_an_unstaged_device_are_split_where_they_are():
    r = Registrar()
    s = HostStaging(1 << 20, register=r.register, unregister=r.unregister)  # stages CUDA tensors only
    x = kv()
    with s.chunks(x, 16) as chunks:
        assert same(chunks, split_chunks(x, 16))
    assert (s.staged, s.unstaged, r.registered) == (0, 0, [])


def test_bad_chunking_and_capacity_are_refused_by_name():
    s, _ = staging()
    with pytest.raises(ValueError, match="64 tokens are not whole chunks of 24"):
        with s.chunks(kv(), 24):
            pass
    with pytest.raises(ValueError, match="staging capacity must be >= 0 bytes"):
        HostStaging(-1)
    assert s.nbytes == 0


def test_uploads_copy_each_chunk_into_its_own_place_and_wait_for_the_stream_before_giving_the_buffer_back():
    synced = []
    s, r = staging(synced=synced)
    chunks = [kv(seed=i)[:, :, :, :16].contiguous() for i in range(3)] + [kv(dtype=torch.float8_e4m3fn)]
    with s.uploads(chunks, "cpu") as upload:  # (a CPU "device" stands in for CUDA: the copies are the buffer's slots)
        up = [upload(c) for c in chunks]
        (ptr, size), = r.registered
        assert same(up, chunks) and all(inside(u, ptr, size) for u in up) and [u.dtype for u in up] == \
            [c.dtype for c in chunks] and [u.shape for u in up] == [c.shape for c in chunks]
        assert len({u.data_ptr() for u in up}) == 4 and synced == []  # no slot shared; not waited for yet
        with s.uploads(chunks[:1], "cpu") as busy:  # the buffer is held: copied from where it is
            assert busy(chunks[0]) is chunks[0]
    assert synced == [torch.device("cpu")] and (s.staged, s.unstaged) == (1, 1)
    with pytest.raises(RuntimeError, match="scatter failed"):
        with s.uploads(chunks, "cpu") as upload:
            upload(chunks[0])
            raise RuntimeError("scatter failed")
    assert len(synced) == 2  # waited for even then, and the buffer is free again
    with s.uploads(chunks, "cpu") as upload:
        assert inside(upload(chunks[0]), ptr, size)
    noncontiguous = kv(seed=5)[:, :, :, 8:24]
    with s.uploads([noncontiguous], "cpu") as upload:
        assert same([upload(noncontiguous)], [noncontiguous])


def test_uploads_beyond_the_capacity_go_around_the_buffer_waiting_for_the_stream_before_a_place_is_reused():
    synced = []
    piece = kv(seed=0)[:, :, :, :16].contiguous()
    n = piece.numel() * piece.element_size()  # 3 KiB
    s, r = staging(capacity=2 * n + n // 2, synced=synced)  # two chunks fit, a third does not
    chunks = [kv(seed=i)[:, :, :, :16].contiguous() for i in range(5)]
    with s.uploads(chunks, "cpu") as upload:
        (ptr, size), = r.registered
        assert size == 2 * n + n // 2  # sized to the capacity, not to the five chunks
        first, second = upload(chunks[0]), upload(chunks[1])
        assert synced == [] and same([first, second], chunks[:2])
        copies = [first.clone(), second.clone()]  # what the device received before the buffer is reused
        third = upload(chunks[2])  # around the ring: waited for the stream, then written over the first place
        assert synced == [torch.device("cpu")] and third.data_ptr() == ptr and same([third], chunks[2:3])
        fourth, fifth = upload(chunks[3]), upload(chunks[4])
        assert len(synced) == 2 and fifth.data_ptr() == ptr and same([fourth, fifth], chunks[3:])
        assert same(copies, chunks[:2])
        big = kv(tokens=64, seed=9)  # 12 KiB: larger than the buffer, copied from where it is
        assert upload(big) is big and len(synced) == 2
    assert len(synced) == 3 and (s.staged, s.unstaged) == (1, 0)


def test_scatter_chunks_through_uploads_writes_what_it_writes_from_host_chunks_and_uploads_only_the_chunks_used():
    from promptcache.client import vllm_paged

    L, H, N, D, B = 3, 2, 4, 8, 12
    chunks = [kv(tokens=16, seed=i).float()[:, :, :H, :, :D] for i in range(3)]  # [L, 2, H, 16, D]
    views = vllm_paged.paged_views("LBNHC", L, B, H, N, 2 * D, torch.float32, torch.device("cpu"))
    p = vllm_paged.plan(views, block_size=N, num_kv_heads=H, head_size=D, engine_layout="LBNHC")
    ids = [7, 2, 9, 0, 11, 4, 5, 1]  # 8 blocks from token 16 on: the second and third chunks only
    plain = vllm_paged.paged_views("LBNHC", L, B, H, N, 2 * D, torch.float32, torch.device("cpu"))
    vllm_paged.scatter_chunks(plain, p, chunks, 16, ids)
    s, _ = staging()
    seen = []
    with s.uploads(chunks, "cpu") as upload:
        def recording(c):
            seen.append(c.data_ptr())
            return upload(c)

        vllm_paged.scatter_chunks(views, p, chunks, 16, ids, recording)
    assert seen == [chunks[1].data_ptr(), chunks[2].data_ptr()] and s.staged == 1
    assert all(torch.equal(a, b) for a, b in zip(views, plain))
    assert any(v.any() for v in views)


def test_uploads_without_a_buffer_or_to_an_unstaged_device_are_plain_copies():
    synced = []
    s, r = staging(capacity=0, synced=synced)  # staging_bytes 0
    chunks = [kv()]
    with s.uploads(chunks, "cpu") as upload:
        assert upload(chunks[0]) is chunks[0]  # .to() of a tensor already there
    assert (s.staged, s.unstaged, r.registered, synced) == (0, 1, [], [])
    plain = HostStaging(1 << 20, register=Registrar().register)  # stages CUDA only
    with plain.uploads(chunks, "cpu") as upload:
        assert upload(chunks[0]) is chunks[0]
    assert (plain.staged, plain.unstaged, plain.nbytes) == (0, 0, 0)


def test_pinned_copies_of_a_cuda_tier_count_until_the_last_view_is_gone_and_fall_back_without_cuda():
    """sinks.PinnedCopies (the sidecar's copies of a CUDA tier's chunks; tests/test_cuda.py runs it on a GPU): here,
    without page-locked memory, every copy is a plain one and nothing stays counted."""
    import gc

    from promptcache.sidecar.sinks import PinnedCopies

    copies = PinnedCopies(1 << 20)
    t = torch.arange(1000, dtype=torch.int32)
    view = copies.array(t)
    assert (view == t.numpy()).all()
    assert copies.live == (4000 if torch.cuda.is_available() else 0)  # counted while the array lives, where pinned
    del view
    gc.collect()
    assert copies.live == 0
    big = torch.zeros(1 << 19, dtype=torch.int32)  # 2 MiB: beyond the bound, copied as before
    assert (copies.array(big) == 0).all() and copies.live == 0


def test_a_save_larger_than_the_buffer_is_staged_in_parts_of_whole_chunks_that_fit():
    s, r = staging(capacity=3 * 3 * 2 * 2 * 8 * 8 * 2 + 100)  # three 8-token chunks of kv() in bf16, and a little
    x = kv(tokens=64)  # eight chunks of 8 tokens
    parts = s.parts(x, 8)
    assert parts == [slice(0, 24), slice(24, 48), slice(48, 64)]
    got = []
    for part in parts:
        with s.chunks(x[:, :, :, part], 8) as chunks:
            (ptr, size), = r.registered
            assert all(inside(c, ptr, size) for c in chunks)
            got += [c.clone() for c in chunks]
    assert same(got, split_chunks(x, 8)) and s.staged == 3 and s.unstaged == 0
    assert s.parts(x, 32) == [slice(0, 64)]  # a chunk larger than the buffer: one part, copied as before
    assert s.parts(kv(tokens=16), 8) == [slice(0, 16)]  # fits
    plain, _ = staging(capacity=0)
    assert plain.parts(x, 8) == [slice(0, 64)]
    cuda_only = HostStaging(1024)
    assert cuda_only.parts(x, 8) == [slice(0, 64)]  # CPU tensors are not staged: one Put as before
