"""The versioned formats of quantized chunks: the mode registry (MODES, the header's mode and dtype ids, retired
ids refused by name), the 16-byte header (MAGIC, VERSION, HEADER; read_header), the entropy-coded modes' 20-byte
sub-header (Z_HEADER), and each mode's section layout and fixed slot size (packed_nbytes). The byte layouts are
spelled out in promptcache.codec's docstring and docs/quantization.md.
"""
from __future__ import annotations

import math
import struct

import torch

MODES = ("k8v8", "k8v4", "k6v4z")
# Header mode ids. 2 was k8v4 format 1 (only the chunk's first token's values at 8 bits) and 3 k8v4 format 2 (fixed
# 8-bit keys and 4-bit values): retired by issue 16, their chunks have other keys (keys.QUANT_FORMATS) and are
# refused here by id, never decoded as format 3.
# 4 was k6v4z format 1 (keys coded as the model stored them, after RoPE): retired by format 2 likewise.
_MODE_IDS = {"k8v8": 1, "k8v4": 6, "k6v4z": 5}
_MODE_NAMES = {v: k for k, v in _MODE_IDS.items()} | {2: "k8v4 format 1 (retired)", 3: "k8v4 format 2 (retired)",
                                                   4: "k6v4z format 1 (retired)"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 2}
_DTYPE_NAMES = {v: k for k, v in _DTYPE_IDS.items()}
# k6v4z: the slot is 1/DENSE_RATIO of the chunk's fp16 bytes; key precision is the finest that fits (rate control)
DENSE_RATIO = 3.5
# k8v4 format 3: a fixed slot of 1/K8V4_RATIO of the chunk's fp16 bytes (its step floors: promptcache.codec.entropy)
K8V4_RATIO = 2.5
Z_HEADER = struct.Struct("<BBHIIIf")
MAGIC = b"PCQ1"
VERSION = 1
HEADER = struct.Struct("<4sBBBBII")  # magic, version, mode, dtype, reserved, crc32, N
HEADER_BYTES = HEADER.size  # 16
MAX_V_GROUP = 64


class CorruptChunk(ValueError):
    """A packed chunk is malformed: wrong length, header, checksum, scales or zero points."""


def _check_mode(mode: str) -> None:
    if mode not in _MODE_IDS:
        raise ValueError(f"unknown quantization mode {mode!r}; expected one of {', '.join(MODES)}")


def v_group_size(head_dim: int) -> int:
    """Channels per value group: 64 when head_dim is a multiple of 64, else 32, 16 or the whole head."""
    for g in (MAX_V_GROUP, 32, 16):
        if head_dim % g == 0:
            return g
    return head_dim


