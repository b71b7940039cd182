"""Warm-up (docs/warmup.md): a restarted sidecar fills its memory tier from its disk tier hottest first, or from a
snapshot file, before its health service says SERVING (up to --warmup-seconds); snapshot files are verified and a
bad one is refused naming the file; the disk index's version 2 records (hits, last access, owner) are read back
and version 1 records still are."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from promptcache.client import PromptCacheClient
from promptcache.contract.layout import chunk_nbytes
from promptcache.sidecar import disk as disktier
from promptcache.sidecar import snapshot
from support import CHUNK, SMALL, SidecarProcess, make_kv, metric
from test_auth import write_secret_dir

CHUNK_BYTES = chunk_nbytes(SMALL, CHUNK)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def prompts(n: int, chunks: int) -> list[list[int]]:
    return [[p * 100_000 + t for t in range(chunks * CHUNK)] for p in range(n)]


def snapshot_index(r) -> int:
    from promptcache.sidecar.tiers.disk import decode_meta

    return decode_meta(r.meta)[2]


# --- the disk index ------------------------------------------------------------------------------------------
def test_index_records_keep_hits_last_access_and_owner_and_version_1_is_still_read():
    key = b"k" * 32
    e = disktier.DiskEntry(0, 5, 123, 10.0, 99.0, b"meta", b"p" * 32, 12.5, 7, "tenant-a", 3600.0)
    got = disktier._decode_index(key, disktier._encode_index(key, e))
    assert (got.last_access, got.hits, got.owner, got.meta, got.parent, got.ttl_hint) == \
        (12.5, 7, "tenant-a", b"meta", b"p" * 32, 3600.0)
    old = disktier._decode_index(key, disktier._encode_index(key, e, version=1))  # written before version 2
    assert (old.last_access, old.hits, old.owner, old.created, old.length, old.ttl_hint) == (10.0, 0, "", 10.0, 5, 0)
    rec = bytearray(disktier._encode_index(key, e))
    rec[6] ^= 1  # any flipped bit fails the record's checksum
    assert disktier._decode_index(key, bytes(rec)) is None
    assert disktier._decode_index(b"x" * 32, disktier._encode_index(key, e)) is None  # bound to its key


def test_index_records_keep_a_priority_hints_pin_in_the_flags_byte():
    key = b"k" * 32
    e = disktier.DiskEntry(0, 5, 123, 10.0, 99.0, b"meta", b"p" * 32, 12.5, 7, "tenant-a", 0.0, pinned=True)
    rec = disktier._encode_index(key, e)
    assert rec[5] == disktier.FLAG_PINNED  # magic (4 bytes), version, flags
    assert disktier._decode_index(key, rec).pinned
    e.pinned = False
    assert not disktier._decode_index(key, disktier._encode_index(key, e)).pinned
    e.pinned = True
    assert not disktier._decode_index(key, disktier._encode_index(key, e, version=1)).pinned  # version 1: no flags


def test_a_disk_tier_with_version_1_records_opens_and_orders_by_hits(tmp_path):
    import rocksdict as rd

    path = str(tmp_path / "db")
    with disktier.DiskTier(path, 1 << 20) as d:
        for i, hits in enumerate((0, 5, 2)):
            assert d.put(bytes([i]) * 32, b"x" * 100, hits=hits, last_access=time.time())
        assert d.flush()
    with disktier.DiskTier(path, 1 << 20) as d:
        assert [k[0] for k, _ in d.hottest()] == [1, 2, 0]
        assert [e.hits for _, e in d.hottest()] == [5, 2, 0]
    # rewrite one record as version 1 (a data folder written by the previous release)
    db = rd.Rdict(path, rd.Options(raw_mode=True))
    key = bytes([1]) * 32
    e = disktier._decode_index(key, db[b"i" + key])
    db[b"i" + key] = disktier._encode_index(key, e, version=1)
    db.close()
    with disktier.DiskTier(path, 1 << 20) as d:
        assert len(d) == 3 and d.open_report["dropped_corrupt"] == 0
        assert d.get(key) == b"x" * 100
        # no hits recorded for it now (version 1): below the one hit twice; its last access reads as its creation
        assert [k[0] for k, _ in d.hottest()][0] == 2
        assert [e.hits for _, e in d.hottest()] == [2, 0, 0]


# --- readiness waits for warm-up, up to its bound (in-process: warm-up held at a gate) -------------------------
@pytest.fixture
def gated(sidecar_factory, tmp_path, monkeypatch):
    """A sidecar restarted on a disk tier holding 8 chunks, whose warm-up waits at `gate` before each chunk."""
    from promptcache.sidecar.tiers import TierStack

    data = str(tmp_path / "data")
    first = sidecar_factory(memory_bytes=64 * CHUNK_BYTES, disk_bytes=64 << 20, data_dir=data)
    tokens = prompts(1, 8)[0]
    with PromptCacheClient(first.address) as c:
        assert c.put(SMALL, tokens, make_kv(SMALL, len(tokens), seed=3)).stored_chunks == 8
    first.stop()
    gate = threading.Event()
    real = TierStack.warm

    def warm(self, source, key):
        gate.wait(30)
        return real(self, source, key)

    monkeypatch.setattr(TierStack, "warm", warm)

    def start(seconds: float):
        return sidecar_factory(memory_bytes=64 * CHUNK_BYTES, disk_bytes=64 << 20, data_dir=data,
                               warmup_seconds=seconds), tokens
    return start, gate


def test_health_says_not_serving_until_warm_up_has_filled_memory(gated):
    start, gate = gated
    sidecar, tokens = start(60.0)
    time.sleep(0.5)
    assert health(sidecar.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert metric(sidecar, "promptcache_warmup_in_progress") == 1
    gate.set()
    assert sidecar.warmup.ready.wait(10)
    assert health(sidecar.address) == health_pb2.HealthCheckResponse.SERVING
    assert not sidecar.warmup.report["bound_reached"]
    assert sidecar.warmup.report["disk_chunks"] == 8
    assert metric(sidecar, 'promptcache_warmup_chunks_total{source="disk"}') == 8
    assert metric(sidecar, "promptcache_warmup_in_progress") == 0
    with PromptCacheClient(sidecar.address) as c:
        assert [ch.tier for ch in c.lookup(SMALL, tokens).chunks] == ["device"] * 8


def test_the_bound_holds_ready_while_warm_up_goes_on(gated):
    start, gate = gated
    t0 = time.monotonic()
    sidecar, tokens = start(0.5)
    assert sidecar.warmup.ready.wait(10)
    took = time.monotonic() - t0
    assert 0.4 <= took < 3.0, took
    assert health(sidecar.address) == health_pb2.HealthCheckResponse.SERVING
    assert sidecar.warmup.report["bound_reached"] and not sidecar.warmup.done.is_set()
    assert metric(sidecar, "promptcache_warmup_bound_reached_total") == 1
    with PromptCacheClient(sidecar.address) as c:  # served meanwhile, from disk
        assert c.lookup(SMALL, tokens).cached_tokens == 8 * CHUNK
    gate.set()
    assert sidecar.warmup.done.wait(10)


# --- end to end: real sidecar processes ----------------------------------------------------------------------
def _args(data, memory_chunks: int, *extra: str) -> tuple[str, ...]:
    return ("--memory-bytes", str(memory_chunks * CHUNK_BYTES), "--disk-bytes", "64Mi", "--data-dir", str(data),
            "--chunk-tokens", str(CHUNK), "--log-format", "text", *extra)


def _fill(address: str, n: int, chunks: int, hot: int, hits: int) -> dict[int, list]:
    """Put n prompts of `chunks` chunks; Get the first `hot` of them `hits` times (those become the hot ones)."""
    kvs = {}
    with PromptCacheClient(address, timeout=20) as c:
        for p, tokens in enumerate(prompts(n, chunks)):
            kvs[p] = make_kv(SMALL, len(tokens), seed=100 + p)
            assert c.put(SMALL, tokens, kvs[p]).stored_chunks == chunks
        for _ in range(hits):
            for tokens in prompts(hot, chunks):
                assert c.get(SMALL, tokens)[0] == chunks * CHUNK
    return kvs


def _assert_hot_in_memory_bit_exact(address: str, kvs, hot: int, chunks: int) -> list[str]:
    with PromptCacheClient(address, timeout=20) as c:
        for p, tokens in enumerate(prompts(hot, chunks)):
            assert [ch.tier for ch in c.lookup(SMALL, tokens).chunks] == ["device"] * chunks, p
            cached, got = c.get(SMALL, tokens)
            assert cached == chunks * CHUNK
            for (k, v), (gk, gv) in zip(kvs[p], got):
                assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))
        return [(c.lookup(SMALL, t).chunks or [None])[0] for t in prompts(len(kvs), chunks)[hot:]]


def _metric_text(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _sample(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


@pytest.mark.slow  # three sidecar processes
def test_a_restarted_sidecar_serves_its_hot_prefixes_from_memory_at_once(tmp_path):
    """10 prompts of 4 chunks, the first 3 hot; memory holds 16 chunks. After a graceful restart with warm-up
    the 3 hot prompts are memory hits the moment it is ready, bit-exact; the cold ones are on disk. Without
    warm-up (the default) everything is on disk at first."""
    data = tmp_path / "data"
    first = SidecarProcess(*_args(data, 64)).wait_ready()
    try:
        kvs = _fill(first.address, 10, 4, hot=3, hits=3)
    finally:
        first.stop()
    assert first.proc.returncode == 0
    warm = SidecarProcess(*_args(data, 16, "--warmup-seconds", "30")).wait_ready()
    try:
        text = _metric_text(warm.metrics_port)
        assert _sample(text, 'promptcache_warmup_chunks_total{source="disk"}') == 16  # memory filled, no more
        assert _sample(text, "promptcache_warmup_in_progress") == 0
        cold = _assert_hot_in_memory_bit_exact(warm.address, kvs, 3, 4)
        # 16 chunks of memory: the 12 hot ones and at most one more prompt
        assert [ch.tier for ch in cold if ch is not None].count("disk") >= 6
    finally:
        warm.stop()
    cold_start = SidecarProcess(*_args(tmp_path / "data", 16)).wait_ready()
    try:
        with PromptCacheClient(cold_start.address, timeout=20) as c:  # no warm-up: memory starts empty
            tiers = [ch.tier for t in prompts(10, 4) for ch in c.lookup(SMALL, t).chunks]
        assert "device" not in tiers and len(tiers) == 40
    finally:
        cold_start.stop()


@pytest.mark.slow  # sidecar processes and the CLI
def test_export_then_a_new_sidecar_warms_from_the_snapshot_and_bad_files_are_refused(tmp_path):
    data = tmp_path / "data"
    first = SidecarProcess(*_args(data, 64)).wait_ready()
    try:
        kvs = _fill(first.address, 6, 4, hot=2, hits=3)
    finally:
        first.stop()
    snap = tmp_path / "hot.pcsnap"
    cli = [sys.executable, "-m", "promptcache.cli"]
    out = subprocess.run([*cli, "export", "--data-dir", str(data), "--output", str(snap),
                          "--max-bytes", str(8 * CHUNK_BYTES)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exported 8 chunks" in out.stdout
    recs = list(snapshot.read_snapshot(str(snap)))
    assert len(recs) == 8 and all(r.hits == 3 for r in recs)  # the hot ones (each Get 3 times), roots first
    assert [snapshot_index(r) for r in recs[:4]] == [0, 1, 2, 3]

    # bad files: truncated, one flipped bit, a foreign file; each refused naming the file, nothing stored
    raw = snap.read_bytes()
    bad = {"truncated": raw[:len(raw) // 2], "corrupt": raw[:100] + bytes([raw[100] ^ 0x10]) + raw[101:],
           "foreign": b"\x89PNG\r\n\x1a\n" + os.urandom(2000)}
    for name, content in bad.items():
        path = tmp_path / f"{name}.pcsnap"
        path.write_bytes(content)
        r = subprocess.run([*cli, "import", str(path), "--data-dir", str(tmp_path / f"d-{name}"),
                            "--disk-bytes", "64Mi"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and str(path) in r.stdout, (name, r.stdout + r.stderr)
        assert {"truncated": "truncated", "corrupt": "corrupt", "foreign": "not a PromptCache snapshot"}[name] \
            in r.stdout, r.stdout
        assert "Traceback" not in r.stdout + r.stderr
        assert not (tmp_path / f"d-{name}").exists()  # refused before the data folder was touched
    os.mkfifo(tmp_path / "fifo.pcsnap")  # would block the reader until someone writes (and it is read twice)
    for path, words in ((tmp_path / "fifo.pcsnap", "not a regular file"), (tmp_path, "a directory, not a file")):
        r = subprocess.run([*cli, "import", str(path), "--data-dir", str(tmp_path / "d-odd"), "--disk-bytes", "64Mi"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"promptcache import: {path}: {words}" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "d-odd").exists()
    with pytest.raises(snapshot.SnapshotError, match="truncated"):
        snapshot.verify(str(tmp_path / "truncated.pcsnap"))

    # a new node, no disk tier: loads the snapshot into memory before it is ready
    fresh = SidecarProcess("--memory-bytes", str(64 * CHUNK_BYTES), "--chunk-tokens", str(CHUNK),
                           "--warmup-seconds", "30", "--warmup-snapshot", str(snap)).wait_ready()
    try:
        text = _metric_text(fresh.metrics_port)
        assert _sample(text, 'promptcache_warmup_chunks_total{source="snapshot"}') == 8, \
            [x for x in text.splitlines() if "warmup" in x]
        cold = _assert_hot_in_memory_bit_exact(fresh.address, kvs, 2, 4)
        assert cold == [None] * 4  # only what the snapshot held
    finally:
        fresh.stop()
    # a corrupt snapshot at serve: logged naming the file, nothing stored, ready anyway
    broken = SidecarProcess("--memory-bytes", str(64 * CHUNK_BYTES), "--chunk-tokens", str(CHUNK),
                            "--warmup-seconds", "30", "--warmup-snapshot", str(tmp_path / "corrupt.pcsnap"),
                            "--log-format", "text").wait_ready()
    try:
        with PromptCacheClient(broken.address, timeout=20) as c:
            assert all(c.lookup(SMALL, t).cached_tokens == 0 for t in prompts(6, 4))
        assert _sample(_metric_text(broken.metrics_port), 'promptcache_warmup_chunks_total{source="snapshot"}') == 0
    finally:
        broken.stop()
    log = broken.proc.stdout.read()
    assert str(tmp_path / "corrupt.pcsnap") in log and "nothing of it was stored" in log, log[-3000:]

    # import into a disk tier, then a sidecar on it warms from there
    data2 = tmp_path / "data2"
    r = subprocess.run([*cli, "import", str(snap), "--data-dir", str(data2), "--disk-bytes", "64Mi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "imported 8 chunks" in r.stdout, r.stdout + r.stderr
    node = SidecarProcess(*_args(data2, 64, "--warmup-seconds", "30")).wait_ready()
    try:
        _assert_hot_in_memory_bit_exact(node.address, kvs, 2, 4)
    finally:
        node.stop()


@pytest.mark.slow  # a sidecar process on a disk tier of 20,000 chunks
def test_a_sidecar_process_is_ready_at_its_bound_while_warm_up_goes_on(tmp_path):
    """A disk tier holding more than warm-up can move in --warmup-seconds 0.3: the process is ready with warm-up
    still running (the bound was reached), and warm-up then finishes in the background, memory filled."""
    import numpy as np

    from promptcache.sidecar.tiers.disk import encode_meta
    from promptcache.sidecar.store import Entry

    n, size = 20_000, 1024
    data = tmp_path / "data"
    with disktier.DiskTier(str(data / "rocksdb"), 256 << 20) as d:
        parent = bytes(32)
        for i in range(n):
            payload = np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8).tobytes()
            key = i.to_bytes(4, "little") * 8
            e = Entry(key, b"f" * 32, parent, i % 64, torch.frombuffer(bytearray(payload), dtype=torch.uint8),
                      disktier.xxhash.xxh3_64_intdigest(payload), (size // 4,), 0, 0.0, 0.0, size)
            deadline = time.monotonic() + 60
            while not d.put(key, payload, meta=encode_meta(e), parent=parent, hits=n - i, last_access=time.time()):
                assert not d.disk_full and time.monotonic() < deadline, (
                    f"chunk {i} was never taken: disk_full={d.disk_full}, {shutil.disk_usage(data).free} bytes free")
                d.flush()
            parent = key if i % 64 != 63 else bytes(32)
        assert d.flush(60)
    proc = SidecarProcess("--memory-bytes", str(2 * n * size), "--disk-bytes", "256Mi", "--data-dir", str(data),
                          "--chunk-tokens", str(CHUNK), "--warmup-seconds", "0.3", "--log-format", "text").wait_ready()
    try:
        text = _metric_text(proc.metrics_port)
        assert _sample(text, "promptcache_warmup_bound_reached_total") == 1
        assert _sample(text, "promptcache_warmup_in_progress") == 1, "warm-up was over before the bound"
        warmed = _sample(text, 'promptcache_warmup_chunks_total{source="disk"}')
        assert 0 < warmed < n
        deadline = time.monotonic() + 120
        while _sample(_metric_text(proc.metrics_port), "promptcache_warmup_in_progress") == 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert _sample(_metric_text(proc.metrics_port), 'promptcache_warmup_chunks_total{source="disk"}') == n
    finally:
        proc.stop()
    log = proc.proc.stdout.read()
    assert "warm-up still running after 0.3 s" in log and "warm-up finished" in log, log[-2000:]


def test_warm_up_never_brings_a_chunk_without_its_parent(sidecar_factory, tmp_path):
    """Memory for 5 chunks, a hot 4-chunk prompt and a 4-chunk one: the second's root fits but not its whole
    chain; what is brought in is always whole prefixes from the root (nothing unreachable)."""
    data = str(tmp_path / "data")
    first = sidecar_factory(memory_bytes=64 * CHUNK_BYTES, disk_bytes=64 << 20, data_dir=data)
    a, b = prompts(2, 4)
    with PromptCacheClient(first.address) as c:
        c.put(SMALL, a, make_kv(SMALL, len(a), seed=1))
        c.put(SMALL, b, make_kv(SMALL, len(b), seed=2))
        for _ in range(3):
            c.get(SMALL, a)
    first.stop()
    second = sidecar_factory(memory_bytes=5 * CHUNK_BYTES, disk_bytes=64 << 20, data_dir=data, warmup_seconds=30.0)
    assert second.warmup.done.wait(30)
    with PromptCacheClient(second.address) as c:
        assert [ch.tier for ch in c.lookup(SMALL, a).chunks] == ["device"] * 4
        tiers = [ch.tier for ch in c.lookup(SMALL, b).chunks]
    assert len(tiers) == 4 and tiers.count("device") <= 1 and tiers[1:] == ["disk"] * 3
    held = {e.key: e for e in second.tier.snapshot()}
    assert all(e.index == 0 or e.parent in held for e in held.values())


@pytest.mark.slow  # in-process sidecars, two Mooncake masters: about 40 s here
def test_the_warm_up_benchmark_shows_each_source_filling_memory_and_none_changing_what_is_cached(capsys):
    """promptcache_devtools.warmup_bench on a slice of the trace: every warm-up row warmed chunks and serves more of
    the window from memory than its cold counterpart, and the overall hit ratio is the same with and without it
    (warm-up moves chunks between tiers; it never makes up a hit)."""
    from promptcache_devtools import warmup_bench

    assert warmup_bench.main(["--before", "300", "--window-seconds", "20", "--memory-chunks", "400",
                              "--cluster"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("start", "---"):
            rows[cells[0]] = [float(c) for c in cells[1:]]
    pairs = [("no warm-up (restart on its disk tier)", "warm-up from its disk tier"),
             ("new node, no disk: no warm-up", "new node, no disk: warm-up from a snapshot"),
             ("new node, no disk, cluster tier: no warm-up", "new node, no disk: warm-up from the cluster's hot lists")]
    assert len(rows) == 7 and "reference: no restart (the same sidecar goes on)" in rows
    for cold, warm in pairs:
        assert rows[cold][1] == 0 and rows[warm][1] > 0, (cold, warm)
        assert rows[warm][2] > rows[cold][2], (cold, warm)  # memory hit ratio
    assert rows[pairs[0][0]][3] == rows[pairs[0][1]][3]  # overall, restart on its disk
    # overall, in the cluster: the same unless a cluster call ran past its 2 s deadline on a loaded machine (the
    # tier is then skipped for a while, as designed), which may cost a few misses
    assert abs(rows[pairs[2][0]][3] - rows[pairs[2][1]][3]) <= 0.02


def test_a_running_sidecar_exports_its_hottest_chunks_and_another_warms_from_them(sidecar_factory, tmp_path,
                                                                                   capsys):
    """`promptcache export --address` (the admin Export call): while it keeps serving, a sidecar's memory and disk
    tiers become one snapshot file, hottest first, each chunk after its parent, verified whole before it is
    written; reading for it counts no hit. A new sidecar warms from the file and serves the hot prompts from memory,
    bit-exact. --max-bytes bounds it; a tenant not in --admin-tenants is refused and no file is left."""
    from promptcache import cli

    tokens = tmp_path / "tokens"
    write_secret_dir(tokens, {"ops": "ops-token", "bob": "bob-token"})
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))  # one fleet secret: a tenant's keys are the same on both sidecars
    auth = dict(token_file=str(tokens), admin_tenants="ops", tenant_secret_file=str(secret))
    s = sidecar_factory(memory_bytes=8 * CHUNK_BYTES, data_dir=str(tmp_path / "data"), disk_bytes=64 * CHUNK_BYTES,
                        disk_min_free_bytes=0, **auth)
    kvs = {}
    with PromptCacheClient(s.address, token="ops-token") as c:
        for p, t in enumerate(prompts(6, 2)):  # 12 chunks through 8 of memory: some go to the disk tier
            kvs[p] = make_kv(SMALL, len(t), seed=p)
            assert c.put(SMALL, t, kvs[p]).stored_chunks == 2
        for _ in range(3):
            for p in (4, 5):  # the hot ones (the newest: still in memory)
                assert c.get(SMALL, prompts(6, 2)[p])[0] == 2 * CHUNK
    hits = {e.key: e.hits for e in s.tier.snapshot()}
    out = tmp_path / "live.pcsnap"
    (tmp_path / "ops").write_text("ops-token\n")
    code = cli.main(["export", "--address", s.address, "--token-file", str(tmp_path / "ops"), "--output", str(out)])
    assert code == 0, capsys.readouterr()
    assert "exported 12 chunks" in capsys.readouterr().out
    assert {e.key: e.hits for e in s.tier.snapshot()} == hits  # an export is not a read
    records = list(snapshot.read_snapshot(str(out)))
    assert len(records) == 12 and len({r.key for r in records}) == 12
    hot_keys = {k for e in s.tier.snapshot() if e.hits for k in [e.key]}
    assert {r.key for r in records[:4]} == hot_keys  # prompts 4 and 5 first
    seen = set()
    for r in records:
        assert r.parent in seen or snapshot.as_record(r).index == 0  # each after its parent
        seen.add(r.key)

    # --max-bytes, and a tenant that is not an admin
    small = tmp_path / "small.pcsnap"
    assert cli.main(["export", "--address", s.address, "--token-file", str(tmp_path / "ops"), "--output",
                     str(small), "--max-bytes", str(3 * CHUNK_BYTES)]) == 0
    assert snapshot.verify(str(small)) == 3
    (tmp_path / "bob").write_text("bob-token\n")
    denied = tmp_path / "denied.pcsnap"
    assert cli.main(["export", "--address", s.address, "--token-file", str(tmp_path / "bob"), "--output",
                     str(denied)]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().out and not denied.exists()
    assert list(tmp_path.glob("denied.pcsnap*")) == []

    # a new node warms from the file: the hot prompts are in memory when it is ready
    warm = sidecar_factory(memory_bytes=4 * CHUNK_BYTES, warmup_snapshot=str(out), warmup_seconds=10, **auth)
    assert warm.warmup.ready.wait(30)
    with PromptCacheClient(warm.address, token="ops-token") as c:
        for p in (4, 5):
            t = prompts(6, 2)[p]
            assert [ch.tier for ch in c.lookup(SMALL, t).chunks] == ["device"] * 2
            got = c.get(SMALL, t)[1]
            for (k, v), (gk, gv) in zip(kvs[p], got):
                assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))


@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.8.9.1:1", True), ("ipv6:[::1]:5000", True),
    ("ipv6:[::ffff:127.0.0.1]:5000", True), ("unix:/run/promptcache/grpc.sock", True), ("unix:", True),
    ("ipv4:10.0.0.7:5000", False), ("ipv6:[2001:db8::1]:5000", False), ("ipv6:[::ffff:10.0.0.7]:1", False),
    ("ipv4:localhost:1", False), ("", False), ("tcp:127.0.0.1:1", False)])
def test_an_unauthenticated_export_is_answered_only_on_this_machine(peer, local):
    from promptcache.sidecar.netaddr import is_local_peer

    assert is_local_peer(peer) is local


def test_an_unauthenticated_sidecar_exports_to_a_caller_on_loopback(sidecar_factory, tmp_path, capsys):
    from promptcache import cli

    s = sidecar_factory()
    with PromptCacheClient(s.address) as c:
        c.put(SMALL, prompts(1, 3)[0], make_kv(SMALL, 3 * CHUNK))
    out = tmp_path / "loopback.pcsnap"
    assert cli.main(["export", "--address", s.address, "--output", str(out)]) == 0
    assert snapshot.verify(str(out)) == 3


def _non_loopback_ipv4() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route picks this machine's outward address
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_an_unauthenticated_export_from_another_address_is_refused(sidecar_factory, tmp_path, capsys):
    from promptcache import cli

    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    s = sidecar_factory(grpc_address="0.0.0.0:0", allow_insecure_remote=True)
    out = tmp_path / "remote.pcsnap"
    assert cli.main(["export", "--address", f"{ip}:{s.port}", "--output", str(out)]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().out and not out.exists()


# --- the resident list: what memory held at the last graceful stop comes back first ---------------------------
def test_warm_up_brings_back_what_memory_held_at_the_stop_before_hotter_chunks_it_had_evicted(sidecar_factory,
                                                                                               tmp_path):
    """Memory for 4 chunks under LRU: an old prompt with many hits was evicted to disk by two newer ones. The
    resident list written at the graceful stop makes warm-up bring back the two newer prompts (the policy's own
    choice), not the old one that ranks first by hit count; the list is consumed by that start. The control (the
    list removed before the start) warms the old prompt first."""
    from promptcache.sidecar.warmup import RESIDENT_FILE

    old, new1, new2 = prompts(3, 2)
    tiers = {}
    for case in ("resident list", "control"):
        data = str(tmp_path / case)
        flags = dict(memory_bytes=4 * CHUNK_BYTES, disk_bytes=64 << 20, data_dir=data, eviction_policy="lru")
        first = sidecar_factory(**flags)
        with PromptCacheClient(first.address) as c:
            for seed, tokens in enumerate((old, new1, new2)):
                c.put(SMALL, tokens, make_kv(SMALL, len(tokens), seed=seed))
                for _ in range(5 if tokens is old else 1):
                    c.get(SMALL, tokens)
            assert [ch.tier for ch in c.lookup(SMALL, old).chunks] == ["disk"] * 2
        first.stop()
        listed = os.path.join(first.spill.disk.path, RESIDENT_FILE)
        assert os.path.exists(listed)
        if case == "control":
            os.unlink(listed)
        again = sidecar_factory(**flags, warmup_seconds=30.0)
        assert again.warmup.done.wait(30) and again.warmup.report["disk_chunks"] == 4
        assert not os.path.exists(listed)  # consumed: a later start does not read it again
        with PromptCacheClient(again.address) as c:
            tiers[case] = {name: [ch.tier for ch in c.lookup(SMALL, t).chunks]
                           for name, t in (("old", old), ("new1", new1), ("new2", new2))}
        again.stop()
    assert tiers["resident list"] == {"old": ["disk"] * 2, "new1": ["device"] * 2, "new2": ["device"] * 2}
    assert tiers["control"]["old"] == ["device"] * 2


def test_a_resident_list_that_is_not_one_only_orders_nothing(tmp_path):
    """The list only orders warm-up (each chunk is still read and verified from the disk tier): a corrupt,
    truncated, foreign or oversized file gives no keys, is removed, and does not stop the sidecar."""
    from promptcache.sidecar import hotlist, warmup

    path = tmp_path / warmup.RESIDENT_FILE
    assert warmup.take_resident(str(tmp_path)) == []  # none written
    entries = [hotlist.HotEntry(bytes([i]) * 32, b"f" * 32, "") for i in range(3)]
    good = hotlist.encode(entries, 1.0)
    path.write_bytes(good)
    assert warmup.take_resident(str(tmp_path)) == [e.key for e in entries]
    assert not path.exists()
    for bad in (good[:-1], good[:-8] + bytes(8), b"not a list", bytes(warmup.HOT_LIST_MAX_BYTES + 1)):
        path.write_bytes(bad)
        assert warmup.take_resident(str(tmp_path)) == []
        assert not path.exists()


def test_a_chunk_restored_with_hits_is_scored_as_proven_not_as_fresh():
    """rate-hazard (the default): a chunk inserted with hits of an earlier life (warm-up, a promotion) gets a gap of
    one turnover of the cache and is not sampled as a fresh chunk; one without hits is fresh as before."""
    from promptcache.sidecar.policies import ROOT_PARENT, key_hash64, make_policy

    p = make_policy("rate-hazard", capacity=100 * 10)
    warm, new = [k for k in (bytes([i]) * 32 for i in range(256)) if key_hash64(k) % p.fresh_sample == 0][:2]
    p.inserted(warm, 10, ROOT_PARENT)
    assert warm in p._tracked  # (a key the policy samples as a fresh chunk...)
    p.restored(warm, 3)
    assert warm not in p._tracked  # (...no longer)
    p.inserted(new, 10, ROOT_PARENT)
    p.restored(new, 0)
    assert p.stats[warm][1] == 100 and p.stats[new][1] is None and new in p._tracked
    p.requested(warm)  # its own gaps take over from the prior as it is requested
    assert p.stats[warm][1] != 100
