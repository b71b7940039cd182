"""paged: the connector's worker-side save and load on vLLM's paged KV views (CUDA layouts) in GB/s, next to a pinned-memory copy; torch alone.

The pinned-memory copy is of the same bytes (cudaMemcpy on a GPU); no vLLM (a lent GPU machine cannot receive
vLLM's wheel).

The caches are what vLLM 0.32 hands a CUDA worker (vllm_paged.paged_views: per-layer [B, H, N, K|V] views of one
flat buffer in a KVCacheLayout; tests/vllm checks them against vLLM's allocator), filled with random bytes on the
device. Per layout and dtype, against a real sidecar process on this machine
(its tier in host memory, lending chunks, as the operator runs it by default; --sidecar-device cuda for the CUDA tier):

* save: what the connector's wait_for_save and save thread do (vllm_paged.gather of the request's scattered blocks
  on the device, the copy to host as chunks through the connector's page-locked staging buffer, Put);
* load: what its load thread does (Get over the bulk channel keeping lent chunks, client.checked_chunks,
  vllm_paged.scatter_chunks into a second, empty set of caches, each chunk to the device through the connector's
  page-locked load buffer, staging.uploads, synchronized); and, as the baseline, the same chunks copied to the
  device from where they are (pageable memory) into a third set, timed apart;
* then every loaded byte is compared with the saved blocks; and the same number of bytes copied host -> device and
  device -> host from pinned memory (best of --repeats), with the link's nominal limit where sysfs tells it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when there is one)")
    p.add_argument("--layouts", default="LBNHC,LBHNC", help="comma-separated vLLM KVCacheLayout names")
    p.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated KV dtypes")
    p.add_argument("--tokens", type=int, default=2048, help="tokens saved and loaded per case (whole chunks)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="vLLM's block size (CUDA's default is 16)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="the sidecar's --chunk-tokens")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per case (best is reported)")
    p.add_argument("--sidecar-device", default="cpu",
                   help="the sidecar's --device: cpu (default: what the operator runs unless spec.gpu.count is set, "
                        "a host memory tier that lends chunks), cuda (the opt-in CUDA tier), or auto")
    p.add_argument("--json", default="", help="write the results here")


def link_limit(device_index: int = 0) -> dict:
    """The GPU's PCIe link from sysfs (current speed and width) and its nominal one-way limit in GB/s, or why not."""
    import torch

    try:
        props = torch.cuda.get_device_properties(device_index)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        base = Path("/sys/bus/pci/devices") / bus
        speed = (base / "current_link_speed").read_text().strip()  # e.g. "32.0 GT/s PCIe"
        width = int((base / "current_link_width").read_text().strip())
        gts = float(speed.split()[0])
        per_lane = gts * (128 / 130 if gts >= 8 else 0.8) / 8  # GB/s per lane after line coding
        return {"pci": bus, "speed": speed, "width": width, "limit_GBps": round(per_lane * width, 1)}
    except Exception as exc:  # noqa: BLE001 - a figure we cannot read is reported as such
        return {"unknown": str(exc)}


def _bits(t):
    import torch

    return t.contiguous().view(torch.uint8)


