"""The cache's own errors. Each carries the name of the gRPC status convention that fits it (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, ...), so every transport answers the same refusal the same way: the gRPC servicer maps the
name onto grpc.StatusCode, the bulk channel onto its status frame. Nothing here imports grpc."""
from __future__ import annotations

# The most UTF-8 bytes of a refusal's message. A message may quote what the client sent (a model field, a name),
# and gRPC carries it in the grpc-message trailer, percent-encoded (up to 3 bytes a byte): a client's default
# limit on metadata is 8 KiB (soft) and 16 KiB (hard), past which it sees RESOURCE_EXHAUSTED "received metadata
# size exceeds ..." instead of the refusal (a 3 MB field quoted back did so). 2 KiB stays within it however
# encoded, and is longer than any message of ours without a client's string in it.
MAX_MESSAGE_BYTES = 2048


def bounded_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message`, at most `limit` UTF-8 bytes: a longer one keeps its start and its end (what was wrong, and the
    explanation after the quote) with a note of how many characters were cut from the middle."""
    data = message.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return message
    room = limit - 64  # the note: " ...[N characters cut]... " with N up to 20 digits
    head = data[:room * 2 // 3].decode("utf-8", "ignore")  # (a character cut in two is dropped)
    tail = data[len(data) - (room - room * 2 // 3):].decode("utf-8", "ignore")
    return f"{head} ...[{len(message) - len(head) - len(tail)} characters cut]... {tail}"


class CacheError(Exception):
    """A refusal of a request, with a message that names what was wrong (at most MAX_MESSAGE_BYTES: a longer
    one, quoting what a client sent, is cut)."""

    status = "INTERNAL"

    def __init__(self, message: str):
        message = bounded_message(message)
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
