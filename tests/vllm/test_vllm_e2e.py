"""vLLM (CPU backend) with PromptCacheConnector against a real sidecar process, end to end (`make test-vllm`).

Real parts only: a `promptcache serve` subprocess (gRPC and bulk channel), vLLM engines in their own processes run by
the vLLM virtualenv (hack/vllm-env.sh; PROMPTCACHE_VLLM_PYTHON names its python), the real SmolLM2-135M model, and
the transformers integration in this process. The engines are started once, in parallel, and reused by every case:

    A    fp32, connector   generates and stores (chunked prefill: at most 256 tokens a step)
    B    fp32, connector   a separate process: loads what A and the transformers integration stored (chunked too)
    N    fp32, no connector  the reference output
    A16  bf16, connector   stores and loads in bf16 (AMX layout on this CPU), cross-checked with transformers
    Q    fp32, connector, quantization k8v4: packs and unpacks in the engine, cross-checked with transformers

A save-then-load in one process cannot catch a layout bug (a wrong conversion round-trips), so the layout is checked
across engines: vLLM's chunks give transformers the logits of its own full prefill, and transformers' chunks give
vLLM its own tokens; the negative control shows a deliberately wrong layout conversion is caught by that comparison.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from promptcache_devtools import models

from promptcache.client import vllm_layout
from promptcache.client import PromptCacheClient
from promptcache.client.hf import PromptCacheHF, adopt_cache, cache_kwargs, decode_prefix
from promptcache_devtools.vllm_engine import EngineProcess
from support import SidecarProcess

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]
CHUNK = 256  # the sidecar's chunk size: two vLLM CPU blocks of 128
NEW_TOKENS = 8


def reused(answer_before: dict, answer_after: dict) -> float:
    key = "promptcache_client_reused_tokens_total"
    return answer_after["metrics"].get(key, 0.0) - answer_before["metrics"].get(key, 0.0)


def fallbacks(answer: dict) -> float:
    return sum(v for k, v in answer["metrics"].items() if k.startswith("promptcache_client_fallbacks_total"))


@pytest.fixture(scope="module")
def text_ids():
    _, tok = models.load_smollm2("float32")
    return models.text_tokens(tok, 6000)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    bulk = f"unix:{tmp}/bulk.sock"
    sidecar = SidecarProcess("--memory-bytes", "1Gi", "--chunk-tokens", str(CHUNK), "--bulk-address", bulk,
                             "--data-dir", str(tmp / "data"), "--disk-bytes", "0").wait_ready(60)
    conn = {"address": sidecar.address, "bulk_address": bulk, "model_id": models.SMOLLM2_ID,
            "revision": models.model_revision(), "load_timeout": 2.0}
    model_dir = str(models.smollm2_dir())
    logs = Path(os.environ.get("PROMPTCACHE_VLLM_LOGS", tmp))
    opts = dict(max_model_len=1024, max_num_seqs=8)
    chunked = dict(opts, max_num_batched_tokens=256)  # prompts of 600 tokens take several steps
    engines = {
        "A": EngineProcess(VLLM_PYTHON, model_dir, connector=conn, log_path=str(logs / "A.log"), **chunked),
        "B": EngineProcess(VLLM_PYTHON, model_dir, connector=conn, log_path=str(logs / "B.log"), **chunked),
        "N": EngineProcess(VLLM_PYTHON, model_dir, log_path=str(logs / "N.log"), **opts),
        "A16": EngineProcess(VLLM_PYTHON, model_dir, dtype="bfloat16", connector=conn,
                             log_path=str(logs / "A16.log"), **opts),
        "Q": EngineProcess(VLLM_PYTHON, model_dir, connector=dict(conn, quantization="k8v4"),
                           log_path=str(logs / "Q.log"), **opts),
    }
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            ready = dict(zip(engines, pool.map(lambda e: e.wait_ready(900), engines.values())))
        print(f"\nvLLM engines ready in {time.monotonic() - t0:.0f}s: {ready}")
        yield {"sidecar": sidecar, "conn": conn, "engines": engines, "ready": ready}
    finally:
        for e in engines.values():
            e.close()
        sidecar.stop()


def hf_integration(dtype: str, address: str, quantization: str = "none") -> PromptCacheHF:
    model, _ = models.load_smollm2(dtype)
    return PromptCacheHF(model, PromptCacheClient(address, timeout=10), model_id=models.SMOLLM2_ID,
                         revision=models.model_revision(), quantization=quantization, fetch_timeout=10)


def full_prefill_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()


def test_layouts_are_probed(env):
    ready = env["ready"]
    assert ready["A"]["layout"] == ready["B"]["layout"] == "cpu_vec" and ready["A"]["disabled"] is None
    expected16 = "cpu_amx" if torch.cpu._is_amx_tile_supported() else "cpu_vec"
    assert ready["A16"]["layout"] == expected16


def test_process_b_loads_what_process_a_stored(env, text_ids):
    A, B, N = (env["engines"][k] for k in "ABN")
    prompt = text_ids[:600]
    stored = A.generate([prompt], NEW_TOKENS)
    A.call(op="flush")
    before = B.call(op="metrics")
    loaded = B.generate([prompt], NEW_TOKENS)
    reference = N.generate([prompt], NEW_TOKENS)
    assert reused(before, loaded) >= (len(prompt) - 1) // CHUNK * CHUNK == 512
    assert loaded["outputs"] == reference["outputs"] == stored["outputs"]


def test_vllm_chunks_give_transformers_its_own_logits_and_a_wrong_layout_is_caught(env, text_ids):
    A = env["engines"]["A"]
    prompt = text_ids[600:1200]
    A.generate([prompt], NEW_TOKENS)
    A.call(op="flush")
    pc = hf_integration("float32", env["sidecar"].address)
    res = pc.prefill(prompt, store=False)
    assert res.cached_tokens == 512
    full = full_prefill_logits(pc.model, prompt)
    diff = (res.logits[0, -1].float() - full).abs().max().item()
    print(f"\nvLLM fp32 chunks -> transformers: logits max abs diff {diff:.2e}")
    assert diff <= 1e-4

    # Negative control: the same chunks as a connector with the wrong layout would have stored them (the CPU
    # backend's blocks read as token-major instead of K transposed) are caught by the very same comparison.
    blobs = pc.client.get_blobs(pc.spec, prompt[:512])
    good = decode_prefix(pc.spec, blobs, CHUNK, "cpu")
    canonical = torch.stack([torch.stack((k[0], v[0])) for k, v in good])  # [L, 2, H, T, D]
    blocks = vllm_layout.canonical_to_blocks(canonical, vllm_layout.scatter_index("cpu_vec", 128, 64), 128)
    wrong = vllm_layout.blocks_to_canonical(blocks, vllm_layout.gather_index("token_major", 128, 64), 128)
    assert not torch.equal(wrong, canonical)
    cache = adopt_cache(pc.model, [(wrong[i, 0][None].clone(), wrong[i, 1][None].clone())
                                   for i in range(wrong.shape[0])])
    with torch.inference_mode():
        out = pc.model(input_ids=torch.tensor([prompt[512:]]), logits_to_keep=1, use_cache=True,
                       **cache_kwargs(pc.model, cache))
    wrong_diff = (out.logits[0, -1].float() - full).abs().max().item()
    print(f"negative control (wrong layout): logits max abs diff {wrong_diff:.2e}")
    assert wrong_diff > 1e-2
    pc.close()


def test_transformers_chunks_give_vllm_its_own_tokens(env, text_ids):
    B, N = env["engines"]["B"], env["engines"]["N"]
    prompt = text_ids[1200:1800]
    pc = hf_integration("float32", env["sidecar"].address)
    pc.prefill(prompt[:512], store=True)
    assert pc.flush(60)
    pc.close()
    before = B.call(op="metrics")
    loaded = B.generate([prompt], NEW_TOKENS)
    reference = N.generate([prompt], NEW_TOKENS)
    assert reused(before, loaded) == 512
    assert loaded["outputs"] == reference["outputs"]


def test_batch_of_eight_sharing_a_system_prompt(env, text_ids):
    A, B, N = (env["engines"][k] for k in "ABN")
    system = text_ids[2000:2512]
    prompts = [system + text_ids[3000 + 50 * i:3000 + 50 * i + 40] for i in range(8)]
    A.generate(prompts[:1], NEW_TOKENS)  # stores the system prompt's two chunks
    A.call(op="flush")
    before = B.call(op="metrics")
    loaded = B.generate(prompts, NEW_TOKENS)
    reference = N.generate(prompts, NEW_TOKENS)
    assert reused(before, loaded) == 8 * 512
    assert loaded["outputs"] == reference["outputs"]


def test_bf16_across_engines(env, text_ids):
    A16 = env["engines"]["A16"]
    model16, _ = models.load_smollm2("bfloat16")
    # vLLM bf16 stores; transformers bf16 loads: its logits match its own full prefill to bf16 precision.
    prompt = text_ids[3600:4200]
    first = A16.generate([prompt], NEW_TOKENS)
    A16.call(op="flush")
    pc = hf_integration("bfloat16", env["sidecar"].address)
    res = pc.prefill(prompt, store=False)
    assert res.cached_tokens == 512
    full = full_prefill_logits(model16, prompt)
    diff = (res.logits[0, -1].float() - full).abs().max().item()
    print(f"\nvLLM bf16 chunks -> transformers bf16: logits max abs diff {diff:.3f}, top token "
          f"{int(res.logits[0, -1].argmax())} vs {int(full.argmax())}")
    assert int(res.logits[0, -1].argmax()) == int(full.argmax())
    assert diff < 0.5
    # The same engine loads its own chunks back: the same tokens as its first (uncached) run.
    before = A16.call(op="metrics")
    again = A16.generate([prompt], NEW_TOKENS)
    assert reused(before, again) == 512
    assert again["outputs"] == first["outputs"]
    # transformers bf16 stores; vLLM bf16 loads: the first generated token is vLLM's own (bf16 kernels differ).
    prompt2 = text_ids[4200:4800]
    plain = A16.generate([prompt2], NEW_TOKENS, cache_salts=["no-such-tenant"])  # a miss: full prefill
    pc.prefill(prompt2[:512], store=True)
    assert pc.flush(60)
    pc.close()
    before = A16.call(op="metrics")
    loaded = A16.generate([prompt2], NEW_TOKENS)
    assert reused(before, loaded) == 512
    assert loaded["outputs"][0][0] == plain["outputs"][0][0]


def test_quantized_chunks_across_engines(env, text_ids):
    """k8v4 (entropy-coded, needs zstandard in the engine's environment): vLLM packs what transformers unpacks and the
    reverse. Quantized K/V is not bit-exact, so the checks are on the next-token choice, not on exact logits."""
    Q, N = env["engines"]["Q"], env["engines"]["N"]
    assert env["ready"]["Q"]["disabled"] is None
    prompt = text_ids[1800:2400]
    Q.generate([prompt], NEW_TOKENS)
    Q.call(op="flush")
    pc = hf_integration("float32", env["sidecar"].address, quantization="k8v4")
    res = pc.prefill(prompt, store=False)
    assert res.cached_tokens == 512 and res.fallback is None
    full = full_prefill_logits(pc.model, prompt)
    diff = (res.logits[0, -1].float() - full).abs().max().item()
    print(f"\nvLLM k8v4 chunks -> transformers: logits max abs diff {diff:.3f}")
    assert int(res.logits[0, -1].argmax()) == int(full.argmax()) and diff < 1.0
    prompt2 = text_ids[2400:3000]  # transformers packs, vLLM unpacks
    pc.prefill(prompt2[:512], store=True)
    assert pc.flush(60)
    pc.close()
    before = Q.call(op="metrics")
    loaded = Q.generate([prompt2], NEW_TOKENS)
    reference = N.generate([prompt2], NEW_TOKENS)
    assert reused(before, loaded) == 512 and fallbacks(loaded) == fallbacks(before)
    assert loaded["outputs"][0][0] == reference["outputs"][0][0]


def test_a_connector_reset_stops_loading_what_was_stored_before(env, text_ids):
    """vLLM resets the connector with its own prefix cache when a pause clears the caches, as RL trainers do around a
    weight update: what was stored before may be the old weights' KV, so this engine no longer loads it; what it
    stores afterwards it loads again, and another engine (the same weights on disk) still loads the old chunks."""
    A, B = env["engines"]["A"], env["engines"]["B"]
    prompt = text_ids[4000:4600]
    A.generate([prompt], NEW_TOKENS)
    A.call(op="flush")
    before = B.call(op="metrics")
    assert reused(before, B.generate([prompt], NEW_TOKENS)) >= 512
    assert B.call(op="reset", connector=True)["ok"] is True
    before = B.call(op="metrics")
    after = B.generate([prompt], NEW_TOKENS)
    assert reused(before, after) == 0 and fallbacks(after) == fallbacks(before)
    B.call(op="flush")
    assert B.call(op="reset", connector=False)["ok"] is True  # vLLM's own cache only: the next run asks the sidecar
    before = B.call(op="metrics")
    assert reused(before, B.generate([prompt], NEW_TOKENS)) >= 512  # what B stored after its reset
    assert A.call(op="reset", connector=False)["ok"] is True
    before = A.call(op="metrics")
    assert reused(before, A.generate([prompt], NEW_TOKENS)) >= 512  # A's identity did not change


def test_a_corrupt_quantized_chunk_is_replaced_not_failed_on_every_request(env, text_ids):
    """A k8v4 chunk whose bytes arrived intact but do not decode (a damaged or forged writer's) is kept by the
    sidecar, which cannot read quantized bytes, and a Put skips a key the sidecar holds: every request of its prefix
    failed its load and recomputed until the chunk aged out. Now the failed load deletes it, and the recomputed
    chunks are stored in its place: a later request loads them and generates the reference tokens."""
    from promptcache.client.client import encode_chunk
    from promptcache.client.hf import cache_kv, output_cache

    Q, N = env["engines"]["Q"], env["engines"]["N"]
    prompt = text_ids[3200:3800]
    reference = N.generate([prompt], NEW_TOKENS)
    pc = hf_integration("float32", env["sidecar"].address, quantization="k8v4")
    with torch.inference_mode():
        kv = cache_kv(output_cache(pc.model(input_ids=torch.tensor([prompt[:CHUNK]]), use_cache=True)))
    forged = encode_chunk(pc.spec, kv, 0, CHUNK).clone()
    forged[-3] ^= 0x40  # fails its CRC when unpacked; intact as far as the sidecar can tell
    assert pc.client.put_blobs(pc.spec, prompt[:CHUNK], {0: forged}).stored_chunks == 1
    pc.close()
    before = Q.call(op="metrics")
    first = Q.generate([prompt], NEW_TOKENS)
    assert fallbacks(first) > fallbacks(before)  # (reused counts what its Lookup found, 256 tokens)
    assert first["outputs"] == reference["outputs"]
    for _ in range(2):  # the recompute's save (it may skip what its Lookup found: then the next request's does)
        Q.call(op="flush")
        assert Q.call(op="reset", connector=False)["ok"] is True  # vLLM's own prefix cache: ask the sidecar again
        before = Q.call(op="metrics")
        out = Q.generate([prompt], NEW_TOKENS)
        if reused(before, out) >= 512:
            break
    assert reused(before, out) >= 512 and fallbacks(out) == fallbacks(before)
    assert out["outputs"][0][0] == reference["outputs"][0][0]  # quantized K/V: the next token, as above


def test_sidecar_killed_mid_run_falls_back_to_prefill(env, text_ids):
    B, N = env["engines"]["B"], env["engines"]["N"]
    prompt = text_ids[5000:5600]
    reference = N.generate([prompt], NEW_TOKENS)
    env["sidecar"].proc.kill()
    env["sidecar"].proc.wait()
    before = B.call(op="metrics")
    out = B.generate([prompt], NEW_TOKENS)
    assert out["outputs"] == reference["outputs"]
    assert fallbacks(out) > fallbacks(before)
    assert reused(before, out) == 0
