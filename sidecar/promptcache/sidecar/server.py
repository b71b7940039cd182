"""The gRPC servicer: an adapter from the KVCache service of promptcache.v1 onto the cache engine.

It turns each call into a `Caller` (the identity the Guard attached, the peer, the inference pod named in the
metadata), calls promptcache.sidecar.engine, and maps the engine's errors (promptcache.sidecar.errors) onto gRPC
status codes; it counts calls and their latency. Get streams the verified chunks as pre-encoded data frames.
"""
from __future__ import annotations

import functools
import logging

from promptcache.contract import frames
from promptcache.sidecar import shmbuffers
from promptcache.sidecar.auth import identity_of
from promptcache.sidecar.calls import Call
from promptcache.sidecar.engine import CacheEngine
from promptcache.sidecar.errors import InvalidRequest
from promptcache.sidecar.guard import watch_of
from promptcache.sidecar.identity import Caller
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import POD_METADATA

log = logging.getLogger("promptcache.sidecar")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
EXPORT_PIECE_BYTES = 1 << 20  # an Export's messages (ExportResponse.data)
# The longest a shrinking Resize waits for Puts and Gets in flight to let go of their bytes (less when the
# caller's deadline is nearer). A stalled stream is cancelled after --stream-idle-seconds (30 s) anyway.
RESIZE_WAIT_SECONDS = 30.0
MAX_POD_NAME = 253  # a Kubernetes object name


def caller_of(context) -> Caller:
    """The caller of a gRPC call: the identity the Guard attached, its peer, and its inference pod."""
    pod = ""
    for name, value in context.invocation_metadata() or ():
        if name == POD_METADATA and value and len(value) <= MAX_POD_NAME:
            pod = value
            break
    return Caller(identity_of(context), context.peer(), pod)


def _observed(rpc: str, streaming_response: bool = False):
    """Run a method as one calls.Call: its latency and status code counted, the engine's errors and crashes
    turned into statuses (the Guard applied credentials, the per-client limit and the watchdog already)."""

    def wrap(fn):
        def fail(call, context, exc):
            call.fail(exc)
            call.end()
            context.abort(call.code, call.message)

        if streaming_response:
            @functools.wraps(fn)
            def stream(self, request, context):
                with Call(rpc, self.metrics) as call:
                    try:
                        yield from fn(self, request, context)
                    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                        fail(call, context, exc)
            return stream

        @functools.wraps(fn)
        def unary(self, request, context):
            with Call(rpc, self.metrics) as call:
                try:
                    return fn(self, request, context)
                except Exception as exc:  # noqa: BLE001
                    fail(call, context, exc)
        return unary

    return wrap


def _model(msg) -> pb.Model | None:
    return msg.model if msg.HasField("model") else None


class KVCacheServicer(pb_grpc.KVCacheServicer):
    def __init__(self, engine: CacheEngine, frame_bytes: int):
        self.engine = engine
        self.metrics = engine.metrics
        self.frame_bytes = frame_bytes

    @_observed("Lookup")
    def Lookup(self, request, context):
        return self.engine.lookup(caller_of(context), _model(request), request.tokens)

    @_observed("Get", streaming_response=True)
    def Get(self, request, context):
        caller = caller_of(context)
        if request.HasField("shared_buffer"):  # the streamed form of GetShared: one batch frame at the end
            batch = shmbuffers.read_into_shared(self.engine, caller, request)
            if batch.chunks:
                yield pb.GetResponse(batch=batch)
            return
        frame = self.frame_bytes
        for begin, view in self.engine.read_chunks(caller, request):
            yield pb.GetResponse(chunk=begin)
            for off in range(0, begin.nbytes, frame):
                yield frames.encode_data_frame(view[off:off + frame])

    @_observed("GetShared")
    def GetShared(self, request, context):
        if not request.HasField("shared_buffer"):
            raise InvalidRequest("GetShared needs shared_buffer (use Get to stream the bytes)")
        return shmbuffers.read_into_shared(self.engine, caller_of(context), request)

    @_observed("Put")
    def Put(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("frame") != "header":
            raise InvalidRequest("a Put stream must start with a header frame")
        # The watchdog's record of the call: told what the Put holds reserved and receives.
        with self.engine.put(caller_of(context), first.header, watch_of(context)) as put:
            for msg in request_iterator:
                kind = msg.WhichOneof("frame")
                if kind == "chunk":
                    put.begin_chunk(msg.chunk)
                elif kind == "data":
                    put.add_data(msg.data)
                elif kind == "header":
                    raise InvalidRequest("a Put stream carries exactly one header frame")
                else:
                    raise InvalidRequest("empty PutRequest frame")
            return put.commit()

    @_observed("OpenSharedBuffer")
    def OpenSharedBuffer(self, request, context):
        grant = shmbuffers.open_buffer(self.engine.buffers, caller_of(context), request.length)
        return pb.OpenSharedBufferResponse(handle=grant.handle, file_name=grant.file_name, length=grant.length,
                                           inode=grant.inode)

    @_observed("CloseSharedBuffer")
    def CloseSharedBuffer(self, request, context):
        shmbuffers.close_buffer(self.engine.buffers, caller_of(context), request.handle)
        return pb.CloseSharedBufferResponse()

    @_observed("Delete")
    def Delete(self, request, context):
        deleted = self.engine.delete(caller_of(context), _model(request), request.tokens, request.start_chunk)
        return pb.DeleteResponse(deleted_chunks=deleted)

    @_observed("Purge")
    def Purge(self, request, context):
        count, nbytes = self.engine.purge(caller_of(context), _model(request))
        return pb.PurgeResponse(deleted_chunks=count, deleted_bytes=nbytes)

    @_observed("Stats")
    def Stats(self, request, context):
        return self.engine.stats(caller_of(context))

    @_observed("Resize")
    def Resize(self, request, context):
        # Wait for Puts and Gets in flight within the caller's deadline (leaving time for the answer), at most
        # RESIZE_WAIT_SECONDS.
        remaining = context.time_remaining()
        wait = max(0.0, min(RESIZE_WAIT_SECONDS, (remaining if remaining is not None else RESIZE_WAIT_SECONDS) - 0.25))
        r = self.engine.resize(caller_of(context), request.memory_bytes, wait)
        return pb.ResizeResponse(previous_bytes=r.previous, memory_bytes=r.requested, evicted_chunks=r.evicted,
                                 bytes_used=r.used, committed_bytes=r.committed,
                                 waited_milliseconds=round(r.waited * 1000))

    @_observed("Export", streaming_response=True)
    def Export(self, request, context):
        pending, held = [], 0
        for piece in self.engine.export(caller_of(context), request.max_bytes):
            pending.append(piece)  # records are small: sent EXPORT_PIECE_BYTES at a time
            held += len(piece)
            while held >= EXPORT_PIECE_BYTES:
                data = b"".join(pending)
                yield pb.ExportResponse(data=data[:EXPORT_PIECE_BYTES])
                pending, held = [data[EXPORT_PIECE_BYTES:]], held - EXPORT_PIECE_BYTES
        if held:
            yield pb.ExportResponse(data=b"".join(pending))
