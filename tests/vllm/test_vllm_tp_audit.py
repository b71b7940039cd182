"""Tensor parallelism when things fail part way (the TP audit): two worker-role PromptCacheConnectors, TP rank 0
(KV heads [0, 1)) and rank 1 ([1, 2)) of a 2-KV-head random Llama, on real paged KV caches (vLLM's own allocator on
the CPU, kv_layout paged) against a real sidecar process; vLLM's own KVOutputAggregator combines the ranks' reports
as the multiprocess executor does. One vLLM-venv subprocess (the PROBE below) does it all, this side asserts.

- One rank's chunk evicted between the scheduler's Lookup (which saw every rank's) and that rank's Get: that rank
  reports the chunk's blocks (get_block_ids_with_load_errors) before it reports the request finished, the other
  rank loads them, and vLLM's aggregate carries them as invalid while the request still waits for its KV, so the
  scheduler recomputes them on every rank (tests/vllm/test_vllm_tp_audit_e2e.py: the same with a TP=2 engine).
- Sleep mode: a load of several batches went on writing into the KV caches after unregister_kv_caches returned
  (vLLM then releases their memory); it now stops before its next write and reports every block failed.
- A device write that fails part way (a chunk's upload or scatter raising after earlier scatters were queued on the
  load stream) reported the load without waiting for the load stream, so queued writes could land in blocks vLLM
  already recomputes or gave to another request; the stream is now waited for in every case (a stand-in stream
  object on this CPU: no GPU here)."""
from __future__ import annotations

import os

import pytest

from promptcache_devtools import models
from support import SidecarProcess, run_vllm_probe

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]
CT, N = 32, 16  # chunk tokens, block size

