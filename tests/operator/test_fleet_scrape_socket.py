"""fleet.scrape() reads the answer through its own descriptor of the connection (no CPython socket internals): an
answer with Connection: close (http.client closes its socket before the body is read) is read in full, every
descriptor is closed once the scrape returns, and the deadline still holds. Sizes are int64 byte counts, one
bound shared with the sidecar (promptcache.contract.quantity.MAX_INT64)."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from promptcache.contract.quantity import MAX_INT64
from promptcache.operator import fleet, tuning

BODY = b'promptcache_hit_tokens_total{tier="device"} 3\n' + b"# padding\n" * 20000


def _serve(handler) -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.recv(65536)
                handler(c)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return srv, t


def _closed_by_client(c: socket.socket, wait: float = 5.0) -> bool:
    """Whether the client closed the connection (every descriptor of it: a FIN arrives) within `wait`."""
    c.settimeout(wait)
    try:
        while c.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:   # reset: closed too
        return True


@pytest.mark.parametrize("headers", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n",
])
def test_a_closing_answer_is_read_in_full_and_the_connection_closed(headers):
    closed: list[bool] = []

    def answer(c):
        c.sendall(headers % len(BODY))
        for i in range(0, len(BODY), 4096):   # in pieces: the body arrives after http.client closed its socket
            c.sendall(BODY[i:i + 4096])
        closed.append(_closed_by_client(c))
    srv, _ = _serve(answer)
    try:
        url = f"http://127.0.0.1:{srv.getsockname()[1]}/metrics"
        for n in range(1, 6):
            got = fleet.scrape(url, timeout=5)
            assert got is not None and got.tokens.memory_hits == 3
            deadline = time.monotonic() + 10
            while len(closed) < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert closed == [True] * n   # no descriptor of it left open once the scrape returned
    finally:
        srv.close()


def test_a_body_ending_with_the_connection_is_read_in_full():
    def answer(c):
        c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        for i in range(0, len(BODY), 4096):
            c.sendall(BODY[i:i + 4096])
        c.shutdown(socket.SHUT_WR)
    srv, _ = _serve(answer)
    try:
        got = fleet.scrape(f"http://127.0.0.1:{srv.getsockname()[1]}/metrics", timeout=5)
        assert got is not None and got.tokens.memory_hits == 3
    finally:
        srv.close()


def test_a_trickle_past_the_deadline_is_a_failed_scrape_and_the_connection_closed():
    closed: list[bool] = []

    def answer(c):
        c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                c.sendall(b"# x\n")
            except OSError:   # the client closed it
                closed.append(True)
                return
            time.sleep(0.05)
        closed.append(False)
    srv, _ = _serve(answer)
    try:
        t0 = time.monotonic()
        assert fleet.scrape(f"http://127.0.0.1:{srv.getsockname()[1]}/metrics", timeout=0.5) is None
        assert time.monotonic() - t0 < 3
        while not closed:
            time.sleep(0.05)
        assert closed == [True]
    finally:
        srv.close()


def test_sizes_are_int64_byte_counts_as_everywhere():
    assert fleet.mrc_size(str(MAX_INT64)) == MAX_INT64
    assert fleet.mrc_size(str(MAX_INT64 + 1)) is None   # 2^63 is no int64 (the API server and sidecar hold none)
    curve = ((1 << 20, 0.1), (MAX_INT64, 0.5), (MAX_INT64 + 1, 0.6))
    got = tuning.sanitize(tuning.Signal(0.5, 1.0, 0.0, curve=curve)).curve
    assert got is not None and sorted(s for s, _ in got) == [1 << 20, MAX_INT64]
    assert "memoryBytes" not in fleet.status_usage([fleet.Counters(all_tiers_stored_bytes=float(MAX_INT64 + 1))])
    assert fleet.status_usage([fleet.Counters(all_tiers_stored_bytes=float(1 << 62))])["memoryBytes"] == 1 << 62
