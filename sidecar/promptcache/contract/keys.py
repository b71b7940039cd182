"""Model fingerprints and chained chunk keys (spec: docs/keys.md).

Pure functions, deterministic across processes, machines and languages: SHA-256 over a canonical,
length-prefixed byte encoding. Never Python's hash().
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

KV_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
# fp8 KV caches (vLLM's --kv-cache-dtype fp8*): raw bytes, 1 byte a value, stored as they are: no finite scan, no
# quantization mode. What they mean depends on per-layer scales too: those go in the salt (request_salt kv_scales).
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# What a chunk holds per (layer, token): "kv" K and V of every KV head ([L, 2, H, T, D]); "mla" one latent vector
# (MLA models: [L, 1, 1, T, D], num_kv_heads 1). Fingerprint field 9, present only for "mla" (kv keys unchanged).
KV_KINDS = ("kv", "mla")
QUANT_MODES = ("none", "k8v8", "k8v4", "k6v4z")
# What field 7 of the fingerprint holds: the mode's byte *format*. k8v4 changed format twice in issue 16 (format 2:
# more 8-bit value tokens per chunk; format 3: keys and values entropy-coded into a fixed 2.5x slot), so its chunks
# hash under "k8v4.3": a chunk of an older format is never found by a format-3 client, nor the reverse. k6v4z likewise
# since its format 2 (keys coded with RoPE undone): "k6v4z.2".
QUANT_FORMATS = {"none": "none", "k8v8": "k8v8", "k8v4": "k8v4.3", "k6v4z": "k6v4z.2"}
DEFAULT_CHUNK_TOKENS = 256
MAX_TOKEN_ID = 2**32 - 1

_FP_DOMAIN = b"promptcache/fingerprint/v1\x00"
_CHUNK_DOMAIN = b"promptcache/chunk/v1\x00"
ROOT_PARENT = bytes(32)  # the parent of chunk 0


@dataclass(frozen=True)
class ModelSpec:
    """Everything the KV bytes depend on; hashed into the fingerprint."""

    model_id: str
    revision: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quantization: str = "none"
    tenant_salt: bytes = field(default=b"", repr=False)
    kv_kind: str = "kv"

    @property
    def kv_parts(self) -> int:
        """2 (K and V) for a "kv" chunk, 1 (the latent) for "mla"."""
        return 1 if self.kv_kind == "mla" else 2

    def validate(self) -> "ModelSpec":
        """Raise ValueError naming the first malformed field."""
        if not self.model_id:
            raise ValueError("model.model_id is empty")
        if len(self.model_id.encode()) > 512:
            raise ValueError("model.model_id is longer than 512 bytes")
        if len(self.revision.encode()) > 512:
            raise ValueError("model.revision is longer than 512 bytes")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"model.kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not 0 < value <= 65536:
                raise ValueError(f"model.{name} must be in 1..65536, got {value}")
        if self.quantization not in QUANT_MODES:
            raise ValueError(f"model.quantization {self.quantization!r} is not one of {', '.join(QUANT_MODES)}")
        if len(self.tenant_salt) > 64:
            raise ValueError("model.tenant_salt is longer than 64 bytes")
        if self.kv_kind not in KV_KINDS:
            raise ValueError(f"model.kv_kind {self.kv_kind!r} is not one of {', '.join(KV_KINDS)}")
        if self.kv_kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"model.num_kv_heads must be 1 for an MLA (latent) chunk, got {self.num_kv_heads}")
        if self.quantization != "none" and (self.kv_dtype in FP8_DTYPES or self.kv_kind == "mla"):
            what = f"{self.kv_dtype} chunks (stored as their raw bytes)" if self.kv_dtype in FP8_DTYPES \
                else "MLA latent chunks"
            raise ValueError(f"model.quantization {self.quantization!r} is not available for {what}: the "
                             "quantization modes code K and V of float16/bfloat16/float32 heads; use \"none\"")
        return self


def _field(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BI", tag, len(payload)) + payload


def fingerprint(spec: ModelSpec) -> bytes:
    """32-byte model fingerprint: SHA-256 over the domain string and the tagged, length-prefixed fields."""
    spec.validate()
    u32 = lambda v: struct.pack("<I", v)  # noqa: E731
    encoded = b"".join((
        _field(1, spec.model_id.encode("utf-8")),
        _field(2, spec.revision.encode("utf-8")),
        _field(3, spec.kv_dtype.encode("ascii")),
        _field(4, u32(spec.num_layers)),
        _field(5, u32(spec.num_kv_heads)),
        _field(6, u32(spec.head_dim)),
        _field(7, QUANT_FORMATS[spec.quantization].encode("ascii")),
        _field(8, spec.tenant_salt),
    )) + (_field(9, b"mla") if spec.kv_kind == "mla" else b"")
    return hashlib.sha256(_FP_DOMAIN + encoded).digest()


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return tokens_to_array(tokens).tobytes()


def tokens_to_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token ids as a contiguous little-endian uint32 array (range-checked)."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
            raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}")
    else:
        # One conversion that also range-checks (numpy >= 2 refuses out-of-range ints): on the server's hot
        # path, where tokens come as a proto repeated uint32, this is 2x faster than converting, then checking.
        try:
            arr = np.array(tokens, dtype="<u4")
        except OverflowError:
            raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}") from None
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of token ids")
    return np.ascontiguousarray(arr.astype("<u4", copy=False))


def chunk_key(fp: bytes, parent: bytes, chunk_tokens_le: bytes) -> bytes:
    """key_i = SHA-256(domain || fingerprint || key_{i-1} || tokens_i as little-endian u32)."""
    return hashlib.sha256(_CHUNK_DOMAIN + fp + parent + chunk_tokens_le).digest()


def chunk_keys(fp: bytes, tokens: Sequence[int] | np.ndarray, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               limit: int | None = None) -> list[bytes]:
    """Keys of every whole chunk of `tokens` (a trailing partial chunk has no key), at most `limit`."""
    return list(iter_chunk_keys(fp, tokens, chunk_tokens, limit))


def iter_chunk_keys(fp: bytes, tokens, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    limit: int | None = None) -> Iterator[bytes]:
    """Keys one after another, each hashed when asked for: a consumer that stops early (Get and Lookup stop at
    the first miss) does not hash the rest of a long request. The tokens are converted in one go (measured: a
    slice of a protobuf repeated field costs far more than converting all of it)."""
    if len(fp) != 32:
        raise ValueError("fingerprint must be 32 bytes")
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    raw = memoryview(tokens_to_array(tokens)).cast("B")  # slices of it are views: no copy of a long request
    step = 4 * chunk_tokens
    n = len(raw) // step
    if limit is not None:
        n = min(n, limit)
    parent = ROOT_PARENT
    for i in range(n):
        parent = chunk_key(fp, parent, raw[i * step:(i + 1) * step])
        yield parent


# ---------------------------------------------------------------------------------------------- request salt (v2)
# What else a request's K/V depends on besides the model and the tokens: a LoRA adapter, multimodal inputs at their
# placeholder positions, prompt embeddings, the slice of the model's KV heads and layers one tensor/pipeline-parallel
# rank holds. None of it needs a field of the fingerprint: it is folded into the salt (fingerprint field 8), so the
# wire format, the server and every existing key stay as they are, and a request without any of it keeps the v1 salt
# (its keys are unchanged, shared with every other client). Spec: docs/keys.md, "Request salt (v2)".
_REQUEST_DOMAIN = b"promptcache/request/v2\x00"
MAX_MM_ITEMS = 4096


@dataclass(frozen=True)
class Adapter:
    """A LoRA (or other) adapter: its name and a digest of its weights (both: a renamed adapter or one whose files
    changed under the same name gives different keys)."""

    name: str
    digest: bytes


@dataclass(frozen=True)
class MultiModalItem:
    """One multimodal input: modality, the engine's content hash of it, and where its placeholder tokens are."""

    modality: str
    content_hash: str
    offset: int
    length: int


