"""One call to the sidecar, whichever transport carries it: gRPC (server.py, behind guard.Guard) or the bulk
channel (bulk.py). A `Call` holds what both must apply alike: the caller's identity and its per-client limit
(--max-calls-per-client), whether its credentials are still valid (a token removed from the token file stops
working on open connections too), the mapping of the engine's errors onto a status code, and the call's metrics
(promptcache_requests_total{rpc,code} and its latency), counted once when it ends. Deadlines are the watchdog's
(limits.Watchdog) for both; only how a call is cut off differs by transport."""
from __future__ import annotations

import logging
import time

import grpc

from promptcache.sidecar.errors import CacheError
from promptcache.sidecar.identity import Caller, client_key

log = logging.getLogger("promptcache.sidecar")


def status_of(exc: BaseException, rpc: str) -> tuple[grpc.StatusCode, str]:
    """The status a failure is answered with: the engine's own errors carry theirs; anything else is a bug,
    logged with its traceback and answered INTERNAL (naming only the exception's type)."""
    if isinstance(exc, CacheError):
        return grpc.StatusCode[exc.status], exc.message
    log.exception("unexpected error in %s", rpc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {rpc}: {type(exc).__name__}"


class CallRefused(CacheError):
    """A call refused before it reached the engine (credentials, the per-client limit)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.status = code.name


def too_many_calls(limit: int) -> CallRefused:
    return CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many calls in flight from this client (at most "
                       f"{limit}, --max-calls-per-client); retry later")


class Call:
    """Use as a context manager around the call's work; set the outcome with fail() (or leave it OK)."""

    def __init__(self, rpc: str, metrics, caller: Caller | None = None, limiter=None):
        self.rpc, self.metrics, self.caller, self.limiter = rpc, metrics, caller, limiter
        self.code, self.message = grpc.StatusCode.OK, ""
        self._client: str | None = None
        self._start = 0.0
        self._ended = False

    def __enter__(self) -> "Call":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def admit(self) -> None:
        """Take one of the caller's --max-calls-per-client (CallRefused when none is left)."""
        if self.limiter is None or self.caller is None:
            return
        client = client_key(self.caller.identity, self.caller.peer)
        if not self.limiter.acquire(client):
            raise too_many_calls(self.limiter.max_per_client)
        self._client = client

    def fail(self, exc: BaseException) -> None:
        self.code, self.message = status_of(exc, self.rpc)

    def end(self) -> None:
        """Count the call (its status, its latency) and give back its slot; idempotent."""
        if self._ended:
            return
        self._ended = True
        if self._client is not None:
            self.limiter.release(self._client)
        self.metrics.latency.labels(self.rpc).observe(time.perf_counter() - self._start)
        self.metrics.requests.labels(self.rpc, self.code.name).inc()
