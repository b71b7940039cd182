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

from promptcache.sidecar.policies import LRU, ClassRate, ReuseRate
from promptcache_devtools.bench import replay, traces

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
    "rate-class with W-TinyLFU's chain-root doorkeeper": lambda c: ClassRate(c, root_door=True),
}

_DATA: dict = {}


def reuse_by_class(reqs) -> list[tuple[str, int, int, int]]:
    """Of the blocks first stored by a request (those after its longest run of blocks seen before), how many are
    requested again later, by kind of run (first turn: the run starts at depth 1, right under a shared root;
    continued: deeper) and offset in the run; a request's last block (partial) apart: (kind, offset, n, reused)."""
    from collections import Counter

    uses = Counter(k for r in reqs for k in r.hash_ids)
    seen: set = set()
    n: Counter = Counter()
    reused: Counter = Counter()
    for r in sorted(reqs, key=lambda q: q.timestamp):
        ids = r.hash_ids
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        kind = "first turn" if run == 1 else ("continued" if run > 1 else "new root")
        for j in range(run, len(ids)):
            if ids[j] in seen:
                continue
            off = "last (partial)" if j == len(ids) - 1 else (str(j - run) if j - run < 8 else "8+")
            n[(kind, off)] += 1
            reused[(kind, off)] += uses[ids[j]] > 1
        seen.update(ids)
    order = [str(i) for i in range(8)] + ["8+", "last (partial)"]
    return [(k, o, n[(k, o)], reused[(k, o)]) for k in ("first turn", "continued", "new root") for o in order
            if n[(k, o)]]


def _one(job):
    name, f = job
    reqs, ws = _DATA["reqs"]
    cap = int(ws * f)
    pol = LRU(cap) if name == "lru" else CANDIDATES[name](cap)
    r = replay.simulate_policy(reqs, pol, cap)
    return name, f, r["hit"] / r["total"]


def victim_census(reqs, make, cap: int) -> dict:
    """Evictions by whether the victim had been requested once (fresh) or more (proven), and whether a later request
    of the replay uses it again: {(kind, reused): count}."""
    from collections import Counter

    last_use = {}
    for i, (ids, _) in enumerate(reqs):
        for k in ids:
            last_use[k] = i
    pol, now, out = make(cap), [0], Counter()
    choose = pol.victim

    def victim():
        v = choose()
        if v is not None:
            out[("fresh" if pol.stats[v][1] is None else "proven", last_use[v] > now[0])] += 1
        return v

    def numbered():
        for i, r in enumerate(reqs):
            now[0] = i
            yield r

    pol.victim = victim
    replay.simulate_policy(numbered(), pol, cap)
    return dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=SETS, default="tuning")
    ap.add_argument("--only", action="append", help="candidate names containing this (repeatable)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--reuse-table", action="store_true",
                    help="print how often newly stored blocks are reused, by kind of run and offset, over the whole "
                         "file of --set (both halves), and exit")
    ap.add_argument("--census", action="store_true",
                    help="victims by fresh / proven and whether they are used again, per --only candidate (default "
                         "rate) and capacity, and exit")
    args = ap.parse_args()
    fname, half = SETS[args.set]
    path = os.path.join(SHARED, fname)
    if not os.path.exists(path):
        print(f"eviction-candidates: {path} is missing (../shared/traces beside the repository)", file=sys.stderr)
        return 2
    if args.census:
        reqs, ws = replay.prepare(replay.split_halves(traces.read_trace(path))[half])
        for n in [n for n in CANDIDATES if any(o in n for o in args.only or ["rate (alive"])]:
            for f in FRACTIONS:
                c = victim_census(reqs, CANDIDATES[n], int(ws * f))
                tot = sum(c.values())
                print(f"{n} {f * 100:g} %: {tot} evictions, " + ", ".join(
                    f"{kind} {sum(v for (k, _), v in c.items() if k == kind) / tot:.0%} "
                    f"({c.get((kind, True), 0) / max(1, sum(v for (k, _), v in c.items() if k == kind)):.0%} "
                    f"of them used again)" for kind in ("fresh", "proven")), flush=True)
        return 0
    if args.reuse_table:
        print("| run | offset in the run | blocks | reused later |\n|---|---|---|---|")
        for kind, off, n, r in reuse_by_class(traces.read_trace(path)):
            print(f"| {kind} | {off} | {n} | {r / n:.3f} |")
        return 0
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
