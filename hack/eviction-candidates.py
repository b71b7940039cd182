#!/usr/bin/env python3
"""The candidates of docs/eviction.md's fifth round (issue #32): token hit ratio / LRU per candidate policy.

    nice .venv/bin/python hack/eviction-candidates.py [--set tuning|held-out|synthetic-1|synthetic-2|generators-SEED]
        [--only NAME] [--jobs N]
    nice .venv/bin/python hack/eviction-candidates.py --set synthetic-2 --characterise

`tuning` is the first half (by time) of ../shared/traces/mooncake-fast25-conversation-first-half.jsonl, `held-out`
its second half (`promptcache bench replay --split half` on that file), `synthetic-1/2` the halves of the synthetic
trace; each half replayed from an empty cache, capacity a fraction of that half's working set. `generators-SEED`
replays the four synthetic generators (promptcache_devtools.bench.traces.GENERATORS, whole traces) with that seed:
the regression guard of tests/test_replay.py is seed 0. A few minutes per set on two cores.

The sixth round (issue #32, the synthetic trace) added `--characterise` and the experimental classes below
(ScoreAdmission, GammaPoisson; ClassHazard is in promptcache.sidecar.policies): docs/eviction.md, "Sixth round".
"""
from __future__ import annotations

import argparse
import os
import sys

import math

from promptcache.sidecar.policies import LRU, ClassHazard, ClassRate, ReuseRate, _is_root, _log2_bucket
from promptcache_devtools.bench import replay, traces

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared", "traces")
SETS = {"tuning": ("mooncake-fast25-conversation-first-half.jsonl", 0),
        "held-out": ("mooncake-fast25-conversation-first-half.jsonl", 1),
        "synthetic-1": ("mooncake-fast25-synthetic.jsonl", 0),
        "synthetic-2": ("mooncake-fast25-synthetic.jsonl", 1)}
FRACTIONS = (0.02, 0.05, 0.10, 0.25)


# --------------------------------------------------------------------------------------------------------------
# Sixth round (issue #32, the synthetic trace): experimental classes, not in the server.


class ScoreAdmission(ClassRate):
    """`rate-class` that refuses a newcomer (a chain root, or with `all_chunks` any chunk) when room must be made and
    its score - its class's learned fresh rate at silence 0, or its own when remembered - is below the lowest score
    among `sample` sampled leaves minus `margin` (TinyLFU's admission with `rate-class`'s scores)."""

    def __init__(self, capacity=None, all_chunks: bool = False, margin: float = 0.0, **kw):
        super().__init__(capacity, **kw)
        self.all_chunks, self.margin = all_chunks, margin

    def _newcomer_score(self, key, size: int, parent) -> float:
        st = self.stats.get(key)
        if st is not None and st[1] is not None:
            return self._log_score(key)
        partial = self._use[0] and size < self._max_size
        if _is_root(parent):
            return math.log(self._class_rate((partial, 0, 0)))
        depth = self._depth.get(parent, 0) + 1
        pst = self.stats.get(parent)
        if pst is not None and pst[1] is None and parent in self._off:
            off = self._off[parent] + 1
            start = self._cls[parent][1] if parent in self._cls else _log2_bucket(depth)
        else:
            off, start = 0, _log2_bucket(depth)
        return math.log(self._class_rate((partial, start if self._use[1] else 0,
                                          _log2_bucket(off) if self._use[2] else 0)))

    def admit(self, key, size: int, parent) -> bool:
        if not super().admit(key, size, parent):
            return False
        if not (self.all_chunks or _is_root(parent)) or not self._leaves:
            return True
        self._rates = {}
        leaves = self._leaves
        pool = leaves if len(leaves) <= self.sample else [leaves[self._rng.randrange(len(leaves))]
                                                          for _ in range(self.sample)]
        scores = [self._log_score(k) for k in pool if k != self._protect]
        if scores and self._newcomer_score(key, size, parent) + self.margin < min(scores):
            self.admissions_rejected += 1
            return False
        return True


