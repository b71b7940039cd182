"""Quantized chunk formats (promptcache.codec): exact length, round-trip error bounds, corrupt blobs rejected."""
from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptcache import codec
from promptcache.codec import entropy, formats, quantizers, rope
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("k8v8", "k8v4", "k6v4z")


@st.composite
def chunks(draw):
    L = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    T = draw(st.integers(1, 48))  # k6v4z: up to 33 tokens are all 8-bit; more have a 4-bit middle
    D = draw(st.sampled_from([2, 4, 6, 16, 32, 48, 64, 80, 96, 128]))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 30.0, 300.0]))
    offset = draw(st.sampled_from([0.0, 0.5, -2.0]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((L, 2, H, T, D), generator=g) * scale + offset * scale
    if draw(st.booleans()):  # a few outlier channels, as real keys have
        x[:, 0, :, :, 0] *= 20
    return x.to(DTYPES[dtype]), dtype


def _check_roundtrip(mode, x, dtype, rope_theta=0.0):
    blob = codec.pack(mode, x, rope_theta)
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    assert blob.numel() == codec.packed_nbytes(mode, tuple(x.shape), dtype)
    y = codec.unpack(mode, blob, tuple(x.shape), dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.isfinite(y).all()
    err = (y.float() - x.float()).abs()
    # quantization bound plus the final rounding to the KV dtype
    bound = codec.error_bound(mode, x, rope_theta) * 1.0001 + y.float().abs() * torch.finfo(x.dtype).eps + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    L, _, H, T, D = x.shape
    if mode == "k6v4z":  # the 4-bit coded tokens: each group's L2 error within its bound
        g = codec.v_group_size(D)
        low = codec.low_bit_value_tokens(x)
        assert int(low.sum()) == L * H * max(0, T - 1 - min(32, T - 1))
        e = (y.float() - x.float())[:, 1].reshape(L, H, T, D // g, g)
        slack = y.float()[:, 1].abs().reshape(L, H, T, D // g, g).amax(-1) * torch.finfo(x.dtype).eps * g
        assert (e.norm(dim=-1) <= codec.value_group_l2_bound(x) + slack)[low].all()


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=chunks())
def test_roundtrip_within_bound_and_exact_length(mode, data):
    x, dtype = data
    _check_roundtrip(mode, x, dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=chunks(), theta=st.sampled_from([1e4, 1e5, 0.5]), rotated=st.booleans())
def test_k6v4z_roundtrip_with_rope_undone_within_bound(data, theta, rotated):
    """k6v4z with a RoPE base: keys that are RoPE-rotated (the base then helps and is used) or not (it may not help
    and is dropped); either way the error stays within error_bound(..., rope_theta)."""
    x, dtype = data
    if rotated and x.shape[-1] % 2 == 0:
        x = x.float()
        x[:, 0] = rope._rope(x[:, 0], theta, 1.0)
        x = x.to(DTYPES[dtype])
    _check_roundtrip("k6v4z", x, dtype, theta)


@pytest.mark.parametrize("mode", MODES)
def test_zero_is_exact_and_constant_groups(mode):
    x = torch.zeros(2, 2, 3, 8, 64)
    y = codec.unpack(mode, codec.pack(mode, x), x.shape, "float32")
    assert torch.equal(y, x)
    x = torch.full((1, 2, 1, 4, 64), 3.25)  # all-positive constant groups still covered
    _check_roundtrip(mode, x, "float32")


def test_compression_for_smollm2_geometry():
    shape = (30, 2, 3, 256, 64)
    assert codec.packed_nbytes("k6v4z", shape, "bfloat16") == 5898240 * 2 // 7  # the fixed slot: fp16 bytes / 3.5
    assert codec.compression_vs_fp16("k6v4z", shape) >= 3.5
    assert codec.packed_nbytes("k8v4", shape, "bfloat16") == 5898240 * 2 // 5  # format 3's slot: fp16 bytes / 2.5
    assert codec.compression_vs_fp16("k8v4", shape) >= 2.5  # format 2 was 2.496x, format 1 2.602x
    assert codec.compression_vs_fp16("k8v8", shape) >= 1.9
    spec = ModelSpec("m", "r", "float16", 30, 3, 64, quantization="k8v4")
    assert chunk_nbytes(spec, 256) == codec.packed_nbytes("k8v4", shape, "float16")


def test_k8v4_spends_finer_value_steps_on_the_tokens_attention_favours():
    """Format 3: token 0, the last 16 tokens and the 16 per (layer, head) whose keys oppose the chunk's mean key get a
    value step floor V_FINE times the others'; every value group's error is within half its step (rotated back:
    sqrt(G) times that), and the step index the encoder chose is the finest whose code streams fit the slot."""
    x = _keys_like(T=256, L=2, H=2)
    blob = codec.pack("k8v4", x)
    top, step = blob[codec.HEADER_BYTES].item(), blob[codec.HEADER_BYTES + 1].item()
    assert top == 255 and step < len(codec.CODED_STEPS)
    y = codec.unpack("k8v4", blob, x.shape, "float32")
    g = codec.v_group_size(64)
    rot = quantizers._rotation(g, "cpu")
    err = (((y - x)[:, 1].reshape(2, 2, 256, 1, g) @ rot)).abs().amax(-1).squeeze(-1)  # [L, H, T], rotated domain
    fine = torch.zeros(2, 2, 256, dtype=torch.bool)
    fine[:, :, 0] = True
    fine[:, :, -codec.DENSE_V_RECENT:] = True
    fine.scatter_(2, entropy._dense_value_tokens(x[:, 0]), True)
    assert int(fine.sum()) == 2 * 2 * (1 + codec.DENSE_V_RECENT + codec.DENSE_V_SELECT)
    rms = (x[:, 1].reshape(2, 2, 256, 1, g) @ rot).square().mean(-1).sqrt().squeeze(-1)
    assert (err / rms)[fine].mean() < 0.5 * (err / rms)[~fine].mean()  # V_FINE = 1/4 of the step: far finer
    # one step coarser would have fit too? no: the encoder picked the finest that fits (its streams fill the slot)
    off, size = _section_offset("k8v4", "float32", "streams", x.shape)
    n_k, n_v = codec.Z_HEADER.unpack(bytes(blob[codec.HEADER_BYTES:codec.HEADER_BYTES + codec.Z_HEADER.size]
                                           .tolist()))[3:5]
    assert n_k + n_v <= size
    _check_roundtrip("k8v4", x, "float32")


# A k8v4 chunk in format 1 (before issue 16: only token 0's values at 8 bits), packed by that code from
# x = (arange(64).reshape(2, 2, 1, 4, 4) - 15) / 7 in float32.
K8V4_FORMAT1 = bytes.fromhex(
    "5043513101020000fb1130c5200000000000000044494e5587919ca9cbdaeafe95989c9fb8babcbedbdcdddefefefefe522009207d1fea"
    "1e2d24522477249c24fefefefe000000003f7fbefee9f0f7fe9c182f2500001e201f211f101e111e111e116a6f727e7f80221111")
# The same x packed by format 2 (issue 16's first step: token 0 and the last 32 tokens' values at 8 bits).
K8V4_FORMAT2 = bytes.fromhex(
    "50435131010300001db30acc200000000000000044494e5587919ca9cbdaeafe95989c9fb8babcbedbdcdddefefefefe522009207d1fea"
    "1e2d24522477249c24fefefefe000000003f7fbefe9fbedefebed4e9fecedeeefee9f0f7feebf1f8feedf2f8feeef3f9fe9c189c1cea1e"
    "9c202f25c3255626ea260000000000000000")
# docs/key-vectors.json "bf16-k8v4-tenant" fingerprint while k8v4 was format 1, and while it was format 2
K8V4_FORMAT1_FINGERPRINT = "e9ce6d5f9d143432b4906783e2b6ffeb4c2af5a181d461e99a7ce10138ee2722"
K8V4_FORMAT2_FINGERPRINT = "18e13c4952648fb07a39d65ec95ac61a3ad55e495262d11a45e14ca5e7fdb892"


@pytest.mark.parametrize("fmt, blob, retired", [(1, K8V4_FORMAT1, "k8v4 format 1 \\(retired\\)"),
                                               (2, K8V4_FORMAT2, "k8v4 format 2 \\(retired\\)")])
def test_k8v4_old_format_chunks_are_never_misread(fmt, blob, retired):
    """Chunks of formats 1 and 2 get other keys (fingerprint field 7 is "k8v4.3") and, if one arrived anyway, are
    refused: by length, and by the header's mode id when forged to the right length."""
    from promptcache.contract.keys import QUANT_FORMATS, fingerprint

    spec = ModelSpec("meta-llama/Llama-3.1-8B", "sha256:0123abcd", "bfloat16", 32, 8, 128, "k8v4", b"tenant-a")
    assert QUANT_FORMATS["k8v4"] == "k8v4.3"
    assert fingerprint(spec).hex() not in (K8V4_FORMAT1_FINGERPRINT, K8V4_FORMAT2_FINGERPRINT)
    old = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    assert codec.read_header(old)["mode"] == f"k8v4 format {fmt} (retired)"
    shape = (2, 2, 1, 4, 4)
    n = codec.packed_nbytes("k8v4", shape, "float32")
    assert n != old.numel()
    with pytest.raises(codec.CorruptChunk, match=f"must be {n} bytes, got {old.numel()}"):
        codec.unpack("k8v4", old, shape, "float32")
    forged = _refresh_crc(torch.cat([old, torch.zeros(max(0, n - old.numel()), dtype=torch.uint8)])[:n])
    with pytest.raises(codec.CorruptChunk, match=f"{retired}, expected k8v4"):
        codec.unpack("k8v4", forged, shape, "float32")


def test_format_header_mode_ids():
    x = torch.randn(1, 2, 1, 20, 64)
    assert codec.pack("k8v8", x)[5].item() == 1
    assert codec.pack("k8v4", x)[5].item() == 6  # format 3 (format 2 was id 3, format 1 id 2)
    assert codec.pack("k6v4z", x)[5].item() == 5  # format 2 (format 1 was id 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown quantization mode"):
        codec.packed_nbytes("k4v2", (1, 2, 1, 1, 64), "float32")
    with pytest.raises(ValueError, match="even head_dim"):
        codec.packed_nbytes("k8v4", (1, 2, 1, 1, 63), "float32")
    with pytest.raises(ValueError, match="shape"):
        codec.pack("k8v4", torch.zeros(1, 3, 1, 1, 64))
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.pack("k8v4", torch.tensor([float("nan")]).expand(1, 2, 1, 1, 64).contiguous())
    with pytest.raises(ValueError, match="dtype"):
        codec.pack("k8v4", torch.zeros(1, 2, 1, 1, 64, dtype=torch.float64))
    for theta in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="rope_theta"):
            codec.pack("k6v4z", torch.zeros(1, 2, 1, 1, 64), theta)


# ------------------------------------------------------------------------------------------------ corrupt blobs
SHAPE = (2, 2, 3, 48, 64)  # 48 tokens: k6v4z has 4-bit middle tokens (1..15)


def _blob(mode="k8v4", dtype="float16"):
    x = (torch.randn(SHAPE) * 2).to(DTYPES[dtype])
    return codec.pack(mode, x)


def _section_offset(mode, dtype, name, shape=SHAPE):
    off = 0
    for sec, size in formats._sections(mode, shape, dtype):
        if sec == name:
            return off, size
        off += size
    raise KeyError(name)


def _refresh_crc(blob: torch.Tensor) -> torch.Tensor:
    """Re-seal a deliberately edited blob so that the scale/zero checks (not the checksum) must catch it."""
    blob = blob.clone()
    crc = zlib.crc32(blob[codec.HEADER_BYTES:].numpy())
    blob[8:12] = torch.frombuffer(bytearray(struct.pack("<I", crc)), dtype=torch.uint8)
    return blob


@pytest.mark.parametrize("mode", MODES)
def test_wrong_length_rejected(mode):
    blob = _blob(mode)
    with pytest.raises(codec.CorruptChunk, match="must be .* bytes"):
        codec.unpack(mode, blob[:-1], SHAPE, "float16")
    with pytest.raises(codec.CorruptChunk, match="must be .* bytes"):
        codec.unpack(mode, torch.cat([blob, blob[:1]]), SHAPE, "float16")


@pytest.mark.parametrize("mode", MODES)
def test_flipped_byte_rejected(mode):
    blob = _blob(mode).clone()
    blob[codec.HEADER_BYTES + 100] ^= 0x10
    with pytest.raises(codec.CorruptChunk, match="checksum"):
        codec.unpack(mode, blob, SHAPE, "float16")


def test_wrong_mode_dtype_shape_magic_rejected():
    forged = _blob("k8v4").clone()
    forged[5] = 1  # header says k8v8 (the lengths differ too, so only a forged header gets this far)
    with pytest.raises(codec.CorruptChunk, match="mode k8v8, expected k8v4"):
        codec.unpack("k8v4", forged, SHAPE, "float16")
    blob = _blob("k8v4", "bfloat16")
    with pytest.raises(codec.CorruptChunk, match="packed from bfloat16, expected float16"):
        codec.unpack("k8v4", blob, SHAPE, "float16")
    other_shape = (2, 2, 3, 24, 128)  # same element count, different layout
    with pytest.raises(codec.CorruptChunk):
        codec.unpack("k8v4", blob, other_shape, "bfloat16")
    bad = blob.clone()
    bad[0] = ord("X")
    with pytest.raises(codec.CorruptChunk, match="magic"):
        codec.unpack("k8v4", bad, SHAPE, "bfloat16")
    with pytest.raises(codec.CorruptChunk, match="1-D uint8"):
        codec.unpack("k8v4", blob.view(torch.int8), SHAPE, "bfloat16")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
@pytest.mark.parametrize("mode", MODES)
def test_bad_fp16_scales_rejected(mode, value):
    blob = _blob(mode)
    off, _ = _section_offset(mode, "float16", "k_scale")
    bad = blob.clone()
    bad[off:off + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(codec.CorruptChunk, match="key scales"):
        codec.unpack(mode, _refresh_crc(bad), SHAPE, "float16")
    for sec in (["v8_scale"] if mode == "k6v4z" else ["v_scale"]):
        off, _ = _section_offset(mode, "float16", sec)
        bad = blob.clone()
        bad[off:off + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
        with pytest.raises(codec.CorruptChunk, match="value scales"):
            codec.unpack(mode, _refresh_crc(bad), SHAPE, "float16")


def test_out_of_range_scales_and_zeros_rejected():
    # k6v4z 4-bit value scale code 255 = 2**15.9: 15 levels of it overflow float16 -> rejected, never Inf
    blob = _blob("k6v4z")
    off, _ = _section_offset("k6v4z", "float16", "v_scale")
    bad = blob.clone()
    bad[off] = 255
    with pytest.raises(codec.CorruptChunk, match="overflow float16"):
        codec.unpack("k6v4z", _refresh_crc(bad), SHAPE, "float16")
    # the same code is fine for float32
    x = torch.randn(SHAPE)
    b32 = codec.pack("k6v4z", x)
    off32, _ = _section_offset("k6v4z", "float32", "v_scale")
    bad = b32.clone()
    bad[off32] = 255
    y = codec.unpack("k6v4z", _refresh_crc(bad), SHAPE, "float32")
    assert torch.isfinite(y).all()
    # k8v4: a float16 value scale whose 255 levels (sqrt(64) times, rotated back) overflow float16
    blob = _blob("k8v4")
    off, _ = _section_offset("k8v4", "float16", "v_scale")
    bad = blob.clone()
    bad[off:off + 2] = torch.tensor([60.0], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(codec.CorruptChunk, match="value scales out of range"):
        codec.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")
    # zero points beyond the format's range
    off, _ = _section_offset("k8v4", "float16", "v_zero")
    bad = blob.clone()
    bad[off] = 0xFF
    with pytest.raises(codec.CorruptChunk, match="value zero points"):
        codec.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")
    off, _ = _section_offset("k8v4", "float16", "k_zero")
    bad = blob.clone()
    bad[off] = 255
    with pytest.raises(codec.CorruptChunk, match="key zero points"):
        codec.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")
    # large fp16 key scale: 255 * 60000 overflows float16
    off, _ = _section_offset("k8v4", "float16", "k_scale")
    bad = blob.clone()
    bad[off:off + 2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(codec.CorruptChunk, match="overflow"):
        codec.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")


# ------------------------------------------------------------------------------------------------ k6v4z
def test_old_format_bytes_unchanged():
    """k8v8 packs to the same bytes and decodes to the same values as before k6v4z was added: chunks stored earlier
    are still read correctly (CRC32 and digest recorded with the old code)."""
    import hashlib

    g = torch.Generator().manual_seed(16)
    x = (torch.randn((2, 2, 3, 48, 64), generator=g) * 2).to(torch.bfloat16)
    for mode, crc, digest in (("k8v8", 3948144445, "18d8263cb985f07b"),):
        blob = codec.pack(mode, x)
        assert zlib.crc32(blob.numpy()) == crc, mode
        y = codec.unpack(mode, blob, x.shape, "bfloat16")
        assert hashlib.sha256(y.view(torch.int16).numpy().tobytes()).hexdigest()[:16] == digest, mode


def _keys_like(T=256, L=2, H=2, D=64, seed=0):
    """Heavy-tailed keys (each channel near its own offset, the first token far out, as at an attention sink): their
    codes crowd around a few values and compress well; values Gaussian."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((L, 1, H, 1, D), generator=g) * 2 + torch.randn((L, 1, H, T, D), generator=g) * 0.1
    k[..., 0, :] += 10
    v = torch.randn((L, 1, H, T, D), generator=g)
    return torch.cat([k, v], dim=1)


def test_k6v4z_rate_control_picks_the_finest_key_step_that_fits():
    """Compressible keys get the finest key step; keys of white noise over a wide range need a coarser one to fit;
    a chunk too small for zstd to pay falls back to raw 4-bit key codes. Every blob fills exactly the fixed slot and
    stays within the error bound."""
    def relative_key_error(x):  # key RMS error over the keys' RMS about their channels' medians
        y = codec.unpack("k6v4z", codec.pack("k6v4z", x), x.shape, "float32")
        return float((y - x)[:, 0].square().mean().sqrt() / quantizers._rms(x[:, 0]).square().mean().sqrt())

    smooth = _keys_like()
    blob = codec.pack("k6v4z", smooth)
    assert blob[codec.HEADER_BYTES].item() == 255 and blob[codec.HEADER_BYTES + 1].item() < len(codec.DENSE_KEY_STEPS)
    _check_roundtrip("k6v4z", smooth, "float32")
    noisy = smooth.clone()
    noisy[:, 0] = torch.rand(noisy[:, 0].shape, generator=torch.Generator().manual_seed(1)) * 100 - 50
    blob = codec.pack("k6v4z", noisy)
    assert blob[codec.HEADER_BYTES].item() == 255 and blob[codec.HEADER_BYTES + 1].item() < len(codec.DENSE_KEY_STEPS)
    assert relative_key_error(smooth) < relative_key_error(noisy)  # the compressible keys: finer (0.032 vs 0.051)
    _check_roundtrip("k6v4z", noisy, "float32")
    tiny = noisy[:1, :, :1, :8, :8].contiguous()  # too small for zstd to pay, too random to fit at 8 bits
    blob = codec.pack("k6v4z", tiny)
    assert (blob[codec.HEADER_BYTES].item(), blob[codec.HEADER_BYTES + 1].item()) == (15, len(codec.DENSE_KEY_STEPS))
    _check_roundtrip("k6v4z", tiny, "float32")


def _dense_parts(blob, shape=SHAPE, dtype="float16"):
    off, _ = _section_offset("k6v4z", dtype, "z_header")
    top, step, _, n_k, n_v8, n_v4, _ = codec.Z_HEADER.unpack(bytes(blob[off:off + codec.Z_HEADER.size].tolist()))
    s_off, s_size = _section_offset("k6v4z", dtype, "streams")
    return off, top, (n_k, n_v8, n_v4), s_off, s_size


def _reseal_dense(blob, top, lengths, streams, dtype="float16", theta=0.0):
    off, _, _, s_off, s_size = _dense_parts(blob, dtype=dtype)
    bad = blob.clone()
    bad[off:off + codec.Z_HEADER.size] = torch.frombuffer(bytearray(codec.Z_HEADER.pack(top, 0, 0, *lengths, theta)),
                                                          dtype=torch.uint8)
    body = bytes(streams) + bytes(s_size - len(streams))
    bad[s_off:s_off + s_size] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return _refresh_crc(bad)


def test_k6v4z_corrupt_streams_rejected():
    import zstandard

    blob = _blob("k6v4z")
    _, top, lengths, s_off, s_size = _dense_parts(blob)
    streams = bytes(blob[s_off:s_off + sum(lengths)].tolist())
    assert codec.unpack("k6v4z", _reseal_dense(blob, top, lengths, streams), SHAPE, "float16") is not None
    with pytest.raises(codec.CorruptChunk, match="key code top 17"):
        codec.unpack("k6v4z", _reseal_dense(blob, 17, lengths, streams), SHAPE, "float16")
    for theta in (float("nan"), float("inf"), -1.0):
        with pytest.raises(codec.CorruptChunk, match="RoPE base"):
            codec.unpack("k6v4z", _reseal_dense(blob, top, lengths, streams, theta=theta), SHAPE, "float16")
    with pytest.raises(codec.CorruptChunk, match="exceed the slot"):
        codec.unpack("k6v4z", _reseal_dense(blob, top, (s_size, *lengths[1:]), streams), SHAPE, "float16")
    padded = blob.clone()
    padded[s_off + s_size - 1] = 1  # padding must be zero
    with pytest.raises(codec.CorruptChunk, match="padding"):
        codec.unpack("k6v4z", _refresh_crc(padded), SHAPE, "float16")
    garbage = bytes(range(256)) * (lengths[0] // 256) + bytes(lengths[0] % 256)
    with pytest.raises(codec.CorruptChunk, match="k_codes stream does not decompress"):
        codec.unpack("k6v4z", _reseal_dense(blob, top, lengths, garbage + streams[lengths[0]:]), SHAPE, "float16")
    # a well-formed frame of the wrong size
    n = SHAPE[0] * SHAPE[2] * SHAPE[3] * SHAPE[4]
    z = zstandard.ZstdCompressor().compress(bytes(n - 1))
    with pytest.raises(codec.CorruptChunk, match="holds"):
        codec.unpack("k6v4z", _reseal_dense(blob, top, (len(z), *lengths[1:]), z + streams[lengths[0]:]),
                     SHAPE, "float16")


def test_k8v4_corrupt_sub_header_and_streams_rejected():
    import zstandard

    blob = _blob("k8v4")
    h_off, _ = _section_offset("k8v4", "float16", "z_header")
    s_off, s_size = _section_offset("k8v4", "float16", "streams")
    top, step, _, n_k, n_v, _, theta = codec.Z_HEADER.unpack(bytes(blob[h_off:h_off + codec.Z_HEADER.size].tolist()))
    streams = bytes(blob[s_off:s_off + n_k + n_v].tolist())

    def resealed(top=top, lengths=(n_k, n_v, 0), body=streams, theta=theta, step=step):
        bad = blob.clone()
        bad[h_off:h_off + codec.Z_HEADER.size] = torch.frombuffer(
            bytearray(codec.Z_HEADER.pack(top, step, 0, *lengths, theta)), dtype=torch.uint8)
        bad[s_off:s_off + s_size] = torch.frombuffer(bytearray(body + bytes(s_size - len(body))), dtype=torch.uint8)
        return _refresh_crc(bad)

    assert torch.equal(codec.unpack("k8v4", resealed(), SHAPE, "float16"), codec.unpack("k8v4", blob, SHAPE, "float16"))
    for bad, match in ((resealed(top=17), "code top 17"), (resealed(step=200), "step 200"),
                       (resealed(lengths=(n_k, n_v, 1)), "reserved"), (resealed(theta=float("nan")), "RoPE base"),
                       (resealed(lengths=(s_size, n_v, 0)), "exceed the slot")):
        with pytest.raises(codec.CorruptChunk, match=match):
            codec.unpack("k8v4", bad, SHAPE, "float16")
    padded = blob.clone()
    padded[s_off + s_size - 1] = 1  # padding must be zero
    with pytest.raises(codec.CorruptChunk, match="padding"):
        codec.unpack("k8v4", _refresh_crc(padded), SHAPE, "float16")
    garbage = bytes(range(256)) * (n_k // 256) + bytes(n_k % 256)
    with pytest.raises(codec.CorruptChunk, match="k_codes stream does not decompress"):
        codec.unpack("k8v4", resealed(body=garbage + streams[n_k:]), SHAPE, "float16")
    n_values = SHAPE[0] * SHAPE[2] * SHAPE[3] * SHAPE[4]
    z = zstandard.ZstdCompressor().compress(bytes(n_values - 1))  # a well-formed frame of the wrong size
    with pytest.raises(codec.CorruptChunk, match="v_codes stream holds"):
        codec.unpack("k8v4", resealed(lengths=(n_k, len(z), 0), body=streams[:n_k] + z), SHAPE, "float16")


@pytest.mark.parametrize("mode", MODES)
def test_large_float16_keys_round_trip(mode):
    """Found by the property test: float16 keys in the thousands made k6v4z's step floor (a multiple of the keys'
    RMS) so large that its top code would overflow float16, and the decoder refused the encoder's own chunk."""
    for seed in range(8):
        x = torch.randn(2, 2, 3, 12, 2, generator=torch.Generator().manual_seed(seed)) * 300
        x[:, 0, :, :, 0] *= 20  # an outlier channel, as keys have
        _check_roundtrip(mode, x.to(torch.float16), "float16")


def test_k6v4z_codes_keys_with_rope_undone():
    """Keys whose channels hold constant components, rotated by RoPE as a model stores them: with the model's base the
    encoder undoes each token's in-chunk rotation (the base is in the sub-header), and the key error at the same
    slot is far lower than when coding the rotated keys; the decoder re-applies the rotation without being told the
    base. Keys RoPE does not fit (constant channels, not rotated) keep the base out (0 in the sub-header)."""
    theta = 1e5
    x = _keys_like(T=256, seed=3)
    x[:, 0, :, 0] -= 10  # no sink token here: the channels' constant components are what RoPE smears
    rotated = x.clone()
    rotated[:, 0] = rope._rope(x[:, 0], theta, 1.0)
    off = codec.HEADER_BYTES  # the sub-header follows the header
    key_mse = {}
    for base in (0.0, theta):
        blob = codec.pack("k6v4z", rotated, base)
        assert codec.Z_HEADER.unpack(bytes(blob[off:off + codec.Z_HEADER.size].tolist()))[-1] == base
        y = codec.unpack("k6v4z", blob, rotated.shape, "float32")
        key_mse[base] = float((y - rotated)[:, 0].square().mean())
        _check_roundtrip("k6v4z", rotated, "float32", base)
    assert key_mse[theta] < 0.5 * key_mse[0.0], key_mse
    blob = codec.pack("k6v4z", x, theta)  # not rotated: undoing a rotation would smear it, so none is undone
    assert codec.Z_HEADER.unpack(bytes(blob[off:off + codec.Z_HEADER.size].tolist()))[-1] == 0.0
    _check_roundtrip("k6v4z", x, "float32", theta)
    blob = codec.pack("k6v4z", rotated, 1e39)  # beyond float32: not used (the decoder would refuse an infinite base)
    assert codec.Z_HEADER.unpack(bytes(blob[off:off + codec.Z_HEADER.size].tolist()))[-1] == 0.0
    _check_roundtrip("k6v4z", rotated, "float32", 1e39)


def test_rope_theta_of_model_configs():
    from transformers import LlamaConfig

    assert codec.rope_theta_of(LlamaConfig(rope_theta=100000.0)) == 100000.0
    assert codec.rope_theta_of(LlamaConfig()) == 10000.0
    scaled = LlamaConfig(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert codec.rope_theta_of(scaled) == 0.0  # scaled frequencies: not the rotation k6v4z undoes


# A k6v4z chunk in format 1 (keys coded as stored, after RoPE; 16-byte sub-header), packed by that code from
# x = (arange(64).reshape(2, 2, 1, 4, 4) - 15) / 7 in float32.
K6V4Z_FORMAT1 = bytes.fromhex(
    "5043513101040000f87994ac200000000f0f0000100000002000000000000000e63093303f30d72fbd34e63410353a350e0e0e0e000000"
    "009c189c1cea1e9c202f25c3255626ea26000000000000000040b740c840d950e9a8eca8eca9eca9ec3f7fbefe9fbedefebed4e9fecede"
    "eefee9f0f7feebf1f8feedf2f8feeef3f9fe")


def test_k6v4z_format1_chunks_are_never_misread():
    """Format-1 chunks get other keys (fingerprint field 7 is "k6v4z.2") and, if one arrived anyway, are refused."""
    from promptcache.contract.keys import QUANT_FORMATS

    assert QUANT_FORMATS["k6v4z"] == "k6v4z.2"
    old = torch.frombuffer(bytearray(K6V4Z_FORMAT1), dtype=torch.uint8)
    assert codec.read_header(old)["mode"] == "k6v4z format 1 (retired)"
    shape = (2, 2, 1, 4, 4)
    n = codec.packed_nbytes("k6v4z", shape, "float32")
    assert n != old.numel()
    with pytest.raises(codec.CorruptChunk, match=f"must be {n} bytes, got {old.numel()}"):
        codec.unpack("k6v4z", old, shape, "float32")
    forged = _refresh_crc(torch.cat([old, torch.zeros(n - old.numel(), dtype=torch.uint8)]))
    with pytest.raises(codec.CorruptChunk, match="k6v4z format 1 \\(retired\\), expected k6v4z"):
        codec.unpack("k6v4z", forged, shape, "float32")


def test_k6v4z_keeps_the_values_of_tokens_whose_keys_oppose_the_mean_key_at_8_bits():
    """Tokens whose keys point against the chunk's mean key (where attention heads put their sink-like mass) get 8-bit
    values: 16 per (layer, head), stored as token indices; every other middle token is 4-bit."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn((2, 2, 3, 96, 64), generator=g)
    x[:, 0] += 2.0  # a common key direction (the chunk's mean key)
    chosen = torch.randperm(96 - 17, generator=g)[:16] + 1  # middle tokens 1..78
    x[:, 0, :, chosen] = -3.0  # keys against it
    blob = codec.pack("k6v4z", x)
    sel_off, sel_size = _section_offset_for("k6v4z", x.shape, "float32", "v_sel")
    stored = blob[sel_off:sel_off + sel_size].view(torch.int16).reshape(2, 3, 16)
    assert torch.equal(stored.long(), chosen.sort().values.expand(2, 3, 16))
    low = codec.low_bit_value_tokens(x)
    assert not low[:, :, chosen].any() and int(low.sum()) == 2 * 3 * (96 - 1 - 16 - 16)
    y = codec.unpack("k6v4z", blob, x.shape, "float32")
    step8 = (x[:, 1].amax(-1) - x[:, 1].amin(-1)) / 254
    assert ((y - x)[:, 1, :, chosen].abs().amax(-1) <= step8[:, :, chosen] * 0.5 * 1.01).all()
    _check_roundtrip("k6v4z", x, "float32")


def _section_offset_for(mode, shape, dtype, name):
    off = 0
    for sec, size in formats._sections(mode, tuple(shape), dtype):
        if sec == name:
            return off, size
        off += size
    raise KeyError(name)


@pytest.mark.parametrize("sel", [[5, 3], [0, 3], [3, 3], [40, 41]])
def test_k6v4z_bad_selected_value_tokens_rejected(sel):
    """Selected tokens must be ascending, distinct middle tokens; anything else is CorruptChunk, never a wrong
    scatter."""
    shape = (1, 2, 1, 48, 64)  # recent 16, selected 16, middle tokens 1..31
    blob = codec.pack("k6v4z", torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    off, size = _section_offset_for("k6v4z", shape, "float32", "v_sel")
    bad = blob.clone()
    bad[off:off + 4] = torch.tensor(sel, dtype=torch.int16).view(torch.uint8)
    if sel == [40, 41]:  # beyond the middle: the last two slots
        bad[off:off + size] = torch.tensor(list(range(1, 15)) + sel, dtype=torch.int16).view(torch.uint8)
    with pytest.raises(codec.CorruptChunk, match="selected value tokens"):
        codec.unpack("k6v4z", _refresh_crc(bad), shape, "float32")


@pytest.mark.parametrize("mode", ["k8v8", "k8v4", "k6v4z"])
def test_unpack_into_out_runs_on_outs_device_and_refuses_another(mode):
    """With `out`, unpack dequantizes on out's device (tests/test_cuda.py checks a CUDA `out`); a `device` that
    contradicts it is refused by name rather than failing inside a kernel."""
    x = torch.randn(2, 2, 2, 32, 64, generator=torch.Generator().manual_seed(3))
    blob = codec.pack(mode, x)
    out = torch.full_like(x, float("nan"))
    assert codec.unpack(mode, blob, x.shape, "float32", device="cpu", out=out) is out
    assert torch.equal(out, codec.unpack(mode, blob, x.shape, "float32"))
    with pytest.raises(ValueError, match="device meta is not the device of out"):
        codec.unpack(mode, blob, x.shape, "float32", device="meta", out=out)
