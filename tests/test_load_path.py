"""The vLLM connector's load path without vLLM: Get keeping lent chunks as they are (keep_sealed), the checks of
client.checked_chunks, and write_chunks into caches shaped like vLLM's CPU backend, against a real sidecar on a real
bulk channel. What must hold: lent chunks are not copied and owned ones are the caller's; whatever is loaded is
bit-exact; a chunk with NaN or Inf is refused: by the sidecar as it is stored, and by the client where no sidecar vouched
for it."""
from __future__ import annotations

import pytest
import torch

from promptcache.client import vllm_layout as vl
from promptcache.client import PromptCacheClient, errors
from promptcache.client.bulk import is_sealed, known_finite
from promptcache.client.client import checked_chunks
from support import CHUNK, SMALL, make_kv

TOKENS = list(range(3 * CHUNK))
BAD_TOKENS = list(range(1000, 1000 + 3 * CHUNK))


@pytest.fixture(params=["lent", "tcp"])
def client(request, sidecar_factory, tmp_path):
    if request.param == "lent":
        sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", bulk_zero_copy="on")
    else:
        sidecar = sidecar_factory(bulk_address="127.0.0.1:0")
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address) as c:
        c.lent_expected = request.param == "lent"
        yield c


def _canonical(kv) -> torch.Tensor:
    return torch.stack([torch.stack((k[0], v[0])) for k, v in kv])  # [L, 2, H, T, D]


def test_kept_lent_chunks_load_bit_exact_into_paged_blocks(client):
    kv = make_kv(SMALL, len(TOKENS), seed=3)
    client.put(SMALL, TOKENS, kv)
    blobs = client.get_blobs(SMALL, TOKENS, copy=True, keep_sealed=True)
    views = client.get_blobs(SMALL, TOKENS, copy=False)
    assert len(blobs) == 3 and all(is_sealed(b) == client.lent_expected for b in blobs)
    if client.lent_expected:  # the very mappings, not copies
        assert [b.data_ptr() for b in blobs] == [v.data_ptr() for v in views]
    chunks = checked_chunks(SMALL, blobs, CHUNK)
    assert [c.data_ptr() for c in chunks] == [b.data_ptr() for b in blobs]  # views: the check copies nothing
    N, H, D = CHUNK // 2, SMALL.num_kv_heads, SMALL.head_dim
    caches = [torch.zeros(9, H, 2 * N * D) for _ in range(SMALL.num_layers)]
    ids = [4, 5, 1, 2, 3]  # tokens [N, 6N): the first block was a local hit
    vl.write_chunks(caches, chunks, N, ids, "cpu_vec", N)
    out = torch.empty(SMALL.num_layers, 2, H, 5 * N, D)
    for layer in range(SMALL.num_layers):
        vl.read_layer(caches[layer][ids], out[layer], "cpu_vec", N)
    assert torch.equal(out, _canonical(kv)[:, :, :, N:])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_chunk_with_nan_or_inf_is_refused_by_the_sidecar_and_by_the_client(client, bad):
    client.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS), seed=1))
    for _ in range(2):  # the second time from the lent mappings already checked
        good = client.get_blobs(SMALL, TOKENS, keep_sealed=True)
        assert len(checked_chunks(SMALL, good, CHUNK)) == 3
    # Lent chunks kept mapped were scanned once, at their first load: the client does not scan them again.
    assert [known_finite(b) for b in good] == [client.lent_expected] * 3
    kv = make_kv(SMALL, len(BAD_TOKENS), seed=2)
    kv[1][1][0, 1, 2 * CHUNK + 5, 3] = bad  # layer 1's V, in the third chunk
    with pytest.raises(errors.InvalidArgument, match="chunk 2 has NaN or Inf"):
        client.put(SMALL, BAD_TOKENS, kv)
    assert client.lookup(SMALL, BAD_TOKENS).cached_tokens == 2 * CHUNK  # the chunks before it are stored
    # The client's own check, for chunks no sidecar vouched for (a disk tier's promotion, an older sidecar).
    blobs = [b.clone() for b in good]
    blobs[2].view(torch.float32)[45] = bad
    for _ in range(2):
        with pytest.raises(errors.CorruptChunk, match="chunk 2 has NaN or Inf"):
            checked_chunks(SMALL, blobs, CHUNK)


def test_a_chunk_of_the_wrong_length_is_refused():
    blob = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(errors.CorruptChunk, match="chunk 0 has 100 bytes"):
        checked_chunks(SMALL, [blob], CHUNK)


