"""What a priority hint buys on a trace: `python -m promptcache_devtools.hints_bench [--trace FILE] ...`.

A real in-process sidecar (memory tier only, the default eviction policy) replays the trace's first --requests
requests (each: Get the cached prefix, Put the rest; one chunk per hash id) at several memory sizes, with and
without hints. The hint is derived from the first half of those requests only: the prefixes (up to --max-depth
blocks) that at least --min-requests of them share are "shared roots" (a system prompt, a popular document); in
the hinted run a request whose prompt starts with a shared root puts that root with priority=1 (pinned, within
--max-pinned-fraction) and the rest as usual. The token hit ratio is counted on the second half (the first warms
the cache). Printed as a Markdown table.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses

from promptcache_devtools.warmup_bench import TRACE, _hits, _requests, kv_for


def shared_roots(reqs, max_depth: int, min_requests: int) -> set[tuple]:
    counts = collections.Counter()
    for r in reqs:
        h = r["hash_ids"]
        for d in range(1, min(max_depth, len(h)) + 1):
            counts[tuple(h[:d])] += 1
    return {p for p, n in counts.items() if n >= min_requests}


def replay(sidecar, spec, reqs, ct: int, roots: set[tuple] | None, count_from: int) -> float:
    from promptcache.client import PromptCacheClient

    before = None
    with PromptCacheClient(sidecar.address, timeout=60) as c:
        for i, r in enumerate(reqs):
            if i == count_from:
                before = _hits(sidecar)
            h = r["hash_ids"]
            tokens = [x * ct + j for x in h for j in range(ct)]
            cached, _ = c.get(spec, tokens)
            if cached >= len(tokens):
                continue
            kv = kv_for(spec, h, ct)
            depth = 0
            if roots:
                depth = max((d for d in range(1, len(h) + 1) if tuple(h[:d]) in roots), default=0)
            if depth:
                c.put(spec, tokens[:depth * ct], [(k[:, :, :depth * ct], v[:, :, :depth * ct]) for k, v in kv],
                      priority=1)
            if cached // ct < len(h):
                c.put(spec, tokens, kv, start_chunk=cached // ct)
    after = _hits(sidecar)
    d = {k: after[k] - before[k] for k in after}
    return (d["device"] + d["disk"]) / (d["device"] + d["disk"] + d["missed"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--capacities", default="0.02,0.05,0.1", help="memory as fractions of the distinct blocks")
    p.add_argument("--max-depth", type=int, default=16)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-pinned-fraction", type=float, default=0.25)
    p.add_argument("--chunk-tokens", type=int, default=16)
    args = p.parse_args(argv)

    from promptcache.contract.keys import ModelSpec
    from promptcache.contract.layout import chunk_nbytes
    from promptcache.sidecar.app import Sidecar
    from promptcache.sidecar.config import Settings

    spec = ModelSpec("bench/hints", "r1", "float32", num_layers=2, num_kv_heads=2, head_dim=8)
    ct = args.chunk_tokens
    reqs = _requests(args.trace)[:args.requests]
    half = len(reqs) // 2
    roots = shared_roots(reqs[:half], args.max_depth, args.min_requests)
    distinct = len({x for r in reqs for x in r["hash_ids"]})
    base = Settings(grpc_address="127.0.0.1:0", metrics_port=0, chunk_tokens=ct, log_level="warning",
                    max_pinned_fraction=args.max_pinned_fraction)
    print(f"trace {args.trace}: {len(reqs)} requests ({distinct} distinct blocks), counted on the second "
          f"{len(reqs) - half}; {len(roots)} shared roots (prefixes of <= {args.max_depth} blocks shared by >= "
          f"{args.min_requests} requests of the first half); pinned at most {args.max_pinned_fraction:g} of memory")
    print()
    print("| capacity | no hints | pin shared roots | ratio |")
    print("|---|---|---|---|")
    for cap in (float(x) for x in args.capacities.split(",")):
        memory = max(1, int(cap * distinct)) * chunk_nbytes(spec, ct)
        out = []
        for hinted in (False, True):
            s = Sidecar(dataclasses.replace(base, memory_bytes=memory)).start()
            try:
                out.append(replay(s, spec, reqs, ct, roots if hinted else None, half))
            finally:
                s.stop(0)
        print(f"| {cap:.0%} | {out[0]:.3f} | {out[1]:.3f} | {out[1] / out[0]:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
