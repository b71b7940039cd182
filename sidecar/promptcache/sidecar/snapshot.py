"""Snapshot files: the hottest chunks of a sidecar's data folder, to warm another (or a rebuilt) one with.

`promptcache export --address HOST:PORT --output FILE [--max-bytes N]` asks a running sidecar for its hottest N
bytes (the admin Export call: its memory tier by hit count then recency, then its disk tier; it keeps serving) and
verifies the file whole before it is renamed into place. `promptcache export --data-dir DIR ...` writes the
hottest N bytes of the disk tier in DIR instead (a stopped sidecar: a graceful stop demotes its memory tier there,
so that is all it held; a running one holds the folder's lock and is named in the error). `promptcache import FILE --data-dir DIR --disk-bytes N` puts
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
every record's framing and both checksums, the count and the file checksum) before it stores anything: a
truncated, corrupt or foreign file is refused with a SnapshotError naming the file, and nothing of it is stored.
"""
from __future__ import annotations

import os
import struct
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
MAX_PAYLOAD = 1 << 34  # a length past this is a corrupt file, not a chunk


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


def _records(path: str, verify_only: bool) -> Iterator[Record]:
    from promptcache.sidecar.disk import payload_checksum
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
            if length > MAX_PAYLOAD or f.tell() + length > size:
                raise SnapshotError(f"snapshot {path}: truncated (record {count}: payload of {length} bytes "
                                    "runs past the end)")
            payload = r.take(length, "payload")
            decoded = decode_meta(meta)
            if decoded is None:
                raise SnapshotError(f"snapshot {path}: corrupt (record {count}: chunk meta)")
            if payload_checksum(key, payload) != chk or xxhash.xxh3_64_intdigest(payload) != decoded[4]:
                raise SnapshotError(f"snapshot {path}: corrupt (record {count}: payload checksum mismatch)")
            count += 1
            if not verify_only:
                yield Record(key, meta, parent, owner, created, expires, last, hits, payload)


def verify(path: str) -> int:
    """Check the whole file; returns its record count. SnapshotError when it is not usable."""
    return _tally(path)[0]


def _tally(path: str) -> tuple[int, int]:
    """Check the whole file; returns (records, payload bytes)."""
    n = payload = 0
    for r in _records(path, False):
        n += 1
        payload += len(r.payload)
    return n, payload


def read_snapshot(path: str) -> Iterator[Record]:
    """The records of a verified file (verified whole first; each record is checked again as it is read, so a
    file changed between the two reads stops at the first bad record, never serves it)."""
    verify(path)
    return _records(path, False)


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
    """Write the byte strings `pieces` to `path` atomically (a temporary file renamed into place); with
    verify_first, the whole file is verified (SnapshotError) before the rename. Returns (records, payload bytes)
    when verified, else (0, bytes written)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    n = 0
    try:
        with open(tmp, "wb") as f:
            for b in pieces:
                f.write(b)
                n += len(b)
            f.flush()
            os.fsync(f.fileno())
        tally = (0, n)
        if verify_first:
            try:
                tally = _tally(tmp)
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


def export(data_dir: str, out: str, max_bytes: int) -> tuple[int, int]:
    """The hottest `max_bytes` of payload (0: all) in the disk tier of `data_dir` to the file `out`: first what the
    memory tier held at the sidecar's last graceful stop (the resident list it wrote then, left in place), then the
    rest hottest first."""
    if not os.path.isdir(os.path.join(data_dir, "rocksdb")):
        raise SnapshotError(f"--data-dir {data_dir}: no disk tier there (no rocksdb folder)")
    disk = _open_disk(data_dir, 1 << 60)  # no record is dropped over a budget
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


def import_into_disk(path: str, data_dir: str, budget: int) -> tuple[int, int]:
    """Put a verified snapshot's records into the disk tier of `data_dir` (budget `budget`), in the file's order
    (hottest first) until the next would not fit; what is there already stays. Returns (records, bytes)."""
    from promptcache.sidecar.disk import RECORD_OVERHEAD

    records = read_snapshot(path)
    disk = _open_disk(data_dir, budget)
    count = nbytes = 0
    try:
        now = time.time()
        for r in records:
            if r.expires <= now or disk.entry(r.key) is not None:
                continue
            if disk.used + len(r.payload) + len(r.meta) + RECORD_OVERHEAD > disk.budget:
                break
            for _ in range(2):
                if disk.put(r.key, r.payload, meta=r.meta, parent=r.parent, ttl_seconds=r.expires - now,
                            created=r.created, last_access=r.last_access, hits=r.hits, owner=r.owner):
                    count += 1
                    nbytes += len(r.payload)
                    break
                disk.flush()  # the write queue was full
        if not disk.flush(timeout=600):
            raise SnapshotError(f"--data-dir {data_dir}: the disk tier did not finish its writes")
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
                       "stopped one's disk tier (--data-dir) to a snapshot file", description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-dir", help="a stopped sidecar's --data-dir")
    add_connection_arguments(p, address=src, output=False)  # --address: a running sidecar (the Export call)
    p.add_argument("--output", required=True, help="snapshot file to write")
    p.add_argument("--max-bytes", type=parse_bytes, default=0, help="at most this many payload bytes, hottest "
                   "first (a quantity such as 4Gi; 0: everything)")
    p.set_defaults(admin_run=_run_export)
    p = sub.add_parser("import", help="verify a snapshot file and put it into a (stopped) sidecar's disk tier",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="snapshot file written by `promptcache export`")
    p.add_argument("--data-dir", help="the sidecar's --data-dir (required unless --verify-only)")
    p.add_argument("--disk-bytes", type=parse_bytes, help="the sidecar's --disk-bytes (required unless "
                   "--verify-only)")
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
            n, b = export(args.data_dir, args.output, args.max_bytes)
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
    with _client(args) as client:
        return write_pieces(args.output, client.export(args.max_bytes, timeout=args.timeout), verify_first=True)


def _run_import(args) -> int:
    from promptcache.sidecar.disk import DiskTierError

    from promptcache.sidecar.config import file_problem

    problem = file_problem(args.snapshot)  # (a FIFO would block; the file is read twice: verified, then imported)
    if problem:
        print(f"promptcache import: {args.snapshot}: {problem}", flush=True)
        return 2
    t = time.monotonic()
    try:
        if args.verify_only:
            print(f"{args.snapshot}: {verify(args.snapshot)} chunks, verified", flush=True)
            return 0
        if not args.data_dir or not args.disk_bytes:
            print("promptcache import: --data-dir and --disk-bytes (positive) are required", flush=True)
            return 2
        n, b = import_into_disk(args.snapshot, args.data_dir, args.disk_bytes)
    except (SnapshotError, DiskTierError, OSError) as exc:
        return _fail(exc)
    print(f"imported {n} chunks ({b} bytes) from {args.snapshot} in {time.monotonic() - t:.2f} s", flush=True)
    return 0
