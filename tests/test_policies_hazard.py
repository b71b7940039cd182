"""ClassHazard (`rate-hazard`): `rate-class` with fresh chunks scored by a return hazard learned per class and age.
docs/eviction.md, "Sixth round" (issue #32)."""
from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.sidecar.policies import ROOT_PARENT, ClassHazard, ClassRate, make_policy
from promptcache.sidecar.trace import simulate_policy

TRACES = pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
SYNTHETIC = TRACES / "mooncake-fast25-synthetic.jsonl"


def test_protocol_and_prefix_semantics_in_the_server_key_space():
    p = ClassHazard(capacity=3)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    for k, parent in ((a, ROOT_PARENT), (b, a), (c, b)):
        p.requested(k)
        assert p.admit(k, 1, parent)
        p.inserted(k, 1, parent)
    assert p.victim() == c  # the only leaf
    p.removed(c)
    assert p.victim() == b
    assert ClassHazard(10).alive == 1.5 and ClassHazard(10).name == "rate-hazard"


workload = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=150)


@settings(max_examples=40, deadline=None)
@given(spec=workload, cap=st.integers(1, 25))
def test_replay_invariants_and_opt_bound(spec, cap):
    from promptcache_devtools.bench import opt

    reqs = [([fam * 1000 + j * 10 + (branch if j >= 2 else 9) for j in range(length)], [1] * length)
            for fam, length, branch in spec]
    r = simulate_policy(reqs, ClassHazard(cap, refresh=8), cap)  # raises on a victim not cached or over capacity
    assert r["hit"] <= opt.simulate_opt(reqs, cap)[0]


def _hazard(p: ClassHazard, c, b: int, r0: float) -> float:
    """ClassHazard's learned hazard of class `c` in age bucket `b`, written out as its docstring says (returns per
    exposure, shrunk by one pseudo-return to the pooled hazard, whose prior rate is r0): the reference that its
    _fresh_rate, which computes it inline, is checked against below."""
    pooled = (p._pr[b] + 1.0) / (p._pe[b] + p._popen[b] + 1.0 / r0)
    if c not in p._hr and c not in p._open:
        return pooled
    e = (p._he[c][b] if c in p._he else 0.0) + (p._open[c][b] if c in p._open else 0.0)
    return ((p._hr[c][b] if c in p._hr else 0.0) + 1.0) / (e + 1.0 / pooled)


def test_a_fresh_chunk_whose_follow_up_is_due_outranks_one_that_waited():
    """Fresh chunks of one class return within a few ticks or never: the learned hazard falls with age, so of two
    fresh chunks of that class the young one is kept even though a memoryless rate cannot tell them apart but by
    recency - and the old, long-silent one goes before a young one of the same class."""
    p = ClassHazard(capacity=10_000, fresh_sample=1, refresh=1)
    for i in range(400):  # one-block chains: half are asked again 2 ticks later, the rest never
        k = 10_000 + i
        p.requested(k)
        p.inserted(k, 512, None)
        if i % 2 == 0:
            p.requested(9_000_000 + i)  # unrelated traffic: time passes
            p.requested(k)
    p.victim()  # refresh the open records
    c = p._cls[10_001]
    young = _hazard(p, c, 1, p._class_rate(None))
    old = _hazard(p, c, 9, p._class_rate(None))
    assert young > 5 * old, (young, old)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_never_below_lru_on_the_generators_for_other_seeds(seed):
    """The regression guard of tests/test_replay.py (no cell more than 0.005 below LRU; seed 0 there, for the
    default) on seeds 1 and 2, where `rate-class` is 0.006-0.007 below LRU on rag. Issue #32's targets on the
    conversation trace's held-out quarter are tests/test_replay.py's, for the default."""
    from promptcache_devtools.bench import replay, traces

    for name in traces.GENERATORS:
        reqs, ws = replay.prepare(traces.generate(name, seed=seed))
        for fraction in replay.DEFAULT_FRACTIONS:
            cap = int(ws * fraction)
            lru = simulate_policy(reqs, make_policy("lru", capacity=cap), cap)
            other = simulate_policy(reqs, ClassHazard(cap), cap)
            assert other["hit"] / other["total"] >= lru["hit"] / lru["total"] - 0.005, (name, seed, fraction)


def _halves(path, half, fraction):
    from promptcache_devtools.bench import replay, traces

    reqs, ws = replay.prepare(replay.split_halves(traces.read_trace(str(path)))[half])
    cap = int(ws * fraction)
    return {name: (lambda r: r["hit"] / r["total"])(simulate_policy(reqs, pol, cap))
            for name, pol in (("lru", make_policy("lru", capacity=cap)), ("rate-class", ClassRate(cap)),
                              ("rate-hazard", ClassHazard(cap)))}


