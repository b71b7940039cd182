"""`promptcache stats|lookup|purge|resize|top`: operate a running sidecar from a shell.

Each command is a thin client over the gRPC API (the same calls and credentials as PromptCacheClient); what to
print is computed by pure functions (`format_stats`, `top_row`) so it is tested without a server.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Any

from promptcache.client.credentials import CredentialError
from promptcache.client.errors import PromptCacheError

COMMANDS = ("stats", "lookup", "purge", "resize", "top")
TIERS = {1: "device", 2: "disk"}  # promptcache.v1.Tier values


def add_connection_arguments(p: argparse.ArgumentParser, address=None, output: bool = True) -> None:
    """How to reach a sidecar. `address`: the group --address goes in (export's choice between a running sidecar
    and a data folder); output False: no -o/--output (export names its file with it)."""
    env = os.environ.get
    (address or p).add_argument("--address", default=env("PROMPTCACHE_ADDRESS", "127.0.0.1:50051"),
                                help="sidecar gRPC address, HOST:PORT or unix:/PATH (env PROMPTCACHE_ADDRESS; "
                                     "default %(default)s)")
    p.add_argument("--tls-ca", default=env("PROMPTCACHE_TLS_CA"),
                   help="PEM CA bundle to verify the sidecar's certificate; turns TLS on (env PROMPTCACHE_TLS_CA)")
    p.add_argument("--tls-cert", default=env("PROMPTCACHE_TLS_CERT"),
                   help="PEM client certificate for mTLS (env PROMPTCACHE_TLS_CERT)")
    p.add_argument("--tls-key", default=env("PROMPTCACHE_TLS_KEY"),
                   help="PEM key of --tls-cert (env PROMPTCACHE_TLS_KEY)")
    p.add_argument("--tls-server-name", default=env("PROMPTCACHE_TLS_SERVER_NAME"),
                   help="name to verify the sidecar's certificate against, when it differs from the address")
    p.add_argument("--token-file", default=env("PROMPTCACHE_TOKEN_FILE"),
                   help="file holding the bearer token (env PROMPTCACHE_TOKEN_FILE); the token itself can be "
                        "given as env PROMPTCACHE_TOKEN, never as a flag, so it stays out of shell history and ps")
    p.add_argument("--timeout", type=float, default=5.0 if output else 600.0,
                   help="seconds per call (default %(default)s)")
    if output:
        p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model fingerprint's fields (docs/keys.md): a lookup or purge must name the model exactly."""
    p.add_argument("--model", required=True, help="model id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--revision", required=True, help="weights revision (or digest) the KV bytes belong to")
    p.add_argument("--kv-dtype", required=True,
                   help="KV dtype: float32, float16, bfloat16, float8_e4m3fn or float8_e5m2")
    p.add_argument("--kv-kind", default="kv", choices=["kv", "mla"],
                   help="kv (K and V per head, default) or mla (an MLA model's latents, --kv-heads 1)")
    p.add_argument("--layers", type=int, required=True, help="number of layers")
    p.add_argument("--kv-heads", type=int, required=True, help="number of KV heads")
    p.add_argument("--head-dim", type=int, required=True, help="head dimension")
    p.add_argument("--quantization", default="none", help="KV quantization mode (default %(default)s)")
    p.add_argument("--tenant-salt", default="", help="the model's tenant_salt (e.g. share:GROUP)")


def add_arguments(sub: argparse._SubParsersAction) -> None:
    helps = {"stats": "print a running sidecar's tiers, hit ratio and settings",
             "lookup": "how many leading tokens of a prompt a sidecar has cached, and in which tier",
             "purge": "delete every chunk of one model (fingerprint) from a sidecar",
             "resize": "change a sidecar's memory-tier budget (admin)",
             "top": "live view of a sidecar: hit ratio, tiers and token rates, refreshed every --interval"}
    for name in COMMANDS:
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        add_connection_arguments(p)
        if name in ("lookup", "purge"):
            add_model_arguments(p)
        if name == "lookup":
            src = p.add_mutually_exclusive_group(required=True)
            src.add_argument("--tokens", help="token ids, comma- or space-separated")
            src.add_argument("--tokens-file", help="file of token ids: a JSON list, or ids separated by "
                                                   "whitespace or commas ('-': standard input)")
        if name == "resize":
            p.add_argument("memory", help="new budget, a Kubernetes quantity such as 4Gi")
        if name == "top":
            p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
            p.add_argument("--iterations", type=int, default=0, help="stop after this many rows (0: never)")
        p.set_defaults(admin_run=run)


