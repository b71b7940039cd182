"""Run by tests/vllm/test_vllm_connector_scheduler.py with the vLLM virtualenv's python: vLLM's real Request objects
(LoRA, multimodal features, prompt embeddings) through the connector's key derivation, and a real connector
(scheduler role, vLLM's own VllmConfig) against a real sidecar process: its lookups, the metadata it sends the
workers, and what it does while the sidecar is stopped (SIGSTOP) and after. Prints one JSON line starting with @@."""
import os
import pickle
import signal
import json
import sys
import time
from types import SimpleNamespace

import torch

args = json.loads(sys.argv[1])
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from promptcache.client import PromptCacheClient  # noqa: E402
from promptcache.client import vllm_connector as vc  # noqa: E402
from promptcache.client.metrics import UNIDENTIFIED  # noqa: E402
from promptcache.contract.keys import chunk_keys, fingerprint  # noqa: E402

if os.environ.get("PROMPTCACHE_PROBE_SKIP_LAYOUT"):
    # vLLM's CUDA wheel without a GPU: the compiled ops that the start-up layout check runs do not load (the workers'
    # layouts are tested by tests/vllm/test_vllm_cuda_layouts.py and the GPU lane); the scheduler's decisions are not
    # affected by it.
    vc.PromptCacheConnector._check_layout_from_config = lambda self, vllm_config: None

CT = 256
LOOKUP_TIMEOUT, RETRY = 0.25, 1.0
tokens = list(range(1000, 1600))
params = SamplingParams(max_tokens=1)
n = [0]


def req(toks=tokens, **kw):
    n[0] += 1
    return Request(f"r{n[0]}", toks, params, None, **kw)


def image(ident, offset=10, length=64, modality="image"):
    return MultiModalFeatureSpec(data=None, modality=modality, identifier=ident,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


loras = args["loras"]
embeds_a = torch.randn(600, 576, generator=torch.Generator().manual_seed(1))
embeds_b = embeds_a.clone()
embeds_b[599, 0] += 1.0
requests = {
    "plain": req(),
    "salted": req(cache_salt="tenant-x"),
    "lora_a": req(lora_request=LoRARequest("A", 1, loras["A"])),
    "lora_b": req(lora_request=LoRARequest("B", 2, loras["B"])),
    "lora_a_renamed": req(lora_request=LoRARequest("A2", 3, loras["A"])),
    "lora_a_other_weights": req(lora_request=LoRARequest("A", 1, loras["A_changed"])),
    "image_1": req(mm_features=[image("img-1")]),
    "image_2": req(mm_features=[image("img-2")]),
    "image_1_moved": req(mm_features=[image("img-1", offset=11)]),
    "image_1_then_2": req(mm_features=[image("img-1"), image("img-2", offset=300)]),
    "audio_1": req(mm_features=[image("img-1", modality="audio")]),
    "lora_a_image_1": req(lora_request=LoRARequest("A", 1, loras["A"]), mm_features=[image("img-1")]),
    "embeds_a": req(None, prompt_embeds=embeds_a),
    "embeds_b": req(None, prompt_embeds=embeds_b),
}


def legacy_spec(base, r):
    """The derivation before issue 26 (cache_salt only): the negative control."""
    import hashlib
    from dataclasses import replace

    salt = getattr(r, "cache_salt", None)
    if not salt:
        return base
    return replace(base, tenant_salt=hashlib.sha256(base.tenant_salt + b"\0" + salt.encode()).digest())


t0 = time.monotonic()
mc = ModelConfig(model=args["model_dir"], dtype="float32", max_model_len=2048, enforce_eager=True)
kt = KVTransferConfig(kv_connector="PromptCacheConnector", kv_connector_module_path="promptcache.client.vllm_connector",
                      kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={"address": args["address"], "load_timeout": 5.0,
                                                 "lookup_timeout": LOOKUP_TIMEOUT, "retry_interval": RETRY})
cfg = VllmConfig(model_config=mc, kv_transfer_config=kt, cache_config=CacheConfig(block_size=128))
conn = vc.PromptCacheConnector(cfg, KVConnectorRole.SCHEDULER)
base = conn.base_spec
out = {"disabled": conn.disabled, "keys": {}, "legacy_keys": {}}
for name, r in requests.items():
    toks = vc.prompt_tokens(r)
    out["keys"][name] = [k.hex() for k in chunk_keys(fingerprint(vc.request_spec(base, r)), toks, CT)]
    out["legacy_keys"][name] = [k.hex() for k in chunk_keys(fingerprint(legacy_spec(base, r)), list(r.prompt_token_ids or [0] * r.num_prompt_tokens), CT)]

bad = {
    "mm_without_hash": req(mm_features=[image("")]),
    "lora_without_files": req(lora_request=LoRARequest("C", 4, args["empty_dir"])),
    "embeds_not_a_tensor": req(None, prompt_embeds=torch.zeros(600, 4)),
}
bad["embeds_not_a_tensor"].prompt_embeds = [[0.0] * 4] * 600
out["bad"] = {}
for name, r in bad.items():
    try:
        vc.request_spec(base, r)
        out["bad"][name] = "identified"
    except vc.Unidentifiable as exc:
        out["bad"][name] = exc.reason

# Retention hints from the request's kv_transfer_params (as the OpenAI API passes them, through extra_args):
# well-formed ones are read, malformed ones ignored (the request is still served and stored, without hints).
def hinted(kv_transfer_params):
    return Request(f"h{len(out.setdefault('hints', {}))}", tokens,
                   SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv_transfer_params}), None)


