"""`promptcache` command: serve | bench NAME | operator | stats | lookup | purge | resize | top."""
from __future__ import annotations

import argparse
import importlib
import sys

# Sub-benchmarks: name -> module with add_arguments(parser) and run(args) -> int.
BENCHES = {
    "throughput": "promptcache.devtools.bench.throughput",
    "latency": "promptcache.devtools.bench.latency",
    "replay": "promptcache.devtools.bench.replay",
    "cluster": "promptcache.devtools.bench.cluster",
    "fidelity": "promptcache.devtools.bench.fidelity",
    "ttft": "promptcache.devtools.bench.ttft",
    "loadtest": "promptcache.devtools.bench.loadtest",
    "vllm": "promptcache.devtools.bench.vllm",
    "loadpath": "promptcache.devtools.bench.loadpath",
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("promptcache")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from promptcache import admin
    from promptcache.sidecar import config

    parser = argparse.ArgumentParser(prog="promptcache", description="Prompt-prefix KV cache for LLM inference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the node-local cache sidecar",
                           description=config.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_arguments(serve)
    bench = sub.add_parser("bench", help="run a benchmark")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(bench_run=module.run)
    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf)", add_help=False)
    op.add_argument("operator_args", nargs=argparse.REMAINDER)
    admin.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["operator"]:
        from promptcache.operator.__main__ import main as operator_main

        return operator_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from promptcache.sidecar import app

        return app.serve_from_args(args)
    if args.command == "bench":
        return args.bench_run(args)
    return args.admin_run(args)


if __name__ == "__main__":
    sys.exit(main())
