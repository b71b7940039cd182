"""The sidecar's bulk channel: Get and Put over a plain stream socket (docs/bulk-channel.md).

An adapter onto the same cache engine as gRPC (Get: CacheEngine.read_chunks, with model and token checks,
tenancy, leases, checksums before serving, metrics; Put: a PutSession, so its checks, reservations, quotas and
limits are the gRPC Put's), same authentication (the bearer token of the hello frame goes through the
Authenticator), without gRPC's fixed per-call cost. Chunk bytes are sent straight from the stored tensor's
memory while its lease is held, and received straight into the memory reserved for the chunk. One thread per connection, at most --bulk-max-connections of them, at most
--bulk-max-connections-per-peer from one peer (a process, by its unix-socket credentials; an IP address over TCP).
A connection must complete its hello within --bulk-hello-seconds; while the channel is full, a new connection
replaces the oldest one still waiting for its hello, so connections that never authenticate cannot lock out
one that does.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import select
import socket
import stat
import struct
import threading
import time

import grpc
import numpy as np

from promptcache.contract import bulkwire
from promptcache.sidecar.calls import Call
from promptcache.sidecar.errors import Cancelled, InvalidRequest, TimedOut
from promptcache.sidecar.identity import Caller
from promptcache.sidecar.limits import LARGE_REQUEST_TOKENS
from promptcache.sidecar import unixpath
from promptcache.sidecar.sinks import ArraySink, ChunkSink
from promptcache.v1 import kvcache_pb2 as pb

log = logging.getLogger("promptcache.sidecar.bulk")
RPC = "BulkGet"
PUT_RPC = "BulkPut"
# Bytes of one chunk a failed Put still reads (and drops) so that its client, still sending, gets the status;
# a chunk frame announcing more closes the connection instead.
MAX_DRAIN_CHUNK_BYTES = 1 << 30
MAX_CHUNK_FRAME_BYTES = 4096  # a ChunkBegin takes a few dozen bytes
# A kept chunk's bytes arrive in pieces this large or smaller, into the connection's receive buffer, which stays in
# the CPU's cache, and are checksummed, scanned and copied into the chunk from there (PutSession.add_data). Received
# straight into the chunk's memory (cold: an evicted chunk's) and then checked, an 8 MiB Put took 2.0 ms of the
# connection's CPU for its bytes where this takes 1.6 ms (hack/bulk-split.py --budget-mb 320); pieces of 128
# KiB-1 MiB cost about the same in a scratch harness, smaller ones more system calls.
RECEIVE_PIECE = 512 << 10
SEND_BATCH_BYTES = 16 << 20  # a Get sends its chunks once this many bytes are queued (leased until sent)
MAX_FDS_PER_WRITE = 250  # the kernel passes at most 253 descriptors per message (SCM_MAX_FD)
MAX_HELLO_BYTES = 64 << 10  # a hello carries a version, a flag and a bearer token
LARGE_FRAME_BYTES = LARGE_REQUEST_TOKENS  # a frame that may carry more tokens (>= 1 byte each) is a large request


class _Connection:
    """An accepted connection, as the accept loop and the hello reaper see it."""

    __slots__ = ("sock", "peer", "accepted", "greeted", "expired", "replaced", "counted", "client")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer            # what --bulk-max-connections-per-peer counts by
        self.accepted = time.monotonic()
        self.greeted = False        # its hello was accepted
        self.expired = False        # closed by the reaper: no hello within --bulk-hello-seconds
        self.replaced = False       # closed to make room for a new connection while still waiting for its hello
        self.counted = True         # still counted in the server's totals
        self.client = ""            # once greeted: who its calls count against (identity.client_key)

    def cut(self) -> None:
        """Wake the connection's thread (blocked reading) without closing the socket under it: recv sees the end."""
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass


class _Session:
    """A bulk connection once its hello is accepted: who is calling, with which token (checked again on every
    get and put, as gRPC checks every call), and whether it takes lent chunks (sealed memfds)."""

    __slots__ = ("caller", "authorization", "lend")

    def __init__(self, caller: Caller, authorization: str | None, lend: bool):
        self.caller = caller
        self.authorization = authorization
        self.lend = lend


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _shutdown(conn: socket.socket) -> None:
    """Wake the thread blocked reading `conn` (it then reads end of stream) without closing the descriptor."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _status(code: grpc.StatusCode, message: str = "", chunks: int = 0) -> pb.BulkFrame:
    return pb.BulkFrame(status=pb.BulkStatus(code=code.value[0], message=message, chunks=chunks))


class BulkServer:
    def __init__(self, address: str, engine, authenticator, metrics, max_connections: int = 64,
                 idle_seconds: float = 30.0, max_call_seconds: float = 0.0, lend: bool = False,
                 max_connections_per_peer: int = 16, hello_seconds: float = 5.0, watchdog=None,
                 frame_bytes: int = 1 << 20, socket_mode: int | None = None, limiter=None):
        self.family, self.sockaddr = bulkwire.parse_address(address)
        self.socket_mode = socket_mode  # a unix socket's permission bits (--bulk-socket-mode); None: the umask's
        self.engine = engine  # promptcache.sidecar.engine.CacheEngine
        self.frame_bytes = frame_bytes  # a Put's bytes are received in pieces of at most this (progress, rate)
        self.authenticator = authenticator
        self.metrics = metrics
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        self.hello_seconds = hello_seconds
        self.watchdog = watchdog  # limits.Watchdog: puts get the gRPC Put's minimum rate (and duration) too
        self.limiter = limiter  # limits.CallLimiter: --max-calls-per-client, shared with gRPC (calls.Call)
        max_tokens = engine.settings.max_request_tokens
        self.max_frame_bytes = min(bulkwire.MAX_FRAME_BYTES, 5 * max_tokens + (64 << 10))  # <= 5 bytes a token
        self.idle_seconds = idle_seconds or None
        self.max_call_seconds = max_call_seconds
        self.lend = lend and self.family == socket.AF_UNIX  # descriptors only cross unix sockets
        self._listener: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # the socket file bound (unix), removed at stop if still it
        self._connections: dict[socket.socket, _Connection] = {}
        self._per_peer: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._stopping = False
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.sockaddr}"
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if self.family == socket.AF_INET6 else f"{host}:{port}"

    def start(self) -> "BulkServer":
        if self.family == socket.AF_UNIX:
            unixpath.claim(self.sockaddr, "--bulk-address")  # (its OSError names the flag already)
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            if self.family != socket.AF_UNIX:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            bulkwire.large_buffers(sock)  # connections accepted from it inherit them
            sock.bind(self.sockaddr)
            if self.family == socket.AF_UNIX and self.socket_mode is not None:
                os.chmod(self.sockaddr, self.socket_mode)  # before listen(): no connection sees other bits
            sock.listen(128)
            if self.family == socket.AF_UNIX:
                self._bound = unixpath.identity(self.sockaddr)
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on --bulk-address {self.sockaddr}: {exc.strerror or exc}") from None
        self._listener = sock
        for target, name in ((self._accept, "bulk-accept"), (self._reap, "bulk-hello-reaper")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            self._stopping = True
            connections = list(self._connections)
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv; it closes the socket
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        if self.family == socket.AF_UNIX:
            unixpath.release(self.sockaddr, self._bound)

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # listener closed by stop()
            peer = self._peer_of(conn, addr)
            record = _Connection(conn, peer)
            refusal = None
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                if self._per_peer.get(peer, 0) >= self.max_connections_per_peer:
                    refusal = (f"this peer ({peer}) has its maximum of {self.max_connections_per_peer} bulk "
                               "connections (--bulk-max-connections-per-peer); reuse them or retry later")
                elif len(self._connections) >= self.max_connections and not self._replace_waiting():
                    refusal = (f"the bulk channel has its maximum of {self.max_connections} connections "
                               "(--bulk-max-connections); retry later or use gRPC Get")
                else:
                    self._connections[conn] = record
                    self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            if refusal:
                self._refuse(conn, refusal)
                continue
            name = f"unix:{self.sockaddr}" if self.family == socket.AF_UNIX else f"ip:{addr[0]}:{addr[1]}"
            t = threading.Thread(target=self._serve, args=(record, name), name="bulk-conn", daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _peer_of(self, conn: socket.socket, addr) -> str:
        """Who --bulk-max-connections-per-peer counts by: the connecting process (SO_PEERCRED) on a unix socket,
        the IP address over TCP."""
        if self.family != socket.AF_UNIX:
            return f"ip:{addr[0]}"
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        return f"pid:{pid} (uid {uid})"

    def _replace_waiting(self) -> bool:
        """Under the lock, the channel full: close the oldest connection still waiting for its hello to make
        room (False if every connection has completed its hello). A client that authenticates sends its hello
        at once; connections that never do cannot hold the channel against it."""
        waiting = [r for r in self._connections.values() if not r.greeted and not r.expired and not r.replaced]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda r: r.accepted)
        oldest.replaced = True
        self._uncount(oldest)
        oldest.cut()
        return True

    def _uncount(self, record: _Connection) -> None:
        """Under the lock: stop counting `record` (its thread may still be finishing)."""
        if record.counted:
            record.counted = False
            self._connections.pop(record.sock, None)
            self._per_peer[record.peer] -= 1
            if self._per_peer[record.peer] <= 0:
                del self._per_peer[record.peer]

    def _reap(self) -> None:
        """Close connections that have not completed their hello within --bulk-hello-seconds."""
        tick = min(0.25, self.hello_seconds / 4)
        while not self._stopped.wait(tick):
            now = time.monotonic()
            with self._lock:
                late = [r for r in self._connections.values()
                        if not r.greeted and not r.expired and now - r.accepted > self.hello_seconds]
                for r in late:
                    r.expired = True
            for r in late:
                r.cut()

    def _refuse(self, conn: socket.socket, message: str) -> None:
        self.metrics.requests.labels(RPC, "RESOURCE_EXHAUSTED").inc()
        try:
            conn.settimeout(1.0)
            bulkwire.send(conn, _status(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, record: _Connection, peer: str) -> None:
        conn = record.sock
        shared: _SharedBuffer | None = None
        fds: list[int] | None = [] if self.family == socket.AF_UNIX else None  # received with frames
        large: list[str | None] = [None]  # the client holding one of --max-large-requests for the frame served
        try:
            conn.settimeout(self.idle_seconds)
            if self.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            readable = select.poll()
            readable.register(conn, select.POLLIN)
            session = self._hello(record, peer, readable)
            while True:
                try:
                    frame = self._next_frame(conn, readable, fds, lambda length: self._admit(length, large, record.client))
                except bulkwire.Closed:
                    return
                kind = frame.WhichOneof("frame")
                if kind == "buffer":
                    self._release_large(large)  # (a frame padded past 64 KiB took one: it is not a request)
                    if fds is None:
                        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "a buffer frame attaches a memfd, which "
                                       "only a unix socket carries; this bulk connection is TCP")
                    shared = self._attach(conn, frame.buffer, fds, shared)
                    continue
                if fds:
                    _close_all(fds)
                    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"a file descriptor came with a {kind} frame; only buffer frames carry one")
                if kind == "put":
                    try:
                        self._put(conn, session, frame.put, shared)
                    finally:
                        self._release_large(large)
                    continue
                if kind != "get":
                    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"expected a get, put or buffer frame, got {kind}")
                try:
                    self._get(conn, session, frame.get, shared)
                finally:
                    self._release_large(large)
        except (bulkwire.Closed, bulkwire.FramingError, OSError) as exc:
            if record.expired or record.replaced:
                why = (f"no hello within {self.hello_seconds:g} s of connecting (--bulk-hello-seconds)"
                       if record.expired else "the bulk channel is full and this connection had not sent its "
                       "hello; it was closed to make room (--bulk-max-connections)")
                code = grpc.StatusCode.DEADLINE_EXCEEDED if record.expired else grpc.StatusCode.RESOURCE_EXHAUSTED
                self.metrics.requests.labels(RPC, code.name).inc()
                self._try_send(conn, _status(code, why))
            elif isinstance(exc, bulkwire.FramingError) and not isinstance(exc, (bulkwire.Closed, bulkwire.Cut)):
                # (Closed: answered already, or the client left; Cut: nobody to answer)
                self.metrics.requests.labels(RPC, "INVALID_ARGUMENT").inc()
                self._try_send(conn, _status(grpc.StatusCode.INVALID_ARGUMENT, f"malformed bulk frame: {exc}"))
            # else: the client left, stalled past --stream-idle-seconds, or stop() shut the socket down
        except _Refused as exc:
            self.metrics.requests.labels(RPC, exc.code.name).inc()
            self._try_send(conn, _status(exc.code, exc.message))
        except Exception:  # noqa: BLE001 - one broken connection must never take the server down
            log.exception("unexpected error on a bulk connection")
        finally:
            if fds:
                _close_all(fds)
            if shared is not None:
                shared.close()
            self._release_large(large)
            with self._lock:
                self._uncount(record)
            conn.close()

    def _next_frame(self, conn: socket.socket, readable: select.poll, fds: list[int] | None = None,
                    admit=None, limit: int = bulkwire.MAX_FRAME_BYTES) -> pb.BulkFrame:
        """The next frame. Waiting for it has no time limit once the hello is done (an idle connection is fine;
        stop() wakes it by shutting the socket down); once its first byte is here, a stall longer than the
        socket's timeout (--stream-idle-seconds) ends the connection."""
        readable.poll()
        return bulkwire.recv(conn, limit=limit, fds=fds, admit=admit)

    def _admit(self, length: int, large: list, client: str) -> float | None:
        """Before a frame's body is read: refuse one too long for --max-request-tokens, and take one of
        --max-large-requests for one that may carry more than LARGE_REQUEST_TOKENS tokens. Either refusal
        ends the connection (the body is never read). A large frame's body must then arrive within
        --stream-idle-seconds in all (the deadline returned), so a client that trickles it cannot keep the slot."""
        if length > self.max_frame_bytes:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a bulk frame of {length} bytes is over the limit of {self.max_frame_bytes} bytes "
                           f"that --max-request-tokens ({self.engine.settings.max_request_tokens}) sets")
        if length > LARGE_FRAME_BYTES:
            if not self.engine.large_requests.acquire(client):
                raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               self.engine.large_requests.refusal(f"a bulk frame of {length} bytes").message)
            large[0] = client
            return time.monotonic() + (self.idle_seconds or 30.0)
        return None

    def _release_large(self, large: list) -> None:
        if large[0] is not None:
            client, large[0] = large[0], None
            self.engine.large_requests.release(client)

    def _hello(self, record: _Connection, peer: str, readable: select.poll) -> _Session:
        conn = record.sock
        # A hello's bytes may take until --bulk-hello-seconds from the accept: the reaper then cuts the connection
        # and it is answered DEADLINE_EXCEEDED. The idle timeout must not close it silently first.
        conn.settimeout(max(self.idle_seconds or 0.0, self.hello_seconds + 1.0))
        frame = self._next_frame(conn, readable, limit=MAX_HELLO_BYTES)
        conn.settimeout(self.idle_seconds)
        if frame.WhichOneof("frame") != "hello":
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"a bulk connection must start with a hello frame, got {frame.WhichOneof('frame')}")
        hello = frame.hello
        if hello.version != bulkwire.VERSION:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"bulk protocol version {hello.version} is not supported (this sidecar speaks "
                           f"{bulkwire.VERSION})")
        authorization = hello.authorization or None
        identity = self.authenticator.identify(authorization)  # no TLS here: the bearer token only
        if identity is None:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                           "this sidecar requires authentication: a valid bearer token in the hello frame "
                           "(authorization: Bearer ...)")
        caller = Caller(identity, peer)
        with self._lock:
            if record.expired or record.replaced:
                raise bulkwire.Closed("closed while its hello was read")
            # The last eighth of the channel (at least one connection) is kept for the other clients: one tenant
            # cannot hold every connection and push the others onto gRPC.
            cap = self.max_connections - max(1, self.max_connections // 8)
            # (without authentication a client is the connecting process or IP address, record.peer: `peer` here
            # names the socket, the same for every connection to it)
            client = caller.client if not identity.anonymous else f"peer:{record.peer}"
            mine = sum(1 for r in self._connections.values() if r.greeted and r.client == client)
            if mine and mine >= cap:
                raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this client holds {mine} of the bulk channel's {self.max_connections} connections "
                               "(--bulk-max-connections), the most one client may; reuse them or use gRPC")
            record.greeted, record.client = True, client
        session = _Session(caller, authorization, self.lend and hello.sealed_memfds)
        frame = _status(grpc.StatusCode.OK)
        frame.status.sealed_memfds = session.lend
        frame.status.puts = True
        bulkwire.send(conn, frame)
        return session

    def _attach(self, conn: socket.socket, buffer: pb.BulkBuffer, fds: list[int],
                old: "_SharedBuffer | None") -> "_SharedBuffer | None":
        """Map the memfd that came with a buffer frame; it replaces the connection's previous buffer."""
        received = list(fds)
        fds.clear()
        try:
            if len(received) != 1:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"a buffer frame must carry exactly one file descriptor, it carried {len(received)}")
            new = _SharedBuffer.map(received.pop(), buffer.length)
        except _Refused as exc:
            _close_all(received)
            self.metrics.requests.labels("BulkBuffer", exc.code.name).inc()
            bulkwire.send(conn, _status(exc.code, exc.message))
            return old
        if old is not None:
            old.close()
        self.metrics.requests.labels("BulkBuffer", "OK").inc()
        bulkwire.send(conn, _status(grpc.StatusCode.OK))
        return new

    def _revoked(self, session: _Session) -> bool:
        """Whether the token of this connection's hello is no longer valid (removed from the token file)."""
        return self.authenticator.enabled and self.authenticator.identify(session.authorization) is None

    def _get(self, conn: socket.socket, session: _Session, request: pb.GetRequest,
             shared: "_SharedBuffer | None" = None) -> None:
        # Credentials are checked on every get, as on every gRPC call: a token revoked (removed from the token
        # file) stops working on open connections too. The connection is then closed.
        if self._revoked(session):
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "the bearer token of this connection's hello is no "
                           "longer valid; reconnect with a current one")
        answer = _GetAnswer(conn, self.engine, self.max_call_seconds)
        try:
            with Call(RPC, self.metrics, session.caller, self.limiter) as call:
                try:
                    call.admit()
                    target = None
                    if request.HasField("shared_buffer"):
                        target = _shared_target(request.shared_buffer, shared)
                    sink = ArraySink(target) if target is not None else ChunkSink()
                    if session.lend:
                        sink = LendSink(sink)
                    chunks = self.engine.read_chunks(session.caller, request, sink, large_slot=False,
                                                     held=answer.held)
                    try:
                        for begin, view in chunks:
                            answer.check_deadline()
                            if begin.sealed_memfd:
                                answer.lent_chunk(*view)
                            elif target is not None:
                                answer.frame_only(begin)  # its bytes are in the shared buffer
                            else:
                                answer.chunk(begin, view)
                    finally:
                        chunks.close()  # counts the lookup; the chunk yielded last joins answer.held
                    answer.send_queued()
                except OSError:
                    call.code = grpc.StatusCode.CANCELLED  # the client went away
                    raise
                except Exception as exc:  # noqa: BLE001 - every failure becomes a status frame
                    call.fail(exc)
            if answer.lent_count:  # counted before the answer ends, as the call's own metrics are
                self.metrics.lent_chunks.inc(answer.lent_count)
            answer.finish(_status(call.code, call.message, answer.sent))
        finally:
            answer.release()

    def _put(self, conn: socket.socket, session: _Session, put: pb.BulkPut,
             shared: "_SharedBuffer | None" = None) -> None:
        """One Put through a PutSession, so every check, reservation, quota and limit is the gRPC Put's; only
        the metrics (rpc="BulkPut") and the answer (a status frame) are the channel's. A chunk is stored when
        all its bytes have arrived and verified; a cut connection stores nothing of the chunk it was in. After
        a failure the rest of the Put is read and dropped, so the connection stays in step (a client still
        sending then reads the status)."""
        with Call(PUT_RPC, self.metrics, session.caller, self.limiter) as call:
            if self._revoked(session):
                call.code = grpc.StatusCode.UNAUTHENTICATED
                self._try_send(conn, _status(call.code, "the bearer token of this connection's hello is no "
                                             "longer valid; reconnect with a current one"))
                raise bulkwire.Closed("token revoked")  # the client is still sending: close rather than read on
            frames = _PutFrames(conn, put, shared, self.frame_bytes,
                                time.perf_counter() + self.max_call_seconds if self.max_call_seconds else 0.0)
            result = None
            # The watchdog cuts a put off (--min-put-bytes-per-second, --max-call-seconds) by shutting the
            # connection down; the serving thread then reports its reason.
            watch = (self.watchdog.watch(lambda reason: _shutdown(conn), PUT_RPC, idle=False)
                     if self.watchdog is not None else None)
            # Blocking reads for the Put's bytes (a socket with a timeout polls before every read, and a blocking
            # one waits for whole pieces: MSG_WAITALL), with the kernel's own timeouts keeping the idle limit.
            _connection.kernel_timeouts(conn, self.idle_seconds)
            conn.settimeout(None)
            try:
                call.admit()
                frames.check()
                with self.engine.put(session.caller, put.header, watch, large_slot=False) as put_session:
                    frames.feed(put_session)
                    result = put_session.commit()
            except (bulkwire.Cut, OSError) as exc:
                if watch is not None and watch.expired:  # the watchdog shut the connection: say why, if it can
                    call.code = grpc.StatusCode.DEADLINE_EXCEEDED
                    self._try_send(conn, _status(call.code, watch.reason))
                    raise bulkwire.Closed("cut off by the watchdog") from None
                call.code = grpc.StatusCode.CANCELLED  # the client went away mid-put
                if isinstance(exc, bulkwire.Cut):
                    raise bulkwire.Closed("connection cut in a put") from None
                raise
            except bulkwire.FramingError as exc:
                call.code = grpc.StatusCode.INVALID_ARGUMENT
                self._try_send(conn, _status(call.code, f"malformed bulk frame: {exc}"))
                raise bulkwire.Closed("framing error in a put") from None  # counted and answered: just close
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status frame
                call.fail(exc)
            finally:
                if watch is not None:
                    self.watchdog.unwatch(watch)
        answer = _status(call.code, call.message)
        if result is not None:
            answer.status.put.CopyFrom(result)
        bulkwire.send(conn, answer)
        if call.code != grpc.StatusCode.OK:
            frames.drain()
        conn.settimeout(self.idle_seconds)

    @staticmethod
    def _try_send(conn: socket.socket, frame: pb.BulkFrame) -> None:
        try:
            conn.settimeout(1.0)
            bulkwire.send(conn, frame)
        except OSError:
            pass


