"""The shared-memory buffers this sidecar created, and for whom (the node-local fast path).

Why the sidecar creates them: a buffer named by a file name is a buffer anyone who can list --shm-dir can
name. Tenant B could have the sidecar read tenant A's buffer into B's own Put (and then Get A's chunks under
B's key), or write B's chunks into A's buffer with GetShared; and a FIFO given as a name blocked a worker in
open() forever. So (docs/security.md, "Shared-memory and bulk paths: threat model"):

* OpenSharedBuffer creates the file here, O_CREAT|O_EXCL|O_NOFOLLOW under a random name, sizes it and keeps its
  descriptor; the caller gets a second random value, the handle, that is never written to the filesystem.
* Put and GetShared take a handle, accept it only from the identity it was granted to (the anonymous identity
  without authentication: there the 128-bit handle itself is the capability), and use the descriptor opened at
  creation: no path is opened per call, so nothing can be swapped in under the name and nothing can block.
* The file name is unlinked at the buffer's first use (the client has opened it by then), so nobody can open
  the file afterwards.
* Backed before it is lent: the file's pages are allocated (posix_fallocate) when it is created, so they count
  against the filesystem's free space then, and a client writing into its mapping can never meet a SIGBUS; a
  folder without room answers RESOURCE_EXHAUSTED (the client streams instead).
* Bounded per identity: at most `max_buffers` buffers and `max_bytes` bytes; a buffer unused for
  `idle_seconds` is closed (a client that died without CloseSharedBuffer), and its handle stops working.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass

from promptcache.contract.shm import SharedBufferError, SharedFile
from promptcache.sidecar.errors import InvalidRequest, NoCapacity, NotFound, NotServed
from promptcache.sidecar.sinks import ChunkSink, chunk_begin, host_view
from promptcache.v1 import kvcache_pb2 as pb


class UnknownBuffer(Exception):
    """The handle was not granted to this caller, or its buffer was closed."""


class BufferLimit(Exception):
    """Opening one more buffer would pass a per-identity limit."""


def refusal(held_buffers: int, held_bytes: int, length: int, max_buffers: int, max_bytes: int) -> str | None:
    """Why an identity holding `held_buffers` buffers of `held_bytes` in all may not open one of `length`
    bytes (None: it may)."""
    if length > max_bytes:
        return f"a shared buffer of {length} bytes is larger than the {max_bytes} bytes one tenant may hold " \
               "(--shm-max-bytes)"
    if held_buffers >= max_buffers:
        return f"this tenant already holds its maximum of {max_buffers} shared buffers (--shm-max-buffers)"
    if held_bytes + length > max_bytes:
        return f"this tenant holds {held_bytes} bytes of shared buffers; {length} more would pass its limit of " \
               f"{max_bytes} (--shm-max-bytes)"
    return None


@dataclass(eq=False)
class Grant:
    handle: str
    owner: object       # the Identity it was granted to
    file_name: str
    fd: int
    length: int
    inode: int
    last_used: float
    linked: bool = True  # its name is still in the folder
    users: int = 0       # calls using it now; its descriptor is closed only when none is
    closed: bool = False


class SharedBuffers:
    """Thread-safe registry of the buffers created in `directory`."""

    def __init__(self, directory: str, max_buffers: int, max_bytes: int, idle_seconds: float,
                 clock=time.monotonic):
        self.directory = directory
        self.max_buffers, self.max_bytes, self.idle_seconds = max_buffers, max_bytes, idle_seconds
        self.clock = clock
        try:
            os.makedirs(directory, exist_ok=True)
            self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"--shm-dir {directory}: {exc.strerror}") from None
        self._grants: dict[str, Grant] = {}
        self._lock = threading.Lock()

    def open(self, owner, length: int) -> Grant:
        """Create a buffer of `length` bytes for `owner`. BufferLimit past its limits; SharedBufferError when the
        folder refuses the file."""
        if length <= 0:
            raise SharedBufferError(f"length must be positive, got {length}")
        with self._lock:
            self._reap_locked(self.clock())
            mine = [g for g in self._grants.values() if g.owner == owner]
            why = refusal(len(mine), sum(g.length for g in mine), length, self.max_buffers, self.max_bytes)
            if why:
                raise BufferLimit(why)
            if length > self._free():
                raise BufferLimit(f"--shm-dir {self.directory} has no room for a shared buffer of {length} bytes "
                                  f"({self._free()} bytes free); stream instead")
            file_name = f"pc-{secrets.token_hex(16)}"
            try:
                fd = os.open(file_name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC, 0o660, dir_fd=self._dir_fd)
            except OSError as exc:
                raise SharedBufferError(f"cannot create a buffer in --shm-dir {self.directory}: "
                                        f"{exc.strerror}") from None
            try:
                os.ftruncate(fd, length)
                # Backed before it is lent: a sparse file on a full tmpfs is a SIGBUS for the client that
                # writes into its mapping. Allocated pages count against the filesystem's free space.
                os.posix_fallocate(fd, 0, length)
                st = os.fstat(fd)
            except OSError as exc:
                os.close(fd)
                self._unlink(file_name, None)
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise BufferLimit(f"--shm-dir {self.directory} has no room for a shared buffer of {length} "
                                      f"bytes ({self._free()} bytes free); stream instead") from None
                raise SharedBufferError(f"cannot size a buffer of {length} bytes in --shm-dir {self.directory}: "
                                        f"{exc.strerror}") from None
            grant = Grant(secrets.token_urlsafe(24), owner, file_name, fd, length, st.st_ino, self.clock())
            self._grants[grant.handle] = grant
            return grant

    def use(self, owner, handle: str, length: int | None, cap: int | None = None) -> SharedFile:
        """The buffer `handle` of `owner` for one call: its first `length` bytes (None: all of it, at most
        `cap`). close() the result when the call is done. UnknownBuffer when `owner` has no such buffer (the
        same answer whether or not someone else has one with that handle); SharedBufferError for a bad length."""
        with self._lock:
            grant = self._grants.get(handle)
            if grant is None or grant.owner != owner:
                raise UnknownBuffer(f"shared_buffer {handle[:64]!r} is not a buffer this client opened "
                                    "(OpenSharedBuffer), or it was closed (unused for "
                                    f"{self.idle_seconds:g} s: --shm-idle-seconds, or the sidecar restarted)")
            if length is None:
                length = grant.length if cap is None else min(grant.length, cap)
            elif not 0 < length <= grant.length:
                raise SharedBufferError(f"shared_buffer.length {length} must be in 1..{grant.length} (the "
                                        "buffer's length)")
            grant.users += 1
            grant.last_used = self.clock()
            unlink, grant.linked = grant.linked, False
        if unlink:
            self._unlink(grant.file_name, grant.inode)
        return SharedFile(grant.fd, handle, length, release=lambda: self._release(grant))

    def close(self, owner, handle: str) -> bool:
        with self._lock:
            grant = self._grants.get(handle)
            if grant is None or grant.owner != owner:
                return False
            self._close_locked(grant)
        return True

    def reap(self) -> int:
        """Close buffers unused for idle_seconds; returns how many."""
        with self._lock:
            return self._reap_locked(self.clock())

    def close_all(self) -> None:
        with self._lock:
            for grant in list(self._grants.values()):
                self._close_locked(grant)
        try:
            os.close(self._dir_fd)
        except OSError:
            pass

    def held(self, owner) -> tuple[int, int]:
        """(buffers, bytes) `owner` holds."""
        with self._lock:
            mine = [g for g in self._grants.values() if g.owner == owner]
            return len(mine), sum(g.length for g in mine)

    # --- internals --------------------------------------------------------------------------------------
    def _free(self) -> int:
        try:
            st = os.fstatvfs(self._dir_fd)
            return st.f_bavail * st.f_frsize
        except OSError:
            return 0

    def _release(self, grant: Grant) -> None:
        with self._lock:
            grant.users -= 1
            grant.last_used = self.clock()
            if grant.closed and grant.users == 0:
                os.close(grant.fd)

    def _reap_locked(self, now: float) -> int:
        idle = [g for g in self._grants.values() if g.users == 0 and now - g.last_used > self.idle_seconds]
        for grant in idle:
            self._close_locked(grant)
        return len(idle)

    def _close_locked(self, grant: Grant) -> None:
        del self._grants[grant.handle]
        grant.closed = True
        if grant.linked:
            grant.linked = False
            self._unlink(grant.file_name, grant.inode)
        if grant.users == 0:
            os.close(grant.fd)  # a call still using it closes it when done (no descriptor reuse under it)

    def _unlink(self, name: str, inode: int | None) -> None:
        """Remove our file's name, and only ours: a name someone replaced with another file stays."""
        try:
            if inode is not None:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
                if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
                    return
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError:
            pass  # already gone (the client may remove it too), or the folder went away


