"""Client side of the bulk channel (docs/bulk-channel.md): Get and Put over a plain socket.

One connection per thread. On a unix socket a sidecar with zero copy on lends each chunk as its own sealed
memfd, which is mapped here read-only and kept for the next Get (LentChunks): no byte is copied. Otherwise, on
a unix socket, the thread's buffer is a memfd shared with the sidecar (sent once per connection, SCM_RIGHTS),
which writes the chunk bytes straight into it; over TCP the bytes come on the socket into a reused buffer.
Receiving into memory that was touched before saves page faults: copying a 64 MiB answer out into fresh memory
adds about 14 ms to a 20-35 ms Get (docs/bulk-channel.md). So blobs come back as views (of the thread's
buffer, valid until its next get, or of lent chunks); callers decode or copy them at once
(PromptCacheClient.get_blobs copies unless asked not to, get decodes straight from them). Asked for owned
blobs over a socket, get receives each chunk straight into a tensor of its own instead: no copy afterwards.

Put sends the chunk bytes from the caller's tensors in one scatter-gather write per batch (no copy here), or on a
unix socket copies them into the thread's shared memfd, from which the sidecar copies and verifies them.
"""
from __future__ import annotations

import collections
import fcntl
import mmap
import os
import select
import socket
import stat
import sys
import threading
import time
import warnings
import weakref
from typing import Callable, Iterator

import numpy as np
import torch
import xxhash

from promptcache.contract import bulkwire
from promptcache.client import errors
from promptcache.v1 import kvcache_pb2 as pb

_MAX_CHUNK_BYTES = 1 << 31  # a sanity bound on what a server may announce, far above any real chunk


