"""Snapshot files: the hottest chunks of a sidecar's data folder, to warm another (or a rebuilt) one with.

`promptcache export --address HOST:PORT --output FILE [--max-bytes N]` asks a running sidecar for its hottest N
bytes (the admin Export call: its memory tier by hit count then recency, then its disk tier; it keeps serving) and
verifies the file whole before it is renamed into place. `promptcache export --data-dir DIR ...` writes the
hottest N bytes of the disk tier in DIR instead, opening it read-only: nothing in DIR is written, no lock is taken,
so it works beside a sidecar serving from DIR (what that sidecar has committed to its disk tier; its memory tier is
not in DIR: a graceful stop demotes it there, so a stopped sidecar's folder holds all it had).
`promptcache import FILE --data-dir DIR --disk-bytes N` puts
a snapshot into a disk tier (the sidecar warms its memory from it at start), and `serve --warmup-snapshot FILE`
loads one straight into the memory tier at start (promptcache.sidecar.warmup).

Format (version 1, little-endian):
  header   8s magic b"PCSNAP\\0\\1", u32 version
  record   u8 key length, key, u32 meta length, meta (promptcache.sidecar.tiers.disk's chunk meta: fingerprint, parent,
           index, dtype, shape, the chunk's own xxh3), u8 parent length, parent, u16 owner length, owner (UTF-8),
           f64 created, f64 expires, f64 last access (wall time), u32 hits, u64 payload length,
           u64 payload xxh3 (seeded with the key, as the disk tier's), payload
  trailer  8s b"PCSNAPEN", u64 record count, u64 xxh3_64 of every byte before the trailer
Records are hottest first, each chunk's ancestors before it. A reader verifies the whole file (magic, version,
every record's framing and both checksums, finite times, the count and the file checksum) before it stores
anything: a truncated, corrupt or foreign file is refused with a SnapshotError naming the file, and nothing of it is
stored. A record's payload is at most the largest chunk a sidecar holds (--max-chunk-bytes, default 256 MiB): a
longer one is refused before anything is allocated, and a payload is verified in 1 MiB pieces, so reading a file
takes bounded memory whatever it claims.

Files: a snapshot is written to a temporary file made O_EXCL, mode 0600, in the output's folder (it holds every
tenant's chunks), verified, then renamed into place. `export` refuses an --output inside a sidecar's data folder
(the --data-dir it reads, or any RocksDB folder of a disk tier), and an existing file that is not a snapshot
unless --force is given. `import` never drops what the data folder holds: it refuses a --disk-bytes below what is
stored there, and when the file turns out bad while it is being stored, the records it stored are deleted again.
"""
from __future__ import annotations

import math
import os
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import xxhash

MAGIC = b"PCSNAP\x00\x01"
END = b"PCSNAPEN"
VERSION = 1
_HEAD = struct.Struct("<8sI")
_TIMES = struct.Struct("<dddIQQ")  # created, expires, last access, hits, payload length, payload xxh3
_TRAILER = struct.Struct("<8sQQ")
MAX_CHUNK_BYTES = 256 << 20  # the sidecar's default --max-chunk-bytes (Settings.max_chunk_bytes): no chunk is larger
FRAME_MAX_PAYLOAD = 1 << 34  # a length past this is a corrupt file whatever the limit (checking a written file)
PIECE = 1 << 20  # a payload is hashed in pieces of this many bytes when it is only verified


class SnapshotError(ValueError):
    """A snapshot file that cannot be used (the message names the file and what is wrong)."""


@dataclass
class Record:
    key: bytes
    meta: bytes
    parent: bytes | None
    owner: str
    created: float
    expires: float
    last_access: float
    hits: int
    payload: bytes


def _encode(r: Record) -> bytes:
    from promptcache.sidecar.disk import payload_checksum

    parent, owner = r.parent or b"", r.owner.encode()
    return (struct.pack("<B", len(r.key)) + r.key + struct.pack("<I", len(r.meta)) + r.meta
            + struct.pack("<B", len(parent)) + parent + struct.pack("<H", len(owner)) + owner
            + _TIMES.pack(r.created, r.expires, r.last_access, r.hits, len(r.payload),
                          payload_checksum(r.key, r.payload)) + r.payload)


class _Reader:
    def __init__(self, path: str, f):
        self.path, self.f = path, f
        self.hash = xxhash.xxh3_64()

    def take(self, n: int, what: str) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise SnapshotError(f"snapshot {self.path}: truncated ({what}: {len(b)} of {n} bytes)")
        self.hash.update(b)
        return b


