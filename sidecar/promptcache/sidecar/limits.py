"""Per-call limits, so that clients that open streams and stall cannot starve the others.

* `CallLimiter`: at most N calls in flight per client (the authenticated tenant, or the peer address when
  auth is off); the next one is refused at once with RESOURCE_EXHAUSTED instead of taking a worker thread.
* `Watchdog`: one thread that cancels calls that run longer than --max-call-seconds, and streams idle for
  --stream-idle-seconds: a Put whose client sent nothing, a Get whose client stopped reading. A cancelled Put
  releases its reservation (nothing partial is stored); a cancelled Get releases its lease. The client sees
  DEADLINE_EXCEEDED with a message naming the limit.
* The watchdog also cancels a Put that holds a memory reservation but sends less than
  --min-put-bytes-per-second, averaged over --put-rate-window-seconds: each byte is progress, so the idle limit
  alone lets a client that trickles one byte every few seconds keep its reservation for --max-call-seconds.
* `ReservedBytes`: what the Puts of one client hold reserved at once (--max-put-reserved-fraction).
* `LargeRequests`: how many requests of more than LARGE_REQUEST_TOKENS tokens are processed at once
  (--max-large-requests).
* `Guard`: the server interceptor that applies authentication (promptcache.sidecar.auth) and the limits to
  every method except the health service.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Iterator

import grpc

from promptcache.sidecar.auth import HEALTH_PREFIX, Authenticator, Identity, attach_identity

log = logging.getLogger("promptcache.sidecar.limits")
LARGE_REQUEST_TOKENS = 1 << 16  # a request with more tokens than this needs one of --max-large-requests
_WATCH_ATTR = "_promptcache_watch"


class CallRejected(Exception):
    """A refusal with a gRPC status, raised below the service layer (the service maps it like its own)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class CallLimiter:
    def __init__(self, max_per_client: int):
        self.max_per_client = max_per_client
        self._lock = threading.Lock()
        self._active: dict[str, int] = defaultdict(int)

    def acquire(self, client: str) -> bool:
        if self.max_per_client <= 0:
            return True
        with self._lock:
            if self._active[client] >= self.max_per_client:
                return False
            self._active[client] += 1
            return True

    def release(self, client: str) -> None:
        if self.max_per_client <= 0:
            return
        with self._lock:
            self._active[client] -= 1
            if self._active[client] <= 0:
                del self._active[client]

    def active(self, client: str) -> int:
        with self._lock:
            return self._active.get(client, 0)


class ReservedBytes:
    """Bytes reserved by each client's Puts in flight. A client may always hold one chunk; beyond that, no more
    than `limit` bytes together, so that one client's slow or stalled Puts cannot hold the whole budget."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[str, int] = defaultdict(int)

    def hold(self, client: str, nbytes: int, limit: int) -> bool:
        with self._lock:
            held = self._held.get(client, 0)
            if held and held + nbytes > limit:
                return False
            self._held[client] = held + nbytes
            return True

    def release(self, client: str, nbytes: int) -> None:
        with self._lock:
            self._held[client] -= nbytes
            if self._held[client] <= 0:
                del self._held[client]

    def held(self, client: str) -> int:
        with self._lock:
            return self._held.get(client, 0)


class LargeRequests:
    """At most `limit` large requests (more than LARGE_REQUEST_TOKENS tokens) at once; the next is refused."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self.active = 0

    def acquire(self) -> bool:
        with self._lock:
            if self.active >= self.limit:
                return False
            self.active += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.active -= 1

    def refusal(self, what: str) -> CallRejected:
        return CallRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{what}: {self.limit} requests of more than {LARGE_REQUEST_TOKENS} tokens are already "
                            "being served (--max-large-requests); retry later")


class _Watch:
    __slots__ = ("context", "rpc", "started", "last", "idle", "max_seconds", "expired", "reason",
                 "holding", "received", "window_start", "window_received")

    def __init__(self, context, rpc: str, max_seconds: float, idle: float):
        self.context = context
        self.rpc = rpc
        self.started = self.last = time.monotonic()
        self.max_seconds = max_seconds
        self.idle = idle          # 0: no idle limit (unary calls, Get)
        self.expired = False
        self.reason = ""
        self.holding = 0            # bytes of memory reservation the call holds (a Put receiving a chunk)
        self.received = 0           # bytes received while holding one
        self.window_start = 0.0
        self.window_received = 0

    def touch(self) -> None:
        self.last = time.monotonic()

    def hold(self, nbytes: int) -> None:
        """The call now holds a reservation of `nbytes` (0: none): the minimum rate applies while it does."""
        if nbytes and not self.holding:
            self.window_start, self.window_received = time.monotonic(), self.received
        self.holding = nbytes

    def progress(self, nbytes: int) -> None:
        self.received += nbytes


def attach_watch(context, w: _Watch) -> None:
    setattr(context, _WATCH_ATTR, w)


