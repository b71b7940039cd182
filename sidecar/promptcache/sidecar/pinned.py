"""Pinned prefixes declared by whoever runs the sidecar (--pinned-prefixes-file; the operator writes it from
spec.cachePolicy.pinnedPrefixes): a Put that stores or covers one of these token prefixes pins its chunks as a
Put's priority hint does (docs/retention.md), under the same bounds (--max-pinned-fraction per owner, half the budget
in all). A system prompt every pod sends is kept however much other traffic comes through, without any client
asking for it.

A Put is matched by its tokens (leading): a chunk's key chains its whole prefix, so under one fingerprint the keys of
two prompts agree exactly as far as their whole chunks of tokens do, and no key is hashed for it (a client that
changes its salt on every Put made the sidecar hash every declared prefix again each time). A chunk promoted from
the disk or cluster tier is matched by key (keys(), computed per fingerprint and kept for the last few hundred).
Only whole chunks of a prefix are pinned; a prefix names token ids,
which mean something only to the model whose tokenizer made them (the keys include the model's fingerprint, so
another model's Put with the same ids pins chunks of its own: a hint, never a correctness change).

File format (JSON): a list of {"name": "...", "tokens": [id, ...]}, checked whole before use; every error names the
file and the entry.
"""
from __future__ import annotations

import json
import os

import numpy as np
import re
import threading
from dataclasses import dataclass
from typing import Sequence

from promptcache.contract import keys as keyspec

MAX_PREFIXES = 64
MAX_TOTAL_TOKENS = 1 << 20
MAX_FILE_BYTES = 16 << 20
MAX_TOKEN_ID = (1 << 32) - 1  # the wire's uint32
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_KNOWN_FINGERPRINTS = 256  # fingerprints whose keys are kept; more clears the cache (recomputed on demand)


class PinnedPrefixesError(ValueError):
    """A pinned-prefixes file that cannot be used (the message names the file and what is wrong)."""


@dataclass(frozen=True)
class PinnedPrefix:
    name: str
    tokens: tuple[int, ...]


def parse(text: str, source: str, chunk_tokens: int, max_request_tokens: int) -> tuple[PinnedPrefix, ...]:
    """The prefixes in `text` (the JSON of a pinned-prefixes file named `source`), all checked."""
    def bad(what: str) -> PinnedPrefixesError:
        return PinnedPrefixesError(f"--pinned-prefixes-file {source}: {what}")

    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(doc, list):
        raise bad('must be a JSON list of {"name": ..., "tokens": [...]} objects')
    if len(doc) > MAX_PREFIXES:
        raise bad(f"{len(doc)} prefixes, more than {MAX_PREFIXES}")
    out, names, total = [], set(), 0
    for i, item in enumerate(doc):
        if not isinstance(item, dict) or set(item) != {"name", "tokens"}:
            raise bad(f'entry {i} must be an object with exactly "name" and "tokens"')
        name, tokens = item["name"], item["tokens"]
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"entry {i}: name {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a "
                      "letter or digit")
        if name in names:
            raise bad(f"entry {i}: name {name!r} appears twice")
        names.add(name)
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens):
            raise bad(f"prefix {name!r}: tokens must be a list of token ids (integers 0..{MAX_TOKEN_ID})")
        if len(tokens) < chunk_tokens:
            raise bad(f"prefix {name!r}: {len(tokens)} tokens, fewer than one chunk of {chunk_tokens} "
                      "(--chunk-tokens): it would pin nothing")
        if len(tokens) > max_request_tokens:
            raise bad(f"prefix {name!r}: {len(tokens)} tokens, more than --max-request-tokens {max_request_tokens}")
        total += len(tokens)
        if total > MAX_TOTAL_TOKENS:
            raise bad(f"more than {MAX_TOTAL_TOKENS} tokens in all")
        out.append(PinnedPrefix(name, tuple(tokens)))
    return tuple(out)


def load(path: str, chunk_tokens: int, max_request_tokens: int) -> "PinnedPrefixes":
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise PinnedPrefixesError(f"--pinned-prefixes-file {path}: {size} bytes, more than {MAX_FILE_BYTES}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise PinnedPrefixesError(f"--pinned-prefixes-file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PinnedPrefixesError(f"--pinned-prefixes-file {path}: not UTF-8 text") from None
    return PinnedPrefixes(parse(text, path, chunk_tokens, max_request_tokens), chunk_tokens)


class PinnedPrefixes:
    def __init__(self, prefixes: Sequence[PinnedPrefix], chunk_tokens: int):
        self.prefixes = tuple(prefixes)
        self.chunk_tokens = chunk_tokens
        self._arrays = [keyspec.tokens_to_array(p.tokens) for p in self.prefixes]
        self._keys: dict[bytes, frozenset[bytes]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.prefixes)

    def keys(self, fingerprint: bytes) -> frozenset[bytes]:
        """The chunk keys of every whole chunk of every prefix, under `fingerprint`."""
        known = self._keys.get(fingerprint)
        if known is None:
            known = frozenset(k for p in self.prefixes
                              for k in keyspec.iter_chunk_keys(fingerprint, list(p.tokens), self.chunk_tokens))
            with self._lock:
                if len(self._keys) >= _KNOWN_FINGERPRINTS:
                    self._keys.clear()
                self._keys[fingerprint] = known
        return known

    def leading(self, tokens) -> int:
        """How many whole chunks of a prompt's `tokens` (from its first) are a declared prefix's: the most whole
        chunks it shares with any prefix. Under the prompt's own fingerprint those chunks' keys are the prefix's."""
        prompt = keyspec.tokens_to_array(tokens)
        best = 0
        for prefix in self._arrays:
            n = min(len(prompt), len(prefix))
            differ = np.flatnonzero(prompt[:n] != prefix[:n])
            best = max(best, (int(differ[0]) if differ.size else n) // self.chunk_tokens)
        return best
