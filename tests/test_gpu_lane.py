"""`make test-gpu` (hack/test-gpu.sh) in its CPU mode, so the GPU lane cannot rot between the rare runs on a GPU
machine: the same steps, the cuda tests skipping with their reason, the TTFT benchmark on a toy model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO

pytestmark = pytest.mark.slow  # about 20 s on an idle 2-core machine: a pytest run, a model and a sidecar process


def test_gpu_lane_runs_on_the_cpu_and_writes_its_results(tmp_path):
    env = {**os.environ, "RESULTS": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(["bash", str(REPO / "hack" / "test-gpu.sh")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda"] is False and summary["tests_exit"] == summary["bench_exit"] == 0
    tests = summary["tests"]
    assert tests["tests"] >= 10 and tests["skipped"] == tests["tests"] and not tests["failures"] + tests["errors"]
    assert summary["skip_reasons"] == ["needs a CUDA device: run `make test-gpu` on a GPU machine"]
    [row] = summary["ttft"]
    assert row["prefix"] == 64 and row["full_s"] > 0
    assert {m: row[m]["first_token_same"] for m in ("none", "k8v8")} == {"none": True, "k8v8": True}
    bench = json.loads((tmp_path / "ttft.json").read_text())
    assert bench["device"] == "cpu" and bench["args"]["model"] == "tiny"
    assert summary["paged_exit"] == 0
    paged = summary["paged"]  # the connector's save/load on vLLM's CUDA layouts, run on the CPU here
    assert [(r["layout"], r["dtype"]) for r in paged["rows"]] == [
        ("LBNHC", "float32"), ("LBNHC", "bfloat16"), ("LBHNC", "float32"), ("LBHNC", "bfloat16")]
    assert all(r["bit_exact"] and r["save_GBps"] > 0 and r["load_GBps"] > 0 for r in paged["rows"])
    assert paged["pinned_memcpy"] == paged["link"] == "skipped: no CUDA device"
    assert json.loads((tmp_path / "paged.json").read_text())["device"] == "cpu"
    assert summary["copy_paths_exit"] == 0 and summary["copy_paths"] == "skipped: no CUDA device"
    assert {p.name for p in tmp_path.iterdir()} == {"summary.json", "cuda-tests.xml", "cuda-tests.log", "ttft.json",
                                                    "ttft.log", "paged.json", "paged.log"}