class _Connection:
    def __init__(self, family: int, sockaddr, authorization: str, timeout: float, shared_memory: bool,
                 zero_copy: bool):
        self.shared: np.ndarray | None = None  # the attached memfd's mapping (unix sockets, shared mode)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        if family != socket.AF_UNIX:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bulkwire.large_buffers(self.sock)
        deadline = time.monotonic() + timeout
        self.sock.connect(sockaddr)
        want_lent = shared_memory and zero_copy
        self.reader = bulkwire.FrameReader(self.sock, descriptors=want_lent)
        bulkwire.send(self.sock, pb.BulkFrame(hello=pb.BulkHello(version=bulkwire.VERSION,
                                                                 authorization=authorization,
                                                                 sealed_memfds=want_lent)))
        status = _expect(self.reader, "status", deadline).status
        _check_status(status)
        self.lent = want_lent and status.sealed_memfds  # the sidecar lends chunks: no buffer needed
        self.puts = status.puts  # the sidecar takes put frames (an older one: gRPC Put)
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.owned = ReleasedBuffers()
        # The process that opened it: a child forked from it shares the socket and the memfd, and must open its own
        # (its requests and the parent's would interleave on one connection, each reading the other's answers).
        self.pid = os.getpid()
        # A request is out and its answer (status frame) not read yet. A call that ends so, by any exception
        # (KeyboardInterrupt, a deadline raised from a signal handler, MemoryError, ...), leaves the connection out
        # of step: its answer may still arrive, after the next request was sent, and be read as that one's.
        self.busy = False

    def set_timeout(self, timeout: float) -> None:
        if timeout != self.sock.gettimeout():  # (setting it costs a system call; reading it, none)
            self.sock.settimeout(timeout)

    def stale(self) -> bool:
        """Whether something is waiting on this idle connection: bytes read and not consumed, or bytes (or the
        end of the stream) in the socket. Between two calls nothing may be: the rest of an answer the sidecar sent
        twice, or a connection it closed. A request sent now would be answered out of step."""
        if self.reader.buffered or self.reader.pending_fds:
            return True
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        self.sock.close()
        self.reader.close()

    def attach(self, size: int, deadline: float | None = None) -> np.ndarray:
        """This connection's shared buffer, at least `size` bytes: a memfd sealed against shrinking (so the
        sidecar can keep it mapped safely), pre-faulted here (its pages are ours, not the sidecar's), sent once
        over the socket. Returns its mapping."""
        if self.shared is not None and self.shared.size >= size:
            return self.shared
        self.busy = True  # the buffer frame's status is an answer to wait for
        size = max(size, 2 * (self.shared.size if self.shared is not None else 0))
        fd = os.memfd_create("promptcache-bulk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            array = np.frombuffer(mm, dtype=np.uint8)
            array.fill(0)
            bulkwire.send_with_fd(self.sock, pb.BulkFrame(buffer=pb.BulkBuffer(length=size)), fd)
        finally:
            os.close(fd)  # the mapping (ours) and the sidecar's copy of the descriptor keep it alive
        status = _expect(self.reader, "status", deadline).status
        self.busy = False
        _check_status(status)
        self.shared = array  # earlier views keep the old mapping alive until they go
        return array


def _expect(reader: bulkwire.FrameReader, kind: str, deadline: float | None = None) -> pb.BulkFrame:
    frame = reader.frame(deadline=deadline)
    got = frame.WhichOneof("frame")
    if got == "status":
        # An answer ends with its status: every descriptor that came with it belongs to one of its chunk frames,
        # taken by now. One left over was never asked for; it is closed (not mapped by the next answer, as if it
        # were that answer's), and a sidecar that sends them is not trusted with this connection any more.
        stray = reader.close()
        if stray:
            raise bulkwire.FramingError(f"{stray} file descriptor(s) came that no chunk frame announced")
    elif got != kind:
        raise bulkwire.FramingError(f"expected a {kind} frame from the sidecar, got {got}")
    return frame


def _check_status(status: pb.BulkStatus) -> None:
    if status.code != 0:
        raise errors.from_status(status.code, status.message)


class BulkClient:
    """Thread-safe: each thread has its own connection and buffer."""

    def __init__(self, address: str, authorization=lambda: "", shared_memory: bool = True,
                 zero_copy: bool = True, lent_cache_bytes: int = 512 << 20):
        self.address = address
        self.family, self.sockaddr = bulkwire.parse_address(address)
        # On a unix socket the peer is on this node: pass the bytes through a shared memfd instead.
        self.shared_memory = shared_memory and self.family == socket.AF_UNIX
        self.zero_copy = zero_copy  # take lent chunks where the sidecar lends them
        self._authorization = authorization
        self.lent = LentChunks(lent_cache_bytes)
        self._local = threading.local()
        self._all: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        _CLIENTS.add(self)

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a thread still in a call, or calling later, opens no new connection
            for c in self._all:
                c.close()
            self._all.clear()
        self.lent.clear()

    def _after_fork_in_child(self) -> None:
        """In a child just forked (one thread): forget the parent's connections without a word on them (they are
        the parent's: a frame sent or read here would interleave with its calls), closing only this process's
        copies of their descriptors; locks a parent thread held at the fork are replaced."""
        self._lock = threading.Lock()
        self.lent._lock = threading.Lock()
        inherited, self._all, self._local = self._all, [], threading.local()
        for c in inherited:
            c.close()

    def _connection(self, timeout: float) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.pid != os.getpid():  # a fork the at-fork hook did not see (never sent on)
            self._local.conn = conn = None
        if conn is None:
            if self._closed:
                raise errors.Unavailable(f"UNAVAILABLE: bulk channel {self.address}: the client was closed")
            try:
                conn = _Connection(self.family, self.sockaddr, self._authorization(), timeout, self.shared_memory,
                                   self.zero_copy)
            except (OSError, bulkwire.FramingError) as exc:
                raise errors.Unavailable(f"UNAVAILABLE: bulk channel {self.address}: {exc}") from None
            except errors.ResourceExhausted as exc:  # at its connection limit: the call itself was not refused
                raise errors.Unavailable(str(exc)) from None
            with self._lock:
                closed = self._closed
                if not closed:
                    self._all.append(conn)
            if closed:  # close() came while this one was opening
                conn.close()
                raise errors.Unavailable(f"UNAVAILABLE: bulk channel {self.address}: the client was closed")
            self._local.conn = conn
        return conn

    def _drop(self, conn: _Connection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()

    def _ready_connection(self, timeout: float) -> _Connection:
        """This thread's connection, a new one where the old one is stale (_Connection.stale)."""
        conn = self._connection(timeout)
        try:
            stale = conn.busy or conn.stale()  # busy: an earlier call was interrupted before its answer
        except (OSError, ValueError):
            stale = True
        if stale:
            self._drop(conn)
            conn = self._connection(timeout)
        return conn

    def get(self, request: pb.GetRequest, expected_bytes: int, timeout: float,
            owned: bool = False, max_chunks: int | None = None,
            chunk_bytes: int | None = None) -> tuple[list[torch.Tensor], bool]:
        """(verified chunk blobs of the longest cached run, whether the caller owns them). Views of this thread's
        buffer (valid until the thread's next call) or of lent chunks (valid while referenced), unless `owned`
        and the bytes come on the socket: then each chunk is received into a tensor of its own.
        `expected_bytes` sizes the buffer; larger answers still fit (a new buffer) unless `max_chunks` (the most
        chunks the request allows) and `chunk_bytes` (every chunk's exact length) are given: an answer with
        more chunks or a chunk of another length is then refused (CorruptChunk) before its bytes are read.
        The whole call, however slowly the answer trickles in, ends by `timeout` (DeadlineExceeded)."""
        deadline = time.monotonic() + timeout
        conn = self._ready_connection(timeout)
        bounds = _Bounds(max_chunks, chunk_bytes)
        try:
            conn.set_timeout(timeout)
            if self.shared_memory and not conn.lent:
                shared = conn.attach(expected_bytes, deadline)
                request.shared_buffer.length = expected_bytes
                conn.busy = True
                try:
                    conn.sock.sendall(bulkwire.encode_get(request))
                finally:
                    request.ClearField("shared_buffer")  # the caller may retry the request over gRPC
                return self._receive_shared(conn, request.start_chunk, shared[:expected_bytes], self.lent,
                                            deadline, bounds), False
            conn.busy = True
            conn.sock.sendall(bulkwire.encode_get(request))
            owned = owned and not conn.lent
            return self._receive(conn, request.start_chunk, expected_bytes, deadline, self.lent, owned,
                                 bounds), owned
        except socket.timeout:
            raise errors.DeadlineExceeded(f"DEADLINE_EXCEEDED: no answer from {self.address} in time") from None
        except (OSError, bulkwire.FramingError) as exc:
            conn.busy = True  # broken, or a sidecar that broke the framing: not used again
            raise errors.Unavailable(f"UNAVAILABLE: bulk channel {self.address}: {exc}") from None
        finally:
            if conn.busy:  # ended before its answer did (timeout, a bad chunk, any exception): the rest of the
                self._drop(conn)  # answer may still come, so this connection's framing can't be trusted

    def put(self, header: pb.PutHeader, chunks: list[tuple[Callable[[], pb.ChunkBegin], np.ndarray]],
            timeout: float) -> pb.PutResponse:
        """Store chunks as gRPC Put would: each a function that builds its ChunkBegin (checksum set), called when
        the chunk is about to be sent, and its bytes. Over a socket each chunk goes out as soon as its frame is
        built, so the sidecar receives and verifies chunk i while chunk i+1 is hashed here. Unavailable when
        the channel cannot take the call (no bulk channel, at its connection limit, a sidecar without bulk Put,
        the connection broke): the caller then uses gRPC Put, whose answer is the same."""
        deadline = time.monotonic() + timeout
        conn = self._ready_connection(timeout)
        if not conn.puts:
            raise errors.Unavailable(f"UNAVAILABLE: the sidecar at {self.address} takes no put frames on its bulk "
                                     "channel (an older version)")
        put = pb.BulkPut(header=header, chunks=len(chunks))
        try:
            conn.set_timeout(timeout)
            if self.shared_memory:
                # One copy into the memfd the sidecar maps; all frames in one write, no bytes after them.
                shared = conn.attach(sum(data.size for _, data in chunks), deadline)
                put.shared_buffer = True
                frames, position = bytearray(bulkwire.encode(pb.BulkFrame(put=put))), 0
                for begin, data in chunks:
                    shared[position:position + data.size] = data
                    frame = begin()
                    frame.buffer_offset = position
                    frames += bulkwire.encode(pb.BulkFrame(chunk=frame))
                    position += data.size
                conn.busy = True
                conn.sock.sendall(frames)
            else:
                buffers = [bulkwire.encode(pb.BulkFrame(put=put))]
                conn.busy = True  # a put cut short part way leaves the sidecar reading chunk bytes
                for begin, data in chunks:
                    buffers += (bulkwire.encode(pb.BulkFrame(chunk=begin())), data)
                    bulkwire.send_buffers(conn.sock, buffers)
                    buffers = []
            status = _expect(conn.reader, "status", deadline).status
            conn.busy = False
        except socket.timeout:
            raise errors.DeadlineExceeded(f"DEADLINE_EXCEEDED: no answer from {self.address} in time") from None
        except (OSError, bulkwire.FramingError) as exc:
            conn.busy = True  # broken, or a sidecar that broke the framing: not used again
            raise errors.Unavailable(f"UNAVAILABLE: bulk channel {self.address}: {exc}") from None
        finally:
            if conn.busy:
                self._drop(conn)
        _check_status(status)
        return status.put

    @staticmethod
    def _receive_shared(conn: _Connection, start_chunk: int, shared: np.ndarray, lent: LentChunks,
                        deadline: float | None = None, bounds: _Bounds | None = None) -> list[torch.Tensor]:
        """Chunk frames without bytes: the sidecar wrote them into the shared buffer and verified them there,
        after the copy, so they are not hashed again here."""
        blobs: list[torch.Tensor] = []
        for c in _answer(conn, start_chunk, blobs, deadline, bounds):
            if c.sealed_memfd:
                blobs.append(lent.take(conn.reader.take_fd(), c))
                continue
            if c.buffer_offset + c.nbytes > shared.size:
                raise errors.CorruptChunk(f"chunk {c.index} was placed outside the shared buffer")
            blobs.append(torch.from_numpy(shared[c.buffer_offset:c.buffer_offset + c.nbytes]))
        return blobs

    @staticmethod
    def _receive(conn: _Connection, start_chunk: int, expected_bytes: int, deadline: float,
                 lent: LentChunks, owned: bool = False, bounds: _Bounds | None = None) -> list[torch.Tensor]:
        if owned:  # no receive buffer: a tensor per chunk, returned as it is
            expected_bytes = 0
        if conn.buffer.numel() < expected_bytes and not conn.lent:  # lent chunks need no buffer
            conn.buffer = torch.empty(expected_bytes, dtype=torch.uint8)
        buffer, position, blobs = conn.buffer, 0, []
        for c in _answer(conn, start_chunk, blobs, deadline, bounds):
            if c.sealed_memfd:
                blobs.append(lent.take(conn.reader.take_fd(), c))
                continue
            if c.nbytes > _MAX_CHUNK_BYTES:
                raise errors.CorruptChunk(f"chunk {c.index} announces {c.nbytes} bytes")
            if owned:
                view = torch.from_numpy(conn.owned.take(c.nbytes))
            else:
                if position + c.nbytes > buffer.numel():
                    # Earlier blobs keep the old buffer alive; the next call starts in the new, larger one.
                    buffer = conn.buffer = torch.empty(max(2 * buffer.numel(), c.nbytes), dtype=torch.uint8)
                    position = 0
                view = buffer[position:position + c.nbytes]
            conn.reader.read_into(view.numpy(), deadline)
            if xxhash.xxh3_64_intdigest(view.numpy()) != c.xxh3_64:
                raise errors.CorruptChunk(f"chunk {c.index} failed its checksum in transit")
            blobs.append(view)
            position += c.nbytes
        return blobs


_CLIENTS: weakref.WeakSet[BulkClient] = weakref.WeakSet()  # every client of this process, for the at-fork hook


def _after_fork_in_child() -> None:
    for client in list(_CLIENTS):
        client._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ReleasedBuffers:
    """Memory for owned blobs, reused once their owner has let go of them: a freshly allocated answer costs a
    page fault per 4 KiB as the bytes arrive (about 0.3 ms per MiB here, as much as receiving them), and
    memory freed by a caller goes back to the system, so the next answer faults again. An array handed out is
    reused only when nothing references it but this list (no tensor, view or storage of it is alive), so a
    caller keeps what it holds for as long as it holds it. At most `max_bytes` are kept."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._arrays: collections.deque[np.ndarray] = collections.deque()
        self._bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        arrays = self._arrays
        # Oldest first: callers mostly drop answers in the order they got them. Two references: the deque's
        # and getrefcount's argument.
        if arrays and sys.getrefcount(arrays[0]) == 2:
            oldest = arrays.popleft()
            if oldest.size == nbytes:
                arrays.append(oldest)
                return oldest
            self._bytes -= oldest.size  # another size: let it go
        array = np.empty(nbytes, dtype=np.uint8)
        if self._bytes + nbytes <= self.max_bytes:
            arrays.append(array)
            self._bytes += nbytes
        return array


class LentChunks:
    """Mappings of the chunks a sidecar lent (sealed memfds), kept for reuse: the sidecar passes a chunk's
    memfd with every Get that serves it, and when this process still has that memfd mapped (same inode, size
    and checksum) the mapping is used again instead of mapping it anew. A new mapping is checked against its
    checksum once (_map_lent); a reused one was. Lent memfds are sealed, so a mapping can never go stale;
    what it costs is memory: a chunk the sidecar has evicted stays alive while mapped
    here. So mappings unused for `idle_seconds` go, and at most `max_bytes` stay mapped (0: none are kept).

    Mappings are shared and read-only (PROT_READ): a write through one of these tensors is a segmentation
    fault. get() and get_blobs() copy out of them; only get_blobs(copy=False) hands them out."""

    def __init__(self, max_bytes: int, idle_seconds: float = 30.0):
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self._maps: collections.OrderedDict[tuple[int, int], tuple[torch.Tensor, int, float]] = \
            collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def mapped_bytes(self) -> int:
        return self._bytes

    def take(self, fd: int, c: pb.ChunkBegin) -> torch.Tensor:
        """The chunk lent with `fd` (which this call closes), as a read-only tensor of c.nbytes bytes."""
        try:
            st = os.fstat(fd)
            key, now = (st.st_dev, st.st_ino), time.monotonic()
            with self._lock:
                kept = self._maps.get(key)
                if kept is not None and kept[0].numel() == c.nbytes and kept[1] == c.xxh3_64:
                    self._maps[key] = (kept[0], kept[1], now)
                    self._maps.move_to_end(key)
                    self._expire(now)
                    return kept[0]
            tensor = _map_lent(fd, st, c)
        finally:
            os.close(fd)
        if c.nbytes <= self.max_bytes:
            with self._lock:
                old = self._maps.pop(key, None)
                self._bytes += c.nbytes - (old[0].numel() if old is not None else 0)
                self._maps[key] = (tensor, c.xxh3_64, now)
                self._expire(now)
        return tensor

    def _expire(self, now: float) -> None:
        while self._maps:
            key, (tensor, _, used) = next(iter(self._maps.items()))
            if self._bytes <= self.max_bytes and now - used < self.idle_seconds:
                return
            del self._maps[key]
            self._bytes -= tensor.numel()

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._bytes = 0


_warned = False  # torch's warning about non-writable buffers has been swallowed (it fires once per process)
_sealed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # id -> lent tensor


# Lent chunks this process scanned once and found to hold finite values (client.checked_chunks). Their bytes never
# change, so they are not scanned again while this process keeps their mapping. The sidecar's values_finite flag is
# not taken for it: a sidecar that is wrong (or not ours) must not get NaN loaded. id -> the blob; an entry goes
# with its blob.
_finite: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def is_sealed(blob: torch.Tensor) -> bool:
    """Whether `blob` is a lent chunk's mapping: a sealed memfd, read-only, whose bytes never change."""
    return _sealed.get(id(blob)) is blob


def known_finite(blob: torch.Tensor) -> bool:
    """Whether `blob` is a lent chunk known to hold no NaN or Inf (see _finite)."""
    return _finite.get(id(blob)) is blob


def mark_finite(blob: torch.Tensor) -> None:
    """Remember that the lent chunk `blob` holds finite values (nothing to remember for other blobs: their
    memory may be reused)."""
    if is_sealed(blob):
        _finite[id(blob)] = blob


def _map_lent(fd: int, st: os.stat_result, c: pb.ChunkBegin) -> torch.Tensor:
    """Map a lent chunk's memfd read-only and pre-faulted, after checking it is what the protocol promises
    (sealed, large enough: a short one would fault on read), and check its bytes against the frame's xxh3 once,
    here: the seals keep them as they are for as long as the mapping lives, so LentChunks reuses it unhashed (one
    hash per new mapping, none per Get). Its values are scanned once too, by client.checked_chunks (the frame's
    values_finite is a hint this client does not rely on: a wrong flag must not get NaN loaded)."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
    if seals & bulkwire.LENT_SEALS != bulkwire.LENT_SEALS or not 0 < c.nbytes <= min(st.st_size, _MAX_CHUNK_BYTES):
        raise errors.CorruptChunk(f"chunk {c.index}: what came with it is not a sealed memfd of at least "
                                  f"{c.nbytes} bytes")
    mm = mmap.mmap(fd, c.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ,
                   **bulkwire.MMAP_OPTIONS)
    if xxhash.xxh3_64_intdigest(mm) != c.xxh3_64:
        mm.close()
        raise errors.CorruptChunk(f"chunk {c.index} failed its checksum in the memfd it was lent in")
    global _warned
    if _warned:
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
    else:
        # torch warns once per process that the buffer is not writable; that is the point here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _warned = True
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
    _sealed[id(tensor)] = tensor
    return tensor


class _Bounds(collections.namedtuple("_Bounds", "max_chunks chunk_bytes")):
    """What a request allows its answer: at most `max_chunks` chunks, each exactly `chunk_bytes` long (None: not
    known here, not checked)."""


def _answer(conn: _Connection, start_chunk: int, blobs: list, deadline: float | None = None,
            bounds: _Bounds | None = None) -> Iterator[pb.ChunkBegin]:
    """The chunk frames of one answer, each checked to be the next index (`blobs`: what the caller kept so far)
    and within `bounds` before any of its bytes are read, until its status frame, all by `deadline`; an error
    status raises its exception type."""
    while True:
        frame = _expect(conn.reader, "chunk", deadline)
        if frame.WhichOneof("frame") == "status":
            conn.busy = False  # the whole answer is read: the connection is in step (whatever the status says)
            if frame.status.chunks != len(blobs):
                raise bulkwire.FramingError(f"status counts {frame.status.chunks} chunks, {len(blobs)} arrived")
            _check_status(frame.status)
            return
        c = frame.chunk
        if c.index != start_chunk + len(blobs):
            raise errors.CorruptChunk(f"expected chunk {start_chunk + len(blobs)}, got {c.index}")
        if bounds is not None:
            errors.check_chunk_within(c, len(blobs), bounds.max_chunks, bounds.chunk_bytes)
        yield c
