"""vllm: vLLM (CPU backend) TTFT and throughput with and without PromptCacheConnector, and vLLM's own prefix cache.

Four engine processes (promptcache_devtools.vllm_engine, run by the vLLM virtualenv of hack/vllm-env.sh) over
SmolLM2-135M and real English text, and a sidecar process (gRPC on a unix socket, bulk channel on another):

* full: no connector, vLLM's prefix caching off: every prompt is prefilled in full;
* writer: PromptCacheConnector, prefix caching off: prefills each prefix once and stores it in the sidecar (what
  another pod, or this one before a restart, did);
* connector: PromptCacheConnector with vLLM's prefix caching on (vLLM's default, as in examples/): a prefix it has
  never seen comes from the sidecar;
* apc (the floor): no connector, prefix caching on and warm: the prefix is in engine memory.

The connector and apc engines are configured alike, so the floor comparison is like for like: what the sidecar
costs over holding the prefix in the engine's own memory. TTFT: one request of prefix + a fresh `--suffix`-token
suffix, max_tokens 1 (prompt in -> first token out), for each prefix length; every round uses a prefix no engine
has seen (the writer stores it and the apc engine is warmed with it first), variants interleaved round by round,
best of `--repeats` reported (the machine is shared), and next to the ratio of the bests the median of the
per-round ratios (connector / floor in the same round, which share the machine's state; a lucky floor round moves
the ratio of the bests by 0.1-0.2x here). The load path (Get over the bulk channel, checks, layout
conversion into the blocks) is reported in GB/s next to a memcpy of the same bytes (into memory written before).
`promptcache bench loadpath` measures the load path alone, without vLLM. Throughput: `--requests` requests over 4
shared 1k-token prefixes with distinct suffixes, `--max-tokens` new tokens each, wall time per variant (the
writer stored the prefixes; the connector engine loads each once, then holds it).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # devtools/promptcache_devtools/bench/ up


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefixes", default="1024,2048,4096", help="comma-separated cached prefix lengths in tokens")
    p.add_argument("--suffix", type=int, default=64, help="new tokens after the cached prefix")
    p.add_argument("--repeats", type=int, default=3, help="interleaved TTFT rounds (best is reported)")
    p.add_argument("--requests", type=int, default=32, help="requests in the throughput run")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request in the throughput run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-python", default=os.environ.get("PROMPTCACHE_VLLM_PYTHON", ""),
                   help="python of the vLLM virtualenv (default: built/located by hack/vllm-env.sh)")
    p.add_argument("--json", default="", help="write every sample here")


def _metric(answer: dict, prefix: str) -> float:
    return sum(v for k, v in answer["metrics"].items() if k.startswith(prefix))


def run(args) -> int:
    import torch

    from promptcache_devtools import models
    from promptcache_devtools.procs import free_port, stop_process, wait_healthy
    from promptcache_devtools.vllm_engine import EngineProcess

    python = args.vllm_python or subprocess.run([str(REPO / "hack" / "vllm-env.sh")], check=True, text=True,
                                                stdout=subprocess.PIPE).stdout.strip().splitlines()[-1]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    _, tok = models.load_smollm2("float32")
    text = models.text_tokens(tok)
    model_dir = str(models.smollm2_dir())
    tmp = Path(tempfile.mkdtemp(prefix="pc-bench-vllm-"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    bulk = f"unix:{tmp}/bulk.sock"
    sidecar = subprocess.Popen([sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", address,
                                "--metrics-port", str(free_port()), "--memory-bytes", "4Gi", "--bulk-address", bulk,
                                "--data-dir", str(tmp / "data"), "--disk-bytes", "0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(address, sidecar, 60, lambda: "")
    conn = {"address": address, "bulk_address": bulk, "model_id": models.SMOLLM2_ID,
            "revision": models.model_revision(), "load_timeout": 10.0}
    max_len = max(*prefixes, 1024) + args.suffix + 64  # the throughput run's prompts: a 1k prefix + 64
    opts = dict(dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.requests,
                max_num_batched_tokens=max_len, kv_cache_gib=1)
    t0 = time.monotonic()
    engines = {
        "full": EngineProcess(python, model_dir, log_path=str(tmp / "full.log"), **opts),
        "connector": EngineProcess(python, model_dir, connector=conn, log_path=str(tmp / "connector.log"),
                                   prefix_caching=True, **opts),
        "apc": EngineProcess(python, model_dir, log_path=str(tmp / "apc.log"), prefix_caching=True, **opts),
    }
    writer = EngineProcess(python, model_dir, connector=conn, log_path=str(tmp / "writer.log"), **opts)
    samples: dict = {"ttft": {}, "throughput": {}, "load": {}}
    try:
        for e in [*engines.values(), writer]:
            e.wait_ready(1800)
        print(f"engines ready in {time.monotonic() - t0:.0f}s (logs in {tmp})", flush=True)
        suffix_at = len(text) - 8000
        # Each prefix starts at its own offset (a multiple of 61): no two share their first block, so none is
        # cached anywhere before the writer stores it. The throughput run's prefixes start at other offsets.
        used = len(prefixes) * args.repeats
        if used * 61 + max(prefixes) > suffix_at or 9001 + 3 * 1100 + 1024 > suffix_at:
            raise SystemExit(f"the offline text has {len(text)} tokens: too few for {used} prefixes")
        lengths = (n for n in prefixes for _ in range(args.repeats))
        fresh_prefixes = (text[k * 61:k * 61 + n] for k, n in enumerate(lengths))
        for n in prefixes:
            rows = {k: [] for k in engines}
            load = []
            for r in range(args.repeats):
                prefix = next(fresh_prefixes)
                fresh = [text[suffix_at + i * args.suffix:suffix_at + (i + 1) * args.suffix] for i in range(3)]
                suffix_at += 3 * args.suffix
                writer.generate([prefix + fresh[0]], 1)  # the writer stores the prefix ...
                writer.call(op="flush")
                engines["apc"].generate([prefix + fresh[1]], 1)  # ... and the floor holds it in memory
                for name, e in engines.items():
                    before = e.call(op="metrics") if name == "connector" else None
                    t = time.perf_counter()
                    e.generate([prefix + fresh[2]], 1)
                    rows[name].append(time.perf_counter() - t)
                    if before is not None:
                        after = e.call(op="metrics")
                        secs = sum(_metric(after, m) - _metric(before, m) for m in
                                   ("promptcache_client_fetch_seconds_sum", "promptcache_client_load_seconds_sum"))
                        tokens = _metric(after, "promptcache_client_reused_tokens_total") - \
                            _metric(before, "promptcache_client_reused_tokens_total")
                        load.append((tokens, secs))
                        if tokens < n:
                            raise RuntimeError(f"the connector loaded {tokens:.0f} of the {n} cached tokens")
            samples["ttft"][n] = rows
            samples["load"][n] = load
            print(f"prefix {n}: " + ", ".join(f"{k} {min(v) * 1e3:.0f} ms" for k, v in rows.items())
                  + f"; loads (tokens, seconds) {load}", flush=True)
        # throughput: 4 shared 1k prefixes, distinct suffixes
        shared = [text[9001 + i * 1100:9001 + i * 1100 + 1024] for i in range(4)]  # 9001 + i*1100: not k*61
        base = len(text) - 3000
        prompts = [shared[i % 4] + text[base + i * 64:base + (i + 1) * 64] for i in range(args.requests)]
        writer.generate([s + text[base - 100:base - 36] for s in shared], 1)
        writer.call(op="flush")
        engines["apc"].generate([s + text[base - 100:base - 36] for s in shared], 1)
        outputs = {}
        for name, e in engines.items():
            before = e.call(op="metrics") if name == "connector" else None
            t = time.perf_counter()
            out = e.generate(prompts, args.max_tokens)
            samples["throughput"][name] = time.perf_counter() - t
            samples["throughput"][name + "_tokens"] = sum(len(o) for o in out["outputs"])
            outputs[name] = out["outputs"]
            print(f"throughput {name}: {samples['throughput'][name]:.1f} s", flush=True)
            if before is not None:
                after = e.call(op="metrics")
                grew = lambda m: _metric(after, m) - _metric(before, m)  # noqa: E731
                loaded = grew("promptcache_client_reused_tokens_total")
                samples["throughput"]["connector_loaded_tokens"] = loaded
                print(f"throughput connector: {loaded:.0f} tokens loaded from the sidecar", flush=True)
        differ = {name: sum(a != b for a, b in zip(outputs[name], outputs["full"])) for name in ("connector", "apc")}
        samples["throughput"]["sequences_differing_from_full"] = differ
        if not any(differ.values()):
            print("throughput: the connector's greedy tokens equal the full prefill's", flush=True)
        else:  # expected in bf16, where a prefill over a cached prefix rounds differently from one long prefill
            print(f"throughput: greedy tokens differ from the full prefill's in {differ['connector']} of "
                  f"{len(prompts)} sequences with the connector, {differ['apc']} with vLLM's prefix cache", flush=True)
    finally:
        for e in [*engines.values(), writer]:
            e.close()
        stop_process(sidecar)

    bytes_per_token = 2 * 30 * 3 * 64 * (4 if args.dtype == "float32" else 2)
    print(f"\nvLLM {args.dtype} CPU backend, SmolLM2-135M; TTFT = prefix + {args.suffix} new tokens -> first token "
          f"(best of {args.repeats})\n")
    print("| cached prefix | full prefill | connector (from the sidecar) | vLLM prefix cache (floor) "
          "| full / connector "
          "| connector / floor | same-round connector / floor, median | load path | memcpy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in prefixes:
        rows = samples["ttft"][n]
        full, conn_t, apc = min(rows["full"]), min(rows["connector"]), min(rows["apc"])
        paired = statistics.median(c / a for c, a in zip(rows["connector"], rows["apc"]))
        loads = [(t, s) for t, s in samples["load"][n] if s > 0]
        nbytes = n * bytes_per_token
        gbps = max((t * bytes_per_token / s for t, s in loads), default=0.0) / 1e9
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        dst = torch.zeros_like(src)  # written before, as the engine's cache was
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
        print(f"| {n} | {full * 1e3:.0f} ms | {conn_t * 1e3:.0f} ms | {apc * 1e3:.0f} ms | {full / conn_t:.1f}x "
              f"| {conn_t / apc:.2f}x | {paired:.2f}x | {gbps:.2f} GB/s | {nbytes / best / 1e9:.1f} GB/s |")
    tp = samples["throughput"]
    print(f"\nThroughput, {args.requests} requests over 4 shared 1k-token prefixes, {args.max_tokens} new tokens each:")
    print("| variant | seconds | tokens/s | vs full |")
    print("| --- | --- | --- | --- |")
    for name in engines:
        print(f"| {name} | {tp[name]:.1f} | {tp[name + '_tokens'] / tp[name]:.1f} | {tp['full'] / tp[name]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(samples, indent=1))
    return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
