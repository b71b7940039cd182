"""Synthetic request traces in the Mooncake JSONL format.

The format (one JSON request per line, chained 512-token block ids), its record, reader and writer are shipped with
the sidecar, whose access log writes it: promptcache.sidecar.trace, re-exported here.

Generators (all deterministic for a seed; `scale` multiplies the number of requests):
  chat   multi-tenant chat: Zipf-popular tenants with long shared system prompts, multi-turn conversations
         whose history grows turn by turn, think time between turns.
  agent  agent loops: a few agent types with big tool-spec prompts; each task appends model output and tool
         results step after step, so every step extends the previous step's context.
  rag    retrieval-augmented generation: a few templates, then k documents drawn from a Zipf-popular pool in
         relevance order, then the question; plus follow-up questions on the same retrieval.
  scan   a hot chat workload interleaved with bursts of one-off long documents (batch summarisation) that are
         never reused and must not flush the cache.
"""
from __future__ import annotations

import heapq
import random
from typing import Iterator

# The record, its reader and writer, and the block helpers are the shipped trace format (the access log writes it):
# re-exported here for the generators and the benchmarks.
from promptcache.sidecar.trace import (  # noqa: F401
    BLOCK_TOKENS, Request, block_sizes, cached_run, read_trace, write_trace)


