"""Where the autoscaler's signal comes from: each sidecar's hit/miss tokens, capacity evictions and their age.

Sidecars are found through the EndpointSlices of the cache's Services (the metrics Service `<name>-metrics`, port
`metrics`, and the node-local Service `<name>`, port `grpc`, joined by pod): ready endpoints only. Two sources:

* `ScrapeSource` (default): reads each sidecar's /metrics and turns the counters into rates over a sliding window,
  from the samples it keeps between ticks (counter resets, i.e. sidecar restarts, count from zero as in Prometheus).
* `PrometheusSource` (when PROMPTCACHE_OPERATOR_PROMETHEUS_URL is set): asks a Prometheus server's HTTP API for the
  same rates over the same window, per pod.

Both return a `tuning.Signal` aggregated over the nodes (one memory target per PromptCache): the hit ratio over all
lookups, and the worst node's traffic, eviction rate and stored bytes; and, where the sidecars run the miss-ratio
curve (promptcache_mrc_hit_tokens_total and promptcache_mrc_lookup_tokens_total, by capacity_bytes), the predicted
hit ratio per cache size over the same window, pooled over the nodes at the sizes they all report.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .tuning import Signal

log = logging.getLogger("promptcache.operator")

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Endpoint:
    """One ready sidecar behind the cache's Services."""

    pod: str
    address: str
    metrics_url: str | None = None
    grpc_target: str | None = None   # host:port of the sidecar's gRPC server (for Resize)


@dataclass(frozen=True)
class Counters:
    """One scrape of one sidecar (memory tier only: tier!="disk")."""

    hit_tokens: float = 0.0
    missed_tokens: float = 0.0
    capacity_evictions: float = 0.0
    capacity_age_sum: float = 0.0
    capacity_age_count: float = 0.0
    stored_bytes: float = 0.0
    budget_bytes: float = 0.0
    committed_bytes: float = 0.0
    mrc_hit_tokens: tuple[tuple[int, float], ...] = ()      # (capacity bytes, sampled hit tokens), by size
    mrc_lookup_tokens: tuple[tuple[int, float], ...] = ()   # (capacity bytes, sampled looked-up tokens)


@dataclass(frozen=True)
class PodRates:
    hit_tokens_per_s: float
    missed_tokens_per_s: float
    capacity_evictions_per_s: float
    age_sum_per_s: float
    age_count_per_s: float
    stored_bytes: float
    budget_bytes: float
    mrc_hits_per_s: tuple[tuple[int, float], ...] = ()
    mrc_lookups_per_s: tuple[tuple[int, float], ...] = ()


def parse(text: str) -> Counters:
    v = dict(hit_tokens=0.0, missed_tokens=0.0, capacity_evictions=0.0, capacity_age_sum=0.0,
             capacity_age_count=0.0, stored_bytes=0.0, budget_bytes=0.0, committed_bytes=0.0)
    mrc: dict[str, dict[int, float]] = {"promptcache_mrc_hit_tokens_total": {},
                                        "promptcache_mrc_lookup_tokens_total": {}}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, raw_labels, raw = m.groups()
        try:
            x = float(raw)
        except ValueError:
            continue
        if not math.isfinite(x):
            continue
        labels = dict(_LABEL.findall(raw_labels or ""))
        if name in mrc:
            if labels.get("capacity_bytes", "").isdigit():
                by_size = mrc[name]
                size = int(labels["capacity_bytes"])
                by_size[size] = by_size.get(size, 0.0) + x
            continue
        if name == "promptcache_hit_tokens_total":
            # A hit in the disk tier is a miss of the memory tier, which is what the autoscaler sizes.
            v["missed_tokens" if labels.get("tier") == "disk" else "hit_tokens"] += x
            continue
        if labels.get("tier") == "disk":
            continue
        elif name == "promptcache_missed_tokens_total":
            v["missed_tokens"] += x
        elif name == "promptcache_evictions_total" and labels.get("reason") == "capacity":
            v["capacity_evictions"] += x
        elif name == "promptcache_eviction_entry_age_seconds_sum" and labels.get("reason") == "capacity":
            v["capacity_age_sum"] += x
        elif name == "promptcache_eviction_entry_age_seconds_count" and labels.get("reason") == "capacity":
            v["capacity_age_count"] += x
        elif name == "promptcache_stored_bytes":
            v["stored_bytes"] += x
        elif name == "promptcache_budget_bytes":
            v["budget_bytes"] += x
        elif name == "promptcache_committed_bytes":
            v["committed_bytes"] += x
    return Counters(**v, mrc_hit_tokens=tuple(sorted(mrc["promptcache_mrc_hit_tokens_total"].items())),
                    mrc_lookup_tokens=tuple(sorted(mrc["promptcache_mrc_lookup_tokens_total"].items())))


