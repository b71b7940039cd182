"""The /metrics HTTP endpoint with bounds: prometheus_client's start_http_server gives every connection a thread of
its own and waits for its request without a timeout, so whoever can reach the port (in a cluster: any pod, the
port listens on the pod's address for Prometheus) could hold thousands of idle connections, each a thread of the
sidecar: 2,000 of them took 2,000 threads (and 50 MiB), and a pod's process limit ends with the gRPC workers
unable to start a thread. Here at most MAX_CONNECTIONS are served at once, at most MAX_CONNECTIONS_PER_PEER of
them from one IP address (more are closed at accept), a connection must send its whole request (request line and
headers) within REQUEST_SECONDS of being accepted, however it trickles (a deadline, checked before every read:
a per-read timeout let 32 connections sending a byte every 5 s hold every slot for as long as they liked), and
each write of the answer must complete within REQUEST_SECONDS. The httpGet probes docs/security.md recommends
use this port, so one peer must not be able to lock out the others."""
from __future__ import annotations

import io
import socket
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

MAX_CONNECTIONS = 32  # Prometheus and a few people with curl; a scrape holds one for milliseconds
MAX_CONNECTIONS_PER_PEER = 4  # one IP address: Prometheus (one or two at once), a kubelet's probes, a curl
REQUEST_SECONDS = 10.0  # to send the whole request (a deadline from accept); and for each write of the answer


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each given only what is left until `deadline` (time.monotonic()), until done() is
    called: a peer trickling a byte at a time cannot stretch the request past the deadline."""

    def __init__(self, sock: socket.socket, deadline: float, timeout: float):
        self._sock = sock
        self._deadline = deadline
        self._timeout = timeout
        self._reading_request = True

    def readable(self) -> bool:
        return True

    def done(self) -> None:
        """The request line and headers are in: from now on reads and writes have the plain timeout."""
        self._reading_request = False
        self._sock.settimeout(self._timeout)

    def readinto(self, b) -> int:
        if self._reading_request:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request was not sent in time")
            self._sock.settimeout(left)
        return self._sock.recv_into(b)


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_SECONDS  # StreamRequestHandler sets it on the socket; also the deadline for the request

    def setup(self) -> None:
        super().setup()
        self._reader = _DeadlineReader(self.connection, time.monotonic() + self.timeout, self.timeout)
        self.rfile = io.BufferedReader(self._reader)

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers (the request line was read before)
        self._reader.done()
        return ok

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    max_connections_per_peer = MAX_CONNECTIONS_PER_PEER
    request_queue_size = 128  # the listen backlog (socketserver's 5 left connections waiting in SYN retries)

    def server_bind(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._by_peer: dict[str, int] = {}  # peer IP -> its connections being served
        self.refused = 0  # connections closed at accept: every slot was taken, or their peer's
        self.refused_peer = 0  # of those, refused because their peer had max_connections_per_peer already
        super().server_bind()

    def _take(self, peer: str) -> bool:
        with self._lock:
            if self._open >= self.max_connections:
                self.refused += 1
                return False
            if self._by_peer.get(peer, 0) >= self.max_connections_per_peer:
                self.refused += 1
                self.refused_peer += 1
                return False
            self._open += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
            return True

    def _give(self, peer: str) -> None:
        with self._lock:
            self._open -= 1
            left = self._by_peer[peer] - 1
            if left:
                self._by_peer[peer] = left
            else:
                del self._by_peer[peer]

    def process_request(self, request, client_address) -> None:
        peer = _peer(client_address)
        if not self._take(peer):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread for it, which gives the slot back
        except BaseException:
            self._give(peer)
            raise

    def handle_error(self, request, client_address) -> None:
        """A connection that timed out or went away: nothing to report (socketserver printed a traceback to stderr
        for each, which idle connections would turn into a flood)."""

    def process_request_thread(self, request, client_address) -> None:
        peer = _peer(client_address)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give(peer)


def _peer(client_address) -> str:
    """The peer a connection counts against: its IP (a unix socket's address as it is)."""
    return client_address[0] if isinstance(client_address, tuple) and client_address else str(client_address)


def serve(port: int, host: str, registry) -> tuple[BoundedMetricsServer, threading.Thread]:
    """Serve `registry` at http://host:port/metrics from a daemon thread (OSError when it cannot listen)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(BoundedMetricsServer):
        address_family = family

    httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), Server, handler_class=_Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
