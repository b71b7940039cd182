"""Warm-up measured on a trace: `python -m promptcache_devtools.warmup_bench [--trace FILE] ...`.

A real in-process sidecar with a disk tier replays the trace's first --before requests (each: Get the cached
prefix, Put the rest; one chunk per hash id, the block's tokens derived from its id), then stops gracefully (its
memory tier goes to disk). Its data folder is copied, and the sidecar is restarted on each copy: without warm-up,
with warm-up from its disk tier, and (a new node with no disk) with warm-up from a snapshot `promptcache export`
wrote of the folder (--snapshot-bytes, default the memory budget). Each then replays the requests of the next
--window-seconds of trace time. The reference row is a sidecar that never stopped: it replays the same first
requests and then the window, what a restart at best gives back. Printed (a Markdown table): warm-up time, and the
token hit ratio of that window served from memory and overall (memory + disk + cluster), with the Get latency's
median.

With --cluster, two more rows, each on a fresh Mooncake master: a peer with a cluster tier replays the same first
requests (its chunks are published, its hot list names what it holds hottest); then a new node without a disk joins
the cluster, without warm-up or with warm-up from the peers' hot lists, and replays the window.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

TRACE = "/work/shared/traces/mooncake-fast25-conversation-first-half.jsonl"


def _requests(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _hits(sidecar) -> dict[str, float]:
    reg = sidecar.metrics.registry
    out = {}
    for tier in ("device", "disk", "cluster"):
        out[tier] = reg.get_sample_value("promptcache_hit_tokens_total", {"rpc": "get", "tier": tier}) or 0.0
    out["missed"] = reg.get_sample_value("promptcache_missed_tokens_total", {"rpc": "get"}) or 0.0
    return out


def _replay(sidecar, spec, reqs, ct: int, put: bool = True) -> dict:
    from promptcache.client import PromptCacheClient

    before = _hits(sidecar)
    lat = []
    with PromptCacheClient(sidecar.address, timeout=60) as c:
        for r in reqs:
            tokens = [h * ct + j for h in r["hash_ids"] for j in range(ct)]
            t = time.perf_counter()
            cached, _ = c.get(spec, tokens)
            lat.append(time.perf_counter() - t)
            if put and cached < len(tokens):
                c.put(spec, tokens, kv_for(spec, r["hash_ids"], ct), start_chunk=cached // ct)
    after = _hits(sidecar)
    d = {k: after[k] - before[k] for k in after}
    total = d["device"] + d["disk"] + d["cluster"] + d["missed"]
    return {"memory_hit": d["device"] / total, "overall_hit": (d["device"] + d["disk"] + d["cluster"]) / total,
            "get_p50_ms": 1000 * statistics.median(lat), "requests": len(reqs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--before", type=int, default=1500, help="requests replayed before the restart")
    p.add_argument("--window-seconds", type=float, default=60.0, help="trace time replayed after it")
    p.add_argument("--memory-chunks", type=int, default=3000, help="memory tier budget, in chunks")
    p.add_argument("--chunk-tokens", type=int, default=16)
    p.add_argument("--cluster", action="store_true", help="also a new node warming from a peer's hot list "
                   "(needs Mooncake: the 'cluster' extra)")
    args = p.parse_args(argv)

    from promptcache.contract.keys import ModelSpec
    from promptcache.contract.layout import chunk_nbytes
    from promptcache.sidecar import snapshot
    from promptcache.sidecar.app import Sidecar
    from promptcache.sidecar.config import Settings

    spec = ModelSpec("bench/warmup", "r1", "float32", num_layers=2, num_kv_heads=2, head_dim=8)
    ct = args.chunk_tokens
    memory = args.memory_chunks * chunk_nbytes(spec, ct)
    reqs = _requests(args.trace)
    first, rest = reqs[:args.before], reqs[args.before:]
    t0 = rest[0]["timestamp"]
    window = [r for r in rest if r["timestamp"] < t0 + 1000 * args.window_seconds]
    tmp = Path(tempfile.mkdtemp(prefix="warmup-bench-"))
    base = Settings(grpc_address="127.0.0.1:0", metrics_port=0, metrics_host="127.0.0.1", chunk_tokens=ct,
                    memory_bytes=memory,
                    disk_bytes=1 << 30, log_level="warning", disk_min_free_bytes=0)
    try:
        s = Sidecar(dataclasses.replace(base, data_dir=str(tmp / "data"))).start()
        warm_phase = _replay(s, spec, first, ct)
        s.stop()
        snap = tmp / "hot.pcsnap"
        t = time.perf_counter()
        n, b = snapshot.export(str(tmp / "data"), str(snap), memory)
        export_s = time.perf_counter() - t
        rows = []
        s = Sidecar(dataclasses.replace(base, data_dir=str(tmp / "reference"))).start()
        _replay(s, spec, first, ct)
        rows.append(("reference: no restart (the same sidecar goes on)", 0.0, {}, _replay(s, spec, window, ct)))
        s.stop()
        for name, extra in (("no warm-up (restart on its disk tier)", dict(warmup_seconds=0.0)),
                            ("warm-up from its disk tier", dict(warmup_seconds=60.0)),
                            ("new node, no disk: no warm-up", dict(disk_bytes=0)),
                            ("new node, no disk: warm-up from a snapshot", dict(disk_bytes=0, warmup_seconds=60.0,
                                                                                 warmup_snapshot=str(snap)))):
            d = tmp / f"data-{len(rows)}"
            shutil.copytree(tmp / "data", d)
            t = time.perf_counter()
            s = Sidecar(dataclasses.replace(base, data_dir=str(d), **extra)).start()
            assert s.warmup.ready.wait(120)
            ready = time.perf_counter() - t
            r = _replay(s, spec, window, ct)
            rows.append((name, ready, s.warmup.report, r))
            s.stop()
        if args.cluster:
            rows += _cluster_rows(base, tmp, spec, first, window, ct)
        print(f"trace {args.trace}: {len(first)} requests before the restart (memory+disk hit ratio "
              f"{warm_phase['overall_hit']:.3f}), then {len(window)} requests ({args.window_seconds:g} s of trace "
              f"time); memory {args.memory_chunks} chunks of {chunk_nbytes(spec, ct)} bytes; snapshot "
              f"{n} chunks, {b} bytes, exported in {export_s:.2f} s")
        print()
        print("| start | ready after (s) | warmed chunks | memory hit ratio | overall hit ratio | Get p50 (ms) |")
        print("|---|---|---|---|---|---|")
        for name, ready, rep, r in rows:
            warmed = sum(rep.get(f"{source}_chunks", 0) for source in ("disk", "snapshot", "cluster"))
            print(f"| {name} | {ready:.2f} | {warmed} | "
                  f"{r['memory_hit']:.3f} | {r['overall_hit']:.3f} | {r['get_p50_ms']:.2f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _cluster_rows(base, tmp: Path, spec, first, window, ct: int) -> list:
    """Per row, a fresh Mooncake master and a peer that replays `first` on it and publishes its hot list; then a new
    node (no disk) joins and replays `window`, without warm-up and with warm-up from the cluster. (One cluster per
    row: a node's Puts publish its window's chunks, which would serve the next row's node.)"""
    from promptcache.sidecar.app import Sidecar

    rows = []
    for name, extra in (("new node, no disk, cluster tier: no warm-up", dict(warmup_seconds=0.0)),
                        ("new node, no disk: warm-up from the cluster's hot lists", dict(warmup_seconds=60.0))):
        master, address = _mooncake_master(tmp / f"master-{len(rows)}.log")
        try:
            cluster = dict(cluster_master=address, cluster_local_hostname="127.0.0.1", cluster_segment_bytes=1 << 30,
                           cluster_buffer_bytes=64 << 20, cluster_timeout_seconds=2.0, disk_bytes=0,
                           cluster_publish_queue=1 << 16)
            peer = Sidecar(dataclasses.replace(base, data_dir=str(tmp / f"peer-{len(rows)}"),
                                               cluster_hot_list_seconds=3600.0, **cluster)).start()
            try:
                assert peer.cluster.wait_joined(30), "the peer did not join the Mooncake master"
                _replay(peer, spec, first, ct)
                assert peer.cluster.drain(120)
                peer.hot_lists.publish_once()
                t = time.perf_counter()
                s = Sidecar(dataclasses.replace(base, data_dir=str(tmp / f"node-{len(rows)}"), **cluster,
                                                cluster_hot_list_seconds=0.0, **extra)).start()
                assert s.warmup.ready.wait(120)
                ready = time.perf_counter() - t
                assert s.cluster.wait_joined(30)  # (without warm-up nothing waited for it)
                r = _replay(s, spec, window, ct)
                rows.append((name, ready, s.warmup.report, r))
                s.stop()
            finally:
                peer.stop()
        finally:
            master.kill()
            master.wait()
    return rows


def _mooncake_master(log: Path):
    """A Mooncake master on loopback (the 'cluster' extra's binary) and its HOST:PORT."""
    import subprocess

    import mooncake

    from promptcache_devtools.procs import free_port

    port, admin = free_port(), free_port()
    master = subprocess.Popen([str(Path(mooncake.__file__).parent / "mooncake_master"), f"-rpc_port={port}",
                               "-rpc_address=127.0.0.1", f"-metrics_port={admin}", "-metrics_host=127.0.0.1"],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return master, f"127.0.0.1:{port}"


_KV_CACHE: dict = {}


def kv_for(spec, hash_ids, ct: int):
    """Per-layer (K, V) for a prompt of these blocks, each block's values derived from its id (so equal
    blocks carry equal bytes wherever they appear)."""
    import torch

    shape = (1, spec.num_kv_heads, ct, spec.head_dim)
    ks, vs = [[] for _ in range(spec.num_layers)], [[] for _ in range(spec.num_layers)]
    for h in hash_ids:
        g = torch.Generator().manual_seed(int(h))
        for layer in range(spec.num_layers):
            ks[layer].append(torch.randn(shape, generator=g))
            vs[layer].append(torch.randn(shape, generator=g))
    return [(torch.cat(ks[i], dim=2), torch.cat(vs[i], dim=2)) for i in range(spec.num_layers)]


if __name__ == "__main__":
    raise SystemExit(main())
