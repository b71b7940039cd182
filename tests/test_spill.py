"""Memory and disk together, through the real server and client: demotion on capacity eviction, promotion on a
hit, restart persistence, purge, TTL on disk, an unwritable data path, and kill -9 during puts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from promptcache.client import PromptCacheClient, errors
from promptcache.contract.layout import chunk_nbytes
from support import CHUNK, SMALL, FakeClock, SidecarProcess, make_kv, metric

CHUNK_BYTES = chunk_nbytes(SMALL, CHUNK)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def tiered(sidecar_factory, tmp_path):
    def start(**overrides):
        settings = dict(memory_bytes=2 * CHUNK_BYTES, disk_bytes=64 << 20, data_dir=str(tmp_path / "data"))
        settings.update(overrides)
        return sidecar_factory(**settings)
    return start


def wait_written(sidecar, timeout=10):
    assert sidecar.spill.disk.flush(timeout)


def test_capacity_eviction_demotes_and_a_hit_promotes_bit_identical(tiered):
    sidecar = tiered()
    tokens = list(range(5 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=11)
    with PromptCacheClient(sidecar.address) as c:
        assert c.put(SMALL, tokens, kv).stored_chunks == 5
        wait_written(sidecar)
        tiers = [ch.tier for ch in c.lookup(SMALL, tokens).chunks]
        assert sorted(tiers) == ["device"] * 2 + ["disk"] * 3  # which ones is the policy's choice
        cached, got = c.get(SMALL, tokens)
        assert cached == 5 * CHUNK
        for (k, v), (gk, gv) in zip(kv, got):
            assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))
        stats = {t.tier: t for t in c.stats().tiers}
    usage = sidecar.tier.usage()
    assert usage["used"] <= 2 * CHUNK_BYTES
    assert sidecar.metrics.promotions._value.get() >= 3 and sidecar.metrics.demotions._value.get() >= 3
    # One tier at a time: what memory holds now is not also on disk.
    in_memory = set(sidecar.tier._entries)
    assert not any(k in sidecar.spill.disk for k in in_memory)
    assert len(stats) == 2


def test_write_queue_gauge_shows_demotions_waiting_for_the_writer(tiered):
    """promptcache_disk_write_queue_bytes: what memory demoted and the disk has not written yet (served from the
    queue meanwhile); it drains to 0 once written."""
    sidecar = tiered()
    disk = sidecar.spill.disk
    held, write_batch = threading.Event(), disk._write_batch
    disk._write_batch = lambda *a: (held.wait(30), write_batch(*a))  # the writer waits until released
    gauge = 'promptcache_disk_write_queue_bytes{tier="disk"}'
    tokens = list(range(5 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=12)
    with PromptCacheClient(sidecar.address) as c:
        assert c.put(SMALL, tokens, kv).stored_chunks == 5
        assert metric(sidecar, gauge) >= 2 * CHUNK_BYTES  # three demoted, one maybe taken by the writer already
        cached, got = c.get(SMALL, tokens)  # served from the queue meanwhile
        assert cached == 5 * CHUNK and all(torch.equal(a, b) for (a, _), (b, _) in zip(got, kv))
        held.set()
        wait_written(sidecar)
        assert metric(sidecar, gauge) == 0


def test_restart_serves_what_was_stored_before(tiered, tmp_path):
    tokens = list(range(4 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=12)
    first = tiered(memory_bytes=8 * CHUNK_BYTES)
    with PromptCacheClient(first.address) as c:
        c.put(SMALL, tokens, kv)
    first.stop()  # graceful: memory is demoted to disk and flushed
    second = tiered(memory_bytes=8 * CHUNK_BYTES)
    with PromptCacheClient(second.address) as c:
        assert [ch.tier for ch in c.lookup(SMALL, tokens).chunks] == ["disk"] * 4
        cached, got = c.get(SMALL, tokens)
    assert cached == 4 * CHUNK
    for (k, v), (gk, gv) in zip(kv, got):
        assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v))


def test_purge_and_delete_reach_the_disk_tier(tiered):
    sidecar = tiered()
    tokens = list(range(4 * CHUNK))
    with PromptCacheClient(sidecar.address) as c:
        c.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
        wait_written(sidecar)
        assert c.delete(SMALL, tokens, start_chunk=3) == 1
        assert c.lookup(SMALL, tokens).cached_tokens == 3 * CHUNK
        assert c.purge(SMALL)[0] == 3
        assert c.lookup(SMALL, tokens).cached_tokens == 0
    assert len(sidecar.spill.disk) == 0


def test_ttl_applies_on_disk(tiered):
    clock = FakeClock()
    sidecar = tiered(ttl_seconds=1.0, clock=clock)
    tokens = list(range(4 * CHUNK))
    with PromptCacheClient(sidecar.address) as c:
        c.put(SMALL, tokens, make_kv(SMALL, len(tokens)))
        wait_written(sidecar)
        clock.advance(0.9)
        assert c.lookup(SMALL, tokens).chunks[0].tier == "disk"
        assert c.lookup(SMALL, tokens).cached_tokens == 4 * CHUNK
        clock.advance(0.2)
        assert c.lookup(SMALL, tokens).cached_tokens == 0
        assert c.get_blobs(SMALL, tokens) == []


@pytest.mark.slow  # a sidecar process that must fail to start
def test_unwritable_data_path_exits_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path = blocker / "data"
    out = subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", "--metrics-port", "0",
                          "--disk-bytes", "64Mi", "--data-dir", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert str(path) in out.stdout + out.stderr


@pytest.mark.slow  # sidecar processes killed and restarted over and over: minutes here under load
def test_kill_9_during_puts_never_serves_a_bad_chunk(tmp_path):
    """20 rounds: stream puts, kill -9 mid-stream, restart on the same data, check everything served."""
    data = tmp_path / "data"
    prompts = [[p * 1000 + t for t in range(3 * CHUNK)] for p in range(40)]
    expected = {p: make_kv(SMALL, 3 * CHUNK, seed=p) for p in range(len(prompts))}
    args = ("--memory-bytes", str(2 * CHUNK_BYTES), "--disk-bytes", "64Mi", "--data-dir", str(data),
            "--chunk-tokens", str(CHUNK), "--log-level", "warning")
    served_from_disk = 0
    for round_ in range(20):
        proc = SidecarProcess(*args).wait_ready()
        try:
            with PromptCacheClient(proc.address, timeout=5, retries=0) as c:
                # Whatever survived earlier kills must be served exactly, or not at all.
                for p, tokens in enumerate(prompts):
                    cached, got = c.get(SMALL, tokens)
                    for (k, v), (gk, gv) in zip(expected[p], got):
                        assert torch.equal(gk, k[:, :, :cached]) and torch.equal(gv, v[:, :, :cached])
                    served_from_disk += cached // CHUNK
                stop = threading.Event()

                def writer():
                    i = round_
                    while not stop.is_set():
                        p = i % len(prompts)
                        try:
                            c.put(SMALL, prompts[p], expected[p])
                        except errors.PromptCacheError:
                            return
                        i += 7

                t = threading.Thread(target=writer)
                t.start()
                time.sleep(0.2 + 0.05 * (round_ % 5))
                os.kill(proc.proc.pid, signal.SIGKILL)
                proc.proc.wait(10)
                stop.set()
                t.join(10)
        finally:
            proc.stop()
    assert served_from_disk > 0  # the loop really exercised restarts with data on disk


def _data_dir_listing(data) -> list[str]:
    return sorted(os.listdir(data))


@pytest.mark.slow
def test_second_sidecar_on_the_same_data_dir_waits_then_exits_and_destroys_nothing(tmp_path):
    """A held RocksDB lock is not corruption: the second sidecar waits --disk-lock-wait-seconds, exits 2 naming
    the path and the holder, and the first one's disk tier is untouched (also after it restarts)."""
    data = tmp_path / "data"
    args = ("--memory-bytes", str(2 * CHUNK_BYTES), "--disk-bytes", "64Mi", "--data-dir", str(data),
            "--chunk-tokens", str(CHUNK), "--log-format", "text")
    tokens = list(range(6 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=21)
    first = SidecarProcess(*args).wait_ready()
    try:
        with PromptCacheClient(first.address, timeout=10) as c:
            assert c.put(SMALL, tokens, kv).stored_chunks == 6
            assert sorted(ch.tier for ch in c.lookup(SMALL, tokens).chunks) == ["device"] * 2 + ["disk"] * 4
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", "--metrics-port", "0",
                                 "--grpc-address", "127.0.0.1:0", "--disk-lock-wait-seconds", "2", *args],
                                capture_output=True, text=True, timeout=120)
        waited = time.monotonic() - t0
        out = second.stdout + second.stderr
        assert second.returncode == 2, out[-3000:]
        assert waited >= 2.0
        assert str(data / "rocksdb") in out and "in use by another process" in out
        assert f"pid {first.proc.pid}" in out, out[-3000:]  # the holder, from the lock table and the owner file
        assert "Traceback" not in out
        assert _data_dir_listing(data) == ["rocksdb"], "the second sidecar moved or added files"
        with PromptCacheClient(first.address, timeout=10) as c:  # the first one still serves from disk
            cached, got = c.get(SMALL, tokens)
            assert cached == 6 * CHUNK
            assert all(torch.equal(bits(gk), bits(k)) for (k, _), (gk, _) in zip(kv, got))
    finally:
        first.stop()
    third = SidecarProcess(*args).wait_ready()  # and after a restart nothing was lost
    try:
        with PromptCacheClient(third.address, timeout=10) as c:
            assert [ch.tier for ch in c.lookup(SMALL, tokens).chunks] == ["disk"] * 6
            cached, got = c.get(SMALL, tokens)
        assert cached == 6 * CHUNK
        assert all(torch.equal(bits(gv), bits(v)) for (_, v), (_, gv) in zip(kv, got))
    finally:
        third.stop()
    assert not [n for n in _data_dir_listing(data) if "corrupt" in n]


