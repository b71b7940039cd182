"""The bulk channel's client against a sidecar that breaks the protocol (docs/bulk-channel.md, "Client").

The sidecar here is a small fake in this file, speaking the real framing (promptcache.contract.bulkwire): it plays
a misbehaving or compromised sidecar (answers that trickle in, never end, carry more chunks than asked, chunks of
another size, lent memfds whose bytes fail their checksum or hold NaN, stray descriptors, an answer sent twice),
which the real sidecar cannot be made to be. What must hold: the call ends by its deadline, no wrong tensor is
loaded (the call fails with CorruptChunk, DeadlineExceeded or Unavailable, which callers turn into a normal
prefill), no descriptor leaks, and the next call on the channel gets its own answer.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
import time
import types

import pytest
import torch
import xxhash

from promptcache.client import PromptCacheClient, errors
from promptcache.client import bulk as client_bulk
from promptcache.client.bulk import BulkClient, known_finite
from promptcache.client.client import checked_chunks
from promptcache.client.transport import _receive
from promptcache.contract import bulkwire
from promptcache.contract.keys import ModelSpec
from promptcache.contract.wire import model_to_proto
from promptcache.v1 import kvcache_pb2 as pb
from support import free_port

CT = 16
SPEC = ModelSpec("test/bad-sidecar", "r1", "float16", num_layers=2, num_kv_heads=2, head_dim=16)
CB = 2 * 2 * 2 * CT * 16 * 2  # bytes of one chunk of SPEC: 4096
ZEROS = bytes(CB)  # finite in every float dtype
NAN = b"\xff" * CB  # NaN in fp16


def _chunk(index: int, data: bytes, **fields) -> bytes:
    fields.setdefault("nbytes", len(data))
    fields.setdefault("xxh3_64", xxhash.xxh3_64_intdigest(data))
    return bulkwire.encode(pb.BulkFrame(chunk=pb.ChunkBegin(index=index, **fields)))


def _status(chunks: int, code: int = 0) -> bytes:
    return bulkwire.encode(pb.BulkFrame(status=pb.BulkStatus(code=code, chunks=chunks)))


def _sealed(data: bytes) -> int:
    fd = os.memfd_create("fake-lent", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, bulkwire.LENT_SEALS)
    return fd


class FakeSidecar:
    """A bulk-channel sidecar that answers each get with answer(conn, request, n) (n: 1 for the connection's first
    get). It lends memfds when the client asks and `lend` is set; it takes the client's buffer frame like the real
    one (self.shared: its mapping)."""

    def __init__(self, address: str, answer, lend: bool = False):
        self.address, self.answer, self.lend = address, answer, lend
        self.shared = None
        self.gets = 0
        family, addr = bulkwire.parse_address(address)
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind(addr)
        self.listener.listen(8)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            hello = bulkwire.recv(conn)
            conn.sendall(bulkwire.encode(pb.BulkFrame(status=pb.BulkStatus(
                code=0, puts=True, sealed_memfds=hello.hello.sealed_memfds and self.lend))))
            n = 0
            while True:
                fds: list[int] = []
                frame = bulkwire.recv(conn, fds=fds)
                if frame.WhichOneof("frame") == "buffer":
                    self.shared = mmap.mmap(fds[0], frame.buffer.length)
                    os.close(fds[0])
                    conn.sendall(_status(0))
                    continue
                n += 1
                self.gets += 1
                self.answer(conn, frame.get, n)
        except (OSError, bulkwire.FramingError):
            pass

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


@pytest.fixture
def fake(tmp_path):
    started: list[FakeSidecar] = []

    def start(answer, transport: str = "tcp", lend: bool = False) -> FakeSidecar:
        address = f"unix:{tmp_path}/bulk{len(started)}.sock" if transport != "tcp" else f"127.0.0.1:{free_port()}"
        started.append(FakeSidecar(address, answer, lend))
        return started[-1]

    yield start
    for f in started:
        f.close()


def _client(fake_sidecar: FakeSidecar, timeout: float = 5.0) -> PromptCacheClient:
    # No gRPC sidecar behind it: a call the channel cannot take falls back to a gRPC call that fails (Unavailable).
    return PromptCacheClient(f"127.0.0.1:{free_port()}", timeout=timeout, retries=0, chunk_tokens=CT,
                             bulk_address=fake_sidecar.address)


def _request(tokens, start_chunk: int = 0, max_chunks: int = 0) -> pb.GetRequest:
    return pb.GetRequest(model=model_to_proto(SPEC), tokens=tokens, start_chunk=start_chunk, max_chunks=max_chunks)


def _open_memfds() -> int:
    """Descriptors of this process open on a memfd (the fake's sockets are in this process too: not counted)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return count


# --- item: the deadline holds however the answer trickles ------------------------------------------------------
def _trickle_bytes(conn, request, n):
    conn.sendall(_chunk(request.start_chunk, ZEROS))
    for i in range(CB):  # one byte per 20 ms: each recv gets something long before the socket's timeout
        conn.sendall(ZEROS[i:i + 1])
        time.sleep(0.02)


def _trickle_frames(conn, request, n):
    frame = _chunk(request.start_chunk, ZEROS, buffer_offset=0)
    for i in range(len(frame)):  # the frame itself one byte at a time (the shared-memory path: frames only)
        conn.sendall(frame[i:i + 1])
        time.sleep(0.1)
    while True:
        conn.sendall(b"\x00")
        time.sleep(0.1)


@pytest.mark.parametrize("transport, answer", [("tcp", _trickle_bytes), ("unix-memfd", _trickle_frames)])
def test_an_answer_that_trickles_in_ends_at_the_calls_deadline(fake, transport, answer):
    sidecar = fake(answer, transport)
    with _client(sidecar) as c:
        t0 = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            c.get_blobs(SPEC, list(range(2 * CT)), timeout=0.6)
        assert time.monotonic() - t0 < 2.0  # was: as long as the sidecar kept sending (80 s here)


def test_frame_reader_without_a_deadline_waits_per_recv_as_before():
    """bulkwire's defaults are unchanged (the sidecar's framing uses them): no deadline, the socket's timeout."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.3)
        reader = bulkwire.FrameReader(b)
        a.sendall(_status(0))
        assert reader.frame().status.chunks == 0
        assert b.gettimeout() == 0.3
        frame = _status(3)
        a.sendall(frame[:3])
        with pytest.raises(socket.timeout):
            reader.frame(deadline=time.monotonic() + 0.2)
        a.sendall(frame[3:])  # what arrived stays buffered: a caller that drops the connection loses nothing else
        assert reader.buffered == 3 and reader.frame().status.chunks == 3


# --- item: no more chunks or bytes than the request allows -----------------------------------------------------
def _endless(conn, request, n):
    i = request.start_chunk
    while True:
        conn.sendall(_chunk(i, ZEROS) + ZEROS)
        i += 1


def _endless_empty_frames(conn, request, n):
    i = request.start_chunk
    while True:
        conn.sendall(b"".join(_chunk(i + k, b"", buffer_offset=0) for k in range(1000)))
        i += 1000


def _one_too_many(conn, request, n):
    want = len(request.tokens) // CT - request.start_chunk
    want = min(want, request.max_chunks) if request.max_chunks else want
    conn.sendall(b"".join(_chunk(request.start_chunk + k, ZEROS) + ZEROS for k in range(want + 1)) + _status(want + 1))


@pytest.mark.parametrize("transport, answer", [("tcp", _endless), ("unix-memfd", _endless_empty_frames),
                                               ("tcp", _one_too_many)])
def test_chunks_past_what_the_request_allows_are_refused(fake, transport, answer):
    sidecar = fake(answer, transport)
    with _client(sidecar) as c:
        t0 = time.monotonic()
        with pytest.raises(errors.CorruptChunk):
            c.get_blobs(SPEC, list(range(4 * CT)), max_chunks=2, timeout=5)
        with pytest.raises(errors.CorruptChunk):
            c.get(SPEC, list(range(2 * CT)), timeout=5)  # was: cached_tokens 48 of the 32 tokens asked
        assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("nbytes", [CB // 2, CB + 2, 256 << 20])
def test_a_chunk_of_another_size_is_refused_before_its_bytes_are_read(fake, nbytes):
    def answer(conn, request, n):
        conn.sendall(_chunk(request.start_chunk, ZEROS, nbytes=nbytes))  # no bytes follow: none may be read
        time.sleep(5)

    with _client(fake(answer)) as c:
        t0 = time.monotonic()
        with pytest.raises(errors.CorruptChunk, match=f"announces {nbytes} bytes"):
            c.get_blobs(SPEC, list(range(2 * CT)), timeout=3)
        assert time.monotonic() - t0 < 1.0


def test_get_blobs_refuses_more_chunks_than_asked_whatever_the_transport(fake, monkeypatch):
    """client._get_blobs checks the answer of every transport (here one that lets an extra chunk through)."""
    with _client(fake(_one_too_many)) as c:
        monkeypatch.setattr(c._transports, "get", lambda call: ([torch.zeros(CB, dtype=torch.uint8)] * 3, True))
        with pytest.raises(errors.CorruptChunk, match="answered 3 chunks; the request allows 2"):
            c.get_blobs(SPEC, list(range(4 * CT)), max_chunks=2)
        with pytest.raises(errors.CorruptChunk, match="answered 3 chunks; the request allows 2"):
            c.get_blobs(SPEC, list(range(4 * CT)), start_chunk=2)
        monkeypatch.setattr(c._transports, "get", lambda call: ([torch.zeros(CB - 2, dtype=torch.uint8)], True))
        with pytest.raises(errors.CorruptChunk, match=f"chunk 0 has {CB - 2} bytes"):
            c.get_blobs(SPEC, list(range(4 * CT)))


def test_the_grpc_stream_refuses_more_chunks_than_asked_and_chunks_of_another_size():
    def stream(count: int, nbytes: int = CB):
        for i in range(count):
            yield pb.GetResponse(chunk=pb.ChunkBegin(index=i, nbytes=nbytes, xxh3_64=xxhash.xxh3_64_intdigest(
                bytes(nbytes))))
            yield pb.GetResponse(data=bytes(nbytes))

    assert len(_receive(stream(2), 0, 2, CB)) == 2
    with pytest.raises(errors.CorruptChunk, match="past the 2 chunks asked for"):
        _receive(stream(3), 0, 2, CB)
    with pytest.raises(errors.CorruptChunk, match="announces 100 bytes"):
        _receive(stream(1, 100), 0, 2, CB)
    assert len(_receive(stream(3), 0)) == 3  # bounds not known: as before


# --- item: a lent chunk is checked once per new mapping, whatever its frame claims ----------------------------
def _lend(data: bytes, claimed: bytes | None = None):
    """Lend a memfd holding `data` with a frame that carries claimed's checksum and values_finite (the same
    memfd, so the same inode, for every get of one fake)."""
    fd = _sealed(data)
    summed = xxhash.xxh3_64_intdigest(claimed if claimed is not None else data)

    def answer(conn, request, n):
        frame = _chunk(request.start_chunk, data, xxh3_64=summed, sealed_memfd=True, values_finite=True)
        bulkwire.send_with_fds(conn, frame + _status(1), [fd])

    return answer


def test_a_lent_chunk_failing_its_checksum_is_refused_though_it_claims_finite_values(fake):
    with _client(fake(_lend(NAN, claimed=ZEROS), "unix", lend=True)) as c:
        with pytest.raises(errors.CorruptChunk, match="failed its checksum in the memfd"):
            c.get_blobs(SPEC, list(range(CT)), keep_sealed=True)


def test_a_lent_chunk_with_nan_is_scanned_though_it_claims_finite_values(fake):
    with _client(fake(_lend(NAN), "unix", lend=True)) as c:
        blobs = c.get_blobs(SPEC, list(range(CT)), keep_sealed=True)
        assert client_bulk.is_sealed(blobs[0]) and not known_finite(blobs[0])
        with pytest.raises(errors.CorruptChunk, match="NaN or Inf"):
            checked_chunks(SPEC, blobs, CT)


def test_a_kept_lent_mapping_is_hashed_and_scanned_once(fake, monkeypatch):
    hashed = []
    monkeypatch.setattr(client_bulk, "xxhash", types.SimpleNamespace(
        xxh3_64_intdigest=lambda b: (hashed.append(1), xxhash.xxh3_64_intdigest(b))[1]))
    with _client(fake(_lend(ZEROS), "unix", lend=True)) as c:
        first = c.get_blobs(SPEC, list(range(CT)), keep_sealed=True)
        assert len(hashed) == 1 and not known_finite(first[0])
        checked_chunks(SPEC, first, CT)
        for _ in range(3):
            again = c.get_blobs(SPEC, list(range(CT)), keep_sealed=True)
            assert again[0] is first[0] and known_finite(again[0])  # the same mapping, not hashed or scanned
        assert len(hashed) == 1


# --- item: descriptors no chunk frame announced ----------------------------------------------------------------
def test_a_stray_descriptor_is_closed_and_never_mapped_by_a_later_get(fake):
    lend_zeros = _lend(ZEROS)

    def answer(conn, request, n):
        if sidecar.gets % 2:  # a valid answer with bytes on the socket, and a memfd of NaN that no frame announced
            stray = _sealed(NAN)
            bulkwire.send_with_fds(conn, _chunk(request.start_chunk, ZEROS) + ZEROS + _status(1), [stray])
            os.close(stray)
        else:  # a lent chunk of zeros
            lend_zeros(conn, request, n)

    sidecar = fake(answer, "unix", lend=True)
    bulk = BulkClient(sidecar.address)
    try:
        before = _open_memfds()
        for _ in range(5):
            with pytest.raises(errors.Unavailable, match="no chunk frame announced"):
                bulk.get(_request(list(range(CT))), CB, 5.0, max_chunks=1, chunk_bytes=CB)
            blobs, _ = bulk.get(_request(list(range(CT))), CB, 5.0, max_chunks=1, chunk_bytes=CB)
            assert bytes(blobs[0].numpy()) == ZEROS  # its own chunk, not the stale memfd of NaN
        del blobs
        bulk.lent.clear()
        assert _open_memfds() <= before  # was: +1 descriptor per Get, for good
    finally:
        bulk.close()


# --- item: an answer sent twice does not answer the next request -----------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_an_answer_sent_twice_does_not_answer_the_next_get(fake, transport):
    def answer(conn, request, n):
        tagged = bytes([request.tokens[0]]) * CB
        whole = b"".join(_chunk(request.start_chunk + k, tagged) + tagged for k in range(2)) + _status(2)
        if transport == "unix":  # the unix socket's default path: the bytes go into the client's memfd
            if sidecar.gets > 1:
                time.sleep(0.2)  # a client that reads the answer left over does so before these bytes land
            sidecar.shared[0:2 * CB] = tagged * 2
            whole = b"".join(_chunk(request.start_chunk + k, tagged, buffer_offset=k * CB) for k in range(2)) \
                + _status(2)
        conn.sendall(whole + (whole if n == 1 else b""))

    sidecar = fake(answer, transport)
    with _client(sidecar) as c:
        for first in (10, 20, 30):
            blobs = c.get_blobs(SPEC, list(range(first, first + 2 * CT)))
            assert [int(b[0]) for b in blobs] == [first, first]  # was: 10, then 10 again, then 20
