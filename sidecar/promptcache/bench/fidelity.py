"""fidelity: cached-prefix reuse vs full prefill per quantization mode, on SmolLM2-135M over real English text.

For each window of the text (prefix P tokens + suffix S tokens): one full prefill gives the reference logits of the S
suffix positions and the prefix K/V. The prefix K/V are then stored in a sidecar (a real gRPC server on loopback,
started in this process) in each mode, fetched back through PromptCacheHF (Lookup + Get + decode + checks), and the
suffix is run on top of them. Reported per mode: max |logit difference|, top-1 next-token agreement, perplexity of
the suffix (full vs reused) and its relative change, bytes per token stored, compression versus fp16.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default="none,k8v8,k8v4", help="comma-separated quantization modes")
    p.add_argument("--prefix", type=int, default=512, help="prefix tokens per window (whole chunks)")
    p.add_argument("--suffix", type=int, default=256, help="suffix tokens per window (positions scored)")
    p.add_argument("--windows", type=int, default=4, help="windows of the text (positions = windows * suffix)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: one core per model stream; 0: torch's default, all cores)")
    p.add_argument("--json", default="", help="also write the results as JSON to this file")


def evaluate(model, tokens: list[int], *, modes, prefix: int, suffix: int, windows: int, chunk_tokens: int,
             revision: str = "", log=print) -> dict:
    """Run the comparison; returns {mode: metrics}."""
    import dataclasses

    import torch

    from promptcache.client import PromptCacheClient
    from promptcache.client.hf import PromptCacheHF, cache_kv, cache_kwargs, output_cache
    from promptcache.layout import chunk_nbytes
    from promptcache.sidecar.config import Settings
    from promptcache.sidecar.server import Sidecar

    if prefix % chunk_tokens:
        raise ValueError(f"--prefix {prefix} must be a multiple of --chunk-tokens {chunk_tokens}")
    span = prefix + suffix + 1
    if windows * span > len(tokens):
        raise ValueError(f"{windows} windows of {span} tokens need {windows * span}; the text has {len(tokens)}")
    settings = dataclasses.replace(Settings(), grpc_address="127.0.0.1:0", metrics_port=0, chunk_tokens=chunk_tokens,
                                   memory_bytes=4 << 30, log_level="warning")
    sidecar = Sidecar(settings).start()
    stats = {m: {"nll_full": 0.0, "nll_cached": 0.0, "agree": 0, "positions": 0, "max_abs": 0.0,
                 "cached_tokens": 0} for m in modes}
    try:
        client = PromptCacheClient(sidecar.address, timeout=60)
        hfs = {m: PromptCacheHF(model, client, quantization=m, revision=revision, fetch_timeout=60) for m in modes}
        for w in range(windows):
            window = tokens[w * span:(w + 1) * span]
            ids = torch.tensor([window[:-1]])
            targets = torch.tensor(window[prefix + 1:])
            t0 = time.perf_counter()
            with torch.inference_mode():
                full = model(input_ids=ids, use_cache=True)
            ref = full.logits[0, prefix:].float()
            kv = [(k[..., :prefix, :], v[..., :prefix, :]) for k, v in cache_kv(output_cache(full))]
            nll_full = torch.nn.functional.cross_entropy(ref, targets, reduction="sum").item()
            log(f"  window {w}: full prefill of {ids.shape[1]} tokens {time.perf_counter() - t0:.1f}s")
            for m in modes:
                pc = hfs[m]
                client.put(pc.spec, window[:prefix], kv)
                t1 = time.perf_counter()
                got = pc.fetch(ids[:, :prefix + 1])
                if got.fallback or got.cached_tokens != prefix:
                    raise RuntimeError(f"mode {m}: expected {prefix} cached tokens, got {got}")
                with torch.inference_mode():
                    out = model(input_ids=ids[:, prefix:], use_cache=True, **cache_kwargs(model, got.cache))
                logits = out.logits[0].float()
                s = stats[m]
                s["max_abs"] = max(s["max_abs"], (logits - ref).abs().max().item())
                s["agree"] += int((logits.argmax(-1) == ref.argmax(-1)).sum())
                s["positions"] += len(targets)
                s["nll_full"] += nll_full
                s["nll_cached"] += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
                s["cached_tokens"] += got.cached_tokens
                log(f"    {m}: reuse + suffix {time.perf_counter() - t1:.1f}s, max|dlogit| so far {s['max_abs']:.4g}")
        results = {}
        for m in modes:
            s = stats[m]
            spec = hfs[m].spec
            bpt = chunk_nbytes(spec, chunk_tokens) / chunk_tokens
            fp16_bpt = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
            ppl_full = math.exp(s["nll_full"] / s["positions"])
            ppl_cached = math.exp(s["nll_cached"] / s["positions"])
            results[m] = {
                "positions": s["positions"], "max_abs_logit_diff": s["max_abs"],
                "top1_agreement": s["agree"] / s["positions"], "ppl_full": ppl_full, "ppl_cached": ppl_cached,
                "ppl_change": ppl_cached / ppl_full - 1, "bytes_per_token": bpt, "compression_vs_fp16": fp16_bpt / bpt,
            }
        client.close()
        return results
    finally:
        sidecar.stop(0)


def format_table(results: dict, kv_dtype: str) -> str:
    lines = [f"| mode | positions | max abs logit diff | top-1 agreement | ppl full | ppl reused | ppl change "
             f"| bytes/token | vs fp16 |", "|---|---|---|---|---|---|---|---|---|"]
    for m, r in results.items():
        label = f"none ({kv_dtype})" if m == "none" else m
        lines.append(f"| {label} | {r['positions']} | {r['max_abs_logit_diff']:.4g} | {100 * r['top1_agreement']:.2f} % "
                     f"| {r['ppl_full']:.4f} | {r['ppl_cached']:.4f} | {100 * r['ppl_change']:+.3f} % "
                     f"| {r['bytes_per_token']:.0f} | {r['compression_vs_fp16']:.3f}x |")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    from promptcache import models

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    t = time.perf_counter()
    model, tok = models.load_smollm2(args.dtype)
    tokens = models.text_tokens(tok)
    print(f"SmolLM2-135M-Instruct ({args.dtype}) loaded in {time.perf_counter() - t:.1f}s; text: {len(tokens)} tokens "
          f"of {', '.join(models.LICENSE_FILES)} from {models.LICENSE_DIR}; {args.windows} windows of "
          f"{args.prefix} prefix + {args.suffix} suffix tokens, chunk {args.chunk_tokens}", flush=True)
    results = evaluate(model, tokens, modes=modes, prefix=args.prefix, suffix=args.suffix, windows=args.windows,
                       chunk_tokens=args.chunk_tokens, revision=models.model_revision(),
                       log=lambda s: print(s, flush=True))
    print()
    print(format_table(results, args.dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"bench_run": None}, "results": results}, f, indent=2, default=str)
    ok = True
    if "k8v4" in results:
        r = results["k8v4"]
        checks = {"compression >= 2.6x": r["compression_vs_fp16"] >= 2.6, "top-1 >= 99 %": r["top1_agreement"] >= 0.99,
                  "ppl increase <= 1 %": r["ppl_change"] <= 0.01}
        print("k8v4 targets: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items()))
    if "none" in results:
        print(f"none: max abs logit diff {results['none']['max_abs_logit_diff']} (target exactly 0.0)")
        ok = results["none"]["max_abs_logit_diff"] == 0.0
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    sys.exit(run(p.parse_args()))
