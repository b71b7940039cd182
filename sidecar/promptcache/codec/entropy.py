"""The entropy-coded modes k8v4 (format 3) and k6v4z (format 2): which value tokens stay at 8 bits, the key frame
(RoPE undone) and energy-weighted key step floors, the rate control that takes the finest step whose zstd-coded code
streams fit the fixed slot, and, on decoding, the sub-header checks and the streams decompressed into code views.
"""
from __future__ import annotations

import math

import torch

from promptcache.codec.formats import DENSE_V_RECENT, Z_HEADER, CorruptChunk, _dense_value_split
from promptcache.codec.quantizers import (
    _group_stats, _max_floor, _needed_scale, _pack_nibbles, _quant8_floor, _quant8_per_token, _quant_groups,
    _quant_low_mse, _rms, _rotation, _round_up_fp16, _u8, _unpack_nibbles)
from promptcache.codec.rope import _rope

# Key step floors tried, finest first, in units of _dense_key_unit (a channel's step is the larger of its 8-bit range
# step and this floor): 1/16-octave apart (format 1: 0.04 ... 0.25, 6-25 % apart: up to 12 % coarser steps than fit)
# from 0.03 to 1.0 (keys with RoPE undone can have so small an RMS that 0.25 of it does not fit); when none fits,
# 4-bit per-channel key codes stored raw (always fit the slot).
DENSE_KEY_STEPS = tuple(0.03 * 2 ** (i / 16) for i in range(82))
# k8v4 format 3: a fixed slot of 1/2.5 of the chunk's fp16 bytes (K8V4_RATIO); one step index i sets the key step
# floor (CODED_STEPS[i] in _dense_key_unit's units) and the value step floor (V_STEP_RATIO * CODED_STEPS[i] * the value
# group's RMS, V_FINE times that for the tokens attention favours). The ratio was chosen on the first fidelity
# windows (SmolLM2, Chinese and English, fp32): 3 gave less KL than 5 at equal bytes.
CODED_STEPS = tuple(0.0075 * 2 ** (i / 16) for i in range(128))
V_STEP_RATIO = 3.0
V_FINE = 0.25
# zstd level 1, not the default 3: on these near-memoryless code streams the higher levels' match finding costs
# more than it finds (SmolLM2, Chinese text: value codes 3.46 bits per code at level 1 against 3.92 at level 3, key
# rows 4.56 against 4.71; the order-0 entropy is 3.57 / 4.81, level 1's per-block Huffman tables beat it). The
# decoder does not depend on the level: chunks packed at either read the same.
ZSTD_LEVEL = 1


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
    zstd = _zstd()
    dctx = zstd.ZstdDecompressor()
    off = 0
    for name, size, raw in specs:
        part = streams[off:off + size]
        off += size
        if size != raw:
            if size > raw:
                raise CorruptChunk(f"{mode} {name} stream is {size} bytes, more than its {raw} raw bytes")
            frame = part.numpy().tobytes()
            try:
                # The size the frame states, checked before decompressing: zstandard allocates and fills a stated
                # size whatever max_output_size says (RLE blocks: 4 bytes -> 128 KiB, a slot's stream -> tens of
                # GB). pack always states it, and writes one frame and nothing after it.
                stated = zstd.frame_content_size(frame)
                data = (dctx.decompress(frame, max_output_size=raw, allow_extra_data=False) if stated == raw
                        else None)
            except Exception as exc:  # zstandard.ZstdError: not a frame, truncated, data after the frame, ...
                raise CorruptChunk(f"{mode} {name} stream does not decompress: {exc}") from None
            if data is None or len(data) != raw:
                got = "an unstated size" if stated < 0 else f"{stated if data is None else len(data)} bytes"
                raise CorruptChunk(f"{mode} {name} stream holds {got}, expected {raw}")
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
