"""What a tier below memory is to the tier stack: `LowerTier`, and the `Record` it reads back.

A lower tier holds chunks that memory does not (the disk tier: what memory evicted for room; the cluster tier:
what any node of the fleet stored). The stack (promptcache.sidecar.tiers.stack) asks the tiers in order, and
promotes what one of them returns into memory with its single routine: a lower tier only stores, finds, verifies
and reads its own records, and knows nothing of memory, quotas or the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Record:
    """A chunk read back from a lower tier, verified (its payload matched its checksum), with what memory needs
    to serve it again and what it keeps of its history: the time it has left, its age (its maximum lifetime
    counts from its first store, on whichever tier or node), how hot it was, its owner and its own TTL."""
    key: bytes
    fingerprint: bytes
    parent: bytes
    index: int
    dtype: int
    shape: tuple[int, ...]
    checksum: int
    payload: np.ndarray  # uint8, exactly the chunk's bytes
    ttl: float  # seconds it has left
    age: float  # seconds since it was first stored
    hits: int = 0
    idle: float | None = None  # seconds since its last access, where the tier keeps it
    ttl_hint: float | None = None  # its own sliding TTL (a retention hint), where it had one
    owner: str = ""  # whose quota it was charged to, where the tier keeps it
    pinned: bool = False  # a priority hint had pinned it in memory before it came down, where the tier keeps it

    @property
    def nbytes(self) -> int:
        return int(self.payload.size)


class LowerTier:
    """A tier below memory. Every method is safe to call from any thread; none blocks on memory's lock.

    `name` labels it in Lookup answers and metrics. `moves`: a promotion takes the chunk out of this tier (one
    tier at a time: the disk) rather than copying it (the cluster keeps its copy for the other nodes). `local`:
    asking it is cheap (no network), so a Put may check it before storing. `publishes`: it is told of every chunk
    a Put stores (stored())."""

    name = "lower"
    moves = False
    local = True
    publishes = False

    def size(self, key: bytes, fingerprint: bytes) -> int | None:
        """The chunk's size when this tier holds `key` under `fingerprint`, else None. No side effects: a Lookup
        changes nothing in any tier."""
        raise NotImplementedError

    def read(self, key: bytes, fingerprint: bytes) -> Record | None:
        """The verified record of `key` under `fingerprint`, or None (absent, expired, or failed its checks:
        then dropped and counted by the tier)."""
        raise NotImplementedError

    def taken(self, key: bytes, hit: bool) -> None:
        """`key` was promoted into memory (`hit`: by a Get, not by warm-up). A moving tier drops its copy."""

    def expired(self, key: bytes) -> None:
        """`key` is past its maximum lifetime (as memory counts it): a tier that can, drops it."""

    def demote(self, entry) -> bool:
        """Memory evicted `entry` (a promptcache.sidecar.store.Entry) for room: keep it if this tier takes
        demotions. Called under memory's lock: only queue work. True when taken."""
        return False

    def stored(self, record: Record) -> None:
        """A Put stored `record` in memory (its payload: the received bytes, never written again): a shared tier
        publishes it. Must not block."""

    def delete(self, keys: list[bytes], fingerprint: bytes) -> int:
        return 0

    def purge(self, fingerprint: bytes) -> int:
        return 0

    def usage(self) -> dict[str, int] | None:
        """entries, used and budget bytes (and disk_full, queued), or None where the tier reports none."""
        return None

    def close(self) -> None:
        pass
