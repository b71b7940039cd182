"""Replay a Mooncake-format trace against the eviction policies; token hit ratio beside OPT and infinite.

The replay drives the very policy classes the server uses (promptcache.sidecar.policies) through a small
simulated store with the server's prefix semantics: every block of a request is `requested`; the request hits
its longest leading run of cached blocks (`accessed`); its missing blocks are then stored in order - a block whose
parent is not cached is not stored (unreachable), `admit` is asked when room must be made, and `victim` is asked
until the block fits. Sizes are tokens, the capacity is a fraction of the trace's working set (the tokens of its
unique blocks). OPT and the infinite cache: promptcache_devtools.bench.opt.

Held-out evaluation (`--split`): a trace is ordered by timestamp and cut at its middle request. `half` replays each
half on its own from an empty cache, its capacity a fraction of that half's working set (tune on the first, report
the second); `half-warm` replays the whole trace and counts only the second half's requests, the capacity a fraction
of the whole trace's working set (the first half only warms the cache, as it would in a sidecar that kept running).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# The replay itself is shipped (the miss-ratio curve's miniatures estimate it): re-exported here.
from promptcache.sidecar.trace import simulate_policy  # noqa: F401

DEFAULT_FRACTIONS = (0.02, 0.05, 0.10, 0.25)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", action="append", metavar="FILE.jsonl",
                     help="Mooncake-format JSONL trace (repeatable)")
    src.add_argument("--synthetic", action="append", metavar="NAME",
                     help="generate a synthetic trace on the fly: chat, agent, rag, scan or all (repeatable)")
    parser.add_argument("--capacity-fraction", type=float, action="append", metavar="F",
                        help="cache capacity as a fraction of the working set (repeatable; "
                             "default 0.02 0.05 0.10 0.25)")
    parser.add_argument("--policy", action="append", metavar="P",
                        help="eviction policy (repeatable), or 'all' (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic traces (default 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="size multiplier of synthetic traces")
    parser.add_argument("--no-opt", action="store_true", help="skip Belady's OPT")
    parser.add_argument("--dead-first", action="store_true",
                        help="add the half-oracle 'dead-first' (lru-prefix that evicts blocks never used again first)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="worker processes (default: CPUs, at most 4); results do not depend on it")
    parser.add_argument("--save-trace", metavar="DIR", help="also write the synthetic traces as JSONL into DIR")
    parser.add_argument("--split", choices=SPLITS, default="none",
                        help="held-out evaluation: 'half' replays the first and the second half (by time) of each "
                             "trace separately; 'half-warm' counts the second half after the first warmed the cache "
                             "(default: none)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--plot", default="", help="also write a PNG of hit ratio against capacity per policy here "
                                                   "(needs matplotlib: the plots extra)")


SPLITS = ("none", "half", "half-warm")


def split_halves(reqs) -> tuple[list, list]:
    """The first and second half of a trace by time (stable for equal timestamps; the middle request goes second)."""
    ordered = sorted(reqs, key=lambda r: r.timestamp)
    mid = len(ordered) // 2
    return ordered[:mid], ordered[mid:]


def replay_sets(name: str, reqs, split: str) -> list[tuple[str, list, int]]:
    """(label, requests, measure_from) for each replay the split asks for."""
    if split == "none":
        return [(name, reqs, 0)]
    name = os.path.basename(name)
    first, second = split_halves(reqs)
    if split == "half":
        return [(f"{name} [first half]", first, 0), (f"{name} [second half]", second, 0)]
    if split == "half-warm":
        return [(f"{name} [second half, warm]", first + second, len(first))]
    raise ValueError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")


def prepare(reqs) -> tuple[list[tuple[list, list[int]]], int]:
    """(ids, block token sizes) per request, and the working set in tokens."""
    from promptcache.sidecar.trace import block_sizes

    out = []
    size_of: dict = {}
    for r in reqs:
        sizes = block_sizes(r)
        for k, s in zip(r.hash_ids, sizes):
            size_of.setdefault(k, s)
        out.append((r.hash_ids, [size_of[k] for k in r.hash_ids]))
    return out, sum(size_of.values())


def _one(job):
    trace_name, policy_name, fraction = job
    from promptcache_devtools.bench import opt
    from promptcache.sidecar.policies import make_policy

    reqs, ws, start = _TRACES[trace_name]
    cap = max(1, int(ws * fraction))
    t0 = time.perf_counter()
    if policy_name == "opt":
        hit, total = opt.simulate_opt(reqs, cap, measure_from=start)
    elif policy_name == "dead-first":
        hit, total = opt.simulate_dead_first(reqs, cap, measure_from=start)
    elif policy_name == "infinite":
        hit, total = opt.simulate_infinite(reqs, measure_from=start)
    else:
        r = simulate_policy(reqs, make_policy(policy_name, capacity=cap), cap, measure_from=start)
        hit, total = r["hit"], r["total"]
    return trace_name, policy_name, fraction, hit / max(1, total), time.perf_counter() - t0


_TRACES: dict = {}


def load_traces(args) -> dict:
    from promptcache_devtools.bench import traces

    out = {}
    if args.trace:
        for path in args.trace:
            out[path] = traces.read_trace(path)
    else:
        names = []
        for n in args.synthetic:
            names.extend(traces.GENERATORS if n == "all" else [n])
        for n in names:
            reqs = traces.generate(n, seed=args.seed, scale=args.scale)
            if args.save_trace:
                os.makedirs(args.save_trace, exist_ok=True)
                traces.write_trace(os.path.join(args.save_trace, f"{n}.jsonl"), reqs)
            out[n] = reqs
    return out


def run(args) -> int:
    from promptcache_devtools.bench import traces
    from promptcache.sidecar.policies import DEFAULT_POLICY, POLICIES

    try:
        raw = load_traces(args)
    except (OSError, ValueError) as exc:
        print(f"promptcache bench replay: {exc}", file=sys.stderr)
        return 2
    policies = []
    for p in args.policy or ["all"]:
        if p == "all":
            policies.extend(POLICIES)
        elif p in POLICIES:
            policies.append(p)
        else:
            print(f"promptcache bench replay: unknown policy {p!r} (one of {', '.join(POLICIES)}, all)",
                  file=sys.stderr)
            return 2
    policies = list(dict.fromkeys(policies))
    fractions = args.capacity_fraction or list(DEFAULT_FRACTIONS)
    for f in fractions:
        if not 0 < f <= 1:
            print(f"promptcache bench replay: --capacity-fraction {f} is not in (0, 1]", file=sys.stderr)
            return 2
    _TRACES.clear()  # a second run in the same process (tests) must not replay the first one's traces
    for name, whole in raw.items():
        for label, reqs, start in replay_sets(name, whole, args.split):
            prepared, ws = prepare(reqs)
            _TRACES[label] = (prepared, ws, start)
            st = traces.stats(reqs)
            counted = f", the last {len(reqs) - start} counted" if start else ""
            print(f"# trace {label}: {st['requests']} requests{counted}, {st['block_refs']} block refs, "
                  f"{st['unique_blocks']} unique blocks, working set {ws} tokens", file=sys.stderr)
    cols = policies + (["dead-first"] if args.dead_first else []) + ([] if args.no_opt else ["opt"])
    jobs = [(t, p, f) for t in _TRACES for f in fractions for p in cols]
    jobs += [(t, "infinite", 1.0) for t in _TRACES]
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(args.jobs) as pool:
            results = _with_progress(pool.imap_unordered(_one, jobs), len(jobs))
    else:
        results = _with_progress(map(_one, jobs), len(jobs))
    table = {(t, p, f): r for t, p, f, r, _ in results}
    print_table(table, list(_TRACES), fractions, cols, markdown=args.markdown, default=DEFAULT_POLICY)
    if args.plot:
        from promptcache_devtools.bench import plots

        plots.replay(table, list(_TRACES), fractions, cols, args.plot, default=DEFAULT_POLICY)
    return 0


def _with_progress(results, total: int, every: float = 5.0) -> list:
    """Collect replay results, printing how many are done to stderr every `every` seconds (long replays)."""
    import time

    out, last = [], time.monotonic()
    for r in results:
        out.append(r)
        if time.monotonic() - last >= every and len(out) < total:
            print(f"replay: {len(out)}/{total} simulations done", file=sys.stderr, flush=True)
            last = time.monotonic()
    return out


def print_table(table, trace_names, fractions, cols, markdown=False, default=None) -> None:
    head = ["trace", "capacity"] + cols + ["infinite"]
    if "opt" in cols and default in cols:
        head.append(f"{default}/opt")
    if "lru" in cols and default in cols and default != "lru":
        head.append(f"{default}/lru")
    rows = []
    for t in trace_names:
        for f in fractions:
            row = [t, f"{f * 100:g}%"] + [f"{table[(t, p, f)]:.3f}" for p in cols]
            row.append(f"{table[(t, 'infinite', 1.0)]:.3f}")
            if "opt" in cols and default in cols:
                o = table[(t, "opt", f)]
                row.append(f"{table[(t, default, f)] / o:.2f}" if o else "-")
            if "lru" in cols and default in cols and default != "lru":
                lru = table[(t, "lru", f)]
                row.append(f"{table[(t, default, f)] / lru:.2f}" if lru else "-")
            rows.append(row)
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