def _sections(mode: str, shape, kv_dtype: str) -> list[tuple[str, int]]:
    _check_mode(mode)
    if kv_dtype not in _DTYPES:
        raise ValueError(f"kv dtype {kv_dtype!r} is not one of {', '.join(_DTYPES)}")
    if len(shape) != 5 or shape[1] != 2 or any(int(s) <= 0 for s in shape):
        raise ValueError(f"chunk shape must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(shape)}")
    L, _, H, T, D = (int(s) for s in shape)
    n = L * H * T * D
    if n >= 2**32:
        raise ValueError("chunk too large for the quantized format (more than 2**32 elements per K or V)")
    ng = D // v_group_size(D)
    if mode in ("k6v4z", "k8v4") and T >= 2**15:
        raise ValueError(f"{mode} chunks hold at most {2**15 - 1} tokens, got {T}")
    secs = [("header", HEADER_BYTES)]
    if mode == "k8v8":
        return secs + [("k_codes", n), ("k_scale", 2 * L * H * D), ("k_zero", L * H * D),
                       ("v_codes", n), ("v_scale", 2 * L * H * T * ng), ("v_zero", L * H * T * ng)]
    if D % 2:
        raise ValueError(f"{mode} needs an even head_dim, got {D}")
    if mode == "k8v4":
        # format 3, a fixed-size slot: sub-header, the float16 scales (2-byte aligned), the zero points and token 0's
        # key codes raw, then the key and value code streams (zstd frames or raw), then zero padding up to the slot
        # (never smaller than the raw layout of 4-bit codes)
        fixed = [("z_header", Z_HEADER.size), ("k_scale", 2 * L * H * D), ("k0_scale", 2 * L * H * ng),
                 ("v_scale", 2 * L * H * T * ng), ("k_zero", L * H * D), ("k0_codes", L * H * D),
                 ("k0_zero", L * H * ng), ("v_zero", L * H * T * ng)]
        raw_floor = (L * H * (T - 1) * D + 1) // 2 + (n + 1) // 2
        used = HEADER_BYTES + sum(b for _, b in fixed)
        slot = max(int(n * 2 * 2 / K8V4_RATIO), used + raw_floor)
        return secs + fixed + [("streams", slot - used)]
    nh, mid = _dense_value_split(T)[2:]
    m = L * H * mid * ng
    values = [("v8_scale", 2 * L * H * nh * ng), ("v8_zero", L * H * nh * ng), ("v_scale", m), ("v_zero", (m + 1) // 2)]
    # k6v4z, a fixed-size slot: sub-header, the scales and zero points raw, then the three code streams (zstd frames
    # or raw), then zero padding up to the slot (never smaller than the raw layout at the coarsest key precision)
    # token 0's keys (the attention sink at chunk 0) 8-bit per token and group, as the 8-bit value tokens (its
    # zero points last: every float16 section stays 2-byte aligned)
    # the selected 8-bit value tokens: u16 token indices [L, H, N] (_dense_value_tokens)
    fixed = [("z_header", Z_HEADER.size), ("v_sel", 2 * L * H * _dense_value_split(T)[1]),
             ("k_scale", 2 * L * H * D), ("k_zero", L * H * D),
             ("k0_scale", 2 * L * H * ng), ("k0_codes", L * H * D)] + values + [("k0_zero", L * H * ng)]
    raw_floor = (L * H * (T - 1) * D + 1) // 2 + L * H * nh * D + L * H * mid * D // 2
    used = HEADER_BYTES + sum(b for _, b in fixed)
    slot = max(int(n * 2 * 2 / DENSE_RATIO), used + raw_floor)
    return secs + fixed + [("streams", slot - used)]


# k6v4z: its 8-bit value tokens are token 0, the last DENSE_V_RECENT and DENSE_V_SELECT more per (layer, head) whose
# keys point most against the chunk's mean key (see _dense_value_tokens).
DENSE_V_RECENT = 16
DENSE_V_SELECT = 16


def _dense_value_split(tokens: int) -> tuple[int, int, int, int]:
    """k6v4z: (recent, selected, 8-bit, low-bit) value token counts per (layer, head) for a chunk."""
    recent = min(DENSE_V_RECENT, tokens - 1)
    sel = min(DENSE_V_SELECT, tokens - 1 - recent)
    return recent, sel, 1 + recent + sel, tokens - 1 - recent - sel


def packed_nbytes(mode: str, shape, kv_dtype: str) -> int:
    """Exact byte length of a packed chunk of logical `shape` [L, 2, H, T, D] (for k6v4z: its fixed slot)."""
    return sum(n for _, n in _sections(mode, shape, kv_dtype))


def compression_vs_fp16(mode: str, shape, kv_dtype: str = "float16") -> float:
    return math.prod(shape) * 2 / packed_nbytes(mode, shape, kv_dtype)


_DTYPE_IDS_BY_TORCH = {v: k for k, v in _DTYPES.items()}


def read_header(blob: torch.Tensor) -> dict:
    """The header fields of a packed chunk (CorruptChunk if it is not one)."""
    if blob.numel() < HEADER_BYTES:
        raise CorruptChunk(f"quantized chunk is {blob.numel()} bytes, shorter than its {HEADER_BYTES}-byte header")
    magic, version, mode_id, dtype_id, reserved, crc, n = HEADER.unpack(bytes(blob[:HEADER_BYTES].tolist()))
    if magic != MAGIC:
        raise CorruptChunk(f"not a quantized chunk: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CorruptChunk(f"unsupported quantized chunk version {version}")
    return {"mode": _MODE_NAMES.get(mode_id, f"unknown({mode_id})"), "kv_dtype": _DTYPE_NAMES.get(dtype_id,
            f"unknown({dtype_id})"), "crc32": crc, "elements": n, "reserved": reserved}
