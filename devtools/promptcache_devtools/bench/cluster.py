"""Fleet-wide token hit ratio of N node caches, with and without the cluster tier, requests routed at random or
by prefix (docs/cluster.md).

Each node is the server's memory tier as `bench replay` simulates it (the server's eviction policy, prefix
semantics: a request hits its longest leading run of cached blocks, then stores its missing blocks in order).
With the cluster tier, a node's miss continues in the cluster: the blocks that follow the local run and are in the
cluster are hits too (and promoted into the node), and every block a node stores is published to the cluster
(the sidecar's write policy: every committed chunk; the last column publishes a chunk only when a node stores it
the second time, for comparison). The cluster is one LRU cache of --cluster-fraction of the
working set (Mooncake evicts by its own watermarks; LRU stands in for it). Routing: `random` picks a node at
random; `prefix` picks the node holding the longest prefix of the request (what KV events let a router do), ties
at random. Capacities are fractions of the trace's working set (tokens of its unique blocks), per node.
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict

from promptcache.sidecar.trace import cached_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", action="append", metavar="FILE.jsonl", help="Mooncake-format JSONL trace")
    src.add_argument("--synthetic", action="append", metavar="NAME",
                     help="synthetic trace: chat, agent, rag, scan or all (repeatable)")
    parser.add_argument("--nodes", type=int, default=4, help="node caches (default 4)")
    parser.add_argument("--capacity-fraction", type=float, default=0.05,
                        help="each node's cache as a fraction of the working set (default 0.05)")
    parser.add_argument("--cluster-fraction", type=float, default=0.25,
                        help="the cluster tier's capacity as a fraction of the working set (default 0.25)")
    parser.add_argument("--policy", default=None, help="node eviction policy (default: the server's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="size multiplier of synthetic traces")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")


class Node:
    """One node's memory tier under an eviction policy, with the server's prefix semantics."""

    def __init__(self, policy, capacity: int):
        self.policy, self.capacity = policy, capacity
        self.present: dict = {}
        self.used = 0

    def prefix(self, ids) -> int:
        return cached_run(ids, self.present)

    def store(self, ids, sizes, start: int) -> list:
        """Store ids[start:] in order (as the sidecar does after a Put or a promotion); the ones stored."""
        stored = []
        parent = ids[start - 1] if start else None
        for j in range(start, len(ids)):
            k, s = ids[j], sizes[j]
            if parent is not None and parent not in self.present:
                break
            if k in self.present:
                self.policy.accessed(k)
                parent = k
                continue
            if self.used + s > self.capacity:
                if s > self.capacity or not self.policy.admit(k, s, parent):
                    break
                while self.used + s > self.capacity:
                    v = self.policy.victim()
                    if v is None:
                        break
                    self.used -= self.present.pop(v)
                    self.policy.removed(v)
                if self.used + s > self.capacity:
                    break
            self.present[k] = s
            self.used += s
            self.policy.inserted(k, s, parent)
            stored.append(k)
            parent = k
        return stored


class Cluster:
    """The cluster tier as one LRU cache."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self.present: OrderedDict = OrderedDict()

    def has(self, k) -> bool:
        if k in self.present:
            self.present.move_to_end(k)
            return True
        return False

    def put(self, k, s: int) -> None:
        if k in self.present or s > self.capacity:
            return
        while self.used + s > self.capacity:
            _, size = self.present.popitem(last=False)
            self.used -= size
        self.present[k] = s
        self.used += s


def simulate(reqs, n_nodes: int, node_capacity: int, cluster_capacity: int, routing: str, policy_name: str,
             seed: int, publish_after: int = 1) -> tuple[float, float]:
    """(fleet token hit ratio, share of the hit tokens served by the cluster tier). A block is published when a
    node stores it for the `publish_after`-th time (1: every chunk, the sidecar's policy; 2: chunks seen twice)."""
    from promptcache.sidecar.policies import make_policy

    rng = random.Random(seed)
    nodes = [Node(make_policy(policy_name, capacity=node_capacity), node_capacity) for _ in range(n_nodes)]
    cluster = Cluster(cluster_capacity) if cluster_capacity else None
    hit = total = from_cluster = 0
    stores: dict = {}
    for ids, sizes in reqs:
        if routing == "prefix":
            lengths = [node.prefix(ids) for node in nodes]
            best = max(lengths)
            node = nodes[rng.choice([i for i, n in enumerate(lengths) if n == best])]
        else:
            node = nodes[rng.randrange(n_nodes)]
        for k in ids:
            node.policy.requested(k)
        n = node.prefix(ids)
        for k in ids[:n]:
            node.policy.accessed(k)
        local = n
        if cluster is not None:
            while n < len(ids) and cluster.has(ids[n]):
                n += 1
        hit += sum(sizes[:n])
        from_cluster += sum(sizes[local:n])
        total += sum(sizes)
        stored = node.store(ids, sizes, local)  # promoted cluster hits, then the computed rest
        if cluster is not None:
            size_of = dict(zip(ids, sizes))
            for k in stored:
                seen = stores[k] = stores.get(k, 0) + 1
                if seen >= publish_after:
                    cluster.put(k, size_of[k])
    return hit / max(1, total), from_cluster / max(1, hit)


def run(args) -> int:
    from promptcache_devtools.bench.replay import load_traces, prepare
    from promptcache.sidecar.policies import DEFAULT_POLICY, POLICIES

    policy = args.policy or DEFAULT_POLICY
    if policy not in POLICIES:
        print(f"promptcache bench cluster: unknown policy {policy!r}", file=sys.stderr)
        return 2
    if args.nodes < 1 or not 0 < args.capacity_fraction <= 1 or not 0 < args.cluster_fraction <= 1:
        print("promptcache bench cluster: --nodes must be >= 1 and the fractions in (0, 1]", file=sys.stderr)
        return 2
    args.save_trace = None
    try:
        raw = load_traces(args)
    except (OSError, ValueError) as exc:
        print(f"promptcache bench cluster: {exc}", file=sys.stderr)
        return 2
    head = ["trace", "routing", "local only", "with cluster", "served by cluster", "with cluster, seen twice"]
    rows = []
    for name, reqs in raw.items():
        prepared, ws = prepare(reqs)
        node_cap, cluster_cap = max(1, int(ws * args.capacity_fraction)), max(1, int(ws * args.cluster_fraction))
        for routing in ("random", "prefix"):
            alone, _ = simulate(prepared, args.nodes, node_cap, 0, routing, policy, args.seed)
            shared, share = simulate(prepared, args.nodes, node_cap, cluster_cap, routing, policy, args.seed)
            twice, _ = simulate(prepared, args.nodes, node_cap, cluster_cap, routing, policy, args.seed, 2)
            rows.append([name, routing, f"{alone:.3f}", f"{shared:.3f}", f"{share:.0%}", f"{twice:.3f}"])
    print(f"# {args.nodes} nodes, each {args.capacity_fraction:g} of the working set ({policy}); cluster tier "
          f"{args.cluster_fraction:g} of it (LRU); fleet token hit ratio", file=sys.stderr)
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        for r in [head, *rows]:
            print("  ".join(x.ljust(w) for x, w in zip(r, widths)))
    return 0