for name, hint_params in {"none": None, "other_connector": {"do_remote_prefill": True},
                     "ttl_and_pin": {"promptcache": {"ttl_seconds": 3600, "priority": 1}},
                     "ttl_only": {"promptcache": {"ttl_seconds": 2.5}},
                     "negative_ttl": {"promptcache": {"ttl_seconds": -1}},
                     "nan_ttl": {"promptcache": {"ttl_seconds": float("nan")}},
                     "string_ttl": {"promptcache": {"ttl_seconds": "1h"}},
                     "priority_7": {"promptcache": {"priority": 7}},
                     "priority_true": {"promptcache": {"priority": True}},
                     "unknown_key": {"promptcache": {"ttl": 60}},
                     "not_an_object": {"promptcache": [1]}}.items():
    out.setdefault("hints", {})[name] = list(vc.retention_hints(hinted(hint_params)))
# an int beyond any float: vLLM 0.32's SamplingParams refuses it, retention_hints must not raise on it either
out["hints"]["huge_int_ttl"] = list(vc.retention_hints(SimpleNamespace(
    request_id="h", kv_transfer_params={"promptcache": {"ttl_seconds": 10 ** 400}})))

# A real connector against a real sidecar: chunks stored under the base spec (what every one of these requests
# would have been keyed with before) for `tokens`; which requests does the connector load them for?
client = PromptCacheClient(args["address"], timeout=10)
L, H, D = base.num_layers, base.num_kv_heads, base.head_dim
blobs = {i: torch.randn(L, 2, H, CT, D) for i in range(2)}
client.put_blobs(base, tokens[:2 * CT], blobs, timeout=30)


def matched(r, deadline=60.0):
    end = time.monotonic() + deadline
    while True:
        got, _ = conn.get_num_new_matched_tokens(r, 0)
        if got is not None or time.monotonic() > end:
            return got
        time.sleep(0.02)


def unidentified():
    return sum(s.value for f in UNIDENTIFIED.collect() for s in f.samples if s.name.endswith("_total"))


out["matched"] = {name: matched(requests[name]) for name in ("plain", "lora_a", "image_1", "salted")}
before = unidentified()
r = req(mm_features=[image("")])
out["matched"]["mm_without_hash"] = matched(r)
conn.update_state_after_alloc(r, None, 0)
out["unidentified_counted"] = unidentified() - before
out["unidentified_tracked"] = r.request_id in conn._tracked

# The metadata the scheduler sends every worker each step, for a 4k-token prompt whose 15 whole chunks are cached:
# block ids, the spec and the tokens, no KV bytes.
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from types import SimpleNamespace  # noqa: E402

long_tokens = list(range(20000, 24096))
client.put_blobs(base, long_tokens[:15 * CT], {i: torch.randn(L, 2, H, CT, D) for i in range(15)}, timeout=60)
r = req(long_tokens)
out["matched"]["long"] = matched(r)
conn.update_state_after_alloc(r, KVCacheBlocks(blocks=([KVCacheBlock(i) for i in range(32)],)), out["matched"]["long"])
meta = conn.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                                 scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))
out["meta_loads"] = [(len(op.block_ids), len(op.tokens), op.first_chunk) for op in meta.loads]
out["meta_bytes"] = len(pickle.dumps(meta))
out["kv_bytes_of_the_load"] = 15 * L * 2 * H * CT * D * 4

