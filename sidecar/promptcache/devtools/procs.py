"""Helpers for a `promptcache serve` child process (and the redis-server the benchmarks compare against),
shared by the benchmarks, the fuzzer and the tests."""
from __future__ import annotations

import socket
import subprocess
import time
from typing import Callable


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Return once check() is truthy; exceptions count as "not yet". TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not come up within {timeout:g} s")


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float = 30.0,
                 describe: Callable[[], str] = lambda: "", **client_kwargs) -> None:
    """Return once the sidecar at `address` answers its gRPC health check; raise if it exits or times out.
    client_kwargs reach PromptCacheClient (tls_ca= for a sidecar serving TLS)."""
    from promptcache.client import PromptCacheClient

    deadline = time.monotonic() + timeout
    with PromptCacheClient(address, timeout=1, **client_kwargs) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {proc.returncode}{describe()}")
            if client.healthy(timeout=0.5):
                return
            time.sleep(0.1)
    raise TimeoutError(f"sidecar at {address} not healthy after {timeout}s{describe()}")


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; a process already gone is left as it is."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
