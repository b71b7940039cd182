"""The cluster tier: chunks shared between sidecars (nodes) through Mooncake Store (docs/cluster.md).

A local miss (memory and disk) asks the cluster before it is reported; a cluster hit is verified and promoted
into this node's memory tier. Every chunk committed by a Put is published, off the critical path: a bounded
queue drained by one thread, full → dropped and counted. Write policy: every committed chunk, once per node
(a chunk promoted from the cluster is not published again); Mooncake's own eviction bounds what the cluster keeps.

The store logic never sees Mooncake: it talks to a `ClusterStore` (put, get, close), and `MooncakeStore` is the
one adapter. A record is the chunk's bytes behind a header naming the key it is published under, the
fingerprint, parent, index, dtype, shape, xxh3 checksum and the absolute expiry (Unix time, since monotonic clocks
differ between nodes), and an xxh3 of the header itself: the key is our chained SHA-256 chunk key (tenant salts
included); the record's own key, fingerprint and checksums are verified before serving (a record copied under
another key is refused), and an expired record is a miss. Nothing here is authenticated: whoever can write the
store can forge a record that passes every check (docs/security.md, "The cluster tier").
The cluster is written by other nodes, so a record is checked as a Put's bytes are before it is served or
promoted: its dtype, shape and size against the requesting model's layout (or, where no model is known, e.g.
warm-up, against its own header), its values finite where its dtype is scanned, and its times finite (a record
with a NaN expiry would never expire).

Cluster down or slow: every call has a deadline (--cluster-timeout-seconds); a call that fails or runs out marks
the tier down for --cluster-retry-seconds, during which lookups do not ask it and publishing drops, all counted.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import queue
import struct
import threading
import time
from typing import Callable, Protocol

import numpy as np
import xxhash
from prometheus_client import Counter, Gauge, Histogram

from promptcache.sidecar import hotlist
from promptcache.sidecar.metrics import LATENCY_BUCKETS
from promptcache.sidecar.store import checksum
from promptcache.sidecar.tiers.base import ChunkLayout, Record, layout_refusal

log = logging.getLogger("promptcache.sidecar.cluster")

# Version 3 (written): the header names the chunk key the record was published under, so a record is served only
# for that key (a record copied or misfiled under another key is refused, reason "key"), and a trailing xxh3 of the
# header (with the shape) covers what the payload's checksum does not: times, key, fingerprint, parent, index.
MAGIC_V3 = b"PCC3"
# magic, expires and born (Unix s), key, fingerprint, parent, index, dtype, ndim, xxh3 of the payload
_HEADER_V3 = struct.Struct("<4sdd32s32s32sIBBQ")
_HEADER_SUM = struct.Struct("<Q")  # xxh3_64 of the header and shape before it
# Version 2 (still read, for a rolling upgrade from nodes that write it): no key, no header checksum. Such a
# record is bound to nothing but its fingerprint: a copy under another key of the same model would be served.
MAGIC = b"PCC2"
# magic, expires and born (Unix s), fingerprint, parent, index, dtype, ndim, xxh3
_HEADER = struct.Struct("<4sdd32s32sIBBQ")
MAX_NDIM = 8  # a chunk's shape has 5 dims; a header announcing more is not one of ours
KEY_PREFIX = "promptcache/v1/"


class ClusterError(Exception):
    """The cluster store failed a call (unreachable master, transfer error)."""


class ClusterStore(Protocol):
    def put(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...  # None: not held
    def upsert(self, key: str, value: bytes) -> None: ...  # put, replacing what the key held (hot lists)
    def close(self) -> None: ...


def store_key(key: bytes) -> str:
    return KEY_PREFIX + key.hex()


def encode_record(record: Record, now: float) -> bytes:
    """The wire form (version 3) of `record` at Unix time `now`: its TTL left and its age become absolute times
    (Unix time: monotonic clocks differ between nodes); the header names its key and is checksummed."""
    header = _HEADER_V3.pack(MAGIC_V3, now + record.ttl, now - record.age, record.key, record.fingerprint,
                             record.parent, record.index, record.dtype, len(record.shape), record.checksum)
    header += struct.pack(f"<{len(record.shape)}I", *record.shape)
    return header + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(header)) + bytes(record.payload)


def decode_record(raw: bytes, key: bytes, now: float) -> Record | None:
    """The record in `raw`, fetched under `key`, as at Unix time `now`, or None when it is not one of ours (wrong
    magic, truncated, a header that fails its checksum, a time that is not finite). A version 3 record carries
    the key it was published under (Record.key: verify refuses it for any other key); a version 2 record, which
    names none, is taken as `key`'s."""
    magic = bytes(raw[:4])
    if magic == MAGIC_V3:
        if len(raw) < _HEADER_V3.size:
            return None
        _, expires, born, own_key, fp, parent, index, dtype, ndim, value = _HEADER_V3.unpack_from(raw)
        end = _HEADER_V3.size + 4 * ndim
        start = end + _HEADER_SUM.size
        if ndim > MAX_NDIM or len(raw) < start:
            return None
        if xxhash.xxh3_64_intdigest(bytes(raw[:end])) != _HEADER_SUM.unpack_from(raw, end)[0]:
            return None
        shape_at = _HEADER_V3.size
    elif magic == MAGIC:
        if len(raw) < _HEADER.size:
            return None
        _, expires, born, fp, parent, index, dtype, ndim, value = _HEADER.unpack_from(raw)
        own_key, shape_at = key, _HEADER.size
        start = _HEADER.size + 4 * ndim
        if ndim > MAX_NDIM or len(raw) < start:
            return None
    else:
        return None
    if not (math.isfinite(expires) and math.isfinite(born)):
        return None
    shape = struct.unpack_from(f"<{ndim}I", raw, shape_at)
    return Record(own_key, fp, parent, index, dtype, tuple(shape), value,
                  np.frombuffer(raw, dtype=np.uint8, offset=start), ttl=expires - now, age=now - born)