class _ConnectionState(threading.local):
    """Per connection (each has its own thread): what its Puts reuse."""

    buffer = bytearray()  # Put bytes are received here: reused, so its pages are already faulted in
    timeouts_set = False

    def receive_buffer(self, n: int) -> bytearray:
        if len(self.buffer) < n:
            self.buffer = bytearray(n)
        return self.buffer

    def kernel_timeouts(self, conn: socket.socket, seconds: float | None) -> None:
        """SO_RCVTIMEO and SO_SNDTIMEO, once per connection: what its reads and writes wait at most while it
        is blocking (None: forever)."""
        if self.timeouts_set:
            return
        whole = int(seconds or 0)
        value = struct.pack("ll", whole, int(((seconds or 0) - whole) * 1e6))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self.timeouts_set = True


_connection = _ConnectionState()


class _GetAnswer:
    """What a bulk Get sends, in order: each chunk's frame with its bytes (queued, and sent together
    SEND_BATCH_BYTES at a time straight from the stored memory, whose leases read_chunks leaves in `held` until
    then: fewer, larger sendmsg calls cost the kernel less per byte), or its frame alone (a lent chunk, its
    descriptor with it; a chunk copied into the caller's buffer); then the status frame. A Get that runs past
    --max-call-seconds stops at the end of a chunk, so the status frame still follows in step."""

    def __init__(self, conn: socket.socket, engine, max_call_seconds: float):
        self.conn, self.engine = conn, engine
        self.max_call_seconds = max_call_seconds
        self.deadline = time.monotonic() + max_call_seconds if max_call_seconds else None
        self.sent = 0  # chunks answered (the status frame's count)
        self.batch: list = []  # frame, bytes, frame, bytes, ...
        self.queued = 0  # bytes of chunks in the batch
        self.held: list = []  # entries whose leases read_chunks left to us
        self.pending = bytearray()  # frames without bytes after them, sent with...
        self.lent: list = []  # ...the descriptors of the SealedChunks they lend, held until sent
        self.lent_count = 0

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.send_queued()  # sends nothing past the deadline: the queued chunks are cancelled
            raise Cancelled(self._too_slow())

    def chunk(self, begin: pb.ChunkBegin, view) -> None:
        """A chunk with its bytes, from the stored memory."""
        _flush(self.conn, self.pending, self.lent)  # frames already queued go first
        self.batch += (bulkwire.encode(pb.BulkFrame(chunk=begin)), view)
        self.queued += begin.nbytes
        self.sent += 1
        if self.queued >= SEND_BATCH_BYTES:
            self.send_queued()

    def lent_chunk(self, memfd, frame: bytes) -> None:
        """A lent chunk: its frame, with the memfd's descriptor (which keeps the memory; no lease needed)."""
        self.send_queued()  # chunks queued before it go first
        self.pending += frame  # its descriptor goes with it
        self.lent.append(memfd)
        self.lent_count += 1
        self.sent += 1
        if len(self.lent) == MAX_FDS_PER_WRITE:
            _flush(self.conn, self.pending, self.lent)

    def frame_only(self, begin: pb.ChunkBegin) -> None:
        """A chunk whose bytes were copied into the caller's shared buffer."""
        self.send_queued()
        self.pending += bulkwire.encode(pb.BulkFrame(chunk=begin))
        self.sent += 1

    def send_queued(self) -> None:
        """Send the queued chunks and give back their leases; past the deadline, stop at the end of the chunk
        being sent and cancel the rest (Cancelled)."""
        unsent = 0
        if self.batch:
            done = bulkwire.send_buffers(self.conn, self.batch, self.deadline, whole=2)
            unsent = (len(self.batch) - done) // 2
            self.batch.clear()
            self.queued = 0
        self.engine.release_leases(self.held)
        if unsent:
            self.sent -= unsent
            raise Cancelled(self._too_slow())

    def finish(self, status: pb.BulkFrame) -> None:
        """The status frame, after what is still queued (chunks queued before a failure go with it)."""
        frame = bulkwire.encode(status)
        if self.batch:
            self.batch.append(frame)
            bulkwire.send_buffers(self.conn, self.batch)
            self.batch.clear()
        else:
            self.pending += frame
            _flush(self.conn, self.pending, self.lent)

    def release(self) -> None:
        self.engine.release_leases(self.held)

    def _too_slow(self) -> str:
        return (f"this get ran longer than --max-call-seconds ({self.max_call_seconds:g} s); the client is "
                "reading too slowly")


