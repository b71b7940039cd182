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


def config(dtype: str, layout: str, cache_dtype: str = "auto", block_size: int = N, **extra):
    mc = ModelConfig(model=MODEL, dtype=dtype, max_model_len=2048, enforce_eager=True)
    kt = KVTransferConfig(kv_connector="PromptCacheConnector",
                          kv_connector_module_path="promptcache.client.vllm_connector",
                          kv_role="kv_both", kv_connector_extra_config={
                              "address": args["address"], "load_timeout": 10.0, "kv_layout": "paged",
                              "model_id": f"cuda-layouts-{layout}-{dtype}", **extra})
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

        saver = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
        saver.register_kv_caches(src)
        r = {"disabled": saver.disabled, "layout": saver._layout, "kernel_wrote_what_it_was_given": kernel_ok,
             "paged_views_match_vllm": paged_views_match,
             "strides": list(src_views[0].stride())}
        if saver.disabled is None:
            base = saver.base_spec
            bind(saver, saves=[vc._SaveOp("save", base, tokens, list(SRC_BLOCKS), 0, CT)])
            saver.wait_for_save()
            saver.flush()
            client = PromptCacheClient(args["address"])
            blobs = client.get_blobs(base, tokens, copy=True)
            stored = torch.cat(checked_chunks(base, blobs, CT), dim=3) if blobs else None
            r["stored_chunks"] = len(blobs)
            r["stored_is_canonical"] = stored is not None and torch.equal(bits(stored), bits(canonical))

            loader = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
            loader.register_kv_caches(dst)
            bind(loader, loads=[vc._LoadOp("load", base, tokens, list(DST_BLOCKS), 0, 0, CT)])
            loader.start_load_kv(None)
            loader.flush()
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
    saver = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
    saver.register_kv_caches(src)
    r = {"disabled": saver.disabled, "layout": saver._layout, "view_shape": list(src[NAMES[0]].shape)}
    if saver.disabled is None:
        base = saver.base_spec
        toks = list(range(seed * 100, seed * 100 + T2))
        bind(saver, saves=[vc._SaveOp("save", base, toks, list(src_ids), 0, CT)])
        saver.wait_for_save()
        saver.flush()
        loader = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, kc)
        loader.register_kv_caches(dst)
        bind(loader, loads=[vc._LoadOp("load", base, toks, list(dst_ids), 0, 0, CT)])
        loader.start_load_kv(None)
        loader.flush()
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
# exactly (the interpreter's rounding is not the GPU's), the bytes checked against torch's own conversion.
for fmt, torch_fmt in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
    for layout in ("LBNHC", "LBHNC"):
        cfg = config("bfloat16", layout)
        spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.uint8)
        kc, src = caches(cfg, spec, layout)
        _, dst = caches(cfg, spec, layout)
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
try:
    cfg = config("bfloat16", "LBNHC", cache_dtype="fp8")
    c = vc.PromptCacheConnector(cfg, KVConnectorRole.WORKER, None)
    out["inert"]["fp8"] = c.disabled
    c.shutdown()
except Exception as exc:  # noqa: BLE001
    out["inert"]["fp8"] = f"config error: {exc}"

# MLA: one latent of 576 (kv_lora_rank 512 + rope 64) per token, one head; written per slot as concat_and_cache_mla
# addresses the cache ([B, N, 576] after the head dim).
for layout in ("LBNHC", "LBHNC"):
    cfg = config("bfloat16", layout)
    spec = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kc, src = caches(cfg, spec, layout)
    _, dst = caches(cfg, spec, layout)
    lat = torch.randn(L, T, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    s = slots(SRC_BLOCKS)
    for i, name in enumerate(NAMES):
        src[name].squeeze(1)[s // N, s % N] = lat[i]
    views, dviews = [src[n] for n in NAMES], [dst[n] for n in NAMES]
    p = vp.plan(views, block_size=N, num_kv_heads=1, head_size=576, head_size_v=0, kind="mla", engine_layout=layout)
    chunk = vp.gather(views, p, SRC_BLOCKS)
    vp.scatter(dviews, p, DST_BLOCKS, chunk)
    d = slots(DST_BLOCKS)
    out["mla"][layout] = {"shape": list(chunk.shape), "is_latent": torch.equal(chunk[:, 0, 0], lat),
                          "round_trip": all(torch.equal(v.squeeze(1)[d // N, d % N], lat[i])
                                            for i, v in enumerate(dviews)),
                          "kv_format": vp.kv_format(p)}
    c = vc.PromptCacheConnector(config("bfloat16", layout), KVConnectorRole.WORKER, kc)
    c.register_kv_caches(src)
    out["inert"][f"mla-{layout}"] = c.disabled
    c.shutdown()

out["seconds"] = round(time.perf_counter() - t_all, 1)
print("@@" + json.dumps(out), flush=True)
os._exit(0)
