"""The disk tier's in-memory index has a stated, enforced RAM bound (--disk-index-bytes), not only a byte budget.

Each record costs the sidecar's RAM about the same whatever its payload's size (a DiskEntry, its meta, parent and
owner, the eviction policy's state): a client that picks a tiny model layout (num_layers=1, num_kv_heads=1,
head_dim=1: 1 KiB chunks) could fill a 100 GiB --disk-bytes with 86 million records, ~100 GiB of RAM (measured
~1.2-1.7 KiB a record), be OOM-killed and load the same index again at every restart. Against the real DiskTier
on RocksDB in tmp_path. Each test failed before the bound existed."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import struct
import tracemalloc
import types

import pytest

from promptcache.sidecar import config
from promptcache.sidecar import disk as disk_mod
from promptcache.sidecar.disk import RECORD_OVERHEAD, DiskEntry, DiskTier, default_index_bytes, index_ram

# A realistic chunk record's meta (tiers/disk.py encode_meta: fingerprint, parent, index, dtype, ndim, checksum,
# a 5-dimensional shape), a 32-byte key and parent, an owner.
META = struct.pack("<32s32sIBBQ", b"f" * 32, b"p" * 32, 7, 1, 5, 123456789) + struct.pack("<5I", 1, 2, 1, 256, 1)
TINY = 1024  # the smallest chunk a model spec allows at 256 tokens (1 layer, 1 KV head, head_dim 1, fp16)


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4


def _fill(t: DiskTier, n: int, size: int, start: int = 0, chain: int = 64, check=None) -> None:
    payload = os.urandom(size)
    parent = None
    for i in range(start, start + n):
        key = _key(i)
        while not t.put(key, payload, meta=META, parent=parent, owner="tenant-a"):
            assert t.stats().get("put_rejected_queue_full") or t.stats().get("put_rejected_disk_full"), t.stats()
            t.flush()
        parent = key if (i + 1) % chain else None
        if check is not None:
            check()
    assert t.flush(timeout=120)


def _open(path, budget, **kw) -> DiskTier:
    return DiskTier(str(path), budget, min_free_bytes=0, **kw)


def test_tiny_records_stay_under_the_index_bound_that_the_budget_alone_would_pass(tmp_path):
    """A 1 GiB budget admits ~860,000 records of 1 KiB chunks (~1 GiB of RAM); a 4 MiB index bound keeps ~2,100 of
    them, evicting as the budget does (counted apart: evicted_index); tracemalloc agrees with the estimate."""
    bound = 4 << 20
    budget = 1 << 30
    t = _open(tmp_path / "db", budget, index_bytes=bound)
    try:
        per_record = TINY + len(META) + RECORD_OVERHEAD
        assert budget // per_record > 400 * (bound // index_ram(_key(0), _entry()))  # the budget alone: far more
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        worst = [0]

        def check():
            assert t.index_used <= bound
            worst[0] = max(worst[0], t.index_used)

        _fill(t, 3 * (bound // index_ram(_key(0), _entry())), TINY, check=check)
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        st = t.stats()
        assert st["index_ram_bytes"] == t.index_used <= bound == st["index_bytes"]
        assert worst[0] > bound - 2 * index_ram(_key(0), _entry())  # it was filled to the bound, not below it
        assert st["evicted_index"] > 0 and st.get("evicted_capacity", 0) == 0
        assert st["entries"] == len(t) <= bound // index_ram(_key(0), _entry(parent=None))
        assert st["bytes_used"] < budget // 100  # the byte budget was nowhere near full
        assert measured <= bound, f"{measured} bytes traced for an index bounded at {bound}"
        assert t.index_used == sum(index_ram(k, e) for k, e in t.index.items())
    finally:
        t.close()
    # what is left on disk is what the index holds: a reopen finds the same records
    t = _open(tmp_path / "db", budget, index_bytes=bound)
    try:
        assert len(t) == st["entries"] and t.open_report["dropped_over_index"] == 0
        key = next(iter(t.index))
        assert t.get(key) is not None
    finally:
        t.close()


def _entry(meta: bytes = META, parent: bytes | None = b"p" * 32, owner: str = "tenant-a") -> DiskEntry:
    return DiskEntry(0, TINY, 0, 0.0, 1.0, meta, parent, owner=owner)


def test_the_estimate_covers_the_measured_ram_per_record(tmp_path):
    """index_ram is never below what the index really holds (tracemalloc), in the worst case measured: after a
    reopen (the records' own parent and owner objects), with hits having grown the policy's heap to its limit,
    right after the dicts resized (5,500 records: just past 2/3 of 8,192)."""
    n = 5500
    t = _open(tmp_path / "db", 1 << 30, index_bytes=1 << 30)
    _fill(t, n, 64)
    t.close()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t = _open(tmp_path / "db", 1 << 30, index_bytes=1 << 30)
    try:
        keys = list(t.index)
        for _ in range(3):
            for k in keys:
                t.policy.accessed(k)  # what a hit does to the policy: a new heap entry each
        del keys
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert len(t) == n
        assert measured <= t.index_used, f"{measured / n:.0f} bytes per record measured, {t.index_used / n:.0f} counted"
        assert t.index_used <= 1.5 * measured  # an estimate, not a gross overcharge
    finally:
        t.close()


def test_ordinary_chunks_never_reach_the_default_bound(tmp_path):
    """A full budget of 256 KiB chunks (the smallest ordinary size) takes at most half of the default bound
    (--disk-bytes / 64); filling a tier with them evicts for the budget only."""
    ordinary = 256 << 10
    rec = _entry()
    for budget in (1 << 30, 100 << 30, 10 << 40):
        assert default_index_bytes(budget) == max(64 << 20, budget // 64)
        records = budget // (ordinary + len(META) + RECORD_OVERHEAD)
        assert records * index_ram(_key(0), rec) <= default_index_bytes(budget) // 2
        # an owner name of 100 characters does not change that
        assert records * index_ram(_key(0), _entry(owner="t" * 100)) <= default_index_bytes(budget) * 0.6
    # for real: the formula without its 64 MiB floor, a budget of 16 MiB (bound 256 KiB: ~130 records)
    budget = 16 << 20
    t = _open(tmp_path / "db", budget, index_bytes=budget // 64)
    try:
        _fill(t, 3 * budget // ordinary, ordinary)
        st = t.stats()
        assert st["evicted_capacity"] > 0 and st.get("evicted_index", 0) == 0
        assert st.get("put_rejected_index_full", 0) == 0
        assert st["bytes_used"] > budget - 2 * ordinary  # the budget is what filled
        assert st["index_ram_bytes"] <= st["index_bytes"] // 2
    finally:
        t.close()
    assert _open(tmp_path / "other", 1 << 30).index_bytes == 64 << 20  # the default, with its floor
    assert DiskTier.__init__.__kwdefaults__["index_bytes"] is None


def test_reopening_with_a_lower_bound_brings_the_index_under_it(tmp_path, caplog):
    """The bound lowered since the last run (or an index written before the bound existed): records over it are
    dropped at open and deleted from RocksDB, as for a lowered --disk-bytes, with a log line naming the flag."""
    t = _open(tmp_path / "db", 1 << 30, index_bytes=16 << 20)
    _fill(t, 5000, TINY)
    assert len(t) == 5000 and t.stats().get("evicted_index", 0) == 0
    t.close()
    low = 2 << 20
    with caplog.at_level(logging.WARNING, logger="promptcache.disk"):
        t = _open(tmp_path / "db", 1 << 30, index_bytes=low)
    try:
        kept = len(t)
        assert t.index_used <= low and kept <= low // index_ram(_key(0), _entry(parent=None))
        assert kept > low // index_ram(_key(0), _entry()) - 10  # trimmed to the bound, not emptied
        assert t.open_report["dropped_over_index"] == 5000 - kept
        assert t.open_report["index_ram_bytes"] == t.index_used and t.open_report["index_bytes"] == low
        assert any("--disk-index-bytes" in r.getMessage() and str(5000 - kept) in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        for key in list(t.index)[:50]:
            assert t.get(key) is not None  # what stays is served, verified
        # a put still fits: it evicts for room within the bound
        assert t.put(_key(10 ** 6), os.urandom(TINY), meta=META)
        assert t.index_used <= low
        t.flush()
        kept = len(t)
    finally:
        t.close()
    t = _open(tmp_path / "db", 1 << 30, index_bytes=16 << 20)  # deleted from RocksDB, not only from the index
    try:
        assert len(t) == kept and t.open_report["dropped_over_index"] == 0
    finally:
        t.close()


def test_a_put_over_the_bound_that_cannot_evict_is_refused(tmp_path):
    t = _open(tmp_path / "db", 1 << 30, index_bytes=1 << 20)
    try:
        assert not t.put(b"k" * 32, b"x", meta=b"m" * (1 << 20))  # one record's RAM over the whole bound
        assert t.stats()["put_rejected_too_large"] == 1 and len(t) == 0 and t.index_used == 0
        with pytest.raises(ValueError, match="index"):
            DiskTier(str(tmp_path / "db2"), 1 << 30, index_bytes=0)
    finally:
        t.close()


def test_deletes_and_purges_give_the_index_ram_back(tmp_path):
    t = _open(tmp_path / "db", 1 << 30, index_bytes=8 << 20)
    try:
        _fill(t, 300, TINY)
        assert t.index_used == sum(index_ram(k, e) for k, e in t.index.items()) > 0
        for i in range(100):
            assert t.delete(_key(i))
        assert t.index_used == sum(index_ram(k, e) for k, e in t.index.items())
        assert t.purge(b"f" * 32) == 200
        assert t.index_used == 0 and t.used == 0
    finally:
        t.close()


def _settings(argv, env=None):
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return config.settings_from_args(p.parse_args(argv), environ=env or {})


def test_the_flag_is_validated_and_named():
    assert _settings([]).disk_index_bytes == 0  # the default: derived from --disk-bytes
    assert _settings(["--disk-index-bytes", "2Gi"]).disk_index_bytes == 2 << 30
    assert _settings([], {"PROMPTCACHE_DISK_INDEX_BYTES": "512Mi"}).disk_index_bytes == 512 << 20
    assert "disk_index_bytes" in config._BYTE_FIELDS
    for bad in ("-1", "-1Gi", "lots"):
        with pytest.raises(ValueError, match="--disk-index-bytes"):
            _settings([f"--disk-index-bytes={bad}"])
    with pytest.raises(ValueError, match="PROMPTCACHE_DISK_INDEX_BYTES"):
        _settings([], {"PROMPTCACHE_DISK_INDEX_BYTES": "-5"})
    with pytest.raises(ValueError, match=r"--disk-index-bytes must be 0 \(--disk-bytes / 64, at least 64Mi\) or at least 1Mi"):
        config.Settings(disk_index_bytes=-1).validate()
    assert "--disk-bytes / 64" in config.HELP["disk_index_bytes"]


def test_serve_passes_the_bound_to_the_disk_tier(monkeypatch, tmp_path):
    from promptcache.sidecar import app

    seen = {}

    class FakeTier:
        def __init__(self, path, budget, **kw):
            seen.update(kw, budget=budget)
            self.path, self.open_report = path, {}

    monkeypatch.setattr(disk_mod, "DiskTier", FakeTier)
    memory = types.SimpleNamespace(clock=lambda: 0.0)
    app.disk_tier(_settings(["--disk-bytes", "1Gi", "--data-dir", str(tmp_path), "--disk-index-bytes", "3Mi"]),
                  memory, None)
    assert seen["index_bytes"] == 3 << 20
    app.disk_tier(_settings(["--disk-bytes", "1Gi", "--data-dir", str(tmp_path)]), memory, None)
    assert seen["index_bytes"] is None  # DiskTier derives it: default_index_bytes(--disk-bytes)
