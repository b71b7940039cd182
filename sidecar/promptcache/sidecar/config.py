"""Sidecar settings: every one is a flag and an environment variable (PROMPTCACHE_<FLAG>), flag winning."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields

DESCRIPTION = """\
Run the PromptCache sidecar: a node-local gRPC server (promptcache.v1.KVCache) that stores the attention
key/value tensors of prompt prefixes so inference pods load them instead of recomputing them.

Every flag can also be set by an environment variable: --memory-bytes is PROMPTCACHE_MEMORY_BYTES, and so on.
Byte sizes accept Kubernetes quantities: 512Mi, 4Gi, 1G, or plain integers.
"""

_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|k|M|G|T)?\s*$")
_FACTORS = {None: 1, "K": 10**3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_bytes(text: str | int) -> int:
    """'4Gi' -> 4294967296. Raises ValueError for anything that is not a non-negative quantity."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative")
        return text
    m = _QUANTITY.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a byte size (examples: 1073741824, 512Mi, 4Gi)")
    return int(float(m.group(1)) * _FACTORS[m.group(2)])


@dataclass(frozen=True)
class Settings:
    grpc_address: str = "127.0.0.1:50051"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9400
    memory_bytes: int = 1 << 30
    max_chunk_bytes: int = 256 << 20
    chunk_tokens: int = 256
    ttl_seconds: float = 4 * 3600.0
    eviction_policy: str = "wtinylfu"  # chosen by trace replay: docs/eviction.md
    quantization: str = "any"
    tenancy: str = "auto"
    device: str = "auto"
    data_dir: str = "./promptcache-data"
    disk_bytes: int = 0
    disk_min_free_bytes: int = 256 << 20
    shm_dir: str = ""
    bulk_address: str = ""
    bulk_max_connections: int = 64
    bulk_zero_copy: str = "auto"
    workers: int = 32
    frame_bytes: int = 1 << 20
    log_level: str = "info"
    log_format: str = "json"
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

    @property
    def bulk_addresses(self) -> list[str]:
        """--bulk-address split at commas: the channel may listen on a unix socket and TCP at once."""
        return [a.strip() for a in self.bulk_address.split(",")] if self.bulk_address else []

    def validate(self) -> "Settings":
        if self.memory_bytes <= 0:
            raise ValueError("--memory-bytes must be positive")
        if self.max_chunk_bytes <= 0:
            raise ValueError("--max-chunk-bytes must be positive")
        if self.chunk_tokens <= 0 or self.chunk_tokens & (self.chunk_tokens - 1):
            raise ValueError(f"--chunk-tokens must be a positive power of two, got {self.chunk_tokens}")
        if self.ttl_seconds <= 0:
            raise ValueError("--ttl-seconds must be positive")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.bulk_address:
            from promptcache.bulkwire import parse_address

            for address in self.bulk_addresses:
                try:
                    parse_address(address)
                except ValueError as exc:
                    raise ValueError(f"--bulk-address: {exc}") from None
            if len(set(self.bulk_addresses)) != len(self.bulk_addresses):
                raise ValueError(f"--bulk-address names an address twice: {self.bulk_address}")
        if self.bulk_max_connections < 1:
            raise ValueError("--bulk-max-connections must be at least 1")
        if self.bulk_zero_copy not in ("auto", "on", "off"):
            raise ValueError(f"--bulk-zero-copy must be auto, on or off, got {self.bulk_zero_copy!r}")
        if self.workers < 1:
            raise ValueError("--workers must be at least 1")
        if not 4096 <= self.frame_bytes <= (3 << 20):
            raise ValueError("--frame-bytes must be between 4096 and 3Mi (gRPC's default message limit is 4 MiB)")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError("--log-level must be one of debug, info, warning, error")
        if self.log_format not in ("json", "text"):
            raise ValueError("--log-format must be json or text")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not self.grpc_address:
            raise ValueError("--grpc-address is empty")
        if self.token_reload_seconds < 0:
            raise ValueError("--token-reload-seconds must not be negative")
        if self.max_calls_per_client < 0:
            raise ValueError("--max-calls-per-client must not be negative (0: no limit)")
        if self.stream_idle_seconds < 0 or self.max_call_seconds < 0:
            raise ValueError("--stream-idle-seconds and --max-call-seconds must not be negative (0: no limit)")
        if self.quantization not in ("any", "none", "k8v8", "k8v4"):
            raise ValueError(f"--quantization must be any, none, k8v8 or k8v4, got {self.quantization!r}")
        if self.tenancy not in ("auto", "isolated", "shared"):
            raise ValueError(f"--tenancy must be auto, isolated or shared, got {self.tenancy!r}")
        from promptcache.sidecar.policies import POLICIES

        if self.eviction_policy not in POLICIES:
            raise ValueError(f"--eviction-policy must be one of {', '.join(sorted(POLICIES))}, "
                             f"got {self.eviction_policy!r}")
        return self


