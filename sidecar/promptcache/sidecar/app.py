"""One running sidecar: its parts built from the settings in dependency order, then served.

`Sidecar(settings)` checks the settings (Settings.validate holds every check), builds the memory tier, tenancy,
observer, the gRPC server (its port bound before the disk tier opens, so a second sidecar started on the same
address by mistake stops before it touches the data), the disk and cluster tiers, KV events, the cache engine
and its two transports (gRPC servicer, bulk channel), each given the parts it needs. The parts that follow the
memory tier's contents (tenancy, KV events, the disk tier, metrics) subscribe to its insert and remove hooks.

Start-up honours SIGTERM and SIGINT (Kubernetes sends SIGTERM at any time: a pod deleted while it starts). The
`promptcache serve` command installs a handler that only sets an event before anything heavy is imported; start-up
looks at it between its steps (and the disk tier while it waits for its lock or rebuilds its index), closes what it
had opened (the disk tier closed cleanly, the socket files it bound removed) and exits 0. A signal once serving has
begun (warm-up included) is the usual graceful stop.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import socket
import threading
import time
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter

from promptcache.contract import frames
from promptcache.sidecar import cgroup, logs, memfd, pinned, unixpath
from promptcache.sidecar.auth import Authenticator, TokenStore, server_credentials
from promptcache.sidecar.bulk import BulkServer
from promptcache.sidecar.config import Settings, settings_from_args
from promptcache.sidecar.disk import DiskTierCancelled, DiskTierError
from promptcache.sidecar.engine import CacheEngine
from promptcache.sidecar.tiers import TierStack
from promptcache.sidecar.tiers.cluster import ClusterLowerTier, HotListPublisher
from promptcache.sidecar.guard import Guard
from promptcache.sidecar.limits import CallLimiter, Watchdog, WorkerShare
from promptcache.sidecar.memfd import ChunkMemory
from promptcache.sidecar.metrics import Metrics
from promptcache.sidecar.netaddr import is_local_address
from promptcache.sidecar.observer import TrafficObserver
from promptcache.sidecar.policies import make_policy
from promptcache.sidecar.server import SERVICE_NAME, KVCacheServicer
from promptcache.sidecar.shmbuffers import SharedBuffers
from promptcache.sidecar.store import MemoryTier
from promptcache.sidecar.tenancy import Tenancy, TenantCollector
from promptcache.sidecar.warmup import Warmup, WarmupMetrics, save_resident

log = logging.getLogger("promptcache.sidecar")


class StartupCancelled(Exception):
    """A SIGTERM or SIGINT came during start-up: what was opened is closed again, and the command exits 0."""


class StartupSignals:
    """SIGTERM and SIGINT during start-up: the handler only records them (safe at any point, even inside an
    import); start-up asks `check()` between its steps. Installed by `promptcache serve` first thing (cli.main)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> "StartupSignals":
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name
        self.event.set()

    def check(self, step: str) -> None:
        if self.event.is_set():
            raise StartupCancelled(f"{self.signal_name or 'a stop'} during start-up ({step})")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available")
    return device


def chunk_memory(settings: Settings, device: torch.device) -> ChunkMemory | None:
    """Memfd-backed chunk memory when the bulk channel may lend chunks (--bulk-zero-copy), else None."""
    mode = settings.bulk_zero_copy
    if mode == "off" or not any(a.startswith("unix:") for a in settings.bulk_addresses):
        return None
    if mode == "auto" and settings.authenticated and settings.tenancy != "shared":
        log.info("bulk zero-copy is off: with isolated tenants a client could keep evicted chunks' memory "
                 "alive (--bulk-zero-copy on allows it)")
        return None
    why = ("the device tier is on " + device.type) if device.type != "cpu" else memfd.probe()
    limit = memfd.descriptor_budget() if not why else 0
    if not why and limit < 64:
        why = f"only {limit} chunks could have a descriptor (raise the open-files limit)"
    if why:
        if mode == "on":
            raise ValueError(f"--bulk-zero-copy on: {why}")
        log.info("bulk zero-copy is off: %s", why)
        return None
    log.info("bulk zero-copy is on", extra={"max_lendable_chunks": limit})
    return ChunkMemory(limit)


def traffic_observer(settings: Settings) -> TrafficObserver:
    from promptcache.sidecar.accesslog import AccessLog
    from promptcache.sidecar.mrc import MissRatioCurve, parse_sizes

    curve = access_log = None
    if settings.mrc_sample_rate > 0:
        curve = MissRatioCurve(parse_sizes(settings.mrc_sizes, settings.memory_bytes), settings.mrc_sample_rate,
                               settings.eviction_policy, settings.mrc_min_chunks)
    if settings.access_log_path:
        access_log = AccessLog(settings.access_log_path, settings.access_log_max_bytes, settings.access_log_files)
    return TrafficObserver(settings.chunk_tokens, curve, access_log, settings.access_log_sample_rate)


