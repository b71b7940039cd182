"""pack and unpack: one chunk [L, 2, H, T, D] to its packed bytes and back, for every mode (k8v8 inline; k8v4 and
k6v4z through promptcache.codec.entropy), with every check that keeps a malformed blob from decoding to NaN or Inf.
"""
from __future__ import annotations

import math
import zlib

import torch

from promptcache.codec.entropy import (
    _coded_streams, _dense_selected, _dense_streams, _pack_coded, _pack_dense, _value_plan)
from promptcache.codec.formats import (
    _DTYPE_IDS, _DTYPE_IDS_BY_TORCH, _DTYPES, HEADER, HEADER_BYTES, MAGIC, _MODE_IDS, VERSION, Z_HEADER, CorruptChunk,
    _check_mode, _dense_value_split, read_header, _sections, v_group_size)
from promptcache.codec.quantizers import (
    _LOG_TABLE, _needed_scale, _quant_groups, _rotation, _round_up_fp16, _u8, _unpack_nibbles)
from promptcache.codec.rope import _rope


def pack(mode: str, chunk: torch.Tensor, rope_theta: float = 0.0) -> torch.Tensor:
    """Quantize one chunk [L, 2, H, T, D] (in the KV dtype) into a 1-D uint8 CPU tensor of packed_nbytes bytes.

    rope_theta (k6v4z only; ignored by the other modes): the model's RoPE base when its keys are rotated the
    rotate-half way over the whole head (Llama and most HF models with rope_type "default"; rope_theta_of(config)),
    0 if unknown. k6v4z then codes the keys with the rotation of each token's offset in the chunk undone, which
    restores their per-channel structure (docs/quantization.md); the base travels in the blob, so decoding never
    depends on it, and a base that does not help (a wrong one) is not used, nor one whose rotation, re-applied on
    decoding, could carry a key beyond the KV dtype's range (float16 keys near 65504).

    ValueError for NaN or Inf, and for values too large for the mode (a chunk the decoder would refuse: float16
    values near its range, values whose squares overflow float32): such a chunk is not cached."""
    _check_mode(mode)
    if not (math.isfinite(rope_theta) and rope_theta >= 0):
        raise ValueError(f"rope_theta must be a finite number >= 0, got {rope_theta!r}")
    if chunk.dtype not in _DTYPE_IDS_BY_TORCH:
        raise ValueError(f"chunk dtype {chunk.dtype} is not float32, float16 or bfloat16")
    if chunk.dim() != 5 or chunk.shape[1] != 2:
        raise ValueError(f"chunk shape must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(chunk.shape)}")
    kv_dtype = _DTYPE_IDS_BY_TORCH[chunk.dtype]
    shape = tuple(chunk.shape)
    secs = _sections(mode, shape, kv_dtype)
    L, _, H, T, D = shape
    x = chunk.float()
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize a chunk that contains NaN or Inf")
    k, v = x[:, 0], x[:, 1]  # [L, H, T, D]

    g = v_group_size(D)
    ng = D // g
    if mode == "k8v8":
        k_scale = _round_up_fp16(_needed_scale(k, 2, 255))  # [L, H, 1, D]
        k_codes, k_zero = _quant_groups(k, 2, 255, k_scale.float())
        vg = v.reshape(L, H, T, ng, g)
        v_scale = _round_up_fp16(_needed_scale(vg, 4, 255))  # [L, H, T, ng, 1]
        v_codes, v_zero = _quant_groups(vg, 4, 255, v_scale.float())
        parts = [k_codes, _u8(k_scale), k_zero, v_codes, _u8(v_scale), v_zero]
    elif mode == "k8v4":
        parts = _pack_coded(k, v, g, secs, rope_theta)
    else:
        parts = _pack_dense(k, v, g, secs, rope_theta)
    body = torch.cat([p.reshape(-1).to("cpu", torch.uint8) for p in parts])
    try:  # never store a chunk the decoder would refuse (float16 values near its range; scales NaN from overflow)
        _check_scales(mode, _split(body, secs), (L, H, T, D), kv_dtype)
    except CorruptChunk as exc:
        if mode != "k8v8" and Z_HEADER.unpack(bytes(body[:Z_HEADER.size].tolist()))[-1]:
            # keys coded with RoPE undone: the rotation re-applied can move a channel pair's whole norm into one
            # channel; coded as stored, each channel is bounded on its own
            return pack(mode, chunk, 0.0)
        raise ValueError(f"values too large to quantize as {mode} in {kv_dtype}: the decoder would refuse the "
                         f"chunk ({exc})") from None
    crc = zlib.crc32(body.numpy())
    n = L * H * T * D
    header = HEADER.pack(MAGIC, VERSION, _MODE_IDS[mode], _DTYPE_IDS[kv_dtype], 0, crc, n)
    blob = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), body])
    assert blob.numel() == sum(s for _, s in secs)
    return blob


