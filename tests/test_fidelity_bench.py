"""Smoke tests of the fidelity and TTFT benchmarks' measuring code, on the tiny random Llama (seconds, not minutes).
The real figures come from `promptcache bench fidelity|ttft` on SmolLM2 (docs/quantization.md, docs/hf-integration.md)."""
from __future__ import annotations

import pytest
import torch

from promptcache_devtools import models
from promptcache_devtools.bench import fidelity, ttft
from support import CHUNK


def _tokens(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fidelity_evaluate_on_tiny_model(dtype):
    model = models.tiny_llama(dtype, num_layers=2)
    res = fidelity.evaluate(model, _tokens(200), modes=["none", "k8v8", "k8v4"], prefix=64, suffix=16, windows=2,
                            chunk_tokens=64, revision="smoke", log=lambda s: None)
    assert set(res) == {"none", "k8v8", "k8v4"}
    for m, r in res.items():
        assert r["positions"] == 32
        assert 0.0 <= r["top1_agreement"] <= 1.0 and 0.0 <= r["top1_agreement_vs_full"] <= 1.0
        assert r["max_abs_logit_diff"] < 1.0
    # lossless reuse is the reference: exactly 0.0 in every dtype (bf16 included, scored by the float32 judge)
    assert res["none"]["max_abs_logit_diff"] == 0.0 and res["none"]["ppl_change"] == 0.0
    assert res["none"]["top1_agreement"] == 1.0
    if dtype == "float32":  # bit-exact K/V; the last bits differ from a full prefill on this tiny model's GEMMs
        assert res["none"]["max_abs_logit_diff_vs_full"] < 1e-4
    assert res["k8v4"]["max_abs_logit_diff"] > 0.0
    assert res["k8v4"]["bytes_per_token"] < res["k8v8"]["bytes_per_token"] < res["none"]["bytes_per_token"]
    table = fidelity.format_table(res, dtype)
    assert "| k8v4 |" in table and f"none ({dtype})" in table
    assert fidelity.target_checks("none", res["none"]) == {"max abs logit diff vs lossless reuse == 0.0": True}


def test_ttft_measure_on_tiny_model(sidecar):
    model = models.tiny_llama("float32", num_layers=2)
    ct = CHUNK
    rows = ttft.measure(model, _tokens(4 * ct + 8), prefixes=[ct, 2 * ct], suffix=8, modes=["none", "k8v4"],
                        repeats=2, full_repeats=1, address=sidecar.address, revision="smoke", chunk_tokens=ct,
                        log=lambda s: None)
    assert [r["prefix"] for r in rows] == [ct, 2 * ct]
    for r in rows:
        assert r["full_s"] > 0 and r["floor_s"] > 0
        for m in ("none", "k8v4"):
            assert r[m]["ttft_s"] > 0 and r[m]["first_token_same"]
        assert 0 < r["k8v4"]["dequant_s"] < r["k8v4"]["ttft_s"] and r["k8v4"]["pack_s"] > 0
        assert "dequant_s" not in r["none"]
    assert f"| {2 * ct} + 8 |" in ttft.format_table(rows, ["none", "k8v4"])


def test_roff_to_text_keeps_prose_and_drops_markup():
    src = ('.\\" a comment\n.TH BASH 1\n.SH "描述(DESCRIPTION)"\n.B Bash\n是一个与 \\fBsh\\fP 兼容的命令解释程序\\(em\n'
           '.PP\n选项 \\-c \\fIstring\\fR，\\e 和 1003\\.2\n')
    assert fidelity.roff_to_text(src) == "描述(DESCRIPTION) Bash 是一个与 sh 兼容的命令解释程序 选项 -c string，\\ 和 1003.2"


def test_load_text_builtins_and_files(tmp_path):
    label, text = fidelity.load_text("zh")  # Debian manpages-zh, installed by hack/system-deps.sh
    assert label == "zh" and len(text) > 50_000
    assert sum("\u4e00" <= c <= "\u9fff" for c in text) > 20_000  # mostly Chinese characters
    assert not any(esc in text for esc in ("\\fB", "\\fI", "\\fP", "\\fR", "\\-", "\\(", "\n"))
    f = tmp_path / "t.txt"
    f.write_text("Grüße,\n\n  Welt ", encoding="utf-8")
    assert fidelity.load_text(str(f)) == ("t.txt", "Grüße, Welt")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        fidelity.load_text(str(tmp_path / "nope.txt"))


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("text", ["en", "zh"])
def test_fidelity_thresholds_on_smollm2_slice(text):
    """The real model, docs/benchmarks.md's 3 windows (512 cached + 256 scored tokens) per text: none exact, k8v4
    top-1 >= 99 %.
    (One window is too few: 99 % of 256 positions allows 2 misses, and the first Chinese window has 3.)"""
    try:
        model, tok = models.load_smollm2("float32")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens = tok(fidelity.load_text(text)[1], add_special_tokens=False)["input_ids"]
        res = fidelity.evaluate(model, tokens, modes=["none", "k8v4"], prefix=512, suffix=256, windows=3,
                                chunk_tokens=256, revision=models.model_revision(), log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    assert res["none"]["max_abs_logit_diff"] == 0.0 and res["none"]["max_abs_logit_diff_vs_full"] == 0.0
    for check, ok in fidelity.target_checks("k8v4", res["k8v4"]).items():
        assert ok, f"{text}: k8v4 {check}: {res['k8v4']}"
