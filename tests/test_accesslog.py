"""The opt-in access log (--access-log-path): a real sidecar's traffic written as a trace that
`promptcache bench replay --trace` replays, with no token or chunk key in it, in bounded disk space."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from promptcache.client import PromptCacheClient
from promptcache.contract import keys as keyspec
from promptcache.contract.keys import ModelSpec
from promptcache.sidecar.accesslog import AccessLog, log_sampled
from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.trace import simulate_policy
from promptcache_devtools.bench import traces
from promptcache_devtools.bench.replay import prepare

CHUNK_TOKENS = 16
SPEC = ModelSpec("test/accesslog", "rev-1", "float16", num_layers=1, num_kv_heads=1, head_dim=8)


def tokens_of(req) -> list[int]:
    return [h * CHUNK_TOKENS + j for h in req.hash_ids for j in range(CHUNK_TOKENS)]


def drive(sidecar, reqs) -> None:
    """One read per request (Lookup or Get, alternately), and a Put of the first chunk now and then."""
    blob = bytes(512)
    with PromptCacheClient(sidecar.address, timeout=10) as c:
        for n, r in enumerate(reqs):
            if n % 2:
                c.get_blobs(SPEC, tokens_of(r))
            else:
                c.lookup(SPEC, tokens_of(r))
            if n % 5 == 0:
                c.put_blobs(SPEC, tokens_of(r), {0: blob})


def log_settings(path, **kw):
    return dict(chunk_tokens=CHUNK_TOKENS, access_log_path=str(path), mrc_sample_rate=0, **kw)


def test_the_log_replays_like_the_traffic_it_recorded(sidecar_factory, tmp_path):
    reqs = traces.generate("chat", seed=3, scale=0.05)
    path = tmp_path / "access.jsonl"
    sidecar = sidecar_factory(**log_settings(path))
    drive(sidecar, reqs)
    sidecar.stop(0)   # flushes what is queued
    logged = traces.read_trace(str(path))
    assert len(logged) == len(reqs)
    ids: dict[int, int] = {}
    back: dict[int, int] = {}
    for r, g in zip(reqs, logged):
        assert g.input_length == len(r.hash_ids) * CHUNK_TOKENS and g.block_tokens == CHUNK_TOKENS
        assert len(g.hash_ids) == len(r.hash_ids)
        for a, b in zip(r.hash_ids, g.hash_ids):   # the same prefix structure under other names
            assert ids.setdefault(a, b) == b and back.setdefault(b, a) == a
    assert logged[0].timestamp <= logged[-1].timestamp and logged[0].timestamp > 1.7e12   # ms since the epoch
    # The replayer sees the same hits in the log as in the original traffic (16-token chunks: block_tokens).
    original = [traces.Request(r.timestamp, len(r.hash_ids) * CHUNK_TOKENS, 0, r.hash_ids, CHUNK_TOKENS)
                for r in reqs]
    for f in (0.05, 0.25):
        a, ws_a = prepare(original)
        b, ws_b = prepare(logged)
        assert ws_a == ws_b
        ra = simulate_policy(a, make_policy("lru", capacity=int(ws_a * f)), int(ws_a * f))
        rb = simulate_policy(b, make_policy("lru", capacity=int(ws_b * f)), int(ws_b * f))
        assert (ra["hit"], ra["total"]) == (rb["hit"], rb["total"]) and ra["hit"] > 0
    out = subprocess.run([sys.executable, "-m", "promptcache.cli", "bench", "replay", "--trace", str(path),
                          "--policy", "lru", "--no-opt", "--jobs", "1", "--capacity-fraction", "0.25"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "25%" in line)
    assert f"{ra['hit'] / ra['total']:.3f}" in row, (row, ra)


def test_no_token_and_no_chunk_key_is_in_the_file(sidecar_factory, tmp_path):
    reqs = traces.generate("rag", seed=1, scale=0.03)
    path = tmp_path / "access.jsonl"
    sidecar = sidecar_factory(**log_settings(path))
    drive(sidecar, reqs)
    sidecar.stop(0)
    data = path.read_bytes()
    assert data.count(b"\n") == len(reqs)
    fp = keyspec.fingerprint(SPEC)
    needles = set()
    for r in reqs:
        toks = tokens_of(r)
        for k in keyspec.chunk_keys(fp, toks, CHUNK_TOKENS):
            needles |= {k, k.hex().encode(), k.hex().upper().encode(), k[:8].hex().encode(),
                        str(int.from_bytes(k[:8], "big")).encode(), str(int.from_bytes(k[:8], "little")).encode(),
                        str(int.from_bytes(k[:8], "big") >> 1).encode()}
        for i in range(0, len(toks), CHUNK_TOKENS):   # token runs as JSON would write them
            needles.add(",".join(map(str, toks[i:i + 4])).encode())
            needles.add(", ".join(map(str, toks[i:i + 4])).encode())
    found = [n for n in needles if n in data]
    assert not found, found[:3]
    # ...and a second start hashes the same keys to other ids (the secret is per start).
    a, b = AccessLog(str(tmp_path / "a"), 1 << 20, 1), AccessLog(str(tmp_path / "b"), 1 << 20, 1)
    key = keyspec.chunk_keys(fp, tokens_of(reqs[0]), CHUNK_TOKENS)[0]
    assert a.hash_id(key) != b.hash_id(key) and a.hash_id(key) == a.hash_id(key) >= 0
    a.close(), b.close()


def test_disk_use_stays_bounded_across_rotation(sidecar_factory, tmp_path):
    reqs = traces.generate("agent", seed=2, scale=0.06)
    path = tmp_path / "logs" / "access.jsonl"
    sidecar = sidecar_factory(**log_settings(path, access_log_max_bytes=4096, access_log_files=3))
    drive(sidecar, reqs)
    rotations = sidecar.observer.access_log.rotations
    sidecar.stop(0)
    files = sorted(os.listdir(path.parent))
    assert files == ["access.jsonl", "access.jsonl.1", "access.jsonl.2"], files
    sizes = [os.path.getsize(path.parent / f) for f in files]
    assert max(sizes) <= 4096 and sum(sizes) <= 3 * 4096, sizes
    written = sum(len(r.hash_ids) for r in reqs) * 20   # at least this many bytes went through the log
    assert written > 4 * 4096 and rotations >= 4
    # The newest records survive, in order, across the files: oldest file first ends with the last request.
    kept = []
    for f in reversed(files):
        kept += traces.read_trace(str(path.parent / f))
    assert [r.input_length for r in kept] == [len(r.hash_ids) * CHUNK_TOKENS for r in reqs[-len(kept):]]


def test_sampling_logs_whole_chains(sidecar_factory, tmp_path):
    reqs = traces.generate("scan", seed=4, scale=0.05)
    path = tmp_path / "access.jsonl"
    sidecar = sidecar_factory(**log_settings(path, access_log_sample_rate=0.5))
    drive(sidecar, reqs)
    sidecar.stop(0)
    fp = keyspec.fingerprint(SPEC)
    chosen = [r for r in reqs if log_sampled(keyspec.chunk_keys(fp, tokens_of(r), CHUNK_TOKENS, limit=1)[0], 0.5)]
    logged = traces.read_trace(str(path))
    assert 0 < len(chosen) < len(reqs)
    assert [r.input_length for r in logged] == [len(r.hash_ids) * CHUNK_TOKENS for r in chosen]


def _refused_at_start(path, *, timeout: float = 60) -> str:
    """A real `promptcache serve` with --access-log-path `path`: it must exit 2 (never hang) with one line naming
    the flag and the path, and no traceback."""
    from support import SidecarProcess

    proc = SidecarProcess("--access-log-path", str(path), "--log-format", "text")
    try:
        out, _ = proc.proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.proc.kill()
        proc.proc.communicate()
        raise AssertionError(f"start-up hung with --access-log-path {path}") from None
    assert proc.proc.returncode == 2, out[-2000:]
    assert "Traceback" not in out and f"--access-log-path {path}" in out, out[-2000:]
    return out


def test_the_log_file_is_opened_safely_and_refusals_name_the_flag(tmp_path):
    """Issue 27 #4: a symlink was followed, a FIFO without a reader hung start-up in open(), a FIFO with a reader,
    /proc/self/status or a folder failed without naming the flag, and the file was created 0644."""
    target = tmp_path / "victim"
    target.write_text("precious\n")
    link = tmp_path / "link.jsonl"
    os.symlink(target, link)
    assert "symbolic link" in _refused_at_start(link)
    assert target.read_text() == "precious\n"
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    assert "FIFO" in _refused_at_start(fifo)  # no reader: O_NONBLOCK, no hang
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert "FIFO" in _refused_at_start(fifo)
    finally:
        os.close(reader)
    _refused_at_start(tmp_path)
    _refused_at_start("/proc/self/status")
    # A new file is created 0600, and an existing access log of ours is made 0600.
    fresh = AccessLog(str(tmp_path / "new" / "a.jsonl"), 4096, 2)
    fresh.record([b"k" * 32], 16, CHUNK_TOKENS, 1)
    fresh.close()
    assert oct(os.stat(tmp_path / "new" / "a.jsonl").st_mode & 0o777) == "0o600"
    os.chmod(tmp_path / "new" / "a.jsonl", 0o644)
    AccessLog(str(tmp_path / "new" / "a.jsonl"), 4096, 2).close()
    assert oct(os.stat(tmp_path / "new" / "a.jsonl").st_mode & 0o777) == "0o600"
    # An existing empty file open to others is not the sidecar's to chmod: refused, its mode kept.
    loose = tmp_path / "loose.jsonl"
    loose.write_text("")
    os.chmod(loose, 0o644)
    with pytest.raises(ValueError, match=r"--access-log-path .*loose.jsonl is an existing empty file open to others"):
        AccessLog(str(loose), 4096, 2)
    assert oct(os.stat(loose).st_mode & 0o777) == "0o644"
    os.chmod(loose, 0o600)
    AccessLog(str(loose), 4096, 2).close()


def test_an_existing_file_that_is_not_an_access_log_is_never_written_chmoded_or_deleted(tmp_path):
    """Audit: --access-log-path naming an operator's notes (or a disk tier's table file) appended the log to it,
    chmod'ed it 0600 and, at rotation with --access-log-files 1, deleted it. Now such a file is refused at start
    naming the flag, untouched; so is a FILE.1 rotation would overwrite; and rotation never deletes or renames a
    FILE that is no longer the one being written."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious operator notes\n" * 10)
    os.chmod(notes, 0o644)
    for files in (1, 2):
        with pytest.raises(ValueError, match=r"--access-log-path .*notes.txt is an existing file that is not an "
                                             r"access log"):
            AccessLog(str(notes), 4096, files)
    assert notes.read_text() == "precious operator notes\n" * 10
    assert oct(os.stat(notes).st_mode & 0o777) == "0o644"
    binary = tmp_path / "000009.sst"
    binary.write_bytes(os.urandom(5000))
    with pytest.raises(ValueError, match="not an access log"):
        AccessLog(str(binary), 4096, 2)
    # a line that merely starts like ours, or a JSON object with other fields, is not ours either
    for text in ('{"timestamp":1,"input_length":2,"output_length":0,"hash_ids":[1]} trailing\n',
                 '{"timestamp": 1, "input_length": 2, "hash_ids": [1]}\n'):
        other = tmp_path / "other.jsonl"
        other.write_text(text)
        with pytest.raises(ValueError, match="not an access log"):
            AccessLog(str(other), 4096, 2)
    # FILE.1 that is not a log: rotation would overwrite it, so the start is refused
    log_path = tmp_path / "access.jsonl"
    (tmp_path / "access.jsonl.1").write_text("keep me\n")
    with pytest.raises(ValueError, match=r"access.jsonl.1 \(a file rotation would overwrite\) is not an access log"):
        AccessLog(str(log_path), 4096, 3)
    assert (tmp_path / "access.jsonl.1").read_text() == "keep me\n"
    assert not log_path.exists() or log_path.stat().st_size == 0
    os.remove(tmp_path / "access.jsonl.1")
    # our own log is appended to across starts, and rotates as before
    log = AccessLog(str(log_path), 400, 2)
    for i in range(20):
        log.record([bytes([i]) * 32], 16, CHUNK_TOKENS, i)
    log.close()
    assert log.rotations >= 2 and log.dropped == 0
    again = AccessLog(str(log_path), 400, 2)
    again.record([b"z" * 32], 16, CHUNK_TOKENS, 99)
    again.close()
    assert len(traces.read_trace(str(log_path))) >= 1 and len(traces.read_trace(str(log_path) + ".1")) >= 1
    # FILE replaced behind the sidecar's back (--access-log-files 1): not deleted at rotation; lines dropped
    single = tmp_path / "single.jsonl"
    log = AccessLog(str(single), 400, 1)
    log.record([b"a" * 32], 16, CHUNK_TOKENS, 1)
    os.remove(single)
    single.write_text("precious, put here after the start\n")
    for i in range(20):
        log.record([bytes([i]) * 32], 16, CHUNK_TOKENS, i)
    log.close()
    assert single.read_text() == "precious, put here after the start\n"
    assert log.dropped > 0 and log.write_errors >= 1


