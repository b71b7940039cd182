"""store: the device tier. Chunks are torch uint8 tensors on CUDA, or in host memory without a GPU.

Accounting is the point: `used + reserved + draining` is every byte the tier has allocated or promised
(stored entries, Puts in flight, evicted entries still being streamed to a reader), and it never exceeds
the budget. A Put reserves its bytes before allocating; a reader holds a lease so eviction cannot free
(or double-count) what it is still sending. A shrink (`resize`) cannot free what Puts and Gets in flight
hold, so it admits new reservations under the new size at once, evicts, and waits for those calls to let go
before the budget changes: the budget reported is always one the committed bytes are under. On the CPU, chunk
memory may come from promptcache.sidecar.memfd (a sealed memfd per chunk, which the bulk channel lends to
clients instead of copying).
"""
from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import xxhash

from promptcache.contract.layout import (COPY_ONLY, ITEMSIZES, copy_finite, copy_kind, native_copy,
                                         values_finite)
from promptcache.sidecar.expiry import ExpiryHeap
from promptcache.sidecar.memfd import ChunkMemory, ProtectedMemory, SealedChunk, mapping_budget, protect
from promptcache.sidecar.policies import EvictionPolicy

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this


class StoreError(Exception):
    """Base of the store's refusals; the server maps each to a gRPC status."""


class ChunkTooLarge(StoreError):
    pass


class NoRoom(StoreError):
    """Everything evictable was evicted and the chunk still does not fit (space held by Puts/Gets in flight)."""


class AdmissionRejected(StoreError):
    pass


@dataclass(frozen=True)
class ResizeOutcome:
    """What a resize did. `done`: the new budget is in force (committed bytes are under it); otherwise the wait
    ran out with `reserved` + `draining` bytes still held by Puts and Gets in flight, and the budget stayed
    `previous`."""
    previous: int
    requested: int
    done: bool
    evicted: int
    used: int
    committed: int
    reserved: int
    draining: int
    waited: float  # seconds spent waiting for Puts and Gets in flight
    unpinned: int = 0  # pinned chunks a shrink unpinned: over the new size's pin bounds (MemoryTier._unpin_to)


@dataclass(eq=False, slots=True)  # (slots: no __dict__ per chunk, one object fewer for the garbage collector to scan)
class Entry:
    key: bytes
    fingerprint: bytes
    parent: bytes
    index: int
    data: torch.Tensor  # 1-D uint8
    checksum: int       # xxh3_64 of the bytes as received
    shape: tuple[int, ...]
    dtype: int          # promptcache.v1.DType value of the logical tensor
    created: float      # stored in this tier (memory clock)
    expires: float      # sliding: every hit moves it to now + TTL, never past born + the maximum lifetime
    accounted: int
    leases: int = 0
    evicted: bool = False
    last_access: float = field(default=0.0)
    memfd: SealedChunk | None = None  # set when `data` is a memfd's mapping: the chunk can be lent (sealed first)
    born: float | None = None  # first stored in any tier (memory clock; a promoted chunk keeps its age); None: created
    owner: str = ""  # whose quota it is charged to (promptcache.sidecar.tenancy)
    values_finite: bool = False  # an unquantized chunk whose values the store found finite (PutSession)
    pinned: bool = False  # a Put's priority hint: capacity eviction passes it over (out of the policy's sight)
    ttl: float | None = None  # its own sliding TTL (a Put's retention hint); None: the tier's
    hits: int = 0  # Gets that served it, in any tier since it was first stored (kept on disk: warm-up's order)
    _array: np.ndarray | None = field(default=None, repr=False)
    recyclable: bool = False  # its memory goes back to the tier's free list once nobody reads it (host_buffer's)
    protectable: bool = False  # `data` is a mapping of its own (memfd.ProtectedMemory)...
    immutable: bool = False  # ...read-only since a Get verified it there (a memfd's: sealed too): not hashed again
    wire: object = field(default=None, repr=False)  # a transport's encoding of this chunk, made once (bulk.py)
    queued_expiry: float = field(default=math.nan, repr=False)  # its item's time in the tier's expiry heap
    nbytes: int = field(init=False)  # asked on every insert, eviction and Get: `data` never changes size

    def __post_init__(self) -> None:
        self.nbytes = self.data.numel()

    @property
    def array(self) -> np.ndarray:
        """`data` (in host memory) as a numpy view, made once: torch's .numpy() costs more than the rest of
        serving a small chunk's bookkeeping."""
        if self._array is None:
            self._array = self.data.numpy()
        return self._array


