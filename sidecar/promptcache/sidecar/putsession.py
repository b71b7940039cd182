"""A Put, chunk by chunk: `PutSession` checks each chunk frame, reserves room for its bytes (memory, the owner's
quota, the client's share of the budget), copies them into the reservation as they arrive (from data frames or a
bulk connection's receive buffer, checksummed and scanned on the way; or from the caller's shared-memory file) and
hands each complete chunk to CacheEngine.store. Every reservation is released on any exit, so a Put cut short
anywhere leaves nothing held and nothing partial stored."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from promptcache.contract import keys as keyspec
from promptcache.contract.layout import chunk_nbytes, chunk_shape, scan_dtype
from promptcache.contract.shm import SharedBufferError
from promptcache.contract.wire import NAME_TO_DTYPE
from promptcache.sidecar.errors import InvalidRequest, NoCapacity
from promptcache.sidecar.identity import Caller
from promptcache.sidecar.shmbuffers import shared_file
from promptcache.sidecar.store import AdmissionRejected, ChunkCheck, ChunkTooLarge, NoRoom, Reservation
from promptcache.sidecar.tenancy import TenancyError
from promptcache.v1 import kvcache_pb2 as pb

if TYPE_CHECKING:
    from promptcache.sidecar.engine import CacheEngine


@dataclass
class Incoming:
    """A chunk being received by a Put."""
    begin: pb.ChunkBegin
    key: bytes
    parent: bytes
    reservation: Reservation | None  # None: not kept (cached already, or refused): the bytes are read and dropped
    buffer: np.ndarray | None
    host: torch.Tensor | None
    check: ChunkCheck | None = None  # checksum and scan of the bytes copied in so far (add_data)
    offset: int = 0
    charged: int = 0  # bytes charged to the owner's quota (tenancy)
    held: int = 0  # bytes counted against the client's --max-put-reserved-fraction


class PutSession:
    """One Put: begin_chunk() for each chunk frame, then its bytes (add_data()), then commit() for the result.
    Every reservation it holds (memory, quota, the client's share) is released on any exit: abort(), or leaving
    the `with` block by an exception. With header.shared_buffer the bytes are read from the caller's shared-memory
    file at begin_chunk() (buffer_offset)."""

    def __init__(self, engine: "CacheEngine", caller: Caller, header: pb.PutHeader, watch=None,
                 large_slot: bool = True):
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
        # the work that grows with the tokens: every key, up front (in one of --max-large-requests, if many)
        with e._large(header.tokens if large_slot else (), "Put", e.slot_client(caller)):
            self.keys = list(e._keys(self.scope.fingerprint, header.tokens))
        spec = self.scope.spec
        self.shape = list(chunk_shape(spec, ct))
        self.nbytes = chunk_nbytes(spec, ct)  # a layout scope() already checked
        self.dtype = NAME_TO_DTYPE[spec.kv_dtype]
        self.scan_dtype = scan_dtype(spec)
        self.stored = self.skipped = self.rejected = self.stored_bytes = 0
        self.ttl = e.ttl_hint(header.ttl_seconds)
        self.priority = min(header.priority, 1)
        self.seen: set[int] = set()
        self.current: Incoming | None = None
        self.shared = None
        self._closed = False
        if header.shared_buffer:
            self.shared = shared_file(e.buffers, caller, header.shared_buffer, None, cap=self.n_chunks * self.nbytes)

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
        current = Incoming(begin, key, parent, None, None, None)
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
        current.buffer = current.reservation.array
        if self.shared is None:
            current.check = ChunkCheck(current.buffer, self.scan_dtype)
        else:  # read by the kernel into the chunk: CacheEngine.store checks it in one pass
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

    def add_data(self, data, client_writable: bool = False) -> None:
        """The next bytes of the current chunk (a data frame, what a bulk connection received, or a piece of the
        client's memfd: `client_writable`): copied into its reserved memory, checksummed and scanned on the way
        (ChunkCheck)."""
        c = self._expect_data()
        n = len(data)
        if c.offset + n > c.begin.nbytes:
            raise InvalidRequest(f"chunk {c.begin.index}: data frames carry more than the {c.begin.nbytes} bytes "
                                 "its chunk frame announced")
        if c.buffer is not None:
            c.check.copy_in(c.offset, np.frombuffer(data, dtype=np.uint8), client_writable)
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
        if self.seen:
            covered = self.keys[:max(self.seen) + 1]
            declared = self.engine.pinned_prefixes
            if not self.priority and declared:  # the prefixes the operator declared pinned (pinned.py)
                covered = covered[:declared.leading(self.header.tokens)]
            if covered and (self.priority or declared):
                self.engine.pin_prefix(self.scope.fingerprint, self.scope.owner, covered)
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
    def _expect_data(self) -> Incoming:
        if self.shared is not None:
            raise InvalidRequest("data frames are not allowed when the header names a shared buffer")
        if self.current is None:
            raise InvalidRequest("a data frame arrived before any chunk frame")
        return self.current

    def _complete(self, current: Incoming) -> None:
        if current.reservation is not None:
            self.stored_bytes += self.engine.store(current, self.scope.spec, self.scope.fingerprint,
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

    def _hold(self, current: Incoming) -> None:
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

    def _unhold(self, current: Incoming) -> None:
        if current.held:
            self.engine.reserved_by_client.release(self.caller.client, current.held)
            current.held = 0
        if self.watch is not None:
            self.watch.hold(0)

    @staticmethod
    def _cut_short(current: Incoming) -> InvalidRequest:
        return InvalidRequest(f"chunk {current.begin.index} ended after {current.offset} of its "
                              f"{current.begin.nbytes} bytes; nothing of it was stored")

