"""Trace generators, Mooncake JSONL I/O, OPT and the `promptcache bench replay` command."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.bench import opt, replay, traces
from promptcache.sidecar.policies import POLICIES, make_policy


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
               "--policy", "wtinylfu", "--markdown"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| trace | capacity | lru | wtinylfu | opt | infinite | wtinylfu/opt |" in out
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
