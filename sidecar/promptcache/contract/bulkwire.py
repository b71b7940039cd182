"""Framing of the bulk channel (docs/bulk-channel.md), shared by the sidecar and the client.

Every message is one promptcache.v1.BulkFrame preceded by its length as 4 little-endian bytes; after a chunk
frame come exactly chunk.nbytes raw bytes. The messages themselves are defined in the proto, like every other
part of the data path; this module only moves them over a plain stream socket.
"""
from __future__ import annotations

import array
import collections
import fcntl
import os
import socket
import struct
import sys
import time

from promptcache.contract.addresses import port_error
from promptcache.v1 import kvcache_pb2 as pb

VERSION = 1
_LENGTH = struct.Struct("<I")
# A get frame carries at most the server's token limit (4M ids, <= 5 bytes each packed) plus the model.
MAX_FRAME_BYTES = (5 << 22) + (64 << 10)


_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # a plain int: the IntFlag's & costs more than the rest of a small read
_MAX_FDS = 4  # more than one is a protocol error, but all that arrive must be received to be closed
MAX_LENT_FDS = 253  # what one message of lent chunks may carry (SCM_MAX_FD)
# A lent chunk's memfd is sealed with all of these (docs/bulk-channel.md): nobody can write, resize or re-seal it.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux >= 5.1; not in Python 3.11's fcntl
LENT_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Python < 3.13 keeps a dup of the descriptor in every mmap object; later ones can be told not to.
MMAP_OPTIONS = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class FramingError(Exception):
    """The peer broke the framing: the connection cannot be used any more."""


class Closed(FramingError):
    """The peer closed the connection between frames."""


class Cut(FramingError):
    """The peer closed the connection in the middle of a frame or of the bytes after one."""


SOCKET_BUFFER_BYTES = 4 << 20  # kernel buffer asked for on each side of a bulk connection


def _sysctl(name: str) -> int:
    try:
        with open(f"/proc/sys/net/core/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def large_buffers(sock: socket.socket) -> None:
    """Kernel buffers of several MiB on a bulk socket (before connect or listen, so TCP's window scale fits):
    a whole chunk then fits, and a call blocks and wakes up fewer times (each wake-up waits for a CPU on a busy
    node). Only where the system allows that much (net.core.wmem_max, rmem_max): a smaller explicit size would
    turn off TCP's own buffer tuning and be worse than leaving it."""
    for option, limit in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max")):
        if _sysctl(limit) >= SOCKET_BUFFER_BYTES:
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            except OSError:
                pass


def parse_address(address: str) -> tuple[int, object]:
    """'unix:/path' or 'unix:///path' -> (AF_UNIX, path); 'HOST:PORT' -> (AF_INET or AF_INET6, (host, port)).
    Raises ValueError naming what is wrong."""
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise ValueError(f"bulk address {address!r}: a unix socket needs an absolute path (unix:/run/x.sock)")
        return socket.AF_UNIX, path
    host, sep, port = address.rpartition(":")
    if not sep or not host or port_error(port):
        raise ValueError(f"bulk address {address!r} is not HOST:PORT or unix:/PATH")
    host = host.strip("[]")
    return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))


def encode(frame: pb.BulkFrame) -> bytes:
    body = frame.SerializeToString()
    return _LENGTH.pack(len(body)) + body


def encode_get(request: pb.GetRequest) -> bytes:
    """encode(BulkFrame(get=request)) without copying the request into a BulkFrame first: the frame is that one
    field (number 2, length-delimited), so its bytes are a tag, the request's length and the request's bytes."""
    body = request.SerializeToString()
    head = bytearray(b"\x12")
    n = len(body)
    while n >= 0x80:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return _LENGTH.pack(len(head) + len(body)) + head + body


def send(sock: socket.socket, frame: pb.BulkFrame) -> None:
    sock.sendall(encode(frame))


_IOV_MAX = 1024  # buffers one sendmsg takes at most (Linux's UIO_MAXIOV)


