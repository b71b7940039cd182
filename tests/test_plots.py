"""The benchmarks' --plot output: each plot is a real PNG drawn from the shape of data its benchmark produces."""
from __future__ import annotations

import pytest

from promptcache_devtools.bench import plots

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def written(path) -> bool:
    return path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


def test_replay_plot(tmp_path):
    fractions, cols = [0.02, 0.05, 0.1], ["lru", "wtinylfu", "opt"]
    table = {(t, p, f): f * (2 if p == "opt" else 1) for t in ("chat", "rag") for p in cols for f in fractions}
    assert plots.replay(table, ["chat", "rag"], fractions, cols, str(tmp_path / "r.png"), default="wtinylfu")
    assert written(tmp_path / "r.png")


def test_throughput_plot(tmp_path):
    rows = [(s, t, 100.0 * s, 200.0 * s, 9000.0, 150.0 * s, 180.0 * s)
            for s in (1, 8, 64) for t in ("tcp", "bulk-tcp", "bulk-tcp, views")]
    assert plots.throughput(rows, str(tmp_path / "t.png")) and written(tmp_path / "t.png")


def test_ttft_plot(tmp_path):
    rows = [{"prefix": p, "full_s": p / 100, "floor_s": 0.5, "none": {"ttft_s": 0.6}, "k8v4": {"ttft_s": 0.55}}
            for p in (512, 1024, 2048)]
    assert plots.ttft(rows, ["none", "k8v4"], str(tmp_path / "f.png")) and written(tmp_path / "f.png")


def test_closed_loop_plot(tmp_path):
    mib = 1 << 20
    rows = [(0.1, 8 * mib, 8 * mib, None, "-"), (1.2, 24 * mib, 8 * mib, 0.3, "grow"),
            (2.5, 24 * mib, 24 * mib, 0.85, "hold"), (9.0, 16 * mib, 24 * mib, None, "shrink")]
    assert plots.closed_loop(rows, 0.8, str(tmp_path / "c.png")) and written(tmp_path / "c.png")


def test_without_matplotlib_a_plot_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "pyplot", lambda: None)
    assert not plots.ttft([], [], str(tmp_path / "x.png"))
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "x.png").exists()