# --- pure: what to print ------------------------------------------------------------------------------------------
def stats_dict(resp) -> dict[str, Any]:
    looked_up = resp.hit_tokens + resp.missed_tokens
    return {
        "device": resp.device, "eviction_policy": resp.eviction_policy, "chunk_tokens": resp.chunk_tokens,
        "max_chunk_bytes": resp.max_chunk_bytes, "hit_tokens": resp.hit_tokens,
        "missed_tokens": resp.missed_tokens, "hit_ratio": resp.hit_tokens / looked_up if looked_up else None,
        "tiers": [{"tier": TIERS.get(t.tier, str(t.tier)), "entries": t.entries, "bytes_used": t.bytes_used,
                   "bytes_budget": t.bytes_budget} for t in resp.tiers],
    }


def human_bytes(n: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def format_stats(s: dict[str, Any]) -> str:
    ratio = "-" if s["hit_ratio"] is None else f"{s['hit_ratio']:.3f}"
    lines = [f"device {s['device']}  policy {s['eviction_policy']}  chunk {s['chunk_tokens']} tokens",
             f"hit ratio {ratio}  ({s['hit_tokens']} hit / {s['missed_tokens']} missed tokens since start)"]
    for t in s["tiers"]:
        use = t["bytes_used"] / t["bytes_budget"] if t["bytes_budget"] else 0.0
        lines.append(f"{t['tier']:<7} {t['entries']:>9} entries  {human_bytes(t['bytes_used']):>10} of "
                     f"{human_bytes(t['bytes_budget'])} ({use:.0%})")
    return "\n".join(lines)


TOP_HEADER = f"{'time':<8} {'hit ratio':>9} {'hit tok/s':>10} {'miss tok/s':>10} {'device used':>16} {'entries':>8}" \
             f" {'disk used':>16}"


def top_row(prev: dict[str, Any], cur: dict[str, Any], seconds: float, clock: str) -> str:
    """One line of `top`: rates over the interval between two Stats answers (the totals since start say little
    about now)."""
    hit = cur["hit_tokens"] - prev["hit_tokens"]
    miss = cur["missed_tokens"] - prev["missed_tokens"]
    if hit < 0 or miss < 0:  # the sidecar restarted between the two samples
        hit, miss = cur["hit_tokens"], cur["missed_tokens"]
    ratio = f"{hit / (hit + miss):.3f}" if hit + miss else "-"
    tiers = {t["tier"]: t for t in cur["tiers"]}

    def used(name: str) -> str:
        t = tiers.get(name)
        if t is None or not t["bytes_budget"]:
            return "-"
        return f"{human_bytes(t['bytes_used'])} {t['bytes_used'] / t['bytes_budget']:.0%}"
    dev = tiers.get("device", {"entries": 0})
    return (f"{clock:<8} {ratio:>9} {hit / seconds:>10.0f} {miss / seconds:>10.0f} {used('device'):>16} "
            f"{dev['entries']:>8} {used('disk'):>16}")


def parse_token_ids(text: str) -> list[int]:
    """Token ids as a JSON list or separated by commas or white space: whole numbers only (int() took 1.9 as 1,
    true as 1, "1_000" and other scripts' digits)."""
    text = text.strip()
    if text.startswith("["):
        try:
            ids = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError("token ids: not a JSON list of integers") from None
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise ValueError("token ids must be integers")
    else:
        parts = text.replace(",", " ").split()
        if not all(re.fullmatch(r"-?[0-9]+", p, re.ASCII) for p in parts):
            raise ValueError("token ids must be integers")
        ids = [int(p) for p in parts]
    if not ids:
        raise ValueError("no token ids given")
    if any(not 0 <= i < 2**32 for i in ids):
        raise ValueError("token ids must be in 0..4294967295")
    return ids


# --- I/O ----------------------------------------------------------------------------------------------------------
def _client(args):
    from promptcache.client import PromptCacheClient

    return PromptCacheClient(args.address, timeout=args.timeout, retries=0, tls_ca=args.tls_ca,
                             tls_cert=args.tls_cert, tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                             token=os.environ.get("PROMPTCACHE_TOKEN") or None, token_file=args.token_file)


def _spec(args):
    from promptcache.contract.keys import ModelSpec

    return ModelSpec(args.model, args.revision, args.kv_dtype, args.layers, args.kv_heads, args.head_dim,
                     quantization=args.quantization, tenant_salt=args.tenant_salt.encode(),
                     kv_kind=args.kv_kind).validate()


def _emit(args, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, sort_keys=True) if args.output == "json" else text, flush=True)