# Two requests with the same cached prefix, vLLM's prefix cache on: the second waits ("ask again later") while the
# first loads it, rather than fetching it twice; once the first's load is reported finished it is answered.
out["dedupe_enabled"] = conn._dedupe
r1, r2 = req(), req()
first_hit = matched(r1)
conn.update_state_after_alloc(r1, KVCacheBlocks(blocks=([KVCacheBlock(i) for i in range(32, 40)],)), first_hit)
conn.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))
out["dedupe"] = {"first": first_hit, "second_while_loading": matched(r2, deadline=1.0)}
conn.update_connector_output(SimpleNamespace(finished_recving={r1.request_id}))
out["dedupe"]["second_after"] = matched(r2)

# The sidecar stops answering (SIGSTOP) while requests arrive: no call of the scheduler's may wait for it.
pid = args["sidecar_pid"]
os.kill(pid, signal.SIGSTOP)
try:
    stalled = req(list(range(30000, 30600)))
    calls, t_start = [], time.monotonic()
    while True:
        t = time.perf_counter()
        got, is_async = conn.get_num_new_matched_tokens(stalled, 0)
        calls.append(time.perf_counter() - t)
        if got is not None:
            break
        time.sleep(0.005)
    out["stalled"] = {"answer": got, "async": is_async, "asks": len(calls), "waited": time.monotonic() - t_start,
                      "max_call": max(calls)}
    others = []
    for i in range(20):  # other requests arriving while it is stopped: a fast 0 each (the sidecar is marked down)
        t = time.perf_counter()
        got = conn.get_num_new_matched_tokens(req(list(range(40000 + 600 * i, 40600 + 600 * i))), 0)
        others.append((time.perf_counter() - t, got[0]))
    out["others"] = {"max_call": max(c for c, _ in others), "answers": sorted({a for _, a in others})}
finally:
    os.kill(pid, signal.SIGCONT)
# Answers again: after the retry interval the next request asks it again and hits.
time.sleep(RETRY + 0.1)
from promptcache.client.metrics import RECONNECTS  # noqa: E402

out["after"] = matched(req())
out["reconnects"] = sum(s.value for f in RECONNECTS.collect() for s in f.samples if s.name.endswith("_total"))
# Malformed settings are refused at start, naming the key and its variable (float("1s") named neither; an address
# gRPC would dial elsewhere, 99999 as 34463, was taken).
out["bad_settings"] = {}
for name, patch in {"load_timeout 1s": {"load_timeout": "1s"}, "lookup_timeout nan": {"lookup_timeout": "nan"},
                    "save_timeout 0": {"save_timeout": 0}, "max_pending_saves 2.5": {"max_pending_saves": 2.5},
                    "max_pending_saves 0": {"max_pending_saves": 0},
                    "tenant_salt with NUL": {"tenant_salt": "acme\0team"},
                    "address port 99999": {"address": "127.0.0.1:99999"}}.items():
    bad = KVTransferConfig(kv_connector="PromptCacheConnector",
                           kv_connector_module_path="promptcache.client.vllm_connector", kv_role="kv_both",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"address": args["address"], **patch})
    try:
        vc.PromptCacheConnector(VllmConfig(model_config=mc, kv_transfer_config=bad,
                                           cache_config=CacheConfig(block_size=128)), KVConnectorRole.SCHEDULER)
        out["bad_settings"][name] = "accepted"
    except ValueError as exc:
        out["bad_settings"][name] = str(exc)
# The model's identity (engine_identity): the same engine config, the same revision (scheduler and workers, every
# pod of a deployment); what changes K/V for the same weights - RoPE overrides, max_model_len (LongRoPE), the
# compute dtype - a different one; weights that are random (load_format dummy), or a failure policy that would fail
# requests, an inert connector.
from vllm.config import LoadConfig, WeightTransferConfig  # noqa: E402


def engine(policy="recompute", load_format="auto", weight_transfer=None, **model):
    kw = {"model": args["model_dir"], "dtype": "float32", "max_model_len": 2048, "enforce_eager": True, **model}
    transfer = KVTransferConfig(kv_connector="PromptCacheConnector",
                                kv_connector_module_path="promptcache.client.vllm_connector", kv_role="kv_both",
                                kv_connector_extra_config={"address": args["address"]},
                                **({"kv_load_failure_policy": policy} if policy else {}))
    c = vc.PromptCacheConnector(VllmConfig(model_config=ModelConfig(**kw), kv_transfer_config=transfer,
                                           cache_config=CacheConfig(block_size=128),
                                           load_config=LoadConfig(load_format=load_format),
                                           weight_transfer_config=weight_transfer), KVConnectorRole.SCHEDULER)
    return {"revision": c.base_spec.revision, "disabled": c.disabled}


import tempfile  # noqa: E402

