"""startup: `promptcache --version` and a default sidecar's time to healthy, in fresh processes.

Each figure is the median of --repeats fresh processes after one warm-up run (warm page cache), with the load
average beside it: on a shared machine the wall times move with the load, so compare them only within one run.
Also reports whether `--version` imported torch (it must not: that alone costs seconds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per figure (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _version_seconds() -> tuple[float, bool]:
    """Wall seconds of one `promptcache --version`, and whether it imported torch (-X importtime's report)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "promptcache.cli", "--version"],
                         capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    return seconds, "torch" in imported_modules(out.stderr)


def imported_modules(importtime_stderr: str) -> set[str]:
    """The module names a `python -X importtime` run reported (its stderr)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header line
                names.add(name)
    return names


def _healthy_seconds() -> tuple[float, float]:
    """Wall seconds from spawning `promptcache serve` (default settings, free ports) to its first SERVING health
    answer, and the CPU seconds the sidecar spent by then."""
    from promptcache_devtools.procs import free_port, stop_process, wait_healthy

    address = f"127.0.0.1:{free_port()}"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", address,
                             "--metrics-port", str(free_port()), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(address, proc)
        seconds = time.perf_counter() - start
        cpu = _cpu_seconds(proc.pid)
    finally:
        stop_process(proc)
    return seconds, cpu


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return float("nan")


def run(args) -> int:
    if args.repeats < 1:
        print("--repeats must be at least 1", file=sys.stderr)
        return 2
    _version_seconds()  # warm-up: page cache
    versions = [_version_seconds() for _ in range(args.repeats)]
    _healthy_seconds()
    healthy = [_healthy_seconds() for _ in range(args.repeats)]
    result = {"load_average_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
              "version_s": round(statistics.median(v for v, _ in versions), 3),
              "version_imports_torch": any(t for _, t in versions),
              "healthy_s": round(statistics.median(h for h, _ in healthy), 3),
              "healthy_cpu_s": round(statistics.median(c for _, c in healthy), 3)}
    if args.json:
        import json

        print(json.dumps(result))
        return 0
    print(f"load average {result['load_average_1m']} on {result['cpus']} CPUs; medians of {args.repeats} fresh "
          "processes after one warm-up")
    print(f"promptcache --version        {result['version_s']:6.3f} s  (imports torch: "
          f"{'yes' if result['version_imports_torch'] else 'no'})")
    print(f"sidecar healthy (defaults)   {result['healthy_s']:6.3f} s  ({result['healthy_cpu_s']:.2f} s of its CPU)")
    return 0
