#!/usr/bin/env python3
"""How far a learned eviction ranking can go on the held-out half of a trace (issue #13's evidence).

LRB-style (Song et al., NSDI'20): a gradient-boosted classifier predicts, for a conversation (the requests that
share a chain root), whether it is requested again within `--horizon` seconds, from what an online policy can
see: its requests so far, silence, last gap, mean gap, age, the length of its last and first request. Eviction
takes the cached leaf whose conversation is least likely to return (ties: least recently requested), through
`replay.simulate_policy` with the same prefix semantics as every figure in docs/eviction.md.

The model is fitted three ways, and each is replayed on the held-out second half at 5 and 10 %:
  * on the first half (what tuning may use)              - the honest transfer;
  * on the held-out half, 2-fold by conversation          - the best a model of the half's *distribution* does on
                                                            conversations it has not seen;
  * on the held-out half, in sample                       - a model that may memorise each conversation.
The gap between the last two is what knowing *which* conversation it is is worth; no online policy has it.

Not part of `make test` (tests/test_eviction_bound.py checks its features and labels): it needs scikit-learn,
which PromptCache does not depend on.
  python3 -m venv ~/.cache/promptcache/bound-venv && ~/.cache/promptcache/bound-venv/bin/pip install scikit-learn
  PYTHONPATH=sidecar:devtools ~/.cache/promptcache/bound-venv/bin/python hack/eviction-bound.py \
      --trace ../shared/traces/mooncake-fast25-synthetic.jsonl
"""
from __future__ import annotations

import argparse
import random
from collections import defaultdict

import numpy as np

from promptcache.sidecar.policies import LRU, ReuseRate, key_hash64
from promptcache_devtools.bench import replay, traces

FEATURES = ("requests", "silence_s", "last_gap_s", "mean_gap_s", "age_s", "last_blocks", "first_blocks")


def features(history: list[tuple[float, int]], now: float) -> list[float]:
    """history: (time s, blocks) of a conversation's requests so far."""
    n = len(history)
    first, last = history[0][0], history[-1][0]
    last_gap = last - history[-2][0] if n > 1 else -1.0
    mean_gap = (last - first) / (n - 1) if n > 1 else -1.0
    return [n, now - last, last_gap, mean_gap, now - first, history[-1][1], history[0][1]]


def dataset(reqs, horizon: float, per_request: int = 8, seed: int = 0):
    """Features of random live conversations, sampled at each arrival, labelled by a return within `horizon`."""
    rng = random.Random(seed)
    times = [r.timestamp / 1000 for r in reqs]
    arrivals = defaultdict(list)
    for i, r in enumerate(reqs):
        arrivals[r.hash_ids[0]].append(i)
    history: dict = defaultdict(list)
    seen: list = []
    done: dict = defaultdict(int)
    X, y, group = [], [], []
    for i, r in enumerate(reqs):
        root, now = r.hash_ids[0], times[i]
        if root not in history:
            seen.append(root)
        history[root].append((now, len(r.hash_ids)))
        done[root] += 1
        for _ in range(per_request):
            c = seen[rng.randrange(len(seen))]
            if now - history[c][-1][0] > 900:
                continue
            nxt = arrivals[c][done[c]] if done[c] < len(arrivals[c]) else None
            X.append(features(history[c], now))
            y.append(int(nxt is not None and times[nxt] - now <= horizon))
            group.append(c)
    return np.array(X, float), np.array(y), group


def fold_of(root) -> int:
    return key_hash64(root) & 1  # deterministic: the same conversations fall in the same fold on every run


