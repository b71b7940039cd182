"""Snapshot files and the folders they come from (an audit of what users hand `promptcache export`/`import` and
`serve --warmup-snapshot`): import never drops what a data folder holds, export never replaces a disk tier's files
or a file that is not a snapshot (without --force), its temporary file never follows a planted link and snapshots
are 0600, a record claiming a huge payload is refused in bounded memory, a file that changes while it is imported
leaves nothing stored, and forged non-finite times are refused (and clamped by the disk tier)."""
from __future__ import annotations

import hashlib
import math
import os
import stat
import struct
import time
import tracemalloc

import pytest
import xxhash

from promptcache.cli import main
from promptcache.sidecar import snapshot
from promptcache.sidecar.disk import DiskTier
from promptcache.sidecar.tiers.disk import _META

FP = hashlib.sha256(b"model").digest()


def chain(seed: int, n: int, size: int = 1024, t: float | None = None) -> list[snapshot.Record]:
    """n chained records (valid meta and checksums), a root and its descendants."""
    import random

    now = time.time() if t is None else t
    out, parent = [], None
    for i in range(n):
        key = hashlib.sha256(f"{seed}/{i}".encode()).digest()
        payload = random.Random(seed * 1000 + i).randbytes(size)
        meta = _META.pack(FP, parent or bytes(32), i, 0, 1, xxhash.xxh3_64_intdigest(payload)) + struct.pack("<I", size)
        out.append(snapshot.Record(key, meta, parent, "", now - 10, now + 3600, now - 5, 1, payload))
        parent = key
    return out


def write(path, records) -> None:
    with open(path, "wb") as f:
        for b in snapshot.encode_stream(records):
            f.write(b)


def open_tier(data_dir, budget=64 << 20) -> DiskTier:
    return DiskTier(os.path.join(data_dir, "rocksdb"), budget, lock_wait_seconds=0, min_free_bytes=0)


def fill(data_dir, records) -> None:
    d = open_tier(data_dir)
    try:
        for r in records:
            assert d.put(r.key, r.payload, meta=r.meta, parent=r.parent, ttl_seconds=3600)
        assert d.flush()
    finally:
        d.close()


def held(data_dir) -> set[bytes]:
    d = open_tier(data_dir, 1 << 60)
    try:
        return {k for k, _ in d.hottest()}
    finally:
        d.close()


def tree(folder) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


# --- 1. import never trims the data folder ----------------------------------------------------------------------
def test_import_with_a_small_disk_bytes_refuses_and_keeps_what_the_folder_holds(tmp_path, capsys):
    """Audit: `import --disk-bytes 4Ki` (a typo for 4Gi) into a folder of 40 chunks deleted 37 of them and exited
    0 (the tier opened with the new budget, and its rebuild dropped what did not fit)."""
    data = tmp_path / "data"
    stored = chain(1, 10) + chain(2, 10)
    fill(data, stored)
    snap = tmp_path / "b.pcsnap"
    write(snap, chain(3, 1))
    rc = main(["import", str(snap), "--data-dir", str(data), "--disk-bytes", "4Ki"])
    out = capsys.readouterr().out
    assert rc == 2, out
    assert f"--data-dir {data} already holds" in out and "more than --disk-bytes 4096" in out, out
    assert held(data) == {r.key for r in stored}
    # a budget that holds what is there but not the new record: nothing dropped, nothing imported
    used = 20 * (1024 + len(stored[0].meta) + 128)
    rc = main(["import", str(snap), "--data-dir", str(data), "--disk-bytes", str(used + 10)])
    assert rc == 0 and "imported 0 chunks" in capsys.readouterr().out
    assert held(data) == {r.key for r in stored}
    rc = main(["import", str(snap), "--data-dir", str(data), "--disk-bytes", "64Mi"])
    assert rc == 0 and "imported 1 chunks" in capsys.readouterr().out
    assert held(data) == {r.key for r in stored} | {chain(3, 1)[0].key}


