"""Read the sidecars' Prometheus endpoints for the PromptCache status (hit ratio, memory in use).

Only the few series the status needs are parsed, from the text exposition format, so the operator image needs no
Prometheus client library.
"""
from __future__ import annotations

import logging
import math
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("promptcache.operator")

HIT = "promptcache_hit_tokens_total"
MISS = "promptcache_missed_tokens_total"
STORED = "promptcache_stored_bytes"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class Sample:
    hit_tokens: float = 0.0
    missed_tokens: float = 0.0
    stored_bytes: float = 0.0


def parse(text: str) -> Sample:
    """Sum the series over all labels (tiers, rpcs)."""
    sums = {HIT: 0.0, MISS: 0.0, STORED: 0.0}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m or m.group(1) not in sums:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(v):
            sums[m.group(1)] += v
    return Sample(sums[HIT], sums[MISS], sums[STORED])


def scrape(url: str, timeout: float = 2.0) -> Sample | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - pod IPs from the API server
            return parse(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError) as exc:
        log.debug("scraping %s: %s", url, exc)
        return None


def summarize(samples: list[Sample | None]) -> dict[str, float | int]:
    """Status fields from the per-node samples: hitRatio (cumulative since each sidecar started) and
    memoryBytes (bytes held over all nodes and tiers). Empty when nothing could be read."""
    got = [s for s in samples if s is not None]
    if not got:
        return {}
    hits = sum(s.hit_tokens for s in got)
    total = hits + sum(s.missed_tokens for s in got)
    out: dict[str, float | int] = {"memoryBytes": int(sum(s.stored_bytes for s in got))}
    if total > 0:
        out["hitRatio"] = round(hits / total, 4)
    return out


def scrape_all(urls: list[str], timeout: float = 2.0) -> list[Sample | None]:
    if not urls:
        return []
    with ThreadPoolExecutor(min(8, len(urls))) as pool:
        return list(pool.map(lambda u: scrape(u, timeout), urls))