def cluster_name(settings: Settings) -> str:
    """The address other nodes reach this one's cluster segment at (the name its hot list's slot comes from)."""
    return settings.cluster_local_hostname or socket.gethostbyname(socket.gethostname())


def cluster_tier(settings: Settings, metrics: Metrics):
    from promptcache.sidecar.cluster import ClusterMetrics, ClusterTier, MooncakeStore

    hostname = cluster_name(settings)

    def connect() -> MooncakeStore:
        return MooncakeStore(settings.cluster_master, hostname, settings.cluster_protocol,
                             settings.cluster_segment_bytes, settings.cluster_buffer_bytes,
                             settings.cluster_metadata_server, settings.cluster_rdma_devices, settings.cluster_id)

    log.info("cluster tier on", extra={"master": settings.cluster_master, "local_hostname": hostname,
                                       "protocol": settings.cluster_protocol})
    return ClusterTier(connect, ClusterMetrics(metrics.registry), settings.cluster_timeout_seconds,
                       settings.cluster_retry_seconds, settings.cluster_publish_queue, settings.cluster_buffer_bytes)


def events_overhead(settings: Settings) -> int:
    """Bytes KV events keep per memory-tier chunk (its token ids), counted in --memory-bytes (0: events off)."""
    from promptcache.sidecar.kvevents import held_bytes_per_chunk

    return held_bytes_per_chunk(settings.chunk_tokens) if settings.kv_events_address else 0


def kv_events(settings: Settings, device: torch.device, metrics: Metrics):
    from promptcache.sidecar.kvevents import KVEvents

    sent = Counter("promptcache_kv_events", "KV events sent to routers, by type (BlockStored, BlockRemoved, "
                   "AllBlocksCleared; dropped: queue full; model_refused: a model over the cap of announced models, its "
                   "chunks not announced; subscriber_full: a subscriber fell behind and ZMQ drops its messages until "
                   "it reads again)", ["type"], registry=metrics.registry)
    try:
        return KVEvents(settings.kv_events_address, settings.kv_events_id or socket.gethostname(),
                        settings.chunk_tokens, "GPU" if device.type == "cuda" else "CPU", sent)
    except Exception as exc:  # noqa: BLE001 - zmq.ZMQError: the address is in use or not ours
        raise OSError(f"cannot listen on --kv-events-address {settings.kv_events_address}: {exc}") from None


def disk_tier(settings: Settings, tier: MemoryTier, metrics: Metrics, cancel: threading.Event | None = None):
    from promptcache.sidecar.disk import DiskTier  # rocksdict loads only when the disk tier is on
    from promptcache.sidecar.tiers.disk import DiskLowerTier

    disk = DiskTier(os.path.join(settings.data_dir, "rocksdb"), settings.disk_bytes,
                    ttl_seconds=settings.ttl_seconds, min_free_bytes=settings.disk_min_free_bytes,
                    lock_wait_seconds=settings.disk_lock_wait_seconds, cancel=cancel,
                    index_bytes=settings.disk_index_bytes or None)  # 0: derived from --disk-bytes
    log.info("disk tier open", extra={"path": disk.path, "disk_bytes": settings.disk_bytes, **disk.open_report})
    return DiskLowerTier(disk, tier.clock, metrics)


