"""The client's one fallback policy: after a transport failed, what next (promptcache.client.transport).

The transports form a chain, fastest first, ending with the gRPC stream, which can carry every call. A failure
is one of three things:

  * the transport cannot take the call (the sidecar has no bulk channel, it is restarting or at a limit, the
    connection broke; it refused a shared buffer): fall back to the next transport, and leave this one alone
    for HOLD_SECONDS, so that a sidecar without it costs nothing on every call;
  * a shared buffer the sidecar no longer knows (it restarted, or closed the buffer after --shm-idle-seconds
    unused): the transport replaces it and the call is tried once more on the same transport;
  * anything else is the call's answer (the sidecar refused the chunks, the deadline passed, a chunk failed its
    checksum): raised as it is, never retried on another transport.

What falls back, by transport and operation:

  bulk   put: Unavailable                       get: Unavailable, ResourceExhausted
  shm    put, get: a buffer refused (Refused)   NotFound: once more with a new buffer, then raised
  grpc   never: its retries are PromptCacheClient._call's (retry_delay), inside the call's deadline

A put refused with ResourceExhausted over the bulk channel is the put's answer (the same gRPC Put would give); a
get refused so (--max-large-requests) is served over gRPC instead. `decide` is the table above, a pure
function; FallbackPolicy adds the clock and the hold times.
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from promptcache.client import errors

BULK, SHM, GRPC = "bulk", "shm", "grpc"  # the transports' names
PUT, GET = "put", "get"
HOLD_SECONDS = 5.0  # a transport that could not take a call is not tried again for this long


class Refused(Exception):
    """The transport could not get ready for the call before anything was sent (the sidecar refused a shared
    buffer: its per-tenant limits, or a file that is not the buffer it named); `cause` says why."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class Action(enum.Enum):
    RAISE = "raise"          # the call's answer: raise it
    RETRY = "retry"          # the same transport again, after its reset()
    FALL_BACK = "fall back"  # the next transport; this one is held


@dataclass(frozen=True)
class Decision:
    action: Action
    hold_seconds: float = 0.0  # FALL_BACK: how long the failed transport is left alone


RAISE = Decision(Action.RAISE)
RETRY = Decision(Action.RETRY)
FALL_BACK = Decision(Action.FALL_BACK, HOLD_SECONDS)


def decide(transport: str, op: str, error: BaseException, attempt: int = 0) -> Decision:
    """What to do after `transport` failed `op` (PUT or GET) with `error`, on its `attempt`-th try of this call
    (0: the first). The table in the module's docstring."""
    if isinstance(error, Refused):
        return FALL_BACK
    if transport == BULK:
        if isinstance(error, errors.Unavailable) or (op == GET and isinstance(error, errors.ResourceExhausted)):
            return FALL_BACK
    elif transport == SHM:
        if isinstance(error, errors.NotFound) and attempt == 0:
            return RETRY
    return RAISE


def first_usable(chain: Sequence[str], held_until: Mapping[str, float], now: float, start: int = 0) -> int:
    """Index of the first transport of `chain`, from `start` on, that is not held at `now`; the last transport
    (the gRPC stream) is used even when held, so every call has one."""
    for i in range(start, len(chain) - 1):
        if now >= held_until.get(chain[i], 0.0):
            return i
    return len(chain) - 1


def retry_delay(attempt: int, backoff: float, remaining: float, jitter: float) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, ...) of a gRPC call that failed with a retryable
    code: exponential from `backoff`, scaled by `jitter` (drawn from [0.5, 1]), never past the `remaining`
    seconds of the call's deadline."""
    return min(backoff * (2 ** attempt) * jitter, max(0.0, remaining))


class FallbackPolicy:
    """`decide` with state: which transports are held, until when (on `clock`). Thread-safe; shared by every
    call of one client, Put and Get alike (a bulk channel that failed a put is not used for gets either)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._held_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        """A new lock in a child just forked: a parent thread may have held this one at the fork (never released
        there: every call would wait forever)."""
        self._lock = threading.Lock()

    def first(self, chain: Sequence[str], start: int = 0) -> int:
        """Index of the transport of `chain` to try, from `start` on."""
        with self._lock:
            return first_usable(chain, self._held_until, self.clock(), start)

    def failed(self, transport: str, op: str, error: BaseException, attempt: int = 0) -> Decision:
        """The decision for this failure; a FALL_BACK holds `transport` from now on."""
        decision = decide(transport, op, error, attempt)
        if decision.action is Action.FALL_BACK:
            with self._lock:
                self._held_until[transport] = self.clock() + decision.hold_seconds
        return decision

    def held_until(self, transport: str) -> float:
        """When `transport` may be tried again (0: it is not held)."""
        with self._lock:
            return self._held_until.get(transport, 0.0)