class _PutFrames:
    """The frames of one bulk Put, fed to a PutSession: for each chunk its ChunkBegin, then its bytes, received
    in pieces of at most `piece` bytes and RECEIVE_PIECE into the connection's reused
    receive buffer, or, with put.shared_buffer, a view of the attached memfd (which the client can still write:
    the session verifies its copy of it). The session copies either into the chunk's memory, verifying on the
    way, and checks each chunk frame (index, layout, --max-chunk-bytes) before the bytes after it are read."""

    def __init__(self, conn: socket.socket, put: pb.BulkPut, shared: "_SharedBuffer | None", piece: int,
                 deadline: float):
        self.conn = conn
        self.put = put
        self.shared = shared if put.shared_buffer else None
        self.bytes_follow = not put.shared_buffer  # raw bytes follow each chunk frame on the socket
        self.piece = piece
        self.deadline = deadline
        self.remaining = put.chunks  # chunk frames not read yet
        self.unread = 0  # bytes after the last chunk frame not read yet

    def check(self) -> None:
        if self.put.header.shared_buffer:
            raise InvalidRequest("put.header.shared_buffer must be empty on the bulk channel: set "
                                 "put.shared_buffer to use the memfd attached by a buffer frame")
        if self.put.shared_buffer and self.shared is None:
            raise InvalidRequest("put.shared_buffer is set but no buffer frame attached a memfd on this connection")

    def feed(self, session) -> None:
        while self.remaining:
            if self.deadline and time.perf_counter() > self.deadline:
                raise TimedOut("this put ran longer than --max-call-seconds; nothing partial was stored")
            begin = self._chunk_frame()
            session.begin_chunk(begin)
            if self.shared is not None:
                end = begin.buffer_offset + begin.nbytes
                if end > self.shared.array.size:
                    raise InvalidRequest(f"chunk {begin.index}: buffer_offset {begin.buffer_offset} + nbytes "
                                         f"{begin.nbytes} runs past the attached buffer's {self.shared.array.size} "
                                         "bytes")
                session.add_data(memoryview(self.shared.array[begin.buffer_offset:end]), client_writable=True)
                continue
            while self.unread:  # (a chunk not kept is read all the same, and dropped by the session)
                session.add_data(self._receive(min(self.unread, self.piece, RECEIVE_PIECE)))

    def _chunk_frame(self) -> pb.ChunkBegin:
        frame = bulkwire.recv(self.conn, limit=MAX_CHUNK_FRAME_BYTES)
        if frame.WhichOneof("frame") != "chunk":
            raise bulkwire.FramingError(f"a put announced {self.put.chunks} chunk frames; frame "
                                        f"{self.put.chunks - self.remaining + 1} is a {frame.WhichOneof('frame')}")
        self.remaining -= 1
        self.unread = frame.chunk.nbytes if self.bytes_follow else 0
        return frame.chunk

    def _receive(self, n: int) -> memoryview:
        view = memoryview(_connection.receive_buffer(n))[:n]
        bulkwire.recv_into(self.conn, view)
        self.unread -= n
        return view

    def drain(self) -> None:
        """Read and drop the rest of a Put that failed, so the connection stays in step."""
        while True:
            if self.unread > MAX_DRAIN_CHUNK_BYTES:
                raise bulkwire.Closed(f"a failed put announced a chunk of {self.unread} bytes; not reading them")
            while self.unread:
                self._receive(min(self.unread, self.piece))
            if not self.remaining:
                return
            if self.deadline and time.perf_counter() > self.deadline:
                raise bulkwire.Closed("a failed put ran past --max-call-seconds while its rest was read")
            self._chunk_frame()


