#!/usr/bin/env python3
"""What a bulk Put's bookkeeping costs per chunk, without any socket (issue #31; docs/benchmarks.md).

    nice .venv/bin/python hack/put-glue.py [--calls 300] [--chunks 8] [--policy rate-hazard] [--piece-kib 512]
        [--profile N]

Drives CacheEngine.put's PutSession directly, in this process, the way the bulk channel does (begin_chunk, then
the chunk's bytes through add_data() in the channel's 512 KiB receive pieces, from a buffer that stays in the CPU's
cache as the connection's receive buffer does), against a sidecar engine whose memory tier is full, so each chunk
stored evicts one (the `promptcache bench throughput` layout: 1 MiB chunks, 4 KiB a token, a budget of 4 x the
Put's bytes + 64 MiB). Prints the thread CPU per chunk: in all, in ChunkCheck.copy_in (the xxh3, the finite scan
and the streaming copy into the chunk), and the rest (reservation, eviction, commit, the listeners and the
session: the per-chunk work hack/bulk-split.py cannot separate from the socket's). `--profile N`: cProfile's N
functions with the most time of their own over the timed Puts instead (inflated by the profiler, per call).
"""
from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="timed Puts")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 1 MiB per Put")
    ap.add_argument("--policy", default=None, help="--eviction-policy (default: the sidecar's)")
    ap.add_argument("--piece-kib", type=int, default=512, help="bytes per add_data call (the bulk channel's "
                    "receive piece, bulk.RECEIVE_PIECE, is 512 KiB)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N by own time")
    args = ap.parse_args()

    import torch

    from promptcache.contract.keys import ModelSpec
    from promptcache.contract.layout import chunk_shape
    from promptcache.contract.wire import NAME_TO_DTYPE, model_to_proto
    from promptcache.sidecar.store import ChunkCheck
    from promptcache.sidecar.app import Sidecar
    from promptcache.sidecar.config import Settings
    from promptcache.sidecar.identity import ANONYMOUS, Caller
    from promptcache.v1 import kvcache_pb2 as pb
    import xxhash

    ct, n = 256, args.chunks
    budget = 4 * (n << 20) + (64 << 20)
    extra = {"eviction_policy": args.policy} if args.policy else {}
    sidecar = Sidecar(Settings(grpc_address="127.0.0.1:0", metrics_port=0, memory_bytes=budget, chunk_tokens=ct,
                               max_chunk_bytes=1 << 20, log_level="warning", **extra))
    engine = sidecar.engine
    spec = ModelSpec("bench/put-glue", "v1", "float16", num_layers=4, num_kv_heads=4, head_dim=64)
    data = torch.randn(ct * 2048).to(torch.float16).view(torch.uint8).numpy()
    checksum = xxhash.xxh3_64_intdigest(data)
    piece = args.piece_kib << 10
    shape, dtype = list(chunk_shape(spec, ct)), NAME_TO_DTYPE["float16"]
    caller = Caller(ANONYMOUS, "put-glue")

    def put(k: int) -> pb.PutResponse:
        header = pb.PutHeader(model=model_to_proto(spec), tokens=[k * 1_000_003 % 2**31 + i for i in range(n * ct)])
        with engine.put(caller, header) as session:
            for i in range(n):
                session.begin_chunk(pb.ChunkBegin(index=i, nbytes=data.size, shape=shape, dtype=dtype,
                                                  xxh3_64=checksum))
                for at in range(0, data.size, piece):
                    session.add_data(memoryview(data[at:at + piece]))
            return session.commit()

    for k in range(10**6, 10**6 + budget // (n << 20) + 2):  # fill the budget: from here on each chunk evicts one
        put(k)
    if args.profile:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.enable()
        for k in range(args.calls):
            put(100 + k)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
        return 0
    copied = [0]
    copy_in = ChunkCheck.copy_in

    def timed_copy_in(self, *a, **kw):
        t = time.thread_time_ns()
        try:
            return copy_in(self, *a, **kw)
        finally:
            copied[0] += time.thread_time_ns() - t

    ChunkCheck.copy_in = timed_copy_in
    start = time.thread_time_ns()
    for k in range(args.calls):
        if put(100 + k).stored_chunks != n:
            raise SystemExit("a timed Put did not store every chunk")
    total = time.thread_time_ns() - start

    def per_chunk(ns: int) -> str:
        return f"{ns / (args.calls * n) / 1e3:7.1f} us"

    print(f"put of {n} x 1 MiB, {args.calls} calls, policy {engine.tier.policy.name}; thread CPU per chunk:")
    print(f"  {per_chunk(total)}  in all")
    print(f"  {per_chunk(copied[0])}  ChunkCheck.copy_in: xxh3, finite scan, streaming copy into the chunk")
    print(f"  {per_chunk(total - copied[0])}  the rest: reservation, eviction, commit, listeners, session")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
