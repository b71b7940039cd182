"""Quantized chunk formats (modes ``k8v8``, ``k8v4`` and ``k6v4z``); spec and measurements in docs/quantization.md.

In the spirit of KIVI (Liu et al., 2024): keys are quantized **per channel** (each (layer, head, channel) over the
chunk's tokens has its own scale, because key outliers live in fixed channels), values **per token** (each
(layer, head, token) group of up to 64 channels has its own scale). Quantization is asymmetric with an integer
zero point, ``x ~= scale * (q - zero)``, and the range of every group always contains 0, so zero is exact.

k8v4 (format 3, issue 16; header mode 6, 3 was format 2 and 2 format 1) is k8v4's byte budget, 2.5x fewer bytes
than fp16, spent where the error shows: a fixed slot of 1/2.5 of the chunk's fp16 bytes holding keys coded as k6v4z's
(below) and values per token and group of G Hadamard-rotated channels (QuaRot: spreads outlier channels over the
group; the inverse is the same matrix) with 8-bit codes whose step is the larger of the group's range / 254 and a
floor V_STEP_RATIO * alpha * the group's RMS (V_FINE times that for token 0, the last DENSE_V_RECENT tokens and
the DENSE_V_SELECT tokens per (layer, head) that attention favours, as k6v4z picks them); both code streams
zstd-coded, alpha the finest of CODED_STEPS whose streams fit (rate control), else 4-bit codes stored raw. Format 2
spent 62 % of its bytes on 8-bit keys whose error cost a sixth of its KL and left the 4-bit values the rest::

    header 16 B (mode 6) | sub-header 20 B: code top u8 (255 or 15), step index u8, reserved u16 = 0, stream
    lengths u32 K, V, reserved u32 = 0, RoPE base f32 (0: none undone) | K scale 2*L*H*D B float16 |
    K0 scale 2*L*H*NG B float16 | V scale 2*L*H*T*NG B float16 | K zero L*H*D B | K0 codes L*H*D B |
    K0 zero L*H*NG B | V zero L*H*T*NG B | streams: K codes as k6v4z's, V codes [L, H, T, NG, G] (uint8, or
    two 4-bit codes per byte when top = 15), each a zstd frame of exactly its raw size or those raw bytes |
    zero padding to the slot

k8v8: keys 8-bit per channel, values 8-bit per token and group of G channels::

    header   16 B   magic b"PCQ1", version u8 = 1, mode u8 (1 k8v8, 6 k8v4, 5 k6v4z; 2, 3 and 4 retired, refused),
                    kv dtype u8 (0 f32, 1 f16, 2 bf16),
                    reserved u8 = 0, crc32 u32 of everything after the header, N u32
    K codes  N B    uint8, layout [L, H, T, D]
    K scale  2*L*H*D B   float16, [L, H, D] (finite, > 0)
    K zero   L*H*D B     uint8 in 0..254
    V codes N B uint8 [L, H, T, D]; V scale 2*L*H*T*NG B float16 (finite, > 0); V zero L*H*T*NG B uint8 0..254

k6v4z (issue 16, the dense mode; format 2, header mode 5, 4 was format 1): a fixed slot of 1/3.5 of the chunk's fp16
bytes. Values 8-bit for token 0, the last DENSE_V_RECENT = 16 and DENSE_V_SELECT = 16
per (layer, head) whose keys point most against the chunk's mean key (_dense_value_tokens; their indices stored),
the others Hadamard-rotated 4-bit codes with a per-group scale (an 8-bit log code) picked for the least squared error
among the no-clipping one and the 4 grid steps below it.
Keys: token 0's (the attention sink at chunk 0) 8-bit per token and group; tokens
1..T-1 with each token's in-chunk RoPE rotation undone when the caller gives the RoPE base and that helps
(_dense_key_frame), then per channel with 8-bit codes whose step is the larger of the channel's range / 254 and a
floor alpha * _dense_key_unit (the chunk's key RMS weighted by the channel pair's energy ** -1/2: keys and queries are
large in the same RoPE pairs), zero points centring each channel's codes; the code streams are zstd-compressed (key
code rows ordered by their step), and the encoder takes the finest alpha of DENSE_KEY_STEPS whose streams fit the slot
(rate control), else 4-bit key codes stored raw::

    header 16 B (mode 5) | sub-header 20 B: key code top u8 (255 or 15), key step index u8, reserved u16 = 0,
    stream lengths u32 K, V8, V4, RoPE base f32 (0: none undone) | selected value tokens 2*L*H*N B int16 [L, H, N],
    ascending | K scale 2*L*H*D B float16 | K zero L*H*D B |
    K0 scale 2*L*H*NG B float16 | K0 codes L*H*D B | the value scales and zero points as k8v4's (V8 scale, V8 zero,
    V scale, V zero; V8 tokens per (layer, head): 0, the recent ones, the selected; V tokens: the other middle ones,
    ascending) | K0 zero L*H*NG B | streams: K codes of tokens 1..T-1, L*H*D rows of T-1 (uint8, rows in
    _key_row_order) or [L, H, D, T-1] 4-bit pairs when top = 15, V8 codes, V4 codes, each a zstd frame of exactly its
    raw size or those raw bytes (told apart by the length) | zero padding to the slot

Without clipping, scales are chosen so that every value is representable: with Q = 2**bits - 1 levels the scale
is at least range / (Q - 1) (rounded *up* to the stored precision) and zero = ceil(-min / scale); the rounding
error of every element is then at most scale / 2. :func:`error_bound` gives the bounds the tests check.
For SmolLM2-135M (L=30, H=3, D=64) at 256-token chunks, k6v4z stores 3.5x fewer bytes than fp16, k8v4 2.5x
(format 2: 2.496x, format 1: 2.602x) and k8v8 1.94x.
"""
from __future__ import annotations

