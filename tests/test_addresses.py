"""Addresses users write (promptcache.contract.addresses): gRPC takes a port out of range modulo 65536 and an empty
one as 443, so a wrong address would listen on, or dial, a port nobody asked for. Each is refused with a message
that names what is wrong."""
from __future__ import annotations

import pytest

from promptcache.client import PromptCacheClient
from promptcache.contract.addresses import listen_address_error, target_error, zmq_endpoint_error


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.0.0.1:50051", "0.0.0.0:65535", "[::1]:50051", "[::]:0",
                                     ":50051", "localhost:1", "unix:/run/pc/grpc.sock", "unix:///run/pc/grpc.sock",
                                     "unix:relative.sock", "unix-abstract:promptcache"])
def test_listen_addresses_taken(address):
    assert listen_address_error(address) == ""


@pytest.mark.parametrize("address,words", [
    ("127.0.0.1:65536", "'65536' is not a number within 0..65535"), ("127.0.0.1:99999", "'99999'"),
    ("127.0.0.1:", "the port ''"), ("127.0.0.1:-1", "'-1'"), ("127.0.0.1:+5", "'+5'"), ("127.0.0.1:5 ", "'5 '"),
    ("127.0.0.1:\u0665", "is not a number"), ("127.0.0.1:1e3", "'1e3'"), ("localhost", "neither HOST:PORT"),
    ("::1:50051", "[::1]:50051"), ("unix:", "needs a path"), ("unix:///", "needs a path"),
    ("unix-abstract:", "needs a name"),
])
def test_listen_addresses_refused(address, words):
    assert words in listen_address_error(address)


@pytest.mark.parametrize("target,words", [
    ("127.0.0.1:50051", ""), ("dns:///promptcache.ns.svc:50051", ""), ("ipv4:127.0.0.1:50051", ""),
    ("[::1]:50051", ""), ("unix:/run/pc/grpc.sock", ""), ("node-cache.ns.svc.cluster.local:50051", ""),
    ("127.0.0.1:0", "must not be 0"), ("127.0.0.1:99999", "'99999'"), ("promptcache", "not HOST:PORT"),
    ("unix:", "needs a path"), (":50051", "not HOST:PORT"),
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


@pytest.mark.parametrize("kwargs,words", [
    ({"timeout": float("nan")}, "timeout=...) must be a number of seconds above 0, got nan"),
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
