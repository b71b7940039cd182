"""What the transformers integration's chunk keys stand for, and when it does not cache (the keys could not name what
the K/V depends on). Tiny random models built from configs, a real sidecar on loopback; every refused request must
get exactly its own plain prefill's logits, and nothing may be stored under its keys."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from promptcache_devtools import models

from promptcache.client.hf import PromptCacheHF, cache_kv, output_cache

CT = 16  # the conftest sidecar's chunk size


def fallbacks(reason: str) -> float:
    return REGISTRY.get_sample_value("promptcache_client_fallbacks_total", {"reason": reason}) or 0.0


def stores(outcome: str) -> float:
    return REGISTRY.get_sample_value("promptcache_client_stores_total", {"outcome": outcome}) or 0.0


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def plain(model, ids, keep=1, **kwargs):
    return model(input_ids=ids, logits_to_keep=keep, **kwargs).logits


def cached_tokens(client, spec, ids) -> int:
    return client.lookup(spec, ids[0].tolist()).cached_tokens


# --------------------------------------------------------------------------------- sliding-window / chunked layers
def mistral(sliding_window):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                        sliding_window=sliding_window)
    return MistralForCausalLM(cfg).eval()


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                       sliding_window=32)
    return Gemma2ForCausalLM(cfg).eval()


def llama4_chunked():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=4096, attention_chunk_size=32, num_local_experts=2,
                           no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"])
    return Llama4ForCausalLM(cfg).eval()


@pytest.mark.parametrize("build", [lambda: mistral(32), gemma2, llama4_chunked], ids=["mistral", "gemma2", "llama4"])
def test_windowed_attention_models_are_never_cached(build, client):
    """A sliding-window layer holds only the last window of tokens: chunks cut from it by position would be other
    tokens' K/V. Such a model neither stores nor loads; each request is its own plain prefill."""
    model = build()
    pc = PromptCacheHF(model, client, revision="w1")
    ids = prompt(100)
    before = fallbacks("layer_types")
    first = pc.prefill(ids, logits_to_keep=3)
    assert first.store is None and first.fallback == "layer_types" and first.cached_tokens == 0
    assert pc.flush(10)
    assert cached_tokens(client, pc.spec, ids) == 0
    assert pc.store_async(ids, first.cache, 0) is None  # nor through the public store
    assert cached_tokens(client, pc.spec, ids) == 0
    other = torch.cat([ids[:, :64], prompt(10, seed=7)], dim=1)
    second = pc.prefill(other, logits_to_keep=3)
    assert second.cached_tokens == 0 and second.fallback == "layer_types"
    assert torch.equal(first.logits, plain(model, ids, 3)) and torch.equal(second.logits, plain(model, other, 3))
    assert pc.fetch(ids).cached_tokens == 0
    assert fallbacks("layer_types") == before + 3
    out = pc.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             pad_token_id=0)
    assert torch.equal(out, ref) and cached_tokens(client, pc.spec, ids) == 0
    assert pc.disabled[0] == "layer_types"


def test_full_attention_mistral_is_cached(client):
    """No window configured: every layer keeps every token, and the model is cached as usual."""
    model = mistral(None)
    pc = PromptCacheHF(model, client, revision="w2")
    ids = prompt(3 * CT + 5)
    pc.prefill(ids)
    assert pc.flush(10)
    assert pc.prefill(ids, store=False).cached_tokens == 3 * CT


def test_store_refuses_a_cache_with_windowed_layers(client):
    """The second guard: a cache whose layers trim (here a sliding-window model's, of the same layout) handed to a
    full-attention model's store is refused, and the integration stops caching that model."""
    full = models.tiny_llama("float32", num_layers=2)
    pc = PromptCacheHF(full, client, revision="w3")
    ids = prompt(100)
    with torch.inference_mode():
        windowed = output_cache(mistral(32)(input_ids=ids, use_cache=True))
    assert [k.shape[-2] for k, _ in cache_kv(windowed)] == [31, 31]
    pc.fetch(ids)  # the chunk size is known: the store would cut chunks 0.. by position
    before = stores("refused")
    assert pc.store_async(ids, windowed, 0) is None
    assert pc.flush(10) and cached_tokens(client, pc.spec, ids) == 0
    assert stores("refused") == before + 1 and pc.disabled[0] == "layer_types"
    res = pc.prefill(ids, logits_to_keep=2)
    assert res.fallback == "layer_types" and res.store is None
    assert torch.equal(res.logits, plain(full, ids, 2))


