#!/usr/bin/env python3
"""Where a bulk Put's or Get's sidecar CPU goes, call by call (issue #31; docs/benchmarks.md).

    nice .venv/bin/python hack/bulk-split.py [--mode put|get] [--chunk-kib 1024] [--size-mb 8] [--calls 400]
        [--budget-mb N] [--memfd] [--profile N]

Runs a sidecar in this process on loopback TCP, or with --memfd on a unix socket (the `promptcache bench
throughput` layout: 4 KiB a token, a budget of 4 x the call's bytes + 64 MiB unless --budget-mb) with the functions below wrapped to add up the CPU time (thread CPU, so waiting on
the socket is not counted) of the calls made under them; a client in another process then fills the budget (puts),
the counters are reset, and it makes `--calls` timed puts of new prefixes (each evicts as much as it stores) or
gets of one stored prefix. Prints microseconds per call of each wrapped function, inclusive of what it calls, and
the process's CPU over all its threads (the connection's, the miss-ratio curve's observer, the rest); each wrapper
adds about a microsecond, so read differences between chunk sizes, not the last digit.

`--profile N` runs cProfile around each BulkServer._put (or _get) instead of the wrappers and prints its N
functions with the most time of their own (wall time, inflated alike by the profiler; the fill calls included): where
the work per chunk goes, which the wrappers' own cost hides at small chunks (docs/benchmarks.md, issue #31).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import tempfile
import sys
import time

CLIENT = r"""
import sys, torch
from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec
from promptcache_devtools.procs import wait_until
grpc_address, bulk_address, ct, n_chunks, calls, mode, fills = sys.argv[1:8]
ct, n_chunks, calls, fills = int(ct), int(n_chunks), int(calls), int(fills)
memfd = bulk_address.startswith("unix:")  # --memfd: puts through the client's memfd
spec = ModelSpec("bench/1mib-chunks", "v1", "float16", num_layers=4, num_kv_heads=4, head_dim=64)
c = PromptCacheClient(grpc_address, timeout=120, chunk_tokens=ct, bulk_address=bulk_address, bulk_shared_memory=memfd)
wait_until(lambda: c.healthy(), "sidecar")
blobs = {i: torch.randn(ct * 2048).to(torch.float16).view(torch.uint8) for i in range(n_chunks)}
def tokens(k):
    return [k * 1_000_003 % 2**31 + i for i in range(n_chunks * ct)]
for k in range(10**6, 10**6 + fills):  # fill the budget: each timed put then evicts as much as it stores
    c.put_blobs(spec, tokens(k), blobs)
if mode == "get":
    c.put_blobs(spec, tokens(7), blobs)
    for _ in range(20):
        c.get_blobs(spec, tokens(7))