def run(args) -> int:
    import torch

    from promptcache.client import PromptCacheClient, vllm_paged
    from promptcache.client.client import checked_chunks
    from promptcache.client.staging import DEFAULT_CAPACITY, HostStaging
    from promptcache.contract.keys import ModelSpec
    from promptcache.contract.layout import TORCH_DTYPES
    from promptcache_devtools.procs import free_port, stop_process, wait_healthy

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    L, H, D, N, T, ct = args.layers, args.kv_heads, args.head_dim, args.block_size, args.tokens, args.chunk_tokens
    if T % ct or ct % N:
        raise SystemExit(f"--tokens {T} must be whole chunks of {ct}, and a chunk whole blocks of {N}")
    layouts, dtypes = args.layouts.split(","), args.dtypes.split(",")
    nb = T // N
    per_case = L * 2 * H * T * D * 4 * args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="pc-bench-paged-"))
    address, bulk = f"127.0.0.1:{free_port()}", f"unix:{tmp}/bulk.sock"
    sidecar = subprocess.Popen([sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", address,
                                "--metrics-port", str(free_port()), "--chunk-tokens", str(ct),
                                "--memory-bytes", str(per_case * len(layouts) * len(dtypes) + (256 << 20)),
                                "--bulk-address", bulk, "--data-dir", str(tmp / "data"), "--disk-bytes", "0",
                                "--device", args.sidecar_device],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = {"device": device, "sidecar_device": args.sidecar_device,
              "device_name": torch.cuda.get_device_name(dev) if cuda else "cpu",
              "torch": torch.__version__, "shape": {"layers": L, "kv_heads": H, "head_dim": D, "block_size": N,
                                                      "tokens": T, "chunk_tokens": ct}, "rows": []}
    ok = True
    try:
        wait_healthy(address, sidecar, 60, lambda: "")
        client = PromptCacheClient(address, bulk_address=bulk, timeout=120)
        staging = HostStaging(DEFAULT_CAPACITY)  # the connector's two, at their default size
        load_staging = HostStaging(DEFAULT_CAPACITY)
        for layout in layouts:
            for dtype_name in dtypes:
                dtype = TORCH_DTYPES[dtype_name]
                g = torch.Generator().manual_seed(zlib.crc32(f"{layout}-{dtype_name}".encode()))
                blocks = nb * 2 + 3  # the request's blocks scattered over twice as many
                src = vllm_paged.paged_views(layout, L, blocks, H, N, 2 * D, dtype, dev)
                dst = vllm_paged.paged_views(layout, L, blocks, H, N, 2 * D, dtype, dev)
                dst_plain = vllm_paged.paged_views(layout, L, blocks, H, N, 2 * D, dtype, dev)
                gd = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{layout}-{dtype_name}".encode()))
                for v in src:  # every block, those not saved too (finite: the load path's checks refuse NaN)
                    v.copy_(torch.randn(v.shape, generator=gd, device=dev).to(dtype))
                ids = torch.randperm(blocks, generator=g)[:nb].tolist()
                p = vllm_paged.plan(src, block_size=N, num_kv_heads=H, head_size=D, engine_layout=layout)
                spec = ModelSpec("bench/paged", f"{layout}-{dtype_name}", dtype_name, L, H, D)
                prompts = [(torch.randperm(50000, generator=g)[:T] + 1).tolist() for _ in range(args.repeats)]
                nbytes = L * 2 * H * T * D * torch.empty((), dtype=dtype).element_size()
                saves, loads, gathers, scatters, to_host, puts, gets = [], [], [], [], [], [], []
                pageable_scatters = []
                staged0, load_staged0 = staging.staged, load_staging.staged
                for tokens in prompts:  # a new prompt each time: every save stores, none is skipped as stored
                    sync()
                    t0 = time.perf_counter()
                    kv = vllm_paged.gather(src, p, ids)
                    sync()
                    t1 = time.perf_counter()
                    copying = putting = 0.0
                    for part in staging.parts(kv, ct):  # the connector's save: its staging, then Put, by parts
                        tp = time.perf_counter()
                        with staging.chunks(kv[:, :, :, part], ct) as chunks:
                            t1h = time.perf_counter()
                            client.put_blobs(spec, tokens, {part.start // ct + i: c for i, c in enumerate(chunks)},
                                             timeout=120)
                        copying += t1h - tp
                        putting += time.perf_counter() - t1h
                    t2 = time.perf_counter()
                    saves.append(t2 - t0)
                    gathers.append(t1 - t0)
                    to_host.append(copying)
                    puts.append(putting)
                    for v in dst:
                        v.zero_()
                    sync()
                    t3 = time.perf_counter()
                    blobs = client.get_blobs(spec, tokens, keep_sealed=True, timeout=120)
                    got = checked_chunks(spec, blobs, ct)
                    t4 = time.perf_counter()
                    with load_staging.uploads(got, dev) as upload:  # the connector's load: its staging
                        vllm_paged.scatter_chunks(dst, p, got, 0, ids, upload)
                    sync()
                    t5 = time.perf_counter()
                    loads.append(t5 - t3)
                    scatters.append(t5 - t4)
                    gets.append(t4 - t3)
                    # The baseline: the same chunks copied to the device from where they are (pageable), into
                    # other caches.
                    for v in dst_plain:
                        v.zero_()
                    sync()
                    t6 = time.perf_counter()
                    vllm_paged.scatter_chunks(dst_plain, p, got, 0, ids)
                    sync()
                    pageable_scatters.append(time.perf_counter() - t6)
                    if len(got) * ct != T:
                        raise RuntimeError(f"{len(got)} chunks of {T // ct} came back")
                index = torch.tensor(ids, device=dev)
                exact = all(torch.equal(_bits(a.index_select(0, index)), _bits(b.index_select(0, index)))
                            and torch.equal(_bits(a.index_select(0, index)), _bits(c.index_select(0, index)))
                            for a, b, c in zip(src, dst, dst_plain))
                exact = exact and torch.equal(_bits(vllm_paged.gather(dst, p, ids).cpu()), _bits(kv.cpu()))
                ok &= exact
                row = {"layout": layout, "dtype": dtype_name, "bytes": nbytes, "bit_exact": exact,
                       "save_GBps": round(nbytes / min(saves) / 1e9, 2),
                       "load_GBps": round(nbytes / min(loads) / 1e9, 2),
                       "gather_on_device_GBps": round(nbytes / min(gathers) / 1e9, 2),
                       "scatter_incl_host_to_device_GBps": round(nbytes / min(scatters) / 1e9, 2),
                       # the save's parts after the gather, and the load's before the scatter
                       "copy_to_host_GBps": round(nbytes / min(to_host) / 1e9, 2),
                       "staged": staging.staged - staged0, "pinned": staging.pinned,
                       "put_GBps": round(nbytes / min(puts) / 1e9, 2),
                       "get_and_check_GBps": round(nbytes / min(gets) / 1e9, 2),
                       "load_staged": load_staging.staged - load_staged0, "load_pinned": load_staging.pinned,
                       "scatter_pageable_GBps": round(nbytes / min(pageable_scatters) / 1e9, 2),
                       "save_s": saves, "load_s": loads}
                result["rows"].append(row)
                print(f"{layout} {dtype_name}: save {row['save_GBps']} GB/s (copy to host {row['copy_to_host_GBps']}"
                      f"{' pinned' if staging.pinned else ''}, Put {row['put_GBps']}), load {row['load_GBps']} GB/s "
                      f"(Get and checks {row['get_and_check_GBps']}, scatter incl. host->device "
                      f"{row['scatter_incl_host_to_device_GBps']}{' pinned' if load_staging.pinned else ''}; "
                      f"from pageable memory {row['scatter_pageable_GBps']}), "
                      f"bit-exact {exact}", flush=True)
                del src, dst, dst_plain, kv
        client.close()
        nbytes = L * 2 * H * T * D * 2
        if cuda:
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            h2d, d2h = [], []
            for _ in range(max(args.repeats, 3)):
                sync()
                t0 = time.perf_counter()
                devbuf.copy_(pinned, non_blocking=True)
                sync()
                t1 = time.perf_counter()
                pinned.copy_(devbuf, non_blocking=True)
                sync()
                h2d.append(t1 - t0)
                d2h.append(time.perf_counter() - t1)
            result["pinned_memcpy"] = {"bytes": nbytes, "host_to_device_GBps": round(nbytes / min(h2d) / 1e9, 2),
                                       "device_to_host_GBps": round(nbytes / min(d2h) / 1e9, 2)}
            result["link"] = link_limit(dev.index or 0)
        else:
            result["pinned_memcpy"] = "skipped: no CUDA device"
            result["link"] = "skipped: no CUDA device"
    finally:
        stop_process(sidecar)
    result["load_average"] = os.getloadavg()[0]
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1
