"""Hot lists: what each node of the cluster tier holds hottest, so that a new or restarted node can warm its memory
tier from the cluster before it takes traffic (docs/warmup.md, docs/cluster.md).

Every node with a cluster tier publishes, every --cluster-hot-list-seconds, the keys of its memory tier's hottest
chunks (by hit count, then last access), each preceded by its ancestors (a prefix is reachable only from its root),
as one record in one of HOT_SLOTS slots of the cluster store (the slot from its name; two nodes that share a slot
overwrite each other, and a reader then sees one of them). A warming node reads every slot, merges the lists rank
by rank and fetches the chunks themselves from the cluster like any cluster hit: each is verified (fingerprint,
expiry, checksum, and dtype, shape, size and finite values as a Put's bytes) there. A list names keys only:
whoever can write a slot can make a node fetch chunks the cluster holds anyway (at most MAX_MERGED of them,
whatever the slots hold), never serve bytes it did not verify. Its owners and hit counts are a peer's word:
warm-up follows an owner only when it knows it and caps the counts (warmup.py).

Pure functions here (order, wire form, merge); cluster.py moves the bytes and warmup.py stores the chunks.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import xxhash

MAGIC = b"PCH2"  # version 2 gives each entry its hit count; version 1 lists (MAGIC_V1, no counts) are still read
MAGIC_V1 = b"PCH1"
HOT_SLOTS = 16
KEY_PREFIX = "promptcache/v1/hot/"  # beside the chunk records' promptcache/v1/<hex key> (cluster.store_key)
MAX_ENTRIES = 16_384  # per list: 64 B of keys each (plus the owner), at most about 4 MiB
MAX_OWNER_BYTES = 255
_HEADER = struct.Struct("<4sdI")  # magic, published (Unix s), entries
_ENTRY = struct.Struct("<32s32sIB")  # key, fingerprint, hits, owner length (the owner's UTF-8 follows)
_ENTRY_V1 = struct.Struct("<32s32sB")  # key, fingerprint, owner length
_TRAILER = struct.Struct("<Q")  # xxh3_64 of every byte before it


class HotListError(ValueError):
    """A slot's bytes are not a hot list of ours (foreign, truncated, corrupt, beyond the bounds)."""


@dataclass(frozen=True)
class HotEntry:
    key: bytes
    fingerprint: bytes
    owner: str  # whose quota the chunk is charged to where it is warmed
    hits: int = 0  # Gets that served it on the node that listed it: the warming node's eviction policy starts there


class Held(Protocol):  # what hot_order reads of a memory-tier entry (store.Entry)
    key: bytes
    fingerprint: bytes
    parent: bytes
    index: int
    owner: str
    hits: int
    last_access: float
    nbytes: int


def slot_of(name: str) -> int:
    """The slot a node publishes to: stable for its name (the pod's address or node name)."""
    return xxhash.xxh3_64_intdigest(name.encode()) % HOT_SLOTS


def slot_key(slot: int) -> str:
    if not 0 <= slot < HOT_SLOTS:
        raise ValueError(f"hot list slot {slot} is not in 0..{HOT_SLOTS - 1}")
    return f"{KEY_PREFIX}{slot}"


def hot_order(entries: Iterable[Held], max_entries: int = MAX_ENTRIES, max_bytes: int | None = None) -> list[HotEntry]:
    """The entries to warm, hottest first (hits, then last access), each after its ancestors; at most
    `max_entries` of them and `max_bytes` of their chunks. A chunk whose chain to its root is not all held is left
    out (no node could store it: its parent would be missing), as is one whose owner does not fit a list."""
    by_key = {e.key: e for e in entries}
    ranked = sorted(by_key.values(), key=lambda e: (e.hits, e.last_access), reverse=True)
    out: list[HotEntry] = []
    listed: set[bytes] = set()
    used = 0
    for entry in ranked:
        if len(out) >= max_entries:
            break
        if entry.key in listed:
            continue
        chain = [entry]  # the entry, then its ancestors not listed yet, up to the root
        while chain[-1].index:
            parent = by_key.get(chain[-1].parent)
            if parent is None or parent.fingerprint != entry.fingerprint or len(chain) > len(by_key):
                chain = []
                break
            if parent.key in listed:
                break
            chain.append(parent)
        if not chain or any(len(e.owner.encode()) > MAX_OWNER_BYTES for e in chain):
            continue
        size = sum(e.nbytes for e in chain)
        if len(out) + len(chain) > max_entries or (max_bytes is not None and used + size > max_bytes):
            continue  # a smaller one further down may still fit
        for e in reversed(chain):
            out.append(HotEntry(e.key, e.fingerprint, e.owner, e.hits))  # (encode caps the count)
            listed.add(e.key)
        used += size
    return out


