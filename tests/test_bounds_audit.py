"""Resource bounds against a hostile client (an adversarial audit): state that grows with what clients send must
have a stated bound (docs/security.md, "Resource limits"). Each test failed before its fix.

Repro scripts against a real `promptcache serve` (RSS measured with psutil) are in the audit's report; these are
their in-process cores, fast enough for `make test-fast`."""
from __future__ import annotations

import tracemalloc

from support import SMALL
from promptcache.sidecar import kvevents
from promptcache.sidecar.identity import Caller, Identity
from promptcache.sidecar.mrc import MissRatioCurve
from promptcache.sidecar.observer import QUEUE_EVENTS, TrafficObserver


def _keys(prefix: int, n: int, consumed: list | None = None):
    for i in range(n):
        if consumed is not None:
            consumed.append(i)
        yield prefix.to_bytes(8, "little") + i.to_bytes(24, "little")


def test_the_observer_queue_is_bounded_in_chunk_keys_not_only_events():
    """A sampled Lookup of --max-request-tokens (1Mi) tokens queues all its 4,096 chunk keys: the queue's 4,096
    events held 1.2 GiB while the observer thread fell behind (a real sidecar grew by 419 MiB in a minute of four
    clients' Lookups, and on). Now the keys queued are bounded (QUEUE_KEYS), and a prompt dropped for it costs no
    hash of its chunks beyond the root."""
    from promptcache.sidecar import observer as observer_module

    limit = getattr(observer_module, "QUEUE_KEYS", 1 << 18)
    obs = TrafficObserver(256, MissRatioCurve([1 << 30], 1.0, "lru"))  # rate 1: every prompt sampled; not started
    per_prompt = 4096
    for p in range(100):
        obs.lookup(SMALL, _keys(p, per_prompt), per_prompt * 256)
    queued = sum(len(event[2]) for event in list(obs._queue.queue))
    assert queued <= limit + per_prompt, f"{queued} chunk keys queued in {obs._queue.qsize()} events"
    assert obs.dropped >= 100 - (limit + per_prompt) // per_prompt
    consumed: list = []
    obs.lookup(SMALL, _keys(1000, per_prompt, consumed), per_prompt * 256)
    assert len(consumed) <= 1, "a dropped prompt's chunk keys were hashed for nothing"
    # everyday prompts still fill every event slot
    small = TrafficObserver(256, MissRatioCurve([1 << 30], 1.0, "lru"))
    for p in range(QUEUE_EVENTS):
        small.lookup(SMALL, _keys(p, 40), 40 * 256)
    assert small._queue.qsize() == QUEUE_EVENTS and small.dropped == 0


def test_kv_events_pod_bindings_are_bounded_whatever_the_number_of_callers():
    """A pod name stays bound to its first caller, 4 per caller, but callers are unbounded (hosts without auth: the
    addresses of an IPv6 /64): 50,000 hosts naming 4 pods each held 91 MiB. Now at most MAX_BOUND_PODS names are
    bound; a name with a topic is never forgotten, so nobody can take over a pod's topic by flooding."""
    cap = getattr(kvevents, "MAX_BOUND_PODS", 4096)
    events = kvevents.KVEvents("tcp://127.0.0.1:*", "node", 16, "CPU").start()
    try:
        events.stored(b"k" * 32, None, "m", range(16))  # a model with a chunk: a pod naming it gets a topic
        real = Caller(Identity("", "none"), "ipv4:10.1.1.1:5000")
        assert events.seen("real-pod", "m", real)
        hosts = cap // kvevents.MAX_PODS_PER_CLIENT + 500
        for n in range(hosts):
            who = Caller(Identity("", "none"), f"ipv6:[2001:db8::{n:x}]:1234")
            for i in range(kvevents.MAX_PODS_PER_CLIENT):
                events.seen(f"made-up-{n}-{i}", "no-chunks-here", who)
        assert len(events._bound) <= cap
        assert sum(map(len, events._bound_by.values())) == len(events._bound)
        # the pod with a topic keeps its name: another caller is refused it, its own caller is not
        other = Caller(Identity("", "none"), "ipv4:10.6.6.6:1")
        assert events._bound["real-pod"] == kvevents.binder_of(real)
        assert not events.seen("real-pod", "m2", other)
        assert events.seen("real-pod", "m2", real)
        # a new pod can still bind a name
        assert events.seen("late-pod", "no-chunks-here", Caller(Identity("", "none"), "ipv4:10.7.7.7:1"))
    finally:
        events.close()


def test_kv_events_queue_the_held_token_ids_not_a_list_of_ints():
    """Each queued BlockStored held its token ids as a list of Python ints (up to 36 bytes a token: 9 KiB a
    256-token chunk), outside the memory budget, 65,536 events at most: up to 600 MiB while the sender is behind.
    Now the queue holds the uint32 array the budget counts already (held_bytes_per_chunk), and the sender packs the
    same bytes."""
    events = kvevents.KVEvents("tcp://127.0.0.1:*", "node", 256, "CPU")  # not started: events stay queued
    try:
        n = 2000
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            events.stored(i.to_bytes(32, "little"), None, "m", range(1 << 20, (1 << 20) + 256))
        per_chunk = (tracemalloc.get_traced_memory()[0] - before) / n
        tracemalloc.stop()
        assert events._queue.qsize() == n
        held = kvevents.held_bytes_per_chunk(256)
        assert per_chunk < held + 1024, f"{per_chunk:.0f} bytes per queued chunk, {held} counted in the budget"
    finally:
        events._socket.close(0)  # (close() joins the sender, never started here)
        events._zmq.term()


def test_a_quota_walk_does_not_pass_the_same_pinned_chunks_for_every_chunk():
    """Tenancy.reserve over a quota walked the owner's entries from the least recent, skipping its pinned ones
    (a priority hint pins up to --max-pinned-fraction of its quota), for every chunk, under the lock every tenant's
    calls take: 37 ms per chunk at 100k pinned 256-byte chunks, 0.5 s at 1M. Now the pinned ones passed over go to
    the recent end; the victims are the same (the unpinned, oldest first)."""
    import time
    from types import SimpleNamespace

    from promptcache.sidecar.tenancy import Tenancy

    held: dict = {}

    class Tier:
        def accounted(self, n):  # (as MemoryTier.accounted with no per-chunk overhead)
            return n

        def delete(self, keys, fingerprint, reason=""):
            for k in keys:
                tenancy.removed(held.pop(k))

    def entry(i: int, pinned: bool):
        e = SimpleNamespace(key=i.to_bytes(32, "little"), fingerprint=b"f", owner="eve", accounted=256, pinned=pinned)
        held[e.key] = e
        tenancy.inserted(e)
        return e

    pinned = 100_000
    tenancy = Tenancy(enabled=True, default_quota=2 * pinned * 256, tier=Tier())
    for i in range(2 * pinned):
        entry(i, i < pinned)  # the oldest half pinned
    order = [e.key for e in tenancy._usage["eve"].entries.values() if not e.pinned]
    spent = []
    for j in range(20):
        t = time.perf_counter()
        tenancy.release("eve", tenancy.reserve("eve", 256, b"f"))
        spent.append(time.perf_counter() - t)
        entry(10**9 + j, False)
    evicted = [k for k in order if k not in held]
    assert evicted == order[:20], "the quota evicted other chunks than the oldest unpinned ones"
    assert all(held[i.to_bytes(32, "little")].pinned for i in range(pinned))  # no pinned one evicted
    assert sum(spent[1:]) / 19 < 0.005, f"{sum(spent[1:]) / 19 * 1e3:.1f} ms per chunk after the first"