# A fine-tune whose first and last MiB of weights (embeddings, head) are its base's: the digest sees the middle too.
with tempfile.TemporaryDirectory() as d:
    body = os.urandom(8 << 20)
    middle = (8 << 20) * 32 // 65 + 100  # inside the window read at 32/65 of the file
    digests = []
    for name, data in (("base", body), ("tuned", body[:middle] + bytes([body[middle] ^ 1]) + body[middle + 1:])):
        os.makedirs(os.path.join(d, name))
        with open(os.path.join(d, name, "model.safetensors"), "wb") as f:
            f.write(data)
        digests.append(vc.weights_digest(os.path.join(d, name)))
    with open(os.path.join(d, "base", "config.json"), "w") as f:
        f.write('{"rope_theta": 10000}')
    digests.append(vc.weights_digest(os.path.join(d, "base")))
    # one changed byte anywhere (a fine-tune of one layer)
    os.makedirs(os.path.join(d, "one_layer"))
    at = (3 << 20) + 45000  # between two of the windows the digest used to sample
    with open(os.path.join(d, "one_layer", "model.safetensors"), "wb") as f:
        f.write(body[:at] + bytes([body[at] ^ 1]) + body[at + 1:])
    os.remove(os.path.join(d, "base", "config.json"))
    digests += [vc.weights_digest(os.path.join(d, "one_layer")), vc.weights_digest(os.path.join(d, "base"))]
    # an adapter rewritten in place with its size and mtime kept (cp -p, rsync -a): a new digest in this process
    adapter = os.path.join(d, "adapter")
    os.makedirs(adapter)
    weights = os.path.join(adapter, "adapter_model.safetensors")
    with open(weights, "wb") as f:
        f.write(os.urandom(1 << 16))
    first = vc.adapter_digest(adapter)
    stat = os.stat(weights)
    time.sleep(0.01)
    with open(weights, "r+b") as f:
        f.write(os.urandom(1 << 16))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    out["adapter_rewritten"] = {"size_and_mtime_kept": (os.stat(weights).st_size, os.stat(weights).st_mtime_ns)
                                == (stat.st_size, stat.st_mtime_ns), "digest_changed": vc.adapter_digest(adapter) != first}
out["weights_digests"] = digests

# Multimodal items that vLLM names by a request counter (its prefix caching off and mm_processor_cache_gb 0: it skips
# the content hash): the names vLLM's own renderer gives two engines' first images, which are the same for a cat and
# a dog. Unidentifiable there, identified where vLLM hashes contents, and a client's own uuid is taken as given.
from vllm.multimodal.parse import MultiModalDataParser, parse_mm_uuids  # noqa: E402
from vllm.multimodal.processing.inputs import ProcessorInputs  # noqa: E402
from vllm.renderers.base import BaseRenderer  # noqa: E402
from vllm.utils.counter import AtomicCounter  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402


def first_image_identifier(picture, prefix_caching: bool, uuids=None):
    """What a fresh engine's renderer names its first image (the attributes _process_mm_uuids reads, and its own
    counter, as BaseRenderer.__init__ makes it)."""
    renderer = SimpleNamespace(config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching)),
                               model_config=SimpleNamespace(multimodal_config=SimpleNamespace(mm_processor_cache_gb=0)),
                               api_process_rank=0, _mm_req_counter=AtomicCounter(),
                               _validate_mm_uuids=lambda *a: BaseRenderer._validate_mm_uuids(None, *a))
    data = {"image": picture}
    items = MultiModalDataParser().parse_mm_data(data)
    req_id = f"renderer0-mm-{renderer._mm_req_counter.inc(1)}"
    named = BaseRenderer._process_mm_uuids(renderer, data, items, parse_mm_uuids(uuids), req_id)
    return ProcessorInputs([], items, named).get_mm_hashes("m", "blake3")["image"][0]


cat, dog = (Image.fromarray(np.full((32, 32, 3), v, np.uint8)) for v in (10, 200))


def mm_spec(ident, hashed):
    try:
        return fingerprint(vc.request_spec(base, req(mm_features=[image(ident)]), hashed)).hex()
    except vc.Unidentifiable as exc:
        return exc.reason


unhashed = [first_image_identifier(p, False) for p in (cat, dog)]
hashed = [first_image_identifier(p, True) for p in (cat, dog)]
out["mm_unhashed"] = {"same_name": unhashed[0] == unhashed[1], "spec": mm_spec(unhashed[0], False),
                      "hashed_names_differ": hashed[0] != hashed[1], "hashed_spec": mm_spec(hashed[0], True) != "multimodal",
                      "client_uuid": mm_spec(first_image_identifier(cat, False, {"image": ["cat-v1"]}), False),
                      "this_engine": vc.mm_content_hashed(cfg)}

