"""The tier stack: memory first, then each lower tier in order, and the one routine that promotes a chunk from
any of them (a Get's hit below memory, warm-up, a snapshot's records) into memory.

Memory (promptcache.sidecar.store.MemoryTier) is the tier that serves; a lower tier (tiers.base.LowerTier) only
finds, verifies and reads records. Lookup asks each tier without side effects and reports where a chunk is; a Get
promotes it. A promotion is charged to the chunk's owner like a Put and never evicts on its own behalf beyond what
a reservation does: when the owner's quota (or memory) has no room, a Get is served from the record's copy for
that call only, and warm-up skips the chunk. A chunk keeps its age (its maximum lifetime counts from its first
store), what it had left of its TTL, its hits and its own TTL across tiers.

The stack knows the chunk layout (tiers.base.ChunkLayout) of each model this node has seen (note_model, and every
chunk a Put stored), bounded; a record from a tier other nodes write (the cluster) is promoted only when its
dtype, shape and size are that layout's (or, for a model not known here, a chunk's at all): the cluster tier
checks it fully when it fetches it, and promote checks the structure again (no pass over the bytes).
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

import numpy as np
import torch

from promptcache.sidecar.store import Entry, MemoryTier, StoreError, StoreListener
from promptcache.sidecar.tiers.base import ChunkLayout, LowerTier, Record, layout_refusal

log = logging.getLogger("promptcache.sidecar.tiers")

MAX_LAYOUTS = 1024  # fingerprints whose layout is kept (as the engine's resolved models: MAX_KNOWN_MODELS)


class TierStack(StoreListener):
    def __init__(self, memory: MemoryTier, lowers: list[LowerTier] | tuple = (), tenancy=None):
        self.memory = memory
        self.lowers = list(lowers)
        self.publishers = [t for t in self.lowers if t.publishes]  # told of every chunk a Put stores
        self.tenancy = tenancy  # promptcache.sidecar.tenancy.Tenancy: promotions are charged to the owner's quota
        # told of each chunk a promotion or warm-up stored in memory: (key, fingerprint, parent, index, owner,
        # whether it was pinned before it came down)
        self.promoted: Callable[[bytes, bytes, bytes, int, str, bool], None] | None = None
        self._layouts: collections.OrderedDict[bytes, ChunkLayout] = collections.OrderedDict()
        self._layouts_lock = threading.Lock()
        for tier in self.lowers:
            tier.bind_layouts(self.layout_of)
        memory.subscribe(self)  # capacity evictions go down the stack

    # --- the models' layouts ----------------------------------------------------------------------------
    def note_model(self, fingerprint: bytes, spec, chunk_tokens: int) -> None:
        """The chunks of `fingerprint` are `spec`'s (a ModelSpec) at `chunk_tokens`: records of it from a lower
        tier are checked against that layout (the engine calls it when it resolves a model)."""
        self.note_layout(fingerprint, ChunkLayout.of(spec, chunk_tokens))

    def note_layout(self, fingerprint: bytes, layout: ChunkLayout) -> None:
        with self._layouts_lock:
            self._layouts[fingerprint] = layout
            self._layouts.move_to_end(fingerprint)
            while len(self._layouts) > MAX_LAYOUTS:
                self._layouts.popitem(last=False)

    def layout_of(self, fingerprint: bytes) -> ChunkLayout | None:
        """The layout of `fingerprint`'s chunks where this node knows its model, else None."""
        return self._layouts.get(fingerprint)

    def lower(self, name: str) -> LowerTier | None:
        return next((t for t in self.lowers if t.name == name), None)

    # --- finding ----------------------------------------------------------------------------------------
    def where(self, key: bytes, fingerprint: bytes) -> tuple[str, int] | None:
        """(tier name, size) of the first tier holding `key`, or None. Promotes nothing (Lookup)."""
        entry = self.memory.peek(key, fingerprint)
        if entry is not None:
            return "device", entry.nbytes
        for tier in self.lowers:
            size = tier.size(key, fingerprint)
            if size is not None:
                return tier.name, size
        return None

    def held(self, key: bytes, fingerprint: bytes) -> bool:
        """Stored in memory or a local lower tier (a Put's check; not a request the eviction policy counts)."""
        return self.memory.holds(key, fingerprint) or any(
            t.local and t.size(key, fingerprint) is not None for t in self.lowers)

    def acquire(self, key: bytes, fingerprint: bytes, owner: str, requested: bool = True, index: int | None = None,
                parent: bytes | None = None) -> tuple[Entry, str] | None:
        """A leased entry for `key` (release it with memory.release_lease) and the tier it came from, or None.
        A hit below memory is promoted (or served from its copy for this call: see promote). `index` and `parent`
        (None: not known): where the caller's chain puts the chunk; a lower tier's record that says otherwise (a
        forged or misfiled one: its bytes may be the key's, but memory, hot lists and KV events would carry the
        wrong chain) is a miss."""
        entry = self.memory.acquire(key, fingerprint, requested=requested)
        if entry is not None:
            return entry, "device"
        for tier in self.lowers:
            record = tier.read(key, fingerprint)
            if record is not None and ((index is not None and record.index != index)
                                       or (parent is not None and record.parent != parent)):
                log.error("a record was not promoted: its chunk index or parent is not its key's",
                          extra={"key": key.hex(), "tier": tier.name, "index": record.index, "expected": index})
                return None
            if record is not None:
                promoted = self.promote(record, owner, source=tier)
                if promoted is not None:
                    return promoted, tier.name
                return None  # past its lifetime: the prefix ends here, as at a miss
        return None

    # --- the promotion routine --------------------------------------------------------------------------
    def promote(self, record: Record, owner: str, *, source: LowerTier | None = None, serve: bool = True):
        """Store `record` in memory, charged to `owner`.
        serve=True (a Get): returns a leased Entry (None only when the chunk is past its maximum lifetime); when
        there is no room for it (quota or memory) the entry is this copy, held for the call and not cached.
        serve=False (warm-up, snapshots): only when it fits without evicting, is not held yet and its parent is
        (a chunk is unreachable without it); returns the bytes stored (0: not stored)."""
        memory, key, fp, n = self.memory, record.key, record.fingerprint, record.nbytes
        layout = self.layout_of(fp)
        if layout is not None or (source is not None and not source.local):
            # defence in depth: a record of a known model must have its layout, and one from a tier other nodes
            # write must be a chunk at all (the cluster tier checked it fully, values included, when it fetched it)
            why, detail = layout_refusal(record, layout, scan=False)
            if why:
                log.error("a record was not promoted: not a chunk of its model",
                          extra={"key": key.hex(), "tier": getattr(source, "name", ""), "detail": detail})
                return None if serve else 0
        now = memory.clock()
        born = now - max(0.0, record.age)
        if not record.ttl > 0 or born + memory.max_lifetime <= now:  # (NaN: refused)
            if source is not None:
                source.expired(key)
            return None if serve else 0
        if not serve and (memory.holds(key, fp) or not memory.room_for(n)
                          or (record.index and not memory.holds(record.parent, fp))):
            return 0
        charged = self.tenancy.charge_if_room(owner, n) if self.tenancy is not None else 0
        if charged is None:  # the owner's quota is full: serve this copy; the record stays where it is
            return _uncached(record, now) if serve else 0
        try:
            try:
                reservation = memory.reserve(n, key, record.parent)
            except StoreError:  # no room in memory right now
                return _uncached(record, now) if serve else 0
            host = memory.host_buffer(reservation)
            host.numpy()[:] = record.payload
            data = host if memory.device.type == "cpu" else host.to(memory.device)
            stored = memory.commit(
                reservation, key=key, fingerprint=fp, parent=record.parent, index=record.index, data=data,
                checksum_value=record.checksum, shape=record.shape, dtype=record.dtype, ttl=max(record.ttl, 0.001),
                born=born, owner=owner, hits=record.hits,
                last_access=None if serve or record.idle is None else now - max(0.0, record.idle),
                sliding_ttl=record.ttl_hint or None)
        finally:
            if self.tenancy is not None and charged:
                self.tenancy.release(owner, charged)
        if stored and self.promoted is not None:
            self.promoted(key, fp, record.parent, record.index, owner, record.pinned)
        if not serve:
            if stored and source is not None:
                source.taken(key, hit=False)
            return n if stored else 0
        if source is not None:
            source.taken(key, hit=True)
        entry = memory.acquire(key, fp, requested=False)  # the miss before this promotion counted it
        return entry if entry is not None else _uncached(record, now)  # evicted again at once: a copy (its
        # memory may already be another chunk's)

    def warm(self, source: LowerTier, key: bytes) -> int:
        """Warm-up: move `key` from `source` into memory under its recorded owner if it fits without evicting
        (promote, serve=False). Returns the bytes moved."""
        record = source.read(key, None)
        return 0 if record is None else self.promote(record, record.owner, source=source, serve=False)

    # --- down the stack ---------------------------------------------------------------------------------
    def removed(self, entry: Entry, reason: str, age: float) -> None:
        """Memory's hook: what it evicts for room goes to the first lower tier that takes it (expired or deleted
        chunks go nowhere)."""
        if reason == "capacity":
            self.demote(entry)

    def demote(self, entry: Entry) -> bool:
        return any(t.demote(entry) for t in self.lowers)

    def demote_all(self) -> int:
        """On a graceful shutdown: everything still in memory goes down, so a restart keeps it."""
        return sum(self.demote(e) for e in self.memory.snapshot())

    def stored(self, record: Record) -> None:
        """A Put stored `record` in memory (its payload: the received bytes, never written again): its layout is
        its model's (the Put checked it)."""
        if record.fingerprint not in self._layouts:
            layout = ChunkLayout.of_record(record)
            if layout is not None:
                self.note_layout(record.fingerprint, layout)
        for tier in self.publishers:
            tier.stored(record)

    def delete(self, keys: list[bytes], fingerprint: bytes) -> int:
        return self.memory.delete(keys, fingerprint) + sum(t.delete(keys, fingerprint) for t in self.lowers)

    def purge(self, fingerprint: bytes) -> tuple[int, int]:
        count, nbytes = self.memory.purge(fingerprint)
        return count + sum(t.purge(fingerprint) for t in self.lowers), nbytes

    def usages(self) -> dict[str, dict[str, int]]:
        """Each tier's usage by name, memory ("device") first; tiers that report none are left out."""
        out = {"device": self.memory.usage()}
        for tier in self.lowers:
            u = tier.usage()
            if u is not None:
                out[tier.name] = u
        return out


def _uncached(record: Record, now: float) -> Entry:
    """An entry served from a copy of the record for the call only (not in memory; `evicted` so nothing
    announces it)."""
    data = torch.from_numpy(np.array(record.payload, dtype=np.uint8, copy=True))
    return Entry(record.key, record.fingerprint, record.parent, record.index, data, record.checksum, record.shape,
                 record.dtype, now, now, 0, leases=1, evicted=True)
