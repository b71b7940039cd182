"""Run by tests/vllm/test_vllm_cuda_layouts.py with the vLLM virtualenv's python (issue 29): the KV caches a CUDA
worker gets, built on the CPU with vLLM's own allocator (get_kv_cache_config_from_groups, allocate_kv_cache) for
each KVCacheLayout and dtype, K/V written by vLLM's own Triton cache-write kernel (triton_reshape_and_cache_flash,
the CUDA backends' writer) in Triton's interpreter, then the connector's worker-side save (a worker-role
PromptCacheConnector, kv_layout "paged") against a real sidecar, a load through a second connector's load path into a
second, empty set of caches, and comparisons. Prints one JSON line starting with @@.

The Triton kernel: vLLM's CPU build disables Triton (vllm.triton_utils: no triton-cpu backend), so the kernel's
module is executed from vLLM's own source file with the real triton bound instead of vLLM's placeholder, and the
platform queries it makes (device capability, fp8 dtype) answered as an SM90 GPU would. The stride arithmetic and
the kernel are vLLM's, unchanged. The interpreter's fp8 rounding is not the GPU's, so fp8 K/V are values fp8 holds
exactly and the bytes are also checked against torch's own fp8 conversion. MLA caches have no Triton writer in vLLM
(concat_and_cache_mla is a CUDA op): they are written per slot by torch, as that op addresses them."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402,F401 - the real one, for the kernel module

args = json.loads(sys.argv[1])

import vllm.v1.attention.ops as vllm_ops  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from promptcache.client import PromptCacheClient  # noqa: E402
from promptcache.client import vllm_connector as vc  # noqa: E402
from promptcache.client import vllm_paged as vp  # noqa: E402
from promptcache.client.client import checked_chunks  # noqa: E402
from promptcache.contract import keys as vc_keys  # noqa: E402


def load_triton_writer():
    path = Path(vllm_ops.__file__).with_name("triton_reshape_and_cache_flash.py")
    src = path.read_text()
    marker = "from vllm.triton_utils import tl, triton"
    if marker not in src:
        raise RuntimeError(f"{path} no longer imports triton as {marker!r}")
    src = src.replace(marker, "import triton\nimport triton.language as tl")
    mod = types.ModuleType("vllm_triton_cache_write")
    exec(compile(src, str(path), "exec"), mod.__dict__)

    class SM90:
        def has_device_capability(self, capability):
            return True

        def is_rocm(self):
            return False

        def is_xpu(self):
            return False

        def fp8_dtype(self):
            return torch.float8_e4m3fn

    mod.current_platform = SM90()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    return mod.triton_reshape_and_cache_flash


write_kernel = load_triton_writer()
MODEL = args["model_dir"]
L, H, D, N, CT = 30, 3, 64, 16, args["chunk_tokens"]  # SmolLM2-135M: 30 layers, 3 KV heads of 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
SRC_BLOCKS, DST_BLOCKS = [5, 2, 9, 0], [3, 7, 1, 8]  # 64 tokens: two chunks of 32
T = len(SRC_BLOCKS) * N
out = {"cases": {}, "fp8": {}, "mla": {}, "inert": {}}


def config(dtype: str, layout: str, cache_dtype: str = "auto", block_size: int = N, model: str = MODEL, **extra):
    mc = ModelConfig(model=model, dtype=dtype, max_model_len=2048, enforce_eager=True)
    kt = KVTransferConfig(kv_connector="PromptCacheConnector",
                          kv_connector_module_path="promptcache.client.vllm_connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={
                              "address": args["address"], "load_timeout": 10.0, "kv_layout": "paged",
                              "model_id": f"cuda-layouts-{layout}-{dtype}",
                              # given: the workers leave the default identity (a digest of the weights) to the
                              # scheduler, and these cases save from a worker's own base_spec
                              "revision": "random-weights", **extra})
    cfg = VllmConfig(model_config=mc, kv_transfer_config=kt, cache_config=CacheConfig(block_size=block_size))
    cfg.cache_config.kv_cache_layout = layout
    cfg.cache_config.cache_dtype = cache_dtype
    return cfg


def caches(cfg, spec, layout: str, names=NAMES, groups=None, blocks=12, kernel_block_sizes=None):
    groups = groups or [KVCacheGroupSpec(list(names), spec)]
    kc = get_kv_cache_config_from_groups(cfg, groups, blocks * sum(g.kv_cache_spec.page_size_bytes *
                                                                   len(g.layer_names) for g in groups))
    return kc, allocate_kv_cache(kc, torch.device("cpu"), KVCacheLayout[layout], kernel_block_sizes)


def kernel_views(view, head_size=D):
    return view.transpose(1, 2).split(head_size, dim=-1)  # as the CUDA backends split [B, H, N, K|V]


def slots(block_ids, block_size=N):
    return torch.tensor([b * block_size + n for b in block_ids for n in range(block_size)], dtype=torch.long)


def bits(t):
    return t.contiguous().view(torch.uint8)


def read_back(views, block_ids, dtype, block_size=N):
    """K and V of the tokens in `block_ids`, read the way the attention kernels address the cache: [L, T, H, D]
    (slot = block id * block size + offset, addressed in the views' kernel blocks)."""
    s = slots(block_ids, block_size)
    ks, vs = [], []
    for v in views:
        kc, vcache = kernel_views(v)
        nk = v.shape[2]
        ks.append(kc[s // nk, s % nk].clone())
        vs.append(vcache[s // nk, s % nk].clone())
    return torch.stack(ks), torch.stack(vs)


def other_strides(view, layout):
    B, Hh, Nn, C = view.shape
    if layout == "LBNHC":  # as if LBHNC: [B, H, N, C] contiguous
        return (Hh * Nn * C, Nn * C, C, 1)
    return (Nn * Hh * C, C, Hh * C, 1)  # as if LBNHC: [B, N, H, C] contiguous


def bind(conn, **meta):
    conn.bind_connector_metadata(vc.PromptCacheConnectorMetadata(**meta))


def saved(cfg, kc, caches, tokens, block_ids):
    """A worker connector on `caches` that saved `tokens` from `block_ids` (when it is active) and flushed."""
    saver = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
    saver.register_kv_caches(caches)
    if saver.disabled is None:
        bind(saver, saves=[vc._SaveOp("save", saver.base_spec, tokens, list(block_ids), 0, CT)])
        saver.wait_for_save()
        saver.flush()
    return saver


def loaded(cfg, kc, caches, spec, tokens, block_ids):
    """A worker connector on `caches` that loaded `tokens` (under `spec`) into `block_ids` and flushed."""
    loader = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
    loader.register_kv_caches(caches)
    bind(loader, loads=[vc._LoadOp("load", spec, tokens, list(block_ids), 0, 0, CT)])
    loader.start_load_kv(None)
    loader.flush()
    return loader


t_all = time.perf_counter()
tokens = list(range(2000, 2000 + T))
for layout in ("LBNHC", "LBHNC"):
    for dtype_name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        t0 = time.perf_counter()
        case = f"{layout}-{dtype_name}"
        cfg = config(dtype_name, layout)
        spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=dtype)
        kc, src = caches(cfg, spec, layout)
        _, dst = caches(cfg, spec, layout)
        _, wrong_dst = caches(cfg, spec, layout)
        g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
        K = torch.randn(L, T, H, D, generator=g).to(dtype)
        V = torch.randn(L, T, H, D, generator=g).to(dtype)
        one = torch.tensor(1.0)
        for i, name in enumerate(NAMES):
            kcache, vcache = kernel_views(src[name])
            write_kernel(K[i], V[i], kcache, vcache, slots(SRC_BLOCKS), "auto", one, one)
        src_views = [src[n] for n in NAMES]
        mine = vp.paged_views(layout, L, src_views[0].shape[0], H, N, 2 * D, dtype)
        paged_views_match = all(a.shape == b.shape and a.stride() == b.stride() and
                                a.data_ptr() - mine[0].data_ptr() == b.data_ptr() - src_views[0].data_ptr()
                                for a, b in zip(mine, src_views))
        kernel_ok = all(torch.equal(bits(a), bits(b)) for a, b in zip(read_back(src_views, SRC_BLOCKS, dtype), (K, V)))
        canonical = torch.stack([K, V], dim=1).permute(0, 1, 3, 2, 4).contiguous()  # [L, 2, H, T, D]

        saver = saved(cfg, kc, src, tokens, SRC_BLOCKS)
        r = {"disabled": saver.disabled, "layout": saver._layout, "kernel_wrote_what_it_was_given": kernel_ok,
             "paged_views_match_vllm": paged_views_match,
             "strides": list(src_views[0].stride())}
        if saver.disabled is None:
            base = saver.base_spec
            client = PromptCacheClient(args["address"])
            blobs = client.get_blobs(base, tokens, copy=True)
            stored = torch.cat(checked_chunks(base, blobs, CT), dim=3) if blobs else None
            r["stored_chunks"] = len(blobs)
            r["stored_is_canonical"] = stored is not None and torch.equal(bits(stored), bits(canonical))

            loader = loaded(cfg, kc, dst, base, tokens, DST_BLOCKS)
            r["load_errors"] = sorted(loader.get_block_ids_with_load_errors())
            r["finished"] = sorted(loader.get_finished(set())[1] or [])
            dst_views = [dst[n] for n in NAMES]
            got_k, got_v = read_back(dst_views, DST_BLOCKS, dtype)
            r["loaded_bit_exact"] = torch.equal(bits(got_k), bits(K)) and torch.equal(bits(got_v), bits(V))
            r["blocks_equal"] = all(torch.equal(bits(a[SRC_BLOCKS]), bits(b[DST_BLOCKS]))
                                    for a, b in zip(src_views, dst_views))
            untouched = [b for b in range(dst_views[0].shape[0]) if b not in DST_BLOCKS]
            r["other_blocks_zero"] = all(not bits(v[untouched]).any() for v in dst_views)
            # Negative control: the same chunks scattered by a conversion that assumes the other order (LBHNC
            # strides for an LBNHC cache and the reverse) instead of reading the views' strides.
            wrong_views = [torch.as_strided(wrong_dst[n], wrong_dst[n].shape, other_strides(wrong_dst[n], layout))
                           for n in NAMES]
            vp.scatter(wrong_views, saver._paged, DST_BLOCKS, stored)
            wk, wv = read_back([wrong_dst[n] for n in NAMES], DST_BLOCKS, dtype)
            r["wrong_conversion_matches"] = torch.equal(bits(wk), bits(K)) and torch.equal(bits(wv), bits(V))
            client.close()
            if case == "LBNHC-float32":
                # A step that computes nothing waits (idle_wait) for the load in flight instead of returning at
                # once; with nothing loading it does not wait at all.
                idle = vc.PromptCacheConnector(config(dtype_name, layout, idle_wait=60.0), KVConnectorRole.WORKER, kc)
                idle.register_kv_caches(dst)
                bind(idle, loads=[vc._LoadOp("idle", base, tokens, list(DST_BLOCKS), 0, 0, CT)], idle=True)
                idle.start_load_kv(None)
                r["idle_step_finished"] = sorted(idle.get_finished(set())[1] or [])
                t_idle = time.perf_counter()
                idle.get_finished(set())
                r["idle_step_nothing_loading_seconds"] = time.perf_counter() - t_idle
                idle.shutdown()
                # The second of two chunks evicted after the Lookup: the load fetches them in two Gets (LOAD_BATCHES),
                # writes the first chunk's blocks and reports exactly the second's as load errors.
                with PromptCacheClient(args["address"]) as deleter:
                    deleter.delete(base, tokens, start_chunk=1)
                _, part = caches(cfg, spec, layout)
                partial = loaded(cfg, kc, part, base, tokens, DST_BLOCKS)
                r["partial_load_errors"] = sorted(partial.get_block_ids_with_load_errors())
                pk, pv = read_back([part[n] for n in NAMES], DST_BLOCKS[:2], dtype)
                half = T // 2
                r["partial_first_chunk_exact"] = (torch.equal(bits(pk), bits(K[:, :half]))
                                                  and torch.equal(bits(pv), bits(V[:, :half])))
                partial.shutdown()
            for c in (saver, loader):
                c.shutdown()
        r["seconds"] = round(time.perf_counter() - t0, 2)
        out["cases"][case] = r
        print(case, r, file=sys.stderr, flush=True)

def round_trip(cfg, kc, src, dst, src_ids, dst_ids, block_size, dtype, seed):
    """Triton-write K/V into src's blocks src_ids, save through one worker connector, load through another into
    dst's blocks dst_ids, read back as the kernels address the cache."""
    T2 = len(src_ids) * block_size
    K = torch.randn(L, T2, H, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    V = torch.randn(L, T2, H, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    one = torch.tensor(1.0)
    for i, name in enumerate(NAMES):
        kcache, vcache = kernel_views(src[name])
        write_kernel(K[i], V[i], kcache, vcache, slots(src_ids, block_size), "auto", one, one)
    toks = list(range(seed * 100, seed * 100 + T2))
    saver = saved(cfg, kc, src, toks, src_ids)
    r = {"disabled": saver.disabled, "layout": saver._layout, "view_shape": list(src[NAMES[0]].shape)}
    if saver.disabled is None:
        base = saver.base_spec
        loader = loaded(cfg, kc, dst, base, toks, dst_ids)
        r["load_errors"] = sorted(loader.get_block_ids_with_load_errors())
        got_k, got_v = read_back([dst[n] for n in NAMES], dst_ids, dtype, block_size)
        r["loaded_bit_exact"] = torch.equal(bits(got_k), bits(K)) and torch.equal(bits(got_v), bits(V))
        for c in (saver, loader):
            c.shutdown()
    sched = vc.PromptCacheConnector(cfg, KVConnectorRole.SCHEDULER, kc)
    r["scheduler_disabled"] = sched.disabled
    sched.shutdown()
    return r


# Manager blocks of 32 tokens split into kernel blocks of 16 (prepare_kernel_block_sizes), bf16: the views have
# twice the blocks; the Triton writer addresses kernel blocks; the connector's block ids are manager blocks.
for layout in ("LBNHC", "LBHNC"):
    case = f"{layout}-bfloat16-kernel16"
    cfg = config("bfloat16", layout, block_size=32)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    kc, src = caches(cfg, spec, layout, kernel_block_sizes=[16])
    _, dst = caches(cfg, spec, layout, kernel_block_sizes=[16])
    out["cases"][case] = r = round_trip(cfg, kc, src, dst, [4, 1], [0, 5], 32, torch.bfloat16, 70)
    print(case, r, file=sys.stderr, flush=True)

# A hybrid model (every other layer sliding-window, as Gemma 3 or gpt-oss) with vLLM's hybrid allocator off, as vLLM
# sets it for a connector that is not SupportsHMA: vLLM's get_kv_cache_groups promotes the sliding-window layers to
# full allocation (one FullAttentionSpec group with the window recorded): every token's K/V is in its block.
cfg = config("float16", "LBNHC")
cfg.scheduler_config.disable_hybrid_kv_cache_manager = True
layer_specs = {n: (SlidingWindowSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.float16,
                                     sliding_window=32) if i % 2 else
                   FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.float16))
               for i, n in enumerate(NAMES)}
hybrid_groups = get_kv_cache_groups(cfg, dict(layer_specs))
kc, src = caches(cfg, None, "LBNHC", groups=hybrid_groups)
_, dst = caches(cfg, None, "LBNHC", groups=hybrid_groups)
r = round_trip(cfg, kc, src, dst, [5, 2, 9, 0], [3, 7, 1, 8], N, torch.float16, 90)
r["groups"] = [(type(g.kv_cache_spec).__name__, len(g.layer_names), g.kv_cache_spec.sliding_window)
               for g in hybrid_groups]
out["cases"]["hybrid-hma-off"] = r
print("hybrid-hma-off", r, file=sys.stderr, flush=True)

# A connector whose engine says one layout while the views have another stays inert.
cfg = config("float16", "LBNHC")
kc, src = caches(cfg, FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.float16), "LBNHC")
cfg.cache_config.kv_cache_layout = "LBHNC"
c = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
c.register_kv_caches(src)
out["inert"]["layout_mismatch"] = c.disabled
c.shutdown()

# Hybrid model with vLLM's hybrid allocator on (two groups, as a SupportsHMA connector would get them).
cfg = config("float16", "LBNHC")
full = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.float16)
swa = SlidingWindowSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.float16, sliding_window=128)
groups = [KVCacheGroupSpec(NAMES[0::2], full), KVCacheGroupSpec(NAMES[1::2], swa)]
kc, hyb = caches(cfg, None, "LBNHC", groups=groups)
c = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
c.register_kv_caches(hyb)
out["inert"]["hybrid"] = c.disabled
c.shutdown()
c = vc.PromptCacheConnector(cfg, KVConnectorRole.SCHEDULER, kc)
out["inert"]["hybrid_scheduler"] = c.disabled
c.shutdown()
c = vc.PromptCacheConnector(config("float16", "LBNHC", kv_layout="cpu"), KVConnectorRole.WORKER, kc)
c.register_kv_caches(hyb)  # the CPU backend's path checks the groups too
out["inert"]["hybrid_cpu_path"] = c.disabled
c.shutdown()

# fp8 (e4m3 by vLLM's "fp8", and e5m2): vLLM's uint8 caches, the Triton kernel's fp8 path; values fp8 holds
# exactly (the interpreter's rounding is not the GPU's), the bytes checked against torch's own conversion. Then the
# connector (active for fp8: the raw bytes under keys carrying the per-layer scales, which each worker reads from its
# attention layers: static_forward_context, here stand-ins carrying _k_scale_float/_v_scale_float) saves all 30
# layers (the other 26 filled with every byte pattern, NaN patterns included) to the sidecar and loads them into a
# second, empty cache set, bit for bit.
SCALES_A = vc_keys.scales_digest([2.0] * L, [0.5] * L)
SCALES_B = vc_keys.scales_digest([2.0] * L, [0.25] * L)


def set_scales(cfg, names, k, v, backend="FLASHINFER"):
    """Stand-ins for vLLM's attention layers: their scales and attention backend (fp8_e5m2 is cached only with a
    backend that stores e5m2 bytes; the bytes here are the Triton writer's, moved as they are)."""
    cfg.compilation_config.static_forward_context = {
        n: types.SimpleNamespace(_k_scale_float=k, _v_scale_float=v,
                                 attn_backend=types.SimpleNamespace(get_name=lambda: backend)) for n in names}


def fp8_connector_round_trip(cfg, kc, src, dst, src_ids, dst_ids, toks):
    saver = saved(cfg, kc, src, toks, src_ids)
    r = {"disabled": saver.disabled, "layout": saver._layout}
    if saver.disabled is None:
        base = saver.base_spec
        r["spec"] = [base.kv_dtype, base.kv_kind, base.num_layers, base.num_kv_heads, base.head_dim]
        client = PromptCacheClient(args["address"])
        blobs = client.get_blobs(base, toks, copy=True)
        r["stored_chunks"] = len(blobs)
        if blobs:
            stored = torch.cat([c.view(torch.uint8) for c in checked_chunks(base, blobs, CT)], dim=3)
            r["stored_is_gather"] = torch.equal(stored, vp.gather([src[n] for n in NAMES], saver._paged,
                                                                  src_ids).view(torch.uint8))
        client.close()
        loader = loaded(cfg, kc, dst, base, toks, dst_ids)
        r["load_errors"] = sorted(loader.get_block_ids_with_load_errors())
        r["blocks_equal"] = all(torch.equal(src[n][list(src_ids)], dst[n][list(dst_ids)]) for n in NAMES)
        untouched = [b for b in range(dst[NAMES[0]].shape[0]) if b not in dst_ids]
        r["other_blocks_zero"] = all(not dst[n][untouched].any() for n in NAMES)
        for c in (saver, loader):
            c.shutdown()
    sched = vc.PromptCacheConnector(cfg, KVConnectorRole.SCHEDULER, kc)
    r["scheduler_disabled"] = sched.disabled
    r["scheduler_spec_is_workers"] = sched.base_spec == getattr(saver, "base_spec", None)
    if sched.disabled is None:
        r["scheduler_hit"] = sched._lookup(vc._Lookup(0, 0.0, None, sched.base_spec, toks))
    sched.shutdown()
    return r


# fp8 (e4m3 by vLLM's "fp8", and e5m2): vLLM's uint8 caches, the Triton kernel's fp8 path; values fp8 holds
# exactly (the interpreter's rounding is not the GPU's), the bytes checked against torch's own conversion.
for fmt, torch_fmt in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
    for layout in ("LBNHC", "LBHNC"):
        cfg = config("bfloat16", layout, cache_dtype=fmt, kv_scales=SCALES_A.hex())
        set_scales(cfg, NAMES, 2.0, 0.5)
        spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.uint8)
        kc, src = caches(cfg, spec, layout)
        _, dst = caches(cfg, spec, layout)
        _, dst2 = caches(cfg, spec, layout)
        g = torch.Generator().manual_seed(7)
        exact = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 1.5, 2.0, -3.0, 0.25, 4.0, -0.125, 6.0, 8.0, -12.0, 0.75])
        K = exact[torch.randint(0, len(exact), (L, T, H, D), generator=g)]
        V = exact[torch.randint(0, len(exact), (L, T, H, D), generator=g)]
        ks, vs = torch.tensor(2.0), torch.tensor(0.5)
        names = NAMES[:4]  # the kernel's fp8 path is slow in the interpreter: four layers
        for i, name in enumerate(names):
            kcache, vcache = kernel_views(src[name])
            write_kernel(K[i].to(torch.bfloat16), V[i].to(torch.bfloat16), kcache, vcache, slots(SRC_BLOCKS), fmt,
                         ks, vs)
        views = [src[n] for n in names]
        p = vp.plan(views, block_size=N, num_kv_heads=H, head_size=D, kv_cache_dtype=fmt, engine_layout=layout)
        chunk = vp.gather(views, p, SRC_BLOCKS)
        want = torch.stack([(K[:4] / ks).to(torch_fmt), (V[:4] / vs).to(torch_fmt)], dim=1).permute(0, 1, 3, 2, 4)
        dviews = [dst[n] for n in names]
        vp.scatter(dviews, p, DST_BLOCKS, chunk)
        out["fp8"][f"{layout}-{fmt}"] = {
            "dtype": str(views[0].dtype), "chunk_dtype": str(chunk.dtype),
            "matches_torch_fp8": torch.equal(bits(chunk), bits(want.contiguous())),
            # vLLM's Triton writer stores current_platform.fp8_dtype() (e4m3fn on CUDA) whatever the fp8 string:
            "matches_torch_e4m3fn": torch.equal(bits(chunk), bits(torch.stack(
                [(K[:4] / ks).to(torch.float8_e4m3fn), (V[:4] / vs).to(torch.float8_e4m3fn)], dim=1)
                .permute(0, 1, 3, 2, 4).contiguous())),
            "round_trip": all(torch.equal(a[SRC_BLOCKS], b[DST_BLOCKS]) for a, b in zip(views, dviews)),
            "kv_format": vp.kv_format(p, [2.0] * 4, [0.5] * 4)}
        g = torch.Generator().manual_seed(17)
        for name in NAMES[4:]:
            v = src[name]
            v[SRC_BLOCKS] = torch.randint(0, 256, v[SRC_BLOCKS].shape, generator=g, dtype=torch.uint8)
        first = 5000 + 1000 * ("LBNHC", "LBHNC").index(layout) + 500 * (fmt != "fp8")  # one prompt per case
        toks = list(range(first, first + T))
        r = fp8_connector_round_trip(cfg, kc, src, dst2, SRC_BLOCKS, DST_BLOCKS, toks)
        r["nan_patterns"] = bool(any(((src[n][SRC_BLOCKS] & 0x7F) == 0x7F).any() for n in NAMES[4:]))
        out["fp8"][f"{layout}-{fmt}"]["connector"] = r
        print(f"fp8 {layout}-{fmt}", r, file=sys.stderr, flush=True)
        if fmt == "fp8_e5m2" and layout == "LBNHC":  # vLLM's Triton backend stores e4m3fn bytes for fp8_e5m2: inert
            set_scales(cfg, NAMES, 2.0, 0.5, backend="TRITON_ATTN")
            c = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
            c.register_kv_caches(dst2)
            out["inert"]["fp8_e5m2_triton"] = c.disabled
            c.shutdown()
        if (layout, fmt) != ("LBNHC", "fp8"):
            continue
        # Negative controls, on these chunks (stored under scales A, LBNHC e4m3):
        # scales B everywhere (config and layers): active, but the chunks are a miss for its scheduler and its loads
        cfg_b = config("bfloat16", layout, cache_dtype=fmt, kv_scales=SCALES_B.hex())
        set_scales(cfg_b, NAMES, 2.0, 0.25)
        _, dst_b = caches(cfg_b, spec, layout)
        lb = vc.PromptCacheConnector(cfg_b, KVConnectorRole.WORKER, kc)
        lb.register_kv_caches(dst_b)
        bind(lb, loads=[vc._LoadOp("load", lb.base_spec, toks, list(DST_BLOCKS), 0, 0, CT)])
        lb.start_load_kv(None)
        lb.flush()
        sb = vc.PromptCacheConnector(cfg_b, KVConnectorRole.SCHEDULER, kc)
        out["fp8_controls"] = {
            "scales_b_disabled": lb.disabled, "scales_b_load_errors": sorted(lb.get_block_ids_with_load_errors()),
            "scales_b_untouched": all(not dst_b[n].any() for n in NAMES),
            "scales_b_scheduler_hit": sb._lookup(vc._Lookup(0, 0.0, None, sb.base_spec, toks)),
            "specs_differ_only_in_salt": [lb.base_spec.kv_dtype, lb.base_spec.num_layers] == ["float8_e4m3fn", L]}
        lb.shutdown()
        sb.shutdown()
        # the config says scales A, the layers hold B: the worker refuses (inert), naming both digests
        cfg_m = config("bfloat16", layout, cache_dtype=fmt, kv_scales=SCALES_A.hex())
        set_scales(cfg_m, NAMES, 2.0, 0.25)
        c = vc.PromptCacheConnector(cfg_m, KVConnectorRole.WORKER, kc)
        c.register_kv_caches(dst_b)
        out["inert"]["fp8_scales_mismatch"] = c.disabled
        c.shutdown()
        # kv_scales auto (every scale 1.0 expected) and layers at 2.0/0.5: inert, the digest to set in the reason
        cfg_u = config("bfloat16", layout, cache_dtype=fmt)
        set_scales(cfg_u, NAMES, 2.0, 0.5)
        c = vc.PromptCacheConnector(cfg_u, KVConnectorRole.WORKER, kc)
        c.register_kv_caches(dst_b)
        out["inert"]["fp8_not_unit"] = c.disabled
        c.shutdown()
        out["fp8_controls"]["scales_a_hex"] = SCALES_A.hex()
        # ... and with unit scales in the layers: active on both sides
        set_scales(cfg_u, NAMES, 1.0, 1.0)
        c = vc.PromptCacheConnector(cfg_u, KVConnectorRole.WORKER, kc)
        c.register_kv_caches(dst_b)
        s_u = vc.PromptCacheConnector(cfg_u, KVConnectorRole.SCHEDULER, kc)
        out["fp8_controls"]["unit_disabled"] = [c.disabled, s_u.disabled]
        out["fp8_controls"]["unit_hit_for_a"] = s_u._lookup(vc._Lookup(0, 0.0, None, s_u.base_spec, toks))
        c.shutdown()
        s_u.shutdown()
        # no attention layer to read the scales from: inert
        cfg_n = config("bfloat16", layout, cache_dtype=fmt)
        c = vc.PromptCacheConnector(cfg_n, KVConnectorRole.WORKER, kc)
        c.register_kv_caches(dst_b)
        out["inert"]["fp8_no_scales"] = c.disabled
        c.shutdown()
        # scales computed at run time (calculate_kv_scales), a checkpoint with KV scales and no kv_scales: inert
        cfg_c = config("bfloat16", layout, cache_dtype=fmt)
        try:
            object.__setattr__(cfg_c.cache_config, "calculate_kv_scales", True)
        except Exception:  # noqa: BLE001
            object.__setattr__(cfg_c.model_config, "calculate_kv_scales", True)
        c = vc.PromptCacheConnector(cfg_c, KVConnectorRole.SCHEDULER, kc)
        out["inert"]["fp8_calculated"] = c.disabled
        c.shutdown()
        cfg_q = config("bfloat16", layout, cache_dtype=fmt)
        cfg_q.model_config.hf_config.quantization_config = {"quant_method": "compressed-tensors",
                                                            "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
        c = vc.PromptCacheConnector(cfg_q, KVConnectorRole.SCHEDULER, kc)
        out["inert"]["fp8_checkpoint_scales"] = c.disabled
        c.shutdown()
        c = vc.PromptCacheConnector(config("bfloat16", layout, cache_dtype=fmt, quantization="k8v8"),
                                    KVConnectorRole.SCHEDULER, kc)
        out["inert"]["fp8_quantization"] = c.disabled
        c.shutdown()

# MLA: one latent of 576 (kv_lora_rank 512 + rope 64) per token, one head; written per slot as concat_and_cache_mla
# addresses the cache ([B, N, 576] after the head dim). vllm_paged on SmolLM2's 30 layers; then the connector on a
# small random DeepSeek-V3 config (4 layers, MLA: vLLM's ModelConfig says use_mla, head size 576): active, saved,
# loaded bit for bit, TP rank 1 saves nothing and loads rank 0's chunks; a non-MLA model never sees them.
import tempfile  # noqa: E402
import shutil  # noqa: E402
from dataclasses import replace  # noqa: E402

MLA_DIR = tempfile.mkdtemp(prefix="promptcache-mla-")
for f in Path(MODEL).iterdir():
    if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
        shutil.copy(f, MLA_DIR)
Path(MLA_DIR, "config.json").write_text(json.dumps({
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 4, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "vocab_size": 49152,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False}))
ML = 4
MLA_NAMES = NAMES[:ML]


def write_latents(cache, names, lat, ids):
    s = slots(ids)
    for i, name in enumerate(names):
        cache[name].squeeze(1)[s // N, s % N] = lat[i]


def read_latents(cache, names, ids):
    d = slots(ids)
    return torch.stack([cache[n].squeeze(1)[d // N, d % N] for n in names])


for layout in ("LBNHC", "LBHNC"):
    cfg = config("bfloat16", layout)
    spec = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kc, src = caches(cfg, spec, layout)
    _, dst = caches(cfg, spec, layout)
    lat = torch.randn(L, T, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    write_latents(src, NAMES, lat, SRC_BLOCKS)
    views, dviews = [src[n] for n in NAMES], [dst[n] for n in NAMES]
    p = vp.plan(views, block_size=N, num_kv_heads=1, head_size=576, head_size_v=0, kind="mla", engine_layout=layout)
    chunk = vp.gather(views, p, SRC_BLOCKS)
    vp.scatter(dviews, p, DST_BLOCKS, chunk)
    out["mla"][layout] = {"shape": list(chunk.shape), "is_latent": torch.equal(chunk[:, 0, 0], lat),
                          "round_trip": torch.equal(read_latents(dst, NAMES, DST_BLOCKS), lat),
                          "kv_format": vp.kv_format(p)}
    # MLA caches for a non-MLA model (SmolLM2): inert
    c = vc.PromptCacheConnector(config("bfloat16", layout), KVConnectorRole.WORKER, kc)
    c.register_kv_caches(src)
    out["inert"][f"mla-{layout}"] = c.disabled
    c.shutdown()

    # The connector on the MLA model
    r = {}
    cfg = config("bfloat16", layout, model=MLA_DIR, revision="tiny-random-mla")
    r["use_mla"] = bool(cfg.model_config.use_mla)
    kc, src = caches(cfg, spec, layout, names=MLA_NAMES)
    _, dst = caches(cfg, spec, layout, names=MLA_NAMES)
    _, dst1 = caches(cfg, spec, layout, names=MLA_NAMES)
    lat = torch.randn(ML, T, 576, generator=torch.Generator().manual_seed(zlib.crc32(layout.encode()))).to(
        torch.bfloat16)
    write_latents(src, MLA_NAMES, lat, SRC_BLOCKS)
    first = 7000 + 100 * ("LBNHC", "LBHNC").index(layout)
    toks = list(range(first, first + T))
    saver = saved(cfg, kc, src, toks, SRC_BLOCKS)
    r["disabled"], r["layout"] = saver.disabled, saver._layout
    if saver.disabled is None:
        base = saver.base_spec
        r["spec"] = [base.kv_dtype, base.kv_kind, base.num_layers, base.num_kv_heads, base.head_dim]
        client = PromptCacheClient(args["address"])
        blobs = client.get_blobs(base, toks, copy=True)
        r["stored_chunks"] = len(blobs)
        if blobs:
            stored = torch.cat(checked_chunks(base, blobs, CT), dim=3)
            r["stored_shape"] = list(stored.shape)
            r["stored_is_latent"] = torch.equal(stored[:, 0, 0], lat)
        loader = loaded(cfg, kc, dst, base, toks, DST_BLOCKS)
        r["load_errors"] = sorted(loader.get_block_ids_with_load_errors())
        r["loaded_bit_exact"] = torch.equal(read_latents(dst, MLA_NAMES, DST_BLOCKS), lat)
        # A non-MLA spec of the same chunk bytes ([4, 2, 1, T, 288]) or the same head_dim: misses
        r["kv_spec_hits"] = [client.lookup(replace(base, kv_kind="kv", head_dim=hd), toks).cached_tokens
                             for hd in (288, 576)]
        sched = vc.PromptCacheConnector(cfg, KVConnectorRole.SCHEDULER, kc)
        r["scheduler_disabled"] = sched.disabled
        r["scheduler_hit"] = sched._lookup(vc._Lookup(0, 0.0, None, sched.base_spec, toks)) \
            if sched.disabled is None else None
        sched.shutdown()
        # TP 2, rank 1 (vLLM's parallel state answered as rank 1 of 2 would): the same chunks, nothing saved by it
        import vllm.distributed.parallel_state as ps

        saved_fns = ps.get_tensor_model_parallel_rank, ps.get_pp_group
        ps.get_tensor_model_parallel_rank = lambda: 1
        ps.get_pp_group = lambda: types.SimpleNamespace(rank_in_group=0)
        try:
            cfg2 = config("bfloat16", layout, model=MLA_DIR, revision="tiny-random-mla")
            cfg2.parallel_config.tensor_parallel_size = 2
            rank1 = vc.PromptCacheConnector(cfg2, KVConnectorRole.WORKER, kc)
            rank1.register_kv_caches(dst1)
            r["tp2_rank1"] = {"disabled": rank1.disabled, "saves": rank1.saves,
                              "spec_is_rank0s": rank1._rank_spec(rank1.base_spec) == base}
            bind(rank1, loads=[vc._LoadOp("load", rank1.base_spec, toks, list(DST_BLOCKS), 0, 0, CT)])
            rank1.start_load_kv(None)
            rank1.flush()
            r["tp2_rank1"]["load_errors"] = sorted(rank1.get_block_ids_with_load_errors())
            r["tp2_rank1"]["loaded_bit_exact"] = torch.equal(read_latents(dst1, MLA_NAMES, DST_BLOCKS), lat)
            toks2 = [t + 2000 for t in toks]
            bind(rank1, saves=[vc._SaveOp("save", rank1.base_spec, toks2, list(DST_BLOCKS), 0, CT)])
            rank1.wait_for_save()
            rank1.flush()
            r["tp2_rank1"]["stored_by_rank1"] = client.lookup(base, toks2).cached_tokens
            rank1.shutdown()
            s2 = vc.PromptCacheConnector(cfg2, KVConnectorRole.SCHEDULER, kc)
            r["tp2_scheduler"] = {"disabled": s2.disabled, "lookup_shards": len(s2.lookup_shards),
                                  "hit": s2._lookup(vc._Lookup(0, 0.0, None, s2.base_spec, toks))}
            s2.shutdown()
        finally:
            ps.get_tensor_model_parallel_rank, ps.get_pp_group = saved_fns
        client.close()
        for c in (saver, loader):
            c.shutdown()
    # Plain K/V caches for the MLA model: inert
    full = FullAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kc_f, src_f = caches(cfg, full, layout, names=MLA_NAMES)
    c = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc_f)
    c.register_kv_caches(src_f)
    r["kv_caches_for_mla_model"] = c.disabled
    c.shutdown()
    out["mla"][layout]["connector"] = r
    print(f"mla {layout}", r, file=sys.stderr, flush=True)
    if layout != "LBNHC":
        continue
    # MLA with an fp8 cache (--kv-cache-dtype fp8: uint8 latents, every byte pattern), scales all 1.0 (kv_scales auto)
    cfg = config("bfloat16", layout, cache_dtype="fp8", model=MLA_DIR, revision="tiny-random-mla")
    set_scales(cfg, MLA_NAMES, 1.0, 1.0)
    spec8 = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=torch.uint8)
    kc8, src8 = caches(cfg, spec8, layout, names=MLA_NAMES)
    _, dst8 = caches(cfg, spec8, layout, names=MLA_NAMES)
    g = torch.Generator().manual_seed(23)
    for n in MLA_NAMES:
        src8[n][SRC_BLOCKS] = torch.randint(0, 256, src8[n][SRC_BLOCKS].shape, generator=g, dtype=torch.uint8)
    toks8 = [t + 4000 for t in toks]
    saver = saved(cfg, kc8, src8, toks8, SRC_BLOCKS)
    r8 = {"disabled": saver.disabled}
    if saver.disabled is None:
        b8 = saver.base_spec
        r8["spec"] = [b8.kv_dtype, b8.kv_kind, b8.num_layers, b8.num_kv_heads, b8.head_dim]
        loader = loaded(cfg, kc8, dst8, b8, toks8, DST_BLOCKS)
        r8["load_errors"] = sorted(loader.get_block_ids_with_load_errors())
        r8["blocks_equal"] = all(torch.equal(src8[n][SRC_BLOCKS], dst8[n][DST_BLOCKS]) for n in MLA_NAMES)
        sched = vc.PromptCacheConnector(cfg, KVConnectorRole.SCHEDULER, kc8)
        r8["scheduler_hit"] = sched._lookup(vc._Lookup(0, 0.0, None, sched.base_spec, toks8))
        for c in (saver, loader, sched):
            c.shutdown()
    out["mla"]["fp8-connector"] = r8
    print("mla fp8", r8, file=sys.stderr, flush=True)
    c = vc.PromptCacheConnector(config("bfloat16", layout, cache_dtype="fp8_ds_mla", model=MLA_DIR,
                                       revision="tiny-random-mla"), KVConnectorRole.SCHEDULER, kc8)
    out["inert"]["fp8_ds_mla"] = c.disabled
    c.shutdown()
shutil.rmtree(MLA_DIR, ignore_errors=True)

out["seconds"] = round(time.perf_counter() - t_all, 1)
print("@@" + json.dumps(out), flush=True)
os._exit(0)
