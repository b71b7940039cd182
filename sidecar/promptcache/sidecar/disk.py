"""Disk tier: KV chunks spilled to a local RocksDB (rocksdict), design and measurements in docs/disk-tier.md.

Standalone: the memory store demotes into it (`put`) and promotes out of it (`get` then `delete`).

* Records. For chunk key K two RocksDB keys are written in one atomic WriteBatch: b"d"+K holds the payload bytes,
  b"i"+K a small index record (header, caller's meta bytes, parent key) that carries an xxh3_64 checksum of the
  payload (seeded with K, so a value can never be served under another key) and one of the index record itself.
  `get` verifies the payload before returning it; a record that fails is deleted, counted and never served.
* Restart. `open` scans only the b"i" records (small) to rebuild the in-memory index; records that fail their
  checksum or are expired are dropped and counted. Atomic batches plus the WAL's point-in-time recovery mean a
  kill -9 loses at most the writes still queued; it never leaves a half record that would be served.
* Budget. Bytes are reserved when a put is accepted (payload + meta + a fixed per-record overhead), victims are
  removed from the index and their deletes queued *before* the put, so neither the index nor the committed
  database ever holds more than the budget. RocksDB's own files (WAL, blobs awaiting GC) are not part of it.
* Off the serving path. `put` only reserves and queues (bounded by bytes and count: when full, the put is refused
  rather than blocking the caller); one writer thread batches the RocksDB writes. Queued chunks are served from
  the queue until written.
* Disk full. When free space falls below `min_free_bytes` or RocksDB reports an I/O error, spilling stops
  (`disk_full` flag, a counter, one log line). Deleted records give their space back to the filesystem only once
  RocksDB flushes and compacts them away, so the writer does that after enough deletes (and at once while full);
  after a RocksDB write error it reopens the database (the only way out of RocksDB's read-only error state) and
  deletes whatever the index no longer holds. While full it looks at the free space every second and resumes
  spilling when it is back above `min_free_bytes`.
* One owner. RocksDB's LOCK file keeps a second process off the folder; `DiskTier` waits for it up to
  `lock_wait_seconds` (a rolling update overlaps two pods briefly) and then raises DiskTierError naming the
  holder. A held lock is never mistaken for corruption: only files RocksDB cannot read are repaired or moved aside.
* TTL. Each record carries its absolute expiry; expired records are never served and are swept in the background.
* Bloom filters are on (10 bits/key, on the SST key space); large values live in RocksDB blob files
  (key-value separation), compressed with the configured codec (measured: `python -m promptcache.sidecar.disk`).
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import shutil
import socket
import struct
import threading
import time
from dataclasses import dataclass

import xxhash

log = logging.getLogger("promptcache.disk")

_IDX = b"i"
_DAT = b"d"
_MAGIC = b"PCD1"
# magic, version, flags, created, expires, payload length, payload xxh3, meta length, parent length
_HDR = struct.Struct("<4sBBddQQIB")
_CHK = struct.Struct("<Q")
RECORD_OVERHEAD = 128  # bytes counted per record on top of payload and meta (keys, headers, RocksDB framing)
CODECS = ("none", "lz4", "zstd")
DEFAULT_CODEC = "none"  # chosen by measurement, see docs/disk-tier.md


OWNER_FILE = "promptcache.owner"  # who opened the database last: named when a second process finds it locked
RECOVERY_INTERVAL = 2.0  # seconds between attempts to reopen RocksDB after a write error
RESUME_MARGIN = 4 << 20  # spilling resumes at min_free_bytes plus this much free: no flapping at the very edge


class DiskTierError(RuntimeError):
    """The disk tier cannot be used (the message names the path)."""


def is_lock_error(message: str) -> bool:
    """RocksDB's messages when another process (or this one) holds the database's LOCK file."""
    return "While lock file" in message or "lock hold by current process" in message


def is_no_space_error(message: str) -> bool:
    return "No space left on device" in message


def reclaim_due(deleted_bytes: int, disk_full: bool, budget: int) -> bool:
    """Whether the writer should flush and compact now. RocksDB gives a deleted record's space back to the
    filesystem only when a flush drops it from the memtable (and the WAL holding it), and a compaction drops its
    tombstone and the blob file its payload lives in; left to itself it may never do so (no new writes while the
    disk is full). Compact after deletes worth a quarter of the budget, or after any delete while full."""
    return deleted_bytes > 0 and (disk_full or deleted_bytes >= budget // 4)


def lock_holders(lock_path: str) -> list[int]:
    """Process ids holding a lock on `lock_path`, from /proc/locks (Linux; empty when unknown). Read-only: opening
    the file and asking fcntl would drop this process's own POSIX locks on it when closed."""
    try:
        st = os.stat(lock_path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids = []
    for line in lines:
        parts = line.split()  # "1: POSIX  ADVISORY  WRITE 15452 fe:00:10027154 0 EOF"; waiters have "->"
        if "->" in parts:
            continue
        try:
            pid, dev = int(parts[4]), parts[5].split(":")
            if (int(dev[0], 16), int(dev[1], 16), int(dev[2])) == want and pid > 0:  # 0: another pid namespace
                pids.append(pid)
        except (IndexError, ValueError):
            continue
    return pids


def payload_checksum(key: bytes, payload) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(key))