def send_buffers(sock: socket.socket, buffers, deadline: float | None = None, whole: int = 1) -> int:
    """Send buffers one after another with as few sendmsg calls as the socket allows (scatter-gather: none of
    them is copied or joined here). Past `deadline` (time.monotonic()) the group of `whole` buffers being sent
    is finished and no further one is started (with whole=2, a frame and the bytes after it stay together).
    Returns how many buffers were sent (all of them unless the deadline passed)."""
    views = [memoryview(b).cast("B") for b in buffers]
    i, partial = 0, False  # partial: views[i] was sent in part
    while True:
        while i < len(views) and not views[i].nbytes:
            i += 1
        if i == len(views):
            return i
        end = i + _IOV_MAX
        if deadline is not None and time.monotonic() > deadline:
            if i % whole == 0 and not partial:
                return i  # between two groups: stop here
            end = i + whole - i % whole  # the rest of this group, and no further
        sent = sock.sendmsg(views[i:end])
        partial = False
        while sent:
            n = views[i].nbytes
            if sent < n:
                views[i], partial = views[i][sent:], True
                break
            sent -= n
            i += 1


def recv_into(sock: socket.socket, buffer, deadline: float | None = None) -> None:
    """Fill `buffer` (any writable buffer) from the socket; FramingError if the peer closes first. With a
    `deadline` (time.monotonic()), socket.timeout once it has passed, however the bytes trickle in. A blocking
    socket (no timeout, no deadline) waits for all of it in one call (MSG_WAITALL)."""
    view = memoryview(buffer).cast("B")
    got, total = 0, view.nbytes
    timeout = sock.gettimeout()
    flags = socket.MSG_WAITALL if timeout is None and deadline is None else 0
    while got < total:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{got} of {total} bytes arrived in time")
            sock.settimeout(left if timeout is None else min(left, timeout))
        n = sock.recv_into(view[got:], 0, flags)
        if n == 0:
            raise Cut(f"connection closed after {got} of {total} bytes")
        got += n
    if deadline is not None:
        sock.settimeout(timeout)


def send_with_fd(sock: socket.socket, frame: pb.BulkFrame, fd: int) -> None:
    """A frame with a file descriptor attached (SCM_RIGHTS, unix sockets); the fd travels with its first byte."""
    send_with_fds(sock, encode(frame), [fd])


def send_with_fds(sock: socket.socket, data, fds: list[int]) -> None:
    """Bytes with descriptors attached (at most 253, the kernel's limit per message): the receiver gets them
    in this order, together with the first of these bytes."""
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def recv(sock: socket.socket, limit: int = MAX_FRAME_BYTES, fds: list[int] | None = None,
         admit=None) -> pb.BulkFrame:
    """The next frame. Closed if the peer closed cleanly before it; FramingError for anything malformed.
    With `fds` (unix sockets), descriptors that arrive with the frame are appended to it: the caller owns them.
    `admit(length)` is called once the length is known, before any memory is taken for the body; it may raise,
    or return a deadline (time.monotonic()) for the body to have arrived by."""
    head = bytearray(_LENGTH.size)
    if fds is None:
        n = sock.recv_into(head)
    else:
        n, ancdata, _, _ = sock.recvmsg_into([head], socket.CMSG_SPACE(4 * _MAX_FDS))
        _collect_fds(ancdata, fds)
    if n == 0:
        raise Closed("connection closed")
    if n < len(head):
        recv_into(sock, memoryview(head)[n:])
    (length,) = _LENGTH.unpack(head)
    deadline = admit(length) if admit is not None else None
    if length > limit:
        raise FramingError(f"frame of {length} bytes is over the limit of {limit}")
    body = bytearray(length)
    recv_into(sock, body, deadline)
    return _parse(body)


