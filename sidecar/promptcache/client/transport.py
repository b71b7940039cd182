"""How chunk bytes travel between PromptCacheClient and the sidecar: a chain of transports behind one interface.

Each transport does the same two things, put chunks (PutCall) and get chunks (GetCall) into a destination of its
own, and the client tries them in order, fastest first (TransportChain), with one fallback policy
(promptcache.client.fallback) deciding what a failure leads to:

  BulkTransport        "bulk": the bulk channel (the sidecar's --bulk-address; docs/bulk-channel.md,
                       promptcache.client.bulk), a plain socket. Over TCP the bytes travel on the socket; on a
                       unix socket through memfds: the chunks' own, lent read-only by the sidecar, or one this
                       client shares with it (attached once per connection).
  SharedFileTransport  "shm": gRPC, with the bytes in a shared-memory file per thread that the sidecar created
                       for this client in its --shm-dir (promptcache.contract.shm).
  StreamTransport      "grpc": gRPC, with the bytes in the stream's frames. Always there, always last: it takes
                       every call, so the chain never runs out.

A get answers with (blobs, whether the caller owns them): blobs in a reused destination (the thread's shared
buffer, the bulk connection's buffer, lent chunks) are views, valid until the thread's next call.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np
import xxhash

from promptcache.client import errors
from promptcache.client.fallback import BULK, GET, GRPC, PUT, SHM, Action, FallbackPolicy, Refused
from promptcache.contract.keys import ModelSpec
from promptcache.contract.shm import ClientBuffers, SharedBufferError
from promptcache.contract.wire import model_to_proto
from promptcache.v1 import kvcache_pb2 as pb

if TYPE_CHECKING:
    import torch

    from promptcache.client.bulk import BulkClient

log = logging.getLogger("promptcache.client")
Blobs = tuple[list["torch.Tensor"], bool]  # (chunk blobs, whether the caller owns them)
Call = Callable[[Callable[[float], object], float | None], object]  # PromptCacheClient._call: retries, deadline


@dataclass
class PutCall:
    """One put_blobs: the chunks (index -> bytes) of `tokens`, in the stored layout. Each chunk's xxh3 is computed
    when its frame is built (begin) and kept in `sums` for a retry: a transport that sends chunk by chunk hashes
    chunk i+1 while the sidecar verifies chunk i, instead of hashing all of them before the first byte leaves."""
    spec: ModelSpec
    tokens: list[int]
    arrays: dict[int, np.ndarray]
    shape: list[int]
    dtype: int
    timeout: float
    ttl_seconds: float = 0.0
    priority: int = 0
    sums: dict[int, int] = field(default_factory=dict)  # index -> xxh3, filled by checksum()

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.arrays.values())

    def header(self, shared_buffer: str = "") -> pb.PutHeader:
        return pb.PutHeader(model=model_to_proto(self.spec), tokens=self.tokens, shared_buffer=shared_buffer,
                            ttl_seconds=self.ttl_seconds, priority=self.priority)

    def checksum(self, index: int) -> int:
        value = self.sums.get(index)
        if value is None:
            value = self.sums[index] = xxhash.xxh3_64_intdigest(self.arrays[index])
        return value

    def begin(self, index: int, buffer_offset: int = 0) -> pb.ChunkBegin:
        return pb.ChunkBegin(index=index, nbytes=self.arrays[index].size, shape=self.shape, dtype=self.dtype,
                             xxh3_64=self.checksum(index), buffer_offset=buffer_offset)


@dataclass
class GetCall:
    """One get_blobs. `nbytes`: what the answer holds at most (whole chunks from start_chunk on), which sizes the
    destination of the transports that need it up front; None when no transport of the chain does. `chunks` and
    `chunk_bytes`: the most chunks the request allows (min(max_chunks, whole chunks of the tokens from start_chunk))
    and every chunk's exact length; an answer past them is refused (CorruptChunk). None: not known, not checked."""
    request: pb.GetRequest
    timeout: float
    owned: bool = False  # owned blobs are wanted, where they cost no extra copy
    nbytes: int | None = None
    chunks: int | None = None
    chunk_bytes: int | None = None

    @property
    def start_chunk(self) -> int:
        return self.request.start_chunk