# --- the calls that use them (gRPC's OpenSharedBuffer, CloseSharedBuffer, GetShared and a Put from a buffer) -------
def _enabled(buffers: SharedBuffers | None) -> SharedBuffers:
    if buffers is None:
        raise NotServed("shared-memory transfer is disabled on this sidecar (start it with --shm-dir)")
    return buffers


def open_buffer(buffers: SharedBuffers | None, caller, length: int) -> Grant:
    buffers = _enabled(buffers)
    if length == 0:
        raise InvalidRequest("length must be positive")
    try:
        return buffers.open(caller.identity, length)
    except BufferLimit as exc:
        raise NoCapacity(str(exc)) from None
    except SharedBufferError as exc:
        raise NotServed(str(exc)) from None


def close_buffer(buffers: SharedBuffers | None, caller, handle: str) -> None:
    if not _enabled(buffers).close(caller.identity, handle):
        raise NotFound(f"shared_buffer {handle[:64]!r} is not a buffer this client opened, or it was closed already")


def shared_file(buffers: SharedBuffers | None, caller, handle: str, need: int | None,
                cap: int | None = None) -> SharedFile:
    """The caller's own shared buffer `handle` for this call (close() it after). Another identity's handle gets
    the same NOT_FOUND as one never granted: neither its bytes nor its existence are revealed."""
    try:
        return _enabled(buffers).use(caller.identity, handle, need, cap)
    except UnknownBuffer as exc:
        raise NotFound(str(exc)) from None
    except SharedBufferError as exc:
        raise InvalidRequest(str(exc)) from None


class SharedFileSink(ChunkSink):
    """A Get into a caller's shared file: each chunk is verified in the stored memory, then written to the file
    one after another (buffer_offset); what is yielded is the ChunkBegin only."""

    def __init__(self, shared: SharedFile):
        self.shared = shared

    def place(self, entry, position: int):
        if position + entry.nbytes > self.shared.size:
            return None
        return host_view(entry), False

    def emit(self, index: int, entry, view, position: int):
        self.shared.write(position, view)
        return chunk_begin(index, entry, position), entry.nbytes


def read_into_shared(engine, caller, request) -> pb.ChunkBatch:
    """Get into the caller's shared-memory file (request.shared_buffer): the chunks' frames, in order."""
    shared = shared_file(engine.buffers, caller, request.shared_buffer.name, request.shared_buffer.length)
    try:
        return pb.ChunkBatch(chunks=list(engine.read_chunks(caller, request, SharedFileSink(shared))))
    except SharedBufferError as exc:  # the buffer's filesystem is full (a client truncated it): stream instead
        raise NoCapacity(str(exc)) from None
    finally:
        shared.close()