import math
import struct
import zlib

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
# Key step floors tried, finest first, in units of _dense_key_unit (a channel's step is the larger of its 8-bit range
# step and this floor): 1/16-octave apart (format 1: 0.04 ... 0.25, 6-25 % apart: up to 12 % coarser steps than fit)
# from 0.03 to 1.0 (keys with RoPE undone can have so small an RMS that 0.25 of it does not fit); when none fits,
# 4-bit per-channel key codes stored raw (always fit the slot).
DENSE_KEY_STEPS = tuple(0.03 * 2 ** (i / 16) for i in range(82))
# k8v4 format 3: a fixed slot of 1/2.5 of the chunk's fp16 bytes; one step index i sets the key step floor
# (CODED_STEPS[i] in _dense_key_unit's units) and the value step floor (V_STEP_RATIO * CODED_STEPS[i] * the value
# group's RMS, V_FINE times that for the tokens attention favours). The ratio was chosen on the first fidelity
# windows (SmolLM2, Chinese and English, fp32): 3 gave less KL than 5 at equal bytes.
K8V4_RATIO = 2.5
CODED_STEPS = tuple(0.0075 * 2 ** (i / 16) for i in range(128))
V_STEP_RATIO = 3.0
V_FINE = 0.25
Z_HEADER = struct.Struct("<BBHIIIf")
# zstd level 1, not the default 3: on these near-memoryless code streams the higher levels' match finding costs
# more than it finds (SmolLM2, Chinese text: value codes 3.46 bits per code at level 1 against 3.92 at level 3, key
# rows 4.56 against 4.71; the order-0 entropy is 3.57 / 4.81, level 1's per-block Huffman tables beat it). The
# decoder does not depend on the level: chunks packed at either read the same.
ZSTD_LEVEL = 1
MAGIC = b"PCQ1"
VERSION = 1
HEADER = struct.Struct("<4sBBBBII")  # magic, version, mode, dtype, reserved, crc32, N
HEADER_BYTES = HEADER.size  # 16
MAX_V_GROUP = 64

# k8v4 value scales: 8-bit logarithmic codes, 1/8 octave apart (a scale rounded up to this grid grows <= 9 %).
_LOG_STEPS_PER_OCTAVE = 8
_LOG_BIAS = 128
_LOG_TABLE = torch.tensor([2.0 ** ((c - _LOG_BIAS) / _LOG_STEPS_PER_OCTAVE) for c in range(256)],
                          dtype=torch.float64).to(torch.float32)
_FP16_MIN_SCALE = 2.0 ** -14  # smallest normal float16


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


def _dense_value_tokens(k: torch.Tensor) -> torch.Tensor:
    """k6v4z: the DENSE_V_SELECT middle tokens per (layer, head) whose values are kept at 8 bits, ascending, [L, H, N].

    Which tokens' value errors matter is which tokens later queries attend to (besides the sink and the most recent
    ones, 8-bit anyway): 8-bit values for the 16 that the scored text attends to most would cut the values' KL by
    60 % (SmolLM2). The chunk alone predicts them: keys pointing against the chunk's mean key (the attention-sink
    direction) hold 88 % of those tokens' attention, random ones 10 % (docs/quantization.md)."""
    L, H, T, D = k.shape
    recent, sel = _dense_value_split(T)[:2]
    score = -(k * k.mean(dim=2, keepdim=True)).sum(-1)[:, :, 1:T - recent]  # middle tokens 1..T-1-recent
    return (score.topk(sel, dim=-1).indices + 1).sort(dim=-1).values