@pytest.mark.slow
@pytest.mark.skipif(not SYNTHETIC.exists(), reason=f"the synthetic trace is not at {SYNTHETIC}")
@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.10])
def test_above_rate_class_on_the_synthetic_halves(half, fraction):
    """Measured (docs/eviction.md, sixth round): first half 1.72 / 1.79 / 1.41x LRU (rate-class 1.30 / 1.62 / 1.27x),
    second half 1.31 / 1.06 / 1.04x (1.30 / 1.05 / 1.01x) at 2 / 5 / 10 %."""
    hr = _halves(SYNTHETIC, half, fraction)
    assert hr["rate-hazard"] > hr["rate-class"], hr  # issue #32's factors over LRU: tests/test_replay.py


class _Reference(ClassHazard):
    """ClassHazard through the general path its victim() inlines: ReuseRate.victim over _log_score, and each
    fresh rate summed bucket by bucket from the reference _hazard above."""

    def victim(self):
        if self.now - self._open_at >= self.refresh:
            self._refresh_open()
        return ClassRate.victim(self)

    def _fresh_rate(self, c, b0):
        r0 = self._class_rate(None)
        t = 0 if b0 == 0 else 1 << (b0 - 1)
        h = max(1.0, self._horizon)
        end, tot, b = t + h, 0.0, b0
        while t < end and b < self.NB:
            tot += (min(end, 1 << b) - t) * _hazard(self, c, b, r0)
            t, b = 1 << b, b + 1
        return tot / h


@pytest.mark.parametrize("name", ["chat", "rag"])
def test_the_inlined_victim_chooses_what_the_general_path_chooses(name):
    """victim() is ReuseRate.victim with the scoring inlined (the sidecar calls it for every chunk stored into a
    full tier, and every miss-ratio miniature does too): the same draws, scores and choices, victim by victim, on
    a generator's trace at a small and a large capacity, with more leaves than the sample (random draws) and
    fewer."""
    from promptcache_devtools.bench import replay, traces

    reqs, ws = replay.prepare(traces.generate(name, seed=3, scale=0.25))
    for fraction in (0.02, 0.25):
        cap = int(ws * fraction)
        chosen = {}
        for cls in (ClassHazard, _Reference):
            p = cls(cap)
            seen, victim = [], p.victim
            p.victim = lambda victim=victim, seen=seen: seen.append(victim()) or seen[-1]
            chosen[cls] = (simulate_policy(reqs, p, cap)["hit"], seen)
        assert len(chosen[ClassHazard][1]) > 100
        assert chosen[ClassHazard] == chosen[_Reference], (name, fraction)


def test_the_sample_draws_are_randrange_s():
    import random

    p = ClassHazard(10)
    for n in (33, 64, 1000, 4097):
        leaves = list(range(n))
        state = p._rng.getstate()
        ref = random.Random()
        ref.setstate(state)
        assert p._candidates(leaves) == [leaves[ref.randrange(n)] for _ in range(p.sample)]
    assert p._candidates([1, 2, 3]) == [1, 2, 3]


def _open_by_loop(p: ClassHazard) -> tuple[dict, list]:
    """The tracked chunks' exposure per class and age bucket, one chunk at a time, as _refresh_open's docstring
    says: the reference for its numpy passes."""
    nb, full, part = p.NB, {}, {}
    for key, t0 in p._tracked.items():
        c, a = p._cls[key], p.now - t0
        b = min(nb - 1, a.bit_length())
        full.setdefault(c, [0] * nb)[b] += 1
        part.setdefault(c, [0.0] * nb)[b] += a - (0 if b == 0 else 1 << (b - 1))
    opened, pooled = {}, [0.0] * nb
    for c, f in full.items():
        e, older = [0.0] * nb, 0
        for b in range(nb - 1, -1, -1):
            e[b] = older * (1 if b == 0 else 1 << (b - 1)) + part[c][b]
            older += f[b]
            pooled[b] += e[b]
        opened[c] = e
    return opened, pooled


@pytest.mark.parametrize("name", ["chat", "rag"])
def test_the_open_exposure_is_the_loop_s_exactly(name):
    """_refresh_open sums the tracked chunks' exposure in numpy (a Python loop over 100,000 of them took 43 ms under
    the store's lock every 1,024 ticks): equal, to the last bit, to the loop over the chunks, at points of a replay
    where chunks were tracked, untracked and re-used slots, and after a jump of the clock past the last age bucket."""
    from promptcache_devtools.bench import replay, traces

    reqs, ws = replay.prepare(traces.generate(name, seed=5, scale=0.25))
    p = ClassHazard(int(ws * 0.05), fresh_sample=1)
    checked, victim = [], p.victim

    def check_then_victim():
        if p.now % 97 == 0:
            p._refresh_open()
            assert (p._open, p._popen) == _open_by_loop(p)
            checked.append(len(p._tracked))
        return victim()

    p.victim = check_then_victim
    simulate_policy(reqs, p, int(ws * 0.05))
    assert len(checked) > 20 and max(checked) > 50 and p._free_slots  # slots were freed and taken again
    p.now += 1 << 40  # every tracked chunk far past the last bucket
    p._refresh_open()
    assert (p._open, p._popen) == _open_by_loop(p) and p._popen[-1] > 1 << 40
    assert len(p._slot) == len(p._tracked)
