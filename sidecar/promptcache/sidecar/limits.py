"""Per-call limits, so that clients that open streams and stall cannot starve the others.

* `CallLimiter`: at most N calls in flight per client (the authenticated tenant, or the peer address when
  auth is off); the next one is refused at once with RESOURCE_EXHAUSTED instead of taking a worker thread.
* `Watchdog`: one thread that cancels calls that run longer than --max-call-seconds, and streams idle for
  --stream-idle-seconds: a Put whose client sent nothing, a Get whose client stopped reading. A cancelled Put
  releases its reservation (nothing partial is stored); a cancelled Get releases its lease. The client sees
  DEADLINE_EXCEEDED with a message naming the limit.
* The watchdog also cancels a Put that holds a memory reservation but sends less than
  --min-put-bytes-per-second, averaged over --put-rate-window-seconds: each byte is progress, so the idle limit
  alone lets a client that trickles one byte every few seconds keep its reservation for --max-call-seconds.
* `ReservedBytes`: what the Puts of one client hold reserved at once (--max-put-reserved-fraction).
* `LargeRequests`: how many requests of more than LARGE_REQUEST_TOKENS tokens are processed at once
  (--max-large-requests).
The gRPC side (the `Guard` interceptor that applies authentication and these limits to every call) is
promptcache.sidecar.guard; the bulk channel applies them itself. Nothing here imports grpc.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

from promptcache.sidecar.errors import NoCapacity

log = logging.getLogger("promptcache.sidecar.limits")
LARGE_REQUEST_TOKENS = 1 << 16  # a request with more tokens than this needs one of --max-large-requests


class CallLimiter:
    def __init__(self, max_per_client: int):
        self.max_per_client = max_per_client
        self._lock = threading.Lock()
        self._active: dict[str, int] = defaultdict(int)

    def acquire(self, client: str) -> bool:
        if self.max_per_client <= 0:
            return True
        with self._lock:
            if self._active[client] >= self.max_per_client:
                return False
            self._active[client] += 1
            return True

    def release(self, client: str) -> None:
        if self.max_per_client <= 0:
            return
        with self._lock:
            self._active[client] -= 1
            if self._active[client] <= 0:
                del self._active[client]

    def active(self, client: str) -> int:
        with self._lock:
            return self._active.get(client, 0)


class ReservedBytes:
    """Bytes reserved by each client's Puts in flight. A client may always hold one chunk; beyond that, no more
    than `limit` bytes together, so that one client's slow or stalled Puts cannot hold the whole budget."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[str, int] = defaultdict(int)

    def hold(self, client: str, nbytes: int, limit: int) -> bool:
        with self._lock:
            held = self._held.get(client, 0)
            if held and held + nbytes > limit:
                return False
            self._held[client] = held + nbytes
            return True

    def release(self, client: str, nbytes: int) -> None:
        with self._lock:
            self._held[client] -= nbytes
            if self._held[client] <= 0:
                del self._held[client]

    def held(self, client: str) -> int:
        with self._lock:
            return self._held.get(client, 0)


class SharedSlots:
    """`limit` slots shared by clients, with the last `reserve` free ones kept for clients that hold none: one client
    (a tenant) that takes slots and stalls cannot take them all from the others."""

    def __init__(self, limit: int, reserve: int):
        self.limit = limit
        self.reserve = reserve
        self._lock = threading.Lock()
        self.active = 0
        self._held: dict[str, int] = {}  # client -> slots it holds (only clients holding one)

    def acquire(self, client: str | None = None) -> bool:
        """`client`: who the slot counts against; None where the caller cannot be told apart from others (anonymous
        gRPC over a unix socket: every peer is "unix:"), for whom only the total applies."""
        with self._lock:
            held = self._held.get(client, 0) if client is not None else 0
            if self.active >= self.limit or (held and self.limit - self.active <= self.reserve):
                return False
            self.active += 1
            if client is not None:
                self._held[client] = held + 1
            return True

    def release(self, client: str | None = None) -> None:
        with self._lock:
            self.active -= 1
            if client is None:
                return
            held = self._held.get(client, 0) - 1
            if held > 0:
                self._held[client] = held
            else:
                self._held.pop(client, None)


class LargeRequests(SharedSlots):
    """At most `limit` large requests (more than LARGE_REQUEST_TOKENS tokens) at once; the next is refused. The
    last free one is kept for a client that holds none: one tenant (or, on the bulk channel without
    authentication, one process or address) that announces large requests and stalls them cannot take every slot."""

    def __init__(self, limit: int):
        super().__init__(limit, reserve=1)

    def refusal(self, what: str) -> NoCapacity:
        return NoCapacity(f"{what}: {self.limit} requests of more than {LARGE_REQUEST_TOKENS} tokens are already "
                          "being served, or this client holds some and the last one is kept for another "
                          "(--max-large-requests); retry later")


