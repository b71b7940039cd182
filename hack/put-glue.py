#!/usr/bin/env python3
"""What a bulk Put's bookkeeping costs per chunk, without any socket (issue #31; docs/benchmarks.md).

    nice .venv/bin/python hack/put-glue.py [--calls 300] [--chunks 8] [--policy rate-hazard]

Drives CacheEngine.put's PutSession directly, in this process, the way the bulk channel does (begin_chunk, the
bytes written into data_target() - a numpy copy standing in for recv_into - then advance()), against a sidecar
engine whose memory tier is full, so each chunk stored evicts one (the `promptcache bench throughput` layout:
1 MiB chunks, 4 KiB a token, a budget of 4 x the Put's bytes + 64 MiB). Prints the thread CPU per chunk: in all,
in the checksum and finite scan, in the copy, and the rest (reservation, eviction, commit, the listeners and the
session: the per-chunk work hack/bulk-split.py cannot separate from the socket's).
"""
from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="timed Puts")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 1 MiB per Put")
    ap.add_argument("--policy", default=None, help="--eviction-policy (default: the sidecar's)")
    args = ap.parse_args()

    import numpy as np
    import torch

    from promptcache.contract.keys import ModelSpec
    from promptcache.contract.layout import chunk_shape
    from promptcache.contract.wire import NAME_TO_DTYPE, model_to_proto
    from promptcache.sidecar import engine as engine_module
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
    shape, dtype = list(chunk_shape(spec, ct)), NAME_TO_DTYPE["float16"]
    caller = Caller(ANONYMOUS, "put-glue")

    def put(k: int) -> pb.PutResponse:
        header = pb.PutHeader(model=model_to_proto(spec), tokens=[k * 1_000_003 % 2**31 + i for i in range(n * ct)])
        with engine.put(caller, header) as session:
            for i in range(n):
                session.begin_chunk(pb.ChunkBegin(index=i, nbytes=data.size, shape=shape, dtype=dtype,
                                                  xxh3_64=checksum))
                target = session.data_target()
                if target is not None:
                    np.frombuffer(target, dtype=np.uint8)[:] = data  # where recv_into would write
                session.advance(data.size)
            return session.commit()

    for k in range(10**6, 10**6 + budget // (n << 20) + 2):  # fill the budget: from here on each chunk evicts one
        put(k)
    scanned = [0]
    verify = engine_module.checksum_and_finite

    def timed_verify(buf, kv_dtype):
        t = time.thread_time_ns()
        try:
            return verify(buf, kv_dtype)
        finally:
            scanned[0] += time.thread_time_ns() - t

    engine_module.checksum_and_finite = timed_verify
    start = time.thread_time_ns()
    for k in range(args.calls):
        if put(100 + k).stored_chunks != n:
            raise SystemExit("a timed Put did not store every chunk")
    total = time.thread_time_ns() - start
    # The copy apart, into as many buffers as the tier holds chunks, in turn: each write lands in memory that is
    # not in the cache, as it does into the reservation an eviction just freed.
    scratch = [np.ones_like(data) for _ in range(budget // data.size)]
    start = time.thread_time_ns()
    for i in range(args.calls * n):
        scratch[i % len(scratch)][:] = data
    copied = time.thread_time_ns() - start

    def per_chunk(ns: int) -> str:
        return f"{ns / (args.calls * n) / 1e3:7.1f} us"

    print(f"put of {n} x 1 MiB, {args.calls} calls, policy {engine.tier.policy.name}; thread CPU per chunk:")
    print(f"  {per_chunk(total)}  in all")
    print(f"  {per_chunk(scanned[0])}  checksum and finite scan")
    print(f"  {per_chunk(copied)}  the copy standing in for recv_into (measured apart)")
    print(f"  {per_chunk(total - scanned[0] - copied)}  the rest: reservation, eviction, commit, listeners, session")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