def test_the_sidecar_refuses_an_access_log_path_that_is_a_file_of_its_disk_tier(tmp_path):
    """Audit: --access-log-path naming one of the disk tier's RocksDB table files appended the log to it."""
    sst = tmp_path / "000009.sst"
    sst.write_bytes(b"\x00" * 64 + os.urandom(4000))
    before = sst.read_bytes()
    out = _refused_at_start(sst)
    assert "not an access log" in out, out[-2000:]
    assert sst.read_bytes() == before


def test_the_log_comes_back_when_its_folder_reappears(sidecar_factory, tmp_path, caplog):
    """Issue 27 #4: removing the log's folder while running made rotation raise tracebacks and the log stopped
    for good. Now lines are dropped (one log line says why, no traceback), and it writes again, 0600, once the
    folder is back."""
    import shutil
    import time

    folder = tmp_path / "logs"
    path = folder / "access.jsonl"
    sidecar = sidecar_factory(**log_settings(path, access_log_max_bytes=4096, access_log_files=2))
    reqs = traces.generate("chat", seed=5, scale=0.05)
    assert len(reqs) >= 44
    drive(sidecar, reqs[:10])
    sidecar.observer.wait_idle()
    assert path.exists()
    shutil.rmtree(folder)
    drive(sidecar, reqs[10:40])  # rotations due while the folder is gone
    sidecar.observer.wait_idle()
    assert not folder.exists()  # not recreated behind the operator's back
    folder.mkdir()
    deadline = time.monotonic() + 20
    while not (path.exists() and path.stat().st_size > 0):
        assert time.monotonic() < deadline, "the access log never came back after its folder reappeared"
        drive(sidecar, reqs[40:44])
        sidecar.observer.wait_idle()
        time.sleep(0.2)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert sidecar.observer.failures == 0
    assert "Traceback" not in caplog.text
    assert all(r.exc_info is None for r in caplog.records)
    assert any("access log stopped" in r.getMessage() for r in caplog.records)
