"""Between vLLM's paged KV blocks and PromptCache's canonical chunks. Pure tensor functions, no vLLM import.

vLLM's CPU attention backend keeps each layer's cache as [num_blocks, kv_heads, block_size, 2 * head_dim]; the
kernel reads it as [num_blocks, kv_heads, 2 * block_size * head_dim] per (block, head): the block's K first, then
its V, each N x D values (N = block_size, D = head_dim) packed as the kernel's instruction set wants it:

* ``cpu_vec``  (fp32/fp16 on AVX-512/AVX2, the "vec" ISA): K transposed, [D, N]; V as [N, D].
* ``cpu_amx``  (bf16 on an AMX CPU): VNNI pairs, K [N/16][D/2][16][2], V [D/16][N/2][16][2].
* ``token_major``: K and V both [N, D] (the plain layout; used as the negative control in the tests).

A layout is described by where each (token n, dim d) of K and of V sits inside the 2*N*D values of one
(block, head): :func:`gather_index` returns, in canonical order [2 (K, V), N, D], the position of each value.
The canonical chunk is [layers, 2, kv_heads, chunk_tokens, head_dim] (promptcache.layout), so one chunk of C
tokens is C/N consecutive blocks.
"""
from __future__ import annotations

import torch

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
    T = kv.shape[3]
    if T % chunk_tokens:
        raise ValueError(f"{T} tokens are not whole chunks of {chunk_tokens}")
    return [kv[:, :, :, i:i + chunk_tokens].contiguous() for i in range(0, T, chunk_tokens)]