def verify(record: Record | None, fingerprint: bytes, layout: ChunkLayout | None = None,
           key: bytes | None = None) -> str:
    """Why `record` may not be served for `key` under `fingerprint` ("" when it may): "malformed", "key" (it was
    published under another key: a copy or a misfiled record), "fingerprint", "expired", "checksum", then as a
    Put's bytes are checked (tiers.base.layout_refusal): "layout" (dtype, shape or size not the requesting model's
    `layout`, or, without one, not a chunk's at all) or "nonfinite" (NaN or Inf values). key=None: not checked."""
    if record is None:
        return "malformed"
    if key is not None and record.key != key:
        return "key"
    if record.fingerprint != fingerprint:
        return "fingerprint"
    if not record.ttl > 0:  # (NaN: decode_record refuses it already)
        return "expired"
    if checksum(record.payload) != record.checksum:
        return "checksum"
    return layout_refusal(record, layout)[0]


class MooncakeStore:
    """ClusterStore on a Mooncake Store client (mooncake-transfer-engine): this sidecar joins the cluster and
    contributes `segment_bytes` of its memory to it. `master` is HOST:PORT of one master, or
    etcd://HOST:PORT[;HOST:PORT...] for an HA master set: the client then finds the leader in etcd and follows it
    when a standby takes over (docs/cluster.md)."""

    NOT_FOUND = -704  # mooncake's OBJECT_NOT_FOUND

    def __init__(self, master: str, local_hostname: str, protocol: str, segment_bytes: int, buffer_bytes: int,
                 metadata_server: str = "P2PHANDSHAKE", rdma_devices: str = "", cluster_id: str = "mooncake_cluster"):
        # With an etcd:// master the client follows the leader of the masters started with -cluster_id; Mooncake's
        # client reads that id from its environment only.
        os.environ["MC_STORE_CLUSTER_ID"] = cluster_id
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ClusterError("the cluster tier needs Mooncake: pip install 'promptcache[cluster]' "
                               f"(and Debian libibverbs1): {exc}") from None
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, segment_bytes, buffer_bytes, protocol,
                               rdma_devices, master)
        if rc != 0:
            raise ClusterError(f"cannot join the Mooncake master at {master} (setup returned {rc})")
        # No record we publish is larger than the transfer buffer (ClusterTier.publish drops those), and Mooncake
        # cannot get one that is: a larger record is a miss, refused before any transfer (a peer's 96 MiB record
        # made the client log an allocation failure and return nothing).
        self.max_bytes = buffer_bytes

    def put(self, key: str, value: bytes) -> None:
        rc = self._store.put(key, value)
        if rc != 0:
            raise ClusterError(f"put returned {rc}")

    def get(self, key: str) -> bytes | None:
        size = self._store.get_size(key)
        if size == self.NOT_FOUND:
            return None
        if size < 0:
            raise ClusterError(f"get_size returned {size}")
        if size > self.max_bytes:
            return None  # not a record of ours (nor a failure of the cluster: the tier stays up)
        value = self._store.get(key)
        return value or None  # empty: evicted between the two calls

    def upsert(self, key: str, value: bytes) -> None:
        rc = self._store.upsert(key, value)  # (put keeps an existing key's old value and still returns 0)
        if rc != 0:
            raise ClusterError(f"upsert returned {rc}")

    def close(self) -> None:
        self._store.close()