@dataclass
class DiskEntry:
    nbytes: int  # counted against the budget
    length: int  # payload bytes
    checksum: int
    created: float
    expires: float
    meta: bytes
    parent: bytes | None


def _encode_index(key: bytes, e: DiskEntry) -> bytes:
    parent = e.parent or b""
    body = _HDR.pack(_MAGIC, 1, 0, e.created, e.expires, e.length, e.checksum, len(e.meta), len(parent)) \
        + e.meta + parent
    return body + _CHK.pack(xxhash.xxh3_64_intdigest(key + body))


def _decode_index(key: bytes, rec: bytes) -> DiskEntry | None:
    if len(rec) < _HDR.size + _CHK.size:
        return None
    body, (chk,) = rec[:-_CHK.size], _CHK.unpack(rec[-_CHK.size:])
    if xxhash.xxh3_64_intdigest(key + body) != chk:
        return None
    magic, version, _flags, created, expires, length, checksum, meta_len, parent_len = _HDR.unpack_from(body)
    if magic != _MAGIC or version != 1 or len(body) != _HDR.size + meta_len + parent_len:
        return None
    meta = body[_HDR.size:_HDR.size + meta_len]
    parent = body[_HDR.size + meta_len:] or None
    return DiskEntry(length + meta_len + RECORD_OVERHEAD, length, checksum, created, expires, meta, parent)


