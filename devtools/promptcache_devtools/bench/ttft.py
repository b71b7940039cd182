"""ttft: time to first token with and without prefix reuse, on SmolLM2-135M over real English text.

For each prefix length (default 512, 1k, 2k, 4k tokens) plus a 64-token suffix, TTFT (prompt in -> first token's
logits and argmax out) for (a) a full prefill of prefix + suffix, (b) reuse of the prefix through a sidecar *process*
over gRPC (Lookup + Get + decode + checks + DynamicCache, then the suffix), per quantization mode, and (c) reuse from an
in-process cache that holds the prefix's K/V tensors (no transfer, no decode: the floor; the tensors are still copied
into a fresh DynamicCache, as every reuse must). The variants run interleaved, round by round; the best of the rounds
is reported (this machine is shared; medians and every sample go to --json). Ratios: full/(b) and (b)/(c).

--device cuda runs the model on the GPU and gives the sidecar a CUDA device tier (--sidecar-device cpu: a host
tier, what the operator runs by default; --bulk: the client also uses the bulk channel, as a pod beside its
sidecar does). --model smollm2-random is a randomly initialised model of SmolLM2-135M's shape over seeded random
tokens (nothing to load: for machines the GGUF cannot reach; its timings are the real model's, its text is noise);
--model tiny is a 2-layer toy for smoke runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefixes", default="512,1024,2048,4096", help="comma-separated prefix lengths in tokens")
    p.add_argument("--suffix", type=int, default=64, help="tokens after the cached prefix")
    p.add_argument("--modes", default="none,k8v8,k8v4,k6v4z", help="comma-separated quantization modes")
    p.add_argument("--repeats", type=int, default=7, help="interleaved runs per reuse measurement (best is reported)")
    p.add_argument("--full-repeats", type=int, default=2, help="interleaved runs per full-prefill measurement")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--transport", choices=["unix", "tcp"], default="unix", help="how the client reaches the sidecar")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: one core per model stream; 0: torch's default, all cores)")
    p.add_argument("--device", default="cpu", help="where the model runs and the sidecar's tier lives: cpu, cuda, "
                   "cuda:N")
    p.add_argument("--sidecar-device", default="",
                   help="the sidecar's tier apart from the model's device: cpu (what the operator runs unless "
                        "spec.gpu.count is set) or cuda (default: --device)")
    p.add_argument("--bulk", action="store_true",
                   help="the client also uses the sidecar's bulk channel on a Unix socket (lent chunks with a host "
                        "tier), as a pod beside its sidecar does; with --transport unix")
    p.add_argument("--model", default="smollm2", choices=list(MODELS),
                   help="smollm2: the real weights and English text; smollm2-random: its shape, random weights and "
                   "tokens; tiny: a 2-layer toy")
    p.add_argument("--plot", default="", help="write a PNG of TTFT vs prefix length here (needs matplotlib)")
    p.add_argument("--json", default="", help="also write the results as JSON to this file")


class SidecarProcess:
    """`promptcache serve` in a child process (as in a pod: a separate process), on a unix socket or TCP port."""

    def __init__(self, transport: str, chunk_tokens: int, memory_bytes: int, device: str = "cpu", bulk: bool = False):
        self.tmp = tempfile.mkdtemp(prefix="promptcache-ttft-")
        self.bulk_address = f"unix:{self.tmp}/bulk.sock" if bulk else None
        if transport == "unix":
            self.address = f"unix://{self.tmp}/sidecar.sock"
            listen = f"unix:{self.tmp}/sidecar.sock"
        else:
            from promptcache_devtools.procs import free_port

            self.address = listen = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", listen, "--metrics-port", "0",
               "--memory-bytes", str(memory_bytes), "--chunk-tokens", str(chunk_tokens), "--device", device,
               "--data-dir", self.tmp, "--log-level", "warning"] + \
            (["--bulk-address", self.bulk_address] if bulk else [])
        self.log = open(os.path.join(self.tmp, "sidecar.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> "SidecarProcess":
        from promptcache_devtools.procs import wait_healthy

        wait_healthy(self.address, self.proc, timeout, lambda: f"; log in {self.log.name}")
        return self

    def stop(self) -> None:
        from promptcache_devtools.procs import stop_process

        stop_process(self.proc)
        self.log.close()
        if self.proc.returncode in (0, -15):  # keep the folder (and its sidecar.log) when the sidecar failed
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)


def measure(model, tokens: list[int], *, prefixes, suffix, modes, repeats, full_repeats, address, revision="",
            chunk_tokens: int = 256, log=print, bulk_address: str | None = None) -> list[dict]:
    """(On CUDA every variant ends in .argmax() read back to the host, which waits for the GPU: the times are
    complete.)"""
    """TTFTs per prefix length. The variants are interleaved round by round (full, floor, each mode), so that load
    from other processes hits them alike; the best of the rounds is reported (the median is kept in the JSON)."""
    import torch

    from promptcache.client import PromptCacheClient
    from promptcache.client.hf import PromptCacheHF, cache_kv, cache_kwargs, make_cache, output_cache

    client = PromptCacheClient(address, timeout=120, bulk_address=bulk_address)
    hfs = {m: PromptCacheHF(model, client, quantization=m, revision=revision, fetch_timeout=120) for m in modes}
    rows = []
    for p in prefixes:
        ids = torch.tensor([tokens[:p + suffix]], device=model.device)
        with torch.inference_mode():  # the prefix K/V, stored in every mode (what a first request's store does)
            cache = output_cache(model(input_ids=ids[:, :p], use_cache=True, logits_to_keep=1))
        prefix_kv = [(k.clone(), v.clone()) for k, v in cache_kv(cache)]
        del cache
        for m in modes:
            client.put(hfs[m].spec, tokens[:p], prefix_kv, rope_theta=hfs[m].rope_theta)

        @torch.inference_mode()
        def full():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax()), 0.0

        @torch.inference_mode()
        def floor():
            c = make_cache(model, prefix_kv)
            out = model(input_ids=ids[:, p:], use_cache=True, logits_to_keep=1, **cache_kwargs(model, c))
            return int(out.logits[0, -1].argmax()), 0.0

        def reuse(m):
            def fn():
                res = hfs[m].prefill(ids, store=False)
                if res.cached_tokens != p:
                    raise RuntimeError(f"mode {m}: {res.cached_tokens} tokens reused, expected {p} ({res.fallback})")
                return int(res.logits[0, -1].argmax()), res.fetch_seconds
            return fn

        variants = {"full": full, "floor": floor, **{m: reuse(m) for m in modes}}
        samples = {k: [] for k in variants}
        names = list(variants)
        for r in range(max(repeats, full_repeats)):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order every round
                fn = variants[name]
                if r >= (full_repeats if name == "full" else repeats):
                    continue
                t = time.perf_counter()
                token, fetch = fn()
                samples[name].append((time.perf_counter() - t, fetch, token))
        best = {k: min(v) for k, v in samples.items()}
        first_token = best["full"][2]
        row = {"prefix": p, "suffix": suffix, "full_s": best["full"][0], "floor_s": best["floor"][0],
               "samples": {k: [x[0] for x in v] for k, v in samples.items()},
               "median": {k: statistics.median(x[0] for x in v) for k, v in samples.items()}}
        log(f"prefix {p}: full prefill {row['full_s']:.3f}s, in-process floor {row['floor_s']:.3f}s")
        quantized = [m for m in modes if m != "none"]
        codec = codec_seconds(hfs, prefix_kv, p, chunk_tokens, quantized, repeats) if quantized else {}
        for m in modes:
            t, fetch, _ = best[m]
            same = all(x[2] == first_token for x in samples[m])
            row[m] = {"ttft_s": t, "fetch_s": fetch, "first_token_same": same,
                      "speedup_vs_full": row["full_s"] / t, "vs_floor": t / row["floor_s"]}
            log(f"  sidecar {m}: {t:.3f}s (fetch+decode {fetch:.3f}s) -> {row['full_s'] / t:.1f}x faster than full, "
                f"{t / row['floor_s']:.2f}x the floor; first token {'same' if same else 'DIFFERENT'}")
            if m in codec:
                row[m]["dequant_s"], row[m]["pack_s"] = codec[m]["unpack"], codec[m]["pack"]
                log(f"    dequantizing its {p} tokens: {codec[m]['unpack'] * 1e3:.1f} ms, {codec[m]['unpack'] / t:.0%} "
                    f"of its TTFT (packing them, on the store path: {codec[m]['pack'] * 1e3:.0f} ms)")
            client.delete(hfs[m].spec, tokens[:p])
        rows.append(row)
    client.close()
    return rows


def codec_seconds(hfs, prefix_kv, tokens: int, chunk_tokens: int, modes, repeats: int) -> dict:
    """Per quantized mode: {"pack": seconds to pack the chunks of a `tokens`-token prefix as the client does (once:
    on the store path, off the TTFT), "unpack": the best time to dequantize them (codec.unpack of each chunk,
    nothing else; the modes interleaved round by round)}."""
    from promptcache.client.client import encode_chunk
    from promptcache import codec

    blobs, packed = {}, {}
    for m in modes:
        t = time.perf_counter()
        blobs[m] = [encode_chunk(hfs[m].spec, prefix_kv, i, i + chunk_tokens, hfs[m].rope_theta)
                    for i in range(0, tokens - chunk_tokens + 1, chunk_tokens)]
        packed[m] = time.perf_counter() - t
    best = {}
    for r in range(repeats):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            spec = hfs[m].spec
            shape = (spec.num_layers, 2, spec.num_kv_heads, chunk_tokens, spec.head_dim)
            t = time.perf_counter()
            for b in blobs[m]:
                codec.unpack(m, b, shape, spec.kv_dtype)
            best[m] = min(best.get(m, float("inf")), time.perf_counter() - t)
    return {m: {"pack": packed[m], "unpack": best[m]} for m in modes}


def format_table(rows: list[dict], modes) -> str:
    head = "| prefix + suffix | full prefill | in-process floor | " + " | ".join(
        f"sidecar {m} (fetch) | {m}: speedup, x floor" for m in modes) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(modes))]
    for r in rows:
        cells = [f"{r['prefix']} + {r['suffix']}", f"{r['full_s']:.3f} s", f"{r['floor_s']:.3f} s"]
        for m in modes:
            x = r[m]
            cells += [f"{x['ttft_s']:.3f} s ({x['fetch_s']:.3f} s)", f"{x['speedup_vs_full']:.1f}x, {x['vs_floor']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


MODELS = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-random": "SmolLM2-135M's shape, random weights",
          "tiny": "a tiny random Llama"}


def load_model(name: str, dtype: str, n_tokens: int):
    """(model in eval mode on the CPU, n_tokens prompt tokens, revision for the cache keys)."""
    import torch

    from promptcache_devtools import models

    if name == "smollm2":
        model, tok = models.load_smollm2(dtype)
        return model, models.text_tokens(tok, n_tokens), models.model_revision()
    model = models.smollm2_random(dtype) if name == "smollm2-random" else models.tiny_llama(dtype)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.config.vocab_size, (n_tokens,), generator=generator).tolist()
    return model, tokens, f"random-{name}-seed0"


def run(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    prefixes = [int(x) for x in args.prefixes.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for p in prefixes:
        if p % args.chunk_tokens:
            raise SystemExit(f"prefix {p} is not a multiple of --chunk-tokens {args.chunk_tokens}")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise SystemExit(f"--device {args.device}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is available")
    model, tokens, revision = load_model(args.model, args.dtype, max(prefixes) + args.suffix)
    model.to(device)
    if args.bulk and args.transport != "unix":
        raise SystemExit("--bulk needs --transport unix (the bulk channel's lent chunks are a Unix socket's)")
    tier = args.sidecar_device or str(device)
    sidecar = SidecarProcess(args.transport, args.chunk_tokens, memory_bytes=2 << 30, device=tier,
                             bulk=args.bulk).wait_ready()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{MODELS[args.model]} ({args.dtype}, on {device}: {where}, {torch.get_num_threads()} torch threads); "
          f"sidecar process at {sidecar.address}{' with a bulk channel' if args.bulk else ''} with its tier on "
          f"{tier}; modes {', '.join(modes)}; suffix {args.suffix} tokens", flush=True)
    try:
        rows = measure(model, tokens, prefixes=prefixes, suffix=args.suffix, modes=modes, repeats=args.repeats,
                       full_repeats=args.full_repeats, address=sidecar.address, revision=revision,
                       chunk_tokens=args.chunk_tokens, log=lambda s: print(s, flush=True),
                       bulk_address=sidecar.bulk_address)
    finally:
        sidecar.stop()
    print()
    print(format_table(rows, modes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "bench_run"}, "device": str(device),
                       "device_name": where, "torch": torch.__version__, "rows": rows}, f, indent=2)
    if args.plot:
        from promptcache_devtools.bench import plots

        plots.ttft(rows, modes, args.plot)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    sys.exit(run(p.parse_args()))
