"""Versioned codec of quantized KV chunks (modes ``k8v8``, ``k8v4`` and ``k6v4z``); spec and measurements in
docs/quantization.md. Clients pack chunks before a Put and unpack them after a Get; the sidecar stores the blobs
without reading them (it only needs their length: packed_nbytes, through promptcache.contract.layout).

Modules, by role: formats (the mode registry, the header and sub-header, each mode's section layout and slot size,
read_header), quantizers (shared quantization primitives), rope (the in-chunk RoPE undone for key coding), entropy
(the zstd-coded modes k8v4 and k6v4z: value token choice, key step floors, rate control, stream decoding), chunk
(pack and unpack of every mode) and bounds (the error bounds the tests check). This package re-exports the public
names; a chunk's format is versioned by its header (mode ids, retired ids refused) and by the mode's format tag in
its keys (promptcache.contract.keys.QUANT_FORMATS), so any change of the bytes is a new format.

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

from promptcache.codec.bounds import error_bound, low_bit_value_tokens, value_group_l2_bound
from promptcache.codec.chunk import pack, unpack
from promptcache.codec.entropy import CODED_STEPS, DENSE_KEY_STEPS, V_FINE, V_STEP_RATIO, ZSTD_LEVEL
from promptcache.codec.formats import (
    DENSE_RATIO, DENSE_V_RECENT, DENSE_V_SELECT, HEADER, HEADER_BYTES, K8V4_RATIO, MAGIC, MAX_V_GROUP, MODES, VERSION,
    Z_HEADER, CorruptChunk, compression_vs_fp16, packed_nbytes, read_header, v_group_size)
from promptcache.codec.quantizers import CLIP_STEPS
from promptcache.codec.rope import rope_theta_of

__all__ = [
    "CLIP_STEPS", "CODED_STEPS", "DENSE_KEY_STEPS", "DENSE_RATIO", "DENSE_V_RECENT", "DENSE_V_SELECT", "HEADER",
    "HEADER_BYTES", "K8V4_RATIO", "MAGIC", "MAX_V_GROUP", "MODES", "VERSION", "V_FINE", "V_STEP_RATIO", "ZSTD_LEVEL",
    "Z_HEADER", "CorruptChunk", "compression_vs_fp16", "error_bound", "low_bit_value_tokens", "pack", "packed_nbytes",
    "read_header", "rope_theta_of", "unpack", "v_group_size", "value_group_l2_bound",
]
