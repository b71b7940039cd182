"""loadpath: the vLLM connector's load path in GB/s, next to memcpy of the same bytes in the same run; no vLLM needed.

A real sidecar process (bulk channel on a unix socket, so it lends chunks as sealed memfds), the real client and the
connector's own functions: Get over the bulk channel keeping lent chunks as they are (get_blobs keep_sealed), the
checks (client.checked_chunks: lengths, finite values), and the layout conversion straight into per-layer caches
shaped like vLLM's CPU backend ([blocks, kv_heads, block_size, 2 * head_dim], block size 128) with
vllm_layout.write_chunks. The model shape defaults to SmolLM2-135M's (30 layers, 3 KV heads, head dim 64).

For each dtype and prefix length: the first load (the memfds are mapped and every chunk is scanned) and the best of
`--repeats` more (the mappings are reused and chunks already found finite are not scanned again: what a prefix shared
by many requests costs), split into fetch / check / write; memcpy is a copy of the same number of bytes into a
destination that was written before (as the engine's cache was), best of as many. Every load is compared bit for bit
with what was stored.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="1024,2048,4096", help="comma-separated cached prefix lengths")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated KV dtypes")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's block size (the CPU backend's is 128)")
    p.add_argument("--layout", default="auto", help="cpu_vec, cpu_amx, token_major, or auto: what vLLM's CPU "
                                                    "backend uses here (cpu_amx for bf16 on an AMX CPU)")
    p.add_argument("--repeats", type=int, default=7, help="loads after the first (best is reported)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads, as the engine sets them (0: "
                                                          "torch's default)")
    p.add_argument("--json", default="", help="write every sample here")


def _amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def run(args) -> int:
    import torch

    from promptcache.client import vllm_layout
    from promptcache.client import PromptCacheClient
    from promptcache.client.client import checked_chunks
    from promptcache.contract.keys import ModelSpec
    from promptcache.contract.layout import TORCH_DTYPES
    from promptcache_devtools.procs import free_port, stop_process, wait_healthy

    if args.threads:
        torch.set_num_threads(args.threads)
    L, H, D, N = args.layers, args.kv_heads, args.head_dim, args.block_size
    lengths = [int(x) for x in args.tokens.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="pc-bench-loadpath-"))
    address = f"127.0.0.1:{free_port()}"
    bulk = f"unix:{tmp}/bulk.sock"
    need = sum(lengths) * 2 * L * H * D * 4 * len(args.dtypes.split(","))
    sidecar = subprocess.Popen([sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", address,
                                "--metrics-port", "0", "--memory-bytes", str(need + (256 << 20)),
                                "--bulk-address", bulk, "--data-dir", str(tmp / "data"), "--disk-bytes", "0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows, samples = [], []
    try:
        wait_healthy(address, sidecar, 60, lambda: "")
        client = PromptCacheClient(address, bulk_address=bulk, timeout=60)
        ct = client.chunk_tokens
        for dtype_name in args.dtypes.split(","):
            dtype = TORCH_DTYPES[dtype_name]
            layout = args.layout
            if layout == "auto":
                layout = "cpu_amx" if dtype == torch.bfloat16 and _amx() else "cpu_vec"
            spec = ModelSpec("bench/loadpath", "rev-1", dtype_name, num_layers=L, num_kv_heads=H, head_dim=D)
            for n in lengths:
                g = torch.Generator().manual_seed(n)
                kv = torch.randn(L, 2, H, n, D, generator=g).to(dtype)
                tokens = (torch.randperm(50000, generator=g)[:n] + 1).tolist()
                client.put(spec, tokens, [(kv[i, 0][None], kv[i, 1][None]) for i in range(L)])
                nbytes = kv.numel() * kv.element_size()
                blocks = n // N
                ids = list(range(1, 1 + blocks))
                caches = [torch.zeros(blocks + 2, H, 2 * N * D, dtype=dtype) for _ in range(L)]

                cpu = []  # per load: this thread's CPU seconds of fetch, check, write (a shared machine's figure)

                def load() -> tuple[float, float, float]:
                    c0, t0 = time.thread_time(), time.perf_counter()
                    blobs = client.get_blobs(spec, tokens, keep_sealed=True)
                    c1, t1 = time.thread_time(), time.perf_counter()
                    chunks = checked_chunks(spec, blobs, ct)
                    c2, t2 = time.thread_time(), time.perf_counter()
                    vllm_layout.write_chunks(caches, chunks, 0, ids, layout, N)
                    c3, t3 = time.thread_time(), time.perf_counter()
                    if len(blobs) * ct != n:
                        raise RuntimeError(f"{len(blobs)} chunks of {n // ct} came back")
                    cpu.append((c1 - c0, c2 - c1, c3 - c2))
                    return t1 - t0, t2 - t1, t3 - t2

                first = load()
                out = torch.empty(L, 2, H, n, D, dtype=dtype)
                for i in range(L):
                    vllm_layout.read_layer(caches[i][ids], out[i], layout, N)
                if not torch.equal(out.view(torch.uint8), kv.view(torch.uint8)):
                    raise RuntimeError(f"{dtype_name} {n} tokens: the blocks do not hold the stored bytes")
                warm = [load() for _ in range(args.repeats)]
                best = min(warm, key=sum)
                best_cpu = min(cpu[1:], key=sum)
                src = kv.reshape(-1).view(torch.uint8)
                dst = torch.zeros_like(src)
                copies, copies_cpu = [], []
                for _ in range(args.repeats + 1):
                    c, t = time.thread_time(), time.perf_counter()
                    dst.copy_(src)
                    copies.append(time.perf_counter() - t)
                    copies_cpu.append(time.thread_time() - c)
                memcpy = min(copies)
                rows.append((dtype_name, layout, n, nbytes, first, best, memcpy, best_cpu, min(copies_cpu)))
                samples.append({"dtype": dtype_name, "layout": layout, "tokens": n, "bytes": nbytes, "first": first,
                                "warm": warm, "memcpy": copies, "warm_cpu": cpu[1:], "memcpy_cpu": copies_cpu})
                print(f"{dtype_name} {n}: first {nbytes / sum(first) / 1e9:.2f} GB/s, "
                      f"then {nbytes / sum(best) / 1e9:.2f} GB/s, memcpy {nbytes / memcpy / 1e9:.2f} GB/s", flush=True)
        client.close()
    finally:
        stop_process(sidecar)

    print(f"\nLoad path: Get (bulk channel, unix socket, lent chunks) + checks + layout conversion into vLLM-shaped "
          f"CPU caches; {L} layers, {H} KV heads, head dim {D}, block size {N}, chunk {ct} tokens, {torch.get_num_threads()} "
          f"torch threads; load average {os.getloadavg()[0]:.2f}. Wall-clock GB/s, then the same from this thread's "
          f"CPU time (steadier on a shared machine; the sidecar's side of the fetch is not in it)\n")
    print("| dtype | layout | tokens | MB | first load | fetch / check / write | repeat load | fetch / check / write "
          "| memcpy | repeat / memcpy | CPU: repeat load | CPU: write | CPU: memcpy | CPU: repeat / memcpy "
          "| CPU: write / memcpy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype_name, layout, n, nbytes, first, best, memcpy, best_cpu, memcpy_cpu in rows:
        split = lambda parts: " / ".join(f"{100 * p / sum(parts):.0f}%" for p in parts)  # noqa: E731
        print(f"| {dtype_name} | {layout} | {n} | {nbytes / 1e6:.1f} | {nbytes / sum(first) / 1e9:.2f} GB/s "
              f"| {split(first)} | {nbytes / sum(best) / 1e9:.2f} GB/s | {split(best)} "
              f"| {nbytes / memcpy / 1e9:.2f} GB/s | {memcpy / sum(best):.2f}x "
              f"| {nbytes / sum(best_cpu) / 1e9:.2f} GB/s | {nbytes / best_cpu[2] / 1e9:.2f} GB/s "
              f"| {nbytes / memcpy_cpu / 1e9:.2f} GB/s | {memcpy_cpu / sum(best_cpu):.2f}x "
              f"| {memcpy_cpu / best_cpu[2]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(samples, indent=1))
    return 0
