"""`promptcache export --data-dir DIR` reads the disk tier read-only. It used to open RocksDB read-write: at each
run it rewrote the folder (a new MANIFEST, WAL, OPTIONS, a rolled LOG, the owner file, the reserve) and could
delete records (expired ones, any it could not decode); beside a running sidecar it failed on the lock but still
rolled the sidecar's LOG. Now nothing in DIR changes (content, size, mode, mtime), no lock is taken, and it works
beside a sidecar serving from DIR (what that sidecar committed to its disk tier)."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from support import SMALL, SidecarProcess, make_kv
from promptcache.client import PromptCacheClient
from promptcache.sidecar.disk import lock_holders

pytestmark = pytest.mark.slow  # sidecar processes


def folder_state(root) -> dict:
    """Every file under `root`: content hash, size, mode and mtime (a link: its target)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            digest = ""
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:  # (this process holds no lock on any of them: reading LOCK is safe)
                    digest = hashlib.sha256(f.read()).hexdigest()
            state[os.path.relpath(full, root)] = (digest, st.st_size, st.st_mode, st.st_mtime_ns,
                                                  os.readlink(full) if os.path.islink(full) else None)
    return state


def changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def disk_sidecar(data_dir) -> SidecarProcess:
    return SidecarProcess("--memory-bytes", "512Ki", "--chunk-tokens", "256", "--disk-bytes", "64Mi",
                          "--disk-min-free-bytes", "0", "--data-dir", str(data_dir), "--log-format", "text")


def fill(proc: SidecarProcess, prompts: int = 16) -> None:
    """Puts that overflow the 512 KiB memory tier: chunks are demoted to the disk tier."""
    with PromptCacheClient(proc.address, timeout=20) as c:
        for p in range(prompts):
            for _ in range(2):
                c.put(SMALL, [p * 100_000 + t for t in range(256)], make_kv(SMALL, 256, seed=p))


def export(data_dir, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "promptcache.cli", "export", "--data-dir", str(data_dir),
                           "--output", str(out)], capture_output=True, text=True, timeout=120)


def verified_chunks(path) -> int:
    r = subprocess.run([sys.executable, "-m", "promptcache.cli", "import", str(path), "--verify-only"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return int(r.stdout.split(": ")[1].split()[0])


def test_an_export_leaves_a_stopped_sidecars_data_dir_byte_identical(tmp_path):
    data = tmp_path / "data"
    proc = disk_sidecar(data)
    try:
        proc.wait_ready()
        fill(proc)
        proc.proc.send_signal(signal.SIGTERM)
        out, _ = proc.proc.communicate(timeout=60)
    finally:
        proc.stop()
    assert proc.proc.returncode == 0 and "disk tier closed" in out, out
    before = folder_state(data)
    for i in range(2):  # twice: a first read-write open would also have changed what the second one finds
        r = export(data, tmp_path / f"hot-{i}.snap")
        assert r.returncode == 0 and "exported" in r.stdout, r.stdout + r.stderr
        assert changed(before, folder_state(data)) == [], "export changed the data dir"
    assert verified_chunks(tmp_path / "hot-0.snap") == verified_chunks(tmp_path / "hot-1.snap") > 0
    with open(tmp_path / "hot-0.snap", "rb") as a, open(tmp_path / "hot-1.snap", "rb") as b:
        assert a.read() == b.read()


def test_an_export_works_beside_the_sidecar_serving_from_the_data_dir(tmp_path):
    data = tmp_path / "data"
    proc = disk_sidecar(data)
    try:
        proc.wait_ready()
        fill(proc)
        time.sleep(1.0)  # the sidecar's disk writer commits the demoted chunks
        rocksdb = data / "rocksdb"
        assert lock_holders(str(rocksdb / "LOCK")) == [proc.proc.pid]
        before = folder_state(data)
        r = export(data, tmp_path / "hot.snap")
        after = folder_state(data)
        assert r.returncode == 0 and "exported" in r.stdout, r.stdout + r.stderr
        assert verified_chunks(tmp_path / "hot.snap") > 0
        assert changed(before, after) == [], "export changed the running sidecar's data dir"
        assert lock_holders(str(rocksdb / "LOCK")) == [proc.proc.pid], "the sidecar lost its lock"
        fill(proc, 20)  # it keeps serving and spilling
        proc.proc.send_signal(signal.SIGTERM)
        out, _ = proc.proc.communicate(timeout=60)
    finally:
        proc.stop()
    assert proc.proc.returncode == 0 and "disk tier closed" in out and "Traceback" not in out, out


def test_an_export_of_a_folder_that_holds_no_disk_tier_names_it_and_creates_nothing(tmp_path):
    data = tmp_path / "data"
    (data / "rocksdb").mkdir(parents=True)
    r = export(data, tmp_path / "hot.snap")
    assert r.returncode == 2 and f"disk tier {data / 'rocksdb'}: no RocksDB database there" in r.stdout, r.stdout
    assert os.listdir(data / "rocksdb") == [] and not (tmp_path / "hot.snap").exists()
