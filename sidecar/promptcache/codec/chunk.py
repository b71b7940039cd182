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
    _DTYPE_IDS, _DTYPE_IDS_BY_TORCH, _DTYPES, HEADER, HEADER_BYTES, MAGIC, _MODE_IDS, VERSION, CorruptChunk,
    _check_mode, read_header, _sections, v_group_size)
from promptcache.codec.quantizers import (
    _LOG_TABLE, _needed_scale, _quant_groups, _rotation, _round_up_fp16, _u8, _unpack_nibbles)
from promptcache.codec.rope import _rope


def pack(mode: str, chunk: torch.Tensor, rope_theta: float = 0.0) -> torch.Tensor:
    """Quantize one chunk [L, 2, H, T, D] (in the KV dtype) into a 1-D uint8 CPU tensor of packed_nbytes bytes.

    rope_theta (k6v4z only; ignored by the other modes): the model's RoPE base when its keys are rotated the
    rotate-half way over the whole head (Llama and most HF models with rope_type "default"; rope_theta_of(config)),
    0 if unknown. k6v4z then codes the keys with the rotation of each token's offset in the chunk undone, which
    restores their per-channel structure (docs/quantization.md); the base travels in the blob, so decoding never
    depends on it, and a base that does not help (a wrong one) is not used."""
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
    blob = blob.cpu()
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

    views = {}
    off = 0
    for name, size in secs[1:]:
        views[name] = body[off:off + size]
        off += size
    if mode == "k6v4z":
        views = _dense_streams(views, L, H, T, D)
    elif mode == "k8v4":
        views = _coded_streams(views, L, H, T, D)
    if device is not None:
        views = {k: t.to(device) for k, t in views.items()}

    g = v_group_size(D)
    ng = D // g
    limit = torch.finfo(_DTYPES[kv_dtype]).max
    if out is None:
        out = torch.empty((L, 2, H, T, D), dtype=_DTYPES[kv_dtype], device=views["k_scale"].device)
    elif tuple(out.shape) != (L, 2, H, T, D) or out.dtype != _DTYPES[kv_dtype]:
        raise ValueError(f"out must be {(L, 2, H, T, D)} {kv_dtype}, got {tuple(out.shape)} {out.dtype}")

    def per_channel(prefix: str, tokens: int, top: int, into: torch.Tensor | None = None) -> torch.Tensor:
        scale = views[f"{prefix}_scale"].view(torch.float16).float().reshape(L, H, 1, D)
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise CorruptChunk("key scales are not finite positive numbers")
        zero = views[f"{prefix}_zero"].reshape(L, H, 1, D)
        if (zero > top - 1).any():
            raise CorruptChunk(f"key zero points out of range (must be <= {top - 1})")
        if float(scale.max()) * top > limit:
            raise CorruptChunk(f"key scales out of range: dequantized values would overflow {kv_dtype}")
        codes = views[f"{prefix}_codes"]
        # x = code * scale - zero * scale: one fused multiply-add per element
        return torch.addcmul(-zero.float() * scale, codes.reshape(L, H, tokens, D).float(), scale, out=into)

    def dequant8(prefix: str, tokens: int, what: str = "value") -> torch.Tensor:
        scale = views[f"{prefix}_scale"].view(torch.float16).float().reshape(L, H, tokens, ng, 1)
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise CorruptChunk(f"{what} scales are not finite positive numbers")
        zero = views[f"{prefix}_zero"].reshape(L, H, tokens, ng, 1)
        if (zero > 254).any():
            raise CorruptChunk(f"{what} zero points out of range (must be <= 254)")
        if float(scale.max()) * 255 > limit:
            raise CorruptChunk(f"{what} scales out of range: dequantized values would overflow {kv_dtype}")
        codes = views[f"{prefix}_codes"].reshape(L, H, tokens, ng, g).float()
        return torch.addcmul(-zero.float() * scale, codes, scale).reshape(L, H, tokens, D)

    if mode == "k8v8":
        out[:, 0].copy_(per_channel("k", T, 255))
        out[:, 1].copy_(dequant8("v", T))
        return out
    theta = float(views["rope_theta"])  # k6v4z and k8v4 (format 3): keys coded with the in-chunk RoPE undone
    keys = torch.empty((L, H, T, D), device=out.device)
    keys[:, :, :1] = dequant8("k0", 1, "token 0 key")
    per_channel("k", T - 1, int(views["code_top"]), into=keys[:, :, 1:])
    out[:, 0].copy_(_rope(keys, theta, 1.0) if theta else keys)  # the rotation keeps |key| within the bound
    if mode == "k8v4":
        top = int(views["code_top"])
        scale = views["v_scale"].view(torch.float16).float().reshape(L, H, T, ng, 1)
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise CorruptChunk("value scales are not finite positive numbers")
        zero = views["v_zero"].reshape(L, H, T, ng, 1)
        if (zero > top - 1).any():
            raise CorruptChunk(f"value zero points out of range (must be <= {top - 1})")
        # |rotated value| <= top * scale, and the rotation keeps the L2 norm of a group: |value| <= sqrt(g) * that
        if float(scale.max()) * top * math.sqrt(g) > limit:
            raise CorruptChunk(f"value scales out of range: dequantized values would overflow {kv_dtype}")
        y = torch.addcmul(-zero.float() * scale, views["v_codes"].reshape(L, H, T, ng, g).float(), scale)
        out[:, 1].copy_((y @ _rotation(g, out.device)).reshape(L, H, T, D))
        return out
    eight, low = _value_plan(T, _dense_selected(views["v_sel"], L, H, T))
    nh, mid = eight.shape[2], low.shape[2]
    parts = [dequant8("v8", nh)]  # stored order; put back in token order below
    if mid:
        top = 15
        m = L * H * mid * ng
        scale = _LOG_TABLE.to(out.device)[views["v_scale"].long()].reshape(L, H, mid, ng, 1)
        zero = _unpack_nibbles(views["v_zero"], m).reshape(L, H, mid, ng, 1)
        if (zero > top - 1).any():
            raise CorruptChunk(f"value zero points out of range (must be <= {top - 1})")
        # |rotated value| <= top * scale, and the rotation keeps the L2 norm of a group: |value| <= sqrt(g) * that
        if float(scale.max()) * top * math.sqrt(g) > limit:
            raise CorruptChunk(f"value scales out of range: dequantized values would overflow {kv_dtype}")
        codes = _unpack_nibbles(views["v_codes"], L * H * mid * D).reshape(L, H, mid, ng, g).float()
        y = torch.addcmul(-zero.float() * scale, codes, scale)
        parts.append((y @ _rotation(g, out.device)).reshape(L, H, mid, D))
    # one row gather: token t of (layer, head) is stored row inverse[t] of it
    inverse = torch.argsort(torch.cat([eight, low], dim=2), dim=2)
    rows = (inverse + torch.arange(L * H, device=out.device).view(L, H, 1) * T).reshape(-1)
    out[:, 1].copy_(torch.cat(parts, dim=2).reshape(L * H * T, D).index_select(0, rows).reshape(L, H, T, D))
    return out
