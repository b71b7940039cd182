"""vLLM's paged KV views (the standard attention backends: CUDA's FlashAttention, Triton, FlashInfer; MLA) <-> the
canonical chunk layout. Pure torch functions, no vLLM import, every copy on the cache's own device.

What vLLM 0.32/0.33 hands a worker (``vllm.v1.kv_cache_interface.create_kv_cache_views``): one tensor per layer
with the *logical* shape ``[B, H, N, C]``: blocks, head slots, tokens of a kernel block, and the content of one
(head, token) cell. For the standard backends C is ``[K | V]`` (``head_size + head_size_v`` values: the backends
split it with ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); for MLA, H is 1 and C is the one latent
vector of the token (``kv_lora_rank + qk_rope_head_dim`` values), identical on every TP rank. The *physical* order
is the engine's ``KVCacheLayout`` (``cache_config.kv_cache_layout``), one for the whole model: LBNHC by default,
LBHNC when a connector requires it (NIXL, offloading) or on the CPU platform; BLHNC/BLNHC/LHBNC/BHLNC interleave
layers or heads. The views carry it as strides, so indexing them is correct for every order; this module reads the
strides only to name the order (``physical_order``) and to check them against what the engine says.

A manager block (what the scheduler's block ids count, ``block_size`` tokens) may be split into kernel blocks
(``N = kernel_block_size``, ``B = num_blocks * block_size / N``, uniformly strided): block id b is kernel blocks
``b*r .. b*r + r - 1`` (``vllm.v1.kv_cache_interface.group_kernel_blocks``).

Canonical chunks (promptcache.contract.layout): ``[layers, 2 (K, V), kv_heads, tokens, head_dim]``; for MLA
``[layers, 1, 1, tokens, latent]``. An fp8 cache (vLLM allocates it as uint8) moves as raw bytes, never converted:
the chunk is the same bytes viewed as the cache's fp8 format (``torch.float8_e4m3fn`` / ``float8_e5m2``); the format
(ModelSpec.kv_dtype) and the per-layer scales (request_salt's kv_scales, keys.scales_digest) are part of the chunks'
keys, and MLA chunks are kv_kind "mla" (:func:`kv_format` names all three), so chunks written under other scales, in
the other format or of the other kind are never read.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# vLLM's KVCacheLayout names -> stride permutation of the logical [L, B, H, N, C] axes (vllm/v1/kv_cache_layout.py).
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
# vLLM's kv_cache_dtype strings for an fp8 cache -> the torch format of its bytes (CUDA's fp8_dtype is e4m3fn).
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PLAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Unsupported(ValueError):
    """The reported layout is not one this module converts: the connector stays inert with this reason."""


@dataclass(frozen=True)
class PagedLayout:
    """How one model's per-layer views map to canonical chunks (built by :func:`plan`)."""

    kind: str  # "kv": C = [K | V]; "mla": C = one latent vector
    num_heads: int  # H of the views (kv heads of this rank; 1 for MLA)
    head_dim: int  # K's (and V's) values per head; MLA: the latent's
    block_size: int  # tokens of a manager block (what block ids count)
    kernel_block_size: int  # N of the views
    dtype: torch.dtype  # the canonical chunks' dtype: the cache's, or its fp8 format
    storage_dtype: torch.dtype  # the views' element type (uint8 for fp8)
    order: str  # the physical order the strides show, a KV_CACHE_LAYOUTS name or "?"

    @property
    def ratio(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def kv_parts(self) -> int:
        return 1 if self.kind == "mla" else 2

    def chunk_shape(self, num_layers: int, tokens: int) -> tuple[int, int, int, int, int]:
        return (num_layers, self.kv_parts, self.num_heads, tokens, self.head_dim)


def physical_order(views: Sequence[torch.Tensor]) -> str:
    """The KVCacheLayout name the views' strides show ([B, H, N, C] per layer; several layers: where the layer
    stride falls, from the distance between their first elements), or "?" (one layer with a layer order that cannot
    be told, or strides no layout gives)."""
    v = views[0]
    strides = {1: v.stride(0), 2: v.stride(1), 3: v.stride(2), 4: v.stride(3)}
    sizes = {1: v.shape[0], 2: v.shape[1], 3: v.shape[2], 4: v.shape[3]}
    if len(views) > 1:
        strides[0] = (views[1].data_ptr() - views[0].data_ptr()) // v.element_size()
        sizes[0] = len(views)
    # Physical order = dims by decreasing stride; singleton dims (H = 1, one layer) may sit anywhere: any layout
    # whose order agrees with the strides of the non-singleton dims matches; the first in KV_CACHE_LAYOUTS wins
    # (so one layer reads as layer-compact).
    for name, order in KV_CACHE_LAYOUTS.items():
        dims = [d for d in order if d in strides and sizes[d] > 1]
        if all(strides[a] > strides[b] for a, b in zip(dims, dims[1:])):
            return name
    return "?"


def _check_order(order: str, engine_layout: str | None, views: Sequence[torch.Tensor]) -> None:
    if engine_layout is None:
        return
    if engine_layout not in KV_CACHE_LAYOUTS:
        raise Unsupported(f"KV cache layout {engine_layout!r} is not one of {', '.join(KV_CACHE_LAYOUTS)}")
    # Compare only what the views can show: the order of H and N within a layer (and of L when several layers).
    want, got = KV_CACHE_LAYOUTS[engine_layout], KV_CACHE_LAYOUTS.get(order)
    if got is None:
        raise Unsupported(f"the KV views' strides {tuple(views[0].stride())} match no vLLM layout")
    v = views[0]
    nh = v.shape[1] > 1 and v.shape[2] > 1
    if nh and (want.index(2) < want.index(3)) != (got.index(2) < got.index(3)):
        raise Unsupported(f"the engine says KV cache layout {engine_layout} but the views' strides "
                          f"{tuple(v.stride())} are {order}")


def plan(views: Sequence[torch.Tensor], *, block_size: int, num_kv_heads: int, head_size: int,
         head_size_v: int | None = None, kv_cache_dtype: str = "auto", kind: str = "kv",
         engine_layout: str | None = None) -> PagedLayout:
    """The conversion for vLLM's per-layer views (in layer order) of one KV cache group, from what vLLM reports:
    its AttentionSpec (block_size, num_kv_heads, head_size, head_size_v, the cache dtype string), whether it is MLA
    (kind "mla": MLAAttentionSpec) and the engine's KVCacheLayout name. Raises Unsupported naming the first thing
    that does not fit: never a guess."""
    if kind not in ("kv", "mla"):
        raise Unsupported(f"KV cache kind {kind!r} is not kv or mla")
    if not views:
        raise Unsupported("no KV cache views")
    head_size_v = head_size if head_size_v is None else head_size_v
    if kind == "mla":
        if head_size_v not in (0, head_size) or num_kv_heads != 1:
            raise Unsupported(f"an MLA cache has one latent head, got {num_kv_heads} heads, V size {head_size_v}")
        content = head_size
    else:
        if head_size_v != head_size:
            raise Unsupported(f"K head size {head_size} != V head size {head_size_v} (diff-KV backends)")
        content = 2 * head_size
    v0 = views[0]
    if kv_cache_dtype in ("auto", None, "", "float32", "float16", "bfloat16", "half", "float"):
        if v0.dtype not in PLAIN_DTYPES:
            raise Unsupported(f"KV cache dtype {v0.dtype} is not float32, float16 or bfloat16")
        dtype = v0.dtype
    elif kv_cache_dtype in FP8_FORMATS:
        if v0.dtype not in (torch.uint8, FP8_FORMATS[kv_cache_dtype]):
            raise Unsupported(f"an {kv_cache_dtype} KV cache of {v0.dtype} (vLLM allocates fp8 as uint8)")
        dtype = FP8_FORMATS[kv_cache_dtype]
    else:
        raise Unsupported(f"KV cache dtype {kv_cache_dtype!r} is not supported (only unquantized or per-tensor fp8)")
    for i, v in enumerate(views):
        if v.dim() != 4 or v.dtype != v0.dtype or tuple(v.shape) != tuple(v0.shape) or v.device != v0.device:
            raise Unsupported(f"KV view {i} is {tuple(v.shape)} {v.dtype} on {v.device}; view 0 is "
                              f"{tuple(v0.shape)} {v0.dtype} on {v0.device}")
        if v.stride() != v0.stride():
            raise Unsupported(f"KV view {i} has strides {v.stride()}, view 0 {v0.stride()}")
    B, H, N, C = v0.shape
    if H != num_kv_heads:
        raise Unsupported(f"KV views hold {H} head slots, the spec {num_kv_heads} KV heads")
    if C != content:
        raise Unsupported(f"KV views hold {C} values per (head, token), {kind} needs {content}")
    if v0.stride(3) != 1:
        raise Unsupported(f"the (head, token) cells are not contiguous (strides {v0.stride()})")
    if N <= 0 or block_size % N or B % (block_size // N):
        raise Unsupported(f"kernel blocks of {N} tokens do not split manager blocks of {block_size} "
                          f"({B} kernel blocks)")
    order = physical_order(views)
    _check_order(order, engine_layout, views)
    return PagedLayout(kind, H, head_size, block_size, N, dtype, v0.dtype, order)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes (index and copy kernels for fp8 are not on every device)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _manager_blocks(view: torch.Tensor, p: PagedLayout) -> torch.Tensor:
    """[B*r, H, N, C] -> [B, r, H, N, C], a view (kernel blocks of one manager block are uniformly strided)."""
    return _raw(view).unflatten(0, (view.shape[0] // p.ratio, p.ratio))


def _ids(block_ids, device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.long)
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def gather(views: Sequence[torch.Tensor], p: PagedLayout, block_ids) -> torch.Tensor:
    """The blocks `block_ids` of every layer -> canonical K/V [L, 2, H, nb*block_size, D] (MLA [L, 1, 1, T, latent])
    in p.dtype, on the views' device: per layer one index_select of whole blocks and one permuting copy."""
    dev = views[0].device
    ids = _ids(block_ids, dev)
    L, nb, H, D, T = len(views), ids.numel(), p.num_heads, p.head_dim, ids.numel() * p.block_size
    out = torch.empty((L, p.kv_parts, H, T, D), dtype=torch.uint8 if p.dtype.itemsize == 1 else p.dtype, device=dev)
    for layer, view in enumerate(views):
        blocks = _manager_blocks(view, p).index_select(0, ids)  # [nb, r, H, N, C]
        cells = blocks.permute(2, 0, 1, 3, 4).reshape(H, T, p.kv_parts, D)  # (head, token) cells in token order
        out[layer].copy_(cells.permute(2, 0, 1, 3))
    return out.view(p.dtype)


def scatter(views: Sequence[torch.Tensor], p: PagedLayout, block_ids, kv: torch.Tensor) -> None:
    """The inverse of gather: canonical K/V [L, 2, H, nb*block_size, D] (any device: moved to the views') into the
    blocks `block_ids` of every layer, one indexed copy of whole blocks per layer."""
    dev = views[0].device
    ids = _ids(block_ids, dev)
    L, nb, H, D = len(views), ids.numel(), p.num_heads, p.head_dim
    want = p.chunk_shape(L, nb * p.block_size)
    if tuple(kv.shape) != want:
        raise ValueError(f"canonical K/V of shape {tuple(kv.shape)} for {nb} blocks: want {want}")
    if kv.dtype != p.dtype:
        raise ValueError(f"{kv.dtype} K/V into a {p.dtype} cache")
    raw = _raw(kv).to(dev, non_blocking=True)
    N, r = p.kernel_block_size, p.ratio
    for layer, view in enumerate(views):
        # [2, H, T, D] -> [T-blocks, r, H, N, 2*D]: (head, token) cells [K | V], blocks first
        cells = raw[layer].permute(1, 2, 0, 3).reshape(H, nb, r, N, p.kv_parts * D)
        _manager_blocks(view, p).index_copy_(0, ids, cells.permute(1, 2, 0, 3, 4))


def scatter_chunks(views: Sequence[torch.Tensor], p: PagedLayout, chunks: Sequence[torch.Tensor], skip: int,
                   block_ids: Sequence[int], upload: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Canonical chunks [L, 2, H, C, D] (consecutive; from token `skip` of the first on) into `block_ids`, chunk by
    chunk: each chunk's blocks in one scatter, straight from where the chunk is (a concatenation on the host first
    was a whole extra copy into fresh memory: on an H200 the load's copy to the device ran at 3.4-5.9 GB/s), or
    from upload(chunk) (HostStaging.uploads: its copy on the views' device, through a page-locked buffer), called
    for the chunks that hold blocks to write, one at a time, just before their scatter."""
    if skip % p.block_size:
        raise ValueError(f"loading from token {skip} of a chunk: not a whole block of {p.block_size}")
    if not block_ids:
        return
    bs, need = p.block_size, len(block_ids) * p.block_size
    for c in chunks:
        if c.shape[3] % bs:
            raise ValueError(f"a chunk of {c.shape[3]} tokens is not whole blocks of {bs}")
    held = sum(c.shape[3] for c in chunks) - skip
    if held < need:
        raise ValueError(f"{len(block_ids)} blocks to write, the chunks hold {max(held, 0) // bs}")
    pos = 0  # the chunk's first token, counted over the chunks
    for c in chunks:
        first, last = max(pos, skip), min(pos + c.shape[3], skip + need)
        if first < last:
            ids = block_ids[(first - skip) // bs:(last - skip) // bs]
            scatter(views, p, ids, (c if upload is None else upload(c))[:, :, :, first - pos:last - pos])
        pos += c.shape[3]


def kv_format(p: PagedLayout, k_scales: Sequence[float] = (), v_scales: Sequence[float] = ()) -> str:
    """What the chunks' bytes mean beyond dtype and shape, as a name (logs, tests; the keys carry the same as
    ModelSpec.kv_kind, kv_dtype and request_salt's kv_scales = keys.scales_digest): "" for a plain (unquantized) K/V
    cache; "mla" for a latent cache; an fp8 cache adds its format and a digest of every layer's K and V scales
    (float32 bits, in layer order), so chunks are never read under other scales or another format."""
    from promptcache.contract.keys import scales_digest

    parts = ["mla"] if p.kind == "mla" else []
    if p.dtype.itemsize == 1:
        if not k_scales or len(k_scales) != len(v_scales):
            raise Unsupported("an fp8 KV cache needs every layer's K and V scale")
        parts.append(f"{str(p.dtype).removeprefix('torch.')}/scales-{scales_digest(k_scales, v_scales).hex()[:32]}")
    return ";".join(parts)


def paged_views(layout: str, num_layers: int, num_blocks: int, num_heads: int, block_size: int, content: int,
                dtype: torch.dtype, device="cpu") -> list[torch.Tensor]:
    """Per-layer views as vLLM 0.32's create_kv_cache_views builds them for one KVCacheTensor without padding (a
    flat int8 buffer; strides from the layout's permutation of the logical [L, B, H, N, C bytes]; each layer's view
    cast to `dtype`): caches in vLLM's layouts with torch alone, for benchmarks and the GPU lane. tests/vllm checks
    the same views against vLLM's own allocator."""
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"KV cache layout {layout!r} is not one of {', '.join(KV_CACHE_LAYOUTS)}")
    item = torch.empty((), dtype=dtype).element_size()
    shape = (num_layers, num_blocks, num_heads, block_size, content * item)
    strides, cur = [0] * 5, 1
    for dim in reversed(KV_CACHE_LAYOUTS[layout]):
        strides[dim] = cur
        cur *= shape[dim]
    raw = torch.zeros(cur, dtype=torch.int8, device=device)
    v5 = torch.as_strided(raw, shape, strides)
    return [v5[i].view(dtype) for i in range(num_layers)]
