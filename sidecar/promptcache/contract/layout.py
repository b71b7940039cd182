"""Byte layout of one stored chunk, shared by the server (validation) and the client (packing).

A chunk holds the K and V of `chunk_tokens` tokens for every layer as one contiguous blob whose logical shape
is [num_layers, 2 (K, V), num_kv_heads, chunk_tokens, head_dim]. With quantization "none" the blob is that
tensor in the model's KV dtype; quantized modes pack it as promptcache.contract.quant describes.
"""
from __future__ import annotations

import math

import torch

from promptcache.contract.keys import ModelSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def chunk_shape(spec: ModelSpec, chunk_tokens: int) -> tuple[int, int, int, int, int]:
    return (spec.num_layers, 2, spec.num_kv_heads, chunk_tokens, spec.head_dim)


def chunk_nbytes(spec: ModelSpec, chunk_tokens: int) -> int:
    """Exact byte length of a stored chunk for this model, chunk size and quantization mode."""
    shape = chunk_shape(spec, chunk_tokens)
    if spec.quantization == "none":
        return math.prod(shape) * TORCH_DTYPES[spec.kv_dtype].itemsize
    from promptcache.contract import quant  # quantized formats live with their (de)quantizers

    return quant.packed_nbytes(spec.quantization, shape, spec.kv_dtype)
