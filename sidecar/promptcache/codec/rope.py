"""RoPE of keys inside a chunk: the base of a transformers config when it applies (rope_theta_of), and the rotate-half
rotation by each token's offset in the chunk, undone before keys are coded per channel and applied again on decoding.
"""
from __future__ import annotations

import torch


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
