"""PNG plots of the benchmarks' results (`--plot FILE.png`): hit ratio against capacity per policy (replay),
throughput against size per transport, TTFT against prefix length, and the autoscaler's closed-loop trajectory.

matplotlib is promptcache-devtools' `plots` extra (`pip install -e 'devtools/[plots]'`, which `make venv` installs);
without it a plot is skipped with a message and the benchmark's tables are unaffected. `make plots` regenerates docs/img/.
"""
from __future__ import annotations

from typing import Any


def pyplot():
    """matplotlib.pyplot on the file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
    return True


def _missing(path: str) -> bool:
    print(f"(no plot: matplotlib is not installed, `pip install -e 'devtools/[plots]'`; {path} not written)")
    return False


def replay(table: dict[tuple[str, str, float], Any], trace_names: list[str], fractions: list[float],
           cols: list[str], path: str, default: str | None = None) -> bool:
    """Token hit ratio against capacity, one panel per trace, one line per policy (OPT dashed)."""
    plt = pyplot()
    if plt is None:
        return _missing(path)
    xs = sorted(fractions)
    fig, axes = plt.subplots(1, len(trace_names), figsize=(4.2 * len(trace_names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], trace_names):
        for col in cols:
            ys = [_hit_ratio(table[(name, col, f)]) for f in xs]
            style = "k--" if col == "opt" else ("o-" if col == default else ".-")
            ax.plot([100 * f for f in xs], ys, style, label=col + (" (default)" if col == default else ""),
                    linewidth=2.2 if col == default else 1.2)
        ax.set_xscale("log")
        ax.set_xticks([100 * f for f in xs], [f"{100 * f:g}%" for f in xs])
        ax.minorticks_off()
        ax.set_xlabel("capacity (share of unique blocks)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("token hit ratio")
    axes[0][-1].legend(fontsize=8)
    return _save(plt, fig, path)


def _hit_ratio(result: Any) -> float:
    return result["hit_ratio"] if isinstance(result, dict) else float(result)


def throughput(rows: list[tuple], path: str) -> bool:
    """Get and Put MB/s against prefix size per transport, Redis GET and SET of the same bytes for comparison.
    rows: (size MiB, transport, put MB/s, get MB/s, memcpy MB/s, Redis SET MB/s, Redis GET MB/s, and maybe more)."""
    plt = pyplot()
    if plt is None:
        return _missing(path)
    sizes = sorted({r[0] for r in rows})
    transports = list(dict.fromkeys(r[1] for r in rows))
    fig, (get_ax, put_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for t in transports:
        mine = {r[0]: r for r in rows if r[1] == t}
        get_ax.plot(sizes, [mine[s][3] for s in sizes], "o-", label=t)
        if ", views" not in t:
            put_ax.plot(sizes, [mine[s][2] for s in sizes], "o-", label=t)
    redis = {r[0]: r for r in rows}
    get_ax.plot(sizes, [redis[s][6] for s in sizes], "k--", label="Redis GET (same run)")
    put_ax.plot(sizes, [redis[s][5] for s in sizes], "k--", label="Redis SET (same run)")
    for ax, what in ((get_ax, "Get"), (put_ax, "Put")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("prefix size (MiB)")
        ax.set_ylabel(f"{what} MB/s")
        ax.set_title(f"{what} throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def ttft(rows: list[dict], modes: list[str], path: str) -> bool:
    """TTFT against prefix length: full prefill, each cached mode through the sidecar, the in-process floor."""
    plt = pyplot()
    if plt is None:
        return _missing(path)
    xs = [r["prefix"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["full_s"] for r in rows], "o-", label="full prefill")
    for m in modes:
        ax.plot(xs, [r[m]["ttft_s"] for r in rows], "o-", label=f"sidecar, {m}")
    ax.plot(xs, [r["floor_s"] for r in rows], "k--", label="in-process floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("prefix tokens (+ suffix)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("SmolLM2-135M on CPU: time to first token")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def closed_loop(rows: list[tuple], target: float, path: str) -> bool:
    """The autoscaler's trajectory: memory decided and the sidecar's budget (left axis), the measured hit ratio
    (right axis), with each grow and shrink marked. rows: (t s, memory bytes, budget bytes or None,
    hit ratio or None, action, ...)."""
    plt = pyplot()
    if plt is None:
        return _missing(path)
    mib = 1 << 20
    t = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(t, [r[1] / mib for r in rows], where="post", label="memory (decided)")
    ax.plot(t, [r[2] / mib if r[2] else float("nan") for r in rows], ".", label="sidecar budget")
    for r in rows:
        if r[4] in ("grow", "shrink"):
            ax.axvline(r[0], color="g" if r[4] == "grow" else "r", alpha=0.25)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("MiB")
    right = ax.twinx()
    right.plot(t, [r[3] if r[3] is not None else float("nan") for r in rows], "m.-", label="hit ratio")
    right.axhline(target, color="m", linestyle=":", label="target")
    right.set_ylim(0, 1.05)
    right.set_ylabel("hit ratio")
    lines = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=8, loc="center right")
    ax.set_title("Autoscaler closed loop: grow to the target, hold, shrink when idle")
    return _save(plt, fig, path)