def _records(path: str, verify_only: bool, max_payload: int = MAX_CHUNK_BYTES,
             limit_name: str = "--max-chunk-bytes", tally: list | None = None) -> Iterator[Record]:
    """The file's records, each checked as it is read (the trailer at the end); with verify_only, nothing is
    yielded and each payload is hashed in PIECE-sized reads, never held whole. A payload over `max_payload` is
    refused before it is read. `tally` ([records, payload bytes]) counts the records checked."""
    from promptcache.sidecar.tiers.disk import decode_meta

    try:
        f = open(path, "rb")
    except OSError as exc:
        raise SnapshotError(f"snapshot {path}: cannot be read: {exc.strerror or exc}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(path, f)
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size or head[:6] != MAGIC[:6]:
            raise SnapshotError(f"snapshot {path}: not a PromptCache snapshot (no {MAGIC[:6]!r} header; written "
                                "by `promptcache export`?)")
        magic, version = _HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise SnapshotError(f"snapshot {path}: format version {version} is not supported (this build reads "
                                f"version {VERSION})")
        r.hash.update(head)
        count = 0
        while True:
            if f.tell() + _TRAILER.size > size:
                raise SnapshotError(f"snapshot {path}: truncated (no trailer after {count} records)")
            if f.tell() + _TRAILER.size == size:
                tail = f.read(_TRAILER.size)
                end, n, chk = _TRAILER.unpack(tail)
                if end != END:
                    raise SnapshotError(f"snapshot {path}: corrupt (bad trailer after {count} records)")
                if n != count:
                    raise SnapshotError(f"snapshot {path}: corrupt (the trailer counts {n} records, the file "
                                        f"holds {count})")
                if chk != r.hash.intdigest():
                    raise SnapshotError(f"snapshot {path}: corrupt (file checksum mismatch)")
                return
            (klen,) = struct.unpack("<B", r.take(1, "record"))
            key = r.take(klen, "key")
            (mlen,) = struct.unpack("<I", r.take(4, "record"))
            if mlen > 1 << 16:
                raise SnapshotError(f"snapshot {path}: corrupt (record {count}: meta length {mlen})")
            meta = r.take(mlen, "meta")
            (plen,) = struct.unpack("<B", r.take(1, "record"))
            parent = r.take(plen, "parent") or None
            (olen,) = struct.unpack("<H", r.take(2, "record"))
            try:
                owner = r.take(olen, "owner").decode()
            except UnicodeDecodeError:
                raise SnapshotError(f"snapshot {path}: corrupt (record {count}: owner is not UTF-8)") from None
            created, expires, last, hits, length, chk = _TIMES.unpack(r.take(_TIMES.size, "record"))
            for name, t in (("created", created), ("expires", expires), ("last access", last)):
                if not math.isfinite(t):
                    raise SnapshotError(f"snapshot {path}: corrupt (record {count}: {name} time {t} is not a "
                                        "finite number)")
            if length > max_payload:
                raise SnapshotError(f"snapshot {path}: corrupt (record {count}: a payload of {length} bytes, more "
                                    f"than the largest chunk a sidecar holds: {max_payload} bytes, {limit_name})")
            if f.tell() + length > size:
                raise SnapshotError(f"snapshot {path}: truncated (record {count}: payload of {length} bytes "
                                    "runs past the end)")
            decoded = decode_meta(meta)
            if decoded is None:
                raise SnapshotError(f"snapshot {path}: corrupt (record {count}: chunk meta)")
            seeded = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(key))  # disk.payload_checksum, piece by piece
            plain = xxhash.xxh3_64()
            if verify_only:
                payload = b""
                left = length
                while left:
                    piece = r.take(min(left, PIECE), "payload")
                    seeded.update(piece)
                    plain.update(piece)
                    left -= len(piece)
            else:
                payload = r.take(length, "payload")
                seeded.update(payload)
                plain.update(payload)
            if seeded.intdigest() != chk or plain.intdigest() != decoded[4]:
                raise SnapshotError(f"snapshot {path}: corrupt (record {count}: payload checksum mismatch)")
            count += 1
            if tally is not None:
                tally[0] += 1
                tally[1] += length
            if not verify_only:
                yield Record(key, meta, parent, owner, created, expires, last, hits, payload)


