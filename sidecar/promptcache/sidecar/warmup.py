"""Warm-up: a new or restarted sidecar fills its memory tier before it reports itself ready (docs/warmup.md).

Sources, in this order, each until the memory tier has no room left without evicting:
* a snapshot file (--warmup-snapshot, written by `promptcache export`; promptcache.sidecar.snapshot), read and
  verified whole before anything of it is stored, its chunks in the order they were written (hottest first);
* its own disk tier: first what the memory tier held when the sidecar last stopped gracefully (the resident list
  it wrote then, RESIDENT_FILE: the eviction policy's own choice, which measured better than any order of the
  whole disk tier), then the other records hottest first (DiskTier.hottest: hit count, then last access, as
  recorded when the chunk left memory), not in key order. A chunk's ancestors are brought in before it (a
  prefix is only reachable from its root), so a hot deep chunk never sits in memory without its parents.
Warming moves a chunk (it leaves the disk tier, as a promotion does), charged to the owner recorded with it.
* the cluster tier: the hot lists its nodes publish (promptcache.sidecar.hotlist: each node's hottest chunks,
  ancestors first), merged rank by rank, each chunk fetched and verified as a cluster hit is (it stays in the
  cluster), charged to the owner the list names, with the hits the list gives it. Lists older than HOT_LIST_MAX_AGE are passed over (their node is
  likely gone, and its chunks with it). A list is a peer's word: an entry whose owner this sidecar does not know
  (Tenancy.knows: "", a configured group, a known tenant) is skipped, so no peer can charge a tenant for chunks it
  never stored or make up owners; a listed hit count is capped at PEER_MAX_HITS (it only orders eviction); and
  each chunk is checked as a Put's bytes are (cluster.verify: dtype, shape and size, finite values).

The gRPC health service says NOT_SERVING until warm-up ends or --warmup-seconds pass, whichever is first; then
SERVING (a bound, not a promise: what is not warm yet is still served from disk). Calls are answered meanwhile.
--warmup-seconds 0 (the default) turns warm-up from the disk and cluster tiers off; a --warmup-snapshot is then
loaded in the background without holding readiness back.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

from prometheus_client import Counter, Gauge

from promptcache.sidecar import hotlist

log = logging.getLogger("promptcache.sidecar.warmup")

RESIDENT_FILE = "promptcache.resident"  # in the disk tier's folder: memory's chunks at the last graceful stop
HOT_LIST_MAX_AGE = 3600.0  # seconds since a hot list was published, beyond which warm-up passes it over
HOT_LIST_MAX_BYTES = 8 << 20  # a slot's record larger than this is refused unread (hotlist.MAX_ENTRIES fit in 4 MiB)
PEER_MAX_HITS = 8  # a hot list's hit count is taken up to this: a peer cannot make its chunks the most protected
MAX_CLUSTER_MISSES_IN_A_ROW = 1024  # hot-listed chunks not found, in a row, after which warm-up stops asking the cluster


def save_resident(folder: str, memory, wall: float) -> int:
    """At a graceful stop, before memory goes down to the disk tier: write the keys of what memory holds (a hot list,
    promptcache.sidecar.hotlist: hottest first, each after its ancestors, at most hotlist.MAX_ENTRIES) to
    `folder`/RESIDENT_FILE, whole or not at all (written aside, then renamed). Returns the keys written."""
    entries = hotlist.hot_order(memory.snapshot())
    path = os.path.join(folder, RESIDENT_FILE)
    aside = path + ".writing"
    with open(aside, "wb") as f:
        f.write(hotlist.encode(entries, wall))
        f.flush()
        os.fsync(f.fileno())
    os.replace(aside, path)
    return len(entries)


def read_resident(folder: str) -> list[bytes]:
    """The keys save_resident wrote in `folder`. A missing, unreadable, foreign or corrupt file gives no keys
    (logged): the list only orders warm-up and exports, each chunk is still read from the disk tier and verified."""
    path = os.path.join(folder, RESIDENT_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(HOT_LIST_MAX_BYTES + 1)
        if len(raw) > HOT_LIST_MAX_BYTES:
            raise hotlist.HotListError(f"larger than {HOT_LIST_MAX_BYTES} bytes")
        _, entries = hotlist.decode(raw)
    except FileNotFoundError:
        return []
    except (OSError, hotlist.HotListError) as exc:
        log.warning("%s is not a resident list we can read (%s); the hottest chunks go first instead", path, exc)
        return []
    return [e.key for e in entries]


def take_resident(folder: str) -> list[bytes]:
    """read_resident, and the file removed: it describes one stop, and a later start must not read it again (the
    run in between changed what is hot)."""
    try:
        return read_resident(folder)
    finally:
        for name in (RESIDENT_FILE, RESIDENT_FILE + ".writing"):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


class WarmupMetrics:
    def __init__(self, registry):
        self.chunks = Counter("promptcache_warmup_chunks", "chunks warm-up brought into the memory tier, by "
                              "source (disk, snapshot, cluster)", ["source"], registry=registry)
        self.bytes = Counter("promptcache_warmup_bytes", "bytes warm-up brought into the memory tier, by source",
                             ["source"], registry=registry)
        self.seconds = Gauge("promptcache_warmup_duration_seconds", "how long warm-up ran (so far, while it runs)",
                             registry=registry)
        self.running = Gauge("promptcache_warmup_in_progress", "1 while warm-up runs (the health service says "
                             "NOT_SERVING until it ends or --warmup-seconds pass)", registry=registry)
        self.bounded = Counter("promptcache_warmup_bound_reached", "warm-ups that --warmup-seconds cut short "
                               "(ready before the memory tier was filled)", registry=registry)


class Warmup:
    """Run once at start (start()); `ready` is set when it ends or its bound passes."""

    def __init__(self, stack, spill, metrics: WarmupMetrics, seconds: float, snapshot_path: str = "",
                 clock=time.monotonic, cluster=None, wall_clock=time.time, max_chunk_bytes: int | None = None):
        self.stack = stack  # promptcache.sidecar.tiers.TierStack: what is warmed is promoted by it
        self.tier = stack.memory
        self.spill = spill  # the stack's disk tier (tiers.disk.DiskLowerTier), or None
        self.cluster = cluster  # the cluster tier (cluster.ClusterTier), or None
        self.wall_clock = wall_clock  # hot lists carry Unix times
        self.metrics = metrics
        self.seconds = seconds
        self.snapshot_path = snapshot_path
        self.max_chunk_bytes = max_chunk_bytes  # a snapshot's records are bounded by it (--max-chunk-bytes)
        self.clock = clock
        self.ready = threading.Event()
        self.done = threading.Event()
        self.report: dict = {"disk_chunks": 0, "disk_bytes": 0, "snapshot_chunks": 0, "snapshot_bytes": 0,
                             "cluster_chunks": 0, "cluster_bytes": 0, "seconds": 0.0, "bound_reached": False,
                             "error": ""}
        self._stop = threading.Event()
        self._started = 0.0

    @property
    def needed(self) -> bool:
        return (self.seconds > 0 and (self.spill is not None or self.cluster is not None)) or bool(self.snapshot_path)

    def start(self, on_ready) -> None:
        """Warm in a thread; call on_ready() once, when warm-up ends or the bound passes."""
        self._started = self.clock()
        if self.spill is not None and not self.seconds > 0:
            take_resident(self.spill.disk.path)  # it describes the last stop only: not for a later start
        if not self.needed:
            self.ready.set()
            self.done.set()
            on_ready()
            return
        self.metrics.running.set(1)

        def ready_once():
            if not self.ready.is_set():
                self.ready.set()
                on_ready()

        def bound():
            if not self.done.wait(self.seconds) and self.seconds > 0:
                self.report["bound_reached"] = True
                self.metrics.bounded.inc()
                log.warning("warm-up still running after %g s (--warmup-seconds): ready anyway, it goes on "
                            "in the background", self.seconds, extra=self._progress())
                ready_once()

        def run():
            try:
                self._run()
            except Exception as exc:  # noqa: BLE001 - warm-up is an optimisation: never keep the node unready
                self.report["error"] = str(exc)
                log.exception("warm-up failed; serving without it")
            finally:
                self.report["seconds"] = round(self.clock() - self._started, 3)
                self.metrics.seconds.set(self.report["seconds"])
                self.metrics.running.set(0)
                self.done.set()
                log.info("warm-up finished", extra=self._progress())
                ready_once()

        threading.Thread(target=bound, name="warmup-bound", daemon=True).start()
        threading.Thread(target=run, name="warmup", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _progress(self) -> dict:
        return {k: v for k, v in self.report.items() if k != "error" or v}

    def _tick(self) -> None:
        self.metrics.seconds.set(self.clock() - self._started)

    def _run(self) -> None:
        if self.snapshot_path:
            self._from_snapshot()
        if self.spill is not None and self.seconds > 0:
            self._from_disk()
        if self.cluster is not None and self.seconds > 0:
            self._from_cluster()

    def _count(self, source: str, nbytes: int) -> None:
        self.report[f"{source}_chunks"] += 1
        self.report[f"{source}_bytes"] += nbytes
        self.metrics.chunks.labels(source).inc()
        self.metrics.bytes.labels(source).inc(nbytes)

    def _from_snapshot(self) -> None:
        from promptcache.sidecar.snapshot import SnapshotError, as_record, read_snapshot

        try:
            # verified whole before anything is stored
            records = read_snapshot(self.snapshot_path, *([self.max_chunk_bytes] if self.max_chunk_bytes else []))
        except SnapshotError as exc:
            self.report["error"] = str(exc)
            log.error("warm-up: %s; nothing of it was stored", exc)
            return
        for rec in records:
            if self._stop.is_set() or self.tier.room() <= 0:
                break
            record = as_record(rec)
            n = self.stack.promote(record, rec.owner, serve=False) if record is not None else 0
            if n:
                self._count("snapshot", n)
            self._tick()

    def _from_disk(self) -> None:
        from promptcache.sidecar.snapshot import hottest_chains

        # what memory held at the last graceful stop, then the hottest; each chunk's ancestors before it (they are
        # at least as hot: every request for it asked for them)
        for key in hottest_chains(self.spill.disk, take_resident(self.spill.disk.path)):
            if self._stop.is_set() or self.tier.room() <= 0:
                break
            n = self.stack.warm(self.spill, key)
            if n:
                self._count("disk", n)
            self._tick()

    def _from_cluster(self) -> None:
        # the join runs on its own thread from start: wait for it within what is left of the bound
        if not self.cluster.wait_joined(max(0.0, self.seconds - (self.clock() - self._started))):
            log.warning("warm-up: the cluster tier was not joined in time; not warming from it")
            return
        now = self.wall_clock()
        lists = [entries for published, entries in self.cluster.hot_lists(HOT_LIST_MAX_BYTES)
                 if now - published <= HOT_LIST_MAX_AGE]
        tenancy = self.stack.tenancy
        source = self.stack.lower("cluster")
        skipped: set[str] = set()
        misses = 0  # fetches in a row that found nothing to warm: lists of chunks gone (or forged) are not walked to the end
        for entry in hotlist.merge(lists):
            if self._stop.is_set() or self.tier.room() <= 0:
                break
            if misses >= MAX_CLUSTER_MISSES_IN_A_ROW:
                log.warning("warm-up: %d hot-listed chunks in a row were not in the cluster tier; not warming from it "
                            "further", misses)
                break
            if tenancy is not None and not tenancy.knows(entry.owner) or tenancy is None and entry.owner:
                if len(skipped) < 8 and entry.owner not in skipped:
                    skipped.add(entry.owner)
                    log.warning("warm-up: a hot list names an owner this sidecar does not know; its chunks are "
                                "not warmed", extra={"owner": entry.owner[:64]})
                continue
            if self.tier.holds(entry.key, entry.fingerprint):
                continue
            # verified: fingerprint, expiry, checksum, and as a Put's bytes (against its own header: no request
            # names the model here, unless this node already knows it)
            record = self.cluster.fetch(entry.key, entry.fingerprint, counted=False,
                                        layout=self.stack.layout_of(entry.fingerprint))
            if record is None:
                misses += 1
                continue
            misses = 0
            # the hits it had on the node that listed it, capped: where its eviction policy's estimate starts here
            record = dataclasses.replace(record, hits=max(record.hits, min(entry.hits, PEER_MAX_HITS)))
            n = self.stack.promote(record, entry.owner, source=source, serve=False)
            if n:
                self._count("cluster", n)
            elif not self.tier.room_for(record.nbytes):
                break  # the rest of memory is smaller than a chunk
            self._tick()
