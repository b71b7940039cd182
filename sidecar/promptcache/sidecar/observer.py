"""Feeds the miss-ratio curve (promptcache.sidecar.mrc) and the access log (promptcache.sidecar.accesslog) from the
request path without slowing it: a request thread only decides whether the request is sampled (two comparisons on
bytes of its root key) and, if so, puts a tuple on a bounded queue; one background thread does the simulating,
hashing and writing. A full queue drops the event and counts it (promptcache_observer_dropped_total): the estimate
loses a sample, the request loses nothing.
"""
from __future__ import annotations

from collections.abc import Iterable

import logging
import queue
import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from promptcache.contract.layout import chunk_nbytes
from promptcache.sidecar.accesslog import AccessLog, log_sampled
from promptcache.sidecar.mrc import MissRatioCurve, sampled

log = logging.getLogger("promptcache.sidecar")

QUEUE_EVENTS = 4096
# Chunk keys the queued events hold together (each a 32-byte key, about 73 bytes with its object and the list's
# pointer: 256Ki keys are about 19 MiB). The events alone do not bound it: a sampled Lookup of --max-request-tokens
# (1Mi) tokens carries 4,096 keys at 256 tokens a chunk, and 4,096 such events would hold 1.2 GiB while the observer
# falls behind (+419 MiB in a minute of four clients' Lookups). 4,096 everyday prompts (tens of chunks) fit in it.
QUEUE_KEYS = 1 << 18
_LOOKUP, _STORE = 0, 1


