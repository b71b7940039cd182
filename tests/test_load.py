"""`promptcache bench loadtest`, short: concurrent clients with mixed lookup/get/put for a bounded time, no
errors, no corrupt chunk, the budget accounting never above the budget."""
from __future__ import annotations

import argparse
import json

import pytest

from promptcache_devtools.bench import loadtest


def args(**overrides) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    loadtest.add_arguments(p)
    a = p.parse_args([])
    for k, v in overrides.items():
        setattr(a, k, v)
    return a


@pytest.mark.slow  # concurrent clients for a bounded time
@pytest.mark.timeout(300)
def test_loadtest_runs_clean(tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = loadtest.run(args(clients=8, duration=8, processes=1, prefixes=64, chunk_tokens=64, memory_bytes="64Mi",
                           json=str(out), progress_seconds=2))
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["errors"] == 0 and report["corrupt_chunks"] == 0 and report["sidecar_alive"]
    assert report["requests"] > 50 and all(report["by_op"][op]["requests"] > 0 for op in loadtest.OPS)
    assert report["p99_ms"] >= report["p50_ms"] > 0
    assert report["budget_samples"] > 5 and report["over_budget_samples"] == 0
    assert 0 < report["peak_committed_bytes"] <= report["budget_bytes"]
    printed = capsys.readouterr()
    assert "loadtest: 8 clients" in printed.out
    # A long run is not silent: a progress line every --progress-seconds while it runs.
    progress = [line for line in printed.err.splitlines() if line.startswith("loadtest: ") and "calls answered" in line]
    assert len(progress) >= 2, printed.err


def test_progress_line():
    line = loadtest.progress_line(10.2, 60, 1500, 1000, 5.0, 32 << 20, 64 << 20, 900 << 20)
    assert line == ("loadtest: 10/60 s, 1500 calls answered (100/s), committed 32.0 of 64 MiB, "
                    "sidecar RSS 900 MiB")


def test_mix_is_validated():
    with pytest.raises(ValueError, match="unknown operation"):
        loadtest._mix("lookup=1,scan=2")
    assert loadtest._mix("get=3") == {"get": 3.0}