class Transport(Protocol):
    name: str   # promptcache.client.fallback's name for it: BULK, SHM or GRPC
    what: str   # for log lines
    sized: bool  # needs GetCall.nbytes

    def put(self, call: PutCall) -> pb.PutResponse: ...

    def get(self, call: GetCall) -> Blobs: ...

    def reset(self) -> None:
        """Forget what this thread holds that the sidecar no longer knows (before a RETRY)."""


class BulkTransport:
    name, what, sized = BULK, "bulk channel", True

    def __init__(self, bulk: "BulkClient"):
        self.bulk = bulk

    def put(self, call: PutCall) -> pb.PutResponse:
        # Each chunk's frame (and checksum) is built as the channel comes to send it.
        chunks = [(functools.partial(call.begin, i), arr) for i, arr in call.arrays.items()]
        return self.bulk.put(call.header(), chunks, call.timeout)

    def get(self, call: GetCall) -> Blobs:
        return self.bulk.get(call.request, call.nbytes, call.timeout, call.owned, call.chunks, call.chunk_bytes)

    def reset(self) -> None:
        pass


class SharedFileTransport:
    """gRPC Put and GetShared, the bytes in this thread's buffer (ClientBuffers), placed at the offsets the
    ChunkBegin frames name. Blobs got are views of that buffer."""
    name, what, sized = SHM, "shared-memory buffer", True

    def __init__(self, buffers: ClientBuffers, stub, call: Call):
        self.buffers = buffers
        self._stub = stub
        self._call = call

    def _buffer(self, size: int):
        try:
            return self.buffers.get(size)
        except (errors.ResourceExhausted, SharedBufferError) as exc:
            raise Refused(exc) from None

    def put(self, call: PutCall) -> pb.PutResponse:
        shared = self._buffer(call.nbytes)
        offsets, pos = {}, 0
        for i, arr in call.arrays.items():
            shared.array[pos:pos + arr.size] = arr
            offsets[i], pos = pos, pos + arr.size

        def frames() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(header=call.header(shared.name))
            for index in call.arrays:
                yield pb.PutRequest(chunk=call.begin(index, offsets[index]))

        return self._call(lambda t: self._stub.Put(frames(), timeout=t), call.timeout)

    def get(self, call: GetCall) -> Blobs:
        shared = self._buffer(call.nbytes)
        req = call.request
        req.shared_buffer.name, req.shared_buffer.length = shared.name, call.nbytes
        try:
            return self._call(lambda t: _receive_shared(self._stub.GetShared(req, timeout=t), call.start_chunk,
                                                        shared.array, call.chunks, call.chunk_bytes),
                              call.timeout), False
        except BaseException:
            self.buffers.retire()  # the sidecar may still write this answer there: the next Get gets a new one
            raise
        finally:
            req.ClearField("shared_buffer")  # the next transport sends the request as it came

    def reset(self) -> None:
        self.buffers.discard()


class StreamTransport:
    """gRPC Put and Get with the bytes in the stream: Put frames of frame_bytes, and a tensor per chunk got (the
    caller's own)."""
    name, what, sized = GRPC, "gRPC stream", False

    def __init__(self, stub, get_stream, call: Call, frame_bytes: int):
        self._stub = stub
        self._get = get_stream  # promptcache.contract.frames.get_callable: data frames as memoryviews
        self._call = call
        self.frame_bytes = frame_bytes

    def put(self, call: PutCall) -> pb.PutResponse:
        step = self.frame_bytes

        def frames() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(header=call.header())
            for index, arr in call.arrays.items():
                yield pb.PutRequest(chunk=call.begin(index))
                for off in range(0, arr.size, step):
                    yield pb.PutRequest(data=arr[off:off + step].tobytes())

        return self._call(lambda t: self._stub.Put(frames(), timeout=t), call.timeout)

    def get(self, call: GetCall) -> Blobs:
        return self._call(lambda t: _receive(self._get(call.request, timeout=t), call.start_chunk, call.chunks,
                                             call.chunk_bytes), call.timeout), True

    def reset(self) -> None:
        pass