class ClusterMetrics:
    def __init__(self, registry):
        r = registry
        self.hits = Counter("promptcache_cluster_hits", "chunks a local miss found in the cluster tier (promoted)",
                            registry=r)
        self.misses = Counter("promptcache_cluster_misses", "local misses the cluster tier did not hold either",
                              registry=r)
        self.rejected = Counter("promptcache_cluster_rejected", "cluster records not served, by reason "
                                "(key: published under another key, fingerprint, expired, checksum, malformed, "
                                "layout: dtype, shape or size not the model's, nonfinite: NaN or Inf values)",
                                ["reason"], registry=r)
        self.fallbacks = Counter("promptcache_cluster_fallbacks", "cluster calls not made or failed, so the "
                                 "sidecar behaved as a single node, by operation and reason (timeout, error, down)",
                                 ["op", "reason"], registry=r)
        self.published = Counter("promptcache_cluster_published_chunks", "chunks published to the cluster tier",
                                 registry=r)
        self.publish_dropped = Counter("promptcache_cluster_publish_dropped", "chunks not published, by reason "
                                       "(queue_full, down, error, too_large)", ["reason"], registry=r)
        self.latency = Histogram("promptcache_cluster_call_duration_seconds", "cluster store calls, by operation",
                                 ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.hot_lists = Counter("promptcache_cluster_hot_lists", "hot lists (what a node holds hottest, read by "
                                 "warming nodes) by outcome: published by this node, read at its warm-up, "
                                 "malformed (refused), failed (not published or not read)", ["outcome"], registry=r)
        self.up = Gauge("promptcache_cluster_up", "1 while the cluster tier answers, 0 while it is marked down",
                        registry=r)


class ClusterTier:
    """Deadlines, the down state, the publish queue and the counters around a ClusterStore."""

    def __init__(self, connect: Callable[[], ClusterStore], metrics: ClusterMetrics, timeout_seconds: float,
                 retry_seconds: float, queue_chunks: int, max_record_bytes: int,
                 clock: Callable[[], float] = time.time):
        self._connect = connect
        self.metrics = metrics
        self.timeout = timeout_seconds
        self.retry = retry_seconds
        self.clock = clock
        self.max_record_bytes = max_record_bytes  # the client's transfer buffer: a larger put would fail
        self._store: ClusterStore | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="cluster")
        self._queue: queue.Queue = queue.Queue(maxsize=queue_chunks)
        self._pending = 0  # queued or being published
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="cluster-publish", daemon=True)
        self.metrics.up.set(0)

    def start(self) -> "ClusterTier":
        self._publisher.start()
        threading.Thread(target=self._join, name="cluster-join", daemon=True).start()
        return self

    def wait_joined(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._store is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._store is not None

    # --- state ------------------------------------------------------------------------------------------
    def _mark_down(self, why: str) -> None:
        with self._lock:
            first = self._down_until <= time.monotonic()
            self._down_until = time.monotonic() + self.retry
        self.metrics.up.set(0)
        if first:
            log.warning("cluster tier down: serving locally", extra={"reason": why, "retry_seconds": self.retry})

    def _join(self) -> None:
        """On a thread of its own: join the cluster, retrying every --cluster-retry-seconds until it works."""
        while not self._stop.is_set():
            try:
                store = self._connect()
            except Exception as exc:  # noqa: BLE001 - any failure to join leaves us single-node, for now
                log.warning("cannot join the cluster tier: serving locally", extra={"error": str(exc)})
                self._stop.wait(self.retry)
                continue
            if self._stop.is_set():
                store.close()
                return
            self._store = store
            self.metrics.up.set(1)
            log.info("joined the cluster tier")
            return

    def _available(self) -> ClusterStore | None:
        """The store; None before it joined and while marked down."""
        if self._store is None or time.monotonic() < self._down_until:
            return None
        return self._store

    def _call(self, op: str, fn, *args):
        """fn(*args) on a worker within the deadline; raises ClusterError (counted) on failure or timeout."""
        store = self._available()
        if store is None:
            self.metrics.fallbacks.labels(op, "down").inc()
            raise ClusterError("marked down")
        started = time.perf_counter()
        future = self._calls.submit(fn, store, *args)
        try:
            result = future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            self.metrics.fallbacks.labels(op, "timeout").inc()
            self._mark_down(f"{op} took longer than {self.timeout} s")
            raise ClusterError("timeout") from None
        except Exception as exc:  # noqa: BLE001
            self.metrics.fallbacks.labels(op, "error").inc()
            self._mark_down(f"{op}: {exc}")
            raise ClusterError(str(exc)) from None
        self.metrics.latency.labels(op).observe(time.perf_counter() - started)
        self.metrics.up.set(1)
        return result

    # --- reads ------------------------------------------------------------------------------------------
    def fetch(self, key: bytes, fingerprint: bytes, counted: bool = True,
              layout: ChunkLayout | None = None) -> Record | None:
        """The verified, unexpired record of `key` under `fingerprint`, or None (a miss, or the cluster is
        down or slow: counted either way). `layout`: the requesting model's (None: the record is checked against
        its own header, see verify). counted=False (warm-up): not a local miss, so neither a cluster hit nor a
        miss (a refused record is still counted)."""
        try:
            raw = self._call("get", lambda store, k: store.get(k), store_key(key))
        except ClusterError:
            return None
        if raw is None:
            if counted:
                self.metrics.misses.inc()
            return None
        record = decode_record(raw, key, self.clock())
        why = verify(record, fingerprint, layout, key)
        if why:
            self.metrics.rejected.labels(why).inc()
            if why == "checksum":
                log.error("cluster chunk failed its checksum and was not served", extra={"key": key.hex()})
            elif why == "key":
                log.error("cluster record was published under another key and was not served",
                          extra={"key": key.hex(), "record_key": record.key.hex()})
            elif why in ("layout", "nonfinite"):
                log.error("cluster chunk is not a chunk of the model and was not served",
                          extra={"key": key.hex(), "reason": why, "detail": layout_refusal(record, layout)[1]})
            return None
        if counted:
            self.metrics.hits.inc()
        return record

    def hot_lists(self, max_bytes: int) -> list[tuple[float, list[hotlist.HotEntry]]]:
        """(published, entries) of every slot's hot list that decodes (one cluster call per slot, within the
        deadline each); a slot that is empty, larger than `max_bytes` or malformed is skipped, counted."""
        lists = []
        for slot in range(hotlist.HOT_SLOTS):
            try:
                raw = self._call("get", lambda store, k: store.get(k), hotlist.slot_key(slot))
            except ClusterError:
                self.metrics.hot_lists.labels("failed").inc()
                continue
            if raw is None:
                continue
            try:
                if len(raw) > max_bytes:
                    raise hotlist.HotListError(f"{len(raw)} bytes, more than the bound of {max_bytes}")
                published, entries = hotlist.decode(raw)
            except hotlist.HotListError as exc:
                self.metrics.hot_lists.labels("malformed").inc()
                log.warning("a hot list in the cluster tier was refused", extra={"slot": slot, "error": str(exc)})
                continue
            self.metrics.hot_lists.labels("read").inc()
            lists.append((published, entries))
        return lists

    # --- writes -----------------------------------------------------------------------------------------
    def publish_hot_list(self, slot: int, value: bytes) -> bool:
        """Replace this node's hot list in `slot` (on the caller's thread, within the deadline)."""
        if len(value) > self.max_record_bytes:
            self.metrics.hot_lists.labels("failed").inc()
            return False
        try:
            self._call("upsert", lambda store, k, v: store.upsert(k, v), hotlist.slot_key(slot), value)
        except ClusterError:
            self.metrics.hot_lists.labels("failed").inc()
            return False
        self.metrics.hot_lists.labels("published").inc()
        return True

    def publish(self, key: bytes, make_record: Callable[[], bytes]) -> None:
        """Queue the chunk for publishing (`make_record` runs on the publisher thread); never blocks."""
        if self._available() is None:
            self.metrics.publish_dropped.labels("down").inc()
            return
        with self._lock:
            try:
                self._queue.put_nowait((key, make_record))
            except queue.Full:
                self.metrics.publish_dropped.labels("queue_full").inc()
                return
            self._pending += 1

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                return
            key, make_record = item
            try:
                value = make_record()
                if len(value) > self.max_record_bytes:
                    self.metrics.publish_dropped.labels("too_large").inc()
                    continue
                self._call("put", lambda store, k, v: store.put(k, v), store_key(key), value)
                self.metrics.published.inc()
            except ClusterError:
                self.metrics.publish_dropped.labels("error").inc()
            except Exception:  # noqa: BLE001 - a bug in one record must not stop publishing
                log.exception("cannot publish a chunk")
            finally:
                with self._lock:
                    self._pending -= 1

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until the publish queue is empty (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._pending == 0:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._stop.set()
        self._publisher.join(timeout=2)
        self._calls.shutdown(wait=False, cancel_futures=True)
        store, self._store = self._store, None
        if store is not None and time.monotonic() >= self._down_until:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                log.warning("closing the cluster store failed", exc_info=True)
