"""Adversarial and numerical audit of the codec (promptcache.codec): chunks forged by a writer that shares the key
space (the CRC re-sealed, so that only the format's own checks stand between the bytes and the model), blobs laid
out as the transports hand them over, and K/V at the edges of their dtypes. Each test failed before its fix."""
from __future__ import annotations

import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from promptcache import codec
from promptcache.codec import entropy, formats
from promptcache.codec.rope import _rope


def _split(blob, mode, shape, dtype):
    parts, off = {}, 0
    for name, size in formats._sections(mode, shape, dtype):
        parts[name] = blob[off:off + size].clone()
        off += size
    return parts


def _seal(parts, mode, shape, dtype):
    """The sections joined and the header's CRC32 recomputed, as a forger would."""
    blob = torch.cat([parts[name] for name, _ in formats._sections(mode, shape, dtype)])
    blob[8:12] = torch.frombuffer(bytearray(struct.pack("<I", zlib.crc32(blob[16:].numpy()))), dtype=torch.uint8)
    return blob


def _u8(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _forge_streams(parts, fields, streams: bytes):
    parts["z_header"] = _u8(codec.Z_HEADER.pack(*fields))
    room = parts["streams"].numel()
    assert len(streams) <= room
    parts["streams"] = _u8(streams + bytes(room - len(streams)))


def _zheader(parts):
    return list(codec.Z_HEADER.unpack(bytes(parts["z_header"].tolist())))


@pytest.mark.parametrize("mode", ["k8v4", "k6v4z"])
def test_forged_keys_cannot_overflow_float16_when_rope_is_reapplied(mode):
    """Keys coded with RoPE undone: each channel within top * scale <= 65504 passed the checks, but the rotation
    re-applied can move a channel pair's whole L2 norm (up to sqrt(2) * 65504) into one channel: Inf in a float16
    chunk (a forged one: scale 256, every code 255, RoPE base 10000). The decoder bounds the pairs' norms."""
    import zstandard

    L, H, T, D = 1, 1, 8, 64
    shape = (L, 2, H, T, D)
    blob = codec.pack(mode, torch.randn(shape).half(), rope_theta=10000.0)
    parts = _split(blob, mode, shape, "float16")
    f = _zheader(parts)
    parts["k_scale"] = torch.full((L * H * D,), 256.0, dtype=torch.float16).view(torch.uint8)
    parts["k_zero"] = torch.zeros(L * H * D, dtype=torch.uint8)
    keys = zstandard.ZstdCompressor().compress(bytes([255]) * (L * H * (T - 1) * D))
    rest = bytes(parts["streams"][f[3]:f[3] + f[4] + (f[5] if mode == "k6v4z" else 0)].tolist())
    f[0], f[3], f[6] = 255, len(keys), 10000.0
    _forge_streams(parts, f, keys + rest)
    with pytest.raises(codec.CorruptChunk, match="key scales out of range"):
        codec.unpack(mode, _seal(parts, mode, shape, "float16"), shape, "float16")


@pytest.mark.parametrize("mode", ["k8v4", "k6v4z"])
def test_pack_codes_keys_as_stored_when_their_rotation_could_overflow(mode):
    """float16 keys whose one token's channel pair (60000, 60000) fits as stored, but coded with RoPE undone needs a
    step whose top code, rotated back, leaves float16: pack stored a chunk its own decoder refused on every read.
    Now it codes such keys as stored (RoPE base 0 in the sub-header)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 4, 24, 64, generator=g) * 0.5 + torch.randn(1, 4, 1, 64, generator=g) * 20
    k = _rope(k, 10000.0, 1.0)  # constant components, rotated as a model stores them: RoPE undone pays
    k[:, 0, 7, 3] = k[:, 0, 7, 35] = 60000.0
    x = torch.stack([k, torch.randn(1, 4, 24, 64, generator=g)], 1).half()
    assert entropy._dense_key_frame(x[:, 0].float(), 10000.0)[0] == 10000.0
    blob = codec.pack(mode, x, 10000.0)
    theta = codec.Z_HEADER.unpack(bytes(blob[16:16 + codec.Z_HEADER.size].tolist()))[-1]
    y = codec.unpack(mode, blob, x.shape, "float16")
    assert theta == 0.0 and torch.isfinite(y).all()
    bound = codec.error_bound(mode, x, theta) * 1.0001 + y.float().abs() * 2.0 ** -10
    assert ((y.float() - x.float()).abs() <= bound).all()


def _rle_bomb(total: int) -> bytes:
    """One zstd frame that states `total` bytes and holds them as RLE blocks of 128 KiB (4 bytes each)."""
    block = 128 * 1024
    n = total // block
    head = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + total.to_bytes(8, "little")  # single segment, 8-byte content size
    return head + b"".join(((i == n - 1) | (1 << 1) | (block << 3)).to_bytes(3, "little") + b"\0" for i in range(n))


def test_zstd_frames_that_state_another_size_or_carry_more_are_refused_before_decompressing():
    """A stream's frame stating far more than the stream's raw size (a decompression bomb: zstandard allocates and
    fills the stated size whatever max_output_size says; 4 bytes of RLE block make 128 KiB, so a 1.6 MB slot could
    make tens of GB) is refused from its header; so are frames that state no size, and data after the frame."""
    import zstandard

    shape, mode = (2, 2, 3, 48, 64), "k6v4z"
    blob = codec.pack(mode, torch.randn(shape).half())
    parts = _split(blob, mode, shape, "float16")
    f = _zheader(parts)
    streams = bytes(parts["streams"].tolist())
    v8, v4 = streams[f[3]:f[3] + f[4]], streams[f[3] + f[4]:f[3] + f[4] + f[5]]
    raw = 2 * 3 * 47 * 64

    def with_keys(stream: bytes) -> torch.Tensor:
        forged = {k: v.clone() for k, v in parts.items()}
        _forge_streams(forged, [f[0], f[1], 0, len(stream), f[4], f[5], f[6]], stream + v8 + v4)
        return _seal(forged, mode, shape, "float16")

    good = zstandard.ZstdCompressor().compress(bytes(raw))
    assert codec.unpack(mode, with_keys(good), shape, "float16") is not None
    bomb = _rle_bomb(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(codec.CorruptChunk, match="k_codes stream holds 268435456 bytes"):
            codec.unpack(mode, with_keys(bomb), shape, "float16")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"decoding the refused chunk allocated {peak} bytes"
    unstated = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    for frame, match in ((unstated.compress(bytes(raw)) + unstated.flush(), "unstated size"),
                         (good + b"\1\2\3", "does not decompress"), (good + good, "does not decompress")):
        with pytest.raises(codec.CorruptChunk, match=match):
            codec.unpack(mode, with_keys(frame), shape, "float16")


@pytest.mark.parametrize("mode", ["k8v8", "k8v4", "k6v4z"])
def test_blobs_at_odd_offsets_decode(mode):
    """Client.get_blobs(copy=True) copies an answer's chunks back to back into one array and splits it (the bulk
    receive buffer lays them out the same): with an odd chunk length (k6v4z for SmolLM2: 1,685,211 bytes) every
    other blob starts at an odd offset, where torch would not view the scale bytes as float16 (RuntimeError, not
    CorruptChunk: the load failed as a client bug). k8v8 with an odd element count too."""
    shape = (2, 2, 3, 48, 64)
    x = torch.randn(shape).bfloat16()
    blob = codec.pack(mode, x)
    buf = torch.zeros(blob.numel() + 1, dtype=torch.uint8)
    buf[1:] = blob
    assert torch.equal(codec.unpack(mode, buf[1:], shape, "bfloat16"), codec.unpack(mode, blob, shape, "bfloat16"))
    arr = np.concatenate([blob.numpy(), blob.numpy()])  # what get_blobs does with an odd-length chunk
    second = torch.from_numpy(arr).split(blob.numel())[1]
    assert torch.equal(codec.unpack(mode, second, shape, "bfloat16"), codec.unpack(mode, blob, shape, "bfloat16"))
    if mode == "k8v8":
        odd = torch.randn(1, 2, 1, 3, 3)
        y = codec.unpack(mode, codec.pack(mode, odd), odd.shape, "float32")
        assert ((y - odd).abs() <= codec.error_bound(mode, odd) * 1.0001).all()


@pytest.mark.parametrize("mode", ["k8v8", "k8v4", "k6v4z"])
def test_pack_refuses_float16_chunks_its_decoder_would_refuse(mode):
    """float16 K/V at the top of the range (a key channel at 65504; a value token of 30000 in every channel, 240000
    after the Hadamard rotation): pack stored chunks whose scales the decoder refuses as overflowing float16, so
    every later fetch of the prefix failed as corrupt. pack now refuses them (ValueError: not cached)."""
    g = torch.Generator().manual_seed(1)
    key = torch.randn(2, 2, 3, 40, 64, generator=g)
    key[:, 0, :, :, 3] = 65504.0
    key[:, 0, :, 5, 3] = -100.0
    value = torch.randn(2, 2, 3, 40, 64, generator=g)
    value[:, 1, :, 3] = 30000.0
    cases = [key, value] if mode != "k8v8" else [key]
    for x in cases:
        with pytest.raises(ValueError, match="too large"):
            codec.pack(mode, x.half())
        assert torch.isfinite(codec.unpack(mode, codec.pack(mode, x), x.shape, "float32")).all()  # fp32: fits


@pytest.mark.parametrize("mode", ["k8v4", "k6v4z"])
def test_pack_refuses_keys_whose_squares_overflow_float32(mode):
    """A finite key of 5e19 (beyond 2**64) in tokens 1..T-1: its square overflows float32 in the key step floor,
    the step became NaN, and _round_up_fp16's `s > 65504` let NaN through: a chunk with NaN key scales was stored
    (refused on every read). pack refuses it."""
    x = torch.randn(2, 2, 3, 48, 64)
    x[0, 0, 1, 5, 3] = 5e19
    with pytest.raises(ValueError, match="too large"):
        codec.pack(mode, x, 10000.0)


def test_a_strided_blob_decodes():
    """A 1-D uint8 blob that is a strided view (stride 2): crc32 raised ValueError (not CorruptChunk) on the
    non-contiguous array; unpack reads a contiguous copy."""
    x = torch.randn(1, 2, 1, 8, 64)
    blob = codec.pack("k8v4", x)
    strided = torch.stack([blob, blob], 1).reshape(-1)[::2]
    assert not strided.is_contiguous()
    expected = codec.unpack("k8v4", blob, x.shape, "float32")
    assert torch.equal(codec.unpack("k8v4", strided, x.shape, "float32"), expected)
