"""promptcache.contract.quantity: the one Kubernetes-quantity parser of the sidecar and the operator, exact (decimal)."""
from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from promptcache.operator.model import SpecError, quantity_bytes
from promptcache.contract.quantity import parse_bytes, parse_quantity
from promptcache.sidecar import config


@pytest.mark.parametrize("text", ["128974848", "129e6", "129M", "128974848000m", "123Mi"])
def test_kubernetes_documentation_examples(text):
    """The memory examples of the Kubernetes docs ('Resource units in Kubernetes') are all about 129 MB."""
    assert abs(parse_quantity(text) - Decimal(128974848)) < Decimal(10) ** 6 * 2


@pytest.mark.parametrize("text, value", [
    ("12345678901234567891", 12345678901234567891),  # a float would give ...7168
    ("1Ei", 2**60), ("8Ei", 2**63), ("1.5Gi", 3 * 2**29), ("0.5Ki", 512), ("1k", 1000), ("2E", 2 * 10**18),
    ("1e3", 1000), ("1E3", 1000), ("5e-1", Decimal("0.5")), ("100m", Decimal("0.1")), ("250u", Decimal("0.00025")),
    ("3n", Decimal("3e-9")), ("+4", 4), (".5", Decimal("0.5")), ("7.", 7), (" 512Mi ", 512 * 2**20), (42, 42),
])
def test_exact_values(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1.2.3", "1K", "1 Gi", "1gi", "0x10", "1e", "1Gi2", "--1", "nan",
                                  "inf", "1e999", True])
def test_malformed_quantities_are_refused_with_the_text(text):
    with pytest.raises(ValueError, match="quantity|exponent"):
        parse_quantity(text)


def test_bytes_round_fractions_up_and_refuse_negatives():
    assert parse_bytes("100m") == 1 and parse_bytes("1.0000001Ki") == 1025 and parse_bytes("0") == 0
    with pytest.raises(ValueError, match="negative"):
        parse_bytes("-1Mi")


@given(st.integers(0, 2**40), st.sampled_from(["", "k", "M", "G", "T", "P", "E"]))
def test_decimal_suffixes(n, suffix):
    power = {"": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}[suffix]
    assert parse_bytes(f"{n}{suffix}") == n * 10**power


@given(st.integers(0, 2**40), st.sampled_from(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]))
def test_binary_suffixes(n, suffix):
    power = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"].index(suffix) + 1
    assert parse_bytes(f"{n}{suffix}") == n * 1024**power


def test_sidecar_and_operator_agree():
    """The sidecar's flags and the operator's spec fields read a quantity the same way."""
    for text in ("12345678901234567891", "1.5Gi", "129e6", "100m", "64Mi"):
        assert config.parse_bytes(text) == quantity_bytes(text) == parse_bytes(text)
    with pytest.raises(SpecError, match="not a Kubernetes quantity"):
        quantity_bytes("lots")


def test_quantities_above_what_the_process_can_hold_are_refused_at_start(tmp_path):
    """Issue 27 #5: --memory-bytes 100Ei (above 2^64) was accepted; Stats then answered INTERNAL (Value out of
    range) and a Resize was applied but answered INTERNAL. Now a start with any quantity above 2^63-1 exits 2
    with one line naming the flag (or variable), and the largest accepted values answer Stats and Resize."""
    import os
    import subprocess
    import sys

    for argv, env, name in ((["--memory-bytes", "100Ei"], {}, "--memory-bytes"),
                            (["--disk-bytes", "8Ei"], {}, "--disk-bytes"),
                            ([], {"PROMPTCACHE_SHM_MAX_BYTES": "1e30"}, "--shm-max-bytes")):
        out = subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", "127.0.0.1:0",
                              "--metrics-port", "0", *argv], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
        lines = (out.stdout + out.stderr).strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (argv, env, out.stdout[-2000:], out.stderr[-2000:])
        assert name in lines[0] and "more than this process can hold" in lines[0], lines[0]
    assert config.Settings(memory_bytes=2**63 - 1).validate().memory_bytes == 2**63 - 1


def test_stats_and_resize_answer_for_the_largest_budgets(sidecar_factory):
    from promptcache.client import PromptCacheClient, errors

    sidecar = sidecar_factory(memory_bytes=2**62)
    with PromptCacheClient(sidecar.address, timeout=10) as c:
        assert c.stats().tiers[0].bytes_budget == 2**62
        try:
            r = c.resize(2**63 - 1)
            assert r.memory_bytes == 2**63 - 1 and r.previous_bytes == 2**62
            assert c.stats().tiers[0].bytes_budget == 2**63 - 1
        except errors.PromptCacheError as exc:  # a cgroup memory limit refuses it: never INTERNAL
            assert "INTERNAL" not in str(exc) and "cgroup" in str(exc), exc