@dataclass(frozen=True)
class Shard:
    """The slice of the model's KV a chunk holds: KV heads [head_start, head_stop) of num_kv_heads, layers
    [layer_start, layer_stop) of num_layers. The whole model is no shard (request_salt leaves it out)."""

    head_start: int
    head_stop: int
    num_kv_heads: int
    layer_start: int
    layer_stop: int
    num_layers: int

    def validate(self) -> "Shard":
        if not 0 <= self.head_start < self.head_stop <= self.num_kv_heads:
            raise ValueError(f"shard heads [{self.head_start}, {self.head_stop}) are not inside 0..{self.num_kv_heads}")
        if not 0 <= self.layer_start < self.layer_stop <= self.num_layers:
            raise ValueError(f"shard layers [{self.layer_start}, {self.layer_stop}) are not inside "
                             f"0..{self.num_layers}")
        return self

    @property
    def whole(self) -> bool:
        return (self.head_start, self.head_stop, self.layer_start, self.layer_stop) == (
            0, self.num_kv_heads, 0, self.num_layers)


def request_salt(salt: bytes, *, adapter: Adapter | None = None, mm_items: Sequence[MultiModalItem] = (),
                 embeds_digest: bytes = b"", shard: Shard | None = None, kv_scales: bytes = b"") -> bytes:
    """The fingerprint's salt for a request: `salt` itself (v1, any tenant salt) when nothing else is given, else
    SHA-256(request domain v2 || F(1, salt) || [F(2, adapter name) F(3, adapter digest)]
            || per multimodal item, in prompt order: F(4, modality) F(5, content hash) F(6, u32 offset u32 length)
            || [F(7, embeds digest)] || [F(8, u32 head_start head_stop num_kv_heads layer_start layer_stop num_layers)]
            || [F(9, kv scales digest)])
    (32 bytes); `kv_scales` is an fp8 cache's scales_digest. Raises ValueError naming what is malformed."""
    if len(salt) > 64:
        raise ValueError("salt is longer than 64 bytes")
    if len(mm_items) > MAX_MM_ITEMS:
        raise ValueError(f"more than {MAX_MM_ITEMS} multimodal items")
    u32 = lambda *vs: struct.pack(f"<{len(vs)}I", *vs)  # noqa: E731
    parts = []
    if adapter is not None:
        if not adapter.name:
            raise ValueError("adapter.name is empty")
        if len(adapter.digest) < 16:
            raise ValueError("adapter.digest is shorter than 16 bytes")
        parts += [_field(2, adapter.name.encode("utf-8")), _field(3, adapter.digest)]
    for i, item in enumerate(mm_items):
        if not item.modality or not item.content_hash:
            raise ValueError(f"multimodal item {i} has no modality or no content hash")
        if not (0 <= item.offset <= MAX_TOKEN_ID and 0 < item.length <= MAX_TOKEN_ID):
            raise ValueError(f"multimodal item {i}: placeholder offset {item.offset} length {item.length} out of range")
        parts += [_field(4, item.modality.encode("utf-8")), _field(5, item.content_hash.encode("utf-8")),
                  _field(6, u32(item.offset, item.length))]
    if embeds_digest:
        parts.append(_field(7, embeds_digest))
    if shard is not None and not shard.validate().whole:
        s = shard
        parts.append(_field(8, u32(s.head_start, s.head_stop, s.num_kv_heads, s.layer_start, s.layer_stop,
                                   s.num_layers)))
    if kv_scales:
        if len(kv_scales) < 16:
            raise ValueError("kv_scales digest is shorter than 16 bytes")
        parts.append(_field(9, kv_scales))
    if not parts:
        return salt
    return hashlib.sha256(_REQUEST_DOMAIN + _field(1, salt) + b"".join(parts)).digest()


