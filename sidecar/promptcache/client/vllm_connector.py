"""vLLM v1 KV connector: vLLM reuses prompt prefixes from the node-local PromptCache sidecar (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PromptCacheConnector",
        "kv_connector_module_path": "promptcache.client.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "unix:///run/promptcache/grpc.sock",
                                      "bulk_address": "unix:/run/promptcache/bulk.sock"}}'

What happens to a request (docs/vllm.md):

1. **Scheduler, Lookup** (``get_num_new_matched_tokens``): a Lookup (metadata only) of the prompt but its last token,
   on a background thread; while it is in flight the answer is None ("ask again later"), for at most
   ``lookup_timeout``; then the cached whole chunks beyond vLLM's own hit, loaded asynchronously (``load_kv_async``).
   The scheduler loop never waits for the sidecar. At TP/PP > 1 every rank's shard is looked up; the fewest count.
2. **Metadata**: block ids, the request's spec and its tokens, never KV bytes (it goes to every worker process).
3. **Worker, load** (``start_load_kv`` queues, a load thread Gets, checks and writes the rank's chunks into the
   blocks, ``get_finished`` reports the request): blocks whose chunks did not come go to
   ``get_block_ids_with_load_errors`` and vLLM recomputes them (``kv_load_failure_policy: recompute``).
4. **Worker, save** (``wait_for_save`` of the step that finishes the prompt): the request's new whole prompt chunks
   are copied out of their blocks (one copy) and handed to a background thread that converts them to the canonical
   chunk layout and Puts them. The queue is bounded: when it is full the save is dropped and counted, never blocking.
   ``requires_kv_delivery`` is False: best effort, a pending save never makes vLLM recompute.

A sidecar that failed is not asked again for ``retry_interval`` (one fast failure per interval, not a timeout per
request); the gRPC channel reconnects within a second, so a sidecar restarted on the same address is used again.

The fingerprint (promptcache.contract.keys.ModelSpec) comes from the engine's config: model id (served name), revision
(the ``revision`` setting, else engine_identity: the weights' commit or a digest of the weight files, and a digest of
what in the engine's config changes K/V for the same weights: hf_overrides, online quantization, dtype,
max_model_len), KV dtype, layers, KV heads, head dim, the quantization mode. The salt (docs/keys.md, "Request salt (v2)") carries vLLM's per-request ``cache_salt``, the request's LoRA
adapter, multimodal items and prompt embeddings (request_spec), and the rank's slice of KV heads and layers; a
request with an input that cannot be identified is neither loaded nor stored.

Layouts (docs/vllm.md, "KV block layouts"): on a GPU (every platform but CPU), vLLM's standard attention backends
hand the worker one view per layer of logical shape [blocks, kv_heads, block_size, K|V] whose strides carry the
engine's KVCacheLayout (LBNHC by default, LBHNC, ...); the layout is read from vLLM's KV cache config and the views'
strides, checked against each other, and converted with whole-block gathers/scatters on the cache's device
(promptcache.client.vllm_paged). vLLM's CPU attention backend (fp32/fp16 "vec" and bf16 AMX) keeps its own cell
format inside that shape, measured once at start-up by writing probe values through the backend's own cache-write
kernel (promptcache.client.vllm_layout.identify). Sliding-window layers of a hybrid model are cached when vLLM's
hybrid allocator is off (as vLLM sets it for this connector, which is not SupportsHMA): they are then allocated for
every token. An fp8 KV cache (fp8/fp8_e4m3, fp8_e5m2) moves as its raw bytes (kv_dtype float8_e4m3fn /
float8_e5m2), under keys that carry the per-layer K/V scales the config says (setting kv_scales; each worker checks
its real scales against them, docs/keys.md "Request salt (v2)"); an MLA model's chunks are its latents (kv_kind mla),
stored by TP rank 0 and loaded by every rank. Several KV cache groups (the hybrid allocator on, Mamba layers), fp8
scales computed at run time or not the configured ones, KV heads that do not split over the TP ranks, decode or
prefill context parallelism, ``kv_load_failure_policy`` other than ``recompute``, weights it cannot identify (or
``load_format dummy``) or a layout neither path recognises leaves the connector inert (said in vLLM's log): every request is
a normal prefill. A chunk is never stored or served in a layout that was not identified.

Counters reach vLLM's /metrics through vLLM's connector stats (get_kv_connector_stats, build_kv_connector_stats,
build_prom_metrics: ``vllm:promptcache_*``), and are also this process's ``promptcache_client_*`` metrics.

Settings (``kv_connector_extra_config`` key, else environment variable):

=================  ===============================  ==========================================================
key                environment                      meaning
=================  ===============================  ==========================================================
address            PROMPTCACHE_ADDRESS              sidecar gRPC address (HOST:PORT or unix:///PATH); required
bulk_address       PROMPTCACHE_BULK_ADDRESS         the sidecar's --bulk-address, for Get (faster); optional
quantization       PROMPTCACHE_QUANTIZATION         none (bit-exact, default), k8v8, k8v4, k6v4z
tenant_salt        PROMPTCACHE_TENANT_SALT          salt for every request without a cache_salt of its own
model_id           PROMPTCACHE_MODEL_ID             model identity in the fingerprint (default: served name)
revision           PROMPTCACHE_REVISION             the model's identity (default: engine_identity, below)
lookup_timeout     PROMPTCACHE_LOOKUP_TIMEOUT       seconds the scheduler waits for a Lookup (default 0.25)
load_timeout       PROMPTCACHE_LOAD_TIMEOUT         seconds for one worker-side fetch (default 1.0)
retry_interval     PROMPTCACHE_RETRY_INTERVAL       seconds a failed sidecar is not asked again (default 2.0)
save_timeout       PROMPTCACHE_SAVE_TIMEOUT         seconds for one background Put (default 30)
max_pending_saves  PROMPTCACHE_MAX_PENDING_SAVES    saves queued at most (1 or more); more are dropped (default 8)
staging_bytes      PROMPTCACHE_STAGING_BYTES        page-locked host buffers of a GPU worker's saves and loads (one
                                                    each, default 512Mi; 0: none); a larger save or load goes
                                                    through its buffer in parts (staging.py)
tls_ca, token_file PROMPTCACHE_TLS_CA, ..._TOKEN_FILE  TLS CA (PEM path) and bearer token file (docs/security.md)
kv_layout          PROMPTCACHE_KV_LAYOUT            auto (default: paged views on GPUs, the probe on CPU), paged, cpu
kv_scales          PROMPTCACHE_KV_SCALES            fp8 KV cache: auto (default: unit, inert if the checkpoint has KV
                                                    scales), unit (every scale 1.0) or the 64-hex scales digest a
                                                    worker logs; each worker checks its real scales against it
=================  ===============================  ==========================================================
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from promptcache.client import vllm_layout, vllm_paged
from promptcache.client import errors
from promptcache.client.client import checked_chunks
from promptcache.client.hf import _warn, fallback_reason
from promptcache.client.metrics import (FALLBACKS, FETCH_SECONDS, HITS, LOAD_ERRORS, LOAD_SECONDS, LOADED_TOKENS,
                                        LOOKUPS, RECONNECTS, REUSED_TOKENS, SAVE_COPY_SECONDS, SAVE_SECONDS, STORES,
                                        UNIDENTIFIED)
from promptcache.client.staging import DEFAULT_CAPACITY, HostStaging
from promptcache.contract.keys import Adapter, ModelSpec, MultiModalItem, Shard, request_salt, shard_spec
from promptcache.contract.layout import DTYPE_NAMES, TORCH_DTYPES
from promptcache.contract.quantity import parse_bytes

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402 - vLLM is this module's host
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("promptcache.client.vllm")
_vllm_log = logging.getLogger("vllm.promptcache")  # vLLM's own logging tree: what vLLM's log shows



def _setting(extra: dict, key: str, default=None):
    value = extra.get(key)
    if value is None:
        value = os.environ.get("PROMPTCACHE_" + key.upper())
    return default if value is None or value == "" else value


def _number(extra: dict, key: str, default: float, *, positive: bool = False, whole: bool = False):
    """A numeric setting: a finite number, 0 or more (above 0 when `positive`), whole when `whole`; anything else is
    refused with a message that names the key and its variable (float("1s") would name neither)."""
    value = _setting(extra, key, default)
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and (number > 0 if positive else number >= 0)
            and (not whole or number.is_integer())):
        what = "a whole number" if whole else "a number of seconds"
        raise ValueError(f"kv_connector_extra_config.{key} (or PROMPTCACHE_{key.upper()}) must be {what} "
                         f"{'above 0' if positive else '0 or more'}, got {value!r}")
    return int(number) if whole else number


def weights_digest(model_dir: str) -> str:
    """The identity of local weight files: their names, sizes and every byte (xxh3-128), and the folder's
    config.json. Every byte: a fine-tune of one layer, of the norms only, or a merged LoRA differs from its base
    in a few MiB anywhere in the files (a sample of windows missed 56 of SmolLM2's 60 K/V projections). Run once,
    by the scheduler, after the workers loaded the weights (so mostly from the page cache: seconds per 10 GB)."""
    import xxhash

    path = Path(model_dir)
    files = sorted(p for p in path.glob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".gguf")) if path.is_dir() \
        else ([path] if path.is_file() else [])
    if not files:
        return ""
    h = xxhash.xxh3_128()
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.is_file():
        data = config.read_bytes()
        h.update(f"config.json:{len(data)}:".encode() + data)
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    for p in files:
        h.update(f"{len(p.name)}:{p.name}:{p.stat().st_size}:".encode())
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                h.update(view[:n])
    return "weights-" + h.hexdigest()


def _hub_commit(repo: str, revision) -> str:
    """The commit of `repo` at `revision` in the local Hugging Face cache, as vLLM loaded it ("" if not there)."""
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(repo, revision=str(revision) if revision else None, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub model, not cached, no huggingface_hub: unidentified
        return ""
    return snapshot.name if re.fullmatch(r"[0-9a-f]{40}", snapshot.name) else ""


# vLLM's multimodal settings that change what an item's placeholder tokens compute, for the same request: the
# processor's and the media loader's arguments (resolution, fps), normalisation, the encoder's attention dtype, video
# token pruning. (vLLM hashes only a request's own processor arguments into its items.)
_MM_ENGINE_SETTINGS = ("mm_processor_kwargs", "media_io_kwargs", "mm_device_do_normalize", "mm_encoder_attn_dtype",
                       "video_pruning_rate", "video_pruning_method", "interleave_mm_strings")


def engine_identity(vllm_config) -> tuple[str, str | None]:
    """The model's identity for the fingerprint's `revision` when none is configured, and why there is none (the
    connector is then inert): what the weights are - the commit vLLM resolved the revision to, else the local
    Hugging Face cache's commit, else a digest of the local weight files (weights_digest) - and a digest of what in
    the engine's config changes K and V for the same weights: the model's config after hf_overrides (RoPE scaling
    and theta, ...), online weight quantization, the compute dtype (an fp8 KV cache's values come from it) and
    max_model_len (which picks LongRoPE's long or short factors). A revision name alone ("main", a tag, or none)
    says nothing: the branch moves."""
    mc = vllm_config.model_config
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))
    if load_format == "dummy":
        return "", "load_format dummy: the weights are random, and their KV must not reach other engines"
    revision = mc.revision
    resolved = getattr(revision, "resolved", None)  # vLLM's ResolvedRevision: str() is the name asked for
    commit = str(resolved) if resolved else ""
    if not commit and revision and re.fullmatch(r"[0-9a-f]{40}", str(revision)):
        commit = str(revision)
    if not commit and not Path(mc.model).exists():
        commit = _hub_commit(mc.model, revision)
    weights = f"commit {commit}" if commit else weights_digest(mc.model)
    if not weights:
        return "", (f"the weights of {mc.model!r} cannot be identified (no resolved commit, no local weight files): "
                    "set kv_connector_extra_config.revision (PROMPTCACHE_REVISION) to what identifies them")
    config = {k: v for k, v in mc.hf_config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    mm = getattr(mc, "multimodal_config", None)  # engine-wide processor settings change an image's tokens' K/V
    multimodal = None if mm is None else {name: getattr(mm, name, None) for name in _MM_ENGINE_SETTINGS}
    engine = {"hf_config": config, "quantization": mc.quantization, "dtype": str(mc.dtype),
              "max_model_len": mc.max_model_len, "multimodal": multimodal}
    digest = hashlib.sha256(json.dumps(engine, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return f"{weights} engine-{digest}", None


def layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", "." + name + ".")
    if not found:
        raise ValueError(f"no layer index in KV cache name {name!r}")
    return int(found[0])


class Unidentifiable(Exception):
    """A request carries an input whose identity the connector cannot establish: it is neither loaded nor stored.
    `reason` is the metric label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


_ADAPTER_DIGESTS: dict[tuple, bytes] = {}
_ADAPTER_LOCK = threading.Lock()
LOAD_BATCHES = 4  # a load's chunks are fetched in up to this many Gets, each overlapping the previous one's write


def adapter_digest(path: str) -> bytes:
    """SHA-256 over an adapter's files (relative names, sizes and all bytes), cached per (path, and each file's name,
    size, inode, mtime and ctime): a file rewritten in place keeps its size and can keep its mtime (cp -p, rsync -a,
    tar), but not its ctime, which no program sets. Raises Unidentifiable when there are no files to read."""
    root = Path(path)
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else ([root] if root.is_file() else [])
        stats = [(p, p.stat()) for p in files]
        stamp = (str(root), tuple((str(p), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for p, st in stats))
    except OSError as exc:
        raise Unidentifiable("lora", f"cannot read LoRA adapter {path!r}: {exc}") from None
    if not files:
        raise Unidentifiable("lora", f"LoRA adapter path {path!r} has no files to digest")
    with _ADAPTER_LOCK:
        digest = _ADAPTER_DIGESTS.get(stamp)
    if digest is None:
        h = hashlib.sha256(b"promptcache/adapter/v1\0")
        try:
            for p, st in stats:  # (the sizes of the stamp: one stat per file)
                name = (str(p.relative_to(root)) if root.is_dir() else p.name).encode()
                h.update(f"{len(name)}:".encode() + name + f":{st.st_size}:".encode())
                with open(p, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
        except OSError as exc:
            raise Unidentifiable("lora", f"cannot read LoRA adapter {path!r}: {exc}") from None
        digest = h.digest()
        with _ADAPTER_LOCK:
            _ADAPTER_DIGESTS[stamp] = digest
    return digest


def embeds_digest(embeds, mask=None) -> bytes:
    """SHA-256 over prompt embeddings (dtype, shape, bytes) and the token/embedding position mask, if any."""
    if not isinstance(embeds, torch.Tensor):
        raise Unidentifiable("prompt_embeds", f"prompt embeddings of type {type(embeds).__name__} cannot be digested")
    t = embeds.detach().cpu().contiguous()
    h = hashlib.sha256(b"promptcache/embeds/v1\0")
    h.update(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    if mask is not None:
        h.update(b"mask:" + bytes(bool(x) for x in mask))
    return h.digest()


# What vLLM names a multimodal item whose content it did not hash (prefix caching off and mm_processor_cache_gb 0):
# "renderer{rank}-mm-{n}-{modality}-{i}", n a request counter that starts again in every process.
_UNHASHED_ITEM = re.compile(r"renderer\d+-mm-\d+-.*-\d+")


def mm_content_hashed(vllm_config) -> bool:
    """Whether vLLM names a multimodal item by a hash of its content: not with prefix caching off and
    mm_processor_cache_gb 0, where it skips the hashing (vLLM 0.32-0.33, renderers/base.py _process_mm_uuids)."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    return not (mm is not None and getattr(mm, "mm_processor_cache_gb", None) == 0
                and not getattr(vllm_config.cache_config, "enable_prefix_caching", False))


def request_spec(base: ModelSpec, request, mm_hashed: bool = True) -> ModelSpec:
    """The spec of a vLLM request's chunks: the engine's model spec with the request's own salt: its cache_salt (v1,
    as before), then (v2, docs/keys.md "Request salt") its LoRA adapter (name and weights digest), its multimodal
    items (vLLM's per-item hash and placeholder range, in prompt order) and its prompt embeddings. Raises
    Unidentifiable for an input it cannot identify: with `mm_hashed` False (the engine's vLLM does not hash item
    contents: mm_content_hashed), an item named by vLLM's request counter rather than by the client's
    multi_modal_uuids. Pure but for the adapter files it reads once."""
    salt = base.tenant_salt
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        salt = hashlib.sha256(salt + b"\0" + str(cache_salt).encode()).digest()
    adapter = None
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name, path = getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)
        if not name or not path:
            raise Unidentifiable("lora", f"LoRA request {lora!r} has no name or no path")
        adapter = Adapter(str(name), adapter_digest(str(path)))
    items = []
    for i, f in enumerate(getattr(request, "mm_features", None) or ()):
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(f, "mm_position", None)
        offset, length = getattr(pos, "offset", None), getattr(pos, "length", None)
        if not ident or not isinstance(offset, int) or not isinstance(length, int) or length <= 0:
            raise Unidentifiable("multimodal", f"multimodal item {i} has no hash or no placeholder range")
        if not mm_hashed and _UNHASHED_ITEM.fullmatch(str(ident)):
            raise Unidentifiable("multimodal", f"multimodal item {i} is named {ident!r} by a request counter: this "
                                 "engine's vLLM does not hash item contents (prefix caching off and "
                                 "mm_processor_cache_gb 0); pass multi_modal_uuids or turn either on")
        items.append(MultiModalItem(str(getattr(f, "modality", "") or "unknown"), str(ident), offset, length))
    items.sort(key=lambda m: (m.offset, m.length))
    digest = b""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        digest = embeds_digest(embeds, getattr(request, "prompt_is_token_ids", None))
    try:
        salt = request_salt(salt, adapter=adapter, mm_items=items, embeds_digest=digest)
    except ValueError as exc:
        raise Unidentifiable("invalid", str(exc)) from None
    return base if salt == base.tenant_salt else replace(base, tenant_salt=salt)


def _finite(number: int | float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int beyond any float (JSON carries 10**400 as one)
        return False


def retention_hints(request) -> tuple[float, int]:
    """(ttl_seconds, priority) of a request's chunks: its `kv_transfer_params["promptcache"]`, e.g. the OpenAI API's
    `"kv_transfer_params": {"promptcache": {"ttl_seconds": 3600, "priority": 1}}` (docs/retention.md). Hints steer
    eviction and TTL only, and the sidecar caps them; a malformed one is ignored with a warning (the request is
    served and stored without it), never an engine error. Pure."""
    params = getattr(request, "kv_transfer_params", None)
    hints = params.get("promptcache") if isinstance(params, dict) else None
    if hints is None:
        return 0.0, 0
    problem = None
    ttl, priority = 0.0, 0
    if not isinstance(hints, dict):
        problem = f"kv_transfer_params.promptcache is a {type(hints).__name__}, not an object"
    else:
        unknown = sorted(set(hints) - {"ttl_seconds", "priority"})
        raw_ttl, raw_priority = hints.get("ttl_seconds", 0), hints.get("priority", 0)
        if unknown:
            problem = f"kv_transfer_params.promptcache has unknown keys {unknown} (ttl_seconds, priority)"
        elif isinstance(raw_ttl, bool) or not isinstance(raw_ttl, (int, float)) or not _finite(raw_ttl) or raw_ttl < 0:
            problem = f"kv_transfer_params.promptcache.ttl_seconds must be a finite number >= 0, not {raw_ttl!r}"
        elif isinstance(raw_priority, bool) or raw_priority not in (0, 1):
            problem = f"kv_transfer_params.promptcache.priority must be 0 or 1, not {raw_priority!r}"
        else:
            ttl, priority = float(raw_ttl), int(raw_priority)
    if problem is not None:
        _warn.warning("bad-hints", "promptcache: request %s: %s; its chunks are stored without hints",
                      getattr(request, "request_id", "?"), problem)
        return 0.0, 0
    return ttl, priority


def prompt_tokens(request) -> list[int]:
    """The token ids the chunk keys are computed over: the prompt's, or (prompt embeddings only) vLLM's placeholder
    zeros, whose identity is in the salt."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return list(ids)
    n = int(getattr(request, "num_prompt_tokens", 0) or 0)
    return [0] * n


# What the connector counts, as it reaches vLLM's /metrics through vLLM's connector stats (every process layout: the
# workers' and the scheduler's counts travel to the API server with the engine's outputs): stats key -> (vLLM metric
# name, help, label name or None). A key with a label is "name:value".
VLLM_METRICS = {
    "lookups": ("vllm:promptcache_lookups", "PromptCache: Lookups the scheduler sent to the sidecar", None),
    "hits": ("vllm:promptcache_hits", "PromptCache: requests that loaded a cached prefix", None),
    "reused_tokens": ("vllm:promptcache_reused_tokens", "PromptCache: prompt tokens loaded, not computed", None),
    "loaded_tokens": ("vllm:promptcache_loaded_tokens", "PromptCache: tokens the workers wrote into KV blocks", None),
    "load_error_blocks": ("vllm:promptcache_load_error_blocks",
                          "PromptCache: KV blocks a Lookup promised that could not be loaded (recomputed)", None),
    "fallbacks": ("vllm:promptcache_fallbacks", "PromptCache: full prefills because the cache could not be used",
                  "reason"),
    "stores": ("vllm:promptcache_stores", "PromptCache: background saves by outcome", "outcome"),
    "unidentified": ("vllm:promptcache_unidentified_requests",
                     "PromptCache: requests neither loaded nor stored (an input that cannot be identified)", "reason"),
    "reconnects": ("vllm:promptcache_reconnects", "PromptCache: times the sidecar answered again after a failure",
                   None),
}


@dataclass
class PromptCacheStats(KVConnectorStats):
    """Counter increments since the last report: data = {"counts": {key: value}} (VLLM_METRICS keys)."""

    def __post_init__(self):
        self.data.setdefault("counts", {})

    def reset(self):
        self.data = {"counts": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counts = self.data.setdefault("counts", {})
        for k, v in (other.data or {}).get("counts", {}).items():
            counts[k] = counts.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data.get("counts", {}))

    def is_empty(self) -> bool:
        return not any(self.data.get("counts", {}).values())


class PromptCachePromMetrics(KVConnectorPromMetrics):
    """The connector's counters on vLLM's /metrics (vllm:promptcache_*), per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for key, (name, doc, label) in VLLM_METRICS.items():
            self._counters[key] = (self._counter_cls(name=name, documentation=doc,
                                                     labelnames=labelnames + ([label] if label else [])), label)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        base = list(self.per_engine_labelvalues.get(engine_idx, []))
        for key, value in (transfer_stats_data or {}).get("counts", {}).items():
            name, _, label_value = key.partition(":")
            got = self._counters.get(name)
            if got is None or not value:
                continue
            counter, label = got
            counter.labels(*base, *([label_value] if label else [])).inc(value)


@dataclass
class _Lookup:
    """A scheduler-side Lookup in flight or answered, for the request's num_computed_tokens `asked`."""

    asked: int
    started: float
    future: Any
    spec: ModelSpec
    tokens: list[int]  # the prompt but its last token (one token is always left to compute)
    hit: int | None = None  # tokens cached from 0 (whole chunks), once answered


@dataclass
class _LoadOp:
    """Worker: fetch chunks [first_chunk, first_chunk + n) of `tokens` under `spec` and write them, from token `skip` of
    the first on, into `block_ids` (whole blocks). No tensor: block ids, the spec and the tokens the keys hash."""

    req_id: str
    spec: ModelSpec
    tokens: list[int]  # the prompt's first (first_chunk + n) * chunk_tokens tokens
    block_ids: list[int]  # the blocks of the tokens to load
    first_chunk: int
    skip: int  # from this token of the first chunk on (whole blocks)
    chunk_tokens: int


@dataclass
class _SaveOp:
    req_id: str
    spec: ModelSpec
    tokens: list[int]  # the prompt's whole chunks
    block_ids: list[int]  # blocks of chunks [first_chunk, len(tokens) / chunk_tokens)
    first_chunk: int
    chunk_tokens: int
    ttl_seconds: float = 0.0  # the request's retention hints (retention_hints)
    priority: int = 0


@dataclass
class PromptCacheConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step: block ids, specs and tokens; never KV bytes."""

    loads: list[_LoadOp] = field(default_factory=list)
    saves: list[_SaveOp] = field(default_factory=list)
    idle: bool = False  # the step computes no token (only requests waiting for their loads, if any)
    lookups: bool = False  # Lookups are in flight on the scheduler's thread


@dataclass
class _Tracked:
    request: Any
    spec: ModelSpec
    loaded_chunks: int = 0
    saved: bool = False


class _Breaker:
    """A sidecar that failed is not asked again for `interval` seconds: one fast failure per interval, not a
    timeout per request; the first call after the interval probes it again (a restarted sidecar is used again)."""

    def __init__(self, interval: float):
        self.interval = interval
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.down_since: float | None = None

    def allow(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def failed(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.interval
            if self.down_since is None:
                self.down_since = time.monotonic()

    def ok(self) -> bool:
        """Record a success; True when it ends an outage (a reconnect)."""
        with self._lock:
            was_down, self.down_since = self.down_since is not None, None
            return was_down


class PromptCacheConnector(KVConnectorBase_V1):
    """KV connector between a vLLM engine and the node-local PromptCache sidecar (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        self.role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.block_size = cc.block_size
        self.load_timeout = _number(extra, "load_timeout", 1.0, positive=True)
        self.lookup_timeout = _number(extra, "lookup_timeout", 0.25, positive=True)
        self.save_timeout = _number(extra, "save_timeout", 30.0, positive=True)
        self.retry_interval = _number(extra, "retry_interval", 2.0)
        self.idle_wait = _number(extra, "idle_wait", 0.01)
        self.disabled: str | None = None  # why the connector is inert, if it is
        self.address = address = _setting(extra, "address")
        if not address:
            self.disabled = "no sidecar address (kv_connector_extra_config.address or PROMPTCACHE_ADDRESS)"
        kv_dtype = mc.dtype if cc.cache_dtype in ("auto", None) else cc.cache_dtype
        self.fp8 = cc.cache_dtype in vllm_paged.FP8_FORMATS
        if self.fp8:
            # The raw bytes of an fp8 cache, stored as they are; which fp8 format they are is the cache dtype's
            # (plain "fp8" is the platform's: e4m3fn on CUDA, e4m3fnuz on some ROCm GPUs, which has no wire dtype).
            kv_dtype = vllm_paged.FP8_FORMATS[cc.cache_dtype]
            if cc.cache_dtype in ("fp8", "fp8_e4m3"):
                from vllm.platforms import current_platform

                if current_platform.fp8_dtype() != kv_dtype:
                    self.disabled = (f"fp8 KV cache in {current_platform.fp8_dtype()}: the chunk contract has "
                                     "float8_e4m3fn and float8_e5m2 only")
        kv_dtype_name = DTYPE_NAMES.get(kv_dtype) if isinstance(kv_dtype, torch.dtype) else None
        if kv_dtype_name is None:
            self.disabled = (f"KV cache dtype {cc.cache_dtype!r} ({kv_dtype}) is not float32, float16, bfloat16, "
                             "fp8 (e4m3) or fp8_e5m2")
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        total_heads, total_layers = mc.get_total_num_kv_heads(), mc.get_total_num_hidden_layers()
        # MLA (DeepSeek V2/V3, Kimi K2, GLM 4.5+): one latent vector per token and layer, the same on every TP rank:
        # chunks of kind "mla" [layers, 1, 1, tokens, latent], saved by TP rank 0 only, loaded by every rank.
        self.mla = bool(getattr(mc, "use_mla", False))
        if self.mla:
            total_heads = 1
        if total_heads % tp and not self.mla:
            self.disabled = (f"{total_heads} KV heads do not split over tensor parallel size {tp} (replicated KV heads "
                             "are not supported yet)")
        hf = mc.hf_text_config
        heads = hf.num_attention_heads
        from promptcache import codec

        self.rope_theta = codec.rope_theta_of(hf)  # k6v4z codes the keys with RoPE undone (codec.pack)
        quantization = str(_setting(extra, "quantization", "none"))
        if quantization != "none" and (self.fp8 or self.mla):
            self.disabled = (f"quantization {quantization!r} with {'an MLA model' if self.mla else 'an fp8 KV cache'}: "
                             "the quantization modes code float K/V heads; fp8 and MLA chunks are stored as they are "
                             "(set quantization none)")
            quantization = "none"
        # fp8: what the bytes mean depends on every layer's K and V scale, which only the workers see (loaded with the
        # weights). The keys carry the scales the deployment expects (request_salt kv_scales: docs/keys.md), from
        # the config alone so that the scheduler's Lookups and the workers' Puts and Gets use the same keys; each
        # worker checks its real scales against them when it registers its caches and stays inert if they differ.
        self.expected_scales: bytes | None = None  # scales_digest the keys carry (fp8)
        self.unit_scales = False  # expected: every scale 1.0 (vLLM's default when the checkpoint has none)
        if self.fp8 and not self.disabled:
            self.disabled = self._expect_scales(mc, cc, total_layers, pp)
        revision = _setting(extra, "revision")  # (given: the operator vouches that the engines compute the same K/V)
        if revision is None and role != KVConnectorRole.SCHEDULER:
            revision = "(the scheduler's)"  # a worker keys nothing itself: every spec comes with the metadata
        elif revision is None:
            revision, problem = engine_identity(vllm_config)
            if problem:
                self.disabled, revision = problem, "unidentified"
        revision = self._identity = str(revision)
        # A chunk that a Lookup found and that is evicted before the load: vLLM's default policy ("fail") fails the
        # request instead of recomputing the blocks.
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            self.disabled = (f"kv_load_failure_policy is {policy!r} (vLLM's default): a chunk evicted between the "
                             "Lookup and the load would fail the request; set \"kv_load_failure_policy\": "
                             "\"recompute\" in --kv-transfer-config")
        # Decode and prefill context parallelism interleave a request's tokens over the ranks' blocks (the scheduler's
        # block is block_size x ranks): no chunk describes a rank's share.
        dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
        if dcp > 1 or pcp > 1:
            self.disabled = (f"context parallelism (decode {dcp}, prefill {pcp}): each rank's blocks hold an "
                             "interleaved share of the tokens")
        # RL training: the trainer replaces the weights while the engine runs (vLLM's weight transfer), under the
        # identity computed here from the weights it started with.
        if getattr(vllm_config, "weight_transfer_config", None) is not None:
            self.disabled = ("weight transfer is configured (RL training): the weights change while the engine "
                             "runs, and the KV of one version would be served for another")
        tenant_salt = str(_setting(extra, "tenant_salt", "")).encode()
        if b"\0" in tenant_salt:  # the request's cache_salt is appended after a NUL: a NUL here would be ambiguous
            raise ValueError("kv_connector_extra_config.tenant_salt (or PROMPTCACHE_TENANT_SALT) must not contain "
                             "a NUL character")
        self.mm_content_hashed = mm_content_hashed(vllm_config)
        if self.expected_scales is not None:
            tenant_salt = request_salt(tenant_salt, kv_scales=self.expected_scales)
        self.base_spec = ModelSpec(
            model_id=str(_setting(extra, "model_id", mc.served_model_name or mc.model)),
            revision=revision,
            kv_dtype=kv_dtype_name or "float32",
            num_layers=total_layers,  # the whole model's: a rank's chunks are its shard of it (shard_spec)
            num_kv_heads=total_heads,
            head_dim=mc.get_head_size() or hf.hidden_size // heads,
            quantization=quantization,
            tenant_salt=tenant_salt,
            kv_kind="mla" if self.mla else "kv",
        ).validate()
        # Each rank stores and loads its own KV heads [r*H/tp, (r+1)*H/tp) of its pipeline stage's layers, under
        # keys that say so (docs/keys.md, "Request salt (v2)"); the scheduler looks up every rank's shard.
        from vllm.distributed.utils import get_pp_indices

        heads_of = (lambda r: (0, 1)) if self.mla else (lambda r: (r * total_heads // tp, (r + 1) * total_heads // tp))
        self.shards = [Shard(*heads_of(r), total_heads, *get_pp_indices(total_layers, p, pp), total_layers)
                       for p in range(pp) for r in range(tp)]
        self.lookup_shards = list(dict.fromkeys(self.shards))  # MLA: the TP ranks of a stage hold the same chunks
        self.shard = self.shards[0]
        self.saves = True  # whether this rank stores its chunks (MLA: TP rank 0 only, every rank loads)
        if role != KVConnectorRole.SCHEDULER and (tp > 1 or pp > 1):
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
            self.shard = self.shards[get_pp_group().rank_in_group * tp + tp_rank]
            self.saves = not (self.mla and tp_rank != 0)
        self.layout_desc = (f"TP {tp} x PP {pp}, this rank KV heads [{self.shard.head_start}, {self.shard.head_stop}) "
                            f"of {total_heads}, layers [{self.shard.layer_start}, {self.shard.layer_stop}) of "
                            f"{total_layers}")
        if self.mla:
            self.layout_desc += ", MLA latents" + ("" if self.saves else " (saved by TP rank 0, loaded here)")
        if self.expected_scales is not None:
            self.layout_desc += (", fp8 scales " + ("all 1.0" if self.unit_scales else "digest ")
                                 + ("" if self.unit_scales else self.expected_scales.hex()))
        self._rank_specs: dict[ModelSpec, ModelSpec] = {}
        if self.disabled is None and role == KVConnectorRole.SCHEDULER:
            # The scheduler promises vLLM loaded tokens, so it must know the workers can write them: the same probe
            # as register_kv_caches, from the config alone (the worker still checks its actual caches).
            self.disabled = self._check_layout_from_config(vllm_config)
        self.client = None
        self.chunk_tokens = 0
        self._breaker = _Breaker(self.retry_interval)
        self._stats_lock = threading.Lock()
        self._stats: dict[str, float] = {}
        if self.disabled is None:
            from promptcache.client import PromptCacheClient
            from promptcache.client.credentials import client_channel

            # Reconnect quickly to a sidecar restarted on the same address (gRPC's default backoff grows to 120 s).
            channel = client_channel(address, root_certificates=_setting(extra, "tls_ca"),
                                     token_file=_setting(extra, "token_file"),
                                     options=[("grpc.initial_reconnect_backoff_ms", 200),
                                              ("grpc.min_reconnect_backoff_ms", 200),
                                              ("grpc.max_reconnect_backoff_ms", 1000)])
            self.client = PromptCacheClient(
                address, timeout=self.load_timeout, retries=0, bulk_address=_setting(extra, "bulk_address"),
                tls_ca=_setting(extra, "tls_ca"), token_file=_setting(extra, "token_file"), channel=channel)
        # scheduler side
        self._lookups: dict[str, _Lookup] = {}
        self._lookup_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="promptcache-lookup")
        self._tracked: dict[str, _Tracked] = {}
        self._specs: dict[str, ModelSpec | None] = {}
        self._pending_loads: dict[str, _LoadOp] = {}
        # With vLLM's prefix cache on, a prefix another request is loading right now is not fetched twice: the
        # second request waits ("ask again later") until the first's load is done and vLLM's cache holds it.
        self._dedupe = bool(getattr(cc, "enable_prefix_caching", False))
        self._inflight: dict[bytes, tuple[str, float]] = {}  # prefix digest -> (loading request, since)
        self._inflight_of: dict[str, bytes] = {}
        # worker side
        self._kv_caches: list[torch.Tensor] = []
        self._layout: str | None = None
        self._paged: vllm_paged.PagedLayout | None = None  # vLLM's standard paged views (vllm_paged), else CPU's
        self._load_stream = None  # CUDA: the loads' own stream
        self._sleeping = False  # vLLM 0.33 sleep mode: the caches are released
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-load")
        self._fetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-fetch")
        self._load_lock = threading.Lock()
        self._load_done = threading.Condition(self._load_lock)  # notified when a load finishes
        self._loading: set[str] = set()
        self._loaded: set[str] = set()  # finished loads whose errors are reported, to report as finished recvs
        self._done: list[tuple[str, set[int]]] = []  # finished loads: (req id, failed block ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-save")
        # (0 would drop every save as "queue full": a pod that should only load says kv_role kv_consumer)
        self._slots = threading.BoundedSemaphore(_number(extra, "max_pending_saves", 8, positive=True, whole=True))
        # the save and load threads' page-locked host buffers (client/staging.py), each allocated at its first use
        # on a GPU and sized to what passed through it, up to staging_bytes
        staging_bytes = parse_bytes(_setting(extra, "staging_bytes", DEFAULT_CAPACITY), "staging_bytes")
        self._staging = HostStaging(staging_bytes)
        self._load_staging = HostStaging(staging_bytes)
        self._log_state()

    def _log_state(self, layout: str | None = None) -> None:
        # vLLM configures the "vllm" logger tree only: say it there too, so the state shows in vLLM's own log.
        spec = self.base_spec
        for logger in (log, _vllm_log):
            if self.disabled:
                logger.warning("PromptCacheConnector (%s) is INERT, every request is a normal prefill: %s",
                               self.role_name, self.disabled)
            else:
                logger.info("PromptCacheConnector (%s) is ACTIVE: sidecar %s, model %s revision %s, %s, "
                            "quantization %s, %s%s", self.role_name, self.address, spec.model_id, spec.revision,
                            spec.kv_dtype, spec.quantization, self.layout_desc,
                            f", KV block layout {layout}" + ("" if self._paged else " (probed)") if layout else "")

    def _inc(self, metric, key: str, n: float = 1, label: str | None = None) -> None:
        """Count on this process's promptcache_client_* metric and in the stats vLLM collects for its /metrics."""
        if not n:
            return
        (metric.labels(label) if label is not None else metric).inc(n)
        k = f"{key}:{label}" if label is not None else key
        with self._stats_lock:
            self._stats[k] = self._stats.get(k, 0) + n

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._stats_lock:
            counts, self._stats = self._stats, {}
        return PromptCacheStats(data={"counts": counts}) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PromptCacheStats(data=dict(data) if data is not None else {"counts": {}})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PromptCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _expect_scales(self, mc, cc, total_layers: int, pp: int) -> str | None:
        """Set the fp8 scales the keys carry from the config (setting kv_scales: "auto", "unit" or the 64-hex-digit
        scales_digest a worker logs); None, or why the connector stays inert."""
        from promptcache.contract.keys import scales_digest

        if getattr(cc, "calculate_kv_scales", False) or getattr(mc, "calculate_kv_scales", False):
            return ("fp8 KV scales computed at run time from the first batch (calculate_kv_scales): no two engines "
                    "share them, and they are not known when the keys are")
        setting = str(_setting(self._extra, "kv_scales", "auto")).strip().lower()
        if setting in ("auto", "unit"):
            qc = getattr(mc.hf_config, "quantization_config", None) or {}
            qc = qc if isinstance(qc, dict) else vars(qc)
            scheme = [k for k in ("kv_cache_scheme", "kv_cache_quant_algo", "kv_cache_group") if qc.get(k)]
            if setting == "auto" and scheme:
                return (f"the checkpoint's quantization config has {scheme[0]}: its fp8 KV scales are loaded with the "
                        "weights, in the workers; set kv_scales to the digest a worker logs (or \"unit\" if they "
                        "are all 1.0)")
            self.unit_scales = True
            self.expected_scales = scales_digest([1.0] * total_layers, [1.0] * total_layers)
            return None
        try:
            digest = bytes.fromhex(setting)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"kv_scales {setting!r} is not auto, unit or a 64-hex-digit scales digest")
        if pp > 1:
            return ("fp8 scales given as a digest with pipeline parallelism: a stage cannot check the scales of the "
                    "layers it does not hold (use kv_scales unit, or PP 1)")
        self.expected_scales = digest
        return None

    # Attention backends known to store fp8_e5m2 bytes for --kv-cache-dtype fp8_e5m2 (vLLM's C++ reshape_and_cache_flash
    # honours the string); vLLM 0.32's Triton writer (TRITON_ATTN) stores current_platform.fp8_dtype(), e4m3fn, for
    # every fp8 string, so under "fp8_e5m2" its bytes are not what the key names.
    E5M2_BACKENDS = ("FLASHINFER",)

    def _check_scales(self, names: list[str]) -> None:
        """Worker, fp8: this rank's layers' real K and V scales (vLLM's attention layers, loaded with the weights)
        against those the keys carry; Unsupported (inert, the digest to set in the log) if they differ, so a chunk
        is never stored or read under other scales. fp8_e5m2 also needs a backend that stores e5m2 bytes."""
        from promptcache.contract.keys import scales_digest

        ctx = getattr(self._vllm_config.compilation_config, "static_forward_context", None) or {}
        ks, vs = [], []
        for n in names:
            layer = ctx.get(n)
            if layer is None:
                raise vllm_paged.Unsupported(f"fp8 KV cache: no attention layer {n!r} to read its K/V scales from")
            if self.base_spec.kv_dtype == "float8_e5m2":
                backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: "unknown")()
                if backend not in self.E5M2_BACKENDS:
                    raise vllm_paged.Unsupported(
                        f"fp8_e5m2 KV cache with attention backend {backend} (layer {n!r}): vLLM's Triton cache writer "
                        "stores e4m3fn bytes for every fp8 dtype, so only backends known to store e5m2 "
                        f"({', '.join(self.E5M2_BACKENDS)}) are cached")
            scales = []
            for which in ("k", "v"):
                value = getattr(layer, f"_{which}_scale_float", None)
                if value is None and getattr(layer, f"_{which}_scale", None) is not None:
                    value = float(getattr(layer, f"_{which}_scale"))
                if value is None:
                    raise vllm_paged.Unsupported(f"fp8 KV cache: layer {n!r} has no {which.upper()} scale")
                scales.append(float(value))
            ks.append(scales[0])
            vs.append(scales[1])
        try:
            real = scales_digest(ks, vs)
        except ValueError as exc:
            raise vllm_paged.Unsupported(str(exc)) from None
        if self.unit_scales:
            if any(x != 1.0 for x in ks + vs):
                raise vllm_paged.Unsupported(f"fp8 KV scales are not all 1.0 (K {ks[:4]}..., V {vs[:4]}...); set "
                                             f"kv_scales to their digest {real.hex()} on every process")
        elif real != self.expected_scales:
            raise vllm_paged.Unsupported(f"fp8 KV scales digest {real.hex()} is not the configured kv_scales "
                                         f"{self.expected_scales.hex()}")

    def _rank_spec(self, spec: ModelSpec, shard: Shard | None = None) -> ModelSpec:
        """The spec of one rank's chunks of a request (shard_spec; the request's own spec at TP 1, PP 1)."""
        shard = shard or self.shard
        if shard.whole:
            return spec
        key = (spec, shard)
        got = self._rank_specs.get(key)
        if got is None:
            if len(self._rank_specs) > 4096:
                self._rank_specs.clear()
            got = self._rank_specs[key] = shard_spec(spec, shard)
        return got

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a pending or dropped save is a future miss, never a reason to recompute

    # ------------------------------------------------------------------------------------------------ helpers
    def _paged_mode(self, vllm_config) -> bool:
        """Whether the workers' caches are vLLM's standard paged views (vllm_paged: CUDA's attention backends) rather
        than the CPU backend's. Setting kv_layout: auto (the platform decides: paged on every platform but CPU),
        paged or cpu (to cross-check one against the other, and for tests on a CPU)."""
        mode = str(_setting(self._extra, "kv_layout", "auto"))
        if mode not in ("auto", "paged", "cpu"):
            raise ValueError(f"kv_layout {mode!r} is not auto, paged or cpu")
        if mode != "auto":
            return mode == "paged"
        from vllm.platforms import current_platform

        return not current_platform.is_cpu()

    def _paged_group(self):
        """The one KV cache group's spec from vLLM's KV cache config, or raise vllm_paged.Unsupported saying why the
        model's caches are not ones this connector stores (hybrid models with the hybrid allocator on, MLA,
        packed pages)."""
        kc = self._kv_cache_config
        if kc is None:
            raise vllm_paged.Unsupported("vLLM passed no KV cache config (vLLM < 0.32)")
        groups = [g for g in kc.kv_cache_groups if g.layer_names]
        if len(groups) != 1:
            kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
            raise vllm_paged.Unsupported(f"hybrid model: {len(groups)} KV cache groups ({kinds}); only one "
                                         "full-attention group is cached")
        spec = groups[0].kv_cache_spec
        name = type(spec).__name__
        if (name == "MLAAttentionSpec") != self.mla:
            raise vllm_paged.Unsupported(f"KV cache spec {name} for a{'n MLA' if self.mla else ' non-MLA'} model")
        if name == "MLAAttentionSpec":
            if getattr(spec, "alignment", None) or getattr(spec, "model_version", None) \
                    or getattr(spec, "index_head_dim", None):
                raise vllm_paged.Unsupported(f"MLA KV cache with padding or a sparse index ({spec})")
        elif name != "FullAttentionSpec":
            raise vllm_paged.Unsupported(f"KV cache spec {name} (only FullAttentionSpec is cached)")
        # A FullAttentionSpec with a sliding window or attention chunk is a hybrid model's local layers promoted to
        # full allocation (the hybrid allocator off, as vLLM turns it off for a connector that is not SupportsHMA):
        # blocks for every token, never freed below the window, so every token's K/V is in its block and cached.
        if getattr(spec, "tokens_per_state", 1) != 1 or getattr(spec, "num_head_slots", None) is not None \
                or getattr(spec, "state_content_bytes", None) is not None:
            raise vllm_paged.Unsupported(f"packed KV pages ({spec})")
        rank_heads = self.shard.head_stop - self.shard.head_start
        if spec.num_kv_heads != rank_heads or spec.head_size != self.base_spec.head_dim:
            raise vllm_paged.Unsupported(f"the KV cache spec has {spec.num_kv_heads} heads of {spec.head_size}, the "
                                         f"model {rank_heads} of {self.base_spec.head_dim} on this rank")
        if spec.block_size != self.block_size:
            raise vllm_paged.Unsupported(f"KV cache group block size {spec.block_size} != {self.block_size}")
        return groups[0], spec

    def _check_paged_config(self) -> str | None:
        try:
            self._paged_group()
        except vllm_paged.Unsupported as exc:
            return f"unsupported KV cache layout: {exc}"
        return None

    def _register_paged(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group, spec = self._paged_group()
        names = sorted((n for n in group.layer_names if n in kv_caches), key=layer_index)
        if len(names) != len(group.layer_names):
            raise vllm_paged.Unsupported(f"{len(group.layer_names) - len(names)} layers of the group have no cache")
        views = [kv_caches[n] for n in names]
        if len({v.data_ptr() for v in views}) != len(views):
            raise vllm_paged.Unsupported("layers share KV caches (cross-layer KV sharing)")
        if len(views) != self._rank_spec(self.base_spec).num_layers:
            raise vllm_paged.Unsupported(f"{len(views)} KV caches for {self._rank_spec(self.base_spec).num_layers} "
                                         "layers")
        cc = self._vllm_config.cache_config
        p = vllm_paged.plan(views, block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                            head_size=spec.head_size, head_size_v=spec.head_size_v,
                            kv_cache_dtype=str(cc.cache_dtype or "auto"), kind="mla" if self.mla else "kv",
                            engine_layout=getattr(cc, "kv_cache_layout", None))
        if p.dtype != TORCH_DTYPES[self.base_spec.kv_dtype]:
            raise vllm_paged.Unsupported(f"{p.dtype} KV caches for a {self.base_spec.kv_dtype} model spec")
        if self.fp8:
            self._check_scales(names)
        self._paged = p
        self._kv_caches = views
        self._layout = f"paged {p.order}" + (f", kernel blocks of {p.kernel_block_size}" if p.ratio > 1 else "")
        if views[0].device.type == "cuda":
            self._load_stream = torch.cuda.Stream(device=views[0].device)

    def _check_layout_from_config(self, vllm_config) -> str | None:
        """None when the workers' KV layout is one this connector knows, else why not."""
        try:
            if self._paged_mode(vllm_config):
                return self._check_paged_config()
            if self.fp8 or self.mla:
                return ("the CPU backend's path caches float32/float16/bfloat16 K/V only (fp8 and MLA caches on "
                        "vLLM's paged views: kv_layout paged)")
            if self._kv_cache_config is not None:
                self._paged_group()  # the same groups check (one group, every token's blocks kept) on the CPU
            spec = self.base_spec
            layout = probe_cpu_layout(TORCH_DTYPES[spec.kv_dtype], self.block_size,
                                      self.shard.head_stop - self.shard.head_start, spec.head_dim, vllm_config)
            return None if layout else "the CPU backend wrote its probe in a layout this connector does not know"
        except Exception as exc:  # noqa: BLE001 - unknown means inert
            return f"cannot probe the KV layout: {exc}"

    def _spec(self, request) -> ModelSpec | None:
        """The request's chunk spec (request_spec), None when it carries an input that cannot be identified: then
        it is neither loaded nor stored, counted once per request."""
        req_id = request.request_id
        if req_id in self._specs:
            return self._specs[req_id]
        try:
            spec = request_spec(self.base_spec, request, self.mm_content_hashed)
        except Unidentifiable as exc:
            self._inc(UNIDENTIFIED, "unidentified", 1, exc.reason)
            _warn.warning(f"unidentified-{exc.reason}", "promptcache: request neither loaded nor stored: %s", exc)
            spec = None
        self._specs[req_id] = spec
        return spec

    def _failed(self, exc: Exception, what: str) -> None:
        reason = fallback_reason(exc)
        self._inc(FALLBACKS, "fallbacks", 1, reason)
        if reason in ("unavailable", "deadline"):
            self._breaker.failed()
        _warn.warning(f"fallback-{reason}", "promptcache: %s failed, full prefill (%s): %s", what, reason, exc)

    def _succeeded(self) -> None:
        if self._breaker.ok():
            self._inc(RECONNECTS, "reconnects")
            log.info("PromptCacheConnector: sidecar %s answers again", self.address)

    # ------------------------------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """A Lookup (metadata only) on a background thread: None ("ask again later") while it is in flight, for at
        most lookup_timeout; then the cached whole chunks beyond num_computed_tokens, loaded asynchronously by the
        workers. Never blocks the scheduler loop."""
        if self.disabled:
            return 0, False
        req_id = request.request_id
        st = self._lookups.get(req_id)
        if st is None or st.asked != num_computed_tokens:
            spec = self._spec(request)
            if spec is None:
                return 0, False
            tokens = prompt_tokens(request)[:-1]
            ct = self.chunk_tokens or self.block_size
            if len(tokens) < max(ct, num_computed_tokens + self.block_size):
                return 0, False
            if not self._breaker.allow():
                self._inc(FALLBACKS, "fallbacks", 1, "sidecar_down")
                return 0, False
            self._inc(LOOKUPS, "lookups")
            st = _Lookup(num_computed_tokens, time.monotonic(), None, spec, tokens)
            st.future = self._lookup_pool.submit(self._lookup, st)
            self._lookups[req_id] = st
        if st.hit is None:
            if not st.future.done():
                if time.monotonic() - st.started < self.lookup_timeout:
                    return None, False
                st.future.cancel()
                st.hit = 0
                self._failed(errors.DeadlineExceeded(f"no Lookup answer in {self.lookup_timeout}s"), "lookup")
            else:
                try:
                    st.hit = st.future.result()
                except Exception as exc:  # noqa: BLE001 - the cache must never fail a request
                    st.hit = 0
                    self._failed(exc, "lookup")
        if self.disabled or st.hit <= num_computed_tokens:
            return 0, False
        if self._dedupe:
            owner = self._inflight.get(self._prefix_digest(st))
            if owner is not None and owner[0] != req_id and time.monotonic() - owner[1] < self.load_timeout + 1:
                return None, False  # the same prefix is loading for another request: vLLM's cache will have it
        return st.hit - num_computed_tokens, True

    @staticmethod
    def _prefix_digest(st: _Lookup) -> bytes:
        from promptcache.contract.keys import fingerprint, tokens_to_bytes

        return hashlib.sha256(fingerprint(st.spec) + tokens_to_bytes(st.tokens[:st.hit])).digest()

    def update_connector_output(self, connector_output) -> None:
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._forget_inflight(req_id)

    def _forget_inflight(self, req_id: str) -> None:
        digest = self._inflight_of.pop(req_id, None)
        if digest is not None and self._inflight.get(digest, ("",))[0] == req_id:
            del self._inflight[digest]

    def _lookup(self, st: _Lookup) -> int:
        """Background thread: the cached tokens (whole chunks from 0) of the request's prompt but its last token, on
        every rank (the fewest of any rank's shard)."""
        cached = None
        for shard in self.lookup_shards:
            res = self.client.lookup(self._rank_spec(st.spec, shard), st.tokens, timeout=self.lookup_timeout)
            cached = res.cached_tokens if cached is None else min(cached, res.cached_tokens)
            if not cached:
                break
        self._succeeded()
        ct = res.chunk_tokens
        if ct <= 0:  # a sidecar that says so is broken: nothing it answers can be placed
            raise errors.PromptCacheError(f"the sidecar answered a Lookup with chunk_tokens {ct}")
        if not self.chunk_tokens:
            if ct % self.block_size:
                self.disabled = (f"sidecar chunk_tokens {ct} is not a multiple of the vLLM block size "
                                 f"{self.block_size}")
                self._log_state()
            self.chunk_tokens = ct
        elif ct != self.chunk_tokens:  # restarted with another chunk size: these keys are not its chunks
            raise errors.PromptCacheError(f"the sidecar's chunk_tokens changed from {self.chunk_tokens} to {ct}")
        if cached < 0 or cached % ct or cached > len(st.tokens):
            # vLLM would assert (more than the prompt) or wait for a load that cannot be placed, forever
            raise errors.PromptCacheError(f"the sidecar answered {cached} cached tokens for a Lookup of "
                                          f"{len(st.tokens)} in chunks of {ct}")
        return cached if not self.disabled else 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if self.disabled:
            return
        req_id = request.request_id
        tracked = self._tracked.get(req_id)
        if tracked is None:
            spec = self._spec(request)
            if spec is None:
                return  # unidentifiable: not tracked, so never saved
            tracked = self._tracked[req_id] = _Tracked(request, spec)
        st = self._lookups.pop(req_id, None)
        if num_external_tokens <= 0:
            if tracked.loaded_chunks and 0 < request.num_computed_tokens and self.chunk_tokens:
                # Back from a load that failed part way on some rank (evicted between the Lookup and that rank's
                # Get, ...): vLLM truncated the request at the first invalid block and recomputes from there on
                # every rank. Those chunks are saved with the rest: the rank that lost its chunk stores it again
                # (the others' Puts of keys they hold are skipped), instead of the prefix being a partial hit for
                # the next requests until one of them stores it.
                tracked.loaded_chunks = min(tracked.loaded_chunks, request.num_computed_tokens // self.chunk_tokens)
            return
        ct = self.chunk_tokens
        block_ids = blocks.get_block_ids()[0]
        if st is None or not st.hit or not ct or st.hit - num_external_tokens < st.asked \
                or (st.hit - num_external_tokens) % self.block_size or st.hit % ct:
            asked = st.asked if st is not None else request.num_computed_tokens
            log.warning("promptcache: vLLM asked to load %d tokens from %d, which no Lookup of this connector "
                        "answered; they are reported failed (recomputed)", num_external_tokens, asked)
            # vLLM waits for them (an asynchronous load): a load with nothing to fetch reports their blocks failed
            first, last = asked // self.block_size, -(-(asked + num_external_tokens) // self.block_size)
            self._pending_loads[req_id] = _LoadOp(req_id, tracked.spec, [], list(block_ids[first:last]), 0, 0,
                                                  ct or self.block_size)
            return
        start, stop = st.hit - num_external_tokens, st.hit
        ids = list(block_ids[start // self.block_size:stop // self.block_size])
        first = start // ct
        self._pending_loads[req_id] = _LoadOp(req_id, st.spec, st.tokens[:stop], ids, first, start - first * ct, ct)
        if self._dedupe:
            digest = self._prefix_digest(st)
            self._inflight.setdefault(digest, (req_id, time.monotonic()))
            self._inflight_of[req_id] = digest
        tracked.loaded_chunks = stop // ct
        self._inc(REUSED_TOKENS, "reused_tokens", num_external_tokens)
        self._inc(HITS, "hits")

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = PromptCacheConnectorMetadata(loads=list(self._pending_loads.values()),
                                            idle=not scheduler_output.total_num_scheduled_tokens,
                                            lookups=any(st.hit is None for st in self._lookups.values()))
        self._pending_loads.clear()
        if self.disabled or not self.chunk_tokens:
            return meta
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.saved:
                continue
            request = tracked.request
            prompt = prompt_tokens(request)
            n_prompt = len(prompt)
            after = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if after < n_prompt:
                continue  # the prompt is not all computed yet (chunked prefill): save when it is
            tracked.saved = True
            ct = self.chunk_tokens
            n_chunks = n_prompt // ct
            if n_chunks <= tracked.loaded_chunks or self._kv_cache_manager is None:
                continue
            if not self._breaker.allow():
                self._inc(STORES, "stores", 1, "dropped")  # the sidecar is down: a save would only wait for its timeout
                continue
            block_ids = self._kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
            per_chunk = ct // self.block_size
            ids = block_ids[tracked.loaded_chunks * per_chunk:n_chunks * per_chunk]
            if len(ids) != (n_chunks - tracked.loaded_chunks) * per_chunk:
                continue
            ttl, priority = retention_hints(request)
            meta.saves.append(_SaveOp(req_id, tracked.spec, prompt[:n_chunks * ct], list(ids),
                                      tracked.loaded_chunks, ct, ttl, priority))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._specs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._forget_inflight(request.request_id)
        return False, None

    def reset_cache(self) -> bool:
        """vLLM resets the connector with its own prefix cache when a pause clears the caches (pause_generation's
        default, the release of the KV memory): the step RL trainers and weight reloads take before the engine runs
        other weights. What was stored before may be the old weights' KV, so from now on this engine's keys carry a
        fresh random part of the model's identity (an engine started from the same files still shares what was
        stored before: it is theirs), and nothing a request admitted before the reset computed is stored."""
        if self.disabled:
            return True
        digest = hashlib.sha256(self._identity.encode()).hexdigest()[:32]
        self.base_spec = replace(self.base_spec, revision=f"reset-{secrets.token_hex(8)} of {digest}")
        self._specs.clear()
        self._lookups.clear()  # (between steps: no Lookup answered here waits for its blocks)
        self._inflight.clear()
        self._inflight_of.clear()
        for tracked in self._tracked.values():
            tracked.saved = True
        log.warning("PromptCacheConnector (%s): cache reset by vLLM (a weight update or reload); chunks stored "
                    "before are no longer loaded by this engine, model revision now %r", self.role_name,
                    self.base_spec.revision)
        return True

    # ---------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.disabled:
            return
        try:
            if self._paged_mode(self._vllm_config):
                self._register_paged(kv_caches)
                self._log_state(self._layout)
                return
        except Exception as exc:  # noqa: BLE001 - an unknown layout means no cache, never a wrong one
            self.disabled = f"unsupported KV cache layout: {exc}"
            self._log_state()
            return
        try:
            if self.fp8 or self.mla:
                raise ValueError("the CPU backend's path caches float32/float16/bfloat16 K/V only")
            if self._kv_cache_config is not None:
                self._paged_group()  # one group, every token's blocks kept: as on a GPU
            names = sorted(kv_caches, key=layer_index)
            caches = [kv_caches[n] for n in names]
            spec = self._rank_spec(self.base_spec)
            N, H, D = self.block_size, spec.num_kv_heads, spec.head_dim
            dtype = TORCH_DTYPES[spec.kv_dtype]
            for n, c in zip(names, caches):
                if c.dim() != 4 or tuple(c.shape[1:]) != (H, N, 2 * D) or c.dtype != dtype or not c.is_contiguous():
                    raise ValueError(f"KV cache {n} is {tuple(c.shape)} {c.dtype}; the CPU backend's layout is "
                                     f"[blocks, {H}, {N}, {2 * D}] {dtype}")
            if len(caches) != spec.num_layers:
                raise ValueError(f"{len(caches)} KV caches for {spec.num_layers} layers")
            layout = probe_cpu_layout(dtype, N, H, D, self._vllm_config)
            if layout is None:
                raise ValueError("the CPU backend wrote its probe in a layout this connector does not know")
        except Exception as exc:  # noqa: BLE001 - an unknown layout means no cache, never a wrong one
            self.disabled = f"unsupported KV cache layout: {exc}"
            self._log_state()
            return
        self._layout = layout
        self._kv_caches = [c.view(c.shape[0], H, 2 * N * D) for c in caches]
        self._log_state(layout)

    # vLLM 0.33 sleep mode: the KV cache memory is released and mapped again at the same addresses on wake-up.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return True  # unregister_kv_caches drains the loads and stops them and the saves until restore_kv_caches

    def unregister_kv_caches(self) -> None:
        self._sleeping = True
        done = threading.Event()
        self._load_pool.submit(done.set)
        # A load in flight stops before its next write (_load checks _sleeping before each batch's write, and a
        # queued one before it starts): what is left to wait for is one fetch (load_timeout) and one write. A load
        # with several batches used to go on writing, one fetch after another, after this returned.
        if not done.wait(self.load_timeout + 5):
            log.error("PromptCacheConnector: a KV load still runs %.0f s after the caches were released",
                      self.load_timeout + 5)

    def restore_kv_caches(self) -> None:
        self._sleeping = False

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Queue this step's loads on the load thread; they run while the engine computes other requests (the
        requests loading wait in WAITING_FOR_REMOTE_KVS, their blocks are not in any forward pass) and finish
        through get_finished."""
        meta = self._connector_metadata
        if not isinstance(meta, PromptCacheConnectorMetadata) or not meta.loads:
            return
        for op in meta.loads:
            with self._load_lock:
                if op.req_id in self._loading:
                    continue
                self._loading.add(op.req_id)
            self._load_pool.submit(self._load, op)

    def _forget(self, spec: ModelSpec, tokens, start_chunk: int) -> None:
        """Delete this rank's cached chunks of `tokens` from `start_chunk` on after one of them failed its checks:
        the sidecar keeps a chunk whose bytes arrived intact (it cannot read a quantized chunk) and a Put skips a key
        it holds, so a damaged or forged chunk would fail every load of its prefix until it aged out. Queued on the
        save thread, ahead of the saves that will store the recomputed chunks in its place."""
        def delete() -> None:
            try:
                self.client.delete(spec, tokens, start_chunk=start_chunk)
            except Exception as exc:  # noqa: BLE001 - the next failed load tries again
                log.warning("promptcache: could not delete a corrupt cached prefix: %s", exc)
        try:
            self._pool.submit(delete)
        except RuntimeError:  # shut down
            pass

    def _load(self, op: _LoadOp) -> None:
        """Load thread: Get the chunks, check them, write them into the blocks; the blocks of chunks that did not
        come (evicted since the Lookup, sidecar down, corrupt) are reported as load errors: vLLM recomputes them.
        The chunks are fetched in up to LOAD_BATCHES Gets, the next one on the fetch thread while this one writes
        the last into the blocks (the write runs in C without the GIL): the fetch and the write overlap."""
        failed = set(op.block_ids)
        waited = written = 0.0
        fetched = False
        try:
            if self._sleeping:
                raise errors.PromptCacheError("the KV caches are released (sleep mode)")
            if self._layout is None:  # the scheduler's probe passed but these caches are not as probed: never
                raise errors.PromptCacheError("the worker's KV caches are not in a probed layout")  # guess
            n = len(op.tokens) // op.chunk_tokens - op.first_chunk
            if n <= 0:
                raise errors.PromptCacheError("a load with nothing to fetch: its blocks are recomputed")
            if not self._breaker.allow():
                raise errors.Unavailable(f"sidecar {self.address} is down (retrying every {self.retry_interval}s)")
            spec = self._rank_spec(op.spec)
            per_chunk = op.chunk_tokens // self.block_size
            step = max(1, -(-n // LOAD_BATCHES))
            batches = [(op.first_chunk + j, min(step, n - j)) for j in range(0, n, step)]

            def fetch(start: int, count: int) -> list[torch.Tensor]:
                blobs = self.client.get_blobs(spec, op.tokens, start_chunk=start, max_chunks=count,
                                              timeout=self.load_timeout, copy=True, keep_sealed=True)
                try:
                    return checked_chunks(spec, blobs, op.chunk_tokens)
                except errors.CorruptChunk:
                    self._forget(spec, op.tokens, start)
                    raise

            got_blocks = 0
            pending = self._fetch_pool.submit(fetch, *batches[0])
            for k, (start, count) in enumerate(batches):
                t0 = time.perf_counter()
                try:
                    chunks = pending.result()
                except Exception as exc:  # noqa: BLE001 - what was written before stays: only the rest fails
                    if k == 0:
                        raise
                    self._failed(exc, "load")
                    break
                finally:
                    waited += time.perf_counter() - t0
                if k == 0:
                    fetched = True
                    self._succeeded()
                pending = (self._fetch_pool.submit(fetch, *batches[k + 1])
                           if len(chunks) == count and k + 1 < len(batches) else None)
                if self._sleeping:  # the caches were released (unregister_kv_caches) while this load ran: no
                    # write into them, and every block of the load is reported failed (their KV is gone anyway)
                    raise errors.PromptCacheError("the KV caches were released (sleep mode) during the load")
                skip = op.skip if k == 0 else 0
                first_block = got_blocks
                blocks = max(0, min(len(op.block_ids) - first_block, len(chunks) * per_chunk - skip // self.block_size))
                if blocks:
                    t1 = time.perf_counter()
                    ids = op.block_ids[first_block:first_block + blocks]
                    if self._paged is not None:
                        self._write_paged(chunks, skip, ids)
                    else:
                        vllm_layout.write_chunks(self._kv_caches, chunks, skip, ids, self._layout, self.block_size)
                    written += time.perf_counter() - t1
                    got_blocks += blocks
                if pending is None:
                    break
            failed = set(op.block_ids[got_blocks:])
            if failed:
                self._inc(FALLBACKS, "fallbacks", 1, "evicted")
            self._inc(LOADED_TOKENS, "loaded_tokens", got_blocks * self.block_size)
        except Exception as exc:  # noqa: BLE001 - a failed load is a recompute, never an engine error
            self._failed(exc, "load")
        finally:
            if fetched:
                FETCH_SECONDS.observe(waited)  # the time this thread waited for chunks (the rest overlapped writes)
            if written:
                LOAD_SECONDS.observe(written)
            if failed:
                self._inc(LOAD_ERRORS, "load_error_blocks", len(failed))
            with self._load_lock:
                self._done.append((op.req_id, failed))
                self._load_done.notify_all()

    def _write_paged(self, chunks: list[torch.Tensor], skip: int, block_ids: list[int]) -> None:
        """Load thread: chunks into the blocks of vLLM's paged views; on CUDA on the loads' own stream, each chunk
        to the device through the page-locked load buffer (staging.uploads), finished (synchronized) before the
        load is reported, so no forward pass reads a block before it is written."""
        if self._load_stream is None:
            vllm_paged.scatter_chunks(self._kv_caches, self._paged, chunks, skip, block_ids)
            return
        try:
            with torch.cuda.stream(self._load_stream):
                with self._load_staging.uploads(chunks, self._load_stream.device) as upload:
                    vllm_paged.scatter_chunks(self._kv_caches, self._paged, chunks, skip, block_ids, upload)
        finally:
            # Also when a chunk's upload or scatter fails part way (a device allocation that fails under vLLM's
            # memory use): the scatters already queued still write into the blocks, and the load must not be
            # reported (failed blocks recomputed, or freed with an aborted request and given to another) before.
            self._load_stream.synchronize()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The failed blocks of every load finished so far; their requests are reported finished by get_finished
        from now on (so a request's failed blocks are never reported after the request)."""
        with self._load_lock:
            done, self._done = self._done, []
            failed = set()
            for req_id, blocks in done:
                failed |= blocks
                self._loading.discard(req_id)
                self._loaded.add(req_id)
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished loads (finished recvs). A load with failed blocks is reported only after
        get_block_ids_with_load_errors has handed vLLM its blocks (whichever of the two vLLM calls first).
        In a step that computes nothing while loads are in flight, waits up to idle_wait (10 ms) for one to
        finish: an engine with nothing else to do then sleeps instead of running empty steps back to back, whose
        Python holds the GIL that the load thread needs between its socket reads (measured on the CPU backend:
        a 2k-token load took 0.15-0.3 s of wall clock for 0.03 s of its thread's CPU without the wait)."""
        meta = self._connector_metadata
        idle = isinstance(meta, PromptCacheConnectorMetadata) and meta.idle
        with self._load_lock:
            if idle and self.idle_wait > 0 and self._loading and not self._done:
                self._load_done.wait(self.idle_wait)
            elif idle and self.idle_wait > 0 and meta.lookups and not self._loading:
                # Only Lookups in flight: a short sleep lets the Lookup thread (in this process when vLLM runs
                # the scheduler and the worker in one) read its answer.
                self._load_done.wait(min(self.idle_wait, 0.002))
            keep = []
            for req_id, blocks in self._done:
                if blocks:
                    keep.append((req_id, blocks))
                else:
                    self._loading.discard(req_id)
                    self._loaded.add(req_id)
            self._done = keep
            recv, self._loaded = self._loaded, set()
        return None, (recv or None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a loading request is in no forward pass until get_finished reports it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saved once per step in wait_for_save, when every layer of the prompt is written

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, PromptCacheConnectorMetadata) or not meta.saves or self._layout is None \
                or self._sleeping or not self.saves:
            return
        for op in meta.saves:
            if not self._slots.acquire(blocking=False):
                self._inc(STORES, "stores", 1, "dropped")
                _warn.warning("store-dropped", "promptcache: save queue full, dropping a save")
                continue
            t0 = time.perf_counter()
            ready = None
            if self._paged is not None:
                # Canonical K/V straight from the blocks, on the cache's device and stream (after this step's
                # writes); on CUDA the save thread waits for the event, not this thread.
                snapshot = vllm_paged.gather(self._kv_caches, self._paged, op.block_ids)
                if snapshot.device.type == "cuda":
                    ready = torch.cuda.Event()
                    ready.record()
            else:
                index = torch.tensor(op.block_ids, dtype=torch.long)
                snapshot = torch.stack([cache.index_select(0, index) for cache in self._kv_caches])
            SAVE_COPY_SECONDS.observe(time.perf_counter() - t0)
            self._pool.submit(self._save, op, snapshot, ready)

    def _save(self, op: _SaveOp, snapshot: torch.Tensor, ready=None) -> None:
        t0 = time.perf_counter()
        try:
            if not self._breaker.allow():
                self._inc(STORES, "stores", 1, "dropped")
                return
            if self._paged is not None:
                if ready is not None:
                    ready.synchronize()
                kv = snapshot  # already canonical [L, 2, H, T, D] (MLA [L, 1, 1, T, latent]), on the device
            else:
                L, nb, H, _ = snapshot.shape
                kv = torch.empty((L, 2, H, nb * self.block_size, self.base_spec.head_dim), dtype=snapshot.dtype)
                for layer in range(L):
                    vllm_layout.read_layer(snapshot[layer], kv[layer], self._layout, self.block_size)
            spec = self._rank_spec(op.spec)
            # A save larger than the staging buffer goes through it in parts, a Put each (in order: a part that
            # fails ends the save). The chunks may be views of the buffer: they are used (packed or Put) inside
            # the block only.
            for part in self._staging.parts(kv, op.chunk_tokens):
                with self._staging.chunks(kv[:, :, :, part], op.chunk_tokens) as chunks:
                    if spec.quantization != "none":
                        from promptcache import codec

                        chunks = [codec.pack(spec.quantization, c, self.rope_theta) for c in chunks]
                    first = op.first_chunk + part.start // op.chunk_tokens
                    blobs = {first + i: c for i, c in enumerate(chunks)}
                    self.client.put_blobs(spec, op.tokens, blobs, timeout=self.save_timeout,
                                          ttl_seconds=op.ttl_seconds, priority=op.priority)
            self._succeeded()
            self._inc(STORES, "stores", 1, "ok")
            SAVE_SECONDS.observe(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            self._inc(STORES, "stores", 1, "error")
            if fallback_reason(exc) in ("unavailable", "deadline"):
                self._breaker.failed()
            _warn.warning("store-error", "promptcache: save failed: %s", exc)
        finally:
            self._slots.release()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued saves and loads (for tests and shutdown)."""
        done = threading.Event()
        self._pool.submit(done.set)
        ok = done.wait(timeout)
        loaded = threading.Event()
        self._load_pool.submit(loaded.set)
        return ok and loaded.wait(timeout)

    def shutdown(self):
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._load_pool.shutdown(wait=True)
        self._fetch_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._staging.close()
        self._load_staging.close()
        if self.client is not None:
            self.client.close()


def probe_cpu_layout(dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int, vllm_config) -> str | None:
    """Write probe values into a scratch block through the CPU backend's own cache-write kernel: which layout?"""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    N, H, D = block_size, num_kv_heads, head_dim
    isa = _get_attn_isa(dtype, N, D, vllm_config.cache_config.cache_dtype)
    cache = torch.zeros(2, H, N, 2 * D, dtype=dtype)
    key_cache, value_cache = cache.view(2, H, 2 * N, D).chunk(2, dim=2)
    slots = torch.arange(N, 2 * N)  # block 1
    seen = []
    for values in (torch.arange(N).view(N, 1, 1).expand(N, H, D), torch.arange(D).view(1, 1, D).expand(N, H, D)):
        x = values.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(x, x.clone(), key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        for h in range(H):  # every head must agree
            region = cache[1, h].reshape(-1)
            seen.append((h, region[:N * D].clone(), region[N * D:].clone()))
    found = set()
    for h in range(H):
        (_, kt, vt), (_, kd, vd) = seen[h], seen[H + h]
        found.add(vllm_layout.identify(kt, kd, vt, vd, N, D))
    return found.pop() if len(found) == 1 else None