class TrafficObserver:
    def __init__(self, chunk_tokens: int, curve: MissRatioCurve | None = None, access_log: AccessLog | None = None,
                 log_rate: float = 1.0, queue_events: int = QUEUE_EVENTS, queue_keys: int = QUEUE_KEYS) -> None:
        self.chunk_tokens = chunk_tokens
        self.curve = curve
        self.access_log = access_log
        self.log_rate = log_rate
        self.dropped = 0
        self.failures = 0
        self.busy_seconds = 0.0   # time the worker spent on events (the curve's and the log's cost)
        self.cpu_seconds = 0.0    # the same in CPU time of its thread (promptcache_observer_cpu_seconds_total)
        self.events = 0
        self._queue: queue.Queue = queue.Queue(queue_events)
        self.queue_keys = queue_keys
        self._queued_keys = 0           # keys held by the events in the queue (QUEUE_KEYS)
        self._keys_lock = threading.Lock()
        self._lock = threading.Lock()   # the worker's state against scrapes
        self._nbytes: dict = {}
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.curve is not None or self.access_log is not None

    # --- request path -----------------------------------------------------------------------------------------
    def _room(self, n: int) -> bool:
        """Whether an event of `n` keys may be queued (asked before its keys are hashed: a dropped prompt costs no
        hash of its chunks). One event is always let in when none is queued, so every size gets sampled."""
        return self._queued_keys == 0 or self._queued_keys + n <= self.queue_keys

    def _offer(self, event: tuple) -> None:
        n = len(event[2])
        with self._keys_lock:
            if not self._room(n):
                self.dropped += 1
                return
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self.dropped += 1
                return
            self._queued_keys += n

    def lookup(self, spec, keys: Iterable[bytes], prompt_tokens: int) -> None:
        """A Lookup or Get of a whole prompt (from chunk 0): `keys` are its whole chunks' keys, possibly hashed
        lazily: only the root is taken unless the prompt is sampled (the request path stops hashing at its first
        miss, and an unsampled prompt must not cost a hash of every chunk)."""
        it = iter(keys)
        root = next(it, None)
        if root is None:
            return
        to_curve = self.curve is not None and sampled(root, self.curve.max_rate(self._chunk_bytes(spec)))
        to_log = self.access_log is not None and log_sampled(root, self.log_rate)
        if to_curve or to_log:
            if not self._room(max(1, prompt_tokens // self.chunk_tokens)):
                self.dropped += 1  # (the queue's keys are full: the rest of the prompt is not hashed for nothing)
                return
            self._offer((_LOOKUP, spec, [root, *it], prompt_tokens, time.time(), to_curve, to_log))

    def stored(self, spec, keys: list[bytes]) -> None:
        """A Put that carried chunks up to len(keys) - 1 (`keys`: the prompt's first chunks, from chunk 0)."""
        if keys and self.curve is not None and sampled(keys[0], self.curve.max_rate(self._chunk_bytes(spec))):
            self._offer((_STORE, spec, keys, 0, 0.0, True, False))

    # --- worker -----------------------------------------------------------------------------------------------
    def start(self) -> "TrafficObserver":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="traffic-observer", daemon=True)
            self._thread.start()
        return self

    def _chunk_bytes(self, spec) -> int:
        n = self._nbytes.get(spec)   # request threads and the worker: a dict's get and set are atomic
        if n is None:
            if len(self._nbytes) >= 1024:
                self._nbytes.clear()
            n = self._nbytes[spec] = chunk_nbytes(spec, self.chunk_tokens)
        return n

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    return
                start, cpu = time.perf_counter(), time.thread_time()
                with self._lock:
                    self._handle(event)
                    self.busy_seconds += time.perf_counter() - start
                    self.cpu_seconds += time.thread_time() - cpu
                    self.events += 1
            except Exception:  # noqa: BLE001 - an estimate must never take the sidecar down
                self.failures += 1
                if self.failures <= 3:
                    log.exception("traffic observer: event failed")
            finally:
                if event is not None:
                    with self._keys_lock:
                        self._queued_keys -= len(event[2])
                self._queue.task_done()

    def _handle(self, event: tuple) -> None:
        kind, spec, keys, prompt_tokens, when, to_curve, to_log = event
        if kind == _LOOKUP:
            if to_curve:
                self.curve.lookup(keys, self.chunk_tokens, prompt_tokens, self._chunk_bytes(spec))
            if to_log:
                self.access_log.record(keys, prompt_tokens, self.chunk_tokens, int(when * 1000))
        else:
            self.curve.store(keys, self._chunk_bytes(spec))

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event has been handled (True), or `timeout` seconds (False)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Handle what is queued if there is an access log (its last lines; the curve's events can go), then end
        the worker."""
        if self._thread is not None:
            if self.access_log is not None:
                self.wait_idle(timeout)
            try:
                self._queue.put(None, timeout=1.0)
            except queue.Full:
                pass
            self._thread.join(timeout)
            self._thread = None
        if self.access_log is not None:
            with self._lock:
                self.access_log.close()

    # --- metrics ----------------------------------------------------------------------------------------------
    def collect(self):
        """Prometheus collector: the curve's counters and gauges, the observer's and the log's counters."""
        out = []
        dropped = CounterMetricFamily("promptcache_observer_dropped", "sampled requests the miss-ratio curve and "
                                      "the access log did not see because the observer's queue was full")
        dropped.add_metric([], self.dropped)
        cpu = CounterMetricFamily("promptcache_observer_cpu_seconds", "CPU time the observer's thread spent "
                                  "simulating the miss-ratio curve's miniatures and writing the access log (off the "
                                  "request path, on the sidecar's CPU: compare with process_cpu_seconds_total)")
        cpu.add_metric([], self.cpu_seconds)
        out += [dropped, cpu]
        with self._lock:
            if self.curve is not None:
                points = self.curve.points()
                hits = CounterMetricFamily("promptcache_mrc_hit_tokens", "sampled prompt tokens a cache of "
                                           "capacity_bytes would have served (miniature simulation of the eviction "
                                           "policy)", labels=["capacity_bytes"])
                ratio = GaugeMetricFamily("promptcache_mrc_hit_ratio", "estimated token hit ratio of a cache of "
                                          "capacity_bytes, since start", labels=["capacity_bytes"])
                for p in points:
                    hits.add_metric([str(p.capacity_bytes)], p.hit_tokens)
                    if p.hit_ratio is not None:
                        ratio.add_metric([str(p.capacity_bytes)], p.hit_ratio)
                lookups = CounterMetricFamily("promptcache_mrc_lookup_tokens", "sampled prompt tokens looked up "
                                              "(the denominator of promptcache_mrc_hit_tokens_total)",
                                              labels=["capacity_bytes"])
                rate = GaugeMetricFamily("promptcache_mrc_sample_rate", "fraction of chain roots simulated for "
                                         "capacity_bytes (--mrc-sample-rate, raised by --mrc-min-chunks)",
                                         labels=["capacity_bytes"])
                for p in points:
                    lookups.add_metric([str(p.capacity_bytes)], p.lookup_tokens)
                    rate.add_metric([str(p.capacity_bytes)], p.rate)
                entries = GaugeMetricFamily("promptcache_mrc_entries", "chunks held by all miniature caches "
                                            "together (the curve's state grows with it)")
                entries.add_metric([], self.curve.entries())
                out += [hits, ratio, lookups, rate, entries]
            if self.access_log is not None:
                records = CounterMetricFamily("promptcache_access_log_records", "requests written to the access "
                                              "log (--access-log-path)")
                records.add_metric([], self.access_log.records)
                rotations = CounterMetricFamily("promptcache_access_log_rotations", "access log files rotated")
                rotations.add_metric([], self.access_log.rotations)
                out += [records, rotations]
        return out