class TransportChain:
    """The transports in the order to try them, the last a StreamTransport, and the policy that moves between
    them. One per client, shared by its threads."""

    def __init__(self, transports: Sequence[Transport], policy: FallbackPolicy | None = None):
        if not transports or transports[-1].name != GRPC:
            raise ValueError("a transport chain ends with the gRPC stream")
        self.transports = list(transports)
        self.names = [t.name for t in self.transports]
        self.policy = policy or FallbackPolicy()
        self.sized = any(t.sized for t in self.transports)  # get calls must carry nbytes

    def put(self, call: PutCall) -> pb.PutResponse:
        if not call.arrays:  # nothing to carry: the Put's header alone, on the stream
            return self.transports[-1].put(call)
        return self._run(PUT, call)

    def get(self, call: GetCall) -> Blobs:
        if call.nbytes == 0:  # no whole chunk asked for: answered here, without a call
            return [], True
        return self._run(GET, call)

    def _run(self, op: str, call):
        i, attempt = self.policy.first(self.names), 0
        while True:
            transport = self.transports[i]
            try:
                return transport.put(call) if op == PUT else transport.get(call)
            except Exception as exc:  # noqa: BLE001 - the policy decides; what it does not take is raised as it is
                decision = self.policy.failed(transport.name, op, exc, attempt)
                if decision.action is Action.RAISE or i == len(self.transports) - 1:
                    raise
                if decision.action is Action.RETRY:
                    transport.reset()
                    attempt += 1
                    continue
                i, attempt = self.policy.first(self.names, i + 1), 0
                log.warning("%s not usable for %s, using the %s (for %.0f s): %s", transport.what, op,
                            self.transports[i].what, decision.hold_seconds, exc)


# --- what comes back over gRPC -------------------------------------------------------------------------------
def _receive(stream: Iterable, start_chunk: int, max_chunks: int | None = None,
             chunk_bytes: int | None = None) -> list["torch.Tensor"]:
    import torch

    blobs: list[torch.Tensor] = []
    current = buf = None
    offset = 0

    def finish():
        if offset != current.nbytes:
            raise errors.CorruptChunk(f"chunk {current.index} ended after {offset} of {current.nbytes} bytes")
        if xxhash.xxh3_64_intdigest(buf) != current.xxh3_64:
            raise errors.CorruptChunk(f"chunk {current.index} failed its checksum in transit")

    for msg in stream:
        if isinstance(msg, memoryview):  # a data frame (promptcache.contract.frames), or a parsed message otherwise
            data = msg
        elif msg.WhichOneof("frame") == "chunk":
            if current is not None:
                finish()
            current = msg.chunk
            if current.index != start_chunk + len(blobs):
                raise errors.CorruptChunk(f"expected chunk {start_chunk + len(blobs)}, got {current.index}")
            errors.check_chunk_within(current, len(blobs), max_chunks, chunk_bytes)
            blobs.append(torch.empty(current.nbytes, dtype=torch.uint8))
            buf, offset = blobs[-1].numpy(), 0
            continue
        elif msg.WhichOneof("frame") == "data":
            data = memoryview(msg.data)
        else:
            raise errors.CorruptChunk(f"unexpected {msg.WhichOneof('frame')} frame in a streamed Get")
        n = data.nbytes
        if current is None or offset + n > current.nbytes:
            raise errors.CorruptChunk("data frame outside a chunk's announced length")
        buf[offset:offset + n] = np.frombuffer(data, dtype=np.uint8)
        offset += n
    if current is not None:
        finish()
    return blobs


def _receive_shared(batch: pb.ChunkBatch, start_chunk: int, buffer: np.ndarray, max_chunks: int | None = None,
                    chunk_bytes: int | None = None) -> list["torch.Tensor"]:
    blobs = []
    for c in batch.chunks:
        errors.check_chunk_within(c, len(blobs), max_chunks, chunk_bytes)
        blobs.append(_shared_chunk(c, start_chunk + len(blobs), buffer))
    return blobs


def _shared_chunk(c: pb.ChunkBegin, expected_index: int, buffer: np.ndarray) -> "torch.Tensor":
    if c.index != expected_index:
        raise errors.CorruptChunk(f"expected chunk {expected_index}, got {c.index}")
    if c.buffer_offset + c.nbytes > buffer.size:
        raise errors.CorruptChunk(f"chunk {c.index} was placed outside the shared buffer")
    view = buffer[c.buffer_offset:c.buffer_offset + c.nbytes]
    if xxhash.xxh3_64_intdigest(view) != c.xxh3_64:
        raise errors.CorruptChunk(f"chunk {c.index} failed its checksum in shared memory")
    import torch

    return torch.from_numpy(view)