def verify(path: str, max_payload: int = MAX_CHUNK_BYTES) -> int:
    """Check the whole file (in bounded memory); returns its record count. SnapshotError when it is not usable."""
    return _tally(path, max_payload)[0]


def _tally(path: str, max_payload: int = MAX_CHUNK_BYTES, limit_name: str = "--max-chunk-bytes") -> tuple[int, int]:
    """Check the whole file, holding no payload; returns (records, payload bytes)."""
    tally = [0, 0]
    for _ in _records(path, True, max_payload, limit_name, tally):  # (yields nothing)
        pass
    return tally[0], tally[1]


def read_snapshot(path: str, max_payload: int = MAX_CHUNK_BYTES) -> Iterator[Record]:
    """The records of a verified file (verified whole first, in bounded memory; each record is checked again as it
    is read, so a file changed between the two reads stops at the first bad record, never serves it). A payload
    over `max_payload` (the sidecar's --max-chunk-bytes) is refused."""
    verify(path, max_payload)
    return _records(path, False, max_payload)


def encode_stream(records) -> Iterator[bytes]:
    """The file's bytes, record by record: header, each record, trailer (count and checksum)."""
    h = xxhash.xxh3_64()
    head = _HEAD.pack(MAGIC, VERSION)
    h.update(head)
    yield head
    count = 0
    for r in records:
        b = _encode(r)
        h.update(b)
        count += 1
        yield b
    yield _TRAILER.pack(END, count, h.intdigest())


