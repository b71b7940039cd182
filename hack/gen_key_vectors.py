"""Regenerate docs/key-vectors.json from promptcache.contract.keys (run only when the spec version changes)."""
import json
from pathlib import Path

from promptcache.contract.keys import ModelSpec, chunk_keys, fingerprint

CASES = [
    {"name": "smollm2-fp32", "spec": ModelSpec("HuggingFaceTB/SmolLM2-135M-Instruct", "gguf-q4_1", "float32", 30, 3, 64),
     "tokens": list(range(8)), "chunk_tokens": 4},
    {"name": "bf16-k8v4-tenant", "spec": ModelSpec("meta-llama/Llama-3.1-8B", "sha256:0123abcd", "bfloat16", 32, 8, 128,
                                                   "k8v4", b"tenant-a"),
     "tokens": [128000, 9906, 11, 1917, 0, 4294967295, 7, 7, 7], "chunk_tokens": 3},
    {"name": "unicode-id-partial-chunk", "spec": ModelSpec("modèle/ünïcode", "", "float16", 1, 1, 1, "k8v8"),
     "tokens": [1, 2, 3, 4, 5], "chunk_tokens": 2},
]

out = []
for case in CASES:
    spec = case["spec"]
    fp = fingerprint(spec)
    out.append({
        "name": case["name"],
        "model": {"model_id": spec.model_id, "revision": spec.revision, "kv_dtype": spec.kv_dtype,
                  "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "quantization": spec.quantization, "tenant_salt_hex": spec.tenant_salt.hex()},
        "fingerprint": fp.hex(),
        "chunk_tokens": case["chunk_tokens"],
        "tokens": case["tokens"],
        "chunk_keys": [k.hex() for k in chunk_keys(fp, case["tokens"], case["chunk_tokens"])],
    })
Path(__file__).resolve().parents[1].joinpath("docs/key-vectors.json").write_text(json.dumps(out, indent=2) + "\n")
