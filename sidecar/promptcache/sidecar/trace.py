"""Request traces in the Mooncake JSONL format, and their exact replay through an eviction policy.

One request per line: {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}.
`hash_ids` are chained block ids: block i's id identifies the whole prefix up to the end of block i, so two requests
share block i's id iff their first (i+1) blocks of tokens are equal (the last block may be partial). An optional
"block_tokens" says how many tokens a block holds when it is not 512: the sidecar's access log
(promptcache.sidecar.accesslog) writes its chunk size there.

The shipped half of the trace tooling: what the access log's records mean (read_trace), and the replay with the
server's prefix semantics (simulate_policy) that the miss-ratio curve's miniatures (promptcache.sidecar.mrc)
estimate. The synthetic generators and the `promptcache bench replay` benchmark around them are in
promptcache_devtools.bench (the promptcache-devtools distribution, devtools/ in the repository).

Pure and I/O-free but for read_trace and write_trace.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Iterable

BLOCK_TOKENS = 512


@dataclass
class Request:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]
    block_tokens: int = BLOCK_TOKENS

    def to_json(self) -> str:
        d = {"timestamp": self.timestamp, "input_length": self.input_length, "output_length": self.output_length,
             "hash_ids": self.hash_ids}
        if self.block_tokens != BLOCK_TOKENS:
            d["block_tokens"] = self.block_tokens
        return json.dumps(d)


MAX_LINE_BYTES = 64 << 20  # a longer line is refused (a record of a million-token prompt takes a few MB)


def _int(d: dict, name: str, default: int | None = None) -> int:
    """The integer field `name` of a record: a JSON integer (or a float with an integral, finite value)."""
    if name not in d:
        if default is None:
            raise ValueError(f"no {name!r}")
        return default
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} {v!r} is not an integer")
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise ValueError(f"{name} {v!r} is not an integer")
    return int(v)


def read_trace(path: str) -> list[Request]:
    """Read a Mooncake-format JSONL trace (a regular file; lines of at most MAX_LINE_BYTES, UTF-8); raise ValueError
    naming the file, and the line of a malformed record."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO without a writer never blocks)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise ValueError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise ValueError(f"{path}: {what}; a trace is a JSONL file")
    out = []
    with os.fdopen(fd, "rb") as f:
        lineno = 0
        while True:
            lineno += 1
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise ValueError(f"{path}:{lineno}: cannot be read: {exc.strerror or exc}") from None
            if not raw:
                break
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes; not a Mooncake trace "
                                 "record")
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError(f"a JSON {type(d).__name__}, not an object")
                hash_ids = d["hash_ids"]
                if not isinstance(hash_ids, list):
                    raise ValueError(f"hash_ids {hash_ids!r} is not a list")
                ids = [_int({"hash_ids[]": h}, "hash_ids[]") for h in hash_ids]
                req = Request(_int(d, "timestamp", 0), _int(d, "input_length"), _int(d, "output_length", 0),
                              ids, _int(d, "block_tokens", BLOCK_TOKENS))
                if req.block_tokens <= 0:
                    raise ValueError(f"block_tokens {req.block_tokens} is not positive")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record (not UTF-8 text: byte "
                                 f"{exc.start + 1} of the line)") from None
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
            out.append(req)
    return out


def write_trace(path: str, reqs: Iterable[Request]) -> None:
    with open(path, "w") as f:
        for r in reqs:
            f.write(r.to_json() + "\n")


def cached_run(ids, cached) -> int:
    """How many leading blocks of a request are in `cached`: a request hits its longest cached prefix only."""
    n = 0
    while n < len(ids) and ids[n] in cached:
        n += 1
    return n


def block_sizes(req: Request) -> list[int]:
    """Tokens covered by each of the request's blocks (the last may be partial)."""
    n = len(req.hash_ids)
    if n == 0:
        return []
    bt = req.block_tokens
    last = req.input_length - bt * (n - 1)
    if not 0 < last <= bt:  # trace does not say; assume full blocks
        last = bt
    return [bt] * (n - 1) + [last]


def simulate_policy(reqs, policy, capacity: int, measure_from: int = 0) -> dict:
    """Replay (ids, block sizes) per request through a policy (promptcache.sidecar.policies) with the server's
    prefix semantics: every block of a request is `requested`; the request hits its longest leading run of cached
    blocks (`accessed`); its missing blocks are then stored in order - a block whose parent is not cached is not
    stored (unreachable), `admit` is asked when room must be made, and `victim` is asked until the block fits.
    Returns hit/total tokens and counters. Requests before index `measure_from` only warm the cache: their tokens
    are not counted."""
    present: dict = {}
    used = 0
    hit = total = 0
    evictions = rejections = orphan_skips = 0
    req_hook, acc_hook, ins_hook, rem_hook = policy.requested, policy.accessed, policy.inserted, policy.removed
    for i, (ids, sizes) in enumerate(reqs):
        for k in ids:
            req_hook(k)
        n = cached_run(ids, present)
        if i >= measure_from:
            hit += sum(sizes[:n])
            total += sum(sizes)
        for k in ids[:n]:
            acc_hook(k)
        parent = ids[n - 1] if n else None
        for j in range(n, len(ids)):
            k = ids[j]
            if parent is not None and parent not in present:
                orphan_skips += 1
                break
            if k in present:
                acc_hook(k)
                parent = k
                continue
            s = sizes[j]
            if used + s > capacity:
                if s > capacity or not policy.admit(k, s, parent):
                    rejections += 1
                    break
                while used + s > capacity:
                    v = policy.victim()
                    if v is None:
                        break
                    if v not in present:
                        raise AssertionError(f"{policy.name}: victim {v!r} is not cached")
                    used -= present.pop(v)
                    rem_hook(v)
                    evictions += 1
                if used + s > capacity:
                    break
                if parent is not None and parent not in present:
                    orphan_skips += 1
                    break
            present[k] = s
            used += s
            ins_hook(k, s, parent)
            parent = k
        if used > capacity:
            raise AssertionError(f"{policy.name}: {used} tokens cached over capacity {capacity}")
    return {"hit": hit, "total": total, "evictions": evictions, "rejections": rejections,
            "orphan_skips": orphan_skips}