def _curve(rates: list[PodRates]) -> tuple[tuple[int, float], ...] | None:
    """Predicted hit ratio per size, pooled over the pods that run the curve, at the sizes all of them report."""
    with_curve = [r for r in rates if r.mrc_hits_per_s and r.mrc_lookups_per_s]
    if not with_curve:
        return None
    sizes = set.intersection(*(set(dict(r.mrc_hits_per_s)) & set(dict(r.mrc_lookups_per_s)) for r in with_curve))
    out = []
    for s in sorted(sizes):
        lookups = sum(dict(r.mrc_lookups_per_s)[s] for r in with_curve)
        if lookups > 0:
            out.append((s, min(1.0, sum(dict(r.mrc_hits_per_s)[s] for r in with_curve) / lookups)))
    return tuple(out) or None


def aggregate(rates: list[PodRates]) -> Signal | None:
    """One Signal for the whole cache (see the module docstring)."""
    if not rates:
        return None
    hits = sum(r.hit_tokens_per_s for r in rates)
    total = hits + sum(r.missed_tokens_per_s for r in rates)
    count = sum(r.age_count_per_s for r in rates)
    return Signal(
        hit_ratio=hits / total if total > 0 else None,
        lookup_tokens_per_s=max(r.hit_tokens_per_s + r.missed_tokens_per_s for r in rates),
        capacity_evictions_per_s=max(r.capacity_evictions_per_s for r in rates),
        eviction_age_s=sum(r.age_sum_per_s for r in rates) / count if count > 0 else None,
        stored_bytes=max(r.stored_bytes for r in rates),
        curve=_curve(rates),
    )


# --- endpoints ----------------------------------------------------------------------------------------------------
def _slice_endpoints(kube, namespace: str, service: str, port_name: str) -> dict[str, tuple[str, str, int]]:
    """pod (or address) -> (pod, address, port) of the ready endpoints of one Service."""
    got = kube.request("GET", f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                       query=[("labelSelector", f"kubernetes.io/service-name={service}")])
    out: dict[str, tuple[str, str, int]] = {}
    for sl in got.get("items") or []:
        port = next((p.get("port") for p in sl.get("ports") or [] if p.get("name") == port_name), None)
        if not port:
            continue
        for ep in sl.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
                continue
            addr = ep["addresses"][0]
            pod = (ep.get("targetRef") or {}).get("name") or addr
            out[pod] = (pod, addr, int(port))
    return out


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def endpoints(kube, namespace: str, name: str, address_map: dict[str, str] | None = None) -> list[Endpoint]:
    """The ready sidecars of a cache. `address_map` rewrites endpoint addresses before they are dialled: a test
    hook (the API server refuses loopback addresses in EndpointSlices, so a test stands a documentation address
    in for the local sidecar); empty in production."""
    amap = address_map or {}
    metrics = {k: (p, amap.get(a, a), port)
               for k, (p, a, port) in _slice_endpoints(kube, namespace, f"{name}-metrics", "metrics").items()}
    grpc = {k: (p, amap.get(a, a), port) for k, (p, a, port) in _slice_endpoints(kube, namespace, name, "grpc").items()}
    out = []
    for pod in sorted(set(metrics) | set(grpc)):
        m, g = metrics.get(pod), grpc.get(pod)
        addr = (m or g)[1]
        out.append(Endpoint(pod=pod, address=addr,
                            metrics_url=f"http://{_hostport(m[1], m[2])}/metrics" if m else None,
                            grpc_target=_hostport(g[1], g[2]) if g else None))
    return out