def test_loadpath_bench_loads_bit_exact_and_prints_its_table(capsys):
    """A short run of `promptcache bench loadpath` (it raises when the blocks do not hold the stored bytes)."""
    from promptcache.cli import main

    assert main(["bench", "loadpath", "--tokens", "512", "--layers", "2", "--repeats", "1",
                 "--layout", "cpu_amx"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "GB/s" in line]
    assert [(r[1].strip(), r[2].strip(), r[3].strip()) for r in rows] == [("float32", "cpu_amx", "512"),
                                                                      ("bfloat16", "cpu_amx", "512")]
    for r in rows:
        assert float(r[7].split()[0]) > 0 and r[10].strip().endswith("x")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_agrees_with_isfinite_on_every_bit_pattern_class(dtype):
    """The integer-view check of 16-bit floats against torch.isfinite: every 16-bit pattern one at a time (all
    NaNs, both infinities, subnormals, -0), and random float32 patterns with specials planted."""
    from promptcache.client.client import all_finite

    if dtype != torch.float32:
        patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        base = torch.zeros(64, dtype=dtype)
        for value in patterns[::7].tolist() + patterns[-200:].tolist() + patterns[32640:33000].tolist():
            base[13] = value
            assert all_finite(base) == bool(torch.isfinite(base).all()), (dtype, value)
        assert not all_finite(patterns) and all_finite(patterns[torch.isfinite(patterns)])
    g = torch.Generator().manual_seed(0)
    for special in (float("nan"), float("inf"), float("-inf"), -float("nan"), None):
        x = torch.randn(5, 300, generator=g).to(dtype) * 1e3
        if special is not None:
            x[3, 17] = special
        assert all_finite(x) == (special is None)
    assert all_finite(torch.empty(0, dtype=dtype))


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_the_compiled_finite_scan_and_the_numpy_one_agree_on_every_value_class(kv_dtype):
    """values_finite's one-pass scan (_scanc.c) against values_finite_numpy and torch.isfinite: every 16-bit
    pattern in its own block of 4096 (the scan stops per block), random 32-bit patterns, a bad value in the last
    position of a buffer that is not a whole number of blocks, and the empty buffer."""
    import numpy as np

    from promptcache.contract import layout

    assert layout.native_scan() is not None, "the compiled scan was not built: run make install (needs a C compiler)"
    dtype = layout.TORCH_DTYPES[kv_dtype]
    if dtype.itemsize == 2:
        patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    else:
        g = torch.Generator().manual_seed(1)
        patterns = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32)
        patterns[:4] = torch.tensor([0x7F800000, 0xFF800000 - 2**32, 0x7FC00001, 0x7F7FFFFF], dtype=torch.int32)
    values = patterns.view(dtype)
    finite = torch.isfinite(values)
    fill = torch.zeros(4096 * 3 + 5, dtype=dtype)
    for i in list(range(0, values.numel(), 97)) + torch.nonzero(~finite).flatten()[:300].tolist():
        for at in (0, 4096, fill.numel() - 1):
            buf = fill.clone()
            buf[at] = values[i]
            raw = buf.view(torch.uint8).numpy()
            expected = bool(finite[i])
            assert layout.values_finite(raw, kv_dtype) == expected, (kv_dtype, i, at)
            assert layout.values_finite_numpy(raw, kv_dtype) == expected, (kv_dtype, i, at)
    assert layout.values_finite(np.empty(0, dtype=np.uint8), kv_dtype)


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16", None])
def test_the_copy_and_scan_copies_every_byte_and_finds_every_bad_value(kv_dtype, native, monkeypatch):
    """copy_finite, compiled (pc_copy_finite: scan 4 KiB blocks, streaming stores after an unaligned head) and
    without a C compiler (numpy), against values_finite_numpy: destinations at every offset of a 16-byte line,
    lengths around the 64-byte store groups and the 4 KiB blocks, one non-finite value at the first, a block-edge
    and the last position. None: bytes copied, never scanned."""
    import numpy as np

    from promptcache.contract import layout

    if native:
        assert layout.native_copy() is not None, "the compiled scan was not built: run make install (needs a C compiler)"
    else:
        monkeypatch.setattr(layout, "_native", False)
        assert layout.native_copy() is None and layout.native_scan() is None
    itemsize = 1 if kv_dtype is None else layout.ITEMSIZES[kv_dtype]
    rng = np.random.default_rng(3)
    bad = {"float32": np.float32(np.nan).view(np.uint32), "float16": np.float16(np.inf).view(np.uint16),
           "bfloat16": np.uint16(0xFF80), None: None}[kv_dtype]  # bfloat16 -Inf
    for n_values in (0, 1, 15, 16, 17, 4096 // itemsize - 1, 4096 // itemsize, 3 * 4096 // itemsize + 5):
        n = n_values * itemsize
        for dst_offset in range(16):
            for at in sorted({0, 4096 // itemsize - 1, 4096 // itemsize, n_values - 1}):
                if not 0 <= at < max(n_values, 1):
                    continue
                # small finite values: uniform bytes would be NaN or Inf by chance for 16-bit floats
                src = (rng.standard_normal(n_values).astype(np.float32 if itemsize == 4 else np.float16)
                       .view(np.uint8) if itemsize > 1 else rng.integers(0, 256, n, dtype=np.uint8))
                if kv_dtype == "bfloat16":
                    src = np.ascontiguousarray(src.view(np.uint16) & 0x3FFF).view(np.uint8)
                if bad is not None and n_values:
                    src.view(bad.dtype)[at] = bad
                room = np.full(n + 32, 0xA5, dtype=np.uint8)
                dst = room[dst_offset:dst_offset + n]
                finite = layout.copy_finite(dst, src, kv_dtype)
                assert bytes(dst) == bytes(src), (kv_dtype, n, dst_offset)
                assert not room[dst_offset + n:].size or (room[dst_offset + n:] == 0xA5).all()  # nothing past
                assert (room[:dst_offset] == 0xA5).all()  # nothing before
                expected = kv_dtype is None or n == 0 or layout.values_finite_numpy(src, kv_dtype)
                assert finite == expected and expected == (bad is None or n == 0), (kv_dtype, n, dst_offset, at)
    if kv_dtype is not None:
        with pytest.raises(ValueError, match="not whole"):
            layout.copy_finite(np.empty(3, dtype=np.uint8), np.zeros(3, dtype=np.uint8), kv_dtype)
    with pytest.raises(ValueError, match="into"):
        layout.copy_finite(np.empty(4, dtype=np.uint8), np.zeros(8, dtype=np.uint8), kv_dtype)
