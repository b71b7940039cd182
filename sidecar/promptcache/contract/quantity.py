"""Kubernetes quantities ('512Mi', '4Gi', '1.5G', '100m', '12e3'), parsed exactly as the API server does:
decimal arithmetic, never float, so 12345678901234567891 stays 12345678901234567891.

The one parser for the sidecar's byte flags and the operator's spec fields (the operator image copies this file
next to its own package). Grammar (k8s.io/apimachinery resource.Quantity):
  <sign><digits>[.<digits>]<suffix>, suffix one of  Ki Mi Gi Ti Pi Ei | n u m "" k M G T P E | e<int> E<int>
"""
from __future__ import annotations

import re
from decimal import Decimal, localcontext

_QUANTITY = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}   # powers of 1024
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}  # powers of 10
EXAMPLES = "examples: 1073741824, 512Mi, 4Gi, 1.5G"
# The largest count or size anything here holds: int64, as the API's fields, the sidecar's flags and counters and a
# Kubernetes resource value (in quantities: 8Ei - 1).
MAX_INT64 = (1 << 63) - 1


def parse_quantity(text: str | int) -> Decimal:
    """'16Gi' -> Decimal(17179869184). Raises ValueError naming the text."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a Kubernetes quantity ({EXAMPLES})")
    if isinstance(text, int):
        return Decimal(text)
    s = str(text).strip()
    m = _QUANTITY.match(s)
    if not m or len(s) > 64:
        raise ValueError(f"{text!r} is not a Kubernetes quantity ({EXAMPLES})")
    sign, number, suffix = m.groups()
    with localcontext() as ctx:
        ctx.prec = 100  # exact for every quantity the API server accepts (at most 2^63 with 9 decimals)
        value = Decimal(number)
        if suffix in _BINARY:
            value *= Decimal(1024) ** _BINARY[suffix]
        elif suffix in _DECIMAL:
            value = value.scaleb(_DECIMAL[suffix])
        elif suffix:  # e / E exponent
            exponent = int(suffix[1:])
            if abs(exponent) > 64:
                raise ValueError(f"{text!r}: exponent out of range")
            value = value.scaleb(exponent)
        return -value if sign == "-" else value


def parse_bytes(text: str | int, what: str = "byte size") -> int:
    """A non-negative whole number of bytes. A fraction is rounded up, as Kubernetes does for resource values
    ('100m' bytes is 1 byte)."""
    value = parse_quantity(text)
    if value < 0:
        raise ValueError(f"{what} {text!r} is negative")
    return int(value.to_integral_value(rounding="ROUND_CEILING"))
