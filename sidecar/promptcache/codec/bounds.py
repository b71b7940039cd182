"""Error bounds of the codec: per element (error_bound), and per value group of k6v4z's 4-bit tokens
(value_group_l2_bound); what tests/test_quant.py checks every round trip against.
"""
from __future__ import annotations

import math

import torch

from promptcache.codec.entropy import (
    CODED_STEPS, DENSE_KEY_STEPS, _coded_value_floor, _dense_key_frame, _dense_key_unit, _dense_value_tokens,
    _value_plan)
from promptcache.codec.formats import _check_mode, v_group_size
from promptcache.codec.quantizers import _FP16_MIN_SCALE, _LOG_TABLE, _log_code_up, _max_floor, _needed_scale, _rotation


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
