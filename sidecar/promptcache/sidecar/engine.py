"""The cache engine: what a request to the sidecar does, with no transport in it.

`CacheEngine` resolves a caller's model into its namespace (fingerprint and owner), answers lookups, yields the
verified chunks of the longest cached prefix (`read_chunks`: the transports decide how the bytes travel) and
stores chunks through a `PutSession` (putsession.py) that releases every reservation it holds on any exit. It raises the
project's own errors (promptcache.sidecar.errors); the gRPC servicer (promptcache.sidecar.server) and the bulk
channel (promptcache.sidecar.bulk) are thin adapters that map them to status codes.

Nothing partial is ever stored (a chunk enters the store only when its last byte has arrived and verified) or
served (every chunk is checksummed before its first byte leaves, unless its memory has been read-only since a
Get verified it there: MemoryTier.seal).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass


from promptcache.contract import keys as keyspec
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes, scan_dtype
from promptcache.sidecar import cgroup
from promptcache.sidecar.errors import DataLoss, InvalidRequest, NotServed, PermissionDenied, TimedOut
from promptcache.sidecar.identity import Caller
from promptcache.sidecar.limits import LARGE_REQUEST_TOKENS, LargeRequests, ReservedBytes
from promptcache.sidecar.putsession import PutSession
from promptcache.sidecar.sinks import ChunkSink
from promptcache.sidecar.store import MemoryTier, ReadListener, ResizeOutcome, checksum, checksum_and_finite
from promptcache.sidecar.tiers import Record, TierStack
from promptcache.sidecar.tenancy import Tenancy, TenancyError
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.contract.wire import model_from_proto

log = logging.getLogger("promptcache.sidecar")
TIER_OF = {"device": pb.TIER_DEVICE, "disk": pb.TIER_DISK, "cluster": pb.TIER_CLUSTER}
MAX_KNOWN_MODELS = 1024  # resolved (model, identity) pairs kept: a client cycling through models cannot grow it


@dataclass(frozen=True)
class Scope:
    """A caller's model, resolved: the spec (salted per tenant when tenants are isolated), the fingerprint every
    chunk key is chained from, and the owner charged for what it stores ("" the shared namespace, a tenant,
    or "group:NAME")."""
    spec: ModelSpec
    fingerprint: bytes
    owner: str


class LookedUp:
    """Chunk keys a Lookup just asked for, so that the Get following it counts each chunk as requested once: the
    eviction policies read `requested` as the reference stream (one per chunk of a client request, as the trace
    replay feeds them), and a Lookup + Get pair would otherwise count every chunk twice a few ticks apart (which
    the `rate` policy reads as a chunk coming back at once). Bounded; an entry lasts `window` seconds or until
    the Get takes it."""

    def __init__(self, window: float = 2.0, max_entries: int = 65536, clock=time.monotonic):
        self.window, self.max_entries, self.clock = window, max_entries, clock
        self._seen: collections.OrderedDict[tuple[str, bytes], float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, owner: str, key: bytes) -> None:
        with self._lock:
            self._seen[(owner, key)] = self.clock()
            self._seen.move_to_end((owner, key))
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)

    def take(self, owner: str, key: bytes) -> bool:
        """Whether `owner` looked `key` up within the window (forgotten from now on)."""
        with self._lock:
            at = self._seen.pop((owner, key), None)
        return at is not None and self.clock() - at <= self.window


class CacheEngine:
    def __init__(self, settings, tier: MemoryTier, metrics, tenancy: Tenancy, observer, *,
                 stack: TierStack | None = None, events=None, buffers=None, read_memory_limit=cgroup.memory_limit,
                 pinned_prefixes=None):
        self.settings = settings
        self.pinned_prefixes = pinned_prefixes  # pinned.PinnedPrefixes (--pinned-prefixes-file), or None
        self.chunk_tokens = settings.chunk_tokens
        self.tier = tier
        # memory, then the disk and cluster tiers where they are on (promptcache.sidecar.tiers)
        self.stack = stack if stack is not None else TierStack(tier, [], tenancy)
        self.metrics = metrics
        self.tenancy = tenancy
        self.observer = observer  # miss-ratio curve and access log; a disabled one ignores everything
        self.events = events  # promptcache.sidecar.kvevents.KVEvents with --kv-events-address
        self.buffers = buffers  # shmbuffers.SharedBuffers: the shared-memory files made for callers (--shm-dir)
        self.read_memory_limit = read_memory_limit  # the container's cgroup limit; budgets must fit under it
        self.reserved_by_client = ReservedBytes()
        self.large_requests = LargeRequests(settings.max_large_requests)
        self.hit_tokens = 0
        self.missed_tokens = 0
        self._totals_lock = threading.Lock()
        self._readers: tuple[ReadListener, ...] = (metrics, tenancy, _Totals(self))
        self._scopes: dict = {}  # (Model bytes, identity) -> Scope; namespace() is pure
        self._looked_up = LookedUp()
        # A chunk a priority hint had pinned, or a declared prefix's, is pinned again when a Get's promotion or a
        # warm-up brings it back from the disk tier (after a restart) or the cluster tier.
        self.stack.promoted = self._pin_again
        # The tier bounds each owner's pins itself, for the budget in force or a pending shrink's size, and
        # unpins what a shrink leaves over the bounds (MemoryTier.resize).
        self.tier.owner_pin_limit = self.pin_limit

    # --- requests, checked ------------------------------------------------------------------------------
    def scope(self, model: pb.Model | None, caller: Caller) -> Scope:
        """The caller's namespace for `model` (None: the request has none). With tenancy on, the salt is derived
        from the caller's identity."""
        if model is None:
            raise InvalidRequest("model is missing")
        cache_key = (model.SerializeToString(deterministic=True), caller.identity)
        known = self._scopes.get(cache_key)
        if known is None:  # pods send the same few models on every call: validated and hashed once
            known = self._resolve(model, caller)
            if len(self._scopes) >= MAX_KNOWN_MODELS:
                self._scopes.clear()
            self._scopes[cache_key] = known
        if self.events is not None:
            self._pod_seen(caller, known)
        return known

    def _resolve(self, model: pb.Model, caller: Caller) -> Scope:
        try:
            spec = model_from_proto(model)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        try:
            chunk_nbytes(spec, self.chunk_tokens)  # a layout no chunk can have (k8v4 with an odd head_dim)
        except ValueError as exc:
            raise InvalidRequest(f"model: {exc}") from None
        served = self.settings.quantization
        if served != "any" and spec.quantization != served:
            raise NotServed(f"model.quantization {spec.quantization!r} is not served here: this sidecar keeps "
                            f"{served} chunks only (--quantization)")
        try:
            salt, owner = self.tenancy.namespace(caller.identity, spec.tenant_salt)
        except TenancyError as exc:
            raise PermissionDenied(exc.message) from None
        if self.tenancy.isolate:
            spec = dataclasses.replace(spec, tenant_salt=salt)
        scope = Scope(spec, keyspec.fingerprint(spec), owner)
        # a record of this model from a lower tier (the cluster's, written by other nodes) must have its layout
        self.stack.note_model(scope.fingerprint, spec, self.chunk_tokens)
        return scope

    def ttl_hint(self, seconds: float) -> float | None:
        """A Put's retention hint as the sliding TTL its chunks get (None: none given), capped at
        --max-ttl-hint-seconds (counted); negative or NaN is refused."""
        if seconds == 0:
            return None
        if not seconds > 0:  # NaN compares false
            raise InvalidRequest(f"ttl_seconds is {seconds}: a retention hint must be positive (0: the server's TTL)")
        cap = self.settings.max_ttl_hint_seconds
        self.metrics.ttl_hints.labels("true" if seconds > cap else "false").inc()
        return min(seconds, cap)

    def pin_limit(self, owner: str, budget: int | None = None) -> int:
        """Bytes `owner` may hold pinned: --max-pinned-fraction of the memory budget (`budget`; None: the one in
        force), or of its quota if smaller. Called by the tier under its lock (MemoryTier.owner_pin_limit)."""
        budget = self.tier.budget if budget is None else budget
        quota = self.tenancy.quota(owner)
        base = budget if not quota else min(quota, budget)
        return int(self.settings.max_pinned_fraction * base)

    def pin_prefix(self, fingerprint: bytes, owner: str, keys: list[bytes]) -> int:
        """A priority hint: pin `keys` (a prefix, root first) while they are held and fit the owner's bound
        (pin_limit, which the tier applies); stops at the first that is not held or does not fit, so what is
        pinned is always a whole prefix."""
        pinned = 0
        for i, key in enumerate(keys):
            done = self.tier.pin(key, fingerprint)
            if done is None:
                break
            if not done:
                self.metrics.pins.labels("refused").inc(len(keys) - i)
                break
            pinned += 1
        if pinned:
            self.metrics.pins.labels("pinned").inc(pinned)
        return pinned

    def _pin_again(self, key: bytes, fingerprint: bytes, parent: bytes, index: int, owner: str,
                   was_pinned: bool) -> None:
        """A chunk just promoted into memory: pinned again if it was pinned when it came down (a priority hint's
        pin) or is a declared prefix's, and its parent is pinned (a pinned prefix is always whole from its root),
        within its owner's bound."""
        if index and not self.tier.is_pinned(parent, fingerprint):
            return  # (checked first: the declared keys are hashed only for a fingerprint that has a pinned root)
        if not was_pinned and (not self.pinned_prefixes or key not in self.pinned_prefixes.keys(fingerprint)):
            return
        self.pin_prefix(fingerprint, owner, [key])

    def check_tokens(self, tokens) -> None:
        if len(tokens) == 0:
            raise InvalidRequest("tokens is empty")
        if len(tokens) > self.settings.max_request_tokens:
            raise InvalidRequest(f"tokens has {len(tokens)} ids, more than the limit of "
                                 f"{self.settings.max_request_tokens} (--max-request-tokens)")

    @staticmethod
    def slot_client(caller: Caller) -> str | None:
        """Who a large-request slot counts against (limits.LargeRequests): the tenant; None for an anonymous gRPC
        caller, whose peer does not tell callers apart over a unix socket (every one is "unix:")."""
        return None if caller.identity.anonymous else caller.client

    def take_large(self, tokens, what: str, client: str | None) -> bool:
        """Take one of --max-large-requests for `client`'s request of more than LARGE_REQUEST_TOKENS tokens (True:
        taken, give it back with give_large); refused with NoCapacity when none is free for it."""
        if len(tokens) <= LARGE_REQUEST_TOKENS:
            return False
        if not self.large_requests.acquire(client):
            raise self.large_requests.refusal(what)
        return True

    def give_large(self, taken: bool, client: str | None) -> None:
        if taken:
            self.large_requests.release(client)

    @contextlib.contextmanager
    def _large(self, tokens, what: str, client: str | None):
        taken = self.take_large(tokens, what, client)
        try:
            yield
        finally:
            self.give_large(taken, client)

    def _keys(self, fp: bytes, tokens, start: int = 0, limit: int = 0):
        """The keys of chunks start.. (at most `limit`; 0: all), each hashed when the consumer asks for it."""
        n = len(tokens) // self.chunk_tokens
        stop = n if limit == 0 else min(n, start + limit)
        return itertools.islice(keyspec.iter_chunk_keys(fp, tokens, self.chunk_tokens, limit=stop), start, None)

    def _cached(self, key: bytes, fp: bytes) -> bool:
        """Stored in memory or a local lower tier (a Put's check: not a request the eviction policy counts)."""
        return self.stack.held(key, fp)

    # --- lookups ----------------------------------------------------------------------------------------
    def lookup(self, caller: Caller, model: pb.Model | None, tokens) -> pb.LookupResponse:
        scope = self.scope(model, caller)
        self.check_tokens(tokens)
        with self._large(tokens, "Lookup", self.slot_client(caller)):
            return self._lookup(scope, tokens)

    def _lookup(self, scope: Scope, tokens) -> pb.LookupResponse:
        """Where each chunk of the longest cached prefix is, tier by tier; nothing is promoted (the Get does)."""
        fp = scope.fingerprint
        chunks = []
        if self.observer.enabled:  # hashes the whole prompt only when it is sampled
            self.observer.lookup(scope.spec, self._keys(fp, tokens), len(tokens))
        by_tier: dict[str, int] = {}
        for i, key in enumerate(self._keys(fp, tokens)):
            self._looked_up.add(scope.owner, key)
            found = self.stack.where(key, fp)
            if found is None:
                break
            name, size = found
            chunks.append(pb.ChunkInfo(index=i, key=key, tier=TIER_OF[name], nbytes=size))
            by_tier[name] = by_tier.get(name, 0) + self.chunk_tokens
        cached = len(chunks) * self.chunk_tokens
        self._count_lookup("lookup", cached, len(tokens), scope.owner, by_tier)
        return pb.LookupResponse(cached_tokens=cached, chunk_tokens=self.chunk_tokens, chunks=chunks)

    def subscribe_reads(self, listener: ReadListener) -> None:
        """Tell `listener` of every Lookup and Get counted, and every chunk a Get sends, from now on."""
        self._readers = (*self._readers, listener)

    def _count_lookup(self, rpc: str, cached: int, total: int, owner: str, by_tier: dict[str, int]) -> None:
        for reader in self._readers:
            reader.looked_up(rpc, owner, cached, total, by_tier)

    # --- reads ------------------------------------------------------------------------------------------
    def read_chunks(self, caller: Caller, request: pb.GetRequest, sink: ChunkSink | None = None,
                    large_slot: bool = True, held: list | None = None):
        """Yield what `sink` makes of each chunk of the longest cached run from request.start_chunk on (the
        plain ChunkSink: (ChunkBegin, the stored bytes)), each verified against its checksum, where the sink
        placed it, before it is yielded. A chunk below memory is promoted (TierStack.acquire). The stored
        memory's lease is held until the consumer asks for the next chunk: send the bytes before that; or, with
        a `held` list, each yielded chunk's entry is appended to it still leased, so the consumer can send
        several chunks at once, and gives the leases back with release_leases(held) once they are sent.
        Counts the lookup when the consumer stops. A request of many tokens holds one of --max-large-requests
        meanwhile, unless the caller took it already (`large_slot` False: the bulk channel, before reading it)."""
        scope = self.scope(request.model if request.HasField("model") else None, caller)
        fp, owner = scope.fingerprint, scope.owner
        sink = sink if sink is not None else ChunkSink()
        self.check_tokens(request.tokens)
        large = large_slot and self.take_large(request.tokens, "Get", self.slot_client(caller))
        served = position = 0
        by_tier: dict[str, int] = {}
        keys = self._keys(fp, request.tokens, request.start_chunk, request.max_chunks)
        if request.start_chunk == 0 and request.max_chunks == 0 and self.observer.enabled:  # a whole prompt
            self.observer.lookup(scope.spec, self._keys(fp, request.tokens), len(request.tokens))
        parent = keyspec.ROOT_PARENT if request.start_chunk == 0 else None  # (None: the chunk before is not known)
        try:
            for i, key in enumerate(keys, start=request.start_chunk):
                found = self.stack.acquire(key, fp, owner, requested=not self._looked_up.take(owner, key),
                                           index=i, parent=parent)
                parent = key
                if found is None:
                    break
                entry, tier_name = found
                view = None
                yielded = False
                try:
                    placed = sink.place(entry, position)
                    if placed is None:
                        break
                    view, verified = placed
                    if not verified and checksum(view) != entry.checksum:
                        # Never served: drop it and end the prefix here, as if it had been evicted.
                        self.tier.drop_corrupt(entry)
                        self.metrics.checksum_failures.labels("device").inc()
                        log.error("chunk failed its checksum and was dropped",
                                  extra={"chunk_index": i, "key": key.hex()})
                        break
                    if not verified and (entry.protectable or entry.memfd is not None) and view is entry.array:
                        self.tier.seal(entry)  # verified where it lies: read-only from now on, never hashed again
                    item, used = sink.emit(i, entry, view, position)
                    yielded = True
                    yield item
                    position += used
                    for reader in self._readers:
                        reader.served(owner, key, entry.nbytes, tier_name)
                    served += 1
                    by_tier[tier_name] = by_tier.get(tier_name, 0) + self.chunk_tokens
                    if tier_name != "device" and self.events is not None and not entry.evicted:
                        self._announce(key, entry.parent, scope.spec, owner, i, request.tokens)
                finally:
                    view = None
                    if yielded and held is not None:
                        held.append(entry)  # its bytes may still be queued: the consumer releases it
                    else:
                        self.tier.release_lease(entry)
        finally:
            self.give_large(large, self.slot_client(caller))
            self._count_lookup("get", served * self.chunk_tokens,
                               max(0, len(request.tokens) - request.start_chunk * self.chunk_tokens), owner, by_tier)

    def release_leases(self, held: list) -> None:
        """Give back the leases read_chunks left in `held` (their bytes are sent), and empty it."""
        for entry in held:
            self.tier.release_lease(entry)
        held.clear()

    # --- writes -----------------------------------------------------------------------------------------
    def put(self, caller: Caller, header: pb.PutHeader, watch=None, large_slot: bool = True):
        """A Put of the chunks of header.tokens (a putsession.PutSession); use it as a context manager. `watch`
        (the watchdog's record of the call, or None) is told what the session holds reserved and receives
        (--min-put-bytes-per-second). `large_slot` False: the caller holds one of --max-large-requests for it
        already (the bulk channel takes it before reading the frame)."""
        return PutSession(self, caller, header, watch, large_slot)

    def store(self, incoming, spec: ModelSpec, fp: bytes, owner: str, tokens, ttl: float | None = None) -> int:
        """Verify a fully received chunk (putsession's Incoming) and commit it; the bytes stored (0: an equal
        chunk won the race)."""
        begin = incoming.begin
        scanned_as = scan_dtype(spec)  # None: opaque bytes (packed codes, fp8), checksummed only
        if incoming.check is not None:  # checked as the bytes were copied in (PutSession.add_data)
            value, finite = incoming.check.result()
        elif scanned_as is not None:  # read into the chunk by the kernel (a shared-memory file): one pass here
            value, finite = checksum_and_finite(incoming.buffer, scanned_as)
        else:
            value, finite = checksum(incoming.buffer), False
        if begin.xxh3_64 and begin.xxh3_64 != value:
            raise DataLoss(f"chunk {begin.index}: checksum of the received bytes does not match xxh3_64")
        if scanned_as is not None and not finite:
            raise InvalidRequest(f"chunk {begin.index} has NaN or Inf values: K/V must be finite")
        data = incoming.host if self.tier.on_cpu else incoming.host.to(self.tier.device)
        reservation, incoming.reservation = incoming.reservation, None
        charged, incoming.charged = incoming.charged, 0
        ttl_left = self.settings.ttl_seconds if ttl is None else ttl
        try:
            stored = self.tier.commit(reservation, key=incoming.key, fingerprint=fp, parent=incoming.parent,
                                      index=begin.index, data=data, checksum_value=value, shape=tuple(begin.shape),
                                      dtype=begin.dtype, owner=owner, values_finite=finite, ttl=ttl,
                                      sliding_ttl=ttl)
        finally:
            self.tenancy.release(owner, charged)  # a stored chunk is charged by the store's insert hook
        if not stored:
            return 0
        if self.stack.publishers:  # a shared tier publishes it (from the received bytes, never written again)
            self.stack.stored(Record(incoming.key, fp, incoming.parent, begin.index, begin.dtype, tuple(begin.shape),
                                     value, incoming.buffer, ttl=ttl_left, age=0.0))
        if self.events is not None:
            self._announce(incoming.key, incoming.parent, spec, owner, begin.index, tokens)
        return begin.nbytes

    # --- KV events --------------------------------------------------------------------------------------
    def _announced(self, owner: str) -> bool:
        """Whether KV events may announce this owner's chunks (with their token ids): the shared namespace and
        sharing groups open to every tenant; never an isolated tenant's or a restricted group's."""
        if owner == "":
            return True
        return owner.startswith("group:") and self.tenancy.groups.get(owner[len("group:"):], ()) is None

    def _pod_seen(self, caller: Caller, scope: Scope) -> None:
        """KV events: the calling inference pod gets this model's events (once a chunk of it is announced here:
        a call registers nothing, KVEvents.seen)."""
        if caller.pod and self._announced(scope.owner):
            self.events.seen(caller.pod, scope.spec.model_id, caller)

    def _announce(self, key: bytes, parent: bytes, spec, owner: str, index: int, tokens) -> None:
        """KV events: a chunk entered the memory tier (this registers its model with the events, within their
        bound: KVEvents.stored). Nothing is kept per model here."""
        if self._announced(owner):
            model, ct = spec.model_id, self.chunk_tokens
            self.events.stored(key, None if index == 0 else parent, model, tokens[index * ct:(index + 1) * ct])

    # --- management -------------------------------------------------------------------------------------
    def delete(self, caller: Caller, model: pb.Model | None, tokens, start_chunk: int = 0) -> int:
        scope = self.scope(model, caller)
        self.check_tokens(tokens)
        with self._large(tokens, "Delete", self.slot_client(caller)):
            keys = list(self._keys(scope.fingerprint, tokens, start_chunk))
        return self.stack.delete(keys, scope.fingerprint)

    def purge(self, caller: Caller, model: pb.Model | None) -> tuple[int, int]:
        """(chunks, bytes) removed: every chunk of the caller's model, in every tier."""
        scope = self.scope(model, caller)
        count, nbytes = self.stack.purge(scope.fingerprint)
        log.info("purged model", extra={"model_id": scope.spec.model_id, "chunks": count, "bytes": nbytes})
        return count, nbytes

    def stats(self, caller: Caller) -> pb.StatsResponse:
        common = dict(chunk_tokens=self.chunk_tokens, max_chunk_bytes=self.settings.max_chunk_bytes,
                      device=str(self.tier.device), eviction_policy=self.tier.policy.name)
        if not self.tenancy.is_admin(caller.identity):
            # A tenant sees its own chunks and hit counts only: whole-cache counts would show other tenants'
            # activity.
            own = self.tenancy.usage(caller.tenant)
            budget = min(own["quota"], self.tier.budget) if own["quota"] else self.tier.budget
            return pb.StatsResponse(
                tiers=[pb.TierStats(tier=pb.TIER_DEVICE, entries=own["entries"], bytes_used=own["used"],
                                    bytes_budget=budget)],
                hit_tokens=own["hit_tokens"], missed_tokens=own["missed_tokens"], **common)
        tiers = [pb.TierStats(tier=TIER_OF[name], entries=u["entries"], bytes_used=u["used"], bytes_budget=u["budget"])
                 for name, u in self.stack.usages().items()]
        return pb.StatsResponse(tiers=tiers, hit_tokens=self.hit_tokens, missed_tokens=self.missed_tokens, **common)

    def export(self, caller: Caller, max_bytes: int):
        """The bytes of a snapshot file of what this sidecar holds, hottest first (admins only; snapshot.py)."""
        if not self.tenancy.is_admin(caller.identity):
            raise PermissionDenied(f"tenant {caller.tenant!r} may not Export (--admin-tenants)")
        from promptcache.sidecar import snapshot
        from promptcache.sidecar.netaddr import is_local_peer

        if not self.tenancy.enabled and not is_local_peer(caller.peer):
            # every tenant's KV in one answer: without credentials, only to a caller on this machine
            raise PermissionDenied("Export without authentication is answered only on this machine (loopback or a "
                                   "unix socket); turn on --token-file or mTLS and call it as one of "
                                   "--admin-tenants")

        disk = self.stack.lower("disk")
        return snapshot.encode_stream(snapshot.live_records(self.tier, disk.disk if disk is not None else None,
                                                            max_bytes))

    def resize(self, caller: Caller, memory_bytes: int, wait_seconds: float) -> ResizeOutcome:
        """Set the memory tier's budget (admins only), waiting at most `wait_seconds` for Puts and Gets in flight
        to let go of what a shrink must free."""
        if not self.tenancy.is_admin(caller.identity):
            raise PermissionDenied(f"tenant {caller.tenant!r} may not Resize (--admin-tenants)")
        if memory_bytes <= 0:
            raise InvalidRequest(f"memory_bytes must be positive, got {memory_bytes}")
        # Read again: a VPA in-place resize may have raised (or lowered) the container's limit since start.
        try:
            cgroup.check_budget(memory_bytes, self.tier.device.type == "cpu", self.read_memory_limit(),
                                what="memory_bytes")
        except ValueError as exc:
            raise NotServed(str(exc)) from None
        r = self.tier.resize(memory_bytes, wait_seconds=wait_seconds)
        if r.unpinned:  # pins over the smaller budget's bounds, unpinned (they stay so if the shrink times out)
            self.metrics.pins.labels("unpinned").inc(r.unpinned)
        if not r.done:
            log.warning("shrink not applied: bytes held by calls in flight", extra={
                "previous_bytes": r.previous, "memory_bytes": r.requested, "evicted_chunks": r.evicted,
                "unpinned_chunks": r.unpinned,
                "committed_bytes": r.committed, "reserved_bytes": r.reserved, "draining_bytes": r.draining})
            raise TimedOut(f"memory_bytes {r.requested}: {r.committed} bytes still committed after waiting "
                           f"{r.waited:.1f} s ({r.reserved} reserved by Puts in flight, {r.draining} held by "
                           f"Gets of evicted chunks); the budget stays {r.previous} bytes ({r.evicted} chunks "
                           "were evicted meanwhile). Retry the Resize")
        self.metrics.resizes.inc()
        log.info("resized memory tier", extra={"previous_bytes": r.previous, "memory_bytes": r.requested,
                                               "evicted_chunks": r.evicted, "unpinned_chunks": r.unpinned,
                                               "bytes_used": r.used,
                                               "committed_bytes": r.committed, "waited_seconds": round(r.waited, 3)})
        return r


class _Totals(ReadListener):
    """The whole cache's hit and missed tokens (an admin's Stats)."""

    def __init__(self, engine: CacheEngine):
        self.engine = engine

    def looked_up(self, rpc: str, owner: str, cached: int, total: int, by_tier: dict[str, int]) -> None:
        e = self.engine
        with e._totals_lock:
            e.hit_tokens += cached
            e.missed_tokens += total - cached