PROBE = r'''
import contextlib, json, sys, time
import torch
args = json.loads(sys.argv[1])
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.utils import allocate_kv_cache
from promptcache.client import PromptCacheClient
from promptcache.client import vllm_connector as vc, vllm_paged as vp
from promptcache.contract.keys import Shard

L, KVH, D, N, CT = 4, 2, 64, 16, args["chunk_tokens"]
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
out = {}
mc = ModelConfig(model=args["model_dir"], dtype="float32", max_model_len=1024, enforce_eager=True)
kt = KVTransferConfig(kv_connector="PromptCacheConnector", kv_connector_module_path="promptcache.client.vllm_connector",
                      kv_role="kv_both", kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"address": args["address"], "load_timeout": 5.0, "kv_layout": "paged",
                                                 "model_id": "tp-audit", "revision": "r"})
cfg = VllmConfig(model_config=mc, kv_transfer_config=kt, cache_config=CacheConfig(block_size=N))
cfg.cache_config.kv_cache_layout = "LBNHC"
spec1 = FullAttentionSpec(block_size=N, num_kv_heads=1, head_size=D, dtype=torch.float32)  # one rank's heads


def rank(r, blocks=24):
    """A worker connector of TP rank r (of 2) on its own real caches (the shard set as a TP=2 worker sets it)."""
    kc = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(list(NAMES), spec1)],
                                         blocks * spec1.page_size_bytes * L)
    caches = allocate_kv_cache(kc, torch.device("cpu"), KVCacheLayout["LBNHC"], None)
    c = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
    c.shards = [Shard(i, i + 1, KVH, 0, L, L) for i in range(2)]
    c.shard = c.shards[r]
    c.register_kv_caches(caches)
    assert c.disabled is None, c.disabled
    return c, [caches[n] for n in NAMES]


def bind(c, **meta):
    c.bind_connector_metadata(vc.PromptCacheConnectorMetadata(**meta))


def saved(c, views, tokens, blocks):
    for v in views:
        v[blocks] = torch.randn_like(v[blocks])
    bind(c, saves=[vc._SaveOp("save", c.base_spec, tokens, list(blocks), 0, CT)])
    c.wait_for_save()
    c.flush()


def step(ranks, agg):
    """One engine step's connector reports, in vLLM's order, per rank and as vLLM's aggregate."""
    outs = [(c.get_finished(set())[1], c.get_block_ids_with_load_errors()) for c, _ in ranks]
    a = agg.aggregate([ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
        finished_recving=f, invalid_block_ids=b)) for f, b in outs]).kv_connector_output
    return {"ranks": [[sorted(f or []), sorted(b)] for f, b in outs],
            "aggregate": [sorted(a.finished_recving or []), sorted(a.invalid_block_ids)]}


torch.manual_seed(0)
client = PromptCacheClient(args["address"], timeout=10)

# 1. rank 1's chunk 1 evicted between the Lookup (both ranks held both chunks) and rank 1's Get
tokens = list(range(1000, 1000 + 2 * CT))
SRC, DST = list(range(0, 4)), list(range(4, 8))
ranks = [rank(0), rank(1)]
for c, views in ranks:
    saved(c, views, tokens, SRC)
specs = [c._rank_spec(c.base_spec) for c, _ in ranks]
out["looked_up"] = [client.lookup(s, tokens).cached_tokens for s in specs]
out["evicted"] = client.delete(specs[1], tokens, start_chunk=1)
for c, _ in ranks:
    bind(c, loads=[vc._LoadOp("req", c.base_spec, tokens, DST, 0, 0, CT)])
    c.start_load_kv(None)
for c, _ in ranks:
    c.flush()
agg = KVOutputAggregator(expected_finished_count=2)
out["steps"] = [step(ranks, agg), step(ranks, agg)]
out["rank0_blocks_loaded"] = all(torch.equal(v[SRC], v[DST]) for v in ranks[0][1])
out["rank1_chunk0_loaded"] = all(torch.equal(v[SRC[:2]], v[DST[:2]]) for v in ranks[1][1])
for c, _ in ranks:
    c.shutdown()

# 2. sleep mode: the caches released while a 4-batch load is in flight (a slow sidecar: 2.5 s per Get)
c, views = rank(1)
tokens4 = list(range(5000, 5000 + 4 * CT))
saved(c, views, tokens4, list(range(8)))
c.load_timeout = 2.0
get_blobs = c.client.get_blobs
def slow(*a, **k):
    time.sleep(2.5)
    return get_blobs(*a, **k)
c.client.get_blobs = slow
DST4 = list(range(12, 20))
bind(c, loads=[vc._LoadOp("sleepy", c.base_spec, tokens4, DST4, 0, 0, CT)])
c.start_load_kv(None)
time.sleep(0.3)
c.unregister_kv_caches()  # when this returns vLLM releases the caches' memory
released = [v[DST4].clone() for v in views]
c.flush()
out["written_after_release"] = not all(torch.equal(a, v[DST4]) for a, v in zip(released, views))
failed = c.get_block_ids_with_load_errors()
out["sleep_failed_blocks"] = sorted(failed)
out["sleep_finished"] = sorted(c.get_finished(set())[1] or [])
c.shutdown()

# 3. a device write failing part way: the load stream is waited for before the load is reported
class Stream:  # what the load thread needs of a torch.cuda.Stream
    device = torch.device("cpu")
    events = []
    def synchronize(self):
        Stream.events.append("synchronize")
c, views = rank(0)
c._load_stream = Stream()
torch.cuda.stream = lambda s: contextlib.nullcontext()
def failing(views_, p, chunks, skip, ids, upload=None):
    vp.scatter(views_, p, ids[:1], (upload or (lambda x: x))(chunks[0])[:, :, :, :N])  # queued on the stream ...
    raise RuntimeError("CUDA out of memory (injected)")  # ... then the next chunk's upload fails
vp.scatter_chunks = failing
class Reports(list):  # the load reports (req id, failed blocks) here: note what the stream saw by then
    def append(self, item):
        Stream.events.append("reported")
        super().append(item)
c._done = Reports()
bind(c, loads=[vc._LoadOp("device", c.base_spec, tokens, DST, 0, 0, CT)])
c.start_load_kv(None)
c.flush()
out["device_events"] = Stream.events
out["device_failed_blocks"] = sorted(c.get_block_ids_with_load_errors())
c.shutdown()
print("@@" + json.dumps(out), flush=True)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    script = tmp_path_factory.mktemp("tp-audit") / "probe.py"
    script.write_text(PROBE)
    sidecar = SidecarProcess("--memory-bytes", "256Mi", "--chunk-tokens", str(CT)).wait_ready(60)
    try:
        yield run_vllm_probe(VLLM_PYTHON, script, {"model_dir": str(models.random_llama_dir(2, 4)),
                                                    "address": sidecar.address, "chunk_tokens": CT})
    finally:
        sidecar.stop()


def test_one_ranks_chunk_evicted_after_the_lookup_fails_its_blocks_on_every_rank(probe):
    assert probe["looked_up"] == [2 * CT, 2 * CT]  # the Lookup saw both ranks' two chunks
    assert probe["evicted"] == 1  # then rank 1's chunk 1 went
    first, second = probe["steps"]
    chunk1 = [6, 7]  # DST blocks of chunk 1
    # rank 0 loaded both chunks and is done; rank 1 hands vLLM chunk 1's blocks first, and is done a step later
    assert first["ranks"] == [[["req"], []], [[], chunk1]]
    assert second["ranks"] == [[[], []], [["req"], []]]
    # vLLM's aggregate: the blocks are invalid while the request still waits (not finished on every rank), so the
    # scheduler truncates it at chunk 1 for every rank before it runs
    assert first["aggregate"] == [[], chunk1]
    assert second["aggregate"] == [["req"], []]
    assert probe["rank0_blocks_loaded"] and probe["rank1_chunk0_loaded"]


def test_a_load_in_flight_stops_writing_once_the_caches_are_released(probe):
    assert not probe["written_after_release"]
    assert probe["sleep_failed_blocks"] == list(range(12, 20))  # every block: the KV is gone with the memory
    assert probe["sleep_finished"] == ["sleepy"]


def test_a_device_write_failing_part_way_waits_for_the_load_stream_before_the_report(probe):
    assert probe["device_failed_blocks"] == [4, 5, 6, 7]
    assert probe["device_events"][:2] == ["synchronize", "reported"]
