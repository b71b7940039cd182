"""Issue 29: the KV caches a CUDA worker gets from vLLM 0.32, built on this CPU with vLLM's own allocator, written by
vLLM's own Triton cache-write kernel (in Triton's interpreter), saved by the connector's worker side to a real sidecar
and loaded by a second connector's load path into a second, empty set of caches: bit for bit, for LBNHC and LBHNC in
fp32, fp16 and bf16; fp8 (e4m3fn, e5m2) and MLA caches through the connector too (fp8: raw bytes under keys carrying
the per-layer scales; MLA: latents of a small random DeepSeek-V3 config, TP rank 1 loading rank 0's chunks);
negative controls. One vLLM-venv subprocess
(tests/vllm/_cuda_layouts_probe.py) does it all, this side asserts."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from promptcache_devtools import models
from support import SidecarProcess, run_vllm_probe

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]
DST_BLOCKS = [3, 7, 1, 8]  # _cuda_layouts_probe.py: two chunks of 32 tokens in blocks of 16
CASES = [f"{layout}-{dtype}" for layout in ("LBNHC", "LBHNC") for dtype in ("float32", "float16", "bfloat16")]


@pytest.fixture(scope="module")
def probe():
    sidecar = SidecarProcess("--memory-bytes", "512Mi", "--chunk-tokens", "32").wait_ready(60)
    try:
        arg = {"model_dir": str(models.smollm2_dir()), "address": sidecar.address, "chunk_tokens": 32}
        yield run_vllm_probe(VLLM_PYTHON, Path(__file__).with_name("_cuda_layouts_probe.py"), arg)
    finally:
        sidecar.stop()


@pytest.mark.parametrize("case", CASES)
def test_the_connector_is_active_and_round_trips_vllm_kernel_writes_bit_for_bit(probe, case):
    r = probe["cases"][case]
    layout = case.split("-")[0]
    assert r["disabled"] is None
    assert r["layout"] == f"paged {layout}"
    assert r["kernel_wrote_what_it_was_given"]  # vLLM's Triton writer put K/V where the kernels read them
    assert r["paged_views_match_vllm"]  # vllm_paged.paged_views (the GPU lane's caches) = vLLM's allocator's
    assert r["stored_chunks"] == 2 and r["stored_is_canonical"]  # the sidecar holds [L, 2, H, T, D] of those K/V
    assert r["load_errors"] == [] and r["finished"] == ["load"]
    assert r["loaded_bit_exact"] and r["blocks_equal"]  # the second cache set, read as the kernels read it
    assert r["other_blocks_zero"]  # and nothing outside the loaded blocks was touched


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_manager_blocks_split_into_kernel_blocks_round_trip(probe, layout):
    """block_size 32 in kernel blocks of 16 (vLLM's allocator with kernel_block_sizes): the views hold twice the
    blocks, the connector's block ids are manager blocks, the scheduler side is active too."""
    r = probe["cases"][f"{layout}-bfloat16-kernel16"]
    assert r["disabled"] is None and r["scheduler_disabled"] is None
    assert r["layout"] == f"paged {layout}, kernel blocks of 16"
    assert r["view_shape"][0] % 2 == 0 and r["view_shape"][2] == 16
    assert r["load_errors"] == [] and r["loaded_bit_exact"]


def test_an_idle_step_waits_for_the_load_in_flight_and_only_then(probe):
    r = probe["cases"]["LBNHC-float32"]
    assert r["idle_step_finished"] == ["idle"]  # reported by the first get_finished: it waited for the load
    assert r["idle_step_nothing_loading_seconds"] < 1.0  # idle_wait is 60 s: nothing loading, no wait


def test_a_chunk_evicted_after_the_lookup_fails_only_its_own_blocks(probe):
    r = probe["cases"]["LBNHC-float32"]
    assert r["partial_load_errors"] == sorted(DST_BLOCKS[2:])  # the evicted second chunk's blocks: recomputed
    assert r["partial_first_chunk_exact"]  # the first chunk's blocks, fetched in the Get before, are written


def test_the_two_layouts_are_really_different_strides(probe):
    """LBNHC: token-major inside a block ([N, H, C]); LBHNC: head-major ([H, N, C]), as vLLM's allocator gives them."""
    H, N, C = 3, 16, 128
    assert probe["cases"]["LBNHC-float32"]["strides"] == [N * H * C, C, H * C, 1]
    assert probe["cases"]["LBHNC-float32"]["strides"] == [H * N * C, N * C, C, 1]


@pytest.mark.parametrize("case", CASES)
def test_negative_control_the_other_layouts_conversion_fails(probe, case):
    """The same stored chunks scattered as if the cache had the other layout's strides: the kernels' view of the
    cache no longer holds the K/V (the comparison above can fail)."""
    assert probe["cases"][case]["wrong_conversion_matches"] is False


def test_an_engine_layout_that_the_strides_contradict_leaves_the_connector_inert(probe):
    assert "the engine says KV cache layout LBHNC but the views' strides" in probe["inert"]["layout_mismatch"]


def test_a_hybrid_model_with_the_hybrid_allocator_off_is_cached(probe):
    """Every other layer sliding-window; vLLM turns its hybrid allocator off for this connector (not SupportsHMA), so
    get_kv_cache_groups promotes those layers to full allocation: one group, every token's K/V in its block, cached
    and loaded bit for bit."""
    r = probe["cases"]["hybrid-hma-off"]
    assert r["groups"] == [["FullAttentionSpec", 30, 32]]
    assert r["disabled"] is None and r["scheduler_disabled"] is None and r["layout"] == "paged LBNHC"
    assert r["load_errors"] == [] and r["loaded_bit_exact"]


def test_a_hybrid_model_with_the_hybrid_allocator_on_is_inert_with_its_reason_on_both_sides(probe):
    for side in ("hybrid", "hybrid_scheduler", "hybrid_cpu_path"):
        assert "hybrid model: 2 KV cache groups (FullAttentionSpec, SlidingWindowSpec)" in probe["inert"][side]


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_fp8_caches_convert_as_raw_bytes(probe, layout):
    """vLLM's fp8 caches are uint8; the Triton writer's bytes (exactly representable values, scales 2 and 0.5) are
    torch's own e4m3fn conversion, gathered as is and scattered back bit for bit. The writer stores e4m3fn even for
    "fp8_e5m2" (it views the cache as current_platform.fp8_dtype()): the bytes' format is the backend's, not the
    string's, which is why kv_format must come from the backend that writes them."""
    e4m3 = probe["fp8"][f"{layout}-fp8"]
    assert e4m3["dtype"] == "torch.uint8" and e4m3["chunk_dtype"] == "torch.float8_e4m3fn"
    assert e4m3["matches_torch_fp8"] and e4m3["round_trip"]
    assert e4m3["kv_format"].startswith("float8_e4m3fn/scales-")
    e5m2 = probe["fp8"][f"{layout}-fp8_e5m2"]
    assert e5m2["round_trip"]
    assert e5m2["matches_torch_e4m3fn"] and not e5m2["matches_torch_fp8"]


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_fp8_caches_round_trip_through_the_connector_and_a_real_sidecar(probe, layout, fmt):
    """The connector is active for fp8: 30 layers (4 written by vLLM's Triton fp8 path, 26 holding every byte
    pattern, NaN patterns included) saved as raw bytes, loaded into empty caches bit for bit; the scheduler computes
    the same keys (the scales from the config, kv_scales) and finds the chunks."""
    r = probe["fp8"][f"{layout}-{fmt}"]["connector"]
    assert r["disabled"] is None and r["scheduler_disabled"] is None and r["layout"] == f"paged {layout}"
    assert r["spec"] == ["float8_e4m3fn" if fmt == "fp8" else "float8_e5m2", "kv", 30, 3, 64]
    assert r["nan_patterns"] and r["stored_chunks"] == 2 and r["stored_is_gather"]
    assert r["load_errors"] == [] and r["blocks_equal"] and r["other_blocks_zero"]
    assert r["scheduler_spec_is_workers"] and r["scheduler_hit"] == 64


def test_fp8_chunks_stored_under_scales_a_are_a_miss_under_scales_b(probe):
    c = probe["fp8_controls"]
    assert c["scales_b_disabled"] is None and c["specs_differ_only_in_salt"]  # an active connector, other scales
    assert c["scales_b_scheduler_hit"] == 0  # its Lookup misses
    assert c["scales_b_load_errors"] == [3, 7, 1, 8] or sorted(c["scales_b_load_errors"]) == [1, 3, 7, 8]
    assert c["scales_b_untouched"]  # and a load it was told to do writes nothing: the blocks are recomputed
    assert c["unit_disabled"] == [None, None] and c["unit_hit_for_a"] == 0


def test_fp8_scales_that_are_not_the_keys_leave_the_connector_inert_with_the_reason(probe):
    inert, a = probe["inert"], probe["fp8_controls"]["scales_a_hex"]
    assert f"is not the configured kv_scales {a}" in inert["fp8_scales_mismatch"]
    assert "fp8 KV scales are not all 1.0" in inert["fp8_not_unit"] and a in inert["fp8_not_unit"]
    assert "no attention layer" in inert["fp8_no_scales"]
    assert "calculate_kv_scales" in inert["fp8_calculated"]
    assert "kv_cache_scheme" in inert["fp8_checkpoint_scales"]
    assert "quantization 'k8v8' with an fp8 KV cache" in inert["fp8_quantization"]
    # vLLM's Triton backend writes e4m3fn bytes for "fp8_e5m2": not what an e5m2 key names
    assert "fp8_e5m2 KV cache with attention backend TRITON_ATTN" in inert["fp8_e5m2_triton"]


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_mla_latents_convert_one_vector_per_token(probe, layout):
    m = probe["mla"][layout]
    assert m["shape"] == [30, 1, 1, 64, 576] and m["is_latent"] and m["round_trip"] and m["kv_format"] == "mla"
    # MLA caches for a non-MLA model (SmolLM2): inert
    assert "KV cache spec MLAAttentionSpec for a non-MLA model" in probe["inert"][f"mla-{layout}"]


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_mla_latents_round_trip_through_the_connector_on_every_tp_rank(probe, layout):
    """A small random DeepSeek-V3 config (vLLM: use_mla, head size 576): the connector is active, stores the
    latents [4, 1, 1, T, 576] once and loads them bit for bit; TP rank 1 loads rank 0's chunks and stores nothing; a
    non-MLA spec of the same chunk bytes or head size misses them; plain K/V caches for the MLA model are refused."""
    r = probe["mla"][layout]["connector"]
    # one latent "head": LBNHC and LBHNC are the same bytes, and the strides name the first (vllm_paged.physical_order)
    assert r["use_mla"] and r["disabled"] is None and r["layout"] == "paged LBHNC"
    assert r["spec"] == ["bfloat16", "mla", 4, 1, 576]
    assert r["stored_chunks"] == 2 and r["stored_shape"] == [4, 1, 1, 64, 576] and r["stored_is_latent"]
    assert r["load_errors"] == [] and r["loaded_bit_exact"]
    assert r["kv_spec_hits"] == [0, 0]
    assert r["scheduler_disabled"] is None and r["scheduler_hit"] == 64
    t = r["tp2_rank1"]
    assert t["disabled"] is None and not t["saves"] and t["spec_is_rank0s"]
    assert t["load_errors"] == [] and t["loaded_bit_exact"] and t["stored_by_rank1"] == 0
    assert r["tp2_scheduler"] == {"disabled": None, "lookup_shards": 1, "hit": 64}
    assert "KV cache spec FullAttentionSpec for an MLA model" in r["kv_caches_for_mla_model"]


def test_mla_latents_in_an_fp8_cache_round_trip_through_the_connector(probe):
    """--kv-cache-dtype fp8 on the MLA model: uint8 latents (every byte pattern) stored as float8_e4m3fn mla chunks
    under the unit scales' keys, loaded bit for bit, found by the scheduler; DeepSeek's packed fp8_ds_mla is inert."""
    r = probe["mla"]["fp8-connector"]
    assert r["disabled"] is None and r["spec"] == ["float8_e4m3fn", "mla", 4, 1, 576]
    assert r["load_errors"] == [] and r["blocks_equal"] and r["scheduler_hit"] == 64
    assert "fp8_ds_mla" in probe["inert"]["fp8_ds_mla"]
