"""Eviction and admission policies (design and measurements: docs/eviction.md).

A policy only orders keys; the store owns the bytes. The store calls every hook under its own lock, so a
policy needs no locking of its own. Pure and I/O-free, so the trace replay (promptcache.sidecar.trace, which
`promptcache bench replay` and the miss-ratio curve run) drives the very same classes that the server uses.

Policies:
  lru         plain least-recently-used, admits everything (prefix-blind; the baseline).
  lru-prefix  LRU restricted to the leaves of the cached prefix forest.
  lfu         LFU with dynamic ageing (LFU-DA), leaves only.
  wtinylfu    W-TinyLFU as in Caffeine (count-min sketch + doorkeeper + periodic halving, LRU window in front of
              a segmented-LRU main space, hill-climbed window size), size-aware and prefix-aware, with a chain-root
              doorkeeper: a full cache admits a new chain only on its root's second appearance (the default
              until issue #32).
  rate        lowest estimated reuse rate (per-chunk mean gap between requests, decayed by silence) among
              sampled leaves; strong on first-turn-heavy traffic, not on the held-out Mooncake half.
  rate-class  `rate` whose chunks seen once get a reuse rate learned online per class (partial last block, depth
              where their run of new chunks started, offset in it): chosen on the production conversation trace
              (issue #32).
  rate-hazard `rate-class` whose fresh chunks are scored by a return hazard learned per class and age (ClassHazard;
              issue #32's sixth round). The default.

Prefix awareness: a chunk's key is chained over its parent's key, so a cached chunk whose parent is gone can
never be reached by a lookup. The prefix-aware policies therefore only ever offer a *leaf* as the victim - a
cached key that no cached key names as its parent - so a prefix is always trimmed from its tail and a parent
is never evicted while one of its cached descendants remains.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable, Protocol

import numpy as np

Key = Hashable  # bytes in the server (32-byte chained chunk keys); ints in the trace replayer

ROOT_PARENT = bytes(32)  # promptcache.contract.keys.ROOT_PARENT; chunk 0 names it as parent


def _is_root(parent: Key | None) -> bool:
    """Is an entry with this parent chunk 0 of its chain? The server names ROOT_PARENT, the trace replay None."""
    return parent is None or parent == ROOT_PARENT


def _detach(parent: dict, children: dict, size: dict, key):
    """Unlink a removed `key` from its parent's children; the parent when it is stored and now has no children
    left (a leaf again, evictable), else None."""
    p = parent.pop(key)
    if p is None:
        return None
    kids = children[p]
    kids.discard(key)
    if kids:
        return None
    del children[p]
    return p if p in size else None

class EvictionPolicy(Protocol):
    name: str

    def requested(self, key: bytes) -> None:
        """A client asked for `key` (hit or miss); frequency-based policies count it."""

    def admit(self, key: bytes, size: int, parent: bytes | None) -> bool:
        """Should a new entry be let in when room has to be made for it?"""

    def inserted(self, key: bytes, size: int, parent: bytes | None) -> None: ...

    def accessed(self, key: bytes) -> None: ...

    # Optional (the store asks hasattr): restored(key, hits), after inserted(), for a chunk brought back from a
    # lower tier with the hits of an earlier life.

    def removed(self, key: bytes) -> None: ...

    def victim(self) -> bytes | None:
        """The key to evict next (not yet removed), or None when empty."""


class LRU:
    """Least recently used; admits everything. Blind to prefixes: may evict a parent before its children."""

    name = "lru"

    def __init__(self, capacity: int | None = None) -> None:
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


# --------------------------------------------------------------------------------------------------------------
# Frequency sketch


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a deterministic 64-bit mix (never Python's randomised hash())."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def key_hash64(key: Key) -> int:
    if isinstance(key, (bytes, bytearray, memoryview)):
        return _mix64(int.from_bytes(bytes(key[:8]), "little") ^ len(key))
    if isinstance(key, int):
        return _mix64(key)
    if isinstance(key, str):
        return key_hash64(key.encode())
    raise TypeError(f"cannot hash policy key of type {type(key).__name__}")


class FrequencySketch:
    """TinyLFU's popularity estimate: a 4-row count-min sketch of 4-bit counters (saturating at 15), a doorkeeper
    that absorbs the first occurrence of each key, and ageing by halving every counter (and clearing the
    doorkeeper) after `sample_size` increments."""

    DEPTH = 4
    MAX = 15

    def __init__(self, entries: int = 1024, sample_factor: float = 10.0) -> None:
        self.sample_factor = sample_factor
        self.resize(entries)

    # 4 rows x 4 Mi counters = 16 MiB at most: a budget of 2**62 bytes (Resize takes any positive size) must not
    # turn into an allocation that fails half-way and leaves the sketch inconsistent.
    MAX_ENTRIES = 1 << 22

    def resize(self, entries: int) -> None:
        entries = min(self.MAX_ENTRIES, max(16, int(entries)))
        width = 1
        while width < entries:
            width <<= 1
        rows = [bytearray(width) for _ in range(self.DEPTH)]  # allocate before changing any state
        self.entries = entries
        self.width = width
        self._mask = width - 1
        self._rows = rows
        self._door: set[int] = set()
        self.sample_size = int(self.sample_factor * entries)
        self.additions = 0
        self.resets = 0

    def _indexes(self, h: int) -> tuple[int, int, int, int]:
        a, b = h & 0xFFFFFFFF, (h >> 32) | 1
        m = self._mask
        return a & m, (a + b) & m, (a + 2 * b) & m, (a + 3 * b) & m

    def frequency(self, key: Key) -> int:
        h = key_hash64(key)
        i0, i1, i2, i3 = self._indexes(h)
        r = self._rows
        est = min(r[0][i0], r[1][i1], r[2][i2], r[3][i3])
        return est + (1 if h in self._door else 0)

    def increment(self, key: Key) -> None:
        h = key_hash64(key)
        if h not in self._door:
            self._door.add(h)
        else:
            idx = self._indexes(h)
            rows = self._rows
            est = min(rows[d][i] for d, i in enumerate(idx))
            if est < self.MAX:  # conservative update: raise only the minimal counters
                for d, i in enumerate(idx):
                    if rows[d][i] == est:
                        rows[d][i] = est + 1
        self.additions += 1
        if self.additions >= self.sample_size:
            self._age()

    def _age(self) -> None:
        self._rows = [bytearray(v >> 1 for v in row) for row in self._rows]
        self._door.clear()
        self.additions //= 2
        self.resets += 1


# --------------------------------------------------------------------------------------------------------------
# Prefix-aware base: victims are leaves of the cached prefix forest, chosen from lazy priority heaps.


class _PrefixAware:
    """Tracks sizes, parents and child counts; keeps one lazy min-heap of leaves per segment.

    Heap entries are (priority, stamp, key); an entry is live iff the key is present, still in that segment,
    its stamp is the newest one pushed for it and it has no cached child. A key that loses its last cached child
    is pushed again, so it becomes a candidate with its own (older) priority. Amortised O(log n) per hook.
    """

    SEGMENTS = 1

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.size: dict[Key, int] = {}
        self.parent: dict[Key, Key | None] = {}
        self.children: dict[Key, set] = {}  # parent key -> the cached keys naming it (the parent may be absent)
        self.seg: dict[Key, int] = {}
        self.prio: dict[Key, object] = {}
        self.stamp: dict[Key, int] = {}
        self.heaps: list[list] = [[] for _ in range(self.SEGMENTS)]
        self.order: list[OrderedDict] = [OrderedDict() for _ in range(self.SEGMENTS)]  # recency, leaves or not
        self.count = [0] * self.SEGMENTS
        self.bytes = [0] * self.SEGMENTS
        self.used = 0
        self._clock = 0

    def resize(self, capacity: int) -> None:
        self.capacity = capacity

    # helpers ---------------------------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _is_leaf(self, key: Key) -> bool:
        return key not in self.children

    def _push(self, key: Key) -> None:
        st = self._tick()
        self.stamp[key] = st
        s = self.seg[key]
        heap = self.heaps[s]
        heapq.heappush(heap, (self.prio[key], st, key))
        if len(heap) > 4 * self.count[s] + 64:
            self._compact(s)

    def _live(self, s: int, entry) -> bool:
        _, st, key = entry
        return self.stamp.get(key) == st and self.seg.get(key) == s and key not in self.children

    def _compact(self, s: int) -> None:
        heap = [e for e in self.heaps[s] if self._live(s, e)]
        heapq.heapify(heap)
        self.heaps[s] = heap

    def _peek(self, s: int) -> Key | None:
        heap = self.heaps[s]
        while heap:
            entry = heap[0]
            if self._live(s, entry):
                return entry[2]
            heapq.heappop(heap)
        return None

    def _set_seg(self, key: Key, s: int) -> None:
        old = self.seg[key]
        sz = self.size[key]
        self.count[old] -= 1
        self.bytes[old] -= sz
        self.count[s] += 1
        self.bytes[s] += sz
        self.seg[key] = s
        del self.order[old][key]
        self.order[s][key] = None

    # protocol --------------------------------------------------------------------------------------------------
    def requested(self, key: Key) -> None:
        pass

    def admit(self, key: Key, size: int, parent: Key | None) -> bool:
        return self.capacity is None or size <= self.capacity

    def _add(self, key: Key, size: int, parent: Key | None, s: int, prio: object) -> None:
        if parent == ROOT_PARENT:
            parent = None
        if key in self.size:
            self.removed(key)
        self.size[key] = size
        self.parent[key] = parent
        self.seg[key] = s
        self.order[s][key] = None
        self.count[s] += 1
        self.bytes[s] += size
        self.used += size
        if parent is not None:
            kids = self.children.get(parent)
            if kids is None:
                self.children[parent] = {key}
            else:
                kids.add(key)
        self.prio[key] = prio
        self._push(key)

    def removed(self, key: Key) -> None:
        if key not in self.size:
            return
        s = self.seg.pop(key)
        sz = self.size.pop(key)
        del self.order[s][key]
        self.count[s] -= 1
        self.bytes[s] -= sz
        self.used -= sz
        self.prio.pop(key, None)
        self.stamp.pop(key, None)
        self._forget(key)
        leaf = _detach(self.parent, self.children, self.size, key)
        if leaf is not None:
            self._push(leaf)

    def _forget(self, key: Key) -> None:
        """Subclass hook: drop per-key state on removal."""

    def leaves(self) -> list[Key]:
        return [k for k in self.size if k not in self.children]


class PrefixLRU(_PrefixAware):
    """LRU over the leaves of the prefix forest: the least recently used chunk that has no cached child."""

    name = "lru-prefix"

    def inserted(self, key: Key, size: int, parent: Key | None) -> None:
        self._add(key, size, parent, 0, self._clock + 1)

    def accessed(self, key: Key) -> None:
        if key in self.size:
            self.prio[key] = self._clock + 1
            self.order[0].move_to_end(key)
            self._push(key)

    def victim(self) -> Key | None:
        return self._peek(0)


class LFUDA(_PrefixAware):
    """LFU with dynamic ageing (Arlitt et al.): priority = L + hits, where the inflation value L is raised to the
    priority of each evicted entry, so formerly popular but idle entries age out. Ties go to the least recent.
    Leaves only."""

    name = "lfu"

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.hits: dict[Key, int] = {}
        self.age = 0
        self._last_victim: Key | None = None

    def inserted(self, key: Key, size: int, parent: Key | None) -> None:
        self.hits[key] = 1
        self._add(key, size, parent, 0, (self.age + 1, self._clock + 1))

    def accessed(self, key: Key) -> None:
        if key in self.size:
            self.hits[key] += 1
            self.prio[key] = (self.age + self.hits[key], self._clock + 1)
            self._push(key)

    def victim(self) -> Key | None:
        self._last_victim = v = self._peek(0)
        return v

    def _forget(self, key: Key) -> None:
        if key == self._last_victim:
            self.age = max(self.age, self.prio_of_victim)
        self.hits.pop(key, None)

    def removed(self, key: Key) -> None:
        if key == self._last_victim and key in self.prio:
            self.prio_of_victim = self.prio[key][0]
        else:
            self.prio_of_victim = self.age
        super().removed(key)


WINDOW, PROBATION, PROTECTED = 0, 1, 2


class WTinyLFU(_PrefixAware):
    """W-TinyLFU (Einziger, Friedman, Manes; Caffeine's design), size-aware and prefix-aware.

    New entries enter an LRU *window*. When the window is over its share, its least recent leaf (the candidate)
    competes with the main space's victim (the least recent leaf of *probation*): the candidate moves to
    probation only if the sketch says it is requested more often, otherwise the candidate itself is evicted.
    A hit in probation promotes to *protected* (80 % of main); protected overflow demotes back to probation.
    The window share is hill-climbed on the observed hit rate (Caffeine's adaptive window). It starts at 80 %
    (prefix-cache reuse is recency-heavy and the climber, one 6.25 % step per 10 x capacity requests, is too slow
    to travel far on its own) and is capped at 90 %, so a TinyLFU-filtered main space always remains (at 100 %
    the policy degenerates to lru-prefix). Measurements and what did not work: docs/eviction.md.

    Size-aware: budgets are in bytes, an entry larger than the whole capacity is refused, and a candidate that
    displaces several smaller victims has to out-score each one in turn. Prefix-aware: victims are leaves.

    Chain-root doorkeeper (`root_door`, on by default): when room must be made, chunk 0 of a chain is admitted only
    if it was seen before - requested before (the sketch counts this request too, so an estimate of at least 2) or
    stored or refused before (a bounded memory of root hashes, so a conversation that returns after minutes of
    silence, when the sketch has aged it out, is not new again). A refused root takes its whole chain with it (the
    store refuses orphans). Most chains in production traffic are never reused (58 % of the Mooncake trace's blocks
    appear once), and a one-off 40k-token document would otherwise push out the window's reused prefixes; TinyLFU's
    own filter only guards the main space. Chunks under a cached parent are not filtered: the hit on the parent
    already vouched for the chain. Replay (docs/eviction.md): 1.12x / 1.05x LRU at 5 / 10 % on the held-out Mooncake
    half (1.02x / 1.01x without it); it costs up to 0.016 on a RAG generator whose every retrieval is a new root.
    """

    name = "wtinylfu"
    SEGMENTS = 3

    def __init__(self, capacity: int | None = None, window: float = 0.8, protected: float = 0.8,
                 adaptive: bool = True, climb_period: float = 10.0, tie_admit: bool = False,
                 inherit: bool = False, sample_factor: float = 10.0, max_window: float = 0.9,
                 adapt: str = "climb", min_window: float = 0.0, climb_decay: float = 0.9,
                 climb_restart: float = 0.1, root_door: bool = True) -> None:
        super().__init__(capacity)
        self.root_door = root_door
        self._roots: OrderedDict[int, None] = OrderedDict()  # hashes of chain roots stored or refused, oldest first
        self.roots_refused = 0
        self.adapt = adapt if adaptive else "none"
        self.min_window = min_window
        self.climb_decay = climb_decay
        self.climb_restart = climb_restart
        self._ghost_w: OrderedDict = OrderedDict()  # recently evicted from the window (lost the contest)
        self._ghost_m: OrderedDict = OrderedDict()  # recently evicted from the main space
        self._last: tuple | None = None
        self.tie_admit = tie_admit
        self.max_window = max_window
        self.inherit = inherit
        self.climb_period = climb_period
        self.window_fraction = window
        self.protected_fraction = protected
        self.adaptive = adaptive
        self.sketch = FrequencySketch(1024, sample_factor)
        self._peak_count = 0
        self._mean_size = 0.0
        self._n_sizes = 0
        # hill climber state
        self._sample_requests = 0
        self._sample_hits = 0
        self._prev_hit_rate = 0.0
        self._step = 0.0625
        self.admissions_rejected = 0

    # capacity / sizing ----------------------------------------------------------------------------------------
    def _cap(self) -> int:
        return self.capacity if self.capacity is not None else max(self.used, 1)

    def _entries_estimate(self) -> int:
        if self.capacity is not None and self._mean_size > 0:
            return int(self.capacity / self._mean_size)
        return self._peak_count

    def _maybe_resize_sketch(self) -> None:
        n = self._entries_estimate()
        if n > 2 * self.sketch.entries or (n > self.sketch.entries and self.sketch.additions == 0):
            self.sketch.resize(n)

    # protocol ---------------------------------------------------------------------------------------------------
    def requested(self, key: Key) -> None:
        self.sketch.increment(key)
        if self.adapt == "ghost":
            if self._ghost_w or self._ghost_m:
                self._ghost_adapt(key)
        elif self.adapt == "climb":
            self._sample_requests += 1
            if self._sample_requests >= self.climb_period * self.sketch.entries:
                self._climb()

    def admit(self, key: Key, size: int, parent: Key | None) -> bool:
        if self.capacity is not None and size > self.capacity:
            self.admissions_rejected += 1
            return False
        if self.root_door and _is_root(parent) and not self._root_seen(key):
            self.admissions_rejected += 1
            self.roots_refused += 1
            return False
        return True

    def _root_seen(self, key: Key) -> bool:
        """The chain-root doorkeeper: has this chain root (chunk 0) been seen before this appearance? Seen = requested
        before (the sketch counts this request too, hence 2), or stored or refused before (`_remember_root`), so a
        conversation that returns after its chunks were evicted gets in again, and a client that only Puts (no
        Lookup) gets its chain in on the second Put."""
        h = key_hash64(key)
        if self.sketch.frequency(key) >= 2 or h in self._roots:
            return True
        self._remember_root(h)
        return False

    def _remember_root(self, h: int) -> None:
        """Bounded: the most recent max(1024, sketch width) roots (chain roots are a small share of the entries)."""
        roots = self._roots
        roots[h] = None
        roots.move_to_end(h)
        while len(roots) > max(1024, self.sketch.entries):
            roots.popitem(last=False)

    def inserted(self, key: Key, size: int, parent: Key | None) -> None:
        if self.root_door and _is_root(parent):
            self._remember_root(key_hash64(key))
        self._n_sizes += 1
        self._mean_size += (size - self._mean_size) / self._n_sizes
        self._add(key, size, parent, WINDOW, self._clock + 1)
        n = len(self.size)
        if n > self._peak_count:
            self._peak_count = n
            if n & (n - 1) == 0:
                self._maybe_resize_sketch()
        self._drain_window()

    def accessed(self, key: Key) -> None:
        if key not in self.size:
            return
        self._sample_hits += 1
        self.prio[key] = self._clock + 1
        self.order[self.seg[key]].move_to_end(key)
        if self.seg[key] == PROBATION:
            self._set_seg(key, PROTECTED)
            self._push(key)
            self._demote_protected()
        else:
            self._push(key)

    def victim(self) -> Key | None:
        cap = self._cap()
        wmax = cap * self.window_fraction
        while self.bytes[WINDOW] > wmax:
            cand = next(iter(self.order[WINDOW]))
            if self.bytes[PROBATION] + self.bytes[PROTECTED] + self.size[cand] <= cap - wmax:
                self._move_to_probation(cand)  # the main space still has room: no contest
                continue
            vic = self._peek(PROBATION)
            if vic is None:
                vic = self._peek(PROTECTED)
            if vic is None:  # no leaf in the main space: every main entry is an ancestor of window entries
                return self._chosen(self._deepest_leaf(cand), WINDOW)
            fc, fv = self._freq(cand), self._freq(vic)
            if fc > fv or (self.tie_admit and fc == fv):
                self._move_to_probation(cand)
                return self._chosen(vic, PROBATION)
            # The candidate loses. If it is a prefix of cached chunks, those go first, deepest first: the
            # contest is decided for the head of the chain and the store keeps asking until the head is gone.
            self.admissions_rejected += 1
            return self._chosen(self._deepest_leaf(cand), WINDOW)
        for s in (PROBATION, PROTECTED, WINDOW):
            v = self._peek(s)
            if v is not None:
                return self._chosen(v, s)
        return None

    def _chosen(self, key: Key, seg: int) -> Key:
        self._last = (key, seg)
        return key

    def removed(self, key: Key) -> None:
        last = self._last
        if last is not None and last[0] == key and key in self.size and self.adapt == "ghost":
            ghost, other = (self._ghost_w, self._ghost_m) if last[1] == WINDOW else (self._ghost_m, self._ghost_w)
            ghost[key] = self.size[key]
            ghost.move_to_end(key)
            other.pop(key, None)
            limit = max(16, len(self.size))
            while len(ghost) > limit:
                ghost.popitem(last=False)
            self._last = None
        super().removed(key)

    def _ghost_adapt(self, key: Key) -> None:
        """ARC-style: a request for a key the window recently let go says the window is too small; one for a
        key the main space recently let go says it is too big. Steps are the key's share of the capacity,
        scaled by the ratio of the ghost lists (as ARC does)."""
        sz = self._ghost_w.pop(key, None)
        if sz is not None:
            ratio = max(1.0, len(self._ghost_m) / max(1, len(self._ghost_w)))
            self.window_fraction = min(self.max_window, self.window_fraction + ratio * sz / self._cap())
            self._demote_protected()
            return
        sz = self._ghost_m.pop(key, None)
        if sz is not None:
            ratio = max(1.0, len(self._ghost_w) / max(1, len(self._ghost_m)))
            self.window_fraction = max(self.min_window, self.window_fraction - ratio * sz / self._cap())

    # internals ----------------------------------------------------------------------------------------------------
    def _deepest_leaf(self, key: Key) -> Key:
        while True:
            kids = self.children.get(key)
            if not kids:
                return key
            present = [k for k in kids if k in self.size]
            if not present:
                return key
            key = max(present, key=lambda k: self.prio[k])

    def _freq(self, key: Key) -> int:
        f = self.sketch.frequency(key)
        if self.inherit:
            p = self.parent.get(key)
            if p is not None:
                f = max(f, self.sketch.frequency(p))
        return f

    def _move_to_probation(self, key: Key) -> None:
        self._set_seg(key, PROBATION)
        self.prio[key] = self._tick()
        self._push(key)

    def _drain_window(self) -> None:
        """While the cache is not yet full, window overflow moves to probation without any contest."""
        if self.capacity is None:
            return
        cap = self.capacity
        wmax = cap * self.window_fraction
        while self.bytes[WINDOW] > wmax:
            cand = next(iter(self.order[WINDOW]))
            if self.bytes[PROBATION] + self.bytes[PROTECTED] + self.size[cand] > cap - wmax:
                return
            self._move_to_probation(cand)

    def _demote_protected(self) -> None:
        pmax = (self._cap() * (1 - self.window_fraction)) * self.protected_fraction
        while self.bytes[PROTECTED] > pmax:
            self._move_to_probation(next(iter(self.order[PROTECTED])))

    def _climb(self) -> None:
        """Caffeine's hill climber: move the window share in the direction that last raised the hit rate."""
        hit_rate = self._sample_hits / max(1, self._sample_requests)
        delta = hit_rate - self._prev_hit_rate
        step = self._step if delta >= 0 else -self._step
        self._prev_hit_rate = hit_rate
        self._sample_hits = self._sample_requests = 0
        self._step = step * self.climb_decay if abs(delta) < self.climb_restart else 0.0625 * (1 if step >= 0 else -1)
        self.window_fraction = min(self.max_window, max(self.min_window, self.window_fraction + step))
        self._demote_protected()


# --------------------------------------------------------------------------------------------------------------
# Reuse rate: a per-chunk estimate of how often it is requested, sampled leaves (issue #13; not the default).


class ReuseRate:
    """Evicts the leaf with the lowest estimated reuse rate, among a deterministic random sample of leaves.

    Time is virtual: one tick per `requested` call (a chunk reference), so no clock is needed and the replay
    behaves as the server does. Per chunk (cached, or remembered in a bounded ghost list after eviction): the time
    of its last request and an exponentially weighted mean `gap` of the times between its requests. A chunk
    requested again after a gap g is treated as a Poisson source of rate 1/g that may have ended: its score is
    exp(-silence / (alive * gap)) / gap (a conversation that keeps returning quickly scores high; one silent for
    longer than its own gaps has probably ended). A chunk requested once so far has no gap yet; it gets the mean
    time to a second request of such chunks, learned online from a hash-sampled subset of them (returns /
    exposure, halved every `half_life` ticks): fresh chunks rank below proven ones where most of them are never
    reused (production traces), above stale ones where the next turn reuses them (chat), and least recent first
    among themselves. Sizes do not enter: a chunk's hit is worth its tokens and it occupies as many, so the hit
    density per byte is the rate.

    It expects one `requested` per chunk per client request, as the replay makes; a store that also reports the
    Get after a Lookup, or an existence check, makes a chunk look as if it returned at once (docs/eviction.md,
    "Integration"). O(1) per hook plus O(`sample`) per `victim()`. Memory: the cached entries, at most `ghost` x
    as many remembered chunks (at least 1024), and as many sampled fresh chunks as are cached (at least
    `fresh_track`). Prefix-aware like the others: only leaves are offered, and the parent of the entry being
    admitted is passed over while another leaf exists (evicting it would orphan the new entry). Measured
    (docs/eviction.md, "Held out"): 1.1-1.6x LRU on the tuning half of the Mooncake trace but 1.01-1.04x at 5-25 %
    on the held-out half; not below LRU on the synthetic traces. An option, not the default.
    """

    name = "rate"

    def __init__(self, capacity: int | None = None, alpha: float = 0.5, alive: float = 0.75, sample: int = 32,
                 ghost: float = 4.0, fresh_sample: int = 4, fresh_track: int = 1024, half_life: int = 1 << 16,
                 seed: int = 0) -> None:
        import random

        self.capacity = capacity
        self.alpha, self.alive, self.sample, self.ghost = alpha, alive, sample, ghost
        self.fresh_sample, self.fresh_track, self.half_life = fresh_sample, fresh_track, half_life
        self._rng = random.Random(seed)
        self.now = 0
        # the rate at which chunks seen once are requested a second time, learned from a hash-sampled subset:
        # second requests / (tracked fresh chunks x ticks), both halved every `half_life` ticks
        self._fresh: OrderedDict[Key, None] = OrderedDict()
        self._fresh_returns = 0.0
        self._fresh_exposure = 0.0
        self.stats: dict[Key, list] = {}  # key -> [time of last request, mean gap or None]
        self._ghosts: OrderedDict[Key, None] = OrderedDict()  # tracked keys that are not cached, oldest first
        self.size: dict[Key, int] = {}
        self.parent: dict[Key, Key | None] = {}
        self.children: dict[Key, set] = {}
        self._leaves: list[Key] = []
        self._leaf_at: dict[Key, int] = {}
        self._protect: Key | None = None
        self.used = 0

    def resize(self, capacity: int) -> None:
        self.capacity = capacity

    # leaves ------------------------------------------------------------------------------------------------------
    def _add_leaf(self, key: Key) -> None:
        if key not in self._leaf_at:
            self._leaf_at[key] = len(self._leaves)
            self._leaves.append(key)

    def _drop_leaf(self, key: Key) -> None:
        i = self._leaf_at.pop(key, None)
        if i is None:
            return
        last = self._leaves.pop()
        if last != key:
            self._leaves[i] = last
            self._leaf_at[last] = i

    def leaves(self) -> list[Key]:
        return list(self._leaves)

    # statistics --------------------------------------------------------------------------------------------------
    def _trim_ghosts(self) -> None:
        limit = max(1024, int(self.ghost * len(self.size)))
        while len(self._ghosts) > limit:
            old, _ = self._ghosts.popitem(last=False)
            del self.stats[old]
            self._fresh.pop(old, None)

    def requested(self, key: Key) -> None:
        self.now += 1
        self._fresh_exposure += len(self._fresh)
        if self.now % self.half_life == 0:
            self._fresh_returns /= 2
            self._fresh_exposure /= 2
        st = self.stats.get(key)
        if st is None:
            self.stats[key] = [self.now, None]
            if key not in self.size:
                self._ghosts[key] = None
                self._trim_ghosts()
            if key_hash64(key) % self.fresh_sample == 0:
                self._fresh[key] = None
                if len(self._fresh) > max(self.fresh_track, len(self.size)):
                    self._fresh.popitem(last=False)  # stops counting: censored, neither return nor exposure
            return
        if st[1] is None and key in self._fresh:
            del self._fresh[key]
            self._fresh_returns += 1
        gap = self.now - st[0]
        st[1] = gap if st[1] is None else self.alpha * gap + (1 - self.alpha) * st[1]
        st[0] = self.now
        if key in self._ghosts:
            self._ghosts.move_to_end(key)

    def _log_score(self, key: Key) -> float:
        last, gap = self.stats[key]
        if gap is None:  # requested once: the mean time to a second request, learned (a small prior return)
            gap = (self._fresh_exposure + 1.0) / (self._fresh_returns + 0.02)
        return -(self.now - last) / (self.alive * gap) - math.log(gap)

    # protocol ----------------------------------------------------------------------------------------------------
    def admit(self, key: Key, size: int, parent: Key | None) -> bool:
        self._protect = None if parent == ROOT_PARENT else parent
        return self.capacity is None or size <= self.capacity

    def inserted(self, key: Key, size: int, parent: Key | None) -> None:
        if parent == ROOT_PARENT:
            parent = None
        if key in self.size:
            self.removed(key)
        self._protect = None
        self.size[key] = size
        self.parent[key] = parent
        self.used += size
        if key in self._ghosts:
            del self._ghosts[key]
        elif key not in self.stats:
            self.stats[key] = [self.now, None]
        if parent is not None:
            self.children.setdefault(parent, set()).add(key)
            self._drop_leaf(parent)
        if key not in self.children:
            self._add_leaf(key)

    def accessed(self, key: Key) -> None:
        pass  # `requested` has counted the reference, hit or miss

    def restored(self, key: Key, hits: int) -> None:
        """`key` was just inserted from a lower tier (warm-up, or a Get's promotion) with `hits` from an earlier
        life (another process, or before it left memory). A chunk that had hits is not a fresh one: it gets a gap
        of one turnover of the cache (as many references as it holds chunks; its own gaps were counted in a clock
        that is gone), and is not sampled as a fresh chunk (that would teach the fresh rate what proven chunks do).
        Measured with warmup_bench: what the first minute after a restart serves from memory (docs/warmup.md)."""
        st = self.stats.get(key)
        if hits <= 0 or st is None or st[1] is not None or key not in self.size:
            return
        self._censor(key)
        size = self.size[key]
        st[1] = max(1, self.capacity // size if self.capacity and size else len(self.size))

    def _censor(self, key: Key) -> None:
        """Stop sampling `key` as a fresh chunk, counting neither a return nor exposure."""
        self._fresh.pop(key, None)

    def removed(self, key: Key) -> None:
        if key not in self.size:
            return
        self.used -= self.size.pop(key)
        self._drop_leaf(key)
        leaf = _detach(self.parent, self.children, self.size, key)
        if leaf is not None:
            self._add_leaf(leaf)
        if key in self.stats:
            self._ghosts[key] = None
            self._trim_ghosts()

    def _candidates(self, leaves: list[Key]) -> list[Key]:
        """The leaves victim() scores: all of them, or `sample` drawn with replacement. The draws are
        random.randrange(len(leaves))'s, without its Python overhead (the same numbers from the same seed)."""
        n = len(leaves)
        if n <= self.sample:
            return leaves
        bits, width, out = self._rng.getrandbits, n.bit_length(), []
        for _ in range(self.sample):
            i = bits(width)
            while i >= n:
                i = bits(width)
            out.append(leaves[i])
        return out

    def victim(self) -> Key | None:
        leaves = self._leaves
        if not leaves:
            return None
        candidates = self._candidates(leaves)
        best = best_score = None
        for k in candidates:
            if k == self._protect and len(leaves) > 1:
                continue
            sc = self._log_score(k)
            if best_score is None or sc < best_score:
                best, best_score = k, sc
        if best is None:  # every sample was the protected parent
            best = next(k for k in leaves if k != self._protect)
        return best


def _log2_bucket(n: int) -> int:
    """0, 1, 2-3, 4-7, 8-15, 16+ -> 0..5."""
    return min(5, n.bit_length())


class ClassRate(ReuseRate):
    """`rate` whose chunks requested once so far get a reuse rate learned per *class* of chunk, not one for all.

    The class of a fresh chunk is read off the shape of the request that stored it, as the workload-aware policy of
    "KVCache Cache in the Wild" (ATC'25) predicts reuse per request category and favours early prefix blocks:
    (partial: smaller than the largest chunk seen, i.e. a request's last block; where its run of newly stored chunks
    started: the depth of the first one, log2-bucketed, so a first turn under a shared system prompt and the new
    tail of a continued conversation differ; its offset in that run, log2-bucketed). On the Mooncake conversation
    trace a request's partial last block is reused 0.5 % of the time, the first chunk stored after a hit prefix
    40 % and the 16th 8 %, the chunks of a first turn 25-35 % (docs/eviction.md, fifth round): one rate for all
    fresh chunks evicts the wrong ones, and more so the larger the cache, where most victims are fresh.

    Per class: second requests / exposure in ticks of a hash-sampled subset of the fresh chunks stored (as `rate`
    learns its single rate), shrunk towards the pooled rate by one pseudo-return, halved every `half_life` ticks.
    No constant is fitted to a trace: the classes are fixed, their rates are learned online. In the server every
    stored chunk is whole, so "partial" marks only chunks smaller than others (another model's, a quantized
    layout's): a class label, never a decision about bytes; a parent held only by another tier counts as depth 0. Chunks requested
    twice or more are scored by their own gaps exactly as `rate` does. O(1) per hook (the halving visits the at
    most 72 classes once per `half_life` ticks), O(`sample`) per `victim()`; memory: `rate`'s plus a class, depth
    and offset per remembered chunk. The default (issue #32). Options for experiments: `classes` (a subset of
    CLASSES; none = `rate` with its fresh rate learned from all stored chunks), `tail`, and `rate`'s.
    """

    name = "rate-class"

    CLASSES = ("partial", "start", "offset")

    def __init__(self, capacity: int | None = None, classes: tuple = CLASSES, tail: float | None = None,
                 root_door: bool = False, **kw) -> None:
        super().__init__(capacity, **kw)
        self.root_door = root_door  # experiments: W-TinyLFU's chain-root doorkeeper in front
        self._refused: OrderedDict[Key, None] = OrderedDict()
        self.admissions_rejected = 0
        unknown = set(classes) - set(self.CLASSES)
        if unknown:
            raise ValueError(f"ClassRate classes {sorted(unknown)} are not among {', '.join(self.CLASSES)}")
        self._use = tuple(f in classes for f in self.CLASSES)
        self.tail = tail  # experiments: survival (1 + silence / (alive x gap)) ** -tail instead of exponential
        self._max_size = 0
        self._depth: dict[Key, int] = {}   # remembered chunk -> depth (chunk 0 = 0)
        self._off: dict[Key, int] = {}     # fresh chunk -> offset in the run of fresh chunks it was stored in
        self._cls: dict[Key, tuple] = {}   # fresh chunk -> class
        self._tracked: OrderedDict[Key, int] = OrderedDict()  # sampled fresh chunk -> tick it was stored
        self._ret: dict[tuple, float] = {}     # class -> second requests
        self._closed: dict[tuple, float] = {}  # class -> exposure of chunks no longer tracked
        self._cnt: dict[tuple, int] = {}       # class -> tracked chunks
        self._sum: dict[tuple, int] = {}       # class -> sum of their start ticks
        self._tot = [0.0, 0.0, 0, 0]           # the same, pooled: returns, closed, count, sum
        self._rates: dict[tuple, float] = {}   # per victim() call

    def _forget(self, key: Key) -> None:
        if key in self._tracked:
            self._untrack(key, returned=False)
        self._cls.pop(key, None)
        self._off.pop(key, None)
        self._depth.pop(key, None)

    def _censor(self, key: Key) -> None:
        if key in self._tracked:
            self._untrack(key, returned=False)  # (inserted just now: no exposure yet)

    def _untrack(self, key: Key, returned: bool) -> None:
        t0 = self._tracked.pop(key)
        c = self._cls[key]
        self._cnt[c] -= 1
        self._sum[c] -= t0
        self._closed[c] = self._closed.get(c, 0.0) + self.now - t0
        tot = self._tot
        tot[2] -= 1
        tot[3] -= t0
        tot[1] += self.now - t0
        if returned:
            self._ret[c] = self._ret.get(c, 0.0) + 1
            tot[0] += 1

    def _trim_ghosts(self) -> None:
        limit = max(1024, int(self.ghost * len(self.size)))
        while len(self._ghosts) > limit:
            old, _ = self._ghosts.popitem(last=False)
            del self.stats[old]
            self._forget(old)

    def requested(self, key: Key) -> None:
        self.now += 1
        if self.now % self.half_life == 0:
            for c, n in self._cnt.items():  # open exposure becomes closed, then halve
                self._closed[c] = (self._closed.get(c, 0.0) + n * self.now - self._sum[c]) / 2
                self._sum[c] = n * self.now
                self._ret[c] = self._ret.get(c, 0.0) / 2
            tot = self._tot
            tot[1] = (tot[1] + tot[2] * self.now - tot[3]) / 2
            tot[3] = tot[2] * self.now
            tot[0] /= 2
        st = self.stats.get(key)
        if st is None:
            self.stats[key] = [self.now, None]
            if key not in self.size:
                self._ghosts[key] = None
                self._trim_ghosts()
            return
        if st[1] is None and key in self._tracked:
            self._untrack(key, returned=True)
        gap = self.now - st[0]
        st[1] = gap if st[1] is None else self.alpha * gap + (1 - self.alpha) * st[1]
        st[0] = self.now
        if key in self._ghosts:
            self._ghosts.move_to_end(key)

    def inserted(self, key: Key, size: int, parent: Key | None) -> None:
        if parent == ROOT_PARENT:
            parent = None
        st = self.stats.get(key)
        fresh = st is None or st[1] is None
        super().inserted(key, size, parent)
        if size > self._max_size:
            self._max_size = size
        depth = 0 if parent is None else self._depth.get(parent, 0) + 1
        self._depth[key] = depth
        if not fresh or key in self._cls:
            return
        pst = None if parent is None else self.stats.get(parent)
        if pst is not None and pst[1] is None and parent in self._off:  # the run of fresh chunks goes on
            off = self._off[parent] + 1
            start = self._cls[parent][1] if parent in self._cls else _log2_bucket(depth)
        else:
            off, start = 0, _log2_bucket(depth)
        self._off[key] = off
        use = self._use
        c = self._cls[key] = (use[0] and size < self._max_size, start if use[1] else 0,
                              _log2_bucket(off) if use[2] else 0)
        if key_hash64(key) % self.fresh_sample == 0:
            self._tracked[key] = self.now
            self._cnt[c] = self._cnt.get(c, 0) + 1
            self._sum[c] = self._sum.get(c, 0) + self.now
            self._tot[2] += 1
            self._tot[3] += self.now
            if len(self._tracked) > max(self.fresh_track, len(self.size)):
                self._untrack(next(iter(self._tracked)), returned=False)  # censored

    def removed(self, key: Key) -> None:
        super().removed(key)
        if key not in self.stats:
            self._forget(key)

    def admit(self, key: Key, size: int, parent: Key | None) -> bool:
        if not super().admit(key, size, parent):
            return False
        if not self.root_door or not _is_root(parent):
            return True
        st = self.stats.get(key)
        if (st is not None and st[1] is not None) or key in self._refused:
            self._refused.pop(key, None)
            return True
        self._refused[key] = None
        if len(self._refused) > max(1024, len(self.size)):
            self._refused.popitem(last=False)
        self.admissions_rejected += 1
        return False

    def _class_rate(self, c: tuple | None) -> float:
        tot = self._tot
        pooled = (tot[0] + 0.02) / (tot[1] + tot[2] * self.now - tot[3] + 1.0)
        if c is None:
            return pooled
        e = self._closed.get(c, 0.0) + self._cnt.get(c, 0) * self.now - self._sum.get(c, 0)
        return (self._ret.get(c, 0.0) + 1.0) / (e + 1.0 / pooled)

    def victim(self) -> Key | None:
        self._rates = {}
        return super().victim()

    def _log_score(self, key: Key) -> float:
        last, gap = self.stats[key]
        if gap is None:
            c = self._cls.get(key)
            r = self._rates.get(c)
            if r is None:
                r = self._rates[c] = self._class_rate(c)
            gap = 1.0 / r
        if self.tail is not None:
            return -self.tail * math.log1p((self.now - last) / (self.alive * gap)) - math.log(gap)
        return -(self.now - last) / (self.alive * gap) - math.log(gap)


class ClassHazard(ClassRate):
    """`rate-class` whose chunks requested once so far are scored by a return hazard learned per class *and age*.

    Why: a fresh chunk's second request is front-loaded - a follow-up question, the next turn, the next step comes
    soon after the first request or not at all - and `rate-class` gives each class one constant (memoryless) rate, so
    it evicts a chunk that was stored a moment ago and whose follow-up is due as readily as one that has waited long
    and will not be asked again. On the `rag` generator, whose follow-ups come right after a retrieval that most
    often gets none, that puts `rate-class` 0.006-0.007 below LRU on seeds 1 and 2, and it is what held `alive` 1.5
    back in the fifth round (0.03 below LRU there on seed 0). docs/eviction.md, "Sixth round".

    How: the hash-sampled fresh chunks that `rate-class` tracks also count, per class and log2 bucket of age (ticks
    since the chunk's only request), their second requests in the bucket and the exposure spent in it (Kaplan-Meier
    style): closed records (returned, or censored) when they close; the still tracked ones by one pass over them every
    `refresh` ticks (without them the exposure at long ages is under-counted, and late returns over-weighted). Shrunk
    to the pooled per-age hazard by one pseudo-return, halved every `half_life` ticks. A fresh chunk's score is its
    mean learned hazard over [age, age + H], H the running mean silence of the recent victims - the cache's own
    horizon, measured, so the score is the expected second requests per tick while it would stay (LHD's hit density,
    with a learned hazard). Chunks requested twice or more are scored by their own gaps as in `rate-class`, with
    `alive` 1.5 (the best on the conversation tuning half in the fifth round; `alive` 0.75 gives up most of the
    gain on the synthetic trace's first half, docs/eviction.md).

    No constant is fitted to a trace: the classes and age buckets are fixed, the hazards and the horizon learned.
    Cost: `rate-class`'s, plus up to 34 buckets per class (at most 72 classes), O(34) per closed record, a pass over
    the tracked chunks every `refresh` ticks (numpy passes over arrays of their slots: about 1 ms for 100,000 tracked
    chunks; O(tracked / refresh) amortised per tick) and, per `victim()`, at most
    34 buckets per (class, age bucket) scored, cached for the call.
    """

    name = "rate-hazard"
    NB = 34  # age buckets: 0, 1, 2-3, 4-7, ... ticks

    def __init__(self, capacity: int | None = None, alive: float = 1.5, refresh: int = 1024, **kw) -> None:
        super().__init__(capacity, alive=alive, **kw)
        self.refresh = refresh
        self._hr: dict[tuple, list] = {}  # class -> second requests per age bucket (closed records)
        self._he: dict[tuple, list] = {}  # class -> exposure per age bucket (closed records)
        self._pr = [0.0] * self.NB        # the same, pooled
        self._pe = [0.0] * self.NB
        self._open: dict[tuple, list] = {}  # class -> exposure per age bucket of the still tracked chunks
        self._popen = [0.0] * self.NB
        self._open_at = -(1 << 62)
        self._horizon = 0.0               # running mean silence of the victims, in ticks
        self._victims = 0
        # The tracked chunks' store ticks and class ids in slots of two arrays, so that _refresh_open is a few numpy
        # passes: a loop over 100,000 tracked chunks took 43 ms under the store's lock every `refresh` ticks.
        self._slot: dict[Key, int] = {}   # tracked chunk -> its slot
        self._free_slots: list[int] = []
        self._slot_t0 = np.zeros(1024, dtype=np.int64)
        self._slot_class = np.full(1024, -1, dtype=np.int64)  # -1: a free slot
        self._class_id: dict[tuple, int] = {}
        self._class_of_id: list[tuple] = []

    def _track_slot(self, key: Key) -> None:
        """`key` was just sampled as a fresh chunk (ClassRate.inserted), or its class changed: (re)fill its slot."""
        c = self._cls[key]
        cid = self._class_id.get(c)
        if cid is None:
            cid = self._class_id[c] = len(self._class_of_id)
            self._class_of_id.append(c)
        i = self._slot.get(key)
        if i is None:
            i = self._slot[key] = self._free_slots.pop() if self._free_slots else self._new_slot()
        self._slot_t0[i] = self._tracked[key]
        self._slot_class[i] = cid

    def _new_slot(self) -> int:
        i = len(self._slot)  # (no slot is free: every slot below i is held)
        if i == self._slot_t0.size:
            self._slot_t0 = np.concatenate([self._slot_t0, np.zeros(i, dtype=np.int64)])
            self._slot_class = np.concatenate([self._slot_class, np.full(i, -1, dtype=np.int64)])
        return i

    def inserted(self, key: Key, size: int, parent: Key | None) -> None:
        super().inserted(key, size, parent)
        if key in self._tracked and key not in self._slot:
            self._track_slot(key)

    def _untrack(self, key: Key, returned: bool) -> None:
        i = self._slot.pop(key, None)
        if i is not None:
            self._slot_class[i] = -1
            self._free_slots.append(i)
        a = self.now - self._tracked[key]
        c = self._cls[key]
        if c not in self._hr:
            self._hr[c], self._he[c] = [0.0] * self.NB, [0.0] * self.NB
        he, pe = self._he[c], self._pe
        for b in range(min(self.NB, a.bit_length() + 1)):
            x = min(a, 1 << b) - (0 if b == 0 else 1 << (b - 1))
            if x > 0:
                he[b] += x
                pe[b] += x
        if returned:
            b = min(self.NB - 1, a.bit_length())
            self._hr[c][b] += 1
            self._pr[b] += 1
        super()._untrack(key, returned)

    def requested(self, key: Key) -> None:
        if (self.now + 1) % self.half_life == 0:  # the tick on which ClassRate halves its counts
            for row in (*self._hr.values(), *self._he.values(), self._pr, self._pe):
                for i in range(self.NB):
                    row[i] /= 2
        super().requested(key)

    def removed(self, key: Key) -> None:
        st = self.stats.get(key)
        if st is not None and key in self.size:
            self._victims += 1
            self._horizon += (self.now - st[0] - self._horizon) / min(self._victims, 1024)
        super().removed(key)

    def _refresh_open(self) -> None:
        """The still tracked chunks' exposure per class and age bucket: a chunk of age a in bucket b spent a - lo(b)
        ticks in b and every bucket below it whole. Sums of whole ticks, exact in float64: the same numbers as a loop
        over the chunks (tests/test_policies_hazard.py)."""
        nb, now = self.NB, self.now
        n = len(self._slot) + len(self._free_slots)  # slots in use or free: the arrays' used part
        cls = self._slot_class[:n]
        held = cls >= 0
        t0, cid = self._slot_t0[:n][held], cls[held]
        age = now - t0
        bucket = np.minimum(nb - 1, np.frexp(age.astype(np.float64))[1].astype(np.int64))  # int.bit_length
        lo = np.left_shift(np.int64(1), bucket) >> 1  # where bucket b starts: 0, 1, 2, 4, ...
        cells = cid * nb + bucket
        k = len(self._class_of_id)
        full = np.bincount(cells, minlength=k * nb).reshape(k, nb)
        part = np.bincount(cells, weights=(age - lo).astype(np.float64), minlength=k * nb).reshape(k, nb)
        # chunks older than bucket b, each of which spent all of b's width (1, 1, 2, 4, ...) in it
        older = np.cumsum(full[:, ::-1], axis=1)[:, ::-1] - full
        width = np.maximum(1, np.left_shift(np.int64(1), np.arange(nb, dtype=np.int64)) >> 1)
        exposure = older * width + part
        present = np.flatnonzero(full.sum(axis=1))
        self._open = {self._class_of_id[i]: exposure[i].tolist() for i in present}
        self._popen = exposure[present].sum(axis=0).tolist() if present.size else [0.0] * nb
        self._open_at = now

    def victim(self) -> Key | None:
        if self.now - self._open_at >= self.refresh:
            self._refresh_open()
        if self.tail is not None:  # experiments: the general path
            return super().victim()
        # ReuseRate.victim with _log_score inlined: the same sample, the same scores, the same choice (a replay
        # through both gives the same victims, tests/test_policies_hazard.py), at a third of the cost per victim:
        # the sidecar calls it once per chunk stored into a full tier, and so does every miss-ratio miniature.
        self._rates = rates = {}
        leaves = self._leaves
        n = len(leaves)
        if not n:
            return None
        candidates = self._candidates(leaves)
        stats, cls, now, protect, alive, log = self.stats, self._cls, self.now, self._protect, self.alive, math.log
        nb = self.NB
        best = best_score = None
        for k in candidates:
            if k == protect and n > 1:
                continue
            last, gap = stats[k]
            if gap is not None:
                sc = -(now - last) / (alive * gap) - log(gap)
            else:
                b0 = (now - last).bit_length()
                at = (cls.get(k), b0 if b0 < nb else nb - 1)
                sc = rates.get(at)
                if sc is None:
                    sc = rates[at] = log(self._fresh_rate(*at))
            if best_score is None or sc < best_score:
                best, best_score = k, sc
        if best is None:  # every sample was the protected parent
            best = next(k for k in leaves if k != protect)
        return best

    def _fresh_rate(self, c: tuple | None, b0: int) -> float:
        """The mean learned hazard of class `c` over [age, age + horizon], for an age in bucket `b0`."""
        r0 = self._class_rate(None)
        t = 0 if b0 == 0 else 1 << (b0 - 1)
        h = max(1.0, self._horizon)
        end, tot, b, nb = t + h, 0.0, b0, self.NB
        # per age bucket b, the hazard of class c: its returns per exposure, shrunk by one pseudo-return to the
        # pooled hazard (each row fetched once: this is victim()'s inner loop)
        pr, pe, popen, inv_r0 = self._pr, self._pe, self._popen, 1.0 / r0
        hr, he, op = self._hr.get(c), self._he.get(c), self._open.get(c)
        while t < end and b < nb:
            pooled = (pr[b] + 1.0) / (pe[b] + popen[b] + inv_r0)
            if hr is None and op is None:
                hz = pooled
            else:
                e = (he[b] if he is not None else 0.0) + (op[b] if op is not None else 0.0)
                hz = ((hr[b] if hr is not None else 0.0) + 1.0) / (e + 1.0 / pooled)
            tot += (min(end, 1 << b) - t) * hz
            t, b = 1 << b, b + 1
        return tot / h

    def _log_score(self, key: Key) -> float:
        last, gap = self.stats[key]
        if gap is not None:
            return super()._log_score(key)
        at = (self._cls.get(key), min(self.NB - 1, (self.now - last).bit_length()))
        sc = self._rates.get(at)
        if sc is None:
            sc = self._rates[at] = math.log(self._fresh_rate(*at))
        return sc


POLICIES = {"lru": LRU, "lru-prefix": PrefixLRU, "lfu": LFUDA, "wtinylfu": WTinyLFU, "rate": ReuseRate,
            "rate-class": ClassRate, "rate-hazard": ClassHazard}
DEFAULT_POLICY = "rate-hazard"


def make_policy(name: str, capacity: int | None = None) -> EvictionPolicy:
    """A fresh policy. `capacity` (bytes) lets size-proportioned policies (W-TinyLFU) set their segments before
    the cache first fills; without it they infer it from the occupancy at the first eviction."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"eviction policy {name!r} is not one of {', '.join(sorted(POLICIES))}") from None
    return cls(capacity)
