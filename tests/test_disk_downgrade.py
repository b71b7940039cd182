"""A rollback after an upgrade: the disk tier's RocksDB holds index records a newer build wrote (a header version
this build does not read, or a later record format). The older build used to take them for corrupt records and
delete them with their payloads at open; now it leaves them in place, byte for byte: never served, never deleted
(open, eviction, purge, a put of the same key, a real sidecar's spills and graceful stop), not counted as its own
usage but charged against the budget, and reported (docs/disk-tier.md, "Newer records")."""
from __future__ import annotations

import hashlib
import signal
import struct

import pytest
import rocksdict as rd
import xxhash

from support import SMALL, SidecarProcess, make_kv
from promptcache.client import PromptCacheClient
from promptcache.sidecar import disk as D

OWN = [bytes([1, i]) * 16 for i in range(4)]
NEWER = {  # key -> (index record, payload) as a newer build would write them
    b"\xee" * 32: "index version 3",
    b"\xef" * 32: "index version 200",
    b"\xf0" * 32: "format PCD2",
}


def _newer_record(key: bytes, what: str) -> tuple[bytes, bytes]:
    payload = hashlib.sha256(key).digest() * 300
    e = D.DiskEntry(0, len(payload), D.payload_checksum(key, payload), 1.7e9, 9e12, b"meta of the future", None)
    body = D._encode_index(key, e)[:-8]
    if what.startswith("index version"):
        body = body[:4] + bytes([int(what.split()[-1])]) + body[5:] + b"fields this build does not know"
    else:
        body = b"PCD2" + body[4:] + b"a layout this build does not know"
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(key + body)), payload


def _write_newer_records(path: str) -> dict[bytes, bytes]:
    """The newer build's records, written straight into RocksDB; returns every RocksDB key -> value written."""
    written = {}
    db = rd.Rdict(path, rd.Options(raw_mode=True))
    try:
        for key, what in NEWER.items():
            rec, payload = _newer_record(key, what)
            db[b"i" + key] = rec
            db[b"d" + key] = payload
            written[b"i" + key] = rec
            written[b"d" + key] = payload
    finally:
        db.close()
    return written


def _assert_still_there(path: str, written: dict[bytes, bytes]) -> None:
    db = rd.Rdict(path, rd.Options(raw_mode=True), access_type=rd.AccessType.read_only())
    try:
        lost = [k[:1] + k[1:2].hex().encode() for k, v in written.items() if db.get(k) != v]
        assert not lost, f"the newer build's records {lost} were changed or deleted"
    finally:
        db.close()


def _assert_still_there_in(t: D.DiskTier, written: dict[bytes, bytes]) -> None:
    """The same, through the open tier's own RocksDB handle (the folder is locked while it is open)."""
    lost = [k[:1] + k[1:2].hex().encode() for k, v in written.items() if t._db.get(k) != v]
    assert not lost, f"the newer build's records {lost} were changed or deleted"


@pytest.fixture
def mixed(tmp_path):
    """A disk tier with 4 records of this build and 3 of a newer one."""
    path = str(tmp_path / "rocksdb")
    with D.DiskTier(path, 64 << 20, min_free_bytes=0) as t:
        for i, key in enumerate(OWN):
            assert t.put(key, bytes([i]) * 5000)
        assert t.flush()
    return path, _write_newer_records(path)


def test_newer_records_are_kept_not_served_and_reported(mixed, caplog):
    path, written = mixed
    with D.DiskTier(path, 64 << 20, min_free_bytes=0):
        pass
    _assert_still_there(path, written)  # (deleted at open as "failed their checksum" before)
    with D.DiskTier(path, 64 << 20, min_free_bytes=0) as t:
        report = t.open_report
        assert report["kept_newer"] == 3 and report["dropped_corrupt"] == 0 and report["dropped_orphans"] == 0
        assert t.foreign_bytes == sum(len(k) + len(v) for k, v in written.items()) == t.stats()["foreign_bytes"]
        assert len(t) == 4 and t.used == 4 * (5000 + D.RECORD_OVERHEAD), "newer records counted as its own usage"
        for key in NEWER:
            assert t.get(key) is None and key not in t and t.entry(key) is None
        assert [t.get(k) for k in OWN] == [bytes([i]) * 5000 for i in range(4)]
        # A client's put of the same key does not overwrite it; delete and purge everything do not touch it.
        assert not t.put(b"\xee" * 32, b"x" * 100) and t.counters["put_rejected_newer_record"] == 1
        assert not t.delete(b"\xef" * 32)
        assert t.purge(b"") == 4
        assert t.flush()
    assert "written by a newer promptcache (format PCD2: 1, index version 200: 1, index version 3: 1; this " \
           "build reads index versions 1-2)" in caplog.text and path in caplog.text
    _assert_still_there(path, written)


def test_eviction_takes_only_its_own_records_and_the_budget_counts_the_newer_ones(mixed):
    path, written = mixed
    foreign = sum(len(k) + len(v) for k, v in written.items())
    budget = foreign + 3 * (5000 + D.RECORD_OVERHEAD)  # room for 3 of its own records next to the newer ones
    with D.DiskTier(path, budget, min_free_bytes=0) as t:
        assert len(t) == 4  # nothing of its own is dropped at open either
        for i in range(8):
            _assert_still_there_in(t, written)
            assert t.put(bytes([2, i]) * 16, b"z" * 5000)
            assert t.flush()
            assert t.used + t.foreign_bytes <= budget
        assert len(t) == 3
    _assert_still_there(path, written)
    with D.DiskTier(path, 64 << 20, min_free_bytes=0) as t:  # the newer build's records, all there for it
        assert t.open_report["kept_newer"] == 3


@pytest.mark.slow  # a sidecar process
def test_a_sidecar_that_spills_evicts_and_stops_leaves_a_newer_builds_records(tmp_path):
    path = str(tmp_path / "data" / "rocksdb")
    with D.DiskTier(path, 64 << 20, min_free_bytes=0):
        pass
    written = _write_newer_records(path)
    # A 512 KiB memory tier spilling into a disk tier that has room for only a few of its chunks next to the
    # newer records: demotions, disk evictions, warm-up at start and the demotion at the graceful stop.
    proc = SidecarProcess("--memory-bytes", "512Ki", "--chunk-tokens", "256", "--disk-bytes", "1Mi",
                          "--disk-min-free-bytes", "0", "--data-dir", str(tmp_path / "data"), "--log-format", "text",
                          "--warmup-seconds", "5")
    try:
        proc.wait_ready()
        with PromptCacheClient(proc.address, timeout=20) as c:
            for p in range(16):
                for _ in range(2):
                    c.put(SMALL, [p * 100_000 + t for t in range(256)], make_kv(SMALL, 256, seed=p))
        proc.proc.send_signal(signal.SIGTERM)
        out, _ = proc.proc.communicate(timeout=60)
    finally:
        proc.stop()
    assert proc.proc.returncode == 0 and "disk tier closed" in out, out
    _assert_still_there(path, written)
    assert "holds 3 records" in out and "written by a newer promptcache" in out and path in out, out
    with D.DiskTier(path, 1 << 20, min_free_bytes=0) as t:
        assert t.open_report["kept_newer"] == 3 and len(t) > 0  # and it spilled its own beside them
        assert t.used + t.foreign_bytes <= 1 << 20
