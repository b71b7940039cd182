"""Helpers for a `promptcache serve` child process, shared by the benchmarks, the fuzzer and the tests."""
from __future__ import annotations

import subprocess
import time
from typing import Callable


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float = 30.0,
                 describe: Callable[[], str] = lambda: "") -> None:
    """Return once the sidecar at `address` answers its gRPC health check; raise if it exits or times out."""
    from promptcache.client import PromptCacheClient

    deadline = time.monotonic() + timeout
    with PromptCacheClient(address, timeout=1) as client:
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