class _Blocks:
    """Turns prompts (sequences of (segment id, length) pieces) into chained 512-token block ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def hash_ids(self, segments: list[tuple[object, int]]) -> tuple[list[int], int]:
        ids: list[int] = []
        total = sum(n for _, n in segments)
        parent = -1
        pos = 0  # token position in the prompt
        seg_i, seg_off = 0, 0
        while pos < total:
            end = min(pos + BLOCK_TOKENS, total)
            label = []
            need = end - pos
            while need > 0:
                sid, n = segments[seg_i]
                take = min(need, n - seg_off)
                label.append((sid, seg_off, take))
                seg_off += take
                need -= take
                if seg_off == n:
                    seg_i += 1
                    seg_off = 0
            key = (parent, tuple(label))
            bid = self._ids.get(key)
            if bid is None:
                bid = self._ids[key] = len(self._ids)
            ids.append(bid)
            parent = bid
            pos = end
        return ids, total


class _Gen:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.blocks = _Blocks()
        self._seg = 0
        self.events: list[tuple[float, int, list, int]] = []  # (time s, seq, segments, output_length)
        self._seq = 0

    def seg(self) -> int:
        self._seg += 1
        return self._seg

    def zipf_index(self, n: int, s: float) -> int:
        # inverse-CDF sampling over precomputed weights (cached per (n, s))
        key = (n, s)
        cache = self.__dict__.setdefault("_zipf", {})
        if key not in cache:
            w = [1.0 / (i + 1) ** s for i in range(n)]
            acc, tot = [], 0.0
            for x in w:
                tot += x
                acc.append(tot)
            cache[key] = (acc, tot)
        acc, tot = cache[key]
        import bisect

        return bisect.bisect_left(acc, self.rng.random() * tot)

    def emit(self, t: float, segments: list, output_length: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, list(segments), output_length))

    def requests(self) -> list[Request]:
        out = []
        while self.events:
            t, _, segments, olen = heapq.heappop(self.events)
            ids, total = self.blocks.hash_ids(segments)
            out.append(Request(int(t * 1000), total, olen, ids))
        return out


def _chat_sessions(g: _Gen, n_requests: int, t0: float, duration: float, n_tenants: int, zipf_s: float) -> None:
    rng = g.rng
    tenants = [(g.seg(), rng.randint(600, 6000)) for _ in range(n_tenants)]
    made = 0
    while made < n_requests:
        tenant = tenants[g.zipf_index(n_tenants, zipf_s)]
        t = t0 + rng.random() * duration
        history = [tenant]
        turns = min(1 + int(rng.expovariate(1 / 3.0)), 24)
        for _ in range(turns):
            history.append((g.seg(), rng.randint(30, 600)))  # user message
            out = rng.randint(50, 600)
            g.emit(t, history, out)
            made += 1
            history.append((g.seg(), out))  # assistant answer joins the context
            t += rng.expovariate(1 / 45.0) + out / 40.0  # think time + generation
            if made >= n_requests:
                break


def chat(seed: int = 0, scale: float = 1.0) -> list[Request]:
    g = _Gen(seed)
    n = int(6000 * scale)
    _chat_sessions(g, n, 0.0, 3600.0 * scale, n_tenants=60, zipf_s=1.0)
    return g.requests()


def agent(seed: int = 0, scale: float = 1.0) -> list[Request]:
    g = _Gen(seed)
    rng = g.rng
    n_types = 8
    types = [[(g.seg(), rng.randint(1500, 8000))] for _ in range(n_types)]
    target = int(5000 * scale)
    made = 0
    duration = 3600.0 * scale
    while made < target:
        ctx = list(types[g.zipf_index(n_types, 0.8)])
        ctx.append((g.seg(), rng.randint(100, 1500)))  # the task
        t = rng.random() * duration
        steps = rng.randint(3, 40)
        for _ in range(steps):
            out = rng.randint(40, 400)
            g.emit(t, ctx, out)
            made += 1
            ctx.append((g.seg(), out))  # model's action
            ctx.append((g.seg(), int(rng.lognormvariate(6.0, 1.0)) + 20))  # tool result
            t += out / 50.0 + rng.expovariate(1 / 8.0)
            if made >= target or sum(n for _, n in ctx) > 120_000:
                break
    return g.requests()


def rag(seed: int = 0, scale: float = 1.0) -> list[Request]:
    g = _Gen(seed)
    rng = g.rng
    templates = [(g.seg(), rng.randint(300, 1500)) for _ in range(4)]
    pool = [(g.seg(), rng.randint(400, 2500)) for _ in range(3000)]
    n = int(6000 * scale)
    duration = 3600.0 * scale
    made = 0
    while made < n:
        tmpl = templates[g.zipf_index(len(templates), 1.0)]
        k = rng.randint(2, 5)
        docs = []
        while len(docs) < k:
            d = g.zipf_index(len(pool), 0.9)
            if d not in docs:
                docs.append(d)
        docs.sort()  # relevance order ~ popularity order: popular documents tend to come first
        t = rng.random() * duration
        ctx = [tmpl] + [pool[d] for d in docs]
        for _ in range(1 + int(rng.expovariate(1 / 1.0))):  # follow-up questions on the same retrieval
            q = (g.seg(), rng.randint(20, 200))
            g.emit(t, ctx + [q], rng.randint(50, 400))
            made += 1
            t += rng.expovariate(1 / 30.0)
    return g.requests()


def scan(seed: int = 0, scale: float = 1.0) -> list[Request]:
    g = _Gen(seed)
    rng = g.rng
    duration = 3600.0 * scale
    _chat_sessions(g, int(4000 * scale), 0.0, duration, n_tenants=30, zipf_s=1.1)
    # bursts of one-off documents: every ~4 minutes a batch of 10-40 unique 4k-24k-token documents
    t = 0.0
    while True:
        t += rng.expovariate(1 / 240.0)
        if t >= duration:
            break
        for i in range(rng.randint(10, 40)):
            g.emit(t + i * 0.5, [(g.seg(), rng.randint(4000, 24000))], rng.randint(100, 400))
    return g.requests()


GENERATORS = {"chat": chat, "agent": agent, "rag": rag, "scan": scan}


def generate(name: str, seed: int = 0, scale: float = 1.0) -> list[Request]:
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"synthetic trace {name!r} is not one of {', '.join(GENERATORS)}") from None
    return gen(seed=seed, scale=scale)


def stats(reqs: list[Request]) -> dict:
    unique = set()
    refs = 0
    for r in reqs:
        unique.update(r.hash_ids)
        refs += len(r.hash_ids)
    return {"requests": len(reqs), "block_refs": refs, "unique_blocks": len(unique),
            "input_tokens": sum(r.input_length for r in reqs)}


def iter_lines(reqs: list[Request]) -> Iterator[str]:
    for r in reqs:
        yield r.to_json()
