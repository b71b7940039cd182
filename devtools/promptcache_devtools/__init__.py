"""Benchmarks, the fuzzer, the demo and the test-model helpers: tools around the product, not part of it."""
