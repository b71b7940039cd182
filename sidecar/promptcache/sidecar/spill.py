"""The two tiers together: capacity evictions from memory are demoted to the disk tier; a hit on disk is promoted
back into memory (and removed from disk, so a chunk is held in one tier at a time).

The disk record's meta carries what the memory tier needs to serve the chunk again: the fingerprint (first, so
`DiskTier.purge(fingerprint)` works), the chunk index, the parent key, the logical shape and dtype, and the
chunk's own xxh3 checksum (verified again after the disk tier's own check, before the chunk is served).

Quotas: a promoted chunk is charged to its owner like a Put. The owner need not be stored on disk: the
fingerprint is derived from the owner's namespace (docs/keys.md, tenancy.py), so the caller that names the
chunk's fingerprint is acting for its owner. A promotion never evicts to make room: when the owner's quota has
no room, the chunk is served from the disk copy for this call only and stays on disk (evicting the owner's other
chunks would drop them from both tiers, and reading a long prefix would then destroy its own head).
"""
from __future__ import annotations

import logging
import struct
import time

import numpy as np
import torch

from promptcache.sidecar.disk import DiskTier
from promptcache.sidecar.store import Entry, MemoryTier, StoreError, StoreListener, checksum

log = logging.getLogger("promptcache.sidecar.spill")

_META = struct.Struct("<32s32sIBBQ")  # fingerprint, parent, index, dtype, ndim, checksum; then ndim x u32 shape


def encode_meta(entry: Entry) -> bytes:
    return _META.pack(entry.fingerprint, entry.parent, entry.index, entry.dtype, len(entry.shape), entry.checksum) \
        + struct.pack(f"<{len(entry.shape)}I", *entry.shape)


def decode_meta(meta: bytes) -> tuple[bytes, bytes, int, int, int, tuple[int, ...]] | None:
    if len(meta) < _META.size:
        return None
    fp, parent, index, dtype, ndim, value = _META.unpack_from(meta)
    if len(meta) != _META.size + 4 * ndim:
        return None
    return fp, parent, index, dtype, value, struct.unpack_from(f"<{ndim}I", meta, _META.size)


