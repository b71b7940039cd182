"""Disk faults on a real, size-limited filesystem made by the test (a tmpfs mount; needs root, as in CI):
the disk fills up, spilling stops with a metric and a log line, and the memory tier keeps serving; once space
is freed (a Purge, or another file going away) the space goes back to the filesystem and spilling resumes."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

import pytest

from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes
from support import SMALL, SidecarProcess, make_kv
from support import metric as sidecar_metric

CHUNK = 256
CHUNK_BYTES = chunk_nbytes(SMALL, CHUNK)  # 64 KiB


def mount_tmpfs(path, size: str):
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"cannot mount a {size} tmpfs (the test needs root): {result.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small-fs"
    mount_tmpfs(mount, "6m")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def fs_64m(tmp_path):
    """Request it before sidecar_factory: fixtures are torn down in reverse, so the sidecar stops first."""
    mount = tmp_path / "fs-64m"
    mount_tmpfs(mount, "64m")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


@pytest.mark.slow  # a sidecar process filling a small filesystem; test_disk.py checks disk-full in process
def test_disk_full_stops_spilling_and_memory_keeps_serving(small_fs):
    proc = SidecarProcess("--memory-bytes", str(8 * CHUNK_BYTES), "--chunk-tokens", str(CHUNK),
                          "--disk-bytes", "256Mi", "--disk-min-free-bytes", "0", "--data-dir", str(small_fs),
                          "--eviction-policy", "lru", "--log-format", "text").wait_ready()
    try:
        with PromptCacheClient(proc.address, timeout=20) as c:
            prompts = [[p * 100_000 + t for t in range(CHUNK)] for p in range(300)]  # ~19 MiB > 6 MiB of fs
            for p, tokens in enumerate(prompts):
                c.put(SMALL, tokens, make_kv(SMALL, CHUNK, seed=p))
            deadline = time.monotonic() + 30
            while metric(proc.metrics_port, 'promptcache_disk_full{tier="disk"}') != 1:
                assert time.monotonic() < deadline, "the disk tier never noticed the full filesystem"
                time.sleep(0.2)
            # Memory keeps serving: the latest prompts are there, bit-exact.
            for p in range(292, 300):
                cached, kv = c.get(SMALL, prompts[p])
                assert cached == CHUNK
                expected = make_kv(SMALL, CHUNK, seed=p)
                assert all(bool((a == b).all()) for (a, _), (b, _) in zip(kv, expected))
            # Whatever made it to disk before it filled is served exactly or not at all.
            for p in range(0, 40):
                cached, kv = c.get(SMALL, prompts[p])
                if cached:
                    expected = make_kv(SMALL, CHUNK, seed=p)
                    assert all(bool((a == b).all()) for (a, _), (b, _) in zip(kv, expected))
            assert c.healthy()
            assert metric(proc.metrics_port, "promptcache_demotion_failures_total") > 0
    finally:
        proc.stop()
        out = proc.proc.stdout.read()
    assert "disk full" in out.lower() or "no space" in out.lower(), out[-2000:]


# 512 KiB chunks of 16 tokens: a 64 MiB volume fills after about a hundred spilled chunks.
BIG = ModelSpec("test/one-mib-chunks", "rev-1", "float32", num_layers=8, num_kv_heads=8, head_dim=64)
BIG_CHUNK = 16
BIG_BYTES = chunk_nbytes(BIG, BIG_CHUNK)


def _free(path) -> int:
    return shutil.disk_usage(path).free


def _wait(condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _spill_until_full(sidecar, client, seed0: int) -> int:
    """Put one-chunk prompts (each evicting an older one to disk) until the disk tier reports full."""
    n = 0
    while sidecar_metric(sidecar, 'promptcache_disk_full{tier="disk"}') != 1:
        assert n < 200, "the disk tier never noticed the full volume"
        tokens = [(seed0 + n) * 1000 + t for t in range(BIG_CHUNK)]
        client.put(BIG, tokens, make_kv(BIG, BIG_CHUNK, seed=seed0 + n))
        sidecar.spill.disk.flush()
        n += 1
    return n


def _spills_again(sidecar, client, seed0: int) -> None:
    """New prompts are demoted to disk again and read back exactly."""
    prompts = [[(seed0 + i) * 1000 + t for t in range(BIG_CHUNK)] for i in range(6)]
    for i, tokens in enumerate(prompts):
        client.put(BIG, tokens, make_kv(BIG, BIG_CHUNK, seed=seed0 + i))
    assert sidecar.spill.disk.flush(10)
    on_disk = [i for i, tokens in enumerate(prompts)
               if [ch.tier for ch in client.lookup(BIG, tokens).chunks] == ["disk"]]
    assert on_disk, "nothing was spilled to disk after the space came back"
    cached, kv = client.get(BIG, prompts[on_disk[0]])
    expected = make_kv(BIG, BIG_CHUNK, seed=seed0 + on_disk[0])
    assert cached == BIG_CHUNK and all(bool((a == b).all()) for (a, _), (b, _) in zip(kv, expected))


@pytest.mark.slow  # fills a filesystem; the ENOSPC test below is the fast lane's
def test_space_freed_by_purge_goes_back_to_the_volume_and_spilling_resumes(fs_64m, sidecar_factory):
    sidecar = sidecar_factory(memory_bytes=4 * BIG_BYTES, chunk_tokens=BIG_CHUNK, disk_bytes=1 << 30,
                              disk_min_free_bytes=16 << 20, data_dir=str(fs_64m), eviction_policy="lru")
    with PromptCacheClient(sidecar.address, timeout=20) as c:
        spilled = _spill_until_full(sidecar, c, 0)
        assert _free(fs_64m) < 24 << 20, f"{spilled} chunks spilled and the volume still has room"
        assert c.purge(BIG)[0] > 0
        assert len(sidecar.spill.disk) == 0
        # RocksDB gives the deleted records' space back, and the tier sees it without any new put.
        _wait(lambda: _free(fs_64m) > 56 << 20, f"purged, but the volume still has only {_free(fs_64m)} bytes free")
        _wait(lambda: sidecar_metric(sidecar, 'promptcache_disk_full{tier="disk"}') == 0,
              "free space is back but promptcache_disk_full stayed 1")
        _spills_again(sidecar, c, 500)


def test_spilling_resumes_after_rocksdb_itself_hit_enospc(fs_64m, sidecar_factory):
    """Another file fills the volume, so RocksDB's own writes fail (it then refuses every write until the
    database is reopened); once that file is gone the tier recovers by itself, and keeps what it held."""
    settings = dict(memory_bytes=4 * BIG_BYTES, chunk_tokens=BIG_CHUNK, disk_bytes=1 << 30, disk_min_free_bytes=0,
                    data_dir=str(fs_64m / "data"), eviction_policy="lru")
    sidecar = sidecar_factory(**settings)
    ballast = fs_64m / "ballast"
    kept = [[7_000_000 + i * 1000 + t for t in range(BIG_CHUNK)] for i in range(8)]
    with PromptCacheClient(sidecar.address, timeout=20) as c:
        for i, tokens in enumerate(kept):  # 4 on disk (still in RocksDB's WAL and memtable), 4 in memory
            c.put(BIG, tokens, make_kv(BIG, BIG_CHUNK, seed=7000 + i))
        assert sidecar.spill.disk.flush(10)
        assert [c.lookup(BIG, t).chunks[0].tier for t in kept[:4]] == ["disk"] * 4
        with open(ballast, "wb", buffering=0) as f:  # fill the volume to the last byte
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    pass
        _spill_until_full(sidecar, c, 100)
        # A delete while full makes the tier flush and compact, and RocksDB's own blob write fails: from then on
        # RocksDB refuses every write until the database is reopened.
        assert c.delete(BIG, kept[3]) == 1
        _wait(lambda: sidecar.spill.disk.stats().get("write_errors", 0) >= 1,
              "RocksDB never failed a write on the full volume")
        os.unlink(ballast)
        _wait(lambda: sidecar_metric(sidecar, 'promptcache_disk_full{tier="disk"}') == 0,
              "the volume has room again but promptcache_disk_full stayed 1")
        assert sidecar.spill.disk.stats()["reopens"] >= 1
        _spills_again(sidecar, c, 600)
    sidecar.stop(0)
    # After a restart: what was on disk before the failure is served bit-exact, and the delete held.
    again = sidecar_factory(**settings)
    with PromptCacheClient(again.address, timeout=20) as c:
        for i, tokens in enumerate(kept[:3]):
            cached, kv = c.get(BIG, tokens)
            expected = make_kv(BIG, BIG_CHUNK, seed=7000 + i)
            assert cached == BIG_CHUNK and all(bool((a == b).all()) for (a, _), (b, _) in zip(kv, expected))
        assert c.lookup(BIG, kept[3]).cached_tokens == 0