class DiskTier:
    """A byte-budgeted, TTL'd, checksummed RocksDB store of KV chunks with a background writer."""

    def __init__(self, path: str, budget_bytes: int, *, ttl_seconds: float = 4 * 3600.0,
                 compression: str = DEFAULT_CODEC, policy: str = "lru-prefix", max_queue_bytes: int = 256 << 20,
                 max_queue_items: int = 1024, min_free_bytes: int = 256 << 20, sync: bool = False,
                 clock=time.time, sweep_interval: float = 30.0, lock_wait_seconds: float = 30.0) -> None:
        from promptcache.sidecar.policies import make_policy

        if budget_bytes <= 0:
            raise ValueError(f"disk budget must be positive, got {budget_bytes}")
        if compression not in CODECS:
            raise ValueError(f"disk compression {compression!r} is not one of {', '.join(CODECS)}")
        self.path = os.path.abspath(path)
        self.budget = int(budget_bytes)
        self.ttl = float(ttl_seconds)
        self.compression = compression
        self.max_queue_bytes = max_queue_bytes
        self.max_queue_items = max_queue_items
        self.min_free_bytes = min_free_bytes
        self.clock = clock
        self.sweep_interval = sweep_interval
        self.lock_wait_seconds = lock_wait_seconds
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.index: dict[bytes, DiskEntry] = {}
        self.pending: dict[bytes, tuple[DiskEntry, bytes]] = {}  # accepted, not yet written
        self._ops: collections.deque = collections.deque()  # ("put", key, entry, payload) | ("del", key)
        self._queued_bytes = 0
        self._queued_puts = 0
        self._inflight = 0
        self.used = 0  # bytes of index + pending entries
        self.policy = make_policy(policy, capacity=self.budget)
        self.disk_full = False
        self._disk_full_since = 0.0
        self._broken = False  # a RocksDB write failed: the handle may be in its read-only error state
        self._last_recovery = 0.0
        self._last_space_check = 0.0
        self._deleted_since_reclaim = 0  # bytes of records deleted since the last flush + compaction
        self._closed = False
        self.counters = collections.Counter()
        self.open_report: dict = {}
        self._db = self._open_db(sync)
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="promptcache-disk-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------------------------------------ opening
    def _options(self):
        import rocksdict as rd

        opts = rd.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_paranoid_checks(True)
        opts.set_wal_recovery_mode(rd.DBRecoveryMode.point_in_time())
        table = rd.BlockBasedOptions()
        table.set_bloom_filter(10, False)
        opts.set_block_based_table_factory(table)
        codec = {"none": rd.DBCompressionType.none(), "lz4": rd.DBCompressionType.lz4(),
                 "zstd": rd.DBCompressionType.zstd()}[self.compression]
        opts.set_enable_blob_files(True)  # key-value separation: MB-sized values do not churn through compaction
        opts.set_min_blob_size(4096)
        opts.set_blob_compression_type(codec)
        opts.set_enable_blob_gc(True)
        opts.set_compression_type(rd.DBCompressionType.none())
        return opts

    def _open_db(self, sync: bool):
        import rocksdict as rd

        try:
            os.makedirs(self.path, exist_ok=True)
            probe = os.path.join(self.path, ".write-probe")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.unlink(probe)
        except OSError as exc:
            raise DiskTierError(f"disk tier path {self.path} is not writable: {exc.strerror or exc}") from None
        self.open_report = {"repaired": False, "quarantined": None}
        try:
            db = self._open_waiting_for_lock()
        except DiskTierError:
            raise
        except Exception as exc:  # corrupt files: try RocksDB's repair, then start afresh beside the old files
            if is_no_space_error(str(exc)):  # not corruption: nothing is moved aside
                raise DiskTierError(f"disk tier {self.path}: RocksDB cannot open for lack of space on the volume "
                                    f"({exc}); free some space") from None
            log.error("disk tier %s: cannot open RocksDB (%s); trying repair", self.path, exc)
            try:
                rd.Rdict.repair(self.path, self._options())
                db = rd.Rdict(self.path, self._options())
                self.open_report["repaired"] = True
            except Exception as exc2:
                if is_lock_error(str(exc2)):  # another process took the lock meanwhile: its files, not ours
                    raise DiskTierError(self._in_use_message()) from None
                aside = f"{self.path}.corrupt-{int(time.time())}"
                os.rename(self.path, aside)
                os.makedirs(self.path, exist_ok=True)
                log.error("disk tier %s: repair failed (%s); moved the old files to %s, starting empty",
                          self.path, exc2, aside)
                self.open_report["quarantined"] = aside
                db = rd.Rdict(self.path, self._options())
        self._write_opts = rd.WriteOptions()
        self._write_opts.sync = sync
        self._write_owner()
        return db

    def _open_waiting_for_lock(self):
        """rd.Rdict(path), waiting up to lock_wait_seconds while another process holds the LOCK file (a rolling
        update: the old pod closes the database on SIGTERM). Other errors are raised at once."""
        import rocksdict as rd

        deadline = time.monotonic() + self.lock_wait_seconds
        waited = False
        while True:
            try:
                return rd.Rdict(self.path, self._options())
            except Exception as exc:
                if not is_lock_error(str(exc)):
                    raise
                if time.monotonic() >= deadline:
                    raise DiskTierError(self._in_use_message()) from None
                if not waited:
                    log.warning("disk tier %s is locked by another process (%s); waiting up to %g s for it "
                                "(--disk-lock-wait-seconds)", self.path, self._holder(), self.lock_wait_seconds)
                    waited = True
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _holder(self) -> str:
        pids = lock_holders(os.path.join(self.path, "LOCK"))
        holder = ("pid " + ",".join(map(str, pids))) if pids else "an unknown process"
        if os.getpid() in pids:
            holder = f"this process (pid {os.getpid()})"
        try:
            with open(os.path.join(self.path, OWNER_FILE)) as f:
                last = f.read(200).strip()
        except OSError:
            last = ""
        return f"lock held by {holder}" + (f"; last opened by {last}" if last else "")

    def _in_use_message(self) -> str:
        return (f"disk tier {self.path} is in use by another process ({self._holder()}); waited "
                f"{self.lock_wait_seconds:g} s for its lock (--disk-lock-wait-seconds). Two sidecars cannot "
                "share one --data-dir; nothing was changed")

    def _write_owner(self) -> None:
        """Note who holds the database, for the message a second process gets (best effort)."""
        try:
            with open(os.path.join(self.path, OWNER_FILE), "w") as f:
                f.write(f"pid {os.getpid()} on host {socket.gethostname()} at "
                        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        except OSError:
            pass

    def _rebuild_index(self) -> None:
        import rocksdict as rd

        now = self.clock()
        dropped_corrupt = dropped_expired = dropped_budget = 0
        stale = []
        it = self._db.iter()
        it.seek(_IDX)
        try:
            while it.valid():
                k = it.key()
                if not k.startswith(_IDX):
                    break
                key = k[1:]
                e = _decode_index(key, it.value())
                if e is None:
                    dropped_corrupt += 1
                    stale.append(key)
                elif e.expires <= now:
                    dropped_expired += 1
                    stale.append(key)
                elif self.used + e.nbytes > self.budget:  # budget lowered since last run
                    dropped_budget += 1
                    stale.append(key)
                else:
                    self.index[key] = e
                    self.used += e.nbytes
                it.next()
        finally:
            del it
        # payloads without an index record (cannot happen with atomic batches; cleaned up anyway)
        orphans = []
        it = self._db.iter()
        it.seek(_DAT)
        try:
            while it.valid():
                k = it.key()
                if not k.startswith(_DAT):
                    break
                if k[1:] not in self.index:
                    orphans.append(k[1:])
                it.next()
        finally:
            del it
        if stale or orphans:
            wb = rd.WriteBatch(raw_mode=True)
            for key in set(stale) | set(orphans):
                wb.delete(_IDX + key)
                wb.delete(_DAT + key)
            self._db.write(wb, self._write_opts)
        # re-seed the policy oldest first, parents before children
        for key in sorted(self.index, key=lambda k: self.index[k].created):
            e = self.index[key]
            self.policy.inserted(key, e.nbytes, e.parent if e.parent in self.index else None)
        self.counters["dropped_corrupt"] += dropped_corrupt
        self.counters["dropped_expired"] += dropped_expired
        self.open_report.update(entries=len(self.index), bytes=self.used, dropped_corrupt=dropped_corrupt,
                                dropped_expired=dropped_expired, dropped_over_budget=dropped_budget,
                                dropped_orphans=len(orphans))
        if dropped_corrupt:
            log.warning("disk tier %s: dropped %d records that failed their checksum", self.path, dropped_corrupt)

    # ------------------------------------------------------------------------------------------------ serving
    def put(self, key: bytes, payload, meta: bytes = b"", parent: bytes | None = None,
            ttl_seconds: float | None = None, created: float | None = None) -> bool:
        """Queue a chunk for writing. Returns False (and counts why) when it is not taken: too large, disk full,
        write queue full, or closed. Never blocks on I/O. `created`: when the chunk was first stored anywhere
        (this tier's clock, wall time), kept in the record so its maximum lifetime survives restarts."""
        payload = bytes(payload)
        now = self.clock()
        e = DiskEntry(len(payload) + len(meta) + RECORD_OVERHEAD, len(payload), payload_checksum(key, payload),
                      now if created is None else min(created, now),
                      now + (self.ttl if ttl_seconds is None else ttl_seconds), bytes(meta), parent)
        with self._lock:
            if self._closed:
                self.counters["put_rejected_closed"] += 1
                return False
            if e.nbytes > self.budget:
                self.counters["put_rejected_too_large"] += 1
                return False
            if self.disk_full and not self._recheck_space_locked(now, e.nbytes):
                self.counters["put_rejected_disk_full"] += 1
                return False
            if self._queued_puts >= self.max_queue_items or self._queued_bytes + e.length > self.max_queue_bytes:
                self.counters["put_rejected_queue_full"] += 1
                return False
            if key in self.index or key in self.pending:
                self._drop_locked(key)
            while self.used + e.nbytes > self.budget:
                v = self.policy.victim()
                if v is None:
                    break
                self._drop_locked(v)
                self.counters["evicted_capacity"] += 1
            if self.used + e.nbytes > self.budget:
                self.counters["put_rejected_too_large"] += 1
                return False
            self.pending[key] = (e, payload)
            self.used += e.nbytes
            self.policy.inserted(key, e.nbytes, parent if parent in self.index or parent in self.pending else None)
            self._ops.append(("put", key, e, payload))
            self._queued_puts += 1
            self._queued_bytes += e.length
            self.counters["puts"] += 1
            self._cv.notify()
        return True

    def get(self, key: bytes) -> bytes | None:
        """The verified payload, or None (absent, expired or failed its checksum - then dropped and counted)."""
        with self._lock:
            p = self.pending.get(key)
            e = self.index.get(key) if p is None else p[0]
            if e is None:
                self.counters["misses"] += 1
                return None
            if e.expires <= self.clock():
                self._drop_locked(key)
                self.counters["evicted_ttl"] += 1
                self.counters["misses"] += 1
                return None
            self.policy.accessed(key)
            if p is not None:
                self.counters["hits"] += 1
                self.counters["hit_bytes"] += e.length
                return p[1]
        db = self._db
        try:
            data = db.get(_DAT + key)
        except Exception as exc:  # an I/O or corruption error reading one record: treat as corrupt
            if self._broken or db is not self._db:  # the handle is being reopened: a miss, the record is fine
                with self._lock:
                    self.counters["misses"] += 1
                return None
            log.warning("disk tier %s: read of a record failed: %s", self.path, exc)
            data = None
        if data is None or len(data) != e.length or payload_checksum(key, data) != e.checksum:
            with self._lock:
                if self.index.get(key) is e:
                    self._drop_locked(key)
                    self.counters["dropped_corrupt"] += 1
                self.counters["misses"] += 1
            log.warning("disk tier %s: dropped a chunk that failed its checksum", self.path)
            return None
        with self._lock:
            self.counters["hits"] += 1
            self.counters["hit_bytes"] += e.length
        return data

    def meta(self, key: bytes) -> bytes | None:
        with self._lock:
            p = self.pending.get(key)
            e = self.index.get(key) if p is None else p[0]
            return None if e is None or e.expires <= self.clock() else e.meta

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            p = self.pending.get(key)
            e = self.index.get(key) if p is None else p[0]
            return e is not None and e.expires > self.clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self.index) + len(self.pending)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self._drop_locked(key)

    def purge(self, meta_prefix: bytes) -> int:
        """Delete every record whose meta starts with `meta_prefix` (e.g. a model fingerprint). Returns the count."""
        with self._lock:
            dead = [k for k, e in self.index.items() if e.meta.startswith(meta_prefix)]
            dead += [k for k, (e, _) in self.pending.items() if e.meta.startswith(meta_prefix)]
            for k in dead:
                self._drop_locked(k)
            return len(dead)

    def _drop_locked(self, key: bytes) -> bool:
        p = self.pending.pop(key, None)
        e = self.index.pop(key, None) if p is None else p[0]
        if p is not None:
            self.index.pop(key, None)
        if e is None:
            return False
        self.used -= e.nbytes
        self.policy.removed(key)
        self._ops.append(("del", key, e.nbytes))
        self._cv.notify()
        return True

    def sweep_expired(self) -> int:
        now = self.clock()
        with self._lock:
            dead = [k for k, e in self.index.items() if e.expires <= now]
            dead += [k for k, (e, _) in self.pending.items() if e.expires <= now]
            for k in dead:
                self._drop_locked(k)
            self.counters["evicted_ttl"] += len(dead)
        return len(dead)

    # ------------------------------------------------------------------------------------------------ writer
    def _recheck_space_locked(self, now: float, need: int) -> bool:
        """While flagged full, look at the free space at most once a second; clear the flag when it is back."""
        if self._broken or now - self._disk_full_since < 1.0:
            return False
        self._disk_full_since = now
        if self._free_bytes() >= self.min_free_bytes + need:
            self.disk_full = False
            log.warning("disk tier %s: free space is back; spilling resumes", self.path)
            return True
        return False

    def _free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.path).free
        except OSError:
            return 0

    def _set_disk_full(self, why: str, broken: bool = False) -> None:
        with self._lock:
            if not self.disk_full:
                log.error("disk tier %s: disk full (%s); spilling stops, the memory tier keeps serving",
                          self.path, why)
            if broken:
                self._broken = True
                self.counters["write_errors"] += 1
            self.disk_full = True
            self._disk_full_since = self.clock()
            self.counters["disk_full_events"] += 1

    def _write_loop(self) -> None:
        import rocksdict as rd

        last_sweep = time.monotonic()
        while True:
            with self._lock:
                if not self._ops and not self._closed:
                    # while full (or broken) wake every second to look at the free space again
                    self._cv.wait(timeout=1.0 if self.disk_full else self.sweep_interval)
                if self._closed and not self._ops:
                    return
                batch = []
                nbytes = 0
                while self._ops and len(batch) < 64 and nbytes < (64 << 20):
                    op = self._ops.popleft()
                    batch.append(op)
                    if op[0] == "put":
                        nbytes += op[2].length
                self._inflight = len(batch)
            if time.monotonic() - last_sweep >= self.sweep_interval:
                last_sweep = time.monotonic()
                self.sweep_expired()
            if batch:
                self._write_batch(rd, batch, nbytes)
            self._maintain()

    def _write_batch(self, rd, batch, nbytes: int) -> None:
        puts = [op for op in batch if op[0] == "put"]
        deleted = sum(op[2] for op in batch if op[0] == "del")
        if self._broken:  # puts fail; deletes are redone by _recover (it drops whatever the index lacks)
            ok = False
        elif puts and self._free_bytes() < self.min_free_bytes + nbytes:
            self._set_disk_full(f"free space below {self.min_free_bytes} bytes")
            ok = False
            self._apply_deletes_only(batch, deleted)
        else:
            wb = rd.WriteBatch(raw_mode=True)
            for op in batch:
                if op[0] == "put":
                    _, key, e, payload = op
                    wb.put(_DAT + key, payload)
                    wb.put(_IDX + key, _encode_index(key, e))
                else:
                    wb.delete(_DAT + op[1])
                    wb.delete(_IDX + op[1])
            try:
                self._db.write(wb, self._write_opts)
                ok = True
                self._deleted_since_reclaim += deleted
            except Exception as exc:
                full = is_no_space_error(str(exc)) or getattr(exc, "errno", None) == errno.ENOSPC
                self._set_disk_full(str(exc) if full else f"write error: {exc}", broken=True)
                ok = False
        with self._lock:
            for op in puts:
                _, key, e, _payload = op
                self._queued_puts -= 1
                self._queued_bytes -= e.length
                cur = self.pending.get(key)
                if cur is None or cur[0] is not e:
                    continue  # deleted or replaced while queued (its delete/put follows in the queue)
                del self.pending[key]
                if ok:
                    self.index[key] = e
                    self.counters["written_bytes"] += e.length
                else:
                    self.used -= e.nbytes
                    self.policy.removed(key)
                    self.counters["put_failed"] += 1
            self._inflight = 0
            self._cv.notify_all()

    def _apply_deletes_only(self, batch, deleted: int) -> None:
        import rocksdict as rd

        wb = rd.WriteBatch(raw_mode=True)
        n = 0
        for op in batch:
            if op[0] == "del":
                wb.delete(_DAT + op[1])
                wb.delete(_IDX + op[1])
                n += 1
        if n:
            try:
                self._db.write(wb, self._write_opts)
                self._deleted_since_reclaim += deleted
            except Exception as exc:  # the index already forgot them; _recover deletes them after reopening
                log.error("disk tier %s: delete failed: %s", self.path, exc)
                self._set_disk_full(f"delete failed: {exc}", broken=True)

    def _maintain(self) -> None:
        """Writer thread, after each batch or idle second: reopen a broken handle, give deleted records' space
        back to the filesystem, and resume spilling once free space is back."""
        now = time.monotonic()
        if self._broken:
            if now - self._last_recovery >= RECOVERY_INTERVAL:
                self._last_recovery = now
                self._recover()
            if self._broken:
                return
        if reclaim_due(self._deleted_since_reclaim, self.disk_full, self.budget):
            self._reclaim()
        if self.disk_full and not self._broken and now - self._last_space_check >= 1.0:
            self._last_space_check = now
            free = self._free_bytes()
            with self._lock:
                if self.disk_full and free >= self.min_free_bytes + RESUME_MARGIN:
                    self.disk_full = False
                    log.warning("disk tier %s: free space is back (%d bytes); spilling resumes", self.path, free)

    def _reclaim(self) -> None:
        """Flush the memtable (drops records deleted before they reached a file, and frees the WAL) and compact
        everything (drops tombstones; blob files left without live records are deleted)."""
        before = self._free_bytes()
        try:
            self._db.flush()
            self._db.compact_range(None, None)
        except Exception as exc:
            log.error("disk tier %s: compaction to free deleted space failed: %s", self.path, exc)
            self._set_disk_full(f"compaction failed: {exc}", broken=True)
            return
        self.counters["reclaims"] += 1
        log.info("disk tier %s: compacted after deleting %d bytes; the volume has %d bytes more free", self.path,
                 self._deleted_since_reclaim, self._free_bytes() - before)
        self._deleted_since_reclaim = 0

    def _recover(self) -> None:
        """After a RocksDB write error the handle stays read-only until reopened (rocksdict has no Resume): close
        it, open again, and delete every record the index no longer holds (deletes that failed meanwhile)."""
        import rocksdict as rd

        try:
            self._db.close()
        except Exception:  # noqa: BLE001 - closing a broken handle reports its error again; it closes anyway
            pass
        opts = self._options()
        opts.create_if_missing(False)  # a folder removed under us stays an error, not a new empty database
        try:
            self._db = rd.Rdict(self.path, opts)
            with self._lock:
                known = set(self.index) | set(self.pending)
            stale = []
            it = self._db.iter()
            it.seek_to_first()
            try:
                while it.valid():
                    k = it.key()
                    if k[1:] not in known and k[:1] in (_IDX, _DAT):
                        stale.append(k)
                    it.next()
            finally:
                del it
            wb = rd.WriteBatch(raw_mode=True)
            for k in stale:
                wb.delete(k)
            self._db.write(wb, self._write_opts)
            self._db.flush()
            self._db.compact_range(None, None)
        except Exception as exc:  # noqa: BLE001 - still no space, or the files went away: try again later
            self.counters["reopen_failures"] += 1
            if self.counters["reopen_failures"] % 60 == 1:  # the first failure, then every two minutes or so
                log.error("disk tier %s: reopening RocksDB after an error failed: %s; retrying every %g s",
                          self.path, exc, RECOVERY_INTERVAL)
            return
        self._broken = False
        self._deleted_since_reclaim = 0
        self.counters["reopens"] += 1
        log.warning("disk tier %s: RocksDB reopened after an error; %d stale records deleted", self.path,
                    len(stale) // 2)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued write is committed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._ops or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left)
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._writer.join()
        self._db.close()

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self.index) + len(self.pending), "bytes_used": self.used,
                    "budget_bytes": self.budget, "queued_puts": self._queued_puts,
                    "queued_bytes": self._queued_bytes, "disk_full": self.disk_full, **self.counters}


def open_or_exit(path: str, budget_bytes: int, **kwargs) -> DiskTier:
    """For the sidecar's start-up: a DiskTier, or exit with a message naming the path."""
    try:
        return DiskTier(path, budget_bytes, **kwargs)
    except DiskTierError as exc:
        raise SystemExit(f"promptcache: {exc}") from None