class Spill(StoreListener):
    def __init__(self, memory: MemoryTier, disk: DiskTier, metrics=None, tenancy=None):
        self.memory = memory
        self.disk = disk
        self.metrics = metrics
        self.tenancy = tenancy  # promptcache.sidecar.tenancy.Tenancy: promotions are charged to the owner's quota

    # --- memory -> disk ---------------------------------------------------------------------------------
    def removed(self, entry: Entry, reason: str, age: float) -> None:
        """The memory tier's hook: what it evicts for room goes to disk (expired or deleted chunks do not)."""
        if reason == "capacity":
            self.demote(entry)

    def demote(self, entry: Entry) -> bool:
        """Called for a capacity eviction (under the memory tier's lock: the disk tier only queues the write)."""
        now = self.memory.clock()
        remaining = entry.expires - now
        if remaining <= 0:
            return False
        host = entry.data if entry.data.device.type == "cpu" else entry.data.cpu()
        # The disk keeps what is left of its sliding TTL and when it was born (in wall time, across restarts).
        born = self.disk.clock() - (now - self.memory.birth(entry))
        # How hot it was (warm-up brings the hottest back first) and whose quota it is charged to.
        last = self.disk.clock() - (now - entry.last_access)
        taken = self.disk.put(entry.key, host.numpy(), meta=encode_meta(entry), parent=entry.parent,
                              ttl_seconds=remaining, created=born, last_access=last, hits=entry.hits,
                              owner=entry.owner, ttl_hint=entry.ttl)
        if self.metrics is not None:
            (self.metrics.demotions if taken else self.metrics.demotion_failures).inc()
        return taken

    def demote_all(self) -> int:
        """On a graceful shutdown: everything still in memory goes to disk, so a restart keeps it."""
        return sum(self.demote(e) for e in self.memory.snapshot())

    # --- disk -> memory ---------------------------------------------------------------------------------
    def contains(self, key: bytes, fingerprint: bytes) -> int | None:
        """The payload size when the disk tier holds `key` under `fingerprint`, else None."""
        meta = self.disk.meta(key)
        decoded = decode_meta(meta) if meta is not None else None
        if decoded is None or decoded[0] != fingerprint:
            return None
        entry = self.disk.index.get(key) or (self.disk.pending.get(key) or (None,))[0]
        return entry.length if entry is not None else None

    def promote(self, key: bytes, fingerprint: bytes, owner: str = "") -> Entry | None:
        """A leased entry for `key` read back from disk (release it with memory.release_lease), or None.
        `owner` (the caller's namespace owner, who owns every chunk under `fingerprint`) is charged for it."""
        meta = self.disk.meta(key)
        decoded = decode_meta(meta) if meta is not None else None
        if decoded is None or decoded[0] != fingerprint:
            return None
        fp, parent, index, dtype, value, shape = decoded
        disk_entry = self.disk.index.get(key) or (self.disk.pending.get(key) or (None,))[0]
        payload = self.disk.get(key)
        if payload is None or disk_entry is None:
            return None
        remaining = disk_entry.expires - self.disk.clock()
        born = self.memory.clock() - (self.disk.clock() - disk_entry.created)  # its age, in the memory clock
        if born + self.memory.max_lifetime <= self.memory.clock():  # past its maximum lifetime (a lowered one)
            self.disk.delete(key)
            return None
        raw = np.frombuffer(payload, dtype=np.uint8)
        if checksum(raw) != value:
            self.disk.delete(key)
            if self.metrics is not None:
                self.metrics.checksum_failures.labels("disk").inc()
            log.error("disk chunk failed its checksum after read and was dropped", extra={"key": key.hex()})
            return None
        charged = self.tenancy.charge_if_room(owner, raw.size) if self.tenancy is not None else 0
        if charged is None:  # the owner's quota is full: serve this copy, keep the chunk on disk
            now = self.memory.clock()
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            return Entry(key, fp, parent, index, data, value, shape, dtype, now, now, 0, leases=1, evicted=True)
        try:
            reservation = self.memory.reserve(raw.size, key, parent)
        except StoreError:
            # No room in memory right now: serve it from this copy, held only for the call and not cached.
            if self.tenancy is not None:
                self.tenancy.release(owner, charged)
            now = self.memory.clock()
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            return Entry(key, fp, parent, index, data, value, shape, dtype, now, now, 0, leases=1, evicted=True)
        data = self.memory.host_buffer(reservation)
        data.numpy()[:] = raw
        device_data = data if self.memory.device.type == "cpu" else data.to(self.memory.device)
        self.memory.commit(reservation, key=key, fingerprint=fp, parent=parent, index=index, data=device_data,
                           checksum_value=value, shape=shape, dtype=dtype, ttl=max(remaining, 0.001), born=born,
                           owner=owner, hits=disk_entry.hits, sliding_ttl=disk_entry.ttl_hint or None)
        if self.tenancy is not None:
            self.tenancy.release(owner, charged)
        self.disk.delete(key)
        if self.metrics is not None:
            self.metrics.promotions.inc()
        entry = self.memory.acquire(key, fp, requested=False)  # the miss before this promotion counted it
        if entry is None:  # evicted again at once by a concurrent writer: serve this copy
            now = time.monotonic()
            return Entry(key, fp, parent, index, data, value, shape, dtype, now, now, 0, leases=1, evicted=True)
        return entry

    def warm(self, key: bytes) -> int:
        """Warm-up: move `key` from disk into memory if it fits without evicting anything and within its owner's
        quota (the owner recorded with it). Returns the bytes moved (0: not moved: gone, expired, past its
        lifetime, failed a checksum, or no room). Its hit count and last access come with it."""
        disk_entry = self.disk.entry(key)
        decoded = decode_meta(disk_entry.meta) if disk_entry is not None else None
        if decoded is None:
            return 0
        fp, parent, index, dtype, value, shape = decoded
        if self.memory.holds(key, fp):
            return 0
        if index and not self.memory.holds(parent, fp):  # unreachable without its parent: not worth a byte
            return 0
        if not self.memory.room_for(disk_entry.length):
            return 0
        now_disk, now = self.disk.clock(), self.memory.clock()
        born = now - (now_disk - disk_entry.created)
        if born + self.memory.max_lifetime <= now:
            self.disk.delete(key)
            return 0
        owner = disk_entry.owner
        charged = self.tenancy.charge_if_room(owner, disk_entry.length) if self.tenancy is not None else 0
        if charged is None:
            return 0
        try:
            payload = self.disk.get(key)
            if payload is None or len(payload) != disk_entry.length:
                return 0
            raw = np.frombuffer(payload, dtype=np.uint8)
            if checksum(raw) != value:
                self.disk.delete(key)
                if self.metrics is not None:
                    self.metrics.checksum_failures.labels("disk").inc()
                return 0
            try:
                reservation = self.memory.reserve(raw.size, key, parent)
            except StoreError:
                return 0
            data = self.memory.host_buffer(reservation)
            data.numpy()[:] = raw
            device_data = data if self.memory.device.type == "cpu" else data.to(self.memory.device)
            last = now - max(0.0, now_disk - (disk_entry.last_access or disk_entry.created))
            stored = self.memory.commit(reservation, key=key, fingerprint=fp, parent=parent, index=index,
                                        data=device_data, checksum_value=value, shape=shape, dtype=dtype,
                                        ttl=max(disk_entry.expires - now_disk, 0.001), born=born, owner=owner,
                                        hits=disk_entry.hits, last_access=last,
                                        sliding_ttl=disk_entry.ttl_hint or None)
        finally:
            if self.tenancy is not None and charged:
                self.tenancy.release(owner, charged)
        if not stored:
            return 0
        self.disk.delete(key)
        return raw.size

    def delete(self, keys: list[bytes], fingerprint: bytes) -> int:
        return sum(self.disk.delete(k) for k in keys if self.contains(k, fingerprint) is not None)

    def purge(self, fingerprint: bytes) -> int:
        return self.disk.purge(fingerprint)

    def usage(self) -> dict[str, int]:
        s = self.disk.stats()
        return {"entries": s["entries"], "used": s["bytes_used"], "budget": s["budget_bytes"],
                "disk_full": int(s["disk_full"]), "queued": s["queued_bytes"]}