def _collect_fds(ancdata, into) -> None:
    """Append the descriptors of recvmsg's SCM_RIGHTS control messages to `into`, in the order they came."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            into.extend(array.array("i", data[:len(data) - len(data) % 4]))


def _parse(body: bytes) -> pb.BulkFrame:
    frame = pb.BulkFrame()
    try:
        frame.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError
        raise FramingError(f"frame of {len(body)} bytes is not a valid BulkFrame ({type(exc).__name__})") from None
    if frame.WhichOneof("frame") is None:
        raise FramingError("frame carries none of hello, get, chunk, status, buffer, put")
    return frame


class FrameReader:
    """Client-side reader: one recv brings in as many small frames as have arrived (a shared-memory answer is
    all frames, sent at once), and raw chunk bytes go straight into their destination buffer. With
    `descriptors` (unix sockets), file descriptors that arrive are queued in order for take_fd()."""

    SCRATCH = 64 << 10

    def __init__(self, sock: socket.socket, descriptors: bool = False):
        self.sock = sock
        self._buf = bytearray()
        self._scratch = bytearray(self.SCRATCH)
        self._fds: collections.deque[int] | None = collections.deque() if descriptors else None
        self._cmsg_space = socket.CMSG_SPACE(4 * MAX_LENT_FDS) if descriptors else 0

    def _fill(self, deadline: float | None = None) -> None:
        if deadline is not None:  # each recv waits at most for what is left: a trickling peer cannot outlast it
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{len(self._buf)} bytes of a frame arrived in time")
            self.sock.settimeout(left)
        if self._fds is None:
            n = self.sock.recv_into(self._scratch)
        else:
            n, ancdata, flags, _ = self.sock.recvmsg_into([self._scratch], self._cmsg_space)
            _collect_fds(ancdata, self._fds)
            if flags & _MSG_CTRUNC:
                raise FramingError("file descriptors were lost in transit (control data truncated)")
        if n == 0:
            raise FramingError(f"connection closed with {len(self._buf)} bytes of a frame read")
        self._buf += memoryview(self._scratch)[:n]

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not consumed yet (none between two well-formed answers)."""
        return len(self._buf)

    @property
    def pending_fds(self) -> int:
        """Descriptors that arrived and were not taken yet."""
        return len(self._fds) if self._fds else 0

    def take_fd(self) -> int:
        """The next descriptor that came with the frames read so far; the caller owns it."""
        if not self._fds:
            raise FramingError("a chunk frame announced a memfd, but no file descriptor came with it")
        return self._fds.popleft()

    def close(self) -> int:
        """Close descriptors that arrived and were never taken; returns how many there were."""
        closed = 0
        while self._fds:
            closed += 1
            try:
                os.close(self._fds.popleft())
            except OSError:
                pass
        return closed

    def frame(self, limit: int = MAX_FRAME_BYTES, deadline: float | None = None) -> pb.BulkFrame:
        """The next frame. With a `deadline` (time.monotonic()), socket.timeout once it has passed, however the
        bytes trickle in (the socket's timeout is then left at what was left of it); without one, each recv
        waits for the socket's own timeout."""
        while len(self._buf) < _LENGTH.size:
            self._fill(deadline)
        (length,) = _LENGTH.unpack_from(self._buf)
        if length > limit:
            raise FramingError(f"frame of {length} bytes is over the limit of {limit}")
        while len(self._buf) < _LENGTH.size + length:
            self._fill(deadline)
        body = bytes(self._buf[_LENGTH.size:_LENGTH.size + length])
        del self._buf[:_LENGTH.size + length]
        return _parse(body)

    def read_into(self, buffer, deadline: float | None = None) -> None:
        """Raw bytes after a chunk frame: first what is already buffered, then straight from the socket (by
        `deadline` if given, as recv_into)."""
        view = memoryview(buffer).cast("B")
        take = min(len(self._buf), view.nbytes)
        if take:
            view[:take] = self._buf[:take]
            del self._buf[:take]
        if take < view.nbytes:
            recv_into(self.sock, view[take:], deadline)
