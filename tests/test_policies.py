"""Eviction policies: protocol behaviour and property tests (hypothesis)."""
from __future__ import annotations

import pathlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.sidecar.trace import simulate_policy
from promptcache.sidecar.policies import (DEFAULT_POLICY, LRU, POLICIES, ROOT_PARENT, ClassRate, FrequencySketch,
                                          WTinyLFU, make_policy)

PREFIX_AWARE = [n for n in POLICIES if n != "lru"]


def test_make_policy_names_and_default():
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        p = make_policy(name, capacity=1000)
        assert p.name == name
        assert p.victim() is None
    with pytest.raises(ValueError, match="not one of"):
        make_policy("nope")


def test_lru_unchanged():
    p = LRU()
    for k in (b"a", b"b", b"c"):
        p.inserted(k, 1, None)
    p.accessed(b"a")
    assert p.victim() == b"b"
    p.removed(b"b")
    assert p.victim() == b"c"


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_parent_outlives_child(name):
    p = make_policy(name, capacity=3)
    p.inserted(b"root", 1, ROOT_PARENT)
    p.inserted(b"mid", 1, b"root")
    p.inserted(b"leaf", 1, b"mid")
    order = []
    while (v := p.victim()) is not None:
        order.append(v)
        p.removed(v)
    assert order == [b"leaf", b"mid", b"root"]


def test_frequency_sketch_counts_and_ages():
    s = FrequencySketch(64)
    assert s.frequency(b"x" * 32) == 0
    s.increment(b"x" * 32)
    assert s.frequency(b"x" * 32) == 1  # doorkeeper
    for _ in range(20):
        s.increment(b"x" * 32)
    assert s.frequency(b"x" * 32) == 16  # 15 (saturated) + doorkeeper
    for i in range(s.sample_size):
        s.increment(i)
    assert s.resets >= 1
    assert s.frequency(b"x" * 32) <= 8


def test_wtinylfu_resists_a_scan():
    """A hot set survives a long one-off scan under W-TinyLFU, not under LRU."""
    hot = [(i,) for i in range(50)]
    cap = 100

    def trace():
        reqs = []
        rng = random.Random(1)
        for _ in range(400):
            reqs.append(([rng.choice(hot)[0]], [1]))
        for i in range(1000, 1600):  # scan: each block once
            reqs.append(([i], [1]))
            reqs.append(([rng.choice(hot)[0]], [1]))
        return reqs

    results = {}
    for name, pol in (("lru", make_policy("lru", capacity=cap)), ("wtinylfu", make_policy("wtinylfu", capacity=cap)),
                      ("wtinylfu-w50", WTinyLFU(cap, window=0.5))):
        r = simulate_policy(trace(), pol, cap)
        results[name] = r["hit"] / r["total"]
    # The frequency filter guards the main space: with half the cache behind it the hot set survives the scan.
    assert results["wtinylfu-w50"] > results["lru"] + 0.05, results
    # The default starts with an 80 % window (recency-heavy prefix reuse, docs/eviction.md): only 20 of the 50
    # hot keys fit behind the filter before the climber has had a sample, so its margin here is smaller.
    assert results["wtinylfu"] > results["lru"] + 0.01, results


# ---------------------------------------------------------------------------------------------------------------
# Property tests: random chained workloads through the simulated store, and random hook sequences.

chains = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 8), st.integers(0, 3)),  # (prefix family, length, branch)
    min_size=1, max_size=120)


def _requests(spec):
    """Chained block ids: block j of (family, branch) shares ids with other branches up to the branch point."""
    reqs = []
    for fam, length, branch in spec:
        ids, sizes = [], []
        for j in range(length):
            ids.append(fam * 10_000 + j * 10 + (branch + 1 if j >= 2 else 0))
            sizes.append(1 + (fam + j) % 3)
        reqs.append((ids, sizes))
    return reqs


class CheckingPolicy:
    """Wraps a policy and checks the protocol invariants at every victim() call."""

    def __init__(self, inner, prefix_aware):
        self.inner = inner
        self.name = inner.name
        self.prefix_aware = prefix_aware
        self.present: dict = {}  # key -> parent

    def requested(self, key):
        self.inner.requested(key)

    def admit(self, key, size, parent):
        return self.inner.admit(key, size, parent)

    def inserted(self, key, size, parent):
        self.present[key] = parent
        self.inner.inserted(key, size, parent)

    def accessed(self, key):
        self.inner.accessed(key)

    def removed(self, key):
        del self.present[key]
        self.inner.removed(key)

    def victim(self):
        v = self.inner.victim()
        if self.present:
            assert v is not None, "victim() is None while entries are cached"
            assert v in self.present, "victim is not a cached key"
            if self.prefix_aware:
                assert v not in set(self.present.values()), "a parent was offered before its cached child"
        else:
            assert v is None
        return v


