"""The /metrics endpoint's bounds (promptcache.sidecar.metricsserver): idle connections cannot pile up threads in
the sidecar, and scrapes are served again once the idle ones time out."""
from __future__ import annotations

import os
import socket
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from promptcache.sidecar import metricsserver


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read()


def test_idle_connections_are_bounded_and_dropped(monkeypatch):
    monkeypatch.setattr(metricsserver.BoundedMetricsServer, "max_connections", 4)
    monkeypatch.setattr(metricsserver._Handler, "timeout", 1.0)
    registry = CollectorRegistry()
    Counter("promptcache_probe", "a probe", registry=registry).inc()
    httpd, thread = metricsserver.serve(0, "127.0.0.1", registry)
    port = httpd.server_port
    try:
        assert b"promptcache_probe_total 1.0" in _scrape(port)
        threads_before = len(os.listdir("/proc/self/task"))
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]  # each sends nothing
        deadline = time.monotonic() + 20  # (the accept loop may lag on a loaded machine)
        while httpd.refused < 46 and time.monotonic() < deadline:
            assert len(os.listdir("/proc/self/task")) <= threads_before + 4  # a thread per slot, not per connection
            time.sleep(0.05)
        assert httpd.refused >= 30  # (most of the 46 beyond the slots; some may still sit in the listen queue)
        for s in idle:
            s.close()
        while time.monotonic() < deadline:  # the idle ones time out (or see their close) and give their slots back
            try:
                assert b"promptcache_probe_total 1.0" in _scrape(port)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("no scrape was served after the idle connections went")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_a_sidecar_serves_metrics_through_the_bounded_server(sidecar):
    assert isinstance(sidecar._http, metricsserver.BoundedMetricsServer)
    assert b"promptcache_" in _scrape(sidecar.metrics_port)


def _trickle_until_closed(sock: socket.socket, every: float, limit: float) -> float:
    """Send one byte of a request every `every` seconds until the server closes the connection; the seconds that
    took (`limit` if it never did)."""
    start = time.monotonic()
    request = b"GET /metrics HTTP/1.1\r\nX-A: " + b"a" * 10_000
    sock.settimeout(every)
    i = 0
    while time.monotonic() - start < limit:
        try:
            sock.sendall(request[i:i + 1])
            if sock.recv(1) == b"":  # (the server answers nothing to a request it never got whole)
                return time.monotonic() - start
        except socket.timeout:
            pass
        except OSError:  # reset
            return time.monotonic() - start
        i += 1
    return limit


def test_a_trickled_request_is_dropped_at_its_deadline_however_slowly_it_comes(monkeypatch):
    """Audit: REQUEST_SECONDS was a timeout per socket read, so a byte every 5 s (under the 10 s) kept a
    connection, and its slot, for ever; 32 such connections made every scrape (and an httpGet probe) fail.
    Now the whole request must arrive within REQUEST_SECONDS of the accept."""
    monkeypatch.setattr(metricsserver._Handler, "timeout", 1.0)
    registry = CollectorRegistry()
    httpd, thread = metricsserver.serve(0, "127.0.0.1", registry)
    try:
        with socket.create_connection(("127.0.0.1", httpd.server_port)) as s:
            took = _trickle_until_closed(s, every=0.25, limit=6.0)  # 4 bytes a second, each within the 1 s
        assert took < 3.0, f"a trickling request was still open after {took:.1f} s (deadline 1 s)"
        _scrape(httpd.server_port)  # a whole request is still served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_one_peer_cannot_take_every_slot():
    """Audit: 32 connections from one address held all 32 slots. Now one IP address holds at most
    MAX_CONNECTIONS_PER_PEER; a scrape from another address is served meanwhile, and the peer's extra
    connections are closed at accept."""
    import http.client

    registry = CollectorRegistry()
    Counter("promptcache_probe", "a probe", registry=registry).inc()
    httpd, thread = metricsserver.serve(0, "127.0.0.1", registry)
    port = httpd.server_port
    held = []
    try:
        for _ in range(metricsserver.MAX_CONNECTIONS):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"G")  # a request begun, never finished (within the 10 s deadline)
            held.append(c)
        beyond = metricsserver.MAX_CONNECTIONS - metricsserver.MAX_CONNECTIONS_PER_PEER
        deadline = time.monotonic() + 5
        while httpd.refused_peer < beyond and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpd.refused_peer == beyond, (httpd.refused, httpd.refused_peer)
        other = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=("127.0.0.2", 0))
        other.request("GET", "/metrics")
        answer = other.getresponse()
        assert answer.status == 200 and b"promptcache_probe_total 1.0" in answer.read()
        other.close()
        closed = 0
        for c in held:
            c.settimeout(0.5)
            try:
                closed += c.recv(1) == b""
            except socket.timeout:
                pass
            except OSError:
                closed += 1
        assert closed == beyond  # the ones over the peer's share were closed at accept; its first ones are open
    finally:
        for c in held:
            c.close()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
