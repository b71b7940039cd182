"""The operator's one view of a cache's running sidecars, read by status and autoscaler alike.

Discovery: the cache's pods (one list call by the cache's labels). A pod bound to a node is a status entry; a ready
one with an IP is a sidecar to scrape and Resize, at the ports its sidecar container declares (`metrics`, `grpc`).

Scrape: each ready sidecar's /metrics once per observation, parsed with `prometheus_client.parser`. `Fleet.observe`
reuses an observation younger than `max_age_s`, so the status and the autoscaler of one tick read the same scrape.

The figures, defined here once (docs/operator.md, "Hit ratios"):

  lookup tokens        promptcache_hit_tokens_total (every tier) + promptcache_missed_tokens_total
  memory_hit_ratio     promptcache_hit_tokens_total{tier="device"} / lookup tokens: hits of the sidecar's own memory
                       tier, the tier the autoscaler sizes (a disk- or cluster-tier hit is a miss of that tier)
  any_tier_hit_ratio   promptcache_hit_tokens_total (every tier) / lookup tokens: prompt tokens served from any tier

status.hitRatio and status.anyTierHitRatio are these over the counters since each sidecar started (summed over the
nodes); the autoscaler's signal is memory_hit_ratio over its window (counter increases, from this module's scrape
history or from a Prometheus server's rate() of the same series).
"""
from __future__ import annotations

import http.client
import io
import json
import logging
import math
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families

from promptcache.contract.quantity import MAX_INT64

from . import builders
from .builders import Owner
from .kube import ApiError
from .model import quantity_bytes
from .tuning import Signal, sanitize

log = logging.getLogger("promptcache.operator")

MEMORY_TIER = "device"   # the tier label of the sidecar's memory tier (the others: disk, cluster)
HIT = "promptcache_hit_tokens_total"
MISS = "promptcache_missed_tokens_total"
MRC_HIT = "promptcache_mrc_hit_tokens_total"
MRC_LOOKUP = "promptcache_mrc_lookup_tokens_total"


# --- the figures ------------------------------------------------------------------------------------------------
def hit_ratio(hit_tokens: float, lookup_tokens: float) -> float | None:
    """None when nothing was looked up (no traffic is not a hit ratio of 0), or when the counts are not finite (a
    sidecar's nonsense is not a ratio); otherwise within [0, 1] (negative or excess hits are clamped)."""
    if not (math.isfinite(hit_tokens) and math.isfinite(lookup_tokens)) or lookup_tokens <= 0:
        return None
    return min(1.0, max(0.0, hit_tokens / lookup_tokens))


@dataclass(frozen=True)
class Tokens:
    """Looked-up prompt tokens and the hits among them: counts (one scrape), increases or rates."""

    memory_hits: float = 0.0
    any_tier_hits: float = 0.0
    lookups: float = 0.0

    @property
    def memory_hit_ratio(self) -> float | None:
        return hit_ratio(self.memory_hits, self.lookups)

    @property
    def any_tier_hit_ratio(self) -> float | None:
        return hit_ratio(self.any_tier_hits, self.lookups)

    def __add__(self, other: "Tokens") -> "Tokens":
        return Tokens(self.memory_hits + other.memory_hits, self.any_tier_hits + other.any_tier_hits,
                      self.lookups + other.lookups)


@dataclass(frozen=True)
class Counters:
    """One scrape of one sidecar. Evictions, bytes and budget are the memory tier's, except all_tiers_stored_bytes."""

    tokens: Tokens = Tokens()
    capacity_evictions: float = 0.0
    capacity_age_sum: float = 0.0
    capacity_age_count: float = 0.0
    stored_bytes: float = 0.0
    all_tiers_stored_bytes: float = 0.0
    budget_bytes: float = 0.0
    committed_bytes: float = 0.0
    mrc_hit_tokens: tuple[tuple[int, float], ...] = ()      # (capacity bytes, sampled hit tokens), by size
    mrc_lookup_tokens: tuple[tuple[int, float], ...] = ()   # (capacity bytes, sampled looked-up tokens)