@dataclass
class Reservation:
    nbytes: int
    accounted: int
    done: bool = False
    host: torch.Tensor | None = None  # what host_buffer() allocated
    memfd: SealedChunk | None = None  # its memfd, if it has one
    protectable: bool = False  # host is a mapping of its own that can be made read-only (MemoryTier.seal)
    array: np.ndarray | None = None  # host as a numpy view (made once per memory, kept with it on the free list)


class StoreListener:
    """What the parts that follow the tier's contents subscribe to (MemoryTier.subscribe): tenancy's
    accounting, the disk tier (demotion), KV events, metrics. Called under the tier's lock, in the order of
    subscription: keep them short and never call back into the tier."""

    def inserted(self, entry: Entry) -> None:
        """`entry` was committed (stored, or promoted from the disk or cluster tier)."""

    def removed(self, entry: Entry, reason: str, age: float) -> None:
        """`entry` left the index (`reason`: capacity, ttl, delete, purge, quota, corrupt, resize);
        entry.evicted is already True. `age`: seconds since it was stored in this tier."""


class ReadListener:
    """What follows reads the way StoreListener follows inserts and removals (CacheEngine.subscribe_reads):
    metrics, tenancy's per-owner counters, the engine's totals. Called on the reading thread, outside any lock."""

    def looked_up(self, rpc: str, owner: str, cached: int, total: int, by_tier: dict[str, int]) -> None:
        """A Lookup or Get of `total` tokens found `cached` (by_tier: tokens from each tier) for `owner`."""

    def served(self, owner: str, key: bytes, nbytes: int, tier: str) -> None:
        """A Get sent chunk `key` (`nbytes`, found in `tier`) to `owner`."""


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


_PIECE = 1 << 20  # checked piece by piece: the second read of each piece comes from the CPU's cache


def checksum_and_finite(buf: np.ndarray, kv_dtype: str) -> tuple[int, bool]:
    """xxh3_64 of `buf` (uint8) and whether, read as `kv_dtype` values, it holds no NaN or Inf: one pass over
    memory."""
    h, finite = xxhash.xxh3_64(), True
    for at in range(0, buf.size, _PIECE):
        piece = buf[at:at + _PIECE]
        h.update(piece)
        finite = finite and values_finite(piece, kv_dtype)
    return h.intdigest(), finite


_STAGING = threading.local()


def _staging() -> np.ndarray:
    """This thread's ChunkCheck.PIECE bytes to take a piece of client-writable memory into before checking it."""
    buf = getattr(_STAGING, "buf", None)
    if buf is None or buf.size < ChunkCheck.PIECE:
        buf = _STAGING.buf = np.empty(ChunkCheck.PIECE, dtype=np.uint8)
    return buf


class ChunkCheck:
    """A Put's chunk verified as its bytes are copied into the chunk's memory `dst` (copy_in): xxh3_64 of every
    byte and, with `scan_dtype`, the finite scan, each piece read while it is still in the CPU's cache. The
    alternative, a copy (or a receive) into the chunk and then checksum_and_finite, reads every byte back from
    memory, and the chunk's memory is mostly an evicted chunk's, cold: an 8 MiB Put into a full tier took 2.0 ms of
    the connection's CPU for its bytes that way, 1.6 ms this way (issue #31, docs/benchmarks.md). A piece that splits
    a value (a data frame of odd length) leaves the scan to result(), over the whole chunk."""

    __slots__ = ("_hash", "_dtype", "_finite", "_scan_at_end", "_dst", "_address", "_copy", "_kind", "_itemsize")
    PIECE = 512 << 10  # hashed, then scanned and copied, while in the CPU's cache (within a server core's L2)

    def __init__(self, dst: np.ndarray, scan_dtype: str | None):
        self._hash = xxhash.xxh3_64()
        self._dtype = scan_dtype  # None: opaque bytes (quantized codes, fp8), checksummed only
        self._finite = True
        self._scan_at_end = False
        self._dst = dst
        self._copy = (native_copy() if dst.flags.c_contiguous and dst.flags.writeable and dst.dtype == np.uint8
                      else None)
        self._address = dst.ctypes.data if self._copy is not None else 0
        self._kind = copy_kind(scan_dtype)
        self._itemsize = ITEMSIZES[scan_dtype] if scan_dtype is not None else 1

    def copy_in(self, at: int, src: np.ndarray, client_writable: bool = False) -> None:
        """Copy `src` (uint8) into the chunk's memory at byte `at`, checking it on the way. `client_writable`: the
        client can still change `src` (its shared memfd): read twice, it could be checked as one thing and stored
        as another, so each piece is first copied into memory of the sidecar's own (this thread's staging buffer,
        which stays in the CPU's cache) and checked and stored from there."""
        n = src.size
        if at < 0 or at + n > self._dst.size:
            raise ValueError(f"{n} bytes at offset {at} run past the chunk's {self._dst.size}")
        if at % self._itemsize or n % self._itemsize:
            self._scan_at_end = True
        staging = _staging() if client_writable else None
        copy = self._copy if src.flags.c_contiguous or staging is not None else None
        source = (staging.ctypes.data if staging is not None else src.ctypes.data) if copy is not None and n else 0
        for start in range(0, n, self.PIECE):
            piece, offset = src[start:start + self.PIECE], start
            if staging is not None:  # from here on nothing the client does can change what is checked and stored
                piece, offset = staging[:piece.size], 0
                np.copyto(piece, src[start:start + self.PIECE])
            scan = self._dtype if self._finite and not self._scan_at_end else None
            self._hash.update(piece)
            if copy is None:
                finite = copy_finite(self._dst[at + start:at + start + piece.size], piece, scan)
            else:
                finite = copy(self._address + at + start, source + offset, piece.size,
                              self._kind if scan else COPY_ONLY)
                if finite < 0:
                    raise ValueError(f"pc_copy_finite refused {piece.size} bytes of kind {self._kind}")
            self._finite = self._finite and finite == 1

    def result(self) -> tuple[int, bool]:
        """(xxh3_64, finite) of the whole chunk, once every byte was copied in; finite is False for opaque bytes
        (not scanned), as checksum_and_finite's callers take it."""
        if self._dtype is None:
            return self._hash.intdigest(), False
        if self._scan_at_end and self._finite:
            self._finite = values_finite(self._dst, self._dtype)
        return self._hash.intdigest(), self._finite


