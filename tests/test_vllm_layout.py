"""promptcache.client.vllm_layout: vLLM paged KV blocks <-> canonical chunks. Each known layout is checked against an
independent construction of the block from its description (reshape/permute, not the position formulas)."""
from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import pytest
import torch

from promptcache.client import vllm_layout as vl

N, D, H, L = 32, 64, 3, 2


def canonical(nb: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, H, nb * N, D, generator=g)


def build_blocks(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """[L, 2, H, nb*N, D] -> [L, nb, H, 2*N*D], written from the layout's description with reshapes only."""
    nb = kv.shape[3] // N
    k = kv[:, 0].reshape(L, H, nb, N, D).permute(0, 2, 1, 3, 4)  # [L, nb, H, N, D]
    v = kv[:, 1].reshape(L, H, nb, N, D).permute(0, 2, 1, 3, 4)
    if layout == "token_major":
        kb, vb = k, v
    elif layout == "cpu_vec":  # K [D, N], V [N, D]
        kb, vb = k.transpose(-1, -2), v
    elif layout == "cpu_amx":  # K [N/16][D/2][16][2], V [D/16][N/2][16][2]
        kb = k.reshape(L, nb, H, N // 16, 16, D // 2, 2).permute(0, 1, 2, 3, 5, 4, 6)
        vb = v.reshape(L, nb, H, N // 2, 2, D // 16, 16).permute(0, 1, 2, 5, 3, 6, 4)
    else:
        raise AssertionError(layout)
    return torch.cat((kb.reshape(L, nb, H, N * D), vb.reshape(L, nb, H, N * D)), dim=3)


@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_conversions_match_the_layout_description(layout):
    kv = canonical(nb=4)
    blocks = build_blocks(kv, layout)
    assert torch.equal(vl.canonical_to_blocks(kv, vl.scatter_index(layout, N, D), N), blocks)
    assert torch.equal(vl.blocks_to_canonical(blocks, vl.gather_index(layout, N, D), N), kv)


@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_indexes_are_inverse_permutations(layout):
    g, s = vl.gather_index(layout, N, D), vl.scatter_index(layout, N, D)
    assert sorted(g.tolist()) == list(range(2 * N * D))
    assert torch.equal(g[s], torch.arange(2 * N * D)) and torch.equal(s[g], torch.arange(2 * N * D))


def test_a_wrong_layout_does_not_round_trip_to_the_same_values():
    kv = canonical(nb=2)
    blocks = build_blocks(kv, "cpu_vec")
    assert not torch.equal(vl.blocks_to_canonical(blocks, vl.gather_index("token_major", N, D), N), kv)
    assert not torch.equal(vl.blocks_to_canonical(blocks, vl.gather_index("cpu_amx", N, D), N), kv)


def probe_regions(layout: str):
    """What a cache-write kernel using `layout` leaves in one (block, head) after writing n, then d, as values."""
    n = torch.arange(N).view(N, 1).expand(N, D).float()
    d = torch.arange(D).view(1, D).expand(N, D).float()
    out = []
    for values in (n, d):
        kv = values.reshape(1, 1, 1, N, D).expand(L, 2, H, N, D).reshape(L, 2, H, N, D)
        region = build_blocks(kv.contiguous(), layout)[0, 0, 0]
        out.append((region[:N * D], region[N * D:]))
    (kt, vt), (kd, vd) = out
    return kt, kd, vt, vd


@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_identify_names_the_layout_a_probe_saw(layout):
    assert vl.identify(*probe_regions(layout), N, D) == layout


def test_identify_refuses_an_unknown_layout():
    kt, kd, vt, vd = probe_regions("token_major")
    perm = torch.randperm(N * D, generator=torch.Generator().manual_seed(1))
    assert vl.identify(kt[perm], kd[perm], vt[perm], vd[perm], N, D) is None
    kt, kd, vt, vd = probe_regions("cpu_vec")
    assert vl.identify(vt, vd, kt, kd, N, D) is None  # K and V swapped


def test_split_chunks_and_bad_shapes():
    kv = canonical(nb=4)
    chunks = vl.split_chunks(kv, 2 * N)
    assert len(chunks) == 2 and all(c.is_contiguous() and c.shape == (L, 2, H, 2 * N, D) for c in chunks)
    assert torch.equal(torch.cat(chunks, dim=3), kv)
    with pytest.raises(ValueError, match="whole chunks"):
        vl.split_chunks(kv, 3 * N)
    with pytest.raises(ValueError, match="not \\[layers, 2"):
        vl.canonical_to_blocks(kv[:, :, :, :N + 1], vl.scatter_index("cpu_vec", N, D), N)
    with pytest.raises(ValueError, match="unknown KV block layout"):
        vl.gather_index("nhd_flash", N, D)


@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_strided_layer_copies_match_the_index_conversions(layout):
    kv = canonical(nb=4, seed=3)
    blocks = build_blocks(kv, layout)  # [L, nb, H, 2ND]
    for layer in range(L):
        region = torch.zeros(6, H, 2 * N * D)
        vl.write_layer(region[1:5], kv[layer], layout, N)
        assert torch.equal(region[1:5], blocks[layer]) and not region[0].any() and not region[5].any()
        out = torch.empty(2, H, 4 * N, D)
        vl.read_layer(blocks[layer], out, layout, N)
        assert torch.equal(out, kv[layer])


@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_16_bit_layer_copies_match_the_layout_description(layout):
    """bf16 takes cpu_amx's own path (K as 32-bit pairs, V by halves): bit-exact, NaN payloads included."""
    kv = canonical(nb=4, seed=5).bfloat16()
    kv.view(torch.int16)[0, 1, 2, 77, 5] = 0x7FC1  # a NaN with a payload: bits must move, not values
    blocks = build_blocks(kv, layout)
    for layer in range(L):
        region = torch.zeros(6, H, 2 * N * D, dtype=torch.bfloat16)
        vl.write_layer(region[1:5], kv[layer], layout, N)
        assert torch.equal(region[1:5].view(torch.int16), blocks[layer].view(torch.int16))
        assert not region[0].any() and not region[5].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_write_chunks_fills_scattered_blocks_from_a_block_into_the_first_chunk(layout, dtype):
    kv = canonical(nb=6, seed=7).to(dtype)  # 3 chunks of 2 blocks
    chunks = [c.contiguous() for c in kv.split(2 * N, dim=3)]
    blocks = build_blocks(kv, layout)  # [L, 6, H, 2ND]
    caches = [torch.zeros(12, H, 2 * N * D, dtype=dtype) for _ in range(L)]
    ids = [9, 3, 4, 5, 0]  # blocks 1..5 of the prefix (the first one is already in the engine)
    vl.write_chunks(caches, chunks, N, ids, layout, N)
    for layer in range(L):
        for b, block_id in enumerate(ids, start=1):
            assert torch.equal(caches[layer][block_id].view(torch.int16), blocks[layer, b].view(torch.int16))
        untouched = [i for i in range(12) if i not in ids]
        assert not caches[layer][untouched].any()
    with pytest.raises(ValueError, match="not a whole block"):
        vl.write_chunks(caches, chunks, N // 2, ids, layout, N)
    with pytest.raises(ValueError, match="the chunks hold 5"):
        vl.write_chunks(caches, chunks, N, ids + [7], layout, N)
    with pytest.raises(ValueError, match="chunks into"):
        vl.write_chunks(caches, [c.double() for c in chunks], N, ids, layout, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_write_chunks_without_the_compiled_writer_fills_the_same_blocks(layout, dtype, monkeypatch):
    monkeypatch.setattr(vl, "_native_lib", False)  # as on an install without a C compiler
    assert vl.native() is None
    test_write_chunks_fills_scattered_blocks_from_a_block_into_the_first_chunk(layout, dtype)


def random_bits(shape, dtype, seed):
    """Every bit pattern is fair (NaN payloads, infinities, subnormals): the writers move bits, not values."""
    g = torch.Generator().manual_seed(seed)
    bits = {4: torch.int32, 2: torch.int16}[dtype.itemsize]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=bits).view(dtype)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", vl.LAYOUTS)
def test_the_compiled_writer_and_the_portable_one_write_the_same_bits(layout, dtype, stream, monkeypatch):
    assert vl.native() is not None, "the compiled layout writer was not built: run make install (needs a C compiler)"
    monkeypatch.setattr(vl, "STREAM_BYTES", 0 if stream else 1 << 62)
    n, d, c = 64, 64, 128  # vLLM's CPU block size is 128; 64 keeps the test small
    chunks = [random_bits((3, 2, H, c, d), dtype, seed) for seed in range(3)]  # 6 blocks
    ids = [11, 2, 3, 4, 0]  # from the second block on, a run and scattered ids
    fast = [torch.zeros(14, H, 2 * n * d, dtype=dtype) for _ in range(3)]
    slow = [torch.zeros(14, H, 2 * n * d, dtype=dtype) for _ in range(3)]
    vl.write_chunks(fast, chunks, n, ids, layout, n)
    vl.write_chunks_portable(slow, chunks, n, ids, layout, n)
    bits = {4: torch.int32, 2: torch.int16}[dtype.itemsize]
    for a, b in zip(fast, slow):
        assert torch.equal(a.view(bits), b.view(bits))
    assert any(a.any() for a in fast)
    if layout != "token_major":  # negative control: the plain layout is other bits
        other = [torch.zeros_like(a) for a in fast]
        vl.write_chunks(other, chunks, n, ids, "token_major", n)
        assert not all(torch.equal(a.view(bits), o.view(bits)) for a, o in zip(fast, other))


def test_the_compiled_writer_leaves_what_it_does_not_handle_to_the_portable_one():
    """Non-contiguous caches, fp32 in cpu_amx, and a head_dim cpu_amx cannot pack go the portable way (same errors)."""
    kv = canonical(nb=2, seed=3)
    chunks = [kv.contiguous()]
    assert not vl._native_fits([torch.zeros(4, H, 2 * N * D)[:, :, :] .transpose(0, 1).transpose(0, 1)[::2]] * L,
                               chunks, [0, 1], "cpu_vec", N)
    assert not vl._native_fits([torch.zeros(4, H, 2 * N * D)] * L, chunks, [0, 1], "cpu_amx", N)
    assert vl._native_fits([torch.zeros(4, H, 2 * N * D)] * L, chunks, [0, 1], "cpu_vec", N)
    assert not vl._native_fits([torch.zeros(4, H, 2 * N * D)] * L, chunks, [0, 4], "cpu_vec", N)  # id past the end


def test_block_runs_group_consecutive_block_ids():
    assert vl.block_runs([]) == []
    assert vl.block_runs([7]) == [(0, 7, 1)]
    assert vl.block_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]


def layout_isa(want: int) -> int:
    """The compiled writer's instruction set (_layoutc.c pc_layout_isa): 0 SSE2 or scalar, 1 AVX2, 2 AVX-512; want >= 0
    caps it (at what the CPU has), want < 0 asks. The library native() loaded (dlopen gives the same one)."""
    for path in sorted(Path(vl.__file__).parent.glob("_layoutc*.so")):
        try:
            fn = ctypes.CDLL(str(path)).pc_layout_isa
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        return fn(want)
    raise AssertionError("the compiled layout writer was not built")


# (block size, head dim): vLLM's CPU block (128), GPU-sized blocks, head dims 80/96/256, and shapes that leave
# tails after each kernel's whole tiles (rows and columns; odd sizes take the scalar loops, without streaming)
SHAPES = [(128, 64), (16, 128), (32, 80), (48, 96), (128, 256), (40, 70), (24, 36), (20, 18), (8, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_each_instruction_set_writes_the_portable_bits_for_every_shape(level, dtype, monkeypatch):
    """Each kernel (SSE2, AVX2, AVX-512, as far as this CPU has them) with and without streaming stores, for every
    layout, against write_chunks_portable on random bit patterns (NaN payloads included)."""
    assert vl.native() is not None, "the compiled layout writer was not built: run make install (needs a C compiler)"
    best = layout_isa(-1)
    if level > best:
        pytest.skip(f"this CPU has instruction set level {best}")
    bits = {4: torch.int32, 2: torch.int16}[dtype.itemsize]
    try:
        assert layout_isa(level) == level
        for (n, d), layout, stream in itertools.product(SHAPES, vl.LAYOUTS, (False, True)):
            if layout == "cpu_amx" and (dtype.itemsize != 2 or n % 16 or d % 32):
                continue
            monkeypatch.setattr(vl, "STREAM_BYTES", 0 if stream else 1 << 62)
            chunks = [random_bits((2, 2, 2, 2 * n, d), dtype, 100 + seed) for seed in range(3)]  # 6 blocks
            chunks[0].view(bits)[0, 0, 0, n, 0] = 0x7FC1 if dtype.itemsize == 2 else 0x7FC00001  # a NaN payload
            ids = [7, 2, 3, 4, 0]
            fast = [torch.zeros(9, 2, 2 * n * d, dtype=dtype) for _ in range(2)]
            slow = [torch.zeros(9, 2, 2 * n * d, dtype=dtype) for _ in range(2)]
            vl.write_chunks(fast, chunks, n, ids, layout, n)
            vl.write_chunks_portable(slow, chunks, n, ids, layout, n)
            for a, b in zip(fast, slow):
                assert torch.equal(a.view(bits), b.view(bits)), (n, d, layout, stream)
    finally:
        layout_isa(best)
