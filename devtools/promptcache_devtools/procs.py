"""Helpers for a `promptcache serve` child process (and the redis-server the benchmarks compare against),
shared by the benchmarks, the fuzzer and the tests."""
from __future__ import annotations

import socket
import subprocess
import threading
import time
from typing import Callable


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago, and not one this process was given before: the kernel may
    hand the same ephemeral port to two binds in a row once the first socket is closed, and a sidecar given one port for
    gRPC and metrics then fails to start ("Address already in use")."""
    with _handed_out_lock:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free loopback port that this process was not given before ({len(_handed_out)} given)")


def port_taken(output: str) -> bool:
    """Whether a `promptcache serve` that exited said it could not listen because a port was in use: with ports
    from free_port, another process took one in between (a start worth retrying on new ports)."""
    return "cannot listen on" in output and "in use" in output


# How long a starting process may take while it is alive and making progress (CPU time or page faults: a cold page
# cache loading torch's libraries shows as faults), and how long it may make none before it counts as stuck. A
# loaded machine slows a start down, it does not stop it, so the waits below fail on an exit or a stall, not at a
# fixed 30 s.
START_BOUND_SECONDS = 600.0
STALL_SECONDS = 30.0


def process_progress(pid: int) -> int | None:
    """A counter that grows while process `pid` runs: its user+system ticks plus its page faults (Linux /proc);
    None where that cannot be read (another OS, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (state) of proc(5): minflt 10, majflt 12, utime 14, stime 15.
    return sum(int(fields[i - 3]) for i in (10, 12, 14, 15))


class StartWatch:
    """The deadline of a wait for a starting process: `timeout` seconds when given, else START_BOUND_SECONDS while
    `proc` (a Popen, or None for an in-process start) stays alive and keeps making progress within STALL_SECONDS."""

    def __init__(self, proc: subprocess.Popen | None = None, timeout: float | None = None):
        self.proc, self.timeout = proc, timeout
        self.start = self.seen = time.monotonic()
        self.last = process_progress(proc.pid) if proc is not None else None

    def expired(self) -> str | None:
        """Why the wait is over (a sentence), or None while it goes on."""
        now = time.monotonic()
        if self.timeout is not None:
            return f"within {self.timeout:g} s" if now - self.start >= self.timeout else None
        if now - self.start >= START_BOUND_SECONDS:
            return f"within {START_BOUND_SECONDS:g} s"
        if self.proc is None:
            return None
        progress = process_progress(self.proc.pid)
        if progress is None or progress != self.last:
            self.last, self.seen = progress, now
        elif now - self.seen >= STALL_SECONDS:
            return f"after {now - self.start:.0f} s (no progress in its last {STALL_SECONDS:g} s)"
        return None


def wait_until(check: Callable[[], object], what: str, timeout: float | None = None,
               proc: subprocess.Popen | None = None) -> None:
    """Return once check() is truthy; exceptions count as "not yet". RuntimeError when `proc` (the process that
    should answer) exits, TimeoutError naming `what` when the wait ends (StartWatch: `timeout` seconds if given,
    else as long as `proc` makes progress, up to a generous bound)."""
    watch = StartWatch(proc, timeout)
    while True:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it came up")
        why = watch.expired()
        if why:
            raise TimeoutError(f"{what} did not come up {why}")
        time.sleep(0.05)


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float | None = None,
                 describe: Callable[[], str] = lambda: "", **client_kwargs) -> None:
    """Return once the sidecar at `address` answers its gRPC health check; raise if it exits, or when the wait
    ends (StartWatch: `timeout` seconds if given, else as long as it makes progress, up to a generous bound).
    client_kwargs reach PromptCacheClient (tls_ca= for a sidecar serving TLS)."""
    from promptcache.client import PromptCacheClient

    watch = StartWatch(proc, timeout)
    with PromptCacheClient(address, timeout=1, **client_kwargs) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {proc.returncode}{describe()}")
            if client.healthy(timeout=0.5):
                return
            why = watch.expired()
            if why:
                raise TimeoutError(f"sidecar at {address} not healthy {why}{describe()}")
            time.sleep(0.05)


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
