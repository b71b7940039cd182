"""`promptcache bench vllm` in miniature (`make test-vllm`): four real vLLM engine processes and a sidecar, one
512-token prefix, so the benchmark behind docs/benchmarks.md's vLLM table keeps running. It raises when the connector
engine does not load the whole cached prefix from the sidecar."""
from __future__ import annotations

import os

import pytest

VLLM_PYTHON = os.environ.get("PROMPTCACHE_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON, reason="needs the vLLM virtualenv: run `make test-vllm`"),
]


def test_bench_vllm_loads_from_the_sidecar_and_prints_its_tables(capsys):
    from promptcache.cli import main

    assert main(["bench", "vllm", "--prefixes", "512", "--repeats", "1", "--requests", "8", "--max-tokens", "2",
                 "--vllm-python", VLLM_PYTHON]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 512 |"))
    assert "GB/s" in row
    assert "| connector |" in out and "| apc |" in out
    # The throughput run: 8 requests over 4 shared 1k prefixes, in one scheduler step. Each prefix is loaded from
    # the sidecar once (4 x 1024 tokens): vLLM's prefix cache gives the second request of a prefix the blocks the
    # first one loads, in the same step. The tokens are those of the full prefill.
    assert "throughput connector: 4096 tokens loaded from the sidecar" in out
    assert "the connector's greedy tokens equal the full prefill's" in out