# The sidecar exports the curve at a handful of sizes (11 by default, docs/sizing.md); an exposition with more is
# not taken as a curve (its work would be quadratic in them), nor are sizes that are not plain byte counts (int64).
MAX_MRC_SIZES = 64
MAX_MRC_SIZE = MAX_INT64   # a size is a byte count: an int64, as everywhere (promptcache.contract.quantity)
_SIZE = re.compile(r"[0-9]{1,19}")


def mrc_size(label: str | None) -> int | None:
    """A capacity_bytes label as a size: ASCII digits, positive and at most MAX_MRC_SIZE; else None."""
    if not label or not _SIZE.fullmatch(label):
        return None
    n = int(label)
    return n if 0 < n <= MAX_MRC_SIZE else None


def _mrc_points(points: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """A pod's curve points, by size: none when a sum is not finite or there are more than MAX_MRC_SIZES."""
    if len(points) > MAX_MRC_SIZES or not all(math.isfinite(x) for x in points.values()):
        return ()
    return tuple(sorted(points.items()))


def parse(text: str) -> Counters:
    """The series the operator reads, summed over their other labels (rpc). Raises ValueError on a malformed
    exposition. A sum that is not finite (samples that overflow together) is taken as absent (0), and the curve as
    absent when it is not finite or has more than MAX_MRC_SIZES sizes: every figure of a Counters is finite."""
    v = dict(memory_hits=0.0, any_tier_hits=0.0, misses=0.0, capacity_evictions=0.0, capacity_age_sum=0.0,
             capacity_age_count=0.0, stored_bytes=0.0, all_tiers_stored_bytes=0.0, budget_bytes=0.0,
             committed_bytes=0.0)
    mrc: dict[str, dict[int, float]] = {MRC_HIT: {}, MRC_LOOKUP: {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, x = s.name, s.labels, s.value
            if not math.isfinite(x):
                continue
            tier, capacity = labels.get("tier"), labels.get("reason") == "capacity"
            if name in mrc:
                size = mrc_size(labels.get("capacity_bytes"))
                if size is not None:
                    mrc[name][size] = mrc[name].get(size, 0.0) + x
            elif name == HIT:
                v["any_tier_hits"] += x
                if tier == MEMORY_TIER:
                    v["memory_hits"] += x
            elif name == MISS:
                v["misses"] += x
            elif name == "promptcache_stored_bytes":
                v["all_tiers_stored_bytes"] += x
                if tier == MEMORY_TIER:
                    v["stored_bytes"] += x
            elif name == "promptcache_evictions_total" and capacity and tier == MEMORY_TIER:
                v["capacity_evictions"] += x
            elif name == "promptcache_eviction_entry_age_seconds_sum" and capacity:   # (no tier label)
                v["capacity_age_sum"] += x
            elif name == "promptcache_eviction_entry_age_seconds_count" and capacity:
                v["capacity_age_count"] += x
            elif name == "promptcache_budget_bytes" and tier == MEMORY_TIER:
                v["budget_bytes"] += x
            elif name == "promptcache_committed_bytes" and tier == MEMORY_TIER:
                v["committed_bytes"] += x
    v = {k: x if math.isfinite(x) else 0.0 for k, x in v.items()}
    memory_hits, any_tier_hits, misses = v.pop("memory_hits"), v.pop("any_tier_hits"), v.pop("misses")
    lookups = any_tier_hits + misses
    mrc_hits, mrc_lookups = _mrc_points(mrc[MRC_HIT]), _mrc_points(mrc[MRC_LOOKUP])
    if not (mrc_hits and mrc_lookups):
        mrc_hits = mrc_lookups = ()
    return Counters(tokens=Tokens(memory_hits, any_tier_hits, lookups if math.isfinite(lookups) else 0.0), **v,
                    mrc_hit_tokens=mrc_hits, mrc_lookup_tokens=mrc_lookups)


def status_usage(counters: list[Counters]) -> dict[str, float | int]:
    """Status fields from one scrape of the ready sidecars: hitRatio (memory_hit_ratio) and anyTierHitRatio since
    each sidecar started, memoryBytes (bytes held over all nodes and tiers). Empty when no sidecar answered; a figure
    that is not finite (sums of hostile counters) is left out, so the status patch stays valid JSON."""
    if not counters:
        return {}
    tokens = sum((c.tokens for c in counters), Tokens())
    out: dict[str, float | int] = {}
    held = sum(c.all_tiers_stored_bytes for c in counters)
    if math.isfinite(held) and 0 <= held <= MAX_INT64:   # else unknown: the API server takes no Infinity (nor > int64)
        out["memoryBytes"] = int(held)
    for key, ratio in (("hitRatio", tokens.memory_hit_ratio), ("anyTierHitRatio", tokens.any_tier_hit_ratio)):
        if ratio is not None:   # finite and within [0, 1] (hit_ratio)
            out[key] = round(ratio, 4)
    return out


# --- rates and the autoscaler's signal ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PodRates:
    tokens: Tokens                  # per second
    capacity_evictions_per_s: float
    age_sum_per_s: float
    age_count_per_s: float
    stored_bytes: float
    budget_bytes: float
    mrc_hits_per_s: tuple[tuple[int, float], ...] = ()
    mrc_lookups_per_s: tuple[tuple[int, float], ...] = ()


def _curve(rates: list[PodRates]) -> tuple[tuple[int, float], ...] | None:
    """Predicted hit ratio per size, pooled over the pods that run the curve, at the sizes all of them report."""
    with_curve = [(dict(r.mrc_hits_per_s), dict(r.mrc_lookups_per_s)) for r in rates
                  if r.mrc_hits_per_s and r.mrc_lookups_per_s]   # each pod's dicts built once
    if not with_curve:
        return None
    sizes = set.intersection(*(set(h) & set(n) for h, n in with_curve))
    out = []
    for s in sorted(sizes):
        if not 0 < s <= MAX_MRC_SIZE:
            continue
        ratio = hit_ratio(sum(h[s] for h, _ in with_curve), sum(n[s] for _, n in with_curve))
        if ratio is not None:
            out.append((s, ratio))
    return tuple(out) or None


def aggregate(rates: list[PodRates]) -> Signal | None:
    """One Signal for the whole cache: memory_hit_ratio over all lookups, and the worst node's traffic, eviction
    rate and stored bytes; its figures finite (tuning.sanitize)."""
    if not rates:
        return None
    count = sum(r.age_count_per_s for r in rates)
    return sanitize(Signal(
        hit_ratio=sum((r.tokens for r in rates), Tokens()).memory_hit_ratio,
        lookup_tokens_per_s=max(r.tokens.lookups for r in rates),
        capacity_evictions_per_s=max(r.capacity_evictions_per_s for r in rates),
        eviction_age_s=sum(r.age_sum_per_s for r in rates) / count if count > 0 else None,
        stored_bytes=max(r.stored_bytes for r in rates),
        curve=_curve(rates),
    ))


def _delta(a: float, b: float) -> float:
    return b - a if b >= a else b  # counter reset: the process restarted and counts from zero


def rates(c0: Counters, c: Counters, dt: float) -> PodRates:
    """Per-second increases from scrape c0 to scrape c, dt seconds apart."""
    t0, t = c0.tokens, c.tokens
    hits0, lookups0 = dict(c0.mrc_hit_tokens), dict(c0.mrc_lookup_tokens)   # once, not per size
    return PodRates(
        tokens=Tokens(*(_delta(getattr(t0, f.name), getattr(t, f.name)) / dt for f in fields(Tokens))),
        capacity_evictions_per_s=_delta(c0.capacity_evictions, c.capacity_evictions) / dt,
        age_sum_per_s=_delta(c0.capacity_age_sum, c.capacity_age_sum) / dt,
        age_count_per_s=_delta(c0.capacity_age_count, c.capacity_age_count) / dt,
        stored_bytes=c.stored_bytes,
        budget_bytes=c.budget_bytes,
        mrc_hits_per_s=tuple((s, _delta(hits0.get(s, 0.0), h) / dt) for s, h in c.mrc_hit_tokens),
        mrc_lookups_per_s=tuple((s, _delta(lookups0.get(s, 0.0), n) / dt) for s, n in c.mrc_lookup_tokens),
    )


# --- discovery ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sidecar:
    """One cache pod bound to a node."""

    pod: str
    node: str
    ready: bool
    ip: str | None = None
    metrics_port: int = builders.METRICS_PORT
    grpc_port: int = builders.GRPC_PORT
    memory_limit: int | None = None   # the sidecar container's limit: the kubelet's report, else the pod spec's

    @property
    def host(self) -> str | None:
        return None if self.ip is None else f"[{self.ip}]" if ":" in self.ip else self.ip

    @property
    def grpc_target(self) -> str | None:
        """host:port of the gRPC server, for a ready sidecar (Resize)."""
        return f"{self.host}:{self.grpc_port}" if self.ready and self.ip else None

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.host}:{self.metrics_port}/metrics" if self.ready and self.ip else None

    def status_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"nodeName": self.node, "ready": self.ready}
        if self.ip:
            entry["endpoint"] = f"{self.host}:{self.grpc_port}"
        return entry


def _sidecar(pod: dict[str, Any]) -> Sidecar | None:
    spec, st = pod.get("spec") or {}, pod.get("status") or {}
    if not spec.get("nodeName"):
        return None
    container = next((c for c in spec.get("containers") or [] if c.get("name") == builders.CONTAINER), {})
    ports = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    limit = next((((cs.get("resources") or {}).get("limits") or {}).get("memory")
                  for cs in st.get("containerStatuses") or [] if cs.get("name") == builders.CONTAINER), None)
    limit = limit or ((container.get("resources") or {}).get("limits") or {}).get("memory")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    return Sidecar(pod=pod["metadata"]["name"], node=spec["nodeName"], ready=ready,
                   ip=st.get("podIP") or None, metrics_port=int(ports.get("metrics") or builders.METRICS_PORT),
                   grpc_port=int(ports.get("grpc") or builders.GRPC_PORT),
                   memory_limit=quantity_bytes(limit) if limit else None)


def discover(kube, owner: Owner) -> list[Sidecar] | None:
    """The cache's pods bound to a node, by node name; None when the API server refused the listing."""
    sel = ",".join(f"{k}={v}" for k, v in builders.selector(owner).items())
    try:
        pods = kube.request("GET", f"/api/v1/namespaces/{owner.namespace}/pods",
                            query=[("labelSelector", sel), ("limit", "1000")])
    except ApiError as exc:
        log.warning("listing pods of %s/%s: %s", owner.namespace, owner.name, exc)
        return None
    found = (_sidecar(p) for p in (pods or {}).get("items") or [])
    return sorted((s for s in found if s is not None), key=lambda s: (s.node, s.pod))


# A sidecar's /metrics is a few hundred KiB. Whatever answers on a pod's address is read at most this much, within
# the scrape's timeout in all: an endless or trickling answer cannot fill the operator's memory or hold its pool.
MAX_SCRAPE_BYTES = 16 << 20


def read_bounded(response, limit: int, deadline: float) -> bytes:
    """The body of `response`, refused (ValueError) past `limit` bytes or `deadline` (time.monotonic())."""
    read = getattr(response, "read1", response.read)  # one recv at a time: read(n) waits for n bytes of a trickle
    chunks, got = [], 0
    while True:
        piece = read(min(1 << 16, limit + 1 - got))
        if not piece:
            return b"".join(chunks)
        chunks.append(piece)
        got += len(piece)
        if got > limit:
            raise ValueError(f"answer larger than {limit} bytes")
        if time.monotonic() > deadline:
            raise ValueError("answer still arriving at the deadline")


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each with the socket timeout set to what is left before `deadline` (time.monotonic()):
    the status line, the headers and the body all fall within it, however slowly they trickle.

    It reads through a duplicate of the socket (socket.dup(), its own descriptor), closed when this reader closes:
    the connection stays open for the answer after http.client closes its own socket (a Connection: close answer
    hands the connection to the response), as socket.makefile() keeps it, without CPython's private counters."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock = sock.dup()
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        self._checkClosed()
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("scrape deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(b)

    def fileno(self) -> int:
        self._checkClosed()
        return self._sock.fileno()

    def close(self) -> None:
        if not self.closed:
            try:
                self._sock.close()
            finally:
                super().close()


class _DeadlineSocket:
    """A connected socket whose makefile() (what http.client reads the answer through) keeps to a deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str = "rb", *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _DeadlineConnection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int | None, deadline: float):
        super().__init__(host, port, timeout=max(0.001, deadline - time.monotonic()))
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self._deadline)


def scrape(url: str, timeout: float = 2.0) -> Counters | None:
    """One GET of a sidecar's /metrics, parsed; None when it fails. The whole exchange (connect, status line,
    headers, body) keeps to `timeout`; any answer but 200 is a failure (a redirect is not followed: the operator
    GETs no address but the pod's); no proxy is used."""
    deadline = time.monotonic() + timeout
    conn = r = None
    try:
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"not an http URL: {url!r}")
        conn = _DeadlineConnection(u.hostname, u.port, deadline)
        conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""),
                     headers={"Accept": "text/plain", "Accept-Encoding": "identity"})
        r = conn.getresponse()
        if r.status != 200:
            raise ValueError(f"HTTP {r.status} {r.reason}")
        return parse(read_bounded(r, MAX_SCRAPE_BYTES, deadline).decode("utf-8", "replace"))
    except (OSError, ValueError, http.client.HTTPException) as exc:
        log.debug("scraping %s: %s", url, exc)
        return None
    finally:
        if r is not None:   # its connection's descriptor (a Connection: close answer holds it past conn.close())
            r.close()
        if conn is not None:
            conn.close()


