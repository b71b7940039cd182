"""The CUDA device tier, on a real GPU: store, serve, evict, checksums, the budget against torch.cuda's own memory
figures, and bit-exact round trips of CUDA tensors through a real sidecar (in process, and as `promptcache serve
--device cuda`). `make test-gpu` (hack/test-gpu.sh) runs these; without a CUDA device they skip.

The allocator facts the accounting tests rely on (c10/cuda/CUDACachingAllocator.cpp): every block is a multiple of
512 bytes (store.CUDA_BLOCK), and a request under 1 MiB is served from the small pool, whose blocks are split down
to exactly the rounded size, so torch.cuda.memory_allocated() moves by exactly the rounded size per chunk tensor.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from support import CHUNK, SidecarProcess, make_kv, metric
from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes
from promptcache.sidecar.store import CUDA_BLOCK
from promptcache.v1 import kvcache_pb2 as pb

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: run `make test-gpu` on a GPU machine")]

# head_dim 9 in fp16: 2 layers * 2 * 2 heads * 16 tokens * 9 * 2 bytes = 2304 bytes per chunk, not a multiple of
# 512, so the tier's rounding (to 2560) is what the allocator's figures must show.
ODD = ModelSpec("test/cuda-odd", "r1", "float16", num_layers=2, num_kv_heads=2, head_dim=9)
ODD_BYTES = chunk_nbytes(ODD, CHUNK)
ODD_ACCOUNTED = -(-ODD_BYTES // CUDA_BLOCK) * CUDA_BLOCK


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def on_cuda(kv):
    return [(k.cuda(), v.cuda()) for k, v in kv]


def allocated() -> int:
    """Bytes the caching allocator has handed out on the current device, after every kernel and free settled."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def prompts(n: int, chunks: int = 1) -> list[list[int]]:
    return [[p * 100_000 + t for t in range(chunks * CHUNK)] for p in range(n)]


@pytest.fixture
def cuda_sidecar(sidecar_factory):
    def start(**overrides):
        sidecar = sidecar_factory(**{"device": "cuda", **overrides})
        assert sidecar.tier.device.type == "cuda"
        return sidecar
    return start


def test_the_rounding_this_file_relies_on():
    assert ODD_BYTES == 2304 and ODD_ACCOUNTED == 2560 and ODD_ACCOUNTED < 1 << 20


