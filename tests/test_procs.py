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
