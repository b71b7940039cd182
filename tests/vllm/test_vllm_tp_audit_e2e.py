"""TP=2 end to end when one rank's part fails (the TP audit): a vLLM engine with tensor_parallel_size 2 on the CPU
backend (a 2-KV-head random Llama, one KV head per rank) and the connector against a real sidecar process. A fault
injector (a sitecustomize in the engine's processes, FLAG below) makes TP rank 1 - and only rank 1 - lose its own
chunk after the scheduler's Lookup saw every rank's, just before its Get: a real eviction between Lookup and Get.

Checked: vLLM recomputes the chunk on every rank (the greedy tokens of a full prefill; vLLM's log says it recovered
from the load failure), although rank 0 loaded it; a prefix one rank never stored (its save failed) is counted only
as far as every rank holds it. Negative control: rank 1 hiding its failed blocks from vLLM (zeros in them while rank
0 holds the cached K/V) changes the tokens, so the comparison sees a rank serving other KV than the rest."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from promptcache.client import PromptCacheClient
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
REPO = Path(__file__).resolve().parents[2]

# The engine's processes import this at start-up (PYTHONPATH). While the flag file says "evict" or "hide", the TP
# worker holding KV head 1 deletes its own chunks from chunk 1 on just before its Get (once); "hide" also makes that
# rank zero the blocks it failed to load and report none (what a connector that dropped a rank's errors would do).
SITECUSTOMIZE = r'''
import os, sys
FLAG = os.environ.get("PC_AUDIT_FLAG")
if FLAG:
    try:
        from promptcache.client import client as _client
        _get_blobs = _client.PromptCacheClient.get_blobs

        def _hidden_errors(orig):
            def get_block_ids_with_load_errors(self):
                failed = orig(self)
                if failed and getattr(self, "_audit_hide", False):
                    self._audit_hide = False
                    for cache in self._kv_caches:
                        cache[sorted(failed)] = 0
                    print(f"AUDIT-INJECT: hid and zeroed blocks {sorted(failed)}", file=sys.stderr, flush=True)
                    return set()
                return failed
            return get_block_ids_with_load_errors

        def get_blobs(self, spec, tokens, start_chunk=0, max_chunks=0, **kw):
            try:
                what = open(FLAG).read()
            except OSError:
                what = ""
            if what in ("evict", "hide"):
                from vllm.distributed.kv_transfer import get_kv_transfer_group
                conn = get_kv_transfer_group()
                if conn.shard.head_start == 1:
                    os.unlink(FLAG)
                    n = self.delete(spec, tokens, start_chunk=1)
                    if what == "hide":
                        cls = type(conn)
                        if not getattr(cls, "_audit_patched", False):
                            cls.get_block_ids_with_load_errors = _hidden_errors(cls.get_block_ids_with_load_errors)
                            cls._audit_patched = True
                        conn._audit_hide = True
                    print(f"AUDIT-INJECT: {what}: rank with {conn.shard} deleted {n} own chunks from 1 before its Get",
                          file=sys.stderr, flush=True)
            return _get_blobs(self, spec, tokens, start_chunk=start_chunk, max_chunks=max_chunks, **kw)

        _client.PromptCacheClient.get_blobs = get_blobs
    except Exception as exc:
        print("AUDIT-INJECT not installed:", exc, file=sys.stderr)
'''


def reused(before: dict, after: dict) -> float:
    key = "promptcache_client_reused_tokens_total"
    return after["metrics"].get(key, 0.0) - before["metrics"].get(key, 0.0)


def rank_specs():
    whole = ModelSpec(MODEL_ID, REVISION, "float32", LAYERS, KV_HEADS, 64)
    return [shard_spec(whole, Shard(r, r + 1, KV_HEADS, 0, LAYERS, LAYERS)) for r in range(2)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-audit-e2e")
    (tmp / "inject").mkdir()
    (tmp / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    model_dir = models.random_llama_dir(KV_HEADS, LAYERS)
    sidecar = SidecarProcess("--memory-bytes", "256Mi", "--chunk-tokens", str(CT)).wait_ready(60)
    log = Path(os.environ.get("PROMPTCACHE_VLLM_LOGS", tmp)) / "tp2-audit.log"
    conn = {"address": sidecar.address, "model_id": MODEL_ID, "revision": REVISION, "load_timeout": 5.0}
    roots = [str(REPO / d) for d in ("sidecar", "proto", "operator", "devtools")]
    path = os.pathsep.join([str(tmp / "inject")] + roots)
    e = EngineProcess(VLLM_PYTHON, str(model_dir), connector=conn, log_path=str(log), max_model_len=1024,
                      max_num_seqs=4, tensor_parallel_size=2,
                      env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "PC_AUDIT_FLAG": str(tmp / "flag"),
                           "PYTHONPATH": path})
    try:
        e.wait_ready(1200)
        _, tok = models.load_smollm2("float32")
        yield {"engine": e, "client": PromptCacheClient(sidecar.address, timeout=10), "flag": tmp / "flag",
               "log": log, "text": models.text_tokens(tok, 1300)}
    finally:
        e.close()
        sidecar.stop()


def stored(env, prompt, label):
    """The tokens of a full prefill of `prompt`, once both ranks stored its two chunks."""
    e = env["engine"]
    ref = e.generate([prompt], NEW_TOKENS, cache_salts=["reference-" + label])["outputs"]
    assert e.generate([prompt], NEW_TOKENS)["outputs"] == ref
    deadline = time.monotonic() + 120
    while any(env["client"].lookup(s, prompt[:2 * CT]).cached_tokens < 2 * CT for s in rank_specs()):
        assert time.monotonic() < deadline, "the ranks' saves did not arrive"
        time.sleep(0.5)
    return ref


def log_lines(env, text):
    env["engine"].call(op="metrics")  # (a round trip: what the engine logged before it is in the file)
    return [line for line in env["log"].read_text(errors="replace").splitlines() if text in line]


def test_rank1_chunk_evicted_between_lookup_and_get_is_recomputed_on_every_rank(env):
    e, prompt = env["engine"], env["text"][:600]
    ref = stored(env, prompt, "A")
    recovered = len(log_lines(env, "Recovered from KV load failure"))
    env["flag"].write_text("evict")
    before = e.call(op="metrics")
    out = e.generate([prompt], NEW_TOKENS)
    assert not env["flag"].exists(), "rank 1 never reached its Get"
    assert reused(before, out) == 2 * CT  # the scheduler promised both chunks (its Lookup saw both ranks')
    assert out["outputs"] == ref
    assert len(log_lines(env, "Recovered from KV load failure")) == recovered + 1  # vLLM rescheduled the request
    # the recomputed chunk is saved again: rank 1 stores what it lost (rank 0's Put of its chunk is skipped)
    e.call(op="flush")
    deadline = time.monotonic() + 60
    while (lookups := [env["client"].lookup(s, prompt[:2 * CT]).cached_tokens for s in rank_specs()]) != [2 * CT] * 2:
        assert time.monotonic() < deadline, f"rank 1's chunk was not stored again: {lookups}"
        time.sleep(0.5)
    before = e.call(op="metrics")
    out = e.generate([prompt], NEW_TOKENS)
    assert reused(before, out) == 2 * CT and out["outputs"] == ref


def test_a_prefix_one_rank_did_not_store_counts_only_what_every_rank_holds(env):
    e, prompt = env["engine"], env["text"][600:1200]
    ref = stored(env, prompt, "B")
    env["client"].delete(rank_specs()[1], prompt[:2 * CT], start_chunk=1)  # rank 1's save of chunk 1 failed
    before = e.call(op="metrics")
    out = e.generate([prompt], NEW_TOKENS)
    assert reused(before, out) == CT and out["outputs"] == ref


def test_negative_control_a_rank_hiding_its_failed_blocks_changes_the_tokens(env):
    e, prompt = env["engine"], env["text"][100:700]
    ref = stored(env, prompt, "C")
    env["flag"].write_text("hide")
    out = e.generate([prompt], NEW_TOKENS)
    assert not env["flag"].exists() and log_lines(env, "AUDIT-INJECT: hid and zeroed blocks")
    assert out["outputs"] != ref
