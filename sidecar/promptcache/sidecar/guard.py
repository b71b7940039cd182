"""The gRPC server interceptor: authentication (promptcache.sidecar.auth), the per-client call limit and the
stream watchdog (promptcache.sidecar.limits) around every method except the health service; requests are parsed
here so that bytes that are not a valid message get INVALID_ARGUMENT."""
from __future__ import annotations

from typing import Iterator

import grpc

from promptcache.sidecar.auth import HEALTH_PREFIX, Authenticator, Identity, attach_identity
from promptcache.sidecar.calls import too_many_calls
from promptcache.sidecar.errors import CacheError
from promptcache.sidecar.identity import client_key
from promptcache.sidecar.limits import CallLimiter, Watchdog, WorkerShare, _Watch

_WATCH_ATTR = "_promptcache_watch"
# The health methods a caller without credentials may call: probes (kubelet's gRPC probe, grpc_health_probe) use
# Check, which answers at once and reveals nothing; List likewise. Health/Watch is a stream that holds one of the
# server's --workers threads until the status changes or the client leaves: exempt, it let a caller with no
# credentials hold every worker for good (the watchdog never saw it), so it is guarded like every other method.
UNGUARDED = frozenset({HEALTH_PREFIX + "Check", HEALTH_PREFIX + "List"})


class CallRejected(CacheError):
    """A refusal by the gRPC layer itself (a malformed message, a cancelled call), with its status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.status = code.name


def attach_watch(context, w: _Watch) -> None:
    setattr(context, _WATCH_ATTR, w)


def watch_of(context) -> _Watch | None:
    """The watchdog's record of this gRPC call (None when no Guard watches it)."""
    return getattr(context, _WATCH_ATTR, None)


def cancel_call(context):
    """How the watchdog cuts off a gRPC call: DEADLINE_EXCEEDED with its reason."""
    return lambda reason: _cancel(context, grpc.StatusCode.DEADLINE_EXCEEDED, reason)


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


def _method_name(full: str) -> str:
    return full.rsplit("/", 1)[-1]


class Guard(grpc.ServerInterceptor):
    """Authentication, per-client call limit and the watchdog around every method but health's Check and List."""

    def __init__(self, authenticator: Authenticator, limiter: CallLimiter, watchdog: Watchdog, metrics=None,
                 workers: WorkerShare | None = None):
        self.authenticator = authenticator
        self.limiter = limiter
        self.watchdog = watchdog
        self.metrics = metrics
        # With authentication, the last workers are kept for tenants that have none in flight (WorkerShare);
        # without it a client is a connection, and one caller can open as many as it likes.
        self.workers = workers if authenticator.enabled else None

    def _refuse(self, context, rpc: str, code: grpc.StatusCode, message: str):
        if self.metrics is not None:
            self.metrics.requests.labels(rpc, code.name).inc()
        context.abort(code, message)

    def _admit(self, context, rpc: str) -> tuple[Identity, str]:
        identity = self.authenticator.authenticate_call(context)
        if identity is None:
            self._refuse(context, rpc, grpc.StatusCode.UNAUTHENTICATED,
                         "this sidecar requires authentication: a valid bearer token (authorization: Bearer ...) "
                         "or a client certificate signed by its client CA")
        attach_identity(context, identity)
        client = client_key(identity, context.peer())
        if not self.limiter.acquire(client):
            refused = too_many_calls(self.limiter.max_per_client)
            self._refuse(context, rpc, grpc.StatusCode.RESOURCE_EXHAUSTED, refused.message)
        if self.workers is not None and not self.workers.acquire(client):
            self.limiter.release(client)
            self._refuse(context, rpc, grpc.StatusCode.RESOURCE_EXHAUSTED, self.workers.refusal())
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
        authentication (not for health's Check and List: UNGUARDED), the per-client limit and the watchdog."""
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        rpc = _method_name(handler_call_details.method)
        guarded = handler_call_details.method not in UNGUARDED
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
                if guard.workers is not None:
                    guard.workers.release(client)

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
                    w = guard.watchdog.watch(cancel_call(context), rpc, idle=False) if guarded else None
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
                    w = guard.watchdog.watch(cancel_call(context), rpc, idle=True) if guarded else None
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
                w = guard.watchdog.watch(cancel_call(context), rpc, idle=True) if guarded else None
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
            w = guard.watchdog.watch(cancel_call(context), rpc, idle=True) if guarded else None
            requests = parsed_stream(raw_iterator if w is None else _WatchedRequests(raw_iterator, w))
            try:
                yield from inner(requests, context)
            except CallRejected as exc:
                guard._refuse(context, rpc, exc.code, exc.message)
            finally:
                done(w, client)

        return grpc.stream_stream_rpc_method_handler(stream_stream, None, handler.response_serializer)