same = engine()
from vllm.config import MultiModalConfig  # noqa: E402


def with_mm_kwargs(kwargs):
    """The identity of an engine whose model has multimodal settings (a text model with a MultiModalConfig put on)."""
    c = VllmConfig(model_config=ModelConfig(model=args["model_dir"], dtype="float32", max_model_len=2048,
                                            enforce_eager=True), kv_transfer_config=kt,
                   cache_config=CacheConfig(block_size=128))
    c.model_config.multimodal_config = MultiModalConfig(mm_processor_kwargs=kwargs)
    return vc.engine_identity(c)[0]


out["mm_engine_settings"] = [with_mm_kwargs({"fps": 1}), with_mm_kwargs({"fps": 1}), with_mm_kwargs({"fps": 2})]
out["identity"] = {
    "base": same, "again": engine(), "max_model_len": engine(max_model_len=1024),
    "rope": engine(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "dtype": engine(dtype="bfloat16"), "dummy": engine(load_format="dummy"), "policy_default": engine(policy=None),
    "weight_transfer": engine(weight_transfer=WeightTransferConfig(backend="nccl")),
}

# vLLM resets the connector with its prefix cache (a pause that clears the caches, around an RL weight update):
# the chunks stored before are no longer looked up, a request admitted before is not stored, one admitted after is,
# under the new revision. (kv_cache_manager: the one call the save path makes on vLLM's KVCacheManager, get_blocks.)
blocks = KVCacheBlocks(blocks=([KVCacheBlock(i) for i in range(100, 105)],))
conn._kv_cache_manager = SimpleNamespace(get_blocks=lambda req_id: blocks)


def step(*requests):
    return conn.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0) for r in requests],
        num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in requests}, total_num_scheduled_tokens=1,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))


control = req(list(range(50000, 50600)))
conn.update_state_after_alloc(control, blocks, 0)
admitted = req(list(range(51000, 51600)))
conn.update_state_after_alloc(admitted, blocks, 0)
revision = conn.base_spec.revision
out["reset"] = {"control_saves": [op.spec.revision == revision for op in step(control).saves],
                "hit_before": matched(req()), "returned": conn.reset_cache()}
late = req(list(range(52000, 52600)))
conn.update_state_after_alloc(late, blocks, 0)
out["reset"].update(revision_changed=conn.base_spec.revision != revision, hit_after=matched(req()),
                    saves=[(op.req_id == late.request_id, op.spec.revision == conn.base_spec.revision)
                           for op in step(admitted, late).saves])
# A sidecar that answers a Lookup wrongly (buggy, or another process on its address): more tokens than the prompt
# has (vLLM asserts), not whole chunks or the whole prompt (vLLM would wait forever for a load that cannot be placed),
# chunk_tokens 0 (a division by zero in the scheduler) or another chunk size than before. The answers are made up
# here - the real sidecar never gives them; each must be a miss, never an engine error.
liar = vc.PromptCacheConnector(cfg, KVConnectorRole.SCHEDULER)
real_lookup = liar.client.lookup
out["bad_answers"] = {}
for name, answer in {"beyond": lambda n: (n + 1 + 256, 256), "unaligned": lambda n: (384, 256),
                     "whole_prompt": lambda n: (n + 1, 256), "chunk_tokens_0": lambda n: (256, 0),
                     "chunk_tokens_changed": lambda n: (512, 512)}.items():
    liar.chunk_tokens = 256 if name == "chunk_tokens_changed" else 0
    liar.client.lookup = lambda spec, toks, timeout=None, answer=answer: SimpleNamespace(
        cached_tokens=answer(len(toks))[0], chunk_tokens=answer(len(toks))[1])
    r = req()
    deadline = time.monotonic() + 30
    while (got := liar.get_num_new_matched_tokens(r, 0)[0]) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    out["bad_answers"][name] = got
liar.client.lookup = real_lookup
# vLLM asking to load tokens no Lookup answered: a load that reports their blocks failed, never none (a wait forever)
orphan = req()
liar.update_state_after_alloc(orphan, KVCacheBlocks(blocks=([KVCacheBlock(i) for i in range(200, 205)],)), 256)
meta = liar.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                 total_num_scheduled_tokens=0,
                                                 scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                                                                                       num_computed_tokens=[])))
out["orphan_load"] = [(op.req_id == orphan.request_id, len(op.tokens), op.block_ids) for op in meta.loads]
liar.shutdown()
out["seconds"] = time.monotonic() - t0
print("@@" + json.dumps(out), flush=True)