def shard_spec(spec: ModelSpec, shard: Shard, **salt_parts) -> ModelSpec:
    """The spec of the chunks one rank holds: the shard's own head and layer counts (the blob's shape), the shard
    (and anything else of request_salt's) in the salt. `spec` is the whole model's."""
    from dataclasses import replace

    if (shard.num_kv_heads, shard.num_layers) != (spec.num_kv_heads, spec.num_layers):
        raise ValueError(f"shard of a model with {shard.num_kv_heads} KV heads and {shard.num_layers} layers, "
                         f"spec has {spec.num_kv_heads} and {spec.num_layers}")
    return replace(spec, num_kv_heads=shard.head_stop - shard.head_start,
                   num_layers=shard.layer_stop - shard.layer_start,
                   tenant_salt=request_salt(spec.tenant_salt, shard=shard, **salt_parts)).validate()


_SCALES_DOMAIN = b"promptcache/kv-scales/v1\x00"


def scales_digest(k_scales: Sequence[float], v_scales: Sequence[float]) -> bytes:
    """The identity of an fp8 KV cache's per-layer scales (request_salt's kv_scales): SHA-256(domain || for every
    layer, in order: f32le(k_scale) f32le(v_scale)) (32 bytes). The scales of the layers a chunk holds, as float32
    (what vLLM keeps). Raises ValueError when they are missing, unpaired or not finite positive numbers."""
    import math

    if not k_scales or len(k_scales) != len(v_scales):
        raise ValueError(f"fp8 scales: {len(k_scales)} K and {len(v_scales)} V scales (one of each per layer)")
    h = hashlib.sha256(_SCALES_DOMAIN)
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        k, v = float(k), float(v)
        if not (math.isfinite(k) and math.isfinite(v) and k > 0 and v > 0):
            raise ValueError(f"fp8 scales of layer {i} are not finite positive numbers: K {k}, V {v}")
        h.update(struct.pack("<ff", k, v))
    return h.digest()