# --- one observation per tick -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    """A cache's sidecars and one scrape of each ready one."""

    namespace: str
    name: str
    time: float
    sidecars: tuple[Sidecar, ...]
    counters: dict[str, Counters]   # pod -> its scrape, for the ready sidecars that answered

    @property
    def ready(self) -> list[Sidecar]:
        return [s for s in self.sidecars if s.metrics_url]

    def nodes(self) -> list[dict[str, Any]]:
        return [s.status_entry() for s in self.sidecars]

    def usage(self) -> dict[str, float | int]:
        return status_usage([self.counters[s.pod] for s in self.sidecars if s.pod in self.counters])


@dataclass
class Fleet:
    """Observations of every cache, and the scrape history the autoscaler's rates come from (per cache and pod,
    `window_s` seconds of it). Also the autoscaler's default signal source (see `signal`)."""

    window_s: float = 300.0
    max_age_s: float = 5.0          # an observation younger than this is reused, not repeated
    timeout_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    scrape: Callable[[str, float], Counters | None] = scrape
    _latest: dict[tuple[str, str], Observation] = field(default_factory=dict)
    _history: dict[tuple[str, str, str], deque] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, kube, owner: Owner) -> Observation:
        key = (owner.namespace, owner.name)
        with self._lock:
            last = self._latest.get(key)
        if last is not None and self.clock() - last.time < self.max_age_s:
            return last
        sidecars = discover(kube, owner)
        if sidecars is None:   # the API server did not answer: nothing known, and the rates' history is kept
            return Observation(owner.namespace, owner.name, self.clock(), (), {})
        ready = [s for s in sidecars if s.metrics_url]
        got: list[Counters | None] = []
        if ready:
            with ThreadPoolExecutor(min(8, len(ready))) as pool:
                got = list(pool.map(self._scrape, ready))
        obs = Observation(owner.namespace, owner.name, self.clock(), tuple(sidecars),
                          {s.pod: c for s, c in zip(ready, got) if c is not None})
        self._record(obs)
        return obs

    def _scrape(self, sidecar: Sidecar) -> Counters | None:
        """One pod's scrape; whatever it raises is that pod's failure (None), never the observation's."""
        try:
            return self.scrape(sidecar.metrics_url, self.timeout_s)
        except Exception as exc:   # noqa: BLE001 - one pod must not stop the others' status and autoscaling
            log.warning("scraping %s: %r", sidecar.pod, exc)
            return None

    def latest(self, namespace: str, name: str) -> Observation | None:
        with self._lock:
            return self._latest.get((namespace, name))

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._latest.pop((namespace, name), None)
            for key in [k for k in self._history if k[:2] == (namespace, name)]:
                del self._history[key]

    def _record(self, obs: Observation) -> None:
        with self._lock:
            self._latest[(obs.namespace, obs.name)] = obs
            live = {s.pod for s in obs.ready}
            for key in [k for k in self._history if k[:2] == (obs.namespace, obs.name) and k[2] not in live]:
                del self._history[key]   # pod gone or not ready: its rates start over
            for pod, c in obs.counters.items():
                h = self._history.setdefault((obs.namespace, obs.name, pod), deque())
                h.append((obs.time, c))
                while len(h) > 2 and obs.time - h[1][0] >= self.window_s:
                    h.popleft()

    def signal(self, obs: Observation) -> tuple[Signal | None, dict[str, Counters]]:
        """The Signal over the window up to `obs` (None until two scrapes of some pod are `window_s`/10 apart),
        and the latest counters of each pod that answered."""
        pairs = []
        with self._lock:   # only the look-up of each pod's window under the operator-wide lock; the rates after
            for pod, c in obs.counters.items():
                h = self._history.get((obs.namespace, obs.name, pod)) or ()
                t0, c0 = h[0] if h else (obs.time, c)
                dt = obs.time - t0
                if dt > 0 and dt >= self.window_s / 10:
                    pairs.append((c0, c, dt))
        return aggregate([rates(c0, c, dt) for c0, c, dt in pairs]), dict(obs.counters)