def write_pieces(path: str, pieces, verify_first: bool = False) -> tuple[int, int]:
    """Write the byte strings `pieces` to `path` atomically: a temporary file made O_EXCL and 0600 in the same
    folder (tempfile.mkstemp: an unpredictable name, never a link planted there), renamed into place; with
    verify_first, the whole file is verified (SnapshotError) before the rename. Returns (records, payload bytes)
    when verified, else (0, bytes written)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise SnapshotError(f"--output {path}: cannot create a file in {folder}: {exc.strerror or exc}") from None
    n = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for b in pieces:
                f.write(b)
                n += len(b)
            f.flush()
            os.fsync(f.fileno())
        tally = (0, n)
        if verify_first:
            try:
                tally = _tally(tmp, FRAME_MAX_PAYLOAD, "the format's limit")
            except SnapshotError as exc:
                raise SnapshotError(str(exc).replace(tmp, path)) from None
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return tally


def _is_data_folder(folder: str) -> bool:
    """Is `folder` a disk tier's RocksDB folder, or a sidecar's --data-dir (holding one in rocksdb/)?"""
    def rocksdb(d: str) -> bool:
        return os.path.isfile(os.path.join(d, "CURRENT")) and os.path.isfile(os.path.join(d, "IDENTITY"))
    return rocksdb(folder) or rocksdb(os.path.join(folder, "rocksdb"))


def check_output(path: str, data_dir: str | None = None, force: bool = False) -> None:
    """SnapshotError unless `path` may be written: not inside `data_dir` (the folder an export reads) nor inside
    any sidecar data folder or RocksDB folder (by its real path: links resolved), not a folder or a special file,
    and, unless `force`, either absent or a snapshot already (its magic): any other file is not replaced."""
    real = os.path.realpath(path)
    if data_dir is not None:
        d = os.path.realpath(data_dir)
        if real == d or real.startswith(d.rstrip(os.sep) + os.sep):
            raise SnapshotError(f"--output {path} is inside --data-dir {data_dir} (the disk tier being read: "
                                "writing there would replace its files); name a file outside it")
    folder = os.path.dirname(real)
    while True:
        if _is_data_folder(folder):
            raise SnapshotError(f"--output {path} is inside {folder}, a sidecar's data folder (a disk tier's "
                                "files: writing there would replace them); name a file outside it")
        up = os.path.dirname(folder)
        if up == folder:
            break
        folder = up
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SnapshotError(f"--output {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SnapshotError(f"--output {path} is a directory; name a file")
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotError(f"--output {path} is not a regular file (a FIFO, socket or device); name a file")
    if force:
        return
    try:
        with open(real, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as exc:
        raise SnapshotError(f"--output {path} exists and cannot be read to check it is a snapshot "
                            f"({exc.strerror or exc}); not replaced (--force replaces it)") from None
    if head[:6] != MAGIC[:6]:
        raise SnapshotError(f"--output {path} exists and is not a PromptCache snapshot; not replaced (--force "
                            "replaces it)")


def write_snapshot(path: str, records) -> tuple[int, int]:
    """Write `records` to `path` (atomically: a temporary file renamed into place). Returns (records, bytes)."""
    counted = {"records": 0, "payload": 0}

    def counting():
        for r in records:
            counted["records"] += 1
            counted["payload"] += len(r.payload)
            yield r
    write_pieces(path, encode_stream(counting()))
    return counted["records"], counted["payload"]


def live_records(memory, disk, max_bytes: int, wall=time.time) -> Iterator[Record]:
    """A running sidecar's chunks as snapshot records, hottest first: its memory tier (hit count, then recency),
    then its disk tier's (DiskTier or None) not already taken, each chunk after its ancestors, at most `max_bytes`
    of payload (0: all). Each memory chunk is read under a lease (its memory cannot be reused meanwhile) and
    checked against its checksum; one that changed or left meanwhile is passed over, as are its descendants."""
    from promptcache.sidecar import hotlist
    from promptcache.sidecar.tiers.disk import decode_meta, encode_meta

    taken: set[bytes] = set()
    total = 0
    entries = memory.snapshot()
    for hot in hotlist.hot_order(entries, max_entries=len(entries) + 1,
                                 max_bytes=max_bytes or None):
        entry = memory.lease(hot.key, hot.fingerprint)
        if entry is None:
            continue
        try:
            if entry.index and entry.parent not in taken:
                continue  # its parent was passed over: it would be unreachable
            payload = entry.array.tobytes() if entry.data.device.type == "cpu" else entry.data.cpu().numpy().tobytes()
            if xxhash.xxh3_64_intdigest(payload) != entry.checksum:
                continue
            now, mono = wall(), memory.clock()
            record = Record(entry.key, encode_meta(entry), entry.parent, entry.owner,
                            created=now - (mono - memory.birth(entry)), expires=now + (entry.expires - mono),
                            last_access=now - (mono - (entry.last_access or entry.created)), hits=entry.hits,
                            payload=payload)
        finally:
            memory.release_lease(entry)
        taken.add(record.key)
        total += len(payload)
        yield record
    if disk is None:
        return
    for key in hottest_chains(disk):
        if key in taken:
            continue
        e = disk.entry(key)
        decoded = decode_meta(e.meta) if e is not None else None
        if decoded is None or (decoded[2] and decoded[1] not in taken):
            continue  # (hottest_chains puts a held parent first: one not taken is not held)
        if max_bytes and total + e.length > max_bytes:
            break
        payload = disk.get(key)  # verified against its checksum
        if payload is None:
            continue
        taken.add(key)
        total += e.length
        yield Record(key, e.meta, e.parent, e.owner, e.created, e.expires, e.last_access or e.created, e.hits,
                     bytes(payload))


def hottest_chains(disk, first: Iterable[bytes] = ()) -> list[bytes]:
    """The disk tier's keys, `first` (those it holds: the resident list, warmup.read_resident) then the rest hottest
    first (DiskTier.hottest), each one's ancestors (those it holds) before it."""
    out, seen = [], set()
    ranked = [(key, e) for key in first if (e := disk.entry(key)) is not None] + disk.hottest()
    for key, e in ranked:
        if key in seen:
            continue
        chain, parent = [key], e.parent
        while parent is not None and parent not in seen and (pe := disk.entry(parent)) is not None:
            if len(chain) > len(ranked):  # (keys chain by hash: a loop means records were forged; stop)
                break
            chain.append(parent)
            parent = pe.parent
        for k in reversed(chain):
            if k not in seen:
                seen.add(k)
                out.append(k)
    return out


def _open_disk(data_dir: str, budget: int):
    from promptcache.sidecar.disk import DiskTier

    return DiskTier(os.path.join(data_dir, "rocksdb"), budget, lock_wait_seconds=0.0, min_free_bytes=0)


