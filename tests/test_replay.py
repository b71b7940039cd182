"""Trace generators, Mooncake JSONL I/O, OPT and the `promptcache bench replay` command."""
from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.sidecar.policies import DEFAULT_POLICY, POLICIES, make_policy
from promptcache_devtools.bench import opt, replay, traces


@pytest.mark.parametrize("name", list(traces.GENERATORS))
def test_generators_are_deterministic_and_chained(name):
    a = traces.generate(name, seed=3, scale=0.05)
    b = traces.generate(name, seed=3, scale=0.05)
    c = traces.generate(name, seed=4, scale=0.05)
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    assert [r.to_json() for r in a] != [r.to_json() for r in c]
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    parent_of = {}
    for r in a:
        assert len(r.hash_ids) == -(-r.input_length // traces.BLOCK_TOKENS)
        for i, h in enumerate(r.hash_ids):  # chained: an id always has the same parent id
            p = r.hash_ids[i - 1] if i else None
            assert parent_of.setdefault(h, p) == p


def test_prefix_reuse_exists_in_every_trace():
    for name in traces.GENERATORS:
        reqs, _ = replay.prepare(traces.generate(name, seed=0, scale=0.1))
        hit, total = opt.simulate_infinite(reqs)
        assert 0.2 < hit / total < 1.0, name


def test_scan_trace_has_one_off_documents():
    reqs = traces.generate("scan", seed=0, scale=0.2)
    seen_count = {}
    for r in reqs:
        for h in r.hash_ids:
            seen_count[h] = seen_count.get(h, 0) + 1
    once = sum(1 for v in seen_count.values() if v == 1)
    assert once > 0.5 * len(seen_count)


def test_mooncake_jsonl_round_trip(tmp_path):
    reqs = traces.generate("chat", seed=1, scale=0.02)
    path = tmp_path / "t.jsonl"
    traces.write_trace(str(path), reqs)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    back = traces.read_trace(str(path))
    assert [r.to_json() for r in back] == [r.to_json() for r in reqs]


def test_read_trace_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        traces.read_trace(str(path))


@pytest.mark.parametrize("content, words", [
    (b'{"timestamp":1,"input_length":1e999,"hash_ids":[1,2]}\n', r"input_length inf is not an integer"),
    (b'{"timestamp":1,"input_length":32,"hash_ids":[1,2],"block_tokens":1e400}\n', r"block_tokens inf"),
    (b'{"timestamp":1,"input_length":32,"hash_ids":[1e999]}\n', r"hash_ids\[\] inf"),
    (b'{"timestamp":1,"input_length":32,"hash_ids":[1,2]}\n\xff\xfe\n', r"not UTF-8"),
    (b'{"timestamp":1,"input_length":32,"hash_ids":"12"}\n', r"hash_ids '12' is not a list"),
    (b'[1,2]\n', r"a JSON list, not an object"),
    (b'{"timestamp":1,"input_length":32.5,"hash_ids":[1]}\n', r"input_length 32.5 is not an integer"),
    (b'{"timestamp":1,"input_length":32,"hash_ids":[true]}\n', r"hash_ids\[\] True is not an integer"),
    (b"[" * 100_000 + b"\n", r""),
])
def test_read_trace_refuses_bad_values_naming_the_line(tmp_path, content, words):
    """Audit: 1e999 gave an uncaught OverflowError, non-UTF-8 bytes an error naming no line, a string of digits
    was taken for a list of ids."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    line = content.count(b"\n")  # the bad record is the last line
    with pytest.raises(ValueError, match=rf"bad.jsonl:{line}: not a Mooncake trace record .*{words}"):
        traces.read_trace(str(path))


def test_read_trace_reads_regular_files_only_and_bounds_a_line(tmp_path, monkeypatch):
    """Audit: a FIFO hung the reader, /dev/zero grew its memory until MemoryError."""
    import os

    from promptcache.sidecar import trace

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero", str(tmp_path)):
        with pytest.raises(ValueError, match="not a regular file|a directory"):
            traces.read_trace(path)
    with pytest.raises(ValueError, match="cannot be read"):
        traces.read_trace(str(tmp_path / "missing.jsonl"))
    monkeypatch.setattr(trace, "MAX_LINE_BYTES", 1000)
    long = tmp_path / "long.jsonl"
    long.write_bytes(b'{"timestamp":1,"input_length":32,"hash_ids":[1]}\n' + b" " * 5000)
    with pytest.raises(ValueError, match=r"long.jsonl:2: line longer than 1000 bytes"):
        traces.read_trace(str(long))
    ok = tmp_path / "ok.jsonl"
    ok.write_bytes(b'{"timestamp":1,"input_length":32.0,"hash_ids":[1,2],"block_tokens":16}\n\n')
    assert [(r.input_length, r.hash_ids, r.block_tokens) for r in traces.read_trace(str(ok))] == [(32, [1, 2], 16)]


def test_block_sizes_partial_last_block():
    r = traces.Request(0, 1100, 5, [1, 2, 3])
    assert traces.block_sizes(r) == [512, 512, 76]


# OPT is an upper bound of every online policy when blocks have equal sizes; infinite bounds OPT.
workload = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=150)


def _uniform(spec):
    reqs = []
    for fam, length, branch in spec:
        ids = [fam * 1000 + j * 10 + (branch if j >= 2 else 9) for j in range(length)]
        reqs.append((ids, [1] * length))
    return reqs


@settings(max_examples=60, deadline=None)
@given(spec=workload, cap=st.integers(1, 25))
def test_opt_bounds_every_policy(spec, cap):
    reqs = _uniform(spec)
    opt_hit, total = opt.simulate_opt(reqs, cap)
    inf_hit, _ = opt.simulate_infinite(reqs)
    assert opt_hit <= inf_hit
    for name in POLICIES:
        r = replay.simulate_policy(reqs, make_policy(name, capacity=cap), cap)
        assert r["total"] == total
        assert r["hit"] <= opt_hit, name


@settings(max_examples=40, deadline=None)
@given(spec=workload, cap=st.integers(1, 25))
def test_dead_first_lies_between_what_it_knows_and_opt(spec, cap):
    reqs = _uniform(spec)
    opt_hit, total = opt.simulate_opt(reqs, cap)
    hit, total_df = opt.simulate_dead_first(reqs, cap)
    assert total_df == total and hit <= opt_hit


def test_dead_first_example():
    # capacity 2: a b c a. To store c, lru-prefix evicts a (least recent); dead-first evicts b (never used again).
    reqs = [([1], [1]), ([2], [1]), ([3], [1]), ([1], [1])]
    assert opt.simulate_dead_first(reqs, 2) == (1, 4)
    assert replay.simulate_policy(reqs, make_policy("lru-prefix"), 2)["hit"] == 0


def test_opt_evicts_the_deepest_of_equal_next_uses():
    """Found by the dead-first property test: with ties in next use broken by recency, OPT evicted chain root 2009
    (touched alone by request 2) before its children 2019 and 2021, which stayed cached but unreachable; it then
    scored 5 tokens where the half-oracle scored 6. Deepest first keeps the chain whole."""
    spec = [(0, 1, 0), (2, 3, 1), (2, 1, 0), (1, 3, 0), (0, 1, 0), (1, 3, 0), (2, 3, 1)]
    reqs = _uniform(spec)
    assert opt.simulate_opt(reqs, 6) == (7, 15)
    assert opt.simulate_dead_first(reqs, 6) == (6, 15)


def test_opt_example():
    # capacity 1 block; a b a: keep a (next use at 2), never store b (next use never)
    reqs = [([1], [1]), ([2], [1]), ([1], [1])]
    assert opt.simulate_opt(reqs, 1) == (1, 3)
    r = replay.simulate_policy(reqs, make_policy("lru"), 1)
    assert r["hit"] == 0


def test_cli_replay_on_a_trace_file(tmp_path, capsys):
    from promptcache.cli import main

    path = tmp_path / "t.jsonl"
    traces.write_trace(str(path), traces.generate("rag", seed=0, scale=0.03))
    rc = main(["bench", "replay", "--trace", str(path), "--capacity-fraction", "0.05", "--policy", "lru",
               "--policy", DEFAULT_POLICY, "--markdown"])
    out = capsys.readouterr().out
    assert rc == 0
    d = DEFAULT_POLICY
    assert f"| trace | capacity | lru | {d} | opt | infinite | {d}/opt | {d}/lru |" in out
    assert "| 5% |" in out


def test_cli_replay_synthetic_and_errors(capsys):
    from promptcache.cli import main

    assert main(["bench", "replay", "--synthetic", "scan", "--scale", "0.02", "--capacity-fraction", "0.1",
                 "--no-opt"]) == 0
    out = capsys.readouterr().out
    assert "lru-prefix" in out and "infinite" in out
    assert main(["bench", "replay", "--synthetic", "chat", "--scale", "0.02", "--policy", "nope"]) == 2
    assert main(["bench", "replay", "--synthetic", "chat", "--scale", "0.02", "--capacity-fraction", "0"]) == 2
    assert main(["bench", "replay", "--trace", "/nonexistent.jsonl"]) == 2


def test_split_halves_by_time():
    reqs = [traces.Request(t, 512, 1, [t]) for t in (50, 10, 40, 30, 20)]  # file order is not time order
    first, second = replay.split_halves(reqs)
    assert [r.timestamp for r in first] == [10, 20]
    assert [r.timestamp for r in second] == [30, 40, 50]  # the middle request goes to the held-out half
    (name_a, a, start_a), (name_b, b, start_b) = replay.replay_sets("/x/t.jsonl", reqs, "half")
    assert (name_a, a, start_a) == ("t.jsonl [first half]", first, 0)
    assert (name_b, b, start_b) == ("t.jsonl [second half]", second, 0)
    [(name, warm, start)] = replay.replay_sets("/x/t.jsonl", reqs, "half-warm")
    assert name == "t.jsonl [second half, warm]" and warm == first + second and start == 2
    assert replay.replay_sets("t", reqs, "none") == [("t", reqs, 0)]
    with pytest.raises(ValueError, match="unknown split"):
        replay.replay_sets("t", reqs, "thirds")


def test_measure_from_counts_only_the_later_requests():
    # a b a, capacity 2 blocks: the first two requests only warm the cache; the third hits a.
    reqs = [([1], [3]), ([2], [5]), ([1], [3])]
    r = replay.simulate_policy(reqs, make_policy("lru"), 8, measure_from=2)
    assert (r["hit"], r["total"]) == (3, 3)
    assert replay.simulate_policy(reqs, make_policy("lru"), 8)["total"] == 11
    assert opt.simulate_opt(reqs, 8, measure_from=2) == (3, 3)
    assert opt.simulate_infinite(reqs, measure_from=2) == (3, 3)
    assert opt.simulate_infinite(reqs, measure_from=3) == (0, 0)


def test_cli_replay_split(tmp_path, capsys):
    from promptcache.cli import main

    path = tmp_path / "t.jsonl"
    traces.write_trace(str(path), traces.generate("chat", seed=0, scale=0.03))
    for split, labels in (("half", ["t.jsonl [first half]", "t.jsonl [second half]"]),
                          ("half-warm", ["t.jsonl [second half, warm]"])):
        assert main(["bench", "replay", "--trace", str(path), "--split", split, "--capacity-fraction", "0.1",
                     "--policy", "lru", "--jobs", "1", "--markdown"]) == 0
        out = capsys.readouterr().out
        assert [line.split(" | ")[0][2:] for line in out.splitlines()[2:]] == labels


# --------------------------------------------------------------------------------------------------------------
# The provided production-like trace (shared/ beside the clone; README there), held out by time. Issue #13.

SHARED_TRACE = (pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
                / "mooncake-fast25-synthetic.jsonl")
needs_trace = pytest.mark.skipif(not SHARED_TRACE.exists(),
                                 reason=f"the Mooncake FAST'25 trace is not at {SHARED_TRACE} (CI puts shared/ "
                                        "beside the clone)")


def _held_out(fraction: float, policies, path=SHARED_TRACE, half: int = 1) -> dict:
    """Token hit ratio per policy on one half (by time) of a trace, from an empty cache (`--split half`)."""
    reqs, ws = replay.prepare(replay.split_halves(traces.read_trace(str(path)))[half])
    cap = int(ws * fraction)
    out = {}
    for name in policies:
        r = replay.simulate_policy(reqs, make_policy(name, capacity=cap), cap)
        out[name] = r["hit"] / r["total"]
    return out


# Issue #32's targets: >= 1.5x LRU at 2 and 5 %, >= 1.2x at 10 %, never more than 0.005 below LRU.
TARGETS = {0.02: 1.5, 0.05: 1.5, 0.10: 1.2, 0.25: None}

CONVERSATION_TRACE = SHARED_TRACE.parent / "mooncake-fast25-conversation-first-half.jsonl"
needs_conversation = pytest.mark.skipif(not CONVERSATION_TRACE.exists(),
                                        reason=f"the conversation trace is not at {CONVERSATION_TRACE}")


def _check_target(hr: dict, policy: str, fraction: float) -> None:
    assert hr[policy] >= hr["lru"] - 0.005, hr
    if TARGETS[fraction]:
        assert hr[policy] >= TARGETS[fraction] * hr["lru"], hr


@needs_conversation
@pytest.mark.slow
@pytest.mark.parametrize("policy,fraction", [(DEFAULT_POLICY, f) for f in TARGETS] + [
    pytest.param("wtinylfu", 0.05, marks=pytest.mark.xfail(strict=True, reason="negative control: the previous "
                                                                               "default is about LRU here"))])
def test_default_reaches_issue_32_targets_on_the_held_out_quarter_of_the_conversation_trace(policy, fraction):
    """The conversation trace's first half (the file we have) cut again at its middle request, the second part held
    out (`promptcache bench replay --trace ...conversation-first-half.jsonl --split half`, its second half):
    docs/eviction.md, fifth round."""
    _check_target(_held_out(fraction, ["lru", policy], CONVERSATION_TRACE, half=1), policy, fraction)


_SYNTHETIC_MISSES = {(1, 0.02), (1, 0.05), (1, 0.10)}  # measured 1.31x, 1.06x, 1.04x LRU (rate-hazard)


@needs_trace
@pytest.mark.slow
@pytest.mark.parametrize("half,fraction", [
    pytest.param(h, f, marks=[pytest.mark.xfail(strict=True, reason="issue #32's factor over LRU is not met on the "
                                                "synthetic trace's second half: docs/eviction.md, sixth round")]
                 if (h, f) in _SYNTHETIC_MISSES else [])
    for h in (0, 1) for f in TARGETS])
def test_default_on_the_halves_of_the_synthetic_trace(half, fraction):
    """Issue #32's targets on both halves of the Mooncake synthetic trace; where the factor is not met (strict
    xfail, so meeting it is noticed), the default is still never more than 0.005 below LRU."""
    hr = _held_out(fraction, ["lru", DEFAULT_POLICY], SHARED_TRACE, half=half)
    assert hr[DEFAULT_POLICY] >= hr["lru"] - 0.005, hr
    _check_target(hr, DEFAULT_POLICY, fraction)


def _warm(path, fractions, policies=("lru", DEFAULT_POLICY)) -> dict:
    """Token hit ratio per (fraction, policy) with `--split half-warm` semantics: the whole trace replayed by time,
    only its second half counted, the capacity a fraction of the whole trace's working set."""
    ordered = sorted(traces.read_trace(str(path)), key=lambda r: r.timestamp)
    reqs, ws = replay.prepare(ordered)
    out = {}
    for fraction in fractions:
        cap = int(ws * fraction)
        for name in policies:
            r = replay.simulate_policy(reqs, make_policy(name, capacity=cap), cap, measure_from=len(ordered) // 2)
            out[fraction, name] = r["hit"] / r["total"]
    return out


# Measured (docs/eviction.md, "Warm, with the sixth round's default"): 1.99 / 1.49 / 1.11 / 1.03x LRU.
_WARM_CONVERSATION_MISSES = {0.05, 0.10}


@needs_conversation
@pytest.mark.slow
def test_default_warm_on_the_conversation_trace_never_below_lru():
    """Issue #32's evaluators also replay the held-back half warm (`--split half-warm`). On the file we have, its
    second half counted after its first warmed the cache: the default is never more than 0.005 below LRU in any
    cell and meets the factor at 2 %; at 5 % (1.49x) and 10 % (1.11x) the factor is not met, and a change that
    meets it fails here on purpose (update the set and docs/eviction.md)."""
    hr = _warm(CONVERSATION_TRACE, TARGETS)
    met = set()
    for fraction, factor in TARGETS.items():
        lru, default = hr[fraction, "lru"], hr[fraction, DEFAULT_POLICY]
        assert default >= lru - 0.005, (fraction, hr)
        if factor and default >= factor * lru:
            met.add(fraction)
    assert set(f for f in TARGETS if TARGETS[f]) - met == _WARM_CONVERSATION_MISSES, hr


@needs_conversation
@pytest.mark.slow
@pytest.mark.parametrize("third", [0, 1, 2])
def test_default_on_each_third_of_the_conversation_trace(third):
    """Windows of a length nothing was tuned on (each third of the file by time, from an empty cache, the capacity
    a fraction of that third's working set): never more than 0.005 below LRU, and at least 1.2x LRU at 2, 5 and 10 %
    (measured 1.41-2.01x; docs/eviction.md)."""
    ordered = sorted(traces.read_trace(str(CONVERSATION_TRACE)), key=lambda r: r.timestamp)
    n = len(ordered)
    reqs, ws = replay.prepare(ordered[third * n // 3:(third + 1) * n // 3])
    for fraction in TARGETS:
        cap = int(ws * fraction)
        lru, default = (replay.simulate_policy(reqs, make_policy(p, capacity=cap), cap)
                        for p in ("lru", DEFAULT_POLICY))
        lru, default = lru["hit"] / lru["total"], default["hit"] / default["total"]
        assert default >= lru - 0.005, (third, fraction, lru, default)
        if fraction < 0.25:
            assert default >= 1.2 * lru, (third, fraction, lru, default)


@needs_trace
@pytest.mark.slow
def test_default_warm_on_the_synthetic_trace_never_below_lru():
    """The synthetic trace replayed warm: 0.97 / 1.01 / 1.04 / 1.01x LRU, the 2 % cell 0.004 below it (the closest
    cell anywhere, docs/eviction.md): never more than 0.005 below."""
    hr = _warm(SHARED_TRACE, TARGETS)
    for fraction in TARGETS:
        assert hr[fraction, DEFAULT_POLICY] >= hr[fraction, "lru"] - 0.005, (fraction, hr)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [DEFAULT_POLICY, "rate"])
@pytest.mark.parametrize("name", list(traces.GENERATORS))
def test_never_below_lru_on_the_generators(name, policy):
    """The regression guard of issue #13: `--synthetic all`, seed 0, no cell more than 0.005 below LRU; for the
    default, and for `rate`, whose `alive` was chosen as the best on the tuning half that passes it."""
    reqs, ws = replay.prepare(traces.generate(name, seed=0))
    for fraction in replay.DEFAULT_FRACTIONS:
        cap = int(ws * fraction)
        lru = replay.simulate_policy(reqs, make_policy("lru", capacity=cap), cap)
        other = replay.simulate_policy(reqs, make_policy(policy, capacity=cap), cap)
        assert other["hit"] / other["total"] >= lru["hit"] / lru["total"] - 0.005, (name, fraction)
