"""The tier stack on its own (promptcache.sidecar.tiers): memory on a fake clock above a fake lower tier. Lookup
finds without promoting, a Get promotes through the one routine (age, TTL left, hits and quota kept), warm-up
promotes only what fits and is reachable, and capacity evictions go down the stack."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.store import MemoryTier
from promptcache.sidecar.tenancy import Tenancy
from promptcache.sidecar.tiers import LowerTier, Record, TierStack

FP = b"f" * 32
NBYTES = 1024


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeLower(LowerTier):
    """A lower tier in a dict; counts what the stack asks of it."""
    name = "disk"
    moves = True

    def __init__(self, takes_demotions: bool = True):
        self.records: dict[bytes, Record] = {}
        self.reads = self.taken_keys = 0
        self.expired_keys: list[bytes] = []
        self.demoted: list[bytes] = []
        self.takes_demotions = takes_demotions

    def size(self, key, fingerprint):
        r = self.records.get(key)
        return None if r is None or r.fingerprint != fingerprint else r.nbytes

    def read(self, key, fingerprint):
        self.reads += 1
        r = self.records.get(key)
        return None if r is None or (fingerprint is not None and r.fingerprint != fingerprint) else r

    def taken(self, key, hit):
        self.taken_keys += 1
        self.records.pop(key, None)

    def expired(self, key):
        self.expired_keys.append(key)
        self.records.pop(key, None)

    def demote(self, entry):
        if self.takes_demotions:
            self.demoted.append(entry.key)
        return self.takes_demotions


def record(i: int, parent: bytes = bytes(32), ttl: float = 60.0, age: float = 0.0, hits: int = 0,
           owner: str = "") -> Record:
    payload = np.random.default_rng(i).integers(0, 255, NBYTES, dtype=np.uint8)
    return Record(bytes([i]) * 32, FP, parent, 0 if parent == bytes(32) else 1, 0, (NBYTES // 4,),
                  xxhash.xxh3_64_intdigest(payload), payload, ttl=ttl, age=age, hits=hits, owner=owner)


def stack(budget: int = 4 * NBYTES, max_lifetime: float = 3600.0, quota: int = 0):
    clock = FakeClock()
    memory = MemoryTier(budget, torch.device("cpu"), make_policy("lru", capacity=budget), ttl_seconds=60.0,
                        clock=clock, max_lifetime_seconds=max_lifetime)
    tenancy = Tenancy(enabled=bool(quota), tier=memory, quotas={"alice": quota} if quota else None)
    memory.subscribe(tenancy)
    lower = FakeLower()
    return TierStack(memory, [lower], tenancy), lower, clock


def test_where_finds_each_tier_and_promotes_nothing():
    s, lower, _ = stack()
    r = record(1)
    lower.records[r.key] = r
    assert s.where(r.key, FP) == ("disk", NBYTES)
    assert s.where(r.key, b"g" * 32) is None  # another fingerprint's: not there
    assert lower.reads == 0 and not s.memory.holds(r.key, FP) and r.key in lower.records


def test_a_get_promotes_with_its_bytes_age_and_ttl_and_takes_it_out_of_the_lower_tier():
    s, lower, clock = stack(max_lifetime=100.0)
    r = record(2, ttl=30.0, age=40.0, hits=5)
    lower.records[r.key] = r
    entry, tier = s.acquire(r.key, FP, owner="")
    try:
        assert tier == "disk" and not entry.evicted
        assert bytes(entry.array) == r.payload.tobytes() and entry.checksum == r.checksum
    finally:
        s.memory.release_lease(entry)
    assert lower.taken_keys == 1 and r.key not in lower.records
    assert s.where(r.key, FP) == ("device", NBYTES)
    # Its age came along: 40 s old with a 100 s lifetime, it is gone after 60 s more however often it is hit.
    for _ in range(5):
        clock.advance(11.0)
        assert s.memory.holds(r.key, FP)
        got = s.acquire(r.key, FP, owner="")
        s.memory.release_lease(got[0])
    clock.advance(6.0)
    assert not s.memory.holds(r.key, FP)


def test_a_record_past_its_lifetime_is_not_served_and_dropped_below():
    s, lower, _ = stack(max_lifetime=100.0)
    r = record(3, age=100.0)
    lower.records[r.key] = r
    assert s.acquire(r.key, FP, owner="") is None
    assert lower.expired_keys == [r.key] and not s.memory.holds(r.key, FP)


def test_ttl_counts_on_the_memory_clock_after_promotion():
    s, lower, clock = stack()
    r, warmed = record(4, ttl=5.0), record(9, ttl=5.0)
    lower.records[r.key] = r
    lower.records[warmed.key] = warmed
    s.memory.release_lease(s.acquire(r.key, FP, owner="")[0])  # a Get's hit: slides to the tier's TTL (60 s)
    assert s.warm(lower, warmed.key) == NBYTES  # warm-up is no hit: it keeps the 5 s it had left
    clock.advance(4.9)
    assert s.memory.holds(r.key, FP) and s.memory.holds(warmed.key, FP)
    clock.advance(0.2)
    assert s.memory.holds(r.key, FP) and not s.memory.holds(warmed.key, FP)
    clock.advance(55.0)
    assert not s.memory.holds(r.key, FP)


def test_over_quota_a_get_is_served_from_the_copy_and_the_record_stays_below():
    s, lower, _ = stack(quota=NBYTES // 2)
    r = record(5)
    lower.records[r.key] = r
    entry, _ = s.acquire(r.key, FP, owner="alice")
    assert entry.evicted and bytes(entry.array) == r.payload.tobytes()
    assert r.key in lower.records and lower.taken_keys == 0 and not s.memory.holds(r.key, FP)


def test_warm_up_promotes_only_what_fits_and_is_reachable():
    s, lower, _ = stack(budget=2 * NBYTES)
    root, child, other = record(6), None, record(8)
    child = record(7, parent=root.key)
    for r in (root, child, other):
        lower.records[r.key] = r
    assert s.warm(lower, child.key) == 0  # its parent is not in memory: unreachable
    assert s.warm(lower, root.key) == NBYTES and s.warm(lower, child.key) == NBYTES
    assert s.warm(lower, other.key) == 0  # memory is full: warm-up never evicts
    assert other.key in lower.records and s.memory.usage()["entries"] == 2


@pytest.mark.parametrize("takes", [True, False])
def test_capacity_evictions_go_down_the_stack(takes):
    s, lower, _ = stack(budget=2 * NBYTES)
    lower.takes_demotions = takes
    keys = []
    for i in range(3):
        r = record(10 + i)
        keys.append(r.key)
        assert s.promote(r, "", serve=False) == (NBYTES if i < 2 else 0)  # the third does not fit
    res = s.memory.reserve(NBYTES, b"x" * 32, bytes(32))  # a Put: evicts the least recent for room
    s.memory.release(res)
    assert lower.demoted == ([keys[0]] if takes else [])


def test_a_record_not_of_its_models_layout_is_not_promoted_and_nan_times_cannot_make_an_entry_immortal():
    from promptcache.sidecar.tiers.base import ChunkLayout

    s, lower, clock = stack()
    r = record(20)  # dtype 0, shape [256]: no chunk of a model
    lower.records[r.key] = r
    s.note_layout(FP, ChunkLayout(1, (1, 2, 2, 16, 4), NBYTES, "float32"))
    assert s.acquire(r.key, FP, owner="") is None and not s.memory.holds(r.key, FP)
    assert s.promote(r, "", serve=False) == 0
    # a record of the layout, but a NaN TTL: refused; NaN times given to the memory tier count as not given
    payload = np.arange(NBYTES // 4, dtype=np.float32).view(np.uint8)
    good = Record(b"g" * 32, FP, bytes(32), 0, 1, (1, 2, 2, 16, 4), xxhash.xxh3_64_intdigest(payload), payload,
                  ttl=float("nan"), age=0.0)
    assert s.promote(good, "", serve=False) == 0
    res = s.memory.reserve(NBYTES, b"n" * 32, bytes(32))
    s.memory.host_buffer(res).numpy()[:] = payload
    assert s.memory.commit(res, key=b"n" * 32, fingerprint=FP, parent=bytes(32), index=0,
                           data=s.memory.host_buffer(res), checksum_value=good.checksum, shape=good.shape, dtype=1,
                           ttl=float("nan"), born=float("nan"), last_access=float("nan"))
    assert s.memory.holds(b"n" * 32, FP)
    clock.advance(61.0)  # past the tier's TTL (60 s)
    assert not s.memory.holds(b"n" * 32, FP)


def test_tenancy_knows_only_configured_owners_and_forgets_owners_that_hold_nothing():
    t = Tenancy(enabled=True, groups={"public": None, "team": frozenset({"carol"})}, quotas={"dave": 1},
                tenants=frozenset({"alice"}))
    for owner in ("", "alice", "carol", "dave", "group:public", "group:team"):
        assert t.knows(owner), owner
    for owner in ("mallory", "group:nobody", 'x"} injected 1'):
        assert not t.knows(owner), owner
    assert not Tenancy(enabled=False).knows("alice") and Tenancy(enabled=False).knows("")
    charged = t.charge_if_room("mallory", 10)
    assert "mallory" in t.owners()
    t.release("mallory", charged)
    assert "mallory" not in t.owners() and t.usage("dave")["quota"] == 1


def test_a_record_whose_chain_position_is_not_its_keys_is_a_miss():
    """A lower tier's record under the right key whose header says another index or parent (forged or misfiled:
    the cluster tier is written by other nodes) is not promoted: memory, hot lists and KV events would carry the
    wrong chain. Without the caller's position (None) nothing is checked."""
    s, lower, _ = stack()
    root, child = record(4), record(5, parent=bytes([4]) * 32)  # chunk 0, and chunk 1 under it
    for r in (root, child):
        lower.records[r.key] = r
    assert s.acquire(root.key, FP, owner="", index=1, parent=bytes(32)) is None  # says chunk 0
    assert s.acquire(child.key, FP, owner="", index=1, parent=bytes([9]) * 32) is None  # under another parent
    assert lower.taken_keys == 0 and not s.memory.holds(root.key, FP)
    for r, index, parent in ((root, 0, bytes(32)), (child, 1, root.key)):
        entry, tier = s.acquire(r.key, FP, owner="", index=index, parent=parent)
        assert tier == "disk"
        s.memory.release_lease(entry)