def drift(reqs) -> tuple[list[int], float]:
    """New conversations per tenth of the trace, and where the later requests of conversations that begin in its
    first 30 % with six or more requests fall within the time left after their first (0.5 if evenly spread)."""
    tenth = max(1, len(reqs) // 10)
    new = [0] * 10
    start_of: dict = {}  # root -> index of its first request
    arrivals = defaultdict(list)
    for i, r in enumerate(reqs):
        root = r.hash_ids[0]
        if root not in start_of:
            start_of[root] = i
            new[min(9, i // tenth)] += 1
        arrivals[root].append(r.timestamp / 1000)
    end = reqs[-1].timestamp / 1000
    early = len(reqs) * 0.3
    where = [(t - ts[0]) / (end - ts[0]) for root, ts in arrivals.items()
             if len(ts) >= 6 and start_of[root] < early for t in ts[1:]]
    return new, float(np.median(where)) if where else float("nan")


class LearnedRanking(ReuseRate):
    """ReuseRate's leaf bookkeeping with the classifier's score; the clock and conversation come from Clocked."""

    name = "learned"

    def __init__(self, capacity, model_for, root_of):
        super().__init__(capacity, sample=64)
        self.model_for, self.root_of = model_for, root_of
        self.history: dict = defaultdict(list)
        self.clock = 0.0
        self._memo: dict = {}

    def arrive(self, root, now: float, blocks: int) -> None:
        self.clock = now
        self.history[root].append((now, blocks))
        self._memo.clear()

    def _log_score(self, key) -> float:
        root = self.root_of[key]
        p = self._memo.get(root)
        if p is None:
            model = self.model_for(root)
            p = self._memo[root] = float(model.predict_proba(np.array([features(self.history[root], self.clock)]))[0, 1])
        return p * 1e9 + self.stats[key][0]  # ties: the tick of the last request, which ReuseRate keeps


class Clocked:
    """The prepared requests, telling the policy each request's time and conversation before it is replayed."""

    def __init__(self, prepared, reqs, policy):
        self.prepared, self.reqs, self.policy = prepared, reqs, policy

    def __iter__(self):
        for (ids, sizes), r in zip(self.prepared, self.reqs):
            self.policy.arrive(r.hash_ids[0], r.timestamp / 1000, len(r.hash_ids))
            yield ids, sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--horizon", type=float, default=30.0, help="seconds; the label is a return within it")
    ap.add_argument("--capacity-fraction", type=float, action="append")
    args = ap.parse_args()
    from sklearn.ensemble import HistGradientBoostingClassifier  # here, so tests import the rest without it
    from sklearn.metrics import roc_auc_score

    fractions = args.capacity_fraction or [0.05, 0.10]
    whole = sorted(traces.read_trace(args.trace), key=lambda r: r.timestamp)
    first, second = replay.split_halves(whole)
    new, where = drift(whole)
    print(f"new conversations per tenth of the trace: {new}; later requests of early long conversations fall at "
          f"{where:.2f} of their remaining time (median; 0.50 if evenly spread)")
    prepared, working_set = replay.prepare(second)
    root_of = {k: r.hash_ids[0] for r in second for k in r.hash_ids}

    XA, yA, _ = dataset(first, args.horizon)
    XB, yB, gB = dataset(second, args.horizon)
    fold = np.array([fold_of(g) for g in gB])

    def fit(X, y):
        return HistGradientBoostingClassifier(max_iter=200, random_state=0).fit(X, y)

    on_first = fit(XA, yA)
    in_sample = fit(XB, yB)
    by_fold = {k: fit(XB[fold != k], yB[fold != k]) for k in (0, 1)}  # model k never saw fold k's conversations
    aucs = {
        "fitted on the first half": roc_auc_score(yB, on_first.predict_proba(XB)[:, 1]),
        "held-out half, 2-fold by conversation": np.mean(
            [roc_auc_score(yB[fold == k], by_fold[k].predict_proba(XB[fold == k])[:, 1]) for k in (0, 1)]),
        "held-out half, in sample": roc_auc_score(yB, in_sample.predict_proba(XB)[:, 1]),
    }
    models = {
        "fitted on the first half": lambda root: on_first,
        "held-out half, 2-fold by conversation": lambda root: by_fold[fold_of(root)],
        "held-out half, in sample": lambda root: in_sample,
    }
    print(f"held-out half of {args.trace}: label = a return within {args.horizon:g} s; features {', '.join(FEATURES)}")
    print("| model | AUC on the held-out half | " + " | ".join(f"{f:.0%} hit / LRU" for f in fractions) + " |")
    print("|---|---|" + "---|" * len(fractions))
    lru = {}
    for f in fractions:
        r = replay.simulate_policy(prepared, LRU(int(working_set * f)), int(working_set * f))
        lru[f] = r["hit"] / r["total"]
    # LRU ranks by silence alone: its AUC is the reference a model has to beat
    silence = -XB[:, FEATURES.index("silence_s")]
    print(f"| LRU | {roc_auc_score(yB, silence):.3f} | " + " | ".join(f"{lru[f]:.3f}" for f in fractions) + " |")
    for name, model_for in models.items():
        cells = []
        for f in fractions:
            cap = int(working_set * f)
            policy = LearnedRanking(cap, model_for, root_of)
            r = replay.simulate_policy(Clocked(prepared, second, policy), policy, cap)
            hit = r["hit"] / r["total"]
            cells.append(f"{hit:.3f} ({hit / lru[f]:.2f}x)")
        print(f"| {name} | {aucs[name]:.3f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