# --- 2. export's --output ---------------------------------------------------------------------------------------
def test_export_refuses_an_output_inside_the_data_folder_and_a_file_that_is_not_a_snapshot(tmp_path, capsys):
    """Audit: `export --data-dir D --output D/rocksdb/000009.sst` replaced the table file it read (all 20 chunks
    lost), and any existing file was replaced silently."""
    data = tmp_path / "data"
    fill(data, chain(1, 5))
    before = tree(data / "rocksdb")
    sst = sorted(n for n in os.listdir(data / "rocksdb") if n.endswith(".sst") or n == "CURRENT")
    link = tmp_path / "innocent.pcsnap"
    os.symlink(data / "rocksdb" / "CURRENT", link)
    for out in [data / "rocksdb" / n for n in sst] + [data / "hot.pcsnap", link]:
        for extra in ([], ["--force"]):
            rc = main(["export", "--data-dir", str(data), "--output", str(out), *extra])
            text = capsys.readouterr().out
            assert rc == 2 and f"--output {out} is inside" in text, text
    assert tree(data / "rocksdb").keys() >= before.keys()
    assert all(tree(data / "rocksdb")[k] == v for k, v in before.items() if k in sst)
    assert held(data) == {r.key for r in chain(1, 5)}
    assert not (data / "hot.pcsnap").exists()
    # live export (--address): the output is checked first too, against any sidecar data folder
    with pytest.raises(snapshot.SnapshotError, match="a sidecar's data folder"):
        snapshot.check_output(str(data / "rocksdb" / "CURRENT"))
    with pytest.raises(snapshot.SnapshotError, match="a sidecar's data folder"):
        snapshot.check_output(str(data / "elsewhere.pcsnap"))

    notes = tmp_path / "notes.txt"
    notes.write_text("precious\n")
    out = str(notes)
    rc = main(["export", "--data-dir", str(data), "--output", out])
    text = capsys.readouterr().out
    assert rc == 2 and f"--output {out} exists and is not a PromptCache snapshot" in text and "--force" in text
    assert notes.read_text() == "precious\n"
    rc = main(["export", "--data-dir", str(data), "--output", out, "--force"])
    assert rc == 0, capsys.readouterr().out
    assert snapshot.verify(out) == 5
    # an existing snapshot is replaced without --force (a re-export), a folder never
    rc = main(["export", "--data-dir", str(data), "--output", out, "--max-bytes", "1024"])
    assert rc == 0 and snapshot.verify(out) == 1, capsys.readouterr().out
    rc = main(["export", "--data-dir", str(data), "--output", str(tmp_path), "--force"])
    assert rc == 2 and "is a directory" in capsys.readouterr().out


# --- 4. the temporary file and the modes ------------------------------------------------------------------------
def test_the_temporary_file_never_follows_a_planted_link_and_snapshots_are_0600(tmp_path, capsys):
    """Audit: export wrote OUTPUT.tmp-<pid> with open("wb"): a link planted under that name had its target
    overwritten, and the snapshot (every tenant's chunks) was created 0644."""
    data = tmp_path / "data"
    fill(data, chain(1, 4))
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.conf"
    victim.write_text("victim contents\n")
    out = shared / "hot.pcsnap"
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        os.symlink(victim, f"{out}.tmp-{pid}")
    old = os.umask(0o022)
    try:
        rc = main(["export", "--data-dir", str(data), "--output", str(out)])
    finally:
        os.umask(old)
    assert rc == 0, capsys.readouterr().out
    assert victim.read_text() == "victim contents\n"
    st = os.lstat(out)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert snapshot.verify(str(out)) == 4
    assert sorted(os.listdir(shared)) == sorted(["hot.pcsnap"] + [f"hot.pcsnap.tmp-{p}" for p in
                                                                  range(os.getpid() - 2, os.getpid() + 3)])
    # write_pieces cut short (a bad stream): no file, no temporary file left
    with pytest.raises(snapshot.SnapshotError):
        snapshot.write_pieces(str(shared / "cut.pcsnap"), [b"PCSNAP\x00\x01" + b"\x01\x00\x00\x00"], verify_first=True)
    assert not any(n.startswith(".cut") or n.startswith("cut") for n in os.listdir(shared))