def watch_of(context) -> _Watch | None:
    """The watchdog's record of this call (None when no Guard watches it)."""
    return getattr(context, _WATCH_ATTR, None)


def _cancel(context, code: grpc.StatusCode, details: str) -> None:
    """Cancel a server-side call from another thread, sending `code` and `details` to the client.

    grpc's public ServicerContext.cancel() always sends CANCELLED; the underlying call object accepts a status
    (grpcio 1.85). Fall back to the public API if that ever changes.
    """
    try:
        from grpc._cython import cygrpc

        context._rpc_event.call.cancel(getattr(cygrpc.StatusCode, code.name.lower()), details)
    except Exception:  # noqa: BLE001
        context.cancel()


class Watchdog:
    def __init__(self, max_call_seconds: float, stream_idle_seconds: float, on_expire=None,
                 min_put_bytes_per_second: int = 0, put_rate_window_seconds: float = 10.0):
        """on_expire(rpc, limit) is called for every call cancelled, limit being "idle", "duration" or "rate"."""
        self.max_call_seconds = max_call_seconds
        self.stream_idle_seconds = stream_idle_seconds
        self.min_rate = min_put_bytes_per_second
        self.rate_window = put_rate_window_seconds
        self.on_expire = on_expire or (lambda rpc, reason: None)
        self._lock = threading.Lock()
        self._watches: set[_Watch] = set()
        self._stop = threading.Event()
        limits = [s for s in (max_call_seconds, stream_idle_seconds,
                              put_rate_window_seconds if min_put_bytes_per_second else 0) if s > 0]
        self.tick = min([0.25] + [s / 4 for s in limits])
        self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
        self._thread.start()

    def watch(self, context, rpc: str, idle: bool) -> _Watch:
        w = _Watch(context, rpc, self.max_call_seconds, self.stream_idle_seconds if idle else 0.0)
        with self._lock:
            self._watches.add(w)
        return w

    def unwatch(self, w: _Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                due = []
                for w in self._watches:
                    if w.max_seconds > 0 and now - w.started > w.max_seconds:
                        w.reason = (f"{w.rpc} ran longer than {w.max_seconds:g} s (--max-call-seconds); "
                                    "cancelled, nothing partial was stored")
                    elif w.idle > 0 and now - w.last > w.idle:
                        w.reason = (f"{w.rpc} stream made no progress for {w.idle:g} s (--stream-idle-seconds: "
                                    "the client sent or read nothing); cancelled, nothing partial was stored")
                    elif not self._too_slow(w, now):
                        continue
                    due.append(w)
                for w in due:
                    self._watches.discard(w)
            for w in due:
                w.expired = True
                log.warning("cancelled a call", extra={"rpc": w.rpc, "reason": w.reason})
                self.on_expire(w.rpc, "duration" if "--max-call-seconds" in w.reason
                               else "rate" if "--min-put-bytes-per-second" in w.reason else "idle")
                _cancel(w.context, grpc.StatusCode.DEADLINE_EXCEEDED, w.reason)

    def _too_slow(self, w: _Watch, now: float) -> bool:
        """Under the lock: whether `w` held a reservation for a whole window while receiving less than the
        minimum rate over it (then w.reason says so); a window that passes starts the next one."""
        if not self.min_rate or not w.holding or now - w.window_start < self.rate_window:
            return False
        got = w.received - w.window_received
        elapsed = now - w.window_start
        if got >= self.min_rate * elapsed:
            w.window_start, w.window_received = now, w.received
            return False
        w.reason = (f"{w.rpc} received {got} bytes in {elapsed:.1f} s while holding a reservation of {w.holding} "
                    f"bytes, less than --min-put-bytes-per-second ({self.min_rate}); cancelled, the reservation "
                    "released, nothing partial was stored")
        return True

    def stop(self) -> None:
        self._stop.set()


class _WatchedRequests:
    """A request iterator that tells the watchdog each time a frame arrives."""

    def __init__(self, inner: Iterator, watch: _Watch):
        self._inner = inner
        self._watch = watch

    def __iter__(self):
        return self

    def __next__(self):
        try:
            item = next(self._inner)
        except grpc.RpcError:
            if self._watch.expired:
                raise CallRejected(grpc.StatusCode.DEADLINE_EXCEEDED, self._watch.reason) from None
            raise CallRejected(grpc.StatusCode.CANCELLED, "the client cancelled the call") from None
        except StopIteration:
            # A call the watchdog cancelled may see its request stream simply end: that is still the watchdog's
            # cancellation, not a client that stopped mid-chunk (which the method would call INVALID_ARGUMENT).
            if self._watch.expired:
                raise CallRejected(grpc.StatusCode.DEADLINE_EXCEEDED, self._watch.reason) from None
            raise
        self._watch.touch()
        return item


def client_key(identity: Identity, peer: str) -> str:
    """Who a call counts against: the authenticated tenant, or the peer address (a connection) without auth."""
    return f"tenant:{identity.tenant}" if not identity.anonymous else f"peer:{peer}"


def _method_name(full: str) -> str:
    return full.rsplit("/", 1)[-1]


class Guard(grpc.ServerInterceptor):
    """Authentication, per-client call limit and the watchdog around every method but health."""

    def __init__(self, authenticator: Authenticator, limiter: CallLimiter, watchdog: Watchdog, metrics=None):
        self.authenticator = authenticator
        self.limiter = limiter
        self.watchdog = watchdog
        self.metrics = metrics

    def _refuse(self, context, rpc: str, code: grpc.StatusCode, message: str):
        if self.metrics is not None:
            self.metrics.requests.labels(rpc, code.name).inc()
        context.abort(code, message)

    def _admit(self, context, rpc: str) -> tuple[Identity, str]:
        identity = self.authenticator.authenticate(context)
        if identity is None:
            self._refuse(context, rpc, grpc.StatusCode.UNAUTHENTICATED,
                         "this sidecar requires authentication: a valid bearer token (authorization: Bearer ...) "
                         "or a client certificate signed by its client CA")
        attach_identity(context, identity)
        client = client_key(identity, context.peer())
        if not self.limiter.acquire(client):
            self._refuse(context, rpc, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"too many calls in flight from this client (at most {self.limiter.max_per_client}, "
                         "--max-calls-per-client); retry later")
        return identity, client

    def _parse(self, deserializer, raw: bytes, rpc: str):
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and anything else a parser raises
            raise CallRejected(grpc.StatusCode.INVALID_ARGUMENT,
                               f"malformed {rpc} request: the bytes are not a valid protobuf message "
                               f"({type(exc).__name__})") from None

    def intercept_service(self, continuation, handler_call_details):
        """Wrap the handler: requests arrive as raw bytes and are parsed here, so that bytes that are not a
        valid message get INVALID_ARGUMENT (grpc's own deserialization failure is INTERNAL); then
        authentication (not for health), the per-client limit and the watchdog."""
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        rpc = _method_name(handler_call_details.method)
        guarded = not handler_call_details.method.startswith(HEALTH_PREFIX)
        guard = self
        parse = handler.request_deserializer

        def admit(context):
            if not guarded:
                return None
            return guard._admit(context, rpc)[1]

        def done(w, client):
            if w is not None:
                guard.watchdog.unwatch(w)
            if client is not None:
                guard.limiter.release(client)

        def parsed_or_abort(raw, context):
            try:
                return guard._parse(parse, raw, rpc)
            except CallRejected as exc:
                guard._refuse(context, rpc, exc.code, exc.message)

        def parsed_stream(raw_iterator):
            for raw in raw_iterator:
                yield guard._parse(parse, raw, rpc)

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary_unary(raw, context):
                client = admit(context)  # credentials first: an unauthenticated caller learns nothing more
                w = None
                try:
                    request = parsed_or_abort(raw, context)
                    w = guard.watchdog.watch(context, rpc, idle=False) if guarded else None
                    return inner(request, context)
                finally:
                    done(w, client)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
        if handler.unary_stream:
            inner = handler.unary_stream

            def unary_stream(raw, context):
                client = admit(context)  # credentials first: an unauthenticated caller learns nothing more
                w = None
                try:
                    request = parsed_or_abort(raw, context)
                    # Idle here means: gRPC did not ask for the next frame (the previous one could not be
                    # sent: a reader that stopped reading) for --stream-idle-seconds.
                    w = guard.watchdog.watch(context, rpc, idle=True) if guarded else None
                    for response in inner(request, context):
                        yield response
                        if w is not None:
                            w.touch()
                finally:
                    done(w, client)

            return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)
        if handler.stream_unary:
            inner = handler.stream_unary

            def stream_unary(raw_iterator, context):
                client = admit(context)
                w = guard.watchdog.watch(context, rpc, idle=True) if guarded else None
                if w is not None:
                    attach_watch(context, w)  # Put reports the reservation it holds and the bytes it receives
                requests = parsed_stream(raw_iterator if w is None else _WatchedRequests(raw_iterator, w))
                try:
                    return inner(requests, context)
                except CallRejected as exc:  # raised inside a handler that does not map it itself
                    guard._refuse(context, rpc, exc.code, exc.message)
                finally:
                    done(w, client)

            return grpc.stream_unary_rpc_method_handler(stream_unary, None, handler.response_serializer)
        inner = handler.stream_stream

        def stream_stream(raw_iterator, context):
            client = admit(context)
            w = guard.watchdog.watch(context, rpc, idle=True) if guarded else None
            requests = parsed_stream(raw_iterator if w is None else _WatchedRequests(raw_iterator, w))
            try:
                yield from inner(requests, context)
            except CallRejected as exc:
                guard._refuse(context, rpc, exc.code, exc.message)
            finally:
                done(w, client)

        return grpc.stream_stream_rpc_method_handler(stream_stream, None, handler.response_serializer)
