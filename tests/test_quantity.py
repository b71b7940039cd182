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