class GammaPoisson(ClassRate):
    """Every chunk scored by the posterior mean of a Poisson rate, (1 + second-and-later requests) / (1 / prior +
    ticks since its first request), the prior its class's learned fresh rate (pooled for proven chunks): frequency
    over the whole remembered history, no survival term."""

    def __init__(self, capacity=None, **kw):
        super().__init__(capacity, **kw)
        self._n: dict = {}
        self._t0: dict = {}

    def _forget(self, key) -> None:
        super()._forget(key)
        self._n.pop(key, None)
        self._t0.pop(key, None)

    def requested(self, key) -> None:
        if key in self.stats:
            self._n[key] = self._n.get(key, 0) + 1
        super().requested(key)
        self._t0.setdefault(key, self.now)

    def inserted(self, key, size: int, parent) -> None:
        super().inserted(key, size, parent)
        self._t0.setdefault(key, self.now)

    def _log_score(self, key) -> float:
        last, gap = self.stats[key]
        if gap is None:
            c = self._cls.get(key)
            r0 = self._rates.get(c)
            if r0 is None:
                r0 = self._rates[c] = self._class_rate(c)
        else:
            r0 = self._class_rate(None)
        return math.log((1.0 + self._n.get(key, 0)) / (1.0 / r0 + self.now - self._t0.get(key, last)))


class RootCount(ClassHazard):
    """Seventh round (scratch): `rate-hazard` whose fresh-chunk class also carries how many requests its chain root
    (the conversation's first chunk) has had, log2-bucketed: a hot conversation's newly appended chunks are as
    likely to be asked again as the conversation is to come back, whatever their own count (one)."""

    def __init__(self, capacity=None, **kw) -> None:
        super().__init__(capacity, **kw)
        self._root: dict = {}   # remembered chunk -> its chain's root
        self._rcount: dict = {}  # root -> requests since it was first stored

    def requested(self, key) -> None:
        if key in self._rcount:
            self._rcount[key] += 1
        super().requested(key)

    def inserted(self, key, size, parent) -> None:
        p = None if _is_root(parent) else parent
        had = key in self._cls
        super().inserted(key, size, parent)
        root = key if p is None else self._root.get(p, p)
        self._root[key] = root
        if p is None and key not in self._rcount:
            self._rcount[key] = 1
        if not had and key in self._cls:
            old = self._cls[key]
            new = self._cls[key] = old + (_log2_bucket(self._rcount.get(root, 1)),)
            if key in self._tracked:
                t0 = self._tracked[key]
                self._cnt[old] -= 1
                self._sum[old] -= t0
                self._cnt[new] = self._cnt.get(new, 0) + 1
                self._sum[new] = self._sum.get(new, 0) + t0
                self._track_slot(key)  # the open exposure's class too

    def _forget(self, key) -> None:
        super()._forget(key)
        self._root.pop(key, None)
        self._rcount.pop(key, None)


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
    # sixth round (issue #32, the synthetic trace)
    "sixth: rate-class, alive 1.5": lambda c: ClassRate(c, alive=1.5),
    "sixth: score admission, roots": lambda c: ScoreAdmission(c),
    "sixth: score admission, roots, alive 1.5": lambda c: ScoreAdmission(c, alive=1.5),
    "sixth: score admission, all chunks": lambda c: ScoreAdmission(c, all_chunks=True),
    "sixth: score admission, all chunks, margin log 2": lambda c: ScoreAdmission(c, all_chunks=True,
                                                                                margin=math.log(2)),
    "sixth: score admission, all chunks, margin log 2, alive 1.5": lambda c: ScoreAdmission(
        c, all_chunks=True, margin=math.log(2), alive=1.5),
    "sixth: gamma-poisson frequency": lambda c: GammaPoisson(c),
    "sixth: class hazard by age, alive 0.75": lambda c: ClassHazard(c, alive=0.75),
    "sixth: class hazard by age, alive 1.5 (ClassHazard as kept)": lambda c: ClassHazard(c),
    "seventh: class hazard, fresh classes by the root's requests": lambda c: RootCount(c),
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


