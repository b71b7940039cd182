"""PromptCacheClient: lookup, put and get of per-layer K/V tensors over gRPC (TCP or a unix socket).

Chunks travel as one contiguous blob each ([layers, 2, kv_heads, chunk_tokens, head_dim], see
promptcache.contract.layout); quantized modes are packed here, before the bytes leave the process, and unpacked
after they arrive. Every chunk received is checked against the checksum the server sent with it.
"""
from __future__ import annotations

import logging
import math
import numbers
import os
import random
import time
import weakref
from dataclasses import dataclass
import sys
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence, TypeVar

import grpc
import numpy as np

from promptcache.contract import frames
from promptcache.client import errors
from promptcache.client.fallback import HOLD_SECONDS, retry_delay
from promptcache.client.transport import (BulkTransport, GetCall, PutCall, SharedFileTransport, StreamTransport,
                                          TransportChain)
from promptcache.contract.keys import ModelSpec
from promptcache.contract.layout import TORCH_DTYPES, all_finite, chunk_nbytes, chunk_shape, scanned
from promptcache.contract.shm import ClientBuffers
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import NAME_TO_DTYPE, TIER_NAMES, model_to_proto

if TYPE_CHECKING:  # torch loads on first use (a tensor passed in or returned), not with the client: admin commands
    import torch   # and health checks never need it

log = logging.getLogger("promptcache.client")
T = TypeVar("T")
KV = Sequence[tuple["torch.Tensor", "torch.Tensor"]]  # per layer (K, V), each [H, T, D] or [1, H, T, D]
BULK_RETRY_SECONDS = SHM_RETRY_SECONDS = HOLD_SECONDS  # a transport that failed is left alone this long (fallback)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class ChunkInfo:
    index: int
    key: bytes
    tier: str
    nbytes: int


@dataclass(frozen=True)
class LookupResult:
    cached_tokens: int
    chunk_tokens: int
    chunks: list[ChunkInfo]


@dataclass(frozen=True)
class PutResult:
    stored_chunks: int
    skipped_chunks: int
    rejected_chunks: int
    stored_bytes: int


def _tokens(tokens) -> list[int]:
    torch = sys.modules.get("torch")  # a tensor means torch is loaded already
    if torch is not None and isinstance(tokens, torch.Tensor):
        tokens = tokens.reshape(-1).tolist()
    elif isinstance(tokens, np.ndarray):
        tokens = tokens.reshape(-1).tolist()
    return list(tokens)


def _number(value) -> bool:
    """A finite real number, not a bool (numbers.Real: numpy's scalars too; an int beyond any float is not)."""
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        return False