# ------------------------------------------------------------------------------------------------ model identity
def test_revision_derived_from_the_weights(client, tmp_path):
    """Two checkpoints saved to the same path (a fine-tune written over /models/current) no longer share keys; the
    same checkpoint loaded twice (two replicas) does."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "current"
    ids = prompt(4 * CT + 6)
    models.tiny_llama("float32", seed=0).save_pretrained(path)
    a = AutoModelForCausalLM.from_pretrained(path).eval()
    pa = PromptCacheHF(a, client)
    pa.prefill(ids)
    assert pa.flush(10)
    replica = PromptCacheHF(AutoModelForCausalLM.from_pretrained(path).eval(), client)
    assert replica.spec == pa.spec
    assert replica.prefill(ids, store=False).cached_tokens == 4 * CT

    models.tiny_llama("float32", seed=123).save_pretrained(path)  # new weights, same path, same config
    b = AutoModelForCausalLM.from_pretrained(path).eval()
    pb = PromptCacheHF(b, client)
    assert pb.spec.model_id == pa.spec.model_id and pb.spec.revision != pa.spec.revision
    res = pb.prefill(ids, logits_to_keep=4, store=False)
    assert res.cached_tokens == 0 and res.fallback is None
    assert torch.equal(res.logits, plain(b, ids, 4))
    assert pa.spec.revision.startswith("weights-") and " config-" in pa.spec.revision


def test_revision_of_config_built_models(client):
    """Models built from a config are all model_id "llama": their weights and config tell them apart."""
    from transformers import LlamaForCausalLM

    base = models.tiny_llama("float32", seed=5)
    other_weights = models.tiny_llama("float32", seed=6)
    cfg = base.config.to_dict() | {"rms_norm_eps": 1e-2}
    other_eps = LlamaForCausalLM(type(base.config).from_dict(cfg)).eval()
    other_eps.load_state_dict(base.state_dict())  # the same bytes: only the norm's epsilon (hence every K) differs
    specs = [PromptCacheHF(m, client).spec for m in (base, other_weights, other_eps)]
    assert {s.model_id for s in specs} == {"llama"}
    weights = [s.revision.split(" ")[0] for s in specs]
    assert weights[0] != weights[1] and weights[0] == weights[2]
    assert len({s.revision for s in specs}) == 3
    assert PromptCacheHF(models.tiny_llama("float32", seed=5), client).spec == specs[0]  # deterministic
    assert PromptCacheHF(base, client, revision="r1").spec.revision == "r1"  # an explicit revision as given
    ids = prompt(2 * CT + 3)
    pc = PromptCacheHF(base, client)
    pc.prefill(ids)
    assert pc.flush(10)
    res = PromptCacheHF(other_eps, client).prefill(ids, logits_to_keep=2, store=False)
    assert res.cached_tokens == 0 and torch.equal(res.logits, plain(other_eps, ids, 2))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_revision_of_half_precision_weights(dtype, client):
    a, b = (PromptCacheHF(models.tiny_llama(dtype, seed=s), client).spec.revision for s in (0, 1))
    assert a != b and a.startswith("weights-")


def test_unreadable_weights_are_not_cached(client):
    """Weights on the meta device (offloaded) cannot be digested: without a revision the model is not cached."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(models.tiny_llama().config)
    pc = PromptCacheHF(model, client)
    before = fallbacks("identity")
    assert pc.fetch(prompt(2 * CT + 1)).fallback == "identity"
    assert fallbacks("identity") == before + 1 and pc.disabled[0] == "identity"
    assert PromptCacheHF(model, client, revision="operator-given").disabled is None


# ---------------------------------------------------------------------------------------------------- adapters
def lora(model):
    peft = pytest.importorskip("peft")
    return peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False), model, "default")


def set_adapters_enabled(model, enabled: bool):
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.enable_adapters(enabled)


def test_adapters_loaded_after_the_identity_are_not_cached(client):
    model = models.tiny_llama("float32", seed=11)
    pc = PromptCacheHF(model, client)
    ids = prompt(4 * CT + 3)
    pc.prefill(ids)
    assert pc.flush(10)
    lora(model)  # LoRA on k_proj / v_proj: every K and V changes, the config does not
    before = fallbacks("adapters")
    res = pc.prefill(ids, logits_to_keep=3)
    assert res.fallback == "adapters" and res.cached_tokens == 0 and res.store is None
    assert torch.equal(res.logits, plain(model, ids, 3))
    assert fallbacks("adapters") == before + 1
    fresh = prompt(3 * CT + 1, seed=5)
    pc.prefill(fresh)
    assert pc.store_async(fresh, res.cache) is None
    assert pc.flush(10) and cached_tokens(client, pc.spec, fresh) == 0


