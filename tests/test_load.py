"""`promptcache bench loadtest`, short: concurrent clients with mixed lookup/get/put for a bounded time, no
errors, no corrupt chunk, the budget accounting never above the budget."""
from __future__ import annotations

import argparse
import json

import pytest

from promptcache.bench import loadtest


def args(**overrides) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    loadtest.add_arguments(p)
    a = p.parse_args([])
    for k, v in overrides.items():
        setattr(a, k, v)
    return a


@pytest.mark.timeout(300)
def test_loadtest_runs_clean(tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = loadtest.run(args(clients=8, duration=8, processes=1, prefixes=64, chunk_tokens=64, memory_bytes="64Mi",
                           json=str(out)))
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["errors"] == 0 and report["corrupt_chunks"] == 0 and report["sidecar_alive"]
    assert report["requests"] > 50 and all(report["by_op"][op]["requests"] > 0 for op in loadtest.OPS)
    assert report["p99_ms"] >= report["p50_ms"] > 0
    assert report["budget_samples"] > 5 and report["over_budget_samples"] == 0
    assert 0 < report["peak_committed_bytes"] <= report["budget_bytes"]
    assert "loadtest: 8 clients" in capsys.readouterr().out


def test_mix_is_validated():
    with pytest.raises(ValueError, match="unknown operation"):
        loadtest._mix("lookup=1,scan=2")
    assert loadtest._mix("get=3") == {"get": 3.0}