class _SharedBuffer:
    """A client's memfd, mapped for the life of its connection. Sealed against shrinking, so no write of ours
    can ever land beyond its end (SIGBUS) whatever the client does to it afterwards."""

    MAX_BYTES = 1 << 40

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.array = np.frombuffer(mm, dtype=np.uint8)

    @classmethod
    def map(cls, fd: int, length: int) -> "_SharedBuffer":
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the buffer frame's descriptor is not a memfd")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               "the shared buffer must be a memfd sealed against shrinking (F_SEAL_SHRINK)")
            if not 0 < length <= min(st.st_size, cls.MAX_BYTES):
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"buffer length {length} must be in 1..{min(st.st_size, cls.MAX_BYTES)} "
                               "(the memfd's size)")
            try:
                mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the shared buffer cannot be mapped for writing: {exc.strerror}") from None
            return cls(mm)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


def _shared_target(request: pb.SharedBuffer, shared: _SharedBuffer | None) -> np.ndarray:
    if shared is None:
        raise InvalidRequest("shared_buffer is set but no buffer frame attached a memfd on this connection "
                             "(on the bulk channel, shared memory needs a unix socket and a buffer frame first)")
    if request.name:
        raise InvalidRequest("shared_buffer.name must be empty on the bulk channel: the buffer is the attached "
                             "memfd")
    if not 0 < request.length <= shared.array.size:
        raise InvalidRequest(f"shared_buffer.length {request.length} must be in 1..{shared.array.size} "
                             "(the attached buffer's length)")
    return shared.array[:request.length]


