"""Between vLLM's paged KV blocks and PromptCache's canonical chunks. Pure tensor functions, no vLLM import.

vLLM's CPU attention backend keeps each layer's cache as [num_blocks, kv_heads, block_size, 2 * head_dim]; the
kernel reads it as [num_blocks, kv_heads, 2 * block_size * head_dim] per (block, head): the block's K first, then
its V, each N x D values (N = block_size, D = head_dim) packed as the kernel's instruction set wants it:

* ``cpu_vec``  (fp32/fp16 on AVX-512/AVX2, the "vec" ISA): K transposed, [D, N]; V as [N, D].
* ``cpu_amx``  (bf16 on an AMX CPU): VNNI pairs, K [N/16][D/2][16][2], V [D/16][N/2][16][2].
* ``token_major``: K and V both [N, D] (the plain layout; used as the negative control in the tests).

A layout is described by where each (token n, dim d) of K and of V sits inside the 2*N*D values of one
(block, head): :func:`gather_index` returns, in canonical order [2 (K, V), N, D], the position of each value.
The canonical chunk is [layers, 2, kv_heads, chunk_tokens, head_dim] (promptcache.contract.layout), so one chunk of C
tokens is C/N consecutive blocks.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from promptcache.client.staging import chunk_slices

LAYOUTS = ("cpu_vec", "cpu_amx", "token_major")


def _positions(layout: str, part: str, n: torch.Tensor, d: torch.Tensor, N: int, D: int) -> torch.Tensor:
    if layout == "token_major" or (layout == "cpu_vec" and part == "v"):
        return n * D + d
    if layout == "cpu_vec":  # K: [D, N]
        return d * N + n
    if layout == "cpu_amx":
        if N % 16 or D % 32:
            raise ValueError(f"layout cpu_amx needs block_size % 16 == 0 and head_dim % 32 == 0, got {N}, {D}")
        if part == "k":  # [N/16][D/2][16][2]
            return ((n // 16) * (D // 2) + d // 2) * 32 + (n % 16) * 2 + d % 2
        return ((d // 16) * (N // 2) + n // 2) * 32 + (d % 16) * 2 + n % 2  # V: [D/16][N/2][16][2]
    raise ValueError(f"unknown KV block layout {layout!r}; known: {', '.join(LAYOUTS)}")


def gather_index(layout: str, block_size: int, head_dim: int) -> torch.Tensor:
    """int64 [2 * N * D]: for canonical (kv, n, d) in row-major order, its position in one (block, head)."""
    N, D = block_size, head_dim
    n = torch.arange(N).view(N, 1).expand(N, D).reshape(-1)
    d = torch.arange(D).view(1, D).expand(N, D).reshape(-1)
    k = _positions(layout, "k", n, d, N, D)
    v = _positions(layout, "v", n, d, N, D) + N * D
    return torch.cat((k, v))


def scatter_index(layout: str, block_size: int, head_dim: int) -> torch.Tensor:
    """The inverse permutation: for each position in one (block, head), its canonical (kv, n, d) index."""
    g = gather_index(layout, block_size, head_dim)
    inv = torch.empty_like(g)
    inv[g] = torch.arange(g.numel())
    return inv


def identify(k_tokens: torch.Tensor, k_dims: torch.Tensor, v_tokens: torch.Tensor, v_dims: torch.Tensor,
             block_size: int, head_dim: int) -> str | None:
    """Which known layout a probe saw, or None. The probe wrote K and V values equal to the token index n, then to the
    dim index d, through the engine's own cache-write kernel; these are the [N * D] regions of one (block, head)
    read back after each write."""
    N, D = block_size, head_dim
    for layout in LAYOUTS:
        try:
            g = gather_index(layout, N, D)
        except ValueError:
            continue
        n = torch.arange(N).repeat_interleave(D).to(k_tokens.dtype)
        d = torch.arange(D).repeat(N).to(k_tokens.dtype)
        kpos, vpos = g[:N * D], g[N * D:] - N * D
        if (torch.equal(k_tokens[kpos], n) and torch.equal(k_dims[kpos], d)
                and torch.equal(v_tokens[vpos], n) and torch.equal(v_dims[vpos], d)):
            return layout
    return None


def blocks_to_canonical(blocks: torch.Tensor, layout_index: torch.Tensor, block_size: int) -> torch.Tensor:
    """[layers, nb, H, 2*N*D] paged blocks -> [layers, 2, H, nb*N, D] canonical K/V of those nb*N tokens."""
    L, nb, H, twond = blocks.shape
    D = twond // (2 * block_size)
    x = blocks.index_select(3, layout_index).view(L, nb, H, 2, block_size, D)
    return x.permute(0, 3, 2, 1, 4, 5).reshape(L, 2, H, nb * block_size, D)


def canonical_to_blocks(kv: torch.Tensor, layout_inverse: torch.Tensor, block_size: int) -> torch.Tensor:
    """[layers, 2, H, nb*N, D] canonical K/V -> [layers, nb, H, 2*N*D] blocks in the engine's layout
    (layout_inverse = scatter_index(...))."""
    L, two, H, T, D = kv.shape
    if two != 2 or T % block_size:
        raise ValueError(f"canonical K/V of shape {tuple(kv.shape)} is not [layers, 2, H, k*{block_size}, D]")
    nb = T // block_size
    x = kv.reshape(L, 2, H, nb, block_size, D).permute(0, 3, 2, 1, 4, 5).reshape(L, nb, H, 2 * block_size * D)
    return x.index_select(3, layout_inverse)


def split_chunks(kv: torch.Tensor, chunk_tokens: int) -> list[torch.Tensor]:
    """[layers, 2, H, k*C, D] -> k contiguous chunks [layers, 2, H, C, D] (the stored blob layout)."""
    return [kv[:, :, :, part].contiguous() for part in chunk_slices(kv.shape[3], chunk_tokens)]


def _block_views(region: torch.Tensor, layout: str, N: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copies) of K and V inside region [nb, H, 2*N*D], indexed [nb, H, n..., d...]: [nb, H, N, D], or for
    cpu_amx K [nb, H, N/16, 16, D/2, 2] and V [nb, H, N/2, 2, D/16, 16] (n and d split the way _split splits them)."""
    nb, H = region.shape[:2]
    k, v = region[..., :N * D], region[..., N * D:]
    if layout == "token_major":
        return k.view(nb, H, N, D), v.view(nb, H, N, D)
    if layout == "cpu_vec":  # K stored [D, N]
        return k.view(nb, H, D, N).transpose(2, 3), v.view(nb, H, N, D)
    if layout == "cpu_amx":  # K stored [N/16][D/2][16][2], V [D/16][N/2][16][2]
        return (k.view(nb, H, N // 16, D // 2, 16, 2).permute(0, 1, 2, 4, 3, 5),
                v.view(nb, H, D // 16, N // 2, 16, 2).permute(0, 1, 3, 5, 2, 4))
    raise ValueError(f"unknown KV block layout {layout!r}; known: {', '.join(LAYOUTS)}")


def _split(t: torch.Tensor, layout: str, part: str, N: int, D: int) -> torch.Tensor:
    nb, H = t.shape[:2]
    if layout != "cpu_amx":
        return t
    if part == "k":
        return t.view(nb, H, N // 16, 16, D // 2, 2)
    return t.view(nb, H, N // 2, 2, D // 16, 16)


def write_layer(region: torch.Tensor, kv: torch.Tensor, layout: str, block_size: int) -> None:
    """Copy one layer's canonical K/V [2, H, nb*N, D] into region [nb, H, 2*N*D] (consecutive blocks, e.g. a slice
    of the engine's cache) in the engine's layout: one strided pass, no intermediate tensor."""
    if region.dtype != kv.dtype:
        raise ValueError(f"{kv.dtype} K/V into a {region.dtype} cache")
    for dest, src in zip(_destination_views(region, layout, block_size, kv.shape[-1]),
                         _source_views(kv[None], layout, block_size), strict=True):
        dest.copy_(src[0])


def _pairs(layout: str, t: torch.Tensor) -> bool:
    """cpu_amx with 16-bit values whose head_dim is contiguous: moved as 32-bit pairs and halves (_source_views)."""
    return layout == "cpu_amx" and t.element_size() == 2 and t.stride(-1) == 1


def _destination_views(cache: torch.Tensor, layout: str, N: int, D: int) -> list[torch.Tensor]:
    """Views of cache [blocks, H, 2*N*D] indexed by block first, each filled by one copy from the matching view of
    _source_views."""
    B, H = cache.shape[:2]
    if _pairs(layout, cache):
        v = cache[..., N * D:].view(B, H, D // 16, N // 2, 16, 2)
        return [cache[..., :N * D].view(torch.int32).view(B, H, N // 16, D // 2, 16), v[..., 0], v[..., 1]]
    return list(_block_views(cache, layout, N, D))


def _source_views(chunk: torch.Tensor, layout: str, N: int) -> list[torch.Tensor]:
    """Views of canonical K/V chunk [layers, 2, H, nb*N, D] indexed [layer, block, ...], matching _destination_views.
    cpu_amx, 16 bits: a copy whose innermost run is the layout's pair of values (2) goes element by element; these
    move runs of 16. K [N/16][D/2][16][2] pairs dims 2j and 2j+1, which sit side by side in canonical K too: as
    32-bit units it is a [16, D/2] -> [D/2, 16] transpose per 16 tokens. V [D/16][N/2][16][2] pairs tokens 2i and
    2i+1: the even tokens go to the low halves, the odd ones to the high halves, each a [N/2, 16] -> [16, N/2]
    transpose per 16 dims."""
    L, _, H, T, D = chunk.shape
    nb = T // N
    k = chunk[:, 0].view(L, H, nb, N, D).transpose(1, 2)  # [L, nb, H, N, D]
    v = chunk[:, 1].view(L, H, nb, N, D).transpose(1, 2)
    if _pairs(layout, chunk):
        k32 = chunk[:, 0].view(torch.int32).view(L, H, nb, N // 16, 16, D // 2).transpose(1, 2).transpose(4, 5)
        pairs = v.unflatten(3, (N // 2, 2)).unflatten(5, (D // 16, 16))  # [L, nb, H, N/2, 2, D/16, 16]
        return [k32, pairs[:, :, :, :, 0].transpose(3, 4), pairs[:, :, :, :, 1].transpose(3, 4)]
    if layout == "cpu_amx":  # n and d split as _block_views splits them
        return [k.unflatten(3, (N // 16, 16)).unflatten(5, (D // 2, 2)),
                v.unflatten(3, (N // 2, 2)).unflatten(5, (D // 16, 16))]
    return [k, v]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    """The same memory as integers of the same width, as numpy: write_chunks copies with numpy, which never splits a
    copy over threads. torch splits each 0.2-0.4 MB copy over its OpenMP threads, which on cores other processes use
    waits for the busy core (2k tokens fp32 here: 0.13 GB/s on two threads, 2.16 GB/s on one), and vLLM's CPU worker
    does not let the connector change the thread count (it replaces torch.set_num_threads)."""
    return t.view(_BITS[t.element_size()]).numpy()


_LAYOUT_IDS = {"cpu_vec": 0, "cpu_amx": 1, "token_major": 2}
STREAM_BYTES = 4 << 20  # a load this large (or larger) is written with streaming stores (_layoutc.c)
_native_lib = None


def native():
    """The compiled writer (_layoutc.c, built by setup.py at install) as a ctypes function, or None when it was not
    built (no C compiler at install) or PROMPTCACHE_NATIVE_LAYOUT=0: write_chunks then copies with numpy."""
    global _native_lib
    if _native_lib is None:
        _native_lib = False
        if os.environ.get("PROMPTCACHE_NATIVE_LAYOUT", "1") != "0":
            for path in sorted(Path(__file__).parent.glob("_layoutc*.so")):
                try:
                    fn = ctypes.CDLL(str(path)).pc_write_chunk
                except (OSError, AttributeError):
                    continue
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.c_int, *[ctypes.c_int64] * 5, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                _native_lib = fn
                break
    return _native_lib or None


def _check_chunks(caches: list[torch.Tensor], chunks: list[torch.Tensor], skip: int, block_ids: list[int],
                  N: int) -> None:
    if skip % N:
        raise ValueError(f"loading from token {skip} of a chunk: not a whole block of {N}")
    for chunk in chunks:
        if chunk.shape[3] % N:
            raise ValueError(f"chunks of {chunk.shape[3]} tokens are not whole blocks of {N}")
        if any(chunk.dtype != cache.dtype for cache in caches):
            raise ValueError(f"{chunk.dtype} chunks into {caches[0].dtype} caches")
    held = sum(chunk.shape[3] // N for chunk in chunks) - skip // N
    if held < len(block_ids):
        raise ValueError(f"{len(block_ids)} blocks to write, the chunks hold {held}")


def write_chunks(caches: list[torch.Tensor], chunks: list[torch.Tensor], skip: int, block_ids: list[int],
                 layout: str, block_size: int) -> None:
    """Copy canonical chunks [layers, 2, H, C, D] (consecutive; from token `skip` of the first on) into the blocks
    `block_ids` of every layer's cache [blocks, H, 2*N*D], straight from the chunks' bytes. With the compiled writer
    (native()) one blocked pass per chunk (register-tile transposes picked by the CPU's
    instruction set, at about memcpy speed with AVX2 or AVX-512); otherwise, or for
    what it does not handle (non-contiguous tensors, other value sizes), write_chunks_portable: the same bits."""
    N = block_size
    fn = native()
    if fn is None or not block_ids or not _native_fits(caches, chunks, block_ids, layout, N):
        return write_chunks_portable(caches, chunks, skip, block_ids, layout, block_size)
    _check_chunks(caches, chunks, skip, block_ids, N)
    L, _, H, _, D = chunks[0].shape
    pointers = (ctypes.c_void_p * len(caches))(*[c.data_ptr() for c in caches])
    ids = np.asarray(block_ids, dtype=np.int64)
    # Streaming stores past a few MiB: the blocks go out to memory instead of reading each line in first.
    stream = int(len(block_ids) * caches[0][0].numel() * caches[0].element_size() * len(caches) >= STREAM_BYTES)
    done = 0
    for chunk in chunks:
        if done == len(block_ids):
            break
        C = chunk.shape[3]
        first = skip // N
        count = min(C // N - first, len(block_ids) - done)
        skip = 0
        if fn(_LAYOUT_IDS[layout], chunk.element_size(), L, H, N, D, C, chunk.data_ptr(), first, count, pointers,
              ids[done:].ctypes.data, stream) != 0:
            raise RuntimeError(f"the compiled layout writer refused {layout} {tuple(chunk.shape)} {chunk.dtype}")
        done += count


def _native_fits(caches, chunks, block_ids, layout: str, N: int) -> bool:
    """Whether the compiled writer handles this call: contiguous CPU tensors of 2- or 4-byte values, caches
    [blocks, H, 2*N*D] holding every block id, chunks [L, 2, H, C, D] of one shape but C, cpu_amx only for 16 bits
    with N % 16 == 0 and D % 32 == 0 (what write_chunks_portable handles too)."""
    if layout not in _LAYOUT_IDS or not chunks or len(caches) != chunks[0].shape[0]:
        return False
    L, two, H, _, D = chunks[0].shape
    esize = chunks[0].element_size()
    if two != 2 or esize not in (2, 4) or (layout == "cpu_amx" and (esize != 2 or N % 16 or D % 32)):
        return False
    tensors = (*caches, *chunks)
    if not all(t.is_contiguous() and t.device.type == "cpu" and t.element_size() == esize for t in tensors):
        return False
    if any(c.dim() != 3 or tuple(c.shape[1:]) != (H, 2 * N * D) for c in caches):
        return False
    if any(c.dim() != 5 or tuple(c.shape[:3]) != (L, 2, H) or c.shape[4] != D for c in chunks):
        return False
    return 0 <= min(block_ids) and max(block_ids) < min(c.shape[0] for c in caches)


def write_chunks_portable(caches: list[torch.Tensor], chunks: list[torch.Tensor], skip: int, block_ids: list[int],
                          layout: str, block_size: int) -> None:
    """write_chunks in torch views and numpy copies, no compiled code: per chunk, layer and run of consecutive block
    ids, one strided copy of K and one of V, no intermediate tensor."""
    N = block_size
    _check_chunks(caches, chunks, skip, block_ids, N)
    if not block_ids:
        return
    D = chunks[0].shape[-1]
    dests = [[_bits(v) for v in _destination_views(cache, layout, N, D)] for cache in caches]
    done = 0  # blocks written
    for chunk in chunks:
        if done == len(block_ids):
            break
        C = chunk.shape[3]
        first = skip // N  # block of the chunk
        count = min(C // N - first, len(block_ids) - done)
        skip = 0
        sources = [_bits(v) for v in _source_views(chunk, layout, N)]
        for at, start, run in block_runs(block_ids[done:done + count]):
            b = first + at
            for layer, views in enumerate(dests):
                for dest, src in zip(views, sources, strict=True):
                    np.copyto(dest[start:start + run], src[layer, b:b + run])
        done += count


def read_layer(region: torch.Tensor, out: torch.Tensor, layout: str, block_size: int) -> None:
    """The inverse of write_layer: region [nb, H, 2*N*D] in the engine's layout -> out [2, H, nb*N, D]."""
    N = block_size
    two, H, T, D = out.shape
    nb = T // N
    ks, vs = _block_views(region, layout, N, D)
    _split(out[0].view(H, nb, N, D).transpose(0, 1), layout, "k", N, D).copy_(ks)
    _split(out[1].view(H, nb, N, D).transpose(0, 1), layout, "v", N, D).copy_(vs)


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in block_ids, first block id, count) for each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs
