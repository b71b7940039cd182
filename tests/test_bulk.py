"""The bulk channel (docs/bulk-channel.md): Get over a plain socket next to gRPC, against a real sidecar.

Raw-socket tests speak the framing by hand (promptcache.contract.bulkwire) to send what the client never would.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
import torch

from promptcache.contract import bulkwire
from promptcache.client import PromptCacheClient, errors
from promptcache.contract.keys import ModelSpec
from promptcache.sidecar.config import Settings
from promptcache.sidecar.app import Sidecar
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.contract.wire import model_to_proto
from support import CHUNK, SMALL, free_port, make_kv, make_writable, metric
from test_auth import pki, token_dir  # noqa: F401 - fixtures

TOKENS = list(range(3 * CHUNK))


@pytest.fixture
def bulk_sidecar(sidecar_factory, tmp_path):
    return sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock")


def _raw(sidecar) -> socket.socket:
    family, addr = bulkwire.parse_address(sidecar.bulk_address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(addr)
    return s


def _hello(s: socket.socket, authorization: str = "") -> pb.BulkStatus:
    bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=1, authorization=authorization)))
    return bulkwire.recv(s).status


def _get(s: socket.socket, request: pb.GetRequest) -> tuple[list[bytes], pb.BulkStatus]:
    bulkwire.send(s, pb.BulkFrame(get=request))
    chunks = []
    while True:
        frame = bulkwire.recv(s)
        if frame.WhichOneof("frame") == "status":
            return chunks, frame.status
        if request.HasField("shared_buffer"):  # the bytes are in the shared buffer, not on the socket
            chunks.append(frame.chunk)
            continue
        data = bytearray(frame.chunk.nbytes)
        bulkwire.recv_into(s, data)
        chunks.append(bytes(data))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("transport", ["unix-lent", "unix-memfd", "unix", "tcp"])
def test_bulk_put_and_get_are_bit_identical(sidecar_factory, tmp_path, dtype, transport):
    """unix-lent: chunks lent as sealed memfds (zero copy), put through the client's memfd; unix-memfd: put
    and got through the client's memfd (the sidecar's zero copy off); unix, tcp: bytes on the socket."""
    address = f"unix:{tmp_path}/bulk.sock" if transport.startswith("unix") else f"127.0.0.1:{free_port()}"
    sidecar = sidecar_factory(bulk_address=address,
                              bulk_zero_copy="on" if transport == "unix-lent" else "off" if address[0] == "u"
                              else "auto")
    spec = ModelSpec("test/bulk", "r1", dtype, num_layers=2, num_kv_heads=2, head_dim=8)
    kv = make_kv(spec, len(TOKENS))
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address,
                           bulk_shared_memory=transport in ("unix-lent", "unix-memfd")) as c:
        assert c.put(spec, TOKENS, kv).stored_chunks == 3
        n, got = c.get(spec, TOKENS)
    assert n == len(TOKENS)
    for (k, v), (gk, gv) in zip(kv, got):
        assert gk.dtype == k.dtype and torch.equal(gk, k) and torch.equal(gv, v)
    # It really went over the bulk channel, not the gRPC fallback.
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkPut"}') == 1
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="Put"}') == 0
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkGet"}') == 1
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="Get"}') == 0
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkBuffer"}') == (
        1 if transport in ("unix-lent", "unix-memfd") else 0)
    assert metric(sidecar, "promptcache_bulk_lent_chunks_total") == (3 if transport == "unix-lent" else 0)


@pytest.mark.parametrize("transport", ["unix-memfd", "tcp"])
def test_a_bulk_put_through_the_clients_memfd_is_checked_from_the_sidecars_copy(sidecar_factory, tmp_path,
                                                                                 monkeypatch, transport):
    """The client can still write its memfd while the sidecar copies a Put out of it, so those bytes go through
    ChunkCheck's client_writable path (copied, then checked from the chunk: tests/test_engine.py shows the race it
    closes); bytes received into the sidecar's own buffer take the one-pass path."""
    from promptcache.sidecar.store import ChunkCheck

    seen = []
    inner = ChunkCheck.copy_in
    monkeypatch.setattr(ChunkCheck, "copy_in",
                        lambda self, at, src, client_writable=False: (seen.append(client_writable),
                                                                      inner(self, at, src, client_writable))[1])
    address = f"unix:{tmp_path}/bulk.sock" if transport.startswith("unix") else f"127.0.0.1:{free_port()}"
    sidecar = sidecar_factory(bulk_address=address, bulk_zero_copy="off" if address[0] == "u" else "auto")
    spec = ModelSpec("test/bulk", "r1", "float32", num_layers=2, num_kv_heads=2, head_dim=8)
    kv = make_kv(spec, len(TOKENS))
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address,
                           bulk_shared_memory=transport == "unix-memfd") as c:
        assert c.put(spec, TOKENS, kv).stored_chunks == 3
        _, got = c.get(spec, TOKENS)
    assert all(torch.equal(gk, k) and torch.equal(gv, v) for (k, v), (gk, gv) in zip(kv, got))
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkPut"}') == 1
    assert len(seen) >= 3 and set(seen) == {transport == "unix-memfd"}


def test_a_bulk_put_hashes_each_chunk_just_before_sending_it(sidecar_factory, monkeypatch):
    """Over a socket the client sends chunk i as soon as its frame (with its xxh3) is built, so the sidecar
    receives and verifies it while chunk i+1 is hashed: not every chunk hashed before the first byte leaves.
    Each chunk is hashed once."""
    from promptcache.client import transport

    sidecar = sidecar_factory(bulk_address=f"127.0.0.1:{free_port()}")
    spec = ModelSpec("test/bulk-order", "r1", "float16", num_layers=2, num_kv_heads=2, head_dim=8)
    kv = make_kv(spec, len(TOKENS))
    me, events = threading.get_ident(), []
    hashed, sent = transport.PutCall.checksum, bulkwire.send_buffers

    def checksum(self, index):
        if index not in self.sums:
            events.append(("hash", index))
        return hashed(self, index)

    def send_buffers(sock, buffers, *a, **k):
        if threading.get_ident() == me:
            frames = [bulkwire._parse(b[bulkwire._LENGTH.size:]) for b in buffers
                      if isinstance(b, bytes)]  # the frames (a chunk's bytes are its array)
            events.append(("send", tuple(f.chunk.index if f.WhichOneof("frame") == "chunk" else "put"
                                         for f in frames)))
        return sent(sock, buffers, *a, **k)

    monkeypatch.setattr(transport.PutCall, "checksum", checksum)
    monkeypatch.setattr(bulkwire, "send_buffers", send_buffers)
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address) as c:
        assert c.put(spec, TOKENS, kv).stored_chunks == 3
        n, got = c.get(spec, TOKENS)
    assert events == [("hash", 0), ("send", ("put", 0)), ("hash", 1), ("send", (1,)), ("hash", 2), ("send", (2,))]
    assert n == len(TOKENS) and all(torch.equal(a, b) for pair in zip(kv, got) for a, b in zip(*pair))
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkPut"}') == 1


@pytest.mark.parametrize("n_tokens", [0, 1, 31, 32, 4000, 70000])
def test_get_frames_encode_as_protobuf_does(n_tokens):
    request = pb.GetRequest(model=model_to_proto(SMALL), tokens=list(range(n_tokens)), start_chunk=1)
    assert bulkwire.encode_get(request) == bulkwire.encode(pb.BulkFrame(get=request))


def _pairs(n: int, size: int) -> list[bytes]:
    out = []
    for i in range(n):
        out += [struct.pack("<I", i), bytes([i]) * size]
    return out


def _drain(s: socket.socket, box: list, delay: float) -> None:
    time.sleep(delay)
    data = bytearray()
    while chunk := s.recv(1 << 20):
        data += chunk
    box.append(bytes(data))


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_send_buffers_past_its_deadline_finishes_the_pair_it_is_in_and_stops(delay):
    """A Get's chunks are sent in batches (a frame, then its bytes); past --max-call-seconds the batch stops at a
    chunk's end, so the status frame that follows is read in step. Nothing sent is partial or out of order."""
    import threading

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    a.settimeout(10)
    buffers = _pairs(8, 1 << 20)
    box = []
    reader = threading.Thread(target=_drain, args=(b, box, delay))
    reader.start()
    done = bulkwire.send_buffers(a, buffers, deadline=time.monotonic() + 0.1, whole=2)
    a.close()
    reader.join()
    b.close()
    assert box[0] == b"".join(buffers[:done])
    if delay:  # the reader waits past the deadline: the first pair is finished, and no other is begun
        assert done % 2 == 0 and 2 <= done < len(buffers)
    else:
        assert done == len(buffers)


def test_send_buffers_after_its_deadline_sends_nothing_and_skips_empty_buffers():
    a, b = socket.socketpair()
    assert bulkwire.send_buffers(a, _pairs(2, 10), deadline=time.monotonic() - 1, whole=2) == 0
    assert bulkwire.send_buffers(a, [b"", b"ab", b"", b"c", b""]) == 5
    a.close()
    assert b.recv(100) == b"abc"
    b.close()


def test_bulk_longest_prefix_and_owned_copies(bulk_sidecar):
    with PromptCacheClient(bulk_sidecar.address, bulk_address=bulk_sidecar.bulk_address) as c:
        c.put(SMALL, TOKENS[:2 * CHUNK], make_kv(SMALL, 2 * CHUNK))
        other = TOKENS[:CHUNK] + [9999] * CHUNK + TOKENS[2 * CHUNK:]
        first = c.get_blobs(SMALL, TOKENS)  # chunks 0, 1 cached; chunk 2 missing
        assert len(first) == 2
        kept = [b.clone() for b in first]
        assert len(c.get_blobs(SMALL, other)) == 1  # shares only chunk 0
        assert len(c.get_blobs(SMALL, TOKENS, start_chunk=1)) == 1
        assert c.get_blobs(SMALL, [5] * CHUNK) == []
        # copy=True (the default) hands out owned tensors: later calls do not change them.
        assert all(torch.equal(a, b) for a, b in zip(first, kept))
        views = c.get_blobs(SMALL, TOKENS, copy=False)
        assert all(torch.equal(a, b) for a, b in zip(views, kept))


def test_bulk_corrupt_chunk_is_never_served(sidecar_factory, tmp_path):
    # Chunks in plain memory, copied to the client (lent chunks are immutable: tests/test_lent_chunks.py).
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", bulk_zero_copy="off")
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        keys = [ch.key for ch in c.lookup(SMALL, TOKENS).chunks]
        make_writable(sidecar.tier._entries[keys[1]])  # as if its memory could not be made read-only
        sidecar.tier._entries[keys[1]].data[7] ^= 0x10
        assert len(c.get_blobs(SMALL, TOKENS)) == 1  # chunk 0 only; the corrupt one ends the prefix
    assert metric(sidecar, 'promptcache_checksum_failures_total{tier="device"}') == 1


@pytest.mark.parametrize("send, code, words", [
    (lambda s: bulkwire.send(s, pb.BulkFrame(get=pb.GetRequest())), grpc.StatusCode.INVALID_ARGUMENT,
     "must start with a hello"),
    (lambda s: bulkwire.send(s, pb.BulkFrame(hello=pb.BulkHello(version=7))), grpc.StatusCode.FAILED_PRECONDITION,
     "version 7"),
    (lambda s: s.sendall(struct.pack("<I", 1 << 30)), grpc.StatusCode.INVALID_ARGUMENT, "over the limit"),
    (lambda s: s.sendall(struct.pack("<I", 3) + b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT,
     "not a valid BulkFrame"),
    (lambda s: s.sendall(struct.pack("<I", 0)), grpc.StatusCode.INVALID_ARGUMENT, "none of hello"),
])
def test_bulk_malformed_frames_are_refused_and_the_server_keeps_serving(bulk_sidecar, send, code, words):
    s = _raw(bulk_sidecar)
    send(s)
    status = bulkwire.recv(s).status
    assert status.code == code.value[0] and words in status.message
    assert s.recv(1) == b""  # the connection is closed after a framing error
    s.close()
    with PromptCacheClient(bulk_sidecar.address, bulk_address=bulk_sidecar.bulk_address) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        assert len(c.get_blobs(SMALL, TOKENS)) == 3


@pytest.mark.parametrize("request_, words", [
    (pb.GetRequest(tokens=TOKENS), "model is missing"),
    (pb.GetRequest(model=model_to_proto(SMALL)), "tokens is empty"),
    (pb.GetRequest(model=pb.Model(model_id="m", kv_dtype=pb.DTYPE_FLOAT16), tokens=TOKENS), "num_layers"),
    (pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS, shared_buffer=pb.SharedBuffer(name="x")),
     "shared_buffer"),
])
def test_bulk_bad_requests_get_a_status_naming_the_problem(bulk_sidecar, request_, words):
    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    chunks, status = _get(s, request_)
    assert chunks == [] and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert words in status.message
    # A bad request does not end the connection: the next one on it is served.
    chunks, status = _get(s, pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS))
    assert status.code == 0 and chunks == []
    s.close()


def test_bulk_requires_the_token_and_keeps_tenants_apart(sidecar_factory, token_dir, tmp_path):  # noqa: F811
    sidecar = sidecar_factory(token_file=str(token_dir), bulk_address=f"unix:{tmp_path}/bulk.sock")
    s = _raw(sidecar)
    status = _hello(s, "Bearer not-a-token")
    assert status.code == grpc.StatusCode.UNAUTHENTICATED.value[0] and "bearer token" in status.message
    s.close()
    with pytest.raises(errors.Unauthenticated):
        with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, token="wrong", retries=0) as c:
            c.get_blobs(SMALL, TOKENS)
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, token="alice-token-1") as alice, \
            PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, token="bob-token-1") as bob:
        alice.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        assert len(alice.get_blobs(SMALL, TOKENS)) == 3
        assert bob.get_blobs(SMALL, TOKENS) == []
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkGet"}') == 2


def test_bulk_stalled_frame_is_dropped_but_idle_connections_stay(sidecar_factory, tmp_path):
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", stream_idle_seconds=0.3)
    idle, stalled = _raw(sidecar), _raw(sidecar)
    assert _hello(idle).code == 0 and _hello(stalled).code == 0
    stalled.sendall(struct.pack("<I", 100) + b"\x12")  # announces 100 bytes, sends 1, stops
    time.sleep(1.0)
    assert stalled.recv(1) == b""  # dropped after --stream-idle-seconds
    chunks, status = _get(idle, pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS))
    assert status.code == 0  # an idle connection between frames is still served
    idle.close()
    stalled.close()


def test_bulk_connection_limit_falls_back_to_grpc(sidecar_factory, tmp_path):
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", bulk_max_connections=1)
    holder = _raw(sidecar)
    assert _hello(holder).code == 0
    extra = _raw(sidecar)
    status = bulkwire.recv(extra).status
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "--bulk-max-connections" in status.message
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        assert len(c.get_blobs(SMALL, TOKENS)) == 3  # served by gRPC Get instead
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="Get"}') == 1
    holder.close()


def test_client_falls_back_to_grpc_when_the_sidecar_has_no_bulk_channel(sidecar, tmp_path):
    with PromptCacheClient(sidecar.address, bulk_address=f"unix:{tmp_path}/nothing.sock") as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        assert len(c.get_blobs(SMALL, TOKENS)) == 3


def test_sidecar_stop_closes_bulk_connections_and_the_socket(sidecar_factory, tmp_path):
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock")
    s = _raw(sidecar)
    assert _hello(s).code == 0
    sidecar.stop(0)
    assert s.recv(1) == b""
    assert not (tmp_path / "bulk.sock").exists()


@pytest.mark.parametrize("overrides, words", [
    ({"bulk_address": "nowhere"}, "not HOST:PORT or unix:/PATH"),
    ({"bulk_address": "unix:relative.sock"}, "absolute path"),
    ({"bulk_address": "127.0.0.1:1", "bulk_max_connections": 0}, "--bulk-max-connections"),
    ({"bulk_address": "10.1.2.3:7000"}, "plaintext"),
])
def test_bad_bulk_settings_are_refused_at_start(overrides, words):
    settings = Settings(grpc_address="127.0.0.1:0", metrics_port=0, **overrides)
    with pytest.raises(ValueError, match=words):
        Sidecar(settings)


def test_bulk_channel_refuses_tcp_with_tls(pki):  # noqa: F811
    settings = Settings(grpc_address="127.0.0.1:0", metrics_port=0, tls_cert_file=pki.server_cert,
                        tls_key_file=pki.server_key, bulk_address="127.0.0.1:0")
    with pytest.raises(ValueError, match="no TLS"):
        Sidecar(settings)


def test_bulk_survives_random_and_mutated_frames(bulk_sidecar):
    """A small in-test fuzz: valid frames with random bytes flipped, cut or appended, on fresh connections.
    Every answer is a status frame or a closed connection, never a hang or a crash, and a real client is
    served afterwards."""
    import random

    rng = random.Random(1234)
    valid = [bulkwire.encode(pb.BulkFrame(hello=pb.BulkHello(version=1))),
             bulkwire.encode(pb.BulkFrame(get=pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS)))]
    for _ in range(150):
        data = bytearray(b"".join(valid))
        for _ in range(rng.randint(1, 4)):
            op = rng.choice(("flip", "cut", "append"))
            if op == "flip" and data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif op == "cut" and data:
                del data[rng.randrange(len(data)):]
            else:
                data += rng.randbytes(rng.randint(1, 64))
        s = _raw(bulk_sidecar)
        s.settimeout(0.5)
        try:
            s.sendall(bytes(data))
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except socket.timeout:
            pass  # a frame that announces more bytes than were sent waits for them: the client just leaves
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed by the server after a framing error, with our extra bytes unread
        s.close()
    with PromptCacheClient(bulk_sidecar.address, bulk_address=bulk_sidecar.bulk_address) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
        assert len(c.get_blobs(SMALL, TOKENS)) == 3
    assert metric(bulk_sidecar, 'promptcache_requests_total{code="INTERNAL",rpc="BulkGet"}') == 0


def _plain_file(path, size: int) -> int:
    import os

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    return fd


def _memfd(size: int, seal: bool = True) -> int:
    import fcntl
    import os

    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def _fifo(path) -> int:
    import os

    os.mkfifo(path)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def _socket_fd() -> int:
    import socket

    a, b = socket.socketpair()
    b.close()
    return a.detach()


@pytest.mark.parametrize("make_fd, length, words", [
    (lambda tmp: _fifo(tmp / "fifo"), 4096, "not a memfd"),  # nothing that could block a read or a mapping
    (lambda tmp: _socket_fd(), 4096, "not a memfd"),
    (lambda tmp: __import__("os").open(tmp, __import__("os").O_RDONLY | __import__("os").O_DIRECTORY), 4096,
     "not a memfd"),
    (lambda tmp: _memfd(4096, seal=False), 4096, "sealed against shrinking"),
    (lambda tmp: _plain_file(tmp / "plain", 4096), 4096, "sealed against shrinking"),
    (lambda tmp: _memfd(4096), 8192, "must be in 1..4096"),
    (lambda tmp: _memfd(4096), 0, "must be in 1..4096"),
])
def test_bulk_bad_shared_buffers_are_refused(bulk_sidecar, tmp_path, make_fd, length, words):
    import os

    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    fd = make_fd(tmp_path)
    bulkwire.send_with_fd(s, pb.BulkFrame(buffer=pb.BulkBuffer(length=length)), fd)
    status = bulkwire.recv(s).status
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and words in status.message
    # No buffer attached: a shared get is refused, and a plain get on the same connection still works.
    chunks, status = _get(s, pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS,
                                           shared_buffer=pb.SharedBuffer(length=4096)))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "no buffer frame" in status.message
    assert _get(s, pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS))[1].code == 0
    os.close(fd)
    s.close()


def test_bulk_descriptor_on_a_get_frame_is_refused(bulk_sidecar):
    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    bulkwire.send_with_fd(s, pb.BulkFrame(get=pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS)),
                          _memfd(4096))
    status = bulkwire.recv(s).status
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "only buffer frames" in status.message
    s.close()


def test_bulk_shared_buffer_cannot_be_shrunk_under_the_sidecar(bulk_sidecar):
    """The seal is what makes keeping the client's memory mapped safe: a client that tries to truncate its
    buffer (which would make the sidecar's next write fault with SIGBUS) is stopped by the kernel."""
    import os

    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    fd = _memfd(1 << 16)
    bulkwire.send_with_fd(s, pb.BulkFrame(buffer=pb.BulkBuffer(length=1 << 16)), fd)
    assert bulkwire.recv(s).status.code == 0
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with PromptCacheClient(bulk_sidecar.address, bulk_address=bulk_sidecar.bulk_address) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
    chunks, status = _get(s, pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS,
                                           shared_buffer=pb.SharedBuffer(length=1 << 16)))
    assert status.code == 0 and status.chunks == 3
    os.close(fd)
    s.close()


def test_bulk_revoked_token_stops_working_on_open_connections(sidecar_factory, tmp_path):
    from test_auth import write_secret_dir

    tokens = tmp_path / "tokens"
    write_secret_dir(tokens, {"alice": "alice-token-1"})
    sidecar = sidecar_factory(token_file=str(tokens), token_reload_seconds=0.05,
                              bulk_address=f"unix:{tmp_path}/bulk.sock")
    s = _raw(sidecar)
    assert _hello(s, "Bearer alice-token-1").code == 0
    request = pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS)
    assert _get(s, request)[1].code == 0
    write_secret_dir(tokens, {"alice": "alice-token-2"})  # rotated: the old token is revoked
    time.sleep(0.3)
    chunks, status = _get(s, request)
    assert status.code == grpc.StatusCode.UNAUTHENTICATED.value[0] and "no longer valid" in status.message
    assert s.recv(1) == b""
    s.close()


def test_bulk_get_slower_than_max_call_seconds_is_cancelled(sidecar_factory, tmp_path):
    """A client that reads an answer too slowly cannot hold chunk leases for ever."""
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", max_call_seconds=0.5,
                              memory_bytes=64 << 20, max_chunk_bytes=8 << 20)
    spec = ModelSpec("test/big", "r1", "float32", num_layers=16, num_kv_heads=8, head_dim=64)  # 2 MiB chunks
    tokens = list(range(8 * CHUNK))
    with PromptCacheClient(sidecar.address) as c:
        assert c.put(spec, tokens, make_kv(spec, len(tokens))).stored_chunks == 8
    s = _raw(sidecar)  # a unix socket buffers far less than the 16 MiB answer: the sidecar waits on us
    assert _hello(s).code == 0
    bulkwire.send(s, pb.BulkFrame(get=pb.GetRequest(model=model_to_proto(spec), tokens=tokens)))
    time.sleep(1.5)  # read nothing for longer than --max-call-seconds
    chunks, status = [], None
    while status is None:
        frame = bulkwire.recv(s)
        if frame.WhichOneof("frame") == "status":
            status = frame.status
        else:
            bulkwire.recv_into(s, bytearray(frame.chunk.nbytes))
            chunks.append(frame.chunk.index)
    assert status.code == grpc.StatusCode.CANCELLED.value[0] and "--max-call-seconds" in status.message
    assert 0 < len(chunks) < 8
    s.close()


# --- Put over the bulk channel ------------------------------------------------------------------------------
SHAPE = [SMALL.num_layers, 2, SMALL.num_kv_heads, CHUNK, SMALL.head_dim]
NBYTES = 2 * SMALL.num_layers * SMALL.num_kv_heads * CHUNK * SMALL.head_dim * 4  # float32


def _begin(index: int, data: bytes, **overrides) -> pb.ChunkBegin:
    import xxhash

    fields = dict(index=index, nbytes=len(data), shape=SHAPE, dtype=pb.DTYPE_FLOAT32,
                  xxh3_64=xxhash.xxh3_64_intdigest(data))
    fields.update(overrides)
    return pb.ChunkBegin(**fields)


def _send_put(s: socket.socket, chunks: list[tuple[pb.ChunkBegin, bytes]], tokens=TOKENS,
              model: pb.Model | None = None) -> None:
    header = pb.PutHeader(model=model or model_to_proto(SMALL), tokens=tokens)
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=len(chunks))))
    for begin, data in chunks:
        bulkwire.send(s, pb.BulkFrame(chunk=begin))
        s.sendall(data)


def _bulk_put(s: socket.socket, chunks, **kwargs) -> pb.BulkStatus:
    _send_put(s, chunks, **kwargs)
    return bulkwire.recv(s).status


def _grpc_put(sidecar, chunks, tokens=TOKENS, model: pb.Model | None = None) -> grpc.RpcError | pb.PutResponse:
    from promptcache.v1 import kvcache_pb2_grpc as pb_grpc

    def frames():
        yield pb.PutRequest(header=pb.PutHeader(model=model or model_to_proto(SMALL), tokens=tokens))
        for begin, data in chunks:
            yield pb.PutRequest(chunk=begin)
            yield pb.PutRequest(data=data)

    with grpc.insecure_channel(sidecar.address) as channel:
        try:
            return pb_grpc.KVCacheStub(channel).Put(frames(), timeout=10)
        except grpc.RpcError as exc:
            return exc


def _blob(seed: int, nbytes: int = NBYTES) -> bytes:
    """A chunk's bytes: finite float32 values (the sidecar refuses NaN and Inf in unquantized chunks)."""
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def test_bulk_put_hello_says_puts_are_taken(bulk_sidecar):
    s = _raw(bulk_sidecar)
    assert _hello(s).puts
    s.close()


def test_bulk_put_answers_like_grpc_put_and_stores_bit_identical_bytes(bulk_sidecar):
    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    blobs = [_blob(i) for i in range(3)]
    status = _bulk_put(s, [(_begin(i, b), b) for i, b in enumerate(blobs)])
    assert status.code == 0 and status.put == pb.PutResponse(stored_chunks=3, stored_bytes=3 * NBYTES)
    # Again: already cached, skipped, as gRPC Put answers.
    status = _bulk_put(s, [(_begin(i, b), b) for i, b in enumerate(blobs)])
    assert status.code == 0 and status.put == pb.PutResponse(skipped_chunks=3)
    chunks, status = _get(s, pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS))
    assert status.code == 0 and chunks == blobs
    s.close()
    assert metric(bulk_sidecar, 'promptcache_requests_total{code="OK",rpc="BulkPut"}') == 2
    assert metric(bulk_sidecar, 'promptcache_request_duration_seconds_count{rpc="BulkPut"}') == 2


def _cases():
    good = _blob(0)
    return [
        ("oversize", [(_begin(0, _blob(1, 2 * NBYTES)), _blob(1, 2 * NBYTES))], grpc.StatusCode.RESOURCE_EXHAUSTED,
         "--max-chunk-bytes"),
        ("wrong nbytes", [(_begin(0, good[:-8]), good[:-8])], grpc.StatusCode.INVALID_ARGUMENT, "need exactly"),
        ("wrong shape", [(_begin(0, good, shape=[2, 2, 2, CHUNK, 4]), good)], grpc.StatusCode.INVALID_ARGUMENT,
         "does not match the model's layout"),
        ("wrong dtype", [(_begin(0, good, dtype=pb.DTYPE_FLOAT16), good)], grpc.StatusCode.INVALID_ARGUMENT,
         "dtype"),
        ("index past the tokens", [(_begin(5, good), good)], grpc.StatusCode.INVALID_ARGUMENT, "chunk index 5"),
        ("sent twice", [(_begin(0, good), good), (_begin(0, good), good)], grpc.StatusCode.INVALID_ARGUMENT,
         "sent twice"),
        ("bad checksum", [(_begin(0, good, xxh3_64=12345), good)], grpc.StatusCode.DATA_LOSS, "checksum"),
    ]


@pytest.mark.parametrize("name, chunks, code, words", _cases(), ids=[c[0] for c in _cases()])
def test_bulk_put_refuses_what_grpc_put_refuses_with_the_same_status(sidecar_factory, tmp_path, name, chunks, code,
                                                                      words):
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", max_chunk_bytes=NBYTES)
    grpc_error = _grpc_put(sidecar, chunks)
    assert isinstance(grpc_error, grpc.RpcError) and grpc_error.code() == code and words in grpc_error.details()
    stored = sidecar.tier.usage()["used"]  # what gRPC Put stored before the bad frame (chunk 0 of "sent twice")
    s = _raw(sidecar)
    assert _hello(s).code == 0
    status = _bulk_put(s, chunks)
    assert status.code == code.value[0] and status.message == grpc_error.details()
    assert metric(sidecar, f'promptcache_requests_total{{code="{code.name}",rpc="BulkPut"}}') == 1
    assert sidecar.tier.usage()["used"] == stored
    # The rest of the failed put was read: the connection is in step and the next put is stored.
    good = [(_begin(i, b), b) for i, b in enumerate(_blob(10 + i) for i in range(3))]
    assert _bulk_put(s, good, tokens=[t + 50_000 for t in TOKENS]).put.stored_chunks == 3
    s.close()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_bulk_put_cut_short_stores_nothing_of_the_cut_chunk(sidecar_factory, tmp_path, transport):
    address = f"unix:{tmp_path}/bulk.sock" if transport == "unix" else f"127.0.0.1:{free_port()}"
    sidecar = sidecar_factory(bulk_address=address)
    s = _raw(sidecar)
    assert _hello(s).code == 0
    first, second = _blob(1), _blob(2)
    header = pb.PutHeader(model=model_to_proto(SMALL), tokens=TOKENS)
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=2)))
    bulkwire.send(s, pb.BulkFrame(chunk=_begin(0, first)))
    s.sendall(first)
    bulkwire.send(s, pb.BulkFrame(chunk=_begin(1, second)))
    s.sendall(second[:len(second) // 2])
    s.close()  # cut in the middle of chunk 1
    deadline = time.monotonic() + 5
    while metric(sidecar, 'promptcache_requests_total{code="CANCELLED",rpc="BulkPut"}') == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with PromptCacheClient(sidecar.address) as c:
        assert [bytes(b.numpy()) for b in c.get_blobs(SMALL, TOKENS)] == [first]  # chunk 0 whole, chunk 1 not
    usage = sidecar.tier.usage()
    assert usage["entries"] == 1 and usage["used"] == NBYTES  # the cut chunk's reservation was released


def test_bulk_put_stalled_mid_chunk_is_dropped_and_stores_nothing_of_it(sidecar_factory, tmp_path):
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", stream_idle_seconds=0.3)
    s = _raw(sidecar)
    assert _hello(s).code == 0
    data = _blob(1)
    header = pb.PutHeader(model=model_to_proto(SMALL), tokens=TOKENS)
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1)))
    bulkwire.send(s, pb.BulkFrame(chunk=_begin(0, data)))
    s.sendall(data[:100])
    time.sleep(1.0)
    assert s.recv(1) == b""  # dropped after --stream-idle-seconds
    assert sidecar.tier.usage()["used"] == 0 and sidecar.tier.usage()["entries"] == 0
    s.close()


def test_bulk_put_frames_are_bounded(bulk_sidecar):
    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    header = pb.PutHeader(model=model_to_proto(SMALL), tokens=TOKENS)
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1)))
    s.sendall(struct.pack("<I", 1 << 20))  # a "chunk frame" of 1 MiB
    status = bulkwire.recv(s).status
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "over the limit" in status.message
    assert s.recv(1) == b""
    s.close()
    # A get frame where a chunk frame belongs is a framing error too.
    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1)))
    bulkwire.send(s, pb.BulkFrame(get=pb.GetRequest()))
    status = bulkwire.recv(s).status
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "is a get" in status.message
    s.close()
    assert bulk_sidecar.tier.usage()["used"] == 0


def test_bulk_put_shared_buffer_offsets_are_checked(bulk_sidecar):
    import os

    s = _raw(bulk_sidecar)
    assert _hello(s).code == 0
    header = pb.PutHeader(model=model_to_proto(SMALL), tokens=TOKENS)
    data = _blob(3)
    # No buffer attached yet.
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1, shared_buffer=True)))
    bulkwire.send(s, pb.BulkFrame(chunk=_begin(0, data)))
    status = bulkwire.recv(s).status
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "no buffer frame" in status.message
    fd = _memfd(2 * NBYTES)
    os.pwrite(fd, data, NBYTES)
    bulkwire.send_with_fd(s, pb.BulkFrame(buffer=pb.BulkBuffer(length=2 * NBYTES)), fd)
    assert bulkwire.recv(s).status.code == 0
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1, shared_buffer=True)))
    bulkwire.send(s, pb.BulkFrame(chunk=_begin(0, data, buffer_offset=NBYTES + 8)))
    status = bulkwire.recv(s).status
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "runs past" in status.message
    bulkwire.send(s, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1, shared_buffer=True)))
    bulkwire.send(s, pb.BulkFrame(chunk=_begin(0, data, buffer_offset=NBYTES)))
    assert bulkwire.recv(s).status.put.stored_chunks == 1
    # The sidecar stored its own copy: the client writing its buffer afterwards changes nothing stored.
    os.pwrite(fd, b"\0" * NBYTES, NBYTES)
    assert _get(s, pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS))[0] == [data]
    os.close(fd)
    s.close()


def test_bulk_put_keeps_tenants_apart_and_checks_the_token(sidecar_factory, token_dir, tmp_path):  # noqa: F811
    sidecar = sidecar_factory(token_file=str(token_dir), bulk_address=f"127.0.0.1:{free_port()}")
    kv = make_kv(SMALL, len(TOKENS))
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, token="alice-token-1") as alice, \
            PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, token="bob-token-1") as bob:
        assert alice.put(SMALL, TOKENS, kv).stored_chunks == 3
        assert bob.get_blobs(SMALL, TOKENS) == []
        assert bob.put(SMALL, TOKENS, kv).stored_chunks == 3  # bob's own copy, under bob's salt
        assert len(alice.get_blobs(SMALL, TOKENS)) == 3
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="BulkPut"}') == 2
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="Put"}') == 0
    s = _raw(sidecar)
    assert _hello(s, "Bearer not-a-token").code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    s.close()


def test_client_puts_over_grpc_when_the_bulk_channel_takes_no_puts(sidecar, tmp_path):
    """An older sidecar's bulk channel (Get only) does not say `puts` in its hello answer: gRPC Put then."""
    import threading

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "old.sock"))
    listener.listen(4)

    def old_sidecar():
        conn, _ = listener.accept()
        with conn:
            bulkwire.recv(conn)
            bulkwire.send(conn, pb.BulkFrame(status=pb.BulkStatus(code=0)))
            conn.recv(1)  # nothing else is sent to it

    t = threading.Thread(target=old_sidecar, daemon=True)
    t.start()
    with PromptCacheClient(sidecar.address, bulk_address=f"unix:{tmp_path}/old.sock",
                           bulk_shared_memory=False) as c:
        assert c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS))).stored_chunks == 3
    t.join(5)
    listener.close()
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="Put"}') == 1


def test_client_puts_over_grpc_when_the_sidecar_has_no_bulk_channel(sidecar, tmp_path):
    with PromptCacheClient(sidecar.address, bulk_address=f"127.0.0.1:{free_port()}") as c:
        assert c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS))).stored_chunks == 3
        assert len(c.get_blobs(SMALL, TOKENS)) == 3
    assert metric(sidecar, 'promptcache_requests_total{code="OK",rpc="Put"}') == 1


def test_bulk_put_errors_raise_what_grpc_put_raises(sidecar_factory, tmp_path):
    """A status of the put itself is the answer (no silent retry over gRPC)."""
    sidecar = sidecar_factory(bulk_address=f"unix:{tmp_path}/bulk.sock", max_chunk_bytes=NBYTES // 2)
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, retries=0) as c:
        with pytest.raises(errors.ResourceExhausted, match="--max-chunk-bytes"):
            c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))
    assert metric(sidecar, 'promptcache_requests_total{code="RESOURCE_EXHAUSTED",rpc="BulkPut"}') == 1
    assert metric(sidecar, 'promptcache_requests_total{code="RESOURCE_EXHAUSTED",rpc="Put"}') == 0


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_owned_blobs_are_not_overwritten_by_later_gets(sidecar_factory, tmp_path, transport):
    address = f"unix:{tmp_path}/bulk.sock" if transport == "unix" else f"127.0.0.1:{free_port()}"
    sidecar = sidecar_factory(bulk_address=address)
    other = [t + 100_000 for t in TOKENS]
    with PromptCacheClient(sidecar.address, bulk_address=sidecar.bulk_address, bulk_shared_memory=False) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS), seed=1))
        c.put(SMALL, other, make_kv(SMALL, len(TOKENS), seed=2))
        first = c.get_blobs(SMALL, TOKENS)
        kept = [bytes(b.numpy()) for b in first]
        view = first[1][10:20]
        del first
        for _ in range(3):
            second = c.get_blobs(SMALL, other)  # may reuse memory of `first`, but not the chunk `view` holds
        assert bytes(view.numpy()) == kept[1][10:20]
        assert [bytes(b.numpy()) for b in c.get_blobs(SMALL, TOKENS)] == kept
        assert all(bytes(b.numpy()) != k for b, k in zip(second, kept))


@pytest.mark.parametrize("mode", ["0660", None])
def test_bulk_socket_mode_sets_who_may_connect(sidecar_factory, mode):
    """--bulk-socket-mode 0660 (what the operator's spec.zeroCopy sets): the socket's group may connect, others
    may not; without it the umask decides (022: only the owner). Checked with real processes of other uids."""
    import os
    import subprocess
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to run the connecting processes as other uids")
    python = "/usr/bin/python3"  # one other uids may run (the venv's may sit in root's home)
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} for the connecting processes")
    folder = tempfile.mkdtemp(prefix="pc-bulk-mode-")
    os.chmod(folder, 0o755)  # traversable by the other uids; the socket's own bits decide
    path = f"{folder}/bulk.sock"
    try:
        sidecar = sidecar_factory(bulk_address=f"unix:{path}", **({"bulk_socket_mode": mode} if mode else {}))
        st = os.stat(path)
        umask = os.umask(0)
        os.umask(umask)
        assert st.st_mode & 0o777 == (0o660 if mode else 0o777 & ~umask)

        errors = []

        def connects(**who) -> bool:
            code = ("import socket; s = socket.socket(socket.AF_UNIX); s.connect(%r); s.close()" % path)
            run = subprocess.run([python, "-c", code], capture_output=True, text=True, **who)
            errors.append(f"{who}: exit {run.returncode}, {run.stderr.strip().splitlines()[-1:] or 'no stderr'}")
            return run.returncode == 0
        group_member = connects(user=54321, group=54321, extra_groups=[st.st_gid])
        other = connects(user=54321, group=54321, extra_groups=[])
        # (a failure says why each connect failed: a permission error is the socket's mode, anything else is not)
        assert (group_member, other) == ((True, False) if mode else (False, False)), errors
        with PromptCacheClient(sidecar.address, bulk_address=f"unix:{path}") as c:  # the owner, as always
            assert c.get(SMALL, list(range(CHUNK)))[0] == 0
    finally:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("overrides, words", [
    ({"bulk_address": "unix:/tmp/x.sock", "bulk_socket_mode": "rw"}, "--bulk-socket-mode must be octal"),
    ({"bulk_address": "unix:/tmp/x.sock", "bulk_socket_mode": "0999"}, "--bulk-socket-mode must be octal"),
    ({"bulk_address": "127.0.0.1:0", "bulk_socket_mode": "0660"}, "needs a unix-socket --bulk-address"),
])
def test_bad_bulk_socket_mode_is_refused(overrides, words):
    with pytest.raises(ValueError, match=words):
        Settings(grpc_address="127.0.0.1:0", metrics_port=0, **overrides).validate()


def test_bulk_calls_count_against_max_calls_per_client_like_grpc(sidecar_factory, token_dir, tmp_path):  # noqa: F811
    """One call context for both transports (calls.Call): a Put in flight on the bulk channel holds one of the
    tenant's --max-calls-per-client, so a second call is refused, on the bulk channel as over gRPC, while another
    tenant's are not; the slot comes back when the Put ends."""
    sidecar = sidecar_factory(token_file=str(token_dir), bulk_address=f"unix:{tmp_path}/bulk.sock",
                              max_calls_per_client=1, stream_idle_seconds=5)
    holder, other = _raw(sidecar), _raw(sidecar)
    assert _hello(holder, "Bearer alice-token-1").code == 0 and _hello(other, "Bearer alice-token-1").code == 0
    data = _blob(2)
    header = pb.PutHeader(model=model_to_proto(SMALL), tokens=TOKENS)
    bulkwire.send(holder, pb.BulkFrame(put=pb.BulkPut(header=header, chunks=1)))
    bulkwire.send(holder, pb.BulkFrame(chunk=_begin(0, data)))
    holder.sendall(data[:100])  # alice's Put is in flight
    deadline = time.monotonic() + 5
    while sidecar.limiter.active("tenant:alice") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    request = pb.GetRequest(model=model_to_proto(SMALL), tokens=TOKENS)
    chunks, status = _get(other, request)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], status
    assert "--max-calls-per-client" in status.message and chunks == []
    with PromptCacheClient(sidecar.address, token="alice-token-1", retries=0) as alice, \
            PromptCacheClient(sidecar.address, token="bob-token-1", retries=0) as bob:
        with pytest.raises(errors.PromptCacheError, match="max-calls-per-client"):
            alice.lookup(SMALL, TOKENS)
        assert bob.lookup(SMALL, TOKENS).cached_tokens == 0  # bob's calls are his own
    holder.sendall(data[100:])  # the Put ends: its slot is given back
    assert bulkwire.recv(holder).status.code == 0
    chunks, status = _get(other, request)
    assert status.code == 0 and chunks == [data]
    assert metric(sidecar, 'promptcache_requests_total{code="RESOURCE_EXHAUSTED",rpc="BulkGet"}') == 1
