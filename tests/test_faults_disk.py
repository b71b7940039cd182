"""Disk faults on a real, size-limited filesystem made by the test (a tmpfs mount; needs root, as in CI):
the disk fills up, spilling stops with a metric and a log line, and the memory tier keeps serving."""
from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest

from promptcache.client import PromptCacheClient
from promptcache.layout import chunk_nbytes
from support import SMALL, SidecarProcess, make_kv

CHUNK = 256
CHUNK_BYTES = chunk_nbytes(SMALL, CHUNK)  # 64 KiB


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small-fs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"cannot mount a 6 MiB tmpfs (the test needs root): {result.stderr.strip()}")
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