def grpc_server(settings: Settings, guard: Guard) -> tuple[grpc.Server, int]:
    """The gRPC server with its port bound (OSError naming the flag when it cannot be)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="grpc"),
                         interceptors=[guard], options=[("grpc.so_reuseport", 0)])
    if not settings.tls and not is_local_address(settings.grpc_address):
        log.warning("serving plaintext gRPC on a non-loopback address (--allow-insecure-remote): requests, "
                    "chunk bytes and bearer tokens cross the network unencrypted",
                    extra={"grpc": settings.grpc_address})
    path = unixpath.grpc_socket_path(settings.grpc_address)
    if path is not None:
        unixpath.claim(path, "--grpc-address")  # gRPC's core would unlink a live one and bind anew
    try:
        port = (server.add_secure_port(settings.grpc_address, server_credentials(
                    settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file,
                    settings.token_reload_seconds)) if settings.tls
                else server.add_insecure_port(settings.grpc_address))
    except RuntimeError:  # grpcio's "Failed to bind": the TLS files were checked above, so it is the address
        port = 0
    if port == 0:
        why = ("the socket is in use, or its folder is missing or not writable"
               if settings.grpc_address.startswith("unix:") else
               "the port is in use, or the host is not an address of this machine")
        raise OSError(f"cannot listen on --grpc-address {settings.grpc_address}: {why}")
    return server, port


class Sidecar:
    """One running sidecar: gRPC server, bulk channel, health, reflection, metrics endpoint, TTL sweeper."""

    def __init__(self, settings: Settings, signals: StartupSignals | None = None):
        self.signals = signals or StartupSignals()  # (not installed: nothing cancels an in-process start)
        self._grpc_socket: tuple[str, tuple[int, int] | None] | None = None
        self.spill = self.events = self.cluster = None
        self.bulk = []
        try:
            self._build(settings.validate())
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Close what a start-up that did not finish had opened (it raised, or a SIGTERM cancelled it)."""
        for close in (lambda: self.spill is not None and self.spill.disk.close(),
                      lambda: self.cluster is not None and self.cluster.close(),
                      lambda: self.events is not None and self.events.close(),
                      lambda: [b.stop() for b in self.bulk],
                      lambda: getattr(self, "server", None) is not None and self.server.stop(0).wait(),
                      lambda: getattr(self, "watchdog", None) is not None and self.watchdog.stop(),
                      lambda: getattr(self, "observer", None) is not None and self.observer.stop()):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - the rest is still closed; the first failure is the story
                log.warning("closing after a start-up that did not finish: %s", exc)
        if self._grpc_socket is not None:  # (a gRPC server that never started leaves its socket file)
            unixpath.release(*self._grpc_socket)

    def _build(self, settings: Settings) -> None:
        self.settings = settings
        check = self.signals.check
        # read and checked before anything is opened (a bad file: ValueError naming it, exit 2)
        pinned_prefixes = (pinned.load(settings.pinned_prefixes_file, settings.chunk_tokens,
                                       settings.max_request_tokens) if settings.pinned_prefixes_file else None)
        tokens = TokenStore(settings.token_file, settings.token_reload_seconds) if settings.token_file else None
        self.authenticator = Authenticator(tokens, mtls=bool(settings.tls_client_ca_file))
        self.device = resolve_device(settings.device)
        self.memory_limit = cgroup.memory_limit()
        cgroup.check_budget(settings.memory_bytes, self.device.type == "cpu", self.memory_limit)
        self.metrics = metrics = Metrics()
        self.tier = tier = MemoryTier(settings.memory_bytes, self.device,
                                      make_policy(settings.eviction_policy, capacity=settings.memory_bytes),
                                      settings.ttl_seconds, host_memory=chunk_memory(settings, self.device),
                                      max_lifetime_seconds=settings.max_lifetime_seconds,
                                      entry_overhead=events_overhead(settings) + settings.chunk_overhead_bytes,
                                      # the cluster tier publishes from a stored chunk's memory on its own thread
                                      recycle=not settings.cluster_master)
        self.tenancy = Tenancy.from_settings(settings, tier)
        tier.subscribe(self.tenancy)
        metrics.watch({"device": tier})
        metrics.registry.register(TenantCollector(self.tenancy))
        self.observer = traffic_observer(settings)
        metrics.registry.register(self.observer)
        cancelled = Counter("promptcache_calls_cancelled", "calls cancelled by the watchdog, by method and limit "
                            "(idle: --stream-idle-seconds, duration: --max-call-seconds, rate: "
                            "--min-put-bytes-per-second)", ["rpc", "limit"], registry=metrics.registry)
        self.watchdog = Watchdog(settings.max_call_seconds, settings.stream_idle_seconds,
                                 on_expire=lambda rpc, limit: cancelled.labels(rpc, limit).inc(),
                                 min_put_bytes_per_second=settings.min_put_bytes_per_second,
                                 put_rate_window_seconds=settings.put_rate_window_seconds)
        self.limiter = CallLimiter(settings.max_calls_per_client)  # gRPC and the bulk channel alike (calls.py)
        check("before binding the gRPC address")
        self.server, self.port = grpc_server(settings, Guard(self.authenticator, self.limiter,
                                                             self.watchdog, metrics, WorkerShare(settings.workers)))
        path = unixpath.grpc_socket_path(settings.grpc_address)
        if path is not None:
            self._grpc_socket = (path, unixpath.identity(path))
        check("after binding the gRPC address")
        self.events = kv_events(settings, self.device, metrics) if settings.kv_events_address else None
        if self.events is not None:
            tier.subscribe(self.events)
        # The tier stack: memory, then disk (capacity evictions are demoted to it), then the cluster.
        self.spill = disk_tier(settings, tier, metrics, self.signals.event) if settings.disk_bytes > 0 else None
        check("after opening the disk tier")
        self.cluster = cluster_tier(settings, metrics) if settings.cluster_master else None
        lowers = [t for t in (self.spill, self.cluster and ClusterLowerTier(self.cluster)) if t]
        self.stack = TierStack(tier, lowers, self.tenancy)  # subscribes to memory's evictions
        if self.spill is not None:
            metrics.watch({"disk": self.spill})
        tier.subscribe(metrics)
        buffers = (SharedBuffers(settings.shm_dir, settings.shm_max_buffers, settings.shm_max_bytes,
                                 settings.shm_idle_seconds) if settings.shm_dir else None)
        self.engine = CacheEngine(settings, tier, metrics, self.tenancy, self.observer, stack=self.stack,
                                  events=self.events, buffers=buffers, pinned_prefixes=pinned_prefixes)
        self.servicer = KVCacheServicer(self.engine, settings.frame_bytes)
        frames.add_service(self.servicer, self.server)
        self.health = health.HealthServicer()
        for name in ("", SERVICE_NAME):  # (grpc's servicer starts with "" SERVING): ready once warm-up allows
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.bulk = [BulkServer(address, self.engine, self.authenticator, metrics, settings.bulk_max_connections,
                                settings.stream_idle_seconds, settings.max_call_seconds,
                                lend=tier.host_memory is not None,
                                max_connections_per_peer=settings.bulk_max_connections_per_peer,
                                hello_seconds=settings.bulk_hello_seconds, watchdog=self.watchdog,
                                frame_bytes=settings.frame_bytes,
                                socket_mode=int(settings.bulk_socket_mode, 8) if settings.bulk_socket_mode else None,
                                limiter=self.limiter)
                     for address in settings.bulk_addresses]
        self.warmup = Warmup(self.stack, self.spill, WarmupMetrics(metrics.registry), settings.warmup_seconds,
                             settings.warmup_snapshot, cluster=self.cluster, max_chunk_bytes=settings.max_chunk_bytes)
        # what this node holds hottest, for the nodes that warm up from the cluster
        self.hot_lists = (HotListPublisher(self.cluster, tier, cluster_name(settings),
                                           settings.cluster_hot_list_seconds)
                          if self.cluster is not None and settings.cluster_hot_list_seconds > 0 else None)
        self._stop = threading.Event()
        self._stop_lock = threading.Lock()
        self.stop_error: str | None = None
        self._http = None
        self.metrics_port = None
        check("after building the sidecar")

    @property
    def bulk_address(self) -> str | None:
        """The first bulk-channel address (as listening: a TCP port 0 resolved), or None."""
        return self.bulk[0].address if self.bulk else None

    @property
    def bulk_addresses(self) -> list[str]:
        return [b.address for b in self.bulk]

    @property
    def address(self) -> str:
        a = self.settings.grpc_address
        return a if a.startswith("unix:") else f"{a.rsplit(':', 1)[0]}:{self.port}"

    def start(self) -> "Sidecar":
        """Start serving; OSError naming the flag when a listener cannot be opened, StartupCancelled when a SIGTERM
        came meanwhile (everything opened is closed either way)."""
        try:
            self.signals.check("before serving")
        except StartupCancelled:
            self._abandon()
            raise
        self.server.start()
        try:
            for b in self.bulk:
                self.signals.check("while opening the bulk channel")
                b.start()
            if self.settings.metrics_port is not None:
                try:
                    from promptcache.sidecar import metricsserver

                    self._http, _ = metricsserver.serve(self.settings.metrics_port, self.settings.metrics_host,
                                                        self.metrics.registry)
                except OSError as exc:
                    raise OSError(f"cannot listen on --metrics-host {self.settings.metrics_host} --metrics-port "
                                  f"{self.settings.metrics_port}: {exc.strerror or exc}") from None
                self.metrics_port = self._http.server_port
        except (OSError, StartupCancelled):
            self._abandon()  # (the cluster tier's connection and the observer too, which this path left open)
            raise
        if self.cluster is not None:
            self.cluster.start()
        if self.hot_lists is not None:
            self.hot_lists.start()
        if self.events is not None:
            self.events.start()
        self.warmup.start(self._ready)  # SERVING once warm-up has filled the memory tier, or its bound passed
        threading.Thread(target=self._sweep, name="ttl-sweeper", daemon=True).start()
        self.observer.start()
        return self

    def _ready(self) -> None:
        if not self._stop.is_set():  # (after a graceful shutdown began, the health service ignores set())
            for name in ("", SERVICE_NAME):
                self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("ready", extra={"warmup": self.warmup.report})

    def _sweep(self) -> None:
        interval = min(max(self.settings.ttl_seconds / 4, 0.05), 30.0)
        while not self._stop.wait(interval):
            self.tier.expire()
            if self.engine.buffers is not None:
                self.engine.buffers.reap()

    def stop(self, grace: float = 2.0) -> None:
        """Idempotent; a second caller waits until the first has finished (the disk flush included). When the
        disk tier could not be flushed and closed, `stop_error` says why (what it held may be lost)."""
        with self._stop_lock:
            if not self._stop.is_set():
                self._stop.set()
                self._shutdown(grace)

    def _shutdown(self, grace: float) -> None:
        self.warmup.stop()
        self.warmup.done.wait(10.0)  # it moves chunks between the tiers: let the one in hand finish
        self.watchdog.stop()
        self.health.enter_graceful_shutdown()
        for b in self.bulk:
            b.stop()
        self.server.stop(grace).wait()
        if self.engine.buffers is not None:
            self.engine.buffers.close_all()
        self.observer.stop()  # after the last call: the access log gets every line queued
        if self.hot_lists is not None:
            self.hot_lists.stop()
        if self.cluster is not None:
            self.cluster.close()
        if self.events is not None:
            self.events.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self.spill is not None:
            # A graceful stop (upgrade, rescheduling) keeps the cache: memory goes to disk for the next start.
            disk = self.spill.disk
            try:  # what memory holds, for the next start's warm-up to bring back first
                save_resident(disk.path, self.stack.memory, time.time())
            except (OSError, ValueError) as exc:  # (only an order for warm-up: never in the way of the demotion)
                log.warning("cannot write the resident list for the next warm-up: %s", exc)
            demoted = self.stack.demote_all()
            flushed = disk.flush()
            try:
                disk.close()
            except Exception as exc:  # noqa: BLE001 - RocksDB reports I/O errors as plain Exception
                self.stop_error = f"cannot close the disk tier {disk.path} (--data-dir): {exc}"
            else:
                if not flushed:
                    self.stop_error = f"the disk tier {disk.path} (--data-dir) did not finish its writes in time"
            if self.stop_error:
                log.error("%s; what it held may be lost", self.stop_error)
            else:
                log.info("disk tier closed", extra={"demoted_on_shutdown": demoted})

    def wait(self) -> None:
        self.server.wait_for_termination()


