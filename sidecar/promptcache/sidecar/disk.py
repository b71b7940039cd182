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
* Index RAM. The in-memory index (a DiskEntry per record, its meta, parent and owner, the eviction policy's state)
  costs about INDEX_ENTRY_RAM bytes per record plus those variable-length bytes (`index_ram`, measured), whatever
  the payload's size: a client's tiny model layout (1 KiB chunks) would otherwise fill a large budget with tens of
  millions of records and the sidecar's RAM with them. `index_bytes` bounds that estimate like the budget bounds
  bytes (default_index_bytes: --disk-bytes / 64, at least 64 MiB, which chunks of 256 KiB and more never reach): a
  put over it evicts first (`evicted_index`), and an index over it at open (the bound was lowered) is trimmed.
* Off the serving path. `put` only reserves and queues (bounded by bytes and count: when full, the put is refused
  rather than blocking the caller); one writer thread batches the RocksDB writes. Queued chunks are served from
  the queue until written.
* Disk full. When free space falls below `min_free_bytes` or RocksDB reports an I/O error, spilling stops
  (`disk_full` flag, a counter, one log line). Deleted records give their space back to the filesystem only once
  RocksDB flushes and compacts them away, so the writer does that after enough deletes (and at once while full);
  after a RocksDB write error it reopens the database (the only way out of RocksDB's read-only error state) and
  deletes whatever the index no longer holds. While full it looks at the free space every second and resumes
  spilling when it is back above `min_free_bytes`. A reserve file it never spills into gives RocksDB room to
  give space back, open and close on a full volume (read-only if it must); when its own records fill the
  volume it evicts the oldest. The guarantee: docs/disk-tier.md, "Full volumes" (SpacePlan).
* One owner. RocksDB's LOCK file keeps a second process off the folder; `DiskTier` waits for it up to
  `lock_wait_seconds` (a rolling update overlaps two pods briefly) and then raises DiskTierError naming the
  holder. A held lock is never mistaken for corruption: only files RocksDB cannot read are repaired or moved aside.
* TTL. Each record carries its absolute expiry; expired records are never served and are swept in the background.
* Newer records (a rollback after an upgrade). An index record written by a newer build (its header's version above
  INDEX_VERSION, or a later b"PCD" magic) is left in place with its payload: never served, never deleted (not at
  open, not by eviction, a purge, a reopen or a put of the same key), not counted as this build's usage; its bytes
  are charged against the budget (the folder never holds more than --disk-bytes), so they are reported apart
  (`foreign_entries`, `foreign_bytes`, the open report's `kept_newer`) and logged once at open, naming the folder
  and the versions. The newer build finds them again when it comes back.
* Readers. `DiskTier(..., reader=True)` (`promptcache export --data-dir`) opens RocksDB read-only, takes no lock
  (works beside a running sidecar), writes nothing in the folder (it opens a temporary view of links to the
  database files, where RocksDB's info LOG and rocksdict's config go) and never deletes: a record that fails its
  checksum is only skipped.
* Bloom filters are on (10 bits/key, on the SST key space); large values live in RocksDB blob files
  (key-value separation), compressed with the configured codec (measured: `python -m promptcache.sidecar.disk`).
"""
from __future__ import annotations

import collections
import errno
import logging
import math
import os
import shutil
import socket
import struct
import threading
import time
from dataclasses import dataclass

import xxhash

from promptcache.sidecar.expiry import ExpiryHeap

log = logging.getLogger("promptcache.disk")

_IDX = b"i"
_DAT = b"d"
_MAGIC = b"PCD1"
# magic, version, flags, created, expires, payload length, payload xxh3, meta length, parent length
_HDR = struct.Struct("<4sBBddQQIB")
# version 2 appends what warm-up orders by (hottest first) and whose quota the chunk is charged to:
# last access (wall time), hit count, owner length, the chunk's own sliding TTL (a Put's retention hint; 0: the
# tier's); the owner's UTF-8 bytes follow the parent. Version 1 records (written before) are still read: last
# access = created, no hits, the shared owner, no TTL of its own.
_HDR2_TAIL = struct.Struct("<dIHd")
INDEX_VERSION = 2
# The header's flags byte (0 in records written before it was used, which read as "no flags"):
# hints only, so a flag this version does not know is ignored rather than the record dropped.
FLAG_PINNED = 0x01  # a Put's priority hint had pinned it in memory: pinned again when it comes back
_CHK = struct.Struct("<Q")
RECORD_OVERHEAD = 128  # bytes counted per record on top of payload and meta (keys, headers, RocksDB framing)
# RAM the index takes per record on top of its variable-length bytes (key, meta, parent, owner): the DiskEntry
# (slots), the float and int objects it holds, its slot in `index` and the eviction policy's per-key state
# (lru-prefix: seven dicts, a children set, heap tuples), with the dicts' growth slack. Measured with tracemalloc
# (Python 3.11; tests/test_disk_index_bound.py checks it): 740-1,000 bytes per record after puts, 950-1,270 after
# a reopen (its own parent and owner objects), up to 1,670 once hits have grown the policy's heap to its 4x limit
# (right after the dicts resized); 1,792 leaves a margin over the worst.
INDEX_ENTRY_RAM = 1792
INDEX_BYTES_PER_BUDGET = 64  # the default index bound: 1 byte of RAM per 64 bytes of --disk-bytes ...
MIN_INDEX_BYTES = 64 << 20  # ... and at least this much
CODECS = ("none", "lz4", "zstd")
DEFAULT_CODEC = "none"  # chosen by measurement, see docs/disk-tier.md


OWNER_FILE = "promptcache.owner"  # who opened the database last: named when a second process finds it locked
RECLAIM_RETRIES = 5  # extra flush + compaction rounds while deleted space has not come back
RESERVE_FILE = "promptcache.reserve"  # space held aside (allocated) for the writes that give space back
RECOVERY_INTERVAL = 2.0  # seconds between attempts to reopen RocksDB after a write error
MAX_INFO_LOG_BYTES = 256 << 10  # RocksDB's LOG file is rolled at this size ...
KEEP_INFO_LOGS = 2  # ... and at most this many LOG files are kept (a reopen loop leaves no growing LOG.old.*)


@dataclass(frozen=True)
class SpacePlan:
    """How the tier uses its volume (docs/disk-tier.md, "Full volumes"). RocksDB needs room to give space back:
    a flush writes the memtable out (the blob file is as large as the payloads it holds) before its WAL can
    go, opening writes a MANIFEST, OPTIONS and LOG and replays the WAL into a flush, and compaction writes its
    output before deleting its input. So the memtable (and with it the WAL) is kept small, and `reserve` bytes
    are held aside in RESERVE_FILE (allocated, never written to by spilling): the tier releases it just before
    an open, flush or compaction on a volume that is nearly full, and allocates it again afterwards. Spilling
    needs the reserve in place and `min_free_bytes + write_buffer + batch` free, so the memtable can always
    be flushed; it resumes once `resume_margin` more than that is free."""
    write_buffer: int  # RocksDB memtable size (max two: the WAL holds at most 2x this)
    reserve: int
    resume_margin: int


def space_plan(volume_bytes: int) -> SpacePlan:
    wb = min(64 << 20, max(1 << 20, volume_bytes // 32))
    return SpacePlan(write_buffer=wb, reserve=2 * wb + (2 << 20), resume_margin=wb)


class DiskTierError(RuntimeError):
    """The disk tier cannot be used (the message names the path)."""


class DiskTierCancelled(DiskTierError):
    """Opening was given up because `cancel` was set (a SIGTERM during the sidecar's start-up); nothing is left
    open."""


def newer_format(rec: bytes) -> str | None:
    """What a newer build wrote `rec` in ("index version 3", "format PCD2"), or None: a record of a version this
    build reads (or one too damaged to tell). Only the header's first bytes are looked at: a newer build may change
    whatever follows them, its checksum included."""
    if len(rec) < 5 or rec[:3] != _MAGIC[:3]:
        return None
    if rec[:4] == _MAGIC:
        return f"index version {rec[4]}" if rec[4] > INDEX_VERSION else None
    if rec[3:4].isdigit() and rec[3:4] > _MAGIC[3:4]:
        return f"format {rec[:4].decode()}"
    return None


def is_lock_error(message: str) -> bool:
    """RocksDB's messages when another process (or this one) holds the database's LOCK file."""
    return "While lock file" in message or "lock hold by current process" in message


def is_no_space_error(message: str) -> bool:
    return "No space left on device" in message


def reclaim_due(deleted_bytes: int, disk_full: bool, budget: int, volume_bytes: int | None = None) -> bool:
    """Whether the writer should flush and compact now. RocksDB gives a deleted record's space back to the
    filesystem only when a flush drops it from the memtable (and the WAL holding it), and a compaction drops its
    tombstone and the blob file its payload lives in; left to itself it may never do so (no new writes while the
    disk is full). Compact after deletes worth a quarter of what the tier can hold (its budget, or its volume
    when that is smaller: a tier that filled its volume is far below its budget), or after any delete while full."""
    holds = budget if volume_bytes is None else min(budget, volume_bytes)
    return deleted_bytes > 0 and (disk_full or deleted_bytes >= holds // 4)


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


def make_private_dirs(path: str) -> None:
    """os.makedirs(path, exist_ok=True), each folder it creates 0700 (a disk tier holds every tenant's KV); a folder
    that exists already is left as it is (its mode is its owner's choice)."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        up = os.path.dirname(path)
        if up == path:
            break
        path = up
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


def default_index_bytes(budget_bytes: int) -> int:
    """The default bound on the index's RAM for a disk budget (--disk-index-bytes 0): budget / 64, at least 64 MiB.
    A record of a chunk of 256 KiB (the smallest ordinary chunk; a 135M-parameter model's are 5.6 MiB) is counted
    ~1.9 KiB of index RAM (index_ram), 1/134 of its budget bytes, so a full budget of them takes half the bound:
    those never reach it. Records of tiny chunks (a 1 KiB chunk is charged ~1.25 KiB of budget and ~1.9 KiB of
    index RAM) are bounded by it instead of by the budget: a 100 GiB disk tier's index takes at most 1.6 GiB of RAM,
    not the ~100 GiB that 86 million 1 KiB chunks would take."""
    return max(MIN_INDEX_BYTES, int(budget_bytes) // INDEX_BYTES_PER_BUDGET)


def index_ram(key: bytes, e: "DiskEntry") -> int:
    """RAM the index holds for one record (an estimate measured with tracemalloc, never below the real cost for
    lru-prefix): a constant plus the bytes of its key, meta, parent and owner (4 per character when not ASCII)."""
    return record_index_ram(key, e.meta, e.parent, e.owner)


def record_index_ram(key: bytes, meta: bytes, parent: bytes | None, owner: str) -> int:
    """index_ram of a record not stored yet."""
    return (INDEX_ENTRY_RAM + len(key) + len(meta) + (len(parent) if parent else 0)
            + (len(owner) if owner.isascii() else 4 * len(owner)))


def foreign_ram(key: bytes) -> int:
    """RAM held for a newer build's record (kept, never served): its key and a byte count in `foreign`."""
    return 160 + len(key)


def payload_checksum(key: bytes, payload) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(key))


@dataclass(slots=True)  # slots: no per-record __dict__ (the index holds one per record; see index_ram)
class DiskEntry:
    nbytes: int  # counted against the budget
    length: int  # payload bytes
    checksum: int
    created: float
    expires: float
    meta: bytes
    parent: bytes | None
    last_access: float = 0.0  # wall time of its last hit in any tier (0: unknown, a version 1 record: created)
    hits: int = 0  # hits it had in any tier since it was first stored (capped at 2^32 - 1)
    owner: str = ""  # whose quota it is charged to once back in memory ("": the shared namespace)
    ttl_hint: float = 0.0  # its own sliding TTL once back in memory (a Put's retention hint); 0: the tier's
    pinned: bool = False  # it was pinned in memory when it came down (a priority hint): pin it again on the way up

    def hotness(self) -> tuple:
        """Warm-up's order, hottest first when sorted descending: hit count, then recency."""
        return (self.hits, self.last_access or self.created)


def _encode_index(key: bytes, e: DiskEntry, version: int = INDEX_VERSION) -> bytes:
    parent = e.parent or b""
    flags = FLAG_PINNED if e.pinned and version >= 2 else 0
    body = _HDR.pack(_MAGIC, version, flags, e.created, e.expires, e.length, e.checksum, len(e.meta), len(parent))
    if version >= 2:
        owner = e.owner.encode()
        body += _HDR2_TAIL.pack(e.last_access, min(e.hits, 0xFFFFFFFF), len(owner), e.ttl_hint) \
            + e.meta + parent + owner
    else:
        body += e.meta + parent
    return body + _CHK.pack(xxhash.xxh3_64_intdigest(key + body))


def _decode_index(key: bytes, rec: bytes) -> DiskEntry | None:
    if len(rec) < _HDR.size + _CHK.size:
        return None
    body, (chk,) = rec[:-_CHK.size], _CHK.unpack(rec[-_CHK.size:])
    if xxhash.xxh3_64_intdigest(key + body) != chk:
        return None
    magic, version, flags, created, expires, length, checksum, meta_len, parent_len = _HDR.unpack_from(body)
    if magic != _MAGIC or version not in (1, 2):
        return None
    at, last_access, hits, owner_len, ttl_hint = _HDR.size, created, 0, 0, 0.0
    if version == 2:
        if len(body) < at + _HDR2_TAIL.size:
            return None
        last_access, hits, owner_len, ttl_hint = _HDR2_TAIL.unpack_from(body, at)
        at += _HDR2_TAIL.size
    if len(body) != at + meta_len + parent_len + owner_len:
        return None
    meta = body[at:at + meta_len]
    parent = body[at + meta_len:at + meta_len + parent_len] or None
    try:
        owner = body[at + meta_len + parent_len:].decode()
    except UnicodeDecodeError:
        return None
    return DiskEntry(length + meta_len + RECORD_OVERHEAD, length, checksum, created, expires, meta, parent,
                     last_access, hits, owner, ttl_hint if ttl_hint > 0 else 0.0, bool(flags & FLAG_PINNED))


class DiskTier:
    """A byte-budgeted, TTL'd, checksummed RocksDB store of KV chunks with a background writer."""

    def __init__(self, path: str, budget_bytes: int, *, ttl_seconds: float = 4 * 3600.0,
                 compression: str = DEFAULT_CODEC, policy: str = "lru-prefix", max_queue_bytes: int = 256 << 20,
                 max_queue_items: int = 1024, min_free_bytes: int = 256 << 20, sync: bool = False,
                 clock=time.time, sweep_interval: float = 30.0, lock_wait_seconds: float = 30.0,
                 reader: bool = False, cancel: threading.Event | None = None,
                 index_bytes: int | None = None) -> None:
        """`reader`: open read-only, write and delete nothing, take no lock (the module docstring, "Readers").
        `cancel`: when set while opening (waiting for the lock, rebuilding the index), the database is closed
        again and DiskTierCancelled raised. `index_bytes`: the bound on the index's RAM (index_ram summed over
        the records; None: default_index_bytes(budget_bytes))."""
        from promptcache.sidecar.policies import make_policy

        if budget_bytes <= 0:
            raise ValueError(f"disk budget must be positive, got {budget_bytes}")
        if index_bytes is not None and index_bytes <= 0:
            raise ValueError(f"disk index bound must be positive, got {index_bytes}")
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
        self.reader = reader
        self._cancel = cancel
        self._view_dir: str | None = None  # a reader's temporary view of the folder (_open_for_reading)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.index: dict[bytes, DiskEntry] = {}
        self.pending: dict[bytes, tuple[DiskEntry, bytes]] = {}  # accepted, not yet written
        # The TTL sweep pops what is due from a heap (expiry.py) rather than scanning every record under the lock
        # (0.9 ms at 100,000 records, 7 us now); an item whose record left or was replaced since (its expiry no
        # longer matches) is dropped when it comes up.
        self._expiry = ExpiryHeap()
        self._ops: collections.deque = collections.deque()  # ("put", key, entry, payload) | ("del", key)
        self._queued_bytes = 0
        self._queued_puts = 0
        self._inflight = 0
        self.used = 0  # bytes of index + pending entries
        self.index_bytes = default_index_bytes(self.budget) if index_bytes is None else int(index_bytes)
        self.index_used = 0  # RAM of index + pending entries (index_ram), and of foreign records (foreign_ram)
        self.foreign: dict[bytes, int] = {}  # key -> bytes of a record a newer build wrote: kept, never served
        self.foreign_bytes = 0
        self.policy = make_policy(policy, capacity=self.budget)
        self.disk_full = False
        self._disk_full_since = 0.0
        self._broken = False  # a RocksDB write failed: the handle may be in its read-only error state
        self._last_recovery = 0.0
        self._last_space_check = 0.0
        self._deleted_since_reclaim = 0  # bytes of records deleted since the last flush + compaction
        self._reclaim_retries = 0  # reclaims in a row that gave back less than half of what was deleted
        self._reclaim_when_drained = False  # a purge's deletes: reclaim once the queue holding them is written
        self._closed = False
        self._read_only = False  # opened read-only (no room to open for writing): served, never written
        self._space_cap: int | None = None  # a budget the volume can hold, learned when it ran full (None: budget)
        self._cap_checked = 0.0
        self.counters = collections.Counter()
        self.open_report: dict = {}
        self.plan = space_plan(1 << 30)  # sized to the volume once the folder exists (_open_db)
        self._writer = None
        self._check_cancel()
        self._db = self._open_for_reading() if reader else self._open_db(sync)
        try:
            self._rebuild_index()
            self._check_cancel()
        except BaseException:
            self._close_db()
            self._remove_view()
            raise
        if not reader:
            self._writer = threading.Thread(target=self._write_loop, name="promptcache-disk-writer", daemon=True)
            self._writer.start()

    def _check_cancel(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise DiskTierCancelled(f"while opening the disk tier {self.path}")

    # ------------------------------------------------------------------------------------------------ opening
    def _volume_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.path).total
        except OSError:
            return 1 << 30

    def _options(self):
        import rocksdict as rd

        opts = rd.Options(raw_mode=True)
        opts.create_if_missing(True)
        plan = self.plan
        opts.set_write_buffer_size(plan.write_buffer)
        opts.set_max_write_buffer_number(2)
        opts.set_max_total_wal_size(2 * plan.write_buffer)
        opts.set_blob_file_size(plan.write_buffer)
        opts.set_manifest_preallocation_size(64 << 10)  # 4 MiB by default, allocated at every open
        opts.set_max_manifest_file_size(4 << 20)
        opts.set_keep_log_file_num(KEEP_INFO_LOGS)
        opts.set_max_log_file_size(MAX_INFO_LOG_BYTES)
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
            make_private_dirs(self.path)
            self.plan = space_plan(self._volume_bytes())
            self._probe()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise DiskTierError(f"disk tier path {self.path} is not writable: {exc.strerror or exc}") from None
            # a full volume is no reason not to start: RocksDB gets the reserve, or opens read-only below
        self.open_report = {"repaired": False, "quarantined": None, "read_only": False}
        try:
            try:
                db = self._open_waiting_for_lock()
            except DiskTierError:
                raise
            except Exception as exc:
                if not is_no_space_error(str(exc)):
                    raise
                # Opening replays the WAL into a flush and writes a MANIFEST and a LOG: it gets the reserve.
                # (Only now: while another process holds the lock, the reserve is that process's.)
                self._release_reserve()
                db = self._open_waiting_for_lock()
        except DiskTierError:
            raise
        except Exception as exc:  # corrupt files: try RocksDB's repair, then start afresh beside the old files
            if is_no_space_error(str(exc)):  # not corruption: nothing is moved aside; serve what can be read
                db = self._open_read_only(exc)
                self._write_opts = rd.WriteOptions()
                self._write_opts.sync = sync
                return db
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
                make_private_dirs(self.path)
                log.error("disk tier %s: repair failed (%s); moved the old files to %s, starting empty",
                          self.path, exc2, aside)
                self.open_report["quarantined"] = aside
                db = rd.Rdict(self.path, self._options())
        self._write_opts = rd.WriteOptions()
        self._write_opts.sync = sync
        self._write_owner()
        if not self._ensure_reserve():
            self.disk_full = True
            self._disk_full_since = self.clock()
            log.error("disk tier %s: no room for its %d-byte reserve; spilling waits for free space", self.path,
                      self.plan.reserve)
        return db

    def _open_for_reading(self):
        """A reader's handle: RocksDB opened read-only, or DiskTierError naming the folder (and who holds it).
        Nothing in the folder is written, not even a timestamp: RocksDB (read-only, no LOCK taken) opens a
        temporary view of it, links to its database files, so its info LOG and rocksdict's config file (which
        rocksdict rewrites at every open, read-only too) go to the view. A running sidecar may switch to a new
        MANIFEST or WAL meanwhile: the view is made again and the open retried a few times."""
        import tempfile

        import rocksdict as rd

        if not os.path.isfile(os.path.join(self.path, "CURRENT")):
            raise DiskTierError(f"disk tier {self.path}: no RocksDB database there (no CURRENT file)")
        self.plan = space_plan(self._volume_bytes())
        self.open_report = {"repaired": False, "quarantined": None, "read_only": True}
        opts = self._options()
        opts.create_if_missing(False)
        self._write_opts = rd.WriteOptions()
        for attempt in range(5):
            self._remove_view()
            self._view_dir = tempfile.mkdtemp(prefix="promptcache-reader-")
            try:
                for name in os.listdir(self.path):
                    if name not in ("LOCK", "rocksdict-config.json", OWNER_FILE, RESERVE_FILE) \
                            and not name.startswith("LOG"):
                        os.symlink(os.path.join(self.path, name), os.path.join(self._view_dir, name))
                db = rd.Rdict(self._view_dir, opts, access_type=rd.AccessType.read_only())
            except Exception as exc:  # noqa: BLE001 - RocksDB raises plain Exception
                if attempt < 4 and not isinstance(exc, OSError):
                    time.sleep(0.05)
                    continue
                self._remove_view()
                raise DiskTierError(f"disk tier {self.path}: cannot open RocksDB read-only ({exc}; "
                                    f"{self._holder()}); nothing was changed") from None
            self._read_only = True
            return db
        raise AssertionError("unreachable")

    def _remove_view(self) -> None:
        if self._view_dir is not None:
            shutil.rmtree(self._view_dir, ignore_errors=True)
            self._view_dir = None

    def _probe(self) -> None:
        probe = os.path.join(self.path, ".write-probe")
        try:
            with open(probe, "wb") as f:
                f.write(b"ok")
                f.flush()
                os.fsync(f.fileno())
        finally:
            try:
                os.unlink(probe)
            except FileNotFoundError:
                pass

    def _open_read_only(self, why: Exception):
        """No room to open for writing: open read-only (nothing is written), serve what it holds, refuse
        writes; the writer reopens it for writing once there is room (_recover)."""
        import rocksdict as rd

        opts = self._options()
        opts.create_if_missing(False)
        try:
            db = rd.Rdict(self.path, opts, access_type=rd.AccessType.read_only())
        except Exception as exc:  # noqa: BLE001 - RocksDB raises plain Exception
            raise DiskTierError(f"disk tier {self.path}: RocksDB cannot open for lack of space on the volume "
                                f"({why}), nor read-only ({exc}); free some space") from None
        self._read_only = True
        self._broken = True  # the writer's recovery path reopens it for writing
        self.disk_full = True
        self._disk_full_since = self.clock()
        self.open_report["read_only"] = True
        self.counters["opened_read_only"] += 1
        log.error("disk tier %s: no room on the volume to open RocksDB for writing (%s); serving what it holds "
                  "read-only, spilling resumes once there is room", self.path, why)
        return db

    # ------------------------------------------------------------------------------------------------ reserve
    def _reserve_path(self) -> str:
        return os.path.join(self.path, RESERVE_FILE)

    def _reserve_held(self) -> int:
        try:
            return os.stat(self._reserve_path()).st_blocks * 512
        except OSError:
            return 0

    def _ensure_reserve(self) -> bool:
        """Allocate the reserve file (posix_fallocate: blocks taken, not a sparse file). False: no room yet."""
        if self._reserve_held() >= self.plan.reserve:
            return True
        try:
            fd = os.open(self._reserve_path(), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            os.posix_fallocate(fd, 0, self.plan.reserve)
            return True
        except OSError:
            os.ftruncate(fd, 0)  # a partial allocation is given back: it would only hide the free space
            return False
        finally:
            os.close(fd)

    def _release_reserve(self) -> int:
        held = self._reserve_held()
        try:
            os.unlink(self._reserve_path())
        except OSError:
            pass
        return held

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
                self._check_cancel()
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
        now = self.clock()
        dropped_corrupt = dropped_expired = dropped_budget = dropped_index = 0
        stale = []
        deleting = not self._read_only  # (a reader, or a database opened read-only for lack of space, keeps them)
        newer: collections.Counter = collections.Counter()
        it = self._db.iter()
        it.seek(_IDX)
        try:
            n = 0
            while it.valid():
                k = it.key()
                if not k.startswith(_IDX):
                    break
                n += 1
                if n % 4096 == 0:
                    self._check_cancel()
                key = k[1:]
                rec = it.value()
                version = newer_format(rec)
                if version is not None:  # a newer build's: kept as it is, for that build (never dropped)
                    newer[version] += 1
                    if key not in self.foreign:
                        self.index_used += foreign_ram(key)
                    self.foreign[key] = len(k) + len(rec)
                    it.next()
                    continue
                e = _decode_index(key, rec)
                ram = 0 if e is None else index_ram(key, e)
                if e is None:
                    dropped_corrupt += 1
                    stale.append(key)
                elif e.expires <= now:
                    dropped_expired += 1
                    stale.append(key)
                elif self.used + e.nbytes > self.budget:  # budget lowered since last run
                    dropped_budget += 1
                    stale.append(key)
                elif self.index_used + ram > self.index_bytes:  # index bound lowered (or a build before it)
                    dropped_index += 1
                    stale.append(key)
                else:
                    self.index[key] = e
                    self.used += e.nbytes
                    self.index_used += ram
                if len(stale) >= 4096:  # deleted as it goes: a list of every key dropped could be as large
                    self._delete_records(stale if deleting else [], payloads=False)  # as the index kept out of RAM
                    stale = []
                it.next()
        finally:
            del it
        self._delete_records(stale if deleting else [], payloads=False)  # (their payloads: orphans, below)
        stale = []
        # payloads without an index record (cannot happen with atomic batches; cleaned up anyway)
        orphans = 0
        it = self._db.iter()
        it.seek(_DAT)
        try:
            while it.valid():
                k = it.key()
                if not k.startswith(_DAT):
                    break
                if k[1:] in self.foreign:
                    self.foreign[k[1:]] += len(k) + len(it.value())
                elif k[1:] not in self.index:
                    orphans += 1
                    stale.append(k[1:])
                    if len(stale) >= 4096:
                        self._delete_records(stale if deleting else [])
                        stale = []
                it.next()
        finally:
            del it
        self._delete_records(stale if deleting else [])
        self.foreign_bytes = sum(self.foreign.values())
        self._expiry.rebuild((key, e.expires) for key, e in self.index.items())
        # re-seed the policy oldest first, parents before children
        for key in sorted(self.index, key=lambda k: self.index[k].created):
            e = self.index[key]
            self.policy.inserted(key, e.nbytes, e.parent if e.parent in self.index else None)
        self.counters["dropped_corrupt"] += dropped_corrupt
        self.counters["dropped_expired"] += dropped_expired
        self.open_report.update(entries=len(self.index), bytes=self.used, dropped_corrupt=dropped_corrupt,
                                dropped_expired=dropped_expired, dropped_over_budget=dropped_budget,
                                dropped_over_index=dropped_index, index_ram_bytes=self.index_used,
                                index_bytes=self.index_bytes,
                                dropped_orphans=orphans, kept_newer=len(self.foreign),
                                kept_newer_bytes=self.foreign_bytes)
        if newer:
            log.warning("disk tier %s holds %d records (%d bytes) written by a newer promptcache (%s; this build "
                        "reads index versions 1-%d): they are kept in place for it, not served, and count against "
                        "the budget", self.path, len(self.foreign), self.foreign_bytes,
                        ", ".join(f"{v}: {c}" for v, c in sorted(newer.items())), INDEX_VERSION)
        if dropped_corrupt:
            log.warning("disk tier %s: dropped %d records that failed their checksum", self.path, dropped_corrupt)
        if dropped_index:
            log.warning("disk tier %s: dropped %d records over the index's RAM bound (%d bytes, --disk-index-bytes; "
                        "it keeps %d records, %d bytes of RAM)%s", self.path, dropped_index, self.index_bytes,
                        len(self.index), self.index_used, "" if deleting else "; left on disk (opened read-only)")

    def _delete_records(self, keys, payloads: bool = True) -> None:
        """At open: delete these records' index records (and payloads) in one batch."""
        import rocksdict as rd

        if not keys:
            return
        wb = rd.WriteBatch(raw_mode=True)
        for key in keys:
            wb.delete(_IDX + key)
            if payloads:
                wb.delete(_DAT + key)
        self._db.write(wb, self._write_opts)

    # ------------------------------------------------------------------------------------------------ serving
    def put(self, key: bytes, payload, meta: bytes = b"", parent: bytes | None = None,
            ttl_seconds: float | None = None, created: float | None = None, last_access: float | None = None,
            hits: int = 0, owner: str = "", ttl_hint: float | None = None, pinned: bool = False) -> bool:
        """Queue a chunk for writing. Returns False (and counts why) when it is not taken: too large, disk full,
        write queue full, or closed. Never blocks on I/O. `created`: when the chunk was first stored anywhere
        (this tier's clock, wall time), kept in the record so its maximum lifetime survives restarts.
        `last_access` (wall time) and `hits`: how hot it was in memory, what warm-up orders by; `owner`: whose
        quota it is charged to when warm-up brings it back; `ttl_hint`: its own sliding TTL once back in memory;
        `pinned`: a priority hint had pinned it in memory (it is pinned again when it comes back)."""
        payload = bytes(payload)
        now = self.clock()
        # (times from a file or a peer: a NaN or infinite one would never compare as expired - clamped)
        born = now if created is None or not math.isfinite(created) else min(created, now)
        ttl = self.ttl if ttl_seconds is None or not math.isfinite(ttl_seconds) else ttl_seconds
        seen = born if last_access is None or not math.isfinite(last_access) else min(max(last_access, born), now)
        e = DiskEntry(len(payload) + len(meta) + RECORD_OVERHEAD, len(payload), payload_checksum(key, payload),
                      born, now + ttl, bytes(meta), parent, seen, max(0, int(hits)), owner,
                      float(ttl_hint) if ttl_hint and math.isfinite(ttl_hint) else 0.0, bool(pinned))
        ram = index_ram(key, e)
        with self._lock:
            if self._closed:
                self.counters["put_rejected_closed"] += 1
                return False
            if self.reader:
                self.counters["put_rejected_reader"] += 1
                return False
            if key in self.foreign:  # a newer build's record under this key: left for it, not overwritten
                self.counters["put_rejected_newer_record"] += 1
                return False
            if e.nbytes > self.budget or ram > self.index_bytes:
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
            while True:  # evict for the byte budget, then for the index's RAM bound (as a capacity eviction)
                if self.used + e.nbytes > self._effective_budget():
                    reason = "evicted_capacity"
                elif self.index_used + ram > self.index_bytes:
                    reason = "evicted_index"
                else:
                    break
                v = self.policy.victim()
                if v is None:
                    break
                self._drop_locked(v)
                self.counters[reason] += 1
            if self.used + e.nbytes > self.budget - self.foreign_bytes:
                self.counters["put_rejected_too_large"] += 1
                return False
            if self.index_used + ram > self.index_bytes:  # nothing left to evict (a newer build's records)
                self.counters["put_rejected_index_full"] += 1
                return False
            self.pending[key] = (e, payload)
            self._queue_expiry(key, e)
            self.used += e.nbytes
            self.index_used += ram
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
            if db is None:
                raise DiskTierError("closed")
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

    def entry(self, key: bytes) -> DiskEntry | None:
        """The live (unexpired) record of `key`, written or still queued; no policy side effects."""
        with self._lock:
            p = self.pending.get(key)
            e = self.index.get(key) if p is None else p[0]
            return None if e is None or e.expires <= self.clock() else e

    def hottest(self) -> list[tuple[bytes, DiskEntry]]:
        """Every live record, hottest first (DiskEntry.hotness: hit count, then last access): warm-up's order."""
        now = self.clock()
        with self._lock:
            live = [(k, e) for k, e in self.index.items() if e.expires > now]
            live += [(k, p[0]) for k, p in self.pending.items() if p[0].expires > now]
        live.sort(key=lambda ke: ke[1].hotness(), reverse=True)
        return live

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
            if dead:  # a purge gives its space back as soon as its deletes are written, however few they are
                self._reclaim_when_drained = True
            return len(dead)

    def _drop_locked(self, key: bytes) -> bool:
        p = self.pending.pop(key, None)
        e = self.index.pop(key, None) if p is None else p[0]
        if p is not None:
            self.index.pop(key, None)
        if e is None:
            return False
        self.used -= e.nbytes
        self.index_used -= index_ram(key, e)
        self.policy.removed(key)
        if self.reader:  # a reader deletes nothing: the record is only no longer offered
            return True
        self._ops.append(("del", key, e.nbytes))
        self._cv.notify()
        return True

    def _queue_expiry(self, key: bytes, e: DiskEntry) -> None:
        self._expiry.push(key, e.expires, len(self.index) + len(self.pending), self._live_expiries)

    def _live_expiries(self):
        yield from ((k, e.expires) for k, e in self.index.items())
        yield from ((k, e.expires) for k, (e, _) in self.pending.items() if k not in self.index)

    def _record(self, key: bytes) -> DiskEntry | None:
        p = self.pending.get(key)
        return p[0] if p is not None else self.index.get(key)

    def sweep_expired(self) -> int:
        """Drop every record whose TTL has passed; O(log n) per record due, nothing when none is."""
        now = self.clock()
        dead = 0
        with self._lock:
            for key, at in self._expiry.pop_due(now):
                e = self._record(key)
                if e is None or e.expires != at:
                    continue  # left, or replaced by a record with its own item
                self._drop_locked(key)
                dead += 1
            self.counters["evicted_ttl"] += dead
        return dead

    # ------------------------------------------------------------------------------------------------ writer
    def _recheck_space_locked(self, now: float, need: int) -> bool:
        """While flagged full, look at the free space at most once a second; clear the flag when it is back."""
        if self._broken or now - self._disk_full_since < 1.0:
            return False
        self._disk_full_since = now
        if self._room_to_write(need, self.plan.resume_margin):
            self.disk_full = False
            log.warning("disk tier %s: free space is back; spilling resumes", self.path)
            return True
        return False

    def _effective_budget(self) -> int:
        """What this build's own records may use: the budget (or the space cap), less a newer build's records."""
        own = self.budget - self.foreign_bytes
        return own if self._space_cap is None else min(own, self._space_cap)

    def _make_room_locked(self, need: int) -> None:
        """The volume is full before the budget is: from now on the budget is what the volume holds (less
        room for `need` and two memtables), and the oldest records go (eviction, as for the budget) so their
        space comes back (the deletes are compacted at once while full) and spilling resumes. Deletes already
        queued or written but not yet compacted count as room coming back: the free space lags them until the
        next reclaim, and evicting again for each batch that finds no room before then would empty the tier
        (a slow reclaim under load evicted all of it)."""
        coming_back = self._deleted_since_reclaim + sum(op[2] for op in self._ops if op[0] == "del")
        if coming_back >= need:
            return
        cap = max(0, self.used - (need - coming_back) - self.plan.write_buffer)
        self._space_cap = cap if self._space_cap is None else min(cap, self._space_cap)
        while self.used > self._space_cap:
            v = self.policy.victim()
            if v is None:
                break
            self._drop_locked(v)
            self.counters["evicted_space"] += 1

    def _fills_its_volume(self) -> bool:
        """Whether the tier's own records are most of what fills the volume: then it yields space by evicting
        its oldest. Filled by something else, it only stops spilling and waits (it does not fight for room)."""
        try:
            usage = shutil.disk_usage(self.path)
        except OSError:
            return False
        return self.used + self._reserve_held() >= (usage.total - usage.free) // 2

    def _maybe_raise_cap(self) -> None:
        """Free space came back from elsewhere (another file removed): let the budget grow back towards it."""
        now = time.monotonic()
        if self._space_cap is None or self.disk_full or now - self._cap_checked < 5.0:
            return
        self._cap_checked = now
        room = self._free_bytes() - self.min_free_bytes - 3 * self.plan.write_buffer
        if room > 0:
            with self._lock:
                self._space_cap += room
                if self._space_cap >= self.budget:
                    self._space_cap = None

    def _room_to_write(self, need: int, margin: int = 0) -> bool:
        """Whether `need` more bytes may be written: the reserve is in place and the memtable can still be
        flushed with min_free_bytes left over (SpacePlan)."""
        return (self._reserve_held() >= self.plan.reserve
                and self._free_bytes() >= self.min_free_bytes + self.plan.write_buffer + need + margin)

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
                while self._ops and len(batch) < 64 and nbytes < min(64 << 20, self.plan.write_buffer):
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
        elif puts and not self._room_to_write(nbytes):
            self._set_disk_full(f"free space below {self.min_free_bytes} bytes (--disk-min-free-bytes) plus "
                                f"{self.plan.write_buffer} for RocksDB's memtable, or its reserve not in place")
            if self._fills_its_volume():  # evict to make room (for the reserve too, when it is not in place)
                with self._lock:
                    self._make_room_locked(nbytes + max(0, self.plan.reserve - self._reserve_held()))
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
                    self.index_used -= index_ram(key, e)
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
        drained = self._reclaim_when_drained and not self._ops
        if drained or self._reclaim_retries or reclaim_due(self._deleted_since_reclaim, self.disk_full,
                                                           self._effective_budget(), self._volume_bytes()):
            if drained:
                self._reclaim_when_drained = False
            if self._deleted_since_reclaim:
                self._reclaim()
        self._maybe_raise_cap()
        if self.disk_full and not self._broken and now - self._last_space_check >= 1.0:
            self._last_space_check = now
            self._ensure_reserve()
            room = self._room_to_write(0, self.plan.resume_margin)
            if not room and self._fills_its_volume():
                # Its own records fill the volume (a restart on it, deletes not enough): make the room itself.
                deficit = (self.min_free_bytes + self.plan.write_buffer + self.plan.resume_margin
                           - self._free_bytes()) + max(0, self.plan.reserve - self._reserve_held())
                if deficit > 0:
                    with self._lock:
                        self._make_room_locked(deficit)
            with self._lock:
                if self.disk_full and room:
                    self.disk_full = False
                    log.warning("disk tier %s: free space is back (%d bytes); spilling resumes", self.path,
                                self._free_bytes())

    def _reclaim(self) -> None:
        """Flush the memtable (drops records deleted before they reached a file, and frees the WAL) and compact
        everything (drops tombstones; blob files left without live records are deleted)."""
        before = self._free_bytes()
        if before < self.min_free_bytes + self.plan.reserve:
            before += self._release_reserve()  # the flush and the compaction need room to give space back
            self.counters["reserve_released"] += 1
        try:
            self._db.flush()
            self._compact()
        except Exception as exc:
            log.error("disk tier %s: compaction to free deleted space failed: %s", self.path, exc)
            self._set_disk_full(f"compaction failed: {exc}", broken=True)
            self._ensure_reserve()
            return
        after = self._free_bytes()
        self._ensure_reserve()
        self.counters["reclaims"] += 1
        log.info("disk tier %s: compacted after deleting %d bytes; the volume has %d bytes more free", self.path,
                 self._deleted_since_reclaim, after - before)
        if after - before < self._deleted_since_reclaim // 2 and self._reclaim_retries < RECLAIM_RETRIES:
            # RocksDB sometimes deletes the obsolete blob files of a compaction only later: keep the deleted
            # bytes due, so the writer flushes and compacts again at its next round (a bounded number of times).
            self._reclaim_retries += 1
            return
        self._reclaim_retries = 0
        self._deleted_since_reclaim = 0

    def _compact(self) -> None:
        """Compact everything: tombstones go, and blob files left without live records are deleted. Blob garbage
        collection (rewriting the live records of the oldest quarter of the blob files) needs room for what it
        rewrites, so it is off for this compaction unless the volume has that much free."""
        gc = self._free_bytes() >= self.used // 4 + self.plan.reserve
        if not gc:
            try:
                self._db.set_options({"enable_blob_garbage_collection": "false"})
            except Exception:  # noqa: BLE001 - an older RocksDB: compact with it on
                gc = True
        try:
            self._db.compact_range(None, None)
        finally:
            if not gc:
                try:
                    self._db.set_options({"enable_blob_garbage_collection": "true"})
                except Exception:  # noqa: BLE001
                    pass

    def _recover(self) -> None:
        """After a RocksDB write error the handle stays read-only until reopened (rocksdict has no Resume), and a
        database opened read-only (no room at start) must be reopened for writing: close it, release the
        reserve, open again, delete every record the index no longer holds (deletes that failed meanwhile),
        flush and compact (the space goes back), allocate the reserve again. If that fails the database is
        opened read-only again, so what it holds is still served."""
        import rocksdict as rd

        with self._lock:
            known = set(self.index) | set(self.pending)
        if self._free_bytes() + self._reserve_held() < self.plan.reserve and known:
            self.counters["reopen_waits"] += 1  # no room to open yet; nothing is tried, nothing is written
            return
        self._close_db()
        self._release_reserve()
        opts = self._options()
        opts.create_if_missing(False)  # a folder removed under us stays an error, not a new empty database
        stale = []
        try:
            self._db = rd.Rdict(self.path, opts)
            it = self._db.iter()
            it.seek_to_first()
            try:
                while it.valid():
                    k = it.key()
                    if k[1:] not in known and k[:1] in (_IDX, _DAT) and k[1:] not in self.foreign:
                        stale.append(k)
                    it.next()
            finally:
                del it
            wb = rd.WriteBatch(raw_mode=True)
            for k in stale:
                wb.delete(k)
            self._db.write(wb, self._write_opts)
            self._db.flush()
            self._compact()
        except Exception as exc:  # noqa: BLE001 - still no space, or the files went away: try again later
            self.counters["reopen_failures"] += 1
            if self.counters["reopen_failures"] % 60 == 1:  # the first failure, then every two minutes or so
                log.error("disk tier %s: reopening RocksDB after an error failed: %s; retrying every %g s",
                          self.path, exc, RECOVERY_INTERVAL)
            self._close_db()
            if not known and not self.foreign and is_no_space_error(str(exc)) and self._start_afresh():
                return
            self._reopen_read_only()
            self._ensure_reserve()
            return
        self._broken = False
        self._read_only = False
        self._deleted_since_reclaim = 0
        self.counters["reopens"] += 1
        self._ensure_reserve()
        log.warning("disk tier %s: RocksDB reopened for writing; %d stale records deleted", self.path,
                    len(stale) // 2)

    def _close_db(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except Exception:  # noqa: BLE001 - closing a broken handle reports its error again; it closes anyway
                pass

    def _reopen_read_only(self) -> None:
        import rocksdict as rd

        opts = self._options()
        opts.create_if_missing(False)
        try:
            self._db = rd.Rdict(self.path, opts, access_type=rd.AccessType.read_only())
            self._read_only = True
        except Exception:  # noqa: BLE001 - nothing readable: every read is a miss until the next attempt
            self._db = None

    def _start_afresh(self) -> bool:
        """The index holds nothing (everything was deleted) but RocksDB cannot even open to drop it (a
        volume filled before this version kept a reserve): remove its files and start an empty database."""
        import rocksdict as rd

        try:
            for name in os.listdir(self.path):
                if name not in (OWNER_FILE,):
                    full = os.path.join(self.path, name)
                    shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.unlink(full)
            self._db = rd.Rdict(self.path, self._options())
        except Exception as exc:  # noqa: BLE001
            log.error("disk tier %s: starting an empty database failed: %s", self.path, exc)
            self._close_db()
            return False
        self._broken = self._read_only = False
        self._deleted_since_reclaim = 0
        self.counters["reopens"] += 1
        self.counters["started_afresh"] += 1
        self._ensure_reserve()
        log.warning("disk tier %s: every record was deleted and RocksDB had no room to open; started an empty "
                    "database", self.path)
        return True

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
        if self._writer is not None:
            self._writer.join()
        db, self._db = self._db, None
        if db is None:
            self._remove_view()
            return
        if self.reader:
            try:
                db.close()
            finally:
                self._remove_view()
            return
        if not self._read_only and self._free_bytes() < self.min_free_bytes + self.plan.reserve:
            self._release_reserve()  # closing flushes the memtable: it needs room (allocated again at open)
        try:
            db.close()
        except Exception as exc:  # noqa: BLE001 - RocksDB raises plain Exception
            if not is_no_space_error(str(exc)):
                raise
            # Not flushed for lack of space: the WAL still holds every committed write (replayed at open).
            log.warning("disk tier %s: closed without flushing its memtable (no space: %s); the WAL keeps the "
                        "writes", self.path, exc)

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self.index) + len(self.pending), "bytes_used": self.used,
                    "budget_bytes": self.budget, "space_cap_bytes": self._space_cap or 0,
                    "index_ram_bytes": self.index_used, "index_bytes": self.index_bytes,
                    "queued_puts": self._queued_puts,
                    "queued_bytes": self._queued_bytes, "disk_full": self.disk_full,
                    "foreign_entries": len(self.foreign), "foreign_bytes": self.foreign_bytes, **self.counters}


def open_or_exit(path: str, budget_bytes: int, **kwargs) -> DiskTier:
    """For the sidecar's start-up: a DiskTier, or exit with a message naming the path."""
    try:
        return DiskTier(path, budget_bytes, **kwargs)
    except DiskTierError as exc:
        raise SystemExit(f"promptcache: {exc}") from None
