"""One exception type per failure kind, so callers can decide: fall back, retry later, or fix the request."""
from __future__ import annotations

import grpc


class PromptCacheError(Exception):
    """Base of every client error. `code` is the gRPC status code, when the server sent one."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class Unavailable(PromptCacheError):
    """The sidecar cannot be reached (down, restarting, wrong address). Fall back to full prefill."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PromptCacheError):
    """The call did not finish within its deadline. Fall back to full prefill."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InvalidArgument(PromptCacheError):
    """The request was malformed; the message names what was wrong. Retrying will not help."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(PromptCacheError):
    """The chunk is too large for the sidecar's limits or budget."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class CorruptChunk(PromptCacheError):
    """Bytes failed verification (checksum, length, scales). They never reach the model."""
    code = grpc.StatusCode.DATA_LOSS


class FailedPrecondition(PromptCacheError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(PromptCacheError):
    """A shared-memory buffer the sidecar no longer knows (restarted, or closed it when idle)."""
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(PromptCacheError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(PromptCacheError):
    code = grpc.StatusCode.PERMISSION_DENIED


BY_CODE = {cls.code: cls for cls in (Unavailable, DeadlineExceeded, InvalidArgument, ResourceExhausted,
                                      CorruptChunk, FailedPrecondition, NotFound, Unauthenticated,
                                      PermissionDenied)}


# grpc.StatusCode by its numeric value, as the bulk channel's status frames carry it.
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def from_status(value: int, message: str) -> PromptCacheError:
    code = STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
    return BY_CODE.get(code, PromptCacheError)(f"{code.name}: {message}", code)


def from_rpc_error(exc: grpc.RpcError) -> PromptCacheError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = BY_CODE.get(code, PromptCacheError)
    return cls(f"{code.name if code else 'UNKNOWN'}: {details}", code)


def check_chunk_within(c, received: int, max_chunks: int | None, chunk_bytes: int | None) -> None:
    """CorruptChunk unless chunk frame `c` (a ChunkBegin), after `received` chunks, is one the request allows: at
    most `max_chunks` chunks, each of exactly `chunk_bytes` (None: not checked). Every transport checks this before
    a chunk's bytes are taken, so an answer can never make a client read more than it asked for."""
    if max_chunks is not None and received >= max_chunks:
        raise CorruptChunk(f"chunk {c.index} is past the {max_chunks} chunks asked for")
    if chunk_bytes is not None and c.nbytes != chunk_bytes:
        raise CorruptChunk(f"chunk {c.index} announces {c.nbytes} bytes; this model's chunks have {chunk_bytes}")