print("reset", flush=True)
sys.stdin.readline()
for k in range(calls):
    if mode == "put":
        assert c.put_blobs(spec, tokens(100 + k), blobs).stored_chunks == n_chunks
    else:
        assert len(c.get_blobs(spec, tokens(7))) == n_chunks
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("put", "get"), default="put")
    ap.add_argument("--chunk-kib", type=int, default=1024, choices=(256, 1024, 4096, 8192))
    ap.add_argument("--size-mb", type=int, default=8)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--budget-mb", type=int, default=0,
                    help="the memory tier's budget (default: 4 x --size-mb + 64, the throughput bench's for this size "
                         "alone; `bench throughput --sizes-mb 8,64` runs at 320)")
    ap.add_argument("--memfd", action="store_true",
                    help="the bulk channel on a unix socket, the client putting through its memfd and the sidecar "
                         "lending (zero copy on): the bulk-lent path, instead of bytes on loopback TCP")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile each call instead of the timers; print the N functions with the most own time")
    args = ap.parse_args()
    chunk_bytes = args.chunk_kib << 10
    if (args.size_mb << 20) % chunk_bytes:
        ap.error("--size-mb must be a whole number of chunks")
    n_chunks, ct = (args.size_mb << 20) // chunk_bytes, chunk_bytes // 4096

    from promptcache.contract import bulkwire
    from promptcache.sidecar import bulk, engine, memfd, observer, putsession, sinks, store, tenancy
    from promptcache.sidecar.tiers import stack
    from promptcache.sidecar.app import Sidecar
    from promptcache.sidecar.config import Settings
    from promptcache_devtools.procs import free_port

    spent: collections.Counter = collections.Counter()
    clock = time.thread_time_ns
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        call = "_put" if args.mode == "put" else "_get"
        served = getattr(bulk.BulkServer, call)

        def profiled(*a, **k):
            profile.enable()
            try:
                return served(*a, **k)
            finally:
                profile.disable()

        setattr(bulk.BulkServer, call, profiled)

    def wrap(owner, name: str, label: str | None = None) -> None:
        if profile is not None:
            return  # the profiler instead of the timers
        inner = getattr(owner, name)

        def timed(*a, **k):
            t = clock()
            try:
                return inner(*a, **k)
            finally:
                spent[label or name] += clock() - t

        setattr(owner, name, timed)

    wrap(bulk.BulkServer, "_next_frame", "waiting for and reading a request frame")
    # On its own thread, off the call's path but on the sidecar's CPU (a sampled Put or Get is simulated in the
    # miss-ratio curve's miniatures: docs/sizing.md).
    wrap(observer.TrafficObserver, "_handle", "TrafficObserver._handle (miss-ratio curve, its own thread)")
    if args.mode == "put":
        wrap(bulk.BulkServer, "_put", "BulkServer._put (all of the put below)")
        wrap(bulkwire, "recv_into", "recv_into (the bytes; frames too)")
        wrap(store.ChunkCheck, "copy_in", "ChunkCheck.copy_in (xxh3, finite scan, copy into the chunk)")
        wrap(engine.CacheEngine, "put", "PutSession() (keys of every chunk)")
        wrap(putsession.PutSession, "begin_chunk")
        wrap(store.MemoryTier, "reserve", "MemoryTier.reserve (in begin_chunk)")
        wrap(store.MemoryTier, "_make_room", "MemoryTier._make_room (eviction, in reserve)")
        wrap(store.MemoryTier, "_remove", "MemoryTier._remove (in _make_room)")
        wrap(tenancy.Tenancy, "reserve", "Tenancy.reserve (in begin_chunk)")
        wrap(putsession.PutSession, "add_data", "PutSession.add_data (copy_in; stores a complete chunk)")
        wrap(engine.CacheEngine, "store", "CacheEngine.store (in add_data)")
        wrap(store.MemoryTier, "commit", "MemoryTier.commit (in store)")
        wrap(memfd.ChunkMemory, "allocate", "ChunkMemory.allocate (a new memfd, --memfd)")
        wrap(bulk._PutFrames, "_chunk_frame", "reading chunk frames")
        wrap(putsession.PutSession, "commit", "PutSession.commit")
        wrap(bulkwire, "send", "sending the status")
    else:
        wrap(bulk.BulkServer, "_get", "BulkServer._get (all of the get below)")
        wrap(bulkwire, "send_buffers", "send_buffers (frames and bytes)")
        wrap(stack.TierStack, "acquire", "TierStack.acquire (the lease; the policy told)")
        wrap(sinks.ChunkSink, "place", "ChunkSink.place")
        wrap(engine.CacheEngine, "release_leases")
        wrap(bulk._GetAnswer, "chunk", "_GetAnswer.chunk (queues; sends each 16 MiB)")
        wrap(bulk._GetAnswer, "finish", "_GetAnswer.finish (the status)")
    tcp = free_port()
    bulk_address = (f"unix:{tempfile.mkdtemp(prefix='bulk-split-')}/bulk.sock" if args.memfd
                    else f"127.0.0.1:{free_port()}")
    budget = (args.budget_mb or 4 * args.size_mb + 64) << 20
    sidecar = Sidecar(Settings(grpc_address=f"127.0.0.1:{tcp}", bulk_address=bulk_address,
                               bulk_zero_copy="on" if args.memfd else "auto", metrics_port=0, memory_bytes=budget,
                               chunk_tokens=ct, max_chunk_bytes=chunk_bytes, log_level="warning")).start()
    try:
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT, f"127.0.0.1:{tcp}", bulk_address, str(ct), str(n_chunks),
             str(args.calls), args.mode, str(budget // (args.size_mb << 20) + 1)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "reset"
        time.sleep(0.2)
        spent.clear()
        process_start = time.process_time_ns()
        client.stdin.write("go\n")
        client.stdin.flush()
        if client.wait() != 0:
            print("the client failed", file=sys.stderr)
            return 1
        process_ns = time.process_time_ns() - process_start
    finally:
        sidecar.stop()
    print(f"{args.mode}, {n_chunks} x {args.chunk_kib} KiB, {args.calls} calls; sidecar thread CPU per call:")
    for label, ns in spent.most_common():
        print(f"  {ns / args.calls / 1e3:9.1f} us  {label}")
    print(f"  {process_ns / args.calls / 1e3:9.1f} us  the sidecar's process, every thread")
    if profile is not None:
        import pstats

        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