def _flush(conn: socket.socket, pending: bytearray, lent: list) -> None:
    """Send the queued frames, with the descriptors of the chunks they lend (in order), and clear both."""
    if lent:
        bulkwire.send_with_fds(conn, pending, [chunk.fd for chunk in lent])
    elif pending:
        conn.sendall(pending)
    pending.clear()
    lent.clear()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class LendSink(ChunkSink):
    """A Get on a unix connection that takes descriptors: a chunk kept in a memfd is lent, not copied. It is
    sealed first, if this is its first read (memfd.py), so the bytes the engine then verifies are the ones the
    client maps, and nothing can change them afterwards; once verified there it is lent without hashing. It is
    yielded as (its ChunkBegin with sealed_memfd set, (its SealedChunk, the encoded frame)). Every other chunk
    (and one whose memfd could not be sealed) goes to `inner`."""

    def __init__(self, inner: ChunkSink):
        self.inner = inner

    def place(self, entry, position: int):
        if entry.memfd is not None and entry.memfd.seal():
            return entry.array, entry.memfd.immutable  # the sidecar's mapping of the very pages the client maps
        return self.inner.place(entry, position)

    def emit(self, index: int, entry, view, position: int):
        if not (entry.memfd is not None and entry.memfd.sealed):
            return self.inner.emit(index, entry, view, position)
        frame = entry.wire  # the same on every Get of this entry at this index: encoded once
        if frame is None or frame[0].index != index:
            begin = pb.ChunkBegin(index=index, nbytes=entry.nbytes, shape=entry.shape, dtype=entry.dtype,
                                  xxh3_64=entry.checksum, sealed_memfd=True, values_finite=entry.values_finite)
            frame = entry.wire = begin, bulkwire.encode(pb.BulkFrame(chunk=begin))
        return (frame[0], (entry.memfd, frame[1])), 0
