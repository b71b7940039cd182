"""Prometheus metrics of one sidecar. A registry per server, so tests can run several in one process."""
from __future__ import annotations

import gc
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
AGE_BUCKETS = (1, 10, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400)
GC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _GcPauses:
    """How long the garbage collector stopped the process, per generation: one gc.callbacks hook per process (a
    full collection stops every thread; it scans every tracked object, 0.1 s per 100,000 chunks held, so on-call
    engineers see it next to the latency it adds). docs/operating.md, "Garbage collection pauses"."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started = 0.0
        self.buckets = [[0] * (len(GC_BUCKETS) + 1) for _ in range(3)]  # per generation, the last one +Inf
        self.sums = [0.0, 0.0, 0.0]
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds, generation = time.perf_counter() - self._started, min(2, info.get("generation", 2))
        i = next((i for i, le in enumerate(GC_BUCKETS) if seconds <= le), len(GC_BUCKETS))
        with self._lock:
            self.buckets[generation][i] += 1
            self.sums[generation] += seconds

    def collect(self):
        family = HistogramMetricFamily("promptcache_gc_pause_seconds", "how long each garbage collection stopped "
                                       "the sidecar (every thread), by generation (2: a full collection)",
                                       labels=["generation"])
        with self._lock:
            rows = [(list(b), total) for b, total in zip(self.buckets, self.sums)]
        for generation, (counts, total) in enumerate(rows):
            cumulative, running = [], 0
            for le, n in zip((*map(str, GC_BUCKETS), "+Inf"), counts):
                running += n
                cumulative.append((le, running))
            family.add_metric([str(generation)], cumulative, total)
        frozen = GaugeMetricFamily("promptcache_gc_frozen_objects", "objects kept out of the garbage collector's "
                                   "scans since start-up (gc.freeze after the imports: torch's, grpc's)")
        frozen.add_metric([], gc.get_freeze_count())
        return [family, frozen]


_GC_PAUSES: _GcPauses | None = None
_GC_LOCK = threading.Lock()


def _gc_pauses() -> _GcPauses:
    global _GC_PAUSES
    with _GC_LOCK:
        if _GC_PAUSES is None:
            _GC_PAUSES = _GcPauses()
        return _GC_PAUSES


class _Children:
    """A labelled metric whose labels() remembers its children: prometheus_client validates the values and
    takes a lock on every labels() call, and a Get asks for the same few children several times. Everything
    else goes to the metric itself."""

    __slots__ = ("metric", "_children")

    def __init__(self, metric):
        self.metric = metric
        self._children: dict[tuple, object] = {}

    def labels(self, *values):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def __getattr__(self, name):
        return getattr(self.metric, name)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("promptcache_requests", "gRPC calls finished, by method and status code",
                                ["rpc", "code"], registry=r)
        self.latency = Histogram("promptcache_request_duration_seconds", "gRPC call duration, by method",
                                 ["rpc"], buckets=LATENCY_BUCKETS, registry=r)
        self.lookups = Counter("promptcache_lookups", "prefix lookups (Lookup and Get calls)", ["rpc"], registry=r)
        self.hit_tokens = Counter("promptcache_hit_tokens", "prompt tokens found cached, by tier",
                                  ["rpc", "tier"], registry=r)
        self.missed_tokens = Counter("promptcache_missed_tokens", "prompt tokens not found cached",
                                     ["rpc"], registry=r)
        self.received_bytes = Counter("promptcache_received_bytes", "chunk bytes received by Put", registry=r)
        self.sent_bytes = Counter("promptcache_sent_bytes", "chunk bytes sent by Get, by tier", ["tier"],
                                  registry=r)
        self.lent_chunks = Counter("promptcache_bulk_lent_chunks", "chunks a bulk-channel Get lent to the client "
                                   "as sealed memfds instead of copying them (--bulk-zero-copy)", registry=r)
        self.stored_chunks = Counter("promptcache_stored_chunks", "chunks stored by Put", registry=r)
        self.evictions = Counter("promptcache_evictions", "entries removed, by tier and reason "
                                 "(capacity, ttl, purge, delete, checksum)", ["tier", "reason"], registry=r)
        self.evicted_bytes = Counter("promptcache_evicted_bytes", "bytes removed, by tier and reason",
                                     ["tier", "reason"], registry=r)
        self.eviction_age = Histogram("promptcache_eviction_entry_age_seconds",
                                      "age of entries when removed, by reason", ["reason"],
                                      buckets=AGE_BUCKETS, registry=r)
        self.checksum_failures = Counter("promptcache_checksum_failures",
                                         "chunks whose bytes failed verification (dropped, never served)",
                                         ["tier"], registry=r)
        self.admission_rejections = Counter("promptcache_admission_rejections",
                                            "Puts refused by the admission policy", ["tier"], registry=r)
        self.resizes = Counter("promptcache_resizes", "Resize calls applied", registry=r)
        self.demotions = Counter("promptcache_demotions", "chunks moved from memory to the disk tier", registry=r)
        self.demotion_failures = Counter("promptcache_demotion_failures",
                                         "capacity evictions the disk tier did not take (full, queue full, "
                                         "disk full): the chunk is dropped", registry=r)
        self.promotions = Counter("promptcache_promotions", "chunks moved from disk back into memory on a hit",
                                  registry=r)
        self.ttl_hints = Counter("promptcache_ttl_hints", "Puts that carried a retention hint (ttl_seconds), by "
                                 "whether it was capped at --max-ttl-hint-seconds", ["capped"], registry=r)
        self.pins = Counter("promptcache_pins", "chunks asked to be pinned (a Put's priority hint, a declared pinned "
                            "prefix, a pinned or declared chunk back from the disk or cluster tier; an already pinned "
                            "chunk asked again counts again), by result "
                            "(pinned, refused: over --max-pinned-fraction; unpinned: a pinned chunk over the "
                            "bounds of a smaller budget after a Resize)", ["result"], registry=r)
        for name, metric in list(vars(self).items()):
            if isinstance(metric, (Counter, Histogram)) and metric._labelnames:
                setattr(self, name, _Children(metric))
        r.register(_gc_pauses())  # (the process's collections: every registry shows the same)

    # The memory tier's hooks (promptcache.sidecar.store.StoreListener).
    def inserted(self, entry) -> None:
        pass

    def removed(self, entry, reason: str, age: float) -> None:
        self.evictions.labels("device", reason).inc()
        self.evicted_bytes.labels("device", reason).inc(entry.nbytes)
        self.eviction_age.labels(reason).observe(age)

    # Reads (promptcache.sidecar.store.ReadListener).
    def looked_up(self, rpc: str, owner: str, cached: int, total: int, by_tier: dict[str, int]) -> None:
        self.lookups.labels(rpc).inc()
        for tier, n in by_tier.items():
            if n:
                self.hit_tokens.labels(rpc, tier).inc(n)
        if total - cached:
            self.missed_tokens.labels(rpc).inc(total - cached)

    def served(self, owner: str, key: bytes, nbytes: int, tier: str) -> None:
        self.sent_bytes.labels(tier).inc(nbytes)

    def watch(self, tiers) -> None:
        """Report entries/bytes/budget of each tier at scrape time, read from the tiers themselves."""
        self.registry.register(_TierCollector(tiers))


class _TierCollector:
    def __init__(self, tiers):
        self.tiers = tiers  # {"device": MemoryTier, ...}

    def collect(self):
        entries = GaugeMetricFamily("promptcache_entries", "chunks held, by tier", labels=["tier"])
        used = GaugeMetricFamily("promptcache_stored_bytes", "bytes held by stored chunks, by tier",
                                 labels=["tier"])
        committed = GaugeMetricFamily("promptcache_committed_bytes", "bytes stored plus reserved by Puts in "
                                      "flight plus held by Gets of evicted chunks; never above the budget",
                                      labels=["tier"])
        budget = GaugeMetricFamily("promptcache_budget_bytes", "byte budget, by tier", labels=["tier"])
        pinned = GaugeMetricFamily("promptcache_pinned_bytes", "memory-tier bytes pinned by priority hints, by "
                                   "owner", labels=["owner"])
        full = GaugeMetricFamily("promptcache_disk_full", "1 while spilling is stopped because the data "
                                 "folder's filesystem is full (or failing writes)", labels=["tier"])
        queued = GaugeMetricFamily("promptcache_disk_write_queue_bytes", "bytes of demoted chunks waiting for the "
                                   "disk tier's writer (served from the queue meanwhile; dropped if the write fails)",
                                   labels=["tier"])
        for name, tier in self.tiers.items():
            u = tier.usage()
            entries.add_metric([name], u["entries"])
            used.add_metric([name], u["used"])
            committed.add_metric([name], u["used"] + u.get("reserved", 0) + u.get("draining", 0))
            budget.add_metric([name], u["budget"])
            if "disk_full" in u:
                full.add_metric([name], u["disk_full"])
            if "queued" in u:
                queued.add_metric([name], u["queued"])
            if hasattr(tier, "pinned_usage"):
                for owner, n in sorted(tier.pinned_usage().items()):
                    pinned.add_metric([owner], n)
        return [entries, used, committed, budget, full, queued, pinned]