HELP = {
    "grpc_address": "gRPC listen address: HOST:PORT, or unix:/PATH for a unix socket",
    "metrics_host": "address the Prometheus /metrics HTTP endpoint binds to",
    "metrics_port": "port of the /metrics endpoint (0 picks a free port and logs it)",
    "memory_bytes": "byte budget of the device tier (GPU memory, or host memory without a GPU); never exceeded",
    "max_chunk_bytes": "largest chunk accepted by Put; larger ones get RESOURCE_EXHAUSTED",
    "chunk_tokens": "tokens per chunk (a power of two); chunk keys are chained over these",
    "ttl_seconds": "lifetime of an entry after it is stored",
    "eviction_policy": "which entry goes first when the budget is full",
    "quantization": "the only KV quantization mode accepted (none, k8v8, k8v4; clients quantize, the mode is "
                    "part of every key); other models get FAILED_PRECONDITION. any: accept every mode",
    "tenancy": "isolated: each tenant's chunks are keyed apart (needs --token-file or mTLS); shared: every "
               "caller shares one namespace even with authentication on; auto: isolated when authentication is on",
    "device": "where the device tier lives: auto (CUDA if present, else CPU), cpu, cuda, cuda:N",
    "data_dir": "folder for the disk tier (RocksDB)",
    "disk_bytes": "byte budget of the disk tier; 0 disables it",
    "disk_min_free_bytes": "spilling stops while the data folder's filesystem has less free space than this",
    "shm_dir": "folder on a shared-memory filesystem (e.g. /dev/shm/promptcache) through which node-local "
               "clients pass chunk bytes instead of streaming them; empty disables the fast path",
    "bulk_address": "bulk channel for Get and Put (docs/bulk-channel.md): HOST:PORT or unix:/PATH of a plain "
                    "socket that streams chunk bytes without gRPC's per-call cost, or several, comma-separated (a "
                    "unix socket for zero copy and TCP for other pods); empty disables it",
    "bulk_max_connections": "open bulk-channel connections at most (one thread each); more are refused",
    "bulk_zero_copy": "on a unix-socket bulk channel, lend stored chunks to clients as sealed read-only memfds "
                      "instead of copying them (docs/bulk-channel.md); a client can then keep an evicted "
                      "chunk's memory alive. auto: on with a CPU tier and shared tenancy, off with isolated "
                      "tenants; on: also with isolated tenants",
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
    "admin_tenants": "comma-separated tenants allowed to Resize and to see whole-cache Stats when auth is on",
    "tenant_quota_bytes": "bytes each tenant (and sharing group) may hold in the memory tier; 0: no quota",
    "tenant_quotas": "per-tenant quotas overriding --tenant-quota-bytes: TENANT=BYTES,group:GROUP=BYTES",
    "max_calls_per_client": "calls in flight per client (tenant, or peer address without auth); more get "
                            "RESOURCE_EXHAUSTED. 0: no limit",
    "stream_idle_seconds": "cancel a stream that made no progress this long: a Put whose client sent nothing, "
                           "a Get whose client read nothing (0: never)",
    "max_call_seconds": "cancel any call running longer than this (0: never)",
}

_BYTE_FIELDS = {"memory_bytes", "max_chunk_bytes", "disk_bytes", "disk_min_free_bytes", "frame_bytes",
                "tenant_quota_bytes"}


def env_name(field_name: str) -> str:
    return "PROMPTCACHE_" + field_name.upper()


def _converter(name: str, typ):
    if name in _BYTE_FIELDS:
        return parse_bytes
    return {"int": int, "float": float, "str": str}[typ if isinstance(typ, str) else typ.__name__]


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
