"""SIGTERM while `promptcache serve` starts (Kubernetes deletes or replaces pods at any moment). It used to kill the
process with status 143 (no handler before it served), leaving its gRPC socket file behind once bound. Now start-up
records the signal from the first moment and stops at its next step: exit 0, what it had opened closed (the disk
tier closed cleanly, its socket files removed), nothing of the data folder changed. Each case sends the signal at a
point of start-up it can see (not by timing): the handler installed (torch still importing), waiting for the disk
tier's lock, warm-up filling memory."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from support import CHUNK, free_port
from promptcache.sidecar import disk as D


class Serve:
    """`promptcache serve` as a process on unix sockets in `folder`, its output read line by line as it comes."""

    def __init__(self, folder, *args: str):
        self.grpc_socket, self.bulk_socket = folder / "grpc.sock", folder / "bulk.sock"
        self.metrics_port = free_port()
        cmd = [sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", f"unix:{self.grpc_socket}",
               "--bulk-address", f"unix:{self.bulk_socket}", "--metrics-port", str(self.metrics_port),
               "--log-format", "text", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self.lines.append("")  # end of output
            self._new.notify_all()

    def wait_for_line(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self._new:
            while not any(text in line for line in self.lines):
                assert "" not in self.lines, f"exited before {text!r}:\n{self.output}"
                assert self._new.wait(deadline - time.monotonic()), f"no {text!r} in {timeout} s:\n{self.output}"

    def wait_for_handler(self, timeout: float = 60) -> None:
        """Until the process catches SIGTERM (/proc/PID/status, SigCgt): its handler is installed."""
        deadline = time.monotonic() + timeout
        while True:
            with open(f"/proc/{self.proc.pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
            if caught & (1 << (signal.SIGTERM - 1)):
                return
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output
            time.sleep(0.002)

    def sigterm(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            with self._new:  # the rest of its output
                self._new.wait_for(lambda: "" in self.lines, 10)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _no_sockets_left(s: Serve) -> None:
    assert not s.grpc_socket.exists() and not s.bulk_socket.exists(), os.listdir(s.grpc_socket.parent)


def _torch_loading(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.slow  # a sidecar process
@pytest.mark.parametrize("point", ["handler installed", "torch loading"])
def test_sigterm_before_anything_is_opened_exits_0(tmp_path, point):
    """At the first moment `serve` can catch it (its handler is the first thing it installs), and while torch is
    loading (its libraries mapped: the import goes on for seconds after)."""
    s = Serve(tmp_path, "--disk-bytes", "16Mi", "--data-dir", str(tmp_path / "data"))
    try:
        s.wait_for_handler()
        if point == "torch loading":
            deadline = time.monotonic() + 60
            while not _torch_loading(s.proc.pid):
                assert s.proc.poll() is None and time.monotonic() < deadline, s.output
                time.sleep(0.002)
        code = s.sigterm()
    finally:
        s.kill()
    assert code == 0, (code, s.output)
    assert "serving" not in s.output.replace("shutting down before serving", "") and "Traceback" not in s.output, \
        s.output
    assert "SIGTERM before start-up; exiting" in s.output or \
        "shutting down before serving: SIGTERM during start-up" in s.output, s.output
    _no_sockets_left(s)
    assert not (tmp_path / "data").exists()  # the disk tier was never opened


@pytest.mark.slow  # a sidecar process
def test_sigterm_while_waiting_for_the_disk_tiers_lock_exits_0_and_leaves_the_folder_to_its_holder(tmp_path):
    """The gRPC address is bound before the disk tier opens; the lock is held by another DiskTier (a rolling
    update's old pod), which this one waits for (--disk-lock-wait-seconds 60) when the SIGTERM comes."""
    rocksdb = tmp_path / "data" / "rocksdb"
    with D.DiskTier(str(rocksdb), 16 << 20, min_free_bytes=0) as holder:
        assert holder.put(b"k" * 32, b"precious" * 1000) and holder.flush()
        s = Serve(tmp_path, "--disk-bytes", "16Mi", "--data-dir", str(tmp_path / "data"),
                  "--disk-lock-wait-seconds", "60", "--disk-min-free-bytes", "0")
        try:
            s.wait_for_line("is locked by another process")
            assert s.grpc_socket.exists()  # (bound already)
            t = time.monotonic()
            code = s.sigterm()
            took = time.monotonic() - t
        finally:
            s.kill()
        assert code == 0, (code, s.output)
        assert took < 10, f"{took:.1f} s to stop: it waited for the lock instead"
        assert "shutting down before serving: SIGTERM during start-up (while opening the disk tier " \
            f"{rocksdb})" in s.output, s.output
        assert "Traceback" not in s.output and "promptcache sidecar serving" not in s.output, s.output
        _no_sockets_left(s)
        # The holder keeps its folder: its lock, its records, and it goes on writing.
        assert D.lock_holders(str(rocksdb / "LOCK")) == [os.getpid()]
        assert holder.get(b"k" * 32) == b"precious" * 1000
        assert holder.put(b"j" * 32, b"more" * 1000) and holder.flush() and not holder.disk_full


def test_a_cancelled_start_closes_the_disk_tier_it_had_opened(tmp_path):
    """In process: the signal recorded while the disk tier was being opened (at its last step: the index
    rebuilt). Start-up raises StartupCancelled, the disk tier is closed (its lock free again), the gRPC socket
    file removed."""
    from promptcache.sidecar import app
    from promptcache.sidecar.config import Settings

    data = tmp_path / "data"
    with D.DiskTier(str(data / "rocksdb"), 16 << 20, min_free_bytes=0) as d:
        assert d.put(b"k" * 32, b"v" * 5000) and d.flush()
    signals = app.StartupSignals()
    real_rebuild = D.DiskTier._rebuild_index

    def rebuild_then_signal(self):
        real_rebuild(self)
        signals._handle(signal.SIGTERM, None)  # what the installed handler does

    settings = dataclasses.replace(Settings(grpc_address=f"unix:{tmp_path / 'grpc.sock'}", metrics_port=0,
                                            chunk_tokens=CHUNK, memory_bytes=8 << 20), disk_bytes=16 << 20,
                                   data_dir=str(data), disk_min_free_bytes=0)
    D.DiskTier._rebuild_index = rebuild_then_signal
    try:
        with pytest.raises((app.StartupCancelled, D.DiskTierCancelled),
                           match="SIGTERM during start-up|while opening the disk tier"):
            app.Sidecar(settings, signals)
    finally:
        D.DiskTier._rebuild_index = real_rebuild
    assert not (tmp_path / "grpc.sock").exists()
    with D.DiskTier(str(data / "rocksdb"), 16 << 20, min_free_bytes=0, lock_wait_seconds=0) as d:
        assert d.get(b"k" * 32) == b"v" * 5000  # closed: the lock is free, the record there


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


@pytest.mark.slow  # a sidecar process warming up from a disk tier of 20,000 chunks
def test_sigterm_during_warm_up_exits_0_and_the_disk_tier_keeps_every_chunk(tmp_path):
    import numpy as np
    import torch

    from promptcache.sidecar.store import Entry
    from promptcache.sidecar.tiers.disk import encode_meta

    n, size = 20_000, 1024
    rocksdb = tmp_path / "data" / "rocksdb"
    with D.DiskTier(str(rocksdb), 256 << 20, min_free_bytes=0) as d:
        parent = bytes(32)
        for i in range(n):
            payload = np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8).tobytes()
            key = i.to_bytes(4, "little") * 8
            e = Entry(key, b"f" * 32, parent, i % 64, torch.frombuffer(bytearray(payload), dtype=torch.uint8),
                      D.xxhash.xxh3_64_intdigest(payload), (size // 4,), 0, 0.0, 0.0, size)
            while not d.put(key, payload, meta=encode_meta(e), parent=parent, hits=n - i, last_access=time.time()):
                d.flush()
            parent = key if i % 64 != 63 else bytes(32)
        assert d.flush(60)
    s = Serve(tmp_path, "--memory-bytes", str(2 * n * size), "--disk-bytes", "256Mi", "--data-dir",
              str(tmp_path / "data"), "--chunk-tokens", str(CHUNK), "--warmup-seconds", "120",
              "--disk-min-free-bytes", "0")
    try:
        s.wait_for_line("disk tier open")
        deadline = time.monotonic() + 60
        while True:
            try:
                if _metric(s.metrics_port, "promptcache_warmup_in_progress") == 1 and \
                        _metric(s.metrics_port, 'promptcache_warmup_chunks_total{source="disk"}') > 0:
                    break
            except OSError:
                pass  # the metrics endpoint is not up yet
            assert s.proc.poll() is None and time.monotonic() < deadline, s.output
            time.sleep(0.01)
        code = s.sigterm()
    finally:
        s.kill()
    assert code == 0, (code, s.output)
    assert "disk tier closed" in s.output and "Traceback" not in s.output, s.output
    assert "ready" not in s.output.split("shutting down")[0], "warm-up was over before the SIGTERM"
    _no_sockets_left(s)
    with D.DiskTier(str(rocksdb), 256 << 20, min_free_bytes=0, lock_wait_seconds=0) as d:
        assert len(d) == n  # what warm-up had moved into memory was demoted back at the stop


def test_a_start_cancelled_after_the_grpc_server_started_closes_everything(tmp_path):
    """In process: the signal recorded just after the gRPC server started (while the bulk channel opens). Start-up
    raises StartupCancelled having closed what _abandon closes for any start that did not finish: the disk tier
    (its lock free), the observer's thread, both socket files."""
    from promptcache.sidecar import app
    from promptcache.sidecar.config import Settings

    data = tmp_path / "data"
    settings = dataclasses.replace(Settings(grpc_address=f"unix:{tmp_path / 'grpc.sock'}", metrics_port=0,
                                            chunk_tokens=CHUNK, memory_bytes=8 << 20), disk_bytes=16 << 20,
                                   data_dir=str(data), disk_min_free_bytes=0,
                                   bulk_address=f"unix:{tmp_path / 'bulk.sock'}")
    signals = app.StartupSignals()
    sidecar = app.Sidecar(settings, signals)
    closed = []
    real_start, real_stop = sidecar.server.start, sidecar.observer.stop
    sidecar.server.start = lambda: (real_start(), signals._handle(signal.SIGTERM, None))
    sidecar.observer.stop = lambda: (closed.append("observer"), real_stop())
    with pytest.raises(app.StartupCancelled, match="while opening the bulk channel"):
        sidecar.start()
    assert closed == ["observer"]
    assert not (tmp_path / "grpc.sock").exists() and not (tmp_path / "bulk.sock").exists()
    with D.DiskTier(str(data / "rocksdb"), 16 << 20, min_free_bytes=0, lock_wait_seconds=0) as d:
        assert len(d) == 0  # closed: the lock is free
