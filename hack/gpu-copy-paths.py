#!/usr/bin/env python3
"""What each way of moving a request's KV between a GPU and a node-local cache costs, on the machine it runs on
(a GPU machine: docs/gpu-lane.md, "Where a GPU's save and load go"). One size (--mb, default 256: Llama-3-8B's KV
of 2048 tokens is 256 MiB in bf16), best of --repeats, GB/s:

* device -> host into a fresh pageable tensor (what `tensor.cpu()` does: the connector's save today), into a reused
  pageable tensor, into page-locked memory (torch's pinned allocator), and into a plain tensor page-locked with
  cudaHostRegister (and that registration's one-off cost);
* host -> device from pageable and from page-locked memory;
* host memcpy (pageable -> pageable), what a copy into or out of a shared staging buffer costs;
* a Unix socket pair moving the bytes between two threads (send / recv_into), the kernel's copy that the sidecar's
  local channels pay per byte;
* CUDA IPC: another process opens the tensor's IPC handle (torch.multiprocessing) and copies it device to device
  into its own memory: what a same-GPU cache would pay instead of the two crossings of the PCIe link;
* host pages (no GPU): writing fresh anonymous memory and a fresh memfd (the sidecar's chunk memory) each first
  time, with and without transparent huge pages asked for (madvise), and mapping a filled memfd with MAP_POPULATE
  (what a client does with a lent chunk), beside the machine's THP settings: first-touch page faults are what the
  sidecar's Put and a lent Get pay per byte on a machine where they are dear.

    python3 hack/gpu-copy-paths.py [--mb 256] [--repeats 5] [--json FILE]

Needs a CUDA device (exits 2 without one). Torch alone; nothing of promptcache is imported.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

import torch
import torch.multiprocessing as mp


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _ipc_child(queue, done, repeats: int) -> None:
    t0 = time.perf_counter()
    src = queue.get()  # a CUDA tensor of the parent's, opened from its IPC handle (this process's CUDA context too)
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    opened = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    done.put((opened, min(times), bool(torch.equal(dst.view(torch.uint8)[:4096], src.view(torch.uint8)[:4096]))))
    del src
    queue.get()  # hold the handle until the parent is done


def socket_pair(nbytes: int, repeats: int) -> float:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    data = memoryview(bytearray(nbytes))
    sink = memoryview(bytearray(nbytes))
    times = []
    for _ in range(repeats):
        t = threading.Thread(target=a.sendall, args=(data,))
        t0 = time.perf_counter()
        t.start()
        got = 0
        while got < nbytes:
            got += b.recv_into(sink[got:], nbytes - got)
        t.join()
        times.append(time.perf_counter() - t0)
    a.close()
    b.close()
    return min(times)


def host_pages(n: int, repeats: int) -> dict:
    """GB/s of first touches of n fresh bytes: anonymous and memfd memory, plain and with MADV_HUGEPAGE; and of
    mapping a filled memfd with MAP_POPULATE."""
    import mmap
    import os

    def fill(mm) -> None:
        torch.frombuffer(mm, dtype=torch.uint8).fill_(1)

    def anon(huge: bool) -> None:
        mm = mmap.mmap(-1, n)
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE)
        fill(mm)
        mm.close()

    def memfd(huge: bool) -> None:
        fd = os.memfd_create("pc-probe")
        try:
            os.ftruncate(fd, n)
            mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
            if huge:
                mm.madvise(mmap.MADV_HUGEPAGE)
            fill(mm)
            mm.close()
        finally:
            os.close(fd)

    def best_host(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(n / min(times) / 1e9, 2)

    out = {}
    for name in ("enabled", "shmem_enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                out[f"thp_{name}"] = f.read().strip()
        except OSError as exc:
            out[f"thp_{name}"] = str(exc)
    out["fresh_anon_fill_GBps"] = best_host(lambda: anon(False))
    out["fresh_anon_hugepage_fill_GBps"] = best_host(lambda: anon(True))
    out["fresh_memfd_fill_GBps"] = best_host(lambda: memfd(False))
    out["fresh_memfd_hugepage_fill_GBps"] = best_host(lambda: memfd(True))
    fd = os.memfd_create("pc-probe-lent")
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n, flags=mmap.MAP_SHARED) as mm:
            fill(mm)

        def lend() -> None:
            mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ).close()

        out["map_populate_filled_memfd_GBps"] = best_host(lend)
    finally:
        os.close(fd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu-copy-paths: needs a CUDA device", file=sys.stderr)
        return 2
    n, r = args.mb << 20, args.repeats
    gb = lambda s: round(n / s / 1e9, 2)
    src = torch.randn(n // 2, device="cuda").to(torch.bfloat16)
    out = {"bytes": n, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    out["d2h_fresh_pageable_GBps"] = gb(best(lambda: src.cpu(), r))
    pageable = torch.empty(n // 2, dtype=torch.bfloat16)
    pageable.fill_(0)  # touched: no first-touch faults in the copy
    out["d2h_reused_pageable_GBps"] = gb(best(lambda: pageable.copy_(src), r))
    t0 = time.perf_counter()
    pinned = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
    out["pinned_alloc_s"] = round(time.perf_counter() - t0, 4)
    out["d2h_pinned_GBps"] = gb(best(lambda: pinned.copy_(src), r))
    registered = torch.zeros(n // 2, dtype=torch.bfloat16)
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    rc = cudart.cudaHostRegister(registered.data_ptr(), n, 0)
    out["host_register_s"] = round(time.perf_counter() - t0, 4)
    out["host_register_rc"] = int(rc) if not hasattr(rc, "value") else int(rc.value)
    out["d2h_registered_GBps"] = gb(best(lambda: registered.copy_(src), r))
    dst = torch.empty_like(src)
    out["h2d_pageable_GBps"] = gb(best(lambda: dst.copy_(pageable), r))
    out["h2d_pinned_GBps"] = gb(best(lambda: dst.copy_(pinned, non_blocking=True), r))
    out["h2d_registered_GBps"] = gb(best(lambda: dst.copy_(registered, non_blocking=True), r))
    cudart.cudaHostUnregister(registered.data_ptr())
    other = torch.empty_like(pageable)
    other.fill_(0)
    out["host_memcpy_GBps"] = gb(best(lambda: other.copy_(pageable), r))
    out["unix_socketpair_GBps"] = gb(socket_pair(n, r))
    out["d2d_same_process_GBps"] = gb(best(lambda: dst.copy_(src), r))
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(queue, done, r))
    child.start()
    queue.put(src)
    opened, copy_s, same = done.get(timeout=120)
    queue.put(None)
    child.join(60)
    out["ipc_first_open_s"] = round(opened, 4)
    out["d2d_via_ipc_handle_GBps"] = gb(copy_s)
    out["ipc_bytes_same"] = same
    del pageable, other, pinned, registered
    out.update(host_pages(n, r))
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
