"""Regenerate docs/key-vectors.json from promptcache.contract.keys (run only when the spec version changes).

A vector with a "request" object derives its salt with request_salt (docs/keys.md, "Request salt (v2)") from the
model's tenant salt and the request's parts; its model fields are then those hashed (a shard's own head and layer
counts) and "request_salt_hex" is the derived salt. "kv_scales" (an fp8 cache's per-layer K and V scales) gives the
scales; "digest_hex" is their scales_digest, folded into the salt as field 9.
"""
import hashlib
import json
from dataclasses import replace
from pathlib import Path

from promptcache.contract.keys import (Adapter, ModelSpec, MultiModalItem, Shard, chunk_keys, fingerprint,
                                       request_salt, scales_digest, shard_spec)

LLAMA = ModelSpec("meta-llama/Llama-3.1-8B", "sha256:0123abcd", "bfloat16", 32, 8, 128)
ADAPTER = Adapter("sql-lora", hashlib.sha256(b"adapter weights").digest())
CASES = [
    {"name": "smollm2-fp32", "spec": ModelSpec("HuggingFaceTB/SmolLM2-135M-Instruct", "gguf-q4_1", "float32", 30, 3, 64),
     "tokens": list(range(8)), "chunk_tokens": 4},
    {"name": "bf16-k8v4-tenant", "spec": ModelSpec("meta-llama/Llama-3.1-8B", "sha256:0123abcd", "bfloat16", 32, 8, 128,
                                                   "k8v4", b"tenant-a"),
     "tokens": [128000, 9906, 11, 1917, 0, 4294967295, 7, 7, 7], "chunk_tokens": 3},
    {"name": "unicode-id-partial-chunk", "spec": ModelSpec("modèle/ünïcode", "", "float16", 1, 1, 1, "k8v8"),
     "tokens": [1, 2, 3, 4, 5], "chunk_tokens": 2},
    # v2 request salts
    {"name": "lora-adapter", "spec": LLAMA, "request": {"adapter": ADAPTER},
     "tokens": [128000, 9906, 11, 1917], "chunk_tokens": 2},
    {"name": "two-images-tenant", "spec": replace(LLAMA, tenant_salt=b"tenant-a"),
     "request": {"mm_items": [MultiModalItem("image", "3f1a9c0e", 1, 2), MultiModalItem("image", "77aa01", 4, 2)]},
     "tokens": [128000, 32000, 32000, 11, 32000, 32000, 7, 7], "chunk_tokens": 4},
    {"name": "embeds-adapter-image", "spec": LLAMA,
     "request": {"adapter": ADAPTER, "mm_items": [MultiModalItem("audio", "ünï", 0, 1)],
                 "embeds_digest": hashlib.sha256(b"embeds").digest()},
     "tokens": [0, 0, 5, 6], "chunk_tokens": 2},
    {"name": "tp2-rank1-pp2-stage0", "spec": LLAMA, "request": {"shard": Shard(4, 8, 8, 0, 16, 32)},
     "tokens": [1, 2, 3, 4], "chunk_tokens": 2},
    # fp8 KV caches (raw bytes; the per-layer scales in the salt) and MLA latent chunks (kv_kind "mla", field 9)
    {"name": "fp8-e4m3fn-scales", "spec": replace(LLAMA, kv_dtype="float8_e4m3fn", num_layers=3),
     "request": {"kv_scales": ([0.0173, 1.0, 2.5], [0.5, 1.0, 0.03125])},
     "tokens": [128000, 9906, 11, 1917], "chunk_tokens": 2},
    {"name": "fp8-e5m2-unit-scales-tenant", "spec": ModelSpec("m", "r", "float8_e5m2", 2, 2, 64, tenant_salt=b"t"),
     "request": {"kv_scales": ([1.0, 1.0], [1.0, 1.0])}, "tokens": [1, 2, 3, 4], "chunk_tokens": 2},
    {"name": "mla-deepseek-v3", "spec": ModelSpec("deepseek-ai/DeepSeek-V3", "sha256:abcd", "bfloat16", 61, 1, 576,
                                                  kv_kind="mla"),
     "tokens": [0, 1, 2, 3, 4, 5], "chunk_tokens": 3},
    {"name": "mla-fp8-pp2-stage1", "spec": ModelSpec("deepseek-ai/DeepSeek-V3", "sha256:abcd", "float8_e4m3fn", 61, 1,
                                                     576, kv_kind="mla"),
     "request": {"kv_scales": ([1.0] * 30, [1.0] * 30), "shard": Shard(0, 1, 1, 31, 61, 61)},
     "tokens": [0, 1, 2, 3], "chunk_tokens": 2},
]


def request_json(r: dict) -> dict:
    out = {}
    if "adapter" in r:
        out["adapter"] = {"name": r["adapter"].name, "digest_hex": r["adapter"].digest.hex()}
    if "mm_items" in r:
        out["mm_items"] = [{"modality": m.modality, "content_hash": m.content_hash, "offset": m.offset,
                            "length": m.length} for m in r["mm_items"]]
    if "embeds_digest" in r:
        out["embeds_digest_hex"] = r["embeds_digest"].hex()
    if "kv_scales" in r:
        k, v = r["kv_scales"]
        out["kv_scales"] = {"k": k, "v": v, "digest_hex": scales_digest(k, v).hex()}
    if "shard" in r:
        s = r["shard"]
        out["shard"] = [s.head_start, s.head_stop, s.num_kv_heads, s.layer_start, s.layer_stop, s.num_layers]
    return out


out = []
for case in CASES:
    spec, request = case["spec"], case.get("request")
    hashed = spec
    if request is not None:
        parts = {k: v for k, v in request.items() if k not in ("shard", "kv_scales")}
        if "kv_scales" in request:
            parts["kv_scales"] = scales_digest(*request["kv_scales"])
        hashed = shard_spec(spec, request["shard"], **parts) if "shard" in request else \
            replace(spec, tenant_salt=request_salt(spec.tenant_salt, **parts))
    fp = fingerprint(hashed)
    vector = {
        "name": case["name"],
        "model": {"model_id": hashed.model_id, "revision": hashed.revision, "kv_dtype": hashed.kv_dtype,
                  "num_layers": hashed.num_layers, "num_kv_heads": hashed.num_kv_heads, "head_dim": hashed.head_dim,
                  "quantization": hashed.quantization, "tenant_salt_hex": spec.tenant_salt.hex(),
                  "kv_kind": hashed.kv_kind},
    }
    if request is not None:
        vector["request"] = request_json(request)
        vector["request_salt_hex"] = hashed.tenant_salt.hex()
    vector.update({
        "fingerprint": fp.hex(),
        "chunk_tokens": case["chunk_tokens"],
        "tokens": case["tokens"],
        "chunk_keys": [k.hex() for k in chunk_keys(fp, case["tokens"], case["chunk_tokens"])],
    })
    out.append(vector)
Path(__file__).resolve().parents[1].joinpath("docs/key-vectors.json").write_text(
    json.dumps(out, indent=2) + "\n")
