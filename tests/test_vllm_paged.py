"""promptcache.client.vllm_paged: vLLM's paged KV views (CUDA's standard backends, MLA) <-> canonical chunks, without
vLLM. The views are built here the way vLLM 0.32's create_kv_cache_views builds them (a flat int8 buffer, strides
from the KVCacheLayout's permutation of [L, B, H, N, C bytes], one view per layer cast to the spec's dtype); the
values are written per token slot the way vLLM's cache-write kernels address them (key_cache =
kv.transpose(1, 2).split(head_size, -1), slot = block * N + n). tests/vllm/test_vllm_cuda_layouts.py does the same
with vLLM's own allocator and Triton kernel."""
from __future__ import annotations

import math

import pytest
import torch

from promptcache.client import vllm_paged as vp

LAYOUTS = list(vp.KV_CACHE_LAYOUTS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def vllm_views(layout: str, L: int, B: int, H: int, N: int, C: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """vLLM's create_kv_cache_views for one KVCacheTensor without padding: logical [L, B, H, N, C*itemsize] bytes,
    physical order KV_CACHE_LAYOUTS[layout]."""
    item = torch.empty((), dtype=dtype).element_size()
    shape = (L, B, H, N, C * item)
    order = vp.KV_CACHE_LAYOUTS[layout]
    strides, cur = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = cur
        cur *= shape[dim]
    raw = torch.zeros(math.prod(shape), dtype=torch.int8)
    v5 = torch.as_strided(raw, shape, strides)
    return [v5[i].view(dtype) for i in range(L)]


def random_values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):  # every byte pattern, NaNs included
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def write_tokens(views, kv: torch.Tensor, block_ids, block_size: int, kind: str = "kv") -> None:
    """Reference cache write, as vLLM's reshape_and_cache kernels address the cache: canonical kv [L, parts, H, T, D]
    of T tokens whose token t sits in slot block_ids[t // block_size] * block_size + t % block_size."""
    L, parts, H, T, D = kv.shape
    for layer, view in enumerate(views):
        Nk = view.shape[2]
        raw = view.view(torch.uint8) if view.element_size() == 1 else view
        cells = raw.transpose(1, 2)  # [B, N, H, C]
        src = kv[layer].view(torch.uint8) if kv.element_size() == 1 else kv[layer]
        for t in range(T):
            slot = block_ids[t // block_size] * block_size + t % block_size
            b, n = divmod(slot, Nk)
            for part in range(parts):
                cells[b, n, :, part * D:(part + 1) * D] = src[part, :, t]


def setup(layout, dtype, *, L=3, B=10, H=4, N=8, D=16, ratio=1, kind="kv", blocks=(7, 2, 5), seed=0,
          cache_dtype="auto"):
    parts = 1 if kind == "mla" else 2
    storage = torch.uint8 if dtype.itemsize == 1 else dtype
    views = vllm_views(layout, L, B * ratio, H, N // ratio, parts * D, storage)
    kv = random_values((L, parts, H, len(blocks) * N, D), dtype, seed)
    write_tokens(views, kv, list(blocks), N, kind)
    p = vp.plan(views, block_size=N, num_kv_heads=H, head_size=D, head_size_v=0 if kind == "mla" else D,
                kv_cache_dtype=cache_dtype, kind=kind, engine_layout=layout)
    return views, kv, p


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def raw_bytes(views) -> list[torch.Tensor]:
    return [v.view(torch.uint8) if v.element_size() == 1 else v.view(torch.int8) for v in views]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_returns_the_canonical_kv_and_scatter_puts_back_the_same_bytes(layout, dtype):
    views, kv, p = setup(layout, dtype)
    assert p.order == layout and p.dtype == dtype and p.kind == "kv"
    got = vp.gather(views, p, [7, 2, 5])
    assert same_bits(got, kv)
    empty = vllm_views(layout, 3, 10, 4, 8, 32, dtype)
    vp.scatter(empty, p, [7, 2, 5], got)
    for a, b in zip(raw_bytes(views), raw_bytes(empty), strict=True):
        assert torch.equal(a, b)  # the written blocks match bit for bit, every other byte is still zero


@pytest.mark.parametrize("fmt,torch_fmt", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                           ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_fp8_caches_move_as_raw_bytes_in_their_format(layout, fmt, torch_fmt):
    """vLLM allocates an fp8 cache as uint8; every byte pattern (NaN codes too) comes back as is, in the chunk's
    fp8 format: nothing is converted."""
    views, kv, p = setup(layout, torch_fmt, cache_dtype=fmt)
    assert views[0].dtype == torch.uint8 and p.dtype == torch_fmt and p.storage_dtype == torch.uint8
    got = vp.gather(views, p, [7, 2, 5])
    assert same_bits(got, kv)
    empty = vllm_views(layout, 3, 10, 4, 8, 32, torch.uint8)
    vp.scatter(empty, p, [7, 2, 5], got)
    assert all(torch.equal(a, b) for a, b in zip(views, empty))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLHNC"])
def test_mla_latent_caches_are_one_vector_per_token(layout, dtype):
    """MLA: H = 1, C = the latent (kv_lora_rank + rope dim; 72 here), no V: chunks [L, 1, 1, T, latent]."""
    cache_dtype = "fp8" if dtype.itemsize == 1 else "auto"
    views, kv, p = setup(layout, dtype, H=1, D=72, kind="mla", cache_dtype=cache_dtype)
    assert p.kind == "mla" and p.chunk_shape(3, 24) == (3, 1, 1, 24, 72)
    got = vp.gather(views, p, [7, 2, 5])
    assert got.shape == (3, 1, 1, 24, 72) and same_bits(got, kv)
    empty = vllm_views(layout, 3, 10, 1, 8, 72, views[0].dtype)
    vp.scatter(empty, p, [7, 2, 5], got)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(views, empty))


def test_mla_chunks_do_not_depend_on_the_tp_rank():
    """Every TP rank holds the same latent: two ranks' caches written with the same latents (in different blocks)
    give the same chunk, so one stored copy serves every rank."""
    a, kv, p = setup("LBNHC", torch.bfloat16, H=1, D=72, kind="mla", blocks=(1, 2, 3))
    b, _, q = setup("LBNHC", torch.bfloat16, H=1, D=72, kind="mla", blocks=(9, 0, 4))
    assert same_bits(vp.gather(a, p, [1, 2, 3]), vp.gather(b, q, [9, 0, 4]))


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_blocks_split_manager_blocks(layout):
    """block_size 16 in kernel blocks of 8: block id b is kernel blocks 2b and 2b+1."""
    views, kv, p = setup(layout, torch.float16, N=16, ratio=2)
    assert p.kernel_block_size == 8 and p.ratio == 2 and views[0].shape[0] == 20
    assert same_bits(vp.gather(views, p, [7, 2, 5]), kv)
    empty = vllm_views(layout, 3, 20, 4, 8, 32, torch.float16)
    vp.scatter(empty, p, [7, 2, 5], kv)
    assert all(torch.equal(a, b) for a, b in zip(views, empty))


def test_scatter_chunks_takes_consecutive_chunks_from_a_block_of_the_first():
    views, kv, p = setup("LBNHC", torch.bfloat16, blocks=(0, 1, 2, 3))  # 32 tokens
    chunks = [kv[:, :, :, :16].contiguous(), kv[:, :, :, 16:].contiguous()]
    empty = vllm_views("LBNHC", 3, 10, 4, 8, 32, torch.bfloat16)
    vp.scatter_chunks(empty, p, chunks, 8, [9, 4, 6])  # tokens 8..32 into blocks 9, 4, 6
    assert same_bits(vp.gather(empty, p, [9, 4, 6]), kv[:, :, :, 8:])
    # chunk by chunk: from the middle of the second of four, and fewer blocks than the chunks hold
    quarters = [kv[:, :, :, i:i + 8].contiguous() for i in range(0, 32, 8)]
    other = vllm_views("LBNHC", 3, 10, 4, 8, 32, torch.bfloat16)
    vp.scatter_chunks(other, p, [quarters[0], torch.cat(quarters[1:3], dim=3), quarters[3]], 16, [2])
    assert same_bits(vp.gather(other, p, [2]), kv[:, :, :, 16:24])
    assert all(not v[[0, 1, 3, 4, 5, 6, 7, 8, 9]].view(torch.uint8).any() for v in other)  # nothing else written
    with pytest.raises(ValueError, match="a chunk of 12 tokens is not whole blocks of 8"):
        vp.scatter_chunks(other, p, [kv[:, :, :, :12]], 0, [1])
    with pytest.raises(ValueError, match="not a whole block"):
        vp.scatter_chunks(empty, p, chunks, 4, [9])
    with pytest.raises(ValueError, match="the chunks hold 3"):
        vp.scatter_chunks(empty, p, chunks, 8, [9, 4, 6, 7])
    with pytest.raises(ValueError, match="float16 K/V into a torch.bfloat16"):
        vp.scatter(empty, p, [9], kv[:, :, :, :8].to(torch.float16))
    with pytest.raises(ValueError, match="want"):
        vp.scatter(empty, p, [9, 4], kv[:, :, :, :8])


def test_negative_control_a_conversion_that_ignores_the_strides_fails():
    """Reading an LBNHC cache as if it were LBHNC (contiguous [B, H, N, C], the CPU backend's order) scrambles heads
    and tokens: the control must not match, while the stride-aware gather does."""
    views, kv, p = setup("LBNHC", torch.float32)
    assert same_bits(vp.gather(views, p, [7, 2, 5]), kv)
    wrong = [torch.as_strided(v, v.shape, torch.empty(v.shape).stride()) for v in views]  # LBHNC strides, same bytes
    assert not same_bits(vp.gather(wrong, p, [7, 2, 5]), kv)
    # And K/V swapped in C (a backend that packed [V | K]) is another wrong conversion the bytes expose:
    swapped = vp.gather(views, p, [7, 2, 5]).flip(1)
    assert not same_bits(swapped, kv)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_physical_order_names_every_layout_from_the_strides(layout):
    views = vllm_views(layout, 3, 10, 4, 8, 32, torch.float16)
    assert vp.physical_order(views) == layout


def test_plan_refuses_what_it_cannot_convert_with_a_reason():
    views = vllm_views("LBNHC", 2, 10, 4, 8, 32, torch.float16)
    ok = dict(block_size=8, num_kv_heads=4, head_size=16)
    assert vp.plan(views, **ok, engine_layout="LBNHC").order == "LBNHC"
    cases = [
        (dict(ok, engine_layout="LBHNC"), "the engine says KV cache layout LBHNC but"),
        (dict(ok, engine_layout="XYZ"), "is not one of"),
        (dict(ok, head_size=8), "views hold 32 values per"),
        (dict(ok, head_size_v=8), "diff-KV"),
        (dict(ok, num_kv_heads=2), "4 head slots"),
        (dict(ok, block_size=12), "do not split"),
        (dict(ok, kv_cache_dtype="int8_per_token_head"), "not supported"),
        (dict(ok, kv_cache_dtype="fp8"), "of torch.float16"),
        (dict(ok, kind="mla"), "one latent head"),
        (dict(ok, kind="mamba"), "not kv or mla"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(vp.Unsupported, match=reason):
            vp.plan(views, **kwargs)
    with pytest.raises(vp.Unsupported, match="strides"):
        vp.plan([views[0], views[1].contiguous()], **ok)
    with pytest.raises(vp.Unsupported, match="not contiguous"):
        vp.plan([v[..., ::2] for v in vllm_views("LBNHC", 1, 4, 4, 8, 64, torch.float16)], **ok)
    with pytest.raises(vp.Unsupported, match="int8 is not float32"):
        vp.plan(vllm_views("LBNHC", 1, 4, 4, 8, 32, torch.int8), **ok)
    with pytest.raises(vp.Unsupported, match="no KV cache views"):
        vp.plan([], **ok)


def test_kv_format_names_what_the_bytes_mean():
    """The fingerprint's extra identity: nothing for plain K/V; mla for latents; fp8 adds its format and a digest
    of the per-layer scales: other scales or another format give other keys."""
    _, _, plain = setup("LBNHC", torch.bfloat16)
    _, _, mla = setup("LBNHC", torch.bfloat16, H=1, D=72, kind="mla")
    _, _, e4m3 = setup("LBNHC", torch.float8_e4m3fn, cache_dtype="fp8")
    _, _, e5m2 = setup("LBNHC", torch.float8_e5m2, cache_dtype="fp8_e5m2")
    assert vp.kv_format(plain) == "" and vp.kv_format(mla) == "mla"
    a = vp.kv_format(e4m3, [1.0, 1.0, 0.5], [1.0, 1.0, 1.0])
    assert a.startswith("float8_e4m3fn/scales-")
    assert a != vp.kv_format(e4m3, [1.0, 1.0, 0.25], [1.0, 1.0, 1.0])
    assert a != vp.kv_format(e4m3, [1.0, 1.0, 1.0], [1.0, 1.0, 0.5])  # K and V scales are not interchangeable
    assert vp.kv_format(e5m2, [1.0, 1.0, 0.5], [1.0, 1.0, 1.0]).startswith("float8_e5m2/")
    with pytest.raises(vp.Unsupported, match="scale"):
        vp.kv_format(e4m3)


def test_block_ids_may_come_as_a_tensor_and_in_any_order():
    views, kv, p = setup("LBHNC", torch.float32, blocks=(3, 1, 8))
    assert same_bits(vp.gather(views, p, torch.tensor([3, 1, 8])), kv)
    back = vp.gather(views, p, [8, 1, 3])
    assert same_bits(back[:, :, :, :8], kv[:, :, :, 16:]) and same_bits(back[:, :, :, 16:], kv[:, :, :, :8])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_views_for_benches_are_the_reference_views(layout):
    """vllm_paged.paged_views (the GPU lane's caches, torch alone) builds what this file's reference builds (and
    tests/vllm/test_vllm_cuda_layouts.py compares the stride arithmetic with vLLM's allocator)."""
    a = vp.paged_views(layout, 3, 10, 4, 8, 32, torch.bfloat16)
    b = vllm_views(layout, 3, 10, 4, 8, 32, torch.bfloat16)
    assert [(v.shape, v.stride(), v.dtype) for v in a] == [(v.shape, v.stride(), v.dtype) for v in b]
    assert a[1].data_ptr() - a[0].data_ptr() == b[1].data_ptr() - b[0].data_ptr()
    with pytest.raises(ValueError, match="not one of"):
        vp.paged_views("NHD", 1, 1, 1, 1, 1, torch.float16)


# ------------------------------------------------------------------ fp8 and MLA chunks through a real sidecar
from promptcache.client.client import checked_chunks  # noqa: E402
from promptcache.contract.keys import ModelSpec, request_salt, scales_digest  # noqa: E402
from support import CHUNK  # noqa: E402

FP8 = [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]


def paged_round_trip(client, spec, views, p, src_blocks, dst_blocks, tokens):
    """The connector's worker path without vLLM: gather the blocks, split into chunks, Put them; Get them back,
    check them as the load path does (checked_chunks) and scatter them into a second, empty cache set."""
    kv = vp.gather(views, p, src_blocks)
    chunks = [kv[:, :, :, i:i + CHUNK].contiguous() for i in range(0, kv.shape[3], CHUNK)]
    res = client.put_blobs(spec, tokens, dict(enumerate(chunks)))
    assert res.stored_chunks == len(chunks) and not res.rejected_chunks, res
    blobs = client.get_blobs(spec, tokens)
    got = checked_chunks(spec, blobs, CHUNK)
    dst = [torch.zeros_like(v) for v in views]
    vp.scatter_chunks(dst, p, got, 0, list(dst_blocks))
    return kv, got, dst


@pytest.mark.parametrize("fmt,torch_fmt", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_fp8_chunks_round_trip_through_a_real_sidecar_bit_for_bit(client, layout, fmt, torch_fmt):
    """Every byte pattern (NaN and Inf patterns included: raw bytes, the sidecar neither scans nor quantizes them)
    from vLLM's uint8 views to the sidecar and back into other blocks, bit for bit, under keys carrying the scales."""
    views, kv, p = setup(layout, torch_fmt, N=8, blocks=(7, 2, 5, 1), cache_dtype=fmt, seed=11)
    assert p.dtype == torch_fmt and p.storage_dtype == torch.uint8
    salt = request_salt(b"", kv_scales=scales_digest([2.0, 0.5, 1.0], [0.5, 0.5, 0.25]))
    spec = ModelSpec("fp8-model", "r", str(torch_fmt).removeprefix("torch."), 3, 4, 16, tenant_salt=salt)
    tokens = list(range(100, 132))
    assert (kv.view(torch.uint8) == 0x7F).any() or (kv.view(torch.uint8) == 0xFF).any()  # NaN patterns in there
    stored, got, dst = paged_round_trip(client, spec, views, p, (7, 2, 5, 1), (0, 3, 8, 9), tokens)
    assert same_bits(stored, kv) and all(g.dtype == torch_fmt for g in got)
    assert all(torch.equal(a.view(torch.uint8)[[7, 2, 5, 1]], b.view(torch.uint8)[[0, 3, 8, 9]])
               for a, b in zip(views, dst))
    assert client.lookup(spec, tokens).cached_tokens == 32
    # Negative controls: other scales, the other fp8 format, no scales at all: misses, never these bytes.
    other = scales_digest([2.0, 0.5, 1.0], [0.5, 0.5, 0.5])
    other_fmt = "float8_e5m2" if torch_fmt == torch.float8_e4m3fn else "float8_e4m3fn"
    for miss in (ModelSpec("fp8-model", "r", spec.kv_dtype, 3, 4, 16, tenant_salt=request_salt(b"", kv_scales=other)),
                 ModelSpec("fp8-model", "r", other_fmt, 3, 4, 16, tenant_salt=salt),
                 ModelSpec("fp8-model", "r", spec.kv_dtype, 3, 4, 16)):
        assert client.lookup(miss, tokens).cached_tokens == 0
        assert client.get_blobs(miss, tokens) == []


def test_the_sidecar_refuses_quantizing_fp8_and_mla_chunks(client):
    from promptcache.client import errors

    for spec in (dict(kv_dtype="float8_e4m3fn", num_kv_heads=4), dict(kv_dtype="bfloat16", num_kv_heads=1)):
        msg = __import__("promptcache.v1.kvcache_pb2", fromlist=["pb"])
        model = msg.Model(model_id="m", kv_dtype=msg.DTYPE_FLOAT8_E4M3FN if "float8" in spec["kv_dtype"]
                          else msg.DTYPE_BFLOAT16, num_layers=2, num_kv_heads=spec["num_kv_heads"], head_dim=16,
                          quantization="k8v8", kv_kind=msg.KV_KIND_KV if "float8" in spec["kv_dtype"]
                          else msg.KV_KIND_MLA)
        with pytest.raises(errors.InvalidArgument, match="not available for"):
            client._call(lambda t: client._stub.Lookup(msg.LookupRequest(model=model, tokens=list(range(16))),
                                                       timeout=t), 10)


@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, "auto"), (torch.float8_e4m3fn, "fp8")], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_mla_chunks_round_trip_through_a_real_sidecar_and_never_serve_a_kv_model(client, layout, dtype, fmt):
    """MLA latents [L, 1, 1, T, 576] (kv_kind mla) round-trip bit for bit; a non-MLA spec whose chunks have the same
    bytes ([L, 2, 1, T, 288]) or the same head_dim misses them."""
    views, kv, p = setup(layout, dtype, H=1, N=8, D=576, kind="mla", blocks=(4, 1), cache_dtype=fmt, seed=5)
    name = str(dtype).removeprefix("torch.")
    salt = request_salt(b"", kv_scales=scales_digest([1.0] * 3, [1.0] * 3)) if dtype.itemsize == 1 else b""
    spec = ModelSpec("mla-model", "r", name, 3, 1, 576, tenant_salt=salt, kv_kind="mla")
    tokens = list(range(16))
    stored, got, dst = paged_round_trip(client, spec, views, p, (4, 1), (6, 0), tokens)
    assert stored.shape == (3, 1, 1, 16, 576) and got[0].shape == (3, 1, 1, CHUNK, 576) and same_bits(stored, kv)
    assert all(torch.equal(_raw8(a)[[4, 1]], _raw8(b)[[6, 0]]) for a, b in zip(views, dst))
    for miss in (ModelSpec("mla-model", "r", name, 3, 1, 288, tenant_salt=salt),
                 ModelSpec("mla-model", "r", name, 3, 1, 576, tenant_salt=salt)):
        assert client.lookup(miss, tokens).cached_tokens == 0 and client.get_blobs(miss, tokens) == []
    assert client.lookup(spec, tokens).cached_tokens == 16


def _raw8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_the_transformers_integration_refuses_fp8_and_mla_chunks():
    from promptcache.client.hf import check_spec, decode_prefix

    for spec, what in ((ModelSpec("m", "r", "float8_e4m3fn", 2, 2, 8), "float8_e4m3fn chunks"),
                       (ModelSpec("m", "r", "float8_e5m2", 2, 2, 8), "float8_e5m2 chunks"),
                       (ModelSpec("m", "r", "bfloat16", 2, 1, 576, kv_kind="mla"), "mla \\(latent\\) chunks")):
        with pytest.raises(ValueError, match=what):
            check_spec(spec)
        with pytest.raises(ValueError, match=what):
            decode_prefix(spec, [torch.zeros(16, dtype=torch.uint8)], CHUNK, "cpu")
    assert check_spec(ModelSpec("m", "r", "bfloat16", 2, 2, 8))


def test_mla_chunks_have_no_k_and_v_in_the_generic_client(client):
    """client.put/get speak per-layer (K, V): an MLA spec is refused there with the way that works (blobs)."""
    spec = ModelSpec("mla-model", "r", "bfloat16", 2, 1, 576, kv_kind="mla")
    kv = [(torch.zeros(1, 1, CHUNK, 576, dtype=torch.bfloat16),) * 2] * 2
    with pytest.raises(ValueError, match="mla chunks hold no K and V: put them as blobs"):
        client.put(spec, list(range(CHUNK)), kv)
    from promptcache.client.client import decode_chunks

    with pytest.raises(ValueError, match="mla chunks hold no K and V: get them as blobs"):
        decode_chunks(spec, [], CHUNK)
