"""Online miss-ratio curve: the token hit ratio this cache would have at other sizes, from miniature simulations.

Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations" (USENIX ATC'17): run the real
eviction policy in K small simulated caches of capacity R x C_i over a hash-sampled fraction R of the traffic;
the hit ratio of miniature i estimates the full cache's at size C_i. SHARDS' stack distances would assume LRU; a
miniature runs whatever policy the sidecar runs (promptcache.sidecar.policies, through make_policy), so the curve
follows the default.

Prefix semantics are kept by sampling whole chains: a request is sampled iff its ROOT key (chunk 0's) is, so
every chunk of a sampled request, and every request sharing that root, lands in the same miniatures. A request
hits its leading run of cached chunks; its missing chunks are stored, in order, when a Put carries them, exactly as
the exact replay (promptcache.sidecar.trace.simulate_policy, which `promptcache bench replay` runs) does: a chunk whose parent is not cached is not
stored, `admit` is asked when room must be made, `victim` until it fits.

The estimate's spread grows with the share of traffic under the largest roots: with only a few roots (one shared
system prompt in front of everything) a low rate samples a handful of them; raise --mrc-sample-rate there.

Pure and I/O-free; promptcache.sidecar.observer feeds it off the request path.
"""
from __future__ import annotations

from dataclasses import dataclass

from promptcache.sidecar.policies import Key, key_hash64, make_policy

_U64 = 1 << 64


def root_hash(root: Key) -> int:
    """64 uniform bits of a chain root. Chunk keys are SHA-256 outputs, so their bytes are already uniform: no hashing
    on the request path. Other keys (ints in the replayer) are mixed first."""
    if isinstance(root, (bytes, bytearray)) and len(root) >= 16:
        return int.from_bytes(root[8:16], "little")
    return key_hash64(root)


def sampled(root: Key, rate: float) -> bool:
    """Is the chain under `root` in a sample of rate `rate`? Samples of lower rates are subsets of higher ones."""
    return rate >= 1.0 or root_hash(root) < rate * _U64


class Miniature:
    """One simulated cache: the real policy over `capacity` bytes of the chains sampled at `rate`."""

    __slots__ = ("size", "rate", "capacity", "policy", "present", "used", "hit_tokens", "lookup_tokens")

    def __init__(self, policy_name: str, size: int, rate: float) -> None:
        self.size = size
        self.rate = rate
        self.capacity = max(1, int(size * rate))
        self.policy = make_policy(policy_name, capacity=self.capacity)
        self.present: dict[Key, int] = {}
        self.used = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    def lookup(self, keys: list[Key], chunk_tokens: int, prompt_tokens: int) -> int:
        """A read of a whole prompt: returns the chunks of its leading cached run (and counts their tokens)."""
        policy, present = self.policy, self.present
        for k in keys:
            policy.requested(k)
        n = 0
        while n < len(keys) and keys[n] in present:
            n += 1
        for k in keys[:n]:
            policy.accessed(k)
        self.hit_tokens += n * chunk_tokens
        self.lookup_tokens += prompt_tokens
        return n

    def store(self, keys: list[Key], chunk_bytes: int) -> None:
        """A Put of the prompt's first len(keys) chunks: store the ones missing here, in order."""
        policy, present = self.policy, self.present
        n = 0
        while n < len(keys) and keys[n] in present:
            n += 1
        parent = keys[n - 1] if n else None
        for k in keys[n:]:
            if parent is not None and parent not in present:
                return  # unreachable: no lookup could get past its missing parent
            if k in present:
                policy.accessed(k)
                parent = k
                continue
            if self.used + chunk_bytes > self.capacity:
                if chunk_bytes > self.capacity or not policy.admit(k, chunk_bytes, parent):
                    return
                while self.used + chunk_bytes > self.capacity:
                    v = policy.victim()
                    if v is None:
                        break
                    self.used -= present.pop(v)
                    policy.removed(v)
                if self.used + chunk_bytes > self.capacity or (parent is not None and parent not in present):
                    return
            present[k] = chunk_bytes
            self.used += chunk_bytes
            policy.inserted(k, chunk_bytes, parent)
            parent = k


@dataclass(frozen=True)
class Point:
    capacity_bytes: int     # the full-size cache this miniature stands for
    hit_tokens: int         # sampled tokens it would have served
    lookup_tokens: int      # sampled tokens looked up
    rate: float             # its sample rate

    @property
    def hit_ratio(self) -> float | None:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else None


MAX_RAISED_RATE = 0.25
# The rates of all miniatures add up to at most this once raised (the raises are scaled down together to fit): each
# sampled request is simulated in every miniature whose rate takes it, so the sum is the curve's policy work per
# request of traffic, relative to the cache's own. At 1 the curve never costs more than the cache it estimates; a
# small cache (a few hundred chunks, where every size below ~8x the budget would be raised towards 1/4) is where it
# binds. A --mrc-sample-rate whose plain sum is higher is kept as asked (no raise then).
MAX_TOTAL_RATE = 1.0