def test_the_data_folders_a_disk_tier_creates_are_0700_and_existing_ones_keep_their_mode(tmp_path):
    old = os.umask(0o022)
    try:
        d = DiskTier(str(tmp_path / "new" / "data" / "rocksdb"), 1 << 20, lock_wait_seconds=0, min_free_bytes=0)
        d.close()
        for p in (tmp_path / "new", tmp_path / "new" / "data", tmp_path / "new" / "data" / "rocksdb"):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o755)
        os.chmod(mine, 0o755)
        DiskTier(str(mine / "rocksdb"), 1 << 20, lock_wait_seconds=0, min_free_bytes=0).close()
        assert stat.S_IMODE(os.stat(mine).st_mode) == 0o755  # not the tier's to chmod
        assert stat.S_IMODE(os.stat(mine / "rocksdb").st_mode) == 0o700
    finally:
        os.umask(old)


# --- 3. bounded memory whatever a record claims -----------------------------------------------------------------
def _sparse(path, claimed: int) -> None:
    r = chain(1, 1)[0]
    rec = (struct.pack("<B", len(r.key)) + r.key + struct.pack("<I", len(r.meta)) + r.meta + struct.pack("<B", 0)
           + struct.pack("<H", 0) + snapshot._TIMES.pack(r.created, r.expires, r.last_access, r.hits, claimed, 0))
    with open(path, "wb") as f:
        f.write(snapshot._HEAD.pack(snapshot.MAGIC, snapshot.VERSION) + rec)
        f.truncate(f.tell() + claimed + snapshot._TRAILER.size)


