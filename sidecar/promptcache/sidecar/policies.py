"""Eviction and admission policies.

A policy only orders keys; the store owns the bytes. The store calls every hook under its own lock, so a
policy needs no locking of its own. Pure and I/O-free, so the trace replayer (promptcache.bench.replay)
drives the very same classes that the server uses.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def requested(self, key: bytes) -> None:
        """A client asked for `key` (hit or miss); frequency-based policies count it."""

    def admit(self, key: bytes, size: int, parent: bytes | None) -> bool:
        """Should a new entry be let in when room has to be made for it?"""

    def inserted(self, key: bytes, size: int, parent: bytes | None) -> None: ...

    def accessed(self, key: bytes) -> None: ...

    def removed(self, key: bytes) -> None: ...

    def victim(self) -> bytes | None:
        """The key to evict next (not yet removed), or None when empty."""


class LRU:
    """Least recently used; admits everything."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def requested(self, key: bytes) -> None:
        pass

    def admit(self, key: bytes, size: int, parent: bytes | None) -> bool:
        return True

    def inserted(self, key: bytes, size: int, parent: bytes | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self) -> bytes | None:
        return next(iter(self._order), None)


POLICIES = {"lru": LRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy {name!r} is not one of {', '.join(sorted(POLICIES))}") from None
