"""Hot lists (promptcache.sidecar.hotlist): which chunks a node publishes for warming nodes, in what order, and how a
list read back from the cluster store is checked. End to end on a real Mooncake master: tests/test_cluster.py."""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import pytest
import xxhash

from promptcache.sidecar import hotlist
from promptcache.sidecar.hotlist import HotEntry, HotListError


@dataclass
class Held:
    key: bytes
    parent: bytes
    index: int
    hits: int = 0
    last_access: float = 0.0
    fingerprint: bytes = b"f" * 32
    owner: str = "alice"
    nbytes: int = 100


def k(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def chain(prefix: str, n: int, hits: list[int], last: float = 0.0, fp: bytes = b"f" * 32) -> list[Held]:
    out, parent = [], b"\0" * 32
    for i in range(n):
        out.append(Held(k(f"{prefix}{i}"), parent, i, hits[i], last, fp))
        parent = out[-1].key
    return out


def keys(entries) -> list[bytes]:
    return [e.key for e in entries]


def test_hottest_first_each_after_its_ancestors():
    cold = chain("c", 2, [0, 0], last=5.0)
    hot = chain("h", 3, [9, 9, 7])
    warm = chain("w", 2, [3, 3], last=1.0)
    order = hotlist.hot_order(cold + warm + hot)
    assert keys(order) == keys(hot) + keys(warm) + keys(cold)
    # a deep chunk hotter than its parents still comes after them
    deep = chain("d", 3, [1, 1, 50])
    assert keys(hotlist.hot_order(deep + hot)) == keys(deep) + keys(hot)
    # ties on hits: the most recent first
    a, b = chain("a", 1, [2], last=1.0), chain("b", 1, [2], last=2.0)
    assert keys(hotlist.hot_order(a + b)) == keys(b) + keys(a)


def test_a_chunk_without_its_whole_chain_is_left_out():
    broken = chain("x", 3, [9, 9, 9])
    del broken[1]  # chunk 2's parent is not held: no node could store chunk 2
    other_fp = chain("y", 2, [5, 5])
    other_fp[1].fingerprint = b"g" * 32  # a parent under another fingerprint is not its parent
    assert keys(hotlist.hot_order(broken + other_fp)) == [k("x0"), k("y0")]


def test_bounds_on_entries_and_bytes_never_list_a_chunk_without_its_ancestors():
    a, b, c = chain("a", 3, [9, 9, 9]), chain("b", 2, [5, 5]), chain("c", 1, [1])
    assert keys(hotlist.hot_order(a + b + c, max_entries=4)) == keys(a) + [k("b0")]
    assert keys(hotlist.hot_order(a + b + c, max_bytes=300)) == keys(a)
    assert keys(hotlist.hot_order(a + b + c, max_bytes=250)) == keys(a)[:2]
    deep = chain("d", 3, [1, 1, 50])  # the hottest chunk's chain does not fit: its cooler prefix still does
    assert keys(hotlist.hot_order(deep, max_bytes=250)) == keys(deep)[:2]
    assert hotlist.hot_order(a, max_entries=0) == []
    long_owner = chain("o", 1, [9])
    long_owner[0].owner = "x" * 256
    assert hotlist.hot_order(long_owner) == []


@pytest.mark.parametrize("seed", range(20))
def test_property_every_listed_chunk_follows_its_parent_and_each_key_is_listed_once(seed):
    rng = random.Random(seed)
    held: list[Held] = []
    for r in range(rng.randint(1, 12)):  # trees: each chunk's parent is an earlier chunk of its tree or the root
        tree: list[Held] = [Held(k(f"{r}-0"), b"\0" * 32, 0, rng.randint(0, 20), rng.random())]
        for i in range(1, rng.randint(1, 10)):
            p = rng.choice(tree)
            tree.append(Held(k(f"{r}-{i}"), p.key, p.index + 1, rng.randint(0, 20), rng.random()))
        held += tree
    dropped = set(rng.sample([h.key for h in held], rng.randint(0, len(held) // 4)))
    kept = [h for h in held if h.key not in dropped]
    cap = rng.randint(1, len(held) + 2)
    order = hotlist.hot_order(kept, max_entries=cap)
    assert len(order) <= cap and len(set(keys(order))) == len(order)
    by_key = {h.key: h for h in held}
    seen = set()
    for e in order:
        h = by_key[e.key]
        assert h.key not in dropped
        assert h.index == 0 or h.parent in seen  # the parent was listed before it
        seen.add(h.key)
    if cap > len(kept):  # unbounded: every chunk whose chain is whole is listed
        whole = set()
        for h in sorted(kept, key=lambda h: h.index):
            if h.index == 0 or h.parent in whole:
                whole.add(h.key)
        assert seen == whole


def test_a_list_round_trips_and_anything_else_is_refused_with_a_reason():
    entries = [HotEntry(k("a"), b"f" * 32, "alice"), HotEntry(k("b"), b"g" * 32, ""),
               HotEntry(k("c"), b"f" * 32, "tenant-ü")]
    raw = hotlist.encode(entries, published=1234.5)
    assert hotlist.decode(raw) == (1234.5, entries)
    assert hotlist.decode(hotlist.encode([], 1.0)) == (1.0, [])

    with pytest.raises(HotListError, match="magic"):
        hotlist.decode(b"PCC2" + raw[4:])
    for cut in range(len(raw)):  # truncated anywhere
        with pytest.raises(HotListError):
            hotlist.decode(raw[:cut])
    for at in range(0, len(raw), 7):  # one bit flipped anywhere
        bad = bytearray(raw)
        bad[at] ^= 0x10
        with pytest.raises(HotListError):
            hotlist.decode(bytes(bad))

    def signed(body: bytes) -> bytes:  # a well-formed checksum over a crafted body
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    header = struct.Struct("<4sdI")
    with pytest.raises(HotListError, match="more than the bound"):
        hotlist.decode(signed(header.pack(b"PCH1", 0.0, hotlist.MAX_ENTRIES + 1)))
    with pytest.raises(HotListError, match="runs past the end"):
        hotlist.decode(signed(header.pack(b"PCH1", 0.0, 2) + struct.pack("<32s32sB", k("a"), b"f" * 32, 0)))
    with pytest.raises(HotListError, match="owner runs past"):
        hotlist.decode(signed(header.pack(b"PCH1", 0.0, 1) + struct.pack("<32s32sB", k("a"), b"f" * 32, 9) + b"ab"))
    with pytest.raises(HotListError, match="not UTF-8"):
        entry = struct.pack("<32s32sB", k("a"), b"f" * 32, 2) + b"\xff\xfe"
        hotlist.decode(signed(header.pack(b"PCH1", 0.0, 1) + entry))
    with pytest.raises(HotListError, match="after the 0 entries"):
        hotlist.decode(signed(header.pack(b"PCH1", 0.0, 0) + b"extra"))
    with pytest.raises(ValueError, match="32-byte"):
        hotlist.encode([HotEntry(b"short", b"f" * 32, "")], 0.0)


def test_version_2_carries_hit_counts_and_version_1_lists_are_still_read():
    """A node still on version 1 during a rolling upgrade publishes lists without hit counts: read, hits 0."""
    entries = [HotEntry(k("a"), b"f" * 32, "alice", 7), HotEntry(k("b"), b"g" * 32, "", 2 ** 32 - 1)]
    raw = hotlist.encode(entries, published=5.0)
    assert raw[:4] == b"PCH2" and hotlist.decode(raw) == (5.0, entries)
    assert hotlist.decode(hotlist.encode([HotEntry(k("a"), b"f" * 32, "", 2 ** 40)], 5.0))[1][0].hits == 2 ** 32 - 1

    def signed(body: bytes) -> bytes:
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    header = struct.Struct("<4sdI")
    v1 = signed(header.pack(b"PCH1", 6.0, 1) + struct.pack("<32s32sB", k("a"), b"f" * 32, 5) + b"alice")
    assert hotlist.decode(v1) == (6.0, [HotEntry(k("a"), b"f" * 32, "alice", 0)])
    with pytest.raises(HotListError, match="runs past the end"):  # a version 1 entry under the version 2 magic
        hotlist.decode(signed(header.pack(b"PCH2", 6.0, 1) + struct.pack("<32s32sB", k("a"), b"f" * 32, 0)))


def test_the_hot_order_carries_each_chunks_hits():
    held = chain("p", 2, [4, 9])
    assert [(h.key, h.hits) for h in hotlist.hot_order(held)] == [(k("p0"), 4), (k("p1"), 9)]


def test_lists_merge_rank_by_rank_once_each_with_ancestors_first():
    a = [HotEntry(k(x), b"f" * 32, "") for x in ("a0", "a1", "a2", "s0")]
    b = [HotEntry(k(x), b"f" * 32, "") for x in ("s0", "b1")]
    c = [HotEntry(k("a0"), b"g" * 32, "")]  # the same key under another fingerprint is another chunk
    merged = hotlist.merge([a, b, c])
    assert [(e.key, e.fingerprint) for e in merged] == [
        (k("a0"), b"f" * 32), (k("s0"), b"f" * 32), (k("a0"), b"g" * 32), (k("a1"), b"f" * 32), (k("b1"), b"f" * 32),
        (k("a2"), b"f" * 32)]
    assert hotlist.merge([]) == []
    for lists in ([a], [a, a]):  # each list's order survives
        assert hotlist.merge(lists) == a


def test_slots_are_stable_and_bounded():
    assert hotlist.slot_of("10.0.0.7") == hotlist.slot_of("10.0.0.7")
    slots = {hotlist.slot_of(f"10.0.{i // 256}.{i % 256}") for i in range(500)}
    assert slots == set(range(hotlist.HOT_SLOTS))
    assert hotlist.slot_key(3) == "promptcache/v1/hot/3"
    with pytest.raises(ValueError):
        hotlist.slot_key(hotlist.HOT_SLOTS)
