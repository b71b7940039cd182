"""Quantization primitives shared by the modes: float16 scales rounded up, asymmetric per-group codes with an integer
zero point, 4-bit code packing, the Hadamard rotation of value groups, 8-bit logarithmic scale codes (with the
least-squared-error choice among clipped scales), per-token 8-bit groups and step floors.
"""
from __future__ import annotations

import math

import torch

# k8v4 value scales: 8-bit logarithmic codes, 1/8 octave apart (a scale rounded up to this grid grows <= 9 %).
_LOG_STEPS_PER_OCTAVE = 8
_LOG_BIAS = 128
_LOG_TABLE = torch.tensor([2.0 ** ((c - _LOG_BIAS) / _LOG_STEPS_PER_OCTAVE) for c in range(256)],
                          dtype=torch.float64).to(torch.float32)
_FP16_MIN_SCALE = 2.0 ** -14  # smallest normal float16


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _round_up_fp16(s: torch.Tensor) -> torch.Tensor:
    """float32 scales -> float16 scales that are >= the input (and >= the smallest normal)."""
    s = s.clamp(min=_FP16_MIN_SCALE)
    if not (s <= 65504).all():  # (NaN too: a step from a square that overflowed float32)
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
    if not (code <= 255).all():  # (NaN too: a range from values that overflowed float32 in the rotation)
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


def _quant8_per_token(x: torch.Tensor, g: int):
    """8-bit codes of x [L, H, t, D] per token and group of g channels: (codes, float16 scales as bytes, zeros)."""
    L, H, t, D = x.shape
    xg = x.reshape(L, H, t, D // g, g)
    scale = _round_up_fp16(_needed_scale(xg, 4, 255))
    codes, zero = _quant_groups(xg, 4, 255, scale.float())
    return codes, _u8(scale), zero