def unpack(mode: str, blob: torch.Tensor, shape, kv_dtype: str, device: torch.device | str | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a packed chunk into [L, 2, H, T, D] of `kv_dtype`; CorruptChunk on any inconsistency.

    Never returns NaN or Inf: the length, header (mode, dtype, element count), CRC32, scales and zero points are
    all checked, and the scales bound every result. `out` (optional): a tensor (or strided view) of that shape and
    dtype to write into (after a CorruptChunk its contents are unspecified: discard it); the dequantization then runs
    on out's device, and `device`, if given, must be that device. Without `out`, on `device` (default: the CPU).
    """
    if out is not None:
        if device is not None and torch.device(device).type != out.device.type:
            raise ValueError(f"device {device} is not the device of out ({out.device})")
        # (a CUDA `out` with the views left on the CPU mixed devices in the fused kernels: seen on an H200)
        device = out.device
    secs = _sections(mode, shape, kv_dtype)
    expected = sum(s for _, s in secs)
    if not isinstance(blob, torch.Tensor):
        blob = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise CorruptChunk(f"a packed chunk must be a 1-D uint8 tensor, got {blob.dtype} {tuple(blob.shape)}")
    blob = blob.cpu().contiguous()  # (crc32 reads it as one buffer)
    if blob.numel() != expected:
        raise CorruptChunk(f"{mode} chunk of shape {tuple(shape)} ({kv_dtype}) must be {expected} bytes, "
                           f"got {blob.numel()}")
    hdr = read_header(blob)
    if hdr["mode"] != mode:
        raise CorruptChunk(f"chunk was packed with mode {hdr['mode']}, expected {mode}")
    if hdr["kv_dtype"] != kv_dtype:
        raise CorruptChunk(f"chunk was packed from {hdr['kv_dtype']}, expected {kv_dtype}")
    L, _, H, T, D = (int(s) for s in shape)
    if hdr["elements"] != L * H * T * D or hdr["reserved"] != 0:
        raise CorruptChunk(f"chunk header says {hdr['elements']} elements, shape {tuple(shape)} has {L * H * T * D}")
    body = blob[HEADER_BYTES:]
    if zlib.crc32(body.numpy()) != hdr["crc32"]:
        raise CorruptChunk("quantized chunk checksum (crc32) mismatch: the bytes were altered")

    views = _split(body, secs)
    if mode == "k6v4z":
        views = _dense_streams(views, L, H, T, D)
    elif mode == "k8v4":
        views = _coded_streams(views, L, H, T, D)
    _check_scales(mode, views, (L, H, T, D), kv_dtype)
    if device is not None:
        views = {k: t.to(device) for k, t in views.items()}

    g = v_group_size(D)
    ng = D // g
    if out is None:
        out = torch.empty((L, 2, H, T, D), dtype=_DTYPES[kv_dtype], device=views["k_scale"].device)
    elif tuple(out.shape) != (L, 2, H, T, D) or out.dtype != _DTYPES[kv_dtype]:
        raise ValueError(f"out must be {(L, 2, H, T, D)} {kv_dtype}, got {tuple(out.shape)} {out.dtype}")

    def per_channel(prefix: str, tokens: int, into: torch.Tensor | None = None) -> torch.Tensor:
        scale = views[f"{prefix}_scale"].view(torch.float16).float().reshape(L, H, 1, D)
        zero = views[f"{prefix}_zero"].reshape(L, H, 1, D)
        codes = views[f"{prefix}_codes"]
        # x = code * scale - zero * scale: one fused multiply-add per element
        return torch.addcmul(-zero.float() * scale, codes.reshape(L, H, tokens, D).float(), scale, out=into)

    def dequant8(prefix: str, tokens: int) -> torch.Tensor:
        scale = views[f"{prefix}_scale"].view(torch.float16).float().reshape(L, H, tokens, ng, 1)
        zero = views[f"{prefix}_zero"].reshape(L, H, tokens, ng, 1)
        codes = views[f"{prefix}_codes"].reshape(L, H, tokens, ng, g).float()
        return torch.addcmul(-zero.float() * scale, codes, scale).reshape(L, H, tokens, D)

    # (every scale and zero point was checked by _check_scales: each result below is within kv_dtype's range)
    if mode == "k8v8":
        out[:, 0].copy_(per_channel("k", T))
        out[:, 1].copy_(dequant8("v", T))
        return out
    theta = float(views["rope_theta"])  # k6v4z and k8v4 (format 3): keys coded with the in-chunk RoPE undone
    keys = torch.empty((L, H, T, D), device=out.device)
    keys[:, :, :1] = dequant8("k0", 1)
    per_channel("k", T - 1, into=keys[:, :, 1:])
    out[:, 0].copy_(_rope(keys, theta, 1.0) if theta else keys)  # each pair's L2 norm checked against the range
    if mode == "k8v4":
        scale = views["v_scale"].view(torch.float16).float().reshape(L, H, T, ng, 1)
        zero = views["v_zero"].reshape(L, H, T, ng, 1)
        y = torch.addcmul(-zero.float() * scale, views["v_codes"].reshape(L, H, T, ng, g).float(), scale)
        out[:, 1].copy_((y @ _rotation(g, out.device)).reshape(L, H, T, D))
        return out
    eight, low = _value_plan(T, _dense_selected(views["v_sel"], L, H, T))
    nh, mid = eight.shape[2], low.shape[2]
    parts = [dequant8("v8", nh)]  # stored order; put back in token order below
    if mid:
        m = L * H * mid * ng
        scale = _LOG_TABLE.to(out.device)[views["v_scale"].long()].reshape(L, H, mid, ng, 1)
        zero = _unpack_nibbles(views["v_zero"], m).reshape(L, H, mid, ng, 1)
        codes = _unpack_nibbles(views["v_codes"], L * H * mid * D).reshape(L, H, mid, ng, g).float()
        y = torch.addcmul(-zero.float() * scale, codes, scale)
        parts.append((y @ _rotation(g, out.device)).reshape(L, H, mid, D))
    # one row gather: token t of (layer, head) is stored row inverse[t] of it
    inverse = torch.argsort(torch.cat([eight, low], dim=2), dim=2)
    rows = (inverse + torch.arange(L * H, device=out.device).view(L, H, 1) * T).reshape(-1)
    out[:, 1].copy_(torch.cat(parts, dim=2).reshape(L * H * T, D).index_select(0, rows).reshape(L, H, T, D))
    return out


# The sections viewed as float16 or int16 (k6v4z's v_scale is uint8 log codes: copying it too costs nothing).
_WIDE = {"k_scale", "k0_scale", "v8_scale", "v_scale", "v_sel"}


def _split(body: torch.Tensor, secs) -> dict:
    """The sections after the header as views of body; a float16 or int16 section at an odd offset (a blob that is a
    view at an odd offset of a larger buffer, as an answer's chunks are laid back to back; or k8v8 with an odd
    element count) is copied, since torch views such bytes as float16 only at even offsets."""
    views, off = {}, 0
    for name, size in secs[1:]:
        t = body[off:off + size]
        if name in _WIDE and t.storage_offset() % 2:
            t = t.clone()
        views[name] = t
        off += size
    return views


def _check_scales(mode: str, views: dict, dims, kv_dtype: str) -> None:
    """CorruptChunk unless every scale is a finite positive number, every zero point is in its range, and no
    dequantized value can leave kv_dtype's range: what bounds every value unpack returns (so never NaN or Inf).
    views: the body's sections (_split; k8v4 and k6v4z: with their sub-header, or after their streams were read,
    code_top and rope_theta instead). Also run by pack on its own chunk, so that no chunk the decoder would refuse
    is ever stored."""
    L, H, T, D = dims
    g = v_group_size(D)
    ng = D // g
    limit = torch.finfo(_DTYPES[kv_dtype]).max
    if mode == "k8v8":
        top, theta = 255, 0.0
    elif "z_header" in views:  # (pack's own chunk: its streams are not read)
        fields = Z_HEADER.unpack(bytes(views["z_header"].tolist()))
        top, theta = fields[0], fields[-1]
    else:
        top, theta = int(views["code_top"]), float(views["rope_theta"])

    def f16(name: str, what: str) -> torch.Tensor:
        scale = views[name].view(torch.float16).float()
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise CorruptChunk(f"{what} scales are not finite positive numbers")
        return scale

    def zeros(name: str, what: str, most: int, count: int | None = None) -> None:
        zero = views[name] if count is None else _unpack_nibbles(views[name], count)
        if (zero > most).any():
            raise CorruptChunk(f"{what} zero points out of range (must be <= {most})")

    def within(bound: float, what: str) -> None:
        if bound > limit:
            raise CorruptChunk(f"{what} scales out of range: dequantized values would overflow {kv_dtype}")

    if mode != "k8v8":  # token 0's keys: 8-bit per token and group (not rotated: its RoPE angle is 0)
        s0 = f16("k0_scale", "token 0 key")
        zeros("k0_zero", "token 0 key", 254)
        within(float(s0.max()) * 255, "token 0 key")
    # keys per channel: |x| <= top * scale; with RoPE undone (theta), the rotation re-applied turns each channel pair
    # (i, i + D/2), so a channel can take the pair's whole L2 norm: bound that instead
    k = f16("k_scale", "key").reshape(L, H, D) * top
    zeros("k_zero", "key", top - 1)
    if theta and D % 2 == 0:
        k = (k[..., :D // 2].square() + k[..., D // 2:].square()).sqrt()
    within(float(k.max()), "key")
    if mode == "k8v8":
        within(float(f16("v_scale", "value").max()) * 255, "value")
        zeros("v_zero", "value", 254)
        return
    # rotated values: |y| <= top * scale, and the rotation back keeps each group's L2 norm: |value| <= sqrt(g) * that
    if mode == "k8v4":
        vs = float(f16("v_scale", "value").max())
        zeros("v_zero", "value", top - 1)
        within(vs * top * math.sqrt(g), "value")
        return
    within(float(f16("v8_scale", "value").max()) * 255, "value")
    zeros("v8_zero", "value", 254)
    mid = _dense_value_split(T)[3]
    if mid:
        m = L * H * mid * ng
        zeros("v_zero", "value", 14, m)
        within(float(_LOG_TABLE[views["v_scale"].long()].max()) * 15 * math.sqrt(g), "value")
