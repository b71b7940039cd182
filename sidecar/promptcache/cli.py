"""`promptcache` command: serve | bench NAME | operator | stats | lookup | purge | resize | top."""
from __future__ import annotations

import argparse
import gc
import importlib
import sys

# Sub-benchmarks: name -> (module with add_arguments(parser) and run(args) -> int, the first line of its docstring).
# The benchmarks are not part of this package: they are promptcache_devtools, the promptcache-devtools distribution
# (devtools/ in the repository; `make venv` installs it). Only the benchmark a command names is imported (most
# import torch: seconds), so `promptcache --help`, `bench --help`, `--version` and the admin commands start in a
# fraction of a second and work without it; tests/test_startup.py checks that these help lines are the modules' own.
DEVTOOLS = "promptcache_devtools"
DEVTOOLS_MISSING = ("promptcache bench: the benchmarks are in the promptcache-devtools package ({module}), which is "
                    "not installed; install it from a checkout with `pip install -e devtools/` (or `make venv`)")
BENCHES = {
    "throughput": ("promptcache_devtools.bench.throughput",
                   "Put/Get throughput of 1, 8 and 64 MB prefixes over TCP and a unix socket (gRPC, shared memory, "
                   "and the bulk"),
    "latency": ("promptcache_devtools.bench.latency",
                "Where the time of one Get goes: gRPC's fixed cost, and a 1 MiB bulk-channel Get alone and between "
                "Redis GETs."),
    "replay": ("promptcache_devtools.bench.replay",
               "Replay a Mooncake-format trace against the eviction policies; token hit ratio beside OPT and "
               "infinite."),
    "cluster": ("promptcache_devtools.bench.cluster",
                "Fleet-wide token hit ratio of N node caches, with and without the cluster tier, requests routed at "
                "random or"),
    "fidelity": ("promptcache_devtools.bench.fidelity",
                 "fidelity: cached-prefix reuse vs full prefill per quantization mode, on SmolLM2-135M over real "
                 "text, per text."),
    "ttft": ("promptcache_devtools.bench.ttft",
             "ttft: time to first token with and without prefix reuse, on SmolLM2-135M over real English text."),
    "loadtest": ("promptcache_devtools.bench.loadtest",
                 "Load test: N concurrent clients, mixed lookup/get/put, for a bounded time; throughput, p50/p99, "
                 "errors."),
    "vllm": ("promptcache_devtools.bench.vllm",
             "vllm: vLLM (CPU backend) TTFT and throughput with and without PromptCacheConnector, and vLLM's own "
             "prefix cache."),
    "startup": ("promptcache_devtools.bench.startup",
                "startup: `promptcache --version` and a default sidecar's time to healthy, in fresh processes."),
    "loadpath": ("promptcache_devtools.bench.loadpath",
                 "loadpath: the vLLM connector's load path in GB/s, next to memcpy of the same bytes in the same "
                 "run; no vLLM needed."),
    "paged": ("promptcache_devtools.bench.paged",
              "paged: the connector's worker-side save and load on vLLM's paged KV views (CUDA layouts) in GB/s, next "
              "to a pinned-memory copy; torch alone."),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("promptcache")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def build_parser(bench: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; of the benchmarks only `bench` (the one a command names) is imported and gets its
    flags, the others are listed by name and help line."""
    from promptcache import admin
    from promptcache.sidecar import config

    parser = argparse.ArgumentParser(prog="promptcache", description="Prompt-prefix KV cache for LLM inference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the node-local cache sidecar",
                           description=config.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_arguments(serve)
    bench_parser = sub.add_parser("bench", help="run a benchmark (needs promptcache-devtools)",
                                  description="Benchmarks, from the promptcache-devtools package (pip install -e "
                                              "devtools/ in a checkout, or make venv).")
    bench_sub = bench_parser.add_subparsers(dest="bench", required=True)
    for name, (module_name, help_line) in BENCHES.items():
        if name != bench:
            bench_sub.add_parser(name, help=help_line)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        p = bench_sub.add_parser(name, help=help_line, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(bench_run=module.run)
    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf)", add_help=False)
    op.add_argument("operator_args", nargs=argparse.REMAINDER)
    admin.add_arguments(sub)
    from promptcache.sidecar import snapshot

    snapshot.add_arguments(sub)
    return parser


def _named_bench(argv: list[str]) -> str | None:
    """The benchmark `promptcache bench NAME ...` names, if any (the word after `bench` that is one)."""
    if argv[:1] != ["bench"]:
        return None
    return next((a for a in argv[1:] if not a.startswith("-")), None)


def devtools_installed() -> bool:
    """Is promptcache_devtools importable (its top-level package only: a one-line module)?"""
    try:
        importlib.import_module(DEVTOOLS)
    except ModuleNotFoundError as exc:
        if exc.name != DEVTOOLS:
            raise
        return False
    return True


class _EarlySignals:
    """SIGTERM/SIGINT from the first moment of `promptcache serve` (before torch and the sidecar are imported:
    seconds), only recorded; promptcache.sidecar.app.StartupSignals takes over once imported, and start-up stops
    cleanly at its next step (exit 0) instead of dying with 143 half-way (Kubernetes stops pods while they start)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def install(self) -> "_EarlySignals":
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.received.append(signum))
        return self


def _serve(args, early: _EarlySignals) -> int:
    import signal

    if early.received:  # nothing imported or opened yet
        print(f"promptcache serve: {signal.Signals(early.received[0]).name} before start-up; exiting",
              file=sys.stderr, flush=True)
        return 0
    from promptcache.sidecar import app  # imports torch: seconds

    # What the imports made (about 190,000 objects: torch, grpc, numpy) lives as long as the process: out of the
    # garbage collector's sight, so that its full collections, which stop every thread, scan only what serving makes
    # (an idle sidecar's took 72 ms; docs/operating.md, "Garbage collection pauses").
    gc.collect()
    gc.freeze()
    signals = app.StartupSignals().install()
    if early.received:  # what came while importing
        signals._handle(early.received[0], None)
    return app.serve_from_args(args, signals)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    early = _EarlySignals().install() if argv[:1] == ["serve"] else None
    if argv[:1] == ["operator"]:
        from promptcache.operator.__main__ import main as operator_main

        return operator_main(argv[1:])
    if argv == ["--version"]:  # the parser below is cheap too; this answers before anything else is imported
        print(f"promptcache {version()}")
        return 0
    bench = _named_bench(argv)
    if bench in BENCHES and not devtools_installed():
        print(DEVTOOLS_MISSING.format(module=DEVTOOLS), file=sys.stderr)
        return 2
    args = build_parser(bench).parse_args(argv)
    if args.command == "serve":
        return _serve(args, early or _EarlySignals().install())
    if args.command == "bench":
        return args.bench_run(args)
    return args.admin_run(args)


if __name__ == "__main__":
    sys.exit(main())
