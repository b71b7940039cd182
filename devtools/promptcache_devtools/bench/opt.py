"""Offline references for trace replay: Belady's OPT and an infinite cache, under prefix semantics.

Model (shared with promptcache_devtools.bench.replay): a request's blocks are looked up in order and it hits the longest
leading run of cached blocks; afterwards its missing blocks are stored in order (a block is stored only if its
parent block is cached, since an orphan could never be reached). Sizes are in tokens (bytes are proportional to
tokens for one model), the capacity is a token budget, and the hit ratio is hit tokens / input tokens.

OPT here is Belady's farthest-next-use with bypass: when a block must be stored and there is no room, the cached
blocks whose next use (the index of the next request that contains them) lies strictly farther in the future than
the incoming block's are evicted, farthest first, until it fits; if that is not possible, the block - and with it
the rest of the request's chain, whose next uses are never earlier - is not stored. Because every request that
uses a block also uses all of its ancestors, an ancestor's next use is never later than a descendant's; of equal
next uses the deepest block goes first, so this never evicts a parent before its child (which would strand the
child, unreachable, in the cache) and every block hit it counts is also a prefix hit. For uniform block sizes
this is the optimal (maximum block hits) offline policy; with the partial last blocks of a trace it is the
standard farthest-next-use heuristic (exact size-aware OPT is NP-hard), and counts tokens, not blocks.
"""
from __future__ import annotations

import heapq

from promptcache.sidecar.trace import cached_run

INF = float("inf")


def next_uses(reqs: list[tuple[list, list[int]]]) -> list[list[float]]:
    """For every request i and block position j: index of the next request > i that contains block j."""
    nxt: list[list[float]] = [None] * len(reqs)  # type: ignore[list-item]
    seen: dict = {}
    for i in range(len(reqs) - 1, -1, -1):
        ids = reqs[i][0]
        row = [seen.get(k, INF) for k in ids]
        nxt[i] = row
        for k in ids:
            seen[k] = i
    return nxt


def simulate_opt(reqs: list[tuple[list, list[int]]], capacity: int, measure_from: int = 0) -> tuple[int, int]:
    """Return (hit tokens, total tokens) of Belady's OPT with bypass under prefix semantics, counting the requests
    from index `measure_from` on (the earlier ones only warm the cache)."""
    nxt = next_uses(reqs)
    present: dict = {}  # key -> size
    nu: dict = {}  # key -> next use
    heap: list = []  # (-next use, -depth, -stamp, key): of equal next uses the deepest block goes first
    used = 0
    hit = total = 0
    stamp = 0
    for i, (ids, sizes) in enumerate(reqs):
        n = cached_run(ids, present)
        if i >= measure_from:
            hit += sum(sizes[:n])
            total += sum(sizes)
        row = nxt[i]
        for j, k in enumerate(ids):
            if k in present:
                stamp += 1
                nu[k] = (row[j], stamp)
                heapq.heappush(heap, (-row[j], -j, -stamp, k))
        for j in range(n, len(ids)):
            k = ids[j]
            if j and ids[j - 1] not in present:
                break
            if k in present:
                continue
            mine = row[j]
            s = sizes[j]
            if mine == INF or s > capacity:
                break
            ok = True
            while used + s > capacity:
                while heap:
                    negnu, _, negst, v = heap[0]
                    if v in present and nu[v][1] == -negst:
                        break
                    heapq.heappop(heap)
                if not heap or -heap[0][0] <= mine:
                    ok = False
                    break
                v = heapq.heappop(heap)[3]
                used -= present.pop(v)
                del nu[v]
            if not ok:
                break
            present[k] = s
            used += s
            stamp += 1
            nu[k] = (mine, stamp)
            heapq.heappush(heap, (-mine, -j, -stamp, k))
        if len(heap) > 4 * len(present) + 1024:
            heap = [e for e in heap if e[3] in present and nu[e[3]][1] == -e[2]]
            heapq.heapify(heap)
    return hit, total


def simulate_infinite(reqs: list[tuple[list, list[int]]], measure_from: int = 0) -> tuple[int, int]:
    seen: set = set()
    hit = total = 0
    for i, (ids, sizes) in enumerate(reqs):
        n = cached_run(ids, seen)
        if i >= measure_from:
            hit += sum(sizes[:n])
            total += sum(sizes)
        seen.update(ids)
    return hit, total


def simulate_dead_first(reqs: list[tuple[list, list[int]]], capacity: int, measure_from: int = 0) -> tuple[int, int]:
    """A half-oracle: lru-prefix, except that cached blocks no later request uses are evicted first.

    It knows *whether* a block will be used again, not *when*: the gap between it and OPT is what knowing the time
    of the next use is worth, the gap between it and lru-prefix what a perfect predictor of reuse would be worth."""
    from promptcache.sidecar.trace import simulate_policy
    from promptcache.sidecar.policies import PrefixLRU

    remaining: dict = {}
    for ids, _ in reqs:
        for k in ids:
            remaining[k] = remaining.get(k, 0) + 1

    class DeadFirst(PrefixLRU):
        name = "dead-first"

        def requested(self, key):
            remaining[key] -= 1

        def inserted(self, key, size, parent):
            self._add(key, size, parent, 0, (remaining[key] > 0, self._clock + 1))

        def accessed(self, key):
            if key in self.size:
                self.prio[key] = (remaining[key] > 0, self._clock + 1)
                self._push(key)

    r = simulate_policy(reqs, DeadFirst(capacity), capacity, measure_from=measure_from)
    return r["hit"], r["total"]
