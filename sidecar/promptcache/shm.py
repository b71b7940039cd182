"""Shared-memory buffers for the node-local fast path.

Over a unix socket the gRPC stream carries only metadata; the chunk bytes move through a file in a
shared-memory folder (tmpfs, e.g. /dev/shm/promptcache) that both the client and the sidecar can open: one
copy each way instead of the four or more of a socket stream. The client creates and owns the file; the
sidecar opens it by plain name inside its --shm-dir only (no paths, no symlinks, regular files only) and reads
or writes it with pread/pwrite, never through a mapping (see SharedFile).
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import uuid
import weakref

import numpy as np

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class SharedBufferError(ValueError):
    pass


class SharedFile:
    """The sidecar's handle on a client's buffer file, read and written with pread/pwrite, never mapped.

    A mapping would let the client crash the sidecar: truncate the file while the sidecar copies and the copy
    faults with SIGBUS. With pread a truncated file is a short read (refused, naming the chunk), with pwrite
    the file just grows again. The copy is the same one memcpy, done by the kernel."""

    def __init__(self, fd: int, name: str, size: int):
        self.fd, self.name, self.size = fd, name, size

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
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_shared(directory: str, name: str, need: int | None, writable: bool,
                cap: int | None = None) -> SharedFile:
    """Open `directory/name` for reading (and writing) its first `need` bytes (None: the whole file, at most
    `cap` bytes). Raises SharedBufferError saying what is wrong."""
    if not _NAME.fullmatch(name or ""):
        raise SharedBufferError(f"shared_buffer name {name!r} is not a plain file name "
                                "(letters, digits, '.', '_', '-'; at most 128)")
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SharedBufferError(f"shared_buffer {name!r} cannot be opened in the sidecar's --shm-dir: "
                                f"{exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SharedBufferError(f"shared_buffer {name!r} is not a regular file")
        need = (st.st_size if cap is None else min(st.st_size, cap)) if need is None else need
        if st.st_size < need:
            raise SharedBufferError(f"shared_buffer {name!r} has {st.st_size} bytes, {need} are needed")
        if need == 0:
            raise SharedBufferError(f"shared_buffer {name!r} is empty")
    except BaseException:
        os.close(fd)
        raise
    return SharedFile(fd, name, need)


class ClientBuffers:
    """One growing shared-memory file per client thread, reused across calls, removed on close()."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._local = threading.local()
        self._all: list[_Buffer] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> "_Buffer":
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = _Buffer(self.directory)
            self._local.buf = buf
            with self._lock:
                self._all.append(buf)
        buf.ensure(size)
        return buf

    def close(self) -> None:
        with self._lock:
            for buf in self._all:
                buf.close()
            self._all.clear()


class _Buffer:
    def __init__(self, directory: str):
        self.name = f"pc-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(directory, self.name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o660)
        self.size = 0
        self.mm: mmap.mmap | None = None
        self.array: np.ndarray | None = None
        self._finalizer = weakref.finalize(self, _remove, self.path)

    def ensure(self, size: int) -> None:
        if size <= self.size:
            return
        size = max(size, 2 * self.size)
        self.array = None
        if self.mm is not None:
            self.mm.close()
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.array.fill(0)  # fault the pages in here: they are the client's memory, not the sidecar's
        self.size = size

    def close(self) -> None:
        self.array = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with it
        os.close(self.fd)
        self._finalizer()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