class MissRatioCurve:
    """K miniatures of one policy at full-size capacities `sizes` (bytes), each over a sample of rate `rate`, raised
    for a small size until its miniature holds at least `min_chunks` chunks: a miniature of a few requests' chunks
    is all granularity (a prefix-blind LRU of 17 chunks never hits requests of 30); raised at most to 1/4 each, and
    all raises scaled down together so that the rates add up to at most MAX_TOTAL_RATE. The floor needs the chunk
    size, so the miniatures are made at the first sampled request (one model's chunks; others are simulated at its
    rates)."""

    def __init__(self, sizes: list[int], rate: float, policy_name: str, min_chunks: int = 0) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"sample rate {rate} is not in (0, 1]")
        if not sizes or min(sizes) <= 0:
            raise ValueError("miss-ratio curve sizes must be positive")
        self.rate = rate
        self.min_chunks = min_chunks
        self.policy_name = policy_name
        self.sizes = sorted(set(int(s) for s in sizes))
        self.minis: list[Miniature] = []
        self.chunk_bytes: int | None = None
        self._rates: dict[int, list[float]] = {}  # chunk bytes -> rates(): asked by the request path until minis exist

    def rate_for(self, size: int, chunk_bytes: int) -> float:
        """`rate`, raised for a small size towards `min_chunks` chunks, but never above MAX_RAISED_RATE (the cost:
        a cache of a few large chunks would otherwise simulate every request)."""
        floor = min(MAX_RAISED_RATE, self.min_chunks * chunk_bytes / size)
        return min(1.0, max(self.rate, floor))

    def rates(self, chunk_bytes: int) -> list[float]:
        """Each size's rate: rate_for's, with the raises above `rate` scaled down by one factor where the rates
        would add up to more than MAX_TOTAL_RATE (the order of the sizes' rates is kept). Computed once per chunk
        size."""
        known = self._rates.get(chunk_bytes)
        if known is not None:
            return known
        wanted = [self.rate_for(s, chunk_bytes) for s in self.sizes]
        base = self.rate * len(wanted)
        raised = sum(wanted) - base
        if sum(wanted) > MAX_TOTAL_RATE and raised > 0:
            scale = max(0.0, MAX_TOTAL_RATE - base) / raised
            wanted = [self.rate + (w - self.rate) * scale for w in wanted]
        if len(self._rates) >= 64:  # one per model's chunk size; a client cycling through layouts cannot grow it
            self._rates.clear()
        self._rates[chunk_bytes] = wanted
        return wanted

    def max_rate(self, chunk_bytes: int) -> float:
        """The highest rate of any miniature (the smallest size's): what the request path samples at."""
        if self.minis:
            return self.minis[0].rate
        return self.rates(self.chunk_bytes or chunk_bytes)[0]

    def _minis(self, chunk_bytes: int) -> list[Miniature]:
        if not self.minis:
            self.chunk_bytes = chunk_bytes
            self.minis = [Miniature(self.policy_name, s, r) for s, r in zip(self.sizes, self.rates(chunk_bytes))]
        return self.minis

    def lookup(self, keys: list[Key], chunk_tokens: int, prompt_tokens: int, chunk_bytes: int) -> None:
        """A Lookup or Get of a whole prompt of `prompt_tokens` tokens whose whole chunks have `keys`."""
        if keys:
            h = root_hash(keys[0])
            for m in self._minis(chunk_bytes):
                if m.rate >= 1.0 or h < m.rate * _U64:
                    m.lookup(keys, chunk_tokens, prompt_tokens)

    def store(self, keys: list[Key], chunk_bytes: int) -> None:
        if keys:
            h = root_hash(keys[0])
            for m in self._minis(chunk_bytes):
                if m.rate >= 1.0 or h < m.rate * _U64:
                    m.store(keys, chunk_bytes)

    def points(self) -> list[Point]:
        if not self.minis:
            return [Point(s, 0, 0, self.rate) for s in self.sizes]
        return [Point(m.size, m.hit_tokens, m.lookup_tokens, m.rate) for m in self.minis]

    def entries(self) -> int:
        """Chunks held by all miniatures together (their state is proportional to it)."""
        return sum(len(m.present) for m in self.minis)


def default_sizes(budget: int) -> list[int]:
    """The budget times 2^(k/2), k = -4..6: a quarter to eight times it in steps of sqrt(2)."""
    return [int(budget * 2 ** (k / 2)) for k in range(-4, 7)]


def parse_sizes(text: str, budget: int) -> list[int]:
    """--mrc-sizes: empty for default_sizes(budget), else comma-separated byte sizes (Kubernetes quantities)."""
    from promptcache.sidecar.config import parse_bytes

    if not text.strip():
        return default_sizes(budget)
    out = []
    for part in text.split(","):
        n = parse_bytes(part.strip())
        if n <= 0:
            raise ValueError(f"size {part.strip()!r} is not positive")
        out.append(n)
    return out


