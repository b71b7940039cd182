"""Disk-tier measurement: `python -m promptcache_devtools.bench.disk [--repeats N]` - codec ratio and throughput
on KV bytes, and disk-tier Get throughput as a ratio of an in-memory Get of the same bytes. Used to pick the
disk tier's DEFAULT_CODEC (promptcache.sidecar.disk)."""
from __future__ import annotations

import logging
import os
import time

from promptcache.sidecar.disk import CODECS, DiskTier

log = logging.getLogger("promptcache_devtools.bench.disk")



def real_kv_chunks(n_tokens: int = 1024, chunk_tokens: int = 256):
    """KV of SmolLM2-135M over offline English text, as [layers, 2, kv_heads, chunk_tokens, head_dim] float32
    chunks (None when the model is not available here)."""
    import torch

    try:
        from promptcache_devtools import models

        model, tok = models.load_smollm2("float32")
        ids = torch.tensor([models.text_tokens(tok, n_tokens)])
    except Exception as exc:  # no model on this machine
        log.warning("real KV unavailable (%s); synthetic only", exc)
        return None
    with torch.no_grad():
        out = model(ids, use_cache=True)
    pkv = out.past_key_values
    layers = []
    for i in range(len(pkv.layers) if hasattr(pkv, "layers") else len(pkv)):
        k, v = (pkv.layers[i].keys, pkv.layers[i].values) if hasattr(pkv, "layers") else pkv[i]
        layers.append(torch.stack([k[0], v[0]]))  # [2, heads, tokens, dim]
    kv = torch.stack(layers)  # [layers, 2, heads, tokens, dim]
    return [kv[:, :, :, s:s + chunk_tokens].contiguous() for s in range(0, n_tokens, chunk_tokens)]


def synthetic_kv_chunks(n: int = 4, shape=(30, 2, 3, 256, 64), seed: int = 0):
    """Gaussian KV with per-channel scales (log-normal) and a few outlier channels, as real K caches show."""
    import torch

    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(shape[0], shape[1], shape[2], 1, shape[4], generator=g) * 0.7)
    outliers = torch.rand(shape[0], shape[1], shape[2], 1, shape[4], generator=g) < 0.03
    scale = torch.where(outliers, scale * 12, scale)
    return [torch.randn(*shape, generator=g) * scale for _ in range(n)]


def measure(chunks_by_source: dict, repeats: int = 4, workdir: str | None = None) -> list[dict]:
    import tempfile

    import torch

    rows = []
    for source, chunks in chunks_by_source.items():
        for dtype in (torch.float16, torch.bfloat16):
            payloads = [c.to(dtype).contiguous().view(torch.uint8).numpy().tobytes() for c in chunks]
            total = sum(len(p) for p in payloads) * repeats
            # memory tier Get: hand out a copy of the stored bytes (what a Get from host memory costs)
            mem_s = float("inf")
            for _ in range(3):  # best of three passes
                t0 = time.perf_counter()
                for _ in range(repeats):
                    for p in payloads:
                        bytearray(p)
                mem_s = min(mem_s, time.perf_counter() - t0)
            for codec in CODECS:
                with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                    d = DiskTier(os.path.join(tmp, "db"), 8 << 30, compression=codec, min_free_bytes=0,
                                 max_queue_bytes=1 << 34, max_queue_items=1 << 20)
                    keys = []
                    t0 = time.perf_counter()
                    for r in range(repeats):
                        for i, p in enumerate(payloads):
                            key = r.to_bytes(4, "big") + i.to_bytes(28, "big")
                            keys.append((key, p))
                            d.put(key, p)
                    d.flush(None)
                    d._db.flush()
                    put_s = time.perf_counter() - t0
                    d.close()
                    files = os.listdir(os.path.join(tmp, "db"))
                    blob = sum(os.path.getsize(os.path.join(tmp, "db", f)) for f in files if f.endswith(".blob"))
                    d = DiskTier(os.path.join(tmp, "db"), 8 << 30, compression=codec, min_free_bytes=0)
                    get_s = float("inf")
                    for _ in range(3):  # best of three passes (the first one also warms the page cache)
                        t0 = time.perf_counter()
                        for key, p in keys:
                            got = d.get(key)
                            assert got is not None and len(got) == len(p)
                        get_s = min(get_s, time.perf_counter() - t0)
                    ok = all(d.get(k) == p for k, p in keys[: len(payloads)])
                    d.close()
                rows.append({"source": source, "dtype": str(dtype).split(".")[-1], "codec": codec,
                             "ratio": total / blob if blob else float("nan"), "put_MBps": total / put_s / 1e6,
                             "get_MBps": total / get_s / 1e6, "mem_get_MBps": total / mem_s / 1e6,
                             "disk_vs_mem_get": mem_s / get_s, "bit_identical": ok,
                             "chunk_bytes": len(payloads[0])})
    return rows


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m promptcache_devtools.bench.disk",
                                 description="Measure disk-tier codecs and Get throughput on KV bytes.")
    ap.add_argument("--repeats", type=int, default=4, help="each chunk is stored this many times (default 4)")
    ap.add_argument("--no-real", action="store_true", help="skip the real SmolLM2 KV")
    ap.add_argument("--workdir", help="where the temporary databases go (default: system temp)")
    args = ap.parse_args(argv)
    sources = {}
    real = None if args.no_real else real_kv_chunks()
    if real is not None:
        sources["smollm2-135m real KV"] = real
    sources["synthetic KV"] = synthetic_kv_chunks(n=4, shape=tuple(real[0].shape) if real else (30, 2, 3, 256, 64))
    rows = measure(sources, repeats=args.repeats, workdir=args.workdir)
    print("| KV bytes | dtype | codec | ratio | put MB/s | get MB/s | disk Get / memory Get | bit-identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['dtype']} | {r['codec']} | {r['ratio']:.3f} | {r['put_MBps']:.0f} | "
              f"{r['get_MBps']:.0f} | {r['disk_vs_mem_get']:.3f} | {r['bit_identical']} |")
    print(f"\nchunk = {rows[0]['chunk_bytes']} bytes (256 tokens), {args.repeats} copies of each chunk; "
          "memory Get = copy of the same bytes in process; Get rates are the best of three passes "
          "(page cache warm), put rates include the final flush")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
