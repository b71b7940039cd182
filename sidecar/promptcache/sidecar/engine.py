"""The cache engine: what a request to the sidecar does, with no transport in it.

`CacheEngine` resolves a caller's model into its namespace (fingerprint and owner), answers lookups, yields the
verified chunks of the longest cached prefix (`read_chunks`: the transports decide how the bytes travel) and
stores chunks through a `PutSession` that releases every reservation it holds on any exit. It raises the
project's own errors (promptcache.sidecar.errors); the gRPC servicer (promptcache.sidecar.server) and the bulk
channel (promptcache.sidecar.bulk) are thin adapters that map them to status codes.

Nothing partial is ever stored (a chunk enters the store only when its last byte has arrived and verified) or
served (every chunk is checksummed before its first byte leaves).
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

import numpy as np
import torch

from promptcache.contract import keys as keyspec
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import chunk_nbytes, chunk_shape, scanned
from promptcache.contract.shm import SharedBufferError, SharedFile
from promptcache.sidecar import cgroup
from promptcache.sidecar.errors import (DataLoss, InvalidRequest, NoCapacity, NotFound, NotServed, PermissionDenied,
                                        TimedOut)
from promptcache.sidecar.identity import Caller
from promptcache.sidecar.limits import LARGE_REQUEST_TOKENS, LargeRequests, ReservedBytes
from promptcache.sidecar.shmbuffers import BufferLimit, SharedBuffers, UnknownBuffer
from promptcache.sidecar.store import (AdmissionRejected, ChunkTooLarge, Entry, MemoryTier, NoRoom, Reservation,
                                       ResizeOutcome, StoreError, checksum, checksum_and_finite)
from promptcache.sidecar.tenancy import Tenancy, TenancyError
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.contract.wire import NAME_TO_DTYPE, model_from_proto

log = logging.getLogger("promptcache.sidecar")
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
    def __init__(self, settings, tier: MemoryTier, metrics, tenancy: Tenancy, observer, *, spill=None,
                 cluster=None, events=None, buffers: SharedBuffers | None = None,
                 read_memory_limit=cgroup.memory_limit):
        self.settings = settings
        self.chunk_tokens = settings.chunk_tokens
        self.tier = tier
        self.metrics = metrics
        self.tenancy = tenancy
        self.observer = observer  # miss-ratio curve and access log; a disabled one ignores everything
        self.spill = spill  # promptcache.sidecar.spill.Spill when the disk tier is on
        self.cluster = cluster  # promptcache.sidecar.cluster.ClusterTier with --cluster-master
        self.events = events  # promptcache.sidecar.kvevents.KVEvents with --kv-events-address
        self.buffers = buffers  # the shared-memory files this sidecar created for its callers (--shm-dir)
        self.read_memory_limit = read_memory_limit  # the container's cgroup limit; budgets must fit under it
        self.reserved_by_client = ReservedBytes()
        self.large_requests = LargeRequests(settings.max_large_requests)
        self.hit_tokens = 0
        self.missed_tokens = 0
        self._totals_lock = threading.Lock()
        self._scopes: dict = {}  # (Model bytes, identity) -> Scope; namespace() is pure
        self._event_models: dict[bytes, str | None] = {}  # fingerprint -> model announced in KV events, or None
        self._looked_up = LookedUp()

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
        if self.events is not None:
            self._event_models[scope.fingerprint] = spec.model_id if self._announced(owner) else None
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

    def pin_limit(self, owner: str) -> int:
        """Bytes `owner` may hold pinned: --max-pinned-fraction of the memory budget, or of its quota if smaller."""
        quota = self.tenancy.quota(owner)
        base = self.tier.budget if not quota else min(quota, self.tier.budget)
        return int(self.settings.max_pinned_fraction * base)

    def pin_prefix(self, scope: "Scope", keys: list[bytes]) -> int:
        """A priority hint: pin `keys` (a prefix, root first) while they are held and fit the owner's bound;
        stops at the first that is not held or does not fit, so what is pinned is always a whole prefix."""
        limit = self.pin_limit(scope.owner)
        pinned = 0
        for i, key in enumerate(keys):
            done = self.tier.pin(key, scope.fingerprint, limit)
            if done is None:
                break
            if not done:
                self.metrics.pins.labels("refused").inc(len(keys) - i)
                break
            pinned += 1
        if pinned:
            self.metrics.pins.labels("pinned").inc(pinned)
        return pinned

    def check_tokens(self, tokens) -> None:
        if len(tokens) == 0:
            raise InvalidRequest("tokens is empty")
        if len(tokens) > self.settings.max_request_tokens:
            raise InvalidRequest(f"tokens has {len(tokens)} ids, more than the limit of "
                                 f"{self.settings.max_request_tokens} (--max-request-tokens)")

    def take_large(self, tokens, what: str) -> bool:
        """Take one of --max-large-requests for a request of more than LARGE_REQUEST_TOKENS tokens (True: taken,
        give it back with give_large); refused with NoCapacity when none is free."""
        if len(tokens) <= LARGE_REQUEST_TOKENS:
            return False
        if not self.large_requests.acquire():
            raise self.large_requests.refusal(what)
        return True

    def give_large(self, taken: bool) -> None:
        if taken:
            self.large_requests.release()

    @contextlib.contextmanager
    def _large(self, tokens, what: str):
        taken = self.take_large(tokens, what)
        try:
            yield
        finally:
            self.give_large(taken)

    def _keys(self, fp: bytes, tokens, start: int = 0, limit: int = 0):
        """The keys of chunks start.. (at most `limit`; 0: all), each hashed when the consumer asks for it."""
        n = len(tokens) // self.chunk_tokens
        stop = n if limit == 0 else min(n, start + limit)
        return itertools.islice(keyspec.iter_chunk_keys(fp, tokens, self.chunk_tokens, limit=stop), start, None)

    def _cached(self, key: bytes, fp: bytes) -> bool:
        """Stored in either tier (a Put's check: not a request the eviction policy counts as a reuse)."""
        return self.tier.holds(key, fp) or (
            self.spill is not None and self.spill.contains(key, fp) is not None)

    # --- lookups ----------------------------------------------------------------------------------------
    def lookup(self, caller: Caller, model: pb.Model | None, tokens) -> pb.LookupResponse:
        scope = self.scope(model, caller)
        self.check_tokens(tokens)
        with self._large(tokens, "Lookup"):
            return self._lookup(scope, tokens)

    def _lookup(self, scope: Scope, tokens) -> pb.LookupResponse:
        fp = scope.fingerprint
        chunks = []
        if self.observer.enabled:  # hashes the whole prompt only when it is sampled
            self.observer.lookup(scope.spec, self._keys(fp, tokens), len(tokens))
        from_cluster = 0
        for i, key in enumerate(self._keys(fp, tokens)):
            entry = self.tier.peek(key, fp)
            self._looked_up.add(scope.owner, key)
            if entry is not None:
                chunks.append(pb.ChunkInfo(index=i, key=key, tier=pb.TIER_DEVICE, nbytes=entry.nbytes))
                continue
            size = self.spill.contains(key, fp) if self.spill is not None else None
            if size is None:
                # The cluster tier is asked before a miss is reported; a hit is promoted here, so the Get
                # that follows finds it in memory.
                entry = self._from_cluster(key, fp, scope.owner)
                if entry is None:
                    break
                self.tier.release_lease(entry)
                if self.events is not None and not entry.evicted:
                    self._announce(key, entry.parent, fp, i, tokens)
                chunks.append(pb.ChunkInfo(index=i, key=key, tier=pb.TIER_DEVICE, nbytes=entry.nbytes))
                from_cluster += 1
                continue
            chunks.append(pb.ChunkInfo(index=i, key=key, tier=pb.TIER_DISK, nbytes=size))
        cached = len(chunks) * self.chunk_tokens
        on_disk = sum(c.tier == pb.TIER_DISK for c in chunks) * self.chunk_tokens
        self._count_lookup("lookup", cached, len(tokens), scope.owner, on_disk, from_cluster * self.chunk_tokens)
        return pb.LookupResponse(cached_tokens=cached, chunk_tokens=self.chunk_tokens, chunks=chunks)

    def _count_lookup(self, rpc: str, cached: int, total: int, owner: str = "", on_disk: int = 0,
                      from_cluster: int = 0) -> None:
        self.tenancy.count_lookup(owner, cached, total)
        self.metrics.lookups.labels(rpc).inc()
        if cached - on_disk - from_cluster:
            self.metrics.hit_tokens.labels(rpc, "device").inc(cached - on_disk - from_cluster)
        if on_disk:
            self.metrics.hit_tokens.labels(rpc, "disk").inc(on_disk)
        if from_cluster:
            self.metrics.hit_tokens.labels(rpc, "cluster").inc(from_cluster)
        if total - cached:
            self.metrics.missed_tokens.labels(rpc).inc(total - cached)
        with self._totals_lock:
            self.hit_tokens += cached
            self.missed_tokens += total - cached

    # --- reads ------------------------------------------------------------------------------------------
    def read_chunks(self, caller: Caller, request: pb.GetRequest, target: np.ndarray | SharedFile | None = None,
                    lend: bool = False, large_slot: bool = True):
        """Yield (ChunkBegin, bytes) for each chunk of the longest cached run from request.start_chunk on,
        each verified against its checksum just before it is yielded. The bytes are the stored tensor's own
        memory, and its lease is held until the consumer asks for the next chunk: send them before that.
        With `target` the chunks are also placed there one after another (buffer_offset): a mapping (the
        bulk channel's memfd) is written first and verified where the client reads it; a client's
        file is written after the stored bytes are verified. With `lend`, a chunk kept in a sealed memfd is
        yielded as (ChunkBegin with sealed_memfd set, (its SealedChunk, the encoded bulk frame)) instead,
        verified in place and neither copied nor counted against `target`: the caller passes the descriptor
        on. Counts the lookup when the consumer stops. A request of many tokens holds one of --max-large-requests
        meanwhile, unless the caller took it already (`large_slot` False: the bulk channel, before reading it)."""
        scope = self.scope(request.model if request.HasField("model") else None, caller)
        fp, owner = scope.fingerprint, scope.owner
        self.check_tokens(request.tokens)
        large = large_slot and self.take_large(request.tokens, "Get")
        served = position = from_disk = from_cluster = 0
        keys = self._keys(fp, request.tokens, request.start_chunk, request.max_chunks)
        if request.start_chunk == 0 and request.max_chunks == 0 and self.observer.enabled:  # a whole prompt
            self.observer.lookup(scope.spec, self._keys(fp, request.tokens), len(request.tokens))
        try:
            for i, key in enumerate(keys, start=request.start_chunk):
                entry = self.tier.acquire(key, fp, requested=not self._looked_up.take(owner, key))
                tier_name = "device"
                if entry is None and self.spill is not None:
                    entry, tier_name = self.spill.promote(key, fp, owner), "disk"
                if entry is None and self.cluster is not None:
                    entry, tier_name = self._from_cluster(key, fp, owner), "cluster"
                if entry is None:
                    break
                view = None
                lent = lend and entry.memfd is not None and entry.memfd.sealed
                try:
                    if lent:
                        view = entry.array  # the sidecar's mapping of the very pages the client maps
                    elif target is not None and position + entry.nbytes > target.size:
                        break
                    elif isinstance(target, np.ndarray):
                        # Copy first, then verify the bytes exactly where the client will read them.
                        view = target[position:position + entry.nbytes]
                        if entry.data.device.type == "cpu":
                            view[:] = entry.array  # one plain memcpy (torch's copy_ measured slower here)
                        else:
                            torch.from_numpy(view).copy_(entry.data)
                    else:
                        view = entry.array if entry.data.device.type == "cpu" else entry.data.cpu().numpy()
                    # A lent chunk's memory is immutable since it was sealed (memfd.py): its checksum was
                    # verified on the way in and cannot have changed. Every other read is verified here.
                    verified = lent and entry.memfd.immutable
                    if not verified and checksum(view) != entry.checksum:
                        # Never served: drop it and end the prefix here, as if it had been evicted.
                        self.tier.drop_corrupt(entry)
                        self.metrics.checksum_failures.labels("device").inc()
                        log.error("chunk failed its checksum and was dropped",
                                  extra={"chunk_index": i, "key": key.hex()})
                        break
                    if isinstance(target, SharedFile) and not lent:
                        target.write(position, view)
                    if lent:
                        begin, frame = entry.lent_frame(i)
                        yield begin, (entry.memfd, frame)
                    else:
                        yield pb.ChunkBegin(index=i, nbytes=entry.nbytes, shape=entry.shape, dtype=entry.dtype,
                                            xxh3_64=entry.checksum,
                                            buffer_offset=position if target is not None else 0), view
                        position += entry.nbytes
                    self.metrics.sent_bytes.labels(tier_name).inc(entry.nbytes)
                    self.tenancy.touched(owner, key)
                    served += 1
                    if tier_name != "device" and self.events is not None and not entry.evicted:
                        self._announce(key, entry.parent, fp, i, request.tokens)
                    from_disk += tier_name == "disk"
                    from_cluster += tier_name == "cluster"
                finally:
                    view = None
                    self.tier.release_lease(entry)
        finally:
            self.give_large(large)
            self._count_lookup("get", served * self.chunk_tokens,
                               max(0, len(request.tokens) - request.start_chunk * self.chunk_tokens), owner,
                               from_disk * self.chunk_tokens, from_cluster * self.chunk_tokens)

    def read_into_shared(self, caller: Caller, request: pb.GetRequest) -> pb.ChunkBatch:
        """Get into the caller's shared-memory file (request.shared_buffer): the chunks' frames, in order."""
        shared = self.shared_file(caller, request.shared_buffer.name, request.shared_buffer.length)
        try:
            return pb.ChunkBatch(chunks=[begin for begin, _ in self.read_chunks(caller, request, shared)])
        except SharedBufferError as exc:  # the buffer's filesystem is full (a client truncated it): stream instead
            raise NoCapacity(str(exc)) from None
        finally:
            shared.close()

    # --- writes -----------------------------------------------------------------------------------------
    def put(self, caller: Caller, header: pb.PutHeader, watch=None) -> "PutSession":
        """A Put of the chunks of header.tokens; use it as a context manager. `watch` (the watchdog's record of
        the call, or None) is told what the session holds reserved and receives (--min-put-bytes-per-second)."""
        return PutSession(self, caller, header, watch)

    def _store(self, incoming: "_Incoming", spec: ModelSpec, fp: bytes, owner: str, tokens,
               ttl: float | None = None) -> int:
        begin = incoming.begin
        # fp8 chunks are a KV cache's raw bytes (layout.scanned): stored as they are, like packed codes
        unquantized = spec.quantization == "none" and scanned(spec.kv_dtype)
        if unquantized:  # checked once here, so no reader has to scan a lent chunk (it cannot change afterwards)
            value, finite = checksum_and_finite(incoming.buffer, spec.kv_dtype)
        else:  # opaque packed codes: the quantized format's own checks run where it is unpacked
            value, finite = checksum(incoming.buffer), False
        if begin.xxh3_64 and begin.xxh3_64 != value:
            raise DataLoss(f"chunk {begin.index}: checksum of the received bytes does not match xxh3_64")
        if unquantized and not finite:
            raise InvalidRequest(f"chunk {begin.index} has NaN or Inf values: K/V must be finite")
        data = incoming.host if self.tier.device.type == "cpu" else incoming.host.to(self.tier.device)
        reservation, incoming.reservation = incoming.reservation, None
        charged, incoming.charged = incoming.charged, 0
        try:
            stored = self.tier.commit(reservation, key=incoming.key, fingerprint=fp, parent=incoming.parent,
                                      index=begin.index, data=data, checksum_value=value, shape=tuple(begin.shape),
                                      dtype=begin.dtype, owner=owner, values_finite=finite, ttl=ttl,
                                      sliding_ttl=ttl)
        finally:
            self.tenancy.release(owner, charged)  # a stored chunk is charged by the store's insert hook
        if not stored:
            return 0
        if self.cluster is not None:
            self._publish(incoming, fp, value)
        if self.events is not None:
            self._announce(incoming.key, incoming.parent, fp, begin.index, tokens)
        return begin.nbytes

    # --- the cluster tier -------------------------------------------------------------------------------
    def _publish(self, incoming: "_Incoming", fp: bytes, value: int) -> None:
        """Queue the committed chunk for the cluster tier; the record is built on the publisher thread from the
        received host bytes (never written again: a CPU tier stores them, a CUDA tier copied them)."""
        from promptcache.sidecar.cluster import encode_record

        now = time.time()
        begin, host, expires = incoming.begin, incoming.host, now + self.settings.ttl_seconds
        self.cluster.publish(incoming.key, lambda: encode_record(
            fingerprint=fp, parent=incoming.parent, index=begin.index, dtype=begin.dtype, shape=tuple(begin.shape),
            checksum_value=value, expires=expires, born=now, payload=host.numpy().data))

    def _from_cluster(self, key: bytes, fp: bytes, owner: str = "") -> Entry | None:
        """A leased memory-tier entry for `key` fetched from the cluster tier and promoted, or None. Like a disk
        promotion: charged to `owner`'s quota (served uncached when it has no room), and the chunk keeps its age
        (its maximum lifetime counts from its first store, on whichever node)."""
        if self.cluster is None:
            return None
        record = self.cluster.fetch(key, fp)
        if record is None:
            return None
        wall = time.time()
        if record.born + self.tier.max_lifetime <= wall:
            return None
        remaining = record.expires - wall
        born = self.tier.clock() - (wall - record.born)
        payload = np.frombuffer(record.payload, dtype=np.uint8)

        def uncached(data: torch.Tensor) -> Entry:  # served from this copy for the call only
            now = self.tier.clock()
            return Entry(key, fp, record.parent, record.index, data, record.checksum, record.shape, record.dtype,
                         now, now, 0, leases=1, evicted=True)
        charged = self.tenancy.charge_if_room(owner, payload.size)
        if charged is None:
            return uncached(torch.from_numpy(payload.copy()))
        try:
            reservation = self.tier.reserve(payload.size, key, record.parent)
        except StoreError:
            self.tenancy.release(owner, charged)
            return uncached(torch.from_numpy(payload.copy()))
        host = self.tier.host_buffer(reservation)
        host.numpy()[:] = payload
        data = host if self.tier.device.type == "cpu" else host.to(self.tier.device)
        try:
            self.tier.commit(reservation, key=key, fingerprint=fp, parent=record.parent, index=record.index,
                             data=data, checksum_value=record.checksum, shape=record.shape, dtype=record.dtype,
                             ttl=max(remaining, 0.001), born=born, owner=owner)
        finally:
            self.tenancy.release(owner, charged)
        entry = self.tier.acquire(key, fp, requested=False)  # the miss before this promotion counted it
        return entry if entry is not None else uncached(host)  # evicted again at once: serve this copy

    # --- KV events --------------------------------------------------------------------------------------
    def _announced(self, owner: str) -> bool:
        """Whether KV events may announce this owner's chunks (with their token ids): the shared namespace and
        sharing groups open to every tenant; never an isolated tenant's or a restricted group's."""
        if owner == "":
            return True
        return owner.startswith("group:") and self.tenancy.groups.get(owner[len("group:"):], ()) is None

    def _pod_seen(self, caller: Caller, scope: Scope) -> None:
        """KV events: the calling inference pod gets this model's events."""
        model_id = self._event_models.get(scope.fingerprint)
        if model_id is not None and caller.pod:
            self.events.seen(caller.pod, model_id, caller)

    def _announce(self, key: bytes, parent: bytes, fp: bytes, index: int, tokens) -> None:
        model = self._event_models.get(fp)
        if model is not None:
            ct = self.chunk_tokens
            self.events.stored(key, None if index == 0 else parent, model, tokens[index * ct:(index + 1) * ct])

    # --- management -------------------------------------------------------------------------------------
    def delete(self, caller: Caller, model: pb.Model | None, tokens, start_chunk: int = 0) -> int:
        scope = self.scope(model, caller)
        self.check_tokens(tokens)
        with self._large(tokens, "Delete"):
            keys = list(self._keys(scope.fingerprint, tokens, start_chunk))
        deleted = self.tier.delete(keys, scope.fingerprint)
        if self.spill is not None:
            deleted += self.spill.delete(keys, scope.fingerprint)
        return deleted

    def purge(self, caller: Caller, model: pb.Model | None) -> tuple[int, int]:
        """(chunks, bytes) removed: every chunk of the caller's model, in every tier."""
        scope = self.scope(model, caller)
        count, nbytes = self.tier.purge(scope.fingerprint)
        if self.spill is not None:
            count += self.spill.purge(scope.fingerprint)
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
        u = self.tier.usage()
        tiers = [pb.TierStats(tier=pb.TIER_DEVICE, entries=u["entries"], bytes_used=u["used"],
                              bytes_budget=u["budget"])]
        if self.spill is not None:
            d = self.spill.usage()
            tiers.append(pb.TierStats(tier=pb.TIER_DISK, entries=d["entries"], bytes_used=d["used"],
                                      bytes_budget=d["budget"]))
        return pb.StatsResponse(tiers=tiers, hit_tokens=self.hit_tokens, missed_tokens=self.missed_tokens, **common)

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
        if not r.done:
            log.warning("shrink not applied: bytes held by calls in flight", extra={
                "previous_bytes": r.previous, "memory_bytes": r.requested, "evicted_chunks": r.evicted,
                "committed_bytes": r.committed, "reserved_bytes": r.reserved, "draining_bytes": r.draining})
            raise TimedOut(f"memory_bytes {r.requested}: {r.committed} bytes still committed after waiting "
                           f"{r.waited:.1f} s ({r.reserved} reserved by Puts in flight, {r.draining} held by "
                           f"Gets of evicted chunks); the budget stays {r.previous} bytes ({r.evicted} chunks "
                           "were evicted meanwhile). Retry the Resize")
        self.metrics.resizes.inc()
        log.info("resized memory tier", extra={"previous_bytes": r.previous, "memory_bytes": r.requested,
                                               "evicted_chunks": r.evicted, "bytes_used": r.used,
                                               "committed_bytes": r.committed, "waited_seconds": round(r.waited, 3)})
        return r

    # --- shared-memory files (--shm-dir) ----------------------------------------------------------------
    def _buffers(self) -> SharedBuffers:
        if self.buffers is None:
            raise NotServed("shared-memory transfer is disabled on this sidecar (start it with --shm-dir)")
        return self.buffers

    def open_buffer(self, caller: Caller, length: int):
        buffers = self._buffers()
        if length == 0:
            raise InvalidRequest("length must be positive")
        try:
            return buffers.open(caller.identity, length)
        except BufferLimit as exc:
            raise NoCapacity(str(exc)) from None
        except SharedBufferError as exc:
            raise NotServed(str(exc)) from None

    def close_buffer(self, caller: Caller, handle: str) -> None:
        if not self._buffers().close(caller.identity, handle):
            raise NotFound(f"shared_buffer {handle[:64]!r} is not a buffer this client opened, or it was closed "
                           "already")

    def shared_file(self, caller: Caller, handle: str, need: int | None, cap: int | None = None) -> SharedFile:
        """The caller's own shared buffer `handle` for this call (close() it after). Another identity's handle
        gets the same NOT_FOUND as one never granted: neither its bytes nor its existence are revealed."""
        try:
            return self._buffers().use(caller.identity, handle, need, cap)
        except UnknownBuffer as exc:
            raise NotFound(str(exc)) from None
        except SharedBufferError as exc:
            raise InvalidRequest(str(exc)) from None


@dataclass
class _Incoming:
    """A chunk being received by a Put."""
    begin: pb.ChunkBegin
    key: bytes
    parent: bytes
    reservation: Reservation | None  # None: not kept (cached already, or refused): the bytes are read and dropped
    buffer: np.ndarray | None
    host: torch.Tensor | None
    offset: int = 0
    charged: int = 0  # bytes charged to the owner's quota (tenancy)
    held: int = 0  # bytes counted against the client's --max-put-reserved-fraction


class PutSession:
    """One Put: begin_chunk() for each chunk frame, then its bytes (add_data(), or straight into data_target()
    and advance()), then commit() for the result. Every reservation it holds (memory, quota, the client's share)
    is released on any exit: abort(), or leaving the `with` block by an exception. With header.shared_buffer the
    bytes are read from the caller's shared-memory file at begin_chunk() (buffer_offset)."""

    def __init__(self, engine: CacheEngine, caller: Caller, header: pb.PutHeader, watch=None):
        e = self.engine = engine
        self.caller = caller
        self.watch = watch
        self.header = header
        self.scope = e.scope(header.model if header.HasField("model") else None, caller)
        e.check_tokens(header.tokens)
        ct = e.chunk_tokens
        self.n_chunks = len(header.tokens) // ct
        if self.n_chunks == 0:
            raise InvalidRequest(f"tokens has {len(header.tokens)} ids, fewer than one chunk of {ct}; "
                                 "only whole chunks are stored")
        with e._large(header.tokens, "Put"):  # the work that grows with the tokens: every key, up front
            self.keys = list(e._keys(self.scope.fingerprint, header.tokens))
        spec = self.scope.spec
        self.shape = list(chunk_shape(spec, ct))
        self.nbytes = chunk_nbytes(spec, ct)  # a layout scope() already checked
        self.dtype = NAME_TO_DTYPE[spec.kv_dtype]
        self.stored = self.skipped = self.rejected = self.stored_bytes = 0
        self.ttl = e.ttl_hint(header.ttl_seconds)
        self.priority = min(header.priority, 1)
        self.seen: set[int] = set()
        self.current: _Incoming | None = None
        self.shared = None
        self._closed = False
        if header.shared_buffer:
            self.shared = e.shared_file(caller, header.shared_buffer, None, cap=self.n_chunks * self.nbytes)

    def __enter__(self) -> "PutSession":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    # --- the frames -------------------------------------------------------------------------------------
    def begin_chunk(self, begin: pb.ChunkBegin) -> None:
        """A chunk frame: checked, and room reserved for its bytes unless it is cached already or refused (its
        bytes are then read and dropped). Raises when the previous chunk is incomplete."""
        e, fp, owner = self.engine, self.scope.fingerprint, self.scope.owner
        if self.current is not None:
            raise self._cut_short(self.current)
        self._check_begin(begin)
        self.seen.add(begin.index)
        key = self.keys[begin.index]
        parent = self.keys[begin.index - 1] if begin.index else keyspec.ROOT_PARENT
        current = _Incoming(begin, key, parent, None, None, None)
        self.current = None if self.shared is not None else current  # a shared chunk's bytes are there already
        if begin.index and not e._cached(parent, fp):
            # Its parent is in neither tier, so no Lookup could ever reach it: not worth a byte.
            self.rejected += 1
            return
        if e._cached(key, fp):
            self.skipped += 1
            return
        self._hold(current)
        self.current = current
        try:
            current.charged = e.tenancy.reserve(owner, begin.nbytes, fp)
        except TenancyError as exc:
            raise NoCapacity(f"chunk {begin.index}: {exc.message}") from None
        try:
            current.reservation = e.tier.reserve(begin.nbytes, key, parent)
        except AdmissionRejected:
            e.tenancy.release(owner, current.charged)
            current.charged = 0
            self.rejected += 1
            e.metrics.admission_rejections.labels("device").inc()
            self._unhold(current)
            self.current = None if self.shared is not None else current
            return
        except (ChunkTooLarge, NoRoom) as exc:
            raise NoCapacity(f"chunk {begin.index}: {exc}") from None
        if self.watch is not None:
            self.watch.hold(current.reservation.accounted)
        # Received into host memory first, checksummed, then moved to the device in one copy.
        current.host = e.tier.host_buffer(current.reservation)
        current.buffer = current.host.numpy()
        if self.shared is not None:
            end = begin.buffer_offset + begin.nbytes
            if end > self.shared.size:
                raise InvalidRequest(f"chunk {begin.index}: buffer_offset {begin.buffer_offset} + nbytes "
                                     f"{begin.nbytes} runs past the shared buffer's {self.shared.size} bytes")
            try:
                self.shared.read_into(begin.buffer_offset, current.buffer)
            except SharedBufferError as exc:
                raise InvalidRequest(f"chunk {begin.index}: {exc}") from None
            e.metrics.received_bytes.inc(begin.nbytes)
            self._complete(current)

    def data_target(self) -> memoryview | None:
        """Where the current chunk's next bytes go (the rest of its reserved memory), or None when they are to
        be dropped; receive at most `unread` bytes into it, then advance()."""
        c = self._expect_data()
        return None if c.buffer is None else memoryview(c.buffer)[c.offset:]

    @property
    def unread(self) -> int:
        """Bytes of the current chunk still to come (0: no chunk is being received)."""
        c = self.current
        return 0 if c is None else c.begin.nbytes - c.offset

    def add_data(self, data) -> None:
        """A data frame: the next bytes of the current chunk (copied into its reserved memory)."""
        c = self._expect_data()
        n = len(data)
        if c.offset + n > c.begin.nbytes:
            raise InvalidRequest(f"chunk {c.begin.index}: data frames carry more than the {c.begin.nbytes} bytes "
                                 "its chunk frame announced")
        if c.buffer is not None:
            c.buffer[c.offset:c.offset + n] = np.frombuffer(data, dtype=np.uint8)
        self.advance(n)

    def advance(self, n: int) -> None:
        """`n` more bytes of the current chunk have arrived (written through data_target(), or add_data())."""
        c = self.current
        c.offset += n
        if self.watch is not None:
            self.watch.progress(n)
        self.engine.metrics.received_bytes.inc(n)
        if c.offset == c.begin.nbytes:
            self._complete(c)

    def commit(self) -> pb.PutResponse:
        """The end of the Put: every chunk announced must be complete. Returns what was stored."""
        if self.current is not None:
            raise self._cut_short(self.current)
        if self.priority and self.seen:
            self.engine.pin_prefix(self.scope, self.keys[:max(self.seen) + 1])
        self.abort()
        self.engine.metrics.stored_chunks.inc(self.stored)
        return pb.PutResponse(stored_chunks=self.stored, skipped_chunks=self.skipped,
                              stored_bytes=self.stored_bytes, rejected_chunks=self.rejected)

    def abort(self) -> None:
        """Release whatever the session still holds (idempotent); the chunks stored so far stay stored."""
        if self._closed:
            return
        self._closed = True
        e, current = self.engine, self.current
        self.current = None
        if self.seen:  # what the client filled, whether or not this cache kept it: the curve simulates the rest
            e.observer.stored(self.scope.spec, self.keys[:max(self.seen) + 1])
        if current is not None and current.reservation is not None:
            e.tier.release(current.reservation)
        if current is not None and current.charged:
            e.tenancy.release(self.scope.owner, current.charged)
        if current is not None:
            self._unhold(current)
        if self.shared is not None:
            self.shared.close()

    # --- inside -----------------------------------------------------------------------------------------
    def _expect_data(self) -> _Incoming:
        if self.shared is not None:
            raise InvalidRequest("data frames are not allowed when the header names a shared buffer")
        if self.current is None:
            raise InvalidRequest("a data frame arrived before any chunk frame")
        return self.current

    def _complete(self, current: _Incoming) -> None:
        if current.reservation is not None:
            self.stored_bytes += self.engine._store(current, self.scope.spec, self.scope.fingerprint,
                                                    self.scope.owner, self.header.tokens, self.ttl)
            self.stored += 1
        self._unhold(current)
        self.current = None

    def _check_begin(self, begin: pb.ChunkBegin) -> None:
        i, ct = begin.index, self.engine.chunk_tokens
        if i >= self.n_chunks:
            raise InvalidRequest(f"chunk index {i} needs tokens up to {(i + 1) * ct}, "
                                 f"but the header carries {self.n_chunks * ct} whole-chunk tokens")
        if i in self.seen:
            raise InvalidRequest(f"chunk index {i} was sent twice")
        if begin.dtype != self.dtype:
            got = pb.DType.Name(begin.dtype) if begin.dtype in pb.DType.values() else str(begin.dtype)
            raise InvalidRequest(f"chunk {i}: dtype {got} does not match the model's kv_dtype "
                                 f"{pb.DType.Name(self.dtype)}")
        if list(begin.shape) != self.shape:
            if len(begin.shape) == 5 and begin.shape[3] != ct:
                raise InvalidRequest(f"chunk {i}: shape[3] (tokens per chunk) is {begin.shape[3]}, but this "
                                     f"server's chunk size is {ct}")
            raise InvalidRequest(f"chunk {i}: shape {list(begin.shape)} does not match the model's layout "
                                 f"{self.shape} [layers, {self.scope.spec.kv_parts}, kv_heads, chunk_tokens, head_dim]")
        limit = self.engine.settings.max_chunk_bytes
        if begin.nbytes > limit:
            raise NoCapacity(f"chunk {i}: {begin.nbytes} bytes exceed the limit of {limit} bytes (--max-chunk-bytes)")
        if begin.nbytes != self.nbytes:
            raise InvalidRequest(f"chunk {i}: nbytes is {begin.nbytes}, but this model's layout and quantization "
                                 f"need exactly {self.nbytes}")
        if begin.sealed_memfd:
            raise InvalidRequest(f"chunk {i}: sealed_memfd is set only by the sidecar, on chunks it lends on the "
                                 "bulk channel; a Put sends the bytes")

    def _hold(self, current: _Incoming) -> None:
        """Count the chunk against its client's share of the budget (--max-put-reserved-fraction)."""
        e, client = self.engine, self.caller.client
        fraction = e.settings.max_put_reserved_fraction
        limit = int(fraction * e.tier.budget)
        nbytes = current.begin.nbytes
        if not e.reserved_by_client.hold(client, nbytes, limit):
            raise NoCapacity(f"chunk {current.begin.index}: this client's Puts in flight already hold "
                             f"{e.reserved_by_client.held(client)} bytes reserved, and {nbytes} more would pass "
                             f"its limit of {limit} bytes (--max-put-reserved-fraction {fraction:g} of the "
                             "budget); retry later")
        current.held = nbytes

    def _unhold(self, current: _Incoming) -> None:
        if current.held:
            self.engine.reserved_by_client.release(self.caller.client, current.held)
            current.held = 0
        if self.watch is not None:
            self.watch.hold(0)

    @staticmethod
    def _cut_short(current: _Incoming) -> InvalidRequest:
        return InvalidRequest(f"chunk {current.begin.index} ended after {current.offset} of its "
                              f"{current.begin.nbytes} bytes; nothing of it was stored")