# --- the same signal from a Prometheus server -----------------------------------------------------------------------
@dataclass
class PrometheusSource:
    """The autoscaler's signal from a Prometheus server's HTTP API: instant queries of rate() over `window_s`, the
    same figures as Fleet.signal computes from its own scrapes."""

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
            body = json.loads(read_bounded(r, 8 * MAX_SCRAPE_BYTES, time.monotonic() + 4 * self.timeout_s))
        if body.get("status") != "success":
            raise ValueError(f"Prometheus query failed: {body.get('error')}")
        return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]
                if math.isfinite(float(s["value"][1]))]

    def signal(self, obs: Observation) -> tuple[Signal | None, dict[str, Counters]]:
        sel = f'namespace="{obs.namespace}",service="{builders.metrics_name(obs.name)}"'
        mem = f'{sel},tier="{MEMORY_TIER}"'
        w = f"{int(self.window_s)}s"
        try:
            hits = self.query(f"sum by (pod) (rate({HIT}{{{sel}}}[{w}]))")
            memory_hits = self.query(f"sum by (pod) (rate({HIT}{{{mem}}}[{w}]))")
            misses = self.query(f"sum by (pod) (rate({MISS}{{{sel}}}[{w}]))")
            ev = self.query(f'sum by (pod) (rate(promptcache_evictions_total{{{mem},reason="capacity"}}[{w}]))')
            asum = self.query(f"sum by (pod) (rate(promptcache_eviction_entry_age_seconds_sum"
                              f'{{{sel},reason="capacity"}}[{w}]))')
            acnt = self.query(f"sum by (pod) (rate(promptcache_eviction_entry_age_seconds_count"
                              f'{{{sel},reason="capacity"}}[{w}]))')
            stored = self.query(f"sum by (pod) (promptcache_stored_bytes{{{mem}}})")
            budget = self.query(f"sum by (pod) (promptcache_budget_bytes{{{mem}}})")
            mrc: dict[str, dict[str, dict[int, float]]] = {MRC_HIT: {}, MRC_LOOKUP: {}}
            for metric in mrc:
                for labels, x in self.query_series(f"sum by (pod, capacity_bytes) (rate({metric}{{{sel}}}[{w}]))"):
                    size = mrc_size(labels.get("capacity_bytes"))
                    if size is not None:
                        mrc[metric].setdefault(labels.get("pod", ""), {})[size] = x
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            log.warning("Prometheus %s: %s", self.url, exc)
            return None, {}
        out = [PodRates(Tokens(memory_hits.get(p, 0.0), hits.get(p, 0.0), hits.get(p, 0.0) + misses.get(p, 0.0)),
                        ev.get(p, 0.0), asum.get(p, 0.0), acnt.get(p, 0.0), stored.get(p, 0.0), budget.get(p, 0.0),
                        _mrc_points(mrc[MRC_HIT].get(p, {})), _mrc_points(mrc[MRC_LOOKUP].get(p, {})))
               for p in sorted(set(hits) | set(misses))]
        latest = {p: Counters(stored_bytes=stored.get(p, 0.0), budget_bytes=budget.get(p, 0.0)) for p in budget}
        return aggregate(out), latest
