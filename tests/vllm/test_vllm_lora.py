"""One vLLM engine (CPU backend, LoRA enabled) with the connector against a real sidecar process (issue 26).

LoRA end to end: two random adapters on q/k/v with non-zero B. Adapter A's stored chunks are never served to adapter B nor to the
base model; A itself gets them back (the positive control). Before issue 26 B and base hit A's chunks and their
greedy tokens differed from a full prefill's (the issue's report; test_vllm_request_keys shows the old keys
collide). References are the same engine's full prefills under a cache_salt no other request uses (a miss).

Reconnects: the sidecar killed, then restarted on the same address under the running engine: hits resume without
restarting vLLM."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from promptcache_devtools import models
from promptcache_devtools.vllm_engine import EngineProcess
from support import SidecarProcess

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]
NEW_TOKENS = 8


def reused(before: dict, after: dict) -> float:
    key = "promptcache_client_reused_tokens_total"
    return after["metrics"].get(key, 0.0) - before["metrics"].get(key, 0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = models.smollm2_dir()
    loras = {name: str(models.random_lora(tmp / name, model_dir, seed=seed)) for name, seed in (("A", 1), ("B", 2))}
    bulk = f"unix:{tmp}/bulk.sock"
    sidecar = SidecarProcess("--memory-bytes", "512Mi", "--chunk-tokens", "256", "--bulk-address", bulk).wait_ready(60)
    logs = Path(os.environ.get("PROMPTCACHE_VLLM_LOGS", tmp))
    conn = {"address": sidecar.address, "bulk_address": bulk, "model_id": models.SMOLLM2_ID,
            "revision": models.model_revision(), "load_timeout": 5.0}
    e = EngineProcess(VLLM_PYTHON, str(model_dir), connector=conn, log_path=str(logs / "lora.log"),
                      max_model_len=1024, max_num_seqs=4, lora_modules=json.dumps(loras), max_lora_rank=8)
    try:
        ready = e.wait_ready(900)
        assert ready["disabled"] is None, ready
        e.sidecar, e.bulk = sidecar, bulk
        yield e
    finally:
        e.close()
        e.sidecar.stop()


def test_adapter_b_and_base_never_get_adapter_a_kv(engine):
    _, tok = models.load_smollm2("float32")
    prompt = models.text_tokens(tok, 700)
    ref = {name: engine.generate([prompt], NEW_TOKENS, cache_salts=[f"reference-{name}"], loras=[lora])["outputs"]
           for name, lora in (("A", "A"), ("B", "B"), ("base", None))}
    print(f"\nreferences (full prefill): {ref}")
    assert len({json.dumps(v) for v in ref.values()}) == 3, "the adapters must change the output"
    before = engine.call(op="metrics")
    stored = engine.generate([prompt], NEW_TOKENS, loras=["A"])  # a miss: stores A's two chunks
    assert engine.call(op="flush")["ok"]
    assert reused(before, stored) == 0 and stored["outputs"] == ref["A"]
    before = engine.call(op="metrics")
    b = engine.generate([prompt], NEW_TOKENS, loras=["B"])
    assert reused(before, b) == 0, "adapter B was served adapter A's KV"
    assert b["outputs"] == ref["B"]
    before = engine.call(op="metrics")
    base = engine.generate([prompt], NEW_TOKENS)
    assert reused(before, base) == 0, "the base model was served adapter A's KV"
    assert base["outputs"] == ref["base"]
    before = engine.call(op="metrics")
    a = engine.generate([prompt], NEW_TOKENS, loras=["A"])
    assert reused(before, a) == 512, "adapter A did not get its own chunks back"
    assert a["outputs"] == ref["A"]


def test_sidecar_restarted_on_the_same_address_is_used_again_without_restarting_vllm(engine):
    """The sidecar is killed under the running engine, then a new one started on the same gRPC address and bulk socket. The running engine (not
    restarted) asks it again after its retry interval (2 s; meanwhile each request costs one immediate fallback, not
    a timeout), stores into it, and hits."""
    B = engine
    _, tok = models.load_smollm2("float32")
    text_ids = models.text_tokens(tok, 2000)
    old = engine.sidecar
    old.proc.kill()
    old.proc.wait()
    t0 = time.monotonic()
    down = B.generate([text_ids[700:1300]], NEW_TOKENS)  # the sidecar is down: a fast full prefill
    down_seconds = time.monotonic() - t0
    new = SidecarProcess("--grpc-address", old.address, "--memory-bytes", "512Mi", "--chunk-tokens", "256",
                         "--bulk-address", engine.bulk)
    new.address = old.address
    engine.sidecar = new  # the fixture stops it
    new.wait_ready(60)
    time.sleep(2.5)  # the connector's retry interval
    prompt = text_ids[1300:1900]
    before = B.call(op="metrics")
    reference = B.generate([prompt], NEW_TOKENS, cache_salts=["reference-restart"])  # asks the new sidecar first
    deadline = time.monotonic() + 60
    while True:  # the first request after the interval probes the sidecar again, misses and stores
        B.generate([prompt], NEW_TOKENS)
        B.call(op="flush")
        after = B.call(op="metrics")
        hit = B.generate([prompt], NEW_TOKENS)
        if reused(after, hit) > 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(f"\nrequest while the sidecar was down: {down_seconds:.2f}s; after the restart: "
          f"{reused(after, hit):.0f} tokens reused, reconnects "
          f"{hit['metrics'].get('promptcache_client_reconnects_total', 0) - before['metrics'].get('promptcache_client_reconnects_total', 0):.0f}")
    assert reused(after, hit) == 512 and down_seconds < 30
    assert hit["outputs"] == reference["outputs"]
    assert hit["metrics"].get("promptcache_client_reconnects_total", 0) > \
        before["metrics"].get("promptcache_client_reconnects_total", 0)
