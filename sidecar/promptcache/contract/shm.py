"""Shared-memory buffers for the node-local fast path.

Over a unix socket the gRPC stream carries only metadata; the chunk bytes move through a file in a
shared-memory folder (tmpfs, the sidecar's --shm-dir) that both the client and the sidecar hold open: one copy
each way instead of the four or more of a socket stream.

Who may name what (docs/security.md, "Shared-memory and bulk paths: threat model"): the sidecar creates each
buffer file itself for one caller (OpenSharedBuffer; promptcache.sidecar.shmbuffers) and answers with a random
handle and the file's name. The client opens that file (checking it is the regular file the sidecar created)
and names the buffer by its handle; the sidecar uses the descriptor it opened at creation, never a path, and
takes a handle only from the identity it was granted to. The sidecar reads and writes the file with
pread/pwrite, never through a mapping (see SharedFile).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import threading
from typing import Callable

import numpy as np

log = logging.getLogger("promptcache.contract.shm")


class SharedBufferError(ValueError):
    pass


class SharedFile:
    """The sidecar's use of a buffer for one call: pread/pwrite on the descriptor it opened when it created the
    file, never a mapping, at most `size` bytes. close() ends the use (the descriptor belongs to the registry).

    A mapping would let the client crash the sidecar: truncate the file while the sidecar copies and the copy
    faults with SIGBUS. With pread a truncated file is a short read (refused, naming the chunk), with pwrite
    the file just grows again. The copy is the same one memcpy, done by the kernel."""

    def __init__(self, fd: int, name: str, size: int, release: Callable[[], None] | None = None):
        self.fd, self.name, self.size = fd, name, size
        self._release = release

    def read_into(self, offset: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        got = 0
        while got < view.nbytes:
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n == 0:
                raise SharedBufferError(f"shared_buffer {self.name!r} ends at byte {offset + got}, before the "
                                        f"{view.nbytes} bytes at offset {offset} (was it truncated?)")
            got += n

    def write(self, offset: int, data: np.ndarray) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            try:
                done += os.pwritev(self.fd, [view[done:]], offset + done)
            except OSError as exc:  # ENOSPC: the client truncated its (allocated) buffer and the folder is full
                raise SharedBufferError(f"cannot write {view.nbytes} bytes at offset {offset} of shared_buffer "
                                        f"{self.name[:64]!r}: {exc.strerror or exc}; stream instead") from None

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(directory: str, name: str, writable: bool) -> tuple[int, os.stat_result]:
    """Open a plain file name in `directory` without ever blocking or following a link: O_NONBLOCK (a FIFO's
    open would otherwise wait for a writer forever), O_NOFOLLOW, then fstat and require a regular file.
    Returns (fd, its stat); raises SharedBufferError naming what the name is instead."""
    if not name or "/" in name or name in (".", ".."):
        raise SharedBufferError(f"{name[:64]!r} is not a plain file name")
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(directory, name), flags)
    except OSError as exc:
        raise SharedBufferError(f"{name!r} in {directory} cannot be opened: "
                                f"{'a symbolic link' if exc.errno == errno.ELOOP else exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SharedBufferError(f"{name!r} in {directory} is {kind_of(st.st_mode)}, not a regular file")
    return fd, st


class ClientBuffers:
    """One shared-memory buffer per client thread, reused across calls. The sidecar creates each one for this
    client (`open_buffer(length)` is the OpenSharedBuffer call; `close_buffer(handle)` CloseSharedBuffer)."""

    def __init__(self, directory: str, open_buffer: Callable[[int], object], close_buffer: Callable[[str], None]):
        self.directory = directory
        self._open_buffer = open_buffer
        self._close_buffer = close_buffer
        self._local = threading.local()
        self._all: list[_Buffer] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> "_Buffer":
        """This thread's buffer, at least `size` bytes; a larger one replaces it (sizes double)."""
        buf = getattr(self._local, "buf", None)
        if buf is not None and buf.size >= size:
            return buf
        granted = self._open_buffer(max(size, 2 * buf.size if buf is not None else 0))
        try:
            new = _Buffer(self.directory, granted)
        except SharedBufferError:
            self._close_quietly(granted.handle)
            raise
        if buf is not None:
            self._forget(buf)
            self._close_quietly(buf.handle)
        self._local.buf = new
        with self._lock:
            self._all.append(new)
        return new

    def discard(self) -> None:
        """Drop this thread's buffer without telling the sidecar: it no longer knows the handle (restarted, or
        closed it after --shm-idle-seconds unused)."""
        buf = getattr(self._local, "buf", None)
        if buf is not None:
            self._forget(buf)

    def retire(self) -> None:
        """Drop this thread's buffer and close it on the sidecar: after a Get that failed (deadline, cancelled,
        sidecar error) the sidecar may still be writing that answer into it, and the next Get's answer must not
        share memory with those late writes. The next call opens a new buffer."""
        buf = getattr(self._local, "buf", None)
        if buf is not None:
            self._forget(buf)
            self._close_quietly(buf.handle)

    def close(self) -> None:
        with self._lock:
            buffers, self._all = self._all, []
        for buf in buffers:
            buf.unmap()
            self._close_quietly(buf.handle)

    def _forget(self, buf: "_Buffer") -> None:
        self._local.buf = None
        with self._lock:
            if buf in self._all:
                self._all.remove(buf)
        buf.unmap()

    def _close_quietly(self, handle: str) -> None:
        try:
            self._close_buffer(handle)
        except Exception as exc:  # noqa: BLE001 - the sidecar reclaims it when idle anyway
            log.debug("closing shared buffer failed: %s", exc)


class _Buffer:
    """A buffer the sidecar created: the file it named, checked to be that very file, mapped and pre-faulted."""

    def __init__(self, directory: str, granted):
        self.handle = granted.handle
        fd, st = open_regular(directory, granted.file_name, writable=True)
        try:
            if st.st_ino != granted.inode or st.st_size < granted.length or granted.length == 0:
                raise SharedBufferError(f"{granted.file_name!r} in {directory} is not the buffer the sidecar "
                                        f"created (inode {st.st_ino}, {st.st_size} bytes; expected inode "
                                        f"{granted.inode}, {granted.length} bytes)")
            # Writing into a mapping of a sparse file on a full tmpfs is a SIGBUS that kills this process: the
            # pages must exist before the mapping is touched. The sidecar allocates them when it creates the
            # buffer; allocate again here (a no-op then), so a sidecar that did not cannot crash us either.
            try:
                os.posix_fallocate(fd, 0, granted.length)
            except OSError as exc:
                raise SharedBufferError(f"no room for a {granted.length}-byte shared buffer in {directory}: "
                                        f"{exc.strerror or exc}") from None
            self.mm = mmap.mmap(fd, granted.length, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)  # the mapping keeps the file; the sidecar has its own descriptor
        self.size = granted.length
        self.array: np.ndarray | None = np.frombuffer(self.mm, dtype=np.uint8)
        self.array.fill(0)  # fault the pages in here: they are the client's memory, not the sidecar's

    @property
    def name(self) -> str:
        """What requests name the buffer by: its handle (not the file name)."""
        return self.handle

    def unmap(self) -> None:
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it