def run(args) -> int:
    prog = f"promptcache {args.command}"
    try:
        _check_flags(args)
        if args.command == "lookup":
            raw = _read_tokens_file(args.tokens_file) if args.tokens_file else args.tokens
            tokens = parse_token_ids(raw)
        spec = _spec(args) if args.command in ("lookup", "purge") else None
        if args.command == "resize":
            from promptcache.sidecar.config import parse_bytes

            memory = parse_bytes(args.memory)
        _check_credentials(args)
    except (OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        with _client(args) as client:
            if args.command == "stats":
                s = stats_dict(client.stats())
                _emit(args, s, format_stats(s))
            elif args.command == "lookup":
                r = client.lookup(spec, tokens)
                chunks = [{"index": c.index, "tier": c.tier, "nbytes": c.nbytes} for c in r.chunks]
                tiers = sorted({c["tier"] for c in chunks})
                _emit(args, {"tokens": len(tokens), "cached_tokens": r.cached_tokens,
                             "chunk_tokens": r.chunk_tokens, "chunks": chunks},
                      f"{r.cached_tokens} of {len(tokens)} tokens cached ({len(chunks)} chunks of "
                      f"{r.chunk_tokens} tokens{', in ' + ' and '.join(tiers) if tiers else ''})")
            elif args.command == "purge":
                n, nbytes = client.purge(spec)
                _emit(args, {"deleted_chunks": n, "deleted_bytes": nbytes},
                      f"deleted {n} chunks ({human_bytes(nbytes)})")
            elif args.command == "resize":
                r = client.resize(memory)
                _emit(args, {"previous_bytes": r.previous_bytes, "memory_bytes": r.memory_bytes,
                             "evicted_chunks": r.evicted_chunks, "bytes_used": r.bytes_used},
                      f"memory tier {human_bytes(r.previous_bytes)} -> {human_bytes(r.memory_bytes)}: "
                      f"{r.evicted_chunks} chunks evicted, {human_bytes(r.bytes_used)} in use")
            else:
                return _top(args, client)
    except PromptCacheError as exc:  # its message starts with the gRPC code: UNAUTHENTICATED: ...
        print(f"{prog}: {args.address}: {exc}", file=sys.stderr)
        return 1
    except CredentialError as exc:  # a credential file changed under a running command (top)
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return 0


# A prompt's token ids as text: the largest request (4Mi tokens) of 10-digit ids with separators is 46 MB. A pipe
# (`--tokens-file <(...)`, stdin) is read as it comes; /dev/zero is not read to the end.
MAX_TOKENS_FILE_BYTES = 64 << 20


def _read_tokens_file(path: str) -> str:
    with (open(sys.stdin.fileno(), "rb", closefd=False) if path == "-" else open(path, "rb")) as f:
        raw = f.read(MAX_TOKENS_FILE_BYTES + 1)
    if len(raw) > MAX_TOKENS_FILE_BYTES:
        raise ValueError(f"--tokens-file {path}: more than {MAX_TOKENS_FILE_BYTES} bytes, more token ids than a "
                         "request may carry")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--tokens-file {path}: not UTF-8 text") from None


def _check_flags(args) -> None:
    """The address and the numbers, each refused naming its flag (ValueError) before anything is dialled."""
    from promptcache.contract.addresses import target_error

    problem = target_error(args.address)
    if problem:
        raise ValueError(f"--address {args.address!r}: {problem}")
    seconds = [("--timeout", args.timeout)] + ([("--interval", args.interval)] if args.command == "top" else [])
    for flag, value in seconds:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a number of seconds above 0, got {value}")
    if args.command == "top" and args.iterations < 0:
        raise ValueError(f"--iterations must be 0 (never stop) or more, got {args.iterations}")


def _check_credentials(args) -> None:
    """Every credential file named is readable, bounded, a regular file, and (the token) not empty: else one
    line naming the flag and the file (CredentialError), before any call."""
    from promptcache.client.credentials import read_credential, read_token

    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path:
            read_credential(path, flag)
    if args.token_file:
        read_token(args.token_file, "--token-file")


def _top(args, client) -> int:
    prev, t_prev = stats_dict(client.stats()), time.monotonic()
    if args.output == "text":
        print(TOP_HEADER, flush=True)
    rows = 0
    try:
        while not args.iterations or rows < args.iterations:
            time.sleep(args.interval)
            cur, t_cur = stats_dict(client.stats()), time.monotonic()
            clock = time.strftime("%H:%M:%S")
            if args.output == "json":
                print(json.dumps({"time": clock, "seconds": t_cur - t_prev, **cur}, sort_keys=True), flush=True)
            else:
                print(top_row(prev, cur, t_cur - t_prev, clock), flush=True)
            prev, t_prev = cur, t_cur
            rows += 1
    except KeyboardInterrupt:
        pass
    return 0
