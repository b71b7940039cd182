"""Chunk memory the sidecar can lend: each stored chunk in a memfd of its own, sealed before it is first read.

Why: on the bulk channel's unix socket a Get can then hand the client the chunk's memfd (SCM_RIGHTS) and the
client maps it: no chunk byte is copied by anyone (docs/bulk-channel.md, "Lent chunks"). The seals make the
lent memory immutable: after F_SEAL_FUTURE_WRITE no new writable shared mapping and no write() is allowed
(through any descriptor, a reopened one included), and F_SEAL_SHRINK/F_SEAL_GROW/F_SEAL_SEAL keep its size and
seals fixed, so no client can change the bytes, punch holes or truncate it under the sidecar (which would make
its reads fault). The sidecar's own mapping, made before sealing to receive the bytes, is then made read-only
(mprotect): from the seal on nothing in any process can change the chunk, so once a Get has verified it there
its checksum holds for as long as it lives and later lends need not hash it again (a stray write in the sidecar
faults instead of corrupting it).

The seal waits for the chunk's first read (MemoryTier.seal, bulk.LendSink), not its Put: a chunk nobody read
was never lent, so when it is evicted its memfd, mapping and pages go to the next chunk of its size (the tier's
free list). A fresh memfd for every chunk a Put stores (create, fault in, seal; unmap and free at eviction) took
5 of an 8 MiB Put's 8.4 ms of CPU (hack/bulk-split.py --memfd --budget-mb 320). A sealed memfd is never reused: a client may map it.

A CPU tier that does not lend (an old kernel, a TCP-only bulk channel, --bulk-zero-copy off) keeps each chunk in
an anonymous mapping of its own instead (ProtectedMemory), made read-only in the same way once the first Get has
verified its bytes: later Gets send it without hashing it again. A CUDA tier keeps plain tensors.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import resource
import threading
import weakref

import numpy as np
import torch

from promptcache.contract.bulkwire import LENT_SEALS as SEALS
from promptcache.contract.bulkwire import MMAP_OPTIONS

log = logging.getLogger("promptcache.sidecar.memfd")
_libc = ctypes.CDLL(None, use_errno=True)

FDS_PER_CHUNK = 1 if MMAP_OPTIONS else 2
RESERVED_FDS = 2048  # left for sockets, RocksDB files and the rest of the process


class SealedChunk:
    """One chunk's memfd. Its descriptor is closed when the last reference goes (entry evicted and no Get still
    sending it); memory a client has mapped lives on until the client unmaps it."""

    __slots__ = ("fd", "sealed", "read_only", "immutable", "_pool", "_mapping")
    _sealing = threading.Lock()  # two Gets may seal one chunk at once: the second finds it sealed

    def __init__(self, fd: int, pool: "ChunkMemory"):
        self.fd, self.sealed, self.read_only, self.immutable, self._pool = fd, False, False, False, pool
        self._mapping: tuple[int, int] | None = None  # (address, length) of the sidecar's own mapping

    def seal(self) -> bool:
        """Seal the memfd, then make the sidecar's mapping read-only (`read_only` says it is); idempotent. False if
        it cannot be sealed (it is then never lent)."""
        if self.sealed:  # every lend asks: no lock once it is
            return True
        with self._sealing:
            if self.sealed:
                return True
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            except OSError as exc:  # never expected after probe(); the chunk is then served by copying
                log.warning("could not seal a chunk memfd; it will not be lent: %s", exc)
                return False
            self.sealed = True
            if self._mapping is not None:
                # the chunk is still lent when this fails, and hashed again before each lend
                self.read_only = protect(*self._mapping, writable=False)
            return True

    def verified(self) -> None:
        """A reader hashed the sealed chunk where it lies and found its checksum: with the mapping read-only,
        nothing can change it any more, so no lend hashes it again (`immutable`)."""
        self.immutable = self.sealed and self.read_only

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, TypeError):
            pass
        self._pool.freed()


def protect(address: int, length: int, writable: bool) -> bool:
    """mprotect a whole mapping read-only (`writable` False) or read-write again; False, with a warning, if the
    kernel refused."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if _libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(length), prot) == 0:
        return True
    log.warning("could not make a chunk's mapping %s: %s", "writable" if writable else "read-only",
                os.strerror(ctypes.get_errno()))
    return False


