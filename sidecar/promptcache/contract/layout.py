"""Byte layout of one stored chunk, shared by the server (validation) and the client (packing).

A chunk holds the K and V of `chunk_tokens` tokens for every layer as one contiguous blob whose logical shape
is [num_layers, 2 (K, V), num_kv_heads, chunk_tokens, head_dim] ([num_layers, 1, 1, chunk_tokens, head_dim] for an
MLA model's latent chunks, kv_kind "mla"). With quantization "none" the blob is that tensor in the model's KV dtype
(an fp8 dtype: its raw bytes, never scanned for finite values); quantized modes pack it as
promptcache.codec describes.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from promptcache.contract.keys import FP8_DTYPES, ModelSpec

if TYPE_CHECKING:
    import torch

ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class _LazyDtypes(Mapping):
    """A read-only dict built on first use, so that importing this module (the CLI, admin commands, the
    sidecar's settings) does not import torch (seconds): only code that touches a torch dtype pays for it."""

    def __init__(self, build):
        self._build, self._map = build, None

    def _get(self) -> dict:
        if self._map is None:
            self._map = self._build()
        return self._map

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get())


def _torch_dtypes() -> dict:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


TORCH_DTYPES: Mapping[str, "torch.dtype"] = _LazyDtypes(_torch_dtypes)
DTYPE_NAMES: Mapping["torch.dtype", str] = _LazyDtypes(lambda: {v: k for k, v in TORCH_DTYPES.items()})

# Per KV dtype: the signed and unsigned integers of its width, and the smallest bit pattern of a non-finite value
# (exponent bits all ones) read as the signed one (positive values) and as the unsigned one (negative values).
_NONFINITE = {"float32": (np.int32, np.uint32, 0x7F800000, 0xFF800000),
              "float16": (np.int16, np.uint16, 0x7C00, 0xFC00),
              "bfloat16": (np.int16, np.uint16, 0x7F80, 0xFF80)}


_SCAN_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}
COPY_ONLY = 3  # pc_copy_finite's kind for bytes that are not scanned
_native = None


def _native_functions():
    """(pc_all_finite, pc_copy_finite) from the compiled scan (_scanc.c, built by setup.py at install) as ctypes
    functions, or None when it was not built or PROMPTCACHE_NATIVE_SCAN=0."""
    global _native
    if _native is None:
        _native = False
        import os

        if os.environ.get("PROMPTCACHE_NATIVE_SCAN", "1") != "0":
            import ctypes
            from pathlib import Path

            for path in sorted(Path(__file__).parent.glob("_scanc*.so")):
                try:
                    lib = ctypes.CDLL(str(path))
                    scan, copy = lib.pc_all_finite, lib.pc_copy_finite
                except (OSError, AttributeError):
                    continue
                scan.restype, scan.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
                copy.restype = ctypes.c_int
                copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
                _native = scan, copy
                break
    return _native or None


def native_scan():
    """The compiled one-pass scan (pc_all_finite) as a ctypes function, or None (see _native_functions)."""
    native = _native_functions()
    return native[0] if native else None


def native_copy():
    """The compiled copy-and-scan (pc_copy_finite) as a ctypes function, or None (see _native_functions)."""
    native = _native_functions()
    return native[1] if native else None


def scanned(kv_dtype: str) -> bool:
    """Whether chunks of `kv_dtype` are scanned for NaN/Inf (values_finite): the float dtypes; fp8 chunks are a KV
    cache's raw bytes, stored and served as they are (their meaning depends on scales the sidecar never sees)."""
    return kv_dtype not in FP8_DTYPES


def scan_dtype(spec: ModelSpec) -> str | None:
    """What a stored chunk of `spec` is scanned as for NaN and Inf, once, where it is stored (so no reader scans a
    lent chunk): its KV dtype when unquantized; None for opaque bytes, checked where they are unpacked (quantized
    codes) or never (fp8, see scanned)."""
    return spec.kv_dtype if spec.quantization == "none" and scanned(spec.kv_dtype) else None


