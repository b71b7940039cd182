"""Sidecar settings: every one is a flag and an environment variable (PROMPTCACHE_<FLAG>), flag winning."""
from __future__ import annotations

import argparse
import errno
import math
import os
import re
import stat
from dataclasses import dataclass, fields
from typing import Literal, get_args, get_origin, get_type_hints

DESCRIPTION = """\
Run the PromptCache sidecar: a node-local gRPC server (promptcache.v1.KVCache) that stores the attention
key/value tensors of prompt prefixes so inference pods load them instead of recomputing them.

Every flag can also be set by an environment variable: --memory-bytes is PROMPTCACHE_MEMORY_BYTES, and so on.
Byte sizes accept Kubernetes quantities: 512Mi, 4Gi, 1G, or plain integers.
"""

from promptcache.contract.addresses import host_port_error, listen_address_error, zmq_endpoint_error  # noqa: E402
from promptcache.contract.quantity import MAX_INT64, parse_bytes  # noqa: E402,F401 - byte flags are Kubernetes quantities

# The settings that take one of a few words: the words are written once, here (validate() and docs/configuration.md
# read them through typing.get_args).
Quantization = Literal["any", "none", "k8v8", "k8v4", "k6v4z"]  # any, or one of promptcache.contract.keys.QUANT_MODES
TenancyMode = Literal["auto", "isolated", "shared"]
BulkZeroCopy = Literal["auto", "on", "off"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["json", "text"]
ClusterProtocol = Literal["tcp", "rdma"]


def one_of(choices) -> str:
    """'a, b or c' from a Literal (or a tuple of words)."""
    words = get_args(choices) or tuple(choices)
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


MAX_SECONDS = 1e9  # every --*-seconds setting: below threading.TIMEOUT_MAX and time_t in socket timeouts


@dataclass(frozen=True)
class Settings:
    grpc_address: str = "127.0.0.1:50051"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9400
    memory_bytes: int = 1 << 30
    max_chunk_bytes: int = 256 << 20
    chunk_overhead_bytes: int = 8 << 10
    chunk_tokens: int = 256
    ttl_seconds: float = 4 * 3600.0
    max_lifetime_seconds: float = 24 * 3600.0
    max_ttl_hint_seconds: float = 24 * 3600.0
    max_pinned_fraction: float = 0.1
    pinned_prefixes_file: str = ""
    eviction_policy: str = "rate-hazard"  # chosen by trace replay: docs/eviction.md
    quantization: Quantization = "any"
    tenancy: TenancyMode = "auto"
    device: str = "auto"
    data_dir: str = "./promptcache-data"
    disk_bytes: int = 0
    disk_index_bytes: int = 0  # 0: --disk-bytes / 64, at least 64Mi (promptcache.sidecar.disk.default_index_bytes)
    disk_min_free_bytes: int = 256 << 20
    disk_lock_wait_seconds: float = 30.0
    warmup_seconds: float = 0.0
    warmup_snapshot: str = ""
    shm_dir: str = ""
    shm_max_buffers: int = 256
    shm_max_bytes: int = 16 << 30
    shm_idle_seconds: float = 300.0
    bulk_address: str = ""
    bulk_max_connections: int = 64
    bulk_max_connections_per_peer: int = 16
    bulk_hello_seconds: float = 5.0
    bulk_zero_copy: BulkZeroCopy = "auto"
    bulk_socket_mode: str = ""
    workers: int = 32
    frame_bytes: int = 1 << 20
    log_level: LogLevel = "info"
    log_format: LogFormat = "json"
    allow_insecure_remote: bool = False
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    token_file: str = ""
    token_reload_seconds: float = 1.0
    tenant_secret_file: str = ""
    sharing_groups: str = ""
    admin_tenants: str = ""
    tenant_quota_bytes: int = 0
    tenant_quotas: str = ""
    max_calls_per_client: int = 0
    stream_idle_seconds: float = 30.0
    max_call_seconds: float = 600.0
    min_put_bytes_per_second: int = 1 << 20
    put_rate_window_seconds: float = 10.0
    max_put_reserved_fraction: float = 0.5
    max_request_tokens: int = 1 << 20
    max_large_requests: int = 4
    mrc_sample_rate: float = 1 / 64
    mrc_sizes: str = ""
    mrc_min_chunks: int = 32
    access_log_path: str = ""
    access_log_sample_rate: float = 1.0
    access_log_max_bytes: int = 64 << 20
    access_log_files: int = 4
    cluster_master: str = ""
    cluster_id: str = "mooncake_cluster"
    cluster_local_hostname: str = ""
    cluster_protocol: ClusterProtocol = "tcp"
    cluster_rdma_devices: str = ""
    cluster_metadata_server: str = "P2PHANDSHAKE"
    cluster_segment_bytes: int = 1 << 30
    cluster_buffer_bytes: int = 64 << 20
    cluster_timeout_seconds: float = 0.25
    cluster_retry_seconds: float = 10.0
    cluster_publish_queue: int = 1024
    cluster_hot_list_seconds: float = 60.0
    kv_events_address: str = ""
    kv_events_id: str = ""

    @property
    def bulk_addresses(self) -> list[str]:
        """--bulk-address split at commas: the channel may listen on a unix socket and TCP at once."""
        return [a.strip() for a in self.bulk_address.split(",")] if self.bulk_address else []

    def validate(self) -> "Settings":
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", float) and not math.isfinite(value):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
            if f.name.endswith("_seconds") and isinstance(value, (int, float)) and abs(value) > MAX_SECONDS:
                # (beyond what socket timeouts and waits take: 1e10 failed every bulk connection at run time)
                raise ValueError(f"--{f.name.replace('_', '-')} {value:g} is more than {MAX_SECONDS:g} seconds "
                                 "(about 31 years)")
            if f.type in ("int", int) and isinstance(value, int) and not -MAX_QUANTITY - 1 <= value <= MAX_QUANTITY:
                raise ValueError(f"--{f.name.replace('_', '-')} {value} is more than this process can hold: at most "
                                 f"{MAX_QUANTITY} (2^63-1; 8Ei - 1)")
        if self.memory_bytes <= 0:
            raise ValueError("--memory-bytes must be positive")
        if not 0 <= self.chunk_overhead_bytes <= 1 << 20:
            raise ValueError(f"--chunk-overhead-bytes must be in 0..1Mi, got {self.chunk_overhead_bytes}")
        if self.max_chunk_bytes <= 0:
            raise ValueError("--max-chunk-bytes must be positive")
        if self.chunk_tokens <= 0 or self.chunk_tokens & (self.chunk_tokens - 1):
            raise ValueError(f"--chunk-tokens must be a positive power of two, got {self.chunk_tokens}")
        if self.ttl_seconds <= 0:
            raise ValueError("--ttl-seconds must be positive")
        if not self.max_lifetime_seconds > 0:
            raise ValueError(f"--max-lifetime-seconds must be positive, got {self.max_lifetime_seconds}")
        if self.disk_index_bytes < 0 or 0 < self.disk_index_bytes < 1 << 20:  # (0: the bound derived from --disk-bytes)
            raise ValueError(f"--disk-index-bytes must be 0 (--disk-bytes / 64, at least 64Mi) or at least 1Mi (less "
                             f"holds a few hundred records and refuses every other demotion), got {self.disk_index_bytes}")
        from promptcache.sidecar.kvevents import POD_NAME  # (a part of the topic kv@ID@MODEL, as a pod's name is)

        if self.kv_events_id and not POD_NAME.fullmatch(self.kv_events_id):
            raise ValueError(f"--kv-events-id {self.kv_events_id[:128]!r} must be letters, digits, '.', '_' and '-', at "
                             "most 253 (no '@': it separates the parts of the topic kv@ID@MODEL)")
        if self.disk_lock_wait_seconds < 0:
            raise ValueError("--disk-lock-wait-seconds must not be negative")
        if not 0 <= self.max_pinned_fraction <= 0.5:
            raise ValueError(f"--max-pinned-fraction must be in 0..0.5, got {self.max_pinned_fraction}")
        if not self.max_ttl_hint_seconds > 0:
            raise ValueError(f"--max-ttl-hint-seconds must be positive, got {self.max_ttl_hint_seconds}")
        if self.warmup_seconds < 0:
            raise ValueError("--warmup-seconds must not be negative")
        for flag, path in (("--pinned-prefixes-file", self.pinned_prefixes_file),
                           ("--warmup-snapshot", self.warmup_snapshot)):
            problem = file_problem(path) if path else ""
            if problem:
                raise ValueError(f"{flag} {path}: {problem}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.bulk_address:
            from promptcache.contract.bulkwire import parse_address

            for address in self.bulk_addresses:
                try:
                    parse_address(address)
                except ValueError as exc:
                    raise ValueError(f"--bulk-address: {exc}") from None
            if len(set(self.bulk_addresses)) != len(self.bulk_addresses):
                raise ValueError(f"--bulk-address names an address twice: {self.bulk_address}")
        if self.shm_max_buffers < 1 or self.shm_max_bytes < 1:
            raise ValueError("--shm-max-buffers and --shm-max-bytes must be positive")
        if self.shm_idle_seconds <= 0:
            raise ValueError("--shm-idle-seconds must be positive")
        if self.shm_dir and not os.path.isdir(self.shm_dir):
            raise ValueError(f"--shm-dir {self.shm_dir} is not an existing folder (create it, on a shared-memory "
                             "filesystem such as /dev/shm, or leave --shm-dir empty)")
        if self.bulk_max_connections < 1:
            raise ValueError("--bulk-max-connections must be at least 1")
        if self.bulk_max_connections_per_peer < 1:
            raise ValueError("--bulk-max-connections-per-peer must be at least 1")
        if self.bulk_hello_seconds <= 0:
            raise ValueError("--bulk-hello-seconds must be positive")
        if self.put_rate_window_seconds <= 0:
            raise ValueError("--put-rate-window-seconds must be positive")
        if not 0 < self.max_put_reserved_fraction <= 1:
            raise ValueError(f"--max-put-reserved-fraction must be in (0, 1], got {self.max_put_reserved_fraction}")
        if not 1 <= self.max_request_tokens <= 1 << 22:
            raise ValueError(f"--max-request-tokens must be in 1..{1 << 22}, got {self.max_request_tokens}")
        if self.max_large_requests < 1:
            raise ValueError("--max-large-requests must be at least 1")
        if self.bulk_socket_mode:
            if not re.fullmatch(r"0?[0-7]{3}", self.bulk_socket_mode):
                raise ValueError(f"--bulk-socket-mode must be octal permission bits such as 0660, got "
                                 f"{self.bulk_socket_mode!r}")
            if not any(a.startswith("unix:") for a in self.bulk_addresses):
                raise ValueError("--bulk-socket-mode needs a unix-socket --bulk-address (unix:/PATH)")
        if self.bulk_zero_copy not in get_args(BulkZeroCopy):
            raise ValueError(f"--bulk-zero-copy must be {one_of(BulkZeroCopy)}, got {self.bulk_zero_copy!r}")
        if self.workers < 1:
            raise ValueError("--workers must be at least 1")
        if not 4096 <= self.frame_bytes <= (3 << 20):
            raise ValueError("--frame-bytes must be between 4096 and 3Mi (gRPC's default message limit is 4 MiB)")
        if self.log_level not in get_args(LogLevel):
            raise ValueError(f"--log-level must be {one_of(LogLevel)}, got {self.log_level!r}")
        if self.log_format not in get_args(LogFormat):
            raise ValueError(f"--log-format must be {one_of(LogFormat)}, got {self.log_format!r}")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not self.grpc_address:
            raise ValueError("--grpc-address is empty")
        problem = listen_address_error(self.grpc_address)
        if problem:
            raise ValueError(f"--grpc-address {self.grpc_address!r}: {problem}")
        if self.token_reload_seconds < 0:
            raise ValueError("--token-reload-seconds must not be negative")
        if self.max_calls_per_client < 0:
            raise ValueError("--max-calls-per-client must not be negative (0: no limit)")
        if self.stream_idle_seconds < 0 or self.max_call_seconds < 0:
            raise ValueError("--stream-idle-seconds and --max-call-seconds must not be negative (0: no limit)")
        if self.quantization not in get_args(Quantization):
            raise ValueError(f"--quantization must be {one_of(Quantization)}, got {self.quantization!r}")
        if self.tenancy not in get_args(TenancyMode):
            raise ValueError(f"--tenancy must be {one_of(TenancyMode)}, got {self.tenancy!r}")
        if not 0 <= self.mrc_sample_rate <= 1:
            raise ValueError(f"--mrc-sample-rate must be within 0..1 (0: no miss-ratio curve), "
                             f"got {self.mrc_sample_rate}")
        from promptcache.sidecar.mrc import parse_sizes

        try:
            parse_sizes(self.mrc_sizes, self.memory_bytes)
        except ValueError as exc:
            raise ValueError(f"--mrc-sizes {self.mrc_sizes!r}: {exc}") from None
        if self.mrc_min_chunks < 0:
            raise ValueError("--mrc-min-chunks must not be negative")
        if not 0 < self.access_log_sample_rate <= 1:
            raise ValueError(f"--access-log-sample-rate must be within (0, 1], got {self.access_log_sample_rate}")
        if self.access_log_max_bytes < 4096:
            raise ValueError("--access-log-max-bytes must be at least 4096")
        if self.access_log_files < 1:
            raise ValueError("--access-log-files must be at least 1")
        if self.cluster_protocol not in get_args(ClusterProtocol):
            raise ValueError(f"--cluster-protocol must be {one_of(ClusterProtocol)}, got {self.cluster_protocol!r}")
        if self.cluster_master and (why := cluster_master_error(self.cluster_master)):
            raise ValueError(f"--cluster-master {self.cluster_master!r}: {why}")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.cluster_id):
            raise ValueError(f"--cluster-id must be letters, digits, '.', '_' or '-', got {self.cluster_id!r}")
        if self.cluster_segment_bytes <= 0 or self.cluster_buffer_bytes <= 0:
            raise ValueError("--cluster-segment-bytes and --cluster-buffer-bytes must be positive")
        if self.cluster_timeout_seconds <= 0 or self.cluster_retry_seconds <= 0:
            raise ValueError("--cluster-timeout-seconds and --cluster-retry-seconds must be positive")
        if self.cluster_publish_queue < 1:
            raise ValueError("--cluster-publish-queue must be at least 1")
        if self.cluster_hot_list_seconds < 0:
            raise ValueError(f"--cluster-hot-list-seconds must be 0 (off) or a positive number of seconds, got "
                             f"{self.cluster_hot_list_seconds}")
        problem = zmq_endpoint_error(self.kv_events_address) if self.kv_events_address else ""
        if problem:
            raise ValueError(f"--kv-events-address must be a ZMQ endpoint tcp://HOST:PORT or ipc://PATH, got "
                             f"{self.kv_events_address!r}: {problem}")
        self._validate_security()
        self._validate_chunk_size()
        if self.bulk_zero_copy == "on" and not any(a.startswith("unix:") for a in self.bulk_addresses):
            raise ValueError("--bulk-zero-copy on needs a unix-socket --bulk-address (unix:/PATH): descriptors "
                             "cannot cross TCP")
        from promptcache.sidecar.policies import POLICIES

        if self.eviction_policy not in POLICIES:
            raise ValueError(f"--eviction-policy must be one of {', '.join(sorted(POLICIES))}, "
                             f"got {self.eviction_policy!r}")
        return self

    @property
    def authenticated(self) -> bool:
        """Callers are authenticated tenants (bearer tokens or mTLS)."""
        return bool(self.token_file or self.tls_client_ca_file)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    def _validate_chunk_size(self) -> None:
        """Refuse a chunk size no Put could ever store: even the smallest model (one layer, one KV head, the
        narrowest head) in the smallest mode served would have chunks over --max-chunk-bytes or the budget."""
        from promptcache.contract.keys import QUANT_MODES, ModelSpec
        from promptcache.contract.layout import chunk_nbytes

        modes = QUANT_MODES if self.quantization == "any" else (self.quantization,)
        smallest = None
        for mode in modes:
            for head_dim in (1, 2):  # some packed modes need an even head_dim
                spec = ModelSpec(model_id="m", revision="", kv_dtype="float16", num_layers=1, num_kv_heads=1,
                                 head_dim=head_dim, quantization=mode)
                try:
                    n = chunk_nbytes(spec, self.chunk_tokens)
                except ValueError:
                    continue
                smallest = n if smallest is None else min(smallest, n)
        limit = min(self.max_chunk_bytes, self.memory_bytes)
        if smallest is not None and smallest > limit:
            which = "--max-chunk-bytes" if self.max_chunk_bytes <= self.memory_bytes else "--memory-bytes"
            raise ValueError(f"--chunk-tokens {self.chunk_tokens}: even the smallest chunk (one layer, one KV head) "
                             f"takes {smallest} bytes, more than {which} {limit}; no Put could ever store one")

    def _validate_security(self) -> None:
        """Cross-field checks of TLS, authentication, tenancy and where plaintext may listen."""
        from promptcache.sidecar.netaddr import is_local_address

        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("--tls-client-ca-file (mTLS) needs --tls-cert-file and --tls-key-file")
        if not self.tls and not is_local_address(self.grpc_address) and not self.allow_insecure_remote:
            raise ValueError(f"--grpc-address {self.grpc_address} is not loopback or a unix socket; "
                             "serve TLS there (--tls-cert-file, --tls-key-file) or, for plaintext, pass "
                             "--allow-insecure-remote")
        if self.tenancy == "isolated" and not self.authenticated:
            raise ValueError("--tenancy isolated needs authentication (--token-file or --tls-client-ca-file): "
                             "without it every caller is the same anonymous tenant")
        if not self.bulk_address:
            return
        if self.tls_client_ca_file and not self.token_file:
            raise ValueError("--bulk-address: bulk clients authenticate with a bearer token, and with mTLS but no "
                             "--token-file they could not; add --token-file or leave --bulk-address empty")
        for address in self.bulk_addresses:
            if address.startswith("unix:"):
                continue
            if self.tls:
                raise ValueError(f"--bulk-address {address} is TCP, and the bulk channel has no TLS: with TLS on, "
                                 "put it on a unix socket (unix:/PATH) or leave it empty")
            if not is_local_address(address) and not self.allow_insecure_remote:
                raise ValueError(f"--bulk-address {address} is not loopback or a unix socket and the bulk channel "
                                 "is plaintext; use a unix socket or pass --allow-insecure-remote")


HELP = {
    "grpc_address": "gRPC listen address: HOST:PORT, or unix:/PATH for a unix socket",
    "metrics_host": "address the Prometheus /metrics HTTP endpoint binds to",
    "metrics_port": "port of the /metrics endpoint (0 picks a free port and logs it)",
    "memory_bytes": "byte budget of the device tier (GPU memory, or host memory without a GPU); never exceeded",
    "max_chunk_bytes": "largest chunk accepted by Put; larger ones get RESOURCE_EXHAUSTED",
    "chunk_overhead_bytes": "bytes each memory-tier chunk is counted for beyond its own, in --memory-bytes: the "
                            "process's bookkeeping per chunk (index, eviction policy and its ghosts, tenancy), so "
                            "tiny chunks cannot grow the process far past the budget",
    "chunk_tokens": "tokens per chunk (a power of two); chunk keys are chained over these",
    "ttl_seconds": "an entry lives this long after its last hit (a Get or bulk get that serves it, or its "
                   "promotion from disk): sliding, every hit extends it",
    "max_lifetime_seconds": "absolute cap: an entry never lives longer than this after it was first stored, "
                            "however often it is hit (on disk and across restarts too)",
    "max_ttl_hint_seconds": "cap on a Put's retention hint (PutHeader.ttl_seconds, the client's put(ttl_seconds=)): "
                            "a longer hint is cut to this, and counted (docs/retention.md)",
    "max_pinned_fraction": "a Put's priority hint pins its prefix (capacity eviction passes it over) up to this "
                           "fraction of the memory budget, or of the owner's quota when smaller, per owner; all "
                           "owners together at most half the budget. 0: no pinning (docs/retention.md)",
    "pinned_prefixes_file": "JSON list of {name, tokens}: a Put that stores or covers one of these token prefixes pins "
                            "its whole chunks as a priority hint does, within --max-pinned-fraction "
                            "(docs/retention.md); empty: none",
    "eviction_policy": "which entry goes first when the budget is full",
    "quantization": "the only KV quantization mode accepted (none, k8v8, k8v4, k6v4z; clients quantize, the mode is "
                    "part of every key); other models get FAILED_PRECONDITION. any: accept every mode",
    "tenancy": "isolated: each tenant's chunks are keyed apart (needs --token-file or mTLS); shared: every "
               "caller shares one namespace even with authentication on; auto: isolated when authentication is on",
    "device": "where the device tier lives: auto (CUDA if present, else CPU), cpu, cuda, cuda:N",
    "data_dir": "folder for the disk tier (RocksDB)",
    "disk_bytes": "byte budget of the disk tier; 0 disables it",
    "disk_index_bytes": "RAM the disk tier's in-memory index may take (about 1.8 KiB per record plus its meta, "
                        "counted on every write; a record costs that whatever its chunk's size, so a client's tiny "
                        "model layout could otherwise fill --disk-bytes with millions of records): a write over it "
                        "evicts from disk as the budget does, and an index over it at start (the bound was lowered) "
                        "is trimmed. 0: --disk-bytes / 64, at least 64Mi, twice what a full budget of 256 KiB chunks "
                        "needs (docs/disk-tier.md); else at least 1Mi",
    "disk_min_free_bytes": "spilling stops while the data folder's filesystem has less free space than this",
    "disk_lock_wait_seconds": "at start, how long to wait for another process (the pod being replaced) to "
                              "release the disk tier's RocksDB lock before exiting with an error",
    "warmup_seconds": "at start, the health service says NOT_SERVING while warm-up fills the memory tier (from "
                      "--warmup-snapshot, then the disk tier, then the cluster tier's hot lists, hottest first), for "
                      "at most this long; then serving anyway while it goes on (docs/warmup.md). 0: no warm-up from "
                      "disk or cluster, and a snapshot loads without holding readiness",
    "warmup_snapshot": "snapshot file (promptcache export) loaded into the memory tier at start, verified whole "
                       "first (a bad file is logged and skipped); empty: none",
    "shm_dir": "existing folder on a shared-memory filesystem (e.g. /dev/shm/promptcache) through which "
               "node-local clients pass chunk bytes instead of streaming them; empty disables the fast path. The sidecar "
               "creates the buffer files there itself, each for one caller (docs/security.md)",
    "shm_max_buffers": "shared-memory buffers one tenant may hold open at once (without authentication: all "
                       "clients together); more get RESOURCE_EXHAUSTED and the client streams instead",
    "shm_max_bytes": "bytes of shared-memory buffers one tenant may hold open at once (without authentication: "
                     "all clients together)",
    "shm_idle_seconds": "close a shared-memory buffer no call used this long (a client that died without "
                        "closing it); its client then opens a new one",
    "bulk_address": "bulk channel for Get and Put (docs/bulk-channel.md): HOST:PORT or unix:/PATH of a plain "
                    "socket that streams chunk bytes without gRPC's per-call cost, or several, comma-separated (a "
                    "unix socket for zero copy and TCP for other pods); empty disables it",
    "bulk_max_connections": "open bulk-channel connections at most (one thread each); more are refused",
    "bulk_max_connections_per_peer": "bulk-channel connections one peer may hold (a process, by its unix-socket "
                                     "credentials; an IP address over TCP); more are refused",
    "bulk_hello_seconds": "a bulk connection that has not completed its hello (and authentication) this long "
                          "after connecting is closed; while the channel is full, a new connection replaces the "
                          "oldest one still waiting for its hello",
    "bulk_zero_copy": "on a unix-socket bulk channel, lend stored chunks to clients as sealed read-only memfds "
                      "instead of copying them (docs/bulk-channel.md); a client can then keep an evicted "
                      "chunk's memory alive. auto: on with a CPU tier and shared tenancy, off with isolated "
                      "tenants; on: also with isolated tenants",
    "bulk_socket_mode": "permission bits of the bulk channel's unix socket file, octal (0660: the socket's group "
                        "may connect too; the operator's spec.zeroCopy sets it); empty: as the process umask "
                        "makes it (with the usual 022 only the owner may connect)",
    "workers": "gRPC worker threads (concurrent calls served at once)",
    "frame_bytes": "bytes per streamed data frame in Put and Get",
    "log_level": "debug, info, warning or error",
    "log_format": "json (one object per line) or text",
    "allow_insecure_remote": "allow plaintext gRPC on a non-loopback address (without --tls-cert-file)",
    "tls_cert_file": "PEM server certificate (chain); with --tls-key-file, gRPC is served over TLS",
    "tls_key_file": "PEM private key of --tls-cert-file",
    "tls_client_ca_file": "PEM CA bundle: require client certificates signed by it (mTLS); the tenant is the "
                          "certificate's common name. Turns authentication on",
    "token_file": "bearer tokens: a folder (one file per tenant, named after it, holding its tokens; a mounted "
                  "Secret) or a file of TENANT:TOKEN lines; reloaded when it changes. Turns authentication on",
    "token_reload_seconds": "how often the token file and the TLS files are checked for changes",
    "tenant_secret_file": "file with the server secret (>= 16 bytes) that tenant key salts are derived from; "
                          "random per start when empty",
    "sharing_groups": "opt-in shared namespaces, GROUP=TENANT,TENANT or GROUP=* separated by ';'; a client "
                      "selects one with the model tenant_salt 'share:GROUP'",
    "admin_tenants": "comma-separated tenants allowed to Resize, to Export and to see whole-cache Stats when auth "
                     "is on",
    "tenant_quota_bytes": "bytes each tenant (and sharing group) may hold in the memory tier; 0: no quota",
    "tenant_quotas": "per-tenant quotas overriding --tenant-quota-bytes: TENANT=BYTES,group:GROUP=BYTES",
    "max_calls_per_client": "calls in flight per client (tenant, or peer address without auth), gRPC and bulk "
                            "channel together; more get RESOURCE_EXHAUSTED. 0: no limit",
    "stream_idle_seconds": "cancel a stream that made no progress this long: a Put whose client sent nothing, "
                           "a Get whose client read nothing (0: never)",
    "max_call_seconds": "cancel any call running longer than this (0: never)",
    "min_put_bytes_per_second": "a Put holding a memory reservation must send at least this many bytes per "
                                "second, averaged over --put-rate-window-seconds, or it is cancelled and its "
                                "reservation released (0: no minimum)",
    "put_rate_window_seconds": "window over which --min-put-bytes-per-second is measured",
    "max_put_reserved_fraction": "fraction of --memory-bytes that the Puts of one client (tenant, or peer "
                                 "address without auth) may hold reserved at once (at least one chunk); more "
                                 "gets RESOURCE_EXHAUSTED",
    "max_request_tokens": "tokens one request may carry (Lookup, Get, Put, Delete, bulk get); more get "
                          "INVALID_ARGUMENT",
    "max_large_requests": "requests with more than 64Ki tokens processed at once; more get RESOURCE_EXHAUSTED",
    "mrc_sample_rate": "fraction of chain roots (prompts by their first chunk) simulated to estimate the hit ratio at "
                       "other sizes (promptcache_mrc_*; docs/sizing.md); 0 turns the miss-ratio curve off",
    "mrc_sizes": "cache sizes the miss-ratio curve estimates, comma-separated; empty: --memory-bytes times 1/4 to 8 "
                 "in steps of sqrt(2)",
    "mrc_min_chunks": "the miss-ratio curve samples more chains (at most 1/4) for a small size, until its miniature "
                      "cache holds this many chunks (fewer are all granularity), the raises scaled down together so "
                      "that all sizes' rates add up to at most 1 (the curve's work stays within the cache's own); "
                      "0: --mrc-sample-rate for every size",
    "access_log_path": "write a sampled access log here (JSONL trace for promptcache bench replay --trace; chunk "
                       "keys hashed again with a per-start secret, no tokens); empty: no log",
    "access_log_sample_rate": "fraction of chain roots whose requests the access log records",
    "access_log_max_bytes": "the access log file is rotated before it grows past this",
    "access_log_files": "access log files kept, the current one included (disk use <= max bytes x files)",
    "cluster_master": "HOST:PORT of a Mooncake master, or etcd://HOST:PORT[;HOST:PORT...] of the etcd behind an HA "
                      "master set: join the cluster tier (docs/cluster.md), where local misses are looked up and "
                      "committed chunks published; empty: single node",
    "cluster_id": "the HA master set's -cluster_id (with an etcd:// --cluster-master: which masters' leader to follow)",
    "cluster_local_hostname": "address other sidecars reach this one's cluster segment at (the pod IP); empty: "
                              "this host's name resolved",
    "cluster_protocol": "Mooncake transfer protocol: tcp or rdma",
    "cluster_rdma_devices": "RDMA devices for --cluster-protocol rdma (e.g. mlx5_0); empty: auto",
    "cluster_metadata_server": "Mooncake metadata server; P2PHANDSHAKE needs none (no etcd)",
    "cluster_segment_bytes": "host memory this sidecar contributes to the cluster store (outside --memory-bytes)",
    "cluster_buffer_bytes": "Mooncake client transfer buffer; chunks larger than it are not published",
    "cluster_timeout_seconds": "deadline of one cluster call; a call that fails or runs out marks the tier down",
    "cluster_retry_seconds": "how long the cluster tier stays marked down (serving locally) before it is tried again",
    "cluster_publish_queue": "chunks waiting to be published at most; more are dropped and counted",
    "cluster_hot_list_seconds": "how often this node publishes the keys of its hottest chunks to the cluster tier, "
                                "from which new and restarted nodes warm up (docs/warmup.md); 0: never",
    "kv_events_address": "ZMQ PUB endpoint (tcp://HOST:PORT or ipc://PATH) on which KV events in vLLM's format "
                         "announce the chunks this node holds, for prefix-aware routers (docs/cluster.md); empty: off",
    "kv_events_id": "the id in the KV event topic kv@ID@MODEL (letters, digits, '.', '_', '-'); empty: this "
                    "host's name",
}

MAX_QUANTITY = MAX_INT64  # every count and size: the sidecar's counters, metrics and the API's int64 fields
_BYTE_FIELDS = {"memory_bytes", "max_chunk_bytes", "chunk_overhead_bytes", "disk_bytes", "disk_index_bytes",
                "disk_min_free_bytes", "frame_bytes",
                "tenant_quota_bytes", "shm_max_bytes", "min_put_bytes_per_second", "access_log_max_bytes",
                "cluster_segment_bytes", "cluster_buffer_bytes"}


def file_problem(path: str) -> str:
    """Why `path` is not a regular file to read ("" when it is): missing, a directory, or something else (a FIFO
    would block the reader, a device such as /dev/zero never end)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return "no such file" if exc.errno == errno.ENOENT else (exc.strerror or str(exc))
    if stat.S_ISREG(st.st_mode):
        return ""
    return "a directory, not a file" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"


def cluster_master_error(address: str) -> str:
    """Why `address` is not a Mooncake master address ("" when it is): HOST:PORT of one master, or
    etcd://HOST:PORT[;HOST:PORT...] of the etcd through which the clients of an HA master set find its leader."""
    endpoints = address.removeprefix("etcd://").split(";") if address.startswith("etcd://") else [address]
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        # (a host holds no separator or scheme: "a:2379,b:2379" or "http://m:50051" would reach Mooncake as one)
        if (not host or any(c.isspace() or c in ",;/@" for c in host) or host_port_error(endpoint)
                or int(port) == 0):
            return (f"{endpoint!r} is not HOST:PORT (expected HOST:PORT of the master, "
                    "or etcd://HOST:PORT[;HOST:PORT...])")
    return ""


def env_name(field_name: str) -> str:
    return "PROMPTCACHE_" + field_name.upper()


def _converter(name: str, typ):
    if name in _BYTE_FIELDS:
        return parse_bytes
    typ = get_type_hints(Settings)[name]
    return str if get_origin(typ) is Literal else {int: int, float: float, str: str}[typ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{HELP[f.name]} (env {env_name(f.name)}; default {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(flag, default=None, help=help_text, metavar=f.name.upper())


def settings_from_args(args: argparse.Namespace, environ=os.environ) -> Settings:
    """Flags beat environment variables beat defaults. Raises ValueError naming the bad flag or variable."""
    values = {}
    for f in fields(Settings):
        raw = getattr(args, f.name, None)
        source = "--" + f.name.replace("_", "-")
        if raw is None and env_name(f.name) in environ:
            raw, source = environ[env_name(f.name)], env_name(f.name)
            if f.type in ("bool", bool):
                if raw.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                    raise ValueError(f"{source}={raw!r} is not a boolean (true/false)")
                raw = raw.lower() in ("1", "true", "yes")
        if raw is None:
            continue
        if f.type in ("bool", bool):
            values[f.name] = bool(raw)
            continue
        try:
            values[f.name] = _converter(f.name, f.type)(raw)
        except ValueError as exc:
            raise ValueError(f"{source}={raw!r}: {exc}") from None
    return Settings(**values).validate()