def serve_from_args(args, signals: StartupSignals | None = None) -> int:
    """`promptcache serve`. `signals`: the start-up handler cli.main installed before importing this module (one
    is installed here otherwise)."""
    signals = signals or StartupSignals().install()
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"promptcache serve: {exc}", file=sys.stderr, flush=True)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        signals.check("before opening anything")
        sidecar = Sidecar(settings, signals).start()
    except (StartupCancelled, DiskTierCancelled) as exc:
        why = exc if isinstance(exc, StartupCancelled) else f"{signals.signal_name} during start-up ({exc})"
        log.info("shutting down before serving: %s; what was opened is closed", why,
                 extra={"signal": signals.signal_name})
        return 0
    except (ValueError, OSError, DiskTierError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    log.info("promptcache sidecar serving", extra={
        "grpc": sidecar.address, "bulk": ",".join(sidecar.bulk_addresses),
        "metrics": f"http://{settings.metrics_host}:{sidecar.metrics_port}/metrics",
        "device": str(sidecar.device), "memory_bytes": settings.memory_bytes,
        "chunk_tokens": settings.chunk_tokens, "eviction_policy": settings.eviction_policy})

    def stop() -> None:
        try:
            sidecar.stop()
        except Exception as exc:  # noqa: BLE001 - a bug: say so, and exit non-zero
            log.exception("shutdown failed")
            sidecar.stop_error = sidecar.stop_error or f"shutdown failed: {exc}"
            sidecar.server.stop(0)  # so that wait() below returns

    def shutdown(signum, frame):
        log.info("shutting down", extra={"signal": signal.Signals(signum).name})
        threading.Thread(target=stop, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    if signals.event.is_set():  # it came between the last start-up check and the handler above
        shutdown(signal.Signals[signals.signal_name or "SIGTERM"], None)
    sidecar.wait()
    sidecar.stop()  # returns once the shutdown started by the signal has finished
    return 1 if sidecar.stop_error else 0