def export(data_dir: str, out: str, max_bytes: int, force: bool = False) -> tuple[int, int]:
    """The hottest `max_bytes` of payload (0: all) in the disk tier of `data_dir` to the file `out`: first what the
    memory tier held at the sidecar's last graceful stop (the resident list it wrote then, left in place), then the
    rest hottest first. `out` is checked first (check_output)."""
    check_output(out, data_dir, force)
    if not os.path.isdir(os.path.join(data_dir, "rocksdb")):
        raise SnapshotError(f"--data-dir {data_dir}: no disk tier there (no rocksdb folder)")
    from promptcache.sidecar.disk import DiskTier

    # Read-only: no lock taken (a running sidecar keeps its folder), nothing written or deleted there; over any
    # budget, so no record is passed over for one.
    disk = DiskTier(os.path.join(data_dir, "rocksdb"), 1 << 60, lock_wait_seconds=0.0, min_free_bytes=0,
                    reader=True)
    try:
        from promptcache.sidecar.warmup import read_resident

        def records():  # what memory held when the sidecar stopped first (its resident list), then the hottest
            total = 0
            for key in hottest_chains(disk, read_resident(disk.path)):
                e = disk.entry(key)
                if e is None:
                    continue
                if max_bytes and total + e.length > max_bytes:
                    break
                payload = disk.get(key)  # verified against its checksum
                if payload is None:
                    continue
                total += e.length
                yield Record(key, e.meta, e.parent, e.owner, e.created, e.expires, e.last_access or e.created,
                             e.hits, payload)
        return write_snapshot(out, records())
    finally:
        disk.close()


def import_into_disk(path: str, data_dir: str, budget: int, max_payload: int = MAX_CHUNK_BYTES) -> tuple[int, int]:
    """Put a verified snapshot's records into the disk tier of `data_dir` (budget `budget`), in the file's order
    (hottest first) until the next would not fit; what is there already stays: the tier is opened over any budget
    (its rebuild drops nothing that fits no budget), and a folder already holding more than `budget` is refused.
    When the file turns out bad while it is stored (changed since it was verified), the records stored from it
    are deleted again before the SnapshotError: nothing of a refused file stays. Returns (records, bytes)."""
    from promptcache.sidecar.disk import RECORD_OVERHEAD, default_index_bytes, record_index_ram

    records = read_snapshot(path, max_payload)
    disk = _open_disk(data_dir, 1 << 60)  # nothing stored is dropped for a budget at open
    # The RAM the sidecar's index may take for this --disk-bytes (its default --disk-index-bytes): a file of tiny
    # records stops there, as the budget stops it, rather than being trimmed at the sidecar's next start.
    index_bound = default_index_bytes(budget)
    count = nbytes = 0
    written: list[bytes] = []
    try:
        if disk.used > budget:
            raise SnapshotError(f"--data-dir {data_dir} already holds {disk.used} bytes, more than --disk-bytes "
                                f"{budget}; nothing imported (name the sidecar's --disk-bytes: a smaller budget "
                                "would drop what it holds)")
        now = time.time()
        full = False
        for r in records:  # read to its end even when full: the file is checked whole again (its trailer)
            if full or r.expires <= now or disk.entry(r.key) is not None:
                continue
            if disk.used + len(r.payload) + len(r.meta) + RECORD_OVERHEAD > min(budget, disk._effective_budget()) \
                    or disk.index_used + record_index_ram(r.key, r.meta, r.parent, r.owner) > index_bound:
                full = True
                continue
            for _ in range(2):
                if disk.put(r.key, r.payload, meta=r.meta, parent=r.parent, ttl_seconds=r.expires - now,
                            created=r.created, last_access=r.last_access, hits=r.hits, owner=r.owner):
                    written.append(r.key)
                    count += 1
                    nbytes += len(r.payload)
                    break
                disk.flush()  # the write queue was full
        if not disk.flush(timeout=600):
            raise SnapshotError(f"--data-dir {data_dir}: the disk tier did not finish its writes")
    except BaseException:
        for key in written:  # what this run stored of a file it refuses
            disk.delete(key)
        disk.flush(timeout=600)
        raise
    finally:
        disk.close()
    return count, nbytes


def as_record(r: Record):
    """A snapshot record as the tier stack's Record (to promote into memory), or None when it has expired."""
    import numpy as np

    from promptcache.sidecar.tiers import Record as TierRecord
    from promptcache.sidecar.tiers.disk import decode_meta

    wall = time.time()
    decoded = decode_meta(r.meta)
    if r.expires <= wall or decoded is None:
        return None
    fp, parent, index, dtype, value, shape = decoded
    return TierRecord(r.key, fp, parent, index, dtype, shape, value, np.frombuffer(r.payload, dtype=np.uint8),
                      ttl=r.expires - wall, age=max(0.0, wall - r.created), hits=r.hits,
                      idle=max(0.0, wall - r.last_access), owner=r.owner)


