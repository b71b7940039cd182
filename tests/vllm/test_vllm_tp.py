"""Tensor parallelism on vLLM's CPU backend (issue 26): TP=2 with the connector against a real sidecar process, a
small random Llama (4 attention heads, 2 KV heads, 4 layers, SmolLM2's tokenizer; devtools.models.random_llama_dir)
whose KV heads split over the ranks. Each rank stores and loads its own KV heads [r*H/tp, (r+1)*H/tp) under keys that
say so (docs/keys.md, "Request salt (v2)"). Checked: a TP=2 engine loads what TP=2 stored, with the greedy tokens of
its own full prefill; and each rank's stored chunk holds exactly its heads of transformers' K/V for the prompt (the
other rank's heads do not match: the negative control), so the ranks' slices are neither swapped nor shared."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from promptcache.client import PromptCacheClient
from promptcache.client.client import checked_chunks
from promptcache.contract.keys import ModelSpec, Shard, shard_spec
from promptcache_devtools import models
from promptcache_devtools.vllm_engine import EngineProcess
from support import SidecarProcess

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not VLLM_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]
CT, NEW_TOKENS, KV_HEADS, LAYERS = 256, 8, 2, 4
MODEL_ID, REVISION = "test/random-llama-kv2", "seed-0"


def reused(before: dict, after: dict) -> float:
    key = "promptcache_client_reused_tokens_total"
    return after["metrics"].get(key, 0.0) - before["metrics"].get(key, 0.0)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    model_dir = models.random_llama_dir(KV_HEADS, LAYERS)
    sidecar = SidecarProcess("--memory-bytes", "256Mi", "--chunk-tokens", str(CT)).wait_ready(60)
    logs = Path(os.environ.get("PROMPTCACHE_VLLM_LOGS", tmp))
    conn = {"address": sidecar.address, "model_id": MODEL_ID, "revision": REVISION, "load_timeout": 5.0}
    e = EngineProcess(VLLM_PYTHON, str(model_dir), connector=conn, log_path=str(logs / "tp2.log"),
                      max_model_len=1024, max_num_seqs=4, tensor_parallel_size=2,
                      env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    t0 = time.monotonic()
    try:
        e.wait_ready(1200)
        print(f"\nTP=2 engine ready in {time.monotonic() - t0:.0f}s")
        yield {"engine": e, "sidecar": sidecar, "model_dir": model_dir}
    finally:
        e.close()
        sidecar.stop()


def rank_specs():
    whole = ModelSpec(MODEL_ID, REVISION, "float32", LAYERS, KV_HEADS, 64)
    return [shard_spec(whole, Shard(r, r + 1, KV_HEADS, 0, LAYERS, LAYERS)) for r in range(2)]


def test_tp2_loads_what_tp2_stored_with_identical_tokens(env):
    e = env["engine"]
    _, tok = models.load_smollm2("float32")
    prompt = models.text_tokens(tok, 600)
    ref = e.generate([prompt], NEW_TOKENS, cache_salts=["reference"])["outputs"]  # a miss: a full prefill
    first = e.generate([prompt], NEW_TOKENS)  # a miss: each rank stores its heads of the two chunks
    assert first["outputs"] == ref
    client = PromptCacheClient(env["sidecar"].address, timeout=10)
    deadline = time.monotonic() + 120
    while any(client.lookup(s, prompt[:2 * CT]).cached_tokens < 2 * CT for s in rank_specs()):
        assert time.monotonic() < deadline, "the ranks' saves did not arrive"
        time.sleep(0.5)
    before = e.call(op="metrics")
    loaded = e.generate([prompt], NEW_TOKENS)
    assert reused(before, loaded) == 2 * CT
    assert loaded["outputs"] == ref

    # Each rank's chunk 0 is its own heads of transformers' K/V for the prompt; the other rank's heads are not.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(env["model_dir"]), dtype=torch.float32).eval()
    with torch.inference_mode():
        cache = hf(input_ids=torch.tensor([prompt[:CT]]), use_cache=True).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers] if hasattr(cache, "layers") else list(cache)
    canonical = torch.stack([torch.stack((k[0], v[0])) for k, v in layers])  # [L, 2, H, T, D]
    for r, spec in enumerate(rank_specs()):
        chunk = checked_chunks(spec, client.get_blobs(spec, prompt[:CT]), CT)[0].float()
        own = (chunk - canonical[:, :, r:r + 1]).abs().max().item()
        other = (chunk - canonical[:, :, 1 - r:2 - r]).abs().max().item()
        print(f"rank {r}: chunk vs transformers, own heads {own:.1e}, the other rank's heads {other:.1e}")
        assert own < 2e-3 and other > 20 * own
    client.close()
