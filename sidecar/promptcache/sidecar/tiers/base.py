"""What a tier below memory is to the tier stack: `LowerTier`, and the `Record` it reads back.

A lower tier holds chunks that memory does not (the disk tier: what memory evicted for room; the cluster tier:
what any node of the fleet stored). The stack (promptcache.sidecar.tiers.stack) asks the tiers in order, and
promotes what one of them returns into memory with its single routine: a lower tier only stores, finds, verifies
and reads its own records, and knows nothing of memory, quotas or the caller.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Record:
    """A chunk read back from a lower tier, verified (its payload matched its checksum), with what memory needs
    to serve it again and what it keeps of its history: the time it has left, its age (its maximum lifetime
    counts from its first store, on whichever tier or node), how hot it was, its owner and its own TTL."""
    key: bytes
    fingerprint: bytes
    parent: bytes
    index: int
    dtype: int
    shape: tuple[int, ...]
    checksum: int
    payload: np.ndarray  # uint8, exactly the chunk's bytes
    ttl: float  # seconds it has left
    age: float  # seconds since it was first stored
    hits: int = 0
    idle: float | None = None  # seconds since its last access, where the tier keeps it
    ttl_hint: float | None = None  # its own sliding TTL (a retention hint), where it had one
    owner: str = ""  # whose quota it was charged to, where the tier keeps it
    pinned: bool = False  # a priority hint had pinned it in memory before it came down, where the tier keeps it

    @property
    def nbytes(self) -> int:
        return int(self.payload.size)


@dataclass(frozen=True)
class ChunkLayout:
    """What every chunk of one fingerprint must be (promptcache.contract.layout, as a Put checks it: putsession's
    _check_begin and CacheEngine.store): its wire dtype (pb.DType), logical shape, exact byte length, and the dtype
    its values are scanned as for NaN/Inf (None: opaque bytes, quantized codes or fp8)."""
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    scan: str | None

    @classmethod
    def of(cls, spec, chunk_tokens: int) -> "ChunkLayout":
        """The layout of `spec`'s chunks (a promptcache.contract.keys.ModelSpec) at `chunk_tokens`."""
        from promptcache.contract.layout import chunk_nbytes, chunk_shape, scan_dtype
        from promptcache.contract.wire import NAME_TO_DTYPE

        return cls(NAME_TO_DTYPE[spec.kv_dtype], tuple(chunk_shape(spec, chunk_tokens)),
                   chunk_nbytes(spec, chunk_tokens), scan_dtype(spec))

    @classmethod
    def of_record(cls, record: "Record") -> "ChunkLayout | None":
        """The layout a record claims, when it is one a chunk can have (layout_refusal(record, None) passes its
        structure); None otherwise. Its scan: the dtype when the size is the unquantized one."""
        from promptcache.contract.layout import ITEMSIZES, scanned
        from promptcache.contract.wire import DTYPE_TO_NAME

        name = DTYPE_TO_NAME.get(record.dtype)
        if name is None or _structure(record, name):
            return None
        plain = math.prod(record.shape) * ITEMSIZES[name] == record.nbytes
        return cls(record.dtype, tuple(record.shape), record.nbytes, name if plain and scanned(name) else None)


def _structure(record: "Record", name: str) -> str:
    """Why `record` cannot be a chunk of dtype `name` whatever its model ("" when it can): a 5-dim shape of
    positive sizes, and its payload exactly the bytes of that shape unquantized or packed by a quantized mode."""
    from promptcache.contract.keys import QUANT_MODES
    from promptcache.contract.layout import ITEMSIZES

    shape = tuple(record.shape)
    if len(shape) != 5 or any(d <= 0 for d in shape):
        return f"shape {list(shape)} is not [layers, parts, kv_heads, chunk_tokens, head_dim]"
    n = record.nbytes
    if math.prod(shape) * ITEMSIZES[name] == n:
        return ""
    from promptcache import codec

    for mode in QUANT_MODES[1:]:
        try:
            if codec.packed_nbytes(mode, shape, name) == n:
                return ""
        except ValueError:
            continue
    return f"{n} bytes are not a chunk of shape {list(shape)} and dtype {name}"


