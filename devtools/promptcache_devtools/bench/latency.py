"""Where the time of one Get goes: gRPC's fixed cost, and a 1 MiB bulk-channel Get alone and between Redis GETs.

Measures, in one run against a sidecar subprocess and a redis-server subprocess on unix sockets:
* an empty gRPC call (health check): the floor of any gRPC Get;
* a bulk-channel Get of a prefix that is not cached: the floor of the bulk channel;
* a bulk-channel Get of one 1 MiB chunk, lent (zero copy) and copied into the client's memfd, back to back and
  each right after a Redis GET of the same bytes (its CPU caches then full of Redis's data), with the
  sidecar's own share of it read from its promptcache_request_duration_seconds{rpc="BulkGet"} histogram;
* the Redis GET itself, back to back and right after a bulk Get;
* in this process, the two per-byte steps of the sidecar's shared-memory Get on one 1 MiB chunk with the CPU caches
  cold (after copying 32 MiB elsewhere): the copy into a memfd mapping, then the xxh3 checksum of that copy.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=300, help="calls per measurement (median reported)")


def _server_seconds(metrics_port: int) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    total = re.search(r'promptcache_request_duration_seconds_sum\{rpc="BulkGet"\} (\S+)', text)
    count = re.search(r'promptcache_request_duration_seconds_count\{rpc="BulkGet"\} (\S+)', text)
    return (float(total.group(1)), float(count.group(1))) if total and count else (0.0, 0.0)


def _cold_copy_and_checksum(chunk, rounds: int) -> tuple[float, float]:
    import mmap
    import os

    import numpy as np

    from promptcache.sidecar.store import checksum

    fd = os.memfd_create("latency-bench")
    try:
        os.ftruncate(fd, chunk.size)
        dst = np.frombuffer(mmap.mmap(fd, chunk.size), dtype=np.uint8)
        dst.fill(0)
    finally:
        os.close(fd)
    other_src = np.ones(32 << 20, dtype=np.uint8)
    other_dst = np.empty_like(other_src)
    copy_times, hash_times = [], []
    for _ in range(rounds):
        other_dst[:] = other_src  # evict the chunk from the CPU caches, as other work between Gets does
        start = time.perf_counter()
        dst[:] = chunk
        copy_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        checksum(dst)  # as the sidecar does: verify the copy, just written, where the client will read it
        hash_times.append(time.perf_counter() - start)
    return statistics.median(copy_times) * 1e3, statistics.median(hash_times) * 1e3


def run(args) -> int:
    import redis
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from promptcache.client import PromptCacheClient
    from promptcache.contract.keys import ModelSpec
    from promptcache_devtools.procs import free_port, stop_process, wait_healthy, wait_until

    redis_bin = shutil.which("redis-server")
    if not redis_bin:
        print("redis-server is not installed: run `make system-deps`", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="promptcache-latency-"))
    metrics_port = free_port()
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", f"unix:{tmp}/grpc.sock",
         "--bulk-address", f"unix:{tmp}/bulk.sock", "--metrics-port", str(metrics_port), "--memory-bytes", "256Mi",
         "--max-chunk-bytes", "1Mi", "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rds = subprocess.Popen([redis_bin, "--port", "0", "--unixsocket", f"{tmp}/redis.sock", "--save", "",
                            "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"unix://{tmp}/grpc.sock", sidecar)
        client = PromptCacheClient(f"unix://{tmp}/grpc.sock", timeout=30, chunk_tokens=256,
                                   bulk_address=f"unix:{tmp}/bulk.sock")
        r = redis.Redis(unix_socket_path=f"{tmp}/redis.sock")
        wait_until(r.ping, "redis-server", proc=rds)
        spec = ModelSpec("bench/1mib-chunks", "v1", "float16", num_layers=4, num_kv_heads=4, head_dim=64)
        blob = torch.randn(1 << 19).to(torch.float16).view(torch.uint8)  # finite K/V values: the sidecar checks
        tokens = list(range(256))
        client.put_blobs(spec, tokens, {0: blob})
        r.set("chunk", blob.numpy().tobytes())
        health = health_pb2_grpc.HealthStub(client._channel)

        def timed(fn, before=None) -> float:
            for _ in range(10):
                fn()
            times = []
            for _ in range(args.rounds):
                if before is not None:
                    before()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times) * 1e3

        copying = PromptCacheClient(f"unix://{tmp}/grpc.sock", timeout=30, chunk_tokens=256,
                                    bulk_address=f"unix:{tmp}/bulk.sock", bulk_zero_copy=False)

        def bulk(c, before=None) -> tuple[float, float]:
            def get():
                assert len(c.get_blobs(spec, tokens, copy=False)) == 1

            s0, n0 = _server_seconds(metrics_port)
            client_ms = timed(get, before)
            s1, n1 = _server_seconds(metrics_port)
            return client_ms, (s1 - s0) / max(n1 - n0, 1) * 1e3

        grpc_ms = timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5))
        uncached = list(range(10_000, 10_256))
        miss_ms = timed(lambda: client.get_blobs(spec, uncached, copy=False))  # the channel's own fixed cost
        lent, lent_server = bulk(client)
        lent_cold, lent_cold_server = bulk(client, before=lambda: r.get("chunk"))
        copied, copied_server = bulk(copying)
        copied_cold, copied_cold_server = bulk(copying, before=lambda: r.get("chunk"))
        redis_ms = timed(lambda: r.get("chunk"))
        redis_cold = timed(lambda: r.get("chunk"), before=lambda: client.get_blobs(spec, tokens, copy=False))
        copy_ms, hash_ms = _cold_copy_and_checksum(blob.numpy(), args.rounds)
        rows = [("empty gRPC call (health check)", f"{grpc_ms:.3f}", ""),
                ("bulk Get, nothing cached", f"{miss_ms:.3f}", ""),
                ("bulk Get 1 MiB lent (zero copy), back to back", f"{lent:.3f}", f"{lent_server:.3f} (mean)"),
                ("bulk Get 1 MiB lent, between Redis GETs", f"{lent_cold:.3f}", f"{lent_cold_server:.3f} (mean)"),
                ("bulk Get 1 MiB copied into the client's memfd, back to back", f"{copied:.3f}",
                 f"{copied_server:.3f} (mean)"),
                ("bulk Get 1 MiB copied, between Redis GETs", f"{copied_cold:.3f}",
                 f"{copied_cold_server:.3f} (mean)"),
                ("Redis GET 1 MiB, back to back", f"{redis_ms:.3f}", ""),
                ("Redis GET 1 MiB, between bulk Gets", f"{redis_cold:.3f}", ""),
                ("copy of 1 MiB into a memfd, caches cold", f"{copy_ms:.3f}", ""),
                ("then xxh3 of that copy", f"{hash_ms:.3f}", "")]
        print("| what | ms (median) | of which in the sidecar, ms |\n|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print(f"\nlent bulk Get / Redis GET: {redis_ms / lent:.2f}x back to back, {redis_cold / lent_cold:.2f}x "
              f"interleaved")
        copying.close()
        client.close()
        return 0
    finally:
        stop_process(sidecar)
        stop_process(rds)
        shutil.rmtree(tmp, ignore_errors=True)
