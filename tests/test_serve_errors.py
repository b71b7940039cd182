"""`promptcache serve` as a real process when something outside it is wrong (issue 17, item 9): a port in use,
unusable TLS files, a disk tier that fails under it. Each gets one line naming the flag or file, no traceback,
and an exit code: 2 when it cannot start, 1 when it stopped but could not close the disk tier cleanly."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from support import SMALL, SidecarProcess, free_port, make_kv
from promptcache.client import PromptCacheClient


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", "--log-format", "text", *args],
                          capture_output=True, text=True, timeout=timeout)


def output(result) -> str:
    return result.stdout + result.stderr


@pytest.fixture
def busy_port():
    """A TCP port on loopback that another process holds (listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# Each case starts a sidecar process (seconds each here): make test-fast keeps a port and a TLS case.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("which", ["grpc", pytest.param("metrics", marks=SLOW), pytest.param("bulk", marks=SLOW)])
def test_a_port_in_use_is_named_and_exits_2(busy_port, which, tmp_path):
    grpc_port = busy_port if which == "grpc" else free_port()
    metrics_port = busy_port if which == "metrics" else 0
    args = ["--grpc-address", f"127.0.0.1:{grpc_port}", "--metrics-port", str(metrics_port),
            "--disk-bytes", "16Mi", "--data-dir", str(tmp_path / "data")]
    if which == "bulk":
        args += ["--bulk-address", f"127.0.0.1:{busy_port}"]
    result = serve(*args)
    text = output(result)
    assert result.returncode == 2, text
    assert "Traceback" not in text
    expected = {"grpc": f"cannot start: cannot listen on --grpc-address 127.0.0.1:{busy_port}: the port is in use",
                "metrics": f"cannot start: cannot listen on --metrics-host 127.0.0.1 --metrics-port {busy_port}: "
                           "Address already in use",
                "bulk": "cannot start: cannot listen on --bulk-address"}[which]
    assert expected in text, text
    # Nothing was left half-open: the same ports serve at once.
    if which != "grpc":
        with socket.socket() as s:
            s.bind(("127.0.0.1", grpc_port))


@pytest.mark.slow
def test_a_unix_socket_in_a_missing_folder_is_named(tmp_path):
    result = serve("--grpc-address", f"unix:{tmp_path}/missing/s.sock", "--metrics-port", "0")
    assert result.returncode == 2 and "Traceback" not in output(result)
    assert f"cannot listen on --grpc-address unix:{tmp_path}/missing/s.sock: the socket is in use, or its folder " \
           "is missing" in output(result)


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    from test_auth_pki import CA

    d = tmp_path_factory.mktemp("pem")
    ca = CA.create("test-ca")
    cert, key = ca.issue("localhost", server=True)
    _, other_key = ca.issue("other", server=True)
    files = {"cert": cert, "key": key, "other_key": other_key, "ca": ca.pem, "garbage": b"not a PEM file\n",
             "empty": b""}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return lambda name: str(d / f"{name}.pem")


@pytest.mark.parametrize("cert,key,ca,message", [
    pytest.param("garbage", "key", None, "--tls-cert-file {garbage} holds no PEM certificate", marks=SLOW),
    pytest.param("empty", "key", None, "--tls-cert-file {empty} holds no PEM certificate", marks=SLOW),
    pytest.param("key", "key", None, "--tls-cert-file {key} holds no PEM certificate", marks=SLOW),
    pytest.param("cert", "garbage", None, "--tls-key-file {garbage} holds no unencrypted PEM private key", marks=SLOW),
    pytest.param("cert", "cert", None, "--tls-key-file {cert} holds no unencrypted PEM private key", marks=SLOW),
    ("cert", "other_key", None, "--tls-key-file {other_key} is not the private key of --tls-cert-file {cert}"),
    pytest.param("cert", "key", "garbage", "--tls-client-ca-file {garbage} holds no PEM certificate", marks=SLOW),
])
def test_unusable_tls_files_are_named_and_exit_2(pem, cert, key, ca, message):
    args = ["--grpc-address", f"127.0.0.1:{free_port()}", "--metrics-port", "0", "--tls-cert-file", pem(cert),
            "--tls-key-file", pem(key)]
    if ca:
        args += ["--tls-client-ca-file", pem(ca)]
    result = serve(*args)
    text = output(result)
    assert result.returncode == 2, text
    assert "Traceback" not in text and "bind" not in text.lower()  # the port is not what is wrong
    names = {n: pem(n) for n in ("garbage", "empty", "key", "cert", "other_key")}
    assert "cannot start: " + message.format(**names) in text, text


@pytest.mark.parametrize("flags,kind,message", [
    (["--tenant-secret-file", "{f}"], "/dev/zero", "--tenant-secret-file {f}: not a regular file"),
    (["--tenant-secret-file", "{f}"], "fifo", "--tenant-secret-file {f}: not a regular file"),
    pytest.param(["--tls-cert-file", "{f}", "--tls-key-file", "{f}"], "/dev/zero",
                 "--tls-cert-file {f}: not a regular file", marks=SLOW),
    (["--tls-cert-file", "{f}", "--tls-key-file", "{f}"], "fifo", "--tls-cert-file {f}: not a regular file"),
    (["--pinned-prefixes-file", "{f}"], "fifo", "--pinned-prefixes-file {f}: not a regular file"),
    pytest.param(["--warmup-snapshot", "{f}"], "/dev/zero", "--warmup-snapshot {f}: not a regular file", marks=SLOW),
    pytest.param(["--pinned-prefixes-file", "{f}"], "folder", "--pinned-prefixes-file {f}: a directory", marks=SLOW),
])
def test_files_that_never_end_or_block_are_refused_naming_the_flag(tmp_path, flags, kind, message):
    """A FIFO blocks its reader until someone writes; /dev/zero never ends (the whole of it was read into memory for
    the tenant secret and the TLS files): each is refused at start, exit 2."""
    f = {"/dev/zero": "/dev/zero", "fifo": str(tmp_path / "fifo"), "folder": str(tmp_path)}[kind]
    if kind == "fifo":
        os.mkfifo(f)
    result = serve("--grpc-address", "127.0.0.1:0", "--metrics-port", "0", *[a.format(f=f) for a in flags],
                   timeout=60)
    assert result.returncode == 2 and message.format(f=f) in output(result), output(result)[-2000:]


@pytest.mark.slow  # a TLS sidecar process; test_auth.py serves TLS in process in the fast lane
def test_good_tls_files_still_serve(pem):
    proc = SidecarProcess("--tls-cert-file", pem("cert"), "--tls-key-file", pem("key"))
    try:
        with PromptCacheClient(proc.address, tls_ca=pem("ca")) as c:
            deadline = time.monotonic() + 30
            while not c.healthy(timeout=0.5):
                assert proc.proc.poll() is None and time.monotonic() < deadline, proc.proc.stdout.read()
                time.sleep(0.1)
    finally:
        proc.stop()


def fill_disk_tier(proc: SidecarProcess, prompts: int = 16) -> None:
    """Puts that overflow the 512 KiB memory tier, so chunks are demoted to the disk tier. Each prompt twice: a full
    memory tier admits a new prompt on its second Put (the default policy's chain-root doorkeeper)."""
    with PromptCacheClient(proc.address, timeout=20) as c:
        for p in range(prompts):
            for _ in range(2):
                c.put(SMALL, [p * 100_000 + t for t in range(256)], make_kv(SMALL, 256, seed=p))


def stop_with_sigterm(proc: SidecarProcess) -> tuple[int, str]:
    proc.proc.send_signal(signal.SIGTERM)
    out, _ = proc.proc.communicate(timeout=60)
    return proc.proc.returncode, out


def disk_sidecar(data_dir) -> SidecarProcess:
    return SidecarProcess("--memory-bytes", "512Ki", "--chunk-tokens", "256", "--disk-bytes", "64Mi",
                          "--disk-min-free-bytes", "0", "--data-dir", str(data_dir), "--log-format", "text")


@pytest.mark.slow
def test_sigterm_after_the_data_dir_was_removed_says_so_and_exits_1(tmp_path):
    proc = disk_sidecar(tmp_path / "data")
    try:
        proc.wait_ready()
        fill_disk_tier(proc)
        shutil.rmtree(tmp_path / "data")
        fill_disk_tier(proc)
        code, out = stop_with_sigterm(proc)
    finally:
        proc.stop()
    assert "Traceback" not in out and "Exception in thread" not in out, out
    assert f"cannot close the disk tier {tmp_path / 'data' / 'rocksdb'} (--data-dir)" in out, out
    assert code == 1


@pytest.mark.slow
def test_sigterm_with_a_healthy_disk_tier_exits_0(tmp_path):
    proc = disk_sidecar(tmp_path / "data")
    try:
        proc.wait_ready()
        fill_disk_tier(proc)
        code, out = stop_with_sigterm(proc)
    finally:
        proc.stop()
    assert code == 0 and "disk tier closed" in out and "Traceback" not in out, out


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small-fs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"cannot mount an 8 MiB tmpfs (the test needs root, as in CI): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_sigterm_after_another_writer_fills_the_volume_closes_cleanly(small_fs):
    """Another writer takes the last byte of the volume under RocksDB. The disk tier's reserve (docs/disk-tier.md,
    "Full volumes") is what RocksDB gets to flush and close with, so SIGTERM still closes the tier and exits 0
    (before that reserve, closing failed and the sidecar exited 1, the crash loop of issue 27 item 1)."""
    proc = disk_sidecar(small_fs)
    try:
        proc.wait_ready()
        fill_disk_tier(proc)
        with open(small_fs / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        fill_disk_tier(proc)
        code, out = stop_with_sigterm(proc)
    finally:
        proc.stop()
        os.unlink(small_fs / "filler") if (small_fs / "filler").exists() else None
    assert "Traceback" not in out and "Exception in thread" not in out, out
    assert "disk tier closed" in out and "cannot close the disk tier" not in out, out
    assert code == 0, out


@SLOW
def test_a_socket_path_holding_a_file_or_another_sidecars_socket_is_not_taken(tmp_path):
    """--bulk-address unix:PATH over a regular file replaced it (the file was deleted); a second sidecar on the
    first's --grpc-address unix:PATH took its socket (gRPC's core unlinks it and binds anew) and the first served
    nobody. Both are refused now, naming the flag, and the file and the first sidecar are untouched."""
    precious = tmp_path / "precious.txt"
    precious.write_text("precious")
    result = serve("--grpc-address", f"127.0.0.1:{free_port()}", "--metrics-port", "0",
                   "--bulk-address", f"unix:{precious}")
    assert result.returncode == 2 and "--bulk-address" in output(result), output(result)
    assert "exists and is not a socket" in output(result) and precious.read_text() == "precious"
    sock = tmp_path / "g.sock"
    first = subprocess.Popen([sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", f"unix:{sock}",
                              "--metrics-port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = PromptCacheClient(f"unix://{sock}", timeout=5, retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.stats()
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert first.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        inode = os.lstat(sock).st_ino
        second = serve("--grpc-address", f"unix:{sock}", "--metrics-port", "0")
        assert second.returncode == 2 and "--grpc-address" in output(second), output(second)
        assert "the socket is in use" in output(second)
        assert os.lstat(sock).st_ino == inode and client.stats().chunk_tokens > 0
    finally:
        first.terminate()
        first.wait(30)