def layout_refusal(record: "Record", layout: ChunkLayout | None, scan: bool = True) -> tuple[str, str]:
    """(reason, detail) when `record` may not be served as a chunk ("", "" when it may), checked as a Put's bytes
    are: against `layout`, the requesting model's (dtype, shape, size; its values finite where its dtype is
    scanned); without one (warm-up, a model this node has not resolved), against its own header: a known dtype,
    a 5-dim shape and a payload of exactly that shape's bytes, its values finite where the size is the unquantized
    one of a scanned dtype. reason: "layout" or "nonfinite". scan=False: the structure only (no pass over the
    bytes)."""
    from promptcache.contract.layout import values_finite
    from promptcache.contract.wire import DTYPE_TO_NAME

    if layout is None:
        name = DTYPE_TO_NAME.get(record.dtype)
        if name is None:
            return "layout", f"dtype {record.dtype} is not a KV dtype"
        why = _structure(record, name)
        if why:
            return "layout", why
        if not scan:
            return "", ""
        layout = ChunkLayout.of_record(record)
    elif record.dtype != layout.dtype or tuple(record.shape) != layout.shape or record.nbytes != layout.nbytes:
        return "layout", (f"dtype {record.dtype}, shape {list(record.shape)}, {record.nbytes} bytes, where the "
                          f"model's chunks are dtype {layout.dtype}, shape {list(layout.shape)}, {layout.nbytes} bytes")
    if scan and layout.scan is not None and not values_finite(np.ascontiguousarray(record.payload), layout.scan):
        return "nonfinite", f"NaN or Inf among its {layout.scan} values"
    return "", ""


class LowerTier:
    """A tier below memory. Every method is safe to call from any thread; none blocks on memory's lock.

    `name` labels it in Lookup answers and metrics. `moves`: a promotion takes the chunk out of this tier (one
    tier at a time: the disk) rather than copying it (the cluster keeps its copy for the other nodes). `local`:
    asking it is cheap (no network), so a Put may check it before storing. `publishes`: it is told of every chunk
    a Put stores (stored())."""

    name = "lower"
    moves = False
    local = True
    publishes = False

    def bind_layouts(self, layout_of) -> None:
        """The stack hands each tier its `layout_of(fingerprint) -> ChunkLayout | None` (the layouts of the models
        this node knows): a tier whose records come from elsewhere checks them against it."""

    def size(self, key: bytes, fingerprint: bytes) -> int | None:
        """The chunk's size when this tier holds `key` under `fingerprint`, else None. No side effects: a Lookup
        changes nothing in any tier."""
        raise NotImplementedError

    def read(self, key: bytes, fingerprint: bytes) -> Record | None:
        """The verified record of `key` under `fingerprint`, or None (absent, expired, or failed its checks:
        then dropped and counted by the tier)."""
        raise NotImplementedError

    def taken(self, key: bytes, hit: bool) -> None:
        """`key` was promoted into memory (`hit`: by a Get, not by warm-up). A moving tier drops its copy."""

    def expired(self, key: bytes) -> None:
        """`key` is past its maximum lifetime (as memory counts it): a tier that can, drops it."""

    def demote(self, entry) -> bool:
        """Memory evicted `entry` (a promptcache.sidecar.store.Entry) for room: keep it if this tier takes
        demotions. Called under memory's lock: only queue work. True when taken."""
        return False

    def stored(self, record: Record) -> None:
        """A Put stored `record` in memory (its payload: the received bytes, never written again): a shared tier
        publishes it. Must not block."""

    def delete(self, keys: list[bytes], fingerprint: bytes) -> int:
        return 0

    def purge(self, fingerprint: bytes) -> int:
        return 0

    def usage(self) -> dict[str, int] | None:
        """entries, used and budget bytes (and disk_full, queued), or None where the tier reports none."""
        return None

    def close(self) -> None:
        pass
