"""Opt-in access log: the sidecar's real traffic as a replayable trace (--access-log-path), rotated by size.

One JSON object per line in the trace format that `promptcache bench replay --trace FILE` reads
(promptcache.devtools.bench.traces.read_trace):

    {"timestamp": ms since the epoch, "input_length": prompt tokens, "output_length": 0,
     "hash_ids": [one integer per whole chunk], "block_tokens": tokens per chunk}

No token and no chunk key is written: each `hash_ids` entry is a keyed BLAKE2b of the chunk's key (64 bits, top bit
cleared so it stays a non-negative JSON integer), keyed by a secret drawn at random when the sidecar starts and never
written anywhere. Chunk keys are chained, so the hashed ids still identify whole prefixes: two records share entry i
iff their first i+1 chunks are equal, which is all a replay needs. Without the secret, an id cannot be tested against
a guessed prompt (a bare chunk key could: it is a SHA-256 of public inputs). Ids from different starts of the
sidecar do not match.

Sampling is by chain root (chunk 0's key), like the miss-ratio curve's, so a sampled conversation is logged whole
and a replay of the sample keeps the prefix structure. Rotation: when the next line would take the file past
--access-log-max-bytes, FILE becomes FILE.1 (FILE.1 becomes FILE.2, ...), and at most --access-log-files files are
kept (FILE included): the log never takes more than max-bytes x files on disk. A line longer than max-bytes is
dropped (and counted). Replay rotated files oldest first: `cat FILE.3 FILE.2 FILE.1 FILE > all.jsonl`.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets

_U64 = 1 << 64


def log_sampled(root: bytes, rate: float) -> bool:
    """Is the chain under `root` logged? Uses other bytes of the (uniform) key than the curve's sample."""
    return rate >= 1.0 or int.from_bytes(root[:8], "little") < rate * _U64


class AccessLog:
    def __init__(self, path: str, max_bytes: int, files: int, secret: bytes | None = None) -> None:
        if max_bytes <= 0 or files < 1:
            raise ValueError("access log: max_bytes must be positive and files at least 1")
        self.path = path
        self.max_bytes = max_bytes
        self.files = files
        self._secret = secret or secrets.token_bytes(32)
        self.records = 0
        self.dropped = 0
        self.rotations = 0
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self._file = open(path, "ab")
        self._size = self._file.tell()

    def hash_id(self, key: bytes) -> int:
        h = hashlib.blake2b(key, key=self._secret, digest_size=8).digest()
        return int.from_bytes(h, "big") >> 1

    def record(self, keys: list[bytes], input_length: int, chunk_tokens: int, timestamp_ms: int) -> None:
        line = json.dumps({"timestamp": timestamp_ms, "input_length": input_length, "output_length": 0,
                           "hash_ids": [self.hash_id(k) for k in keys], "block_tokens": chunk_tokens},
                          separators=(",", ":")).encode() + b"\n"
        if len(line) > self.max_bytes:
            self.dropped += 1
            return
        if self._size + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._file.flush()  # a crash loses at most the line being written
        self._size += len(line)
        self.records += 1

    def _rotate(self) -> None:
        self._file.close()
        if self.files == 1:
            os.remove(self.path)
        else:
            for i in range(self.files - 1, 0, -1):
                src = self.path if i == 1 else f"{self.path}.{i - 1}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i}")  # the oldest is overwritten: files stay bounded
        self._file = open(self.path, "ab")
        self._size = 0
        self.rotations += 1

    def close(self) -> None:
        self._file.close()
