"""Load test: N concurrent clients, mixed lookup/get/put, for a bounded time; throughput, p50/p99, errors.

`promptcache bench loadtest --clients 64 --duration 120` starts a sidecar subprocess on loopback (or drives
--target) and runs the clients as threads, spread over --processes worker processes, each client with its
own connection. Prefixes are drawn from a working set with a Zipf-like popularity, so the cache sees hits,
misses and evictions. Every chunk a Get returns is checked against the bytes that were put for it (not only
its checksum): a chunk with the wrong content counts as corrupt. While it runs, the sidecar's RSS and its
budget accounting (/metrics: promptcache_committed_bytes against promptcache_budget_bytes) are sampled.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from promptcache_devtools.procs import free_port

OPS = ("lookup", "get", "put")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to run (default 60)")
    p.add_argument("--progress-seconds", type=float, default=5.0,
                   help="print a progress line to stderr this often while running (0: never; default 5)")
    p.add_argument("--processes", type=int, default=0,
                   help="client processes the clients are spread over (0: one per 16 clients, at most CPUs)")
    p.add_argument("--mix", default="lookup=4,get=4,put=2", help="relative weights of the operations")
    p.add_argument("--prefixes", type=int, default=512, help="distinct prefixes in the working set")
    p.add_argument("--chunks", type=int, default=4, help="chunks per prefix")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--memory-bytes", default="256Mi", help="budget of the sidecar started by the test")
    p.add_argument("--workers", type=int, default=32, help="gRPC workers of the sidecar started by the test")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline of each call")
    p.add_argument("--target", help="drive this running sidecar instead of starting one")
    p.add_argument("--metrics-url", help="with --target: its /metrics URL, for the budget samples")
    p.add_argument("--token", help="bearer token for --target")
    p.add_argument("--tls-ca", help="CA file for a --target that serves TLS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON here")


def _mix(text: str) -> dict[str, float]:
    weights = {}
    for part in text.split(","):
        op, _, w = part.partition("=")
        if op.strip() not in OPS:
            raise ValueError(f"--mix: unknown operation {op!r} (lookup, get, put)")
        weights[op.strip()] = float(w or 1)
    return weights


def _spec(cfg):
    from promptcache.contract.keys import ModelSpec

    return ModelSpec("loadtest/model", "r1", cfg["dtype"], cfg["layers"], cfg["kv_heads"], cfg["head_dim"])


def _tokens(prefix: int, cfg) -> list[int]:
    n = cfg["chunks"] * cfg["chunk_tokens"]
    return [(prefix * 7919 + i) % 50_000 for i in range(n)] if prefix else list(range(n))


def _blob(prefix: int, index: int, nbytes: int, blobs: list[bytes]) -> bytes:
    """The bytes of chunk `index` of `prefix`: a shared random block with (prefix, index) stamped in front."""
    base = blobs[(prefix * 31 + index) % len(blobs)]
    return (prefix.to_bytes(8, "little") + index.to_bytes(8, "little") + base[16:])[:nbytes]


def _client_worker(cfg, client_id: int, deadline: float, out: dict, lock: threading.Lock, blobs) -> None:
    import grpc

    from promptcache.client import PromptCacheClient, errors
    from promptcache.contract.layout import chunk_nbytes
    from promptcache.client.credentials import client_channel

    rng = random.Random(cfg["seed"] * 100_003 + client_id)
    spec = _spec(cfg)
    nbytes = chunk_nbytes(spec, cfg["chunk_tokens"])
    ops, weights = zip(*cfg["mix"].items())
    channel = client_channel(cfg["target"], root_certificates=cfg.get("tls_ca"), token=cfg.get("token"),
                             options=[("grpc.use_local_subchannel_pool", 1)])
    lat = {op: [] for op in OPS}
    errs: dict[str, int] = {}
    hits = gets = corrupt = 0
    with PromptCacheClient(cfg["target"], channel=channel, timeout=cfg["timeout"], retries=1,
                           chunk_tokens=cfg["chunk_tokens"]) as client:
        while time.monotonic() < deadline:
            # Zipf-like popularity over the working set.
            prefix = min(int(rng.paretovariate(1.1)) - 1, cfg["prefixes"] - 1)
            tokens = _tokens(prefix, cfg)
            op = rng.choices(ops, weights)[0]
            t0 = time.perf_counter()
            try:
                if op == "lookup":
                    client.lookup(spec, tokens)
                elif op == "get":
                    got = client.get_blobs(spec, tokens)
                    gets += 1
                    hits += bool(got)
                    for i, blob in enumerate(got):
                        if blob.numpy().tobytes() != _blob(prefix, i, nbytes, blobs):
                            corrupt += 1
                else:
                    client.put_blobs(spec, tokens, {i: _blob(prefix, i, nbytes, blobs)
                                                    for i in range(cfg["chunks"])})
            except errors.PromptCacheError as exc:
                name = exc.code.name if isinstance(exc.code, grpc.StatusCode) else type(exc).__name__
                errs[name] = errs.get(name, 0) + 1
            lat[op].append(time.perf_counter() - t0)
    with lock:
        for op in OPS:
            out["latencies"][op].extend(lat[op])
        for k, v in errs.items():
            out["errors"][k] = out["errors"].get(k, 0) + v
        out["gets"] += gets
        out["hits"] += hits
        out["corrupt"] += corrupt


def _process_main(cfg, client_ids, duration, ready, go, queue) -> None:
    """One client process: its share of the clients as threads; results to the queue. The clock starts when
    every process has done its imports (they take seconds on a loaded machine)."""
    import grpc  # noqa: F401 - import before the clock starts
    import torch

    from promptcache.client import PromptCacheClient  # noqa: F401

    from promptcache.contract.layout import TORCH_DTYPES, chunk_nbytes

    nbytes = chunk_nbytes(_spec(cfg), cfg["chunk_tokens"])
    # Finite values of the model's dtype, as K/V are (the sidecar refuses NaN and Inf in unquantized chunks).
    dtype = TORCH_DTYPES[cfg["dtype"]]
    g = torch.Generator().manual_seed(cfg["seed"])
    blobs = [torch.randn(nbytes // dtype.itemsize, generator=g).to(dtype).view(torch.uint8).numpy().tobytes()
             for _ in range(8)]
    out = {"latencies": {op: [] for op in OPS}, "errors": {}, "gets": 0, "hits": 0, "corrupt": 0}
    lock = threading.Lock()
    ready.put(os.getpid())
    go.wait()
    deadline = time.monotonic() + duration
    threads = [threading.Thread(target=_client_worker, args=(cfg, cid, deadline, out, lock, blobs), daemon=True)
               for cid in client_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(out)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class _Sampler(threading.Thread):
    """Samples the sidecar's RSS (psutil) and its budget accounting from /metrics."""

    def __init__(self, pid: int | None, metrics_url: str | None, interval: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.url, self.interval = pid, metrics_url, interval
        self.stop_event = threading.Event()
        self.peak_rss = 0
        self.baseline_rss = 0
        self.peak_committed = 0
        self.budget = 0
        self.over_budget_samples = 0
        self.samples = 0
        self.rss = 0
        self.committed = 0
        self.requests = 0  # calls the sidecar has answered (promptcache_requests_total), for progress

    def run(self) -> None:
        proc = None
        if self.pid:
            import psutil

            proc = psutil.Process(self.pid)
        while not self.stop_event.is_set():
            try:
                if proc is not None:
                    rss = self.rss = proc.memory_info().rss
                    self.baseline_rss = self.baseline_rss or rss
                    self.peak_rss = max(self.peak_rss, rss)
                if self.url:
                    committed, budget, self.requests = _scrape(self.url)
                    self.committed = committed
                    self.samples += 1
                    self.peak_committed = max(self.peak_committed, committed)
                    self.budget = budget
                    if committed > budget:
                        self.over_budget_samples += 1
            except Exception:  # noqa: BLE001 - a sample missed while the sidecar is busy is not fatal
                pass
            self.stop_event.wait(self.interval)


def _scrape(url: str) -> tuple[int, int, int]:
    """(committed, budget) of the device tier and the calls answered so far."""
    text = urllib.request.urlopen(url, timeout=2).read().decode()
    values = {}
    requests = 0.0
    for line in text.splitlines():
        for name in ("promptcache_committed_bytes", "promptcache_budget_bytes"):
            if line.startswith(name + "{") and 'tier="device"' in line:
                values[name] = int(float(line.rsplit(" ", 1)[1]))
        if line.startswith("promptcache_requests_total{"):
            requests += float(line.rsplit(" ", 1)[1])
    return values["promptcache_committed_bytes"], values["promptcache_budget_bytes"], int(requests)


def progress_line(elapsed: float, duration: float, requests: int, since: int, interval: float,
                  committed: int, budget: int, rss: int) -> str:
    """One progress line of a running load test (pure)."""
    mib = 1 << 20
    parts = [f"loadtest: {elapsed:.0f}/{duration:.0f} s", f"{requests} calls answered ({(requests - since) / interval:.0f}/s)"]
    if budget:
        parts.append(f"committed {committed / mib:.1f} of {budget / mib:.0f} MiB")
    if rss:
        parts.append(f"sidecar RSS {rss / mib:.0f} MiB")
    return ", ".join(parts)


def _start_sidecar(args) -> tuple[subprocess.Popen, str, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port, mport = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    log = open(Path(tempfile.mkdtemp(prefix="promptcache-load-")) / "sidecar.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", address,
                             "--metrics-port", str(mport), "--chunk-tokens", str(args.chunk_tokens),
                             "--memory-bytes", str(args.memory_bytes), "--workers", str(args.workers),
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(address) as ch:
        while True:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                break
            except grpc.RpcError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sidecar did not start; see {log.name}") from None
                time.sleep(0.1)
    return proc, address, f"http://127.0.0.1:{mport}/metrics"


def _collect(queue, n: int, started: float, args, sampler: "_Sampler") -> list[dict]:
    """Wait for every client process's results, printing a progress line every --progress-seconds."""
    import queue as queue_mod

    results: list[dict] = []
    interval = args.progress_seconds
    deadline = started + args.duration + 300
    next_line, last_requests = started + (interval or float("inf")), sampler.requests
    while len(results) < n:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"client processes did not report within {args.duration + 300:.0f} s")
        try:
            results.append(queue.get(timeout=max(0.05, min(next_line, deadline) - now)))
        except queue_mod.Empty:
            if time.monotonic() >= next_line:
                print(progress_line(time.monotonic() - started, args.duration, sampler.requests, last_requests,
                                    interval, sampler.committed, sampler.budget, sampler.rss),
                      file=sys.stderr, flush=True)
                last_requests, next_line = sampler.requests, next_line + interval
    return results


def load(args) -> dict:
    import multiprocessing as mp

    cfg = {k: getattr(args, k) for k in ("chunks", "chunk_tokens", "layers", "kv_heads", "head_dim", "dtype",
                                         "prefixes", "timeout", "seed", "token", "tls_ca")}
    cfg["dtype"] = args.dtype
    cfg["mix"] = _mix(args.mix)
    proc = None
    if args.target:
        cfg["target"], metrics_url = args.target, args.metrics_url
    else:
        proc, cfg["target"], metrics_url = _start_sidecar(args)
    sampler = _Sampler(proc.pid if proc else None, metrics_url)
    sampler.start()
    try:
        n_proc = args.processes or max(1, min(os.cpu_count() or 1, -(-args.clients // 16)))
        n_proc = min(n_proc, args.clients)
        ctx = mp.get_context("spawn")
        queue, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        groups = [list(range(args.clients))[i::n_proc] for i in range(n_proc)]
        workers = [ctx.Process(target=_process_main, args=(cfg, g, args.duration, ready, go, queue))
                   for g in groups]
        for w in workers:
            w.start()
        for _ in workers:
            ready.get(timeout=300)
        started = time.monotonic()
        go.set()
        results = _collect(queue, len(workers), started, args, sampler)
        for w in workers:
            w.join(30)
        elapsed = time.monotonic() - started
    finally:
        sampler.stop_event.set()
        sampler.join(5)
        alive = proc.poll() is None if proc else True
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    lat = {op: [x for r in results for x in r["latencies"][op]] for op in OPS}
    every = [x for op in OPS for x in lat[op]]
    errors_total: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors_total[k] = errors_total.get(k, 0) + v
    gets = sum(r["gets"] for r in results)
    report = {
        "clients": args.clients, "processes": n_proc, "seconds": round(elapsed, 1),
        "requests": len(every), "throughput_rps": round(len(every) / max(elapsed, 1e-9), 1),
        "p50_ms": round(_percentile(every, 0.5) * 1e3, 2), "p99_ms": round(_percentile(every, 0.99) * 1e3, 2),
        "by_op": {op: {"requests": len(lat[op]), "p50_ms": round(_percentile(lat[op], 0.5) * 1e3, 2),
                       "p99_ms": round(_percentile(lat[op], 0.99) * 1e3, 2)} for op in OPS},
        "errors": sum(errors_total.values()), "errors_by_code": errors_total,
        "get_hit_ratio": round(sum(r["hits"] for r in results) / gets, 3) if gets else None,
        "corrupt_chunks": sum(r["corrupt"] for r in results),
        "sidecar_alive": alive,
        "baseline_rss_bytes": sampler.baseline_rss or None,
        "peak_rss_bytes": sampler.peak_rss or None, "budget_bytes": sampler.budget or None,
        "peak_committed_bytes": sampler.peak_committed or None, "budget_samples": sampler.samples,
        "over_budget_samples": sampler.over_budget_samples,
    }
    return report


def run(args) -> int:
    report = load(args)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    mib = 1 << 20
    print(f"loadtest: {report['clients']} clients, {report['seconds']} s, {report['requests']} requests, "
          f"{report['throughput_rps']} req/s, p50 {report['p50_ms']} ms, p99 {report['p99_ms']} ms, "
          f"errors {report['errors']}, corrupt chunks {report['corrupt_chunks']}"
          + (f", RSS {report['baseline_rss_bytes'] / mib:.0f} MiB at start, peak {report['peak_rss_bytes'] / mib:.0f} MiB"
             f", peak committed "
             f"{report['peak_committed_bytes'] / mib:.1f} of {report['budget_bytes'] / mib:.0f} MiB budget"
             if report["peak_rss_bytes"] and report["budget_bytes"] else ""))
    ok = report["errors"] == 0 and report["corrupt_chunks"] == 0 and report["over_budget_samples"] == 0 \
        and report["sidecar_alive"]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m promptcache_devtools.bench.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