def _value_plan(tokens: int, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k6v4z: (8-bit token indices [L, H, NH]: token 0, the recent tail, the selected; low-bit token indices
    [L, H, M]: the other middle tokens, ascending) from the selected tokens sel [L, H, N] (ascending, distinct)."""
    L, H, n = sel.shape
    recent, _, nh, mid = _dense_value_split(tokens)
    fixed = torch.tensor([0] + list(range(tokens - recent, tokens)), device=sel.device).expand(L, H, 1 + recent)
    low = torch.ones(L, H, tokens, dtype=torch.bool, device=sel.device)
    low[:, :, 0] = False
    low[:, :, tokens - recent:] = False
    low.scatter_(2, sel, False)
    rest = torch.arange(tokens, device=sel.device).expand(L, H, tokens)[low].reshape(L, H, mid)
    return torch.cat([fixed, sel], dim=2), rest


def packed_nbytes(mode: str, shape, kv_dtype: str) -> int:
    """Exact byte length of a packed chunk of logical `shape` [L, 2, H, T, D] (for k6v4z: its fixed slot)."""
    return sum(n for _, n in _sections(mode, shape, kv_dtype))


def compression_vs_fp16(mode: str, shape, kv_dtype: str = "float16") -> float:
    return math.prod(shape) * 2 / packed_nbytes(mode, shape, kv_dtype)


# ---------------------------------------------------------------------------------------------------- quantizers
def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _round_up_fp16(s: torch.Tensor) -> torch.Tensor:
    """float32 scales -> float16 scales that are >= the input (and >= the smallest normal)."""
    s = s.clamp(min=_FP16_MIN_SCALE)
    if (s > 65504).any():
        raise ValueError("values too large to quantize (a group's range exceeds the float16 scale range)")
    h = s.to(torch.float16)
    low = h.float() < s
    if low.any():
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, math.inf)), h)
    return h


def _quant_groups(x: torch.Tensor, dim: int, levels: int, scale: torch.Tensor):
    """Codes for x with per-group `scale` (broadcast over `dim`); returns (codes uint8, zero uint8)."""
    lo = x.amin(dim=dim, keepdim=True).clamp(max=0)
    zero = torch.ceil(-lo / scale).clamp(0, levels - 1)
    q = (torch.round(x / scale) + zero).clamp(0, levels)
    return q.to(torch.uint8), zero.to(torch.uint8)


def _needed_scale(x: torch.Tensor, dim: int, levels: int) -> torch.Tensor:
    lo = x.amin(dim=dim, keepdim=True).clamp(max=0)
    hi = x.amax(dim=dim, keepdim=True).clamp(min=0)
    return (hi - lo) / (levels - 1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.reshape(-1)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return q[0::2] | (q[1::2] << 4)


def _unpack_nibbles(b: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(-1)
    return out[:n]


_ROTATIONS: dict = {}


def _rotation(g: int, device) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix of order g (symmetric and orthogonal: its own inverse); identity when
    g is not a power of two."""
    key = (g, str(device))
    if key not in _ROTATIONS:
        if g & (g - 1):
            h = torch.eye(g, dtype=torch.float64)
        else:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < g:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            h = h / math.sqrt(g)
        _ROTATIONS[key] = h.to(torch.float32).to(device)
    return _ROTATIONS[key]


def _log_code_up(need: torch.Tensor) -> torch.Tensor:
    """Smallest log code whose scale is >= need (float tensor of codes, unclamped above)."""
    need = need.clamp(min=float(_LOG_TABLE[0]))
    code = (torch.ceil(torch.log2(need) * _LOG_STEPS_PER_OCTAVE - 1e-4) + _LOG_BIAS).clamp(min=0)
    if (code > 255).any():
        raise ValueError("values too large to quantize for k8v4 (a value group's range exceeds 2**16)")
    table = _LOG_TABLE.to(need.device)
    short = table[code.long()] < need  # guard against log2 rounding: never a scale below what the range needs
    return torch.where(short, code + 1, code)


CLIP_STEPS = 5  # k8v4 encoder: candidate scales = the no-clipping one and the 4 grid steps below it


def _quant_low_mse(y: torch.Tensor, bits: int):
    """b-bit codes (b <= 4) for groups y[..., g]: per group, the candidate scale with the least squared error.
    Returns (scale codes uint8 [..., 1], codes uint8 [..., g], zero points uint8 [..., 1])."""
    table = _LOG_TABLE.to(y.device)
    top = (1 << bits) - 1
    lo = y.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = y.amax(dim=-1, keepdim=True).clamp(min=0)
    c1 = _log_code_up((hi - lo) / (top - 1))
    if (c1 > 255).any():
        raise ValueError("values too large to quantize for k8v4 (a value group's range exceeds 2**16)")
    best = None
    for step in range(CLIP_STEPS):
        code = (c1 - step).clamp(min=0)
        scale = table[code.long()]
        zero = torch.ceil(-lo / scale).clamp(0, top - 1)
        q = (torch.round(y / scale) + zero).clamp(0, top)
        err = ((q - zero) * scale - y).square().sum(dim=-1, keepdim=True)
        if best is None:
            best = [err, code, q, zero]
        else:
            better = err < best[0]
            best = [torch.where(better, err, best[0]), torch.where(better, code, best[1]),
                    torch.where(better, q, best[2]), torch.where(better, zero, best[3])]
    return best[1].to(torch.uint8), best[2].to(torch.uint8), best[3].to(torch.uint8)


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


_DTYPE_IDS_BY_TORCH = {v: k for k, v in _DTYPES.items()}


def _quant_values_v4(v: torch.Tensor, g: int, plan: tuple[torch.Tensor, torch.Tensor]):
    """k6v4z's values [L, H, T, D]: (8-bit codes, scales, zeros of the 8-bit tokens; packed 4-bit codes, log scale
    codes, packed zeros of the Hadamard-rotated others), the tokens per (layer, head) as `plan` (_value_plan) says."""
    L, H, T, D = v.shape
    nh, mid = plan[0].shape[2], plan[1].shape[2]
    vo = v.gather(2, torch.cat(plan, dim=2).unsqueeze(-1).expand(L, H, T, D))
    v8 = _quant8_per_token(vo[:, :, :nh], g)  # token 0 (the sink), the recent tail and the selected: 8 bits
    y = vo[:, :, nh:].reshape(L, H, mid, D // g, g) @ _rotation(g, v.device)
    code, v_codes, v_zero = _quant_low_mse(y, 4)
    return (*v8, _pack_nibbles(v_codes), code, _pack_nibbles(v_zero))


def _zstd():
    try:
        import zstandard
    except ImportError as exc:  # a dependency of the package; an engine's own image may lack it
        raise RuntimeError("quantization modes k8v4 and k6v4z need the zstandard package (pip install zstandard)") from exc
    return zstandard


def _compress(raw: torch.Tensor) -> bytes:
    """A zstd frame of raw's bytes, or the raw bytes when that is not shorter (the reader tells them by length)."""
    data = raw.contiguous().reshape(-1).cpu().numpy().tobytes()
    z = _zstd().ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=False).compress(data)
    return z if len(z) < len(data) else data


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMS of x [L, H, T, D] about each channel's median over the tokens, per (layer, head): shape [L, H, 1, 1].
    (About the median: a channel's constant offset, large in the outlier channels of keys, costs no bits.)"""
    c = x - x.median(dim=2, keepdim=True).values
    return c.square().mean(dim=(2, 3), keepdim=True).sqrt()


def _max_floor(top: int) -> float:
    """The largest step floor whose float16 round-up, times `top` codes, stays within float16's range."""
    return 65504 / top / (1 + 2.0 ** -9)


def _group_stats(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(min clamped to <= 0, max clamped to >= 0, median) of x over `dim`: what _quant8_floor needs of each group,
    computed once for all the steps a rate control tries (the median is most of a try's time)."""
    return (x.amin(dim=dim, keepdim=True).clamp(max=0), x.amax(dim=dim, keepdim=True).clamp(min=0),
            x.median(dim=dim, keepdim=True).values)


def _quant8_floor(x: torch.Tensor, dim: int, floor: torch.Tensor, top: int = 255, stats=None):
    """Codes of x with a per-group scale (groups: everything but `dim`) that is the larger of the no-clipping step and
    `floor`, and zero points that put each group's median near the middle code (so that the groups' code histograms
    line up for the entropy coder). stats: _group_stats(x, dim), if already known. Returns (codes uint8, float16
    scale, zero uint8); |error| <= scale / 2."""
    lo, hi, med = stats if stats is not None else _group_stats(x, dim)
    # The floor never makes a step the decoder would refuse (top codes of it must stay within float16's range).
    floor = floor.clamp(max=_max_floor(top))
    scale = _round_up_fp16(torch.maximum((hi - lo) / (top - 1), floor.expand_as(hi)))
    sf = scale.float()
    zmin = torch.ceil(-lo / sf)
    zmax = torch.maximum(zmin, top - torch.ceil(hi / sf))
    want = (top + 1) // 2 - torch.round(med / sf)
    zero = torch.minimum(torch.maximum(want, zmin), zmax).clamp(0, top - 1)
    q = (torch.round(x / sf) + zero).clamp(0, top)
    return q.to(torch.uint8), scale, zero.to(torch.uint8)


def rope_theta_of(config) -> float:
    """The RoPE base of a transformers model config when k6v4z's key rotation applies (rope_type "default",
    rotation over the whole head), else 0.0. (Other RoPE types scale some frequencies: not undone, no gain.)"""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta if theta is not None else getattr(config, "rope_theta", None)
    if rope_type != "default" or not theta or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return 0.0
    return float(theta)


_ROPE_TABLES: dict = {}


def _rope_table(theta: float, tokens: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, cos) and (-sin, sin) [tokens, head_dim] of the angles t * theta**(-2i / head_dim), t = 0..tokens-1
    (float64 angles; the encoder and the decoder compute the same float32 tables from the blob's float32 theta)."""
    key = (theta, tokens, head_dim, str(device))
    if key not in _ROPE_TABLES:
        if len(_ROPE_TABLES) > 64:
            _ROPE_TABLES.clear()
        inv = float(theta) ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang = torch.arange(tokens, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
        _ROPE_TABLES[key] = (torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))
    return _ROPE_TABLES[key]


def _rope(k: torch.Tensor, theta: float, sign: float) -> torch.Tensor:
    """Rotate-half RoPE over keys [..., T, D] by each token's offset in the chunk: sign -1 undoes it, +1 applies it.
    Each channel pair (i, i + D/2) turns by an orthogonal 2x2 rotation, so the L2 norm of every pair is kept."""
    T, D = k.shape[-2], k.shape[-1]
    cos, sin = _rope_table(theta, T, D, k.device)
    h = D // 2
    swapped = torch.cat([k[..., h:], k[..., :h]], dim=-1)  # (b, a): x * cos + swapped * (-sin, sin) rotates (a, b)
    return torch.addcmul(k * cos, swapped, sin, value=sign)


def _dense_key_frame(k: torch.Tensor, rope_theta: float) -> tuple[float, torch.Tensor]:
    """(theta used, keys to code) for k6v4z: the keys with each token's in-chunk RoPE rotation undone when that
    lowers their RMS about the channels' medians (what the key step scales with), else the keys as they are.
    After RoPE a channel pair with a constant component oscillates with the token's position, and per-channel
    steps can't take the oscillation out; undone, the pair is constant again (a fixed rotation by the chunk's start
    position is left, which keeps it constant). With the model's base this cuts the key MSE at equal bytes by 44 %."""
    theta = float(torch.tensor(rope_theta, dtype=torch.float32))  # what the sub-header keeps
    if not 0 < theta < math.inf or k.shape[-1] % 2:  # (a base beyond float32 would be refused by the decoder)
        return 0.0, k
    kr = _rope(k, theta, -1.0)
    return (theta, kr) if float(_rms(kr).sum()) < float(_rms(k).sum()) else (0.0, k)


def _dense_key_unit(k: torch.Tensor) -> torch.Tensor:
    """k6v4z's key step floor per (layer, head, channel) [L, H, 1, D], in units of DENSE_KEY_STEPS: the chunk's mean
    key RMS (about the channels' medians) times (w / mean w) ** -1/2, w the channel pair's energy (mean square of
    channels i and i + D/2 over the tokens, the same before and after RoPE).

    Why: a key error moves the attention score by q . dk, and queries are large in the same RoPE pairs as keys
    (SmolLM2, log pair energies over all layers and heads: correlation 0.86), so the pair's key energy stands in for
    its query energy w; minimising the sum of w * step**2 at a given rate gives step ~ w ** -1/2 (reverse
    water-filling). The decoder does not care: every channel's scale is stored."""
    L, H, T, D = k.shape
    e = k.square().mean(dim=2, keepdim=True)  # [L, H, 1, D]
    if D % 2 == 0:
        e = (e[..., :D // 2] + e[..., D // 2:]).repeat(1, 1, 1, 2)
    mean = float(e.mean())
    if mean == 0.0:
        return torch.zeros_like(e)
    return float(_rms(k).mean()) * (e / mean).clamp(min=1e-4).rsqrt()


def _key_row_order(scale: torch.Tensor) -> torch.Tensor:
    """k6v4z format 2: the order of the channels' code rows in the key stream, by their stored float16 step (the
    decoder computes the same order from the same scales). Channels with like steps have like code spreads, so
    zstd's Huffman tables, one per block, fit each block better: 4.54 -> 4.33 bits per key (SmolLM2, real chunks)."""
    return torch.argsort(scale.reshape(-1).float(), stable=True)


def _pack_dense(k: torch.Tensor, v: torch.Tensor, g: int, secs, rope_theta: float = 0.0) -> list:
    """k6v4z body parts: values exactly as k8v4, keys (in-chunk RoPE undone, see _dense_key_frame) per channel with
    the finest step floor of DENSE_KEY_STEPS whose entropy-coded codes fit the slot, code streams zstd-compressed,
    zero padding."""
    sel = _dense_value_tokens(k)
    v8_codes, v8_scale, v8_zero, v_codes, v_scale, v_zero = _quant_values_v4(v, g, _value_plan(k.shape[2], sel))
    v_sel = _u8(sel.to(torch.int16))  # token indices < 2**15 (chunks of more tokens are refused by _sections)
    theta, k = _dense_key_frame(k, rope_theta)
    k0 = _quant8_per_token(k[:, :, :1], g)
    k = k[:, :, 1:]  # the per-channel coded tokens: 1..T-1
    z_v8, z_v4 = _compress(v8_codes), _compress(v_codes)
    room = dict(secs)["streams"] - len(z_v8) - len(z_v4)
    if k.shape[2] == 0:  # a one-token chunk: nothing per channel (placeholder scales 1.0, zero points 0)
        zh = Z_HEADER.pack(255, 0, 0, 0, len(z_v8), len(z_v4), theta)
        L, H, _, D = k.shape
        scale = _u8(torch.ones(L, H, 1, D, dtype=torch.float16))
        return _dense_parts(zh, v_sel, scale, torch.zeros(L * H * D, dtype=torch.uint8), k0, v8_scale, v8_zero,
                            v_scale, v_zero, z_v8 + z_v4, dict(secs)["streams"])
    unit = _dense_key_unit(k)
    stats = _group_stats(k, 2)

    def keys_at(step: int):
        codes, scale, zero = _quant8_floor(k, 2, DENSE_KEY_STEPS[step] * unit, stats=stats)
        rows = codes.transpose(2, 3).reshape(-1, codes.shape[2])  # [L * H * D, T]: each channel's tokens together
        return _compress(rows[_key_row_order(scale)]), scale, zero

    # binary search for the finest step that fits (the size shrinks as the step grows; every answer is checked)
    lo, hi, best = 0, len(DENSE_KEY_STEPS) - 1, None
    while lo <= hi:
        mid_step = (lo + hi) // 2
        z_k, k_scale, k_zero = keys_at(mid_step)
        if len(z_k) <= room:
            best, hi = (mid_step, z_k, k_scale, k_zero), mid_step - 1
        else:
            lo = mid_step + 1
    if best is not None:
        top = 255
        step, z_k, k_scale, k_zero = best
        k_scale = _u8(k_scale)
    else:  # the floor: 4-bit per-channel codes, stored raw (the slot is sized for them)
        top, step = 15, len(DENSE_KEY_STEPS)
        scale = _round_up_fp16(_needed_scale(k, 2, top))
        k_codes, k_zero = _quant_groups(k, 2, top, scale.float())
        k_scale = _u8(scale)
        z_k = bytes(_pack_nibbles(k_codes.transpose(2, 3)).numpy())
        assert len(z_k) <= room, "k6v4z slot smaller than its raw floor"
    zh = Z_HEADER.pack(top, step, 0, len(z_k), len(z_v8), len(z_v4), theta)
    return _dense_parts(zh, v_sel, k_scale, k_zero, k0, v8_scale, v8_zero, v_scale, v_zero, z_k + z_v8 + z_v4,
                        dict(secs)["streams"])


def _dense_parts(zh: bytes, v_sel, k_scale, k_zero, k0, v8_scale, v8_zero, v_scale, v_zero, streams: bytes,
                 slot: int):
    """k6v4z body parts in layout order, the streams zero-padded to the slot."""
    as_u8 = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
    k0_codes, k0_scale, k0_zero = k0
    return [as_u8(zh), v_sel, k_scale, k_zero, k0_scale, k0_codes, v8_scale, v8_zero, v_scale, v_zero, k0_zero,
            as_u8(streams + bytes(slot - len(streams)))]


def _coded_value_floor(k: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """k8v4 format 3: each value group's step floor in units of CODED_STEPS, [L, H, T, NG, 1]: V_STEP_RATIO times the
    group's RMS (the Hadamard-rotated group y), V_FINE times that for token 0, the last DENSE_V_RECENT tokens and the
    DENSE_V_SELECT tokens per (layer, head) whose keys oppose the chunk's mean key: a value's error reaches the output
    in proportion to the attention its token gets, and these are the tokens later queries attend to most (the sink,
    the nearest context, and the sink-like directions: _dense_value_tokens)."""
    L, H, T = y.shape[:3]
    fine = torch.ones(L, H, T, device=y.device)
    recent = min(DENSE_V_RECENT, T - 1)
    fine[:, :, 0] = V_FINE
    fine[:, :, T - recent:] = V_FINE
    fine.scatter_(2, _dense_value_tokens(k), V_FINE)
    return V_STEP_RATIO * y.square().mean(dim=-1, keepdim=True).sqrt() * fine[..., None, None]


def _pack_coded(k: torch.Tensor, v: torch.Tensor, g: int, secs, rope_theta: float = 0.0) -> list:
    """k8v4 format 3 body parts: keys as k6v4z's (in-chunk RoPE undone, token 0 8-bit per token, the others per
    channel with energy-weighted step floors), values per token and group of g Hadamard-rotated channels with step
    floors relative to the group's RMS (_coded_value_floor), 8-bit codes; both code streams zstd-coded; one step
    index for both, the finest whose streams fit the slot (binary search); raw 4-bit codes if none does."""
    L, H, T, D = k.shape
    y = v.reshape(L, H, T, D // g, g) @ _rotation(g, v.device)
    v_unit = _coded_value_floor(k, y)
    theta, k = _dense_key_frame(k, rope_theta)
    k0_codes, k0_scale, k0_zero = _quant8_per_token(k[:, :, :1], g)
    k = k[:, :, 1:]  # the per-channel coded tokens: 1..T-1
    k_unit = _dense_key_unit(k) if T > 1 else None
    k_stats = _group_stats(k, 2) if T > 1 else None
    v_stats = _group_stats(y, 4)
    room = dict(secs)["streams"]
    v_max = _max_floor(255) / math.sqrt(g)

    def keys_at(step: int):
        if T == 1:  # nothing per channel (placeholder scales 1.0, zero points 0)
            return b"", torch.ones(L, H, 1, D, dtype=torch.float16), torch.zeros(L, H, 1, D, dtype=torch.uint8)
        codes, scale, zero = _quant8_floor(k, 2, CODED_STEPS[step] * k_unit, stats=k_stats)
        rows = codes.transpose(2, 3).reshape(-1, codes.shape[2])  # [L * H * D, T - 1]: each channel's tokens together
        return _compress(rows[_key_row_order(scale)]), scale, zero

    def at(step: int):
        z_k, k_scale, k_zero = keys_at(step)
        # (the floor never makes a step whose codes, rotated back, the decoder would refuse as overflowing float16)
        v_codes, v_scale, v_zero = _quant8_floor(y, 4, (CODED_STEPS[step] * v_unit).clamp(max=v_max), stats=v_stats)
        return z_k, _compress(v_codes), k_scale, k_zero, v_scale, v_zero

    lo, hi, best = 0, len(CODED_STEPS) - 1, None
    while lo <= hi:  # the streams shrink as the step grows; every answer is checked
        mid_step = (lo + hi) // 2
        coded = at(mid_step)
        if len(coded[0]) + len(coded[1]) <= room:
            best, hi = (mid_step, *coded), mid_step - 1
        else:
            lo = mid_step + 1
    if best is not None:
        top, (step, z_k, z_v, k_scale, k_zero, v_scale, v_zero) = 255, best
    else:  # the floor: 4-bit codes of the whole range, stored raw (the slot is sized for them)
        top, step = 15, len(CODED_STEPS)
        z_k, k_scale, k_zero = keys_at(0)  # the placeholders of a one-token chunk
        if T > 1:
            k_scale = _round_up_fp16(_needed_scale(k, 2, top))
            k_codes, k_zero = _quant_groups(k, 2, top, k_scale.float())
            z_k = bytes(_pack_nibbles(k_codes.transpose(2, 3)).numpy())
        v_scale = _round_up_fp16(_needed_scale(y, 4, top))
        v_codes, v_zero = _quant_groups(y, 4, top, v_scale.float())
        z_v = bytes(_pack_nibbles(v_codes).numpy())
        assert len(z_k) + len(z_v) <= room, "k8v4 slot smaller than its raw floor"
    zh = Z_HEADER.pack(top, step, 0, len(z_k), len(z_v), 0, theta)
    streams = z_k + z_v
    as_u8 = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return [as_u8(zh), _u8(k_scale), k0_scale, _u8(v_scale), k_zero, k0_codes, k0_zero, v_zero,
            as_u8(streams + bytes(room - len(streams)))]


def _quant8_per_token(x: torch.Tensor, g: int):
    """8-bit codes of x [L, H, t, D] per token and group of g channels: (codes, float16 scales as bytes, zeros)."""
    L, H, t, D = x.shape
    xg = x.reshape(L, H, t, D // g, g)
    scale = _round_up_fp16(_needed_scale(xg, 4, 255))
    codes, zero = _quant_groups(xg, 4, 255, scale.float())
    return codes, _u8(scale), zero


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


def unpack(mode: str, blob: torch.Tensor, shape, kv_dtype: str, device: torch.device | str | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a packed chunk into [L, 2, H, T, D] of `kv_dtype`; CorruptChunk on any inconsistency.

    Never returns NaN or Inf: the length, header (mode, dtype, element count), CRC32, scales and zero points are
    all checked, and the scales bound every result. `out` (optional): a tensor (or strided view) of that shape and
    dtype to write into (after a CorruptChunk its contents are unspecified: discard it).
    """
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


def _dense_selected(raw: torch.Tensor, L: int, H: int, T: int) -> torch.Tensor:
    """k6v4z: the stored selected 8-bit value tokens [L, H, N], checked: middle tokens (1..T-1-recent), strictly
    ascending per (layer, head); CorruptChunk if not."""
    recent, n = _dense_value_split(T)[:2]
    sel = raw.view(torch.int16).long().reshape(L, H, n)
    if n and ((sel < 1).any() or (sel > T - 1 - recent).any() or (sel[..., 1:] <= sel[..., :-1]).any()):
        raise CorruptChunk(f"k6v4z selected value tokens must be ascending middle tokens 1..{T - 1 - recent}")
    return sel


def _dense_streams(views: dict, L: int, H: int, T: int, D: int) -> dict:
    """k6v4z: the sub-header checked and the code streams decompressed into k8v4's views (CorruptChunk if not)."""
    top, step, reserved, n_k, n_v8, n_v4, theta = Z_HEADER.unpack(bytes(views.pop("z_header").tolist()))
    if top not in (15, 255) or step > len(DENSE_KEY_STEPS) or reserved or not (math.isfinite(theta) and theta >= 0):
        raise CorruptChunk(f"k6v4z sub-header: key code top {top} (expected 15 or 255), key step {step}, "
                           f"reserved {reserved}, RoPE base {theta} (expected finite, >= 0)")
    if theta and D % 2:
        raise CorruptChunk(f"k6v4z sub-header: RoPE base {theta} with an odd head_dim {D}")
    streams = views.pop("streams")
    if n_k + n_v8 + n_v4 > streams.numel() or streams[n_k + n_v8 + n_v4:].any():
        raise CorruptChunk("k6v4z stream lengths exceed the slot, or its padding is not zero")
    nh, mid = _dense_value_split(T)[2:]
    n = L * H * (T - 1) * D  # per-channel key codes: tokens 1..T-1 (token 0's are k0_codes)
    k_raw = (n + 1) // 2 if top == 15 else n
    want = {"v8_codes": L * H * nh * D, "v_codes": L * H * mid * D // 2}
    _read_streams("k6v4z", views, streams, (("k_codes", n_k, k_raw), ("v8_codes", n_v8, want["v8_codes"]),
                                            ("v_codes", n_v4, want["v_codes"])))
    views["k_codes"] = _key_codes(views, top, L, H, T, D)
    views["code_top"] = torch.tensor(top)
    views["rope_theta"] = torch.tensor(theta, dtype=torch.float32)
    return views


def _read_streams(mode: str, views: dict, streams: torch.Tensor, specs) -> None:
    """Split `streams` into views[name] for each (name, stored length, raw length) in order: a stored length equal
    to the raw one is the raw bytes, a shorter one a zstd frame of exactly the raw length (CorruptChunk if not)."""
    dctx = _zstd().ZstdDecompressor()
    off = 0
    for name, size, raw in specs:
        part = streams[off:off + size]
        off += size
        if size != raw:
            try:
                data = dctx.decompress(part.numpy().tobytes(), max_output_size=raw)
            except Exception as exc:  # zstandard.ZstdError: not a frame, truncated, ...
                raise CorruptChunk(f"{mode} {name} stream does not decompress: {exc}") from None
            if len(data) != raw or size > raw:
                raise CorruptChunk(f"{mode} {name} stream holds {len(data)} bytes, expected {raw}")
            part = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        views[name] = part


def _key_codes(views: dict, top: int, L: int, H: int, T: int, D: int) -> torch.Tensor:
    """The per-channel key codes of tokens 1..T-1 as [L, H, T-1, D] from their stream: two 4-bit codes per byte
    channel-major (top 15), or 8-bit rows stored in _key_row_order (the scales are checked later; any float16 bits
    give a permutation)."""
    k = views["k_codes"]
    if top == 15:
        k = _unpack_nibbles(k, L * H * (T - 1) * D)
    else:
        rows = k.reshape(L * H * D, T - 1)
        k = torch.empty_like(rows)
        k[_key_row_order(views["k_scale"].view(torch.float16))] = rows
    return k.reshape(L, H, D, T - 1).transpose(2, 3).contiguous()


def _coded_streams(views: dict, L: int, H: int, T: int, D: int) -> dict:
    """k8v4 (format 3): the sub-header checked and the key and value code streams decompressed (CorruptChunk if not)."""
    top, step, reserved, n_k, n_v, unused, theta = Z_HEADER.unpack(bytes(views.pop("z_header").tolist()))
    if (top not in (15, 255) or step > len(CODED_STEPS) or reserved or unused
            or not (math.isfinite(theta) and theta >= 0)):
        raise CorruptChunk(f"k8v4 sub-header: code top {top} (expected 15 or 255), step {step}, reserved "
                           f"{reserved}/{unused}, RoPE base {theta} (expected finite, >= 0)")
    streams = views.pop("streams")
    if n_k + n_v > streams.numel() or streams[n_k + n_v:].any():
        raise CorruptChunk("k8v4 stream lengths exceed the slot, or its padding is not zero")
    nk, nv = L * H * (T - 1) * D, L * H * T * D
    if top == 15:
        nk, nv = (nk + 1) // 2, (nv + 1) // 2
    _read_streams("k8v4", views, streams, (("k_codes", n_k, nk), ("v_codes", n_v, nv)))
    views["k_codes"] = _key_codes(views, top, L, H, T, D)
    if top == 15:
        views["v_codes"] = _unpack_nibbles(views["v_codes"], L * H * T * D)
    views["code_top"] = torch.tensor(top)
    views["rope_theta"] = torch.tensor(theta, dtype=torch.float32)
    return views


def error_bound(mode: str, chunk: torch.Tensor, rope_theta: float = 0.0) -> torch.Tensor:
    """Per-element bound on |unpack(pack(chunk)) - chunk| (before rounding to the KV dtype), same shape as chunk.

    k8v8, and the 8-bit values of k6v4z (token 0, the recent and the selected tokens): half a step of the group's
    scale, the scale being the group's range (widened to include 0) over Q - 1 levels rounded up to float16. The other
    (4-bit) k6v4z values: the L2 error of a group is at most that of the no-clipping scale s1 (the encoder only picks a
    candidate with less squared error), so every element is within sqrt(G) * s1 / 2 (see value_group_l2_bound for
    the tighter per-group bound). k8v4 values: half the coarsest step the rate control can choose (the coarsest
    floor, or the raw 4-bit range step), times sqrt(G) for the rotation back. Keys of k6v4z and k8v4: per channel
    at the coarsest step likewise; coded with the in-chunk RoPE rotation undone (pack's rope_theta), the error of a
    channel pair (i, i + D/2) is turned by the rotation, so each of its elements is within the L2 norm of the pair's
    two bounds (plus float32 rounding of the two rotations).
    """
    _check_mode(mode)
    x = chunk.float()
    L, _, H, T, D = x.shape
    k, v = x[:, 0], x[:, 1]
    theta = 0.0
    g = v_group_size(D)
    ng = D // g
    if mode in ("k6v4z", "k8v4"):  # the key step depends on how well the chunk compresses: bound by the coarsest
        theta, kc = _dense_key_frame(k, rope_theta)
        k0 = _needed_scale(kc[:, :, :1].reshape(L, H, 1, ng, g), 4, 255).expand(L, H, 1, ng, g).reshape(L, H, 1, D)
        kb = k0.expand(L, H, T, D).clone()  # token 0: 8-bit per group; the others per channel, coarsest floor
        if T > 1:
            kr = kc[:, :, 1:]
            coarsest = (DENSE_KEY_STEPS if mode == "k6v4z" else CODED_STEPS)[-1]
            floor = (coarsest * _dense_key_unit(kr)).clamp(max=_max_floor(15))
            kb[:, :, 1:] = torch.maximum(_needed_scale(kr, 2, 15), floor)
    else:
        kb = _needed_scale(k, 2, 255)
    kb = kb.clamp(min=_FP16_MIN_SCALE) * (1 + 2.0 ** -10) / 2
    if theta:
        pair = (kb[..., :D // 2].square() + kb[..., D // 2:].square()).sqrt()
        kb = torch.cat([pair, pair], dim=-1) + 1e-6 * k.abs().amax(dim=(2, 3), keepdim=True)
    vg = v.reshape(L, H, T, ng, g)
    vb = (_needed_scale(vg, 4, 255).clamp(min=_FP16_MIN_SCALE) * (1 + 2.0 ** -10) / 2).expand(L, H, T, ng, g).clone()
    if mode == "k6v4z":
        low = low_bit_value_tokens(chunk)[..., None, None].expand(L, H, T, ng, g)
        vb = torch.where(low, value_group_l2_bound(chunk).unsqueeze(-1).expand(L, H, T, ng, g), vb)
    elif mode == "k8v4":  # every group's rotated error within half its step (the coarsest floor or the raw 4-bit
        # range step); rotated back, each element is within the group's L2 error: sqrt(g) times that
        y = vg @ _rotation(g, x.device)
        floor = (CODED_STEPS[-1] * _coded_value_floor(k, y)).clamp(max=_max_floor(255) / math.sqrt(g))
        step = torch.maximum(_needed_scale(y, 4, 15), floor).clamp(min=_FP16_MIN_SCALE) * (1 + 2.0 ** -10)
        vb = (math.sqrt(g) * step / 2 * (1 + 1e-4) + 1e-6 * y.abs().amax(dim=-1, keepdim=True)).expand(L, H, T, ng, g)
    return torch.stack([kb.expand(L, H, T, D), vb.reshape(L, H, T, D)], dim=1)


def low_bit_value_tokens(chunk: torch.Tensor) -> torch.Tensor:
    """k6v4z: which tokens' values are 4-bit coded, bool [L, H, T]: the middle tokens but the selected ones, per
    (layer, head)."""
    L, _, H, T, D = chunk.shape
    low = torch.zeros(L, H, T, dtype=torch.bool, device=chunk.device)
    rest = _value_plan(T, _dense_value_tokens(chunk[:, 0].float()))[1]
    return low.scatter_(2, rest, True)


def value_group_l2_bound(chunk: torch.Tensor) -> torch.Tensor:
    """k6v4z: bound on the L2 norm of the value error of each group of a 4-bit coded token (see
    low_bit_value_tokens), computed for every token, shape [L, H, T, NG]."""
    x = chunk.float()
    L, _, H, T, D = x.shape
    g = v_group_size(D)
    y = x[:, 1].reshape(L, H, T, D // g, g) @ _rotation(g, x.device)
    s1 = _LOG_TABLE.to(x.device)[_log_code_up(_needed_scale(y, 4, 15)).long()]
    return (math.sqrt(g) * s1 / 2 * (1 + 1e-4) + 1e-6 * y.abs().amax(dim=-1, keepdim=True)).squeeze(-1)
