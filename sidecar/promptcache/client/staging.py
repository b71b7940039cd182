"""Host staging for a GPU worker's saves and loads: a request's K/V leaves the device as its stored chunks, and
loaded chunks reach it, through a reused, page-locked host buffer (one per thread that uses it).

Measured on an H200 node (hack/gpu-copy-paths.py, 256 MiB, docs/gpu-lane.md): device -> host into a fresh pageable
tensor (``tensor.cpu()``, what a save did) 2.1 GB/s, most of it first-touch page faults; into a reused pageable
buffer 19.7 GB/s; into page-locked memory 55 GB/s, the PCIe link's speed. Splitting the host copy into chunks then
cost another copy into fresh memory (each chunk is a token slice of every layer); now each chunk is copied from the
device straight into its place in the buffer, so the host copy is the chunks. For loads, `uploads` copies each
received chunk (a lent mapping or the receive buffer) into the buffer at host memory speed and from it to the
device asynchronously, instead of a pageable copy: `promptcache bench paged` measured the load's scatter 1.5-2.2x
faster that way on an H200, bit-exact.

One buffer, sized to the largest save or load seen (rounded up to 64 MiB) and never beyond ``capacity`` bytes; it
is page-locked with cudaHostRegister (exact size: torch's pinned allocator rounds to powers of two) and used by one
holder at a time. A save larger than the buffer is staged in parts (`parts`, a Put each); one that finds the buffer
in use copies as before; a load that does not fit goes around the buffer. A save's chunks are views of the buffer,
valid inside the ``with`` block only: the caller's Put, which sends them before it returns, must happen inside it;
a load's device copies may still be reading the buffer when the block ends, so leaving it waits for the stream.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

log = logging.getLogger("promptcache.client.staging")

DEFAULT_CAPACITY = 512 << 20  # the connector's staging_bytes: Llama-3-8B's 2048-token save (256 MiB in bf16) twice
GRAIN = 64 << 20  # the buffer grows in steps of this, so that a slightly longer prompt does not re-register it


def chunk_slices(T: int, chunk_tokens: int) -> list[slice]:
    """The token slices of the chunks of T tokens; ValueError unless they are whole chunks."""
    if chunk_tokens <= 0 or T % chunk_tokens:
        raise ValueError(f"{T} tokens are not whole chunks of {chunk_tokens}")
    return [slice(i, i + chunk_tokens) for i in range(0, T, chunk_tokens)]


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process, not only the registering one


def _cuda_register(t: torch.Tensor) -> bool:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), CUDA_HOST_REGISTER_PORTABLE)
    return int(getattr(rc, "value", rc)) == 0


def _cuda_unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _on(device: torch.device):
    """The CUDA runtime calls under `device`: a raw runtime call in a thread that never chose a device runs on
    device 0 and creates its context there (hundreds of MB of GPU 0 taken by every tensor-parallel worker)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _cuda_synchronize(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


class HostStaging:
    """A save or load thread's host buffer (module docstring). Thread-safe: one holder at a time, others copy as
    before.

    capacity: bytes the buffer may take (0: never staged). devices: the device types whose tensors are staged (CPU
    tensors already are host memory: their chunks are made contiguous where they are). register / unregister:
    page-lock a uint8 host tensor and undo it (default: cudaHostRegister); synchronize: wait for the current stream
    of a device (default: CUDA's). Tests pass their own."""

    def __init__(self, capacity: int, *, devices: Sequence[str] = ("cuda",),
                 register: Callable[[torch.Tensor], bool] = _cuda_register,
                 unregister: Callable[[torch.Tensor], None] = _cuda_unregister,
                 synchronize: Callable[[torch.device], None] = _cuda_synchronize):
        if capacity < 0:
            raise ValueError(f"staging capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.devices = tuple(devices)
        self._register, self._unregister, self._synchronize = register, unregister, synchronize
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None
        self._device = torch.device("cpu")  # whose context page-locked the buffer
        self._pinned = False
        self.staged = 0  # saves (or loads) that went through the buffer
        self.unstaged = 0  # saves (or loads) of a staged device that did not fit or found the buffer busy

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now (0 before the first staged save)."""
        return 0 if self._buf is None else self._buf.numel()

    @property
    def pinned(self) -> bool:
        return self._pinned

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The buffer, grown to hold nbytes, page-locked from `device`'s context (the caller holds the lock and
        checked nbytes <= capacity)."""
        if self._buf is None or self._buf.numel() < nbytes:
            self._release_buffer()
            size = min(self.capacity, -(-nbytes // GRAIN) * GRAIN)
            self._buf = torch.empty(size, dtype=torch.uint8)
            try:
                with _on(device):
                    self._pinned = bool(self._register(self._buf))
                self._device = device
            except Exception as exc:  # noqa: BLE001 - a reused pageable buffer is still 10x a fresh one
                log.warning("promptcache: host staging buffer not page-locked (%s); using it pageable", exc)
                self._pinned = False
        return self._buf

    def _release_buffer(self) -> None:
        if self._buf is not None and self._pinned:
            with _on(self._device):
                self._unregister(self._buf)
        self._buf, self._pinned = None, False

    def parts(self, kv: torch.Tensor, chunk_tokens: int) -> list[slice]:
        """The token slices of kv [L, P, H, T, D] to stage one after another, so that a save larger than the buffer
        still goes through it (a Put per part, each of whole chunks that fit): one slice of all T unless kv's
        device is staged and kv is larger than the capacity (and a chunk fits in it)."""
        T = kv.shape[3]
        chunk_bytes = kv[:, :, :, :chunk_tokens].numel() * kv.element_size()
        whole = [slice(0, T)]
        if kv.device.type not in self.devices or chunk_bytes == 0 or chunk_bytes > self.capacity or \
                kv.numel() * kv.element_size() <= self.capacity:
            return whole
        step = self.capacity // chunk_bytes * chunk_tokens
        return [slice(i, min(i + step, T)) for i in range(0, T, step)]

    @contextlib.contextmanager
    def chunks(self, kv: torch.Tensor, chunk_tokens: int) -> Iterator[list[torch.Tensor]]:
        """kv [L, P, H, T, D] (any device) -> its T / chunk_tokens chunks [L, P, H, chunk_tokens, D], contiguous, in
        host memory (what split_chunks makes): views of the staging buffer when kv's device is staged, kv fits and
        the buffer is free, else fresh host tensors. Use them inside the block only.

        Chunk by chunk, each a token slice of every layer: on a GPU each copy makes its slice contiguous there (a
        chunk-sized temporary, not a second copy of the request) and lands in its place in the buffer."""
        parts = chunk_slices(kv.shape[3], chunk_tokens)
        nbytes = kv.numel() * kv.element_size()
        staged = kv.device.type in self.devices
        if not (staged and nbytes <= self.capacity and self._lock.acquire(blocking=False)):
            self.unstaged += staged
            yield [kv[:, :, :, part].cpu().contiguous() for part in parts]
            return
        try:
            src = kv.view(torch.uint8) if kv.element_size() == 1 else kv  # fp8 moves as its bytes
            L, P, H, _, D = kv.shape
            host = self._buffer(nbytes, kv.device)[:nbytes].view(src.dtype)
            host = host.view(len(parts), L, P, H, chunk_tokens, D)
            for i, part in enumerate(parts):
                host[i].copy_(src[:, :, :, part])
            self.staged += 1
            yield list(host.view(kv.dtype).unbind(0))
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def uploads(self, chunks: Sequence[torch.Tensor], device: torch.device) -> Iterator[Callable[[torch.Tensor],
                                                                                                  torch.Tensor]]:
        """Yields upload(chunk) -> its copy on `device`, for host chunks (`chunks` sizes the buffer: the ones to be
        uploaded). Through the buffer when the device is staged and the buffer is free: each chunk copied into the
        next free place in it (host memory speed), then to the device asynchronously on the current stream (the
        link's speed; the next chunk's host copy overlaps it). When the chunks do not all fit (beyond capacity),
        the buffer is used as a ring: before a place is written again the stream is waited for. A chunk larger
        than the buffer, or every chunk when the device is not staged or the buffer is busy, is copied from where
        it is (pageable: 12 GB/s at best on an H200, against 55).

        One chunk at a time, so the caller holds one device copy at a time (a load's device memory stays one
        chunk, not the whole load, beyond vLLM's own). On leaving, even by an exception, the current stream is
        waited for before the buffer is given back, so no copy out of it is in flight when the next holder
        writes it."""
        device = torch.device(device)
        nbytes = min(self.capacity, sum(c.numel() * c.element_size() for c in chunks))
        staged = device.type in self.devices

        def plain(c: torch.Tensor) -> torch.Tensor:
            return c.to(device, non_blocking=True)

        if not (staged and nbytes > 0 and self._lock.acquire(blocking=False)):
            self.unstaged += staged
            yield plain
            return
        try:
            buf = self._buffer(nbytes, device)
            size, off = buf.numel(), 0

            def upload(c: torch.Tensor) -> torch.Tensor:
                nonlocal off
                n = c.numel() * c.element_size()
                if n > size:
                    return plain(c)
                if off + n > size:  # around the ring: the copies out of the places about to be written are done
                    self._synchronize(device)
                    off = 0
                slot = buf[off:off + n]
                off += n
                slot.copy_(c.reshape(-1).view(torch.uint8))
                return slot.view(c.dtype).view(c.shape).to(device, non_blocking=True)

            self.staged += 1
            yield upload
        finally:
            try:
                self._synchronize(device)
            finally:
                self._lock.release()

    def close(self) -> None:
        """Unpin and drop the buffer (waits for a save that holds it)."""
        with self._lock:
            self._release_buffer()