def request_path(policy: str, calls: int = 20000) -> None:
    """What a request thread pays: TrafficObserver.lookup of a 30-chunk prompt of a 7B-class model at the default
    rate (queueing the sampled few; the observer is not started), beside computing the 30 chunk keys."""
    import hashlib
    import time

    from promptcache.contract import keys as keyspec
    from promptcache.sidecar.observer import TrafficObserver

    spec = keyspec.ModelSpec("m", "r", "float16", num_layers=32, num_kv_heads=8, head_dim=128)
    observer = TrafficObserver(256, MissRatioCurve(default_sizes(64 << 30), 1 / 64, policy, 32),
                               queue_events=calls)
    prompts = [[hashlib.sha256(f"{i}/{j}".encode()).digest() for j in range(30)] for i in range(calls)]
    t0 = time.perf_counter()
    for ks in prompts:
        observer.lookup(spec, ks, 30 * 256)
    per_call = (time.perf_counter() - t0) / calls
    fp, tokens = keyspec.fingerprint(spec), list(range(30 * 256))
    t0 = time.perf_counter()
    for _ in range(100):
        keyspec.chunk_keys(fp, tokens, 256)
    keys_cost = (time.perf_counter() - t0) / 100
    print(f"request path: {per_call * 1e6:.1f} us per Lookup of 30 chunks (64 GiB budget, 1/64; "
          f"{observer._queue.qsize()} of {calls} queued), computing its chunk keys: {keys_cost * 1e6:.0f} us")


def _main(argv: list[str] | None = None) -> int:
    """Accuracy, memory and cost of the curve on a trace: `python -m promptcache.sidecar.mrc --trace FILE`."""
    import argparse
    import time
    import tracemalloc

    from promptcache.sidecar import trace
    from promptcache.sidecar.policies import DEFAULT_POLICY
    from promptcache.sidecar.trace import simulate_policy

    ap = argparse.ArgumentParser(prog="python -m promptcache.sidecar.mrc", description=_main.__doc__)
    ap.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    ap.add_argument("--requests", type=int, default=0, help="use the first N requests (0: all)")
    ap.add_argument("--rate", type=float, action="append", help="sample rate (repeatable; default 1/64 1/16 1/4)")
    ap.add_argument("--budget-fraction", type=float, default=0.10,
                    help="the cache budget as a fraction of the working set; the sizes are default_sizes(budget)")
    ap.add_argument("--policy", default=DEFAULT_POLICY)
    ap.add_argument("--min-chunks", type=int, default=32, help="as --mrc-min-chunks (default 32)")
    args = ap.parse_args(argv)
    try:
        reqs = trace.read_trace(args.trace)
    except ValueError as exc:  # names the file and the line
        ap.exit(2, f"{ap.prog}: {exc}\n")
    reqs = reqs[:args.requests] if args.requests else reqs
    chunk = 1 << 20   # every chunk 1 MiB (the sidecar's chunks of one model are all alike)
    ws = len({k for r in reqs for k in r.hash_ids}) * chunk
    sizes = default_sizes(int(ws * args.budget_fraction))
    prepared = [(r.hash_ids, [chunk] * len(r.hash_ids)) for r in reqs]
    exact = []
    for s in sizes:
        r = simulate_policy(prepared, make_policy(args.policy, capacity=s), s)
        exact.append(r["hit"] / max(1, r["total"]))
    print(f"# {len(reqs)} requests, working set {ws // chunk} chunks, policy {args.policy}, sizes "
          f"{', '.join(f'{s / ws:.3f}' for s in sizes)} of the working set")
    print("exact  " + " ".join(f"{x:.3f}" for x in exact))
    def feed(curve: MissRatioCurve) -> int:
        n = 0
        for r in reqs:
            if r.hash_ids and sampled(r.hash_ids[0], curve.max_rate(chunk)):
                n += 1
                curve.lookup(r.hash_ids, 1, len(r.hash_ids), chunk)
                curve.store(r.hash_ids, chunk)
        return n

    for rate in args.rate or [1 / 64, 1 / 16, 1 / 4]:
        curve = MissRatioCurve(sizes, rate, args.policy, args.min_chunks)
        t0 = time.perf_counter()
        sampled_requests = feed(curve)
        spent = time.perf_counter() - t0
        tracemalloc.start()   # again, traced, for the state's size
        before = tracemalloc.get_traced_memory()[0]
        traced = MissRatioCurve(sizes, rate, args.policy, args.min_chunks)
        feed(traced)
        state = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        est = [p.hit_ratio or 0.0 for p in curve.points()]
        mae = sum(abs(a - b) for a, b in zip(est, exact)) / len(exact)
        print(f"rate {rate:.4f} (smallest size {curve.max_rate(chunk):.4f}): {sampled_requests} requests sampled, "
              f"MAE {mae:.4f}, state {state / 2**20:.2f} MiB "
              f"({curve.entries()} entries), {spent / max(1, sampled_requests) * 1e3:.2f} ms per sampled request, "
              f"{spent / len(reqs) * 1e6:.0f} us per request")
        print("online " + " ".join(f"{x:.3f}" for x in est))
    request_path(args.policy)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
