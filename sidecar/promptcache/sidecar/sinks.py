"""Where a Get's chunks go: the engine (CacheEngine.read_chunks) finds, leases and verifies each chunk, and hands
it to a sink that belongs to the transport. A sink places the bytes (a stream sends the stored memory itself; a
copy into a caller's buffer is made first and verified where the caller reads it; a lent memfd is passed as it is)
and says what the engine yields for it. The sinks of the gRPC stream and of a buffer in this process live here; the
bulk channel's lending sink and the shared-file sink live beside their transports (bulk.py, shmbuffers.py).
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from promptcache.v1 import kvcache_pb2 as pb


def chunk_begin(index: int, entry, offset: int = 0) -> pb.ChunkBegin:
    return pb.ChunkBegin(index=index, nbytes=entry.nbytes, shape=entry.shape, dtype=entry.dtype,
                         xxh3_64=entry.checksum, buffer_offset=offset)


class PinnedCopies:
    """Copies of a CUDA tier's chunks in page-locked host memory, for serving them. A copy from the device into
    fresh pageable memory (tensor.cpu()) ran at 2.1 GB/s on an H200 node, mostly first-touch page faults; into
    page-locked memory at 55 (docs/gpu-lane.md). The copies come from torch's pinned allocator, which keeps freed
    blocks for the next ones; the copies alive at once are bounded here (torch's own figures lag behind frees), so
    what the allocator holds stays about `bound` bytes (its blocks are powers of two). Beyond the bound, or when
    page-locking fails, a chunk is copied as before. Thread-safe."""

    def __init__(self, bound: int):
        self.bound = bound
        self.live = 0  # bytes of page-locked copies not yet dropped
        self._lock = threading.Lock()

    def _release(self, n: int) -> None:
        with self._lock:
            self.live -= n

    def array(self, t: torch.Tensor) -> np.ndarray:
        """t's bytes (t on a CUDA device) in host memory, as the array a transport sends; they are there when this
        returns. A page-locked copy counts until the array and every view of it are gone (the array, not the
        tensor: a tensor's numpy() keeps its memory alive, not the tensor object)."""
        n = t.numel() * t.element_size()
        with self._lock:
            fits = self.live + n <= self.bound
            if fits:
                self.live += n
        if not fits:
            return t.cpu().numpy()
        try:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: as before
            self._release(n)
            return t.cpu().numpy()
        host.copy_(t)  # synchronous
        out = host.numpy()
        weakref.finalize(out, self._release, n)
        return out


PINNED_COPIES = PinnedCopies(256 << 20)  # per sidecar process: a few dozen chunks on their way out


def host_view(entry) -> np.ndarray:
    """The entry's bytes in host memory (its own memory for a CPU tier, a copy from a CUDA tier)."""
    return entry.array if entry.data.device.type == "cpu" else PINNED_COPIES.array(entry.data)


class ChunkSink:
    """The stream: yields (ChunkBegin, the stored bytes); the transport sends them before asking for the next."""

    def place(self, entry, position: int):
        """Put the chunk where it goes. Returns (the bytes to verify, already verified?), or None when there is
        no room for it (the Get ends at the chunk before). A chunk whose memory has been read-only since its
        bytes were verified in it (entry.immutable) is not hashed again: nothing can have changed it."""
        return host_view(entry), entry.immutable

    def emit(self, index: int, entry, view, position: int):
        """After the bytes were verified: (what read_chunks yields, bytes of the destination it used)."""
        return (chunk_begin(index, entry), view), 0


class ArraySink(ChunkSink):
    """Copies the chunks one after another into `target` (a mapping the caller reads: the bulk channel's attached
    memfd), and the copy is what gets verified: the bytes exactly where the caller will read them."""

    def __init__(self, target: np.ndarray):
        self.target = target

    def place(self, entry, position: int):
        if position + entry.nbytes > self.target.size:
            return None
        view = self.target[position:position + entry.nbytes]
        if entry.data.device.type == "cpu":
            view[:] = entry.array  # one plain memcpy (torch's copy_ measured slower here)
        else:
            torch.from_numpy(view).copy_(entry.data)
        return view, False

    def emit(self, index: int, entry, view, position: int):
        return (chunk_begin(index, entry, position), view), entry.nbytes
