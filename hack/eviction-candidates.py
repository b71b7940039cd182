#!/usr/bin/env python3
"""The candidates of docs/eviction.md's fifth round (issue #32): token hit ratio / LRU per candidate policy.

    nice .venv/bin/python hack/eviction-candidates.py [--set tuning|held-out|synthetic-1|synthetic-2] [--jobs N]

`tuning` is the first half (by time) of ../shared/traces/mooncake-fast25-conversation-first-half.jsonl, `held-out`
its second half (`promptcache bench replay --split half` on that file), `synthetic-1/2` the halves of the synthetic
trace; each half replayed from an empty cache, capacity a fraction of that half's working set. A few minutes per
set on two cores.
"""
from __future__ import annotations

import argparse
import os
import sys

from promptcache.devtools.bench import replay, traces
from promptcache.sidecar.policies import LRU, ClassRate, ReuseRate

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared", "traces")
SETS = {"tuning": ("mooncake-fast25-conversation-first-half.jsonl", 0),
        "held-out": ("mooncake-fast25-conversation-first-half.jsonl", 1),
        "synthetic-1": ("mooncake-fast25-synthetic.jsonl", 0),
        "synthetic-2": ("mooncake-fast25-synthetic.jsonl", 1)}
FRACTIONS = (0.02, 0.05, 0.10, 0.25)
CANDIDATES = {
    "rate (alive 0.75)": lambda c: ReuseRate(c),
    "rate, alive 1.5": lambda c: ReuseRate(c, alive=1.5),
    "rate, alive 3": lambda c: ReuseRate(c, alive=3),
    "rate, alive 8": lambda c: ReuseRate(c, alive=8),
    "rate, ghost x16": lambda c: ReuseRate(c, ghost=16),
    "rate, alpha 0.2": lambda c: ReuseRate(c, alpha=0.2),
    "classes: none (one fresh rate, learned from stored chunks)": lambda c: ClassRate(c, classes=()),
    "classes: partial": lambda c: ClassRate(c, classes=("partial",)),
    "classes: offset": lambda c: ClassRate(c, classes=("offset",)),
    "classes: partial, offset": lambda c: ClassRate(c, classes=("partial", "offset")),
    "**rate-class: partial, start, offset**": lambda c: ClassRate(c),
    "rate-class, alive 1.5": lambda c: ClassRate(c, alive=1.5),
    "rate-class, power-law survival, tail 1": lambda c: ClassRate(c, tail=1),
    "rate-class, tail 2": lambda c: ClassRate(c, tail=2),
}

_DATA: dict = {}


def _one(job):
    name, f = job
    reqs, ws = _DATA["reqs"]
    cap = int(ws * f)
    pol = LRU(cap) if name == "lru" else CANDIDATES[name](cap)
    r = replay.simulate_policy(reqs, pol, cap)
    return name, f, r["hit"] / r["total"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=SETS, default="tuning")
    ap.add_argument("--only", action="append", help="candidate names containing this (repeatable)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    fname, half = SETS[args.set]
    path = os.path.join(SHARED, fname)
    if not os.path.exists(path):
        print(f"eviction-candidates: {path} is missing (../shared/traces beside the repository)", file=sys.stderr)
        return 2
    _DATA["reqs"] = replay.prepare(replay.split_halves(traces.read_trace(path))[half])
    names = [n for n in CANDIDATES if not args.only or any(o in n for o in args.only)]
    jobs = [(n, f) for n in ["lru"] + names for f in FRACTIONS]
    if args.jobs > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(args.jobs) as pool:
            res = pool.map(_one, jobs)
    else:
        res = list(map(_one, jobs))
    t = {(n, f): h for n, f, h in res}
    lru = " / ".join("%.3f" % t[("lru", f)] for f in FRACTIONS)
    print(f"| candidate ({args.set}; LRU {lru}) | "
          + " | ".join(f"{f * 100:g} %" for f in FRACTIONS) + " |")
    print("|---|" + "---|" * len(FRACTIONS))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{t[(n, f)]:.3f} ({t[(n, f)] / t[('lru', f)]:.2f}x)" for f in FRACTIONS)
              + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
