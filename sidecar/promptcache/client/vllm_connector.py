"""vLLM v1 KV connector: vLLM reuses prompt prefixes from the node-local PromptCache sidecar (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PromptCacheConnector",
        "kv_connector_module_path": "promptcache.client.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "unix:///run/promptcache/grpc.sock",
                                      "bulk_address": "unix:/run/promptcache/bulk.sock"}}'

What happens to a request:

1. **Scheduler, lookup and fetch** (``get_num_new_matched_tokens``, bounded by ``load_timeout``): a Get of the longest
   run of cached whole chunks of the prompt, never the last prompt token (one is always left to compute). The chunks
   are checked (transit checksum, length, finite values or quantization checks) before vLLM is told how many tokens
   it can skip; anything wrong, slow or down means 0 (a normal prefill), counted in
   ``promptcache_client_fallbacks_total{reason}``. Hits are whole chunks, and chunks are whole vLLM blocks.
2. **Worker, load** (``start_load_kv``, before the forward pass): the fetched chunks are written into the request's
   blocks in the attention backend's own layout.
3. **Worker, save** (``wait_for_save`` of the step that finishes the prompt): the request's new whole prompt chunks
   are copied out of their blocks (one copy) and handed to a background thread that converts them to the canonical
   chunk layout and Puts them. The queue is bounded: when it is full the save is dropped and counted, never blocking.

The fingerprint (promptcache.contract.keys.ModelSpec) comes from the engine's config: model id (served name), revision (the
configured revision, else a digest of the weight files), KV dtype, layers, KV heads, head dim, the quantization mode;
vLLM's per-request ``cache_salt`` is the tenant salt, so salted requests share only with the same salt.

Layouts: vLLM's CPU attention backend is supported (fp32/fp16 "vec" and bf16 AMX); the layout is not assumed but
measured once at start-up by writing probe values through the backend's own cache-write kernel
(promptcache.client.vllm_layout.identify). Any other backend, an fp8 KV cache or a layout the probe does not recognise is
logged once and the connector stays inert: every request is a normal prefill. A chunk is never stored or served in
a layout that was not identified.

Settings (``kv_connector_extra_config`` key, else environment variable):

=================  ===============================  ==========================================================
key                environment                      meaning
=================  ===============================  ==========================================================
address            PROMPTCACHE_ADDRESS              sidecar gRPC address (HOST:PORT or unix:///PATH); required
bulk_address       PROMPTCACHE_BULK_ADDRESS         the sidecar's --bulk-address, for Get (faster); optional
quantization       PROMPTCACHE_QUANTIZATION         none (bit-exact, default), k8v8, k8v4, k6v4z
tenant_salt        PROMPTCACHE_TENANT_SALT          salt for every request without a cache_salt of its own
model_id           PROMPTCACHE_MODEL_ID             model identity in the fingerprint (default: served name)
revision           PROMPTCACHE_REVISION             weights identity (default: model revision, else weights digest)
load_timeout       PROMPTCACHE_LOAD_TIMEOUT         seconds for one request's fetch (default 1.0)
save_timeout       PROMPTCACHE_SAVE_TIMEOUT         seconds for one background Put (default 30)
max_pending_saves  PROMPTCACHE_MAX_PENDING_SAVES    saves queued at most; more are dropped (default 8)
tls_ca, token_file PROMPTCACHE_TLS_CA, ..._TOKEN_FILE  TLS CA (PEM path) and bearer token file (docs/security.md)
=================  ===============================  ==========================================================
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from promptcache.client import vllm_layout
from promptcache.client import errors
from promptcache.client.client import checked_chunks
from promptcache.client.hf import _warn, fallback_reason
from promptcache.client.metrics import (FALLBACKS, FETCH_SECONDS, HITS, LOAD_SECONDS, REUSED_TOKENS,
                                        SAVE_COPY_SECONDS, SAVE_SECONDS, STORES, UNIDENTIFIED)
from promptcache.contract.keys import Adapter, ModelSpec, MultiModalItem, request_salt
from promptcache.contract.layout import DTYPE_NAMES, TORCH_DTYPES

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402 - vLLM is this module's host
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("promptcache.client.vllm")



def _setting(extra: dict, key: str, default=None):
    value = extra.get(key)
    if value is None:
        value = os.environ.get("PROMPTCACHE_" + key.upper())
    return default if value is None or value == "" else value


def weights_digest(model_dir: str) -> str:
    """A cheap identity of local weight files: names, sizes and the first and last MiB of each (like a GGUF digest)."""
    path = Path(model_dir)
    files = sorted(p for p in path.glob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".gguf")) if path.is_dir() \
        else ([path] if path.is_file() else [])
    if not files:
        return ""
    h = hashlib.sha256()
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return "weights-" + h.hexdigest()[:32]


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


def adapter_digest(path: str) -> bytes:
    """SHA-256 over an adapter's files (relative names, sizes and all bytes), cached per (path, names, sizes, mtimes):
    computed once per adapter and process. Raises Unidentifiable when there are no files to read."""
    root = Path(path)
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else ([root] if root.is_file() else [])
        stamp = (str(root), tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    except OSError as exc:
        raise Unidentifiable("lora", f"cannot read LoRA adapter {path!r}: {exc}") from None
    if not files:
        raise Unidentifiable("lora", f"LoRA adapter path {path!r} has no files to digest")
    with _ADAPTER_LOCK:
        digest = _ADAPTER_DIGESTS.get(stamp)
    if digest is None:
        h = hashlib.sha256(b"promptcache/adapter/v1\0")
        try:
            for p in files:
                name = str(p.relative_to(root)) if root.is_dir() else p.name
                h.update(f"{len(name)}:{name}:{p.stat().st_size}:".encode())
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


def request_spec(base: ModelSpec, request) -> ModelSpec:
    """The spec of a vLLM request's chunks: the engine's model spec with the request's own salt: its cache_salt (v1,
    as before), then (v2, docs/keys.md "Request salt") its LoRA adapter (name and weights digest), its multimodal
    items (vLLM's per-item hash and placeholder range, in prompt order) and its prompt embeddings. Raises
    Unidentifiable for an input it cannot identify. Pure but for the adapter files it reads once."""
    from dataclasses import replace

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


def prompt_tokens(request) -> list[int]:
    """The token ids the chunk keys are computed over: the prompt's, or (prompt embeddings only) vLLM's placeholder
    zeros, whose identity is in the salt."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return list(ids)
    n = int(getattr(request, "num_prompt_tokens", 0) or 0)
    return [0] * n


@dataclass
class _Load:
    """A fetched prefix: checked canonical chunks [layers, 2, H, chunk_tokens, D] (views of the received blobs: lent
    read-only mappings or the client's own copies), the first starting at prompt token `first`; vLLM may load
    tokens [start, stop) of them."""

    first: int
    start: int
    stop: int
    chunks: list[torch.Tensor]


@dataclass
class _LoadOp:
    req_id: str
    block_ids: list[int]  # the blocks of the tokens to load
    chunks: list[torch.Tensor]  # canonical chunks holding them,
    skip: int  # from this token of the first chunk on (whole blocks)


@dataclass
class _SaveOp:
    req_id: str
    spec: ModelSpec
    tokens: list[int]  # the prompt's whole chunks
    block_ids: list[int]  # blocks of chunks [first_chunk, len(tokens) / chunk_tokens)
    first_chunk: int
    chunk_tokens: int


@dataclass
class PromptCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[_LoadOp] = field(default_factory=list)
    saves: list[_SaveOp] = field(default_factory=list)


@dataclass
class _Tracked:
    request: Any
    spec: ModelSpec
    loaded_chunks: int = 0
    saved: bool = False


class PromptCacheConnector(KVConnectorBase_V1):
    """KV connector between a vLLM engine and the node-local PromptCache sidecar (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        self.block_size = cc.block_size
        self.load_timeout = float(_setting(extra, "load_timeout", 1.0))
        self.save_timeout = float(_setting(extra, "save_timeout", 30.0))
        self.disabled: str | None = None  # why the connector is inert, if it is
        address = _setting(extra, "address")
        if not address:
            self.disabled = "no sidecar address (kv_connector_extra_config.address or PROMPTCACHE_ADDRESS)"
        kv_dtype = mc.dtype if cc.cache_dtype in ("auto", None) else cc.cache_dtype
        kv_dtype_name = DTYPE_NAMES.get(kv_dtype) if isinstance(kv_dtype, torch.dtype) else None
        if kv_dtype_name is None:
            self.disabled = f"KV cache dtype {cc.cache_dtype!r} ({kv_dtype}) is not float32, float16 or bfloat16"
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            self.disabled = "tensor or pipeline parallelism is not supported yet"
        hf = mc.hf_text_config
        heads = hf.num_attention_heads
        from promptcache.contract import quant

        self.rope_theta = quant.rope_theta_of(hf)  # k6v4z codes the keys with RoPE undone (quant.pack)
        self.base_spec = ModelSpec(
            model_id=str(_setting(extra, "model_id", mc.served_model_name or mc.model)),
            revision=str(_setting(extra, "revision", mc.revision or weights_digest(mc.model))),
            kv_dtype=kv_dtype_name or "float32",
            num_layers=mc.get_num_layers(pc),
            num_kv_heads=mc.get_num_kv_heads(pc),
            head_dim=mc.get_head_size() or hf.hidden_size // heads,
            quantization=str(_setting(extra, "quantization", "none")),
            tenant_salt=str(_setting(extra, "tenant_salt", "")).encode(),
        ).validate()
        if self.disabled is None and role == KVConnectorRole.SCHEDULER:
            # The scheduler promises vLLM loaded tokens, so it must know the workers can write them: the same probe
            # as register_kv_caches, from the config alone (the worker still checks its actual caches).
            self.disabled = self._check_layout_from_config(vllm_config)
        self.client = None
        self.chunk_tokens = 0
        if self.disabled is None:
            from promptcache.client import PromptCacheClient

            self.client = PromptCacheClient(
                address, timeout=self.load_timeout, retries=1, bulk_address=_setting(extra, "bulk_address"),
                tls_ca=_setting(extra, "tls_ca"), token_file=_setting(extra, "token_file"))
        # scheduler side
        self._fetched: dict[str, tuple[int, _Load | None]] = {}  # req_id -> (num_computed_tokens asked, result)
        self._tracked: dict[str, _Tracked] = {}
        self._specs: dict[str, ModelSpec | None] = {}
        self._pending_loads: dict[str, _LoadOp] = {}
        # worker side
        self._kv_caches: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._layout: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-save")
        self._slots = threading.BoundedSemaphore(int(_setting(extra, "max_pending_saves", 8)))
        if self.disabled:
            log.warning("PromptCacheConnector is inert, every request is a normal prefill: %s", self.disabled)
        else:
            log.info("PromptCacheConnector: sidecar %s, model %s revision %s, %s, quantization %s", address,
                     self.base_spec.model_id, self.base_spec.revision, self.base_spec.kv_dtype,
                     self.base_spec.quantization)

    # ------------------------------------------------------------------------------------------------ helpers
    def _check_layout_from_config(self, vllm_config) -> str | None:
        """None when the workers' KV layout is one this connector knows, else why not."""
        try:
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                return f"attention backend of platform {current_platform.device_name!r} is not supported yet"
            spec = self.base_spec
            layout = probe_cpu_layout(TORCH_DTYPES[spec.kv_dtype], self.block_size, spec.num_kv_heads,
                                      spec.head_dim, vllm_config)
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
            spec = request_spec(self.base_spec, request)
        except Unidentifiable as exc:
            UNIDENTIFIED.labels(exc.reason).inc()
            _warn.warning(f"unidentified-{exc.reason}", "promptcache: request neither loaded nor stored: %s", exc)
            spec = None
        self._specs[req_id] = spec
        return spec

    def _chunk_tokens(self) -> int:
        if not self.chunk_tokens:
            ct = self.client.chunk_tokens  # a Stats call, once
            if ct % self.block_size:
                self.disabled = f"sidecar chunk_tokens {ct} is not a multiple of the vLLM block size {self.block_size}"
                log.warning("PromptCacheConnector is inert: %s", self.disabled)
            self.chunk_tokens = ct
        return self.chunk_tokens

    # ------------------------------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.disabled:
            return 0, False
        prev = self._fetched.get(request.request_id)
        if prev is not None and prev[0] == num_computed_tokens:
            load = prev[1]
            return (load.stop - num_computed_tokens if load else 0), False
        load = self._fetch(request, num_computed_tokens)
        self._fetched[request.request_id] = (num_computed_tokens, load)
        return (load.stop - num_computed_tokens if load else 0), False

    def _fetch(self, request, num_computed_tokens: int) -> _Load | None:
        t0 = time.perf_counter()
        try:
            ct = self._chunk_tokens()
            if self.disabled:
                return None
            spec = self._spec(request)
            if spec is None:
                return None
            prompt = prompt_tokens(request)
            usable = (len(prompt) - 1) // ct  # whole chunks, leaving at least one token to compute
            first = num_computed_tokens // ct
            if usable <= first:
                return None
            # Lent chunks stay the read-only mappings they are (they never change); anything else is the client's
            # own copy. The worker copies them into the blocks: the one pass over the bytes.
            blobs = self.client.get_blobs(spec, prompt[:usable * ct], start_chunk=first, max_chunks=usable - first,
                                          timeout=self.load_timeout, copy=True, keep_sealed=True)
            if not blobs:
                return None
            chunks = checked_chunks(spec, blobs, ct)
            if time.perf_counter() - t0 > self.load_timeout:
                raise errors.DeadlineExceeded(f"fetch took longer than {self.load_timeout}s")
            stop = (first + len(blobs)) * ct
            if stop <= num_computed_tokens:
                return None
            FETCH_SECONDS.observe(time.perf_counter() - t0)
            # vLLM already holds tokens [first * ct, num_computed_tokens) (a block-aligned local hit): not loaded.
            return _Load(first * ct, num_computed_tokens, stop, chunks)
        except Exception as exc:  # noqa: BLE001 - the cache must never fail a request
            reason = fallback_reason(exc)
            FALLBACKS.labels(reason).inc()
            _warn.warning(f"fallback-{reason}", "promptcache: falling back to full prefill (%s): %s", reason, exc)
            return None

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
        fetched = self._fetched.pop(req_id, None)
        if num_external_tokens <= 0 or fetched is None or fetched[1] is None:
            return
        load = fetched[1]
        start, stop = load.stop - num_external_tokens, load.stop
        if start < load.start or start % self.block_size:
            log.warning("promptcache: vLLM asked to load tokens [%d, %d) of a fetch of [%d, %d); not loading",
                        start, stop, load.start, load.stop)
            return
        block_ids = blocks.get_block_ids()[0]
        ids = block_ids[start // self.block_size:stop // self.block_size]
        ct = self.chunk_tokens
        skipped = (start - load.first) // ct
        self._pending_loads[req_id] = _LoadOp(req_id, list(ids), load.chunks[skipped:],
                                              start - load.first - skipped * ct)
        tracked.loaded_chunks = stop // self.chunk_tokens
        REUSED_TOKENS.inc(num_external_tokens)
        HITS.inc()

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = PromptCacheConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        if self.disabled:
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
            block_ids = self._kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
            per_chunk = ct // self.block_size
            ids = block_ids[tracked.loaded_chunks * per_chunk:n_chunks * per_chunk]
            if len(ids) != (n_chunks - tracked.loaded_chunks) * per_chunk:
                continue
            meta.saves.append(_SaveOp(req_id, tracked.spec, prompt[:n_chunks * ct],
                                      list(ids), tracked.loaded_chunks, ct))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._specs.pop(request.request_id, None)
        self._fetched.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.disabled:
            return
        try:
            names = sorted(kv_caches, key=layer_index)
            caches = [kv_caches[n] for n in names]
            spec = self.base_spec
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
            log.warning("PromptCacheConnector is inert, every request is a normal prefill: %s", self.disabled)
            return
        self._layout = layout
        self._kv_caches = [c.view(c.shape[0], H, 2 * N * D) for c in caches]
        log.info("PromptCacheConnector: %d layers, KV block layout %s (probed)", len(caches), layout)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PromptCacheConnectorMetadata) or not meta.loads:
            return
        for op in meta.loads:
            if self._layout is None:  # the scheduler's probe passed but these caches are not as probed: never
                self._load_errors.update(op.block_ids)  # write a guessed layout; vLLM recomputes these blocks
                continue
            t0 = time.perf_counter()
            # On vLLM's intra-op threads as it bound them (its CPU worker refuses torch.set_num_threads).
            vllm_layout.write_chunks(self._kv_caches, op.chunks, op.skip, op.block_ids, self._layout, self.block_size)
            LOAD_SECONDS.observe(time.perf_counter() - t0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saved once per step in wait_for_save, when every layer of the prompt is written

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, PromptCacheConnectorMetadata) or not meta.saves or self._layout is None:
            return
        for op in meta.saves:
            if not self._slots.acquire(blocking=False):
                STORES.labels("dropped").inc()
                _warn.warning("store-dropped", "promptcache: save queue full, dropping a save")
                continue
            t0 = time.perf_counter()
            index = torch.tensor(op.block_ids, dtype=torch.long)
            snapshot = torch.stack([cache.index_select(0, index) for cache in self._kv_caches])
            SAVE_COPY_SECONDS.observe(time.perf_counter() - t0)
            self._pool.submit(self._save, op, snapshot)

    def _save(self, op: _SaveOp, snapshot: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            L, nb, H, _ = snapshot.shape
            kv = torch.empty((L, 2, H, nb * self.block_size, self.base_spec.head_dim), dtype=snapshot.dtype)
            for layer in range(L):
                vllm_layout.read_layer(snapshot[layer], kv[layer], self._layout, self.block_size)
            chunks = vllm_layout.split_chunks(kv, op.chunk_tokens)
            if op.spec.quantization != "none":
                from promptcache.contract import quant

                chunks = [quant.pack(op.spec.quantization, c, self.rope_theta) for c in chunks]
            blobs = {op.first_chunk + i: c for i, c in enumerate(chunks)}
            self.client.put_blobs(op.spec, op.tokens, blobs, timeout=self.save_timeout)
            STORES.labels("ok").inc()
            SAVE_SECONDS.observe(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            STORES.labels("error").inc()
            _warn.warning("store-error", "promptcache: save failed: %s", exc)
        finally:
            self._slots.release()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued saves (for tests and shutdown)."""
        done = threading.Event()
        self._pool.submit(done.set)
        return done.wait(timeout)

    def shutdown(self):
        self._pool.shutdown(wait=True)
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
