"""The cluster tier in the stack: every chunk a Put stores is published to the fleet's shared store
(promptcache.sidecar.cluster: Mooncake, deadlines, the publish queue), and a miss in memory and on disk asks it.

A Lookup asks the cluster too (the answer says `cluster`, nothing is promoted); the record it fetched is kept
for a few seconds, bounded in bytes, so the Get that follows promotes it without fetching it again. The cluster
keeps its copy after a promotion (other nodes read it), and a promoted chunk is not published again.
Every record fetched must name the key it was fetched under (a copy under another key is refused) and is checked
as a Put's bytes are (cluster.verify), against the layout of the requesting model where the stack knows it
(TierStack.layout_of), else against its own header.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

from promptcache.sidecar import hotlist
from promptcache.sidecar.cluster import ClusterTier, encode_record
from promptcache.sidecar.tiers.base import LowerTier, Record

log = logging.getLogger("promptcache.sidecar.cluster")

RECENT_SECONDS = 5.0  # how long a record fetched by a Lookup waits for its Get
RECENT_BYTES = 64 << 20  # ... and at most this many bytes of them


class ClusterLowerTier(LowerTier):
    name = "cluster"
    moves = False
    local = False
    publishes = True

    def __init__(self, cluster: ClusterTier, recent_bytes: int = RECENT_BYTES, recent_seconds: float = RECENT_SECONDS,
                 monotonic=time.monotonic):
        self.cluster = cluster
        self.recent_bytes, self.recent_seconds, self.monotonic = recent_bytes, recent_seconds, monotonic
        self._recent: collections.OrderedDict[tuple[bytes, bytes], tuple[float, Record]] = collections.OrderedDict()
        self._recent_held = 0
        self._lock = threading.Lock()
        self.layout_of = lambda fingerprint: None  # TierStack.bind_layouts: the models' layouts this node knows

    def bind_layouts(self, layout_of) -> None:
        self.layout_of = layout_of

    # --- reads ------------------------------------------------------------------------------------------
    def _fetch(self, key: bytes, fingerprint: bytes, keep: bool) -> Record | None:
        now = self.monotonic()
        with self._lock:
            kept = self._recent.pop((key, fingerprint), None)
            if kept is not None:
                self._recent_held -= kept[1].nbytes
                fetched, record = kept
                elapsed = now - fetched
                if elapsed <= self.recent_seconds and record.ttl > elapsed:
                    if keep:
                        self._keep_locked(key, fingerprint, fetched, record)
                    return dataclasses.replace(record, ttl=record.ttl - elapsed, age=record.age + elapsed)
        # verified: fingerprint, expiry, checksum, and as a Put's bytes (dtype, shape, size, finite values)
        record = self.cluster.fetch(key, fingerprint, layout=self.layout_of(fingerprint))
        if record is not None and keep:
            with self._lock:
                self._keep_locked(key, fingerprint, now, record)
        return record

    def _keep_locked(self, key: bytes, fingerprint: bytes, fetched: float, record: Record) -> None:
        if record.nbytes > self.recent_bytes:
            return
        self._recent[(key, fingerprint)] = (fetched, record)
        self._recent_held += record.nbytes
        now = self.monotonic()
        while self._recent_held > self.recent_bytes or (
                self._recent and now - next(iter(self._recent.values()))[0] > self.recent_seconds):
            _, (_, old) = self._recent.popitem(last=False)
            self._recent_held -= old.nbytes

    def size(self, key: bytes, fingerprint: bytes) -> int | None:
        record = self._fetch(key, fingerprint, keep=True)
        return None if record is None else record.nbytes

    def read(self, key: bytes, fingerprint: bytes | None) -> Record | None:
        return None if fingerprint is None else self._fetch(key, fingerprint, keep=False)  # (warm-up: disk only)

    # --- writes -----------------------------------------------------------------------------------------
    def stored(self, record: Record) -> None:
        """Queue the chunk a Put stored for publishing; the record is encoded on the publisher thread, its TTL
        counted from now."""
        published = self.cluster.clock()
        self.cluster.publish(record.key, lambda: encode_record(record, published))

    def close(self) -> None:
        self.cluster.close()


class HotListPublisher:
    """Every `seconds`, this node's hot list (hotlist.hot_order of its memory tier: at most the tier's budget of
    chunks, hottest first, ancestors first) replaces the one in its slot of the cluster store, for nodes that warm
    from the cluster (docs/warmup.md). An empty memory tier publishes nothing (it would only erase a list)."""

    def __init__(self, cluster: ClusterTier, memory, name: str, seconds: float, clock=time.time):
        self.cluster, self.memory, self.seconds, self.clock = cluster, memory, seconds, clock
        self.slot = hotlist.slot_of(name)
        # each entry takes at most 64 B of keys, the owner's length and the owner; the list fits one cluster record
        largest = 65 + hotlist.MAX_OWNER_BYTES
        self.max_entries = min(hotlist.MAX_ENTRIES, max(0, cluster.max_record_bytes - 64) // largest)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish_once(self) -> int:
        """Publish now; the number of entries published (0: nothing held, or the call failed)."""
        entries = hotlist.hot_order(self.memory.snapshot(), self.max_entries, self.memory.budget)
        if not entries:
            return 0
        return len(entries) if self.cluster.publish_hot_list(self.slot, hotlist.encode(entries, self.clock())) else 0

    def start(self) -> "HotListPublisher":
        def run():
            while not self._stop.wait(self.seconds):
                try:
                    self.publish_once()
                except Exception:  # noqa: BLE001 - a failed list must not stop the next one
                    log.exception("cannot publish the hot list")

        self._thread = threading.Thread(target=run, name="cluster-hot-list", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
