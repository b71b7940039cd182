"""HF transformers integration: reuse cached prompt prefixes from the PromptCache sidecar around generation.

    from promptcache.client import PromptCacheClient
    from promptcache.client.hf import PromptCacheHF

    pc = PromptCacheHF(model, PromptCacheClient("unix:///run/promptcache.sock"), revision="weights-sha256...",
                       quantization="k8v4")
    out = pc.generate(input_ids, max_new_tokens=64)       # drop-in for model.generate(input_ids, ...)
    # or, around your own decoding loop:
    res = pc.prefill(input_ids)      # res.logits (last position), res.cache (a DynamicCache over all the tokens)

What happens on each request:

1. **Fetch** (critical path, bounded by ``fetch_timeout``): ``Lookup`` then ``Get`` of the longest run of cached whole
   chunks (at least one prompt token is always left to compute). Blobs are checked (transit checksum, length; for
   quantized modes the crc32, scales and zero points; for ``none`` that every value is finite) *before* they are turned
   into a fresh ``transformers.DynamicCache`` that this request owns (the tensors are copied into it, so nothing
   ``generate()`` mutates is shared with anything else).
2. **Compute** only the remaining tokens with that cache.
3. **Store** (off the critical path): the new whole chunks are snapshotted (one copy) and handed to a background
   thread that quantizes them (if the mode says so) and ``Put``s them; the caller never waits for it. The queue is
   bounded; when it is full the store is dropped and counted, never blocking.

A sidecar that is down, slow or returns bad bytes costs at most ``fetch_timeout`` and falls back to a full prefill:
a warning is logged and ``promptcache_client_fallbacks_total{reason}`` counts it; the request never fails because of
the cache. Nothing is fetched or stored (a plain prefill, counted the same way) where the chunks' keys could not name
everything the K/V depends on: a model whose cache does not keep every token (sliding-window, chunked or other
non-full attention layers: ``layer_types``), weights that cannot be identified (``identity``), PEFT adapters other
than those present when the identity was taken (``adapters``), model inputs besides the token ids (``model_kwargs``).
Without ``revision`` the identity is derived (``model_revision``): the hub commit transformers recorded, else a
digest of every parameter and buffer, plus a digest of the config.

Batch size 1 (one prompt per call); GQA, and fp32, fp16 and bf16 models, are handled by the ModelSpec (KV heads,
head dim and KV dtype are read from the model).

transformers 5.x: the cache is passed as ``cache`` where the model's forward takes it (5.24 on, where
``past_key_values`` is deprecated), else as ``past_key_values`` and built with ``DynamicCache(ddp_cache_data=..., config=model.config)``.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from promptcache.client import errors
from promptcache.client.client import PromptCacheClient, encode_chunk
from promptcache.client.metrics import COMPUTED_TOKENS, FALLBACKS, FETCH_SECONDS, REUSED_TOKENS, STORES
from promptcache.contract.keys import ModelSpec

log = logging.getLogger("promptcache.client.hf")


def cache_kwargs(model, cache) -> dict:
    """The cache as the keyword this transformers version takes: `cache` (5.24 on; `past_key_values` is deprecated
    there) or `past_key_values` (earlier 5.x)."""
    forward = inspect.signature(type(model).forward).parameters
    return {"cache": cache} if "cache" in forward else {"past_key_values": cache}


def output_cache(out):
    """The cache a forward pass returned, under either name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


_REASONS = {
    errors.Unavailable: "unavailable",
    errors.DeadlineExceeded: "deadline",
    errors.CorruptChunk: "corrupt",
}


