"""Benchmarks, run by `promptcache bench NAME` (make bench). Each module has add_arguments(parser) and
run(args) -> int, and keeps its heavy imports inside run() so `promptcache --help` stays fast."""