def test_adapters_present_at_the_identity_are_in_it(client):
    base = PromptCacheHF(models.tiny_llama("float32", seed=12), client).spec
    model = lora(models.tiny_llama("float32", seed=12))
    pc = PromptCacheHF(model, client)
    assert pc.spec.revision != base.revision
    ids = prompt(3 * CT + 2)
    pc.prefill(ids)
    assert pc.flush(10)
    assert pc.prefill(ids, store=False).cached_tokens == 3 * CT
    set_adapters_enabled(model, False)  # the base model's K/V now: not what the identity stands for
    res = pc.prefill(ids, logits_to_keep=2, store=False)
    assert res.fallback == "adapters" and res.cached_tokens == 0
    assert torch.equal(res.logits, plain(model, ids, 2))
    set_adapters_enabled(model, True)
    assert pc.prefill(ids, store=False).cached_tokens == 3 * CT


# -------------------------------------------------------------------------------------- inputs besides input_ids
def tiny_llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vis = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, projection_dim=32)
    txt = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    cfg = LlavaConfig(vision_config=vis, text_config=txt, image_token_id=299, vision_feature_layer=-1,
                      vision_feature_select_strategy="full")
    return LlavaForConditionalGeneration(cfg).eval()


def image(seed):
    return torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(seed))


def test_pixel_values_are_not_cached(client):
    """Another image at the same placeholder tokens has other K/V: a request with pixel_values neither loads nor
    stores (before: request B got image A's K/V, or failed)."""
    model = tiny_llava()
    pc = PromptCacheHF(model, client, revision="v1")
    ids = prompt(70)
    ids[0, 3:8] = 299  # the image's 5 placeholder tokens (CLS + 4 patches), inside chunk 0
    before = fallbacks("model_kwargs")
    for img in (image(10), image(20)):
        res = pc.prefill(ids, logits_to_keep=2, pixel_values=img)
        assert res.fallback == "model_kwargs" and res.cached_tokens == 0 and res.store is None
        assert torch.equal(res.logits, plain(model, ids, 2, pixel_values=img))
    assert pc.flush(10) and cached_tokens(client, pc.spec, ids) == 0
    assert fallbacks("model_kwargs") == before + 2
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    out = pc.generate(ids, pixel_values=image(20), **kw)
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=image(20), **kw)
    assert torch.equal(out, ref) and pc.last_prefix.fallback == "model_kwargs"
    assert torch.equal(PromptCacheHF(model, None, revision="v1").generate(ids, pixel_values=image(20), **kw), ref)
    assert pc.flush(10) and cached_tokens(client, pc.spec, ids) == 0


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_llama("float32", num_layers=2, seed=3)


@pytest.mark.parametrize("kwarg", ["position_ids", "token_type_ids", "padded_mask"])
def test_inputs_that_change_kv_are_not_cached(kwarg, tiny, client):
    pc = PromptCacheHF(tiny, client, revision=f"k-{kwarg}")
    ids = prompt(3 * CT + 4)
    pc.prefill(ids)
    assert pc.flush(10)
    assert pc.fetch(ids).cached_tokens == 3 * CT  # cached under these token ids; with the extra input, not usable
    n = ids.shape[1]
    name, value = {"position_ids": ("position_ids", torch.arange(5, 5 + n)[None]),
                   "token_type_ids": ("token_type_ids", torch.zeros_like(ids)),
                   "padded_mask": ("attention_mask", torch.cat([torch.zeros(1, 4, dtype=torch.long),
                                                                torch.ones(1, n - 4, dtype=torch.long)], 1))}[kwarg]
    res = pc.prefill(ids, logits_to_keep=2, **{name: value})
    assert res.fallback == "model_kwargs" and res.cached_tokens == 0 and res.store is None
    assert torch.equal(res.logits, plain(tiny, ids, 2, **{name: value}))


def test_inputs_that_cannot_change_kv_are_cached(tiny, client):
    pc = PromptCacheHF(tiny, client, revision="k-safe")
    ids = prompt(3 * CT + 4)
    pc.prefill(ids)
    assert pc.flush(10)
    res = pc.prefill(ids, logits_to_keep=2, store=False, attention_mask=torch.ones_like(ids), use_cache=False,
                     return_dict=False, output_hidden_states=True)
    assert res.fallback is None and res.cached_tokens == 3 * CT
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    out = pc.generate(ids, attention_mask=torch.ones_like(ids), output_scores=True, **kw)
    assert pc.last_prefix.cached_tokens == 3 * CT and pc.last_prefix.fallback is None
    with torch.inference_mode():
        ref = tiny.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(out, ref)


def test_generate_with_padding_is_not_cached(tiny, client):
    pc = PromptCacheHF(tiny, client, revision="k-gen")
    ids = prompt(3 * CT + 4)
    pc.prefill(ids)
    assert pc.flush(10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    out = pc.generate(ids, attention_mask=mask, **kw)
    assert pc.last_prefix.fallback == "model_kwargs" and pc.last_prefix.cached_tokens == 0
    with torch.inference_mode():
        ref = tiny.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)
