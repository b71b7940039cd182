"""Addresses users write (promptcache.contract.addresses): gRPC takes a port out of range modulo 65536 and an empty
one as 443, so a wrong address would listen on, or dial, a port nobody asked for. Each is refused with a message
that names what is wrong."""
from __future__ import annotations

import pytest

from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec
from promptcache.contract.addresses import listen_address_error, target_error, zmq_endpoint_error


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.0.0.1:50051", "0.0.0.0:65535", "[::1]:50051", "[::]:0",
                                     "localhost:1", "unix:/run/pc/grpc.sock", "unix:///run/pc/grpc.sock",
                                     "unix:relative.sock", "unix-abstract:promptcache", "node-1.example:50051"])
def test_listen_addresses_taken(address):
    assert listen_address_error(address) == ""


@pytest.mark.parametrize("address,words", [
    ("127.0.0.1:65536", "'65536' is not a number within 0..65535"), ("127.0.0.1:99999", "'99999'"),
    ("127.0.0.1:", "the port ''"), ("127.0.0.1:-1", "'-1'"), ("127.0.0.1:+5", "'+5'"), ("127.0.0.1:5 ", "'5 '"),
    ("127.0.0.1:\u0665", "is not a number"), ("127.0.0.1:1e3", "'1e3'"), ("localhost", "neither HOST:PORT"),
    ("::1:50051", "[::1]:50051"), ("unix:", "needs a path"), ("unix:///", "needs a path"),
    ("unix-abstract:", "needs a name"),
    # gRPC's Python server cannot listen on these (":PORT" failed at start saying the port was in use)
    (":50051", "names no host: use 0.0.0.0:PORT"), ("*:50051", "[::]:PORT (every address)"),
    ("[::1]", "needs :PORT after it"), ("[::]", "needs :PORT after it"),
    ("dns:///0.0.0.0:50051", "dns: is not an address to listen on"), ("UNIX:/run/pc.sock", "lower case: unix:"),
])
def test_listen_addresses_refused(address, words):
    assert words in listen_address_error(address)


@pytest.mark.parametrize("target,words", [
    ("127.0.0.1:50051", ""), ("dns:///promptcache.ns.svc:50051", ""), ("ipv4:127.0.0.1:50051", ""),
    ("[::1]:50051", ""), ("unix:/run/pc/grpc.sock", ""), ("node-cache.ns.svc.cluster.local:50051", ""),
    ("127.0.0.1:0", "must not be 0"), ("127.0.0.1:99999", "'99999'"), ("promptcache", "not HOST:PORT"),
    ("unix:", "needs a path"), (":50051", "not HOST:PORT"),
    # schemes are case-insensitive, as gRPC's channels take them; an unknown one is named as such
    ("DNS:///promptcache.ns.svc:50051", ""), ("Unix:/run/pc/grpc.sock", ""), ("unix-abstract:promptcache", ""),
    ("unix-abstract:", "needs a name"), ("[::1]", "needs :PORT after it"),
    ("passthrough:///localhost:50051", "unknown scheme passthrough"), ("http://localhost:50051", "unknown scheme http"),
    ("localhost:abc", "the port 'abc' is not a number"),
])
def test_targets(target, words):
    got = target_error(target)
    assert (words in got and got) if words else got == ""


@pytest.mark.parametrize("endpoint,words", [
    ("tcp://127.0.0.1:5557", ""), ("tcp://*:5557", ""), ("tcp://127.0.0.1:*", ""), ("tcp://127.0.0.1:0", ""),
    ("tcp://[::1]:5557", ""), ("ipc:///run/pc/events", ""), ("tcp://127.0.0.1:70000", "'70000'"),
    ("tcp://127.0.0.1", "needs HOST:PORT"), ("tcp://:5557", "needs HOST:PORT"), ("ipc://", "needs a path"),
    ("udp://127.0.0.1:5557", "neither"), ("tcp://127.0.0.1:5557\n", "white space"),
])
def test_zmq_endpoints(endpoint, words):
    got = zmq_endpoint_error(endpoint)
    assert (words in got and got) if words else got == ""


def test_a_client_refuses_an_address_grpc_would_dial_elsewhere():
    with pytest.raises(ValueError, match=r"sidecar address '127.0.0.1:99999': the port '99999' is not a number"):
        PromptCacheClient("127.0.0.1:99999")


def test_a_client_takes_numpy_numbers():
    import numpy as np

    c = PromptCacheClient("127.0.0.1:50051", timeout=np.float64(3), retries=np.int64(2), frame_bytes=np.int32(1 << 20))
    assert (c.timeout, c.retries, c.frame_bytes) == (3.0, 2, 1 << 20) and type(c.retries) is int
    c.close()


@pytest.mark.parametrize("kwargs,words", [
    ({"timeout": float("nan")}, "timeout=...) must be a number of seconds above 0, got nan"),
    ({"timeout": 10 ** 400}, "timeout=...) must be a number of seconds above 0"),  # OverflowError before
    ({"timeout": 0}, "timeout=...) must be a number of seconds above 0"), ({"retries": -1}, "retries=..."),
    ({"retries": 1.5}, "retries=..."), ({"backoff": float("inf")}, "backoff=..."),
    ({"frame_bytes": 0}, "frame_bytes=...) must be a whole number of bytes above 0"),
    ({"chunk_tokens": 100}, "chunk_tokens=...) must be None (the sidecar's) or a power of two"),
    ({"bulk_lent_cache_bytes": -1}, "bulk_lent_cache_bytes=..."),
])
def test_a_client_refuses_numbers_it_cannot_use_naming_the_argument(kwargs, words):
    with pytest.raises(ValueError) as info:
        PromptCacheClient("127.0.0.1:50051", **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("method", ["put", "put_blobs"])
@pytest.mark.parametrize("hints,words", [
    ({"priority": -1}, "priority=...) must be a whole number in 0..4294967295"), ({"priority": 2 ** 32}, "priority"),
    ({"priority": 1.0}, "priority"), ({"priority": False}, "priority"),
    ({"ttl_seconds": "60"}, "ttl_seconds=...) must be a number of seconds, 0 or more"),
    ({"ttl_seconds": float("nan")}, "ttl_seconds"), ({"ttl_seconds": -0.5}, "ttl_seconds"),
    ({"ttl_seconds": 10 ** 400}, "got " + "1" + "0" * 23 + "... (401 characters)"),
])
def test_a_client_refuses_retention_hints_it_cannot_send_naming_the_argument(method, hints, words):
    """Before any call: no sidecar listens here (unchecked, gRPC failed with UNKNOWN "Exception iterating
    requests!"; full tests against a sidecar on every transport: test_retention.py)."""
    c = PromptCacheClient("127.0.0.1:1", chunk_tokens=16, timeout=1, retries=0)
    try:
        with pytest.raises(ValueError) as info:
            getattr(c, method)(ModelSpec("m", "r", "float32", 1, 1, 8), list(range(16)), {} if method == "put_blobs"
                               else [], **hints)
        assert f"PromptCacheClient.{method}(" in str(info.value) and words in str(info.value)
    finally:
        c.close()
