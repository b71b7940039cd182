"""The gRPC service: a thin layer that validates requests, maps them onto the store and reports metrics.

Every malformed request is answered with a gRPC status whose message names what was wrong; nothing partial is
ever stored (a chunk enters the store only when its last byte has arrived and verified) or served (every chunk
is checksummed before its first byte leaves).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import logging
import os
import signal
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from promptcache import keys as keyspec
from promptcache import frames
from promptcache.layout import chunk_nbytes, chunk_shape
from promptcache.shm import SharedBufferError, SharedFile
from promptcache.sidecar import cgroup, logs, memfd
from promptcache.sidecar.auth import Authenticator, TokenStore, identity_of, server_credentials
from promptcache.sidecar.bulk import BulkServer
from promptcache.sidecar.config import Settings, settings_from_args
from promptcache.sidecar.disk import DiskTierError
from promptcache.sidecar.limits import (LARGE_REQUEST_TOKENS, CallLimiter, CallRejected, Guard, LargeRequests,
                                        ReservedBytes, Watchdog, client_key, watch_of)
from promptcache.sidecar.memfd import ChunkMemory
from promptcache.sidecar.metrics import Metrics
from promptcache.sidecar.observer import TrafficObserver
from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.shmbuffers import BufferLimit, SharedBuffers, UnknownBuffer
from promptcache.sidecar.store import (AdmissionRejected, ChunkTooLarge, Entry, MemoryTier, NoRoom, Reservation,
                                       StoreError, checksum)
from promptcache.sidecar.tenancy import Tenancy, TenancyError
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.wire import NAME_TO_DTYPE, model_from_proto

log = logging.getLogger("promptcache.sidecar")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
# The longest a shrinking Resize waits for Puts and Gets in flight to let go of their bytes (less when the
# caller's deadline is nearer). A stalled stream is cancelled after --stream-idle-seconds (30 s) anyway.
RESIZE_WAIT_SECONDS = 30.0


class RpcFailure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)


def _observed(rpc: str, streaming_response: bool = False):
    """Record latency and status code of a method; turn RpcFailure and crashes into proper statuses."""

    def wrap(fn):
        def fail(self, context, exc):
            if isinstance(exc, (RpcFailure, CallRejected)):
                code, message = exc.code, exc.message
            else:
                log.exception("unexpected error in %s", rpc)
                code, message = grpc.StatusCode.INTERNAL, f"internal error in {rpc}: {type(exc).__name__}"
            self.metrics.requests.labels(rpc, code.name).inc()
            context.abort(code, message)

        if streaming_response:
            @functools.wraps(fn)
            def stream(self, request, context):
                start = time.perf_counter()
                try:
                    yield from fn(self, request, context)
                except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                    fail(self, context, exc)
                else:
                    self.metrics.requests.labels(rpc, "OK").inc()
                finally:
                    self.metrics.latency.labels(rpc).observe(time.perf_counter() - start)
            return stream

        @functools.wraps(fn)
        def unary(self, request, context):
            start = time.perf_counter()
            try:
                result = fn(self, request, context)
            except Exception as exc:  # noqa: BLE001
                fail(self, context, exc)
            else:
                self.metrics.requests.labels(rpc, "OK").inc()
                return result
            finally:
                self.metrics.latency.labels(rpc).observe(time.perf_counter() - start)
        return unary

    return wrap


@dataclass
class _Incoming:
    """A chunk being received by Put."""
    begin: pb.ChunkBegin
    key: bytes
    parent: bytes
    reservation: Reservation | None  # None: already cached, the bytes are read and dropped
    buffer: np.ndarray | None
    host: torch.Tensor | None
    offset: int = 0
    charged: int = 0  # bytes charged to the owner's quota (tenancy)
    held: int = 0  # bytes counted against the client's --max-put-reserved-fraction


class KVCacheService(pb_grpc.KVCacheServicer):
    def __init__(self, settings: Settings, tier: MemoryTier, metrics: Metrics, tenancy: Tenancy | None = None,
                 observer: TrafficObserver | None = None):
        self.settings = settings
        self.observer = observer or TrafficObserver(settings.chunk_tokens)  # a disabled one ignores everything
        self.tier = tier
        self.tenancy = tenancy or Tenancy(enabled=False)
        if self.tenancy.tier is None:
            self.tenancy.bind(tier)
        self.metrics = metrics
        self.chunk_tokens = settings.chunk_tokens
        self.memory_limit: int | None = None  # the container's cgroup limit; budgets must fit under it
        self.read_memory_limit = cgroup.memory_limit
        self.spill = None  # promptcache.sidecar.spill.Spill when the disk tier is on
        self.cluster = None  # promptcache.sidecar.cluster.ClusterTier with --cluster-master
        self.events = None  # promptcache.sidecar.kvevents.KVEvents with --kv-events-address
        self._event_models: dict[bytes, str | None] = {}  # fingerprint -> model announced in KV events, or None
        self._totals_lock = threading.Lock()
        self._models: dict = {}  # (Model bytes, identity) -> (spec, fingerprint, owner); namespace() is pure
        # The shared-memory buffers this sidecar created for its callers (the only ones Put/GetShared use).
        self.buffers = (SharedBuffers(settings.shm_dir, settings.shm_max_buffers, settings.shm_max_bytes,
                                      settings.shm_idle_seconds) if settings.shm_dir else None)
        self.hit_tokens = 0
        self.missed_tokens = 0
        self.reserved_by_client = ReservedBytes()
        self.large_requests = LargeRequests(settings.max_large_requests)

    # --- validation helpers -----------------------------------------------------------------------------
    def _model(self, msg: pb.Model, present: bool, context):
        """(spec, fingerprint, owner). With tenancy on, the salt is derived from the caller's identity."""
        if not present:
            raise invalid("model is missing")
        identity = identity_of(context)
        cache_key = (msg.SerializeToString(deterministic=True), identity)
        known = self._models.get(cache_key)
        if known is not None:  # pods send the same few models on every call: skip validation and hashing
            if self.events is not None:
                self._pod_seen(context, known)
            return known
        try:
            spec = model_from_proto(msg)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        try:
            chunk_nbytes(spec, self.chunk_tokens)  # a layout no chunk can have (k8v4 with an odd head_dim)
        except ValueError as exc:
            raise invalid(f"model: {exc}") from None
        served = self.settings.quantization
        if served != "any" and spec.quantization != served:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model.quantization {spec.quantization!r} is not served here: this sidecar keeps "
                             f"{served} chunks only (--quantization)")
        try:
            salt, owner = self.tenancy.namespace(identity, spec.tenant_salt)
        except TenancyError as exc:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED, exc.message) from None
        if self.tenancy.isolate:
            spec = dataclasses.replace(spec, tenant_salt=salt)
        result = spec, keyspec.fingerprint(spec), owner
        if self.events is not None:
            self._event_models[result[1]] = spec.model_id if self._announced(owner) else None
            self._pod_seen(context, result)
        if len(self._models) >= 1024:  # bounded: a client cycling through models cannot grow it
            self._models.clear()
        self._models[cache_key] = result
        return result

    def _announced(self, owner: str) -> bool:
        """Whether KV events may announce this owner's chunks (with their token ids): the shared namespace and
        sharing groups open to every tenant; never an isolated tenant's or a restricted group's."""
        if owner == "":
            return True
        return owner.startswith("group:") and self.tenancy.groups.get(owner[len("group:"):], ()) is None

    def _pod_seen(self, context, model) -> None:
        """KV events: the calling inference pod (gRPC metadata x-promptcache-pod) gets this model's events."""
        from promptcache.sidecar.kvevents import POD_METADATA

        model_id = self._event_models.get(model[1])
        if model_id is None:
            return
        metadata = getattr(context, "invocation_metadata", None)  # the bulk channel's context has none
        for name, value in (metadata() if metadata is not None else None) or ():
            if name == POD_METADATA and value and len(value) <= 253:
                self.events.seen(value, model_id)
                return

    def _announce(self, key: bytes, parent: bytes, fp: bytes, index: int, tokens) -> None:
        model = self._event_models.get(fp)
        if model is not None:
            ct = self.chunk_tokens
            self.events.stored(key, None if index == 0 else parent, model, tokens[index * ct:(index + 1) * ct])

    def _tokens(self, tokens) -> None:
        if len(tokens) == 0:
            raise invalid("tokens is empty")
        if len(tokens) > self.settings.max_request_tokens:
            raise invalid(f"tokens has {len(tokens)} ids, more than the limit of {self.settings.max_request_tokens} "
                          "(--max-request-tokens)")

    def _take_large(self, tokens, rpc: str) -> bool:
        """Take one of --max-large-requests for a request of more than LARGE_REQUEST_TOKENS tokens (True: taken,
        give it back with _give_large); refused with RESOURCE_EXHAUSTED when none is free."""
        if len(tokens) <= LARGE_REQUEST_TOKENS:
            return False
        if not self.large_requests.acquire():
            raise self.large_requests.refusal(rpc)
        return True

    def _give_large(self, taken: bool) -> None:
        if taken:
            self.large_requests.release()

    @contextlib.contextmanager
    def _large(self, tokens, rpc: str):
        taken = self._take_large(tokens, rpc)
        try:
            yield
        finally:
            self._give_large(taken)

    def _keys(self, fp: bytes, tokens, start: int = 0, limit: int = 0):
        """The keys of chunks start.. (at most `limit`; 0: all), each hashed when the consumer asks for it."""
        n = len(tokens) // self.chunk_tokens
        stop = n if limit == 0 else min(n, start + limit)
        return itertools.islice(keyspec.iter_chunk_keys(fp, tokens, self.chunk_tokens, limit=stop), start, None)

    def _buffers(self) -> SharedBuffers:
        if self.buffers is None:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                             "shared-memory transfer is disabled on this sidecar (start it with --shm-dir)")
        return self.buffers

    def _shared(self, handle: str, need: int | None, context, cap: int | None = None) -> SharedFile:
        """The caller's own shared buffer `handle` for this call (close() it after). Another identity's handle
        gets the same NOT_FOUND as one never granted: neither its bytes nor its existence are revealed."""
        try:
            return self._buffers().use(identity_of(context), handle, need, cap)
        except UnknownBuffer as exc:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except SharedBufferError as exc:
            raise invalid(str(exc)) from None

    def _cached(self, key: bytes, fp: bytes) -> bool:
        return self.tier.peek(key, fp) is not None or (
            self.spill is not None and self.spill.contains(key, fp) is not None)

    # --- RPCs -------------------------------------------------------------------------------------------
    @_observed("Lookup")
    def Lookup(self, request, context):
        spec, fp, owner = self._model(request.model, request.HasField("model"), context)
        self._tokens(request.tokens)
        with self._large(request.tokens, "Lookup"):
            return self._lookup(request, spec, fp, owner)

    def _lookup(self, request, spec, fp: bytes, owner: str) -> pb.LookupResponse:
        chunks = []
        if self.observer.enabled:  # hashes the whole prompt only when it is sampled
            self.observer.lookup(spec, self._keys(fp, request.tokens), len(request.tokens))
        from_cluster = 0
        for i, key in enumerate(self._keys(fp, request.tokens)):
            entry = self.tier.peek(key, fp)
            if entry is not None:
                chunks.append(pb.ChunkInfo(index=i, key=key, tier=pb.TIER_DEVICE, nbytes=entry.nbytes))
                continue
            size = self.spill.contains(key, fp) if self.spill is not None else None
            if size is None:
                # The cluster tier is asked before a miss is reported; a hit is promoted here, so the Get
                # that follows finds it in memory.
                entry = self._from_cluster(key, fp, owner)
                if entry is None:
                    break
                self.tier.release_lease(entry)
                if self.events is not None and not entry.evicted:
                    self._announce(key, entry.parent, fp, i, request.tokens)
                chunks.append(pb.ChunkInfo(index=i, key=key, tier=pb.TIER_DEVICE, nbytes=entry.nbytes))
                from_cluster += 1
                continue
            chunks.append(pb.ChunkInfo(index=i, key=key, tier=pb.TIER_DISK, nbytes=size))
        cached = len(chunks) * self.chunk_tokens
        on_disk = sum(c.tier == pb.TIER_DISK for c in chunks) * self.chunk_tokens
        self._count_lookup("lookup", cached, len(request.tokens), owner, on_disk, from_cluster * self.chunk_tokens)
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

    @_observed("Get", streaming_response=True)
    def Get(self, request, context):
        if request.HasField("shared_buffer"):  # the streamed form of GetShared: one batch frame at the end
            batch = self._get_shared(request, context)
            if batch.chunks:
                yield pb.GetResponse(batch=batch)
            return
        frame = self.settings.frame_bytes
        for begin, view in self.verified_chunks(request, context):
            yield pb.GetResponse(chunk=begin)
            for off in range(0, begin.nbytes, frame):
                yield frames.encode_data_frame(view[off:off + frame])

    @_observed("GetShared")
    def GetShared(self, request, context):
        if not request.HasField("shared_buffer"):
            raise invalid("GetShared needs shared_buffer (use Get to stream the bytes)")
        return self._get_shared(request, context)

    def _get_shared(self, request, context) -> pb.ChunkBatch:
        shared = self._shared(request.shared_buffer.name, request.shared_buffer.length, context)
        try:
            return pb.ChunkBatch(chunks=[begin for begin, _ in self.verified_chunks(request, context, shared)])
        finally:
            shared.close()

    def verified_chunks(self, request, context, shared: np.ndarray | SharedFile | None = None,
                        lend: bool = False, large_slot: bool = True):
        """Yield (ChunkBegin, bytes) for each chunk of the longest cached run from request.start_chunk on,
        each verified against its checksum just before it is yielded. The bytes are the stored tensor's own
        memory, and its lease is held until the consumer asks for the next chunk: send them before that.
        With `shared` the chunks are also placed there one after another (buffer_offset): a mapping (the
        bulk channel's memfd) is written first and verified where the client reads it; a client's
        file is written after the stored bytes are verified. With `lend`, a chunk kept in a sealed memfd is
        yielded as (ChunkBegin with sealed_memfd set, (its SealedChunk, the encoded bulk frame)) instead,
        verified in place and neither copied nor counted against `shared`: the caller passes the descriptor
        on. Counts the lookup when the consumer stops. A request of many tokens holds one of --max-large-requests
        meanwhile, unless the caller took it already (`large_slot` False: the bulk channel, before reading it)."""
        spec, fp, owner = self._model(request.model, request.HasField("model"), context)
        self._tokens(request.tokens)
        large = large_slot and self._take_large(request.tokens, "Get")
        served = position = from_disk = from_cluster = 0
        keys = self._keys(fp, request.tokens, request.start_chunk, request.max_chunks)
        if request.start_chunk == 0 and request.max_chunks == 0 and self.observer.enabled:  # a whole prompt
            self.observer.lookup(spec, self._keys(fp, request.tokens), len(request.tokens))
        try:
            for i, key in enumerate(keys, start=request.start_chunk):
                entry = self.tier.acquire(key, fp)
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
                    elif shared is not None and position + entry.nbytes > shared.size:
                        break
                    elif isinstance(shared, np.ndarray):
                        # Copy first, then verify the bytes exactly where the client will read them.
                        view = shared[position:position + entry.nbytes]
                        if entry.data.device.type == "cpu":
                            view[:] = entry.array  # one plain memcpy (torch's copy_ measured slower here)
                        else:
                            torch.from_numpy(view).copy_(entry.data)
                    else:
                        view = entry.array if entry.data.device.type == "cpu" else entry.data.cpu().numpy()
                    if checksum(view) != entry.checksum:
                        # Never served: drop it and end the prefix here, as if it had been evicted.
                        self.tier.drop_corrupt(entry)
                        self.metrics.checksum_failures.labels("device").inc()
                        log.error("chunk failed its checksum and was dropped",
                                  extra={"chunk_index": i, "key": key.hex()})
                        break
                    if isinstance(shared, SharedFile) and not lent:
                        shared.write(position, view)
                    if lent:
                        begin, frame = entry.lent_frame(i)
                        yield begin, (entry.memfd, frame)
                    else:
                        yield pb.ChunkBegin(index=i, nbytes=entry.nbytes, shape=entry.shape, dtype=entry.dtype,
                                            xxh3_64=entry.checksum,
                                            buffer_offset=position if shared is not None else 0), view
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
            self._give_large(large)
            self._count_lookup("get", served * self.chunk_tokens,
                               max(0, len(request.tokens) - request.start_chunk * self.chunk_tokens), owner,
                               from_disk * self.chunk_tokens, from_cluster * self.chunk_tokens)

    @_observed("Put")
    def Put(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("frame") != "header":
            raise invalid("a Put stream must start with a header frame")
        header = first.header
        spec, fp, owner = self._model(header.model, header.HasField("model"), context)
        self._tokens(header.tokens)
        n_chunks = len(header.tokens) // self.chunk_tokens
        if n_chunks == 0:
            raise invalid(f"tokens has {len(header.tokens)} ids, fewer than one chunk of {self.chunk_tokens}; "
                          "only whole chunks are stored")
        with self._large(header.tokens, "Put"):  # the work that grows with the tokens: every key, up front
            keys = list(self._keys(fp, header.tokens))
        watch = watch_of(context)  # told what this Put holds reserved and receives (--min-put-bytes-per-second)
        client = client_key(identity_of(context), context.peer())
        expected_shape = list(chunk_shape(spec, self.chunk_tokens))
        expected_nbytes = chunk_nbytes(spec, self.chunk_tokens)  # a layout _model() already checked
        expected_dtype = NAME_TO_DTYPE[spec.kv_dtype]
        stored = skipped = rejected = stored_bytes = 0
        seen: set[int] = set()
        current: _Incoming | None = None
        shared = None
        if header.shared_buffer:
            shared = self._shared(header.shared_buffer, None, context, cap=n_chunks * expected_nbytes)
        try:
            for msg in request_iterator:
                kind = msg.WhichOneof("frame")
                if kind == "chunk":
                    if current is not None:
                        raise self._cut_short(current)
                    begin = msg.chunk
                    self._check_begin(begin, n_chunks, seen, expected_shape, expected_nbytes, expected_dtype)
                    seen.add(begin.index)
                    key = keys[begin.index]
                    parent = keys[begin.index - 1] if begin.index else keyspec.ROOT_PARENT
                    current = _Incoming(begin, key, parent, None, None, None)
                    if begin.index and not self._cached(parent, fp):
                        # Its parent is in neither tier, so no Lookup could ever reach it: not worth a byte.
                        rejected += 1
                        current = None if shared is not None else current
                        continue
                    if self._cached(key, fp):
                        skipped += 1
                        current = None if shared is not None else current
                        continue
                    self._hold(current, client)
                    try:
                        current.charged = self.tenancy.reserve(owner, begin.nbytes, fp)
                    except TenancyError as exc:
                        raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"chunk {begin.index}: {exc.message}") from None
                    try:
                        current.reservation = self.tier.reserve(begin.nbytes, key, parent)
                    except AdmissionRejected:
                        self.tenancy.release(owner, current.charged)
                        current.charged = 0
                        rejected += 1
                        self.metrics.admission_rejections.labels("device").inc()
                        self._unhold(current, client, watch)
                        current = None if shared is not None else current
                        continue
                    except (ChunkTooLarge, NoRoom) as exc:
                        self.tenancy.release(owner, current.charged)
                        current.charged = 0
                        raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"chunk {begin.index}: {exc}") from None
                    if watch is not None:
                        watch.hold(current.reservation.accounted)
                    # Received into host memory first, checksummed, then moved to the device in one copy.
                    current.host = self.tier.host_buffer(current.reservation)
                    current.buffer = current.host.numpy()
                    if shared is not None:
                        end = begin.buffer_offset + begin.nbytes
                        if end > shared.size:
                            raise invalid(f"chunk {begin.index}: buffer_offset {begin.buffer_offset} + nbytes "
                                          f"{begin.nbytes} runs past the shared buffer's {shared.size} bytes")
                        try:
                            shared.read_into(begin.buffer_offset, current.buffer)
                        except SharedBufferError as exc:
                            raise invalid(f"chunk {begin.index}: {exc}") from None
                        self.metrics.received_bytes.inc(begin.nbytes)
                        stored_bytes += self._store(current, fp, owner, header.tokens)
                        stored += 1
                        self._unhold(current, client, watch)
                        current = None
                elif kind == "data":
                    if shared is not None:
                        raise invalid("data frames are not allowed when the header names a shared buffer")
                    if current is None:
                        raise invalid("a data frame arrived before any chunk frame")
                    n = len(msg.data)
                    if current.offset + n > current.begin.nbytes:
                        raise invalid(f"chunk {current.begin.index}: data frames carry more than the "
                                      f"{current.begin.nbytes} bytes its chunk frame announced")
                    if current.buffer is not None:
                        current.buffer[current.offset:current.offset + n] = np.frombuffer(msg.data, dtype=np.uint8)
                    current.offset += n
                    if watch is not None:
                        watch.progress(n)
                    self.metrics.received_bytes.inc(n)
                    if current.offset == current.begin.nbytes:
                        if current.reservation is not None:
                            stored_bytes += self._store(current, fp, owner, header.tokens)
                            stored += 1
                        self._unhold(current, client, watch)
                        current = None
                elif kind == "header":
                    raise invalid("a Put stream carries exactly one header frame")
                else:
                    raise invalid("empty PutRequest frame")
            if current is not None:
                raise self._cut_short(current)
        finally:
            if seen:  # what the client filled, whether or not this cache kept it: the curve simulates the rest
                self.observer.stored(spec, keys[:max(seen) + 1])
            if current is not None and current.reservation is not None:
                self.tier.release(current.reservation)
            if current is not None and current.charged:
                self.tenancy.release(owner, current.charged)
            if current is not None:
                self._unhold(current, client, watch)
            if shared is not None:
                shared.close()
        self.metrics.stored_chunks.inc(stored)
        return pb.PutResponse(stored_chunks=stored, skipped_chunks=skipped, stored_bytes=stored_bytes,
                              rejected_chunks=rejected)

    def _check_begin(self, begin, n_chunks, seen, shape, nbytes, dtype) -> None:
        i = begin.index
        if i >= n_chunks:
            raise invalid(f"chunk index {i} needs tokens up to {(i + 1) * self.chunk_tokens}, "
                          f"but the header carries {n_chunks * self.chunk_tokens} whole-chunk tokens")
        if i in seen:
            raise invalid(f"chunk index {i} was sent twice")
        if begin.dtype != dtype:
            got = pb.DType.Name(begin.dtype) if begin.dtype in pb.DType.values() else str(begin.dtype)
            raise invalid(f"chunk {i}: dtype {got} does not match the model's kv_dtype {pb.DType.Name(dtype)}")
        if list(begin.shape) != shape:
            if len(begin.shape) == 5 and begin.shape[3] != self.chunk_tokens:
                raise invalid(f"chunk {i}: shape[3] (tokens per chunk) is {begin.shape[3]}, but this server's "
                              f"chunk size is {self.chunk_tokens}")
            raise invalid(f"chunk {i}: shape {list(begin.shape)} does not match the model's layout {shape} "
                          "[layers, 2, kv_heads, chunk_tokens, head_dim]")
        if begin.nbytes > self.settings.max_chunk_bytes:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"chunk {i}: {begin.nbytes} bytes exceed the limit of "
                             f"{self.settings.max_chunk_bytes} bytes (--max-chunk-bytes)")
        if begin.nbytes != nbytes:
            raise invalid(f"chunk {i}: nbytes is {begin.nbytes}, but this model's layout and quantization "
                          f"need exactly {nbytes}")
        if begin.sealed_memfd:
            raise invalid(f"chunk {i}: sealed_memfd is set only by the sidecar, on chunks it lends on the bulk "
                          "channel; a Put sends the bytes")

    def _hold(self, current: _Incoming, client: str) -> None:
        """Count the chunk against its client's share of the budget (--max-put-reserved-fraction)."""
        limit = int(self.settings.max_put_reserved_fraction * self.tier.budget)
        nbytes = current.begin.nbytes
        if not self.reserved_by_client.hold(client, nbytes, limit):
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"chunk {current.begin.index}: this client's Puts in flight already hold "
                             f"{self.reserved_by_client.held(client)} bytes reserved, and {nbytes} more would pass "
                             f"its limit of {limit} bytes (--max-put-reserved-fraction "
                             f"{self.settings.max_put_reserved_fraction:g} of the budget); retry later")
        current.held = nbytes

    def _unhold(self, current: _Incoming, client: str, watch) -> None:
        if current.held:
            self.reserved_by_client.release(client, current.held)
            current.held = 0
        if watch is not None:
            watch.hold(0)

    @staticmethod
    def _cut_short(current: _Incoming) -> RpcFailure:
        return invalid(f"chunk {current.begin.index} ended after {current.offset} of its "
                       f"{current.begin.nbytes} bytes; nothing of it was stored")

    def _publish(self, incoming: _Incoming, fp: bytes, value: int) -> None:
        """Queue the committed chunk for the cluster tier; the record is built on the publisher thread from the
        received host bytes (never written again: a CPU tier stores them, a CUDA tier copied them)."""
        from promptcache.sidecar.cluster import encode_record

        now = time.time()
        begin, host, expires = incoming.begin, incoming.host, now + self.settings.ttl_seconds
        self.cluster.publish(incoming.key, lambda: encode_record(
            fingerprint=fp, parent=incoming.parent, index=begin.index, dtype=begin.dtype, shape=tuple(begin.shape),
            checksum_value=value, expires=expires, born=now, payload=host.numpy().data))

    def _from_cluster(self, key: bytes, fp: bytes, owner: str = ""):
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

        def uncached() -> Entry:  # served from this copy for the call only
            now = self.tier.clock()
            return Entry(key, fp, record.parent, record.index, torch.from_numpy(payload.copy()), record.checksum,
                         record.shape, record.dtype, now, now, 0, leases=1, evicted=True)
        charged = self.tenancy.charge_if_room(owner, payload.size)
        if charged is None:
            return uncached()
        try:
            reservation = self.tier.reserve(payload.size, key, record.parent)
        except StoreError:
            self.tenancy.release(owner, charged)
            return uncached()
        host = self.tier.host_buffer(reservation)
        host.numpy()[:] = payload
        data = host if self.tier.device.type == "cpu" else host.to(self.tier.device)
        stored = self.tier.commit(reservation, key=key, fingerprint=fp, parent=record.parent, index=record.index,
                                  data=data, checksum_value=record.checksum, shape=record.shape, dtype=record.dtype,
                                  ttl=max(remaining, 0.001), born=born)
        if stored:
            self.tenancy.committed(owner, key, charged)
        else:
            self.tenancy.release(owner, charged)
        entry = self.tier.acquire(key, fp)
        if entry is None:  # evicted again at once by a concurrent writer: serve this copy
            now = self.tier.clock()
            return Entry(key, fp, record.parent, record.index, host, record.checksum, record.shape, record.dtype,
                         now, now, 0, leases=1, evicted=True)
        return entry

    def _store(self, incoming: _Incoming, fp: bytes, owner: str = "", tokens=()) -> int:
        begin = incoming.begin
        value = checksum(incoming.buffer)
        if begin.xxh3_64 and begin.xxh3_64 != value:
            raise RpcFailure(grpc.StatusCode.DATA_LOSS,
                             f"chunk {begin.index}: checksum of the received bytes does not match xxh3_64")
        data = incoming.host if self.tier.device.type == "cpu" else incoming.host.to(self.tier.device)
        reservation, incoming.reservation = incoming.reservation, None
        charged, incoming.charged = incoming.charged, 0
        if self.tier.commit(reservation, key=incoming.key, fingerprint=fp, parent=incoming.parent,
                            index=begin.index, data=data, checksum_value=value, shape=tuple(begin.shape),
                            dtype=begin.dtype):
            self.tenancy.committed(owner, incoming.key, charged)
            if self.cluster is not None:
                self._publish(incoming, fp, value)
            if self.events is not None:
                self._announce(incoming.key, incoming.parent, fp, begin.index, tokens)
            return begin.nbytes
        self.tenancy.release(owner, charged)
        return 0

    @_observed("OpenSharedBuffer")
    def OpenSharedBuffer(self, request, context):
        buffers = self._buffers()
        if request.length == 0:
            raise invalid("length must be positive")
        try:
            grant = buffers.open(identity_of(context), request.length)
        except BufferLimit as exc:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except SharedBufferError as exc:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return pb.OpenSharedBufferResponse(handle=grant.handle, file_name=grant.file_name, length=grant.length,
                                           inode=grant.inode)

    @_observed("CloseSharedBuffer")
    def CloseSharedBuffer(self, request, context):
        if not self._buffers().close(identity_of(context), request.handle):
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"shared_buffer {request.handle[:64]!r} is not a buffer "
                             "this client opened, or it was closed already")
        return pb.CloseSharedBufferResponse()

    @_observed("Delete")
    def Delete(self, request, context):
        spec, fp, owner = self._model(request.model, request.HasField("model"), context)
        self._tokens(request.tokens)
        with self._large(request.tokens, "Delete"):
            keys = list(self._keys(fp, request.tokens, request.start_chunk))
        deleted = self.tier.delete(keys, fp)
        if self.spill is not None:
            deleted += self.spill.delete(keys, fp)
        return pb.DeleteResponse(deleted_chunks=deleted)

    @_observed("Purge")
    def Purge(self, request, context):
        spec, fp, owner = self._model(request.model, request.HasField("model"), context)
        count, nbytes = self.tier.purge(fp)
        if self.spill is not None:
            count += self.spill.purge(fp)
        log.info("purged model", extra={"model_id": spec.model_id, "chunks": count, "bytes": nbytes})
        return pb.PurgeResponse(deleted_chunks=count, deleted_bytes=nbytes)

    @_observed("Stats")
    def Stats(self, request, context):
        identity = identity_of(context)
        if not self.tenancy.is_admin(identity):
            # A tenant sees its own chunks and hit counts only: whole-cache counts would show other tenants'
            # activity.
            own = self.tenancy.usage(identity.tenant)
            budget = min(own["quota"], self.tier.budget) if own["quota"] else self.tier.budget
            return pb.StatsResponse(
                tiers=[pb.TierStats(tier=pb.TIER_DEVICE, entries=own["entries"], bytes_used=own["used"],
                                    bytes_budget=budget)],
                chunk_tokens=self.chunk_tokens, max_chunk_bytes=self.settings.max_chunk_bytes,
                hit_tokens=own["hit_tokens"], missed_tokens=own["missed_tokens"], device=str(self.tier.device),
                eviction_policy=self.tier.policy.name)
        u = self.tier.usage()
        tiers = [pb.TierStats(tier=pb.TIER_DEVICE, entries=u["entries"], bytes_used=u["used"],
                              bytes_budget=u["budget"])]
        if self.spill is not None:
            d = self.spill.usage()
            tiers.append(pb.TierStats(tier=pb.TIER_DISK, entries=d["entries"], bytes_used=d["used"],
                                      bytes_budget=d["budget"]))
        return pb.StatsResponse(
            tiers=tiers,
            chunk_tokens=self.chunk_tokens, max_chunk_bytes=self.settings.max_chunk_bytes,
            hit_tokens=self.hit_tokens, missed_tokens=self.missed_tokens, device=str(self.tier.device),
            eviction_policy=self.tier.policy.name)

    @_observed("Resize")
    def Resize(self, request, context):
        if not self.tenancy.is_admin(identity_of(context)):
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"tenant {identity_of(context).tenant!r} may not Resize (--admin-tenants)")
        if request.memory_bytes <= 0:
            raise invalid(f"memory_bytes must be positive, got {request.memory_bytes}")
        # Read again: a VPA in-place resize may have raised (or lowered) the container's limit since start.
        self.memory_limit = self.read_memory_limit()
        try:
            cgroup.check_budget(request.memory_bytes, self.tier.device.type == "cpu", self.memory_limit,
                                what="memory_bytes")
        except ValueError as exc:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        # Wait for Puts and Gets in flight within the caller's deadline (leaving time for the answer), at most
        # RESIZE_WAIT_SECONDS.
        wait = max(0.0, min(RESIZE_WAIT_SECONDS, context.time_remaining() - 0.25))
        r = self.tier.resize(request.memory_bytes, wait_seconds=wait)
        if not r.done:
            log.warning("shrink not applied: bytes held by calls in flight", extra={
                "previous_bytes": r.previous, "memory_bytes": r.requested, "evicted_chunks": r.evicted,
                "committed_bytes": r.committed, "reserved_bytes": r.reserved, "draining_bytes": r.draining})
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"memory_bytes {r.requested}: {r.committed} bytes still committed after waiting "
                             f"{r.waited:.1f} s ({r.reserved} reserved by Puts in flight, {r.draining} held by "
                             f"Gets of evicted chunks); the budget stays {r.previous} bytes ({r.evicted} chunks "
                             "were evicted meanwhile). Retry the Resize")
        self.metrics.resizes.inc()
        log.info("resized memory tier", extra={"previous_bytes": r.previous, "memory_bytes": r.requested,
                                               "evicted_chunks": r.evicted, "bytes_used": r.used,
                                               "committed_bytes": r.committed, "waited_seconds": round(r.waited, 3)})
        return pb.ResizeResponse(previous_bytes=r.previous, memory_bytes=r.requested, evicted_chunks=r.evicted,
                                 bytes_used=r.used, committed_bytes=r.committed,
                                 waited_milliseconds=round(r.waited * 1000))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available")
    return device


