"""The helpers that start sidecars for the tests and benchmarks (promptcache_devtools.procs)."""
from __future__ import annotations

import socket

from promptcache_devtools.procs import free_port


def test_free_port_never_hands_out_a_port_twice():
    # The kernel may give the same ephemeral port to two binds in a row; a sidecar given it for both --grpc-address and
    # --metrics-port failed to start in CI ("Address already in use").
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:  # and what it hands out is bindable
        s.bind(("127.0.0.1", ports[-1]))


def test_a_sidecar_start_that_lost_its_port_is_retried_on_new_ones(monkeypatch):
    import support

    from promptcache_devtools.procs import port_taken

    with socket.socket() as taken:  # another process listens on the first port handed out
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        monkeypatch.setattr(support, "free_port", lambda: next(ports, None) or free_port())
        sc = support.SidecarProcess()
        first = sc.proc
        try:
            sc.wait_ready()
            assert first.wait(5) == 2 and sc.proc is not first and busy not in (sc.port, sc.metrics_port)
        finally:
            sc.stop()
    assert port_taken("cannot start: cannot listen on --grpc-address 127.0.0.1:1: the port is in use")
    assert not port_taken("cannot start: --memory-bytes: not a quantity")