def _whole(value) -> bool:
    """A whole number, not a bool (numbers.Integral: numpy's integers too)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_arguments(*, timeout, retries, backoff, frame_bytes, chunk_tokens, bulk_lent_cache_bytes) -> None:
    """PromptCacheClient's numbers, refused up front naming the argument (a frame_bytes of 0 failed inside gRPC's
    request stream as an unknown error; a NaN timeout reached gRPC)."""
    number, whole = _number, _whole
    for name, value, ok, what in (
            ("timeout", timeout, number(timeout) and timeout > 0, "a number of seconds above 0"),
            ("retries", retries, whole(retries) and retries >= 0, "a whole number, 0 or more"),
            ("backoff", backoff, number(backoff) and backoff >= 0, "a number of seconds, 0 or more"),
            ("frame_bytes", frame_bytes, whole(frame_bytes) and frame_bytes > 0, "a whole number of bytes above 0"),
            ("chunk_tokens", chunk_tokens, chunk_tokens is None or (whole(chunk_tokens) and chunk_tokens > 0
                                                                    and chunk_tokens & (chunk_tokens - 1) == 0),
             "None (the sidecar's) or a power of two"),
            ("bulk_lent_cache_bytes", bulk_lent_cache_bytes,
             whole(bulk_lent_cache_bytes) and bulk_lent_cache_bytes >= 0, "a whole number of bytes, 0 or more")):
        if not ok:
            raise ValueError(f"PromptCacheClient({name}=...) must be {what}, got {value!r}")


MAX_PRIORITY = (1 << 32) - 1  # PutHeader.priority is a uint32 (the sidecar reads every level above 1 as 1)


def _retention_hints(method: str, ttl_seconds, priority) -> tuple[float, int]:
    """A Put's retention hints (docs/retention.md) as PutHeader carries them, refused up front naming the argument:
    unchecked, a bad one failed inside the request stream (gRPC: UNKNOWN "Exception iterating requests!"; the bulk
    channel: protobuf's own TypeError or ValueError), after the chunks were encoded. None is the default of each:
    no hint (ttl_seconds 0, the sidecar's --ttl-seconds; priority 0). ttl_seconds may be inf ("as long as
    allowed"): the sidecar caps every hint at its --max-ttl-hint-seconds, as it refuses negative and NaN ones."""
    def shown(value) -> str:  # (an int past a double's range has hundreds of digits)
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"

    if ttl_seconds is None:
        ttl = 0.0
    else:
        try:
            ttl = float(ttl_seconds) if isinstance(ttl_seconds, numbers.Real) and not isinstance(ttl_seconds, bool) \
                else math.nan
        except OverflowError:  # an int past a double's range
            ttl = math.nan
        if not ttl >= 0:  # NaN compares false
            raise ValueError(f"PromptCacheClient.{method}(ttl_seconds=...) must be a number of seconds, 0 or more "
                             "(0 or None: the sidecar's --ttl-seconds; more than its --max-ttl-hint-seconds, inf "
                             f"included, is cut to it), got {shown(ttl_seconds)}")
    if priority is None:
        level = 0
    elif _whole(priority) and 0 <= priority <= MAX_PRIORITY:
        level = int(priority)
    else:
        raise ValueError(f"PromptCacheClient.{method}(priority=...) must be a whole number in 0..{MAX_PRIORITY} "
                         f"(0 or None: no pin; 1: pin the prefix, levels above 1 read as 1), got {shown(priority)}")
    return ttl, level


class PromptCacheClient:
    """Thread-safe; share one per process. Fork-safe: a child forked after the client was used opens bulk
    connections and shared-memory buffers of its own (the parent's stay the parent's, untouched).

    target: "HOST:PORT" or "unix:///path/to.sock". timeout: deadline of each call in seconds. retries: extra
    attempts after UNAVAILABLE (sidecar restarting), with jittered exponential backoff inside the deadline.

    Security (docs/security.md): tls_ca (PEM bytes or path; the CA that signed the sidecar's certificate) turns
    TLS on; tls_cert and tls_key add a client certificate (mTLS; its common name is the tenant); token or
    token_file (re-read when it changes) sends `authorization: Bearer ...` with every call; tls_server_name
    overrides the name checked against the server certificate.

    shm_dir: the sidecar's --shm-dir, as this process sees it; Put and Get bytes then pass through a shared-memory
    buffer per thread that the sidecar creates for this client (OpenSharedBuffer), streamed instead while the
    sidecar's per-tenant limits refuse one.

    bulk_address: the sidecar's --bulk-address (HOST:PORT or unix:/PATH); Get and Put then go over that plain
    socket (docs/bulk-channel.md), several times faster than gRPC for node-local clients. It has no TLS: with
    tls_ca set it is refused unless it is a unix socket. A sidecar without it falls back to gRPC. On a unix
    socket the bytes go through memfds unless bulk_shared_memory is False: the chunks' own, lent read-only by a
    sidecar with zero copy on (unless bulk_zero_copy is False; mappings kept for reuse, up to
    bulk_lent_cache_bytes, 0 for none), or one this client shares with the sidecar, which copies the chunks in.

    Put and Get try these transports in that order, bulk channel, shared memory, gRPC stream (whichever are
    configured; promptcache.client.transport), with one fallback policy (promptcache.client.fallback): a
    transport that cannot take a call is left alone for a few seconds, the next one serves it.
    """

    def __init__(self, target: str, *, timeout: float = 5.0, retries: int = 2, backoff: float = 0.05,
                 frame_bytes: int = 1 << 20, chunk_tokens: int | None = None, shm_dir: str | None = None,
                 channel: grpc.Channel | None = None, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                 tls_server_name: str | None = None, token: str | None = None, token_file: str | None = None,
                 bulk_address: str | None = None, bulk_shared_memory: bool = True,
                 bulk_zero_copy: bool = True, bulk_lent_cache_bytes: int = 512 << 20):
        _check_arguments(timeout=timeout, retries=retries, backoff=backoff, frame_bytes=frame_bytes,
                         chunk_tokens=chunk_tokens, bulk_lent_cache_bytes=bulk_lent_cache_bytes)
        self.target = target
        self.timeout = float(timeout)  # (numpy scalars are taken too: plain numbers from here on)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.frame_bytes = int(frame_bytes)
        chunk_tokens = None if chunk_tokens is None else int(chunk_tokens)
        bulk_lent_cache_bytes = int(bulk_lent_cache_bytes)
        if channel is None:
            from promptcache.client.credentials import client_channel

            channel = client_channel(target, root_certificates=tls_ca, client_cert=tls_cert, client_key=tls_key,
                                     server_name=tls_server_name, token=token, token_file=token_file)
        self._channel = channel
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._get = frames.get_callable(self._channel)  # data frames arrive as memoryviews, not copied
        self._chunk_tokens = chunk_tokens
        # Node-local fast path: chunk bytes go through shared memory in this folder (the sidecar's --shm-dir),
        # in buffers the sidecar creates for this client (docs/security.md).
        self._shm = ClientBuffers(shm_dir, self._open_shared_buffer, self._close_shared_buffer) if shm_dir else None
        self._bulk = None
        if bulk_address:
            from promptcache.client.bulk import BulkClient
            from promptcache.client.credentials import TokenSource

            if tls_ca is not None and not bulk_address.startswith("unix:"):
                raise ValueError(f"bulk_address {bulk_address} is TCP and the bulk channel has no TLS; with "
                                 "tls_ca use a unix socket (unix:/PATH) or no bulk_address")
            source = TokenSource(token, token_file) if (token or token_file) else None
            self._bulk = BulkClient(bulk_address, (lambda: f"Bearer {source.get()}") if source else (lambda: ""),
                                    shared_memory=bulk_shared_memory, zero_copy=bulk_zero_copy,
                                    lent_cache_bytes=bulk_lent_cache_bytes)
        transports = [BulkTransport(self._bulk)] if self._bulk is not None else []
        if self._shm is not None:
            transports.append(SharedFileTransport(self._shm, self._stub, self._call))
        transports.append(StreamTransport(self._stub, self._get, self._call, frame_bytes))
        self._transports = TransportChain(transports)
        _CLIENTS.add(self)

    def _after_fork_in_child(self) -> None:
        """In a child just forked: this process's own shared-memory buffers from now on. The inherited ones are the
        parent's (mapped MAP_SHARED, named by the parent's handles): used here, the sidecar would write the child's
        answers into the very buffer the parent's views are of, and the other way round. They are forgotten, not
        closed (closing would tell the sidecar to close the parent's). Locks a parent thread held at the fork are
        replaced (the bulk channel resets itself: promptcache.client.bulk)."""
        self._transports.policy.after_fork_in_child()
        if self._shm is not None:
            self._shm = ClientBuffers(self._shm.directory, self._open_shared_buffer, self._close_shared_buffer)
            for transport in self._transports.transports:
                if isinstance(transport, SharedFileTransport):
                    transport.buffers = self._shm

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()  # tells the sidecar, so before the channel goes
        self._channel.close()
        if self._bulk is not None:
            self._bulk.close()

    def __enter__(self) -> "PromptCacheClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[float], T], timeout: float | None = None, retryable=RETRYABLE) -> T:
        """Run fn(remaining_seconds) with retries on retryable codes, all inside one overall deadline."""
        deadline = time.monotonic() + (timeout or self.timeout)
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded(f"DEADLINE_EXCEEDED: no answer from {self.target} in time")
            try:
                return fn(remaining)
            except grpc.RpcError as exc:
                if exc.code() not in retryable or attempt >= self.retries:
                    raise errors.from_rpc_error(exc) from None
            attempt += 1
            time.sleep(retry_delay(attempt, self.backoff, deadline - time.monotonic(), random.uniform(0.5, 1.0)))

    @property
    def chunk_tokens(self) -> int:
        if self._chunk_tokens is None:
            self._chunk_tokens = self.stats().chunk_tokens
        return self._chunk_tokens

    # --- metadata RPCs ----------------------------------------------------------------------------------
    def lookup(self, spec: ModelSpec, tokens, timeout: float | None = None) -> LookupResult:
        req = pb.LookupRequest(model=model_to_proto(spec), tokens=_tokens(tokens))
        resp = self._call(lambda t: self._stub.Lookup(req, timeout=t), timeout)
        if resp.chunk_tokens > 0:  # (a sidecar answering 0 is broken: it must not undo what is known)
            self._chunk_tokens = resp.chunk_tokens
        return LookupResult(resp.cached_tokens, resp.chunk_tokens,
                            [ChunkInfo(c.index, c.key, TIER_NAMES.get(c.tier, "unknown"), c.nbytes)
                             for c in resp.chunks])

    def delete(self, spec: ModelSpec, tokens, start_chunk: int = 0) -> int:
        req = pb.DeleteRequest(model=model_to_proto(spec), tokens=_tokens(tokens), start_chunk=start_chunk)
        return self._call(lambda t: self._stub.Delete(req, timeout=t)).deleted_chunks

    def purge(self, spec: ModelSpec) -> tuple[int, int]:
        resp = self._call(lambda t: self._stub.Purge(pb.PurgeRequest(model=model_to_proto(spec)), timeout=t))
        return resp.deleted_chunks, resp.deleted_bytes

    def stats(self) -> pb.StatsResponse:
        return self._call(lambda t: self._stub.Stats(pb.StatsRequest(), timeout=t))

    def resize(self, memory_bytes: int, timeout: float | None = None) -> pb.ResizeResponse:
        """A shrink waits (within `timeout`) for Puts and Gets in flight to let go of their bytes, and raises
        DeadlineExceeded, leaving the budget as it was, when they do not in time."""
        return self._call(lambda t: self._stub.Resize(pb.ResizeRequest(memory_bytes=memory_bytes), timeout=t),
                          timeout)

    def export(self, max_bytes: int = 0, timeout: float | None = None) -> Iterator[bytes]:
        """The pieces of a snapshot file of what the sidecar holds, hottest first (admin; docs/warmup.md), at most
        `max_bytes` of chunk bytes (0: all), within one deadline (`timeout`, else the client's). Not retried: a
        failure part way raises (PromptCacheError), and a file cut short fails its verification."""
        call = self._stub.Export(pb.ExportRequest(max_bytes=max_bytes), timeout=timeout or self.timeout)
        try:
            for resp in call:
                yield resp.data
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None

    # --- shared memory ----------------------------------------------------------------------------------
    def _open_shared_buffer(self, length: int) -> pb.OpenSharedBufferResponse:
        req = pb.OpenSharedBufferRequest(length=length)
        # RESOURCE_EXHAUSTED here is the sidecar's limit on buffers: stream instead of waiting for it.
        return self._call(lambda t: self._stub.OpenSharedBuffer(req, timeout=t),
                          retryable=(grpc.StatusCode.UNAVAILABLE,))

    def _close_shared_buffer(self, handle: str) -> None:
        self._stub.CloseSharedBuffer(pb.CloseSharedBufferRequest(handle=handle), timeout=min(self.timeout, 1.0))

    # --- blobs ------------------------------------------------------------------------------------------
    def put_blobs(self, spec: ModelSpec, tokens, blobs: Mapping[int, torch.Tensor | bytes],
                  timeout: float | None = None, ttl_seconds: float | None = 0.0,
                  priority: int | None = 0) -> PutResult:
        """Store raw chunk blobs (already in the stored layout) under the chunk indices of `tokens`.
        ttl_seconds: a retention hint, how long after its last hit each chunk is worth keeping, a number of seconds,
        0 or more (0 or None: the sidecar's --ttl-seconds; capped by its --max-ttl-hint-seconds; docs/retention.md).
        priority 1: pin the prefix (capacity eviction passes it over), within the sidecar's --max-pinned-fraction
        for this caller; a whole number in 0..2**32-1 (0 or None: none; levels above 1 read as 1). A hint out of
        range raises ValueError naming it, before anything is sent."""
        ttl_seconds, priority = _retention_hints("put_blobs", ttl_seconds, priority)
        token_list = _tokens(tokens)
        shape = list(chunk_shape(spec, self.chunk_tokens))
        dtype = NAME_TO_DTYPE[spec.kv_dtype]
        arrays = {i: _as_bytes_array(b) for i, b in sorted(blobs.items())}
        resp = self._transports.put(PutCall(spec, token_list, arrays, shape, dtype, timeout or self.timeout,
                                             ttl_seconds, priority))
        return PutResult(resp.stored_chunks, resp.skipped_chunks, resp.rejected_chunks, resp.stored_bytes)

    def get_blobs(self, spec: ModelSpec, tokens, start_chunk: int = 0, max_chunks: int = 0,
                  timeout: float | None = None, copy: bool = True, keep_sealed: bool = False) -> list[torch.Tensor]:
        """The longest run of cached chunk blobs from start_chunk on, each verified against its checksum.

        With shared memory and copy=False the blobs are zero-copy views of this thread's shared buffer, valid
        until this thread's next call: decode them at once (as get() does). With copy and keep_sealed, chunks
        the sidecar lent come back as the read-only mappings they are (bulk.is_sealed: they never change, so
        they stay valid without a copy); writing into one is a segmentation fault."""
        blobs, owned = self._get_blobs(spec, tokens, start_chunk, max_chunks, timeout, owned=copy)
        if owned or not blobs or not copy:
            return blobs
        from promptcache.client.bulk import is_sealed

        copied = [i for i, b in enumerate(blobs) if not (keep_sealed and is_sealed(b))]
        if not copied:
            return blobs
        # Views of a reused buffer are copied out (one copy, one allocation) before the next call reuses it.
        sizes = [blobs[i].numel() for i in copied]
        out = np.empty(sum(sizes), dtype=np.uint8)
        pos = 0
        for i, n in zip(copied, sizes):
            out[pos:pos + n] = blobs[i].numpy()
            pos += n
        blobs = list(blobs)
        import torch

        for i, part in zip(copied, torch.from_numpy(out).split(sizes)):
            blobs[i] = part
        return blobs

    def _get_blobs(self, spec, tokens, start_chunk, max_chunks, timeout,
                   owned: bool = False) -> tuple[list[torch.Tensor], bool]:
        """(blobs as get_blobs, whether the caller owns them). Unless owned, with shared memory or the bulk
        channel the blobs may be views of this thread's buffer, valid until its next call: decode or copy them
        at once. `owned` asks for owned blobs where they cost no extra copy."""
        token_list = _tokens(tokens)
        req = pb.GetRequest(model=model_to_proto(spec), tokens=token_list, start_chunk=start_chunk,
                            max_chunks=max_chunks)
        # What the request allows its answer: the transports refuse more as it arrives. A chain without a sized
        # transport does not ask the sidecar for its chunk size up front (a Stats call) just for this.
        ct = self.chunk_tokens if self._transports.sized else self._chunk_tokens
        chunks, chunk_bytes = self._answer_bounds(spec, token_list, start_chunk, max_chunks, ct)
        nbytes = chunks * chunk_bytes if self._transports.sized else None
        blobs, owned = self._transports.get(GetCall(req, timeout or self.timeout, owned, nbytes, chunks, chunk_bytes))
        if blobs:
            if chunks is None:
                chunks, chunk_bytes = self._answer_bounds(spec, token_list, start_chunk, max_chunks, self.chunk_tokens)
            # Every transport checks this as the answer arrives; this is the one place all of them pass.
            if len(blobs) > chunks:
                raise errors.CorruptChunk(f"the sidecar answered {len(blobs)} chunks; the request allows {chunks}")
            for i, blob in enumerate(blobs):
                if blob.numel() != chunk_bytes:
                    raise errors.CorruptChunk(f"chunk {start_chunk + i} has {blob.numel()} bytes; this model's "
                                              f"chunks have {chunk_bytes}")
        return blobs, owned

    @staticmethod
    def _answer_bounds(spec: ModelSpec, token_list: list[int], start_chunk: int, max_chunks: int,
                       ct: int | None) -> tuple[int | None, int | None]:
        """(most chunks the request allows, each chunk's exact bytes) for chunks of `ct` tokens; (None, None)
        while `ct` is not known, (0, 0) where it is 0 (no chunk can be asked for)."""
        if ct is None:
            return None, None
        if ct <= 0:
            return 0, 0
        n = len(token_list) // ct - start_chunk
        n = min(n, max_chunks) if max_chunks else n
        return max(n, 0), chunk_nbytes(spec, ct)

    # --- tensors ----------------------------------------------------------------------------------------
    def put(self, spec: ModelSpec, tokens, kv: KV, start_chunk: int = 0, timeout: float | None = None,
            rope_theta: float = 0.0, ttl_seconds: float | None = 0.0, priority: int | None = 0) -> PutResult:
        """Store every whole chunk of `kv` (covering `tokens`) from start_chunk on. rope_theta: see encode_chunk.
        ttl_seconds, priority: retention hints (put_blobs), checked before any chunk is encoded."""
        ttl_seconds, priority = _retention_hints("put", ttl_seconds, priority)
        ct = self.chunk_tokens
        n_chunks = min(len(_tokens(tokens)), _kv_tokens(kv)) // ct
        blobs = {i: encode_chunk(spec, kv, i * ct, (i + 1) * ct, rope_theta) for i in range(start_chunk, n_chunks)}
        if not blobs:
            return PutResult(0, 0, 0, 0)
        return self.put_blobs(spec, tokens, blobs, timeout, ttl_seconds, priority)

    def get(self, spec: ModelSpec, tokens, start_chunk: int = 0, max_chunks: int = 0,
            device: torch.device | str = "cpu", timeout: float | None = None) -> tuple[int, list]:
        """(cached_tokens, per-layer [(K, V)] each [1, H, cached_tokens, D]) of the longest cached prefix."""
        blobs, _ = self._get_blobs(spec, tokens, start_chunk, max_chunks, timeout)
        if not blobs:
            return 0, []
        return len(blobs) * self.chunk_tokens, decode_chunks(spec, blobs, self.chunk_tokens, device)

    def healthy(self, timeout: float = 1.0) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


_CLIENTS: "weakref.WeakSet[PromptCacheClient]" = weakref.WeakSet()  # this process's clients, for the at-fork hook


def _after_fork_in_child() -> None:
    for client in list(_CLIENTS):
        client._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _as_bytes_array(blob: torch.Tensor | bytes) -> np.ndarray:
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return np.frombuffer(blob, dtype=np.uint8)
    import torch

    return blob.detach().reshape(-1).view(torch.uint8).cpu().numpy()


def _kv_tokens(kv: KV) -> int:
    return kv[0][0].shape[-2]


def encode_chunk(spec: ModelSpec, kv: KV, start: int, stop: int, rope_theta: float = 0.0) -> torch.Tensor:
    """Tokens [start, stop) of every layer's K and V as one stored blob (1-D uint8, on the CPU)."""
    import torch

    if spec.kv_kind != "kv":
        raise ValueError(f"{spec.kv_kind} chunks hold no K and V: put them as blobs (put_blobs)")
    if len(kv) != spec.num_layers:
        raise ValueError(f"kv has {len(kv)} layers, the model spec says {spec.num_layers}")
    dtype = TORCH_DTYPES[spec.kv_dtype]
    expected = (spec.num_kv_heads, spec.head_dim)
    for layer, (k, v) in enumerate(kv):
        for name, t in (("K", k), ("V", v)):
            if t.dtype != dtype:
                raise ValueError(f"layer {layer} {name} has dtype {t.dtype}, the model spec says {dtype}")
            if (t.shape[-3], t.shape[-1]) != expected or (t.dim() == 4 and t.shape[0] != 1) or t.dim() not in (3, 4):
                raise ValueError(f"layer {layer} {name} has shape {tuple(t.shape)}; expected [1, "
                                 f"{spec.num_kv_heads}, tokens, {spec.head_dim}] or without the batch dim")
    chunk = torch.stack([torch.stack((k.reshape(k.shape[-3:])[:, start:stop], v.reshape(v.shape[-3:])[:, start:stop]))
                         for k, v in kv]).cpu()
    if spec.quantization == "none":
        return chunk.contiguous().view(torch.uint8).reshape(-1)
    from promptcache import codec  # (torch-heavy quantizers: loaded only for quantized models)

    return codec.pack(spec.quantization, chunk, rope_theta)


def decode_chunk(spec: ModelSpec, index: int, blob: torch.Tensor, expected: int, shape, dtype) -> torch.Tensor:
    """One stored chunk blob as its canonical tensor [layers, 2, kv_heads, chunk_tokens, head_dim]: a view for
    unquantized chunks, dequantized otherwise. CorruptChunk when its length or its quantization checks fail."""
    if blob.numel() != expected:
        raise errors.CorruptChunk(f"chunk {index} has {blob.numel()} bytes; this model's layout needs {expected}")
    if spec.quantization == "none":
        return blob.view(dtype).reshape(shape)
    from promptcache import codec

    try:
        return codec.unpack(spec.quantization, blob, shape, spec.kv_dtype)
    except codec.CorruptChunk as exc:
        raise errors.CorruptChunk(f"chunk {index}: {exc}") from None


def checked_chunks(spec: ModelSpec, blobs: Sequence[torch.Tensor], chunk_tokens: int) -> list[torch.Tensor]:
    """Blobs of consecutive chunks -> their canonical tensors [layers, 2, kv_heads, chunk_tokens, head_dim] (views
    of the blobs when unquantized: no copy), each checked: its length, then finite values (unquantized floats; one read
    pass, skipped for a lent chunk the sidecar vouched for or this process found finite before; fp8: raw bytes, not
    scanned) or the quantized
    format's checks.
    CorruptChunk on the first bad one."""
    from promptcache.client.bulk import known_finite, mark_finite

    shape = chunk_shape(spec, chunk_tokens)
    expected = chunk_nbytes(spec, chunk_tokens)
    dtype = TORCH_DTYPES[spec.kv_dtype]
    chunks = []
    for i, blob in enumerate(blobs):
        chunk = decode_chunk(spec, i, blob, expected, shape, dtype)
        if spec.quantization == "none" and scanned(spec.kv_dtype) and not known_finite(blob):
            if not all_finite(chunk):
                raise errors.CorruptChunk(f"chunk {i} has NaN or Inf values")
            mark_finite(blob)
        chunks.append(chunk)
    return chunks


def decode_chunks(spec: ModelSpec, blobs: Sequence[torch.Tensor], chunk_tokens: int,
                  device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Blobs of consecutive chunks -> per-layer (K, V), each [1, H, len(blobs) * chunk_tokens, D]."""
    import torch

    if spec.kv_kind != "kv":
        raise ValueError(f"{spec.kv_kind} chunks hold no K and V: get them as blobs (get_blobs, checked_chunks)")
    shape = chunk_shape(spec, chunk_tokens)
    expected = chunk_nbytes(spec, chunk_tokens)
    dtype = TORCH_DTYPES[spec.kv_dtype]
    chunks = []
    for i, blob in enumerate(blobs):
        chunks.append(decode_chunk(spec, i, blob, expected, shape, dtype))
    # [C, L, 2, H, Tc, D] -> [L, 2, H, C*Tc, D]: one copy, then per-layer views.
    stacked = torch.stack(chunks).to(device)
    c, layers, _, heads, tc, dim = stacked.shape
    merged = stacked.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, c * tc, dim)
    return [(merged[layer, 0].unsqueeze(0), merged[layer, 1].unsqueeze(0)) for layer in range(layers)]