# --- sources --------------------------------------------------------------------------------------------------------
def scrape(url: str, timeout: float = 2.0) -> Counters | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - endpoint IPs from the API server
            return parse(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError) as exc:
        log.debug("scraping %s: %s", url, exc)
        return None


@dataclass
class ScrapeSource:
    """Rates from successive scrapes, kept per (cache, pod) for `window_s` seconds."""

    window_s: float = 300.0
    timeout_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    _history: dict[tuple[str, str], deque] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    last: dict[str, Counters] = field(default_factory=dict)   # latest scrape per pod (for budget checks)

    def signal(self, cache: str, eps: list[Endpoint]) -> tuple[Signal | None, dict[str, Counters]]:
        """The Signal over the window (None until two scrapes of some pod are `window_s`/10 apart), and the latest
        counters of each pod that answered."""
        eps = [e for e in eps if e.metrics_url]
        if not eps:
            return None, {}
        with ThreadPoolExecutor(min(8, len(eps))) as pool:
            got = list(pool.map(lambda e: scrape(e.metrics_url, self.timeout_s), eps))
        now = self.clock()
        rates, latest = [], {}
        with self._lock:
            live = {(cache, e.pod) for e in eps}
            for key in [k for k in self._history if k[0] == cache and k not in live]:
                del self._history[key]   # pod gone
            for e, c in zip(eps, got):
                if c is None:
                    continue
                latest[e.pod] = c
                h = self._history.setdefault((cache, e.pod), deque())
                h.append((now, c))
                while len(h) > 2 and now - h[1][0] >= self.window_s:
                    h.popleft()
                t0, c0 = h[0]
                dt = now - t0
                if dt < self.window_s / 10 or dt <= 0:
                    continue
                rates.append(_rates(c0, c, dt))
        self.last.update(latest)
        return aggregate(rates), latest


def _delta(a: float, b: float) -> float:
    return b - a if b >= a else b  # counter reset: the process restarted and counts from zero


def _rates(c0: Counters, c: Counters, dt: float) -> PodRates:
    return PodRates(
        hit_tokens_per_s=_delta(c0.hit_tokens, c.hit_tokens) / dt,
        missed_tokens_per_s=_delta(c0.missed_tokens, c.missed_tokens) / dt,
        capacity_evictions_per_s=_delta(c0.capacity_evictions, c.capacity_evictions) / dt,
        age_sum_per_s=_delta(c0.capacity_age_sum, c.capacity_age_sum) / dt,
        age_count_per_s=_delta(c0.capacity_age_count, c.capacity_age_count) / dt,
        stored_bytes=c.stored_bytes,
        budget_bytes=c.budget_bytes,
        mrc_hits_per_s=tuple((s, _delta(dict(c0.mrc_hit_tokens).get(s, 0.0), h) / dt) for s, h in c.mrc_hit_tokens),
        mrc_lookups_per_s=tuple((s, _delta(dict(c0.mrc_lookup_tokens).get(s, 0.0), n) / dt)
                                for s, n in c.mrc_lookup_tokens),
    )


