"""Where a Get's chunks go: the engine (CacheEngine.read_chunks) finds, leases and verifies each chunk, and hands
it to a sink that belongs to the transport. A sink places the bytes (a stream sends the stored memory itself; a
copy into a caller's buffer is made first and verified where the caller reads it; a lent memfd is passed as it is)
and says what the engine yields for it. The sinks of the gRPC stream and of a buffer in this process live here; the
bulk channel's lending sink and the shared-file sink live beside their transports (bulk.py, shmbuffers.py).
"""
from __future__ import annotations

import numpy as np
import torch

from promptcache.v1 import kvcache_pb2 as pb


def chunk_begin(index: int, entry, offset: int = 0) -> pb.ChunkBegin:
    return pb.ChunkBegin(index=index, nbytes=entry.nbytes, shape=entry.shape, dtype=entry.dtype,
                         xxh3_64=entry.checksum, buffer_offset=offset)


def host_view(entry) -> np.ndarray:
    """The entry's bytes in host memory (its own memory for a CPU tier, a copy from a CUDA tier)."""
    return entry.array if entry.data.device.type == "cpu" else entry.data.cpu().numpy()


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
