"""Smoke tests of the fidelity and TTFT benchmarks' measuring code, on the tiny random Llama (seconds, not minutes).
The real figures come from `promptcache bench fidelity|ttft` on SmolLM2 (docs/quantization.md, docs/hf-integration.md)."""
from __future__ import annotations

import torch

from promptcache import models
from promptcache.bench import fidelity, ttft


def _tokens(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fidelity_evaluate_on_tiny_model():
    model = models.tiny_llama("float32", num_layers=2)
    res = fidelity.evaluate(model, _tokens(200), modes=["none", "k8v8", "k8v4"], prefix=32, suffix=16, windows=2,
                            chunk_tokens=16, revision="smoke", log=lambda s: None)
    assert set(res) == {"none", "k8v8", "k8v4"}
    for m, r in res.items():
        assert r["positions"] == 32
        assert 0.0 <= r["top1_agreement"] <= 1.0
        assert r["max_abs_logit_diff"] < 1.0
    assert res["none"]["max_abs_logit_diff"] < 1e-4  # bit-exact K/V; the last bits differ on this tiny model's GEMMs
    assert res["k8v4"]["bytes_per_token"] < res["k8v8"]["bytes_per_token"] < res["none"]["bytes_per_token"]
    table = fidelity.format_table(res, "float32")
    assert "| k8v4 |" in table and "none (float32)" in table


def test_ttft_measure_on_tiny_model(sidecar):
    model = models.tiny_llama("float32", num_layers=2)
    rows = ttft.measure(model, _tokens(100), prefixes=[32, 64], suffix=8, modes=["none", "k8v4"], repeats=2,
                        full_repeats=1, address=sidecar.address, revision="smoke", log=lambda s: None)
    assert [r["prefix"] for r in rows] == [32, 64]
    for r in rows:
        assert r["full_s"] > 0 and r["floor_s"] > 0
        for m in ("none", "k8v4"):
            assert r[m]["ttft_s"] > 0 and r[m]["first_token_same"]
    assert "| 64 + 8 |" in ttft.format_table(rows, ["none", "k8v4"])