def characterise(reqs_raw, fractions=(0.05, 0.10)) -> None:
    """Sixth round: what the trace's reuse looks like and what OPT keeps that LRU and rate-class lose."""
    import heapq
    from collections import Counter, defaultdict

    from promptcache.sidecar.trace import cached_run
    from promptcache_devtools.bench import opt

    reqs = sorted(reqs_raw, key=lambda r: r.timestamp)
    uses = Counter(k for r in reqs for k in r.hash_ids)
    conv = defaultdict(list)  # conversation = the requests sharing a root block
    for i, r in enumerate(reqs):
        conv[r.hash_ids[0]].append(i)
    print(f"{len(reqs)} requests, {len(uses)} unique blocks, {sum(v == 1 for v in uses.values()) / len(uses):.0%} "
          f"used once; {len(conv)} conversations (root blocks), requests per conversation: "
          f"{sorted(Counter(min(len(v), 10) for v in conv.values()).items())} (10 = 10+)")
    print("| k-th request of its conversation (in this set) | n | P(next within 32 / 64 / 128 / 256 requests, ever) |")
    print("|---|---|---|")
    tab = defaultdict(lambda: [0] * 6)
    for v in conv.values():
        for j, i in enumerate(v):
            g = v[j + 1] - i if j + 1 < len(v) else math.inf
            row = tab[min(j + 1, 6)]
            row[0] += 1
            for x, h in enumerate((32, 64, 128, 256, math.inf)):
                row[x + 1] += g <= h if h != math.inf else g != math.inf
    for k, row in sorted(tab.items()):
        print(f"| {k}{'+' if k == 6 else ''} | {row[0]} | " + " / ".join(f"{x / row[0]:.2f}" for x in row[1:]) + " |")
    prepared, ws = replay.prepare(reqs)

    def opt_runs(cap):  # opt.simulate_opt, returning each request's hit prefix length
        nxt, present, nu, heap, used, stamp, out = opt.next_uses(prepared), {}, {}, [], 0, 0, []
        for i, (ids, sizes) in enumerate(prepared):
            n = cached_run(ids, present)
            out.append(n)
            for j, k in enumerate(ids):
                if k in present:
                    stamp += 1
                    nu[k] = stamp
                    heapq.heappush(heap, (-nxt[i][j], -j, -stamp, k))
            for j in range(n, len(ids)):
                k, mine, s = ids[j], nxt[i][j], sizes[j]
                if (j and ids[j - 1] not in present) or mine == math.inf or s > cap:
                    break
                if k in present:
                    continue
                while used + s > cap:
                    while heap and not (heap[0][3] in present and nu[heap[0][3]] == -heap[0][2]):
                        heapq.heappop(heap)
                    if not heap or -heap[0][0] <= mine:
                        break
                    used -= present.pop(heapq.heappop(heap)[3])
                if used + s > cap:
                    break
                present[k], used, stamp = s, used + s, stamp + 1
                nu[k] = stamp
                heapq.heappush(heap, (-mine, -j, -stamp, k))
        return out

    def policy_runs(pol, cap):
        out, n = [], [0]
        acc = pol.accessed

        def accessed(k):
            n[0] += 1
            acc(k)

        def numbered():
            for r in prepared:
                n[0] = 0
                yield r
                out.append(n[0])

        pol.accessed = accessed
        replay.simulate_policy(numbered(), pol, cap)
        return out

    cb = ("1", "2", "3-4", "5-8", "9+")
    sb = ("<=4", "<=16", "<=64", "<=256", "<=1024", ">1024")
    print("\n| capacity | who | hit | hit tokens by the block's earlier requests " + " / ".join(cb)
          + " | by its silence in requests " + " / ".join(sb) + " |\n|---|---|---|---|---|")
    total = sum(sum(s) for _, s in prepared)
    for f in (None, *fractions):
        cap = int(ws * f) if f else 0
        runs = {"reuse (infinite)": None} if f is None else {
            "opt": opt_runs(cap), "lru": policy_runs(LRU(cap), cap), "rate-class": policy_runs(ClassRate(cap), cap)}
        for who, ns in runs.items():
            cnt, last, by_c, by_s = {}, {}, Counter(), Counter()
            for i, (ids, sizes) in enumerate(prepared):
                n = cached_run(ids, cnt) if ns is None else ns[i]
                for j in range(n):
                    k, c, sil = ids[j], cnt[ids[j]], i - last[ids[j]]
                    by_c[cb[min(4, (c > 1) + (c > 2) + (c > 4) + (c > 8))]] += sizes[j]
                    by_s[sb[sum(sil > x for x in (4, 16, 64, 256, 1024))]] += sizes[j]
                for k in ids:
                    cnt[k] = cnt.get(k, 0) + 1
                    last[k] = i
            print(f"| {'-' if f is None else f'{f:.0%}'} | {who} | {sum(by_c.values()) / total:.3f} | "
                  + " / ".join(f"{by_c[b] / total:.3f}" for b in cb) + " | "
                  + " / ".join(f"{by_s[b] / total:.3f}" for b in sb) + " |", flush=True)
        if f:
            hit, tot = opt.simulate_dead_first(prepared, cap)
            print(f"| {f:.0%} | dead-first (knows which blocks are never used again) | {hit / tot:.3f} | | |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", default="tuning", help=f"{', '.join(SETS)} or generators-SEED")
    ap.add_argument("--only", action="append", help="candidate names containing this (repeatable)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--reuse-table", action="store_true",
                    help="print how often newly stored blocks are reused, by kind of run and offset, over the whole "
                         "file of --set (both halves), and exit")
    ap.add_argument("--census", action="store_true",
                    help="victims by fresh / proven and whether they are used again, per --only candidate (default "
                         "rate) and capacity, and exit")
    ap.add_argument("--characterise", action="store_true",
                    help="reuse by conversation request count, and OPT / LRU / rate-class hits by the block's earlier "
                         "requests and silence at 5 and 10 %% (sixth round), for --set, and exit")
    args = ap.parse_args()
    if args.set.startswith("generators-"):
        return _generators(args, int(args.set.split("-", 1)[1]))
    if args.set not in SETS:
        ap.error(f"--set {args.set!r} is not one of {', '.join(SETS)} or generators-SEED")
    fname, half = SETS[args.set]
    path = os.path.join(SHARED, fname)
    if not os.path.exists(path):
        print(f"eviction-candidates: {path} is missing (../shared/traces beside the repository)", file=sys.stderr)
        return 2
    if args.characterise:
        characterise(replay.split_halves(traces.read_trace(path))[half])
        return 0
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
    _table(args, args.set)
    return 0


def _generators(args, seed: int) -> int:
    """The regression guard's sets: each generator of promptcache_devtools.bench.traces, whole, with `seed`; a cell
    more than 0.005 below LRU is marked with '!'."""
    for gen in traces.GENERATORS:
        _DATA["reqs"] = replay.prepare(traces.generate(gen, seed=seed))
        _table(args, f"{gen}, seed {seed}")
    return 0


def _table(args, label: str) -> None:
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
    print(f"| candidate ({label}; LRU {lru}) | "
          + " | ".join(f"{f * 100:g} %" for f in FRACTIONS) + " |")
    print("|---|" + "---|" * len(FRACTIONS))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{t[(n, f)]:.3f} ({t[(n, f)] / t[('lru', f)]:.2f}x)"
                                      + ("!" if t[(n, f)] < t[("lru", f)] - 0.005 else "") for f in FRACTIONS)
              + " |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
