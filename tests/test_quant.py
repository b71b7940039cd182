"""Quantized chunk formats: exact length, round-trip error bounds, corrupt blobs rejected."""
from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptcache import quant
from promptcache.keys import ModelSpec
from promptcache.layout import chunk_nbytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("k8v8", "k8v4")


@st.composite
def chunks(draw):
    L = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    T = draw(st.integers(1, 19))
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


def _check_roundtrip(mode, x, dtype):
    blob = quant.pack(mode, x)
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    assert blob.numel() == quant.packed_nbytes(mode, tuple(x.shape), dtype)
    y = quant.unpack(mode, blob, tuple(x.shape), dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.isfinite(y).all()
    err = (y.float() - x.float()).abs()
    # quantization bound plus the final rounding to the KV dtype
    bound = quant.error_bound(mode, x) * 1.0001 + y.float().abs() * torch.finfo(x.dtype).eps + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    if mode == "k8v4" and x.shape[3] > 1:
        L, _, H, T, D = x.shape
        g = quant.v_group_size(D)
        e = (y.float() - x.float())[:, 1, :, 1:].reshape(L, H, T - 1, D // g, g)
        slack = y.float()[:, 1, :, 1:].abs().reshape(L, H, T - 1, D // g, g).amax(-1) * torch.finfo(x.dtype).eps * g
        assert (e.norm(dim=-1) <= quant.value_group_l2_bound(x) + slack).all()


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=chunks())
def test_roundtrip_within_bound_and_exact_length(mode, data):
    x, dtype = data
    _check_roundtrip(mode, x, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_zero_is_exact_and_constant_groups(mode):
    x = torch.zeros(2, 2, 3, 8, 64)
    y = quant.unpack(mode, quant.pack(mode, x), x.shape, "float32")
    assert torch.equal(y, x)
    x = torch.full((1, 2, 1, 4, 64), 3.25)  # all-positive constant groups still covered
    _check_roundtrip(mode, x, "float32")


def test_compression_for_smollm2_geometry():
    shape = (30, 2, 3, 256, 64)
    assert quant.compression_vs_fp16("k8v4", shape) >= 2.6
    assert quant.compression_vs_fp16("k8v8", shape) >= 1.9
    spec = ModelSpec("m", "r", "float16", 30, 3, 64, quantization="k8v4")
    assert chunk_nbytes(spec, 256) == quant.packed_nbytes("k8v4", shape, "float16")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown quantization mode"):
        quant.packed_nbytes("k4v2", (1, 2, 1, 1, 64), "float32")
    with pytest.raises(ValueError, match="even head_dim"):
        quant.packed_nbytes("k8v4", (1, 2, 1, 1, 63), "float32")
    with pytest.raises(ValueError, match="shape"):
        quant.pack("k8v4", torch.zeros(1, 3, 1, 1, 64))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.pack("k8v4", torch.tensor([float("nan")]).expand(1, 2, 1, 1, 64).contiguous())
    with pytest.raises(ValueError, match="dtype"):
        quant.pack("k8v4", torch.zeros(1, 2, 1, 1, 64, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ corrupt blobs
SHAPE = (2, 2, 3, 16, 64)


def _blob(mode="k8v4", dtype="float16"):
    x = (torch.randn(SHAPE) * 2).to(DTYPES[dtype])
    return quant.pack(mode, x)


def _section_offset(mode, dtype, name):
    off = 0
    for sec, size in quant._sections(mode, SHAPE, dtype):
        if sec == name:
            return off, size
        off += size
    raise KeyError(name)


def _refresh_crc(blob: torch.Tensor) -> torch.Tensor:
    """Re-seal a deliberately edited blob so that the scale/zero checks (not the checksum) must catch it."""
    blob = blob.clone()
    crc = zlib.crc32(blob[quant.HEADER_BYTES:].numpy())
    blob[8:12] = torch.frombuffer(bytearray(struct.pack("<I", crc)), dtype=torch.uint8)
    return blob


@pytest.mark.parametrize("mode", MODES)
def test_wrong_length_rejected(mode):
    blob = _blob(mode)
    with pytest.raises(quant.CorruptChunk, match="must be .* bytes"):
        quant.unpack(mode, blob[:-1], SHAPE, "float16")
    with pytest.raises(quant.CorruptChunk, match="must be .* bytes"):
        quant.unpack(mode, torch.cat([blob, blob[:1]]), SHAPE, "float16")


@pytest.mark.parametrize("mode", MODES)
def test_flipped_byte_rejected(mode):
    blob = _blob(mode).clone()
    blob[quant.HEADER_BYTES + 100] ^= 0x10
    with pytest.raises(quant.CorruptChunk, match="checksum"):
        quant.unpack(mode, blob, SHAPE, "float16")


def test_wrong_mode_dtype_shape_magic_rejected():
    forged = _blob("k8v4").clone()
    forged[5] = 1  # header says k8v8 (the lengths differ too, so only a forged header gets this far)
    with pytest.raises(quant.CorruptChunk, match="mode k8v8, expected k8v4"):
        quant.unpack("k8v4", forged, SHAPE, "float16")
    blob = _blob("k8v4", "bfloat16")
    with pytest.raises(quant.CorruptChunk, match="packed from bfloat16, expected float16"):
        quant.unpack("k8v4", blob, SHAPE, "float16")
    other_shape = (2, 2, 3, 8, 128)  # same element count, different layout
    with pytest.raises(quant.CorruptChunk):
        quant.unpack("k8v4", blob, other_shape, "bfloat16")
    bad = blob.clone()
    bad[0] = ord("X")
    with pytest.raises(quant.CorruptChunk, match="magic"):
        quant.unpack("k8v4", bad, SHAPE, "bfloat16")
    with pytest.raises(quant.CorruptChunk, match="1-D uint8"):
        quant.unpack("k8v4", blob.view(torch.int8), SHAPE, "bfloat16")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
@pytest.mark.parametrize("mode", MODES)
def test_bad_fp16_scales_rejected(mode, value):
    blob = _blob(mode)
    off, _ = _section_offset(mode, "float16", "k_scale")
    bad = blob.clone()
    bad[off:off + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(quant.CorruptChunk, match="key scales"):
        quant.unpack(mode, _refresh_crc(bad), SHAPE, "float16")
    for sec in (["v_scale"] if mode == "k8v8" else ["v0_scale"]):
        off, _ = _section_offset(mode, "float16", sec)
        bad = blob.clone()
        bad[off:off + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
        with pytest.raises(quant.CorruptChunk, match="value scales"):
            quant.unpack(mode, _refresh_crc(bad), SHAPE, "float16")


def test_out_of_range_scales_and_zeros_rejected():
    # k8v4 value scale code 255 = 2**15.9: 15 levels of it overflow float16 -> rejected, never Inf
    blob = _blob("k8v4")
    off, _ = _section_offset("k8v4", "float16", "v_scale")
    bad = blob.clone()
    bad[off] = 255
    with pytest.raises(quant.CorruptChunk, match="overflow float16"):
        quant.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")
    # the same code is fine for float32
    x = torch.randn(SHAPE)
    b32 = quant.pack("k8v4", x)
    bad = b32.clone()
    bad[off] = 255
    y = quant.unpack("k8v4", _refresh_crc(bad), SHAPE, "float32")
    assert torch.isfinite(y).all()
    # zero points beyond the format's range
    off, _ = _section_offset("k8v4", "float16", "v_zero")
    bad = blob.clone()
    bad[off] = 0xFF
    with pytest.raises(quant.CorruptChunk, match="value zero points"):
        quant.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")
    off, _ = _section_offset("k8v4", "float16", "k_zero")
    bad = blob.clone()
    bad[off] = 255
    with pytest.raises(quant.CorruptChunk, match="key zero points"):
        quant.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")
    # large fp16 key scale: 255 * 60000 overflows float16
    off, _ = _section_offset("k8v4", "float16", "k_scale")
    bad = blob.clone()
    bad[off:off + 2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(quant.CorruptChunk, match="overflow"):
        quant.unpack("k8v4", _refresh_crc(bad), SHAPE, "float16")