class MemoryTier:
    def __init__(self, budget_bytes: int, device: torch.device, policy: EvictionPolicy, ttl_seconds: float,
                 clock: Callable[[], float] = time.monotonic, host_memory: ChunkMemory | None = None,
                 max_lifetime_seconds: float = math.inf, entry_overhead: int = 0, recycle: bool = True,
                 protect_memory: bool = True):
        if budget_bytes <= 0:
            raise ValueError("budget must be positive")
        self.device = device
        self.policy = policy
        self.ttl = ttl_seconds  # sliding: an entry lives this long after its last hit (Get, promotion)...
        self.max_lifetime = max_lifetime_seconds  # ...and never longer than this after it was first stored
        self.clock = clock
        self._listeners: tuple[StoreListener, ...] = ()
        self._budget = budget_bytes
        self._entry_overhead = entry_overhead  # bytes held elsewhere per chunk (KV events' token ids), counted here
        self._entries: dict[bytes, Entry] = {}
        self._pinned: dict[str, int] = {}  # owner -> accounted bytes of its pinned entries
        self._pinned_total = 0
        # (owner, budget) -> the bytes `owner` may hold pinned under `budget` (CacheEngine sets it from
        # --max-pinned-fraction and the owner's quota); None: only the bound on all owners together, half the budget
        self.owner_pin_limit: Callable[[str, int], int] | None = None
        # Expiry from a heap (expiry.py), not a scan of every entry: a tier whose chunks leave by TTL as fast as Puts
        # come, full, scanned all of them per Put (7 ms per chunk at 100,000). A hit that moves an expiry later leaves
        # its item where it is (queued again when it comes up); an item superseded by a newer one (queued_expiry),
        # or of an entry that left, is dropped when it comes up.
        self._expiry = ExpiryHeap()
        self._used = 0
        self._reserved = 0
        self._draining = 0
        self._lock = threading.Lock()
        self._shrinking_to: int | None = None  # while a shrink waits: the size new reservations must fit under
        self._drained = threading.Condition(self._lock)  # notified, during a shrink, as held bytes are let go
        self._resize_lock = threading.Lock()  # one resize at a time: each starts from where the last ended
        self._round = CUDA_BLOCK if device.type == "cuda" else 1
        self.on_cpu = device.type == "cpu"  # asked per chunk stored: torch's device.type builds a new string
        # Memfd-backed chunks only where the chunk stays in host memory: a CUDA tier copies to the device.
        self.host_memory = host_memory if device.type == "cpu" else None
        # Plain host memory of chunks that left, kept for the next chunks of the same size: fresh memory costs a
        # page fault per 4 KiB on first touch (2,052 faults and 3.2 ms of CPU per 8 MiB Put, measured), and
        # memory malloc gave back to the system after a purge is fresh again; kept memory faults never. Only what
        # nobody reads any more (no lease) is kept, and at most what the budget leaves free, so the process never
        # holds more than the budget. (Transparent huge pages for fresh memory were tried: with the kernel's
        # direct compaction an 8 MiB Put took 28 ms of CPU instead of 8.) Off where another thread may still read
        # a stored chunk's memory after it left (the cluster tier publishes from it): `recycle` False. A memfd is
        # kept the same way until it is sealed (memfd.py): never once it may have been lent.
        self._recycle = recycle and device.type == "cpu"
        # size -> (memory, its numpy view or None, protectable, read-only, its unsealed memfd or None)
        self._free: dict[int, list[tuple[torch.Tensor, np.ndarray | None, bool, bool, SealedChunk | None]]] = {}
        # Chunk memory that can be made read-only once a Get verified it (seal): later Gets send it unhashed.
        self._protected = (ProtectedMemory(mapping_budget())
                           if protect_memory and device.type == "cpu" and self.host_memory is None else None)
        self._free_bytes = 0

    def subscribe(self, listener: StoreListener) -> None:
        """Tell `listener` of every entry inserted and removed from now on."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    # --- accounting -------------------------------------------------------------------------------------
    @property
    def budget(self) -> int:
        return self._budget

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "used": self._used, "reserved": self._reserved,
                    "draining": self._draining, "budget": self._budget}

    def pin(self, key: bytes, fingerprint: bytes, owner_limit: int | None = None) -> bool | None:
        """Pin the live entry `key`: taken out of the eviction policy's sight, so capacity eviction passes it over
        (TTL, deletes, purges and quotas still remove it). False when its owner's pinned bytes would pass its bound
        (`owner_limit` if given, and owner_pin_limit), or all owners' half the budget; both bounds are those of a
        pending shrink's size while one waits. None when it is not held. Idempotent."""
        now = self.clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.fingerprint != fingerprint or entry.expires <= now:
                return None
            if entry.pinned:
                return True
            size = self._limit()
            bound = self._owner_bound(entry.owner, size)
            if owner_limit is not None:
                bound = min(bound, owner_limit)
            mine = self._pinned.get(entry.owner, 0)
            if mine + entry.accounted > bound or self._pinned_total + entry.accounted > size // 2:
                return False
            entry.pinned = True
            self._pinned[entry.owner] = mine + entry.accounted
            self._pinned_total += entry.accounted
            self.policy.removed(key)
            return True

    def _owner_bound(self, owner: str, size: int) -> int:
        """Bytes `owner` may hold pinned under a budget of `size` (never more than all owners together)."""
        total = size // 2
        return total if self.owner_pin_limit is None else min(total, self.owner_pin_limit(owner, size))

    def _uncount_pin(self, entry: Entry) -> None:
        """Under the lock: take pinned `entry`'s bytes off its owner's pinned bytes (unpinned, or removed: a
        removed entry keeps its flag, which the disk tier keeps for when it comes back)."""
        self._pinned_total -= entry.accounted
        left = self._pinned[entry.owner] - entry.accounted
        if left:
            self._pinned[entry.owner] = left
        else:
            del self._pinned[entry.owner]

    def _unpin_to(self, size: int) -> int:
        """Under the lock: unpin until every owner's pinned bytes are within its bound under a budget of `size`
        and all owners' within half of it, so capacity eviction always has room. The deepest chunks go first
        (an owner's own, for its bound; anyone's, least recently used first among equals, for the total): what
        stays pinned is still whole prefixes from the root. An unpinned chunk goes back to the eviction policy,
        as a promoted one does (with its hits), and may be evicted like any other. Returns the chunks unpinned."""
        if not self._pinned_total:
            return 0
        total = size // 2
        bounds = {owner: self._owner_bound(owner, size) for owner in self._pinned}
        if self._pinned_total <= total and all(self._pinned[o] <= b for o, b in bounds.items()):
            return 0
        pinned = sorted((e for e in self._entries.values() if e.pinned), key=lambda e: (-e.index, e.last_access))
        unpinned = []
        for entry in pinned:  # each owner within its own bound
            if self._pinned.get(entry.owner, 0) > bounds[entry.owner]:
                self._uncount_pin(entry)
                entry.pinned = False
                unpinned.append(entry)
        for entry in pinned:  # all of them within half the budget
            if self._pinned_total <= total:
                break
            if entry.pinned:
                self._uncount_pin(entry)
                entry.pinned = False
                unpinned.append(entry)
        for entry in reversed(unpinned):  # root first: a prefix-aware policy sees each parent before its children
            self.policy.inserted(entry.key, entry.nbytes, entry.parent)
            if entry.hits and hasattr(self.policy, "restored"):
                self.policy.restored(entry.key, entry.hits)
        return len(unpinned)

    def is_pinned(self, key: bytes, fingerprint: bytes) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.fingerprint == fingerprint and entry.pinned

    def pinned_usage(self) -> dict[str, int]:
        with self._lock:
            return dict(self._pinned)

    def room(self) -> int:
        """Bytes that can be reserved now without evicting anything (warm-up fills only this)."""
        with self._lock:
            return self._limit() - self._committed()

    def room_for(self, nbytes: int) -> bool:
        with self._lock:
            return self._committed() + self.accounted(nbytes) <= self._limit()

    def snapshot(self) -> list[Entry]:
        """The entries stored now (a consistent copy of the index; no policy side effects)."""
        with self._lock:
            return list(self._entries.values())

    def measured_bytes(self) -> int:
        """Bytes actually held by stored tensors, read from torch, not from our own counters."""
        with self._lock:
            return sum(e.data.untyped_storage().nbytes() for e in self._entries.values())

    def rounded(self, nbytes: int) -> int:
        """`nbytes` as this tier's allocator holds them (a CUDA tier rounds up to CUDA_BLOCK)."""
        return -(-nbytes // self._round) * self._round

    def accounted(self, nbytes: int) -> int:
        """What a chunk of `nbytes` is counted for in the budget: its bytes as allocated, plus the per-chunk overhead
        (--chunk-overhead-bytes, KV events' token ids). Tenancy's quotas count the same."""
        return self.rounded(nbytes) + self._entry_overhead


    def _committed(self) -> int:
        return self._used + self._reserved + self._draining

    def _limit(self) -> int:
        """What committed bytes must stay under for a new reservation: the budget, or a pending shrink's size."""
        return self._budget if self._shrinking_to is None else self._shrinking_to

    def _give_back(self, data: torch.Tensor | None, protectable: bool = False, read_only: bool = False,
                   array: np.ndarray | None = None, memfd: SealedChunk | None = None) -> None:
        """Under the lock: keep a chunk's memory that nobody reads any more for the next chunk of its size
        (host_buffer makes it writable again if it is read-only). A sealed memfd is let go: a client may have
        mapped it."""
        if data is None or not self._recycle or (memfd is not None and memfd.sealed):
            return
        n = data.numel()
        if self._free_bytes + n + self._committed() > self._budget:
            return  # the budget's worth is held already: let it go back to the system
        self._free.setdefault(n, []).append((data, array, protectable, read_only, memfd))
        self._free_bytes += n

    def _drop_free(self) -> None:
        self._free.clear()
        self._free_bytes = 0

    def _let_go(self) -> None:
        """Under the lock, after reserved or draining bytes went down (or reserved became used)."""
        if self._shrinking_to is not None:
            self._drained.notify_all()

    # --- eviction ---------------------------------------------------------------------------------------
    def _remove(self, entry: Entry, reason: str) -> None:
        """Drop `entry` from the index; its bytes stay accounted while a reader still holds a lease."""
        del self._entries[entry.key]
        self.policy.removed(entry.key)
        if entry.pinned:
            self._uncount_pin(entry)
        self._used -= entry.accounted
        entry.evicted = True
        if entry.leases:
            self._draining += entry.accounted
        age = self.clock() - entry.created
        for listener in self._listeners:
            listener.removed(entry, reason, age)  # (a demotion copies the bytes before it returns)
        if not entry.leases and entry.recyclable:
            self._give_back(entry.data, entry.protectable, entry.immutable, entry._array, entry.memfd)

    def _queue_expiry(self, entry: Entry) -> None:
        """Under the lock: put `entry` in the expiry heap at its current expiry (superseding any earlier item)."""
        entry.queued_expiry = entry.expires
        self._expiry.push(entry.key, entry.expires, len(self._entries), self._live_expiries)

    def _live_expiries(self):
        for e in self._entries.values():  # (what the rebuilt heap holds: each entry's item is its current one)
            e.queued_expiry = e.expires
            yield e.key, e.expires

    def _expire(self, now: float) -> int:
        """Under the lock: remove every entry whose expiry has passed; O(log n) per item due, nothing when none is."""
        expired = 0
        for key, at in self._expiry.pop_due(now):
            e = self._entries.get(key)
            if e is None or at != e.queued_expiry:
                continue  # left the tier, or queued again since (an entry under the key since: its own item)
            if e.expires > now:
                self._queue_expiry(e)  # a hit extended it
                continue
            self._remove(e, "ttl")
            expired += 1
        return expired

    def expire(self) -> int:
        with self._lock:
            return self._expire(self.clock())

    def _make_room(self, need: int) -> int:
        evicted = 0
        while self._committed() + need > self._limit():
            victim = self.policy.victim()
            if victim is None:
                return evicted
            self._remove(self._entries[victim], "capacity")
            evicted += 1
        return evicted

    # --- writes -----------------------------------------------------------------------------------------
    def reserve(self, nbytes: int, key: bytes, parent: bytes) -> Reservation:
        accounted = self.accounted(nbytes)
        with self._lock:
            limit = self._limit()
            if accounted > limit:
                raise ChunkTooLarge(f"chunk of {nbytes} bytes exceeds the memory budget of {limit} bytes")
            if self._committed() + accounted > limit:
                self._expire(self.clock())
            if self._committed() + accounted > limit:
                if not self.policy.admit(key, nbytes, parent):
                    raise AdmissionRejected("admission policy kept the cached entries")
                self._make_room(accounted)
            if self._committed() + accounted > limit:
                raise NoRoom(f"no room for {nbytes} bytes: {self._reserved} bytes reserved by Puts and "
                             f"{self._draining} bytes held by Gets in flight, budget {limit}")
            self._reserved += accounted
            return Reservation(nbytes, accounted)

    def release(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.done:
                reservation.done = True
                self._reserved -= reservation.accounted
                self._let_go()
                self._give_back(reservation.host, reservation.protectable, array=reservation.array,
                                memfd=reservation.memfd)

    def host_buffer(self, reservation: Reservation) -> torch.Tensor:
        """Host memory to receive the reserved chunk into (a CPU tier stores this very tensor)."""
        kept = None
        with self._lock:
            free = self._free.get(reservation.nbytes)
            if free:
                kept = free.pop()
                self._free_bytes -= reservation.nbytes
        if kept is not None:
            host, array, protectable, read_only, memfd = kept
            if not read_only or protect(host.data_ptr(), host.numel(), writable=True):
                reservation.host, reservation.array, reservation.protectable = host, array, protectable
                reservation.memfd = memfd
        if reservation.host is None:
            if self.host_memory is not None:
                reservation.host, reservation.memfd = self.host_memory.allocate(reservation.nbytes)
            elif self._protected is not None:
                reservation.host, reservation.protectable = self._protected.allocate(reservation.nbytes)
            else:
                reservation.host = torch.empty(reservation.nbytes, dtype=torch.uint8)
        if reservation.array is None:
            reservation.array = reservation.host.numpy()
        return reservation.host

    def commit(self, reservation: Reservation, *, key: bytes, fingerprint: bytes, parent: bytes, index: int,
               data: torch.Tensor, checksum_value: int, shape: tuple[int, ...], dtype: int,
               ttl: float | None = None, born: float | None = None, owner: str = "",
               values_finite: bool = False, hits: int = 0, last_access: float | None = None,
               sliding_ttl: float | None = None) -> bool:
        """Insert a fully received, verified chunk (living `ttl` seconds, default the tier's TTL; a chunk
        promoted from disk keeps what it had left and its birth time `born`, so its maximum lifetime counts from
        its first store), charged to `owner`; `hits` and `last_access` (memory clock) carry how hot it was in the
        tier it comes from; `sliding_ttl`: its own TTL from now on (a retention hint; None: the tier's). False if
        an equal key won the race (bytes released).
        A chunk stored in its reservation's memfd is sealed at its first read (seal; memfd.py), not here."""
        memfd = reservation.memfd if data is reservation.host and reservation.memfd is not None else None
        protectable = data is reservation.host and reservation.protectable
        immutable = False  # made read-only, and sealed, once a reader has verified it where it lies (seal)
        now = self.clock()
        # Times that are not finite (a forged record's) count as not given: no entry outlives its TTL and lifetime.
        ttl = ttl if ttl is None or math.isfinite(ttl) else None
        born = born if born is None or math.isfinite(born) else None
        last_access = last_access if last_access is None or math.isfinite(last_access) else None
        sliding_ttl = sliding_ttl if sliding_ttl is None or math.isfinite(sliding_ttl) else None
        with self._lock:
            if reservation.done:
                raise RuntimeError("reservation already released")
            reservation.done = True
            self._reserved -= reservation.accounted
            self._let_go()  # reserved became used (or was dropped): a shrink can now evict it
            existing = self._entries.get(key)
            own = data is reservation.host  # memory host_buffer gave it
            if existing is not None and existing.fingerprint != fingerprint:
                # A key is derived from its fingerprint: an entry under it that names another one came from a forged
                # or damaged record (a snapshot, the disk tier) and blocked this prefix for good; the chunk computed
                # for the key replaces it.
                self._remove(existing, "checksum")
                existing = None
            if existing is not None and existing.expires > now:
                if own:
                    self._give_back(data, protectable, immutable, reservation.array, memfd)
                return False
            if existing is not None:
                self._remove(existing, "ttl")
            born = now if born is None else born
            entry = Entry(key, fingerprint, parent, index, data, checksum_value, shape, dtype, now,
                          min(now + (self.ttl if ttl is None else ttl), born + self.max_lifetime),
                          reservation.accounted, last_access=now if last_access is None else min(last_access, now),
                          memfd=memfd, born=born, owner=owner, values_finite=values_finite, hits=hits,
                          ttl=sliding_ttl, recyclable=own and self._recycle, protectable=protectable,
                          immutable=immutable, _array=reservation.array if data is reservation.host else None)
            self._entries[key] = entry
            self._queue_expiry(entry)
            self._used += entry.accounted
            self.policy.inserted(key, entry.nbytes, parent)
            if hits and hasattr(self.policy, "restored"):
                self.policy.restored(key, hits)
            for listener in self._listeners:
                listener.inserted(entry)
            return True

    # --- reads ------------------------------------------------------------------------------------------
    def _live(self, key: bytes, fingerprint: bytes, now: float, requested: bool = True) -> Entry | None:
        """Under the lock: the unexpired entry for `key` under `fingerprint` (an expired one is removed).
        `requested`: tell the eviction policy a client asked for it (once per chunk of a client's request: the
        policies read these as the reference stream, as the trace replay feeds them)."""
        if requested:
            self.policy.requested(key)
        entry = self._entries.get(key)
        if entry is None or entry.fingerprint != fingerprint:
            return None
        if entry.expires <= now:
            self._remove(entry, "ttl")
            return None
        return entry

    def holds(self, key: bytes, fingerprint: bytes) -> bool:
        """Whether a live entry for `key` is stored, as a Put asks before sending a chunk: not a request for it,
        so the eviction policy is not told (a reuse signal it must not count)."""
        now = self.clock()
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.fingerprint == fingerprint and entry.expires > now

    def peek(self, key: bytes, fingerprint: bytes, requested: bool = True) -> Entry | None:
        """The live entry for `key` under `fingerprint`, without leasing it."""
        now = self.clock()
        with self._lock:
            return self._live(key, fingerprint, now, requested)

    def lease(self, key: bytes, fingerprint: bytes) -> Entry | None:
        """Lease the live entry for reading without it counting as a hit (an export): no policy access, no
        change to its expiry or hit count. Give it back with release_lease."""
        now = self.clock()
        with self._lock:
            entry = self._live(key, fingerprint, now, False)
            if entry is not None:
                entry.leases += 1
            return entry

    def acquire(self, key: bytes, fingerprint: bytes, requested: bool = True) -> Entry | None:
        """Lease the entry for reading: its bytes stay accounted until release(). `requested` False: the client's
        request for this chunk was counted already (a promotion after a miss, a Get after the caller's Lookup)."""
        now = self.clock()
        with self._lock:
            entry = self._live(key, fingerprint, now, requested)
            if entry is None:
                return None
            entry.leases += 1
            entry.last_access = now
            entry.hits += 1
            entry.expires = min(now + (self.ttl if entry.ttl is None else entry.ttl),  # a hit extends its life
                                self.birth(entry) + self.max_lifetime)
            if entry.expires < entry.queued_expiry:  # (a TTL hint shorter than what it had left): due sooner
                self._queue_expiry(entry)
            self.policy.accessed(key)
            return entry

    @staticmethod
    def birth(entry: Entry) -> float:
        return entry.created if entry.born is None else entry.born

    def release_lease(self, entry: Entry) -> None:
        with self._lock:
            entry.leases -= 1
            if entry.evicted and entry.leases == 0:
                self._draining -= entry.accounted
                self._let_go()
                if entry.recyclable:
                    self._give_back(entry.data, entry.protectable, entry.immutable, entry._array, entry.memfd)

    def seal(self, entry: Entry) -> None:
        """A reader (holding a lease) verified `entry`'s own memory against its checksum: make that memory read-only
        if it can be (ProtectedMemory; a memfd is sealed too, memfd.py), so later Gets send it without hashing it
        again and a stray write faults instead of corrupting it. Done on the first verified read rather than at
        commit: making 1 MiB read-only and writable again costs about as much CPU as hashing it (~35 us each way,
        measured), so a chunk that is never read pays neither, and its memory goes to the next chunk when it is
        evicted. A lend seals the memfd before that read (bulk.LendSink): what the client maps is what was
        verified."""
        if entry.memfd is not None:
            if not entry.immutable and entry.memfd.seal():
                entry.memfd.verified()
                entry.immutable = entry.memfd.immutable
        elif entry.protectable and not entry.immutable and not entry.evicted:
            entry.immutable = protect(entry.data.data_ptr(), entry.data.numel(), writable=False)

    def drop_corrupt(self, entry: Entry) -> None:
        with self._lock:
            if self._entries.get(entry.key) is entry:
                self._remove(entry, "checksum")

    # --- bulk operations --------------------------------------------------------------------------------
    def delete(self, keys: list[bytes], fingerprint: bytes, reason: str = "delete") -> int:
        with self._lock:
            victims = [e for k in keys if (e := self._entries.get(k)) is not None and e.fingerprint == fingerprint]
            for e in victims:
                self._remove(e, reason)
            return len(victims)

    def purge(self, fingerprint: bytes) -> tuple[int, int]:
        with self._lock:
            victims = [e for e in self._entries.values() if e.fingerprint == fingerprint]
            for e in victims:
                self._remove(e, "purge")
            return len(victims), sum(e.nbytes for e in victims)

    def _evict_to(self, size: int) -> int:
        """Evict by policy until what is stored and reserved fits in `size`; bytes of evicted entries that
        readers still lease (draining) are left to their leases."""
        evicted = 0
        pinned = None  # collected once, deepest last, when the policy has nothing left to offer
        while self._used + self._reserved > size:
            victim = self.policy.victim()
            if victim is None:
                # pins are hints: where Puts in flight hold more than the room pins leave (_unpin_to kept them
                # within the new size's bounds), a shrink evicts pinned chunks too (deepest first)
                if pinned is None:
                    pinned = sorted((e for e in self._entries.values() if e.pinned), key=lambda e: e.index)
                if not pinned:
                    break
                self._remove(pinned.pop(), "capacity")
                evicted += 1
                continue
            self._remove(self._entries[victim], "capacity")
            evicted += 1
        return evicted

    def resize(self, budget_bytes: int, wait_seconds: float = 0.0) -> ResizeOutcome:
        """Set a new budget. A grow applies at once. A shrink admits new reservations only under the new size
        from now on, evicts by policy until stored + reserved bytes fit, and waits up to `wait_seconds` for the
        Puts in flight to finish (reserved) and for readers of evicted entries to let go (draining), evicting
        what those Puts store. Pinned chunks over the new size's bounds (half of it in all, each owner's
        owner_pin_limit) are unpinned first, deepest first, and are then evictable like any other. Only when
        committed bytes are under the new size does it become the budget; if the wait runs out, the budget stays
        as it was (ResizeOutcome.done False, what is still held is reported) and the entries evicted (or unpinned)
        meanwhile stay so."""
        if budget_bytes <= 0:
            raise ValueError("budget must be positive")
        with self._resize_lock, self._lock:
            previous = self._budget
            started = time.monotonic()
            evicted = self._expire(self.clock())
            if budget_bytes >= previous:
                self._budget = budget_bytes
                if hasattr(self.policy, "resize"):  # size-proportioned policies re-split their segments
                    self.policy.resize(budget_bytes)
                return self._outcome(previous, budget_bytes, True, evicted, 0.0)
            if hasattr(self.policy, "resize"):
                self.policy.resize(budget_bytes)
            self._drop_free()  # what a shrink frees goes back to the system
            self._shrinking_to = budget_bytes  # (new pins are bounded by it too: pin)
            # Pins within the new size's bounds first (half of it, each owner's --max-pinned-fraction), so that
            # capacity eviction has room after the shrink; what is unpinned is evictable from now on.
            unpinned = self._unpin_to(budget_bytes)
            done = False
            try:
                deadline = started + wait_seconds
                while True:
                    evicted += self._evict_to(budget_bytes)
                    if self._committed() <= budget_bytes:
                        self._budget, done = budget_bytes, True
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._drained.wait(remaining)
            finally:
                self._shrinking_to = None
                if not done and hasattr(self.policy, "resize"):
                    self.policy.resize(previous)
            return self._outcome(previous, budget_bytes, done, evicted, time.monotonic() - started, unpinned)

    def _outcome(self, previous: int, requested: int, done: bool, evicted: int, waited: float,
                 unpinned: int = 0) -> ResizeOutcome:
        return ResizeOutcome(previous, requested, done, evicted, self._used, self._committed(), self._reserved,
                             self._draining, waited, unpinned)