class ProtectedMemory:
    """Host memory for the chunks of a CPU tier that does not lend: each chunk in a private anonymous mapping of
    its own (page-aligned, so it can be made read-only alone), pre-faulted in one call. MemoryTier.seal makes it
    read-only once the first Get verified the bytes in it, so later Gets need not hash them again before sending
    (a stray write in the sidecar faults instead of corrupting a chunk); the tier makes it writable again when it
    reuses the memory for another chunk. Each live chunk holds one mapping: at most `limit` (the kernel's limit on
    mappings per process bounds them); past it allocate() gives plain tensors, which are hashed before each send."""

    def __init__(self, limit: int):
        self.limit = limit
        self._live = 0
        self._lock = threading.Lock()

    @property
    def live(self) -> int:
        return self._live

    def _freed(self) -> None:
        with self._lock:
            self._live -= 1

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """(memory for `nbytes`, whether it is a mapping of its own that protect() may change)."""
        with self._lock:
            room = nbytes > 0 and self._live < self.limit
            if room:
                self._live += 1
        if not room:
            return torch.empty(nbytes, dtype=torch.uint8), False
        try:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            self._freed()
            return torch.empty(nbytes, dtype=torch.uint8), False
        weakref.finalize(mm, self._freed).atexit = False  # counted down when the last view of it goes (unmapped)
        return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8)), True


def mapping_budget() -> int:
    """Chunks that may each hold a mapping of their own: half the kernel's limit on mappings per process."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return 65530 // 2


def probe() -> str:
    """Why chunk memory cannot be lent on this machine, or "" if it can (memfd with the seals above)."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available (Linux only)"
    try:
        fd = os.memfd_create("promptcache-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        return f"memfd_create failed: {exc.strerror}"
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return ""
    except OSError as exc:
        return f"this kernel cannot seal a memfd against future writes (Linux >= 5.1 needed): {exc.strerror}"
    finally:
        os.close(fd)


def descriptor_budget() -> int:
    """Chunks that may hold a memfd: bounded by open files (raising the soft limit to the hard one) and by
    the kernel's limit on mappings per process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(0, min((soft - RESERVED_FDS) // FDS_PER_CHUNK, mapping_budget()))


class ChunkMemory:
    """Allocates host memory for chunks: a memfd each while under `limit` live ones, plain memory after that
    (those chunks are served by copying)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._live = 0
        self._lock = threading.RLock()  # RLock: SealedChunk.__del__ may run inside allocate() (a GC pass)

    @property
    def live(self) -> int:
        return self._live

    def freed(self) -> None:
        with self._lock:
            self._live -= 1

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, SealedChunk | None]:
        with self._lock:
            full = nbytes == 0 or self._live >= self.limit
            if not full:
                self._live += 1
        if full:
            return torch.empty(nbytes, dtype=torch.uint8), None
        try:
            fd = os.memfd_create("promptcache-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError:
            self.freed()
            return torch.empty(nbytes, dtype=torch.uint8), None
        chunk = SealedChunk(fd, self)  # owns fd (and the count) from here on
        try:
            os.ftruncate(fd, nbytes)
            # Pre-faulted in one call: the bytes are written at once anyway.
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, **MMAP_OPTIONS)
        except OSError:
            return torch.empty(nbytes, dtype=torch.uint8), None
        array = np.frombuffer(mm, dtype=np.uint8)
        chunk._mapping = array.ctypes.data, nbytes  # mmap maps whole pages from a page boundary
        return torch.from_numpy(array), chunk