@pytest.mark.parametrize("name", list(POLICIES))
@settings(max_examples=60, deadline=None)
@given(spec=chains, cap=st.integers(1, 40), known=st.booleans())
def test_replay_invariants(name, spec, cap, known):
    pol = CheckingPolicy(make_policy(name, capacity=cap if known else None), name != "lru")
    r = simulate_policy(_requests(spec), pol, cap)  # asserts the capacity is never exceeded
    assert 0 <= r["hit"] <= r["total"]


ops = st.lists(st.tuples(st.sampled_from(["ins", "acc", "rem", "evict", "req"]), st.integers(0, 30)),
               min_size=1, max_size=300)


@pytest.mark.parametrize("name", list(POLICIES))
@settings(max_examples=80, deadline=None)
@given(seq=ops)
def test_random_hook_sequences(name, seq):
    """Arbitrary interleavings, including removals the policy did not choose (TTL, delete, purge) that can leave
    orphans: the victim is always a cached key, and a leaf for prefix-aware policies."""
    pol = CheckingPolicy(make_policy(name), name != "lru")
    for op, k in seq:
        key = k.to_bytes(2, "big")
        parent = (k // 2).to_bytes(2, "big") if k > 0 else ROOT_PARENT  # a binary tree of keys
        if op == "ins" and key not in pol.present:
            pol.inserted(key, 1 + k % 4, parent if k > 0 else None)
        elif op == "acc" and key in pol.present:
            pol.accessed(key)
        elif op == "rem" and key in pol.present:
            pol.removed(key)
        elif op == "req":
            pol.requested(key)
        elif op == "evict":
            v = pol.victim()
            if v is not None:
                pol.removed(v)
    while pol.present:  # drains completely, leaves first
        pol.removed(pol.victim())
    assert pol.victim() is None


def test_wtinylfu_without_capacity_infers_it():
    p = WTinyLFU()
    for i in range(100):
        p.inserted(i, 1, i - 1 if i else None)
    seen = []
    for _ in range(100):
        v = p.victim()
        seen.append(v)
        p.removed(v)
    assert seen == list(range(99, -1, -1))


def test_sketch_of_a_huge_budget_stays_bounded_and_consistent():
    """Found by the fuzzer: Resize(2**62) made W-TinyLFU size its sketch for billions of entries."""
    from promptcache.sidecar.policies import FrequencySketch, make_policy

    sketch = FrequencySketch(2**40)
    assert sketch.entries == FrequencySketch.MAX_ENTRIES and len(sketch._rows[0]) == sketch.width
    policy = make_policy("wtinylfu", capacity=1 << 20)
    policy.inserted(b"k" * 32, 4096, None)
    policy.resize(2**62)
    for i in range(64):
        key = i.to_bytes(32, "little")
        policy.requested(key)
        policy.inserted(key, 4096, None)
    assert policy.victim() is not None


def test_default_beats_lru_on_a_small_chat_trace():
    """Issue #3's target on a small draw of the chat generator (the cell the 50 % start window lost on)."""
    from promptcache_devtools.bench import replay, traces

    reqs, ws = replay.prepare(traces.generate("chat", seed=0, scale=0.2))
    for fraction in (0.05, 0.10):
        cap = int(ws * fraction)
        lru = simulate_policy(reqs, make_policy("lru", capacity=cap), cap)
        default = simulate_policy(reqs, make_policy(DEFAULT_POLICY, capacity=cap), cap)
        assert default["hit"] > lru["hit"], (fraction, default["hit"], lru["hit"])


def test_wtinylfu_window_stays_within_bounds():
    """The hill climber never takes the window past max_window: a TinyLFU-filtered main space always remains."""
    from promptcache_devtools.bench import replay, traces

    reqs, ws = replay.prepare(traces.generate("agent", seed=1, scale=0.1))
    cap = int(ws * 0.1)
    p = WTinyLFU(cap, climb_period=0.5)  # many climbs
    seen = []
    orig = p._climb

    def climb():
        orig()
        seen.append(p.window_fraction)

    p._climb = climb
    simulate_policy(reqs, p, cap)
    assert seen and all(p.min_window <= w <= p.max_window == 0.9 for w in seen)


@pytest.mark.parametrize("adapt", ["ghost", "none"])
@settings(max_examples=30, deadline=None)
@given(spec=chains, cap=st.integers(1, 40))
def test_replay_invariants_of_the_experimental_adaptations(adapt, spec, cap):
    pol = CheckingPolicy(WTinyLFU(cap, adapt=adapt), True)
    r = simulate_policy(_requests(spec), pol, cap)
    assert 0 <= r["hit"] <= r["total"]


def _sizes_of_state(obj, seen=None) -> list[tuple[str, int]]:
    """(attribute path, length) of every container a policy holds, nested ones included."""
    out = []
    for name, value in vars(obj).items():
        if isinstance(value, (dict, set, list, bytearray)):
            out.append((name, len(value)))
            if isinstance(value, list):
                out.extend((f"{name}[{i}]", len(v)) for i, v in enumerate(value)
                           if isinstance(v, (dict, set, list, bytearray)))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            out.extend((f"{name}.{n}", size) for n, size in _sizes_of_state(value))
    return out


@pytest.mark.parametrize("name", list(POLICIES))
def test_state_stays_bounded_by_the_cached_entries(name):
    """Bounded memory: 4,000 requests, most of them distinct chains, through a 200-block cache leave no container
    in the policy larger than a small multiple of what is cached (the sketch has a fixed width; heaps are compacted;
    the chain roots W-TinyLFU's doorkeeper refused are bounded by the sketch's width). Churn is evictions or
    refusals: the doorkeeper refuses most one-off chains instead of evicting for them."""
    rng = random.Random(7)
    reqs = []
    for i in range(4000):
        fam = i if rng.random() < 0.7 else rng.randrange(50)  # mostly one-off chains, some reused
        length = rng.randint(1, 8)
        reqs.append(([fam * 100 + j for j in range(length)], [1] * length))
    cap = 200
    policy = make_policy(name, capacity=cap)
    r = simulate_policy(reqs, policy, cap)
    assert r["evictions"] + r["rejections"] > 4_000  # 20x the cache turned over
    limit = 10 * cap + 1024
    sizes = _sizes_of_state(policy)
    assert sizes and all(n <= limit for _, n in sizes), [(k, n) for k, n in sizes if n > limit]


class EvictionCounter(CheckingPolicy):
    """Checks that each victim was asked for while the block inserted next did not fit yet."""

    def __init__(self, inner, prefix_aware, capacity):
        super().__init__(inner, prefix_aware)
        self.capacity = capacity
        self.sizes: dict = {}
        self.used = 0
        self.calls = []  # cache occupancy at each victim() call since the last insertion

    def requested(self, key):
        self.calls.clear()  # a new request: the previous one gave up on its block (its parent was evicted)
        super().requested(key)

    def inserted(self, key, size, parent):
        assert all(used + size > self.capacity for used in self.calls), (self.calls, size, self.capacity)
        self.calls.clear()
        super().inserted(key, size, parent)
        self.sizes[key] = size
        self.used += size

    def removed(self, key):
        super().removed(key)
        self.used -= self.sizes.pop(key)

    def victim(self):
        self.calls.append(self.used)
        return super().victim()


@pytest.mark.parametrize("name", list(POLICIES))
@settings(max_examples=40, deadline=None)
@given(spec=chains, cap=st.integers(3, 40))
def test_never_evicts_beyond_need(name, spec, cap):
    """Victims are asked for only while the incoming block does not fit: no entry is evicted for nothing."""
    pol = EvictionCounter(make_policy(name, capacity=cap), name != "lru", cap)
    r = simulate_policy(_requests(spec), pol, cap)
    assert r["evictions"] <= sum(len(ids) for ids, _ in _requests(spec))


# --------------------------------------------------------------------------------------------------------------
# ReuseRate ("rate"): per-chunk mean gap between requests, decayed by silence; sampled leaves.

def _req(p, *keys):
    for k in keys:
        p.requested(k)


def _rate_policy(capacity: int):
    """A "rate" policy that has seen 200 chunks requested once and never again: it has learned that a fresh chunk
    is rarely requested a second time (tests that compare fresh with proven chunks do not then hang on the prior)."""
    p = make_policy("rate", capacity=capacity)
    _req(p, *(b"once%d" % i for i in range(200)))
    return p


def test_rate_keeps_a_chunk_that_returns_quickly_over_one_seen_once():
    p = _rate_policy(10)
    for k in (b"hot", b"once"):
        p.requested(k)
        p.inserted(k, 1, None)
    for _ in range(5):  # hot returns every few references; "once" is never requested again
        _req(p, b"x1", b"x2", b"hot")
    assert p.victim() == b"once"


def test_rate_evicts_a_proven_chunk_once_it_is_silent_for_many_of_its_gaps():
    p = _rate_policy(10)
    p.requested(b"burst")
    p.inserted(b"burst", 1, None)
    for _ in range(3):
        p.requested(b"burst")  # gap 1: a source that returned at once, three times
    p.requested(b"new")
    p.inserted(b"new", 1, None)
    assert p.victim() == b"new"  # silent for 1 of its gaps: still the better bet
    _req(p, *(b"filler%d" % i for i in range(50)))  # 50 references later "burst" has most likely ended
    assert p.victim() == b"burst"


def test_rate_learns_how_often_fresh_chunks_return():
    """Fresh chunks (requested once) get the learned mean time to a second request: where they never return it
    grows, so a fresh chunk ranks below a proven chunk that has been silent for a while; where they do, above."""
    def fresh_against_stale(returns: bool) -> bytes:
        p = make_policy("rate", capacity=10)
        for i in range(4000):  # a stream of fresh chunks, each requested again 8 references later or never
            k = b"f%d" % i
            p.requested(k)
            if returns and i >= 8:
                p.requested(b"f%d" % (i - 8))
        _req(p, b"stale", b"stale")  # a proven chunk (gap 1) ...
        p.inserted(b"stale", 1, None)
        _req(p, b"fresh")
        p.inserted(b"fresh", 1, None)
        _req(p, *(b"g%d" % i for i in range(3)))  # ... silent for 4 references, as long as "fresh" is old
        return p.victim()

    assert fresh_against_stale(returns=False) == b"fresh"
    assert fresh_against_stale(returns=True) == b"stale"


def test_rate_passes_over_the_parent_of_the_entry_being_admitted():
    p = _rate_policy(2)
    _req(p, b"a", b"a", b"a")  # "a" is the better bet (proven), "p" the one that would be evicted ...
    p.inserted(b"a", 1, None)
    _req(p, b"p")
    p.inserted(b"p", 1, None)
    assert p.victim() == b"p"
    assert p.admit(b"c", 1, b"p")  # ... but "c" extends "p": evicting "p" would leave "c" unreachable
    assert p.victim() == b"a"
    p.removed(b"a")
    p.inserted(b"c", 1, b"p")
    assert p.victim() == b"c"  # "p" has a cached child now, and no other leaf is protected


def test_rate_class_learns_a_reuse_rate_per_class_of_fresh_chunk():
    """`rate-class` (the fifth round's default): fresh chunks get the return rate of their class, learned online. Trained on
    chains whose full root is requested again 8 references later and whose partial last chunk never is, it evicts a
    new partial chunk before an older full one; `rate` (one rate for every fresh chunk) evicts the older one - the
    negative control."""
    def victim(name: str) -> bytes:
        p = make_policy(name, capacity=1 << 20)
        for i in range(400):
            f, q = b"f%d" % i, b"p%d" % i
            _req(p, f, q)
            p.inserted(f, 2, None)
            p.inserted(q, 1, f)  # smaller than the largest chunk seen: a partial last block
            if i >= 8:
                p.requested(b"f%d" % (i - 8))
        for i in range(400):
            p.removed(b"p%d" % i)
            p.removed(b"f%d" % i)
        _req(p, b"A")
        p.inserted(b"A", 2, None)  # fresh, full, the older
        _req(p, b"R", b"B")
        p.inserted(b"R", 2, None)
        p.inserted(b"B", 1, b"R")  # fresh, partial, the newer
        assert sorted(p.leaves()) == [b"A", b"B"]
        return p.victim()

    assert victim("rate-class") == b"B"
    assert victim("rate") == b"A"


def test_rate_class_root_door_option_admits_a_new_chain_on_its_second_appearance():
    """The experimental `root_door` (off in the default, docs/eviction.md fifth round): a new chain root is refused
    the first time room must be made for it, admitted the second (also for a writer that never looks up)."""
    on, off = ClassRate(capacity=4, root_door=True), ClassRate(capacity=4)
    for p in (on, off):
        p.requested(b"r")
    assert not on.admit(b"r", 1, ROOT_PARENT) and on.admissions_rejected == 1
    assert on.admit(b"r", 1, ROOT_PARENT)               # seen before (refused once)
    assert on.admit(b"child", 1, b"r")                  # under a parent: never filtered
    assert off.admit(b"r", 1, ROOT_PARENT)              # the default has no doorkeeper


CONVERSATION_TRACE = (pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
                      / "mooncake-fast25-conversation-first-half.jsonl")


@pytest.mark.skipif(not CONVERSATION_TRACE.exists(), reason=f"the conversation trace is not at {CONVERSATION_TRACE}")
@pytest.mark.slow
def test_rate_class_beats_rate_at_10_percent_on_the_tuning_quarter_of_the_conversation_trace():
    """Why the classes (docs/eviction.md, fifth round): on the first half of the conversation trace's first half,
    `rate` is 1.18x LRU at 10 %, `rate-class` 1.28x."""
    from promptcache_devtools.bench import replay, traces

    first, _ = replay.split_halves(traces.read_trace(str(CONVERSATION_TRACE)))
    reqs, ws = replay.prepare(first)
    cap = int(ws * 0.10)
    hr = {n: (lambda r: r["hit"] / r["total"])(simulate_policy(reqs, make_policy(n, capacity=cap), cap))
          for n in ("lru", "rate", "rate-class")}
    assert hr["rate-class"] >= 1.25 * hr["lru"] > hr["rate"] + 0.001, hr


MOONCAKE_TRACE = (pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
                  / "mooncake-fast25-synthetic.jsonl")


@pytest.mark.skipif(not MOONCAKE_TRACE.exists(), reason=f"the Mooncake FAST'25 trace is not at {MOONCAKE_TRACE}")
@pytest.mark.slow
def test_rate_beats_lru_on_the_tuning_half_of_the_mooncake_trace():
    """What it was chosen for (docs/eviction.md, "Held out"): 1.61x LRU at 5 % and 1.27x at 10 % on the first half."""
    from promptcache_devtools.bench import replay, traces

    first, _ = replay.split_halves(traces.read_trace(str(MOONCAKE_TRACE)))
    reqs, ws = replay.prepare(first)
    for fraction, factor in ((0.05, 1.5), (0.10, 1.2)):
        cap = int(ws * fraction)
        lru = simulate_policy(reqs, make_policy("lru"), cap)
        rate = simulate_policy(reqs, make_policy("rate", capacity=cap), cap)
        assert rate["hit"] / rate["total"] >= factor * lru["hit"] / lru["total"], (fraction, rate, lru)


def test_wtinylfu_admits_a_new_chain_root_under_pressure_only_on_its_second_appearance():
    """The chain-root doorkeeper (docs/eviction.md): when room must be made, chunk 0 of a chain never seen before is
    refused; its second request, or a second Put without any request (a writer that never looks up), gets in.
    Chunks past the root are not filtered (their chain was admitted), and nothing is refused while there is room."""
    p = WTinyLFU(capacity=4)
    for k in ("a", "b", "c", "d"):
        p.requested(k)
        p.inserted(k, 1, ROOT_PARENT)  # not full yet: the store does not ask admit()
    p.requested("e")
    assert not p.admit("e", 1, ROOT_PARENT)  # first appearance, cache full
    p.requested("e")
    assert p.admit("e", 1, ROOT_PARENT)  # the same root requested again
    assert not p.admit("w", 1, None)  # a Put-only writer's first Put of a new root (None: the replay's root)
    assert p.admit("w", 1, None)  # ... and its second
    assert p.admit("x1", 1, "a")  # a chunk under a cached parent: TinyLFU's window decides, not the doorkeeper
    assert p.roots_refused == 2 and p.admissions_rejected == 2
    off = WTinyLFU(capacity=4, root_door=False)
    off.requested("e")
    assert off.admit("e", 1, ROOT_PARENT)


def test_the_root_doorkeeper_keeps_one_off_chains_from_flushing_reused_ones():
    """A scan of one-off chains through a full cache: the doorkeeper refuses them, so the reused chains stay; without
    it they are evicted by the scan. Replay semantics (every block requested, missing blocks stored in order)."""
    hot = [[h * 10 + j for j in range(3)] for h in range(4)]  # 4 reused chains of 3 blocks fill a 12-block cache
    reqs = []
    for i in range(400):
        reqs.append((hot[i % 4], [1] * 3))
        reqs.append(([1000 + i * 10 + j for j in range(3)], [1] * 3))  # a one-off chain
    on = simulate_policy(reqs, WTinyLFU(capacity=12), 12)
    off = simulate_policy(reqs, WTinyLFU(capacity=12, root_door=False), 12)
    assert on["hit"] / on["total"] > 0.45  # nearly every hot request (half the tokens) hits
    assert on["hit"] > off["hit"] + 0.05 * on["total"]
    assert on["rejections"] >= 300