def add_arguments(sub) -> None:
    from promptcache.sidecar.config import parse_bytes

    from promptcache.admin import add_connection_arguments

    p = sub.add_parser("export", help="write the hottest chunks of a running sidecar (--address, admin) or of a "
                       "sidecar's disk tier read-only (--data-dir) to a snapshot file", description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-dir", help="a sidecar's --data-dir, read-only (it may be running: then only what "
                     "it has committed to its disk tier)")
    add_connection_arguments(p, address=src, output=False)  # --address: a running sidecar (the Export call)
    p.add_argument("--output", required=True, help="snapshot file to write")
    p.add_argument("--max-bytes", type=parse_bytes, default=0, help="at most this many payload bytes, hottest "
                   "first (a quantity such as 4Gi; 0: everything)")
    p.add_argument("--force", action="store_true", help="replace an existing --output that is not a snapshot "
                   "(a file inside a sidecar's data folder is refused even so)")
    p.set_defaults(admin_run=_run_export)
    p = sub.add_parser("import", help="verify a snapshot file and put it into a (stopped) sidecar's disk tier",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="snapshot file written by `promptcache export`")
    p.add_argument("--data-dir", help="the sidecar's --data-dir (required unless --verify-only)")
    p.add_argument("--disk-bytes", type=parse_bytes, help="the sidecar's --disk-bytes (required unless "
                   "--verify-only)")
    p.add_argument("--max-chunk-bytes", type=parse_bytes, default=MAX_CHUNK_BYTES, help="the sidecar's "
                   "--max-chunk-bytes: a record with a larger payload is refused (default 256Mi, the sidecar's)")
    p.add_argument("--verify-only", action="store_true", help="only check the file")
    p.set_defaults(admin_run=_run_import)


def _fail(exc: Exception) -> int:
    print(f"promptcache: {exc}", flush=True)
    return 2


def _run_export(args) -> int:
    from promptcache.client.credentials import CredentialError
    from promptcache.client.errors import PromptCacheError
    from promptcache.sidecar.disk import DiskTierError

    t = time.monotonic()
    try:
        if args.data_dir:
            n, b = export(args.data_dir, args.output, args.max_bytes, args.force)
        else:
            n, b = export_live(args)
    except (SnapshotError, DiskTierError, OSError, CredentialError, ValueError) as exc:
        return _fail(exc)
    except PromptCacheError as exc:  # its message starts with the gRPC code: PERMISSION_DENIED: ...
        print(f"promptcache export: {args.address}: {exc}", flush=True)
        return 1
    print(f"exported {n} chunks ({b} bytes) to {args.output} in {time.monotonic() - t:.2f} s", flush=True)
    return 0


def export_live(args) -> tuple[int, int]:
    """A running sidecar's Export call into args.output, verified whole before it is renamed into place."""
    from promptcache.admin import _check_credentials, _check_flags, _client

    _check_flags(args)
    _check_credentials(args)
    check_output(args.output, None, getattr(args, "force", False))
    with _client(args) as client:
        return write_pieces(args.output, client.export(args.max_bytes, timeout=args.timeout), verify_first=True)


def _run_import(args) -> int:
    from promptcache.sidecar.disk import DiskTierError

    from promptcache.sidecar.config import file_problem

    problem = file_problem(args.snapshot)  # (a FIFO would block; the file is read twice: verified, then imported)
    if problem:
        print(f"promptcache import: {args.snapshot}: {problem}", flush=True)
        return 2
    if args.max_chunk_bytes <= 0:
        print(f"promptcache import: --max-chunk-bytes must be positive, got {args.max_chunk_bytes}", flush=True)
        return 2
    t = time.monotonic()
    try:
        if args.verify_only:
            print(f"{args.snapshot}: {verify(args.snapshot, args.max_chunk_bytes)} chunks, verified", flush=True)
            return 0
        if not args.data_dir or not args.disk_bytes:
            print("promptcache import: --data-dir and --disk-bytes (positive) are required", flush=True)
            return 2
        n, b = import_into_disk(args.snapshot, args.data_dir, args.disk_bytes, args.max_chunk_bytes)
    except (SnapshotError, DiskTierError, OSError) as exc:
        return _fail(exc)
    print(f"imported {n} chunks ({b} bytes) from {args.snapshot} in {time.monotonic() - t:.2f} s", flush=True)
    return 0