class _RateLimitedLog:
    """Warn at most once per `interval` seconds per key (a sidecar that is down must not flood the logs); the
    metrics count every event."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self.interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            n = self._suppressed.pop(key, 0)
        log.warning(msg + (f" ({n} similar suppressed)" if n else ""), *args)


_warn = _RateLimitedLog()


def fallback_reason(exc: BaseException) -> str:
    for cls, reason in _REASONS.items():
        if isinstance(exc, cls):
            return reason
    if isinstance(exc, errors.PromptCacheError):
        return "error"
    return "client_bug"


@dataclass
class Prefix:
    """The cached prefix of one request: `cache` holds `cached_tokens` tokens (None when nothing was reused)."""

    cached_tokens: int = 0
    cache: object | None = None  # transformers.DynamicCache
    fallback: str | None = None  # reason, when the cache could not be used
    seconds: float = 0.0
    chunk_tokens: int = 0


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, logits_to_keep, vocab]
    cache: object  # DynamicCache over every input token
    cached_tokens: int
    computed_tokens: int
    fallback: str | None
    fetch_seconds: float
    compute_seconds: float
    store: Future | None = field(default=None, repr=False)


def _as_ids(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"PromptCacheHF handles one prompt at a time; input_ids has shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty")
    return ids


def cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) tensors [1, H, T, D] of a transformers Cache (DynamicCache in 5.x: .layers[i].keys)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return [(k, v) for k, v in cache]  # legacy tuple-of-tuples


def make_cache(model, kv) -> object:
    """A fresh DynamicCache that owns copies of `kv` (per-layer (K, V), each [1, H, T, D])."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv, config=model.config)


def adopt_cache(model, kv) -> object:
    """A DynamicCache over `kv` *without copying*: only for tensors nobody else holds (freshly decoded ones).

    Plain `DynamicLayer`s (every layer of a full-attention model) take the tensors as they are; any other layer
    type (sliding window, ...) gets them through its public `update()`, which copies.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        layer = cache.layers[i] if i < len(cache.layers) else None
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, i)
    return cache


def check_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` if transformers' caches can hold its chunks, else ValueError saying why: fp8 chunks (a vLLM fp8 KV
    cache's raw bytes, meaningful only with that engine's per-layer scales, which a chunk does not carry) and MLA
    latent chunks (transformers' caches hold each head's decompressed K and V, not the latent) are refused, never
    reinterpreted."""
    from promptcache.contract.keys import FP8_DTYPES

    if spec.kv_dtype in FP8_DTYPES:
        raise ValueError(f"{spec.kv_dtype} chunks (a vLLM fp8 KV cache's raw bytes, scaled per layer) cannot be used "
                         "by the transformers integration: it neither stores nor dequantizes fp8 KV")
    if spec.kv_kind != "kv":
        raise ValueError(f"{spec.kv_kind} (latent) chunks cannot be used by the transformers integration: its caches "
                         "hold K and V per head")
    return spec


def decode_prefix(spec: ModelSpec, blobs, chunk_tokens: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Blobs of consecutive chunks -> per-layer (K, V) [1, H, C*chunk_tokens, D], decoded straight into one buffer
    (one copy for mode none; quantized chunks are dequantized in place). CorruptChunk on any bad chunk; ValueError
    for fp8 or MLA chunks (check_spec)."""
    from promptcache import codec
    from promptcache.contract.layout import TORCH_DTYPES, chunk_nbytes, chunk_shape

    check_spec(spec)
    shape = chunk_shape(spec, chunk_tokens)
    expected = chunk_nbytes(spec, chunk_tokens)
    dtype = TORCH_DTYPES[spec.kv_dtype]
    L, _, H, ct, D = shape
    buf = torch.empty((L, 2, 1, H, len(blobs) * ct, D), dtype=dtype, device=device)
    for i, blob in enumerate(blobs):
        if blob.numel() != expected:
            raise errors.CorruptChunk(f"chunk {i} has {blob.numel()} bytes; this model's layout needs {expected}")
        dst = buf[:, :, 0, :, i * ct:(i + 1) * ct, :]
        if spec.quantization == "none":
            dst.copy_(blob.view(dtype).reshape(shape))
        else:
            try:
                codec.unpack(spec.quantization, blob, shape, spec.kv_dtype, out=dst)
            except codec.CorruptChunk as exc:
                raise errors.CorruptChunk(f"chunk {i}: {exc}") from None
    return [(buf[layer, 0], buf[layer, 1]) for layer in range(L)]


def uncacheable_layers(model) -> str | None:
    """Why this model's transformers cache does not keep every token's K/V at its position (so whole chunks cannot be
    cut from it by position), or None: sliding-window and chunked attention layers keep only their last window,
    others (linear attention, KV sharing, ...) hold no per-token K/V at all. From the config, the way transformers
    picks its cache layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("sliding_window", "attention_chunk_size"):
        if getattr(text, name, None):
            return f"{name} {getattr(text, name)} (its layers keep only the last window of tokens)"
    other = sorted({str(t) for t in getattr(text, "layer_types", None) or ()} - {"full_attention"})
    if other:
        return f"layer_types {other} (only full_attention layers keep every token)"
    try:
        odd = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers
                      if type(layer) is not DynamicLayer})
    except Exception as exc:  # noqa: BLE001 - a cache we cannot inspect is not cached
        return f"cannot build its cache from the config: {exc}"
    return f"cache layers {odd} (only DynamicLayer keeps every token)" if odd else None