class WorkerShare(SharedSlots):
    """The gRPC server's `workers` threads among authenticated clients (tenants): a call in flight holds a worker
    for its whole length, and calls beyond the workers wait in gRPC's queue, where no limit sees them. So a client
    that already has calls in flight cannot take one of the last free workers (an eighth, at least one): one
    tenant's stalled streams cannot hold every worker and leave the others waiting until their deadlines."""

    def __init__(self, workers: int):
        super().__init__(workers, reserve=max(1, workers // 8))

    @property
    def workers(self) -> int:
        return self.limit

    @property
    def busy(self) -> int:
        return self.active

    def refusal(self) -> str:
        return (f"this client has calls in flight and the last {self.reserve} of the sidecar's {self.workers} gRPC "
                "workers (--workers) are kept for other clients; retry later")


class _Watch:
    __slots__ = ("cancel", "rpc", "started", "last", "idle", "max_seconds", "expired", "reason",
                 "holding", "received", "window_start", "window_received")

    def __init__(self, cancel, rpc: str, max_seconds: float, idle: float):
        self.cancel = cancel  # cancel(reason): how the call is cut off (its transport decides)
        self.rpc = rpc
        self.started = self.last = time.monotonic()
        self.max_seconds = max_seconds
        self.idle = idle          # 0: no idle limit (unary calls, Get)
        self.expired = False
        self.reason = ""
        self.holding = 0            # bytes of memory reservation the call holds (a Put receiving a chunk)
        self.received = 0           # bytes received while holding one
        self.window_start = 0.0
        self.window_received = 0

    def touch(self) -> None:
        self.last = time.monotonic()

    def hold(self, nbytes: int) -> None:
        """The call now holds a reservation of `nbytes` (0: none): the minimum rate applies while it does."""
        if nbytes and not self.holding:
            self.window_start, self.window_received = time.monotonic(), self.received
        self.holding = nbytes

    def progress(self, nbytes: int) -> None:
        self.received += nbytes


class Watchdog:
    def __init__(self, max_call_seconds: float, stream_idle_seconds: float, on_expire=None,
                 min_put_bytes_per_second: int = 0, put_rate_window_seconds: float = 10.0):
        """on_expire(rpc, limit) is called for every call cancelled, limit being "idle", "duration" or "rate"."""
        self.max_call_seconds = max_call_seconds
        self.stream_idle_seconds = stream_idle_seconds
        self.min_rate = min_put_bytes_per_second
        self.rate_window = put_rate_window_seconds
        self.on_expire = on_expire or (lambda rpc, reason: None)
        self._lock = threading.Lock()
        self._watches: set[_Watch] = set()
        self._stop = threading.Event()
        limits = [s for s in (max_call_seconds, stream_idle_seconds,
                              put_rate_window_seconds if min_put_bytes_per_second else 0) if s > 0]
        self.tick = min([0.25] + [s / 4 for s in limits])
        self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
        self._thread.start()

    def watch(self, cancel, rpc: str, idle: bool) -> _Watch:
        """Watch one call; cancel(reason) is called (from the watchdog's thread) when it breaks a limit."""
        w = _Watch(cancel, rpc, self.max_call_seconds, self.stream_idle_seconds if idle else 0.0)
        with self._lock:
            self._watches.add(w)
        return w

    def unwatch(self, w: _Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                due = []
                for w in self._watches:
                    if w.max_seconds > 0 and now - w.started > w.max_seconds:
                        w.reason = (f"{w.rpc} ran longer than {w.max_seconds:g} s (--max-call-seconds); "
                                    "cancelled, nothing partial was stored")
                    elif w.idle > 0 and now - w.last > w.idle:
                        w.reason = (f"{w.rpc} stream made no progress for {w.idle:g} s (--stream-idle-seconds: "
                                    "the client sent or read nothing); cancelled, nothing partial was stored")
                    elif not self._too_slow(w, now):
                        continue
                    due.append(w)
                for w in due:
                    self._watches.discard(w)
            for w in due:
                w.expired = True
                log.warning("cancelled a call", extra={"rpc": w.rpc, "reason": w.reason})
                self.on_expire(w.rpc, "duration" if "--max-call-seconds" in w.reason
                               else "rate" if "--min-put-bytes-per-second" in w.reason else "idle")
                w.cancel(w.reason)

    def _too_slow(self, w: _Watch, now: float) -> bool:
        """Under the lock: whether `w` held a reservation for a whole window while receiving less than the
        minimum rate over it (then w.reason says so); a window that passes starts the next one."""
        if not self.min_rate or not w.holding or now - w.window_start < self.rate_window:
            return False
        got = w.received - w.window_received
        elapsed = now - w.window_start
        if got >= self.min_rate * elapsed:
            w.window_start, w.window_received = now, w.received
            return False
        w.reason = (f"{w.rpc} received {got} bytes in {elapsed:.1f} s while holding a reservation of {w.holding} "
                    f"bytes, less than --min-put-bytes-per-second ({self.min_rate}); cancelled, the reservation "
                    "released, nothing partial was stored")
        return True

    def stop(self) -> None:
        self._stop.set()