def is_local_address(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Sidecar:
    """One running sidecar: gRPC server, health, reflection, metrics endpoint, TTL sweeper."""

    def __init__(self, settings: Settings):
        self.settings = settings.validate()
        # Cross-field checks of the security settings (the tenancy ones are in Tenancy.from_settings).
        if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if settings.tls_client_ca_file and not settings.tls_cert_file:
            raise ValueError("--tls-client-ca-file (mTLS) needs --tls-cert-file and --tls-key-file")
        tls = bool(settings.tls_cert_file)
        if not tls and not is_local_address(settings.grpc_address) and not settings.allow_insecure_remote:
            raise ValueError(f"--grpc-address {settings.grpc_address} is not loopback or a unix socket; "
                             "serve TLS there (--tls-cert-file, --tls-key-file) or, for plaintext, pass "
                             "--allow-insecure-remote")
        if settings.bulk_address:
            self._check_bulk_address(settings, tls)
        if not tls and not is_local_address(settings.grpc_address):
            log.warning("serving plaintext gRPC on a non-loopback address (--allow-insecure-remote): requests, "
                        "chunk bytes and bearer tokens cross the network unencrypted",
                        extra={"grpc": settings.grpc_address})
        credentials = (server_credentials(settings.tls_cert_file, settings.tls_key_file,
                                          settings.tls_client_ca_file, settings.token_reload_seconds)
                       if tls else None)
        tokens = TokenStore(settings.token_file, settings.token_reload_seconds) if settings.token_file else None
        self.authenticator = Authenticator(tokens, mtls=bool(settings.tls_client_ca_file))
        self.tenancy = Tenancy.from_settings(settings)
        self.device = resolve_device(settings.device)
        self.memory_limit = cgroup.memory_limit()
        cgroup.check_budget(settings.memory_bytes, self.device.type == "cpu", self.memory_limit)
        self.metrics = Metrics()
        policy = make_policy(settings.eviction_policy, capacity=settings.memory_bytes)
        self.tier = MemoryTier(settings.memory_bytes, self.device, policy,
                               settings.ttl_seconds, on_evict=self._evicted, host_memory=self._chunk_memory(),
                               max_lifetime_seconds=settings.max_lifetime_seconds)
        self.tenancy.bind(self.tier)
        self.metrics.watch({"device": self.tier})
        self.observer = self._observer(settings)
        self.metrics.registry.register(self.observer)
        self.service = KVCacheService(settings, self.tier, self.metrics, self.tenancy, self.observer)
        self.service.memory_limit = self.memory_limit
        self.spill = None
        from prometheus_client import Counter

        from promptcache.sidecar.tenancy import TenantCollector

        self.metrics.registry.register(TenantCollector(self.tenancy))
        cancelled = Counter("promptcache_calls_cancelled", "calls cancelled by the watchdog, by method and limit "
                            "(idle: --stream-idle-seconds, duration: --max-call-seconds, rate: "
                            "--min-put-bytes-per-second)", ["rpc", "limit"], registry=self.metrics.registry)
        self.watchdog = Watchdog(settings.max_call_seconds, settings.stream_idle_seconds,
                                 on_expire=lambda rpc, limit: cancelled.labels(rpc, limit).inc(),
                                 min_put_bytes_per_second=settings.min_put_bytes_per_second,
                                 put_rate_window_seconds=settings.put_rate_window_seconds)
        self.guard = Guard(self.authenticator, CallLimiter(settings.max_calls_per_client), self.watchdog,
                           self.metrics)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.workers,
                                                             thread_name_prefix="grpc"),
                                  interceptors=[self.guard], options=[("grpc.so_reuseport", 0)])
        frames.add_service(self.service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        try:
            self.port = (self.server.add_secure_port(settings.grpc_address, credentials) if tls
                         else self.server.add_insecure_port(settings.grpc_address))
        except RuntimeError:  # grpcio's "Failed to bind": the TLS files were checked above, so it is the address
            self.port = 0
        if self.port == 0:
            why = ("the socket is in use, or its folder is missing or not writable"
                   if settings.grpc_address.startswith("unix:") else
                   "the port is in use, or the host is not an address of this machine")
            raise OSError(f"cannot listen on --grpc-address {settings.grpc_address}: {why}")
        # Opened once the gRPC port is ours: a second sidecar started with the same --grpc-address by mistake
        # stops before it touches the data.
        if settings.disk_bytes > 0:
            from promptcache.sidecar.disk import DiskTier  # rocksdict loads only when the disk tier is on
            from promptcache.sidecar.spill import Spill

            disk = DiskTier(os.path.join(settings.data_dir, "rocksdb"), settings.disk_bytes,
                            ttl_seconds=settings.ttl_seconds, min_free_bytes=settings.disk_min_free_bytes,
                            lock_wait_seconds=settings.disk_lock_wait_seconds)
            self.spill = self.service.spill = Spill(self.tier, disk, self.metrics, self.tenancy)
            self.metrics.watch({"disk": self.spill})
            log.info("disk tier open", extra={"path": disk.path, "disk_bytes": settings.disk_bytes,
                                              **disk.open_report})
        self.events = None
        if settings.kv_events_address:
            from promptcache.sidecar.kvevents import KVEvents

            events_counter = Counter("promptcache_kv_events", "KV events sent to routers, by type (BlockStored, "
                                     "BlockRemoved, AllBlocksCleared; dropped: queue full)", ["type"],
                                     registry=self.metrics.registry)
            try:
                self.events = self.service.events = KVEvents(
                    settings.kv_events_address, settings.kv_events_id or socket.gethostname(),
                    settings.chunk_tokens, "GPU" if self.device.type == "cuda" else "CPU", events_counter)
            except Exception as exc:  # noqa: BLE001 - zmq.ZMQError: the address is in use or not ours
                raise OSError(f"cannot listen on --kv-events-address {settings.kv_events_address}: {exc}") from None
        self.cluster = None
        if settings.cluster_master:
            self.cluster = self.service.cluster = self._cluster_tier(settings)
        self.bulk = [BulkServer(address, self.service, self.authenticator, self.metrics,
                                settings.bulk_max_connections, settings.stream_idle_seconds,
                                settings.max_call_seconds, lend=self.tier.host_memory is not None,
                                max_connections_per_peer=settings.bulk_max_connections_per_peer,
                                hello_seconds=settings.bulk_hello_seconds, watchdog=self.watchdog)
                     for address in settings.bulk_addresses]
        self._stop = threading.Event()
        self._stop_lock = threading.Lock()
        self.stop_error: str | None = None
        self._http = None
        self.metrics_port = None

    @staticmethod
    def _observer(settings: Settings) -> TrafficObserver:
        from promptcache.sidecar.accesslog import AccessLog
        from promptcache.sidecar.mrc import MissRatioCurve, parse_sizes

        curve = access_log = None
        if settings.mrc_sample_rate > 0:
            curve = MissRatioCurve(parse_sizes(settings.mrc_sizes, settings.memory_bytes), settings.mrc_sample_rate,
                                   settings.eviction_policy, settings.mrc_min_chunks)
        if settings.access_log_path:
            access_log = AccessLog(settings.access_log_path, settings.access_log_max_bytes, settings.access_log_files)
        return TrafficObserver(settings.chunk_tokens, curve, access_log, settings.access_log_sample_rate)

    def _cluster_tier(self, settings: Settings):
        from promptcache.sidecar.cluster import ClusterMetrics, ClusterTier, MooncakeStore

        hostname = settings.cluster_local_hostname or socket.gethostbyname(socket.gethostname())

        def connect() -> MooncakeStore:
            return MooncakeStore(settings.cluster_master, hostname, settings.cluster_protocol,
                                 settings.cluster_segment_bytes, settings.cluster_buffer_bytes,
                                 settings.cluster_metadata_server, settings.cluster_rdma_devices)

        log.info("cluster tier on", extra={"master": settings.cluster_master, "local_hostname": hostname,
                                           "protocol": settings.cluster_protocol})
        return ClusterTier(connect, ClusterMetrics(self.metrics.registry), settings.cluster_timeout_seconds,
                           settings.cluster_retry_seconds, settings.cluster_publish_queue,
                           settings.cluster_buffer_bytes)

    def _chunk_memory(self) -> ChunkMemory | None:
        """Memfd-backed chunk memory when the bulk channel may lend chunks (--bulk-zero-copy), else None."""
        mode = self.settings.bulk_zero_copy
        unix = any(a.startswith("unix:") for a in self.settings.bulk_addresses)
        if mode == "on" and not unix:
            raise ValueError("--bulk-zero-copy on needs a unix-socket --bulk-address (unix:/PATH): descriptors "
                             "cannot cross TCP")
        if mode == "off" or not unix:
            return None
        if mode == "auto" and self.tenancy.isolate:
            log.info("bulk zero-copy is off: with isolated tenants a client could keep evicted chunks' memory "
                     "alive (--bulk-zero-copy on allows it)")
            return None
        why = ("the device tier is on " + self.device.type) if self.device.type != "cpu" else memfd.probe()
        limit = memfd.descriptor_budget() if not why else 0
        if not why and limit < 64:
            why = f"only {limit} chunks could have a descriptor (raise the open-files limit)"
        if why:
            if mode == "on":
                raise ValueError(f"--bulk-zero-copy on: {why}")
            log.info("bulk zero-copy is off: %s", why)
            return None
        log.info("bulk zero-copy is on", extra={"max_lendable_chunks": limit})
        return ChunkMemory(limit)

    def _evicted(self, entry, reason: str, age: float) -> None:
        self.tenancy.on_evicted(entry)
        if getattr(self, "events", None) is not None:
            self.events.removed(entry.key)
        if reason == "capacity" and getattr(self, "spill", None) is not None:
            self.spill.demote(entry)
        self.metrics.evictions.labels("device", reason).inc()
        self.metrics.evicted_bytes.labels("device", reason).inc(entry.nbytes)
        self.metrics.eviction_age.labels(reason).observe(age)

    @staticmethod
    def _check_bulk_address(settings: Settings, tls: bool) -> None:
        if settings.tls_client_ca_file and not settings.token_file:
            raise ValueError("--bulk-address: bulk clients authenticate with a bearer token, and with mTLS but no "
                             "--token-file they could not; add --token-file or leave --bulk-address empty")
        for address in settings.bulk_addresses:
            if address.startswith("unix:"):
                continue
            if tls:
                raise ValueError(f"--bulk-address {address} is TCP, and the bulk channel has no TLS: with TLS on, "
                                 "put it on a unix socket (unix:/PATH) or leave it empty")
            if not is_local_address(address) and not settings.allow_insecure_remote:
                raise ValueError(f"--bulk-address {address} is not loopback or a unix socket and the bulk channel "
                                 "is plaintext; use a unix socket or pass --allow-insecure-remote")

    @property
    def bulk_address(self) -> str | None:
        """The first bulk-channel address (as listening: a TCP port 0 resolved), or None."""
        return self.bulk[0].address if self.bulk else None

    @property
    def bulk_addresses(self) -> list[str]:
        return [b.address for b in self.bulk]

    @property
    def address(self) -> str:
        a = self.settings.grpc_address
        return a if a.startswith("unix:") else f"{a.rsplit(':', 1)[0]}:{self.port}"

    def start(self) -> "Sidecar":
        """Start serving; OSError naming the flag when a listener cannot be opened (everything opened is closed)."""
        self.server.start()
        started = []
        try:
            for b in self.bulk:
                started.append(b.start())
            if self.settings.metrics_port is not None:
                try:
                    self._http, _ = start_http_server(self.settings.metrics_port, addr=self.settings.metrics_host,
                                                      registry=self.metrics.registry)
                except OSError as exc:
                    raise OSError(f"cannot listen on --metrics-host {self.settings.metrics_host} --metrics-port "
                                  f"{self.settings.metrics_port}: {exc.strerror or exc}") from None
                self.metrics_port = self._http.server_port
        except OSError:
            for b in started:
                b.stop()
            if self.events is not None:
                self.events.close()
            self.server.stop(0)
            self.watchdog.stop()
            if self.spill is not None:
                self.spill.disk.close()
            raise
        if self.cluster is not None:
            self.cluster.start()
        if self.events is not None:
            self.events.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._sweep, name="ttl-sweeper", daemon=True).start()
        self.observer.start()
        return self

    def _sweep(self) -> None:
        interval = min(max(self.settings.ttl_seconds / 4, 0.05), 30.0)
        while not self._stop.wait(interval):
            self.tier.expire()
            if self.service.buffers is not None:
                self.service.buffers.reap()

    def stop(self, grace: float = 2.0) -> None:
        """Idempotent; a second caller waits until the first has finished (the disk flush included). When the
        disk tier could not be flushed and closed, `stop_error` says why (what it held may be lost)."""
        with self._stop_lock:
            if not self._stop.is_set():
                self._stop.set()
                self._shutdown(grace)

    def _shutdown(self, grace: float) -> None:
        self.watchdog.stop()
        self.health.enter_graceful_shutdown()
        for b in self.bulk:
            b.stop()
        self.server.stop(grace).wait()
        if self.service.buffers is not None:
            self.service.buffers.close_all()
        self.observer.stop()  # after the last call: the access log gets every line queued
        if self.cluster is not None:
            self.cluster.close()
        if self.events is not None:
            self.events.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self.spill is not None:
            # A graceful stop (upgrade, rescheduling) keeps the cache: memory goes to disk for the next start.
            disk = self.spill.disk
            demoted = self.spill.demote_all()
            flushed = disk.flush()
            try:
                disk.close()
            except Exception as exc:  # noqa: BLE001 - RocksDB reports I/O errors as plain Exception
                self.stop_error = f"cannot close the disk tier {disk.path} (--data-dir): {exc}"
            else:
                if not flushed:
                    self.stop_error = f"the disk tier {disk.path} (--data-dir) did not finish its writes in time"
            if self.stop_error:
                log.error("%s; what it held may be lost", self.stop_error)
            else:
                log.info("disk tier closed", extra={"demoted_on_shutdown": demoted})

    def wait(self) -> None:
        self.server.wait_for_termination()


def serve_from_args(args) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"promptcache serve: {exc}", flush=True)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        sidecar = Sidecar(settings).start()
    except (ValueError, OSError, DiskTierError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    log.info("promptcache sidecar serving", extra={
        "grpc": sidecar.address, "bulk": ",".join(sidecar.bulk_addresses), "metrics": f"http://{settings.metrics_host}:{sidecar.metrics_port}/metrics",
        "device": str(sidecar.device), "memory_bytes": settings.memory_bytes,
        "chunk_tokens": settings.chunk_tokens, "eviction_policy": settings.eviction_policy})

    def stop() -> None:
        try:
            sidecar.stop()
        except Exception as exc:  # noqa: BLE001 - a bug: say so, and exit non-zero
            log.exception("shutdown failed")
            sidecar.stop_error = sidecar.stop_error or f"shutdown failed: {exc}"
            sidecar.server.stop(0)  # so that wait() below returns

    def shutdown(signum, frame):
        log.info("shutting down", extra={"signal": signal.Signals(signum).name})
        threading.Thread(target=stop, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    sidecar.wait()
    sidecar.stop()  # returns once the shutdown started by the signal has finished
    return 1 if sidecar.stop_error else 0