def _json_default(obj):
    return sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else str(obj)


def _public(d):
    """A config dict without what does not change K/V: private keys (_name_or_path, _commit_hash, ...) and the
    transformers version, at every level."""
    if isinstance(d, dict):
        return {k: _public(v) for k, v in d.items() if not str(k).startswith("_") and k != "transformers_version"}
    return [_public(v) for v in d] if isinstance(d, (list, tuple)) else d


def weights_digest(model) -> str:
    """xxh3-128 over every byte of the model's state dict (parameters, persistent buffers, adapter weights) and its
    non-persistent buffers, with names, dtypes and shapes. Each tensor is copied to the CPU on its own, so it costs
    about one read of the weights (a 7B fp16 model: 14 GB, seconds on a GPU host), once per PromptCacheHF; an
    explicit revision skips it. Not collision-resistant against crafted weights: it needs not be, any client of a
    tenant can Put any bytes under any key. ValueError for weights whose bytes cannot be read (meta, offloaded)."""
    import xxhash

    h = xxhash.xxh3_128()
    state = model.state_dict()
    items = list(state.items()) + [(f"buffer:{n}", b) for n, b in model.named_buffers() if n not in state]
    for name, t in items:
        if not isinstance(t, torch.Tensor):  # e.g. a module's _extra_state
            h.update(f"{name}={t!r}\0".encode())
            continue
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (offloaded?): its bytes cannot be read")
        cpu = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{cpu.dtype}:{tuple(cpu.shape)}\0".encode())
        h.update(cpu.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def adapter_state(model) -> tuple | None:
    """The PEFT adapters the model computes with right now, None when none is loaded: the loaded adapters' names and,
    for every adapter layer, whether adapters are disabled, which are active and whether they are merged into the
    weights. A scan of every module on each request (0.4 ms for 30 layers here), so adapters however injected
    (peft.inject_adapter_in_model, model.load_adapter, PeftModel) are seen."""
    names = set()
    layers = set()
    count = 0
    for module in model.modules():
        config = module.__dict__.get("peft_config")
        if isinstance(config, dict):
            names.update(map(str, config))
        # looked up on the class first: a miss through nn.Module.__getattr__ costs microseconds per module
        off = getattr(module, "disable_adapters", None) if hasattr(type(module), "disable_adapters") else None
        if isinstance(off, bool):  # peft's BaseTunerLayer (a method, not a bool, on a transformers model)
            active = getattr(module, "active_adapters", ())
            active = (active,) if isinstance(active, str) else tuple(active)
            layers.add((off, active, bool(getattr(module, "merged", False))))
            count += 1
    if getattr(model, "_hf_peft_config_loaded", False):
        names.add("(transformers peft integration)")
    if not names and not count:
        return None
    return tuple(sorted(names)), count, tuple(sorted(layers))


def model_revision(model) -> str:
    """The fingerprint's revision for a model given none: what the weights are - the hub commit transformers recorded
    in the config (``_commit_hash``, earlier releases) or else a digest of every byte of them (weights_digest) - and a
    digest of the config (RoPE, windows, ... change K for the same weights) and of any PEFT adapters loaded now.
    The commit does not cover adapter weights, so with adapters loaded the weights are always digested."""
    adapters = adapter_state(model)
    commit = getattr(model.config, "_commit_hash", None)
    weights = f"commit-{commit}" if commit and adapters is None else f"weights-{weights_digest(model)}"
    described = {"config": _public(model.config.to_dict())}
    if adapters is not None:
        peft = {}
        for module in model.modules():
            for name, cfg in (module.__dict__.get("peft_config") or {}).items():
                peft[str(name)] = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg
        described["adapters"] = {"state": adapters, "configs": peft}
    text = json.dumps(described, sort_keys=True, default=_json_default)
    return f"{weights} config-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


# Model inputs prefill() passes on besides input_ids that cannot change any K/V (attention_mask: only all ones).
SAFE_MODEL_KWARGS = frozenset({"attention_mask", "output_attentions", "output_hidden_states"})
IGNORED_MODEL_KWARGS = frozenset({"use_cache", "return_dict"})  # prefill always needs both: it returns a cache
# generate() arguments that only steer decoding, never the prompt's K/V. Anything else (pixel_values, position_ids,
# inputs_embeds, token_type_ids, cache_implementation, assistant models, ...) is not cached.
SAFE_GENERATE_KWARGS = frozenset({
    "generation_config", "logits_processor", "stopping_criteria", "streamer", "synced_gpus", "tokenizer",
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "max_time", "stop_strings", "early_stopping",
    "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "num_beams", "num_return_sequences", "length_penalty", "repetition_penalty", "no_repeat_ngram_size",
    "bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "exponential_decay_length_penalty", "renormalize_logits", "remove_invalid_values",
    "pad_token_id", "eos_token_id", "bos_token_id", "return_dict_in_generate", "output_scores", "output_logits",
    "output_attentions", "output_hidden_states", "prefix_allowed_tokens_fn",
})


def unsafe_kwargs(kwargs: dict, safe: frozenset, n: int) -> list[str]:
    """The names in `kwargs` that may change K/V: not in `safe`, or an attention_mask other than n ones (padding)."""
    bad = sorted(k for k, v in kwargs.items() if k not in safe and v is not None)
    mask = kwargs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.numel() == n and bool((mask == 1).all())):
        bad.append("attention_mask (not all ones)")
    return bad