def encode(entries: Sequence[HotEntry], published: float) -> bytes:
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"a hot list holds at most {MAX_ENTRIES} entries, not {len(entries)}")
    parts = [_HEADER.pack(MAGIC, published, len(entries))]
    for e in entries:
        owner = e.owner.encode()
        if len(e.key) != 32 or len(e.fingerprint) != 32 or len(owner) > MAX_OWNER_BYTES:
            raise ValueError("a hot list entry needs a 32-byte key and fingerprint and an owner of at most "
                             f"{MAX_OWNER_BYTES} bytes")
        parts.append(_ENTRY.pack(e.key, e.fingerprint, min(max(e.hits, 0), 0xFFFFFFFF), len(owner)) + owner)
    body = b"".join(parts)
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def decode(raw: bytes) -> tuple[float, list[HotEntry]]:
    """(published, entries) of a list encode() wrote; HotListError naming what is wrong otherwise. Everything is
    checked before anything is returned: magic, the count's bound, framing, the owners' UTF-8, the checksum."""
    raw = bytes(raw)
    if len(raw) < _HEADER.size + _TRAILER.size:
        raise HotListError(f"{len(raw)} bytes: shorter than a hot list's header and trailer")
    magic, published, count = _HEADER.unpack_from(raw)
    if magic not in (MAGIC, MAGIC_V1):
        raise HotListError(f"magic {magic!r} is not {MAGIC!r} or {MAGIC_V1!r}: not a hot list of a known version")
    entry_format = _ENTRY if magic == MAGIC else _ENTRY_V1
    if not math.isfinite(published):
        raise HotListError(f"published at {published}: not a time")
    if count > MAX_ENTRIES:
        raise HotListError(f"{count} entries announced, more than the bound of {MAX_ENTRIES}")
    body_end = len(raw) - _TRAILER.size
    (digest,) = _TRAILER.unpack_from(raw, body_end)
    if xxhash.xxh3_64_intdigest(raw[:body_end]) != digest:
        raise HotListError("checksum mismatch: truncated or corrupt")
    at, entries = _HEADER.size, []
    for i in range(count):
        if at + entry_format.size > body_end:
            raise HotListError(f"entry {i} of {count} runs past the end")
        if magic == MAGIC:
            key, fp, hits, n = entry_format.unpack_from(raw, at)
        else:
            (key, fp, n), hits = entry_format.unpack_from(raw, at), 0
        at += entry_format.size
        if at + n > body_end:
            raise HotListError(f"entry {i}'s owner runs past the end")
        try:
            owner = raw[at:at + n].decode()
        except UnicodeDecodeError:
            raise HotListError(f"entry {i}'s owner is not UTF-8") from None
        at += n
        entries.append(HotEntry(key, fp, owner, hits))
    if at != body_end:
        raise HotListError(f"{body_end - at} bytes after the {count} entries announced")
    return published, entries


MAX_MERGED = MAX_ENTRIES  # a warming node fetches at most this many chunks, whatever the 16 slots hold


def merge(lists: Iterable[Sequence[HotEntry]], limit: int = MAX_MERGED) -> list[HotEntry]:
    """One order from several nodes' lists: rank by rank (every node's hottest first, then every node's second...),
    each (key, fingerprint) once, at most `limit` entries. Each list has a chunk's ancestors before it, and so does
    the merge (and any beginning of it). The limit bounds what forged lists can make a warming node do: each entry
    is a cluster call, and entries naming keys the cluster does not hold never fill memory, which is what ends
    warm-up otherwise (16 full slots were 262,144 calls, 28 s of a warming node's cluster calls, measured here)."""
    lists = [list(x) for x in lists]
    seen: set[tuple[bytes, bytes]] = set()
    out: list[HotEntry] = []
    for rank in range(max((len(x) for x in lists), default=0)):
        for x in lists:
            if len(out) >= limit:
                return out
            if rank < len(x) and (x[rank].key, x[rank].fingerprint) not in seen:
                seen.add((x[rank].key, x[rank].fingerprint))
                out.append(x[rank])
    return out