def test_a_record_claiming_a_huge_payload_is_refused_in_bounded_memory(tmp_path, capsys):
    """Audit: a 4 KiB sparse file whose record claims 6 GiB made `import --verify-only` peak at 6.8 GB RSS, and
    `serve --warmup-snapshot` was OOM-killed at every start."""
    from promptcache.sidecar.config import Settings

    assert snapshot.MAX_CHUNK_BYTES == Settings().max_chunk_bytes
    big = tmp_path / "sparse.pcsnap"
    _sparse(big, 6 << 30)
    tracemalloc.start()
    try:
        for read in (snapshot.verify, lambda p: list(snapshot.read_snapshot(p))):
            with pytest.raises(snapshot.SnapshotError, match=r"a payload of 6442450944 bytes, more than the largest "
                                                             r"chunk a sidecar holds: 268435456 bytes"):
                read(str(big))
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()
    rc = main(["import", str(big), "--verify-only"])
    text = capsys.readouterr().out
    assert rc == 2 and str(big) in text and "--max-chunk-bytes" in text, text
    # under a larger limit it is read, and verified in pieces: bounded memory, refused by its checksum
    mid = tmp_path / "mid.pcsnap"
    _sparse(mid, 300 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(snapshot.SnapshotError, match="payload checksum mismatch"):
            snapshot.verify(str(mid), max_payload=1 << 30)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()
    rc = main(["import", str(mid), "--verify-only", "--max-chunk-bytes", "1Gi"])
    assert rc == 2 and "payload checksum mismatch" in capsys.readouterr().out
    # a good file reads back whole, bit-exact
    good = tmp_path / "good.pcsnap"
    recs = chain(4, 3, size=3 << 20)
    write(good, recs)
    assert [r.payload for r in snapshot.read_snapshot(str(good))] == [r.payload for r in recs]
    assert snapshot._tally(str(good)) == (3, 9 << 20)


# --- 6. a file that changes between the two reads ---------------------------------------------------------------
@pytest.mark.parametrize("budget", ["64Mi", "30Ki"])
def test_import_keeps_nothing_of_a_file_that_changes_between_its_verify_and_store_passes(tmp_path, capsys,
                                                                                        monkeypatch, budget):
    """Audit: the file was verified, then rewritten in place (a copy in progress), then read again to store: 10
    records of the new, truncated file were stored although import exited 2. With a small budget the store pass
    used to stop reading at the first record that did not fit, never reaching the trailer's checksum."""
    data = tmp_path / "data"
    before = chain(9, 3)
    fill(data, before)
    snap = tmp_path / "race.pcsnap"
    write(snap, chain(1, 2))
    new = tmp_path / "new.pcsnap"
    write(new, chain(2, 20))
    content = new.read_bytes()
    if budget != "64Mi":  # everything fits but the last records; the rewrite is whole but for its trailer bits
        content = content[:-8] + bytes(8)
    else:
        content = content[:len(content) // 2]
    real = snapshot.verify

    def verify_then_rewritten(path, *a, **kw):
        n = real(path, *a, **kw)
        with open(path, "r+b") as f:
            f.write(content)
            f.truncate()
        return n
    monkeypatch.setattr(snapshot, "verify", verify_then_rewritten)
    rc = main(["import", str(snap), "--data-dir", str(data), "--disk-bytes", budget])
    text = capsys.readouterr().out
    assert rc == 2 and str(snap) in text and ("truncated" in text or "corrupt" in text), text
    assert held(data) == {r.key for r in before}


# --- 7. forged times --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["created", "expires", "last_access"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_record_with_a_non_finite_time_is_refused(tmp_path, field, value):
    """Audit: a forged record (checksums recomputed) with expires = NaN was imported and never expired."""
    import dataclasses

    path = tmp_path / "forged.pcsnap"
    write(path, [dataclasses.replace(r, **{field: value}) for r in chain(1, 2)])
    name = field.replace("_", " ")
    with pytest.raises(snapshot.SnapshotError, match=f"record 0: {name} time {value} is not a finite number"):
        snapshot.verify(str(path))
    with pytest.raises(snapshot.SnapshotError):
        snapshot.import_into_disk(str(path), str(tmp_path / "data"), 64 << 20)
    assert not (tmp_path / "data").exists()


def test_the_disk_tier_clamps_non_finite_times_so_a_record_always_expires(tmp_path):
    now = [1_000_000.0]
    d = DiskTier(str(tmp_path / "db"), 1 << 20, clock=lambda: now[0], lock_wait_seconds=0, min_free_bytes=0,
                 ttl_seconds=60)
    try:
        for i, (ttl, created, last) in enumerate([(math.nan, math.nan, math.nan), (math.inf, -math.inf, math.inf),
                                                  (-math.inf, math.inf, -math.nan)]):
            assert d.put(bytes([i]) * 32, b"x" * 100, ttl_seconds=ttl, created=created, last_access=last,
                         ttl_hint=math.nan)
        assert d.flush()
        for i in range(3):
            e = d.entry(bytes([i]) * 32)
            assert e is None or all(math.isfinite(x) for x in (e.created, e.expires, e.last_access, e.ttl_hint))
        now[0] += 3650 * 86400
        assert all(d.get(bytes([i]) * 32) is None for i in range(3))
    finally:
        d.close()


def test_import_stops_at_the_index_bound_the_sidecar_will_keep(tmp_path, monkeypatch):
    """A snapshot of tiny records (a tiny model layout's) is imported up to the RAM the sidecar's disk index may
    take for this --disk-bytes (its default --disk-index-bytes), not to the byte budget alone: what the sidecar
    would trim at its next start is never written. (The floor of the default bound, 64 MiB, is lowered here so that
    a few hundred records reach it.)"""
    from promptcache.sidecar import disk as disk_mod

    monkeypatch.setattr(disk_mod, "MIN_INDEX_BYTES", 0)
    budget = 64 << 20
    bound = disk_mod.default_index_bytes(budget)  # 1 MiB: about 540 records
    records = chain(7, 1500, size=64)
    path = tmp_path / "tiny.pcsnap"
    write(path, records)
    data = tmp_path / "data"
    count, _ = snapshot.import_into_disk(str(path), str(data), budget)
    with DiskTier(str(data / "rocksdb"), budget, min_free_bytes=0, index_bytes=bound) as d:
        assert 0 < count < 1500 and len(d) == count  # nothing trimmed at open: all of it fits the bound
        following = records[count]
        assert d.index_used <= bound < d.index_used + disk_mod.record_index_ram(following.key, following.meta,
                                                                               following.parent, "")
        assert d.used < budget // 10  # the byte budget alone would have taken all 1,500
