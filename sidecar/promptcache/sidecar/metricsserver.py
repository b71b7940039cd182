"""The /metrics HTTP endpoint with bounds: prometheus_client's start_http_server gives every connection a thread of
its own and waits for its request without a timeout, so whoever can reach the port (in a cluster: any pod, the
port listens on the pod's address for Prometheus) could hold thousands of idle connections, each a thread of the
sidecar: 2,000 of them took 2,000 threads (and 50 MiB), and a pod's process limit ends with the gRPC workers
unable to start a thread. Here at most MAX_CONNECTIONS are served at once (more are closed at accept), and a
connection that sends no complete request, or reads no answer, within REQUEST_SECONDS is dropped."""
from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

MAX_CONNECTIONS = 32  # Prometheus and a few people with curl; a scrape holds one for milliseconds
REQUEST_SECONDS = 10.0  # to send a request, and to read the answer, per socket operation


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_SECONDS  # StreamRequestHandler sets it on the socket: reads and writes give up after it

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    request_queue_size = 128  # the listen backlog (socketserver's 5 left connections waiting in SYN retries)

    def server_bind(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0  # connections closed at accept because every slot was taken
        super().server_bind()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread for it, which gives the slot back
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request, client_address) -> None:
        """A connection that timed out or went away: nothing to report (socketserver printed a traceback to stderr
        for each, which idle connections would turn into a flood)."""

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(port: int, host: str, registry) -> tuple[BoundedMetricsServer, threading.Thread]:
    """Serve `registry` at http://host:port/metrics from a daemon thread (OSError when it cannot listen)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(BoundedMetricsServer):
        address_family = family

    httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), Server, handler_class=_Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
