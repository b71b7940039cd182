"""The cache's own errors. Each carries the name of the gRPC status convention that fits it (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, ...), so every transport answers the same refusal the same way: the gRPC servicer maps the
name onto grpc.StatusCode, the bulk channel onto its status frame. Nothing here imports grpc."""
from __future__ import annotations


class CacheError(Exception):
    """A refusal of a request, with a message that names what was wrong."""

    status = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(CacheError):
    status = "INVALID_ARGUMENT"


class NotServed(CacheError):
    """The request is well formed but this sidecar is not set up for it (a flag decides)."""
    status = "FAILED_PRECONDITION"


class PermissionDenied(CacheError):
    status = "PERMISSION_DENIED"


class NoCapacity(CacheError):
    """A limit or the budget refuses it now; a retry later may succeed."""
    status = "RESOURCE_EXHAUSTED"


class NotFound(CacheError):
    status = "NOT_FOUND"


class DataLoss(CacheError):
    status = "DATA_LOSS"


class TimedOut(CacheError):
    status = "DEADLINE_EXCEEDED"


class Cancelled(CacheError):
    status = "CANCELLED"