def values_finite(raw: np.ndarray, kv_dtype: str) -> bool:
    """Whether the bytes `raw` (uint8, whole values of `kv_dtype`) hold no NaN or Inf: one pass of the compiled
    scan (native_scan) over a contiguous buffer, else values_finite_numpy. ValueError for an fp8 dtype (never
    scanned: see scanned)."""
    if not scanned(kv_dtype):
        raise ValueError(f"{kv_dtype} chunks are raw bytes: they are not scanned for finite values")
    scan = native_scan()
    if scan is None or not raw.flags.c_contiguous or raw.size % ITEMSIZES[kv_dtype]:
        return values_finite_numpy(raw, kv_dtype)
    if raw.size == 0:
        return True
    return scan(raw.ctypes.data, raw.size // ITEMSIZES[kv_dtype], _SCAN_KINDS[kv_dtype]) == 1


def values_finite_numpy(raw: np.ndarray, kv_dtype: str) -> bool:
    """values_finite without compiled code. Read as integers, in two max reductions and no temporary (2-3x faster
    than a float reduction for 16-bit floats, which widens every value): a value is non-finite exactly when its
    bits as a signed integer are >= the positive pattern, or as an unsigned one >= the negative pattern."""
    signed, unsigned, positive, negative = _NONFINITE[kv_dtype]
    if raw.size == 0:
        return True
    return int(raw.view(signed).max()) < positive and int(raw.view(unsigned).max()) < negative


def copy_kind(kv_dtype: str | None) -> int:
    """pc_copy_finite's `kind` for chunks of `kv_dtype` (None: bytes that are not scanned)."""
    return COPY_ONLY if kv_dtype is None else _SCAN_KINDS[kv_dtype]


def copy_finite(dst: np.ndarray, src: np.ndarray, kv_dtype: str | None) -> bool:
    """Copy `src` into `dst` (uint8, the same length, `dst` contiguous) and tell whether the copied bytes, read as
    `kv_dtype` values, hold no NaN or Inf (always True for None: bytes that are not scanned). One pass of the
    compiled copy (pc_copy_finite: each piece scanned while in the CPU's cache, written with streaming stores)
    where it was built, else numpy's copy and values_finite. ValueError for an fp8 dtype or a partial value."""
    if kv_dtype is not None and not scanned(kv_dtype):
        raise ValueError(f"{kv_dtype} chunks are raw bytes: they are not scanned for finite values")
    if dst.size != src.size:
        raise ValueError(f"copy of {src.size} bytes into {dst.size}")
    if kv_dtype is not None and src.size % ITEMSIZES[kv_dtype]:
        raise ValueError(f"{src.size} bytes are not whole {kv_dtype} values")
    copy = native_copy()
    if copy is None or not (dst.flags.c_contiguous and src.flags.c_contiguous) or src.size == 0:
        np.copyto(dst, src)
        return kv_dtype is None or values_finite(dst, kv_dtype)
    return copy(dst.ctypes.data, src.ctypes.data, src.size, copy_kind(kv_dtype)) == 1


def all_finite(t: "torch.Tensor") -> bool:
    """values_finite for a CPU tensor of a KV dtype."""
    import torch

    return values_finite(t.reshape(-1).view(torch.uint8).numpy(), DTYPE_NAMES[t.dtype])


def chunk_shape(spec: ModelSpec, chunk_tokens: int) -> tuple[int, int, int, int, int]:
    return (spec.num_layers, spec.kv_parts, spec.num_kv_heads, chunk_tokens, spec.head_dim)


def chunk_nbytes(spec: ModelSpec, chunk_tokens: int) -> int:
    """Exact byte length of a stored chunk for this model, chunk size and quantization mode."""
    shape = chunk_shape(spec, chunk_tokens)
    if spec.quantization == "none":
        return math.prod(shape) * ITEMSIZES[spec.kv_dtype]
    from promptcache import codec  # quantized formats live with their (de)quantizers (torch: imported on use)

    return codec.packed_nbytes(spec.quantization, shape, spec.kv_dtype)
