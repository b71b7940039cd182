"""The disk tier in the stack: memory's capacity evictions are demoted to RocksDB (promptcache.sidecar.disk), and a
hit there is read back, verified and handed to the stack to promote (and removed from disk: a chunk is held in one
tier at a time).

The disk record's meta carries what memory needs to serve the chunk again: the fingerprint (first, so
`DiskTier.purge(fingerprint)` works), the chunk index, the parent key, the logical shape and dtype, and the
chunk's own xxh3 checksum (verified again after the disk tier's own record check, before the chunk is served).

Quotas: the owner need not be stored on disk for a Get: the fingerprint is derived from the owner's namespace
(docs/keys.md, tenancy.py), so the caller that names the chunk's fingerprint is acting for its owner. Warm-up
charges the owner recorded with the chunk.
"""
from __future__ import annotations

import logging
import struct

import numpy as np

from promptcache.sidecar.disk import DiskTier
from promptcache.sidecar.store import Entry, MemoryTier, checksum
from promptcache.sidecar.tiers.base import LowerTier, Record

log = logging.getLogger("promptcache.sidecar.tiers.disk")

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


class DiskLowerTier(LowerTier):
    name = "disk"
    moves = True
    local = True

    def __init__(self, disk: DiskTier, memory_clock, metrics=None):
        self.disk = disk
        self.memory_clock = memory_clock  # the memory tier's clock: an evicted entry's times are in it
        self.metrics = metrics

    def _live(self, key: bytes, fingerprint: bytes | None):
        e = self.disk.entry(key)
        decoded = decode_meta(e.meta) if e is not None else None
        if decoded is None or (fingerprint is not None and decoded[0] != fingerprint):
            return None, None
        return e, decoded

    def size(self, key: bytes, fingerprint: bytes) -> int | None:
        e, _ = self._live(key, fingerprint)
        return None if e is None else e.length

    def read(self, key: bytes, fingerprint: bytes | None) -> Record | None:
        """(fingerprint None: whatever the record's own is; warm-up only.)"""
        e, decoded = self._live(key, fingerprint)
        if e is None:
            return None
        payload = self.disk.get(key)  # checked against the disk record's own checksum
        if payload is None or len(payload) != e.length:
            return None
        fp, parent, index, dtype, value, shape = decoded
        raw = np.frombuffer(payload, dtype=np.uint8)
        if checksum(raw) != value:
            self.disk.delete(key)
            if self.metrics is not None:
                self.metrics.checksum_failures.labels("disk").inc()
            log.error("disk chunk failed its checksum after read and was dropped", extra={"key": key.hex()})
            return None
        now = self.disk.clock()
        return Record(key, fp, parent, index, dtype, shape, value, raw, ttl=e.expires - now, age=now - e.created,
                      hits=e.hits, idle=max(0.0, now - (e.last_access or e.created)), ttl_hint=e.ttl_hint or None,
                      owner=e.owner, pinned=e.pinned)

    def taken(self, key: bytes, hit: bool) -> None:
        self.disk.delete(key)
        if hit and self.metrics is not None:
            self.metrics.promotions.inc()

    def expired(self, key: bytes) -> None:
        self.disk.delete(key)

    def demote(self, entry: Entry) -> bool:
        """Under the memory tier's lock: the disk tier only queues the write."""
        now = self.memory_clock()
        remaining = entry.expires - now
        if remaining <= 0:
            return False
        host = entry.data if entry.data.device.type == "cpu" else entry.data.cpu()
        # The disk keeps what is left of its sliding TTL and when it was born (in wall time, across restarts),
        # how hot it was (warm-up brings the hottest back first), whose quota it is charged to and whether a
        # priority hint had pinned it (pinned again when it comes back: a restart keeps a hint's pins).
        born = self.disk.clock() - (now - MemoryTier.birth(entry))
        last = self.disk.clock() - (now - entry.last_access)
        taken = self.disk.put(entry.key, host.numpy(), meta=encode_meta(entry), parent=entry.parent,
                              ttl_seconds=remaining, created=born, last_access=last, hits=entry.hits,
                              owner=entry.owner, ttl_hint=entry.ttl, pinned=entry.pinned)
        if self.metrics is not None:
            (self.metrics.demotions if taken else self.metrics.demotion_failures).inc()
        return taken

    def delete(self, keys: list[bytes], fingerprint: bytes) -> int:
        return sum(self.disk.delete(k) for k in keys if self.size(k, fingerprint) is not None)

    def purge(self, fingerprint: bytes) -> int:
        return self.disk.purge(fingerprint)

    def usage(self) -> dict[str, int]:
        s = self.disk.stats()
        return {"entries": s["entries"], "used": s["bytes_used"], "budget": s["budget_bytes"],
                "disk_full": int(s["disk_full"]), "queued": s["queued_bytes"]}

    def close(self) -> None:
        self.disk.close()
