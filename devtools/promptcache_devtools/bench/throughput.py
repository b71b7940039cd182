"""Put/Get throughput of 1, 8 and 64 MB prefixes over TCP and a unix socket (gRPC, shared memory, and the bulk
channel of docs/bulk-channel.md), against memcpy and Redis.

Everything is measured in the same run: an in-process copy of the same bytes (the ceiling), a sidecar
subprocess driven by PromptCacheClient, and redis-server subprocesses driven by redis-py (with hiredis) from
the same Python process, with the same chunk payloads (one Redis key per chunk, pipelined). Puts are compared with
two: SETs that overwrite the same keys (the ratios of the first table), and Redis used as a cache the way the
sidecar is (maxmemory the sidecar's budget, allkeys-lru, filled first, every SET a new key: "new keys").
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mb", default="1,8,64", help="prefix sizes in MiB (comma separated)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions per cell (median reported)")
    p.add_argument("--transports", default="tcp,unix,shm,bulk-tcp,bulk-unix,bulk-shm,bulk-lent",
                   help="tcp, unix (gRPC, bytes streamed over the socket), shm (gRPC on the unix socket for "
                        "metadata, bytes through shared memory), bulk-tcp, bulk-unix (Get over the bulk channel, "
                        "docs/bulk-channel.md, bytes on the socket both ways), bulk-shm (bulk channel on the unix "
                        "socket, Get's bytes copied into a memfd shared with the sidecar, Put's copied out of it), "
                        "bulk-lent (bulk channel on the unix socket, Get's chunks lent as the sidecar's own sealed "
                        "memfds: zero copy, the default; Put as bulk-shm)")
    p.add_argument("--chunk-kib", type=int, default=1024, choices=(256, 1024, 4096, 8192),
                   help="the layout's chunk size (256 KiB, 1, 4 or 8 MiB: 64, 256, 1024, 2048 tokens of 4 KiB): the "
                        "same bytes in more or fewer chunks, which separates what a Put or Get costs per chunk from its "
                        "cost per byte; Redis stores one key per chunk")
    p.add_argument("--block-seconds", type=float, default=0.02,
                   help="in each round, each contender runs a block of calls lasting about this long (at most 20 "
                        "calls; the same count for all, sized by the slowest); 0: one call each per round")
    p.add_argument("--output", default="bench-results/throughput.md", help="where to write the markdown table")
    p.add_argument("--plot", default="", help="also write a PNG of Get and Put throughput against size per transport, "
                                              "with Redis, here (needs matplotlib: the plots extra)")


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_seconds(pid: int) -> float:
    """CPU time of every thread of a process so far, in ns resolution (/proc/PID/task/*/schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


class CpuMeter:
    """CPU seconds per call of each contender, in each process that works on it (this one, the sidecar,
    redis-server): what a call costs whatever else runs on the machine, where wall-clock figures on a shared
    machine are mostly other processes' load."""

    def __init__(self, pids: dict[str, int]):
        self.pids = {"client": os.getpid(), **pids}
        self.spent: dict[str, dict[str, float]] = {}
        self.calls: dict[str, int] = {}
        self._own = 0.0  # CPU this process spent in snapshot() so far: not the client's work

    def snapshot(self) -> dict[str, float]:
        """CPU seconds of each process so far; the client's without the meter's own reads (about 0.5 ms a
        snapshot here, two per block of calls: 0.2 ms a call at 8 MiB was counted as the client's before)."""
        start = time.thread_time()
        out = {who: _cpu_seconds(pid) for who, pid in self.pids.items()}  # the client first (dict order)
        self._own += time.thread_time() - start
        out["client"] -= self._own
        return out

    def add(self, name: str, before: dict[str, float], calls: int) -> None:
        after = self.snapshot()
        spent = self.spent.setdefault(name, dict.fromkeys(self.pids, 0.0))
        for who in self.pids:
            spent[who] += after[who] - before[who]
        self.calls[name] = self.calls.get(name, 0) + calls

    def per_call_ms(self, name: str) -> dict[str, float]:
        return {who: s / self.calls[name] * 1e3 for who, s in self.spent[name].items()}


def _interleaved_medians(fns: dict, repeats: int, block_seconds: float = 0.0, cpu: CpuMeter | None = None,
                         prefix: str = "") -> dict:
    """Median seconds per call of each function, measured in rounds that run every one of them once, or for a
    block of calls lasting about `block_seconds` (the same count for each, sized by the slowest): on a shared
    machine, load that comes and goes then hits each side alike instead of whichever ran at the time. Blocks
    keep each side running as a stream of calls, which is what throughput is; with one call each, every call
    starts right after the other side's, with the CPU caches full of its data (`promptcache bench latency`
    measures that case)."""
    slowest = 0.0
    for fn in fns.values():
        start = time.perf_counter()
        fn()  # warm-up
        slowest = max(slowest, time.perf_counter() - start)
    block = max(1, min(20, int(block_seconds / max(slowest, 1e-6))))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            before = cpu.snapshot() if cpu is not None else None
            for _ in range(block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            if cpu is not None:
                cpu.add(prefix + name, before, block)
    return {name: statistics.median(t) for name, t in times.items()}


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def steady_allocator() -> bool:
    """Pin glibc malloc's mmap and trim thresholds (256 / 512 MiB) in this process, as a long-running client's
    reach on their own: by default each free of a large mmapped block raises the threshold, so the first calls
    with large buffers map fresh memory and fault every page in, later ones reuse the heap. The Redis client of
    whichever transport came first in --transports ran in that first state (10.9 against 3.6 ms of CPU per 8 MiB
    pipelined SET, 8.5 against 4.6 ms without a transport before it): the ratio measured the order, not the
    server. Both contenders' clients are in this process, so both get the same. False where it does not apply
    (not glibc)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 256 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 512 << 20))


def run(args) -> int:
    steady = steady_allocator()
    load = os.getloadavg()[0]
    import redis
    import torch

    from promptcache.client import PromptCacheClient
    from promptcache.contract.keys import ModelSpec
    from promptcache_devtools.procs import free_port, wait_until

    # 4 KiB a token: 4 layers x (K, V) x 4 heads x 64 dims x fp16; 256-token chunks of exactly 1 MiB by default.
    spec = ModelSpec("bench/1mib-chunks", "v1", "float16", num_layers=4, num_kv_heads=4, head_dim=64)
    chunk_bytes = args.chunk_kib << 10
    chunk_tokens = chunk_bytes // 4096
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    if any(size <= 0 or (size << 20) % chunk_bytes for size in sizes):
        print(f"--sizes-mb {args.sizes_mb}: every size must be a positive multiple of the chunk size "
              f"({args.chunk_kib} KiB, --chunk-kib)", file=sys.stderr)
        return 2
    transports = args.transports.split(",")
    redis_bin = shutil.which("redis-server")
    if not redis_bin:
        print("redis-server is not installed: run `make system-deps` (Debian package redis-server)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="promptcache-bench-"))
    shm_dir = Path(tempfile.mkdtemp(prefix="promptcache-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    procs = []
    try:
        tcp_port, bulk_port = free_port(), free_port()
        sock, bulk_sock = tmp / "sidecar.sock", tmp / "bulk.sock"
        budget = 4 * (max(sizes) << 20) + (64 << 20)
        # One sidecar process per transport family: TCP, and a unix socket (also used by the shm path).
        bulk = {"bulk-tcp": f"127.0.0.1:{bulk_port}", "bulk-unix": f"unix:{bulk_sock}",
                "bulk-shm": f"unix:{bulk_sock}", "bulk-lent": f"unix:{bulk_sock}"}
        for address, bulk_address in ((f"127.0.0.1:{tcp_port}", bulk["bulk-tcp"]),
                                      (f"unix:{sock}", bulk["bulk-unix"])):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", address,
                 "--bulk-address", bulk_address,
                 "--metrics-port", "0", "--memory-bytes", str(budget), "--chunk-tokens", str(chunk_tokens),
                 "--max-chunk-bytes", str(chunk_bytes), "--log-level", "warning", "--shm-dir", str(shm_dir)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        addresses = {"tcp": f"127.0.0.1:{tcp_port}", "unix": f"unix://{sock}", "shm": f"unix://{sock}",
                     "bulk-tcp": f"127.0.0.1:{tcp_port}", "bulk-unix": f"unix://{sock}",
                     "bulk-shm": f"unix://{sock}", "bulk-lent": f"unix://{sock}"}
        redis_port = free_port()
        redis_sock = tmp / "redis.sock"
        procs.append(subprocess.Popen(
            [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--unixsocket", str(redis_sock),
             "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--maxmemory", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # Redis used as this cache is: its budget as maxmemory, filled, and every SET a new key, so each one evicts
        # (allkeys-lru) as much as it stores and writes into memory an evicted value held, as a sidecar's Put does.
        # The first Redis SETs the same keys over and over: its values stay in the CPU's cache.
        cache_port = free_port()
        cache_sock = tmp / "redis-cache.sock"
        procs.append(subprocess.Popen(
            [redis_bin, "--port", str(cache_port), "--bind", "127.0.0.1", "--unixsocket", str(cache_sock),
             "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--maxmemory", str(budget),
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # Redis has no shared-memory path: the shm rows compare against Redis over its unix socket.
        rclients = {"tcp": redis.Redis(host="127.0.0.1", port=redis_port),
                    "unix": redis.Redis(unix_socket_path=str(redis_sock))}
        rclients["shm"] = rclients["bulk-unix"] = rclients["bulk-shm"] = rclients["bulk-lent"] = rclients["unix"]
        rclients["bulk-tcp"] = rclients["tcp"]
        caches = {"tcp": redis.Redis(host="127.0.0.1", port=cache_port),
                  "unix": redis.Redis(unix_socket_path=str(cache_sock))}
        caches.update({t: caches["tcp" if "tcp" in t else "unix"] for t in rclients})
        clients = {t: PromptCacheClient(addresses[t], timeout=120, chunk_tokens=chunk_tokens,
                                        shm_dir=str(shm_dir) if t == "shm" else None, bulk_address=bulk.get(t),
                                        bulk_shared_memory=t in ("bulk-shm", "bulk-lent"),
                                        bulk_zero_copy=t == "bulk-lent")
                   for t in transports}
        # procs: the TCP sidecar, the unix one, redis-server, Redis as a cache; each wait lasts while its process
        # starts (StartWatch).
        for t in transports:
            wait_until(lambda: clients[t].healthy(), f"sidecar ({t})", proc=procs[0 if "tcp" in t else 1])
            wait_until(lambda: rclients[t].ping(), f"redis ({t})", proc=procs[2])
            wait_until(lambda: caches[t].ping(), f"redis as a cache ({t})", proc=procs[3])

        rows, profile = [], []
        for size in sizes:
            n_chunks = (size << 20) // chunk_bytes
            # Finite float16 values, as K/V are (the sidecar refuses NaN and Inf in unquantized chunks).
            blobs = {i: torch.randn(chunk_bytes // 2).to(torch.float16).view(torch.uint8) for i in range(n_chunks)}
            payloads = [b.numpy().tobytes() for b in blobs.values()]
            src = torch.cat(list(blobs.values()))
            dst = torch.empty_like(src)
            memcpy = _median_seconds(lambda: dst.copy_(src), args.repeats)
            for t in transports:
                client, rc = clients[t], rclients[t]
                counter = iter(range(10**9))

                def put_once():
                    n = next(counter)
                    tokens = [n * 1_000_003 % 2**31 + i for i in range(n_chunks * chunk_tokens)]
                    res = client.put_blobs(spec, tokens, blobs)
                    assert res.stored_chunks == n_chunks, res

                tokens = list(range(n_chunks * chunk_tokens))
                keys = [f"bench:{size}:{i}" for i in range(n_chunks)]

                def redis_put():
                    pipe = rc.pipeline(transaction=False)
                    for k, v in zip(keys, payloads):
                        pipe.set(k, v)
                    pipe.execute()

                cc, cache_counter = caches[t], iter(range(10**9))

                def redis_cache_put():
                    n = next(cache_counter)
                    pipe = cc.pipeline(transaction=False)
                    for i, v in enumerate(payloads):
                        pipe.set(f"bench:{size}:{n}:{i}", v)
                    pipe.execute()

                # Each Put stores a new prefix and each SET overwrites its keys. The sidecar is filled to its
                # budget first, as a cache in service is: each timed Put then evicts as many bytes as it stores
                # (Redis reuses the memory of the values it replaces; a sidecar still filling up pays a page fault
                # per 4 KiB of new memory instead, docs/benchmarks.md).
                for _ in range(budget // (n_chunks * chunk_bytes) + 1):
                    put_once()
                    redis_cache_put()
                cpu = CpuMeter({"sidecar": procs[0 if t in ("tcp", "bulk-tcp") else 1].pid, "redis": procs[2].pid,
                                "redis-cache": procs[3].pid})
                puts = _interleaved_medians({"Put": put_once, "Redis SET": redis_put,
                                             "Redis SET, new keys": redis_cache_put},
                                            args.repeats, args.block_seconds, cpu, f"{t} ")
                put_s, rput_s, rcache_s = puts["Put"], puts["Redis SET"], puts["Redis SET, new keys"]
                client.put_blobs(spec, tokens, blobs)

                def get_once(copy=True):
                    got = client.get_blobs(spec, tokens, copy=copy)
                    assert len(got) == n_chunks

                def redis_get():
                    got = rc.mget(keys)
                    assert len(got) == n_chunks and all(len(g) == chunk_bytes for g in got)

                gets = {"Get, owned": get_once, "Redis GET": redis_get}
                if t == "shm" or t.startswith("bulk"):
                    # Views of the reused receive buffer: what get() decodes from (shm and bulk paths have them).
                    gets["Get, views"] = lambda: get_once(copy=False)
                medians = _interleaved_medians(gets, args.repeats, args.block_seconds, cpu, f"{t} ")
                get_s, rget_s, view_s = medians["Get, owned"], medians["Redis GET"], medians.get("Get, views")
                for name in cpu.calls:
                    profile.append((size, name, cpu.per_call_ms(name)))
                rc.flushall()
                cc.flushall()
                mb = n_chunks * chunk_bytes / 1e6
                rows.append((size, t, mb / put_s, mb / get_s, mb / memcpy, mb / rput_s, mb / rget_s, mb / rcache_s))
                print(f"throughput: {size} MiB {t}: Put {mb / put_s:,.0f} MB/s ({rput_s / put_s:.2f}x Redis SET, "
                      f"{rcache_s / put_s:.2f}x as a cache), Get {mb / get_s:,.0f} MB/s ({rget_s / get_s:.2f}x Redis "
                      "GET)", file=sys.stderr, flush=True)
                if view_s is not None:
                    rows.append((size, f"{t}, views", mb / put_s, mb / view_s, mb / memcpy, mb / rput_s, mb / rget_s,
                                 mb / rcache_s))
                client.purge(spec)
        lines = ["| prefix | transport | Put MB/s | Get MB/s | memcpy MB/s | Redis SET MB/s | Redis GET MB/s "
                 "| Put / Redis | Get / Redis | Get / memcpy | Redis SET, new keys MB/s | Put / Redis, new keys |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for size, t, put, get, mc, rput, rget, rcache in rows:
            lines.append(f"| {size} MiB | {t} | {put:,.0f} | {get:,.0f} | {mc:,.0f} | {rput:,.0f} | {rget:,.0f} "
                         f"| {put / rput:.2f}x | {get / rget:.2f}x | {get / mc:.3f} | {rcache:,.0f} "
                         f"| {put / rcache:.2f}x |")
        lines += ["", "CPU ms per call, each process (client: this benchmark; sidecar or redis-server: the server):",
                  "", "| prefix | call | client | server | total |", "|---|---|---|---|---|"]
        for size, name, ms in profile:
            server = ms["redis-cache"] if "new keys" in name else ms["redis"] if "Redis" in name else ms["sidecar"]
            lines.append(f"| {size} MiB | {name} | {ms['client']:.2f} | {server:.2f} | {ms['client'] + server:.2f} |")
        table = "\n".join(lines)
        print(table)
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"<!-- promptcache bench throughput, {time.strftime('%Y-%m-%d %H:%M')}, "
                       f"{os.cpu_count()} CPUs, load average {load:.2f} at the start, {args.repeats} rounds, "
                       f"blocks of ~{args.block_seconds:g} s, chunks of {args.chunk_kib} KiB, client malloc "
                       f"{'pinned' if steady else 'default'} -->\n"
                       f"{table}\n")
        if args.plot:
            from promptcache_devtools.bench import plots

            plots.throughput(rows, args.plot)
        return 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
