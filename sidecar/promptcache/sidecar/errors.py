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


# One class a refusal kind, named for what went wrong; `status` is the gRPC convention's name for it.
class InvalidRequest(CacheError): status = "INVALID_ARGUMENT"  # noqa: E701
class NotServed(CacheError): status = "FAILED_PRECONDITION"  # noqa: E701 - well formed, but a flag rules it out
class PermissionDenied(CacheError): status = "PERMISSION_DENIED"  # noqa: E701
class NoCapacity(CacheError): status = "RESOURCE_EXHAUSTED"  # noqa: E701 - a limit or the budget; retry later
class NotFound(CacheError): status = "NOT_FOUND"  # noqa: E701
class DataLoss(CacheError): status = "DATA_LOSS"  # noqa: E701
class TimedOut(CacheError): status = "DEADLINE_EXCEEDED"  # noqa: E701
class Cancelled(CacheError): status = "CANCELLED"  # noqa: E701
