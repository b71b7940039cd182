#!/usr/bin/env python3
"""How long a full garbage collection stops a sidecar that holds N chunks (docs/operating.md, "Garbage collection
pauses").

    nice .venv/bin/python hack/gc-pauses.py [--chunks 100000] [--no-freeze]

Imports what `promptcache serve` imports, freezes it as serve does (unless --no-freeze), fills a MemoryTier under
the default policy with N small chunks in chains of 64, and times gc.collect() (the least of three)."""
from __future__ import annotations

import argparse
import gc
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--no-freeze", action="store_true", help="do not gc.freeze() after the imports")
    args = ap.parse_args()
    import torch

    import promptcache.sidecar.app  # noqa: F401 - what serve imports
    from promptcache.sidecar.policies import DEFAULT_POLICY, make_policy
    from promptcache.sidecar.store import MemoryTier

    if not args.no_freeze:
        gc.collect()
        gc.freeze()
    size, n = 512, max(1, args.chunks)
    tier = MemoryTier(n * size, torch.device("cpu"), make_policy(DEFAULT_POLICY), ttl_seconds=3600,
                      protect_memory=False)
    root = parent = b"\0" * 32
    for i in range(args.chunks):
        key = i.to_bytes(8, "little") * 4
        tier.policy.requested(key)
        r = tier.reserve(size, key, parent)
        tier.commit(r, key=key, fingerprint=b"f" * 32, parent=parent, index=i % 64, data=tier.host_buffer(r),
                    checksum_value=0, shape=(size,), dtype=0)
        parent = key if (i + 1) % 64 else root
    pauses = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - t)
    print(f"{args.chunks} chunks held, {'not ' if args.no_freeze else ''}frozen after the imports: "
          f"{len(gc.get_objects())} objects tracked, a full collection {min(pauses) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