def test_auto_device_is_cuda_and_stats_say_so(sidecar_factory):
    sidecar = sidecar_factory(device="auto")
    assert sidecar.tier.device.type == "cuda"
    with PromptCacheClient(sidecar.address) as c:
        assert c.stats().device.startswith("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("transport", ["grpc", "shm", "bulk"])
def test_cuda_tensors_round_trip_bit_exact(cuda_sidecar, tmp_path, dtype, transport):
    """KV made on the GPU, stored in the CUDA tier, read back onto the GPU: the same bits, whatever the path."""
    shm = tmp_path / "shm"
    shm.mkdir()
    sidecar = cuda_sidecar(grpc_address=f"unix:{tmp_path}/s.sock", shm_dir=str(shm),
                           bulk_address=f"unix:{tmp_path}/bulk.sock")
    spec = ModelSpec("test/cuda", "r1", dtype, num_layers=3, num_kv_heads=2, head_dim=64)
    tokens = list(range(1000, 1000 + 4 * CHUNK + 7))
    kv = on_cuda(make_kv(spec, len(tokens), seed=5))
    tiny = torch.finfo(getattr(torch, dtype)).smallest_normal / 4  # a subnormal: bits, not values (NaN and Inf
    kv[0][0][0, 0, 0, :4] = torch.tensor([tiny, -0.0, -tiny, 0.0])  # are refused: test_load_path.py)
    options = {"grpc": {}, "shm": {"shm_dir": str(shm)}, "bulk": {"bulk_address": sidecar.bulk_address}}[transport]
    with PromptCacheClient(sidecar.address, **options) as c:
        assert c.put(spec, tokens, kv).stored_chunks == 4
        assert all(e.data.is_cuda for e in sidecar.tier._entries.values())
        cached, got = c.get(spec, tokens, device="cuda")
    assert cached == 4 * CHUNK
    for (k, v), (gk, gv) in zip(kv, got):
        assert gk.is_cuda and gk.dtype == k.dtype and gk.shape == (1, 2, cached, 64)
        assert torch.equal(bits(gk), bits(k[:, :, :cached])) and torch.equal(bits(gv), bits(v[:, :, :cached]))
    if transport == "bulk":  # served by the bulk channel, and never lent: a CUDA chunk has no memfd to lend
        assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkGet"}') == 1
        assert metric(sidecar, "promptcache_bulk_lent_chunks_total") == 0


def test_zero_copy_cannot_be_forced_on_a_cuda_tier(sidecar_factory, tmp_path):
    with pytest.raises(ValueError, match="--bulk-zero-copy on: the device tier is on cuda"):
        sidecar_factory(device="cuda", bulk_address=f"unix:{tmp_path}/bulk.sock", bulk_zero_copy="on")


def test_budget_accounting_matches_the_cuda_allocator(cuda_sidecar):
    """The tier's byte counts are what torch.cuda reports it holds: each chunk costs its rounded size, never more;
    the budget bounds the allocator's peak while eviction runs; evicted and purged chunks are really freed."""
    torch.cuda.empty_cache()
    base = allocated()
    budget = 10 * ODD_ACCOUNTED + ODD_ACCOUNTED // 2  # room for 10 chunks
    sidecar = cuda_sidecar(memory_bytes=budget, eviction_policy="lru")
    assert allocated() == base  # an empty tier holds nothing on the GPU
    torch.cuda.reset_peak_memory_stats()
    with PromptCacheClient(sidecar.address) as c:
        for i, p in enumerate(prompts(6)):
            c.put(ODD, p, make_kv(ODD, CHUNK, seed=i))
        assert sidecar.tier.usage()["used"] == 6 * ODD_ACCOUNTED
        assert allocated() - base == 6 * ODD_ACCOUNTED
        assert sidecar.tier.measured_bytes() == 6 * ODD_BYTES  # the storages themselves hold the unrounded bytes
        for i, p in enumerate(prompts(40)[6:], start=6):  # four times the budget: capacity evictions
            c.put(ODD, p, make_kv(ODD, CHUNK, seed=i))
            c.get_blobs(ODD, p)
        usage = sidecar.tier.usage()
        assert usage["entries"] == 10 and usage["reserved"] == usage["draining"] == 0
        assert allocated() - base == usage["used"] == 10 * ODD_ACCOUNTED
        assert torch.cuda.max_memory_allocated() - base <= budget
        assert metric(sidecar, 'promptcache_evictions_total{reason="capacity",tier="device"}') == 30
        assert metric(sidecar, 'promptcache_committed_bytes{tier="device"}') == 10 * ODD_ACCOUNTED
        assert sum(c.purge(ODD)) > 0
    assert sidecar.tier.usage()["used"] == 0
    assert allocated() == base


def test_corrupt_chunk_on_the_gpu_is_dropped_freed_and_never_served(cuda_sidecar):
    sidecar = cuda_sidecar()
    tokens = list(range(3 * CHUNK))
    with PromptCacheClient(sidecar.address) as c:
        c.put(ODD, tokens, make_kv(ODD, len(tokens), seed=2))
        keys = [ch.key for ch in c.lookup(ODD, tokens).chunks]
        before = allocated()
        entry = sidecar.tier._entries[keys[1]]
        entry.data[123] ^= 0x01  # one bit flipped in GPU memory
        del entry
        assert len(c.get_blobs(ODD, tokens)) == 1  # chunk 0 served; the corrupt chunk 1 ends the prefix
        assert c.lookup(ODD, tokens).cached_tokens == CHUNK
    assert metric(sidecar, 'promptcache_checksum_failures_total{tier="device"}') == 1
    assert metric(sidecar, 'promptcache_evictions_total{reason="checksum",tier="device"}') == 1
    assert before - allocated() == ODD_ACCOUNTED  # the dropped chunk's GPU memory went back


def test_resize_on_cuda_frees_what_it_evicts(cuda_sidecar):
    sidecar = cuda_sidecar(memory_bytes=8 * ODD_ACCOUNTED, eviction_policy="lru")
    with PromptCacheClient(sidecar.address) as c:
        for i, p in enumerate(prompts(8)):
            c.put(ODD, p, make_kv(ODD, CHUNK, seed=i))
        held = allocated()
        shrunk = c.resize(3 * ODD_ACCOUNTED)
        assert shrunk.evicted_chunks == 5 and shrunk.bytes_used == 3 * ODD_ACCOUNTED
        assert held - allocated() == 5 * ODD_ACCOUNTED
        assert [c.lookup(ODD, p).cached_tokens for p in prompts(8)] == [0] * 5 + [CHUNK] * 3


def test_disk_tier_behind_a_cuda_tier_demotes_and_promotes_bit_exact(cuda_sidecar, tmp_path):
    pytest.importorskip("rocksdict", reason="the disk tier needs rocksdict (carry its wheel: hack/gpu-wheels.sh)")
    spec = dataclasses.replace(ODD, kv_dtype="bfloat16")
    sidecar = cuda_sidecar(memory_bytes=2 * ODD_ACCOUNTED, disk_bytes=64 << 20, data_dir=str(tmp_path / "data"))
    tokens = list(range(5 * CHUNK))
    kv = make_kv(spec, len(tokens), seed=11)
    with PromptCacheClient(sidecar.address) as c:
        assert c.put(spec, tokens, kv).stored_chunks == 5
        assert sidecar.spill.disk.flush(10)
        assert sorted(ch.tier for ch in c.lookup(spec, tokens).chunks) == ["device"] * 2 + ["disk"] * 3
        cached, got = c.get(spec, tokens, device="cuda")
    assert cached == 5 * CHUNK
    for (k, v), (gk, gv) in zip(kv, got):
        assert torch.equal(bits(gk).cpu(), bits(k)) and torch.equal(bits(gv).cpu(), bits(v))
    assert sidecar.metrics.promotions._value.get() >= 3
    assert all(e.data.is_cuda for e in sidecar.tier._entries.values())  # promoted back onto the GPU
    assert sidecar.tier.usage()["used"] <= 2 * ODD_ACCOUNTED


def test_hf_prefill_on_the_gpu_reuses_the_prefix(cuda_sidecar):
    from promptcache_devtools import models
    from promptcache.client.hf import PromptCacheHF

    sidecar = cuda_sidecar(memory_bytes=64 << 20)
    model = models.tiny_llama("float32").cuda()
    ids = torch.randint(0, 256, (1, 4 * CHUNK + 5), generator=torch.Generator().manual_seed(1)).cuda()
    with PromptCacheClient(sidecar.address) as c:
        pc = PromptCacheHF(model, c, revision="cuda-1")
        first = pc.prefill(ids, logits_to_keep=5)
        assert first.cached_tokens == 0 and pc.flush(10) and first.store.result().stored_chunks == 4
        second = pc.prefill(ids, logits_to_keep=5)
    assert second.cached_tokens == 4 * CHUNK and second.logits.is_cuda
    assert (second.logits - first.logits).abs().max() < 1e-4


def decoded_on(device: str, mode: str, dtype: str = "float32"):
    """(original chunks, the stored blobs decoded by hf.decode_prefix into a buffer on `device`, the error bound)."""
    from promptcache import codec
    from promptcache.client.client import encode_chunk
    from promptcache.client.hf import decode_prefix

    spec = ModelSpec("test/cuda-quant", "r1", dtype, num_layers=2, num_kv_heads=2, head_dim=64, quantization=mode)
    kv = make_kv(spec, 2 * CHUNK, seed=5)
    chunks = [torch.stack([torch.stack((k[0, :, i * CHUNK:(i + 1) * CHUNK], v[0, :, i * CHUNK:(i + 1) * CHUNK]))
                           for k, v in kv]) for i in range(2)]
    blobs = [encode_chunk(spec, kv, i * CHUNK, (i + 1) * CHUNK, 10000.0) for i in range(2)]
    decoded = decode_prefix(spec, blobs, CHUNK, device)
    bound = [codec.error_bound(mode, c.float(), 10000.0) for c in chunks]
    return kv, decoded, bound


@pytest.mark.parametrize("mode", ["k8v8", "k8v4", "k6v4z"])
def test_quantized_chunks_decode_into_gpu_memory_as_on_the_cpu(mode):
    """The transformers integration dequantizes stored chunks straight into the model's KV buffer on the GPU
    (hf.decode_prefix -> codec.unpack(out=...)). k8v4 and k6v4z once failed there (views on the CPU, out on the GPU:
    'Expected all tensors to be on the same device'), and the integration fell back to a full prefill on every
    request. Within the codec's error bound of the original, and the GPU's arithmetic agrees with the CPU's."""
    kv, on_gpu, bound = decoded_on("cuda", mode)
    _, on_cpu, _ = decoded_on("cpu", mode)
    for layer, ((k, v), (gk, gv), (ck, cv)) in enumerate(zip(kv, on_gpu, on_cpu)):
        assert gk.is_cuda and gv.is_cuda
        for i in range(2):
            part = slice(i * CHUNK, (i + 1) * CHUNK)
            for j, (orig, gpu, cpu) in enumerate(((k, gk, ck), (v, gv, cv))):
                err = (gpu[0, :, part].cpu().float() - orig[0, :, part].float()).abs()
                assert (err <= bound[i][layer, j] + 1e-5).all(), (mode, layer, i, j, float(err.max()))
                assert torch.allclose(gpu[0, :, part].cpu(), cpu[0, :, part], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_saves_leave_the_gpu_through_one_page_locked_buffer(dtype):
    """The vLLM connector's save thread (client/staging.py): a request's K/V [L, 2, H, T, D] on the GPU becomes its
    chunks in one cudaHostRegister'ed host buffer, bit-exact as split_chunks of a plain copy, the buffer reused by
    the next save; a save beyond the capacity copies to fresh memory, also exact."""
    from promptcache.client.staging import HostStaging
    from promptcache.client.vllm_layout import split_chunks

    def raw(chunks):
        return [c.view(torch.uint8) for c in chunks]

    s = HostStaging(64 << 20)
    kv = torch.randn(4, 2, 8, 512, 128, device="cuda").to(dtype)  # 8 MiB in bf16
    with s.chunks(kv, 128) as chunks:
        assert s.pinned and s.staged == 1 and all(c.device.type == "cpu" and c.is_contiguous() for c in chunks)
        assert all(torch.equal(a, b) for a, b in zip(raw(chunks), raw(split_chunks(kv.cpu(), 128))))
        first = chunks[0].data_ptr()
    again = kv.float().neg().to(dtype)
    with s.chunks(again, 256) as chunks:
        assert chunks[0].data_ptr() == first and s.staged == 2
        assert all(torch.equal(a, b) for a, b in zip(raw(chunks), raw(split_chunks(again.cpu(), 256))))
    big = torch.randn(4, 2, 8, 8192, 128, device="cuda").to(dtype)  # 128 MiB in bf16, 64 in fp8
    with s.chunks(big, 1024) as chunks:
        assert all(torch.equal(a, b) for a, b in zip(raw(chunks), raw(split_chunks(big.cpu(), 1024))))
    assert s.unstaged == (1 if dtype == torch.bfloat16 else 0)
    s.close()
    assert s.nbytes == 0


def test_loads_reach_the_gpu_through_the_page_locked_buffer_and_it_is_reused_only_after_the_stream():
    """The connector's load thread (client/staging.py uploads, on its own stream): each chunk copied into the
    registered buffer and from it to the GPU asynchronously; leaving waits for the stream, so the next load's
    writes into the buffer cannot reach copies still in flight."""
    from promptcache.client.staging import HostStaging

    s = HostStaging(64 << 20)
    chunks = [torch.randn(4, 2, 8, 128, 128, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
              for i in range(3)] + [torch.randint(0, 256, (4, 2, 8, 128, 128), dtype=torch.uint8)
                                    .view(torch.float8_e4m3fn)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with s.uploads(chunks, torch.device("cuda")) as upload:
            up = [upload(c) for c in chunks]
            assert s.pinned and s.staged == 1 and all(u.is_cuda and u.dtype == c.dtype for u, c in zip(up, chunks))
            copies = [u.view(torch.uint8).clone() for u in up]  # queued on the stream behind the uploads
    zeros = [torch.zeros_like(c) for c in chunks]
    with s.uploads(zeros, "cuda") as upload:
        assert s.staged == 2 and not any(upload(z).view(torch.uint8).any() for z in zeros)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b.view(torch.uint8)) for a, b in zip(copies, chunks))
    # Five chunks through a buffer that holds two: around it, each place rewritten only after the stream
    small = HostStaging(2 * chunks[0].numel() * 2 + (1 << 20))
    many = [torch.randn(4, 2, 8, 128, 128, generator=torch.Generator().manual_seed(10 + i)).to(torch.bfloat16)
            for i in range(5)]
    with torch.cuda.stream(stream):
        with small.uploads(many, torch.device("cuda")) as upload:
            got = [upload(c).clone() for c in many]
    torch.cuda.synchronize()
    assert small.nbytes < sum(c.numel() * 2 for c in many)
    assert all(torch.equal(g.cpu().view(torch.uint8), c.view(torch.uint8)) for g, c in zip(got, many))
    s.close()
    small.close()


def test_a_cuda_tier_serves_through_page_locked_copies_within_their_bound():
    """sinks.PinnedCopies: the bytes of a chunk on the GPU in page-locked host memory (torch's pinned allocator)
    while the copies alive stay within the bound, counted until the last view of each (the array a transport
    sends) is gone; beyond it, a pageable copy; exact both ways."""
    from promptcache.sidecar.sinks import PinnedCopies

    chunks = [torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda") for _ in range(3)]
    copies = PinnedCopies((8 << 20) + (1 << 20))  # room for two 4 MiB copies, not three
    held = [copies.array(c) for c in chunks]  # what host_view hands a transport
    assert copies.live == 8 << 20
    assert all((h == c.cpu().numpy()).all() for h, c in zip(held, chunks))
    assert [torch.from_numpy(h).is_pinned() for h in held] == [True, True, False]
    views = [memoryview(h)[4096:] for h in held]  # a transport's slices keep them counted
    del held
    gc.collect()
    assert copies.live == 8 << 20
    del views
    gc.collect()
    assert copies.live == 0
    again = copies.array(chunks[2])
    assert torch.from_numpy(again).is_pinned() and (again == chunks[2].cpu().numpy()).all()


def test_serve_process_with_the_cuda_tier_round_trips_cuda_tensors(tmp_path):
    """`promptcache serve --device cuda` as a pod runs it: a real process, its own CUDA context."""
    proc = SidecarProcess("--device", "cuda", "--memory-bytes", "256Mi", "--chunk-tokens", "256",
                          "--data-dir", str(tmp_path), "--log-format", "text").wait_ready(120)
    try:
        spec = ModelSpec("test/cuda-process", "r1", "bfloat16", num_layers=30, num_kv_heads=3, head_dim=64)
        tokens = list(range(4 * 256 + 10))
        kv = on_cuda(make_kv(spec, len(tokens), seed=7))
        with PromptCacheClient(proc.address, timeout=60) as c:
            assert c.put(spec, tokens, kv).stored_chunks == 4
            cached, got = c.get(spec, tokens, device="cuda")
            stats = c.stats()
        assert cached == 4 * 256 and stats.device.startswith("cuda")
        for (k, v), (gk, gv) in zip(kv, got):
            assert torch.equal(bits(gk), bits(k[:, :, :cached])) and torch.equal(bits(gv), bits(v[:, :, :cached]))
        device_tier = next(t for t in stats.tiers if t.tier == pb.TIER_DEVICE)
        assert device_tier.bytes_used == 4 * -(-chunk_nbytes(spec, 256) // CUDA_BLOCK) * CUDA_BLOCK
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.proc.stdout.read()