@pytest.mark.slow
def test_rolling_update_new_sidecar_waits_for_the_old_one_and_keeps_its_cache(tmp_path):
    data = tmp_path / "data"
    args = ("--memory-bytes", str(8 * CHUNK_BYTES), "--disk-bytes", "64Mi", "--data-dir", str(data),
            "--chunk-tokens", str(CHUNK), "--log-format", "text")
    tokens = list(range(3 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=22)
    old = SidecarProcess(*args).wait_ready()
    new = None
    try:
        with PromptCacheClient(old.address, timeout=10) as c:
            assert c.put(SMALL, tokens, kv).stored_chunks == 3  # in memory only, until the old one stops
        new = SidecarProcess(*args, "--disk-lock-wait-seconds", "60")
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(new.proc.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not any("disk tier" in line for line in lines):  # the new one has reached the locked database
            assert new.proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.1)
        old.stop()  # SIGTERM: memory is demoted to disk, then the database is closed and its lock released
        assert old.proc.returncode == 0
        new.wait_ready(60)
        with PromptCacheClient(new.address, timeout=10) as c:
            assert [ch.tier for ch in c.lookup(SMALL, tokens).chunks] == ["disk"] * 3
            cached, got = c.get(SMALL, tokens)
        assert cached == 3 * CHUNK
        assert all(torch.equal(bits(gk), bits(k)) for (k, _), (gk, _) in zip(kv, got))
    finally:
        old.stop()
        if new is not None:
            new.stop()
