"""Helpers shared by the tests (importable as `support`; conftest.py holds only fixtures, since two conftest
modules in one run would shadow each other)."""
from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import torch

from promptcache.contract.keys import ModelSpec
from promptcache_devtools.procs import free_port, port_taken, stop_process, wait_healthy  # noqa: F401 - free_port re-exported

REPO = Path(__file__).resolve().parents[1]
SMALL = ModelSpec("test/tiny-llama", "rev-1", "float32", num_layers=2, num_kv_heads=2, head_dim=8)
CHUNK = 16


def make_kv(spec: ModelSpec, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random per-layer (K, V), [1, H, tokens, D] in the spec's dtype."""
    from promptcache.contract.layout import TORCH_DTYPES

    g = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[spec.kv_dtype]
    shape = (1, spec.num_kv_heads, tokens, spec.head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(spec.num_layers)]


class FakeClock:
    """Time that moves only when the test advances it, for TTL tests without sleeps. Two clocks from different
    origins move together, as the sidecar's do: `monotonic` (the memory tier's, MemoryTier(clock=)) and `wall`
    (the disk tier's, DiskTier(clock=), kept in its records across restarts). sidecar_factory(clock=...) builds an
    in-process sidecar whose tiers run on them (installed)."""

    def __init__(self, monotonic: float = 1000.0, wall: float = 1.7e9):
        self.elapsed = 0.0
        self._monotonic, self._wall = monotonic, wall

    def monotonic(self) -> float:
        return self._monotonic + self.elapsed

    def wall(self) -> float:
        return self._wall + self.elapsed

    __call__ = monotonic

    def advance(self, seconds: float) -> None:
        self.elapsed += seconds

    @contextlib.contextmanager
    def installed(self):
        """Within it, a MemoryTier or DiskTier built without a clock gets these (the default of its `clock=`),
        as a Sidecar constructed here builds them. The sidecar's TTL sweeper still wakes up in real time, and
        removes what has expired by these clocks."""
        from promptcache.sidecar.disk import DiskTier
        from promptcache.sidecar.store import MemoryTier

        with _default(MemoryTier.__init__, "clock", self.monotonic), _default(DiskTier.__init__, "clock", self.wall):
            yield self


@contextlib.contextmanager
def _default(fn, name: str, value):
    """`fn`'s parameter `name` defaults to `value` within."""
    if inspect.signature(fn).parameters[name].kind is inspect.Parameter.KEYWORD_ONLY:
        saved = fn.__kwdefaults__
        fn.__kwdefaults__ = {**saved, name: value}
        try:
            yield
        finally:
            fn.__kwdefaults__ = saved
        return
    positional = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    saved = fn.__defaults__
    at = positional.index(name) - (len(positional) - len(saved))
    fn.__defaults__ = saved[:at] + (value,) + saved[at + 1:]
    try:
        yield
    finally:
        fn.__defaults__ = saved


class SidecarProcess:
    """`promptcache serve` as a real subprocess, for what needs a process: exit codes, signals, kill -9."""

    def __init__(self, *args: str, env: dict | None = None):
        # PROMPTCACHE_CHUNK_OVERHEAD_BYTES 0 unless asked: budgets here are sized in the tests' chunk bytes alone
        self._args = args
        self._env = {**os.environ, "PROMPTCACHE_CHUNK_OVERHEAD_BYTES": "0", **(env or {})}
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", self.address,
               "--metrics-port", str(self.metrics_port), *self._args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self._env)

    def wait_ready(self, timeout: float | None = None, **client_kwargs) -> "SidecarProcess":
        """Wait until it answers its health check: as long as it is alive and starting (procs.StartWatch), or
        `timeout` seconds when given. client_kwargs: how to reach it (tls_ca=... when it serves TLS; health needs
        no token). A start that lost one of its free ports to another process in the meantime (the port is in
        use) is retried on new ports, twice."""
        for attempt in range(3):
            output = []

            def describe() -> str:
                if self.proc.poll() is None:
                    return ""
                output.append(self.proc.stdout.read())
                return f": {output[-1]}"

            try:
                wait_healthy(self.address, self.proc, timeout, describe, **client_kwargs)
                return self
            except RuntimeError:
                if attempt == 2 or not output or not port_taken(output[-1]):
                    raise
            self._start()
        return self

    def stop(self) -> None:
        stop_process(self.proc)


def metrics_text(sidecar) -> str:
    """The /metrics page of an in-process Sidecar, as Prometheus scrapes it."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(sidecar, name_and_labels: str) -> float:
    """One sample's value, e.g. metric(s, 'promptcache_requests_total{code="OK",rpc="Get"}'); 0 when absent."""
    for line in metrics_text(sidecar).splitlines():
        if line.startswith(name_and_labels + " "):
            return float(line.split()[-1])
    return 0.0


def run_vllm_probe(vllm_python: str, script: Path, arg: dict, timeout: float = 800, env: dict | None = None) -> dict:
    """Run a probe script (tests/vllm/_*_probe.py) in the vLLM virtualenv with `arg` as JSON, the checkout's source
    roots on its path, no network and `env` on top; returns what it printed on its `@@` line (a JSON object)."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / d) for d in ("sidecar", "proto", "operator")),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
    run = subprocess.run([vllm_python, str(script), json.dumps(arg)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=str(REPO))
    line = next((x for x in run.stdout.splitlines() if x.startswith("@@")), None)
    assert line is not None, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(line[2:])


def make_writable(entry) -> None:
    """What a tier whose chunk memory could not be made read-only has (mprotect refused, or more chunks than the
    kernel allows mappings): the entry's memory writable, and hashed before each send. For tests that corrupt a
    stored chunk."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    if entry.immutable:
        assert libc.mprotect(ctypes.c_void_p(entry.data.data_ptr()), ctypes.c_size_t(entry.data.numel()),
                             mmap.PROT_READ | mmap.PROT_WRITE) == 0
        entry.immutable = False
        if entry.memfd is not None:
            entry.memfd.immutable = False


def mapping_permissions(address: int) -> str:
    """The permissions /proc/self/maps gives the mapping that holds `address` (e.g. "r--s")."""
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return perms
    raise AssertionError(f"no mapping holds {address:#x}")