class PromptCacheHF:
    """Prefix reuse for one `transformers` causal LM through a PromptCache sidecar. Thread-safe.

    client: a PromptCacheClient, a target string ("unix:///path.sock", "host:port"), or None (cache disabled: every
    call is a plain prefill). quantization: "none" (bit-exact), "k8v8" or "k8v4" (part of the fingerprint).
    revision: identifies the weights (their digest or a revision the operator supplies); it is hashed into every key,
    so two different checkpoints never share chunks. Taken as given when set; else derived (model_revision, which
    reads every weight once). fetch_timeout: the whole budget of the fetch (Lookup + Get + decode) on the critical
    path. max_pending_stores: background stores queued at most; more are dropped.

    `disabled` is (reason, why) when this model is never cached (uncacheable_layers, unidentifiable weights): every
    request is then a plain prefill, counted as a fallback with that reason.
    """

    def __init__(self, model, client: PromptCacheClient | str | None, *, quantization: str = "none",
                 model_id: str | None = None, revision: str = "", tenant_salt: bytes = b"",
                 fetch_timeout: float = 1.0, store_timeout: float = 30.0, store: bool = True,
                 max_pending_stores: int = 8, verify_finite: bool = True):
        from promptcache import codec
        from promptcache.contract.layout import DTYPE_NAMES

        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = cfg.num_attention_heads
        if getattr(cfg, "kv_lora_rank", None):
            raise ValueError(f"{cfg.model_type}: an MLA model (kv_lora_rank {cfg.kv_lora_rank}); the transformers "
                             "integration does not cache MLA models (their chunks are vLLM's latents)")
        if model.dtype not in DTYPE_NAMES or DTYPE_NAMES[model.dtype] not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"model dtype {model.dtype}: the transformers integration caches float32, float16 and "
                             "bfloat16 K/V only (fp8 chunks are a vLLM fp8 KV cache's raw bytes)")
        self.model = model
        self.disabled: tuple[str, str] | None = None
        why = uncacheable_layers(model)
        if why:
            self.disabled = ("layer_types", why)
        self._adapters = adapter_state(model)  # the adapters the identity stands for
        if not revision and not self.disabled:
            try:
                revision = model_revision(model)
            except Exception as exc:  # noqa: BLE001 - unidentified weights are not cached
                self.disabled = ("identity", f"cannot identify the weights ({exc}); pass revision=")
        if self.disabled:
            log.warning("promptcache: %s is never cached (%s): %s", type(model).__name__, *self.disabled)
        self.spec = ModelSpec(
            model_id=model_id or getattr(cfg, "_name_or_path", "") or cfg.model_type,
            revision=revision, kv_dtype=DTYPE_NAMES[model.dtype], num_layers=cfg.num_hidden_layers,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            quantization=quantization, tenant_salt=tenant_salt).validate()
        check_spec(self.spec)
        self.rope_theta = codec.rope_theta_of(cfg)  # k6v4z codes the keys with RoPE undone (codec.pack)
        self._owns_client = isinstance(client, str)
        self.client = PromptCacheClient(client, timeout=fetch_timeout, retries=1) if isinstance(client, str) else client
        self.fetch_timeout = fetch_timeout
        self.store_timeout = store_timeout
        self.store_enabled = store
        self.verify_finite = verify_finite
        self._max_pending_stores = max_pending_stores
        self._start_store_thread()
        self._chunk_tokens: int | None = None  # learnt from the sidecar's Lookup answers
        _INSTANCES.add(self)

    def _start_store_thread(self) -> None:
        """The store thread and what it shares with callers. Started again in a child forked from this process (the
        parent's thread is not there: every store would wait in its queue for good, and flush() never return)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-store")
        self._slots = threading.BoundedSemaphore(self._max_pending_stores)
        self._pending: set[Future] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------- fetch
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def uncacheable(self, model_kwargs: dict | None = None, safe: frozenset = SAFE_MODEL_KWARGS,
                    n: int = 0) -> tuple[str, str] | None:
        """(reason, why) when this request must neither load nor store, else None."""
        if self.disabled:
            return self.disabled
        if adapter_state(self.model) != self._adapters:
            return ("adapters", "the model's PEFT adapters changed since its identity was taken (construct a new "
                                "PromptCacheHF for the adapted model)")
        bad = unsafe_kwargs(model_kwargs or {}, safe, n)
        if bad:
            return ("model_kwargs", f"inputs besides the token ids, not in the chunks' keys: {', '.join(bad)}")
        return None

    def _refuse(self, why: tuple[str, str]) -> str:
        reason, detail = why
        FALLBACKS.labels(reason).inc()
        _warn.warning(f"fallback-{reason}", "promptcache: not caching this request, full prefill (%s): %s", reason,
                      detail)
        return reason

    def fetch(self, input_ids) -> Prefix:
        """The longest cached whole-chunk prefix of `input_ids` (leaving at least one token to compute)."""
        ids = _as_ids(input_ids)
        why = self.uncacheable() if self.client is not None else None
        return Prefix(fallback=self._refuse(why)) if why else self._fetch(ids)

    def _fetch(self, ids) -> Prefix:
        if self.client is None or ids.shape[1] < 2:
            return Prefix()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.fetch_timeout
        tokens = ids[0].tolist()
        try:
            found = self.client.lookup(self.spec, tokens[:-1], timeout=self.fetch_timeout)
            ct = self._chunk_tokens = found.chunk_tokens
            usable = min(found.cached_tokens, len(tokens) - 1) // ct if ct else 0
            if usable == 0:
                return Prefix(seconds=time.perf_counter() - t0, chunk_tokens=ct)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded("fetch deadline spent on Lookup")
            # copy=False: views of this thread's receive buffer where the transport has one, decoded into the
            # model's buffer at once below (a copy out first was a whole extra copy into fresh host memory)
            blobs = self.client.get_blobs(self.spec, tokens[:usable * ct], max_chunks=usable, timeout=remaining,
                                          copy=False)
            if not blobs:  # evicted between Lookup and Get
                return Prefix(seconds=time.perf_counter() - t0, chunk_tokens=ct)
            if len(blobs) > usable:  # chunks for tokens never asked for: never loaded
                raise errors.CorruptChunk(f"the sidecar answered {len(blobs)} chunks; {usable} were asked for")
            try:
                kv = decode_prefix(self.spec, blobs, ct, self.device)
                if self.verify_finite and self.spec.quantization == "none":
                    # quantized modes prove finiteness from their scales; raw chunks are scanned (cheap next to
                    # compute)
                    for layer, (k, v) in enumerate(kv):
                        if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                            raise errors.CorruptChunk(f"cached prefix has NaN or Inf in layer {layer}")
            except errors.CorruptChunk:
                # What is stored is bad (it came intact: a transit failure raises in get_blobs, and is not this)
                self._forget(tokens[:usable * ct])
                raise
            cache = adopt_cache(self.model, kv)  # freshly decoded: this request's own tensors, no copy needed
            if time.monotonic() > deadline:
                raise errors.DeadlineExceeded(f"fetch took longer than {self.fetch_timeout}s")
            cached = len(blobs) * ct
            seconds = time.perf_counter() - t0
            FETCH_SECONDS.observe(seconds)
            REUSED_TOKENS.inc(cached)
            return Prefix(cached, cache, None, seconds, ct)
        except Exception as exc:  # noqa: BLE001 - the cache must never fail a request
            reason = fallback_reason(exc)
            FALLBACKS.labels(reason).inc()
            _warn.warning(f"fallback-{reason}", "promptcache: falling back to full prefill (%s): %s", reason, exc)
            return Prefix(fallback=reason, seconds=time.perf_counter() - t0)

    def _forget(self, tokens: list[int]) -> None:
        """Delete the cached chunks of `tokens` after one failed its checks: the sidecar keeps a chunk whose bytes
        arrived intact (it cannot read a quantized chunk), and a Put skips a key it holds, so a damaged or forged
        chunk would fail every request of its prefix until it aged out. Run on the store thread, before the store
        of this request's own chunks, which then replace it."""
        try:
            self._pool.submit(self._delete_quietly, list(tokens))
        except RuntimeError:  # closed
            pass

    def _delete_quietly(self, tokens: list[int]) -> None:
        try:
            self.client.delete(self.spec, tokens)
        except Exception as exc:  # noqa: BLE001 - the next failure tries again
            _warn.warning("forget", "promptcache: could not delete a corrupt cached prefix: %s", exc)

    # ---------------------------------------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(self, input_ids, *, logits_to_keep: int = 1, store: bool | None = None,
                **model_kwargs) -> PrefillResult:
        """Fetch the cached prefix, run the model over the rest, schedule the store of new whole chunks.

        Returns the logits of the last `logits_to_keep` positions and a DynamicCache over all the input tokens,
        ready for decoding (it is this request's own object).
        """
        ids = _as_ids(input_ids).to(self.device)
        n = ids.shape[1]
        model_kwargs = {k: v for k, v in model_kwargs.items() if k not in IGNORED_MODEL_KWARGS}
        why = self.uncacheable(model_kwargs, SAFE_MODEL_KWARGS, n) if self.client is not None else None
        prefix = Prefix(fallback=self._refuse(why)) if why else self._fetch(ids)
        t0 = time.perf_counter()
        cache = prefix.cache if prefix.cache is not None else make_cache(self.model, None)
        out = self.model(input_ids=ids[:, prefix.cached_tokens:], use_cache=True, logits_to_keep=logits_to_keep,
                         **cache_kwargs(self.model, cache), **model_kwargs)
        compute = time.perf_counter() - t0
        COMPUTED_TOKENS.inc(n - prefix.cached_tokens)
        fut = None
        if not why and (store if store is not None else self.store_enabled):
            fut = self._store_async(ids, output_cache(out), prefix.cached_tokens)
        return PrefillResult(out.logits, output_cache(out), prefix.cached_tokens, n - prefix.cached_tokens,
                             prefix.fallback, prefix.seconds, compute, fut)

    @torch.inference_mode()
    def generate(self, input_ids, attention_mask=None, **generate_kwargs):
        """`model.generate(input_ids, **generate_kwargs)` with the prompt prefix reused and stored.

        The prompt minus its last token is prefilled here (from the cache where possible; new whole chunks are stored
        in the background right away), then `generate()` continues from that cache, computing the last prompt token
        and decoding. Same output as plain `generate()` for mode "none".
        """
        ids = _as_ids(input_ids).to(self.device)
        n = ids.shape[1]
        if generate_kwargs.get("past_key_values") is not None or generate_kwargs.get("cache") is not None:
            raise ValueError("PromptCacheHF.generate builds the cache itself; do not pass cache/past_key_values")
        why = None
        if self.client is not None:
            why = self.uncacheable({"attention_mask": attention_mask, **generate_kwargs},
                                   SAFE_GENERATE_KWARGS | {"attention_mask"}, n)
        if attention_mask is None:
            attention_mask = torch.ones_like(ids)
        if self.client is None or why:  # plain generate with the caller's arguments: nothing to reuse or store
            self.last_prefix = Prefix(fallback=self._refuse(why) if why else None)
            COMPUTED_TOKENS.inc(n)
            return self.model.generate(ids, attention_mask=attention_mask, **generate_kwargs)
        prefix = self._fetch(ids)
        cache = prefix.cache if prefix.cache is not None else make_cache(self.model, None)
        start = prefix.cached_tokens
        if n - 1 > start:
            out = self.model(input_ids=ids[:, start:n - 1], use_cache=True, logits_to_keep=1,
                             **cache_kwargs(self.model, cache))
            cache = output_cache(out)
        COMPUTED_TOKENS.inc(n - start)
        if self.store_enabled and n - 1 > start:
            self._store_async(ids[:, :n - 1], cache, start)
        self.last_prefix = prefix
        return self.model.generate(ids, attention_mask=attention_mask, **cache_kwargs(self.model, cache),
                                   **generate_kwargs)

    # ------------------------------------------------------------------------------------------------ store
    def store_async(self, input_ids, cache, cached_tokens: int = 0) -> Future | None:
        """Store the whole chunks of `input_ids` not yet cached, in the background. Never blocks on the network.

        The K/V of those chunks is copied here (the caller's cache may be mutated or freed afterwards); the
        background thread quantizes and Puts. Returns a Future (None when nothing is new, the queue is full or the
        request is not cached: uncacheable).
        """
        if self.client is None:
            return None
        why = self.uncacheable()
        if why:
            STORES.labels("refused").inc()
            _warn.warning(f"store-refused-{why[0]}", "promptcache: not storing (%s): %s", *why)
            return None
        return self._store_async(input_ids, cache, cached_tokens)

    def _store_async(self, input_ids, cache, cached_tokens: int = 0) -> Future | None:
        if self.client is None:
            return None
        ids = _as_ids(input_ids)
        n = ids.shape[1]
        ct = self._chunk_tokens
        if ct:  # copy just the new whole chunks
            a, b = (cached_tokens // ct) * ct, (n // ct) * ct
        else:  # chunk size not known yet (no Lookup answered): copy the rest, the store thread asks the sidecar
            a, b = cached_tokens, n
        if b <= a:
            return None
        why = self._unsliceable(cache, b)
        if why:
            STORES.labels("refused").inc()
            _warn.warning("store-refused-layers", "promptcache: not storing: %s", why)
            return None
        if not self._slots.acquire(blocking=False):
            STORES.labels("dropped").inc()
            _warn.warning("store-dropped", "promptcache: background store queue full; dropping a store of %d tokens",
                          b - a)
            return None
        try:
            snapshot = [(k[..., a:b, :].clone(), v[..., a:b, :].clone()) for k, v in cache_kv(cache)]
            tokens = ids[0, :b].tolist()
        except BaseException:
            self._slots.release()
            raise
        fut = self._pool.submit(self._store, tokens, snapshot, a)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _unsliceable(self, cache, b: int) -> str | None:
        """Why the first `b` tokens' K/V cannot be cut from `cache` by position, else None. The second guard behind
        uncacheable_layers: a layer that is not a plain DynamicLayer (one that trims to a window) disables this
        model for good; a cache shorter than the tokens is refused this once."""
        from transformers.cache_utils import DynamicLayer

        odd = sorted({type(layer).__name__ for layer in getattr(cache, "layers", None) or ()
                      if type(layer) is not DynamicLayer})
        if odd:
            self.disabled = ("layer_types", f"its cache has {odd} layers (only DynamicLayer keeps every token)")
            log.warning("promptcache: %s is never cached from now on (%s): %s", type(self.model).__name__,
                        *self.disabled)
            return self.disabled[1]
        kv = cache_kv(cache)
        if len(kv) != self.spec.num_layers or any(k is None or k.shape[-2] < b or v.shape[-2] < b for k, v in kv):
            return f"the cache does not hold {b} tokens in each of {self.spec.num_layers} layers"
        return None

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
        self._slots.release()

    def _store(self, tokens, snapshot, a):
        """Background: quantize (if the mode says so) and Put the whole chunks in snapshot (tokens a.. of `tokens`)."""
        b = a + snapshot[0][0].shape[-2]
        try:
            ct = self._chunk_tokens or self.client.chunk_tokens
            self._chunk_tokens = ct
            if a % ct:
                raise ValueError(f"snapshot starts at token {a}, not at a chunk boundary of {ct}")
            first, last = a // ct, b // ct
            if last <= first:
                return None
            blobs = {i: encode_chunk(self.spec, snapshot, i * ct - a, (i + 1) * ct - a, self.rope_theta)
                     for i in range(first, last)}
            res = self.client.put_blobs(self.spec, tokens[:last * ct], blobs, timeout=self.store_timeout)
            STORES.labels("ok").inc()
            return res
        except Exception as exc:  # noqa: BLE001 - a failed store only costs a future cache miss
            STORES.labels("error").inc()
            _warn.warning("store-error", "promptcache: background store of tokens %d..%d failed: %s", a, b, exc)
            return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the background stores queued so far; True when all finished in time."""
        from concurrent.futures import wait

        with self._lock:
            pending = list(self._pending)
        done, not_done = wait(pending, timeout=timeout)
        return not not_done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._owns_client and self.client is not None:
            self.client.close()

    def __enter__(self) -> "PromptCacheHF":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_INSTANCES: "weakref.WeakSet[PromptCacheHF]" = weakref.WeakSet()  # for the at-fork hook


def _after_fork_in_child() -> None:
    for pc in list(_INSTANCES):
        pc._start_store_thread()  # the parent's queued stores are the parent's to make


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