@dataclass
class PrometheusSource:
    """Rates from a Prometheus server's HTTP API (instant queries of rate() over `window_s`)."""

    url: str
    window_s: float = 300.0
    timeout_s: float = 5.0

    def query(self, promql: str) -> dict[str, float]:
        """pod -> value of an instant query."""
        return {labels.get("pod", ""): v for labels, v in self.query_series(promql)}

    def query_series(self, promql: str) -> list[tuple[dict[str, str], float]]:
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url.rstrip('/')}/api/v1/query?{q}",  # noqa: S310 - configured URL
                                    timeout=self.timeout_s) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise ValueError(f"Prometheus query failed: {body.get('error')}")
        return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]
                if math.isfinite(float(s["value"][1]))]

    def signal(self, cache: str, eps: list[Endpoint]) -> tuple[Signal | None, dict[str, Counters]]:
        namespace, name = cache.split("/", 1)
        sel = f'namespace="{namespace}",service="{name}-metrics",tier!="disk"'
        sel_no_tier = f'namespace="{namespace}",service="{name}-metrics"'
        w = f"{int(self.window_s)}s"
        try:
            hit = self.query(f"sum by (pod) (rate(promptcache_hit_tokens_total{{{sel}}}[{w}]))")
            # disk-tier hits are misses of the memory tier (see parse)
            miss = self.query(f"sum by (pod) (rate(promptcache_missed_tokens_total{{{sel_no_tier}}}[{w}])) + "
                              f"sum by (pod) (rate(promptcache_hit_tokens_total{{{sel_no_tier},tier=\"disk\"}}[{w}]) "
                              f"or rate(promptcache_missed_tokens_total{{{sel_no_tier}}}[{w}]) * 0)")
            ev = self.query(f'sum by (pod) (rate(promptcache_evictions_total{{{sel},reason="capacity"}}[{w}]))')
            asum = self.query(f"sum by (pod) (rate(promptcache_eviction_entry_age_seconds_sum"
                              f'{{{sel_no_tier},reason="capacity"}}[{w}]))')
            acnt = self.query(f"sum by (pod) (rate(promptcache_eviction_entry_age_seconds_count"
                              f'{{{sel_no_tier},reason="capacity"}}[{w}]))')
            stored = self.query(f"sum by (pod) (promptcache_stored_bytes{{{sel}}})")
            budget = self.query(f"sum by (pod) (promptcache_budget_bytes{{{sel}}})")
            mrc: dict[str, dict[str, dict[int, float]]] = {}
            for metric in ("promptcache_mrc_hit_tokens_total", "promptcache_mrc_lookup_tokens_total"):
                for labels, x in self.query_series(f"sum by (pod, capacity_bytes) "
                                                   f"(rate({metric}{{{sel_no_tier}}}[{w}]))"):
                    if labels.get("capacity_bytes", "").isdigit():
                        mrc.setdefault(metric, {}).setdefault(labels.get("pod", ""), {})[
                            int(labels["capacity_bytes"])] = x
        except (OSError, ValueError, KeyError) as exc:
            log.warning("Prometheus %s: %s", self.url, exc)
            return None, {}
        pods = set(hit) | set(miss)
        rates = [PodRates(hit.get(p, 0.0), miss.get(p, 0.0), ev.get(p, 0.0), asum.get(p, 0.0), acnt.get(p, 0.0),
                          stored.get(p, 0.0), budget.get(p, 0.0),
                          tuple(sorted(mrc.get("promptcache_mrc_hit_tokens_total", {}).get(p, {}).items())),
                          tuple(sorted(mrc.get("promptcache_mrc_lookup_tokens_total", {}).get(p, {}).items())))
                 for p in sorted(pods)]
        latest = {p: Counters(stored_bytes=stored.get(p, 0.0), budget_bytes=budget.get(p, 0.0)) for p in budget}
        return aggregate(rates), latest


def source_from_env(env: dict[str, str], window_s: float) -> Any:
    url = env.get("PROMPTCACHE_OPERATOR_PROMETHEUS_URL")
    return PrometheusSource(url, window_s) if url else ScrapeSource(window_s)
